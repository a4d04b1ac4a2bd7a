"""The PostgreSQL stores' known traps, each against the real server (the conformance suites
run in ``tests/stores/test_conformance.py``)."""

from __future__ import annotations

import asyncio
import itertools
import re
import subprocess
import sys
import time
from dataclasses import asdict, replace
from importlib import resources
from typing import Any

import psycopg
import pytest
from psycopg.pq import TransactionStatus
from psycopg_pool import AsyncConnectionPool

from adapters import services
from tesserix_adk.adapters.postgres import (
    EXPECTED_CHECKPOINT_SCHEMA,
    MIGRATIONS,
    SCHEMA_VERSION,
    PostgresCheckpointStore,
    PostgresDatabase,
    PostgresLeaseStore,
    open_postgres_stores,
)
from tesserix_adk.errors import (
    ConfigurationError,
    LeaseHeldError,
    LeaseLostError,
    StaleFenceError,
    StoreUnavailableError,
)
from tesserix_adk.messages import ToolCall, Usage
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.stores.protocols import RecordStatus, ToolFlags

pytestmark = pytest.mark.postgres

T = "acme"
R = "run-1"
Admin = psycopg.AsyncConnection[Any]


async def _claim(
    stores: Stores, key: str, holder: str, *, tenant: str = T, run_id: str = R, fence: int
) -> None:
    await stores.idempotency.claim(
        key,
        holder=holder,
        tenant=tenant,
        run_id=run_id,
        iteration=0,
        tool="book_seat",
        call_id="call_1",
        flags=ToolFlags(),
        fence=fence,
    )


async def _tables(admin: Admin, schema: str) -> set[str]:
    cur = await admin.execute(
        "SELECT table_name FROM information_schema.tables WHERE table_schema = %s", (schema,)
    )
    return {row[0] for row in await cur.fetchall()}


# --- importing and opening ---------------------------------------------------------------


def test_importing_without_psycopg_names_the_extra_to_install() -> None:
    code = (
        "import sys\n"
        "sys.modules['psycopg'] = None\n"
        "try:\n"
        "    import tesserix_adk.adapters.postgres\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
        "else:\n"
        "    raise SystemExit('imported without psycopg')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert 'pip install "tesserix-adk[postgres]"' in done.stdout


async def test_open_takes_the_kits_options_out_of_the_url_and_does_no_io() -> None:
    # Nothing listens on port 1: opening must not notice.
    stores = open_postgres_stores(
        "postgresql://nobody@127.0.0.1:1/none?keep_last=3&pool_min=0&pool_max=2"
        "&connect_timeout=1&options=-csearch_path%3Delsewhere"
    )
    try:
        assert isinstance(stores.checkpoints, PostgresCheckpointStore)
        assert stores.checkpoints.keep_last == 3
        pool = stores.checkpoints.database.pool
        assert (pool.min_size, pool.max_size) == (0, 2)
        assert pool.closed
        assert "keep_last" not in pool.conninfo and "pool_m" not in pool.conninfo
        assert "connect_timeout=1" in pool.conninfo
        assert "options=-csearch_path%3Delsewhere" in pool.conninfo
        assert stores.schema == EXPECTED_CHECKPOINT_SCHEMA
    finally:
        await stores.aclose()


async def test_pool_defaults_are_one_and_four() -> None:
    stores = open_postgres_stores("postgresql://nobody@127.0.0.1:1/none")
    try:
        assert isinstance(stores.leases, PostgresLeaseStore)
        pool = stores.leases.database.pool
        assert (pool.min_size, pool.max_size) == (1, 4)
    finally:
        await stores.aclose()


def test_bad_kit_options_are_configuration_errors() -> None:
    for query in (
        "keep_last=0",
        "pool_max=0",
        "pool_min=3&pool_max=2",
        "pool_min=x",
        "prefix=adk%3A",
        "allow_volatile=true",
    ):
        with pytest.raises(ConfigurationError):
            open_postgres_stores(f"postgresql://nobody@127.0.0.1:1/none?{query}")


async def test_an_unreachable_server_is_a_retryable_store_error() -> None:
    pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
        "postgresql://nobody@127.0.0.1:1/none?connect_timeout=1",
        min_size=0,
        max_size=1,
        open=False,
        timeout=0.5,
    )
    database = PostgresDatabase(pool)
    try:
        with pytest.raises(StoreUnavailableError) as failed:
            await PostgresLeaseStore(database).current(T, R)
        assert failed.value.retryable
    finally:
        await database.aclose()


# --- the shipped SQL ---------------------------------------------------------------------


def _shipped_statements() -> dict[str, str]:
    """Every ``sql/<store>/<name>.sql`` of the package, by ``<store>/<name>``."""
    root = resources.files("tesserix_adk.adapters.postgres").joinpath("sql")
    return {
        f"{folder.name}/{entry.name.removesuffix('.sql')}": entry.read_text(encoding="utf-8")
        for folder in root.iterdir()
        if folder.is_dir()
        for entry in folder.iterdir()
        if entry.name.endswith(".sql")
    }


async def test_every_statement_file_is_one_a_store_reads_when_it_is_built() -> None:
    stores = open_postgres_stores("postgresql://nobody@127.0.0.1:1/none")
    try:
        read = {
            f"{folder}/{name}": text
            for folder, store in (
                ("checkpoints", stores.checkpoints),
                ("idempotency", stores.idempotency),
                ("leases", stores.leases),
                ("history", stores.history),
                ("ledger", stores.ledger),
                ("approvals", stores.approvals),
                ("work", stores.work),
            )
            for name, text in asdict(store._sql).items()  # type: ignore[attr-defined]
        }
    finally:
        await stores.aclose()
    assert read == _shipped_statements()


def test_every_statement_names_its_parameters_in_its_header() -> None:
    for name, text in _shipped_statements().items():
        header = list(itertools.takewhile(lambda line: line.startswith("--"), text.splitlines()))
        assert header and header[0].startswith(f"-- {name}: "), name
        joined = " ".join(line.removeprefix("--").strip() for line in header)
        listed = re.search(r"Parameters: (.*?)\. Returns: ", joined)
        assert listed is not None, f"{name} has no Parameters line"
        named = {re.sub(r" \(.*?\)", "", part).strip() for part in listed.group(1).split(",")}
        used = set(re.findall(r"%\((\w+)\)s", text))
        assert named == used, f"{name}: header names {sorted(named)}, statement uses {sorted(used)}"
        # psycopg reads every other % as a placeholder, in comments too.
        assert "%" not in re.sub(r"%\(\w+\)s", "", text), name


def test_every_fenced_write_passes_the_same_gate_and_reports_the_same_verdict() -> None:
    # The gate is written out in every fenced statement: the copies must not drift apart.
    gate = re.compile(r"lease AS \(.*?\ngate AS \(.*?RETURNING 1\n\)", re.DOTALL)
    verdict = re.compile(r"EXISTS \(SELECT 1 FROM gate\) AS accepted,.*? AS leased", re.DOTALL)
    shipped = _shipped_statements()
    model = shipped["checkpoints/seal"]

    def part(pattern: re.Pattern[str], text: str, store: str) -> str:
        found = pattern.search(text)
        assert found is not None
        assert found.group(0).count(f"'{store}'") == 1
        return found.group(0).replace(f"'{store}'", "'<store>'")

    # leases/acquire reads the fences (it starts above them), it passes no gate.
    fenced = {
        name
        for name, text in shipped.items()
        if "adk_fences" in text and not name.startswith("leases/")
    }
    for name in fenced:
        store, text = name.split("/")[0], shipped[name]
        # Only an append adds a condition of its own: the prefix it follows must resolve.
        own = text.replace("          AND (SELECT resolves FROM prefix)\n", "")
        assert part(gate, own, store) == part(gate, model, "checkpoints"), name
        if name != "idempotency/claim_fenced":  # a claim returns the record instead
            assert part(verdict, text, store) == part(verdict, model, "checkpoints"), name
    stores = ("checkpoints", "idempotency", "history", "ledger", "approvals")
    assert fenced == {f"{store}/seal" for store in stores} | {
        "checkpoints/put",
        "checkpoints/put_keeping",
        "idempotency/claim_fenced",
        "history/append",
        "ledger/charge",
        "approvals/request",
    }


def test_importing_the_package_reads_no_file_and_opening_does() -> None:
    code = (
        "import importlib.resources as resources\n"
        "real = resources.files\n"
        "def refuse(*args, **kwargs):\n"
        "    raise SystemExit('read at import')\n"
        "resources.files = refuse\n"
        "import tesserix_adk.adapters.postgres as pg\n"
        "resources.files = real\n"
        "stores = pg.open_postgres_stores('postgresql://nobody@127.0.0.1:1/none')\n"
        "assert stores.schema == pg.EXPECTED_CHECKPOINT_SCHEMA\n"
        "assert len(pg.MIGRATIONS) == pg.SCHEMA_VERSION\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr + done.stdout


# --- schema ------------------------------------------------------------------------------


async def test_nothing_creates_a_table_until_create_schema(
    pg_url: str, pg_schema: str, pg_admin: Admin
) -> None:
    stores = open_postgres_stores(pg_url)
    try:
        with pytest.raises(ConfigurationError, match="tesserix schema apply"):
            await stores.checkpoints.latest(T, R)
        assert await _tables(pg_admin, pg_schema) == set()
        await stores.create_schema()
        assert "adk_checkpoints" in await _tables(pg_admin, pg_schema)
    finally:
        await stores.aclose()


async def test_verify_on_an_empty_schema_fails_clearly_then_passes_after_create(
    pg_url: str,
) -> None:
    stores = open_postgres_stores(pg_url)
    try:
        with pytest.raises(ConfigurationError) as missing:
            await stores.verify()
        message = str(missing.value)
        assert "missing" in message and "tesserix schema apply" in message
        await stores.create_schema()
        await stores.verify()
    finally:
        await stores.aclose()


async def test_verify_on_an_older_schema_fails_clearly_then_passes_after_create(
    pg_stores: Stores, pg_admin: Admin
) -> None:
    await pg_admin.execute("UPDATE adk_schema_version SET version = %s", (SCHEMA_VERSION - 1,))
    with pytest.raises(ConfigurationError) as older:
        await pg_stores.verify()
    message = str(older.value)
    assert f"version {SCHEMA_VERSION - 1}, older" in message
    assert "tesserix schema apply" in message
    await pg_stores.create_schema()
    await pg_stores.verify()


async def test_a_newer_schema_is_neither_read_nor_downgraded(
    pg_stores: Stores, pg_admin: Admin
) -> None:
    await pg_admin.execute("UPDATE adk_schema_version SET version = %s", (SCHEMA_VERSION + 1,))
    with pytest.raises(ConfigurationError, match="newer"):
        await pg_stores.verify()
    with pytest.raises(ConfigurationError, match="newer"):
        await pg_stores.create_schema()
    cur = await pg_admin.execute("SELECT version FROM adk_schema_version")
    assert await cur.fetchone() == (SCHEMA_VERSION + 1,)


async def test_verify_names_a_missing_table(pg_stores: Stores, pg_admin: Admin) -> None:
    await pg_admin.execute("DROP TABLE adk_ledger")
    with pytest.raises(ConfigurationError, match="adk_ledger"):
        await pg_stores.verify()
    await pg_stores.create_schema()
    await pg_stores.verify()


async def test_create_schema_twice_and_concurrently_is_fine(
    pg_url: str, pg_schema: str, pg_admin: Admin
) -> None:
    opened = [open_postgres_stores(pg_url) for _ in range(6)]
    try:
        await asyncio.gather(*(stores.create_schema() for stores in opened))
        await opened[0].create_schema()
        for stores in opened:
            await stores.verify()
        cur = await pg_admin.execute("SELECT count(*), max(version) FROM adk_schema_version")
        assert await cur.fetchone() == (1, SCHEMA_VERSION)
    finally:
        for stores in opened:
            await stores.aclose()


async def test_tables_live_in_the_search_path_schema(
    pg_stores: Stores, pg_schema: str, pg_admin: Admin
) -> None:
    tables = await _tables(pg_admin, pg_schema)
    assert {"adk_checkpoints", "adk_run_leases", "adk_schema_version"} <= tables
    await pg_stores.checkpoints.put(T, R, b"here", step=1, fence=1)
    cur = await pg_admin.execute(
        f'SELECT payload FROM "{pg_schema}".adk_checkpoints WHERE tenant = %s', (T,)
    )
    assert await cur.fetchone() == (b"here",)


def test_expected_schema_is_the_ddl_with_its_version_table() -> None:
    assert "adk_schema_version" in EXPECTED_CHECKPOINT_SCHEMA
    for table in ("adk_checkpoints", "adk_checkpoint_steps", "adk_run_leases", "adk_fences"):
        assert f"CREATE TABLE IF NOT EXISTS {table}" in EXPECTED_CHECKPOINT_SCHEMA
    assert f"VALUES (1, {SCHEMA_VERSION})" in EXPECTED_CHECKPOINT_SCHEMA


async def test_the_published_ddl_applies_as_is(
    pg_url: str, pg_schema: str, pg_admin: Admin
) -> None:
    await pg_admin.execute(EXPECTED_CHECKPOINT_SCHEMA.encode())
    stores = open_postgres_stores(pg_url)
    try:
        await stores.verify()
    finally:
        await stores.aclose()


_VERSION_1_RECORDS = """
INSERT INTO adk_idempotency (key, status, holder, tenant, run_id, iteration, tool, call_id,
    side_effects, idempotent, fence, outcome, since, completed_at, expires_at, resolved_by)
VALUES
    ('order-5', 'completed', 'worker-a', 'acme', 'run-1', 0, 'book_seat', 'call_1', true,
     false, 3, 'booked', clock_timestamp(), clock_timestamp(), NULL, NULL),
    ('k-flight', 'in_flight', 'worker-a', 'acme', 'run-1', 1, 'book_seat', 'call_2', true,
     false, 3, NULL, clock_timestamp(), NULL, NULL, NULL);
INSERT INTO adk_fences (store, tenant, run_id, fence) VALUES ('idempotency', 'acme', 'run-1', 3)
"""


async def _primary_key(admin: Admin, table: str) -> list[str]:
    cur = await admin.execute(
        "SELECT a.attname FROM pg_constraint c, unnest(c.conkey) WITH ORDINALITY AS k(n, i) "
        "JOIN pg_attribute a ON a.attnum = k.n "
        "WHERE c.contype = 'p' AND c.conrelid = %s::regclass AND a.attrelid = c.conrelid "
        "ORDER BY k.i",
        (table,),
    )
    return [row[0] for row in await cur.fetchall()]


async def test_a_version_1_database_migrates_to_tenant_keyed_records_and_keeps_them(
    pg_url: str, pg_admin: Admin
) -> None:
    # Version 1 as an older kit left it: records keyed by key alone.
    await pg_admin.execute(
        "CREATE TABLE adk_schema_version (id integer PRIMARY KEY, version integer NOT NULL, "
        "applied_at timestamptz NOT NULL DEFAULT clock_timestamp())"
    )
    await pg_admin.execute(MIGRATIONS[0].encode())
    await pg_admin.execute("INSERT INTO adk_schema_version (id, version) VALUES (1, 1)")
    await pg_admin.execute(_VERSION_1_RECORDS.encode())
    assert await _primary_key(pg_admin, "adk_idempotency") == ["key"]
    stores = open_postgres_stores(pg_url)
    try:
        with pytest.raises(ConfigurationError, match="older"):
            await stores.verify()
        await stores.create_schema()
        await stores.verify()
        await stores.create_schema()
        assert await _primary_key(pg_admin, "adk_idempotency") == ["tenant", "key"]
        idem = stores.idempotency
        kept = await idem.lookup(["order-5", "k-flight"], tenant=T)
        assert (kept["order-5"].status, kept["order-5"].outcome) == (
            RecordStatus.completed,
            b"booked",
        )
        assert (kept["k-flight"].status, kept["k-flight"].holder) == (
            RecordStatus.in_flight,
            "worker-a",
        )
        # A kept claim is still fenced as before, and completes under its own tenant only.
        with pytest.raises(StaleFenceError):
            await _claim(stores, "k-flight", "worker-a", fence=2)
        with pytest.raises(StaleFenceError):
            await idem.complete("k-flight", b"x", tenant="globex", holder="worker-a")
        done = await idem.complete("k-flight", b"paid", tenant=T, holder="worker-a")
        assert (done.status, done.outcome) == (RecordStatus.completed, b"paid")
        # The same key is now a record of its own under another tenant.
        assert await idem.lookup(["order-5"], tenant="globex") == {}
        await _claim(stores, "order-5", "worker-g", tenant="globex", fence=1)
        theirs = (await idem.lookup(["order-5"], tenant="globex"))["order-5"]
        assert (theirs.status, theirs.holder) == (RecordStatus.in_flight, "worker-g")
        assert [r.key for r in await idem.records(T, R)] == ["order-5", "k-flight"]
    finally:
        await stores.aclose()


async def test_the_same_key_under_two_tenants_is_two_records(pg_stores: Stores) -> None:
    idem = pg_stores.idempotency
    await _claim(pg_stores, "order-5", "worker-a", tenant="a:b", run_id="c", fence=1)
    await _claim(pg_stores, "order-5", "worker-b", tenant="a", run_id="b:c", fence=1)
    await idem.complete("order-5", b"A's seat", tenant="a:b", holder="worker-a")
    with pytest.raises(StaleFenceError):
        await idem.complete("order-5", b"B's", tenant="a", holder="worker-a")
    await idem.release("order-5", tenant="a:b", holder="worker-b", undispatched=True)
    resolved = await idem.resolve("order-5", never_ran=True, tenant="a", by="ops-b")
    assert (resolved.tenant, resolved.status) == ("a", RecordStatus.never_ran)
    with pytest.raises(KeyError):
        await idem.resolve("order-5", never_ran=True, tenant="other", by="ops")
    a_record = (await idem.lookup(["order-5"], tenant="a:b"))["order-5"]
    assert (a_record.status, a_record.outcome) == (RecordStatus.completed, b"A's seat")
    assert [r.run_id for r in await idem.records("a", "b:c")] == ["b:c"]


# --- connections -------------------------------------------------------------------------


async def test_lease_statements_leave_no_transaction_open_after_a_refusal(
    pg_schema: str,
) -> None:
    name = f"adk-{pg_schema}"
    url = services.schema_url(pg_schema)
    url = services.with_query(url, application_name=name, pool_min="1", pool_max="1")
    stores = open_postgres_stores(url)
    try:
        await stores.create_schema()
        lease = await stores.leases.acquire(T, R, "worker-a", 3600)
        with pytest.raises(LeaseHeldError) as refused:
            await stores.leases.acquire(T, R, "worker-b", 3600)
        assert refused.value.holder == "worker-a"
        with pytest.raises(LeaseLostError):
            await stores.leases.renew(replace(lease, fence=lease.fence + 1), 30)
        assert isinstance(stores.leases, PostgresLeaseStore)
        async with stores.leases.database.pool.connection() as conn:
            assert conn.autocommit
            assert conn.info.transaction_status is TransactionStatus.IDLE
        async with await psycopg.AsyncConnection.connect(services.POSTGRES_URL) as admin:
            cur = await admin.execute(
                "SELECT state FROM pg_stat_activity WHERE application_name = %s", (name,)
            )
            states = [row[0] for row in await cur.fetchall()]
        assert states and all(state == "idle" for state in states), states
    finally:
        await stores.aclose()


async def test_a_statement_the_server_refuses_is_rolled_back_and_its_connection_reused(
    pg_schema: str,
) -> None:
    url = services.with_query(services.schema_url(pg_schema), pool_min="1", pool_max="1")
    stores = open_postgres_stores(url)
    try:
        await stores.create_schema()
        assert isinstance(stores.leases, PostgresLeaseStore)
        database = stores.leases.database
        with pytest.raises(StoreUnavailableError) as refused:
            await database.rows(
                "dividing",
                "INSERT INTO adk_fences (store, tenant, run_id, fence) "
                "VALUES ('x', 't', 'r', 1 / %(zero)s::int)",
                {"zero": 0},
            )
        assert not refused.value.retryable
        async with database.pool.connection() as conn:
            assert conn.info.transaction_status is TransactionStatus.IDLE
        lease = await stores.leases.acquire(T, R, "worker-a", 30)
        assert lease.fence == 1
    finally:
        await stores.aclose()


async def test_server_default_isolation_does_not_leak_into_the_stores(pg_schema: str) -> None:
    url = services.with_query(
        services.POSTGRES_URL,
        options=f"-csearch_path={pg_schema} -cdefault_transaction_isolation=serializable",
    )
    stores = open_postgres_stores(url)
    try:
        await stores.create_schema()
        assert isinstance(stores.leases, PostgresLeaseStore)
        database = stores.leases.database
        row = await database.row(
            "reading the isolation", "SELECT current_setting('transaction_isolation') AS i", {}
        )
        assert row == {"i": "read committed"}
        # Set per transaction, not per session: a pooler may hand the next transaction to
        # another server connection, and the session's default is left as it was.
        async with database.pool.connection() as conn:
            cur = await conn.execute("SHOW transaction_isolation")
            assert await cur.fetchone() == ("serializable",)
    finally:
        await stores.aclose()


# --- fences ------------------------------------------------------------------------------


async def test_a_takeover_fences_the_old_holder_out_at_once(pg_stores: Stores) -> None:
    old = await pg_stores.leases.acquire(T, R, "worker-a", 0.2)
    await pg_stores.checkpoints.put(T, R, b"old", step=1, fence=old.fence)
    handle = await pg_stores.history.append(T, R, [b"m0"], fence=old.fence, after=None)
    await asyncio.sleep(0.4)
    new = await pg_stores.leases.acquire(T, R, "worker-b", 30)
    # Nobody sealed anything: each statement compares with the run's current lease fence.
    with pytest.raises(StaleFenceError):
        await pg_stores.checkpoints.put(T, R, b"late", step=2, fence=old.fence)
    with pytest.raises(StaleFenceError):
        await _claim(pg_stores, "k1", "worker-a", fence=old.fence)
    with pytest.raises(StaleFenceError):
        await pg_stores.history.append(T, R, [b"late"], fence=old.fence, after=handle)
    with pytest.raises(StaleFenceError):
        await pg_stores.ledger.charge(T, R, 1, Usage(), fence=old.fence)
    with pytest.raises(StaleFenceError):
        await pg_stores.approvals.request(T, R, [], iteration=1, fence=old.fence)
    with pytest.raises(StaleFenceError):
        await pg_stores.checkpoints.seal(T, R, old.fence)
    await pg_stores.checkpoints.put(T, R, b"new", step=2, fence=new.fence)
    latest = await pg_stores.checkpoints.latest(T, R)
    assert latest is not None and latest.payload == b"new"


async def test_fence_survives_release_and_forget(pg_stores: Stores, pg_admin: Admin) -> None:
    first = await pg_stores.leases.acquire(T, R, "worker-a", 30)
    await pg_stores.checkpoints.put(T, R, b"x", step=1, fence=first.fence)
    await pg_stores.leases.release(first)
    await pg_stores.checkpoints.forget(T, R)
    cur = await pg_admin.execute("SELECT fence, holder FROM adk_run_leases")
    assert await cur.fetchall() == [(first.fence, None)]
    with pytest.raises(StaleFenceError):
        await pg_stores.checkpoints.put(T, R, b"unfenced", step=1)
    second = await pg_stores.leases.acquire(T, R, "worker-b", 30)
    assert second.fence == first.fence + 1


# --- ids ---------------------------------------------------------------------------------

INJECTIONS = (
    "x'); DROP TABLE adk_checkpoints;--",
    "'; DELETE FROM adk_run_leases; --",
    "a' OR '1'='1",
    "$1 %s %(tenant)s {}",
    'q"uote\\',
    "ü/ß",
)


async def test_sql_injection_in_tenant_and_run_ids_is_stored_verbatim_and_harmless(
    pg_stores: Stores, pg_schema: str, pg_admin: Admin
) -> None:
    await pg_stores.checkpoints.put(T, R, b"acme's", step=1, fence=1)
    bystander = await pg_stores.leases.acquire(T, R, "worker-a", 3600)
    tables = await _tables(pg_admin, pg_schema)
    call = ToolCall(id="c'1", name="x'); DROP TABLE adk_approvals;--", arguments={"q": "';--"})
    for tenant in INJECTIONS:
        for run_id in INJECTIONS:
            lease = await pg_stores.leases.acquire(tenant, run_id, f"{tenant}|{run_id}", 3600)
            await pg_stores.checkpoints.put(
                tenant, run_id, f"{tenant}|{run_id}".encode(), step=1, fence=lease.fence
            )
            await _claim(
                pg_stores, f"{tenant}|{run_id}", tenant, tenant=tenant, run_id=run_id, fence=1
            )
            request = await pg_stores.approvals.request(
                tenant, run_id, [call], iteration=0, fence=lease.fence
            )
            assert (await pg_stores.approvals.get(tenant, request.id)) == request
            assert request.calls == (call,)
    for tenant in INJECTIONS:
        assert await pg_stores.checkpoints.runs(tenant) == sorted(INJECTIONS)
        for run_id in INJECTIONS:
            latest = await pg_stores.checkpoints.latest(tenant, run_id)
            assert latest is not None and latest.payload == f"{tenant}|{run_id}".encode()
            current = await pg_stores.leases.current(tenant, run_id)
            assert current is not None and current.holder == f"{tenant}|{run_id}"
            [record] = await pg_stores.idempotency.records(tenant, run_id)
            assert (record.key, record.holder) == (f"{tenant}|{run_id}", tenant)
    assert await _tables(pg_admin, pg_schema) == tables
    assert await pg_stores.leases.current(T, R) == bystander
    latest = await pg_stores.checkpoints.latest(T, R)
    assert latest is not None and latest.payload == b"acme's"
    assert await pg_stores.checkpoints.runs(T) == [R]


# --- clocks ------------------------------------------------------------------------------


async def test_client_clock_an_hour_off_can_neither_take_a_live_lease_nor_keep_a_lapsed_one(
    pg_stores: Stores, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_time = time.time
    live = await pg_stores.leases.acquire(T, "live", "worker-a", 3600)
    lapsed = await pg_stores.leases.acquire(T, "lapsed", "worker-a", 0.2)
    await asyncio.sleep(0.4)
    for skew in (3600.0, -3600.0):
        monkeypatch.setattr(time, "time", lambda skew=skew: real_time() + skew)
        with pytest.raises(LeaseHeldError):
            await pg_stores.leases.acquire(T, "live", "worker-b", 30)
        with pytest.raises(LeaseLostError):
            await pg_stores.leases.renew(lapsed, 3600)
        assert await pg_stores.leases.current(T, "live") == live
        assert await pg_stores.leases.current(T, "lapsed") is None
        # Deadlines are the server's: an hour of client skew does not show in them.
        assert abs(live.expires_at - (real_time() + 3600)) < 60


def test_the_url_reaches_psycopg_byte_for_byte_but_for_the_kits_options() -> None:
    from tesserix_adk.adapters.postgres.opening import _split_url

    socket = "postgresql:///test?host=/var/run/postgresql&application_name=team+a"
    assert _split_url(socket + "&keep_last=3") == (socket, {"keep_last": "3"})
    plus = "postgresql://app:ab+c%40d@db.internal:5432/x?options=-csearch_path%3Dmine"
    assert _split_url(plus)[0] == plus


def test_a_typo_in_a_driver_option_is_a_configuration_error_at_open() -> None:
    from tesserix_adk.adapters.postgres import open_postgres_stores

    with pytest.raises(ConfigurationError, match="keep_lats"):
        open_postgres_stores(services.with_query(services.POSTGRES_URL, keep_lats="3"))


async def test_a_database_that_does_not_exist_is_a_configuration_error_not_an_outage(
    pg_schema: str,
) -> None:
    from tesserix_adk.adapters.postgres import open_postgres_stores

    base = services.POSTGRES_URL.rsplit("/", 1)[0]
    async with open_postgres_stores(f"{base}/no_such_db_{pg_schema}") as stores:
        with pytest.raises(ConfigurationError, match="does not exist") as refused:
            await stores.checkpoints.runs("acme")
    assert refused.value.retryable is False
