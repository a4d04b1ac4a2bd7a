"""Spans of runs (GenAI semantic conventions), through the SDK's in-memory exporter: the
tree of a booking run, a resume that replays instead of executing again, calls settled by
a person or a reconciler, ids that derive from the run, parallel calls, no secrets."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import Any, cast

import pytest
from opentelemetry.trace import StatusCode

from booking import Airline, booking_agent
from otel_spans.world import Pipeline, World, attrs, every_value
from run.helpers import at
from tesserix_adk import (
    Agent,
    IndeterminateToolCallError,
    LeaseLostError,
    LeasePolicy,
    MemoryIdempotencyStore,
    ProviderError,
    Reconciled,
    Redactor,
    RunStatus,
    ToolOutcome,
    tool,
)
from tesserix_adk.checkpoint.payload import encode_outcome
from tesserix_adk.run.events import ModelCallFinished, RunFinished, ToolCallFinished
from tesserix_adk.telemetry import span_id_of, trace_id_of
from tesserix_adk.testing.faults import SimulatedCrash

T = "acme"


def _crash_at(airline: Airline, stage: str) -> None:
    def hook(at: str) -> None:
        if at == stage:
            airline.hook = None
            raise SimulatedCrash(f"died {stage} booking")

    airline.hook = hook


async def test_a_two_turn_booking_run_makes_one_agent_span_with_its_model_and_tool_calls(
    airline: Airline,
) -> None:
    otel = Pipeline()
    agent = booking_agent(airline, model="gpt-test")
    run = await World().runner(otel).run(agent, "book", tenant=T, run_id="r1")
    assert run.status is RunStatus.completed

    (root,) = otel.named("invoke_agent")
    assert root.name == "invoke_agent booking"
    assert root.parent is None
    assert attrs(root)["gen_ai.operation.name"] == "invoke_agent"
    assert attrs(root)["gen_ai.agent.name"] == "booking"
    assert attrs(root)["tesserix.run.status"] == "completed"
    assert attrs(root)["tesserix.attempt.kind"] == "run"
    assert attrs(root)["tesserix.attempt"] == 1  # the fence of the run's first lease
    chats = sorted(otel.named("chat"), key=lambda s: s.start_time or 0)
    assert [s.name for s in chats] == ["chat gpt-test"] * 3
    assert [attrs(s)["gen_ai.response.finish_reasons"] for s in chats] == [
        ("tool_calls",),
        ("tool_calls",),
        ("stop",),
    ]
    for chat in chats:
        assert attrs(chat)["gen_ai.request.model"] == "gpt-test"
        assert attrs(chat)["gen_ai.usage.input_tokens"] == 100
        assert attrs(chat)["gen_ai.usage.output_tokens"] == 20
    tools = sorted(otel.named("execute_tool"), key=lambda s: s.start_time or 0)
    assert [s.name for s in tools] == ["execute_tool search_flights", "execute_tool book_seat"]
    assert [attrs(s)["gen_ai.tool.call.id"] for s in tools] == ["call_0_0", "call_1_0"]
    assert [attrs(s)["tesserix.tool.disposition"] for s in tools] == ["dispatched"] * 2
    for child in [*chats, *tools]:
        assert child.parent is not None and child.parent.span_id == root.context.span_id
        assert child.context.trace_id == root.context.trace_id == trace_id_of(T, "r1")
    # Each model turn comes before the calls it asked for.
    assert (chats[0].end_time or 0) <= (tools[0].start_time or 0)
    assert (tools[0].end_time or 0) <= (chats[1].start_time or 0)


async def test_a_call_a_person_resolved_is_reported_resolved_and_the_resume_links_back(
    airline: Airline,
) -> None:
    otel, world = Pipeline(), World()
    agent = booking_agent(airline)
    _crash_at(airline, "after")  # book_seat ran; its outcome is not recorded yet
    with pytest.raises(SimulatedCrash):
        await world.runner(otel).run(agent, "book", tenant=T, run_id="r1")
    first = otel.spans()
    (first_root,) = [s for s in first if s.name.startswith("invoke_agent")]
    assert attrs(first_root)["error.type"] == "SimulatedCrash"
    (sent,) = [s for s in first if s.name == "execute_tool book_seat"]
    assert attrs(sent)["tesserix.tool.disposition"] == "dispatched"
    otel.exporter.clear()

    # The crash left book_seat in flight: it is in doubt until a person says it ran.
    with pytest.raises(IndeterminateToolCallError) as err:
        await world.runner(otel).resume(agent, "r1", tenant=T)
    otel.exporter.clear()
    (doubt,) = err.value.calls
    assert doubt.key is not None
    outcome = ToolOutcome(call_id=doubt.call_id or "", content={"booking": "B1"})
    await world.idempotency.resolve(
        doubt.key, encode_outcome(outcome, Redactor()), tenant=T, by="alice"
    )
    run = await world.runner(otel).resume(agent, "r1", tenant=T)
    assert run.status is RunStatus.completed
    assert airline.bookings == ["LH123"]

    (root,) = otel.named("invoke_agent")
    assert attrs(root)["tesserix.attempt.kind"] == "resume"
    assert attrs(root)["tesserix.attempt"] == 3
    (book,) = otel.named("execute_tool book_seat")
    assert attrs(book)["tesserix.tool.disposition"] == "resolved"
    # Linked to the attempt that wrote the frontier it continues (the first, fence 1; the
    # second wrote nothing).
    (link,) = root.links
    assert link.context.span_id == first_root.context.span_id
    assert link.context.trace_id == first_root.context.trace_id
    assert dict(link.attributes or {}) == {"tesserix.link": "continues"}


async def test_a_completed_call_resumed_past_is_replayed_never_a_new_execution(
    airline: Airline,
) -> None:
    otel, world = Pipeline(), World()
    agent = booking_agent(airline)
    # book_seat completed and was recorded; the frontier after it was never written.
    world.store.crash_before = at("after_tool_result", 1)
    with pytest.raises(SimulatedCrash):
        await world.runner(otel).run(agent, "book", tenant=T, run_id="r1")
    world.store.crash_before = None
    (first_root,) = otel.named("invoke_agent")
    otel.exporter.clear()

    run = await world.runner(otel).resume(agent, "r1", tenant=T)
    assert run.status is RunStatus.completed
    assert airline.bookings == ["LH123"]
    (root,) = otel.named("invoke_agent")
    (book,) = otel.named("execute_tool book_seat")
    assert attrs(book)["tesserix.tool.disposition"] == "replayed"
    assert book.parent is not None and book.parent.span_id == root.context.span_id
    assert [link.context.span_id for link in root.links] == [first_root.context.span_id]
    assert attrs(root)["tesserix.resumed.step"] >= 1


async def test_a_call_its_reconciler_settled_is_reported_reconciled(airline: Airline) -> None:
    def found(call: Any, ctx: Any) -> Reconciled:
        return Reconciled.completed({"booking": "found"})

    otel, world = Pipeline(), World()
    agent = booking_agent(airline)
    book = agent.tools["book_seat"]
    agent = Agent(
        "booking",
        "Book.",
        [agent.tools["search_flights"], tool(reconcile=found)(book.fn)],
    )
    _crash_at(airline, "after")
    with pytest.raises(SimulatedCrash):
        await world.runner(otel).run(agent, "book", tenant=T, run_id="r1")
    otel.exporter.clear()
    run = await world.runner(otel, never_ran_margin=0.01).resume(agent, "r1", tenant=T)
    assert run.status is RunStatus.completed
    (span,) = otel.named("execute_tool book_seat")
    assert attrs(span)["tesserix.tool.disposition"] == "reconciled"
    assert airline.bookings == ["LH123"]


async def test_ids_derive_from_the_run_so_the_same_attempt_reported_twice_names_the_same_spans(
    airline: Airline,
) -> None:
    def ids(otel: Pipeline) -> list[tuple[str, int, int, int | None]]:
        return sorted(
            (
                s.name,
                s.context.trace_id,
                s.context.span_id,
                None if s.parent is None else s.parent.span_id,
            )
            for s in otel.spans()
        )

    first, again = Pipeline(), Pipeline()
    for otel in (first, again):  # the same attempt, carried and exported twice
        await World().runner(otel).run(booking_agent(Airline()), "b", tenant=T, run_id="r1")
    assert ids(first) == ids(again)
    assert len({span_id for _, _, span_id, _ in ids(first)}) == len(first.spans()) == 6
    (root,) = first.named("invoke_agent")
    assert root.context.span_id == span_id_of(T, "r1", "attempt", 1)

    other = Pipeline()
    await World().runner(other).run(booking_agent(Airline()), "b", tenant=T, run_id="r2")
    assert not {i[2] for i in ids(other)} & {i[2] for i in ids(first)}
    assert {i[1] for i in ids(other)} == {trace_id_of(T, "r2")}


async def test_without_deterministic_ids_the_tree_is_the_same(airline: Airline) -> None:
    otel = Pipeline(deterministic=False)
    await World().runner(otel).run(booking_agent(airline), "b", tenant=T, run_id="r1")
    (root,) = otel.named("invoke_agent")
    children = [s for s in otel.spans() if s is not root]
    assert len(children) == 5
    assert all(c.parent is not None and c.parent.span_id == root.context.span_id for c in children)


SECRET = "sk-live-4eC39HqLyjWDarjtT1zdp7dc"
SECRET_TURNS: list[Any] = [
    [("book_seat", {"flight": "LH123", "note": f"card via {SECRET}"})],
    "Booked.",
]


@pytest.mark.parametrize("capture", [False, True], ids=["content-off", "content-on"])
async def test_no_attribute_holds_an_idempotency_key_or_a_secret_from_the_arguments(
    capture: bool,
) -> None:
    @tool
    def book_seat(flight: str, note: str) -> dict[str, str]:
        """Book a seat; the airline's answer carries a token of its own."""
        return {"booking": "B1", "flight": flight, "receipt": f"token {SECRET}"}

    otel, world = Pipeline(capture_content=capture), World()
    agent = Agent("booking", "Book.", [book_seat])
    run = await world.runner(otel, SECRET_TURNS).run(agent, "book", tenant=T, run_id="r1")
    assert run.status is RunStatus.completed
    keys = [r.key for r in await world.idempotency.records(T, "r1")]
    assert keys
    values = every_value(otel.spans())
    for value in values:
        assert SECRET not in value
        assert "4eC39HqLyjWDarjtT1zdp7dc" not in value
        for key in keys:
            assert key not in value
    (span,) = otel.named("execute_tool book_seat")
    shown = attrs(span).get("gen_ai.tool.call.arguments")
    result = attrs(span).get("gen_ai.tool.call.result")
    if capture:
        assert json.loads(shown)["flight"] == "LH123"
        assert "[redacted:" in json.loads(shown)["note"]
        assert json.loads(result)["booking"] == "B1"
        assert "[redacted:" in json.loads(result)["receipt"]
    else:
        assert shown is None and result is None


async def test_parallel_calls_are_sibling_tool_spans() -> None:
    @tool
    def lookup(city: str) -> str:
        """Look a city up."""
        return city.upper()

    turns: list[Any] = [[("lookup", {"city": "a"}), ("lookup", {"city": "b"})], "done"]
    otel = Pipeline()
    agent = Agent("scout", "Look.", [lookup], parallel_tool_calls=2)
    await World().runner(otel, turns).run(agent, "go", tenant=T, run_id="r1")
    (root,) = otel.named("invoke_agent")
    calls = otel.named("execute_tool lookup")
    assert sorted(attrs(s)["gen_ai.tool.call.id"] for s in calls) == ["call_0_0", "call_0_1"]
    assert {s.parent.span_id for s in calls if s.parent is not None} == {root.context.span_id}
    assert len({s.context.span_id for s in calls}) == 2


async def test_a_streamed_run_reports_to_its_stream_and_its_spans(airline: Airline) -> None:
    otel = Pipeline()
    events = [
        e
        async for e in World()
        .runner(otel)
        .stream(booking_agent(airline), "book", tenant=T, run_id="r1")
    ]
    assert isinstance(events[-1], RunFinished)
    assert [e.finish_reason for e in events if isinstance(e, ModelCallFinished)] == [
        "tool_calls",
        "tool_calls",
        "stop",
    ]
    assert len([e for e in events if isinstance(e, ToolCallFinished)]) == 2
    (root,) = otel.named("invoke_agent")
    assert attrs(root)["tesserix.attempt.streamed"] is True
    assert len(otel.named("execute_tool")) == 2


async def test_a_model_error_ends_its_chat_span_with_the_error(airline: Airline) -> None:
    class Down:
        async def complete(self, request: Any) -> Any:
            raise ProviderError("the model is down", retryable=True)

    otel, world = Pipeline(), World()
    runner = world.runner(otel)
    runner.provider = Down()
    with pytest.raises(ProviderError):
        await runner.run(booking_agent(airline), "book", tenant=T, run_id="r1")
    (chat,) = otel.named("chat")
    assert attrs(chat)["error.type"] == "ProviderError"
    assert chat.status.status_code is StatusCode.ERROR
    (root,) = otel.named("invoke_agent")
    assert root.status.status_code is StatusCode.ERROR


def test_importing_the_kit_loads_no_opentelemetry() -> None:
    code = (
        "import sys, tesserix_adk, tesserix_adk.worker, tesserix_adk.run.runner\n"
        "print([m for m in sys.modules if m.startswith('opentelemetry')])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip() == "[]"


async def test_a_call_to_an_unknown_tool_is_refused_never_an_execution(airline: Airline) -> None:
    turns: list[Any] = [[("teleport", {"to": "JFK"})], "cannot"]
    otel = Pipeline()
    run = await World().runner(otel, turns).run(booking_agent(airline), "go", tenant=T, run_id="r")
    assert run.status is RunStatus.completed
    (span,) = otel.named("execute_tool teleport")
    assert attrs(span)["tesserix.tool.disposition"] == "refused"
    assert span.status.status_code is StatusCode.ERROR


class _Broken:
    """An observer that fails at everything it is asked."""

    def watch(self, watched: Any) -> Any:
        return self

    def event(self, event: Any) -> None:
        raise RuntimeError("the collector is down")

    def end(self, run: Any, error: Any) -> None:
        raise RuntimeError("the collector is down")


async def test_a_failing_observer_never_fails_the_run(airline: Airline) -> None:
    world = World()
    runner = world.runner(Pipeline())
    runner.telemetry = _Broken()
    run = await runner.run(booking_agent(airline), "book", tenant=T, run_id="r1")
    assert run.status is RunStatus.completed
    assert airline.bookings == ["LH123"]


async def test_a_call_its_lease_stopped_before_sending_is_not_an_execution(
    airline: Airline,
) -> None:
    inner = MemoryIdempotencyStore()

    class SlowClaims:
        """The memory store, whose claim of book_seat holds the loop past the lease ttl
        (as a stalled process would), so the lease lapses between claim and send."""

        def __getattr__(self, name: str) -> Any:
            return getattr(inner, name)

        async def claim(self, key: str, **kwargs: Any) -> Any:
            record = await inner.claim(key, **kwargs)
            if kwargs.get("tool") == "book_seat":
                time.sleep(0.35)  # noqa: ASYNC251  (blocking is the fault)
            return record

    otel, world = Pipeline(), World()
    runner = world.runner(otel, lease_policy=LeasePolicy(ttl=0.3, renew_within=0.1))
    runner.idempotency = cast(Any, SlowClaims())
    with pytest.raises(LeaseLostError):
        await runner.run(booking_agent(airline), "book", tenant=T, run_id="r1")
    assert airline.bookings == []
    (span,) = otel.named("execute_tool book_seat")
    assert attrs(span)["tesserix.tool.disposition"] == "refused"
    assert attrs(span)["error.type"] == "LeaseLostError"


async def test_a_run_whose_id_the_runner_picks_is_traced_under_that_id(airline: Airline) -> None:
    otel = Pipeline()
    run = await World().runner(otel).run(booking_agent(airline), "book", tenant=T)
    (root,) = otel.named("invoke_agent")
    assert attrs(root)["tesserix.run.id"] == run.run_id
    assert {s.context.trace_id for s in otel.spans()} == {trace_id_of(T, run.run_id)}
