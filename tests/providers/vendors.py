"""The two vendors behind one face, so a guarantee is tested once for both SDK paths."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tesserix_adk.providers.anthropic import AnthropicProvider
from tesserix_adk.providers.openai import OpenAIProvider
from tesserix_adk.providers.pricing import Prices

from .fake_server import (
    Call,
    ModelServer,
    Reply,
    anthropic_error,
    anthropic_message,
    anthropic_stream,
    openai_completion,
    openai_error,
    openai_stream,
)

SDKProvider = OpenAIProvider | AnthropicProvider


@dataclass(frozen=True, slots=True, kw_only=True)
class Vendor:
    """How to build a provider against the fake server, and what that vendor answers."""

    name: str
    path: str  # the endpoint the SDK posts to
    model: str  # as a user writes it, vendor prefix included
    wire_model: str  # as it goes on the wire

    def provider(
        self,
        server: ModelServer,
        *,
        api_key: str = "test-key-not-secret",
        prices: Prices = None,
        max_retries: int = 2,
        timeout: float = 5.0,
        base_url: str | None = None,
    ) -> SDKProvider:
        """A fresh provider on the real SDK path, pointed at ``server``."""
        if self.name == "openai":
            return OpenAIProvider(
                self.model,
                base_url=base_url or server.url + "/v1",
                api_key=api_key,
                prices=prices,
                max_retries=max_retries,
                timeout=timeout,
            )
        return AnthropicProvider(
            self.model,
            base_url=base_url or server.url,
            api_key=api_key,
            prices=prices,
            max_retries=max_retries,
            timeout=timeout,
        )

    def turn(
        self,
        text: str | None = None,
        calls: Sequence[Call] = (),
        *,
        usage: tuple[int, int] = (120, 30),
    ) -> dict[str, Any]:
        """A successful reply body."""
        if self.name == "openai":
            return openai_completion(text, calls, usage=usage)
        return anthropic_message(text, calls, usage=usage)

    def streamed(
        self,
        text: str | None = None,
        calls: Sequence[Call] = (),
        *,
        usage: tuple[int, int] = (120, 30),
        cut_after: int | None = None,
        hold_after: int | None = None,
    ) -> Reply:
        """A successful reply as this vendor streams it (server-sent events), maybe cut
        short after ``cut_after`` frames or held open after ``hold_after``."""
        build = openai_stream if self.name == "openai" else anthropic_stream
        return Reply(
            events=build(text, calls, usage=usage), cut_after=cut_after, hold_after=hold_after
        )

    def broken_off(self, text: str, *, after: int = 3) -> Reply:
        """A stream that sends ``after`` frames of an answer, then an error event (the
        vendor overloaded mid-answer) and ends."""
        frames = self.streamed(text).events[:after]
        if self.name == "openai":
            error = {"error": {"message": "The server had an error", "type": "server_error"}}
            frames.append(f"data: {json.dumps(error)}\n\n")
        else:
            error = {
                "type": "error",
                "error": {"type": "overloaded_error", "message": "Overloaded"},
            }
            frames.append(f"event: error\ndata: {json.dumps(error)}\n\n")
        return Reply(events=frames)

    def error(self, status: int, message: str = "something went wrong") -> Reply:
        """An error reply shaped like this vendor's."""
        kinds: Mapping[int, tuple[str, str]] = {
            400: ("invalid_request_error", "invalid_request_error"),
            401: ("invalid_request_error", "authentication_error"),
            429: ("rate_limit_error", "rate_limit_error"),
            500: ("server_error", "api_error"),
        }
        openai_kind, anthropic_kind = kinds.get(status, ("server_error", "api_error"))
        if self.name == "openai":
            return openai_error(status, message, openai_kind)
        return anthropic_error(status, message, anthropic_kind)

    def tool_results(self, body: Mapping[str, Any]) -> dict[str, tuple[str, bool]]:
        """The tool results a request body carries: call id → (content, is_error)."""
        if self.name == "openai":
            return {
                m["tool_call_id"]: (m["content"], m["content"].startswith("error: "))
                for m in body["messages"]
                if m["role"] == "tool"
            }
        return {
            b["tool_use_id"]: (b["content"], b["is_error"])
            for m in body["messages"]
            if m["role"] == "user" and isinstance(m["content"], list)
            for b in m["content"]
            if b["type"] == "tool_result"
        }

    def key_headers(self, headers: Mapping[str, str]) -> str:
        """The header values that may carry the API key (Anthropic SDKs have used both)."""
        return " ".join(headers.get(name, "") for name in ("authorization", "x-api-key"))


OPENAI = Vendor(
    name="openai", path="/v1/chat/completions", model="openai:gpt-4o", wire_model="gpt-4o"
)
ANTHROPIC = Vendor(
    name="anthropic",
    path="/v1/messages",
    model="anthropic:claude-haiku-4-5",
    wire_model="claude-haiku-4-5",
)
VENDORS = (OPENAI, ANTHROPIC)
