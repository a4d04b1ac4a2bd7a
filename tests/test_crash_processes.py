"""Real process deaths: SIGKILL, SIGSTOP/SIGCONT and a 20-process race, on every durable
backend (SQLite, Redis, PostgreSQL): the store URL reaches each worker through its argv and
environment, as it would in a deployment.

The airline is a table the tool writes; each test counts its rows.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from processes import BACKENDS, POSTGRES_PGBOUNCER, REDIS_CLUSTER, Site, held_open, store_url

pytestmark = pytest.mark.skipif(os.name != "posix", reason="needs POSIX signals")


def _resume(site: Site, run_id: str) -> tuple[int, str]:
    proc = site.worker(run_id, "--resume")
    out, err = proc.communicate(timeout=60)
    return proc.returncode, out + err


# The representative crash tests run on a Redis Cluster too, and on PostgreSQL behind
# PgBouncer (each costs a server's worth of CI time, so not every one does).
ALSO_ON_A_CLUSTER = pytest.mark.parametrize(
    "site", [*BACKENDS, REDIS_CLUSTER, POSTGRES_PGBOUNCER], indirect=True
)


@pytest.fixture(params=BACKENDS)
def site(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Site]:
    """The test's store (a fresh SQLite file, Redis prefix or PostgreSQL schema, with the
    schema applied) and airline; the Redis keys or the schema are removed afterwards."""
    cluster = None
    if request.param == "redis-cluster":
        cluster = request.getfixturevalue("redis_cluster")
    with held_open(store_url(request.param, tmp_path, cluster)) as url:
        yield Site(tmp_path, url)


@ALSO_ON_A_CLUSTER
def test_killed_after_book_seat_completed_resumes_with_the_outcome_replayed(site: Site) -> None:
    site.kill_at("r1", "booked")
    assert site.bookings("r1") == 1
    site.wait_lease_lapsed("r1")
    code, out = _resume(site, "r1")
    assert code == 0, out
    assert "RESULT completed" in out
    assert site.bookings("r1") == 1


@ALSO_ON_A_CLUSTER
def test_killed_while_book_seat_in_flight_refuses_naming_it(site: Site) -> None:
    site.kill_at("r2", "in_flight")
    assert site.bookings("r2") == 1
    site.wait_lease_lapsed("r2")
    code, out = _resume(site, "r2")
    assert code == 4
    assert "IndeterminateToolCallError" in out and "book_seat" in out
    assert site.bookings("r2") == 1


def test_killed_right_after_the_model_call_books_exactly_once(site: Site) -> None:
    site.kill_at("r3", "model_call")
    assert site.bookings("r3") == 0
    site.wait_lease_lapsed("r3")
    code, out = _resume(site, "r3")
    assert code == 0, out
    assert site.bookings("r3") == 1


def test_twenty_processes_race_to_resume_and_exactly_one_carries_the_run(site: Site) -> None:
    site.kill_at("race", "model_call")
    site.wait_lease_lapsed("race")
    # The winner stops after booking and holds the run until it is killed, so every other
    # process genuinely overlaps with it.
    procs = [site.worker("race", "--resume", "--pause", "booked") for _ in range(20)]
    outputs: list[str] = []
    winners = []
    for proc in procs:
        assert proc.stdout is not None
        line = proc.stdout.readline().strip()
        if line == "PAUSED booked":
            winners.append(proc)
            continue
        proc.communicate(timeout=60)
        outputs.append(line)
    for proc in winners:
        os.kill(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=10)
    assert len(winners) == 1
    assert len(outputs) == 19
    assert all(o.startswith("ERROR ResumeConflictError") for o in outputs), outputs
    assert site.bookings("race") == 1


@ALSO_ON_A_CLUSTER
def test_worker_paused_past_its_ttl_is_refused_by_the_fence_after_sigcont(site: Site) -> None:
    first = site.worker("stop", "--pause", "stop_before_put", "--lease-ttl", "1")
    assert first.stdout is not None
    assert first.stdout.readline().strip() == "PAUSED stop_before_put"
    # The first worker booked the seat and stopped (SIGSTOP) just before its next write.
    deadline = time.monotonic() + 10
    while not _stopped(first.pid):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert site.bookings("stop") == 1
    site.wait_lease_lapsed("stop")

    code, out = _resume(site, "stop")
    assert code == 0, out
    assert "RESULT completed fence=2" in out

    os.kill(first.pid, signal.SIGCONT)
    rest, err = first.communicate(timeout=60)
    assert first.returncode == 4, rest + err
    assert "StaleFenceError" in rest
    assert site.bookings("stop") == 1


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


def test_ctrl_c_of_run_resume_releases_its_lease_and_resume_claim(site: Site) -> None:
    """A clean interrupt leaves nothing behind: the next resume need not wait out a 5-minute
    resume claim nobody holds."""
    import asyncio
    import subprocess
    import sys

    from processes import AGENT, TENANT
    from tesserix_adk import open_stores
    from tesserix_adk.run.attempt import run_claim_key
    from tesserix_adk.stores.protocols import RecordStatus

    site.kill_at("ctrl-c", "model_call")
    site.wait_lease_lapsed("ctrl-c")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tesserix_adk",
            "run",
            "--resume",
            "ctrl-c",
            "--tenant",
            TENANT,
            "--agent",
            AGENT,
        ],
        # Each tool takes seconds, so the interrupt lands while the run is held even on a
        # loaded machine (at 2 s a run could finish between two looks at the store).
        env={**site.env, "ADK_DEMO_DELAY": "6"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )

    async def held() -> tuple[object, object]:
        async with open_stores(site.store) as stores:
            key = run_claim_key(TENANT, "ctrl-c")
            claim = (await stores.idempotency.lookup([key], tenant=TENANT)).get(key)
            return await stores.leases.current(TENANT, "ctrl-c"), claim

    deadline = time.monotonic() + 30
    while asyncio.run(held())[0] is None:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "interrupted" in err and "Traceback" not in err
    lease, claim = asyncio.run(held())
    assert lease is None
    assert claim is None or claim.status is not RecordStatus.in_flight  # type: ignore[attr-defined]
    assert site.bookings("ctrl-c") <= 1
