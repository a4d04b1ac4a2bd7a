"""The Redis work index behind the conformance suite: its key layout, the bound on what one
``due`` examines, damaged entries, and resends of a call whose reply was lost."""

from __future__ import annotations

import asyncio
import secrets

import pytest
from redis.asyncio import Redis

from tesserix_adk.adapters.redis import RedisWorkIndex, open_redis_stores
from tesserix_adk.errors import CheckpointCorruptError
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.stores.protocols import WorkState

T = "acme"
A = "booking"
LONG = 3600.0


def _index(redis_stores: Stores) -> RedisWorkIndex:
    assert isinstance(redis_stores.work, RedisWorkIndex)
    return redis_stores.work


async def _members(client: Redis, prefix: str, name: str) -> list[str]:
    return [m.decode() for m in await client.zrange(f"{prefix}work:{name}", 0, -1)]


async def test_open_redis_stores_carries_a_work_index_under_its_prefix(
    redis_url: str, redis_prefix: str
) -> None:
    stores = open_redis_stores(redis_url)
    try:
        assert isinstance(stores.work, RedisWorkIndex)
        assert stores.work.prefix == redis_prefix
    finally:
        await stores.aclose()


async def test_done_and_parked_runs_are_in_no_due_index_and_a_delayed_one_waits_apart(
    redis_stores: Stores, redis_client: Redis, redis_prefix: str
) -> None:
    work = _index(redis_stores)
    await work.submit(T, "s", agent=A, input=b"")
    await work.want(T, "w", agent=A)
    await work.want(T, "d", agent=A, state=WorkState.decided)
    await work.want(T, "p", agent=A)
    await work.park(T, "p", agent=A, reason="in doubt")
    await work.want(T, "f", agent=A)
    await work.done(T, "f")
    await work.want(T, "later", agent=A, delay=0.3)
    assert await _members(redis_client, redis_prefix, "due:decided") == ["acme:d"]
    assert await _members(redis_client, redis_prefix, "due:wanted") == ["acme:w"]
    assert await _members(redis_client, redis_prefix, "due:submitted") == ["acme:s"]
    assert await _members(redis_client, redis_prefix, "delayed") == ["acme:later"]
    # Every entry is listed for operators, done ones too.
    assert len(await _members(redis_client, redis_prefix, "runs")) == 6
    await asyncio.sleep(0.5)
    assert [i.run_id for i in await work.due(limit=10)] == ["d", "w", "later", "s"]
    # The delayed run moved to its state's index once its time came.
    assert await _members(redis_client, redis_prefix, "delayed") == []
    assert sorted(await _members(redis_client, redis_prefix, "due:wanted")) == [
        "acme:later",
        "acme:w",
    ]


async def test_a_head_of_carried_runs_longer_than_the_scan_does_not_hide_the_next_state(
    redis_stores: Stores, redis_client: Redis, redis_prefix: str
) -> None:
    work = RedisWorkIndex(redis_client, prefix=redis_prefix, allow_volatile=True, scan=5)
    for n in range(20):
        await work.want(T, f"carried-{n:02}", agent=A)
        await redis_stores.leases.acquire(T, f"carried-{n:02}", "worker-a", LONG)
    await work.want(T, "free-but-far-back", agent=A)
    await work.submit(T, "new", agent=A, input=b"")
    # Each state's index is examined up to limit + scan entries: the wanted run behind
    # twenty carried ones is past that, the submitted run is in an index of its own.
    assert [i.run_id for i in await work.due(limit=1)] == ["new"]
    # A scan that reaches past the carried runs finds the free one first, as ordered.
    wide = RedisWorkIndex(redis_client, prefix=redis_prefix, allow_volatile=True, scan=50)
    assert [i.run_id for i in await wide.due(limit=2)] == ["free-but-far-back", "new"]


async def test_a_scan_below_one_is_refused(redis_client: Redis, redis_prefix: str) -> None:
    with pytest.raises(ValueError, match="scan"):
        RedisWorkIndex(redis_client, prefix=redis_prefix, scan=0)


@pytest.mark.parametrize(
    ("field", "value"),
    [("state", "bogus"), ("since", "yesterday"), ("attempts", "many")],
)
async def test_a_damaged_entry_is_a_typed_error_and_left_out_of_a_poll(
    redis_stores: Stores, redis_client: Redis, redis_prefix: str, field: str, value: str
) -> None:
    work = _index(redis_stores)
    await work.want(T, "r1", agent=A)
    await work.want(T, "r2", agent=A)
    await redis_client.hset(f"{redis_prefix}{{acme:r1}}:work", field, value)
    with pytest.raises(CheckpointCorruptError, match="work index entry"):
        await work.items(T)  # an operator's listing says so
    # A worker's poll leaves it out (naming it in the log) and still finds the other.
    assert [i.run_id for i in await work.due(limit=10)] == ["r2"]


async def test_an_entry_that_is_not_a_hash_is_a_typed_error(
    redis_stores: Stores, redis_client: Redis, redis_prefix: str
) -> None:
    work = _index(redis_stores)
    await redis_client.set(f"{redis_prefix}{{acme:r1}}:work", b"not a hash")
    with pytest.raises(CheckpointCorruptError):
        await work.submit(T, "r1", agent=A, input=b"")
    with pytest.raises(CheckpointCorruptError):
        await work.input(T, "r1")


async def test_a_resent_submission_answers_as_the_first_did(
    redis_stores: Stores, redis_prefix: str
) -> None:
    # redis-py sends a script again when its reply was lost: the resend must still say the
    # run was recorded, and another client's submission must still be told it was not.
    work = _index(redis_stores)
    token = secrets.token_hex(8)
    keys = [
        f"{redis_prefix}{{acme:r1}}:work",
        f"{redis_prefix}work:due:submitted",
        f"{redis_prefix}work:runs",
    ]
    args = ["acme:r1", T, "r1", A, b"input", token]
    assert await work._submit(keys=keys, args=args) == 1
    assert await work._submit(keys=keys, args=args) == 1
    assert await work.submit(T, "r1", agent=A, input=b"other") is False
    assert await work.input(T, "r1") == b"input"


async def test_a_resent_retry_counts_one_attempt(redis_stores: Stores, redis_prefix: str) -> None:
    work = _index(redis_stores)
    keys = [
        f"{redis_prefix}{{acme:r1}}:work",
        *(f"{redis_prefix}work:due:{s}" for s in ("decided", "wanted", "submitted")),
        f"{redis_prefix}work:delayed",
        f"{redis_prefix}work:runs",
    ]
    args = ["acme:r1", T, "r1", A, "wanted", str(60_000_000), "0", "", secrets.token_hex(8)]
    await work._want(keys=keys, args=args)
    await work._want(keys=keys, args=args)
    (item,) = await work.items(T)
    assert item.attempts == 1
