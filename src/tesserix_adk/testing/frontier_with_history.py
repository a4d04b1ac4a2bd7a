"""The conformance suite of ``FrontierWithHistory``: a transcript append and the frontier
that names it written together, both or neither."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import pytest

from tesserix_adk.errors import HistoryUnavailableError, StaleFenceError
from tesserix_adk.stores.grouping import group_scope
from tesserix_adk.stores.memory import MemoryHistoryStore
from tesserix_adk.stores.protocols import (
    CheckpointStore,
    FrontierWithHistory,
    GroupedWrites,
    HistoryHandle,
    HistoryStore,
)

__all__ = ["FrontierWithHistoryConformance"]

T = "acme"


@contextlib.asynccontextmanager
async def together(store: object) -> AsyncIterator[None]:
    """Where a store writes the pair together: inside a write group on a backend that has
    them (PostgreSQL writes a pair together only there), else as it is."""
    if not isinstance(store, GroupedWrites):
        yield
        return
    with group_scope():
        group = store.write_group()
        await group.begin()
        yield
        await group.commit()


class FrontierWithHistoryConformance:
    """Subclass this in a test module to check a ``CheckpointStore`` that offers
    ``FrontierWithHistory``; a store without it skips, saying so.

    Provide two fixtures: ``checkpoint_store`` and ``history_store``, fresh and empty,
    on the same backend (the history store the checkpoint store writes beside).
    """

    @pytest.fixture
    def pairs(self, checkpoint_store: CheckpointStore) -> FrontierWithHistory:
        if not isinstance(checkpoint_store, FrontierWithHistory):
            pytest.skip(f"{type(checkpoint_store).__name__} does not offer FrontierWithHistory")
        return checkpoint_store

    async def _pair(
        self,
        pairs: FrontierWithHistory,
        history: HistoryStore,
        run_id: str,
        n: int,
        after: HistoryHandle | None,
        fence: int | None = 1,
    ) -> HistoryHandle | None:
        return await pairs.put_with_history(
            history,
            T,
            run_id,
            f"frontier-{n}".encode(),
            step=n,
            fence=fence,
            encoded=[f"m{n}".encode()],
            after=after,
        )

    async def _first(
        self, pairs: FrontierWithHistory, history: HistoryStore, run_id: str
    ) -> HistoryHandle:
        async with together(pairs):
            handle = await self._pair(pairs, history, run_id, 1, None)
        assert handle is not None and handle.count == 1
        return handle

    async def _untouched(
        self, store: CheckpointStore, history: HistoryStore, run_id: str, handle: HistoryHandle
    ) -> None:
        latest = await store.latest(T, run_id)
        assert latest is not None and latest.payload == b"frontier-1" and latest.step == 1
        assert await history.fetch(handle) == [b"m1"]
        longer = HistoryHandle(tenant=T, run_id=run_id, count=2, digest=handle.digest)
        with pytest.raises(HistoryUnavailableError):
            await history.fetch(longer)

    async def test_both_are_written_and_the_handle_is_the_one_an_append_gives(
        self,
        pairs: FrontierWithHistory,
        checkpoint_store: CheckpointStore,
        history_store: HistoryStore,
    ) -> None:
        history = MemoryHistoryStore()  # what a plain append gives, for comparison
        beside = history_store
        async with together(pairs):
            first = await self._pair(pairs, beside, "r", 1, None)
            assert first is not None
            second = await self._pair(pairs, beside, "r", 2, first)
        one = await history.append(T, "r", [b"m1"], after=None)
        two = await history.append(T, "r", [b"m2"], after=one)
        assert (first, second) == (one, two)
        assert await beside.fetch(two) == [b"m1", b"m2"]
        latest = await checkpoint_store.latest(T, "r")
        assert latest is not None and (latest.payload, latest.step) == (b"frontier-2", 2)

    @pytest.mark.parametrize("refused", ["transcript", "frontier"])
    async def test_either_half_refused_by_its_fence_writes_neither(
        self,
        pairs: FrontierWithHistory,
        checkpoint_store: CheckpointStore,
        history_store: HistoryStore,
        refused: str,
    ) -> None:
        history = history_store
        handle = await self._first(pairs, history, "r")
        # A newer holder fenced one store out (each store keeps its own highest fence).
        sealed = history if refused == "transcript" else checkpoint_store
        await sealed.seal(T, "r", 2)
        async with together(pairs):
            with pytest.raises(StaleFenceError):
                await self._pair(pairs, history, "r", 2, handle)
            # What is written afterwards (in the same group, where there is one) stands.
            await checkpoint_store.put(T, "other", b"other-1", step=1, fence=None)
        await self._untouched(checkpoint_store, history, "r", handle)
        other = await checkpoint_store.latest(T, "other")
        assert other is not None and other.payload == b"other-1"

    async def test_a_prefix_that_does_not_resolve_writes_neither(
        self,
        pairs: FrontierWithHistory,
        checkpoint_store: CheckpointStore,
        history_store: HistoryStore,
    ) -> None:
        history = history_store
        handle = await self._first(pairs, history, "r")
        wrong = HistoryHandle(tenant=T, run_id="r", count=1, digest="0" * len(handle.digest))
        async with together(pairs):
            with pytest.raises(HistoryUnavailableError):
                await self._pair(pairs, history, "r", 2, wrong)
        await self._untouched(checkpoint_store, history, "r", handle)

    async def test_a_dead_writers_tail_beyond_the_prefix_is_dropped(
        self,
        pairs: FrontierWithHistory,
        checkpoint_store: CheckpointStore,
        history_store: HistoryStore,
    ) -> None:
        history = history_store
        handle = await self._first(pairs, history, "r")
        # A writer that died after appending, before its frontier: its items are a tail.
        await history.append(T, "r", [b"orphan"], fence=1, after=handle)
        async with together(pairs):
            second = await self._pair(pairs, history, "r", 2, handle)
        assert second is not None and await history.fetch(second) == [b"m1", b"m2"]

    async def test_a_history_store_elsewhere_is_declined_and_nothing_written(
        self, pairs: FrontierWithHistory, checkpoint_store: CheckpointStore
    ) -> None:
        async with together(pairs):
            declined = await self._pair(pairs, MemoryHistoryStore(), "r", 1, None)
        assert declined is None
        assert await checkpoint_store.latest(T, "r") is None
