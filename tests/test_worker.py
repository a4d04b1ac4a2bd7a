"""The worker in one process, on memory stores: it starts submitted runs, carries on runs
whose holder died, settles calls in doubt with reconcilers, parks what must not go on,
backs off from passing failures, picks up decided approvals and drains at a boundary.
The same promises across real processes and every backend are in tests/test_worker_chaos.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import io
import time
from collections.abc import Callable
from typing import Any

import pytest

from booking import BOOK_TURNS, Airline
from tesserix_adk import (
    Agent,
    AgentRunner,
    Carried,
    Checkpointer,
    LeasePolicy,
    ProviderError,
    Reconciled,
    RunStatus,
    ScriptedProvider,
    Worker,
    WorkState,
    open_stores,
    tool,
)
from tesserix_adk.checkpoint.payload import Carrier, CheckpointStatus, encode_checkpoint
from tesserix_adk.checkpoint.redaction import Redactor
from tesserix_adk.cli import frontier_main
from tesserix_adk.cli.failures import exit_code_for
from tesserix_adk.errors import CarriedByWorkflowError, RunStartedError
from tesserix_adk.run.attempt import run_claim_key
from tesserix_adk.run.cancelling import cancel_requested
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.stores.memory import MemoryWorkIndex
from tesserix_adk.stores.protocols import RecordStatus
from tesserix_adk.testing.faults import SimulatedCrash

T = "acme"
MARGIN = 0.05


def _stores() -> Stores:
    stores = open_stores("memory://")
    stores.work = MemoryWorkIndex(stores.leases)
    return stores


def _runner(stores: Stores, turns: list[Any] | None = None, **kwargs: Any) -> AgentRunner:
    return AgentRunner.from_stores(
        ScriptedProvider(list(turns or BOOK_TURNS)),
        stores,
        lease_policy=LeasePolicy(ttl=2.0, renew_within=1.0),
        never_ran_margin=MARGIN,
        **kwargs,
    )


def _agent(
    airline: Airline,
    *,
    reconcile: Callable[..., Any] | None = None,
    approval: bool = False,
) -> Agent:
    @tool
    def search_flights(origin: str, dest: str) -> list[str]:
        """Find flights."""
        return ["LH123"]

    @tool(reconcile=reconcile, requires_approval=approval)
    def book_seat(flight: str, ctx: Any) -> dict[str, str]:
        """Book a seat."""
        if airline.hook is not None:
            airline.hook("before")
        airline.bookings.append(f"{flight}:{ctx.idempotency_key}")
        if airline.hook is not None:
            airline.hook("after")
        return {"booking": f"B{len(airline.bookings)}"}

    return Agent("booking", "Book.", [search_flights, book_seat])


def _by_key(airline: Airline, call: Any, ctx: Any) -> Reconciled:
    """The airline's own answer: is there a booking under this key?"""
    for booking in airline.bookings:
        if booking.endswith(f":{ctx.idempotency_key}"):
            return Reconciled.completed({"booking": "found", "flight": call.arguments["flight"]})
    return Reconciled.never_ran()


async def _work_until_idle(stores: Stores, agent: Agent, **kwargs: Any) -> Worker:
    worker = Worker(_runner(stores), [agent], exit_when_idle=True, poll_interval=0.01, **kwargs)
    await asyncio.wait_for(worker.run(), 30)
    return worker


def _die_inside_book_seat(airline: Airline, stage: str) -> None:
    def hook(at: str) -> None:
        if at == stage:
            airline.hook = None
            raise SimulatedCrash(f"died {stage} booking")

    airline.hook = hook


async def test_submit_twice_makes_one_run_which_a_worker_finishes() -> None:
    stores, airline = _stores(), Airline()
    agent = _agent(airline)
    runner = _runner(stores)
    first = await runner.submit(agent, "book", tenant=T, run_id="r1")
    again = await runner.submit(agent, "book", tenant=T, run_id="r1")
    assert first == again == "r1"
    # Another request under that id is told it was not recorded, not dropped unsaid.
    with pytest.raises(RunStartedError):
        await runner.submit(agent, "book again", tenant=T, run_id="r1")
    worker = await _work_until_idle(stores, agent)
    assert [how for _, how in worker.carried] == [Carried.finished]
    assert len(airline.bookings) == 1
    # Retried after it finished: still the one run.
    assert await runner.submit(agent, "book", tenant=T, run_id="r1") == "r1"
    await _work_until_idle(stores, agent)
    assert len(airline.bookings) == 1


async def test_submit_without_an_id_makes_one_and_keeps_no_secret() -> None:
    stores, airline = _stores(), Airline()
    agent = _agent(airline)
    run_id = await _runner(stores).submit(
        agent, "book; my password: hunter2-correct-horse", tenant=T
    )
    assert run_id.startswith("run_")
    assert stores.work is not None
    stored = await stores.work.input(T, run_id)
    assert stored is not None and b"hunter2-correct-horse" not in stored


async def test_a_run_whose_holder_died_is_carried_on_by_a_worker() -> None:
    stores, airline = _stores(), Airline()
    agent = _agent(airline, reconcile=lambda call, ctx: _by_key(airline, call, ctx))
    _die_inside_book_seat(airline, "after")
    with pytest.raises(SimulatedCrash):
        await _runner(stores).run(agent, "book", tenant=T, run_id="r1")
    assert stores.work is not None
    (wanted,) = await stores.work.items(T)
    assert wanted.state is WorkState.wanted
    await _work_until_idle(stores, agent)
    assert len(airline.bookings) == 1, airline.bookings
    (record,) = [r for r in await stores.idempotency.records(T, "r1") if r.tool == "book_seat"]
    assert record.status is RecordStatus.completed and record.by == "reconciler:book_seat"
    assert await stores.work.items(T) == []


async def test_a_run_another_attempt_holds_is_tried_again_later_not_in_a_loop() -> None:
    """A run due by the index (no live lease) whose resume claim another attempt holds: the
    worker looks once, leaves it for a while, and takes it once the claim is let go."""
    stores, airline = _stores(), Airline()
    agent = _agent(airline, reconcile=lambda call, ctx: _by_key(airline, call, ctx))
    _die_inside_book_seat(airline, "after")
    with pytest.raises(SimulatedCrash):
        await _runner(stores).run(agent, "book", tenant=T, run_id="r1")
    claim = run_claim_key(T, "r1")
    taken = await stores.idempotency.claim(
        claim,
        holder="other",
        tenant=T,
        run_id="r1",
        iteration=None,
        tool=None,
        call_id=None,
        flags=None,
        ttl=60,
    )
    assert taken.holder == "other"
    worker = Worker(_runner(stores), [agent], poll_interval=0.01)
    running = asyncio.create_task(worker.run())
    try:
        await asyncio.sleep(0.5)  # fifty polls
        assert [how for _, how in worker.carried] == [Carried.elsewhere]
        await stores.idempotency.release(claim, tenant=T, holder="other")
        deadline = time.monotonic() + 30
        while not worker.carried or worker.carried[-1][1] is not Carried.finished:
            assert time.monotonic() < deadline, worker.carried
            await asyncio.sleep(0.02)
    finally:
        worker.drain()
        await asyncio.wait_for(running, 30)
    assert [how for _, how in worker.carried] == [Carried.elsewhere, Carried.finished]
    assert len(airline.bookings) == 1


async def test_a_call_that_never_happened_is_sent_once_the_reconciler_says_so() -> None:
    stores, airline = _stores(), Airline()
    asked: list[str] = []

    def reconcile(call: Any, ctx: Any) -> Reconciled:
        asked.append(ctx.idempotency_key)
        return _by_key(airline, call, ctx)

    agent = _agent(airline, reconcile=reconcile)
    _die_inside_book_seat(airline, "before")
    with pytest.raises(SimulatedCrash):
        await _runner(stores).run(agent, "book", tenant=T, run_id="r1")
    await _work_until_idle(stores, agent)
    assert len(asked) == 1
    assert len(airline.bookings) == 1
    (record,) = [r for r in await stores.idempotency.records(T, "r1") if r.tool == "book_seat"]
    assert record.status is RecordStatus.completed and record.by is None


@pytest.mark.parametrize(
    "answer",
    [
        lambda call, ctx: Reconciled.unknown(),
        lambda call, ctx: 1 / 0,
        lambda call, ctx: "yes, it ran",
    ],
    ids=["unknown", "raises", "not-a-Reconciled"],
)
async def test_a_call_no_reconciler_can_settle_parks_the_run_naming_it(answer: Any) -> None:
    stores, airline = _stores(), Airline()
    agent = _agent(airline, reconcile=answer)
    _die_inside_book_seat(airline, "before")
    with pytest.raises(SimulatedCrash):
        await _runner(stores).run(agent, "book", tenant=T, run_id="r1")
    worker = await _work_until_idle(stores, agent)
    assert [how for _, how in worker.carried] == [Carried.parked]
    assert stores.work is not None
    (parked,) = await stores.work.items(T, state=WorkState.parked)
    assert parked.reason is not None and "book_seat" in parked.reason
    # Parked means left alone: another round takes nothing.
    again = await _work_until_idle(stores, agent)
    assert again.carried == []
    assert airline.bookings == []


async def test_a_parked_run_goes_on_once_an_operator_resolved_its_call() -> None:
    stores, airline = _stores(), Airline()
    agent = _agent(airline)  # no reconciler
    _die_inside_book_seat(airline, "before")
    with pytest.raises(SimulatedCrash):
        await _runner(stores).run(agent, "book", tenant=T, run_id="r1")
    await _work_until_idle(stores, agent)
    assert stores.work is not None
    assert len(await stores.work.items(T, state=WorkState.parked)) == 1
    (record,) = [r for r in await stores.idempotency.records(T, "r1") if r.tool == "book_seat"]
    await stores.idempotency.resolve(record.key, tenant=T, never_ran=True, by="on-call")
    await stores.work.want(T, "r1", agent="booking")
    worker = await _work_until_idle(stores, agent)
    assert [how for _, how in worker.carried] == [Carried.finished]
    assert len(airline.bookings) == 1


class _FlakyProvider:
    """Fails with a retryable error ``failures`` times, then answers as scripted."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.inner = ScriptedProvider(list(BOOK_TURNS))

    async def complete(self, request: Any) -> Any:
        if self.failures:
            self.failures -= 1
            raise ProviderError("rate limited", retryable=True, status_code=429)
        return await self.inner.complete(request)


async def test_a_passing_failure_is_retried_later_not_in_a_loop() -> None:
    stores, airline = _stores(), Airline()
    agent = _agent(airline)
    runner = AgentRunner.from_stores(_FlakyProvider(failures=1), stores)
    await runner.submit(agent, "book", tenant=T, run_id="r1")
    worker = Worker(runner, [agent], exit_when_idle=True, poll_interval=0.01)
    await asyncio.wait_for(worker.run(), 30)
    assert [how for _, how in worker.carried] == [Carried.retry]
    assert stores.work is not None
    (waiting,) = await stores.work.items(T)
    assert waiting.attempts == 1 and waiting.not_before is not None
    assert waiting.reason is not None and "rate limited" in waiting.reason
    assert await stores.work.due(limit=10) == []  # backing off: not due yet
    await stores.work.want(T, "r1", agent="booking")  # time passes (the delay is >= 0.5 s)
    again = Worker(runner, [agent], exit_when_idle=True, poll_interval=0.01)
    await asyncio.wait_for(again.run(), 30)
    assert [how for _, how in again.carried] == [Carried.finished]
    assert len(airline.bookings) == 1


async def test_a_decided_approval_is_picked_up_without_anyone_resuming() -> None:
    stores, airline = _stores(), Airline()
    agent = _agent(airline, approval=True)
    runner = _runner(stores)
    result = await runner.run(agent, "book", tenant=T, run_id="r1")
    assert result.status is RunStatus.waiting_approval
    assert stores.work is not None
    assert await stores.work.due(limit=10) == []  # waiting on a person: nothing to do
    assert result.pending_approval is not None
    await stores.approvals.decide(T, result.pending_approval.id, approved=True, by="alice")
    await stores.work.want(T, "r1", agent="booking", state=WorkState.decided)
    worker = await _work_until_idle(stores, agent)
    assert [how for _, how in worker.carried] == [Carried.finished]
    assert len(airline.bookings) == 1


async def test_drain_stops_a_run_at_its_next_boundary_and_lets_another_worker_take_it() -> None:
    stores, airline = _stores(), Airline()
    booked = asyncio.Event()
    gate = asyncio.Event()

    @tool
    async def search_flights(origin: str, dest: str) -> list[str]:
        """Find flights."""
        booked.set()
        await gate.wait()
        return ["LH123"]

    @tool
    def book_seat(flight: str) -> dict[str, str]:
        """Book."""
        airline.bookings.append(flight)
        return {"booking": "B1"}

    agent = Agent("booking", "Book.", [search_flights, book_seat])
    runner = _runner(stores)
    await runner.submit(agent, "book", tenant=T, run_id="r1")
    worker = Worker(runner, [agent], poll_interval=0.01)
    running = asyncio.create_task(worker.run())
    await asyncio.wait_for(booked.wait(), 10)
    worker.drain()
    gate.set()  # the search finishes; the run stops at the boundary after it
    await asyncio.wait_for(running, 10)
    assert [how for _, how in worker.carried] == [Carried.stopped]
    assert airline.bookings == []
    assert await stores.leases.current(T, "r1") is None  # released, not left to lapse
    assert stores.work is not None
    assert [i.run_id for i in await stores.work.due(limit=10)] == ["r1"]
    other = await _work_until_idle(stores, agent)
    assert [how for _, how in other.carried] == [Carried.finished]
    assert airline.bookings == ["LH123"]


async def test_a_run_drained_more_often_than_max_attempts_is_never_parked_for_it() -> None:
    """A take counts one attempt (so a run that kills its carrier is counted); a run stopped
    cleanly at a boundary gives its take back, so deploys that drain it do not park it."""
    stores, airline = _stores(), Airline()
    started = asyncio.Event()
    gate = asyncio.Event()

    @tool
    async def search_flights(origin: str, dest: str) -> list[str]:
        """Find flights."""
        started.set()
        await gate.wait()
        return ["LH123"]

    @tool
    def book_seat(flight: str) -> dict[str, str]:
        """Book."""
        airline.bookings.append(flight)
        return {"booking": "B1"}

    agent = Agent("booking", "Book.", [search_flights, book_seat])
    turns = [[("search_flights", {"origin": "A", "dest": "B"})]] * 3 + list(BOOK_TURNS)
    runner = _runner(stores, turns)
    await runner.submit(agent, "book", tenant=T, run_id="r1")
    assert stores.work is not None
    for _ in range(3):
        started.clear()
        gate.clear()
        worker = Worker(runner, [agent], poll_interval=0.01, max_attempts=2)
        running = asyncio.create_task(worker.run())
        await asyncio.wait_for(started.wait(), 10)
        (taken,) = await stores.work.items(T)
        assert taken.attempts == 1  # counted while it is carried
        worker.drain()
        gate.set()
        await asyncio.wait_for(running, 10)
        assert [how for _, how in worker.carried] == [Carried.stopped]
        (back,) = await stores.work.items(T)
        assert (back.state, back.attempts) == (WorkState.wanted, 0)
    gate.set()
    last = Worker(runner, [agent], exit_when_idle=True, poll_interval=0.01, max_attempts=2)
    await asyncio.wait_for(last.run(), 30)
    assert [how for _, how in last.carried] == [Carried.finished]
    assert airline.bookings == ["LH123"]


async def test_two_workers_never_carry_one_run() -> None:
    stores, airline = _stores(), Airline()
    agent = _agent(airline)
    runner = _runner(stores)
    for n in range(6):
        await runner.submit(agent, "book", tenant=T, run_id=f"r{n}")
    workers = [
        Worker(_runner(stores), [agent], exit_when_idle=True, poll_interval=0.01) for _ in range(3)
    ]
    await asyncio.wait_for(asyncio.gather(*(w.run() for w in workers)), 60)
    finished = [i.run_id for w in workers for i, how in w.carried if how is Carried.finished]
    assert sorted(finished) == [f"r{n}" for n in range(6)]
    assert len(airline.bookings) == 6
    assert len(set(airline.bookings)) == 6


def test_a_worker_needs_a_work_index() -> None:
    stores = open_stores("memory://")
    stores.work = None
    runner = AgentRunner.from_stores(ScriptedProvider(list(BOOK_TURNS)), stores)
    with pytest.raises(Exception, match="work index"):
        Worker(runner, [_agent(Airline())])


def test_a_reconciler_needs_a_key() -> None:
    with pytest.raises(Exception, match="no idempotency key"):

        @tool(key=None, reconcile=lambda call, ctx: Reconciled.unknown())
        def book(flight: str) -> str:
            """Book."""
            return flight


def test_a_worker_needs_a_checkpointer() -> None:
    stores = _stores()
    runner = AgentRunner(ScriptedProvider([]), idempotency=stores.idempotency, work=stores.work)
    with pytest.raises(Exception, match="Checkpointer"):
        Worker(runner, [_agent(Airline())])


async def test_a_reconciler_is_asked_only_a_margin_past_the_previous_lease() -> None:
    """A claimant whose lease just ended may have sent the call a moment before: the
    airline is asked once that call could have landed."""
    stores, airline = _stores(), Airline()
    asked_at: list[float] = []

    def reconcile(call: Any, ctx: Any) -> Reconciled:
        asked_at.append(time.time())
        return _by_key(airline, call, ctx)

    agent = _agent(airline, reconcile=reconcile)
    _die_inside_book_seat(airline, "before")
    with pytest.raises(SimulatedCrash):
        await _runner(stores).run(agent, "book", tenant=T, run_id="r1")
    ended = time.time()  # the dead attempt's lease was released on its way out
    runner = _runner(stores)
    runner.never_ran_margin = 0.5
    worker = Worker(runner, [agent], exit_when_idle=True, poll_interval=0.01)
    await asyncio.wait_for(worker.run(), 30)
    assert len(asked_at) == 1 and asked_at[0] - ended >= 0.5
    assert len(airline.bookings) == 1


# --- cancel ---------------------------------------------------------------------------------


async def test_cancel_stops_a_live_run_at_its_next_boundary_and_sends_nothing_more() -> None:
    stores, airline = _stores(), Airline()
    searching = asyncio.Event()
    gate = asyncio.Event()

    @tool
    async def search_flights(origin: str, dest: str) -> list[str]:
        """Find flights."""
        searching.set()
        await gate.wait()
        return ["LH123"]

    @tool
    def book_seat(flight: str) -> dict[str, str]:
        """Book."""
        airline.bookings.append(flight)
        return {"booking": "B1"}

    agent = Agent("booking", "Book.", [search_flights, book_seat])
    runner = _runner(stores)
    await runner.submit(agent, "book", tenant=T, run_id="r1")
    worker = Worker(runner, [agent], exit_when_idle=True, poll_interval=0.01)
    running = asyncio.create_task(worker.run())
    await asyncio.wait_for(searching.wait(), 10)
    other = _runner(stores)
    assert await other.cancel("r1", tenant=T, by="alice", reason="customer called") is None
    gate.set()
    await asyncio.wait_for(running, 10)
    assert airline.bookings == []
    assert stores.checkpoints is not None
    cp = await Checkpointer.from_stores(stores).latest(T, "r1")
    assert cp is not None and cp.status.value == "cancelled"
    assert cp.output == "cancelled by alice: customer called"
    again = await _work_until_idle(stores, agent)
    assert again.carried == []


async def test_cancel_ends_a_run_nobody_holds_and_no_worker_takes_it() -> None:
    stores, airline = _stores(), Airline()
    agent = _agent(airline)
    _die_inside_book_seat(airline, "before")
    with pytest.raises(SimulatedCrash):
        await _runner(stores).run(agent, "book", tenant=T, run_id="r1")
    run = await _runner(stores).cancel(
        "r1", tenant=T, by="bob", reason="token sk-proj-AbCdEfGhIjKlMnOpQrStUvWxYz0123456789abcd"
    )
    assert run is not None and run.status is RunStatus.cancelled
    assert run.output is not None and "sk-proj" not in run.output
    assert (await _work_until_idle(stores, agent)).carried == []
    resumed = await _runner(stores).resume(agent, "r1", tenant=T)
    assert resumed.status is RunStatus.cancelled
    assert airline.bookings == []


async def test_cancelling_a_finished_run_records_nothing() -> None:
    stores, airline = _stores(), Airline()
    agent = _agent(airline)
    done = await _runner(stores).run(agent, "book", tenant=T, run_id="r1")
    assert done.status is RunStatus.completed
    for by in ("bob", "carol"):
        again = await _runner(stores).cancel("r1", tenant=T, by=by)
        assert again is not None and again.status is RunStatus.completed
    # The run's story holds no cancel nobody made happen, and no lease was taken for it.
    assert await cancel_requested(stores.idempotency, T, "r1") is None
    probe = await stores.leases.acquire(T, "r1", holder="probe", ttl=5.0)
    assert probe.fence == 2  # the run's own lease was the first
    assert len(airline.bookings) == 1


async def test_a_submitted_run_cancelled_before_it_started_never_starts() -> None:
    stores, airline = _stores(), Airline()
    agent = _agent(airline)
    runner = _runner(stores)
    await runner.submit(agent, "book", tenant=T, run_id="r1")
    assert await runner.cancel("r1", tenant=T, by="carol") is None
    assert (await _work_until_idle(stores, agent)).carried == []
    assert airline.bookings == []
    assert await runner.submit(agent, "book", tenant=T, run_id="r1") == "r1"
    assert (await _work_until_idle(stores, agent)).carried == []


async def test_an_operator_sees_why_a_run_is_parked() -> None:
    stores, airline = _stores(), Airline()
    agent = _agent(airline)
    _die_inside_book_seat(airline, "before")
    with pytest.raises(SimulatedCrash):
        await _runner(stores).run(agent, "book", tenant=T, run_id="r1")
    await _work_until_idle(stores, agent)
    outputs = []
    for argv in (["inspect", "r1", "--tenant", T], ["runs", "--tenant", T, "--stuck"]):
        out = io.StringIO()
        code = await asyncio.to_thread(
            frontier_main, argv, stores=stores, out=out, err=io.StringIO()
        )
        assert code == 0
        outputs.append(out.getvalue())
    assert "parked: IndeterminateToolCallError" in outputs[0] and "book_seat" in outputs[0]
    assert outputs[1].startswith("r1 ") and "parked:" in outputs[1]


async def test_starting_a_run_that_already_started_says_resume_it_and_is_retryable() -> None:
    """The resume-or-start race: a start that lost it did nothing and is told to resume
    (a ResumeConflictError, exit 3), not that it is misconfigured."""
    from tesserix_adk.errors import ConfigurationError, ResumeConflictError

    stores, airline = _stores(), Airline()
    agent = _agent(airline)
    await _runner(stores).run(agent, "book", tenant=T, run_id="r1")
    with pytest.raises(RunStartedError, match="resume it instead") as raised:
        await _runner(stores).run(agent, "book", tenant=T, run_id="r1")
    assert isinstance(raised.value, ResumeConflictError)
    assert not isinstance(raised.value, ConfigurationError)
    assert raised.value.retryable
    assert len(airline.bookings) == 1


def test_a_workers_resume_claims_lapse_with_its_leases() -> None:
    stores = _stores()
    runner = _runner(stores)
    assert runner.resume_claim_ttl > runner.lease_policy.ttl
    Worker(runner, [_agent(Airline())])
    assert runner.resume_claim_ttl == runner.lease_policy.ttl


async def _as_if_temporal_carried(stores: Stores, run_id: str) -> None:
    """Rewrite the run's frontier as its Temporal workflow's activity writes it."""
    cp = await Checkpointer.from_stores(stores).latest(T, run_id)
    assert cp is not None
    payload = encode_checkpoint(
        dataclasses.replace(cp, carried_by=Carrier.temporal, step=cp.step + 1), Redactor()
    )
    await stores.checkpoints.put(T, run_id, payload, step=cp.step + 1, fence=cp.fence)


async def test_a_run_its_temporal_workflow_carries_is_left_to_it() -> None:
    """An approved Temporal run that the work index shows as decided (an earlier kit's
    approve, or a race): the kit's resume refuses it before asking a reconciler anything;
    a worker gives its take back, marks it done and sends nothing; the CLI's approve does
    not wake a kit worker for it and says its workflow takes the decision."""
    stores, airline = _stores(), Airline()
    asked: list[str] = []

    def reconcile(call: Any, ctx: Any) -> Reconciled:
        asked.append(call.name)
        return Reconciled.never_ran()

    agent = _agent(airline, approval=True, reconcile=reconcile)
    result = await _runner(stores).run(agent, "book", tenant=T, run_id="r1")
    assert result.status is RunStatus.waiting_approval and result.pending_approval is not None
    await _as_if_temporal_carried(stores, "r1")
    out, err = io.StringIO(), io.StringIO()
    argv = ["approve", result.pending_approval.id, "--tenant", T, "--by", "alice"]
    code = await asyncio.to_thread(frontier_main, argv, stores=stores, out=out, err=err)
    assert code == 0, err.getvalue()
    assert "its temporal workflow takes the decision" in out.getvalue()
    assert "tesserix run --resume" not in out.getvalue()
    assert stores.work is not None
    assert await stores.work.due(limit=10) == []  # no kit worker was told of it
    with pytest.raises(CarriedByWorkflowError, match="temporal workflow") as refused:
        await _runner(stores).resume(agent, "r1", tenant=T)
    assert exit_code_for(refused.value) == 4 and not refused.value.retryable
    await stores.work.want(T, "r1", agent="booking", state=WorkState.decided)
    worker = await _work_until_idle(stores, agent)
    assert [how for _, how in worker.carried] == [Carried.elsewhere]
    assert await stores.work.items(T) == []  # done: listed no more, due no more
    assert airline.bookings == [] and asked == []
    latest = await Checkpointer.from_stores(stores).latest(T, "r1")
    assert latest is not None and latest.carried_by is Carrier.temporal
    assert latest.status is CheckpointStatus.waiting_approval  # left as its workflow left it


async def test_a_finished_temporal_run_reads_back_through_resume() -> None:
    """Nothing is carried on in a finished run, so the kit's resume answers it as it
    answers its own."""
    stores, airline = _stores(), Airline()
    agent = _agent(airline)
    await _runner(stores).run(agent, "book", tenant=T, run_id="r1")
    await _as_if_temporal_carried(stores, "r1")
    again = await _runner(stores).resume(agent, "r1", tenant=T)
    assert again.status is RunStatus.completed and len(airline.bookings) == 1


async def test_a_starting_worker_wakes_runs_parked_for_a_format_and_no_others() -> None:
    """An earlier release parks a run whose payload is of a newer format and never takes it
    back (``tests/test_attacks_mixed_fleet.py`` runs one); a worker of this release wakes
    such runs of its agents as it starts. A run parked for anything else, or of an agent it
    does not carry, stays parked."""
    stores, airline = _stores(), Airline()
    agent = _agent(airline)
    runner = _runner(stores)
    for run_id in ("format", "in-doubt", "other-agent"):
        await runner.submit(agent, "book", tenant=T, run_id=run_id)
    assert stores.work is not None
    newer = (
        "CheckpointFormatError: a recorded outcome has format 3, newer than the 2 this kit reads"
    )
    await stores.work.park(T, "format", agent="booking", reason=newer)
    await stores.work.park(T, "in-doubt", agent="booking", reason="IndeterminateToolCallError: x")
    await stores.work.park(T, "other-agent", agent="refunds", reason=newer)
    worker = await _work_until_idle(stores, agent)
    assert [(i.run_id, how) for i, how in worker.carried] == [("format", Carried.finished)]
    assert len(airline.bookings) == 1
    left = {i.run_id: i.reason for i in await stores.work.items(T, state=WorkState.parked)}
    assert left == {"in-doubt": "IndeterminateToolCallError: x", "other-agent": newer}


class _Dies:
    """Answers the first turn; the process "dies" while the model thinks of the second:
    the run is left at a frontier pinned to its agent's revision."""

    def __init__(self) -> None:
        self.inner = ScriptedProvider(list(BOOK_TURNS))
        self.calls = 0

    async def complete(self, request: Any) -> Any:
        self.calls += 1
        if self.calls > 1:
            raise SimulatedCrash("died while the model thought")
        return await self.inner.complete(request)


async def test_a_running_worker_wakes_runs_of_its_revision_another_revision_parked() -> None:
    """A rolling deploy: a worker of the old revision parks a run of the new one
    (``RevisionMismatchError``) while a worker of the new revision is already running. The
    new worker looks again every ``parked_sweep`` seconds and carries the run on;
    a run pinned to the old revision stays parked for the old workers or a person."""
    stores, airline = _stores(), Airline()
    new = _agent(airline)
    old = Agent("booking", "Book, the old way.", list(new.tools.values()))
    assert old.revision != new.revision
    runner = _runner(stores)
    assert stores.work is not None
    for run_id, agent in (("of-new", new), ("of-old", old)):
        await runner.submit(agent, "book", tenant=T, run_id=run_id)
        # Started (a frontier pinned to its revision), then its holder died.
        dies = AgentRunner.from_stores(
            _Dies(), stores, lease_policy=LeasePolicy(ttl=0.1, renew_within=0.05)
        )
        with pytest.raises(SimulatedCrash):
            await dies.run(agent, "book", tenant=T, run_id=run_id)
    worker = Worker(_runner(stores), [new], poll_interval=0.02, parked_sweep=0.05)
    parked = asyncio.Event()

    async def old_worker_parks() -> None:
        # As an old worker does, once the new one runs (it took neither run: not due yet).
        for run_id in ("of-new", "of-old"):
            reason = f"RevisionMismatchError: run {run_id} is pinned to another revision"
            await stores.work.park(T, run_id, agent="booking", reason=reason)
        parked.set()

    for run_id in ("of-new", "of-old"):
        await stores.work.done(T, run_id)  # not due: the new worker leaves them alone
    task = asyncio.create_task(worker.run())
    await asyncio.sleep(0.1)
    await old_worker_parks()
    for _ in range(200):
        if any(i.run_id == "of-new" and how is Carried.finished for i, how in worker.carried):
            break
        await asyncio.sleep(0.02)
    worker.drain()
    await task
    assert [(i.run_id, how) for i, how in worker.carried] == [("of-new", Carried.finished)]
    assert len(airline.bookings) == 1
    left = {i.run_id for i in await stores.work.items(T, state=WorkState.parked)}
    assert left == {"of-old"}
