"""A sync tool's call waits for a free thread for as long as other calls hold them, and the
run's lease may lapse meanwhile: the lease is checked again as the thread takes the call
up, so a holder that lost the run sends nothing (``tools.NotStarted``). The end-to-end case
with a second process taking the run over is
``tests/test_attacks_load_starvation.py``."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tesserix_adk import (
    Agent,
    AgentRunner,
    LeasePolicy,
    ScriptedProvider,
    ToolCall,
    open_stores,
    tool,
)
from tesserix_adk.errors import LeaseLostError
from tesserix_adk.tools import NotStarted, ToolContext

T = "acme"


def _blocked_executor(loop: asyncio.AbstractEventLoop) -> tuple[threading.Event, Any]:
    """The loop's default executor with its one thread held until the event is set."""
    pool = ThreadPoolExecutor(max_workers=1)
    loop.set_default_executor(pool)
    gate = threading.Event()
    pool.submit(gate.wait)
    return gate, pool


async def test_the_guard_is_asked_again_as_the_thread_starts_the_call() -> None:
    made: list[str] = []

    @tool
    def book(flight: str) -> str:
        """Book a seat."""
        made.append(flight)
        return "booked"

    gate, pool = _blocked_executor(asyncio.get_running_loop())
    asked: list[str] = []

    def guard() -> None:
        asked.append(threading.current_thread().name)
        if len(asked) > 1:
            raise LeaseLostError("lapsed while the call waited for a thread")

    call = ToolCall(id="c1", name="book", arguments={"flight": "LH1"})
    ctx = ToolContext(tenant=T, run_id="r", call=call, idempotency_key="k", fence=1, iteration=0)
    calling = asyncio.ensure_future(book.invoke({"flight": "LH1"}, ctx, guard=guard))
    await asyncio.sleep(0.05)
    assert len(asked) == 1  # asked on the loop; the call waits for the thread
    gate.set()
    with pytest.raises(NotStarted) as refused:
        await calling
    assert isinstance(refused.value.error, LeaseLostError)
    assert made == []
    assert asked[1] != asked[0]  # asked again in the worker thread
    pool.shutdown()


@pytest.mark.parametrize("cancelled", [False, True])
async def test_a_call_that_waited_past_its_lease_is_not_sent_and_its_claim_goes(
    tmp_path: Path, cancelled: bool
) -> None:
    """The run's lease lapses while its booking waits for the one thread (the event loop
    stalled past the ttl, so no renewal ran): the thread refuses to start it. Nothing was
    sent, so the claim goes and a resume books once. Also when the run's task was cancelled
    while the call waited (the thread's refusal then comes as the cancellation's end)."""
    made: list[str] = []

    @tool
    def book(flight: str) -> str:
        """Book a seat."""
        made.append(flight)
        return "booked"

    agent = Agent("booking", "Book it.", [book])
    url = f"sqlite:///{tmp_path / 'adk.sqlite3'}"
    async with open_stores(url) as stores:
        await stores.create_schema()
        gate, pool = _blocked_executor(asyncio.get_running_loop())
        runner = AgentRunner.from_stores(
            ScriptedProvider([[("book", {"flight": "LH1"})], "done"]),
            stores,
            lease_policy=LeasePolicy(ttl=0.3, renew_within=0.1),
        )
        running = asyncio.ensure_future(runner.run(agent, "go", tenant=T, run_id="r"))
        for _ in range(200):
            records = await stores.idempotency.records(T, "r")
            if records:
                break
            await asyncio.sleep(0.01)
        assert records and records[0].status.value == "in_flight"
        if cancelled:
            running.cancel()
            await asyncio.sleep(0)
        time.sleep(0.5)  # noqa: ASYNC251 - the loop stalls past the ttl: no renewal runs
        gate.set()
        with pytest.raises((LeaseLostError, asyncio.CancelledError)):
            await running
        assert made == []
        assert await stores.idempotency.records(T, "r") == []  # the claim went
        pool.shutdown()
        asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(max_workers=2))
        resumed = AgentRunner.from_stores(
            ScriptedProvider([[("book", {"flight": "LH1"})], "done"]), stores
        )
        run = await resumed.resume(agent, "r", tenant=T)
    assert run.status.value == "completed"
    assert made == ["LH1"]
