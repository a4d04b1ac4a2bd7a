"""The ``Provider`` protocol: one model call in, one assistant message out."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from tesserix_adk.messages import Message, Usage
from tesserix_adk.tools import ToolSpec

__all__ = ["ModelRequest", "ModelResponse", "Provider"]


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
    """The model's answer: an assistant message, its usage and its cost."""

    message: Message
    usage: Usage = field(default_factory=Usage)
    cost_micros: int = 0


@runtime_checkable
class Provider(Protocol):
    """A model. ``complete`` may be called again for the same request after a crash."""

    async def complete(self, request: ModelRequest) -> ModelResponse:
        """Answer one request."""
        ...
