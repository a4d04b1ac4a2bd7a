"""The crash windows write groups change (``run.grouping``), with real processes killed by
SIGKILL. Where a backend groups a turn's writes, the charge, the ``after_model_call``
frontier and the first claim commit together: a death before that commit leaves none of
them, and the resume asks the model again and books once. A death inside the tool finds the
claim and the frontier durable; a death after the outcome finds the outcome durable."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from processes import TENANT, Site, held_open, store_url
from tesserix_adk.checkpoint.checkpointer import Checkpointer
from tesserix_adk.stores.urls import open_stores

pytestmark = pytest.mark.skipif(os.name != "posix", reason="needs POSIX signals")

# The backends whose stores group a turn's writes.
GROUPED = [
    pytest.param("sqlite", id="sqlite"),
    pytest.param("postgres", id="postgres", marks=pytest.mark.postgres),
]


@pytest.fixture(params=GROUPED)
def site(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Site]:
    with held_open(store_url(request.param, tmp_path)) as url:
        yield Site(tmp_path, url)


def _durable(site: Site, run_id: str) -> tuple[tuple[int, str] | None, list[str], int]:
    """What a new process finds: the frontier's (iteration, boundary), the tools with a
    record, and the ledger's spend."""

    async def read() -> tuple[tuple[int, str] | None, list[str], int]:
        async with open_stores(site.store) as stores:
            cp = await Checkpointer.from_stores(stores).latest(TENANT, run_id)
            records = await stores.idempotency.records(TENANT, run_id)
            assert stores.ledger is not None
            spent = await stores.ledger.spent(TENANT, run_id)
        where = None if cp is None else (cp.iteration, str(cp.boundary))
        return where, sorted(r.tool for r in records if r.tool), spent

    return asyncio.run(read())


def test_a_death_before_the_turns_first_claim_commits_leaves_none_of_the_turn(
    site: Site,
) -> None:
    # Paused once the booking turn's after_model_call frontier went into the group, before
    # the claim of book_seat joined it and the group committed.
    site.kill_at("g1", "in_group")
    where, tools, spent = _durable(site, "g1")
    assert where == (0, "after_tool_result")
    assert tools == ["search_flights"]
    assert spent == 1400  # the first model call's charge only
    site.wait_lease_lapsed("g1")
    proc = site.worker("g1", "--resume")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, out + err
    assert "RESULT completed" in out
    assert site.bookings("g1") == 1
    where, tools, spent = _durable(site, "g1")
    assert tools == ["book_seat", "search_flights"]
    # The model was asked again for the booking turn, and charged once for it.
    assert spent == 1400 + 1700 + 1800


def test_a_death_inside_the_tool_finds_its_claim_and_frontier_durable(site: Site) -> None:
    site.kill_at("g2", "in_flight", "--group-writes")
    where, tools, spent = _durable(site, "g2")
    assert where == (1, "after_model_call")
    assert tools == ["book_seat", "search_flights"]
    assert spent == 1400 + 1700


def test_a_death_after_the_outcome_finds_it_recorded_before_its_frontier(site: Site) -> None:
    site.kill_at("g3", "booked", "--group-writes")
    where, _, _ = _durable(site, "g3")
    assert where == (1, "after_model_call")

    async def booked() -> str:
        async with open_stores(site.store) as stores:
            records = await stores.idempotency.records(TENANT, "g3")
        return next(str(r.status) for r in records if r.tool == "book_seat")

    assert asyncio.run(booked()) == "completed"
    assert site.bookings("g3") == 1
