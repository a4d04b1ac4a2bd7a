"""The conformance suite every ``CheckpointStore`` passes."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import pytest

from tesserix_adk.errors import StaleFenceError
from tesserix_adk.stores.capabilities import run_listing, step_history
from tesserix_adk.stores.protocols import (
    CheckpointStore,
    FencedStore,
    RunListing,
    StepHistory,
    StoredCheckpoint,
)
from tesserix_adk.testing._support import JOIN_ALIKE_IDS, ODD_IDS
from tesserix_adk.testing.costs import check_reads_are_constant
from tesserix_adk.testing.counting import round_trips_of

__all__ = ["CheckpointStoreConformance", "MakeCheckpointStore"]

MakeCheckpointStore = Callable[[int], Awaitable[CheckpointStore]]
"""Builds a fresh, empty store that keeps the last ``keep_last`` steps."""

T = "acme"
R = "run-1"


def _skip_without(store: object, capability: type) -> None:
    if not isinstance(store, capability):
        pytest.skip(f"{type(store).__name__} does not offer {capability.__name__}")


def steps_of(store: CheckpointStore) -> StepHistory:
    """The store's step snapshots (the test skips without them)."""
    _skip_without(store, StepHistory)
    return step_history(store)


def runs_of(store: CheckpointStore) -> RunListing:
    """The store's run listing (the test skips without it)."""
    _skip_without(store, RunListing)
    return run_listing(store)


class CheckpointStoreConformance:
    """Subclass this in a test module to check a ``CheckpointStore``.

    Provide two fixtures (in the subclass, a conftest or the module):

    - ``checkpoint_store``: a fresh, empty store without retention;
    - ``make_checkpoint_store``: an async callable ``make(keep_last)`` building a fresh,
      empty store that keeps the ``keep_last`` highest steps.

    Tear down whatever they build in the fixtures themselves. Optionally ``round_trips``:
    a ``testing.counting.RoundTrips`` wired to the store's driver, or ``None``; without one
    the tests of requests sent skip, saying why.
    """

    async def test_store_satisfies_the_protocol(self, checkpoint_store: CheckpointStore) -> None:
        assert isinstance(checkpoint_store, CheckpointStore)
        assert isinstance(checkpoint_store, FencedStore)

    async def test_put_then_latest_returns_what_was_put(
        self, checkpoint_store: CheckpointStore
    ) -> None:
        await checkpoint_store.put(T, R, b"frontier", step=1, fence=3)
        assert await checkpoint_store.latest(T, R) == StoredCheckpoint(
            payload=b"frontier", step=1, fence=3
        )

    async def test_unfenced_put_is_kept_without_a_fence(
        self, checkpoint_store: CheckpointStore
    ) -> None:
        await checkpoint_store.put(T, R, b"frontier", step=0)
        assert await checkpoint_store.latest(T, R) == StoredCheckpoint(
            payload=b"frontier", step=0, fence=None
        )

    async def test_payload_bytes_round_trip_exactly(
        self, checkpoint_store: CheckpointStore
    ) -> None:
        every_byte = bytes(range(256)) * 4
        await checkpoint_store.put(T, R, every_byte, step=1)
        await checkpoint_store.put(T, "empty", b"", step=1)
        latest = await checkpoint_store.latest(T, R)
        empty = await checkpoint_store.latest(T, "empty")
        assert latest is not None and latest.payload == every_byte
        assert empty is not None and empty.payload == b""

    async def test_latest_of_an_unknown_run_is_none(
        self, checkpoint_store: CheckpointStore
    ) -> None:
        assert await checkpoint_store.latest(T, "nobody") is None

    async def test_missing_step_is_none(self, checkpoint_store: CheckpointStore) -> None:
        await checkpoint_store.put(T, R, b"one", step=1)
        await checkpoint_store.put(T, R, b"three", step=3)
        assert await steps_of(checkpoint_store).at(T, R, 2) is None
        assert await steps_of(checkpoint_store).at(T, R, 4) is None
        assert await steps_of(checkpoint_store).at(T, "nobody", 1) is None

    async def test_at_returns_the_snapshot_of_that_step(
        self, checkpoint_store: CheckpointStore
    ) -> None:
        await checkpoint_store.put(T, R, b"one", step=1, fence=1)
        await checkpoint_store.put(T, R, b"two", step=2, fence=1)
        assert await steps_of(checkpoint_store).at(T, R, 1) == StoredCheckpoint(
            payload=b"one", step=1, fence=1
        )
        assert await steps_of(checkpoint_store).at(T, R, 2) == StoredCheckpoint(
            payload=b"two", step=2, fence=1
        )

    async def test_latest_is_the_last_accepted_put_whatever_its_step(
        self, checkpoint_store: CheckpointStore
    ) -> None:
        await checkpoint_store.put(T, R, b"five", step=5, fence=1)
        await checkpoint_store.put(T, R, b"three", step=3, fence=1)
        latest = await checkpoint_store.latest(T, R)
        assert latest is not None
        assert (latest.payload, latest.step) == (b"three", 3)

    async def test_at_is_the_last_write_under_that_step(
        self, checkpoint_store: CheckpointStore
    ) -> None:
        await checkpoint_store.put(T, R, b"first", step=2, fence=1)
        await checkpoint_store.put(T, R, b"second", step=2, fence=2)
        at = await steps_of(checkpoint_store).at(T, R, 2)
        assert at == StoredCheckpoint(payload=b"second", step=2, fence=2)
        assert await steps_of(checkpoint_store).steps(T, R) == [2]

    async def test_steps_are_ascending(self, checkpoint_store: CheckpointStore) -> None:
        for step in (3, 1, 10, 2):
            await checkpoint_store.put(T, R, b"x", step=step)
        assert await steps_of(checkpoint_store).steps(T, R) == [1, 2, 3, 10]

    async def test_steps_of_an_unknown_run_are_empty(
        self, checkpoint_store: CheckpointStore
    ) -> None:
        assert await steps_of(checkpoint_store).steps(T, "nobody") == []

    async def test_store_without_retention_keeps_every_step(
        self, checkpoint_store: CheckpointStore
    ) -> None:
        for step in range(30):
            await checkpoint_store.put(T, R, b"x", step=step)
        assert await steps_of(checkpoint_store).steps(T, R) == list(range(30))

    async def test_runs_lists_runs_with_a_frontier_sorted(
        self, checkpoint_store: CheckpointStore
    ) -> None:
        for run_id in ("run-b", "run-c", "run-a"):
            await checkpoint_store.put(T, run_id, b"x", step=0)
        assert await runs_of(checkpoint_store).runs(T) == ["run-a", "run-b", "run-c"]
        assert await runs_of(checkpoint_store).runs("other") == []

    async def test_forget_removes_the_frontier_and_the_steps(
        self, checkpoint_store: CheckpointStore
    ) -> None:
        await checkpoint_store.put(T, R, b"one", step=1)
        await checkpoint_store.put(T, R, b"two", step=2)
        await checkpoint_store.put(T, "kept", b"kept", step=1)
        await checkpoint_store.forget(T, R)
        assert await checkpoint_store.latest(T, R) is None
        assert await steps_of(checkpoint_store).at(T, R, 1) is None
        assert await steps_of(checkpoint_store).steps(T, R) == []
        assert await runs_of(checkpoint_store).runs(T) == ["kept"]

    async def test_forget_of_an_unknown_run_is_a_no_op(
        self, checkpoint_store: CheckpointStore
    ) -> None:
        await checkpoint_store.forget(T, "nobody")
        assert await runs_of(checkpoint_store).runs(T) == []

    async def test_forget_keeps_the_fence(self, checkpoint_store: CheckpointStore) -> None:
        await checkpoint_store.put(T, R, b"x", step=1, fence=5)
        await checkpoint_store.forget(T, R)
        with pytest.raises(StaleFenceError):
            await checkpoint_store.put(T, R, b"old", step=1, fence=4)
        with pytest.raises(StaleFenceError):
            await checkpoint_store.put(T, R, b"unfenced", step=1)
        assert await checkpoint_store.latest(T, R) is None
        await checkpoint_store.put(T, R, b"new", step=2, fence=5)
        latest = await checkpoint_store.latest(T, R)
        assert latest is not None and latest.payload == b"new"

    async def test_stale_fence_is_refused_on_put(self, checkpoint_store: CheckpointStore) -> None:
        await checkpoint_store.put(T, R, b"new holder", step=2, fence=7)
        with pytest.raises(StaleFenceError):
            await checkpoint_store.put(T, R, b"old holder", step=3, fence=6)

    async def test_refused_put_changes_nothing(self, checkpoint_store: CheckpointStore) -> None:
        await checkpoint_store.put(T, R, b"new holder", step=2, fence=7)
        with pytest.raises(StaleFenceError):
            await checkpoint_store.put(T, R, b"old holder", step=3, fence=6)
        assert await checkpoint_store.latest(T, R) == StoredCheckpoint(
            payload=b"new holder", step=2, fence=7
        )
        assert await steps_of(checkpoint_store).steps(T, R) == [2]

    async def test_same_and_higher_fences_are_accepted(
        self, checkpoint_store: CheckpointStore
    ) -> None:
        await checkpoint_store.put(T, R, b"a", step=1, fence=2)
        await checkpoint_store.put(T, R, b"b", step=2, fence=2)
        await checkpoint_store.put(T, R, b"c", step=3, fence=9)
        with pytest.raises(StaleFenceError):
            await checkpoint_store.put(T, R, b"d", step=4, fence=8)
        latest = await checkpoint_store.latest(T, R)
        assert latest is not None and latest.payload == b"c"

    async def test_unfenced_puts_are_accepted_before_any_fence(
        self, checkpoint_store: CheckpointStore
    ) -> None:
        await checkpoint_store.put(T, R, b"a", step=1)
        await checkpoint_store.put(T, R, b"b", step=2)
        await checkpoint_store.put(T, R, b"c", step=3, fence=1)
        assert await steps_of(checkpoint_store).steps(T, R) == [1, 2, 3]

    async def test_unfenced_put_is_refused_once_a_fence_was_seen(
        self, checkpoint_store: CheckpointStore
    ) -> None:
        await checkpoint_store.put(T, R, b"fenced", step=1, fence=1)
        with pytest.raises(StaleFenceError):
            await checkpoint_store.put(T, R, b"unfenced", step=2)
        latest = await checkpoint_store.latest(T, R)
        assert latest is not None and latest.payload == b"fenced"

    async def test_fences_are_kept_per_run(self, checkpoint_store: CheckpointStore) -> None:
        await checkpoint_store.put(T, "run-a", b"a", step=1, fence=9)
        await checkpoint_store.put(T, "run-b", b"b", step=1, fence=1)
        await checkpoint_store.put(T, "run-c", b"c", step=1)
        assert await runs_of(checkpoint_store).runs(T) == ["run-a", "run-b", "run-c"]

    async def test_seal_refuses_writes_below_it_before_any_write(
        self, checkpoint_store: CheckpointStore
    ) -> None:
        await checkpoint_store.seal(T, R, 4)
        with pytest.raises(StaleFenceError):
            await checkpoint_store.put(T, R, b"old", step=1, fence=3)
        with pytest.raises(StaleFenceError):
            await checkpoint_store.put(T, R, b"unfenced", step=1)
        await checkpoint_store.put(T, R, b"sealer", step=1, fence=4)
        latest = await checkpoint_store.latest(T, R)
        assert latest is not None and latest.payload == b"sealer"

    async def test_seal_writes_no_data(self, checkpoint_store: CheckpointStore) -> None:
        await checkpoint_store.seal(T, R, 4)
        assert await checkpoint_store.latest(T, R) is None
        assert await steps_of(checkpoint_store).steps(T, R) == []
        assert await runs_of(checkpoint_store).runs(T) == []

    async def test_seal_is_idempotent(self, checkpoint_store: CheckpointStore) -> None:
        await checkpoint_store.seal(T, R, 4)
        await checkpoint_store.seal(T, R, 4)
        await checkpoint_store.put(T, R, b"x", step=1, fence=4)
        await checkpoint_store.seal(T, R, 4)

    async def test_seal_below_the_highest_seen_fence_raises(
        self, checkpoint_store: CheckpointStore
    ) -> None:
        await checkpoint_store.put(T, R, b"x", step=1, fence=6)
        with pytest.raises(StaleFenceError):
            await checkpoint_store.seal(T, R, 5)
        await checkpoint_store.seal(T, R, 7)
        with pytest.raises(StaleFenceError):
            await checkpoint_store.seal(T, R, 6)

    async def test_keep_last_keeps_the_newest_steps(
        self, make_checkpoint_store: MakeCheckpointStore
    ) -> None:
        store = await make_checkpoint_store(3)
        for step in range(1, 8):
            await store.put(T, R, f"step {step}".encode(), step=step, fence=1)
        assert await steps_of(store).steps(T, R) == [5, 6, 7]
        assert await steps_of(store).at(T, R, 4) is None
        at = await steps_of(store).at(T, R, 5)
        assert at is not None and at.payload == b"step 5"

    async def test_keep_last_keeps_the_highest_steps_not_the_latest_writes(
        self, make_checkpoint_store: MakeCheckpointStore
    ) -> None:
        store = await make_checkpoint_store(2)
        for step in (9, 8, 1, 7):
            await store.put(T, R, b"x", step=step)
        assert await steps_of(store).steps(T, R) == [8, 9]

    async def test_keep_last_keeps_the_frontier_even_when_its_step_is_pruned(
        self, make_checkpoint_store: MakeCheckpointStore
    ) -> None:
        store = await make_checkpoint_store(2)
        for step in (5, 6, 7):
            await store.put(T, R, b"ahead", step=step, fence=1)
        await store.put(T, R, b"rewound", step=1, fence=1)
        assert await store.latest(T, R) == StoredCheckpoint(payload=b"rewound", step=1, fence=1)
        assert await steps_of(store).steps(T, R) == [6, 7]
        assert await steps_of(store).at(T, R, 1) is None

    async def test_keep_last_is_per_run(self, make_checkpoint_store: MakeCheckpointStore) -> None:
        store = await make_checkpoint_store(2)
        for step in range(5):
            await store.put(T, "run-a", b"a", step=step)
        await store.put(T, "run-b", b"b", step=0)
        assert await steps_of(store).steps(T, "run-a") == [3, 4]
        assert await steps_of(store).steps(T, "run-b") == [0]

    async def test_tenants_do_not_see_each_other(self, checkpoint_store: CheckpointStore) -> None:
        await checkpoint_store.put("acme", R, b"acme's", step=1, fence=9)
        assert await checkpoint_store.latest("globex", R) is None
        assert await steps_of(checkpoint_store).at("globex", R, 1) is None
        assert await steps_of(checkpoint_store).steps("globex", R) == []
        assert await runs_of(checkpoint_store).runs("globex") == []
        # Fences too: another tenant's run of the same id starts unfenced.
        await checkpoint_store.put("globex", R, b"globex's", step=2, fence=1)
        await checkpoint_store.forget("globex", R)
        latest = await checkpoint_store.latest("acme", R)
        assert latest is not None and latest.payload == b"acme's"
        assert await runs_of(checkpoint_store).runs("acme") == [R]

    async def test_ids_with_odd_characters_are_kept_verbatim(
        self, checkpoint_store: CheckpointStore
    ) -> None:
        for tenant in ODD_IDS:
            for run_id in ODD_IDS:
                payload = f"{tenant}|{run_id}".encode()
                await checkpoint_store.put(tenant, run_id, payload, step=1, fence=1)
        for tenant in ODD_IDS:
            assert await runs_of(checkpoint_store).runs(tenant) == sorted(ODD_IDS)
            for run_id in ODD_IDS:
                latest = await checkpoint_store.latest(tenant, run_id)
                assert latest is not None
                assert latest.payload == f"{tenant}|{run_id}".encode()
        assert await runs_of(checkpoint_store).runs("a") == []

    async def test_ids_that_join_alike_do_not_collide(
        self, checkpoint_store: CheckpointStore
    ) -> None:
        for tenant, run_id in JOIN_ALIKE_IDS:
            await checkpoint_store.put(tenant, run_id, f"{tenant}|{run_id}".encode(), step=1)
        for tenant, run_id in JOIN_ALIKE_IDS:
            latest = await checkpoint_store.latest(tenant, run_id)
            assert latest is not None and latest.payload == f"{tenant}|{run_id}".encode()
            assert await steps_of(checkpoint_store).steps(tenant, run_id) == [1]

    async def test_reads_send_as_many_requests_however_many_steps_are_kept(
        self, checkpoint_store: CheckpointStore, request: pytest.FixtureRequest
    ) -> None:
        await check_reads_are_constant(checkpoint_store, await round_trips_of(request))
