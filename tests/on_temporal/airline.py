"""An airline that outlives processes: its bookings are lines in a file of the test's world
directory (``TESSERIX_WORLD``), so a test counts them after any worker died.

``book_seat`` blocks while a hold file exists (``hold_before``: before the booking is made,
``hold_after``: right after it), writing ``entered`` first: a test kills a worker process
there, deterministically, without sleeping on a guess. ``reconciled_agent`` has a
reconciler that asks the airline, by the call's idempotency key, whether it booked.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from tesserix_adk import Agent, Reconciled, ScriptedProvider, ToolCall, ToolContext, tool

WORLD_ENV = "TESSERIX_WORLD"
TENANT = "acme"

BOOK_TURNS: list[Any] = [
    [("search_flights", {"origin": "FRA", "dest": "JFK"})],
    [("book_seat", {"flight": "LH123"})],
    "Booked LH123.",
]


def world() -> Path:
    """The test's world directory (from the environment, so worker processes share it)."""
    return Path(os.environ[WORLD_ENV])


def bookings() -> list[tuple[str, str]]:
    """Every booking the airline took: (flight, idempotency key), in order."""
    path = world() / "bookings.txt"
    if not path.exists():
        return []
    return [
        (flight, key)
        for flight, key in (line.split("|", 1) for line in path.read_text().splitlines() if line)
    ]


def _hold(name: str) -> None:
    hold = world() / name
    if not hold.exists():
        return
    (world() / "entered").write_text(name)
    while hold.exists():
        time.sleep(0.02)


@tool(side_effects=False)
def search_flights(origin: str, dest: str) -> list[str]:
    """Find flights between two airports."""
    return ["LH123", "UA456"]


def _book(flight: str, ctx: ToolContext) -> dict[str, str]:
    _hold("hold_before")
    with (world() / "bookings.txt").open("a") as f:
        f.write(f"{flight}|{ctx.idempotency_key}\n")
    _hold("hold_after")
    return {"booking": f"B-{flight}", "flight": flight}


@tool
def book_seat(flight: str, ctx: ToolContext) -> dict[str, str]:
    """Book one seat on a flight."""
    return _book(flight, ctx)


def _ask_airline(call: ToolCall, ctx: ToolContext) -> Reconciled:
    for flight, key in bookings():
        if key == ctx.idempotency_key:
            return Reconciled.completed({"booking": f"B-{flight}", "flight": flight})
    return Reconciled.never_ran()


@tool(name="book_seat", reconcile=_ask_airline)
def book_seat_reconciled(flight: str, ctx: ToolContext) -> dict[str, str]:
    """Book one seat on a flight."""
    return _book(flight, ctx)


agent = Agent("airline", "Book the flight the user asks for.", [search_flights, book_seat])
reconciled_agent = Agent(
    "airline", "Book the flight the user asks for.", [search_flights, book_seat_reconciled]
)


def provider() -> ScriptedProvider:
    """The booking script (``--provider on_temporal.airline:provider``)."""
    return ScriptedProvider(BOOK_TURNS)


long_agent = Agent(
    "airline", "Book the flight the user asks for.", [search_flights, book_seat], max_iterations=100
)


def long_turns(single: int, triple: int) -> list[Any]:
    """``single`` turns booking one flight each, then ``triple`` turns booking three, then
    the answer: every flight a name of its own, so each booking is counted once."""
    turns: list[Any] = [[("book_seat", {"flight": f"S{i}"})] for i in range(single)]
    turns += [[("book_seat", {"flight": f"T{i}-{j}"}) for j in range(3)] for i in range(triple)]
    return [*turns, "All booked."]


@tool(name="book_seat", requires_approval=True)
def book_seat_approved(flight: str, ctx: ToolContext) -> dict[str, str]:
    """Book one seat on a flight, once a person approved it."""
    return _book(flight, ctx)


approval_agent = Agent(
    "airline", "Book the flight the user asks for.", [search_flights, book_seat_approved]
)
