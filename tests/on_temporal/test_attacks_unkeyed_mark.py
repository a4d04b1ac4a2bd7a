"""An attack on the durable mark an unkeyed side-effecting call carried by Temporal leaves
just before it goes out (commit 1109a69, since moved to ``temporal.marks.UnkeyedMarks``,
``unkeyed_mark_key``, the ``Attempt.send_marks`` that ``run.dispatch._call_tool`` asks).

The workflow's two activities are driven here as a Temporal worker runs them, in this
process, on a SQLite store in ``tmp_path`` (``temporal.steps.model_turn`` writes the
frontier, ``temporal.calls.tool_call`` carries one call; ``retried=False`` with a fresh
holder is what an activity of an execution started by ``temporal workflow reset`` gets),
so that no dev server is needed and the file stays well within its time budget. The reset
itself on a real dev server is covered by ``test_attacks_temporal_fresh.py``.

Attacked: a reset execution carrying an unkeyed call the first one sent, in a parallel
turn of several unkeyed calls (the same tool twice with the same arguments, and two calls
the model gave one id), in process and once on the real dev server (``temporal workflow
reset`` to the task that scheduled the calls); a side-effect-free unkeyed call; calls
refused before they go out (an unknown tool, invalid arguments, a denied approval) and an
approved approval-gated one; a run cancelled before its call went out; a call its lease
check stopped right before it went out, and one whose mark lost its store reply, carried
again by a reset execution; the operator's views of a run holding a mark (``tesserix
runs`` and ``runs --stuck``, ``show --json``, ``inspect``, ``resolve``) and the console's
reads; the kit's own runner (does it set the hook?).

Found, and fixed (``UnkeyedMarks.unsent`` drops the mark of a call its lease check stopped,
through ``release(undispatched=True)``, which now drops a claim with no tool and no ttl of
its holder too; a mark whose reply was lost is read back, sent on when it is this
attempt's, else dropped with the call not sent):

- MEDIUM ``test_an_unkeyed_call_its_lease_check_stopped_is_sent_by_the_next_execution``:
  the mark is written before ``invoke``'s own lease check; when that check stops the call
  (``NotSent``: the lease lapsed or was lost between the mark and the send) nothing went
  out, yet the mark stays in flight for ever (``dispatch._call_tool`` re-raises
  ``stop.error`` without dropping it, where a keyed call's claim goes by
  ``release_unsent``), so a reset execution refuses that never-sent call as in doubt ("an
  earlier execution of its workflow sent it"), and nothing clears it: ``tesserix
  resolve`` ignores records with no tool, and the stores' ``release`` drops a tool-less
  record only if it has a ttl, which a mark has not.
- MEDIUM ``test_an_unkeyed_call_whose_mark_lost_its_reply_is_sent_by_the_next_execution``:
  a mark whose write lost its reply (``StoreReplyLostError``) stops the call before it is
  sent, but ``calls._marked_sent`` neither reads it back (as ``recording.claim`` reads a
  keyed claim back and carries on when it is its own) nor drops it: a reset execution
  refuses the never-sent call as in doubt.

(Both also hold for a plain Temporal retry of the activity, refused by ``calls.tool_call``'s
``if retried and oc.side_effects`` whatever the mark says; that predates the mark.)

Held: a reset execution refuses, as in doubt, every unkeyed call of a parallel turn the
first execution sent, each sent once, the same tool twice with equal arguments and two
calls given one id alike (a mark per place in the turn); on the dev server, a reset past
a turn of two unkeyed calls with one id (which take the run's lease one at a time, so the
first one's lost reply failed the workflow before the second went out) sends nothing
again and leaves no mark for the call that never went out; a side-effect-free unkeyed call
leaves no mark and is carried again; an unknown tool, invalid arguments and a denied
approval leave no mark, and a reset execution answers them as refused again, not in
doubt; an approved approval-gated unkeyed call is marked and refused by a reset
execution; a run cancelled before its call went out leaves no mark; ``tesserix runs``
counts no call in flight and ``runs --stuck`` lists nothing for a completed run holding a
mark, ``show --json`` and ``inspect`` show no mark, the console's reads count none and plan
nothing in doubt, and ``resolve`` of the call id finds no record rather than resolving the
mark; the kit's own runner never sets the hook and leaves no mark (its own resume refuses
any unkeyed side-effecting call at an open frontier, so it needs none).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from operator_cli import cli
from tesserix_adk import (
    Agent,
    AgentRunner,
    LeasePolicy,
    ScriptedProvider,
    Stores,
    open_stores,
    tool,
)
from tesserix_adk.errors import (
    IndeterminateToolCallError,
    LeaseHeldError,
    LeaseLostError,
    ResumeConflictError,
    StoreReplyLostError,
    StoreUnavailableError,
)
from tesserix_adk.providers.base import ModelRequest, ModelResponse
from tesserix_adk.run.attempt import new_holder
from tesserix_adk.stores.protocols import RecordStatus
from tesserix_adk.temporal import calls, steps
from tesserix_adk.temporal.marks import unkeyed_mark_key
from tesserix_adk.temporal.shapes import ModelStep, StepKind, StepResult, ToolInput, ToolResult

T = "acme"
SENT: list[str] = []


@tool(key=None)
def ship(order: str) -> str:
    """Ship an order (a side effect nothing dedupes)."""
    SENT.append(f"ship:{order}")
    return f"shipped {order}"


@tool(key=None, side_effects=False)
def look(order: str) -> str:
    """Look an order up."""
    SENT.append(f"look:{order}")
    return f"order {order} is fine"


@tool(key=None, requires_approval=True)
def refund(order: str) -> str:
    """Refund an order (a person approves it first)."""
    SENT.append(f"refund:{order}")
    return f"refunded {order}"


agent = Agent("marks", "Do what the user asks.", [ship, look, refund])


class OneId:
    """A model that gives every call of its answers one id (some do)."""

    def __init__(self, inner: ScriptedProvider) -> None:
        self.inner = inner

    async def complete(self, request: ModelRequest) -> ModelResponse:
        answer = await self.inner.complete(request)
        same = [dataclasses.replace(c, id="dup") for c in answer.message.tool_calls]
        message = dataclasses.replace(answer.message, tool_calls=same)
        return dataclasses.replace(answer, message=message)


class LosingLeases:
    """The run's lease store, whose renewals fail once ``lose`` is set."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.lose = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def renew(self, lease: Any, ttl: float) -> Any:
        if self.lose:
            raise LeaseLostError("taken (an attack)")
        return await self.inner.renew(lease, ttl)


class MarkThenLoseLease:
    """The idempotency store: right after an unkeyed call's mark is written, the run's
    lease is lost (its renewal refused), before the call goes out."""

    def __init__(self, inner: Any, leases: LosingLeases) -> None:
        self.inner = inner
        self.leases = leases

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def claim(self, key: str, **kw: Any) -> Any:
        rec = await self.inner.claim(key, **kw)
        if key.startswith("unkeyed1:") and not self.leases.lose:
            self.leases.lose = True
            await asyncio.sleep(0.6)  # past a renewal: the lease is lost
        return rec


class MarkReplyLost:
    """The idempotency store: an unkeyed call's mark is written, and its reply lost."""

    def __init__(self, inner: Any, *, unreadable: bool = False) -> None:
        self.inner = inner
        self.lost = 0
        self.unreadable = unreadable

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def claim(self, key: str, **kw: Any) -> Any:
        rec = await self.inner.claim(key, **kw)
        if key.startswith("unkeyed1:") and not self.lost:
            self.lost += 1
            raise StoreReplyLostError("the connection dropped after the write (an attack)")
        return rec

    async def lookup(self, keys: Any, **kw: Any) -> Any:
        if self.unreadable and any(k.startswith("unkeyed1:") for k in keys):
            raise StoreUnavailableError("the store went away (an attack)")
        return await self.inner.lookup(keys, **kw)


@pytest.fixture
async def stores(tmp_path: Path) -> AsyncIterator[Stores]:
    SENT.clear()
    s = open_stores(f"sqlite:///{tmp_path / 'adk.sqlite3'}")
    await s.create_schema()
    try:
        yield s
    finally:
        await s.aclose()


def _url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'adk.sqlite3'}"


def _runner(provider: Any, stores: Stores) -> AgentRunner:
    return AgentRunner.from_stores(
        provider, stores, lease_policy=LeasePolicy(ttl=2.0, renew_within=1.0)
    )


async def _model(runner: AgentRunner, rid: str, iteration: int = 0, **kw: Any) -> StepResult:
    step = ModelStep(
        tenant=T,
        run_id=rid,
        agent_name=agent.name,
        agent_revision=agent.revision,
        iteration=iteration,
        **kw,
    )
    return await steps.model_turn(runner, agent, step, new_holder("temporal-model_turn-1"))


async def _call(
    runner: AgentRunner, rid: str, turn: StepResult, i: int, *, retried: bool = False
) -> ToolResult:
    ref = turn.calls[i]
    call = ToolInput(
        tenant=T,
        run_id=rid,
        agent_name=agent.name,
        agent_revision=agent.revision,
        iteration=turn.iteration,
        call_id=ref.call_id,
        position=ref.position,
    )
    return await calls.tool_call(
        runner, agent, call, new_holder("temporal-tool_call-1"), retried=retried
    )


async def _marks(stores: Stores, rid: str) -> list[Any]:
    return [r for r in await stores.idempotency.records(T, rid) if r.key.startswith("unkeyed1:")]


# --- what a reset execution does with calls the first one sent ----------------------------


@pytest.mark.parametrize("one_id", [False, True], ids=["own-ids", "one-id"])
async def test_a_reset_execution_refuses_every_unkeyed_call_of_a_parallel_turn(
    stores: Stores, one_id: bool
) -> None:
    rid = f"r-par-{one_id}"
    script = ScriptedProvider([[("ship", {"order": "o-1"})] * 2 + [("ship", {"order": "o-2"})]])
    runner = _runner(OneId(script) if one_id else script, stores)
    turn = await _model(runner, rid, input="Ship o-1 twice and o-2")
    assert [c.position for c in turn.calls] == [0, 1, 2]
    first = [await _call(runner, rid, turn, i) for i in range(3)]
    assert [r.is_error for r in first] == [False, False, False]
    assert SENT == ["ship:o-1", "ship:o-1", "ship:o-2"]
    marks = await _marks(stores, rid)
    assert len(marks) == 3  # one a place in the turn, ids alike or not
    ids = [c.call_id for c in turn.calls]
    assert {m.key for m in marks} == {
        unkeyed_mark_key(T, rid, turn.iteration, i, ids[i]) for i in range(3)
    }
    # The reset execution: each activity a first attempt again, with a holder of its own.
    for i in range(3):
        with pytest.raises(IndeterminateToolCallError, match="earlier execution"):
            await _call(runner, rid, turn, i)
    assert SENT == ["ship:o-1", "ship:o-1", "ship:o-2"]


async def test_a_side_effect_free_unkeyed_call_leaves_no_mark_and_is_carried_again(
    stores: Stores,
) -> None:
    rid = "r-look"
    runner = _runner(ScriptedProvider([[("look", {"order": "o-1"})]]), stores)
    turn = await _model(runner, rid, input="Look o-1 up")
    assert not (await _call(runner, rid, turn, 0)).is_error
    assert await _marks(stores, rid) == []
    assert not (await _call(runner, rid, turn, 0)).is_error  # a reset execution: sent again
    assert SENT == ["look:o-1", "look:o-1"]


# --- calls refused before they go out ---------------------------------------------------


async def test_refused_calls_leave_no_mark_and_a_reset_refuses_them_again_not_in_doubt(
    stores: Stores,
) -> None:
    rid = "r-refused"
    turns = [[("nope", {"order": "o-1"}), ("ship", {"order": 5, "extra": True})]]
    runner = _runner(ScriptedProvider(turns), stores)
    turn = await _model(runner, rid, input="Do odd things")
    for _execution in range(2):
        for i in range(2):
            result = await _call(runner, rid, turn, i)
            assert result.is_error, result
    assert SENT == []
    assert await _marks(stores, rid) == []


async def _approval_turn(stores: Stores, rid: str, approved: bool) -> tuple[AgentRunner, Any]:
    runner = _runner(ScriptedProvider([[("refund", {"order": "o-9"})]]), stores)
    waiting = await _model(runner, rid, input="Refund o-9")
    assert waiting.kind is StepKind.waiting and waiting.approval is not None, waiting
    await stores.approvals.decide(T, waiting.approval, approved=approved, by="ops")
    turn = await _model(runner, rid)
    assert turn.kind is StepKind.calls, turn
    return runner, turn


async def test_a_denied_approval_leaves_no_mark_and_a_reset_denies_it_again(
    stores: Stores,
) -> None:
    rid = "r-denied"
    runner, turn = await _approval_turn(stores, rid, approved=False)
    for _execution in range(2):
        result = await _call(runner, rid, turn, 0)
        assert result.is_error, result
    assert SENT == []
    assert await _marks(stores, rid) == []


async def test_an_approved_unkeyed_call_is_marked_and_never_sent_again_by_a_reset(
    stores: Stores,
) -> None:
    rid = "r-approved"
    runner, turn = await _approval_turn(stores, rid, approved=True)
    assert not (await _call(runner, rid, turn, 0)).is_error
    assert len(await _marks(stores, rid)) == 1
    with pytest.raises(IndeterminateToolCallError):
        await _call(runner, rid, turn, 0)
    assert SENT == ["refund:o-9"]


async def test_a_run_cancelled_before_its_unkeyed_call_went_out_leaves_no_mark(
    stores: Stores,
) -> None:
    rid = "r-cancel"
    runner = _runner(ScriptedProvider([[("ship", {"order": "o-1"})]]), stores)
    turn = await _model(runner, rid, input="Ship o-1")
    await runner.cancel(rid, tenant=T, by="ops", reason="changed my mind")
    for _execution in range(2):
        result = await _call(runner, rid, turn, 0)
        assert result.is_error and "not sent" in str(result.content), result
    assert SENT == []
    assert await _marks(stores, rid) == []


async def _carried(runner: AgentRunner, rid: str, turn: StepResult) -> ToolResult:
    """The call carried by the next execution's activity, retried (as Temporal retries
    it) while the stopped attempt's lease lapses by the store's clock."""
    for _ in range(40):
        try:
            return await _call(runner, rid, turn, 0)
        except (LeaseHeldError, ResumeConflictError):
            await asyncio.sleep(0.1)
    raise AssertionError("the stopped attempt's lease never lapsed")


# --- a call its lease check stopped right before it went out -------------------------------


async def test_an_unkeyed_call_its_lease_check_stopped_is_sent_by_the_next_execution(
    stores: Stores,
) -> None:
    rid = "r-notsent"
    leases = LosingLeases(stores.leases)
    attacked = dataclasses.replace(
        stores, leases=leases, idempotency=MarkThenLoseLease(stores.idempotency, leases)
    )
    runner = AgentRunner.from_stores(
        ScriptedProvider([[("ship", {"order": "o-1"})]]),
        attacked,
        lease_policy=LeasePolicy(ttl=1.0, renew_within=0.8),
    )
    turn = await _model(runner, rid, input="Ship o-1")
    with pytest.raises(LeaseLostError):
        await _call(runner, rid, turn, 0)
    assert SENT == []  # certainly never went out
    leases.lose = False
    # The next execution (a reset: attempt 1 again) carries the call: it was never sent.
    again = await _carried(_runner(ScriptedProvider([]), stores), rid, turn)
    assert not again.is_error, again
    assert SENT == ["ship:o-1"]


async def test_an_unkeyed_call_whose_mark_lost_its_reply_is_sent_by_the_next_execution(
    stores: Stores,
) -> None:
    """The mark's write lost its reply and cannot be read back: the call is not sent, the
    mark (written after all) is dropped, and the next execution sends it once."""
    rid = "r-replylost"
    lossy = MarkReplyLost(stores.idempotency, unreadable=True)
    attacked = dataclasses.replace(stores, idempotency=lossy)
    runner = _runner(ScriptedProvider([[("ship", {"order": "o-1"})]]), attacked)
    turn = await _model(runner, rid, input="Ship o-1")
    with pytest.raises(StoreUnavailableError):
        await _call(runner, rid, turn, 0)
    assert SENT == []  # the mark raised before the tool was invoked
    assert await _marks(stores, rid) == []
    again = await _carried(_runner(ScriptedProvider([]), stores), rid, turn)
    assert not again.is_error, again
    assert SENT == ["ship:o-1"]


async def test_a_mark_whose_reply_was_lost_and_is_read_back_as_ours_sends_the_call_once(
    stores: Stores,
) -> None:
    """Read back as this attempt's, the mark stands: the call goes out, and a reset
    execution refuses it as in doubt, never sends it again."""
    rid = "r-replylost-read"
    attacked = dataclasses.replace(stores, idempotency=MarkReplyLost(stores.idempotency))
    runner = _runner(ScriptedProvider([[("ship", {"order": "o-1"})]]), attacked)
    turn = await _model(runner, rid, input="Ship o-1")
    first = await _call(runner, rid, turn, 0)
    assert not first.is_error, first
    assert SENT == ["ship:o-1"]
    with pytest.raises(IndeterminateToolCallError):
        await _carried(_runner(ScriptedProvider([]), stores), rid, turn)
    assert SENT == ["ship:o-1"]


# --- what an operator sees of a run holding marks ---------------------------------------


async def test_operator_views_neither_count_nor_offer_a_mark(
    stores: Stores, tmp_path: Path
) -> None:
    from tesserix_adk.console import reads

    rid = "r-views"
    runner = _runner(ScriptedProvider([[("ship", {"order": "o-1"})], "Shipped."]), stores)
    turn = await _model(runner, rid, input="Ship o-1")
    result = await _call(runner, rid, turn, 0)
    done = await _model(runner, rid, iteration=1, results=[result])
    assert done.kind is StepKind.finished and done.status == "completed", done
    (mark,) = await _marks(stores, rid)
    assert mark.status is RecordStatus.in_flight and mark.tool is None
    url = _url(tmp_path)

    code, out, err = cli("runs", "--tenant", T, "--store", url, "--json")
    assert code == 0, err
    (row,) = [r for r in json.loads(out)["runs"] if r["run_id"] == rid]
    assert row["in_flight"] == 0, row
    code, out, err = cli("runs", "--tenant", T, "--store", url, "--stuck", "--json")
    assert code == 0, err
    assert json.loads(out)["runs"] == []

    code, out, err = cli("show", rid, "--tenant", T, "--store", url, "--json")
    assert code == 0, err
    assert "unkeyed1:" not in out and mark.key not in out

    code, out, err = cli("inspect", rid, "--tenant", T, "--store", url)
    assert code == 0, err
    assert "unkeyed1:" not in out and "in doubt" not in out.lower(), out

    # The call id names no call on record: the mark is never what an operator resolves.
    code, out, err = cli(
        "resolve", rid, turn.calls[0].call_id, "--tenant", T, "--store", url,
        "--never-ran", "--by", "ops",
    )  # fmt: skip
    assert code != 0
    (still,) = await _marks(stores, rid)
    assert still.status is RecordStatus.in_flight

    listed = await reads.runs(stores, T, reads.RunFilter())
    (summary,) = [r for r in listed if r.run_id == rid]
    assert (summary.in_flight, summary.in_doubt) == (0, 0), summary
    assert [r for r in await reads.runs(stores, T, reads.RunFilter(stuck=True))] == []
    detail = await reads.run_detail(stores, T, rid)
    assert detail is not None
    assert all(r.tool is not None for r in detail.records)
    assert detail.plan.indeterminate == ()


# --- the kit's own runner -------------------------------------------------------------------


async def test_the_kits_own_runner_sets_no_hook_and_leaves_no_mark(stores: Stores) -> None:
    rid = "r-kit"
    runner = _runner(ScriptedProvider([[("ship", {"order": "o-1"})], "Shipped."]), stores)
    run = await runner.run(agent, "Ship o-1", tenant=T, run_id=rid)
    assert run.status.value == "completed", run
    assert SENT == ["ship:o-1"]
    assert await _marks(stores, rid) == []


# --- on the real dev server: a reset past a parallel turn of unkeyed calls -----------------


def _ship_slowly(order: str) -> str:
    import time

    from on_temporal import airline

    with (airline.world() / "shipped.txt").open("a") as f:
        f.write(order + "\n")
    time.sleep(1.6)  # longer than the tool activity's timeout: the reply is lost
    return f"shipped {order}"


@tool(key=None)
def ship_slow(order: str) -> str:
    """Ship an order (a side effect nothing dedupes)."""
    return _ship_slowly(order)


slow_agent = Agent("marks-slow", "Ship what the user asks.", [ship_slow], parallel_tool_calls=2)


async def test_a_temporal_reset_past_a_turn_of_two_calls_with_one_id_sends_nothing_again(
    temporal_server: Any, tmp_path: Path
) -> None:
    from temporalio.client import Client, WorkflowFailureError

    from on_temporal import airline
    from on_temporal.helpers import (
        FAST,
        fast_runner,
        in_world,
        queue,
        run_id,
        worker_running,
        world_stores,
    )
    from tesserix_adk.temporal import RunOutcome, start_run

    async def outcome(client: Client, rid: str) -> Any:
        handle = client.get_workflow_handle(rid, result_type=RunOutcome)
        try:
            return await asyncio.wait_for(handle.result(), 20)
        except (WorkflowFailureError, TimeoutError) as exc:
            return exc

    rid = run_id()
    turns: list[Any] = [[("ship_slow", {"order": "o-1"})] * 2, "Shipped."]
    options = dataclasses.replace(FAST, tool_timeout=0.8)
    shipped = tmp_path / "shipped.txt"
    with in_world(tmp_path):
        client = await Client.connect(temporal_server.address)
        async with await world_stores(tmp_path) as s:
            q = queue()
            runner = fast_runner(OneId(ScriptedProvider(turns)), s)
            async with worker_running(client, runner, [slow_agent], q):
                await start_run(
                    client, slow_agent, "Ship o-1 twice", tenant=airline.TENANT, run_id=rid,
                    task_queue=q, options=options,
                )  # fmt: skip
                first = await outcome(client, rid)
                assert isinstance(first, WorkflowFailureError), first
                # The turn's calls take the run's lease one at a time: the first one's lost
                # reply fails the workflow before the second goes out.
                assert shipped.read_text().split() == ["o-1"]
                history = await client.get_workflow_handle(rid).fetch_history()
                scheduled = next(
                    e.activity_task_scheduled_event_attributes.workflow_task_completed_event_id
                    for e in history.events
                    if e.HasField("activity_task_scheduled_event_attributes")
                    and e.activity_task_scheduled_event_attributes.activity_type.name
                    == "tesserix.tool_call"
                )
                done = await asyncio.create_subprocess_exec(
                    temporal_server.binary, "workflow", "reset", "--address",
                    temporal_server.address, "-w", rid, f"--event-id={scheduled}",
                    "--reason", "attack", "-y",
                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                )  # fmt: skip
                out, err = await done.communicate()
                assert done.returncode == 0, (out + err).decode()
                again = await outcome(client, rid)
                await asyncio.sleep(0.3)
            records = await s.idempotency.records(airline.TENANT, rid)
    marks = [r for r in records if r.key.startswith("unkeyed1:")]
    assert shipped.read_text().split() == ["o-1"], again
    assert isinstance(again, WorkflowFailureError), again
    assert "IndeterminateToolCallError" in repr(again.cause), again.cause
    assert "earlier execution" in repr(again.cause), again.cause
    assert len(marks) == 1  # the call that never went out left none
