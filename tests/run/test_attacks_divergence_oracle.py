"""Divergence and twin calls against a plain model of the world (SPEC "Deciding what
already ran", section 10 "Twin calls" and "Divergence is refused at the first moment it
shows").

A hypothesis test draws a scripted model (turns of one or several calls, identical twins
included, a read-only call beside side-effecting ones), an agent running
``parallel_tool_calls`` 1..3 at a time, a checkpoint policy (every boundary, only
``after_tool_result``, none), and a crash at a drawn moment: before or after a claim, inside
the tool once it took effect (its outcome not recorded), before or after a complete, before
or after an ``after_tool_result`` frontier; the crash is a ``SimulatedCrash`` raised there or
the task cancelled there. The resumed model then answers the same, reorders a turn, changes
one argument, adds a call (a twin too), drops a call, or finishes early.

The oracle is the world: which bookings (iteration, seat, occurrence within the turn) were
actually made, read against what the stores hold after the crash (the records and the last
frontier). From that it decides what the resume must do:

- no booking is ever made twice; twins are two bookings, each once;
- a booking in flight (claimed, its outcome not recorded) refuses the resume with
  ``IndeterminateToolCallError`` naming it, nothing sent;
- a turn asked again past the frontier that leaves out a booking already made there, or a
  run that would finish without asking again for one, is ``DivergedRunError`` (not
  retryable): nothing of that turn is claimed, sent, or written as a frontier;
- otherwise the run finishes, each booking it asked for made exactly once.

One real-process case checks the in-process model is faithful: a child process on SQLite
is SIGKILLed after its tool took effect under the policy with only ``after_tool_result``;
the resume refuses to guess, then after an operator's resolve a model that drops the call
is refused as diverged.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, event, given, settings

from tesserix_adk import (
    Agent,
    AgentRunner,
    Boundary,
    Checkpointer,
    CheckpointPolicy,
    DivergedRunError,
    IndeterminateToolCallError,
    Redactor,
    RunStatus,
    ScriptedProvider,
    ToolContext,
    ToolOutcome,
    tool,
)
from tesserix_adk.checkpoint.payload import encode_outcome
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.stores.protocols import RecordStatus
from tesserix_adk.stores.urls import open_stores
from tesserix_adk.testing.faults import (
    FaultyCheckpointStore,
    FaultyIdempotencyStore,
    SimulatedCrash,
)
from tesserix_adk.tools import default_key

T = "acme"
SEATS = ("1A", "2B", "3C")
POLICIES = {
    "all": CheckpointPolicy(),
    "tools": CheckpointPolicy(boundaries={Boundary.after_tool_result}),
    "none": CheckpointPolicy(boundaries=set()),
}
MAX_ITERATIONS = 6

Call = tuple[str, dict[str, Any]]
Turn = list[Call] | str


# --- the world and the crash --------------------------------------------------------------


@dataclass
class Crash:
    """Where the first attempt dies: ``where`` one of the points below, at its ``nth``
    occurrence; ``how`` ``raise`` (a ``SimulatedCrash`` there) or ``cancel`` (the task
    cancelled there: it stops at its next await)."""

    where: str
    nth: int
    how: str
    seen: Counter[str] = field(default_factory=Counter)
    fired: bool = False
    armed: bool = True
    task: asyncio.Future[Any] | None = None
    loop: asyncio.AbstractEventLoop | None = None

    def point(self, where: str) -> None:
        if not self.armed or self.fired or where != self.where:
            return
        self.seen[where] += 1
        if self.seen[where] - 1 != self.nth:
            return
        self.fired = True
        if self.how == "cancel":
            assert self.task is not None and self.loop is not None
            self.loop.call_soon_threadsafe(self.task.cancel)  # a sync tool's thread too
            return
        raise SimulatedCrash(f"died at {where} #{self.nth}")


@dataclass
class World:
    """The airline: every booking made, by its key; the read-only looks are free."""

    bookings: list[tuple[int, str, str]] = field(default_factory=list)  # iteration, seat, key
    crash: Crash | None = None

    def point(self, where: str) -> None:
        if self.crash is not None:
            self.crash.point(where)

    def agent(self, parallel: int, sync: bool = False) -> Agent:
        def booking(seat: str, ctx: ToolContext) -> str:
            assert ctx.idempotency_key is not None
            self.bookings.append((ctx.iteration, seat, ctx.idempotency_key))
            self.point("tool book")
            return f"booked {seat}"

        if sync:

            @tool
            def book(seat: str, ctx: ToolContext) -> str:
                """Book a seat (side-effecting, keyed)."""
                return booking(seat, ctx)

        else:

            @tool
            async def book(seat: str, ctx: ToolContext) -> str:
                """Book a seat (side-effecting, keyed)."""
                return booking(seat, ctx)

        @tool(side_effects=False)
        async def look(seat: str) -> str:
            """Look at a seat (read-only: safe to send again)."""
            return f"{seat} is free"

        return Agent(
            "div",
            "Do as scripted.",
            [book, look],
            parallel_tool_calls=parallel,
            max_iterations=MAX_ITERATIONS,
        )


def _hook(world: World) -> Callable[[str, str, str], None]:
    def hook(phase: str, op: str, key: str) -> None:
        if op in ("claim", "complete"):
            world.point(f"{phase} {op}")

    return hook


def _runner(
    stores: Stores, world: World, script: list[Turn], policy: CheckpointPolicy
) -> tuple[AgentRunner, FaultyCheckpointStore]:
    checkpoints = FaultyCheckpointStore(
        stores.checkpoints,
        crash_before=lambda body: _frontier_point(world, "before", body),
        crash_after=lambda body: _frontier_point(world, "after", body),
    )
    runner = AgentRunner(
        ScriptedProvider(script),
        idempotency=FaultyIdempotencyStore(stores.idempotency, hook=_hook(world)),
        checkpoints=Checkpointer(checkpoints, history=stores.history, policy=policy),
        leases=stores.leases,
        ledger=stores.ledger,
        approvals=stores.approvals,
        work=stores.work,
    )
    return runner, checkpoints


def _frontier_point(world: World, phase: str, body: dict[str, Any]) -> bool:
    if body.get("boundary") == "after_tool_result":
        try:
            world.point(f"{phase} frontier")
        except SimulatedCrash:
            return True
    return False


# --- the model of what must happen ---------------------------------------------------------


def _keys(run_id: str, iteration: int, turn: list[Call]) -> list[tuple[str, str]]:
    """(key, tool) of each call of a turn, twins told apart by their occurrence."""
    seen: Counter[tuple[str, str]] = Counter()
    out = []
    for name, args in turn:
        twin = (name, repr(sorted(args.items())))
        occurrence = seen[twin]
        seen[twin] += 1
        key = default_key(
            tenant=T,
            run_id=run_id,
            iteration=iteration,
            tool=name,
            arguments=args,
            occurrence=occurrence,
        )
        out.append((key, name))
    return out


@dataclass
class Expected:
    outcome: str  # completed | diverged | indeterminate
    booked: set[str]  # every booking key made once the resume is over
    diverged_at: int | None = None
    in_doubt: set[str] = field(default_factory=set)


def _expect(
    run_id: str,
    first: list[Turn],
    then: list[Turn],
    records: list[Any],
    frontier: Any,
    booked: set[str],
) -> Expected:
    """What the resume must do, from what the stores hold and the world saw."""
    books = [r for r in records if r.tool == "book"]
    in_doubt = {r.key for r in books if r.status is RecordStatus.in_flight}
    if frontier is not None and frontier.status.value != "running":
        return Expected("completed", set(booked))
    if in_doubt:
        return Expected("indeterminate", set(booked), in_doubt=in_doubt)
    done = {r.key: r.iteration for r in books if r.status is RecordStatus.completed}
    made = set(booked)
    if frontier is None:
        start = 0
    elif frontier.boundary is Boundary.after_tool_result:
        start = frontier.iteration + 1
    else:  # after_model_call: its outstanding calls (the first model's turn) go out first
        turn = first[frontier.iteration]
        assert not isinstance(turn, str)
        made |= {k for k, name in _keys(run_id, frontier.iteration, turn) if name == "book"}
        start = frontier.iteration + 1
    ahead: dict[int, set[str]] = {}
    for key, iteration in done.items():
        if frontier is None or iteration >= start:
            ahead.setdefault(iteration, set()).add(key)
    for j in range(start, MAX_ITERATIONS + 1):
        turn = then[j] if j < len(then) else "done"
        if j >= MAX_ITERATIONS or isinstance(turn, str):
            if ahead:
                return Expected("diverged", made, diverged_at=j)
            return Expected("completed", made)
        asked = {k for k, name in _keys(run_id, j, turn) if name == "book"}
        if not ahead.get(j, set()) <= asked:
            return Expected("diverged", made, diverged_at=j)
        ahead.pop(j, None)
        made |= asked
    raise AssertionError("unreachable")


# --- strategies ----------------------------------------------------------------------------

calls_st = st.lists(
    st.tuples(st.sampled_from(["book", "book", "look"]), st.sampled_from(SEATS)).map(
        lambda c: (c[0], {"seat": c[1]})
    ),
    min_size=1,
    max_size=4,
)
script_st = st.lists(calls_st, min_size=1, max_size=3)
crash_st = st.builds(
    Crash,
    where=st.sampled_from(
        [
            "before claim",
            "after claim",
            "tool book",
            "before complete",
            "after complete",
            "before frontier",
            "after frontier",
        ]
    ),
    nth=st.integers(0, 5),
    how=st.sampled_from(["raise", "raise", "cancel"]),
)


@st.composite
def resumed_st(draw: st.DrawFn, turns: list[list[Call]]) -> tuple[str, list[Turn]]:
    """The resumed model: the first model's script with one turn changed."""
    how = draw(st.sampled_from(["same", "reorder", "change", "add", "drop", "finish"]))
    then: list[Turn] = [list(t) for t in turns]
    if how == "same":
        return how, [*then, "done"]
    at = draw(st.integers(0, len(turns) - 1))
    turn = list(turns[at])
    if how == "finish":
        return how, [*then[:at], "finished early"]
    if how == "reorder":
        turn = draw(st.permutations(turn))
    elif how == "change":
        i = draw(st.integers(0, len(turn) - 1))
        name, args = turn[i]
        other = draw(st.sampled_from([s for s in SEATS if s != args["seat"]]))
        turn[i] = (name, {"seat": other})
    elif how == "add":
        extra = draw(st.sampled_from([*turn, ("book", {"seat": "9Z"})]))
        turn.insert(draw(st.integers(0, len(turn))), extra)
    elif how == "drop":
        if len(turn) == 1:
            return how, [*then[:at], "finished early"]
        del turn[draw(st.integers(0, len(turn) - 1))]
    then[at] = turn
    return how, [*then, "done"]


@st.composite
def case_st(draw: st.DrawFn) -> dict[str, Any]:
    turns = draw(script_st)
    how, then = draw(resumed_st(turns))
    return {
        "turns": turns,
        "then": then,
        "resumed": how,
        "crash": draw(crash_st),
        "parallel": draw(st.integers(1, 3)),
        "sync": draw(st.booleans()),
        "policy": draw(st.sampled_from(sorted(POLICIES))),
    }


# --- the property ---------------------------------------------------------------------------


async def _check(stores: Stores, case: dict[str, Any]) -> None:
    run_id = f"r-{uuid.uuid4().hex[:10]}"
    first: list[Turn] = [*case["turns"], "done"]
    then: list[Turn] = case["then"]
    policy = POLICIES[case["policy"]]
    world = World(crash=case["crash"])
    agent = world.agent(case["parallel"], case["sync"])
    dying, _ = _runner(stores, world, first, policy)
    task = asyncio.ensure_future(dying.run(agent, "go", tenant=T, run_id=run_id))
    world.crash.task, world.crash.loop = task, asyncio.get_running_loop()
    with contextlib.suppress(SimulatedCrash, asyncio.CancelledError):
        await task
    assert world.crash is not None
    world.crash.armed = False
    event(f"crashed={world.crash.fired} policy={case['policy']} resumed={case['resumed']}")

    # What the world saw and what the stores hold, read after the crash.
    made = Counter(k for _, _, k in world.bookings)
    assert all(n == 1 for n in made.values()), world.bookings  # twins are two calls
    records = [r for r in await stores.idempotency.records(T, run_id) if r.tool is not None]
    by_key = {r.key: r for r in records}
    for key in made:  # a booking made is claimed, never released as undispatched
        assert key in by_key and by_key[key].status is not RecordStatus.never_ran, key
    for r in records:
        if r.tool == "book" and r.status is RecordStatus.completed:
            assert made[r.key] == 1, r
    frontier = await Checkpointer(stores.checkpoints).latest(T, run_id)
    expected = _expect(run_id, first, then, records, frontier, set(made))

    padded = [*then, *["done"] * MAX_ITERATIONS]
    resuming, written = _runner(stores, world, padded, policy)
    try:
        if frontier is None:  # no frontier: the same run() again carries it on
            run = await resuming.run(agent, "go", tenant=T, run_id=run_id)
        else:
            run = await resuming.resume(agent, run_id, tenant=T)
    except DivergedRunError as exc:
        outcome: Any = exc
    except IndeterminateToolCallError as exc:
        outcome = exc
    else:
        outcome = run
    after = Counter(k for _, _, k in world.bookings)
    assert all(n == 1 for n in after.values()), world.bookings  # never a second booking
    note = f"{case} expected {expected} got {outcome!r}"
    if expected.outcome == "indeterminate":
        assert isinstance(outcome, IndeterminateToolCallError), note
        assert outcome.retryable is False
        assert after == made, note  # nothing sent
        named = {c.key for c in outcome.calls}
        assert expected.in_doubt <= named, note
        return
    if expected.outcome == "diverged":
        assert isinstance(outcome, DivergedRunError), note
        assert outcome.retryable is False
        assert set(after) == expected.booked, note
        j = expected.diverged_at
        assert j is not None
        # Nothing of the diverging turn: no claim at its iteration, no frontier of it.
        now = [r for r in await stores.idempotency.records(T, run_id) if r.tool is not None]
        assert {r.key for r in now if r.iteration == j} == {
            r.key for r in records if r.iteration == j
        }, note
        assert all(p.get("iteration", -1) < j for p in written.puts), (note, written.puts)
        latest = await Checkpointer(stores.checkpoints).latest(T, run_id)
        assert latest is None or latest.status.value == "running", note
        await _resume_with_the_truth(stores, world, agent, run_id, first, policy, latest)
        return
    assert not isinstance(outcome, Exception), note
    assert outcome.status is RunStatus.completed, note
    assert set(after) == expected.booked, note


async def _resume_with_the_truth(
    stores: Stores,
    world: World,
    agent: Agent,
    run_id: str,
    first: list[Turn],
    policy: CheckpointPolicy,
    frontier: Any,
) -> None:
    """After a refusal as diverged, the refused run is still whole: a resume whose model
    asks what happened carries it on, booking nothing twice."""
    made = Counter(k for _, _, k in world.bookings)
    records = [r for r in await stores.idempotency.records(T, run_id) if r.tool is not None]
    expected = _expect(run_id, first, first, records, frontier, set(made))
    runner, _ = _runner(stores, world, [*first, *["done"] * MAX_ITERATIONS], policy)
    try:
        if frontier is None:
            outcome: Any = await runner.run(agent, "go", tenant=T, run_id=run_id)
        else:
            outcome = await runner.resume(agent, run_id, tenant=T)
    except DivergedRunError as exc:
        outcome = exc
    after = Counter(k for _, _, k in world.bookings)
    assert all(n == 1 for n in after.values()), world.bookings
    note = f"truth: expected {expected} got {outcome!r}"
    if expected.outcome == "diverged":
        assert isinstance(outcome, DivergedRunError), note
        return
    assert not isinstance(outcome, Exception), note
    assert outcome.status is RunStatus.completed, note
    assert set(after) == expected.booked, note


SETTINGS = settings(
    max_examples=int(os.environ.get("DIVERGENCE_EXAMPLES", "150")),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@SETTINGS
@given(case=case_st())
def test_memory_resume_never_books_twice_and_refuses_divergence_first(
    case: dict[str, Any],
) -> None:
    async def go() -> None:
        async with open_stores("memory://") as stores:
            await stores.create_schema()
            await _check(stores, case)

    asyncio.run(go())


@SETTINGS
@given(case=case_st())
def test_sqlite_resume_never_books_twice_and_refuses_divergence_first(
    case: dict[str, Any],
) -> None:
    with tempfile.TemporaryDirectory() as tmp:

        async def go() -> None:
            async with open_stores(f"sqlite:///{tmp}/adk.sqlite3") as stores:
                await stores.create_schema()
                await _check(stores, case)

        asyncio.run(go())


# --- one real process killed with SIGKILL ---------------------------------------------------

_CHILD = textwrap.dedent(
    '''
    import asyncio, os, sys, time

    from tesserix_adk import (
        Agent, AgentRunner, Boundary, Checkpointer, CheckpointPolicy, LeasePolicy,
        ScriptedProvider, ToolContext, open_stores, tool,
    )

    url, airline, run_id = sys.argv[1], sys.argv[2], sys.argv[3]

    @tool
    def book(seat: str, ctx: ToolContext) -> str:
        """Book a seat (side-effecting, keyed)."""
        with open(airline, "a") as f:
            f.write(f"{ctx.iteration} {seat} {ctx.idempotency_key}\\n")
        with open(airline) as f:
            if len(f.read().splitlines()) == 3:
                open(airline + ".third", "w").close()
                time.sleep(120)  # killed here: booked, its outcome not recorded
        return f"booked {seat}"

    @tool(side_effects=False)
    def look(seat: str) -> str:
        """Look at a seat (read-only: safe to send again)."""
        return f"{seat} is free"

    TURN = [("book", {"seat": "1A"}), ("book", {"seat": "1A"}), ("book", {"seat": "2B"})]

    async def main():
        async with open_stores(url) as stores:
            runner = AgentRunner(
                ScriptedProvider([TURN, "done"]),
                idempotency=stores.idempotency,
                checkpoints=Checkpointer(
                    stores.checkpoints,
                    history=stores.history,
                    policy=CheckpointPolicy(boundaries={Boundary.after_tool_result}),
                ),
                leases=stores.leases,
                ledger=stores.ledger,
                approvals=stores.approvals,
                work=stores.work,
                lease_policy=LeasePolicy(ttl=1, renew_within=0.5),
            )
            agent = Agent("div", "Do as scripted.", [book, look], max_iterations=6)
            await runner.run(agent, "go", tenant="acme", run_id=run_id)

    asyncio.run(main())
    '''
)

KILLED_TURN: list[Call] = [
    ("book", {"seat": "1A"}),
    ("book", {"seat": "1A"}),
    ("book", {"seat": "2B"}),
]


def _statuses(records: list[Any]) -> list[tuple[int | None, str, str]]:
    return sorted((r.iteration, r.key, r.status.value) for r in records if r.tool is not None)


@pytest.mark.skipif(os.name != "posix", reason="needs POSIX signals")
def test_sigkill_inside_a_twin_turn_matches_the_in_process_model(tmp_path: Path) -> None:
    """A process SIGKILLed inside the third call of a turn (twins first), with only
    ``after_tool_result`` frontiers: the stores hold what the in-process crash leaves (two
    twins completed, the third in flight, no frontier); the resume refuses to guess; once an
    operator says the third ran, a model that asks for one twin only is refused as diverged
    with nothing sent or written; the model that asks for all three finishes, three
    bookings in all."""
    run_id = f"killed-{uuid.uuid4().hex[:8]}"
    modelled = asyncio.run(_modelled_death(tmp_path, run_id))
    url = f"sqlite:///{tmp_path / 'adk.sqlite3'}"
    asyncio.run(_schema(url))
    script = tmp_path / "child.py"
    script.write_text(_CHILD)
    airline = tmp_path / "airline.txt"
    proc = subprocess.Popen(
        [sys.executable, str(script), url, str(airline), run_id],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        for _ in range(1500):
            if Path(f"{airline}.third").exists() or proc.poll() is not None:
                break
            time.sleep(0.02)
        assert Path(f"{airline}.third").exists(), proc.poll()
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGKILL, err[-2000:]
    lines = [line.split() for line in airline.read_text().splitlines()]
    assert [(int(i), s) for i, s, _ in lines] == [(0, "1A"), (0, "1A"), (0, "2B")]
    assert len({k for _, _, k in lines}) == 3  # twins are two calls
    asyncio.run(_after_the_kill(url, run_id, modelled, [k for _, _, k in lines]))
    assert len(airline.read_text().splitlines()) == 3


async def _schema(url: str) -> None:
    async with open_stores(url) as stores:
        await stores.create_schema()


async def _modelled_death(tmp_path: Path, run_id: str) -> list[tuple[int | None, str, str]]:
    """The in-process model of the same death: what the stores hold after it."""
    world = World(crash=Crash("tool book", 2, "raise"))
    async with open_stores(f"sqlite:///{tmp_path / 'model.sqlite3'}") as stores:
        await stores.create_schema()
        dying, _ = _runner(stores, world, [KILLED_TURN, "done"], POLICIES["tools"])
        with pytest.raises(SimulatedCrash):
            await dying.run(world.agent(1), "go", tenant=T, run_id=run_id)
        assert await stores.checkpoints.latest(T, run_id) is None
        return _statuses(await stores.idempotency.records(T, run_id))


async def _after_the_kill(
    url: str, run_id: str, modelled: list[tuple[int | None, str, str]], booked: list[str]
) -> None:
    policy = POLICIES["tools"]
    killed = World()
    agent = killed.agent(1)
    async with open_stores(url) as stores:
        records = await stores.idempotency.records(T, run_id)
        assert _statuses(records) == modelled  # the in-process model is faithful
        assert await stores.checkpoints.latest(T, run_id) is None
        for _ in range(500):  # the dead holder's 1 s lease lapses by the store's clock
            if await stores.leases.current(T, run_id) is None:
                break
            await asyncio.sleep(0.02)

        def runner(script: list[Turn]) -> AgentRunner:
            return _runner(stores, killed, [*script, *["done"] * MAX_ITERATIONS], policy)[0]

        with pytest.raises(IndeterminateToolCallError) as doubt:
            await runner([KILLED_TURN]).run(agent, "go", tenant=T, run_id=run_id)
        in_flight = [r for r in records if r.status is RecordStatus.in_flight]
        assert [c.key for c in doubt.value.calls] == [r.key for r in in_flight]
        assert in_flight[0].key == booked[2]
        assert killed.bookings == []

        # The operator: it ran (the airline holds it).
        outcome = encode_outcome(ToolOutcome(call_id="", content="booked 2B"), Redactor())
        await stores.idempotency.resolve(in_flight[0].key, outcome, tenant=T, by="ops")

        with pytest.raises(DivergedRunError) as diverged:
            await runner([[("book", {"seat": "1A"}), ("book", {"seat": "2B"})]]).run(
                agent, "go", tenant=T, run_id=run_id
            )
        assert diverged.value.retryable is False
        assert killed.bookings == []
        assert _statuses(await stores.idempotency.records(T, run_id)) == [
            (i, k, "completed") for i, k, _ in modelled
        ]
        assert await stores.checkpoints.latest(T, run_id) is None

        run = await runner([KILLED_TURN]).run(agent, "go", tenant=T, run_id=run_id)
        assert run.status is RunStatus.completed
        assert killed.bookings == []  # all three replayed, none sent again
