"""An attacker's look at the Temporal path after today's commits: recorded outcomes that name
their record (format 3, ``outcomes.record_tag``, read back in ``temporal/steps.py _told``),
``never_ran`` records that must name who said so (``planning._said_never_ran``), the new
redaction shapes, and ``tesserix resolve`` waking the other parked runs waiting on the same
business key (``cli/waking.py wake_waiting_on``). Every run is a real ``AgentWorkflow`` on
the session's dev server (``conftest.temporal_server``), over a SQLite world.

Defect, found as a strict xfail and fixed (marker removed): ``temporal/activities._translated``
redacted only ``AdkError``; a provider's plain exception (a hand-written provider's HTTP
client echoing its headers) left the model activity as it was, and Temporal wrote its text
into the workflow's history (the retried attempt's ``last_failure``). Any other error is now
raised as a retried ``ApplicationError`` with the redacted text and no chain.

Held: a call whose activity died after (or before) its side effect, resolved ``--completed``
(format 3, bound to its record; a token list in the operator's paste masked) or
``--never-ran`` (naming ``ops``, no outcome), then carried on by a new execution: booked
once, the model told the operator's outcome / the real booking; two Temporal runs sharing a
business key, resolved on the run whose claim it is (refused on the other, naming it,
``also_woken`` empty), both carried on replay it and charge once; a kit run dead after
recording its call, handed over with ``carry_on_run``, replays it (not in history); a JSON
token list in a tool error, an object under ``credentials``, a list under ``access_token``
and ``call_sk-proj-…`` ids reach neither history nor the SQLite file; a run cancelled while
its workflow was closed in doubt, then resolved ``--never-ran``, stays cancelled, unsent.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import pytest
from temporalio.client import Client, WorkflowFailureError

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
from on_temporal.test_attacks_temporal_shared_keys import Told
from tesserix_adk import Agent, Checkpointer, ScriptedProvider, ToolContext, tool
from tesserix_adk.checkpoint.payload import decode_outcome, record_tag
from tesserix_adk.errors import CheckpointCorruptError, ResumeError
from tesserix_adk.messages import Message, Role, ToolCall
from tesserix_adk.providers.base import ModelRequest, ModelResponse
from tesserix_adk.stores.protocols import RecordStatus
from tesserix_adk.temporal import RunOutcome, carry_on_run, start_run
from tesserix_adk.testing.faults import SimulatedCrash
from tesserix_adk.testing.secrets import leaked_secrets, planted_secrets

TENANT = airline.TENANT


def _cli_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(TESTS)}


def _world_bytes(world: Path) -> bytes:
    """Every byte of the world's SQLite database (main file, WAL and journal)."""
    out = b""
    for name in ("adk.sqlite3", "adk.sqlite3-wal", "adk.sqlite3-journal"):
        path = world / name
        if path.exists():
            out += path.read_bytes()
    return out


async def _dead_in_book_seat(server: DevServer, world: Path, hold: str, rid: str) -> Exception:
    """The booking run on a worker process SIGKILLed at ``hold`` inside ``book_seat``, a
    second worker process then refusing the call in doubt: the workflow's failure."""
    (world / hold).touch()
    q = queue()
    async with await world_stores(world):
        pass
    client = await Client.connect(server.address)
    first = await WorkerProcess.start(server.address, q, "agent")
    try:
        handle = await start_run(
            client, airline.agent, "Book LH123", tenant=TENANT, run_id=rid, task_queue=q,
            options=FAST,
        )  # fmt: skip
        await wait_for_file(world / "entered")
        await first.kill()
    finally:
        await first.stop()
    (world / hold).unlink()
    second = await WorkerProcess.start(server.address, q, "agent")
    try:
        try:
            await asyncio.wait_for(handle.result(), 60)
        except WorkflowFailureError as exc:
            return exc
        raise AssertionError("the run did not fail in doubt")
    finally:
        await second.stop()


async def _resolve(rid: str, url: str, *how: str, call: str = "call_1_0") -> Any:
    return await tesserix(
        "resolve", rid, "--tenant", TENANT, "--call", call, *how, "--by", "ops", "--store", url,
        "--json", env=_cli_env(),
    )  # fmt: skip


async def _carried_on(
    server: DevServer, world: Path, rid: str, agent: Agent, provider: Any
) -> tuple[RunOutcome, Any]:
    """A new execution of ``rid`` from its frontier (``carry_on_run``, what ``submit
    --temporal`` does for a closed run) on an in-process worker: its outcome and history."""
    client = await Client.connect(server.address)
    async with await world_stores(world) as stores:
        cp = await Checkpointer.from_stores(stores).latest(TENANT, rid)
        assert cp is not None
        q = queue()
        async with worker_running(client, fast_runner(provider, stores), [agent], q):
            handle = await carry_on_run(
                client, agent, cp, spent_micros=await stores.ledger.spent(TENANT, rid),
                task_queue=q, options=FAST,
            )  # fmt: skip
            try:
                outcome = await asyncio.wait_for(handle.result(), 40)
            finally:
                with contextlib.suppress(Exception):
                    await handle.terminate("attack test over")
            history = await handle.fetch_history()
    return outcome, history


def _told_in_last_request(provider: Told) -> list[str]:
    return [m.text for m in provider.seen[-1].messages if m.role is Role.tool]


# --- 1. an activity dead after the side effect, resolved by an operator, carried on -----------


async def test_a_call_resolved_completed_after_its_activity_died_replays_the_operators_outcome(
    temporal_server: DevServer, tmp_path: Path
) -> None:
    rid, url = run_id(), store_url(tmp_path)
    with in_world(tmp_path):
        failure = await _dead_in_book_seat(temporal_server, tmp_path, "hold_after", rid)
        assert "IndeterminateToolCallError" in repr(failure.cause)
        assert len(airline.bookings()) == 1
        # The operator pastes the airline's answer, a token list in its note among it.
        note = "airline said " + json.dumps({"token": list(LIST_SECRETS)})
        pasted = {"booking": "B-BY-OPS", "flight": "LH123", "note": note}
        resolved = await _resolve(rid, url, "--outcome", json.dumps(pasted))
        assert resolved.returncode == 0, resolved.stderr
        said = json.loads(resolved.stdout)
        # Its workflow carries it (a closed one, here): no kit worker is woken for it.
        assert (said["resolved_as"], said["woken"], said["also_woken"]) == (
            "completed",
            False,
            [],
        )
        async with await world_stores(tmp_path) as stores:
            [(_, key)] = airline.bookings()
            rec = (await stores.idempotency.lookup([key], tenant=TENANT))[key]
        assert rec.status is RecordStatus.completed and rec.outcome is not None
        # The operator's outcome names its record (format 3): read under it, refused under
        # any other.
        told = decode_outcome(rec.outcome, "call_1_0", record=record_tag(TENANT, key))
        assert told.content["booking"] == "B-BY-OPS"
        assert "[redacted:token]" in told.content["note"], told.content
        with pytest.raises(CheckpointCorruptError):
            decode_outcome(rec.outcome, "call_1_0", record=record_tag(TENANT, key + "x"))
        model = Told(airline.BOOK_TURNS)
        outcome, history = await _carried_on(temporal_server, tmp_path, rid, airline.agent, model)
        booked = airline.bookings()
        stored = _world_bytes(tmp_path)
    assert (outcome.status, outcome.output) == ("completed", "Booked LH123.")
    assert len(booked) == 1  # the dead worker's booking, never sent again
    raw = b"".join(e.SerializeToString() for e in history.events)
    assert _leaks(raw) == [] and _leaks(stored) == []
    assert model.calls == 1  # only the last answer was asked for
    assert any("B-BY-OPS" in t for t in _told_in_last_request(model))


async def test_a_call_resolved_never_ran_after_its_activity_died_is_sent_once_by_the_new_execution(
    temporal_server: DevServer, tmp_path: Path
) -> None:
    rid, url = run_id(), store_url(tmp_path)
    with in_world(tmp_path):
        failure = await _dead_in_book_seat(temporal_server, tmp_path, "hold_before", rid)
        assert "IndeterminateToolCallError" in repr(failure.cause)
        assert airline.bookings() == []
        resolved = await _resolve(rid, url, "--never-ran", "--margin", "0")
        assert resolved.returncode == 0, resolved.stderr
        assert json.loads(resolved.stdout)["resolved_as"] == "never_ran"
        async with await world_stores(tmp_path) as stores:
            [rec] = [
                r for r in await stores.idempotency.records(TENANT, rid) if r.call_id == "call_1_0"
            ]
            assert rec.status is RecordStatus.never_ran
            assert rec.by == "ops" and not rec.outcome  # names who said so, holds nothing
            key = rec.key
        model = Told(airline.BOOK_TURNS)
        outcome, _ = await _carried_on(temporal_server, tmp_path, rid, airline.agent, model)
        booked = airline.bookings()
        async with await world_stores(tmp_path) as stores:
            after = (await stores.idempotency.lookup([key], tenant=TENANT))[key]
    assert outcome.status == "completed", outcome
    assert booked == [("LH123", key)]  # sent once, by the new execution, under its key
    assert after.status is RecordStatus.completed
    assert after.outcome is not None
    assert decode_outcome(after.outcome, "call_1_0", record=record_tag(TENANT, key)).content == {
        "booking": "B-LH123",
        "flight": "LH123",
    }
    assert any("B-LH123" in t for t in _told_in_last_request(model))


# --- 2. two Temporal runs sharing a business key ---------------------------------------------


def _by_order(**kw: Any) -> str:
    return f"order-{kw['arguments']['order']}"


@tool(key=_by_order)
async def slow_charge(order: str, ctx: ToolContext) -> str:
    """Charge an order, on a payment system that answers slowly."""
    with (airline.world() / "charges.txt").open("a") as f:
        f.write(f"{ctx.run_id}|{order}\n")
    await asyncio.sleep(4)
    return f"charged {order} by {ctx.run_id}"


shop = Agent("shop", "Charge.", [slow_charge])
CHARGE: list[Any] = [[("slow_charge", {"order": "5"})], "done"]


def _charges() -> list[str]:
    path = airline.world() / "charges.txt"
    return path.read_text().splitlines() if path.exists() else []


async def test_two_temporal_runs_sharing_a_key_both_replay_the_outcome_resolved_on_the_first(
    temporal_server: DevServer, tmp_path: Path
) -> None:
    r1, r2, url = run_id(), run_id(), store_url(tmp_path)
    short = dataclasses.replace(FAST, tool_timeout=1.5)
    with in_world(tmp_path):
        client = await Client.connect(temporal_server.address)
        model = Told(CHARGE)
        async with await world_stores(tmp_path) as stores:
            q = queue()
            async with worker_running(client, fast_runner(model, stores), [shop], q):
                failures = []
                for rid in (r1, r2):
                    handle = await start_run(
                        client, shop, f"go {rid}", tenant=TENANT, run_id=rid, task_queue=q,
                        options=short,
                    )  # fmt: skip
                    with pytest.raises(WorkflowFailureError) as failed:
                        await asyncio.wait_for(handle.result(), 40)
                    failures.append(failed.value)
            key = f"{TENANT}/order-5"
            rec = (await stores.idempotency.lookup([key], tenant=TENANT)).get(key)
        assert all("IndeterminateToolCallError" in repr(f.cause) for f in failures)
        assert f"run {r1!r}" in str(failures[1].cause)  # r2 waits on r1's claim
        assert [c.split("|")[0] for c in _charges()] == [r1]
        assert rec is not None and rec.run_id == r1 and rec.status is RecordStatus.in_flight
        on_r2 = await _resolve(r2, url, "--outcome", '"charged 5 by ops"', call="call_0_0")
        assert on_r2.returncode != 0 and r1 in on_r2.stderr  # resolved on the run whose call
        on_r1 = await _resolve(r1, url, "--outcome", '"charged 5 by ops"', call="call_0_0")
        assert on_r1.returncode == 0, on_r1.stderr
        # Neither run is a kit worker's to carry.
        assert json.loads(on_r1.stdout)["also_woken"] == []
        outcomes = []
        for rid in (r1, r2):
            told = Told(CHARGE)
            outcome, _ = await _carried_on(temporal_server, tmp_path, rid, shop, told)
            outcomes.append((outcome.status, told.told(rid)))
        charged = [c.split("|")[0] for c in _charges()]
    assert outcomes == [
        ("completed", ["charged 5 by ops"]),
        ("completed", ["charged 5 by ops"]),
    ]
    assert charged == [r1]  # charged once, never again


# --- 3. a kit run handed to a workflow after it recorded a format-3 outcome -----------------


async def test_a_kit_run_dead_after_recording_its_call_is_replayed_by_its_workflow(
    temporal_server: DevServer, tmp_path: Path
) -> None:
    from tesserix_adk.testing.faults import FaultyCheckpointStore

    rid = run_id()
    turns: list[Any] = [[("book_seat", {"flight": "LH123"})], "Booked LH123."]
    with in_world(tmp_path):
        async with await world_stores(tmp_path) as stores:
            dying = dataclasses.replace(
                stores,
                checkpoints=FaultyCheckpointStore(
                    stores.checkpoints,
                    crash_before=lambda body: body.get("boundary") == "after_tool_result",
                ),
            )
            kit = fast_runner(ScriptedProvider(turns), dying)
            with pytest.raises(SimulatedCrash):
                await kit.run(airline.agent, "Book LH123", tenant=TENANT, run_id=rid)
            [(_, key)] = airline.bookings()
            rec = (await stores.idempotency.lookup([key], tenant=TENANT))[key]
            assert rec.status is RecordStatus.completed and rec.outcome is not None
            with pytest.raises(CheckpointCorruptError):  # names its record: format 3
                decode_outcome(rec.outcome, "call_0_0", record=record_tag(TENANT, "other"))
            cp = await Checkpointer.from_stores(stores).latest(TENANT, rid)
            assert cp is not None and cp.boundary.value == "after_model_call"
            assert cp.carried_by is None
        model = Told(turns)
        outcome, history = await _carried_on(temporal_server, tmp_path, rid, airline.agent, model)
        booked = airline.bookings()
    assert (outcome.status, outcome.output) == ("completed", "Booked LH123.")
    assert len(booked) == 1
    assert _told_in_last_request(model) == [json.dumps({"booking": "B-LH123", "flight": "LH123"})]
    raw = b"".join(e.SerializeToString() for e in history.events)
    assert b"B-LH123" not in raw  # replayed as ``recorded``: the outcome stays in the store


# --- 4. secrets in today's shapes, on Temporal -----------------------------------------------

_OPENAI = planted_secrets()["openai_key"]
GLUED_ID = "call_" + _OPENAI
LIST_SECRETS = ("Zq8xK2mP9vR4tL7wN3bY6hC1aa", "Pp4Lm7Qz2Wx9Rt5Yb8Nc3Vd6bb")
OBJ_SECRET = "Hh3Jk8Lm2Nq7Rs4Tv9Wx1Yz5cc"


@tool
def fetch_session(user: str) -> str:
    """Open a session for the user (the upstream answers in JSON inside its error)."""
    raise RuntimeError(
        "upstream refused: "
        + json.dumps({"error": "denied", "token": list(LIST_SECRETS)})
        + " and "
        + json.dumps({"credentials": {"primary": OBJ_SECRET}}, indent=2)
    )


@tool(side_effects=False)
def session_info(user: str) -> str:
    """What the session store says about the user."""
    return "session: " + json.dumps({"user": user, "access_token": [OBJ_SECRET, None]})


secret_agent = Agent("secrets", "Open a session.", [fetch_session, session_info])


class GluedIds(Told):
    """Scripted, but every call id the model gives is a key glued to ``call_`` (with a
    second call's id the same key and a suffix)."""

    async def complete(self, request: ModelRequest) -> ModelResponse:
        response = await super().complete(request)
        calls = [
            ToolCall(id=GLUED_ID + ("" if i == 0 else f"_{i}"), name=c.name, arguments=c.arguments)
            for i, c in enumerate(response.message.tool_calls)
        ]
        if not calls:
            return response
        return dataclasses.replace(
            response, message=Message.assistant(response.message.text, calls)
        )


def _leaks(blob: bytes) -> list[str]:
    found = leaked_secrets(blob)
    found += [s for s in (*LIST_SECRETS, OBJ_SECRET) if s.encode() in blob]
    return found


async def test_secrets_in_todays_shapes_reach_neither_temporal_history_nor_the_sqlite_file(
    temporal_server: DevServer, tmp_path: Path
) -> None:
    rid = run_id()
    turns: list[Any] = [
        [("fetch_session", {"user": "ann"}), ("session_info", {"user": "ann"})],
        "Could not open it.",
    ]
    model = GluedIds(turns)
    with in_world(tmp_path):
        client = await Client.connect(temporal_server.address)
        async with await world_stores(tmp_path) as stores:
            q = queue()
            async with worker_running(client, fast_runner(model, stores), [secret_agent], q):
                handle = await start_run(
                    client, secret_agent, "open a session for ann", tenant=TENANT, run_id=rid,
                    task_queue=q, options=FAST,
                )  # fmt: skip
                outcome = await asyncio.wait_for(handle.result(), 40)
                history = await handle.fetch_history()
            cp = await Checkpointer.from_stores(stores).latest(TENANT, rid)
    assert outcome.status == "completed", outcome
    assert cp is not None
    raw = b"".join(e.SerializeToString() for e in history.events)
    assert _leaks(raw) == []
    assert _leaks(_world_bytes(tmp_path)) == []
    # The call went out and the model was told its (masked) error, not refused unsent.
    told = _told_in_last_request(model)
    assert len(told) == 2 and "upstream refused" in told[0] and "session" in told[1], told
    assert model.seen[-1].messages[1].tool_calls[0].id != GLUED_ID


# --- 5. cancel of a Temporal run whose call an operator resolves afterwards ------------------


async def test_a_run_cancelled_in_doubt_then_resolved_is_not_sent_and_ends_cancelled(
    temporal_server: DevServer, tmp_path: Path
) -> None:
    rid, url = run_id(), store_url(tmp_path)
    with in_world(tmp_path):
        failure = await _dead_in_book_seat(temporal_server, tmp_path, "hold_before", rid)
        assert "IndeterminateToolCallError" in repr(failure.cause)
        cancelled = await tesserix(
            "cancel", rid, "--tenant", TENANT, "--by", "ops", "--store", url, env=_cli_env()
        )
        assert cancelled.returncode == 0, cancelled.stderr
        resolved = await _resolve(rid, url, "--never-ran", "--margin", "0")
        assert resolved.returncode == 0, resolved.stderr
        assert json.loads(resolved.stdout)["woken"] is False
        async with await world_stores(tmp_path) as stores:
            cp = await Checkpointer.from_stores(stores).latest(TENANT, rid)
        assert cp is not None and cp.status.value == "cancelled"
        # Ended: nothing carries it on, and the call that never ran is never sent.
        with pytest.raises(ResumeError, match="has ended"):
            await _carried_on(temporal_server, tmp_path, rid, airline.agent, Told([]))
        booked = airline.bookings()
    assert booked == []


# --- 6. a provider's own exception (not the kit's) on the Temporal path ----------------------


class LeakyOnce(ScriptedProvider):
    """Scripted, but its first answer fails the way a hand-written provider's HTTP client
    does: a plain exception whose text echoes the request's credentials."""

    def __init__(self, turns: list[Any]) -> None:
        super().__init__(turns)
        self.failed = False

    async def complete(self, request: ModelRequest) -> ModelResponse:
        if not self.failed:
            self.failed = True
            raise RuntimeError(
                "401 from upstream; request headers: Authorization: "
                + planted_secrets()["bearer"]
                + " x-api-key: "
                + _OPENAI
            )
        return await super().complete(request)


async def test_a_secret_in_a_providers_plain_exception_never_reaches_temporals_history(
    temporal_server: DevServer, tmp_path: Path
) -> None:
    rid = run_id()
    model = LeakyOnce(airline.BOOK_TURNS)
    with in_world(tmp_path):
        client = await Client.connect(temporal_server.address)
        async with await world_stores(tmp_path) as stores:
            q = queue()
            async with worker_running(client, fast_runner(model, stores), [airline.agent], q):
                handle = await start_run(
                    client, airline.agent, "Book LH123", tenant=TENANT, run_id=rid,
                    task_queue=q, options=FAST,
                )  # fmt: skip
                outcome = await asyncio.wait_for(handle.result(), 40)
                history = await handle.fetch_history()
        booked = airline.bookings()
    assert model.failed
    assert outcome.status == "completed", outcome
    assert len(booked) == 1
    raw = b"".join(e.SerializeToString() for e in history.events)
    assert leaked_secrets(raw) == []
