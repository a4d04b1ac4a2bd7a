"""A turn's calls side by side (``Agent(parallel_tool_calls=N)``), in one process.

At most N at a time, each behind its own claim; results to the model in the model's order
whatever order they finish in; approvals still gate; twins keep their keys; one call's
failure starts no more calls and cancels none already sent; each call reports its start and
its finish (with how its result came to be). The oracle is ``test_parallel_oracle.py``;
process deaths mid-turn are ``tests/test_parallel_crash.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import Counter
from typing import Any

import pytest

from run.helpers import Recording
from tesserix_adk import (
    Agent,
    AgentRunner,
    Checkpointer,
    ConfigurationError,
    IndeterminateToolCallError,
    LeaseLostError,
    LeasePolicy,
    MemoryApprovalStore,
    MemoryCheckpointStore,
    MemoryIdempotencyStore,
    MemoryLeaseStore,
    Redactor,
    RunStatus,
    ScriptedProvider,
    StoreUnavailableError,
    ToolContext,
    tool,
)
from tesserix_adk.checkpoint.payload import encode_outcome
from tesserix_adk.messages import Role, ToolCall, ToolOutcome
from tesserix_adk.run.attempt import Attempt
from tesserix_adk.run.dispatch import dispatch_turn
from tesserix_adk.run.events import CallDisposition, RunEvent, ToolCallFinished, ToolCallStarted
from tesserix_adk.run.loop import outstanding_calls
from tesserix_adk.run.parallel import in_model_order
from tesserix_adk.run.parts import RunParts
from tesserix_adk.run.state import RunState
from tesserix_adk.stores.protocols import RecordStatus
from tesserix_adk.testing.faults import FaultyIdempotencyStore

T = "acme"
FOUR = [("step", {"n": n}) for n in range(4)]


def _runner(provider: Any, idem: Any, cps: MemoryCheckpointStore, **kw: Any) -> AgentRunner:
    return AgentRunner(
        provider,
        idempotency=idem,
        checkpoints=Checkpointer(cps),
        leases=kw.pop("leases", MemoryLeaseStore()),
        **kw,
    )


def _result_ids(provider: Recording) -> list[str | None]:
    """The tool results of the last request, as the model reads them."""
    return [m.tool_call_id for m in provider.requests[-1].messages if m.role is Role.tool]


def _asked_ids(provider: Recording) -> list[str]:
    return [c.id for m in provider.requests[-1].messages for c in m.tool_calls]


# --- the option -------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "2"])
def test_parallel_tool_calls_below_one_or_not_a_whole_number_is_refused(bad: Any) -> None:
    with pytest.raises(ConfigurationError, match="parallel_tool_calls"):
        Agent("a", "i", parallel_tool_calls=bad)


def test_parallel_tool_calls_defaults_to_one_and_is_not_part_of_the_revision() -> None:
    @tool
    def step(n: int) -> int:
        """A step."""
        return n

    sequential = Agent("a", "i", [step])
    assert sequential.parallel_tool_calls == 1
    assert Agent("a", "i", [step], parallel_tool_calls=4).revision == sequential.revision


# --- how many at once -------------------------------------------------------------------


def _gated_agent(limit: int | None, width: int) -> tuple[Agent, dict[str, int]]:
    """Async calls that each wait (up to 2 s) until ``width`` of them run at once."""
    seen = {"active": 0, "peak": 0}
    together = asyncio.Event()

    @tool
    async def step(n: int) -> int:
        """A step that waits for company."""
        seen["active"] += 1
        seen["peak"] = max(seen["peak"], seen["active"])
        if seen["active"] >= width:
            together.set()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(together.wait(), 2.0)
        seen["active"] -= 1
        return n

    if limit is None:
        return Agent("par", "Do steps.", [step]), seen
    return Agent("par", "Do steps.", [step], parallel_tool_calls=limit), seen


async def test_by_default_a_turns_calls_run_one_at_a_time() -> None:
    agent, seen = _gated_agent(None, 2)
    provider = ScriptedProvider([[("step", {"n": 0}), ("step", {"n": 1})], "done"])
    run = await _runner(provider, MemoryIdempotencyStore(), MemoryCheckpointStore()).run(
        agent, "go", tenant=T, run_id="seq"
    )
    assert run.status is RunStatus.completed
    assert seen["peak"] == 1


async def test_at_most_n_calls_run_at_once() -> None:
    agent, seen = _gated_agent(2, 2)
    provider = ScriptedProvider([[("step", {"n": n}) for n in range(5)], "done"])
    run = await _runner(provider, MemoryIdempotencyStore(), MemoryCheckpointStore()).run(
        agent, "go", tenant=T, run_id="two"
    )
    assert run.status is RunStatus.completed
    assert seen["peak"] == 2


async def test_sync_tools_run_side_by_side_in_worker_threads() -> None:
    barrier = threading.Barrier(3, timeout=5)
    loop_thread = threading.get_ident()
    threads: set[int] = set()

    @tool
    def step(n: int) -> int:
        """A blocking step: it returns only once three run at once."""
        threads.add(threading.get_ident())
        barrier.wait()  # BrokenBarrierError (an error result) unless three are in threads
        return n

    agent = Agent("sync", "Do steps.", [step], parallel_tool_calls=3)
    provider = Recording(ScriptedProvider([[("step", {"n": n}) for n in range(3)], "done"]))
    run = await _runner(provider, MemoryIdempotencyStore(), MemoryCheckpointStore()).run(
        agent, "go", tenant=T, run_id="sync"
    )
    assert run.status is RunStatus.completed
    results = [m for m in provider.requests[-1].messages if m.role is Role.tool]
    assert [m.is_error for m in results] == [False] * 3
    assert len(threads) == 3 and loop_thread not in threads


# --- order, claims, twins -----------------------------------------------------------------


async def test_results_reach_the_model_in_its_order_whatever_order_the_calls_finish() -> None:
    finished: list[int] = []
    done = {n: asyncio.Event() for n in range(5)}
    done[4].set()

    @tool
    async def step(n: int) -> int:
        """Finishes only after the call asked after it."""
        await asyncio.wait_for(done[n + 1].wait(), 5)
        finished.append(n)
        done[n].set()
        return n

    agent = Agent("rev", "Do steps.", [step], parallel_tool_calls=4)
    provider = Recording(ScriptedProvider([FOUR, "done"]))
    run = await _runner(provider, MemoryIdempotencyStore(), MemoryCheckpointStore()).run(
        agent, "go", tenant=T, run_id="rev"
    )
    assert run.status is RunStatus.completed
    assert finished == [3, 2, 1, 0]
    assert _result_ids(provider) == _asked_ids(provider)
    results = [m for m in provider.requests[-1].messages if m.role is Role.tool]
    assert [m.content for m in results] == ["0", "1", "2", "3"]


async def test_each_call_is_claimed_before_it_is_sent_and_twins_keep_their_keys() -> None:
    idem = MemoryIdempotencyStore()
    sent: list[tuple[str | None, RecordStatus | None]] = []

    @tool
    async def book(flight: str, ctx: ToolContext) -> str:
        """Books a seat."""
        assert ctx.idempotency_key is not None
        rec = (await idem.lookup([ctx.idempotency_key], tenant=T)).get(ctx.idempotency_key)
        sent.append((ctx.idempotency_key, None if rec is None else rec.status))
        await asyncio.sleep(0.01)
        return flight

    agent = Agent("twins", "Book.", [book], parallel_tool_calls=4)
    turn = [("book", {"flight": "LH1"}), ("book", {"flight": "LH1"}), ("book", {"flight": "UA2"})]
    run = await _runner(ScriptedProvider([turn, "done"]), idem, MemoryCheckpointStore()).run(
        agent, "go", tenant=T, run_id="twins"
    )
    assert run.status is RunStatus.completed
    assert len(sent) == 3
    assert all(status is RecordStatus.in_flight for _, status in sent)
    assert len({key for key, _ in sent}) == 3  # the twins are two calls, two keys
    records = await idem.records(T, "twins")
    assert sorted(r.status for r in records if r.tool == "book") == [RecordStatus.completed] * 3


@pytest.mark.parametrize("approved", [True, False], ids=["approved", "denied"])
async def test_approvals_still_gate_calls_that_run_side_by_side(approved: bool) -> None:
    booked: list[str] = []

    @tool(requires_approval=True)
    async def book(flight: str) -> str:
        """Books a seat, once a person agrees."""
        booked.append(flight)
        return flight

    @tool(side_effects=False)
    async def look(flight: str) -> str:
        """Looks a flight up."""
        return f"seen {flight}"

    agent = Agent("gate", "Book.", [book, look], parallel_tool_calls=3)
    turn = [("book", {"flight": "LH1"}), ("look", {"flight": "LH1"}), ("book", {"flight": "UA2"})]
    idem, cps, approvals = MemoryIdempotencyStore(), MemoryCheckpointStore(), MemoryApprovalStore()
    provider = Recording(ScriptedProvider([turn, "done"]))
    waiting = await _runner(provider, idem, cps, approvals=approvals).run(
        agent, "go", tenant=T, run_id="gate"
    )
    assert waiting.status is RunStatus.waiting_approval and booked == []
    assert waiting.pending_approval is not None
    assert [c.id for c in waiting.pending_approval.calls] == ["call_0_0", "call_0_2"]
    await approvals.decide(T, waiting.pending_approval.id, approved=approved, by="ops")
    run = await _runner(provider, idem, cps, approvals=approvals).resume(agent, "gate", tenant=T)
    assert run.status is RunStatus.completed
    results = [m for m in provider.requests[-1].messages if m.role is Role.tool]
    assert [m.tool_call_id for m in results] == ["call_0_0", "call_0_1", "call_0_2"]
    assert results[1].content == "seen LH1" and not results[1].is_error
    if approved:
        assert sorted(booked) == ["LH1", "UA2"]
        assert [m.content for m in results] == ["LH1", "seen LH1", "UA2"]
    else:
        assert booked == []
        assert [m.is_error for m in results] == [True, False, True]
        assert all("denied by ops" in str(results[i].content) for i in (0, 2))


# --- one call fails -----------------------------------------------------------------------


async def test_a_failed_claim_cancels_no_started_sibling_and_starts_no_more_calls() -> None:
    """Call 1's claim never reaches the store while call 0 is sent: call 0 finishes and its
    outcome is recorded, calls 2 and 3 are never claimed, the run stops with the error;
    the resume replays call 0 and sends 1, 2 and 3 once each."""
    effects: Counter[str] = Counter()
    inner = MemoryIdempotencyStore()
    claims: list[str] = []

    def fault(phase: str, op: str, key: str) -> None:
        if phase == "before" and op == "claim":
            claims.append(key)
            if len(claims) == 2 and faulty.fail_claims == 0 and not resumed:
                faulty.fail_claims = 1

    faulty = FaultyIdempotencyStore(inner, hook=fault)
    resumed = False

    @tool
    async def step(n: int, ctx: ToolContext) -> int:
        """A step with an effect."""
        assert ctx.idempotency_key is not None
        if n == 0 and not resumed:
            await asyncio.sleep(0.05)  # still running while its sibling's claim fails
        effects[ctx.idempotency_key] += 1
        return n

    agent = Agent("fail", "Do steps.", [step], parallel_tool_calls=2)
    cps = MemoryCheckpointStore()
    leases = MemoryLeaseStore()
    with pytest.raises(StoreUnavailableError):
        await _runner(ScriptedProvider([FOUR, "done"]), faulty, cps, leases=leases).run(
            agent, "go", tenant=T, run_id="fail"
        )
    records = {r.call_id: r for r in await inner.records(T, "fail") if r.tool == "step"}
    assert set(records) == {"call_0_0"}
    assert records["call_0_0"].status is RecordStatus.completed
    assert sum(effects.values()) == 1

    resumed = True
    provider = Recording(ScriptedProvider([FOUR, "done"]))
    run = await _runner(provider, faulty, cps, leases=leases).resume(agent, "fail", tenant=T)
    assert run.status is RunStatus.completed
    assert sorted(effects.values()) == [1, 1, 1, 1]
    assert _result_ids(provider) == _asked_ids(provider)


async def test_a_lease_lost_mid_turn_lets_sent_calls_finish_and_sends_no_more() -> None:
    """Call 1 freezes the event loop past the lease ttl while call 0 is out: call 0 still
    finishes and is recorded, calls 2 and 3 are never claimed (the lease guard refuses them
    before their claim), the run stops with ``LeaseLostError``; the resume replays 0 and 1
    and sends 2 and 3 once."""
    effects: Counter[str] = Counter()
    resumed = False

    @tool
    async def slow(n: int, ctx: ToolContext) -> int:
        """Out for a while."""
        assert ctx.idempotency_key is not None
        if not resumed:
            await asyncio.sleep(0.6)
        effects[ctx.idempotency_key] += 1
        return n

    @tool(inline=True)
    def freeze(n: int, ctx: ToolContext) -> int:
        """Blocks the event loop past the lease ttl: no renewal can happen meanwhile."""
        assert ctx.idempotency_key is not None
        if not resumed:
            time.sleep(0.4)
        effects[ctx.idempotency_key] += 1
        return n

    agent = Agent("lease", "Do steps.", [slow, freeze], parallel_tool_calls=2)
    turn = [("slow", {"n": 0}), ("freeze", {"n": 1}), ("slow", {"n": 2}), ("slow", {"n": 3})]
    idem, cps, leases = MemoryIdempotencyStore(), MemoryCheckpointStore(), MemoryLeaseStore()
    policy = LeasePolicy(ttl=0.3, renew_within=0.1)
    with pytest.raises(LeaseLostError):
        await _runner(
            ScriptedProvider([turn, "done"]), idem, cps, leases=leases, lease_policy=policy
        ).run(agent, "go", tenant=T, run_id="lease")
    records = {r.call_id: r.status for r in await idem.records(T, "lease") if r.tool}
    assert records == {"call_0_0": RecordStatus.completed, "call_0_1": RecordStatus.completed}
    assert sorted(effects.values()) == [1, 1]

    resumed = True
    provider = Recording(ScriptedProvider([turn, "done"]))
    run = await _runner(provider, idem, cps, leases=leases).resume(agent, "lease", tenant=T)
    assert run.status is RunStatus.completed
    assert sorted(effects.values()) == [1, 1, 1, 1]
    assert _result_ids(provider) == _asked_ids(provider)


async def test_calls_found_in_doubt_side_by_side_are_named_in_one_refusal() -> None:
    """Two calls claimed in flight by a dead holder, met by a live turn (a retry of run()
    on the same stores): one refusal names both."""
    idem = MemoryIdempotencyStore()

    @tool
    async def step(n: int) -> int:
        """A step with an effect."""
        return n

    agent = Agent("doubt", "Do steps.", [step], parallel_tool_calls=4)
    run = RunState(agent=agent, tenant=T, run_id="doubt", messages=[])
    calls = outstanding_calls(
        run, [ToolCall(id=f"c{n}", name="step", arguments={"n": n}) for n in range(3)]
    )
    for oc in calls[:2]:
        assert oc.key is not None
        await idem.claim(
            oc.key,
            holder="dead",
            tenant=T,
            run_id="doubt",
            iteration=0,
            tool="step",
            call_id=oc.call.id,
            flags=None,
        )
    parts = _parts(idem)
    with pytest.raises(IndeterminateToolCallError) as refused:
        await dispatch_turn(parts, run, Attempt(holder="me"), calls)
    assert sorted(str(c.call_id) for c in refused.value.calls) == ["c0", "c1"]


async def test_cancelling_the_turn_reaches_every_started_call_and_waits_for_each() -> None:
    stopped: list[int] = []

    async def job(n: int) -> int:
        try:
            await asyncio.sleep(10)
        finally:
            await asyncio.sleep(0.01)  # cleanup that must finish before the turn lets go
            stopped.append(n)
        return n

    jobs = [lambda n=n: job(n) for n in range(4)]
    turn = asyncio.ensure_future(in_model_order(jobs, 3))
    await asyncio.sleep(0.05)
    turn.cancel()
    with pytest.raises(asyncio.CancelledError):
        await turn
    assert sorted(stopped) == [0, 1, 2]


# --- events -------------------------------------------------------------------------------


def _parts(idem: Any) -> RunParts:
    return RunParts(
        provider=ScriptedProvider(["unused"]),
        idempotency=idem,
        checkpoints=None,
        ledger=None,
        approvals=None,
        redactor=Redactor(),
    )


async def test_each_call_reports_its_start_and_its_finish_with_how_its_result_came() -> None:
    idem = MemoryIdempotencyStore()
    claimed_at_start: dict[str, RecordStatus | None] = {}

    @tool
    async def step(n: int) -> int:
        """A step with an effect."""
        await asyncio.sleep(0.01 * (4 - n))
        return n

    agent = Agent("ev", "Do steps.", [step], parallel_tool_calls=4)
    run = RunState(agent=agent, tenant=T, run_id="ev", messages=[])
    asked = [ToolCall(id=f"c{n}", name="step", arguments={"n": n}) for n in range(4)]
    asked.append(ToolCall(id="c4", name="nope", arguments={}))
    calls = outstanding_calls(run, asked)
    # c0 was recorded by an earlier attempt; c1 settled by an operator; c2, c3 are new.
    for oc, by in ((calls[0], None), (calls[1], "ops")):
        assert oc.key is not None
        await idem.claim(
            oc.key,
            holder="before",
            tenant=T,
            run_id="ev",
            iteration=0,
            tool="step",
            call_id=oc.call.id,
            flags=None,
        )
        done = encode_outcome(ToolOutcome(call_id=oc.call.id, content="earlier"), Redactor())
        if by is None:
            await idem.complete(oc.key, done, tenant=T, holder="before")
        else:
            await idem.resolve(oc.key, done, tenant=T, by=by)
    events: list[RunEvent] = []
    keys = {oc.call.id: oc.key for oc in calls}

    def sink(event: RunEvent) -> None:
        events.append(event)
        if isinstance(event, ToolCallStarted):
            key = keys[event.call_id]
            assert key is not None
            # The sink is called synchronously: read the memory store's table directly.
            rec = idem._records.get((T, key))
            claimed_at_start[event.call_id] = None if rec is None else rec.status

    await dispatch_turn(_parts(idem), run, Attempt(holder="me", events=sink), calls)
    started = [e.call_id for e in events if isinstance(e, ToolCallStarted)]
    finished = {e.call_id: e for e in events if isinstance(e, ToolCallFinished)}
    assert sorted(started) == ["c0", "c1", "c2", "c3"]
    assert {c: e.disposition for c, e in finished.items()} == {
        "c0": CallDisposition.replayed,
        "c1": CallDisposition.settled,
        "c2": CallDisposition.dispatched,
        "c3": CallDisposition.dispatched,
        "c4": CallDisposition.refused,
    }
    assert finished["c4"].is_error and not finished["c2"].is_error
    for call_id in started:  # each start comes before its own finish
        start = next(
            i
            for i, e in enumerate(events)
            if isinstance(e, ToolCallStarted) and e.call_id == call_id
        )
        assert start < events.index(finished[call_id])
    # A call is reported started once its claim is durable, never before.
    assert claimed_at_start["c2"] is RecordStatus.in_flight
    assert claimed_at_start["c3"] is RecordStatus.in_flight
    assert [m.tool_call_id for m in run.messages] == ["c0", "c1", "c2", "c3", "c4"]
