"""A fresh attacker's look at runs carried by ``AgentWorkflow`` on a real Temporal dev server
(the session's ``conftest.temporal_server``), where the other attack files had not gone:
Temporal's own operator verbs (reset, cancel, raw signals) rather than the kit's.

Attacked: ``temporal workflow reset`` of a completed run to its first workflow task, of a
running run while its booking is held right after the effect, and of a run failed on a call
in doubt (a tool activity timed out after the effect, its reply lost) to the task that
scheduled that call's activity and to its first workflow task, keyed and unkeyed; a Temporal
cancel (``WorkflowHandle.cancel``, not ``tesserix cancel``) while an async tool holds its
effect and while the run waits on an approval, then ``submit`` carrying the run on; the
approval signal sent before the run waits, repeatedly, with arguments the handler does not
take, and after the run closed; everything Temporal records of a run whose input, final
answer and tool arguments hold secrets (every execution's raw history after a reset, list
and describe info with memo and search attributes).

Found, and fixed (``calls._marked_sent``: an unkeyed side-effecting call leaves a durable
mark in the idempotency store just before it goes out, and an execution finding one an
earlier attempt left refuses the call as in doubt; a keyed call was safe already, as the
plain test beside it shows):

- HIGH ``test_an_unkeyed_call_in_doubt_is_not_sent_again_by_a_reset_to_before_its_activity``
  [scheduler, FirstWorkflowTask]: a run fails non-retryably with
  ``IndeterminateToolCallError`` on an unkeyed side-effecting call whose first activity
  attempt timed out after the effect; ``temporal workflow reset`` (to the task that
  scheduled the call, or to the first workflow task) starts an execution whose tool
  activity is attempt 1, so ``activities.tool_call`` passes ``retried=False`` and
  ``calls.tool_call`` (``if retried and oc.side_effects``) sends the call again. The model
  turn of the FirstWorkflowTask reset does not refuse it either: ``steps.model_turn`` only
  checks unkeyed calls in doubt when ``step.resumed or cp.carried_by is None``.

Held: a completed run reset to its first task ends completed again with the same output, no
model asked, nothing booked again; a running run reset while its booking is held fails
``CheckpointCorruptError`` (the frontier is past where the reset put it), never guessing,
and ``submit`` carries it on to one booking; a keyed call whose reply was lost is replayed,
not sent, by a reset to before its activity; a Temporal cancel mid async call leaves the
call to finish and record, and ``submit`` carries the run on to one booking; a Temporal
cancel of a run waiting on a person: ``approve`` wakes no kit worker, ``tesserix run
--resume`` is refused (exit 4), ``submit`` carries it on and books once; approval signals
before the wait, repeated or with arguments approve nothing and do not break the workflow;
no planted secret is in any execution's history, result, memo or search attributes.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

import pytest
from temporalio.client import Client, WorkflowExecutionStatus, WorkflowFailureError

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
    wait_for_file,
    worker_running,
    world_stores,
)
from tesserix_adk import Agent, ScriptedProvider, ToolContext, tool
from tesserix_adk.temporal import APPROVAL_SIGNAL, RunOutcome, start_run
from tesserix_adk.temporal.commands import submit
from tesserix_adk.testing.secrets import leaked_secrets, planted_secrets

TENANT = airline.TENANT


async def _reset(server: DevServer, rid: str, kind: str = "FirstWorkflowTask") -> None:
    done = await asyncio.create_subprocess_exec(
        server.binary,
        "workflow",
        "reset",
        "--address",
        server.address,
        "-w",
        rid,
        *([kind] if kind.startswith("--") else ["-t", kind]),
        "--reason",
        "attack",
        "-y",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await done.communicate()
    assert done.returncode == 0, (out + err).decode()


async def _newest_outcome(client: Client, rid: str, within: float = 20.0) -> Any:
    handle = client.get_workflow_handle(rid, result_type=RunOutcome)
    try:
        return await asyncio.wait_for(handle.result(), within)
    except (WorkflowFailureError, TimeoutError) as exc:
        return exc


async def _closed(client: Client, rid: str) -> WorkflowExecutionStatus:
    handle = client.get_workflow_handle(rid)
    async with asyncio.timeout(20):
        while True:
            status = (await handle.describe()).status
            if status not in (None, WorkflowExecutionStatus.RUNNING):
                return status
            await asyncio.sleep(0.05)


def _with_tests() -> dict[str, str]:
    import os

    from on_temporal.helpers import TESTS

    path = os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path}


# --- reset -------------------------------------------------------------------------------


async def test_a_completed_run_reset_to_its_first_task_books_nothing_more_nor_asks_the_model(
    temporal_server: DevServer, tmp_path: Path
) -> None:
    rid = run_id()
    with in_world(tmp_path):
        client = await Client.connect(temporal_server.address)
        async with await world_stores(tmp_path) as stores:
            provider = ScriptedProvider(airline.BOOK_TURNS)
            q = queue()
            async with worker_running(client, fast_runner(provider, stores), [airline.agent], q):
                handle = await start_run(
                    client, airline.agent, "Book LH123", tenant=TENANT, run_id=rid, task_queue=q,
                    options=FAST,
                )  # fmt: skip
                first = await handle.result()
                assert first.status == "completed"
                assert len(airline.bookings()) == 1
                await _reset(temporal_server, rid)
                again = await _newest_outcome(client, rid)
            assert len(airline.bookings()) == 1
            # The reset execution finds the run ended: it ends as the run did (the script
            # is used up, so a model asked again would have failed it).
            assert getattr(again, "status", None) == "completed", again
            assert again.output == first.output


async def test_a_run_reset_while_its_booking_is_held_books_once_and_is_carried_on(
    temporal_server: DevServer, tmp_path: Path
) -> None:
    rid = run_id()
    with in_world(tmp_path):
        (tmp_path / "hold_after").write_text("")
        client = await Client.connect(temporal_server.address)
        async with await world_stores(tmp_path) as stores:
            provider = ScriptedProvider(airline.BOOK_TURNS)
            q = queue()
            async with worker_running(client, fast_runner(provider, stores), [airline.agent], q):
                await start_run(
                    client, airline.agent, "Book LH123", tenant=TENANT, run_id=rid, task_queue=q,
                    options=FAST,
                )  # fmt: skip
                await wait_for_file(tmp_path / "entered")
                await _reset(temporal_server, rid)
                await asyncio.sleep(0.5)  # the reset execution meets the run mid-turn
                (tmp_path / "hold_after").unlink()
                outcome = await _newest_outcome(client, rid)
                if not hasattr(outcome, "status"):
                    # Refused (the frontier is past where the reset put the workflow): never
                    # guessed; the run is carried on from its frontier by ``submit``.
                    assert isinstance(outcome, WorkflowFailureError), outcome
                    await _closed(client, rid)
                    await submit(
                        temporal_server.address, "default", airline.agent, "Book LH123",
                        tenant=TENANT, run_id=rid, task_queue=q, stores=stores,
                    )  # fmt: skip
                    outcome = await _newest_outcome(client, rid)
            assert len(airline.bookings()) == 1
            assert getattr(outcome, "status", None) == "completed", outcome


# --- a Temporal cancel while an async tool holds its effect ------------------------------


@tool
async def book_async(flight: str, ctx: ToolContext) -> dict[str, str]:
    """Book one seat, then wait on the airline's confirmation."""
    with (airline.world() / "bookings.txt").open("a") as f:
        f.write(f"{flight}|{ctx.idempotency_key}\n")
    gate = airline.world() / "gate"
    (airline.world() / "entered").write_text("gate")
    while gate.exists():  # noqa: ASYNC110 (a gate another process may lift)
        await asyncio.sleep(0.02)
    return {"booking": f"B-{flight}"}


async_agent = Agent("airline-async", "Book what the user asks.", [book_async])


async def test_a_workflow_cancelled_by_temporal_mid_call_books_once_when_carried_on(
    temporal_server: DevServer, tmp_path: Path
) -> None:
    rid = run_id()
    turns: list[Any] = [[("book_async", {"flight": "LH123"})], "Booked."]
    with in_world(tmp_path):
        (tmp_path / "gate").write_text("")
        client = await Client.connect(temporal_server.address)
        async with await world_stores(tmp_path) as stores:
            provider = ScriptedProvider(turns)
            q = queue()
            async with worker_running(client, fast_runner(provider, stores), [async_agent], q):
                handle = await start_run(
                    client, async_agent, "Book LH123", tenant=TENANT, run_id=rid, task_queue=q,
                    options=FAST,
                )  # fmt: skip
                await wait_for_file(tmp_path / "entered")
                await handle.cancel()
                status = await _closed(client, rid)
                assert status is WorkflowExecutionStatus.CANCELED
                (tmp_path / "gate").unlink()
                await asyncio.sleep(1.0)  # the cancelled activity ends what it does
                refused: Exception | None = None
                try:
                    await submit(
                        temporal_server.address, "default", async_agent, "Book LH123",
                        tenant=TENANT, run_id=rid, task_queue=q, stores=stores,
                    )  # fmt: skip
                except Exception as exc:
                    refused = exc
                outcome = None if refused is not None else await _newest_outcome(client, rid)
            assert len(airline.bookings()) == 1
            if refused is not None:
                # Left in doubt for ``tesserix resolve``: never guessed.
                assert "doubt" in str(refused) or "ran" in str(refused), refused
            else:
                assert getattr(outcome, "status", None) == "completed", outcome


# --- the approval signal -----------------------------------------------------------------


async def _pending(stores: Any, rid: str) -> str:
    from tesserix_adk import Checkpointer

    checkpoints = Checkpointer.from_stores(stores)
    async with asyncio.timeout(20):
        while True:
            cp = await checkpoints.latest(TENANT, rid)
            if cp is not None and cp.pending_approval is not None:
                return cp.pending_approval.id
            await asyncio.sleep(0.05)


async def test_approval_signals_early_twice_and_with_an_argument_approve_nothing(
    temporal_server: DevServer, tmp_path: Path
) -> None:
    rid = run_id()
    url = store_url(tmp_path)
    with in_world(tmp_path):
        client = await Client.connect(temporal_server.address)
        async with await world_stores(tmp_path) as stores:
            q = queue()
            runner = fast_runner(airline.provider(), stores)
            async with worker_running(client, runner, [airline.approval_agent], q):
                handle = await start_run(
                    client, airline.approval_agent, "Book LH123", tenant=TENANT, run_id=rid,
                    task_queue=q, options=FAST, approval_poll=60.0,
                )  # fmt: skip
                # Before the run asks anything: twice, and once with an argument.
                await handle.signal(APPROVAL_SIGNAL)
                await handle.signal(APPROVAL_SIGNAL)
                await handle.signal(APPROVAL_SIGNAL, "approved")
                request = await _pending(stores, rid)
                for _ in range(3):
                    await handle.signal(APPROVAL_SIGNAL)
                await handle.signal(APPROVAL_SIGNAL, {"approved": True})
                await asyncio.sleep(0.5)
                assert airline.bookings() == []
                assert (await handle.describe()).status is WorkflowExecutionStatus.RUNNING
                approved = await tesserix(
                    "approve", request, "--tenant", TENANT, "--by", "ops", "--store", url
                )
                assert approved.returncode == 0, approved.stderr
                await handle.signal(APPROVAL_SIGNAL)
                await handle.signal(APPROVAL_SIGNAL)
                outcome = await asyncio.wait_for(handle.result(), 20)
                with contextlib.suppress(Exception):
                    await handle.signal(APPROVAL_SIGNAL)
            assert outcome.status == "completed"
            assert [f for f, _ in airline.bookings()] == ["LH123"]


async def test_a_waiting_run_cancelled_by_temporal_is_left_to_submit_and_books_once(
    temporal_server: DevServer, tmp_path: Path
) -> None:
    from tesserix_adk.stores.protocols import WorkState

    rid = run_id()
    url = store_url(tmp_path)
    with in_world(tmp_path):
        client = await Client.connect(temporal_server.address)
        async with await world_stores(tmp_path) as stores:
            q = queue()
            runner = fast_runner(airline.provider(), stores)
            async with worker_running(client, runner, [airline.approval_agent], q):
                handle = await start_run(
                    client, airline.approval_agent, "Book LH123", tenant=TENANT, run_id=rid,
                    task_queue=q, options=FAST, approval_poll=0.2,
                )  # fmt: skip
                request = await _pending(stores, rid)
                await handle.cancel()
                assert await _closed(client, rid) is WorkflowExecutionStatus.CANCELED
                approved = await tesserix(
                    "approve", request, "--tenant", TENANT, "--by", "ops", "--store", url
                )
                assert approved.returncode == 0, approved.stderr
                # No kit worker is woken for a run a workflow carries (or carried).
                assert stores.work is not None
                items = [i for i in await stores.work.items(TENANT) if i.run_id == rid]
                assert all(i.state is not WorkState.ready for i in items), items
                resumed = await tesserix(
                    "run", "--resume", rid, "--tenant", TENANT, "--store", url,
                    "--agent", "on_temporal.airline:approval_agent",
                    "--provider", "on_temporal.airline:provider", env=_with_tests(),
                )  # fmt: skip
                assert resumed.returncode == 4, resumed.stderr
                assert (
                    "CarriedByWorkflow" in resumed.stderr or "submit --temporal" in resumed.stderr
                )
                assert airline.bookings() == []
                await submit(
                    temporal_server.address, "default", airline.approval_agent, "Book LH123",
                    tenant=TENANT, run_id=rid, task_queue=q, stores=stores,
                )  # fmt: skip
                outcome = await _newest_outcome(client, rid)
            assert getattr(outcome, "status", None) == "completed", outcome
            assert [f for f, _ in airline.bookings()] == ["LH123"]


# --- what Temporal records ---------------------------------------------------------------


@tool(side_effects=False)
def note(text: str) -> str:
    """Write a note the user asked for."""
    return "noted"


note_agent = Agent("noter", "Do what the user asks.", [note, airline.book_seat])


async def test_no_secret_reaches_any_execution_history_result_memo_or_attributes(
    temporal_server: DevServer, tmp_path: Path
) -> None:
    secrets = " ".join(planted_secrets().values())
    rid = run_id()
    turns: list[Any] = [
        [("note", {"text": f"card {secrets}"}), ("book_seat", {"flight": "LH123"})],
        f"Done; your card {secrets} is on file.",
    ]
    with in_world(tmp_path):
        client = await Client.connect(temporal_server.address)
        async with await world_stores(tmp_path) as stores:
            q = queue()
            async with worker_running(
                client, fast_runner(ScriptedProvider(turns), stores), [note_agent], q
            ):
                handle = await start_run(
                    client, note_agent, f"Book LH123 paying with {secrets}", tenant=TENANT,
                    run_id=rid, task_queue=q, options=FAST,
                )  # fmt: skip
                outcome = await handle.result()
                await _reset(temporal_server, rid)
                again = await _newest_outcome(client, rid)
                blobs: list[bytes] = []
                async for wf in client.list_workflows(f"WorkflowId = '{rid}'"):
                    h = client.get_workflow_handle(rid, run_id=wf.run_id)
                    history = await h.fetch_history()
                    blobs += [e.SerializeToString() for e in history.events]
                    blobs.append(wf.raw_info.SerializeToString())
                    blobs.append((await h.describe()).raw_description.SerializeToString())
            assert len(airline.bookings()) == 1
    assert outcome.status == "completed"
    assert getattr(again, "status", None) == "completed", again
    assert len(blobs) > 4
    assert leaked_secrets(b"".join(blobs)) == []


# --- a reset past a call in doubt --------------------------------------------------------


def _ship(order: str) -> str:
    import time

    with (airline.world() / "shipped.txt").open("a") as f:
        f.write(order + "\n")
    time.sleep(2.0)  # longer than the tool activity's timeout: the reply is lost
    return f"shipped {order}"


@tool(key=None)
def ship_unkeyed(order: str) -> str:
    """Ship an order (a side effect the carrier cannot dedupe)."""
    return _ship(order)


@tool
def ship_keyed(order: str) -> str:
    """Ship an order."""
    return _ship(order)


unkeyed_agent = Agent("shipper-u", "Ship what the user asks.", [ship_unkeyed])
keyed_agent = Agent("shipper-k", "Ship what the user asks.", [ship_keyed])


def _shipped() -> list[str]:
    path = airline.world() / "shipped.txt"
    return path.read_text().split() if path.exists() else []


async def _tool_scheduled_by(client: Client, rid: str) -> int:
    """The workflow task that scheduled the first tool activity: a reset point."""
    history = await client.get_workflow_handle(rid).fetch_history()
    for event in history.events:
        if event.HasField("activity_task_scheduled_event_attributes"):
            attrs = event.activity_task_scheduled_event_attributes
            if attrs.activity_type.name == "tesserix.tool_call":
                return attrs.workflow_task_completed_event_id
    raise AssertionError("no tool activity was scheduled")


async def _reset_before_the_tool(
    server: DevServer, world: Path, agent: Agent, tool_name: str, to: str = "scheduler"
) -> tuple[Any, Any, list[str]]:
    """Run ``agent`` on one call of ``tool_name`` whose first activity attempt times out
    after the effect (its reply lost), then reset the workflow to the task that scheduled
    that call's activity; (first outcome, reset execution's outcome, orders shipped)."""
    import dataclasses

    rid = run_id()
    turns: list[Any] = [[(tool_name, {"order": "o-1"})], "Shipped."]
    options = dataclasses.replace(FAST, tool_timeout=1.0)
    client = await Client.connect(server.address)
    async with await world_stores(world) as stores:
        q = queue()
        async with worker_running(client, fast_runner(ScriptedProvider(turns), stores), [agent], q):
            await start_run(
                client, agent, "Ship o-1", tenant=TENANT, run_id=rid, task_queue=q,
                options=options,
            )  # fmt: skip
            first = await _newest_outcome(client, rid)
            assert _shipped() == ["o-1"]
            if to == "scheduler":
                to = f"--event-id={await _tool_scheduled_by(client, rid)}"
            await _reset(server, rid, to)
            again = await _newest_outcome(client, rid)
            await asyncio.sleep(0.3)
            return first, again, _shipped()


async def test_a_keyed_call_is_replayed_not_sent_by_a_reset_to_before_its_activity(
    temporal_server: DevServer, tmp_path: Path
) -> None:
    with in_world(tmp_path):
        first, again, shipped = await _reset_before_the_tool(
            temporal_server, tmp_path, keyed_agent, "ship_keyed"
        )
    # The lost reply's record was written by the timed-out attempt: the retry replayed it.
    assert getattr(first, "status", None) == "completed", first
    assert shipped == ["o-1"], f"the call was sent {len(shipped)} times ({again!r})"
    assert getattr(again, "status", None) == "completed", again


@pytest.mark.parametrize("to", ["scheduler", "FirstWorkflowTask"])
async def test_an_unkeyed_call_in_doubt_is_not_sent_again_by_a_reset_to_before_its_activity(
    temporal_server: DevServer, tmp_path: Path, to: str
) -> None:
    with in_world(tmp_path):
        first, again, shipped = await _reset_before_the_tool(
            temporal_server, tmp_path, unkeyed_agent, "ship_unkeyed", to
        )
    # The lost reply of an unkeyed call: refused in doubt, naming it (this holds).
    assert isinstance(first, WorkflowFailureError), first
    assert "IndeterminateToolCallError" in repr(first.cause), first.cause
    # The reset execution meets the same frontier, the same call in doubt: never sent again.
    assert shipped == ["o-1"], f"the call in doubt was sent {len(shipped)} times ({again!r})"
