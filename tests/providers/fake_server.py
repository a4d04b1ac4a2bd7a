"""A fake model server on 127.0.0.1: it answers like the OpenAI and Anthropic APIs.

Each test queues the replies it wants (a completion with tool calls, a 429, a 500, a body
that is not JSON) and the real SDK, pointed at the server with ``base_url``, talks to it
over HTTP. Every request is recorded with its parsed JSON body, so a test can check what the
SDK actually sent.

A reply may also be a stream of server-sent events (``Reply(events=...)``, built by
``openai_stream``/``anthropic_stream``), cut short mid-stream (``cut_after``: the body
declared longer than what is sent, so the client sees the connection drop) or held open
(``hold_after``: the server sends that many events and waits until it is stopped).
"""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

# Environment the SDKs read that would send a test somewhere else or change its requests.
SDK_ENVIRONMENT = (
    "HTTP_PROXY",
    "HTTPS_PROXY",
    "ALL_PROXY",
    "http_proxy",
    "https_proxy",
    "all_proxy",
    "OPENAI_API_KEY",
    "OPENAI_BASE_URL",
    "OPENAI_ORG_ID",
    "OPENAI_PROJECT_ID",
    "ANTHROPIC_API_KEY",
    "ANTHROPIC_AUTH_TOKEN",
    "ANTHROPIC_BASE_URL",
    "ANTHROPIC_CUSTOM_HEADERS",
    "ANTHROPIC_PROFILE",
    "ANTHROPIC_CONFIG_DIR",
)


@dataclass(frozen=True, slots=True, kw_only=True)
class Reply:
    """One queued answer: a status, a body (a dict is sent as JSON) and headers."""

    status: int = 200
    body: Mapping[str, Any] | str = field(default_factory=dict)
    headers: Mapping[str, str] = field(default_factory=dict)
    content_type: str = "application/json"
    delay: float = 0.0  # seconds to wait before answering (for client timeouts)
    events: Sequence[str] = ()  # server-sent event frames: the reply is a stream
    cut_after: int | None = None  # send this many frames, then drop the connection
    hold_after: int | None = None  # send this many frames, then wait for ``stop``


@dataclass(frozen=True, slots=True, kw_only=True)
class Recorded:
    """One request the server received."""

    path: str
    headers: Mapping[str, str]
    body: dict[str, Any]
    raw: bytes


class ModelServer:
    """Replays queued replies in order and records every request."""

    def __init__(self) -> None:
        self._replies: deque[Reply] = deque()
        self._lock = threading.Lock()
        self.requests: list[Recorded] = []
        self.unexpected = 0
        self.stopping = threading.Event()  # releases the streams held open
        self._http = _QuietServer(("127.0.0.1", 0), _Handler)
        self._http.model_server = self  # type: ignore[attr-defined]
        # A short poll interval: ``shutdown`` waits up to one interval.
        self._thread = threading.Thread(
            target=self._http.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
        )

    @property
    def url(self) -> str:
        """``http://127.0.0.1:<port>``, the base URL the SDKs are pointed at."""
        host, port = self._http.server_address[:2]
        return f"http://{host!s}:{port}"

    def queue(self, *replies: Reply | Mapping[str, Any]) -> None:
        """Queue replies; a plain mapping is a 200 with that JSON body."""
        with self._lock:
            for reply in replies:
                self._replies.append(reply if isinstance(reply, Reply) else Reply(body=reply))

    @property
    def pending(self) -> int:
        """Replies queued and not yet sent."""
        with self._lock:
            return len(self._replies)

    @property
    def bodies(self) -> list[dict[str, Any]]:
        """The JSON bodies of every request so far."""
        return [r.body for r in self.requests]

    def _next(self, recorded: Recorded) -> Reply:
        with self._lock:
            self.requests.append(recorded)
            if self._replies:
                return self._replies.popleft()
            self.unexpected += 1
        # Told not to retry, so a test that asks more than it queued fails at once.
        return Reply(
            status=500,
            body={"error": {"message": "fake server: no reply queued", "type": "server_error"}},
            headers={"x-should-retry": "false"},
        )

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self.stopping.set()
        self._http.shutdown()
        self._http.server_close()
        self._thread.join(timeout=5)


class _QuietServer(ThreadingHTTPServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that timed out and hung up is what the test asked for


class _Handler(BaseHTTPRequestHandler):
    # HTTP/1.0: one request per connection, so nothing is left open when the test ends.
    protocol_version = "HTTP/1.0"

    def do_POST(self) -> None:
        length = int(self.headers.get("content-length") or 0)
        raw = self.rfile.read(length)
        try:
            body = json.loads(raw) if raw else {}
        except ValueError:
            body = {"_unparsed": raw.decode("utf-8", errors="replace")}
        server: ModelServer = self.server.model_server  # type: ignore[attr-defined]
        reply = server._next(
            Recorded(
                path=self.path,
                headers={k.lower(): v for k, v in self.headers.items()},
                body=body,
                raw=raw,
            )
        )
        if reply.delay:
            time.sleep(reply.delay)
        if reply.events:
            self._stream(server, reply)
            return
        payload = (
            reply.body.encode("utf-8")
            if isinstance(reply.body, str)
            else json.dumps(reply.body).encode("utf-8")
        )
        self.send_response(reply.status)
        self.send_header("content-type", reply.content_type)
        self.send_header("content-length", str(len(payload)))
        for name, value in reply.headers.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(payload)

    def _stream(self, server: ModelServer, reply: Reply) -> None:
        frames = [f.encode("utf-8") for f in reply.events]
        self.send_response(reply.status)
        self.send_header("content-type", "text/event-stream")
        self.send_header("cache-control", "no-cache")
        if reply.cut_after is not None:
            # Declared whole, sent in part: the client reads a body that stops short.
            self.send_header("content-length", str(sum(len(f) for f in frames)))
        for name, value in reply.headers.items():
            self.send_header(name, value)
        self.end_headers()
        stop_at = reply.cut_after if reply.cut_after is not None else reply.hold_after
        for frame in frames[:stop_at]:
            self.wfile.write(frame)
            self.wfile.flush()
        if reply.hold_after is not None:
            server.stopping.wait()
        # HTTP/1.0 without a length: the stream ends when the connection closes.

    def log_message(self, format: str, *args: Any) -> None:
        pass  # quiet: pytest shows what matters


# --- realistic bodies ------------------------------------------------------------------------

Call = tuple[str, str, Mapping[str, Any] | str]  # (call id, tool name, arguments)


def openai_completion(
    text: str | None = None,
    calls: Sequence[Call] = (),
    *,
    usage: tuple[int, int] = (120, 30),
    model: str = "gpt-4o-2024-08-06",
) -> dict[str, Any]:
    """A Chat Completions body; arguments given as a string are sent verbatim."""
    tool_calls = [
        {
            "id": call_id,
            "type": "function",
            "function": {
                "name": name,
                "arguments": args if isinstance(args, str) else json.dumps(args),
            },
        }
        for call_id, name, args in calls
    ]
    message: dict[str, Any] = {
        "role": "assistant",
        "content": text,
        "refusal": None,
        "annotations": [],
    }
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {
        "id": "chatcmpl-A1b2C3d4E5f6G7h8I9j0",
        "object": "chat.completion",
        "created": 1_727_000_000,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "logprobs": None,
                "finish_reason": "tool_calls" if tool_calls else "stop",
            }
        ],
        "usage": {
            "prompt_tokens": usage[0],
            "completion_tokens": usage[1],
            "total_tokens": usage[0] + usage[1],
            "prompt_tokens_details": {"cached_tokens": 0, "audio_tokens": 0},
            "completion_tokens_details": {"reasoning_tokens": 0, "audio_tokens": 0},
        },
        "service_tier": "default",
        "system_fingerprint": "fp_5f20662549",
    }


def anthropic_message(
    text: str | None = None,
    calls: Sequence[Call] = (),
    *,
    usage: tuple[int, int] = (120, 30),
    model: str = "claude-haiku-4-5-20251001",
) -> dict[str, Any]:
    """A Messages API body."""
    content: list[dict[str, Any]] = [{"type": "text", "text": text}] if text else []
    content += [
        {"type": "tool_use", "id": call_id, "name": name, "input": args}
        for call_id, name, args in calls
    ]
    return {
        "id": "msg_01XFDUDYJgAACzvnptvVoYEL",
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": "tool_use" if calls else "end_turn",
        "stop_sequence": None,
        "usage": {
            "input_tokens": usage[0],
            "output_tokens": usage[1],
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0,
        },
    }


def _pieces(text: str, count: int) -> list[str]:
    """``text`` in ``count`` pieces (fewer if it is shorter)."""
    size = max(1, -(-len(text) // count))
    return [text[i : i + size] for i in range(0, len(text), size)]


def _arguments_text(args: Mapping[str, Any] | str) -> str:
    return args if isinstance(args, str) else json.dumps(args)


def openai_stream(
    text: str | None = None,
    calls: Sequence[Call] = (),
    *,
    usage: tuple[int, int] = (120, 30),
    model: str = "gpt-4o-2024-08-06",
    pieces: int = 3,
) -> list[str]:
    """A streamed Chat Completion as ``stream_options={"include_usage": True}`` sends it:
    text deltas, each call's id and name then its arguments in pieces, a chunk with the
    finish reason, a last chunk with the usage and no choices, and ``[DONE]``."""

    def chunk(delta: dict[str, Any] | None, finish: str | None = None, **extra: Any) -> str:
        body: dict[str, Any] = {
            "id": "chatcmpl-A1b2C3d4E5f6G7h8I9j0",
            "object": "chat.completion.chunk",
            "created": 1_727_000_000,
            "model": model,
            "system_fingerprint": "fp_5f20662549",
            "service_tier": "default",
            "choices": []
            if delta is None
            else [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
            "usage": None,
            **extra,
        }
        return f"data: {json.dumps(body)}\n\n"

    frames = [chunk({"role": "assistant", "content": "", "refusal": None})]
    frames += [chunk({"content": piece}) for piece in _pieces(text or "", pieces)]
    for index, (call_id, name, args) in enumerate(calls):
        frames.append(
            chunk(
                {
                    "tool_calls": [
                        {
                            "index": index,
                            "id": call_id,
                            "type": "function",
                            "function": {"name": name, "arguments": ""},
                        }
                    ]
                }
            )
        )
        frames += [
            chunk({"tool_calls": [{"index": index, "function": {"arguments": piece}}]})
            for piece in _pieces(_arguments_text(args), pieces)
        ]
    frames.append(chunk({}, "tool_calls" if calls else "stop"))
    total = {"prompt_tokens": usage[0], "completion_tokens": usage[1]}
    frames.append(chunk(None, usage={**total, "total_tokens": usage[0] + usage[1]}))
    frames.append("data: [DONE]\n\n")
    return frames


def anthropic_stream(
    text: str | None = None,
    calls: Sequence[Call] = (),
    *,
    usage: tuple[int, int] = (120, 30),
    model: str = "claude-haiku-4-5-20251001",
    pieces: int = 3,
) -> list[str]:
    """A streamed Messages API reply: ``message_start`` (input tokens), each content block
    started, its deltas (text, or a call's input as partial JSON) and stopped, then
    ``message_delta`` (stop reason, output tokens) and ``message_stop``."""

    def event(kind: str, **body: Any) -> str:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **body})}\n\n"

    start_usage = {
        "input_tokens": usage[0],
        "output_tokens": 1,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
    }
    frames = [
        event(
            "message_start",
            message={
                "id": "msg_01XFDUDYJgAACzvnptvVoYEL",
                "type": "message",
                "role": "assistant",
                "model": model,
                "content": [],
                "stop_reason": None,
                "stop_sequence": None,
                "usage": start_usage,
            },
        )
    ]
    index = 0
    if text:
        frames.append(
            event("content_block_start", index=0, content_block={"type": "text", "text": ""})
        )
        frames += [
            event("content_block_delta", index=0, delta={"type": "text_delta", "text": piece})
            for piece in _pieces(text, pieces)
        ]
        frames.append(event("content_block_stop", index=0))
        index = 1
    for offset, (call_id, name, args) in enumerate(calls):
        block = index + offset
        frames.append(
            event(
                "content_block_start",
                index=block,
                content_block={"type": "tool_use", "id": call_id, "name": name, "input": {}},
            )
        )
        frames += [
            event(
                "content_block_delta",
                index=block,
                delta={"type": "input_json_delta", "partial_json": piece},
            )
            for piece in _pieces(_arguments_text(args), pieces)
        ]
        frames.append(event("content_block_stop", index=block))
    frames.append(
        event(
            "message_delta",
            delta={"stop_reason": "tool_use" if calls else "end_turn", "stop_sequence": None},
            usage={"output_tokens": usage[1]},
        )
    )
    frames.append(event("message_stop"))
    return frames


def openai_error(status: int, message: str, kind: str) -> Reply:
    """An OpenAI error reply; retriable ones ask for a 1 ms wait, to keep tests fast."""
    headers = {"retry-after-ms": "1"} if status in (429,) or status >= 500 else {}
    return Reply(
        status=status,
        body={"error": {"message": message, "type": kind, "param": None, "code": None}},
        headers=headers,
    )


def anthropic_error(status: int, message: str, kind: str) -> Reply:
    """An Anthropic error reply; retriable ones ask for a 1 ms wait, to keep tests fast."""
    headers = {"retry-after-ms": "1"} if status in (429,) or status >= 500 else {}
    return Reply(
        status=status,
        body={"type": "error", "error": {"type": kind, "message": message}},
        headers=headers,
    )


MALFORMED = Reply(status=200, body='{"id": "chatcmpl-trunc', content_type="application/json")
"""A 200 whose JSON body was cut short."""
