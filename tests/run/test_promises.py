"""The runner keeps its first promise — one effect per call — under what users really do:
retry on the same runner, re-ask a turn differently, ask for twin calls, approve a call whose
arguments held a secret, lose a store's reply, block in a sync tool.

Each test names the defect it pins (issue 11); each failed on the runner before the split.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import json
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from adapters import services
from booking import BOOK_TURNS, Airline, booking_agent
from run.helpers import Recording as _Recording
from run.helpers import answers as _answer_to
from run.helpers import at as _at
from tesserix_adk import (
    Agent,
    AgentRunner,
    Boundary,
    CheckpointCorruptError,
    Checkpointer,
    CheckpointPolicy,
    CheckpointStatus,
    ConfigurationError,
    DivergedRunError,
    IdempotencyStore,
    IndeterminateToolCallError,
    LeaseLostError,
    LeasePolicy,
    MemoryApprovalStore,
    MemoryCheckpointStore,
    MemoryHistoryStore,
    MemoryIdempotencyStore,
    MemoryLeaseStore,
    ModelRequest,
    ModelResponse,
    ResumeConflictError,
    Resumer,
    RunStatus,
    ScriptedProvider,
    StoreReplyLostError,
    StoreUnavailableError,
    tool,
)
from tesserix_adk.run import run_claim_key
from tesserix_adk.stores import open_stores
from tesserix_adk.testing.faults import (
    FaultyCheckpointStore,
    FaultyIdempotencyStore,
    SimulatedCrash,
)

ONLY_TOOL_RESULTS = CheckpointPolicy(boundaries=frozenset({Boundary.after_tool_result}))


@pytest.fixture(
    params=[
        "memory",
        "sqlite",
        pytest.param("redis", marks=pytest.mark.redis),
        pytest.param("postgres", marks=pytest.mark.postgres),
    ]
)
async def idempotency(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Any]:
    """An idempotency store of every backend."""
    if request.param == "memory":
        yield MemoryIdempotencyStore()
        return
    if request.param == "redis":
        async with services.redis_stores() as stores:
            yield stores.idempotency
        return
    if request.param == "postgres":
        async with services.postgres_stores() as stores:
            yield stores.idempotency
        return
    stores = open_stores(f"sqlite:///{tmp_path}/adk.sqlite3")
    await stores.create_schema()
    async with stores:
        yield stores.idempotency


# --- 1. ownership belongs to one attempt -------------------------------------------------


async def test_retry_on_the_same_runner_never_sends_a_claimed_call_again(
    airline: Airline, idempotency: IdempotencyStore
) -> None:
    def unrecordable(phase: str, op: str, key: str) -> None:
        if phase == "before" and op == "complete" and airline.bookings:
            raise StoreUnavailableError("the booking's outcome can never be recorded")

    faulty = FaultyIdempotencyStore(idempotency, hook=unrecordable)
    runner = AgentRunner(ScriptedProvider(BOOK_TURNS), idempotency=faulty)
    agent = booking_agent(airline)
    with pytest.raises(StoreUnavailableError) as first:
        await runner.run(agent, "book", tenant="acme", run_id="r")
    assert first.value.retryable
    assert airline.bookings == ["LH123"]
    # The natural answer to a retryable error: the same call on the same runner.
    with pytest.raises(IndeterminateToolCallError, match="book_seat"):
        await runner.run(agent, "book", tenant="acme", run_id="r")
    assert airline.bookings == ["LH123"]


async def test_complete_is_retried_in_process_before_giving_up(
    airline: Airline, idempotency: IdempotencyStore
) -> None:
    faulty = FaultyIdempotencyStore(idempotency)
    faulty.fail_completes = 2
    runner = AgentRunner(ScriptedProvider(BOOK_TURNS), idempotency=faulty)
    run = await runner.run(booking_agent(airline), "book", tenant="acme", run_id="r")
    assert run.status is RunStatus.completed
    assert airline.bookings == ["LH123"]
    assert [op for op, _ in faulty.calls].count("complete") == 4  # 3 for search, 1 for book_seat


async def test_two_concurrent_runs_of_one_run_id_on_one_runner_dispatch_once() -> None:
    booked: list[str] = []
    gate = asyncio.Event()
    entered = asyncio.Event()

    @tool
    async def book_seat(flight: str) -> str:
        """Book a seat."""
        booked.append(flight)
        entered.set()
        if len(booked) > 1:  # the second attempt dispatched too: let both finish
            gate.set()
        await gate.wait()
        return "booked"

    agent = Agent("booking", "Book.", [book_seat])
    turns: list[Any] = [[("book_seat", {"flight": "LH123"})], "done"]
    runner = AgentRunner(ScriptedProvider(turns), idempotency=MemoryIdempotencyStore())

    async def attempt() -> Any:
        return await runner.run(agent, "book", tenant="acme", run_id="r")

    first = asyncio.ensure_future(attempt())
    await entered.wait()
    second = asyncio.ensure_future(attempt())
    done = await asyncio.gather(second, return_exceptions=True)
    gate.set()
    assert (await first).status is RunStatus.completed
    assert isinstance(done[0], IndeterminateToolCallError)
    assert booked == ["LH123"]


# --- 2. divergence is refused at once -----------------------------------------------------


def _shop(booked: list[str], charged: list[int]) -> Agent:
    @tool
    def book_seat(flight: str) -> str:
        """Book a seat."""
        booked.append(flight)
        return f"booked {flight}"

    @tool
    def charge_card(amount: int) -> str:
        """Charge the card."""
        charged.append(amount)
        return "charged"

    return Agent("shop", "Book and pay.", [book_seat, charge_card])


async def test_divergence_is_refused_before_any_later_dispatch() -> None:
    booked: list[str] = []
    charged: list[int] = []
    store = FaultyCheckpointStore(MemoryCheckpointStore(), crash_before=_at("after_tool_result", 1))
    idem = MemoryIdempotencyStore()

    def runner(turns: list[Any]) -> AgentRunner:
        checkpoints = Checkpointer(store, policy=ONLY_TOOL_RESULTS)
        return AgentRunner(ScriptedProvider(turns), idempotency=idem, checkpoints=checkpoints)

    first: list[Any] = [
        [("book_seat", {"flight": "X0"})],
        [("book_seat", {"flight": "LH123"}), ("book_seat", {"flight": "UA456"})],
        "done",
    ]
    with pytest.raises(SimulatedCrash):
        await runner(first).run(_shop(booked, charged), "go", tenant="acme", run_id="r")
    assert booked == ["X0", "LH123", "UA456"]
    store.crash_before = None
    # The resumed model asks again for only one of the two, then for something new.
    second: list[Any] = [
        first[0],
        [("book_seat", {"flight": "LH123"})],
        [("charge_card", {"amount": 5})],
        "done",
    ]
    with pytest.raises(DivergedRunError) as err:
        await runner(second).resume(_shop(booked, charged), "r", tenant="acme")
    assert charged == []
    assert booked == ["X0", "LH123", "UA456"]
    assert "1 side-effecting call" in str(err.value)
    assert "book_seat" in str(err.value)


# --- 3. twin calls ------------------------------------------------------------------------


TWINS: list[Any] = [
    [("book_seat", {"flight": "LH123"}), ("book_seat", {"flight": "LH123"})],
    "Booked two seats.",
]


async def test_two_identical_calls_in_one_turn_each_run_once(airline: Airline) -> None:
    runner = AgentRunner(
        ScriptedProvider(TWINS),
        idempotency=MemoryIdempotencyStore(),
        checkpoints=Checkpointer(MemoryCheckpointStore()),
    )
    run = await runner.run(booking_agent(airline), "two seats", tenant="acme", run_id="r")
    assert run.status is RunStatus.completed
    assert airline.bookings == ["LH123", "LH123"]


async def test_twin_calls_run_once_each_across_a_crash(airline: Airline) -> None:
    store = MemoryCheckpointStore()
    idem = MemoryIdempotencyStore()

    def runner() -> AgentRunner:
        return AgentRunner(
            ScriptedProvider(TWINS), idempotency=idem, checkpoints=Checkpointer(store)
        )

    def die_before_second(stage: str) -> None:
        if stage == "before" and len(airline.bookings) == 1:
            raise SimulatedCrash

    airline.hook = die_before_second
    with pytest.raises(SimulatedCrash):
        await runner().run(booking_agent(airline), "two seats", tenant="acme", run_id="r")
    airline.hook = None
    assert airline.bookings == ["LH123"]
    # The second twin's claim was taken, then the process died before its effect: the
    # operator says it never ran.
    recs = [r for r in await idem.records("acme", "r") if r.tool == "book_seat"]
    assert len(recs) == 2
    in_flight = [r for r in recs if r.status == "in_flight"]
    assert len(in_flight) == 1
    await idem.resolve(in_flight[0].key, tenant="acme", never_ran=True, by="ops")
    run = await runner().resume(booking_agent(airline), "r", tenant="acme")
    assert run.status is RunStatus.completed
    assert airline.bookings == ["LH123", "LH123"]


# --- 4. a masked call is never sent ---------------------------------------------------------

SECRET = "sk-proj-abcdefghijklmnopqrstuvwxyz0123456789ABCD"


def _vault(sent: list[str], *, approval: bool) -> Agent:
    @tool(requires_approval=approval)
    def store_key(service: str, api_key: str) -> str:
        """Store an API key in the vault."""
        sent.append(api_key)
        return "stored"

    return Agent("vault", "Keep keys.", [store_key])


VAULT_TURNS: list[Any] = [[("store_key", {"service": "openai", "api_key": SECRET})], "done"]


async def test_an_approved_call_whose_arguments_were_masked_is_never_sent() -> None:
    sent: list[str] = []
    store, idem, approvals = (
        MemoryCheckpointStore(),
        MemoryIdempotencyStore(),
        MemoryApprovalStore(),
    )

    def runner(provider: Any) -> AgentRunner:
        return AgentRunner(
            provider, idempotency=idem, checkpoints=Checkpointer(store), approvals=approvals
        )

    waiting = await runner(ScriptedProvider(VAULT_TURNS)).run(
        _vault(sent, approval=True), "keep it", tenant="acme", run_id="r"
    )
    assert waiting.status is RunStatus.waiting_approval
    assert waiting.pending_approval is not None
    await approvals.decide("acme", waiting.pending_approval.id, approved=True, by="ops")
    provider = _Recording(ScriptedProvider(VAULT_TURNS))
    run = await runner(provider).resume(_vault(sent, approval=True), "r", tenant="acme")
    assert run.status is RunStatus.completed
    assert sent == []
    [answer] = _answer_to(provider.requests[-1], "store_key")
    assert answer.is_error
    assert "not sent" in answer.text and "secret" in answer.text


async def test_a_masked_call_resolved_never_ran_is_answered_and_the_run_carries_on() -> None:
    sent: list[str] = []
    store, idem = MemoryCheckpointStore(), MemoryIdempotencyStore()

    def runner(provider: Any) -> AgentRunner:
        return AgentRunner(provider, idempotency=idem, checkpoints=Checkpointer(store))

    def dying(service: str, api_key: str) -> str:
        raise SimulatedCrash  # dies inside the tool, before any effect

    crashing = Agent(
        "vault",
        "Keep keys.",
        [tool(dying, name="store_key", description="Store an API key in the vault.")],
    )
    assert crashing.revision == _vault(sent, approval=False).revision
    with pytest.raises(SimulatedCrash):
        await runner(ScriptedProvider(VAULT_TURNS)).run(crashing, "keep", tenant="acme", run_id="r")
    with pytest.raises(IndeterminateToolCallError):
        await runner(ScriptedProvider(VAULT_TURNS)).resume(
            _vault(sent, approval=False), "r", tenant="acme"
        )
    [rec] = [r for r in await idem.records("acme", "r") if r.tool == "store_key"]
    await idem.resolve(rec.key, tenant="acme", never_ran=True, by="ops")
    provider = _Recording(ScriptedProvider(VAULT_TURNS))
    run = await runner(provider).resume(_vault(sent, approval=False), "r", tenant="acme")
    assert run.status is RunStatus.completed
    assert sent == []
    [answer] = _answer_to(provider.requests[-1], "store_key")
    assert answer.is_error and "not sent" in answer.text


async def test_a_masked_call_that_was_never_claimed_is_answered_not_sent() -> None:
    sent: list[str] = []
    store = FaultyCheckpointStore(MemoryCheckpointStore(), crash_after=_at("after_model_call", 0))
    idem = MemoryIdempotencyStore()

    def runner() -> AgentRunner:
        return AgentRunner(
            ScriptedProvider(VAULT_TURNS), idempotency=idem, checkpoints=Checkpointer(store)
        )

    with pytest.raises(SimulatedCrash):
        await runner().run(_vault(sent, approval=False), "keep", tenant="acme", run_id="r")
    store.crash_after = None
    run = await runner().resume(_vault(sent, approval=False), "r", tenant="acme")
    assert run.status is RunStatus.completed
    assert sent == []


# --- 5. a lost reply is read back ---------------------------------------------------------


async def test_a_claim_whose_reply_was_lost_is_read_back_and_sent_once(
    airline: Airline, idempotency: IdempotencyStore
) -> None:
    faulty = FaultyIdempotencyStore(idempotency)
    faulty.lose_claim_replies = 2  # search and book_seat
    runner = AgentRunner(
        ScriptedProvider(BOOK_TURNS),
        idempotency=faulty,
        checkpoints=Checkpointer(MemoryCheckpointStore()),
    )
    run = await runner.run(booking_agent(airline), "book", tenant="acme", run_id="r")
    assert run.status is RunStatus.completed
    assert airline.bookings == ["LH123"]


async def test_a_complete_whose_reply_was_lost_is_read_back(
    airline: Airline, idempotency: IdempotencyStore
) -> None:
    faulty = FaultyIdempotencyStore(idempotency)
    faulty.lose_complete_replies = 2
    runner = AgentRunner(ScriptedProvider(BOOK_TURNS), idempotency=faulty)
    run = await runner.run(booking_agent(airline), "book", tenant="acme", run_id="r")
    assert run.status is RunStatus.completed
    assert airline.bookings == ["LH123"]


async def test_a_claim_that_never_reached_the_store_stops_the_run_resumably(
    airline: Airline, idempotency: IdempotencyStore
) -> None:
    faulty = FaultyIdempotencyStore(idempotency)
    store = MemoryCheckpointStore()

    def runner() -> AgentRunner:
        return AgentRunner(
            ScriptedProvider(BOOK_TURNS), idempotency=faulty, checkpoints=Checkpointer(store)
        )

    faulty.fail_claims = 100
    with pytest.raises(StoreUnavailableError) as err:
        await runner().run(booking_agent(airline), "book", tenant="acme", run_id="r")
    assert err.value.retryable
    assert airline.bookings == []
    faulty.fail_claims = 0
    run = await runner().resume(booking_agent(airline), "r", tenant="acme")
    assert run.status is RunStatus.completed
    assert airline.bookings == ["LH123"]


# --- 6. sync tools run in a worker thread -------------------------------------------------


async def test_a_sync_tool_runs_off_the_event_loop() -> None:
    seen: dict[str, Any] = {}
    ticks = 0

    @tool(side_effects=False)
    def slow_lookup(code: str) -> str:
        """A blocking lookup."""
        seen["thread"] = threading.current_thread()
        time.sleep(0.3)
        return code

    @tool(side_effects=False, inline=True)
    def quick_lookup(code: str) -> str:
        """A lookup that must run on the loop's thread."""
        seen["inline"] = threading.current_thread()
        return code

    async def tick() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    agent = Agent("lookups", "Look up.", [slow_lookup, quick_lookup])
    turns: list[Any] = [[("slow_lookup", {"code": "a"}), ("quick_lookup", {"code": "b"})], "ok"]
    runner = AgentRunner(ScriptedProvider(turns), idempotency=MemoryIdempotencyStore())
    ticker = asyncio.ensure_future(tick())
    try:
        await runner.run(agent, "go", tenant="acme")
    finally:
        ticker.cancel()
    assert seen["thread"] is not threading.main_thread()
    assert seen["inline"] is threading.main_thread()
    assert ticks > 5  # the loop kept turning while the sync tool blocked


async def test_a_blocking_sync_tool_longer_than_the_lease_ttl_keeps_the_lease(
    airline: Airline,
) -> None:
    @tool
    def book_seat(flight: str) -> str:
        """Book a seat (a slow, blocking HTTP call)."""
        time.sleep(0.8)
        airline.bookings.append(flight)
        return "booked"

    agent = Agent("booking", "Book.", [book_seat])
    turns: list[Any] = [[("book_seat", {"flight": "LH123"})], "done"]
    runner = AgentRunner(
        ScriptedProvider(turns),
        idempotency=MemoryIdempotencyStore(),
        checkpoints=Checkpointer(MemoryCheckpointStore()),
        leases=MemoryLeaseStore(),
        lease_policy=LeasePolicy(ttl=0.5, renew_within=0.3),
    )
    run = await runner.run(agent, "book", tenant="acme", run_id="r")
    assert run.status is RunStatus.completed
    assert airline.bookings == ["LH123"]


# --- 7. smaller promises -------------------------------------------------------------------


class _Failing:
    def __init__(self, exc: BaseException, turns: list[Any]) -> None:
        self.exc: BaseException | None = exc
        self.inner = ScriptedProvider(turns)

    async def complete(self, request: ModelRequest) -> ModelResponse:
        if self.exc is not None and request.iteration == 1:
            raise self.exc
        return await self.inner.complete(request)


async def test_a_transient_non_kit_provider_error_is_retryable_and_the_run_resumable(
    airline: Airline,
) -> None:
    store, idem = MemoryCheckpointStore(), MemoryIdempotencyStore()
    provider = _Failing(ConnectionResetError("peer reset"), BOOK_TURNS)

    def runner() -> AgentRunner:
        return AgentRunner(provider, idempotency=idem, checkpoints=Checkpointer(store))

    with pytest.raises(Exception) as err:
        await runner().run(booking_agent(airline), "book", tenant="acme", run_id="r")
    assert getattr(err.value, "retryable", False) is True
    cp = await Checkpointer(store).latest("acme", "r")
    assert cp is not None and cp.status is CheckpointStatus.running
    provider.exc = None
    run = await runner().resume(booking_agent(airline), "r", tenant="acme")
    assert run.status is RunStatus.completed


async def test_a_providers_configuration_error_is_not_saved_as_a_failed_run(
    airline: Airline,
) -> None:
    store = MemoryCheckpointStore()
    provider = _Failing(ConfigurationError("model 'gpt-9' is not a model name"), BOOK_TURNS)
    runner = AgentRunner(
        provider, idempotency=MemoryIdempotencyStore(), checkpoints=Checkpointer(store)
    )
    with pytest.raises(ConfigurationError):
        await runner.run(booking_agent(airline), "book", tenant="acme", run_id="r")
    cp = await Checkpointer(store).latest("acme", "r")
    assert cp is not None and cp.status is CheckpointStatus.running


async def test_an_unkeyed_call_whose_frontier_is_too_large_says_why_and_is_not_retryable() -> None:
    sent: list[str] = []

    @tool(key=None)
    def send_email(to: str, body: str) -> str:
        """Send an email."""
        sent.append(to)
        return "sent"

    agent = Agent("mailer", "Mail.", [send_email])
    turns: list[Any] = [[("send_email", {"to": "a@example.com", "body": "x" * 20_000})], "ok"]
    runner = AgentRunner(
        ScriptedProvider(turns),
        idempotency=MemoryIdempotencyStore(),
        checkpoints=Checkpointer(
            MemoryCheckpointStore(), history=MemoryHistoryStore(), max_bytes=8_000
        ),
    )
    with pytest.raises(Exception) as err:
        await runner.run(agent, "mail", tenant="acme", run_id="r")
    assert getattr(err.value, "retryable", True) is False
    assert "resumable" not in str(err.value)
    assert "too large" in str(err.value)
    assert sent == []


def test_resumer_requires_the_idempotency_store() -> None:
    param = inspect.signature(Resumer).parameters["idempotency"]
    assert param.default is inspect.Parameter.empty
    assert "None" not in str(param.annotation)


# --- issue 20: the lease is checked right before the tool runs -----------------------------


async def test_a_holder_that_stalls_after_its_claim_does_not_dispatch(airline: Airline) -> None:
    ttl = 0.3

    def stall(phase: str, op: str, key: str) -> None:
        # A SIGSTOP or a long GC pause right after the claim's reply: the loop is frozen.
        if phase == "after" and op == "claim" and airline.searches:
            time.sleep(ttl + 0.1)

    faulty = FaultyIdempotencyStore(MemoryIdempotencyStore(), hook=stall)
    runner = AgentRunner(
        ScriptedProvider(BOOK_TURNS),
        idempotency=faulty,
        checkpoints=Checkpointer(MemoryCheckpointStore()),
        leases=MemoryLeaseStore(),
        lease_policy=LeasePolicy(ttl=ttl, renew_within=0.2),
    )
    with pytest.raises(LeaseLostError):
        await runner.run(booking_agent(airline), "book", tenant="acme", run_id="r")
    assert airline.bookings == []


async def test_the_resume_claim_is_renewed_while_a_long_iteration_runs(airline: Airline) -> None:
    store = FaultyCheckpointStore(MemoryCheckpointStore(), crash_after=_at("after_model_call", 1))
    idem = MemoryIdempotencyStore()
    started = asyncio.Event()

    def runner() -> AgentRunner:
        return AgentRunner(
            ScriptedProvider(BOOK_TURNS),
            idempotency=idem,
            checkpoints=Checkpointer(store),
            resume_claim_ttl=0.3,
        )

    @tool(side_effects=False)
    def search_flights(origin: str, dest: str) -> list[str]:
        """Find flights."""
        return ["LH123"]

    @tool
    async def book_seat(flight: str) -> str:
        """Book one seat (slowly)."""
        started.set()
        await asyncio.sleep(0.9)
        airline.bookings.append(flight)
        return "booked"

    slow = Agent("booking", "Book.", [search_flights, book_seat])
    with pytest.raises(SimulatedCrash):
        await runner().run(slow, "book", tenant="acme", run_id="r")
    store.crash_after = None
    carrier = asyncio.ensure_future(runner().resume(slow, "r", tenant="acme"))
    await started.wait()
    await asyncio.sleep(0.5)  # past the claim's ttl, had it not been renewed
    with pytest.raises(ResumeConflictError):
        await runner().resume(slow, "r", tenant="acme")
    run = await carrier
    assert run.status is RunStatus.completed
    assert airline.bookings == ["LH123"]
    assert json.loads(json.dumps(run.output)) == "Booked LH123."


# --- 7b. an approval request orphaned by a death is reused -----------------------------------


async def test_a_request_orphaned_by_a_death_is_asked_again_under_the_same_id(
    airline: Airline,
) -> None:
    store = FaultyCheckpointStore(MemoryCheckpointStore(), crash_before=_at("before_approval", 1))
    idem, approvals = MemoryIdempotencyStore(), MemoryApprovalStore()

    def runner() -> AgentRunner:
        return AgentRunner(
            ScriptedProvider(BOOK_TURNS),
            idempotency=idem,
            checkpoints=Checkpointer(store),
            approvals=approvals,
        )

    agent = booking_agent(airline, approval=True)
    with pytest.raises(SimulatedCrash):
        await runner().run(agent, "book", tenant="acme", run_id="r")
    store.crash_before = None
    orphans = [r for r in approvals._requests.values() if r.run_id == "r"]
    assert len(orphans) == 1
    waiting = await runner().resume(agent, "r", tenant="acme")
    assert waiting.status is RunStatus.waiting_approval
    assert waiting.pending_approval is not None
    assert waiting.pending_approval.id == orphans[0].id
    assert len([r for r in approvals._requests.values() if r.run_id == "r"]) == 1


async def test_an_orphaned_request_decided_meanwhile_lets_the_resume_go_on(
    airline: Airline,
) -> None:
    store = FaultyCheckpointStore(MemoryCheckpointStore(), crash_before=_at("before_approval", 1))
    idem, approvals = MemoryIdempotencyStore(), MemoryApprovalStore()

    def runner() -> AgentRunner:
        return AgentRunner(
            ScriptedProvider(BOOK_TURNS),
            idempotency=idem,
            checkpoints=Checkpointer(store),
            approvals=approvals,
        )

    agent = booking_agent(airline, approval=True)
    with pytest.raises(SimulatedCrash):
        await runner().run(agent, "book", tenant="acme", run_id="r")
    store.crash_before = None
    [orphan] = [r for r in approvals._requests.values() if r.run_id == "r"]
    await approvals.decide("acme", orphan.id, approved=True, by="ops")
    run = await runner().resume(agent, "r", tenant="acme")
    assert run.status is RunStatus.completed
    assert airline.bookings == ["LH123"]


async def test_from_stores_wires_every_store_of_a_bundle(airline: Airline, tmp_path: Path) -> None:
    stores = open_stores(f"sqlite:///{tmp_path}/adk.sqlite3")
    await stores.create_schema()
    async with stores:
        runner = AgentRunner.from_stores(
            ScriptedProvider(BOOK_TURNS), stores, worker="w7", policy=ONLY_TOOL_RESULTS
        )
        assert runner.checkpoints is not None
        assert runner.checkpoints.history is stores.history
        assert runner.checkpoints.policy == ONLY_TOOL_RESULTS
        assert (runner.leases, runner.ledger, runner.approvals, runner.idempotency) == (
            stores.leases,
            stores.ledger,
            stores.approvals,
            stores.idempotency,
        )
        run = await runner.run(booking_agent(airline), "book", tenant="acme", run_id="r")
        assert run.status is RunStatus.completed
        assert run.fence is not None
        lease_holder = [r.holder for r in await stores.idempotency.records("acme", "r")]
        assert all(h.startswith("w7-") for h in lease_holder)


# --- issue 12: hostile ids and arguments get a typed error ------------------------------------


@pytest.mark.parametrize(
    ("tenant", "run_id", "why"),
    [
        ("acme", "", "empty"),
        ("", "r", "empty"),
        ("acme", "r\ud800", "surrogate"),
        ("acme", "r" * 2000, "longer"),
    ],
)
async def test_a_hostile_run_id_or_tenant_is_refused_before_anything_is_written(
    airline: Airline, tenant: str, run_id: str, why: str
) -> None:
    store = MemoryCheckpointStore()
    runner = AgentRunner(
        ScriptedProvider(BOOK_TURNS),
        idempotency=MemoryIdempotencyStore(),
        checkpoints=Checkpointer(store),
    )
    with pytest.raises(ConfigurationError, match=why):
        await runner.run(booking_agent(airline), "book", tenant=tenant, run_id=run_id)
    with pytest.raises(ConfigurationError, match=why):
        await runner.resume(booking_agent(airline), run_id, tenant=tenant)
    assert airline.searches == 0


async def test_arguments_nested_too_deep_are_refused_not_sent_and_the_run_carries_on() -> None:
    sent: list[Any] = []

    @tool
    def store_tree(tree: Any) -> str:
        """Store a tree."""
        sent.append(tree)
        return "stored"

    deep: Any = "leaf"
    for _ in range(5000):
        deep = {"child": deep}
    agent = Agent("trees", "Store trees.", [store_tree])
    turns: list[Any] = [[("store_tree", {"tree": deep})], "done"]
    store = MemoryCheckpointStore()
    provider = _Recording(ScriptedProvider(turns))
    runner = AgentRunner(
        provider,
        idempotency=MemoryIdempotencyStore(),
        checkpoints=Checkpointer(store, history=MemoryHistoryStore()),
    )
    run = await runner.run(agent, "store", tenant="acme", run_id="r")
    assert run.status is RunStatus.completed
    assert sent == []
    [answer] = _answer_to(provider.requests[-1], "store_tree")
    assert answer.is_error and "nest" in answer.text
    cp = await Checkpointer(store).latest("acme", "r")
    assert cp is not None and not cp.is_tombstone


async def test_a_resume_claim_whose_reply_was_lost_is_read_back(airline: Airline) -> None:
    store = FaultyCheckpointStore(MemoryCheckpointStore(), crash_after=_at("after_model_call", 1))
    idem = MemoryIdempotencyStore()

    class LosesTheRunClaimReply:
        """The run's resume claim is applied, then its reply is lost (once)."""

        lost = False

        def __getattr__(self, name: str) -> Any:
            return getattr(idem, name)

        async def claim(self, key: str, **kwargs: Any) -> Any:
            record = await idem.claim(key, **kwargs)
            if kwargs.get("tool") is None and not self.lost:
                self.lost = True
                raise StoreReplyLostError("applied; the reply was lost")
            return record

    def runner(idempotency: Any) -> AgentRunner:
        return AgentRunner(
            ScriptedProvider(BOOK_TURNS), idempotency=idempotency, checkpoints=Checkpointer(store)
        )

    with pytest.raises(SimulatedCrash):
        await runner(idem).run(booking_agent(airline), "book", tenant="acme", run_id="r")
    store.crash_after = None
    run = await runner(LosesTheRunClaimReply()).resume(booking_agent(airline), "r", tenant="acme")
    assert run.status is RunStatus.completed
    assert airline.bookings == ["LH123"]


async def test_an_approval_request_rewritten_in_its_store_is_never_acted_on(
    airline: Airline,
) -> None:
    store, idem, approvals = (
        MemoryCheckpointStore(),
        MemoryIdempotencyStore(),
        MemoryApprovalStore(),
    )

    def runner() -> AgentRunner:
        return AgentRunner(
            ScriptedProvider(BOOK_TURNS),
            idempotency=idem,
            checkpoints=Checkpointer(store),
            approvals=approvals,
        )

    agent = booking_agent(airline, approval=True)
    waiting = await runner().run(agent, "book", tenant="acme", run_id="r")
    assert waiting.pending_approval is not None
    request_id = waiting.pending_approval.id
    await approvals.decide("acme", request_id, approved=True, by="ops")
    # Damage or a hand edit: the stored request now shows another flight.
    stored = approvals._requests[request_id]
    [call] = stored.calls
    approvals._requests[request_id] = dataclasses.replace(
        stored, calls=(dataclasses.replace(call, arguments={"flight": "XX999"}),)
    )
    with pytest.raises(CheckpointCorruptError, match="approval request"):
        await runner().resume(agent, "r", tenant="acme")
    assert airline.bookings == []


async def test_a_renewal_that_cannot_reach_the_store_keeps_the_resume_claim(
    airline: Airline,
) -> None:
    store = FaultyCheckpointStore(MemoryCheckpointStore(), crash_after=_at("after_model_call", 1))
    idem = MemoryIdempotencyStore()
    held: list[bool] = []

    class RenewalsFail:
        """Every resume claim after the first never reaches the store."""

        claims = 0

        def __getattr__(self, name: str) -> Any:
            return getattr(idem, name)

        async def claim(self, key: str, **kwargs: Any) -> Any:
            if kwargs.get("tool") is None:
                self.claims += 1
                if self.claims > 1:
                    raise StoreUnavailableError("the store is down (simulated)")
            return await idem.claim(key, **kwargs)

    @tool(side_effects=False)
    def search_flights(origin: str, dest: str) -> list[str]:
        """Find flights."""
        return ["LH123"]

    @tool
    async def book_seat(flight: str) -> str:
        """Book one seat (while the claim's renewals fail, within the claim's ttl)."""
        await asyncio.sleep(1.5)
        key = run_claim_key("acme", "r")
        held.append(key in await idem.lookup([key], tenant="acme"))
        airline.bookings.append(flight)
        return "booked"

    agent = Agent("booking", "Book.", [search_flights, book_seat])

    def runner(idempotency: Any) -> AgentRunner:
        return AgentRunner(
            ScriptedProvider(BOOK_TURNS),
            idempotency=idempotency,
            checkpoints=Checkpointer(store),
            resume_claim_ttl=30.0,
        )

    with pytest.raises(SimulatedCrash):
        await runner(idem).run(agent, "book", tenant="acme", run_id="r")
    store.crash_after = None
    fast = runner(RenewalsFail())
    fast.resume_claim_ttl = 3.0  # renewals every 1 s, all failing
    run = await fast.resume(agent, "r", tenant="acme")
    assert run.status is RunStatus.completed
    assert held == [True]
