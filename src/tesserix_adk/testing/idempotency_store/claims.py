"""Claims: a fresh claim, a claim met by a record, takeover, and a holder claiming again."""

from __future__ import annotations

import time

import pytest

from tesserix_adk.errors import StaleFenceError
from tesserix_adk.stores.protocols import (
    FencedStore,
    IdempotencyStore,
    RecordsFrom,
    RecordStatus,
    ToolFlags,
)
from tesserix_adk.testing._support import ClockedConformance
from tesserix_adk.testing.clock import FakeClock
from tesserix_adk.testing.idempotency_store._common import R, T, _claim, _run_claim

__all__ = ["ClaimChecks"]


class ClaimChecks(ClockedConformance):
    """Claims: a fresh claim, a claim met by a record, takeover, and a holder claiming again."""

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

    async def test_takeover_by_another_run_names_the_taker_and_stays_the_first_runs_call(
        self, idempotency_store: IdempotencyStore
    ) -> None:
        # A business key two runs share: a third run looks at the taker's lease (its holder
        # may be sending the call), and the first run's listing still finds the call it sent.
        flags = ToolFlags(side_effects=True, idempotent=True)
        await _claim(idempotency_store, "k1", "worker-a", iteration=1, call_id="c1", flags=flags)
        taken = await _claim(
            idempotency_store,
            "k1",
            "worker-b",
            run_id="run-2",
            iteration=4,
            call_id="c7",
            fence=1,
            takeover=True,
        )
        assert (taken.holder, taken.holder_run, taken.holding_run) == ("worker-b", "run-2", "run-2")
        assert (taken.run_id, taken.iteration, taken.call_id) == (R, 1, "c1")
        assert (taken.holder_iteration, taken.holder_call_id) == (4, "c7")
        assert (taken.tool, taken.flags) == ("book_seat", flags)
        assert (await idempotency_store.lookup(["k1"], tenant=T))["k1"] == taken
        assert [r.key for r in await idempotency_store.records(T, R)] == ["k1"]
        # The taker lists it too, as its own call: at its turn, with its call id.
        (mine,) = await idempotency_store.records(T, "run-2")
        assert (mine.key, mine.iteration, mine.call_id, mine.run_id) == ("k1", 4, "c7", R)
        if isinstance(idempotency_store, RecordsFrom):
            assert [r.key for r in await idempotency_store.records_from(T, R, 1)] == ["k1"]
            taker = await idempotency_store.records_from(T, "run-2", 4)
            assert [(r.key, r.iteration, r.call_id) for r in taker] == [("k1", 4, "c7")]
            assert await idempotency_store.records_from(T, "run-2", 5) == []
        # The outcome the taker records, and an operator's word, keep who took it.
        done = await idempotency_store.complete("k1", b"ok", tenant=T, holder="worker-b")
        assert (done.status, done.holder_run) == (RecordStatus.completed, "run-2")
        # Taken back by the first run, it is that run's own again; and a fresh claim after
        # "never ran" names no taker.
        await _claim(idempotency_store, "k2", "worker-a", flags=flags)
        await _claim(idempotency_store, "k2", "worker-b", run_id="run-2", fence=1, takeover=True)
        back = await _claim(idempotency_store, "k2", "worker-c", fence=2, takeover=True)
        assert (back.holder, back.holder_run, back.holding_run) == ("worker-c", None, R)
        assert (back.holder_iteration, back.holder_call_id) == (None, None)
        assert "k2" not in [r.key for r in await idempotency_store.records(T, "run-2")]
        await _claim(idempotency_store, "k3", "worker-a", flags=flags, fence=2)
        await _claim(idempotency_store, "k3", "worker-b", run_id="run-2", fence=1, takeover=True)
        await idempotency_store.resolve("k3", tenant=T, never_ran=True, by="ops")
        fresh = await _claim(idempotency_store, "k3", "worker-d", run_id="run-3", fence=1)
        assert (fresh.run_id, fresh.holder_run, fresh.holding_run) == ("run-3", None, "run-3")

    async def test_a_claim_of_its_own_run_names_no_taker(
        self, idempotency_store: IdempotencyStore
    ) -> None:
        await _claim(idempotency_store, "k1", "worker-a", fence=1)
        again = await _claim(idempotency_store, "k1", "worker-b", fence=2, takeover=True)
        assert (again.holder, again.holder_run, again.holding_run) == ("worker-b", None, R)

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
