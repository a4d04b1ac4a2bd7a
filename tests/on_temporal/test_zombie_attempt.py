"""A worker frozen inside a tool call (SIGSTOP) is not dead: Temporal times its attempt
out and retries elsewhere, and when the frozen one wakes it still holds the call in
memory. The kit's lease decides who may act: the retry waits out the frozen holder's
lease, takes it with a higher fence and settles the call by its reconciler; the zombie,
thawed, records nothing over the settled outcome (Temporal cancels it, and a write of its
that got out first would carry the old fence, which every store now refuses)."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

from temporalio.client import Client

from on_temporal import airline
from on_temporal.conftest import DevServer
from on_temporal.helpers import (
    FAST,
    WorkerProcess,
    in_world,
    pause,
    queue,
    run_id,
    unpause,
    wait_for_file,
    world_stores,
)
from tesserix_adk.stores.protocols import RecordStatus
from tesserix_adk.temporal import start_run

TENANT = airline.TENANT


async def test_a_thawed_zombie_attempt_changes_nothing_the_retry_settled(
    temporal_server: DevServer, tmp_path: Path
) -> None:
    rid, q = run_id(), queue()
    with in_world(tmp_path):
        (tmp_path / "hold_after").touch()
        async with await world_stores(tmp_path):
            pass
        client = await Client.connect(temporal_server.address)
        zombie = await WorkerProcess.start(temporal_server.address, q, "reconciled_agent")
        second: WorkerProcess | None = None
        try:
            handle = await start_run(
                client,
                airline.reconciled_agent,
                "Book LH123",
                tenant=TENANT,
                run_id=rid,
                task_queue=q,
                # Model turns handed to the frozen worker's open polls are retried after
                # two seconds, not thirty.
                options=dataclasses.replace(FAST, model_timeout=2.0),
                # A workflow task handed to the frozen worker's open poll is taken back
                # after a second, not the server's default ten.
                task_timeout=1.0,
            )
            await wait_for_file(tmp_path / "entered")
            await pause(zombie)  # booked, not yet recorded; frozen with the call in memory
            (tmp_path / "hold_after").unlink()
            second = await WorkerProcess.start(temporal_server.address, q, "reconciled_agent")
            outcome = await asyncio.wait_for(handle.result(), 60)
            assert outcome.status == "completed"
            async with await world_stores(tmp_path) as stores:
                [(_, key)] = airline.bookings()
                before = (await stores.idempotency.lookup([key], tenant=TENANT))[key]
                assert before.status is RecordStatus.completed
                assert before.by == "reconciler:book_seat"
                await unpause(zombie)
                # The zombie's next durable act would be recording its outcome under its
                # old fence. Give it longer than a lease renewal takes to act.
                await asyncio.sleep(3)
                after = (await stores.idempotency.lookup([key], tenant=TENANT))[key]
            assert after.status is RecordStatus.completed
            assert after.by == "reconciler:book_seat" and after.outcome == before.outcome
            assert len(airline.bookings()) == 1
        finally:
            await unpause(zombie)
            await zombie.stop()
            if second is not None:
                await second.stop()
