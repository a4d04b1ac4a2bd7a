"""A resume whose lease lapsed while it read the run's records does not refuse in doubt.

Seen in the reliability suite (``tests/reliability/test_proxy.py``, Redis behind a slow
proxy): a resuming worker's replies were held back past its lease's ttl; another worker
took the run and claimed its call; the old worker's late read found that claim in flight and
refused the run in doubt (exit 4, "that holder no longer carries the run") while the new
holder was sending it. A worker parks a run so refused and pages an operator for a run
carried to its end. A holder that can no longer be sure it holds the run says so instead
(``LeaseLostError``: superseded, retryable), and leaves the call to the live holder.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from run.helpers import Asks, fresh_stores
from run.shared_key import EVERY, ORDER, T
from run.stale import TTL, Late, runner_over
from tesserix_adk import (
    Agent,
    LeaseLostError,
    ToolCall,
    ToolContext,
    tool,
)
from tesserix_adk.testing.faults import SimulatedCrash


@pytest.mark.parametrize("where", EVERY)
async def test_a_resume_superseded_while_reading_says_so_instead_of_refusing(
    where: str, tmp_path: Path
) -> None:
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
        model = Asks([ToolCall(id="c1", name="book", arguments=ORDER)], "done")
        first = Late(stores.idempotency)
        first.die_at_claim = True
        with pytest.raises(SimulatedCrash):  # the frontier names c1; its claim never landed
            await runner_over(stores, model, first, stores.leases).run(
                agent, "go", tenant=T, run_id="r"
            )
        await asyncio.sleep(TTL * 2)  # the dead attempt's lease and claims lapse

        old_ids, old_leases = Late(stores.idempotency), Late(stores.leases)
        old_ids.partner = old_leases
        old_ids.gate_lookup = True  # the plan's read is made, its reply held back
        old = asyncio.create_task(
            runner_over(stores, model, old_ids, old_leases).resume(agent, "r", tenant=T)
        )
        await asyncio.wait_for(old_ids.reading.wait(), 10)
        await asyncio.sleep(TTL * 2)  # its lease and resume claim lapse meanwhile

        new = asyncio.create_task(
            runner_over(stores, model, stores.idempotency, stores.leases).resume(
                agent, "r", tenant=T
            )
        )
        await asyncio.wait_for(in_tool.wait(), 10)  # the live holder is sending c1
        old_ids.heal()  # the old attempt's read comes back, late
        with pytest.raises(LeaseLostError):
            await asyncio.wait_for(old, 10)
        go_on.set()
        finished = await asyncio.wait_for(new, 10)
        assert str(finished.status) == "completed"
        assert len(sent) == 1, sent
