"""A fake model server on 127.0.0.1: it answers like the OpenAI and Anthropic APIs.

Each test queues the replies it wants (a completion with tool calls, a 429, a 500, a body
that is not JSON) and the real SDK, pointed at the server with ``base_url``, talks to it
over HTTP. Every request is recorded with its parsed JSON body, so a test can check what the
SDK actually sent.
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
