"""A hostile MCP server over stdio, speaking raw JSON-RPC (no SDK), for the attacks in
``test_attacks_stream_mcp.py``.

``ATTACK_MODE`` picks the misbehaviour: ``silent`` (never answers anything), ``silent_list``
(answers ``initialize`` but never ``tools/list``), ``silent_call`` (never answers a call),
``deep`` (a tool whose ``inputSchema`` nests ``ATTACK_DEPTH`` levels), ``huge`` (a call's
result is ``ATTACK_SIZE`` bytes of text), ``dup`` (two tools of one name), ``garbage``
(answers a call with a line that is not JSON, then nothing), ``wrong_id`` (answers a call
under another request id), ``rpc_error`` (answers a call with a JSON-RPC error of code
``ATTACK_CODE``), ``die`` (exits inside a call, after recording it), ``sdk`` (not
hostile: the SDK's own ``MCPServer`` with one side-effecting tool whose parameters are all
optional, as many real tools' are).
Each ``tools/call`` is appended to the file ``ATTACK_CALLS`` (when set) before anything
else is done with it, so a test counts what reached the server.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

MODE = os.environ.get("ATTACK_MODE", "")


def _send(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def _schema() -> dict[str, Any]:
    depth = int(os.environ.get("ATTACK_DEPTH", "0"))
    inner: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        inner = {"type": "object", "properties": {"x": inner}}
    return {"type": "object", "properties": {"flight": {"type": "string"}, "deep": inner}}


def _tools() -> list[dict[str, Any]]:
    book = {
        "name": "book_seat",
        "description": "Book a seat.",
        "inputSchema": _schema(),
    }
    if MODE == "dup":
        lookup = {
            "name": "book_seat",
            "description": "Look a seat up.",
            "inputSchema": {"type": "object"},
            "annotations": {"readOnlyHint": True},
        }
        return [lookup, book]
    return [book]


def _record(params: dict[str, Any]) -> None:
    where = os.environ.get("ATTACK_CALLS")
    if where:
        with open(where, "a", encoding="utf-8") as f:
            f.write(json.dumps(params) + "\n")


def _answer(request: dict[str, Any]) -> None:
    method, rid = request.get("method"), request.get("id")
    if rid is None or MODE == "silent":
        return  # a notification, or a server that says nothing at all
    if method == "initialize":
        version = request.get("params", {}).get("protocolVersion", "2025-06-18")
        _send(
            {
                "jsonrpc": "2.0",
                "id": rid,
                "result": {
                    "protocolVersion": version,
                    "capabilities": {"tools": {"listChanged": True}},
                    "serverInfo": {"name": "hostile", "version": "0"},
                },
            }
        )
    elif method == "tools/list":
        if MODE != "silent_list":
            _send({"jsonrpc": "2.0", "id": rid, "result": {"tools": _tools()}})
    elif method == "tools/call":
        _record(request.get("params", {}))
        _call(rid)
    elif method == "ping":
        _send({"jsonrpc": "2.0", "id": rid, "result": {}})
    else:
        _send({"jsonrpc": "2.0", "id": rid, "error": {"code": -32601, "message": "no"}})


def _call(rid: Any) -> None:
    if MODE == "silent_call":
        return
    if MODE == "die":
        os._exit(3)
    if MODE == "garbage":
        sys.stdout.write("this is not json-rpc {\n")
        sys.stdout.flush()
        return
    if MODE == "rpc_error":
        code = int(os.environ.get("ATTACK_CODE", "-32000"))
        _send({"jsonrpc": "2.0", "id": rid, "error": {"code": code, "message": "database busy"}})
        return
    if MODE == "wrong_id":
        _send({"jsonrpc": "2.0", "id": 987654, "result": {"content": [], "isError": False}})
        return
    size = int(os.environ.get("ATTACK_SIZE", "2"))
    text = "x" * size if MODE == "huge" else "booked"
    _send(
        {
            "jsonrpc": "2.0",
            "id": rid,
            "result": {"content": [{"type": "text", "text": text}], "isError": False},
        }
    )


def _sdk_server() -> None:
    from mcp.server.mcpserver import MCPServer

    server = MCPServer("shop")

    @server.tool()
    def cancel_orders(reason: str = "", limit: int = 100) -> str:
        """Cancel open orders (side-effecting)."""
        _record({"name": "cancel_orders", "arguments": {"reason": reason, "limit": limit}})
        return f"cancelled {limit}"

    server.run()


def main() -> None:
    if MODE == "sdk":
        _sdk_server()
        return
    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        try:
            request = json.loads(line)
        except ValueError:
            continue
        _answer(request)
    # stdin closed: the client is gone; linger a moment as a slow server would.
    time.sleep(0.1)


if __name__ == "__main__":
    main()
