"""The Redis stores on a Redis Cluster (three masters of the tests' own): the URL that
selects it, the server clock read outside pipelines, cluster errors in the kit's tree, every
key of a run in the run's hash slot, and the persistence check on every node. (The
conformance suites run on the cluster in ``tests/stores/test_conformance.py``, the crash
tests in ``tests/test_crash_processes.py``.)"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from redis.asyncio.cluster import RedisCluster
from redis.crc import key_slot
from redis.exceptions import ConnectionError as RedisConnectionError

from adapters.cluster import ThrowawayCluster, cluster_stores, raw_client, redis_cluster
from adapters.services import redis_prefix, with_query
from tesserix_adk.adapters.redis.connection import _driver_errors
from tesserix_adk.adapters.redis.keys import _Keys
from tesserix_adk.errors import ConfigurationError, StoreUnavailableError
from tesserix_adk.messages import ToolCall, Usage
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.stores.protocols import RecordStatus, ToolFlags
from tesserix_adk.stores.urls import open_stores

pytestmark = pytest.mark.redis

T = "acme"
R = "run-1"
FLAGS = ToolFlags(side_effects=True, idempotent=False)


@pytest.fixture
async def stores(redis_cluster: ThrowawayCluster) -> AsyncIterator[Stores]:
    async with cluster_stores(redis_cluster) as opened:
        yield opened


async def _claim(
    stores: Stores, key: str, run_id: str, *, ttl: float | None = None, fence: int | None = None
) -> None:
    await stores.idempotency.claim(
        key,
        holder="w1",
        tenant=T,
        run_id=run_id,
        iteration=1,
        tool="book_seat",
        call_id=f"c-{key}",
        flags=FLAGS,
        ttl=ttl,
        fence=fence,
    )


# --- the URL -----------------------------------------------------------------------------


async def test_a_cluster_url_opens_every_store_on_one_cluster_client_naming_each_node() -> None:
    stores = open_stores("redis+cluster://127.0.0.1:7001,[::1]:7002,node-3/?prefix=p:")
    try:
        client = stores.checkpoints._client  # type: ignore[attr-defined]
        assert isinstance(client, RedisCluster)
        for store in (stores.idempotency, stores.leases, stores.history, stores.approvals):
            assert store._client is client  # type: ignore[attr-defined]
        startup = sorted(client.nodes_manager.startup_nodes)
        assert startup == sorted(["127.0.0.1:7001", "::1:7002", "node-3:6379"])
        # The work index keeps global sorted sets beside each run's keys: not on a cluster.
        assert stores.work is None
    finally:
        await stores.aclose()


def test_a_rediss_cluster_url_connects_to_every_node_with_tls() -> None:
    from redis.asyncio.connection import SSLConnection

    stores = open_stores("rediss+cluster://127.0.0.1:7001,127.0.0.1:7002/")
    client = stores.leases._client  # type: ignore[attr-defined]
    assert issubclass(client.connection_kwargs["connection_class"], SSLConnection)
    for node in client.nodes_manager.startup_nodes.values():
        assert issubclass(node.connection_class, SSLConnection)


@pytest.mark.parametrize(
    "url",
    [
        "redis+cluster://127.0.0.1:7001/3",  # a cluster has database 0 only
        "redis+cluster://127.0.0.1:notaport/",
        "redis+cluster://127.0.0.1:7001/?no_such_driver_option=1",
        "redis+cluster://127.0.0.1:7001/?read_from_replicas=true",  # replicas lag
    ],
)
def test_a_cluster_url_the_driver_cannot_use_is_a_configuration_error(url: str) -> None:
    with pytest.raises(ConfigurationError, match="Redis Cluster store URL"):
        open_stores(url)


def test_a_cluster_url_refused_for_its_hosts_does_not_show_its_password() -> None:
    with pytest.raises(ConfigurationError, match="not host:port") as caught:
        open_stores("redis+cluster://app:s3cret@127.0.0.1:7001,127.0.0.1:x/")
    assert "s3cret" not in str(caught.value)


async def test_an_unreachable_cluster_is_unavailable_not_a_driver_error() -> None:
    async with open_stores("redis+cluster://127.0.0.1:1/?allow_volatile=true") as stores:
        with pytest.raises(StoreUnavailableError) as caught:
            await stores.leases.current(T, R)
    assert caught.value.retryable
    assert type(caught.value) is StoreUnavailableError  # nothing was sent: not "reply lost"


async def test_discovering_the_clusters_layout_is_no_command_sent_for_a_kit_call(
    redis_cluster: ThrowawayCluster,
) -> None:
    # CLUSTER SLOTS and the like go out on first use: a failure right after them, before
    # the call's own command, must still say that nothing of the call was sent.
    async with open_stores(redis_cluster.url) as stores:
        client = stores.leases._client  # type: ignore[attr-defined]
        with pytest.raises(StoreUnavailableError) as caught, _driver_errors("testing"):
            await client.initialize()
            raise RedisConnectionError("refused before the call's command left")
    assert type(caught.value) is StoreUnavailableError


# --- keys and slots ------------------------------------------------------------------------


async def test_every_key_of_a_run_is_in_the_runs_hash_slot(
    redis_cluster: ThrowawayCluster,
) -> None:
    prefix = redis_prefix()
    url = with_query(redis_cluster.url, prefix=prefix)
    async with open_stores(url) as stores:
        lease = await stores.leases.acquire(T, R, "w1", ttl=30)
        for store in (stores.checkpoints, stores.idempotency, stores.history, stores.approvals):
            await store.seal(T, R, lease.fence)  # type: ignore[attr-defined]
        await stores.checkpoints.put(T, R, b"frontier", step=1, fence=lease.fence)
        await _claim(stores, "k1", R, fence=lease.fence)
        await stores.idempotency.complete("k1", b"done", tenant=T, holder="w1")
        handle = await stores.history.append(T, R, [b"m1", b"m2"], fence=lease.fence, after=None)
        assert handle.count == 2
        usage = Usage(input_tokens=1, output_tokens=2)
        await stores.ledger.charge(T, R, 3, usage, fence=lease.fence)
        call = ToolCall(id="c1", name="book_seat", arguments={})
        await stores.approvals.request(T, R, [call], iteration=1, fence=lease.fence, id="a1")
        await stores.leases.release(lease)
    from adapters.cluster import delete_prefixed

    keys = sorted(k.decode() for k in await delete_prefixed(redis_cluster, prefix))
    tag = "{acme:run-1}"
    run_slot = key_slot(tag[1:-1].encode())
    per_run = [k for k in keys if k.startswith(f"{prefix}{tag}:")]
    # Two lookups by something other than the run: a record by its key, a request by its id.
    assert sorted(set(keys) - set(per_run)) == [
        f"{prefix}approval-id:{{a1}}",
        f"{prefix}idem-key:{{acme:k1}}",
    ]
    assert {f"{prefix}{tag}:{n}" for n in ("lease:fence", "cp:frontier", "ledger")} <= set(per_run)
    assert any(":idem:rec:" in k for k in per_run)
    assert any(":approval:" in k for k in per_run)
    assert any(":history:" in k for k in per_run)
    assert {key_slot(k.encode()) for k in per_run} == {run_slot}


# --- errors ------------------------------------------------------------------------------


async def test_a_key_claimed_by_two_runs_is_a_clear_cross_slot_error(stores: Stores) -> None:
    # A custom idempotency key reused by another run of the tenant: its record lives under
    # the first run's tag, the second run's fences under its own, in another slot.
    slots = {key_slot(b"acme:run-a"), key_slot(b"acme:run-b")}
    assert len(slots) == 2
    await _claim(stores, "shared", "run-a")
    with pytest.raises(ConfigurationError, match="CROSSSLOT") as caught:
        await _claim(stores, "shared", "run-b")
    assert not caught.value.retryable
    assert "different slots" in str(caught.value) and "refused whole" in str(caught.value)
    [record] = (await stores.idempotency.lookup(["shared"], tenant=T)).values()
    assert (record.run_id, record.status) == ("run-a", RecordStatus.in_flight)


async def test_a_servers_crossslot_reply_is_a_clear_configuration_error(
    redis_cluster: ThrowawayCluster,
) -> None:
    client = raw_client(redis_cluster)
    try:
        await client.initialize()
        node = client.get_primaries()[0]
        # Sent to one node as is, past the client's own slot check: the server refuses.
        with pytest.raises(ConfigurationError, match="CROSSSLOT"), _driver_errors("testing"):
            await client.execute_command("SUNION", "a", "b", target_nodes=node)
    finally:
        await client.aclose()


# --- the clock ---------------------------------------------------------------------------


async def test_a_ttl_claim_lapses_by_its_nodes_clock_read_outside_any_pipeline(
    stores: Stores,
) -> None:
    # Three runs, so the records sit on several nodes and one look-up reads each of them.
    runs = ["run-1", "run-2", "run-3", "run-4", "run-5"]
    for run_id in runs:
        await _claim(stores, f"k-{run_id}", run_id, ttl=0.5)
    keys = [f"k-{run_id}" for run_id in runs]
    assert sorted(await stores.idempotency.lookup(keys, tenant=T)) == sorted(keys)
    await asyncio.sleep(0.6)
    assert await stores.idempotency.lookup(keys, tenant=T) == {}
    assert [r.key for r in await stores.idempotency.records(T, "run-1")] == []


# --- persistence ---------------------------------------------------------------------------


async def test_a_cluster_whose_every_node_keeps_aof_passes_the_persistence_check(
    stores: Stores,
) -> None:
    await stores.create_schema()
    await stores.verify()


async def test_the_persistence_check_refuses_a_cluster_with_two_volatile_primaries() -> None:
    durable = ("--appendonly", "yes", "--appendfsync", "always")
    with redis_cluster(durable, (), ()) as cluster:
        async with open_stores(cluster.url) as stores:
            with pytest.raises(ConfigurationError) as caught:
                await stores.create_schema()
            message = str(caught.value)
            assert "allow_volatile=true" in message
            assert message.count("no AOF") == 1  # said once, naming both nodes
            durable_port, *volatile_ports = cluster.ports
            for port in volatile_ports:
                assert f"127.0.0.1:{port}" in message
            assert f"127.0.0.1:{durable_port}" not in message
            # First use of the lease store refuses too, before writing anything.
            with pytest.raises(ConfigurationError):
                await stores.leases.acquire(T, R, "w1", ttl=30)
        allowed = with_query(cluster.url, allow_volatile="true")
        async with open_stores(allowed) as stores:
            await stores.create_schema()
            assert (await stores.leases.acquire(T, R, "w1", ttl=30)).fence == 1


async def test_a_plain_url_on_a_cluster_node_says_to_name_the_cluster(
    redis_cluster: ThrowawayCluster,
) -> None:
    # A run whose slot another node serves: the node answers MOVED to a plain client.
    client = raw_client(redis_cluster)
    try:
        await client.initialize()
        run_id = next(
            f"run-{i}"
            for i in range(100)
            if client.get_node_from_key(f"{{acme:run-{i}}}").port != redis_cluster.ports[0]
        )
    finally:
        await client.aclose()
    prefix = redis_prefix()
    url = f"redis://127.0.0.1:{redis_cluster.ports[0]}/0?prefix={prefix}&allow_volatile=true"
    async with open_stores(url) as stores:
        with pytest.raises(ConfigurationError, match=r"redis\+cluster://") as caught:
            await stores.leases.acquire(T, run_id, "w1", ttl=30)
    assert "Redis Cluster" in str(caught.value)
    assert not caught.value.retryable


# --- every key of a run in its slot, whatever the ids -----------------------------------


@settings(max_examples=300, deadline=None)
@given(
    prefix=st.text(max_size=12).filter(lambda p: "{" not in p and "}" not in p),
    tenant=st.text(max_size=20),
    run_id=st.text(max_size=20),
    name=st.text(max_size=20),
)
def test_every_key_named_for_a_run_hashes_to_the_runs_slot(
    prefix: str, tenant: str, run_id: str, name: str
) -> None:
    # Oracle: Redis hashes a key by its first {…} (when not empty), as redis-py's key_slot
    # does; a run's slot is that of its tag. Ids with braces or colons must not move it.
    keys = _Keys(prefix)
    tag = _Keys.tag(tenant, run_id)
    run_slot = key_slot(tag.encode())
    assert key_slot(keys.run(tenant, run_id, name).encode()) == run_slot
    assert key_slot(keys.tagged(tag, f"idem:rec:{name}").encode()) == run_slot


async def test_stores_built_by_hand_on_a_redis_cluster_client_work_as_opened_ones(
    redis_cluster: ThrowawayCluster,
) -> None:
    from tesserix_adk.adapters.redis import RedisIdempotencyStore, RedisLeaseStore

    client = raw_client(redis_cluster)
    prefix = redis_prefix()
    try:
        leases = RedisLeaseStore(client, prefix=prefix)  # the cluster's nodes keep AOF
        idempotency = RedisIdempotencyStore(client, prefix=prefix)
        lease = await leases.acquire(T, R, "w1", ttl=30)
        await idempotency.claim(
            "k1",
            holder="w1",
            tenant=T,
            run_id=R,
            iteration=1,
            tool="book_seat",
            call_id="c1",
            flags=FLAGS,
            fence=lease.fence,
        )
        # The look-up a resume plans by: hashes and each node's TIME, no pipelined TIME.
        [record] = (await idempotency.lookup(["k1"], tenant=T)).values()
        assert (record.run_id, record.status) == (R, RecordStatus.in_flight)
    finally:
        from adapters.cluster import delete_prefixed

        await delete_prefixed(redis_cluster, prefix, client)
        await client.aclose()


def test_a_cluster_client_that_decodes_replies_is_refused() -> None:
    from redis.asyncio.cluster import ClusterNode

    from tesserix_adk.adapters.redis import RedisLeaseStore

    # No I/O: refused when the store is built.
    client = RedisCluster(startup_nodes=[ClusterNode("127.0.0.1", 7001)], decode_responses=True)
    with pytest.raises(ConfigurationError, match="decode_responses"):
        RedisLeaseStore(client)
