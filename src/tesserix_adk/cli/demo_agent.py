"""The demo's booking agent and its "airline": a table in a SQLite file of its own.

``book_seat`` passes the run's idempotency key on to the airline, as a real integration
would, so an operator can look a booking up by it. Used by ``tesserix demo``, the crash
tests and the README; load it with ``--agent tesserix_adk.cli.demo_agent:agent``.
"""

from __future__ import annotations

import os
import sqlite3
import sys
import time
from typing import Any

from tesserix_adk.agent import Agent
from tesserix_adk.messages import Usage
from tesserix_adk.providers.scripted import ScriptedProvider, ScriptedTurn
from tesserix_adk.tools import ToolContext, tool

__all__ = [
    "AIRLINE_ENV",
    "DELAY_ENV",
    "PAUSE_ENV",
    "PROVIDER",
    "TURNS",
    "agent",
    "airline_bookings",
    "create_airline",
]

AIRLINE_ENV = "ADK_DEMO_AIRLINE"
PAUSE_ENV = "ADK_DEMO_PAUSE"
DELAY_ENV = "ADK_DEMO_DELAY"  # seconds each tool takes (the torture tests spread kills)

TURNS: list[Any] = [
    ScriptedTurn(
        calls=[("search_flights", {"origin": "FRA", "destination": "JFK"})],
        usage=Usage(input_tokens=410, output_tokens=35),
        cost_micros=1400,
    ),
    ScriptedTurn(
        calls=[("book_seat", {"flight": "LH400", "passenger": "Ada Lovelace"})],
        usage=Usage(input_tokens=520, output_tokens=40),
        cost_micros=1700,
    ),
    ScriptedTurn(
        text="Booked LH400 from Frankfurt to New York for Ada Lovelace.",
        usage=Usage(input_tokens=600, output_tokens=25),
        cost_micros=1800,
    ),
]


def PROVIDER() -> ScriptedProvider:  # the name the CLI looks for in an agent module
    """A fresh scripted model for the demo (no network, deterministic)."""
    return ScriptedProvider(TURNS)


def create_airline(path: str) -> None:
    """Create the airline's bookings table."""
    with sqlite3.connect(path) as conn:
        conn.execute(
            "CREATE TABLE IF NOT EXISTS bookings (id INTEGER PRIMARY KEY, run_id TEXT, "
            "flight TEXT, passenger TEXT, idempotency_key TEXT)"
        )
    conn.close()


def airline_bookings(path: str, run_id: str) -> list[tuple[int, str, str, str]]:
    """The airline's bookings for a run: (id, flight, passenger, idempotency key)."""
    conn = sqlite3.connect(path)
    try:
        rows = conn.execute(
            "SELECT id, flight, passenger, idempotency_key FROM bookings WHERE run_id = ? "
            "ORDER BY id",
            (run_id,),
        ).fetchall()
    finally:
        conn.close()
    return [(int(r[0]), str(r[1]), str(r[2]), str(r[3])) for r in rows]


@tool(side_effects=False)
def search_flights(origin: str, destination: str) -> list[dict[str, str]]:
    """Find flights between two airports (read-only)."""
    time.sleep(float(os.environ.get(DELAY_ENV, "0")))
    return [
        {"flight": "LH400", "from": origin, "to": destination, "departs": "10:15"},
        {"flight": "UA961", "from": origin, "to": destination, "departs": "13:40"},
    ]


@tool
def book_seat(flight: str, passenger: str, *, ctx: ToolContext) -> dict[str, str]:
    """Book one seat on a flight for a passenger (side-effecting, keyed)."""
    delay = float(os.environ.get(DELAY_ENV, "0"))
    time.sleep(delay / 2)
    conn = sqlite3.connect(os.environ[AIRLINE_ENV])
    try:
        cur = conn.execute(
            "INSERT INTO bookings (run_id, flight, passenger, idempotency_key) VALUES (?, ?, ?, ?)",
            (ctx.run_id, flight, passenger, ctx.idempotency_key),
        )
        conn.commit()
        booking = f"BK-{cur.lastrowid}"
    finally:
        conn.close()
    if os.environ.get(PAUSE_ENV) == "in_flight":
        # The demo kills the process here: booked at the airline, outcome not yet recorded.
        sys.stdout.write("PAUSED in_flight\n")
        sys.stdout.flush()
        time.sleep(3600)
    time.sleep(delay / 2)
    return {"booking_id": booking, "flight": flight, "passenger": passenger}


agent = Agent(
    "booking",
    "Find the flight the user asks for and book one seat on it.",
    [search_flights, book_seat],
    max_iterations=6,
)
