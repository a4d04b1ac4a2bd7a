"""An attacker's review of the telemetry promises (README "Spans and metrics", guarantees 6
and 7), through the real OpenTelemetry SDK in process: in-memory span exporter and metric
reader, real span processors, tracers and meters that fail; no mock of the kit.

Defects found (each was an ``xfail(strict=True)``, its reason naming where in ``src``; all
are fixed since and their tests plain: names and call ids masked on spans; span ids from the
call's place in its turn and, without a lease, from the attempt's holder; a replay read
before it is reported started; each step of an attempt's end on its own; failures logged
masked; content over 16 KiB not captured; a call failing its tool's validation answered
without a claim, ``refused``):

1. A tool name the model asks for is masked in every store (guarantee 7) but emitted raw as
   the ``execute_tool {name}`` span name and ``gen_ai.tool.name``, capture_content off
   (``telemetry/spans.py`` ``_tool_span``).
2. Two calls of one reply sharing a call id (the kit carries them as two calls) get the
   same ``DeterministicIds`` span id: span ids derive from (iteration, call id) only
   (``telemetry/spans.py`` ``_tool_span`` / ``_child``).
3. Parallel calls sharing a call id: ``ToolCallFinished`` ends the first *started* span of
   that id, so a call that finishes first reports its result (and end) on its sibling's
   span (``telemetry/spans.py`` ``_tool_finished`` / ``_first``).
4. Without a lease store, two attempts resumed from the same step number their spans alike
   (``_attempt_number`` falls back to the step): the call one attempt *dispatched* and the
   call the next *replayed* share one span id, so a backend that keeps one span per id
   loses the execution or reports the replay as it (``telemetry/spans.py``
   ``_attempt_number``).
5. Attempts refused before they hold a lease (``ResumeConflictError``: another holder) are
   all attempt 0: every one of them gets the same root span id (same place).
6. A replay whose recorded outcome fails its checksum is reported ``dispatched``:
   ``run/dispatch.py`` ``_call_tool`` reports ``ToolCallStarted`` before
   ``decode_outcome``, and ``AttemptSpans.end`` marks every open tool span ``dispatched``.
7. ``AttemptSpans.end`` is all or nothing: a span processor that raises ending one open
   child span leaves the attempt's root span never ended (never exported) and the attempt
   uncounted in ``tesserix.runs``.
8. The two pipelines take each other down in ``end``: a tracer that cannot start spans
   loses the ``tesserix.runs`` metric (``end`` makes the root span before it counts), and
   a meter whose counter raises leaves the root span never ended (``runs.add`` comes
   before ``root.end()``).
9. An observer's failure is logged unmasked: ``run/observing.py`` logs ``%r`` of what the
   span pipeline raised (a URL password, say) on ``tesserix_adk.runner``, whose log lines
   guarantee 7 promises masked.
10. The same for a failing ``on_event`` listener (``run/attempt.py`` ``Attempt.emit``).
11. ``capture_content=True`` masks a large tool result again on the event loop
    (``telemetry/spans.py`` ``_shown``), where the kit otherwise masks anything over
    ``OFF_LOOP_BYTES`` in a worker thread "so lease renewals go on".
12. A call whose arguments fail the tool's validation never reaches the tool, yet its span
    says ``dispatched`` ("the only new execution") instead of ``refused`` ("answered with
    an error, never sent"): ``run/dispatch.py`` reports it as sent.

Promises that held (plain tests): a raising exporter, a blocking exporter behind a batch
processor, a tracer that cannot start spans and a meter whose instruments raise never fail
or stall a run; secrets (built-in and ``extra_patterns``) in arguments, results, errors and
model text reach no span, metric or log record at DEBUG, capture on and off; dispositions
across crash/resume/resolve/approval/denial count each execution exactly once; metric
attributes stay bounded (no run, call, tenant or key); a stream left early or a cancelled
run ends every span it started; a resume exported twice names the same spans; parallel
calls with ids of their own report their own results.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import threading
from collections.abc import Sequence
from typing import Any

import pytest
from opentelemetry import metrics, trace
from opentelemetry.context import Context
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    SimpleSpanProcessor,
    SpanExporter,
    SpanExportResult,
)

from booking import BOOK_TURNS, Airline, booking_agent
from otel_spans.world import Pipeline, World, attrs, every_value
from run.helpers import at
from tesserix_adk import (
    Agent,
    AgentRunner,
    Checkpointer,
    IndeterminateToolCallError,
    LeasePolicy,
    MemoryApprovalStore,
    Message,
    ModelResponse,
    ProviderError,
    Redactor,
    Role,
    RunStatus,
    ScriptedProvider,
    ToolCall,
    ToolOutcome,
    tool,
)
from tesserix_adk.checkpoint.checkpointer import OFF_LOOP_BYTES
from tesserix_adk.checkpoint.payload import encode_outcome
from tesserix_adk.run.events import ModelCallFinished, ToolCallStarted
from tesserix_adk.testing.faults import SimulatedCrash

T = "acme"
URL_SECRET = "hunter2-s3cret"


# --- helpers -------------------------------------------------------------------------------


class Tracking(SpanProcessor):
    """Every span started and every span ended, by span id (to find spans left open)."""

    def __init__(self) -> None:
        self.started: dict[int, str] = {}
        self.ended: set[int] = set()

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        self.started[span.context.span_id] = span.name

    def on_end(self, span: ReadableSpan) -> None:
        self.ended.add(span.context.span_id)

    def left_open(self) -> list[str]:
        return [name for sid, name in self.started.items() if sid not in self.ended]


def tracked(otel: Pipeline) -> Tracking:
    tracking = Tracking()
    otel.tracer_provider.add_span_processor(tracking)
    return tracking


class OneReply:
    """A model whose first turn asks for ``calls`` exactly as given (ids included), then
    answers "done"."""

    def __init__(self, calls: Sequence[ToolCall]) -> None:
        self.calls = list(calls)

    async def complete(self, request: Any) -> ModelResponse:
        asked = sum(1 for m in request.messages if m.role is Role.assistant)
        if asked == 0:
            return ModelResponse(message=Message.assistant("", self.calls))
        return ModelResponse(message=Message.assistant("done", []))


class DownAt:
    """The booking script, whose model call at turn ``turn`` fails retryably."""

    def __init__(self, turn: int) -> None:
        self.turn = turn
        self.inner = ScriptedProvider(list(BOOK_TURNS))

    async def complete(self, request: Any) -> ModelResponse:
        if sum(1 for m in request.messages if m.role is Role.assistant) == self.turn:
            raise ProviderError("the model is down", retryable=True)
        return await self.inner.complete(request)


def _crash_inside_booking(airline: Airline, stage: str) -> None:
    def hook(at: str) -> None:
        if at == stage:
            airline.hook = None
            raise SimulatedCrash(f"died {stage} booking")

    airline.hook = hook


def _disposition(span: ReadableSpan) -> Any:
    return attrs(span).get("tesserix.tool.disposition")


def _dispatched(spans: Sequence[ReadableSpan], name: str) -> int:
    return sum(1 for s in spans if s.name == name and _disposition(s) == "dispatched")


def _metric_attributes(otel: Pipeline) -> list[dict[str, Any]]:
    data = otel.reader.get_metrics_data()
    found: list[dict[str, Any]] = []
    for rm in data.resource_metrics if data is not None else ():
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                found += [dict(p.attributes or {}) for p in metric.data.data_points]
    return found


class FailingOnEnd(SpanProcessor):
    """A span processor whose export of tool spans fails with an error naming its
    collector's URL, password included (as an HTTP client's error does)."""

    def on_end(self, span: ReadableSpan) -> None:
        if span.name.startswith("execute_tool"):
            raise ConnectionError(
                f"POST https://otel:{URL_SECRET}@collector.example/v1/traces refused"
            )


class BrokenTracer(trace.Tracer):
    def start_span(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("the tracer is down")

    def start_as_current_span(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("the tracer is down")


class BrokenTracerProvider(trace.TracerProvider):
    def get_tracer(self, *args: Any, **kwargs: Any) -> trace.Tracer:
        return BrokenTracer()


def _with_tracer(otel: Pipeline, provider: trace.TracerProvider) -> None:
    """``otel``'s telemetry, spans through ``provider``, metrics still to ``otel``'s reader."""
    from tesserix_adk.telemetry import Telemetry

    otel.telemetry = Telemetry(tracer_provider=provider, meter_provider=otel.meter_provider)


# --- 1. secrets ----------------------------------------------------------------------------

TOOL_NAME_SECRET = "sk-proj-4eC39HqLyjWDarjtT1zdp7dcQ9xZ"


async def test_a_secret_the_model_puts_in_a_tool_name_is_masked_in_spans(
    airline: Airline,
) -> None:
    otel, world = Pipeline(capture_content=False), World()
    turns: list[Any] = [[(TOOL_NAME_SECRET, {"to": "JFK"})], "cannot"]
    run = await world.runner(otel, turns).run(booking_agent(airline), "go", tenant=T, run_id="r")
    assert run.status is RunStatus.completed
    stored = await world.store.latest(T, "r")
    assert stored is not None and TOOL_NAME_SECRET not in repr(stored)  # the store masks it
    (refused,) = [s for s in otel.named("execute_tool") if _disposition(s) == "refused"]
    assert refused.status.status_code is trace.StatusCode.ERROR
    for value in every_value(otel.spans()):
        assert "4eC39HqLyjWDarjtT1zdp7dc" not in value


SECRET = "sk-live-4eC39HqLyjWDarjtT1zdp7dc"
CUSTOM = "ACME-778899"


@pytest.mark.parametrize("capture", [False, True], ids=["content-off", "content-on"])
async def test_secrets_in_arguments_results_errors_and_text_reach_no_span_metric_or_log(
    capture: bool, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)

    @tool
    def pay(card: str, memo: str) -> dict[str, str]:
        """Pay; the processor answers with tokens of its own."""
        return {
            "receipt": f"Bearer {SECRET}",
            "password": "hunter2hunter2",
            "note": f"customer {CUSTOM}",
        }

    @tool
    def fail(memo: str) -> str:
        """Fails, naming a secret in its error."""
        raise ValueError(f"declined: token={SECRET} for {CUSTOM}")

    turns: list[Any] = [
        [("pay", {"card": f"{SECRET}", "memo": f"ref {CUSTOM}"})],
        [("fail", {"memo": f"apikey {SECRET}"})],
        f"Paid with {SECRET} and {CUSTOM}.",
    ]
    otel, world = Pipeline(capture_content=capture), World()
    runner = AgentRunner(
        ScriptedProvider(turns),
        idempotency=world.idempotency,
        checkpoints=Checkpointer(world.store, extra_patterns=(r"ACME-[0-9]{6}",)),
        leases=world.leases,
        telemetry=otel.telemetry,
    )
    run = await runner.run(Agent("payer", "Pay.", [pay, fail]), "pay", tenant=T, run_id="r1")
    assert run.status is RunStatus.completed

    # A model that fails for good, saying a secret: the run fails, the span says only why.
    class Leaky:
        async def complete(self, request: Any) -> Any:
            raise ProviderError(f"401 for key {SECRET} ({CUSTOM})", retryable=False)

    runner.provider = Leaky()
    failed = await runner.run(Agent("payer", "Pay.", [pay, fail]), "x", tenant=T, run_id="r2")
    assert failed.status is RunStatus.failed

    texts = every_value(otel.spans())
    texts += [str(s.status.description) for s in otel.spans()]
    texts += [json.dumps(a, default=str) for a in _metric_attributes(otel)]
    texts += [r.getMessage() for r in caplog.records]
    for text in texts:
        assert "4eC39HqLyjWDarjtT1zdp7dc" not in text
        assert CUSTOM not in text
        assert "hunter2hunter2" not in text
    (paid,) = otel.named("execute_tool pay")
    if capture:
        assert "[redacted:" in attrs(paid)["gen_ai.tool.call.arguments"]
        assert "[redacted:" in attrs(paid)["gen_ai.tool.call.result"]
    else:
        assert "gen_ai.tool.call.result" not in attrs(paid)


async def test_an_observer_failure_is_logged_with_its_secrets_masked(
    airline: Airline, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    otel, world = Pipeline(), World()
    otel.tracer_provider.add_span_processor(FailingOnEnd())
    run = await world.runner(otel).run(booking_agent(airline), "book", tenant=T, run_id="r1")
    assert run.status is RunStatus.completed  # the failing pipeline never fails the run
    assert airline.bookings == ["LH123"]
    ours = [r.getMessage() for r in caplog.records if r.name.startswith("tesserix_adk")]
    assert any("observing" in m for m in ours)  # the failure is heard
    assert not [m for m in ours if URL_SECRET in m]


async def test_a_failing_event_listener_is_logged_with_its_secrets_masked(
    airline: Airline, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)

    def forward(event: Any) -> None:
        raise ConnectionError(f"wss://viewer:{URL_SECRET}@ui.example/events closed")

    otel, world = Pipeline(), World()
    run = await world.runner(otel).run(
        booking_agent(airline), "book", tenant=T, run_id="r1", on_event=forward
    )
    assert run.status is RunStatus.completed
    ours = [r.getMessage() for r in caplog.records if r.name.startswith("tesserix_adk")]
    assert any("listener" in m for m in ours)
    assert not [m for m in ours if URL_SECRET in m]


class _SpyRedactor(Redactor):
    """The kit's own redactor, noting each large payload it masks and on which thread."""

    seen: list[tuple[str, int]] = []  # noqa: RUF012  (a class-level log: the dataclass is frozen)

    def text(self, value: str) -> str:
        if len(value) > OFF_LOOP_BYTES:
            _SpyRedactor.seen.append(("text", threading.get_ident()))
        return super().text(value)

    def value(self, data: Any) -> Any:
        if len(json.dumps(data, default=str)) > OFF_LOOP_BYTES:
            _SpyRedactor.seen.append(("value", threading.get_ident()))
        return super().value(data)


async def _large_result_masked_on_loop(capture: bool) -> list[str]:
    @tool
    def report() -> dict[str, list[str]]:
        """A large report (well under max_bytes)."""
        return {"rows": [f"row {i} of the quarterly report" for i in range(6000)]}

    _SpyRedactor.seen = []
    otel, world = Pipeline(capture_content=capture), World()
    runner = world.runner(otel, [[("report", {})], "done"])
    assert runner.checkpoints is not None
    runner.checkpoints.redactor = _SpyRedactor()
    loop_thread = threading.get_ident()
    run = await runner.run(Agent("a", "Report.", [report]), "go", tenant=T, run_id="r1")
    assert run.status is RunStatus.completed
    assert _SpyRedactor.seen  # the large result was masked somewhere
    return [what for what, thread in _SpyRedactor.seen if thread == loop_thread]


async def test_without_captured_content_a_large_result_is_masked_off_the_event_loop() -> None:
    assert await _large_result_masked_on_loop(capture=False) == []


async def test_with_captured_content_a_large_result_is_still_masked_off_the_event_loop() -> None:
    assert await _large_result_masked_on_loop(capture=True) == []


# --- 2. span ids ---------------------------------------------------------------------------


def _twins(calls: Sequence[ToolCall]) -> tuple[Pipeline, World, AgentRunner]:
    otel, world = Pipeline(capture_content=True), World()
    runner = world.runner(otel)
    runner.provider = OneReply(calls)
    return otel, world, runner


async def test_two_calls_of_one_reply_sharing_a_call_id_get_span_ids_of_their_own() -> None:
    @tool
    def lookup(city: str) -> str:
        """Look a city up."""
        return city.upper()

    calls = [
        ToolCall(id="call_1", name="lookup", arguments={"city": "a"}),
        ToolCall(id="call_1", name="lookup", arguments={"city": "b"}),
    ]
    otel, _, runner = _twins(calls)
    run = await runner.run(Agent("scout", "Look.", [lookup]), "go", tenant=T, run_id="r1")
    assert run.status is RunStatus.completed
    spans = otel.named("execute_tool lookup")
    assert _dispatched(spans, "execute_tool lookup") == 2  # both ran, each reported
    assert len({s.context.span_id for s in spans}) == 2


async def test_parallel_calls_sharing_a_call_id_each_report_their_own_result() -> None:
    second_done = asyncio.Event()

    @tool
    async def lookup(city: str) -> str:
        """Look a city up; "a" answers only once "b" has."""
        if city == "a":
            await asyncio.wait_for(second_done.wait(), 10)
        else:
            second_done.set()
        return city.upper()

    calls = [
        ToolCall(id="call_1", name="lookup", arguments={"city": "a"}),
        ToolCall(id="call_1", name="lookup", arguments={"city": "b"}),
    ]
    otel, _, runner = _twins(calls)
    agent = Agent("scout", "Look.", [lookup], parallel_tool_calls=2)
    run = await runner.run(agent, "go", tenant=T, run_id="r1")
    assert run.status is RunStatus.completed
    shown = sorted(
        (
            json.loads(attrs(s)["gen_ai.tool.call.arguments"])["city"],
            json.loads(attrs(s)["gen_ai.tool.call.result"]),
        )
        for s in otel.named("execute_tool lookup")
    )
    assert shown == [("a", "A"), ("b", "B")]


async def test_parallel_calls_with_ids_of_their_own_each_report_their_own_result() -> None:
    second_done = asyncio.Event()

    @tool
    async def lookup(city: str) -> str:
        """Look a city up; "a" answers only once "b" has."""
        if city == "a":
            await asyncio.wait_for(second_done.wait(), 10)
        else:
            second_done.set()
        return city.upper()

    turns: list[Any] = [[("lookup", {"city": "a"}), ("lookup", {"city": "b"})], "done"]
    otel = Pipeline(capture_content=True)
    tracking = tracked(otel)
    agent = Agent("scout", "Look.", [lookup], parallel_tool_calls=2)
    await World().runner(otel, turns).run(agent, "go", tenant=T, run_id="r1")
    spans = otel.named("execute_tool lookup")
    shown = sorted(
        (
            json.loads(attrs(s)["gen_ai.tool.call.arguments"])["city"],
            json.loads(attrs(s)["gen_ai.tool.call.result"]),
        )
        for s in spans
    )
    assert shown == [("a", "A"), ("b", "B")]
    (root,) = otel.named("invoke_agent")
    assert {s.parent.span_id for s in spans if s.parent is not None} == {root.context.span_id}
    assert len({s.context.span_id for s in spans}) == 2
    assert tracking.left_open() == []


def _leaseless(world: World, otel: Pipeline, provider: Any) -> AgentRunner:
    return AgentRunner(
        provider,
        idempotency=world.idempotency,
        checkpoints=Checkpointer(world.store),
        telemetry=otel.telemetry,
    )


async def test_without_leases_a_replayed_call_never_shares_the_span_of_its_execution(
    airline: Airline,
) -> None:
    otel, world = Pipeline(), World()
    agent = booking_agent(airline)
    # The first attempt stops retryably after searching: its frontier is where both
    # resumes start.
    with pytest.raises(ProviderError):
        await _leaseless(world, otel, DownAt(1)).run(agent, "book", tenant=T, run_id="r1")
    otel.exporter.clear()
    # Resume A books (its frontiers cannot be written: a checkpoint failure never fails the
    # run), then stops retryably at the next model call.
    world.store.fail_with = ConnectionError("checkpoint store down")
    with pytest.raises(ProviderError):
        await _leaseless(world, otel, DownAt(2)).resume(agent, "r1", tenant=T)
    first = otel.spans()
    otel.exporter.clear()
    # Resume B starts from the same frontier and replays the booking.
    world.store.fail_with = None
    run = await _leaseless(world, otel, DownAt(99)).resume(agent, "r1", tenant=T)
    assert run.status is RunStatus.completed
    assert airline.bookings == ["LH123"]
    second = otel.spans()
    (sent,) = [s for s in first if s.name == "execute_tool book_seat"]
    (replayed,) = [s for s in second if s.name == "execute_tool book_seat"]
    assert (_disposition(sent), _disposition(replayed)) == ("dispatched", "replayed")
    assert sent.context.span_id != replayed.context.span_id
    assert not {s.context.span_id for s in first} & {s.context.span_id for s in second}


async def test_attempts_refused_before_holding_a_lease_get_span_ids_of_their_own() -> None:
    gate, entered = asyncio.Event(), asyncio.Event()

    @tool
    async def wait() -> str:
        """Waits for the test."""
        entered.set()
        await gate.wait()
        return "ok"

    otel, world = Pipeline(), World()
    agent = Agent("a", "Wait.", [wait])
    turns: list[Any] = [[("wait", {})], "done"]
    holder = asyncio.create_task(world.runner(otel, turns).run(agent, "go", tenant=T, run_id="r1"))
    await asyncio.wait_for(entered.wait(), 10)  # the first attempt holds the run
    for _ in range(2):  # two other attempts find the run held
        with pytest.raises(Exception, match="held by"):
            await world.runner(otel, turns).resume(agent, "r1", tenant=T)
    gate.set()
    assert (await holder).status is RunStatus.completed
    roots = otel.named("invoke_agent")
    assert len(roots) == 3
    assert len({s.context.span_id for s in roots}) == 3


async def test_a_resume_exported_twice_names_the_same_spans() -> None:
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

    seen = []
    for _ in range(2):  # the same crash and resume, in two worlds
        otel, world, airline = Pipeline(), World(), Airline()
        agent = booking_agent(airline)
        world.store.crash_before = at("after_tool_result", 1)
        with pytest.raises(SimulatedCrash):
            await world.runner(otel).run(agent, "book", tenant=T, run_id="r1")
        world.store.crash_before = None
        otel.exporter.clear()
        await world.runner(otel).resume(agent, "r1", tenant=T)
        seen.append(ids(otel))
    assert seen[0] == seen[1]
    assert len({span_id for _, _, span_id, _ in seen[0]}) == len(seen[0])


# --- 3. dispositions -----------------------------------------------------------------------


async def test_a_replay_whose_recorded_outcome_is_corrupt_is_never_reported_dispatched(
    airline: Airline,
) -> None:
    otel, world = Pipeline(), World()
    agent = booking_agent(airline)
    world.store.crash_before = at("after_tool_result", 1)  # booked and recorded, no frontier
    with pytest.raises(SimulatedCrash):
        await world.runner(otel).run(agent, "book", tenant=T, run_id="r1")
    world.store.crash_before = None
    # A byte of the recorded outcome changes at rest (the store's own data, not the kit's).
    records = world.idempotency._records
    ((where, rec),) = [(k, r) for k, r in records.items() if r.tool == "book_seat"]
    assert rec.outcome is not None
    flipped = bytearray(rec.outcome)
    flipped[flipped.index(b"LH123")] ^= 1
    records[where] = dataclasses.replace(rec, outcome=bytes(flipped))
    otel.exporter.clear()
    with pytest.raises(Exception, match="checksum"):
        await world.runner(otel).resume(agent, "r1", tenant=T)
    assert airline.bookings == ["LH123"]  # nothing was sent again
    assert _dispatched(otel.spans(), "execute_tool book_seat") == 0


async def test_a_call_whose_arguments_fail_validation_is_not_reported_as_an_execution() -> None:
    ran: list[int] = []

    @tool
    def charge(cents: int) -> int:
        """Charge an amount."""
        ran.append(cents)
        return cents

    otel, _, runner = _twins([ToolCall(id="c1", name="charge", arguments={"cents": "ten"})])
    run = await runner.run(Agent("a", "Charge.", [charge]), "go", tenant=T, run_id="r1")
    assert run.status is RunStatus.completed
    assert ran == []
    (span,) = otel.named("execute_tool charge")
    assert _disposition(span) == "refused"


async def test_across_crash_resolve_and_resume_each_execution_is_dispatched_exactly_once(
    airline: Airline,
) -> None:
    otel, world = Pipeline(), World()
    tracking = tracked(otel)
    agent = booking_agent(airline)
    _crash_inside_booking(airline, "after")  # booked; the outcome never recorded
    with pytest.raises(SimulatedCrash):
        await world.runner(otel).run(agent, "book", tenant=T, run_id="r1")
    with pytest.raises(IndeterminateToolCallError) as err:
        await world.runner(otel).resume(agent, "r1", tenant=T)
    (doubt,) = err.value.calls
    assert doubt.key is not None
    outcome = ToolOutcome(call_id=doubt.call_id or "", content={"booking": "B1"})
    await world.idempotency.resolve(
        doubt.key, encode_outcome(outcome, Redactor()), tenant=T, by="alice"
    )
    assert (await world.runner(otel).resume(agent, "r1", tenant=T)).status is (RunStatus.completed)
    await world.runner(otel).resume(agent, "r1", tenant=T)  # finished: nothing carried
    spans = otel.spans()
    assert _dispatched(spans, "execute_tool book_seat") == len(airline.bookings) == 1
    assert _dispatched(spans, "execute_tool search_flights") == airline.searches == 1
    assert sorted(_disposition(s) for s in spans if s.name == "execute_tool book_seat") == [
        "dispatched",
        "resolved",
    ]
    assert tracking.left_open() == []


@pytest.mark.parametrize("approved", [True, False], ids=["approved", "denied"])
async def test_an_approval_dispatches_once_and_a_denial_is_refused(
    airline: Airline, approved: bool
) -> None:
    otel, world, approvals = Pipeline(), World(), MemoryApprovalStore()
    agent = booking_agent(airline, approval=True)
    run = await world.runner(otel, approvals=approvals).run(agent, "b", tenant=T, run_id="r1")
    assert run.status is RunStatus.waiting_approval and run.pending_approval is not None
    again = await world.runner(otel, approvals=approvals).resume(agent, "r1", tenant=T)
    assert again.status is RunStatus.waiting_approval
    assert otel.named("execute_tool book_seat") == []  # waiting is no call at all
    await approvals.decide(T, run.pending_approval.id, approved=approved, by="alice")
    done = await world.runner(otel, approvals=approvals).resume(agent, "r1", tenant=T)
    assert done.status is RunStatus.completed
    await world.runner(otel, approvals=approvals).resume(agent, "r1", tenant=T)
    (book,) = otel.named("execute_tool book_seat")
    assert _disposition(book) == ("dispatched" if approved else "refused")
    assert len(airline.bookings) == (1 if approved else 0)
    assert _dispatched(otel.spans(), "execute_tool search_flights") == airline.searches == 1


# --- 4. failing and slow pipelines ---------------------------------------------------------


class _RaisingExporter(SpanExporter):
    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        raise ConnectionError("the collector is down")

    def shutdown(self) -> None:
        pass


async def test_a_raising_exporter_never_fails_the_run(airline: Airline) -> None:
    otel, world = Pipeline(), World()
    otel.tracer_provider.add_span_processor(SimpleSpanProcessor(_RaisingExporter()))
    run = await world.runner(otel).run(booking_agent(airline), "book", tenant=T, run_id="r1")
    assert run.status is RunStatus.completed
    assert airline.bookings == ["LH123"]
    assert len(otel.spans()) == 6  # the healthy exporter beside it has every span


class _BlockingExporter(SpanExporter):
    """An exporter that hangs until told to let go (a collector that never answers)."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.entered = threading.Event()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.entered.set()
        self.release.wait(30)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        self.release.set()


async def test_a_blocking_exporter_behind_a_batch_processor_neither_stalls_nor_costs_the_lease(
    airline: Airline,
) -> None:
    hung = _BlockingExporter()
    otel, world = Pipeline(), World()
    otel.tracer_provider.add_span_processor(
        BatchSpanProcessor(hung, schedule_delay_millis=1, max_export_batch_size=1)
    )

    def slow_search() -> None:
        assert hung.entered.wait(10)  # the exporter is stuck by the time we search

    agent = booking_agent(airline, search_hook=slow_search)
    # A short lease, renewed while the run goes on: a stalled loop would lose it.
    runner = world.runner(otel, lease_policy=LeasePolicy(ttl=0.4, renew_within=0.2))

    @tool
    async def settle() -> str:
        """Takes longer than the lease's ttl, so it must be renewed meanwhile."""
        await asyncio.sleep(0.9)
        return "settled"

    agent = Agent("booking", "Book.", [*agent.tools.values(), settle])
    turns: list[Any] = [*BOOK_TURNS[:2], [("settle", {})], "Booked."]
    runner.provider = ScriptedProvider(turns)
    try:
        run = await runner.run(agent, "book", tenant=T, run_id="r1")
    finally:
        hung.release.set()
        otel.tracer_provider.shutdown()
    assert run.status is RunStatus.completed
    assert airline.bookings == ["LH123"]


async def test_a_tracer_that_cannot_start_spans_never_fails_the_run(airline: Airline) -> None:
    otel, world = Pipeline(), World()
    _with_tracer(otel, BrokenTracerProvider())
    run = await world.runner(otel).run(booking_agent(airline), "book", tenant=T, run_id="r1")
    assert run.status is RunStatus.completed
    assert airline.bookings == ["LH123"]
    assert otel.points("tesserix.step.duration")  # metrics still flow


async def test_a_tracer_that_cannot_start_spans_still_lets_the_attempt_be_counted(
    airline: Airline,
) -> None:
    otel, world = Pipeline(), World()
    _with_tracer(otel, BrokenTracerProvider())
    await world.runner(otel).run(booking_agent(airline), "book", tenant=T, run_id="r1")
    assert [p.value for p in otel.points("tesserix.runs")] == [1]


async def test_a_processor_failing_on_one_span_still_ends_the_attempt_span_and_counts_it(
    airline: Airline,
) -> None:
    otel, world = Pipeline(), World()
    tracking = tracked(otel)
    otel.tracer_provider.add_span_processor(FailingOnEnd())
    _crash_inside_booking(airline, "after")  # the attempt dies with book_seat's span open
    with pytest.raises(SimulatedCrash):
        await world.runner(otel).run(booking_agent(airline), "book", tenant=T, run_id="r1")
    (book,) = otel.named("execute_tool book_seat")
    assert _disposition(book) == "dispatched"  # it was sent
    assert tracking.left_open() == []
    (root,) = otel.named("invoke_agent")
    assert attrs(root)["error.type"] == "SimulatedCrash"
    (runs,) = otel.points("tesserix.runs")
    assert runs.attributes is not None and runs.attributes["error.type"] == "SimulatedCrash"


class _RaisingInstrument:
    def add(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("the meter is down")

    def record(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("the meter is down")


class _RaisingMeter(metrics.NoOpMeter):
    def create_counter(self, *args: Any, **kwargs: Any) -> Any:
        return _RaisingInstrument()

    def create_histogram(self, *args: Any, **kwargs: Any) -> Any:
        return _RaisingInstrument()


class _RaisingMeterProvider(metrics.NoOpMeterProvider):
    def get_meter(self, name: str, *args: Any, **kwargs: Any) -> metrics.Meter:
        return _RaisingMeter(name)


async def test_a_meter_whose_instruments_raise_never_fails_the_run(airline: Airline) -> None:
    from tesserix_adk.telemetry import Telemetry

    otel, world = Pipeline(), World()
    otel.telemetry = Telemetry(
        tracer_provider=otel.tracer_provider, meter_provider=_RaisingMeterProvider()
    )
    run = await world.runner(otel).run(booking_agent(airline), "book", tenant=T, run_id="r1")
    assert run.status is RunStatus.completed
    assert airline.bookings == ["LH123"]
    assert len(otel.named("execute_tool")) == 2  # spans still flow


async def test_a_meter_whose_instruments_raise_still_lets_the_attempt_span_end(
    airline: Airline,
) -> None:
    from tesserix_adk.telemetry import Telemetry

    otel, world = Pipeline(), World()
    tracking = tracked(otel)
    otel.telemetry = Telemetry(
        tracer_provider=otel.tracer_provider, meter_provider=_RaisingMeterProvider()
    )
    await world.runner(otel).run(booking_agent(airline), "book", tenant=T, run_id="r1")
    assert tracking.left_open() == []
    (root,) = otel.named("invoke_agent")
    assert attrs(root)["tesserix.run.status"] == "completed"


# --- 5. metrics cardinality ----------------------------------------------------------------


async def test_metric_attributes_never_hold_a_run_call_tenant_or_key() -> None:
    otel = Pipeline()
    world = World()
    for i in range(4):
        airline = Airline()
        tenant = f"tenant-{i}"
        await world.runner(otel).run(booking_agent(airline), "b", tenant=tenant, run_id=f"r-{i}")
    keys = [
        r.key for i in range(4) for r in await world.idempotency.records(f"tenant-{i}", f"r-{i}")
    ]
    allowed = {"gen_ai.agent.name", "tesserix.boundary", "tesserix.run.status", "error.type"}
    seen = _metric_attributes(otel)
    assert seen
    for attributes in seen:
        assert set(attributes) <= allowed
        for value in attributes.values():
            assert not str(value).startswith(("r-", "tenant-", "call_"))
            assert value not in keys
    # Four runs, one series: the count grows, the series do not.
    (runs,) = otel.points("tesserix.runs")
    assert runs.value == 4
    assert len(otel.points("tesserix.step.duration")) == 2  # one per boundary kind


# --- 6. cancelled runs and streams left early ----------------------------------------------


async def test_a_stream_left_early_ends_every_span_it_started(airline: Airline) -> None:
    otel, world = Pipeline(), World()
    tracking = tracked(otel)
    agent = booking_agent(airline)
    stream = world.runner(otel).stream(agent, "book", tenant=T, run_id="r1")
    async for event in stream:
        if isinstance(event, ModelCallFinished) and event.iteration == 1:
            break
    await stream.aclose()  # type: ignore[attr-defined]
    assert tracking.left_open() == []
    (root,) = otel.named("invoke_agent")
    assert root.status.status_code is trace.StatusCode.ERROR
    # The run goes on later, from its frontier; nothing is reported sent twice.
    run = await world.runner(otel).resume(agent, "r1", tenant=T)
    assert run.status is RunStatus.completed
    spans = otel.spans()
    assert _dispatched(spans, "execute_tool book_seat") == len(airline.bookings) == 1
    assert _dispatched(spans, "execute_tool search_flights") == airline.searches == 1
    assert tracking.left_open() == []


async def test_a_run_cancelled_inside_a_tool_ends_its_spans_and_reports_the_call_sent() -> None:
    started = asyncio.Event()

    @tool
    async def transfer(amount: int) -> str:
        """Moves money; hangs until cancelled."""
        started.set()
        await asyncio.sleep(60)
        return "done"

    otel, world = Pipeline(), World()
    tracking = tracked(otel)
    events: list[Any] = []
    turns: list[Any] = [[("transfer", {"amount": 5})], "done"]
    task = asyncio.create_task(
        world.runner(otel, turns).run(
            Agent("bank", "Pay.", [transfer]), "go", tenant=T, run_id="r1", on_event=events.append
        )
    )
    await asyncio.wait_for(started.wait(), 10)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert any(isinstance(e, ToolCallStarted) for e in events)
    assert tracking.left_open() == []
    (span,) = otel.named("execute_tool transfer")
    assert _disposition(span) == "dispatched"  # it was sent; its outcome unknown
    assert attrs(span)["error.type"] == "CancelledError"
    (root,) = otel.named("invoke_agent")
    assert attrs(root)["error.type"] == "CancelledError"
