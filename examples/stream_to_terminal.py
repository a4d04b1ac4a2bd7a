"""Streaming a run to the terminal, offline: text as it arrives, each call, each frontier.

    python examples/stream_to_terminal.py [STORE_URL]   # default: a SQLite file in a temp dir

The viewer leaves halfway through the model's last answer (a closed terminal, Ctrl-C):
leaving stops the run at once and lets go of it, and the frontier written after the
booking is where it goes on. ``stream_resume`` then streams the rest: the model is asked
again for the answer that was cut off, and the seat is not booked twice.
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
from contextlib import aclosing

from tesserix_adk import (
    Agent,
    AgentRunner,
    Checkpointer,
    FrontierWritten,
    RunEvent,
    RunFinished,
    ScriptedProvider,
    ScriptedTurn,
    TextDelta,
    ToolCallAsked,
    ToolCallFinished,
    open_stores,
    tool,
)

BOOKINGS: list[str] = []  # stands in for the airline's own records


@tool(side_effects=False)
def search_flights(origin: str, destination: str) -> list[str]:
    """Find flights (read-only: safe to send again)."""
    return ["LH400", "UA961"]


@tool
def book_seat(flight: str) -> dict[str, str]:
    """Book one seat (side-effecting: keyed, claimed before it runs)."""
    BOOKINGS.append(flight)
    return {"booking": f"BK-{len(BOOKINGS)}"}


agent = Agent("booking", "Book the flight the user asks for.", [search_flights, book_seat])
TURNS = [
    ScriptedTurn(
        text="Let me look for flights.",
        calls=[("search_flights", {"origin": "FRA", "destination": "JFK"})],
    ),
    ScriptedTurn(
        text="LH400 leaves first; booking it.", calls=[("book_seat", {"flight": "LH400"})]
    ),
    "Booked LH400 from Frankfurt to New York, seat confirmed.",
]


class Terminal:
    """Shows events as they come: text inline, everything else on lines of its own."""

    def __init__(self) -> None:
        self.mid_line = False  # text printed since the last newline

    def show(self, event: RunEvent) -> None:
        if isinstance(event, TextDelta):
            print(event.text, end="", flush=True)
            self.mid_line = True
            return
        if self.mid_line:
            print()
            self.mid_line = False
        if isinstance(event, ToolCallAsked):
            print(f"  -> {event.name}({dict(event.arguments)})")
        elif isinstance(event, ToolCallFinished):
            print(f"  <- {event.name}: {event.disposition}{' (error)' if event.is_error else ''}")
        elif isinstance(event, FrontierWritten):
            print(f"  [frontier {event.step}: {event.boundary}]")
        elif isinstance(event, RunFinished):
            print(f"  run {event.run.run_id} {event.run.status}: {event.run.output}")


async def main(url: str) -> int:
    async with open_stores(url) as stores:
        await stores.create_schema()

        def runner() -> AgentRunner:  # what each new process builds
            return AgentRunner(
                ScriptedProvider(TURNS),
                idempotency=stores.idempotency,
                checkpoints=Checkpointer.from_stores(stores),
                leases=stores.leases,
                ledger=stores.ledger,
            )

        terminal = Terminal()
        print("== streaming; the viewer leaves during the last answer")
        stream = runner().stream(agent, "book me FRA to JFK", tenant="acme", run_id="run_1")
        async with aclosing(stream) as events:
            async for event in events:
                terminal.show(event)
                if isinstance(event, TextDelta) and event.iteration == 2:
                    print("\n  (viewer left: the run stops, its lease is released)")
                    terminal.mid_line = False
                    break

        print("== stream_resume: the rest, from the last frontier")
        async with aclosing(runner().stream_resume(agent, "run_1", tenant="acme")) as events:
            async for event in events:
                terminal.show(event)
    print(f"airline holds {len(BOOKINGS)} booking(s)")
    return 0 if BOOKINGS == ["LH400"] else 1


if __name__ == "__main__":
    if len(sys.argv) > 1:
        sys.exit(asyncio.run(main(sys.argv[1])))
    with tempfile.TemporaryDirectory() as tmp:
        sys.exit(asyncio.run(main(f"sqlite:///{tmp}/adk.sqlite3")))
