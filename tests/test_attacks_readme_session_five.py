"""Attacks on today's README claims (``git diff 25b8c6b..HEAD -- README.md``), exercised for
real: the SDK's ``MCPServer`` over stdio and streamable HTTP (``tests/mcp_tools/server.py``
and a large-reply server written here), a stateful streamable-HTTP server written here that
answers an unknown session as the SDK's own stateful server does (404 and a JSON-RPC
``Session not found``), the runner on a SQLite file, the ``tesserix`` entry point in a
subprocess, and the console's Starlette app.

A strict xfail is a defect (its reason says what and where); a plain test is a claim that
held.

Findings (each was a strict xfail; all fixed since and their tests plain. 404 ``Session not
found`` is not sent and ends the connection, so the next call reaches the server again;
"other tools" refuses every later call until the toolset is entered again; the plan's
words for another run's claim say it is that run's call, replayed here and resolved there,
though its disposition stays ``indeterminate`` (this run cannot go on by itself) and
``run --resume`` still prints that it held the run, which it did, the tests changed so;
``resolve`` names the run whose claim it is; a key function's ``None`` for arguments the
tool refuses is a refusal):

1. MEDIUM. "A lost connection ... Over HTTP the next call reaches the server again" does not
   hold for an HTTP server that keeps sessions and restarted while the toolset was idle (a
   deploy, a crash between calls): it answers the old session 404 ``Session not found``
   with a JSON-RPC error body, the SDK hands that on as the server's own error, and
   ``MCPToolset.call`` (``mcp/toolset.py``: ``stand_in`` is ``None``, so ``MCPToolError``)
   tells the model "book_seat: Session not found" as the tool's answer; ``conn.lost`` is
   never set, so every later call is the same and the server is never reached again until
   the app leaves ``async with``. Nothing runs twice (404 ran nothing), but the toolset is
   dead while the README says it heals, and the model reads a transport failure as a
   booking refused. (The SDK's own ``MCPServer`` here negotiates the session-less protocol,
   so it is not hit; a server of the 2025 protocol, stateful, is.)
   ``test_a_stateful_http_server_restarted_while_idle_is_reached_again``
2. LOW. "when it lists other tools, every call is ``MCPUnavailableError``, not retryable
   ... leave ``async with`` and enter it again": every later call opens a new session
   (``initialize`` and ``tools/list`` per call, ``_reached_again`` retries whenever the
   last try's count is unchanged) and, once the server lists the first tools again, the
   call goes out. "not retryable" is not what happens; either the README or the code.
   ``test_after_other_tools_every_later_call_is_refused_until_entered_again``
3. LOW-MEDIUM. ``tesserix inspect`` (``checkpoint/planning.py``, the ``rec.run_id !=
   checkpoint.run_id`` branch) and the console's run page show a run whose call another
   LIVE run is sending as ``indeterminate`` ... "nobody can say whether it ran", the words
   of a call in doubt that needs an operator, while the README says such a run "is not
   refused in doubt meanwhile" and a resume would come back and replay. The run it waits
   on is named (r1), but not that it is r1's call, not the operator's to resolve, nor that
   carrying this run on once r1 has its outcome replays it.
   ``test_inspect_of_a_run_waiting_on_a_live_run_does_not_call_it_in_doubt``
4. LOW. ``tesserix run --resume`` of such a run prints the same "indeterminate ... nobody
   can say whether it ran" plan and "holding the run as worker-... (fence 2)" on stdout,
   then exits 3 with the (good) sentence naming r1 on stderr: a script or an operator
   reading stdout sees a run in doubt being carried.
   ``test_run_resume_of_a_waiting_run_prints_no_in_doubt_plan_nor_holding``
5. LOW. ``tesserix resolve r2 --call call_0_0`` (the call id ``inspect r2`` just listed,
   or its key) says "run 'r2' of tenant 'acme' has no call 'call_0_0' on record", exit 1:
   right to refuse, but it does not say the call is claimed by run r1 under a shared key,
   so the operator is sent looking rather than told where the call is.
   ``test_resolve_on_the_waiting_run_names_the_run_whose_claim_it_is``
6. LOW. "A call whose custom key cannot be made from what the model sent (the function
   reads an argument the model left out) and whose arguments the tool refuses too is
   answered 'not sent'": a key function reading it with ``.get`` (``None`` when the model
   left it out) is a ``ConfigurationError`` (``run/screening.py`` ``_key_of`` re-raises
   the ``ConfigurationError`` ``Tool.key_for`` makes of a non-str key before asking the
   tool's validation), so the model's omission stops the run (a worker parks it) where the
   README promises the model is told "not sent".
   ``test_a_key_function_returning_none_for_an_argument_the_model_left_out_is_not_sent``

Unclear (not turned into tests):

- "every later call is ``MCPUnavailableError``, not sent" for a dead stdio server: it is
  ``retryable=True`` (the class default), though no retry can succeed until the toolset
  is entered again; the HTTP other-tools case says "not retryable", stdio says nothing.
- ``max_reply_items`` bounds every message, the connect-time ``tools/list`` reply too: a
  server listing more than 250,000 JSON values of tools cannot be connected to
  (``MCPUnavailableError`` "tesserix: a reply of more than ..."); the README speaks only of
  a call's reply. A server's JSON-RPC error answer past the limit (its "no") becomes a
  call in doubt (safe direction, unsaid). ``DEFAULT_MAX_REPLY_ITEMS`` is not exported from
  ``tesserix_adk.mcp`` (only ``tesserix_adk.mcp.toolset``).
- The default is smaller than it reads: the SDK's ``MCPServer`` sends a tool's list as one
  content block per item plus a structured copy, 4 JSON values an item, so a tool returning
  a list of some 62,500 numbers is already past 250,000 and its call in doubt.
- ``ResumeConflictError`` now means two things: "another worker holds the run" (its
  docstring, ``exc.holder`` the holder of THIS run) and "another run is sending a call
  this run needs" (``exc.holder`` is then the other run's worker). A caller reading
  ``.holder`` cannot tell which; the message text can.
- A run that waits on another run's claim is not listed by ``runs --stuck`` (right while
  that run lives); once that run died, only that run is listed, and the waiting run is
  blocked without a note until it is carried on (a worker then parks it, in doubt). The
  README says "in doubt as any other"; which run to resolve is only in ``inspect``'s text.
- ``tesserix show`` of the waiting run says nothing of the other run's claim (its
  ``calls:`` list is empty: the record is the other run's).

What held (plain tests): over stdio, a server killed mid-call leaves that call
``MCPReplyLostError`` and every later call ``MCPUnavailableError``, nothing sent and no
server started again; over streamable HTTP (the SDK's ``MCPServer`` in a subprocess)
killed mid-call: in doubt, while down ``MCPUnavailableError`` retryable and not sent, back
with the same tools the call goes out once; a reply of about 280,000 values (70,000
numbers) from the SDK's ``MCPServer`` over stdio at the default limit is
``MCPReplyLostError`` naming ``max_reply_items`` and the next call on the same connection
is answered, one of about 200,000 values is read; ``max_reply_items`` refuses 0, a bool
and a float; a run waiting on a live run's claim: ``tesserix run --resume`` exits 3 with
one sentence naming r1 and no traceback, ``runs --stuck`` lists neither run, the console
offers no resolve form on it, carried on by the CLI after r1 finished it replays r1's
outcome (one charge); a key function reading an argument the model left out of a tool that
requires it: the model is told "not sent" with the tool's validation sentence, nothing
sent, the run completes; one failing on arguments the tool accepts: ``ConfigurationError``
naming the tool, nothing sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import itertools
import json
import os
import signal
import sys
import textwrap
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from mcp_tools.servers import (
    SERVER,
    Effects,
    JsonHttpHandler,
    QuietHTTPServer,
    _wait_accepting,
    free_port,
    stdio,
)
from mcp_tools.test_attacks_mcp_reach_again import BOOK_SEAT, LOOK, _lose, _switched
from tesserix_adk import (
    Agent,
    AgentRunner,
    ConfigurationError,
    RunStatus,
    ScriptedProvider,
    open_stores,
    tool,
)
from tesserix_adk.errors import ResumeConflictError
from tesserix_adk.mcp import MCPReplyLostError, MCPToolset, MCPUnavailableError
from tesserix_adk.messages import Role
from tesserix_adk.providers.base import ModelRequest, ModelResponse

T = "acme"
TESSERIX = str(Path(sys.executable).with_name("tesserix"))


# --- MCP: a lost connection --------------------------------------------------------------


def _server_children() -> list[int]:
    """Pids of this process's children running the test MCP server (over stdio)."""
    found = []
    me = os.getpid()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        state = stat.rsplit(")", 1)[1].split()[0]
        if ppid == me and SERVER in cmdline and state != "Z":
            found.append(int(entry.name))
    return found


async def _until(check: Any, seconds: float = 20.0) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


async def test_a_stdio_server_killed_mid_call_is_in_doubt_then_not_sent_and_not_restarted(
    tmp_path: Path,
) -> None:
    effects = Effects(tmp_path)
    hold = tmp_path / "hold"
    hold.mkdir()
    async with stdio(effects, MCP_HOLD_DIR=str(hold)) as toolset:
        call = asyncio.create_task(toolset.call("book_seat", {"flight": "LH1"}, key="k1"))
        await _until((hold / "inside").exists)
        os.kill(int((hold / "inside").read_text()), signal.SIGKILL)
        with pytest.raises(MCPReplyLostError):
            await asyncio.wait_for(call, 30)
        for key in ("k2", "k3"):
            with pytest.raises(MCPUnavailableError) as met:
                await asyncio.wait_for(toolset.call("book_seat", {"flight": "LH1"}, key=key), 30)
            assert not isinstance(met.value, MCPReplyLostError)
            assert "not sent" in str(met.value)
        assert _server_children() == []  # not started again
    assert effects.keys() == ["k1"]


@contextlib.contextmanager
def _sdk_http_server(effects: Effects, port: int, **env: str) -> Iterator[None]:
    import subprocess

    proc = subprocess.Popen(
        [sys.executable, SERVER, "http", str(port)],
        env={**os.environ, **effects.env(**env)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        _wait_accepting(port, proc)
        yield
    finally:
        proc.kill()
        proc.wait(10)


async def test_an_http_server_killed_mid_call_is_in_doubt_unavailable_while_down_reached_back(
    tmp_path: Path,
) -> None:
    effects = Effects(tmp_path)
    hold = tmp_path / "hold"
    hold.mkdir()
    port = free_port()
    url = f"http://127.0.0.1:{port}/mcp"
    with _sdk_http_server(effects, port, MCP_HOLD_DIR=str(hold)):
        toolset = MCPToolset.http(url, call_timeout=20, connect_timeout=3)
        await toolset.__aenter__()
        call = asyncio.create_task(toolset.call("book_seat", {"flight": "LH1"}, key="k1"))
        await _until((hold / "inside").exists)
        os.kill(int((hold / "inside").read_text()), signal.SIGKILL)
        try:
            with pytest.raises(MCPReplyLostError):
                await asyncio.wait_for(call, 30)
        except BaseException:
            await toolset.__aexit__(None, None, None)
            raise
    try:
        with pytest.raises(MCPUnavailableError) as down:
            await asyncio.wait_for(toolset.call("book_seat", {"flight": "LH1"}, key="k2"), 30)
        assert not isinstance(down.value, MCPReplyLostError)
        assert down.value.retryable and "not sent" in str(down.value)
        with _sdk_http_server(effects, port):
            got = await asyncio.wait_for(toolset.call("book_seat", {"flight": "LH1"}, key="k3"), 30)
            assert got.startswith("booking B")
    finally:
        await toolset.__aexit__(None, None, None)
    assert effects.keys() == ["k1", "k3"]


class _Stateful(JsonHttpHandler):
    """A streamable-HTTP server of the 2025 protocol that keeps sessions: ``initialize``
    opens one (``mcp-session-id``); a request naming a session it does not know is answered
    as the SDK's own stateful server answers it (``streamable_http_manager``): 404 with a
    JSON-RPC error ``Session not found``. ``restart()`` forgets every session, as a new
    process would."""

    def do_POST(self) -> None:
        request = self._request()
        server: Any = self.server
        session = self.headers.get("mcp-session-id")
        method, rid = request.get("method"), request.get("id")
        if method == "initialize":
            new = f"s{next(server.numbers)}"
            server.sessions.add(new)
            result = {
                "protocolVersion": request["params"]["protocolVersion"],
                "capabilities": {"tools": {}},
                "serverInfo": {"name": "stateful", "version": "0"},
            }
            ok = {"jsonrpc": "2.0", "id": rid, "result": result}
            self._reply(200, ok, headers={"mcp-session-id": new})
            return
        if session is not None and session not in server.sessions:
            gone = {"code": -32600, "message": "Session not found"}
            self._reply(404, {"jsonrpc": "2.0", "id": None, "error": gone})
            return
        if rid is None:
            self._reply(202)
        elif session is None:  # server/discover of the newer protocol: unknown here
            no = {"code": -32601, "message": "Method not found"}
            self._reply(200, {"jsonrpc": "2.0", "id": rid, "error": no})
        elif method == "tools/list":
            self._reply(200, {"jsonrpc": "2.0", "id": rid, "result": {"tools": [BOOK_SEAT]}})
        elif method == "tools/call":
            server.calls.append(request["params"])
            content = [{"type": "text", "text": "booked"}]
            self._reply(200, {"jsonrpc": "2.0", "id": rid, "result": {"content": content}})
        else:
            no = {"code": -32601, "message": "?"}
            self._reply(200, {"jsonrpc": "2.0", "id": rid, "error": no})


@contextlib.contextmanager
def _stateful() -> Iterator[Any]:
    server: Any = QuietHTTPServer(("127.0.0.1", 0), _Stateful)
    server.daemon_threads = True
    server.sessions, server.numbers, server.calls = set(), itertools.count(), []
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02})
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


async def test_a_stateful_http_server_restarted_while_idle_is_reached_again() -> None:
    with _stateful() as server:
        url = f"http://127.0.0.1:{server.server_address[1]}/mcp"
        async with MCPToolset.http(url, call_timeout=10, connect_timeout=10) as toolset:
            assert await toolset.call("book_seat", {}, key="k1") == "booked"
            server.sessions.clear()  # the server restarted between calls
            outcomes: list[str] = []
            for key in ("k2", "k3", "k4"):
                try:
                    outcomes.append(str(await toolset.call("book_seat", {}, key=key)))
                except MCPUnavailableError as exc:  # not sent, or (wrongly) in doubt
                    outcomes.append(type(exc).__name__)
            # Told "not sent" at most once while it reconnects; then the calls go out again.
            assert outcomes[-1] == "booked", outcomes
            assert "MCPReplyLostError" not in outcomes, outcomes


async def test_after_other_tools_every_later_call_is_refused_until_entered_again() -> None:
    with _switched() as server:
        async with MCPToolset.http(server.url, call_timeout=10, connect_timeout=10) as toolset:
            await _lose(toolset, server)
            server.set("", tools=[BOOK_SEAT])  # LOOK gone: other tools
            with pytest.raises(MCPUnavailableError) as met:
                await toolset.call("book_seat", {}, key="a")
            assert not met.value.retryable
            inits = server.inits
            server.set("", tools=[BOOK_SEAT, LOOK])  # rolled back
            with pytest.raises(MCPUnavailableError):
                await toolset.call("book_seat", {}, key="b")
            assert server.inits == inits
    assert "b" not in server.sent_keys()


# --- MCP: a large reply ------------------------------------------------------------------

BIG_SERVER = textwrap.dedent(
    """
    from mcp.server.mcpserver import MCPServer

    server = MCPServer("big")

    @server.tool()
    def numbers(n: int) -> list[int]:
        \"\"\"n small numbers.\"\"\"
        return list(range(n))

    server.run()
    """
)


async def test_a_reply_past_the_default_limit_is_in_doubt_and_the_connection_stays(
    tmp_path: Path,
) -> None:
    script = tmp_path / "big_server.py"
    script.write_text(BIG_SERVER)
    toolset = MCPToolset.stdio(sys.executable, [str(script)], call_timeout=60)
    async with toolset:
        with pytest.raises(MCPReplyLostError, match="max_reply_items") as met:
            await toolset.call("numbers", {"n": 70_000}, key="k-big")
        assert "250,000" in str(met.value)
        # Each number is a content block (3 values) and an item of the structured copy:
        # 4 values a number, so 50,000 numbers are about 200,000 values, 70,000 280,000.
        small = await toolset.call("numbers", {"n": 50_000}, key="k-small")
        assert "49999" in json.dumps(small)
        assert "1" in json.dumps(await toolset.call("numbers", {"n": 2}, key="k-after"))


@pytest.mark.parametrize("bad", [0, True, 1.5, -3])
def test_max_reply_items_refuses_what_is_not_a_positive_whole_number(bad: Any) -> None:
    with pytest.raises(ConfigurationError, match="max_reply_items"):
        MCPToolset.http("http://127.0.0.1:1/mcp", max_reply_items=bad)


# --- a run waiting on another run's claim: the operator's view ----------------------------

SHOP_MODULE = textwrap.dedent(
    """
    from tesserix_adk import Agent, ScriptedProvider, ToolContext, tool

    GATE = None  # (inside, release) events, set by the test process
    charged = []


    @tool(key=lambda **kw: f"order-{kw['arguments']['order']}")
    async def charge(order: str, ctx: ToolContext) -> dict:
        \"\"\"Charge an order.\"\"\"
        if GATE is not None and ctx.run_id == "r1":
            inside, release = GATE
            inside.set()
            await release.wait()
        charged.append(ctx.run_id)
        return {"charged": order, "by": ctx.run_id}


    agent = Agent("shop", "Charge.", [charge])
    PROVIDER = ScriptedProvider([[("charge", {"order": "5"})], "done"])
    """
)
TURNS: list[Any] = [[("charge", {"order": "5"})], "done"]


class Waiting:
    """r1 inside its charge (lease live), r2 told to come back (``ResumeConflictError``)."""

    def __init__(self, tmp: Path, shop: ModuleType, r1: asyncio.Task[Any]) -> None:
        self.tmp = tmp
        self.url = f"sqlite:///{tmp / 'adk.sqlite3'}"
        self.shop = shop
        self.r1 = r1

    async def cli(self, *argv: str) -> tuple[int, str, str]:
        proc = await asyncio.create_subprocess_exec(
            TESSERIX,
            "--store",
            self.url,
            *argv,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env={**os.environ, "PYTHONPATH": str(self.tmp)},
        )
        out, err = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode is not None
        return proc.returncode, out.decode(), err.decode()

    async def finish_r1(self) -> None:
        _, release = self.shop.GATE
        release.set()
        assert (await asyncio.wait_for(self.r1, 30)).status is RunStatus.completed


@contextlib.asynccontextmanager
async def _waiting(tmp_path: Path) -> AsyncIterator[Waiting]:
    (tmp_path / "shopmod.py").write_text(SHOP_MODULE)
    spec = importlib.util.spec_from_file_location(
        f"shopmod_{id(tmp_path)}", tmp_path / "shopmod.py"
    )
    assert spec is not None and spec.loader is not None
    shop = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(shop)
    inside, release = asyncio.Event(), asyncio.Event()
    shop.GATE = (inside, release)
    url = f"sqlite:///{tmp_path / 'adk.sqlite3'}"
    async with open_stores(url) as stores:
        await stores.create_schema()

        async def carry(run_id: str) -> Any:
            runner = AgentRunner.from_stores(ScriptedProvider(list(TURNS)), stores)
            return await runner.run(shop.agent, "go", tenant=T, run_id=run_id)

        r1 = asyncio.create_task(carry("r1"))
        try:
            await asyncio.wait_for(inside.wait(), 20)
            with pytest.raises(ResumeConflictError, match="r1"):
                await carry("r2")
            yield Waiting(tmp_path, shop, r1)
        finally:
            release.set()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(r1, 30)


async def test_run_resume_of_a_run_waiting_on_a_live_run_names_it_in_one_line_exit_3(
    tmp_path: Path,
) -> None:
    async with _waiting(tmp_path) as w:
        code, _, err = await w.cli(
            "run", "--resume", "r2", "--tenant", T, "--agent", "shopmod:agent"
        )
        assert code == 3, err
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
        assert "'r1'" in err and "once that run has its outcome" in err
        code, out, _ = await w.cli("runs", "--tenant", T, "--stuck")
        assert code == 0 and "r2" not in out and "r1" not in out
        await w.finish_r1()
        code, out, err = await w.cli(
            "run", "--resume", "r2", "--tenant", T, "--agent", "shopmod:agent"
        )
        assert code == 0, err
    assert w.shop.charged == ["r1"]  # r2 replayed r1's outcome, in this process and the CLI's


async def test_inspect_of_a_run_waiting_on_a_live_run_does_not_call_it_in_doubt(
    tmp_path: Path,
) -> None:
    async with _waiting(tmp_path) as w:
        code, out, err = await w.cli("inspect", "r2", "--tenant", T)
        assert code == 0, err
        (line,) = [x for x in out.splitlines() if x.startswith("charge (call_0_0)")]
        assert "r1" in line
        assert "nobody can say whether it ran" not in line, line
        # Still "indeterminate" (the plan's disposition: this run cannot go on by itself),
        # but said to be r1's call, replayed here, resolved on r1 if r1 died with it.
        assert "that run's call" in line and "resolved on run r1" in line, line


async def test_run_resume_of_a_waiting_run_prints_no_in_doubt_plan_nor_holding(
    tmp_path: Path,
) -> None:
    async with _waiting(tmp_path) as w:
        code, out, _ = await w.cli(
            "run", "--resume", "r2", "--tenant", T, "--agent", "shopmod:agent"
        )
        assert code == 3
        assert "nobody can say whether it ran" not in out, out
        # "holding the run as ..." stays: the resume did hold r2 while it planned.


async def test_resolve_on_the_waiting_run_names_the_run_whose_claim_it_is(
    tmp_path: Path,
) -> None:
    async with _waiting(tmp_path) as w:
        for call in ("call_0_0", "acme/order-5"):
            code, _, err = await w.cli(
                "resolve", "r2", "--tenant", T, "--call", call, "--never-ran", "--by", "alice"
            )
            assert code != 0
            assert "r1" in err, err
        await w.finish_r1()
    assert w.shop.charged == ["r1"]


async def test_the_console_offers_no_resolve_form_on_a_run_waiting_on_a_live_run(
    tmp_path: Path,
) -> None:
    from starlette.testclient import TestClient

    from tesserix_adk.console import create_app
    from tesserix_adk.console.pages import tenant_path

    async with _waiting(tmp_path) as w:

        def look() -> tuple[int, str, str]:
            app = create_app(w.url)
            with TestClient(app, base_url="http://127.0.0.1:8765") as client:
                page = client.get(tenant_path(T, "runs", "r2"))
                stuck = client.get(tenant_path(T, "runs") + "?stuck=1")
            return page.status_code, page.text, stuck.text

        status, page, stuck = await asyncio.to_thread(look)
        assert status == 200
        assert "r1" in page
        assert 'class="resolve"' not in page
        assert "/runs/r2" not in stuck


# --- a custom key function that cannot key what the model sent ---------------------------


class Recording(ScriptedProvider):
    """A scripted provider that keeps every request it was asked."""

    def __init__(self, turns: Any) -> None:
        super().__init__(turns)
        self.requests: list[ModelRequest] = []

    async def complete(self, request: ModelRequest) -> ModelResponse:
        self.requests.append(request)
        return await super().complete(request)


def _told(provider: Recording) -> list[str]:
    return [
        str(m.content) for r in provider.requests[-1:] for m in r.messages if m.role is Role.tool
    ]


def _shop(sent: list[str], key: Any) -> Agent:
    @tool(key=key)
    async def charge(order: str, note: str = "") -> str:
        """Charge an order."""
        sent.append(order)
        return "charged"

    return Agent("shop", "Charge.", [charge])


async def test_a_key_function_reading_an_argument_the_model_left_out_is_not_sent(
    tmp_path: Path,
) -> None:
    sent: list[str] = []
    provider = Recording([[("charge", {"note": "x"})], "done"])
    async with open_stores(f"sqlite:///{tmp_path / 'a.sqlite3'}") as stores:
        await stores.create_schema()
        runner = AgentRunner.from_stores(provider, stores)
        agent = _shop(sent, lambda **kw: f"order-{kw['arguments']['order']}")
        run = await runner.run(agent, "go", tenant=T, run_id="r")
    assert run.status is RunStatus.completed
    assert sent == []
    (told,) = _told(provider)
    assert "invalid arguments for charge" in told and "order" in told, told
    assert "not sent" in told.lower() or "was not sent" in told.lower(), told


async def test_a_key_function_failing_on_arguments_the_tool_accepts_is_configuration_error(
    tmp_path: Path,
) -> None:
    sent: list[str] = []
    async with open_stores(f"sqlite:///{tmp_path / 'a.sqlite3'}") as stores:
        await stores.create_schema()
        runner = AgentRunner.from_stores(ScriptedProvider([[("charge", {"order": "5"})]]), stores)
        agent = _shop(sent, lambda **kw: f"order-{kw['arguments']['note']}")
        with pytest.raises(ConfigurationError, match="'charge'"):
            await runner.run(agent, "go", tenant=T, run_id="r")
    assert sent == []


async def test_a_key_function_returning_none_for_an_argument_the_model_left_out_is_not_sent(
    tmp_path: Path,
) -> None:
    sent: list[str] = []
    provider = Recording([[("charge", {"note": "x"})], "done"])
    async with open_stores(f"sqlite:///{tmp_path / 'a.sqlite3'}") as stores:
        await stores.create_schema()
        runner = AgentRunner.from_stores(provider, stores)
        agent = _shop(sent, lambda **kw: kw["arguments"].get("order"))
        run = await runner.run(agent, "go", tenant=T, run_id="r")
    assert run.status is RunStatus.completed
    assert sent == []
    (told,) = _told(provider)
    assert "invalid arguments for charge" in told, told
