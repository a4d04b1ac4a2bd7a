"""Attacks on ``AgentRunner.stream``/``stream_resume`` by consumers that misbehave.

A consumer breaks out of ``async for``, closes the iterator, raises in its loop body (an
``Exception``, a ``BaseException``), is cancelled (once, twice), is slow, blocks the event
loop past the lease, iterates twice or never. Each time the promises are checked: the
lease and resume claim are let go, the last frontier is resumable, and a later resume (the
same runner, a fresh one, a ``Worker``) sends each side-effecting call exactly once. Real
SQLite files, and the shared PostgreSQL and Redis servers.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing, suppress
from pathlib import Path
from typing import Any

import pytest

from booking import Airline, booking_agent
from run.helpers import at, faulty_runner, fresh_stores
from tesserix_adk import (
    Agent,
    AgentRunner,
    LeasePolicy,
    ResumeConflictError,
    RunStatus,
    ScriptedProvider,
    Worker,
    tool,
)
from tesserix_adk.checkpoint.payload import Boundary
from tesserix_adk.errors import (
    AdkError,
    IndeterminateToolCallError,
    LeaseHeldError,
    RunStartedError,
)
from tesserix_adk.providers.scripted import ScriptedTurn
from tesserix_adk.run.events import (
    AttemptResumed,
    CallDisposition,
    FrontierWritten,
    ModelCallFinished,
    ModelCallStarted,
    RunEvent,
    RunFinished,
    TextDelta,
    ToolCallAsked,
    ToolCallFinished,
    ToolCallStarted,
)
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.testing.faults import SimulatedCrash

T = "acme"
CLI = Path(sys.executable).parent / "tesserix"

TURNS: list[Any] = [
    [("search_flights", {"origin": "FRA", "dest": "JFK"})],
    ScriptedTurn(text="Booking LH123 for you now.", calls=[("book_seat", {"flight": "LH123"})]),
    "Booked LH123 from Frankfurt to New York.",
]


def runner_of(stores: Stores, *, ttl: float = 30.0, **kwargs: Any) -> AgentRunner:
    """A runner ("a process") over ``stores``; lease ttl 30 s unless told, so a lease the
    consumer left behind would make every resume below a ``ResumeConflictError``."""
    return AgentRunner.from_stores(
        ScriptedProvider(list(TURNS)),
        stores,
        worker="viewer",
        lease_policy=LeasePolicy(ttl=ttl, renew_within=ttl / 3),
        **kwargs,
    )


def slow_booking(airline: Airline, seconds: float = 0.2) -> None:
    """book_seat takes ``seconds`` before it books: a consumer leaving at its start leaves
    while the sync tool's thread is still going."""
    airline.hook = lambda stage: time.sleep(seconds) if stage == "before" else None


Pick = Callable[[RunEvent], bool]

POINTS: dict[str, Pick] = {
    "model-started-0": lambda e: isinstance(e, ModelCallStarted) and e.iteration == 0,
    "asked-search": lambda e: isinstance(e, ToolCallAsked) and e.name == "search_flights",
    "frontier-after-search": lambda e: (
        isinstance(e, FrontierWritten) and e.boundary is Boundary.after_tool_result and e.step == 2
    ),
    "text-of-booking-turn": lambda e: isinstance(e, TextDelta) and e.iteration == 1,
    "asked-book": lambda e: isinstance(e, ToolCallAsked) and e.name == "book_seat",
    "started-book": lambda e: isinstance(e, ToolCallStarted) and e.name == "book_seat",
    "finished-book": lambda e: isinstance(e, ToolCallFinished) and e.name == "book_seat",
    "frontier-after-book": lambda e: (
        isinstance(e, FrontierWritten) and e.boundary is Boundary.after_tool_result and e.step == 4
    ),
    "text-of-final-answer": lambda e: isinstance(e, TextDelta) and e.iteration == 2,
    "model-finished-final": lambda e: isinstance(e, ModelCallFinished) and e.iteration == 2,
}


async def leave_at(stream: AsyncIterator[RunEvent], pick: Pick) -> list[RunEvent]:
    """Read ``stream`` until ``pick`` says leave (``break`` inside ``aclosing``)."""
    seen: list[RunEvent] = []
    async with aclosing(stream) as events:
        async for event in events:
            seen.append(event)
            if pick(event):
                break
    return seen


async def finish_with(how: str, stores: Stores, same: AgentRunner, airline: Airline) -> None:
    """Carry run r1 on: the same runner, a fresh one, or a ``Worker``; at once (the lease
    was let go, so no wait on the 30 s ttl)."""
    agent = booking_agent(airline)
    if how == "worker":
        worker = Worker(
            runner_of(stores), [agent], exit_when_idle=True, poll_interval=0.01, concurrency=1
        )
        await asyncio.wait_for(worker.run(), 20)
        return
    runner = same if how == "same-runner" else runner_of(stores)
    if await latest(stores) is None:
        # Left before the first frontier: nothing to resume; ``run`` again, as README
        # says of a run whose first frontier could not be written.
        run = await runner.run(agent, "book", tenant=T, run_id="r1")
    else:
        run = await runner.resume(agent, "r1", tenant=T)
    assert run.status is RunStatus.completed


async def latest(stores: Stores, run_id: str = "r1") -> Any:
    return await runner_of(stores).checkpoints.latest(T, run_id)  # type: ignore[union-attr]


# Before the first frontier a worker starts the run from its submission.
CASES = [
    (point, resumer) for point in POINTS for resumer in ("same-runner", "fresh-runner", "worker")
]


@pytest.mark.parametrize(("point", "resumer"), CASES)
async def test_leaving_at_any_event_then_carrying_on_books_once(
    point: str, resumer: str, tmp_path: Path
) -> None:
    airline = Airline()
    slow_booking(airline)
    async with fresh_stores("sqlite", tmp_path) as stores:
        runner = runner_of(stores)
        seen = await leave_at(
            runner.stream(booking_agent(airline), "book", tenant=T, run_id="r1"), POINTS[point]
        )
        assert POINTS[point](seen[-1])
        assert len(airline.bookings) <= 1
        await finish_with(resumer, stores, runner, airline)
        assert airline.bookings == ["LH123"]
        cp = await latest(stores)
        assert cp.status.value == "completed"
        assert await stores.leases.current(T, "r1") is None


def cli(path: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    """``tesserix`` as an operator runs it, in a process of its own, on the SQLite file."""
    return subprocess.run(
        [str(CLI), *argv, "--tenant", T, "--store", f"sqlite:///{path}"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "NO_COLOR": "1"},
    )


async def test_leaving_before_the_first_frontier_leaves_the_run_to_a_worker(
    tmp_path: Path,
) -> None:
    """Found as a defect: the run was left wanted with no input, and a worker parked it
    (NoCheckpointError) for an operator. A run started on a runner with a work index keeps
    its input as a submission, so a worker starts it as it would one submitted, as it carries
    on one left after its first frontier: nothing parked, one booking."""
    airline = Airline()
    async with fresh_stores("sqlite", tmp_path) as stores:
        seen = await leave_at(
            runner_of(stores).stream(booking_agent(airline), "book", tenant=T, run_id="r1"),
            POINTS["model-started-0"],
        )
        assert isinstance(seen[-1], ModelCallStarted)
        assert await latest(stores) is None  # nothing checkpointed: the run never began
        worker = Worker(
            runner_of(stores), [booking_agent(airline)], exit_when_idle=True, poll_interval=0.01
        )
        await asyncio.wait_for(worker.run(), 20)
        assert stores.work is not None
        parked = [i for i in await stores.work.items(T) if i.state.value == "parked"]
        finished = await latest(stores)
        stuck = cli(tmp_path / "adk.sqlite3", "runs", "--stuck")
    assert len(airline.bookings) == 1
    assert finished is not None and finished.status.value == "completed"
    assert stuck.returncode == 0, stuck.stderr
    assert parked == [], parked
    assert "r1" not in stuck.stdout, stuck.stdout


class ConsumerQuit(BaseException):
    """A consumer's own BaseException (a KeyboardInterrupt, a SystemExit) in its loop."""


async def read_and(how: str, stream: AsyncIterator[RunEvent], pick: Pick) -> None:
    """Read ``stream`` without ``aclosing`` and misbehave at the event ``pick`` picks."""
    async for event in stream:
        if pick(event):
            if how == "exception":
                raise ValueError("the consumer's own bug")
            if how == "base-exception":
                raise ConsumerQuit()
            if how == "cancelled-error":
                raise asyncio.CancelledError()
            if how == "break":
                break


async def until_free(runner: AgentRunner, airline: Airline) -> Any:
    """Resume r1 as soon as the dropped stream let go of it (the loop closes a dropped
    async generator soon, not at once); ``pytest.fail`` if it never does."""
    for _ in range(500):
        try:
            return await runner.resume(booking_agent(airline), "r1", tenant=T)
        except ResumeConflictError:
            await asyncio.sleep(0.01)
    pytest.fail("the stream never let go of the run")


@pytest.mark.parametrize("how", ["exception", "base-exception", "cancelled-error", "break"])
async def test_a_consumer_raising_in_its_loop_body_leaves_the_run_resumable(
    how: str, tmp_path: Path
) -> None:
    airline = Airline()
    slow_booking(airline)
    path = tmp_path / "adk.sqlite3"
    async with fresh_stores("sqlite", tmp_path) as stores:
        stream = runner_of(stores).stream(booking_agent(airline), "book", tenant=T, run_id="r1")
        with suppress(ValueError, ConsumerQuit, asyncio.CancelledError):
            await read_and(how, stream, POINTS["started-book"])
        del stream
        # What an operator sees meanwhile: a run at a frontier, not finished, no traceback.
        shown = await asyncio.to_thread(cli, path, "runs")
        run = await until_free(runner_of(stores), airline)
        inspected = await asyncio.to_thread(cli, path, "inspect", "r1")
    assert shown.returncode == 0 and "Traceback" not in shown.stdout + shown.stderr, shown
    assert "r1" in shown.stdout
    assert run.status is RunStatus.completed
    assert airline.bookings == ["LH123"]  # booked by the stream's run, replayed by resume
    assert inspected.returncode == 0 and "Traceback" not in inspected.stderr, inspected


async def test_a_consumer_task_cancelled_twice_while_a_sync_tool_runs_books_once(
    tmp_path: Path,
) -> None:
    """Cancelled while the run waits for its sync tool's thread, then cancelled again while
    the iterator waits for the run to let go: the second cancellation goes on up, and the
    run's own cleanup still records the booking and lets go of the run."""
    airline = Airline()
    gate = threading.Event()
    inside = threading.Event()

    def hook(stage: str) -> None:
        if stage == "before":
            inside.set()
            gate.wait(10)

    airline.hook = hook
    async with fresh_stores("sqlite", tmp_path) as stores:
        stream = runner_of(stores).stream(booking_agent(airline), "book", tenant=T, run_id="r1")

        async def consume() -> None:
            async with aclosing(stream) as events:
                async for _ in events:
                    pass

        task = asyncio.create_task(consume())
        await asyncio.to_thread(inside.wait, 10)
        task.cancel()
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        gate.set()
        run = await until_free(runner_of(stores), airline)
    assert run.status is RunStatus.completed
    assert airline.bookings == ["LH123"]


def async_booking_agent(airline: Airline, inside: asyncio.Event, gate: asyncio.Event) -> Any:
    """The booking agent with an async ``book_seat`` that waits on ``gate`` before it books
    (an HTTP call in flight)."""

    @tool(side_effects=False)
    def search_flights(origin: str, dest: str) -> list[str]:
        """Find flights between two airports."""
        return ["LH123"]

    @tool
    async def book_seat(flight: str) -> dict[str, str]:
        """Book one seat on a flight."""
        inside.set()
        await gate.wait()
        airline.bookings.append(flight)
        return {"booking": "B1", "flight": flight}

    return Agent("booking", "Book the flight the user asks for.", [search_flights, book_seat])


async def test_leaving_inside_an_async_tool_refuses_to_guess_then_books_once(
    tmp_path: Path,
) -> None:
    """The viewer leaves while an async ``book_seat`` is in flight: it is cancelled where
    it stands, so whether it booked is unknown. The resume refuses (never guesses), inspect
    names the call, and once an operator says it never ran it is sent once."""
    airline = Airline()
    inside, gate = asyncio.Event(), asyncio.Event()
    agent = async_booking_agent(airline, inside, gate)
    path = tmp_path / "adk.sqlite3"
    async with fresh_stores("sqlite", tmp_path) as stores:
        seen = await leave_at(
            runner_of(stores).stream(agent, "book", tenant=T, run_id="r1"),
            POINTS["started-book"],
        )
        assert isinstance(seen[-1], ToolCallStarted)
        assert inside.is_set() and airline.bookings == []
        with pytest.raises(IndeterminateToolCallError, match="book_seat"):
            await runner_of(stores).resume(agent, "r1", tenant=T)
        inspected = await asyncio.to_thread(cli, path, "inspect", "r1")
        call = seen[-1].call_id
        resolved = await asyncio.to_thread(
            cli,
            path,
            "resolve",
            "r1",
            "--call",
            call,
            "--never-ran",
            "--by",
            "oncall",
            "--margin",
            "0",
        )
        gate.set()
        run = await runner_of(stores).resume(agent, "r1", tenant=T)
    assert inspected.returncode == 0, inspected
    assert "indeterminate" in inspected.stdout and "book_seat" in inspected.stdout
    assert resolved.returncode == 0, resolved.stdout + resolved.stderr
    assert run.status is RunStatus.completed
    assert airline.bookings == ["LH123"]


async def test_a_consumer_slower_than_the_lease_ttl_does_not_cost_the_run_its_lease(
    tmp_path: Path,
) -> None:
    """The consumer sleeps (awaiting) longer than the lease ttl after each event: the run
    goes on at its own pace, renewing its lease; nothing is lost or sent twice."""
    airline = Airline()
    async with fresh_stores("sqlite", tmp_path) as stores:
        runner = runner_of(stores, ttl=0.6)
        events: list[RunEvent] = []
        async with aclosing(
            runner.stream(booking_agent(airline), "book", tenant=T, run_id="r1")
        ) as stream:
            async for event in stream:
                events.append(event)
                if len(events) <= 3:
                    await asyncio.sleep(1.0)
        cp = await latest(stores)
    assert isinstance(events[-1], RunFinished)
    assert events[-1].run.status is RunStatus.completed
    assert airline.bookings == ["LH123"]
    assert cp.status.value == "completed"


async def test_a_consumer_that_blocks_the_loop_past_the_lease_lets_a_taker_finish_once(
    tmp_path: Path,
) -> None:
    """The consumer blocks the event loop (``time.sleep`` in its body) past the lease ttl
    after the search's result: another process (a thread with its own loop and its own
    stores on the same file) takes the run over and books. When the consumer wakes, its
    run must send nothing: the seat is booked once and the stream ends with a typed error
    (its lease was lost), never a second booking."""
    airline = Airline()
    url = f"sqlite:///{tmp_path / 'adk.sqlite3'}"
    async with fresh_stores("sqlite", tmp_path) as stores:
        taken: list[Any] = []

        def take_over() -> None:
            from tesserix_adk import open_stores

            async def go() -> Any:
                async with open_stores(url) as other:
                    runner = runner_of(other, ttl=0.5)
                    for _ in range(100):
                        try:
                            return await runner.resume(booking_agent(airline), "r1", tenant=T)
                        except ResumeConflictError:
                            await asyncio.sleep(0.1)
                    return None

            taken.append(asyncio.run(go()))

        runner = runner_of(stores, ttl=0.5)
        seen: list[RunEvent] = []
        error: BaseException | None = None
        try:
            async with aclosing(
                runner.stream(booking_agent(airline), "book", tenant=T, run_id="r1")
            ) as stream:
                async for event in stream:
                    seen.append(event)
                    if POINTS["frontier-after-search"](event):
                        other = threading.Thread(target=take_over)
                        other.start()
                        other.join(30)  # the loop blocked all along: no renewal
        except AdkError as exc:
            error = exc
        cp = await latest(stores)
    assert taken and taken[0] is not None and taken[0].status is RunStatus.completed
    assert airline.bookings == ["LH123"], airline.bookings
    assert cp.status.value == "completed"
    finished = [e for e in seen if isinstance(e, RunFinished)]
    # Either it stopped with its lease lost, or it found the run finished by the taker;
    # never a booking of its own.
    assert error is not None or finished, seen


async def test_a_stream_never_iterated_takes_nothing_and_starts_nothing(tmp_path: Path) -> None:
    airline = Airline()
    async with fresh_stores("sqlite", tmp_path) as stores:
        runner = runner_of(stores)
        stream = runner.stream(booking_agent(airline), "book", tenant=T, run_id="r1")
        await asyncio.sleep(0.2)
        assert await stores.leases.current(T, "r1") is None
        assert await latest(stores) is None
        await stream.aclose()  # closing one never started is fine
        del stream
        run = await runner.run(booking_agent(airline), "book", tenant=T, run_id="r1")
    assert run.status is RunStatus.completed
    assert airline.bookings == ["LH123"]


async def test_a_stream_iterated_twice_yields_nothing_the_second_time_and_books_once(
    tmp_path: Path,
) -> None:
    airline = Airline()
    async with fresh_stores("sqlite", tmp_path) as stores:
        runner = runner_of(stores)
        stream = runner.stream(booking_agent(airline), "book", tenant=T, run_id="r1")
        first = [e async for e in stream]
        second = [e async for e in stream]
        # The same run id streamed again: a typed refusal, nothing sent.
        with pytest.raises(RunStartedError):
            async with aclosing(
                runner.stream(booking_agent(airline), "book", tenant=T, run_id="r1")
            ) as again:
                async for _ in again:
                    pass
    assert isinstance(first[-1], RunFinished) and second == []
    assert airline.bookings == ["LH123"]


async def test_two_streams_of_one_run_at_once_book_once(tmp_path: Path) -> None:
    airline = Airline()
    slow_booking(airline, 0.3)
    async with fresh_stores("sqlite", tmp_path) as stores:

        async def consume(runner: AgentRunner) -> Any:
            async with aclosing(
                runner.stream(booking_agent(airline), "book", tenant=T, run_id="r1")
            ) as events:
                return [e async for e in events]

        results = await asyncio.gather(
            consume(runner_of(stores)), consume(runner_of(stores)), return_exceptions=True
        )
    errors = [r for r in results if isinstance(r, BaseException)]
    done = [r for r in results if not isinstance(r, BaseException)]
    assert len(done) == 1 and isinstance(done[0][-1], RunFinished), results
    assert len(errors) == 1 and isinstance(errors[0], LeaseHeldError | RunStartedError), errors
    assert airline.bookings == ["LH123"]


async def test_one_stream_read_from_two_tasks_is_refused_not_doubled(tmp_path: Path) -> None:
    """Two tasks pull the same iterator at once: Python refuses the second pull (the
    generator is running); the run is not started twice and books once."""
    airline = Airline()
    slow_booking(airline, 0.2)
    async with fresh_stores("sqlite", tmp_path) as stores:
        stream = runner_of(stores).stream(booking_agent(airline), "book", tenant=T, run_id="r1")
        first = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0)
        with pytest.raises(RuntimeError, match="already running"):
            await anext(stream)
        seen = [await first]
        async with aclosing(stream) as events:
            seen += [e async for e in events]
    assert isinstance(seen[-1], RunFinished)
    assert airline.bookings == ["LH123"]


KEY = "sk-proj-" + "A1b2C3d4E5f6G7h8I9j0K1l2M3n4O5p6Q7r8S9t0"


def card_agent(issued: list[str]) -> Any:
    """An agent whose side-effecting tool answers with an API key."""

    @tool
    def issue_card(holder: str) -> dict[str, str]:
        """Issue a card; its API key comes back."""
        issued.append(holder)
        return {"card": f"C{len(issued)}", "api_key": KEY}

    return Agent("cards", "Issue cards.", [issue_card])


CARD_TURNS: list[Any] = [[("issue_card", {"holder": "ann"})], "Issued."]


async def stream_resume_when_free(runner: AgentRunner, agent: Any) -> list[RunEvent]:
    for _ in range(300):
        try:
            async with aclosing(runner.stream_resume(agent, "r1", tenant=T)) as events:
                return [e async for e in events]
        except ResumeConflictError:
            await asyncio.sleep(0.02)
    pytest.fail("the dead attempt's lease never lapsed")


@pytest.mark.parametrize("where", ["sqlite", "postgres", "redis"])
async def test_a_streamed_resume_tells_a_call_made_before_the_crash_as_replayed_and_masked(
    where: str, tmp_path: Path
) -> None:
    """The run dies after issue_card's outcome is recorded, before its frontier. The
    streamed resume reports the call (a UI would show it) as ``replayed``, never as
    ``dispatched`` again, with the content as stored (its key masked); it is issued once,
    and no store holds the key raw."""
    issued: list[str] = []
    agent = card_agent(issued)
    async with fresh_stores(where, tmp_path) as stores:
        dying = faulty_runner(
            stores,
            ScriptedProvider(list(CARD_TURNS)),
            crash_before=at("after_tool_result", 0),
            lease_policy=LeasePolicy(ttl=0.5, renew_within=0.2),
        )
        live: list[RunEvent] = []
        with pytest.raises(SimulatedCrash):
            async with aclosing(dying.stream(agent, "card", tenant=T, run_id="r1")) as events:
                async for event in events:
                    live.append(event)
        resumed = await stream_resume_when_free(
            AgentRunner.from_stores(ScriptedProvider(list(CARD_TURNS)), stores), agent
        )
        records = await stores.idempotency.records(T, "r1")
    (live_finish,) = [e for e in live if isinstance(e, ToolCallFinished)]
    assert live_finish.disposition is CallDisposition.dispatched
    assert isinstance(resumed[0], AttemptResumed)
    finishes = [e for e in resumed if isinstance(e, ToolCallFinished)]
    assert [(e.name, e.disposition) for e in finishes] == [("issue_card", CallDisposition.replayed)]
    assert KEY not in json.dumps(finishes[0].content)
    assert not [e for e in resumed if isinstance(e, ToolCallAsked)]  # not asked anew
    assert isinstance(resumed[-1], RunFinished)
    assert resumed[-1].run.status is RunStatus.completed
    assert issued == ["ann"]
    assert all(KEY.encode() not in bytes(r.outcome or b"") for r in records)


@pytest.mark.parametrize("where", ["postgres", "redis"])
@pytest.mark.parametrize("point", ["asked-book", "started-book", "text-of-final-answer"])
async def test_leaving_on_a_server_store_lets_go_at_once_and_books_once(
    where: str, point: str, tmp_path: Path
) -> None:
    """The same on PostgreSQL and Redis: left at ``point``, then left again at the same
    point of a streamed resume (where it comes again); a last resume at once books once."""
    airline = Airline()
    slow_booking(airline)
    async with fresh_stores(where, tmp_path) as stores:
        agent = booking_agent(airline)
        await leave_at(
            runner_of(stores).stream(agent, "book", tenant=T, run_id="r1"), POINTS[point]
        )
        if await latest(stores) is not None:
            await leave_at(runner_of(stores).stream_resume(agent, "r1", tenant=T), POINTS[point])
        await finish_with("fresh-runner", stores, runner_of(stores), airline)
        assert await stores.leases.current(T, "r1") is None
    assert airline.bookings == ["LH123"]


@pytest.mark.parametrize("point", ["asked-book", "text-of-booking-turn"])
async def test_leaving_as_an_approval_is_asked_then_approving_books_once(
    point: str, tmp_path: Path
) -> None:
    """book_seat needs a person: the viewer leaves as it is asked. A resume comes to the
    approval wait (or is there already), a person approves, a resume books once."""
    airline = Airline()
    async with fresh_stores("sqlite", tmp_path) as stores:
        agent = booking_agent(airline, approval=True)
        await leave_at(
            runner_of(stores).stream(agent, "book", tenant=T, run_id="r1"), POINTS[point]
        )
        assert airline.bookings == []
        waiting = await runner_of(stores).resume(agent, "r1", tenant=T)
        assert waiting.status is RunStatus.waiting_approval
        assert waiting.pending_approval is not None
        await stores.approvals.decide(T, waiting.pending_approval.id, approved=True, by="alice")
        done = await runner_of(stores).resume(agent, "r1", tenant=T)
        again = await runner_of(stores).resume(agent, "r1", tenant=T)
    assert done.status is RunStatus.completed and again.status is RunStatus.completed
    assert airline.bookings == ["LH123"]
