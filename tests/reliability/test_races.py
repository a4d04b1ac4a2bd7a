"""Many processes racing to resume one run: exactly one carries it, every round.

The run's first worker dies right after the model asked for the bookings (its frontier
written, nothing claimed); once its lease lapsed, N processes start at once. The winner
holds the run inside its first tool call (renewing its lease) until every loser has given
up, so all of them genuinely overlap with it; then it finishes the run.
"""

from __future__ import annotations

import json
import time

from reliability.figures import TALLY
from reliability.harness import Site, in_parallel
from reliability.history import read_history, written
from reliability.profile import PROFILE
from reliability.worker import EXIT_COMPLETED, EXIT_NOT_NOW


def _holding(site: Site, run: str) -> list[str]:
    """The racers holding ``run`` in their tool; polled often, so only those lines are
    parsed (the history of 16 x 20 races is long)."""
    tag = f'"run": "{run}"'
    return [
        json.loads(line)["proc"]
        for line in written(site.history).splitlines()
        if '"kind": "hold"' in line and tag in line and '"ev": "fault"' in line
    ]


def _round(site: Site, run: str) -> list[str]:
    assert site.start(run, "--fault=kill:after_frontier@1").finish() < 0
    time.sleep(site.lease_ttl * 1.5)
    release = site.tmp / f"{run}.release"
    racers = [
        site.start(run, "--fault=hold:tool_before@1", "--release", str(release), "--lease-ttl", "3")
        for _ in range(PROFILE.racers)
    ]
    holding: list[str] = []
    deadline = time.monotonic() + 60
    codes: dict[str, int | None] = {}
    # Every loser ends on its own; the winner waits in its tool for the release.
    while time.monotonic() < deadline:
        codes = {r.label: r.exitcode for r in racers}
        holding = _holding(site, run)
        if len([c for c in codes.values() if c is None]) <= len(holding) and holding:
            break
        time.sleep(0.05)
    release.touch()
    ended = {r.label: r.finish() for r in racers}
    events = [e for e in read_history(site.history, live=True) if e.run == run and e.proc in ended]
    acquirers = {e.proc for e in events if e.ev == "acquire_ok"}
    carriers = sorted(holding)
    assert set(carriers) <= acquirers, (carriers, acquirers)
    assert [ended[c] for c in carriers] == [EXIT_COMPLETED] * len(carriers), ended
    losers = {label: code for label, code in ended.items() if label not in carriers}
    assert set(losers.values()) <= {EXIT_NOT_NOW}, ended
    # A racer may win the lease and lose it before its first tool call only if it could not
    # renew in time (a starved machine: its renewal reached the store after the ttl); it
    # must then have claimed and done nothing, and ended superseded.
    for lost in acquirers - set(carriers):
        mine = [e.ev for e in events if e.proc == lost and e.ev in ("claim_ok", "effect")]
        verdict = [e["verdict"] for e in events if e.proc == lost and e.ev == "result"]
        assert not mine and verdict == ["superseded"], (lost, mine, verdict)
        site.note("race winners that lost the lease before the tool")
    return carriers


def test_processes_racing_to_resume_one_run_have_exactly_one_carrier(site: Site) -> None:
    rounds: list[list[str]] = []
    # Rounds side by side, each on a run of its own: the racers of one round race each
    # other only, and the CI profile affords 16 x 20 per backend.
    in_parallel(
        [lambda n=n: rounds.append(_round(site, f"race-{n}")) for n in range(PROFILE.race_rounds)],  # type: ignore[misc]
        PROFILE.race_width,
    )
    verdict = site.verdict()
    TALLY.add(
        site.backend,
        f"races {PROFILE.racers}x",
        len(rounds),
        verdict,
        kills=len(rounds),
        workers=site.stats.workers,
        notes=dict(site.stats.notes),
    )
    assert verdict.ok, verdict.explain()
    assert [len(c) for c in rounds] == [1] * len(rounds), rounds
