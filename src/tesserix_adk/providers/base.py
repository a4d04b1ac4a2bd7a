"""The ``Provider`` protocol: one model call in, one assistant message out.

``StreamingProvider`` is the optional capability of reporting the text as it arrives; the
whole message is still assembled before the call returns, so nothing partial is saved.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from tesserix_adk.messages import Message, Usage
from tesserix_adk.tools import ToolSpec

__all__ = ["ModelRequest", "ModelResponse", "Provider", "StreamingProvider", "TextSink"]

TextSink = Callable[[str], None]
"""Told each piece of the model's text as it streams in; must not block."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelRequest:
    """Everything a model call needs; ``messages`` is the whole transcript so far."""

    agent_name: str
    instructions: str
    messages: Sequence[Message]
    tools: Sequence[ToolSpec] = ()
    model: str | None = None
    iteration: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelResponse:
    """The model's answer: an assistant message, its usage and its cost; ``finish_reason``
    is why the vendor ended it, as the vendor says it (``None``: not said)."""

    message: Message
    usage: Usage = field(default_factory=Usage)
    cost_micros: int = 0
    finish_reason: str | None = None


@runtime_checkable
class Provider(Protocol):
    """A model. ``complete`` may be called again for the same request after a crash."""

    async def complete(self, request: ModelRequest) -> ModelResponse:
        """Answer one request."""
        ...


@runtime_checkable
class StreamingProvider(Provider, Protocol):
    """A model that can also stream: ``complete_streaming`` tells ``on_text`` each piece of
    text as it arrives and returns only once the whole message (text, calls with their
    arguments, usage and cost) is in. A stream cut short raises a retryable
    ``ProviderError``: a partial message is never returned."""

    async def complete_streaming(self, request: ModelRequest, on_text: TextSink) -> ModelResponse:
        """Answer one request, streaming its text to ``on_text``."""
        ...
