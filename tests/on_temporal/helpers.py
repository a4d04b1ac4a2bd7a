"""What the Temporal tests share: a world directory, stores on a SQLite file in it, a
runner with short leases (a killed worker strands a run for two seconds), and options
that notice a dead worker within a second or two."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

from temporalio.client import Client

from on_temporal.airline import WORLD_ENV
from tesserix_adk import Agent, AgentRunner, LeasePolicy, Stores, open_stores
from tesserix_adk.temporal import ActivityOptions, agent_worker

LEASE_TTL = 2.0
TESTS = Path(__file__).resolve().parent.parent
FAST = ActivityOptions(
    model_timeout=30.0,
    tool_timeout=60.0,
    heartbeat_timeout=2.0,
    retry_initial=0.2,
    retry_max=1.0,
)


@contextmanager
def in_world(path: Path) -> Iterator[Path]:
    """Point the airline (in this process and the workers it starts) at ``path``."""
    before = os.environ.get(WORLD_ENV)
    os.environ[WORLD_ENV] = str(path)
    try:
        yield path
    finally:
        if before is None:
            os.environ.pop(WORLD_ENV, None)
        else:
            os.environ[WORLD_ENV] = before


def store_url(world: Path) -> str:
    return f"sqlite:///{world / 'adk.sqlite3'}"


async def world_stores(world: Path) -> Stores:
    """The world's stores, schema applied."""
    stores = open_stores(store_url(world))
    await stores.create_schema()
    return stores


def fast_runner(provider: Any, stores: Stores) -> AgentRunner:
    return AgentRunner.from_stores(
        provider,
        stores,
        lease_policy=LeasePolicy(ttl=LEASE_TTL, renew_within=LEASE_TTL / 2),
        never_ran_margin=0.2,
    )


def queue() -> str:
    return f"q-{uuid.uuid4().hex[:8]}"


@asynccontextmanager
async def worker_running(
    client: Client, runner: AgentRunner, agents: list[Agent], task_queue: str
) -> AsyncIterator[None]:
    worker = agent_worker(
        client, task_queue=task_queue, runner=runner, agents=agents, heartbeat_every=0.3
    )
    async with worker:
        yield


async def tesserix(
    *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """The ``tesserix`` command line in a process of its own (off the event loop)."""
    return await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "tesserix_adk", *args],
        capture_output=True,
        text=True,
        check=False,
        env=env,
    )


class WorkerProcess:
    """``on_temporal.worker_process`` in an OS process of its own, started by this test
    and ended by it (by pid: SIGKILL for a crash, or at the end)."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc

    @classmethod
    async def start(cls, address: str, task_queue: str, agent: str) -> WorkerProcess:
        tests = str(TESTS)
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")]),
        }
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "on_temporal.worker_process",
            address,
            task_queue,
            agent,
            env=env,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        assert proc.stdout is not None
        try:
            line = await asyncio.wait_for(proc.stdout.readline(), 60)
        except TimeoutError:
            line = b""
        if line.strip() != b"ready":
            proc.kill()
            _, err = await proc.communicate()
            raise AssertionError(f"the worker process did not start: {line!r} {err.decode()}")
        return cls(proc)

    async def kill(self) -> None:
        """SIGKILL: nothing of the process runs after this."""
        self.proc.send_signal(signal.SIGKILL)
        await self.proc.wait()

    async def stop(self) -> None:
        if self.proc.returncode is None:
            self.proc.send_signal(signal.SIGKILL)
        await self.proc.wait()


async def wait_for_file(path: Path, within: float = 30.0) -> None:
    """Until ``path`` exists (a tool reached its hold), or fail after ``within`` seconds."""
    await asyncio.to_thread(_wait_for_file, path, within)


def _wait_for_file(path: Path, within: float) -> None:
    deadline = time.monotonic() + within
    while not path.exists():
        if time.monotonic() > deadline:
            raise AssertionError(f"{path.name} did not appear within {within:g} s")
        time.sleep(0.02)


def run_id() -> str:
    """A run id no other test of the session uses (one dev server keeps them all)."""
    return f"run-{uuid.uuid4().hex[:8]}"


async def pause(worker: WorkerProcess) -> None:
    """SIGSTOP: the process is frozen (its heartbeats and lease renewals stop) but alive."""
    worker.proc.send_signal(signal.SIGSTOP)


async def unpause(worker: WorkerProcess) -> None:
    worker.proc.send_signal(signal.SIGCONT)
