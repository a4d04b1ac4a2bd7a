"""Attacks on the runner's first promise, tried as a careful user and as an attacker would.

Each test names what the kit must do; those marked DEFECT failed on the runner package as
first written (the report of the attack names the cause), the others are regressions of
attacks it withstood.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from booking import BOOK_TURNS, Airline, booking_agent
from tesserix_adk import (
    Agent,
    AgentRunner,
    Boundary,
    Checkpointer,
    CheckpointPolicy,
    IndeterminateToolCallError,
    LeaseLostError,
    LeasePolicy,
    Message,
    MemoryApprovalStore,
    MemoryCheckpointStore,
    MemoryIdempotencyStore,
    MemoryLeaseStore,
    ModelRequest,
    ModelResponse,
    RunStatus,
    ScriptedProvider,
    StoreUnavailableError,
    ToolCall,
    tool,
)
from tesserix_adk.stores import open_stores
from tesserix_adk.testing.faults import (
    FaultyCheckpointStore,
    FaultyIdempotencyStore,
    SimulatedCrash,
)

ONLY_TOOL_RESULTS = CheckpointPolicy(boundaries=frozenset({Boundary.after_tool_result}))

# A deadline for a hang, never a measure of speed: a run that should take milliseconds.
HANG = 5.0


def _at(boundary: str, iteration: int) -> Any:
    return lambda body: body.get("boundary") == boundary and body.get("iteration") == iteration


class _Recording:
    """A provider that keeps every request it was sent."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.requests: list[ModelRequest] = []

    async def complete(self, request: ModelRequest) -> ModelResponse:
        self.requests.append(request)
        response: ModelResponse = await self.inner.complete(request)
        return response


def _answers(request: ModelRequest, name: str) -> list[Any]:
    ids = {c.id for m in request.messages for c in m.tool_calls if c.name == name}
    return [m for m in request.messages if m.tool_call_id in ids]


# --- a sync tool that raises StopIteration ---------------------------------------------


async def test_a_sync_tool_raising_stop_iteration_is_an_error_outcome_not_a_hang() -> None:
    """DEFECT. ``next(iter([]))`` in a sync tool is an ordinary bug; asyncio cannot put a
    StopIteration into a future, so ``asyncio.to_thread`` never resolves and the run hangs
    for ever (renewing its lease for ever). SPEC §2: an ``Exception`` raised by a tool is
    that call's error outcome."""

    @tool(side_effects=False)
    def first_flight(dest: str) -> str:
        """The first flight to a destination."""
        return str(next(iter([])))

    agent = Agent("flights", "Find.", [first_flight])
    provider = _Recording(ScriptedProvider([[("first_flight", {"dest": "JFK"})], "none"]))
    runner = AgentRunner(provider, idempotency=MemoryIdempotencyStore())
    run = await asyncio.wait_for(runner.run(agent, "go", tenant="acme", run_id="r"), HANG)
    assert run.status is RunStatus.completed
    [answer] = _answers(provider.requests[-1], "first_flight")
    assert answer.is_error and "StopIteration" in answer.text


# --- approvals: dying between the request and its frontier -----------------------------


class _CountingApprovals:
    """The approval store, with every request it was asked to record."""

    def __init__(self) -> None:
        self.inner = MemoryApprovalStore()
        self.requested: list[str] = []

    async def request(
        self,
        tenant: str,
        run_id: str,
        calls: Sequence[ToolCall],
        *,
        iteration: int,
        fence: int | None = None,
        id: str | None = None,
    ) -> Any:
        request = await self.inner.request(
            tenant, run_id, calls, iteration=iteration, fence=fence, id=id
        )
        self.requested.append(request.id)
        return request

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class _FreshCallIds:
    """A model that, like a real one, gives every tool call a new id each time it is asked."""

    def __init__(self, turns: list[Any]) -> None:
        self.inner = ScriptedProvider(turns)
        self.asked = 0

    async def complete(self, request: ModelRequest) -> ModelResponse:
        self.asked += 1
        response: ModelResponse = await self.inner.complete(request)
        message = response.message
        calls = [
            ToolCall(id=f"toolu_{self.asked}_{i}", name=c.name, arguments=c.arguments)
            for i, c in enumerate(message.tool_calls)
        ]
        return ModelResponse(
            message=Message.assistant(message.text, calls),
            usage=response.usage,
            cost_micros=response.cost_micros,
        )


async def test_a_request_orphaned_by_a_death_is_found_again_when_the_model_is_asked_again(
    airline: Airline,
) -> None:
    """DEFECT (issue 11 point 7). The process dies after the approval request was recorded
    and before the ``before_approval`` frontier; the operator approves the request they
    were shown. With a policy that skips ``after_model_call`` the resume asks the model
    again, and a real model names its calls with new ids: the request must still be found
    (keyed like the calls, by what is asked, never by the provider's call ids — SPEC §3
    "Default key"), not asked again under a new id nobody will ever decide."""
    store = FaultyCheckpointStore(MemoryCheckpointStore(), crash_before=_at("before_approval", 1))
    approvals = _CountingApprovals()
    idem = MemoryIdempotencyStore()

    def runner() -> AgentRunner:
        return AgentRunner(
            _FreshCallIds(BOOK_TURNS),
            idempotency=idem,
            checkpoints=Checkpointer(store, policy=ONLY_TOOL_RESULTS),
            approvals=approvals,  # type: ignore[arg-type]
        )

    agent = booking_agent(airline, approval=True)
    with pytest.raises(SimulatedCrash):
        await runner().run(agent, "book", tenant="acme", run_id="r")
    [orphan] = approvals.requested
    await approvals.inner.decide("acme", orphan, approved=True, by="ops")
    store.crash_before = None
    run = await runner().resume(agent, "r", tenant="acme")
    assert set(approvals.requested) == {orphan}
    assert run.status is RunStatus.completed
    assert airline.bookings == ["LH123"]


# --- run() retried when no frontier could be written -----------------------------------


class _Flaky:
    """A model that fails once at one iteration and answers a different script after."""

    def __init__(self, first: list[Any], then: list[Any], *, fail_at: int) -> None:
        self.first = ScriptedProvider(first)
        self.then = ScriptedProvider(then)
        self.fail_at = fail_at
        self.failed = False

    async def complete(self, request: ModelRequest) -> ModelResponse:
        if not self.failed:
            if request.iteration == self.fail_at:
                self.failed = True
                raise ConnectionResetError("peer reset")
            return await self.first.complete(request)
        return await self.then.complete(request)


async def test_run_retried_after_an_unwritable_frontier_does_not_book_a_different_seat(
    airline: Airline,
) -> None:
    """DEFECT. The checkpoint store is down (a checkpoint failure never fails the live run,
    SPEC §1.3), so no frontier exists; the seat is booked, then the model is unreachable
    (retryable). ``resume`` has nothing to read, so the caller retries ``run``: that
    attempt ignores the records the first one left and, when the (non-deterministic)
    model now asks for another seat, books it. SPEC §3 calls records past the frontier
    "ahead" and a turn asking for other side effects than those that ran "diverged":
    refuse before dispatching, never a second booking."""
    store = FaultyCheckpointStore(
        MemoryCheckpointStore(), fail_with=StoreUnavailableError("checkpoint store down")
    )
    other = [BOOK_TURNS[0], [("book_seat", {"flight": "UA456"})], "Booked UA456."]
    provider = _Flaky(BOOK_TURNS, other, fail_at=2)
    runner = AgentRunner(
        provider, idempotency=MemoryIdempotencyStore(), checkpoints=Checkpointer(store)
    )
    agent = booking_agent(airline)
    with pytest.raises(Exception) as first:
        await runner.run(agent, "book", tenant="acme", run_id="r")
    assert getattr(first.value, "retryable", False) is True
    assert airline.bookings == ["LH123"]
    store.fail_with = None
    try:
        await runner.run(agent, "book", tenant="acme", run_id="r")
    except Exception as exc:
        assert getattr(exc, "retryable", True) is False
    assert airline.bookings == ["LH123"]
