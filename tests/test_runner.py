"""The run loop and resume: the seed's guarantees, with in-memory stores.

Process death is simulated in-process with ``SimulatedCrash`` (a ``BaseException``); the
real-process versions (SIGKILL) live in ``tests/test_crash_processes.py``.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from booking import BOOK_TURNS, Airline, booking_agent
from tesserix_adk import (
    AgentRunner,
    Boundary,
    Checkpointer,
    CheckpointPolicy,
    CheckpointStatus,
    DivergedRunError,
    IndeterminateToolCallError,
    MemoryApprovalStore,
    MemoryCheckpointStore,
    MemoryHistoryStore,
    MemoryIdempotencyStore,
    MemoryLedger,
    Message,
    ModelRequest,
    ModelResponse,
    ResumeConflictError,
    RunStatus,
    ScriptedProvider,
    ScriptedTurn,
    StoreUnavailableError,
    Usage,
)
from tesserix_adk.testing import FakeClock
from tesserix_adk.testing.faults import (
    FaultyCheckpointStore,
    FaultyIdempotencyStore,
    SimulatedCrash,
)


def at(boundary: str, iteration: int) -> Any:
    """A payload test: the frontier written at ``boundary`` of ``iteration``."""
    return lambda body: body.get("boundary") == boundary and body.get("iteration") == iteration


class World:
    """One tenant's stores, shared by every "process" (runner) of a test."""

    def __init__(self, clock: FakeClock | None = None, **store_kwargs: Any) -> None:
        self.clock = clock or FakeClock()
        self.idempotency = MemoryIdempotencyStore(clock=self.clock)
        self.store = FaultyCheckpointStore(MemoryCheckpointStore())
        self.history = MemoryHistoryStore()
        self.ledger = MemoryLedger()
        self.approvals = MemoryApprovalStore(clock=self.clock)
        self.store_kwargs = store_kwargs

    def runner(self, turns: Any = BOOK_TURNS, **kwargs: Any) -> AgentRunner:
        """A fresh runner, as a new process would build it."""
        provider = kwargs.pop("provider", None) or ScriptedProvider(turns)
        checkpointer = Checkpointer(self.store, history=self.history, **self.store_kwargs)
        return AgentRunner(
            provider,
            idempotency=kwargs.pop("idempotency", self.idempotency),
            checkpoints=checkpointer,
            ledger=self.ledger,
            approvals=self.approvals,
            **kwargs,
        )


# --- the seed's example ------------------------------------------------------------------


async def test_seed_example_runs_dies_and_resumes(airline: Airline) -> None:
    runner = AgentRunner(
        ScriptedProvider(BOOK_TURNS),
        idempotency=MemoryIdempotencyStore(),
        checkpoints=Checkpointer(MemoryCheckpointStore()),
    )
    agent = booking_agent(airline)

    def die(stage: str) -> None:
        if stage == "after":
            raise SimulatedCrash("the process dies mid-run")

    airline.hook = die
    with pytest.raises(SimulatedCrash):
        await runner.run(agent, "book the flight", tenant="acme", run_id="run_1")
    airline.hook = None
    with pytest.raises(IndeterminateToolCallError) as err:
        await runner.resume(agent, "run_1", tenant="acme")
    assert [c.tool for c in err.value.calls] == ["book_seat"]
    assert airline.bookings == ["LH123"]


async def test_completed_call_is_replayed_and_runs_once(airline: Airline) -> None:
    world = World()
    # Dies after book_seat completed, before its after_tool_result frontier is written.
    world.store.crash_before = at("after_tool_result", 1)
    with pytest.raises(SimulatedCrash):
        await world.runner().run(booking_agent(airline), "book", tenant="acme", run_id="r")
    assert airline.bookings == ["LH123"]
    world.store.crash_before = None

    seen: list[ModelRequest] = []
    provider = _Recording(ScriptedProvider(BOOK_TURNS), seen)
    run = await world.runner(provider=provider).resume(booking_agent(airline), "r", tenant="acme")

    assert run.status is RunStatus.completed
    assert airline.bookings == ["LH123"]
    tool_messages = [m for m in seen[-1].messages if m.tool_call_id == "call_1_0"]
    assert json.loads(tool_messages[0].text) == {"booking": "B1", "flight": "LH123"}


async def test_in_flight_call_is_indeterminate_and_not_rerun(airline: Airline) -> None:
    world = World()

    def die(stage: str) -> None:
        if stage == "after":
            raise SimulatedCrash

    airline.hook = die
    with pytest.raises(SimulatedCrash):
        await world.runner().run(booking_agent(airline), "book", tenant="acme", run_id="r")
    airline.hook = None
    with pytest.raises(IndeterminateToolCallError) as err:
        await world.runner().resume(booking_agent(airline), "r", tenant="acme")
    assert err.value.retryable is False
    assert "book_seat" in str(err.value)
    assert [(c.tool, c.call_id) for c in err.value.calls] == [("book_seat", "call_1_0")]
    assert airline.bookings == ["LH123"]


async def test_call_that_never_started_is_dispatched_exactly_once(airline: Airline) -> None:
    world = World()
    # Dies right after the model asked for book_seat: frontier written, nothing claimed.
    world.store.crash_after = at("after_model_call", 1)
    with pytest.raises(SimulatedCrash):
        await world.runner().run(booking_agent(airline), "book", tenant="acme", run_id="r")
    assert airline.bookings == []
    world.store.crash_after = None
    run = await world.runner().resume(booking_agent(airline), "r", tenant="acme")
    assert run.status is RunStatus.completed
    assert airline.bookings == ["LH123"]


async def test_side_effect_free_call_in_flight_is_sent_again(airline: Airline) -> None:
    world = World()

    def die() -> None:
        if airline.searches == 1:
            raise SimulatedCrash

    with pytest.raises(SimulatedCrash):
        await world.runner().run(
            booking_agent(airline, search_hook=die), "book", tenant="acme", run_id="r"
        )
    run = await world.runner().resume(booking_agent(airline, search_hook=die), "r", tenant="acme")
    assert run.status is RunStatus.completed
    assert airline.searches == 2
    assert airline.bookings == ["LH123"]


async def test_keyless_side_effecting_call_in_flight_is_indeterminate(airline: Airline) -> None:
    from tesserix_adk import Agent, tool

    sent: list[str] = []

    @tool(key=None)
    def send_email(to: str) -> str:
        """Send an email."""
        sent.append(to)
        raise SimulatedCrash

    agent = Agent("mailer", "Send mail.", [send_email])
    world = World()
    turns = [[("send_email", {"to": "a@example.com"})], "sent"]
    with pytest.raises(SimulatedCrash):
        await world.runner(turns).run(agent, "mail", tenant="acme", run_id="r")
    with pytest.raises(IndeterminateToolCallError, match="send_email"):
        await world.runner(turns).resume(agent, "r", tenant="acme")
    assert sent == ["a@example.com"]


async def test_resuming_a_finished_run_calls_no_model_and_releases_its_claim(
    airline: Airline,
) -> None:
    world = World()
    await world.runner().run(booking_agent(airline), "book", tenant="acme", run_id="r")
    provider = ScriptedProvider(BOOK_TURNS)
    run = await world.runner(provider=provider).resume(booking_agent(airline), "r", tenant="acme")
    assert run.status is RunStatus.completed
    assert run.output == "Booked LH123."
    assert provider.calls == 0
    assert airline.bookings == ["LH123"]
    # The claim was released: another resume right away is not refused.
    await world.runner().resume(booking_agent(airline), "r", tenant="acme")


# --- checkpoint policy -------------------------------------------------------------------


@pytest.mark.parametrize(
    "boundaries",
    [
        (Boundary.after_model_call, Boundary.after_tool_result),
        (Boundary.after_model_call,),
        (Boundary.after_tool_result,),
        (),
    ],
    ids=["both", "after_model_call", "after_tool_result", "final-only"],
)
async def test_policy_writes_exactly_at_its_boundaries(
    airline: Airline, boundaries: tuple[Boundary, ...]
) -> None:
    world = World(policy=CheckpointPolicy(boundaries=frozenset(boundaries)))
    await world.runner().run(booking_agent(airline), "book", tenant="acme", run_id="r")
    written = [(p["boundary"], p["iteration"], p["status"]) for p in world.store.puts]
    expected = [
        (str(b), i, "running")
        for i in (0, 1)
        for b in (Boundary.after_model_call, Boundary.after_tool_result)
        if b in boundaries
    ]
    expected.append(("after_model_call", 2, "completed"))
    assert written == expected
    assert [p["step"] for p in world.store.puts] == list(range(1, len(expected) + 1))


# --- size cap and store failures ---------------------------------------------------------


async def test_over_the_cap_nothing_truncated_run_completes_and_resume_refuses(
    airline: Airline,
) -> None:
    from tesserix_adk import CheckpointTooLargeError

    world = World()
    big = "x" * 5000
    turns = [
        [("search_flights", {"origin": "FRA", "dest": "JFK"})],
        [("book_seat", {"flight": "LH123"})],
        ScriptedTurn(text=big),
    ]
    checkpointer = Checkpointer(world.store, history=world.history, max_bytes=2000)
    runner = AgentRunner(
        ScriptedProvider(turns), idempotency=world.idempotency, checkpoints=checkpointer
    )
    run = await runner.run(booking_agent(airline), "book", tenant="acme", run_id="r")
    assert run.status is RunStatus.completed
    assert isinstance(checkpointer.last_error, CheckpointTooLargeError)
    for payload in world.store.payloads:
        assert len(payload) <= 2000
        assert big not in payload.decode()
    latest = await checkpointer.latest("acme", "r")
    assert latest is not None and latest.status is CheckpointStatus.tombstone
    with pytest.raises(CheckpointTooLargeError) as err:
        await world.runner().resume(booking_agent(airline), "r", tenant="acme")
    assert err.value.retryable is False


async def test_inline_transcript_over_the_cap_is_refused_not_trimmed(airline: Airline) -> None:
    from tesserix_adk import CheckpointTooLargeError

    store = FaultyCheckpointStore(MemoryCheckpointStore())
    checkpointer = Checkpointer(store, max_bytes=1500)
    runner = AgentRunner(
        ScriptedProvider(BOOK_TURNS),
        idempotency=MemoryIdempotencyStore(),
        checkpoints=checkpointer,
    )
    run = await runner.run(booking_agent(airline), "y" * 1000, tenant="acme", run_id="r")
    assert run.status is RunStatus.completed
    assert isinstance(checkpointer.last_error, CheckpointTooLargeError)
    full = [p for p in store.puts if p["status"] != "tombstone"]
    for body in full:  # whatever was written is whole: the first message is all there
        assert body["messages"][0]["content"] == "y" * 1000
    assert store.puts[-1]["status"] == "tombstone"


async def test_store_that_raises_on_put_does_not_fail_the_run(airline: Airline) -> None:
    world = World()
    world.store.fail_with = ConnectionError("checkpoint store down")
    runner = world.runner()
    run = await runner.run(booking_agent(airline), "book", tenant="acme", run_id="r")
    assert run.status is RunStatus.completed
    assert runner.checkpoints is not None
    assert isinstance(runner.checkpoints.last_error, ConnectionError)
    assert airline.bookings == ["LH123"]


# --- one resumer at a time ---------------------------------------------------------------


async def test_two_concurrent_resumes_exactly_one_conflicts(airline: Airline) -> None:
    world = World()
    world.store.crash_after = at("after_model_call", 1)
    with pytest.raises(SimulatedCrash):
        await world.runner().run(booking_agent(airline), "book", tenant="acme", run_id="r")
    world.store.crash_after = None

    gate = asyncio.Event()
    entered = asyncio.Event()

    class Slow:
        async def complete(self, request: ModelRequest) -> ModelResponse:
            entered.set()
            await gate.wait()
            return await ScriptedProvider(BOOK_TURNS).complete(request)

    first = asyncio.create_task(
        world.runner(provider=Slow()).resume(booking_agent(airline), "r", tenant="acme")
    )
    await entered.wait()
    results = await asyncio.gather(
        world.runner().resume(booking_agent(airline), "r", tenant="acme"),
        return_exceptions=True,
    )
    gate.set()
    done = await first
    assert [type(r) for r in results] == [ResumeConflictError]
    assert done.status is RunStatus.completed
    assert airline.bookings == ["LH123"]


async def test_resume_claim_expires_after_five_minutes_of_store_time(airline: Airline) -> None:
    world = World()
    world.store.crash_after = at("after_model_call", 1)
    with pytest.raises(SimulatedCrash):
        await world.runner().run(booking_agent(airline), "book", tenant="acme", run_id="r")
    world.store.crash_after = None

    # A resumer dies holding the run claim.
    dying = ScriptedProvider(BOOK_TURNS)

    class Dies:
        async def complete(self, request: ModelRequest) -> ModelResponse:
            raise SimulatedCrash

    world.store.crash_before = lambda body: True
    with pytest.raises(SimulatedCrash):
        await world.runner(provider=Dies()).resume(booking_agent(airline), "r", tenant="acme")
    world.store.crash_before = None
    with pytest.raises(ResumeConflictError):
        await world.runner(provider=dying).resume(booking_agent(airline), "r", tenant="acme")
    world.clock.advance(299)
    with pytest.raises(ResumeConflictError):
        await world.runner().resume(booking_agent(airline), "r", tenant="acme")
    world.clock.advance(2)
    run = await world.runner().resume(booking_agent(airline), "r", tenant="acme")
    assert run.status is RunStatus.completed
    assert airline.bookings == ["LH123"]


# --- records ahead of the frontier -------------------------------------------------------


def _tool_result_only() -> CheckpointPolicy:
    return CheckpointPolicy(boundaries=frozenset({Boundary.after_tool_result}))


async def test_in_flight_record_ahead_of_the_frontier_makes_the_plan_unsafe(
    airline: Airline,
) -> None:
    from tesserix_adk import plan_resume

    world = World(policy=_tool_result_only())

    def die(stage: str) -> None:
        if stage == "after":
            raise SimulatedCrash

    airline.hook = die
    with pytest.raises(SimulatedCrash):
        await world.runner().run(booking_agent(airline), "book", tenant="acme", run_id="r")
    airline.hook = None
    checkpointer = Checkpointer(world.store, history=world.history)
    frontier = await checkpointer.latest("acme", "r")
    assert frontier is not None and frontier.iteration == 0
    plan = await plan_resume(frontier, world.idempotency)
    assert not plan.safe
    assert [(c.tool, c.ahead) for c in plan.indeterminate] == [("book_seat", True)]
    with pytest.raises(IndeterminateToolCallError):
        await world.runner().resume(booking_agent(airline), "r", tenant="acme")
    assert airline.bookings == ["LH123"]


async def test_completed_record_ahead_is_replayed_when_asked_again(airline: Airline) -> None:
    world = World(policy=_tool_result_only())
    world.store.crash_before = at("after_tool_result", 1)
    with pytest.raises(SimulatedCrash):
        await world.runner().run(booking_agent(airline), "book", tenant="acme", run_id="r")
    world.store.crash_before = None
    run = await world.runner().resume(booking_agent(airline), "r", tenant="acme")
    assert run.status is RunStatus.completed
    assert airline.bookings == ["LH123"]


async def test_different_side_effecting_call_ahead_is_refused_as_diverged(
    airline: Airline,
) -> None:
    world = World(policy=_tool_result_only())
    world.store.crash_before = at("after_tool_result", 1)
    with pytest.raises(SimulatedCrash):
        await world.runner().run(booking_agent(airline), "book", tenant="acme", run_id="r")
    world.store.crash_before = None
    other = [BOOK_TURNS[0], [("book_seat", {"flight": "UA456"})], "Booked UA456."]
    with pytest.raises(DivergedRunError) as err:
        await world.runner(other).resume(booking_agent(airline), "r", tenant="acme")
    assert err.value.retryable is False
    assert airline.bookings == ["LH123"]
    # Refused before that turn's frontier was written.
    assert world.store.puts[-1]["iteration"] == 0


async def test_finishing_without_asking_again_for_a_completed_call_is_diverged(
    airline: Airline,
) -> None:
    world = World(policy=_tool_result_only())
    world.store.crash_before = at("after_tool_result", 1)
    with pytest.raises(SimulatedCrash):
        await world.runner().run(booking_agent(airline), "book", tenant="acme", run_id="r")
    world.store.crash_before = None
    with pytest.raises(DivergedRunError):
        await world.runner([BOOK_TURNS[0], "Nothing to book."]).resume(
            booking_agent(airline), "r", tenant="acme"
        )
    assert airline.bookings == ["LH123"]


# --- no claim, no dispatch ---------------------------------------------------------------


async def test_unreachable_idempotency_store_dispatches_nothing_and_stays_resumable(
    airline: Airline,
) -> None:
    world = World()
    faulty = FaultyIdempotencyStore(world.idempotency)

    faulty.unreachable = True
    with pytest.raises(StoreUnavailableError) as err:
        await world.runner(idempotency=faulty).run(
            booking_agent(airline), "book", tenant="acme", run_id="r"
        )
    assert err.value.retryable is True
    assert airline.bookings == []
    # search_flights needed a claim too (every keyed call does).
    assert airline.searches == 0

    faulty.unreachable = False
    run = await world.runner(idempotency=faulty).resume(booking_agent(airline), "r", tenant="acme")
    assert run.status is RunStatus.completed
    assert airline.bookings == ["LH123"]


async def test_claim_is_recorded_before_the_tool_runs() -> None:
    from tesserix_adk import Agent, tool

    world = World()
    seen: list[str] = []

    @tool
    async def refund(order: str) -> str:
        """Refund an order."""
        records = await world.idempotency.records("acme", "r")
        seen.extend(f"{r.tool}:{r.status}" for r in records if r.tool is not None)
        return "refunded"

    agent = Agent("refunds", "Refund.", [refund])
    await world.runner([[("refund", {"order": "o-1"})], "done"]).run(
        agent, "refund o-1", tenant="acme", run_id="r"
    )
    assert seen == ["refund:in_flight"]


# --- spend -------------------------------------------------------------------------------


async def test_resumed_run_keeps_its_spend_from_the_ledger_and_the_budget_stops_it(
    airline: Airline,
) -> None:
    world = World()
    turns = [
        ScriptedTurn(calls=[("search_flights", {"origin": "A", "dest": "B"})], cost_micros=100),
        ScriptedTurn(calls=[("search_flights", {"origin": "B", "dest": "C"})], cost_micros=100),
        ScriptedTurn(calls=[("book_seat", {"flight": "LH123"})], cost_micros=100),
        ScriptedTurn(text="done", cost_micros=100),
    ]
    agent = booking_agent(airline, budget_micros=250)
    world.store.crash_after = at("after_tool_result", 0)
    with pytest.raises(SimulatedCrash):
        await world.runner(turns).run(agent, "book", tenant="acme", run_id="r")
    world.store.crash_after = None
    assert await world.ledger.spent("acme", "r") == 100
    # Spend the frontier does not know about: only the ledger does.
    await world.ledger.charge("acme", "r", 100, Usage())
    provider = ScriptedProvider(turns)
    run = await world.runner(provider=provider).resume(agent, "r", tenant="acme")
    assert run.status is RunStatus.budget_exhausted
    assert run.spent_micros == 300
    assert provider.calls == 1  # 200 < 250 allowed one more call, then 300 stopped it
    assert airline.bookings == []


# --- approvals ---------------------------------------------------------------------------


async def test_waiting_run_keeps_waiting_then_approval_dispatches_once(airline: Airline) -> None:
    world = World()
    agent = booking_agent(airline, approval=True)
    run = await world.runner().run(agent, "book", tenant="acme", run_id="r")
    assert run.status is RunStatus.waiting_approval
    assert run.pending_approval is not None
    request_id = run.pending_approval.id
    assert [c.name for c in run.pending_approval.calls] == ["book_seat"]
    assert world.store.puts[-1]["boundary"] == "before_approval"
    assert world.store.puts[-1]["pending_approval"]["id"] == request_id

    writes = len(world.store.puts)
    again = await world.runner().resume(agent, "r", tenant="acme")
    assert again.status is RunStatus.waiting_approval
    assert len(world.store.puts) == writes
    assert airline.bookings == []

    await world.approvals.decide("acme", request_id, approved=True, by="alice")
    done = await world.runner().resume(agent, "r", tenant="acme")
    assert done.status is RunStatus.completed
    assert airline.bookings == ["LH123"]
    await world.runner().resume(agent, "r", tenant="acme")
    assert airline.bookings == ["LH123"]


async def test_denied_call_is_never_dispatched_and_the_model_sees_the_denial(
    airline: Airline,
) -> None:
    world = World()
    agent = booking_agent(airline, approval=True)
    run = await world.runner().run(agent, "book", tenant="acme", run_id="r")
    assert run.pending_approval is not None
    await world.approvals.decide(
        "acme", run.pending_approval.id, approved=False, by="bob", note="over budget"
    )
    seen: list[ModelRequest] = []
    provider = _Recording(ScriptedProvider(BOOK_TURNS), seen)
    done = await world.runner(provider=provider).resume(agent, "r", tenant="acme")
    assert done.status is RunStatus.completed
    assert airline.bookings == []
    answer = next(m for m in seen[-1].messages if m.tool_call_id == "call_1_0")
    assert answer.is_error
    assert answer.text == "denied by bob: over budget"
    assert [r for r in await world.idempotency.records("acme", "r") if r.tool == "book_seat"] == []


async def test_approval_tool_without_an_approval_store_is_a_configuration_error(
    airline: Airline,
) -> None:
    from tesserix_adk import ConfigurationError

    runner = AgentRunner(ScriptedProvider(BOOK_TURNS), idempotency=MemoryIdempotencyStore())
    with pytest.raises(ConfigurationError, match="approval"):
        await runner.run(booking_agent(airline, approval=True), "book", tenant="acme")
    assert airline.searches == 0


async def test_max_iterations_writes_a_final_frontier(airline: Airline) -> None:
    world = World()
    agent = booking_agent(airline, max_iterations=1)
    run = await world.runner().run(agent, "book", tenant="acme", run_id="r")
    assert run.status is RunStatus.max_iterations
    assert world.store.puts[-1]["status"] == "max_iterations"


async def test_input_may_be_messages(airline: Airline) -> None:
    world = World()
    run = await world.runner().run(
        booking_agent(airline),
        [Message.user("book"), Message.user("LH123 please")],
        tenant="acme",
        run_id="r",
    )
    assert run.status is RunStatus.completed


# --- helpers -----------------------------------------------------------------------------


class _Recording:
    def __init__(self, inner: ScriptedProvider, seen: list[ModelRequest]) -> None:
        self.inner = inner
        self.seen = seen

    async def complete(self, request: ModelRequest) -> ModelResponse:
        self.seen.append(request)
        return await self.inner.complete(request)
