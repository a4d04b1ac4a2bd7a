"""``ScriptedProvider``: a deterministic, offline model for tests, demos and examples.

It streams too (``complete_streaming``): a turn's text goes out in a few chunks, with a
pause for the event loop between them, so a streamed run can be tested without a network.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tesserix_adk.errors import ConfigurationError
from tesserix_adk.messages import Message, Role, ToolCall, Usage
from tesserix_adk.providers.base import ModelRequest, ModelResponse, TextSink

__all__ = ["ScriptedProvider", "ScriptedTurn"]

STREAM_CHUNKS = 3  # how many pieces a streamed turn's text is told in (at most)


@dataclass(frozen=True, slots=True, kw_only=True)
class ScriptedTurn:
    """One answer: final ``text``, or ``calls`` as (tool name, arguments) pairs."""

    text: str = ""
    calls: Sequence[tuple[str, Mapping[str, Any]]] = ()
    usage: Usage = field(default_factory=lambda: Usage(input_tokens=100, output_tokens=20))
    cost_micros: int = 0


Turn = str | ScriptedTurn | Sequence[tuple[str, Mapping[str, Any]]]


class ScriptedProvider:
    """Answers with a fixed list of turns.

    The turn is chosen by counting the assistant messages already in the request, not by
    counting calls to this object, so a fresh instance in a new process carries on exactly
    where a dead one stopped.
    """

    def __init__(self, turns: Sequence[Turn]) -> None:
        self.turns = tuple(_normalise(t) for t in turns)
        self.calls = 0

    async def complete_streaming(self, request: ModelRequest, on_text: TextSink) -> ModelResponse:
        """``complete``, its text told to ``on_text`` in a few chunks first."""
        response = await self.complete(request)
        for chunk in _chunks(response.message.text):
            on_text(chunk)
            await asyncio.sleep(0)  # as a network would, let the listener in between
        return response

    async def complete(self, request: ModelRequest) -> ModelResponse:
        """The turn after the assistant messages the request already holds."""
        index = sum(1 for m in request.messages if m.role is Role.assistant)
        if index >= len(self.turns):
            raise ConfigurationError(
                f"scripted provider has {len(self.turns)} turn(s); turn {index + 1} was asked for"
            )
        self.calls += 1
        turn = self.turns[index]
        calls = [
            ToolCall(id=f"call_{index}_{j}", name=name, arguments=dict(args))
            for j, (name, args) in enumerate(turn.calls)
        ]
        return ModelResponse(
            message=Message.assistant(turn.text, calls),
            usage=turn.usage,
            cost_micros=turn.cost_micros,
        )


def _normalise(turn: Turn) -> ScriptedTurn:
    if isinstance(turn, ScriptedTurn):
        return turn
    if isinstance(turn, str):
        return ScriptedTurn(text=turn)
    return ScriptedTurn(calls=tuple(turn))


def _chunks(text: str) -> list[str]:
    """``text`` in at most ``STREAM_CHUNKS`` pieces, split between words."""
    words = re.findall(r"\s*\S+\s*", text) or ([text] if text else [])
    size = -(-len(words) // STREAM_CHUNKS) if words else 1
    return ["".join(words[i : i + size]) for i in range(0, len(words), size)]
