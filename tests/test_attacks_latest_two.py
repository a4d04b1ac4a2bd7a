"""Attacks on the two newest commits: the key-owner rule by the turn's tools (a7ce85b) and
the work indexes listing past damage (54ff6a2).

Defects (strict xfails):

* A Temporal call activity builds its ``RunState`` with no messages, so
  ``dispatch._turn_tools`` finds no assistant message and takes the turn to have asked for
  no tool: a charge and a refund keyed alike (``order-5``) in ONE turn, under distinct call
  ids, make the refund's activity raise ``CheckpointCorruptError`` ("the store holds a
  damaged row") once the charge ran, where the kit's own runner answers it "not sent"
  (and before a7ce85b the activity did too).
* Redis ``work_items.lua`` passes over a member whose hash lacks tenant, run_id and state
  even when the hash still holds its other fields: that run's damaged entry is neither
  listed nor named, so a never-started run vanishes from ``tesserix runs``.

Held: the kit's own runner answers a refund keyed like the turn's charge "not sent".
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from run.helpers import Recording
from tesserix_adk import (
    Agent,
    AgentRunner,
    LeasePolicy,
    Role,
    RunStatus,
    ScriptedProvider,
    Stores,
    open_stores,
    tool,
)
from tesserix_adk.temporal import steps
from tesserix_adk.temporal.shapes import ModelStep, StepKind, ToolInput

T = "acme"


def _by_order(**kw: Any) -> str:
    return f"order-{kw['arguments']['order']}"


def _shop(sent: list[str]) -> Agent:
    @tool(key=_by_order)
    def charge(order: str) -> str:
        """Charge an order."""
        sent.append(f"charge {order}")
        return f"charged order {order}"

    @tool(key=_by_order)
    def refund(order: str) -> str:
        """Refund an order."""
        sent.append(f"refund {order}")
        return f"refunded order {order}"

    return Agent("shop", "Shop.", [charge, refund])


async def _stores(tmp_path: Path) -> Stores:
    stores = open_stores(f"sqlite:///{tmp_path / 'adk.sqlite3'}")
    await stores.create_schema()
    return stores


def _runner(stores: Stores, turns: list[Any]) -> AgentRunner:
    return AgentRunner.from_stores(
        ScriptedProvider(turns),
        stores,
        lease_policy=LeasePolicy(ttl=2.0, renew_within=1.0),
        never_ran_margin=0.05,
    )


_TURN = [[("charge", {"order": "5"}), ("refund", {"order": "5"})], "done"]


async def test_the_runner_answers_a_refund_keyed_like_a_charge_not_sent(tmp_path: Path) -> None:
    """Baseline: in the kit's own runner the refund is "not sent", the run completes."""
    stores = await _stores(tmp_path)
    try:
        sent: list[str] = []
        model = Recording(ScriptedProvider(_TURN))
        runner = AgentRunner.from_stores(model, stores)
        run = await runner.run(_shop(sent), "go", tenant=T, run_id="r")
        assert run.status is RunStatus.completed
        assert sent == ["charge 5"]
        told = [m for m in model.requests[-1].messages if m.role is Role.tool]
        assert [m.is_error for m in told] == [False, True]
        assert "not sent" in str(told[1].content)
    finally:
        await stores.aclose()


async def test_a_temporal_refund_keyed_like_a_charge_of_its_turn_is_not_sent(
    tmp_path: Path,
) -> None:
    stores = await _stores(tmp_path)
    try:
        sent: list[str] = []
        agent = _shop(sent)
        runner = _runner(stores, _TURN)
        step = ModelStep(
            tenant=T,
            run_id="r",
            agent_name=agent.name,
            agent_revision=agent.revision,
            iteration=0,
            input="go",
        )
        turn = await steps.model_turn(runner, agent, step, "model-attempt-1")
        assert turn.kind is StepKind.calls, turn
        calls = [
            ToolInput(
                tenant=T,
                run_id="r",
                agent_name=agent.name,
                agent_revision=agent.revision,
                iteration=0,
                call_id=ref.call_id,
                position=i,
            )
            for i, ref in enumerate(turn.calls)
        ]
        assert len({c.call_id for c in calls}) == 2
        charged = await steps.tool_call(runner, agent, calls[0], "tool-1", retried=False)
        assert sent == ["charge 5"]
        assert not charged.is_error
        refunded = await steps.tool_call(runner, agent, calls[1], "tool-2", retried=False)
        assert sent == ["charge 5"]
        assert refunded.is_error
        assert "not sent" in (refunded.content or "")
    finally:
        await stores.aclose()


@pytest.mark.redis
async def test_a_redis_entry_that_lost_its_names_and_state_is_still_named(
    tmp_path: Path,
) -> None:
    from test_attacks_damaged_views import runs_json
    from test_attacks_waking_others import rig

    async with rig("redis", tmp_path) as r:
        await r.submit("fresh-bad", "book:k4")
        await r.submit("fresh-ok", "book:k5")
        work = r.stores.work
        await work._client.hdel(work._entry(T, "fresh-bad"), "tenant", "run_id", "state")
        assert await work._client.hlen(work._entry(T, "fresh-bad")) > 0
        rows, out = await runs_json(r)
        assert "fresh-ok" in out
        assert "fresh-bad" in out, rows
