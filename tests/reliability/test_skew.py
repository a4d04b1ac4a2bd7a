"""Workers whose wall clock is off by +-90 s and +-1 h (faketime) carry runs together with
workers whose clock is right.

A worker with the right clock starts the run and is killed, stopped or left alone mid-run;
two skewed workers race to resume it at once, then skewed and unskewed workers take turns
until it completes (an operator with the right clock resolving refusals from the world).
Redis and PostgreSQL decide lease expiry by the server's clock, so a skewed worker behaves
as any other: none may take a lease that is live. SQLite decides by the calling process's
wall clock (the README states the limit), so a worker ahead of time may take a live lease;
fences must still keep every effect single and refuse every stale write.
"""

from __future__ import annotations

import random
import signal
import time
from pathlib import Path

import pytest

from reliability.figures import TALLY
from reliability.harness import Site, in_parallel, stopped
from reliability.history import read_history
from reliability.profile import PROFILE
from reliability.skew import OFFSETS, faketime_env, libfaketime, live_takeovers, skews, wall_offset

# What happens to the first worker (right clock): nothing, killed or stopped mid-run.
FIRST = (
    "",
    "kill:after_claim@1",
    "stop:after_claim@2",
    "kill:after_frontier@2",
    "stop:before_frontier@3",
)
# Slow enough that the skewed workers (an interpreter start away) meet it mid-run.
SLOW = ("--delay", "0.3")


@pytest.fixture(scope="module")
def so() -> Path:
    found = libfaketime()
    if found is None:
        pytest.skip("the libfaketime wheel is not installed (pip install -e '.[dev]')")
    return found


def _trial(site: Site, run: str, offset: str, first: str, so: Path) -> None:
    env = faketime_env(so, offset)
    a = site.start(run, *([f"--fault={first}"] if first else []), *SLOW)
    deadline = time.monotonic() + 30
    # Until the first worker is stopped, dead, or well into its run.
    while a.exitcode is None and not stopped(a.pid) and time.monotonic() < deadline:
        if not first and time.monotonic() - a.started > 0.8:
            break
        time.sleep(0.01)
    racers = [site.start(run, env=env) for _ in range(2)]
    for racer in racers:
        racer.finish()
    site.carry(run, random.Random(run), env_for=lambda n: env if n % 2 == 0 else None)
    if stopped(a.pid):
        a.wake()
    if a.finish() == -signal.SIGKILL:
        site.count("kills")


def test_workers_with_a_skewed_wall_clock_make_no_call_twice(site: Site, so: Path) -> None:
    offsets = list(OFFSETS)
    trials = [
        (f"skew-{n}", offsets[n % len(offsets)], FIRST[n % len(FIRST)])
        for n in range(PROFILE.skew_runs)
    ]
    in_parallel(
        [lambda t=t: _trial(site, *t, so) for t in trials],  # type: ignore[misc]
        PROFILE.width,
    )
    events = read_history(site.history)
    # Worth something only if the clocks were off as asked (and only where asked).
    started = {e.proc: e.get("faketime") for e in events if e.ev == "start"}
    for label, (python, sqlite) in skews(events, wall_offset()).items():
        want = OFFSETS.get(started[label] or "", 0.0)
        assert abs(python - want) < 5 and abs(sqlite - want) < 5, (label, want, python, sqlite)
    skewed = sum(1 for f in started.values() if f)
    assert skewed >= 2 * len(trials), started
    taken = live_takeovers(events, site.lease_ttl)
    verdict = site.verdict()
    TALLY.add(
        site.backend,
        "clock skew",
        len(trials),
        verdict,
        kills=site.stats.kills,
        workers=site.stats.workers,
        notes={"live leases taken by a skewed clock": len(taken), **site.stats.notes},
    )
    assert verdict.ok, verdict.explain()
    if site.backend != "sqlite":
        # The server's clock decides: a skewed worker waits like any other.
        assert taken == [], taken
