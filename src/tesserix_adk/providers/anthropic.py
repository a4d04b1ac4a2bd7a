"""``AnthropicProvider``: the Anthropic Messages API through the official ``anthropic`` SDK.

What it owns: mapping our messages to the wire and back, the cost of a call, and turning
the SDK's errors into ``ProviderError`` once, at this boundary.

- The instructions (and any system messages) go in the top-level ``system``; turns
  alternate user/assistant: an assistant's calls are ``tool_use`` blocks, and the results
  that answer them are ``tool_result`` blocks (with ``is_error``) in the next user message —
  consecutive tool results, and a user message that follows them, share one user turn.
- Transient failures (429, 408, 409, 5xx and 529 overloaded, timeouts, dropped connections)
  are retried by the SDK itself (``max_retries``, its own backoff, honouring
  ``retry-after-ms``/``retry-after``); a model call is safe to repeat. When the SDK gives up
  the runner gets ``ProviderError(retryable=True)``: the run stops and stays resumable. A
  rejected request (400, 401, 403, 404, 413, 422) is ``retryable=False``: the run ends
  ``failed``. A body that is not JSON or lacks a message's fields is ``retryable=True``.
- The provider never runs a tool, so it never repeats one.
- Streaming (``complete_streaming``, used by ``AgentRunner.stream``) goes through the SDK's
  ``messages.stream``: text deltas are told on as they come, and the SDK's accumulated
  message is read only after ``message_stop``, so the ``after_model_call`` checkpoint is
  written only once the whole message has arrived, as without streaming. A stream that
  breaks, or ends before ``message_stop``, or without the ``message_delta`` that carries
  its output tokens, is ``retryable=True``: nothing of it is kept.
- Content blocks other than ``text`` and ``tool_use`` (e.g. thinking, which is not
  requested) are not kept.
- The API key lives in the SDK client only; it is never put in a message, and is scrubbed
  from error text.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

try:
    import anthropic
    from anthropic.types import Message as WireMessage
except ImportError as exc:  # pragma: no cover - exercised by a test that hides the package
    raise ImportError(
        "tesserix_adk.providers.anthropic needs the anthropic package: "
        'pip install "tesserix-adk[anthropic]"'
    ) from exc

from tesserix_adk.errors import ConfigurationError, ProviderError
from tesserix_adk.messages import BinaryPart, Message, Part, Role, TextPart, ToolCall, Usage
from tesserix_adk.providers._common import (
    MALFORMED_ARGUMENTS,
    arguments_from_text,
    cut_off,
    token_count,
)
from tesserix_adk.providers._sdk import MALFORMED_REPLY, Reply, SDKProvider, StreamCut
from tesserix_adk.providers.base import ModelRequest, TextSink
from tesserix_adk.providers.pricing import Price, Prices
from tesserix_adk.tools import ToolSpec

__all__ = ["AnthropicProvider", "Price"]


class AnthropicProvider(SDKProvider[anthropic.AsyncAnthropic]):
    """A ``Provider`` over ``anthropic.AsyncAnthropic`` and the Messages API with tools.

    ``model`` may carry the vendor prefix (``"anthropic:claude-haiku-4-5"``); the
    provider's own model is sent whatever the agent's ``model`` says. ``max_tokens`` is
    required by the API and sent on every call. Pass ``client`` to use an ``AsyncAnthropic``
    you configured yourself (its own retries and timeout apply). ``prices`` turns usage into
    micros (see ``tesserix_adk.providers.pricing``); input tokens include cache writes and
    reads, all charged at the input price — an upper bound, which is what a budget wants.
    """

    vendor = "anthropic"
    title = "Anthropic"
    reply_noun = "message"
    sdk: ClassVar[Any] = anthropic
    sdk_error = anthropic.AnthropicError

    def __init__(
        self,
        model: str,
        *,
        client: anthropic.AsyncAnthropic | None = None,
        base_url: str | None = None,
        api_key: str | None = None,
        prices: Prices = None,
        max_retries: int = 2,
        timeout: float = 60.0,
        max_tokens: int = 1024,
    ) -> None:
        # Checked before the base builds a client, so a refused provider leaves none open.
        if max_tokens < 1:
            raise ConfigurationError(f"max_tokens must be at least 1, got {max_tokens}")
        self.max_tokens = max_tokens
        super().__init__(
            model,
            client=client,
            base_url=base_url,
            api_key=api_key,
            prices=prices,
            max_retries=max_retries,
            timeout=timeout,
        )

    def request_body(self, request: ModelRequest) -> dict[str, Any]:
        """The keyword arguments for ``messages.create`` (the wire body)."""
        system, turns = _wire_turns(request.instructions, request.messages)
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": self.max_tokens,
            "messages": turns,
        }
        if system:
            body["system"] = system
        if request.tools:
            body["tools"] = [_wire_tool(spec) for spec in request.tools]
        return body

    def _build_client(self, options: dict[str, Any]) -> anthropic.AsyncAnthropic:
        return anthropic.AsyncAnthropic(**options)

    async def _create(self, body: dict[str, Any]) -> object:
        wire: object = await self._client.messages.create(**body)
        return wire

    def _read(self, wire: object) -> Reply:
        if not isinstance(wire, WireMessage):
            raise TypeError(f"the body is a {type(wire).__name__}, not a message")
        return _read_message(wire)

    def _usage_of(self, wire: object) -> Usage | None:
        try:
            return _usage(wire.usage) if isinstance(wire, WireMessage) else None
        except (ProviderError, *MALFORMED_REPLY):
            return None

    async def _stream(self, body: dict[str, Any], on_text: TextSink) -> Reply:
        stopped = delta_seen = False
        # The tool inputs as sent: the SDK's snapshot parses them leniently (a cut-off
        # `{"amount": 10` reads as a whole object), so they are parsed again, strictly.
        raw_inputs: dict[int, str] = {}
        async with self._client.messages.stream(**body) as stream:
            try:
                async for event in stream:
                    if event.type == "text":
                        on_text(event.text)
                    elif (
                        event.type == "content_block_delta"
                        and event.delta.type == "input_json_delta"
                    ):
                        raw_inputs[event.index] = raw_inputs.get(event.index, "") + str(
                            event.delta.partial_json
                        )
                    elif event.type == "message_delta":
                        delta_seen = True
                    elif event.type == "message_stop":
                        stopped = True
            except ProviderError:
                raise  # the kit's own refusal, not a cut
            except Exception as exc:
                if not delta_seen:
                    raise
                # Cut after message_delta told what the call used: it is billed, so charged.
                raise StreamCut(
                    f"the stream broke after its usage: {type(exc).__name__}",
                    usage=self._usage_of(stream.current_message_snapshot),
                ) from exc
            if not stopped:
                # The SDK hands out its snapshot however far the stream got; past
                # message_delta it holds the usage the call is billed by.
                raise StreamCut(
                    "no message_stop",
                    usage=self._usage_of(stream.current_message_snapshot) if delta_seen else None,
                )
            if not delta_seen:
                # message_delta carries the output tokens; without it the snapshot holds
                # message_start's placeholder count and the call would be undercharged.
                raise StreamCut("no message_delta before message_stop")
            wire = await stream.get_final_message()
        return _read_message(wire, raw_inputs)


# --- our messages → the wire ----------------------------------------------------------------


def _wire_turns(instructions: str, messages: Sequence[Message]) -> tuple[str, list[dict[str, Any]]]:
    """The top-level system text and the alternating user/assistant turns."""
    system = [instructions] if instructions else []
    turns: list[dict[str, Any]] = []
    for m in messages:
        if m.role is Role.system:
            system.append(_text_only(m))
            continue
        role, blocks = _wire_blocks(m)
        if not blocks:
            continue  # the API refuses empty content; an empty message says nothing
        if turns and turns[-1]["role"] == role:
            turns[-1]["content"].extend(blocks)  # the API wants turns to alternate
        else:
            turns.append({"role": role, "content": blocks})
    return "\n\n".join(system), turns


def _wire_blocks(m: Message) -> tuple[str, list[dict[str, Any]]]:
    if m.role is Role.user:
        return "user", _content_blocks(m.content)
    if m.role is Role.assistant:
        blocks: list[dict[str, Any]] = [{"type": "text", "text": m.text}] if m.text else []
        blocks += [
            {"type": "tool_use", "id": c.id, "name": c.name, "input": dict(c.arguments)}
            for c in m.tool_calls
        ]
        return "assistant", blocks
    if m.tool_call_id is None:
        raise ConfigurationError("a tool message without tool_call_id cannot be sent")
    content: str | list[dict[str, Any]] = (
        m.content if isinstance(m.content, str) else _content_blocks(m.content)
    )
    return "user", [
        {
            "type": "tool_result",
            "tool_use_id": m.tool_call_id,
            "content": content,
            "is_error": m.is_error,
        }
    ]


def _content_blocks(content: str | Sequence[Part]) -> list[dict[str, Any]]:
    parts: Sequence[Part] = [TextPart(text=content)] if isinstance(content, str) else content
    return [_wire_part(p) for p in parts if not (isinstance(p, TextPart) and not p.text)]


def _wire_part(part: Part) -> dict[str, Any]:
    if isinstance(part, TextPart):
        return {"type": "text", "text": part.text}
    source = {
        "type": "base64",
        "media_type": part.media_type,
        "data": base64.b64encode(part.data).decode("ascii"),
    }
    if part.media_type.startswith("image/"):
        return {"type": "image", "source": source}
    if part.media_type == "application/pdf":
        return {"type": "document", "source": source}
    raise ConfigurationError(f"the Messages API cannot take a {part.media_type!r} part")


def _wire_tool(spec: ToolSpec) -> dict[str, Any]:
    return {
        "name": spec.name,
        "description": spec.description,
        "input_schema": dict(spec.parameters),
    }


def _text_only(message: Message) -> str:
    if not isinstance(message.content, str) and any(
        isinstance(p, BinaryPart) for p in message.content
    ):
        raise ConfigurationError("a system message cannot carry binary parts")
    return message.text


# --- the wire → our message ----------------------------------------------------------------

# Stop reasons of a reply the model did not finish: out of tokens or of context, or stopped
# by the vendor's classifiers part way. Its calls may read whole and still be cut short.
_CUT_OFF = frozenset({"max_tokens", "model_context_window_exceeded", "refusal"})


def _read_message(wire: WireMessage, raw_inputs: Mapping[int, str] | None = None) -> Reply:
    """Our message from the wire's; ``raw_inputs`` are the streamed tool inputs by block
    index, which decide the arguments (parsed strictly) over the SDK's snapshot. A reply
    cut off at ``max_tokens`` has its calls refused (``cut_off``)."""
    texts: list[str] = []
    calls: list[ToolCall] = []
    for index, block in enumerate(wire.content):
        if block.type == "text":
            texts.append(str(block.text))
        elif block.type == "tool_use":
            arguments = block.input
            if raw_inputs is not None and index in raw_inputs:
                arguments = arguments_from_text(raw_inputs[index])
            elif not isinstance(arguments, dict):
                arguments = {MALFORMED_ARGUMENTS: json.dumps(arguments)}
            calls.append(ToolCall(id=str(block.id), name=str(block.name), arguments=arguments))
    stop = wire.stop_reason if isinstance(wire.stop_reason, str) else None
    if stop in _CUT_OFF and calls:
        calls = cut_off(calls, f"the reply was cut off ({stop}) while it was written")
    return Reply(
        message=Message.assistant("".join(texts), calls),
        usage=_usage(wire.usage),
        model=str(wire.model),
        finish_reason=stop,
    )


def _usage(usage: Any) -> Usage:
    """The tokens a message used (its cache's reads and writes are input too)."""
    input_tokens = sum(
        token_count(getattr(usage, name, None), name)
        for name in ("input_tokens", "cache_creation_input_tokens", "cache_read_input_tokens")
    )
    return Usage(
        input_tokens=input_tokens,
        output_tokens=token_count(usage.output_tokens, "output_tokens"),
    )
