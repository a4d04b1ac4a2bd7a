"""A second attacker's pass over the telemetry promises (README "Spans and metrics"): spans
are replay-safe, secrets never reach spans or metric labels, and telemetry failing never
fails a run. Real OpenTelemetry SDK (in-memory exporter and reader), real SQLite files, a
real worker process killed with SIGKILL; no mock of a store.

Defects (xfail strict): ``tesserix.lease.takeovers`` is counted in ``Worker._take`` before
the resume, for any wanted run with a frontier: a worker's own retry after a retryable
error counts as a takeover, and every take refused as held elsewhere counts one too.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import sqlite3
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult

from booking import BOOK_TURNS, Airline, booking_agent
from otel_spans.world import Pipeline, World, attrs, every_value
from processes import TENANT, Site
from run.helpers import at
from tesserix_adk import (
    Agent,
    AgentRunner,
    Backoff,
    LeaseLostError,
    LeasePolicy,
    MemoryApprovalStore,
    ModelResponse,
    NoCheckpointError,
    ProviderError,
    Role,
    RunStatus,
    ScriptedProvider,
    StoreUnavailableError,
    Worker,
    open_stores,
    tool,
)
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.stores.memory import MemoryWorkIndex
from tesserix_adk.telemetry import span_id_of, trace_id_of
from tesserix_adk.testing.faults import SimulatedCrash

T = "acme-otel-again"


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


def _stored_bytes(path: Path) -> bytes:
    """Everything the SQLite file (and its WAL) holds, as raw bytes."""
    out = b""
    for suffix in ("", "-wal", "-journal"):
        f = Path(f"{path}{suffix}")
        if f.exists():
            out += f.read_bytes()
    # And every value of every table, decoded (a page may hold text split across overflow).
    conn = sqlite3.connect(path)
    try:
        tables = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")]
        for table in tables:
            for row in conn.execute(f'SELECT * FROM "{table}"'):
                for value in row:
                    if isinstance(value, bytes):
                        out += value
                    elif value is not None:
                        out += str(value).encode("utf-8", "surrogatepass")
    finally:
        conn.close()
    return out


# --- 1. secrets in captured content, encoded -------------------------------------------

KEY = "sk-live-9fQ2xLmW7pRtZ4vB8nK3sD6hJ1"
PASSPHRASE = "hunter2hunter2hunter2"

# What a tool returns and what the model sends it, each holding a secret in a shape the
# README says the store masks. Each marker is a piece of the secret as it would leak.
ENCODED: dict[str, tuple[Any, list[str]]] = {
    "base64": (
        base64.b64encode(f"api_key={KEY}\n".encode()).decode(),
        [base64.b64encode(f"api_key={KEY}\n".encode()).decode(), "9fQ2xLmW7pRtZ4vB8nK3"],
    ),
    "base64-urlsafe-bytes": (
        b"\xff\xfe\x00" + f"password={PASSPHRASE} key {KEY}".encode(),
        [
            base64.urlsafe_b64encode(
                b"\xff\xfe\x00" + f"password={PASSPHRASE} key {KEY}".encode()
            ).decode()[8:40],
            PASSPHRASE,
        ],
    ),
    "json-text-duplicate-keys": (
        json.dumps({"token": "first"})[:-1] + f', "token": "{PASSPHRASE}"}}',
        [PASSPHRASE],
    ),
    "glued-bearer-percent": (f"Authorization: Bearer%20{KEY}", ["9fQ2xLmW7pRtZ4vB8nK3"]),
    "pretty-list-under-tokens": (
        "config:\n" + json.dumps({"api_keys": [PASSPHRASE, "other-one-1234"]}, indent=2),
        [PASSPHRASE],
    ),
    "bytes-literal": (repr(f"token={PASSPHRASE}".encode()), [PASSPHRASE]),
}


@pytest.mark.parametrize("shape", list(ENCODED))
async def test_captured_content_never_shows_an_encoded_secret_the_store_masked(
    shape: str, tmp_path: Path
) -> None:
    payload, markers = ENCODED[shape]
    argument = payload if isinstance(payload, str) else payload.decode("latin-1")

    @tool
    def fetch(blob: str) -> Any:
        """Returns the blob the vendor sent (a secret inside, encoded)."""
        return payload

    otel = Pipeline(capture_content=True)
    db = tmp_path / "adk.sqlite3"
    async with open_stores(f"sqlite:///{db}") as stores:
        await stores.create_schema()
        runner = AgentRunner.from_stores(
            ScriptedProvider([[("fetch", {"blob": argument})], "done"]),
            stores,
            telemetry=otel.telemetry,
        )
        run = await runner.run(Agent("fetcher", "Fetch.", [fetch]), "go", tenant=T, run_id="r1")
        assert run.status is RunStatus.completed
    stored = _stored_bytes(db)
    (span,) = otel.named("execute_tool fetch")
    assert "gen_ai.tool.call.result" in attrs(span)
    shown = "\n".join(every_value(otel.spans()))
    for marker in markers:
        if marker.encode() in stored:
            continue  # the store keeps it too (a documented limit): not the spans' doing
        assert marker not in shown, f"{marker!r} is masked in the store but shown in a span"


# --- 2. replay-safety across a real SIGKILL --------------------------------------------


def test_a_worker_killed_with_sigkill_after_booking_is_resumed_with_the_booking_replayed(
    tmp_path: Path,
) -> None:
    from tesserix_adk.cli.demo_agent import PROVIDER, agent

    site = Site(tmp_path)
    site.kill_at("k1", "booked")  # booked and recorded; the frontier after it never written
    assert site.bookings("k1") == 1
    site.wait_lease_lapsed("k1")
    otel = Pipeline()

    async def resume() -> Any:
        async with open_stores(site.store) as stores:
            runner = AgentRunner.from_stores(PROVIDER(), stores, telemetry=otel.telemetry)
            return await runner.resume(agent, "k1", tenant=TENANT)

    old = os.environ.get("ADK_DEMO_AIRLINE")
    os.environ["ADK_DEMO_AIRLINE"] = site.airline
    try:
        run = asyncio.run(resume())
    finally:
        if old is None:
            os.environ.pop("ADK_DEMO_AIRLINE", None)
        else:
            os.environ["ADK_DEMO_AIRLINE"] = old
    assert run.status is RunStatus.completed
    assert site.bookings("k1") == 1
    spans = otel.spans()
    (book,) = [s for s in spans if s.name == "execute_tool book_seat"]
    assert _disposition(book) == "replayed"
    assert _dispatched(spans, "execute_tool book_seat") == 0
    # Only the model call the dead worker never made is reported (and charged) here.
    chats = [s for s in spans if s.name.startswith("chat")]
    assert len(chats) == 1
    (root,) = [s for s in spans if s.name.startswith("invoke_agent")]
    assert root.context.trace_id == trace_id_of(TENANT, "k1")
    assert [link.context.span_id for link in root.links] == [span_id_of(TENANT, "k1", "attempt", 1)]


# --- 3. a run that went past its last frontier ----------------------------------------


class _DiesAtTurn:
    """The booking script; the model call at ``turn`` kills the process (once)."""

    def __init__(self, turn: int) -> None:
        self.turn = turn
        self.inner = ScriptedProvider(list(BOOK_TURNS))
        self.asked = 0

    async def complete(self, request: Any) -> ModelResponse:
        self.asked += 1
        if sum(1 for m in request.messages if m.role is Role.assistant) == self.turn:
            self.turn = -1
            raise SimulatedCrash("died asking the model")
        return await self.inner.complete(request)


async def test_a_run_past_its_last_frontier_reports_each_execution_dispatched_once(
    airline: Airline,
) -> None:
    otel, world = Pipeline(), World()
    agent = booking_agent(airline)

    # Frontiers fail from the booking on (the live run goes on: guarantee 6), then the
    # process dies asking the model for its final answer.
    def down(stage: str) -> None:
        if stage == "before":
            world.store.fail_with = StoreUnavailableError("the checkpoint store is down")

    airline.hook = down
    first = world.runner(otel)
    first.provider = _DiesAtTurn(2)
    with pytest.raises(SimulatedCrash):
        await first.run(agent, "book", tenant=T, run_id="r1")
    world.store.fail_with, airline.hook = None, None
    assert airline.bookings == ["LH123"]
    second = world.runner(otel)
    run = await second.resume(agent, "r1", tenant=T)
    assert run.status is RunStatus.completed
    assert airline.bookings == ["LH123"]
    spans = otel.spans()
    assert _dispatched(spans, "execute_tool book_seat") == 1
    assert _dispatched(spans, "execute_tool search_flights") == airline.searches
    dispositions = sorted(_disposition(s) for s in spans if s.name == "execute_tool book_seat")
    assert dispositions == ["dispatched", "replayed"]


# --- 4. model calls reported once -------------------------------------------------------


class _Counting:
    def __init__(self) -> None:
        self.inner = ScriptedProvider(list(BOOK_TURNS))
        self.calls = 0

    async def complete(self, request: Any) -> ModelResponse:
        self.calls += 1
        return await self.inner.complete(request)


async def test_across_a_crash_each_chat_span_is_one_model_call_made(airline: Airline) -> None:
    otel, world = Pipeline(), World()
    agent = booking_agent(airline)
    made = 0
    # Dies right after the model's booking turn is durable (after_model_call, iteration 1):
    # the resume must not ask that turn again, nor report it.
    world.store.crash_after = at("after_model_call", 1)
    first = world.runner(otel)
    first.provider = counting = _Counting()
    with pytest.raises(SimulatedCrash):
        await first.run(agent, "book", tenant=T, run_id="r1")
    made += counting.calls
    world.store.crash_after = None
    second = world.runner(otel)
    second.provider = counting = _Counting()
    assert (await second.resume(agent, "r1", tenant=T)).status is RunStatus.completed
    made += counting.calls
    chats = otel.named("chat")
    assert len(chats) == made == 3
    tokens = sum(attrs(s).get("gen_ai.usage.input_tokens", 0) for s in chats)
    assert tokens == 100 * made


# --- 5. slow and shut-down pipelines -----------------------------------------------------


class _SlowExporter(SpanExporter):
    """A collector that answers each export after ``seconds`` (synchronously)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.exported = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        time.sleep(self.seconds)
        self.exported += len(spans)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass


async def test_a_synchronous_exporter_stalling_past_the_lease_stops_the_run_and_sends_nothing_twice(
    airline: Airline,
) -> None:
    # A SimpleSpanProcessor exports on the event loop's thread: an export slower than the
    # lease's ttl stalls the holder past its lease. That costs the attempt (LeaseLostError:
    # a worker looks again later), never a second booking: the resume carries it on with one.
    otel, world = Pipeline(), World()
    otel.tracer_provider.add_span_processor(SimpleSpanProcessor(_SlowExporter(0.5)))
    agent = booking_agent(airline)
    runner = world.runner(otel, lease_policy=LeasePolicy(ttl=0.4, renew_within=0.2))
    try:
        run = await runner.run(agent, "book", tenant=T, run_id="r1")
        assert run.status is RunStatus.completed
    except LeaseLostError:
        await asyncio.sleep(0.5)
        healthy = Pipeline()
        try:
            run = await world.runner(healthy).resume(agent, "r1", tenant=T)
        except NoCheckpointError:  # lost before its first frontier: run() again
            run = await world.runner(healthy).run(agent, "book", tenant=T, run_id="r1")
        assert run.status is RunStatus.completed
        spans = [*otel.spans(), *healthy.spans()]
        assert _dispatched(spans, "execute_tool book_seat") == len(airline.bookings)
    assert airline.bookings == ["LH123"]


async def test_a_tracer_provider_shut_down_mid_run_never_fails_it_nor_sends_twice() -> None:
    otel, world, airline = Pipeline(), World(), Airline()

    def shut() -> None:
        otel.tracer_provider.shutdown()

    agent = booking_agent(airline, search_hook=shut)
    run = await world.runner(otel).run(agent, "book", tenant=T, run_id="r1")
    assert run.status is RunStatus.completed
    assert airline.bookings == ["LH123"] and airline.searches == 1
    # Metrics still flow: the attempt is counted once.
    (runs,) = otel.points("tesserix.runs")
    assert runs.value == 1


async def test_a_one_megabyte_tool_result_and_arguments_stay_bounded_in_spans() -> None:
    big = "x" * (1024 * 1024 - 4096)

    @tool
    def echo(text: str) -> str:
        """Echo."""
        return text

    otel, world = Pipeline(capture_content=True), World()
    runner = world.runner(otel, [[("echo", {"text": big})], "done"])
    run = await runner.run(Agent("echoer", "Echo.", [echo]), "go", tenant=T, run_id="r1")
    assert run.status is RunStatus.completed
    for span in otel.spans():
        assert len(span.name) < 1000
        for value in (span.attributes or {}).values():
            assert len(str(value)) < 20_000


async def test_a_denial_note_and_a_cancel_reason_holding_secrets_reach_no_span_or_metric(
    airline: Airline,
) -> None:
    otel, world, approvals = Pipeline(capture_content=True), World(), MemoryApprovalStore()
    agent = booking_agent(airline, approval=True)
    run = await world.runner(otel, approvals=approvals).run(agent, "b", tenant=T, run_id="r1")
    assert run.status is RunStatus.waiting_approval and run.pending_approval is not None
    await approvals.decide(
        T,
        run.pending_approval.id,
        approved=False,
        by=f"alice token={KEY}",
        note=f"no: the card's key is {KEY}, password={PASSPHRASE}",
    )
    done = await world.runner(otel, approvals=approvals).resume(agent, "r1", tenant=T)
    assert done.status is RunStatus.completed
    assert airline.bookings == []
    # A second run, cancelled with a reason holding the secret, then carried to its end.
    second = world.runner(otel, approvals=approvals)
    waiting = await second.run(agent, "b", tenant=T, run_id="r2")
    assert waiting.status is RunStatus.waiting_approval
    await second.cancel("r2", tenant=T, by=f"ops {KEY}", reason=f"leaked key {KEY}")
    await world.runner(otel, approvals=approvals).resume(agent, "r2", tenant=T)
    shown = "\n".join(every_value(otel.spans()))
    shown += json.dumps(_metric_attributes(otel))
    assert "9fQ2xLmW7pRtZ4vB8nK3" not in shown
    assert PASSPHRASE not in shown
    (book,) = otel.named("execute_tool book_seat")
    assert _disposition(book) == "refused"


# --- 6. metric labels ----------------------------------------------------------------------


async def test_a_secret_in_a_failing_tool_or_model_error_type_never_becomes_a_metric_label(
    airline: Airline,
) -> None:
    class Leaky(ProviderError):
        pass

    otel, world = Pipeline(), World()

    class Model:
        async def complete(self, request: Any) -> Any:
            raise Leaky(f"401 key {KEY}", retryable=False)

    runner = world.runner(otel)
    runner.provider = Model()
    run = await runner.run(booking_agent(airline), "book", tenant=T, run_id="r1")
    assert run.status is RunStatus.failed
    for labels in _metric_attributes(otel):
        assert set(labels) <= {
            "gen_ai.agent.name",
            "tesserix.boundary",
            "tesserix.run.status",
            "error.type",
        }
        assert "9fQ2xLmW7pRtZ4vB8nK3" not in json.dumps(labels)
    assert "9fQ2xLmW7pRtZ4vB8nK3" not in "\n".join(every_value(otel.spans()))


# --- 7. worker telemetry -----------------------------------------------------------------


def _stores() -> Stores:
    stores = open_stores("memory://")
    stores.work = MemoryWorkIndex(stores.leases)
    return stores


class _DownOnce:
    """The booking script, whose model is down (retryably) the first time at ``turn``."""

    def __init__(self, turn: int) -> None:
        self.turn = turn
        self.inner = ScriptedProvider(list(BOOK_TURNS))

    async def complete(self, request: Any) -> ModelResponse:
        if sum(1 for m in request.messages if m.role is Role.assistant) == self.turn:
            self.turn = -1
            raise ProviderError("the model is down for a moment", retryable=True)
        return await self.inner.complete(request)


async def test_a_worker_retrying_its_own_retryable_failure_counts_no_lease_takeover() -> None:
    otel, stores, airline = Pipeline(), _stores(), Airline()
    agent = booking_agent(airline)
    runner = AgentRunner.from_stores(
        _DownOnce(1), stores, lease_policy=LeasePolicy(ttl=2.0, renew_within=1.0)
    )
    await runner.submit(agent, "book", tenant=T, run_id="r1")
    carried = []
    for _ in range(2):  # the first take fails retryably; the next, after the backoff, ends it
        worker = Worker(
            runner,
            [agent],
            exit_when_idle=True,
            poll_interval=0.01,
            backoff=Backoff(base=0.05, cap=0.1),
            telemetry=otel.telemetry,
        )
        await asyncio.wait_for(worker.run(), 30)
        carried += [how.value for _, how in worker.carried]
        await asyncio.sleep(0.3)
    assert carried == ["retry", "finished"]
    assert airline.bookings == ["LH123"]
    taken = otel.points("tesserix.lease.takeovers")
    assert sum(p.value for p in taken) == 0


async def test_a_take_refused_as_held_elsewhere_counts_no_lease_takeover() -> None:
    otel, stores, airline = Pipeline(), _stores(), Airline()
    agent = booking_agent(airline)
    policy = LeasePolicy(ttl=0.3, renew_within=0.15)
    first = AgentRunner.from_stores(ScriptedProvider(list(BOOK_TURNS)), stores, lease_policy=policy)
    # A run dies; a plain resume (not a worker: its resume claim lasts 300 s) dies too,
    # inside the search, leaving its resume claim behind once its lease lapses.

    def die() -> None:
        raise SimulatedCrash("died searching")

    dying = booking_agent(airline, search_hook=die)
    with pytest.raises(SimulatedCrash):
        await first.run(dying, "book", tenant=T, run_id="r1")
    await asyncio.sleep(0.5)
    again = AgentRunner.from_stores(ScriptedProvider(list(BOOK_TURNS)), stores, lease_policy=policy)
    with pytest.raises(SimulatedCrash):
        await again.resume(dying, "r1", tenant=T)
    await asyncio.sleep(0.5)  # its lease lapsed; its resume claim did not
    worker = Worker(
        AgentRunner.from_stores(ScriptedProvider(list(BOOK_TURNS)), stores, lease_policy=policy),
        [agent],
        poll_interval=0.01,
        telemetry=otel.telemetry,
    )
    task = asyncio.create_task(worker.run())
    await asyncio.sleep(1.0)
    worker.drain()
    await asyncio.wait_for(task, 10)
    hows = [how.value for _, how in worker.carried]
    assert hows and set(hows) == {"elsewhere"}, hows  # never carried
    taken = otel.points("tesserix.lease.takeovers")
    assert sum(p.value for p in taken) == 0
