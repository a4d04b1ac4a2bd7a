"""Attacks on the runner's first promise, tried as a careful user and as an attacker would.

Each test names what the kit must do; those marked DEFECT failed on the runner package as
first written (the report of the attack names the cause), the others are regressions of
attacks it withstood.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from booking import BOOK_TURNS, Airline, booking_agent
from run.helpers import Recording as _Recording
from run.helpers import answers as _answers
from run.helpers import at as _at
from tesserix_adk import (
    Agent,
    AgentRunner,
    Boundary,
    Checkpointer,
    CheckpointPolicy,
    ConfigurationError,
    IndeterminateToolCallError,
    LeaseLostError,
    LeasePolicy,
    MemoryApprovalStore,
    MemoryCheckpointStore,
    MemoryIdempotencyStore,
    MemoryLeaseStore,
    Message,
    ModelRequest,
    ModelResponse,
    NoCheckpointError,
    ResumeConflictError,
    RunStatus,
    ScriptedProvider,
    StoreUnavailableError,
    ToolCall,
    ToolContext,
    ToolOutcome,
    tool,
)
from tesserix_adk.checkpoint.payload import encode_outcome
from tesserix_adk.checkpoint.redaction import Redactor
from tesserix_adk.errors import LeaseHeldError
from tesserix_adk.run import run_claim_key
from tesserix_adk.stores import open_stores
from tesserix_adk.testing import FakeClock
from tesserix_adk.testing.faults import (
    FaultyCheckpointStore,
    FaultyIdempotencyStore,
    SimulatedCrash,
)

ONLY_TOOL_RESULTS = CheckpointPolicy(boundaries=frozenset({Boundary.after_tool_result}))

# A deadline for a hang, never a measure of speed: a run that should take milliseconds.
HANG = 5.0


# --- a sync tool that raises StopIteration ---------------------------------------------


async def test_a_sync_tool_raising_stop_iteration_is_an_error_outcome_not_a_hang() -> None:
    """DEFECT. ``next(iter([]))`` in a sync tool is an ordinary bug; asyncio cannot put a
    StopIteration into a future, so ``asyncio.to_thread`` never resolves and the run hangs
    for ever (renewing its lease for ever). SPEC §2: an ``Exception`` raised by a tool is
    that call's error outcome."""

    @tool(side_effects=False)
    def first_flight(dest: str) -> str:
        """The first flight to a destination."""
        return str(next(iter([])))

    agent = Agent("flights", "Find.", [first_flight])
    provider = _Recording(ScriptedProvider([[("first_flight", {"dest": "JFK"})], "none"]))
    runner = AgentRunner(provider, idempotency=MemoryIdempotencyStore())
    run = await asyncio.wait_for(runner.run(agent, "go", tenant="acme", run_id="r"), HANG)
    assert run.status is RunStatus.completed
    [answer] = _answers(provider.requests[-1], "first_flight")
    assert answer.is_error and "StopIteration" in answer.text


# --- approvals: dying between the request and its frontier -----------------------------


class _CountingApprovals:
    """The approval store, with every request it was asked to record."""

    def __init__(self) -> None:
        self.inner = MemoryApprovalStore()
        self.requested: list[str] = []

    async def request(
        self,
        tenant: str,
        run_id: str,
        calls: Sequence[ToolCall],
        *,
        iteration: int,
        fence: int | None = None,
        id: str | None = None,
    ) -> Any:
        request = await self.inner.request(
            tenant, run_id, calls, iteration=iteration, fence=fence, id=id
        )
        self.requested.append(request.id)
        return request

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class _FreshCallIds:
    """A model that, like a real one, gives every tool call a new id each time it is asked."""

    def __init__(self, turns: list[Any]) -> None:
        self.inner = ScriptedProvider(turns)
        self.asked = 0

    async def complete(self, request: ModelRequest) -> ModelResponse:
        self.asked += 1
        response: ModelResponse = await self.inner.complete(request)
        message = response.message
        calls = [
            ToolCall(id=f"toolu_{self.asked}_{i}", name=c.name, arguments=c.arguments)
            for i, c in enumerate(message.tool_calls)
        ]
        return ModelResponse(
            message=Message.assistant(message.text, calls),
            usage=response.usage,
            cost_micros=response.cost_micros,
        )


async def test_a_request_orphaned_by_a_death_is_found_again_when_the_model_is_asked_again(
    airline: Airline,
) -> None:
    """DEFECT (issue 11 point 7). The process dies after the approval request was recorded
    and before the ``before_approval`` frontier; the operator approves the request they
    were shown. With a policy that skips ``after_model_call`` the resume asks the model
    again, and a real model names its calls with new ids: the request must still be found
    (keyed like the calls, by what is asked, never by the provider's call ids — SPEC §3
    "Default key"), not asked again under a new id nobody will ever decide."""
    store = FaultyCheckpointStore(MemoryCheckpointStore(), crash_before=_at("before_approval", 1))
    approvals = _CountingApprovals()
    idem = MemoryIdempotencyStore()

    def runner() -> AgentRunner:
        return AgentRunner(
            _FreshCallIds(BOOK_TURNS),
            idempotency=idem,
            checkpoints=Checkpointer(store, policy=ONLY_TOOL_RESULTS),
            approvals=approvals,  # type: ignore[arg-type]
        )

    agent = booking_agent(airline, approval=True)
    with pytest.raises(SimulatedCrash):
        await runner().run(agent, "book", tenant="acme", run_id="r")
    [orphan] = approvals.requested
    await approvals.inner.decide("acme", orphan, approved=True, by="ops")
    store.crash_before = None
    run = await runner().resume(agent, "r", tenant="acme")
    assert set(approvals.requested) == {orphan}
    assert run.status is RunStatus.completed
    assert airline.bookings == ["LH123"]


# --- run() retried when no frontier could be written -----------------------------------


class _Flaky:
    """A model that fails once at one iteration and answers a different script after."""

    def __init__(self, first: list[Any], then: list[Any], *, fail_at: int) -> None:
        self.first = ScriptedProvider(first)
        self.then = ScriptedProvider(then)
        self.fail_at = fail_at
        self.failed = False

    async def complete(self, request: ModelRequest) -> ModelResponse:
        if not self.failed:
            if request.iteration == self.fail_at:
                self.failed = True
                raise ConnectionResetError("peer reset")
            return await self.first.complete(request)
        return await self.then.complete(request)


async def test_run_retried_after_an_unwritable_frontier_does_not_book_a_different_seat(
    airline: Airline,
) -> None:
    """DEFECT. The checkpoint store is down (a checkpoint failure never fails the live run,
    SPEC §1.3), so no frontier exists; the seat is booked, then the model is unreachable
    (retryable). ``resume`` has nothing to read, so the caller retries ``run``: that
    attempt ignores the records the first one left and, when the (non-deterministic)
    model now asks for another seat, books it. SPEC §3 calls records past the frontier
    "ahead" and a turn asking for other side effects than those that ran "diverged":
    refuse before dispatching, never a second booking."""
    store = FaultyCheckpointStore(
        MemoryCheckpointStore(), fail_with=StoreUnavailableError("checkpoint store down")
    )
    other = [BOOK_TURNS[0], [("book_seat", {"flight": "UA456"})], "Booked UA456."]
    provider = _Flaky(BOOK_TURNS, other, fail_at=2)
    runner = AgentRunner(
        provider, idempotency=MemoryIdempotencyStore(), checkpoints=Checkpointer(store)
    )
    agent = booking_agent(airline)
    with pytest.raises(Exception) as first:
        await runner.run(agent, "book", tenant="acme", run_id="r")
    assert getattr(first.value, "retryable", False) is True
    assert airline.bookings == ["LH123"]
    store.fail_with = None
    try:
        await runner.run(agent, "book", tenant="acme", run_id="r")
    except Exception as exc:
        assert getattr(exc, "retryable", True) is False
    assert airline.bookings == ["LH123"]


# --- twin calls and custom key functions -----------------------------------------------


async def test_twin_calls_are_two_calls_with_a_key_function_taking_keyword_arguments(
    airline: Airline,
) -> None:
    """DEFECT. A key function written as ``def key(**kw)`` (the KeyFunction protocol's
    keywords, no ``occurrence``) is taken to honour ``occurrence`` because it accepts any
    keyword, so twin calls share its key: the second seat is never booked and the model is
    told it was. SPEC §10: two identical calls in one turn are two calls."""

    def by_flight(**kw: Any) -> str:
        return f"{kw['run_id']}:{kw['iteration']}:{kw['tool']}:{kw['arguments']['flight']}"

    @tool(key=by_flight)
    def book_seat(flight: str) -> str:
        """Book one seat."""
        airline.bookings.append(flight)
        return f"booked seat {len(airline.bookings)}"

    agent = Agent("booking", "Book.", [book_seat])
    turns: list[Any] = [
        [("book_seat", {"flight": "LH123"}), ("book_seat", {"flight": "LH123"})],
        "Booked two seats.",
    ]
    provider = _Recording(ScriptedProvider(turns))
    runner = AgentRunner(provider, idempotency=MemoryIdempotencyStore())
    run = await runner.run(agent, "two seats", tenant="acme", run_id="r")
    assert run.status is RunStatus.completed
    assert airline.bookings == ["LH123", "LH123"]
    answers = [m.text for m in _answers(provider.requests[-1], "book_seat")]
    assert sorted(answers) == ["booked seat 1", "booked seat 2"]


# --- a turn asked again after dying between its calls ----------------------------------


async def test_a_turn_asked_again_after_dying_between_its_calls_carries_on(
    airline: Airline,
) -> None:
    """DEFECT (or a SPEC §3 wording to revisit). With a policy that skips
    ``after_model_call``, the process dies after the first of a turn's two bookings and
    before the second was claimed. The resumed model asks for exactly the same turn: the
    first is replayed, the second never ran and is sent once. Nothing that happened is
    hidden from the model, so nothing diverged; yet the runner refuses for ever
    (``DivergedRunError``, exit 4) because the second call's key is not among the completed
    ones. A run that can finish must."""
    store = MemoryCheckpointStore()
    idem = MemoryIdempotencyStore()
    turns: list[Any] = [
        BOOK_TURNS[0],
        [("book_seat", {"flight": "LH123"}), ("book_seat", {"flight": "UA456"})],
        "Booked both.",
    ]

    def runner() -> AgentRunner:
        return AgentRunner(
            ScriptedProvider(turns),
            idempotency=idem,
            checkpoints=Checkpointer(store, policy=ONLY_TOOL_RESULTS),
        )

    def die_after_first(stage: str) -> None:
        if stage == "after" and airline.bookings == ["LH123"]:
            raise SimulatedCrash

    airline.hook = die_after_first
    with pytest.raises(SimulatedCrash):
        await runner().run(booking_agent(airline), "book both", tenant="acme", run_id="r")
    airline.hook = None
    # The first booking's outcome was never recorded (death inside the tool): the
    # operator checks the airline and records it.
    [rec] = [r for r in await idem.records("acme", "r") if r.tool == "book_seat"]
    booked = encode_outcome(ToolOutcome(call_id="-", content="booked"), Redactor())
    await idem.resolve(rec.key, booked, tenant="acme", by="ops")
    run = await runner().resume(booking_agent(airline), "r", tenant="acme")
    assert run.status is RunStatus.completed
    assert airline.bookings == ["LH123", "UA456"]


# --- a claim the lease check stopped before dispatch ----------------------------------


async def test_a_call_stopped_by_the_lease_check_before_dispatch_is_not_left_in_doubt(
    airline: Airline,
) -> None:
    """DEFECT. The holder stalls right after its claim; the lease check before the tool
    (issue 20 1a) rightly stops it with nothing sent. But the claim stays in flight under
    that holder, so every later resume refuses, naming ``book_seat`` as a call nobody can
    decide — although the only attempt that could have sent it knows it did not. Every
    refusal names exactly the calls in doubt; this one is not."""
    ttl = 0.3

    def stall(phase: str, op: str, key: str) -> None:
        if phase == "after" and op == "claim" and airline.searches:
            time.sleep(ttl + 0.1)

    store, idem = MemoryCheckpointStore(), MemoryIdempotencyStore()
    leases = MemoryLeaseStore()

    def runner(hook: Any) -> AgentRunner:
        return AgentRunner(
            ScriptedProvider(BOOK_TURNS),
            idempotency=FaultyIdempotencyStore(idem, hook=hook),
            checkpoints=Checkpointer(store),
            leases=leases,
            lease_policy=LeasePolicy(ttl=ttl, renew_within=0.2),
        )

    with pytest.raises(LeaseLostError):
        await runner(stall).run(booking_agent(airline), "book", tenant="acme", run_id="r")
    assert airline.bookings == []
    await asyncio.sleep(ttl + 0.1)  # the stale lease lapses by the store's clock
    run = await runner(None).resume(booking_agent(airline), "r", tenant="acme")
    assert run.status is RunStatus.completed
    assert airline.bookings == ["LH123"]


# --- a lost claim reply that cannot be read back ---------------------------------------


async def test_a_claim_given_up_as_not_dispatched_is_not_called_in_doubt_by_the_retry(
    airline: Airline,
) -> None:
    """DEFECT. The claim of ``book_seat`` is applied but its reply is lost, and reading
    the record back fails too: the run stops with a retryable error saying the call "was
    not dispatched". The caller retries on the same runner, and that attempt refuses with
    ``IndeterminateToolCallError`` ("nobody can say whether it ran"), non-retryable, for a
    call the kit itself said it did not send. A retryable stop must leave the run
    resumable (SPEC §2), and a refusal must name only calls in doubt."""
    store = MemoryCheckpointStore()
    reads_fail = False

    def lookups_fail(phase: str, op: str, key: str) -> None:
        if phase == "before" and op == "lookup" and reads_fail:
            raise StoreUnavailableError("lookup never reached the store (simulated)")

    faulty = FaultyIdempotencyStore(MemoryIdempotencyStore(), hook=lookups_fail)
    runner = AgentRunner(
        ScriptedProvider(BOOK_TURNS), idempotency=faulty, checkpoints=Checkpointer(store)
    )
    agent = booking_agent(airline)

    def lose_the_booking_claim(phase: str, op: str, key: str) -> None:
        nonlocal reads_fail
        lookups_fail(phase, op, key)
        if phase == "before" and op == "claim" and airline.searches:
            faulty.lose_claim_replies = 1
            reads_fail = True

    faulty.hook = lose_the_booking_claim
    with pytest.raises(StoreUnavailableError) as first:
        await runner.run(agent, "book", tenant="acme", run_id="r")
    assert first.value.retryable
    assert "not dispatched" in str(first.value)
    assert airline.bookings == []
    faulty.hook = None
    reads_fail = False
    run = await runner.resume(agent, "r", tenant="acme")
    assert run.status is RunStatus.completed
    assert airline.bookings == ["LH123"]


# --- custom key functions --------------------------------------------------------------


def _by_order(*, tenant: str, run_id: str, iteration: int, tool: str, arguments: Any) -> Any:
    """A business key: the order, so the payment provider deduplicates by it."""
    return arguments["order"]


async def test_a_key_function_returning_a_non_string_is_a_typed_error_before_any_dispatch() -> None:
    """DEFECT. A key function returns the order number, an ``int`` (KeyFunction returns
    ``str``). The runner claims and sends the payment under it and writes a frontier that
    no reader accepts: every resume then says the frontier is *corrupt*
    (``CheckpointCorruptError``), which sends the operator after a storage fault. Bad
    input must be a typed error (``ConfigurationError``) before anything is sent."""
    paid: list[int] = []

    @tool(key=_by_order)
    def pay(order: int) -> str:
        """Pay an order."""
        paid.append(order)
        return "paid"

    agent = Agent("shop", "Pay.", [pay])
    runner = AgentRunner(
        ScriptedProvider([[("pay", {"order": 5})], "done"]),
        idempotency=MemoryIdempotencyStore(),
        checkpoints=Checkpointer(MemoryCheckpointStore()),
    )
    with pytest.raises(ConfigurationError, match="key"):
        await runner.run(agent, "pay", tenant="acme", run_id="r")
    assert paid == []


async def test_a_key_that_ignores_the_tenant_never_hands_one_tenant_another_tenants_outcome() -> (
    None
):
    """DEFECT. A business key (``f"order-{n}"``) that does not name the tenant: tenant
    ``globex`` pays its order 5 after tenant ``acme`` paid theirs. The record of ``acme``
    answers ``globex``'s call: ``globex`` is never charged, and its model is told
    ``acme``'s receipt. SPEC §10: the idempotency protocol is tenant-scoped, records are
    keyed by (tenant, key)."""
    paid: list[tuple[str, int]] = []

    def order_key(**kw: Any) -> str:
        return f"order-{kw['arguments']['order']}"

    @tool(key=order_key)
    def pay(order: int, ctx: ToolContext) -> str:
        """Pay an order."""
        paid.append((ctx.tenant, order))
        return f"receipt for {ctx.tenant}"

    agent = Agent("shop", "Pay.", [pay])
    idem = MemoryIdempotencyStore()
    turns: list[Any] = [[("pay", {"order": 5})], "done"]
    for tenant in ("acme", "globex"):
        provider = _Recording(ScriptedProvider(turns))
        runner = AgentRunner(provider, idempotency=idem)
        await runner.run(agent, "pay", tenant=tenant, run_id="r")
        [answer] = _answers(provider.requests[-1], "pay")
        assert answer.text == f"receipt for {tenant}"
    assert paid == [("acme", 5), ("globex", 5)]


# --- the resume claim racing a second resumer ------------------------------------------


async def test_a_carrier_holding_the_lease_is_not_stopped_by_a_resumer_that_failed(
    airline: Airline,
) -> None:
    """DEFECT (issue 20 point 6, a window left). The carrier's resume claim lapses (the
    idempotency store was out longer than the claim's ttl, so renewals failed); a second
    resumer takes the claim, is refused by the lease and lets go. If the carrier's renewal
    lands in between, the carrier — which holds the lease, and which nobody else carries
    — stops with ``ResumeConflictError``. The claim only saves work (SPEC §3); with a
    lease store the lease decides who carries."""
    clock = FakeClock()
    idem = MemoryIdempotencyStore(clock=clock)
    store = FaultyCheckpointStore(MemoryCheckpointStore(), crash_after=_at("after_model_call", 1))
    leases = MemoryLeaseStore()

    def runner() -> AgentRunner:
        return AgentRunner(
            ScriptedProvider(BOOK_TURNS),
            idempotency=idem,
            checkpoints=Checkpointer(store),
            leases=leases,
            resume_claim_ttl=0.3,
        )

    @tool(side_effects=False)
    def search_flights(origin: str, dest: str) -> list[str]:
        """Find flights between two airports."""
        return ["LH123"]

    @tool
    async def book_seat(flight: str) -> str:
        """Book one seat on a flight."""
        if store.crash_after is None:  # the resumed carrier
            clock.advance(1.0)  # its claim lapsed while renewals could not get through
            key = run_claim_key("acme", "r")
            other = await idem.claim(
                key,
                holder="resumer-2",
                tenant="acme",
                run_id="r",
                iteration=None,
                tool=None,
                call_id=None,
                flags=None,
                ttl=0.3,
            )
            assert other.holder == "resumer-2"
            await asyncio.sleep(0.25)  # the carrier's renewal runs now
            await idem.release(
                key, tenant="acme", holder="resumer-2"
            )  # refused by the lease, it lets go
        airline.bookings.append(flight)
        return "booked"

    agent = Agent("booking", "Book the flight the user asks for.", [search_flights, book_seat])
    with pytest.raises(SimulatedCrash):
        await runner().run(agent, "book", tenant="acme", run_id="r")
    store.crash_after = None
    lapsed = await leases.current("acme", "r")
    assert lapsed is None  # the dead run's lease was released on the way out
    run = await runner().resume(agent, "r", tenant="acme")
    assert run.status is RunStatus.completed
    assert airline.bookings == ["LH123"]


# --- withstood: cancellation or death at every await, then retries on the same runner --


class _Trip:
    """Raises ``exc`` at the ``k``-th store call (before it reaches the store, or after)."""

    def __init__(self, k: int, *, after: bool, exc: type[BaseException]) -> None:
        self.k, self.after, self.exc = k, after, exc
        self.seen = 0
        self.tripped: str | None = None

    def tick(self, name: str, phase: str) -> None:
        if phase != ("after" if self.after else "before"):
            return
        self.seen += 1
        if self.seen == self.k:
            self.tripped = name
            raise self.exc()


class _Tripping:
    """Any store, every async method passing through a ``_Trip``."""

    def __init__(self, inner: Any, trip: _Trip, name: str) -> None:
        self._inner, self._trip, self._name = inner, trip, name

    def __getattr__(self, attr: str) -> Any:
        value = getattr(self._inner, attr)
        if attr.startswith("_") or not asyncio.iscoroutinefunction(value):
            return value

        async def tripping(*args: Any, **kwargs: Any) -> Any:
            self._trip.tick(f"{self._name}.{attr}", "before")
            result = await value(*args, **kwargs)
            self._trip.tick(f"{self._name}.{attr}", "after")
            return result

        return tripping


async def _carry_to_the_end(
    runner: AgentRunner, agent: Agent, idem: Any, airline: Airline
) -> list[str]:
    """Retry on the same runner as a careful operator would: wait out a held run, and
    settle each call a refusal names by what the airline truthfully holds."""
    seen: list[str] = []
    for _ in range(12):
        try:
            try:
                run = await runner.resume(agent, "r", tenant="acme")
            except NoCheckpointError:
                run = await runner.run(agent, "book", tenant="acme", run_id="r")
        except (ResumeConflictError, LeaseHeldError):
            seen.append("held")
            await asyncio.sleep(0.2)
            continue
        except LeaseLostError:
            # This attempt's own 0.3 s lease lapsed (a loaded machine): nothing went out
            # after it, and an operator tries again.
            seen.append("lost")
            continue
        except IndeterminateToolCallError as exc:
            for call in exc.calls:
                seen.append(f"in doubt: {call.tool}")
                assert call.tool == "book_seat", "only a side-effecting call is ever in doubt"
                assert call.key is not None
                if airline.bookings:
                    done = encode_outcome(ToolOutcome(call_id="-", content="booked"), Redactor())
                    await idem.resolve(call.key, done, tenant="acme", by="ops")
                else:
                    await idem.resolve(call.key, tenant="acme", never_ran=True, by="ops")
            continue
        seen.append(run.status.value)
        return seen
    raise AssertionError(f"the run never finished: {seen}")


@pytest.mark.parametrize("backend", ["memory", "sqlite"])
@pytest.mark.parametrize(
    ("after", "exc"),
    [(False, asyncio.CancelledError), (True, asyncio.CancelledError), (True, SimulatedCrash)],
    ids=["cancelled-before", "cancelled-after", "died-after"],
)
async def test_cancelled_or_dead_at_any_store_call_then_retried_books_once(
    backend: str, after: bool, exc: type[BaseException], tmp_path: Path
) -> None:
    for k in range(1, 200):
        airline = Airline()
        trip = _Trip(k, after=after, exc=exc)
        if backend == "memory":
            stores: Any = open_stores("memory://")
        else:
            stores = open_stores(f"sqlite:///{tmp_path}/k{k}.sqlite3")
            await stores.create_schema()
        async with stores:
            wrapped = {
                name: _Tripping(getattr(stores, name), trip, name)
                for name in ("checkpoints", "idempotency", "leases", "history", "ledger")
            }
            runner = AgentRunner(
                ScriptedProvider(BOOK_TURNS),
                idempotency=wrapped["idempotency"],
                checkpoints=Checkpointer(wrapped["checkpoints"], history=wrapped["history"]),
                leases=wrapped["leases"],
                ledger=wrapped["ledger"],
                lease_policy=LeasePolicy(ttl=0.3, renew_within=0.2),
                resume_claim_ttl=0.3,
            )
            agent = booking_agent(airline)
            with contextlib.suppress(BaseException):
                await runner.run(agent, "book", tenant="acme", run_id="r")
            if trip.tripped is None:
                break  # past the last store call of a whole run
            trip.k = -1
            await _carry_to_the_end(runner, agent, stores.idempotency, airline)
            assert airline.bookings == ["LH123"], f"tripped at {trip.tripped} (call {k})"
    assert trip.tripped is None, "the sweep never reached the end of the run"


# --- withstood: resumers racing ----------------------------------------------------------


async def test_resumers_racing_on_one_runner_and_on_two_carry_the_run_once(
    airline: Airline,
) -> None:
    store = FaultyCheckpointStore(MemoryCheckpointStore(), crash_after=_at("after_model_call", 1))
    idem, leases = MemoryIdempotencyStore(), MemoryLeaseStore()

    def runner() -> AgentRunner:
        return AgentRunner(
            ScriptedProvider(BOOK_TURNS),
            idempotency=idem,
            checkpoints=Checkpointer(store),
            leases=leases,
        )

    agent = booking_agent(airline)
    with pytest.raises(SimulatedCrash):
        await runner().run(agent, "book", tenant="acme", run_id="r")
    store.crash_after = None
    shared = runner()
    racers = [shared, shared, runner(), runner()]
    outcomes = await asyncio.gather(
        *(r.resume(agent, "r", tenant="acme") for r in racers), return_exceptions=True
    )
    finished = [o for o in outcomes if not isinstance(o, BaseException)]
    refused = [o for o in outcomes if isinstance(o, BaseException)]
    assert len(finished) == 1 and finished[0].status is RunStatus.completed
    assert all(isinstance(o, ResumeConflictError) for o in refused), refused
    assert airline.bookings == ["LH123"]
