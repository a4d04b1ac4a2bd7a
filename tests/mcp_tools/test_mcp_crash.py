"""A runner process killed with SIGKILL while the MCP server is inside the side-effecting
tool: the resume, in a new process, never sends that call again. Without a reconciler it
refuses the call as indeterminate, naming it; with one that asks the server by the call's
idempotency key, the call is settled from the server's own record."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from mcp_tools.servers import Effects
from tesserix_adk import open_stores
from tesserix_adk.stores.protocols import RecordStatus

pytestmark = pytest.mark.skipif(os.name != "posix", reason="needs POSIX signals")

AGENT_PROCESS = str(Path(__file__).with_name("agent_process.py"))


class Crash:
    """One test's store, effects file and hold directory, and the processes it started."""

    def __init__(self, tmp: Path) -> None:
        self.store = f"sqlite:///{tmp / 'adk.sqlite3'}"
        self.effects = Effects(tmp)
        self.hold = tmp / "hold"
        self.hold.mkdir()
        self.server_pid: int | None = None

    def process(self, run_id: str, *extra: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [sys.executable, AGENT_PROCESS, self.store, run_id, self.effects.path, *extra],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def kill_inside(self, run_id: str, tool: str = "book_seat") -> None:
        proc = self.process(run_id, "--hold", str(self.hold), "--hold-tool", tool)
        inside = self.hold / "inside"
        deadline = time.monotonic() + 30
        while not inside.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise AssertionError(f"never reached {tool}: {proc.communicate()}")
            time.sleep(0.02)
        self.server_pid = int(inside.read_text())
        os.kill(proc.pid, signal.SIGKILL)
        # The orphaned server shares the dead runner's stderr: it is ended before reading.
        self.release()
        proc.communicate(timeout=10)
        assert proc.returncode == -signal.SIGKILL

    def resume(self, run_id: str, *extra: str) -> tuple[int, str]:
        proc = self.process(run_id, "--resume", *extra)
        out, err = proc.communicate(timeout=60)
        return proc.returncode, out + err

    def release(self) -> None:
        """Let the orphaned server out of book_seat, and end it."""
        (self.hold / "release").write_text("")
        if self.server_pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.server_pid, signal.SIGKILL)

    async def record(self, run_id: str, tool: str = "book_seat") -> tuple[RecordStatus, str | None]:
        async with open_stores(self.store) as stores:
            records = await stores.idempotency.records("acme", run_id)
        (record,) = [r for r in records if r.tool == tool]
        return record.status, record.by


@pytest.fixture
def crash(tmp_path: Path) -> Iterator[Crash]:
    site = Crash(tmp_path)
    try:
        yield site
    finally:
        site.release()


async def test_killed_while_the_mcp_call_is_in_flight_the_resume_refuses_naming_it(
    crash: Crash,
) -> None:
    crash.kill_inside("r1")
    assert len(crash.effects.keys()) == 1
    code, out = crash.resume("r1")
    assert code == 4, out
    assert "ERROR IndeterminateToolCallError" in out and "book_seat" in out
    assert len(crash.effects.keys()) == 1
    assert (await crash.record("r1"))[0] is RecordStatus.in_flight


async def test_killed_while_the_mcp_call_is_in_flight_a_reconciler_settles_it_by_its_key(
    crash: Crash,
) -> None:
    crash.kill_inside("r2")
    (key,) = crash.effects.keys()
    code, out = crash.resume("r2", "--reconcile")
    assert code == 0, out
    assert "RESULT completed" in out
    assert crash.effects.keys() == [key]
    assert await crash.record("r2") == (RecordStatus.completed, "reconciler:book_seat")


async def test_killed_while_a_read_only_mcp_call_is_in_flight_the_resume_sends_it_again(
    crash: Crash,
) -> None:
    """readOnlyHint made it free of side effects, so sending it again is safe: the resume
    does, under the same key, and the run goes on to book exactly once."""
    crash.kill_inside("r3", "find_flights")
    (key,) = crash.effects.keys("find_flights")
    assert crash.effects.keys() == []
    code, out = crash.resume("r3")
    assert code == 0, out
    assert "RESULT completed" in out
    assert crash.effects.keys("find_flights") == [key, key]
    assert len(crash.effects.keys()) == 1
    assert (await crash.record("r3", "find_flights"))[0] is RecordStatus.completed
