"""SIGKILL at random moments of real runs (SPEC §9): no call is ever made twice, and every
run either completes or is refused naming its call — which an operator then resolves from
the airline's own records, after which it completes.

Short in CI; ``ADK_TORTURE_RUNS=50`` (and ``ADK_TORTURE_SEED``) for a long profile.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest

from processes import TENANT, Site
from tesserix_adk.cli.demo_agent import airline_bookings
from tesserix_adk.stores.urls import open_stores

RUNS = int(os.environ.get("ADK_TORTURE_RUNS", "4"))
SEED = int(os.environ.get("ADK_TORTURE_SEED", "20261129"))
FAST = ["--delay", "0.05", "--lease-ttl", "0.5", "--claim-ttl", "0.5"]

pytestmark = pytest.mark.skipif(os.name != "posix", reason="needs POSIX signals")


def _has_frontier(site: Site, run_id: str) -> bool:
    async def latest() -> bool:
        async with open_stores(site.store) as stores:
            return await stores.checkpoints.latest(TENANT, run_id) is not None

    return asyncio.run(latest())


def _resolve_from_the_airline(site: Site, run_id: str) -> None:
    """What an on-call engineer does: look the booking up, record what was found."""
    rows = airline_bookings(site.airline, run_id)
    assert len(rows) <= 1, rows
    if rows:
        booking, flight, _, _ = rows[0]
        what = ["--outcome", json.dumps({"booking_id": f"BK-{booking}", "flight": flight})]
    else:
        what = ["--never-ran"]
    while True:
        done = site.tesserix(
            "resolve", run_id, "--tenant", TENANT, "--call", "call_1_0", *what, "--by", "oncall"
        )
        if done.returncode != 3:  # 3: a dead worker's lease has not lapsed yet
            assert done.returncode == 0, done.stderr
            return
        time.sleep(0.1)


def _carry_to_the_end(site: Site, run_id: str, rng: random.Random) -> list[str]:
    """Start, kill at random, resume, kill again... until the run completes."""
    history: list[str] = []
    for _ in range(60):
        args = [*FAST, "--resume"] if _has_frontier(site, run_id) else list(FAST)
        proc = site.worker(run_id, *args)
        assert proc.stderr is not None
        assert proc.stderr.readline().strip() == "STARTED"
        try:
            # A run takes about 0.3 s from here (five steps of 0.05 s plus the stores).
            out, err = proc.communicate(timeout=rng.uniform(0.0, 0.4))
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.communicate()
            history.append("killed")
        else:
            verdict = (out.strip().splitlines() or [err.strip()])[-1]
            history.append(verdict.split(":")[0])
            if verdict.startswith("RESULT completed"):
                return history
            if "IndeterminateToolCallError" in verdict:
                assert "book_seat" in verdict
                _resolve_from_the_airline(site, run_id)
            elif not any(word in verdict for word in ("ResumeConflictError", "LeaseHeldError")):
                raise AssertionError(f"unexpected end of a worker: {out} {err}")
        # Whatever happened, the airline never holds two bookings for the run.
        assert site.bookings(run_id) <= 1, history
        time.sleep(0.05)
    raise AssertionError(f"run {run_id} never completed: {history}")


def test_sigkill_at_random_moments_never_books_twice(tmp_path: Path) -> None:
    rng = random.Random(SEED)
    site = Site(tmp_path)
    kills = 0
    for n in range(RUNS):
        run_id = f"torture-{n}"
        history = _carry_to_the_end(site, run_id, rng)
        assert site.bookings(run_id) == 1, history
        kills += history.count("killed")
    # The test is only worth something if the kills landed: some runs were cut short.
    assert kills >= RUNS, kills
