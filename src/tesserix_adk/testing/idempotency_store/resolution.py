"""An operator's resolution of an in-flight call: an outcome, or ``never_ran``."""

from __future__ import annotations

import pytest

from tesserix_adk.stores.protocols import IdempotencyStore, RecordStatus
from tesserix_adk.testing._support import ClockedConformance
from tesserix_adk.testing.idempotency_store._common import T, _claim

__all__ = ["ResolutionChecks"]


class ResolutionChecks(ClockedConformance):
    """An operator's resolution of an in-flight call: an outcome, or ``never_ran``."""

    async def test_resolve_records_an_operator_outcome(
        self, idempotency_store: IdempotencyStore
    ) -> None:
        await _claim(idempotency_store, "k1", "worker-a")
        resolved = await idempotency_store.resolve("k1", b"booked by hand", tenant=T, by="ops@acme")
        assert resolved.status is RecordStatus.completed
        assert resolved.outcome == b"booked by hand"
        assert resolved.by == "ops@acme"
        assert resolved.completed_at is not None
        assert await _claim(idempotency_store, "k1", "worker-b") == resolved

    async def test_resolve_never_ran_lets_the_call_be_claimed_again(
        self, idempotency_store: IdempotencyStore
    ) -> None:
        await _claim(idempotency_store, "k1", "worker-a", fence=1)
        resolved = await idempotency_store.resolve("k1", never_ran=True, tenant=T, by="ops@acme")
        assert resolved.status is RecordStatus.never_ran
        assert resolved.by == "ops@acme"
        assert (await idempotency_store.lookup(["k1"], tenant=T))["k1"] == resolved
        again = await _claim(idempotency_store, "k1", "worker-b", fence=2)
        assert again.status is RecordStatus.in_flight
        assert again.holder == "worker-b"
        assert again.fence == 2

    async def test_resolve_of_an_unknown_key_raises_key_error(
        self, idempotency_store: IdempotencyStore
    ) -> None:
        with pytest.raises(KeyError):
            await idempotency_store.resolve("nothing", b"x", tenant=T, by="ops@acme")

    async def test_resolve_of_a_settled_record_raises_value_error(
        self, idempotency_store: IdempotencyStore
    ) -> None:
        await _claim(idempotency_store, "done", "worker-a")
        done = await idempotency_store.complete("done", b"x", tenant=T, holder="worker-a")
        await _claim(idempotency_store, "skipped", "worker-a")
        await idempotency_store.resolve("skipped", never_ran=True, tenant=T, by="ops@acme")
        for key in ("done", "skipped"):
            with pytest.raises(ValueError):
                await idempotency_store.resolve(key, b"y", tenant=T, by="ops@acme")
            with pytest.raises(ValueError):
                await idempotency_store.resolve(key, never_ran=True, tenant=T, by="ops@acme")
        assert (await idempotency_store.lookup(["done"], tenant=T))["done"] == done
