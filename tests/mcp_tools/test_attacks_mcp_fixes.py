"""Attacks on the MCP toolset after e6c9c6d (SDK stand-ins told apart by code and text
prefix, the ``_closed`` peek, an unreadable reply leaving that call in doubt, a message the
transport could not read failing every waiting call, ``_shown_url``), against real MCP
servers over loopback: the SDK's ``MCPServer`` over stdio and streamable HTTP (the kit's
``server.py``, a gateway relaying an upstream, a handshake-era HTTP server), and raw
JSON-RPC stdio servers written here.

A strict xfail is a defect found (its reason says which); a plain test is a promise that
held.

Findings (defects; all fixed since, their tests now plain; 5 was a limit the README named
until the toolset learned to reach an HTTP server again):

1. HIGH. A server's own SDK answers a request that was in the tool's handler when its
   session ended with ``-32603 "Session terminated before the request completed"`` (the
   handshake-era streamable-HTTP transport in JSON-response mode; reported in the field).
   ``_STAND_INS`` does not know it, so the toolset raises ``MCPToolError``: the call is
   recorded as completed with an error and the model is told the booking failed, while
   the server booked it. It should be ``MCPReplyLostError`` (the handler had it). Here the
   server is the SDK's ``MCPServer`` behind a front that does not know ``server/discover``
   (as servers before 2026-07-28 do), the session ended by a DELETE naming it.
2. MEDIUM. ``_stand_in`` takes ``(-32000, "Connection closed")`` for the SDK's own
   connection loss by its text, and the toolset then marks its connection lost for good.
   A gateway built on the SDK relays exactly that error when its upstream dies in a call
   (``MCPError`` is re-raised as a JSON-RPC error by ``MCPServer``): the call is rightly
   in doubt, but every later call of every run on the toolset is refused "was not sent:
   the connection ... was lost earlier" though the gateway is up and answering (and the
   first error says "no reply came" of a reply that came). The SDK itself tells its own
   closed outcome apart by identity; the toolset could ask ``_closed`` before believing
   the text.
3. MEDIUM (a regression of e6c9c6d). A line on a stdio server's stdout that is not JSON at
   all (a log line: ``console.log`` in a Node tool, a C library's printf), which cannot be
   any request's reply, now fails every call waiting at that moment as in doubt, though
   each one's whole reply comes right after; each is also cancelled on the server
   (``notifications/cancelled``: an SDK server interrupts the handler mid-way). Before the
   change the SDK dropped such a line and the calls completed. Every run with a call in
   flight then stops for an operator.
4. MEDIUM. Arguments the transport cannot encode fail before a byte is written, yet the
   toolset calls the call sent and in doubt: a lone surrogate (``"\\ud83d"`` from a model's
   JSON, a cut emoji) crashes the SDK's stdio writer, so the call is "sent ... may have
   run" and the connection dies (every later call refused); bytes that are not UTF-8 are
   "sent, and its reply could not be read". Reached by a reconciler's ``toolset.call`` or
   an unkeyed tool (``MCPToolOverride(key=None)``; a keyed one crashes the run earlier, in
   ``default_key``, outside this file's scope).
5. MEDIUM. Over streamable HTTP at 2026-07-28 (no session: each call is its own POST) a
   server restarted during a call leaves the toolset dead for good: the SDK transport's
   task group dies with the dropped POST, and every later call is refused as not sent,
   ``retryable``, though the server is back; retrying never helps until the app re-enters
   the toolset. A restart while idle is harmless, so the same deploy breaks or not by
   timing. (Fixed: the next call reaches the server again, if it lists the same tools.)
6. LOW. ``_shown_url`` raises ``ValueError`` for a URL ``urlsplit`` cannot take apart (a
   port out of range or not a number, an unclosed IPv6 bracket, an unencoded ``#``, ``?``
   or ``/`` in a password): ``repr(toolset)`` raises, and ``async with`` fails with a raw
   ``ValueError`` (not ``ConfigurationError``), leaking an un-awaited coroutine, and the
   text quotes the start of the password ("as 'pa'").
7. LOW. ``_answer`` waits for an abandoned request under ``suppress(BaseException)``: a
   cancel of the caller landing while the SDK writes its courtesy cancel (up to 5 s when
   the server is not reading its stdin) is swallowed, and the call ends
   ``MCPReplyLostError`` instead of ``CancelledError`` (a ``wait_for`` or a worker's
   shutdown loses its cancel).

Held (plain tests): a server's deliberate error whose text starts like a stand-in is in
doubt today (the safe direction; it costs an operator, never a second send) and keeps the
connection, and a stand-in's text under another code is the server's "no"; a garbled reply
while two calls wait is never told to the model and the late real reply is dropped, not
shifted onto a later call; a garbled message between calls leaves later calls fine; twelve
calls in parallel, a third never answered, keep each answer with its own call, each sent
once, the connection up; a server killed in a call leaves that call in doubt and the next
ones not sent (the ``_closed`` peek never calls a sent call "not sent": it is read before
the request is handed over), heard once; a cancelled call is cancelled, sent once, and the
toolset stays usable; a toolset is refused after close and reconnects when entered again,
the loss forgotten, its old tools on the new connection; ``_shown_url`` keeps an IPv6 host
and port and drops user info, query and fragment, also in a real connect error.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import warnings
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from mcp_tools.servers import SERVER, Effects, free_port, stdio
from tesserix_adk import ConfigurationError
from tesserix_adk.errors import ToolOutcomeUnknownError
from tesserix_adk.mcp import (
    MCPReplyLostError,
    MCPToolError,
    MCPToolset,
    MCPUnavailableError,
)
from tesserix_adk.messages import ToolCall
from tesserix_adk.tools import ToolContext

pytestmark = pytest.mark.skipif(os.name != "posix", reason="needs POSIX signals and pipes")


# --- a raw JSON-RPC server over stdio -------------------------------------------------------

RAW_STDIO = r"""
import json, os, sys, time

RECEIVED = os.environ["RECEIVED"]
held = []  # (request id, flight) of `hold` calls not answered yet


def send(message):
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def line(text):
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def text(rid, words):
    send({"jsonrpc": "2.0", "id": rid,
          "result": {"content": [{"type": "text", "text": words}]}})


def answer_held():
    while held:
        rid, flight = held.pop(0)
        text(rid, "held " + flight)


def tools():
    def side(name):
        return {"name": name, "description": name, "inputSchema": {"type": "object"}}
    look = {"name": "look", "description": "Look.", "inputSchema": {"type": "object"},
            "annotations": {"readOnlyHint": True}}
    names = ("book", "hold", "never", "noisy", "garble", "chirp", "refuse", "stall")
    return [side(n) for n in names] + [look]


def call(rid, name, args):
    flight = str(args.get("flight", ""))
    if name == "look":
        return text(rid, "seen")
    if name == "book":
        return text(rid, "booked " + flight)
    if name == "hold":  # answered when a later call says so
        return held.append((rid, flight))
    if name == "never":  # never answered
        return
    if name == "noisy":  # a log line on stdout (console.log in a tool), then the replies
        line("log: booking " + flight + " for the customer")
        time.sleep(0.3)
        answer_held()
        return text(rid, "booked " + flight)
    if name == "garble":  # this call's own reply is unreadable; held calls answered later
        line(json.dumps({"jsonrpc": "2.0", "id": rid, "result": "booked " + flight}))
        time.sleep(0.3)
        return answer_held()
    if name == "chirp":  # answered, then a garbled notification while nothing waits
        text(rid, "seen")
        time.sleep(0.1)
        line('{"jsonrpc": "2.0", "method": "notifications/message", "params": ')
        with open(RECEIVED + ".chirped", "w"):
            pass
        return
    if name == "stall":  # reads nothing for a while, its own reply unreadable in the middle
        time.sleep(1.0)
        line(json.dumps({"jsonrpc": "2.0", "id": rid, "result": "stalled"}))
        return time.sleep(2.0)
    if name == "refuse":  # the server's own JSON-RPC error, as the arguments say
        error = {"code": args["code"], "message": args["message"]}
        return send({"jsonrpc": "2.0", "id": rid, "error": error})


for raw in sys.stdin:
    with open(RECEIVED, "a") as f:
        f.write(raw)
    request = json.loads(raw)
    method, rid = request.get("method"), request.get("id")
    if rid is None:
        continue
    if method == "initialize":
        send({"jsonrpc": "2.0", "id": rid, "result": {
            "protocolVersion": request["params"]["protocolVersion"],
            "capabilities": {"tools": {}}, "serverInfo": {"name": "raw", "version": "0"}}})
    elif method == "tools/list":
        send({"jsonrpc": "2.0", "id": rid, "result": {"tools": tools()}})
    elif method == "tools/call":
        params = request.get("params", {})
        call(rid, params.get("name"), params.get("arguments") or {})
    else:
        send({"jsonrpc": "2.0", "id": rid, "error": {"code": -32601, "message": "no " + method}})
"""


class Raw:
    """The raw stdio server, written into the test's directory, and what it received."""

    def __init__(self, tmp: Path) -> None:
        self.script = tmp / "raw_stdio.py"
        self.script.write_text(RAW_STDIO)
        self.received = tmp / "received.jsonl"

    def toolset(self, *, call_timeout: float | None = 20.0) -> MCPToolset:
        return MCPToolset.stdio(
            sys.executable,
            [str(self.script)],
            env={"RECEIVED": str(self.received)},
            call_timeout=call_timeout,
        )

    def _messages(self) -> list[dict[str, Any]]:
        if not self.received.exists():
            return []
        return [json.loads(line) for line in self.received.read_text().splitlines()]

    def calls(self, name: str | None = None) -> list[dict[str, Any]]:
        """The ``tools/call`` params the server received (of tool ``name``), in order."""
        got = [m["params"] for m in self._messages() if m.get("method") == "tools/call"]
        return [p for p in got if name is None or p["name"] == name]

    def cancelled(self) -> list[Any]:
        """The request ids the client told the server it cancelled."""
        return [
            m["params"]["requestId"]
            for m in self._messages()
            if m.get("method") == "notifications/cancelled"
        ]

    def chirped(self) -> bool:
        return Path(str(self.received) + ".chirped").exists()


@pytest.fixture
def raw(tmp_path: Path) -> Raw:
    return Raw(tmp_path)


async def _until(predicate: Any, what: str, *, seconds: float = 20.0) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, f"never: {what}"
        await asyncio.sleep(0.01)


# --- 3. a log line on stdout while calls wait ------------------------------------------------


async def test_a_log_line_on_stdout_does_not_put_calls_whose_replies_come_in_doubt(
    raw: Raw,
) -> None:
    async with raw.toolset() as toolset:
        first = asyncio.ensure_future(toolset.call("hold", {"flight": "LH1"}, key="k1"))
        await _until(lambda: raw.calls("hold"), "the held call reached the server")
        second = asyncio.ensure_future(toolset.call("noisy", {"flight": "LH2"}, key="k2"))
        results: list[Any] = list(await asyncio.gather(first, second, return_exceptions=True))
        assert results == ["held LH1", "booked LH2"], results
        assert raw.cancelled() == []  # nothing was abandoned on the server
    assert len(raw.calls()) == 2


# --- held: garbled messages, by design ----------------------------------------------------------


async def test_a_garbled_reply_while_two_calls_wait_is_never_an_error_nor_a_shifted_answer(
    raw: Raw,
) -> None:
    """The unreadable reply may have been either call's: today both are in doubt (never
    told to the model); the held call's real reply, arriving after, is dropped, never
    taken for the next call's answer. (A toolset that could tell whose reply it was may
    answer the held call; that would be fine too.)"""
    async with raw.toolset() as toolset:
        first = asyncio.ensure_future(toolset.call("hold", {"flight": "LH1"}, key="k1"))
        await _until(lambda: raw.calls("hold"), "the held call reached the server")
        second = asyncio.ensure_future(toolset.call("garble", {"flight": "LH2"}, key="k2"))
        outcomes: list[Any] = list(await asyncio.gather(first, second, return_exceptions=True))
        held, garbled = outcomes
        assert isinstance(garbled, MCPReplyLostError), garbled
        assert isinstance(garbled, ToolOutcomeUnknownError)
        assert held == "held LH1" or isinstance(held, MCPReplyLostError), held
        assert await toolset.call("book", {"flight": "LH3"}, key="k3") == "booked LH3"
        assert await toolset.call("look", {}) == "seen"
    keys = [c["_meta"]["tesserix/idempotency_key"] for c in raw.calls() if c["name"] != "look"]
    assert keys == ["k1", "k2", "k3"]


async def test_a_garbled_message_while_no_call_waits_leaves_later_calls_fine(raw: Raw) -> None:
    async with raw.toolset() as toolset:
        assert await toolset.call("chirp", {}) == "seen"
        await _until(raw.chirped, "the garbled notification was written")
        await asyncio.sleep(0.2)  # the toolset reads it, with no call waiting
        assert await toolset.call("book", {"flight": "LH1"}, key="k1") == "booked LH1"
        assert await toolset.call("look", {}) == "seen"
    assert len(raw.calls("book")) == 1


# --- held: a server's own error that reads like a stand-in ---------------------------------------


@pytest.mark.parametrize(
    ("code", "message", "kind"),
    [
        # The server's deliberate "no" whose text starts like an SDK stand-in: in doubt
        # today (the safe direction: never told to the model, never sent again; an operator
        # decides), or the server's "no" if the toolset learns to tell; never "not sent".
        (-32600, "Redirect to the partner desk: fares changed", None),
        (-32000, "SSE stream failed: upstream reset", None),
        (-32601, "Not Found", None),
        # A stand-in's text under another code is the server's own answer.
        (-32002, "Connection closed", MCPToolError),
        # A server's internal error may come after its tool ran: in doubt (either is safe).
        (-32603, "Session terminated", None),
    ],
)
async def test_a_servers_error_reading_like_a_stand_in_errs_safe_and_keeps_the_connection(
    raw: Raw, code: int, message: str, kind: type[Exception] | None
) -> None:
    args = {"code": code, "message": message}
    async with raw.toolset() as toolset:
        with pytest.raises((MCPReplyLostError, MCPToolError)) as caught:
            await toolset.call("refuse", args, key="k1")
        if kind is not None:
            assert type(caught.value) is kind
        assert await toolset.call("look", {}) == "seen"  # the connection stays
    assert len(raw.calls("refuse")) == 1


# --- held: many calls in parallel, some replies lost --------------------------------------------


async def test_many_parallel_calls_with_some_never_answered_keep_each_answer_with_its_call(
    raw: Raw,
) -> None:
    async with raw.toolset(call_timeout=1.5) as toolset:
        names = ["book" if i % 3 else "never" for i in range(12)]
        calls = [
            toolset.call(name, {"flight": f"F{i}"}, key=f"k{i}") for i, name in enumerate(names)
        ]
        results = await asyncio.gather(*calls, return_exceptions=True)
        for i, (name, result) in enumerate(zip(names, results, strict=True)):
            if name == "book":
                assert result == f"booked F{i}", (i, result)
            else:
                assert isinstance(result, MCPReplyLostError), (i, result)
        assert await toolset.call("look", {}) == "seen"  # the connection stands
    received = sorted(
        c["_meta"]["tesserix/idempotency_key"] for c in raw.calls() if c["name"] != "look"
    )
    assert received == sorted(f"k{i}" for i in range(12))  # each sent once


# --- 2. a gateway relaying its upstream's "Connection closed" -----------------------------------

UPSTREAM = r"""
import json, os, sys


def send(message):
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


for raw in sys.stdin:
    request = json.loads(raw)
    method, rid = request.get("method"), request.get("id")
    if rid is None:
        continue
    if method == "initialize":
        send({"jsonrpc": "2.0", "id": rid, "result": {
            "protocolVersion": request["params"]["protocolVersion"],
            "capabilities": {"tools": {}}, "serverInfo": {"name": "upstream", "version": "0"}}})
    elif method == "tools/list":
        send({"jsonrpc": "2.0", "id": rid, "result": {"tools": [
            {"name": "book_seat", "inputSchema": {"type": "object"}}]}})
    elif method == "tools/call":
        with open(os.environ["BOOKED"], "a") as f:  # booked, then the upstream dies
            f.write(json.dumps(request["params"]) + "\n")
        os._exit(1)
    else:
        send({"jsonrpc": "2.0", "id": rid, "error": {"code": -32601, "message": "no"}})
"""

GATEWAY = r"""
import os, sys
from contextlib import asynccontextmanager

from mcp import Client, StdioServerParameters
from mcp.server.mcpserver import Context, MCPServer
from mcp.types import ToolAnnotations

UPSTREAM = StdioServerParameters(command=sys.executable, args=[os.environ["UPSTREAM"]],
                                 env={"BOOKED": os.environ["BOOKED"]})


@asynccontextmanager
async def upstream(server):
    async with Client(UPSTREAM) as client:  # one connection upstream, held open
        yield {"upstream": client}


server = MCPServer("gateway", lifespan=upstream)


@server.tool()
async def relay(flight: str, ctx: Context) -> str:
    '''Book through the upstream airline.'''
    client = ctx.request_context.lifespan_context["upstream"]
    result = await client.call_tool("book_seat", {"flight": flight})
    return str(result.content)


@server.tool(annotations=ToolAnnotations(read_only_hint=True))
def look() -> str:
    '''Look.'''
    return "seen"


server.run()
"""


async def test_a_gateway_relaying_its_upstreams_connection_closed_does_not_cut_the_toolset_off(
    tmp_path: Path,
) -> None:
    (tmp_path / "upstream.py").write_text(UPSTREAM)
    (tmp_path / "gateway.py").write_text(GATEWAY)
    booked = tmp_path / "booked.jsonl"
    env = {"UPSTREAM": str(tmp_path / "upstream.py"), "BOOKED": str(booked)}
    toolset = MCPToolset.stdio(
        sys.executable, [str(tmp_path / "gateway.py")], env=env, call_timeout=20
    )
    async with toolset:
        # Rightly in doubt: the upstream booked, then died before it answered.
        with pytest.raises(MCPReplyLostError):
            await toolset.call("relay", {"flight": "LH1"}, key="k1")
        assert len(booked.read_text().splitlines()) == 1
        # The gateway itself is fine and answers.
        assert await toolset.call("look", {}) == "seen"


# --- 1. the server SDK's own "Session terminated before the request completed" -----------------

HANDSHAKE_ERA_HTTP = r"""
import json, os, sys, time
from pathlib import Path

import uvicorn
from mcp.server.mcpserver import Context, MCPServer

HOLD = Path(os.environ["HOLD"])
server = MCPServer("airline")


@server.tool()
def book_seat(flight: str, ctx: Context) -> str:
    '''Book a seat; records it, then waits for `release`.'''
    headers = ctx.request_context.request.headers
    with open(HOLD / "booked", "a") as f:
        f.write(flight + "\n")
    session = {k: headers.get(k, "") for k in ("mcp-session-id", "mcp-protocol-version")}
    (HOLD / "session.json").write_text(json.dumps(session))
    deadline = time.monotonic() + 30
    while not (HOLD / "release").exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    return "booked " + flight


app = server.streamable_http_app(json_response=True)


async def handshake_era(scope, receive, send):
    '''A server from before 2026-07-28: it does not know server/discover.'''
    if scope["type"] != "http" or scope["method"] != "POST":
        return await app(scope, receive, send)
    got, body = [], b""
    while True:
        message = await receive()
        got.append(message)
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    if b'"server/discover"' in body:
        reply = {"jsonrpc": "2.0", "id": json.loads(body)["id"],
                 "error": {"code": -32601, "message": "Method not found"}}
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": json.dumps(reply).encode()})
        return

    async def again():
        return got.pop(0) if got else await receive()

    await app(scope, again, send)


uvicorn.run(handshake_era, host="127.0.0.1", port=int(sys.argv[1]), log_level="critical")
"""


def _accepting(port: int, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 20
    while True:
        assert proc.poll() is None and time.monotonic() < deadline, "no MCP server"
        with contextlib.suppress(OSError):
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        time.sleep(0.05)


@contextlib.contextmanager
def _process(argv: list[str], port: int, **env: str) -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(
        argv,
        env={**os.environ, **env},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        _accepting(port, proc)
        yield proc
    finally:
        proc.kill()
        proc.wait(10)


def _delete_session(url: str, headers: dict[str, str]) -> int:
    request = urllib.request.Request(url, method="DELETE", headers=headers)
    with urllib.request.urlopen(request, timeout=10) as response:
        return int(response.status)


async def test_a_call_whose_session_ended_in_the_handler_is_in_doubt_not_the_servers_no(
    tmp_path: Path,
) -> None:
    script, hold = tmp_path / "handshake_era.py", tmp_path / "hold"
    script.write_text(HANDSHAKE_ERA_HTTP)
    hold.mkdir()
    port = free_port()
    url = f"http://127.0.0.1:{port}/mcp"
    try:
        with _process([sys.executable, str(script), str(port)], port, HOLD=str(hold)):
            async with MCPToolset.http(url, call_timeout=20) as toolset:
                call = asyncio.ensure_future(toolset.call("book_seat", {"flight": "LH1"}, key="k1"))
                await _until((hold / "session.json").exists, "the call reached the handler")
                headers = json.loads((hold / "session.json").read_text())
                # The session ends while the tool is in the handler (an operator's tool,
                # a reaper: here a DELETE naming it).
                assert await asyncio.to_thread(_delete_session, url, headers) == 200
                try:
                    outcome: Any = await asyncio.wait_for(call, 30)
                except Exception as exc:  # the outcome is what is tested
                    outcome = exc
                assert (hold / "booked").read_text().split() == ["LH1"]  # the server booked
                assert isinstance(outcome, MCPReplyLostError), repr(outcome)
    finally:
        (hold / "release").write_text("")


# --- 4. arguments the transport cannot encode ---------------------------------------------------


@pytest.mark.parametrize(
    "flight",
    [json.loads('"LH1 \\ud83d"'), b"LH1 \xff"],
    ids=["lone-surrogate", "bytes-not-utf8"],
)
async def test_a_call_whose_arguments_cannot_be_encoded_is_not_in_doubt_and_not_fatal(
    tmp_path: Path, flight: Any
) -> None:
    effects = Effects(tmp_path)
    async with stdio(effects) as toolset:
        try:
            await asyncio.wait_for(toolset.call("book_seat", {"flight": flight}, key="k1"), 30)
        except Exception as exc:  # the outcome is what is tested
            failed: Exception | None = exc
        else:
            failed = None
        assert effects.keys() == []  # it never reached the server
        assert not isinstance(failed, ToolOutcomeUnknownError), failed
        # The connection is untouched: the next call is answered.
        assert await toolset.call("find_flights", {"origin": "FRA", "dest": "JFK"}) == (
            "LH123 FRA-JFK"
        )


# --- 5. a streamable-HTTP server restarted during a call ----------------------------------------


async def test_a_server_restarted_during_a_call_is_reached_again_once_it_is_back(
    tmp_path: Path,
) -> None:
    effects, hold = Effects(tmp_path), tmp_path / "hold"
    hold.mkdir()
    port = free_port()
    argv = [sys.executable, SERVER, "http", str(port)]
    env = effects.env(MCP_HOLD_DIR=str(hold))
    try:
        with _process(argv, port, **env) as first:
            async with MCPToolset.http(f"http://127.0.0.1:{port}/mcp", call_timeout=20) as toolset:
                call = asyncio.ensure_future(toolset.call("book_seat", {"flight": "LH1"}, key="k1"))
                await _until((hold / "inside").exists, "the call reached the tool")
                first.kill()  # a deploy restarts the server during the call
                first.wait(10)
                with pytest.raises(MCPReplyLostError):  # rightly in doubt
                    await asyncio.wait_for(call, 30)
                (hold / "release").write_text("")
                with _process(argv, port, **effects.env()):
                    last: Any = None
                    for _ in range(3):  # a retryable error: asked again, a little later
                        try:
                            last = await toolset.call("find_flights", {"origin": "A", "dest": "B"})
                            break
                        except MCPUnavailableError as exc:
                            assert exc.retryable and not exc.outcome_unknown
                            last = exc
                            await asyncio.sleep(0.2)
                    assert last == "LH123 A-B", repr(last)
    finally:
        (hold / "release").write_text("")
    assert effects.keys() == ["k1"]


@contextlib.asynccontextmanager
async def _lost_over_http(tmp_path: Path) -> AsyncIterator[tuple[MCPToolset, Effects, Any]]:
    """A toolset over HTTP whose server was killed during a call (rightly in doubt): the
    connection is lost. Yields it, the effects, and how to start the server again."""
    effects, hold = Effects(tmp_path), tmp_path / "hold"
    hold.mkdir()
    port = free_port()
    argv = [sys.executable, SERVER, "http", str(port)]
    async with contextlib.AsyncExitStack() as stack:
        first = stack.enter_context(_process(argv, port, **effects.env(MCP_HOLD_DIR=str(hold))))
        toolset = await stack.enter_async_context(
            MCPToolset.http(f"http://127.0.0.1:{port}/mcp", call_timeout=20, connect_timeout=5)
        )
        call = asyncio.ensure_future(toolset.call("book_seat", {"flight": "LH1"}, key="k1"))
        await _until((hold / "inside").exists, "the call reached the tool")
        first.kill()
        first.wait(10)
        with pytest.raises(MCPReplyLostError):
            await asyncio.wait_for(call, 30)
        (hold / "release").write_text("")
        yield toolset, effects, lambda **env: _process(argv, port, **effects.env(**env))


async def test_a_server_still_down_is_not_sent_to_and_is_reached_once_it_is_back(
    tmp_path: Path,
) -> None:
    async with _lost_over_http(tmp_path) as (toolset, effects, start_again):
        with pytest.raises(MCPUnavailableError, match="reaching it again failed") as down:
            await toolset.call("book_seat", {"flight": "LH2"}, key="k2")
        assert down.value.retryable and not down.value.outcome_unknown
        with start_again():
            # Two calls at once: one reaches the server again, both are answered.
            both = await asyncio.gather(
                toolset.call("book_seat", {"flight": "LH3"}, key="k3"),
                toolset.call("find_flights", {"origin": "A", "dest": "B"}),
            )
            assert both[1] == "LH123 A-B"
    assert effects.keys() == ["k1", "k3"]


async def test_a_server_back_with_other_tools_is_refused_whole_not_called(
    tmp_path: Path,
) -> None:
    async with _lost_over_http(tmp_path) as (toolset, effects, start_again):
        with start_again(MCP_TOOLS_VARIANT="added"):
            for flight in ("LH2", "LH3"):  # refused each time, never sent
                with pytest.raises(MCPUnavailableError, match="lists other tools") as other:
                    await toolset.call("book_seat", {"flight": flight}, key=flight)
                assert not other.value.retryable and not other.value.outcome_unknown
    assert effects.keys() == ["k1"]


# --- held: a server killed in a call, with another call behind it -------------------------------


async def test_a_server_killed_in_a_call_leaves_it_in_doubt_and_the_next_not_sent(
    tmp_path: Path,
) -> None:
    effects, hold = Effects(tmp_path), tmp_path / "hold"
    hold.mkdir()
    async with stdio(effects, MCP_HOLD_DIR=str(hold)) as toolset:
        call = asyncio.ensure_future(toolset.call("book_seat", {"flight": "LH1"}, key="k1"))
        await _until((hold / "inside").exists, "the call reached the tool")
        os.kill(int((hold / "inside").read_text()), signal.SIGKILL)
        with pytest.raises(MCPReplyLostError):
            await asyncio.wait_for(call, 30)
        later = [toolset.call("book_seat", {"flight": f"LH{i}"}, key=f"k{i}") for i in (2, 3)]
        for outcome in await asyncio.gather(*later, return_exceptions=True):
            assert isinstance(outcome, MCPUnavailableError), outcome
            assert not isinstance(outcome, MCPReplyLostError)  # not sent, not in doubt
    assert effects.keys() == ["k1"]


# --- held: a cancelled call ---------------------------------------------------------------------


async def test_a_call_cancelled_while_it_waits_is_cancelled_and_the_toolset_stays_usable(
    tmp_path: Path,
) -> None:
    effects, hold = Effects(tmp_path), tmp_path / "hold"
    hold.mkdir()
    async with stdio(effects, MCP_HOLD_DIR=str(hold)) as toolset:
        call = asyncio.ensure_future(toolset.call("book_seat", {"flight": "LH1"}, key="k1"))
        await _until((hold / "inside").exists, "the call reached the tool")
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        (hold / "release").write_text("")
        assert await toolset.call("find_flights", {"origin": "A", "dest": "B"}) == "LH123 A-B"
        assert await toolset.call("book_seat", {"flight": "LH2"}, key="k2") == "booking B2"
    assert effects.keys() == ["k1", "k2"]


# --- 7. a cancel that lands while an abandoned call is wound down ------------------------------


async def test_a_cancel_landing_while_an_abandoned_call_winds_down_is_not_swallowed(
    raw: Raw,
) -> None:
    """The server reads nothing for a while, another call's large arguments fill the pipe,
    then the stalling call's reply comes unreadable: the toolset abandons it and waits (up
    to the SDK's 5 s) for its courtesy cancel to be written. Its caller is cancelled
    meanwhile."""
    async with raw.toolset() as toolset:
        stalled = asyncio.ensure_future(toolset.call("stall", {}, key="k1"))
        await _until(lambda: raw.calls("stall"), "the stalling call reached the server")
        big = asyncio.ensure_future(toolset.call("book", {"flight": "x" * 1_000_000}, key="k2"))
        await _until(lambda: len(toolset._unread) == 2, "both calls wait")
        await _until(lambda: len(toolset._unread) < 2, "the unreadable reply was read")
        await asyncio.sleep(0.05)  # winding down, the courtesy cancel not yet written
        stalled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await stalled
        await asyncio.gather(big, return_exceptions=True)


# --- held: a toolset used after close, and entered again ----------------------------------------


async def test_a_toolset_is_refused_after_close_and_reconnects_when_entered_again(
    tmp_path: Path,
) -> None:
    effects, hold = Effects(tmp_path), tmp_path / "hold"
    hold.mkdir()
    (hold / "release").write_text("")
    toolset = stdio(effects, MCP_HOLD_DIR=str(hold), MCP_HOLD_TOOL="find_flights")
    async with toolset:
        (old_book,) = [t for t in toolset.tools if t.name == "book_seat"]
        await toolset.call("find_flights", {"origin": "A", "dest": "B"})
        os.kill(int((hold / "inside").read_text()), signal.SIGKILL)  # dies while idle
        with contextlib.suppress(MCPUnavailableError):
            for _ in range(200):
                await toolset.call("find_flights", {"origin": "A", "dest": "B"})
                await asyncio.sleep(0.02)
    with pytest.raises(ConfigurationError):
        await toolset.call("book_seat", {"flight": "LH1"}, key="k1")
    with pytest.raises(ConfigurationError):
        _ = toolset.tools
    async with toolset:  # a new server process, and the loss is forgotten
        assert await toolset.call("book_seat", {"flight": "LH1"}, key="k1") == "booking B1"
        # A tool of the first connection (an agent built then) calls the new one.
        call = ToolCall(id="c2", name="book_seat", arguments={"flight": "LH2"})
        ctx = ToolContext(
            tenant="acme", run_id="r", call=call, idempotency_key="k2", fence=None, iteration=0
        )
        assert await old_book.invoke(call.arguments, ctx) == "booking B2"
    assert effects.keys() == ["k1", "k2"]


# --- 6. and held: what error texts show of a URL ------------------------------------------------


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:99999/mcp",
        "http://127.0.0.1:http/mcp",
        "http://[::1/mcp",
        "http://ops:pa#ss@127.0.0.1:1/mcp",
    ],
    ids=["port-out-of-range", "port-not-a-number", "unclosed-ipv6", "hash-in-password"],
)
async def test_a_url_that_cannot_be_taken_apart_does_not_crash_the_error_texts(url: str) -> None:
    # Refused when the toolset is made (ConfigurationError, the URL's credentials not
    # shown), or else when it is entered; never a raw ValueError.
    try:
        toolset = MCPToolset.http(url, connect_timeout=5)
    except ConfigurationError as exc:
        assert "pa" not in str(exc) and "ops" not in str(exc), exc
        return
    with warnings.catch_warnings():
        # Entering leaks the connection coroutine it never started: not this test's point.
        warnings.simplefilter("ignore", RuntimeWarning)
        try:
            async with toolset:
                pass
        except Exception as exc:  # the outcome is what is tested
            entered: Exception | None = exc
        else:
            entered = None
        gc.collect()
    assert isinstance(entered, ConfigurationError | MCPUnavailableError), repr(entered)
    assert "MCPToolset(" in repr(toolset)


async def test_error_texts_keep_an_ipv6_host_and_port_and_drop_credentials() -> None:
    with socket.socket(socket.AF_INET6) as s:  # a port on ::1 that nobody listens on
        s.bind(("::1", 0))
        port = s.getsockname()[1]
    url = f"http://ops:tok-pw@[::1]:{port}/mcp?access_token=tok-q#tok-f"
    toolset = MCPToolset.http(url, connect_timeout=5)
    assert repr(toolset) == f"MCPToolset(the MCP server at http://[::1]:{port}/mcp, not connected)"
    with pytest.raises(MCPUnavailableError) as refused:
        async with toolset:
            pass
    assert f"http://[::1]:{port}/mcp" in str(refused.value)
    assert "tok-" not in str(refused.value), refused.value
