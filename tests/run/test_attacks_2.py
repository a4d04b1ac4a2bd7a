"""A second attack on the runner, after the fixes of the first (tests/run/test_attacks.py).

Targets: ``release(undispatched=True)``, ``plan_without_frontier`` in a retried ``run()``,
relaxed divergence, approval ids made from call keys, and tenant-prefixed custom keys. Each
test names what the kit must do; those marked DEFECT fail on the code they were written
against (the attack's report names the cause), the others are attacks it withstood.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
from collections.abc import AsyncIterator, Sequence
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
    DivergedRunError,
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
    RunStatus,
    ScriptedProvider,
    StoreUnavailableError,
    ToolCall,
    ToolContext,
    tool,
)
from tesserix_adk.checkpoint.payload import encode_outcome
from tesserix_adk.checkpoint.redaction import Redactor
from tesserix_adk.cli import ExitCode, frontier_main
from tesserix_adk.messages import ToolOutcome
from tesserix_adk.stores import open_stores
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.stores.protocols import RecordStatus
from tesserix_adk.testing.faults import FaultyCheckpointStore, SimulatedCrash

ONLY_TOOL_RESULTS = CheckpointPolicy(boundaries=frozenset({Boundary.after_tool_result}))
HANG = 10.0


@contextlib.asynccontextmanager
async def _backend(name: str, tmp_path: Path) -> AsyncIterator[Stores]:
    if name == "memory":
        stores: Stores = open_stores("memory://")
        async with stores:
            yield stores
    elif name == "sqlite":
        stores = open_stores(f"sqlite:///{tmp_path}/x.db")
        await stores.create_schema()
        async with stores:
            yield stores
    elif name == "redis":
        from adapters.services import redis_stores

        async with redis_stores() as stores:
            yield stores
    else:
        from adapters.services import postgres_stores

        async with postgres_stores() as stores:
            yield stores


BACKENDS = ["memory", "sqlite", "redis", "postgres"]


class _FreshCallIds:
    """A model that, like a real one, gives every tool call a new id each time it is asked."""

    counter = 0

    def __init__(self, turns: list[Any]) -> None:
        self.inner = ScriptedProvider(turns)

    async def complete(self, request: ModelRequest) -> ModelResponse:
        _FreshCallIds.counter += 1
        response: ModelResponse = await self.inner.complete(request)
        message = response.message
        calls = [
            ToolCall(id=f"toolu_{_FreshCallIds.counter}_{i}", name=c.name, arguments=c.arguments)
            for i, c in enumerate(message.tool_calls)
        ]
        return ModelResponse(
            message=Message.assistant(message.text, calls),
            usage=response.usage,
            cost_micros=response.cost_micros,
        )


# --- approvals: a decision is about the call the operator saw ---------------------------


class _Approvals(MemoryApprovalStore):
    """The memory approval store, keeping the id of every request made."""

    def __init__(self) -> None:
        super().__init__()
        self.made: list[str] = []

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
        made = await super().request(tenant, run_id, calls, iteration=iteration, fence=fence, id=id)
        if made.id not in self.made:
            self.made.append(made.id)
        return made


def _order_key(**kw: Any) -> str:
    """A business key: the order, so the payment provider deduplicates by it."""
    return f"order-{kw['arguments']['order']}"


def _payments(paid: list[tuple[int, int]]) -> Agent:
    @tool(side_effects=False)
    def find_order(customer: str) -> int:
        """Find the customer's open order."""
        return 5

    @tool(key=_order_key, requires_approval=True)
    def pay(order: int, amount: int) -> str:
        """Pay an order."""
        paid.append((order, amount))
        return f"paid {amount}"

    return Agent("shop", "Pay.", [find_order, pay])


async def test_an_approval_is_never_spent_on_a_call_with_arguments_the_operator_never_saw() -> None:
    """DEFECT. The run asks to ``pay(order=5, amount=10)`` (a business key names only the
    order) and dies before its ``before_approval`` frontier. The operator approves the
    request they were shown: 10. Asked again, the model now wants ``amount=10000``: the
    key is the same, so the approval id is the same, the request is found approved and
    10 000 is paid with no person ever having seen it. An approval names the arguments it
    was given for; a call asking for other ones needs a decision of its own."""
    store = FaultyCheckpointStore(MemoryCheckpointStore(), crash_before=_at("before_approval", 1))
    approvals, idem = _Approvals(), MemoryIdempotencyStore()
    paid: list[tuple[int, int]] = []

    def runner(amount: int) -> AgentRunner:
        turns: list[Any] = [
            [("find_order", {"customer": "c1"})],
            [("pay", {"order": 5, "amount": amount})],
            "Paid.",
        ]
        return AgentRunner(
            _FreshCallIds(turns),
            idempotency=idem,
            checkpoints=Checkpointer(store, policy=ONLY_TOOL_RESULTS),
            approvals=approvals,
        )

    with pytest.raises(SimulatedCrash):
        await runner(10).run(_payments(paid), "pay my order", tenant="acme", run_id="r")
    [orphan_id] = approvals.made
    orphan = await approvals.get("acme", orphan_id)
    assert orphan is not None
    assert [c.arguments for c in orphan.calls] == [{"order": 5, "amount": 10}]
    await approvals.decide("acme", orphan.id, approved=True, by="ops")
    store.crash_before = None
    run = await runner(10000).resume(_payments(paid), "r", tenant="acme")
    assert paid == [], "10 000 was paid on an approval given for 10"
    assert run.status is RunStatus.waiting_approval
    assert run.pending_approval is not None
    assert [c.arguments for c in run.pending_approval.calls] == [{"order": 5, "amount": 10000}]


async def test_an_orphan_request_found_pending_and_decided_later_is_honoured(
    airline: Airline,
) -> None:
    """Withstood. The orphaned request (made under call ids a dead attempt's model gave)
    is found *pending* by the next attempt, whose model named the calls anew; its
    ``before_approval`` frontier lists the new ids. The operator then approves: the
    approved call must be sent once, not answered "not approved"."""
    store = FaultyCheckpointStore(MemoryCheckpointStore(), crash_before=_at("before_approval", 1))
    approvals, idem = _Approvals(), MemoryIdempotencyStore()

    def runner() -> AgentRunner:
        return AgentRunner(
            _FreshCallIds(BOOK_TURNS),
            idempotency=idem,
            checkpoints=Checkpointer(store, policy=ONLY_TOOL_RESULTS),
            approvals=approvals,
        )

    agent = booking_agent(airline, approval=True)
    with pytest.raises(SimulatedCrash):
        await runner().run(agent, "book", tenant="acme", run_id="r")
    store.crash_before = None
    waiting = await runner().resume(agent, "r", tenant="acme")
    assert waiting.status is RunStatus.waiting_approval
    assert waiting.pending_approval is not None
    assert approvals.made == [waiting.pending_approval.id]  # the orphan, found again
    await approvals.decide("acme", waiting.pending_approval.id, approved=True, by="ops")
    provider = _Recording(_FreshCallIds(BOOK_TURNS))
    resumer = AgentRunner(
        provider,
        idempotency=idem,
        checkpoints=Checkpointer(store, policy=ONLY_TOOL_RESULTS),
        approvals=approvals,
    )
    run = await resumer.resume(agent, "r", tenant="acme")
    assert run.status is RunStatus.completed
    assert airline.bookings == ["LH123"]
    [answer] = _answers(provider.requests[-1], "book_seat")
    assert not answer.is_error, answer.text


@pytest.mark.parametrize("backend", BACKENDS)
async def test_approval_ids_of_lookalike_tenants_and_runs_never_meet(
    backend: str, tmp_path: Path
) -> None:
    """Withstood. Runs whose tenant and run id join alike (``a:b``/``c``, ``a``/``b:c``,
    ``a/b``/``c``, ``a``/``b/c``) ask for the same call at the same turn: every request is
    its own, and a decision on one never answers another."""
    async with _backend(backend, tmp_path) as stores:
        seen: dict[str, tuple[str, str]] = {}
        for tenant, run_id in (("a:b", "c"), ("a", "b:c"), ("a/b", "c"), ("a", "b/c")):
            runner = AgentRunner.from_stores(ScriptedProvider(BOOK_TURNS), stores)
            run = await runner.run(
                booking_agent(Airline(), approval=True), "book", tenant=tenant, run_id=run_id
            )
            assert run.status is RunStatus.waiting_approval and run.pending_approval is not None
            rid = run.pending_approval.id
            assert rid not in seen, f"{(tenant, run_id)} met {seen[rid]}"
            seen[rid] = (tenant, run_id)
            if tenant == "a:b":
                await stores.approvals.decide(tenant, rid, approved=True, by="ops")
        for rid, (tenant, _) in seen.items():
            request = await stores.approvals.get(tenant, rid)
            assert request is not None
            assert (request.status.value == "approved") == (tenant == "a:b")


# --- release(undispatched=True): never drops a claim that another holder took -----------


@pytest.mark.parametrize("backend", BACKENDS)
async def test_an_unsent_release_never_drops_a_claim_taken_over_since(
    backend: str, tmp_path: Path
) -> None:
    """Withstood. Holder A claims, stalls; a resumer B takes the claim over (safe tool) and
    sends. A's lease check then stops it and it releases its claim as unsent: B's claim
    must stand, and so must a completed record and another run's claim."""
    async with _backend(backend, tmp_path) as stores:
        idem = stores.idempotency
        common: dict[str, Any] = {
            "tenant": "acme",
            "run_id": "r",
            "iteration": 1,
            "tool": "search_flights",
            "call_id": "c1",
            "flags": None,
        }
        await idem.claim("k-1", holder="A", **common)
        taken = await idem.claim("k-1", holder="B", takeover=True, **common)
        assert taken.holder == "B"
        await idem.release("k-1", tenant="acme", holder="A", undispatched=True)
        found = await idem.lookup(["k-1"], tenant="acme")
        assert found["k-1"].status is RecordStatus.in_flight and found["k-1"].holder == "B"
        await idem.complete("k-1", b"done", tenant="acme", holder="B")
        await idem.release("k-1", tenant="acme", holder="B", undispatched=True)
        found = await idem.lookup(["k-1"], tenant="acme")
        assert found["k-1"].status is RecordStatus.completed
        # Many racing releases by the stale holder against takeovers by fresh ones.
        for n in range(20):
            key = f"k-race-{n}"
            await idem.claim(key, holder="A", **common)
            await asyncio.gather(
                idem.release(key, tenant="acme", holder="A", undispatched=True),
                idem.claim(key, holder="B", takeover=True, **common),
            )
            rec = (await idem.lookup([key], tenant="acme")).get(key)
            # Either B took over first (its claim stands) or A's release came first and
            # B's claim made a fresh record: B holds it in both orders.
            assert rec is not None and rec.holder == "B", (n, rec)


async def test_a_tool_raising_lease_lost_itself_is_its_outcome_and_never_sent_again(
    airline: Airline, tmp_path: Path
) -> None:
    """Withstood. A tool that talks to another kit-run system raises ``LeaseLostError``
    of its own after booking. It is not the guard's refusal: the call ran, so its claim
    must be completed (not released as unsent), and no resume sends it again."""
    stores = open_stores(f"sqlite:///{tmp_path}/x.db")
    await stores.create_schema()
    async with stores:

        @tool(side_effects=False)
        def search_flights(origin: str, dest: str) -> list[str]:
            """Find flights between two airports."""
            return ["LH123"]

        @tool
        def book_seat(flight: str) -> str:
            """Book one seat on a flight."""
            airline.bookings.append(flight)
            raise LeaseLostError("the airline's own worker lost its lease")

        agent = Agent("booking", "Book the flight the user asks for.", [search_flights, book_seat])
        store = FaultyCheckpointStore(stores.checkpoints, crash_before=_at("after_tool_result", 1))

        def runner() -> AgentRunner:
            return AgentRunner(
                ScriptedProvider(BOOK_TURNS),
                idempotency=stores.idempotency,
                checkpoints=Checkpointer(store, history=stores.history),
                leases=stores.leases,
                history=None,
            )

        with pytest.raises(SimulatedCrash):
            await runner().run(agent, "book", tenant="acme", run_id="r")
        recs = [r for r in await stores.idempotency.records("acme", "r") if r.tool == "book_seat"]
        assert [r.status for r in recs] == [RecordStatus.completed]
        store.crash_before = None
        run = await runner().resume(agent, "r", tenant="acme")
        assert run.status is RunStatus.completed
        assert airline.bookings == ["LH123"]


async def test_a_death_inside_a_sync_tool_after_its_booking_never_releases_its_claim(
    airline: Airline,
) -> None:
    """Withstood. The process dies inside a sync tool (in its worker thread) after the
    booking was made, with a lease store and a short ttl: the claim is not released as
    unsent on the way out, so the next resume names the call as in doubt rather than book
    it again."""
    ttl = 0.3
    store, idem, leases = MemoryCheckpointStore(), MemoryIdempotencyStore(), MemoryLeaseStore()

    @tool(side_effects=False)
    def search_flights(origin: str, dest: str) -> list[str]:
        """Find flights between two airports."""
        return ["LH123"]

    @tool
    def book_seat(flight: str) -> str:
        """Book one seat on a flight."""
        airline.bookings.append(flight)
        raise SimulatedCrash  # dies inside the tool, after the booking

    agent = Agent("booking", "Book the flight the user asks for.", [search_flights, book_seat])
    runner = AgentRunner(
        ScriptedProvider(BOOK_TURNS),
        idempotency=idem,
        checkpoints=Checkpointer(store),
        leases=leases,
        lease_policy=LeasePolicy(ttl=ttl, renew_within=0.2),
    )
    with pytest.raises(SimulatedCrash):
        await runner.run(agent, "book", tenant="acme", run_id="r")
    await asyncio.sleep(ttl + 0.1)
    with pytest.raises(IndeterminateToolCallError) as refused:
        await runner.resume(agent, "r", tenant="acme")
    assert [c.tool for c in refused.value.calls] == ["book_seat"]
    assert airline.bookings == ["LH123"]


# --- plan_without_frontier: a retried run() is not fooled ------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
async def test_records_of_a_lookalike_run_are_not_ahead_of_a_new_run(
    backend: str, tmp_path: Path
) -> None:
    """Withstood. Run ``b:c`` of tenant ``a`` booked LH123; run ``c`` of tenant ``a:b``
    (ids that join alike) books UA456: it must not find the other run's records and be
    refused as diverged, nor be told the other run's booking."""
    async with _backend(backend, tmp_path) as stores:
        airline = Airline()
        first = AgentRunner.from_stores(ScriptedProvider(BOOK_TURNS), stores)
        await first.run(booking_agent(airline), "book", tenant="a", run_id="b:c")
        other: list[Any] = [BOOK_TURNS[0], [("book_seat", {"flight": "UA456"})], "Booked UA456."]
        second = AgentRunner.from_stores(ScriptedProvider(other), stores)
        run = await second.run(booking_agent(airline), "book", tenant="a:b", run_id="c")
        assert run.status is RunStatus.completed
        assert airline.bookings == ["LH123", "UA456"]


async def test_run_retried_after_a_resume_died_refuses_a_divergent_turn(airline: Airline) -> None:
    """Withstood. No frontier was ever written (checkpoint store down), the run booked
    LH123 and a resume's run claim is on record too. A retried ``run()`` whose model asks
    for another seat is refused before it books anything."""
    store = FaultyCheckpointStore(
        MemoryCheckpointStore(), fail_with=StoreUnavailableError("checkpoint store down")
    )
    idem = MemoryIdempotencyStore()

    def die_after(stage: str) -> None:
        if stage == "after":
            raise SimulatedCrash

    airline.hook = die_after
    runner = AgentRunner(
        ScriptedProvider(BOOK_TURNS), idempotency=idem, checkpoints=Checkpointer(store)
    )
    with pytest.raises(SimulatedCrash):
        await runner.run(booking_agent(airline), "book", tenant="acme", run_id="r")
    airline.hook = None
    [rec] = [r for r in await idem.records("acme", "r") if r.tool == "book_seat"]
    await idem.resolve(
        rec.key,
        encode_outcome(ToolOutcome(call_id="-", content="booked"), Redactor()),
        tenant="acme",
        by="ops",
    )
    store.fail_with = None
    other: list[Any] = [BOOK_TURNS[0], [("book_seat", {"flight": "UA456"})], "Booked UA456."]
    again = AgentRunner(ScriptedProvider(other), idempotency=idem, checkpoints=Checkpointer(store))
    with pytest.raises(DivergedRunError):
        await again.run(booking_agent(airline), "book", tenant="acme", run_id="r")
    assert airline.bookings == ["LH123"]


# --- relaxed divergence: twins and custom keys across several crashes ------------------


def _die_after_bookings(airline: Airline, n: int) -> Any:
    def hook(stage: str) -> None:
        if stage == "after" and len(airline.bookings) == n:
            raise SimulatedCrash

    return hook


async def test_twins_that_ran_must_both_be_asked_again(airline: Airline) -> None:
    """Withstood. Two identical bookings ran at iteration 1 (twins) and the outcome of the
    second was settled by an operator; the resumed model asks for only one: refused
    before anything else is sent (one of the two would be hidden)."""
    store, idem = MemoryCheckpointStore(), MemoryIdempotencyStore()
    twins: list[Any] = [
        BOOK_TURNS[0],
        [("book_seat", {"flight": "LH123"}), ("book_seat", {"flight": "LH123"})],
        "Booked two.",
    ]
    airline.hook = _die_after_bookings(airline, 2)
    first = AgentRunner(
        ScriptedProvider(twins),
        idempotency=idem,
        checkpoints=Checkpointer(store, policy=ONLY_TOOL_RESULTS),
    )
    with pytest.raises(SimulatedCrash):
        await first.run(booking_agent(airline), "two", tenant="acme", run_id="r")
    airline.hook = None
    for rec in await idem.records("acme", "r"):
        if rec.status is RecordStatus.in_flight and rec.tool == "book_seat":
            done = encode_outcome(ToolOutcome(call_id="-", content="booked"), Redactor())
            await idem.resolve(rec.key, done, tenant="acme", by="ops")
    one: list[Any] = [
        BOOK_TURNS[0],
        [("book_seat", {"flight": "LH123"}), ("book_seat", {"flight": "UA456"})],
        "Booked.",
    ]
    resumer = AgentRunner(
        ScriptedProvider(one),
        idempotency=idem,
        checkpoints=Checkpointer(store, policy=ONLY_TOOL_RESULTS),
    )
    with pytest.raises(DivergedRunError):
        await resumer.resume(booking_agent(airline), "r", tenant="acme")
    assert airline.bookings == ["LH123", "LH123"]


async def test_a_turn_re_asked_with_more_calls_over_two_crashes_sends_each_once(
    airline: Airline,
) -> None:
    """Withstood. Crash 1 after the first booking of the turn; the re-asked turn adds a
    call; crash 2 after it; the third attempt asks the grown turn again: every call was
    sent once, the third attempt sends nothing."""
    store, idem = MemoryCheckpointStore(), MemoryIdempotencyStore()

    def turns(calls: list[Any]) -> list[Any]:
        return [BOOK_TURNS[0], calls, "Booked."]

    def runner(calls: list[Any]) -> AgentRunner:
        return AgentRunner(
            ScriptedProvider(turns(calls)),
            idempotency=idem,
            checkpoints=Checkpointer(store, policy=ONLY_TOOL_RESULTS),
            resume_claim_ttl=0.2,
        )

    lh, ua, af = (("book_seat", {"flight": f}) for f in ("LH123", "UA456", "AF001"))

    async def settle() -> None:
        for rec in await idem.records("acme", "r"):
            if rec.status is RecordStatus.in_flight and rec.tool == "book_seat":
                done = encode_outcome(ToolOutcome(call_id="-", content="booked"), Redactor())
                await idem.resolve(rec.key, done, tenant="acme", by="ops")

    airline.hook = _die_after_bookings(airline, 1)
    with pytest.raises(SimulatedCrash):
        await runner([lh]).run(booking_agent(airline), "book", tenant="acme", run_id="r")
    await settle()
    airline.hook = _die_after_bookings(airline, 2)
    with pytest.raises(SimulatedCrash):
        await runner([lh, ua]).resume(booking_agent(airline), "r", tenant="acme")
    await settle()
    await asyncio.sleep(0.3)  # the dead resumer's run claim lapses
    airline.hook = None
    run = await runner([lh, ua, af]).resume(booking_agent(airline), "r", tenant="acme")
    assert run.status is RunStatus.completed
    assert airline.bookings == ["LH123", "UA456", "AF001"]


# --- custom keys: the tenant prefix, twins, resolve, replay ----------------------------


async def test_resolve_by_a_tenant_prefixed_twin_key_settles_exactly_that_call(
    tmp_path: Path,
) -> None:
    """Withstood. A tenant with characters the prefix percent-encodes runs twin calls
    under a business key and dies inside the second; ``tesserix resolve --call KEY`` with
    the key the refusal printed settles it, and the resume sends nothing again."""
    tenant = "acme corp/eu"
    paid: list[int] = []

    def receipt_key(**kw: Any) -> str:
        return f"receipt-{kw['run_id']}-{kw['arguments']['order']}"

    @tool(key=receipt_key)
    def pay(order: int, ctx: ToolContext) -> str:
        """Pay an order."""
        paid.append(order)
        if len(paid) == 2:
            raise SimulatedCrash
        return "paid"

    agent = Agent("shop", "Pay.", [pay])
    turns: list[Any] = [[("pay", {"order": 5}), ("pay", {"order": 5})], "Paid twice."]
    url = f"sqlite:///{tmp_path}/x.db"
    stores = open_stores(url)
    await stores.create_schema()
    async with stores:
        runner = AgentRunner.from_stores(ScriptedProvider(turns), stores)
        with pytest.raises(SimulatedCrash):
            await runner.run(agent, "pay twice", tenant=tenant, run_id="r")
        with pytest.raises(IndeterminateToolCallError) as refused:
            await runner.resume(agent, "r", tenant=tenant)
        [doubt] = refused.value.calls
        assert doubt.key == "acme%20corp%2Feu/receipt-r-5#1"

    def resolve() -> tuple[int, str]:
        out, err = io.StringIO(), io.StringIO()
        code = frontier_main(
            [
                "resolve",
                "r",
                "--tenant",
                tenant,
                "--call",
                str(doubt.key),
                "--outcome",
                '"paid"',
                "--by",
                "ops",
            ],
            stores=open_stores(url),
            out=out,
            err=err,
        )
        return code, out.getvalue() + err.getvalue()

    code, said = await asyncio.to_thread(resolve)
    assert code == ExitCode.CARRIED_ON, said
    stores = open_stores(url)
    async with stores:
        provider = _Recording(ScriptedProvider(turns))
        run = await AgentRunner.from_stores(provider, stores).resume(agent, "r", tenant=tenant)
        assert run.status is RunStatus.completed
    assert paid == [5, 5]


class _CountedIds:
    """A model whose call ids come from a counter of its own process (as some local
    OpenAI-compatible servers number them): a restarted process numbers from 1 again."""

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


async def test_a_grant_left_by_an_orphan_request_never_approves_a_later_call(
    airline: Airline,
) -> None:
    """DEFECT. The orphaned request names the call by the dead attempt's call id
    (``toolu_2_0``); the next attempt's model names it ``toolu_1_0`` and waits on the same
    request. Once it is approved, the resume grants *both* ids: the one of the request,
    which no call of the turn has, stays among the run's grants for ever (and in every
    frontier). Two turns later the model's counter reaches ``toolu_2_0`` again, for a
    booking of UA456 nobody was asked about: it is sent on the stale grant. A decision
    approves the calls of its own turn, never a later call that happens to reuse an id."""
    store = FaultyCheckpointStore(MemoryCheckpointStore(), crash_before=_at("before_approval", 1))
    approvals, idem = MemoryApprovalStore(), MemoryIdempotencyStore()
    turns: list[Any] = [
        [("search_flights", {"origin": "FRA", "dest": "JFK"})],
        [("book_seat", {"flight": "LH123"})],
        [("search_flights", {"origin": "JFK", "dest": "SFO"})],
        [("book_seat", {"flight": "UA456"})],
        "Booked both legs.",
    ]

    def runner() -> AgentRunner:
        return AgentRunner(
            _CountedIds(turns),
            idempotency=idem,
            checkpoints=Checkpointer(store, policy=ONLY_TOOL_RESULTS),
            approvals=approvals,
        )

    agent = booking_agent(airline, approval=True)
    with pytest.raises(SimulatedCrash):
        await runner().run(agent, "book", tenant="acme", run_id="r")
    store.crash_before = None
    waiting = await runner().resume(agent, "r", tenant="acme")
    assert waiting.status is RunStatus.waiting_approval and waiting.pending_approval is not None
    await approvals.decide("acme", waiting.pending_approval.id, approved=True, by="ops")
    run = await runner().resume(agent, "r", tenant="acme")
    assert airline.bookings == ["LH123"], "UA456 was booked without anyone approving it"
    assert run.status is RunStatus.waiting_approval
    assert run.pending_approval is not None
    assert [c.arguments for c in run.pending_approval.calls] == [{"flight": "UA456"}]


async def test_a_live_run_is_not_stopped_as_superseded_when_another_run_shares_its_key() -> None:
    """DEFECT. An idempotent payment keyed by its order (the payment provider
    deduplicates): run ``r1`` is still waiting on the provider when run ``r2`` of the same
    tenant pays the same order. ``r2`` finds ``r1``'s claim in flight and, the tool being
    safe to re-send, takes it over as if ``r1`` were dead. ``r1``'s answer then comes back
    and recording it raises ``StaleFenceError`` — "another worker carries the run now",
    non-retryable — although nobody else carries ``r1``: a live run is stopped by a
    stranger. A claim of another live attempt is not an earlier attempt's leftover; the
    run that ran the call carries on (its outcome, or the taker's, is what it is told)."""
    started, release = asyncio.Event(), asyncio.Event()
    sent: list[str] = []

    @tool(key=_order_key, idempotent=True)
    async def pay(order: int, ctx: ToolContext) -> str:
        """Pay an order (the provider deduplicates by the key)."""
        sent.append(ctx.run_id)
        if ctx.run_id == "r1":
            started.set()
            await release.wait()
        return f"paid by {ctx.run_id}"

    agent = Agent("shop", "Pay.", [pay])
    idem = MemoryIdempotencyStore()
    turns: list[Any] = [[("pay", {"order": 5})], "Paid."]
    first = AgentRunner(ScriptedProvider(turns), idempotency=idem)
    task = asyncio.create_task(first.run(agent, "pay", tenant="acme", run_id="r1"))
    await asyncio.wait_for(started.wait(), HANG)
    second = AgentRunner(ScriptedProvider(turns), idempotency=idem)
    done = await asyncio.wait_for(second.run(agent, "pay", tenant="acme", run_id="r2"), HANG)
    assert done.status is RunStatus.completed
    release.set()
    run = await asyncio.wait_for(task, HANG)
    assert run.status is RunStatus.completed
