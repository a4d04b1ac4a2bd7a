"""``tesserix worker --temporal`` and ``tesserix submit --temporal`` as an operator runs
them: real processes, one sentence on stderr when something is wrong, documented codes."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

from temporalio.client import Client

from on_temporal import airline
from on_temporal.conftest import DevServer
from on_temporal.helpers import TESTS, in_world, queue, run_id, store_url, tesserix, world_stores
from tesserix_adk.temporal import RunOutcome

TENANT = airline.TENANT
AGENT = "on_temporal.airline:agent"


async def test_a_run_submitted_on_temporal_is_carried_by_tesserix_worker(
    temporal_server: DevServer, tmp_path: Path
) -> None:
    rid, q, url = run_id(), queue(), store_url(tmp_path)
    with in_world(tmp_path):
        async with await world_stores(tmp_path):
            pass
        env = {**os.environ, "PYTHONPATH": str(TESTS)}
        worker = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "tesserix_adk",
            "worker",
            "--temporal",
            temporal_server.address,
            "--task-queue",
            q,
            "--agent",
            AGENT,
            "--provider",
            "on_temporal.airline:provider",
            "--store",
            url,
            env=env,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        try:
            assert worker.stdout is not None
            banner = await asyncio.wait_for(worker.stdout.readline(), 60)
            assert b"Temporal task queue " + q.encode() in banner
            args = (
                "submit",
                "--temporal",
                temporal_server.address,
                "--task-queue",
                q,
                "--agent",
                AGENT,
                "--tenant",
                TENANT,
                "--input",
                "Book LH123",
                "--run-id",
                rid,
                "--store",
                url,
            )
            submitted = await tesserix(*args, env=env)
            assert submitted.returncode == 0, submitted.stderr
            assert submitted.stdout.strip() == rid
            again = await tesserix(*args, env=env)  # the same id twice makes one run
            assert again.returncode == 0 and again.stdout.strip() == rid
            client = await Client.connect(temporal_server.address)
            outcome = await asyncio.wait_for(
                client.get_workflow_handle(rid, result_type=RunOutcome).result(), 90
            )
            assert outcome.status == "completed"
            assert len(airline.bookings()) == 1
        finally:
            if worker.returncode is None:
                worker.send_signal(signal.SIGTERM)
            out, err = await asyncio.wait_for(worker.communicate(), 40)
        assert worker.returncode == 0, err.decode()
        assert b"SIGTERM" in out and b"stopped" in out
    inspected = await tesserix("inspect", rid, "--tenant", TENANT, "--store", url)
    assert inspected.returncode == 0 and rid in inspected.stdout


async def test_an_unreachable_temporal_server_is_exit_3_in_one_sentence(tmp_path: Path) -> None:
    done = await tesserix(
        "submit",
        "--temporal",
        "127.0.0.1:1",
        "--task-queue",
        "q",
        "--agent",
        AGENT,
        "--tenant",
        TENANT,
        "--input",
        "hi",
        "--store",
        store_url(tmp_path),
        env={**os.environ, "PYTHONPATH": str(TESTS)},
    )
    assert done.returncode == 3
    assert "127.0.0.1:1 cannot be reached" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr


async def test_a_task_queue_without_temporal_is_exit_2(tmp_path: Path) -> None:
    done = await tesserix(
        "submit",
        "--task-queue",
        "q",
        "--agent",
        AGENT,
        "--tenant",
        TENANT,
        "--input",
        "hi",
        "--store",
        store_url(tmp_path),
        env={**os.environ, "PYTHONPATH": str(TESTS)},
    )
    assert done.returncode == 2
    assert "--temporal" in done.stderr and "Traceback" not in done.stderr
