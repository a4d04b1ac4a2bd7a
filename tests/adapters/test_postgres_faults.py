"""PostgreSQL under faults, on the shared server's ``test`` database in a schema of the
test's own: every call is bounded, and its error says whether the outcome is unknown."""

from __future__ import annotations

import asyncio
from typing import Any
from urllib.parse import urlsplit

import psycopg
import pytest

from adapters import services
from adapters.throwaway import free_port, reply_dropping_proxy
from tesserix_adk.adapters.postgres import open_postgres_stores
from tesserix_adk.errors import ConfigurationError, StoreReplyLostError, StoreUnavailableError
from tesserix_adk.stores.protocols import RecordStatus, ToolFlags

pytestmark = pytest.mark.postgres

T = "acme"
R = "run-1"
# Far longer than any bounded call takes: reaching it means the call was not bounded.
HANG = 30.0


async def _bounded(call: Any) -> Any:
    try:
        return await asyncio.wait_for(call, HANG)
    except TimeoutError:
        pytest.fail(f"the store call was still waiting after {HANG:g} s")


def test_timeout_is_a_kit_option_of_the_url() -> None:
    stores = open_postgres_stores(services.with_query(services.POSTGRES_URL, timeout="2.5"))
    assert stores.leases.database.timeout == 2.5  # type: ignore[attr-defined]
    default = open_postgres_stores(services.POSTGRES_URL)
    assert 0 < default.leases.database.timeout < 30  # type: ignore[attr-defined]
    for bad in ("0", "-1", "soon", "nan"):
        with pytest.raises(ConfigurationError, match="timeout"):
            open_postgres_stores(services.with_query(services.POSTGRES_URL, timeout=bad))


async def test_statements_carry_statement_and_lock_timeouts_and_connections_keepalives(
    pg_url: str,
) -> None:
    async with services.postgres_stores_at(services.with_query(pg_url, timeout="4")) as stores:
        await stores.create_schema()
        database = stores.leases.database  # type: ignore[attr-defined]
        # What a statement of the stores runs under: its own transaction's settings.
        row = await database.row(
            "reading the bounds",
            "SELECT current_setting('statement_timeout') AS statement, "
            "current_setting('lock_timeout') AS lock",
            {},
        )
        async with database.pool.connection() as conn:
            params = conn.info.get_parameters()
            # Set LOCAL, so nothing stays behind on a server connection a pooler shares.
            session = (await (await conn.execute("SHOW statement_timeout")).fetchone())[0]
        assert row["statement"] == "3200ms" and row["lock"] == "2400ms"
        assert session == "0"
        assert params.get("keepalives") == "1"
        assert "keepalives_idle" in params and "tcp_user_timeout" in params


async def test_a_statement_blocked_by_a_row_lock_is_cancelled_and_refused_whole(
    pg_url: str, pg_admin: psycopg.AsyncConnection[Any]
) -> None:
    async with services.postgres_stores_at(services.with_query(pg_url, timeout="2")) as stores:
        await stores.create_schema()
        lease = await stores.leases.acquire(T, R, "worker-a", 30)
        # Another session holds the lease row: the renewal waits for its lock.
        await pg_admin.execute("BEGIN")
        await pg_admin.execute(
            "SELECT * FROM adk_run_leases WHERE tenant = %s AND run_id = %s FOR UPDATE", (T, R)
        )
        try:
            with pytest.raises(StoreUnavailableError) as refused:
                await _bounded(stores.leases.renew(lease, 30))
        finally:
            await pg_admin.execute("ROLLBACK")
        # The server cancelled it and rolled it back: certainly not applied.
        assert not isinstance(refused.value, StoreReplyLostError), refused.value
        assert refused.value.retryable
        assert (await stores.leases.current(T, R)) == lease  # still the old expiry


async def test_a_statement_blocked_by_an_advisory_lock_hits_statement_timeout(
    pg_url: str, pg_admin: psycopg.AsyncConnection[Any]
) -> None:
    async with services.postgres_stores_at(services.with_query(pg_url, timeout="2")) as stores:
        await stores.create_schema()
        database = stores.leases.database  # type: ignore[attr-defined]
        await pg_admin.execute("SELECT pg_advisory_lock(20, 3)")
        try:
            with pytest.raises(StoreUnavailableError) as refused:
                await _bounded(database.rows("waiting", "SELECT pg_advisory_lock(20, 3)", {}))
        finally:
            await pg_admin.execute("SELECT pg_advisory_unlock(20, 3)")
        assert not isinstance(refused.value, StoreReplyLostError), refused.value
        assert refused.value.retryable


async def test_a_reply_that_never_comes_hits_the_client_deadline_outcome_unknown(
    pg_schema: str,
) -> None:
    where = urlsplit(services.POSTGRES_URL)
    async with reply_dropping_proxy(where.hostname or "127.0.0.1", where.port or 5432) as proxy:
        url = services.schema_url(
            pg_schema, f"postgresql://postgres@127.0.0.1:{proxy.listen_port}{where.path}"
        )
        async with (
            services.postgres_stores_at(
                services.with_query(url, timeout="1.5", pool_min="1", pool_max="1")
            ) as via,
            services.postgres_stores_at(services.schema_url(pg_schema)) as direct,
        ):
            await direct.create_schema()
            await via.leases.current(T, "warm-up")  # the pool's one connection is open
            # BEGIN, the statement and COMMIT go out together: their replies are lost.
            proxy.drop_next_reply(then="hang")
            with pytest.raises(StoreReplyLostError) as lost:
                await _bounded(via.leases.acquire(T, R, "worker-a", 30))
            assert lost.value.retryable and lost.value.outcome_unknown
            assert proxy.dropped == 1
            # It was applied; reading the lease back is what settles it.
            current = await direct.leases.current(T, R)
            assert current is not None and current.holder == "worker-a"


async def test_a_connection_lost_mid_statement_is_outcome_unknown(pg_schema: str) -> None:
    where = urlsplit(services.POSTGRES_URL)
    async with reply_dropping_proxy(where.hostname or "127.0.0.1", where.port or 5432) as proxy:
        url = services.schema_url(
            pg_schema, f"postgresql://postgres@127.0.0.1:{proxy.listen_port}{where.path}"
        )
        async with (
            services.postgres_stores_at(
                services.with_query(url, pool_min="1", pool_max="1")
            ) as via,
            services.postgres_stores_at(services.schema_url(pg_schema)) as direct,
        ):
            await direct.create_schema()
            await via.idempotency.lookup(["warm-up"], tenant=T)
            # BEGIN, the statement and COMMIT go out together: their replies are lost.
            proxy.drop_next_reply(then="close")
            with pytest.raises(StoreReplyLostError):
                await _bounded(
                    via.idempotency.claim(
                        "k1",
                        holder="worker-a",
                        tenant=T,
                        run_id=R,
                        iteration=0,
                        tool="book_seat",
                        call_id="call_1",
                        flags=ToolFlags(),
                    )
                )
            record = (await direct.idempotency.lookup(["k1"], tenant=T))["k1"]
            assert record.status is RecordStatus.in_flight


async def test_a_server_nobody_can_connect_to_is_unavailable_not_in_doubt() -> None:
    url = f"postgresql://postgres@127.0.0.1:{free_port()}/test?timeout=1"
    async with services.postgres_stores_at(url) as stores:
        for attempt in (stores.leases.current(T, R), stores.leases.acquire(T, R, "w", 30)):
            with pytest.raises(StoreUnavailableError) as failed:
                await _bounded(attempt)
            assert not isinstance(failed.value, StoreReplyLostError), failed.value
            assert failed.value.retryable
