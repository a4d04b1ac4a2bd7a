"""``AgentRunner.stream`` and ``stream_resume``: a run's events as an async iterator.

Offline, with ``ScriptedProvider`` (which streams its text in pieces): the order of the
events of a booking run, errors raised after the events before them, a resume streamed
after a crash, and a consumer that leaves early stopping the run and letting go of it at
once (a second resume takes it straight away).
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
from collections.abc import AsyncIterator
from contextlib import aclosing
from pathlib import Path
from typing import Any

import pytest

from booking import Airline, booking_agent
from run.helpers import Recording
from tesserix_adk import (
    AgentRunner,
    Checkpointer,
    MemoryCheckpointStore,
    MemoryHistoryStore,
    MemoryIdempotencyStore,
    MemoryLeaseStore,
    MemoryLedger,
    ModelRequest,
    ModelResponse,
    ResumeConflictError,
    RunStatus,
    ScriptedProvider,
)
from tesserix_adk.checkpoint.payload import Boundary
from tesserix_adk.providers.base import TextSink
from tesserix_adk.providers.scripted import ScriptedTurn
from tesserix_adk.run.events import (
    AttemptResumed,
    FrontierWritten,
    RunEvent,
    RunFinished,
    TextDelta,
    ToolCallAsked,
    ToolCallFinished,
    ToolCallStarted,
)
from tesserix_adk.testing.faults import SimulatedCrash

EXAMPLES = Path(__file__).parent.parent.parent / "examples"

TURNS: list[Any] = [
    ScriptedTurn(text="Let me book LH123 for you.", calls=[("book_seat", {"flight": "LH123"})]),
    "Booked LH123 from Frankfurt to New York.",
]


class World:
    """Stores shared by every "process" (runner) of a test; leases held for real."""

    def __init__(self) -> None:
        self.idempotency = MemoryIdempotencyStore()
        self.store = MemoryCheckpointStore()
        self.history = MemoryHistoryStore()
        self.leases = MemoryLeaseStore()
        self.ledger = MemoryLedger()

    def runner(self, provider: Any) -> AgentRunner:
        return AgentRunner(
            provider,
            idempotency=self.idempotency,
            checkpoints=Checkpointer(self.store, history=self.history),
            leases=self.leases,
            ledger=self.ledger,
        )

    async def latest(self, run_id: str) -> Any:
        return await Checkpointer(self.store, history=self.history).latest("acme", run_id)


async def collect(stream: AsyncIterator[RunEvent], into: list[RunEvent]) -> None:
    async with aclosing(stream) as events:
        async for event in events:
            into.append(event)


def shape(events: list[RunEvent]) -> list[tuple[Any, ...]]:
    """The events this module's promises are about, as comparable tuples (the dispatch
    unit's started/finished events are checked for their place only)."""
    out: list[tuple[Any, ...]] = []
    for e in events:
        if isinstance(e, TextDelta):
            out.append(("text", e.iteration))
        elif isinstance(e, ToolCallAsked):
            out.append(("asked", e.iteration, e.name, dict(e.arguments)))
        elif isinstance(e, FrontierWritten):
            out.append(("frontier", e.step, e.boundary))
        elif isinstance(e, RunFinished):
            out.append(("finished", e.run.status))
    return out


def squeeze(items: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """Runs of text deltas of one iteration as one item."""
    out: list[tuple[Any, ...]] = []
    for item in items:
        if not (out and item[0] == "text" and out[-1] == item):
            out.append(item)
    return out


async def test_events_of_a_two_turn_booking_run_come_in_order(airline: Airline) -> None:
    world = World()
    events: list[RunEvent] = []
    await collect(
        world.runner(ScriptedProvider(TURNS)).stream(
            booking_agent(airline), "book LH123", tenant="acme", run_id="r1"
        ),
        events,
    )
    assert squeeze(shape(events)) == [
        ("text", 0),
        ("asked", 0, "book_seat", {"flight": "LH123"}),
        ("frontier", 1, Boundary.after_model_call),
        ("frontier", 2, Boundary.after_tool_result),
        ("text", 1),
        ("frontier", 3, Boundary.after_model_call),  # the final frontier
        ("finished", RunStatus.completed),
    ]
    deltas = [e.text for e in events if isinstance(e, TextDelta)]
    assert len(deltas) > 2  # streamed in pieces, not whole messages
    assert "".join(d for e in events if isinstance(e, TextDelta) for d in [e.text]) == (
        "Let me book LH123 for you.Booked LH123 from Frankfurt to New York."
    )
    # The dispatch unit's reports of the call, if any, come between its turn's frontiers.
    frontiers = [i for i, e in enumerate(events) if isinstance(e, FrontierWritten)]
    dispatch = [
        i for i, e in enumerate(events) if isinstance(e, ToolCallStarted | ToolCallFinished)
    ]
    assert all(frontiers[0] < i < frontiers[1] for i in dispatch)
    finished = events[-1]
    assert isinstance(finished, RunFinished)
    assert finished.run.output == "Booked LH123 from Frankfurt to New York."
    assert airline.bookings == ["LH123"]
    latest = await world.latest("r1")
    assert latest.step == 3 and latest.status.finished


async def test_run_and_resume_tell_on_event_what_stream_yields(airline: Airline) -> None:
    """``on_event`` on ``run``/``resume`` is told the events a stream would yield, in the
    same order, without ``RunFinished`` (the call returns the run)."""
    streamed: list[RunEvent] = []
    await collect(
        World()
        .runner(ScriptedProvider(TURNS))
        .stream(booking_agent(Airline()), "book LH123", tenant="acme", run_id="r1"),
        streamed,
    )
    world = World()
    told: list[RunEvent] = []
    run = await world.runner(ScriptedProvider(TURNS)).run(
        booking_agent(airline), "book LH123", tenant="acme", run_id="r1", on_event=told.append
    )
    assert run.status is RunStatus.completed
    assert squeeze(shape(told)) == squeeze(shape(streamed))[:-1]
    # A resume of a run that crashed after booking: told where it picked up, then on.
    world = World()
    with pytest.raises(SimulatedCrash):
        await collect(
            world.runner(DiesMidStream(1)).stream(
                booking_agent(airline), "book LH123", tenant="acme", run_id="r2"
            ),
            [],
        )
    told = []
    run = await world.runner(ScriptedProvider(TURNS)).resume(
        booking_agent(airline), "r2", tenant="acme", on_event=told.append
    )
    assert run.status is RunStatus.completed
    resumed = [e for e in told if isinstance(e, AttemptResumed)]
    assert [(e.step, e.boundary) for e in resumed] == [(2, Boundary.after_tool_result)]
    assert told[0] is resumed[0]
    assert ("frontier", 3, Boundary.after_model_call) in shape(told)
    assert airline.bookings == ["LH123", "LH123"]  # one per run, none sent again


async def test_a_provider_that_cannot_stream_tells_its_text_whole(airline: Airline) -> None:
    provider = Recording(ScriptedProvider(TURNS))  # complete() only
    events: list[RunEvent] = []
    await collect(
        World().runner(provider).stream(booking_agent(airline), "book", tenant="acme", run_id="r1"),
        events,
    )
    assert [e.text for e in events if isinstance(e, TextDelta)] == [
        "Let me book LH123 for you.",
        "Booked LH123 from Frankfurt to New York.",
    ]
    assert isinstance(events[-1], RunFinished)


class DiesMidStream:
    """The scripted model, streaming; at ``iteration`` the process dies after one piece."""

    def __init__(self, iteration: int) -> None:
        self.inner = ScriptedProvider(TURNS)
        self.iteration = iteration

    async def complete(self, request: ModelRequest) -> ModelResponse:
        return await self.inner.complete(request)

    async def complete_streaming(self, request: ModelRequest, on_text: TextSink) -> ModelResponse:
        if request.iteration != self.iteration:
            return await self.inner.complete_streaming(request, on_text)
        on_text("Booked ")
        await asyncio.sleep(0)
        raise SimulatedCrash("the process dies mid-stream")


async def test_run_error_is_raised_after_the_events_before_it(airline: Airline) -> None:
    world = World()
    agent = booking_agent(airline)
    events: list[RunEvent] = []
    with pytest.raises(SimulatedCrash):
        await collect(
            world.runner(DiesMidStream(1)).stream(agent, "book LH123", tenant="acme", run_id="r1"),
            events,
        )
    assert squeeze(shape(events)) == [
        ("text", 0),
        ("asked", 0, "book_seat", {"flight": "LH123"}),
        ("frontier", 1, Boundary.after_model_call),
        ("frontier", 2, Boundary.after_tool_result),
        ("text", 1),
    ]
    latest = await world.latest("r1")
    assert (latest.step, latest.boundary) == (2, Boundary.after_tool_result)  # nothing partial

    # A new "process" streams the resume: the model is asked again, nothing booked again.
    resumed: list[RunEvent] = []
    provider = ScriptedProvider(TURNS)
    await collect(world.runner(provider).stream_resume(agent, "r1", tenant="acme"), resumed)
    assert squeeze(shape(resumed)) == [
        ("text", 1),
        ("frontier", 3, Boundary.after_model_call),
        ("finished", RunStatus.completed),
    ]
    assert provider.calls == 1
    assert airline.bookings == ["LH123"]


async def test_leaving_the_stream_early_lets_go_of_the_run_at_once(airline: Airline) -> None:
    world = World()
    agent = booking_agent(airline)
    provider = ScriptedProvider(TURNS)
    seen: list[RunEvent] = []
    async with aclosing(
        world.runner(provider).stream(agent, "book LH123", tenant="acme", run_id="r1")
    ) as events:
        async for event in events:
            seen.append(event)
            if isinstance(event, TextDelta) and event.iteration == 1:
                break  # mid-stream of the second turn
    assert not any(isinstance(e, RunFinished) for e in seen)
    latest = await world.latest("r1")
    assert (latest.boundary, latest.step) == (Boundary.after_tool_result, 2)
    assert not latest.status.finished
    # The lease (ttl 30 s) was released: a resume takes the run straight away, asks the
    # model again for the turn that was streaming, and books nothing more.
    again = ScriptedProvider(TURNS)
    run = await world.runner(again).resume(agent, "r1", tenant="acme")
    assert run.status is RunStatus.completed
    assert again.calls == 1
    assert airline.bookings == ["LH123"]


async def test_leaving_a_streamed_resume_early_releases_its_claim(airline: Airline) -> None:
    world = World()
    agent = booking_agent(airline)
    crash = ScriptedProvider(TURNS)
    async with aclosing(
        world.runner(crash).stream(agent, "book", tenant="acme", run_id="r1")
    ) as events:
        async for event in events:
            if isinstance(event, FrontierWritten) and event.boundary is Boundary.after_tool_result:
                break
    async with aclosing(
        world.runner(ScriptedProvider(TURNS)).stream_resume(agent, "r1", tenant="acme")
    ) as events:
        async for event in events:
            if isinstance(event, TextDelta):
                break
    # Neither the resume claim (ttl 300 s) nor the lease is left behind.
    run = await world.runner(ScriptedProvider(TURNS)).resume(agent, "r1", tenant="acme")
    assert run.status is RunStatus.completed
    assert airline.bookings == ["LH123"]


async def test_a_run_being_streamed_is_held_until_its_consumer_leaves(
    airline: Airline,
) -> None:
    booking = threading.Event()
    airline.hook = lambda stage: None if stage == "after" else booking.wait(10)
    world = World()
    agent = booking_agent(airline)
    async with aclosing(
        world.runner(ScriptedProvider(TURNS)).stream(agent, "book", tenant="acme", run_id="r1")
    ) as events:
        async for event in events:
            if isinstance(event, FrontierWritten) and not booking.is_set():
                # The run waits inside book_seat: the stream's run holds the lease.
                with pytest.raises(ResumeConflictError):
                    await world.runner(ScriptedProvider(TURNS)).resume(agent, "r1", tenant="acme")
                booking.set()
            last = event
    assert isinstance(last, RunFinished)
    assert last.run.status is RunStatus.completed
    assert airline.bookings == ["LH123"]


def test_stream_to_terminal_example_runs() -> None:
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "stream_to_terminal.py")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Booked LH400" in done.stdout
    assert "frontier" in done.stdout
    assert done.stdout.strip().endswith("airline holds 1 booking(s)")


async def test_a_break_without_aclose_lets_go_of_the_run_once_collected(
    airline: Airline,
) -> None:
    world = World()
    agent = booking_agent(airline)
    async for event in world.runner(ScriptedProvider(TURNS)).stream(
        agent, "book", tenant="acme", run_id="r1"
    ):
        if isinstance(event, TextDelta) and event.iteration == 1:
            break
    # The event loop closes the dropped iterator, which cancels the run; until then the
    # lease (ttl 30 s) is held and a resume is refused.
    for _ in range(500):
        try:
            run = await world.runner(ScriptedProvider(TURNS)).resume(agent, "r1", tenant="acme")
        except ResumeConflictError:
            await asyncio.sleep(0.01)
        else:
            break
    else:
        pytest.fail("the dropped stream never let go of the run")
    assert run.status is RunStatus.completed
    assert airline.bookings == ["LH123"]


class StreamsFromAThread:
    """A provider over a blocking SDK: it reads the stream on a worker thread, telling
    each piece from there."""

    def __init__(self) -> None:
        self.inner = ScriptedProvider(TURNS)

    async def complete(self, request: ModelRequest) -> ModelResponse:
        return await self.inner.complete(request)

    async def complete_streaming(self, request: ModelRequest, on_text: TextSink) -> ModelResponse:
        response = await self.inner.complete(request)
        pieces = response.message.text.split(" ")
        await asyncio.to_thread(lambda: [on_text(p + " ") for p in pieces])
        return response


async def test_text_told_from_another_thread_reaches_the_stream_in_order(
    airline: Airline,
) -> None:
    # Debug mode makes the loop refuse a call from the wrong thread instead of racing it.
    asyncio.get_running_loop().set_debug(True)
    events: list[RunEvent] = []
    streamed = collect(
        World()
        .runner(StreamsFromAThread())
        .stream(booking_agent(airline), "book", tenant="acme", run_id="r1"),
        events,
    )
    await asyncio.wait_for(streamed, 60)  # a lost wake-up would hang here, not fail
    texts = [(e.iteration, e.text) for e in events if isinstance(e, TextDelta)]
    assert "".join(t for i, t in texts if i == 0) == "Let me book LH123 for you. "
    assert "".join(t for i, t in texts if i == 1) == "Booked LH123 from Frankfurt to New York. "
    assert squeeze(shape(events))[-1] == ("finished", RunStatus.completed)
