"""Streamed model calls through each vendor's real SDK, against the fake server's SSE.

Each test runs once per vendor: the SDK sends ``stream=True``, reads server-sent events
over HTTP from 127.0.0.1, and the provider assembles the whole message before the run
writes anything. A stream cut short is a retryable error that leaves the last boundary
frontier; the resume asks the model again.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import aclosing

import pytest

from tesserix_adk import (
    AgentRunner,
    Checkpointer,
    MemoryCheckpointStore,
    MemoryHistoryStore,
    MemoryIdempotencyStore,
    MemoryLedger,
    Message,
    ModelRequest,
    ProviderError,
    RunStatus,
)
from tesserix_adk.checkpoint.payload import Boundary
from tesserix_adk.providers.base import StreamingProvider
from tesserix_adk.providers.pricing import Price
from tesserix_adk.run.events import FrontierWritten, RunEvent, RunFinished, TextDelta

from .booking import Airline, booking_agent
from .fake_server import ModelServer, Reply
from .vendors import SDKProvider, Vendor

NewProvider = Callable[..., SDKProvider]

SEARCH = ("call_search_1", "search_flights", {"origin": "FRA", "dest": "JFK"})
BOOK = ("call_book_1", "book_seat", {"flight": "LH123"})
ANSWER = "Booked LH123 from Frankfurt to New York."


class World:
    """One tenant's stores, shared by every "process" (runner) of a test."""

    def __init__(self) -> None:
        self.idempotency = MemoryIdempotencyStore()
        self.store = MemoryCheckpointStore()
        self.history = MemoryHistoryStore()
        self.ledger = MemoryLedger()
        self.checkpoints = Checkpointer(self.store, history=self.history)

    def runner(self, provider: SDKProvider) -> AgentRunner:
        return AgentRunner(
            provider,
            idempotency=self.idempotency,
            checkpoints=Checkpointer(self.store, history=self.history),
            ledger=self.ledger,
        )


def _request() -> ModelRequest:
    return ModelRequest(
        agent_name="booking",
        instructions="Book the flight the user asks for.",
        messages=(Message.user("book me FRA to JFK"),),
    )


async def _events(stream: object) -> list[RunEvent]:
    out: list[RunEvent] = []
    async with aclosing(stream) as events:  # type: ignore[type-var]
        async for event in events:
            out.append(event)
    return out


async def test_streamed_reply_is_assembled_whole(
    vendor: Vendor, model_server: ModelServer, new_provider: NewProvider
) -> None:
    model_server.queue(vendor.streamed("Let me book that.", [SEARCH, BOOK], usage=(200, 40)))
    provider = new_provider()
    assert isinstance(provider, StreamingProvider)
    heard: list[str] = []
    response = await provider.complete_streaming(_request(), heard.append)
    assert len(heard) > 1  # told in pieces, as they came
    assert "".join(heard) == response.message.text == "Let me book that."
    calls = [(c.id, c.name, dict(c.arguments)) for c in response.message.tool_calls]
    assert calls == [SEARCH, BOOK]
    assert (response.usage.input_tokens, response.usage.output_tokens) == (200, 40)
    body = model_server.bodies[0]
    assert body["stream"] is True
    if vendor.name == "openai":
        assert body["stream_options"] == {"include_usage": True}


async def test_usage_and_cost_from_the_last_event_reach_the_ledger(
    vendor: Vendor, model_server: ModelServer, new_provider: NewProvider, airline: Airline
) -> None:
    model_server.queue(
        vendor.streamed(calls=[BOOK], usage=(1000, 100)),
        vendor.streamed(ANSWER, usage=(2000, 200)),
    )
    price = Price(input_per_million_micros=1_000_000, output_per_million_micros=10_000_000)
    world = World()
    provider = new_provider(prices={vendor.wire_model: price})
    events = await _events(
        world.runner(provider).stream(
            booking_agent(airline), "book LH123", tenant="acme", run_id="r1"
        )
    )
    finished = events[-1]
    assert isinstance(finished, RunFinished)
    assert finished.run.status is RunStatus.completed
    # 3000 input tokens at $1/Mtok and 300 output tokens at $10/Mtok, in micros.
    expected = 3000 * 1 + 300 * 10
    assert await world.ledger.spent("acme", "r1") == expected
    assert finished.run.usage.input_tokens == 3000
    assert finished.run.usage.output_tokens == 300
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == ANSWER


@pytest.mark.parametrize("cut", ["connection dropped", "stream ended early"])
async def test_stream_cut_mid_call_saves_nothing_and_resume_asks_again(
    cut: str,
    vendor: Vendor,
    model_server: ModelServer,
    new_provider: NewProvider,
    airline: Airline,
) -> None:
    booked = vendor.streamed(calls=[BOOK])
    # Cut inside the booking call's arguments: the SDK has read part of the call.
    frames = len(booked.events) - 4
    broken = (
        vendor.streamed(calls=[BOOK], cut_after=frames)
        if cut == "connection dropped"
        else Reply(events=booked.events[:frames])
    )
    model_server.queue(vendor.streamed(calls=[SEARCH]), broken)
    world = World()
    agent = booking_agent(airline)
    seen: list[RunEvent] = []
    with pytest.raises(ProviderError) as raised:
        async with aclosing(
            world.runner(new_provider()).stream(agent, "book LH123", tenant="acme", run_id="r1")
        ) as events:
            async for event in events:
                seen.append(event)
    assert raised.value.retryable
    assert airline.bookings == []
    assert len(model_server.requests) == 2  # a broken stream is not retried by the SDK
    latest = await world.checkpoints.latest("acme", "r1")
    assert latest is not None
    assert (latest.boundary, latest.iteration) == (Boundary.after_tool_result, 0)
    saved = await world.checkpoints.messages(latest)
    assert not any(c.name == "book_seat" for m in saved for c in m.tool_calls)
    written = [e for e in seen if isinstance(e, FrontierWritten)]
    assert written[-1].step == latest.step

    model_server.queue(vendor.streamed(calls=[BOOK]), vendor.streamed(ANSWER))
    events = await _events(world.runner(new_provider()).stream_resume(agent, "r1", tenant="acme"))
    finished = events[-1]
    assert isinstance(finished, RunFinished)
    assert finished.run.status is RunStatus.completed
    assert finished.run.output == ANSWER
    assert airline.bookings == ["LH123"]
    assert len(model_server.requests) == 4  # the cut turn was asked again
    assert model_server.bodies[3]["messages"][-1] != model_server.bodies[1]["messages"][-1]


async def test_an_error_event_mid_stream_is_retryable_and_resume_asks_again(
    vendor: Vendor, model_server: ModelServer, new_provider: NewProvider, airline: Airline
) -> None:
    model_server.queue(vendor.streamed(calls=[BOOK]), vendor.broken_off(ANSWER))
    world = World()
    agent = booking_agent(airline)
    with pytest.raises(ProviderError) as raised:
        await _events(
            world.runner(new_provider()).stream(agent, "book LH123", tenant="acme", run_id="r1")
        )
    assert raised.value.retryable  # not a rejected request: the run is not failed
    latest = await world.checkpoints.latest("acme", "r1")
    assert latest is not None and not latest.status.finished
    model_server.queue(vendor.streamed(ANSWER))
    events = await _events(world.runner(new_provider()).stream_resume(agent, "r1", tenant="acme"))
    finished = events[-1]
    assert isinstance(finished, RunFinished)
    assert finished.run.output == ANSWER
    assert airline.bookings == ["LH123"]


async def test_a_run_without_a_stream_still_uses_the_plain_endpoint(
    vendor: Vendor, model_server: ModelServer, new_provider: NewProvider, airline: Airline
) -> None:
    model_server.queue(vendor.turn(calls=[BOOK]), vendor.turn(ANSWER))
    world = World()
    run = await world.runner(new_provider()).run(
        booking_agent(airline), "book LH123", tenant="acme", run_id="r1"
    )
    assert run.status is RunStatus.completed
    assert all("stream" not in body for body in model_server.bodies)
