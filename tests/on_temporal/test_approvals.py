"""A Temporal run waiting on a person: the request is in the kit's approval store, so
``tesserix inspect`` shows it and ``tesserix approve`` decides it, and the workflow (looking
on a short timer) carries on with the decision."""

from __future__ import annotations

import asyncio
import json
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
    store_url,
    tesserix,
    worker_running,
    world_stores,
)
from tesserix_adk import AgentRunner
from tesserix_adk.checkpoint.continuation import ContinuationPolicy
from tesserix_adk.stores.protocols import WorkState
from tesserix_adk.temporal import start_run

TENANT = airline.TENANT


async def _pending_request(runner: AgentRunner, rid: str) -> str:
    assert runner.checkpoints is not None
    async with asyncio.timeout(30):
        while True:
            cp = await runner.checkpoints.latest(TENANT, rid)
            if cp is not None and cp.pending_approval is not None:
                return cp.pending_approval.id
            await asyncio.sleep(0.05)


async def _until_continued(client: Client, rid: str, first: str | None) -> None:
    async with asyncio.timeout(60):
        while True:
            if (await client.get_workflow_handle(rid).describe()).run_id != first:
                return
            await asyncio.sleep(0.1)


@pytest.mark.parametrize(("decision", "booked"), [((), ["LH123"]), (("--deny",), [])])
async def test_a_waiting_run_resumes_when_tesserix_approve_decides(
    temporal_server: DevServer, tmp_path: Path, decision: tuple[str, ...], booked: list[str]
) -> None:
    rid = run_id()
    url = store_url(tmp_path)
    with in_world(tmp_path):
        client = await Client.connect(temporal_server.address)
        async with await world_stores(tmp_path) as stores:
            runner = fast_runner(airline.provider(), stores)
            q = queue()
            async with worker_running(client, runner, [airline.approval_agent], q):
                handle = await start_run(
                    client,
                    airline.approval_agent,
                    "Book LH123",
                    tenant=TENANT,
                    run_id=rid,
                    task_queue=q,
                    options=FAST,
                    approval_poll=0.2,
                )
                request = await _pending_request(runner, rid)
                inspected = await tesserix("inspect", rid, "--tenant", TENANT, "--store", url)
                assert inspected.returncode == 0, inspected.stderr
                assert request in inspected.stdout
                assert airline.bookings() == []  # nothing is sent before the decision
                approved = await tesserix(
                    "approve",
                    request,
                    "--tenant",
                    TENANT,
                    "--by",
                    "ops",
                    *decision,
                    "--store",
                    url,
                )
                assert approved.returncode == 0, approved.stderr
                outcome = await asyncio.wait_for(handle.result(), 90)
            assert outcome.status == "completed"
            assert [flight for flight, _ in airline.bookings()] == booked
            # `tesserix approve` told the kit's work index the run wants a worker; the
            # workflow took the decision, so no `tesserix worker` is left to take it too.
            assert stores.work is not None
            items = [i for i in await stores.work.items(TENANT) if i.run_id == rid]
            assert all(i.state is WorkState.done for i in items), items
    done = await tesserix("inspect", rid, "--tenant", TENANT, "--json", "--store", url)
    assert json.loads(done.stdout)["status"] == "completed"


async def test_a_long_wait_continues_as_new_carrying_the_pending_approval(
    temporal_server: DevServer, tmp_path: Path
) -> None:
    rid = run_id()
    url = store_url(tmp_path)
    with in_world(tmp_path):
        client = await Client.connect(temporal_server.address)
        async with await world_stores(tmp_path) as stores:
            runner = fast_runner(airline.provider(), stores)
            q = queue()
            async with worker_running(client, runner, [airline.approval_agent], q):
                handle = await start_run(
                    client,
                    airline.approval_agent,
                    "Book LH123",
                    tenant=TENANT,
                    run_id=rid,
                    task_queue=q,
                    options=FAST,
                    approval_poll=0.2,
                    # The first turn leaves about 4 KB; a few looks at the approval store
                    # fill the rest.
                    continuation=ContinuationPolicy(max_history_bytes=6000),
                )
                request = await _pending_request(runner, rid)
                first = (await handle.describe()).run_id
                # Looking on a timer fills the history until the policy asks for a new
                # execution; the wait goes on there.
                await _until_continued(client, rid, first)
                approved = await tesserix(
                    "approve", request, "--tenant", TENANT, "--by", "ops", "--store", url
                )
                assert approved.returncode == 0, approved.stderr
                outcome = await asyncio.wait_for(handle.result(), 90)
            assert outcome.status == "completed"
            assert "policy" in outcome.chain
            assert [flight for flight, _ in airline.bookings()] == ["LH123"]
