"""A run whose call another run is sending under the same business key is told to come
back (``ResumeConflictError``, retryable), not refused in doubt and parked: once the other
run has its outcome, carrying this run on replays it; if the other run died with the call
in hand, the call is in doubt as before. On memory and on SQLite."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from tesserix_adk import (
    Agent,
    AgentRunner,
    Carried,
    IndeterminateToolCallError,
    LeasePolicy,
    RunStatus,
    ScriptedProvider,
    ToolContext,
    Worker,
    WorkState,
    open_stores,
    tool,
)
from tesserix_adk.errors import ResumeConflictError
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.testing.faults import SimulatedCrash

T = "acme"
TURNS: list[Any] = [[("charge", {"order": "5"})], "done"]


class Shop:
    """The payment system: what it charged, and a gate that holds run r1 inside the call."""

    def __init__(self) -> None:
        self.charged: list[str] = []
        self.inside = asyncio.Event()
        self.gate = asyncio.Event()
        self.die_in: str | None = None

    def agent(self) -> Agent:
        @tool(key=lambda **kw: f"order-{kw['arguments']['order']}")
        async def charge(order: str, ctx: ToolContext) -> dict[str, str]:
            """Charge an order."""
            if ctx.run_id == "r1":
                self.inside.set()
                await self.gate.wait()
                if self.die_in == "r1":
                    raise SimulatedCrash("r1 died with the call in hand")
            assert ctx.idempotency_key is not None
            self.charged.append(ctx.idempotency_key)
            return {"charged": order, "by": ctx.run_id}

        return Agent("shop", "Charge.", [charge])


@pytest.fixture(params=["memory", "sqlite"])
async def stores(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Stores]:
    url = "memory://" if request.param == "memory" else f"sqlite:///{tmp_path / 'a.sqlite3'}"
    async with open_stores(url) as opened:
        await opened.create_schema()
        yield opened


def _runner(stores: Stores, ttl: float = 2.0) -> AgentRunner:
    return AgentRunner.from_stores(
        ScriptedProvider(list(TURNS)),
        stores,
        lease_policy=LeasePolicy(ttl=ttl, renew_within=ttl / 2),
        never_ran_margin=0.0,
    )


async def test_a_run_meeting_a_live_runs_claim_comes_back_and_replays_its_outcome(
    stores: Stores,
) -> None:
    shop = Shop()
    agent = shop.agent()
    r1 = asyncio.create_task(_runner(stores).run(agent, "go", tenant=T, run_id="r1"))
    await asyncio.wait_for(shop.inside.wait(), 10)
    with pytest.raises(ResumeConflictError, match="r1") as met:
        await _runner(stores).run(agent, "go", tenant=T, run_id="r2")
    assert met.value.retryable
    # Carried on while r1 still sends it: the same answer, nothing sent.
    with pytest.raises(ResumeConflictError, match="r1"):
        await _runner(stores).resume(agent, "r2", tenant=T)
    shop.gate.set()
    assert (await asyncio.wait_for(r1, 10)).status is RunStatus.completed
    run = await _runner(stores).resume(agent, "r2", tenant=T)
    assert run.status is RunStatus.completed
    assert shop.charged == ["acme/order-5"]  # once, by r1; r2 replayed its outcome


async def test_a_claim_whose_run_died_with_it_in_hand_is_in_doubt_not_waited_on(
    stores: Stores,
) -> None:
    shop = Shop()
    shop.die_in = "r1"
    agent = shop.agent()
    r1 = asyncio.create_task(_runner(stores, ttl=0.4).run(agent, "go", tenant=T, run_id="r1"))
    await asyncio.wait_for(shop.inside.wait(), 10)
    shop.gate.set()
    with pytest.raises(SimulatedCrash):
        await asyncio.wait_for(r1, 10)
    # r1's claim stays in flight; its lease is let go (or lapses): nobody is sending it.
    deadline = time.monotonic() + 10
    while await stores.leases.current(T, "r1") is not None:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)
    with pytest.raises(IndeterminateToolCallError, match="r1") as doubt:
        await _runner(stores).run(agent, "go", tenant=T, run_id="r2")
    assert re.search(r"claimed in flight by run 'r1' \(\S+, fence \d+\), another", str(doubt.value))
    assert shop.charged == []


async def test_a_worker_carrying_such_a_run_looks_again_later_instead_of_parking_it(
    stores: Stores,
) -> None:
    shop = Shop()
    agent = shop.agent()
    r1 = asyncio.create_task(_runner(stores).run(agent, "go", tenant=T, run_id="r1"))
    await asyncio.wait_for(shop.inside.wait(), 10)
    with pytest.raises(ResumeConflictError):
        await _runner(stores).run(agent, "go", tenant=T, run_id="r2")
    assert stores.work is not None
    worker = Worker(_runner(stores, ttl=0.4), [agent], poll_interval=0.01)
    running = asyncio.create_task(worker.run())
    try:
        deadline = time.monotonic() + 10
        while not any(run_id == "r2" for (_, run_id), _ in _carried(worker)):
            assert time.monotonic() < deadline, worker.carried
            await asyncio.sleep(0.02)
        assert [how for (_, run_id), how in _carried(worker) if run_id == "r2"] == [
            Carried.elsewhere
        ]
        (item,) = [i for i in await stores.work.items(T) if i.run_id == "r2"]
        assert item.state is not WorkState.parked
        shop.gate.set()
        await asyncio.wait_for(r1, 10)
        while Carried.finished not in [h for (_, rid), h in _carried(worker) if rid == "r2"]:
            assert time.monotonic() < deadline + 20, worker.carried
            await asyncio.sleep(0.02)
    finally:
        worker.drain()
        await asyncio.wait_for(running, 30)
    assert shop.charged == ["acme/order-5"]


def _carried(worker: Worker) -> list[tuple[tuple[str, str], Carried]]:
    return [((item.tenant, item.run_id), how) for item, how in worker.carried]
