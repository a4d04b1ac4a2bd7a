"""Round trips on the wire, read off libpq's own protocol trace: each Sync or simple Query
the client sends is answered by one ReadyForQuery, which it waits for. The conformance
suites count the statements a store executes; only the wire shows how often it waited."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from adapters import services
from adapters.wire import Wire
from tesserix_adk import Agent, AgentRunner, ScriptedProvider, ScriptedTurn, tool
from tesserix_adk.adapters.postgres import open_postgres_stores

pytestmark = pytest.mark.postgres

T = "acme"


async def test_a_write_waits_once_alone_and_once_in_a_group_whose_commit_waits_once(
    pg_url: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    wire = Wire(monkeypatch, tmp_path)
    stores = open_postgres_stores(pg_url)
    try:
        await stores.create_schema()
        history = stores.history
        handle = await history.append(T, "warm", [b"{}"], fence=None, after=None)

        before = wire.waits()
        handle = await history.append(T, "warm", [b"{}"], fence=None, after=handle)
        assert wire.waits() - before == 1, "a write of its own"

        async with services.write_group(stores) as group:
            before = wire.waits()
            handle = await history.append(T, "grouped", [b"{}"], fence=None, after=None)
            assert wire.waits() - before == 1, "a group's first write (its BEGIN with it)"
            before = wire.waits()
            await history.append(T, "grouped", [b"{}"], fence=None, after=handle)
            assert wire.waits() - before == 1, "a group's next write"
            before = wire.waits()
            await group.commit()
            assert wire.waits() - before == 1, "the group's commit"
        assert len(await history.fetch(handle)) == 1
    finally:
        await stores.aclose()


def _turns(calls_per_turn: int, turns: int) -> list[Any]:
    script: list[Any] = [
        ScriptedTurn(calls=[("book", {"seat": f"{t}-{c}"}) for c in range(calls_per_turn)])
        for t in range(turns)
    ]
    return [*script, "done"]


async def _waits(url: str, wire: Wire, calls: int, turns: int, run_id: str) -> int:
    @tool
    def book(seat: str) -> str:
        return f"booked {seat}"

    stores = open_postgres_stores(url)
    try:
        await stores.create_schema()
        runner = AgentRunner.from_stores(
            ScriptedProvider(_turns(calls, turns)), stores, group_writes=True
        )
        before = wire.waits()
        run = await runner.run(
            Agent("w", "b", tools=[book], max_iterations=20), "go", tenant=T, run_id=run_id
        )
        assert run.status == "completed"
        return wire.waits() - before
    finally:
        await stores.aclose()


@pytest.mark.parametrize(("calls", "per_turn"), [(1, 7), (3, 13)])
async def test_a_grouped_turn_waits_once_per_write_and_its_commits_ride_with_the_last(
    pg_url: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, calls: int, per_turn: int
) -> None:
    """One call: the charge (its BEGIN with it), the check for a cancel asked while the
    model thought, the frontier with its transcript append (one message), and the claim
    with the COMMIT (4); the outcome, the next frontier with its append, and the cancel
    check with the COMMIT (3). Each further call: a check for a cancel asked while the
    calls before it were out, its claim with the outcome before it, the COMMIT with the
    claim (3). Before those checks (a cancel asked while the model thought, or while a
    turn's first call was out, did not stop the calls after it) the counts were 6 and 10; while each
    COMMIT went in a round trip of its own, 8 and 14; before the turn's last outcome
    committed with its frontier they were the same with one commit more; in a group of its
    own it cost one more (11 and 17), and the frontier's append and put one each (19
    before either)."""
    wire = Wire(monkeypatch, tmp_path)
    short = await _waits(pg_url, wire, calls, 2, "short")
    long = await _waits(pg_url, wire, calls, 6, "long")
    assert (long - short) / 4 == per_turn
