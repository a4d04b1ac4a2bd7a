"""The conformance suite every ``HistoryStore`` passes."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tesserix_adk.errors import HistoryUnavailableError, StaleFenceError
from tesserix_adk.stores.protocols import (
    EMPTY_HISTORY_DIGEST,
    FencedStore,
    HistoryHandle,
    HistoryStore,
    chain_digest,
)
from tesserix_adk.testing._support import JOIN_ALIKE_IDS, ODD_IDS
from tesserix_adk.testing.costs import check_fetch_is_constant
from tesserix_adk.testing.counting import round_trips_of

__all__ = ["HistoryStoreConformance"]

T = "acme"
R = "run-1"


def _digest(items: list[bytes]) -> str:
    digest = EMPTY_HISTORY_DIGEST
    for item in items:
        digest = chain_digest(digest, item)
    return digest


def _empty(tenant: str = T, run_id: str = R) -> HistoryHandle:
    return HistoryHandle(tenant=tenant, run_id=run_id, count=0, digest=EMPTY_HISTORY_DIGEST)


class HistoryStoreConformance:
    """Subclass this in a test module to check a ``HistoryStore``.

    Provide one fixture (in the subclass, a conftest or the module):

    - ``history_store``: a fresh, empty store;

    and, optionally, ``round_trips``: a ``testing.counting.RoundTrips`` wired to the store's
    driver, or ``None``; without one the tests of requests sent skip, saying why.
    """

    async def test_store_satisfies_the_protocol(self, history_store: HistoryStore) -> None:
        assert isinstance(history_store, HistoryStore)
        assert isinstance(history_store, FencedStore)

    async def test_append_returns_a_handle_naming_the_chained_prefix(
        self, history_store: HistoryStore
    ) -> None:
        items = [b"system", b"user: hello"]
        handle = await history_store.append(T, R, items, fence=1, after=None)
        assert handle == HistoryHandle(tenant=T, run_id=R, count=2, digest=_digest(items))

    async def test_fetch_returns_the_prefix(self, history_store: HistoryStore) -> None:
        items = [b"system", b"user: hello"]
        handle = await history_store.append(T, R, items, after=None)
        assert await history_store.fetch(handle) == items

    async def test_bytes_round_trip_exactly(self, history_store: HistoryStore) -> None:
        items = [bytes(range(256)), b"", b"\x00", "ü".encode()]
        handle = await history_store.append(T, R, items, after=None)
        assert await history_store.fetch(handle) == items

    async def test_appends_grow_the_transcript(self, history_store: HistoryStore) -> None:
        first = await history_store.append(T, R, [b"m0", b"m1"], fence=1, after=None)
        second = await history_store.append(T, R, [b"m2"], fence=1, after=first)
        third = await history_store.append(T, R, [b"m3", b"m4"], fence=1, after=second)
        assert (first.count, second.count, third.count) == (2, 3, 5)
        assert third.digest == _digest([b"m0", b"m1", b"m2", b"m3", b"m4"])
        assert await history_store.fetch(third) == [b"m0", b"m1", b"m2", b"m3", b"m4"]

    async def test_fetch_of_an_earlier_prefix_returns_just_that_prefix(
        self, history_store: HistoryStore
    ) -> None:
        first = await history_store.append(T, R, [b"m0", b"m1"], after=None)
        await history_store.append(T, R, [b"m2"], after=first)
        assert await history_store.fetch(first) == [b"m0", b"m1"]
        assert await history_store.fetch(_empty()) == []

    async def test_appending_nothing_names_the_same_prefix(
        self, history_store: HistoryStore
    ) -> None:
        first = await history_store.append(T, R, [b"m0"], after=None)
        again = await history_store.append(T, R, [], after=first)
        assert again == first
        assert await history_store.fetch(again) == [b"m0"]

    async def test_history_append_drops_a_dead_writers_tail(
        self, history_store: HistoryStore
    ) -> None:
        base = await history_store.append(T, R, [b"m0", b"m1"], fence=1, after=None)
        # The dead writer got further than its last frontier recorded.
        await history_store.append(T, R, [b"dead-2", b"dead-3"], fence=1, after=base)
        carried = await history_store.append(T, R, [b"new-2"], fence=2, after=base)
        assert carried.count == 3
        assert carried.digest == _digest([b"m0", b"m1", b"new-2"])
        assert await history_store.fetch(carried) == [b"m0", b"m1", b"new-2"]

    async def test_fetch_of_a_prefix_that_no_longer_resolves_raises(
        self, history_store: HistoryStore
    ) -> None:
        base = await history_store.append(T, R, [b"m0"], after=None)
        dead = await history_store.append(T, R, [b"dead-1", b"dead-2"], after=base)
        await history_store.append(T, R, [b"new-1"], after=base)
        with pytest.raises(HistoryUnavailableError):
            await history_store.fetch(dead)
        # Same length, other bytes: still refused.
        with pytest.raises(HistoryUnavailableError):
            await history_store.fetch(replace(dead, count=2))
        assert await history_store.fetch(base) == [b"m0"]

    async def test_fetch_with_a_wrong_digest_raises(self, history_store: HistoryStore) -> None:
        handle = await history_store.append(T, R, [b"m0", b"m1"], after=None)
        with pytest.raises(HistoryUnavailableError):
            await history_store.fetch(replace(handle, digest=_digest([b"m0", b"other"])))

    async def test_fetch_beyond_the_end_raises(self, history_store: HistoryStore) -> None:
        handle = await history_store.append(T, R, [b"m0", b"m1"], after=None)
        beyond = replace(handle, count=3, digest=_digest([b"m0", b"m1", b"m2"]))
        with pytest.raises(HistoryUnavailableError):
            await history_store.fetch(beyond)

    async def test_fetch_of_an_unknown_run_raises(self, history_store: HistoryStore) -> None:
        handle = HistoryHandle(tenant=T, run_id="nobody", count=1, digest=_digest([b"m0"]))
        with pytest.raises(HistoryUnavailableError):
            await history_store.fetch(handle)

    async def test_empty_prefix_always_resolves(self, history_store: HistoryStore) -> None:
        assert await history_store.fetch(_empty(T, "nobody")) == []

    async def test_append_after_a_prefix_that_does_not_resolve_raises(
        self, history_store: HistoryStore
    ) -> None:
        handle = await history_store.append(T, R, [b"m0"], after=None)
        wrong = replace(handle, digest=_digest([b"other"]))
        with pytest.raises(HistoryUnavailableError):
            await history_store.append(T, R, [b"m1"], after=wrong)
        with pytest.raises(HistoryUnavailableError):
            await history_store.append(T, R, [b"m1"], after=replace(handle, count=2))
        assert await history_store.fetch(handle) == [b"m0"]

    async def test_append_after_none_starts_from_the_empty_prefix(
        self, history_store: HistoryStore
    ) -> None:
        await history_store.append(T, R, [b"old-0", b"old-1"], after=None)
        handle = await history_store.append(T, R, [b"new-0"], after=None)
        assert handle.count == 1
        assert await history_store.fetch(handle) == [b"new-0"]

    async def test_forget_removes_the_transcript(self, history_store: HistoryStore) -> None:
        handle = await history_store.append(T, R, [b"m0"], after=None)
        kept = await history_store.append(T, "kept", [b"k0"], after=None)
        await history_store.forget(T, R)
        with pytest.raises(HistoryUnavailableError):
            await history_store.fetch(handle)
        with pytest.raises(HistoryUnavailableError):
            await history_store.append(T, R, [b"m1"], after=handle)
        assert await history_store.fetch(kept) == [b"k0"]

    async def test_forget_keeps_the_fence(self, history_store: HistoryStore) -> None:
        await history_store.append(T, R, [b"m0"], fence=5, after=None)
        await history_store.forget(T, R)
        with pytest.raises(StaleFenceError):
            await history_store.append(T, R, [b"old"], fence=4, after=None)
        with pytest.raises(StaleFenceError):
            await history_store.append(T, R, [b"unfenced"], after=None)
        handle = await history_store.append(T, R, [b"new"], fence=5, after=None)
        assert await history_store.fetch(handle) == [b"new"]

    async def test_stale_fence_is_refused_on_append(self, history_store: HistoryStore) -> None:
        base = await history_store.append(T, R, [b"m0"], fence=1, after=None)
        carried = await history_store.append(T, R, [b"new-1"], fence=2, after=base)
        with pytest.raises(StaleFenceError):
            await history_store.append(T, R, [b"old-1"], fence=1, after=base)
        assert await history_store.fetch(carried) == [b"m0", b"new-1"]

    async def test_fence_is_checked_before_the_prefix(self, history_store: HistoryStore) -> None:
        await history_store.append(T, R, [b"m0"], fence=2, after=None)
        wrong = HistoryHandle(tenant=T, run_id=R, count=5, digest=_digest([b"x"]))
        with pytest.raises(StaleFenceError):
            await history_store.append(T, R, [b"m1"], fence=1, after=wrong)

    async def test_refused_append_raises_no_fence(self, history_store: HistoryStore) -> None:
        base = await history_store.append(T, R, [b"m0"], fence=1, after=None)
        wrong = replace(base, digest=_digest([b"other"]))
        with pytest.raises(HistoryUnavailableError):
            await history_store.append(T, R, [b"m1"], fence=2, after=wrong)
        # The refused append carried fence 2; fence 1 is still the highest seen.
        handle = await history_store.append(T, R, [b"m1"], fence=1, after=base)
        assert await history_store.fetch(handle) == [b"m0", b"m1"]

    async def test_unfenced_appends_are_accepted_before_any_fence(
        self, history_store: HistoryStore
    ) -> None:
        first = await history_store.append(T, R, [b"m0"], after=None)
        second = await history_store.append(T, R, [b"m1"], fence=1, after=first)
        assert await history_store.fetch(second) == [b"m0", b"m1"]

    async def test_unfenced_append_is_refused_once_a_fence_was_seen(
        self, history_store: HistoryStore
    ) -> None:
        base = await history_store.append(T, R, [b"m0"], fence=1, after=None)
        with pytest.raises(StaleFenceError):
            await history_store.append(T, R, [b"m1"], after=base)
        assert await history_store.fetch(base) == [b"m0"]

    async def test_seal_refuses_writes_below_it_before_any_write(
        self, history_store: HistoryStore
    ) -> None:
        await history_store.seal(T, R, 3)
        with pytest.raises(StaleFenceError):
            await history_store.append(T, R, [b"old"], fence=2, after=None)
        with pytest.raises(StaleFenceError):
            await history_store.append(T, R, [b"unfenced"], after=None)
        handle = await history_store.append(T, R, [b"sealer"], fence=3, after=None)
        assert await history_store.fetch(handle) == [b"sealer"]

    async def test_seal_writes_no_data(self, history_store: HistoryStore) -> None:
        await history_store.seal(T, R, 3)
        assert await history_store.fetch(_empty()) == []
        handle = HistoryHandle(tenant=T, run_id=R, count=1, digest=_digest([b"m0"]))
        with pytest.raises(HistoryUnavailableError):
            await history_store.fetch(handle)

    async def test_seal_is_idempotent_and_never_goes_back(
        self, history_store: HistoryStore
    ) -> None:
        await history_store.seal(T, R, 3)
        await history_store.seal(T, R, 3)
        with pytest.raises(StaleFenceError):
            await history_store.seal(T, R, 2)
        await history_store.append(T, R, [b"m0"], fence=4, after=None)
        with pytest.raises(StaleFenceError):
            await history_store.seal(T, R, 3)

    async def test_fences_are_kept_per_run(self, history_store: HistoryStore) -> None:
        await history_store.append(T, "run-a", [b"a"], fence=9, after=None)
        handle = await history_store.append(T, "run-b", [b"b"], fence=1, after=None)
        assert await history_store.fetch(handle) == [b"b"]

    async def test_tenants_do_not_see_each_other(self, history_store: HistoryStore) -> None:
        acme = await history_store.append("acme", R, [b"acme's"], fence=9, after=None)
        with pytest.raises(HistoryUnavailableError):
            await history_store.fetch(replace(acme, tenant="globex"))
        globex = await history_store.append("globex", R, [b"globex's"], fence=1, after=None)
        await history_store.forget("globex", R)
        assert await history_store.fetch(acme) == [b"acme's"]
        with pytest.raises(HistoryUnavailableError):
            await history_store.fetch(globex)

    async def test_ids_with_odd_characters_are_kept_verbatim(
        self, history_store: HistoryStore
    ) -> None:
        handles = {}
        for tenant in ODD_IDS:
            for run_id in ODD_IDS:
                item = f"{tenant}|{run_id}".encode()
                handles[tenant, run_id] = await history_store.append(
                    tenant, run_id, [item], fence=1, after=None
                )
        for (tenant, run_id), handle in handles.items():
            assert (handle.tenant, handle.run_id) == (tenant, run_id)
            assert await history_store.fetch(handle) == [f"{tenant}|{run_id}".encode()]

    async def test_ids_that_join_alike_do_not_collide(self, history_store: HistoryStore) -> None:
        handles = [
            await history_store.append(t, r, [f"{t}|{r}".encode()], after=None)
            for t, r in JOIN_ALIKE_IDS
        ]
        for (t, r), handle in zip(JOIN_ALIKE_IDS, handles, strict=True):
            assert await history_store.fetch(handle) == [f"{t}|{r}".encode()]

    async def test_fetch_sends_as_many_requests_however_long_the_transcript(
        self, history_store: HistoryStore, request: pytest.FixtureRequest
    ) -> None:
        await check_fetch_is_constant(history_store, await round_trips_of(request))
