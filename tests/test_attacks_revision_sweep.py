"""An attack on the revision sweep of a rolling deploy (``Parking._wake_parked``): a worker
wakes the runs a worker of another revision parked (``RevisionMismatchError``) whose
frontier is pinned to the revision it serves, as it starts and, idle, every
``parked_sweep`` seconds; and on the operator's view of parked runs (``shown_entry``,
``runs --stuck``).

The oracle: each side-effecting call at most once; a cancelled run sends nothing; a call
in doubt is never guessed; ``max_attempts`` still bounds the takes of a run old and new
workers bounce between them; one damaged run hides no other; the sweep reads frontiers
only every ``parked_sweep`` seconds; a reason shown is redacted and still names its error.
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from booking import BOOK_TURNS, Airline
from tesserix_adk import (
    Agent,
    AgentRunner,
    Carried,
    LeasePolicy,
    ScriptedProvider,
    Worker,
    WorkState,
    open_stores,
    tool,
)
from tesserix_adk.checkpoint.payload import encode_outcome, record_tag
from tesserix_adk.checkpoint.redaction import Redactor
from tesserix_adk.errors import RevisionMismatchError
from tesserix_adk.messages import ToolOutcome
from tesserix_adk.run.cancelling import request_cancel
from tesserix_adk.run.entries import shown_entry
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.stores.memory import MemoryWorkIndex
from tesserix_adk.stores.protocols import WorkItem
from tesserix_adk.testing.faults import SimulatedCrash
from tesserix_adk.worker_parking import Backoff, parked_for
from test_attacks_rolling_deploy import deploy

T = "sweep-acme"
MARGIN = 0.05


def _memory() -> Stores:
    stores = open_stores("memory://")
    stores.work = MemoryWorkIndex(stores.leases)
    return stores


def _runner(stores: Stores, provider: Any = None) -> AgentRunner:
    return AgentRunner.from_stores(
        provider or ScriptedProvider(list(BOOK_TURNS)),
        stores,
        lease_policy=LeasePolicy(ttl=2.0, renew_within=1.0),
        never_ran_margin=MARGIN,
    )


def _agents(airline: Airline) -> tuple[Agent, Agent]:
    """The old and the new revision of one agent (same name, same tools)."""

    @tool(side_effects=False)
    def search_flights(origin: str, dest: str) -> list[str]:
        """Find flights."""
        airline.searches += 1
        return ["LH123"]

    @tool
    def book_seat(flight: str, ctx: Any) -> dict[str, str]:
        """Book a seat."""
        if airline.hook is not None:
            airline.hook("before")
        airline.bookings.append(f"{flight}:{ctx.idempotency_key}")
        if airline.hook is not None:
            airline.hook("after")
        return {"booking": f"B{len(airline.bookings)}"}

    new = Agent("booking", "Book, the new way.", [search_flights, book_seat])
    old = Agent("booking", "Book, the old way.", [search_flights, book_seat])
    assert old.revision != new.revision
    return old, new


class _Dies:
    """Answers the first turn; the process "dies" while the model thinks of the second."""

    def __init__(self) -> None:
        self.inner = ScriptedProvider(list(BOOK_TURNS))
        self.calls = 0

    async def complete(self, request: Any) -> Any:
        self.calls += 1
        if self.calls > 1:
            raise SimulatedCrash("died while the model thought")
        return await self.inner.complete(request)


class _Fails:
    """A model that fails every time it is asked (a run that cannot get on)."""

    def __init__(self) -> None:
        self.calls = 0

    async def complete(self, request: Any) -> Any:
        self.calls += 1
        raise RuntimeError("the model's host keeps failing")


async def _started(stores: Stores, agent: Agent, run_id: str, *, tenant: str = T) -> None:
    """A run started under ``agent`` (a frontier pinned to its revision) whose holder died.
    Its lease is short, to be waited out, and long enough that a loaded machine still
    renews it before the death (a 0.1 s one lapsed there first)."""
    runner = _runner(stores)
    await runner.submit(agent, "book", tenant=tenant, run_id=run_id)
    dies = AgentRunner.from_stores(
        _Dies(), stores, lease_policy=LeasePolicy(ttl=0.4, renew_within=0.2)
    )
    with pytest.raises(SimulatedCrash):
        await dies.run(agent, "book", tenant=tenant, run_id=run_id)


async def _lapsed(stores: Stores, run_id: str, *, tenant: str = T) -> None:
    deadline = time.monotonic() + 10
    while await stores.leases.current(tenant, run_id) is not None:
        assert time.monotonic() < deadline, "lease never lapsed"
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.15)  # the dead attempt's resume claim too


def _mismatch(run_id: str) -> str:
    return f"RevisionMismatchError: run {run_id!r} was checkpointed by another revision"


async def _entry(stores: Stores, run_id: str, *, tenant: str = T) -> WorkItem:
    assert stores.work is not None
    item = await stores.work.entry(tenant, run_id)
    assert item is not None
    return item


# --- old and new workers bouncing a run that cannot get on ---------------------------------


async def test_max_attempts_bounds_a_run_bounced_between_old_and_new_workers() -> None:
    stores, airline = _memory(), Airline()
    old, new = _agents(airline)
    await _started(stores, new, "poison")
    await _lapsed(stores, "poison")
    max_attempts = 3
    failing = _Fails()
    fast = Backoff(base=0.001, cap=0.001)
    new_worker = Worker(
        _runner(stores, failing), [new], max_attempts=max_attempts, backoff=fast, parked_sweep=0
    )
    old_worker = Worker(_runner(stores), [old], max_attempts=max_attempts, backoff=fast)
    new_takes = 0
    for _ in range(4 * max_attempts):
        item = await _entry(stores, "poison")
        if item.state is WorkState.parked and not parked_for(item, RevisionMismatchError):
            break  # parked for a person: what max_attempts promises
        if item.state is WorkState.parked:
            await new_worker._wake_parked(formats=False)  # the new worker's idle sweep
            continue
        how = await new_worker._carry(item)
        new_takes += how is not Carried.parked
        await asyncio.sleep(0.01)
        # An old worker polls first this time: it parks the run (RevisionMismatchError).
        item = await _entry(stores, "poison")
        if item.state is not WorkState.parked:
            assert await old_worker._carry(item) is Carried.parked
            item = await _entry(stores, "poison")
            assert parked_for(item, RevisionMismatchError), item
    final = await _entry(stores, "poison")
    assert final.state is WorkState.parked and not parked_for(final, RevisionMismatchError), (
        final,
        new_takes,
    )
    assert new_takes <= max_attempts, new_takes
    assert airline.bookings == []


async def test_a_run_bounced_between_revisions_keeps_no_duplicate_and_finishes() -> None:
    """Old and new workers take turns on a run of the new revision: the old one parks it,
    the new one's sweep wakes it, and the new one carries it to the end; one booking."""
    stores, airline = _memory(), Airline()
    old, new = _agents(airline)
    await _started(stores, new, "r1")
    await _lapsed(stores, "r1")
    old_worker = Worker(_runner(stores), [old])
    new_worker = Worker(_runner(stores), [new], parked_sweep=0)
    for _ in range(3):
        item = await _entry(stores, "r1")
        assert await old_worker._carry(item) is Carried.parked
        assert airline.bookings == []
        await new_worker._wake_parked(formats=False)
        assert (await _entry(stores, "r1")).state is WorkState.wanted
    assert await new_worker._carry(await _entry(stores, "r1")) is Carried.finished
    assert len(airline.bookings) == 1
    assert (await _entry(stores, "r1")).state is WorkState.done
    # A finished run is not woken again by any sweep.
    await new_worker._wake_parked(formats=False)
    assert (await _entry(stores, "r1")).state is WorkState.done


# --- a parked run with a call in doubt, or a cancel request --------------------------------


async def test_a_run_parked_for_a_revision_with_a_call_in_doubt_is_never_guessed() -> None:
    stores, airline = _memory(), Airline()
    old, new = _agents(airline)
    await _runner(stores).submit(new, "book", tenant=T, run_id="doubt")

    def hook(at: str) -> None:
        if at == "after":
            airline.hook = None
            raise SimulatedCrash("died after booking")

    airline.hook = hook
    dies = AgentRunner.from_stores(
        ScriptedProvider(list(BOOK_TURNS)),
        stores,
        lease_policy=LeasePolicy(ttl=0.1, renew_within=0.05),
    )
    with pytest.raises(SimulatedCrash):
        await dies.run(new, "book", tenant=T, run_id="doubt")
    assert len(airline.bookings) == 1
    await _lapsed(stores, "doubt")
    old_worker = Worker(_runner(stores), [old])
    assert await old_worker._carry(await _entry(stores, "doubt")) is Carried.parked
    assert parked_for(await _entry(stores, "doubt"), RevisionMismatchError)
    new_worker = Worker(_runner(stores), [new], parked_sweep=0)
    await new_worker._wake_parked(formats=False)
    assert await new_worker._carry(await _entry(stores, "doubt")) is Carried.parked
    item = await _entry(stores, "doubt")
    assert (item.reason or "").startswith("IndeterminateToolCallError:"), item
    assert len(airline.bookings) == 1
    # Parked for the call in doubt now: no sweep wakes it again.
    await new_worker._wake_parked(formats=True)
    assert (await _entry(stores, "doubt")).state is WorkState.parked
    assert len(airline.bookings) == 1


async def test_a_cancel_asked_while_parked_is_honoured_when_the_sweep_wakes_the_run() -> None:
    """A cancel recorded while an old worker held the run (it then parked it): the new
    worker's sweep wakes it, and its take must end it cancelled, sending nothing."""
    stores, airline = _memory(), Airline()
    old, new = _agents(airline)
    await _started(stores, new, "cancelled")
    await _lapsed(stores, "cancelled")
    runner = _runner(stores)
    old_worker = Worker(runner, [old])
    assert await old_worker._carry(await _entry(stores, "cancelled")) is Carried.parked
    await request_cancel(
        runner.idempotency,
        T,
        "cancelled",
        by="al",
        reason="customer withdrew",
        redactor=runner.redactor,
    )
    searches = airline.searches
    new_worker = Worker(_runner(stores), [new], parked_sweep=0)
    await new_worker._wake_parked(formats=False)
    item = await _entry(stores, "cancelled")
    if item.state is not WorkState.parked:
        await new_worker._carry(item)
    assert airline.bookings == []
    assert airline.searches == searches
    assert runner.checkpoints is not None
    cp = await runner.checkpoints.latest(T, "cancelled")
    assert cp is not None and cp.status.value == "cancelled", cp
    assert (await _entry(stores, "cancelled")).state is not WorkState.wanted


async def test_a_run_cancelled_while_parked_is_not_woken() -> None:
    stores, airline = _memory(), Airline()
    old, new = _agents(airline)
    await _started(stores, new, "gone")
    await _lapsed(stores, "gone")
    runner = _runner(stores)
    assert await Worker(runner, [old])._carry(await _entry(stores, "gone")) is Carried.parked
    await runner.cancel("gone", tenant=T, by="al", reason="no longer wanted")
    new_worker = Worker(_runner(stores), [new], parked_sweep=0)
    await new_worker._wake_parked(formats=True)
    assert (await _entry(stores, "gone")).state is WorkState.done
    assert airline.bookings == []


# --- whose runs a sweep wakes --------------------------------------------------------------


async def test_the_sweep_wakes_its_revision_in_every_tenant_and_leaves_others() -> None:
    stores, airline = _memory(), Airline()
    old, new = _agents(airline)
    assert stores.work is not None
    await _started(stores, new, "mine-a", tenant=T)
    await _started(stores, new, "mine-b", tenant="sweep-other")
    await _started(stores, old, "old-one", tenant=T)
    # A run whose entry names another agent ("billing"), though its frontier is pinned to
    # this revision: no worker of "booking" may wake it.
    await _started(stores, new, "other-agent", tenant=T)
    for tenant, run_id in (
        (T, "mine-a"),
        ("sweep-other", "mine-b"),
        (T, "old-one"),
        (T, "other-agent"),
    ):
        agent = "billing" if run_id == "other-agent" else "booking"
        await stores.work.park(tenant, run_id, agent=agent, reason=_mismatch(run_id))
    # Parked for something else than a revision: left alone.
    await _started(stores, new, "held-for-person", tenant=T)
    await stores.work.park(
        T, "held-for-person", agent="booking", reason="IndeterminateToolCallError: x"
    )
    await Worker(_runner(stores), [new], parked_sweep=0)._wake_parked(formats=False)
    states = {
        (i.tenant, i.run_id): i.state
        for tenant in (T, "sweep-other")
        for i in await stores.work.items(tenant)
    }
    assert states == {
        (T, "mine-a"): WorkState.wanted,
        ("sweep-other", "mine-b"): WorkState.wanted,
        (T, "old-one"): WorkState.parked,
        (T, "other-agent"): WorkState.parked,
        (T, "held-for-person"): WorkState.parked,
    }


# --- damage --------------------------------------------------------------------------------


async def test_one_damaged_work_entry_hides_no_parked_run_from_the_sweep(tmp_path: Path) -> None:
    path = tmp_path / "adk.sqlite3"
    async with open_stores(f"sqlite:///{path}") as stores:
        await stores.create_schema()
        assert stores.work is not None
        airline = Airline()
        _old, new = _agents(airline)
        await _started(stores, new, "good")
        await _started(stores, new, "bad", tenant="sweep-damaged")
        for tenant, run_id in ((T, "good"), ("sweep-damaged", "bad")):
            await stores.work.park(tenant, run_id, agent="booking", reason=_mismatch(run_id))
        with sqlite3.connect(path) as conn:
            conn.execute("UPDATE adk_work SET attempts = 'many' WHERE run_id = 'bad'")
        worker = Worker(_runner(stores), [new], parked_sweep=0)
        await worker._wake_parked(formats=False)  # must not raise either
        assert (await _entry(stores, "good")).state is WorkState.wanted


async def test_a_damaged_frontier_of_a_parked_run_hides_no_other(tmp_path: Path) -> None:
    path = tmp_path / "adk.sqlite3"
    async with open_stores(f"sqlite:///{path}") as stores:
        await stores.create_schema()
        assert stores.work is not None
        airline = Airline()
        _old, new = _agents(airline)
        # The damaged one is older, so listed first.
        await _started(stores, new, "corrupt")
        await _started(stores, new, "fine")
        for run_id in ("corrupt", "fine"):
            await stores.work.park(T, run_id, agent="booking", reason=_mismatch(run_id))
        with sqlite3.connect(path) as conn:
            # A lean frontier reads its payload from the step snapshot it names.
            (step,) = conn.execute(
                "SELECT step FROM adk_frontiers WHERE run_id = 'corrupt'"
            ).fetchone()
            (payload,) = conn.execute(
                "SELECT payload FROM adk_checkpoint_steps WHERE run_id = 'corrupt' AND step = ?",
                (step,),
            ).fetchone()
            flipped = bytearray(payload)
            flipped[len(flipped) // 2] ^= 0x01
            conn.execute(
                "UPDATE adk_checkpoint_steps SET payload = ? WHERE run_id = 'corrupt' AND step = ?",
                (bytes(flipped), step),
            )
        await _lapsed(stores, "fine")
        worker = Worker(
            _runner(stores), [new], parked_sweep=0, exit_when_idle=True, poll_interval=0.01
        )
        await asyncio.wait_for(worker.run(), 60)
        assert (await _entry(stores, "corrupt")).state is WorkState.parked
        assert (await _entry(stores, "fine")).state is WorkState.done
        assert len(airline.bookings) == 1


# --- cost of the sweep ---------------------------------------------------------------------


async def test_an_idle_worker_reads_parked_frontiers_only_every_parked_sweep() -> None:
    stores, airline = _memory(), Airline()
    old, new = _agents(airline)
    assert stores.work is not None
    n = 12
    for k in range(n):
        # Pinned to the OLD revision and parked for it: the new worker looks and leaves it.
        await _started(stores, old, f"p{k}")
        await stores.work.park(T, f"p{k}", agent="booking", reason=_mismatch(f"p{k}"))
    runner = _runner(stores)
    assert runner.checkpoints is not None
    reads: Counter[str] = Counter()
    latest = runner.checkpoints.latest

    async def counted_latest(tenant: str, run_id: str) -> Any:
        reads[run_id] += 1
        return await latest(tenant, run_id)

    runner.checkpoints.latest = counted_latest  # type: ignore[method-assign]
    polls = 0
    due = stores.work.due

    async def counted_due(**kwargs: Any) -> Any:
        nonlocal polls
        polls += 1
        return await due(**kwargs)

    stores.work.due = counted_due  # type: ignore[method-assign]
    worker = Worker(runner, [new], poll_interval=0.005, parked_sweep=3600)
    task = asyncio.create_task(worker.run())
    deadline = time.monotonic() + 30
    while polls < 40:
        assert time.monotonic() < deadline, polls
        await asyncio.sleep(0.01)
    worker.drain()
    await task
    assert polls >= 40
    # Once each, as the worker started; not once per idle poll.
    assert reads == Counter({f"p{k}": 1 for k in range(n)}), reads
    assert airline.bookings == []


# --- an operator's resolve racing the sweep ------------------------------------------------


async def test_resolve_racing_the_sweep_books_once() -> None:
    stores, airline = _memory(), Airline()
    old, new = _agents(airline)
    await _runner(stores).submit(new, "book", tenant=T, run_id="raced")

    def hook(at: str) -> None:
        if at == "after":
            airline.hook = None
            raise SimulatedCrash("died after booking")

    airline.hook = hook
    dies = AgentRunner.from_stores(
        ScriptedProvider(list(BOOK_TURNS)),
        stores,
        lease_policy=LeasePolicy(ttl=0.1, renew_within=0.05),
    )
    with pytest.raises(SimulatedCrash):
        await dies.run(new, "book", tenant=T, run_id="raced")
    await _lapsed(stores, "raced")
    assert await Worker(_runner(stores), [old])._carry(await _entry(stores, "raced")) is (
        Carried.parked
    )
    runner = _runner(stores)
    records = [r for r in await stores.idempotency.records(T, "raced") if r.tool == "book_seat"]
    assert len(records) == 1
    sweeper = Worker(_runner(stores), [new], parked_sweep=0)
    record = records[0]

    async def operator_resolves() -> None:
        # What `tesserix resolve --outcome` records, then its wake of the parked run.
        outcome = ToolOutcome(call_id=record.call_id or "", content={"booking": "B1"})
        encoded = encode_outcome(outcome, Redactor(), record=record_tag(T, record.key))
        await stores.idempotency.resolve(record.key, encoded, tenant=T, by="al")
        assert stores.work is not None
        await stores.work.want(T, "raced", agent="booking")

    await asyncio.gather(sweeper._wake_parked(formats=False), operator_resolves())
    workers = [
        Worker(_runner(stores), [new], exit_when_idle=True, poll_interval=0.01) for _ in range(2)
    ]
    await asyncio.wait_for(asyncio.gather(*(w.run() for w in workers)), 60)
    assert len(airline.bookings) == 1
    assert runner.checkpoints is not None
    cp = await runner.checkpoints.latest(T, "raced")
    assert cp is not None and cp.status.value == "completed", cp


# --- the operator's view -------------------------------------------------------------------

_SECRET = "sk-proj-" + "A1b2C3d4E5f6G7h8J9k0L1m2N3p4Q5r6S7t8U9v0"


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    head=st.text(max_size=40),
    tail=st.text(max_size=40),
    error=st.sampled_from(["RevisionMismatchError", "CheckpointFormatError"]),
)
def test_a_shown_reason_keeps_its_error_type_and_masks_the_secret(
    head: str, tail: str, error: str
) -> None:
    reason = f"{error}: {head} password={_SECRET} {tail}"
    item = WorkItem(
        tenant=T, run_id="r", agent="booking", state=WorkState.parked, since=0.0, reason=reason
    )
    shown = shown_entry(item)
    assert item.reason == reason  # what workers decide on is unchanged
    assert shown.reason is not None
    assert shown.reason.startswith(f"{error}:"), shown.reason
    assert _SECRET not in shown.reason
    assert "A1b2C3d4E5f6G7h8J9k0" not in shown.reason
    expected = RevisionMismatchError if error == "RevisionMismatchError" else None
    if expected is not None:
        assert parked_for(shown, expected) and parked_for(item, expected)


async def test_runs_stuck_shows_the_parked_reason_redacted_and_the_current_revision_advice(
    tmp_path: Path,
) -> None:
    """A reason another writer left unmasked: ``runs --stuck`` masks it, still names the
    error, and says a run on the current revision needs no --accept-revision."""
    async with deploy("sqlite", tmp_path) as d:
        new = d.agent("v2", instructions="Book carefully.")
        d.submit(new, "r1", "book:k1")
        assert d.killed_in_tool(new, "new-a") == "book-k1"
        await d.lapse("r1")
        async with open_stores(d.url) as stores:
            assert stores.work is not None
            await stores.work.park(
                "rolling",
                "r1",
                agent="booker",
                reason=f"RevisionMismatchError: pinned elsewhere; token={_SECRET}",
            )
        row = d.stuck("--agent", new)["r1"]
        assert _SECRET not in str(row), row
        assert str(row["reason"]).startswith("RevisionMismatchError:"), row
        assert "--accept-revision" not in str(row["blocked"]), row
        code, out, err = d.cli("inspect", "r1", "--tenant", "rolling")
        assert code == 0, err
        assert _SECRET not in out + err
        assert "RevisionMismatchError" in out, out


# --- real worker processes: two new workers wake and carry one run -------------------------


async def test_two_new_workers_starting_at_once_carry_the_parked_run_once(
    tmp_path: Path,
) -> None:
    async with deploy("sqlite", tmp_path) as d:
        old = d.agent("v1")
        new = d.agent("v2", instructions="Book carefully.")
        d.submit(new, "r1", "book:k1 book:k2 book:k3")
        assert d.killed_in_tool(new, "new-a") == "book-k1"
        await d.lapse("r1")
        code, out, err = d.cli(
            "resolve", "r1", "--tenant", "rolling", "--call", "c0", "--outcome", '"done k1"',
            "--by", "al",
        )  # fmt: skip
        assert code == 0, (out, err)
        code, out, err = await asyncio.to_thread(d.idle_worker, old, "old-a")
        assert code == 0 and "parked: RevisionMismatchError" in out, (out, err)
        # Two workers of the run's revision start side by side: both sweep as they start.
        both = await asyncio.gather(
            asyncio.to_thread(d.idle_worker, new, "new-b"),
            asyncio.to_thread(d.idle_worker, new, "new-c"),
        )
        for code, out, err in both:
            assert code == 0, (out, err)
        assert d.counts() == Counter({"book-k1": 1, "book-k2": 1, "book-k3": 1})
        assert d.status("r1") == "completed"
