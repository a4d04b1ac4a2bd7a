"""What the ``openai`` SDK sends for our transcripts, checked against the documented Chat
Completions shapes, and how its answers come back as our messages."""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest

from tesserix_adk import (
    AgentRunner,
    BinaryPart,
    Checkpointer,
    ConfigurationError,
    MemoryCheckpointStore,
    MemoryIdempotencyStore,
    Message,
    ModelRequest,
    RunStatus,
    TextPart,
    ToolCall,
    ToolOutcome,
)
from tesserix_adk.providers.openai import OpenAIProvider

from .booking import Airline, booking_agent
from .fake_server import ModelServer, openai_completion

PNG = base64.b64decode(
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="
)
MESSAGE_KEYS = {
    "system": {"role", "content"},
    "user": {"role", "content"},
    "assistant": {"role", "content", "tool_calls"},
    "tool": {"role", "content", "tool_call_id"},
}


@pytest.fixture
async def provider(model_server: ModelServer) -> AsyncIterator[OpenAIProvider]:
    async with OpenAIProvider(
        "openai:gpt-4o", base_url=model_server.url + "/v1", api_key="test-key", max_retries=0
    ) as p:
        yield p


def runner(provider: OpenAIProvider) -> AgentRunner:
    return AgentRunner(
        provider,
        idempotency=MemoryIdempotencyStore(),
        checkpoints=Checkpointer(MemoryCheckpointStore()),
    )


async def test_transcript_with_tool_calls_and_results_has_the_documented_shape(
    model_server: ModelServer, provider: OpenAIProvider, airline: Airline
) -> None:
    fra = {"origin": "FRA", "dest": "JFK"}
    muc = {"origin": "MUC", "dest": "JFK"}
    model_server.queue(
        # Two calls in one turn: Chat Completions' parallel tool calls.
        openai_completion(
            calls=[("call_s1", "search_flights", fra), ("call_s2", "search_flights", muc)]
        ),
        openai_completion(calls=[("call_b1", "book_seat", {"flight": "LH123"})]),
        openai_completion("Booked LH123."),
    )
    agent = booking_agent(airline)
    run = await runner(provider).run(agent, "book LH123", tenant="acme", run_id="r1")
    assert run.status is RunStatus.completed and run.output == "Booked LH123."
    assert airline.searches == 2 and airline.bookings == ["LH123"]

    request = model_server.requests[-1]
    assert request.path == "/v1/chat/completions"
    assert request.headers["authorization"] == "Bearer test-key"
    body = request.body
    assert body["model"] == "gpt-4o"
    assert not body.get("stream")  # the non-streaming endpoint: one whole message
    messages = body["messages"]
    for m in messages:
        assert set(m) <= MESSAGE_KEYS[m["role"]], m
    assert [m["role"] for m in messages] == [
        "system",
        "user",
        "assistant",
        "tool",
        "tool",
        "assistant",
        "tool",
    ]
    assert messages[0] == {"role": "system", "content": agent.instructions}
    assert messages[1] == {"role": "user", "content": "book LH123"}

    first = messages[2]
    assert first["content"] is None
    assert [(c["id"], c["type"], c["function"]["name"]) for c in first["tool_calls"]] == [
        ("call_s1", "function", "search_flights"),
        ("call_s2", "function", "search_flights"),
    ]
    for call, arguments in zip(first["tool_calls"], [fra, muc], strict=True):
        assert isinstance(call["function"]["arguments"], str)  # JSON text, not an object
        assert json.loads(call["function"]["arguments"]) == arguments
    assert [(m["tool_call_id"], json.loads(m["content"])) for m in messages[3:5]] == [
        ("call_s1", ["LH123", "UA456"]),
        ("call_s2", ["LH123", "UA456"]),
    ]
    assert messages[5]["tool_calls"][0]["id"] == "call_b1"
    assert messages[6]["tool_call_id"] == "call_b1"
    assert json.loads(messages[6]["content"]) == {"booking": "B1", "flight": "LH123"}

    tools = body["tools"]
    assert [t["type"] for t in tools] == ["function", "function"]
    assert [set(t["function"]) for t in tools] == [{"name", "description", "parameters"}] * 2
    search = next(t["function"] for t in tools if t["function"]["name"] == "search_flights")
    assert search["description"] == "Find flights between two airports."
    assert search["parameters"]["type"] == "object"
    assert set(search["parameters"]["properties"]) == {"origin", "dest"}
    assert "max_tokens" not in body and "parallel_tool_calls" not in body


async def test_error_result_says_so_in_the_text(
    model_server: ModelServer, provider: OpenAIProvider, airline: Airline
) -> None:
    model_server.queue(
        openai_completion(calls=[("call_x", "cancel_everything", {})]),
        openai_completion("I cannot do that."),
    )
    await runner(provider).run(booking_agent(airline), "cancel", tenant="acme", run_id="r1")
    tool = next(m for m in model_server.bodies[-1]["messages"] if m["role"] == "tool")
    assert tool["tool_call_id"] == "call_x"
    assert tool["content"].startswith("error: unknown tool 'cancel_everything'")


async def test_image_reaches_the_wire_as_a_data_url(
    model_server: ModelServer, provider: OpenAIProvider, airline: Airline
) -> None:
    model_server.queue(openai_completion("A red pixel."))
    question = Message.user(
        [TextPart(text="What is in this picture?"), BinaryPart(data=PNG, media_type="image/png")]
    )
    await runner(provider).run(booking_agent(airline), question, tenant="acme", run_id="r1")

    content = model_server.bodies[0]["messages"][1]["content"]
    assert content[0] == {"type": "text", "text": "What is in this picture?"}
    assert content[1]["type"] == "image_url"
    url = content[1]["image_url"]["url"]
    prefix = "data:image/png;base64,"
    assert url.startswith(prefix)
    assert base64.b64decode(url[len(prefix) :]) == PNG


async def test_malformed_arguments_are_answered_to_the_model_and_never_run(
    model_server: ModelServer, provider: OpenAIProvider, airline: Airline
) -> None:
    truncated = '{"flight": "LH1'
    model_server.queue(
        openai_completion(calls=[("call_b1", "book_seat", truncated)]),
        openai_completion("Sorry, let me try again later."),
    )
    run = await runner(provider).run(booking_agent(airline), "book", tenant="acme", run_id="r1")
    assert run.status is RunStatus.completed
    assert airline.bookings == []  # refused before the tool was even asked

    messages = model_server.bodies[-1]["messages"]
    said = messages[2]["tool_calls"][0]["function"]["arguments"]
    assert said == truncated  # the assistant's words go back verbatim
    assert messages[3]["content"].startswith("error: not sent: its arguments were not one JSON")


async def test_answer_maps_to_our_message_and_usage(
    model_server: ModelServer, provider: OpenAIProvider
) -> None:
    model_server.queue(
        openai_completion(
            "Checking both.",
            calls=[("c1", "search_flights", {"origin": "FRA", "dest": "JFK"}), ("c2", "f", "")],
            usage=(321, 54),
        )
    )
    response = await provider.complete(
        ModelRequest(agent_name="a", instructions="", messages=[Message.user("hi")])
    )
    assert response.message == Message.assistant(
        "Checking both.",
        [
            ToolCall(id="c1", name="search_flights", arguments={"origin": "FRA", "dest": "JFK"}),
            ToolCall(id="c2", name="f", arguments={}),  # "" is no arguments
        ],
    )
    assert (response.usage.input_tokens, response.usage.output_tokens) == (321, 54)
    assert model_server.bodies[0]["messages"] == [{"role": "user", "content": "hi"}]


def _body(provider: OpenAIProvider, *messages: Message) -> dict[str, Any]:
    return provider.request_body(
        ModelRequest(agent_name="a", instructions="Be brief.", messages=messages)
    )


async def test_request_options_and_transcript_details() -> None:
    provider = OpenAIProvider(
        "llama3.1:8b",  # a local model name keeps its own colon
        base_url="http://127.0.0.1:9/v1",
        api_key="unused",
        max_tokens=256,
        parallel_tool_calls=False,
    )
    try:
        body = _body(
            provider,
            Message("system", "Today is Tuesday."),
            Message.user("hi"),
            Message.assistant("Hello!"),
            Message.tool_result(ToolOutcome(call_id="c1", content={"ok": True})),
        )
        assert body["model"] == "llama3.1:8b"
        assert body["max_tokens"] == 256
        assert "parallel_tool_calls" not in body  # only sent along with tools
        assert body["messages"] == [
            {"role": "system", "content": "Be brief."},
            {"role": "system", "content": "Today is Tuesday."},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "tool", "tool_call_id": "c1", "content": '{"ok": true}'},
        ]
        with pytest.raises(ConfigurationError, match="audio/wav"):
            _body(provider, Message.user([BinaryPart(data=b"RIFF", media_type="audio/wav")]))
        pdf = _body(
            provider, Message.user([BinaryPart(data=b"%PDF", media_type="application/pdf")])
        )
        assert pdf["messages"][1]["content"][0]["file"]["file_data"].startswith(
            "data:application/pdf;base64,"
        )
    finally:
        await provider.aclose()


async def test_configuration_mistakes_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with pytest.raises(ConfigurationError, match="OPENAI_API_KEY"):
        OpenAIProvider("gpt-4o")
    client = openai.AsyncOpenAI(api_key="k", base_url="http://127.0.0.1:9/v1")
    try:
        with pytest.raises(ConfigurationError, match="not both"):
            OpenAIProvider("gpt-4o", client=client, api_key="k")
        with pytest.raises(ConfigurationError, match="no model name"):
            OpenAIProvider("openai:", client=client)
    finally:
        await client.close()


async def test_a_client_passed_in_is_used_and_left_open(model_server: ModelServer) -> None:
    client = openai.AsyncOpenAI(api_key="k", base_url=model_server.url + "/v1", max_retries=0)
    model_server.queue(openai_completion("Hi."))
    async with OpenAIProvider("gpt-4o", client=client) as provider:
        response = await provider.complete(
            ModelRequest(agent_name="a", instructions="", messages=[Message.user("hi")])
        )
    assert response.message.text == "Hi."
    assert not client.is_closed()
    await client.close()
