"""A worker process SIGKILLed inside a tool call, and a second worker process that carries
the run on: Temporal retries the activity (at least once), the kit decides what that
retry may do. A call whose outcome was recorded is replayed, never sent again; a call in
doubt is settled by its reconciler, or refused naming it — never guessed."""

from __future__ import annotations

from pathlib import Path

import pytest
from temporalio.client import Client, WorkflowFailureError

from on_temporal import airline
from on_temporal.conftest import DevServer
from on_temporal.helpers import (
    FAST,
    WorkerProcess,
    in_world,
    queue,
    run_id,
    wait_for_file,
    world_stores,
)
from tesserix_adk.stores.protocols import RecordStatus
from tesserix_adk.temporal import start_run

TENANT = airline.TENANT


async def _killed_inside_book_seat(
    server: DevServer, world: Path, hold: str, agent: str
) -> tuple[object, Exception | None]:
    """Run the booking with a first worker killed at ``hold`` and a second one carrying it
    on; the run's outcome (or the workflow's failure)."""
    (world / hold).touch()
    q = queue()
    async with await world_stores(world):
        pass  # the schema, before either worker opens the file
    client = await Client.connect(server.address)
    first = await WorkerProcess.start(server.address, q, agent)
    try:
        handle = await start_run(
            client,
            getattr(airline, agent),
            "Book LH123",
            tenant=TENANT,
            run_id=run_id(),
            task_queue=q,
            options=FAST,
        )
        await wait_for_file(world / "entered")
        await first.kill()
    finally:
        await first.stop()
    (world / hold).unlink()
    second = await WorkerProcess.start(server.address, q, agent)
    try:
        try:
            return await handle.result(), None
        except WorkflowFailureError as exc:
            return None, exc
    finally:
        await second.stop()


async def test_a_completed_call_whose_reply_was_lost_is_replayed_not_sent_again(
    temporal_server: DevServer, tmp_path: Path
) -> None:
    with in_world(tmp_path):
        outcome, failure = await _killed_inside_book_seat(
            temporal_server, tmp_path, "hold_reply", "agent"
        )
        assert failure is None, failure
        assert outcome.status == "completed"
        assert len(airline.bookings()) == 1


async def test_a_call_in_doubt_without_a_reconciler_is_refused_naming_it(
    temporal_server: DevServer, tmp_path: Path
) -> None:
    with in_world(tmp_path):
        outcome, failure = await _killed_inside_book_seat(
            temporal_server, tmp_path, "hold_after", "agent"
        )
        assert outcome is None
        assert isinstance(failure, WorkflowFailureError)
        cause = failure.cause
        assert "IndeterminateToolCallError" in repr(cause)
        assert "book_seat (call_1_0)" in str(cause)
        assert len(airline.bookings()) == 1  # made once, by the killed worker; never again
        async with await world_stores(tmp_path) as stores:
            [(_, key)] = airline.bookings()
            record = (await stores.idempotency.lookup([key], tenant=TENANT))[key]
            assert record.status is RecordStatus.in_flight  # left for `tesserix resolve`


@pytest.mark.parametrize(
    ("hold", "booked_by_the_dead"), [("hold_after", True), ("hold_before", False)]
)
async def test_a_call_in_doubt_is_settled_by_its_reconciler(
    temporal_server: DevServer, tmp_path: Path, hold: str, booked_by_the_dead: bool
) -> None:
    with in_world(tmp_path):
        outcome, failure = await _killed_inside_book_seat(
            temporal_server, tmp_path, hold, "reconciled_agent"
        )
        assert failure is None, failure
        assert outcome.status == "completed"
        # Booked once: by the dead worker (the reconciler said so), or — it never ran —
        # by the second worker.
        assert len(airline.bookings()) == 1
        async with await world_stores(tmp_path) as stores:
            [(_, key)] = airline.bookings()
            record = (await stores.idempotency.lookup([key], tenant=TENANT))[key]
            assert record.status is RecordStatus.completed
            assert (record.by == "reconciler:book_seat") is booked_by_the_dead
