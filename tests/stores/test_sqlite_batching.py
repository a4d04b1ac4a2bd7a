"""Group commit across runs on one SQLite file: writes queued while the thread was busy
share one transaction and one COMMIT, and each comes out as it would have alone."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sqlite_writes import put, stored_rows
from tesserix_adk.errors import StaleFenceError, StoreReplyLostError, StoreUnavailableError
from tesserix_adk.stores.protocols import RecordStatus
from tesserix_adk.stores.sqlite import (
    SqliteDatabase,
    SqliteIdempotencyStore,
    SqliteLeaseStore,
)


async def test_writes_sent_together_share_commits(database: SqliteDatabase) -> None:
    """32 writes of 32 callers at once: fewer COMMITs (fsyncs) than writes, all durable."""
    before = database.commits
    done = await asyncio.gather(*(database.write(put(f"r{i:02}")) for i in range(32)))
    assert done == [f"r{i:02}" for i in range(32)]
    assert database.commits - before < 32
    assert stored_rows(database.path) == [f"r{i:02}" for i in range(32)]


async def test_a_failing_write_is_undone_alone_and_its_neighbours_commit(
    database: SqliteDatabase,
) -> None:
    class Refused(Exception):
        pass

    def half_then_refuse(conn: sqlite3.Connection) -> None:
        put("half")(conn)
        raise Refused("decided against it")

    before = database.commits
    results = await asyncio.gather(
        database.write(put("a")),
        database.write(half_then_refuse),
        database.write(put("b")),
        return_exceptions=True,
    )
    assert results[0] == "a" and results[2] == "b"
    assert isinstance(results[1], Refused)
    assert stored_rows(database.path) == ["a", "b"]  # the refused write's half is gone
    assert database.commits - before < 3


async def test_a_constraint_error_in_a_batch_is_that_writes_alone(
    database: SqliteDatabase,
) -> None:
    await database.write(put("taken"))
    results = await asyncio.gather(
        database.write(put("x")),
        database.write(put("taken")),  # primary key: refused by SQLite
        database.write(put("y")),
        return_exceptions=True,
    )
    assert results[0] == "x" and results[2] == "y"
    assert isinstance(results[1], StoreUnavailableError)
    assert stored_rows(database.path) == ["taken", "x", "y"]


def test_no_write_of_a_batch_is_answered_before_its_commit(tmp_path: Path) -> None:
    """A COMMIT refused (here a deferred foreign key, checked only there) leaves every
    write of the batch failed with that error and nothing of them in the file: nobody was
    answered from a savepoint."""
    from tesserix_adk.stores.sqlite.batching import run_batch, savepoint_name

    conn = sqlite3.connect(tmp_path / "f.sqlite3", isolation_level=None)
    try:
        conn.execute("PRAGMA foreign_keys = ON")
        conn.execute("CREATE TABLE p (id INTEGER PRIMARY KEY)")
        conn.execute(
            "CREATE TABLE c (id INTEGER, pid INTEGER REFERENCES p(id) DEFERRABLE INITIALLY "
            "DEFERRED)"
        )

        def insert(row: int, parent: int) -> Callable[[sqlite3.Connection], int]:
            def fn(c: sqlite3.Connection) -> int:
                c.execute("INSERT INTO c (id, pid) VALUES (?, ?)", (row, parent))
                return row

            return fn

        conn.execute("INSERT INTO p (id) VALUES (1)")
        outcomes, committed = run_batch(
            conn, [insert(1, 1), insert(2, 99), insert(3, 1)], path="f", savepoint=savepoint_name()
        )
        assert not committed
        assert [type(o.error) for o in outcomes] == [sqlite3.IntegrityError] * 3
        assert [o.value for o in outcomes] == [None, None, None]
        assert not conn.in_transaction
        assert conn.execute("SELECT count(*) FROM c").fetchone() == (0,)
        # The same writes without the orphan commit together.
        outcomes, committed = run_batch(
            conn, [insert(1, 1), insert(3, 1)], path="f", savepoint=savepoint_name()
        )
        assert committed and [o.value for o in outcomes] == [1, 3]
    finally:
        conn.close()


async def test_commit_in_doubt_reaches_every_write_of_the_batch_as_reply_lost(
    database: SqliteDatabase, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tesserix_adk.stores.sqlite import batching

    real = batching.run_batch

    def in_doubt(conn: sqlite3.Connection, fns: Any, **options: Any) -> Any:
        outcomes, _ = real(conn, fns, **options)
        doubt = batching.CommitInDoubt(sqlite3.OperationalError("disk I/O error"))
        return [batching.BatchOutcome(error=doubt) for _ in outcomes], False

    monkeypatch.setattr("tesserix_adk.stores.sqlite.database.run_batch", in_doubt)
    results = await asyncio.gather(
        database.write(put("a")), database.write(put("b")), return_exceptions=True
    )
    assert all(isinstance(r, StoreReplyLostError) for r in results)


# --- an oracle: a batch decides as the same writes one by one would ------------------------

_op = st.one_of(
    st.tuples(st.just("claim"), st.sampled_from("abc"), st.sampled_from(["h1", "h2"])),
    st.tuples(st.just("complete"), st.sampled_from("abc"), st.sampled_from(["h1", "h2"])),
    st.tuples(st.just("lease"), st.sampled_from("xy"), st.sampled_from(["w1", "w2"])),
    st.tuples(st.just("seal"), st.sampled_from("xy"), st.integers(min_value=1, max_value=3)),
)


async def _apply(db: SqliteDatabase, ops: list[tuple[str, str, Any]], together: bool) -> list[str]:
    idem = SqliteIdempotencyStore(db)
    leases = SqliteLeaseStore(db)

    async def one(op: tuple[str, str, Any]) -> str:
        kind, name, who = op
        try:
            if kind == "claim":
                rec = await idem.claim(
                    f"k:{name}",
                    holder=who,
                    tenant="t",
                    run_id="r",
                    iteration=1,
                    tool="book",
                    call_id=name,
                    flags=None,
                    ttl=300,
                )
                return f"claim {rec.status.value} {rec.holder}"
            if kind == "complete":
                await idem.complete(f"k:{name}", b"{}", tenant="t", holder=who)
                return "completed"
            if kind == "lease":
                lease = await leases.acquire("t", name, who, 300)
                return f"lease {lease.holder} {lease.fence}"
            await idem.seal("t", name, who)
            return "sealed"
        except Exception as exc:
            return type(exc).__name__

    if together:
        return list(await asyncio.gather(*(one(op) for op in ops)))
    return [await one(op) for op in ops]


async def _state(db: SqliteDatabase) -> list[tuple[Any, ...]]:
    return await db.read(
        lambda c: [
            *c.execute("SELECT key, status, holder FROM adk_idempotency ORDER BY key"),
            *c.execute("SELECT run_id, holder, fence FROM adk_run_leases ORDER BY run_id"),
            *c.execute("SELECT * FROM adk_fences ORDER BY 1, 2"),
        ]
    )


@given(ops=st.lists(_op, min_size=1, max_size=12))
@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
def test_writes_batched_together_decide_as_they_would_one_by_one(
    tmp_path_factory: pytest.TempPathFactory, ops: list[tuple[str, str, Any]]
) -> None:
    """Oracle: the same operations awaited one at a time on a file of their own (a COMMIT
    each). Sent together, they are batched, and every answer and the stored state match."""

    async def go() -> None:
        results = []
        for together in (False, True):
            db = SqliteDatabase(tmp_path_factory.mktemp("b") / "adk.sqlite3", synchronous="normal")
            await db.create_schema()
            try:
                answers = await _apply(db, ops, together)
                results.append((answers, await _state(db), db.commits))
            finally:
                await db.aclose()
        (alone, alone_state, _), (batched, batched_state, _) = results
        assert batched == alone
        assert batched_state == alone_state

    asyncio.run(go())


async def test_a_stale_write_batched_with_a_fresh_one_is_refused_alone(
    database: SqliteDatabase,
) -> None:
    idem = SqliteIdempotencyStore(database)
    await idem.seal("t", "r", 2)

    async def claim(key: str, fence: int) -> Any:
        sealed = SqliteIdempotencyStore(database)
        return await sealed.claim(
            key,
            holder=f"h{fence}",
            tenant="t",
            run_id="r",
            iteration=1,
            tool="book",
            call_id=key,
            flags=None,
            ttl=300,
            fence=fence,
        )

    results = await asyncio.gather(claim("old", 1), claim("new", 2), return_exceptions=True)
    assert isinstance(results[0], StaleFenceError)
    assert results[1].status is RecordStatus.in_flight
