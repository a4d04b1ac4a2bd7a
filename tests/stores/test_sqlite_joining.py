"""A run's calls joining its write group on SQLite (``SqliteDatabase.write``/``read`` inside
a group): the group takes the connection at its first call, in the worker thread (that call
begins the transaction, which may wait on another process); once the transaction is open, a
small call runs on the caller's own thread, with no hop to the worker thread and back.

What must not change: every call is answered as it would be in the thread (its value, its
error, undone alone if it fails), the loop is never blocked waiting for the connection, and
what commits is what the group was told it wrote."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sqlite_writes import noting_thread, on_loops_in_threads, put, stored_rows
from tesserix_adk.errors import StoreUnavailableError
from tesserix_adk.stores.grouping import group_scope
from tesserix_adk.stores.sqlite import SqliteDatabase
from tesserix_adk.stores.sqlite.grouping import INLINE_BYTES

LIMIT = 3.0  # seconds a caller may wait before it counts as hung


async def test_a_group_begins_and_commits_without_the_thread_when_nothing_joins_it(
    database: SqliteDatabase,
) -> None:
    await database.write(put("before"))  # the thread exists, the file is open
    before = database.handoffs
    with group_scope():
        group = database.write_group()
        await group.begin()
        await group.commit()
    assert database.handoffs == before
    assert await database.write(put("after")) == "after"
    assert stored_rows(database.path) == ["after", "before"]


async def test_a_groups_first_call_begins_in_the_thread_and_small_ones_after_it_stay_here(
    database: SqliteDatabase,
) -> None:
    seen: dict[str, str] = {}
    here = threading.current_thread().name
    before = database.handoffs
    with group_scope():
        group = database.write_group()
        await group.begin()
        await database.write(noting_thread("a", seen), weight=0)
        await database.write(noting_thread("b", seen), weight=INLINE_BYTES)
        count = await database.read(
            lambda c: c.execute("SELECT count(*) FROM adk_ledger").fetchone()[0], weight=0
        )
        await group.commit()
    assert seen["a"].startswith("tesserix-sqlite")
    assert seen["b"] == here
    assert count == 2  # the read saw the group's own writes
    assert database.handoffs - before == 2  # the first call and the commit
    assert stored_rows(database.path) == ["a", "b"]


@pytest.mark.parametrize("weight", [None, INLINE_BYTES + 1])
async def test_a_large_or_unweighed_call_of_a_group_goes_to_the_thread(
    database: SqliteDatabase, weight: int | None
) -> None:
    seen: dict[str, str] = {}
    with group_scope():
        group = database.write_group()
        await group.begin()
        await database.write(noting_thread("a", seen), weight=0)
        await database.write(noting_thread("b", seen), weight=weight)
        await group.commit()
    assert seen["b"].startswith("tesserix-sqlite")
    assert stored_rows(database.path) == ["a", "b"]


async def test_a_small_call_that_finds_the_connection_in_use_queues_and_the_loop_runs_on(
    database: SqliteDatabase,
) -> None:
    seen: dict[str, str] = {}
    with group_scope():
        group = database.write_group()
        await group.begin()
        await database.write(put("a"), weight=0)
        # Another thread inside the connection (as the worker thread is while it runs a
        # job): the caller must neither wait for it on the loop nor use the connection.
        database._lock.acquire()
        try:
            write = asyncio.create_task(database.write(noting_thread("b", seen), weight=0))
            ticks = 0
            for _ in range(20):
                await asyncio.sleep(0.005)
                ticks += 1
            assert ticks == 20 and not write.done()
        finally:
            database._lock.release()
        assert await asyncio.wait_for(write, LIMIT) == "b"
        await group.commit()
    assert seen["b"].startswith("tesserix-sqlite")
    assert stored_rows(database.path) == ["a", "b"]


def _failing(key: str, error: Callable[[sqlite3.Connection], Any]) -> Callable[..., str]:
    """Writes ``key``'s row, then fails as ``error`` does."""
    write = put(key)

    def fn(conn: sqlite3.Connection) -> str:
        write(conn)
        error(conn)
        return key

    return fn


def _bad_sql(conn: sqlite3.Connection) -> None:
    conn.execute("INSERT INTO no_such_table VALUES (1)")


def _python_error(conn: sqlite3.Connection) -> None:
    raise ValueError("refused by the write")


@pytest.mark.parametrize("error", [_bad_sql, _python_error])
async def test_a_failing_call_on_the_callers_thread_is_told_and_undone_as_in_the_thread(
    database: SqliteDatabase, error: Callable[[sqlite3.Connection], Any]
) -> None:
    told: dict[int | None, BaseException] = {}
    for weight in (None, 0):
        with group_scope():
            group = database.write_group()
            await group.begin()
            await database.write(put(f"first-{weight}"), weight=0)
            with pytest.raises(Exception) as caught:
                await database.write(_failing(f"failed-{weight}", error), weight=weight)
            told[weight] = caught.value
            await database.write(put(f"then-{weight}"), weight=0)
            await group.commit()
    assert type(told[0]) is type(told[None])
    assert str(told[0]) == str(told[None])
    assert stored_rows(database.path) == ["first-0", "first-None", "then-0", "then-None"]


async def test_a_second_group_waits_at_its_first_call_and_lands_after_the_first_commits(
    database: SqliteDatabase,
) -> None:
    order: list[str] = []
    first_wrote = asyncio.Event()
    release_first = asyncio.Event()

    async def first() -> None:
        with group_scope():
            group = database.write_group()
            await group.begin()
            await database.write(put("1a"), weight=0)
            first_wrote.set()
            await release_first.wait()
            await database.write(put("1b"), weight=0)
            await group.commit()
            order.append("first committed")

    async def second() -> None:
        await first_wrote.wait()
        with group_scope():
            group = database.write_group()
            await group.begin()  # takes nothing, so it does not wait
            order.append("second begun")
            await database.write(put("2a"), weight=0)
            order.append("second wrote")
            await group.commit()

    tasks = [asyncio.create_task(first()), asyncio.create_task(second())]
    for _ in range(20):
        await asyncio.sleep(0.005)
    assert order == ["second begun"]  # its first write waits for the first group
    release_first.set()
    await asyncio.wait_for(asyncio.gather(*tasks), LIMIT)
    assert order == ["second begun", "first committed", "second wrote"]
    assert stored_rows(database.path) == ["1a", "1b", "2a"]


async def test_a_call_of_a_group_that_already_committed_is_refused_and_begins_nothing(
    database: SqliteDatabase,
) -> None:
    with group_scope():
        group = database.write_group()
        await group.begin()
        await database.write(put("a"), weight=0)
        await group.commit()
    # A call that found the group open and reached the thread only after its commit (a
    # caller racing the commit from another task): it must not open a transaction that
    # nobody would commit.
    loop = asyncio.get_running_loop()
    with pytest.raises(StoreUnavailableError, match="already ended"):
        await database._submit(
            lambda: group._in_thread(put("late"), False, loop, loop.create_future())
        )
    assert await asyncio.wait_for(database.write(put("b")), LIMIT) == "b"
    assert stored_rows(database.path) == ["a", "b"]


def test_groups_of_small_calls_from_several_loops_in_threads_all_land_once(
    tmp_path: Path,
) -> None:
    db = SqliteDatabase(tmp_path / "adk.sqlite3", synchronous="normal")
    asyncio.run(db.create_schema())
    acked: list[str] = []

    async def worker(w: int) -> None:
        for i in range(25):
            if i % 2:
                acked.append(await db.write(put(f"w{w}-{i}-alone")))
                continue
            with group_scope():
                group = db.write_group()
                await group.begin()
                try:
                    for j in range(3):
                        await db.write(put(f"w{w}-{i}-g{j}"), weight=0)
                        await db.read(
                            lambda c: c.execute("SELECT count(*) FROM adk_ledger").fetchone(),
                            weight=0,
                        )
                finally:
                    await group.commit()
            acked.extend(f"w{w}-{i}-g{j}" for j in range(3))

    on_loops_in_threads(db, worker, acked, limit=LIMIT)


# --- against an oracle: the same calls, all in the thread ------------------------------------

_CALL = st.tuples(
    st.sampled_from(["write", "fail", "bad-sql", "read"]),
    st.sampled_from([None, 0, INLINE_BYTES + 1]),
)


async def _outcomes(
    db: SqliteDatabase, groups: list[list[tuple[str, int | None]]], *, inline: bool
) -> list[Any]:
    told: list[Any] = []
    for g, calls in enumerate(groups):
        with group_scope():
            group = db.write_group()
            await group.begin()
            for c, (kind, weight) in enumerate(calls):
                key = f"g{g:02}-c{c:02}"
                fn: Callable[[sqlite3.Connection], Any] = {
                    "write": put(key),
                    "fail": _failing(key, _python_error),
                    "bad-sql": _failing(key, _bad_sql),
                    "read": lambda conn: conn.execute(
                        "SELECT run_id FROM adk_ledger ORDER BY run_id"
                    ).fetchall(),
                }[kind]
                call = db.read if kind == "read" else db.write
                try:
                    told.append(await call(fn, weight=weight if inline else None))
                except Exception as exc:
                    told.append((type(exc).__name__, str(exc).replace(db.path, "<file>")))
            await group.commit()
    return told


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(groups=st.lists(st.lists(_CALL, max_size=6), min_size=1, max_size=4))
def test_calls_on_the_callers_thread_answer_and_commit_as_the_thread_would(
    tmp_path_factory: pytest.TempPathFactory, groups: list[list[tuple[str, int | None]]]
) -> None:
    async def both() -> tuple[list[Any], list[str], list[Any], list[str]]:
        results = []
        for inline in (True, False):
            db = SqliteDatabase(tmp_path_factory.mktemp("j") / "adk.sqlite3", synchronous="normal")
            await db.create_schema()
            try:
                told = await _outcomes(db, groups, inline=inline)
            finally:
                await db.aclose()
            results.extend([told, stored_rows(db.path)])
        return results[0], results[1], results[2], results[3]

    told_inline, rows_inline, told_thread, rows_thread = asyncio.run(both())
    assert told_inline == told_thread
    assert rows_inline == rows_thread


async def test_a_group_whose_first_call_was_cancelled_while_waiting_commits_nothing_of_another(
    database: SqliteDatabase,
) -> None:
    wrote, go_on = asyncio.Event(), asyncio.Event()

    async def first() -> None:
        with group_scope():
            group = database.write_group()
            await group.begin()
            await database.write(put("1a"), weight=0)
            wrote.set()
            await go_on.wait()
            await database.write(put("1b"), weight=0)
            await group.commit()

    holder = asyncio.create_task(first())
    await wrote.wait()
    with group_scope():
        second = database.write_group()
        await second.begin()
        waiting = asyncio.create_task(database.write(put("2a"), weight=0))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        await second.commit()
    # The first group's transaction is still its own: nothing of it is committed yet.
    assert stored_rows(database.path) == []
    go_on.set()
    await asyncio.wait_for(holder, LIMIT)
    assert stored_rows(database.path) == ["1a", "1b"]


async def test_a_group_commit_called_off_before_the_thread_began_it_rolls_back_and_lets_go(
    database: SqliteDatabase,
) -> None:
    # Found with this change (the attack on a stream left mid-group hung its lease
    # release), older than it: the commit's job, cancelled before the thread took it up,
    # never ran, and the group held the connection for good.
    started, go = threading.Event(), threading.Event()

    def block() -> None:
        started.set()
        go.wait(LIMIT)

    with group_scope():
        group = database.write_group()
        await group.begin()
        await database.write(put("grouped"), weight=0)
        busy = asyncio.create_task(database._submit(block))
        assert await asyncio.to_thread(started.wait, LIMIT)
        committing = asyncio.create_task(group.commit())
        await asyncio.sleep(0.01)
        committing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await committing
    go.set()
    await busy
    assert await asyncio.wait_for(database.write(put("after")), LIMIT) == "after"
    assert stored_rows(database.path) == ["after"]
