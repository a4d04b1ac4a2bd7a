"""Attacks on two features: streaming (``AgentRunner.stream``, the providers'
``complete_streaming``) and the MCP toolset (``tesserix_adk.mcp``).

Real SDKs against the fake model server on loopback (``providers.fake_server``), and real
MCP servers over stdio: the kit's test server and a hostile one speaking raw JSON-RPC
(``attack_mcp_server.py``). A strict xfail is a defect found (its reason says which); a
plain test is a promise that held.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import aclosing
from pathlib import Path
from typing import Any

import pytest

from mcp_tools.servers import Effects, JsonHttpHandler, QuietHTTPServer, stdio
from providers.fake_server import (
    ModelServer,
    Reply,
    anthropic_stream,
    openai_stream,
)
from tesserix_adk import (
    Agent,
    AgentRunner,
    Checkpointer,
    ConfigurationError,
    MemoryCheckpointStore,
    MemoryHistoryStore,
    MemoryIdempotencyStore,
    MemoryLeaseStore,
    MemoryLedger,
    Message,
    ModelRequest,
    ProviderError,
    ScriptedProvider,
    tool,
)
from tesserix_adk.errors import AdkError, IndeterminateToolCallError, ToolOutcomeUnknownError
from tesserix_adk.mcp import MCPToolset
from tesserix_adk.mcp.errors import (
    MCPError,
    MCPReplyLostError,
    MCPToolError,
    MCPUnavailableError,
)
from tesserix_adk.providers.anthropic import AnthropicProvider
from tesserix_adk.providers.openai import OpenAIProvider
from tesserix_adk.providers.pricing import Price
from tesserix_adk.run.events import RunEvent, RunFinished, ToolCallStarted

HOSTILE = str(Path(__file__).with_name("attack_mcp_server.py"))
PRICE = Price(input_per_million_micros=1_000_000, output_per_million_micros=2_000_000)


@pytest.fixture
async def openai(model_server: ModelServer) -> AsyncIterator[OpenAIProvider]:
    provider = OpenAIProvider(
        "openai:gpt-4o",
        base_url=model_server.url + "/v1",
        api_key="test-key",
        max_retries=0,
        timeout=5.0,
        prices={"gpt-4o": PRICE},
    )
    yield provider
    await provider.aclose()


@pytest.fixture
async def anthropic(model_server: ModelServer) -> AsyncIterator[AnthropicProvider]:
    provider = AnthropicProvider(
        "anthropic:claude-haiku-4-5",
        base_url=model_server.url,
        api_key="test-key",
        max_retries=0,
        timeout=5.0,
        prices={"claude-haiku-4-5": PRICE},
    )
    yield provider
    await provider.aclose()


def _request() -> ModelRequest:
    return ModelRequest(agent_name="bank", instructions="x", messages=(Message.user("pay"),))


class Bank:
    """The outside world: every transfer it was asked to make."""

    def __init__(self) -> None:
        self.transfers: list[dict[str, Any]] = []

    def agent(self) -> Agent:
        @tool
        def transfer(amount: int, memo: str = "") -> str:
            """Send money (side-effecting)."""
            self.transfers.append({"amount": amount, "memo": memo})
            return f"sent {amount}"

        return Agent("bank", "Pay what the user asks.", [transfer])


class World:
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


async def _drain(stream: AsyncIterator[RunEvent]) -> list[RunEvent]:
    out: list[RunEvent] = []
    async with aclosing(stream) as events:
        async for event in events:
            out.append(event)
    return out


# --- streaming: tool-call arguments -------------------------------------------------------


@pytest.mark.parametrize(
    "partial_json",
    ['{"amount": 10', '{"amount": 1, "memo": "rent for ma', '{"amount": 1} {"amount": 900}'],
    ids=["number-cut", "string-cut", "trailing-junk"],
)
async def test_anthropic_streamed_arguments_that_are_not_one_json_object_are_not_sent(
    model_server: ModelServer, anthropic: AnthropicProvider, partial_json: str
) -> None:
    bank, world = Bank(), World()
    frames = anthropic_stream(None, [("toolu_1", "transfer", partial_json)])
    model_server.queue(Reply(events=frames), Reply(events=anthropic_stream("done")))
    with contextlib.suppress(ProviderError):
        await _drain(world.runner(anthropic).stream(bank.agent(), "pay", tenant="t", run_id="r"))
    # Either a typed error or a refused malformed call; never a transfer the model did
    # not ask for in full.
    assert bank.transfers == []


async def test_openai_streamed_arguments_cut_short_are_refused_not_sent(
    model_server: ModelServer, openai: OpenAIProvider
) -> None:
    bank, world = Bank(), World()
    frames = openai_stream(None, [("call_1", "transfer", '{"amount": 10')])
    model_server.queue(Reply(events=frames), Reply(events=openai_stream("ok, stopping")))
    events = await _drain(world.runner(openai).stream(bank.agent(), "pay", tenant="t", run_id="r"))
    assert isinstance(events[-1], RunFinished)
    assert bank.transfers == []


def _oa_chunk(delta: dict[str, Any] | None, finish: str | None = None, **extra: Any) -> str:
    body = {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "gpt-4o-2024-08-06",
        "choices": []
        if delta is None
        else [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
        "usage": None,
        **extra,
    }
    return f"data: {json.dumps(body)}\n\n"


def _frag(index: int, arguments: str, *, call_id: str | None = None, name: str = "") -> str:
    fragment: dict[str, Any] = {"index": index, "function": {"arguments": arguments}}
    if call_id is not None:
        fragment.update(id=call_id, type="function")
        fragment["function"]["name"] = name
    return _oa_chunk({"tool_calls": [fragment]})


async def test_openai_parallel_calls_interleaved_by_index_are_assembled_each_whole(
    model_server: ModelServer, openai: OpenAIProvider
) -> None:
    """Fragments of two calls arrive interleaved, a key split across chunks, and index 1
    announced before index 0 finishes; each call's arguments come out whole and in index
    order."""
    frames = [
        _oa_chunk({"role": "assistant", "content": None}),
        _frag(1, "", call_id="call_b", name="transfer"),
        _frag(0, '{"amo', call_id="call_a", name="transfer"),
        _frag(1, '{"amount": 2'),
        _frag(0, 'unt": 1'),
        _frag(1, '00, "memo": "b\\u00e9"}'),
        _frag(0, "}"),
        _oa_chunk({}, "tool_calls"),
        _oa_chunk(None, usage={"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}),
        "data: [DONE]\n\n",
    ]
    model_server.queue(Reply(events=frames))
    response = await openai.complete_streaming(_request(), lambda _: None)
    calls = [(c.id, c.name, dict(c.arguments)) for c in response.message.tool_calls]
    assert calls == [
        ("call_a", "transfer", {"amount": 1}),
        ("call_b", "transfer", {"amount": 200, "memo": "bé"}),
    ]
    assert (response.usage.input_tokens, response.usage.output_tokens) == (7, 3)


async def test_anthropic_input_json_delta_pieces_are_assembled_whole(
    model_server: ModelServer, anthropic: AnthropicProvider
) -> None:
    args = {"amount": 300, "memo": 'a "quoted" memo, split in many pieces'}
    frames = anthropic_stream(
        "Paying.", [("toolu_a", "transfer", args), ("toolu_b", "transfer", {"amount": 1})], pieces=9
    )
    model_server.queue(Reply(events=frames))
    response = await anthropic.complete_streaming(_request(), lambda _: None)
    assert [dict(c.arguments) for c in response.message.tool_calls] == [args, {"amount": 1}]


# --- streaming: malformed and truncated streams -----------------------------------------------


_BAD_OPENAI = {
    "not-json": ["data: {not json\n\n"],
    "choice-without-delta": [
        'data: {"id":"x","object":"chat.completion.chunk","created":1,"model":"m",'
        '"choices":[{"index":0,"finish_reason":"stop"}]}\n\n',
        "data: [DONE]\n\n",
    ],
    "choices-null": [
        'data: {"id":"x","object":"chat.completion.chunk","created":1,"model":"m",'
        '"choices":null}\n\n',
        "data: [DONE]\n\n",
    ],
    "call-index-null": [
        _oa_chunk({"tool_calls": [{"index": None, "id": "c", "function": {"name": "t"}}]}),
        _oa_chunk({}, "tool_calls"),
        "data: [DONE]\n\n",
    ],
    "call-without-id": [_frag(0, "{}"), _oa_chunk({}, "tool_calls"), "data: [DONE]\n\n"],
    "no-finish": [_oa_chunk({"content": "half an ans"}), "data: [DONE]\n\n"],
}


@pytest.mark.parametrize("frames", list(_BAD_OPENAI.values()), ids=list(_BAD_OPENAI))
async def test_a_malformed_openai_stream_is_a_retryable_provider_error(
    model_server: ModelServer, openai: OpenAIProvider, frames: list[str]
) -> None:
    model_server.queue(Reply(events=frames))
    with pytest.raises(ProviderError) as caught:
        await asyncio.wait_for(openai.complete_streaming(_request(), lambda _: None), 20)
    assert caught.value.retryable


def _an_unknown_index() -> list[str]:
    frames = anthropic_stream("hello")
    bad = (
        'event: content_block_delta\ndata: {"type":"content_block_delta","index":5,'
        '"delta":{"type":"text_delta","text":"x"}}\n\n'
    )
    return [*frames[:1], bad, *frames[1:]]


@pytest.mark.parametrize(
    "frames",
    [["event: message_start\ndata: {bad\n\n"], _an_unknown_index(), anthropic_stream("hi")[:-1]],
    ids=["not-json", "delta-for-unknown-block", "no-message-stop"],
)
async def test_a_malformed_anthropic_stream_is_a_retryable_provider_error(
    model_server: ModelServer, anthropic: AnthropicProvider, frames: list[str]
) -> None:
    model_server.queue(Reply(events=frames))
    with pytest.raises(ProviderError) as caught:
        await asyncio.wait_for(anthropic.complete_streaming(_request(), lambda _: None), 20)
    assert caught.value.retryable


# --- streaming: usage from the final chunk ------------------------------------------------


async def test_openai_stream_ending_before_its_usage_chunk_is_not_taken_as_whole(
    model_server: ModelServer, openai: OpenAIProvider
) -> None:
    world = World()
    frames = openai_stream("All paid.", usage=(5000, 1000))
    model_server.queue(Reply(events=frames[:-2]))  # no usage chunk, no [DONE]; clean close
    try:
        events = await _drain(
            world.runner(openai).stream(Bank().agent(), "pay", tenant="t", run_id="r")
        )
    except ProviderError as exc:
        assert exc.retryable  # cut short: ask again, as any other cut stream
        return
    assert isinstance(events[-1], RunFinished)
    assert await world.ledger.spent("t", "r") > 0


async def test_anthropic_stream_without_its_message_delta_is_not_taken_as_whole(
    model_server: ModelServer, anthropic: AnthropicProvider
) -> None:
    frames = anthropic_stream("All paid.", usage=(100, 4000))
    model_server.queue(Reply(events=frames[:-2] + frames[-1:]))  # message_delta dropped
    try:
        response = await anthropic.complete_streaming(_request(), lambda _: None)
    except ProviderError as exc:
        assert exc.retryable
        return
    assert response.usage.output_tokens == 4000


async def test_streamed_usage_and_cost_reach_the_ledger_for_both_vendors(
    model_server: ModelServer, openai: OpenAIProvider, anthropic: AnthropicProvider
) -> None:
    for provider, frames in (
        (openai, openai_stream("ok", usage=(1000, 10))),
        (anthropic, anthropic_stream("ok", usage=(1000, 10))),
    ):
        world = World()
        model_server.queue(Reply(events=frames))
        await _drain(world.runner(provider).stream(Bank().agent(), "pay", tenant="t", run_id="r"))
        assert await world.ledger.spent("t", "r") == 1000 + 20


# --- streaming: a consumer that goes away ---------------------------------------------------


async def test_a_cancelled_consumer_lets_go_of_the_run_at_once_and_nothing_runs_twice() -> None:
    """The consumer's own task is cancelled mid-stream (not aclose): the run stops, its
    lease is free for an immediate resume, and the transfer made before is not made again."""
    bank, world = Bank(), World()
    turns: list[Any] = [[("transfer", {"amount": 5})], "Sent five, and here is a long answer."]
    agent = bank.agent()
    reached = asyncio.Event()

    async def consume() -> None:
        async with aclosing(
            world.runner(ScriptedProvider(turns)).stream(agent, "pay", tenant="t", run_id="r")
        ) as events:
            async for event in events:
                if bank.transfers and type(event).__name__ == "TextDelta":
                    reached.set()
                    await asyncio.sleep(3600)

    task = asyncio.create_task(consume())
    await asyncio.wait_for(reached.wait(), 20)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    run = await world.runner(ScriptedProvider(turns)).resume(agent, "r", tenant="t")
    assert run.status.value == "completed"
    assert bank.transfers == [{"amount": 5, "memo": ""}]


# --- MCP: hostile servers -------------------------------------------------------------------


def _hostile(mode: str, tmp: Path, *, call_timeout: float | None = 1.0, **env: str) -> MCPToolset:
    return MCPToolset.stdio(
        sys.executable,
        [HOSTILE],
        env={"ATTACK_MODE": mode, "ATTACK_CALLS": str(tmp / "calls.jsonl"), **env},
        call_timeout=call_timeout,
    )


class Seeing(ScriptedProvider):
    """A scripted model that keeps the last request it was asked."""

    last: ModelRequest

    async def complete(self, request: ModelRequest) -> Any:
        self.last = request
        return await super().complete(request)


def _calls(tmp: Path) -> list[dict[str, Any]]:
    path = tmp / "calls.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("mode", ["silent", "deep"])
async def test_a_server_that_never_answers_the_connection_fails_typed_by_default(
    tmp_path: Path, mode: str
) -> None:
    """Connecting is bounded whatever ``call_timeout`` says (default
    ``DEFAULT_CONNECT_TIMEOUT``, finite); here a short bound, so the test is quick."""
    from tesserix_adk.mcp.toolset import DEFAULT_CONNECT_TIMEOUT

    assert 0 < DEFAULT_CONNECT_TIMEOUT <= 60
    toolset = MCPToolset.stdio(
        sys.executable,
        [HOSTILE],
        env={
            "ATTACK_MODE": mode,
            "ATTACK_CALLS": str(tmp_path / "calls.jsonl"),
            "ATTACK_DEPTH": "300",
        },
        call_timeout=None,
        connect_timeout=3,
    )
    try:
        async with asyncio.timeout(25):
            with pytest.raises(MCPUnavailableError):
                async with toolset:
                    pass
    except TimeoutError:
        pytest.fail("the toolset never gave up on a server that does not answer")


@pytest.mark.parametrize("mode", ["silent_list", "deep"])
async def test_with_a_timeout_a_server_that_never_lists_is_a_typed_unavailable_error(
    tmp_path: Path, mode: str
) -> None:
    with pytest.raises(MCPUnavailableError) as caught:
        async with asyncio.timeout(30):
            async with _hostile(mode, tmp_path, ATTACK_DEPTH="300"):
                pass
    assert not caught.value.outcome_unknown


@pytest.mark.parametrize("mode", ["silent_call", "garbage", "wrong_id", "die"])
async def test_a_call_the_server_never_answers_is_a_lost_reply_and_is_sent_once(
    tmp_path: Path, mode: str
) -> None:
    async with _hostile(mode, tmp_path) as toolset:
        with pytest.raises(MCPReplyLostError) as caught:
            await asyncio.wait_for(toolset.call("book_seat", {"flight": "LH1"}, key="k1"), 30)
        assert caught.value.outcome_unknown and caught.value.retryable
        assert isinstance(caught.value, ToolOutcomeUnknownError)
    calls = _calls(tmp_path)
    assert len(calls) == 1
    assert calls[0]["_meta"] == {"tesserix/idempotency_key": "k1"}


async def test_a_lost_mcp_reply_in_a_run_leaves_the_call_in_doubt_not_told_to_the_model(
    tmp_path: Path,
) -> None:
    world = World()
    provider = ScriptedProvider([[("book_seat", {"flight": "LH1"})], "done"])
    async with _hostile("silent_call", tmp_path) as toolset:
        agent = Agent("mcp", "book", list(toolset.tools))
        with pytest.raises(ToolOutcomeUnknownError):
            await world.runner(provider).run(agent, "book", tenant="t", run_id="r")
        assert provider.calls == 1  # the model was never told the call failed
        with pytest.raises(AdkError) as refused:
            await world.runner(
                ScriptedProvider([[("book_seat", {"flight": "LH1"})], "done"])
            ).resume(agent, "r", tenant="t")
        assert type(refused.value).__name__ == "IndeterminateToolCallError"
    assert len(_calls(tmp_path)) == 1


async def test_a_huge_mcp_result_neither_crashes_the_run_nor_is_sent_twice(
    tmp_path: Path,
) -> None:
    """A 3 MB result (past the 1 MiB record cap): the run goes on, the model is told the
    call completed but its result could not be kept; the server hears the call once."""
    world = World()
    turns: list[Any] = [[("book_seat", {"flight": "LH1"})], "done"]
    seeing = Seeing(turns)
    async with _hostile("huge", tmp_path, call_timeout=60, ATTACK_SIZE="3000000") as toolset:
        agent = Agent("mcp", "book", list(toolset.tools))
        try:
            run = await world.runner(seeing).run(agent, "book", tenant="t", run_id="r")
        except AdkError:
            with contextlib.suppress(AdkError):
                await world.runner(ScriptedProvider(turns)).resume(agent, "r", tenant="t")
        else:
            assert run.status.value == "completed"
            (result,) = [m for m in seeing.last.messages if m.tool_call_id is not None]
            # Told that the call completed and its result was too large, not to ask again.
            assert result.is_error and "completed" in result.text
    assert len(_calls(tmp_path)) == 1


async def test_server_tools_clashing_by_name_make_no_agent(tmp_path: Path) -> None:
    async with _hostile("dup", tmp_path) as toolset:
        with pytest.raises(ConfigurationError):
            Agent("mcp", "x", list(toolset.tools))

    @tool
    def book_seat(flight: str) -> str:
        """A local tool with the server's tool's name."""
        return flight

    async with _hostile("", tmp_path) as toolset:
        with pytest.raises(ConfigurationError):
            Agent("mcp", "x", [book_seat, *toolset.tools])


async def test_an_unannotated_server_tool_is_side_effecting_not_idempotent_and_keyed(
    tmp_path: Path,
) -> None:
    async with _hostile("", tmp_path) as toolset:
        (book,) = toolset.tools
        assert book.side_effects and not book.idempotent
        await toolset.call("book_seat", {"flight": "LH1"}, key="k-9")
    assert _calls(tmp_path)[0]["_meta"] == {"tesserix/idempotency_key": "k-9"}


async def test_the_same_tools_under_changed_annotations_are_another_revision(
    tmp_path: Path,
) -> None:
    effects = Effects(tmp_path)
    async with stdio(effects) as plain, stdio(effects, variant="annotations") as changed:
        first = Agent("a", "x", list(plain.tools)).revision
        second = Agent("a", "x", list(changed.tools)).revision
        again = Agent("a", "x", list(plain.tools)).revision
    assert first != second
    assert first == again


# --- streaming and MCP together ---------------------------------------------------------------


async def test_leaving_the_stream_mid_mcp_call_leaves_it_in_doubt_and_the_connection_usable(
    tmp_path: Path,
) -> None:
    """The consumer leaves while book_seat is inside the server: aclose returns once the run
    let go, the resume refuses the call in doubt rather than send it again, and the
    toolset's connection survives the cancelled request."""
    effects, hold = Effects(tmp_path), tmp_path / "hold"
    hold.mkdir()
    world = World()
    turns: list[Any] = [[("book_seat", {"flight": "LH1"})], "done"]
    async with stdio(effects, MCP_HOLD_DIR=str(hold)) as toolset:
        agent = Agent("mcp", "book", list(toolset.tools))
        stream = world.runner(ScriptedProvider(turns)).stream(agent, "b", tenant="t", run_id="r")
        async with asyncio.timeout(30):
            async with aclosing(stream) as events:
                async for event in events:
                    if isinstance(event, ToolCallStarted):
                        for _ in range(1000):
                            if (hold / "inside").exists():
                                break
                            await asyncio.sleep(0.02)
                        break
        with pytest.raises(IndeterminateToolCallError):
            await world.runner(ScriptedProvider(turns)).resume(agent, "r", tenant="t")
        (hold / "release").write_text("")
        flights = await asyncio.wait_for(
            toolset.call("find_flights", {"origin": "A", "dest": "B"}, key=None), 30
        )
        assert "LH123" in flights
    assert len(effects.keys()) == 1


async def test_malformed_model_arguments_are_never_sent_to_an_mcp_server(
    tmp_path: Path, model_server: ModelServer, openai: OpenAIProvider
) -> None:
    world = World()
    frames = openai_stream(None, [("call_1", "cancel_orders", '{"reason": "dup", "limit": 1')])
    model_server.queue(Reply(events=frames), Reply(events=openai_stream("stopping")))
    async with _hostile("sdk", tmp_path, call_timeout=30) as toolset:
        agent = Agent("shop", "x", list(toolset.tools))
        await _drain(world.runner(openai).stream(agent, "cancel", tenant="t", run_id="r"))
    # The model meant at most one order; nothing it did not finish asking for is sent.
    assert _calls(tmp_path) == []


@pytest.mark.parametrize("code", ["-32000", "-32001"])
async def test_an_error_the_server_answered_is_a_tool_error_not_a_lost_reply(
    tmp_path: Path, code: str
) -> None:
    async with _hostile("rpc_error", tmp_path, ATTACK_CODE=code) as toolset:
        for key in ("k1", "k2"):
            with pytest.raises(MCPError) as caught:
                await toolset.call("book_seat", {"flight": "LH1"}, key=key)
            assert not caught.value.outcome_unknown  # the server said no: nothing in doubt
    assert [c["_meta"]["tesserix/idempotency_key"] for c in _calls(tmp_path)] == ["k1", "k2"]


async def test_an_ordinary_json_rpc_error_answer_is_a_tool_error_and_the_connection_stays(
    tmp_path: Path,
) -> None:
    async with _hostile("rpc_error", tmp_path, ATTACK_CODE="-32602") as toolset:
        for key in ("k1", "k2"):
            with pytest.raises(MCPToolError):
                await toolset.call("book_seat", {"flight": "LH1"}, key=key)
    assert len(_calls(tmp_path)) == 2


# --- MCP over streamable HTTP: a server (or the proxy before it) that fails mid-call -------


class _HttpMCP(JsonHttpHandler):
    """Just enough of the streamable HTTP transport (JSON replies, no SSE) to list one
    side-effecting tool; a ``tools/call`` is recorded, then answered as ``server.mode`` says:
    ``drop`` (the connection closes with no response) or an HTTP status (a gateway's 502/504
    after it forwarded the request)."""

    def do_POST(self) -> None:
        request = self._request()
        method, rid = request.get("method"), request.get("id")
        server: Any = self.server
        if rid is None:
            self._reply(202)
        elif method == "initialize":
            result = {
                "protocolVersion": request["params"]["protocolVersion"],
                "capabilities": {"tools": {}},
                "serverInfo": {"name": "gateway", "version": "0"},
            }
            self._reply(
                200, {"jsonrpc": "2.0", "id": rid, "result": result}, {"mcp-session-id": "s"}
            )
        elif method == "tools/list":
            tools = [{"name": "book_seat", "inputSchema": {"type": "object"}}]
            self._reply(200, {"jsonrpc": "2.0", "id": rid, "result": {"tools": tools}})
        elif method == "tools/call":
            server.calls.append(request["params"])
            if server.mode == "drop":
                self.connection.close()
            else:
                self._reply(int(server.mode), {"error": "upstream timed out"})
        else:
            self._reply(
                200, {"jsonrpc": "2.0", "id": rid, "error": {"code": -32601, "message": "?"}}
            )


@contextlib.contextmanager
def _http_mcp(mode: str) -> Iterator[tuple[str, list[dict[str, Any]]]]:
    server = QuietHTTPServer(("127.0.0.1", 0), _HttpMCP)
    calls: list[dict[str, Any]] = []
    server.calls, server.mode = calls, mode  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02})
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/mcp", calls
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


async def test_an_http_connection_dropped_mid_call_is_a_typed_lost_reply(tmp_path: Path) -> None:
    world = World()
    turns: list[Any] = [[("book_seat", {"flight": "LH1"})], "done"]
    with _http_mcp("drop") as (url, calls):
        try:
            async with asyncio.timeout(30), MCPToolset.http(url) as toolset:
                agent = Agent("mcp", "book", list(toolset.tools))
                with pytest.raises(ToolOutcomeUnknownError):
                    await world.runner(ScriptedProvider(turns)).run(
                        agent, "b", tenant="t", run_id="r"
                    )
        except BaseException as exc:  # what escaped instead of the typed error
            pytest.fail(f"untyped: {exc!r}")
    assert len(calls) == 1


@pytest.mark.parametrize("status", ["502", "504"])
async def test_a_gateway_error_to_a_side_effecting_call_is_never_followed_by_a_second_send(
    status: str,
) -> None:
    world = World()
    again: list[Any] = [[("book_seat", {"flight": "LH1"})]] * 2 + ["done"]
    with _http_mcp(status) as (url, calls):
        async with MCPToolset.http(url) as toolset:
            agent = Agent("mcp", "book", list(toolset.tools))
            with contextlib.suppress(AdkError):
                await world.runner(ScriptedProvider(again)).run(agent, "b", tenant="t", run_id="r")
    assert len(calls) == 1


async def test_openai_stream_without_usage_is_taken_whole_when_the_server_sends_none(
    model_server: ModelServer,
) -> None:
    """``require_stream_usage=False`` is for a server that never sends the usage chunk: its
    stream is taken whole at 0 tokens, where by default it is refused as cut."""
    lenient = OpenAIProvider(
        "openai:gpt-4o",
        base_url=model_server.url + "/v1",
        api_key="test-key",
        max_retries=0,
        timeout=5.0,
        require_stream_usage=False,
    )
    frames = openai_stream("No usage here.", usage=(5000, 1000))
    model_server.queue(Reply(events=frames[:-2] + frames[-1:]))  # usage chunk dropped
    try:
        response = await lenient.complete_streaming(_request(), lambda _: None)
    finally:
        await lenient.aclose()
    assert response.message.text == "No usage here."
    assert (response.usage.input_tokens, response.usage.output_tokens) == (0, 0)
