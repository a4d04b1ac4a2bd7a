"""A tool's own key function that cannot make a key from what the model sent (it reads an
argument the model left out) refuses that call, as the tool's validation would: the model
is told "not sent" and asks again; the run and its frontier are kept. A key function that
fails on arguments the tool accepts is the tool's author's bug: a ``ConfigurationError``
naming the tool, nothing sent."""

from __future__ import annotations

from typing import Any

import pytest

from tesserix_adk import Agent, AgentRunner, RunStatus, ScriptedProvider, open_stores, tool
from tesserix_adk.errors import ConfigurationError
from tesserix_adk.messages import Role

T = "acme"


class Seeing(ScriptedProvider):
    """The scripted model, keeping every request it was sent."""

    def __init__(self, turns: list[Any]) -> None:
        super().__init__(turns)
        self.seen: list[Any] = []

    async def complete(self, request: Any) -> Any:
        self.seen.append(request)
        return await super().complete(request)


def _shop(charged: list[str], key: Any) -> Agent:
    @tool(key=key)
    def charge(order: str) -> str:
        """Charge an order."""
        charged.append(order)
        return f"charged {order}"

    return Agent("shop", "Charge.", [charge])


async def test_a_key_function_reading_an_argument_the_model_left_out_refuses_the_call() -> None:
    charged: list[str] = []
    agent = _shop(charged, lambda **kw: f"order-{kw['arguments']['order']}")
    model = Seeing([[("charge", {"ordr": "5"})], [("charge", {"order": "5"})], "done"])
    async with open_stores("memory://") as stores:
        run = await AgentRunner.from_stores(model, stores).run(agent, "go", tenant=T, run_id="r")
        assert run.status is RunStatus.completed
        told = [m.text for m in model.seen[1].messages if m.role is Role.tool]
        assert len(told) == 1 and told[0].startswith("not sent:"), told
        assert "invalid arguments for charge" in told[0]
        assert charged == ["5"]  # the second, whole call; the first never went out
        (record,) = await stores.idempotency.records(T, "r")
        assert record.key == "acme/order-5"


async def test_a_key_function_failing_on_arguments_the_tool_accepts_is_a_configuration_error() -> (
    None
):
    charged: list[str] = []

    def broken(**kw: Any) -> str:
        raise KeyError("customer")  # reads what the tool never takes

    agent = _shop(charged, broken)
    async with open_stores("memory://") as stores:
        runner = AgentRunner.from_stores(ScriptedProvider([[("charge", {"order": "5"})]]), stores)
        with pytest.raises(ConfigurationError, match="charge") as raised:
            await runner.run(agent, "go", tenant=T, run_id="r")
        assert "key function" in str(raised.value)
    assert charged == []
