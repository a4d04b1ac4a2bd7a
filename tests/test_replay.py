"""Replay from a step, with stubs: the debugger's verb, never a second real execution."""

from __future__ import annotations

from typing import Any

import pytest

from tesserix_adk import (
    Agent,
    AgentRunner,
    Boundary,
    CheckpointCorruptError,
    Checkpointer,
    CheckpointPolicy,
    ConfigurationError,
    MemoryCheckpointStore,
    MemoryHistoryStore,
    MemoryIdempotencyStore,
    NoCheckpointError,
    RunStatus,
    ScriptedProvider,
    ToolContext,
    tool,
)
from tesserix_adk.checkpoint.payload import decode_outcome

REFUND_TURNS: list[Any] = [
    [("lookup_order", {"order": "o-1"})],
    [("lookup_payment", {"order": "o-1"})],
    [("check_policy", {"order": "o-1"})],
    [("refund", {"order": "o-1", "amount": 40})],
    "Refunded 40 on o-1.",
]


class Shop:
    def __init__(self) -> None:
        self.refunds: list[str] = []
        self.lookups = 0

    def agent(self) -> Agent:
        @tool(side_effects=False)
        def lookup_order(order: str, ctx: ToolContext) -> dict[str, Any]:
            """Read an order."""
            self.lookups += 1
            ctx.state["phase"] = "gathered"
            return {"order": order, "total": 40}

        @tool(side_effects=False)
        def lookup_payment(order: str) -> dict[str, str]:
            """Read a payment."""
            return {"order": order, "card": "visa"}

        @tool(side_effects=False)
        def check_policy(order: str) -> bool:
            """May it be refunded?"""
            return True

        @tool
        def refund(order: str, amount: int) -> dict[str, Any]:
            """Refund money (the real thing)."""
            self.refunds.append(order)
            return {"refunded": amount, "order": order}

        return Agent(
            "refunds",
            "Refund when policy allows.",
            [lookup_order, lookup_payment, check_policy, refund],
        )


class World:
    def __init__(self, keep_last: int | None = None) -> None:
        self.store = MemoryCheckpointStore(keep_last=keep_last)
        self.history = MemoryHistoryStore()
        self.idempotency = MemoryIdempotencyStore()
        self.checkpointer = Checkpointer(
            self.store,
            history=self.history,
            policy=CheckpointPolicy(boundaries=frozenset({Boundary.after_model_call})),
        )
        self.provider = ScriptedProvider(REFUND_TURNS)

    def runner(self) -> AgentRunner:
        return AgentRunner(
            self.provider, idempotency=self.idempotency, checkpoints=self.checkpointer
        )

    async def original_bytes(self, run_id: str) -> list[Any]:
        latest = await self.store.latest("acme", run_id)
        steps = await self.store.steps("acme", run_id)
        snaps = [await self.store.at("acme", run_id, s) for s in steps]
        records = await self.idempotency.records("acme", run_id)
        cp = await self.checkpointer.latest("acme", run_id)
        assert cp is not None and cp.history_handle is not None
        return [latest, steps, snaps, records, await self.history.fetch(cp.history_handle)]


async def _five_steps(world: World, shop: Shop) -> None:
    run = await world.runner().run(
        shop.agent(), "refund o-1", tenant="acme", run_id="r", state={"phase": "start"}
    )
    assert run.status is RunStatus.completed
    assert await world.store.steps("acme", "r") == [1, 2, 3, 4, 5]
    assert shop.refunds == ["o-1"]


async def test_replay_from_step_4_with_refund_stubbed_never_touches_the_original() -> None:
    world, shop = World(), Shop()
    await _five_steps(world, shop)
    before = await world.original_bytes("r")
    stubbed: list[dict[str, Any]] = []

    def fake_refund(order: str, amount: int) -> dict[str, Any]:
        stubbed.append({"order": order, "amount": amount})
        return {"ok": True}

    run = await world.runner().replay(
        shop.agent(), "r", tenant="acme", from_step=4, stubs={"refund": fake_refund}
    )
    assert run.status is RunStatus.completed
    assert shop.refunds == ["o-1"]  # the real refund ran once, in the original run only
    assert stubbed == [{"order": "o-1", "amount": 40}]
    assert run.run_id != "r" and run.replay_of == "r@4"
    assert await world.original_bytes("r") == before
    replayed = await world.checkpointer.latest("acme", run.run_id)
    assert replayed is not None and replayed.replay_of == "r@4"
    records = await world.idempotency.records("acme", run.run_id)
    outcome = next(r.outcome for r in records if r.tool == "refund")
    assert outcome is not None and b'"stub":true' in outcome


async def test_non_dict_stub_results_are_wrapped_and_marked() -> None:
    world, shop = World(), Shop()
    await _five_steps(world, shop)
    run = await world.runner().replay(
        shop.agent(),
        "r",
        tenant="acme",
        from_step=4,
        stubs={"refund": lambda **_: "done"},
        new_run_id="dbg-1",
    )
    records = await world.idempotency.records("acme", run.run_id)
    outcome = next(r.outcome for r in records if r.tool == "refund")
    assert outcome is not None
    replayed = decode_outcome(outcome, "x")
    assert replayed.content == {"stub": True, "value": "done"}
    assert not replayed.is_error


async def test_replay_without_a_stub_for_refund_is_refused_before_anything_runs() -> None:
    world, shop = World(), Shop()
    await _five_steps(world, shop)
    calls, lookups = world.provider.calls, shop.lookups
    with pytest.raises(ConfigurationError, match="refund"):
        await world.runner().replay(shop.agent(), "r", tenant="acme", from_step=1, stubs={})
    assert (world.provider.calls, shop.lookups, shop.refunds) == (calls, lookups, ["o-1"])
    assert await world.store.runs("acme") == ["r"]


async def test_live_lets_a_named_tool_run_for_real() -> None:
    world, shop = World(), Shop()
    await _five_steps(world, shop)
    await world.runner().replay(
        shop.agent(), "r", tenant="acme", from_step=4, stubs={}, live=("refund",)
    )
    assert shop.refunds == ["o-1", "o-1"]


async def test_missing_step_is_none_and_replay_from_it_fails() -> None:
    world, shop = World(), Shop()
    await _five_steps(world, shop)
    assert await world.checkpointer.at("acme", "r", 9) is None
    with pytest.raises(NoCheckpointError):
        await world.runner().replay(
            shop.agent(), "r", tenant="acme", from_step=9, stubs={"refund": lambda **_: {}}
        )


async def test_corrupted_step_fails_closed() -> None:
    world, shop = World(), Shop()
    await _five_steps(world, shop)
    # A torn write of step 4 (last write under a step wins, so it replaces the snapshot).
    await world.store.put("acme", "r", b'{"format": 1, "tenant"', step=4)
    with pytest.raises(CheckpointCorruptError):
        await world.checkpointer.at("acme", "r", 4)
    with pytest.raises(CheckpointCorruptError):
        await world.runner().replay(
            shop.agent(), "r", tenant="acme", from_step=4, stubs={"refund": lambda **_: {}}
        )


async def test_mutating_state_after_a_checkpoint_never_changes_the_stored_step() -> None:
    world, shop = World(), Shop()
    state = {"phase": "start", "facts": ["a"]}
    await world.runner().run(shop.agent(), "refund o-1", tenant="acme", run_id="r", state=state)
    first = await world.checkpointer.at("acme", "r", 1)
    assert first is not None and first.state == {"phase": "start", "facts": ["a"]}
    second = await world.checkpointer.at("acme", "r", 2)
    assert second is not None and second.state["phase"] == "gathered"
    state["facts"].append("b")  # the caller's object, after the fact
    first.state["phase"] = "tampered"  # a loaded copy
    again = await world.checkpointer.at("acme", "r", 1)
    assert again is not None and again.state == {"phase": "start", "facts": ["a"]}


async def test_keep_last_keeps_three_steps_and_the_newest_frontier() -> None:
    world, shop = World(keep_last=3), Shop()
    await world.runner().run(shop.agent(), "refund o-1", tenant="acme", run_id="r")
    assert await world.store.steps("acme", "r") == [3, 4, 5]
    latest = await world.checkpointer.latest("acme", "r")
    assert latest is not None and latest.step == 5
    assert await world.checkpointer.at("acme", "r", 2) is None


async def test_snapshots_carry_state_observation_and_steps_used() -> None:
    world, shop = World(), Shop()
    await _five_steps(world, shop)
    snap = await world.checkpointer.at("acme", "r", 4)
    assert snap is not None
    assert snap.steps_used == 4 and snap.iteration == 3
    assert snap.observation == [
        {"call_id": "call_2_0", "tool": "check_policy", "content": True, "is_error": False}
    ]
    assert snap.state == {"phase": "gathered"}


async def test_replay_never_takes_over_a_run_that_exists() -> None:
    world, shop = World(), Shop()
    await _five_steps(world, shop)
    await world.runner().run(shop.agent(), "refund o-1", tenant="acme", run_id="other")
    before = await world.original_bytes("other")
    with pytest.raises(ConfigurationError, match="already exists"):
        await world.runner().replay(
            shop.agent(),
            "r",
            tenant="acme",
            from_step=4,
            stubs={"refund": lambda **_: {}},
            new_run_id="other",
        )
    assert await world.original_bytes("other") == before


async def test_a_step_whose_call_arguments_were_redacted_must_be_stubbed() -> None:
    world = World()
    turns = [[("refund", {"order": "o-1", "amount": 40, "token": "abc"})], "done"]

    @tool(side_effects=False)
    def refund(order: str, amount: int, token: str) -> str:
        """A live tool would get the masked token."""
        return token

    agent = Agent("masked", "i", [refund])
    runner = AgentRunner(
        ScriptedProvider(turns), idempotency=world.idempotency, checkpoints=world.checkpointer
    )
    await runner.run(agent, "go", tenant="acme", run_id="m")
    step = await world.checkpointer.at("acme", "m", 1)
    assert step is not None and step.outstanding[0].redacted
    with pytest.raises(ConfigurationError, match="redacted"):
        await runner.replay(agent, "m", tenant="acme", from_step=1, stubs={})
    run = await runner.replay(
        agent, "m", tenant="acme", from_step=1, stubs={"refund": lambda **_: "stubbed"}
    )
    assert run.status is RunStatus.completed
