"""Attacks on a write group's statements prepared once per connection (``prepared.py``:
``PREPARE`` in the first message that runs a statement on a connection, ``EXECUTE
name(values)`` after, the values bound by psycopg's client cursor), against the real server.

Oracle: the same operations with ``prepare_threshold=none``, which sends every statement as
text exactly as the code before prepared statements did (``driver.batched``'s text branch is
that code), compared outcome by outcome and row by row. Attacked: hostile text, every byte,
the edges of integer, bigint and float parameters, NULLs and empty arrays; writes that fail,
are cancelled or lose their backend inside a group; statements deallocated, discarded or
outdated under the kit; psycopg's own prepared statements beside the kit's; two database
objects over one pool; the server's prepared statements after many failures; PgBouncer in
session and transaction mode.

A strict xfail is a defect found (its reason says what goes wrong); a plain test is a
promise that held. Three defects it found are fixed: psycopg's own ``DEALLOCATE ALL`` after
a rollback took the kit's statements with it (psycopg now prepares nothing on the kit's
connections), a percent sign right before a placeholder, and two databases over one pool
sharing statement names.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import re
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool

from adapters import pooler, services
from tesserix_adk import Agent, AgentRunner, ScriptedProvider, ScriptedTurn, tool
from tesserix_adk.adapters.postgres import PostgresDatabase, PostgresLedger
from tesserix_adk.adapters.postgres.driver import batched
from tesserix_adk.adapters.postgres.prepared import PreparedStatements
from tesserix_adk.errors import StoreReplyLostError, StoreUnavailableError
from tesserix_adk.messages import ToolCall, Usage
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.stores.protocols.idempotency import ToolFlags

pytestmark = pytest.mark.postgres

T = "acme"
ONE = Usage(input_tokens=1, output_tokens=1)

HOSTILE = [
    "a'b",
    "back\\slash\\",
    "per%cent %(x)s %s %% %%(y)s",
    "uni \u2713 \U0001f600 \u00fc \u202e",
    "semi;colon; DROP TABLE x; --",
    "dollar $1 $$ $q$",
    "/* open comment",
    "new\nline\r\ttab",
    "E'\\047'",
    " spaced ",
    "x" * 3000,
    "",
    "NULL",
    '{"a,b"}',
]
BYTES = [b"", b"\x00\xff", b"\\x41", b"'", b'"', b"{}", b",", b"NULL", b"\\", bytes(range(256))]
INTS = [0, -1, 2**31 - 1, -(2**31), 2**31, 2**63 - 1, -(2**63), 2**63, -(2**63) - 1]
# A delay is due at once or not within the test (a day), whatever the machine's speed: a
# delay of 0.1 s was due in one replay and not yet in the other on a loaded machine.
FLOATS = [0.0, 5e-324, 1e-300, 86400.0, 1e18, 1e300, math.inf, -1.0, math.nan]

Op = tuple[str, Callable[[Stores], Awaitable[Any]]]


def _operations() -> list[Op]:
    """Every kind of write (and a few reads) a group sends, with values at their edges."""
    ops: list[Op] = []
    for i, w in enumerate(HOSTILE):
        flags = ToolFlags(side_effects=bool(i % 2), idempotent=bool(i % 3))
        call = ToolCall(id=w, name=w, arguments={w: [w, 1.5, None, True]})
        ops += [
            (f"charge {i}", lambda s, w=w, i=i: s.ledger.charge(w, f"r{i}", 5, ONE)),
            (f"park {i}", lambda s, w=w, i=i: s.work.park(T, f"p{i}", agent=w, reason=w)),
            (
                f"submit {i}",
                lambda s, w=w, i=i: s.work.submit(w, f"s{i}", agent=w, input=w.encode()),
            ),
            (
                f"claim {i}",
                lambda s, w=w, i=i, flags=flags: s.idempotency.claim(
                    w,
                    holder=w,
                    tenant=w,
                    run_id=w,
                    iteration=i,
                    tool=w,
                    call_id=w,
                    flags=flags,
                ),
            ),
            (
                f"approval {i}",
                lambda s, w=w, i=i, call=call: s.approvals.request(
                    w, "r", [call], iteration=i, id=f"id{i}{w[:20]}"
                ),
            ),
            (f"frontier {i}", lambda s, w=w: s.checkpoints.latest(w, "r")),
            (f"spent {i}", lambda s, w=w, i=i: s.ledger.spent(w, f"r{i}")),
        ]
    for j, v in enumerate(INTS):
        ops += [
            (
                f"charge int {j}",
                lambda s, v=v, j=j: s.ledger.charge(
                    T, f"ci{j}", v, Usage(input_tokens=v, output_tokens=1)
                ),
            ),
            (f"step {j}", lambda s, v=v, j=j: s.checkpoints.put(T, f"ps{j}", b"p", step=v)),
            (
                f"approval iteration {j}",
                lambda s, v=v, j=j: s.approvals.request(T, f"ai{j}", [], iteration=v, id=f"a{j}"),
            ),
            (
                f"claim iteration {j}",
                lambda s, v=v, j=j: s.idempotency.claim(
                    f"k{j}",
                    holder="h",
                    tenant=T,
                    run_id="r",
                    iteration=v,
                    tool="book",
                    call_id="c",
                    flags=ToolFlags(),
                ),
            ),
        ]
    for j, b in enumerate(BYTES):
        ops += [
            (
                f"append {j}",
                lambda s, b=b, j=j: s.history.append(T, f"h{j}", [b, b, b"x"], after=None),
            ),
            (f"payload {j}", lambda s, b=b, j=j: s.checkpoints.put(T, f"pp{j}", b, step=j)),
            (f"input {j}", lambda s, b=b, j=j: s.work.submit(T, f"sb{j}", agent="a", input=b)),
        ]
    for j, f in enumerate(FLOATS):
        ops += [
            (f"delay {j}", lambda s, f=f, j=j: s.work.want(T, f"wd{j}", agent="a", delay=f)),
            (
                f"ttl {j}",
                lambda s, f=f, j=j: s.idempotency.claim(
                    f"ttl{j}",
                    holder="h",
                    tenant=T,
                    run_id="r",
                    iteration=1,
                    tool=None,
                    call_id=None,
                    flags=None,
                    ttl=f,
                ),
            ),
        ]
    ops += [
        ("append nothing", lambda s: s.history.append(T, "he", [], after=None)),
        ("due", lambda s: s.work.due(limit=50)),
        ("due for no agent", lambda s: s.work.due(limit=50, agents=[])),
        ("due for hostile agents", lambda s: s.work.due(limit=50, agents=[*HOSTILE, "a"])),
        ("lookup hostile keys", lambda s: s.idempotency.lookup(HOSTILE, tenant=HOSTILE[0])),
    ]
    return ops


# The server's clock in what the stores return: differs between any two runs.
_CLOCK = re.compile(r"\b1\d{9}\.\d+|datetime\.datetime\([^)]*\)")

_DUMPS = {
    "adk_ledger": "*",
    # want.sql reads the clock twice (since, then not_before): microseconds apart.
    "adk_work": "tenant, run_id, agent, state, attempts, reason, input, "
    "round(extract(epoch FROM not_before - since)::numeric, 2)",
    "adk_idempotency": "key, status, holder, tenant, run_id, iteration, tool, call_id, "
    "side_effects, idempotent, fence, outcome, expires_at - since",
    "adk_approvals": "id, tenant, run_id, calls::text, iteration, status",
    "adk_history": "*",
    "adk_checkpoints": "tenant, run_id, step, fence, payload",
    "adk_checkpoint_steps": "*",
    "adk_fences": "*",
}


async def _replay(url: str, schema: str) -> tuple[list[Any], dict[str, list[Any]], int]:
    """Every operation, five to a write group; what each returned or raised, every table
    after, and how many statements the kit prepared on the (one) connection."""
    outcomes: list[Any] = []
    async with services.postgres_stores_applied(url) as stores:
        ops = _operations()
        for start in range(0, len(ops), 5):
            async with services.write_group(stores) as group:
                for name, op in ops[start : start + 5]:
                    try:
                        outcomes.append((name, _CLOCK.sub("<t>", repr(await op(stores)))))
                    except Exception as exc:
                        outcomes.append((name, type(exc).__name__, getattr(exc, "retryable", 0)))
                await group.commit()
        database: Any = stores.history.database  # type: ignore[attr-defined]
        async with database.pool.connection() as conn:
            prepared = len(await _kit_names(conn))
    tables: dict[str, list[Any]] = {}
    async with await psycopg.AsyncConnection.connect(services.POSTGRES_URL) as admin:
        for table, columns in _DUMPS.items():
            cur = await admin.execute(f'SELECT {columns} FROM "{schema}".{table} ORDER BY 1, 2, 3')
            tables[table] = [repr(tuple(row)) for row in await cur.fetchall()]
    return outcomes, tables, prepared


async def _kit_names(conn: psycopg.AsyncConnection[Any]) -> list[str]:
    """The kit's statements prepared in ``conn``'s session (psycopg's own are ``_pg3_``)."""
    cur = await conn.execute(
        "SELECT name FROM pg_prepared_statements WHERE name LIKE 'adk%' ORDER BY name",
        prepare=False,
    )
    return [row[0] for row in await cur.fetchall()]


async def test_hostile_and_edge_values_commit_the_same_prepared_as_sent_as_text(
    pg_schema: str,
) -> None:
    async with services.postgres_schema() as other:
        # Prepared: tables qualified by schema=; as text: found by the search_path.
        prepared = await _replay(
            services.with_query(
                services.POSTGRES_URL, schema=pg_schema, pool_max="1", prepare_threshold="0"
            ),
            pg_schema,
        )
        text = await _replay(
            services.with_query(services.schema_url(other), pool_max="1", prepare_threshold="none"),
            other,
        )
    assert prepared[2] >= 10, "the kit's statements were prepared and sent by name"
    assert text[2] == 0
    assert [o for o in prepared[0] if o[1] != "ok"], "some values are refused (out of range)"
    assert prepared[0] == text[0]
    assert prepared[1] == text[1]


# --- psycopg's own prepared statements beside the kit's ------------------------------------


def _pool_max_1(pg_url: str) -> str:
    # Prepared at first use, as these attacks were written for (the default waits 5 runs).
    return services.with_query(pg_url, pool_max="1", prepare_threshold="0")


async def _psycopg_prepares_its_own(stores: Stores) -> None:
    """A read run outside any group often enough that psycopg would prepare it on the
    store's one connection (its threshold, 5), as a worker's polling does: found by this
    attack, psycopg's preparing is now off on the kit's connections (the kit prepares its
    statements itself), so nothing of psycopg's is there to DEALLOCATE ALL."""
    for _ in range(7):
        await stores.checkpoints.latest(T, "polled")
    database: Any = stores.history.database  # type: ignore[attr-defined]
    async with database.pool.connection() as conn:
        cur = await conn.execute(
            "SELECT count(*) FROM pg_prepared_statements WHERE name LIKE '_pg3%'"
        )
        (count,) = await cur.fetchone()  # type: ignore[misc]
    assert count == 0, "psycopg prepared a statement of its own"


async def _charges_prepared(stores: Stores, run_id: str) -> None:
    """Two charges in a group: the kit prepares its statement and then sends it by name."""
    async with services.write_group(stores) as group:
        await stores.ledger.charge(T, run_id, 1, ONE)
        await stores.ledger.charge(T, run_id, 1, ONE)
        await group.commit()


# Found by this attack and fixed, the next two tests failed (they were strict xfails): psycopg
# DEALLOCATE ALLs the session on every ROLLBACK, ROLLBACK TO SAVEPOINT (the group's undoing of
# a failed write) and pool reset once it has prepared a statement of its own there, which
# dropped the kit's statements too; the kit's record still named them, so the connection's
# next group write failed retryably though nobody else had touched it.


async def test_a_write_undone_alone_leaves_the_groups_next_write_working(pg_url: str) -> None:
    async with services.postgres_stores_applied(_pool_max_1(pg_url)) as stores:
        await _psycopg_prepares_its_own(stores)
        await _charges_prepared(stores, "r")
        async with services.write_group(stores) as group:
            await stores.ledger.charge(T, "r", 1, ONE)
            # A write the server refuses (iteration past an integer): undone alone.
            with pytest.raises(StoreUnavailableError) as refused:
                await stores.approvals.request(T, "r", [], iteration=2**31)
            assert not refused.value.retryable
            await stores.ledger.charge(T, "r", 1, ONE)  # the group goes on
            await group.commit()
        assert (await stores.ledger.usage(T, "r")).input_tokens == 4


async def _booking_run(stores: Stores, run_id: str, booked: list[str]) -> str:
    @tool
    def book(seat: str) -> str:
        booked.append(f"{run_id}:{seat}")
        return f"booked {seat}"

    script: list[Any] = [ScriptedTurn(calls=[("book", {"seat": str(t)})]) for t in range(2)]
    runner = AgentRunner.from_stores(ScriptedProvider([*script, "done"]), stores, group_writes=True)
    run = await runner.run(
        Agent("p", "b", tools=[book], max_iterations=20), "go", tenant=T, run_id=run_id
    )
    return str(run.status)


async def test_a_statement_rolled_back_outside_any_group_does_not_stop_the_next_run(
    pg_url: str,
) -> None:
    booked: list[str] = []
    async with services.postgres_stores_applied(_pool_max_1(pg_url)) as stores:
        assert "completed" in await _booking_run(stores, "first", booked)
        await _psycopg_prepares_its_own(stores)
        # Any statement the server refuses outside a group is rolled back (``roll_back``).
        with pytest.raises(StoreUnavailableError):
            await stores.approvals.request(T, "x", [], iteration=2**31)
        # The code before prepared statements completes this run.
        assert "completed" in await _booking_run(stores, "second", booked)
    assert booked == ["first:0", "first:1", "second:0", "second:1"]


# --- what others do to the kit's statements -----------------------------------------------


@pytest.mark.parametrize("drop", ["DEALLOCATE ALL", "DISCARD ALL", "DEALLOCATE {name}"])
async def test_statements_dropped_by_someone_fail_one_write_retryably_then_are_prepared_again(
    pg_url: str, drop: str
) -> None:
    async with services.postgres_stores_applied(_pool_max_1(pg_url)) as stores:
        await _charges_prepared(stores, "r")
        database: Any = stores.history.database  # type: ignore[attr-defined]
        async with database.pool.connection() as conn:
            [name] = await _kit_names(conn)
            await conn.execute(drop.format(name=name))
            assert await _kit_names(conn) == []
        async with services.write_group(stores) as group:
            with pytest.raises(StoreUnavailableError) as lost:
                await stores.ledger.charge(T, "r", 1, ONE)
            assert lost.value.retryable
            assert not isinstance(lost.value, StoreReplyLostError)
            await stores.ledger.charge(T, "r", 1, ONE)
            await stores.ledger.charge(T, "r", 1, ONE)
            await group.commit()
        async with database.pool.connection() as conn:
            assert len(await _kit_names(conn)) == 1, "prepared again once"
        assert (await stores.ledger.usage(T, "r")).input_tokens == 4


async def test_a_table_changed_under_a_statement_fails_one_write_retryably(
    pg_url: str, pg_admin: psycopg.AsyncConnection[Any]
) -> None:
    async with services.postgres_stores_applied(_pool_max_1(pg_url)) as stores:
        await _charges_prepared(stores, "r")
        # The charge returns the fence it saw: its result type changes.
        await pg_admin.execute("ALTER TABLE adk_fences ALTER COLUMN fence TYPE numeric")
        async with services.write_group(stores) as group:
            with pytest.raises(StoreUnavailableError, match="cached plan") as lost:
                await stores.ledger.charge(T, "r", 1, ONE)
            assert lost.value.retryable
            await stores.ledger.charge(T, "r", 1, ONE)
            await group.commit()
        assert (await stores.ledger.usage(T, "r")).input_tokens == 3


async def test_a_backend_terminated_inside_a_group_loses_it_typed_and_the_next_group_works(
    pg_url: str, pg_admin: psycopg.AsyncConnection[Any]
) -> None:
    async with services.postgres_stores_applied(_pool_max_1(pg_url)) as stores:
        await _charges_prepared(stores, "r")
        async with services.write_group(stores) as group:
            await stores.ledger.charge(T, "r", 1, ONE)
            pid = group._conn.info.backend_pid
            await pg_admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
            await asyncio.sleep(0.2)
            with pytest.raises(StoreReplyLostError):
                await stores.ledger.charge(T, "r", 1, ONE)
            with pytest.raises(StoreUnavailableError) as later:
                await stores.ledger.charge(T, "r", 1, ONE)
            assert later.value.retryable
            with pytest.raises(StoreUnavailableError):
                await group.commit()
        await _charges_prepared(stores, "r")
        assert (await stores.ledger.usage(T, "r")).input_tokens == 4


# --- what the server keeps ------------------------------------------------------------------


async def test_failures_and_cancellations_leave_one_prepared_statement_a_statement(
    pg_url: str, pg_admin: psycopg.AsyncConnection[Any]
) -> None:
    async with services.postgres_stores_applied(_pool_max_1(pg_url)) as stores:
        database: Any = stores.history.database  # type: ignore[attr-defined]
        counts: list[int] = []
        for round_ in range(4):
            async with services.write_group(stores) as group:
                for i in range(3):
                    await stores.ledger.charge(T, "r", 1, ONE)
                    with pytest.raises(StoreUnavailableError):
                        await stores.approvals.request(T, "r", [], iteration=2**31)
                    await stores.history.append(T, f"h{round_}{i}", [b"x"], after=None)
                await group.commit()
            # A write blocked on a row lock, cancelled while its message is at the server.
            await pg_admin.execute("BEGIN")
            await pg_admin.execute(
                "INSERT INTO adk_fences VALUES ('ledger', %s, 'held', NULL)", (T,)
            )
            async with services.write_group(stores) as group:
                await stores.ledger.charge(T, "r", 1, ONE)
                blocked = asyncio.create_task(stores.ledger.charge(T, "held", 1, ONE))
                await asyncio.sleep(0.3)
                blocked.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await blocked
                await stores.ledger.charge(T, "r", 1, ONE)
                await group.commit()
            await pg_admin.execute("ROLLBACK")
            async with database.pool.connection() as conn:
                counts.append(len(await _kit_names(conn)))
        assert counts == [3, 3, 3, 3], counts
        assert (await stores.ledger.usage(T, "r")).input_tokens == 4 * 5


async def test_hundreds_of_distinct_statements_are_prepared_once_each(
    pg_admin: psycopg.AsyncConnection[Any],
) -> None:
    prepared = PreparedStatements()
    await batched(pg_admin, (), [("SELECT 1 AS one", {})], prepared=prepared)  # first message
    statements = [(f"SELECT %(v)s::bigint + {n} AS w", {"v": -(2**62)}) for n in range(300)]
    for _ in range(2):
        for start in range(0, 300, 50):
            results = await batched(pg_admin, (), statements[start : start + 50], prepared=prepared)
            assert [rows[0]["w"] for rows in results] == [
                -(2**62) + n for n in range(start, start + 50)
            ]
    names = await _kit_names(pg_admin)
    assert len(names) in (300, 301)
    assert len(set(prepared.on(pg_admin).names.values())) == len(names)


async def test_names_in_doubt_in_a_failed_transaction_are_not_prepared_twice(
    pg_admin: psycopg.AsyncConnection[Any],
) -> None:
    prepared = PreparedStatements()
    add = ("SELECT %(v)s::bigint + 1 AS w", {"v": 1})
    await batched(pg_admin, (), [("SELECT 1 AS one", {})], prepared=prepared)  # first message
    await pg_admin.execute("BEGIN")
    with pytest.raises(psycopg.errors.DivisionByZero):
        await batched(
            pg_admin, (), [add, ("SELECT 1 / %(z)s::integer AS q", {"z": 0})], prepared=prepared
        )
    with pytest.raises(psycopg.errors.InFailedSqlTransaction):
        await batched(pg_admin, (), [add], prepared=prepared)
    await pg_admin.execute("ROLLBACK")
    for _ in range(2):
        assert await batched(pg_admin, (), [add], prepared=prepared) == [[{"w": 2}]]
    # What the server holds is what the kit knows it holds: nothing prepared twice, no name
    # forgotten while it still existed.
    known = prepared.on(pg_admin)
    assert sorted(await _kit_names(pg_admin)) == sorted(known.names.values())
    assert add[0] in known.names and not known.doubt


async def test_a_schema_named_with_a_dollar_and_a_dash_is_prepared_and_written_there(
    pg_admin: psycopg.AsyncConnection[Any],
) -> None:
    # "$1" inside a quoted identifier is no parameter, in PREPARE as anywhere.
    schema = f"adk$1-{secrets.token_hex(4)}"
    await pg_admin.execute(f'CREATE SCHEMA "{schema}"')
    try:
        url = services.with_query(
            services.POSTGRES_URL, schema=schema, pool_max="1", prepare_threshold="0"
        )
        async with services.postgres_stores_applied(url) as stores:
            for _ in range(2):
                await _charges_prepared(stores, "r")
            async with services.write_group(stores) as group:
                await stores.history.append(T, "h", [b"$1", b"%(x)s"], after=None)
                await stores.history.append(T, "h2", [b"x"], after=None)
                await group.commit()
            database: Any = stores.history.database  # type: ignore[attr-defined]
            async with database.pool.connection() as conn:
                assert len(await _kit_names(conn)) == 2
        cur = await pg_admin.execute(f'SELECT micros FROM "{schema}".adk_ledger')
        assert await cur.fetchall() == [(4,)]
        cur = await pg_admin.execute(f'SELECT item FROM "{schema}".adk_history ORDER BY 1')
        assert [bytes(row[0]) for row in await cur.fetchall()] == [b"$1", b"%(x)s", b"x"]
    finally:
        await pg_admin.execute(f'DROP SCHEMA "{schema}" CASCADE')


async def test_a_percent_sign_right_before_a_placeholder_is_bound_as_the_text_path_binds_it(
    pg_admin: psycopg.AsyncConnection[Any],
) -> None:
    modulo = [("SELECT 7 %%%(n)s AS r", {"n": 4})]
    assert await batched(pg_admin, (), modulo) == [[{"r": 3}]]
    prepared = PreparedStatements()
    for _ in range(3):  # the first message on a connection may go as text
        assert await batched(pg_admin, (), modulo, prepared=prepared) == [[{"r": 3}]]


# --- two database objects over one pool ------------------------------------------------------


async def test_two_databases_over_one_pool_never_run_each_others_statements(
    pg_schema: str,
) -> None:
    async with services.postgres_schema() as other:
        pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
            services.POSTGRES_URL,
            min_size=1,
            max_size=1,
            open=False,
            kwargs={"autocommit": True},
        )
        first = PostgresDatabase(pool, schema=pg_schema)
        second = PostgresDatabase(pool, schema=other)
        try:
            await first.create_schema()
            await second.create_schema()
            outcomes: list[str] = []
            for database, charges in ((first, 2), (second, 4)):
                ledger = PostgresLedger(database)
                async with _group_on(database) as group:
                    for _ in range(charges):
                        try:
                            await ledger.charge(T, "r", 1, ONE)
                            outcomes.append("ok")
                        except StoreUnavailableError as exc:
                            outcomes.append(str(exc))
                    await group.commit()
            spent = [(await PostgresLedger(d).usage(T, "r")).input_tokens for d in (first, second)]
        finally:
            await first.aclose()
            await second.aclose()
    assert outcomes == ["ok"] * 6
    assert spent == [2, 4], "each database's charges in its own schema"


@contextlib.asynccontextmanager
async def _group_on(database: PostgresDatabase) -> AsyncIterator[Any]:
    from tesserix_adk.stores.grouping import group_scope

    with group_scope():
        group = database.write_group()
        await group.begin()
        yield group


# --- PgBouncer --------------------------------------------------------------------------


@contextlib.contextmanager
def _pgbouncer(mode: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[pooler.PgBouncer]:
    """The tests' throwaway PgBouncer (``pooler``), in ``mode``."""
    write_text = Path.write_text

    def in_mode(self: Path, data: str, *args: Any, **kwargs: Any) -> int:
        return write_text(self, data.replace("pool_mode = transaction", f"pool_mode = {mode}"))

    with contextlib.ExitStack() as stack:
        with monkeypatch.context() as patched:
            patched.setattr(Path, "write_text", in_mode)
            bouncer = stack.enter_context(pooler.pgbouncer())
        assert f"pool_mode = {mode}" in (bouncer.log.parent / "pgbouncer.ini").read_text()
        yield bouncer


@pytest.mark.parametrize(
    ("mode", "options"),
    [("session", {}), ("transaction", {"prepare_threshold": "none"})],
)
async def test_grouped_runs_behind_pgbouncer_complete_and_book_once(
    pg_schema: str, monkeypatch: pytest.MonkeyPatch, mode: str, options: dict[str, str]
) -> None:
    booked: list[str] = []
    with _pgbouncer(mode, monkeypatch) as bouncer:
        url = bouncer.url(schema=pg_schema, pool_max="3", **options)
        async with services.postgres_stores_applied(url) as stores:
            for round_ in range(2):
                statuses = await asyncio.gather(
                    *[_booking_run(stores, f"r{round_}-{i}", booked) for i in range(4)]
                )
                assert all("completed" in status for status in statuses), statuses
                database: Any = stores.history.database  # type: ignore[attr-defined]
                await database.pool.drain()  # new client connections: DISCARD ALL behind
    assert sorted(booked) == sorted(
        f"r{r}-{i}:{s}" for r in range(2) for i in range(4) for s in "01"
    )
