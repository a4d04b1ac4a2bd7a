"""Attacks on restoring ``ctx.state`` from the run's last completion since the frontier
(``run.resume.state_since``, outcome format 4): an oracle of a run whose tools append to and
overwrite the state, crashed at frontiers and resumed (twice in a row too), against what
the tools are handed; business keys a later turn of the same run reuses; completions whose
store clock ties; a call in flight beside one that completed, later said never to have run;
a result too large to keep; what ``tesserix show`` reads of a format-4 outcome.

Found and fixed (their tests pass now): a business key this run completed in an earlier
turn and asked for again rolled the state back to that turn's snapshot (only the frontier's
turn or later counts now); completions whose store clock tied kept the earlier call's
snapshot (ties go to the later turn, then the later call). Left, a strict xfail and a limit
README names: a side-effecting call in flight beside one that completed leaves its half-done
change in that call's snapshot, so resolved never-ran and sent again, its change is applied
twice.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path
from typing import Any

import pydantic
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from run.helpers import at, faulty_runner, fresh_stores
from tesserix_adk import Agent, AgentRunner, LeasePolicy, ScriptedProvider, ToolContext, tool
from tesserix_adk.checkpoint.payload import encode_outcome, outcome_state, record_tag
from tesserix_adk.checkpoint.payload.outcomes import STATE_FORMAT, _body
from tesserix_adk.cli.show import story
from tesserix_adk.errors import IndeterminateToolCallError
from tesserix_adk.messages import ToolOutcome
from tesserix_adk.stores.memory.idempotency import MemoryIdempotencyStore
from tesserix_adk.stores.urls import open_stores
from tesserix_adk.testing.faults import SimulatedCrash

T = "acme"


class Cart(pydantic.BaseModel):
    items: list[str] = []
    note: str = ""


async def _final(runner: AgentRunner, run_id: str) -> Any:
    assert runner.checkpoints is not None
    latest = await runner.checkpoints.latest(T, run_id)
    assert latest is not None and str(latest.status) == "completed"
    return latest.state


def _tools(seen: list[tuple[str, str, dict[str, Any]]], *, business_key: bool = False) -> list:
    def add(item: str, ctx: ToolContext) -> str:
        """Append an item (a side effect)."""
        seen.append(("add", item, ctx.state.model_dump()))
        ctx.state.items.append(item)
        return f"added {item}"

    def note(text: str, ctx: ToolContext) -> str:
        """Overwrite the note (a side effect)."""
        seen.append(("note", text, ctx.state.model_dump()))
        ctx.state.note = text
        return f"noted {text}"

    def look(ctx: ToolContext) -> str:
        """Read the state (no side effects)."""
        seen.append(("look", "", ctx.state.model_dump()))
        return f"{len(ctx.state.items)} items"

    keyed = tool(key=lambda **kw: f"order-{kw['arguments']['item']}") if business_key else tool
    return [keyed(add), tool(note), tool(side_effects=False)(look)]


def _apply(state: dict[str, Any], name: str, arg: str) -> None:
    if name == "add":
        state["items"].append(arg)
    elif name == "note":
        state["note"] = arg


def _call(name: str, arg: str) -> tuple[str, dict[str, Any]]:
    return (
        name,
        {"item": arg} if name == "add" else {"text": arg} if name == "note" else {},
    )


# -- the oracle -------------------------------------------------------------------------

OPS = st.sampled_from([("add", "x"), ("add", "y"), ("note", "n1"), ("note", "n2"), ("look", "")])


@settings(
    max_examples=6,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    turns=st.lists(st.lists(OPS, min_size=1, max_size=3), min_size=1, max_size=3),
    crashes=st.lists(st.integers(0, 2), min_size=0, max_size=1),
    parallel=st.sampled_from([1, 3]),
)
def test_the_state_a_tool_sees_after_resumes_is_the_oracles(
    turns: list[list[tuple[str, str]]], crashes: list[int], parallel: int
) -> None:
    """Each call (its own default key) changes the state once: through a crash before an
    ``after_tool_result`` frontier (or none), every tool is handed the state the calls
    before it left, and the run ends with every change applied once."""

    async def scenario() -> None:
        seen: list[tuple[str, str, dict[str, Any]]] = []
        agent = Agent(
            "cart", "Fill it.", _tools(seen), state_schema=Cart, parallel_tool_calls=parallel
        )
        script = [[_call(n, a) for n, a in turn] for turn in turns] + ["done"]
        async with open_stores("memory://") as stores:
            await stores.create_schema()
            first = True
            for crash in sorted(set(crashes)):
                if crash >= len(turns):
                    continue
                crashing = faulty_runner(
                    stores, ScriptedProvider(script), crash_before=at("after_tool_result", crash)
                )
                with pytest.raises(SimulatedCrash):
                    if first:
                        await crashing.run(agent, "go", tenant=T, run_id="r", state=Cart())
                    else:
                        await crashing.resume(agent, "r", tenant=T)
                first = False
            runner = AgentRunner.from_stores(ScriptedProvider(script), stores)
            if first:
                await runner.run(agent, "go", tenant=T, run_id="r", state=Cart())
            else:
                await runner.resume(agent, "r", tenant=T)
            final = await _final(runner, "r")
        oracle: dict[str, Any] = {"items": [], "note": ""}
        for turn in turns:
            for name, arg in turn:
                _apply(oracle, name, arg)
        assert final == oracle
        # A side-effecting call ran once; each one was handed a state holding every change
        # of the turns before its own (within a turn, parallel calls may see each other's).
        ran = [(n, a) for n, a, _ in seen if n != "look"]
        assert ran == [(n, a) for turn in turns for n, a in turn if n != "look"]
        before: dict[str, Any] = {"items": [], "note": ""}
        position = 0
        for turn in turns:
            for name, _arg in turn:
                if name == "look":
                    continue
                _, _, handed = [s for s in seen if s[0] != "look"][position]
                position += 1
                assert handed["items"][: len(before["items"])] == before["items"]
            for name, arg in turn:
                _apply(before, name, arg)

    asyncio.run(scenario())


# -- defects ----------------------------------------------------------------------------


async def test_a_business_key_replayed_in_a_later_turn_never_rolls_the_state_back(
    tmp_path: Path,
) -> None:
    seen: list[tuple[str, str, dict[str, Any]]] = []
    agent = Agent("cart", "Fill it.", _tools(seen, business_key=True), state_schema=Cart)
    script = [
        [("add", {"item": "a"})],
        [("note", {"text": "paid"})],
        [("add", {"item": "a"})],  # the same order again: replayed from turn 0's record
        [("note", {"text": "shipped"})],
        "done",
    ]
    async with fresh_stores("sqlite", tmp_path) as stores:
        crashing = faulty_runner(
            stores, ScriptedProvider(script), crash_before=at("after_tool_result", 2)
        )
        with pytest.raises(SimulatedCrash):
            await crashing.run(agent, "go", tenant=T, run_id="r", state=Cart())
        assert crashing.checkpoints is not None
        frontier = await crashing.checkpoints.latest(T, "r")
        assert frontier is not None and frontier.state == {"items": ["a"], "note": "paid"}
        again = AgentRunner.from_stores(ScriptedProvider(script), stores)
        await again.resume(agent, "r", tenant=T)
        final = await _final(again, "r")
    # The last tool must be handed the note "paid" the second turn wrote.
    assert seen[-1] == ("note", "shipped", {"items": ["a"], "note": "paid"})
    assert final == {"items": ["a"], "note": "shipped"}


async def test_completions_with_tied_clocks_never_lose_the_later_calls_change() -> None:
    seen: list[tuple[str, str, dict[str, Any]]] = []
    agent = Agent("cart", "Fill it.", _tools(seen), state_schema=Cart)
    script = [[("add", {"item": "a"}), ("add", {"item": "b"})], [("add", {"item": "c"})], "done"]
    async with open_stores("memory://") as opened:
        await opened.create_schema()

        def coarse() -> float:  # a store clock of 100-second resolution
            return float(int(time.time()) // 100 * 100)

        stores = dataclasses.replace(opened, idempotency=MemoryIdempotencyStore(clock=coarse))
        crashing = faulty_runner(
            stores, ScriptedProvider(script), crash_before=at("after_tool_result", 0)
        )
        with pytest.raises(SimulatedCrash):
            await crashing.run(agent, "go", tenant=T, run_id="r", state=Cart())
        done = [r for r in await stores.idempotency.records(T, "r") if r.tool == "add"]
        assert len({r.completed_at for r in done}) == 1  # the tie this test is about
        again = AgentRunner.from_stores(ScriptedProvider(script), stores)
        await again.resume(agent, "r", tenant=T)
        final = await _final(again, "r")
    assert seen[-1] == ("add", "c", {"items": ["a", "b"], "note": ""})
    assert final["items"] == ["a", "b", "c"]


@pytest.mark.xfail(
    strict=True,
    reason="DEFECT MEDIUM (a limit README names): a side-effecting call in flight beside one "
    "that completed leaves its half-done change in that call's snapshot; resolved "
    "--never-ran and sent again, its change is applied twice",
)
async def test_a_call_said_never_to_have_run_leaves_no_change_in_the_state(
    tmp_path: Path,
) -> None:
    sent: list[str] = []
    dies = [True]

    @tool
    async def book(item: str, ctx: ToolContext) -> str:
        """Book (a side effect)."""
        sent.append(item)
        ctx.state.items.append(item)
        await asyncio.sleep(0.05)
        if dies[0]:
            dies[0] = False
            raise SimulatedCrash("the process dies with the booking in hand")
        return f"booked {item}"

    @tool
    async def add(item: str, ctx: ToolContext) -> str:
        """Append (a side effect)."""
        ctx.state.items.append(item)
        return f"added {item}"

    agent = Agent("cart", "Fill it.", [book, add], state_schema=Cart, parallel_tool_calls=2)
    script = [[("book", {"item": "b"}), ("add", {"item": "a"})], "done"]
    async with fresh_stores("sqlite", tmp_path) as stores:
        first = AgentRunner.from_stores(ScriptedProvider(script), stores)
        with pytest.raises(SimulatedCrash):
            await first.run(agent, "go", tenant=T, run_id="r", state=Cart())
        records = {r.tool: r for r in await stores.idempotency.records(T, "r") if r.tool}
        assert str(records["add"].status) == "completed"
        assert str(records["book"].status) == "in_flight"
        again = AgentRunner.from_stores(ScriptedProvider(script), stores)
        with pytest.raises(IndeterminateToolCallError):
            await again.resume(agent, "r", tenant=T)
        # The operator checks the booking system: nothing was booked.
        await stores.idempotency.resolve(records["book"].key, tenant=T, never_ran=True, by="op")
        last = AgentRunner.from_stores(ScriptedProvider(script), stores)
        await last.resume(agent, "r", tenant=T)
        final = await _final(last, "r")
    assert sent == ["b", "b"]  # sent again, as the operator said it never ran
    assert sorted(final["items"]) == ["a", "b"]


# -- what holds -------------------------------------------------------------------------


async def test_another_runs_completion_in_the_same_turn_never_wins_over_ours(
    tmp_path: Path,
) -> None:
    """A turn replays another run's completed order (later by the clock than ours) beside
    a call of its own: the state is this run's own last completion."""
    seen: list[tuple[str, str, dict[str, Any]]] = []
    agent = Agent("cart", "Fill it.", _tools(seen, business_key=True), state_schema=Cart)
    async with fresh_stores("sqlite", tmp_path) as stores:
        mine = [[("note", {"text": "mine"}), ("add", {"item": "z"})], "done"]
        crashing = faulty_runner(
            stores, ScriptedProvider(mine), crash_before=at("after_tool_result", 0)
        )
        other = AgentRunner.from_stores(
            ScriptedProvider([[("add", {"item": "z"})], "done"]), stores
        )
        await other.run(agent, "go", tenant=T, run_id="other", state=Cart(items=["o"]))
        with pytest.raises(SimulatedCrash):
            await crashing.run(agent, "go", tenant=T, run_id="mine", state=Cart(items=["m"]))
        again = AgentRunner.from_stores(ScriptedProvider(mine), stores)
        await again.resume(agent, "mine", tenant=T)
        assert await _final(again, "mine") == {"items": ["m"], "note": "mine"}


async def test_a_result_too_large_to_keep_still_keeps_the_state(tmp_path: Path) -> None:
    seen: list[str] = []

    @tool
    def dump(ctx: ToolContext) -> str:
        """A huge answer (a side effect)."""
        seen.append("dump")
        ctx.state.note = "dumped"
        return "x" * 1_100_000

    agent = Agent("cart", "Fill it.", [dump], state_schema=Cart)
    script = [[("dump", {})], "done"]
    async with fresh_stores("sqlite", tmp_path) as stores:
        crashing = faulty_runner(
            stores, ScriptedProvider(script), crash_before=at("after_tool_result", 0)
        )
        with pytest.raises(SimulatedCrash):
            await crashing.run(agent, "go", tenant=T, run_id="r", state=Cart())
        [rec] = [r for r in await stores.idempotency.records(T, "r") if r.tool == "dump"]
        assert rec.outcome is not None
        body, fmt = _body(bytes(rec.outcome), record_tag(T, rec.key))
        assert fmt == STATE_FORMAT and "replaced" in body
        again = AgentRunner.from_stores(ScriptedProvider(script), stores)
        await again.resume(agent, "r", tenant=T)
        assert await _final(again, "r") == {"items": [], "note": "dumped"}
    assert seen == ["dump"]


async def test_a_call_resolved_by_hand_after_ours_leaves_our_snapshot(tmp_path: Path) -> None:
    """The last completion by the clock is one an operator recorded (no state): the
    snapshot of the call completed before it is restored, not the frontier's."""
    dies = [True]

    @tool
    async def book(item: str, ctx: ToolContext) -> str:
        """Book (a side effect)."""
        if dies[0]:
            dies[0] = False
            raise SimulatedCrash("dies before booking")
        return "booked"

    @tool
    async def add(item: str, ctx: ToolContext) -> str:
        """Append (a side effect)."""
        ctx.state.items.append(item)
        return "added"

    agent = Agent("cart", "Fill it.", [add, book], state_schema=Cart)
    script = [[("add", {"item": "a"}), ("book", {"item": "b"})], "done"]
    async with fresh_stores("sqlite", tmp_path) as stores:
        first = AgentRunner.from_stores(ScriptedProvider(script), stores)
        with pytest.raises(SimulatedCrash):
            await first.run(agent, "go", tenant=T, run_id="r", state=Cart())
        [booking] = [r for r in await stores.idempotency.records(T, "r") if r.tool == "book"]
        said = encode_outcome(
            ToolOutcome(call_id=booking.call_id or "", content="booked"),
            first.redactor,
            record=record_tag(T, booking.key),
        )
        await stores.idempotency.resolve(booking.key, said, tenant=T, by="op")
        again = AgentRunner.from_stores(ScriptedProvider(script), stores)
        await again.resume(agent, "r", tenant=T)
        assert await _final(again, "r") == {"items": ["a"], "note": ""}


async def test_show_reads_a_format_4_outcome_and_never_prints_its_state(
    tmp_path: Path,
) -> None:
    seen: list[tuple[str, str, dict[str, Any]]] = []
    agent = Agent("cart", "Fill it.", _tools(seen), state_schema=Cart)
    async with fresh_stores("sqlite", tmp_path) as stores:
        runner = AgentRunner.from_stores(
            ScriptedProvider([[("note", {"text": "kept-in-state-only"})], "done"]), stores
        )
        await runner.run(agent, "go", tenant=T, run_id="r", state=Cart())
        [rec] = [r for r in await stores.idempotency.records(T, "r") if r.tool == "note"]
        assert rec.outcome is not None
        kept = outcome_state(bytes(rec.outcome), record=record_tag(T, rec.key))
        assert kept is not None and kept.state["note"] == "kept-in-state-only"
        told = await story(stores, T, "r", step=None)
    [call] = [c for c in told["calls"] if c.get("tool") == "note"]
    assert call["outcome"] == "noted kept-in-state-only"
    assert "unreadable" not in str(call)


async def test_two_resumes_in_a_row_each_dying_keep_every_change_once(tmp_path: Path) -> None:
    """The run dies before turn 0's frontier, its resume dies before turn 1's, and a third
    process (after the dead one's claim lapsed) carries it to the end."""
    seen: list[tuple[str, str, dict[str, Any]]] = []
    agent = Agent("cart", "Fill it.", _tools(seen), state_schema=Cart)
    script = [[("add", {"item": "a"})], [("note", {"text": "n"})], [("add", {"item": "b"})]]
    script = [*script, "done"]
    short = LeasePolicy(ttl=0.4, renew_within=0.2)
    async with fresh_stores("sqlite", tmp_path) as stores:
        for boundary, step in (("after_tool_result", 0), ("after_tool_result", 1)):
            crashing = faulty_runner(
                stores,
                ScriptedProvider(script),
                crash_before=at(boundary, step),
                lease_policy=short,
            )
            crashing.resume_claim_ttl = 0.4  # a dead resumer's claim lapses soon
            with pytest.raises(SimulatedCrash):
                if step == 0:
                    await crashing.run(agent, "go", tenant=T, run_id="r", state=Cart())
                else:
                    await crashing.resume(agent, "r", tenant=T)
            await asyncio.sleep(0.5)  # the dead process's claim lapses
        last = AgentRunner.from_stores(ScriptedProvider(script), stores)
        await last.resume(agent, "r", tenant=T)
        assert await _final(last, "r") == {"items": ["a", "b"], "note": "n"}
    assert [(n, a) for n, a, _ in seen] == [("add", "a"), ("note", "n"), ("add", "b")]
    assert seen[-1][2] == {"items": ["a"], "note": "n"}
