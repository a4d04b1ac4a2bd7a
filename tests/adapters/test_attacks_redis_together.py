"""Attacks on the Redis frontier written with its transcript append in one script
(``RedisCheckpointStore.put_with_history``, ``scripts/put_with_history.lua``), against the
real server: fences (each store's own seen fence, the lease fence, a takeover, a seal of one
store only, unfenced writes, a seeded random interleaving checked against a model),
``keep_last`` pruning, a resend after a lost reply (a client that resends, the cluster's own
client, a takeover between the two sends), cancellation in flight, empty, huge and binary
appends, ``max_value_bytes``, ids that look like hash tags or globs, the cluster, history
stores it must decline, runs moving between the scripts before the change and the pair, a
server out of memory or killed amid pairs, and whole runs through ``AgentRunner`` with a
lease taken over (whole or in part) or a reply lost before every combined write.

The oracle throughout: the same writes made one after the other (``append`` then ``put``)
leave the same keys, byte for byte, when both are taken; when either is refused, nothing of
the run changes (every key of its tag compared before and after).

Found, and fixed since (each was a strict xfail; its reason is now a comment above its
test): a handle of a negative count resolved (``resolves()`` in
``common.lua`` indexes the digests from the tail); and a script that fails midway is not
undone by Redis, while ``put_with_history.lua`` writes the transcript half (and both seen
fences) before ``put_frontier`` runs, with nothing in front that would make its later
commands certain to succeed. A damaged key (a frontier or step index of another type) or a
step Redis cannot score as a double then left the transcript half, or the whole pair,
written while the caller was told of a certain failure."""

from __future__ import annotations

import asyncio
import contextlib
import random
from typing import Any

import pytest
from redis.asyncio import Redis
from redis.asyncio.connection import Connection
from redis.crc import key_slot
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import OutOfMemoryError

from adapters import services
from adapters.cluster import ThrowawayCluster, cluster_stores
from adapters.redis_wire import lose_the_next_reply, resending_client, sent_by
from adapters.throwaway import redis_server
from tesserix_adk import Agent, AgentRunner, ScriptedProvider, ScriptedTurn, tool
from tesserix_adk.adapters.redis import (
    RedisCheckpointStore,
    RedisHistoryStore,
    open_redis_stores,
)
from tesserix_adk.adapters.redis.keys import _glob_escape, _Keys
from tesserix_adk.adapters.redis.lua import _read
from tesserix_adk.checkpoint.checkpointer import Checkpointer
from tesserix_adk.errors import (
    CheckpointCorruptError,
    CheckpointTooLargeError,
    HistoryUnavailableError,
    StaleFenceError,
    StoreReplyLostError,
    StoreUnavailableError,
)
from tesserix_adk.messages import Message
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.stores.memory import MemoryHistoryStore
from tesserix_adk.stores.protocols import EMPTY_HISTORY_DIGEST, FrontierWithHistory, HistoryHandle
from tesserix_adk.testing.faults import SimulatedCrash

pytestmark = pytest.mark.redis

T = "acme"


# --- helpers -----------------------------------------------------------------------------


def _stores(
    client: Any, prefix: str, **options: Any
) -> tuple[RedisCheckpointStore, RedisHistoryStore]:
    return RedisCheckpointStore(client, prefix=prefix, **options), RedisHistoryStore(
        client, prefix=prefix
    )


async def _together(
    cp: RedisCheckpointStore,
    history: Any,
    run_id: str,
    step: int,
    after: HistoryHandle | None,
    *,
    items: list[bytes] | None = None,
    payload: bytes | None = None,
    fence: int | None = 1,
    tenant: str = T,
) -> HistoryHandle | None:
    return await cp.put_with_history(
        history,
        tenant,
        run_id,
        f"f{step}".encode() if payload is None else payload,
        step=step,
        fence=fence,
        encoded=[f"m{step}".encode()] if items is None else items,
        after=after,
    )


async def _apart(
    cp: RedisCheckpointStore,
    history: RedisHistoryStore,
    run_id: str,
    step: int,
    after: HistoryHandle | None,
    *,
    items: list[bytes] | None = None,
    payload: bytes | None = None,
    fence: int | None = 1,
    tenant: str = T,
) -> HistoryHandle:
    """The same writes one after the other: the oracle of a pair both halves take."""
    handle = await history.append(
        tenant, run_id, [f"m{step}".encode()] if items is None else items, fence=fence, after=after
    )
    await cp.put(
        tenant, run_id, f"f{step}".encode() if payload is None else payload, step=step, fence=fence
    )
    return handle


async def _dump(client: Any, prefix: str, run_id: str, tenant: str = T) -> dict[str, Any]:
    """Every key of the run's tag (name after the tag) with its type and whole value."""
    head = f"{prefix}{{{_Keys.tag(tenant, run_id)}}}:"
    found: dict[str, Any] = {}
    async for raw in client.scan_iter(match=_glob_escape(head) + "*", count=1000):
        key = raw.decode()
        kind = (await client.type(raw)).decode()
        value: Any
        if kind == "string":
            value = await client.get(raw)
        elif kind == "list":
            value = await client.lrange(raw, 0, -1)
        elif kind == "hash":
            value = dict(await client.hgetall(raw))
        elif kind == "zset":
            value = await client.zrange(raw, 0, -1, withscores=True)
        else:
            value = None
        found[key[len(head) :]] = (kind, value)
    return found


def _of(run_id: str, handle: HistoryHandle) -> HistoryHandle:
    """``handle``'s prefix (length and digest) named for run ``run_id``."""
    return HistoryHandle(tenant=T, run_id=run_id, count=handle.count, digest=handle.digest)


async def _memory_handle(run_id: str, *batches: list[bytes], tenant: str = T) -> HistoryHandle:
    """The handle plain appends of ``batches`` give (the reference for every handle)."""
    memory = MemoryHistoryStore()
    handle: HistoryHandle | None = None
    for batch in batches:
        handle = await memory.append(tenant, run_id, batch, after=handle)
    assert handle is not None
    return handle


# --- fences --------------------------------------------------------------------------------


@pytest.mark.parametrize("sealed", ["history", "checkpoints", "both", "lease only"])
async def test_a_takeover_of_either_kind_refuses_the_pair_and_changes_no_key(
    redis_client: Redis, redis_prefix: str, sealed: str
) -> None:
    cp, history = _stores(redis_client, redis_prefix)
    stores = open_redis_stores(
        services.with_query(services.REDIS_URL, prefix=redis_prefix, allow_volatile="true")
    )
    try:
        first = await stores.leases.acquire(T, "r", "old", 30)
        handle = await _together(cp, history, "r", 1, None, fence=first.fence)
        assert handle is not None
        # The old holder's lease lapses; a new holder takes the run (fence 2) and seals.
        await stores.leases.release(first)
        taken = await stores.leases.acquire(T, "r", "new", 30)
        assert taken.fence == 2
        if sealed in ("history", "both"):
            await history.seal(T, "r", taken.fence)
        if sealed in ("checkpoints", "both"):
            await cp.seal(T, "r", taken.fence)
        before = await _dump(redis_client, redis_prefix, "r")
        with pytest.raises(StaleFenceError, match=r"fence 1 is stale.*fence 2 was seen"):
            await _together(cp, history, "r", 2, handle, fence=first.fence)
        assert await _dump(redis_client, redis_prefix, "r") == before
        # The new holder writes on from the old holder's last pair.
        again = await _together(cp, history, "r", 2, handle, fence=taken.fence)
        assert again is not None and await history.fetch(again) == [b"m1", b"m2"]
    finally:
        await stores.aclose()


@pytest.mark.parametrize("sealed", ["history", "checkpoints"])
async def test_a_seal_of_one_store_only_keeps_the_other_stores_fence_where_it_was(
    redis_client: Redis, redis_prefix: str, sealed: str
) -> None:
    cp, history = _stores(redis_client, redis_prefix)
    handle = await _together(cp, history, "r", 1, None, fence=1)
    assert handle is not None
    await (history if sealed == "history" else cp).seal(T, "r", 5)
    with pytest.raises(StaleFenceError, match=r"fence 3 is stale.*fence 5 was seen"):
        await _together(cp, history, "r", 2, handle, fence=3)
    dump = await _dump(redis_client, redis_prefix, "r")
    # Neither seen fence took the refused 3: the store that was not sealed still says 1.
    other = "cp:fence" if sealed == "history" else "history:fence"
    assert dump[other] == ("string", b"1")
    # So the unsealed store alone still takes fence 3 (the pair is refused as a whole).
    if sealed == "history":
        await cp.put(T, "r", b"alone", step=9, fence=3)
    else:
        await history.append(T, "r", [b"alone"], fence=3, after=handle)


@pytest.mark.parametrize(
    ("seen", "what"),
    [("history", "append"), ("checkpoints", "write"), ("lease", "append")],
)
async def test_an_unfenced_pair_after_any_fence_is_refused_naming_the_half_that_refused(
    redis_client: Redis, redis_prefix: str, seen: str, what: str
) -> None:
    cp, history = _stores(redis_client, redis_prefix)
    handle = await _together(cp, history, "r", 1, None, fence=None)  # unfenced: taken
    assert handle is not None
    await _apart(cp, history, "twin", 1, None, fence=None)
    assert await _dump(redis_client, redis_prefix, "r") == await _dump(
        redis_client, redis_prefix, "twin"
    )
    if seen == "history":
        await history.seal(T, "r", 1)
    elif seen == "checkpoints":
        await cp.seal(T, "r", 1)
    else:
        stores = open_redis_stores(
            services.with_query(services.REDIS_URL, prefix=redis_prefix, allow_volatile="true")
        )
        try:
            lease = await stores.leases.acquire(T, "r", "holder", 30)
            await stores.leases.release(lease)  # a lease once existed: the fence stays
        finally:
            await stores.aclose()
    before = await _dump(redis_client, redis_prefix, "r")
    with pytest.raises(StaleFenceError, match=f"unfenced {what} refused.*fence 1 was seen"):
        await _together(cp, history, "r", 2, handle, fence=None)
    assert await _dump(redis_client, redis_prefix, "r") == before


async def test_refusals_come_in_order_stale_append_then_missing_prefix_then_stale_frontier(
    redis_client: Redis, redis_prefix: str
) -> None:
    cp, history = _stores(redis_client, redis_prefix)
    handle = await _together(cp, history, "r", 1, None, fence=1)
    assert handle is not None
    wrong = HistoryHandle(tenant=T, run_id="r", count=1, digest="0" * len(handle.digest))
    longer = HistoryHandle(tenant=T, run_id="r", count=7, digest=handle.digest)
    before = await _dump(redis_client, redis_prefix, "r")
    # Only the frontier's fence is stale: the frontier's refusal.
    await cp.seal(T, "r", 4)
    with pytest.raises(StaleFenceError, match=r"fence 2 is stale.*fence 4"):
        await _together(cp, history, "r", 2, handle, fence=2)
    # A prefix that does not resolve comes before the frontier's stale fence.
    for after in (wrong, longer):
        with pytest.raises(HistoryUnavailableError):
            await _together(cp, history, "r", 2, after, fence=2)
    # The transcript's stale fence comes before both.
    await history.seal(T, "r", 3)
    with pytest.raises(StaleFenceError, match=r"fence 2 is stale.*fence 3"):
        await _together(cp, history, "r", 2, wrong, fence=2)
    after_all = await _dump(redis_client, redis_prefix, "r")
    assert after_all.pop("cp:fence") == ("string", b"4")
    assert after_all.pop("history:fence") == ("string", b"3")
    before.pop("cp:fence")
    before.pop("history:fence")
    assert after_all == before


# Found by the attack on 7cb4aa4, fixed since: common.lua's resolves() reads LINDEX
# digests (count - 1) for any count but 0: a negative count indexes from the tail (count
# -1 reads the second-to-last digest), so a handle of -1 items whose digest is that
# prefix's resolves, append_after's LTRIM 0 -2 keeps all but the last item, and the answer
# is a handle of count 0 over a transcript of 2 items; fetch() refuses count < 0 and
# SQLite's _prefix_resolves says no
async def test_a_handle_of_a_negative_count_does_not_resolve(
    redis_client: Redis, redis_prefix: str
) -> None:
    cp, history = _stores(redis_client, redis_prefix)
    first = await _together(cp, history, "r", 1, None)
    second = await _together(cp, history, "r", 2, first)
    assert first is not None and second is not None
    forged = HistoryHandle(tenant=T, run_id="r", count=-1, digest=first.digest)
    before = await _dump(redis_client, redis_prefix, "r")
    with pytest.raises(HistoryUnavailableError):
        await history.fetch(forged)
    with pytest.raises(HistoryUnavailableError):
        await _together(cp, history, "r", 3, forged, items=[b"x"])
    assert await _dump(redis_client, redis_prefix, "r") == before


async def test_a_handle_of_another_run_is_refused_before_anything_issent_by(
    redis_client: Redis, redis_prefix: str
) -> None:
    cp, history = _stores(redis_client, redis_prefix)
    other = await _together(cp, history, "other", 1, None)
    assert other is not None
    sent = sent_by(redis_client)
    with pytest.raises(ValueError, match="names run 'other'"):
        await _together(cp, history, "r", 2, other)
    assert sent == []
    assert await _dump(redis_client, redis_prefix, "r") == {}


async def test_random_interleavings_of_pairs_and_seals_match_a_model_of_both_or_neither(
    redis_client: Redis, redis_prefix: str
) -> None:
    """Four holders (fences 1..4) write pairs after the prefix each last saw, and seal one
    store or the other, in a seeded random order. A model of the two stores (each its own
    seen fence; the transcript; the frontier) says what each call must answer; the server's
    keys must then be exactly the model's after every call."""
    rng = random.Random(7)
    cp, history = _stores(redis_client, redis_prefix)
    keys = _Keys(redis_prefix)
    seen: dict[str, int | None] = {"history": None, "cp": None}
    transcript: list[bytes] = []
    frontier: bytes | None = None
    handles: dict[int, HistoryHandle | None] = dict.fromkeys(range(1, 5))
    answers: set[str] = set()
    for n in range(300):
        fence = rng.randint(1, 4)
        if rng.random() < 0.15:
            store = rng.choice(["history", "cp"])
            current = seen[store]
            refused = current is not None and current > fence
            try:
                await (history if store == "history" else cp).seal(T, "r", fence)
            except StaleFenceError:
                assert refused
            else:
                assert not refused
                seen[store] = fence if current is None else max(current, fence)
            continue
        after = handles[fence]
        if rng.random() < 0.2 and frontier is not None:
            # The holder (re)reads the run: it carries on from the frontier's prefix.
            count = len(transcript)
            after = await _memory_handle("r", transcript) if count else None
        elif rng.random() < 0.06:
            # A prefix the transcript never had (a handle from a lost branch).
            after = HistoryHandle(tenant=T, run_id="r", count=len(transcript), digest="0" * 64)
        items = [f"{fence}-{n}-{i}".encode() for i in range(rng.randint(0, 3))]
        payload = f"{fence}-{n}".encode()
        count = 0 if after is None else after.count
        resolves = after is None or (
            count <= len(transcript) and await _memory_handle("r", transcript[:count]) == after
        )
        if seen["history"] is not None and seen["history"] > fence:
            want = "stale"
        elif not resolves:
            want = "unavailable"
        elif seen["cp"] is not None and seen["cp"] > fence:
            want = "stale"
        else:
            want = "ok"
        try:
            got = await _together(
                cp, history, "r", n, after, items=items, payload=payload, fence=fence
            )
        except StaleFenceError:
            answer = "stale"
        except HistoryUnavailableError:
            answer = "unavailable"
        else:
            answer = "ok"
            transcript = transcript[:count] + items
            frontier = payload
            for store in seen:
                seen[store] = fence if seen[store] is None else max(seen[store] or 0, fence)
            handles[fence] = got
        assert answer == want, (n, fence)
        answers.add(answer)
        assert await redis_client.lrange(keys.run(T, "r", "history:items"), 0, -1) == transcript
        latest = await cp.latest(T, "r")
        assert (None if latest is None else latest.payload) == frontier
        for store, name in (("history", "history:fence"), ("cp", "cp:fence")):
            raw = await redis_client.get(keys.run(T, "r", name))
            assert (None if raw is None else int(raw)) == seen[store]
    assert answers == {"ok", "stale", "unavailable"}


async def test_a_server_killed_amid_pairs_restarts_with_each_pair_whole_and_none_acknowledged_lost(
    tmp_path: Any,
) -> None:
    config = ("--appendonly", "yes", "--appendfsync", "always", "--dir", str(tmp_path))
    acknowledged: dict[str, int] = {}
    with redis_server(*config) as server:
        client = Redis.from_url(server.url)
        cp, history = _stores(client, "kill:")

        async def writer(run_id: str) -> None:
            handle: HistoryHandle | None = None
            for step in range(1, 100_000):
                items = [f"{run_id}-{step}-{i}".encode() for i in range(step % 4)]
                handle = await _together(cp, history, run_id, step, handle, items=items)
                acknowledged[run_id] = step

        tasks = [asyncio.create_task(writer(f"r{i}")) for i in range(6)]
        await asyncio.sleep(0.4)
        server.kill()
        for task in tasks:
            with pytest.raises((StoreUnavailableError, StoreReplyLostError)):
                await task
        await client.aclose()
        port = server.port
    assert len(acknowledged) == 6 and min(acknowledged.values()) > 1
    with redis_server(*config, port=port) as again:
        client = Redis.from_url(again.url)
        try:
            cp, history = _stores(client, "kill:")
            for run_id, step in acknowledged.items():
                latest = await cp.latest(T, run_id)
                # Every acknowledged pair is there; the one in doubt may be too.
                assert latest is not None and latest.step in (step, step + 1)
                assert latest.payload == f"f{latest.step}".encode()
                items = await client.lrange(_Keys("kill:").run(T, run_id, "history:items"), 0, -1)
                want = [
                    f"{run_id}-{s}-{i}".encode()
                    for s in range(1, latest.step + 1)
                    for i in range(s % 4)
                ]
                assert items == want  # the transcript is exactly the frontier's, no more
        finally:
            await client.aclose()


# --- keep_last -----------------------------------------------------------------------------


async def test_keep_last_prunes_the_steps_and_never_the_transcript_as_put_and_append_do(
    redis_client: Redis, redis_prefix: str
) -> None:
    cp, history = _stores(redis_client, redis_prefix, keep_last=2)
    together: HistoryHandle | None = None
    apart: HistoryHandle | None = None
    # Steps rise, then one goes back below the kept ones (a rewrite after a resume).
    for step in (1, 2, 3, 4, 5, 3):
        together = await _together(cp, history, "a", step, together, fence=1)
        apart = await _apart(cp, history, "b", step, apart, fence=1)
        assert together == _of("a", apart)
        assert await _dump(redis_client, redis_prefix, "a") == await _dump(
            redis_client, redis_prefix, "b"
        )
    assert together is not None
    assert await cp.steps(T, "a") == [4, 5]
    latest = await cp.latest(T, "a")
    assert latest is not None and (latest.payload, latest.step) == (b"f3", 3)
    assert await history.fetch(together) == [b"m1", b"m2", b"m3", b"m4", b"m5", b"m3"]


async def test_a_pair_prunes_more_than_a_thousand_steps_at_once(
    redis_client: Redis, redis_prefix: str
) -> None:
    keys = _Keys(redis_prefix)
    steps = {str(s): b"old" for s in range(1, 2502)}
    await redis_client.hset(keys.run(T, "r", "cp:steps"), mapping=steps)  # type: ignore[arg-type]
    await redis_client.hset(keys.run(T, "r", "cp:step-fences"), mapping=dict.fromkeys(steps, ""))  # type: ignore[arg-type]
    await redis_client.zadd(keys.run(T, "r", "cp:step-index"), {s: int(s) for s in steps})
    cp, history = _stores(redis_client, redis_prefix, keep_last=3)
    handle = await _together(cp, history, "r", 2600, None, fence=None)
    assert handle is not None
    assert await cp.steps(T, "r") == [2500, 2501, 2600]
    assert await redis_client.hlen(keys.run(T, "r", "cp:steps")) == 3
    assert await redis_client.hlen(keys.run(T, "r", "cp:step-fences")) == 3
    assert await history.fetch(handle) == [b"m2600"]


# --- a resend after a lost reply -------------------------------------------------------------


async def test_a_pair_resent_after_a_lost_reply_answers_the_same_and_leaves_one_write(
    redis_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with resending_client() as client:
        cp, history = _stores(client, redis_prefix, keep_last=1)
        first = await _together(cp, history, "r", 1, None, fence=1)  # scripts loaded
        await _apart(cp, history, "twin", 1, None, fence=1)
        assert first is not None
        # A dead writer's tail beyond the prefix: the pair trims it (and so would a resend).
        await history.append(T, "r", [b"orphan"], fence=1, after=first)
        twin_after = _of("twin", first)
        await history.append(T, "twin", [b"orphan"], fence=1, after=twin_after)
        items = [b"m2", b"m3"]
        with lose_the_next_reply(monkeypatch):
            second = await _together(cp, history, "r", 2, first, items=items, fence=2)
        twin = await _apart(cp, history, "twin", 2, twin_after, items=items, fence=2)
        assert second == _of("r", twin)
        assert second == await _memory_handle("r", [b"m1"], items)
        assert await _dump(client, redis_prefix, "r") == await _dump(client, redis_prefix, "twin")
        assert await cp.steps(T, "r") == [2]


@pytest.mark.parametrize("refusal", ["stale", "unavailable"])
async def test_a_refused_pair_resent_after_a_lost_reply_is_refused_again_and_writes_nothing(
    redis_prefix: str, monkeypatch: pytest.MonkeyPatch, refusal: str
) -> None:
    async with resending_client() as client:
        cp, history = _stores(client, redis_prefix)
        first = await _together(cp, history, "r", 1, None, fence=2)
        assert first is not None
        before = await _dump(client, redis_prefix, "r")
        longer = HistoryHandle(tenant=T, run_id="r", count=2, digest=first.digest)
        after = first if refusal == "stale" else longer  # ``longer`` does not resolve
        fence = 1 if refusal == "stale" else 2
        error = StaleFenceError if refusal == "stale" else HistoryUnavailableError
        with lose_the_next_reply(monkeypatch), pytest.raises(error):
            await _together(cp, history, "r", 2, after, fence=fence)
        assert await _dump(client, redis_prefix, "r") == before


async def test_a_takeover_between_a_lost_reply_and_its_resend_leaves_what_the_new_holder_read(
    redis_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The resend is refused (the new holder's seal came between): the old holder stops,
    and the pair its first send wrote is what the new holder reads and carries on from."""
    async with resending_client() as client:
        cp, history = _stores(client, redis_prefix)
        first = await _together(cp, history, "r", 1, None, fence=1)
        assert first is not None
        real = Connection.read_response
        armed = [True]
        read: list[Any] = []

        async def read_response(self: Connection, *args: Any, **kwargs: Any) -> Any:
            reply = await real(self, *args, **kwargs)
            if armed[0]:
                armed[0] = False
                # Between the lost reply and the resend, a new holder seals both stores
                # and reads the run (on a client of its own).
                async with resending_client() as other:
                    cp2, history2 = _stores(other, redis_prefix)
                    await history2.seal(T, "r", 2)
                    await cp2.seal(T, "r", 2)
                    read.append(await cp2.latest(T, "r"))
                raise RedisConnectionError("the reply was lost (test)")
            return reply

        monkeypatch.setattr(Connection, "read_response", read_response)
        try:
            with pytest.raises(StaleFenceError):
                await _together(cp, history, "r", 2, first, fence=1)
        finally:
            monkeypatch.setattr(Connection, "read_response", real)
        assert read[0] is not None and (read[0].payload, read[0].step) == (b"f2", 2)
        handle = await _memory_handle("r", [b"m1"], [b"m2"])
        assert await history.fetch(handle) == [b"m1", b"m2"]
        third = await _together(cp, history, "r", 3, handle, fence=2)
        assert third is not None and await history.fetch(third) == [b"m1", b"m2", b"m3"]


@pytest.mark.parametrize("delay", [0.0, 0.005, 0.05])
async def test_a_pair_cancelled_in_flight_lands_whole_or_not_at_all_and_the_next_reply_is_its_own(
    redis_prefix: str, delay: float
) -> None:
    # One connection only: a reply left unread on it would be the next call's answer.
    client = Redis.from_url(services.REDIS_URL, max_connections=1)
    try:
        cp, history = _stores(client, redis_prefix)
        sealed = await _together(cp, history, "sealed", 1, None)
        assert sealed is not None
        await cp.seal(T, "sealed", 5)
        items = [f"i{i}".encode() for i in range(30_000)]
        task = asyncio.create_task(_together(cp, history, "big", 1, None, items=items))
        await asyncio.sleep(delay)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        # The next call on the same connection hears its own answer (stale), not "ok".
        with pytest.raises(StaleFenceError):
            await _together(cp, history, "sealed", 2, sealed)
        dump = await _dump(client, redis_prefix, "big")
        if dump:
            handle = await _memory_handle("big", items)
            assert await history.fetch(handle) == items
            latest = await cp.latest(T, "big")
            assert latest is not None and latest.payload == b"f1"
        else:
            assert await cp.latest(T, "big") is None
    finally:
        await client.aclose()


# --- what is appended ------------------------------------------------------------------------


@pytest.mark.parametrize("after", ["none", "prefix"])
async def test_an_empty_append_writes_the_frontier_and_cuts_the_transcript_to_its_prefix(
    redis_client: Redis, redis_prefix: str, after: str
) -> None:
    cp, history = _stores(redis_client, redis_prefix)
    results = []
    for run_id, write in (("a", _together), ("b", _apart)):
        first = await write(cp, history, run_id, 1, None, items=[b"m1", b"m2"])
        assert first is not None
        await history.append(T, run_id, [b"tail"], fence=1, after=first)  # a dead tail
        handle = None if after == "none" else first
        results.append(await write(cp, history, run_id, 2, handle, items=[]))
    together, apart = results
    assert together is not None and apart is not None
    expected = (0, EMPTY_HISTORY_DIGEST) if after == "none" else (2, results[1].digest)
    assert (together.count, together.digest) == (apart.count, apart.digest) == expected
    assert await history.fetch(together) == ([] if after == "none" else [b"m1", b"m2"])
    assert await _dump(redis_client, redis_prefix, "a") == await _dump(
        redis_client, redis_prefix, "b"
    )
    latest = await cp.latest(T, "a")
    assert latest is not None and latest.payload == b"f2"


@pytest.mark.parametrize("n", [999, 1000, 1001, 2500, 4100])
async def test_huge_appends_past_the_push_batches_and_lua_stack_land_whole(
    redis_client: Redis, redis_prefix: str, n: int
) -> None:
    # 4100 items: 8 + 2 * 4100 = 8208 arguments, past Lua's 8000-slot C stack.
    cp, history = _stores(redis_client, redis_prefix)
    first_items = [f"a{i}".encode() for i in range(n)]
    second_items = [f"b{i}".encode() for i in range(n + 3)]
    first = await _together(cp, history, "r", 1, None, items=first_items)
    second = await _together(cp, history, "r", 2, first, items=second_items)
    assert second == await _memory_handle("r", first_items, second_items)
    assert await history.fetch(second) == first_items + second_items
    assert first is not None and await history.fetch(first) == first_items
    keys = _Keys(redis_prefix)
    assert await redis_client.llen(keys.run(T, "r", "history:digests")) == 2 * n + 3
    latest = await cp.latest(T, "r")
    assert latest is not None and latest.payload == b"f2"


async def test_binary_items_and_payload_with_every_byte_value_come_back_exactly(
    redis_client: Redis, redis_prefix: str
) -> None:
    cp, history = _stores(redis_client, redis_prefix)
    items = [bytes([b]) for b in range(256)]
    items += [bytes(range(256)) * 3, b"", b"*3\r\n$4\r\nPING\r\n", b"\x00" * 10_000, "é€".encode()]
    payload = bytes(range(256))[::-1] * 50 + b"\x00"
    handle = await _together(cp, history, "r", 1, None, items=items, payload=payload)
    assert handle == await _memory_handle("r", items)
    assert await history.fetch(handle) == items
    latest = await cp.latest(T, "r")
    assert latest is not None and latest.payload == payload
    at = await cp.at(T, "r", 1)
    assert at is not None and at.payload == payload


async def test_a_payload_over_max_value_bytes_is_refused_with_nothing_sent_or_written(
    redis_client: Redis, redis_prefix: str
) -> None:
    cp, history = _stores(redis_client, redis_prefix, max_value_bytes=10)
    handle = await _together(cp, history, "r", 1, None, payload=b"x" * 10)  # at the limit
    assert handle is not None
    before = await _dump(redis_client, redis_prefix, "r")
    sent = sent_by(redis_client)
    with pytest.raises(CheckpointTooLargeError):
        await _together(cp, history, "r", 2, handle, payload=b"x" * 11, items=[b"y" * 100])
    assert sent == []
    assert await _dump(redis_client, redis_prefix, "r") == before


async def test_a_checkpointer_refused_by_max_value_bytes_appends_nothing_and_tombstones(
    redis_client: Redis, redis_prefix: str
) -> None:
    from tesserix_adk import Checkpoint, CheckpointStatus
    from tesserix_adk.checkpoint.checkpointer import TranscriptCursor
    from tesserix_adk.checkpoint.payload.frontier import Boundary

    cp, history = _stores(redis_client, redis_prefix, max_value_bytes=2000)
    checkpointer = Checkpointer(cp, history=history)
    frontier = Checkpoint(
        tenant=T,
        run_id="r",
        agent_name="a",
        step=1,
        boundary=Boundary.after_model_call,
        status=CheckpointStatus.running,
        iteration=0,
        messages=(Message.user("hi"),),
        state={"big": "z" * 5000},
    )
    cursor = TranscriptCursor()
    assert await checkpointer.write(frontier, cursor=cursor) is False
    assert isinstance(checkpointer.last_error, CheckpointTooLargeError)
    assert cursor.handle is None and cursor.persisted == 0
    dump = await _dump(redis_client, redis_prefix, "r")
    assert "history:items" not in dump and "history:digests" not in dump
    latest = await checkpointer.latest(T, "r")
    assert latest is not None and latest.is_tombstone


# --- ids and key layout ----------------------------------------------------------------------

ODD_IDS = [
    ("{acme}", "{run}"),
    ("a}b{c", "x:y:z"),
    ("t*", "r?[x]\\"),
    ("%7Bacme%7D", "%25"),
    ("ten:ant", "run:1"),
    ("ten", "ant:run:1"),
    ("é€", "\x00{}"),
]


async def test_ids_that_look_like_hash_tags_or_globs_stay_apart_in_one_slot(
    redis_client: Redis, redis_prefix: str
) -> None:
    cp, history = _stores(redis_client, redis_prefix)
    handles = {}
    for tenant, run_id in ODD_IDS:
        handle = await _together(
            cp, history, run_id, 1, None, tenant=tenant, items=[f"{tenant}|{run_id}".encode()]
        )
        assert handle is not None
        handles[tenant, run_id] = handle
    for (tenant, run_id), handle in handles.items():
        assert await history.fetch(handle) == [f"{tenant}|{run_id}".encode()]
        latest = await cp.latest(tenant, run_id)
        assert latest is not None and latest.payload == b"f1"
        keys = await _dump(redis_client, redis_prefix, run_id, tenant)
        assert set(keys) == {
            "history:items",
            "history:digests",
            "history:fence",
            "cp:frontier",
            "cp:steps",
            "cp:step-fences",
            "cp:step-index",
            "cp:fence",
        }
        tag = _Keys.tag(tenant, run_id)
        slots = {key_slot(f"{redis_prefix}{{{tag}}}:{name}".encode()) for name in keys}
        assert slots == {key_slot(tag.encode())}
    for tenant in {t for t, _ in ODD_IDS}:
        assert await cp.runs(tenant) == sorted(r for t, r in ODD_IDS if t == tenant)


async def test_the_cluster_writes_a_pair_of_odd_ids_and_huge_binary_appends_in_one_slot(
    redis_cluster: ThrowawayCluster,
) -> None:
    async with cluster_stores(redis_cluster, keep_last=2) as stores:
        cp, history = stores.checkpoints, stores.history
        assert isinstance(cp, RedisCheckpointStore) and isinstance(history, RedisHistoryStore)
        client = cp._client
        items = [bytes([b]) for b in range(256)] + [f"i{i}".encode() for i in range(2000)]
        for tenant, run_id in ODD_IDS[:4]:
            first = await _together(cp, history, run_id, 1, None, tenant=tenant, items=items)
            second = await _together(cp, history, run_id, 2, first, tenant=tenant)
            third = await _together(cp, history, run_id, 3, second, tenant=tenant, items=[])
            assert third == await _memory_handle(run_id, items, [b"m2"], [], tenant=tenant)
            assert await history.fetch(third) == [*items, b"m2"]
            assert await cp.steps(tenant, run_id) == [2, 3]
            tag = _Keys.tag(tenant, run_id)
            keys = [
                k async for k in client.scan_iter(match=_glob_escape(f"{cp.prefix}{{{tag}}}") + "*")
            ]
            assert len(keys) == 8
            assert {key_slot(k) for k in keys} == {key_slot(tag.encode())}
            # A takeover on the cluster refuses the pair whole, too.
            await history.seal(tenant, run_id, 2)
            with pytest.raises(StaleFenceError):
                await _together(cp, history, run_id, 4, third, tenant=tenant)
            latest = await cp.latest(tenant, run_id)
            assert latest is not None and latest.step == 3
            assert await history.fetch(third) == [*items, b"m2"]
        # A history store of another prefix on the same cluster client: declined, unsent.
        other = RedisHistoryStore(client, prefix=cp.prefix + "x:")
        assert await _together(cp, other, "declined", 1, None) is None
        assert await cp.latest(T, "declined") is None


async def test_the_cluster_client_resends_a_pair_whose_reply_was_lost_and_it_lands_once(
    redis_cluster: ThrowawayCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A RedisCluster client sends a command again after a connection error by default.
    async with cluster_stores(redis_cluster, keep_last=1) as stores:
        cp, history = stores.checkpoints, stores.history
        assert isinstance(cp, RedisCheckpointStore) and isinstance(history, RedisHistoryStore)
        first = await _together(cp, history, "r", 1, None, items=[b"m1", b"tail"])
        assert first is not None
        shorter = await _memory_handle("r", [b"m1"])
        with lose_the_next_reply(monkeypatch):
            second = await _together(cp, history, "r", 2, shorter, items=[b"m2", b"m3"])
        assert second == await _memory_handle("r", [b"m1"], [b"m2", b"m3"])
        assert await history.fetch(second) == [b"m1", b"m2", b"m3"]
        assert await cp.steps(T, "r") == [2]
        with lose_the_next_reply(monkeypatch), pytest.raises(HistoryUnavailableError):
            await _together(cp, history, "r", 3, first)  # its tail was cut: gone
        latest = await cp.latest(T, "r")
        assert latest is not None and latest.payload == b"f2"


async def test_a_run_on_the_cluster_taken_over_mid_run_never_sends_a_tool_twice(
    redis_cluster: ThrowawayCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with cluster_stores(redis_cluster) as stores:
        reference = await _reference(stores)
        checkpoints = stores.checkpoints
        assert isinstance(checkpoints, RedisCheckpointStore)
        real = checkpoints.put_with_history
        calls = [0]

        async def racing(*args: Any, **kwargs: Any) -> Any:
            calls[0] += 1
            if calls[0] == 4:  # the second turn's tool result, its call already made
                await _take_over(stores, checkpoints._client, "{r}:*")
            return await real(*args, **kwargs)

        sent: list[str] = []
        agent, script = _booking(sent)
        monkeypatch.setattr(checkpoints, "put_with_history", racing)
        with pytest.raises(StaleFenceError):
            await AgentRunner.from_stores(ScriptedProvider(script), stores).run(
                agent, "go", tenant=T, run_id="{r}:*"
            )
        monkeypatch.undo()
        run = await _carry_on(stores, agent, script, "{r}:*")
        assert run.status.value == "completed" and sent == [str(t) for t in range(TURNS)]
        await _consistent(stores, "{r}:*", reference)


# --- history stores it must decline ----------------------------------------------------------


async def test_a_history_store_of_another_prefix_or_client_or_kind_is_declined_unsent(
    redis_client: Redis, redis_prefix: str
) -> None:
    cp, history = _stores(redis_client, redis_prefix)
    other_client = await services.redis_client()
    try:
        declined = [
            RedisHistoryStore(redis_client, prefix=redis_prefix + "x:"),
            RedisHistoryStore(redis_client, prefix=redis_prefix[:-1]),
            RedisHistoryStore(other_client, prefix=redis_prefix),  # same server, other client
            MemoryHistoryStore(),
            cp,  # not a history store at all
            None,
        ]
        sent = sent_by(redis_client)
        other_sent = sent_by(other_client)
        for store in declined:
            assert await _together(cp, store, "r", 1, None) is None
        assert sent == [] and other_sent == []
        found = [k async for k in redis_client.scan_iter(match=f"{redis_prefix[:-1]}*")]
        assert found == []
        # The same store then writes its own pair as usual.
        handle = await _together(cp, history, "r", 1, None)
        assert handle is not None and await history.fetch(handle) == [b"m1"]
    finally:
        await other_client.aclose()


# --- runs written by the scripts before the change -------------------------------------------

# put.lua and append.lua as they were before 7cb4aa4 (``git show 7cb4aa4^``), run after the
# same common prelude: what a worker not yet upgraded writes.
OLD_PUT = """
local refused = refusal(KEYS[5], KEYS[6], ARGV[1])
if refused then return {'stale', refused} end
accept(KEYS[5], ARGV[1])
redis.call('HSET', KEYS[1], 'payload', ARGV[3], 'step', ARGV[2], 'fence', ARGV[1])
redis.call('HSET', KEYS[2], ARGV[2], ARGV[3])
redis.call('HSET', KEYS[3], ARGV[2], ARGV[1])
redis.call('ZADD', KEYS[4], ARGV[2], ARGV[2])
if ARGV[4] ~= '' then
  local extra = redis.call('ZCARD', KEYS[4]) - tonumber(ARGV[4])
  while extra > 0 do
    local old = redis.call('ZRANGE', KEYS[4], 0, math.min(extra, 1000) - 1)
    redis.call('ZREM', KEYS[4], unpack(old))
    redis.call('HDEL', KEYS[2], unpack(old))
    redis.call('HDEL', KEYS[3], unpack(old))
    extra = extra - #old
  end
end
return {'ok'}
"""
OLD_APPEND = """
local refused = refusal(KEYS[3], KEYS[4], ARGV[1])
if refused then return {'stale', refused} end
local count = tonumber(ARGV[2])
local resolves
if count == 0 then
  resolves = ARGV[3] == ARGV[4]
else
  resolves = redis.call('LINDEX', KEYS[2], count - 1) == ARGV[3]
end
if not resolves then return {'unavailable'} end
accept(KEYS[3], ARGV[1])
if count == 0 then
  redis.call('DEL', KEYS[1], KEYS[2])
else
  redis.call('LTRIM', KEYS[1], 0, count - 1)
  redis.call('LTRIM', KEYS[2], 0, count - 1)
end
local n = tonumber(ARGV[5])
if n > 0 then
  push(KEYS[1], 6, 5 + n)
  push(KEYS[2], 6 + n, 5 + 2 * n)
end
return {'ok'}
"""


def _older_kit(
    client: Redis, prefix: str, keep_last: int | None
) -> tuple[RedisCheckpointStore, RedisHistoryStore]:
    cp, history = _stores(client, prefix, keep_last=keep_last)
    common = _read("common")
    cp._put = client.register_script(common + OLD_PUT)  # type: ignore[method-assign]
    history._append = client.register_script(common + OLD_APPEND)  # type: ignore[method-assign]
    return cp, history


async def test_runs_moving_between_the_old_scripts_and_the_pair_keep_one_layout(
    redis_client: Redis, redis_prefix: str
) -> None:
    new_cp, new_history = _stores(redis_client, redis_prefix, keep_last=3)
    old_cp, old_history = _older_kit(redis_client, redis_prefix, keep_last=3)
    # Each run: the same steps, written by: only the old kit; only the pair; alternating.
    plans = {
        "old": ["old"] * 6,
        "new": ["new"] * 6,
        "old-then-new": ["old", "old", "new", "new", "new", "new"],
        "new-then-old": ["new", "new", "old", "old", "old", "new"],
    }
    for run_id, plan in plans.items():
        handle: HistoryHandle | None = None
        for step, kit in enumerate(plan, start=1):
            items = [f"m{step}-{i}".encode() for i in range(step % 3)]  # 0, 1 or 2 items
            if kit == "old":
                handle = await _apart(old_cp, old_history, run_id, step, handle, items=items)
            else:
                handle = await _together(new_cp, new_history, run_id, step, handle, items=items)
            assert handle is not None
        # Both kits read the run back the same way.
        assert handle is not None
        assert await new_history.fetch(handle) == await old_history.fetch(handle)
    dumps = [await _dump(redis_client, redis_prefix, run_id) for run_id in plans]
    # Fences are shared too: a holder of fence 2 on either kit shuts out fence 1 on the other.
    for run_id, (low, high) in {"old": ("new", "old"), "new": ("old", "new")}.items():
        high_cp, high_history = (old_cp, old_history) if high == "old" else (new_cp, new_history)
        await high_history.seal(T, run_id, 2)
        await high_cp.seal(T, run_id, 2)
        frozen = await _dump(redis_client, redis_prefix, run_id)
        with pytest.raises(StaleFenceError):
            if low == "old":
                await _apart(old_cp, old_history, run_id, 9, None, fence=1)
            else:
                await _together(new_cp, new_history, run_id, 9, None, fence=1)
        assert await _dump(redis_client, redis_prefix, run_id) == frozen
    assert all(dump == dumps[0] for dump in dumps)
    assert sorted(dumps[0]) == sorted(
        [
            "cp:fence",
            "cp:frontier",
            "cp:step-fences",
            "cp:step-index",
            "cp:steps",
            "history:digests",
            "history:fence",
            "history:items",
        ]
    )


# --- a script that fails midway is not undone ------------------------------------------------


async def _told_truthfully(
    client: Redis, prefix: str, before: dict[str, Any], call: Any, both: list[bytes]
) -> None:
    """``call`` either takes the pair (both halves: the transcript ``both``) or fails; a
    failure that says nothing was applied (not ``outcome_unknown``) left every key as
    ``before``; one in doubt left ``before`` or both halves."""
    try:
        written = await call
    except Exception as exc:
        after = await _dump(client, prefix, "r")
        if getattr(exc, "outcome_unknown", False):
            items = after.get("history:items", ("list", []))[1]
            assert after == before or items == both
        else:
            assert after == before, f"told {type(exc).__name__} ({exc}), yet written"
    else:
        assert written is not None
        assert await client.lrange(_Keys(prefix).run(T, "r", "history:items"), 0, -1) == both


# Found by the attack on 7cb4aa4, fixed since: Redis does not undo a script's earlier
# writes when a later command of it fails, and put_with_history.lua raised both seen fences
# and rewrote the transcript before put_frontier ran; with the frontier key or the step
# index holding a string, put_frontier failed after them, and the caller was told of a
# certain failure for a pair that had (partly) landed. The script now checks the type of
# every key it writes before it writes anything.
@pytest.mark.parametrize(
    "damaged",
    [
        "cp:frontier",
        "cp:step-index",
        "history:digests",  # refused by resolves() (LINDEX) before any write: nothing changes
    ],
)
async def test_a_damaged_key_of_the_run_fails_the_pair_with_nothing_written(
    redis_client: Redis, redis_prefix: str, damaged: str
) -> None:
    cp, history = _stores(redis_client, redis_prefix)
    handle = await _together(cp, history, "r", 1, None, fence=1)
    assert handle is not None
    await redis_client.delete(_Keys(redis_prefix).run(T, "r", damaged))
    await redis_client.set(_Keys(redis_prefix).run(T, "r", damaged), b"damaged")
    before = await _dump(redis_client, redis_prefix, "r")
    call = _together(cp, history, "r", 2, handle, fence=2)
    await _told_truthfully(redis_client, redis_prefix, before, call, [b"m1", b"m2"])


# Found by the attack on 7cb4aa4, fixed since: a step past a double's range
# (str(int(step)) is sent as is, never checked) fails put_frontier's ZADD ('value is not a
# valid float') after both fences, the transcript, the frontier hash and the step hashes
# were written; the caller is told StoreUnavailableError, a certain refusal
# (outcome_unknown False), yet the frontier and the transcript landed
async def test_a_step_redis_cannot_score_is_either_taken_or_refused_with_nothing_written(
    redis_client: Redis, redis_prefix: str
) -> None:
    cp, history = _stores(redis_client, redis_prefix)
    handle = await _together(cp, history, "r", 1, None, fence=1)
    assert handle is not None
    before = await _dump(redis_client, redis_prefix, "r")
    call = _together(cp, history, "r", 2**1100, handle, fence=1)
    await _told_truthfully(redis_client, redis_prefix, before, call, [b"m1", b"m2"])


async def test_out_of_memory_refuses_the_pair_whole_or_takes_it_whole() -> None:
    with redis_server("--maxmemory", "4mb", "--maxmemory-policy", "noeviction") as server:
        client = Redis.from_url(server.url)
        try:
            cp, history = _stores(client, "oom:")
            handle = await _together(cp, history, "r", 1, None, fence=1)
            assert handle is not None
            filler = b"x" * 64_000
            with pytest.raises(OutOfMemoryError):
                for i in range(200):
                    await client.set(f"fill:{i}", filler)
            outcomes = []
            # A new fence (its first write is a SET, refused by OOM), then the same fence
            # (its first write is an LTRIM, which OOM does not refuse: then all of it runs).
            for fence, step in ((2, 2), (1, 2)):
                before = await _dump(client, "oom:", "r")
                try:
                    written = await _together(cp, history, "r", step, handle, fence=fence)
                except StoreUnavailableError as exc:
                    assert exc.retryable and not exc.outcome_unknown
                    assert await _dump(client, "oom:", "r") == before
                    outcomes.append("refused")
                else:
                    assert written is not None
                    assert await history.fetch(written) == [b"m1", b"m2"]
                    latest = await cp.latest(T, "r")
                    assert latest is not None and latest.payload == b"f2"
                    outcomes.append("taken")
            assert outcomes[0] == "refused"
        finally:
            await client.aclose()


# --- whole runs through AgentRunner ------------------------------------------------------------

TURNS = 3


def _booking(sent: list[str]) -> tuple[Agent, list[Any]]:
    @tool
    def book(seat: str) -> str:
        sent.append(seat)
        return f"booked {seat}"

    script: list[Any] = [
        *(ScriptedTurn(calls=[("book", {"seat": str(t)})]) for t in range(TURNS)),
        "done",
    ]
    return Agent("g", "book", tools=[book], max_iterations=50), script


async def _reference(stores: Stores) -> list[Message]:
    sent: list[str] = []
    agent, script = _booking(sent)
    runner = AgentRunner.from_stores(ScriptedProvider(script), stores)
    run = await runner.run(agent, "go", tenant=T, run_id="reference")
    assert run.status == "completed" and sent == [str(t) for t in range(TURNS)]
    checkpoints = runner.checkpoints
    assert checkpoints is not None
    latest = await checkpoints.latest(T, "reference")
    assert latest is not None
    return await checkpoints.messages(latest)


async def _carry_on(stores: Stores, agent: Agent, script: list[Any], run_id: str) -> Any:
    runner = AgentRunner.from_stores(ScriptedProvider(script), stores)
    if await stores.checkpoints.latest(T, run_id) is None:
        return await runner.run(agent, "go", tenant=T, run_id=run_id)
    return await runner.resume(agent, run_id, tenant=T)


async def _consistent(stores: Stores, run_id: str, reference: list[Message]) -> None:
    """The frontier names a transcript that resolves and is the reference run's, and a
    resume of the finished run reads it back and changes nothing."""
    checkpointer = Checkpointer.from_stores(stores)
    latest = await checkpointer.latest(T, run_id)
    assert latest is not None and latest.status.value == "completed"
    assert await checkpointer.messages(latest) == reference
    assert latest.step == max(await stores.checkpoints.steps(T, run_id))  # type: ignore[attr-defined]
    sent: list[str] = []
    agent, script = _booking(sent)
    again = await AgentRunner.from_stores(ScriptedProvider(script), stores).resume(
        agent, run_id, tenant=T
    )
    assert again.status == "completed" and again.output == "done" and sent == []


async def _take_over(stores: Stores, client: Any, run_id: str, which: str = "all") -> None:
    """The holder's lease lapses (its hash goes); another takes the run: it acquires the
    lease and seals every store (``all``), or its takeover got only as far as the lease
    (``lease``), or only one store was sealed (``checkpoints``, ``history``: the lease
    fence unchanged, as when leases live elsewhere)."""
    await client.delete(_Keys(stores.checkpoints.prefix).run(T, run_id, "lease"))  # type: ignore[attr-defined]
    fence = 2
    if which in ("all", "lease"):
        lease = await stores.leases.acquire(T, run_id, "thief", 30)
        await stores.leases.release(lease)
        fence = lease.fence
    sealed: list[Any] = []
    if which == "all":
        sealed = [stores.idempotency, stores.ledger, stores.approvals, stores.checkpoints]
        sealed.append(stores.history)
    elif which == "checkpoints":
        sealed = [stores.checkpoints]
    elif which == "history":
        sealed = [stores.history]
    for store in sealed:
        await store.seal(T, run_id, fence)


@pytest.mark.parametrize("before_write", range(1, 2 * TURNS + 2))
async def test_a_takeover_before_any_combined_write_of_a_run_never_sends_a_tool_twice(
    redis_stores: Stores,
    redis_client: Redis,
    monkeypatch: pytest.MonkeyPatch,
    before_write: int,
) -> None:
    reference = await _reference(redis_stores)
    checkpoints = redis_stores.checkpoints
    assert isinstance(checkpoints, FrontierWithHistory)
    real = checkpoints.put_with_history
    calls = [0]

    async def racing(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == before_write:
            await _take_over(redis_stores, redis_client, "r")
        return await real(*args, **kwargs)

    sent: list[str] = []
    agent, script = _booking(sent)
    monkeypatch.setattr(checkpoints, "put_with_history", racing)
    with pytest.raises(StaleFenceError):
        await AgentRunner.from_stores(ScriptedProvider(script), redis_stores).run(
            agent, "go", tenant=T, run_id="r"
        )
    monkeypatch.undo()
    assert calls[0] == before_write  # nothing more was written after the refusal
    run = await _carry_on(redis_stores, agent, script, "r")
    assert run.status.value == "completed"
    assert sent == [str(t) for t in range(TURNS)]  # each booking once, in order
    await _consistent(redis_stores, "r", reference)


@pytest.mark.parametrize("before_write", [1, 4, 2 * TURNS + 1])
@pytest.mark.parametrize("which", ["lease", "checkpoints", "history"])
async def test_a_partial_takeover_before_a_combined_write_still_stops_the_old_holder(
    redis_stores: Stores,
    redis_client: Redis,
    monkeypatch: pytest.MonkeyPatch,
    before_write: int,
    which: str,
) -> None:
    reference = await _reference(redis_stores)
    checkpoints = redis_stores.checkpoints
    assert isinstance(checkpoints, FrontierWithHistory)
    real = checkpoints.put_with_history
    calls = [0]
    frozen: list[dict[str, Any]] = []

    async def racing(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == before_write:
            await _take_over(redis_stores, redis_client, "r", which)
            frozen.append(await _dump(redis_client, redis_stores.checkpoints.prefix, "r"))  # type: ignore[attr-defined]
        return await real(*args, **kwargs)

    sent: list[str] = []
    agent, script = _booking(sent)
    monkeypatch.setattr(checkpoints, "put_with_history", racing)
    with pytest.raises(StaleFenceError):
        await AgentRunner.from_stores(ScriptedProvider(script), redis_stores).run(
            agent, "go", tenant=T, run_id="r"
        )
    monkeypatch.undo()
    # The refused pair wrote neither half, and nothing of the frontier or transcript moved.
    now = await _dump(redis_client, redis_stores.checkpoints.prefix, "r")  # type: ignore[attr-defined]
    for name in ("cp:frontier", "cp:steps", "history:items", "history:digests"):
        assert now.get(name) == frozen[0].get(name)
    run = await _carry_on(redis_stores, agent, script, "r")
    assert run.status.value == "completed" and sent == [str(t) for t in range(TURNS)]
    await _consistent(redis_stores, "r", reference)


@pytest.mark.parametrize("before_write", range(2, 2 * TURNS + 2))
async def test_a_new_holder_that_finishes_the_run_before_the_old_ones_write_is_not_overwritten(
    redis_stores: Stores,
    redis_client: Redis,
    monkeypatch: pytest.MonkeyPatch,
    before_write: int,
) -> None:
    reference = await _reference(redis_stores)
    checkpoints = redis_stores.checkpoints
    assert isinstance(checkpoints, FrontierWithHistory)
    real = checkpoints.put_with_history
    calls = [0]
    sent: list[str] = []
    agent, script = _booking(sent)
    thief: list[Any] = []

    async def racing(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == before_write:
            # The old holder stalls here; its lease lapses; a new holder resumes the run
            # and carries it to the end (its own writes go through ``real``).
            await redis_client.delete(_Keys(checkpoints.prefix).run(T, "r", "lease"))  # type: ignore[attr-defined]
            monkeypatch.setattr(checkpoints, "put_with_history", real)
            runner = AgentRunner.from_stores(ScriptedProvider(script), redis_stores)
            thief.append(await runner.resume(agent, "r", tenant=T))
        return await real(*args, **kwargs)

    monkeypatch.setattr(checkpoints, "put_with_history", racing)
    with pytest.raises(StaleFenceError):
        await AgentRunner.from_stores(ScriptedProvider(script), redis_stores).run(
            agent, "go", tenant=T, run_id="r"
        )
    monkeypatch.undo()
    assert thief and thief[0].status.value == "completed"
    assert sent == [str(t) for t in range(TURNS)]
    await _consistent(redis_stores, "r", reference)


@pytest.mark.parametrize("lost", range(1, 2 * TURNS + 2))
async def test_a_lost_reply_of_any_combined_write_of_a_run_leaves_it_consistent(
    redis_stores: Stores, lost: int
) -> None:
    reference = await _reference(redis_stores)
    checkpoints = redis_stores.checkpoints
    assert isinstance(checkpoints, RedisCheckpointStore)
    script_object = checkpoints._put_with_history
    calls = [0]

    async def losing(*, keys: Any, args: Any) -> Any:
        result = await script_object(keys=keys, args=args)  # applied by the server
        calls[0] += 1
        if calls[0] == lost:
            raise RedisConnectionError("the reply was lost (test)")
        return result

    checkpoints._put_with_history = losing  # type: ignore[method-assign]
    sent: list[str] = []
    agent, script = _booking(sent)
    try:
        run = await AgentRunner.from_stores(ScriptedProvider(script), redis_stores).run(
            agent, "go", tenant=T, run_id="r"
        )
    finally:
        checkpoints._put_with_history = script_object  # type: ignore[method-assign]
    assert calls[0] >= lost
    if run.status.value != "completed":
        run = await _carry_on(redis_stores, agent, script, "r")
    assert run.status.value == "completed"
    assert sent == [str(t) for t in range(TURNS)]
    await _consistent(redis_stores, "r", reference)


async def test_a_run_on_keep_last_one_prunes_its_steps_and_resumes_from_its_transcript(
    redis_prefix: str,
) -> None:
    url = services.with_query(
        services.REDIS_URL, prefix=redis_prefix, allow_volatile="true", keep_last="1"
    )
    stores = open_redis_stores(url)
    try:
        reference = await _reference(stores)
        sent: list[str] = []
        agent, script = _booking(sent)
        # The run dies after the first turn's tool result (its first turn only is scripted).
        first = AgentRunner.from_stores(ScriptedProvider(script), stores)
        checkpoints = stores.checkpoints
        assert isinstance(checkpoints, FrontierWithHistory)
        real = checkpoints.put_with_history
        calls = [0]

        async def dying(*args: Any, **kwargs: Any) -> Any:
            calls[0] += 1
            if calls[0] == 3:
                raise SimulatedCrash("died before writing (test)")
            return await real(*args, **kwargs)

        checkpoints.put_with_history = dying  # type: ignore[method-assign]
        try:
            with pytest.raises(SimulatedCrash):
                await first.run(agent, "go", tenant=T, run_id="r")
        finally:
            del checkpoints.put_with_history  # type: ignore[method-assign]
        assert await checkpoints.steps(T, "r") == [2]  # type: ignore[attr-defined]
        run = await _carry_on(stores, agent, script, "r")
        assert run.status.value == "completed" and sent == [str(t) for t in range(TURNS)]
        assert len(await checkpoints.steps(T, "r")) == 1  # type: ignore[attr-defined]
        await _consistent(stores, "r", reference)
    finally:
        await stores.aclose()
        client = await services.redis_client()
        try:
            await services.delete_prefixed(client, redis_prefix)
        finally:
            await client.aclose()


# Found by review: put.lua and append.lua, run alone (a frontier without a transcript
# store beside it, or stores on different clients), wrote before a key of another type
# failed a later command, as put_with_history.lua did before it checked its keys; the
# caller was told of a failure for a write that had partly landed.
@pytest.mark.parametrize("damaged", ["cp:frontier", "cp:steps", "cp:step-fences", "cp:step-index"])
async def test_a_damaged_key_fails_a_frontier_written_alone_with_nothing_written(
    redis_client: Redis, redis_prefix: str, damaged: str
) -> None:
    cp, _ = _stores(redis_client, redis_prefix)
    await cp.put(T, "r", b"one", step=1, fence=1)
    await redis_client.delete(_Keys(redis_prefix).run(T, "r", damaged))
    await redis_client.set(_Keys(redis_prefix).run(T, "r", damaged), b"damaged")
    before = await _dump(redis_client, redis_prefix, "r")
    with pytest.raises(CheckpointCorruptError):
        await cp.put(T, "r", b"two", step=2, fence=2)
    assert await _dump(redis_client, redis_prefix, "r") == before


@pytest.mark.parametrize("damaged", ["history:items", "history:digests"])
async def test_a_damaged_key_fails_an_append_alone_with_nothing_written(
    redis_client: Redis, redis_prefix: str, damaged: str
) -> None:
    _, history = _stores(redis_client, redis_prefix)
    handle = await history.append(T, "r", [b"m0"], fence=1, after=None)
    await redis_client.delete(_Keys(redis_prefix).run(T, "r", damaged))
    await redis_client.set(_Keys(redis_prefix).run(T, "r", damaged), b"damaged")
    before = await _dump(redis_client, redis_prefix, "r")
    with pytest.raises(CheckpointCorruptError):
        await history.append(T, "r", [b"m1"], fence=2, after=handle)
    assert await _dump(redis_client, redis_prefix, "r") == before
