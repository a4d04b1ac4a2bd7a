"""A small booking world shared by the tests: an airline that counts its bookings."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tesserix_adk import Agent, ScriptedTurn, tool

BOOK_TURNS: list[Any] = [
    [("search_flights", {"origin": "FRA", "dest": "JFK"})],
    [("book_seat", {"flight": "LH123"})],
    "Booked LH123.",
]


@dataclass
class Airline:
    """The outside world: every booking it ever took, and how often it was searched."""

    bookings: list[str] = field(default_factory=list)
    searches: int = 0
    # Called inside book_seat: before (stage="before") and after (stage="after") booking.
    hook: Callable[[str], None] | None = None


def booking_agent(
    airline: Airline,
    *,
    approval: bool = False,
    search_side_effects: bool = False,
    search_hook: Callable[[], None] | None = None,
    **agent_kwargs: Any,
) -> Agent:
    """The seed's booking agent; tool bodies close over ``airline`` (the revision does not
    depend on them, so a fresh agent in a "new process" has the same revision)."""

    @tool(side_effects=search_side_effects)
    def search_flights(origin: str, dest: str) -> list[str]:
        """Find flights between two airports."""
        airline.searches += 1
        if search_hook is not None:
            search_hook()
        return ["LH123", "UA456"]

    @tool(requires_approval=approval)
    def book_seat(flight: str) -> dict[str, str]:
        """Book one seat on a flight."""
        if airline.hook is not None:
            airline.hook("before")
        airline.bookings.append(flight)
        if airline.hook is not None:
            airline.hook("after")
        return {"booking": f"B{len(airline.bookings)}", "flight": flight}

    return Agent(
        "booking", "Book the flight the user asks for.", [search_flights, book_seat], **agent_kwargs
    )


def provider() -> Any:
    """A fresh scripted model for the booking agent (``--provider booking:provider``)."""
    from tesserix_adk import ScriptedProvider

    return ScriptedProvider(BOOK_TURNS)


def broken_provider() -> Any:
    """A provider factory that cannot build its client (``--provider booking:broken_provider``)."""
    raise RuntimeError("OPENAI_API_KEY is not set")


STUB_CALLS: list[dict[str, Any]] = []


def fake_booking(flight: str) -> dict[str, str]:
    """A stub for book_seat (``--stub book_seat=booking:fake_booking``)."""
    STUB_CALLS.append({"flight": flight})
    return {"booking": "STUB", "flight": flight}


def seat_booking(
    sent: list[str], seats: int, *, cost: int = 0, budget: int | None = None
) -> tuple[Agent, list[Any]]:
    """An agent whose model books seat 1, then 2, ... up to ``seats``, then says done, each
    model turn costing ``cost``; ``sent`` records every booking that reached the airline."""

    @tool
    def book(seat: str) -> str:
        sent.append(seat)
        return f"booked {seat}"

    script: list[Any] = [
        ScriptedTurn(calls=[("book", {"seat": str(n)})], cost_micros=cost)
        for n in range(1, seats + 1)
    ]
    return Agent("g", "book", tools=[book], budget_micros=budget), [*script, "done"]
