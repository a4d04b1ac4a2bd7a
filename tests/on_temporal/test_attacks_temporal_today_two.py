"""An attacker's second look at the Temporal path after today's commits: sync tools' guard
asked again in the worker thread (``tools._in_thread``), a sync tool's ``CancelledError`` or
``GeneratorExit`` as its error outcome, results that cannot be written told as text
(``invoking.result_content``), deep-copied arguments, ``run()`` keeping its input as a
submission in the kit's work index (``runner._submitted``), all reached through a real
``AgentWorkflow`` on the session's dev server (``conftest.temporal_server``), over a SQLite
world.

The question each test asks: is every side effect made exactly once, is any run carried by
both a workflow and a kit worker, is anything untyped or stranded?

Defect (strict xfails): a kit run dead after sending a call without a key (``key=None``),
then started on Temporal under its run id (``start_run``, which ``tesserix submit --temporal``
does first for an id no workflow holds), has its ``after_model_call`` frontier adopted as
the workflow's first turn and the call sent again: ``steps.model_turn`` refuses unkeyed
calls in doubt only for a carried-on execution (``step.resumed``).

Held: ``carry_on_run`` of the same run refuses the call in doubt; a sync tool's own
``CancelledError``/``GeneratorExit`` is its error outcome, booked once; a result nothing can
write is told as text and its mutated arguments leave the frontier as the model gave them;
a workflow cancelled while a sync tool ran records its outcome and a new execution replays
it; a kit submission of a run its workflow carries is neither carried nor parked by a kit
worker; ``worker --temporal --lease-ttl`` out of bounds is exit 2 in one sentence.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from pathlib import Path
from typing import Any

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
    worker_running,
    world_stores,
)
from on_temporal.test_attacks_temporal_shared_keys import Told
from tesserix_adk import Agent, Checkpointer, ScriptedProvider, ToolContext, Worker, tool
from tesserix_adk.messages import Role
from tesserix_adk.temporal import carry_on_run, start_run
from tesserix_adk.testing.faults import FaultyCheckpointStore, SimulatedCrash

TENANT = airline.TENANT


def _shipments() -> list[str]:
    path = airline.world() / "shipments.txt"
    return path.read_text().splitlines() if path.exists() else []


def _ship_line(order: str) -> None:
    with (airline.world() / "shipments.txt").open("a") as f:
        f.write(order + "\n")


@tool(key=None)
def ship_order(order: str) -> str:
    """Ship an order (the warehouse takes no idempotency key)."""
    _ship_line(order)
    airline._hold("hold_after")  # a test kills the process here, the order shipped
    return f"shipped {order}"


ship_agent = Agent("warehouse", "Ship what the user asks for.", [ship_order])
SHIP_TURNS: list[Any] = [[("ship_order", {"order": "o-1"})], "Shipped o-1."]


async def _kit_run_dead_after_unkeyed_call(world: Path, rid: str) -> None:
    """The kit's own ``run()`` sends ``ship_order`` (no key), then its process "dies" before
    the turn's results are written: the frontier stands at ``after_model_call`` with the call
    sent, and the run is kept in the work index as a submission."""
    async with await world_stores(world) as stores:
        dying = dataclasses.replace(
            stores,
            checkpoints=FaultyCheckpointStore(
                stores.checkpoints,
                crash_before=lambda body: body.get("boundary") == "after_tool_result",
            ),
        )
        kit = fast_runner(ScriptedProvider(SHIP_TURNS), dying)
        with pytest.raises(SimulatedCrash):
            await kit.run(ship_agent, "Ship o-1", tenant=TENANT, run_id=rid)
        cp = await Checkpointer.from_stores(stores).latest(TENANT, rid)
        assert cp is not None and cp.boundary.value == "after_model_call"
        assert cp.carried_by is None
    assert _shipments() == ["o-1"]


# --- 1. a kit run dead inside an unkeyed call, then given to Temporal -------------------------


async def test_a_kit_run_dead_after_an_unkeyed_call_started_on_temporal_does_not_send_it_again(
    temporal_server: DevServer, tmp_path: Path
) -> None:
    rid = run_id()
    with in_world(tmp_path):
        await _kit_run_dead_after_unkeyed_call(tmp_path, rid)
        client = await Client.connect(temporal_server.address)
        async with await world_stores(tmp_path) as stores:
            q = queue()
            runner = fast_runner(ScriptedProvider(SHIP_TURNS), stores)
            async with worker_running(client, runner, [ship_agent], q):
                handle = await start_run(
                    client, ship_agent, "Ship o-1", tenant=TENANT, run_id=rid, task_queue=q,
                    options=FAST,
                )  # fmt: skip
                try:
                    with contextlib.suppress(WorkflowFailureError):
                        await asyncio.wait_for(handle.result(), 40)
                finally:
                    with contextlib.suppress(Exception):
                        await handle.terminate("attack test over")
        shipped = _shipments()
    assert shipped == ["o-1"], f"the unkeyed call was sent {len(shipped)} times"


async def test_a_kit_run_dead_after_an_unkeyed_call_carried_on_temporal_is_refused_in_doubt(
    temporal_server: DevServer, tmp_path: Path
) -> None:
    rid = run_id()
    with in_world(tmp_path):
        await _kit_run_dead_after_unkeyed_call(tmp_path, rid)
        client = await Client.connect(temporal_server.address)
        async with await world_stores(tmp_path) as stores:
            cp = await Checkpointer.from_stores(stores).latest(TENANT, rid)
            assert cp is not None
            q = queue()
            runner = fast_runner(ScriptedProvider(SHIP_TURNS), stores)
            async with worker_running(client, runner, [ship_agent], q):
                handle = await carry_on_run(
                    client, ship_agent, cp, spent_micros=0, task_queue=q, options=FAST
                )
                try:
                    with pytest.raises(WorkflowFailureError) as failed:
                        await asyncio.wait_for(handle.result(), 40)
                finally:
                    with contextlib.suppress(Exception):
                        await handle.terminate("attack test over")
        shipped = _shipments()
    assert shipped == ["o-1"]
    cause = failed.value.cause
    while getattr(cause, "cause", None) is not None and getattr(cause, "type", None) is None:
        cause = cause.cause
    assert getattr(cause, "type", None) == "IndeterminateToolCallError"


_KIT_PROCESS = """
import asyncio, sys
from pathlib import Path
from on_temporal.helpers import fast_runner, world_stores
from on_temporal.test_attacks_temporal_today_two import SHIP_TURNS, TENANT, ship_agent
from tesserix_adk import ScriptedProvider

async def main():
    stores = await world_stores(Path(sys.argv[1]))
    runner = fast_runner(ScriptedProvider(SHIP_TURNS), stores)
    await runner.run(ship_agent, "Ship o-1", tenant=TENANT, run_id=sys.argv[2])

asyncio.run(main())
"""


@pytest.mark.slow
async def test_tesserix_submit_temporal_of_a_sigkilled_kit_run_never_sends_its_unkeyed_call_again(
    temporal_server: DevServer, tmp_path: Path
) -> None:
    import os
    import signal
    import sys

    from on_temporal.helpers import TESTS, store_url, tesserix, wait_for_file

    rid = run_id()
    (tmp_path / "hold_after").touch()
    with in_world(tmp_path):
        async with await world_stores(tmp_path):
            pass
        env = {**os.environ, "PYTHONPATH": str(TESTS)}
        kit = await asyncio.create_subprocess_exec(
            sys.executable, "-c", _KIT_PROCESS, str(tmp_path), rid, env=env
        )
        try:
            await wait_for_file(tmp_path / "entered")
        finally:
            kit.send_signal(signal.SIGKILL)
            await kit.wait()
        (tmp_path / "hold_after").unlink()
        assert _shipments() == ["o-1"]
        client = await Client.connect(temporal_server.address)
        async with await world_stores(tmp_path) as stores:
            q = queue()
            runner = fast_runner(ScriptedProvider(SHIP_TURNS), stores)
            async with worker_running(client, runner, [ship_agent], q):
                submitted = await tesserix(
                    "submit", "--temporal", temporal_server.address, "--task-queue", q,
                    "--agent", "on_temporal.test_attacks_temporal_today_two:ship_agent",
                    "--tenant", TENANT, "--input", "Ship o-1", "--run-id", rid,
                    "--store", store_url(tmp_path), env=env,
                )  # fmt: skip
                handle = client.get_workflow_handle(rid)
                try:
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(handle.result(), 40)
                finally:
                    with contextlib.suppress(Exception):
                        await handle.terminate("attack test over")
        shipped = _shipments()
    assert shipped == ["o-1"], (
        f"submit exited {submitted.returncode}; the unkeyed call was sent {len(shipped)} times"
    )


# --- 2. sync tools' own CancelledError / GeneratorExit, odd results, mutated arguments ---------


@tool
def cancelled_booking(flight: str, ctx: ToolContext) -> str:
    """Book a seat; the airline's client raises CancelledError after booking."""
    with (airline.world() / "bookings.txt").open("a") as f:
        f.write(f"{flight}|{ctx.idempotency_key}\n")
    raise asyncio.CancelledError("the airline's client gave up")


@tool
def closed_booking(flight: str, ctx: ToolContext) -> str:
    """Book a seat; a generator of the airline's client raises GeneratorExit after booking."""
    with (airline.world() / "bookings.txt").open("a") as f:
        f.write(f"{flight}|{ctx.idempotency_key}\n")
    raise GeneratorExit("closed")


class _Cycle:
    def __repr__(self) -> str:
        raise RuntimeError("no repr")

    def __str__(self) -> str:
        raise RuntimeError("no str")


@tool
def odd_booking(flight: str, legs: list[str], ctx: ToolContext) -> Any:
    """Book a seat; the airline answers with something nothing can write, and the tool
    mutates its own arguments on the way."""
    with (airline.world() / "bookings.txt").open("a") as f:
        f.write(f"{flight}|{ctx.idempotency_key}\n")
    legs.append("MUTATED")
    loop: list[Any] = [_Cycle()]
    loop.append(loop)
    return loop


@pytest.mark.parametrize(
    "tool_",
    [cancelled_booking, pytest.param(closed_booking, marks=pytest.mark.slow)],
    ids=["CancelledError", "GeneratorExit"],
)
async def test_a_sync_tools_own_cancel_on_temporal_is_its_error_booked_once_and_the_run_completes(
    temporal_server: DevServer, tmp_path: Path, tool_: Any
) -> None:
    rid = run_id()
    agent = Agent("canceller", "Book.", [tool_])
    turns: list[Any] = [[(tool_.name, {"flight": "LH1"})], "Done."]
    model = Told(turns)
    with in_world(tmp_path):
        client = await Client.connect(temporal_server.address)
        async with await world_stores(tmp_path) as stores:
            q = queue()
            async with worker_running(client, fast_runner(model, stores), [agent], q):
                handle = await start_run(
                    client, agent, "Book LH1", tenant=TENANT, run_id=rid, task_queue=q,
                    options=FAST,
                )  # fmt: skip
                try:
                    outcome = await asyncio.wait_for(handle.result(), 40)
                finally:
                    with contextlib.suppress(Exception):
                        await handle.terminate("attack test over")
        booked = airline.bookings()
    assert (outcome.status, outcome.output) == ("completed", "Done.")
    assert len(booked) == 1
    told = [m.text for m in model.seen[-1].messages if m.role is Role.tool]
    assert len(told) == 1 and "RuntimeError" in told[0]


async def test_an_unwritable_result_and_mutated_arguments_on_temporal_complete_the_call_once(
    temporal_server: DevServer, tmp_path: Path
) -> None:
    rid = run_id()
    agent = Agent("odd", "Book.", [odd_booking])
    turns: list[Any] = [[("odd_booking", {"flight": "LH2", "legs": ["FRA"]})], "Done."]
    model = Told(turns)
    with in_world(tmp_path):
        client = await Client.connect(temporal_server.address)
        async with await world_stores(tmp_path) as stores:
            q = queue()
            async with worker_running(client, fast_runner(model, stores), [agent], q):
                handle = await start_run(
                    client, agent, "Book LH2", tenant=TENANT, run_id=rid, task_queue=q,
                    options=FAST,
                )  # fmt: skip
                try:
                    outcome = await asyncio.wait_for(handle.result(), 40)
                finally:
                    with contextlib.suppress(Exception):
                        await handle.terminate("attack test over")
            cp = await Checkpointer.from_stores(stores).latest(TENANT, rid)
        booked = airline.bookings()
    assert (outcome.status, outcome.output) == ("completed", "Done.")
    assert len(booked) == 1
    assert cp is not None and cp.status.value == "completed"
    last = model.seen[-1].messages  # the transcript as the store gives it back
    [assistant] = [m for m in last if m.role is Role.assistant and m.tool_calls]
    assert assistant.tool_calls[0].arguments == {"flight": "LH2", "legs": ["FRA"]}
    [told] = [m for m in last if m.role is Role.tool]
    assert "cannot be written" in told.text or "_Cycle" in told.text
    assert not told.text.startswith("RuntimeError")


# --- 3. a run() submission in the kit's work index, and a workflow of the same run id ---------


async def test_a_submitted_run_carried_by_its_workflow_is_not_sent_again_by_a_kit_worker(
    temporal_server: DevServer, tmp_path: Path
) -> None:
    """``runner.submit`` keeps the run for the kit's workers; the operator starts the same run
    id on Temporal too. Once the workflow carried it to its end, a kit worker draining the
    index must not start it again (its tool is sent once)."""
    rid = run_id()
    turns: list[Any] = [[("book_seat", {"flight": "LH9"})], "Booked LH9."]
    with in_world(tmp_path):
        client = await Client.connect(temporal_server.address)
        async with await world_stores(tmp_path) as stores:
            kit = fast_runner(ScriptedProvider(turns), stores)
            await kit.submit(airline.agent, "Book LH9", tenant=TENANT, run_id=rid)
            q = queue()
            async with worker_running(
                client, fast_runner(ScriptedProvider(turns), stores), [airline.agent], q
            ):
                handle = await start_run(
                    client, airline.agent, "Book LH9", tenant=TENANT, run_id=rid, task_queue=q,
                    options=FAST,
                )  # fmt: skip
                try:
                    outcome = await asyncio.wait_for(handle.result(), 40)
                finally:
                    with contextlib.suppress(Exception):
                        await handle.terminate("attack test over")
            worker = Worker(kit, [airline.agent], exit_when_idle=True, poll_interval=0.1)
            await asyncio.wait_for(worker.run(), 30)
            cp = await Checkpointer.from_stores(stores).latest(TENANT, rid)
        booked = airline.bookings()
    assert (outcome.status, outcome.output) == ("completed", "Booked LH9.")
    assert len(booked) == 1
    assert cp is not None and cp.status.value == "completed"


# --- 4. Temporal cancels the activity while a sync tool runs (dispatch's ThreadReturned) --------


async def test_a_workflow_cancelled_while_a_sync_tool_ran_records_it_and_a_new_execution_replays_it(
    temporal_server: DevServer, tmp_path: Path
) -> None:
    from tesserix_adk.stores.protocols import RecordStatus

    rid = run_id()
    turns: list[Any] = [[("book_seat", {"flight": "LH5"})], "Booked LH5."]
    (tmp_path / "hold_after").touch()
    with in_world(tmp_path):
        client = await Client.connect(temporal_server.address)
        async with await world_stores(tmp_path) as stores:
            q = queue()
            async with worker_running(
                client, fast_runner(ScriptedProvider(turns), stores), [airline.agent], q
            ):
                handle = await start_run(
                    client, airline.agent, "Book LH5", tenant=TENANT, run_id=rid, task_queue=q,
                    options=FAST,
                )  # fmt: skip
                from on_temporal.helpers import wait_for_file

                await wait_for_file(tmp_path / "entered")
                await handle.cancel()
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(handle.result(), 20)
                await asyncio.sleep(1.0)  # the cancel reaches the activity by its heartbeat
                (tmp_path / "hold_after").unlink()
                [(_, key)] = airline.bookings()
                rec = None
                for _ in range(200):
                    rec = (await stores.idempotency.lookup([key], tenant=TENANT)).get(key)
                    if rec is not None and rec.status is RecordStatus.completed:
                        break
                    await asyncio.sleep(0.05)
                assert rec is not None and rec.status is RecordStatus.completed
                cp = await Checkpointer.from_stores(stores).latest(TENANT, rid)
                assert cp is not None
                again = await carry_on_run(
                    client, airline.agent, cp, spent_micros=0, task_queue=q, options=FAST
                )
                try:
                    outcome = await asyncio.wait_for(again.result(), 40)
                finally:
                    with contextlib.suppress(Exception):
                        await again.terminate("attack test over")
        booked = airline.bookings()
    assert (outcome.status, outcome.output) == ("completed", "Booked LH5.")
    assert len(booked) == 1


# --- 5. tesserix worker --temporal --lease-ttl bounds ------------------------------------------


@pytest.mark.parametrize(
    "ttl",
    ["nan", *(pytest.param(t, marks=pytest.mark.slow) for t in ("0.5", "1e300", "-1"))],
)
async def test_a_temporal_worker_with_a_lease_ttl_out_of_bounds_is_refused_in_one_sentence(
    temporal_server: DevServer, tmp_path: Path, ttl: str
) -> None:
    import os

    from on_temporal.helpers import TESTS, store_url, tesserix

    async with await world_stores(tmp_path):
        pass
    done = await tesserix(
        "worker", "--temporal", temporal_server.address, "--task-queue", queue(),
        "--agent", "on_temporal.airline:agent", "--provider", "on_temporal.airline:provider",
        "--store", store_url(tmp_path), f"--lease-ttl={ttl}",
        env={**os.environ, "PYTHONPATH": str(TESTS)},
    )  # fmt: skip
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    assert "Traceback" not in done.stderr
    assert "carrying runs" not in done.stdout
    assert "lease-ttl" in done.stderr


# --- 6. a kit submission of a run its workflow carries, waiting on an approval ----------------


async def test_a_kit_worker_meeting_a_submitted_run_its_workflow_carries_leaves_it_unparked(
    temporal_server: DevServer, tmp_path: Path
) -> None:
    """``runner.submit`` keeps the run in the kit's work index; the same id runs on Temporal
    and waits on an approval. A kit worker draining the index meets it: it must neither
    carry it nor park it for an operator (``runs --stuck`` leaves it to its workflow), and
    once approved the workflow books once."""
    import os

    from on_temporal.helpers import TESTS, store_url, tesserix
    from on_temporal.test_attacks_temporal import _pending_request
    from tesserix_adk.temporal import APPROVAL_SIGNAL

    rid, url = run_id(), store_url(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(TESTS)}
    with in_world(tmp_path):
        client = await Client.connect(temporal_server.address)
        async with await world_stores(tmp_path) as stores:
            kit = fast_runner(airline.provider(), stores)
            await kit.submit(airline.approval_agent, "Book LH123", tenant=TENANT, run_id=rid)
            q = queue()
            async with worker_running(
                client, fast_runner(airline.provider(), stores), [airline.approval_agent], q
            ):
                handle = await start_run(
                    client, airline.approval_agent, "Book LH123", tenant=TENANT, run_id=rid,
                    task_queue=q, options=FAST, approval_poll=20.0,
                )  # fmt: skip
                try:
                    request = await _pending_request(stores, rid)
                    worker = Worker(
                        kit, [airline.approval_agent], exit_when_idle=True, poll_interval=0.1
                    )
                    await asyncio.wait_for(worker.run(), 30)
                    stuck = await tesserix(
                        "runs", "--stuck", "--tenant", TENANT, "--json", "--store", url, env=env
                    )
                    approved = await tesserix(
                        "approve", request, "--tenant", TENANT, "--by", "ops", "--store", url,
                        env=env,
                    )  # fmt: skip
                    assert approved.returncode == 0, approved.stderr
                    await handle.signal(APPROVAL_SIGNAL)
                    outcome = await asyncio.wait_for(handle.result(), 40)
                finally:
                    with contextlib.suppress(Exception):
                        await handle.terminate("attack test over")
        booked = airline.bookings()
    assert outcome.status == "completed"
    assert len(booked) == 1
    assert stuck.returncode in (0, 1), stuck.stderr
    assert rid not in stuck.stdout, stuck.stdout
