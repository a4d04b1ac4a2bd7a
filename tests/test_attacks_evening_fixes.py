"""The evening's fixes, attacked: a tool result converted in a worker thread unless plainly
cheap (19008dc, ``run/invoking.converted``, ``checkpointer.text_weight``), a call waiting on
its failed twin under one business key (f769059, ``dispatch.call_tool``), and the state a
``Resumer`` hands a driver (9e9bb8a, ``run/resume.carried_state``).

Attacked: results that pass ``_cheap`` yet are large (one multi-MB text, 64 ints near the
digit limit, floats) under ``LeasePolicy(ttl=0.5, renew_within=0.25)``; a run cancelled
while its result is converted in the thread; three calls under one key in a parallel turn
whose first ends in a tool error; the ``Resumer``'s state beside another run's completion
under a shared key.

Held: a flat result of 64 ints near the digit limit and floats completes under the short
lease; three calls under one key whose tool raises (a tool error outcome, not a failure)
are none of them refused: side by side they go exactly as one at a time (each sent, each
recorded completed); a run cancelled while its result is converted never sends the call
again and gives its lease back; the ``Resumer`` never hands another run's state as this
run's.

Found, and fixed (their tests pass now):

* MEDIUM: one text of about 25 MB returned by a tool (a plainly cheap result) lost a
  ``ttl=0.5`` lease: its redaction went to a worker thread (``run/recording.redacted_record``)
  but the redactor's regexes (``checkpoint/redaction``) each scan the whole text in one C
  call holding the GIL, so the event loop could not renew for seconds. A result whose text
  alone is over twice the record's cap is now replaced unscanned (it could never be kept:
  ``payload/outcomes._least_bytes``).
* MEDIUM: a run cancelled while its tool's result was converted in the worker thread
  (``run/invoking.converted``, a new await after the tool returned) left the call in doubt,
  though the kit held the result. The conversion now waits for its thread when cancelled
  and raises ``ThreadReturned`` with the content, which the dispatch unit records, as for a
  sync tool cancelled while it runs.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pydantic
import pytest

from hostile_results import run_under_short_lease
from tesserix_adk import (
    Agent,
    AgentRunner,
    Resumer,
    RunStatus,
    ScriptedProvider,
    ToolContext,
    tool,
)
from tesserix_adk.errors import IndeterminateToolCallError
from tesserix_adk.stores.protocols import RecordStatus
from tesserix_adk.stores.urls import open_stores
from tesserix_adk.testing.faults import SimulatedCrash

T = "t"


# ==========================================================================================
# 19008dc: converted off the loop
# ==========================================================================================


# A 0.5 s lease against other processes' load: in the ADK_SLOW=1 run (README, Testing);
# tests/run/test_result_content.py checks the pieces themselves in every run.
@pytest.mark.slow
def test_a_large_text_result_keeps_the_lease() -> None:
    run = asyncio.run(run_under_short_lease("x" * 25_000_000))
    assert not isinstance(run, Exception), run
    assert run.status is RunStatus.completed


def test_a_flat_result_of_big_ints_and_floats_completes_under_a_short_lease() -> None:
    value = [10**4200 + i for i in range(60)] + [1.5, float("inf"), -0.0, 10**18]
    run = asyncio.run(run_under_short_lease(value))
    assert not isinstance(run, Exception), run
    assert run.status is RunStatus.completed


class _Slow:
    """A value pydantic cannot write; its ``str`` (the fallback) waits on ``gate``."""

    def __init__(self, entered: threading.Event, gate: threading.Event) -> None:
        self.entered, self.gate = entered, gate

    def __str__(self) -> str:
        self.entered.set()
        self.gate.wait(10)
        return "receipt-1"


async def test_a_run_cancelled_while_its_result_is_converted_records_the_call() -> None:
    sent: list[str] = []
    entered, gate = threading.Event(), threading.Event()

    @tool(key=lambda **kw: "order-1")
    def book(seat: str) -> Any:
        """Book a seat (a side effect)."""
        sent.append(seat)
        return {"receipt": _Slow(entered, gate)}

    agent = Agent("a", "x", [book])
    script = [[("book", {"seat": "1A"})], "ok"]
    try:
        async with open_stores("memory://") as stores:
            await stores.create_schema()
            first = AgentRunner.from_stores(ScriptedProvider(script), stores)
            task = asyncio.ensure_future(first.run(agent, "go", tenant=T, run_id="r"))
            assert await asyncio.to_thread(entered.wait, 10)
            # The thread is let go shortly after the cancel: the cancel waits for it.
            asyncio.get_running_loop().call_later(0.2, gate.set)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            gate.set()
            # Sent once either way.
            assert sent == ["1A"]
            [rec] = await stores.idempotency.records(T, "r")
            assert rec.status is RecordStatus.completed, rec.status
            again = AgentRunner.from_stores(ScriptedProvider(script), stores)
            run = await again.resume(agent, "r", tenant=T)
    finally:
        gate.set()
    assert run.status is RunStatus.completed
    assert sent == ["1A"]


async def test_a_run_cancelled_while_its_result_is_converted_never_sends_it_twice() -> None:
    """Whatever the resume finds, the call is not sent again and the lease goes back."""
    sent: list[str] = []
    entered, gate = threading.Event(), threading.Event()

    @tool(key=lambda **kw: "order-1")
    def book(seat: str) -> Any:
        """Book a seat (a side effect)."""
        sent.append(seat)
        return {"receipt": _Slow(entered, gate)}

    agent = Agent("a", "x", [book])
    script = [[("book", {"seat": "1A"})], "ok"]
    try:
        async with open_stores("memory://") as stores:
            await stores.create_schema()
            first = AgentRunner.from_stores(ScriptedProvider(script), stores)
            task = asyncio.ensure_future(first.run(agent, "go", tenant=T, run_id="r"))
            assert await asyncio.to_thread(entered.wait, 10)
            # The thread is let go shortly after the cancel: the cancel waits for it.
            asyncio.get_running_loop().call_later(0.2, gate.set)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            gate.set()
            again = AgentRunner.from_stores(ScriptedProvider(script), stores)
            try:
                run = await again.resume(agent, "r", tenant=T)
            except IndeterminateToolCallError:
                run = None
            assert run is None or run.status is RunStatus.completed
            assert await stores.leases.current(T, "r") is None
    finally:
        gate.set()
    assert sent == ["1A"]


# ==========================================================================================
# f769059: twins under one business key
# ==========================================================================================


@pytest.mark.parametrize("side_by_side", [1, 3])
async def test_twins_whose_first_tool_raised_go_as_one_call_at_a_time_would(
    side_by_side: int,
) -> None:
    """A twin whose tool raised ended in a tool error outcome, not a failure: the calls
    waiting on it are not refused; side by side they go exactly as one at a time."""
    sent: list[str] = []

    @tool(key=lambda **kw: "order-7")
    def book(seat: str) -> str:
        """Book a seat (a side effect)."""
        sent.append(seat)
        raise ValueError("seat taken")

    agent = Agent("a", "x", [book], parallel_tool_calls=side_by_side)
    turn = [("book", {"seat": "1A"}), ("book", {"seat": "1A"}), ("book", {"seat": "1A"})]
    async with open_stores("memory://") as stores:
        await stores.create_schema()
        runner = AgentRunner.from_stores(ScriptedProvider([turn, "ok"]), stores)
        run = await runner.run(agent, "go", tenant=T, run_id="r")
        records = await stores.idempotency.records(T, "r")
    assert run.status is RunStatus.completed
    # As a turn of one call at a time does (side_by_side=1): each told its error.
    assert sent == ["1A"] * 3
    assert sorted(r.call_id for r in records) == ["call_0_0", "call_0_1", "call_0_2"]
    assert all(r.status is RecordStatus.completed for r in records)


# ==========================================================================================
# 9e9bb8a: the Resumer's state
# ==========================================================================================


class _Basket(pydantic.BaseModel):
    items: list[str] = []


async def test_the_resumer_never_hands_another_runs_state_under_a_shared_key() -> None:
    from run.helpers import at, faulty_runner

    ran: list[str] = []

    @tool(key=lambda **kw: f"order-{kw['arguments']['item']}")
    def add(item: str, ctx: ToolContext) -> str:
        """Add an item (a side effect)."""
        ran.append(item)
        ctx.state.items.append(item)
        return f"added {item}"

    agent = Agent("basket", "Fill it.", [add], state_schema=_Basket)
    turns = [[("add", {"item": "a"})], [("add", {"item": "b"})], "done"]
    async with open_stores("memory://") as stores:
        await stores.create_schema()
        other = AgentRunner.from_stores(ScriptedProvider([turns[0], "done"]), stores)
        await other.run(agent, "go", tenant=T, run_id="other", state=_Basket(items=["x"]))
        crashing = faulty_runner(
            stores, ScriptedProvider(turns), crash_before=at("after_tool_result", 0)
        )
        with pytest.raises(SimulatedCrash):
            await crashing.run(agent, "go", tenant=T, run_id="mine", state=_Basket(items=["m"]))
        carried = await Resumer.from_stores(stores).resume("mine", tenant=T, worker="w")
        await stores.leases.release(carried.lease)
    assert carried.state == {"items": ["m"]}
    assert ran == ["a"]
