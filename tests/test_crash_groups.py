"""The crash windows write groups change (``run.grouping``), with real processes killed by
SIGKILL. Where a backend groups a turn's writes, the charge, the ``after_model_call``
frontier and the first claim commit together: a death before that commit leaves none of
them, and the resume asks the model again and books once. A death inside the tool finds the
claim and the frontier durable. A turn's last outcome commits with its ``after_tool_result``
frontier: a death before that commit leaves the call in doubt, one after finds both."""

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


def _book_seat(site: Site, run_id: str) -> str:
    async def status() -> str:
        async with open_stores(site.store) as stores:
            records = await stores.idempotency.records(TENANT, run_id)
        return next(str(r.status) for r in records if r.tool == "book_seat")

    return asyncio.run(status())


def test_a_death_before_the_last_outcome_commits_with_its_frontier_leaves_the_call_in_doubt(
    site: Site,
) -> None:
    # Paused with book_seat's outcome written into the group, before after_tool_result
    # joined it: the window a turn's last outcome shares with its frontier. Nothing of it
    # is durable, so the call that ran is in doubt, refused, and not sent again.
    site.kill_at("g3", "booked", "--group-writes")
    where, _, _ = _durable(site, "g3")
    assert where == (1, "after_model_call")
    assert _book_seat(site, "g3") == "in_flight"
    assert site.bookings("g3") == 1
    site.wait_lease_lapsed("g3")
    proc = site.worker("g3", "--resume", "--group-writes")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 4, out + err
    assert "IndeterminateToolCallError" in out and "book_seat" in out
    assert site.bookings("g3") == 1


def test_a_death_once_the_model_is_asked_again_finds_the_outcome_and_its_frontier(
    site: Site,
) -> None:
    # Paused as the model is asked after the booking turn: its outcome and its
    # after_tool_result frontier committed together before that.
    site.kill_at("g4", "asked_again", "--group-writes")
    where, _, _ = _durable(site, "g4")
    assert where == (1, "after_tool_result")
    assert _book_seat(site, "g4") == "completed"
    site.wait_lease_lapsed("g4")
    proc = site.worker("g4", "--resume", "--group-writes")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, out + err
    assert "RESULT completed" in out
    assert site.bookings("g4") == 1
