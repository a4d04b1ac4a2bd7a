"""How an MCP toolset reads what came back for a call: the errors the SDK makes up itself
when no whole answer came (a lost reply, the call in doubt) told apart from a server's own,
whether a message the transport could not read may have been a reply, and what error texts
may show of a server's URL."""

from __future__ import annotations

import asyncio
from typing import Any
from urllib.parse import urlsplit

from pydantic import ValidationError

try:
    from mcp import Client
    from mcp.shared.exceptions import MCPError as SdkError
    from mcp_types import (
        CONNECTION_CLOSED,
        INTERNAL_ERROR,
        INVALID_REQUEST,
        METHOD_NOT_FOUND,
        PARSE_ERROR,
        REQUEST_TIMEOUT,
    )
except ImportError as exc:  # pragma: no cover - exercised without the extra installed
    raise ImportError(
        'tesserix_adk.mcp needs the MCP SDK: pip install "tesserix-adk[mcp]"'
    ) from exc

__all__ = [
    "Unread",
    "maybe_a_reply",
    "sdk_closed",
    "session_gone",
    "shown_url",
    "stand_in",
    "wound_down",
]


# The errors the SDK makes up itself when no whole answer came, told apart from a server's
# own JSON-RPC errors by code and text (the codes alone sit in the range servers use for
# their own errors): the connection closed, the wait ran out, an SSE stream cut or given
# up, a 202 or a redirect instead of an answer, a body that is not JSON-RPC (a proxy's
# page, a cut body), or an HTTP status with no JSON-RPC error in its body (a gateway's 502
# or 504 may come after the call was forwarded). Each text is the start of the SDK's own;
# ``tests/mcp_tools/test_mcp_stand_ins.py`` checks the installed SDK makes no other.
_STAND_INS: dict[int, tuple[tuple[str, str], ...]] = {
    CONNECTION_CLOSED: (
        ("Connection closed", "closed"),
        ("SSE stream failed: ", "http"),
        ("SSE stream ended without a response", "http"),
        ("SSE stream ended and reconnection attempts were exhausted", "http"),
    ),
    INTERNAL_ERROR: (("Server returned an error response", "http"),),
    INVALID_REQUEST: (
        ("Session terminated", "http"),
        ("server answered a request with 202 Accepted", "http"),
        ("Redirect to ", "http"),
        ("Unexpected content type: ", "http"),
    ),
    METHOD_NOT_FOUND: (("Not Found", "http"),),
    PARSE_ERROR: (
        ("Failed to parse JSON response: ", "http"),
        ("Failed to parse SSE message: ", "http"),
    ),
}


def stand_in(exc: SdkError) -> str | None:
    """What kind of SDK stand-in ``exc`` is (the call may have run), or ``None`` for an
    error the server answered. A server's own internal error is one too: it failed while
    it handled the call (its session ended mid-call, its handler's result was invalid),
    perhaps after the tool ran."""
    if exc.code == INTERNAL_ERROR:
        return "http" if exc.message == "Server returned an error response" else "internal"
    if (
        exc.code == REQUEST_TIMEOUT
        and exc.message.startswith("Request ")
        and exc.message.endswith(" timed out")
    ):
        return "timeout"
    for start, kind in _STAND_INS.get(exc.code, ()):
        whole = not start.endswith(" ")
        if exc.message == start if whole else exc.message.startswith(start):
            return kind
    return None


class Unread(Exception):
    """A message came while the call waited that the transport could not read."""


def session_gone(exc: SdkError) -> bool:
    """Whether ``exc`` is a streamable-HTTP server saying it does not know the session the
    request named (the SDK's own server: 404, ``Session not found``): it restarted, and the
    request was refused whole, so nothing ran; this connection is over."""
    return exc.code == INVALID_REQUEST and exc.message == "Session not found"


def sdk_closed(client: Client) -> bool:
    """Whether the SDK already knows the connection closed (a server that died while
    idle): its dispatcher then refuses a call before writing a byte. Read from the SDK's
    private state, as it offers no public one; where that is not found, ``False``, and a
    call then fails as sent with no reply (in doubt), never the other way round."""
    dispatcher = getattr(getattr(client, "session", None), "_dispatcher", None)
    return getattr(dispatcher, "_closed", False) is True


# The longest path segment shown whole: words such as ``mcp`` or ``v1`` are shorter, the
# tokens some services put in a server's path (``/s/<token>/mcp``) longer.
_SHOWN_SEGMENT = 12


def shown_url(url: str) -> str:
    """``url`` without what may hold a credential (user info, query, fragment, and a path
    segment longer than a word, shown as ``…``): it goes into error texts a model is told."""
    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
        port = f":{parts.port}" if parts.port is not None else ""
    except ValueError:
        return "(a URL that cannot be read)"
    if ":" in host:
        host = f"[{host}]"
    path = "/".join(seg if len(seg) <= _SHOWN_SEGMENT else "…" for seg in parts.path.split("/"))
    return f"{parts.scheme}://{host}{port}{path}"


async def wound_down(sent: asyncio.Future[Any]) -> None:
    """Wait for ``sent``, cancelled by the caller, to end; its own outcome is dropped, but a
    cancellation of the task waiting here goes on (never swallowed with it)."""
    try:
        await sent
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise
    except BaseException:  # the call's own end, already accounted for
        pass


def maybe_a_reply(exc: Exception) -> bool:
    """Whether a message the transport could not read may have been some call's reply: a
    JSON-RPC reply is a JSON object, so a line that does not start as one (a log line a
    server printed on stdout) or an object with neither ``result``, ``error`` nor ``id``
    (a structured log line) is nobody's. Anything else, or an error that does not say what
    it read, may be."""
    if not isinstance(exc, ValidationError):
        return True
    for error in exc.errors(include_url=False):
        read = error.get("input")
        if isinstance(read, str) and not read.lstrip().startswith("{"):
            continue
        if isinstance(read, dict) and not read.keys() & {"result", "error", "id"}:
            continue
        return True
    return False
