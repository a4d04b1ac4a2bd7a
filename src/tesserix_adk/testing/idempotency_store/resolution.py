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

    async def test_resolve_for_a_holder_settles_only_that_holders_claim(
        self, idempotency_store: IdempotencyStore
    ) -> None:
        """``holder=``: the answer is about the claim the caller saw, and is refused once
        that claim was settled and taken again by someone else."""
        first = await _claim(idempotency_store, "k1", "worker-a", fence=1)
        with pytest.raises(ValueError):
            await idempotency_store.resolve(
                "k1", never_ran=True, tenant=T, by="reconciler:x", holder="worker-b"
            )
        assert (await idempotency_store.lookup(["k1"], tenant=T))["k1"] == first
        await idempotency_store.resolve("k1", never_ran=True, tenant=T, by="ops", holder="worker-a")
        again = await _claim(idempotency_store, "k1", "worker-b", fence=2)
        with pytest.raises(ValueError):
            await idempotency_store.resolve(
                "k1", b"done", tenant=T, by="reconciler:x", holder="worker-a"
            )
        assert (await idempotency_store.lookup(["k1"], tenant=T))["k1"] == again
        done = await idempotency_store.resolve(
            "k1", b"done", tenant=T, by="reconciler:x", holder="worker-b"
        )
        assert (done.status, done.outcome) == (RecordStatus.completed, b"done")

    async def test_a_call_sent_again_keeps_who_said_it_never_ran(
        self, idempotency_store: IdempotencyStore
    ) -> None:
        """The word that let a call go out a second time stays on its record: through the
        new claim, its outcome, and another operator's word after a second loss."""
        await _claim(idempotency_store, "k1", "worker-a", fence=1)
        await idempotency_store.resolve("k1", never_ran=True, tenant=T, by="alice")
        again = await _claim(idempotency_store, "k1", "worker-b", fence=2)
        assert (again.status, again.by, again.never_ran_by) == (
            RecordStatus.in_flight,
            None,
            "alice",
        )
        done = await idempotency_store.complete("k1", b"booked", tenant=T, holder="worker-b")
        assert (done.by, done.never_ran_by) == (None, "alice")
        assert (await idempotency_store.lookup(["k1"], tenant=T))["k1"] == done
        await _claim(idempotency_store, "k2", "worker-a", fence=2)
        await idempotency_store.resolve("k2", never_ran=True, tenant=T, by="alice")
        await _claim(idempotency_store, "k2", "worker-b", fence=3)
        bob = await idempotency_store.resolve("k2", never_ran=True, tenant=T, by="bob")
        assert (bob.by, bob.never_ran_by) == ("bob", "alice")
        third = await _claim(idempotency_store, "k2", "worker-c", fence=4)
        assert (third.by, third.never_ran_by) == (None, "bob")
        fresh = await _claim(idempotency_store, "k3", "worker-a", fence=4)
        assert fresh.never_ran_by is None

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
