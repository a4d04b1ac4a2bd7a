"""Ttl claims: renewed by their holder, absent once expired, read on the store's clock."""

from __future__ import annotations

import time

import pytest

from tesserix_adk.errors import StaleFenceError
from tesserix_adk.stores.protocols import IdempotencyStore, RecordStatus
from tesserix_adk.testing._support import ClockedConformance
from tesserix_adk.testing.clock import FakeClock
from tesserix_adk.testing.idempotency_store._common import R, T, _claim, _run_claim

__all__ = ["ExpiryChecks"]


class ExpiryChecks(ClockedConformance):
    """Ttl claims: renewed by their holder, absent once expired, read on the store's clock."""

    async def test_claim_by_the_same_holder_renews_its_ttl(
        self, idempotency_store: IdempotencyStore, clock: FakeClock | None
    ) -> None:
        ttl = 2 * self.short_ttl
        first = await _run_claim(idempotency_store, "run", "worker-a", ttl=ttl)
        await self.let_pass(clock, 0.6 * ttl)
        renewed = await _run_claim(idempotency_store, "run", "worker-a", ttl=ttl)
        assert renewed.holder == "worker-a"
        assert renewed.expires_at is not None and first.expires_at is not None
        assert renewed.expires_at > first.expires_at
        await self.let_pass(clock, 0.6 * ttl)
        # Past the first expiry, within the renewed one.
        assert (await idempotency_store.lookup(["run"], tenant=T))["run"].holder == "worker-a"
        theirs = await _run_claim(idempotency_store, "run", "worker-b", ttl=ttl)
        assert theirs.holder == "worker-a"

    async def test_expired_ttl_claim_is_absent(
        self, idempotency_store: IdempotencyStore, clock: FakeClock | None
    ) -> None:
        await _run_claim(idempotency_store, "run", "worker-a", ttl=self.short_ttl)
        await self.let_pass(clock, self.past_short_ttl)
        assert await idempotency_store.lookup(["run"], tenant=T) == {}
        assert await idempotency_store.records(T, R) == []
        with pytest.raises(KeyError):
            await idempotency_store.resolve("run", never_ran=True, tenant=T, by="operator")
        fresh = await _run_claim(idempotency_store, "run", "worker-b", ttl=30)
        assert fresh.status is RecordStatus.in_flight
        assert fresh.holder == "worker-b"

    async def test_expired_ttl_claim_cannot_be_completed(
        self, idempotency_store: IdempotencyStore, clock: FakeClock | None
    ) -> None:
        await _run_claim(idempotency_store, "run", "worker-a", ttl=self.short_ttl)
        await self.let_pass(clock, self.past_short_ttl)
        with pytest.raises(StaleFenceError):
            await idempotency_store.complete("run", b"late", tenant=T, holder="worker-a")

    async def test_tool_call_claim_without_ttl_never_expires(
        self, idempotency_store: IdempotencyStore, clock: FakeClock | None
    ) -> None:
        await _claim(idempotency_store, "k1", "worker-a")
        await self.let_pass(
            clock, 365 * 86400.0 if self.moves_clock(clock) else self.past_short_ttl
        )
        found = await idempotency_store.lookup(["k1"], tenant=T)
        assert found["k1"].status is RecordStatus.in_flight
        assert found["k1"].holder == "worker-a"

    async def test_completed_run_claim_does_not_expire(
        self, idempotency_store: IdempotencyStore, clock: FakeClock | None
    ) -> None:
        await _run_claim(idempotency_store, "run", "worker-a", ttl=self.short_ttl)
        await idempotency_store.complete("run", b"finished", tenant=T, holder="worker-a")
        await self.let_pass(clock, self.past_short_ttl)
        found = await idempotency_store.lookup(["run"], tenant=T)
        assert found["run"].status is RecordStatus.completed
        assert found["run"].outcome == b"finished"

    async def test_caller_clock_an_hour_off_changes_nothing(
        self,
        idempotency_store: IdempotencyStore,
        clock: FakeClock | None,
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        real_time = time.time
        await _run_claim(idempotency_store, "live", "worker-a", ttl=3600)
        await _run_claim(idempotency_store, "lapsing", "worker-a", ttl=self.short_ttl)
        await self.let_pass(clock, self.past_short_ttl)
        for skew in (3600.0, -3600.0):
            monkeypatch.setattr(time, "time", lambda skew=skew: real_time() + skew)
            taken = await _run_claim(idempotency_store, "live", "worker-b", ttl=30)
            assert taken.holder == "worker-a"
            assert set(await idempotency_store.lookup(["live", "lapsing"], tenant=T)) == {"live"}
