"""A long run crosses executions: the workflow continues-as-new by the kit's policy and by
the server's suggestion, carrying only a transcript handle, numbers and approvals; every
tool effect happens exactly once and the final answer comes out of the last execution."""

from __future__ import annotations

from pathlib import Path

import pytest
from temporalio.client import Client

from on_temporal import airline
from on_temporal.conftest import DevServer
from on_temporal.helpers import (
    FAST,
    fast_runner,
    in_world,
    queue,
    run_id,
    worker_running,
    world_stores,
)
from tesserix_adk import ScriptedProvider
from tesserix_adk.checkpoint.continuation import ContinuationPolicy
from tesserix_adk.errors import ConfigurationError
from tesserix_adk.temporal import ContinueReason, start_run
from tesserix_adk.temporal.shapes import Carried, carried_from, continuation_from

TENANT = airline.TENANT
SINGLE, TRIPLE = 20, 40  # 60 steps: one call each, then three (a history that fills faster)


async def test_a_sixty_step_run_continues_as_new_by_policy_and_by_suggestion(
    temporal_server: DevServer, tmp_path: Path
) -> None:
    turns = airline.long_turns(SINGLE, TRIPLE)
    rid = run_id()
    with in_world(tmp_path):
        client = await Client.connect(temporal_server.address)
        async with await world_stores(tmp_path) as stores:
            runner = fast_runner(ScriptedProvider(turns), stores)
            q = queue()
            async with worker_running(client, runner, [airline.long_agent], q):
                handle = await start_run(
                    client,
                    airline.long_agent,
                    "Book them all",
                    tenant=TENANT,
                    run_id=rid,
                    task_queue=q,
                    options=FAST,
                    # Ten one-call steps (about 125 events) stay under the server's
                    # suggestion (180 events); three-call steps reach it first.
                    continuation=ContinuationPolicy(max_steps=10),
                )
                outcome = await handle.result()
                last = await client.get_workflow_handle(rid).fetch_history()
            assert runner.checkpoints is not None
            cp = await runner.checkpoints.latest(TENANT, rid)
        flights = [flight for flight, _ in airline.bookings()]
    assert outcome.status == "completed" and outcome.output == "All booked."
    assert outcome.iteration == SINGLE + TRIPLE
    assert ContinueReason.policy in outcome.chain
    assert ContinueReason.suggested in outcome.chain
    assert len(outcome.chain) >= 2
    expected = [f"S{i}" for i in range(SINGLE)]
    expected += [f"T{i}-{j}" for i in range(TRIPLE) for j in range(3)]
    assert flights == expected  # each exactly once, in the model's order
    # The last execution started from a carry of a few numbers, names and a handle, not
    # from the transcript of sixty steps.
    started = last.events[0].workflow_execution_started_event_attributes
    assert started.continued_execution_run_id
    assert sum(len(p.data) for p in started.input.payloads) < 2048
    assert cp is not None and cp.status.value == "completed" and cp.iteration == SINGLE + TRIPLE


def test_a_carry_that_drops_an_approval_the_run_acts_under_cannot_cross() -> None:
    grant = {
        "request": "req-1",
        "call_id": "c1",
        "key": "k",
        "approved": True,
        "by": "ops",
        "note": None,
    }
    kept = Carried(
        history=None, spent_micros=5, iteration=3, grants=[grant], acting_under=["req-1"]
    )
    back = continuation_from(kept, tenant=TENANT, agent_name="airline", run_id="r")
    assert carried_from(back) == kept
    dropped = Carried(history=None, spent_micros=5, iteration=3, acting_under=["req-1"])
    with pytest.raises(ConfigurationError, match="req-1"):
        continuation_from(dropped, tenant=TENANT, agent_name="airline", run_id="r")
