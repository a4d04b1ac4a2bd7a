"""Printing ``turns.py``'s results as ratios, a markdown table and three plots."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

NAMES = {
    "ours": "ours",
    "floor2": "floor, 2 commits",
    "floor3": "floor, 3 commits",
    "langgraph": "LangGraph",
    "dbos": "DBOS",
}
TARGET_FLOOR = {"sqlite-full": 1.5, "sqlite-normal": 3.0, "postgres": 1.3}


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.2f} ms"


def _ratio(values: list[float]) -> str:
    mid = statistics.median(values)
    if len(values) == 1:
        return f"{mid:.2f}\u00d7"
    return f"{mid:.2f}\u00d7 ({min(values):.2f}\u2013{max(values):.2f})"


def _ratios(res: Any, config: str, top: str, bottom: str) -> list[float] | None:
    """Per rep: ``top``/``bottom`` where each is "who" (its own turns) or "who:floorN".

    A framework against ours compares each one's ratio to its own interleaved floor, so
    the machine's drift between the two runs cancels too."""
    row = res.per_turn.get(config, {})
    if top == "ours" and bottom.startswith("floor"):
        reps = row.get("ours", [])
        if not reps or bottom not in reps[0]:
            return None
        return [r["own"] / r[bottom] for r in reps]
    if top not in row or bottom not in row:
        return None
    return [
        a["own"] / a["floor2"] / (b["own"] / b["floor2"])
        for a, b in zip(row[top], row[bottom], strict=True)
    ]


def _window(seconds: list[float], centre: int, half: int = 10) -> float:
    lo, hi = max(2, centre - half), min(len(seconds), centre + half)
    return statistics.median(seconds[lo:hi])


def flatness(seconds: list[float]) -> tuple[float, float, float]:
    early = _window(seconds, 10, 5)
    late = statistics.median(seconds[-20:])
    return early, late, late / early


def rows(res: Any, profile: Any) -> list[tuple[str, list[list[str]], list[str]]]:
    """(title, table rows, header) for each section."""
    out = []
    header = [
        "backend",
        "ours per turn",
        "floor 2 / 3 per turn",
        "ours / floor 2",
        "ours / floor 3",
        "LangGraph / ours",
        "DBOS / ours",
        "target (ours / floor)",
    ]
    table = []
    for config, row in res.per_turn.items():
        ours = statistics.median(r["own"] for r in row["ours"])
        floors = [
            statistics.median(r[f] for r in row["ours"])
            for f in ("floor2", "floor3")
            if f in row["ours"][0]
        ]
        cells = [config, _ms(ours), " / ".join(_ms(f) for f in floors) or "\u2014"]
        for top, bottom in (
            ("ours", "floor2"),
            ("ours", "floor3"),
            ("langgraph", "ours"),
            ("dbos", "ours"),
        ):
            r = _ratios(res, config, top, bottom)
            cells.append("—" if r is None else _ratio(r))
        target = TARGET_FLOOR.get(config)
        cells.append("—" if target is None else f"≤ {target}\u00d7")
        table.append(cells)
    out.append(
        (
            f"Per turn, {profile.reps} runs of {profile.turns} turns, each turn interleaved with "
            "one turn of each floor (ratio: median, min\u2013max)",
            table,
            header,
        )
    )

    header = [
        "backend",
        "who",
        "commits",
        "transactions",
        "statements",
        "round trips",
        "fsyncs",
        "bytes stored",
    ]
    table = []
    for config, by in res.counts.items():
        for who, c in by.items():
            stored = res.bytes_per_turn.get(config, {}).get(who)
            table.append(
                [config, NAMES[who]]
                + [
                    "—" if c.get(k) is None else f"{c[k]:.2f}".rstrip("0").rstrip(".")
                    for k in ("commits", "transactions", "statements", "round_trips", "fsyncs")
                ]
                + ["—" if stored is None else f"{stored:,.0f} B"]
            )
    out.append(
        (
            f"Per turn, counted (untimed pass, {profile.window} turns); Redis: "
            "statements = server commands",
            table,
            header,
        )
    )

    header = ["backend", "fresh runs' turns", f"turns before {profile.long:,}", "ratio", "target"]
    table = []
    for config, pairs in res.flat_pairs.items():
        if not pairs:
            continue
        _, late, early = pairs[-1]
        table.append(
            [config, _ms(early), _ms(late), f"{late / early:.2f}\u00d7", "\u2264 1.2\u00d7"]
        )
    if res.lg_curve:
        early, late, ratio = flatness(res.lg_curve)
        table.append(
            [
                f"LangGraph SQLite NORMAL ({len(res.lg_curve)} turns)",
                _ms(early),
                _ms(late),
                f"{ratio:.2f}\u00d7",
                "—",
            ]
        )
    out.append(
        (
            "Flatness: a long run's last turns, each alternating with a turn of fresh runs "
            "(their turns 3-25) in the same process and store",
            table,
            header,
        )
    )

    if res.bytes_run:
        header = ["who", "bytes stored", "per turn", "LangGraph / this"]
        table = []
        final = {who: samples[-1][1] for who, samples in res.bytes_run.items()}
        lg = final.get("langgraph")
        for who, total in final.items():
            turns = res.bytes_run[who][-1][0]
            ratio = "—" if not lg or not total else f"{lg / total:,.0f}\u00d7"
            table.append([NAMES[who], f"{total:,}", f"{total / turns:,.0f} B", ratio])
        out.append(
            (
                f"Bytes stored by one {profile.bytes_turns}-turn run on SQLite (target: "
                "LangGraph / ours ≥ 300\u00d7, ours ≤ 1.5 KB per turn)",
                table,
                header,
            )
        )

    header = [
        "backend",
        "run length",
        "ours resume",
        "LangGraph get_state",
        "ours / LangGraph",
        "vs shortest",
    ]
    table = []
    for config, by in res.resume.items():
        first = None
        for turns in profile.resume:
            mine = statistics.median(by[f"ours@{turns}"])
            first = first or mine
            lg = by.get(f"langgraph@{turns}")
            lg_mid = statistics.median(lg) if lg else None
            table.append(
                [
                    config,
                    f"{turns:,} turns",
                    _ms(mine),
                    "—" if lg_mid is None else _ms(lg_mid),
                    "—" if lg_mid is None else f"{mine / lg_mid:.1f}\u00d7",
                    f"{mine / first:.2f}\u00d7",
                ]
            )
    out.append(
        (
            "Resume after the process died (lease, seal, frontier, plan, transcript, up "
            "to the next model call); target ≤ 2\u00d7 get_state at 5,000",
            table,
            header,
        )
    )

    header = ["resume of", "transactions", "statements", "round trips"]
    table = [
        [
            k,
            *(
                "—" if c.get(f) is None else f"{c[f]:.0f}"
                for f in ("transactions", "statements", "round_trips")
            ),
        ]
        for k, c in res.resume_counts.items()
    ]
    out.append(("Round trips per resume, by run length (target: constant)", table, header))

    header = ["backend", *(f"K = {k}" for k in profile.ks), f"K = {profile.ks[-1]} / K = 1"]
    table = []
    for config, by in res.throughput.items():
        first = by[str(profile.ks[0])]
        table.append(
            [
                config,
                *(f"{by[str(k)]:,.0f}" for k in profile.ks),
                f"{by[str(profile.ks[-1])] / first:.2f}\u00d7"
                + ("" if "(" in config else " (target ≥ 4\u00d7)"),
            ]
        )
    out.append(
        (
            f"Durable turns per second, K runs of {profile.k_turns} turns at once in one "
            "process (a turn is two frontiers)",
            table,
            header,
        )
    )
    return out


def text(res: Any, profile: Any) -> str:
    lines = [
        f"tesserix turns benchmark, profile {res.profile}; commit {res.commit}",
        f"{res.machine}; started {res.started}",
    ]
    for title, table, header in rows(res, profile):
        if not table:
            continue
        lines += ["", title]
        widths = [max(len(str(r[i])) for r in [header, *table]) for i in range(len(header))]
        for r in [header, *table]:
            lines.append("  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)))
    goals = targets(res, profile)
    if goals:
        lines += ["", "Against issue 18's targets"]
        width = max(len(g[0]) for g in goals)
        lines += [f"  {g[0]:<{width}}  {g[1]}  [{g[2]}]" for g in goals]
    lines += ["", *(f"note: {n}" for n in res.notes)]
    return "\n".join(lines)


def markdown(res: Any, profile: Any) -> str:
    lines = [f"Profile `{res.profile}`, commit `{res.commit}`, {res.machine}, {res.started}."]
    for title, table, header in rows(res, profile):
        if not table:
            continue
        lines += [
            "",
            f"**{title}**",
            "",
            "| " + " | ".join(header) + " |",
            "|" + " --- |" * len(header),
        ]
        lines += ["| " + " | ".join(map(str, r)) + " |" for r in table]
    goals = targets(res, profile)
    if goals:
        lines += [
            "",
            "**Against issue 18's targets**",
            "",
            "| target | measured | |",
            "| --- | --- | --- |",
            *(f"| {a} | {b} | {c} |" for a, b, c in goals),
        ]
    lines += ["", *(f"- {n}" for n in res.notes)]
    return "\n".join(lines) + "\n"


def _rolling(seconds: list[float], n: int = 25) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    step = max(1, len(seconds) // 200)
    for i in range(0, len(seconds), step):
        lo = max(0, i - n // 2)
        xs.append(i + 1)
        ys.append(statistics.median(seconds[lo : lo + n]) * 1000)
    return xs, ys


def plots(res: Any, profile: Any, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, (ax, low) = plt.subplots(
        2, 1, figsize=(7, 6), dpi=90, sharex=True, gridspec_kw={"height_ratios": [3, 2]}
    )
    for config, seconds in res.flat.items():
        ax.plot(*_rolling(seconds), label=f"ours, {config}", linewidth=1)
    if res.lg_curve:
        ax.plot(*_rolling(res.lg_curve), "k--", label="LangGraph SqliteSaver, NORMAL")
    ax.set(
        ylabel="ms per turn (rolling median)",
        yscale="log",
        title=f"Per-turn cost against run length ({res.profile} profile)",
    )
    ax.yaxis.set_major_locator(matplotlib.ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2, loc="best", framealpha=0.85)
    for config, pairs in res.flat_pairs.items():
        low.plot(
            [t for t, _, _ in pairs],
            [late / early for _, late, early in pairs],
            marker="o",
            markersize=3,
            linewidth=1,
            label=config,
        )
    low.axhline(1.2, color="grey", linestyle=":", label="target 1.2\u00d7")
    low.set(xlabel="turn", ylabel="late / fresh run, side by side")
    low.grid(True, alpha=0.3)
    low.legend(fontsize=7, ncol=3, loc="best", framealpha=0.85)
    fig.tight_layout()
    fig.savefig(out / "per_turn.png")
    plt.close(fig)

    if res.bytes_run:
        fig, ax = plt.subplots(figsize=(7, 4), dpi=90)
        for who, samples in res.bytes_run.items():
            xs = [t for t, _ in samples if t]
            ys = [b / t / 1000 for t, b in samples if t]
            ax.plot(xs, ys, marker="o", markersize=3, label=NAMES[who])
        ax.set(
            xlabel="run length (turns)",
            ylabel="KB stored per turn so far",
            yscale="log",
            title="Bytes stored per turn against run length (SQLite)",
        )
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "bytes.png")
        plt.close(fig)

    if res.throughput:
        fig, ax = plt.subplots(figsize=(7, 4), dpi=90)
        for config, by in res.throughput.items():
            ks = [int(k) for k in by]
            ax.plot(ks, list(by.values()), marker="o", label=config)
        ax.set(
            xlabel="concurrent runs in one process (K)",
            ylabel="durable turns per second",
            xscale="log",
            title="Throughput against concurrency",
        )
        ax.set_xticks(list(profile.ks), [str(k) for k in profile.ks])
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "throughput.png")
        plt.close(fig)


def targets(res: Any, profile: Any) -> list[list[str]]:
    """Issue 18's targets against this run's figures: [target, measured, met]."""
    out: list[list[str]] = []

    def verdict(ok: bool | None) -> str:
        return "\u2014" if ok is None else ("met" if ok else "not met")

    for config, limit in TARGET_FLOOR.items():
        r = _ratios(res, config, "ours", "floor2")
        r3 = _ratios(res, config, "ours", "floor3")
        if r is None:
            continue
        mid = statistics.median(r)
        extra = "" if r3 is None else f" (vs the 3-commit floor {statistics.median(r3):.2f}\u00d7)"
        out.append(
            [
                f"{config}: per turn \u2264 {limit}\u00d7 the raw floor",
                f"{_ratio(r)} the 2-commit floor{extra}",
                verdict(mid <= limit),
            ]
        )
    for config, pairs in res.flat_pairs.items():
        if not pairs:
            continue
        _, late, early = pairs[-1]
        out.append(
            [
                f"{config}: flat within 1.2\u00d7 from turn ~10 to {pairs[-1][0]:,}",
                f"{late / early:.2f}\u00d7",
                verdict(late / early <= 1.2),
            ]
        )
    if res.bytes_run:
        final = {who: samples[-1] for who, samples in res.bytes_run.items()}
        if "ours" in final:
            turns, ours = final["ours"]
            if "langgraph" in final:
                ratio = final["langgraph"][1] / ours
                out.append(
                    [
                        f"bytes \u2265 300\u00d7 fewer than LangGraph SqliteSaver at {turns} turns",
                        f"{ratio:,.0f}\u00d7",
                        verdict(ratio >= 300),
                    ]
                )
            out.append(
                [
                    "bytes \u2264 1.5 KB per turn on SQLite",
                    f"{ours / turns:,.0f} B",
                    verdict(ours / turns <= 1500),
                ]
            )
    by_config: dict[str, list[float]] = {}
    for key, c in res.resume_counts.items():
        if c.get("round_trips") is not None:
            by_config.setdefault(key.split("@")[0], []).append(c["round_trips"])
    for config, trips in by_config.items():
        steady = trips[-1] <= trips[0] * 1.15  # a pool's refill or a renewal may add one
        out.append(
            [
                f"{config}: resume round trips constant",
                " / ".join(f"{t:.0f}" for t in trips) + " (shorter / longer run)",
                verdict(steady),
            ]
        )
    for config, by in res.resume.items():
        big = max(profile.resume)
        mine, lg = by.get(f"ours@{big}"), by.get(f"langgraph@{big}")
        if mine and lg:
            ratio = statistics.median(mine) / statistics.median(lg)
            out.append(
                [
                    f"{config}: resume at {big:,} turns \u2264 2\u00d7 LangGraph get_state",
                    f"{ratio:.1f}\u00d7",
                    verdict(ratio <= 2),
                ]
            )
    for config in ("sqlite-normal", "postgres", "sqlite-full"):
        by = res.throughput.get(config)
        if by:
            ratio = by[str(profile.ks[-1])] / by[str(profile.ks[0])]
            out.append(
                [
                    f"{config}: \u2265 4\u00d7 durable steps/s from K = {profile.ks[0]} to "
                    f"{profile.ks[-1]}",
                    f"{ratio:.2f}\u00d7",
                    verdict(ratio >= 4),
                ]
            )
    for config in ("sqlite-full", "postgres"):
        c = res.counts.get(config, {})
        if "ours" in c and "floor2" in c and c["ours"].get("commits") is not None:
            out.append(
                [
                    f"{config}: commits per turn (the safety argument needs 2)",
                    f"{c['ours']['commits']:.2f}",
                    verdict(c["ours"]["commits"] <= 2),
                ]
            )
    return out
