"""``MCPToolset``: the tools of one MCP server, over stdio or streamable HTTP, as kit tools.

The toolset holds a connection (``connection.Connection``) for as long as its ``async with``
lasts: entering connects and lists the server's tools once; ``tools`` are then ordinary kit
tools, so the agent's revision covers each one's name, description, schema and flags, and a
server that changed its tools makes a changed agent. An HTTP server whose connection was
lost is reached again by the next call, if it lists the same tools. Errors of the SDK and
its transports are translated once, here, into ``tesserix_adk.mcp.errors``, saying whether
a call was sent.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Coroutine, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar, cast
from urllib.parse import urlsplit

from tesserix_adk.errors import AdkError, ConfigurationError
from tesserix_adk.mcp.connection import Connection, said
from tesserix_adk.mcp.errors import MCPReplyLostError, MCPToolError, MCPUnavailableError
from tesserix_adk.mcp.replies import (
    Unread,
    maybe_a_reply,
    sdk_closed,
    session_gone,
    shown_url,
    stand_in,
    wound_down,
)
from tesserix_adk.mcp.tools import (
    IDEMPOTENCY_KEY_META,
    MCPTool,
    MCPToolOverride,
    ServerTool,
    outcome_of,
)
from tesserix_adk.mcp.weighing import DEFAULT_MAX_REPLY_ITEMS, TOO_LARGE, Weighed

try:
    from mcp import Client, StdioServerParameters
    from mcp.client._transport import Transport
    from mcp.client.stdio import stdio_client
    from mcp.client.streamable_http import streamable_http_client
    from mcp.shared.exceptions import MCPError as SdkError
    from mcp_types import RequestParamsMeta
except ImportError as exc:  # pragma: no cover - exercised without the extra installed
    raise ImportError(
        'tesserix_adk.mcp needs the MCP SDK: pip install "tesserix-adk[mcp]"'
    ) from exc

__all__ = ["DEFAULT_CONNECT_TIMEOUT", "DEFAULT_MAX_REPLY_ITEMS", "MCPToolset"]

T = TypeVar("T")

# Seconds to start or reach a server and list its tools.
DEFAULT_CONNECT_TIMEOUT = 20.0


class MCPToolset:
    """The tools of one MCP server; use as ``async with MCPToolset.stdio(...) as toolset``.

    ``overrides`` maps a server tool's name to the flags the user sets for it (over its
    annotations); naming a tool the server does not list is a ``ConfigurationError``.
    ``prefix`` goes in front of every tool's kit name (two servers with a tool of the same
    name); the server is still asked for its own name. ``call_timeout`` (seconds) bounds
    each call; one that runs out is ``MCPReplyLostError``, as the tool may have run.
    ``connect_timeout`` (seconds, default ``DEFAULT_CONNECT_TIMEOUT``) bounds connecting and
    listing: a server that does not answer in time is ``MCPUnavailableError``.
    ``max_reply_items`` (default ``DEFAULT_MAX_REPLY_ITEMS``) bounds the JSON values a reply
    may hold: the SDK validates one holding every thread of the process, so one past it is
    not read, and its call is ``MCPReplyLostError`` (it ran, its outcome is unknown).
    """

    __slots__ = (
        "_conn",
        "_connect_timeout",
        "_listed",
        "_max_items",
        "_overrides",
        "_prefix",
        "_reach_failed",
        "_reach_tries",
        "_reconnecting",
        "_server",
        "_timeout",
        "_tools",
        "_unread",
    )

    def __init__(
        self,
        server: StdioServerParameters | str,
        *,
        overrides: Mapping[str, MCPToolOverride] | None = None,
        prefix: str = "",
        call_timeout: float | None = None,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
        max_reply_items: int = DEFAULT_MAX_REPLY_ITEMS,
    ) -> None:
        if call_timeout is not None and call_timeout <= 0:
            raise ConfigurationError("call_timeout must be positive")
        if isinstance(max_reply_items, bool) or not isinstance(max_reply_items, int):
            raise ConfigurationError("max_reply_items must be a whole number")
        if max_reply_items < 1:
            raise ConfigurationError("max_reply_items must be at least 1")
        self._max_items = max_reply_items
        if not 0 < connect_timeout < float("inf"):
            raise ConfigurationError("connect_timeout must be a positive number of seconds")
        self._connect_timeout = connect_timeout
        self._server = server
        self._overrides = dict(overrides or {})
        self._prefix = prefix
        self._timeout = call_timeout
        self._conn: Connection | None = None
        # Taken by the call that reaches the server again after the connection was lost.
        self._reconnecting = asyncio.Lock()
        # Tries that failed so far, and why the last one did: calls queued behind a try that
        # failed are told so, rather than each waiting out a connect_timeout of its own.
        self._reach_tries = 0
        self._reach_failed = ("", True)
        # The tools as listed on entering: a server reached again must list the same.
        self._listed: tuple[ServerTool, ...] = ()
        self._tools: tuple[MCPTool, ...] | None = None
        # One future per call waiting for its reply, told when a message came that the
        # transport could not read: it may have been that call's reply.
        self._unread: set[asyncio.Future[str]] = set()

    @classmethod
    def stdio(
        cls,
        command: str,
        args: Sequence[str] = (),
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | Path | None = None,
        overrides: Mapping[str, MCPToolOverride] | None = None,
        prefix: str = "",
        call_timeout: float | None = None,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
        max_reply_items: int = DEFAULT_MAX_REPLY_ITEMS,
    ) -> MCPToolset:
        """A server the toolset starts as ``command *args`` and talks to over its stdin and
        stdout; ``env`` is added to the SDK's safe default environment. The process is
        stopped when the toolset closes."""
        params = StdioServerParameters(
            command=command,
            args=list(args),
            env=dict(env) if env is not None else None,
            cwd=cwd,
        )
        return cls(
            params,
            overrides=overrides,
            prefix=prefix,
            call_timeout=call_timeout,
            connect_timeout=connect_timeout,
            max_reply_items=max_reply_items,
        )

    @classmethod
    def http(
        cls,
        url: str,
        *,
        overrides: Mapping[str, MCPToolOverride] | None = None,
        prefix: str = "",
        call_timeout: float | None = None,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
        max_reply_items: int = DEFAULT_MAX_REPLY_ITEMS,
    ) -> MCPToolset:
        """A running server at ``url`` (its streamable HTTP endpoint, e.g.
        ``http://127.0.0.1:8000/mcp``); ``ConfigurationError`` for one that cannot be read."""
        try:
            urlsplit(url).port  # noqa: B018 - reading it is the check
        except ValueError as exc:
            raise ConfigurationError(
                f"{shown_url(url)} is not an MCP server URL that can be read"
            ) from exc
        return cls(
            url,
            overrides=overrides,
            prefix=prefix,
            call_timeout=call_timeout,
            connect_timeout=connect_timeout,
            max_reply_items=max_reply_items,
        )

    @property
    def tools(self) -> tuple[MCPTool, ...]:
        """The server's tools as kit tools, in the order it listed them."""
        if self._tools is None:
            raise ConfigurationError(
                f"{self!r} is not connected; use it as `async with toolset:` first"
            )
        return self._tools

    async def __aenter__(self) -> MCPToolset:
        if self._conn is not None:
            raise ConfigurationError(f"{self!r} is already connected")
        conn = await Connection.open(self._client, self._where(), self._connect_timeout)
        try:
            tools = self._kit_tools(conn.listed)
        except BaseException:
            await conn.close()
            raise
        self._conn, self._listed, self._tools = conn, conn.listed, tools
        self._reach_failed = ("", True)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        conn, self._conn, self._tools = self._conn, None, None
        if conn is not None:
            await conn.close()

    async def call(self, name: str, arguments: Mapping[str, Any], *, key: str | None = None) -> Any:
        """Call the server's tool ``name`` (its own name, not prefixed) and answer the
        outcome: the text of its result, ``MCPToolError`` for an error answer. ``key``
        goes in the request's ``_meta`` as ``tesserix/idempotency_key``. A reconciler may
        use this to ask the server about a call in doubt."""
        conn = self._conn
        if conn is None:
            raise ConfigurationError(f"{self!r} is not connected")
        if conn.lost is None and sdk_closed(conn.client):
            conn.lost = "the server closed the connection"
        if conn.lost is not None:
            conn = await self._reached_again(conn, name)
        try:
            json.dumps([dict(arguments), key], ensure_ascii=False).encode("utf-8")
        except (TypeError, ValueError) as exc:
            # Checked here, before the SDK writes a byte: its writer fails on them half-way
            # (a lone surrogate), and whether it wrote anything nobody could say then.
            raise MCPUnavailableError(
                f"{name} was not sent: its arguments cannot be written as JSON text "
                f"({type(exc).__name__})",
                retryable=False,
            ) from exc
        # An open TypedDict (extra_items, PEP 728) that mypy does not read yet: hence the cast.
        meta = None if key is None else cast(RequestParamsMeta, {IDEMPOTENCY_KEY_META: key})
        try:
            result = await self._answer(
                conn, conn.client.call_tool(name, dict(arguments), meta=meta)
            )
        except SdkError as exc:
            if session_gone(exc):
                # A server that restarted since: refused whole, so not sent; the next call
                # reaches it again.
                conn.lost = f"it no longer knows the session ({exc.message})"
                raise MCPUnavailableError(
                    f"{name} was not sent: {self._where()} no longer knows this toolset's "
                    "session (it restarted); the next call reaches it again"
                ) from exc
            kind = stand_in(exc)
            if kind == "closed" and conn.gone():
                # Our own connection closed; the same words relayed by a gateway from its
                # upstream, or an HTTP request that failed while the session stands, leave
                # later calls to go out.
                conn.lost = exc.message
            if kind == "internal" and exc.message.startswith(TOO_LARGE):
                raise MCPReplyLostError(
                    f"{name} was sent to {self._where()}, and its reply held more than "
                    f"{self._max_items:,} JSON values (max_reply_items), so it was not read; "
                    "it may have run: look it up by its idempotency key before sending it "
                    "again"
                ) from exc
            if kind is not None:
                raise self._reply_lost(name, exc) from exc
            # A JSON-RPC error answer (unknown tool, invalid params): the server said no.
            raise MCPToolError(f"{name}: {exc.message}") from exc
        except Unread as exc:
            raise MCPReplyLostError(
                f"{name} was sent to {self._where()}, and a reply came that could not be read "
                f"({exc}); it may have run: look it up by its idempotency key before sending "
                "it again"
            ) from exc
        except Exception as exc:
            if conn.gone() or isinstance(exc, ConnectionError):
                # A transport failure after the request was handed over: nobody can say
                # whether it reached the server, and the connection is gone.
                conn.lost = conn.lost or f"{type(exc).__name__}: {exc}"
                raise self._reply_lost(name, exc) from exc
            # The connection stands, and the reply came but is not a result the SDK
            # accepts (its shape, the tool's output schema): in doubt, this call only.
            raise MCPReplyLostError(
                f"{name} was sent to {self._where()}, and its reply could not be read "
                f"({type(exc).__name__}); it may have run: look it up by its idempotency "
                "key before sending it again"
            ) from exc
        return outcome_of(
            result.content, is_error=result.is_error, structured=result.structured_content
        )

    async def _reached_again(self, lost: Connection, name: str) -> Connection:
        """A new connection to an HTTP server in place of ``lost``, or
        ``MCPUnavailableError`` (``name`` not sent). A stdio server is not started again:
        the toolset's own process died, which a restart would hide."""
        not_sent = (
            f"{name} was not sent: the connection to {self._where()} was lost earlier ({lost.lost})"
        )
        if not isinstance(self._server, str):
            raise MCPUnavailableError(not_sent)
        why, retryable = self._reach_failed
        if not retryable:
            # It listed other tools: every call is refused until the toolset is entered
            # again, whatever it lists later.
            raise MCPUnavailableError(f"{not_sent}; {why}", retryable=False)
        failed = self._reach_tries
        async with self._reconnecting:
            current = self._conn
            if current is None:
                raise ConfigurationError(f"{self!r} is not connected")
            if current is not lost and current.lost is None:
                return current  # another call reached it again meanwhile
            if self._reach_tries != failed:
                # Another call tried while this one waited, and failed: so does this one.
                why, retryable = self._reach_failed
                raise MCPUnavailableError(f"{not_sent}; {why}", retryable=retryable)
            try:
                fresh = await Connection.open(self._client, self._where(), self._connect_timeout)
            except AdkError as exc:
                self._failed_to_reach(f"reaching it again failed ({exc})", retryable=True)
                raise MCPUnavailableError(f"{not_sent}; reaching it again failed ({exc})") from exc
            if self._conn is not current:
                # The toolset was left meanwhile: nothing goes out, nothing stays open.
                await fresh.close()
                raise ConfigurationError(f"{self!r} is not connected")
            if _by_name(fresh.listed) != _by_name(self._listed):
                await fresh.close()
                why = (
                    "reached again, it lists other tools than when the toolset connected, so "
                    "the agent's tools no longer say what it does: leave the toolset and "
                    "enter it again"
                )
                self._failed_to_reach(why, retryable=False)
                raise MCPUnavailableError(f"{not_sent}; {why}", retryable=False)
            self._conn = fresh
        await current.close()
        return fresh

    def _failed_to_reach(self, why: str, *, retryable: bool) -> None:
        self._reach_tries += 1
        self._reach_failed = (why, retryable)

    async def _answer(self, conn: Connection, request: Coroutine[Any, Any, T]) -> T:
        """``request``'s answer, or the connection's failure if it ended first (the
        request was handed over: whether it reached the server, nobody can say), or
        ``Unread`` if a message came meanwhile that the transport could not read."""
        sent = asyncio.ensure_future(request)
        unread: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._unread.add(unread)
        try:
            waits: set[asyncio.Future[Any]] = {sent, unread, conn.owner}
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            sent.cancel()
            await wound_down(sent)
            raise
        finally:
            self._unread.discard(unread)
        if not sent.done():
            sent.cancel()
            await wound_down(sent)
            if unread.done():
                raise Unread(unread.result())
            raise ConnectionError(conn.lost or "the connection ended")
        return sent.result()

    async def _heard(self, message: Any) -> None:
        """The SDK's ``message_handler``: a server notification (nothing to do), or a
        message the transport could not read. JSON-RPC cannot say which request that one
        answered, so every call waiting then is told: its reply may be the one lost."""
        if isinstance(message, Exception) and maybe_a_reply(message):
            said = f"{type(message).__name__}: {message}"[:200]
            for waiting in self._unread:
                if not waiting.done():
                    waiting.set_result(said)
        await asyncio.sleep(0)

    def _reply_lost(self, name: str, exc: BaseException) -> MCPReplyLostError:
        return MCPReplyLostError(
            f"{name} was sent to {self._where()} but no reply came ({said(exc)}); it may "
            "have run: look it up by its idempotency key before sending it again"
        )

    def _client(self) -> Client:
        """A new SDK client for one connection: no response cache, so every listing is
        the server's word now."""
        return Client(
            Weighed(self._transport(), self._max_items),
            read_timeout_seconds=self._timeout,
            cache=None,
            message_handler=self._heard,
        )

    def _kit_tools(self, listed: tuple[ServerTool, ...]) -> tuple[MCPTool, ...]:
        names = {t.name for t in listed}
        unknown = sorted(set(self._overrides) - names)
        if unknown:
            raise ConfigurationError(
                f"overrides name tool(s) {unknown} that {self._where()} does not list; it "
                f"lists {sorted(names)}"
            )
        return tuple(
            MCPTool(
                t,
                self.call,
                name=self._prefix + t.name,
                override=self._overrides.get(t.name),
            )
            for t in listed
        )

    def _transport(self) -> Transport:
        if isinstance(self._server, str):
            return cast(Transport, streamable_http_client(self._server))
        return cast(Transport, stdio_client(self._server))

    def _where(self) -> str:
        if isinstance(self._server, str):
            return f"the MCP server at {shown_url(self._server)}"
        return f"the MCP server `{self._server.command}`"

    def __repr__(self) -> str:
        state = "connected" if self._conn is not None else "not connected"
        return f"MCPToolset({self._where()}, {state})"


def _by_name(listed: tuple[ServerTool, ...]) -> dict[str, ServerTool]:
    # The agent's revision sorts tools by name: the same tools in another order are the same.
    return {t.name: t for t in listed}
