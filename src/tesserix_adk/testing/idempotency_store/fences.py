"""Fences: a stale claim is refused, ``seal`` raises the floor, each run keeps its own."""

from __future__ import annotations

import pytest

from tesserix_adk.errors import StaleFenceError
from tesserix_adk.stores.protocols import IdempotencyStore, RecordStatus
from tesserix_adk.testing._support import ClockedConformance
from tesserix_adk.testing.idempotency_store._common import R, T, _claim

__all__ = ["FenceChecks"]


class FenceChecks(ClockedConformance):
    """Fences: a stale claim is refused, ``seal`` raises the floor, each run keeps its own."""

    async def test_stale_fence_is_refused_on_claim(
        self, idempotency_store: IdempotencyStore
    ) -> None:
        await _claim(idempotency_store, "k1", "worker-b", fence=2)
        with pytest.raises(StaleFenceError):
            await _claim(idempotency_store, "k2", "worker-a", fence=1)
        assert await idempotency_store.lookup(["k2"], tenant=T) == {}

    async def test_fence_is_checked_before_anything_else_on_claim(
        self, idempotency_store: IdempotencyStore
    ) -> None:
        await _claim(idempotency_store, "done", "worker-b", fence=2)
        await idempotency_store.complete("done", b"x", tenant=T, holder="worker-b")
        await _claim(idempotency_store, "busy", "worker-b", fence=2)
        for key in ("done", "busy"):
            with pytest.raises(StaleFenceError):
                await _claim(idempotency_store, key, "worker-a", fence=1)
            with pytest.raises(StaleFenceError):
                await _claim(idempotency_store, key, "worker-a", fence=1, takeover=True)
        # Even the holder itself, once superseded, cannot renew with its old fence.
        with pytest.raises(StaleFenceError):
            await _claim(idempotency_store, "busy", "worker-b", fence=1)

    async def test_unfenced_claims_are_accepted_before_any_fence(
        self, idempotency_store: IdempotencyStore
    ) -> None:
        await _claim(idempotency_store, "k1", "worker-a")
        await _claim(idempotency_store, "k2", "worker-a", fence=1)
        assert set(await idempotency_store.lookup(["k1", "k2"], tenant=T)) == {"k1", "k2"}

    async def test_unfenced_claim_is_refused_once_a_fence_was_seen(
        self, idempotency_store: IdempotencyStore
    ) -> None:
        await _claim(idempotency_store, "k1", "worker-a", fence=1)
        with pytest.raises(StaleFenceError):
            await _claim(idempotency_store, "k2", "worker-a")
        assert await idempotency_store.lookup(["k2"], tenant=T) == {}

    async def test_seal_refuses_claims_below_it_before_any_claim(
        self, idempotency_store: IdempotencyStore
    ) -> None:
        await idempotency_store.seal(T, R, 5)
        with pytest.raises(StaleFenceError):
            await _claim(idempotency_store, "k1", "worker-a", fence=4)
        with pytest.raises(StaleFenceError):
            await _claim(idempotency_store, "k1", "worker-a")
        assert await idempotency_store.records(T, R) == []
        claimed = await _claim(idempotency_store, "k1", "worker-a", fence=5)
        assert claimed.status is RecordStatus.in_flight

    async def test_seal_is_idempotent_and_never_goes_back(
        self, idempotency_store: IdempotencyStore
    ) -> None:
        await idempotency_store.seal(T, R, 5)
        await idempotency_store.seal(T, R, 5)
        with pytest.raises(StaleFenceError):
            await idempotency_store.seal(T, R, 4)
        await _claim(idempotency_store, "k1", "worker-a", fence=6)
        with pytest.raises(StaleFenceError):
            await idempotency_store.seal(T, R, 5)

    async def test_fences_are_kept_per_run(self, idempotency_store: IdempotencyStore) -> None:
        await _claim(idempotency_store, "k1", "worker-a", run_id="run-a", fence=9)
        claimed = await _claim(idempotency_store, "k2", "worker-a", run_id="run-b", fence=1)
        assert claimed.status is RecordStatus.in_flight
