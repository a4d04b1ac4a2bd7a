"""Attacks on `tesserix submit --temporal` carrying a run on in a new execution (723676d:
``commands.submit``, ``carry_on_run``, ``carried_from_frontier``), and on the stream usage
checks of e62571d (``OpenAIProvider``'s usage chunk, ``AnthropicProvider``'s message_delta).

Attacked (Temporal): a resubmit after a workflow failed on a call in doubt that nobody
resolved (a keyed call, and an unkeyed side-effecting one); a resubmit after ``terminate``
mid-turn (the model's answer written but no call sent; a call claimed and mid-send; the
model's next turn still running in the old execution's activity, holding the lease, after
the previous turn was folded), with the ledger's spend carried into the budget and the run
resubmitted again once it ended budget_exhausted; a resubmit while an approval was pending
(after a continue-as-new chain): it must stay pending, then the decision is taken; a
resubmit after the approval was denied while no workflow ran; a run cancelled (`tesserix
cancel`) while no workflow ran, then approved late, then resubmitted from the command line;
three resubmits racing; a resubmit with a different ``--input`` of a run closed before its
first frontier; a resubmit with an agent of another revision; a resubmit over a tampered
frontier; ``carried_from_frontier`` on edge frontiers (before_approval with grants and a
pending request, after_tool_result with and without outstanding calls, finished, failed
and tombstone frontiers, the ledger's spend rather than the frontier's).
Attacked (streams): an OpenAI usage chunk before the finish_reason, two usage chunks, usage
without ``[DONE]``, a usage chunk whose counts are null; an Anthropic message_delta without
usage, and a repeated message_delta.

Defects found, all fixed since (they were strict xfails; their tests pass now): a
resubmit is refused in one sentence when the run cannot be carried on (a call in doubt
nobody resolved, another revision), a new execution refuses a call the closed one may have
sent without a key, a run closed before its frontier restarts on its first input and
settings, and a usage chunk with null counts is no usage:
- an unkeyed side-effecting call whose workflow failed as in doubt (IndeterminateToolCallError,
  which `tesserix resolve` cannot settle: it has no record) is SENT AGAIN by the execution a
  resubmit starts: the tool activity's first attempt in the new execution does not count
  as "retried", so the call in doubt is guessed to have never run;
- a resubmit with an agent of another revision than the frontier's exits 0 and prints the
  run id, starting an execution pinned to the new revision that no worker can carry (the
  new revision's worker refuses the frontier, the old revision's worker refuses the pin);
  it should be refused up front in one sentence (exit 4), as `tesserix run --resume` is;
- a run whose workflow closed before its first frontier is started again on the
  resubmitted ``--input``: the same run id silently becomes a different request (the kit's
  own submit keeps the first input of an id);
- an OpenAI stream whose usage chunk carries null token counts is taken whole at 0 tokens
  and charged nothing: the undercharge the usage check exists to prevent.

Held: a keyed call in doubt stays refused (sent once, IndeterminateToolCallError naming it)
after a resubmit until it is resolved; a run terminated after the model's answer is carried
on without asking the model for that turn again and books once; a call mid-send at
terminate is booked once, the ledger's spend carries over (the run ends budget_exhausted,
no model asked past the budget) and a resubmit of the ended run starts nothing; a model turn
left running by the terminated execution keeps the lease, its answer stands and the turn is
not asked twice; a pending approval stays pending across continue-as-new, terminate and
resubmit (same request, nothing booked) and is then taken; a denial stays a denial (the
model is told "denied by ops", nothing booked); a cancelled run is not restarted by a late
approval plus a resubmit (exit 0, its id, nothing started); racing resubmits start one
execution; a tampered frontier is refused in one sentence with exit 4 and nothing is
started; ``carried_from_frontier`` carries what it must and refuses ended and half-folded
frontiers; the stream checks hold for the other shapes tried (usage before the finish, two
usage chunks, usage without [DONE], usage without a finished choice, a message_delta
without usage, a repeated message_delta).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import sqlite3
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from temporalio import activity
from temporalio.client import Client, WorkflowExecutionStatus, WorkflowFailureError
from temporalio.exceptions import ApplicationError
from temporalio.worker import Worker

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
    wait_for_file,
    worker_running,
    world_stores,
)
from providers.fake_server import (
    ModelServer,
    Reply,
    anthropic_stream,
    openai_stream,
)
from tesserix_adk import (
    Agent,
    Checkpointer,
    Message,
    ModelRequest,
    ProviderError,
    Role,
    ScriptedProvider,
    ToolCall,
    tool,
)
from tesserix_adk.checkpoint.continuation import ContinuationPolicy
from tesserix_adk.checkpoint.payload import (
    Boundary,
    Checkpoint,
    CheckpointStatus,
    Grant,
    OutstandingCall,
    PendingApproval,
)
from tesserix_adk.errors import (
    AdkError,
    IndeterminateToolCallError,
    ResumeError,
)
from tesserix_adk.providers.anthropic import AnthropicProvider
from tesserix_adk.providers.openai import OpenAIProvider
from tesserix_adk.providers.scripted import ScriptedTurn
from tesserix_adk.stores.protocols import HistoryHandle
from tesserix_adk.temporal import (
    APPROVAL_SIGNAL,
    AgentActivities,
    AgentWorkflow,
    RunOutcome,
    carry_on_run,
    start_run,
)
from tesserix_adk.temporal.commands import submit
from tesserix_adk.temporal.shapes import (
    TOOL_ACTIVITY,
    ToolInput,
    ToolResult,
    carried_from_frontier,
    continuation_from,
)

TENANT = airline.TENANT


# --- the world's tools ---------------------------------------------------------------------


def _sent(name: str) -> None:
    with (airline.world() / f"{name}.sent").open("a") as f:
        f.write("x\n")


def _sends(name: str) -> int:
    path = airline.world() / f"{name}.sent"
    return len(path.read_text().splitlines()) if path.exists() else 0


async def _notify(to: str) -> str:
    # Sent first, then the airline's answer is slow while the hold file is there: an
    # attempt timed out meanwhile is cancelled with the notice out and nothing recorded.
    _sent("notify")
    while (airline.world() / "hold_notify").exists():  # noqa: ASYNC110 - a file, not an Event
        await asyncio.sleep(0.02)
    return f"notified {to}"


@tool(name="notify", key=None)
async def notify_unkeyed(to: str) -> str:
    """Send a notice (a side effect; the tool opted out of idempotency keys)."""
    return await _notify(to)


@tool(name="notify")
async def notify_keyed(to: str) -> str:
    """Send a notice (a side effect, keyed; no reconciler)."""
    return await _notify(to)


@contextlib.contextmanager
def _held(path: Path) -> Iterator[Path]:
    """``path`` exists for the block (a tool waits on it), and never outlives it."""
    path.touch()
    try:
        yield path
    finally:
        path.unlink(missing_ok=True)


unkeyed_agent = Agent("notifier", "Notify whom the user says.", [notify_unkeyed])
keyed_agent = Agent("notifier", "Notify whom the user says.", [notify_keyed])

# The airline with a reconciler and a budget the first turn already spends.
budget_agent = Agent(
    "airline",
    "Book the flight the user asks for.",
    [airline.search_flights, airline.book_seat_reconciled],
    budget_micros=100,
)


@tool(side_effects=False)
def seat_map(flight: str) -> list[str]:
    """The free seats of a flight."""
    return ["12A"]


# ``--agent on_temporal.test_attacks_carry_on:changed_agent``: the approval airline with one
# more tool, so another revision under the same name.
changed_agent = Agent(
    "airline",
    "Book the flight the user asks for.",
    [airline.search_flights, airline.book_seat_approved, seat_map],
)


def _cli_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(TESTS)}


async def _resubmit(
    server: DevServer, agent: Agent, rid: str, q: str, stores: Any, input: str = "go"
) -> str:
    """``tesserix submit --temporal`` as the command line calls it (in this process)."""
    return await submit(
        server.address, "default", agent, input, tenant=TENANT, run_id=rid, task_queue=q,
        stores=stores,
    )  # fmt: skip


async def _outcome(client: Client, rid: str, within: float = 40.0) -> Any:
    """The newest execution's outcome, or the error it failed with."""
    handle = client.get_workflow_handle(rid, result_type=RunOutcome)
    try:
        return await asyncio.wait_for(handle.result(), within)
    except WorkflowFailureError as exc:
        return exc


async def _until(predicate: Any, within: float = 20.0) -> None:
    deadline = time.monotonic() + within
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("the condition did not come true in time")
        await asyncio.sleep(0.05)


async def _pending(stores: Any, rid: str) -> str:
    checkpoints = Checkpointer.from_stores(stores)
    async with asyncio.timeout(30):
        while True:
            cp = await checkpoints.latest(TENANT, rid)
            if cp is not None and cp.pending_approval is not None:
                return cp.pending_approval.id
            await asyncio.sleep(0.05)


async def _waiting_then_terminated(
    client: Client, stores: Any, q: str, **start: Any
) -> tuple[str, str]:
    """An approval run waiting on a person, its workflow terminated: (run id, request)."""
    rid = run_id()
    runner = fast_runner(airline.provider(), stores)
    async with worker_running(client, runner, [airline.approval_agent], q):
        await start_run(
            client, airline.approval_agent, "Book LH123", tenant=TENANT, run_id=rid,
            task_queue=q, options=FAST, approval_poll=0.3, **start,
        )  # fmt: skip
        request = await _pending(stores, rid)
        await client.get_workflow_handle(rid).terminate("terminated while it waits")
    return rid, request


async def _status(client: Client, rid: str) -> WorkflowExecutionStatus | None:
    return (await client.get_workflow_handle(rid).describe()).status


async def _ended(client: Client, rid: str) -> None:
    with contextlib.suppress(Exception):
        await client.get_workflow_handle(rid).terminate("attack test over")


# --- calls in doubt ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "agent",
    [
        pytest.param(keyed_agent, id="keyed"),
        pytest.param(
            unkeyed_agent,
            id="unkeyed",
        ),
    ],
)
async def test_a_call_in_doubt_nobody_resolved_is_not_sent_again_by_a_resubmit(
    temporal_server: DevServer, tmp_path: Path, agent: Agent
) -> None:
    rid, q = run_id(), queue()
    turns: list[Any] = [[("notify", {"to": "ops"})], "Notified."]
    # The first attempt is timed out while the tool is held; the second finds it in doubt.
    options = dataclasses.replace(FAST, tool_timeout=1.5)
    with in_world(tmp_path):
        client = await Client.connect(temporal_server.address)
        async with await world_stores(tmp_path) as stores:
            runner = fast_runner(ScriptedProvider(turns), stores)
            async with worker_running(client, runner, [agent], q):
                with _held(tmp_path / "hold_notify") as hold:
                    await start_run(
                        client, agent, "notify ops", tenant=TENANT, run_id=rid,
                        task_queue=q, options=options,
                    )  # fmt: skip
                    first = await _outcome(client, rid)
                    assert isinstance(first, WorkflowFailureError), first
                    assert "IndeterminateToolCallError" in repr(first.cause), first.cause
                    assert _sends("notify") == 1  # the notice did go out, once
                hold.unlink(missing_ok=True)
                # Nobody resolved it; the operator submits the run's id again: refused, in
                # one sentence naming the call, and nothing is started.
                with pytest.raises(IndeterminateToolCallError, match="notify"):
                    await _resubmit(temporal_server, agent, rid, q, stores)
                status = (await client.get_workflow_handle(rid).describe()).status
                assert status is WorkflowExecutionStatus.FAILED
                # An execution started past that check (another submit's, a hand-made
                # one) refuses the call itself, naming it.
                cp = await Checkpointer.from_stores(stores).latest(TENANT, rid)
                assert cp is not None
                await carry_on_run(client, agent, cp, spent_micros=0, task_queue=q, options=options)
                again = await _outcome(client, rid)
                await asyncio.sleep(0.3)
                sends = _sends("notify")
                await _ended(client, rid)
    assert sends == 1, f"the call in doubt was sent {sends} times"
    # Never guessed: the new execution refuses it again, naming it.
    assert isinstance(again, WorkflowFailureError), again
    assert "IndeterminateToolCallError" in repr(again.cause), again.cause
    assert "notify" in str(again.cause)


# --- terminate mid-turn --------------------------------------------------------------------


class _HeldBeforeTheCall(AgentActivities):
    """Tool activities wait here (before anything is claimed or sent) while ``holding``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.holding = True
        self.entered = asyncio.Event()
        self.released = asyncio.Event()

    @activity.defn(name=TOOL_ACTIVITY)
    async def tool_call(self, call: ToolInput) -> ToolResult:
        if self.holding:
            self.entered.set()
            await self.released.wait()
            raise ApplicationError("held by the test: never sent", non_retryable=True)
        return await super().tool_call(call)


async def test_a_run_terminated_after_the_models_answer_is_carried_on_without_asking_again(
    temporal_server: DevServer, tmp_path: Path
) -> None:
    rid, q = run_id(), queue()
    turns: list[Any] = [[("book_seat", {"flight": "LH123"})], "Booked LH123."]
    provider = ScriptedProvider(turns)
    with in_world(tmp_path):
        client = await Client.connect(temporal_server.address)
        async with await world_stores(tmp_path) as stores:
            acts = _HeldBeforeTheCall(
                fast_runner(provider, stores), [airline.agent], heartbeat_every=0.3
            )
            worker = Worker(
                client,
                task_queue=q,
                workflows=[AgentWorkflow],
                activities=[acts.model_turn, acts.tool_call],
            )
            async with worker:
                await start_run(
                    client, airline.agent, "Book LH123", tenant=TENANT, run_id=rid,
                    task_queue=q, options=FAST,
                )  # fmt: skip
                await asyncio.wait_for(acts.entered.wait(), 30)
                # The answer and its call's key are in the frontier; nothing was sent.
                await client.get_workflow_handle(rid).terminate("terminated mid-turn")
                acts.holding = False
                acts.released.set()
                assert airline.bookings() == []
                assert await _resubmit(temporal_server, airline.agent, rid, q, stores) == rid
                outcome = await _outcome(client, rid)
            cp = await Checkpointer.from_stores(stores).latest(TENANT, rid)
        booked = airline.bookings()
    assert getattr(outcome, "status", None) == "completed", outcome
    assert outcome.output == "Booked LH123."
    assert [flight for flight, _ in booked] == ["LH123"]
    # The turn's answer stood: the model was asked for it once, then for the last turn.
    assert provider.calls == 2
    assert cp is not None and cp.status is CheckpointStatus.completed


async def test_a_call_claimed_at_terminate_is_booked_once_and_the_spend_carries_over(
    temporal_server: DevServer, tmp_path: Path
) -> None:
    rid, q = run_id(), queue()
    # The first turn alone costs more than the whole budget: the run must end
    # budget_exhausted at its next turn, in whichever execution gets there.
    turns: list[Any] = [
        ScriptedTurn(calls=(("book_seat", {"flight": "LH123"}),), cost_micros=150),
        "Booked LH123.",
    ]
    provider = ScriptedProvider(turns)
    with in_world(tmp_path):
        client = await Client.connect(temporal_server.address)
        async with await world_stores(tmp_path) as stores:
            async with worker_running(client, fast_runner(provider, stores), [budget_agent], q):
                with _held(tmp_path / "hold_before") as hold:  # gone before the worker stops
                    await start_run(
                        client, budget_agent, "Book LH123", tenant=TENANT, run_id=rid,
                        task_queue=q, options=FAST,
                    )  # fmt: skip
                    await wait_for_file(tmp_path / "entered")  # claimed, about to book
                    await client.get_workflow_handle(rid).terminate("terminated mid-call")
                hold.unlink(missing_ok=True)
                await _until(lambda: len(airline.bookings()) == 1)
                await asyncio.sleep(0.5)
                spent = await stores.ledger.spent(TENANT, rid)
                assert await _resubmit(temporal_server, budget_agent, rid, q, stores) == rid
                outcome = await _outcome(client, rid)
                # The run ended (not as a failure of its workflow): its id again starts
                # nothing, and nothing is booked again.
                assert await _resubmit(temporal_server, budget_agent, rid, q, stores) == rid
                await asyncio.sleep(1.0)
                status = await _status(client, rid)
            spent_after = await stores.ledger.spent(TENANT, rid)
        booked = airline.bookings()
    assert spent == 150
    assert getattr(outcome, "status", None) == "budget_exhausted", outcome
    assert status is WorkflowExecutionStatus.COMPLETED
    assert spent_after == 150  # no model was asked past the budget
    assert provider.calls == 1
    assert [flight for flight, _ in booked] == ["LH123"]


class _SlowSecondTurn(ScriptedProvider):
    """The script, with the model's second turn held (after the first turn's results were
    folded into an after_tool_result frontier) until the test lets it answer."""

    def __init__(self, turns: list[Any]) -> None:
        super().__init__(turns)
        self.asked: list[int] = []
        self.entered = asyncio.Event()
        self.release = asyncio.Event()

    async def complete(self, request: ModelRequest) -> Any:
        index = sum(1 for m in request.messages if m.role is Role.assistant)
        self.asked.append(index)
        if index == 1 and not self.entered.is_set():
            self.entered.set()
            await self.release.wait()
        return await super().complete(request)


async def test_a_model_turn_left_running_by_a_terminated_execution_is_not_asked_twice(
    temporal_server: DevServer, tmp_path: Path
) -> None:
    rid, q = run_id(), queue()
    provider = _SlowSecondTurn(list(airline.BOOK_TURNS))
    with in_world(tmp_path):
        client = await Client.connect(temporal_server.address)
        stores = await world_stores(tmp_path)
        async with (
            stores,
            worker_running(client, fast_runner(provider, stores), [airline.agent], q),
        ):
            try:
                await start_run(
                    client, airline.agent, "Book LH123", tenant=TENANT, run_id=rid,
                    task_queue=q, options=FAST,
                )  # fmt: skip
                await asyncio.wait_for(provider.entered.wait(), 30)
                cp = await Checkpointer.from_stores(stores).latest(TENANT, rid)
                assert cp is not None and cp.boundary is Boundary.after_tool_result
                await client.get_workflow_handle(rid).terminate("terminated mid-turn")
                # Carried on from the folded turn, while the old turn still thinks.
                assert await _resubmit(temporal_server, airline.agent, rid, q, stores) == rid
                await asyncio.sleep(1.0)
            finally:
                provider.release.set()
            outcome = await _outcome(client, rid)
        booked = airline.bookings()
    assert getattr(outcome, "status", None) == "completed", outcome
    assert outcome.output == "Booked LH123."
    assert [flight for flight, _ in booked] == ["LH123"]
    # The old turn's answer stood (it held the run's lease): turn 1 was asked for once.
    assert provider.asked.count(1) == 1, provider.asked


# --- approvals -----------------------------------------------------------------------------


async def test_a_pending_approval_stays_pending_across_terminate_and_resubmit_then_is_taken(
    temporal_server: DevServer, tmp_path: Path
) -> None:
    q = queue()
    with in_world(tmp_path):
        client = await Client.connect(temporal_server.address)
        async with await world_stores(tmp_path) as stores:
            # Continued-as-new after the search, then waiting: the terminated execution is
            # the second of its chain.
            rid, request = await _waiting_then_terminated(
                client, stores, q, continuation=ContinuationPolicy(max_steps=1)
            )
            executions = [e async for e in client.list_workflows(f"WorkflowId = '{rid}'")]
            runner = fast_runner(airline.provider(), stores)
            async with worker_running(client, runner, [airline.approval_agent], q):
                assert (
                    await _resubmit(temporal_server, airline.approval_agent, rid, q, stores) == rid
                )
                await asyncio.sleep(2.5)  # more than one look at the approval store
                status = await _status(client, rid)
                cp = await Checkpointer.from_stores(stores).latest(TENANT, rid)
                still = await stores.approvals.get(TENANT, request)
                booked_while_pending = airline.bookings()
                await stores.approvals.decide(TENANT, request, approved=True, by="ops")
                await client.get_workflow_handle(rid).signal(APPROVAL_SIGNAL)
                outcome = await _outcome(client, rid)
        booked = airline.bookings()
    assert len(executions) >= 2, executions  # the chain did continue before it was cut
    assert booked_while_pending == []
    assert status is WorkflowExecutionStatus.RUNNING
    assert cp is not None and cp.pending_approval is not None
    assert cp.pending_approval.id == request
    assert still is not None and still.status.value == "pending"
    assert getattr(outcome, "status", None) == "completed", outcome
    assert [flight for flight, _ in booked] == ["LH123"]


async def test_an_approval_denied_while_no_workflow_ran_stays_denied_after_resubmit(
    temporal_server: DevServer, tmp_path: Path
) -> None:
    q = queue()
    with in_world(tmp_path):
        client = await Client.connect(temporal_server.address)
        async with await world_stores(tmp_path) as stores:
            rid, request = await _waiting_then_terminated(client, stores, q)
            await stores.approvals.decide(TENANT, request, approved=False, by="ops")
            runner = fast_runner(airline.provider(), stores)
            async with worker_running(client, runner, [airline.approval_agent], q):
                await _resubmit(temporal_server, airline.approval_agent, rid, q, stores)
                outcome = await _outcome(client, rid)
            cp = await Checkpointer.from_stores(stores).latest(TENANT, rid)
            messages = [] if cp is None else await Checkpointer.from_stores(stores).messages(cp)
        booked = airline.bookings()
    assert getattr(outcome, "status", None) == "completed", outcome
    assert booked == []
    # The model was told the booking was denied, by whom.
    told = [m.text for m in messages if m.tool_call_id is not None]
    assert any("denied by ops" in t for t in told), told


async def test_a_run_cancelled_while_no_workflow_ran_is_not_restarted_by_a_resubmit(
    temporal_server: DevServer, tmp_path: Path
) -> None:
    q, url = queue(), store_url(tmp_path)
    with in_world(tmp_path):
        client = await Client.connect(temporal_server.address)
        async with await world_stores(tmp_path) as stores:
            rid, request = await _waiting_then_terminated(client, stores, q)
            runner = fast_runner(ScriptedProvider([]), stores)
            cancelled = await runner.cancel(rid, tenant=TENANT, by="ops", reason="not wanted")
            # A person approves the booking afterwards: too late, the run ended.
            await stores.approvals.decide(TENANT, request, approved=True, by="someone")
            runner = fast_runner(airline.provider(), stores)
            async with worker_running(client, runner, [airline.approval_agent], q):
                done = await tesserix(
                    *_submit_line(
                        temporal_server, q, rid, url, "on_temporal.airline:approval_agent"
                    ),
                    env=_cli_env(),
                )
                await asyncio.sleep(1.0)
                status = await _status(client, rid)
            cp = await Checkpointer.from_stores(stores).latest(TENANT, rid)
        booked = airline.bookings()
        await _ended(client, rid)
    assert cancelled is not None and cancelled.status.value == "cancelled"
    # It already ended: its id is printed, exit 0, and nothing is started or booked.
    assert (done.returncode, done.stdout.strip(), done.stderr) == (0, rid, ""), done
    assert status is WorkflowExecutionStatus.TERMINATED
    assert cp is not None and cp.status is CheckpointStatus.cancelled
    assert booked == []


# --- submit's answers ----------------------------------------------------------------------


async def test_two_resubmits_racing_start_one_execution(
    temporal_server: DevServer, tmp_path: Path
) -> None:
    q = queue()
    with in_world(tmp_path):
        client = await Client.connect(temporal_server.address)
        async with await world_stores(tmp_path) as stores:
            rid, _ = await _waiting_then_terminated(client, stores, q)
            # Nobody polls the queue now: whatever is started stays open.
            answers = await asyncio.gather(
                *(
                    _resubmit(temporal_server, airline.approval_agent, rid, q, stores)
                    for _ in range(3)
                )
            )
            await asyncio.sleep(1.0)  # visibility catches up
            executions = [e async for e in client.list_workflows(f"WorkflowId = '{rid}'")]
            await _ended(client, rid)
    assert answers == [rid] * 3
    running = [e for e in executions if e.status is WorkflowExecutionStatus.RUNNING]
    assert len(running) == 1, [(e.run_id, e.status) for e in executions]
    assert len(executions) == 2, [(e.run_id, e.status) for e in executions]


def _submit_line(server: DevServer, q: str, rid: str, url: str, agent: str) -> list[str]:
    return [
        "submit", "--temporal", server.address, "--task-queue", q, "--agent", agent,
        "--tenant", TENANT, "--input", "Book LH123", "--run-id", rid, "--store", url,
    ]  # fmt: skip


async def test_a_resubmit_with_an_agent_of_another_revision_is_refused_in_one_sentence(
    temporal_server: DevServer, tmp_path: Path
) -> None:
    assert changed_agent.revision != airline.approval_agent.revision
    q, url = queue(), store_url(tmp_path)
    with in_world(tmp_path):
        client = await Client.connect(temporal_server.address)
        async with await world_stores(tmp_path) as stores:
            rid, _ = await _waiting_then_terminated(client, stores, q)
        done = await tesserix(
            *_submit_line(
                temporal_server, q, rid, url, "on_temporal.test_attacks_carry_on:changed_agent"
            ),
            env=_cli_env(),
        )
        status = await _status(client, rid)
        await _ended(client, rid)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 4, (done.returncode, done.stdout, done.stderr)
    assert len(lines) == 1 and "revision" in done.stderr, done.stderr
    assert status is WorkflowExecutionStatus.TERMINATED  # nothing was started


async def test_a_resubmit_over_a_tampered_frontier_is_refused_and_starts_nothing(
    temporal_server: DevServer, tmp_path: Path
) -> None:
    q, url = queue(), store_url(tmp_path)
    with in_world(tmp_path):
        client = await Client.connect(temporal_server.address)
        async with await world_stores(tmp_path) as stores:
            rid, _ = await _waiting_then_terminated(client, stores, q)
        with contextlib.closing(sqlite3.connect(tmp_path / "adk.sqlite3")) as db:
            # The frontier's payload is its step snapshot's (the frontier row names the step).
            (step,) = db.execute(
                "SELECT step FROM adk_frontiers WHERE tenant = ? AND run_id = ?", (TENANT, rid)
            ).fetchone()
            where = "WHERE tenant = ? AND run_id = ? AND step = ?"
            (payload,) = db.execute(
                f"SELECT payload FROM adk_checkpoint_steps {where}", (TENANT, rid, step)
            ).fetchone()
            raw = bytes(payload)
            # The pending booking now names another flight (its checksum left as it was).
            assert raw.count(b"LH123") >= 1, raw[:200]
            with db:
                db.execute(
                    f"UPDATE adk_checkpoint_steps SET payload = ? {where}",
                    (raw.replace(b"LH123", b"LH666"), TENANT, rid, step),
                )
        done = await tesserix(
            *_submit_line(temporal_server, q, rid, url, "on_temporal.airline:approval_agent"),
            env=_cli_env(),
        )
        status = await _status(client, rid)
        await _ended(client, rid)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 4, (done.returncode, done.stdout, done.stderr)
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert done.stdout.strip() == ""
    assert status is WorkflowExecutionStatus.TERMINATED


async def test_a_resubmit_with_another_input_does_not_change_a_run_closed_before_its_frontier(
    temporal_server: DevServer, tmp_path: Path
) -> None:
    rid, q = run_id(), queue()  # nobody polls q: no frontier is ever written
    with in_world(tmp_path):
        client = await Client.connect(temporal_server.address)
        async with await world_stores(tmp_path) as stores:
            first = await start_run(
                client, airline.agent, "Book LH123", tenant=TENANT, run_id=rid, task_queue=q,
                options=FAST,
            )  # fmt: skip
            await first.terminate("terminated before any worker took it")
            assert await Checkpointer.from_stores(stores).latest(TENANT, rid) is None
            with contextlib.suppress(AdkError):  # refusing it would keep the run too
                await _resubmit(temporal_server, airline.agent, rid, q, stores, "Book UA456")
            history = await client.get_workflow_handle(rid).fetch_history()
            status = await _status(client, rid)
            await _ended(client, rid)
    started = history.events[0].workflow_execution_started_event_attributes
    given = json.loads(started.input.payloads[0].data)
    if status is WorkflowExecutionStatus.RUNNING:  # a new execution: on the run's input
        assert given["input"] == "Book LH123", given["input"]


# --- carried_from_frontier on edge frontiers (no server) ------------------------------------

_HANDLE = HistoryHandle(tenant=TENANT, run_id="r-1", count=5, digest="sha256:ab")


def _frontier(**fields: Any) -> Checkpoint:
    base: dict[str, Any] = {
        "tenant": TENANT,
        "run_id": "r-1",
        "agent_name": "airline",
        "agent_revision": airline.approval_agent.revision,
        "step": 4,
        "boundary": Boundary.after_model_call,
        "status": CheckpointStatus.running,
        "iteration": 2,
        "history_handle": _HANDLE,
        "micros": 7,
    }
    return Checkpoint(**{**base, **fields})


def _call(call_id: str) -> OutstandingCall:
    return OutstandingCall(
        call=ToolCall(id=call_id, name="book_seat", arguments={"flight": "LH123"}), key="k1:x"
    )


def test_a_waiting_frontier_carries_its_pending_approval_and_grants_and_stays_at_its_turn() -> None:
    earlier = Grant(request="apr-1", call_id="call_1_0", key="k1:a", approved=False, by="ops")
    cp = _frontier(
        boundary=Boundary.before_approval,
        status=CheckpointStatus.waiting_approval,
        outstanding=(_call("call_2_0"),),
        pending_approval=PendingApproval(id="apr-2", calls=("call_2_0",)),
        grants=(earlier,),
    )
    carried = carried_from_frontier(cp, 1234)
    assert carried.iteration == 2  # the turn held open is not skipped
    assert carried.pending_approval == {"id": "apr-2", "calls": ["call_2_0"]}
    assert carried.grants == [dataclasses.asdict(earlier)]
    assert set(carried.acting_under) == {"apr-1", "apr-2"}
    assert carried.history == dataclasses.asdict(_HANDLE)
    # The ledger's figure, not the frontier's report of it.
    assert carried.spent_micros == 1234
    back = continuation_from(carried, tenant=TENANT, agent_name="airline", run_id="r-1")
    assert back.pending_approval == cp.pending_approval and back.grants == (earlier,)


def test_a_folded_turn_is_carried_to_the_next_iteration_and_a_half_folded_one_is_refused() -> None:
    folded = _frontier(boundary=Boundary.after_tool_result)
    assert carried_from_frontier(folded, 0).iteration == 3
    half = _frontier(boundary=Boundary.after_tool_result, outstanding=(_call("call_2_1"),))
    with pytest.raises(ResumeError, match="r-1"):  # exit 4 on the command line
        carried_from_frontier(half, 0)
    open_turn = _frontier(outstanding=(_call("call_2_0"),))
    assert carried_from_frontier(open_turn, 0).iteration == 2


@pytest.mark.parametrize(
    "status",
    [CheckpointStatus.completed, CheckpointStatus.failed, CheckpointStatus.tombstone],
)
def test_a_frontier_that_ended_carries_nothing(status: CheckpointStatus) -> None:
    with pytest.raises(ResumeError, match="r-1"):
        carried_from_frontier(_frontier(status=status), 0)


# --- streams: the usage an OpenAI or Anthropic stream ends with ------------------------------


@pytest.fixture
async def openai(model_server: ModelServer) -> AsyncIterator[OpenAIProvider]:
    provider = OpenAIProvider(
        "openai:gpt-4o",
        base_url=model_server.url + "/v1",
        api_key="test-key",
        max_retries=0,
        timeout=5.0,
    )
    yield provider
    await provider.aclose()


@pytest.fixture
async def anthropic(model_server: ModelServer) -> AsyncIterator[AnthropicProvider]:
    provider = AnthropicProvider(
        "anthropic:claude-haiku-4-5",
        base_url=model_server.url,
        api_key="test-key",
        max_retries=0,
        timeout=5.0,
    )
    yield provider
    await provider.aclose()


def _request() -> ModelRequest:
    return ModelRequest(agent_name="bank", instructions="x", messages=(Message.user("pay"),))


async def _streamed(provider: Any) -> Any:
    return await asyncio.wait_for(provider.complete_streaming(_request(), lambda _: None), 20)


async def test_an_openai_usage_chunk_before_the_finish_reason_is_counted(
    model_server: ModelServer, openai: OpenAIProvider
) -> None:
    frames = openai_stream("Paid.", usage=(5000, 1000))
    # [... text, finish, usage, DONE] -> [... text, usage, finish, DONE]
    model_server.queue(Reply(events=[*frames[:-3], frames[-2], frames[-3], frames[-1]]))
    response = await _streamed(openai)
    assert response.message.text == "Paid."
    assert (response.usage.input_tokens, response.usage.output_tokens) == (5000, 1000)


async def test_two_openai_usage_chunks_are_counted_once(
    model_server: ModelServer, openai: OpenAIProvider
) -> None:
    frames = openai_stream("Paid.", usage=(5000, 1000))
    model_server.queue(Reply(events=[*frames[:-1], frames[-2], frames[-1]]))
    response = await _streamed(openai)
    assert (response.usage.input_tokens, response.usage.output_tokens) == (5000, 1000)


async def test_an_openai_stream_with_its_usage_but_no_done_is_taken_with_that_usage(
    model_server: ModelServer, openai: OpenAIProvider
) -> None:
    frames = openai_stream("Paid.", usage=(5000, 1000))
    model_server.queue(Reply(events=frames[:-1]))  # clean close after the usage chunk
    response = await _streamed(openai)
    assert (response.usage.input_tokens, response.usage.output_tokens) == (5000, 1000)


async def test_an_openai_usage_chunk_without_a_finished_choice_is_cut(
    model_server: ModelServer, openai: OpenAIProvider
) -> None:
    frames = openai_stream("Paid.", usage=(5000, 1000))
    model_server.queue(Reply(events=[*frames[:-3], frames[-2], frames[-1]]))  # no finish
    with pytest.raises(ProviderError) as caught:
        await _streamed(openai)
    assert caught.value.retryable


async def test_an_openai_usage_chunk_with_null_counts_is_not_taken_as_a_free_reply(
    model_server: ModelServer, openai: OpenAIProvider
) -> None:
    frames = openai_stream("Paid.", usage=(5000, 1000))
    usage = json.loads(frames[-2].removeprefix("data: "))
    usage["usage"] = {"prompt_tokens": None, "completion_tokens": None, "total_tokens": None}
    model_server.queue(Reply(events=[*frames[:-2], f"data: {json.dumps(usage)}\n\n", frames[-1]]))
    try:
        response = await _streamed(openai)
    except ProviderError as exc:
        assert exc.retryable  # refused as a stream without its usage: asked again
        return
    assert response.usage.output_tokens > 0, response.usage


def _anthropic_delta(frames: list[str], **usage: Any) -> str:
    body = json.loads(frames[-2].split("data: ", 1)[1])
    if usage.get("drop"):
        del body["usage"]
    else:
        body["usage"] = usage
    return f"event: message_delta\ndata: {json.dumps(body)}\n\n"


async def test_an_anthropic_message_delta_without_usage_is_a_retryable_cut(
    model_server: ModelServer, anthropic: AnthropicProvider
) -> None:
    frames = anthropic_stream("Paid.", usage=(100, 4000))
    model_server.queue(
        Reply(events=[*frames[:-2], _anthropic_delta(frames, drop=True), frames[-1]])
    )
    with pytest.raises(ProviderError) as caught:
        await _streamed(anthropic)
    assert caught.value.retryable


async def test_a_repeated_anthropic_message_delta_counts_its_last_cumulative_usage(
    model_server: ModelServer, anthropic: AnthropicProvider
) -> None:
    frames = anthropic_stream("Paid.", usage=(100, 4000))
    early = _anthropic_delta(frames, output_tokens=7)
    model_server.queue(Reply(events=[*frames[:-2], early, frames[-2], frames[-1]]))
    response = await _streamed(anthropic)
    assert (response.usage.input_tokens, response.usage.output_tokens) == (100, 4000)
