"""The Redis stores' known traps, each against the real server (the conformance suites run
in ``tests/stores/test_conformance.py``)."""

from __future__ import annotations

import asyncio
import itertools
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from redis.asyncio import Redis

import tesserix_adk.adapters.redis as redis_adapter
from adapters import services
from adapters.redis_wire import lose_the_next_reply, resending_client, sent_by
from records_oracle import records_from_oracle
from tesserix_adk import Agent, AgentRunner, ScriptedProvider, ScriptedTurn, tool
from tesserix_adk.adapters.redis import (
    RedisCheckpointStore,
    RedisLeaseStore,
    RedisLedger,
    open_redis_stores,
)
from tesserix_adk.errors import (
    CheckpointCorruptError,
    CheckpointTooLargeError,
    ConfigurationError,
    HistoryUnavailableError,
    LeaseHeldError,
    LeaseLostError,
    StaleFenceError,
    StoreUnavailableError,
)
from tesserix_adk.messages import ToolCall, Usage
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.stores.protocols import (
    FrontierWithHistory,
    IdempotencyRecord,
    RecordsFrom,
    RecordStatus,
    ToolFlags,
)

pytestmark = pytest.mark.redis

T = "acme"
R = "run-1"
# Nothing listens here: a store pointed at it must fail as "unavailable", or not call at all.
DEAD_URL = "redis://127.0.0.1:1/0"


async def _keys(client: Redis, prefix: str) -> list[str]:
    return sorted([key.decode() async for key in client.scan_iter(match=f"{prefix}*")])


async def _claim(
    stores: Stores,
    key: str,
    holder: str,
    *,
    tenant: str = T,
    run_id: str = R,
    fence: int | None = None,
    ttl: float | None = None,
    tool: str | None = "book_seat",
) -> None:
    await stores.idempotency.claim(
        key,
        holder=holder,
        tenant=tenant,
        run_id=run_id,
        iteration=None if tool is None else 0,
        tool=tool,
        call_id=None if tool is None else "call_1",
        flags=None if tool is None else ToolFlags(),
        fence=fence,
        ttl=ttl,
    )


async def _require_volatile(client: Redis) -> None:
    persistence = await client.info("persistence")
    save = (await client.config_get("save"))["save"]
    if str(persistence.get("aof_enabled")) == "1" or save:
        pytest.skip("the test Redis has persistence on; this test needs a volatile one")


# --- importing and opening ---------------------------------------------------------------


def test_importing_without_redis_names_the_extra_to_install() -> None:
    code = (
        "import sys\n"
        "sys.modules['redis'] = None\n"
        "sys.modules['redis.asyncio'] = None\n"
        "try:\n"
        "    import tesserix_adk.adapters.redis\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
        "else:\n"
        "    raise SystemExit('imported without redis')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert 'pip install "tesserix-adk[redis]"' in done.stdout


def test_importing_the_adapters_package_imports_no_driver() -> None:
    code = (
        "import sys\n"
        "import tesserix_adk, tesserix_adk.adapters\n"
        "assert 'redis' not in sys.modules and 'psycopg' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


async def test_open_takes_the_kits_options_out_of_the_url_and_does_no_io() -> None:
    stores = open_redis_stores(
        f"{DEAD_URL}?prefix=mine%3A&allow_volatile=true&keep_last=2&socket_timeout=4"
    )
    try:
        assert isinstance(stores.checkpoints, RedisCheckpointStore)
        assert stores.checkpoints.prefix == "mine:"
        assert stores.checkpoints.keep_last == 2
        client = stores.checkpoints._client
        kwargs = client.connection_pool.connection_kwargs
        assert kwargs["socket_timeout"] == 4.0
        assert not {"prefix", "allow_volatile", "keep_last"} & set(kwargs)
        # Nothing listens there: the first use, not the open, finds that out.
        with pytest.raises(StoreUnavailableError) as failed:
            await stores.checkpoints.latest(T, R)
        assert failed.value.retryable
    finally:
        await stores.aclose()


async def test_a_client_that_decodes_responses_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="decode_responses"):
        open_redis_stores(f"{DEAD_URL}?decode_responses=true")


async def test_bad_kit_options_are_configuration_errors() -> None:
    for query, says in (
        ("allow_volatile=maybe", "allow_volatile"),
        ("keep_last=0", "keep_last"),
        ("prefix=%7Bx%7D", "braces"),
        ("synchronous=normal", "not an option of Redis stores"),
        ("pool_max=2", "not an option of Redis stores"),
        ("prefix=a&prefix=b", "twice"),
    ):
        with pytest.raises(ConfigurationError, match=says):
            open_redis_stores(f"{DEAD_URL}?{query}")


async def test_oversized_payload_is_refused_before_any_call() -> None:
    # The server is unreachable: a store that called it would raise StoreUnavailableError.
    stores = open_redis_stores(DEAD_URL)
    try:
        store = RedisCheckpointStore(stores.checkpoints._client, max_value_bytes=10)
        with pytest.raises(CheckpointTooLargeError, match="max_value_bytes"):
            await store.put(T, R, b"x" * 11, step=1, fence=1)
    finally:
        await stores.aclose()


async def test_payload_at_the_cap_is_written(redis_client: Redis, redis_prefix: str) -> None:
    store = RedisCheckpointStore(redis_client, prefix=redis_prefix, max_value_bytes=10)
    await store.put(T, R, b"x" * 10, step=1, fence=1)
    latest = await store.latest(T, R)
    assert latest is not None and latest.payload == b"x" * 10


# --- scripts -----------------------------------------------------------------------------

_PACKAGE = Path(redis_adapter.__file__).parent
_SCRIPTS = _PACKAGE / "scripts"


def _header(text: str) -> list[str]:
    return list(itertools.takewhile(lambda line: line.startswith("--"), text.splitlines()))


def test_every_lua_file_opens_with_a_header_naming_its_keys_and_argv() -> None:
    files = sorted(_SCRIPTS.glob("*.lua"))
    assert len(files) > 1
    for file in files:
        header = _header(file.read_text(encoding="utf-8"))
        assert any(line.startswith("-- KEYS:") for line in header), file.name
        assert any(line.startswith("-- ARGV:") for line in header), file.name


async def test_every_script_the_stores_register_is_a_file_after_the_common_prelude(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    registered: list[str] = []
    register = Redis.register_script

    def recording(self: Redis, script: str) -> Any:
        registered.append(script)
        return register(self, script)

    monkeypatch.setattr(Redis, "register_script", recording)
    stores = open_redis_stores(DEAD_URL)
    await stores.aclose()
    common = (_SCRIPTS / "common.lua").read_text(encoding="utf-8")
    files = {
        file.stem: common + file.read_text(encoding="utf-8")
        for file in _SCRIPTS.glob("*.lua")
        if file.stem != "common"
    }
    assert set(registered) == set(files.values())
    # And no Lua is left in a Python string.
    for module in _PACKAGE.glob("*.py"):
        assert "redis.call" not in module.read_text(encoding="utf-8"), module.name


# --- fences ------------------------------------------------------------------------------


async def test_fence_counter_survives_lease_expiry_and_release(
    redis_stores: Stores, redis_client: Redis, redis_prefix: str
) -> None:
    counter = f"{redis_prefix}{{acme:run-1}}:lease:fence"
    lease_key = f"{redis_prefix}{{acme:run-1}}:lease"
    first = await redis_stores.leases.acquire(T, R, "worker-a", 0.2)
    assert await redis_client.ttl(counter) == -1
    assert await redis_client.ttl(lease_key) == -1
    await asyncio.sleep(0.4)
    assert await redis_stores.leases.current(T, R) is None
    assert await redis_client.get(counter) == b"1"
    second = await redis_stores.leases.acquire(T, R, "worker-b", 30)
    await redis_stores.leases.release(second)
    # The hash stays, holderless, so that the next acquisition can tell when this lease ended.
    assert await redis_client.hget(lease_key, "holder") is None
    assert await redis_client.ttl(lease_key) == -1
    assert await redis_client.get(counter) == b"2"
    assert await redis_client.ttl(counter) == -1
    third = await redis_stores.leases.acquire(T, R, "worker-c", 30)
    assert (first.fence, second.fence, third.fence) == (1, 2, 3)


async def test_no_key_that_holds_a_fence_or_a_record_has_a_ttl(
    redis_stores: Stores, redis_client: Redis, redis_prefix: str
) -> None:
    lease = await redis_stores.leases.acquire(T, R, "worker-a", 30)
    fence = lease.fence
    await redis_stores.checkpoints.put(T, R, b"frontier", step=1, fence=fence)
    await _claim(redis_stores, "k-call", "worker-a", fence=fence)
    await _claim(redis_stores, "k-run", "worker-a", ttl=30, tool=None)
    await _claim(redis_stores, "k-done", "worker-a", fence=fence)
    await redis_stores.idempotency.complete("k-done", b"outcome", tenant=T, holder="worker-a")
    handle = await redis_stores.history.append(T, R, [b"m0"], fence=fence, after=None)
    await redis_stores.history.append(T, R, [b"m1"], fence=fence, after=handle)
    await redis_stores.ledger.charge(T, R, 10, Usage(input_tokens=1), fence=fence)
    call = ToolCall(id="c1", name="book_seat", arguments={})
    await redis_stores.approvals.request(T, R, [call], iteration=0, fence=fence)
    for store in (redis_stores.checkpoints, redis_stores.history, redis_stores.ledger):
        await store.seal(T, R, fence)
    keys = await _keys(redis_client, redis_prefix)
    assert len(keys) >= 15, keys
    ttls = {key: await redis_client.ttl(key) for key in keys}
    assert ttls == dict.fromkeys(keys, -1)


async def test_in_flight_records_carry_no_ttl(
    redis_stores: Stores, redis_client: Redis, redis_prefix: str
) -> None:
    await _claim(redis_stores, "k-call", "worker-a", fence=1)
    # A run's resume claim lapses, but by its stored deadline, never by a key TTL.
    await _claim(redis_stores, "k-run", "worker-a", ttl=30, tool=None)
    for key in await _keys(redis_client, redis_prefix):
        assert await redis_client.ttl(key) == -1, key
    found = await redis_stores.idempotency.lookup(["k-call", "k-run"], tenant=T)
    assert found["k-call"].status is RecordStatus.in_flight
    assert found["k-call"].expires_at is None
    assert found["k-run"].expires_at is not None


async def test_ttl_claim_expiry_is_decided_by_the_stored_deadline_against_time(
    redis_stores: Stores, redis_client: Redis, redis_prefix: str
) -> None:
    await _claim(redis_stores, "k-run", "worker-a", ttl=3600, tool=None)
    record_key = f"{redis_prefix}{{acme:run-1}}:idem:rec:k-run"
    assert await redis_client.hget(record_key, "holder") == b"worker-a"
    # Move the stored deadline into the past by the server's clock; the key stays.
    seconds, micros = await redis_client.time()
    await redis_client.hset(record_key, "expires_at", str(seconds * 1_000_000 + micros - 1))
    assert await redis_stores.idempotency.lookup(["k-run"], tenant=T) == {}
    assert await redis_stores.idempotency.records(T, R) == []
    await _claim(redis_stores, "k-run", "worker-b", ttl=30, tool=None)
    assert (await redis_stores.idempotency.lookup(["k-run"], tenant=T))[
        "k-run"
    ].holder == "worker-b"


async def test_lease_expiry_is_decided_by_the_stored_deadline_against_time(
    redis_stores: Stores, redis_client: Redis, redis_prefix: str
) -> None:
    lease = await redis_stores.leases.acquire(T, R, "worker-a", 3600)
    lease_key = f"{redis_prefix}{{acme:run-1}}:lease"
    seconds, micros = await redis_client.time()
    await redis_client.hset(lease_key, "deadline", str(seconds * 1_000_000 + micros - 1))
    assert await redis_stores.leases.current(T, R) is None
    with pytest.raises(LeaseLostError):
        await redis_stores.leases.renew(lease, 30)
    taken = await redis_stores.leases.acquire(T, R, "worker-b", 30)
    assert taken.fence == lease.fence + 1


async def test_a_takeover_fences_the_old_holder_out_at_once(redis_stores: Stores) -> None:
    old = await redis_stores.leases.acquire(T, R, "worker-a", 0.2)
    await redis_stores.checkpoints.put(T, R, b"old", step=1, fence=old.fence)
    handle = await redis_stores.history.append(T, R, [b"m0"], fence=old.fence, after=None)
    await asyncio.sleep(0.4)
    new = await redis_stores.leases.acquire(T, R, "worker-b", 30)
    # Nobody sealed anything: the stores compare with the run's current lease fence.
    with pytest.raises(StaleFenceError):
        await redis_stores.checkpoints.put(T, R, b"late", step=2, fence=old.fence)
    with pytest.raises(StaleFenceError):
        await _claim(redis_stores, "k1", "worker-a", fence=old.fence)
    with pytest.raises(StaleFenceError):
        await redis_stores.history.append(T, R, [b"late"], fence=old.fence, after=handle)
    with pytest.raises(StaleFenceError):
        await redis_stores.ledger.charge(T, R, 1, Usage(), fence=old.fence)
    with pytest.raises(StaleFenceError):
        await redis_stores.approvals.request(T, R, [], iteration=1, fence=old.fence)
    with pytest.raises(StaleFenceError):
        await redis_stores.checkpoints.seal(T, R, old.fence)
    await redis_stores.checkpoints.put(T, R, b"new", step=2, fence=new.fence)
    latest = await redis_stores.checkpoints.latest(T, R)
    assert latest is not None and latest.payload == b"new"


async def test_a_lease_counts_as_a_seen_fence_for_unfenced_writes(redis_stores: Stores) -> None:
    await redis_stores.leases.acquire(T, R, "worker-a", 30)
    with pytest.raises(StaleFenceError):
        await redis_stores.checkpoints.put(T, R, b"unfenced", step=1)
    with pytest.raises(StaleFenceError):
        await redis_stores.ledger.charge(T, R, 1, Usage())
    # A resume claim is never fenced.
    await _claim(redis_stores, "run-claim", "worker-a", ttl=30, tool=None)


async def test_a_charge_resent_after_a_lost_reply_counts_once(
    redis_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with resending_client() as client:
        ledger = RedisLedger(client, prefix=redis_prefix)
        await ledger.charge(T, R, 100, Usage(input_tokens=10), fence=1)
        with lose_the_next_reply(monkeypatch):
            await ledger.charge(T, R, 5, Usage(input_tokens=1), fence=1)
        assert await ledger.spent(T, R) == 105
        assert await ledger.usage(T, R) == Usage(input_tokens=11)
        # The same amount charged again is a second charge, not a resend.
        await ledger.charge(T, R, 5, Usage(input_tokens=1), fence=1)
        assert await ledger.spent(T, R) == 110


async def test_an_acquire_resent_after_a_lost_reply_gets_the_lease_it_took(
    redis_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with resending_client() as client:
        leases = RedisLeaseStore(client, prefix=redis_prefix, allow_volatile=True)
        await leases.acquire(T, "warm-up", "worker-z", 30)  # connected, script loaded
        with lose_the_next_reply(monkeypatch):
            lease = await leases.acquire(T, R, "worker-a", 30)
        assert lease.fence == 1
        assert await leases.current(T, R) == lease
        with pytest.raises(LeaseHeldError):
            await leases.acquire(T, R, "worker-a", 30)


# --- durability --------------------------------------------------------------------------


async def test_volatile_server_is_refused_without_allow_volatile(
    redis_client: Redis, redis_prefix: str
) -> None:
    await _require_volatile(redis_client)
    url = services.with_query(services.REDIS_URL, prefix=redis_prefix)
    stores = open_redis_stores(url)
    try:
        for attempt in (
            stores.leases.acquire(T, R, "worker-a", 30),
            stores.idempotency.lookup(["k1"], tenant=T),
            _claim(stores, "k1", "worker-a", fence=1),
            stores.create_schema(),
            stores.verify(),
        ):
            with pytest.raises(ConfigurationError) as refused:
                await attempt
            message = str(refused.value)
            assert "allow_volatile=true" in message
            assert "appendonly" in message and "save" in message
        # Nothing was written by the refused stores.
        assert await _keys(redis_client, redis_prefix) == []
    finally:
        await stores.aclose()


async def test_allow_volatile_accepts_a_volatile_server(
    redis_client: Redis, redis_prefix: str
) -> None:
    await _require_volatile(redis_client)
    stores = open_redis_stores(
        services.with_query(services.REDIS_URL, prefix=redis_prefix, allow_volatile="true")
    )
    try:
        await stores.create_schema()
        await stores.verify()
        lease = await stores.leases.acquire(T, R, "worker-a", 30)
        assert lease.fence == 1
    finally:
        await stores.aclose()


# Servers with AOF, RDB only, or an eviction policy: tests/adapters/test_redis_faults.py,
# each on a throwaway server (the shared one is never reconfigured).


# --- ids ---------------------------------------------------------------------------------

NASTY_IDS = (
    "x'; DROP TABLE adk_checkpoints;--",
    "a}:{b",
    "{acme:run-1}",
    "*",
    "?[x]\\",
    "\r\nFLUSHALL\r\n",
    "adk:{other}",
    "ü/ß %41",
)
_KEY_SHAPE = re.compile(
    r"(\{[A-Za-z0-9._~%-]+:[A-Za-z0-9._~%-]+\}:[a-z:-]+(:[A-Za-z0-9._~%-]+)?"
    r"|idem-key:\{[A-Za-z0-9._~%-]+:[A-Za-z0-9._~%-]+\}|approval-id:\{[A-Za-z0-9._~%-]+\})"
)


async def test_key_injection_in_tenant_and_run_ids_is_stored_verbatim_and_harmless(
    redis_stores: Stores, redis_client: Redis, redis_prefix: str
) -> None:
    bystander = f"{redis_prefix}bystander"
    await redis_client.set(bystander, b"untouched")
    await redis_stores.checkpoints.put(T, R, b"acme's", step=1, fence=1)
    for tenant in NASTY_IDS:
        for run_id in NASTY_IDS:
            lease = await redis_stores.leases.acquire(tenant, run_id, f"{tenant}|{run_id}", 30)
            await redis_stores.checkpoints.put(
                tenant, run_id, f"{tenant}|{run_id}".encode(), step=1, fence=lease.fence
            )
            await _claim(
                redis_stores,
                f"{tenant}|{run_id}",
                tenant,
                tenant=tenant,
                run_id=run_id,
                fence=lease.fence,
            )
            await redis_stores.approvals.request(tenant, run_id, [], iteration=0, fence=1)
    for tenant in NASTY_IDS:
        assert await redis_stores.checkpoints.runs(tenant) == sorted(NASTY_IDS)
        for run_id in NASTY_IDS:
            latest = await redis_stores.checkpoints.latest(tenant, run_id)
            assert latest is not None and latest.payload == f"{tenant}|{run_id}".encode()
            current = await redis_stores.leases.current(tenant, run_id)
            assert current is not None and current.holder == f"{tenant}|{run_id}"
            [record] = await redis_stores.idempotency.records(tenant, run_id)
            assert (record.key, record.tenant, record.run_id) == (
                f"{tenant}|{run_id}",
                tenant,
                run_id,
            )
    # The glob characters in a tenant id match nothing but that tenant's own runs.
    assert await redis_stores.checkpoints.runs(T) == [R]
    assert await redis_client.get(bystander) == b"untouched"
    latest = await redis_stores.checkpoints.latest(T, R)
    assert latest is not None and latest.payload == b"acme's"
    for key in await _keys(redis_client, redis_prefix):
        if key != bystander:
            assert _KEY_SHAPE.fullmatch(key[len(redis_prefix) :]), key


async def test_every_key_of_a_run_shares_its_hash_tag(
    redis_stores: Stores, redis_client: Redis, redis_prefix: str
) -> None:
    tenant, run_id = "a:b", "c}d"
    lease = await redis_stores.leases.acquire(tenant, run_id, "worker-a", 30)
    await redis_stores.checkpoints.put(tenant, run_id, b"x", step=1, fence=lease.fence)
    await redis_stores.history.append(tenant, run_id, [b"m"], fence=lease.fence, after=None)
    await redis_stores.ledger.charge(tenant, run_id, 1, Usage(), fence=lease.fence)
    await _claim(redis_stores, "k", "worker-a", tenant=tenant, run_id=run_id, fence=lease.fence)
    await redis_stores.approvals.request(tenant, run_id, [], iteration=0, fence=lease.fence)
    run_keys = [
        key
        for key in await _keys(redis_client, redis_prefix)
        if not key.startswith((f"{redis_prefix}idem-key:", f"{redis_prefix}approval-id:"))
    ]
    assert len(run_keys) >= 10
    for key in run_keys:
        assert key.startswith(f"{redis_prefix}{{a%3Ab:c%7Dd}}:"), key


async def test_the_key_index_names_the_tenant_and_two_tenants_keep_two_records(
    redis_stores: Stores, redis_client: Redis, redis_prefix: str
) -> None:
    idem = redis_stores.idempotency
    await _claim(redis_stores, "order-5", "worker-a", tenant="a:b", run_id="c")
    await _claim(redis_stores, "order-5", "worker-b", tenant="a", run_id="b:c")
    await idem.complete("order-5", b"A's seat", tenant="a:b", holder="worker-a")
    assert await redis_client.get(f"{redis_prefix}idem-key:{{a%3Ab:order-5}}") == b"a%3Ab:c"
    assert await redis_client.get(f"{redis_prefix}idem-key:{{a:order-5}}") == b"a:b%3Ac"
    b_record = (await idem.lookup(["order-5"], tenant="a"))["order-5"]
    assert (b_record.status, b_record.holder, b_record.outcome) == (
        RecordStatus.in_flight,
        "worker-b",
        None,
    )
    with pytest.raises(StaleFenceError):
        await idem.complete("order-5", b"B's", tenant="a", holder="worker-a")
    resolved = await idem.resolve("order-5", never_ran=True, tenant="a", by="ops-b")
    assert resolved.tenant == "a" and resolved.status is RecordStatus.never_ran
    a_record = (await idem.lookup(["order-5"], tenant="a:b"))["order-5"]
    assert (a_record.status, a_record.outcome) == (RecordStatus.completed, b"A's seat")
    assert await idem.lookup(["order-5"], tenant="other") == {}


async def test_a_record_indexed_by_an_older_kit_is_found_by_its_own_tenant_only(
    redis_stores: Stores, redis_client: Redis, redis_prefix: str
) -> None:
    # The layout before records were keyed by (tenant, key): the index named only the key.
    idem = redis_stores.idempotency
    await _claim(redis_stores, "k-old", "worker-a", run_id="run-0", fence=1)
    await idem.complete("k-old", b"booked", tenant=T, holder="worker-a")
    await redis_client.rename(
        f"{redis_prefix}idem-key:{{acme:k-old}}", f"{redis_prefix}idem-key:{{k-old}}"
    )
    assert (await idem.lookup(["k-old"], tenant=T))["k-old"].outcome == b"booked"
    # Another run of the tenant reusing the key meets the record, not a fresh claim.
    await _claim(redis_stores, "k-old", "worker-b", run_id=R, fence=1)
    [record] = await idem.records(T, "run-0")
    assert (record.status, record.holder, record.outcome) == (
        RecordStatus.completed,
        "worker-a",
        b"booked",
    )
    assert await idem.records(T, R) == []
    # Another tenant does not see it, and claims a record of its own.
    assert await idem.lookup(["k-old"], tenant="globex") == {}
    await _claim(redis_stores, "k-old", "worker-g", tenant="globex", run_id=R, fence=1)
    mine = (await idem.lookup(["k-old"], tenant="globex"))["k-old"]
    assert (mine.tenant, mine.status, mine.holder) == ("globex", RecordStatus.in_flight, "worker-g")
    assert (await idem.lookup(["k-old"], tenant=T))["k-old"].outcome == b"booked"


async def _turns(stores: Stores, count: int, run_id: str = R) -> list[IdempotencyRecord]:
    """One booking per turn 0..count-1, each completed; the run's records read whole."""
    for turn in range(count):
        await stores.idempotency.claim(
            f"{run_id}-k{turn}",
            holder="worker-a",
            tenant=T,
            run_id=run_id,
            iteration=turn,
            tool="book_seat",
            call_id=f"call_{turn}",
            flags=ToolFlags(),
        )
        await stores.idempotency.complete(
            f"{run_id}-k{turn}", b"booked", tenant=T, holder="worker-a"
        )
    return await stores.idempotency.records(T, run_id)


async def test_records_from_a_turn_read_none_of_the_earlier_records(
    redis_stores: Stores, redis_client: Redis, redis_prefix: str
) -> None:
    whole = await _turns(redis_stores, 6)
    # A damaged record of turn 1: a read that reached it would refuse the whole run.
    await redis_client.hset(f"{redis_prefix}{{acme:run-1}}:idem:rec:run-1-k1", "status", "?")
    with pytest.raises(CheckpointCorruptError):
        await redis_stores.idempotency.records(T, R)
    assert isinstance(redis_stores.idempotency, RecordsFrom)
    assert await redis_stores.idempotency.records_from(T, R, 4) == records_from_oracle(whole, 4)


async def test_records_from_a_run_an_older_kit_wrote_read_it_whole(
    redis_stores: Stores, redis_client: Redis, redis_prefix: str
) -> None:
    # Kits before the iteration index kept only the record set.
    whole = await _turns(redis_stores, 5)
    await redis_client.delete(f"{redis_prefix}{{acme:run-1}}:idem:iter")
    assert isinstance(redis_stores.idempotency, RecordsFrom)
    assert await redis_stores.idempotency.records_from(T, R, 3) == records_from_oracle(whole, 3)
    # An index out of step with the set, as they are equal in size: one record in the set
    # alone, and one in the index whose record is gone (inside the range read).
    whole = await _turns(redis_stores, 4, run_id="run-2")
    run = f"{redis_prefix}{{acme:run-2}}"
    await redis_client.srem(f"{run}:idem:keys", "run-2-k3")
    await redis_client.delete(f"{run}:idem:rec:run-2-k3")
    await redis_client.hset(
        f"{run}:idem:rec:k9",
        mapping={
            **{
                k.decode(): v
                for k, v in (await redis_client.hgetall(f"{run}:idem:rec:run-2-k2")).items()
            },
            "key": "k9",
            "iteration": "3",
            "call_id": "call_9",
        },
    )
    await redis_client.sadd(f"{run}:idem:keys", "k9")
    await redis_client.set(f"{redis_prefix}idem-key:{{acme:k9}}", "acme:run-2")
    whole = await redis_stores.idempotency.records(T, "run-2")
    assert [r.key for r in whole if r.iteration == 3] == ["k9"]
    assert await redis_stores.idempotency.records_from(T, "run-2", 3) == records_from_oracle(
        whole, 3
    )


# --- transcripts -------------------------------------------------------------------------


async def test_append_writes_only_new_items_and_trims_a_dead_writers_tail(
    redis_stores: Stores, redis_client: Redis, redis_prefix: str
) -> None:
    items = f"{redis_prefix}{{acme:run-1}}:history:items"
    base = await redis_stores.history.append(T, R, [b"m0", b"m1"], fence=1, after=None)
    dead = await redis_stores.history.append(T, R, [b"dead-2", b"dead-3"], fence=1, after=base)
    assert await redis_client.llen(items) == 4
    carried = await redis_stores.history.append(T, R, [b"new-2"], fence=2, after=base)
    assert await redis_client.lrange(items, 0, -1) == [b"m0", b"m1", b"new-2"]
    assert await redis_stores.history.fetch(carried) == [b"m0", b"m1", b"new-2"]
    with pytest.raises(HistoryUnavailableError):
        await redis_stores.history.append(T, R, [b"x"], fence=2, after=dead)


async def test_a_frontier_and_its_transcript_append_go_in_one_script(
    redis_stores: Stores,
) -> None:
    checkpoints = redis_stores.checkpoints
    assert isinstance(checkpoints, FrontierWithHistory)
    await checkpoints.put(T, "warm", b"f", step=1)  # the script is loaded
    await redis_stores.history.append(T, "warm", [b"m"], after=None)
    sent = sent_by(checkpoints._client)  # type: ignore[attr-defined]
    first = await checkpoints.put_with_history(
        redis_stores.history, T, R, b"f1", step=1, fence=1, encoded=[b"m1", b"m2"], after=None
    )
    assert sent == ["EVALSHA"]
    sent.clear()
    # Another prefix on another client: its keys are not this run's, so the caller writes
    # the two one after the other.
    other = open_redis_stores(
        services.with_query(services.REDIS_URL, prefix="adk-other:", allow_volatile="true")
    )
    try:
        assert (
            await checkpoints.put_with_history(
                other.history, T, R, b"f2", step=2, fence=1, encoded=[b"m3"], after=first
            )
            is None
        )
    finally:
        await other.aclose()
    assert sent == []
    assert first is not None and await redis_stores.history.fetch(first) == [b"m1", b"m2"]
    latest = await checkpoints.latest(T, R)
    assert latest is not None and latest.payload == b"f1"


async def _requests_per_turn(stores: Stores, turns: int) -> int:
    @tool
    def book(seat: str) -> str:
        return f"booked {seat}"

    script: list[Any] = [
        *(ScriptedTurn(calls=[("book", {"seat": str(t)})], cost_micros=5) for t in range(turns)),
        "done",
    ]
    runner = AgentRunner.from_stores(ScriptedProvider(script), stores)
    sent = sent_by(stores.checkpoints._client)  # type: ignore[attr-defined]
    run = await runner.run(
        Agent("g", "book", tools=[book], max_iterations=50), "go", tenant=T, run_id=f"t{turns}"
    )
    assert run.status == "completed"
    return len(sent)


async def test_a_turn_sends_nine_requests(redis_stores: Stores) -> None:
    # Per turn: the charge; the check for a cancel asked while the model thought;
    # after_model_call's frontier and append in one script; the claim; the outcome
    # (finding its run, then recording it); after_tool_result's frontier and append in one
    # script; the cancel check before the model is asked again (finding its run, then
    # reading it). It was 8 before the check after the model's answer, and 10 while each
    # frontier and its append went as two scripts.
    await _requests_per_turn(redis_stores, 1)  # every script loaded on the server
    short = await _requests_per_turn(redis_stores, 2)
    long = await _requests_per_turn(redis_stores, 6)
    assert (long - short) / 4 == 9


# --- clocks ------------------------------------------------------------------------------


async def test_client_clock_an_hour_off_can_neither_take_a_live_lease_nor_keep_a_lapsed_one(
    redis_stores: Stores, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_time = time.time
    live = await redis_stores.leases.acquire(T, "live", "worker-a", 3600)
    lapsed = await redis_stores.leases.acquire(T, "lapsed", "worker-a", 0.2)
    await asyncio.sleep(0.4)
    for skew in (3600.0, -3600.0):
        monkeypatch.setattr(time, "time", lambda skew=skew: real_time() + skew)
        with pytest.raises(LeaseHeldError):
            await redis_stores.leases.acquire(T, "live", "worker-b", 30)
        with pytest.raises(LeaseLostError):
            await redis_stores.leases.renew(lapsed, 3600)
        assert await redis_stores.leases.current(T, "live") == live
        assert await redis_stores.leases.current(T, "lapsed") is None
        # Deadlines are the server's: an hour of client skew does not show in them.
        assert abs(live.expires_at - (real_time() + 3600)) < 60


def test_an_option_the_driver_does_not_know_is_a_configuration_error_at_open() -> None:
    with pytest.raises(ConfigurationError, match="keep_lats"):
        open_redis_stores("redis://127.0.0.1:6379/0?keep_lats=3")
