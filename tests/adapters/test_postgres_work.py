"""The PostgreSQL work index's own traps, against the real server (its conformance suite,
``TestWorkIndex``, runs in ``tests/stores/test_conformance.py``)."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from tesserix_adk.adapters.postgres import MIGRATIONS, PostgresWorkIndex, open_postgres_stores
from tesserix_adk.errors import CheckpointCorruptError, ConfigurationError
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.stores.protocols import WorkState

pytestmark = pytest.mark.postgres

T = "acme"
A = "booking"
Admin = psycopg.AsyncConnection[Any]


def _work(stores: Stores) -> PostgresWorkIndex:
    assert isinstance(stores.work, PostgresWorkIndex)
    return stores.work


async def test_open_stores_keeps_a_work_index_on_the_same_pool(pg_stores: Stores) -> None:
    work = _work(pg_stores)
    assert work.database is pg_stores.leases.database  # type: ignore[attr-defined]


async def test_a_version_2_database_gains_the_work_index_on_create_schema(
    pg_url: str, pg_admin: Admin
) -> None:
    # Version 2 as the previous kit left it: no adk_work.
    await pg_admin.execute(
        "CREATE TABLE adk_schema_version (id integer PRIMARY KEY, version integer NOT NULL, "
        "applied_at timestamptz NOT NULL DEFAULT clock_timestamp())"
    )
    for migration in MIGRATIONS[:2]:
        await pg_admin.execute(migration.encode())
    await pg_admin.execute("INSERT INTO adk_schema_version (id, version) VALUES (1, 2)")
    await pg_admin.execute(
        "INSERT INTO adk_run_leases (tenant, run_id, fence, holder, expires_at) "
        "VALUES ('acme', 'kept', 4, NULL, clock_timestamp())"
    )
    stores = open_postgres_stores(pg_url)
    try:
        with pytest.raises(ConfigurationError, match="older"):
            await stores.verify()
        await stores.create_schema()
        await stores.verify()
        work = _work(stores)
        assert await work.submit(T, "r1", agent=A, input=b"in")
        assert [i.run_id for i in await work.due(limit=10)] == ["r1"]
        lease = await stores.leases.acquire(T, "kept", "worker-a", 30)
        assert lease.fence == 5  # the rows already there are kept
    finally:
        await stores.aclose()


async def test_due_finds_runs_behind_many_held_ones_in_one_statement(pg_stores: Stores) -> None:
    work = _work(pg_stores)
    for n in range(40):
        await work.want(T, f"held-{n:02}", agent=A)
        await pg_stores.leases.acquire(T, f"held-{n:02}", "worker-a", 3600)
    await work.want(T, "free-1", agent=A)
    await work.want(T, "free-2", agent=A)
    assert [i.run_id for i in await work.due(limit=2)] == ["free-1", "free-2"]


async def test_the_scan_is_bounded_past_the_limit(pg_stores: Stores) -> None:
    # A bound that cannot be seen cannot be trusted: with scan 3, three held runs at the
    # head are skipped and a fourth hides the due run behind it.
    work = PostgresWorkIndex(_work(pg_stores).database, scan=3)
    for n in range(3):
        await work.want(T, f"held-{n}", agent=A)
        await pg_stores.leases.acquire(T, f"held-{n}", "worker-a", 3600)
    await work.want(T, "free", agent=A)
    assert [i.run_id for i in await work.due(limit=1)] == ["free"]
    await pg_stores.leases.acquire(T, "free", "worker-a", 3600)
    await work.want(T, "behind", agent=A)
    assert await work.due(limit=1) == []
    assert [i.run_id for i in await work.due(limit=2)] == ["behind"]


async def test_each_agent_asked_for_has_a_head_of_its_own(pg_stores: Stores) -> None:
    # Runs of other agents at the head use up no part of the scan.
    work = PostgresWorkIndex(_work(pg_stores).database, scan=0)
    for n in range(5):
        await work.want(T, f"other-{n}", agent="refunds")
    await work.want(T, "mine", agent=A)
    assert [i.run_id for i in await work.due(limit=1, agents=[A, A])] == ["mine"]
    assert [i.run_id for i in await work.due(limit=2, agents=["refunds", A])] == [
        "other-0",
        "other-1",
    ]


async def test_finding_work_reads_the_head_of_the_due_index(
    pg_stores: Stores, pg_admin: Admin
) -> None:
    work = _work(pg_stores)
    for n in range(200):
        await work.submit(T, f"r{n:03}", agent=A, input=b"")
    for n in range(150):
        await work.done(T, f"r{n:03}")
    await pg_admin.execute("ANALYZE adk_work")
    await pg_admin.execute("SET enable_seqscan = off")  # as a large table would be planned
    sql = work._sql.due  # type: ignore[attr-defined]
    cur = await pg_admin.execute(
        ("EXPLAIN " + sql).encode(),
        {"row_limit": 5, "scan": 5 + work.scan, "agents": None},
    )
    plan = "\n".join(row[0] for row in await cur.fetchall())
    assert "adk_work_due" in plan, plan
    cur = await pg_admin.execute(
        "SELECT count(*) FROM adk_work WHERE take_order IS NOT NULL AND state = 'done'"
    )
    assert await cur.fetchone() == (0,)


async def test_a_damaged_row_is_a_typed_error(pg_stores: Stores, pg_admin: Admin) -> None:
    work = _work(pg_stores)
    await work.want(T, "r1", agent=A)
    await pg_admin.execute("ALTER TABLE adk_work DROP CONSTRAINT adk_work_state_check")
    await pg_admin.execute("UPDATE adk_work SET state = 'someday'")
    with pytest.raises(CheckpointCorruptError, match="work index entry"):
        await work.items(T)


async def test_a_want_in_a_state_that_wants_no_worker_is_refused(pg_stores: Stores) -> None:
    work = _work(pg_stores)
    for state in (WorkState.parked, WorkState.done):
        with pytest.raises(ValueError, match="decided, wanted or submitted"):
            await work.want(T, "r1", agent=A, state=state)
    assert await work.items() == []
