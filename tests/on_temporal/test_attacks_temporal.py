"""Attacks on the Temporal integration's promises: a call that happened is never sent again,
one in doubt is never guessed, nothing secret reaches Temporal's history, no payload nears
Temporal's 2 MiB limit, the workflow replays deterministically, and the command line ends in
one sentence with its documented exit code.

Tests marked ``xfail(strict=True)`` are defects: each asserts the promise as it should hold.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
from pathlib import Path
from typing import Any

import pytest
from temporalio.client import Client, WorkflowFailureError
from temporalio.exceptions import WorkflowAlreadyStartedError
from temporalio.worker import Replayer

from on_temporal import airline
from on_temporal.conftest import DevServer
from on_temporal.helpers import (
    FAST,
    TESTS,
    WorkerProcess,
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
from tesserix_adk import Agent, Checkpointer, ScriptedProvider, ToolContext, tool
from tesserix_adk.checkpoint.continuation import ContinuationPolicy
from tesserix_adk.temporal import APPROVAL_SIGNAL, AgentWorkflow, RunOutcome, start_run
from tesserix_adk.testing.secrets import leaked_secrets, planted_secrets

TENANT = airline.TENANT
AGENT = "on_temporal.airline:agent"

# Tools of this module's agents: each counts its sends in the world directory, so a second
# send is seen whatever the kit recorded.


def _sent(name: str) -> None:
    with (airline.world() / f"{name}.sent").open("a") as f:
        f.write("x\n")


def _sends(name: str) -> int:
    path = airline.world() / f"{name}.sent"
    return len(path.read_text().splitlines()) if path.exists() else 0


@tool(side_effects=False)
def card_on_file(customer: str) -> str:
    """The customer's card and credentials on file."""
    return "card on file: " + " ".join(planted_secrets().values())


@tool
def export_report(name: str) -> str:
    """Export a large report (a side effect: it is filed with the regulator)."""
    _sent("export_report")
    return "R" * (2 * 1024 * 1024 + 512 * 1024)


@tool
def export_chunk(name: str) -> str:
    """Export one part of a report (a side effect), just under the kit's result cap."""
    _sent("export_chunk")
    return name[:1] * (900 * 1024)


@tool(side_effects=False)
def search_flights_in_cabin(origin: str, dest: str, cabin: str = "economy") -> list[str]:
    """Find flights between two airports, in a cabin."""
    return []


@tool
async def slow_async_booking(flight: str, ctx: ToolContext) -> str:
    """Book a seat, then wait on the airline's slow confirmation."""
    _sent("slow_async_booking")
    await asyncio.sleep(float(os.environ.get("ATTACK_SLOW", "4")))
    return f"B-{flight}"


@tool
def slow_sync_booking(flight: str, ctx: ToolContext) -> str:
    """Book a seat on an airline that answers slowly."""
    import time

    _sent("slow_sync_booking")
    time.sleep(float(os.environ.get("ATTACK_SLOW", "4")))
    return f"B-{flight}"


def _agent(*tools: Any) -> Agent:
    return Agent("attacker", "Do what the user asks.", list(tools))


# ``--agent on_temporal.test_attacks_temporal:slow_agent`` for the command line.
slow_agent = _agent(slow_async_booking)


async def _run(
    server: DevServer,
    world: Path,
    agent: Agent,
    turns: list[Any],
    *,
    within: float = 40.0,
    **start: Any,
) -> tuple[Any, Any]:
    """Run ``agent`` on ``turns`` with an in-process worker; (outcome or error, handle)."""
    client = await Client.connect(server.address)
    async with await world_stores(world) as stores:
        q = queue()
        async with worker_running(client, fast_runner(ScriptedProvider(turns), stores), [agent], q):
            handle = await start_run(
                client,
                agent,
                start.pop("input", "go"),
                tenant=TENANT,
                run_id=start.pop("rid", None) or run_id(),
                task_queue=q,
                options=start.pop("options", FAST),
                **start,
            )
            try:
                outcome: Any = await asyncio.wait_for(handle.result(), within)
            except (WorkflowFailureError, TimeoutError) as exc:
                outcome = exc
            finally:
                # A run left going would keep this worker's queue busy: ended (a no-op on a
                # closed workflow, whose error is ignored).
                with contextlib.suppress(Exception):
                    await handle.terminate("attack test over")
    return outcome, handle


# --- secrets -------------------------------------------------------------------------------


async def test_a_secret_a_tool_returns_never_reaches_temporals_history(
    temporal_server: DevServer, tmp_path: Path
) -> None:
    agent = _agent(card_on_file)
    with in_world(tmp_path):
        outcome, handle = await _run(
            temporal_server,
            tmp_path,
            agent,
            [[("card_on_file", {"customer": "c-1"})], "Done."],
        )
        history = await handle.fetch_history()
    assert getattr(outcome, "status", None) == "completed", outcome
    raw = b"".join(event.SerializeToString() for event in history.events)
    # A recorded result stays in the kit's store: it never crosses, masked or not.
    assert b"card on file" not in raw
    assert leaked_secrets(raw) == []


async def test_a_secret_in_a_tools_arguments_never_reaches_temporals_history(
    temporal_server: DevServer, tmp_path: Path
) -> None:
    secret = " ".join(planted_secrets().values())
    agent = _agent(card_on_file)
    with in_world(tmp_path):
        outcome, handle = await _run(
            temporal_server,
            tmp_path,
            agent,
            [[("card_on_file", {"customer": f"c-1 {secret}"})], "Done."],
        )
        history = await handle.fetch_history()
    assert getattr(outcome, "status", None) == "completed", outcome
    raw = b"".join(event.SerializeToString() for event in history.events)
    # Arguments never cross (only the call's id does); the result is masked or not, but
    # the arguments' own text must be absent.
    assert b"c-1 " not in raw


# --- determinism ---------------------------------------------------------------------------


async def test_a_finished_runs_history_replays_without_nondeterminism(
    temporal_server: DevServer, tmp_path: Path
) -> None:
    with in_world(tmp_path):
        outcome, handle = await _run(
            temporal_server, tmp_path, airline.agent, list(airline.BOOK_TURNS)
        )
        history = await handle.fetch_history()
    assert getattr(outcome, "status", None) == "completed", outcome
    result = await Replayer(workflows=[AgentWorkflow]).replay_workflow(
        history, raise_on_replay_failure=False
    )
    assert result.replay_failure is None, result.replay_failure


async def test_every_execution_of_a_continued_chain_replays_without_nondeterminism(
    temporal_server: DevServer, tmp_path: Path
) -> None:
    with in_world(tmp_path):
        outcome, handle = await _run(
            temporal_server,
            tmp_path,
            airline.agent,
            list(airline.BOOK_TURNS),
            continuation=ContinuationPolicy(max_steps=1),
        )
        assert getattr(outcome, "status", None) == "completed", outcome
        assert len(outcome.chain) >= 2, outcome.chain
        client = await Client.connect(temporal_server.address)
        histories = []
        execution: str | None = handle.first_execution_run_id
        while execution:
            history = await client.get_workflow_handle(handle.id, run_id=execution).fetch_history()
            histories.append(history)
            last = history.events[-1]
            continued = last.workflow_execution_continued_as_new_event_attributes
            execution = continued.new_execution_run_id or None
    assert len(histories) == len(outcome.chain) + 1
    replayer = Replayer(workflows=[AgentWorkflow])
    for history in histories:
        result = await replayer.replay_workflow(history, raise_on_replay_failure=False)
        assert result.replay_failure is None, result.replay_failure


# --- payload size --------------------------------------------------------------------------


async def test_a_tool_result_over_the_payload_limit_ends_the_run_and_is_sent_once(
    temporal_server: DevServer, tmp_path: Path
) -> None:
    agent = _agent(export_report)
    with in_world(tmp_path):
        outcome, _ = await _run(
            temporal_server,
            tmp_path,
            agent,
            [[("export_report", {"name": "q3"})], "Filed."],
            within=25.0,
        )
        sends = _sends("export_report")
    assert sends == 1
    # Either the transcript stays in the kit's stores (completed) or the run fails in words.
    assert not isinstance(outcome, TimeoutError), "the run neither completed nor failed"
    assert getattr(outcome, "status", None) == "completed", outcome


async def test_a_turn_whose_results_together_pass_the_payload_limit_still_ends(
    temporal_server: DevServer, tmp_path: Path
) -> None:
    agent = _agent(export_chunk)
    turns: list[Any] = [[("export_chunk", {"name": n}) for n in ("a", "b", "c")], "Exported."]
    with in_world(tmp_path):
        # The server's workflow task timeout is 10 s: by 12 s it has been tried twice.
        outcome, _ = await _run(temporal_server, tmp_path, agent, turns, within=12.0)
        sends = _sends("export_chunk")
    assert sends == 3
    assert not isinstance(outcome, TimeoutError), "the run neither completed nor failed"
    # Recorded results no longer cross Temporal, so the turn closes; its frontier is then
    # over the kit's own max_bytes, which ends the run in words, as the kit's loop does.
    if getattr(outcome, "status", None) != "completed":
        assert "CheckpointTooLargeError" in repr(outcome) + repr(outcome.__cause__), outcome


# --- a tool slower than its start-to-close timeout ----------------------------------------


@pytest.mark.parametrize("slow", [slow_async_booking, slow_sync_booking], ids=["async", "sync"])
async def test_a_tool_slower_than_its_timeout_is_never_sent_twice(
    temporal_server: DevServer, tmp_path: Path, slow: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Temporal times the first attempt out at 1.5 s and retries while it still runs (4 s).
    monkeypatch.setenv("ATTACK_SLOW", "4")
    agent = _agent(slow)
    options = dataclasses.replace(FAST, tool_timeout=1.5)
    with in_world(tmp_path):
        outcome, _ = await _run(
            temporal_server,
            tmp_path,
            agent,
            [[(slow.name, {"flight": "LH123"})], "Booked."],
            options=options,
            within=30.0,
        )
        # Let a first attempt that was cancelled but not stopped finish what it does.
        await asyncio.sleep(1.0)
        sends = _sends(slow.name)
    assert sends == 1
    if isinstance(outcome, WorkflowFailureError):
        # Refused as in doubt, naming the call: never guessed.
        assert "IndeterminateToolCallError" in repr(outcome.cause), outcome.cause
    else:
        assert not isinstance(outcome, TimeoutError), "the run neither completed nor failed"


async def test_a_resolved_run_can_go_on_on_temporal_or_submit_says_it_cannot(
    temporal_server: DevServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ATTACK_SLOW", "4")
    rid, url, q = run_id(), store_url(tmp_path), queue()
    options = dataclasses.replace(FAST, tool_timeout=1.5)
    turns: list[Any] = [[("slow_async_booking", {"flight": "LH123"})], "Booked."]
    with in_world(tmp_path):
        outcome, _ = await _run(
            temporal_server, tmp_path, slow_agent, turns, options=options, rid=rid
        )
        assert isinstance(outcome, WorkflowFailureError), outcome
        assert "IndeterminateToolCallError" in repr(outcome.cause)
        resolved = await tesserix(
            "resolve",
            rid,
            "--tenant",
            TENANT,
            "--call",
            "call_0_0",
            "--outcome",
            '"B-LH123"',
            "--by",
            "ops",
            "--store",
            url,
            env=_cli_env(),
        )
        assert resolved.returncode == 0, resolved.stderr
        again = await tesserix(
            "submit",
            "--temporal",
            temporal_server.address,
            "--task-queue",
            q,
            "--agent",
            "on_temporal.test_attacks_temporal:slow_agent",
            "--tenant",
            TENANT,
            "--input",
            "go",
            "--run-id",
            rid,
            "--store",
            url,
            env=_cli_env(),
        )
        client = await Client.connect(temporal_server.address)
        latest = await client.get_workflow_handle(rid).describe()  # the newest execution
        status = latest.status
    assert status is not None
    if again.returncode == 0:
        # It printed the run id as started: then something must carry it.
        assert status.name != "FAILED", (again.stdout, again.stderr)
    else:
        assert rid in again.stderr and len(again.stderr.strip().splitlines()) == 1


async def test_a_resolved_run_is_carried_on_by_a_new_execution_and_books_once(
    temporal_server: DevServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The run's workflow failed on a call in doubt; `tesserix resolve` settled it; the same
    `tesserix submit --temporal` starts a new execution from the run's frontier, which
    replays the resolved outcome (the booking is not sent again) and finishes the run.
    Submitting the id once more, after it completed, starts nothing."""
    monkeypatch.setenv("ATTACK_SLOW", "4")
    rid, url, q = run_id(), store_url(tmp_path), queue()
    options = dataclasses.replace(FAST, tool_timeout=1.5)
    turns: list[Any] = [[("slow_async_booking", {"flight": "LH123"})], "Booked."]
    submit = [
        "submit",
        "--temporal",
        temporal_server.address,
        "--task-queue",
        q,
        "--agent",
        "on_temporal.test_attacks_temporal:slow_agent",
        "--tenant",
        TENANT,
        "--input",
        "go",
        "--run-id",
        rid,
        "--store",
        url,
    ]
    with in_world(tmp_path):
        outcome, _ = await _run(
            temporal_server, tmp_path, slow_agent, turns, options=options, rid=rid
        )
        assert isinstance(outcome, WorkflowFailureError), outcome
        assert _sends("slow_async_booking") == 1
        resolved = await tesserix(
            "resolve", rid, "--tenant", TENANT, "--call", "call_0_0", "--outcome",
            '"B-LH123"', "--by", "ops", "--store", url, env=_cli_env(),
        )  # fmt: skip
        assert resolved.returncode == 0, resolved.stderr
        client = await Client.connect(temporal_server.address)
        async with await world_stores(tmp_path) as stores:
            runner = fast_runner(ScriptedProvider(turns), stores)
            async with worker_running(client, runner, [slow_agent], q):
                again = await tesserix(*submit, env=_cli_env())
                assert again.returncode == 0, again.stderr
                assert again.stdout.strip() == rid
                handle = client.get_workflow_handle(rid, result_type=RunOutcome)
                result = await asyncio.wait_for(handle.result(), 40)
            assert (result.status, result.output) == ("completed", "Booked.")
            latest = await Checkpointer.from_stores(stores).latest(TENANT, rid)
            assert latest is not None and latest.status.value == "completed"
        once_more = await tesserix(*submit, env=_cli_env())
        assert once_more.returncode == 0, once_more.stderr
        assert (await client.get_workflow_handle(rid).describe()).status.name == "COMPLETED"
        assert _sends("slow_async_booking") == 1


async def test_a_second_worker_with_a_changed_agent_refuses_the_run_and_sends_nothing(
    temporal_server: DevServer, tmp_path: Path
) -> None:
    changed = Agent(
        "airline",
        "Book the flight the user asks for.",
        [search_flights_in_cabin, airline.book_seat],
    )
    assert changed.revision != airline.agent.revision
    rid, q = run_id(), queue()
    with in_world(tmp_path):
        (tmp_path / "hold_before").touch()
        async with await world_stores(tmp_path) as stores:
            client = await Client.connect(temporal_server.address)
            first = await WorkerProcess.start(temporal_server.address, q, "agent")
            try:
                handle = await start_run(
                    client,
                    airline.agent,
                    "Book LH123",
                    tenant=TENANT,
                    run_id=rid,
                    task_queue=q,
                    options=FAST,
                    task_timeout=1.0,
                )
                await wait_for_file(tmp_path / "entered")  # claimed, about to book
                await first.kill()
            finally:
                await first.stop()
            (tmp_path / "hold_before").unlink()
            async with worker_running(
                client, fast_runner(ScriptedProvider([]), stores), [changed], q
            ):
                with pytest.raises(WorkflowFailureError) as failed:
                    await asyncio.wait_for(handle.result(), 40)
        booked = airline.bookings()
    cause = repr(failed.value.cause)
    assert "RevisionMismatchError" in cause, cause
    assert airline.agent.revision in cause and changed.revision in cause
    assert booked == []


async def test_a_lost_reply_right_before_continue_as_new_is_replayed_across_the_chain(
    temporal_server: DevServer, tmp_path: Path
) -> None:
    # The booking (iteration 1) is the second step: the policy continues-as-new right after
    # it. Its worker is SIGKILLed with the call recorded and its reply to Temporal held.
    rid, q = run_id(), queue()
    with in_world(tmp_path):
        (tmp_path / "hold_reply").touch()
        async with await world_stores(tmp_path):
            pass
        client = await Client.connect(temporal_server.address)
        first = await WorkerProcess.start(temporal_server.address, q, "agent")
        try:
            handle = await start_run(
                client,
                airline.agent,
                "Book LH123",
                tenant=TENANT,
                run_id=rid,
                task_queue=q,
                options=FAST,
                continuation=ContinuationPolicy(max_steps=2),
                task_timeout=1.0,
            )
            await wait_for_file(tmp_path / "entered")
            await first.kill()
        finally:
            await first.stop()
        (tmp_path / "hold_reply").unlink()
        second = await WorkerProcess.start(temporal_server.address, q, "agent")
        try:
            outcome = await asyncio.wait_for(handle.result(), 40)
        finally:
            await second.stop()
        booked = airline.bookings()
    assert outcome.status == "completed" and outcome.output == "Booked LH123."
    assert "policy" in outcome.chain
    assert [flight for flight, _ in booked] == ["LH123"]


# --- duplicate starts ----------------------------------------------------------------------


async def test_a_second_start_with_the_same_run_id_is_refused(
    temporal_server: DevServer, tmp_path: Path
) -> None:
    rid = run_id()
    with in_world(tmp_path):
        outcome, _ = await _run(
            temporal_server, tmp_path, airline.agent, list(airline.BOOK_TURNS), rid=rid
        )
        assert getattr(outcome, "status", None) == "completed", outcome
        client = await Client.connect(temporal_server.address)
        with pytest.raises(WorkflowAlreadyStartedError):
            await start_run(
                client, airline.agent, "Book LH123", tenant=TENANT, run_id=rid, task_queue=queue()
            )
        assert len(airline.bookings()) == 1


# --- approvals and signals ------------------------------------------------------------------


async def _pending_request(stores: Any, rid: str) -> str:
    runner = fast_runner(ScriptedProvider([]), stores)
    assert runner.checkpoints is not None
    async with asyncio.timeout(30):
        while True:
            cp = await runner.checkpoints.latest(TENANT, rid)
            if cp is not None and cp.pending_approval is not None:
                return cp.pending_approval.id
            await asyncio.sleep(0.05)


async def test_approval_signals_twice_and_for_another_run_change_nothing(
    temporal_server: DevServer, tmp_path: Path
) -> None:
    rid, url = run_id(), store_url(tmp_path)
    with in_world(tmp_path):
        client = await Client.connect(temporal_server.address)
        async with await world_stores(tmp_path) as stores:
            q = queue()
            async with worker_running(
                client, fast_runner(airline.provider(), stores), [airline.approval_agent], q
            ):
                handle = await start_run(
                    client,
                    airline.approval_agent,
                    "Book LH123",
                    tenant=TENANT,
                    run_id=rid,
                    task_queue=q,
                    options=FAST,
                    approval_poll=0.3,
                )
                other = await start_run(
                    client,
                    airline.approval_agent,
                    "Book LH123",
                    tenant=TENANT,
                    run_id=run_id(),
                    task_queue=q,
                    options=FAST,
                    approval_poll=0.3,
                )
                request = await _pending_request(stores, rid)
                await _pending_request(stores, other.id)
                # Woken with nothing decided, twice: it looks, finds no decision, waits on.
                await handle.signal(APPROVAL_SIGNAL)
                await handle.signal(APPROVAL_SIGNAL)
                await asyncio.sleep(1.0)
                assert airline.bookings() == []
                approved = await tesserix(
                    "approve", request, "--tenant", TENANT, "--by", "ops", "--store", url
                )
                assert approved.returncode == 0, approved.stderr
                # The decision of one run, signalled to another run: the other waits on.
                await other.signal(APPROVAL_SIGNAL)
                await handle.signal(APPROVAL_SIGNAL)
                await handle.signal(APPROVAL_SIGNAL)
                outcome = await asyncio.wait_for(handle.result(), 40)
                await asyncio.sleep(1.0)
                assert (await other.describe()).status is not None
                still = (await other.describe()).status
                await other.terminate("attack test over")
        assert outcome.status == "completed"
        assert len(airline.bookings()) == 1
        assert still is not None and still.name == "RUNNING"


async def test_a_kit_worker_on_the_same_store_leaves_an_approved_temporal_run_alone(
    temporal_server: DevServer, tmp_path: Path
) -> None:
    rid, url = run_id(), store_url(tmp_path)
    with in_world(tmp_path):
        client = await Client.connect(temporal_server.address)
        async with await world_stores(tmp_path) as stores:
            q = queue()
            async with worker_running(
                client, fast_runner(airline.provider(), stores), [airline.approval_agent], q
            ):
                handle = await start_run(
                    client,
                    airline.approval_agent,
                    "Book LH123",
                    tenant=TENANT,
                    run_id=rid,
                    task_queue=q,
                    options=FAST,
                    # The workflow's next look at the approval store is a while off: the
                    # window a kit worker has is this wide (2 s by default).
                    approval_poll=20.0,
                )
                request = await _pending_request(stores, rid)
                approved = await tesserix(
                    "approve", request, "--tenant", TENANT, "--by", "ops", "--store", url
                )
                assert approved.returncode == 0, approved.stderr
                kit = await asyncio.wait_for(
                    tesserix(
                        "worker",
                        "--agent",
                        "on_temporal.airline:approval_agent",
                        "--provider",
                        "on_temporal.airline:provider",
                        "--exit-when-idle",
                        "--store",
                        url,
                        env=_cli_env(),
                    ),
                    40,
                )
                await handle.signal(APPROVAL_SIGNAL)
                try:
                    outcome: Any = await asyncio.wait_for(handle.result(), 40)
                except WorkflowFailureError as exc:
                    outcome = exc
        assert kit.returncode == 0, kit.stderr
        # The Temporal run is its workflow's alone: it completes there, booking once.
        assert len(airline.bookings()) == 1
        assert getattr(outcome, "status", None) == "completed", (outcome, kit.stdout)
        assert rid not in kit.stdout, kit.stdout


async def test_tesserix_cancel_mid_turn_lets_the_call_in_hand_finish_and_sends_nothing_more(
    temporal_server: DevServer, tmp_path: Path
) -> None:
    rid, url = run_id(), store_url(tmp_path)
    turns: list[Any] = [
        [("book_seat", {"flight": "LH123"})],
        [("book_seat", {"flight": "UA456"})],
        "Booked both.",
    ]
    with in_world(tmp_path):
        (tmp_path / "hold_before").touch()
        client = await Client.connect(temporal_server.address)
        async with await world_stores(tmp_path) as stores:
            q = queue()
            async with worker_running(
                client, fast_runner(ScriptedProvider(turns), stores), [airline.agent], q
            ):
                handle = await start_run(
                    client,
                    airline.agent,
                    "Book LH123 and UA456",
                    tenant=TENANT,
                    run_id=rid,
                    task_queue=q,
                    options=FAST,
                )
                await wait_for_file(tmp_path / "entered")  # inside the first booking
                cancelled = await tesserix(
                    "cancel", rid, "--tenant", TENANT, "--by", "ops", "--store", url
                )
                assert cancelled.returncode == 0, cancelled.stderr
                (tmp_path / "hold_before").unlink()
                outcome = await asyncio.wait_for(handle.result(), 30)
        assert outcome.status == "cancelled"
        assert [flight for flight, _ in airline.bookings()] == ["LH123"]


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
            env=_cli_env(),
        ),
        40,
    )


async def test_a_kit_worker_leaves_a_temporal_run_whose_worker_was_killed_alone(
    temporal_server: DevServer, tmp_path: Path
) -> None:
    # The Temporal worker dies inside the booking (claimed, not sent); its lease lapses.
    rid, q, url = run_id(), queue(), store_url(tmp_path)
    with in_world(tmp_path):
        (tmp_path / "hold_before").touch()
        async with await world_stores(tmp_path):
            pass
        client = await Client.connect(temporal_server.address)
        first = await WorkerProcess.start(temporal_server.address, q, "reconciled_agent")
        try:
            await start_run(
                client,
                airline.reconciled_agent,
                "Book LH123",
                tenant=TENANT,
                run_id=rid,
                task_queue=q,
                options=FAST,
            )
            await wait_for_file(tmp_path / "entered")
            await first.kill()
        finally:
            await first.stop()
        (tmp_path / "hold_before").unlink()
        await asyncio.sleep(2.5)  # past the lease's two seconds
        kit = await _kit_worker(url, "on_temporal.airline:reconciled_agent")
        booked = airline.bookings()
        with contextlib.suppress(Exception):
            await client.get_workflow_handle(rid).terminate("attack test over")
    assert kit.returncode == 0, kit.stderr
    assert rid not in kit.stdout, kit.stdout
    assert booked == []


# --- the command line ----------------------------------------------------------------------


def _cli_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(TESTS)}


async def test_submit_to_an_unknown_namespace_is_one_sentence(
    temporal_server: DevServer, tmp_path: Path
) -> None:
    done = await asyncio.wait_for(
        tesserix(
            "submit",
            "--temporal",
            temporal_server.address,
            "--namespace",
            "no-such-namespace",
            "--task-queue",
            queue(),
            "--agent",
            AGENT,
            "--tenant",
            TENANT,
            "--input",
            "hi",
            "--store",
            store_url(tmp_path),
            env=_cli_env(),
        ),
        60,
    )
    assert done.returncode == 2, done
    assert "no-such-namespace" in done.stderr and "RPCError" not in done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr


async def test_a_worker_for_an_unknown_namespace_is_one_sentence_and_no_banner(
    temporal_server: DevServer, tmp_path: Path
) -> None:
    done = await asyncio.wait_for(
        tesserix(
            "worker",
            "--temporal",
            temporal_server.address,
            "--namespace",
            "no-such-namespace",
            "--task-queue",
            queue(),
            "--agent",
            AGENT,
            "--provider",
            "on_temporal.airline:provider",
            "--store",
            store_url(tmp_path),
            env=_cli_env(),
        ),
        60,
    )
    assert done.returncode == 2, done
    assert "carrying runs" not in done.stdout, done.stdout
    assert "no-such-namespace" in done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr


async def test_submit_to_something_that_is_not_temporal_is_exit_3_in_one_sentence(
    tmp_path: Path,
) -> None:
    # Redis listens on 6379 (the test services): the port answers, the protocol is wrong.
    done = await asyncio.wait_for(
        tesserix(
            "submit",
            "--temporal",
            "127.0.0.1:6379",
            "--task-queue",
            "q",
            "--agent",
            AGENT,
            "--tenant",
            TENANT,
            "--input",
            "hi",
            "--store",
            store_url(tmp_path),
            env=_cli_env(),
        ),
        60,
    )
    assert done.returncode == 3, done
    assert "Traceback" not in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr


async def test_a_worker_for_an_unreachable_server_is_exit_3_in_one_sentence(
    tmp_path: Path,
) -> None:
    done = await asyncio.wait_for(
        tesserix(
            "worker",
            "--temporal",
            "127.0.0.1:1",
            "--task-queue",
            "q",
            "--agent",
            AGENT,
            "--provider",
            "on_temporal.airline:provider",
            "--store",
            store_url(tmp_path),
            env=_cli_env(),
        ),
        60,
    )
    assert done.returncode == 3, done
    assert "cannot be reached" in done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1


async def test_a_run_cancelled_while_its_call_is_in_doubt_ends_cancelled_not_failed(
    temporal_server: DevServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The booking outlives its activity's timeout (in doubt: it may have happened) and the
    operator cancels the run meanwhile. The retry finds the call in doubt: the run ends
    cancelled, as the kit's own resume ends it, the booking neither sent again nor guessed
    at (its record left in flight), instead of the workflow failing on the doubt."""
    from tesserix_adk import Redactor
    from tesserix_adk.run.cancelling import request_cancel
    from tesserix_adk.stores.protocols import RecordStatus

    monkeypatch.setenv("ATTACK_SLOW", "3")
    rid, q = run_id(), queue()
    options = dataclasses.replace(FAST, tool_timeout=1.0)
    turns: list[Any] = [[("slow_async_booking", {"flight": "LH123"})], "Booked."]
    with in_world(tmp_path):
        client = await Client.connect(temporal_server.address)
        async with await world_stores(tmp_path) as stores:
            runner = fast_runner(ScriptedProvider(turns), stores)
            async with worker_running(client, runner, [slow_agent], q):
                handle = await start_run(
                    client, slow_agent, "go", tenant=TENANT, run_id=rid, task_queue=q,
                    options=options,
                )  # fmt: skip
                for _ in range(200):  # the booking went out
                    if _sends("slow_async_booking"):
                        break
                    await asyncio.sleep(0.05)
                await request_cancel(
                    stores.idempotency, TENANT, rid, by="ops", reason=None, redactor=Redactor()
                )
                try:
                    outcome: Any = await asyncio.wait_for(handle.result(), 40)
                except WorkflowFailureError as exc:
                    outcome = exc
            records = [r for r in await stores.idempotency.records(TENANT, rid) if r.tool]
        sent = _sends("slow_async_booking")
    assert getattr(outcome, "status", None) == "cancelled", outcome
    assert sent == 1
    assert [r.status for r in records] == [RecordStatus.in_flight]  # never guessed at
