"""Attacks on write groups (commit 49b2095, ``run.grouping`` and ``SqliteWriteGroup``).

On SQLite a run's charge, ``after_model_call`` frontier and first claim commit in one
transaction right before the call goes out; each outcome commits with the next claim; while
a group is open every other caller of the file (any task, thread or event loop) waits for
its commit. Every test here uses a real SQLite file and looks at it through a second
connection (as another process would) where durability matters. Each is a promise that
holds and fails if it breaks: every defect the attack found is fixed, its test kept.
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from run.helpers import database_of, scripted, statuses
from sqlite_writes import interrupts_itself
from tesserix_adk import (
    Agent,
    AgentRunner,
    FrontierWritten,
    Reconciled,
    RunFinished,
    ScriptedProvider,
    ToolCallAsked,
    tool,
)
from tesserix_adk.checkpoint.checkpointer import Checkpointer
from tesserix_adk.checkpoint.payload import Boundary
from tesserix_adk.errors import (
    IndeterminateToolCallError,
    LeaseLostError,
    NoCheckpointError,
    StaleFenceError,
    StoreUnavailableError,
)
from tesserix_adk.leases import LeasePolicy
from tesserix_adk.messages import Usage
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.stores.protocols import RecordStatus
from tesserix_adk.stores.sqlite.checkpoints import SqliteCheckpointStore
from tesserix_adk.stores.sqlite.database import SqliteDatabase
from tesserix_adk.stores.sqlite.grouping import SqliteWriteGroup
from tesserix_adk.stores.sqlite.idempotency import SqliteIdempotencyStore
from tesserix_adk.stores.sqlite.ledger import SqliteLedger
from tesserix_adk.stores.urls import open_stores

pytestmark = pytest.mark.usefixtures("grouped_writes")

TENANT = "t"
LIMIT = 30.0


def _work_rows(path: str, run_id: str) -> int:
    with contextlib.closing(sqlite3.connect(path)) as other:
        (n,) = other.execute("SELECT count(*) FROM adk_work WHERE run_id = ?", (run_id,)).fetchone()
    return int(n)


async def _latest(path: str, run_id: str) -> Any:
    """The run's latest frontier read through stores of their own (another connection)."""
    async with open_stores(f"sqlite:///{path}") as other:
        return await Checkpointer.from_stores(other).latest(TENANT, run_id)


async def _lock_is_free(stores: Stores) -> None:
    """Nobody holds the database's group lock: a plain write goes through promptly."""
    await asyncio.wait_for(stores.leases.current(TENANT, "nobody"), 5)
    await asyncio.wait_for(stores.work.want(TENANT, "probe", agent="g"), 5)  # type: ignore[union-attr]


class HookLedger(SqliteLedger):
    """A SQLite ledger that runs ``hook`` inside each charge, before charging (or after,
    with ``after``): the charge runs inside the run's open write group, so the hook sees the
    group open; the charge is the group's first write, so after it the group holds the
    connection."""

    def __init__(self, database: SqliteDatabase) -> None:
        super().__init__(database)
        self.hook: Any = None
        self.after = False

    async def charge(
        self, tenant: str, run_id: str, micros: int, usage: Usage, *, fence: int | None = None
    ) -> None:
        if self.hook is not None and not self.after:
            await self.hook(run_id)
        await super().charge(tenant, run_id, micros, usage, fence=fence)
        if self.hook is not None and self.after:
            await self.hook(run_id)


def _hooked(stores: Stores) -> HookLedger:
    ledger = HookLedger(database_of(stores))
    stores.ledger = ledger
    return ledger


# --- defects found at 49b2095, fixed since: regression tests ---------------------------


# Found at 49b2095, fixed in 4939a14: SqliteDatabase._group_lock is an asyncio.Lock made
# in __init__: once runs contend for it on one event loop, stores reused under another
# asyncio.run raise RuntimeError (bound to a different event loop) where they used to
# work
def test_stores_reused_across_event_loops_keep_working_once_runs_contend_in_each(
    path: str,
) -> None:
    stores = open_stores(f"sqlite:///{path}")

    @tool
    async def book(seat: str) -> str:
        await asyncio.sleep(0.005)
        return f"booked {seat}"

    async def four(tag: str) -> list[Any]:
        agent = Agent("g", "b", tools=[book])
        runs = [
            AgentRunner.from_stores(
                ScriptedProvider(scripted([("book", {"seat": "1"})])), stores
            ).run(agent, "go", tenant=TENANT, run_id=f"{tag}{i}")
            for i in range(4)
        ]
        return await asyncio.wait_for(asyncio.gather(*runs, return_exceptions=True), LIMIT)

    try:
        asyncio.run(stores.create_schema())
        first = asyncio.run(four("a"))
        second = asyncio.run(four("b"))
    finally:
        asyncio.run(stores.aclose())
    assert [getattr(r, "status", r) for r in first] == ["completed"] * 4
    assert [getattr(r, "status", r) for r in second] == ["completed"] * 4


class SlowEncoding(Checkpointer):
    """Encoding the ``after_model_call`` frontier takes 1.5 s (a large transcript): the
    kit does it in a worker thread so the event loop renews leases meanwhile."""

    def _encoded(self, frontier: Any, cursor: Any) -> Any:
        encoded = super()._encoded(frontier, cursor)
        if frontier.boundary is Boundary.after_model_call:
            time.sleep(1.5)
        return encoded


def _slow_runner(stores: Stores, script: list[Any]) -> AgentRunner:
    return AgentRunner(
        ScriptedProvider(script),
        idempotency=stores.idempotency,
        checkpoints=SlowEncoding(stores.checkpoints, history=stores.history),
        leases=stores.leases,
        ledger=stores.ledger,
        approvals=stores.approvals,
        lease_policy=LeasePolicy(ttl=1.0, renew_within=0.6),
    )


# Found at 49b2095, fixed in 4939a14: the write group opened before the ledger charge
# stays open (holding the database lock) while the after_model_call frontier is encoded
# off the loop, so the run's own lease renewal waits behind it and the lease lapses
# (LeaseLostError)
async def test_the_lease_keeps_renewing_while_a_large_frontier_is_encoded_off_the_loop(
    stores: Stores,
) -> None:
    sent: list[str] = []

    @tool
    def book(seat: str) -> str:
        sent.append(seat)
        return f"booked {seat}"

    runner = _slow_runner(stores, scripted([("book", {"seat": "1"})]))
    big = "x" * 40_000  # over OFF_LOOP_BYTES: encoded in a worker thread
    run = await asyncio.wait_for(
        runner.run(Agent("g", "b", tools=[book]), big, tenant=TENANT, run_id="r"), LIMIT
    )
    assert run.status == "completed"
    assert sent == ["1"]


# Found at 49b2095, fixed in 4939a14: the group's BEGIN IMMEDIATE (taken at the ledger
# charge) holds the file's write lock while the after_model_call frontier is encoded off
# the loop, so another process's writes wait out busy_timeout and fail 'locked'
async def test_another_process_can_write_while_a_large_frontier_is_encoded(
    stores: Stores, path: str
) -> None:
    @tool
    def book(seat: str) -> str:
        return f"booked {seat}"

    runner = _slow_runner(stores, scripted([("book", {"seat": "1"})]))
    # Another process's connection to the file, with a short busy timeout.
    other = SqliteDatabase(path, busy_timeout=0.5)
    outcome: list[str] = []

    async def write_meanwhile() -> None:
        await asyncio.sleep(0.5)  # the frontier is being encoded now
        try:
            await other.write(lambda conn: conn.execute("CREATE TABLE IF NOT EXISTS x (a)"))
            outcome.append("written")
        except StoreUnavailableError as exc:
            outcome.append(str(exc))

    meanwhile = asyncio.create_task(write_meanwhile())
    try:
        with contextlib.suppress(LeaseLostError):
            await asyncio.wait_for(
                runner.run(Agent("g", "b", tools=[book]), "x" * 40_000, tenant=TENANT, run_id="r"),
                LIMIT,
            )
        await asyncio.wait_for(meanwhile, LIMIT)
    finally:
        await other.aclose()
    assert outcome == ["written"]


class AbortingIdempotency(SqliteIdempotencyStore):
    """Before claiming ``abort_on``, one write that SQLite aborts together with its whole
    transaction (an interrupted INSERT; an I/O error or SQLITE_FULL can do the same)."""

    abort_on = "call_0_1"
    aborted = False

    async def claim(self, key: str, **kwargs: Any) -> Any:
        if kwargs.get("call_id") == self.abort_on and not self.aborted:
            self.aborted = True
            await self.database.write(interrupts_itself)
        return await super().claim(key, **kwargs)


# Found at 49b2095, fixed in 4939a14: _in_group carries on after a write whose error
# made SQLite roll back the whole group transaction (conn.in_transaction False): the
# outcome of a call that ran, held in the group, is silently lost, the next write opens
# a fresh transaction that commits, and no redo runs, so a resume refuses that call as
# indeterminate
async def test_an_outcome_held_in_a_group_survives_a_later_write_sqlite_aborts(
    stores: Stores, path: str
) -> None:
    stores.idempotency = AbortingIdempotency(database_of(stores))
    sent: list[str] = []

    @tool
    def book(seat: str) -> str:
        sent.append(seat)
        return f"booked {seat}"

    agent = Agent("g", "b", tools=[book])
    script = scripted([("book", {"seat": "a"}), ("book", {"seat": "b"})])
    runner = AgentRunner.from_stores(ScriptedProvider(script), stores)
    with pytest.raises(StoreUnavailableError):
        await asyncio.wait_for(runner.run(agent, "go", tenant=TENANT, run_id="r"), LIMIT)
    assert sent == ["a"]
    # The first call ran and the kit had its outcome in hand: it must be on record.
    assert statuses(path, "r").get("call_0_0") == RecordStatus.completed.value
    again = AgentRunner.from_stores(ScriptedProvider(script), stores)
    run = await asyncio.wait_for(again.resume(agent, "r", tenant=TENANT), LIMIT)
    assert run.status == "completed"
    assert sent == ["a", "b"]


class AbortingCheckpoints(SqliteCheckpointStore):
    """Writing the first frontier, one write SQLite aborts with its whole transaction (as
    an I/O error can); a checkpoint failure never fails the live run, so the run goes on."""

    aborted = False

    async def put_with_history(self, *args: Any, **kwargs: Any) -> Any:
        if not self.aborted:
            self.aborted = True
            await self.database.write(interrupts_itself)
        return await super().put_with_history(*args, **kwargs)


# Found at 49b2095, fixed in 4939a14: a checkpoint write that SQLite aborts with the
# group's transaction takes the group's ledger charge with it; the checkpoint failure is
# tolerated and the group goes on in a fresh transaction, so the run completes with a
# model call never charged
async def test_a_frontier_write_sqlite_aborts_does_not_take_the_turns_charge_with_it(
    stores: Stores, path: str
) -> None:
    stores.checkpoints = AbortingCheckpoints(database_of(stores))
    charged_when_sent: list[int | None] = []

    @tool
    def book(seat: str) -> str:
        # "The charge, the frontier and the claim are all there or none is": the claim is.
        with contextlib.closing(sqlite3.connect(path)) as other:
            row = other.execute("SELECT micros FROM adk_ledger WHERE run_id = 'r'").fetchone()
        charged_when_sent.append(None if row is None else int(row[0]))
        return f"booked {seat}"

    runner = AgentRunner.from_stores(ScriptedProvider(scripted([("book", {"seat": "a"})])), stores)
    with contextlib.suppress(StoreUnavailableError):  # stopping, retryably, is fine
        await asyncio.wait_for(
            runner.run(Agent("g", "b", tools=[book]), "go", tenant=TENANT, run_id="r"), LIMIT
        )
    # A call sent means its turn's model call (7 micros) is on the ledger, the authority.
    assert all(micros == 7 for micros in charged_when_sent), charged_when_sent


# Found at 49b2095, fixed in 4939a14: a task a tool spawns inherits the attempt's
# GroupScope, so a write of another run it makes while this run's group is open joins
# that group: it returns before it is durable, and is lost if this run's group is rolled
# back or its process dies
async def test_another_runs_write_from_a_tools_background_task_is_durable_when_it_returns(
    stores: Stores, path: str
) -> None:
    ledger = _hooked(stores)
    go, written = asyncio.Event(), asyncio.Event()
    durable_on_return: list[bool] = []

    async def submit_child() -> None:
        await go.wait()
        await stores.work.submit(TENANT, "child", agent="g", input=b"{}")  # type: ignore[union-attr]
        durable_on_return.append(_work_rows(path, "child") == 1)
        written.set()

    background: list[asyncio.Task[None]] = []

    @tool
    async def spawn(what: str) -> str:
        # Fire and forget: a follow-up run submitted in the background (once).
        if not background:
            background.append(asyncio.create_task(submit_child()))
        return f"spawned {what}"

    async def in_the_second_charge(run_id: str) -> None:
        if background:  # the second turn's charge: its group is open now
            go.set()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(written.wait(), 1.0)

    ledger.hook = in_the_second_charge
    script = scripted([("spawn", {"what": "x"})], [("spawn", {"what": "y"})])
    runner = AgentRunner.from_stores(ScriptedProvider(script), stores)
    run = await asyncio.wait_for(
        runner.run(Agent("g", "b", tools=[spawn]), "go", tenant=TENANT, run_id="r"), LIMIT
    )
    assert run.status == "completed"
    await asyncio.wait_for(asyncio.gather(*background), LIMIT)
    assert durable_on_return == [True]


# Found at 49b2095, fixed in 4939a14: a write that joins the group (joined() still sees
# it active) after the group's COMMIT was submitted runs after it in a fresh BEGIN
# IMMEDIATE nobody commits: it returns success, then the next plain write rolls it back
# ('a write group left open')
async def test_a_write_that_lands_while_the_group_commits_is_not_lost(
    stores: Stores, path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    loop = asyncio.get_running_loop()
    go = asyncio.Event()
    armed = threading.Event()
    real_commit = SqliteWriteGroup._commit

    def slow_commit(group: SqliteWriteGroup) -> None:
        # A commit that takes a while to reach the disk (fsync), as commits do.
        if armed.is_set():
            armed.clear()
            loop.call_soon_threadsafe(go.set)
            time.sleep(0.3)
        real_commit(group)

    monkeypatch.setattr(SqliteWriteGroup, "_commit", slow_commit)
    returned: list[bool] = []

    async def submit_child() -> None:
        await go.wait()
        await stores.work.submit(TENANT, "child", agent="g", input=b"{}")  # type: ignore[union-attr]
        returned.append(True)

    background: list[asyncio.Task[None]] = []

    async def spawn(what: str) -> str:
        background.append(asyncio.create_task(submit_child()))
        armed.set()  # the next group commit (this outcome's) is the slow one
        return f"spawned {what}"

    spawning = tool(spawn)
    script = scripted([("spawn", {"what": "x"})])
    runner = AgentRunner.from_stores(ScriptedProvider(script), stores)
    run = await asyncio.wait_for(
        runner.run(Agent("g", "b", tools=[spawning]), "go", tenant=TENANT, run_id="r"), LIMIT
    )
    assert run.status == "completed"
    await asyncio.wait_for(asyncio.gather(*background), LIMIT)
    assert returned == [True]
    await stores.leases.current(TENANT, "anything")  # one more plain call on the file
    assert _work_rows(path, "child") == 1


# --- promises that held -------------------------------------------------------------------


async def test_side_by_side_calls_each_find_their_claim_and_frontier_durable(
    stores: Stores, path: str
) -> None:
    seen: dict[str, tuple[str | None, int]] = {}

    @tool
    async def book(seat: str) -> str:
        records = statuses(path, "r")
        with contextlib.closing(sqlite3.connect(path)) as other:
            (steps,) = other.execute(
                "SELECT count(*) FROM adk_frontiers WHERE run_id = 'r'"
            ).fetchone()
        seen[seat] = (records.get(f"call_0_{int(seat)}"), int(steps))
        await asyncio.sleep(0.02)
        return f"booked {seat}"

    calls = [("book", {"seat": str(i)}) for i in range(3)]
    runner = AgentRunner.from_stores(ScriptedProvider(scripted(calls)), stores)
    agent = Agent("g", "b", tools=[book], parallel_tool_calls=3)
    run = await asyncio.wait_for(runner.run(agent, "go", tenant=TENANT, run_id="r"), LIMIT)
    assert run.status == "completed"
    assert seen == {str(i): (RecordStatus.in_flight.value, 1) for i in range(3)}
    assert set(statuses(path, "r").values()) == {RecordStatus.completed.value}
    await _lock_is_free(stores)


async def test_an_unkeyed_side_effecting_call_goes_out_only_once_its_frontier_is_durable(
    stores: Stores, path: str
) -> None:
    seen: list[Any] = []

    @tool(key=None)
    async def notify(who: str) -> str:
        seen.append(await _latest(path, "r"))
        return f"notified {who}"

    script = scripted([("notify", {"who": "a"})], [("notify", {"who": "b"})])
    runner = AgentRunner.from_stores(ScriptedProvider(script), stores)
    run = await asyncio.wait_for(
        runner.run(Agent("g", "n", tools=[notify]), "go", tenant=TENANT, run_id="r"), LIMIT
    )
    assert run.status == "completed"
    assert [(cp.boundary, cp.iteration) for cp in seen] == [
        (Boundary.after_model_call, 0),
        (Boundary.after_model_call, 1),
    ]
    assert all(cp.outstanding[0].call.name == "notify" for cp in seen)


async def test_a_run_cancelled_inside_its_group_lets_go_and_is_not_swallowed(
    stores: Stores, path: str
) -> None:
    ledger = _hooked(stores)
    inside, never = asyncio.Event(), asyncio.Event()
    sent: list[str] = []

    async def stuck(run_id: str) -> None:
        if run_id == "stuck":
            inside.set()
            await never.wait()

    ledger.hook = stuck
    ledger.after = True  # the group holds the connection while it is stuck

    @tool
    def book(seat: str) -> str:
        sent.append(seat)
        return f"booked {seat}"

    agent = Agent("g", "b", tools=[book])
    script = scripted([("book", {"seat": "1"})])
    task = asyncio.create_task(
        AgentRunner.from_stores(ScriptedProvider(script), stores).run(
            agent, "go", tenant=TENANT, run_id="stuck"
        )
    )
    await asyncio.wait_for(inside.wait(), LIMIT)
    # Another run now waits for the group's lock (its lease acquire); cancel it there.
    waiting = asyncio.create_task(
        AgentRunner.from_stores(ScriptedProvider(script), stores).run(
            agent, "go", tenant=TENANT, run_id="waiting"
        )
    )
    await asyncio.sleep(0.2)
    assert not waiting.done()
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(waiting, 10)
    # And the run holding the group, cancelled inside its ledger charge.
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 10)
    assert sent == []
    await _lock_is_free(stores)
    # Nothing of either turn was durable, so both start again and book exactly once each.
    ledger.hook = None
    for run_id in ("stuck", "waiting"):
        latest = await _latest(path, run_id)
        assert latest is None or latest.iteration == 0
        again = AgentRunner.from_stores(ScriptedProvider(script), stores)
        try:
            run = await asyncio.wait_for(again.resume(agent, run_id, tenant=TENANT), LIMIT)
        except NoCheckpointError:
            run = await asyncio.wait_for(
                again.run(agent, "go", tenant=TENANT, run_id=run_id), LIMIT
            )
        assert run.status == "completed"
    assert sent == ["1", "1"]


async def test_a_consumer_leaving_the_stream_mid_group_leaves_nothing_held(
    stores: Stores,
) -> None:
    sent: list[str] = []

    @tool
    async def book(seat: str) -> str:
        sent.append(seat)
        return f"booked {seat}"

    agent = Agent("g", "b", tools=[book])
    script = scripted([("book", {"seat": "1"})])
    runner = AgentRunner.from_stores(ScriptedProvider(script), stores)

    async def leave_early() -> None:
        async with contextlib.aclosing(
            runner.stream(agent, "go", tenant=TENANT, run_id="r")
        ) as events:
            async for event in events:
                if isinstance(event, ToolCallAsked):
                    break

    await asyncio.wait_for(leave_early(), LIMIT)
    await _lock_is_free(stores)
    again = AgentRunner.from_stores(ScriptedProvider(script), stores)
    try:
        run = await asyncio.wait_for(again.resume(agent, "r", tenant=TENANT), LIMIT)
    except NoCheckpointError:
        run = await asyncio.wait_for(again.run(agent, "go", tenant=TENANT, run_id="r"), LIMIT)
    except IndeterminateToolCallError:
        # Claimed and maybe sent: never guessed, never sent twice.
        assert len(sent) <= 1
        return
    assert run.status == "completed"
    assert sent == ["1"]


class Death(BaseException):
    """A stand-in for the process dying inside a tool."""


async def test_a_tool_dying_leaves_its_claim_durable_and_the_resume_refuses_it(
    stores: Stores, path: str
) -> None:
    @tool
    def book(seat: str) -> str:
        raise Death

    agent = Agent("g", "b", tools=[book])
    script = scripted([("book", {"seat": "1"})])
    with pytest.raises(Death):
        await asyncio.wait_for(
            AgentRunner.from_stores(ScriptedProvider(script), stores).run(
                agent, "go", tenant=TENANT, run_id="r"
            ),
            LIMIT,
        )
    await _lock_is_free(stores)
    assert statuses(path, "r") == {"call_0_0": RecordStatus.in_flight.value}
    with pytest.raises(IndeterminateToolCallError, match="book"):
        await asyncio.wait_for(
            AgentRunner.from_stores(ScriptedProvider(script), stores).resume(
                agent, "r", tenant=TENANT
            ),
            LIMIT,
        )


async def test_a_run_waiting_on_an_approval_has_its_request_and_frontier_durable(
    stores: Stores, path: str
) -> None:
    @tool(requires_approval=True)
    def pay(amount: int) -> str:
        return f"paid {amount}"

    runner = AgentRunner.from_stores(ScriptedProvider(scripted([("pay", {"amount": 5})])), stores)
    run = await asyncio.wait_for(
        runner.run(Agent("g", "p", tools=[pay]), "go", tenant=TENANT, run_id="r"), LIMIT
    )
    assert run.status == "waiting_approval"
    latest = await _latest(path, "r")
    assert latest.boundary is Boundary.before_approval
    with contextlib.closing(sqlite3.connect(path)) as other:
        (asked,) = other.execute("SELECT count(*) FROM adk_approvals WHERE run_id = 'r'").fetchone()
    assert asked == 1
    await _lock_is_free(stores)


async def test_runs_ending_on_max_iterations_or_the_budget_have_a_durable_final_frontier(
    stores: Stores, path: str
) -> None:
    @tool
    def book(seat: str) -> str:
        return f"booked {seat}"

    script = scripted(*([("book", {"seat": str(i)})] for i in range(5)))
    capped = Agent("g", "b", tools=[book], max_iterations=2)
    broke = Agent("h", "b", tools=[book], budget_micros=10)
    for agent, run_id, status in (
        (capped, "cap", "max_iterations"),
        (broke, "bud", "budget_exhausted"),
    ):
        runner = AgentRunner.from_stores(ScriptedProvider(script), stores)
        run = await asyncio.wait_for(runner.run(agent, "go", tenant=TENANT, run_id=run_id), LIMIT)
        assert run.status == status
        latest = await _latest(path, run_id)
        assert latest.status.value == status
        assert set(statuses(path, run_id).values()) == {RecordStatus.completed.value}
    with contextlib.closing(sqlite3.connect(path)) as other:
        (spent,) = other.execute("SELECT micros FROM adk_ledger WHERE run_id = 'bud'").fetchone()
    assert spent == 14  # two model calls of 7, both charged
    await _lock_is_free(stores)


async def test_runners_on_two_opens_of_one_file_carry_their_runs_side_by_side(
    stores: Stores, path: str
) -> None:
    sent: list[str] = []

    @tool
    async def book(seat: str) -> str:
        await asyncio.sleep(0.005)
        sent.append(seat)
        return f"booked {seat}"

    agent = Agent("g", "b", tools=[book])
    script = scripted([("book", {"seat": "a"}), ("book", {"seat": "b"})], [("book", {"seat": "c"})])
    async with open_stores(f"sqlite:///{path}") as second:
        runs = [
            AgentRunner.from_stores(ScriptedProvider(script), bundle).run(
                agent, "go", tenant=TENANT, run_id=f"r{i}"
            )
            for i, bundle in enumerate([stores, second] * 3)
        ]
        done = await asyncio.wait_for(asyncio.gather(*runs), LIMIT)
    assert [r.status for r in done] == ["completed"] * 6
    assert sorted(sent) == sorted(["a", "b", "c"] * 6)
    for i in range(6):
        assert set(statuses(path, f"r{i}").values()) == {RecordStatus.completed.value}


async def test_a_lease_taken_over_while_a_group_is_open_stops_the_old_holder_unsent(
    stores: Stores, path: str
) -> None:
    ledger = _hooked(stores)
    sent: list[str] = []
    inside, taken = asyncio.Event(), asyncio.Event()

    @tool
    def book(seat: str) -> str:
        sent.append(seat)
        return f"booked {seat}"

    agent = Agent("g", "b", tools=[book])
    script = scripted([("book", {"seat": "1"})])

    async def wait_for_takeover(run_id: str) -> None:
        inside.set()  # the group is open: the model answered, the charge is next
        await taken.wait()

    ledger.hook = wait_for_takeover
    old = AgentRunner.from_stores(
        ScriptedProvider(script), stores, lease_policy=LeasePolicy(ttl=0.5, renew_within=0.25)
    )
    first = asyncio.create_task(old.run(agent, "go", tenant=TENANT, run_id="r"))
    # Another process: its own open of the file. The group takes the file's write lock
    # only at its first write, so the old holder's lease is ended here as if its renewals
    # had stalled past the ttl, and the new holder takes it.
    await asyncio.wait_for(inside.wait(), LIMIT)
    async with open_stores(f"sqlite:///{path}") as other:
        deadline = time.monotonic() + LIMIT
        while True:
            with contextlib.closing(sqlite3.connect(path)) as clock:
                clock.execute("UPDATE adk_run_leases SET expires_at = 0 WHERE run_id = 'r'")
                clock.commit()
            try:
                lease = await other.leases.acquire(TENANT, "r", "intruder", 30.0)
                break
            except Exception:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.1)
        taken.set()
        with pytest.raises((StaleFenceError, LeaseLostError)):
            await asyncio.wait_for(first, LIMIT)
        await other.leases.release(lease)
    assert sent == []
    assert statuses(path, "r") == {}
    await _lock_is_free(stores)


def test_a_worker_killed_at_its_model_call_pause_left_that_frontier_durable(
    tmp_path: Path,
) -> None:
    from processes import TENANT as SITE_TENANT
    from processes import Site

    site = Site(tmp_path)
    site.kill_at("r", "model_call")  # a real process, SIGKILLed at the pause

    async def latest() -> Any:
        async with open_stores(site.store) as other:
            return await Checkpointer.from_stores(other).latest(SITE_TENANT, "r")

    frontier = asyncio.run(latest())
    assert frontier is not None
    assert frontier.boundary is Boundary.after_model_call
    assert [oc.call.name for oc in frontier.outstanding] == ["book_seat"]
    # And the resume carries it on booking exactly once.
    site.wait_lease_lapsed("r")
    proc = site.worker("r", "--resume")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, out + err
    assert site.bookings("r") == 1


async def test_a_streamed_run_hears_each_frontier_incl_approval_and_final_once_durable(
    stores: Stores, path: str
) -> None:
    @tool
    def look(where: str) -> str:
        return f"looked {where}"

    @tool(requires_approval=True)
    def pay(amount: int) -> str:
        return f"paid {amount}"

    agent = Agent("g", "p", tools=[look, pay])
    heard: list[tuple[str, int, int | None]] = []

    async def listen(events: AsyncIterator[Any]) -> Any:
        async for event in events:
            if isinstance(event, FrontierWritten):
                with contextlib.closing(sqlite3.connect(path)) as other:
                    (durable,) = other.execute(
                        "SELECT max(step) FROM adk_checkpoint_steps WHERE run_id = 'r'"
                    ).fetchone()
                heard.append((event.boundary.value, event.step, durable))
            if isinstance(event, RunFinished):
                return event.run
        raise AssertionError("no RunFinished")

    script = scripted(
        [("look", {"where": "a"}), ("look", {"where": "b"})], [("pay", {"amount": 3})]
    )
    runner = AgentRunner.from_stores(ScriptedProvider(script), stores)
    run = await asyncio.wait_for(
        listen(runner.stream(agent, "go", tenant=TENANT, run_id="r")), LIMIT
    )
    assert run.status == "waiting_approval"
    assert stores.approvals is not None
    request = run.pending_approval
    await stores.approvals.decide(TENANT, request.id, approved=True, by="op")
    again = AgentRunner.from_stores(ScriptedProvider(script), stores)
    run = await asyncio.wait_for(listen(again.stream_resume(agent, "r", tenant=TENANT)), LIMIT)
    assert run.status == "completed"
    boundaries = [b for b, _, _ in heard]
    assert boundaries[:4] == [
        "after_model_call",
        "after_tool_result",
        "after_model_call",
        "before_approval",
    ]
    assert boundaries[-1] == "after_model_call"  # the final frontier
    assert all(durable is not None and durable >= step for _, step, durable in heard), heard


async def test_a_replay_of_a_grouped_run_leaves_the_original_alone_and_nothing_held(
    stores: Stores, path: str
) -> None:
    sent: list[str] = []

    @tool
    def book(seat: str) -> str:
        sent.append(seat)
        return f"booked {seat}"

    agent = Agent("g", "b", tools=[book])
    script = scripted([("book", {"seat": "a"}), ("book", {"seat": "b"})], [("book", {"seat": "c"})])
    runner = AgentRunner.from_stores(ScriptedProvider(script), stores)
    run = await asyncio.wait_for(runner.run(agent, "go", tenant=TENANT, run_id="r"), LIMIT)
    assert run.status == "completed"
    with contextlib.closing(sqlite3.connect(path)) as other:
        before = other.execute(
            "SELECT step, payload FROM adk_checkpoint_steps WHERE run_id = 'r' ORDER BY step"
        ).fetchall()
    stubbed: list[str] = []

    def fake(seat: str) -> dict[str, Any]:
        stubbed.append(seat)
        return {"ok": True}

    replayed = await asyncio.wait_for(
        AgentRunner.from_stores(ScriptedProvider(script), stores).replay(
            agent, "r", tenant=TENANT, from_step=1, stubs={"book": fake}
        ),
        LIMIT,
    )
    assert replayed.status == "completed"
    assert sent == ["a", "b", "c"] and stubbed == ["a", "b", "c"]
    with contextlib.closing(sqlite3.connect(path)) as other:
        after = other.execute(
            "SELECT step, payload FROM adk_checkpoint_steps WHERE run_id = 'r' ORDER BY step"
        ).fetchall()
    assert after == before
    assert set(statuses(path, replayed.run_id).values()) == {RecordStatus.completed.value}
    await _lock_is_free(stores)


class PausingClaims(SqliteIdempotencyStore):
    """After each call's claim (taken inside the run's open group), lets another thread's
    event loop make one call on the same stores before the group commits."""

    go: threading.Event
    done: threading.Event

    async def claim(self, key: str, **kwargs: Any) -> Any:
        taken = await super().claim(key, **kwargs)
        if kwargs.get("tool") is not None and not self.go.is_set():
            self.go.set()
            await asyncio.to_thread(self.done.wait, 5)
        return taken


async def test_a_claim_is_durable_when_sent_while_another_threads_loop_uses_the_stores(
    stores: Stores, path: str
) -> None:
    claims = PausingClaims(database_of(stores))
    claims.go, claims.done = threading.Event(), threading.Event()
    stores.idempotency = claims
    other_thread: list[str] = []

    def another_loop() -> None:
        # E.g. a Worker in a thread of its own, or a sync web framework's per-thread loop,
        # sharing the process's one open_stores bundle.
        claims.go.wait(LIMIT)

        async def look() -> None:
            await asyncio.wait_for(stores.leases.current(TENANT, "elsewhere"), 2)

        try:
            asyncio.run(look())
            other_thread.append("looked")
        except BaseException as exc:  # what it met is reported, not raised in a thread
            other_thread.append(repr(exc))
        finally:
            claims.done.set()

    claimed_when_sent: list[str | None] = []

    @tool
    def book(seat: str) -> str:
        claimed_when_sent.append(statuses(path, "r").get("call_0_0"))
        return f"booked {seat}"

    thread = threading.Thread(target=another_loop, daemon=True)
    thread.start()
    try:
        runner = AgentRunner.from_stores(
            ScriptedProvider(scripted([("book", {"seat": "1"})])), stores
        )
        with contextlib.suppress(Exception):
            await asyncio.wait_for(
                runner.run(Agent("g", "b", tools=[book]), "go", tenant=TENANT, run_id="r"), LIMIT
            )
    finally:
        claims.go.set()
        await asyncio.to_thread(thread.join, LIMIT)
    # No claim, no dispatch: whatever another loop did meanwhile.
    assert claimed_when_sent in ([], [RecordStatus.in_flight.value]), (
        claimed_when_sent,
        other_thread,
    )


async def test_a_tool_carrying_sub_runs_on_the_same_stores_never_waits_on_its_own_group(
    stores: Stores, path: str
) -> None:
    """Agent as a tool: the tool awaits a sub-run (and starts another in the background) on
    the very stores its run's groups use; neither may wait on a group its parent holds."""
    booked: list[str] = []

    @tool
    def book(seat: str) -> str:
        booked.append(seat)
        return f"booked {seat}"

    child = Agent("child", "b", tools=[book])
    background: list[asyncio.Task[Any]] = []

    @tool
    async def delegate(seat: str) -> str:
        inner = AgentRunner.from_stores(
            ScriptedProvider(scripted([("book", {"seat": seat})])), stores
        )
        run = await inner.run(child, "go", tenant=TENANT, run_id=f"sub-{seat}")
        later = AgentRunner.from_stores(
            ScriptedProvider(scripted([("book", {"seat": f"bg-{seat}"})])), stores
        )
        background.append(
            asyncio.create_task(later.run(child, "go", tenant=TENANT, run_id=f"bg-{seat}"))
        )
        return str(run.status)

    parent = Agent("parent", "d", tools=[delegate], parallel_tool_calls=2)
    script = scripted(
        [("delegate", {"seat": "a"}), ("delegate", {"seat": "b"})], [("delegate", {"seat": "c"})]
    )
    runner = AgentRunner.from_stores(ScriptedProvider(script), stores)
    run = await asyncio.wait_for(runner.run(parent, "go", tenant=TENANT, run_id="p"), LIMIT)
    assert run.status == "completed"
    finished = await asyncio.wait_for(asyncio.gather(*background), LIMIT)
    assert [r.status for r in finished] == ["completed"] * 3
    assert sorted(booked) == ["a", "b", "bg-a", "bg-b", "bg-c", "c"]
    for run_id in ("p", "sub-a", "sub-b", "sub-c", "bg-a", "bg-b", "bg-c"):
        assert set(statuses(path, run_id).values()) == {RecordStatus.completed.value}
    await _lock_is_free(stores)


async def test_a_reconciler_reading_the_same_stores_settles_a_call_without_a_hang(
    stores: Stores, path: str
) -> None:
    sent: list[str] = []

    async def look_up(call: Any, ctx: Any) -> Reconciled:
        # A reconciler that asks the kit's own stores (and the far side's, here a list).
        found = await stores.idempotency.lookup([ctx.idempotency_key], tenant=TENANT)
        assert ctx.idempotency_key in found
        return (
            Reconciled.completed(f"booked {call.arguments['seat']}")
            if sent
            else (Reconciled.never_ran())
        )

    @tool(reconcile=look_up)
    def book(seat: str) -> str:
        sent.append(seat)
        if len(sent) == 1:
            raise Death  # the process dies inside the call: its claim stays in flight
        return f"booked {seat}"

    agent = Agent("g", "b", tools=[book])
    script = scripted([("book", {"seat": "1"})], [("book", {"seat": "2"})])
    with pytest.raises(Death):
        await asyncio.wait_for(
            AgentRunner.from_stores(ScriptedProvider(script), stores).run(
                agent, "go", tenant=TENANT, run_id="r"
            ),
            LIMIT,
        )
    again = AgentRunner.from_stores(ScriptedProvider(script), stores, never_ran_margin=0.05)
    run = await asyncio.wait_for(again.resume(agent, "r", tenant=TENANT), LIMIT)
    assert run.status == "completed"
    assert sent == ["1", "2"]  # the first settled by the reconciler, never sent again
    assert set(statuses(path, "r").values()) == {RecordStatus.completed.value}
    await _lock_is_free(stores)


async def test_a_run_cancelled_while_waiting_to_record_its_outcome_records_it_first(
    stores: Stores, path: str
) -> None:
    """Run b's tool returned while run a holds a group: b waits for the lock to record its
    outcome, and is cancelled there. The outcome in hand is recorded to the end (once a's
    group commits), then the cancellation goes on, never swallowed."""
    ledger = _hooked(stores)
    b_in_tool, a_inside, release_a = asyncio.Event(), asyncio.Event(), asyncio.Event()
    sent: list[str] = []

    async def hold_a(run_id: str) -> None:
        if run_id == "a":
            a_inside.set()
            await release_a.wait()

    ledger.hook = hold_a
    ledger.after = True  # a's group holds the connection meanwhile

    @tool
    async def book(seat: str) -> str:
        sent.append(seat)
        if seat == "b":
            b_in_tool.set()
            await a_inside.wait()  # returns while a's group is open
        return f"booked {seat}"

    agent = Agent("g", "b", tools=[book])

    def runner(seat: str) -> AgentRunner:
        return AgentRunner.from_stores(
            ScriptedProvider(scripted([("book", {"seat": seat})])), stores
        )

    b = asyncio.create_task(runner("b").run(agent, "go", tenant=TENANT, run_id="b"))
    await asyncio.wait_for(b_in_tool.wait(), LIMIT)
    a = asyncio.create_task(runner("a").run(agent, "go", tenant=TENANT, run_id="a"))
    await asyncio.wait_for(a_inside.wait(), LIMIT)
    await asyncio.sleep(0.2)  # b has its outcome and waits on a's group now
    assert not b.done()
    b.cancel()
    await asyncio.sleep(0.2)
    assert not b.done()  # still recording what it has
    release_a.set()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(b, LIMIT)
    assert (await asyncio.wait_for(a, LIMIT)).status == "completed"
    assert statuses(path, "b") == {"call_0_0": RecordStatus.completed.value}
    ledger.hook = None
    run = await asyncio.wait_for(runner("b").resume(agent, "b", tenant=TENANT), LIMIT)
    assert run.status == "completed"
    assert sorted(sent) == ["a", "b"]  # b's call replayed from its record, never sent again
    await _lock_is_free(stores)


class AnswersWhen:
    """A provider that answers once ``ready`` is set, after telling ``asked``."""

    def __init__(self, inner: ScriptedProvider, asked: asyncio.Event, ready: asyncio.Event):
        self.inner, self.asked, self.ready = inner, asked, ready

    async def complete(self, request: Any) -> Any:
        self.asked.set()
        await self.ready.wait()
        return await self.inner.complete(request)


async def test_a_run_cancelled_while_waiting_for_the_lock_after_its_model_answered_is_charged(
    stores: Stores, path: str
) -> None:
    ledger = _hooked(stores)
    b_asked, a_inside, release_a = asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def hold_a(run_id: str) -> None:
        if run_id == "a":
            a_inside.set()
            await release_a.wait()

    ledger.hook = hold_a
    ledger.after = True  # a's group holds the connection meanwhile

    @tool
    def book(seat: str) -> str:
        return f"booked {seat}"

    agent = Agent("g", "b", tools=[book])
    script = scripted([("book", {"seat": "1"})])
    model_b = AnswersWhen(ScriptedProvider(script), b_asked, a_inside)
    b = asyncio.create_task(
        AgentRunner(
            model_b,
            idempotency=stores.idempotency,
            checkpoints=Checkpointer.from_stores(stores),
            leases=stores.leases,
            ledger=ledger,
        ).run(agent, "go", tenant=TENANT, run_id="b")
    )
    await asyncio.wait_for(b_asked.wait(), LIMIT)
    a = asyncio.create_task(
        AgentRunner.from_stores(ScriptedProvider(script), stores).run(
            agent, "go", tenant=TENANT, run_id="a"
        )
    )
    await asyncio.wait_for(a_inside.wait(), LIMIT)
    await asyncio.sleep(0.2)  # b's model answered (7 micros); b waits on a's group now
    assert not b.done()
    b.cancel()
    release_a.set()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(b, LIMIT)
    assert (await asyncio.wait_for(a, LIMIT)).status == "completed"
    with contextlib.closing(sqlite3.connect(path)) as other:
        row = other.execute("SELECT micros FROM adk_ledger WHERE run_id = 'b'").fetchone()
    assert row is not None and row[0] == 7, row


async def test_a_ledger_outside_the_group_is_charged_once_when_the_group_fails(
    stores: Stores, path: str
) -> None:
    from tesserix_adk.stores.memory import MemoryLedger

    claims = AbortingIdempotency(database_of(stores))
    claims.abort_on = "call_0_0"  # the turn's first claim: its group then fails whole
    ledger = MemoryLedger()  # the ledger elsewhere (another backend)
    sent: list[str] = []

    @tool
    def book(seat: str) -> str:
        sent.append(seat)
        return f"booked {seat}"

    runner = AgentRunner(
        ScriptedProvider(scripted([("book", {"seat": "1"})])),
        idempotency=claims,
        checkpoints=Checkpointer.from_stores(stores),
        leases=stores.leases,
        ledger=ledger,
    )
    with pytest.raises(StoreUnavailableError):
        await asyncio.wait_for(
            runner.run(Agent("g", "b", tools=[book]), "go", tenant=TENANT, run_id="r"), LIMIT
        )
    assert sent == []
    assert await ledger.spent(TENANT, "r") == 7  # one model call, charged once
