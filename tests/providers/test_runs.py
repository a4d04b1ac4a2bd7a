"""Whole runs through each vendor's real SDK, against the fake model server.

Every test here runs once per vendor (``vendor`` is parametrised): the SDK builds the
request, sends it over HTTP to 127.0.0.1, retries with its own policy, and parses the reply.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tesserix_adk import (
    AgentRunner,
    Checkpointer,
    CheckpointStatus,
    MemoryCheckpointStore,
    MemoryHistoryStore,
    MemoryIdempotencyStore,
    MemoryLedger,
    Message,
    ModelRequest,
    ProviderError,
    RunStatus,
)
from tesserix_adk.providers.pricing import Price
from tesserix_adk.testing.faults import FaultyCheckpointStore, SimulatedCrash
from tesserix_adk.testing.secrets import leaked_secrets, planted_secrets

from .booking import Airline, booking_agent
from .fake_server import MALFORMED, ModelServer, Reply
from .vendors import SDKProvider, Vendor

NewProvider = Callable[..., SDKProvider]

SEARCH = ("call_search_1", "search_flights", {"origin": "FRA", "dest": "JFK"})
BOOK = ("call_book_1", "book_seat", {"flight": "LH123"})


class World:
    """One tenant's stores, shared by every "process" (runner) of a test."""

    def __init__(self) -> None:
        self.idempotency = MemoryIdempotencyStore()
        self.store = FaultyCheckpointStore(MemoryCheckpointStore())
        self.history = MemoryHistoryStore()
        self.ledger = MemoryLedger()

    def runner(self, provider: SDKProvider) -> AgentRunner:
        """A fresh runner, as a new process would build it."""
        return AgentRunner(
            provider,
            idempotency=self.idempotency,
            checkpoints=Checkpointer(self.store, history=self.history),
            ledger=self.ledger,
        )

    async def latest_status(self, run_id: str) -> CheckpointStatus | None:
        checkpoint = await Checkpointer(self.store, history=self.history).latest("acme", run_id)
        return None if checkpoint is None else checkpoint.status


def at(boundary: str, iteration: int) -> Any:
    """A payload test: the frontier written at ``boundary`` of ``iteration``."""
    return lambda body: body.get("boundary") == boundary and body.get("iteration") == iteration


def book_turns(vendor: Vendor) -> list[dict[str, Any]]:
    """Search, book, answer: the booking conversation as the vendor would send it."""
    return [
        vendor.turn(calls=[SEARCH]),
        vendor.turn(calls=[BOOK]),
        vendor.turn("Booked LH123 from Frankfurt to New York."),
    ]


# --- a run, a kill, a resume ------------------------------------------------------------------


async def test_run_killed_after_booking_resumes_and_books_once(
    vendor: Vendor, model_server: ModelServer, new_provider: NewProvider, airline: Airline
) -> None:
    model_server.queue(*book_turns(vendor))
    world = World()
    # The process dies after book_seat completed, before its after_tool_result frontier.
    world.store.crash_before = at("after_tool_result", 1)
    with pytest.raises(SimulatedCrash):
        await world.runner(new_provider()).run(
            booking_agent(airline), "book LH123", tenant="acme", run_id="r1"
        )
    assert airline.bookings == ["LH123"]
    assert len(model_server.requests) == 2

    world.store.crash_before = None
    run = await world.runner(new_provider()).resume(booking_agent(airline), "r1", tenant="acme")

    assert run.status is RunStatus.completed
    assert run.output == "Booked LH123 from Frankfurt to New York."
    assert airline.bookings == ["LH123"]  # the side-effecting tool ran once
    assert len(model_server.requests) == 3 and model_server.pending == 0
    assert all(r.path == vendor.path for r in model_server.requests)
    # The resumed call carries the recorded booking back to the model.
    content, is_error = vendor.tool_results(model_server.bodies[-1])["call_book_1"]
    assert json.loads(content) == {"booking": "B1", "flight": "LH123"} and not is_error


async def test_run_killed_before_dispatch_resumes_and_books_once(
    vendor: Vendor, model_server: ModelServer, new_provider: NewProvider, airline: Airline
) -> None:
    model_server.queue(*book_turns(vendor))
    world = World()
    # Dies right after the model asked to book: nothing dispatched yet.
    world.store.crash_after = at("after_model_call", 1)
    with pytest.raises(SimulatedCrash):
        await world.runner(new_provider()).run(
            booking_agent(airline), "book LH123", tenant="acme", run_id="r1"
        )
    assert airline.bookings == []

    world.store.crash_after = None
    run = await world.runner(new_provider()).resume(booking_agent(airline), "r1", tenant="acme")

    assert run.status is RunStatus.completed
    assert airline.bookings == ["LH123"]
    assert len(model_server.requests) == 3  # the model was not asked again for turn 2


# --- transient and permanent failures -----------------------------------------------------------


async def test_rate_limit_then_success_is_one_logical_call(
    vendor: Vendor, model_server: ModelServer, new_provider: NewProvider, airline: Airline
) -> None:
    price = Price(input_per_million_micros=1_000_000, output_per_million_micros=1_000_000)
    model_server.queue(vendor.error(429, "Rate limit reached"), vendor.turn("Hello."))
    world = World()
    run = await world.runner(new_provider(prices=price)).run(
        booking_agent(airline), "hi", tenant="acme", run_id="r1"
    )

    assert run.status is RunStatus.completed and run.output == "Hello."
    assert len(model_server.requests) == 2  # the SDK retried, by itself
    assert model_server.bodies[0] == model_server.bodies[1]
    assert await world.ledger.spent("acme", "r1") == 150  # charged once: 120 + 30 tokens


async def test_bad_request_is_not_retryable(
    vendor: Vendor, model_server: ModelServer, new_provider: NewProvider
) -> None:
    model_server.queue(vendor.error(400, "messages: field required"))
    with pytest.raises(ProviderError) as err:
        await new_provider().complete(_request("hi"))
    assert err.value.retryable is False
    assert err.value.status_code == 400
    assert isinstance(err.value.__cause__, Exception)  # translated once, with its cause
    assert len(model_server.requests) == 1  # never retried


async def test_bad_request_ends_the_run_failed(
    vendor: Vendor, model_server: ModelServer, new_provider: NewProvider, airline: Airline
) -> None:
    model_server.queue(vendor.turn(calls=[SEARCH]), vendor.error(400, "bad request"))
    world = World()
    run = await world.runner(new_provider()).run(
        booking_agent(airline), "book", tenant="acme", run_id="r1"
    )
    assert run.status is RunStatus.failed
    assert await world.latest_status("r1") == CheckpointStatus.failed


async def test_server_error_after_retries_propagates_and_the_run_resumes(
    vendor: Vendor, model_server: ModelServer, new_provider: NewProvider, airline: Airline
) -> None:
    model_server.queue(
        vendor.turn(calls=[SEARCH]), vendor.error(500, "boom"), vendor.error(500, "boom")
    )
    world = World()
    with pytest.raises(ProviderError) as err:
        await world.runner(new_provider(max_retries=1)).run(
            booking_agent(airline), "book", tenant="acme", run_id="r1"
        )
    assert err.value.retryable is True
    assert err.value.status_code == 500
    assert len(model_server.requests) == 3  # one call, one SDK retry of the second
    assert airline.searches == 1

    model_server.queue(vendor.turn("LH123 and UA456 fly FRA to JFK."))
    run = await world.runner(new_provider()).resume(booking_agent(airline), "r1", tenant="acme")
    assert run.status is RunStatus.completed
    assert airline.searches == 1  # the finished search was not run again


@pytest.mark.parametrize(
    "reply",
    [
        MALFORMED,
        Reply(body={"object": "chat.completion", "type": "message"}),  # fields missing
        Reply(body="<html>502 Bad Gateway</html>", content_type="text/html"),
    ],
    ids=["truncated-json", "missing-fields", "not-json"],
)
async def test_malformed_body_is_retryable(
    vendor: Vendor, model_server: ModelServer, new_provider: NewProvider, reply: Reply
) -> None:
    model_server.queue(reply)
    with pytest.raises(ProviderError) as err:
        await new_provider().complete(_request("hi"))
    assert err.value.retryable is True
    assert err.value.__cause__ is not None
    assert len(model_server.requests) == 1  # the SDK does not retry a body it got


async def test_connection_refused_is_retryable(
    vendor: Vendor, model_server: ModelServer, new_provider: NewProvider
) -> None:
    with socket.socket() as s:  # a port nobody listens on once this closes
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = f"http://127.0.0.1:{port}" + ("/v1" if vendor.name == "openai" else "")
    with pytest.raises(ProviderError) as err:
        await new_provider(base_url=base, max_retries=0).complete(_request("hi"))
    assert err.value.retryable is True and err.value.status_code is None


async def test_timeout_is_retryable(
    vendor: Vendor, model_server: ModelServer, new_provider: NewProvider
) -> None:
    model_server.queue(Reply(body=vendor.turn("late"), delay=1.0))
    with pytest.raises(ProviderError) as err:
        await new_provider(timeout=0.2, max_retries=0).complete(_request("hi"))
    assert err.value.retryable is True
    assert "timed out" in str(err.value)


# --- cost -----------------------------------------------------------------------------------


async def test_cost_in_micros_is_charged_to_the_ledger(
    vendor: Vendor, model_server: ModelServer, new_provider: NewProvider, airline: Airline
) -> None:
    # $2.50 in, $10.00 out per million tokens; each turn reads 120 and writes 30 tokens.
    prices = {
        vendor.wire_model: Price(
            input_per_million_micros=2_500_000, output_per_million_micros=10_000_000
        )
    }
    model_server.queue(*book_turns(vendor))
    world = World()
    run = await world.runner(new_provider(prices=prices)).run(
        booking_agent(airline), "book LH123", tenant="acme", run_id="r1"
    )
    per_call = 120 * 2_500_000 // 1_000_000 + 30 * 10_000_000 // 1_000_000  # 300 + 300
    assert run.status is RunStatus.completed
    assert run.spent_micros == 3 * per_call
    assert await world.ledger.spent("acme", "r1") == 3 * per_call
    assert run.usage.input_tokens == 360 and run.usage.output_tokens == 90


async def test_no_price_costs_nothing(
    vendor: Vendor, model_server: ModelServer, new_provider: NewProvider
) -> None:
    model_server.queue(vendor.turn("Hello."))
    response = await new_provider(
        prices={"some-other-model": Price(input_per_million_micros=1, output_per_million_micros=1)}
    ).complete(_request("hi"))
    assert response.cost_micros == 0
    assert (response.usage.input_tokens, response.usage.output_tokens) == (120, 30)


# --- secrets --------------------------------------------------------------------------------


async def test_api_key_never_reaches_a_store(
    vendor: Vendor, model_server: ModelServer, new_provider: NewProvider, airline: Airline
) -> None:
    key = planted_secrets()["openai_key" if vendor.name == "openai" else "anthropic_key"]
    # A full run, then a second run that fails on a 401 whose message echoes the key (some
    # servers do), so the key is offered to the failure reason the frontier keeps.
    model_server.queue(
        *book_turns(vendor),
        vendor.error(401, f"Incorrect API key provided: {key}"),
    )
    world = World()
    runner = world.runner(new_provider(api_key=key))
    done = await runner.run(booking_agent(airline), "book LH123", tenant="acme", run_id="r1")
    failed = await runner.run(booking_agent(airline), "book", tenant="acme", run_id="r2")

    assert (done.status, failed.status) == (RunStatus.completed, RunStatus.failed)
    assert key in vendor.key_headers(model_server.requests[0].headers)  # it was sent...
    held = b"".join(_every_byte([world.store, world.history, world.idempotency, world.ledger]))
    assert b"Booked LH123 from Frankfurt" in held  # ...the scan reaches the transcript...
    assert leaked_secrets(key) != []  # the detector knows this key...
    assert leaked_secrets(held) == []  # ...and no store holds it
    assert key not in repr(runner.provider)


def _every_byte(value: Any, seen: set[int] | None = None) -> Iterator[bytes]:
    """Every str and bytes reachable from ``value``: what a store holds, whatever its shape."""
    seen = set() if seen is None else seen
    if id(value) in seen:
        return
    seen.add(id(value))
    if isinstance(value, bytes | bytearray | memoryview):
        yield bytes(value)
    elif isinstance(value, str):
        yield value.encode("utf-8")
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _every_byte(k, seen)
            yield from _every_byte(v, seen)
    elif isinstance(value, list | tuple | set | frozenset):
        for item in value:
            yield from _every_byte(item, seen)
    elif hasattr(value, "__dict__") or hasattr(type(value), "__slots__"):
        fields = dict(getattr(value, "__dict__", {}))
        for name in getattr(type(value), "__slots__", ()):
            if hasattr(value, name):
                fields[name] = getattr(value, name)
        yield from _every_byte(fields, seen)


def _request(text: str) -> ModelRequest:
    return ModelRequest(
        agent_name="probe", instructions="Answer briefly.", messages=(Message.user(text),)
    )
