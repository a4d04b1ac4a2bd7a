"""libpq's own protocol trace of every connection psycopg opens, for tests that count what
goes over the wire: each Sync or simple Query the client sends is answered by one
ReadyForQuery, which it waits for."""

from __future__ import annotations

import itertools
import os
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import pq


class Wire:
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
        self.read()
        return self.counted

    def read(self) -> list[str]:
        """The text of every simple Query sent since the last read (``waits`` counts them)."""
        queries: list[str] = []
        for conn in list(self.conns):
            path = conn._adk_trace
            if conn.pgconn.status == pq.ConnStatus.OK:
                conn.pgconn.untrace()  # flushes libpq's buffered stream
                self._trace(conn)
            else:
                self.conns.remove(conn)
            sent = [
                message.split("\t")
                for message in _messages(path.read_text(errors="replace"))
                if message.startswith("F\t")
            ]
            # Each Sync (a pipeline's end) and each simple Query is answered by one
            # ReadyForQuery, which the client waits for; a connection's start-up is not.
            self.counted += sum(fields[2:3] in (["Sync"], ["Query"]) for fields in sent)
            queries += ["\t".join(fields[3:]) for fields in sent if fields[2:3] == ["Query"]]
            path.unlink()
        return queries


def _messages(trace: str) -> list[str]:
    """The trace's messages: a query's newlines go into the trace as they are, so a line
    that starts with neither direction continues the message before it."""
    messages: list[str] = []
    for line in trace.splitlines():
        if line.startswith(("F\t", "B\t")) or not messages:
            messages.append(line)
        else:
            messages[-1] += "\n" + line
    return messages
