"""``Weighed``: a transport whose messages past a size in JSON values never reach the SDK.

After reading a message the SDK validates it again, in calls into pydantic-core that hold
the GIL throughout: a reply of a million small values stops the process, the run's lease
renewal included, for seconds. A message is weighed here first, by a walk that stops as
soon as the limit is passed; a reply past it is handed to the SDK as an internal error
answering the same request, so that call alone is in doubt (it ran, its reply was not
read), and nothing else is. The SDK's own first parse of the message is not bounded here.
"""

from __future__ import annotations

from types import TracebackType
from typing import Any

try:
    from mcp.client._transport import Transport, TransportStreams
    from mcp.shared._stream_protocols import ReadStream
    from mcp.shared.message import SessionMessage
    from mcp_types import INTERNAL_ERROR, ErrorData, JSONRPCError, JSONRPCResponse
except ImportError as exc:  # pragma: no cover - exercised without the extra installed
    raise ImportError(
        'tesserix_adk.mcp needs the MCP SDK: pip install "tesserix-adk[mcp]"'
    ) from exc

__all__ = ["DEFAULT_MAX_REPLY_ITEMS", "TOO_LARGE", "Weighed", "heavier_than"]

# JSON values (objects, arrays and scalars, each counted once) a message may hold. Here
# the SDK validates about a million a second, twice, so the default keeps that to about
# half a second.
DEFAULT_MAX_REPLY_ITEMS = 250_000

# The start of the error text a reply past the limit is answered with; the toolset tells
# it from a server's own internal error by it.
TOO_LARGE = "tesserix: a reply of more than "


def heavier_than(value: Any, limit: int) -> bool:
    """Whether ``value`` holds more than ``limit`` JSON values; stops counting once past."""
    left = [value]
    seen = 0
    while left:
        item = left.pop()
        seen += 1
        if seen > limit:
            return True
        if isinstance(item, dict):
            left.extend(item.values())
        elif isinstance(item, list):
            left.extend(item)
    return False


class Weighed:
    """``inner`` with each message it reads weighed before the SDK sees it."""

    __slots__ = ("_inner", "_limit")

    def __init__(self, inner: Transport, limit: int) -> None:
        self._inner = inner
        self._limit = limit

    async def __aenter__(self) -> TransportStreams:
        read, write = await self._inner.__aenter__()
        return _WeighedRead(read, self._limit), write

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        return await self._inner.__aexit__(exc_type, exc, tb)


class _WeighedRead:
    """The inner read stream: a response past the limit becomes an error answering the
    same request; any other message past it (a server's request or notification, which
    no call waits on) is dropped."""

    __slots__ = ("_inner", "_limit")

    def __init__(self, inner: ReadStream[SessionMessage | Exception], limit: int) -> None:
        self._inner = inner
        self._limit = limit

    async def receive(self) -> SessionMessage | Exception:
        while True:
            weighed = self._weighed(await self._inner.receive())
            if weighed is not None:
                return weighed

    async def __anext__(self) -> SessionMessage | Exception:
        while True:
            weighed = self._weighed(await self._inner.__anext__())
            if weighed is not None:
                return weighed

    def __aiter__(self) -> _WeighedRead:
        return self

    async def aclose(self) -> None:
        await self._inner.aclose()

    def _weighed(self, item: SessionMessage | Exception) -> SessionMessage | Exception | None:
        if not isinstance(item, SessionMessage):
            return item
        message = item.message
        body: Any
        if isinstance(message, JSONRPCResponse):
            body = message.result
        elif isinstance(message, JSONRPCError):
            body = message.error.data
        else:
            body = message.params
        if not heavier_than(body, self._limit):
            return item
        if isinstance(message, JSONRPCResponse | JSONRPCError) and message.id is not None:
            said = f"{TOO_LARGE}{self._limit:,} JSON values came and was not read"
            error = ErrorData(code=INTERNAL_ERROR, message=said)
            answer = JSONRPCError(jsonrpc="2.0", id=message.id, error=error)
            return SessionMessage(answer, metadata=item.metadata)
        return None

    async def __aenter__(self) -> _WeighedRead:
        await self._inner.__aenter__()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        return await self._inner.__aexit__(exc_type, exc, tb)

    def __getattr__(self, name: str) -> Any:
        # ``last_context`` and the like, which the SDK reads with getattr when present.
        if name == "_inner":
            raise AttributeError(name)
        return getattr(self._inner, name)
