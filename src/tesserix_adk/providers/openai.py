"""``OpenAIProvider``: OpenAI Chat Completions, and any server that speaks it (vLLM,
llama.cpp's server, Ollama), through the official ``openai`` SDK.

What it owns: mapping our messages to the wire and back, the cost of a call, and turning
the SDK's errors into ``ProviderError`` once, at this boundary.

- Transient failures (429, 408, 409, 5xx, timeouts, dropped connections) are retried by the
  SDK itself (``max_retries``, its own backoff, honouring ``retry-after-ms``/``retry-after``);
  a model call is safe to repeat. Only when the SDK gives up does the error reach the runner,
  as ``ProviderError(retryable=True)``: the run stops and stays resumable. A rejected
  request (400, 401, 403, 404, 422) is ``retryable=False``: the run ends ``failed``.
- A body that is not JSON or lacks the fields of a completion is ``retryable=True``.
- The provider never runs a tool, so it never repeats one.
- Streaming (``complete_streaming``, used by ``AgentRunner.stream``) sends ``stream=True``
  with ``stream_options={"include_usage": True}``, tells the text deltas on as they come and
  assembles the whole message (tool calls from their argument fragments, usage from the last
  chunk) before returning, so the ``after_model_call`` checkpoint is written only once the
  whole message has arrived, as without streaming. A stream that breaks, or ends before a
  ``finish_reason`` or before the usage chunk ``include_usage`` asks for, is
  ``retryable=True``: nothing of it is kept, the model is asked again; one that breaks after
  its usage chunk is charged first (the vendor bills it). A reply taken whole without its
  usage would be charged nothing: a plain completion without one ends the run ``failed``
  (asking again would pay again, uncounted). For a server that never sends usage, pass
  ``require_stream_usage=False``: its calls are then counted at 0 tokens.
- Tool-call arguments that are not a JSON object are kept as
  ``{"_malformed_arguments": "<raw text>"}``: the tool's validation refuses them, the model
  is answered with an ``is_error`` result and can ask again, and the raw text is sent back
  verbatim as what the assistant said.
- The API key lives in the SDK client only; it is never put in a message, and is scrubbed
  from error text.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

try:
    import openai
    from openai.types.chat import ChatCompletion
except ImportError as exc:  # pragma: no cover - exercised by a test that hides the package
    raise ImportError(
        'tesserix_adk.providers.openai needs the openai package: pip install "tesserix-adk[openai]"'
    ) from exc

from tesserix_adk.errors import ConfigurationError, ProviderError
from tesserix_adk.messages import BinaryPart, Message, Part, Role, TextPart, ToolCall, Usage
from tesserix_adk.providers._common import (
    arguments_from_text,
    arguments_to_text,
    cut_off,
    token_count,
    uncharged,
)
from tesserix_adk.providers._sdk import MALFORMED_REPLY, Reply, SDKProvider, StreamCut
from tesserix_adk.providers.base import ModelRequest, TextSink
from tesserix_adk.providers.pricing import Price, Prices
from tesserix_adk.tools import ToolSpec

__all__ = ["OpenAIProvider", "Price"]


class OpenAIProvider(SDKProvider[openai.AsyncOpenAI]):
    """A ``Provider`` over ``openai.AsyncOpenAI`` and Chat Completions with tools.

    ``model`` may carry the vendor prefix (``"openai:gpt-4o"``); the provider's own model is
    sent whatever the agent's ``model`` says. Pass ``client`` to use an ``AsyncOpenAI`` you
    configured yourself (its own retries and timeout apply), or ``base_url``/``api_key`` for
    a local server (any non-empty key for one that checks none). ``prices`` turns usage into
    micros (see ``tesserix_adk.providers.pricing``); without it every call costs 0.
    ``require_stream_usage=False`` takes a reply whole without its usage (a stream's
    chunk, a completion's field), for a server that never sends one (its calls then cost
    0).
    """

    vendor = "openai"
    title = "OpenAI"
    reply_noun = "completion"
    client_hint = (
        " (set OPENAI_API_KEY or pass api_key=; any non-empty key for a local server "
        "that checks none)"
    )
    sdk: ClassVar[Any] = openai
    sdk_error = openai.OpenAIError

    def __init__(
        self,
        model: str,
        *,
        client: openai.AsyncOpenAI | None = None,
        base_url: str | None = None,
        api_key: str | None = None,
        prices: Prices = None,
        max_retries: int = 2,
        timeout: float = 60.0,
        max_tokens: int | None = None,
        parallel_tool_calls: bool | None = None,
        require_stream_usage: bool = True,
    ) -> None:
        self.max_tokens = max_tokens
        self.require_stream_usage = require_stream_usage
        self.parallel_tool_calls = parallel_tool_calls
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
        """The keyword arguments for ``chat.completions.create`` (the wire body)."""
        body: dict[str, Any] = {
            "model": self.model,
            "messages": _wire_messages(request.instructions, request.messages),
        }
        if request.tools:
            body["tools"] = [_wire_tool(spec) for spec in request.tools]
            if self.parallel_tool_calls is not None:
                body["parallel_tool_calls"] = self.parallel_tool_calls
        if self.max_tokens is not None:
            # ``max_tokens`` rather than ``max_completion_tokens``: every OpenAI-compatible
            # server understands it.
            body["max_tokens"] = self.max_tokens
        return body

    def _build_client(self, options: dict[str, Any]) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(**options)

    async def _create(self, body: dict[str, Any]) -> object:
        completion: object = await self._client.chat.completions.create(**body)
        return completion

    def _read(self, wire: object) -> Reply:
        if not isinstance(wire, ChatCompletion):
            raise TypeError(f"the body is a {type(wire).__name__}, not a completion")
        reply = _read_completion(wire)
        if wire.usage is None and self.require_stream_usage:
            # As a stream without its usage chunk: taken whole, it would be charged nothing.
            raise uncharged("a completion without its usage")
        return reply

    def _usage_of(self, wire: object) -> Usage | None:
        try:
            return _usage(wire.usage) if isinstance(wire, ChatCompletion) and wire.usage else None
        except (ProviderError, *MALFORMED_REPLY):
            return None

    async def _stream(self, body: dict[str, Any], on_text: TextSink) -> Reply:
        stream = await self._client.chat.completions.create(
            **body, stream=True, stream_options={"include_usage": True}
        )
        reply = _StreamedReply()
        try:
            async with stream:
                async for chunk in stream:
                    reply.add(chunk, on_text)
        except ProviderError:
            raise  # the kit's own refusal (a count it cannot charge), not a cut
        except Exception as exc:
            if not reply.usage_seen:
                raise
            # Cut after the vendor told what the call used: it is billed, so it is charged.
            raise StreamCut(
                f"the stream broke after its usage: {type(exc).__name__}", usage=reply.usage
            ) from exc
        try:
            return reply.whole(with_usage=self.require_stream_usage)
        except MALFORMED_REPLY as exc:
            if not reply.usage_seen:
                raise
            # Whole and billed, but not readable: charged as the vendor told, asked again.
            raise StreamCut(
                f"the reply cannot be read: {type(exc).__name__}: {exc}", usage=reply.usage
            ) from exc


# --- our messages → the wire ----------------------------------------------------------------


def _wire_messages(instructions: str, messages: Sequence[Message]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if instructions:
        out.append({"role": "system", "content": instructions})
    for m in messages:
        if m.role is Role.system:
            out.append({"role": "system", "content": _text_only(m)})
        elif m.role is Role.user:
            out.append({"role": "user", "content": _user_content(m.content)})
        elif m.role is Role.assistant:
            item: dict[str, Any] = {"role": "assistant"}
            # ``null`` content is the documented form for a turn that only calls tools.
            item["content"] = m.text if m.text or not m.tool_calls else None
            if m.tool_calls:
                item["tool_calls"] = [_wire_call(c) for c in m.tool_calls]
            out.append(item)
        else:
            if m.tool_call_id is None:
                raise ConfigurationError("a tool message without tool_call_id cannot be sent")
            text = _text_only(m)
            # Chat Completions has no error flag on a tool result; say it in the text.
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": m.tool_call_id,
                    "content": f"error: {text}" if m.is_error else text,
                }
            )
    return out


def _wire_call(call: ToolCall) -> dict[str, Any]:
    return {
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": arguments_to_text(call.arguments)},
    }


def _wire_tool(spec: ToolSpec) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": spec.name,
            "description": spec.description,
            "parameters": dict(spec.parameters),
        },
    }


def _text_only(message: Message) -> str:
    if not isinstance(message.content, str) and any(
        isinstance(p, BinaryPart) for p in message.content
    ):
        raise ConfigurationError(
            f"Chat Completions takes binary parts only in user messages, not {message.role}"
        )
    return message.text


def _user_content(content: str | Sequence[Part]) -> str | list[dict[str, Any]]:
    if isinstance(content, str):
        return content
    return [_wire_part(p) for p in content]


def _wire_part(part: Part) -> dict[str, Any]:
    if isinstance(part, TextPart):
        return {"type": "text", "text": part.text}
    url = f"data:{part.media_type};base64,{base64.b64encode(part.data).decode('ascii')}"
    if part.media_type.startswith("image/"):
        return {"type": "image_url", "image_url": {"url": url}}
    if part.media_type == "application/pdf":
        return {"type": "file", "file": {"filename": "document.pdf", "file_data": url}}
    raise ConfigurationError(f"Chat Completions cannot take a {part.media_type!r} part")


# --- the wire → our message ----------------------------------------------------------------


def _read_completion(completion: ChatCompletion) -> Reply:
    if not completion.choices:
        raise IndexError("the completion has no choices")
    choice = completion.choices[0]
    wire = choice.message
    calls = _whole_calls([_read_call(c) for c in (wire.tool_calls or ())], choice.finish_reason)
    text = wire.content if wire.content is not None else (wire.refusal or "")
    if not isinstance(text, str):
        raise TypeError("the message content is not text")
    usage = Usage()
    if completion.usage is not None:
        usage = _usage(completion.usage)
    return Reply(
        message=Message.assistant(text, calls),
        usage=usage,
        model=completion.model if isinstance(completion.model, str) else None,
        finish_reason=_reason(choice.finish_reason),
    )


def _usage(usage: Any) -> Usage:
    return Usage(
        input_tokens=token_count(usage.prompt_tokens, "prompt_tokens"),
        output_tokens=token_count(usage.completion_tokens, "completion_tokens"),
    )


def _joined(pieces: list[object]) -> object:
    """A streamed call's arguments: its pieces of text joined, or the one object a server
    sent them as; pieces of both are no JSON (answered as malformed)."""
    if len(pieces) == 1:
        return pieces[0]
    if all(isinstance(p, str) for p in pieces):
        return "".join(str(p) for p in pieces)
    return repr(pieces)


def _reason(finish_reason: object) -> str | None:
    return finish_reason if isinstance(finish_reason, str) else None


def _whole_calls(calls: list[ToolCall], finish_reason: object) -> list[ToolCall]:
    """The calls of a reply; refused if the reply was cut short while written: out of
    tokens (``length``) or with content the vendor's filter left out (``content_filter``)."""
    if finish_reason in ("length", "content_filter") and calls:
        return cut_off(calls, f"the reply was cut off ({finish_reason}) while it was written")
    return calls


@dataclass(slots=True)
class _CallFragments:
    id: str = ""
    name: str = ""
    kind: str | None = None
    # Pieces of JSON text; a server that sends the arguments as an object sends one.
    arguments: list[object] = field(default_factory=list)


@dataclass(slots=True)
class _StreamedReply:
    """A streamed completion as its chunks arrive; whole once a choice has finished."""

    text: list[str] = field(default_factory=list)
    refusal: list[str] = field(default_factory=list)
    calls: dict[int, _CallFragments] = field(default_factory=dict)
    usage: Usage = field(default_factory=Usage)
    model: str | None = None
    finished: bool = False
    finish_reason: str | None = None
    usage_seen: bool = False

    def add(self, chunk: Any, on_text: TextSink) -> None:
        self.model = chunk.model or self.model
        if chunk.usage is not None:  # the last chunk, with no choices
            # Counts of null say nothing: such a chunk is not the usage asked for.
            u = chunk.usage
            self.usage = _usage(u)
            self.usage_seen = u.prompt_tokens is not None and u.completion_tokens is not None
        for choice in chunk.choices:
            if choice.index != 0:
                continue  # one choice is asked for
            delta = choice.delta
            if delta.content:
                self.text.append(delta.content)
                on_text(delta.content)
            if getattr(delta, "refusal", None):
                self.refusal.append(str(delta.refusal))
            for fragment in delta.tool_calls or ():
                call = self.calls.setdefault(int(fragment.index), _CallFragments())
                call.id = fragment.id or call.id
                call.kind = fragment.type or call.kind
                if fragment.function is not None:
                    # The name comes whole in one fragment; the arguments in pieces.
                    call.name = fragment.function.name or call.name
                    if fragment.function.arguments:
                        call.arguments.append(fragment.function.arguments)
            if choice.finish_reason is not None:
                self.finished = True
                self.finish_reason = _reason(choice.finish_reason)

    def whole(self, *, with_usage: bool) -> Reply:
        if not self.finished:
            raise StreamCut("no choice finished", usage=self.usage if self.usage_seen else None)
        if with_usage and not self.usage_seen:
            # The usage chunk follows the finished choice; a stream closed between the two
            # is cut, and taking it whole would charge the call nothing.
            raise StreamCut("no usage chunk after the finished choice")
        calls = []
        for _, fragments in sorted(self.calls.items()):
            if fragments.kind not in (None, "function"):
                raise TypeError(f"a tool call of type {fragments.kind!r}")
            if not fragments.id or not fragments.name:
                raise ValueError("a streamed tool call without its id or name")
            calls.append(
                ToolCall(
                    id=fragments.id,
                    name=fragments.name,
                    arguments=arguments_from_text(_joined(fragments.arguments)),
                )
            )
        text = "".join(self.text) or "".join(self.refusal)
        return Reply(
            message=Message.assistant(text, _whole_calls(calls, self.finish_reason)),
            usage=self.usage,
            model=self.model,
            finish_reason=self.finish_reason,
        )


def _read_call(call: Any) -> ToolCall:
    # We declare function tools only; any other kind of call is a malformed answer.
    if call.type != "function":
        raise TypeError(f"a tool call of type {call.type!r}")
    return ToolCall(
        id=str(call.id),
        name=str(call.function.name),
        arguments=arguments_from_text(call.function.arguments),
    )
