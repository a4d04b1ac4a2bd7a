"""Attacks on a write group's first call (``SqliteWriteGroup._here``): where it begins its
transaction, and what everybody else's calls meet meanwhile.

Commit 4ff896e began that transaction on the caller's thread (the event loop) when the file
looked free (``BEGIN IMMEDIATE`` with ``PRAGMA busy_timeout = 0``). This attack found it
broke three promises, and it was reverted: a call waiting for a group was overtaken by the
same loop's next group again and again (starved); a write already queued for the thread was
overtaken by a group, and one the group itself awaited hung; and ``BEGIN IMMEDIATE`` still
sleeps in SQLite's own retry loop while another process holds the WAL index's read locks,
whatever the busy timeout, which on the loop stops it. Those tests (``# --- defects``)
failed on 4ff896e and pass since its revert; they stay, for any later try. The rest are
promises that held then and hold now: nothing lost, doubled or left open, and whole runs
send every call once. Durability is looked at through a second connection, as another
process would."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import select
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sqlite_writes import fills_the_disk, noting_thread, on_loops_in_threads, put, stored_rows
from tesserix_adk import Agent, AgentRunner, ScriptedProvider, ScriptedTurn, ToolContext, tool
from tesserix_adk.errors import (
    ConfigurationError,
    IndeterminateToolCallError,
    NoCheckpointError,
    ResumeConflictError,
)
from tesserix_adk.stores.grouping import group_scope, outside_scope
from tesserix_adk.stores.protocols import RecordStatus
from tesserix_adk.stores.sqlite import SqliteDatabase
from tesserix_adk.stores.sqlite.grouping import INLINE_BYTES
from tesserix_adk.stores.urls import open_stores

LIMIT = 3.0  # seconds a caller may wait before it counts as hung
TENANT = "t"


# --- helpers ------------------------------------------------------------------------------


def _in_order(path: str) -> list[str]:
    """The ledger's run ids in the order they were inserted (rowid)."""
    with contextlib.closing(sqlite3.connect(path)) as conn:
        return [r[0] for r in conn.execute("SELECT run_id FROM adk_ledger ORDER BY rowid")]


async def _loop_runs_while(task: asyncio.Future[Any], ticks: int = 20) -> bool:
    """Whether the loop ticked ``ticks`` times (5 ms sleeps) with ``task`` still pending."""
    counted = 0
    for _ in range(ticks):
        await asyncio.sleep(0.005)
        counted += 1
    return counted == ticks and not task.done()


def _write_lock_free(path: str) -> bool:
    """Whether another connection (as another process) can take the file's write lock."""
    with contextlib.closing(sqlite3.connect(path, timeout=0, isolation_level=None)) as other:
        try:
            other.execute("BEGIN IMMEDIATE")
        except sqlite3.OperationalError:
            return False
        other.execute("ROLLBACK")
        return True


async def _busy_timeout(db: SqliteDatabase) -> int:
    """The connection's busy timeout (ms), read in the worker thread."""
    return int(
        await asyncio.wait_for(
            db._submit(lambda: db._connection().execute("PRAGMA busy_timeout").fetchone()[0]),
            LIMIT,
        )
    )


# Another process: it takes the byte-range locks SQLite's unix VFS keeps in the WAL index
# (the -shm file: 120 the write lock, 121 the checkpoint lock, 122 the recovery lock, 123-127
# the five read locks), optionally zeroes the index header (as a recovery finds it), and holds
# them until a line on stdin (or the timeout).
_SHM_HOLDER = textwrap.dedent(
    """
    import fcntl, os, select, sys
    fd = os.open(sys.argv[1] + "-shm", os.O_RDWR)
    for byte in sys.argv[2].split(","):
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, int(byte))
    if sys.argv[3] == "zero":
        os.pwrite(fd, bytes(136), 0)
    print("locked", flush=True)
    select.select([sys.stdin], [], [], float(sys.argv[4]))
    """
)


# Another process writing: BEGIN IMMEDIATE, a row, then COMMIT once told on stdin (or the
# timeout); killed instead by the test where it says so.
class _Process:
    """A helper process started by a test: told to go on with ``release()``."""

    def __init__(self, script: str, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", script, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], 10 * LIMIT)
        assert ready and self.proc.stdout.readline().strip() == "locked"

    def release(self) -> None:
        assert self.proc.stdin is not None
        with contextlib.suppress(BrokenPipeError, ValueError):
            self.proc.stdin.write("go\n")
            self.proc.stdin.flush()

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)

    def close(self) -> None:
        self.release()
        try:
            self.proc.wait(2 * LIMIT)
        finally:
            for pipe in (self.proc.stdin, self.proc.stdout):
                if pipe is not None:
                    with contextlib.suppress(BrokenPipeError):
                        pipe.close()


@contextlib.contextmanager
def _process(script: str, *args: str) -> Iterator[_Process]:
    proc = _Process(script, *args)
    try:
        yield proc
    finally:
        proc.close()


# --- defects of 4ff896e, fixed by its revert ----------------------------------------------

GROUPS = 40


@pytest.mark.parametrize("kind", ["write", "read", "group"])
async def test_a_call_waiting_for_a_group_lands_before_the_same_loops_next_group(
    database: SqliteDatabase, kind: str
) -> None:
    await database.verify()
    inside = [asyncio.Event() for _ in range(GROUPS)]
    counted: dict[int, int] = {}

    async def grouper() -> None:
        for i in range(GROUPS):
            with group_scope():
                group = database.write_group()
                await group.begin()
                await database.write(put(f"g{i:03}"), weight=0)
                inside[i].set()
                for _ in range(3):  # the loop does something else inside the group
                    await asyncio.sleep(0)
                await group.commit()

    async def waiting(k: int) -> None:
        key = f"w{k:03}"
        if kind == "write":
            await database.write(put(key))
        elif kind == "read":
            counted[k] = await database.read(
                lambda c: c.execute("SELECT count(*) FROM adk_ledger").fetchone()[0]
            )
        else:  # another run's group whose first call is large: it goes to the thread
            with group_scope():
                group = database.write_group()
                await group.begin()
                await database.write(put(key), weight=None)
                await group.commit()

    waiters: list[asyncio.Task[None]] = []

    async def start_waiters() -> None:
        for k in range(0, GROUPS, 2):
            await inside[k].wait()  # group k holds the connection: this call waits for it
            waiters.append(asyncio.create_task(waiting(k)))

    await asyncio.wait_for(asyncio.gather(grouper(), start_waiters()), 10 * LIMIT)
    await asyncio.wait_for(asyncio.gather(*waiters), LIMIT)
    if kind == "read":
        after = counted
    else:
        order = _in_order(database.path)
        after = {
            int(key[1:]): sum(1 for r in order[:n] if r.startswith("g"))
            for n, key in enumerate(order)
            if key.startswith("w")
        }
    # Each landed right after the group it waited for committed, before the next group.
    assert after == {k: k + 1 for k in range(0, GROUPS, 2)}


async def test_a_write_queued_for_the_thread_before_a_groups_first_call_lands_before_the_group(
    database: SqliteDatabase,
) -> None:
    await database.verify()
    for i in range(20):
        with outside_scope():  # another run's write
            plain = asyncio.create_task(database.write(put(f"p{i:02}")))
        await asyncio.sleep(0)  # it is queued for the thread now
        with group_scope():
            group = database.write_group()
            await group.begin()
            await database.write(put(f"q{i:02}"), weight=0)
            await asyncio.sleep(0)
            await asyncio.wait_for(group.commit(), LIMIT)
        await asyncio.wait_for(plain, LIMIT)
    order = _in_order(database.path)
    assert order == [key for i in range(20) for key in (f"p{i:02}", f"q{i:02}")]


async def test_a_groups_first_call_leaves_the_loop_while_another_process_holds_the_wal_read_locks(
    database: SqliteDatabase,
) -> None:
    await database.write(put("warm"))  # the connection is open; the WAL holds a commit
    seen: dict[str, str] = {}
    locks = "123,124,125,126,127"
    with _process(_SHM_HOLDER, database.path, locks, "-", "2") as holder, group_scope():
        group = database.write_group()
        await group.begin()
        write = asyncio.create_task(database.write(noting_thread("a", seen), weight=0))
        try:
            # The loop goes on while the other process holds the lock; the write lands
            # once it lets go.
            running = await _loop_runs_while(write)
            holder.release()
            assert await asyncio.wait_for(write, LIMIT) == "a"
        finally:
            holder.release()
            await asyncio.wait_for(asyncio.gather(write, return_exceptions=True), LIMIT)
            await asyncio.wait_for(group.commit(), LIMIT)
    assert running, f"the loop stopped while another process held the lock ({seen})"
    assert stored_rows(database.path) == ["a", "warm"]
    assert _write_lock_free(database.path)


# --- what held: the busy timeout, and files the loop must not begin on ----------------------


async def test_a_groups_first_call_on_a_file_out_of_wal_mode_never_begins_on_the_loop(
    database: SqliteDatabase,
) -> None:
    with contextlib.closing(sqlite3.connect(database.path, isolation_level=None)) as other:
        assert other.execute("PRAGMA journal_mode = DELETE").fetchone()[0] == "delete"
    db = SqliteDatabase(database.path, synchronous="normal")
    seen: dict[str, str] = {}
    try:
        await db.verify()
        with group_scope():
            group = db.write_group()
            await group.begin()
            await db.write(noting_thread("a", seen), weight=0)
            await db.write(noting_thread("b", seen), weight=0)
            await group.commit()
        assert all(name.startswith("tesserix-sqlite") for name in seen.values()), seen
        assert stored_rows(db.path) == ["a", "b"]
        assert await _busy_timeout(db) == 5000
    finally:
        await db.aclose()


async def test_a_groups_first_call_on_a_connection_not_yet_open_begins_in_the_thread(
    database: SqliteDatabase,
) -> None:
    db = SqliteDatabase(database.path, synchronous="normal")
    seen: dict[str, str] = {}
    try:
        with group_scope():
            group = db.write_group()
            await group.begin()
            await db.write(noting_thread("a", seen), weight=0)  # opens the file, in the thread
            await db.write(noting_thread("b", seen), weight=0)  # the transaction is open: here
            await group.commit()
        assert seen["a"].startswith("tesserix-sqlite")
        assert seen["b"] == threading.current_thread().name
        assert stored_rows(db.path) == ["a", "b"]
    finally:
        await db.aclose()


async def test_a_read_only_connection_tells_a_groups_first_write_as_the_thread_does(
    database: SqliteDatabase,
) -> None:
    """The connection ``_connection`` opens read-only where the directory may not be written
    (root here may write anything, so it is opened so by hand): BEGIN IMMEDIATE itself
    succeeds on it, so the group begins on the loop, and the write is refused as in the
    thread, the group's commit holds nothing, and nothing is left open."""
    await database.write(put("before"))

    def read_only() -> bool:
        assert database._conn is not None
        database._conn.close()
        database._conn = database._checked("ro")
        (mode,) = database._conn.execute("PRAGMA journal_mode").fetchone()
        database._wal = str(mode).lower() == "wal"
        return database._wal

    assert await database._submit(read_only)
    told: dict[int | None, tuple[str, str]] = {}
    for weight in (0, None):
        with group_scope():
            group = database.write_group()
            await group.begin()
            with pytest.raises(ConfigurationError) as caught:
                await database.write(put(f"x-{weight}"), weight=weight)
            told[weight] = (type(caught.value).__name__, str(caught.value))
            await asyncio.wait_for(group.commit(), LIMIT)
        assert await _busy_timeout(database) == 5000
        assert database._held is None
        assert await database._submit(lambda: database._connection().in_transaction) is False
    assert told[0] == told[None]
    assert "read-only" in told[0][1]
    assert stored_rows(database.path) == ["before"]
    assert _write_lock_free(database.path)


# --- what held: other processes ------------------------------------------------------------


async def test_a_first_call_meeting_a_recovery_in_another_process_waits_in_the_thread(
    database: SqliteDatabase,
) -> None:
    """SQLITE_BUSY_RECOVERY: another process recovering the WAL index (it holds the write and
    recovery locks, the index header is not valid yet). BEGIN here gives up at once; the
    thread waits, then recovers the index itself; every committed row is still there."""
    for key in ("w1", "w2", "w3"):
        await database.write(put(key))
    seen: dict[str, str] = {}
    holder = _process(_SHM_HOLDER, database.path, "120,122", "zero", "5")
    with holder as recovering, group_scope():
        group = database.write_group()
        await group.begin()
        write = asyncio.create_task(database.write(noting_thread("a", seen), weight=0))
        assert await _loop_runs_while(write)
        recovering.release()
        assert await asyncio.wait_for(write, LIMIT) == "a"
        await group.commit()
    assert seen["a"].startswith("tesserix-sqlite")
    assert stored_rows(database.path) == ["a", "w1", "w2", "w3"]
    assert await _busy_timeout(database) == 5000


_GROUPING_PROCESS = textwrap.dedent(
    """
    import asyncio, random, sys
    sys.path[:0] = sys.argv[4].split(":")
    from sqlite_writes import put
    from tesserix_adk.stores.grouping import group_scope, outside_scope
    from tesserix_adk.stores.sqlite import SqliteDatabase

    async def main(path, tag, rounds):
        rng = random.Random(tag)
        db = SqliteDatabase(path, synchronous="normal")
        try:
            for i in range(rounds):
                keys = [f"{tag}-{i:03}-{j}" for j in range(rng.randint(1, 3))]
                if rng.random() < 0.25:
                    await db.write(put(keys[0]))
                    print("acked", keys[0], flush=True)
                    continue
                print("group", *keys, flush=True)
                with group_scope():
                    group = db.write_group()
                    await group.begin()
                    for key in keys:
                        await db.write(put(key), weight=rng.choice([0, 0, 0, None]))
                        if rng.random() < 0.5:
                            await asyncio.sleep(rng.random() * 0.002)
                    await group.commit()
                print("acked", *keys, flush=True)
        finally:
            await db.aclose()
        print("done", flush=True)

    asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
    """
)


def test_groups_of_several_processes_on_one_file_land_whole_and_once_with_one_killed(
    database: SqliteDatabase,
) -> None:
    """Three processes grouping writes on one file (each group begins here when the file
    is free, in the thread when another holds it), one SIGKILLed part way: whatever a
    process was told is durable, every group is all there or not at all, nothing twice,
    and the others finish."""
    tests = str(Path(__file__).resolve().parent.parent)
    src = os.pathsep.join([tests, *sys.path])
    procs = {
        tag: subprocess.Popen(
            [sys.executable, "-c", _GROUPING_PROCESS, database.path, tag, "120", src],
            stdout=subprocess.PIPE,
            text=True,
        )
        for tag in ("p0", "p1", "p2")
    }
    acked: list[str] = []  # what each process was told is durable
    grouped: list[list[str]] = []  # each group's keys, said before it began
    done: set[str] = set()

    def note(line: list[str], tag: str) -> None:
        if line[0] == "acked":
            acked.extend(line[1:])
        elif line[0] == "group":
            grouped.append(line[1:])
        elif line[0] == "done":
            done.add(tag)

    try:
        victim = procs["p1"]
        assert victim.stdout is not None
        told = 0
        while told < 30:  # it is well inside its rounds, the others running too
            line = victim.stdout.readline().split()
            assert line, "the process to kill ended early"
            note(line, "p1")
            told += line[0] == "acked"
        victim.send_signal(signal.SIGKILL)
        for tag, proc in procs.items():
            assert proc.stdout is not None
            for raw in proc.stdout:
                note(raw.split(), tag)
            proc.wait(10 * LIMIT)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
    assert done == {"p0", "p2"}, "a process that was not killed did not finish"
    rows = stored_rows(database.path)
    assert len(rows) == len(set(rows)), "a write landed twice"
    assert set(acked) <= set(rows), sorted(set(acked) - set(rows))
    # Every group is whole: all its keys or none (the killed process's last one too).
    for keys in grouped:
        assert len(set(keys) & set(rows)) in (0, len(keys)), keys
    assert len(grouped) > 100
    assert _write_lock_free(database.path)


# --- what held: everybody else, and how a group ends ---------------------------------------


async def _until(condition: Callable[[], bool]) -> None:
    for _ in range(int(LIMIT / 0.002)):
        if condition():
            return
        await asyncio.sleep(0.002)
    raise AssertionError("never came")


async def test_aclose_while_the_loop_is_inside_an_inline_begun_call_loses_the_group_truthfully(
    database: SqliteDatabase,
) -> None:
    await database.verify()
    inside, go = threading.Event(), threading.Event()

    def slow(conn: sqlite3.Connection) -> str:
        put("a")(conn)
        inside.set()
        go.wait(LIMIT)  # on the loop's thread, holding the lock: the close waits for it
        return "a"

    def closer() -> None:
        assert inside.wait(LIMIT)
        loop = asyncio.new_event_loop()
        try:
            closing = loop.create_task(database.aclose())
            loop.call_later(0.05, go.set)
            loop.run_until_complete(asyncio.wait_for(closing, 2 * LIMIT))
        finally:
            loop.close()

    thread = threading.Thread(target=closer)
    thread.start()
    try:
        with group_scope():
            group = database.write_group()
            await group.begin()
            assert await database.write(slow, weight=0) == "a"  # it began here
            with pytest.raises(ConfigurationError, match="closed"):
                await database.write(put("b"), weight=0)
            with pytest.raises(ConfigurationError, match="closed"):
                await asyncio.wait_for(group.commit(), LIMIT)
    finally:
        go.set()
        await asyncio.to_thread(thread.join, 2 * LIMIT)
    assert not thread.is_alive()
    assert database._conn is None and database._held is None
    assert stored_rows(database.path) == []
    assert _write_lock_free(database.path)


async def test_aclose_after_an_inline_begin_tells_the_group_and_whoever_waits_for_it(
    database: SqliteDatabase,
) -> None:
    await database.verify()
    with group_scope():
        group = database.write_group()
        await group.begin()
        await database.write(put("a"), weight=0)
        with outside_scope():  # another run's write: it does not join the group
            waiting = asyncio.create_task(database.write(put("plain")))
        await _until(lambda: len(database._waiting) == 1)
        await database.aclose()
        with pytest.raises(ConfigurationError, match="closed"):
            await asyncio.wait_for(waiting, LIMIT)
        with pytest.raises(ConfigurationError, match="closed"):
            await asyncio.wait_for(group.commit(), LIMIT)
    assert stored_rows(database.path) == []
    assert _write_lock_free(database.path)


# --- against an oracle: the same calls, every first call begun in the thread ----------------

_CALL = st.tuples(
    st.sampled_from(["write", "fail", "bad-sql", "read", "full"]),
    st.sampled_from([0, INLINE_BYTES + 1, None]),
)
_GROUP = st.tuples(st.sampled_from(["free", "contended"]), st.lists(_CALL, min_size=1, max_size=5))


def _failing(key: str, why: str) -> Callable[[sqlite3.Connection], str]:
    def fn(conn: sqlite3.Connection) -> str:
        put(key)(conn)
        if why == "fail":
            raise ValueError("refused by the write")
        if why == "bad-sql":
            conn.execute("INSERT INTO no_such_table VALUES (1)")
        fills_the_disk(conn)
        return key

    return fn


async def _told(
    db: SqliteDatabase, groups: list[tuple[str, list[Any]]], *, inline: bool
) -> list[Any]:
    """What each call, each commit and another run's write waiting for the group were told.
    A contended group's first call meets another connection holding the write lock."""
    told: list[Any] = []

    def said(exc: Exception) -> tuple[str, str]:
        return (type(exc).__name__, str(exc).replace(db.path, "<file>"))

    for g, (first, calls) in enumerate(groups):
        other = None
        if first == "contended":
            other = sqlite3.connect(db.path, isolation_level=None)
            other.execute("BEGIN IMMEDIATE")
            put(f"g{g}-other")(other)
        try:
            with group_scope():
                group = db.write_group()
                await group.begin()
                plain: asyncio.Task[str] | None = None
                for c, (kind, weight) in enumerate(calls):
                    key = f"g{g}-c{c}"
                    fn: Callable[[sqlite3.Connection], Any] = (
                        put(key)
                        if kind == "write"
                        else (
                            (
                                lambda conn: [
                                    r[0]
                                    for r in conn.execute(
                                        "SELECT run_id FROM adk_ledger ORDER BY run_id"
                                    )
                                ]
                            )
                            if kind == "read"
                            else _failing(key, kind)
                        )
                    )
                    call = db.read if kind == "read" else db.write
                    task = asyncio.create_task(call(fn, weight=weight if inline else None))
                    if other is not None:
                        await _loop_runs_while(task, 3)
                        other.execute("COMMIT")
                        other.close()
                        other = None
                    try:
                        told.append(await asyncio.wait_for(task, LIMIT))
                    except Exception as exc:
                        told.append(said(exc))
                    if plain is None:
                        with outside_scope():  # another run's: it waits for the commit
                            plain = asyncio.create_task(db.write(put(f"g{g}-plain")))
                try:
                    await asyncio.wait_for(group.commit(), LIMIT)
                    told.append("committed")
                except Exception as exc:
                    told.append(said(exc))
                assert plain is not None
                told.append(await asyncio.wait_for(plain, LIMIT))
        finally:
            if other is not None:
                other.close()
    told.append(await _busy_timeout(db))
    return told


@settings(
    max_examples=20,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(groups=st.lists(_GROUP, min_size=1, max_size=4))
def test_groups_begun_here_or_refused_here_answer_and_commit_as_the_thread_would(
    tmp_path_factory: pytest.TempPathFactory, groups: list[tuple[str, list[Any]]]
) -> None:
    async def both() -> list[tuple[list[Any], list[str]]]:
        results = []
        for inline in (True, False):
            db = SqliteDatabase(tmp_path_factory.mktemp("b") / "adk.sqlite3", synchronous="normal")
            await db.create_schema()
            try:
                await db.verify()
                told = await _told(db, groups, inline=inline)
            finally:
                await db.aclose()
            results.append((told, _in_order(db.path)))
        return results

    (told_inline, rows_inline), (told_thread, rows_thread) = asyncio.run(both())
    assert told_inline == told_thread
    assert rows_inline == rows_thread


# --- several event loops in threads ---------------------------------------------------------


def test_groups_begun_here_in_the_thread_or_on_a_read_from_several_loops_all_land_once(
    tmp_path: Path,
) -> None:
    db = SqliteDatabase(tmp_path / "adk.sqlite3", synchronous="normal")
    asyncio.run(db.create_schema())
    acked: list[str] = []
    timeouts: list[int] = []
    lock = threading.Lock()

    async def worker(w: int) -> None:
        rng = random.Random(w)
        await db.verify()
        for i in range(30):
            kind = rng.choice(["plain", "read", "here", "thread", "read-first", "failing"])
            if kind == "plain":
                key = await db.write(put(f"w{w}-{i:02}"))
                with lock:
                    acked.append(key)
                continue
            if kind == "read":
                await db.read(lambda c: c.execute("SELECT count(*) FROM adk_ledger").fetchone())
                continue
            keys = [f"w{w}-{i:02}-{j}" for j in range(3)]
            with group_scope():
                group = db.write_group()
                await group.begin()
                if kind == "read-first":
                    await db.read(lambda c: c.execute("SELECT 1").fetchone(), weight=0)
                if kind == "failing":
                    with pytest.raises(ValueError):
                        await db.write(_failing(f"w{w}-{i:02}-x", "fail"), weight=0)
                for j, key in enumerate(keys):
                    weight = None if kind == "thread" and j == 0 else 0
                    await db.write(put(key), weight=weight)
                    if rng.random() < 0.3:
                        await asyncio.sleep(0)
                await group.commit()
            with lock:
                acked.extend(keys)
        seen = await db.read(lambda c: c.execute("PRAGMA busy_timeout").fetchone()[0])
        with lock:
            timeouts.append(seen)

    on_loops_in_threads(db, worker, acked, limit=LIMIT)
    assert timeouts == [5000] * 4
    assert _write_lock_free(db.path)


# --- whole runs -----------------------------------------------------------------------------


def _durable_before_sent(path: str, tenant: str, key: str, run_id: str) -> bool:
    """Whether, seen from another connection, the call's claim and the turn's charge are
    committed (as they must be before the call is sent)."""
    with contextlib.closing(sqlite3.connect(path)) as other:
        row = other.execute(
            "SELECT status FROM adk_idempotency WHERE tenant = ? AND key = ?", (tenant, key)
        ).fetchone()
        charged = other.execute(
            "SELECT count(*) FROM adk_ledger WHERE run_id = ?", (run_id,)
        ).fetchone()[0]
    return row is not None and row[0] == RecordStatus.in_flight.value and charged > 0


def _script(run_id: str, turns: int = 4, calls: int = 2) -> list[Any]:
    return [
        *(
            ScriptedTurn(
                calls=[("book", {"seat": f"{run_id}-{t}-{c}"}) for c in range(calls)],
                cost_micros=1,
            )
            for t in range(turns)
        ),
        "done",
    ]


def test_grouped_runs_on_loops_in_threads_sharing_one_file_send_every_call_once(
    tmp_path: Path, grouped_writes: None
) -> None:
    path = str(tmp_path / "adk.sqlite3")
    stores = open_stores(f"sqlite:///{path}")
    asyncio.run(stores.create_schema())
    sent: list[tuple[str, str]] = []
    not_durable: list[str] = []
    lock = threading.Lock()

    @tool
    async def book(seat: str, ctx: ToolContext) -> str:
        if not _durable_before_sent(path, ctx.tenant, ctx.idempotency_key or "", ctx.run_id):
            not_durable.append(seat)
        with lock:
            sent.append((ctx.run_id, seat))
        await asyncio.sleep(0)
        return f"booked {seat}"

    agent = Agent("g", "b", tools=[book], max_iterations=50)
    statuses: list[str] = []
    failures: list[str] = []

    def worker(w: int) -> None:
        async def go() -> list[str]:
            runs = await asyncio.gather(
                *(
                    AgentRunner.from_stores(ScriptedProvider(_script(f"w{w}r{i}")), stores).run(
                        agent, "go", tenant=TENANT, run_id=f"w{w}r{i}"
                    )
                    for i in range(3)
                )
            )
            return [str(r.status) for r in runs]

        try:
            got = asyncio.run(asyncio.wait_for(go(), 10 * LIMIT))
            with lock:
                statuses.extend(got)
        except BaseException as exc:  # reported below
            failures.append(repr(exc))

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(3)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(12 * LIMIT)
        assert not any(t.is_alive() for t in threads), "a run hangs"
        assert not failures, failures
    finally:
        asyncio.run(stores.aclose())
    assert statuses == ["completed"] * 9
    assert not_durable == []
    assert len(sent) == len(set(sent)) == 9 * 8, "a call was sent twice, or not at all"
    assert _write_lock_free(path)


_RUNNING_PROCESS = textwrap.dedent(
    """
    import asyncio, contextlib, sqlite3, sys
    sys.path[:0] = sys.argv[3].split(":")
    from tesserix_adk import Agent, AgentRunner, ScriptedProvider, ScriptedTurn, ToolContext, tool
    from tesserix_adk.leases import LeasePolicy
    from tesserix_adk.stores.urls import open_stores

    path, tag = sys.argv[1], sys.argv[2]

    def script(run_id):
        return [
            *(
                ScriptedTurn(
                    calls=[("book", {"seat": f"{run_id}-{t}-{c}"}) for c in range(2)],
                    cost_micros=1,
                )
                for t in range(6)
            ),
            "done",
        ]

    @tool
    async def book(seat: str, ctx: ToolContext) -> str:
        with contextlib.closing(sqlite3.connect(path)) as other:
            row = other.execute(
                "SELECT status FROM adk_idempotency WHERE tenant = ? AND key = ?",
                (ctx.tenant, ctx.idempotency_key),
            ).fetchone()
        print("sent", ctx.run_id, seat, row[0] if row else "none", flush=True)
        await asyncio.sleep(0.001)
        return f"booked {seat}"

    async def main():
        agent = Agent("g", "b", tools=[book], max_iterations=50)
        async with open_stores(f"sqlite:///{path}") as stores:
            runs = await asyncio.gather(
                *(
                    AgentRunner.from_stores(
                        ScriptedProvider(script(f"{tag}r{i}")),
                        stores,
                        group_writes=True,
                        lease_policy=LeasePolicy(ttl=1.0, renew_within=0.5),
                    ).run(agent, "go", tenant="t", run_id=f"{tag}r{i}")
                    for i in range(3)
                )
            )
        print("done", *sorted(str(r.status) for r in runs), flush=True)

    asyncio.run(main())
    """
)


def _run_in_processes(path: str) -> tuple[list[tuple[str, str]], list[str], dict[str, str]]:
    """``_RUNNING_PROCESS`` as processes a, b, c, b SIGKILLed after its 10th line: the calls
    each sent, those whose claim was not durable when sent, and what the others finished."""
    src = os.pathsep.join(sys.path)
    procs = {
        tag: subprocess.Popen(
            [sys.executable, "-c", _RUNNING_PROCESS, path, tag, src],
            stdout=subprocess.PIPE,
            text=True,
        )
        for tag in ("a", "b", "c")
    }
    sent: list[tuple[str, str]] = []
    not_durable: list[str] = []
    done: dict[str, str] = {}

    def note(tag: str, line: list[str]) -> None:
        if line and line[0] == "sent":
            sent.append((line[1], line[2]))
            if line[3] != "in_flight":
                not_durable.append(line[2])
        elif line and line[0] == "done":
            done[tag] = " ".join(line[1:])

    try:
        victim = procs["b"]
        assert victim.stdout is not None
        for _ in range(10):  # part way through its runs
            note("b", victim.stdout.readline().split())
        victim.send_signal(signal.SIGKILL)
        for tag, proc in procs.items():
            assert proc.stdout is not None
            for raw in proc.stdout:
                note(tag, raw.split())
            proc.wait(10 * LIMIT)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
    return sent, not_durable, done


async def test_grouped_runs_in_several_processes_one_killed_send_every_call_at_most_once(
    tmp_path: Path, grouped_writes: None
) -> None:
    """Three processes running grouped runs on one file, one SIGKILLed part way; then its
    runs are resumed here. No call is sent twice, each was claimed durably before it was
    sent, the others finish, and each killed run completes or refuses a call in doubt."""
    path = str(tmp_path / "adk.sqlite3")
    async with open_stores(f"sqlite:///{path}") as stores:
        await stores.create_schema()
    sent, not_durable, done = await asyncio.to_thread(_run_in_processes, path)
    assert set(done) == {"a", "c"}, done
    assert all(statuses == " ".join(["completed"] * 3) for statuses in done.values()), done

    @tool
    async def book(seat: str, ctx: ToolContext) -> str:
        if not _durable_before_sent(path, ctx.tenant, ctx.idempotency_key or "", ctx.run_id):
            not_durable.append(seat)
        sent.append((ctx.run_id, seat))
        return f"booked {seat}"

    agent = Agent("g", "b", tools=[book], max_iterations=50)
    finished: dict[str, str] = {}
    async with open_stores(f"sqlite:///{path}") as stores:
        for i in range(3):
            run_id = f"br{i}"
            script: list[Any] = [
                *(
                    ScriptedTurn(
                        calls=[("book", {"seat": f"{run_id}-{t}-{c}"}) for c in range(2)],
                        cost_micros=1,
                    )
                    for t in range(6)
                ),
                "done",
            ]
            for _ in range(40):  # the dead process's lease lapses within its 1 s ttl
                again = AgentRunner.from_stores(ScriptedProvider(script), stores)
                try:
                    run = await asyncio.wait_for(again.resume(agent, run_id, tenant=TENANT), LIMIT)
                except NoCheckpointError:
                    run = await asyncio.wait_for(
                        again.run(agent, "go", tenant=TENANT, run_id=run_id), LIMIT
                    )
                except IndeterminateToolCallError:
                    finished[run_id] = "in doubt"
                    break
                except ResumeConflictError:
                    await asyncio.sleep(0.1)
                    continue
                finished[run_id] = str(run.status)
                break
    assert set(finished) == {"br0", "br1", "br2"}, finished
    assert not_durable == []
    assert len(sent) == len(set(sent)), "a call was sent twice"
    for run_id, status in finished.items():
        assert status in ("completed", "in doubt"), (run_id, status)
        if status == "completed":
            assert sorted(s for r, s in sent if r == run_id) == sorted(
                f"{run_id}-{t}-{c}" for t in range(6) for c in range(2)
            )
    for tag in ("a", "c"):
        for i in range(3):
            assert len([s for r, s in sent if r == f"{tag}r{i}"]) == 12
    assert _write_lock_free(path)
