"""A business key two tools make alike (``order-5`` for a charge and for its refund): the
second tool's call finds the first tool's completed record. That outcome is no answer to
it, and its key is taken, so it is answered "not sent", saying why, and never sent; the
same after a crash before the turn's frontier (tests/test_attacks_newcomer_api.py found
the refund told "charged order 5")."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from run.helpers import Recording, at, faulty_runner, fresh_stores
from tesserix_adk import (
    Agent,
    AgentRunner,
    LeasePolicy,
    Role,
    RunStatus,
    ScriptedProvider,
    tool,
)
from tesserix_adk.testing.faults import SimulatedCrash

T = "acme"
TURNS: list[Any] = [[("charge", {"order": "5"})], [("refund", {"order": "5"})], "done"]


def _agent(sent: list[str]) -> Agent:
    def by_order(**kw: Any) -> str:
        return f"order-{kw['arguments']['order']}"

    @tool(key=by_order)
    def charge(order: str) -> str:
        """Charge an order."""
        sent.append(f"charge {order}")
        return f"charged order {order}"

    @tool(key=by_order)
    def refund(order: str) -> str:
        """Refund an order."""
        sent.append(f"refund {order}")
        return f"refunded order {order}"

    return Agent("shop", "Charge, then refund.", [charge, refund])


def _last_told(model: Recording) -> list[Any]:
    return [(m.text, m.is_error) for m in model.requests[-1].messages if m.role is Role.tool]


@pytest.mark.parametrize("backend", ["sqlite", pytest.param("redis", marks=pytest.mark.redis)])
async def test_a_call_whose_key_another_tool_took_is_answered_not_sent(
    backend: str, tmp_path: Path
) -> None:
    sent: list[str] = []
    async with fresh_stores(backend, tmp_path) as stores:
        model = Recording(ScriptedProvider(TURNS))
        run = await AgentRunner.from_stores(model, stores).run(
            _agent(sent), "go", tenant=T, run_id="r"
        )
        assert run.status is RunStatus.completed
        assert sent == ["charge 5"]
        charged, refund = _last_told(model)
        assert charged == ("charged order 5", False)
        assert refund[1] and refund[0].startswith("not sent") and "charge" in refund[0]
        # One record under the key, the charge's: the refusal is kept nowhere but the run.
        (record,) = await stores.idempotency.records(T, "r")
        assert record.tool == "charge"


async def test_after_a_crash_before_the_turns_frontier_the_resume_answers_alike(
    tmp_path: Path,
) -> None:
    sent: list[str] = []
    async with fresh_stores("sqlite", tmp_path) as stores:
        crashing = faulty_runner(
            stores, ScriptedProvider(TURNS), crash_before=at("after_tool_result", 1)
        )
        with pytest.raises(SimulatedCrash):
            await crashing.run(_agent(sent), "go", tenant=T, run_id="r")
        model = Recording(ScriptedProvider(TURNS))
        runner = AgentRunner.from_stores(
            model, stores, lease_policy=LeasePolicy(ttl=0.2, renew_within=0.1)
        )
        run = await runner.resume(_agent(sent), "r", tenant=T)
        assert run.status is RunStatus.completed
        assert sent == ["charge 5"]
        refund = _last_told(model)[-1]
        assert refund[1] and refund[0].startswith("not sent")
