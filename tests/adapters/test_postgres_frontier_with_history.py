"""PostgreSQL writes a frontier and the transcript append it names together
(``FrontierWithHistory``) inside a write group: one savepoint of the group's transaction,
sent in one round trip. Either refused, neither is written, and the group goes on. Outside
a group it declines, and the caller writes them one after the other: alone, the pair would
hold a transaction open between round trips, where nothing bounds a frozen holder."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest

from adapters import services
from tesserix_adk.adapters.postgres import open_postgres_stores
from tesserix_adk.errors import HistoryUnavailableError, StaleFenceError
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.stores.memory import MemoryHistoryStore
from tesserix_adk.stores.protocols import FrontierWithHistory, HistoryHandle

pytestmark = pytest.mark.postgres

T = "acme"


@asynccontextmanager
async def _group(stores: Stores) -> AsyncIterator[None]:
    async with services.write_group(stores) as group:
        yield
        await group.commit()


async def _pair(
    stores: Stores, run_id: str, n: int, after: HistoryHandle | None
) -> HistoryHandle | None:
    checkpoints = stores.checkpoints
    assert isinstance(checkpoints, FrontierWithHistory)
    return await checkpoints.put_with_history(
        stores.history,
        T,
        run_id,
        f"frontier-{n}".encode(),
        step=n,
        fence=1,
        encoded=[f"m{n}".encode()],
        after=after,
    )


async def _first(stores: Stores, run_id: str) -> HistoryHandle:
    async with _group(stores):
        handle = await _pair(stores, run_id, 1, None)
    assert handle is not None and handle.count == 1
    return handle


async def _untouched(stores: Stores, run_id: str, handle: HistoryHandle) -> None:
    latest = await stores.checkpoints.latest(T, run_id)
    assert latest is not None and latest.payload == b"frontier-1"
    assert await stores.history.fetch(handle) == [b"m1"]
    longer = HistoryHandle(tenant=T, run_id=run_id, count=2, digest=handle.digest)
    with pytest.raises(HistoryUnavailableError):
        await stores.history.fetch(longer)


@pytest.mark.parametrize("refused", ["transcript", "frontier"])
async def test_either_half_refused_in_a_group_writes_neither_and_the_group_goes_on(
    pg_stores: Stores, refused: str
) -> None:
    run_id = f"r-{refused}"
    handle = await _first(pg_stores, run_id)
    # A newer holder fenced one store out (each store keeps its own highest fence).
    sealed = pg_stores.history if refused == "transcript" else pg_stores.checkpoints
    await sealed.seal(T, run_id, 2)
    async with _group(pg_stores):
        with pytest.raises(StaleFenceError):
            await _pair(pg_stores, run_id, 2, handle)
        # What joins the group afterwards commits, the refused pair never.
        await pg_stores.checkpoints.put(T, "other", b"other-1", step=1, fence=None)
    await _untouched(pg_stores, run_id, handle)
    other = await pg_stores.checkpoints.latest(T, "other")
    assert other is not None and other.payload == b"other-1"


async def test_both_halves_are_written_together_in_a_group(pg_stores: Stores) -> None:
    async with _group(pg_stores):
        handle = await _pair(pg_stores, "grouped", 1, None)
        second = await _pair(pg_stores, "grouped", 2, handle)
    assert second is not None and await pg_stores.history.fetch(second) == [b"m1", b"m2"]
    latest = await pg_stores.checkpoints.latest(T, "grouped")
    assert latest is not None and latest.payload == b"frontier-2"


async def test_outside_a_group_or_with_a_history_elsewhere_the_caller_writes_them(
    pg_stores: Stores, pg_url: str
) -> None:
    assert await _pair(pg_stores, "alone", 1, None) is None
    checkpoints = pg_stores.checkpoints
    assert isinstance(checkpoints, FrontierWithHistory)
    other = open_postgres_stores(pg_url)  # the same server, another pool and database object
    try:
        async with _group(pg_stores):
            for history in (MemoryHistoryStore(), other.history):
                assert (
                    await checkpoints.put_with_history(
                        history, T, "r", b"f", step=1, fence=None, encoded=[], after=None
                    )
                    is None
                )
    finally:
        await other.aclose()
    assert await checkpoints.latest(T, "r") is None
    assert await checkpoints.latest(T, "alone") is None
