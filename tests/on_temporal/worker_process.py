"""A Temporal worker in a process of its own, for tests that SIGKILL it.

``python -m on_temporal.worker_process ADDRESS QUEUE AGENT`` (``AGENT`` is an
attribute of ``on_temporal.airline``) prints ``ready`` once it polls. While the world holds
a ``hold_reply`` file, a tool activity whose call the kit has already recorded waits
before its reply goes back to Temporal (writing ``entered``): a kill there loses a
completed call's reply, the case Temporal alone would send again.
"""

from __future__ import annotations

import asyncio
import sys
import time
from datetime import timedelta
from pathlib import Path

from temporalio import activity
from temporalio.client import Client
from temporalio.worker import PollerBehaviorSimpleMaximum, Worker

from on_temporal import airline
from on_temporal.helpers import fast_runner, world_stores
from tesserix_adk.temporal import AgentActivities, AgentWorkflow
from tesserix_adk.temporal.shapes import TOOL_ACTIVITY, ToolInput, ToolResult


class _HoldingReplies(AgentActivities):
    @activity.defn(name=TOOL_ACTIVITY)
    async def tool_call(self, call: ToolInput) -> ToolResult:
        result = await super().tool_call(call)
        hold = airline.world() / "hold_reply"
        if hold.exists() and call.call_id.startswith("call_1"):
            (airline.world() / "entered").write_text("hold_reply")
            await asyncio.to_thread(_wait_while, hold)
        return result


def _wait_while(hold: Path) -> None:
    while hold.exists():
        time.sleep(0.02)


async def main(address: str, task_queue: str, agent_attr: str) -> None:
    agent = getattr(airline, agent_attr)
    client = await Client.connect(address)
    async with await world_stores(airline.world()) as stores:
        activities = _HoldingReplies(
            fast_runner(airline.provider(), stores), [agent], heartbeat_every=0.3
        )
        worker = Worker(
            client,
            task_queue=task_queue,
            workflows=[AgentWorkflow],
            activities=[activities.model_turn, activities.tool_call],
            # A killed worker's cached workflows go back to the shared queue in a second.
            sticky_queue_schedule_to_start_timeout=timedelta(seconds=1),
            # A frozen worker (SIGSTOP) swallows one task per open poll until it times out:
            # one poll, so it swallows one.
            workflow_task_poller_behavior=PollerBehaviorSimpleMaximum(2),
            activity_task_poller_behavior=PollerBehaviorSimpleMaximum(1),
        )
        async with worker:
            print("ready", flush=True)
            await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3]))
