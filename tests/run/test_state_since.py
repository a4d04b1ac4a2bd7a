"""A resume restores what a completed call's tool wrote into ``ctx.state`` after the last
frontier (``run.resume.state_since``): the call is replayed from its record, which keeps
the run's state as it stood when the call completed. Only the run's own completions count:
a business key another run completed holds that run's state."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pydantic
import pytest

from run.helpers import at, faulty_runner, fresh_stores
from tesserix_adk import Agent, AgentRunner, Resumer, ScriptedProvider, ToolContext, tool
from tesserix_adk.checkpoint.payload import outcome_state, record_tag
from tesserix_adk.errors import StateRedactedError
from tesserix_adk.testing.faults import SimulatedCrash

T = "acme"


class Basket(pydantic.BaseModel):
    items: list[str] = []


def _agent(ran: list[tuple[str, list[str]]], key: Any = None) -> Agent:
    def add(item: str, ctx: ToolContext) -> str:
        """Add an item (a side effect)."""
        ran.append((item, list(ctx.state.items)))
        ctx.state.items.append(item)
        return f"added {item}"

    # The default key (the run's own) unless a business key is given.
    made = tool(add) if key is None else tool(key=key)(add)
    return Agent("basket", "Fill it.", [made], state_schema=Basket)


async def _final_state(runner: AgentRunner, run_id: str) -> Any:
    assert runner.checkpoints is not None
    latest = await runner.checkpoints.latest(T, run_id)
    assert latest is not None and str(latest.status) == "completed"
    return latest.state


TURNS = [[("add", {"item": "a"})], [("add", {"item": "b"})], "done"]


@pytest.mark.parametrize("where", ["memory", "sqlite"])
async def test_a_resume_restores_the_state_a_completed_calls_tool_left(
    where: str, tmp_path: Path
) -> None:
    ran: list[tuple[str, list[str]]] = []
    agent = _agent(ran)
    async with fresh_stores(where, tmp_path) as stores:
        crashing = faulty_runner(
            stores, ScriptedProvider(TURNS), crash_before=at("after_tool_result", 0)
        )
        with pytest.raises(SimulatedCrash):
            await crashing.run(agent, "go", tenant=T, run_id="r", state=Basket())
        records = [r for r in await stores.idempotency.records(T, "r") if r.tool == "add"]
        [record] = records
        assert record is not None and record.outcome is not None
        kept = outcome_state(bytes(record.outcome), record=record_tag(T, record.key))
        assert kept is not None and kept.state == {"items": ["a"]}
        again = AgentRunner.from_stores(ScriptedProvider(TURNS), stores)
        await again.resume(agent, "r", tenant=T)
        assert await _final_state(again, "r") == {"items": ["a", "b"]}
    # "a" ran once; "b" was handed the state "a" left.
    assert ran == [("a", []), ("b", ["a"])]


async def test_another_runs_completion_under_a_shared_key_does_not_become_this_runs_state(
    tmp_path: Path,
) -> None:
    ran: list[tuple[str, list[str]]] = []
    agent = _agent(ran, key=lambda **kw: f"order-{kw['arguments']['item']}")
    async with fresh_stores("sqlite", tmp_path) as stores:
        first = AgentRunner.from_stores(ScriptedProvider([TURNS[0], "done"]), stores)
        await first.run(agent, "go", tenant=T, run_id="other", state=Basket(items=["x"]))
        crashing = faulty_runner(
            stores, ScriptedProvider(TURNS), crash_before=at("after_tool_result", 0)
        )
        with pytest.raises(SimulatedCrash):
            await crashing.run(agent, "go", tenant=T, run_id="mine", state=Basket(items=["m"]))
        again = AgentRunner.from_stores(ScriptedProvider(TURNS), stores)
        await again.resume(agent, "mine", tenant=T)
        # "a" was the other run's call (replayed here, never run); its state is not ours.
        assert await _final_state(again, "mine") == {"items": ["m", "b"]}
    assert ran == [("a", ["x"]), ("b", ["m"])]


@pytest.mark.parametrize("where", ["memory", "sqlite"])
async def test_the_resumer_hands_a_driver_the_state_a_completed_calls_tool_left(
    where: str, tmp_path: Path
) -> None:
    """A driver of its own (``Resumer``) is handed the same state a runner's resume
    restores: ``CarriedRun.state``, not only the frontier's."""
    ran: list[tuple[str, list[str]]] = []
    agent = _agent(ran)
    async with fresh_stores(where, tmp_path) as stores:
        crashing = faulty_runner(
            stores, ScriptedProvider(TURNS), crash_before=at("after_tool_result", 0)
        )
        with pytest.raises(SimulatedCrash):
            await crashing.run(agent, "go", tenant=T, run_id="r", state=Basket())
        carried = await Resumer.from_stores(stores).resume("r", tenant=T, worker="mine")
        await stores.leases.release(carried.lease)
    assert carried.checkpoint.state == {"items": []}  # the frontier's, before "a" ran
    assert carried.state == {"items": ["a"]}
    assert ran == [("a", [])]


async def test_the_resumer_refuses_a_kept_state_that_lost_a_secret(tmp_path: Path) -> None:
    class Holder(pydantic.BaseModel):
        token: str = ""

    @tool
    def login(ctx: ToolContext) -> str:
        """Log in (a side effect): keeps a token in the state."""
        ctx.state.token = "ghp_" + "a1B2c3D4e5F6g7H8i9J0k1L2m3N4o5P6q7R8"
        return "logged in"

    agent = Agent("holder", "Log in.", [login], state_schema=Holder)
    script = [[("login", {})], "done"]
    async with fresh_stores("sqlite", tmp_path) as stores:
        crashing = faulty_runner(
            stores, ScriptedProvider(script), crash_before=at("after_tool_result", 0)
        )
        with pytest.raises(SimulatedCrash):
            await crashing.run(agent, "go", tenant=T, run_id="r", state=Holder())
        with pytest.raises(StateRedactedError):
            await Resumer.from_stores(stores).resume("r", tenant=T, worker="mine")
        # The lease was handed back: the next taker is not kept waiting.
        assert await stores.leases.current(T, "r") is None
