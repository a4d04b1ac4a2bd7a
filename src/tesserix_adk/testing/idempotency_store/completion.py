"""Completing a claim with its outcome, and releasing a claim (a ttl claim, or a tool call
never dispatched)."""

from __future__ import annotations

import pytest

from tesserix_adk.errors import StaleFenceError
from tesserix_adk.stores.protocols import IdempotencyStore, RecordStatus
from tesserix_adk.testing._support import ClockedConformance
from tesserix_adk.testing.idempotency_store._common import R, T, _claim, _run_claim

__all__ = ["CompletionChecks"]


class CompletionChecks(ClockedConformance):
    """Completing a claim with its outcome, and releasing a claim (a ttl claim, or a tool
    call never dispatched)."""

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

    async def test_release_undispatched_drops_a_claim_with_no_tool_and_no_ttl(
        self, idempotency_store: IdempotencyStore
    ) -> None:
        """An unkeyed call's mark (``temporal.calls``): a record of no tool, never lapsing,
        dropped by its holder when the call did not go out."""
        await idempotency_store.claim(
            "m1",
            holder="worker-a",
            tenant=T,
            run_id=R,
            iteration=None,
            tool=None,
            call_id=None,
            flags=None,
        )
        await idempotency_store.release("m1", tenant=T, holder="worker-a")
        assert set(await idempotency_store.lookup(["m1"], tenant=T)) == {"m1"}
        await idempotency_store.release("m1", tenant=T, holder="worker-b", undispatched=True)
        assert set(await idempotency_store.lookup(["m1"], tenant=T)) == {"m1"}
        await idempotency_store.release("m1", tenant=T, holder="worker-a", undispatched=True)
        assert await idempotency_store.lookup(["m1"], tenant=T) == {}

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
