"""The conformance suite every ``IdempotencyStore`` passes."""

from __future__ import annotations

import time

import pytest

from tesserix_adk.errors import StaleFenceError
from tesserix_adk.stores.protocols import (
    FencedStore,
    IdempotencyRecord,
    IdempotencyStore,
    RecordStatus,
    ToolFlags,
)
from tesserix_adk.testing._support import JOIN_ALIKE_IDS, ODD_IDS, ClockedConformance
from tesserix_adk.testing.clock import FakeClock
from tesserix_adk.testing.costs import check_lookup_is_batched, check_plan_calls
from tesserix_adk.testing.counting import round_trips_of

__all__ = ["IdempotencyStoreConformance"]

T = "acme"
R = "run-1"
# A second tenant, for the tests that one tenant's record never reaches another's.
G = "globex"


async def _claim(
    store: IdempotencyStore,
    key: str,
    holder: str,
    *,
    tenant: str = T,
    run_id: str = R,
    iteration: int | None = 0,
    tool: str | None = "book_seat",
    call_id: str | None = "call_1",
    flags: ToolFlags | None = None,
    fence: int | None = None,
    ttl: float | None = None,
    takeover: bool = False,
) -> IdempotencyRecord:
    return await store.claim(
        key,
        holder=holder,
        tenant=tenant,
        run_id=run_id,
        iteration=iteration,
        tool=tool,
        call_id=call_id,
        flags=ToolFlags() if flags is None else flags,
        fence=fence,
        ttl=ttl,
        takeover=takeover,
    )


async def _run_claim(
    store: IdempotencyStore,
    key: str,
    holder: str,
    *,
    ttl: float,
    tenant: str = T,
    fence: int | None = None,
    takeover: bool = False,
) -> IdempotencyRecord:
    return await store.claim(
        key,
        holder=holder,
        tenant=tenant,
        run_id=R,
        iteration=None,
        tool=None,
        call_id=None,
        flags=None,
        fence=fence,
        ttl=ttl,
        takeover=takeover,
    )


class IdempotencyStoreConformance(ClockedConformance):
    """Subclass this in a test module to check an ``IdempotencyStore``.

    Provide two fixtures (in the subclass, a conftest or the module):

    - ``idempotency_store``: a fresh, empty store;
    - ``clock``: the ``FakeClock`` injected into that store, or ``None`` when the store
      reads its own clock (a database or server clock); ttl tests then wait for real, for
      ``past_short_ttl`` seconds at a time. ``controls_clock = False`` forces real waits.

    and, optionally, ``round_trips``: a ``testing.counting.RoundTrips`` wired to the
    store's driver, or ``None``; without one the tests of requests sent skip, saying why.
    """

    async def test_store_satisfies_the_protocol(self, idempotency_store: IdempotencyStore) -> None:
        assert isinstance(idempotency_store, IdempotencyStore)
        assert isinstance(idempotency_store, FencedStore)

    async def test_claim_of_an_absent_key_is_in_flight_under_the_holder(
        self, idempotency_store: IdempotencyStore
    ) -> None:
        flags = ToolFlags(side_effects=True, idempotent=False)
        record = await _claim(
            idempotency_store, "k1", "worker-a", iteration=2, flags=flags, fence=3
        )
        assert record.key == "k1"
        assert record.status is RecordStatus.in_flight
        assert record.holder == "worker-a"
        assert (record.tenant, record.run_id) == (T, R)
        assert (record.iteration, record.tool, record.call_id) == (2, "book_seat", "call_1")
        assert record.flags == flags
        assert record.fence == 3
        assert record.outcome is None
        assert record.completed_at is None
        assert record.expires_at is None
        assert record.by is None

    async def test_claim_is_stamped_by_the_store_clock(
        self, idempotency_store: IdempotencyStore, clock: FakeClock | None
    ) -> None:
        before = time.time()
        record = await _run_claim(idempotency_store, "run", "worker-a", ttl=30)
        if clock is not None and self.moves_clock(clock):
            assert record.since == clock()
            assert record.expires_at == pytest.approx(clock() + 30)
        else:
            # A server clock may be a little off ours; it still counts epoch seconds.
            assert abs(record.since - before) < 300
            assert record.expires_at == pytest.approx(record.since + 30, abs=1)

    async def test_record_keeps_the_tool_flags_and_call_id(
        self, idempotency_store: IdempotencyStore
    ) -> None:
        flags = ToolFlags(side_effects=False, idempotent=True)
        await _claim(idempotency_store, "k1", "worker-a", call_id="call_9", flags=flags)
        found = await idempotency_store.lookup(["k1"], tenant=T)
        assert found["k1"].flags == flags
        assert found["k1"].call_id == "call_9"
        assert found["k1"].flags.safe_to_resend

    async def test_complete_records_the_outcome(self, idempotency_store: IdempotencyStore) -> None:
        claimed = await _claim(idempotency_store, "k1", "worker-a", fence=1)
        done = await idempotency_store.complete(
            "k1", b'{"seat": "12A"}', tenant=T, holder="worker-a"
        )
        assert done.status is RecordStatus.completed
        assert done.outcome == b'{"seat": "12A"}'
        assert done.holder == "worker-a"
        assert done.completed_at is not None and done.completed_at >= claimed.since
        assert done.by is None
        assert (await idempotency_store.lookup(["k1"], tenant=T))["k1"] == done

    async def test_outcome_bytes_round_trip_exactly(
        self, idempotency_store: IdempotencyStore
    ) -> None:
        every_byte = bytes(range(256))
        await _claim(idempotency_store, "k1", "worker-a")
        await idempotency_store.complete("k1", every_byte, tenant=T, holder="worker-a")
        await _claim(idempotency_store, "k2", "worker-a")
        await idempotency_store.complete("k2", b"", tenant=T, holder="worker-a")
        found = await idempotency_store.lookup(["k1", "k2"], tenant=T)
        assert found["k1"].outcome == every_byte
        assert found["k2"].outcome == b""

    async def test_completed_record_is_returned_unchanged_on_claim(
        self, idempotency_store: IdempotencyStore
    ) -> None:
        await _claim(idempotency_store, "k1", "worker-a", fence=1)
        done = await idempotency_store.complete("k1", b"result", tenant=T, holder="worker-a")
        assert await _claim(idempotency_store, "k1", "worker-b", fence=2) == done
        assert await _claim(idempotency_store, "k1", "worker-b", fence=2, takeover=True) == done
        assert await _claim(idempotency_store, "k1", "worker-a", fence=2) == done

    async def test_in_flight_claim_of_another_holder_is_not_taken_without_takeover(
        self, idempotency_store: IdempotencyStore
    ) -> None:
        mine = await _claim(idempotency_store, "k1", "worker-a", fence=1)
        theirs = await _claim(idempotency_store, "k1", "worker-b", fence=2)
        assert theirs == mine
        assert (await idempotency_store.lookup(["k1"], tenant=T))["k1"] == mine

    async def test_takeover_moves_an_in_flight_claim_to_the_new_holder(
        self, idempotency_store: IdempotencyStore
    ) -> None:
        await _claim(idempotency_store, "k1", "worker-a", fence=1)
        taken = await _claim(idempotency_store, "k1", "worker-b", fence=2, takeover=True)
        assert taken.status is RecordStatus.in_flight
        assert taken.holder == "worker-b"
        assert taken.fence == 2
        with pytest.raises(StaleFenceError):
            await idempotency_store.complete("k1", b"late", tenant=T, holder="worker-a")
        done = await idempotency_store.complete("k1", b"done", tenant=T, holder="worker-b")
        assert done.status is RecordStatus.completed

    async def test_resume_claims_are_not_fenced(self, idempotency_store: IdempotencyStore) -> None:
        # A resume claim is taken before the lease, so it carries no fence even after the
        # store has seen one for the run, and it does not raise the highest seen.
        await idempotency_store.seal(T, R, 5)
        claim = await _run_claim(idempotency_store, "run", "worker-a", ttl=30)
        assert claim.status is RecordStatus.in_flight and claim.holder == "worker-a"
        await _run_claim(idempotency_store, "run", "worker-a", ttl=30, fence=9)
        await _claim(idempotency_store, "k1", "worker-a", fence=5)

    async def test_claim_by_the_same_holder_keeps_its_in_flight_claim(
        self, idempotency_store: IdempotencyStore
    ) -> None:
        first = await _claim(idempotency_store, "k1", "worker-a", fence=1)
        again = await _claim(idempotency_store, "k1", "worker-a", fence=1)
        assert again.status is RecordStatus.in_flight
        assert again.holder == "worker-a"
        assert again.since == first.since

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

    async def test_release_drops_a_ttl_claim_of_its_holder(
        self, idempotency_store: IdempotencyStore
    ) -> None:
        await _run_claim(idempotency_store, "run", "worker-a", ttl=30)
        await idempotency_store.release("run", tenant=T, holder="worker-a")
        assert await idempotency_store.lookup(["run"], tenant=T) == {}
        assert (await _run_claim(idempotency_store, "run", "worker-b", ttl=30)).holder == (
            "worker-b"
        )

    async def test_release_by_another_holder_changes_nothing(
        self, idempotency_store: IdempotencyStore
    ) -> None:
        mine = await _run_claim(idempotency_store, "run", "worker-a", ttl=30)
        await idempotency_store.release("run", tenant=T, holder="worker-b")
        assert (await idempotency_store.lookup(["run"], tenant=T))["run"] == mine

    async def test_release_never_drops_a_tool_call_claim(
        self, idempotency_store: IdempotencyStore
    ) -> None:
        mine = await _claim(idempotency_store, "k1", "worker-a")
        await idempotency_store.release("k1", tenant=T, holder="worker-a")
        assert (await idempotency_store.lookup(["k1"], tenant=T))["k1"] == mine

    async def test_release_undispatched_drops_a_tool_call_claim_of_its_holder(
        self, idempotency_store: IdempotencyStore
    ) -> None:
        await _claim(idempotency_store, "k1", "worker-a")
        await idempotency_store.release("k1", tenant=T, holder="worker-a", undispatched=True)
        assert await idempotency_store.lookup(["k1"], tenant=T) == {}
        assert (await _claim(idempotency_store, "k1", "worker-b")).holder == "worker-b"

    async def test_release_undispatched_by_another_holder_changes_nothing(
        self, idempotency_store: IdempotencyStore
    ) -> None:
        mine = await _claim(idempotency_store, "k1", "worker-a")
        await idempotency_store.release("k1", tenant=T, holder="worker-b", undispatched=True)
        assert (await idempotency_store.lookup(["k1"], tenant=T))["k1"] == mine

    async def test_release_undispatched_never_drops_a_completed_record(
        self, idempotency_store: IdempotencyStore
    ) -> None:
        await _claim(idempotency_store, "k1", "worker-a")
        done = await idempotency_store.complete("k1", b"done", tenant=T, holder="worker-a")
        await idempotency_store.release("k1", tenant=T, holder="worker-a", undispatched=True)
        assert (await idempotency_store.lookup(["k1"], tenant=T))["k1"] == done

    async def test_release_never_drops_a_completed_record(
        self, idempotency_store: IdempotencyStore
    ) -> None:
        await _run_claim(idempotency_store, "run", "worker-a", ttl=30)
        done = await idempotency_store.complete("run", b"finished", tenant=T, holder="worker-a")
        await idempotency_store.release("run", tenant=T, holder="worker-a")
        assert (await idempotency_store.lookup(["run"], tenant=T))["run"] == done

    async def test_release_of_an_absent_key_is_a_no_op(
        self, idempotency_store: IdempotencyStore
    ) -> None:
        await idempotency_store.release("nothing", tenant=T, holder="worker-a")
        assert await idempotency_store.lookup(["nothing"], tenant=T) == {}

    async def test_complete_by_another_holder_is_refused(
        self, idempotency_store: IdempotencyStore
    ) -> None:
        mine = await _claim(idempotency_store, "k1", "worker-a")
        with pytest.raises(StaleFenceError):
            await idempotency_store.complete("k1", b"not mine", tenant=T, holder="worker-b")
        assert (await idempotency_store.lookup(["k1"], tenant=T))["k1"] == mine

    async def test_complete_of_an_absent_key_is_refused(
        self, idempotency_store: IdempotencyStore
    ) -> None:
        with pytest.raises(StaleFenceError):
            await idempotency_store.complete("nothing", b"x", tenant=T, holder="worker-a")
        assert await idempotency_store.lookup(["nothing"], tenant=T) == {}

    async def test_complete_again_by_the_same_holder_returns_it_unchanged(
        self, idempotency_store: IdempotencyStore
    ) -> None:
        await _claim(idempotency_store, "k1", "worker-a")
        done = await idempotency_store.complete("k1", b"first", tenant=T, holder="worker-a")
        assert await idempotency_store.complete("k1", b"first", tenant=T, holder="worker-a") == done
        assert (
            await idempotency_store.complete("k1", b"second", tenant=T, holder="worker-a") == done
        )
        with pytest.raises(StaleFenceError):
            await idempotency_store.complete("k1", b"first", tenant=T, holder="worker-b")

    async def test_complete_is_not_fenced(self, idempotency_store: IdempotencyStore) -> None:
        await _claim(idempotency_store, "k1", "worker-a", fence=1)
        await idempotency_store.seal(T, R, 2)
        done = await idempotency_store.complete("k1", b"what it did", tenant=T, holder="worker-a")
        assert done.status is RecordStatus.completed

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

    async def test_tenants_do_not_see_each_other(self, idempotency_store: IdempotencyStore) -> None:
        await _claim(idempotency_store, "acme-k", "worker-a", tenant="acme", fence=9)
        await _claim(idempotency_store, "globex-k", "worker-a", tenant="globex", fence=1)
        assert [r.key for r in await idempotency_store.records("acme", R)] == ["acme-k"]
        assert [r.key for r in await idempotency_store.records("globex", R)] == ["globex-k"]
        await idempotency_store.seal("globex", R, 2)
        await _claim(idempotency_store, "acme-k2", "worker-a", tenant="acme", fence=9)

    async def test_the_same_key_under_two_tenants_is_two_records(
        self, idempotency_store: IdempotencyStore
    ) -> None:
        # A business key such as ``order-5`` chosen by both tenants: the second claim is a
        # fresh record of its own, not the first tenant's claim handed back.
        acme = await _claim(idempotency_store, "order-5", "worker-a", tenant=T, fence=1)
        globex = await _claim(idempotency_store, "order-5", "worker-b", tenant=G, fence=1)
        assert (globex.tenant, globex.holder, globex.status) == (
            G,
            "worker-b",
            RecordStatus.in_flight,
        )
        assert (await idempotency_store.lookup(["order-5"], tenant=T))["order-5"] == acme
        assert (await idempotency_store.lookup(["order-5"], tenant=G))["order-5"] == globex
        assert await idempotency_store.records(T, R) == [acme]
        assert await idempotency_store.records(G, R) == [globex]

    async def test_a_claim_never_takes_over_or_reads_another_tenants_record(
        self, idempotency_store: IdempotencyStore
    ) -> None:
        busy = await _claim(idempotency_store, "busy", "worker-a", tenant=T, fence=1)
        await _claim(idempotency_store, "done", "worker-a", tenant=T, fence=1)
        done = await idempotency_store.complete("done", b"acme's seat", tenant=T, holder="worker-a")
        taken = await _claim(
            idempotency_store, "busy", "worker-b", tenant=G, fence=1, takeover=True
        )
        fresh = await _claim(idempotency_store, "done", "worker-b", tenant=G, fence=1)
        for record in (taken, fresh):
            assert (record.tenant, record.holder) == (G, "worker-b")
            assert record.status is RecordStatus.in_flight and record.outcome is None
        assert await idempotency_store.lookup(["busy", "done"], tenant=T) == {
            "busy": busy,
            "done": done,
        }

    async def test_complete_never_crosses_tenants(
        self, idempotency_store: IdempotencyStore
    ) -> None:
        acme = await _claim(idempotency_store, "order-5", "worker-a", tenant=T)
        with pytest.raises(StaleFenceError):
            # The holder of acme's claim, naming the wrong tenant, holds nothing there.
            await idempotency_store.complete("order-5", b"x", tenant=G, holder="worker-a")
        assert await idempotency_store.lookup(["order-5"], tenant=G) == {}
        globex = await _claim(idempotency_store, "order-5", "worker-a", tenant=G)
        done = await idempotency_store.complete("order-5", b"globex's", tenant=G, holder="worker-a")
        assert done.outcome == b"globex's"
        assert (await idempotency_store.lookup(["order-5"], tenant=T))["order-5"] == acme
        assert globex.status is RecordStatus.in_flight
        assert (await idempotency_store.lookup(["order-5"], tenant=G))["order-5"] == done

    async def test_release_never_crosses_tenants(self, idempotency_store: IdempotencyStore) -> None:
        # Same holder name, same key, two tenants: each release drops only its own claim.
        acme_run = await _run_claim(idempotency_store, "run", "worker-a", tenant=T, ttl=30)
        acme_call = await _claim(idempotency_store, "k1", "worker-a", tenant=T)
        await _run_claim(idempotency_store, "run", "worker-a", tenant=G, ttl=30)
        await _claim(idempotency_store, "k1", "worker-a", tenant=G)
        await idempotency_store.release("run", tenant=G, holder="worker-a")
        await idempotency_store.release("k1", tenant=G, holder="worker-a", undispatched=True)
        assert await idempotency_store.lookup(["run", "k1"], tenant=G) == {}
        assert await idempotency_store.lookup(["run", "k1"], tenant=T) == {
            "run": acme_run,
            "k1": acme_call,
        }

    async def test_resolve_never_crosses_tenants(self, idempotency_store: IdempotencyStore) -> None:
        acme = await _claim(idempotency_store, "order-5", "worker-a", tenant=T)
        with pytest.raises(KeyError):
            await idempotency_store.resolve("order-5", b"x", tenant=G, by="ops@globex")
        with pytest.raises(KeyError):
            await idempotency_store.resolve("order-5", tenant=G, never_ran=True, by="ops@globex")
        assert await idempotency_store.lookup(["order-5"], tenant=G) == {}
        assert (await idempotency_store.lookup(["order-5"], tenant=T))["order-5"] == acme
        await _claim(idempotency_store, "order-5", "worker-b", tenant=G)
        skipped = await idempotency_store.resolve(
            "order-5", tenant=G, never_ran=True, by="ops@globex"
        )
        assert skipped.status is RecordStatus.never_ran and skipped.tenant == G
        assert (await idempotency_store.lookup(["order-5"], tenant=T))["order-5"] == acme
        resolved = await idempotency_store.resolve(
            "order-5", b"booked by hand", tenant=T, by="ops@acme"
        )
        assert resolved.status is RecordStatus.completed and resolved.by == "ops@acme"
        assert (await idempotency_store.lookup(["order-5"], tenant=G))["order-5"] == skipped

    async def test_lookup_with_the_wrong_tenant_finds_nothing(
        self, idempotency_store: IdempotencyStore
    ) -> None:
        await _claim(idempotency_store, "in-flight", "worker-a", tenant=T)
        await _claim(idempotency_store, "done", "worker-a", tenant=T)
        await idempotency_store.complete("done", b"secret", tenant=T, holder="worker-a")
        await _run_claim(idempotency_store, "run", "worker-a", tenant=T, ttl=30)
        assert await idempotency_store.lookup(["in-flight", "done", "run"], tenant=G) == {}
        assert await idempotency_store.records(G, R) == []

    async def test_tenant_and_key_pairs_that_join_alike_stay_apart(
        self, idempotency_store: IdempotencyStore
    ) -> None:
        # ("a:b", "c") and ("a", "b:c") are one string when joined with ":".
        for tenant, key in JOIN_ALIKE_IDS:
            await _claim(idempotency_store, key, holder=f"{tenant}|{key}", tenant=tenant)
        every_key = [key for _, key in JOIN_ALIKE_IDS]
        for tenant in {tenant for tenant, _ in JOIN_ALIKE_IDS}:
            found = await idempotency_store.lookup(every_key, tenant=tenant)
            assert {k: (r.tenant, r.holder) for k, r in found.items()} == {
                key: (tenant, f"{tenant}|{key}") for t, key in JOIN_ALIKE_IDS if t == tenant
            }

    async def test_ids_with_odd_characters_are_kept_verbatim(
        self, idempotency_store: IdempotencyStore
    ) -> None:
        for tenant in ODD_IDS:
            for run_id in ODD_IDS:
                await _claim(
                    idempotency_store,
                    f"{tenant}|{run_id}",
                    holder=tenant,
                    tenant=tenant,
                    run_id=run_id,
                    call_id=run_id,
                    fence=1,
                )
        for tenant in ODD_IDS:
            for run_id in ODD_IDS:
                records = await idempotency_store.records(tenant, run_id)
                assert [(r.key, r.holder, r.call_id) for r in records] == [
                    (f"{tenant}|{run_id}", tenant, run_id)
                ]
        for tenant in ODD_IDS:
            keys = [f"{tenant}|{r}" for r in ODD_IDS]
            assert set(await idempotency_store.lookup(keys, tenant=tenant)) == set(keys)

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
