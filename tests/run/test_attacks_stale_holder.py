"""Attacks: an attempt that no longer holds its run (its lease lapsed or was taken while it
waited on a slow store, a slow model) must not take a decision only the live holder may:
refuse in doubt, declare the run diverged, park it, or tell a person it must decide.

The rig is ``tests/run/test_superseded_refusal.py``'s: store wrappers that hold one
attempt's replies back (gates), a short lease ttl, and a second runner that takes the run
meanwhile.

Three defects were found here as strict xfails and are fixed (markers removed): a stale
attempt declared the run diverged (a late read of the cancel request after its model
answered), so a worker parked a run another worker had finished; and it returned the run
as waiting on a person (a late read of the approval) and took it out of the work index
while the live holder sent the approved call. An attempt now says ``LeaseLostError``
instead when its lease may have lapsed (``run/holding.py`` ``_told_while_held``, and
``AgentRunner._settled`` for a waiting run).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from run.helpers import Asks, at, faulty_runner, fresh_stores
from run.shared_key import EVERY, RESULTS_ONLY, T
from run.stale import POLICY, TTL, Late, runner_over
from tesserix_adk import (
    Agent,
    LeaseLostError,
    ModelRequest,
    ModelResponse,
    Reconciled,
    ToolCall,
    ToolContext,
    tool,
)
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.stores.protocols import WorkState
from tesserix_adk.testing.faults import SimulatedCrash
from tesserix_adk.worker import Worker


class Answered:
    """A model that sets ``answered`` once it has answered."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.answered = asyncio.Event()

    async def complete(self, request: ModelRequest) -> ModelResponse:
        response: ModelResponse = await self.inner.complete(request)
        self.answered.set()
        return response


def booker(sent: list[str]) -> Agent:
    @tool(key=lambda **kw: f"order-{kw['arguments']['order']}")
    async def book(order: str, ctx: ToolContext) -> str:
        """Book an order."""
        sent.append(f"order {order} fence {ctx.fence}")
        return f"booked {order}"

    return Agent("shop", "Book it.", [book])


C1 = ToolCall(id="c1", name="book", arguments={"order": "1"})
C2 = ToolCall(id="c2", name="book", arguments={"order": "2"})
C3 = ToolCall(id="c3", name="book", arguments={"order": "3"})


async def went_ahead(stores: Stores, agent: Agent) -> None:
    """A run whose frontier is ``after_tool_result`` of iteration 0 (c1 booked) and whose
    dead attempt booked c2 at iteration 1 before it could write the next frontier: c2 is
    recorded ahead of the frontier."""
    model = Asks([C1], [C2], "done")
    runner = faulty_runner(
        stores,
        model,
        crash_before=at("after_tool_result", 1),
        lease_policy=POLICY,
        policy=RESULTS_ONLY,
    )
    with pytest.raises(SimulatedCrash):
        await runner.run(agent, "go", tenant=T, run_id="r")


@pytest.mark.parametrize("where", EVERY)
@pytest.mark.parametrize("answer", ["done", "another call"])
async def test_a_superseded_attempt_does_not_declare_the_run_diverged(
    where: str, answer: str, tmp_path: Path
) -> None:
    sent: list[str] = []
    agent = booker(sent)
    async with fresh_stores(where, tmp_path) as stores:
        await went_ahead(stores, agent)
        assert len(sent) == 2

        # The stale attempt's model answers without asking for c2 again (a model need not
        # answer the same twice): its last answer, or another call in c2's place. The live
        # holder's asks for c2 again, as the run did.
        second: list[ToolCall] | str = "done" if answer == "done" else [C3]
        old_model = Answered(Asks([C1], second))
        old_ids, old_leases = Late(stores.idempotency), Late(stores.leases)
        old_ids.partner = old_leases
        old_ids.gate_cancel = old_model.answered
        old = asyncio.create_task(
            runner_over(stores, old_model, old_ids, old_leases).resume(agent, "r", tenant=T)
        )
        await asyncio.wait_for(old_ids.reading.wait(), 10)
        await asyncio.sleep(TTL * 2)  # its lease and resume claim lapse meanwhile

        new_model = Asks([C1], [C2], "done")
        finished = await asyncio.wait_for(
            runner_over(stores, new_model, stores.idempotency, stores.leases).resume(
                agent, "r", tenant=T
            ),
            10,
        )
        assert str(finished.status) == "completed"
        old_ids.heal()
        with pytest.raises(LeaseLostError):
            await asyncio.wait_for(old, 10)
        assert len(sent) == 2, sent  # c2 replayed, never sent again


@pytest.mark.parametrize("where", ["memory", "sqlite"])
async def test_a_worker_does_not_park_a_run_another_worker_finished(
    where: str, tmp_path: Path
) -> None:
    sent: list[str] = []
    agent = booker(sent)
    async with fresh_stores(where, tmp_path) as stores:
        await went_ahead(stores, agent)
        old_model = Answered(Asks([C1], "done"))
        old_ids, old_leases = Late(stores.idempotency), Late(stores.leases)
        old_ids.partner = old_leases
        old_ids.gate_cancel = old_model.answered
        worker = Worker(runner_over(stores, old_model, old_ids, old_leases), [agent])
        assert await worker.poll() == 1  # the run its dead holder left wants a worker
        await asyncio.wait_for(old_ids.reading.wait(), 10)
        await asyncio.sleep(TTL * 2)

        new_model = Asks([C1], [C2], "done")
        finished = await asyncio.wait_for(
            runner_over(stores, new_model, stores.idempotency, stores.leases).resume(
                agent, "r", tenant=T
            ),
            10,
        )
        assert str(finished.status) == "completed"
        old_ids.heal()
        for _ in range(200):
            if worker.carried:
                break
            await asyncio.sleep(0.05)
        [(_, how)] = worker.carried
        parked = await stores.work.items(T, state=WorkState.parked)
        assert parked == [], [p.reason for p in parked]
        assert str(how) == "elsewhere"


class EarlyRead:
    """An approval store whose ``get`` is answered now but heard late: the reply waits on
    ``gate``, and meanwhile ``stalled`` (the same attempt's other stores) stop answering."""

    def __init__(self, inner: Any, *stalled: Late) -> None:
        self.inner = inner
        self.stalled = stalled
        self.gate = asyncio.Event()
        self.reading = asyncio.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def get(self, tenant: str, id: str) -> Any:
        found = await self.inner.get(tenant, id)
        for store in self.stalled:
            store.stall = True
        self.reading.set()
        await self.gate.wait()
        return found


@pytest.mark.parametrize("where", EVERY)
async def test_a_superseded_attempt_does_not_say_the_run_waits_on_a_person(
    where: str, tmp_path: Path
) -> None:
    sent: list[str] = []
    in_tool, go_on = asyncio.Event(), asyncio.Event()

    @tool(key=lambda **kw: f"order-{kw['arguments']['order']}", requires_approval=True)
    async def pay(order: str, ctx: ToolContext) -> str:
        """Pay an order."""
        sent.append(f"fence {ctx.fence}")
        in_tool.set()
        await go_on.wait()
        return f"paid {order}"

    agent = Agent("shop", "Pay it.", [pay])
    call = ToolCall(id="c1", name="pay", arguments={"order": "1"})
    async with fresh_stores(where, tmp_path) as stores:
        model = Asks([call], "done")
        plain = runner_over(stores, model, stores.idempotency, stores.leases)
        waiting = await plain.run(agent, "go", tenant=T, run_id="r")
        assert waiting.pending_approval is not None

        old_ids, old_leases = Late(stores.idempotency), Late(stores.leases)
        old_runner = runner_over(stores, model, old_ids, old_leases)
        late = EarlyRead(stores.approvals, old_ids, old_leases)
        old_runner.approvals = late
        old = asyncio.create_task(old_runner.resume(agent, "r", tenant=T))
        await asyncio.wait_for(late.reading.wait(), 10)  # it read "pending"; the reply is late
        await asyncio.sleep(TTL * 2)  # its lease and resume claim lapse meanwhile

        await stores.approvals.decide(T, waiting.pending_approval.id, approved=True, by="alice")
        new = asyncio.create_task(
            runner_over(stores, model, stores.idempotency, stores.leases).resume(
                agent, "r", tenant=T
            )
        )
        await asyncio.wait_for(in_tool.wait(), 10)  # the live holder is paying
        late.gate.set()
        old_ids.heal()
        old_leases.heal()
        [told] = await asyncio.gather(asyncio.wait_for(old, 10), return_exceptions=True)
        carried = [i.run_id for i in await stores.work.items(T)]
        go_on.set()
        finished = await asyncio.wait_for(new, 10)
        assert str(finished.status) == "completed"
        assert len(sent) == 1, sent
        assert carried == ["r"], "the run a live holder carries wants a worker should it die"
        assert isinstance(told, LeaseLostError), told


@pytest.mark.parametrize("where", EVERY)
async def test_a_run_retried_and_superseded_while_reading_says_so(
    where: str, tmp_path: Path
) -> None:
    """Held: ``run()`` plans the records of a run without a frontier and, superseded while
    it read them, stops with ``LeaseLostError`` rather than refuse the live holder's call."""
    sent: list[str] = []
    in_tool, go_on = asyncio.Event(), asyncio.Event()

    @tool(key=lambda **kw: f"order-{kw['arguments']['order']}")
    async def book(order: str, ctx: ToolContext) -> str:
        """Book an order."""
        sent.append(f"fence {ctx.fence}")
        in_tool.set()
        await go_on.wait()
        return f"booked {order}"

    agent = Agent("shop", "Book it.", [book])
    async with fresh_stores(where, tmp_path) as stores:
        model = Asks([C1], "done")
        old_ids, old_leases = Late(stores.idempotency), Late(stores.leases)
        old_ids.partner = old_leases
        old_ids.gate_records = True
        old = asyncio.create_task(
            runner_over(stores, model, old_ids, old_leases).run(agent, "go", tenant=T, run_id="r")
        )
        await asyncio.wait_for(old_ids.reading.wait(), 10)
        await asyncio.sleep(TTL * 2)
        new = asyncio.create_task(
            runner_over(stores, model, stores.idempotency, stores.leases).run(
                agent, "go", tenant=T, run_id="r"
            )
        )
        await asyncio.wait_for(in_tool.wait(), 10)
        old_ids.heal()
        with pytest.raises(LeaseLostError):
            await asyncio.wait_for(old, 10)
        go_on.set()
        assert str((await asyncio.wait_for(new, 10)).status) == "completed"
        assert len(sent) == 1, sent


@pytest.mark.parametrize("where", ["memory", "sqlite"])
async def test_a_superseded_resume_asks_no_reconciler_about_the_live_holders_call(
    where: str, tmp_path: Path
) -> None:
    """Held: a resume that read the live holder's claim late asks the tool's reconciler
    nothing and records nothing (its guard stops it: ``LeaseLostError``)."""
    sent: list[str] = []
    asked: list[str] = []
    in_tool, go_on = asyncio.Event(), asyncio.Event()

    def reconcile(call: ToolCall, ctx: ToolContext) -> Reconciled:
        asked.append(call.id)
        return Reconciled.never_ran()

    @tool(key=lambda **kw: f"order-{kw['arguments']['order']}", reconcile=reconcile)
    async def book(order: str, ctx: ToolContext) -> str:
        """Book an order."""
        sent.append(f"fence {ctx.fence}")
        in_tool.set()
        await go_on.wait()
        return f"booked {order}"

    agent = Agent("shop", "Book it.", [book])
    async with fresh_stores(where, tmp_path) as stores:
        model = Asks([C1], "done")
        dying = Late(stores.idempotency)
        dying.die_at_claim = True
        with pytest.raises(SimulatedCrash):  # the frontier names c1; its claim never landed
            await runner_over(stores, model, dying, stores.leases).run(
                agent, "go", tenant=T, run_id="r"
            )
        old_ids, old_leases = Late(stores.idempotency), Late(stores.leases)
        old_ids.partner = old_leases
        old_ids.gate_lookup = True
        old_runner = runner_over(stores, model, old_ids, old_leases)
        old_runner.never_ran_margin = 0.0
        old = asyncio.create_task(old_runner.resume(agent, "r", tenant=T))
        await asyncio.wait_for(old_ids.reading.wait(), 10)
        await asyncio.sleep(TTL * 2)
        new = asyncio.create_task(
            runner_over(stores, model, stores.idempotency, stores.leases).resume(
                agent, "r", tenant=T
            )
        )
        await asyncio.wait_for(in_tool.wait(), 10)
        old_ids.heal()
        with pytest.raises(LeaseLostError):
            await asyncio.wait_for(old, 10)
        go_on.set()
        assert str((await asyncio.wait_for(new, 10)).status) == "completed"
        assert asked == [] and len(sent) == 1, (asked, sent)
