"""PostgreSQL where many deployments put it: behind a transaction pooler (PgBouncer, started
by the test in transaction mode), and named by a URL that needs no startup parameter.

The conformance suites run through PgBouncer in ``tests/stores/test_conformance.py``
(``postgres-pgbouncer``), the crash tests in ``tests/test_crash_processes.py`` and the
process races in ``tests/adapters/test_process_races.py``.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator
from typing import Any

import psycopg
import pytest

from adapters import services
from adapters.pooler import pgbouncer
from adapters.test_process_races import start_racers, stop_racers
from tesserix_adk.adapters.postgres import PostgresLeaseStore, open_postgres_stores
from tesserix_adk.cli import ExitCode
from tesserix_adk.cli.main import main
from tesserix_adk.errors import ConfigurationError
from tesserix_adk.stores.urls import open_stores

pytestmark = pytest.mark.postgres

T = "acme"


@pytest.fixture
async def admin() -> AsyncIterator[psycopg.AsyncConnection[Any]]:
    try:
        conn = await psycopg.AsyncConnection.connect(
            services.POSTGRES_URL, autocommit=True, connect_timeout=3
        )
    except psycopg.OperationalError as exc:
        services.unavailable(f"PostgreSQL at {services.POSTGRES_URL} cannot be reached: {exc}")
    try:
        yield conn
    finally:
        await conn.close()


# --- naming the schema -------------------------------------------------------------------


async def test_schema_option_puts_the_tables_in_that_schema_whatever_the_search_path(
    pg_schema: str, admin: psycopg.AsyncConnection[Any]
) -> None:
    url = services.with_query(services.POSTGRES_URL, schema=pg_schema)
    async with open_stores(url) as stores:
        await stores.create_schema()
        await stores.verify()
        lease = await stores.leases.acquire(T, "r", "worker-a", 30)
        await stores.checkpoints.put(T, "r", b"frontier", step=1, fence=lease.fence)
    cur = await admin.execute(
        "SELECT count(*) FROM information_schema.tables WHERE table_schema = %s", (pg_schema,)
    )
    assert await cur.fetchone() == (10,)
    cur = await admin.execute(f'SELECT payload FROM "{pg_schema}".adk_checkpoints')
    assert await cur.fetchone() == (b"frontier",)


@pytest.mark.parametrize(
    "name",
    [
        'x"; DROP TABLE adk_fences; --',
        "x.adk",
        "a b",
        "%(fence)s",
        "1abc",
        "",
        "x" * 64,
        "é",
    ],
)
def test_a_schema_name_that_is_not_a_plain_identifier_is_a_configuration_error(
    name: str,
) -> None:
    url = services.with_query(services.POSTGRES_URL, schema=name)
    with pytest.raises(ConfigurationError, match="schema in the PostgreSQL store URL"):
        open_postgres_stores(url)


async def test_a_schema_that_does_not_exist_is_named_by_create_schema(pg_schema: str) -> None:
    missing = pg_schema + "_nope"
    async with open_stores(services.with_query(services.POSTGRES_URL, schema=missing)) as stores:
        with pytest.raises(ConfigurationError, match=f"{missing}.*does not exist"):
            await stores.create_schema()


def test_prepare_threshold_none_turns_prepared_statements_off() -> None:
    stores = open_postgres_stores(
        services.with_query(services.POSTGRES_URL, prepare_threshold="none")
    )
    assert isinstance(stores.leases, PostgresLeaseStore)
    assert stores.leases.database.prepare_threshold is None
    assert stores.leases.database.pool.kwargs["prepare_threshold"] is None
    for bad in ("never", "-1", "1.5"):
        url = services.with_query(services.POSTGRES_URL, prepare_threshold=bad)
        with pytest.raises(ConfigurationError, match="prepare_threshold"):
            open_postgres_stores(url)


# --- through PgBouncer -------------------------------------------------------------------


async def test_the_options_startup_parameter_a_pooler_refuses_is_a_configuration_error(
    pg_schema: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pgbouncer() as bouncer:
        url = services.schema_url(pg_schema, bouncer.url())
        async with open_stores(url) as stores:
            with pytest.raises(ConfigurationError, match="schema=") as refused:
                await stores.leases.current(T, "r")
        assert "unsupported startup parameter" in str(refused.value)
        code = await asyncio.to_thread(main, ["--store", url, "inspect", "r", "--tenant", T])
    err = capsys.readouterr().err
    assert code == ExitCode.USAGE, err
    assert err.startswith("tesserix: ") and err.count("\n") == 1, err
    assert "schema=" in err


async def test_a_role_the_pooler_does_not_know_is_a_configuration_error(pg_schema: str) -> None:
    with pgbouncer() as bouncer:
        url = bouncer.stores_url(pg_schema, user=f"adktest_nobody_{secrets.token_hex(4)}")
        async with open_stores(url) as stores:
            with pytest.raises(ConfigurationError, match="refused the connection"):
                await stores.leases.current(T, "r")


async def test_a_password_the_pooler_refuses_is_exit_2_in_one_sentence(
    pg_schema: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pgbouncer(users={"postgres": "right"}, auth_type="md5") as bouncer:
        url = bouncer.stores_url(pg_schema).replace("postgres@", "postgres:wrong@", 1)
        async with open_stores(url) as stores:
            with pytest.raises(ConfigurationError, match="authentication failed"):
                await stores.leases.current(T, "r")
        code = await asyncio.to_thread(main, ["--store", url, "inspect", "r", "--tenant", T])
    err = capsys.readouterr().err
    assert code == ExitCode.USAGE, err
    assert err.startswith("tesserix: ") and err.count("\n") == 1, err
    assert "wrong" not in err


async def test_a_role_that_may_not_log_in_is_exit_2_in_one_sentence(
    pg_schema: str, admin: psycopg.AsyncConnection[Any], capsys: pytest.CaptureFixture[str]
) -> None:
    role = f"adktest_nologin_{secrets.token_hex(4)}"
    await admin.execute(f'CREATE ROLE "{role}" NOLOGIN')
    try:
        url = services.with_query(
            services.POSTGRES_URL.replace("postgres@", f"{role}@", 1), schema=pg_schema
        )
        code = await asyncio.to_thread(main, ["--store", url, "inspect", "r", "--tenant", T])
    finally:
        await admin.execute(f'DROP ROLE "{role}"')
    err = capsys.readouterr().err
    assert code == ExitCode.USAGE, err
    assert err.startswith("tesserix: ") and err.count("\n") == 1, err
    assert "not permitted to log in" in err


async def test_concurrent_leases_hold_behind_a_pooler_whose_default_is_serializable(
    pg_schema: str,
) -> None:
    # Every server connection PgBouncer opens starts SERIALIZABLE by default: the kit's
    # transactions must say READ COMMITTED themselves, each one, whichever connection.
    query = "SET default_transaction_isolation = serializable"
    with pgbouncer(connect_query=query) as bouncer:
        url = bouncer.stores_url(pg_schema)
        conn = await psycopg.AsyncConnection.connect(
            bouncer.url(), autocommit=True, prepare_threshold=None
        )
        try:
            cur = await conn.execute("SHOW default_transaction_isolation")
            assert await cur.fetchone() == ("serializable",)
        finally:
            await conn.close()
        async with open_stores(url) as stores:
            await stores.create_schema()
        racers = await start_racers(url, 10)
        try:
            for round_ in range(3):
                run_id = f"run-{round_}"
                for racer in racers:
                    racer.order(run_id, 60)
                answers = [(await racer.line()).split() for racer in racers]
                winners = [a for a in answers if a[0] == "WON"]
                assert winners == [["WON", "1"]], answers
                assert sorted(a[0] for a in answers).count("HELD") == 9, answers
        finally:
            await stop_racers(racers)
