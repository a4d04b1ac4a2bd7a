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
    stop_runs: int
    restart_runs: int
    proxy_runs: int
    width: int  # trials side by side


CI = Profile(
    name="ci",
    named_kill_rounds=2,
    random_kill_runs=6,
    racers=8,
    race_rounds=1,
    stop_runs=5,
    restart_runs=3,
    proxy_runs=6,
    width=5,
)
FULL = Profile(
    name="full",
    named_kill_rounds=20,
    random_kill_runs=200,
    racers=16,
    race_rounds=20,
    stop_runs=50,
    restart_runs=20,
    proxy_runs=40,
    width=5,
)

PROFILE = FULL if os.environ.get("ADK_TORTURE", "").strip() not in ("", "0") else CI
SEED = int(os.environ.get("ADK_TORTURE_SEED", "20261129"))
