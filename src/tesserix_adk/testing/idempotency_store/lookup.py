"""Look-up: the live records of the keys asked (in one batched call), and a run's records."""

from __future__ import annotations

import dataclasses

import pytest

from tesserix_adk.errors import StaleFenceError
from tesserix_adk.stores.protocols import IdempotencyStore, RecordsFrom, RecordStatus
from tesserix_adk.testing._support import ClockedConformance
from tesserix_adk.testing.clock import FakeClock
from tesserix_adk.testing.costs import check_lookup_is_batched, check_plan_calls
from tesserix_adk.testing.counting import round_trips_of
from tesserix_adk.testing.idempotency_store._common import R, T, _claim, _run_claim

__all__ = ["LookupChecks"]


class LookupChecks(ClockedConformance):
    """Look-up: the live records of the keys asked (in one batched call), and a run's records."""

    async def test_lookup_is_one_batched_call(
        self, idempotency_store: IdempotencyStore, request: pytest.FixtureRequest
    ) -> None:
        await check_lookup_is_batched(idempotency_store, await round_trips_of(request))

    async def test_a_resume_plan_takes_at_most_two_store_calls(
        self, idempotency_store: IdempotencyStore
    ) -> None:
        await check_plan_calls(idempotency_store)

    async def test_lookup_returns_the_live_records_of_the_keys_asked(
        self, idempotency_store: IdempotencyStore, clock: FakeClock | None
    ) -> None:
        await _claim(idempotency_store, "in-flight", "worker-a")
        await _claim(idempotency_store, "done", "worker-a")
        await idempotency_store.complete("done", b"x", tenant=T, holder="worker-a")
        await _run_claim(idempotency_store, "lapsed", "worker-a", ttl=self.short_ttl)
        await self.let_pass(clock, self.past_short_ttl)
        found = await idempotency_store.lookup(["in-flight", "absent", "done", "lapsed"], tenant=T)
        assert set(found) == {"in-flight", "done"}
        assert found["in-flight"].status is RecordStatus.in_flight
        assert found["done"].status is RecordStatus.completed
        assert await idempotency_store.lookup([], tenant=T) == {}

    async def test_records_find_a_key_another_run_named_first(
        self, idempotency_store: IdempotencyStore
    ) -> None:
        # A custom key reused across runs: run A's claim is refused by its fence and
        # stores nothing; run B then claims the same key, and B's records list it.
        await idempotency_store.seal(T, "run-a", 5)
        with pytest.raises(StaleFenceError):
            await _claim(idempotency_store, "order-42", "worker-a", run_id="run-a", fence=1)
        mine = await _claim(idempotency_store, "order-42", "worker-b", run_id="run-b", fence=1)
        assert mine.run_id == "run-b" and mine.holder == "worker-b"
        assert [r.key for r in await idempotency_store.records(T, "run-b")] == ["order-42"]
        assert await idempotency_store.records(T, "run-a") == []

    async def test_records_lists_every_live_record_of_the_run_in_order(
        self, idempotency_store: IdempotencyStore
    ) -> None:
        await _claim(idempotency_store, "k-second", "worker-a", iteration=2, call_id="c2")
        await _claim(idempotency_store, "k-first", "worker-a", iteration=1, call_id="c1")
        await _run_claim(idempotency_store, "run", "worker-a", ttl=30)
        await _claim(idempotency_store, "other-run", "worker-a", run_id="run-2")
        records = await idempotency_store.records(T, R)
        assert [r.key for r in records] == ["run", "k-first", "k-second"]
        assert await idempotency_store.records(T, "nobody") == []

    async def test_records_from_an_iteration_leave_out_earlier_ones_and_outcomes(
        self, idempotency_store: IdempotencyStore
    ) -> None:
        if not isinstance(idempotency_store, RecordsFrom):
            pytest.skip(f"{type(idempotency_store).__name__} does not offer RecordsFrom")
        await _run_claim(idempotency_store, "the-run", "worker-a", ttl=300)
        for iteration in range(5):
            key = f"call-{iteration}"
            await _claim(idempotency_store, key, "worker-a", iteration=iteration)
            if iteration % 2 == 0:
                await idempotency_store.complete(key, b"booked", tenant=T, holder="worker-a")
        found = await idempotency_store.records_from(T, R, 2)
        assert [(r.key, r.status) for r in found] == [
            ("call-2", RecordStatus.completed),
            ("call-3", RecordStatus.in_flight),
            ("call-4", RecordStatus.completed),
        ]
        assert all(r.outcome is None for r in found)
        whole = {r.key: r for r in await idempotency_store.records(T, R)}
        for record in found:
            assert record == dataclasses.replace(whole[record.key], outcome=None)
        assert await idempotency_store.records_from(T, R, 5) == []
        assert await idempotency_store.records_from("another tenant", R, 0) == []
