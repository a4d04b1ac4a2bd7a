"""Metrics through the API's meter, read with the SDK's in-memory reader: step latency per
frontier written, attempts by status, and a worker's parked runs and lease takeovers."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from booking import BOOK_TURNS, Airline, booking_agent
from otel_spans.world import Pipeline, World
from tesserix_adk import (
    AgentRunner,
    LeasePolicy,
    RunStatus,
    ScriptedProvider,
    Worker,
    open_stores,
)
from tesserix_adk.run.events import FrontierWritten
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.stores.memory import MemoryWorkIndex
from tesserix_adk.testing.faults import SimulatedCrash

T = "acme"


async def test_each_durable_step_and_each_attempt_is_measured(airline: Airline) -> None:
    otel = Pipeline()
    frontiers: list[FrontierWritten] = []
    runner = World().runner(otel)
    async for event in runner.stream(booking_agent(airline), "book", tenant=T, run_id="r1"):
        if isinstance(event, FrontierWritten):
            frontiers.append(event)
    per_boundary = {
        p.attributes["tesserix.boundary"]: p.count for p in otel.points("tesserix.step.duration")
    }
    assert sum(per_boundary.values()) == len(frontiers) >= 3
    assert all(p.sum >= 0 for p in otel.points("tesserix.step.duration"))
    (runs,) = otel.points("tesserix.runs")
    assert dict(runs.attributes) == {
        "gen_ai.agent.name": "booking",
        "tesserix.run.status": "completed",
    }
    assert runs.value == 1


async def test_a_failed_attempt_is_counted_by_its_error(airline: Airline) -> None:
    otel, world = Pipeline(), World()
    world.store.crash_before = lambda body: True
    with pytest.raises(SimulatedCrash):
        await world.runner(otel).run(booking_agent(airline), "book", tenant=T, run_id="r1")
    (runs,) = otel.points("tesserix.runs")
    assert runs.attributes["error.type"] == "SimulatedCrash"
    assert otel.points("tesserix.step.duration") == []  # no frontier became durable


def _stores() -> Stores:
    stores = open_stores("memory://")
    stores.work = MemoryWorkIndex(stores.leases)
    return stores


def _runner(stores: Stores) -> AgentRunner:
    return AgentRunner.from_stores(
        ScriptedProvider(list(BOOK_TURNS)),
        stores,
        lease_policy=LeasePolicy(ttl=2.0, renew_within=1.0),
        never_ran_margin=0.05,
    )


def _crash_inside_booking(airline: Airline, stage: str) -> None:
    def hook(at: str) -> None:
        if at == stage:
            airline.hook = None
            raise SimulatedCrash(f"died {stage} booking")

    airline.hook = hook


async def _work(stores: Stores, otel: Pipeline, airline: Airline) -> Worker:
    worker = Worker(
        _runner(stores),
        [booking_agent(airline)],
        exit_when_idle=True,
        poll_interval=0.01,
        telemetry=otel.telemetry,
    )
    await asyncio.wait_for(worker.run(), 30)
    return worker


async def test_a_worker_counts_the_runs_it_takes_over_and_the_runs_it_parks() -> None:
    otel, stores, airline = Pipeline(), _stores(), Airline()
    agent = booking_agent(airline)
    # r1 dies inside book_seat, its claim in flight: a worker takes the run over and, the
    # call in doubt with no reconciler, parks it.
    runner = _runner(stores)
    _crash_inside_booking(airline, "before")
    with pytest.raises(SimulatedCrash):
        await runner.run(agent, "book", tenant=T, run_id="r1")
    worker = await _work(stores, otel, airline)
    (taken,) = otel.points("tesserix.lease.takeovers")
    assert taken.value == 1
    (parked,) = otel.points("tesserix.runs.parked")
    assert parked.value == 1
    assert dict(parked.attributes) == {
        "gen_ai.agent.name": "booking",
        "error.type": "IndeterminateToolCallError",
    }
    # The worker's runner reports spans too: its resume attempt, refused.
    (root,) = otel.named("invoke_agent")
    assert root.attributes is not None and root.attributes["tesserix.attempt.kind"] == "resume"
    assert root.attributes["error.type"] == "IndeterminateToolCallError"
    assert [how.value for _, how in worker.carried] == ["parked"]

    # A submitted run is started, not taken over: the count stays.
    await _runner(stores).submit(agent, "book", tenant=T, run_id="r2")
    await _work(stores, otel, airline)
    (taken,) = otel.points("tesserix.lease.takeovers")
    assert taken.value == 1
    statuses: dict[str, Any] = {
        p.attributes.get("tesserix.run.status", p.attributes.get("error.type")): p.value
        for p in otel.points("tesserix.runs")
    }
    assert statuses == {"IndeterminateToolCallError": 1, RunStatus.completed.value: 1}


async def test_resuming_a_finished_run_does_not_count_it_again(airline: Airline) -> None:
    otel, world = Pipeline(), World()
    agent = booking_agent(airline)
    await world.runner(otel).run(agent, "book", tenant=T, run_id="r1")
    again = await world.runner(otel).resume(agent, "r1", tenant=T)
    assert again.status is RunStatus.completed
    (runs,) = otel.points("tesserix.runs")
    assert runs.value == 1
    resumed = [s for s in otel.named("invoke_agent") if s.attributes is not None]
    assert [s.attributes["tesserix.attempt.carried"] for s in resumed] == [True, False]
