"""Attacks on ``Resumer``, as a user who drives the loop himself would misuse it, and as a
race would: two processes on one run, SIGKILL of the holder, a stale holder's writes, a
``CarriedRun`` used after its lease is gone, runs that must not be carried, odd ids, and the
plan it hands over against what the records say.

Held: exactly one of two real processes gets the run and the loser reads nothing; after a
SIGKILL the run is taken over only once the lease lapsed, with a higher fence, and the dead
holder's frontier, transcript and call claims are refused (``StaleFenceError``) on every
backend; a superseded ``CarriedRun`` cannot renew, its stale plan cannot claim a call, and
releasing it (twice) leaves the new holder's lease alone; a tombstone and a damaged
frontier raise typed errors and hand the lease back; another tenant's run is not found;
the plan never offers a completed call for dispatch and calls every in-flight call of a
side-effecting, non-idempotent tool indeterminate (hypothesis, against a simple oracle).

Defects found, each fixed (their tests pass now): the ledger and the approval store were
not sealed (``Resumer.from_stores`` seals all five), so a superseded holder's spend and
approval requests still landed; a run that ended failed, an unfinished replay, a run
Temporal carries and a run whose cancel stands were handed over as carriable (now
``RunFailedError`` / ``ReplayNotResumableError`` / ``CarriedByWorkflowError``, and
``CarriedRun.cancel`` with nothing to dispatch); ids the runner refuses were not checked
(a lone surrogate read as a damaged store, and junk fence rows were written).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from booking import BOOK_TURNS, Airline, booking_agent
from processes import BACKENDS, store_url
from tesserix_adk import (
    AgentRunner,
    CheckpointCorruptError,
    Checkpointer,
    CheckpointTooLargeError,
    ConfigurationError,
    LeaseLostError,
    LeasePolicy,
    Message,
    NoCheckpointError,
    ResumeConflictError,
    ResumeError,
    Resumer,
    ScriptedProvider,
    StaleFenceError,
    ToolCall,
    Usage,
)
from tesserix_adk.checkpoint.checkpointer import TranscriptCursor
from tesserix_adk.checkpoint.payload import Boundary, Checkpoint, CheckpointStatus, OutstandingCall
from tesserix_adk.checkpoint.payload.frontier import Carrier
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.stores.memory import (
    MemoryCheckpointStore,
    MemoryIdempotencyStore,
    MemoryLeaseStore,
)
from tesserix_adk.stores.protocols import RecordStatus, ToolFlags
from tesserix_adk.stores.urls import open_stores
from tesserix_adk.testing import FakeClock
from tesserix_adk.testing.faults import FaultyCheckpointStore, SimulatedCrash

TENANT = "acme"

# --- helpers -----------------------------------------------------------------------------


async def interrupted(stores: Stores, run_id: str, tenant: str = TENANT) -> AgentRunner:
    """A booking run that "died" right after its iteration-1 frontier (book_seat asked
    for, not sent); the lease the dead process left is handed back, as if it lapsed."""
    runner = AgentRunner(
        ScriptedProvider(BOOK_TURNS),
        idempotency=stores.idempotency,
        checkpoints=Checkpointer(
            FaultyCheckpointStore(
                stores.checkpoints, crash_after=lambda body: body.get("iteration") == 1
            ),
            history=stores.history,
        ),
        leases=stores.leases,
        ledger=stores.ledger,
        approvals=stores.approvals,
    )
    with pytest.raises(SimulatedCrash):
        await runner.run(booking_agent(Airline()), "book", tenant=tenant, run_id=run_id)
    left = await stores.leases.current(tenant, run_id)
    if left is not None:
        await stores.leases.release(left)
    return runner


def resumer_of(stores: Stores, policy: LeasePolicy | None = None) -> Resumer:
    return Resumer.from_stores(stores, policy=policy)


async def rewrite(stores: Stores, run_id: str, *, max_bytes: int = 1 << 20, **changes: Any) -> None:
    """Write the run's frontier again, one step on, with ``changes`` (as another carrier
    or an earlier ending would have left it)."""
    checkpoints = Checkpointer(stores.checkpoints, history=stores.history, max_bytes=max_bytes)
    latest = await checkpoints.latest(TENANT, run_id)
    assert latest is not None
    messages = tuple(await checkpoints.messages(latest))
    frontier = dataclasses.replace(
        latest, step=latest.step + 1, messages=messages, history_handle=None, **changes
    )
    await checkpoints.write(
        frontier, cursor=TranscriptCursor(handle=latest.history_handle, persisted=len(messages))
    )


@pytest.fixture
async def memory() -> Any:
    async with open_stores("memory://") as stores:
        yield stores


# --- two real processes on one run; SIGKILL; the dead holder's writes --------------------

RACER = """
import asyncio, json, os, sys
from tesserix_adk import Checkpointer, LeasePolicy, ResumeConflictError, Resumer
from tesserix_adk.stores.urls import open_stores

url, run_id, worker, gate = sys.argv[1:5]


async def main():
    async with open_stores(url) as s:
        reads = []
        inner = s.checkpoints.latest

        async def latest(*a, **k):
            reads.append(1)
            return await inner(*a, **k)

        s.checkpoints.latest = latest
        r = Resumer(
            Checkpointer(s.checkpoints, history=s.history), s.leases, s.history,
            s.idempotency, policy=LeasePolicy(ttl=2.5, renew_within=0.5),
        )
        print(json.dumps({"ready": True}), flush=True)
        while not os.path.exists(gate):
            await asyncio.sleep(0.002)
        try:
            c = await r.resume(run_id, tenant="acme", worker=worker)
        except ResumeConflictError as e:
            print(json.dumps({"won": False, "holder": e.holder, "reads": len(reads)}), flush=True)
            return
        print(json.dumps({
            "won": True, "holder": c.lease.holder, "fence": c.lease.fence, "reads": len(reads),
            "to_dispatch": [p.tool for p in c.plan.to_dispatch],
        }), flush=True)
        await asyncio.sleep(3600)


asyncio.run(main())
"""


def _racer(script: Path, url: str, run_id: str, worker: str, gate: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(script), url, run_id, worker, str(gate)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.parametrize("backend", BACKENDS)
async def test_two_processes_one_wins_the_loser_reads_nothing_and_a_killed_holder_is_fenced(
    backend: str, tmp_path: Path
) -> None:
    script = tmp_path / "racer.py"
    script.write_text(RACER)
    gate = tmp_path / "gate"
    run_id = f"race-{os.getpid()}-{time.monotonic_ns()}"
    async with store_url(backend, tmp_path) as url, open_stores(url) as stores:
        await stores.create_schema()
        await interrupted(stores, run_id)
        before = await stores.checkpoints.latest(TENANT, run_id)
        assert before is not None
        procs = [_racer(script, url, run_id, f"p{i}", gate) for i in range(2)]
        try:
            for p in procs:
                assert p.stdout is not None
                assert json.loads(p.stdout.readline()) == {"ready": True}
            gate.touch()
            said = [json.loads(p.stdout.readline()) for p in procs if p.stdout is not None]
            winners = [s for s in said if s["won"]]
            losers = [s for s in said if not s["won"]]
            assert len(winners) == 1 and len(losers) == 1, said
            won = winners[0]
            assert won["to_dispatch"] == ["book_seat"] and won["reads"] >= 1
            assert losers[0]["holder"] == won["holder"]
            assert losers[0]["reads"] == 0  # the loser never read the frontier
            holder = procs[said.index(won)]

            resumer = resumer_of(stores, LeasePolicy(ttl=2.5, renew_within=0.5))
            with pytest.raises(ResumeConflictError) as err:
                await resumer.resume(run_id, tenant=TENANT, worker="me")
            assert err.value.holder == won["holder"]
            assert procs[said.index(losers[0])].wait(timeout=10) == 0

            holder.send_signal(signal.SIGKILL)
            holder.wait(timeout=10)
            deadline = time.monotonic() + 10
            while True:
                try:
                    carried = await resumer.resume(run_id, tenant=TENANT, worker="me")
                    break
                except ResumeConflictError:
                    assert time.monotonic() < deadline, "the dead holder's lease never lapsed"
                    await asyncio.sleep(0.1)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait(timeout=10)
                if p.stdout is not None:
                    p.stdout.close()
                if p.stderr is not None:
                    p.stderr.close()
        assert carried.lease.fence > won["fence"]
        assert [p.tool for p in carried.plan.to_dispatch] == ["book_seat"]

        # The killed holder's writes, had it been only frozen, are refused in every store.
        old = won["fence"]
        with pytest.raises(StaleFenceError):
            await stores.checkpoints.put(
                TENANT, run_id, before.payload, step=before.step + 1, fence=old
            )
        assert stores.history is not None
        with pytest.raises(StaleFenceError):
            await stores.history.append(TENANT, run_id, [b"{}"], fence=old, after=None)
        key = carried.plan.to_dispatch[0].key
        assert key is not None
        with pytest.raises(StaleFenceError):
            await stores.idempotency.claim(
                key,
                holder=won["holder"],
                tenant=TENANT,
                run_id=run_id,
                iteration=1,
                tool="book_seat",
                call_id="call_1_0",
                flags=ToolFlags(),
                fence=old,
            )
        assert await stores.idempotency.lookup([key], tenant=TENANT) == {}
        after = await stores.checkpoints.latest(TENANT, run_id)
        assert after is not None and after.step == before.step
        again = await resumer_of(stores).checkpoints.messages(carried.checkpoint)
        assert [m.text for m in again] == [m.text for m in carried.messages]
        await stores.leases.release(carried.lease)


# --- a CarriedRun used after its lease lapsed or was taken; releasing twice ---------------


class Fleet:
    """Memory stores on one fake clock, so a lease lapses when the test says so."""

    def __init__(self) -> None:
        self.clock = FakeClock()
        self.leases = MemoryLeaseStore(clock=self.clock)
        self.idempotency = MemoryIdempotencyStore(clock=self.clock)
        self.store = MemoryCheckpointStore()

    def resumer(self) -> Resumer:
        return Resumer(Checkpointer(self.store), self.leases, None, self.idempotency)

    def runner(self) -> AgentRunner:
        return AgentRunner(
            ScriptedProvider(BOOK_TURNS),
            idempotency=self.idempotency,
            checkpoints=Checkpointer(self.store),
            leases=self.leases,
        )


async def test_a_superseded_carried_run_cannot_renew_claim_or_release_the_new_holder() -> None:
    fleet = Fleet()
    faulty = FaultyCheckpointStore(fleet.store, crash_after=lambda b: b.get("iteration") == 1)
    with pytest.raises(SimulatedCrash):
        await AgentRunner(
            ScriptedProvider(BOOK_TURNS),
            idempotency=fleet.idempotency,
            checkpoints=Checkpointer(faulty),
            leases=fleet.leases,
        ).run(booking_agent(Airline()), "book", tenant=TENANT, run_id="r")
    fleet.clock.advance(31)  # the crashed run's lease lapses

    a = await fleet.resumer().resume("r", tenant=TENANT, worker="a")
    fleet.clock.advance(31)  # a's driver stalled past its ttl
    with pytest.raises(LeaseLostError):  # lapsed, even though nobody took it yet
        await fleet.leases.renew(a.lease, 30)
    b = await fleet.resumer().resume("r", tenant=TENANT, worker="b")
    assert b.lease.fence > a.lease.fence
    with pytest.raises(LeaseLostError):
        await fleet.leases.renew(a.lease, 30)

    # a acts on its stale plan: book_seat "never ran". Its claim is fenced out.
    planned = a.plan.to_dispatch[0]
    assert planned.key is not None
    with pytest.raises(StaleFenceError):
        await fleet.idempotency.claim(
            planned.key,
            holder=a.lease.holder,
            tenant=TENANT,
            run_id="r",
            iteration=planned.iteration,
            tool=planned.tool,
            call_id=planned.call_id,
            flags=ToolFlags(),
            fence=a.lease.fence,
        )
    # a's driver releases its lease, twice: b keeps the run.
    await fleet.leases.release(a.lease)
    await fleet.leases.release(a.lease)
    current = await fleet.leases.current(TENANT, "r")
    assert current is not None and current.holder == b.lease.holder
    with pytest.raises(ResumeConflictError):
        await fleet.resumer().resume("r", tenant=TENANT, worker="c")
    # b releases twice too: the run is free, and the next taker's fence is higher still.
    await fleet.leases.release(b.lease)
    await fleet.leases.release(b.lease)
    c = await fleet.resumer().resume("r", tenant=TENANT, worker="c")
    assert c.lease.fence > b.lease.fence


async def test_a_plan_read_then_a_zombie_completes_the_call_stays_indeterminate_not_resent() -> (
    None
):
    """The zombie claimed book_seat, its lease lapsed; the resumer plans it indeterminate.
    The zombie then records its outcome (``complete`` is not fenced): the plan already
    handed over errs to the safe side, and a fresh resume replays it."""
    fleet = Fleet()
    airline = Airline()
    faulty = FaultyCheckpointStore(fleet.store)
    zombie = AgentRunner(
        ScriptedProvider(BOOK_TURNS),
        idempotency=fleet.idempotency,
        checkpoints=Checkpointer(faulty),
        leases=fleet.leases,
    )
    outcomes: list[tuple[str, bytes, str]] = []
    original = fleet.idempotency.complete

    async def die_before_complete(key: str, outcome: bytes, *, tenant: str, holder: str) -> Any:
        if airline.bookings:  # book_seat ran; the process froze before recording it
            outcomes.append((key, outcome, holder))
            raise SimulatedCrash
        return await original(key, outcome, tenant=tenant, holder=holder)

    fleet.idempotency.complete = die_before_complete  # type: ignore[method-assign]
    with pytest.raises(SimulatedCrash):
        await zombie.run(booking_agent(airline), "book", tenant=TENANT, run_id="z")
    fleet.idempotency.complete = original  # type: ignore[method-assign]
    fleet.clock.advance(31)

    carried = await fleet.resumer().resume("z", tenant=TENANT, worker="d")
    assert [p.tool for p in carried.plan.indeterminate] == ["book_seat"]
    assert not carried.plan.safe and carried.plan.to_dispatch == ()
    key, outcome, holder = outcomes[0]
    await original(key, outcome, tenant=TENANT, holder=holder)  # the zombie wakes up
    assert [p.tool for p in carried.plan.to_dispatch] == []
    await fleet.leases.release(carried.lease)
    fresh = await fleet.resumer().resume("z", tenant=TENANT, worker="e")
    assert [p.tool for p in fresh.plan.completed] == ["book_seat"]
    assert fresh.plan.safe and fresh.plan.to_dispatch == ()
    assert airline.bookings == ["LH123"]


async def test_a_takeover_seals_the_ledger_and_approvals_against_the_old_holder(
    memory: Stores,
) -> None:
    await interrupted(memory, "r")
    old = await memory.leases.acquire(TENANT, "r", "zombie", 30)
    await memory.leases.release(old)  # lapsed; the zombie is only frozen
    carried = await resumer_of(memory).resume("r", tenant=TENANT, worker="new")
    assert carried.lease.fence > old.fence
    refused: list[str] = []
    assert memory.ledger is not None and memory.approvals is not None
    try:
        await memory.ledger.charge(TENANT, "r", 1_000_000, Usage(input_tokens=9), fence=old.fence)
    except StaleFenceError:
        refused.append("ledger")
    try:
        await memory.approvals.request(
            TENANT,
            "r",
            [ToolCall(id="x", name="book_seat", arguments={"flight": "LH999"})],
            iteration=1,
            fence=old.fence,
        )
    except StaleFenceError:
        refused.append("approvals")
    assert refused == ["ledger", "approvals"]


# --- runs that must not be carried: typed errors, lease handed back ----------------------


async def test_a_tombstone_is_refused_typed_and_the_lease_handed_back(memory: Stores) -> None:
    await interrupted(memory, "t")
    await rewrite(memory, "t", max_bytes=200)
    latest = await Checkpointer(memory.checkpoints, history=memory.history).latest(TENANT, "t")
    assert latest is not None and latest.is_tombstone
    with pytest.raises(CheckpointTooLargeError) as err:
        await resumer_of(memory).resume("t", tenant=TENANT, worker="w")
    assert err.value.retryable is False
    assert await memory.leases.current(TENANT, "t") is None


async def test_a_damaged_frontier_is_refused_typed_and_the_lease_handed_back(
    memory: Stores,
) -> None:
    await interrupted(memory, "d")
    stored = await memory.checkpoints.latest(TENANT, "d")
    assert stored is not None
    await memory.checkpoints.put(
        TENANT, "d", stored.payload[: len(stored.payload) // 2], step=stored.step + 1, fence=1
    )
    with pytest.raises(CheckpointCorruptError):
        await resumer_of(memory).resume("d", tenant=TENANT, worker="w")
    assert await memory.leases.current(TENANT, "d") is None
    with pytest.raises(CheckpointCorruptError):  # again, not stuck behind a lease
        await resumer_of(memory).resume("d", tenant=TENANT, worker="w")


async def test_another_tenants_run_is_not_found_and_its_owner_keeps_it(memory: Stores) -> None:
    await interrupted(memory, "mine")
    with pytest.raises(NoCheckpointError):
        await resumer_of(memory).resume("mine", tenant="evil", worker="w")
    assert await memory.leases.current("evil", "mine") is None
    carried = await resumer_of(memory).resume("mine", tenant=TENANT, worker="w")
    assert carried.checkpoint.tenant == TENANT
    assert [p.tool for p in carried.plan.to_dispatch] == ["book_seat"]


NOT_CARRIED = [
    pytest.param(
        {"status": CheckpointStatus.failed},
        id="failed",
    ),
    pytest.param(
        {"replay_of": "original-run"},
        id="unfinished-replay",
    ),
    pytest.param(
        {"carried_by": Carrier.temporal},
        id="carried-by-temporal",
    ),
]


@pytest.mark.parametrize("changes", NOT_CARRIED)
async def test_a_run_the_kit_does_not_carry_on_is_refused_typed(
    memory: Stores, changes: dict[str, Any]
) -> None:
    await interrupted(memory, "n")
    await rewrite(memory, "n", **changes)
    with pytest.raises(ResumeError):
        carried = await resumer_of(memory).resume("n", tenant=TENANT, worker="w")
        pytest.fail(
            f"handed over {carried.checkpoint.status} with to_dispatch "
            f"{[p.tool for p in carried.plan.to_dispatch]}"
        )
    assert await memory.leases.current(TENANT, "n") is None


async def test_a_completed_run_is_handed_over_with_nothing_to_do(memory: Stores) -> None:
    await interrupted(memory, "c")
    await rewrite(memory, "c", status=CheckpointStatus.completed, outstanding=())
    carried = await resumer_of(memory).resume("c", tenant=TENANT, worker="w")
    assert carried.checkpoint.status.finished
    assert carried.plan.calls == ()
    await memory.leases.release(carried.lease)


async def test_a_run_whose_cancel_stands_is_not_handed_over_with_calls_to_send(
    memory: Stores,
) -> None:
    runner = await interrupted(memory, "x")
    zombie = await memory.leases.acquire(TENANT, "x", "zombie", 30)
    assert await runner.cancel("x", tenant=TENANT, by="ops", reason="wrong flight") is None
    await memory.leases.release(zombie)  # the holder died before its next boundary
    try:
        carried = await resumer_of(memory).resume("x", tenant=TENANT, worker="w")
    except ResumeError:
        return  # refused: what a driver needs
    assert carried.plan.to_dispatch == (), [p.describe() for p in carried.plan.to_dispatch]


# --- ids the runner refuses ----------------------------------------------------------------


def _fence_rows(path: Path) -> list[tuple[str, str]]:
    with sqlite3.connect(path) as db:
        return [(str(t), str(r)) for t, r in db.execute("SELECT tenant, run_id FROM adk_fences")]


async def test_ids_no_store_can_keep_are_refused_before_anything_is_written(
    tmp_path: Path,
) -> None:
    path = tmp_path / "ids.sqlite3"
    async with open_stores(f"sqlite:///{path}") as stores:
        await stores.create_schema()
        resumer = resumer_of(stores)
        wrong: dict[str, str] = {}
        for run_id in ("", "x" * 5000, "\ud800"):
            try:
                await resumer.resume(run_id, tenant=TENANT, worker="w")
                wrong[repr(run_id)[:12]] = "carried"
            except ConfigurationError:
                pass
            except Exception as exc:
                wrong[repr(run_id)[:12]] = type(exc).__name__
    assert wrong == {}
    assert _fence_rows(path) == []


async def test_ids_with_odd_but_storable_characters_are_their_own_runs(tmp_path: Path) -> None:
    async with open_stores(f"sqlite:///{tmp_path / 'odd.sqlite3'}") as stores:
        await stores.create_schema()
        await interrupted(stores, "a/b%2F")
        for near in ("a/b%2f", "a/b/", "a/b%2F ", "a%2Fb%2F"):
            with pytest.raises(NoCheckpointError):
                await resumer_of(stores).resume(near, tenant=TENANT, worker="w")
        carried = await resumer_of(stores).resume("a/b%2F", tenant=TENANT, worker="w")
        assert carried.checkpoint.run_id == "a/b%2F"
        await stores.leases.release(carried.lease)


# --- the plan against what the records say (hypothesis) ------------------------------------

RECORD = st.sampled_from(["none", "in_flight", "completed", "never_ran"])
CALL = st.tuples(st.booleans(), st.booleans(), RECORD)  # side_effects, idempotent, record


async def _plan_of(calls: list[tuple[bool, bool, str]]) -> tuple[Any, list[str]]:
    store, idem, leases = MemoryCheckpointStore(), MemoryIdempotencyStore(), MemoryLeaseStore()
    checkpoints = Checkpointer(store)
    asked = [ToolCall(id=f"c{i}", name=f"t{i}", arguments={"n": i}) for i in range(len(calls))]
    outstanding = tuple(
        OutstandingCall(call=c, key=f"k-{c.id}", side_effects=se, idempotent=ide)
        for c, (se, ide, _) in zip(asked, calls, strict=True)
    )
    messages = (
        Message(role="user", content="go"),
        Message(role="assistant", content="", tool_calls=tuple(asked)),
    )
    frontier = Checkpoint(
        tenant=TENANT,
        run_id="h",
        agent_name="prop",
        agent_revision="sha256:x",
        step=1,
        boundary=Boundary.after_model_call,
        status=CheckpointStatus.running,
        iteration=0,
        messages=messages,
        outstanding=outstanding,
    )
    assert await checkpoints.write(frontier, cursor=TranscriptCursor()), checkpoints.last_error
    for oc, (se, ide, rec) in zip(outstanding, calls, strict=True):
        assert oc.key is not None
        if rec == "none":
            continue
        await idem.claim(
            oc.key,
            holder="zombie",
            tenant=TENANT,
            run_id="h",
            iteration=0,
            tool=oc.call.name,
            call_id=oc.call.id,
            flags=ToolFlags(side_effects=se, idempotent=ide),
        )
        if rec == "completed":
            await idem.complete(oc.key, b'{"content": "ok"}', tenant=TENANT, holder="zombie")
        elif rec == "never_ran":
            await idem.resolve(oc.key, tenant=TENANT, never_ran=True, by="ops")
    carried = await Resumer(checkpoints, leases, None, idem).resume("h", tenant=TENANT, worker="w")
    records = await idem.lookup([o.key for o in outstanding if o.key], tenant=TENANT)
    truth = ["none" if o.key not in records else str(records[o.key].status) for o in outstanding]
    return carried.plan, truth


def _oracle(side_effects: bool, idempotent: bool, record: str) -> str:
    if record == "completed":
        return "completed"
    if record == "in_flight" and side_effects and not idempotent:
        return "indeterminate"
    return "never_ran"


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(calls=st.lists(CALL, min_size=1, max_size=4))
def test_the_plan_never_sends_a_completed_call_and_never_guesses_an_in_flight_one(
    calls: list[tuple[bool, bool, str]],
) -> None:
    plan, truth = asyncio.run(_plan_of(calls))
    assert truth == [
        "none" if r == "none" else str(RecordStatus(r)) for _, _, r in calls
    ]  # the records are what the example says
    by_call = {p.call_id: p for p in plan.calls}
    assert sorted(by_call) == sorted(f"c{i}" for i in range(len(calls)))
    assert len(plan.calls) == len(calls)  # each call once
    for i, (se, ide, rec) in enumerate(calls):
        planned = by_call[f"c{i}"]
        assert planned.disposition == _oracle(se, ide, rec), (calls, planned.describe())
        if rec == "completed":
            assert planned not in plan.to_dispatch
        if rec == "in_flight" and se and not ide:
            assert planned in plan.indeterminate and not planned.takeover
    assert plan.safe == all(_oracle(*c) != "indeterminate" for c in calls)
