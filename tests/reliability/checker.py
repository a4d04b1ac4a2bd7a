"""Reads a history afterwards and says what went wrong, as Jepsen's checkers do.

Per run, from the events alone (never from the stores the kit wrote):

- **duplicate effects**: a key whose tool effect happened more than once;
- **stale writes accepted**: a write (frontier put, transcript append, tool claim) or a
  tool start carrying fence *f* that went out after a lease with a higher fence had been
  granted (its reply was back before the write was sent), yet was accepted; also two
  grants whose fences do not rise in the order they were granted;
- **wrong refusals**: a refusal must name exactly the calls in doubt: every call whose own
  claim was acknowledged and whose completion was never even sent (it may have run), and
  nothing but calls claimed and neither completed nor resolved when the refusing process
  took the run (a holder that lost it may record a call while the new one decides). A
  run that ends any other way than completed, or a refusal of another kind, counts here
  too;
- **hangs**: a process the harness had to kill at its deadline;
- and every run ends completed with each of its calls' effects exactly once.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from reliability.history import Event

__all__ = ["Verdict", "check"]


@dataclass
class Verdict:
    """What the checker found in one history."""

    runs: int = 0
    duplicate_effects: int = 0
    stale_writes: int = 0
    wrong_refusals: int = 0
    hangs: int = 0
    lost_effects: int = 0
    unfinished: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def explain(self) -> str:
        return "\n".join(self.problems)


WRITES = ("put_ok", "append_ok")


def check(events: list[Event], *, expected_items: tuple[str, ...] = ()) -> Verdict:
    """Check every run of ``events``; ``expected_items`` are the items each run books."""
    verdict = Verdict()
    by_run: dict[str, list[Event]] = defaultdict(list)
    for e in events:
        by_run[e.run].append(e)
    for run, evs in by_run.items():
        verdict.runs += 1
        _check_run(run, evs, verdict, expected_items)
    return verdict


def _check_run(run: str, evs: list[Event], v: Verdict, items: tuple[str, ...]) -> None:
    _effects(run, evs, v, items)
    _fences(run, evs, v)
    _refusals(run, evs, v)
    for e in evs:
        if e.ev == "hang":
            v.hangs += 1
            v.problems.append(f"{run}: {e.proc} hung: {e.get('detail', '')}")
    results = [e for e in evs if e.ev == "result"]
    # A paused worker woken after the end reports last, so "ends" means "some worker
    # completed it"; what the others did is checked above.
    if not any(e["verdict"] == "completed" for e in results):
        v.unfinished += 1
        last = results[-1].fields if results else None
        v.problems.append(f"{run}: never completed (last result {last})")
    for e in results:
        if e["verdict"] == "error":
            v.wrong_refusals += 1
            v.problems.append(f"{run}: {e.proc} ended with {e.get('error') or e.get('status')}")


def _effects(run: str, evs: list[Event], v: Verdict, items: tuple[str, ...]) -> None:
    by_key: dict[str, list[Event]] = defaultdict(list)
    by_item: dict[str, int] = defaultdict(int)
    for e in evs:
        if e.ev == "effect":
            by_key[e["key"]].append(e)
            by_item[e["item"]] += 1
    for key, effects in by_key.items():
        if len(effects) > 1:
            v.duplicate_effects += len(effects) - 1
            who = ", ".join(f"{x.proc} fence {x['fence']}" for x in effects)
            v.problems.append(f"{run}: {key} took effect {len(effects)} times ({who})")
    completed = any(e.ev == "result" and e["verdict"] == "completed" for e in evs)
    for item in items if completed else ():
        if by_item[item] == 0:
            v.lost_effects += 1
            v.problems.append(f"{run}: completed, but {item} never took effect")
        elif by_item[item] > 1 and all(len(x) < 2 for x in by_key.values()):
            # The same item under two keys: the kit keyed one call two ways.
            v.duplicate_effects += by_item[item] - 1
            v.problems.append(f"{run}: {item} took effect {by_item[item]} times under two keys")


def _fences(run: str, evs: list[Event], v: Verdict) -> None:
    grants = [e for e in evs if e.ev == "acquire_ok"]
    for a in grants:
        for b in grants:
            if a is not b and a.t < b["sent"] and not a["fence"] < b["fence"]:
                v.stale_writes += 1
                v.problems.append(
                    f"{run}: fence {a['fence']} ({a.proc}) was granted before fence "
                    f"{b['fence']} ({b.proc}) was asked for: fences must rise"
                )
    writes = [
        e
        for e in evs
        if e.ev in WRITES
        or e.ev == "effect"
        or (e.ev == "claim_ok" and e["status"] == "in_flight" and e["mine"])
    ]
    for w in writes:
        if w.get("fence") is None:
            continue
        newer = [g for g in grants if g["fence"] > w["fence"] and g.t < w["sent"]]
        if newer:
            v.stale_writes += 1
            what = "started" if w.ev == "effect" else "was accepted"
            v.problems.append(
                f"{run}: {w.ev} from {w.proc} under fence {w['fence']} {what} after fence "
                f"{newer[0]['fence']} was granted to {newer[0].proc}"
            )


def _refusals(run: str, evs: list[Event], v: Verdict) -> None:
    sent: set[str] = set()
    acked: set[str] = set()
    complete_sent: set[str] = set()
    settled: set[str] = set()
    never_ran: set[str] = set()
    # Claims their holder dropped unsent (a drop whose reply was lost may not have landed:
    # such a call may still be named, and need not be). Only the drop by the holder whose
    # claim was acknowledged counts: anyone else's leaves the record as it was.
    released: set[str] = set()
    claiming: dict[tuple[str, str], str] = {}  # (process, key) -> its last claim's holder
    holding: dict[str, str] = {}  # key -> the holder its acknowledged claim named
    # Per process, the calls in doubt at any moment since it took the run: what it may
    # have read as in flight, even if their holder recorded them while it was deciding.
    seen: dict[str, set[str]] = {}
    for e in evs:
        if e.ev == "acquire_ok":
            seen[e.proc] = sent - settled
        elif e.ev == "claim_sent":
            for doubts in seen.values():
                doubts.add(e["key"])
            sent.add(e["key"])
            released.discard(e["key"])
            claiming[(e.proc, e["key"])] = e["holder"]
            if e["key"] in never_ran:
                # An operator said it never ran; this claim starts its story afresh.
                never_ran.discard(e["key"])
                for known in (settled, acked, complete_sent):
                    known.discard(e["key"])
        elif e.ev == "claim_ok":
            if e["status"] == "completed":
                settled.add(e["key"])
            elif e["status"] == "in_flight" and e["mine"]:
                acked.add(e["key"])
                holder = claiming.get((e.proc, e["key"]))
                if holder is not None:
                    holding[e["key"]] = holder
        elif e.ev == "complete_sent":
            complete_sent.add(e["key"])
        elif e.ev == "release_sent" and holding.get(e["key"]) == e["holder"]:
            released.add(e["key"])
        elif e.ev == "complete_ok":
            settled.add(e["key"])
        elif e.ev == "resolve_ok":
            settled.add(e["key"])
            if e["never_ran"]:
                never_ran.add(e["key"])
        elif e.ev == "result" and e["verdict"] == "refused":
            named = set(e["keys"])
            must = acked - complete_sent - settled - released
            may = (sent - settled) | seen.get(e.proc, set())
            if not must <= named or not named <= may:
                v.wrong_refusals += 1
                v.problems.append(
                    f"{run}: {e.proc} refused naming {sorted(named)}; calls in doubt were at "
                    f"least {sorted(must)} and at most {sorted(may)} ({e.get('error')})"
                )
