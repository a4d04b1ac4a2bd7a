"""Round trips on the wire, read off libpq's own protocol trace: each Sync or simple Query
the client sends is answered by one ReadyForQuery, which it waits for. The conformance
suites count the statements a store executes; only the wire shows how often it waited."""

from __future__ import annotations

import itertools
import os
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import pq

from adapters import services
from tesserix_adk import Agent, AgentRunner, ScriptedProvider, ScriptedTurn, tool
from tesserix_adk.adapters.postgres import open_postgres_stores

pytestmark = pytest.mark.postgres

T = "acme"


class _Wire:
    """Every connection psycopg opens from here on traces its protocol to a file."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, folder: Path) -> None:
        self.folder = folder
        self.conns: list[Any] = []
        self.counted = 0
        self._names = itertools.count()
        connect = psycopg.AsyncConnection.connect.__func__  # type: ignore[attr-defined]

        async def traced(cls: Any, *args: Any, **kwargs: Any) -> Any:
            conn = await connect(cls, *args, **kwargs)
            self._trace(conn)
            self.conns.append(conn)
            return conn

        monkeypatch.setattr(psycopg.AsyncConnection, "connect", classmethod(traced))

    def _trace(self, conn: Any) -> None:
        path = self.folder / f"trace-{next(self._names)}"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT)
        conn.pgconn.trace(fd)  # libpq owns the descriptor from here (fdopen)
        conn.pgconn.set_trace_flags(pq.Trace.SUPPRESS_TIMESTAMPS | pq.Trace.REGRESS_MODE)
        conn._adk_trace = path

    def waits(self) -> int:
        """Replies waited for so far, on every traced connection."""
        for conn in list(self.conns):
            path = conn._adk_trace
            if conn.pgconn.status == pq.ConnStatus.OK:
                conn.pgconn.untrace()  # flushes libpq's buffered stream
                self._trace(conn)
            else:
                self.conns.remove(conn)
            # Each Sync (a pipeline's end) and each simple Query is answered by one
            # ReadyForQuery, which the client waits for; a connection's start-up is not.
            self.counted += sum(
                line.startswith("F\t") and line.split("\t")[2:3] in (["Sync"], ["Query"])
                for line in path.read_text(errors="replace").splitlines()
            )
            path.unlink()
        return self.counted


async def test_a_write_waits_once_alone_and_once_in_a_group_whose_commit_waits_once(
    pg_url: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    wire = _Wire(monkeypatch, tmp_path)
    stores = open_postgres_stores(pg_url)
    try:
        await stores.create_schema()
        history = stores.history
        handle = await history.append(T, "warm", [b"{}"], fence=None, after=None)

        before = wire.waits()
        handle = await history.append(T, "warm", [b"{}"], fence=None, after=handle)
        assert wire.waits() - before == 1, "a write of its own"

        async with services.write_group(stores) as group:
            before = wire.waits()
            handle = await history.append(T, "grouped", [b"{}"], fence=None, after=None)
            assert wire.waits() - before == 1, "a group's first write (its BEGIN with it)"
            before = wire.waits()
            await history.append(T, "grouped", [b"{}"], fence=None, after=handle)
            assert wire.waits() - before == 1, "a group's next write"
            before = wire.waits()
            await group.commit()
            assert wire.waits() - before == 1, "the group's commit"
        assert len(await history.fetch(handle)) == 1
    finally:
        await stores.aclose()


def _turns(calls_per_turn: int, turns: int) -> list[Any]:
    script: list[Any] = [
        ScriptedTurn(calls=[("book", {"seat": f"{t}-{c}"}) for c in range(calls_per_turn)])
        for t in range(turns)
    ]
    return [*script, "done"]


async def _waits(url: str, wire: _Wire, calls: int, turns: int, run_id: str) -> int:
    @tool
    def book(seat: str) -> str:
        return f"booked {seat}"

    stores = open_postgres_stores(url)
    try:
        await stores.create_schema()
        runner = AgentRunner.from_stores(
            ScriptedProvider(_turns(calls, turns)), stores, group_writes=True
        )
        before = wire.waits()
        run = await runner.run(
            Agent("w", "b", tools=[book], max_iterations=20), "go", tenant=T, run_id=run_id
        )
        assert run.status == "completed"
        return wire.waits() - before
    finally:
        await stores.aclose()


@pytest.mark.parametrize(("calls", "per_turn"), [(1, 8), (3, 14)])
async def test_a_grouped_turn_waits_once_per_write_and_once_per_commit(
    pg_url: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, calls: int, per_turn: int
) -> None:
    """One call: the charge, the frontier with its transcript append (one pipeline), and
    the claim, then COMMIT (4); the outcome (its BEGIN with it), the next frontier with its
    append, and the cancel check, then COMMIT (4). Each further call: its claim with the
    outcome before it, then COMMIT (3). While the last outcome was written on its own, its
    COMMIT in the same round trip, the count was the same (one write fewer in the group,
    one round trip of its own) with one commit more; in a group of its own it cost one
    more (11 and 17), and the frontier's append and put one each (19 before either)."""
    wire = _Wire(monkeypatch, tmp_path)
    short = await _waits(pg_url, wire, calls, 2, "short")
    long = await _waits(pg_url, wire, calls, 6, "long")
    assert (long - short) / 4 == per_turn
