"""The booking world of these tests: an airline that counts what it was asked to do.

Kept here rather than imported from the top-level ``conftest`` so this package does not
depend on which ``conftest`` module Python happens to find first.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tesserix_adk import Agent, tool


@dataclass
class Airline:
    """The outside world: every booking it took and how often it was searched."""

    bookings: list[str] = field(default_factory=list)
    searches: int = 0


def booking_agent(airline: Airline) -> Agent:
    """A read-only search and a side-effecting booking; bodies close over ``airline``, so a
    fresh agent in a "new process" has the same revision."""

    @tool(side_effects=False)
    def search_flights(origin: str, dest: str) -> list[str]:
        """Find flights between two airports."""
        airline.searches += 1
        return ["LH123", "UA456"]

    @tool
    def book_seat(flight: str) -> dict[str, str]:
        """Book one seat on a flight."""
        airline.bookings.append(flight)
        return {"booking": f"B{len(airline.bookings)}", "flight": flight}

    return Agent("booking", "Book the flight the user asks for.", [search_flights, book_seat])
