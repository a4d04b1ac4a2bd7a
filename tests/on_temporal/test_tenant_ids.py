"""A run id is a Temporal workflow id, one namespace for every tenant: ``submit --temporal``
of tenant B with a run id that tenant A's workflow holds must neither claim it started
(nothing would carry B's run) nor start an execution from A's closed one (A's input in B's
run)."""

from __future__ import annotations

import pytest
from temporalio.client import Client, WorkflowExecutionStatus

from on_temporal import airline
from on_temporal.conftest import DevServer
from on_temporal.helpers import FAST, queue, run_id
from tesserix_adk import open_stores
from tesserix_adk.errors import ConfigurationError
from tesserix_adk.temporal import start_run
from tesserix_adk.temporal.commands import submit

A, B = "tenant-a", "tenant-b"


async def _b_submits(server: DevServer, rid: str, q: str) -> None:
    async with open_stores("memory://") as stores:
        await submit(
            server.address, "default", airline.agent, "Book UA456 for B", tenant=B,
            run_id=rid, task_queue=q, stores=stores,
        )  # fmt: skip


@pytest.mark.parametrize("closed", [False, True], ids=["open", "terminated"])
async def test_a_run_id_another_tenants_workflow_holds_is_refused(
    temporal_server: DevServer, closed: bool
) -> None:
    rid, q = run_id(), queue()
    client = await Client.connect(temporal_server.address)
    # No worker: A's workflow waits on its first task (open), or is ended there.
    handle = await start_run(
        client, airline.agent, "Book LH123 for A (secret-ish)", tenant=A, run_id=rid,
        task_queue=q, options=FAST,
    )  # fmt: skip
    if closed:
        await handle.terminate("A's run ended")
    try:
        with pytest.raises(ConfigurationError, match="another tenant"):
            await _b_submits(temporal_server, rid, q)
        newest = await client.get_workflow_handle(rid).describe()
        # Nothing was started for B: the newest execution is A's, as A left it.
        assert newest.run_id == handle.result_run_id
        want = WorkflowExecutionStatus.TERMINATED if closed else WorkflowExecutionStatus.RUNNING
        assert newest.status is want
    finally:
        if not closed:
            await handle.terminate("test over")


async def test_the_same_tenant_submitting_its_open_run_again_starts_nothing(
    temporal_server: DevServer,
) -> None:
    rid, q = run_id(), queue()
    client = await Client.connect(temporal_server.address)
    handle = await start_run(
        client, airline.agent, "Book LH123", tenant=B, run_id=rid, task_queue=q, options=FAST
    )
    try:
        await _b_submits(temporal_server, rid, q)  # one run: nothing more is started
        newest = await client.get_workflow_handle(rid).describe()
        assert newest.run_id == handle.result_run_id
    finally:
        await handle.terminate("test over")
