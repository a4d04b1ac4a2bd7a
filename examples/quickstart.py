"""The README's quick start, runnable offline: a run dies after booking, a new runner resumes.

    .venv/bin/python examples/quickstart.py [STORE_URL]   # default: a SQLite file in a temp dir

It prints the store it used and the run's id; run it again with that URL and it starts a new
run (a new id) in the same store, beside the first. Works unchanged with ``memory://``,
``sqlite:///…``, ``redis://…?allow_volatile=true`` or ``postgresql://…`` — only the URL
changes.
"""

from __future__ import annotations

import asyncio
import secrets
import shlex
import sys
import tempfile

from tesserix_adk import Agent, AgentRunner, Checkpointer, ScriptedProvider, ToolContext, tool
from tesserix_adk.stores import open_stores
from tesserix_adk.testing.faults import SimulatedCrash

BOOKINGS: list[str] = []  # stands in for the airline's own records


@tool(side_effects=False)
def search_flights(origin: str, destination: str) -> list[str]:
    """Find flights (read-only: safe to send again)."""
    return ["LH400", "UA961"]


@tool
def book_seat(flight: str, *, ctx: ToolContext) -> dict[str, str]:
    """Book one seat (side-effecting: keyed, claimed before it runs)."""
    BOOKINGS.append(flight)
    if len(BOOKINGS) == 1:
        raise SimulatedCrash("the process dies right after the airline booked the seat")
    return {"booking": f"BK-{len(BOOKINGS)}", "key": ctx.idempotency_key or ""}


agent = Agent("booking", "Book the flight the user asks for.", [search_flights, book_seat])
TURNS = [
    [("search_flights", {"origin": "FRA", "destination": "JFK"})],
    [("book_seat", {"flight": "LH400"})],
    "Booked LH400.",
]
# What `tesserix run --resume RUN --agent examples/quickstart.py:agent` asks (it refuses, exit 4).
PROVIDER = ScriptedProvider(TURNS)


async def main(url: str) -> int:
    run_id = f"run-{secrets.token_hex(3)}"  # a run id is the run's identity: one per run
    print(f"store {url}; run {run_id}")
    async with open_stores(url) as stores:
        await stores.create_schema()  # idempotent; `tesserix schema apply` does the same

        def runner() -> AgentRunner:  # what each new process builds
            return AgentRunner(
                ScriptedProvider(TURNS),
                idempotency=stores.idempotency,
                checkpoints=Checkpointer.from_stores(stores),
                leases=stores.leases,
                ledger=stores.ledger,
                approvals=stores.approvals,
            )

        try:
            await runner().run(agent, "book me FRA to JFK", tenant="acme", run_id=run_id)
        except SimulatedCrash as death:
            print(f"died: {death}")
        try:
            await runner().resume(agent, run_id, tenant="acme")
        except Exception as refused:  # the booking was in flight: nobody can say it ran
            print(f"resume refused ({type(refused).__name__}): {refused}")
        print(f"airline holds {len(BOOKINGS)} booking(s)")
    if not url.startswith("memory:"):
        # Quoted for the shell: a URL's ``&`` or ``?`` would otherwise be read by it.
        print(f"look at it: tesserix inspect {run_id} --tenant acme --store {shlex.quote(url)}")
    return 0 if len(BOOKINGS) == 1 else 1


if __name__ == "__main__":
    default = f"sqlite:///{tempfile.mkdtemp()}/adk.sqlite3"
    sys.exit(asyncio.run(main(sys.argv[1] if len(sys.argv) > 1 else default)))
