"""An agent run as a Temporal workflow on a real dev server: it completes, makes its one
booking, and leaves frontiers the kit reads as for any run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from temporalio.client import Client, WorkflowFailureError

from on_temporal import airline
from on_temporal.conftest import DevServer
from on_temporal.helpers import (
    FAST,
    fast_runner,
    in_world,
    queue,
    run_id,
    store_url,
    tesserix,
    worker_running,
    world_stores,
)
from tesserix_adk import Agent, ScriptedProvider, tool
from tesserix_adk.temporal import start_run

TENANT = airline.TENANT


async def test_a_booking_run_completes_with_one_booking_and_readable_frontiers(
    temporal_server: DevServer, tmp_path: Path
) -> None:
    rid = run_id()
    with in_world(tmp_path):
        client = await Client.connect(temporal_server.address)
        async with await world_stores(tmp_path) as stores:
            runner = fast_runner(airline.provider(), stores)
            q = queue()
            async with worker_running(client, runner, [airline.agent], q):
                handle = await start_run(
                    client,
                    airline.agent,
                    "Book LH123",
                    tenant=TENANT,
                    run_id=rid,
                    task_queue=q,
                    options=FAST,
                )
                assert handle.id == rid  # the workflow id is the kit's run id
                outcome = await handle.result()
            assert outcome.status == "completed"
            assert outcome.output == "Booked LH123."
            assert [flight for flight, _ in airline.bookings()] == ["LH123"]
            assert runner.checkpoints is not None
            cp = await runner.checkpoints.latest(TENANT, rid)
            assert cp is not None and cp.status.value == "completed"
            assert cp.agent_revision == airline.agent.revision
            messages = await runner.checkpoints.messages(cp)
            assert [m.role.value for m in messages] == [
                "user",
                "assistant",
                "tool",
                "assistant",
                "tool",
                "assistant",
            ]
    inspected = await tesserix(
        "inspect", rid, "--tenant", TENANT, "--json", "--store", store_url(tmp_path)
    )
    assert inspected.returncode == 0, inspected.stderr
    described = json.loads(inspected.stdout)
    assert described["status"] == "completed"


async def test_a_changed_agent_is_refused_naming_both_revisions(
    temporal_server: DevServer, tmp_path: Path
) -> None:
    @tool(side_effects=False)
    def search_flights(origin: str, dest: str, cabin: str = "economy") -> list[str]:
        """Find flights between two airports, in a cabin."""
        return []

    changed = Agent("airline", "Book the flight the user asks for.", [search_flights])
    assert changed.revision != airline.agent.revision
    with in_world(tmp_path):
        client = await Client.connect(temporal_server.address)
        async with await world_stores(tmp_path) as stores:
            q = queue()
            async with worker_running(
                client, fast_runner(ScriptedProvider([]), stores), [changed], q
            ):
                handle = await start_run(
                    client,
                    airline.agent,
                    "Book LH123",
                    tenant=TENANT,
                    run_id=run_id(),
                    task_queue=q,
                    options=FAST,
                )
                with pytest.raises(WorkflowFailureError) as failed:
                    await handle.result()
    cause = failed.value.cause
    assert "RevisionMismatchError" in repr(cause)
    assert airline.agent.revision in str(cause) and changed.revision in str(cause)
