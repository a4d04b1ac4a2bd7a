"""A turn's writes in the fewest commits that keep the promises (``run.grouping``).

On SQLite the stores share one file, so the charge, the ``after_model_call`` frontier and
the first claim commit together; each outcome commits with the next call's claim; the
turn's last outcome commits with ``after_tool_result``. Every test here looks at
the file through a second connection, as another process would, at the moment a tool runs.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from run.helpers import at, database_of
from tesserix_adk import (
    Agent,
    AgentRunner,
    Checkpointer,
    FrontierWritten,
    ScriptedProvider,
    ScriptedTurn,
    tool,
)
from tesserix_adk.errors import StoreReplyLostError, StoreUnavailableError
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.stores.memory import MemoryCheckpointStore, MemoryIdempotencyStore
from tesserix_adk.stores.protocols import RecordStatus
from tesserix_adk.stores.urls import open_stores
from tesserix_adk.testing.faults import FaultyCheckpointStore, SimulatedCrash

pytestmark = pytest.mark.usefixtures("grouped_writes")

TENANT = "t"


def _turns(calls_per_turn: int, turns: int) -> list[Any]:
    script: list[Any] = [
        ScriptedTurn(
            calls=[("book", {"seat": f"{t}-{c}"}) for c in range(calls_per_turn)], cost_micros=5
        )
        for t in range(turns)
    ]
    return [*script, "done"]


async def _per_turn(tmp_path: Path, calls_per_turn: int, counter: str) -> float:
    """What ``SqliteDatabase.<counter>`` grows by per turn of ``calls_per_turn`` calls: a
    run of 6 turns against one of 2, so what a run does once cancels out."""

    @tool
    def book(seat: str) -> str:
        return f"booked {seat}"

    grown: list[int] = []
    for turns in (2, 6):
        stores = open_stores(f"sqlite:///{tmp_path / f'{counter}-{turns}.sqlite3'}")
        await stores.create_schema()
        try:
            script = ScriptedProvider(_turns(calls_per_turn, turns))
            runner = AgentRunner.from_stores(script, stores)
            agent = Agent("g", "book", tools=[book], max_iterations=50)
            before = getattr(database_of(stores), counter)
            run = await runner.run(agent, "go", tenant=TENANT, run_id="r")
            assert run.status == "completed"
            grown.append(getattr(database_of(stores), counter) - before)
        finally:
            await stores.aclose()
    return (grown[1] - grown[0]) / 4


@pytest.mark.parametrize(("calls", "per_turn"), [(1, 2), (3, 4)])
async def test_a_turn_commits_once_per_claim_plus_once_for_its_last_outcome_and_frontier(
    tmp_path: Path, calls: int, per_turn: int
) -> None:
    # One call: [charge + after_model_call + claim], [outcome + after_tool_result]: 2 (it
    # was 5 without groups, 3 while the last outcome committed on its own). Three calls:
    # the two middle outcomes ride on the next claims: 4 (9 and 5).
    assert await _per_turn(tmp_path, calls, "commits") == per_turn


@pytest.mark.parametrize(("calls", "per_turn"), [(1, 4), (3, 8)])
async def test_a_grouped_turn_hands_the_sqlite_thread_a_job_only_to_begin_or_end_a_transaction(
    tmp_path: Path, calls: int, per_turn: int
) -> None:
    # One call: [charge: begins; frontier, claim: on the caller's thread; commit], [the
    # outcome: begins; after_tool_result, the cancel check: on the caller's thread;
    # commit]: 4 (10 when the group's begin and each of its writes went to the thread, 5
    # while the last outcome committed on its own). Three calls: each middle outcome
    # begins the group its next claim joins: 8 (18 and 9).
    assert await _per_turn(tmp_path, calls, "handoffs") == per_turn


async def test_each_claim_and_every_earlier_outcome_are_durable_before_a_call_is_sent(
    stores: Stores,
) -> None:
    path = database_of(stores).path
    seen: list[tuple[str, dict[str, str], int | None]] = []

    def look(seat: str) -> None:
        # Another connection, as another process: only what is committed shows.
        with sqlite3.connect(path) as other:
            rows = other.execute(
                "SELECT call_id, status FROM adk_idempotency WHERE run_id = 'r'"
            ).fetchall()
            step = other.execute("SELECT step FROM adk_frontiers WHERE run_id = 'r'").fetchone()
        seen.append((seat, {str(c): str(s) for c, s in rows}, None if step is None else step[0]))

    @tool
    def book(seat: str) -> str:
        look(seat)
        return f"booked {seat}"

    runner = AgentRunner.from_stores(ScriptedProvider(_turns(3, 2)), stores)
    run = await runner.run(Agent("g", "book", tools=[book]), "go", tenant=TENANT, run_id="r")
    assert run.status == "completed"
    in_flight, completed = RecordStatus.in_flight.value, RecordStatus.completed.value
    for turn in range(2):
        for call in range(3):
            seat, records, step = seen[turn * 3 + call]
            assert seat == f"{turn}-{call}"
            # Its own claim, and every earlier call's outcome, already committed.
            assert records[f"call_{turn}_{call}"] == in_flight
            for earlier in range(call):
                assert records[f"call_{turn}_{earlier}"] == completed
            # The turn's after_model_call frontier committed with the first claim: steps
            # are 1 (after_model_call) and 2 (after_tool_result) per turn.
            assert step == 2 * turn + 1


async def test_frontier_written_is_heard_only_once_the_frontier_is_durable(
    stores: Stores,
) -> None:
    path = database_of(stores).path

    @tool
    def book(seat: str) -> str:
        return f"booked {seat}"

    runner = AgentRunner.from_stores(ScriptedProvider(_turns(1, 2)), stores)
    heard: list[tuple[int, int | None]] = []
    async for event in runner.stream(Agent("g", "b", tools=[book]), "go", tenant=TENANT):
        if isinstance(event, FrontierWritten):
            with sqlite3.connect(path) as other:
                row = other.execute("SELECT max(step) FROM adk_checkpoint_steps").fetchone()
            heard.append((event.step, row[0]))
    assert [step for step, _ in heard] == [1, 2, 3, 4, 5]
    assert all(durable is not None and durable >= step for step, durable in heard)


async def test_another_run_on_the_same_file_is_not_held_up_or_joined(
    stores: Stores,
) -> None:
    @tool
    async def book(seat: str) -> str:
        await asyncio.sleep(0.01)
        return f"booked {seat}"

    runner = AgentRunner.from_stores(ScriptedProvider(_turns(2, 3)), stores)
    agent = Agent("g", "b", tools=[book])
    runs = await asyncio.gather(
        *(runner.run(agent, "go", tenant=TENANT, run_id=f"r{i}") for i in range(8))
    )
    assert [r.status for r in runs] == ["completed"] * 8
    for i in range(8):
        records = await stores.idempotency.records(TENANT, f"r{i}")
        assert len(records) == 6
        assert {r.status for r in records} == {RecordStatus.completed}


class _FailingGroup:
    def __init__(self, store: GroupingMemoryStore) -> None:
        self.store = store

    async def begin(self) -> None:
        return None

    async def commit(self) -> None:
        self.store.commits += 1
        if self.store.commits == self.store.fail_at:
            raise StoreReplyLostError("the commit's reply was lost")


class GroupingMemoryStore(MemoryIdempotencyStore):
    """A memory store that says it groups writes, and fails its ``fail_at``-th commit
    (its writes are applied at once, so what the runner does after is what shows)."""

    def __init__(self, fail_at: int) -> None:
        super().__init__()
        self.fail_at = fail_at
        self.commits = 0

    def write_group(self) -> _FailingGroup:
        return _FailingGroup(self)

    def joins(self, group: object) -> bool:
        return isinstance(group, _FailingGroup) and group.store is self


async def test_a_group_that_fails_to_commit_sends_nothing_more_and_drops_its_claims() -> None:
    sent: list[str] = []

    @tool
    def book(seat: str) -> str:
        sent.append(seat)
        return f"booked {seat}"

    # Commit 1 holds the first turn's claim of seat 0-0: it fails, so nothing is sent.
    store = GroupingMemoryStore(fail_at=1)
    runner = AgentRunner(ScriptedProvider(_turns(2, 1)), idempotency=store)
    with pytest.raises(StoreUnavailableError, match="nothing more was sent"):
        await runner.run(Agent("g", "b", tools=[book]), "go", tenant=TENANT, run_id="r")
    assert sent == []
    assert await store.records(TENANT, "r") == []


async def test_a_group_that_fails_holding_an_outcome_records_it_again_and_stops() -> None:
    sent: list[str] = []

    @tool
    def book(seat: str) -> str:
        sent.append(seat)
        return f"booked {seat}"

    # Commit 2 holds seat 0-0's outcome and seat 0-1's claim.
    store = GroupingMemoryStore(fail_at=2)
    runner = AgentRunner(ScriptedProvider(_turns(2, 1)), idempotency=store)
    with pytest.raises(StoreUnavailableError, match="nothing more was sent"):
        await runner.run(Agent("g", "b", tools=[book]), "go", tenant=TENANT, run_id="r")
    assert sent == ["0-0"]
    records = {r.call_id: r for r in await store.records(TENANT, "r")}
    assert records["call_0_0"].status is RecordStatus.completed
    assert "call_0_1" not in records


class _LookingCheckpoints(MemoryCheckpointStore):
    """A checkpoint store elsewhere (it joins no group) that looks, at each
    ``after_tool_result`` it takes, at what the SQLite file has committed."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path
        self.seen: list[set[str]] = []

    async def put(
        self, tenant: str, run_id: str, payload: bytes, *, step: int, fence: int | None = None
    ) -> None:
        if json.loads(payload)["boundary"] == "after_tool_result":
            with sqlite3.connect(self.path) as other:
                rows = other.execute("SELECT status FROM adk_idempotency WHERE run_id = 'r'")
                self.seen.append({str(status) for (status,) in rows})
        await super().put(tenant, run_id, payload, step=step, fence=fence)


async def test_a_frontier_that_commits_on_its_own_never_goes_before_the_last_outcome(
    stores: Stores,
) -> None:
    # The idempotency store groups; the checkpoints are elsewhere, so the frontier
    # commits on its own: the group holding the turn's last outcome commits first, or a
    # resume from that frontier would never look at the call's record again.
    looking = _LookingCheckpoints(database_of(stores).path)
    runner = AgentRunner(
        ScriptedProvider(_turns(1, 3)),
        idempotency=stores.idempotency,
        checkpoints=Checkpointer(looking),
    )

    @tool
    def book(seat: str) -> str:
        return f"booked {seat}"

    run = await runner.run(Agent("g", "b", tools=[book]), "go", tenant=TENANT, run_id="r")
    assert run.status == "completed"
    assert looking.seen == [{RecordStatus.completed.value}] * 3


async def test_a_group_that_fails_holding_the_turns_last_outcome_records_it_again() -> None:
    sent: list[str] = []

    @tool
    def book(seat: str) -> str:
        sent.append(seat)
        return f"booked {seat}"

    # Commit 2 holds seat 0-0's outcome, the turn's last: it fails, the outcome is
    # recorded again, and the run stops before its frontier. The resume replays it.
    store = GroupingMemoryStore(fail_at=2)
    checkpoints = Checkpointer(MemoryCheckpointStore())
    runner = AgentRunner(ScriptedProvider(_turns(1, 1)), idempotency=store, checkpoints=checkpoints)
    agent = Agent("g", "b", tools=[book])
    with pytest.raises(StoreUnavailableError, match="nothing more was sent"):
        await runner.run(agent, "go", tenant=TENANT, run_id="r")
    assert sent == ["0-0"]
    [record] = await store.records(TENANT, "r")
    assert record.status is RecordStatus.completed
    latest = await checkpoints.latest(TENANT, "r")
    assert latest is not None and str(latest.boundary) == "after_model_call"
    resumed = await runner.resume(agent, "r", tenant=TENANT)
    assert resumed.status == "completed"
    assert sent == ["0-0"]


async def test_a_masked_calls_claim_goes_in_its_group_and_nothing_is_kept_for_it(
    stores: Stores,
) -> None:
    # A resumed turn: book is sent, then store_key, whose arguments were masked, is claimed
    # and answered without being sent. Its claim goes again in the group that holds book's
    # outcome (it was recorded as a completed refusal, which under a business key would
    # answer the model's next real call of it): nothing is kept for it, nothing is sent
    # twice, and a later resume answers it alike.
    sent: list[str] = []

    @tool
    def book(seat: str) -> str:
        sent.append(seat)
        return f"booked {seat}"

    @tool
    def store_key(service: str, api_key: str) -> str:
        sent.append(api_key)
        return "stored"

    secret = "sk-proj-abcdefghijklmnopqrstuvwxyz0123456789ABCD"
    turns: list[Any] = [
        [("book", {"seat": "1A"}), ("store_key", {"service": "s", "api_key": secret})],
        "done",
    ]
    agent = Agent("g", "b", tools=[book, store_key])
    checkpoints = Checkpointer.from_stores(stores)
    faulty = FaultyCheckpointStore(checkpoints.store, crash_after=at("after_model_call", 0))
    checkpoints.store = faulty

    def runner() -> AgentRunner:
        return AgentRunner(
            ScriptedProvider(turns),
            idempotency=stores.idempotency,
            checkpoints=checkpoints,
            ledger=stores.ledger,
        )

    with pytest.raises(SimulatedCrash):
        await runner().run(agent, "go", tenant=TENANT, run_id="r")
    faulty.crash_after = None
    done = await runner().resume(agent, "r", tenant=TENANT)
    assert done.status == "completed"
    assert sent == ["1A"]
    records = {r.call_id: r for r in await stores.idempotency.records(TENANT, "r")}
    assert records["call_0_0"].status is RecordStatus.completed
    assert "call_0_1" not in records


class _RollingBackStore(GroupingMemoryStore):
    """Its failing commit undoes the outcomes recorded in the group (as a database rolls
    them back), and recording them again fails too: what the runner drops then shows."""

    def __init__(self, fail_at: int) -> None:
        super().__init__(fail_at)
        self.in_group: dict[tuple[str, str], Any] = {}
        self.down = False

    async def complete(self, key: str, outcome: bytes, *, tenant: str, holder: str) -> Any:
        if self.down:
            raise StoreUnavailableError("the store is down (the test)")
        self.in_group.setdefault((tenant, key), self._records.get((tenant, key)))
        return await super().complete(key, outcome, tenant=tenant, holder=holder)

    def rolled_back(self) -> None:
        for where, before in self.in_group.items():
            self._records[where] = before
        self.down = True


class _RollingBackGroup(_FailingGroup):
    store: _RollingBackStore

    async def commit(self) -> None:
        try:
            await super().commit()
        except StoreReplyLostError:
            self.store.rolled_back()
            raise StoreUnavailableError("the commit failed (the test)") from None
        self.store.in_group.clear()


async def test_a_twin_that_found_its_twins_outcome_never_drops_the_claim_of_a_sent_call() -> None:
    """Two calls of one turn under one business key: the first is sent and its outcome
    recorded in the group; the second finds that outcome and is answered with it. The
    group fails to commit (the outcome is rolled back: the key is claimed in flight, sent)
    and recording the outcome again fails too. The claim must stay: it is what tells a
    resume the call may have run. Dropping it (the second twin's claim asked to be dropped)
    would let a resume send the booking again."""
    sent: list[str] = []

    def by_seat(*, occurrence: int = 0, **kw: Any) -> str:
        return f"seat-{kw['arguments']['seat']}"  # one key for both twins, on purpose

    @tool(key=by_seat)
    def book(seat: str) -> str:
        sent.append(seat)
        return f"booked {seat}"

    store = _RollingBackStore(fail_at=2)
    store.write_group = lambda: _RollingBackGroup(store)  # type: ignore[method-assign]
    script: list[Any] = [ScriptedTurn(calls=[("book", {"seat": "7A"}), ("book", {"seat": "7A"})])]
    runner = AgentRunner(ScriptedProvider([*script, "done"]), idempotency=store)
    with pytest.raises(StoreUnavailableError):
        await runner.run(Agent("g", "b", tools=[book]), "go", tenant=TENANT, run_id="r")
    assert sent == ["7A"]
    [record] = await store.records(TENANT, "r")
    assert record.status is RecordStatus.in_flight, "the sent call's claim was dropped"
