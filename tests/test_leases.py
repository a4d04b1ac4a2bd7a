"""Leases, fences and the Resumer: one worker carries a run."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import pytest

from booking import BOOK_TURNS, Airline, booking_agent
from tesserix_adk import (
    Agent,
    AgentRunner,
    Boundary,
    Checkpointer,
    CheckpointPolicy,
    ConfigurationError,
    LeaseHeldError,
    Leaseholder,
    LeaseLostError,
    LeasePolicy,
    MemoryCheckpointStore,
    MemoryHistoryStore,
    MemoryIdempotencyStore,
    MemoryLeaseStore,
    MemoryLedger,
    ResumeConflictError,
    Resumer,
    RunStatus,
    ScriptedProvider,
    StaleFenceError,
    tool,
)
from tesserix_adk.leases import MAX_TTL
from tesserix_adk.testing import FakeClock
from tesserix_adk.testing.faults import FaultyCheckpointStore, SimulatedCrash


class World:
    def __init__(self, *, history: bool = True, policy: CheckpointPolicy | None = None) -> None:
        self.clock = FakeClock()
        self.leases = MemoryLeaseStore(clock=self.clock)
        self.idempotency = MemoryIdempotencyStore(clock=self.clock)
        self.store = FaultyCheckpointStore(MemoryCheckpointStore())
        self.history = MemoryHistoryStore() if history else None
        self.ledger = MemoryLedger()
        self.policy = policy

    def checkpointer(self) -> Checkpointer:
        return Checkpointer(self.store, history=self.history, policy=self.policy)

    def runner(self, turns: Any = BOOK_TURNS, worker: str = "w") -> AgentRunner:
        return AgentRunner(
            ScriptedProvider(turns),
            idempotency=self.idempotency,
            checkpoints=self.checkpointer(),
            leases=self.leases,
            ledger=self.ledger,
            worker=worker,
        )

    def resumer(self) -> Resumer:
        cp = self.checkpointer()
        return Resumer(cp, self.leases, cp.history, self.idempotency)


async def _take_over_inside_book_seat(world: World, airline: Airline) -> list[Any]:
    """While worker A is inside book_seat, its lease lapses and worker B takes the run."""
    taken: list[Any] = []

    def hook(stage: str) -> None:
        if stage == "after":
            world.clock.advance(31)  # past A's 30 s ttl, by the store's clock

    async def take() -> None:
        taken.append(await world.resumer().resume("r", tenant="acme", worker="b"))

    airline.hook = hook
    original = world.idempotency.complete

    async def complete_then_take(key: str, outcome: bytes, *, tenant: str, holder: str) -> Any:
        # B takes over (and seals every store) between A's tool returning and its next write.
        if not taken and airline.bookings:
            await take()
        return await original(key, outcome, tenant=tenant, holder=holder)

    world.idempotency.complete = complete_then_take  # type: ignore[method-assign]
    return taken


async def test_superseded_holder_is_refused_on_its_next_history_write(airline: Airline) -> None:
    world = World()
    taken = await _take_over_inside_book_seat(world, airline)
    with pytest.raises(StaleFenceError):
        await world.runner().run(booking_agent(airline), "book", tenant="acme", run_id="r")
    assert taken and taken[0].lease.fence == 2
    assert airline.bookings == ["LH123"]
    # The superseded holder still recorded what its call did: the outcome is the truth.
    # B planned while A's call was in flight: it would refuse, never re-send.
    assert [p.tool for p in taken[0].plan.indeterminate] == ["book_seat"]
    records = await world.idempotency.records("acme", "r")
    assert [str(r.status) for r in records if r.tool == "book_seat"] == ["completed"]
    # Nothing A wrote after the takeover landed.
    assert all(p["fence"] == 1 for p in world.store.puts)
    assert world.store.puts[-1]["boundary"] == "after_model_call"


async def test_superseded_holder_is_refused_on_its_next_checkpoint_put(airline: Airline) -> None:
    world = World(history=False)
    await _take_over_inside_book_seat(world, airline)
    with pytest.raises(StaleFenceError):
        await world.runner().run(booking_agent(airline), "book", tenant="acme", run_id="r")
    assert world.store.puts[-1]["iteration"] == 1
    assert world.store.puts[-1]["boundary"] == "after_model_call"
    assert airline.bookings == ["LH123"]


async def test_superseded_holder_is_refused_on_its_next_claim(airline: Airline) -> None:
    world = World()
    turns = [[("book_seat", {"flight": "LH123"}), ("book_seat", {"flight": "UA456"})], "done"]
    await _take_over_inside_book_seat(world, airline)
    with pytest.raises(StaleFenceError):
        await world.runner(turns).run(booking_agent(airline), "book", tenant="acme", run_id="r")
    # The first call ran (it was claimed before the takeover); the second was refused.
    assert airline.bookings == ["LH123"]


async def test_seal_fences_out_the_old_holder_before_the_new_one_writes(airline: Airline) -> None:
    world = World()
    first = await world.leases.acquire("acme", "r", "a", 30)
    await world.store.put("acme", "r", b"{}", step=1, fence=first.fence)
    world.clock.advance(31)
    carried_error: list[BaseException] = []
    try:
        await world.resumer().resume("r", tenant="acme", worker="b")
    except Exception as exc:  # the frontier is not a real one; the seal already happened
        carried_error.append(exc)
    assert carried_error  # b read garbage and refused it, but had sealed first
    with pytest.raises(StaleFenceError):
        await world.store.put("acme", "r", b"{}", step=2, fence=first.fence)
    for store in (world.idempotency, world.history):
        assert store is not None
        with pytest.raises(StaleFenceError):
            await store.seal("acme", "r", first.fence)


async def test_workers_sharing_a_name_never_both_hold_a_run(airline: Airline) -> None:
    world = World()
    inside = asyncio.Event()
    release = asyncio.Event()

    @tool
    async def book_seat(flight: str) -> str:
        """Book a seat (waits while the other worker tries)."""
        inside.set()
        await release.wait()
        airline.bookings.append(flight)
        return "booked"

    agent = Agent("booking", "Book.", [book_seat])
    turns: list[Any] = [[("book_seat", {"flight": "LH123"})], "done"]
    one, two = world.runner(turns, worker="w1"), world.runner(turns, worker="w1")
    first = asyncio.ensure_future(one.run(agent, "book", tenant="acme", run_id="r"))
    await inside.wait()
    held = await world.leases.current("acme", "r")
    assert held is not None and held.holder.startswith("w1-")
    with pytest.raises(LeaseHeldError) as err:
        await two.run(agent, "book", tenant="acme", run_id="r")
    assert err.value.holder == held.holder
    release.set()
    assert (await first).status is RunStatus.completed
    assert airline.bookings == ["LH123"]


async def test_runner_holds_a_lease_while_running_and_releases_it(airline: Airline) -> None:
    world = World()
    held: list[Any] = []

    def hook(stage: str) -> None:
        held.append(stage)

    airline.hook = hook
    seen: list[Any] = []
    original = world.idempotency.claim

    async def claim(key: str, **kwargs: Any) -> Any:
        seen.append(await world.leases.current("acme", "r"))
        return await original(key, **kwargs)

    world.idempotency.claim = claim  # type: ignore[method-assign]
    run = await world.runner().run(booking_agent(airline), "book", tenant="acme", run_id="r")
    assert run.status is RunStatus.completed and run.fence == 1
    assert all(lease is not None and lease.fence == 1 for lease in seen)
    assert await world.leases.current("acme", "r") is None


async def test_lease_is_released_when_the_run_is_cancelled(airline: Airline) -> None:
    world = World()
    started = asyncio.Event()

    class Hangs:
        async def complete(self, request: Any) -> Any:
            started.set()
            await asyncio.Event().wait()

    runner = AgentRunner(
        Hangs(),
        idempotency=world.idempotency,
        checkpoints=world.checkpointer(),
        leases=world.leases,
    )
    task = asyncio.create_task(runner.run(booking_agent(airline), "b", tenant="acme", run_id="r"))
    await started.wait()
    assert await world.leases.current("acme", "r") is not None
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await world.leases.current("acme", "r") is None


async def test_resume_after_a_crash_carries_on_under_a_higher_fence(airline: Airline) -> None:
    world = World(policy=CheckpointPolicy(boundaries=frozenset(Boundary)))
    world.store.crash_after = lambda body: body.get("iteration") == 1
    with pytest.raises(SimulatedCrash):
        await world.runner().run(booking_agent(airline), "book", tenant="acme", run_id="r")
    world.store.crash_after = None
    # The dying runner released its lease on the way out (shielded); a SIGKILL leaves it
    # to lapse instead, which the process tests cover.
    assert await world.leases.current("acme", "r") is None
    run = await world.runner().resume(booking_agent(airline), "r", tenant="acme")
    assert run.status is RunStatus.completed
    assert run.fence == 2
    assert airline.bookings == ["LH123"]


# --- Leaseholder -------------------------------------------------------------------------


async def test_leaseholder_renews_a_run_that_outlives_its_ttl_and_keeps_the_fence() -> None:
    leases = MemoryLeaseStore()  # the real clock: renewal is driven by real time here
    policy = LeasePolicy(ttl=0.3, renew_within=0.2)
    holder = await Leaseholder.acquire(leases, "acme", "r", "w-1", policy)
    async with holder:
        for _ in range(10):  # 1 s: more than three ttls
            await asyncio.sleep(0.1)
            holder.check()
        current = await leases.current("acme", "r")
        assert current is not None and current.fence == holder.fence == 1
        assert holder.renewals >= 3
    # Handed back on exit: the next worker waits for nothing.
    assert await leases.current("acme", "r") is None
    nxt = await leases.acquire("acme", "r", "w-2", 30)
    assert nxt.fence == 2


async def test_leaseholder_stops_the_run_once_its_lease_was_taken() -> None:
    clock = FakeClock()
    leases = MemoryLeaseStore(clock=clock)
    holder = await Leaseholder.acquire(
        leases, "acme", "r", "w-1", LeasePolicy(ttl=30, renew_within=10)
    )
    clock.advance(31)
    await leases.acquire("acme", "r", "w-2", 30)
    with pytest.raises(LeaseLostError):
        await holder.renew()
    with pytest.raises(LeaseLostError):
        holder.check()


async def test_leaseholder_own_deadline_stops_writes_when_renewal_cannot_happen() -> None:
    now = [100.0]
    leases = MemoryLeaseStore()
    lease = await leases.acquire("acme", "r", "w-1", 30)
    holder = Leaseholder(
        leases, lease, LeasePolicy(ttl=30, renew_within=10), monotonic=lambda: now[0]
    )
    holder.check()
    now[0] += 30
    with pytest.raises(LeaseLostError, match="lapsed"):
        holder.check()


@pytest.mark.parametrize(
    ("ttl", "renew_within"),
    [
        (10, 10),
        (0, -1),
        (float("nan"), 1),
        (10, float("nan")),
        (float("inf"), 10),  # no store holds the expiry
        (1e300, 10),
        (MAX_TTL * 2, 10),
    ],
)
def test_lease_policy_rejects_nonsense(ttl: float, renew_within: float) -> None:
    with pytest.raises(ConfigurationError):
        LeasePolicy(ttl=ttl, renew_within=renew_within)


def test_lease_policy_takes_the_longest_ttl_every_store_holds() -> None:
    assert LeasePolicy(ttl=MAX_TTL, renew_within=MAX_TTL / 3).renew_every > 0


# --- Resumer -----------------------------------------------------------------------------


async def _interrupted_run(world: World, airline: Airline) -> None:
    world.store.crash_after = lambda body: body.get("iteration") == 1
    with pytest.raises(SimulatedCrash):
        await world.runner().run(booking_agent(airline), "book", tenant="acme", run_id="r")
    world.store.crash_after = None


async def test_resumer_takes_the_lease_then_reads_frontier_plan_and_transcript(
    airline: Airline,
) -> None:
    world = World()
    await _interrupted_run(world, airline)
    carried = await world.resumer().resume("r", tenant="acme", worker="w-7")
    assert carried.lease.holder.startswith("w-7-")
    assert carried.lease.fence == 2
    assert carried.checkpoint.iteration == 1
    assert carried.plan.safe
    assert [p.tool for p in carried.plan.to_dispatch] == ["book_seat"]
    assert carried.messages[0].text == "book"


async def test_loser_of_a_resume_race_never_sees_the_frontier(airline: Airline) -> None:
    world = World()
    await _interrupted_run(world, airline)
    winner = await world.resumer().resume("r", tenant="acme", worker="a")
    reads = world.store.reads
    with pytest.raises(ResumeConflictError) as err:
        await world.resumer().resume("r", tenant="acme", worker="b")
    assert err.value.holder == winner.lease.holder
    assert world.store.reads == reads


async def test_runner_resume_maps_a_held_lease_to_resume_conflict(airline: Airline) -> None:
    world = World()
    await _interrupted_run(world, airline)
    await world.resumer().resume("r", tenant="acme", worker="a")
    reads = world.store.reads
    with pytest.raises(ResumeConflictError) as err:
        await world.runner().resume(booking_agent(airline), "r", tenant="acme")
    assert isinstance(err.value.__cause__, LeaseHeldError)
    assert world.store.reads == reads
    assert airline.bookings == []


async def test_fifty_concurrent_resumes_one_carries_the_run(airline: Airline) -> None:
    world = World()
    await _interrupted_run(world, airline)
    gate = asyncio.Event()

    class Holds:
        """The winner waits inside its model call until every other resume has answered,
        so the fifty genuinely overlap (none can find the run already finished)."""

        async def complete(self, request: Any) -> Any:
            await gate.wait()
            return await ScriptedProvider(BOOK_TURNS).complete(request)

    def runner() -> AgentRunner:
        return AgentRunner(
            Holds(),
            idempotency=world.idempotency,
            checkpoints=world.checkpointer(),
            leases=world.leases,
            ledger=world.ledger,
        )

    tasks = [
        asyncio.create_task(runner().resume(booking_agent(airline), "r", tenant="acme"))
        for _ in range(50)
    ]
    losers_answered = asyncio.Event()

    def answered(_: object) -> None:
        if sum(t.done() for t in tasks) >= 49:
            losers_answered.set()

    for task in tasks:
        task.add_done_callback(answered)
    await losers_answered.wait()
    gate.set()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    winners = [r for r in results if not isinstance(r, BaseException)]
    assert len(winners) == 1 and winners[0].status is RunStatus.completed
    assert all(isinstance(r, ResumeConflictError) for r in results if r not in winners)
    assert airline.bookings == ["LH123"]


async def test_a_renewal_that_cannot_reach_the_store_is_lost_once_the_ttl_has_passed() -> None:
    inner = MemoryLeaseStore()

    class Unreachable:
        def __getattr__(self, name: str) -> Any:
            return getattr(inner, name)

        async def renew(self, lease: Any, ttl: float) -> Any:
            raise ConnectionError("lease store unreachable")

    policy = LeasePolicy(ttl=0.3, renew_within=0.2)
    holder = await Leaseholder.acquire(Unreachable(), "acme", "r", "w-1", policy)  # type: ignore[arg-type]
    async with holder:
        holder.check()  # fine while the ttl has not passed, reachable or not
        await asyncio.sleep(0.4)
        with pytest.raises(LeaseLostError):
            holder.check()


# --- closing: bounded, never renewing for ever, cancellation passed on -------------------


class _DeafRenewals:
    """A lease store whose renew loses a cancellation, as redis-py on Python 3.11 does about
    half the time: it goes on waiting for ``gate`` (a server that has not answered yet)."""

    def __init__(self) -> None:
        self.inner = MemoryLeaseStore()
        self.gate = asyncio.Event()
        self.renewing = asyncio.Event()
        self.renewals = 0
        self.lost_cancellations = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def renew(self, lease: Any, ttl: float) -> Any:
        self.renewing.set()
        while not self.gate.is_set():
            try:
                await self.gate.wait()
            except asyncio.CancelledError:
                self.lost_cancellations += 1
        self.renewals += 1
        return await self.inner.renew(lease, ttl)


async def _finished(task: asyncio.Task[Any], within: float = 10.0) -> bool:
    """Whether ``task`` ends within ``within`` seconds (a hang guard, not a speed claim)."""
    done, _ = await asyncio.wait({task}, timeout=within)
    return task in done


async def test_close_returns_and_stops_renewing_when_a_renewal_loses_its_cancellation() -> None:
    store = _DeafRenewals()
    policy = LeasePolicy(ttl=0.3, renew_within=0.2)
    holder = await Leaseholder.acquire(store, "acme", "r", "w-1", policy)  # type: ignore[arg-type]
    try:
        await holder.__aenter__()
        await store.renewing.wait()
        closing = asyncio.create_task(holder.close())
        assert await _finished(closing), "close() hung on a renewal that lost its cancellation"
        await closing
        assert store.lost_cancellations >= 1
    finally:
        store.gate.set()
    # The renewal the server finally answers must be the last one: the loop was told to
    # stop, not only cancelled, so it renews no more however long the process lives.
    await asyncio.sleep(0.5)  # five renewal periods
    assert store.renewals <= 1


async def test_close_swallows_no_cancellation_of_its_caller() -> None:
    store = _DeafRenewals()
    policy = LeasePolicy(ttl=0.3, renew_within=0.2)
    holder = await Leaseholder.acquire(store, "acme", "r", "w-1", policy)  # type: ignore[arg-type]
    try:
        await holder.__aenter__()
        await store.renewing.wait()
        closing = asyncio.create_task(holder.close())
        await asyncio.sleep(0.01)
        closing.cancel()
        assert await _finished(closing), "close() hung after its caller was cancelled"
    finally:
        store.gate.set()
    with pytest.raises(asyncio.CancelledError):
        await closing
    # The cleanup ran to its end, shielded: the lease was handed back.
    assert await store.inner.current("acme", "r") is None


async def test_close_bounds_a_release_that_never_answers() -> None:
    inner = MemoryLeaseStore()
    answer = asyncio.Event()

    class HangingRelease:
        def __getattr__(self, name: str) -> Any:
            return getattr(inner, name)

        async def release(self, lease: Any) -> None:
            while not answer.is_set():  # deaf to cancellation too
                with contextlib.suppress(asyncio.CancelledError):
                    await answer.wait()

    policy = LeasePolicy(ttl=0.3, renew_within=0.2)
    holder = await Leaseholder.acquire(HangingRelease(), "acme", "r", "w-1", policy)  # type: ignore[arg-type]
    try:
        await holder.__aenter__()
        await asyncio.sleep(0.05)
        closing = asyncio.create_task(holder.close())
        assert await _finished(closing), "close() waited for ever on the release"
        await closing
        lease = await inner.current("acme", "r")
        assert lease is not None and lease.holder == "w-1"  # left to lapse by the store's clock
    finally:
        answer.set()


async def test_a_grant_whose_reply_a_cancellation_cut_off_is_handed_back() -> None:
    """Ctrl-C landing after the store granted the lease but before its reply arrived: the
    caller never learns it holds the run, so ``acquire`` must hand back what it may hold,
    or the next resume waits out a whole ttl for nobody (seen on PostgreSQL in CI)."""
    inner = MemoryLeaseStore()
    granted = asyncio.Event()
    reply = asyncio.Event()

    class SlowReply:
        def __getattr__(self, name: str) -> Any:
            return getattr(inner, name)

        async def acquire(self, tenant: str, run_id: str, holder: str, ttl: float) -> Any:
            lease = await inner.acquire(tenant, run_id, holder, ttl)
            granted.set()
            await reply.wait()  # the reply still on the wire
            return lease

    policy = LeasePolicy(ttl=30, renew_within=10)
    taking = asyncio.create_task(Leaseholder.acquire(SlowReply(), "acme", "r", "w-1", policy))  # type: ignore[arg-type]
    await granted.wait()
    taking.cancel()
    with pytest.raises(asyncio.CancelledError):
        await taking
    assert await inner.current("acme", "r") is None


async def test_a_cut_off_grant_leaves_another_holders_lease_alone() -> None:
    inner = MemoryLeaseStore()
    started = asyncio.Event()

    class Refused:
        def __getattr__(self, name: str) -> Any:
            return getattr(inner, name)

        async def acquire(self, tenant: str, run_id: str, holder: str, ttl: float) -> Any:
            started.set()
            await asyncio.Event().wait()  # cancelled before the store did anything

    theirs = await inner.acquire("acme", "r", "w-2", 30)
    taking = asyncio.create_task(Leaseholder.acquire(Refused(), "acme", "r", "w-1"))  # type: ignore[arg-type]
    await started.wait()
    taking.cancel()
    with pytest.raises(asyncio.CancelledError):
        await taking
    assert await inner.current("acme", "r") == theirs
