"""Planning a resume reads what it decides on, whatever the run's length: the outstanding
keys, and the run's records from the frontier's iteration on, without their outcomes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tesserix_adk import Agent, AgentRunner, ScriptedProvider, ScriptedTurn, tool
from tesserix_adk.checkpoint.planning import plan_resume
from tesserix_adk.stores.protocols import IdempotencyRecord
from tesserix_adk.stores.urls import open_stores


@pytest.mark.parametrize("store", ["memory://", "sqlite", "postgres"])
async def test_a_plan_reads_the_records_of_its_frontiers_turn_alone_without_outcomes(
    tmp_path: Path, store: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if store == "postgres":
        from adapters import services

        async with services.postgres_schema() as schema:
            await _plans_read_their_turn_alone(services.schema_url(schema), monkeypatch)
        return
    url = store if store != "sqlite" else f"sqlite:///{tmp_path / 'a.sqlite3'}"
    await _plans_read_their_turn_alone(url, monkeypatch)


async def _plans_read_their_turn_alone(url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    stores = open_stores(url)
    await stores.create_schema()

    @tool
    def book(seat: str) -> str:
        return f"booked {seat} " * 40

    turns = 30
    script: list[Any] = [ScriptedTurn(calls=[("book", {"seat": str(i)})]) for i in range(turns)]
    runner = AgentRunner.from_stores(ScriptedProvider([*script, "done"]), stores)
    try:
        await runner.run(
            Agent("p", "x", tools=[book], max_iterations=40), "go", tenant="t", run_id="r"
        )
        idempotency: Any = stores.idempotency
        read: list[list[IdempotencyRecord]] = []
        whole = idempotency.records
        ranged = idempotency.records_from

        async def records(*args: Any, **kwargs: Any) -> list[IdempotencyRecord]:
            raise AssertionError("planning read every record of the run")

        async def records_from(*args: Any, **kwargs: Any) -> list[IdempotencyRecord]:
            found: list[IdempotencyRecord] = await ranged(*args, **kwargs)
            read.append(found)
            return found

        monkeypatch.setattr(idempotency, "records", records)
        monkeypatch.setattr(idempotency, "records_from", records_from)
        assert runner.checkpoints is not None
        for step in (3, 41, 57):  # after_model_call of iterations 1, 20 and 28
            cp = await runner.checkpoints.at("t", "r", step)
            assert cp is not None and cp.boundary == "after_model_call"
            plan = await plan_resume(cp, idempotency)
            # Its own call is completed; the later turns' calls are ahead of it.
            assert [p.disposition for p in plan.completed][:1] == ["completed"]
            assert len(plan.completed) == turns - cp.iteration
        # Each plan read the records from its frontier's iteration on, none with an outcome.
        assert [len(found) for found in read] == [turns - 1, turns - 20, turns - 28]
        assert all(r.outcome is None for found in read for r in found)
        monkeypatch.setattr(idempotency, "records", whole)
    finally:
        await stores.aclose()
