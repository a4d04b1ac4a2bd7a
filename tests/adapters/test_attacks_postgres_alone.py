"""Attacks on every statement outside a write group (``driver.alone``) now sent as one
simple Query, its values bound on the client and, after ``prepare_threshold`` runs as text
on a direct connection, run as ``EXECUTE name(values)`` of a statement the kit prepared.

Oracle: the same operations with ``prepare_threshold=none``, where ``alone`` is the code
before the change (one psycopg pipeline, values bound on the server), compared outcome by
outcome and row by row. The group path is attacked in ``test_attacks_postgres_prepared``.

A strict xfail is a defect found; a plain test is a promise that held. The one defect it
found is fixed: records_from compared ``iteration`` uncast, so once prepared the server
took it for an integer and refused 2**31 (now cast, and every narrow integer is checked in
``test_postgres_prepared``).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable
from typing import Any

import psycopg
import pytest

from adapters import services
from adapters.test_attacks_postgres_prepared import (
    _CLOCK,
    _DUMPS,
    HOSTILE,
    INTS,
    ONE,
    T,
    _booking_run,
    _kit_names,
    _operations,
    _pgbouncer,
)
from tesserix_adk import Agent, AgentRunner, ScriptedProvider, ScriptedTurn, tool
from tesserix_adk.errors import StoreUnavailableError
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.stores.protocols.idempotency import ToolFlags

pytestmark = pytest.mark.postgres

Op = tuple[str, Callable[[Stores], Awaitable[Any]]]
TTLS = [1e-9, 0.001, 1.0, 1e6, 1e300, math.inf, math.nan, -0.0, 2**63, 2**64]


def _alone_operations() -> list[Op]:
    """What only ``alone`` runs (reads, leases, completions, resolutions, forgetting),
    each with values at their edges, after every write the group attack sends."""
    ops: list[Op] = list(_operations())
    for i, w in enumerate(HOSTILE[:8]):
        ops += [
            (f"acquire {i}", lambda s, w=w: s.leases.acquire(w, w, w, 30.0)),
            (f"acquire held {i}", lambda s, w=w: s.leases.acquire(w, w, "other", 30.0)),
            (f"current {i}", lambda s, w=w: s.leases.current(w, w)),
            (f"ended {i}", lambda s, w=w: s.leases.ended_ago(w, w)),
            (f"renew {i}", lambda s, w=w: _renew(s, w)),
            (f"release {i}", lambda s, w=w: _release(s, w)),
            (f"ended after {i}", lambda s, w=w: s.leases.ended_ago(w, w)),
            (
                f"complete {i}",
                lambda s, w=w: s.idempotency.complete(
                    w, w.encode() + b"\x00\\", tenant=w, holder=w
                ),
            ),
            (f"lookup {i}", lambda s, w=w: s.idempotency.lookup([w, "x", w], tenant=w)),
            (f"records {i}", lambda s, w=w: s.idempotency.records(w, w)),
            (f"records from {i}", lambda s, w=w, i=i: s.idempotency.records_from(w, w, i)),
            (
                f"resolve {i}",
                lambda s, w=w: s.idempotency.resolve(w, b"\\x00'", tenant=w, by=w),
            ),
            (
                f"release claim {i}",
                lambda s, w=w: s.idempotency.release(w, tenant=w, holder=w, undispatched=True),
            ),
            (f"at {i}", lambda s, w=w: s.checkpoints.at(w, "r", 0)),
            (f"steps {i}", lambda s, w=w: s.checkpoints.steps(w, "r")),
            (f"runs {i}", lambda s, w=w: s.checkpoints.runs(w)),
            (f"approval get {i}", lambda s, w=w, i=i: s.approvals.get(w, f"id{i}{w[:20]}")),
            (
                f"decide {i}",
                lambda s, w=w, i=i: s.approvals.decide(
                    w, f"id{i}{w[:20]}", approved=bool(i % 2), by=w, note=w if i % 3 else None
                ),
            ),
            (f"input {i}", lambda s, w=w, i=i: s.work.input(w, f"s{i}")),
            (f"items {i}", lambda s, w=w: s.work.items(w)),
            (f"done {i}", lambda s, w=w, i=i: s.work.done(T, f"p{i}")),
            (f"forget checkpoints {i}", lambda s, w=w: s.checkpoints.forget(w, "r")),
            (f"forget history {i}", lambda s, w=w: s.history.forget(w, w)),
        ]
    for j, v in enumerate(INTS):
        ops += [
            (f"at step {j}", lambda s, v=v: s.checkpoints.at(T, "ps0", v)),
            (
                f"fenced put {j}",
                lambda s, v=v, j=j: s.checkpoints.put(T, "fp", b"x", step=j, fence=v),
            ),
            (f"fenced charge {j}", lambda s, v=v: s.ledger.charge(T, "fc", 1, ONE, fence=v)),
        ]
    for j, f in enumerate(TTLS):
        ops += [
            (f"acquire ttl {j}", lambda s, f=f, j=j: s.leases.acquire(T, f"t{j}", "h", f)),
            # Leases of a microsecond lapse before they can be renewed: not renewed.
            (
                f"renew ttl {j}",
                lambda s, f=f, j=j: _renew(s, f"t{j}", ttl=f, tenant=T) if j > 1 else None,
            ),
        ]
    ops += [
        ("items all", lambda s: s.work.items()),
        ("lookup none", lambda s: s.idempotency.lookup([], tenant=T)),
        ("due again", lambda s: s.work.due(limit=50)),
    ]
    return ops


async def _renew(
    s: Stores, w: str, *, ttl: float = 30.0, tenant: str | None = None, holder: str | None = None
) -> Any:
    lease = await s.leases.current(tenant or w, w)
    if lease is None:
        return None
    return await s.leases.renew(lease, ttl)


async def _release(s: Stores, w: str) -> Any:
    lease = await s.leases.current(w, w)
    if lease is None:
        return None
    return await s.leases.release(lease)


async def _replay_alone(url: str, schema: str) -> tuple[list[Any], dict[str, list[Any]], int]:
    outcomes: list[Any] = []
    async with services.postgres_stores_applied(url) as stores:
        for name, op in _alone_operations():
            try:
                got = await op(stores)
                if name.startswith("ended") and isinstance(got, float):
                    got = "ended"
                outcomes.append((name, _CLOCK.sub("<t>", repr(got))))
            except Exception as exc:
                outcomes.append((name, type(exc).__name__, getattr(exc, "retryable", 0)))
        database: Any = stores.history.database  # type: ignore[attr-defined]
        async with database.pool.connection() as conn:
            prepared = len(await _kit_names(conn))
    tables: dict[str, list[Any]] = {}
    dumps = {
        **_DUMPS,
        # Two clock readings a microsecond apart or not: seconds are what the delay says.
        "adk_work": "tenant, run_id, agent, state, attempts, reason, input, "
        "round(extract(epoch FROM not_before - since))",
        "adk_run_leases": "tenant, run_id, fence, holder, expires_at IS NULL",
    }
    async with await psycopg.AsyncConnection.connect(services.POSTGRES_URL) as admin:
        for table, columns in dumps.items():
            cur = await admin.execute(f'SELECT {columns} FROM "{schema}".{table} ORDER BY 1, 2, 3')
            tables[table] = [repr(tuple(row)) for row in await cur.fetchall()]
    return outcomes, tables, prepared


@pytest.mark.parametrize("threshold", ["0", "1", "5"])
async def test_every_operation_alone_gives_what_the_pipeline_gave(
    pg_schema: str, threshold: str
) -> None:
    async with services.postgres_schema() as other:
        new = await _replay_alone(
            services.with_query(
                services.POSTGRES_URL, schema=pg_schema, pool_max="1", prepare_threshold=threshold
            ),
            pg_schema,
        )
        old = await _replay_alone(
            services.with_query(services.schema_url(other), pool_max="1", prepare_threshold="none"),
            other,
        )
    assert new[2] >= 20, "the kit's statements were prepared"
    assert old[2] == 0
    diff = [(a, b) for a, b in zip(new[0], old[0], strict=True) if a != b]
    for a, b in diff:
        print(a, "\n   ", b)
    assert diff == []
    for table in new[1]:
        if new[1][table] != old[1][table]:
            print(table, set(new[1][table]) ^ set(old[1][table]))
    assert new[1] == old[1]


# --- a parameter's type: inferred by PREPARE, not bound by psycopg ----------------------------


async def test_records_from_past_an_integer_reads_the_same_before_and_after_preparing(
    pg_url: str,
) -> None:
    async with services.postgres_stores_applied(services.with_query(pg_url, pool_max="1")) as s:
        await s.idempotency.claim(
            "k",
            holder="h",
            tenant=T,
            run_id="r",
            iteration=1,
            tool="t",
            call_id="c",
            flags=ToolFlags(),
        )
        for _ in range(8):  # the default prepare_threshold is 5
            assert await s.idempotency.records_from(T, "r", 2**31) == []
            assert len(await s.idempotency.records_from(T, "r", -(2**31) - 1)) == 1


# --- failures and cancellations of a statement alone ------------------------------------------


def _database(stores: Stores) -> Any:
    return stores.history.database  # type: ignore[attr-defined]


async def _pid(stores: Stores) -> int:
    async with _database(stores).pool.connection() as conn:
        return int(conn.info.backend_pid)


async def _hold_ledger_row(admin: psycopg.AsyncConnection[Any], run_id: str) -> None:
    await admin.execute("BEGIN")
    await admin.execute("INSERT INTO adk_fences VALUES ('ledger', %s, %s, NULL)", (T, run_id))


async def _failures(url: str, admin: psycopg.AsyncConnection[Any]) -> list[Any]:
    """A statement alone blocked on a lock (the server's lock_timeout), cancelled, and run
    on a connection whose backend was terminated: what each raised, and that the next call
    on the pool's one connection works every time."""
    seen: list[Any] = []
    async with services.postgres_stores_applied(url) as stores:
        for _ in range(6):
            await stores.ledger.charge(T, "r", 1, ONE)
        # Blocked past lock_timeout (0.6 of timeout=1): the server rolls it back.
        await _hold_ledger_row(admin, "held")
        with pytest.raises(StoreUnavailableError) as blocked:
            await stores.ledger.charge(T, "held", 1, ONE)
        seen.append((type(blocked.value).__name__, blocked.value.retryable))
        await stores.ledger.charge(T, "r", 1, ONE)
        # Cancelled while at the server.
        task = asyncio.create_task(stores.ledger.charge(T, "held", 1, ONE))
        await asyncio.sleep(0.2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await admin.execute("ROLLBACK")
        await stores.ledger.charge(T, "r", 1, ONE)
        # The backend terminated between two calls.
        await admin.execute("SELECT pg_terminate_backend(%s)", (await _pid(stores),))
        await asyncio.sleep(0.2)
        with pytest.raises(StoreUnavailableError) as lost:
            await stores.ledger.charge(T, "r", 1, ONE)
        seen.append((type(lost.value).__name__, lost.value.retryable))
        for _ in range(6):
            await stores.ledger.charge(T, "r", 1, ONE)
        seen.append(await stores.ledger.spent(T, "r"))  # 14 or 15: the lost one may be in
        seen.append(await stores.ledger.spent(T, "held"))
        async with _database(stores).pool.connection() as conn:
            seen.append(len(await _kit_names(conn)) <= 2)
    return seen


async def test_failures_alone_are_typed_as_through_the_pipeline_and_the_connection_goes_on(
    pg_url: str, pg_admin: psycopg.AsyncConnection[Any]
) -> None:
    new = await _failures(
        services.with_query(pg_url, pool_max="1", timeout="1", prepare_threshold="0"), pg_admin
    )
    old = await _failures(
        services.with_query(pg_url, pool_max="1", timeout="1", prepare_threshold="none"), pg_admin
    )
    assert new[0] == ("StoreUnavailableError", True), "rolled back by the server: retryable"
    assert new[1][0] == "StoreReplyLostError"
    assert new[:2] == old[:2]
    # One schema for both: the second replay's charges add to the first's.
    assert new[2] == old[2] - new[2] == 14, "each charge once, the lost one not applied"
    assert new[3:] == old[3:]
    assert new[3] == 0, "the blocked and the cancelled charge were rolled back"
    assert new[4], "nothing prepared twice"


# --- real runs: a side-effecting tool booked exactly once -------------------------------------


async def _ungrouped_booking_run(stores: Stores, run_id: str, booked: list[str]) -> str:
    @tool
    def book(seat: str) -> str:
        booked.append(f"{run_id}:{seat}")
        return f"booked {seat}"

    script: list[Any] = [ScriptedTurn(calls=[("book", {"seat": str(t)})]) for t in range(2)]
    runner = AgentRunner.from_stores(ScriptedProvider([*script, "done"]), stores)
    run = await runner.run(
        Agent("p", "b", tools=[book], max_iterations=20), "go", tenant=T, run_id=run_id
    )
    return str(run.status)


async def _book_concurrently(stores: Stores, rounds: int, first: int = 0) -> list[str]:
    booked: list[str] = []
    for round_ in range(first, first + rounds):
        statuses = await asyncio.gather(
            *[_booking_run(stores, f"g{round_}-{i}", booked) for i in range(3)],
            *[_ungrouped_booking_run(stores, f"u{round_}-{i}", booked) for i in range(3)],
        )
        assert all("completed" in status for status in statuses), statuses
    assert sorted(booked) == sorted(
        f"{k}{r}-{i}:{s}"
        for k in "gu"
        for r in range(first, first + rounds)
        for i in range(3)
        for s in "01"
    )
    return booked


@pytest.mark.parametrize("threshold", ["0", "1", "5"])
async def test_grouped_and_ungrouped_runs_on_one_pool_book_once(
    pg_url: str, threshold: str
) -> None:
    url = services.with_query(pg_url, pool_max="2", prepare_threshold=threshold)
    async with services.postgres_stores_applied(url) as stores:
        await _book_concurrently(stores, 2)
        async with _database(stores).pool.connection() as conn:
            assert await _kit_names(conn), "statements alone were prepared too"


@pytest.mark.parametrize("mode", ["transaction", "session"])
async def test_runs_behind_pgbouncer_without_prepare_threshold_none_book_once(
    pg_schema: str, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    with _pgbouncer(mode, monkeypatch) as bouncer:
        # The default prepare_threshold: the pid check alone keeps the kit from preparing.
        url = bouncer.url(schema=pg_schema, pool_max="3", prepare_threshold="0")
        async with services.postgres_stores_applied(url) as stores:
            await _book_concurrently(stores, 2)
            await _database(stores).pool.drain()
            await _book_concurrently(stores, 1, first=2)
            known = _database(stores).prepared
            assert known is not None
            assert all(not record.names for record in known._on.values())
            assert all(record.direct is False for record in known._on.values())


async def test_a_first_message_that_fails_leaves_the_pid_unasked_then_asked_again(
    pg_url: str,
) -> None:
    url = services.with_query(pg_url, pool_max="1", prepare_threshold="0")
    async with services.postgres_stores_applied(url) as stores:
        database = _database(stores)
        await database.pool.drain()  # a fresh connection: its first message fails
        with pytest.raises(StoreUnavailableError) as refused:
            await stores.approvals.request(T, "r", [], iteration=2**31)
        assert not refused.value.retryable
        for _ in range(3):
            await stores.ledger.charge(T, "r", 1, ONE)
        async with database.pool.connection() as conn:
            assert database.prepared.on(conn).direct is True
            assert len(await _kit_names(conn)) == 1
        assert (await stores.ledger.usage(T, "r")).input_tokens == 3
