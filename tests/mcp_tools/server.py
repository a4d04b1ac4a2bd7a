"""A real MCP server (the SDK's ``MCPServer``, formerly ``FastMCP``) for the toolset tests.

``python server.py`` serves over stdio; ``python server.py http PORT`` over streamable HTTP
on 127.0.0.1. Every ``book_seat`` call is recorded, with the idempotency key its request's
``_meta`` carried, in the SQLite file named by ``MCP_EFFECTS_DB``, so a test counts effects.
``find_flights`` calls are logged there too (they change nothing; a test counts sends).
With ``MCP_HOLD_DIR`` set, the tool named by ``MCP_HOLD_TOOL`` (``book_seat`` unless set)
records its call, writes ``inside`` there and waits for ``release`` (at most a minute), so
a test kills the client while the call is in flight.
``MCP_TOOLS_VARIANT`` changes the listed tools: ``schema`` (a new parameter), ``annotations``
(``book_seat`` idempotent) or ``added`` (one more tool).
"""

from __future__ import annotations

import os
import sqlite3
import sys
import time
from pathlib import Path

from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import ToolAnnotations

KEY_META = "tesserix/idempotency_key"


def _db() -> sqlite3.Connection:
    conn = sqlite3.connect(os.environ["MCP_EFFECTS_DB"], timeout=10)
    conn.execute("create table if not exists effects (tool text, flight text, key text)")
    return conn


def _key(ctx: Context) -> str | None:
    meta = ctx.request_context.meta or {}
    key = meta.get(KEY_META)
    return str(key) if key is not None else None


def _record(tool: str, flight: str, key: str | None) -> int:
    with _db() as conn:
        conn.execute("insert into effects values (?, ?, ?)", (tool, flight, key))
        (count,) = conn.execute("select count(*) from effects where tool = ?", (tool,)).fetchone()
    return int(count)


def _hold(tool: str) -> None:
    where = os.environ.get("MCP_HOLD_DIR")
    if not where or os.environ.get("MCP_HOLD_TOOL", "book_seat") != tool:
        return
    hold = Path(where)
    # Written whole, then named: a test that sees the file reads the pid, never an empty
    # file caught between its creation and its write (a clean-clone CI run met that).
    (hold / "inside.tmp").write_text(str(os.getpid()))
    (hold / "inside.tmp").replace(hold / "inside")
    deadline = time.monotonic() + 60
    while not (hold / "release").exists() and time.monotonic() < deadline:
        time.sleep(0.02)


def build(variant: str) -> MCPServer:
    server = MCPServer("airline")
    read_only = ToolAnnotations(read_only_hint=True)

    @server.tool(annotations=read_only)
    def find_flights(origin: str, dest: str, ctx: Context) -> str:
        """Find flights between two airports."""
        _record("find_flights", f"{origin}-{dest}", _key(ctx))
        _hold("find_flights")
        return f"LH123 {origin}-{dest}"

    if variant == "schema":

        @server.tool()
        def book_seat(flight: str, ctx: Context, seat: str = "any") -> str:
            """Book a seat on a flight."""
            return f"booking B{_record('book_seat', flight, _key(ctx))}"

    else:
        hints = ToolAnnotations(idempotent_hint=True) if variant == "annotations" else None

        @server.tool(annotations=hints)
        def book_seat(flight: str, ctx: Context) -> str:  # type: ignore[misc]
            """Book a seat on a flight."""
            count = _record("book_seat", flight, _key(ctx))
            _hold("book_seat")
            return f"booking B{count}"

    @server.tool(annotations=ToolAnnotations(idempotent_hint=True))
    def set_seat_limit(limit: int) -> str:
        """Set the most seats one booking may take."""
        return f"limit {limit}"

    @server.tool()
    def cancel_booking(booking: str) -> str:
        """Cancel a booking; fails for one that does not exist."""
        raise ToolError(f"no booking {booking}")

    @server.tool(annotations=read_only)
    def booking_for(key: str) -> str:
        """The booking made under an idempotency key, or 'none'."""
        with _db() as conn:
            row = conn.execute(
                "select rowid from effects where tool = 'book_seat' and key = ?", (key,)
            ).fetchone()
        return "none" if row is None else f"booking B{row[0]}"

    if variant == "added":

        @server.tool()
        def upgrade_seat(booking: str) -> str:
            """Upgrade a booking."""
            return f"upgraded {booking}"

    return server


def main() -> None:
    server = build(os.environ.get("MCP_TOOLS_VARIANT", ""))
    if sys.argv[1:2] == ["http"]:
        server.run("streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
    else:
        server.run()


if __name__ == "__main__":
    main()
