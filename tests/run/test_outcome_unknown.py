"""A tool that sent its request and lost the reply (a timeout after sending, a connection
cut) cannot say whether it took effect. Telling the model "error" would be a guess — the
model would likely ask again, under a new key, and book twice — so the call is left in
doubt: its claim stays in flight, the attempt stops retryably, and the resume asks the
tool's reconciler or refuses the call naming it, as for a process that died there.
"""

from __future__ import annotations

from typing import Any

import pytest

from booking import BOOK_TURNS, Airline
from tesserix_adk import (
    Agent,
    AgentRunner,
    IndeterminateToolCallError,
    Reconciled,
    ScriptedProvider,
    ToolOutcomeUnknownError,
    open_stores,
    tool,
)
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.stores.protocols import RecordStatus

T = "acme"


def _agent(airline: Airline, *, reconcile: Any = None, lose_reply: bool = True) -> Agent:
    @tool(side_effects=False)
    def search_flights(origin: str, dest: str) -> list[str]:
        """Find flights."""
        return ["LH123"]

    @tool(reconcile=reconcile)
    def book_seat(flight: str, ctx: Any) -> dict[str, str]:
        """Book a seat (the airline takes it, then the reply is lost)."""
        airline.bookings.append(f"{flight}:{ctx.idempotency_key}")
        if lose_reply and len(airline.bookings) == 1:
            raise ToolOutcomeUnknownError("the airline took the request; its reply was lost")
        return {"booking": f"B{len(airline.bookings)}"}

    return Agent("booking", "Book.", [search_flights, book_seat])


def _runner(stores: Stores) -> AgentRunner:
    return AgentRunner.from_stores(ScriptedProvider(list(BOOK_TURNS)), stores, never_ran_margin=0)


async def _book_seat_record(stores: Stores) -> Any:
    (record,) = [r for r in await stores.idempotency.records(T, "r1") if r.tool == "book_seat"]
    return record


async def test_a_lost_reply_is_left_in_doubt_never_told_to_the_model_as_an_error() -> None:
    stores, airline = open_stores("memory://"), Airline()
    with pytest.raises(ToolOutcomeUnknownError) as raised:
        await _runner(stores).run(_agent(airline), "book", tenant=T, run_id="r1")
    assert raised.value.retryable
    assert (await _book_seat_record(stores)).status is RecordStatus.in_flight
    # The resume neither sends it again nor guesses: it names the call.
    with pytest.raises(IndeterminateToolCallError, match="book_seat"):
        await _runner(stores).resume(_agent(airline), "r1", tenant=T)
    assert len(airline.bookings) == 1


async def test_a_lost_reply_is_settled_by_the_reconciler_and_sent_once() -> None:
    stores, airline = open_stores("memory://"), Airline()

    def by_key(call: Any, ctx: Any) -> Reconciled:
        found = [b for b in airline.bookings if b.endswith(f":{ctx.idempotency_key}")]
        return Reconciled.completed({"booking": "found"}) if found else Reconciled.never_ran()

    agent = _agent(airline, reconcile=by_key)
    with pytest.raises(ToolOutcomeUnknownError):
        await _runner(stores).run(agent, "book", tenant=T, run_id="r1")
    run = await _runner(stores).resume(agent, "r1", tenant=T)
    assert run.status.value == "completed"
    assert len(airline.bookings) == 1
    record = await _book_seat_record(stores)
    assert record.status is RecordStatus.completed and record.by == "reconciler:book_seat"
