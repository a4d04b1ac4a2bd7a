"""One run's work-index entry is read as one run (``WorkIndex.entry``), never found by
listing every entry of its tenant: a tenant with many runs makes neither a worker's
too-many park nor an operator's look at one run slower.

Each test hands the code a work index whose ``items`` (the tenant's listing) fails, on
every backend, and checks that the one-run path still decides as before.
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

import pytest

from run.helpers import fresh_stores
from tesserix_adk import Carried, Worker, WorkState
from tesserix_adk.cli.reasons import parked_item
from tesserix_adk.cli.waking import wake
from tesserix_adk.run.unstarted import unstarted_runs
from tesserix_adk.stores.bundle import Stores
from test_attacks_work_index import (
    BACKENDS,
    FAST,
    Steps,
    T,
    Work,
    _entry,
    _run_taken_twice,
    _runner,
    _step_agent,
)


class NoListing(Work):
    """The work index, except that listing a tenant's entries fails."""

    async def items(self, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError("one run's entry was looked for through the tenant's listing")


def _unlisted(stores: Stores) -> Stores:
    return dataclasses.replace(stores, work=NoListing(stores.work))


@pytest.mark.parametrize("backend", BACKENDS)
async def test_the_too_many_park_reads_only_the_runs_entry(backend: str, tmp_path: Path) -> None:
    async with fresh_stores(backend, tmp_path) as stores:
        agent = _step_agent()
        model = Steps(steps=2, fail_at={2})
        await _run_taken_twice(stores, model, agent)
        runner, _ = _runner(stores, model)
        runner.work = NoListing(stores.work)  # type: ignore[assignment]
        w = Worker(runner, [agent], max_attempts=2, poll_interval=0.01, backoff=FAST)
        assert await w.poll() == 1
        await asyncio.gather(*w._running.values())
        assert [h for _, h in w.carried] == [Carried.parked]
        parked = await _entry(stores)
        assert (parked.state, parked.reason is not None) == (WorkState.parked, True)
        assert "taken 2 times" in parked.reason


@pytest.mark.parametrize("backend", BACKENDS)
async def test_an_operators_look_at_one_run_reads_only_its_entry(
    backend: str, tmp_path: Path
) -> None:
    async with fresh_stores(backend, tmp_path) as stores:
        assert stores.work is not None
        agent = _step_agent()
        runner, _ = _runner(stores, Steps(steps=1, fail_at=set()))
        for run_id in ("r", "other", "gone"):
            await runner.submit(agent, "go", tenant=T, run_id=run_id)
        await stores.work.park(T, "r", agent=agent.name, reason="why")
        await runner.cancel("gone", tenant=T, by="ops", reason="not wanted")
        gone = await stores.work.entry(T, "gone")
        assert gone is not None and gone.state is WorkState.done
        one = _unlisted(stores)

        item = await parked_item(one, T, "r")
        assert item is not None and (item.run_id, item.reason) == ("r", "why")
        assert await parked_item(one, T, "other") is None  # submitted, not parked
        assert await parked_item(one, T, "nobody") is None

        (found,) = await unstarted_runs(one, T, with_frontier=(), only="r")
        assert (found.item.run_id, found.parked) == ("r", "why")
        (found,) = await unstarted_runs(one, T, with_frontier=(), only="gone")
        assert found.status == "cancelled" and found.cancel is not None
        assert await unstarted_runs(one, T, with_frontier=(), only="gone", cancelled=False) == []
        assert await unstarted_runs(one, T, with_frontier=("r",), only="r") == []
        assert await unstarted_runs(one, T, with_frontier=(), only="nobody") == []

        # An operator's wake of a run with no frontier finds its agent in its entry.
        assert await wake(one, T, "r", WorkState.wanted, None) is True
        assert await wake(one, T, "nobody", WorkState.wanted, None) is False
        woken = await stores.work.entry(T, "r")
        assert woken is not None and woken.state is WorkState.wanted
