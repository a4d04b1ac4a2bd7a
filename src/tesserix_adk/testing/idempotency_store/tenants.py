"""Tenants: one tenant's record never reaches another's, and ids are kept verbatim."""

from __future__ import annotations

import pytest

from tesserix_adk.errors import StaleFenceError
from tesserix_adk.stores.protocols import IdempotencyStore, RecordStatus
from tesserix_adk.testing._support import JOIN_ALIKE_IDS, ODD_IDS, ClockedConformance
from tesserix_adk.testing.idempotency_store._common import G, R, T, _claim, _run_claim

__all__ = ["TenantChecks"]


class TenantChecks(ClockedConformance):
    """Tenants: one tenant's record never reaches another's, and ids are kept verbatim."""

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
