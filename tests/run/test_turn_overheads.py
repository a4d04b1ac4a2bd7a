"""What a turn costs the process beside its writes: counted, never timed."""

from __future__ import annotations

import typing
from pathlib import Path
from typing import Any

import pytest

from tesserix_adk import Agent, AgentRunner, ScriptedProvider, ScriptedTurn, tool
from tesserix_adk.checkpoint import checkpointer as checkpointer_module
from tesserix_adk.checkpoint.checkpointer import Checkpointer
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


async def test_a_frontier_is_weighed_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Whether a frontier is encoded off the event loop is decided by weighing its fresh
    # content; a grouped run asked it twice a frontier (the runner, then the Checkpointer).
    counts = {"weighed": 0, "written": 0}
    weight, write = checkpointer_module._weight, Checkpointer.write

    def weighing(*args: Any) -> int:
        counts["weighed"] += 1
        return weight(*args)

    async def writing(self: Checkpointer, *args: Any, **kwargs: Any) -> bool:
        counts["written"] += 1
        return await write(self, *args, **kwargs)

    monkeypatch.setattr(checkpointer_module, "_weight", weighing)
    monkeypatch.setattr(Checkpointer, "write", writing)
    await _protocol_checks(tmp_path, 3, monkeypatch)  # asserts the run completed
    assert counts["written"] == 7  # two a turn, and the final one
    assert counts["weighed"] == counts["written"]
