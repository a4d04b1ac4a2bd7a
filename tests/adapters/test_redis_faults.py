"""Redis under faults, each on a server of the test's own (or a proxy in front of the shared
one): what counts as persistent, which refusals are retryable, and whether an error says
that the outcome is unknown."""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from urllib.parse import urlsplit

import pytest
from redis.asyncio import Redis
from redis.exceptions import BusyLoadingError, MasterDownError, OutOfMemoryError, TryAgainError

from adapters import services
from adapters.throwaway import free_port, redis_server, reply_dropping_proxy
from tesserix_adk.adapters.redis import (
    RedisIdempotencyStore,
    RedisLeaseStore,
    check_persistence,
    open_redis_stores,
)
from tesserix_adk.errors import ConfigurationError, StoreReplyLostError, StoreUnavailableError
from tesserix_adk.leases import Leaseholder, LeasePolicy
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.stores.protocols import RecordStatus, ToolFlags

pytestmark = pytest.mark.redis

T = "acme"
R = "run-1"
AOF_ALWAYS = ("--appendonly", "yes", "--appendfsync", "always")


@asynccontextmanager
async def _client(url: str) -> AsyncIterator[Redis]:
    client = Redis.from_url(url)
    try:
        yield client
    finally:
        await client.aclose()


async def _claim(stores: Stores, key: str, holder: str = "worker-a", run_id: str = R) -> None:
    await stores.idempotency.claim(
        key,
        holder=holder,
        tenant=T,
        run_id=run_id,
        iteration=0,
        tool="book_seat",
        call_id="call_1",
        flags=ToolFlags(),
        fence=None,
    )


# --- what persistent means ---------------------------------------------------------------


async def test_rdb_save_points_alone_are_refused_as_volatile() -> None:
    with redis_server("--save", "3600 1 300 100") as server:
        async with _client(server.url) as client:
            with pytest.raises(ConfigurationError) as refused:
                await check_persistence(client)
            message = str(refused.value)
            assert "appendonly" in message and "allow_volatile=true" in message
            assert "RDB" in message
            store = RedisLeaseStore(client, prefix="adk:")
            with pytest.raises(ConfigurationError):
                await store.acquire(T, R, "worker-a", 30)
            assert await client.dbsize() == 0
            # Accepting the risk is still possible, by name.
            allowed = RedisLeaseStore(client, prefix="adk:", allow_volatile=True)
            assert (await allowed.acquire(T, R, "worker-a", 30)).fence == 1


async def test_aof_with_appendfsync_always_is_persistent() -> None:
    with redis_server(*AOF_ALWAYS) as server:
        async with _client(server.url) as client:
            await check_persistence(client)
            store = RedisLeaseStore(client, prefix="adk:")
            assert (await store.acquire(T, R, "worker-a", 30)).fence == 1


async def test_aof_everysec_is_accepted_with_its_one_second_window_stated(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with redis_server("--appendonly", "yes", "--appendfsync", "everysec") as server:
        async with _client(server.url) as client:
            with caplog.at_level(logging.WARNING, logger="tesserix_adk.adapters.redis"):
                await check_persistence(client)
    stated = [r.getMessage() for r in caplog.records if "everysec" in r.getMessage()]
    assert stated and "one second" in stated[0]


async def test_aof_with_appendfsync_no_is_refused() -> None:
    with redis_server("--appendonly", "yes", "--appendfsync", "no") as server:
        async with _client(server.url) as client:
            with pytest.raises(ConfigurationError) as refused:
                await check_persistence(client)
            assert "appendfsync" in str(refused.value)


async def test_allkeys_eviction_policy_is_refused_even_with_aof() -> None:
    with redis_server(*AOF_ALWAYS, "--maxmemory-policy", "allkeys-lru") as server:
        async with _client(server.url) as client:
            with pytest.raises(ConfigurationError) as refused:
                await RedisLeaseStore(client, prefix="adk:").acquire(T, R, "worker-a", 30)
            message = str(refused.value)
            assert "maxmemory-policy" in message and "allkeys-lru" in message
            assert "allow_volatile=true" in message
            assert "appendonly" not in message


async def test_aof_with_a_volatile_policy_is_accepted() -> None:
    with redis_server(*AOF_ALWAYS, "--maxmemory-policy", "volatile-lru") as server:
        async with _client(server.url) as client:
            store = RedisIdempotencyStore(client, prefix="adk:")
            await store.check_persistence()
            record = await store.claim(
                "k1",
                holder="worker-a",
                tenant=T,
                run_id=R,
                iteration=0,
                tool="book_seat",
                call_id="c1",
                flags=ToolFlags(),
            )
            assert record.status is RecordStatus.in_flight


# --- refusals that mean "not now" ----------------------------------------------------------


async def test_out_of_memory_is_a_retryable_refusal_with_nothing_applied() -> None:
    with redis_server(*AOF_ALWAYS, "--maxmemory", "4mb", "--maxmemory-policy", "noeviction") as s:
        async with _client(s.url) as client:
            filler = b"x" * 65536
            with pytest.raises(OutOfMemoryError):
                for i in range(10_000):
                    await client.set(f"fill:{i}", filler)
            stores = open_redis_stores(s.url + "?prefix=adk%3A")
            try:
                with pytest.raises(StoreUnavailableError) as refused:
                    await stores.leases.acquire(T, R, "worker-a", 30)
                assert refused.value.retryable
                assert not isinstance(refused.value, StoreReplyLostError)
                with pytest.raises(StoreUnavailableError) as refused:
                    await _claim(stores, "k1")
                assert refused.value.retryable
            finally:
                await stores.aclose()
            assert await client.exists("adk:{acme:run-1}:lease") == 0


async def test_a_read_only_replica_is_a_retryable_refusal() -> None:
    # A replica whose primary is not there: every write is refused with READONLY.
    with redis_server(*AOF_ALWAYS, "--replicaof", "127.0.0.1", str(free_port())) as server:
        stores = open_redis_stores(server.url)
        try:
            with pytest.raises(StoreUnavailableError) as refused:
                await stores.leases.acquire(T, R, "worker-a", 30)
            assert refused.value.retryable
            assert not isinstance(refused.value, StoreReplyLostError)
        finally:
            await stores.aclose()


@pytest.mark.parametrize(
    "error",
    [
        BusyLoadingError("Redis is loading the dataset in memory"),
        TryAgainError("Multiple keys request during rehashing of slot"),
        MasterDownError("Link with MASTER is down and replica-serve-stale-data is set to 'no'."),
    ],
    ids=["LOADING", "TRYAGAIN", "MASTERDOWN"],
)
def test_server_replies_meaning_not_now_are_retryable(error: Exception) -> None:
    # Exactly what redis-py raises for these replies (it strips the code from the message).
    from tesserix_adk.adapters.redis.connection import _driver_errors

    with pytest.raises(StoreUnavailableError) as refused, _driver_errors("testing"):
        raise error
    assert refused.value.retryable
    assert not isinstance(refused.value, StoreReplyLostError)


# --- never sent, or sent and the reply lost -------------------------------------------------


async def test_a_server_that_cannot_be_reached_is_unavailable_not_in_doubt() -> None:
    with redis_server() as server:
        stores = open_redis_stores(server.url + "?allow_volatile=true")
        try:
            await stores.leases.acquire(T, "warm-up", "worker-z", 30)
            server.kill()
            # The pooled connection still looks open, so this command is written to it:
            # from the client's side it may have been applied before the server died.
            with pytest.raises(StoreUnavailableError) as failed:
                await stores.leases.acquire(T, R, "worker-a", 30)
            assert failed.value.retryable
            # Now nothing is connected and nothing can connect: nothing was sent.
            for attempt in (
                stores.leases.acquire(T, R, "worker-a", 30),
                _claim(stores, "k1"),
                stores.checkpoints.latest(T, R),
            ):
                with pytest.raises(StoreUnavailableError) as failed:
                    await attempt
                assert not isinstance(failed.value, StoreReplyLostError), failed.value
                assert failed.value.retryable
        finally:
            await stores.aclose()


async def test_a_reply_lost_after_the_server_applied_it_is_outcome_unknown(
    redis_prefix: str,
) -> None:
    where = urlsplit(services.REDIS_URL)
    async with reply_dropping_proxy(where.hostname or "127.0.0.1", where.port or 6379) as proxy:
        url = services.with_query(
            f"redis://127.0.0.1:{proxy.listen_port}{where.path or '/0'}",
            prefix=redis_prefix,
            allow_volatile="true",
        )
        via_proxy = open_redis_stores(url)
        direct = open_redis_stores(
            services.with_query(services.REDIS_URL, prefix=redis_prefix, allow_volatile="true")
        )
        try:
            await via_proxy.leases.acquire(T, "warm-up", "worker-z", 30)  # connected, loaded
            proxy.drop_next_reply()
            with pytest.raises(StoreReplyLostError) as lost:
                await via_proxy.leases.acquire(T, R, "worker-a", 30)
            assert lost.value.retryable and lost.value.outcome_unknown
            assert proxy.dropped == 1
            # It was applied: reading it back is what settles it.
            current = await direct.leases.current(T, R)
            assert current is not None and current.holder == "worker-a"

            await _claim(via_proxy, "warm-up", run_id="run-2")  # connected, script loaded
            # A claim writes the key's index first (one pipeline), then runs its script:
            # the script's reply is the one lost.
            proxy.drop_next_reply(skip=1)
            with pytest.raises(StoreReplyLostError):
                await _claim(via_proxy, "k1", run_id="run-2")
            record = (await direct.idempotency.lookup(["k1"], tenant=T))["k1"]
            assert record.status is RecordStatus.in_flight
        finally:
            await via_proxy.aclose()
            await direct.aclose()


# --- closing a Leaseholder on a real server ---------------------------------------------------


async def test_leaseholder_close_on_redis_never_hangs_and_hands_the_lease_back(
    redis_stores: Stores,
) -> None:
    # Closed at every phase of the renewal loop (waiting, mid-renewal), many times.
    policy = LeasePolicy(ttl=0.2, renew_within=0.15)
    rng = random.Random(20)
    for round_ in range(25):
        run_id = f"close-{round_}"
        holder = await Leaseholder.acquire(redis_stores.leases, T, run_id, "worker-a", policy)
        await holder.__aenter__()
        await asyncio.sleep(rng.uniform(0, 0.15))
        closing = asyncio.create_task(holder.close())
        done, _ = await asyncio.wait({closing}, timeout=10)
        assert closing in done, f"close() hung in round {round_}"
        await closing
        assert await redis_stores.leases.current(T, run_id) is None
        await asyncio.sleep(0.06)  # more than one renewal period: nothing renews it again
        assert await redis_stores.leases.current(T, run_id) is None
