"""Helpers for tests that run real OS processes: workers, the console script, SIGKILL."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tesserix_adk.cli.demo_agent import AIRLINE_ENV, airline_bookings, create_airline
from tesserix_adk.stores.urls import open_stores

TENANT = "demo"
AGENT = "tesserix_adk.cli.demo_agent:agent"


class Site:
    """A store URL and an airline file shared by every process of one test."""

    def __init__(self, tmp: Path, store: str | None = None) -> None:
        self.tmp = tmp
        self.store = store or f"sqlite:///{tmp / 'adk.sqlite3'}"
        self.airline = str(tmp / "airline.sqlite3")
        create_airline(self.airline)
        self.env = {**os.environ, AIRLINE_ENV: self.airline, "ADK_STORE": self.store}
        self.env.pop("ADK_DEMO_PAUSE", None)
        asyncio.run(self._apply_schema())

    async def _apply_schema(self) -> None:
        async with open_stores(self.store) as stores:
            await stores.create_schema()

    def bookings(self, run_id: str) -> int:
        return len(airline_bookings(self.airline, run_id))

    def worker(self, run_id: str, *extra: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tesserix_adk.cli.worker",
                "--store",
                self.store,
                "--run",
                run_id,
                "--tenant",
                TENANT,
                *extra,
            ],
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def kill_at(self, run_id: str, pause: str, *extra: str) -> None:
        """Run a worker to ``pause`` and SIGKILL it there."""
        proc = self.worker(run_id, "--pause", pause, "--lease-ttl", "1", *extra)
        assert proc.stdout is not None
        line = proc.stdout.readline().strip()
        if line != f"PAUSED {pause}":
            proc.kill()
            _, err = proc.communicate(timeout=10)
            raise AssertionError(f"worker did not reach {pause}: {line!r} {err}")
        os.kill(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=10)
        assert proc.returncode == -signal.SIGKILL

    def wait_lease_lapsed(self, run_id: str, timeout: float = 10.0) -> None:
        async def current() -> Any:
            async with open_stores(self.store) as stores:
                return await stores.leases.current(TENANT, run_id)

        deadline = time.monotonic() + timeout
        while asyncio.run(current()) is not None:
            assert time.monotonic() < deadline, "lease never lapsed"
            time.sleep(0.05)

    def tesserix(
        self, *args: str, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        """The console script, as a real subprocess."""
        return subprocess.run(
            [sys.executable, "-m", "tesserix_adk", *args],
            env=env or self.env,
            capture_output=True,
            text=True,
            timeout=120,
        )
