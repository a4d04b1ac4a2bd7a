"""A worker stopped (SIGSTOP) past its lease's ttl, the run carried on by others, then woken
(SIGCONT): it must not make a call again, nor have a write accepted.

Stopped right after a claim's reply (before the tool starts: issue 20, defect 1a), before a
claim, after a completion and before a frontier write.
"""

from __future__ import annotations

import random
import time

from reliability.figures import TALLY
from reliability.harness import Site, in_parallel, stopped
from reliability.profile import PROFILE
from reliability.worker import EXIT_NOT_NOW

POINTS = (
    "after_claim@1",
    "after_claim@3",
    "before_claim@2",
    "after_complete@2",
    "before_frontier@2",
)


def _trial(site: Site, run: str, point: str) -> int | None:
    """The woken worker's exit code; ``None`` if it gave the run up before its stop."""
    first = site.start(run, f"--fault=stop:{point}")
    deadline = time.monotonic() + 30
    while not stopped(first.pid):
        if first.exitcode is not None:
            # Under load (a CI run on two cores) a worker whose lease is 0.6 s may lose it
            # before its stop point, or find the store busy: it gives the run up, typed, as
            # the kit promises. Its run is still carried to its end and checked below.
            result = first.result()
            assert result is not None, first.output()
            assert result["code"] == EXIT_NOT_NOW, (result, first.output())
            site.note(f"gave up before its stop ({result['verdict']})")
            site.carry(run, random.Random(run))
            return None
        assert time.monotonic() < deadline, f"{run} never stopped at {point}"
        time.sleep(0.01)
    time.sleep(site.lease_ttl * 1.5)  # past the ttl by the store's clock and the worker's
    site.carry(run, random.Random(run))
    first.wake()
    return first.finish()


def test_worker_stopped_past_its_ttl_and_woken_makes_no_second_effect(site: Site) -> None:
    trials = [(f"stop-{n}", POINTS[n % len(POINTS)]) for n in range(PROFILE.stop_runs)]
    codes: dict[str, int | None] = {}

    def job(run: str, point: str) -> None:
        codes[run] = _trial(site, run, point)

    in_parallel([lambda t=t: job(*t) for t in trials], PROFILE.width)  # type: ignore[misc]
    verdict = site.verdict()
    TALLY.add(site.backend, "SIGSTOP", len(trials), verdict, workers=site.stats.workers)
    assert verdict.ok, verdict.explain()
    # Woken, each finds it no longer carries the run (one woken early because it held
    # SQLite's write lock, which blocks every writer while it is stopped, may carry on).
    early = {label.split(".w")[0] for label in site.woken_early}
    woken = {run: code for run, code in codes.items() if code is not None and run not in early}
    assert woken, f"no worker reached its stop point: {site.stats.notes}"
    assert set(woken.values()) == {EXIT_NOT_NOW}, codes
