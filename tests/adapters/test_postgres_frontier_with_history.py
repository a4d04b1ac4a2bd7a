"""PostgreSQL writes a frontier and the transcript append it names together
(``FrontierWithHistory``): one transaction sent in one round trip, or one savepoint of a
write group. Either refused, neither is written, alone or in a group."""

from __future__ import annotations

import pytest

from tesserix_adk.adapters.postgres import open_postgres_stores
from tesserix_adk.errors import HistoryUnavailableError, StaleFenceError
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.stores.grouping import group_scope
from tesserix_adk.stores.memory import MemoryHistoryStore
from tesserix_adk.stores.protocols import FrontierWithHistory, HistoryHandle

pytestmark = pytest.mark.postgres

T = "acme"


async def _first(stores: Stores, run_id: str) -> HistoryHandle:
    checkpoints = stores.checkpoints
    assert isinstance(checkpoints, FrontierWithHistory)
    handle = await checkpoints.put_with_history(
        stores.history, T, run_id, b"frontier-1", step=1, fence=1, encoded=[b"m1"], after=None
    )
    assert handle is not None and handle.count == 1
    return handle


async def _second(stores: Stores, run_id: str, after: HistoryHandle) -> HistoryHandle | None:
    checkpoints = stores.checkpoints
    assert isinstance(checkpoints, FrontierWithHistory)
    return await checkpoints.put_with_history(
        stores.history, T, run_id, b"frontier-2", step=2, fence=1, encoded=[b"m2"], after=after
    )


async def _untouched(stores: Stores, run_id: str, handle: HistoryHandle) -> None:
    latest = await stores.checkpoints.latest(T, run_id)
    assert latest is not None and latest.payload == b"frontier-1"
    assert await stores.history.fetch(handle) == [b"m1"]
    longer = HistoryHandle(tenant=T, run_id=run_id, count=2, digest=handle.digest)
    with pytest.raises(HistoryUnavailableError):
        await stores.history.fetch(longer)


@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("refused", ["transcript", "frontier"])
async def test_either_half_refused_writes_neither(
    pg_stores: Stores, grouped: bool, refused: str
) -> None:
    run_id = f"r-{refused}-{grouped}"
    handle = await _first(pg_stores, run_id)
    # A newer holder fenced one store out (each store keeps its own highest fence).
    sealed = pg_stores.history if refused == "transcript" else pg_stores.checkpoints
    await sealed.seal(T, run_id, 2)
    if not grouped:
        with pytest.raises(StaleFenceError):
            await _second(pg_stores, run_id, handle)
        await _untouched(pg_stores, run_id, handle)
        return
    with group_scope():
        group = pg_stores.history.write_group()  # type: ignore[attr-defined]
        await group.begin()
        with pytest.raises(StaleFenceError):
            await _second(pg_stores, run_id, handle)
        # The group goes on: what joins it afterwards commits, the refused pair never.
        await pg_stores.checkpoints.put(T, "other", b"other-1", step=1, fence=None)
        await group.commit()
    await _untouched(pg_stores, run_id, handle)
    other = await pg_stores.checkpoints.latest(T, "other")
    assert other is not None and other.payload == b"other-1"


async def test_both_halves_are_written_together_alone_and_in_a_group(pg_stores: Stores) -> None:
    handle = await _first(pg_stores, "alone")
    second = await _second(pg_stores, "alone", handle)
    assert second is not None and await pg_stores.history.fetch(second) == [b"m1", b"m2"]
    with group_scope():
        group = pg_stores.history.write_group()  # type: ignore[attr-defined]
        await group.begin()
        handle = await _first(pg_stores, "grouped")
        second = await _second(pg_stores, "grouped", handle)
        await group.commit()
    assert second is not None and await pg_stores.history.fetch(second) == [b"m1", b"m2"]
    latest = await pg_stores.checkpoints.latest(T, "grouped")
    assert latest is not None and latest.payload == b"frontier-2"


async def test_a_history_store_elsewhere_is_written_by_the_caller(
    pg_stores: Stores, pg_url: str
) -> None:
    checkpoints = pg_stores.checkpoints
    assert isinstance(checkpoints, FrontierWithHistory)
    other = open_postgres_stores(pg_url)  # the same server, another pool and database object
    try:
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
