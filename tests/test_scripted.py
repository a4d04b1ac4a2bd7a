"""ScriptedProvider: the turn comes from the request, so a fresh instance carries on."""

from __future__ import annotations

import pytest

from tesserix_adk import ConfigurationError, Message, ModelRequest, ScriptedProvider, ToolCall


def _request(*messages: Message) -> ModelRequest:
    return ModelRequest(agent_name="a", instructions="i", messages=messages)


async def test_turn_is_chosen_by_the_assistant_messages_already_in_the_request() -> None:
    turns = [[("search", {"q": "x"})], "done"]
    first = await ScriptedProvider(turns).complete(_request(Message.user("hi")))
    assert [c.name for c in first.message.tool_calls] == ["search"]
    history = (
        Message.user("hi"),
        first.message,
        Message("tool", "result", tool_call_id=first.message.tool_calls[0].id),
    )
    fresh = ScriptedProvider(turns)  # a new process
    second = await fresh.complete(_request(*history))
    assert second.message.text == "done" and not second.message.tool_calls


async def test_call_ids_are_deterministic() -> None:
    turns = [[("a", {}), ("b", {})]]
    one = await ScriptedProvider(turns).complete(_request(Message.user("x")))
    two = await ScriptedProvider(turns).complete(_request(Message.user("x")))
    assert one.message.tool_calls == two.message.tool_calls
    assert one.message.tool_calls[1] == ToolCall(id="call_0_1", name="b", arguments={})


async def test_running_out_of_turns_is_a_configuration_error() -> None:
    with pytest.raises(ConfigurationError):
        await ScriptedProvider([]).complete(_request(Message.user("x")))
