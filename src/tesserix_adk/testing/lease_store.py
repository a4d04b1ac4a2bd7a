"""The conformance suite every ``LeaseStore`` passes."""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import replace
from typing import ClassVar

import pytest

from tesserix_adk.errors import LeaseHeldError, LeaseLostError
from tesserix_adk.stores.protocols import LeaseStore, RunLease
from tesserix_adk.testing._support import JOIN_ALIKE_IDS, ODD_IDS, ClockedConformance
from tesserix_adk.testing.clock import FakeClock

__all__ = ["LeaseStoreConformance"]

T = "acme"
R = "run-1"
LONG = 3600.0


class LeaseStoreConformance(ClockedConformance):
    """Subclass this in a test module to check a ``LeaseStore``.

    Provide two fixtures (in the subclass, a conftest or the module):

    - ``lease_store``: a fresh, empty store;
    - ``clock``: the ``FakeClock`` injected into that store, or ``None`` when the store
      reads its own clock (a database or server clock); expiry tests then wait for real,
      for ``past_short_ttl`` seconds at a time. ``controls_clock = False`` forces real waits.

    ``lease_cycles`` acquire/expire cycles run with a clock the suite moves,
    ``real_clock_lease_cycles`` with a real one.
    """

    lease_cycles: ClassVar[int] = 1000
    real_clock_lease_cycles: ClassVar[int] = 3
    racers: ClassVar[int] = 50

    async def test_store_satisfies_the_protocol(self, lease_store: LeaseStore) -> None:
        assert isinstance(lease_store, LeaseStore)

    async def test_acquire_hands_the_run_to_the_holder(
        self, lease_store: LeaseStore, clock: FakeClock | None
    ) -> None:
        before = time.time()
        lease = await lease_store.acquire(T, R, "worker-a", 30)
        assert (lease.tenant, lease.run_id, lease.holder) == (T, R, "worker-a")
        assert isinstance(lease.fence, int)
        if clock is not None and self.moves_clock(clock):
            assert lease.expires_at == pytest.approx(clock() + 30)
        else:
            # A server clock may be a little off ours; it still counts epoch seconds.
            assert abs(lease.expires_at - (before + 30)) < 300
        assert await lease_store.current(T, R) == lease

    async def test_acquire_of_a_live_lease_is_refused_naming_the_holder(
        self, lease_store: LeaseStore
    ) -> None:
        lease = await lease_store.acquire(T, R, "worker-a", LONG)
        with pytest.raises(LeaseHeldError) as refused:
            await lease_store.acquire(T, R, "worker-b", LONG)
        assert refused.value.holder == "worker-a"
        assert await lease_store.current(T, R) == lease

    async def test_acquire_is_refused_also_for_the_holder_itself(
        self, lease_store: LeaseStore
    ) -> None:
        lease = await lease_store.acquire(T, R, "worker-a", LONG)
        with pytest.raises(LeaseHeldError) as refused:
            await lease_store.acquire(T, R, "worker-a", LONG)
        assert refused.value.holder == "worker-a"
        assert await lease_store.current(T, R) == lease

    async def test_expired_lease_can_be_taken_at_a_higher_fence(
        self, lease_store: LeaseStore, clock: FakeClock | None
    ) -> None:
        first = await lease_store.acquire(T, R, "worker-a", self.short_ttl)
        await self.let_pass(clock, self.past_short_ttl)
        second = await lease_store.acquire(T, R, "worker-b", LONG)
        assert second.holder == "worker-b"
        assert second.fence > first.fence
        assert first.superseded_by(second)
        assert not second.superseded_by(first)

    async def test_the_first_acquisition_follows_no_lease(self, lease_store: LeaseStore) -> None:
        lease = await lease_store.acquire(T, R, "worker-a", LONG)
        assert lease.previous_end is None

    async def test_an_acquisition_tells_when_the_lapsed_lease_before_it_ended(
        self, lease_store: LeaseStore, clock: FakeClock | None
    ) -> None:
        # The last renewal's deadline, not the first grant's: a holder that renewed could
        # dispatch until then.
        first = await lease_store.acquire(T, R, "worker-a", self.short_ttl)
        renewed = await lease_store.renew(first, self.short_ttl)
        await self.let_pass(clock, self.past_short_ttl)
        second = await lease_store.acquire(T, R, "worker-b", LONG)
        assert second.previous_end == pytest.approx(renewed.expires_at, abs=1e-3)
        assert second.previous_end is not None
        assert second.previous_end <= second.expires_at - LONG + 1e-3

    async def test_an_acquisition_after_a_release_tells_when_it_was_released(
        self, lease_store: LeaseStore, clock: FakeClock | None
    ) -> None:
        first = await lease_store.acquire(T, R, "worker-a", LONG)
        await self.let_pass(clock, 0.2 * self.short_ttl)
        await lease_store.release(first)
        second = await lease_store.acquire(T, R, "worker-b", LONG)
        assert second.previous_end is not None
        # Released, not lapsed: it ended at the release, long before its deadline.
        assert first.expires_at - LONG - 1e-3 <= second.previous_end < first.expires_at - 1
        assert second.previous_end <= second.expires_at - LONG + 1e-3
        if clock is not None and self.moves_clock(clock):
            assert second.previous_end == pytest.approx(
                first.expires_at - LONG + 0.2 * self.short_ttl
            )

    async def test_the_end_of_the_previous_lease_is_not_part_of_a_lease_identity(
        self, lease_store: LeaseStore, clock: FakeClock | None
    ) -> None:
        first = await lease_store.acquire(T, R, "worker-a", self.short_ttl)
        await self.let_pass(clock, self.past_short_ttl)
        second = await lease_store.acquire(T, R, "worker-b", LONG)
        assert second.previous_end is not None
        assert await lease_store.current(T, R) == second
        assert await lease_store.renew(second, LONG) != first

    async def test_ended_ago_tells_how_long_ago_the_last_lease_ended_and_changes_nothing(
        self, lease_store: LeaseStore, clock: FakeClock | None
    ) -> None:
        assert await lease_store.ended_ago(T, R) is None
        await lease_store.acquire(T, R, "worker-a", self.short_ttl)
        assert await lease_store.ended_ago(T, R) is None  # live: it has not ended
        await self.let_pass(clock, self.past_short_ttl)
        lapsed = await lease_store.ended_ago(T, R)
        assert lapsed is not None
        assert 0 < lapsed <= self.past_short_ttl
        later = await lease_store.ended_ago(T, R)
        assert later is not None and later >= lapsed  # a read moves nothing
        second = await lease_store.acquire(T, R, "worker-b", LONG)
        assert second.previous_end is not None
        assert await lease_store.ended_ago(T, R) is None
        await self.let_pass(clock, 0.2 * self.short_ttl)
        await lease_store.release(second)
        released = await lease_store.ended_ago(T, R)
        # Released, not lapsed: it ended just now, long before its deadline.
        assert released is not None and 0 <= released < 1
        assert await lease_store.current(T, R) is None

    async def test_fence_rises_after_expiry_and_after_release(
        self, lease_store: LeaseStore, clock: FakeClock | None
    ) -> None:
        first = await lease_store.acquire(T, R, "worker-a", self.short_ttl)
        await self.let_pass(clock, self.past_short_ttl)
        second = await lease_store.acquire(T, R, "worker-a", LONG)
        await lease_store.release(second)
        third = await lease_store.acquire(T, R, "worker-a", LONG)
        assert first.fence < second.fence < third.fence

    async def test_renew_keeps_the_fence_and_extends_the_lease(
        self, lease_store: LeaseStore, clock: FakeClock | None
    ) -> None:
        ttl = 2 * self.short_ttl
        lease = await lease_store.acquire(T, R, "worker-a", ttl)
        await self.let_pass(clock, 0.6 * ttl)
        renewed = await lease_store.renew(lease, ttl)
        assert renewed.fence == lease.fence
        assert renewed.holder == "worker-a"
        assert renewed.expires_at > lease.expires_at
        await self.let_pass(clock, 0.6 * ttl)
        # Past the first expiry, within the renewed one.
        assert await lease_store.current(T, R) == renewed
        with pytest.raises(LeaseHeldError):
            await lease_store.acquire(T, R, "worker-b", ttl)
        assert (await lease_store.renew(renewed, ttl)).fence == lease.fence

    async def test_renew_after_expiry_fails_even_if_nobody_took_it(
        self, lease_store: LeaseStore, clock: FakeClock | None
    ) -> None:
        lease = await lease_store.acquire(T, R, "worker-a", self.short_ttl)
        await self.let_pass(clock, self.past_short_ttl)
        with pytest.raises(LeaseLostError):
            await lease_store.renew(lease, LONG)
        assert await lease_store.current(T, R) is None

    async def test_renew_of_a_superseded_lease_fails(
        self, lease_store: LeaseStore, clock: FakeClock | None
    ) -> None:
        old = await lease_store.acquire(T, R, "worker-a", self.short_ttl)
        await self.let_pass(clock, self.past_short_ttl)
        new = await lease_store.acquire(T, R, "worker-b", LONG)
        with pytest.raises(LeaseLostError):
            await lease_store.renew(old, LONG)
        assert await lease_store.current(T, R) == new

    async def test_renew_of_a_superseded_lease_of_the_same_holder_fails(
        self, lease_store: LeaseStore, clock: FakeClock | None
    ) -> None:
        old = await lease_store.acquire(T, R, "worker-a", self.short_ttl)
        await self.let_pass(clock, self.past_short_ttl)
        new = await lease_store.acquire(T, R, "worker-a", LONG)
        with pytest.raises(LeaseLostError):
            await lease_store.renew(old, LONG)
        assert await lease_store.current(T, R) == new

    async def test_renew_of_a_lease_under_another_holder_name_fails(
        self, lease_store: LeaseStore
    ) -> None:
        lease = await lease_store.acquire(T, R, "worker-a", LONG)
        with pytest.raises(LeaseLostError):
            await lease_store.renew(replace(lease, holder="worker-b"), LONG)
        assert await lease_store.current(T, R) == lease

    async def test_renew_after_release_fails(self, lease_store: LeaseStore) -> None:
        lease = await lease_store.acquire(T, R, "worker-a", LONG)
        await lease_store.release(lease)
        with pytest.raises(LeaseLostError):
            await lease_store.renew(lease, LONG)
        assert await lease_store.current(T, R) is None

    async def test_renew_of_a_run_never_leased_fails(self, lease_store: LeaseStore) -> None:
        forged = RunLease(tenant=T, run_id=R, holder="worker-a", fence=1, expires_at=0.0)
        with pytest.raises(LeaseLostError):
            await lease_store.renew(forged, LONG)

    async def test_release_frees_the_run(self, lease_store: LeaseStore) -> None:
        lease = await lease_store.acquire(T, R, "worker-a", LONG)
        await lease_store.release(lease)
        assert await lease_store.current(T, R) is None
        other = await lease_store.acquire(T, R, "worker-b", LONG)
        assert other.fence > lease.fence

    async def test_release_by_a_superseded_holder_changes_nothing(
        self, lease_store: LeaseStore, clock: FakeClock | None
    ) -> None:
        old = await lease_store.acquire(T, R, "worker-a", self.short_ttl)
        await self.let_pass(clock, self.past_short_ttl)
        new = await lease_store.acquire(T, R, "worker-b", LONG)
        await lease_store.release(old)
        await lease_store.release(replace(new, holder="worker-a"))
        assert await lease_store.current(T, R) == new
        with pytest.raises(LeaseHeldError):
            await lease_store.acquire(T, R, "worker-c", LONG)

    async def test_release_twice_is_harmless(self, lease_store: LeaseStore) -> None:
        lease = await lease_store.acquire(T, R, "worker-a", LONG)
        await lease_store.release(lease)
        await lease_store.release(lease)
        assert await lease_store.current(T, R) is None

    async def test_current_of_a_run_never_leased_is_none(self, lease_store: LeaseStore) -> None:
        assert await lease_store.current(T, "nobody") is None

    async def test_current_is_none_once_the_lease_expired(
        self, lease_store: LeaseStore, clock: FakeClock | None
    ) -> None:
        await lease_store.acquire(T, R, "worker-a", self.short_ttl)
        await self.let_pass(clock, self.past_short_ttl)
        assert await lease_store.current(T, R) is None

    async def test_concurrent_acquires_have_exactly_one_winner(
        self, lease_store: LeaseStore
    ) -> None:
        results = await asyncio.gather(
            *(lease_store.acquire(T, R, f"worker-{i}", LONG) for i in range(self.racers)),
            return_exceptions=True,
        )
        winners = [r for r in results if isinstance(r, RunLease)]
        refusals = [r for r in results if isinstance(r, LeaseHeldError)]
        assert len(winners) == 1, results
        assert len(refusals) == self.racers - 1, results
        assert {r.holder for r in refusals} == {winners[0].holder}
        assert await lease_store.current(T, R) == winners[0]

    async def test_fences_rise_strictly_over_many_acquire_expire_cycles(
        self, lease_store: LeaseStore, clock: FakeClock | None
    ) -> None:
        cycles = self.lease_cycles if self.moves_clock(clock) else self.real_clock_lease_cycles
        fences: list[int] = []
        for i in range(cycles):
            lease = await lease_store.acquire(T, R, f"worker-{i % 3}", self.short_ttl)
            fences.append(lease.fence)
            await self.let_pass(clock, self.past_short_ttl)
        assert all(a < b for a, b in itertools.pairwise(fences)), fences

    async def test_runs_are_leased_independently(self, lease_store: LeaseStore) -> None:
        a = await lease_store.acquire(T, "run-a", "worker-a", LONG)
        b = await lease_store.acquire(T, "run-b", "worker-b", LONG)
        assert await lease_store.current(T, "run-a") == a
        assert await lease_store.current(T, "run-b") == b
        assert not a.superseded_by(b)

    async def test_tenants_do_not_see_each_other(self, lease_store: LeaseStore) -> None:
        acme = await lease_store.acquire("acme", R, "worker-a", LONG)
        globex = await lease_store.acquire("globex", R, "worker-b", LONG)
        assert await lease_store.current("acme", R) == acme
        assert await lease_store.current("globex", R) == globex
        await lease_store.release(globex)
        assert await lease_store.current("acme", R) == acme
        with pytest.raises(LeaseLostError):
            await lease_store.renew(replace(acme, tenant="globex"), LONG)

    async def test_ids_with_odd_characters_are_kept_verbatim(self, lease_store: LeaseStore) -> None:
        for tenant in ODD_IDS:
            for run_id in ODD_IDS:
                lease = await lease_store.acquire(tenant, run_id, f"{tenant}|{run_id}", LONG)
                assert (lease.tenant, lease.run_id) == (tenant, run_id)
        for tenant in ODD_IDS:
            for run_id in ODD_IDS:
                current = await lease_store.current(tenant, run_id)
                assert current is not None and current.holder == f"{tenant}|{run_id}"
        assert await lease_store.current("a", "b") is None

    async def test_ids_that_join_alike_do_not_collide(self, lease_store: LeaseStore) -> None:
        for tenant, run_id in JOIN_ALIKE_IDS:
            await lease_store.acquire(tenant, run_id, f"{tenant}|{run_id}", LONG)
        for tenant, run_id in JOIN_ALIKE_IDS:
            current = await lease_store.current(tenant, run_id)
            assert current is not None and current.holder == f"{tenant}|{run_id}"

    async def test_caller_clock_an_hour_off_changes_nothing(
        self,
        lease_store: LeaseStore,
        clock: FakeClock | None,
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        real_time = time.time
        live = await lease_store.acquire(T, "live", "worker-a", LONG)
        lapsed = await lease_store.acquire(T, "lapsed", "worker-a", self.short_ttl)
        await self.let_pass(clock, self.past_short_ttl)
        for skew in (3600.0, -3600.0):
            monkeypatch.setattr(time, "time", lambda skew=skew: real_time() + skew)
            with pytest.raises(LeaseHeldError):
                await lease_store.acquire(T, "live", "worker-b", LONG)
            assert await lease_store.current(T, "live") == live
            with pytest.raises(LeaseLostError):
                await lease_store.renew(lapsed, LONG)
            assert await lease_store.current(T, "lapsed") is None
