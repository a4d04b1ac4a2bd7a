"""Attacks on SQLite write groups whose small calls run on the caller's thread (commit
1ac9a1d, ``stores/sqlite/grouping.py``): the group takes the connection at its first call
(in the worker thread), and once its transaction is open a call of ``weight`` at most
``INLINE_BYTES`` runs on the event loop's thread under ``SqliteDatabase._lock``.

Every test states a promise the feature makes (each call told its value or its error
truthfully, durable exactly when acknowledged, nothing held or left open after, no hang, the
event loop never blocked on the connection); the ones that found a defect say so above them
(all fixed since). Durability is looked at through a second connection, as
another process would."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from sqlite_writes import fills_the_disk, interrupts_itself, put, stored_rows
from tesserix_adk import Agent, AgentRunner, ScriptedProvider, ScriptedTurn, ToolContext, tool
from tesserix_adk.errors import (
    AdkError,
    ConfigurationError,
    IndeterminateToolCallError,
    NoCheckpointError,
    StoreReplyLostError,
    StoreUnavailableError,
)
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.stores.grouping import group_scope
from tesserix_adk.stores.protocols import RecordStatus, ToolFlags
from tesserix_adk.stores.sqlite import SqliteDatabase, SqliteIdempotencyStore
from tesserix_adk.stores.sqlite.grouping import INLINE_BYTES, SqliteWriteGroup
from tesserix_adk.stores.urls import open_stores

LIMIT = 3.0  # seconds a caller may wait before it counts as hung
TENANT = "t"
FLAGS = ToolFlags(side_effects=True, idempotent=False)


# --- helpers ------------------------------------------------------------------------------


class Ticker:
    """A task on the loop that ticks every 5 ms: the longest gap between two ticks is how
    long the loop was blocked."""

    def __init__(self) -> None:
        self.gap = 0.0
        self.ticks = 0
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        last = time.perf_counter()
        while True:
            await asyncio.sleep(0.005)
            now = time.perf_counter()
            self.gap = max(self.gap, now - last)
            self.ticks += 1
            last = now

    async def __aenter__(self) -> Ticker:
        self._task = asyncio.create_task(self._run())
        await asyncio.sleep(0.01)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


@contextlib.asynccontextmanager
async def _thread_busy(db: SqliteDatabase) -> AsyncIterator[threading.Event]:
    """The worker thread stuck in a job of its own (holding ``_lock``, as it does around
    every job) until the body sets the event it is given, or the body ends."""
    started, go = threading.Event(), threading.Event()

    def block() -> None:
        started.set()
        go.wait(LIMIT)

    blocker = asyncio.create_task(db._submit(block))
    assert await asyncio.to_thread(started.wait, LIMIT)
    try:
        yield go
    finally:
        go.set()
        await asyncio.wait_for(blocker, LIMIT)


async def _nothing_held(db: SqliteDatabase) -> None:
    """No group holds the connection and no transaction is left open: a plain write and a
    plain read go through promptly, and another connection can take the write lock."""
    if not db._closed:
        # Behind whatever the thread still has to finish (a cancelled caller's job).
        open_txn = db._submit(lambda: db._conn is not None and db._conn.in_transaction)
        assert await asyncio.wait_for(open_txn, LIMIT) is False
        probe = f"zz-probe-{next(_PROBES)}"
        assert await asyncio.wait_for(db.write(put(probe)), LIMIT) == probe
        assert await asyncio.wait_for(db.read(lambda c: 1), LIMIT) == 1
    assert db._held is None
    with contextlib.closing(sqlite3.connect(db.path, timeout=0.5, isolation_level=None)) as o:
        o.execute("BEGIN IMMEDIATE")
        o.execute("ROLLBACK")


_PROBES = itertools.count()


def _rows(path: str) -> list[str]:
    return [r for r in stored_rows(path) if not r.startswith("zz-probe")]


def _scratch(path: str, *tables: str) -> None:
    with contextlib.closing(sqlite3.connect(path)) as conn:
        for table in tables:
            conn.execute(f"CREATE TABLE {table} (k TEXT, b BLOB)")
        conn.commit()


def _blob(key: str, size: int) -> Callable[[sqlite3.Connection], str]:
    def fn(conn: sqlite3.Connection) -> str:
        conn.execute("INSERT INTO scratch VALUES (?, ?)", (key, b"b" * size))
        return key

    return fn


def _scratch_keys(path: str) -> list[str]:
    with contextlib.closing(sqlite3.connect(path)) as conn:
        return sorted(r[0] for r in conn.execute("SELECT k FROM scratch"))


def _failing(key: str, error: BaseException) -> Callable[[sqlite3.Connection], str]:
    write = put(key)

    def fn(conn: sqlite3.Connection) -> str:
        write(conn)
        raise error

    return fn


def _interrupted(key: str) -> Callable[[sqlite3.Connection], None]:
    """Writes ``key``, then an INSERT SQLite interrupts: it rolls the whole transaction
    back (SQLITE_INTERRUPT)."""
    write = put(key)

    def fn(conn: sqlite3.Connection) -> None:
        write(conn)
        interrupts_itself(conn)

    return fn


def _fills_the_disk(key: str) -> Callable[[sqlite3.Connection], None]:
    """Writes ``key``, then SQLITE_FULL (as on a full disk): SQLite rolls the whole
    transaction back."""
    write = put(key)

    def fn(conn: sqlite3.Connection) -> None:
        write(conn)
        fills_the_disk(conn)

    return fn


async def _claim(store: SqliteIdempotencyStore, key: str, holder: str) -> Any:
    return await store.claim(
        key,
        holder=holder,
        tenant=TENANT,
        run_id="r",
        iteration=0,
        tool="book",
        call_id="c",
        flags=FLAGS,
    )


# --- defects ------------------------------------------------------------------------------


# Found by the attack on 1ac9a1d, fixed since: claim() and lookup() of one key pass
# weight=0 ('what it reads back is one record'), but that one record carries the call's
# recorded outcome, of any size (complete() itself weighs it at len(outcome)): inside an
# open group, a claim that finds the call completed (say under a business key another run
# completed) or a one-key lookup (read_back, the cancel check) reads the whole outcome on
# the event loop's thread, so a large outcome stalls the loop (64 MiB: ~0.1 s per call),
# which INLINE_BYTES exists to prevent (leases renew on that loop)
async def test_a_call_reading_back_a_large_recorded_outcome_does_not_run_on_the_loop(
    database: SqliteDatabase,
) -> None:
    store = SqliteIdempotencyStore(database)
    await _claim(store, "k", "h")
    outcome = b"o" * (64 * INLINE_BYTES)  # 1 MiB
    await store.complete("k", outcome, tenant=TENANT, holder="h")
    here = threading.current_thread().name
    read_on: list[str] = []

    def trace(sql: str) -> None:
        if sql.startswith("SELECT key, status"):
            read_on.append(threading.current_thread().name)

    with group_scope():
        group = database.write_group()
        await group.begin()
        await database.write(put("first"), weight=0)  # the transaction is open now
        assert database._conn is not None
        with database._lock:
            database._conn.set_trace_callback(trace)
        try:
            found = await store.lookup(["k"], tenant=TENANT)
            again = await _claim(store, "k", "h2")
        finally:
            with database._lock:
                database._conn.set_trace_callback(None)
        await group.commit()
    # Told truthfully all the same.
    assert found["k"].outcome == outcome
    assert again.status is RecordStatus.completed and again.outcome == outcome
    assert read_on and here not in read_on, read_on


# Found by the attack on 1ac9a1d, fixed since: the inline path assumes 'inside the open
# transaction it cannot wait on a lock', true only in WAL mode: on a file whose
# journal_mode was set back to DELETE (the connection never checks), a small write that
# makes the page cache spill needs an EXCLUSIVE lock, and with another process reading it
# waits out busy_timeout in SQLite's busy handler on the event loop's thread, on every
# page it adds (minutes in all for a few MB); in the thread it would only slow the thread
async def test_small_calls_of_a_group_never_block_the_loop_on_a_file_out_of_wal_mode(
    database: SqliteDatabase,
) -> None:
    _scratch(database.path, "scratch")
    with contextlib.closing(sqlite3.connect(database.path, isolation_level=None)) as other:
        assert other.execute("PRAGMA journal_mode = DELETE").fetchone()[0] == "delete"
    db = SqliteDatabase(database.path, synchronous="normal", busy_timeout=0.3)
    reader = sqlite3.connect(database.path, isolation_level=None)
    try:
        reader.execute("BEGIN")
        reader.execute("SELECT count(*) FROM adk_ledger").fetchone()  # a SHARED lock
        async with Ticker() as ticker:
            with group_scope():
                group = db.write_group()
                await group.begin()
                await db.write(put("first"), weight=0)
                for i in range(600):  # ~5 MB in all, past the default 2 MB page cache
                    started = time.perf_counter()
                    await db.write(_blob(f"b{i:03}", 8 * 1024), weight=8 * 1024)
                    if time.perf_counter() - started > 0.2:
                        break  # one is enough (each page it adds would wait as long)
                    await asyncio.sleep(0)
                await asyncio.sleep(0.02)  # the ticker sees the gap
                with contextlib.suppress(StoreUnavailableError):  # the reader holds on
                    await asyncio.wait_for(group.commit(), LIMIT)
        assert ticker.gap < 0.2, f"the loop was blocked {ticker.gap:.2f} s"
    finally:
        reader.close()
        await db.aclose()


# 1ac9a1d's fix of an older defect (test_a_group_commit_called_off_before_the_thread_began_it
# in tests/stores/test_sqlite_joining.py) turned a hang into a rollback: the writes the run
# was told were made in the group are dropped, among them the outcome of a call that ran.
# Found by the attack on 1ac9a1d, fixed since: a run cancelled while its group's COMMIT
# waits in the worker thread's queue (SqliteWriteGroup.commit -> _abandon) has the group
# rolled back: the outcome of the turn's first call, whose complete() was acknowledged
# inside the group and which dispatch records 'to the end even if cancelled', is lost with
# the next call's claim; run.grouping.commit redoes held outcomes only for an AdkError,
# never for a CancelledError, so the resume refuses a call that ran and whose outcome was
# in hand (IndeterminateToolCallError). Cancelled anywhere else in the group, the group
# commits
async def test_a_run_cancelled_while_its_group_commit_is_queued_keeps_the_outcome_it_held(
    tmp_path: Path, grouped_writes: None
) -> None:
    path = str(tmp_path / "adk.sqlite3")
    stores = open_stores(f"sqlite:///{path}")
    await stores.create_schema()
    db = stores.idempotency.database  # type: ignore[attr-defined]
    busy: list[Any] = []
    queued = asyncio.Event()

    class Stalling(SqliteIdempotencyStore):
        async def claim(self, key: str, **kwargs: Any) -> Any:
            record = await super().claim(key, **kwargs)
            if kwargs.get("call_id") == "call_0_1":
                # The thread is busy with another job when the group's COMMIT is queued.
                busy.append(_thread_busy(db))
                await busy[0].__aenter__()
                queued.set()
            return record

    stores.idempotency = Stalling(db)
    sent: list[str] = []

    @tool
    def book(seat: str) -> str:
        sent.append(seat)
        return f"booked {seat}"

    agent = Agent("g", "b", tools=[book])
    script = [
        ScriptedTurn(calls=[("book", {"seat": "a"}), ("book", {"seat": "b"})], cost_micros=7),
        "done",
    ]
    try:
        task = asyncio.create_task(
            AgentRunner.from_stores(ScriptedProvider(script), stores).run(
                agent, "go", tenant=TENANT, run_id="r"
            )
        )
        await asyncio.wait_for(queued.wait(), LIMIT)
        await asyncio.sleep(0.05)  # the run awaits its group's COMMIT, queued behind
        task.cancel()
        await asyncio.sleep(0.05)  # the cancellation reaches the queued COMMIT
        await busy[0].__aexit__(None, None, None)
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, LIMIT)
        assert sent == ["a"]
        with contextlib.closing(sqlite3.connect(path)) as other:
            status = dict(
                other.execute(
                    "SELECT call_id, status FROM adk_idempotency WHERE call_id IS NOT NULL"
                ).fetchall()
            )
        # Seat a was booked and its outcome was in hand: it is on record.
        assert status.get("call_0_0") == RecordStatus.completed.value, status
        again = AgentRunner.from_stores(ScriptedProvider(script), stores)
        run = await asyncio.wait_for(again.resume(agent, "r", tenant=TENANT), LIMIT)
        assert run.status == "completed"
        assert sent == ["a", "b"]
    finally:
        await stores.aclose()


async def test_a_run_cancelled_inside_its_group_before_the_commit_keeps_the_outcome_it_held(
    tmp_path: Path, grouped_writes: None
) -> None:
    """The counterpart of the test above, which holds: cancelled while the second call's
    claim is on its way (the group open, holding the first call's outcome), the run commits
    its group on the way out, and the resume sends only the second call."""
    path = str(tmp_path / "adk.sqlite3")
    stores = open_stores(f"sqlite:///{path}")
    await stores.create_schema()
    db = stores.idempotency.database  # type: ignore[attr-defined]
    inside, never = asyncio.Event(), asyncio.Event()

    class Stuck(SqliteIdempotencyStore):
        async def claim(self, key: str, **kwargs: Any) -> Any:
            if kwargs.get("call_id") == "call_0_1" and not inside.is_set():
                inside.set()
                await never.wait()
            return await super().claim(key, **kwargs)

    stores.idempotency = Stuck(db)
    sent: list[str] = []

    @tool
    def book(seat: str) -> str:
        sent.append(seat)
        return f"booked {seat}"

    agent = Agent("g", "b", tools=[book])
    script = [
        ScriptedTurn(calls=[("book", {"seat": "a"}), ("book", {"seat": "b"})], cost_micros=7),
        "done",
    ]
    try:
        task = asyncio.create_task(
            AgentRunner.from_stores(ScriptedProvider(script), stores).run(
                agent, "go", tenant=TENANT, run_id="r"
            )
        )
        await asyncio.wait_for(inside.wait(), LIMIT)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, LIMIT)
        records = {r.call_id: r.status for r in await stores.idempotency.records(TENANT, "r")}
        assert records.get("call_0_0") is RecordStatus.completed
        again = AgentRunner.from_stores(ScriptedProvider(script), stores)
        run = await asyncio.wait_for(again.resume(agent, "r", tenant=TENANT), LIMIT)
        assert run.status == "completed"
        assert sent == ["a", "b"]
        await _nothing_held(db)
    finally:
        await stores.aclose()


# Found by the attack on 1ac9a1d, fixed since: a write that runs COMMIT itself inside a
# group (inline or in the thread: both go through _joined) commits what joined before it,
# yet its caller is told a plain StoreUnavailableError (RELEASE of the gone savepoint
# fails) and the group's commit says 'lost its transaction; nothing of it was committed'
# (_commit_held) while the rows are durable; outside a group the same write is told
# StoreReplyLostError (in doubt), and the runner retries a charge only on a certain
# failure
async def test_a_write_that_commits_by_itself_in_a_group_is_not_reported_as_never_committed(
    database: SqliteDatabase,
) -> None:
    def committing(conn: sqlite3.Connection) -> str:
        put("b")(conn)
        conn.execute("COMMIT")
        return "b"

    told: list[BaseException | str] = []
    with group_scope():
        group = database.write_group()
        await group.begin()
        await database.write(put("a"), weight=0)
        try:
            told.append(await database.write(committing, weight=0))
        except Exception as exc:
            told.append(exc)
        try:
            await group.commit()
            told.append("committed")
        except Exception as exc:
            told.append(exc)
    rows = _rows(database.path)
    await _nothing_held(database)
    assert rows == ["a", "b"]  # what SQLite did
    # Told the truth: committed, or in doubt; never "nothing of it was committed".
    assert told[1] == "committed" or isinstance(told[1], StoreReplyLostError), told
    assert not isinstance(told[0], BaseException) or isinstance(told[0], StoreReplyLostError)


# --- what held: calls on the caller's thread, told and undone as in the thread --------------


@pytest.mark.parametrize(
    "error",
    [SystemExit(3), KeyboardInterrupt(), asyncio.CancelledError(), GeneratorExit()],
    ids=["system-exit", "keyboard-interrupt", "cancelled-error", "generator-exit"],
)
async def test_a_write_raising_a_base_exception_is_told_undone_alone_and_the_group_goes_on(
    database: SqliteDatabase, error: BaseException
) -> None:
    told: dict[int | None, str] = {}
    for weight in (0, None):
        with group_scope():
            group = database.write_group()
            await group.begin()
            await database.write(put(f"a-{weight}"), weight=0)
            try:
                # Awaited here, not in a task of its own: a task raising SystemExit or
                # KeyboardInterrupt stops the whole loop, whichever thread ran the write.
                await database.write(_failing(f"x-{weight}", error), weight=weight)
            except BaseException as exc:
                told[weight] = type(exc).__name__
            assert not database._lock.locked()
            await database.write(put(f"c-{weight}"), weight=0)
            await group.commit()
    assert told[0] == told[None] == type(error).__name__
    assert _rows(database.path) == ["a-0", "a-None", "c-0", "c-None"]
    await _nothing_held(database)


@pytest.mark.parametrize("abort", [_interrupted, _fills_the_disk], ids=["interrupt", "full"])
async def test_a_small_call_sqlite_aborts_with_the_whole_transaction_loses_the_group_truthfully(
    database: SqliteDatabase, abort: Callable[[str], Callable[[sqlite3.Connection], None]]
) -> None:
    seen: list[str] = []
    with group_scope():
        group = database.write_group()
        await group.begin()
        assert await database.write(put("a"), weight=0) == "a"
        assert await database.write(put("b"), weight=0) == "b"  # on the loop's thread
        with pytest.raises(StoreUnavailableError):
            await database.write(abort("x"), weight=0)
        # Nothing more joins as if the group still stood: inline, in the thread, reads too.
        for call in (
            database.write(put("c"), weight=0),
            database.write(put("d"), weight=None),
            database.read(lambda c: seen.append("read"), weight=0),
        ):
            with pytest.raises(StoreUnavailableError, match="rolled back"):
                await asyncio.wait_for(call, LIMIT)
        with pytest.raises(StoreUnavailableError, match="nothing of it was committed"):
            await asyncio.wait_for(group.commit(), LIMIT)
    assert seen == []
    assert _rows(database.path) == []
    await _nothing_held(database)


async def test_small_writes_past_max_page_count_are_told_and_the_commit_tells_the_truth(
    database: SqliteDatabase,
) -> None:
    """SQLITE_FULL part way through a group of small writes on the loop's thread (SQLite
    may undo the statement or the whole transaction): each write is told, and what the
    commit says matches what the file holds."""
    _scratch(database.path, "scratch")
    acked: list[str] = []
    refused: list[str] = []
    with group_scope():
        group = database.write_group()
        await group.begin()

        def cap(conn: sqlite3.Connection) -> None:
            (pages,) = conn.execute("PRAGMA page_count").fetchone()
            conn.execute(f"PRAGMA max_page_count = {pages + 6}")

        await database.write(cap, weight=0)  # begins, in the thread
        for i in range(20):
            try:
                acked.append(await database.write(_blob(f"k{i:02}", 3000), weight=3000))
            except StoreUnavailableError:
                refused.append(f"k{i:02}")
        assert acked and refused, (acked, refused)
        with contextlib.suppress(StoreUnavailableError):
            await database.write(
                lambda c: c.execute("PRAGMA max_page_count = 4294967294").fetchone(), weight=0
            )
        try:
            await asyncio.wait_for(group.commit(), LIMIT)
            committed = True
        except StoreUnavailableError:
            committed = False
    if not committed:
        # The group lost, the write lifting the cap was refused: lift it here, or every
        # later write on this connection stays capped.
        await database._submit(
            lambda: database._connection().execute("PRAGMA max_page_count = 4294967294")
        )
    assert _scratch_keys(database.path) == (sorted(acked) if committed else [])
    await _nothing_held(database)


async def test_a_write_that_rolls_back_by_itself_leaves_the_group_lost_and_nothing_held(
    database: SqliteDatabase,
) -> None:
    def rolling_back(conn: sqlite3.Connection) -> str:
        put("b")(conn)
        conn.execute("ROLLBACK")
        return "b"

    with group_scope():
        group = database.write_group()
        await group.begin()
        await database.write(put("a"), weight=0)
        with contextlib.suppress(StoreUnavailableError):
            await database.write(rolling_back, weight=0)
        with pytest.raises(StoreUnavailableError):
            await database.write(put("c"), weight=0)
        with pytest.raises(StoreUnavailableError):  # a certain failure: nothing committed
            await asyncio.wait_for(group.commit(), LIMIT)
    assert _rows(database.path) == []
    await _nothing_held(database)


async def test_many_tasks_of_one_group_at_once_land_exactly_what_each_was_told(
    database: SqliteDatabase,
) -> None:
    rng = random.Random(7)
    acked: list[str] = []
    reads: list[int] = []

    async def one(i: int) -> None:
        await asyncio.sleep(rng.random() * 0.01)
        key = f"k{i:03}"
        kind = i % 5
        if kind == 0:
            acked.append(await database.write(put(key), weight=0))
        elif kind == 1:
            acked.append(await database.write(put(key), weight=None))
        elif kind == 2:
            with pytest.raises(ValueError, match="refused"):
                await database.write(_failing(key, ValueError("refused")), weight=0)
        elif kind == 3:
            reads.append(
                await database.read(
                    lambda c: c.execute("SELECT count(*) FROM adk_ledger").fetchone()[0],
                    weight=0,
                )
            )
        else:
            # The worker thread busy with a job of its own: small calls find the lock taken.
            await database._submit(lambda: time.sleep(0.002))
            acked.append(await database.write(put(key), weight=INLINE_BYTES))

    async with Ticker() as ticker:
        with group_scope():
            group = database.write_group()
            await group.begin()
            # Tasks started here share the group (they copy the context).
            await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(100))), 10 * LIMIT)
            await group.commit()
    assert _rows(database.path) == sorted(acked)
    assert len(acked) == 60 and len(reads) == 20
    assert ticker.gap < 0.5
    await _nothing_held(database)


# --- cancellation at each await of a group ------------------------------------------------


async def test_a_first_call_cancelled_before_the_thread_took_it_holds_nothing(
    database: SqliteDatabase,
) -> None:
    with group_scope():
        group = database.write_group()
        await group.begin()
        async with _thread_busy(database):
            first = asyncio.create_task(database.write(put("never"), weight=0))
            await asyncio.sleep(0.01)
            first.cancel()
            with pytest.raises(asyncio.CancelledError):
                await first
        await asyncio.wait_for(group.commit(), LIMIT)
    assert database._held is None
    assert _rows(database.path) == []
    await _nothing_held(database)


async def test_a_first_call_cancelled_while_it_runs_is_committed_with_the_group_or_not_at_all(
    database: SqliteDatabase,
) -> None:
    inside, go = threading.Event(), threading.Event()

    def slow(conn: sqlite3.Connection) -> str:
        put("slow")(conn)
        inside.set()
        go.wait(LIMIT)
        return "slow"

    with group_scope():
        group = database.write_group()
        await group.begin()
        first = asyncio.create_task(database.write(slow, weight=0))
        assert await asyncio.to_thread(inside.wait, LIMIT)
        first.cancel()
        go.set()
        with pytest.raises(asyncio.CancelledError):
            await first
        # The group holds the connection now: its next small call joins on this thread.
        assert await database.write(put("next"), weight=0) == "next"
        await asyncio.wait_for(group.commit(), LIMIT)
    # The commit succeeded: everything that ran in the group is durable.
    assert _rows(database.path) == ["next", "slow"]
    await _nothing_held(database)


async def test_a_commit_cancelled_while_the_commit_runs_is_durable_and_lets_go(
    database: SqliteDatabase, monkeypatch: pytest.MonkeyPatch
) -> None:
    inside, go = threading.Event(), threading.Event()
    real = SqliteWriteGroup._commit_held

    def slow(group: SqliteWriteGroup) -> None:
        inside.set()
        go.wait(LIMIT)
        real(group)

    monkeypatch.setattr(SqliteWriteGroup, "_commit_held", slow)
    with group_scope():
        group = database.write_group()
        await group.begin()
        await database.write(put("a"), weight=0)
        await database.write(put("b"), weight=0)
        committing = asyncio.create_task(group.commit())
        assert await asyncio.to_thread(inside.wait, LIMIT)
        committing.cancel()
        await asyncio.sleep(0.01)
        go.set()
        with pytest.raises(asyncio.CancelledError):
            await committing
    monkeypatch.undo()
    await _nothing_held(database)
    assert _rows(database.path) == ["a", "b"]


async def test_a_cancelled_commit_lets_waiting_groups_and_readers_on_other_loops_go_on(
    database: SqliteDatabase,
) -> None:
    other_loop: list[Any] = []

    def read_elsewhere() -> None:
        # A plain read on another event loop in another thread: waits for the group.
        async def read() -> Any:
            return await database.read(lambda c: c.execute("SELECT 1").fetchone()[0])

        try:
            other_loop.append(asyncio.run(asyncio.wait_for(read(), 2 * LIMIT)))
        except BaseException as exc:  # reported below
            other_loop.append(exc)

    async def second_group() -> list[str]:
        with group_scope():
            group = database.write_group()
            await group.begin()
            await database.write(put("second"), weight=0)
            await database.write(put("second-2"), weight=0)
            await group.commit()
        return ["second", "second-2"]

    with group_scope():
        group = database.write_group()
        await group.begin()
        await database.write(put("first"), weight=0)
        waiter = asyncio.create_task(second_group())
        reader = threading.Thread(target=read_elsewhere)
        reader.start()
        await asyncio.sleep(0.05)
        assert not waiter.done() and not other_loop
        async with _thread_busy(database):
            committing = asyncio.create_task(group.commit())
            await asyncio.sleep(0.01)
            committing.cancel()
            with pytest.raises(asyncio.CancelledError):
                await committing
    assert await asyncio.wait_for(waiter, LIMIT) == ["second", "second-2"]
    await asyncio.to_thread(reader.join, 2 * LIMIT)
    assert other_loop == [1]
    assert _rows(database.path) == ["second", "second-2"]  # the first group was called off
    await _nothing_held(database)


# --- other threads, loops, processes and opens of the file --------------------------------


async def test_aclose_from_another_thread_during_a_small_call_waits_for_it_and_loses_the_group(
    database: SqliteDatabase,
) -> None:
    inside, release = threading.Event(), threading.Event()
    closed: list[BaseException | None] = []

    def long_small(conn: sqlite3.Connection) -> str:
        put("inline")(conn)
        inside.set()
        release.wait(LIMIT)  # blocks this loop on purpose: the close comes meanwhile
        return "inline"

    def close_elsewhere() -> None:
        inside.wait(LIMIT)
        threading.Timer(0.2, release.set).start()
        try:
            asyncio.run(asyncio.wait_for(database.aclose(), 2 * LIMIT))
            closed.append(None)
        except BaseException as exc:  # reported below
            closed.append(exc)

    closer = threading.Thread(target=close_elsewhere)
    closer.start()
    with group_scope():
        group = database.write_group()
        await group.begin()
        await database.write(put("first"), weight=0)
        assert await database.write(long_small, weight=0) == "inline"
        await asyncio.to_thread(closer.join, 2 * LIMIT)
        assert closed == [None]
        with pytest.raises(ConfigurationError, match="closed"):
            await asyncio.wait_for(database.write(put("late"), weight=0), LIMIT)
        with pytest.raises(ConfigurationError, match="closed"):
            await asyncio.wait_for(group.commit(), LIMIT)
    assert _rows(database.path) == []  # the group was never committed: none of it is
    with contextlib.closing(sqlite3.connect(database.path, timeout=0.5)) as other:
        other.execute("BEGIN IMMEDIATE")
        other.execute("ROLLBACK")


def test_groups_and_plain_calls_from_several_loops_with_aclose_midway_tell_the_truth(
    tmp_path: Path,
) -> None:
    db = SqliteDatabase(tmp_path / "adk.sqlite3", synchronous="normal")
    asyncio.run(db.create_schema())
    durable: list[str] = []  # what was acknowledged
    lock = threading.Lock()
    hung: list[str] = []
    stopped: list[int] = []  # workers told the database was closed

    async def worker(w: int) -> None:
        rng = random.Random(w)
        for i in range(100_000):
            keys = [f"w{w}-{i:03}-{j}" for j in range(3)]
            try:
                if i % 3 == 0:
                    key = await db.write(put(keys[0]))
                    with lock:
                        durable.append(key)
                elif i % 3 == 1:
                    await db.read(lambda c: c.execute("SELECT count(*) FROM adk_ledger"))
                else:
                    with group_scope():
                        group = db.write_group()
                        await group.begin()
                        try:
                            for key in keys:
                                await db.write(put(key), weight=rng.choice([0, None]))
                                await asyncio.sleep(0)
                        finally:
                            await group.commit()  # raises if it failed: then none counts
                    with lock:
                        durable.extend(keys)
            except (ConfigurationError, StoreUnavailableError, RuntimeError):
                stopped.append(w)
                return  # closed: told so

    def run(w: int) -> None:
        try:
            asyncio.run(asyncio.wait_for(worker(w), 6 * LIMIT))
        except BaseException as exc:  # reported below
            hung.append(repr(exc))

    threads = [threading.Thread(target=run, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    time.sleep(0.15)
    asyncio.run(asyncio.wait_for(db.aclose(), LIMIT))
    for t in threads:
        t.join(8 * LIMIT)
    assert not any(t.is_alive() for t in threads), "a caller hangs"
    assert not hung, hung
    assert sorted(stopped) == [0, 1, 2, 3]  # the close came while each was busy
    assert stored_rows(db.path) == sorted(durable)
    with contextlib.closing(sqlite3.connect(db.path, timeout=0.5)) as other:
        other.execute("BEGIN IMMEDIATE")  # nothing of the closed database holds the file
        other.execute("ROLLBACK")


_HOLDER = textwrap.dedent(
    """
    import sqlite3, sys, time
    conn = sqlite3.connect(sys.argv[1], isolation_level=None)
    conn.execute("BEGIN IMMEDIATE")
    conn.execute(
        "INSERT INTO adk_ledger (tenant, run_id, micros, input_tokens, output_tokens) "
        "VALUES ('t', 'other-process', 1, 0, 0)"
    )
    print("locked", flush=True)
    time.sleep(float(sys.argv[2]))
    conn.execute("COMMIT")
    """
)


@contextlib.contextmanager
def _other_process_writing(path: str, hold: float) -> Any:
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, path, str(hold)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    with proc.stdout:
        try:
            assert proc.stdout.readline().strip() == "locked"
            yield proc
        finally:
            proc.wait(2 * LIMIT)


async def test_a_group_whose_first_call_waits_on_another_process_never_blocks_the_loop(
    database: SqliteDatabase,
) -> None:
    await database.write(put("warm"))
    async with Ticker() as ticker:
        with _other_process_writing(database.path, 0.6), group_scope():
            group = database.write_group()
            await group.begin()
            started = time.perf_counter()
            # The thread waits in BEGIN IMMEDIATE; another task of the group meanwhile.
            first = asyncio.create_task(database.write(put("a"), weight=0))
            await asyncio.sleep(0.05)
            second = asyncio.create_task(database.write(put("b"), weight=0))
            assert await asyncio.wait_for(first, LIMIT) == "a"
            assert await asyncio.wait_for(second, LIMIT) == "b"
            waited = time.perf_counter() - started
            assert await database.write(put("c"), weight=0) == "c"
            await group.commit()
    assert waited > 0.3
    assert ticker.gap < 0.2 and ticker.ticks > 50
    assert _rows(database.path) == ["a", "b", "c", "other-process", "warm"]
    await _nothing_held(database)


async def test_a_first_call_refused_by_another_process_is_told_and_the_group_recovers(
    tmp_path: Path,
) -> None:
    db = SqliteDatabase(tmp_path / "adk.sqlite3", synchronous="normal", busy_timeout=0.2)
    await db.create_schema()
    try:
        with group_scope():
            group = db.write_group()
            await group.begin()
            with (
                _other_process_writing(db.path, 0.8),
                pytest.raises(StoreUnavailableError, match="locked"),
            ):
                await asyncio.wait_for(db.write(put("refused"), weight=0), LIMIT)
            assert await db.write(put("later"), weight=0) == "later"
            assert await db.write(put("inline"), weight=0) == "inline"
            await group.commit()
        assert _rows(db.path) == ["inline", "later", "other-process"]
        await _nothing_held(db)
    finally:
        await db.aclose()


async def test_groups_on_two_opens_of_one_file_interleave_without_blocking_the_loop(
    database: SqliteDatabase,
) -> None:
    second = SqliteDatabase(database.path, synchronous="normal")

    async def grouped(db: SqliteDatabase, tag: str) -> list[str]:
        keys = [f"{tag}-{i:02}" for i in range(15)]
        with group_scope():
            group = db.write_group()
            await group.begin()
            for key in keys:
                await db.write(put(key), weight=0)
                await asyncio.sleep(0.005)
            await group.commit()
        return keys

    try:
        async with Ticker() as ticker:
            done = await asyncio.wait_for(
                asyncio.gather(
                    *(
                        grouped(db, f"{n}{i}")
                        for i in range(3)
                        for n, db in (("a", database), ("b", second))
                    )
                ),
                4 * LIMIT,
            )
        assert ticker.gap < 0.2
        assert _rows(database.path) == sorted(k for keys in done for k in keys)
        await _nothing_held(database)
        await _nothing_held(second)
    finally:
        await second.aclose()


# --- whole runs ---------------------------------------------------------------------------


@pytest.fixture
async def stores(tmp_path: Path, grouped_writes: None) -> AsyncIterator[Stores]:
    opened = open_stores(f"sqlite:///{tmp_path / 'adk.sqlite3'}")
    await opened.create_schema()
    try:
        yield opened
    finally:
        await opened.aclose()


async def test_concurrent_grouped_runs_cancelled_at_random_never_send_a_call_twice(
    stores: Stores,
) -> None:
    db = stores.idempotency.database  # type: ignore[attr-defined]
    path = db.path
    rng = random.Random(11)
    sent: list[tuple[str, str]] = []
    not_durable: list[str] = []

    @tool
    async def book(seat: str, ctx: ToolContext) -> str:
        # Another connection, as another process: the claim is committed before the call.
        with contextlib.closing(sqlite3.connect(path)) as other:
            row = other.execute(
                "SELECT status FROM adk_idempotency WHERE tenant = ? AND key = ?",
                (ctx.tenant, ctx.idempotency_key),
            ).fetchone()
            charged = other.execute(
                "SELECT count(*) FROM adk_ledger WHERE run_id = ?", (ctx.run_id,)
            ).fetchone()[0]
        if row is None or row[0] != RecordStatus.in_flight.value or not charged:
            not_durable.append(seat)
        sent.append((ctx.run_id, seat))
        await asyncio.sleep(rng.random() * 0.01)
        return f"booked {seat}"

    agent = Agent("g", "b", tools=[book])

    def script(run_id: str) -> list[Any]:
        return [
            *(
                ScriptedTurn(
                    calls=[("book", {"seat": f"{run_id}-{t}-{c}"}) for c in range(2)],
                    cost_micros=3,
                )
                for t in range(3)
            ),
            "done",
        ]

    run_ids = [f"r{i}" for i in range(8)]
    tasks = {
        r: asyncio.create_task(
            AgentRunner.from_stores(ScriptedProvider(script(r)), stores).run(
                agent, "go", tenant=TENANT, run_id=r
            )
        )
        for r in run_ids
    }
    for r in run_ids[::2]:
        asyncio.get_running_loop().call_later(rng.random() * 0.1, tasks[r].cancel)
    await asyncio.wait_for(asyncio.gather(*tasks.values(), return_exceptions=True), 10 * LIMIT)
    # Every run picks up where it stopped; a call in doubt is refused, never sent again.
    finished: dict[str, str] = {}
    for r in run_ids:
        done = tasks[r]
        if not done.cancelled() and done.exception() is None:
            finished[r] = done.result().status
            continue
        again = AgentRunner.from_stores(ScriptedProvider(script(r)), stores)
        try:
            run = await asyncio.wait_for(again.resume(agent, r, tenant=TENANT), LIMIT)
        except NoCheckpointError:
            run = await asyncio.wait_for(again.run(agent, "go", tenant=TENANT, run_id=r), LIMIT)
        except IndeterminateToolCallError:
            finished[r] = "in doubt"
            continue
        finished[r] = run.status
    assert not_durable == []
    assert len(sent) == len(set(sent)), "a call was sent twice"
    for r, status in finished.items():
        assert status in ("completed", "in doubt"), (r, status)
        if status == "completed":
            assert sorted(s for rr, s in sent if rr == r) == sorted(
                f"{r}-{t}-{c}" for t in range(3) for c in range(2)
            )
    for r in run_ids[1::2]:
        assert finished[r] == "completed"
    await _nothing_held(db)


# Older than 1ac9a1d (run/dispatch.py), found by the random cancellations above: it loses
# outcomes with and without write groups.
# Found by the attack on 1ac9a1d, fixed since: dispatch records a tool's outcome in two
# steps, 'await to_the_end(redacted_record(...))' then 'await
# to_the_end(_grouped_complete(...))': a run cancelled while the first runs (a large
# outcome is redacted in a worker thread) gets its CancelledError re-raised by to_the_end
# once the redaction is done, so complete() is never called; the outcome in hand is lost
# and the resume refuses the call that ran (IndeterminateToolCallError), contrary to
# 'recorded to the end even if cancelled'
@pytest.mark.parametrize("grouped", [True, False], ids=["grouped", "plain"])
async def test_a_run_cancelled_while_its_outcome_is_redacted_still_records_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, grouped: bool
) -> None:
    from tesserix_adk.run import recording

    if grouped:
        monkeypatch.setitem(AgentRunner.__init__.__kwdefaults__, "group_writes", True)
    redacting = threading.Event()
    real = recording.recorded_outcome

    def slow(*args: Any, **kw: Any) -> Any:
        redacting.set()
        time.sleep(0.1)  # a large outcome takes a while to redact
        return real(*args, **kw)

    monkeypatch.setattr(recording, "recorded_outcome", slow)
    path = str(tmp_path / "adk.sqlite3")
    sent: list[str] = []

    @tool
    async def fetch(seat: str) -> str:
        sent.append(seat)
        return "r" * (64 * 1024)  # over OFF_LOOP_BYTES: redacted off the loop

    agent = Agent("g", "f", tools=[fetch])
    script = [
        ScriptedTurn(calls=[("fetch", {"seat": "a"}), ("fetch", {"seat": "b"})], cost_micros=7),
        "done",
    ]
    async with open_stores(f"sqlite:///{path}") as stores:
        await stores.create_schema()
        task = asyncio.create_task(
            AgentRunner.from_stores(ScriptedProvider(script), stores).run(
                agent, "go", tenant=TENANT, run_id="r"
            )
        )
        assert await asyncio.to_thread(redacting.wait, LIMIT)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, LIMIT)
        monkeypatch.setattr(recording, "recorded_outcome", real)
        assert sent == ["a"]
        records = {r.call_id: r.status for r in await stores.idempotency.records(TENANT, "r")}
        assert records.get("call_0_0") is RecordStatus.completed, records
        again = AgentRunner.from_stores(ScriptedProvider(script), stores)
        run = await asyncio.wait_for(again.resume(agent, "r", tenant=TENANT), LIMIT)
        assert run.status == "completed"
        assert sent == ["a", "b"]


async def test_a_resume_sees_exactly_what_was_durable_when_a_grouped_run_stopped(
    stores: Stores,
) -> None:
    """A run stopped by an error in its second call's claim (after the first call ran):
    what the file holds is what the group committed, and the resume sends nothing twice."""
    db = stores.idempotency.database  # type: ignore[attr-defined]
    sent: list[str] = []

    class Failing(SqliteIdempotencyStore):
        failed = False

        async def claim(self, key: str, **kwargs: Any) -> Any:
            if kwargs.get("call_id") == "call_0_1" and not self.failed:
                self.failed = True
                raise StoreUnavailableError("the claim's write failed")
            return await super().claim(key, **kwargs)

    stores.idempotency = Failing(db)

    @tool
    def book(seat: str) -> str:
        sent.append(seat)
        return f"booked {seat}"

    agent = Agent("g", "b", tools=[book])
    script = [
        ScriptedTurn(calls=[("book", {"seat": "a"}), ("book", {"seat": "b"})], cost_micros=7),
        "done",
    ]
    with pytest.raises(AdkError):
        await asyncio.wait_for(
            AgentRunner.from_stores(ScriptedProvider(script), stores).run(
                agent, "go", tenant=TENANT, run_id="r"
            ),
            LIMIT,
        )
    await _nothing_held(db)
    records = {r.call_id: r.status for r in await stores.idempotency.records(TENANT, "r")}
    assert records.get("call_0_0") is RecordStatus.completed
    run = await asyncio.wait_for(
        AgentRunner.from_stores(ScriptedProvider(script), stores).resume(agent, "r", tenant=TENANT),
        LIMIT,
    )
    assert run.status == "completed"
    assert sent == ["a", "b"]
