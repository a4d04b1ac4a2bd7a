"""An attacker's tries at the OpenAI and Anthropic provider adapters, over loopback.

The real ``openai`` and ``anthropic`` SDKs talk HTTP to the fake model server
(``fake_server.ModelServer``) or, where a reply has to be cut at a byte that is not a
character boundary, to a tiny byte-level server of this module. Nothing of an SDK is mocked.
A strict xfail is a defect found (its reason names what goes wrong and where); a plain test
is a promise that held.

Defects (each was a strict xfail; all are fixed since and their tests plain, but for a
boolean count on the SDK paths that hand it on as 1, where that case skips saying so):

1. A token count past a float's range (``1e999``, ``Infinity``) in a reply's usage raises a
   bare ``OverflowError`` out of ``runner.run``/``stream`` instead of ending the run
   ``failed`` (README guarantee 10): the adapters' ``int()`` (``openai._read_completion``,
   ``_StreamedReply.add``, ``anthropic._read_message``) overflows, and ``OverflowError`` is
   neither in ``_sdk.MALFORMED_REPLY`` nor handled by ``SDKProvider._stream_error``.
2. A NaN (or non-numeric) token count is a *retryable* ``ProviderError`` ("malformed
   completion") where README guarantee 10 says a token count that is not one ends the run
   ``failed`` and is not retried, "asking again would pay again": every resume or worker
   retry pays the vendor again and charges nothing.
3. A fractional or boolean token count (``10.9``, ``true``) is laundered by the adapters'
   ``int()`` into a whole count (10, 1): the call is charged *less* than the vendor reported
   and the run completes, where ``run.costs.paid`` refuses booleans and README guarantee 10
   says a token count that is not one ends the run ``failed``.
4. An Anthropic reply that stopped at ``max_tokens`` mid ``tool_use`` (non-streaming: the
   API hands back the incomplete block with the input it could parse) is dispatched as if
   whole: ``anthropic._read_message`` never looks at ``stop_reason``. A side-effecting call
   goes out with cut-off arguments ("never guesses"); the streaming path re-parses the raw
   input strictly for exactly this reason, the plain path has nothing equivalent.
5. The ``chat`` span's ``gen_ai.response.finish_reasons`` says ``stop`` for a reply the
   vendor ended with ``length``/``content_filter``/``max_tokens``/``refusal``: the adapters
   drop the vendor's finish reason and ``run/loop.py`` (``_asked``) makes one up from
   whether the message has calls; the run ends ``completed`` with a cut or empty answer
   and nothing says so.
6. With ``capture_content=True``, two calls of one reply sharing an id (which models do,
   as ``run/approvals.py`` notes) get each other's arguments on their ``execute_tool``
   spans: ``telemetry/spans.py`` keys ``_arguments`` by call id, so the second overwrites
   the first and the second span shows none.
7. A runner with telemetry streams every ``run()``/``resume()``: ``run/observing.py``
   (``observed``) sets ``attempt.events`` for the spans and ``run/loop.py`` (``_ask``)
   streams whenever events are heard, where README says ``run()`` calls the non-streaming
   endpoints. Switching telemetry on changes the wire: a server that never sends the stream
   usage chunk (the ``require_stream_usage`` case) then fails every run retryably.

Promises that held (plain tests): a negative or absurd (past 2**53) token count ends the
run ``failed`` uncharged and unretried; an API key no redaction pattern knows, echoed by a
401, a 500 and a mid-stream error event, reaches neither the error text, nor any store, nor
a log line; an overloaded (529) or rate-limited (429) model that outlasts the SDK's retries
stops the run retryably after the booking, and the resume books nothing twice and charges
exactly the answered calls; a tool name not among the agent's is answered, never run; a
stream split inside UTF-8 characters is assembled exactly; OpenAI calls streamed under one
index are never sent garbled or twice; two calls sharing an id are each sent once across a
crash and get their own results back; a budget met exactly stops before the next model
call and one micro more allows it; odd Anthropic content blocks (thinking, redacted
thinking, server tools, unknown types, a list as ``input``) neither crash the run nor send
anything.

Seen, and not called a defect because README documents it: a request the SDK retried by
itself after a read timeout, and a stream cut after its answer but before its usage, may
have been billed by the vendor and are charged nothing (the ledger only hears of calls
whose usage arrived).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import aclosing
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from tesserix_adk import (
    Agent,
    AgentRunner,
    Checkpointer,
    MemoryCheckpointStore,
    MemoryHistoryStore,
    MemoryIdempotencyStore,
    MemoryLeaseStore,
    MemoryLedger,
    Message,
    ModelRequest,
    ProviderError,
    RunStatus,
    tool,
)
from tesserix_adk.providers.anthropic import AnthropicProvider
from tesserix_adk.providers.openai import OpenAIProvider
from tesserix_adk.providers.pricing import Price
from tesserix_adk.run.events import RunEvent, RunFinished
from tesserix_adk.run.result import Run
from tesserix_adk.telemetry import Telemetry
from tesserix_adk.testing.faults import FaultyCheckpointStore, SimulatedCrash

from .fake_server import (
    SDK_ENVIRONMENT,
    ModelServer,
    Reply,
    anthropic_error,
    anthropic_message,
    anthropic_stream,
    openai_completion,
    openai_error,
    openai_stream,
)
from .vendors import SDKProvider, Vendor

NewProvider = Callable[..., SDKProvider]

# One micro per token in and out: a reply of 120 + 30 tokens costs 150 micros.
PRICE = Price(input_per_million_micros=1_000_000, output_per_million_micros=1_000_000)
PER_CALL = 150


class Bank:
    """The outside world: every transfer it was asked to make."""

    def __init__(self) -> None:
        self.transfers: list[dict[str, Any]] = []

    def agent(self, **kwargs: Any) -> Agent:
        @tool
        def transfer(amount: int, memo: str = "") -> str:
            """Send money (side-effecting)."""
            self.transfers.append({"amount": amount, "memo": memo})
            return f"sent {amount}"

        return Agent("bank", "Pay what the user asks.", [transfer], **kwargs)


class World:
    """One tenant's stores, shared by every "process" (runner) of a test."""

    def __init__(self) -> None:
        self.idempotency = MemoryIdempotencyStore()
        self.store = FaultyCheckpointStore(MemoryCheckpointStore())
        self.history = MemoryHistoryStore()
        self.leases = MemoryLeaseStore()
        self.ledger = MemoryLedger()

    def runner(self, provider: Any, **kwargs: Any) -> AgentRunner:
        return AgentRunner(
            provider,
            idempotency=self.idempotency,
            checkpoints=Checkpointer(self.store, history=self.history),
            leases=self.leases,
            ledger=self.ledger,
            **kwargs,
        )

    def every_byte(self) -> bytes:
        return b"".join(
            _every_byte([self.store, self.history, self.idempotency, self.leases, self.ledger])
        )


async def _run(runner: AgentRunner, agent: Agent, run_id: str, *, streamed: bool) -> Run:
    """``run()`` or ``stream()`` to its end: the ``Run`` either way."""
    if not streamed:
        return await runner.run(agent, "pay", tenant="acme", run_id=run_id)
    events: list[RunEvent] = []
    async with aclosing(runner.stream(agent, "pay", tenant="acme", run_id=run_id)) as stream:
        async for event in stream:
            events.append(event)
    last = events[-1]
    assert isinstance(last, RunFinished)
    return last.run


def _tampered_usage(vendor: Vendor, *, streamed: bool, output_tokens: str) -> Reply:
    """A final answer whose output-token count on the wire is ``output_tokens`` verbatim
    (JSON text: ``NaN``, ``1e999``, ``true``, ...)."""
    field = '"completion_tokens": 30' if vendor.name == "openai" else '"output_tokens": 30'
    wanted = field.replace("30", output_tokens)
    if streamed:
        frames = list(vendor.streamed("Paid.").events)
        changed = [f.replace(field, wanted) for f in frames]
        assert changed != frames  # the usage event is there to tamper with
        return Reply(events=changed)
    body = json.dumps(vendor.turn("Paid."))
    assert field in body
    return Reply(body=body.replace(field, wanted))


MODES = pytest.mark.parametrize("streamed", [False, True], ids=["plain", "streamed"])


# --- usage numbers a provider answers (README guarantee 10) --------------------------------


@MODES
@pytest.mark.parametrize("tokens", ["1e999", "Infinity"])
async def test_a_token_count_past_a_float_ends_the_run_failed_not_an_untyped_overflow(
    vendor: Vendor,
    model_server: ModelServer,
    new_provider: NewProvider,
    streamed: bool,
    tokens: str,
) -> None:
    bank, world = Bank(), World()
    model_server.queue(_tampered_usage(vendor, streamed=streamed, output_tokens=tokens))
    runner = world.runner(new_provider(prices=PRICE, max_retries=0))
    run = await _run(runner, bank.agent(), "r1", streamed=streamed)
    assert run.status is RunStatus.failed
    assert await world.ledger.spent("acme", "r1") == 0
    assert len(model_server.requests) == 1


@MODES
@pytest.mark.parametrize("tokens", ["NaN", '"many"'], ids=["nan", "text"])
async def test_a_token_count_that_is_not_a_number_ends_the_run_failed_not_asked_again(
    vendor: Vendor,
    model_server: ModelServer,
    new_provider: NewProvider,
    streamed: bool,
    tokens: str,
) -> None:
    bank, world = Bank(), World()
    model_server.queue(_tampered_usage(vendor, streamed=streamed, output_tokens=tokens))
    runner = world.runner(new_provider(prices=PRICE, max_retries=0))
    run = await _run(runner, bank.agent(), "r1", streamed=streamed)
    assert run.status is RunStatus.failed


@MODES
@pytest.mark.parametrize("tokens", ["10.9", "true"], ids=["fraction", "boolean"])
async def test_a_fractional_or_boolean_token_count_is_refused_not_rounded_down(
    vendor: Vendor,
    model_server: ModelServer,
    new_provider: NewProvider,
    streamed: bool,
    tokens: str,
) -> None:
    if tokens == "true" and (vendor.name == "openai" or streamed):
        # Not the kit's to see: these SDK paths hand ``true`` on to the adapter as the int 1.
        pytest.skip("the SDK itself reads a boolean count as 1 before the adapter sees it")
    bank, world = Bank(), World()
    model_server.queue(_tampered_usage(vendor, streamed=streamed, output_tokens=tokens))
    runner = world.runner(new_provider(prices=PRICE, max_retries=0))
    run = await _run(runner, bank.agent(), "r1", streamed=streamed)
    assert (run.status, await world.ledger.spent("acme", "r1")) == (RunStatus.failed, 0)


@MODES
@pytest.mark.parametrize("tokens", ["-5", str(2**70)], ids=["negative", "past-2**53"])
async def test_a_negative_or_absurd_token_count_ends_the_run_failed_uncharged_and_unretried(
    vendor: Vendor,
    model_server: ModelServer,
    new_provider: NewProvider,
    streamed: bool,
    tokens: str,
) -> None:
    bank, world = Bank(), World()
    model_server.queue(_tampered_usage(vendor, streamed=streamed, output_tokens=tokens))
    runner = world.runner(new_provider(prices=PRICE, max_retries=0))
    run = await _run(runner, bank.agent(), "r1", streamed=streamed)
    assert run.status is RunStatus.failed
    assert "ledger cannot charge" in (run.output or "")
    assert await world.ledger.spent("acme", "r1") == 0  # never lowered, never a refund
    assert len(model_server.requests) == 1  # not asked again: that would pay again


# --- finish reasons ------------------------------------------------------------------------


async def test_anthropic_tool_use_cut_off_by_max_tokens_is_never_sent(
    model_server: ModelServer,
) -> None:
    # The model was writing {"amount": 1000} when max_tokens cut it at {"amount": 10: the
    # Messages API hands back the incomplete tool_use block with the input it could parse
    # and stop_reason "max_tokens" (Anthropic's docs: retry with a higher max_tokens).
    bank, world = Bank(), World()
    body = anthropic_message(None, [("toolu_1", "transfer", {"amount": 10})])
    body["stop_reason"] = "max_tokens"
    model_server.queue(body, anthropic_message("Stopped."))
    provider = _anthropic(model_server)
    try:
        await world.runner(provider).run(bank.agent(), "pay 1000", tenant="acme", run_id="r1")
    except ProviderError:
        pass  # refusing the cut-off reply is fine too; sending it is not
    finally:
        await provider.aclose()
    assert bank.transfers == []


@MODES
async def test_a_reply_cut_off_at_its_token_limit_has_its_calls_refused_and_told(
    vendor: Vendor, model_server: ModelServer, new_provider: NewProvider, streamed: bool
) -> None:
    """Both vendors, plain and streamed: calls whose arguments read whole, in a reply the
    vendor ended for want of tokens, are answered "not sent" saying why, and the run goes
    on (the model may ask again, shorter)."""
    field, whole, cut = (
        ("finish_reason", "tool_calls", "length")
        if vendor.name == "openai"
        else ("stop_reason", "tool_use", "max_tokens")
    )
    whole, cut = f'"{field}": "{whole}"', f'"{field}": "{cut}"'
    calls = [("call_1", "transfer", {"amount": 10})]
    if streamed:
        frames = [f.replace(whole, cut) for f in vendor.streamed(None, calls).events]
        assert any(cut in f for f in frames)
        model_server.queue(Reply(events=frames), vendor.streamed("Stopped."))
    else:
        body = json.dumps(vendor.turn(None, calls)).replace(whole, cut)
        assert cut in body
        model_server.queue(Reply(body=body), vendor.turn("Stopped."))
    bank, world = Bank(), World()
    runner = world.runner(new_provider(prices=PRICE, max_retries=0))
    run = await _run(runner, bank.agent(), "r1", streamed=streamed)
    assert (run.status, bank.transfers) == (RunStatus.completed, [])
    told, _ = vendor.tool_results(model_server.bodies[1])["call_1"]
    assert "not sent" in told and "cut off" in told, told


FINISH_REASONS = [
    ("openai", "length", "The answer is"),
    ("openai", "content_filter", None),
    ("anthropic", "max_tokens", "The answer is"),
    ("anthropic", "refusal", None),
]


@pytest.mark.parametrize(
    ("vendor_name", "reason", "text"), FINISH_REASONS, ids=[r[1] for r in FINISH_REASONS]
)
async def test_the_chat_span_reports_the_vendors_finish_reason(
    model_server: ModelServer, vendor_name: str, reason: str, text: str | None
) -> None:
    provider: SDKProvider
    if vendor_name == "openai":
        frames = [
            f.replace('"finish_reason": "stop"', f'"finish_reason": "{reason}"')
            for f in openai_stream(text)
        ]
        provider = _openai(model_server)
    else:
        frames = [
            f.replace('"stop_reason": "end_turn"', f'"stop_reason": "{reason}"')
            for f in anthropic_stream(text)
        ]
        provider = _anthropic(model_server)
    assert any(reason in f for f in frames)
    model_server.queue(Reply(events=frames))
    exporter = InMemorySpanExporter()
    traces = TracerProvider()
    traces.add_span_processor(SimpleSpanProcessor(exporter))
    runner = World().runner(provider, telemetry=Telemetry(tracer_provider=traces))
    try:
        run = await _run(runner, Bank().agent(), "r1", streamed=True)
    finally:
        await provider.aclose()
    assert run.status is RunStatus.completed  # the run took the answer as it came...
    (chat,) = [s for s in exporter.get_finished_spans() if s.name.startswith("chat")]
    assert chat.attributes is not None
    # ...and its span says why the vendor stopped.
    assert tuple(chat.attributes["gen_ai.response.finish_reasons"]) == (reason,)


async def test_twin_ids_each_show_their_own_arguments_on_their_tool_spans(
    model_server: ModelServer,
) -> None:
    twins = [("call_1", "transfer", {"amount": 1}), ("call_1", "transfer", {"amount": 2})]
    model_server.queue(
        Reply(events=openai_stream(None, twins)), Reply(events=openai_stream("Paid twice."))
    )
    exporter = InMemorySpanExporter()
    traces = TracerProvider()
    traces.add_span_processor(SimpleSpanProcessor(exporter))
    provider = _openai(model_server)
    bank = Bank()
    runner = World().runner(
        provider, telemetry=Telemetry(tracer_provider=traces, capture_content=True)
    )
    try:
        run = await _run(runner, bank.agent(), "r1", streamed=True)
    finally:
        await provider.aclose()
    assert run.status is RunStatus.completed and [t["amount"] for t in bank.transfers] == [1, 2]
    tools = sorted(
        (s for s in exporter.get_finished_spans() if s.name.startswith("execute_tool")),
        key=lambda s: s.start_time or 0,
    )
    shown = [
        json.loads(str((s.attributes or {}).get("gen_ai.tool.call.arguments", "null")))
        for s in tools
    ]
    assert shown == [{"amount": 1}, {"amount": 2}]


async def test_run_with_telemetry_still_calls_the_plain_endpoint(
    model_server: ModelServer,
) -> None:
    model_server.queue(openai_completion("Hello."))
    provider = _openai(model_server)
    traces = TracerProvider()
    traces.add_span_processor(SimpleSpanProcessor(InMemorySpanExporter()))
    runner = World().runner(provider, telemetry=Telemetry(tracer_provider=traces))
    try:
        await runner.run(Bank().agent(), "hi", tenant="acme", run_id="r1")
    except ProviderError:
        pass  # what a streamed call makes of a plain answer; the request says why
    finally:
        await provider.aclose()
    assert "stream" not in model_server.bodies[0]


# --- secrets in error bodies ----------------------------------------------------------------

# A key no built-in redaction pattern knows: only the provider's own scrubbing keeps it out.
UNKNOWN_SHAPE_KEY = "tsx-local-Q7f9Zk2LmN4pR8sTwV3y"


def _echoing_stream_error(vendor: Vendor) -> Reply:
    frames = list(vendor.streamed("Hello there, I am").events[:3])
    if vendor.name == "openai":
        error = {"error": {"message": f"bad key {UNKNOWN_SHAPE_KEY}", "type": "server_error"}}
        frames.append(f"data: {json.dumps(error)}\n\n")
    else:
        error = {
            "type": "error",
            "error": {"type": "overloaded_error", "message": f"bad key {UNKNOWN_SHAPE_KEY}"},
        }
        frames.append(f"event: error\ndata: {json.dumps(error)}\n\n")
    return Reply(events=frames)


@pytest.mark.parametrize("where", ["status-500", "status-401", "mid-stream"])
async def test_an_api_key_echoed_by_the_server_reaches_no_error_store_or_log(
    vendor: Vendor,
    model_server: ModelServer,
    new_provider: NewProvider,
    caplog: pytest.LogCaptureFixture,
    where: str,
) -> None:
    caplog.set_level(logging.DEBUG, logger="tesserix_adk")
    bank, world = Bank(), World()
    message = f"Incorrect API key provided: {UNKNOWN_SHAPE_KEY}"
    if where == "mid-stream":
        model_server.queue(_echoing_stream_error(vendor))
    else:
        model_server.queue(vendor.error(int(where[-3:]), message))
    runner = world.runner(new_provider(api_key=UNKNOWN_SHAPE_KEY, max_retries=0))
    texts: list[str] = []
    try:
        run = await _run(runner, bank.agent(), "r1", streamed=where == "mid-stream")
        texts.append(run.output or "")
        assert run.status is RunStatus.failed and where == "status-401"
    except ProviderError as exc:
        assert exc.retryable and where != "status-401"
        texts.append(str(exc))
    assert UNKNOWN_SHAPE_KEY in " ".join(
        vendor.key_headers(r.headers) for r in model_server.requests
    )  # it was sent, and echoed...
    assert "[redacted:api_key]" in " ".join(texts)  # ...and masked where it came back
    assert UNKNOWN_SHAPE_KEY not in " ".join(texts)
    assert UNKNOWN_SHAPE_KEY.encode() not in world.every_byte()
    kit_lines = [r.getMessage() for r in caplog.records if r.name.startswith("tesserix_adk")]
    assert kit_lines or where != "status-401"  # the runner logs the run's failure...
    assert not [line for line in kit_lines if UNKNOWN_SHAPE_KEY in line]  # ...masked


# --- transient failures: the documented state, nothing twice --------------------------------


async def test_a_model_overloaded_past_the_sdks_retries_stops_retryably_and_books_once(
    vendor: Vendor, model_server: ModelServer, new_provider: NewProvider
) -> None:
    bank, world = Bank(), World()
    busy = (
        openai_error(429, "Rate limit reached", "rate_limit_error")
        if vendor.name == "openai"
        else anthropic_error(529, "Overloaded", "overloaded_error")
    )
    model_server.queue(
        vendor.turn(calls=[("call_1", "transfer", {"amount": 70})]), busy, busy, busy
    )
    with pytest.raises(ProviderError) as err:
        await world.runner(new_provider(prices=PRICE, max_retries=2)).run(
            bank.agent(), "pay", tenant="acme", run_id="r1"
        )
    assert err.value.retryable is True
    assert err.value.status_code == (429 if vendor.name == "openai" else 529)
    assert len(model_server.requests) == 4  # one answer, then the SDK's 1 + 2 retries
    assert [t["amount"] for t in bank.transfers] == [70]
    assert await world.ledger.spent("acme", "r1") == PER_CALL  # the one answered call

    model_server.queue(vendor.turn("Sent 70."))
    run = await world.runner(new_provider(prices=PRICE)).resume(bank.agent(), "r1", tenant="acme")
    assert (run.status, run.output) == (RunStatus.completed, "Sent 70.")
    assert [t["amount"] for t in bank.transfers] == [70]  # not sent again
    assert await world.ledger.spent("acme", "r1") == 2 * PER_CALL
    content, is_error = vendor.tool_results(model_server.bodies[-1])["call_1"]
    assert "sent 70" in content and not is_error


# --- what the model asks for ----------------------------------------------------------------


@MODES
async def test_a_tool_the_agent_does_not_have_is_answered_never_run(
    vendor: Vendor, model_server: ModelServer, new_provider: NewProvider, streamed: bool
) -> None:
    bank, world = Bank(), World()
    ask = ("call_x", "wire_money", {"amount": 900})
    if streamed:
        model_server.queue(vendor.streamed(calls=[ask]), vendor.streamed("I cannot."))
    else:
        model_server.queue(vendor.turn(calls=[ask]), vendor.turn("I cannot."))
    run = await _run(
        world.runner(new_provider(max_retries=0)), bank.agent(), "r1", streamed=streamed
    )
    assert (run.status, run.output) == (RunStatus.completed, "I cannot.")
    assert bank.transfers == []
    content, is_error = vendor.tool_results(model_server.bodies[-1])["call_x"]
    assert is_error and "wire_money" in content


async def test_two_calls_sharing_an_id_are_each_sent_once_across_a_crash(
    vendor: Vendor, model_server: ModelServer, new_provider: NewProvider
) -> None:
    bank, world = Bank(), World()
    twins = [("call_1", "transfer", {"amount": 1}), ("call_1", "transfer", {"amount": 2})]
    model_server.queue(vendor.turn(calls=twins), vendor.turn("Paid 1 and 2."))
    # Both calls ran; the process dies before the turn's after_tool_result frontier.
    world.store.crash_before = lambda body: body.get("boundary") == "after_tool_result"
    with pytest.raises(SimulatedCrash):
        await world.runner(new_provider(max_retries=0)).run(
            bank.agent(), "pay", tenant="acme", run_id="r1"
        )
    world.store.crash_before = None
    run = await world.runner(new_provider(max_retries=0)).resume(bank.agent(), "r1", tenant="acme")
    assert (run.status, run.output) == (RunStatus.completed, "Paid 1 and 2.")
    assert [t["amount"] for t in bank.transfers] == [1, 2]  # each once, none twice
    # The replayed outcomes reach the model in its order, each under the call it answers.
    assert _result_texts(vendor, model_server.bodies[-1]) == ["sent 1", "sent 2"]


async def test_openai_calls_streamed_under_one_index_are_never_sent_garbled_or_twice(
    model_server: ModelServer,
) -> None:
    # Some OpenAI-compatible servers stream every call at index 0, each with its own id.
    frames = openai_stream(
        None, [("call_1", "transfer", {"amount": 1}), ("call_2", "transfer", {"amount": 2})]
    )
    frames = [f.replace('"index": 1', '"index": 0') for f in frames]
    model_server.queue(Reply(events=frames), Reply(events=openai_stream("Done.")))
    bank, world = Bank(), World()
    provider = _openai(model_server)
    try:
        run = await _run(world.runner(provider), bank.agent(), "r1", streamed=True)
    finally:
        await provider.aclose()
    assert run.status is RunStatus.completed
    amounts = [t["amount"] for t in bank.transfers]
    assert amounts in ([], [1, 2])  # refused, or both as asked: never merged, never twice


async def test_odd_anthropic_content_blocks_neither_crash_the_run_nor_send_anything(
    model_server: ModelServer,
) -> None:
    body = anthropic_message("ignored")
    body["content"] = [
        {"type": "thinking", "thinking": "hmm", "signature": "c2ln"},
        {"type": "redacted_thinking", "data": "ZW5jcnlwdGVk"},
        {"type": "server_tool_use", "id": "srvtoolu_1", "name": "web_search", "input": {}},
        {"type": "text", "text": "Let me pay."},
        {"type": "tool_use", "id": "toolu_1", "name": "transfer", "input": [1000]},
        {"type": "some_future_block", "payload": {"x": 1}},
    ]
    body["stop_reason"] = "tool_use"
    model_server.queue(body, anthropic_message("I need the amount as an object."))
    bank, world = Bank(), World()
    provider = _anthropic(model_server)
    try:
        run = await world.runner(provider).run(bank.agent(), "pay", tenant="acme", run_id="r1")
    finally:
        await provider.aclose()
    assert (run.status, run.output) == (RunStatus.completed, "I need the amount as an object.")
    assert bank.transfers == []
    sent_back = model_server.bodies[-1]["messages"]
    assert [b["type"] for b in sent_back[1]["content"]] == ["text", "tool_use"]
    assert sent_back[2]["content"][0]["is_error"] is True


# --- the budget at its boundary --------------------------------------------------------------


@pytest.mark.parametrize(("budget", "model_calls"), [(PER_CALL, 1), (PER_CALL + 1, 2)])
async def test_a_budget_met_exactly_stops_before_the_next_model_call(
    vendor: Vendor,
    model_server: ModelServer,
    new_provider: NewProvider,
    budget: int,
    model_calls: int,
) -> None:
    bank, world = Bank(), World()
    model_server.queue(
        vendor.turn(calls=[("call_1", "transfer", {"amount": 5})]), vendor.turn("Sent 5.")
    )
    run = await world.runner(new_provider(prices=PRICE, max_retries=0)).run(
        bank.agent(budget_micros=budget), "pay", tenant="acme", run_id="r1"
    )
    assert len(model_server.requests) == model_calls
    assert run.status is (RunStatus.budget_exhausted if model_calls == 1 else RunStatus.completed)
    assert await world.ledger.spent("acme", "r1") == model_calls * PER_CALL
    assert [t["amount"] for t in bank.transfers] == [5]  # the turn paid for is carried out


# --- a stream split inside UTF-8 characters ---------------------------------------------------

TEXT = "Grüße aus 東京 🎉, done"
MEMO = "café → 東京 🎉"


class _ByteServer:
    """Serves one queued byte stream per request, written in the given pieces (flushed
    one by one), so a character can be cut between two TCP writes."""

    def __init__(self, pieces: Sequence[bytes]) -> None:
        self.pieces = list(pieces)
        self.bodies: list[dict[str, Any]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"

            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers.get("content-length") or 0))
                outer.bodies.append(json.loads(raw))
                self.send_response(200)
                self.send_header("content-type", "text/event-stream")
                self.end_headers()
                for piece in outer.pieces:
                    self.wfile.write(piece)
                    self.wfile.flush()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(
            target=self.http.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
        )
        self.thread.start()

    @property
    def url(self) -> str:
        host, port = self.http.server_address[:2]
        return f"http://{host!s}:{port}"

    def stop(self) -> None:
        self.http.shutdown()
        self.http.server_close()
        self.thread.join(timeout=5)


def _mid_character_pieces(frames: Sequence[str]) -> list[bytes]:
    """The stream's bytes, cut right after the first byte of every multi-byte character
    (and at no other place)."""
    data = "".join(frames).encode("utf-8")
    pieces, start = [], 0
    for i, byte in enumerate(data):
        if byte >= 0xC0:  # a lead byte: cut right after it, inside the character
            pieces.append(data[start : i + 1])
            start = i + 1
    pieces.append(data[start:])
    assert len(pieces) > 5
    return pieces


@pytest.mark.parametrize("vendor_name", ["openai", "anthropic"])
async def test_a_stream_cut_inside_utf8_characters_is_assembled_exactly(
    vendor_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in SDK_ENVIRONMENT:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("ANTHROPIC_CONFIG_DIR", "/nonexistent/tesserix-adk-tests")
    # Raw UTF-8 on the wire, in the events and in the arguments' JSON text inside them.
    arguments = json.dumps({"amount": 3, "memo": MEMO}, ensure_ascii=False)
    build = openai_stream if vendor_name == "openai" else anthropic_stream
    wire = []
    for frame in build(TEXT, [("call_1", "transfer", arguments)], pieces=4):
        head, sep, body = frame.partition("data: ")
        if body.startswith("{"):
            body = json.dumps(json.loads(body), ensure_ascii=False) + "\n\n"
        wire.append(head + sep + body)
    server = _ByteServer(_mid_character_pieces(wire))
    provider: SDKProvider
    if vendor_name == "openai":
        provider = OpenAIProvider(
            "gpt-4o", base_url=server.url + "/v1", api_key="k", max_retries=0, timeout=5.0
        )
    else:
        provider = AnthropicProvider(
            "claude-haiku-4-5", base_url=server.url, api_key="k", max_retries=0, timeout=5.0
        )
    heard: list[str] = []
    try:
        response = await provider.complete_streaming(
            ModelRequest(agent_name="bank", instructions="x", messages=(Message.user("pay"),)),
            heard.append,
        )
    finally:
        await provider.aclose()
        server.stop()
    assert response.message.text == TEXT == "".join(heard)
    (asked,) = response.message.tool_calls
    assert dict(asked.arguments) == {"amount": 3, "memo": MEMO}
    assert (response.usage.input_tokens, response.usage.output_tokens) == (120, 30)


# --- helpers ----------------------------------------------------------------------------------


def _openai(server: ModelServer) -> OpenAIProvider:
    return OpenAIProvider(
        "openai:gpt-4o",
        base_url=server.url + "/v1",
        api_key="test-key",
        max_retries=0,
        timeout=5.0,
        prices=PRICE,
    )


def _anthropic(server: ModelServer) -> AnthropicProvider:
    return AnthropicProvider(
        "anthropic:claude-haiku-4-5",
        base_url=server.url,
        api_key="test-key",
        max_retries=0,
        timeout=5.0,
        prices=PRICE,
    )


def _result_texts(vendor: Vendor, body: dict[str, Any]) -> list[str]:
    """The tool results a request carries, in its order (ids may repeat)."""
    if vendor.name == "openai":
        return [m["content"] for m in body["messages"] if m["role"] == "tool"]
    return [
        b["content"]
        for m in body["messages"]
        if m["role"] == "user" and isinstance(m["content"], list)
        for b in m["content"]
        if b["type"] == "tool_result"
    ]


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
