"""Round trips on the wire, read off libpq's own protocol trace: each reply PostgreSQL ends
with ReadyForQuery is one the client waited for. The conformance suites count the
statements a store executes; only the wire shows how many times it waited."""

from __future__ import annotations

import itertools
import os
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import pq

from tesserix_adk.adapters.postgres import open_postgres_stores
from tesserix_adk.stores.grouping import group_scope

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
            self.counted += sum(
                line.startswith("B\t") and line.split("\t")[2:3] == ["ReadyForQuery"]
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

        with group_scope():
            group = history.write_group()  # type: ignore[attr-defined]
            await group.begin()
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
