"""What the attacks on taking a claim over share: an order's business key two runs use, a
booking tool that dies once in a chosen run after its call went out, and the scripted turns
that book. Memory, SQLite, Redis and PostgreSQL (``EVERY``)."""

from __future__ import annotations

from typing import Any

import pytest

from run.helpers import Asks
from tesserix_adk import (
    Agent,
    AgentRunner,
    Boundary,
    CheckpointPolicy,
    LeasePolicy,
    Role,
    ToolCall,
    ToolContext,
    tool,
)
from tesserix_adk.testing.faults import SimulatedCrash

T = "acme"
KEY = "acme/order-5"
FAST = LeasePolicy(ttl=2.0, renew_within=1.0)
# Frontiers only after results: a call sent and recorded can be ahead of the last one.
RESULTS_ONLY = CheckpointPolicy(boundaries=frozenset({Boundary.after_tool_result}))
EVERY = [
    "memory",
    "sqlite",
    pytest.param("redis", marks=pytest.mark.redis),
    pytest.param("postgres", marks=pytest.mark.postgres),
]
ORDER = {"order": "5"}


def by_order(**kw: Any) -> str:
    """The business key of a call naming an order."""
    return f"order-{kw['arguments']['order']}"


def told(model: Asks) -> list[str]:
    """What the model was told of the calls of its last turn."""
    return [m.text for m in model.requests[-1].messages if m.role is Role.tool]


def booking(sent: list[str], crashes: set[str], **flags: Any) -> Any:
    """``book``: each call noted in ``sent`` (its run); a run in ``crashes`` dies once in
    the call, after it went out."""

    @tool(key=by_order, **flags)
    async def book(order: str, ctx: ToolContext) -> str:
        """Book an order; the far side dedupes by our key when idempotent."""
        sent.append(ctx.run_id)
        if ctx.run_id in crashes:
            crashes.discard(ctx.run_id)
            raise SimulatedCrash
        return f"booked {order} by {ctx.run_id}"

    return book


@tool
def peek(order: str) -> str:
    """Look at an order (read-only, no key)."""
    return f"order {order} is free"


def peek_then_book(call_id: str = "c1") -> Asks:
    """A model that looks at order 5, then books it."""
    return Asks(
        [ToolCall(id="p1", name="peek", arguments=ORDER)],
        [ToolCall(id=call_id, name="book", arguments=ORDER)],
        "done",
    )


def books(call_id: str) -> Asks:
    """A model that books order 5 (call ``call_id``), then is done."""
    return Asks([ToolCall(id=call_id, name="book", arguments=ORDER)], "done")


async def crashes(runner: AgentRunner, agent: Agent, run_id: str) -> None:
    """Run ``run_id`` until its booking dies."""
    with pytest.raises(SimulatedCrash):
        await runner.run(agent, "go", tenant=T, run_id=run_id)
