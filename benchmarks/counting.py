"""Counting what a durable turn costs, from outside the kit: commits, statements, round
trips and fsyncs, by backend. Nothing here is timed; ``turns.py`` counts in a pass of its
own, so the counting never slows a timed turn.

- SQLite: every connection the process opens (``sqlite3.connect``, which the kit, LangGraph
  and SQLAlchemy all call) gets a trace callback; COMMITs and statements are counted
  (``BEGIN``/``COMMIT`` apart). A round trip is a job the kit hands its SQLite thread
  (``SqliteDatabase.handoffs``: a hop there and back); for code that runs SQLite on the
  caller's thread (the floors, LangGraph, DBOS), a transaction.
- PostgreSQL: every psycopg connection gets a libpq protocol trace; a transaction is a
  ``ReadyForQuery`` back to idle, a writing transaction one that ran ``INSERT``, ``UPDATE``,
  ``DELETE`` or ``MERGE`` (also inside a CTE), a round trip each time the client, having
  sent (one message or a pipeline's batch), reads replies.
- Redis: ``INFO commandstats`` deltas on the benchmark's own server, and the commands or
  pipelines the client sends (counted on its connection class).
- fsyncs: ``strace -c`` attached to this process (SQLite) or to the Redis server, when
  strace is installed and may attach; otherwise left out, and said so.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import sqlite3
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any


@dataclass
class Counts:
    """What one window of work cost; ``None`` where it was not counted."""

    commits: int | None = None  # writing transactions committed
    transactions: int | None = None  # every transaction, reads included
    statements: int | None = None  # SQL statements or Redis commands, BEGIN/COMMIT apart
    round_trips: int | None = None
    fsyncs: int | None = None

    def per(self, n: int) -> dict[str, float | None]:
        return {k: None if v is None else v / n for k, v in self.__dict__.items()}


# --- SQLite ------------------------------------------------------------------------------

_WRITE = re.compile(r"\b(INSERT|UPDATE|DELETE|REPLACE|MERGE)\b", re.IGNORECASE)
_CONTROL = re.compile(r"^\s*(BEGIN|COMMIT|END|ROLLBACK|SAVEPOINT|RELEASE)\b", re.IGNORECASE)
_PREPARE = re.compile(r"PREPARE\s+(\w+)\s+AS\s+(.*)", re.IGNORECASE | re.DOTALL)
_EXECUTE = re.compile(r"EXECUTE\s+(\w+)", re.IGNORECASE)


class _SqliteTally:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.active = False
        self.commits = self.transactions = self.statements = self.hops = 0
        self.writing: dict[int, bool] = {}  # per connection: the open transaction wrote

    def trace(self, conn_id: int) -> Callable[[str], None]:
        def callback(sql: str) -> None:
            if not self.active or sql.startswith("--"):  # "--" marks a trigger's body
                return
            with self.lock:
                head = sql.lstrip()[:8].upper()
                if head.startswith(("COMMIT", "END")):
                    self.transactions += 1
                    if self.writing.pop(conn_id, False):
                        self.commits += 1
                elif head.startswith("ROLLBACK"):
                    self.writing.pop(conn_id, None)
                elif not _CONTROL.match(sql):
                    self.statements += 1
                    if _WRITE.search(sql):
                        self.writing[conn_id] = True

        return callback


_sqlite = _SqliteTally()


def trace_sqlite() -> None:
    """From now on, every new ``sqlite3`` connection of this process is counted in windows."""
    original = sqlite3.connect
    if getattr(original, "_bench_traced", False):
        return

    def connect(*args: Any, **kwargs: Any) -> sqlite3.Connection:
        conn = original(*args, **kwargs)
        conn.set_trace_callback(_sqlite.trace(id(conn)))
        return conn

    connect._bench_traced = True  # type: ignore[attr-defined]
    sqlite3.connect = connect  # type: ignore[assignment]
    sqlite3.dbapi2.connect = connect  # type: ignore[assignment]  # SQLAlchemy's way in

    from tesserix_adk.stores.sqlite.database import SqliteDatabase

    queue = SqliteDatabase._queue

    def counted(self: SqliteDatabase, call: Any) -> Any:
        if _sqlite.active:
            with _sqlite.lock:
                _sqlite.hops += 1
        return queue(self, call)

    SqliteDatabase._queue = counted  # type: ignore[method-assign]


@contextlib.contextmanager
def sqlite_window(fsync_pid: int | None = None) -> Iterator[Counts]:
    """Count SQLite commits and statements (and this process's fsyncs) while the block runs."""
    counts = Counts()
    with _sqlite.lock:
        _sqlite.active = True
        _sqlite.commits = _sqlite.transactions = _sqlite.statements = _sqlite.hops = 0
    with fsyncs(fsync_pid if fsync_pid is not None else os.getpid()) as synced:
        try:
            yield counts
        finally:
            with _sqlite.lock:
                _sqlite.active = False
                counts.commits = _sqlite.commits
                counts.transactions = _sqlite.transactions
                counts.statements = _sqlite.statements
                counts.round_trips = _sqlite.hops or _sqlite.transactions
    counts.fsyncs = synced[0]


# --- PostgreSQL --------------------------------------------------------------------------


class _PgTrace:
    """One psycopg connection's libpq trace, parsed window by window."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self.names: dict[str, str] = {}  # prepared statement name -> SQL
        self.unnamed = ""
        self.current = ""
        self.wrote = False
        self.last_side = ""
        self.path: str | None = None

    def start(self) -> None:
        from psycopg import pq

        fd, self.path = tempfile.mkstemp(prefix="pgtrace-")
        try:
            self.conn.pgconn.trace(fd)
            self.conn.pgconn.set_trace_flags(pq.Trace.SUPPRESS_TIMESTAMPS | pq.Trace.REGRESS_MODE)
        except Exception:
            os.close(fd)
            os.unlink(self.path)
            self.path = None

    def rotate(self, counts: Counts | None) -> None:
        """Read what was traced so far (counted into ``counts``, or only to learn the
        prepared statements' SQL) and trace on into a new file."""
        if self.path is None:
            return
        with contextlib.suppress(Exception):
            self.conn.pgconn.untrace()  # flushes the stream
        try:
            with open(self.path, encoding="utf-8", errors="replace") as f:
                message = ""
                for line in f:
                    # SQL with newlines spans several lines: a message starts with F or B.
                    if line.startswith(("F\t", "B\t")) and message:
                        self._line(message, counts)
                        message = ""
                    message += line
                if message:
                    self._line(message, counts)
        finally:
            os.unlink(self.path)
            self.path = None
        if not self.conn.closed:
            self.start()

    def _line(self, line: str, counts: Counts | None) -> None:
        parts = line.rstrip("\n").split("\t", 3)
        if len(parts) < 3:
            return
        side, kind, rest = parts[0], parts[2], parts[3] if len(parts) > 3 else ""
        # A round trip: the client sent (a batch, in pipeline mode) and now reads replies.
        if side == "B" and self.last_side == "F" and counts is not None:
            counts.round_trips = (counts.round_trips or 0) + 1
        self.last_side = side
        quoted = re.findall(r'"((?:[^"]|"")*)"', rest, re.DOTALL)
        if side == "F" and kind == "Parse" and len(quoted) >= 2:
            self.names[quoted[0]] = quoted[1]
        elif side == "F" and kind == "Bind" and len(quoted) >= 2:
            self.current = self.names.get(quoted[1], "")
        elif side == "F" and kind == "Query" and quoted:
            # Several statements in one message (a write group's write: its savepoint, the
            # statement, the release), joined by ";" and a newline, which the trace escapes.
            # The whole quoted text: a bound literal may hold a double quote of its own.
            text = rest.strip()
            text = text[1:-1] if len(text) > 1 and text[0] == text[-1] == '"' else quoted[0]
            for sql in re.split(r";(?:\\x0a|\n)", text):
                sql = sql.strip()
                # A group's statements are prepared by SQL once per connection and then
                # run as EXECUTE name(values): counted by what they run.
                prepared = _PREPARE.match(sql)
                if prepared is not None:
                    # Preparing writes nothing: counted as a statement, not as a write.
                    self.names[prepared.group(1)] = prepared.group(2)
                    sql = f"PREPARE {prepared.group(1)}"
                executed = _EXECUTE.match(sql)
                if executed is not None:
                    sql = self.names.get(executed.group(1), sql)
                if counts is not None:
                    self._statement(sql, counts)
        elif counts is None:
            return
        elif side == "F" and kind == "Execute":
            self._statement(self.current, counts)
        elif side == "B" and kind == "ReadyForQuery" and rest.strip() == "I":
            counts.transactions = (counts.transactions or 0) + 1
            if self.wrote:
                counts.commits = (counts.commits or 0) + 1
            self.wrote = False

    def _statement(self, sql: str, counts: Counts) -> None:
        if _CONTROL.match(sql):
            return
        counts.statements = (counts.statements or 0) + 1
        if _WRITE.search(sql):
            self.wrote = True


class _PgTally:
    def __init__(self) -> None:
        self.traces: list[_PgTrace] = []

    def add(self, conn: Any) -> None:
        trace = _PgTrace(conn)
        self.traces.append(trace)
        trace.start()


_pg = _PgTally()


def trace_postgres() -> None:
    """From now on, every new psycopg connection (sync or async) is counted in windows."""
    import psycopg

    if getattr(psycopg.Connection.connect, "_bench_traced", False):
        return
    sync_connect = psycopg.Connection.connect.__func__  # type: ignore[attr-defined]
    async_connect = psycopg.AsyncConnection.connect.__func__  # type: ignore[attr-defined]

    def connect(cls: Any, *args: Any, **kwargs: Any) -> Any:
        conn = sync_connect(cls, *args, **kwargs)
        _pg.add(conn)
        return conn

    async def aconnect(cls: Any, *args: Any, **kwargs: Any) -> Any:
        conn = await async_connect(cls, *args, **kwargs)
        _pg.add(conn)
        return conn

    connect._bench_traced = True  # type: ignore[attr-defined]
    psycopg.Connection.connect = classmethod(connect)  # type: ignore[method-assign,assignment]
    psycopg.AsyncConnection.connect = classmethod(aconnect)  # type: ignore[method-assign,assignment]
    psycopg.connect = psycopg.Connection.connect  # type: ignore[assignment]  # bound at import


@contextlib.contextmanager
def postgres_window() -> Iterator[Counts]:
    """Count PostgreSQL transactions, statements and round trips while the block runs.

    Start and end it while no statement is on the wire (between runs)."""
    counts = Counts(commits=0, transactions=0, statements=0, round_trips=0)
    for trace in _pg.traces:
        trace.rotate(None)
    _pg.traces = [t for t in _pg.traces if t.path is not None]
    try:
        yield counts
    finally:
        for trace in list(_pg.traces):
            trace.rotate(counts)


# --- Redis -------------------------------------------------------------------------------


@contextlib.contextmanager
def redis_round_trips() -> Iterator[list[int]]:
    """Commands or pipelines the clients (asyncio and sync) send while the block runs."""
    from redis.asyncio.connection import AbstractConnection

    count = [0]
    original = AbstractConnection.send_packed_command

    async def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        count[0] += 1
        return await original(self, *args, **kwargs)

    from redis.connection import AbstractConnection as SyncConnection

    sync_original = SyncConnection.send_packed_command

    def sync_counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        count[0] += 1
        return sync_original(self, *args, **kwargs)

    AbstractConnection.send_packed_command = counted  # type: ignore[method-assign]
    SyncConnection.send_packed_command = sync_counted  # type: ignore[method-assign]
    try:
        yield count
    finally:
        AbstractConnection.send_packed_command = original  # type: ignore[method-assign]
        SyncConnection.send_packed_command = sync_original  # type: ignore[method-assign]


def redis_commands(info: dict[str, Any]) -> int:
    """Commands the server ran, from ``INFO commandstats`` (the INFO calls left out)."""
    total = 0
    for name, stats in info.items():
        if name.startswith("cmdstat_") and name not in ("cmdstat_info",):
            total += int(stats["calls"])
    return total


# --- fsyncs ------------------------------------------------------------------------------


COUNT_FSYNCS = True  # turned off by ``--smoke``: attaching strace takes a while


def can_count_fsyncs() -> bool:
    return COUNT_FSYNCS and shutil.which("strace") is not None


@contextlib.contextmanager
def fsyncs(pid: int) -> Iterator[list[int | None]]:
    """fsync + fdatasync calls of process ``pid`` (all its threads) while the block runs;
    ``[None]`` when strace is missing or may not attach."""
    result: list[int | None] = [None]
    if not can_count_fsyncs():
        yield result
        return
    tids = os.listdir(f"/proc/{pid}/task") if os.path.isdir(f"/proc/{pid}/task") else [pid]
    command = ["strace", "-f", "-c", "-e", "trace=fsync,fdatasync"]
    for tid in tids:
        command += ["-p", str(tid)]
    proc = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    # strace says "Process N attached" once per thread; give it a moment to get there.
    time.sleep(0.3)
    try:
        yield result
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            _, err = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
        if "attached" in err:
            total = 0
            for line in err.splitlines():
                cells = line.split()
                if cells and cells[-1] in ("fsync", "fdatasync"):
                    # columns: % time, seconds, usecs/call, calls, [errors], syscall
                    total += int(cells[3])
            result[0] = total
