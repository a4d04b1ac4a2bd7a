"""Fresh attacks on MCP tools (``tesserix_adk.mcp``), where the earlier MCP attack files did
not go: secrets in what a server answers (result text, error result, JSON-RPC error,
structured content, resource blocks, an internal error that leaves a call in doubt, its
tool listing: description, schema, name), hostile input schemas (recursive ``$ref``, huge,
odd ``required``, properties named ``ctx``/``self``/``_meta``), unicode and NUL in tool
names and arguments, one toolset shared by two concurrent runs, a stdio server SIGKILLed in
a run's call then the run resumed, a server whose tool changed between runs.

Against a raw JSON-RPC stdio server written here (its tools and each tool's answer read
from a JSON file the test writes), and the runner on SQLite.

Found, and fixed (their tests pass now: a tool whose name reads as holding a secret, or is
empty, is refused when it is made, ``tools.Tool``; a GitHub token glued to a name before it
is masked, ``redaction/patterns.py``):

1. HIGH (secret stored raw). A tool name the server lists holding a secret
   (``lookup_ghp_…``) is stored raw: in the transcript's ``tool_calls`` name, the step
   snapshots' outstanding calls and observations, and ``adk_idempotency.tool``. Call ids
   holding a secret are replaced (``run/screening.py``), names are not, and the toolset
   takes a server's names unchecked (``mcp/connection.py`` ``_server_tool``).
   ``test_a_secret_in_a_listed_tools_name_is_not_stored_raw``.
2. LOW. A server tool named ``""`` becomes the kit tool ``_sent_over_mcp`` (the internal
   placeholder function's name: ``MCPTool`` passes ``name=""``, ``Tool`` falls back to
   ``func.__name__``), neither refused nor kept as listed.
   ``test_a_tool_with_an_empty_name_is_refused_typed_or_kept_as_listed``.

Held: a secret in a result's text, an ``isError`` result, a JSON-RPC error, structured
content only, resource/resource_link blocks, a ``-32603`` error (call in doubt, sent once),
a tool's description or schema default, or a read-only call's arguments is masked in every
SQLite row and file (and the read-only arguments reach the server raw); a side-effecting
call with a secret argument is never sent masked; a recursive ``$ref`` schema is listed
and called once with arguments as given; properties named ``ctx``, ``self``,
``arguments``, ``name``, ``_meta``, ``idempotency_key``, ``guard`` reach the server as given
with the key in ``_meta``; a required ``ctx`` missing is told to the model, not sent; a
listing past ``max_reply_items`` fails entering typed, nothing called; odd schemas
(``required`` a string or odd items, ``type: array``, ``properties: null``) do not crash a
call; NUL and unicode (emoji, RTL override) in arguments are sent once and stored; tool
names with umlauts, spaces, newlines or 300 characters are called by their own name, one
with a NUL is refused typed (``ConfigurationError``); two tools of one name are refused;
two concurrent runs on one toolset each send once under their own key and keep their own
answer; a stdio server SIGKILLed in a run's call leaves it in doubt (later calls not sent)
and a resume against a restarted server is refused (``IndeterminateToolCallError``), the
server heard once; a tool whose schema and ``idempotentHint`` changed between runs makes
the resume a ``RevisionMismatchError``, nothing sent again.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sqlite3
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from tesserix_adk import (
    AdkError,
    Agent,
    AgentRunner,
    IndeterminateToolCallError,
    RevisionMismatchError,
    RunStatus,
    ScriptedProvider,
    open_stores,
)
from tesserix_adk.mcp import (
    MCPReplyLostError,
    MCPToolError,
    MCPToolset,
    MCPUnavailableError,
)
from tesserix_adk.testing.secrets import leaked_secrets, planted_secrets

pytestmark = pytest.mark.skipif(os.name != "posix", reason="needs POSIX signals and pipes")

T = "acme"
SECRETS = planted_secrets()
OPENAI = SECRETS["openai_key"]
GITHUB = SECRETS["github_token"]

SERVER = r"""
import json, os, sys, time

CONF = json.load(open(os.environ["CONF"]))
RECEIVED = os.environ["RECEIVED"]


def send(message):
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


for raw in sys.stdin:
    request = json.loads(raw)
    with open(RECEIVED, "a") as f:
        f.write(json.dumps(request) + "\n")
    method, rid = request.get("method"), request.get("id")
    if rid is None:
        continue
    if method == "initialize":
        send({"jsonrpc": "2.0", "id": rid, "result": {
            "protocolVersion": request["params"]["protocolVersion"],
            "capabilities": {"tools": {}}, "serverInfo": {"name": "fresh", "version": "0"}}})
    elif method == "tools/list":
        send({"jsonrpc": "2.0", "id": rid, "result": {"tools": CONF["tools"]}})
    elif method == "tools/call":
        params = request.get("params", {})
        name, args = params.get("name"), params.get("arguments") or {}
        how = CONF["answers"].get(name, {"kind": "echo"})
        kind = how["kind"]
        if kind == "echo":
            text = "done " + json.dumps(args, sort_keys=True)
            send({"jsonrpc": "2.0", "id": rid,
                  "result": {"content": [{"type": "text", "text": text}]}})
        elif kind == "result":
            send({"jsonrpc": "2.0", "id": rid, "result": how["result"]})
        elif kind == "error":
            send({"jsonrpc": "2.0", "id": rid, "error": how["error"]})
        elif kind == "hold":
            with open(os.environ["RECEIVED"] + ".inside", "w") as f:
                f.write(str(os.getpid()))
            time.sleep(60)
        elif kind == "slow_echo":
            time.sleep(float(how.get("seconds", 0.3)))
            send({"jsonrpc": "2.0", "id": rid, "result": {"content": [
                {"type": "text", "text": "done " + json.dumps(args, sort_keys=True)}]}})
    else:
        send({"jsonrpc": "2.0", "id": rid, "error": {"code": -32601, "message": "no"}})
"""


def _side(name: str, schema: dict[str, Any] | None = None, **annotations: bool) -> dict[str, Any]:
    tool: dict[str, Any] = {
        "name": name,
        "description": f"{name} tool",
        "inputSchema": schema or {"type": "object", "properties": {"flight": {"type": "string"}}},
    }
    if annotations:
        tool["annotations"] = annotations
    return tool


class Server:
    """The raw server's script, its configuration and what it received."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.script = tmp / "fresh_server.py"
        self.script.write_text(SERVER)
        self.conf = tmp / "conf.json"
        self.received = tmp / "received.jsonl"
        self.configure([_side("book")])

    def configure(self, tools: list[dict[str, Any]], **answers: dict[str, Any]) -> None:
        self.conf.write_text(json.dumps({"tools": tools, "answers": answers}))

    def toolset(self, **kw: Any) -> MCPToolset:
        kw.setdefault("call_timeout", 20.0)
        return MCPToolset.stdio(
            sys.executable,
            [str(self.script)],
            env={"CONF": str(self.conf), "RECEIVED": str(self.received)},
            **kw,
        )

    def calls(self, name: str | None = None) -> list[dict[str, Any]]:
        if not self.received.exists():
            return []
        got = [json.loads(line) for line in self.received.read_text().splitlines()]
        params = [m["params"] for m in got if m.get("method") == "tools/call"]
        return [p for p in params if name is None or p["name"] == name]


def _exists(path: Path) -> bool:
    return path.exists()


def _read(path: Path) -> str:
    return path.read_text()


@pytest.fixture
def server(tmp_path: Path) -> Server:
    return Server(tmp_path)


@contextlib.asynccontextmanager
async def _stores(tmp: Path) -> AsyncIterator[Any]:
    async with open_stores(f"sqlite:///{tmp / 'adk.sqlite3'}") as opened:
        await opened.create_schema()
        yield opened


def _everything(tmp: Path) -> str:
    """The SQLite files as bytes and every row of every table, as one text."""
    path = tmp / "adk.sqlite3"
    out = bytearray()
    for suffix in ("", "-wal", "-shm", "-journal"):
        f = Path(str(path) + suffix)
        if f.exists():
            out += f.read_bytes()
    with contextlib.closing(sqlite3.connect(path)) as db:
        tables = [r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")]
        for table in tables:
            for row in db.execute(f'SELECT * FROM "{table}"'):
                for cell in row:
                    out += cell if isinstance(cell, bytes) else str(cell).encode()
                    out += b"\n"
    return out.decode("utf-8", "replace")


async def _run(
    tmp: Path, toolset: MCPToolset, script: list[Any], run_id: str = "r1"
) -> tuple[Any, ScriptedProvider]:
    provider = ScriptedProvider(script)
    async with _stores(tmp) as stores:
        agent = Agent("fresh", "Do it.", toolset.tools)
        run = await AgentRunner.from_stores(provider, stores).run(
            agent, "go", tenant=T, run_id=run_id
        )
    return run, provider


# --- secrets in what the server answers -----------------------------------------------------


async def test_a_secret_in_a_tools_result_text_is_masked_in_the_stores(
    tmp_path: Path, server: Server
) -> None:
    result = {"content": [{"type": "text", "text": f"booked, key {OPENAI} and {GITHUB}"}]}
    server.configure([_side("book")], book={"kind": "result", "result": result})
    async with server.toolset() as toolset:
        run, _ = await _run(tmp_path, toolset, [[("book", {"flight": "LH1"})], "Done."])
    assert run.status is RunStatus.completed
    assert len(server.calls("book")) == 1
    assert leaked_secrets(_everything(tmp_path)) == []


async def test_a_secret_in_an_error_result_is_masked_in_the_stores(
    tmp_path: Path, server: Server
) -> None:
    result = {"content": [{"type": "text", "text": f"refused: {OPENAI}"}], "isError": True}
    server.configure([_side("book")], book={"kind": "result", "result": result})
    async with server.toolset() as toolset:
        run, _ = await _run(tmp_path, toolset, [[("book", {"flight": "LH1"})], "Sorry."])
    assert run.status is RunStatus.completed
    assert len(server.calls("book")) == 1
    assert leaked_secrets(_everything(tmp_path)) == []


async def test_a_secret_in_a_json_rpc_error_is_masked_in_the_stores(
    tmp_path: Path, server: Server
) -> None:
    error = {"code": -32000, "message": f"db down, dsn postgres://u:{GITHUB}@db/x"}
    server.configure([_side("book")], book={"kind": "error", "error": error})
    async with server.toolset() as toolset:
        with pytest.raises(MCPToolError):
            await toolset.call("book", {"flight": "LH0"})
        run, _ = await _run(tmp_path, toolset, [[("book", {"flight": "LH1"})], "Sorry."])
    assert run.status is RunStatus.completed
    assert len(server.calls("book")) == 2
    assert leaked_secrets(_everything(tmp_path)) == []


async def test_a_secret_in_structured_content_only_is_masked_in_the_stores(
    tmp_path: Path, server: Server
) -> None:
    result = {"content": [], "structuredContent": {"booking": "B1", "api_key": OPENAI}}
    server.configure([_side("book")], book={"kind": "result", "result": result})
    async with server.toolset() as toolset:
        assert (await toolset.call("book", {"flight": "LH0"}))["booking"] == "B1"
        run, _ = await _run(tmp_path, toolset, [[("book", {"flight": "LH1"})], "Done."])
    assert run.status is RunStatus.completed
    assert leaked_secrets(_everything(tmp_path)) == []


async def test_a_secret_in_an_internal_error_leaves_the_call_in_doubt_and_masked(
    tmp_path: Path, server: Server
) -> None:
    error = {"code": -32603, "message": f"crashed holding {OPENAI}"}
    server.configure([_side("book")], book={"kind": "error", "error": error})
    async with server.toolset() as toolset:
        with pytest.raises(MCPReplyLostError):
            await _run(tmp_path, toolset, [[("book", {"flight": "LH1"})], "Done."])
    assert len(server.calls("book")) == 1
    assert leaked_secrets(_everything(tmp_path)) == []


async def test_a_secret_in_a_tools_description_and_schema_is_not_stored_raw(
    tmp_path: Path, server: Server
) -> None:
    schema = {
        "type": "object",
        "properties": {"flight": {"type": "string", "default": GITHUB}},
    }
    tool = _side("book", schema)
    tool["description"] = f"Book. Uses key {OPENAI} internally."
    server.configure([tool])
    async with server.toolset() as toolset:
        run, _ = await _run(tmp_path, toolset, [[("book", {"flight": "LH1"})], "Done."])
    assert run.status is RunStatus.completed
    assert leaked_secrets(_everything(tmp_path)) == []


# --- hostile input schemas ------------------------------------------------------------------


async def test_a_recursive_ref_schema_is_listed_and_called_once(
    tmp_path: Path, server: Server
) -> None:
    schema = {
        "type": "object",
        "$defs": {
            "node": {
                "type": "object",
                "properties": {"next": {"$ref": "#/$defs/node"}, "v": {"type": "string"}},
            }
        },
        "properties": {"root": {"$ref": "#/$defs/node"}, "self": {"$ref": "#"}},
        "required": ["root"],
    }
    server.configure([_side("walk", schema)])
    args = {"root": {"v": "a", "next": {"v": "b"}}}
    async with server.toolset() as toolset:
        (tool,) = toolset.tools
        assert tool.parameters["properties"]["self"] == {"$ref": "#"}
        run, _ = await _run(tmp_path, toolset, [[("walk", args)], "Done."])
    assert run.status is RunStatus.completed
    assert [c["arguments"] for c in server.calls("walk")] == [args]


async def test_properties_named_ctx_self_and_meta_reach_the_server_as_given(
    tmp_path: Path, server: Server
) -> None:
    names = ["ctx", "self", "arguments", "name", "_meta", "idempotency_key", "guard"]
    schema = {
        "type": "object",
        "properties": {n: {"type": "string"} for n in names},
        "required": names,
    }
    server.configure([_side("odd", schema)])
    args = {n: f"v-{n}" for n in names}
    async with server.toolset() as toolset:
        run, _ = await _run(tmp_path, toolset, [[("odd", args)], "Done."])
    assert run.status is RunStatus.completed
    (call,) = server.calls("odd")
    assert call["arguments"] == args
    assert call["_meta"]["tesserix/idempotency_key"].startswith("k1:")


async def test_a_required_ctx_missing_is_told_to_the_model_and_not_sent(
    tmp_path: Path, server: Server
) -> None:
    schema = {"type": "object", "properties": {"ctx": {"type": "string"}}, "required": ["ctx"]}
    server.configure([_side("odd", schema)])
    async with server.toolset() as toolset:
        run, _ = await _run(tmp_path, toolset, [[("odd", {})], "Ok."])
    assert run.status is RunStatus.completed
    assert server.calls("odd") == []


async def test_a_huge_tool_listing_past_max_reply_items_fails_entering_typed(
    server: Server,
) -> None:
    props = {f"p{i}": {"type": "string", "description": "x"} for i in range(3000)}
    server.configure([_side("big", {"type": "object", "properties": props})])
    with pytest.raises(AdkError) as raised:
        async with server.toolset(max_reply_items=1000):
            pass
    assert "1,000" in str(raised.value) or "max_reply_items" in str(raised.value)
    assert server.calls() == []


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "object", "required": "flight"},
        {"type": "object", "required": [1, None, {"x": 1}]},
        {"type": "array"},
        {"type": "object", "properties": None},
    ],
    ids=["required-str", "required-odd", "array", "props-null"],
)
async def test_an_odd_schema_does_not_crash_a_call(server: Server, schema: dict[str, Any]) -> None:
    server.configure([_side("odd", schema)])
    try:
        toolset = server.toolset()
        async with toolset:
            (tool,) = toolset.tools
            assert tool.invalid_arguments({"flight": "x"}) is None
            assert "done" in await toolset.call("odd", {"flight": "x"})
    except AdkError:
        pass  # refused whole on entering, typed: fine too
    assert len(server.calls("odd")) <= 1


# --- unicode and NUL in names and arguments -------------------------------------------------


async def test_unicode_and_nul_in_arguments_are_sent_once_and_stored(
    tmp_path: Path, server: Server
) -> None:
    args = {"flight": "LH\u00001 \u2708\ufe0f \U0001f600 \u202e"}
    server.configure([_side("book")])
    async with server.toolset() as toolset:
        run, _ = await _run(tmp_path, toolset, [[("book", args)], "Done."])
        assert run.status is RunStatus.completed
    assert [c["arguments"] for c in server.calls("book")] == [args]


@pytest.mark.parametrize(
    "name",
    ["b\u00f6\u00f6k", "book\u0000seat", "book seat", "a" * 300, "book\nseat"],
    ids=["umlaut", "nul", "space", "long", "newline"],
)
async def test_an_odd_tool_name_is_refused_typed_or_called_by_its_own_name(
    tmp_path: Path, server: Server, name: str
) -> None:
    server.configure([_side(name)])
    try:
        toolset = server.toolset()
        async with toolset:
            (tool,) = toolset.tools
            assert tool.name == name
            run, _ = await _run(tmp_path, toolset, [[(name, {"flight": "LH1"})], "Done."])
            assert run.status is RunStatus.completed
            assert [c["name"] for c in server.calls()] == [name]
    except AdkError:
        assert server.calls() == []


async def test_a_tool_with_an_empty_name_is_refused_typed_or_kept_as_listed(
    tmp_path: Path, server: Server
) -> None:
    server.configure([_side("")])
    try:
        toolset = server.toolset()
        async with toolset:
            (tool,) = toolset.tools
            assert tool.name == ""
    except AdkError:
        return


async def test_two_tools_whose_names_clash_after_the_prefix_are_refused(server: Server) -> None:
    server.configure([_side("book"), _side("book")])
    with pytest.raises(AdkError):
        toolset = server.toolset()
        async with toolset:
            Agent("fresh", "Do it.", toolset.tools)


# --- one toolset, two runs ------------------------------------------------------------------


async def test_two_runs_sharing_a_toolset_each_send_once_and_keep_their_own_answer(
    tmp_path: Path, server: Server
) -> None:
    server.configure([_side("book")], book={"kind": "slow_echo", "seconds": 0.3})
    p1 = ScriptedProvider([[("book", {"flight": "AA1"})], "Done."])
    p2 = ScriptedProvider([[("book", {"flight": "BB2"})], "Done."])
    async with server.toolset() as toolset, _stores(tmp_path) as stores:
        agent = Agent("fresh", "Do it.", toolset.tools)
        r1, r2 = await asyncio.gather(
            AgentRunner.from_stores(p1, stores).run(agent, "a", tenant=T, run_id="s1"),
            AgentRunner.from_stores(p2, stores).run(agent, "b", tenant=T, run_id="s2"),
        )
        recs = {}
        for rid in ("s1", "s2"):
            (rec,) = [r for r in await stores.idempotency.records(T, rid) if r.tool == "book"]
            recs[rid] = rec
    assert r1.status is RunStatus.completed and r2.status is RunStatus.completed
    calls = server.calls("book")
    assert len(calls) == 2
    by_key = {c["_meta"]["tesserix/idempotency_key"]: c["arguments"]["flight"] for c in calls}
    assert by_key == {recs["s1"].key: "AA1", recs["s2"].key: "BB2"}
    assert "AA1" in json.dumps(recs["s1"].outcome, default=str)
    assert "BB2" in json.dumps(recs["s2"].outcome, default=str)


# --- a server killed in a run's call, then the run resumed ----------------------------------


async def test_a_server_sigkilled_in_a_runs_call_leaves_it_in_doubt_across_a_resume(
    tmp_path: Path, server: Server
) -> None:
    server.configure([_side("book")], book={"kind": "hold"})
    script = [[("book", {"flight": "LH1"})], "Done."]
    inside = Path(str(server.received) + ".inside")
    async with server.toolset() as toolset:

        async def kill() -> None:
            deadline = time.monotonic() + 10
            while not _exists(inside):
                assert time.monotonic() < deadline
                await asyncio.sleep(0.02)
            os.kill(int(_read(inside)), signal.SIGKILL)

        killer = asyncio.ensure_future(kill())
        with pytest.raises(MCPReplyLostError):
            await _run(tmp_path, toolset, script)
        await killer
        with pytest.raises(MCPUnavailableError) as unsent:
            await toolset.call("book", {"flight": "LH2"}, key="k-2")
        assert not unsent.value.outcome_unknown
    # A new server process, answering this time; the resume must not send the call again.
    server.configure([_side("book")])
    async with server.toolset() as toolset, _stores(tmp_path) as stores:
        agent = Agent("fresh", "Do it.", toolset.tools)
        with pytest.raises(IndeterminateToolCallError, match="book"):
            await AgentRunner.from_stores(ScriptedProvider(script[1:]), stores).resume(
                agent, "r1", tenant=T
            )
    assert len(server.calls("book")) == 1


async def test_a_server_whose_tools_changed_schema_between_runs_is_a_changed_revision(
    tmp_path: Path, server: Server
) -> None:
    server.configure([_side("book")], book={"kind": "hold"})
    inside = Path(str(server.received) + ".inside")
    script = [[("book", {"flight": "LH1"})], "Done."]
    async with server.toolset(call_timeout=0.5) as toolset:
        with pytest.raises(MCPReplyLostError):
            await _run(tmp_path, toolset, script)
        assert _exists(inside)
    schema = {
        "type": "object",
        "properties": {"flight": {"type": "string"}, "seat": {"type": "string"}},
    }
    server.configure([_side("book", schema, idempotentHint=True)])
    async with server.toolset() as toolset, _stores(tmp_path) as stores:
        agent = Agent("fresh", "Do it.", toolset.tools)
        with pytest.raises(RevisionMismatchError):
            await AgentRunner.from_stores(ScriptedProvider(script[1:]), stores).resume(
                agent, "r1", tenant=T
            )
    assert len(server.calls("book")) == 1


# --- more secrets: in a tool's name, in resource blocks, in the model's arguments ------------


async def test_a_secret_in_a_listed_tools_name_is_not_stored_raw(
    tmp_path: Path, server: Server
) -> None:
    name = f"lookup_{GITHUB}"
    server.configure([_side(name, readOnlyHint=True)])
    try:
        async with server.toolset() as toolset:
            run, _ = await _run(tmp_path, toolset, [[(name, {"flight": "LH1"})], "Done."])
            assert run.status is RunStatus.completed
    except AdkError:
        return  # refused typed: nothing stored
    assert leaked_secrets(_everything(tmp_path)) == []


async def test_a_secret_in_resource_blocks_is_masked_in_the_stores(
    tmp_path: Path, server: Server
) -> None:
    url = SECRETS["url_password"]
    content = [
        {"type": "resource_link", "uri": url, "name": "r"},
        {"type": "resource", "resource": {"uri": "file:///a", "text": f"k={OPENAI}"}},
        {"type": "image", "data": "aGVsbG8=", "mimeType": "image/png"},
    ]
    server.configure([_side("book")], book={"kind": "result", "result": {"content": content}})
    async with server.toolset() as toolset:
        run, _ = await _run(tmp_path, toolset, [[("book", {"flight": "LH1"})], "Done."])
    assert run.status is RunStatus.completed
    assert leaked_secrets(_everything(tmp_path)) == []


async def test_a_read_only_calls_secret_argument_reaches_the_server_and_is_masked_in_stores(
    tmp_path: Path, server: Server
) -> None:
    server.configure([_side("look", readOnlyHint=True)])
    args = {"flight": f"LH1 {OPENAI}"}
    async with server.toolset() as toolset:
        run, _ = await _run(tmp_path, toolset, [[("look", args)], "Done."])
    assert run.status is RunStatus.completed
    assert [c["arguments"] for c in server.calls("look")] == [args]
    assert leaked_secrets(_everything(tmp_path)) == []


async def test_a_side_effecting_call_with_a_secret_argument_is_not_sent_masked(
    tmp_path: Path, server: Server
) -> None:
    """Either sent as the model wrote it (once), or not at all: never with ``[redacted:…]``
    in place of the secret."""
    server.configure([_side("book")])
    args = {"flight": f"LH1 {OPENAI}"}
    async with server.toolset() as toolset:
        run, _ = await _run(tmp_path, toolset, [[("book", args)], "Done."])
    assert run.status is RunStatus.completed
    sent = [c["arguments"] for c in server.calls("book")]
    assert sent in ([], [args])
    assert leaked_secrets(_everything(tmp_path)) == []
