"""How much torture a run of the suite does: the CI profile (``make test``) or the full one
(``ADK_TORTURE=1``, ``make torture``)."""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["PROFILE", "SEED", "Profile"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Profile:
    name: str
    # Rounds of every named kill point per backend (round r kills at a point's
    # (r mod its occurrences)+1-th occurrence).
    named_kill_rounds: int
    # Runs cut by SIGKILL at random moments, per backend (up to three kills each).
    random_kill_runs: int
    racers: int
    race_rounds: int
    race_width: int  # race rounds side by side (each its own run)
    stop_runs: int
    restart_runs: int
    proxy_runs: int
    # Runs under a wall clock off by +-90 s and +-1 h (faketime), per backend.
    skew_runs: int
    # Runs through a proxy that delays replies, and one that goes half-open, per server.
    delay_runs: int
    half_open_runs: int
    # Runs into a Redis at maxmemory, per eviction policy.
    maxmemory_runs: int
    width: int  # trials side by side


CI = Profile(
    name="ci",
    named_kill_rounds=2,
    random_kill_runs=6,
    racers=16,
    # The issue asks 16 x 20 here; measured on the shared 2 cores, 16 x 20 costs 3.5 to 5.4
    # minutes of this directory's 6.5 to 9 (docs/reliability.md), too close to its 10.
    # Cut to 6 (and skew to 5) in stop 40, when the whole suite's CI run reached 19.7 min
    # of its 20, and to 4 in stop 42 (a clean clone's run took 1,157 s, then 1,316 s on the
    # same code): docs/reliability.md.
    race_rounds=4,
    race_width=4,
    stop_runs=5,
    restart_runs=3,
    proxy_runs=6,
    skew_runs=5,
    delay_runs=5,
    half_open_runs=5,
    maxmemory_runs=2,
    width=5,
)
FULL = Profile(
    name="full",
    named_kill_rounds=20,
    random_kill_runs=200,
    racers=16,
    race_rounds=200,
    race_width=4,
    stop_runs=50,
    restart_runs=20,
    proxy_runs=40,
    skew_runs=100,
    delay_runs=20,
    half_open_runs=20,
    maxmemory_runs=10,
    width=5,
)

PROFILE = FULL if os.environ.get("ADK_TORTURE", "").strip() not in ("", "0") else CI
SEED = int(os.environ.get("ADK_TORTURE_SEED", "20261129"))
