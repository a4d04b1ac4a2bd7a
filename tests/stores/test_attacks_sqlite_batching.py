"""Attacks on group commit across runs on SQLite (``stores/sqlite/batching.py`` and
``SqliteDatabase.write``/``_drain``): writes queued while the thread is busy share one
``BEGIN IMMEDIATE`` transaction, a savepoint each, and one COMMIT.

Every test states the behaviour the feature promises; the ones that found a defect are
strict xfails whose reason says what goes wrong."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from sqlite_writes import fills_the_disk, interrupts_itself, on_loops_in_threads, put, stored_rows
from tesserix_adk.errors import (
    ConfigurationError,
    LeaseHeldError,
    StoreReplyLostError,
    StoreUnavailableError,
)
from tesserix_adk.stores.grouping import group_scope
from tesserix_adk.stores.sqlite import SqliteDatabase, SqliteLeaseStore
from tesserix_adk.stores.sqlite.batching import CommitInDoubt, run_batch, savepoint_name

LIMIT = 3.0  # seconds a caller may wait before it counts as hung


@contextlib.asynccontextmanager
async def _thread_busy(db: SqliteDatabase) -> AsyncIterator[None]:
    """Keep the worker thread inside a read of its own: whatever is sent in the body
    queues up behind it and is drained as ONE batch when the body ends."""
    started, go = threading.Event(), threading.Event()

    def block(conn: sqlite3.Connection) -> None:
        started.set()
        go.wait(LIMIT)

    blocker = asyncio.create_task(db.read(block))
    assert await asyncio.to_thread(started.wait, LIMIT)
    try:
        yield
        for _ in range(5):  # every task of the body reaches its queue
            await asyncio.sleep(0)
    finally:
        go.set()
        await blocker


async def _batched(db: SqliteDatabase, fns: list[Callable[[sqlite3.Connection], Any]]) -> list[Any]:
    async with _thread_busy(db):
        tasks = [asyncio.create_task(db.write(fn)) for fn in fns]
    _done, pending = await asyncio.wait(tasks, timeout=LIMIT)
    for task in pending:
        task.cancel()
    assert not pending, f"{len(pending)} caller(s) of the batch were never answered"
    return [t.exception() if t.exception() is not None else t.result() for t in tasks]


async def _in_transaction(db: SqliteDatabase) -> bool:
    return await db._submit(lambda: db._connection().in_transaction)


def _assert_told_the_truth(results: list[Any], keys: list[str], rows: list[str]) -> None:
    """Told it committed: it is in the file. Told plainly it failed: it is not (only
    ``StoreReplyLostError`` may leave it either way)."""
    for key, result in zip(keys, results, strict=True):
        if isinstance(result, StoreReplyLostError):
            continue
        if isinstance(result, BaseException):
            assert key not in rows, f"{key}: told {result!r}, yet it was committed"
        else:
            assert key in rows, f"{key}: acknowledged, yet it is not in the file"


# --- a write fn raising a BaseException in the thread ------------------------------------


@pytest.mark.parametrize("error", [KeyboardInterrupt, SystemExit, asyncio.CancelledError])
async def test_a_write_raising_a_base_exception_leaves_no_caller_of_its_batch_hanging(
    database: SqliteDatabase, error: type[BaseException]
) -> None:
    """The raiser's caller hears its exception (as if it had run the fn itself; on its own
    event loop, here in a thread, since KeyboardInterrupt and SystemExit end the loop they
    reach), and the writes batched with it are answered and committed."""

    def escapes(conn: sqlite3.Connection) -> None:
        put("escapes")(conn)
        raise error()

    heard: list[BaseException] = []

    def rogue_caller() -> None:
        try:
            asyncio.run(database.write(escapes))
        except BaseException as exc:
            heard.append(exc)

    async with _thread_busy(database):
        first = asyncio.create_task(database.write(put("a")))
        await asyncio.sleep(0)
        rogue = threading.Thread(target=rogue_caller)
        rogue.start()
        # Another thread's loop queues it: polled, as no event of this loop can say so.
        deadline = time.monotonic() + LIMIT
        while len(database._writes) < 2 and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.001)
        last = asyncio.create_task(database.write(put("b")))
    _done, pending = await asyncio.wait([first, last], timeout=LIMIT)
    assert not pending, "a write batched with the raiser was never answered"
    await asyncio.to_thread(rogue.join, LIMIT)
    assert not rogue.is_alive(), "the raiser's caller was never answered"
    assert [type(e) for e in heard] == [error]
    assert first.result() == "a" and last.result() == "b"
    assert stored_rows(database.path) == ["a", "b"]
    assert not await _in_transaction(database)


async def test_a_lone_write_raising_system_exit_is_answered(database: SqliteDatabase) -> None:
    def escapes(conn: sqlite3.Connection) -> None:
        raise SystemExit(3)

    heard: list[BaseException] = []

    def caller() -> None:
        try:
            asyncio.run(asyncio.wait_for(database.write(escapes), LIMIT))
        except BaseException as exc:
            heard.append(exc)

    thread = threading.Thread(target=caller)
    thread.start()
    await asyncio.to_thread(thread.join, LIMIT * 2)
    assert [type(e) for e in heard] == [SystemExit]


# --- a write fn that ends or bends the batch's transaction itself -------------------------


def _rogue(sql: str, *, then_raise: bool = False) -> Callable[[sqlite3.Connection], str]:
    def fn(conn: sqlite3.Connection) -> str:
        put("rogue")(conn)
        conn.execute(sql)
        if then_raise:
            raise RuntimeError("decided against it")
        return "rogue"

    return fn


_IN_DOUBT = (
    "a write fn that runs COMMIT itself and then raises has its own write committed "
    "although its caller hears the error: nothing can undo a COMMIT (its neighbours are told "
    "StoreReplyLostError, the truth); an authorizer refusing transaction control inside a "
    "write would stop it, at the cost of re-preparing every statement of every write"
)


@pytest.mark.parametrize(
    ("sql", "then_raise"),
    [
        pytest.param("COMMIT", False, id="commit-returns"),
        pytest.param("COMMIT", True, id="commit-raises"),
        pytest.param("ROLLBACK", False, id="rollback-returns"),
        pytest.param("ROLLBACK", True, id="rollback-raises"),
        pytest.param("RELEASE adk_batch", False, id="release-returns"),
        pytest.param("RELEASE adk_batch", True, id="release-raises"),
        pytest.param("ROLLBACK TO adk_batch", False, id="rollback-to-returns"),
        pytest.param("ROLLBACK TO adk_batch", True, id="rollback-to-raises"),
        pytest.param("SAVEPOINT adk_batch", False, id="shadow-savepoint-returns"),
        pytest.param("SAVEPOINT adk_batch", True, id="shadow-savepoint-raises"),
        pytest.param("SAVEPOINT other", True, id="own-savepoint-raises"),
        pytest.param("BEGIN", False, id="begin-refused"),
        pytest.param("PRAGMA journal_mode = DELETE", False, id="journal-mode-refused"),
    ],
)
async def test_a_write_running_transaction_control_leaves_every_caller_told_the_truth(
    database: SqliteDatabase, sql: str, then_raise: bool
) -> None:
    """Its neighbours are told the truth about their writes (what the rogue does to its
    own is its business), and a rogue that raises leaves nothing of its own behind."""
    results = await _batched(database, [put("a"), _rogue(sql, then_raise=then_raise), put("c")])
    rows = stored_rows(database.path)
    _assert_told_the_truth([results[0], results[2]], ["a", "c"], rows)
    if then_raise:
        assert isinstance(results[1], BaseException)
        if sql == "COMMIT":
            # The known limit, reported as an expected failure without a traceback: CPython
            # 3.11.7 sometimes fails to parse a traceback's source ("AST constructor
            # recursion depth mismatch", seen in a process that ran the BaseException tests
            # above first), which stops the whole run. Once fixed, this fails: drop it then.
            assert "rogue" in rows, f"fixed at last: {_IN_DOUBT}"
            raise pytest.xfail.Exception(_IN_DOUBT, pytrace=False)
        assert "rogue" not in rows, "a write that raised was committed"
    assert not await _in_transaction(database)
    assert await database.write(put("after")) == "after"
    assert "after" in stored_rows(database.path)


# --- writes SQLite aborts together with the whole transaction -----------------------------


def _interrupted(conn: sqlite3.Connection) -> None:
    """SQLITE_INTERRUPT of an INSERT: SQLite rolls back the whole transaction."""
    put("interrupted")(conn)
    interrupts_itself(conn)


@pytest.mark.parametrize("abort", [fills_the_disk, _interrupted])
async def test_a_write_sqlite_aborts_leaves_its_batch_told_the_truth(
    database: SqliteDatabase, abort: Callable[[sqlite3.Connection], None]
) -> None:
    results = await _batched(database, [put("a"), abort, put("c")])
    assert isinstance(results[1], StoreUnavailableError)
    _assert_told_the_truth(results, ["a", "interrupted", "c"], stored_rows(database.path))
    assert not await _in_transaction(database)
    assert await database.write(put("after")) == "after"


async def test_a_write_sqlite_aborts_is_undone_alone_as_it_would_be_one_by_one(
    database: SqliteDatabase,
) -> None:
    # One by one: the full write fails alone, its neighbours commit.
    assert await database.write(put("a0")) == "a0"
    with pytest.raises(StoreUnavailableError):
        await database.write(fills_the_disk)
    assert await database.write(put("c0")) == "c0"
    # Batched, the same writes must decide the same.
    results = await _batched(database, [put("a1"), fills_the_disk, put("c1")])
    assert isinstance(results[1], StoreUnavailableError)
    assert results[0] == "a1" and results[2] == "c1"
    assert stored_rows(database.path) == ["a0", "a1", "c0", "c1"]


# --- a COMMIT that fails --------------------------------------------------------------------


class _CommitFails:
    """A connection whose COMMIT fails, SQLite having ended the transaction (``ends``,
    as an I/O error while writing it out can) or not (as SQLITE_BUSY)."""

    def __init__(self, conn: sqlite3.Connection, *, ends: bool) -> None:
        self.conn, self.ends = conn, ends

    @property
    def in_transaction(self) -> bool:
        return self.conn.in_transaction

    def execute(self, sql: str, *args: Any) -> sqlite3.Cursor:
        if sql == "COMMIT":
            if self.ends:
                self.conn.execute("ROLLBACK")
            raise sqlite3.OperationalError("disk I/O error")
        return self.conn.execute(sql, *args)


@pytest.mark.parametrize("ends", [True, False])
def test_a_failed_commit_fails_every_kept_write_and_spares_the_refused_ones_error(
    tmp_path: Path, ends: bool
) -> None:
    class Refused(Exception):
        pass

    def refuse(conn: Any) -> None:
        raise Refused()

    path = str(tmp_path / "f.sqlite3")
    with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as conn:
        conn.execute(
            "CREATE TABLE adk_ledger (tenant, run_id, micros, input_tokens, output_tokens)"
        )
        outcomes, committed = run_batch(
            _CommitFails(conn, ends=ends),  # type: ignore[arg-type]
            [put("a"), refuse, put("b")],
            path=path,
            savepoint=savepoint_name(),
        )
        assert not committed and not conn.in_transaction
        assert isinstance(outcomes[1].error, Refused)
        kept = (outcomes[0].error, outcomes[2].error)
        if ends:
            assert all(isinstance(e, CommitInDoubt) for e in kept)
        else:
            assert all(isinstance(e, sqlite3.OperationalError) for e in kept)
        assert conn.execute("SELECT count(*) FROM adk_ledger").fetchone() == (0,)


async def test_begin_refused_by_another_writer_fails_the_whole_batch_and_writes_nothing(
    tmp_path: Path,
) -> None:
    db = SqliteDatabase(tmp_path / "adk.sqlite3", synchronous="normal", busy_timeout=0.1)
    await db.create_schema()
    try:
        await db.write(put("warm"))
        with contextlib.closing(sqlite3.connect(db.path, isolation_level=None)) as other:
            other.execute("BEGIN IMMEDIATE")
            results = await _batched(db, [put("a"), put("b"), put("c")])
            assert all(isinstance(r, StoreUnavailableError) for r in results[:3])
            other.execute("COMMIT")
        assert stored_rows(db.path) == ["warm"]
        assert not await _in_transaction(db)
        assert await db.write(put("after")) == "after"
    finally:
        await db.aclose()


# --- closing the database ------------------------------------------------------------------


async def test_closing_while_a_group_holds_the_connection_answers_its_waiters(
    tmp_path: Path,
) -> None:
    db = SqliteDatabase(tmp_path / "adk.sqlite3", synchronous="normal")
    await db.create_schema()
    with group_scope():
        group = db.write_group()
        await group.begin()
        await db.write(put("grouped"))
    waiting_write = asyncio.create_task(db.write(put("waiting")))
    waiting_read = asyncio.create_task(
        db.read(lambda c: c.execute("SELECT count(*) FROM adk_ledger").fetchone())
    )
    await asyncio.sleep(0.05)
    assert not waiting_write.done() and not waiting_read.done()
    await db.aclose()
    with pytest.raises(ConfigurationError):
        await group.commit()
    _done, pending = await asyncio.wait([waiting_write, waiting_read], timeout=LIMIT)
    for task in pending:
        task.cancel()
    assert not pending, "callers waiting for the group hang after aclose()"
    assert stored_rows(db.path) == []


async def test_closing_while_writes_are_queued_answers_each_truthfully(tmp_path: Path) -> None:
    db = SqliteDatabase(tmp_path / "adk.sqlite3", synchronous="normal")
    await db.create_schema()
    keys = [f"k{i:03}" for i in range(60)]
    async with _thread_busy(db):
        tasks = [asyncio.create_task(db.write(put(k))) for k in keys[:30]]
        for _ in range(3):
            await asyncio.sleep(0)
        closing = asyncio.create_task(db.aclose())
        await asyncio.sleep(0)
        tasks += [asyncio.create_task(db.write(put(k))) for k in keys[30:]]
    _done, pending = await asyncio.wait([*tasks, closing], timeout=LIMIT)
    assert not pending
    results = [t.exception() or t.result() for t in tasks]
    rows = stored_rows(db.path)
    _assert_told_the_truth(results, keys, rows)
    assert all(isinstance(r, ConfigurationError) for r in results[30:])
    assert results[:30] == keys[:30]


class _HookedDeque(deque):  # type: ignore[type-arg]
    """The database's queue of writes, running ``hook`` right after one append: to put
    another thread's step exactly between a caller's append and its ``_queue``."""

    hook: Callable[[], None] | None = None

    def append(self, item: Any) -> None:
        super().append(item)
        hook, self.hook = self.hook, None
        if hook is not None:
            hook()


async def test_a_write_racing_aclose_on_another_thread_is_not_told_closed_once_committed(
    tmp_path: Path,
) -> None:
    db = SqliteDatabase(tmp_path / "adk.sqlite3", synchronous="normal")
    await db.create_schema()
    await db.write(put("warm"))
    started, go = threading.Event(), threading.Event()

    def block(conn: sqlite3.Connection) -> None:
        started.set()
        go.wait(LIMIT)

    blocker = asyncio.create_task(db.write(block))
    assert await asyncio.to_thread(started.wait, LIMIT)
    hooked = _HookedDeque()
    db._writes = hooked
    first = asyncio.create_task(db.write(put("first")))  # its drain is queued now
    for _ in range(3):
        await asyncio.sleep(0)

    def aclose_elsewhere() -> None:
        # Right after "racing" is appended: the thread goes on, and another thread closes
        # the database; its close runs after the drain already queued (first's), which
        # takes "racing" too and commits it.
        go.set()
        closer = threading.Thread(target=asyncio.run, args=(db.aclose(),))
        closer.start()
        closer.join(LIMIT)

    hooked.hook = aclose_elsewhere
    outcome: Any
    try:
        outcome = await asyncio.wait_for(db.write(put("racing")), LIMIT)
    except ConfigurationError as exc:
        outcome = exc
    await asyncio.wait_for(blocker, LIMIT)
    assert await asyncio.wait_for(first, LIMIT) == "first"
    _assert_told_the_truth([outcome], ["racing"], stored_rows(db.path))


# --- cancellation ----------------------------------------------------------------------------


@pytest.mark.parametrize("steps", range(8))
async def test_cancelling_batched_callers_at_any_step_keeps_acks_true_and_no_txn_open(
    database: SqliteDatabase, steps: int
) -> None:
    keys = [f"s{steps}-{i:02}" for i in range(16)]
    async with _thread_busy(database):
        tasks = [asyncio.create_task(database.write(put(k))) for k in keys]
        reads = [
            asyncio.create_task(
                database.read(lambda c: c.execute("SELECT count(*) FROM adk_ledger").fetchone())
            )
            for _ in range(4)
        ]
    for _ in range(steps):
        await asyncio.sleep(0)
    for task in [*tasks[::2], *reads[::2]]:
        task.cancel()
    await asyncio.wait([*tasks, *reads], timeout=LIMIT)
    assert all(t.done() for t in [*tasks, *reads])
    rows = stored_rows(database.path)
    for key, task in zip(keys, tasks, strict=True):
        if not task.cancelled():
            assert task.result() == key and key in rows
    assert not await _in_transaction(database)
    assert await database.write(put(f"s{steps}-after")) == f"s{steps}-after"


@pytest.mark.parametrize("steps", range(10))
async def test_cancelling_a_group_begin_at_any_step_never_leaves_the_connection_held(
    database: SqliteDatabase, steps: int
) -> None:
    async def grouped() -> None:
        with group_scope():
            group = database.write_group()
            try:
                await group.begin()
                await database.write(put(f"g{steps}"))
            finally:
                await asyncio.shield(group.commit())

    async with _thread_busy(database):
        owner = asyncio.create_task(grouped())
        batched = [asyncio.create_task(database.write(put(f"b{steps}-{i}"))) for i in range(4)]
    for _ in range(steps):
        await asyncio.sleep(0)
    owner.cancel()
    await asyncio.wait([owner, *batched], timeout=LIMIT)
    assert all(t.done() for t in batched), "batched writes hang behind a cancelled group"
    assert [t.result() for t in batched] == [f"b{steps}-{i}" for i in range(4)]
    if not owner.cancelled() and owner.exception() is None:
        assert f"g{steps}" in stored_rows(database.path)
    assert await asyncio.wait_for(database.write(put(f"after{steps}")), LIMIT)
    assert not await _in_transaction(database)


# --- several event loops in threads -----------------------------------------------------------


def test_writes_reads_and_groups_from_several_loops_in_threads_all_land_once(
    tmp_path: Path,
) -> None:
    db = SqliteDatabase(tmp_path / "adk.sqlite3", synchronous="normal")
    asyncio.run(db.create_schema())
    acked: list[str] = []

    async def worker(w: int) -> None:
        for i in range(25):
            kind = (w + i) % 3
            if kind == 0:
                keys = [f"w{w}-{i}-{j}" for j in range(4)]
                got = await asyncio.gather(*(db.write(put(k)) for k in keys))
                acked.extend(got)
            elif kind == 1:
                await db.read(lambda c: c.execute("SELECT count(*) FROM adk_ledger").fetchone())
                acked.append(await db.write(put(f"w{w}-{i}-r")))
            else:
                with group_scope():
                    group = db.write_group()
                    await group.begin()
                    try:
                        await db.write(put(f"w{w}-{i}-g1"))
                        await db.write(put(f"w{w}-{i}-g2"))
                    finally:
                        await group.commit()
                acked.extend([f"w{w}-{i}-g1", f"w{w}-{i}-g2"])

    on_loops_in_threads(db, worker, acked, limit=LIMIT)


# --- many writes, fences and leases ----------------------------------------------------------


async def test_thousands_of_queued_writes_all_commit_in_few_transactions(
    database: SqliteDatabase,
) -> None:
    keys = [f"m{i:05}" for i in range(3000)]
    before = database.commits
    got = await asyncio.wait_for(
        asyncio.gather(*(database.write(put(k)) for k in keys)), 10 * LIMIT
    )
    assert got == keys
    assert stored_rows(database.path) == keys
    assert database.commits - before < len(keys)


async def test_lease_takers_batched_together_have_exactly_one_winner(
    database: SqliteDatabase,
) -> None:
    leases = SqliteLeaseStore(database)
    async with _thread_busy(database):
        tasks = [asyncio.create_task(leases.acquire("t", "r", f"w{i}", 300)) for i in range(8)]
    results = await asyncio.gather(*tasks, return_exceptions=True)
    won = [r for r in results if not isinstance(r, BaseException)]
    assert len(won) == 1 and won[0].fence == 1
    assert all(isinstance(r, LeaseHeldError) for r in results if r is not won[0])
    current = await leases.current("t", "r")
    assert current is not None and current.holder == won[0].holder
    assert current.fence == 1


# --- real processes, SIGKILLed mid-batch -------------------------------------------------------

_CHILD = textwrap.dedent(
    """
    import asyncio, sqlite3, sys
    from tesserix_adk.stores.sqlite import SqliteDatabase

    path, name = sys.argv[1], sys.argv[2]

    def pair(key):
        def fn(conn):
            for half in ("a", "b"):
                conn.execute(
                    "INSERT INTO adk_ledger (tenant, run_id, micros, input_tokens, "
                    "output_tokens) VALUES ('t', ?, 1, 0, 0)", (key + "-" + half,))
            return key
        return fn

    async def main():
        db = SqliteDatabase(path)
        async def one(key):
            try:
                await db.write(pair(key))
            except Exception as exc:
                print("ERR", type(exc).__name__, flush=True)
            else:
                print(key, flush=True)
        i = 0
        while True:
            await asyncio.gather(*(one(f"{name}.{i + j}") for j in range(16)))
            i += 16

    asyncio.run(main())
    """
)


def test_processes_sigkilled_mid_batch_lose_no_ack_and_half_apply_nothing(
    tmp_path: Path,
) -> None:
    db = SqliteDatabase(tmp_path / "adk.sqlite3")
    asyncio.run(db.create_schema())
    asyncio.run(db.aclose())
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src")}
    children = [
        subprocess.Popen(
            [sys.executable, "-c", _CHILD, db.path, name],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
        )
        for name in ("p", "q")
    ]
    try:
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            time.sleep(0.05)
            with contextlib.suppress(sqlite3.Error):
                if len(stored_rows(db.path)) >= 400:
                    break
    finally:
        for child in children:
            child.send_signal(signal.SIGKILL)
    acked: list[str] = []
    for child in children:
        out, err = child.communicate(timeout=LIMIT)
        lines = out.decode().split()
        assert "ERR" not in lines, err.decode()
        acked += lines
    assert len(acked) >= 1
    rows = stored_rows(db.path)
    halves: dict[str, list[str]] = {}
    for row in rows:
        key, _, half = row.rpartition("-")
        halves.setdefault(key, []).append(half)
    assert all(sorted(h) == ["a", "b"] for h in halves.values()), "a write half-applied"
    assert set(acked) <= set(halves), "an acknowledged write was lost"
