"""Attacks on "one carrier" (commit 2146604) on a real Temporal dev server: every frontier
a workflow writes names ``carried_by: temporal``, and the kit's resume, workers and
approve/resolve leave such an unfinished run to its workflow.

Attacked: every write path of the activities (model turns, calls, folds before a
continue-as-new, a run cancelled before its first frontier, a run out of budget), the
histories of a continued chain replayed after the change (determinism), a run whose
workflow was terminated (``tesserix run --resume`` refused in one sentence, exit 4;
``tesserix submit --temporal`` carries it on, booking once), and a run the kit started that
``carry_on_run`` (``tesserix submit --temporal``'s second half) hands to a workflow while
it waits on an approval, then approved with a kit worker on the same store.

Defects (fixed: a workflow's first activity on a frontier that names no carrier writes it
again naming its workflow, ``temporal/steps.py`` ``_adopted``, before anything else; the
test passes now):

- ``test_a_kit_run_handed_to_its_workflow_is_not_carried_by_a_kit_worker_after_approve``:
  a workflow that only *looks* for a decision (``temporal/steps.py`` ``model_turn`` ->
  ``_open_turn`` -> ``take_decision`` returning waiting) writes no frontier, so the run's
  frontier stays the kit's own (no ``carried_by``); ``cli/frontier.py`` ``_wake`` then
  tells the kit's work index the approved run wants a worker, and a kit worker carries it
  on beside its open workflow. The same held for a Temporal run waiting on an approval
  across the upgrade (its frontier written before this release).

Held: every frontier of a continued chain, of a run cancelled before its first frontier
and of a run out of budget names its carrier; the chain's histories replay without
nondeterminism; a terminated Temporal run is refused by ``tesserix run --resume`` (exit 4,
one sentence naming ``submit --temporal``), ``approve`` says its workflow takes the decision
and wakes no kit worker, and ``submit --temporal`` carries it on to one booking.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.worker import Replayer

from on_temporal import airline
from on_temporal.conftest import DevServer
from on_temporal.helpers import (
    FAST,
    TESTS,
    fast_runner,
    in_world,
    queue,
    run_id,
    store_url,
    tesserix,
    worker_running,
    world_stores,
)
from tesserix_adk import Agent, Checkpointer, ScriptedProvider
from tesserix_adk.checkpoint.continuation import ContinuationPolicy
from tesserix_adk.checkpoint.payload import Carrier, CheckpointStatus
from tesserix_adk.temporal import AgentWorkflow, RunOutcome, carry_on_run, start_run

TENANT = airline.TENANT


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(TESTS)}


async def _every_step(stores: Any, rid: str) -> list[Any]:
    checkpoints = Checkpointer.from_stores(stores)
    latest = await checkpoints.latest(TENANT, rid)
    assert latest is not None
    steps = [await checkpoints.at(TENANT, rid, s) for s in range(1, latest.step + 1)]
    return [cp for cp in steps if cp is not None]


async def _pending_request(stores: Any, rid: str) -> str:
    checkpoints = Checkpointer.from_stores(stores)
    async with asyncio.timeout(30):
        while True:
            cp = await checkpoints.latest(TENANT, rid)
            if cp is not None and cp.pending_approval is not None:
                return cp.pending_approval.id
            await asyncio.sleep(0.05)


async def _model_turns_done(client: Client, rid: str, at_least: int) -> None:
    """Until the workflow's history holds ``at_least`` completed activities."""
    async with asyncio.timeout(30):
        while True:
            history = await client.get_workflow_handle(rid).fetch_history()
            done = sum(
                1 for e in history.events if e.HasField("activity_task_completed_event_attributes")
            )
            if done >= at_least:
                return
            await asyncio.sleep(0.1)


async def _kit_worker(url: str, agent: str) -> Any:
    return await asyncio.wait_for(
        tesserix(
            "worker",
            "--agent",
            agent,
            "--provider",
            "on_temporal.airline:provider",
            "--exit-when-idle",
            "--store",
            url,
            env=_env(),
        ),
        40,
    )


# --- held ------------------------------------------------------------------------------------


async def test_every_frontier_of_a_continued_chain_names_its_carrier_and_replays(
    temporal_server: DevServer, tmp_path: Path
) -> None:
    rid = run_id()
    with in_world(tmp_path):
        client = await Client.connect(temporal_server.address)
        async with await world_stores(tmp_path) as stores:
            q = queue()
            provider = ScriptedProvider(airline.long_turns(4, 1))
            async with worker_running(
                client, fast_runner(provider, stores), [airline.long_agent], q
            ):
                handle = await start_run(
                    client,
                    airline.long_agent,
                    "Book them all",
                    tenant=TENANT,
                    run_id=rid,
                    task_queue=q,
                    options=FAST,
                    continuation=ContinuationPolicy(max_steps=2),
                )
                outcome = await asyncio.wait_for(handle.result(), 60)
            steps = await _every_step(stores, rid)
            histories = []
            execution: str | None = None
            for _ in range(len(outcome.chain) + 1):
                history = await client.get_workflow_handle(rid, run_id=execution).fetch_history()
                histories.append(history)
                last = history.events[-1]
                execution = (
                    last.workflow_execution_continued_as_new_event_attributes.new_execution_run_id
                    or None
                )
        booked = airline.bookings()
    assert outcome.status == "completed" and "policy" in outcome.chain
    assert len(booked) == 7
    assert len(steps) > 10
    assert {(cp.carried_by, cp.format) for cp in steps} == {(Carrier.temporal, 4)}, [
        (cp.step, cp.carried_by) for cp in steps
    ]
    replayer = Replayer(workflows=[AgentWorkflow])
    for history in histories:
        result = await replayer.replay_workflow(history, raise_on_replay_failure=False)
        assert result.replay_failure is None, result.replay_failure


async def test_a_run_cancelled_before_its_first_frontier_or_out_of_budget_names_its_carrier(
    temporal_server: DevServer, tmp_path: Path
) -> None:
    cancelled, broke = run_id(), run_id()
    poor = Agent(
        "airline",
        "Book the flight the user asks for.",
        [airline.search_flights, airline.book_seat],
        budget_micros=0,
    )
    with in_world(tmp_path):
        client = await Client.connect(temporal_server.address)
        async with await world_stores(tmp_path) as stores:
            # Asked before any worker started it: the request waits in the store.
            gone = await fast_runner(airline.provider(), stores).cancel(
                cancelled, tenant=TENANT, by="ops", reason="not wanted"
            )
            assert gone is None
            q = queue()
            runner = fast_runner(airline.provider(), stores)
            async with worker_running(client, runner, [airline.agent], q):
                first = await start_run(
                    client,
                    airline.agent,
                    "Book LH123",
                    tenant=TENANT,
                    run_id=cancelled,
                    task_queue=q,
                    options=FAST,
                )
                ended = await asyncio.wait_for(first.result(), 30)
            q2 = queue()
            async with worker_running(client, fast_runner(airline.provider(), stores), [poor], q2):
                second = await start_run(
                    client, poor, "Book LH123", tenant=TENANT, run_id=broke, task_queue=q2
                )
                spent = await asyncio.wait_for(second.result(), 30)
            found = {
                rid: await Checkpointer.from_stores(stores).latest(TENANT, rid)
                for rid in (cancelled, broke)
            }
        booked = airline.bookings()
    assert ended.status == "cancelled", ended
    cp = found[cancelled]
    assert cp is not None and cp.status is CheckpointStatus.cancelled
    assert cp.carried_by is Carrier.temporal
    assert spent.status == "budget_exhausted", spent
    cp = found[broke]
    assert cp is not None and cp.carried_by is Carrier.temporal
    assert booked == []


async def test_a_terminated_temporal_run_is_refused_by_the_kit_and_carried_on_by_submit(
    temporal_server: DevServer, tmp_path: Path
) -> None:
    rid, url = run_id(), store_url(tmp_path)
    agent = "on_temporal.airline:approval_agent"
    with in_world(tmp_path):
        client = await Client.connect(temporal_server.address)
        async with await world_stores(tmp_path) as stores:
            q = queue()
            runner = fast_runner(airline.provider(), stores)
            async with worker_running(client, runner, [airline.approval_agent], q):
                handle = await start_run(
                    client,
                    airline.approval_agent,
                    "Book LH123",
                    tenant=TENANT,
                    run_id=rid,
                    task_queue=q,
                    options=FAST,
                    approval_poll=0.5,
                )
                request = await _pending_request(stores, rid)
                await handle.terminate("an operator ended it")
                resumed = await tesserix(
                    "run",
                    "--resume",
                    rid,
                    "--tenant",
                    TENANT,
                    "--agent",
                    agent,
                    "--provider",
                    "on_temporal.airline:provider",
                    "--store",
                    url,
                    env=_env(),
                )
                approved = await tesserix(
                    "approve", request, "--tenant", TENANT, "--by", "ops", "--store", url
                )
                kit = await _kit_worker(url, agent)
                submitted = await tesserix(
                    "submit",
                    "--temporal",
                    temporal_server.address,
                    "--task-queue",
                    q,
                    "--agent",
                    agent,
                    "--tenant",
                    TENANT,
                    "--input",
                    "Book LH123",
                    "--run-id",
                    rid,
                    "--store",
                    url,
                    env=_env(),
                )
                assert submitted.returncode == 0, submitted.stderr
                outcome = await asyncio.wait_for(
                    client.get_workflow_handle(rid, result_type=RunOutcome).result(), 40
                )
            latest = await Checkpointer.from_stores(stores).latest(TENANT, rid)
        booked = airline.bookings()
    assert resumed.returncode == 4, resumed
    assert len(resumed.stderr.strip().splitlines()) == 1, resumed.stderr
    assert "submit --temporal" in resumed.stderr and "Traceback" not in resumed.stderr
    assert approved.returncode == 0, approved.stderr
    assert "temporal workflow" in approved.stdout, approved.stdout
    assert kit.returncode == 0 and rid not in kit.stdout, kit.stdout
    assert outcome.status == "completed", outcome
    assert len(booked) == 1
    assert latest is not None and latest.carried_by is Carrier.temporal


# --- defects ---------------------------------------------------------------------------------


async def test_a_kit_run_handed_to_its_workflow_is_not_carried_by_a_kit_worker_after_approve(
    temporal_server: DevServer, tmp_path: Path
) -> None:
    rid, url = run_id(), store_url(tmp_path)
    with in_world(tmp_path):
        client = await Client.connect(temporal_server.address)
        async with await world_stores(tmp_path) as stores:
            kit_runner = fast_runner(airline.provider(), stores)
            started = await kit_runner.run(
                airline.approval_agent, "Book LH123", tenant=TENANT, run_id=rid
            )
            assert started.status.value == "waiting_approval", started
            cp = await Checkpointer.from_stores(stores).latest(TENANT, rid)
            assert cp is not None and cp.carried_by is None
            q = queue()
            runner = fast_runner(airline.provider(), stores)
            async with worker_running(client, runner, [airline.approval_agent], q):
                handle = await carry_on_run(
                    client,
                    airline.approval_agent,
                    cp,
                    spent_micros=await stores.ledger.spent(TENANT, rid),
                    task_queue=q,
                    options=FAST,
                    approval_poll=20.0,  # the kit worker's window is this wide
                )
                await _model_turns_done(client, rid, 1)  # the workflow waits on the decision
                assert started.pending_approval is not None
                approved = await tesserix(
                    "approve",
                    started.pending_approval.id,
                    "--tenant",
                    TENANT,
                    "--by",
                    "ops",
                    "--store",
                    url,
                )
                assert approved.returncode == 0, approved.stderr
                kit = await _kit_worker(url, "on_temporal.airline:approval_agent")
                status = (await handle.describe()).status
                await handle.signal("tesserix.approval_decided")
                try:
                    outcome: Any = await asyncio.wait_for(handle.result(), 40)
                except Exception as exc:
                    outcome = exc
        booked = airline.bookings()
    assert status is WorkflowExecutionStatus.RUNNING
    assert kit.returncode == 0, kit.stderr
    assert len(booked) == 1
    # Its workflow alone carries it: no kit worker took it, the workflow completes it.
    assert rid not in kit.stdout, (kit.stdout, approved.stdout)
    assert getattr(outcome, "status", None) == "completed", outcome
