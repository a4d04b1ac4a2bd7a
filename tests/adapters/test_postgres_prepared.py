"""The kit's statements are prepared on the server once per direct connection and then sent
by name, and what a connection has prepared is known, never assumed (``prepared``)."""

from __future__ import annotations

import asyncio
from importlib import resources
from pathlib import Path
from typing import Any

import psycopg
import pytest

from adapters import services
from adapters.pooler import pgbouncer
from adapters.wire import Wire
from tesserix_adk import Agent, AgentRunner, ScriptedProvider, ScriptedTurn, tool
from tesserix_adk.adapters.postgres import open_postgres_stores
from tesserix_adk.adapters.postgres.driver import batched
from tesserix_adk.adapters.postgres.prepared import PreparedStatements, _form
from tesserix_adk.errors import StoreUnavailableError
from tesserix_adk.stores.bundle import Stores

pytestmark = pytest.mark.postgres

T = "acme"
# A statement of the kind the kit batches: a CTE that writes and returns rows.
UPSERT = (
    "-- a comment first, as the kit's statement files have\n"
    "WITH up AS (INSERT INTO kv (k, v) VALUES (%(k)s, %(v)s::bigint) "
    "ON CONFLICT (k) DO UPDATE SET v = EXCLUDED.v RETURNING k, v) SELECT k, v FROM up"
)


async def _run(stores: Stores, run_id: str, turns: int = 3) -> None:
    @tool
    def book(seat: str) -> str:
        return f"booked {seat}"

    script: list[Any] = [ScriptedTurn(calls=[("book", {"seat": str(t)})]) for t in range(turns)]
    runner = AgentRunner.from_stores(ScriptedProvider([*script, "done"]), stores, group_writes=True)
    run = await runner.run(
        Agent("p", "b", tools=[book], max_iterations=20), "go", tenant=T, run_id=run_id
    )
    assert run.status == "completed"


async def test_a_groups_statements_are_prepared_once_a_connection_then_sent_by_name(
    pg_url: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    wire = Wire(monkeypatch, tmp_path)
    stores = open_postgres_stores(services.with_query(pg_url, pool_max="1", prepare_threshold="0"))
    try:
        await stores.create_schema()
        wire.read()
        await _run(stores, "first")
        first = wire.read()
        prepares = [q for q in first if "PREPARE adk_" in q]
        assert prepares, "the first run prepares the statements it writes with"
        await _run(stores, "second")
        second = wire.read()
    finally:
        await stores.aclose()
    statements = [
        part.split(" AS ", 1)[1]
        for q in [*first, *second]
        for part in q.split(";\n")
        if part.startswith("PREPARE adk_")
    ]
    assert len(statements) == len(set(statements)), "prepared once, on its one connection"
    executes = [q for q in second if "EXECUTE adk_" in q]
    # Every grouped write of the second run: 3 turns of 6 writes, and the final frontier.
    assert len(executes) >= 3 * 5
    # The statements' text (their CTEs) crosses the wire only inside a PREPARE, but for
    # the connection's first message, which asks whether the session is its own.
    sent = [*first, *second]
    as_text = [q for q in sent if "WITH " in q and "PREPARE " not in q]
    assert all("pg_backend_pid()" in q for q in as_text)
    assert len([q for q in sent if "pg_backend_pid()" in q]) == 1


async def test_behind_a_transaction_pooler_nothing_is_prepared(
    pg_url: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    wire = Wire(monkeypatch, tmp_path)
    stores = open_postgres_stores(services.with_query(pg_url, prepare_threshold="none"))
    try:
        await stores.create_schema()
        wire.read()
        await _run(stores, "pooled")
        sent = wire.read()
    finally:
        await stores.aclose()
    assert [q for q in sent if "WITH " in q], "the statements go as text"
    assert not [q for q in sent if "PREPARE adk_" in q or "EXECUTE adk_" in q]


async def test_behind_a_pooler_nothing_is_prepared_whatever_prepare_threshold_says(
    pg_schema: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A prepared statement lives in one server session, which a transaction pooler does
    not keep for a client: the kit sees the pid it was given is not its backend's."""
    wire = Wire(monkeypatch, tmp_path)
    with pgbouncer() as bouncer:
        url = bouncer.url(schema=pg_schema, prepare_threshold="0")
        stores = open_postgres_stores(url)
        try:
            await stores.create_schema()
            await _run(stores, "pooled")
            await _run(stores, "pooled-again")
            sent = wire.read()
        finally:
            await stores.aclose()
    assert [q for q in sent if "pg_backend_pid()" in q], "asked on its first message"
    assert not [q for q in sent if "PREPARE adk_" in q or "EXECUTE adk_" in q]


@pytest.fixture
async def conn(pg_url: str) -> Any:
    connection = await psycopg.AsyncConnection.connect(pg_url, autocommit=True)
    await connection.execute("CREATE TABLE kv (k text PRIMARY KEY, v bigint)")
    try:
        yield connection
    finally:
        await connection.close()


async def _prepared(conn: Any) -> PreparedStatements:
    """A record for ``conn`` that has learnt the session is its own (its first message)."""
    prepared = PreparedStatements()
    assert await batched(conn, (), [("SELECT 1 AS one", {})], prepared=prepared) == [[{"one": 1}]]
    assert prepared.on(conn).direct is True
    return prepared


async def _on_server(conn: Any) -> set[str]:
    cur = await conn.execute("SELECT name FROM pg_prepared_statements")
    return {row[0] for row in await cur.fetchall()}


async def test_a_statement_prepared_in_a_message_that_failed_is_found_not_prepared_again(
    conn: Any,
) -> None:
    prepared = await _prepared(conn)
    failing = ("SELECT 1 / %(zero)s::integer AS q", {"zero": 0})
    with pytest.raises(psycopg.errors.DivisionByZero):
        await batched(conn, (), [(UPSERT, {"k": "a", "v": 1}), failing], prepared=prepared)
    known = prepared.on(conn)
    assert not known.names and len(known.doubt) == 2  # the message failed: in doubt
    names = await _on_server(conn)
    # Both were prepared before the division failed (a PREPARE does not execute).
    assert names == set(known.doubt.values())
    [[row]] = await batched(conn, (), [(UPSERT, {"k": "a", "v": 2})], prepared=prepared)
    assert row == {"k": "a", "v": 2}
    assert await _on_server(conn) == names, "found on the server, not prepared again"
    assert not known.doubt and set(known.names.values()) == names


async def test_a_prepare_that_failed_is_forgotten_and_prepared_afresh(conn: Any) -> None:
    prepared = await _prepared(conn)
    missing = ("SELECT v FROM nowhere WHERE k = %(k)s", {"k": "a"})
    with pytest.raises(psycopg.errors.UndefinedTable):
        await batched(conn, (), [missing], prepared=prepared)
    await conn.execute("CREATE TABLE nowhere (k text, v bigint)")
    await conn.execute("INSERT INTO nowhere VALUES ('a', 7)")
    [[row]] = await batched(conn, (), [missing], prepared=prepared)
    assert row == {"v": 7}
    assert len(await _on_server(conn)) == 1


async def test_a_message_abandoned_midway_leaves_its_names_in_doubt_then_settled(
    conn: Any,
) -> None:
    prepared = await _prepared(conn)
    slow = ("SELECT pg_sleep(%(s)s::float8) AS slept", {"s": 5})
    task = asyncio.create_task(
        batched(conn, (), [(UPSERT, {"k": "b", "v": 1}), slow], prepared=prepared)
    )
    await asyncio.sleep(0.5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert len(prepared.on(conn).doubt) == 2
    if conn.info.transaction_status is not psycopg.pq.TransactionStatus.IDLE:
        pytest.skip("psycopg left the connection busy after the cancellation")
    [[row]] = await batched(conn, (), [(UPSERT, {"k": "b", "v": 3})], prepared=prepared)
    assert row == {"k": "b", "v": 3}


async def test_statements_deallocated_under_the_kit_fail_once_then_are_prepared_again(
    conn: Any,
) -> None:
    prepared = await _prepared(conn)
    await batched(conn, (), [(UPSERT, {"k": "c", "v": 1})], prepared=prepared)
    await conn.execute("DEALLOCATE ALL")
    with pytest.raises(psycopg.errors.InvalidSqlStatementName):
        await batched(conn, (), [(UPSERT, {"k": "c", "v": 2})], prepared=prepared)
    [[row]] = await batched(conn, (), [(UPSERT, {"k": "c", "v": 3})], prepared=prepared)
    assert row == {"k": "c", "v": 3}


async def test_a_statement_whose_table_changed_is_prepared_again(conn: Any) -> None:
    prepared = await _prepared(conn)
    everything = ("SELECT * FROM kv WHERE k = %(k)s", {"k": "d"})
    await batched(conn, (), [(UPSERT, {"k": "d", "v": 1})], prepared=prepared)
    assert await batched(conn, (), [everything], prepared=prepared) == [[{"k": "d", "v": 1}]]
    await conn.execute("ALTER TABLE kv ADD COLUMN w text DEFAULT 'x'")
    with pytest.raises(psycopg.errors.FeatureNotSupported, match="cached plan"):
        await batched(conn, (), [everything], prepared=prepared)
    rows = await batched(conn, (), [everything], prepared=prepared)
    assert rows == [[{"k": "d", "v": 1, "w": "x"}]]


async def test_a_group_write_after_its_statements_were_deallocated_stops_retryably_once(
    pg_url: str,
) -> None:
    stores = open_postgres_stores(services.with_query(pg_url, pool_max="1"))
    try:
        await stores.create_schema()
        await _run(stores, "before")
        database: Any = stores.history.database  # type: ignore[attr-defined]
        async with database.pool.connection() as pooled:
            await pooled.execute("DEALLOCATE ALL")
        async with services.write_group(stores) as group:
            with pytest.raises(StoreUnavailableError) as lost:
                await stores.history.append(T, "x", [b"{}"], fence=None, after=None)
            await group.commit()  # what was undone is gone; the group still commits
        assert lost.value.retryable
        await _run(stores, "after")
    finally:
        await stores.aclose()


async def test_two_records_over_one_connection_never_name_a_statement_alike(conn: Any) -> None:
    """Two databases built over one pool each keep their own record of the same sessions."""
    first, second = await _prepared(conn), await _prepared(conn)
    for prepared in (first, second, first):
        [[row]] = await batched(conn, (), [(UPSERT, {"k": "e", "v": 5})], prepared=prepared)
        assert row == {"k": "e", "v": 5}
    assert len(await _on_server(conn)) == 2


_NARROW = {"integer": ("integer", "int4", "int"), "smallint": ("smallint", "int2")}


async def test_a_value_prepared_as_a_narrow_integer_is_cast_so_in_the_statement_too(
    pg_stores: Stores, pg_admin: Any
) -> None:
    """Prepared, a value takes the type its context gives it; as text, a literal keeps its
    own. Where the two could differ (an integer column compared with a Python int past
    int4), the statement casts the value itself, so both read it alike (found by attack:
    records_from compared ``iteration`` uncast and failed past 2**31 once prepared)."""
    sql = resources.files("tesserix_adk.adapters.postgres") / "sql"
    files = sorted(
        f for folder in sql.iterdir() for f in folder.iterdir() if f.name.endswith(".sql")
    )
    assert len(files) > 30
    uncast = []
    for file in files:
        text = file.read_text(encoding="utf-8")
        form = _form(text)
        await pg_admin.execute(f"PREPARE adk_probe AS {form.text}")
        cur = await pg_admin.execute(
            "SELECT parameter_types::text[] FROM pg_prepared_statements WHERE name = 'adk_probe'"
        )
        (types,) = await cur.fetchone()
        await pg_admin.execute("DEALLOCATE adk_probe")
        for name, kind in zip(form.names, types, strict=True):
            casts = _NARROW.get(kind, ())
            if casts and not any(f"%({name})s::{cast}" in text for cast in casts):
                uncast.append(f"{file.name}: {name} ({kind})")
    assert uncast == []
