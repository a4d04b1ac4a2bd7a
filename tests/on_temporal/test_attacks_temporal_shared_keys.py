"""An attacker's look at the Temporal activity path (``temporal/steps.py`` ``tool_call``,
``temporal/activities.py``) for what the kit's own runner learned lately: a business key
two runs share (``run/claims.py`` ``unless_carried``, ``run/holding.py``), a keyed call that
cannot go out (``run/dispatch.py`` ``_not_claimed``), and key functions that raise
(``run/screening.py``). Each Temporal run here is a real ``AgentWorkflow`` on the session's
dev server, with an in-process worker over a SQLite world; the kit's runner on the same
stores plays the other run where one is needed. (The brief named ``tests/temporal/``; the
Temporal tests and their dev-server fixture live in ``tests/on_temporal/``, so this file
is here.)

Defects (all three since fixed or turned into a limit the README names; plain tests):

1. (MEDIUM, fixed) ``test_a_denied_call_under_a_key_another_run_completed_is_told_it_was_denied``.
   A refused call was not told truthfully. ``steps.tool_call`` ran ``dispatch._answer`` and
   then looked the call's key up again on its own: whenever a completed record stood under
   it, it returned ``ToolResult(recorded=True)`` and ``_fold`` told the model that record's
   outcome, whatever ``_answer`` decided. With a business key, a call an operator denied
   whose order another run charged earlier was told "charged 5: 10 by <r1>" instead of
   "denied by ops". Now only a call the dispatch unit replayed, settled or sent (its
   ``ToolCallFinished`` disposition) crosses as ``recorded``.
2. (MEDIUM, now a limit the README names, the test changed to it)
   ``test_a_call_whose_arguments_hold_a_secret_is_refused_on_temporal_saying_why``. On
   Temporal a call whose arguments hold something redaction masks (an argument named
   ``token``) is never sent, even on its first attempt: ``tool_call`` reads the call from
   the ``after_model_call`` frontier, where it is kept masked, and no secret crosses
   Temporal's history. The model was told ``MASKED_CALL`` ("ask for the call again with the
   real values"), and asking again met the same refusal until ``max_iterations``. It is now
   told ``MASKED_ON_TEMPORAL``: why, and not to ask again with the secret in it.
3. (LOW, fixed) ``test_a_run_waiting_on_another_runs_claim_ends_cancelled_when_cancelled``.
   A Temporal run told to come back later (another live run holds its order's claim) and
   then cancelled kept being retried until the other run let go: ``tool_call`` reached
   the cancel only on ``IndeterminateToolCallError``, and ``claims.unless_carried``'s
   ``ResumeConflictError`` came first. It now looks at the cancel on either.

What held (plain tests):

- A business key two runs share, the other run live (a Temporal workflow or a kit run)
  and inside the call: the Temporal run's tool activity fails retryably with
  ``ResumeConflictError`` naming that run (Temporal retries it; no spin beyond the retry
  policy's backoff), is not refused in doubt, sends nothing, and once the other run
  records it replays that outcome and completes; the order is charged once.
- The other run died with the call in hand (its lease gone): the workflow fails
  non-retryably with ``IndeterminateToolCallError`` naming that run; nothing is sent.
- A keyed call its tool's validation refuses, and one whose arguments were masked: told
  "invalid arguments ..." / ``MASKED_CALL``, nothing kept under the order's key (looked up,
  never claimed), and a later valid call of that order is sent once.
- A refused (invalid) call while a live run holds its order's claim comes back later, then
  replays that run's outcome, as the kit's runner does.
- A key function reading an argument the model left out: that call is refused "not sent:
  invalid arguments ... (so its idempotency key could not be made ...)" and the whole call
  the model asks next goes out once. A key function failing on arguments the tool accepts
  ends the workflow non-retryably with ``ConfigurationError`` naming the tool and its key
  function, after one model activity, nothing sent.

Not looked at: Redis/PostgreSQL under Temporal (SQLite only), group writes, a SIGKILLed
worker process mid-call under a shared key, continue-as-new while waiting on a shared key.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from temporalio.client import Client, WorkflowFailureError, WorkflowHandle

from on_temporal.conftest import DevServer
from on_temporal.helpers import FAST, fast_runner, queue, run_id, worker_running, world_stores
from tesserix_adk import Agent, AgentRunner, LeasePolicy, ScriptedProvider, ToolContext, tool
from tesserix_adk.checkpoint.redaction import Redactor
from tesserix_adk.errors import ConfigurationError
from tesserix_adk.messages import Role
from tesserix_adk.run.cancelling import request_cancel
from tesserix_adk.run.unsendable import MASKED_ON_TEMPORAL
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.temporal import start_run
from tesserix_adk.testing.faults import SimulatedCrash

T = "acme"
KEY = "acme/order-5"
GOOD = {"order": "5", "amount": 10}
BAD = {"order": "5", "amount": "ten"}
SECRET = {"order": "5", "amount": 10, "token": "tok-live-123"}


def _by_order(**kw: Any) -> str:
    return f"order-{kw['arguments']['order']}"


class Shop:
    """The payment system: what it charged (run, order), and a gate holding a run inside
    the call."""

    def __init__(self) -> None:
        self.charged: list[tuple[str, str]] = []
        self.inside = asyncio.Event()
        self.gate = asyncio.Event()
        self.hold: str | None = None
        self.crash: str | None = None

    def agent(self, name: str = "shop", **flags: Any) -> Agent:
        @tool(key=_by_order, **flags)
        async def charge(order: str, amount: int, ctx: ToolContext, token: str = "") -> str:
            """Charge an order once."""
            self.charged.append((ctx.run_id, order))
            if ctx.run_id == self.crash:
                raise SimulatedCrash(f"{ctx.run_id} died with the call in hand")
            if ctx.run_id == self.hold:
                self.inside.set()
                await self.gate.wait()
            return f"charged {order}: {amount} by {ctx.run_id}"

        return Agent(name, "Charge.", [charge])


class Told(ScriptedProvider):
    """The scripted model, keeping every request, so what each run was told can be read
    (a run's input names it)."""

    def __init__(self, turns: list[Any]) -> None:
        super().__init__(turns)
        self.seen: list[Any] = []

    async def complete(self, request: Any) -> Any:
        self.seen.append(request)
        return await super().complete(request)

    def told(self, rid: str) -> list[str]:
        mine = [r for r in self.seen if r.messages[0].text == f"go {rid}"]
        return [m.text for m in mine[-1].messages if m.role is Role.tool] if mine else []


class Rig:
    """One client, the world's stores, and a worker per agent (each its own queue)."""

    def __init__(self, client: Client, stores: Stores) -> None:
        self.client = client
        self.stores = stores
        self.queues: dict[str, str] = {}
        self.handles: list[WorkflowHandle[Any, Any]] = []

    async def start(self, agent: Agent, rid: str, **start: Any) -> WorkflowHandle[Any, Any]:
        handle = await start_run(
            self.client,
            agent,
            f"go {rid}",
            tenant=T,
            run_id=rid,
            task_queue=self.queues[agent.name],
            options=FAST,
            **start,
        )
        self.handles.append(handle)
        return handle

    async def record(self) -> Any:
        return (await self.stores.idempotency.lookup([KEY], tenant=T)).get(KEY)


@contextlib.asynccontextmanager
async def rig(
    server: DevServer, world: Path, provider: Any, agents: list[Agent]
) -> AsyncIterator[Rig]:
    client = await Client.connect(server.address)
    async with await world_stores(world) as stores:
        r = Rig(client, stores)
        async with contextlib.AsyncExitStack() as stack:
            for agent in agents:
                q = queue()
                r.queues[agent.name] = q
                runner = fast_runner(provider, stores)
                await stack.enter_async_context(worker_running(client, runner, [agent], q))
            try:
                yield r
            finally:
                for handle in r.handles:
                    with contextlib.suppress(Exception):
                        await handle.terminate("attack test over")


async def _result(handle: WorkflowHandle[Any, Any], within: float = 20.0) -> Any:
    try:
        return await asyncio.wait_for(handle.result(), within)
    except (WorkflowFailureError, TimeoutError) as exc:
        return exc


async def _tool_retried_with(handle: WorkflowHandle[Any, Any], within: float = 10.0) -> Any:
    """The failure the run's pending tool activity was last retried on, once it was
    retried at least once (attempt 2 or later)."""
    async with asyncio.timeout(within):
        while True:
            desc = await handle.describe()
            for pa in desc.raw_description.pending_activities:
                if pa.activity_type.name.endswith("tool_call") and pa.attempt >= 2:
                    return pa
            await asyncio.sleep(0.1)


def _failure_type(outcome: Any) -> str:
    cause = getattr(outcome, "cause", None)
    return f"{getattr(cause, 'type', None)}: {getattr(cause, 'message', outcome)}"


# --- 1. a business key two runs share, while the other run is live ------------------------


@pytest.mark.parametrize("first", ["temporal", "kit"])
async def test_a_run_meeting_a_live_runs_claim_comes_back_then_replays_its_outcome(
    temporal_server: DevServer, tmp_path: Path, first: str
) -> None:
    shop = Shop()
    agent = shop.agent()
    model = Told([[("charge", GOOD)], "done"])
    r1, r2 = run_id(), run_id()
    shop.hold = r1
    async with rig(temporal_server, tmp_path, model, [agent]) as world:
        if first == "temporal":
            h1: Any = await world.start(agent, r1)
            one: Any = asyncio.ensure_future(_result(h1))
        else:
            kit = AgentRunner.from_stores(
                model, world.stores, lease_policy=LeasePolicy(ttl=2.0, renew_within=1.0)
            )
            one = asyncio.ensure_future(kit.run(agent, f"go {r1}", tenant=T, run_id=r1))
        await asyncio.wait_for(shop.inside.wait(), 15)
        h2 = await world.start(agent, r2)
        pending = await _tool_retried_with(h2)
        # Come back later (retryable), not refused in doubt, and nothing sent by r2.
        assert pending.last_failure.application_failure_info.type == "ResumeConflictError"
        assert not pending.last_failure.application_failure_info.non_retryable
        assert r1 in pending.last_failure.message
        assert shop.charged == [(r1, "5")]
        shop.gate.set()
        done1 = await asyncio.wait_for(one, 20)
        done2 = await _result(h2)
    assert getattr(done1, "status", None) == "completed", done1
    assert getattr(done2, "status", None) == "completed", done2
    assert shop.charged == [(r1, "5")]  # once, by r1
    assert model.told(r2) == [f"charged 5: 10 by {r1}"]


async def test_a_claim_whose_run_died_with_it_in_hand_ends_the_workflow_in_doubt(
    temporal_server: DevServer, tmp_path: Path
) -> None:
    shop = Shop()
    agent = shop.agent()
    model = Told([[("charge", GOOD)], "done"])
    r1, r2 = run_id(), run_id()
    shop.crash = r1
    async with rig(temporal_server, tmp_path, model, [agent]) as world:
        kit = AgentRunner.from_stores(model, world.stores)
        with pytest.raises(SimulatedCrash):
            await kit.run(agent, f"go {r1}", tenant=T, run_id=r1)
        assert await world.stores.leases.current(T, r1) is None
        outcome = await _result(await world.start(agent, r2))
    assert isinstance(outcome, WorkflowFailureError), outcome
    assert "IndeterminateToolCallError" in _failure_type(outcome)
    assert f"run {r1!r}" in _failure_type(outcome)
    assert shop.charged == [(r1, "5")]


# --- 2. a keyed call that cannot go out: refused arguments, masked arguments ---------------


@pytest.mark.parametrize("args", [BAD, SECRET], ids=["refused", "masked"])
async def test_a_keyed_call_that_cannot_go_out_keeps_nothing_and_a_later_call_goes_once(
    temporal_server: DevServer, tmp_path: Path, args: dict[str, Any]
) -> None:
    shop = Shop()
    agent = shop.agent()
    first = Told([[("charge", args)], "done"])
    later = Told([[("charge", GOOD)], "done"])
    ra, rb = run_id(), run_id()
    async with rig(temporal_server, tmp_path, first, [agent]) as world:
        outcome = await _result(await world.start(agent, ra))
        kept = await world.record()
    assert getattr(outcome, "status", None) == "completed", outcome
    (answer,) = first.told(ra)
    if args is SECRET:
        assert answer == MASKED_ON_TEMPORAL
    else:
        assert answer.startswith("invalid arguments for charge"), answer
    assert kept is None, kept  # looked up, never claimed: nothing under the order's key
    assert shop.charged == []
    async with rig(temporal_server, tmp_path, later, [agent]) as world:
        outcome = await _result(await world.start(agent, rb))
    assert getattr(outcome, "status", None) == "completed", outcome
    assert shop.charged == [(rb, "5")]
    assert later.told(rb) == [f"charged 5: 10 by {rb}"]


async def test_a_refused_call_while_a_live_run_holds_its_key_comes_back_then_replays(
    temporal_server: DevServer, tmp_path: Path
) -> None:
    shop = Shop()
    agent = shop.agent()
    model = Told([[("charge", GOOD)], "done"])
    refused = Told([[("charge", BAD)], "done"])
    r1, r2 = run_id(), run_id()
    shop.hold = r1
    second = shop.agent("shop-2")
    client = await Client.connect(temporal_server.address)
    async with await world_stores(tmp_path) as stores:
        q1, q2 = queue(), queue()
        async with (
            worker_running(client, fast_runner(model, stores), [agent], q1),
            worker_running(client, fast_runner(refused, stores), [second], q2),
        ):
            h1 = await start_run(
                client, agent, f"go {r1}", tenant=T, run_id=r1, task_queue=q1, options=FAST
            )
            await asyncio.wait_for(shop.inside.wait(), 15)
            h2 = await start_run(
                client, second, f"go {r2}", tenant=T, run_id=r2, task_queue=q2, options=FAST
            )
            try:
                pending = await _tool_retried_with(h2)
                assert pending.last_failure.application_failure_info.type == ("ResumeConflictError")
                shop.gate.set()
                done1, done2 = await _result(h1), await _result(h2)
            finally:
                for h in (h1, h2):
                    with contextlib.suppress(Exception):
                        await h.terminate("attack test over")
    assert getattr(done1, "status", None) == "completed", done1
    assert getattr(done2, "status", None) == "completed", done2
    assert shop.charged == [(r1, "5")]
    # As the kit's runner does: a recorded outcome is replayed, whatever the validation.
    assert refused.told(r2) == [f"charged 5: 10 by {r1}"]


async def test_a_call_whose_arguments_hold_a_secret_is_refused_on_temporal_saying_why(
    temporal_server: DevServer, tmp_path: Path
) -> None:
    # (Changed to the design that landed, a limit the README names: on Temporal a call
    # reaches its activity only as the frontier keeps it, secrets masked, so such a call is
    # never sent there; the model is told so, not told to ask again with the real values.)
    shop = Shop()
    agent = shop.agent()
    by_kit = Told([[("charge", SECRET)], "done"])
    on_temporal = Told([[("charge", {**SECRET, "order": "6"})], "done"])
    kit_run, rid = run_id(), run_id()
    async with rig(temporal_server, tmp_path, on_temporal, [agent]) as world:
        kit = await AgentRunner.from_stores(by_kit, world.stores).run(
            agent, f"go {kit_run}", tenant=T, run_id=kit_run
        )
        outcome = await _result(await world.start(agent, rid))
    assert kit.status == "completed"
    assert by_kit.told(kit_run) == [f"charged 5: 10 by {kit_run}"]  # the kit sends it
    assert getattr(outcome, "status", None) == "completed", outcome
    assert on_temporal.told(rid) == [MASKED_ON_TEMPORAL], on_temporal.told(rid)
    assert shop.charged == [(kit_run, "5")]


async def _pending_request(stores: Stores, rid: str, within: float = 15.0) -> str:
    checkpoints = fast_runner(ScriptedProvider([]), stores).checkpoints
    assert checkpoints is not None
    async with asyncio.timeout(within):
        while True:
            cp = await checkpoints.latest(T, rid)
            if cp is not None and cp.pending_approval is not None:
                return cp.pending_approval.id
            await asyncio.sleep(0.05)


async def test_a_denied_call_under_a_key_another_run_completed_is_told_it_was_denied(
    temporal_server: DevServer, tmp_path: Path
) -> None:
    shop = Shop()
    plain = shop.agent()
    guarded = shop.agent("guarded", requires_approval=True)
    model = Told([[("charge", GOOD)], "done"])
    r1, r2 = run_id(), run_id()
    async with rig(temporal_server, tmp_path, model, [guarded]) as world:
        kit = await AgentRunner.from_stores(model, world.stores).run(
            plain, f"go {r1}", tenant=T, run_id=r1
        )
        assert kit.status == "completed"  # order 5 charged, recorded under its key
        h2 = await world.start(guarded, r2, approval_poll=0.2)
        request = await _pending_request(world.stores, r2)
        await world.stores.approvals.decide(T, request, approved=False, by="ops")
        outcome = await _result(h2)
    assert getattr(outcome, "status", None) == "completed", outcome
    assert shop.charged == [(r1, "5")]  # held: nothing sent twice
    # As the kit's runner tells it (checked in the docstring's note): the truth.
    assert model.told(r2) == ["denied by ops"], model.told(r2)


# --- 3. a key function that raises for the model's arguments -------------------------------


async def test_a_key_function_reading_an_argument_the_model_left_out_refuses_that_call(
    temporal_server: DevServer, tmp_path: Path
) -> None:
    shop = Shop()
    agent = shop.agent()
    model = Told([[("charge", {"ordr": "5", "amount": 10})], [("charge", GOOD)], "done"])
    rid = run_id()
    async with rig(temporal_server, tmp_path, model, [agent]) as world:
        outcome = await _result(await world.start(agent, rid))
        kept = await world.record()
    assert getattr(outcome, "status", None) == "completed", outcome
    first = [r for r in model.seen if r.messages[0].text == f"go {rid}"][1]
    told = [m.text for m in first.messages if m.role is Role.tool]
    assert len(told) == 1 and told[0].startswith("not sent:"), told
    assert "invalid arguments for charge" in told[0]
    assert shop.charged == [(rid, "5")]
    assert kept is not None and kept.run_id == rid


async def test_a_key_function_failing_on_arguments_the_tool_accepts_ends_the_workflow(
    temporal_server: DevServer, tmp_path: Path
) -> None:
    charged: list[str] = []

    def broken(**kw: Any) -> str:
        raise KeyError("customer")

    @tool(key=broken)
    def charge(order: str) -> str:
        """Charge an order."""
        charged.append(order)
        return f"charged {order}"

    agent = Agent("shop", "Charge.", [charge])
    model = Told([[("charge", {"order": "5"})], "done"])
    rid = run_id()
    async with rig(temporal_server, tmp_path, model, [agent]) as world:
        handle = await world.start(agent, rid)
        outcome = await _result(handle)
        history = await handle.fetch_history()
    assert isinstance(outcome, WorkflowFailureError), outcome
    said = _failure_type(outcome)
    assert said.startswith(f"{ConfigurationError.__name__}:"), said
    assert "charge" in said and "key function" in said
    assert charged == []
    # Not retried: one model activity scheduled, ended at once (non-retryable).
    scheduled = [
        e for e in history.events if e.HasField("activity_task_scheduled_event_attributes")
    ]
    assert len(scheduled) == 1


async def test_a_run_waiting_on_another_runs_claim_ends_cancelled_when_cancelled(
    temporal_server: DevServer, tmp_path: Path
) -> None:
    shop = Shop()
    agent = shop.agent()
    model = Told([[("charge", GOOD)], "done"])
    r1, r2 = run_id(), run_id()
    shop.hold = r1
    async with rig(temporal_server, tmp_path, model, [agent]) as world:
        h1 = await world.start(agent, r1)
        await asyncio.wait_for(shop.inside.wait(), 15)
        h2 = await world.start(agent, r2)
        await _tool_retried_with(h2)
        # What `tesserix cancel` records when it meets r2's lease held by an attempt (it
        # then leaves the ending to r2's holder, "at its next boundary").
        await request_cancel(
            world.stores.idempotency, T, r2, by="ops", reason=None, redactor=Redactor()
        )
        try:
            outcome = await _result(h2, within=6.0)
        finally:
            shop.gate.set()
            await _result(h1)
    assert shop.charged == [(r1, "5")]
    assert getattr(outcome, "status", None) == "cancelled", outcome
