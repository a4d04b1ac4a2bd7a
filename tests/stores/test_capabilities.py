"""Optional store capabilities are asked for by type: a checkpoint store that offers only
the required four methods still runs agents, the conformance suite skips what it lacks
(saying so), and the commands that need a capability say which one is missing."""

from __future__ import annotations

import asyncio
import io
from typing import Any

import pytest

from booking import BOOK_TURNS, Airline, booking_agent
from tesserix_adk import AgentRunner, Checkpointer, ConfigurationError, ScriptedProvider
from tesserix_adk.cli import ExitCode, frontier_main
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.stores.memory import MemoryCheckpointStore
from tesserix_adk.stores.protocols import (
    CheckpointStore,
    FrontierWithHistory,
    RunListing,
    StepHistory,
    StoredCheckpoint,
)
from tesserix_adk.stores.urls import open_stores
from tesserix_adk.testing import CheckpointStoreConformance


class LatestOnly:
    """A checkpoint store with the required methods only: no steps, no listing."""

    def __init__(self) -> None:
        self._inner = MemoryCheckpointStore()

    async def put(
        self, tenant: str, run_id: str, payload: bytes, *, step: int, fence: int | None = None
    ) -> None:
        await self._inner.put(tenant, run_id, payload, step=step, fence=fence)

    async def latest(self, tenant: str, run_id: str) -> StoredCheckpoint | None:
        return await self._inner.latest(tenant, run_id)

    async def forget(self, tenant: str, run_id: str) -> None:
        await self._inner.forget(tenant, run_id)

    async def seal(self, tenant: str, run_id: str, fence: int) -> None:
        await self._inner.seal(tenant, run_id, fence)


def test_the_required_protocol_is_the_four_methods_and_nothing_optional() -> None:
    store = LatestOnly()
    assert isinstance(store, CheckpointStore)
    assert not isinstance(store, StepHistory)
    assert not isinstance(store, RunListing)
    assert not isinstance(store, FrontierWithHistory)


@pytest.mark.parametrize("url", ["memory://", "sqlite"])
def test_the_shipped_stores_offer_every_capability(url: str, tmp_path: Any) -> None:
    async def go() -> None:
        target = f"sqlite:///{tmp_path / 'adk.sqlite3'}" if url == "sqlite" else url
        async with open_stores(target) as stores:
            if url == "sqlite":
                await stores.create_schema()
            assert isinstance(stores.checkpoints, StepHistory)
            assert isinstance(stores.checkpoints, RunListing)
            if url == "sqlite":
                assert isinstance(stores.checkpoints, FrontierWithHistory)

    asyncio.run(go())


async def test_a_run_goes_on_a_store_without_optional_capabilities() -> None:
    stores = open_stores("memory://")
    store = LatestOnly()
    checkpointer = Checkpointer(store, history=stores.history)
    runner = AgentRunner(
        ScriptedProvider(BOOK_TURNS),
        idempotency=stores.idempotency,
        checkpoints=checkpointer,
        ledger=stores.ledger,
    )
    airline = Airline()
    result = await runner.run(booking_agent(airline), "book", tenant="acme", run_id="r")
    assert result.status.value == "completed"
    assert len(airline.bookings) == 1
    assert (await checkpointer.latest("acme", "r")) is not None
    with pytest.raises(ConfigurationError, match="does not offer StepHistory"):
        await checkpointer.steps("acme", "r")


def test_steps_and_runs_commands_name_the_missing_capability() -> None:
    base = open_stores("memory://")
    stores = Stores(
        checkpoints=LatestOnly(),
        idempotency=base.idempotency,
        leases=base.leases,
        history=base.history,
        ledger=base.ledger,
        approvals=base.approvals,
    )
    for argv in (["steps", "r", "--tenant", "acme"], ["runs", "--tenant", "acme"]):
        err = io.StringIO()
        code = frontier_main(argv, stores=stores, out=io.StringIO(), err=err)
        assert code == ExitCode.USAGE, err.getvalue()
        missing = "StepHistory" if argv[0] == "steps" else "RunListing"
        assert f"does not offer {missing}" in err.getvalue()
        assert err.getvalue().count("\n") == 1


class TestLatestOnlyConformance(CheckpointStoreConformance):
    """The suite on a store without the optional capabilities: their tests skip, saying
    which capability is absent; the required behaviour is still checked."""

    @pytest.fixture
    def checkpoint_store(self) -> LatestOnly:
        return LatestOnly()

    @pytest.fixture
    def make_checkpoint_store(self) -> Any:
        async def make(keep_last: int) -> LatestOnly:
            return LatestOnly()

        return make

    @pytest.fixture
    def round_trips(self) -> None:
        return None
