"""An attacker's look at the Temporal tool activity after 7bb7fca (``temporal/calls.py``
``tool_call``: ``recorded`` decided from the dispatch unit's own ``ToolCallFinished``
disposition, the cancel looked at on ``ResumeConflictError`` too, ``MASKED_ON_TEMPORAL``)
and at ``temporal/steps.py`` ``_fold``, which reads recorded outcomes back. Each run is a
real ``AgentWorkflow`` on the session's dev server with an in-process worker over SQLite.

Defects (both fixed since, their tests plain: ``CallRef``, ``ToolInput`` and ``ToolResult``
carry the call's place in its turn, ``calls._the_call`` finds the frontier's call by place
and id, and ``steps._fold`` matches results by place and id):

1. (MEDIUM) ``test_two_calls_sharing_an_id_in_one_turn_are_each_sent_once_on_temporal``
   [default key, business key]. A model that gives two calls of one turn the same id (the
   kit's runner handles it: ``Attempt.positions``, events carry a position) breaks the
   workflow. ``calls.tool_call`` finds its call in the frontier by ``call_id`` alone
   (``next(c for c in cp.outstanding if c.call.id == call.call_id)``) and the workflow's
   ``CallRef``/``ToolInput`` carry no position, so both activities answer the *first*
   call: the first sends it, the second replays its record (``recorded=True``). The second
   call is never sent; ``steps._fold`` (``told = {r.call_id: r}``) then looks the second
   call's own key up, finds nothing, and ends the workflow non-retryably with
   ``CheckpointCorruptError: call dup was recorded, but its record is gone``. The kit's
   runner sends both, once each, and completes.
2. (HIGH, the model is told something false and the run completes)
   ``test_a_call_sharing_its_id_with_an_unknown_tools_call_is_not_told_unknown_tool``.
   Same cause: a turn ``[nope(), charge(order 5)]`` whose calls share an id. Both tool
   activities answer the first call ("unknown tool 'nope'", not recorded), ``_fold``
   tells the charge that text too, the charge is never sent, and the workflow completes:
   the model believes ``charge`` does not exist. The kit's runner sends the charge once
   and tells each call its own outcome. (Any refused first call — denied, invalid
   arguments, masked — would hide a second, sendable call by the same lookup; not run.)

What held (plain tests):

- An activity whose first attempt sent and recorded the call, then failed (its own lookup
  of the record out of reach): the retry (``retried=True``) replays the record as
  ``recorded``; the call is sent once and the model told its outcome.
- A call sent whose ``complete`` failed every try (record left in flight): the activity
  fails retryably; the retry does not send it again. Without a reconciler the workflow
  ends non-retryably with ``IndeterminateToolCallError`` naming ``charge``; with one, it
  is asked once, its answer recorded (``settled``) and told to the model.
- History: a keyed call's outcome crosses as ``recorded`` (every activity payload under
  8 KiB); an unkeyed one as its redacted text; an outcome over the 1 MiB cap is told
  "too large to keep" either way; no secret (``sk-…`` in a result) is in the raw history.
- An unkeyed call whose arguments hold a secret (``token``) is not sent and is told
  ``MASKED_ON_TEMPORAL``; the secret is not in the history.
- Read, not tested: the ``_kept_in`` sink makes ``Attempt.streams`` true in the tool
  activity, but only a model call (``loop``) and ``observe`` read it, and neither runs
  there; the sink keeps events in memory only. The cancel after a come-back-later is the
  shared-keys module's test, which passes.

Not looked at: a call settled by ``tesserix resolve`` then carried on, group writes under
Temporal, Redis/PostgreSQL.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from temporalio.client import Client, WorkflowFailureError, WorkflowHandle

from on_temporal.conftest import DevServer
from on_temporal.helpers import FAST, fast_runner, queue, run_id, worker_running, world_stores
from tesserix_adk import Agent, AgentRunner, ScriptedProvider, ToolContext, tool
from tesserix_adk.errors import StoreUnavailableError
from tesserix_adk.messages import Role
from tesserix_adk.reconcile import Reconciled
from tesserix_adk.run.unsendable import MASKED_ON_TEMPORAL
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.temporal import start_run

T = "acme"
SECRET = "sk-live-abcdefghijklmnopqrstuvwxyz0123456789"


def _by_order(**kw: Any) -> str:
    return f"order-{kw['arguments']['order']}"


class Told(ScriptedProvider):
    """The scripted model, keeping every request; ``same_ids`` gives every call of a turn
    one id (a model may)."""

    def __init__(self, turns: list[Any], *, same_ids: bool = False) -> None:
        super().__init__(turns)
        self.seen: list[Any] = []
        self.same_ids = same_ids

    async def complete(self, request: Any) -> Any:
        self.seen.append(request)
        response = await super().complete(request)
        if self.same_ids and response.message.tool_calls:
            calls = [dataclasses.replace(c, id="dup") for c in response.message.tool_calls]
            message = dataclasses.replace(response.message, tool_calls=tuple(calls))
            response = dataclasses.replace(response, message=message)
        return response

    def told(self, rid: str) -> list[str]:
        mine = [r for r in self.seen if r.messages[0].text == f"go {rid}"]
        return [m.text for m in mine[-1].messages if m.role is Role.tool] if mine else []


class Rig:
    def __init__(self, client: Client, stores: Stores, q: str) -> None:
        self.client = client
        self.stores = stores
        self.q = q
        self.handles: list[WorkflowHandle[Any, Any]] = []

    async def start(self, agent: Agent, rid: str) -> WorkflowHandle[Any, Any]:
        handle = await start_run(
            self.client, agent, f"go {rid}", tenant=T, run_id=rid, task_queue=self.q, options=FAST
        )
        self.handles.append(handle)
        return handle


@contextlib.asynccontextmanager
async def rig(
    server: DevServer, world: Path, provider: Any, agent: Agent, stores: Stores | None = None
) -> AsyncIterator[Rig]:
    client = await Client.connect(server.address)
    async with contextlib.AsyncExitStack() as stack:
        if stores is None:
            stores = await stack.enter_async_context(await world_stores(world))
        q = queue()
        r = Rig(client, stores, q)
        await stack.enter_async_context(
            worker_running(client, fast_runner(provider, stores), [agent], q)
        )
        try:
            yield r
        finally:
            for handle in r.handles:
                with contextlib.suppress(Exception):
                    await handle.terminate("attack test over")


async def _result(handle: WorkflowHandle[Any, Any], within: float = 15.0) -> Any:
    try:
        return await asyncio.wait_for(handle.result(), within)
    except (WorkflowFailureError, TimeoutError) as exc:
        return exc


def _failure(outcome: Any) -> str:
    cause = getattr(outcome, "cause", None)
    return f"{getattr(cause, 'type', None)}: {getattr(cause, 'message', outcome)}"


class Shop:
    def __init__(self) -> None:
        self.charged: list[tuple[str, str, int]] = []

    def agent(self, **flags: Any) -> Agent:
        @tool(**flags)
        async def charge(order: str, amount: int, ctx: ToolContext) -> str:
            """Charge an order once."""
            self.charged.append((ctx.run_id, order, amount))
            return f"charged {order}: {amount}"

        return Agent("shop", "Charge.", [charge])


# --- two calls the model gave one id, in one turn -------------------------------------------


@pytest.mark.parametrize("keyed", ["default", "business"])
async def test_two_calls_sharing_an_id_in_one_turn_are_each_sent_once_on_temporal(
    temporal_server: DevServer, tmp_path: Path, keyed: str
) -> None:
    shop = Shop()
    flags = {"key": _by_order} if keyed == "business" else {}
    agent = shop.agent(**flags)
    turns = [[("charge", {"order": "5", "amount": 10}), ("charge", {"order": "6", "amount": 20})]]
    # The kit's own runner, for comparison: each call sent once, each told its own outcome.
    kit_model = Told([*turns, "done"], same_ids=True)
    kit_run = run_id()
    async with await world_stores(tmp_path / "kit") as kit_stores:
        done = await AgentRunner.from_stores(kit_model, kit_stores).run(
            agent, f"go {kit_run}", tenant=T, run_id=kit_run
        )
    assert done.status == "completed"
    assert kit_model.told(kit_run) == ["charged 5: 10", "charged 6: 20"]
    shop.charged.clear()
    model = Told([*turns, "done"], same_ids=True)
    rid = run_id()
    async with rig(temporal_server, tmp_path, model, agent) as world:
        outcome = await _result(await world.start(agent, rid))
    assert getattr(outcome, "status", None) == "completed", _failure(outcome)
    assert shop.charged == [(rid, "5", 10), (rid, "6", 20)]
    assert model.told(rid) == ["charged 5: 10", "charged 6: 20"]


async def test_a_call_sharing_its_id_with_an_unknown_tools_call_is_not_told_unknown_tool(
    temporal_server: DevServer, tmp_path: Path
) -> None:
    shop = Shop()
    agent = shop.agent()
    turns = [[("nope", {}), ("charge", {"order": "5", "amount": 10})]]
    kit_model = Told([*turns, "done"], same_ids=True)
    kit_run = run_id()
    async with await world_stores(tmp_path / "kit") as kit_stores:
        done = await AgentRunner.from_stores(kit_model, kit_stores).run(
            agent, f"go {kit_run}", tenant=T, run_id=kit_run
        )
    assert done.status == "completed"
    assert kit_model.told(kit_run) == ["unknown tool 'nope'", "charged 5: 10"]
    shop.charged.clear()
    model = Told([*turns, "done"], same_ids=True)
    rid = run_id()
    async with rig(temporal_server, tmp_path, model, agent) as world:
        outcome = await _result(await world.start(agent, rid))
    assert getattr(outcome, "status", None) == "completed", _failure(outcome)
    # The charge was asked for with a tool the agent has: it is sent (once), or at least
    # not answered with another call's "unknown tool".
    assert model.told(rid) == ["unknown tool 'nope'", "charged 5: 10"], model.told(rid)
    assert shop.charged == [(rid, "5", 10)]


# --- an activity retried after its first attempt sent the call ------------------------------


class Faulty:
    """Faults in the world's idempotency store, armed once the tool has run."""

    def __init__(self, stores: Stores) -> None:
        self.store = stores.idempotency
        self.sent = False
        self.lookups_to_fail = 0
        self.completes_to_fail = 0
        self.failed: list[str] = []
        lookup, complete = self.store.lookup, self.store.complete

        async def failing_lookup(keys: Any, **kw: Any) -> Any:
            if self.sent and self.lookups_to_fail:
                self.lookups_to_fail -= 1
                self.failed.append("lookup")
                raise StoreUnavailableError("injected: lookup out of reach")
            return await lookup(keys, **kw)

        async def failing_complete(key: str, payload: bytes, **kw: Any) -> Any:
            if self.sent and self.completes_to_fail:
                self.completes_to_fail -= 1
                self.failed.append("complete")
                raise StoreUnavailableError("injected: complete out of reach")
            return await complete(key, payload, **kw)

        self.store.lookup = failing_lookup  # type: ignore[method-assign]
        self.store.complete = failing_complete  # type: ignore[method-assign]


def _faulty_shop(faults: list[Faulty], **flags: Any) -> tuple[list[str], Agent]:
    charged: list[str] = []

    @tool(**flags)
    async def charge(order: str, amount: int, ctx: ToolContext) -> str:
        """Charge an order once."""
        charged.append(order)
        faults[0].sent = True
        return f"charged {order}: {amount}"

    return charged, Agent("shop", "Charge.", [charge])


async def test_a_call_recorded_then_its_activity_retried_is_replayed_not_sent_again(
    temporal_server: DevServer, tmp_path: Path
) -> None:
    faults: list[Faulty] = []
    charged, agent = _faulty_shop(faults)
    model = Told([[("charge", {"order": "5", "amount": 10})], "done"])
    rid = run_id()
    async with await world_stores(tmp_path) as stores:
        fault = Faulty(stores)
        faults.append(fault)
        fault.lookups_to_fail = 1  # tool_call's own lookup after the record: attempt 1 fails
        async with rig(temporal_server, tmp_path, model, agent, stores) as world:
            handle = await world.start(agent, rid)
            outcome = await _result(handle)
            history = await handle.fetch_history()
    assert getattr(outcome, "status", None) == "completed", _failure(outcome)
    assert fault.failed == ["lookup"]
    assert charged == ["5"]  # replayed on the retry, not sent again
    assert model.told(rid) == ["charged 5: 10"]
    tool_attempts = [
        e.activity_task_started_event_attributes.attempt
        for e in history.events
        if e.HasField("activity_task_started_event_attributes")
    ]
    assert max(tool_attempts) == 2


@pytest.mark.parametrize("reconciled", [False, True], ids=["no-reconciler", "reconciler"])
async def test_a_sent_call_whose_record_failed_is_not_sent_again_on_the_retry(
    temporal_server: DevServer, tmp_path: Path, reconciled: bool
) -> None:
    faults: list[Faulty] = []
    asked: list[str | None] = []

    def found(call: Any, ctx: ToolContext) -> Reconciled:
        asked.append(ctx.idempotency_key)
        return Reconciled.completed("found charged 5 in the ledger")

    flags = {"reconcile": found} if reconciled else {}
    charged, agent = _faulty_shop(faults, **flags)
    model = Told([[("charge", {"order": "5", "amount": 10})], "done"])
    rid = run_id()
    async with await world_stores(tmp_path) as stores:
        fault = Faulty(stores)
        faults.append(fault)
        fault.completes_to_fail = 3  # every try of the first attempt's record
        async with rig(temporal_server, tmp_path, model, agent, stores) as world:
            outcome = await _result(await world.start(agent, rid))
    assert fault.failed == ["complete"] * 3
    assert charged == ["5"]  # sent once, never again
    if reconciled:
        assert getattr(outcome, "status", None) == "completed", _failure(outcome)
        assert len(asked) == 1
        assert model.told(rid) == ["found charged 5 in the ledger"]
    else:
        assert isinstance(outcome, WorkflowFailureError), outcome
        said = _failure(outcome)
        assert said.startswith("IndeterminateToolCallError:"), said
        assert "charge" in said


# --- what crosses Temporal's history ---------------------------------------------------------


def _raw(history: Any) -> bytes:
    """Every event of ``history`` as the server keeps it (payload data unencoded)."""
    return b"".join(e.SerializeToString() for e in history.events)


def _payload_sizes(history: Any) -> list[int]:
    """The size of every activity result and input payload in ``history``."""
    sizes: list[int] = []
    for e in history.events:
        for field in (
            "activity_task_completed_event_attributes",
            "activity_task_scheduled_event_attributes",
        ):
            if e.HasField(field):
                attrs = getattr(e, field)
                box = attrs.result if field.endswith("completed_event_attributes") else attrs.input
                sizes += [len(p.data) for p in box.payloads]
    return sizes


@pytest.mark.parametrize("keyed", [True, False], ids=["keyed", "unkeyed"])
async def test_no_secret_and_no_outcome_over_the_cap_crosses_temporal_history(
    temporal_server: DevServer, tmp_path: Path, keyed: bool
) -> None:
    big = "x" * (1536 * 1024)

    @tool(**({} if keyed else {"key": None, "side_effects": False}))
    def fetch(size: str) -> str:
        """Fetch a document."""
        return f"token {SECRET} " + (big if size == "big" else "y" * 2000)

    agent = Agent("docs", "Fetch.", [fetch])
    model = Told([[("fetch", {"size": "small"}), ("fetch", {"size": "big"})], "done"])
    rid = run_id()
    async with rig(temporal_server, tmp_path, model, agent) as world:
        handle = await world.start(agent, rid)
        outcome = await _result(handle)
        history = await handle.fetch_history()
    assert getattr(outcome, "status", None) == "completed", _failure(outcome)
    small, large = model.told(rid)
    assert SECRET not in small and small.startswith("token ")
    assert "too large to keep" in large, large[:200]
    assert f"go {rid}".encode() in _raw(history)  # the look would see a secret there
    assert SECRET.encode() not in _raw(history)
    sizes = _payload_sizes(history)
    # Keyed: the outcome crosses as ``recorded`` (ids only); unkeyed, its redacted text.
    assert max(sizes) < (8 * 1024 if keyed else 16 * 1024), sorted(sizes)[-3:]


async def test_an_unkeyed_call_with_a_secret_in_its_arguments_is_told_masked_on_temporal(
    temporal_server: DevServer, tmp_path: Path
) -> None:
    sent: list[str] = []

    @tool(key=None)
    def notify(channel: str, token: str) -> str:
        """Post to a channel."""
        sent.append(token)
        return f"posted to {channel}"

    agent = Agent("ops", "Notify.", [notify])
    model = Told([[("notify", {"channel": "c1", "token": SECRET})], "done"])
    rid = run_id()
    async with rig(temporal_server, tmp_path, model, agent) as world:
        handle = await world.start(agent, rid)
        outcome = await _result(handle)
        history = await handle.fetch_history()
    assert getattr(outcome, "status", None) == "completed", _failure(outcome)
    assert sent == []
    assert model.told(rid) == [MASKED_ON_TEMPORAL]
    assert SECRET.encode() not in _raw(history)
