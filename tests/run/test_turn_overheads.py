"""What a turn costs the process beside its writes: counted, never timed."""

from __future__ import annotations

import typing
from pathlib import Path
from typing import Any

import pytest

from tesserix_adk import Agent, AgentRunner, ScriptedProvider, ScriptedTurn, tool
from tesserix_adk.stores.urls import open_stores


async def _protocol_checks(tmp_path: Path, turns: int, monkeypatch: pytest.MonkeyPatch) -> int:
    @tool
    def book(seat: str) -> str:
        return f"booked {seat}"

    script: list[Any] = [
        ScriptedTurn(calls=[("book", {"seat": str(t)})], cost_micros=5) for t in range(turns)
    ]
    stores = open_stores(f"sqlite:///{tmp_path / f'{turns}.sqlite3'}")
    await stores.create_schema()
    checks = 0
    # A runtime protocol check (``isinstance`` against a ``runtime_checkable`` protocol)
    # walks every member of the protocol: a few microseconds each.
    meta: Any = typing._ProtocolMeta  # type: ignore[attr-defined]
    checking = meta.__instancecheck__

    def counted(cls: Any, instance: Any) -> bool:
        nonlocal checks
        checks += 1
        return bool(checking(cls, instance))

    try:
        runner = AgentRunner.from_stores(
            ScriptedProvider([*script, "done"]), stores, group_writes=True
        )
        agent = Agent("g", "book", tools=[book], max_iterations=50)
        with monkeypatch.context() as patch:
            patch.setattr(meta, "__instancecheck__", counted)
            run = await runner.run(agent, "go", tenant="t", run_id="r")
        assert run.status == "completed"
    finally:
        await stores.aclose()
    return checks


async def test_a_turn_asks_no_store_what_it_offers_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A run asks once what its stores offer (write groups, a frontier written with its
    # transcript); its turns do not ask again (5 checks a turn before).
    short = await _protocol_checks(tmp_path, 2, monkeypatch)
    long = await _protocol_checks(tmp_path, 6, monkeypatch)
    assert long - short == 0
