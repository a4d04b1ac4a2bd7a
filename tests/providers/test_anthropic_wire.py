"""What the ``anthropic`` SDK sends for our transcripts, checked against the documented
Messages API shapes, and how its answers come back as our messages."""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator
from typing import Any

import anthropic
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
from tesserix_adk.providers.anthropic import AnthropicProvider

from .booking import Airline, booking_agent
from .fake_server import ModelServer, anthropic_message

PNG = base64.b64decode(
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="
)


@pytest.fixture
async def provider(model_server: ModelServer) -> AsyncIterator[AnthropicProvider]:
    async with AnthropicProvider(
        "anthropic:claude-haiku-4-5", base_url=model_server.url, api_key="test-key", max_retries=0
    ) as p:
        yield p


def runner(provider: AnthropicProvider) -> AgentRunner:
    return AgentRunner(
        provider,
        idempotency=MemoryIdempotencyStore(),
        checkpoints=Checkpointer(MemoryCheckpointStore()),
    )


async def test_transcript_with_tool_use_and_results_has_the_documented_shape(
    model_server: ModelServer, provider: AnthropicProvider, airline: Airline
) -> None:
    fra = {"origin": "FRA", "dest": "JFK"}
    muc = {"origin": "MUC", "dest": "JFK"}
    model_server.queue(
        anthropic_message(
            "Let me look.",
            calls=[("toolu_s1", "search_flights", fra), ("toolu_s2", "search_flights", muc)],
        ),
        anthropic_message(calls=[("toolu_b1", "book_seat", {"flight": "LH123"})]),
        anthropic_message("Booked LH123."),
    )
    agent = booking_agent(airline)
    run = await runner(provider).run(agent, "book LH123", tenant="acme", run_id="r1")
    assert run.status is RunStatus.completed and run.output == "Booked LH123."
    assert airline.searches == 2 and airline.bookings == ["LH123"]

    request = model_server.requests[-1]
    assert request.path == "/v1/messages"
    assert "anthropic-version" in request.headers
    body = request.body
    assert body["model"] == "claude-haiku-4-5"
    assert body["max_tokens"] == 1024
    assert body["system"] == agent.instructions  # top level, not a message
    assert not body.get("stream")  # the non-streaming endpoint: one whole message
    messages = body["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant", "user"]
    assert messages[0] == {"role": "user", "content": [{"type": "text", "text": "book LH123"}]}
    assert messages[1]["content"] == [
        {"type": "text", "text": "Let me look."},
        {"type": "tool_use", "id": "toolu_s1", "name": "search_flights", "input": fra},
        {"type": "tool_use", "id": "toolu_s2", "name": "search_flights", "input": muc},
    ]
    # Both results answer in one user message, in the model's order.
    results = messages[2]["content"]
    assert [(b["type"], b["tool_use_id"], b["is_error"]) for b in results] == [
        ("tool_result", "toolu_s1", False),
        ("tool_result", "toolu_s2", False),
    ]
    assert [set(b) for b in results] == [{"type", "tool_use_id", "content", "is_error"}] * 2
    assert json.loads(results[0]["content"]) == ["LH123", "UA456"]
    assert messages[3]["content"] == [
        {"type": "tool_use", "id": "toolu_b1", "name": "book_seat", "input": {"flight": "LH123"}}
    ]
    assert json.loads(messages[4]["content"][0]["content"]) == {"booking": "B1", "flight": "LH123"}

    tools = body["tools"]
    assert [set(t) for t in tools] == [{"name", "description", "input_schema"}] * 2
    search = next(t for t in tools if t["name"] == "search_flights")
    assert search["description"] == "Find flights between two airports."
    assert search["input_schema"]["type"] == "object"
    assert set(search["input_schema"]["properties"]) == {"origin", "dest"}


async def test_error_result_is_flagged(
    model_server: ModelServer, provider: AnthropicProvider, airline: Airline
) -> None:
    model_server.queue(
        anthropic_message(calls=[("toolu_x", "cancel_everything", {})]),
        anthropic_message("I cannot do that."),
    )
    await runner(provider).run(booking_agent(airline), "cancel", tenant="acme", run_id="r1")
    result = model_server.bodies[-1]["messages"][2]["content"][0]
    assert result["type"] == "tool_result" and result["tool_use_id"] == "toolu_x"
    assert result["is_error"] is True
    assert result["content"] == "unknown tool 'cancel_everything'"


async def test_image_reaches_the_wire_as_a_base64_block(
    model_server: ModelServer, provider: AnthropicProvider, airline: Airline
) -> None:
    model_server.queue(anthropic_message("A red pixel."))
    question = Message.user(
        [TextPart(text="What is in this picture?"), BinaryPart(data=PNG, media_type="image/png")]
    )
    await runner(provider).run(booking_agent(airline), question, tenant="acme", run_id="r1")

    content = model_server.bodies[0]["messages"][0]["content"]
    assert content[0] == {"type": "text", "text": "What is in this picture?"}
    image = content[1]
    assert image["type"] == "image"
    assert image["source"]["type"] == "base64"
    assert image["source"]["media_type"] == "image/png"
    assert base64.b64decode(image["source"]["data"]) == PNG


async def test_answer_maps_to_our_message_and_usage(
    model_server: ModelServer, provider: AnthropicProvider
) -> None:
    body = anthropic_message(
        "Checking.", calls=[("toolu_1", "search_flights", {"origin": "FRA"})], usage=(200, 40)
    )
    body["content"].insert(0, {"type": "thinking", "thinking": "hmm", "signature": "sig"})
    body["usage"]["cache_read_input_tokens"] = 1000  # cached input is still input
    model_server.queue(body)
    response = await provider.complete(
        ModelRequest(agent_name="a", instructions="", messages=[Message.user("hi")])
    )
    assert response.message == Message.assistant(
        "Checking.", [ToolCall(id="toolu_1", name="search_flights", arguments={"origin": "FRA"})]
    )
    assert (response.usage.input_tokens, response.usage.output_tokens) == (1200, 40)
    assert "system" not in model_server.bodies[0]  # no instructions, no system


def _body(provider: AnthropicProvider, *messages: Message) -> dict[str, Any]:
    return provider.request_body(
        ModelRequest(agent_name="a", instructions="Be brief.", messages=messages)
    )


async def test_turns_alternate_and_system_messages_join_the_system_text() -> None:
    provider = AnthropicProvider(
        "claude-haiku-4-5", base_url="http://127.0.0.1:9", api_key="unused", max_tokens=64
    )
    try:
        call = ToolCall(id="t1", name="lookup", arguments={"q": "x"})
        body = _body(
            provider,
            Message("system", "Today is Tuesday."),
            Message.user("look it up"),
            Message.assistant("", [call]),
            Message.tool_result(ToolOutcome(call_id="t1", content="found", is_error=False)),
            Message.user("and then?"),  # shares the user turn with the result before it
        )
        assert body["system"] == "Be brief.\n\nToday is Tuesday."
        assert body["max_tokens"] == 64
        assert body["messages"] == [
            {"role": "user", "content": [{"type": "text", "text": "look it up"}]},
            {
                "role": "assistant",
                "content": [
                    {"type": "tool_use", "id": "t1", "name": "lookup", "input": {"q": "x"}}
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "t1",
                        "content": "found",
                        "is_error": False,
                    },
                    {"type": "text", "text": "and then?"},
                ],
            },
        ]
        with pytest.raises(ConfigurationError, match="audio/wav"):
            _body(provider, Message.user([BinaryPart(data=b"RIFF", media_type="audio/wav")]))
        pdf = _body(
            provider, Message.user([BinaryPart(data=b"%PDF", media_type="application/pdf")])
        )
        assert pdf["messages"][0]["content"][0]["type"] == "document"
    finally:
        await provider.aclose()


async def test_configuration_mistakes_are_refused() -> None:
    client = anthropic.AsyncAnthropic(api_key="k", base_url="http://127.0.0.1:9")
    try:
        with pytest.raises(ConfigurationError, match="not both"):
            AnthropicProvider("claude-haiku-4-5", client=client, base_url="http://127.0.0.1:9")
        with pytest.raises(ConfigurationError, match="max_tokens"):
            AnthropicProvider("claude-haiku-4-5", client=client, max_tokens=0)
    finally:
        await client.close()
