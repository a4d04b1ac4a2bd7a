"""Helpers the runner's tests share: frontier predicates and a provider that records."""

from __future__ import annotations

from typing import Any

from tesserix_adk import Message, ModelRequest, ModelResponse

__all__ = ["Recording", "answers", "at"]


def at(boundary: str, iteration: int) -> Any:
    """A payload test for ``FaultyCheckpointStore``: the frontier at ``boundary`` of
    ``iteration``."""
    return lambda body: body.get("boundary") == boundary and body.get("iteration") == iteration


class Recording:
    """A provider that keeps every request it was sent."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.requests: list[ModelRequest] = []

    async def complete(self, request: ModelRequest) -> ModelResponse:
        self.requests.append(request)
        response: ModelResponse = await self.inner.complete(request)
        return response


def answers(request: ModelRequest, name: str) -> list[Message]:
    """The tool results in ``request`` answering calls of the tool ``name``."""
    ids = {c.id for m in request.messages for c in m.tool_calls if c.name == name}
    return [m for m in request.messages if m.tool_call_id in ids]
