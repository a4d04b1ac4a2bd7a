"""The agent of the worker chaos tests (``--agent chaos_agent:agent`` or
``chaos_agent:agent_without_reconciler``, with ``tests/`` on ``PYTHONPATH``).

Each run books two seats, one per turn; each booking sleeps a random short time and is a
row in an "airline" table of its own SQLite file (``CHAOS_AIRLINE``), carrying the call's
idempotency key, so the test counts effects per key and the reconciler looks them up by it.
The model is deterministic per request, so one provider serves many runs at once.
"""

from __future__ import annotations

import os
import random
import sqlite3
import time
from typing import Any

from tesserix_adk import Agent, ModelRequest, ModelResponse, Reconciled, tool
from tesserix_adk.messages import Message, Role, ToolCall

AIRLINE_ENV = "CHAOS_AIRLINE"
FLIGHTS = ("LH400", "UA901")


def create_airline(path: str) -> None:
    with sqlite3.connect(path) as conn:
        conn.execute("PRAGMA journal_mode = WAL")
        conn.execute(
            "CREATE TABLE IF NOT EXISTS effects (id INTEGER PRIMARY KEY, key TEXT, run_id TEXT, "
            "flight TEXT)"
        )
    conn.close()


def effects(path: str) -> list[tuple[str, str, str]]:
    """Every booking the airline ever took: (idempotency key, run id, flight)."""
    conn = sqlite3.connect(path, timeout=30)
    try:
        return conn.execute("SELECT key, run_id, flight FROM effects ORDER BY id").fetchall()
    finally:
        conn.close()


def _connect() -> sqlite3.Connection:
    return sqlite3.connect(os.environ[AIRLINE_ENV], timeout=30, isolation_level=None)


def _book(flight: str, ctx: Any) -> dict[str, str]:
    # CHAOS_SLOW: seconds each booking takes before its effect (a benchmark kills inside it).
    time.sleep(float(os.environ.get("CHAOS_SLOW", "0")) or random.uniform(0.0, 0.15))
    conn = _connect()
    try:
        conn.execute(
            "INSERT INTO effects (key, run_id, flight) VALUES (?, ?, ?)",
            (ctx.idempotency_key, ctx.run_id, flight),
        )
    finally:
        conn.close()
    time.sleep(random.uniform(0.0, 0.15))
    return {"booked": flight}


def _look_up(call: Any, ctx: Any) -> Reconciled:
    conn = _connect()
    try:
        row = conn.execute(
            "SELECT flight FROM effects WHERE key = ?", (ctx.idempotency_key,)
        ).fetchone()
    finally:
        conn.close()
    return Reconciled.never_ran() if row is None else Reconciled.completed({"booked": row[0]})


@tool(reconcile=_look_up)
def book_seat(flight: str, ctx: Any) -> dict[str, str]:
    """Book one seat."""
    return _book(flight, ctx)


@tool(name="book_seat")
def book_seat_unreconciled(flight: str, ctx: Any) -> dict[str, str]:
    """Book one seat."""
    return _book(flight, ctx)


class ChaosModel:
    """Asks for the next booking by how many tool results the run has, then answers."""

    async def complete(self, request: ModelRequest) -> ModelResponse:
        done = sum(1 for m in request.messages if m.role is Role.tool)
        if done < len(FLIGHTS):
            call = ToolCall(
                id=f"call_{done}", name="book_seat", arguments={"flight": FLIGHTS[done]}
            )
            return ModelResponse(message=Message(Role.assistant, "", tool_calls=[call]))
        return ModelResponse(message=Message(Role.assistant, "Booked both."))


PROVIDER = ChaosModel()
agent = Agent("chaos", "Book two seats.", [book_seat])
agent_without_reconciler = Agent("chaos", "Book two seats.", [book_seat_unreconciled])
