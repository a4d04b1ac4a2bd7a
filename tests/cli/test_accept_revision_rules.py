"""When ``--accept-revision`` refuses (``run/upgrade.revision_differences``): each way an
outstanding or in-flight call's tool can differ is named; a harmless change is none."""

from __future__ import annotations

import dataclasses

from tesserix_adk import Agent, Checkpoint, CheckpointStatus, PendingApproval, ToolCall, tool
from tesserix_adk.checkpoint.payload import OutstandingCall
from tesserix_adk.run.upgrade import revision_differences
from tesserix_adk.stores.protocols import IdempotencyRecord, RecordStatus, ToolFlags


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
