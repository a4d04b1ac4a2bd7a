"""The test MCP server, started for real: over stdio by a toolset, or over streamable HTTP
as a subprocess on a free loopback port; and the effects it recorded."""

from __future__ import annotations

import json
import os
import socket
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from tesserix_adk.mcp import MCPToolOverride, MCPToolset

SERVER = str(Path(__file__).with_name("server.py"))


class QuietHTTPServer(ThreadingHTTPServer):
    """A test's hand-made HTTP server. A client that hung up on a handler still answering
    (a cut connection, a call given up) is the test's own doing: not printed, since a
    handler thread can outlive its test and its traceback would land in whatever later
    test of the process is capturing stderr."""

    def handle_error(self, request: Any, client_address: Any) -> None:
        if isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
            return
        super().handle_error(request, client_address)


class Effects:
    """The SQLite file the server records each ``book_seat`` call in, with its key."""

    def __init__(self, tmp: Path) -> None:
        self.path = str(tmp / "effects.sqlite3")

    def env(self, **extra: str) -> dict[str, str]:
        return {"MCP_EFFECTS_DB": self.path, **extra}

    def keys(self, tool: str = "book_seat") -> list[str | None]:
        """The idempotency key of each call of ``tool`` the server received, in order."""
        if not Path(self.path).exists():
            return []
        with sqlite3.connect(self.path) as conn:
            rows = conn.execute("select key from effects where tool = ?", (tool,)).fetchall()
        return [r[0] for r in rows]


def stdio(
    effects: Effects,
    *,
    overrides: Mapping[str, MCPToolOverride] | None = None,
    variant: str = "",
    **env: str,
) -> MCPToolset:
    extra = {**env, "MCP_TOOLS_VARIANT": variant}
    return MCPToolset.stdio(sys.executable, [SERVER], env=effects.env(**extra), overrides=overrides)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


@contextmanager
def http_server(effects: Effects, **env: str) -> Iterator[str]:
    """The server over streamable HTTP; yields its endpoint once it accepts connections."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, SERVER, "http", str(port)],
        env={**os.environ, **effects.env(**env)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        _wait_accepting(port, proc)
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        proc.kill()
        proc.communicate(timeout=10)


def _wait_accepting(port: int, proc: subprocess.Popen[Any]) -> None:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the MCP server exited: {proc.communicate()[1]!r}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise AssertionError("the MCP server never accepted connections")


class JsonHttpHandler(BaseHTTPRequestHandler):
    """The plumbing of a hand-written streamable-HTTP MCP server (JSON replies, no SSE):
    quiet, no server-to-client stream (GET is 405), a session's DELETE accepted. A test's
    subclass answers ``do_POST``, reading the request with ``_request``."""

    protocol_version = "HTTP/1.0"

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _request(self) -> Any:
        """The POSTed JSON-RPC message."""
        return json.loads(self.rfile.read(int(self.headers.get("content-length") or 0)))

    def _reply(self, status: int, body: Any = None, headers: dict[str, str] | None = None) -> None:
        data = b"" if body is None else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self._reply(405)

    def do_DELETE(self) -> None:
        self._reply(200)
