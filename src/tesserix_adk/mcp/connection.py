"""``Connection``: one connection of a toolset to its MCP server, from connecting and
listing the tools to closing, and why it is known gone once it is.

The SDK's task group lives in the task that enters its client, and a transport failure
cancels whatever that task does: so a connection is held open by a task of its own (the
owner), where such a failure cancels only the connection, never a run.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from contextlib import AsyncExitStack

from tesserix_adk.errors import AdkError, ConfigurationError
from tesserix_adk.mcp.errors import MCPUnavailableError
from tesserix_adk.mcp.replies import sdk_closed
from tesserix_adk.mcp.tools import ServerTool

try:
    import mcp
    from mcp import Client
    from mcp.shared.exceptions import MCPError as SdkError
except ImportError as exc:  # pragma: no cover - exercised without the extra installed
    raise ImportError(
        'tesserix_adk.mcp needs the MCP SDK: pip install "tesserix-adk[mcp]"'
    ) from exc

__all__ = ["Connection", "said"]

# Bounds the listing walk: a server whose cursor never ends cannot hang the connection.
_MAX_LIST_PAGES = 100


class Connection:
    """A live connection: ``client``, the tools it ``listed``, and ``lost`` (why it is
    known gone, ``None`` while it is not), which makes a later call certainly not sent."""

    __slots__ = ("_client", "_closing", "_listed", "_owner", "lost")

    def __init__(self) -> None:
        self._closing = asyncio.Event()
        self._owner: asyncio.Task[None] | None = None
        self._client: Client | None = None
        self._listed: tuple[ServerTool, ...] = ()
        self.lost: str | None = None

    @classmethod
    async def open(
        cls, client: Callable[[], Client], where: str, connect_timeout: float
    ) -> Connection:
        """Connect with the client ``client()`` makes and list the tools, within
        ``connect_timeout`` seconds; the SDK's and the transports' errors translated
        (``MCPUnavailableError``, or ``ConfigurationError`` for a server that cannot be
        started)."""
        conn = cls()
        ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        owner = asyncio.create_task(conn._own(client, where, connect_timeout, ready))
        owner.set_name(f"mcp:{where}")
        conn._owner = owner
        try:
            await asyncio.shield(ready)
        except BaseException as exc:
            conn._closing.set()
            owner.cancel()
            with contextlib.suppress(BaseException):
                await owner
            # The kit's own errors stand (raised inside the SDK's task group, they come
            # out in an exception group).
            leaf = _leaf(exc)
            if isinstance(leaf, AdkError):
                raise leaf from exc
            if isinstance(exc, Exception):
                raise _connect_error(where, exc) from exc
            raise
        return conn

    @property
    def client(self) -> Client:
        """The SDK's client of this connection."""
        if self._client is None:  # pragma: no cover - open() sets it before returning
            raise ConfigurationError("the connection is not open")
        return self._client

    @property
    def listed(self) -> tuple[ServerTool, ...]:
        """The tools the server listed when this connection opened, in its order."""
        return self._listed

    @property
    def owner(self) -> asyncio.Task[None]:
        """The task holding the connection open: done once the connection ended."""
        if self._owner is None:  # pragma: no cover - open() sets it before returning
            raise ConfigurationError("the connection is not open")
        return self._owner

    def gone(self) -> bool:
        """Whether this connection is known to be over."""
        return self.owner.done() or sdk_closed(self.client)

    async def close(self) -> None:
        """End the connection and wait for it to close."""
        self._closing.set()
        with contextlib.suppress(Exception):
            await self.owner

    async def _own(
        self,
        client: Callable[[], Client],
        where: str,
        connect_timeout: float,
        ready: asyncio.Future[None],
    ) -> None:
        """Connect, list, say ready, and hold the connection until closing; a failure
        after that is remembered in ``lost``, never raised."""
        try:
            async with AsyncExitStack() as stack:
                # Bounded whatever call_timeout says: a server that never answers
                # initialize, or whose listing the SDK cannot parse (and drops), would hang
                # here for good.
                async with asyncio.timeout(connect_timeout):
                    entered = await stack.enter_async_context(client())
                    self._listed = tuple(await _listed(entered, where))
                self._client = entered
                ready.set_result(None)
                await self._closing.wait()
        except BaseException as exc:
            if not ready.done():
                if isinstance(exc, asyncio.CancelledError):
                    ready.cancel()
                else:
                    ready.set_exception(exc)
            elif not self._closing.is_set():
                self.lost = said(exc)


async def _listed(client: Client, where: str) -> list[ServerTool]:
    found: list[ServerTool] = []
    cursor: str | None = None
    for _ in range(_MAX_LIST_PAGES):
        page = await client.list_tools(cursor=cursor)
        found.extend(_server_tool(t) for t in page.tools)
        cursor = page.next_cursor
        if not cursor:
            return found
    raise MCPUnavailableError(
        f"{where} listed more than {_MAX_LIST_PAGES} pages of tools", retryable=False
    )


def _server_tool(listed: mcp.types.Tool) -> ServerTool:
    hints = listed.annotations
    return ServerTool(
        name=listed.name,
        description=listed.description or "",
        input_schema=listed.input_schema,
        read_only=bool(hints and hints.read_only_hint),
        idempotent=bool(hints and hints.idempotent_hint),
    )


def _connect_error(where: str, exc: Exception) -> Exception:
    cause = _leaf(exc)
    if isinstance(cause, FileNotFoundError | PermissionError | NotADirectoryError):
        return ConfigurationError(f"cannot start {where}: {cause}")
    return MCPUnavailableError(f"cannot connect to {where}: {said(cause)}")


def _leaf(exc: BaseException) -> BaseException:
    """The first error inside a (nested) exception group: what actually failed."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


def said(exc: BaseException) -> str:
    """What an error says, for a sentence: the SDK's own message, or its type and text."""
    leaf = _leaf(exc)
    if isinstance(leaf, SdkError):
        return leaf.message
    return f"{type(leaf).__name__}: {leaf}"
