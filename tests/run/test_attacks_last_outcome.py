"""Attacks on ff00a40: a turn's last outcome commits with its ``after_tool_result`` frontier.

With ``group_writes=True`` the turn's last outcome is written into the run's open write
group and commits with the ``after_tool_result`` frontier (and its transcript append) right
before the model is asked again; a frontier whose stores do not join the group, or one
heavy enough to encode off the loop, commits the group first. Every test here runs on a
real SQLite file (two on PostgreSQL) and looks at it through a second connection (as
another process would) where durability matters. The attack found two defects, each first
a strict xfail and fixed since (the tests say which); the rest are promises that held.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sqlite3
import threading
from pathlib import Path
from typing import Any

import pytest

from run.helpers import database_of, scripted, statuses
from sqlite_writes import fills_the_disk, interrupts_itself
from tesserix_adk import (
    Agent,
    AgentRunner,
    FrontierWritten,
    ScriptedProvider,
    ToolCallFinished,
    tool,
)
from tesserix_adk.checkpoint.checkpointer import Checkpointer, CheckpointPolicy
from tesserix_adk.checkpoint.payload import Boundary
from tesserix_adk.errors import (
    CheckpointError,
    IndeterminateToolCallError,
    LeaseLostError,
    RunStoppedError,
    StaleFenceError,
    StoreUnavailableError,
)
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.stores.memory import MemoryHistoryStore
from tesserix_adk.stores.protocols import RecordStatus
from tesserix_adk.stores.sqlite.checkpoints import SqliteCheckpointStore
from tesserix_adk.stores.sqlite.database import SqliteDatabase
from tesserix_adk.stores.sqlite.history import SqliteHistoryStore
from tesserix_adk.stores.sqlite.idempotency import SqliteIdempotencyStore
from tesserix_adk.stores.urls import open_stores

pytestmark = pytest.mark.usefixtures("grouped_writes")

TENANT = "t"
LIMIT = 30.0
COMPLETED = RecordStatus.completed.value
IN_FLIGHT = RecordStatus.in_flight.value


def _durable_step(path: str, run_id: str = "r") -> int | None:
    """The highest step snapshot another connection sees for the run."""
    with contextlib.closing(sqlite3.connect(path)) as other:
        (step,) = other.execute(
            "SELECT max(step) FROM adk_checkpoint_steps WHERE run_id = ?", (run_id,)
        ).fetchone()
    return None if step is None else int(step)


def _booking(sent: list[str]) -> Any:
    @tool
    def book(seat: str) -> str:
        sent.append(seat)
        return f"booked {seat}"

    return book


# --- defects --------------------------------------------------------------------------


class FirstCompleteAborts(SqliteIdempotencyStore):
    """The first attempt to record an outcome hits an error SQLite answers by rolling back
    the whole transaction it ran in (SQLITE_FULL for an instant: a disk that fills and is
    freed again, another file's burst); every later write works. The kit retries
    ``complete`` (``COMPLETE_TRIES``) precisely for such a passing failure."""

    aborted = False

    async def complete(self, key: str, outcome: bytes, *, tenant: str, holder: str) -> Any:
        if not self.aborted:
            self.aborted = True
            await self.database.write(fills_the_disk)  # raises: nothing of it is written
        return await super().complete(key, outcome, tenant=tenant, holder=holder)


async def _run_with_first_complete_aborting(stores: Stores, calls: int) -> list[str]:
    """A turn of ``calls`` calls whose first outcome's first record attempt aborts: with
    one call that outcome is the turn's last, with two it is a middle one."""
    stores.idempotency = FirstCompleteAborts(database_of(stores))
    sent: list[str] = []
    agent = Agent("g", "b", tools=[_booking(sent)])
    turn = [("book", {"seat": str(n)}) for n in range(calls)]
    runner = AgentRunner.from_stores(ScriptedProvider(scripted(turn)), stores)
    with contextlib.suppress(StoreUnavailableError):
        await asyncio.wait_for(runner.run(agent, "go", tenant=TENANT, run_id="r"), LIMIT)
    return sent


@pytest.mark.parametrize("calls", [1, 2], ids=["last_outcome", "middle_outcome"])
async def test_without_groups_a_passing_failure_recording_the_outcome_is_retried_and_recorded(
    stores: Stores, path: str, monkeypatch: pytest.MonkeyPatch, calls: int
) -> None:
    # The control: each write commits on its own, so the second try records the outcome.
    defaults = AgentRunner.__init__.__kwdefaults__
    assert defaults is not None
    monkeypatch.setitem(defaults, "group_writes", False)
    sent = await _run_with_first_complete_aborting(stores, calls)
    assert sent[:1] == ["0"]
    assert statuses(path)["call_0_0"] == COMPLETED


@pytest.mark.parametrize("calls", [1, 2], ids=["last_outcome", "middle_outcome"])
async def test_an_outcome_whose_first_record_attempt_aborts_the_group_is_still_recorded(
    stores: Stores, path: str, calls: int
) -> None:
    # Was a defect (the last outcome since ff00a40, a middle one before): the group was
    # lost, complete's retries all went to it, and no redo had been asked for, so the call
    # that ran was left in doubt. The redo is now asked for before the first try.
    sent = await _run_with_first_complete_aborting(stores, calls)
    assert sent == ["0"]
    # Rule 1: the outcome of a call that ran is never lost while the process lives.
    assert statuses(path)["call_0_0"] == COMPLETED


async def test_an_outcome_whose_record_attempt_aborts_the_group_is_never_sent_again(
    stores: Stores, path: str
) -> None:
    # What still holds where the defect above bites: the call is left in doubt and the
    # resume refuses it rather than guess (once fixed, the resume replays its record).
    sent = await _run_with_first_complete_aborting(stores, 1)
    assert sent == ["0"]
    agent = Agent("g", "b", tools=[_booking(sent)])
    again = AgentRunner.from_stores(ScriptedProvider(scripted([("book", {"seat": "0"})])), stores)
    try:
        run = await asyncio.wait_for(again.resume(agent, "r", tenant=TENANT), LIMIT)
    except IndeterminateToolCallError as refused:
        assert [c.tool for c in refused.calls] == ["book"]
    else:
        assert run.status == "completed"
    assert sent == ["0"]


# --- promises that held: the frontier past an outcome ----------------------------------


class LookingCheckpoints(SqliteCheckpointStore):
    """A checkpoint store (on the run's own file, or another one) that looks at the run's
    file through another connection each time it takes an ``after_tool_result`` frontier:
    what is committed there, as another process would see it, while the frontier goes in."""

    def __init__(self, database: SqliteDatabase, looked_at: str) -> None:
        super().__init__(database)
        self.looked_at = looked_at
        self.seen: list[dict[str, str]] = []

    def _look(self, payload: bytes) -> None:
        if json.loads(payload).get("boundary") == "after_tool_result":
            self.seen.append(statuses(self.looked_at))

    async def put(self, tenant: str, run_id: str, payload: bytes, **kwargs: Any) -> None:
        self._look(payload)
        await super().put(tenant, run_id, payload, **kwargs)

    async def put_with_history(self, history: object, *args: Any, **kwargs: Any) -> Any:
        if isinstance(history, SqliteHistoryStore) and history.database is self.database:
            self._look(args[2])  # else it answers None and the frontier goes through put
        return await super().put_with_history(history, *args, **kwargs)


class Undeclared:
    """A wrapper around a checkpoint store that says nothing of write groups (no
    ``GroupedWrites``): logging, metrics, a user's own layer. Its writes go to the run's own
    file all the same."""

    def __init__(self, inner: SqliteCheckpointStore) -> None:
        self.inner = inner

    async def put(self, tenant: str, run_id: str, payload: bytes, **kwargs: Any) -> None:
        await self.inner.put(tenant, run_id, payload, **kwargs)

    async def latest(self, tenant: str, run_id: str) -> Any:
        return await self.inner.latest(tenant, run_id)

    async def forget(self, tenant: str, run_id: str) -> None:
        await self.inner.forget(tenant, run_id)

    async def seal(self, tenant: str, run_id: str, fence: int) -> None:
        await self.inner.seal(tenant, run_id, fence)


@pytest.mark.parametrize("where", ["another_file", "undeclared_wrapper", "history_elsewhere"])
async def test_a_frontier_whose_stores_do_not_join_finds_the_last_outcome_committed(
    stores: Stores, path: str, tmp_path: Path, where: str
) -> None:
    sent: list[str] = []
    looking = LookingCheckpoints(database_of(stores), path)
    history: Any = stores.history
    others: list[Stores] = []
    if where == "another_file":
        other = open_stores(f"sqlite:///{tmp_path / 'checkpoints.sqlite3'}")
        await other.create_schema()
        others.append(other)
        looking = LookingCheckpoints(database_of(other), path)
        history = other.history
        checkpoints = Checkpointer(looking, history=history)
    elif where == "undeclared_wrapper":
        checkpoints = Checkpointer(Undeclared(looking), history=history)  # type: ignore[arg-type]
    else:
        checkpoints = Checkpointer(looking, history=MemoryHistoryStore())
    assert not checkpoints.joins(database_of(stores).write_group())
    script = scripted([("book", {"seat": "a"}), ("book", {"seat": "b"})], [("book", {"seat": "c"})])
    runner = AgentRunner(
        ScriptedProvider(script),
        idempotency=stores.idempotency,
        checkpoints=checkpoints,
        leases=stores.leases,
        ledger=stores.ledger,
    )
    try:
        run = await asyncio.wait_for(
            runner.run(Agent("g", "b", tools=[_booking(sent)]), "go", tenant=TENANT, run_id="r"),
            LIMIT,
        )
    finally:
        for other in others:
            await other.aclose()
    assert run.status == "completed"
    assert sent == ["a", "b", "c"]
    # Each after_tool_result frontier went in only once its turn's every outcome was
    # committed: a resume from it never looks at those calls' records again.
    assert looking.seen == [
        {"call_0_0": COMPLETED, "call_0_1": COMPLETED},
        {"call_0_0": COMPLETED, "call_0_1": COMPLETED, "call_1_0": COMPLETED},
    ]


class EncodingLooks(Checkpointer):
    """Looks at the run's file, from the encoding thread, as each ``after_tool_result``
    frontier is encoded."""

    looked_at = ""
    seen: list[tuple[bool, dict[str, str]]]

    def _encoded(self, frontier: Any, cursor: Any) -> Any:
        if frontier.boundary is Boundary.after_tool_result:
            on_loop = _on_a_loop()
            self.seen.append((on_loop, statuses(self.looked_at)))
        return super()._encoded(frontier, cursor)


def _on_a_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


async def test_a_heavy_after_tool_result_frontier_commits_the_last_outcome_before_encoding(
    stores: Stores, path: str
) -> None:
    sent: list[str] = []

    @tool
    def fetch(page: str) -> str:
        sent.append(page)
        return "x" * 40_000  # over OFF_LOOP_BYTES: the frontier is encoded off the loop

    checkpoints = EncodingLooks(stores.checkpoints, history=stores.history)
    checkpoints.looked_at, checkpoints.seen = path, []
    runner = AgentRunner(
        ScriptedProvider(scripted([("fetch", {"page": "1"})])),
        idempotency=stores.idempotency,
        checkpoints=checkpoints,
        leases=stores.leases,
        ledger=stores.ledger,
    )
    run = await asyncio.wait_for(
        runner.run(Agent("g", "f", tools=[fetch]), "go", tenant=TENANT, run_id="r"), LIMIT
    )
    assert run.status == "completed"
    # Encoded in a worker thread, the outcome already committed (nobody waits on a group).
    assert checkpoints.seen == [(False, {"call_0_0": COMPLETED})]


# --- promises that held: a frontier write that fails inside the group ------------------


class AbortingFrontier(SqliteCheckpointStore):
    """Writing the first ``after_tool_result`` frontier, one write SQLite aborts with its
    whole transaction: the group holding the turn's last outcome is lost with it."""

    aborted = False

    async def put_with_history(self, history: object, *args: Any, **kwargs: Any) -> Any:
        if not self.aborted and json.loads(args[2]).get("boundary") == "after_tool_result":
            self.aborted = True
            await self.database.write(interrupts_itself)
        return await super().put_with_history(history, *args, **kwargs)


async def test_a_frontier_write_that_loses_the_group_has_the_outcome_recorded_again(
    stores: Stores, path: str
) -> None:
    stores.checkpoints = AbortingFrontier(database_of(stores))
    sent: list[str] = []
    agent = Agent("g", "b", tools=[_booking(sent)])
    script = scripted([("book", {"seat": "1"})], [("book", {"seat": "2"})])
    heard: list[tuple[str, int]] = []
    runner = AgentRunner.from_stores(ScriptedProvider(script), stores)

    async def listen() -> None:
        async for event in runner.stream(agent, "go", tenant=TENANT, run_id="r"):
            if isinstance(event, FrontierWritten):
                heard.append((event.boundary.value, event.step))

    with pytest.raises(StoreUnavailableError):
        await asyncio.wait_for(listen(), LIMIT)
    assert sent == ["1"]
    # The outcome the lost group held is recorded again, on its own; its frontier is not
    # there and nobody heard of it.
    assert statuses(path) == {"call_0_0": COMPLETED}
    assert _durable_step(path) == 1
    assert heard == [("after_model_call", 1)]
    # The resume replays it from its record and books the next seat once.
    again = AgentRunner.from_stores(ScriptedProvider(script), stores)
    run = await asyncio.wait_for(again.resume(agent, "r", tenant=TENANT), LIMIT)
    assert run.status == "completed"
    assert sent == ["1", "2"]


async def test_a_lost_group_holding_a_charge_and_no_outcome_charges_it_once(
    stores: Stores, path: str
) -> None:
    # A turn whose one call is refused unsent (an unknown tool): nothing commits between
    # the model's answer and the after_tool_result frontier, so the group holds the charge,
    # both frontiers and no outcome. The frontier's write loses the group: the charge
    # certainly did not commit, so it is made again, once.
    stores.checkpoints = AbortingFrontier(database_of(stores))
    runner = AgentRunner.from_stores(ScriptedProvider(scripted([("nowhere", {"x": 1})])), stores)
    with pytest.raises(StoreUnavailableError):
        await asyncio.wait_for(
            runner.run(Agent("g", "b", tools=[]), "go", tenant=TENANT, run_id="r"), LIMIT
        )
    assert stores.ledger is not None
    assert await stores.ledger.spent(TENANT, "r") == 7
    assert _durable_step(path) is None  # neither frontier of the lost group is there


async def test_a_too_large_after_tool_result_frontier_leaves_a_tombstone_and_the_outcome(
    stores: Stores, path: str
) -> None:
    sent: list[str] = []

    @tool
    def fetch(page: str) -> str:
        sent.append(page)
        return "y" * 6_000  # its transcript entry is over max_bytes; its record is not

    class Dies(BaseException):
        pass

    class DiesWhenAskedAgain:
        def __init__(self, inner: ScriptedProvider) -> None:
            self.inner, self.asked = inner, 0

        async def complete(self, request: Any) -> Any:
            self.asked += 1
            if self.asked == 2:
                raise Dies  # the process dies as the model is asked again
            return await self.inner.complete(request)

    agent = Agent("g", "f", tools=[fetch])
    script = scripted([("fetch", {"page": "1"})])
    runner = AgentRunner.from_stores(
        DiesWhenAskedAgain(ScriptedProvider(script)), stores, max_bytes=4_000
    )
    with pytest.raises(Dies):
        await asyncio.wait_for(runner.run(agent, "go", tenant=TENANT, run_id="r"), LIMIT)
    assert sent == ["1"]
    # The tombstone stands for the frontier, committed with the outcome before the model
    # was asked again.
    assert statuses(path) == {"call_0_0": COMPLETED}
    latest = await Checkpointer.from_stores(stores).latest(TENANT, "r")
    assert latest is not None and latest.is_tombstone and latest.step == 2
    again = AgentRunner.from_stores(ScriptedProvider(script), stores, max_bytes=4_000)
    with pytest.raises(CheckpointError):
        await asyncio.wait_for(again.resume(agent, "r", tenant=TENANT), LIMIT)
    assert sent == ["1"]


def _take_lease(path: str, run_id: str = "r") -> None:
    """Another worker takes the run's lease (its fence one higher) for an hour."""
    with contextlib.closing(sqlite3.connect(path)) as other:
        other.execute(
            "UPDATE adk_run_leases SET fence = fence + 1, holder = 'thief', "
            "expires_at = (julianday('now') - 2440587.5) * 86400.0 + 3600 "
            "WHERE tenant = ? AND run_id = ?",
            (TENANT, run_id),
        )
        other.commit()


def _free_lease(path: str, run_id: str = "r") -> None:
    with contextlib.closing(sqlite3.connect(path)) as other:
        other.execute(
            "UPDATE adk_run_leases SET holder = NULL, "
            "expires_at = (julianday('now') - 2440587.5) * 86400.0 - 1 "
            "WHERE tenant = ? AND run_id = ?",
            (TENANT, run_id),
        )
        other.commit()


async def test_a_lease_taken_while_the_tool_runs_still_leaves_its_outcome_on_record(
    stores: Stores, path: str
) -> None:
    sent: list[str] = []

    @tool
    def book(seat: str) -> str:
        sent.append(seat)
        if seat == "1":
            _take_lease(path)  # taken over while the call is out
        return f"booked {seat}"

    agent = Agent("g", "b", tools=[book])
    script = scripted([("book", {"seat": "1"})], [("book", {"seat": "2"})])
    runner = AgentRunner.from_stores(ScriptedProvider(script), stores)
    with pytest.raises((StaleFenceError, LeaseLostError)):
        await asyncio.wait_for(runner.run(agent, "go", tenant=TENANT, run_id="r"), LIMIT)
    assert sent == ["1"]
    # Its after_tool_result frontier is refused (fenced out), the outcome it held is not.
    assert statuses(path) == {"call_0_0": COMPLETED}
    assert _durable_step(path) == 1
    _free_lease(path)
    again = AgentRunner.from_stores(ScriptedProvider(script), stores)
    run = await asyncio.wait_for(again.resume(agent, "r", tenant=TENANT), LIMIT)
    assert run.status == "completed"
    assert sent == ["1", "2"]


# --- promises that held: cancelled, stopped, streamed ----------------------------------


class StallingFrontier(SqliteCheckpointStore):
    """Stalls inside the ``after_tool_result`` frontier's write (in the open group that
    holds the turn's last outcome) until the run is cancelled there."""

    inside: asyncio.Event
    never: asyncio.Event

    async def put_with_history(self, history: object, *args: Any, **kwargs: Any) -> Any:
        if json.loads(args[2]).get("boundary") == "after_tool_result" and not self.inside.is_set():
            self.inside.set()
            await self.never.wait()
        return await super().put_with_history(history, *args, **kwargs)


class StallingCancelCheck(SqliteIdempotencyStore):
    """Stalls at the boundary's cancel check (a read inside the open group, after the
    ``after_tool_result`` frontier joined it) until the run is cancelled there."""

    inside: asyncio.Event
    never: asyncio.Event
    armed = False

    async def lookup(self, keys: Any, *, tenant: str) -> Any:
        found = await super().lookup(keys, tenant=tenant)
        if any(str(k).startswith("cancel1:") for k in keys) and self.armed:
            self.armed = False
            self.inside.set()
            await self.never.wait()
        return found


class StallingEncoding(Checkpointer):
    """Blocks the encoding thread of a heavy ``after_tool_result`` frontier (the group
    committed first) until released; the run is cancelled meanwhile."""

    inside: threading.Event
    release: threading.Event

    def _encoded(self, frontier: Any, cursor: Any) -> Any:
        if frontier.boundary is Boundary.after_tool_result:
            self.inside.set()
            self.release.wait(LIMIT)
        return super()._encoded(frontier, cursor)


@pytest.mark.parametrize("where", ["frontier_write", "cancel_check", "heavy_encoding"])
async def test_a_run_cancelled_between_its_last_outcome_and_the_next_model_call_keeps_it(
    stores: Stores, path: str, where: str
) -> None:
    sent: list[str] = []

    inside, never = asyncio.Event(), asyncio.Event()
    checkpoints: Checkpointer = Checkpointer.from_stores(stores)
    idempotency: Any = stores.idempotency

    @tool
    def book(seat: str) -> str:
        sent.append(seat)
        if where == "cancel_check" and seat == "1":
            idempotency.armed = True  # the next cancel check is the one after its outcome
        return ("z" * 40_000) if where == "heavy_encoding" else f"booked {seat}"

    release = threading.Event()
    if where == "frontier_write":
        stalling = StallingFrontier(database_of(stores))
        stalling.inside, stalling.never = inside, never
        checkpoints = Checkpointer(stalling, history=stores.history)
    elif where == "cancel_check":
        idempotency = StallingCancelCheck(database_of(stores))
        idempotency.inside, idempotency.never = inside, never
    else:
        encoding = StallingEncoding(stores.checkpoints, history=stores.history)
        encoding.inside, encoding.release = threading.Event(), release
        checkpoints = encoding

    agent = Agent("g", "b", tools=[book])
    script = scripted([("book", {"seat": "1"})], [("book", {"seat": "2"})])

    def runner() -> AgentRunner:
        return AgentRunner(
            ScriptedProvider(script),
            idempotency=idempotency,
            checkpoints=checkpoints,
            leases=stores.leases,
            ledger=stores.ledger,
        )

    task = asyncio.create_task(runner().run(agent, "go", tenant=TENANT, run_id="r"))
    if where in ("cancel_check", "frontier_write"):
        await asyncio.wait_for(inside.wait(), LIMIT)
    else:
        await asyncio.wait_for(asyncio.to_thread(encoding.inside.wait, LIMIT), LIMIT)
    # Inside the window: the outcome is in the open group, not yet durable (a heavy
    # frontier committed it first).
    in_window = COMPLETED if where == "heavy_encoding" else IN_FLIGHT
    assert statuses(path) == {"call_0_0": in_window}
    task.cancel()
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, LIMIT)
    assert sent == ["1"]
    # The outcome in hand is durable once the cancelled run let go.
    assert statuses(path) == {"call_0_0": COMPLETED}
    run = await asyncio.wait_for(runner().resume(agent, "r", tenant=TENANT), LIMIT)
    assert run.status == "completed"
    assert sent == ["1", "2"]


async def test_a_consumer_leaving_the_stream_at_the_last_tool_result_leaves_it_on_record(
    stores: Stores, path: str
) -> None:
    sent: list[str] = []
    agent = Agent("g", "b", tools=[_booking(sent)])
    script = scripted([("book", {"seat": "1"}), ("book", {"seat": "2"})], [("book", {"seat": "3"})])
    runner = AgentRunner.from_stores(ScriptedProvider(script), stores)
    async with contextlib.aclosing(runner.stream(agent, "go", tenant=TENANT, run_id="r")) as events:
        async for event in events:
            if isinstance(event, ToolCallFinished) and event.call_id == "call_0_1":
                # The turn's last outcome is in the open group now, not yet durable.
                assert statuses(path) == {"call_0_0": COMPLETED, "call_0_1": IN_FLIGHT}
                break
    # The iterator returned once the run let go: what it held is committed.
    assert statuses(path) == {"call_0_0": COMPLETED, "call_0_1": COMPLETED}
    again = AgentRunner.from_stores(ScriptedProvider(script), stores)
    run = await asyncio.wait_for(again.resume(agent, "r", tenant=TENANT), LIMIT)
    assert run.status == "completed"
    assert sent == ["1", "2", "3"]


async def test_after_tool_result_is_heard_only_once_it_and_the_last_outcome_are_durable(
    stores: Stores, path: str
) -> None:
    sent: list[str] = []
    agent = Agent("g", "b", tools=[_booking(sent)])
    script = scripted([("book", {"seat": "1"}), ("book", {"seat": "2"})], [("book", {"seat": "3"})])
    runner = AgentRunner.from_stores(ScriptedProvider(script), stores)
    heard: list[tuple[int, int | None, dict[str, str]]] = []
    async for event in runner.stream(agent, "go", tenant=TENANT, run_id="r"):
        if isinstance(event, FrontierWritten) and event.boundary is Boundary.after_tool_result:
            heard.append((event.step, _durable_step(path), statuses(path)))
    assert [(step, durable) for step, durable, _ in heard] == [(2, 2), (4, 4)]
    assert heard[0][2] == {"call_0_0": COMPLETED, "call_0_1": COMPLETED}
    assert heard[1][2] == {"call_0_0": COMPLETED, "call_0_1": COMPLETED, "call_1_0": COMPLETED}


# --- promises that held: the run ends right after the turn -----------------------------


@pytest.mark.parametrize("ending", ["max_iterations", "budget", "cancelled", "stopped"])
async def test_a_run_ending_right_after_its_turn_has_the_last_outcome_durable_when_it_returns(
    stores: Stores, path: str, ending: str
) -> None:
    sent: list[str] = []
    cancel_by: list[AgentRunner] = []

    @tool
    async def book(seat: str) -> str:
        sent.append(seat)
        if ending == "cancelled":
            # An operator cancels the run while the call is out: the holder ends it at
            # the next boundary.
            assert await cancel_by[0].cancel("r", tenant=TENANT, by="op") is None
        return f"booked {seat}"

    agent = Agent(
        "g",
        "b",
        tools=[book],
        max_iterations=1 if ending == "max_iterations" else 10,
        budget_micros=7 if ending == "budget" else None,
    )
    script = scripted([("book", {"seat": "1"})], [("book", {"seat": "2"})])
    runner = AgentRunner.from_stores(ScriptedProvider(script), stores)
    cancel_by.append(AgentRunner.from_stores(ScriptedProvider(script), stores))
    stop = (lambda: "draining" if sent else None) if ending == "stopped" else None
    work = runner.run(agent, "go", tenant=TENANT, run_id="r", stop=stop)
    if ending == "stopped":
        with pytest.raises(RunStoppedError):
            await asyncio.wait_for(work, LIMIT)
    else:
        run = await asyncio.wait_for(work, LIMIT)
        assert run.status == {"max_iterations": "max_iterations", "budget": "budget_exhausted"}.get(
            ending, ending
        )
    # Durable the moment the run returned (or raised): the outcome and the frontier after it.
    assert statuses(path) == {"call_0_0": COMPLETED}
    latest = await Checkpointer.from_stores(stores).latest(TENANT, "r")
    assert latest is not None
    if ending == "stopped":
        assert latest.boundary is Boundary.after_tool_result
        again = AgentRunner.from_stores(ScriptedProvider(script), stores)
        run = await asyncio.wait_for(again.resume(agent, "r", tenant=TENANT), LIMIT)
        assert run.status == "completed"
        assert sent == ["1", "2"]
    else:
        assert latest.status.finished and latest.step == 3
        assert sent == ["1"]


# --- promises that held: no folding, no after_tool_result, no checkpointer --------------


class LooksWhenAsked:
    """A model that, each time it is asked past the first turn, looks at the run's file
    through another connection: everything before a model call is durable by then."""

    def __init__(self, inner: ScriptedProvider, path: str) -> None:
        self.inner, self.path = inner, path
        self.seen: list[dict[str, str]] = []

    async def complete(self, request: Any) -> Any:
        if request.iteration > 0:
            self.seen.append(statuses(self.path))
        return await self.inner.complete(request)


async def test_side_by_side_calls_have_every_outcome_committed_before_their_frontier(
    stores: Stores, path: str
) -> None:
    looking = LookingCheckpoints(database_of(stores), path)
    sent: list[str] = []

    @tool
    async def book(seat: str) -> str:
        await asyncio.sleep(0.01 * (3 - int(seat)))  # the last asked finishes first
        sent.append(seat)
        return f"booked {seat}"

    agent = Agent("g", "b", tools=[book], parallel_tool_calls=3)
    calls = [("book", {"seat": str(i)}) for i in range(3)]
    runner = AgentRunner(
        ScriptedProvider(scripted(calls)),
        idempotency=stores.idempotency,
        checkpoints=Checkpointer(looking, history=stores.history),
        leases=stores.leases,
        ledger=stores.ledger,
    )
    run = await asyncio.wait_for(runner.run(agent, "go", tenant=TENANT, run_id="r"), LIMIT)
    assert run.status == "completed"
    assert sorted(sent) == ["0", "1", "2"]
    # No folding side by side: each outcome committed on its own, before the frontier.
    assert looking.seen == [{f"call_0_{i}": COMPLETED for i in range(3)}]


@pytest.mark.parametrize("checkpointed", ["after_model_call_only", "no_checkpointer"])
async def test_without_an_after_tool_result_frontier_the_last_outcome_commits_before_the_model(
    stores: Stores, path: str, checkpointed: str
) -> None:
    sent: list[str] = []
    agent = Agent("g", "b", tools=[_booking(sent)])
    script = scripted([("book", {"seat": "1"}), ("book", {"seat": "2"})], [("book", {"seat": "3"})])
    model = LooksWhenAsked(ScriptedProvider(script), path)
    checkpoints = None
    if checkpointed == "after_model_call_only":
        checkpoints = Checkpointer.from_stores(
            stores, policy=CheckpointPolicy(boundaries=frozenset({Boundary.after_model_call}))
        )
    runner = AgentRunner(
        model,
        idempotency=stores.idempotency,
        checkpoints=checkpoints,
        leases=stores.leases,
        ledger=stores.ledger,
    )
    run = await asyncio.wait_for(runner.run(agent, "go", tenant=TENANT, run_id="r"), LIMIT)
    assert run.status == "completed"
    assert sent == ["1", "2", "3"]
    assert model.seen == [
        {"call_0_0": COMPLETED, "call_0_1": COMPLETED},
        {"call_0_0": COMPLETED, "call_0_1": COMPLETED, "call_1_0": COMPLETED},
    ]


@pytest.mark.parametrize("checkpointed", ["after_model_call_only", "no_checkpointer"])
async def test_without_an_after_tool_result_frontier_a_run_ending_after_the_turn_keeps_it(
    stores: Stores, path: str, checkpointed: str
) -> None:
    sent: list[str] = []
    agent = Agent("g", "b", tools=[_booking(sent)], max_iterations=1)
    script = scripted([("book", {"seat": "1"})], [("book", {"seat": "2"})])
    checkpoints = None
    if checkpointed == "after_model_call_only":
        checkpoints = Checkpointer.from_stores(
            stores, policy=CheckpointPolicy(boundaries=frozenset({Boundary.after_model_call}))
        )
    runner = AgentRunner(
        ScriptedProvider(script),
        idempotency=stores.idempotency,
        checkpoints=checkpoints,
        leases=stores.leases,
        ledger=stores.ledger,
    )
    run = await asyncio.wait_for(runner.run(agent, "go", tenant=TENANT, run_id="r"), LIMIT)
    assert run.status == "max_iterations"
    assert sent == ["1"]
    assert statuses(path) == {"call_0_0": COMPLETED}


async def test_a_run_stopped_at_a_boundary_without_after_tool_result_replays_the_outcome(
    stores: Stores, path: str
) -> None:
    sent: list[str] = []
    agent = Agent("g", "b", tools=[_booking(sent)])
    script = scripted([("book", {"seat": "1"})], [("book", {"seat": "2"})])
    policy = CheckpointPolicy(boundaries=frozenset({Boundary.after_model_call}))

    def runner() -> AgentRunner:
        return AgentRunner.from_stores(ScriptedProvider(script), stores, policy=policy)

    with pytest.raises(RunStoppedError):
        await asyncio.wait_for(
            runner().run(
                agent, "go", tenant=TENANT, run_id="r", stop=lambda: "drain" if sent else None
            ),
            LIMIT,
        )
    assert statuses(path) == {"call_0_0": COMPLETED}
    latest = await Checkpointer.from_stores(stores).latest(TENANT, "r")
    assert latest is not None and latest.boundary is Boundary.after_model_call
    # The resume carries the turn on from after_model_call: the call is replayed from its
    # record, not sent again, not refused.
    run = await asyncio.wait_for(runner().resume(agent, "r", tenant=TENANT), LIMIT)
    assert run.status == "completed"
    assert sent == ["1", "2"]


# --- the same defect on PostgreSQL -----------------------------------------------------


def _terminating_store(database: Any) -> Any:
    """A PostgreSQL idempotency store whose connection is cut (a failover, a restart, a
    reset: pg_terminate_backend here) right as the first outcome is recorded; every later
    connection works."""
    import psycopg

    from adapters.services import POSTGRES_URL
    from tesserix_adk.adapters.postgres.idempotency import PostgresIdempotencyStore

    class TerminatedOnFirstComplete(PostgresIdempotencyStore):
        terminated = False

        async def complete(self, key: str, outcome: bytes, *, tenant: str, holder: str) -> Any:
            if not self.terminated:
                self.terminated = True
                # The connection this call goes out on: the open group's, if there is one.
                row = await self.database.row(
                    "finding the backend", "SELECT pg_backend_pid() AS pid", {}
                )
                assert row is not None
                async with await psycopg.AsyncConnection.connect(
                    POSTGRES_URL, autocommit=True
                ) as admin:
                    await admin.execute("SELECT pg_terminate_backend(%s)", (row["pid"],))
            return await super().complete(key, outcome, tenant=tenant, holder=holder)

    return TerminatedOnFirstComplete(database)


async def _pg_run_with_the_first_complete_cut(grouped: bool) -> dict[str, str]:
    from adapters.services import postgres_stores

    async with postgres_stores() as pg:
        pg.idempotency = _terminating_store(pg.idempotency.database)  # type: ignore[attr-defined]
        sent: list[str] = []
        agent = Agent("g", "b", tools=[_booking(sent)])
        runner = AgentRunner.from_stores(
            ScriptedProvider(scripted([("book", {"seat": "1"})])), pg, group_writes=grouped
        )
        with contextlib.suppress(StoreUnavailableError):
            await asyncio.wait_for(runner.run(agent, "go", tenant=TENANT, run_id="r"), LIMIT)
        assert sent == ["1"]
        return {str(r.call_id): str(r.status) for r in await pg.idempotency.records(TENANT, "r")}


@pytest.mark.postgres
async def test_on_postgres_without_groups_an_outcome_whose_connection_is_cut_is_recorded() -> None:
    assert await _pg_run_with_the_first_complete_cut(grouped=False) == {"call_0_0": COMPLETED}


@pytest.mark.postgres
async def test_on_postgres_an_outcome_whose_group_connection_is_cut_is_still_recorded() -> None:
    # Was the defect above, on PostgreSQL.
    assert await _pg_run_with_the_first_complete_cut(grouped=True) == {"call_0_0": COMPLETED}


async def test_a_resumed_approved_turn_that_ends_the_run_has_its_last_outcome_durable(
    stores: Stores, path: str
) -> None:
    sent: list[str] = []

    @tool
    def look(where: str) -> str:
        sent.append(f"look {where}")
        return f"looked {where}"

    @tool(requires_approval=True)
    def pay(amount: int) -> str:
        sent.append(f"pay {amount}")
        return f"paid {amount}"

    agent = Agent("g", "p", tools=[look, pay], max_iterations=1)
    script = scripted(
        [("look", {"where": "a"}), ("pay", {"amount": 3})], [("look", {"where": "b"})]
    )
    runner = AgentRunner.from_stores(ScriptedProvider(script), stores)
    run = await asyncio.wait_for(runner.run(agent, "go", tenant=TENANT, run_id="r"), LIMIT)
    assert run.status == "waiting_approval"
    assert stores.approvals is not None and run.pending_approval is not None
    await stores.approvals.decide(TENANT, run.pending_approval.id, approved=True, by="op")
    again = AgentRunner.from_stores(ScriptedProvider(script), stores)
    run = await asyncio.wait_for(again.resume(agent, "r", tenant=TENANT), LIMIT)
    # The decided turn ran, and the run ended right after it (max_iterations): its last
    # outcome (pay) and the final frontier are durable the moment resume returns.
    assert run.status == "max_iterations"
    assert sent == ["look a", "pay 3"]
    assert statuses(path) == {"call_0_0": COMPLETED, "call_0_1": COMPLETED}
    latest = await Checkpointer.from_stores(stores).latest(TENANT, "r")
    assert latest is not None and latest.status.finished


# --- a frontier through another connection to the same file ----------------------------


async def test_a_final_frontier_through_another_connection_to_the_file_is_written(
    stores: Stores, path: str
) -> None:
    # Was a defect: a frontier whose stores do not join the group committed the group
    # first only while it held an outcome, so one holding the charge alone kept the file's
    # write lock, and this frontier waited it out and was not written although the run
    # completed. It now commits the group first whatever it holds.
    other = SqliteDatabase(path, busy_timeout=0.3)  # short, so the test does not wait 5 s
    sent: list[str] = []
    checkpoints = Checkpointer(SqliteCheckpointStore(other), history=SqliteHistoryStore(other))
    assert not checkpoints.joins(database_of(stores).write_group())
    runner = AgentRunner(
        ScriptedProvider(scripted([("book", {"seat": "1"})])),
        idempotency=stores.idempotency,
        checkpoints=checkpoints,
        leases=stores.leases,
        ledger=stores.ledger,
    )
    try:
        run = await asyncio.wait_for(
            runner.run(Agent("g", "b", tools=[_booking(sent)]), "go", tenant=TENANT, run_id="r"),
            LIMIT,
        )
    finally:
        await other.aclose()
    assert run.status == "completed"
    assert statuses(path) == {"call_0_0": COMPLETED}
    latest = await Checkpointer.from_stores(stores).latest(TENANT, "r")
    assert latest is not None
    assert latest.status.finished, (latest.step, latest.boundary, checkpoints.last_error)
