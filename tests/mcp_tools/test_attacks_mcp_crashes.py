"""Attacks on the MCP toolset (``tesserix_adk.mcp``) against real MCP servers over loopback:
the SDK's ``MCPServer`` (``tests/mcp_tools/server.py``, stdio and streamable HTTP), a raw
JSON-RPC stdio server and a raw streamable-HTTP server written here, combined with the
runner on SQLite, operator cancels and a runner process killed with SIGKILL.

A strict xfail is a defect found (its reason says which); a plain test is a promise that
held.

Findings (defects; 1-4 and 6 are fixed and their tests plain, 5 stays a strict xfail, a
limit the README names):

1. HIGH. Over streamable HTTP, errors the SDK makes up itself when a call's answer never
   came whole are taken for the server's own answer: an SSE response that ends before its
   result ("SSE stream ended without a response", a server or a load balancer cutting a
   long call), reconnection given up ("... reconnection attempts were exhausted"), a
   ``202 Accepted`` to the request, a proxy's ``text/html`` page, a JSON body cut short.
   ``toolset._STAND_INS`` matches only four exact SDK texts, so each of these is an
   ``MCPToolError`` ("the server answered with an error"), recorded as the call's completed
   error outcome and told to the model, which asks again under a new key: a side-effecting
   call reaches the server twice in one run. It should be ``MCPReplyLostError`` (in doubt).
2. MEDIUM. A server that died while idle (restarted between two calls) makes the next call
   an ``MCPReplyLostError`` ("was sent ... it may have run"), though the SDK refused it
   before writing a byte: the call is left in doubt and every resume is refused
   (``IndeterminateToolCallError``) until an operator resolves a call that was never
   sent. errors.py says a gone server is ``MCPUnavailableError``, nothing sent. (The toolset
   only learns of the loss when its owner task ends, and the SDK's client does not end.)
3. MEDIUM. One malformed reply (a result that is not a ``CallToolResult``, structured
   content breaking the tool's ``outputSchema``) marks a live connection lost for good:
   every later call of every run sharing the toolset is refused "was not sent: the
   connection ... was lost earlier", though the server is up and answering. The first
   error also says "no reply came" of a reply that came.
4. MEDIUM. With the default ``call_timeout=None`` a reply the SDK cannot parse (nested past
   pydantic's recursion limit; logged and dropped by the SDK) leaves the call waiting for
   ever: the run holds its lease for ever, and ``runner.cancel`` cannot end it (the call is
   "in hand and finishes", and it never does). A reply that came and could not be read
   should be a lost reply.
5. MEDIUM. A crafted reply (120 000 small annotated content blocks, about 20 MB) is
   parsed and validated by the SDK on the runner's event loop: here over a second at a
   time with nothing else running, so a short lease lapses (``LeaseLostError``) although
   the worker is alive; the stall grows with the reply. Since then a reply past
   ``max_reply_items`` is not validated (its call in doubt; ``test_mcp_weighing.py``),
   which halves the stall; the SDK's parse of the line stays, so this stays a strict
   xfail, a limit the README names. (A thread of its own for the connection was tried
   and does not help: with a child process running, pydantic-core's parse there holds
   the GIL throughout.)
6. MEDIUM. The toolset's own error texts name the server by its full URL, credentials
   included (e.g. ``?access_token=``): ``MCPUnavailableError`` is a tool
   error outcome, so the token is handed to the model (a third party) verbatim, while the
   stores get it masked.

Held (plain tests): an operator cancel during a long MCP call lets the call finish, records
it and ends the run ``cancelled`` with nothing more sent; a runner killed with SIGKILL inside
an MCP call whose server then calls the tool idempotent (so a resume would send it again)
is neither resumed nor accepted under the new revision, and the server hears it once; a
runner killed with SIGKILL inside a streamable-HTTP call (the server outlives it and books)
is refused on resume from SQLite in another process, naming the call, never sent again; a
server answering one request twice does not shift answers onto later calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import pytest

from mcp_tools.servers import SERVER, Effects, QuietHTTPServer, free_port, stdio
from tesserix_adk import (
    Agent,
    AgentRunner,
    IndeterminateToolCallError,
    LeasePolicy,
    RevisionMismatchError,
    RunStatus,
    ScriptedProvider,
    open_stores,
)
from tesserix_adk.errors import AdkError, LeaseLostError, ToolOutcomeUnknownError
from tesserix_adk.leases import Leaseholder
from tesserix_adk.mcp import (
    MCPReplyLostError,
    MCPToolset,
    MCPUnavailableError,
)
from tesserix_adk.mcp.weighing import DEFAULT_MAX_REPLY_ITEMS
from tesserix_adk.messages import Role
from tesserix_adk.providers.base import ModelRequest, ModelResponse
from tesserix_adk.run.upgrade import accept_revision
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.stores.protocols import RecordStatus

pytestmark = pytest.mark.skipif(os.name != "posix", reason="needs POSIX signals and pipes")

T = "acme"
AGENT_PROCESS = str(Path(__file__).with_name("agent_process.py"))
BOOK: list[Any] = [[("book_seat", {"flight": "LH1"})], "done"]
# A model that, told the booking failed, asks for it again (a new call, a new key).
BOOK_AGAIN: list[Any] = [[("book_seat", {"flight": "LH1"})]] * 2 + ["done"]


class Seeing(ScriptedProvider):
    """The scripted model, keeping the last request it was sent."""

    last: ModelRequest | None = None

    async def complete(self, request: ModelRequest) -> ModelResponse:
        self.last = request
        return await super().complete(request)

    def tool_results(self) -> list[str]:
        assert self.last is not None
        return [m.text for m in self.last.messages if m.role is Role.tool]


@pytest.fixture
async def stores(tmp_path: Path) -> AsyncIterator[Stores]:
    """The kit's stores on one SQLite file under the test's directory."""
    async with open_stores(f"sqlite:///{tmp_path / 'adk.sqlite3'}") as opened:
        await opened.create_schema()
        yield opened


async def _record(stores: Stores, run_id: str, tool: str = "book_seat") -> Any:
    return [r for r in await stores.idempotency.records(T, run_id) if r.tool == tool]


# --- a raw JSON-RPC server over stdio -------------------------------------------------------

HOSTILE_STDIO = r"""
import json, os, sys

MODE = os.environ.get("MODE", "")


def send(message):
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def tools():
    book = {"name": "book_seat", "description": "Book a seat.",
            "inputSchema": {"type": "object", "properties": {"flight": {"type": "string"}}}}
    if MODE == "schema":
        book["outputSchema"] = {"type": "object", "properties": {"n": {"type": "integer"}},
                                "required": ["n"]}
    look = {"name": "look", "description": "Look.", "inputSchema": {"type": "object"},
            "annotations": {"readOnlyHint": True}}
    return [book, look]


def call(rid, params):
    with open(os.environ["CALLS"], "a") as f:
        f.write(json.dumps(params) + "\n")
    if params.get("name") == "look":
        return send({"jsonrpc": "2.0", "id": rid,
                     "result": {"content": [{"type": "text", "text": "seen"}]}})
    if MODE == "malformed":  # booked, and the answer is not a CallToolResult
        return send({"jsonrpc": "2.0", "id": rid, "result": {"content": "booked"}})
    if MODE == "schema":  # booked, and the structured content breaks the outputSchema
        return send({"jsonrpc": "2.0", "id": rid, "result": {
            "content": [{"type": "text", "text": "booked"}], "structuredContent": {"n": "x"}}})
    if MODE == "deep":  # booked, and the answer nests past what the SDK parses
        depth = 400
        value = '{"x":' * depth + '"booked"' + "}" * depth
        sys.stdout.write('{"jsonrpc":"2.0","id":%s,"result":{"content":[],'
                         '"structuredContent":%s}}\n' % (json.dumps(rid), value))
        return sys.stdout.flush()
    if MODE == "blocks":  # booked, and the answer is many small annotated blocks
        block = ('{"type":"text","text":"b","annotations":{"audience":["user","assistant",'
                 '"user","assistant"],"priority":0.5,"lastModified":"2025-01-01T00:00:00Z"},'
                 '"_meta":{"a":1}}')
        body = ",".join([block] * int(os.environ["BLOCKS"]))
        sys.stdout.write('{"jsonrpc":"2.0","id":%s,"result":{"content":[%s]}}\n'
                         % (json.dumps(rid), body))
        return sys.stdout.flush()
    if MODE == "error_blocks":  # booked, and an error answer whose data is many values
        data = [{"at": i, "why": ["a", "b"]} for i in range(int(os.environ["BLOCKS"]))]
        return send({"jsonrpc": "2.0", "id": rid,
                     "error": {"code": -32000, "message": "refused", "data": data}})
    if MODE == "noisy":  # a notification of many values first, then the plain answer
        params = {"level": "info", "data": [[i] for i in range(int(os.environ["BLOCKS"]))]}
        send({"jsonrpc": "2.0", "method": "notifications/message", "params": params})
    if MODE == "twice":  # the same request answered twice, differently
        text = "booked " + params.get("arguments", {}).get("flight", "?")
        send({"jsonrpc": "2.0", "id": rid, "result": {"content": [{"type": "text", "text": text}]}})
        return send({"jsonrpc": "2.0", "id": rid,
                     "result": {"content": [{"type": "text", "text": "stale second answer"}]}})
    send({"jsonrpc": "2.0", "id": rid, "result": {"content": [{"type": "text", "text": "booked"}]}})


for line in sys.stdin:
    try:
        request = json.loads(line)
    except ValueError:
        continue
    method, rid = request.get("method"), request.get("id")
    if rid is None:
        continue
    if method == "initialize":
        send({"jsonrpc": "2.0", "id": rid, "result": {
            "protocolVersion": request["params"]["protocolVersion"],
            "capabilities": {"tools": {}}, "serverInfo": {"name": "hostile", "version": "0"}}})
    elif method == "tools/list":
        send({"jsonrpc": "2.0", "id": rid, "result": {"tools": tools()}})
    elif method == "tools/call":
        call(rid, request.get("params", {}))
    else:
        send({"jsonrpc": "2.0", "id": rid, "error": {"code": -32601, "message": "no " + method}})
"""


class Hostile:
    """The raw stdio server, written into the test's directory, and the calls it got."""

    def __init__(self, tmp: Path) -> None:
        self.script = tmp / "hostile_stdio.py"
        self.script.write_text(HOSTILE_STDIO)
        self.calls_file = tmp / "calls.jsonl"

    def toolset(
        self,
        mode: str,
        *,
        call_timeout: float | None = 10.0,
        max_reply_items: int = DEFAULT_MAX_REPLY_ITEMS,
        **env: str,
    ) -> MCPToolset:
        return MCPToolset.stdio(
            sys.executable,
            [str(self.script)],
            env={"MODE": mode, "CALLS": str(self.calls_file), **env},
            call_timeout=call_timeout,
            max_reply_items=max_reply_items,
        )

    def calls(self, name: str = "book_seat") -> list[dict[str, Any]]:
        if not self.calls_file.exists():
            return []
        rows = [json.loads(line) for line in self.calls_file.read_text().splitlines()]
        return [r for r in rows if r.get("name") == name]


@pytest.fixture
def hostile(tmp_path: Path) -> Hostile:
    return Hostile(tmp_path)


# --- a raw streamable-HTTP server whose call answers never come whole -------------------------


class _HttpMCP(BaseHTTPRequestHandler):
    """Enough streamable HTTP to list one side-effecting tool; a ``tools/call`` is recorded
    (the tool ran), then answered as ``server.mode`` says."""

    protocol_version = "HTTP/1.0"

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _reply(
        self,
        status: int,
        body: Any = None,
        *,
        raw: bytes | None = None,
        kind: str = "application/json",
        headers: dict[str, str] | None = None,
    ) -> None:
        data = raw if raw is not None else b"" if body is None else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-type", kind)
        self.send_header("content-length", str(len(data)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(data)

    def _sse(self, frames: bytes) -> None:
        # The response starts as an event stream, then the connection ends with no result.
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.end_headers()
        self.wfile.write(frames)
        self.wfile.flush()
        self.connection.close()

    def do_GET(self) -> None:
        self._reply(405)

    def do_DELETE(self) -> None:
        self._reply(200)

    def do_POST(self) -> None:
        request = json.loads(self.rfile.read(int(self.headers.get("content-length") or 0)))
        method, rid = request.get("method"), request.get("id")
        server: Any = self.server
        if rid is None:
            self._reply(202)
        elif method == "initialize":
            result = {
                "protocolVersion": request["params"]["protocolVersion"],
                "capabilities": {"tools": {}},
                "serverInfo": {"name": "gateway", "version": "0"},
            }
            self._reply(
                200,
                {"jsonrpc": "2.0", "id": rid, "result": result},
                headers={"mcp-session-id": "s"},
            )
        elif method == "tools/list":
            tools = [{"name": "book_seat", "inputSchema": {"type": "object"}}]
            self._reply(200, {"jsonrpc": "2.0", "id": rid, "result": {"tools": tools}})
        elif method == "tools/call":
            server.calls.append(request["params"])
            mode = server.mode
            if mode == "sse-cut":
                self._sse(b": working\n\n")
            elif mode == "sse-cut-resumable":
                self._sse(b"id: e1\nretry: 10\ndata: \n\n")
            elif mode == "accepted":
                self._reply(202)
            elif mode == "proxy-html":
                self._reply(200, raw=b"<html>502 upstream</html>", kind="text/html")
            elif mode == "json-cut":
                self._reply(200, raw=b'{"jsonrpc": "2.0", "id": ')
            else:
                text = {"content": [{"type": "text", "text": "booked"}]}
                self._reply(200, {"jsonrpc": "2.0", "id": rid, "result": text})
        else:
            self._reply(
                200, {"jsonrpc": "2.0", "id": rid, "error": {"code": -32601, "message": "?"}}
            )


@contextlib.contextmanager
def _http_mcp(mode: str) -> Iterator[tuple[str, list[dict[str, Any]]]]:
    server = QuietHTTPServer(("127.0.0.1", 0), _HttpMCP)
    calls: list[dict[str, Any]] = []
    server.calls, server.mode = calls, mode  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02})
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/mcp", calls
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


@contextlib.contextmanager
def _sdk_http_server(effects: Effects, **env: str) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """The SDK's server over streamable HTTP on a free loopback port, and its process."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, SERVER, "http", str(port)],
        env={**os.environ, **effects.env(**env)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 20
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "no MCP server"
            with contextlib.suppress(OSError):
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            time.sleep(0.05)
        yield proc, f"http://127.0.0.1:{port}/mcp"
    finally:
        proc.kill()
        proc.wait(10)


CUT_SHORT = ["sse-cut", "sse-cut-resumable", "accepted", "proxy-html", "json-cut"]


# --- 1. SDK stand-ins taken for the server's answer ----------------------------------------


@pytest.mark.parametrize("mode", CUT_SHORT)
async def test_an_http_answer_that_never_came_whole_is_a_lost_reply(mode: str) -> None:
    with _http_mcp(mode) as (url, calls):
        async with MCPToolset.http(url, call_timeout=10) as toolset:
            with pytest.raises(MCPReplyLostError) as lost:
                await asyncio.wait_for(toolset.call("book_seat", {}, key="k1"), 30)
    assert lost.value.outcome_unknown
    assert len(calls) == 1


async def test_a_booking_whose_sse_answer_was_cut_is_left_in_doubt_not_sent_again(
    stores: Stores,
) -> None:
    with _http_mcp("sse-cut") as (url, calls):
        async with MCPToolset.http(url, call_timeout=10) as toolset:
            agent = Agent("mcp", "book", list(toolset.tools))
            runner = AgentRunner.from_stores(ScriptedProvider(BOOK_AGAIN), stores)
            with contextlib.suppress(AdkError):
                await asyncio.wait_for(runner.run(agent, "b", tenant=T, run_id="r"), 60)
    records = await _record(stores, "r")
    assert len(calls) == 1, f"the server booked {len(calls)} times"
    assert [r.status for r in records] == [RecordStatus.in_flight]


# --- 2. a server gone while idle ------------------------------------------------------------


def _reaped_or_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError):
        return True


async def _until_the_sdk_saw_it_close(toolset: MCPToolset) -> None:
    """The SDK notices the dead server's EOF within a few loop turns; its dispatcher says so."""
    dispatcher = getattr(getattr(toolset._client, "session", None), "_dispatcher", None)
    for _ in range(250):
        if dispatcher is not None and getattr(dispatcher, "_closed", False):
            return
        await asyncio.sleep(0.02)


async def test_a_call_to_a_server_that_died_while_idle_is_not_sent_and_not_in_doubt(
    tmp_path: Path, stores: Stores
) -> None:
    effects, hold = Effects(tmp_path), tmp_path / "hold"
    hold.mkdir()
    (hold / "release").write_text("")  # find_flights writes its pid and returns at once
    seeing = Seeing(BOOK)
    toolset = stdio(effects, MCP_HOLD_DIR=str(hold), MCP_HOLD_TOOL="find_flights")
    async with toolset:
        await toolset.call("find_flights", {"origin": "FRA", "dest": "JFK"})
        pid = int((hold / "inside").read_text())
        os.kill(pid, signal.SIGKILL)  # the server is restarted between two turns
        for _ in range(500):
            if _reaped_or_zombie(pid):
                break
            await asyncio.sleep(0.01)
        await _until_the_sdk_saw_it_close(toolset)
        agent = Agent("booking", "Book.", toolset.tools)
        runner = AgentRunner.from_stores(seeing, stores)
        try:
            run = await runner.run(agent, "book", tenant=T, run_id="r")
        except ToolOutcomeUnknownError as exc:
            (record,) = await _record(stores, "r")
            pytest.fail(f"left in doubt ({record.status}): {exc}")
    (record,) = await _record(stores, "r")
    assert run.status is RunStatus.completed
    assert record.status is RecordStatus.completed
    assert "not sent" in seeing.tool_results()[0]
    assert effects.keys() == []


# --- 3. one malformed reply poisons a live connection ---------------------------------------


@pytest.mark.parametrize("mode", ["malformed", "schema"])
async def test_one_malformed_reply_does_not_cut_off_the_live_server(
    hostile: Hostile, mode: str
) -> None:
    async with hostile.toolset(mode) as toolset:
        with pytest.raises(MCPReplyLostError) as first:
            await toolset.call("book_seat", {"flight": "LH1"}, key="k1")
        assert await asyncio.wait_for(toolset.call("look", {}), 30) == "seen"
    # The server did answer; the toolset should not say otherwise.
    assert "no reply came" not in str(first.value)
    assert len(hostile.calls("look")) == 1


# --- 4. a reply the SDK drops, with no call timeout -------------------------------------------


async def test_an_unreadable_reply_neither_hangs_the_run_nor_outlives_a_cancel(
    hostile: Hostile, stores: Stores
) -> None:
    async with hostile.toolset("deep", call_timeout=None) as toolset:
        agent = Agent("mcp", "book", list(toolset.tools))
        runner = AgentRunner.from_stores(ScriptedProvider(BOOK), stores)
        task = asyncio.ensure_future(runner.run(agent, "b", tenant=T, run_id="r"))
        try:
            for _ in range(1500):
                if hostile.calls() or task.done():
                    break
                await asyncio.sleep(0.02)
            assert hostile.calls(), "the call never reached the server"
            await runner.cancel("r", tenant=T, by="ops", reason="stuck")
            # The reply came at once; a bound many times what ending the run takes.
            done, _ = await asyncio.wait({task}, timeout=8)
            assert task in done, "the run is still waiting on a reply that came"
            with pytest.raises(ToolOutcomeUnknownError):
                task.result()
        finally:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
    assert len(hostile.calls()) == 1


# --- 5. a reply parsed on the runner's event loop --------------------------------------------


@pytest.mark.xfail(
    strict=True,
    reason="the SDK parses a stdio line in one call into pydantic-core, on whatever thread "
    "reads it, holding the GIL: 20 MB of small values stop the process for seconds "
    "before max_reply_items (mcp/weighing.py) can weigh the reply, and a short lease "
    "lapses (a limit README's MCP section names; the validation after it is bounded)",
)
async def test_a_crafted_reply_does_not_stall_the_loop_until_the_lease_is_lost(
    hostile: Hostile, stores: Stores
) -> None:
    """120 000 annotated blocks (about 20 MB), past max_reply_items: the call is rightly in
    doubt, but reading the line held the loop longer than the 0.4 s ttl, so a run's lease
    held meanwhile has lapsed."""
    policy = LeasePolicy(ttl=0.4, renew_within=0.3)
    async with hostile.toolset("blocks", call_timeout=120, BLOCKS="120000") as toolset:
        holder = await Leaseholder.acquire(stores.leases, T, "r", "worker-1", policy)
        async with holder:
            with pytest.raises(MCPReplyLostError, match="max_reply_items"):
                await toolset.call("book_seat", {"flight": "LH1"}, key="k1")
            try:
                holder.check()
            except LeaseLostError as exc:
                pytest.fail(f"the lease lapsed while the reply was read: {exc}")
    assert len(hostile.calls()) == 1


# --- 6. credentials in the server's URL -----------------------------------------------------


async def test_a_token_in_the_servers_url_is_never_told_to_the_model(
    tmp_path: Path, stores: Stores
) -> None:
    token = "mcp-tok-9f8e7d6c5b4a39281706"
    effects = Effects(tmp_path)
    seeing = Seeing(BOOK)
    with _sdk_http_server(effects) as (proc, base):
        url = f"{base}?access_token={token}"
        async with MCPToolset.http(url, call_timeout=10) as toolset:
            agent = Agent("booking", "Book.", toolset.tools)
            proc.kill()  # the server goes away (a deploy); the toolset finds out
            proc.wait(10)
            for _ in range(5):  # the first call finds out, later ones are refused
                with contextlib.suppress(AdkError):
                    await asyncio.wait_for(toolset.call("find_flights", {}), 30)
            with pytest.raises(MCPUnavailableError):
                await asyncio.wait_for(toolset.call("find_flights", {}), 30)
            runner = AgentRunner.from_stores(seeing, stores)
            run = await runner.run(agent, "book", tenant=T, run_id="r")
    assert run.status is RunStatus.completed
    (told,) = seeing.tool_results()
    assert "not sent" in told  # what the model is told: the call did not go out
    assert token not in told, told


# --- held: an operator cancel during a long call ------------------------------------------------


async def test_an_operator_cancel_during_a_long_mcp_call_lets_it_finish_then_ends_the_run(
    tmp_path: Path, stores: Stores
) -> None:
    """README: a call already claimed is in hand and finishes; the run then ends
    ``cancelled`` at its next boundary and sends nothing more."""
    effects, hold = Effects(tmp_path), tmp_path / "hold"
    hold.mkdir()
    turns: list[Any] = [
        [("book_seat", {"flight": "LH1"})],
        [("book_seat", {"flight": "LH2"})],
        "done",
    ]
    async with stdio(effects, MCP_HOLD_DIR=str(hold)) as toolset:
        agent = Agent("booking", "Book.", toolset.tools)
        runner = AgentRunner.from_stores(ScriptedProvider(turns), stores)
        task = asyncio.ensure_future(runner.run(agent, "book", tenant=T, run_id="r"))
        try:
            for _ in range(1500):
                if (hold / "inside").exists() or task.done():
                    break
                await asyncio.sleep(0.02)
            assert (hold / "inside").exists()
            assert await runner.cancel("r", tenant=T, by="ops", reason="wrong trip") is None
            (hold / "release").write_text("")
            run = await asyncio.wait_for(task, 60)
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
    records = await _record(stores, "r")
    assert run.status is RunStatus.cancelled
    (record,) = records
    assert record.status is RecordStatus.completed
    assert effects.keys() == [record.key]


# --- held: a killed runner, then a server that calls the tool idempotent -----------------------


def _kill_inside_book_seat(hold: Path, argv: list[str], *, end_server: bool) -> None:
    """Start the runner process ``argv``, SIGKILL it while the server is inside book_seat
    (the server has booked), then let the server out (and end it, if it was the dead
    runner's stdio child)."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    server_pid = None
    try:
        deadline = time.monotonic() + 30
        while not (hold / "inside").exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise AssertionError(f"never reached book_seat: {proc.communicate()}")
            time.sleep(0.02)
        server_pid = int((hold / "inside").read_text())
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        (hold / "release").write_text("")
        if end_server and server_pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(server_pid, signal.SIGKILL)
        proc.communicate(timeout=20)
    assert proc.returncode == -signal.SIGKILL


async def test_killed_mid_call_a_server_now_calling_the_tool_idempotent_gets_nothing_resent(
    tmp_path: Path,
) -> None:
    """The server comes back saying ``book_seat`` is idempotent, which would make the call
    in doubt safe to send again: the resume is refused (a changed agent), and so is
    accepting the new revision, naming the flag; the server heard the booking once."""
    store = f"sqlite:///{tmp_path / 'adk.sqlite3'}"
    effects, hold = Effects(tmp_path), tmp_path / "hold"
    hold.mkdir()
    argv = [sys.executable, AGENT_PROCESS, store, "r", effects.path, "--hold", str(hold)]
    _kill_inside_book_seat(hold, argv, end_server=True)
    assert len(effects.keys()) == 1
    async with open_stores(store) as stores, stdio(effects, variant="annotations") as toolset:
        changed = Agent("booking", "Book.", toolset.tools)
        assert {t.name: t.idempotent for t in changed.tools.values()}["book_seat"]
        runner = AgentRunner.from_stores(
            ScriptedProvider(["Booked."]),
            stores,
            lease_policy=LeasePolicy(ttl=3.0, renew_within=2.0),
        )
        deadline = time.monotonic() + 20
        while True:  # the dead runner's lease (3 s) lapses first
            try:
                await runner.resume(changed, "r", tenant=T)
            except RevisionMismatchError:
                break
            except AdkError as exc:
                assert exc.retryable and time.monotonic() < deadline, exc
                await asyncio.sleep(0.1)
        with pytest.raises(RevisionMismatchError, match="book_seat"):
            await accept_revision(runner, changed, "r", tenant=T, by="ops")
        (record,) = await _record(stores, "r")
    assert record.status is RecordStatus.in_flight
    assert effects.keys() == [record.key]


HTTP_RUNNER = r"""
import asyncio, sys
from tesserix_adk import Agent, AgentRunner, LeasePolicy, ScriptedProvider, open_stores
from tesserix_adk.mcp import MCPToolset


async def main(store, url):
    async with open_stores(store) as stores, MCPToolset.http(url) as toolset:
        await stores.create_schema()
        agent = Agent("booking", "Book.", toolset.tools)
        turns = [[("book_seat", {"flight": "LH9"})], "Booked."]
        runner = AgentRunner.from_stores(
            ScriptedProvider(turns), stores, lease_policy=LeasePolicy(ttl=3.0, renew_within=2.0)
        )
        await runner.run(agent, "book", tenant="acme", run_id="h")


asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


async def test_a_runner_killed_inside_an_http_mcp_call_is_refused_on_resume_not_resent(
    tmp_path: Path,
) -> None:
    """Over streamable HTTP the server outlives the runner and finishes the booking; the
    resume, in another process on the same SQLite file, refuses the call in doubt, naming
    it, and the server hears it once."""
    store = f"sqlite:///{tmp_path / 'adk.sqlite3'}"
    script = tmp_path / "http_runner.py"
    script.write_text(HTTP_RUNNER)
    effects, hold = Effects(tmp_path), tmp_path / "hold"
    hold.mkdir()
    with _sdk_http_server(effects, MCP_HOLD_DIR=str(hold)) as (_, url):
        argv = [sys.executable, str(script), store, url]
        _kill_inside_book_seat(hold, argv, end_server=False)
        async with open_stores(store) as stores, MCPToolset.http(url) as toolset:
            agent = Agent("booking", "Book.", toolset.tools)
            turns: list[Any] = [[("book_seat", {"flight": "LH9"})], "Booked."]
            runner = AgentRunner.from_stores(
                ScriptedProvider(turns), stores, lease_policy=LeasePolicy(ttl=3.0, renew_within=2.0)
            )
            deadline = time.monotonic() + 20
            while True:  # the dead runner's lease (3 s) lapses first
                try:
                    await runner.resume(agent, "h", tenant=T)
                except IndeterminateToolCallError as exc:
                    refused = exc
                    break
                except AdkError as exc:
                    assert exc.retryable and time.monotonic() < deadline, exc
                    await asyncio.sleep(0.1)
            (record,) = await _record(stores, "h")
    assert "book_seat" in str(refused) and not refused.retryable
    assert record.status is RecordStatus.in_flight
    assert effects.keys() == [record.key]


# --- held: a request answered twice -------------------------------------------------------------


async def test_a_request_answered_twice_does_not_shift_answers_onto_later_calls(
    hostile: Hostile,
) -> None:
    async with hostile.toolset("twice") as toolset:
        first = await toolset.call("book_seat", {"flight": "LH1"}, key="k1")
        second = await toolset.call("book_seat", {"flight": "LH2"}, key="k2")
    assert (first, second) == ("booked LH1", "booked LH2")
    assert [c["_meta"]["tesserix/idempotency_key"] for c in hostile.calls()] == ["k1", "k2"]
