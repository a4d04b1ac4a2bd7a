"""A third attacker's pass over telemetry (README "Spans and metrics"), where the earlier
passes did not go: a worker whose meter fails, a parallel turn that dies half-done and is
resumed, ``stream_resume`` of a crashed run, a cancel acknowledged while the model thinks, a
span processor that cannot start spans, tool errors holding secrets that end up in doubt,
and huge model-chosen tool names. Real OpenTelemetry SDK (in-memory exporter and reader),
memory stores; no mock of the kit.

Found, and fixed (``Telemetry.parked``/``took_over`` log a failing meter instead of raising;
``AttemptSpans._said`` masks a bounded head of a tool's name or call id and cuts it):

1. MEDIUM ``test_a_worker_whose_takeover_counter_fails_still_reports_the_run_finished``:
   ``Worker._take`` counts the takeover (``Telemetry.took_over``, unguarded) in a
   ``finally`` after the resume: a meter that raises replaces the run's result, so a run
   the worker carried to completion is treated as failed ("retry", an attempt counted,
   backoff) (``worker.py`` ``_take``/``_took_over``, ``telemetry/config.py`` ``took_over``).
2. MEDIUM ``test_a_worker_whose_takeover_counter_fails_still_parks_a_run_in_doubt``: the
   same ``finally`` replaces an ``IndeterminateToolCallError`` with the meter's error, so a
   run in doubt is retried (not parked for an operator) on every take.
3. MEDIUM ``test_a_worker_whose_parked_counter_fails_still_reports_the_run_parked``:
   ``_park_as`` calls ``Telemetry.parked`` unguarded after the park is written: the
   meter's error escapes ``Worker._carry`` ("Task exception was never retrieved"), the
   take is never recorded and its progress never settled (``worker_parking.py``
   ``_park_as``).
4. LOW ``test_a_huge_tool_name_the_model_invents_stays_bounded_in_spans``: a 300,000-char
   tool name (the model's words) is put whole in the span name and ``gen_ai.tool.name``,
   capture_content off, masked on the event loop, where content over ~16,000 characters is
   never captured for that reason (``telemetry/spans.py`` ``_tool_span``).

Held: a parallel turn that died with one call recorded and one in flight is resumed with
one ``replayed`` and one ``reconciled`` span and no new ``dispatched``, and across both
attempts ``dispatched`` equals the effects made; ``stream_resume`` of a crashed run marks
its root streamed and reports the booking replayed, its events and spans agreeing; a
cancel acknowledged while the model thinks sends nothing and reports nothing dispatched; a
span processor whose ``on_start`` raises never fails a run, which is still counted; a tool
whose outcome is unknown (``ToolOutcomeUnknownError``) with a secret in its message reports
the call ``dispatched`` (it was sent) and no span, metric or log line holds the secret; the
resume's reconciled span and metrics hold no secret either.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Sequence
from typing import Any

import pytest
from opentelemetry import metrics
from opentelemetry.context import Context
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor

from booking import BOOK_TURNS, Airline, booking_agent
from otel_spans.world import Pipeline, World, attrs, every_value
from run.helpers import at
from tesserix_adk import (
    Agent,
    AgentRunner,
    LeasePolicy,
    Message,
    ModelResponse,
    Reconciled,
    Role,
    RunStatus,
    ScriptedProvider,
    ToolCall,
    Worker,
    open_stores,
    tool,
)
from tesserix_adk.errors import ToolOutcomeUnknownError
from tesserix_adk.run.events import ModelCallStarted, RunFinished, ToolCallFinished
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.stores.memory import MemoryWorkIndex
from tesserix_adk.telemetry import Telemetry
from tesserix_adk.testing.faults import SimulatedCrash

T = "acme-fresh"
SECRET = "sk-live-Zq81xWm4PbT9rLk2VnC7dH3s"
PIECE = "Zq81xWm4PbT9rLk2VnC7"


def _disposition(span: ReadableSpan) -> Any:
    return attrs(span).get("tesserix.tool.disposition")


def _dispositions(spans: Sequence[ReadableSpan], name: str) -> list[Any]:
    return sorted(str(_disposition(s)) for s in spans if s.name == name)


def _metric_attributes(otel: Pipeline) -> list[dict[str, Any]]:
    data = otel.reader.get_metrics_data()
    found: list[dict[str, Any]] = []
    for rm in data.resource_metrics if data is not None else ():
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                found += [dict(p.attributes or {}) for p in metric.data.data_points]
    return found


# --- 1. a worker whose meter fails ------------------------------------------------------


class _Instrument:
    """A counter or histogram that raises, for the instrument names in ``failing``."""

    def __init__(self, name: str, failing: set[str]) -> None:
        self.name, self.failing = name, failing

    def add(self, *args: Any, **kwargs: Any) -> None:
        if self.name in self.failing:
            raise RuntimeError(f"the meter is down ({self.name})")

    def record(self, *args: Any, **kwargs: Any) -> None:
        if self.name in self.failing:
            raise RuntimeError(f"the meter is down ({self.name})")


class _Meter(metrics.NoOpMeter):
    def __init__(self, name: str, failing: set[str]) -> None:
        super().__init__(name)
        self.failing = failing

    def create_counter(self, name: str, *args: Any, **kwargs: Any) -> Any:
        return _Instrument(name, self.failing)

    def create_histogram(self, name: str, *args: Any, **kwargs: Any) -> Any:
        return _Instrument(name, self.failing)


class _MeterProvider(metrics.NoOpMeterProvider):
    def __init__(self, failing: set[str]) -> None:
        self.failing = failing

    def get_meter(self, name: str, *args: Any, **kwargs: Any) -> metrics.Meter:
        return _Meter(name, self.failing)


def _stores() -> Stores:
    stores = open_stores("memory://")
    stores.work = MemoryWorkIndex(stores.leases)
    return stores


def _runner(stores: Stores) -> AgentRunner:
    return AgentRunner.from_stores(
        ScriptedProvider(list(BOOK_TURNS)),
        stores,
        lease_policy=LeasePolicy(ttl=2.0, renew_within=1.0),
        never_ran_margin=0.05,
    )


async def _worker_after_a_crash(failing: set[str], where: str) -> tuple[Worker, Airline]:
    """A run dies (``where``: "search", inside the side-effect-free search, or "before",
    inside book_seat with its claim in flight); a worker whose meter fails on ``failing``
    takes it, once."""
    otel, stores, airline = Pipeline(), _stores(), Airline()
    telemetry = Telemetry(
        tracer_provider=otel.tracer_provider, meter_provider=_MeterProvider(failing)
    )
    if where == "search":

        def die() -> None:
            raise SimulatedCrash("died searching")

        dying = booking_agent(airline, search_hook=die)
    else:

        def hook(stage: str) -> None:
            if stage == where:
                airline.hook = None
                raise SimulatedCrash(f"died {stage} booking")

        airline.hook = hook
        dying = booking_agent(airline)
    with pytest.raises(SimulatedCrash):
        await _runner(stores).run(dying, "book", tenant=T, run_id="r1")
    worker = Worker(
        _runner(stores),
        [booking_agent(airline)],
        exit_when_idle=True,
        poll_interval=0.01,
        telemetry=telemetry,
    )
    await asyncio.wait_for(worker.run(), 30)
    return worker, airline


async def test_a_worker_whose_takeover_counter_fails_still_reports_the_run_finished() -> None:
    worker, airline = await _worker_after_a_crash({"tesserix.lease.takeovers"}, "search")
    assert airline.bookings == ["LH123"]  # the run was carried to its end
    assert [how.value for _, how in worker.carried] == ["finished"]


async def test_a_worker_whose_takeover_counter_fails_still_parks_a_run_in_doubt() -> None:
    worker, airline = await _worker_after_a_crash({"tesserix.lease.takeovers"}, "before")
    assert airline.bookings == []  # never sent again
    assert [how.value for _, how in worker.carried] == ["parked"]


async def test_a_worker_whose_parked_counter_fails_still_reports_the_run_parked() -> None:
    worker, airline = await _worker_after_a_crash({"tesserix.runs.parked"}, "before")
    assert airline.bookings == []
    assert [how.value for _, how in worker.carried] == ["parked"]


async def test_a_worker_whose_step_and_run_instruments_fail_still_finishes_the_run() -> None:
    worker, airline = await _worker_after_a_crash(
        {"tesserix.step.duration", "tesserix.runs"}, "search"
    )
    assert airline.bookings == ["LH123"]
    assert [how.value for _, how in worker.carried] == ["finished"]


# --- 2. a parallel turn that died half-done ---------------------------------------------


class _TwoAtOnce:
    """A model whose first turn asks for ``charge`` and ``ship`` side by side, then says
    done."""

    async def complete(self, request: Any) -> ModelResponse:
        if any(m.role is Role.assistant for m in request.messages):
            return ModelResponse(message=Message.assistant("done", []))
        calls = [
            ToolCall(id="call_charge", name="charge", arguments={"amount": 5}),
            ToolCall(id="call_ship", name="ship", arguments={"parcel": "P1"}),
        ]
        return ModelResponse(message=Message.assistant("", calls))


async def test_a_parallel_turn_dead_half_done_is_resumed_replayed_and_reconciled() -> None:
    effects: list[str] = []
    charged = asyncio.Event()
    crash = [True]

    @tool
    async def charge(amount: int) -> str:
        """Charge the card."""
        effects.append("charge")
        charged.set()
        return "charged"

    def shipped(call: Any, ctx: Any) -> Reconciled:
        return Reconciled.completed({"parcel": "shipped", "token": SECRET})

    @tool(reconcile=shipped)
    async def ship(parcel: str) -> str:
        """Ship the parcel; the process dies once it is handed over."""
        await asyncio.wait_for(charged.wait(), 10)
        await asyncio.sleep(0.05)  # charge's outcome is recorded meanwhile
        effects.append("ship")
        if crash[0]:
            crash[0] = False
            raise SimulatedCrash("died shipping")
        return "shipped"

    agent = Agent("shop", "Sell.", [charge, ship], parallel_tool_calls=2)
    otel, world = Pipeline(), World()
    runner = world.runner(otel)
    runner.provider = _TwoAtOnce()
    with pytest.raises(SimulatedCrash):
        await runner.run(agent, "buy", tenant=T, run_id="p1")
    first = otel.spans()
    assert _dispositions(first, "execute_tool charge") == ["dispatched"]
    assert _dispositions(first, "execute_tool ship") == ["dispatched"]  # sent, then died
    otel.exporter.clear()

    again = world.runner(otel, never_ran_margin=0.01)
    again.provider = _TwoAtOnce()
    run = await again.resume(agent, "p1", tenant=T)
    assert run.status is RunStatus.completed
    assert effects == ["charge", "ship"]  # nothing sent twice
    resumed = otel.spans()
    assert _dispositions(resumed, "execute_tool charge") == ["replayed"]
    assert _dispositions(resumed, "execute_tool ship") == ["reconciled"]
    # Every execution the trace names is an effect made, and none is named twice.
    dispatched = [s for s in [*first, *resumed] if _disposition(s) == "dispatched"]
    assert len(dispatched) == len(effects)
    for text in every_value(resumed) + [json.dumps(a) for a in _metric_attributes(otel)]:
        assert PIECE not in text


# --- 3. stream_resume of a crashed run --------------------------------------------------


async def test_stream_resume_of_a_crashed_run_reports_the_booking_replayed(
    airline: Airline,
) -> None:
    otel, world = Pipeline(), World()
    agent = booking_agent(airline)
    world.store.crash_before = at("after_tool_result", 1)  # book_seat recorded, no frontier
    with pytest.raises(SimulatedCrash):
        await world.runner(otel).run(agent, "book", tenant=T, run_id="s1")
    world.store.crash_before = None
    otel.exporter.clear()
    finished: list[ToolCallFinished] = []
    last: Any = None
    async for event in world.runner(otel).stream_resume(agent, "s1", tenant=T):
        if isinstance(event, ToolCallFinished):
            finished.append(event)
        last = event
    assert isinstance(last, RunFinished) and last.run.status is RunStatus.completed
    assert airline.bookings == ["LH123"]
    (root,) = otel.named("invoke_agent")
    assert attrs(root)["tesserix.attempt.streamed"] is True
    assert attrs(root)["tesserix.attempt.kind"] == "resume"
    spans = otel.named("execute_tool")
    assert [str(_disposition(s)) for s in spans] == ["replayed"]
    assert [(e.name, e.disposition.value) for e in finished] == [("book_seat", "replayed")]


# --- 4. a cancel acknowledged while the model thinks ------------------------------------


async def test_a_cancel_while_the_model_thinks_sends_nothing_and_reports_nothing_sent(
    airline: Airline,
) -> None:
    otel, world = Pipeline(), World()
    agent = booking_agent(airline)
    thinking, answer = asyncio.Event(), asyncio.Event()
    script = ScriptedProvider(list(BOOK_TURNS))

    class Slow:
        async def complete(self, request: Any) -> ModelResponse:
            if sum(1 for m in request.messages if m.role is Role.assistant) == 1:
                thinking.set()
                await asyncio.wait_for(answer.wait(), 10)
            return await script.complete(request)

    runner = world.runner(otel)
    runner.provider = Slow()
    task = asyncio.create_task(runner.run(agent, "book", tenant=T, run_id="c1"))
    await asyncio.wait_for(thinking.wait(), 10)
    await world.runner(otel).cancel("c1", tenant=T, by="ops", reason=f"fraud {SECRET}")
    answer.set()
    run = await asyncio.wait_for(task, 10)
    assert run.status is RunStatus.cancelled
    assert airline.bookings == []
    assert [_disposition(s) for s in otel.named("execute_tool book_seat")] in ([], ["refused"])
    assert all(_disposition(s) != "dispatched" for s in otel.named("execute_tool book_seat"))
    for text in every_value(otel.spans()):
        assert PIECE not in text


# --- 5. a span processor that cannot start spans ----------------------------------------


class _FailingOnStart(SpanProcessor):
    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        raise ConnectionError(f"https://otel:{SECRET}@collector.example refused")


async def test_a_processor_failing_on_start_never_fails_the_run_and_it_is_counted(
    airline: Airline, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    otel, world = Pipeline(), World()
    otel.tracer_provider.add_span_processor(_FailingOnStart())
    run = await world.runner(otel).run(booking_agent(airline), "book", tenant=T, run_id="f1")
    assert run.status is RunStatus.completed
    assert airline.bookings == ["LH123"]
    assert [p.value for p in otel.points("tesserix.runs")] == [1]
    ours = [r.getMessage() for r in caplog.records if r.name.startswith("tesserix_adk")]
    assert not [m for m in ours if PIECE in m]


# --- 6. a call in doubt whose error holds a secret --------------------------------------


async def test_an_outcome_unknown_call_is_dispatched_and_its_secret_shown_nowhere(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    sent: list[str] = []

    @tool
    def wire(amount: int) -> str:
        """Wire money; the bank's gateway times out after taking it."""
        sent.append("wire")
        raise ToolOutcomeUnknownError(f"gateway timeout, session token={SECRET}")

    for capture in (False, True):
        otel, world = Pipeline(capture_content=capture), World()
        runner = world.runner(otel, [[("wire", {"amount": 5})], "ok", "ok"])
        # The call is left in doubt, its claim in flight: how the run ends is not asserted.
        with contextlib.suppress(Exception):
            await runner.run(Agent("bank", "Pay.", [wire]), "pay", tenant=T, run_id=f"u{capture}")
        (span,) = otel.named("execute_tool wire")
        assert _disposition(span) == "dispatched"  # it was sent
        texts = every_value(otel.spans()) + [str(s.status.description) for s in otel.spans()]
        texts += [json.dumps(a) for a in _metric_attributes(otel)]
        for text in texts:
            assert PIECE not in text
    assert sent == ["wire", "wire"]
    for record in caplog.records:
        assert PIECE not in record.getMessage()


# --- 7. huge attributes ------------------------------------------------------------------


async def test_a_huge_tool_name_the_model_invents_stays_bounded_in_spans() -> None:
    otel, world = Pipeline(capture_content=False), World()
    name = "x" * 300_000
    runner = world.runner(otel, [[(name, {"to": "JFK"})], "cannot"])
    run = await runner.run(booking_agent(Airline()), "go", tenant=T, run_id="h1")
    assert run.status is RunStatus.completed
    (span,) = [s for s in otel.spans() if s.name.startswith("execute_tool")]
    assert _disposition(span) == "refused"
    assert len(span.name) <= 16_100
    assert len(str(attrs(span)["gen_ai.tool.name"])) <= 16_100


async def test_chat_spans_of_a_resumed_run_are_model_calls_made_in_that_attempt(
    airline: Airline,
) -> None:
    otel, world = Pipeline(), World()
    agent = booking_agent(airline)
    world.store.crash_before = at("after_tool_result", 1)
    with pytest.raises(SimulatedCrash):
        await world.runner(otel).run(agent, "book", tenant=T, run_id="m1")
    world.store.crash_before = None
    otel.exporter.clear()
    asked: list[ModelCallStarted] = []
    run = await world.runner(otel).resume(
        agent,
        "m1",
        tenant=T,
        on_event=lambda e: asked.append(e) if isinstance(e, ModelCallStarted) else None,
    )
    assert run.status is RunStatus.completed
    assert len(otel.named("chat")) == len(asked) >= 1
