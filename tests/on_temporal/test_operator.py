"""What an operator does to a Temporal run with the kit's own tools: cancel it with
``tesserix cancel``, and trust that no secret it was given reaches Temporal's history."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from temporalio.client import Client

from on_temporal import airline
from on_temporal.conftest import DevServer
from on_temporal.helpers import (
    FAST,
    fast_runner,
    in_world,
    queue,
    run_id,
    store_url,
    tesserix,
    wait_for_file,
    worker_running,
    world_stores,
)
from tesserix_adk import ScriptedProvider
from tesserix_adk.providers.base import ModelRequest, ModelResponse
from tesserix_adk.temporal import start_run
from tesserix_adk.testing.secrets import leaked_secrets, planted_secrets

TENANT = airline.TENANT


async def test_tesserix_cancel_ends_a_waiting_temporal_run_with_nothing_sent(
    temporal_server: DevServer, tmp_path: Path
) -> None:
    rid, url = run_id(), store_url(tmp_path)
    with in_world(tmp_path):
        client = await Client.connect(temporal_server.address)
        async with await world_stores(tmp_path) as stores:
            runner = fast_runner(airline.provider(), stores)
            q = queue()
            async with worker_running(client, runner, [airline.approval_agent], q):
                handle = await start_run(
                    client,
                    airline.approval_agent,
                    "Book LH123",
                    tenant=TENANT,
                    run_id=rid,
                    task_queue=q,
                    options=FAST,
                    approval_poll=0.2,
                )
                assert runner.checkpoints is not None
                async with asyncio.timeout(30):
                    while True:
                        cp = await runner.checkpoints.latest(TENANT, rid)
                        if cp is not None and cp.pending_approval is not None:
                            break
                        await asyncio.sleep(0.05)
                cancelled = await tesserix(
                    "cancel",
                    rid,
                    "--tenant",
                    TENANT,
                    "--by",
                    "ops",
                    "--reason",
                    "wrong trip",
                    "--store",
                    url,
                )
                assert cancelled.returncode == 0, cancelled.stderr
                outcome = await asyncio.wait_for(handle.result(), 90)
            assert outcome.status == "cancelled"
            assert "ops" in (outcome.output or "")
            assert airline.bookings() == []


async def test_no_planted_secret_reaches_temporals_history(
    temporal_server: DevServer, tmp_path: Path
) -> None:
    secrets = " ".join(planted_secrets().values())
    rid = run_id()
    with in_world(tmp_path):
        client = await Client.connect(temporal_server.address)
        async with await world_stores(tmp_path) as stores:
            q = queue()
            async with worker_running(
                client, fast_runner(airline.provider(), stores), [airline.agent], q
            ):
                handle = await start_run(
                    client,
                    airline.agent,
                    f"Book LH123, paying with {secrets}",
                    tenant=TENANT,
                    run_id=rid,
                    task_queue=q,
                    options=FAST,
                )
                outcome = await handle.result()
                history = await handle.fetch_history()
    assert outcome.status == "completed"
    # Raw protobuf bytes: payloads as they are, not base64 as in the JSON form.
    raw = b"".join(event.SerializeToString() for event in history.events)
    assert b"LH123" in raw  # the input is there to be read, only its secrets are masked
    assert leaked_secrets(raw) == []


class _Thinking(ScriptedProvider):
    """Answers as scripted, but its second answer (the run has a frontier by then) waits
    until ``go`` is set."""

    def __init__(self, turns: list[Any]) -> None:
        super().__init__(turns)
        self.asked = asyncio.Event()
        self.go = asyncio.Event()

    async def complete(self, request: ModelRequest) -> ModelResponse:
        if len(request.messages) > 1 and not self.go.is_set():
            self.asked.set()
            await self.go.wait()
        return await super().complete(request)


async def test_tesserix_cancel_while_the_model_thinks_sends_none_of_its_calls(
    temporal_server: DevServer, tmp_path: Path
) -> None:
    # As on the runner's own loop: a cancel acknowledged while the model thinks stops the
    # calls it answers with (the check after its answer), and one acknowledged while a
    # sequential turn's first call is out stops the rest (each call activity asks first).
    rid, url = run_id(), store_url(tmp_path)
    provider = _Thinking(
        [[("book_seat", {"flight": "LH123"})], [("book_seat", {"flight": "UA456"})], "Booked."]
    )
    with in_world(tmp_path):
        client = await Client.connect(temporal_server.address)
        async with await world_stores(tmp_path) as stores:
            q = queue()
            async with worker_running(client, fast_runner(provider, stores), [airline.agent], q):
                handle = await start_run(
                    client,
                    airline.agent,
                    "Book LH123 then UA456",
                    tenant=TENANT,
                    run_id=rid,
                    task_queue=q,
                    options=FAST,
                )
                await asyncio.wait_for(provider.asked.wait(), 30)
                cancelled = await tesserix(
                    "cancel", rid, "--tenant", TENANT, "--by", "ops", "--store", url
                )
                assert cancelled.returncode == 0, cancelled.stderr
                provider.go.set()
                outcome = await asyncio.wait_for(handle.result(), 30)
        assert outcome.status == "cancelled"
        assert [flight for flight, _ in airline.bookings()] == ["LH123"]  # not UA456


async def test_tesserix_cancel_while_the_model_thinks_ends_the_run_cancelled_on_a_last_answer(
    temporal_server: DevServer, tmp_path: Path
) -> None:
    # The model's last answer, arriving after the cancel was acknowledged, does not end
    # the run completed.
    rid, url = run_id(), store_url(tmp_path)
    provider = _Thinking([[("book_seat", {"flight": "LH123"})], "Booked LH123."])
    with in_world(tmp_path):
        client = await Client.connect(temporal_server.address)
        async with await world_stores(tmp_path) as stores:
            q = queue()
            async with worker_running(client, fast_runner(provider, stores), [airline.agent], q):
                handle = await start_run(
                    client,
                    airline.agent,
                    "Book LH123",
                    tenant=TENANT,
                    run_id=rid,
                    task_queue=q,
                    options=FAST,
                )
                await asyncio.wait_for(provider.asked.wait(), 30)
                cancelled = await tesserix(
                    "cancel", rid, "--tenant", TENANT, "--by", "ops", "--store", url
                )
                assert cancelled.returncode == 0, cancelled.stderr
                provider.go.set()
                outcome = await asyncio.wait_for(handle.result(), 30)
        assert outcome.status == "cancelled"


async def test_tesserix_cancel_during_a_turns_first_call_sends_none_of_the_rest(
    temporal_server: DevServer, tmp_path: Path
) -> None:
    rid, url = run_id(), store_url(tmp_path)
    turns: list[Any] = [
        [("book_seat", {"flight": "LH123"}), ("book_seat", {"flight": "UA456"})],
        "Booked both.",
    ]
    with in_world(tmp_path):
        (tmp_path / "hold_before").touch()
        client = await Client.connect(temporal_server.address)
        async with await world_stores(tmp_path) as stores:
            q = queue()
            async with worker_running(
                client, fast_runner(ScriptedProvider(turns), stores), [airline.agent], q
            ):
                handle = await start_run(
                    client,
                    airline.agent,
                    "Book LH123 and UA456",
                    tenant=TENANT,
                    run_id=rid,
                    task_queue=q,
                    options=FAST,
                )
                await wait_for_file(tmp_path / "entered")  # inside the first booking
                cancelled = await tesserix(
                    "cancel", rid, "--tenant", TENANT, "--by", "ops", "--store", url
                )
                assert cancelled.returncode == 0, cancelled.stderr
                (tmp_path / "hold_before").unlink()
                outcome = await asyncio.wait_for(handle.result(), 30)
        assert outcome.status == "cancelled"
        assert [flight for flight, _ in airline.bookings()] == ["LH123"]
