"""PostgreSQL writes a frontier and the transcript append it names together
(``FrontierWithHistory``) inside a write group: one savepoint of the group's transaction,
sent in one round trip (what every backend's pair promises, both or neither, is the
conformance suite's: ``tesserix_adk.testing.frontier_with_history``). Outside a group it
declines, and the caller writes them one after the other: alone, the pair would hold a
transaction open between round trips, where nothing bounds a frozen holder."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest

from adapters import services
from tesserix_adk.adapters.postgres import open_postgres_stores
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
