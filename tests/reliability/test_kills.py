"""SIGKILL at every named point of a run, and at random moments, on every backend.

Each trial is a run of three bookings (two in one turn, one in the next) carried to its end
through deaths, refusals and an operator's resolutions; the checker then reads the history.
"""

from __future__ import annotations

import random

from reliability.figures import TALLY
from reliability.harness import Site, in_parallel
from reliability.history import read_history
from reliability.profile import PROFILE

# Each point with how often a fresh run reaches it: three tool calls, five frontiers.
OCCURRENCES = {
    "before_claim": 3,
    "after_claim": 3,
    "tool_before": 3,
    "tool_after": 3,
    "after_complete": 3,
    "before_frontier": 5,
    "after_frontier": 5,
    "before_renew": 1,
    "after_renew": 1,
}


def named(rounds: int) -> list[tuple[str, int]]:
    """Every point once a round, at its 1st, 2nd, ... occurrence in turn."""
    return [(point, (r % count) + 1) for r in range(rounds) for point, count in OCCURRENCES.items()]


# Slow enough that the lease (0.6 s) is renewed before the run ends.
SLOW = ["--delay", "0.25"]


def _tally(site: Site, scenario: str, trials: int) -> None:
    verdict = site.verdict()
    TALLY.add(
        site.backend, scenario, trials, verdict, kills=site.stats.kills, workers=site.stats.workers
    )
    assert verdict.ok, verdict.explain()


def test_sigkill_at_every_named_point_never_makes_a_call_twice(
    site: Site, rng: random.Random
) -> None:
    trials = [
        (f"kill-{point}-{nth}-{i}", point, nth)
        for i, (point, nth) in enumerate(named(PROFILE.named_kill_rounds))
    ]

    def trial(run: str, point: str, nth: int) -> None:
        first = SLOW if "renew" in point else []
        site.carry(run, random.Random(run), faults=[[f"kill:{point}@{nth}"]], first=first)

    in_parallel(
        [lambda t=t: trial(*t) for t in trials],  # type: ignore[misc]
        PROFILE.width,
    )
    _tally(site, "named SIGKILL", len(trials))
    # Worth something only if every kill landed where it was aimed.
    events = read_history(site.history)
    landed = {e.run for e in events if e.ev == "fault"}
    missed = {run for run, _, _ in trials} - landed
    first = {e.run: e.fields for e in events if e.ev == "result" and e.run in missed}
    assert not missed, f"kills that never landed, with how their first worker ended: {first}"


def test_sigkill_at_random_moments_never_makes_a_call_twice(site: Site, rng: random.Random) -> None:
    runs = [f"random-{n}" for n in range(PROFILE.random_kill_runs)]
    seeds = {run: rng.random() for run in runs}

    def trial(run: str) -> None:
        site.carry(run, random.Random(seeds[run]), kill_within=0.5, kills=3)

    in_parallel([lambda r=r: trial(r) for r in runs], PROFILE.width)  # type: ignore[misc]
    assert site.stats.kills >= len(runs), site.stats
    _tally(site, "random SIGKILL", len(runs))
