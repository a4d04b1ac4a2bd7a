"""When ``--accept-revision`` refuses (``run/upgrade.revision_differences``): each way an
outstanding or in-flight call's tool can differ is named; a harmless change is none."""

from __future__ import annotations

import dataclasses

import pytest

from booking import Airline, booking_agent
from tesserix_adk import (
    Agent,
    AgentRunner,
    Checkpoint,
    CheckpointStatus,
    PendingApproval,
    ScriptedProvider,
    ToolCall,
    tool,
)
from tesserix_adk.checkpoint.payload import OutstandingCall
from tesserix_adk.errors import ResumeConflictError
from tesserix_adk.run.attempt import RunClaim
from tesserix_adk.run.upgrade import accept_revision, accepted_revisions, revision_differences
from tesserix_adk.stores.protocols import IdempotencyRecord, RecordStatus, ToolFlags
from tesserix_adk.stores.urls import open_stores


@tool
def book(flight: str) -> str:
    """Book."""
    return flight


@tool(side_effects=False)
def search(origin: str) -> str:
    """Search."""
    return origin


def _frontier(*outstanding: OutstandingCall, pending: tuple[str, ...] = ()) -> Checkpoint:
    return Checkpoint(
        tenant="t",
        run_id="r",
        agent_name="a",
        agent_revision="old",
        step=3,
        status=CheckpointStatus.waiting_approval if pending else CheckpointStatus.running,
        messages=(),
        outstanding=outstanding,
        pending_approval=PendingApproval(id="req", calls=pending) if pending else None,
    )


def _out(name: str, call_id: str, *, key: str | None = "k1:x", **flags: bool) -> OutstandingCall:
    return OutstandingCall(call=ToolCall(id=call_id, name=name), key=key, **flags)


def test_a_changed_instruction_with_the_same_tools_differs_in_nothing() -> None:
    agent = Agent("a", "new words", [book, search])
    cp = _frontier(_out("book", "c1"), _out("search", "c2", side_effects=False))
    assert revision_differences(cp, agent, []) == []


def test_each_difference_is_named() -> None:
    @tool(idempotent=True)
    def book(flight: str) -> str:  # same name, now idempotent
        """Book."""
        return flight

    @tool(key=None, side_effects=False)
    def search(origin: str) -> str:  # now unkeyed
        """Search."""
        return origin

    agent = Agent("a", "x", [book, search])
    cp = _frontier(
        _out("book", "c1"),
        _out("search", "c2", side_effects=False),
        _out("gone", "c3"),
    )
    assert revision_differences(cp, agent, []) == [
        "book (c1): idempotent was False, now True",
        "search (c2): keyed was True, now False",
        "gone (c3): the tool no longer exists",
    ]
    assert revision_differences(cp, Agent("b", "x", [book, search]), [])[0] == (
        "the run belongs to agent 'a', not 'b'"
    )


def test_a_pending_approval_whose_tool_no_longer_asks_for_one_differs() -> None:
    @tool(requires_approval=True)
    def refund(order: str) -> str:
        """Refund."""
        return order

    cp = _frontier(_out("refund", "c1"), pending=("c1",))
    assert revision_differences(cp, Agent("a", "x", [refund]), []) == []
    assert revision_differences(cp, Agent("a", "x", [book]), []) == [
        "refund (c1): the tool no longer exists"
    ]

    @tool(name="refund")  # the same tool, no longer asking for approval
    def refund_now(order: str) -> str:
        """Refund."""
        return order

    assert revision_differences(cp, Agent("a", "x", [refund_now]), []) == [
        "refund (c1): requires_approval was True, now False"
    ]


def test_an_in_flight_record_whose_flags_changed_differs() -> None:
    record = IdempotencyRecord(
        key="k1:y",
        status=RecordStatus.in_flight,
        holder="h",
        tenant="t",
        run_id="r",
        tool="search",
        call_id="c9",
        flags=ToolFlags(side_effects=True, idempotent=False),
    )
    agent = Agent("a", "x", [book, search])
    assert revision_differences(_frontier(), agent, [record]) == [
        "search (c9) (in flight): side_effects was True, now False"
    ]
    done = dataclasses.replace(record, status=RecordStatus.completed)
    assert revision_differences(_frontier(), agent, [done]) == []  # settled: nothing to plan


async def test_accepting_rewrites_the_frontier_once_and_a_live_resumer_refuses_it() -> None:
    stores = open_stores("memory://")
    airline = Airline()
    turns = [[("book_seat", {"flight": "LH1"})], "Booked."]
    old = booking_agent(airline, approval=True, revision="v1")
    new = booking_agent(airline, approval=True, revision="v2")
    runner = AgentRunner.from_stores(ScriptedProvider(turns), stores)
    waiting = await runner.run(old, "book", tenant="t", run_id="r")
    assert waiting.pending_approval is not None
    before = await runner.checkpoints.latest("t", "r")  # type: ignore[union-attr]
    other = RunClaim(stores.idempotency, tenant="t", run_id="r", holder="other", ttl=60)
    await other.take()
    with pytest.raises(ResumeConflictError):
        await accept_revision(runner, new, "r", tenant="t", by="erin")
    await other.release()
    accepted = await accept_revision(runner, new, "r", tenant="t", by="erin", note="why")
    assert accepted is not None and (accepted.from_revision, accepted.to_revision) == ("v1", "v2")
    after = await runner.checkpoints.latest("t", "r")  # type: ignore[union-attr]
    assert before is not None and after is not None
    assert (after.agent_revision, after.step) == ("v2", before.step + 1)
    assert after.pending_approval == before.pending_approval
    assert after.outstanding == before.outstanding
    assert await accept_revision(runner, new, "r", tenant="t", by="erin") is None
    assert [a.by for a in await accepted_revisions(stores.idempotency, "t", "r")] == ["erin"]
    assert airline.bookings == []  # accepting sends nothing
