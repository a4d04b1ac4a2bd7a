"""Attacks on parallel turns (``Agent(parallel_tool_calls=N)``) and ``ToolOutcomeUnknownError``.

Each test states a promise of the feature and tries to break it in one process with memory
stores: a lost reply in one of several calls, tools raising ``BaseException`` subclasses,
a run cancelled mid-turn, store faults on some calls but not others, large results of
unkeyed calls, ``N`` above the number of calls, and a hypothesis oracle mixing lost
replies and outcomes left in doubt at random widths and finish orders. A test marked
``xfail(strict=True)`` is a defect: it asserts what should hold.
"""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from typing import Any

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, given, settings

from run.helpers import Recording
from tesserix_adk import (
    Agent,
    AgentRunner,
    Checkpointer,
    IndeterminateToolCallError,
    MemoryCheckpointStore,
    MemoryIdempotencyStore,
    MemoryLeaseStore,
    Redactor,
    RunStatus,
    ScriptedProvider,
    ToolContext,
    ToolOutcomeUnknownError,
    tool,
)
from tesserix_adk.checkpoint.payload import encode_outcome
from tesserix_adk.messages import Role, ToolOutcome
from tesserix_adk.run.cancelling import request_cancel
from tesserix_adk.stores.protocols import RecordStatus
from tesserix_adk.testing.faults import FaultyIdempotencyStore

T = "acme"


def _runner(provider: Any, idem: Any, cps: MemoryCheckpointStore, **kw: Any) -> AgentRunner:
    return AgentRunner(
        provider,
        idempotency=idem,
        checkpoints=Checkpointer(cps),
        leases=kw.pop("leases", MemoryLeaseStore()),
        **kw,
    )


def _results(provider: Recording) -> list[tuple[str | None, str]]:
    """The tool results of the last request, as the model reads them."""
    return [
        (m.tool_call_id, str(m.content))
        for m in provider.requests[-1].messages
        if m.role is Role.tool
    ]


def _table(idem: MemoryIdempotencyStore, run_id: str) -> dict[str, Any]:
    """The memory store's records of ``run_id``'s tool calls by call id, read without a
    loop (some tests end their event loop abruptly)."""
    return {
        r.call_id: r
        for (tenant, _), r in idem._records.items()
        if tenant == T and r.run_id == run_id and r.tool is not None and r.call_id
    }


async def _resolve_truthfully(
    idem: MemoryIdempotencyStore, run_id: str, call_id: str, content: Any | None
) -> None:
    rec = _table(idem, run_id)[call_id]
    if content is None:
        await idem.resolve(rec.key, tenant=T, never_ran=True, by="ops")
    else:
        told = encode_outcome(ToolOutcome(call_id=call_id, content=content), Redactor())
        await idem.resolve(rec.key, told, tenant=T, by="ops")


# --- ToolOutcomeUnknownError among parallel calls -------------------------------------------


async def test_an_outcome_unknown_in_one_of_several_calls_leaves_only_it_in_doubt() -> None:
    """Call 1 of 4 loses its reply (after its effect) while calls 0, 2, 3 are out: they
    finish and are recorded, call 1 stays claimed in flight, the run stops retryably; the
    resume names exactly call 1; once the operator records it, the model gets four results
    in its order and every key has one effect."""
    effects: Counter[str] = Counter()
    lose = {"on": True}

    @tool
    async def step(n: int, ctx: ToolContext) -> int:
        """A step with an effect."""
        assert ctx.idempotency_key is not None
        await asyncio.sleep(0.01 * (4 - n))
        effects[ctx.idempotency_key] += 1
        if n == 1 and lose["on"]:
            raise ToolOutcomeUnknownError("sent; the reply was lost")
        return n * 10

    agent = Agent("unk", "Do steps.", [step], parallel_tool_calls=4)
    turn = [("step", {"n": n}) for n in range(4)]
    idem, cps, leases = MemoryIdempotencyStore(), MemoryCheckpointStore(), MemoryLeaseStore()
    provider = Recording(ScriptedProvider([turn, "done"]))
    with pytest.raises(ToolOutcomeUnknownError) as raised:
        await _runner(provider, idem, cps, leases=leases).run(agent, "go", tenant=T, run_id="u")
    assert raised.value.retryable
    table = _table(idem, "u")
    assert {c: r.status for c, r in table.items()} == {
        "call_0_0": RecordStatus.completed,
        "call_0_1": RecordStatus.in_flight,
        "call_0_2": RecordStatus.completed,
        "call_0_3": RecordStatus.completed,
    }
    lose["on"] = False
    with pytest.raises(IndeterminateToolCallError) as refused:
        await _runner(provider, idem, cps, leases=leases).resume(agent, "u", tenant=T)
    assert [c.call_id for c in refused.value.calls] == ["call_0_1"]
    await _resolve_truthfully(idem, "u", "call_0_1", 10)
    run = await _runner(provider, idem, cps, leases=leases).resume(agent, "u", tenant=T)
    assert run.status is RunStatus.completed
    assert _results(provider) == [(f"call_0_{n}", str(n * 10)) for n in range(4)]
    assert sorted(effects.values()) == [1, 1, 1, 1]


async def test_two_outcomes_unknown_side_by_side_are_both_named_by_the_stopped_run() -> None:
    """Two calls of one turn lose their replies: the error the run stops with must say both
    are in doubt (as ``IndeterminateToolCallError`` does for calls found in doubt side by
    side), not just the first to finish."""

    @tool
    async def step(n: int) -> int:
        """A step whose reply is lost for n = 0 and 2."""
        await asyncio.sleep(0.01 * n)
        if n in (0, 2):
            raise ToolOutcomeUnknownError(f"reply of step {n} lost")
        return n

    agent = Agent("unk2", "Do steps.", [step], parallel_tool_calls=3)
    turn = [("step", {"n": n}) for n in range(3)]
    idem = MemoryIdempotencyStore()
    with pytest.raises(ToolOutcomeUnknownError) as raised:
        await _runner(ScriptedProvider([turn, "done"]), idem, MemoryCheckpointStore()).run(
            agent, "go", tenant=T, run_id="u2"
        )
    told = str(raised.value) + " ".join(getattr(raised.value, "__notes__", []))
    assert "call_0_0" in told and "call_0_2" in told


async def test_an_outcome_unknown_under_n1_stops_the_turn_there() -> None:
    """N=1 as before: the call in doubt stops the turn; later calls are never claimed."""
    sent: list[int] = []

    @tool
    async def step(n: int) -> int:
        """A step."""
        sent.append(n)
        if n == 1:
            raise ToolOutcomeUnknownError("lost")
        return n

    agent = Agent("seq", "Do steps.", [step])
    idem = MemoryIdempotencyStore()
    turn = [("step", {"n": n}) for n in range(4)]
    with pytest.raises(ToolOutcomeUnknownError):
        await _runner(ScriptedProvider([turn, "done"]), idem, MemoryCheckpointStore()).run(
            agent, "go", tenant=T, run_id="s"
        )
    assert sent == [0, 1]
    assert {c: r.status for c, r in _table(idem, "s").items()} == {
        "call_0_0": RecordStatus.completed,
        "call_0_1": RecordStatus.in_flight,
    }


async def test_a_call_in_doubt_is_not_hidden_behind_a_siblings_certain_failure() -> None:
    """Call 0 is out (its reply will be lost); call 1's claim never reaches the store. The
    run stops once call 0 is done; what it raises must say an outcome is unknown."""
    inner = MemoryIdempotencyStore()
    claims: list[str] = []

    def hook(phase: str, op: str, key: str) -> None:
        if phase == "before" and op == "claim":
            claims.append(key)
            if len(claims) == 2:
                faulty.fail_claims = 1

    faulty = FaultyIdempotencyStore(inner, hook=hook)

    @tool
    async def step(n: int) -> int:
        """A step; call 0 loses its reply after a while."""
        if n == 0:
            await asyncio.sleep(0.05)
            raise ToolOutcomeUnknownError("sent; reply lost")
        return n

    agent = Agent("hide", "Do steps.", [step], parallel_tool_calls=2)
    turn = [("step", {"n": n}) for n in range(3)]
    with pytest.raises(Exception) as raised:
        await _runner(ScriptedProvider([turn, "done"]), faulty, MemoryCheckpointStore()).run(
            agent, "go", tenant=T, run_id="hide"
        )
    assert _table(inner, "hide")["call_0_0"].status is RecordStatus.in_flight
    assert getattr(raised.value, "outcome_unknown", False) is True


# --- tools raising BaseException subclasses ---------------------------------------------


def _base_exception_turn(
    exc_type: type[BaseException],
) -> tuple[MemoryIdempotencyStore, Counter[str]]:
    """Call 0 (slow, async) is out when call 1 raises ``exc_type`` from inside the tool;
    the run is driven by its own ``asyncio.run`` so an exception that escapes the event
    loop is caught here, not by pytest."""
    effects: Counter[str] = Counter()
    idem = MemoryIdempotencyStore()

    @tool
    async def step(n: int, ctx: ToolContext) -> int:
        """A step with an effect; n = 1 raises."""
        assert ctx.idempotency_key is not None
        if n == 1:
            await asyncio.sleep(0.01)
            raise exc_type("raised by the tool")
        await asyncio.sleep(0.1)
        effects[ctx.idempotency_key] += 1
        return n

    agent = Agent("base", "Do steps.", [step], parallel_tool_calls=2)
    turn = [("step", {"n": n}) for n in range(3)]

    async def main() -> None:
        await _runner(ScriptedProvider([turn, "done"]), idem, MemoryCheckpointStore()).run(
            agent, "go", tenant=T, run_id="b"
        )

    with pytest.raises(exc_type):
        asyncio.run(main())
    return idem, effects


@pytest.mark.parametrize("exc_type", [KeyboardInterrupt, SystemExit])
def test_a_tool_raising_keyboardinterrupt_or_systemexit_cancels_no_started_sibling(
    exc_type: type[BaseException],
) -> None:
    idem, effects = _base_exception_turn(exc_type)
    table = _table(idem, "b")
    assert table["call_0_0"].status is RecordStatus.completed
    assert sum(effects.values()) == 1
    assert "call_0_2" not in table  # never started


def test_a_tool_raising_keyboardinterrupt_leaves_no_call_half_recorded() -> None:
    """Whatever happens to the siblings, nothing is guessed: the raising call and any
    sibling cut short stay in flight (a resume refuses them), a call never started has no
    record, and no record says completed without its effect."""
    idem, effects = _base_exception_turn(KeyboardInterrupt)
    table = _table(idem, "b")
    assert table["call_0_1"].status is RecordStatus.in_flight
    assert "call_0_2" not in table
    for call_id, rec in table.items():
        if rec.status is RecordStatus.completed:
            assert effects[rec.key] == 1, call_id


class _Died(BaseException):
    """A death stand-in that asyncio keeps inside the task."""


async def test_a_base_exception_from_a_tool_lets_a_started_sibling_finish() -> None:
    effects: Counter[str] = Counter()
    idem = MemoryIdempotencyStore()

    @tool
    async def step(n: int, ctx: ToolContext) -> int:
        """A step with an effect; n = 1 dies."""
        assert ctx.idempotency_key is not None
        if n == 1:
            await asyncio.sleep(0.01)
            raise _Died
        await asyncio.sleep(0.05)
        effects[ctx.idempotency_key] += 1
        return n

    agent = Agent("died", "Do steps.", [step], parallel_tool_calls=2)
    turn = [("step", {"n": n}) for n in range(3)]
    with pytest.raises(_Died):
        await _runner(ScriptedProvider([turn, "done"]), idem, MemoryCheckpointStore()).run(
            agent, "go", tenant=T, run_id="d"
        )
    table = _table(idem, "d")
    assert table["call_0_0"].status is RecordStatus.completed
    assert table["call_0_1"].status is RecordStatus.in_flight
    assert "call_0_2" not in table


async def test_cancelled_error_from_a_tool_leaves_only_that_call_in_doubt() -> None:
    """A tool raising ``asyncio.CancelledError`` itself (a library's timeout, say): its
    sibling already sent finishes and is recorded, its own claim stays in flight, a later
    call is not started; the resume names exactly that call."""
    effects: Counter[str] = Counter()
    idem, cps, leases = MemoryIdempotencyStore(), MemoryCheckpointStore(), MemoryLeaseStore()
    raising = {"on": True}

    @tool
    async def step(n: int, ctx: ToolContext) -> int:
        """A step with an effect; n = 1 raises CancelledError of its own."""
        assert ctx.idempotency_key is not None
        if n == 1 and raising["on"]:
            await asyncio.sleep(0.01)
            raise asyncio.CancelledError
        await asyncio.sleep(0.05 if raising["on"] else 0)
        effects[ctx.idempotency_key] += 1
        return n

    agent = Agent("canc", "Do steps.", [step], parallel_tool_calls=2)
    turn = [("step", {"n": n}) for n in range(3)]
    provider = Recording(ScriptedProvider([turn, "done"]))
    with pytest.raises(asyncio.CancelledError):
        await _runner(provider, idem, cps, leases=leases).run(agent, "go", tenant=T, run_id="c")
    table = _table(idem, "c")
    assert table["call_0_0"].status is RecordStatus.completed
    assert table["call_0_1"].status is RecordStatus.in_flight
    assert "call_0_2" not in table
    raising["on"] = False
    with pytest.raises(IndeterminateToolCallError) as refused:
        await _runner(provider, idem, cps, leases=leases).resume(agent, "c", tenant=T)
    assert [c.call_id for c in refused.value.calls] == ["call_0_1"]


# --- the run cancelled or stopped mid-turn -----------------------------------------------


async def test_a_run_task_cancelled_mid_turn_leaves_each_call_as_it_stood() -> None:
    """N=2, four calls: call 0 returns at once (call 2 takes its slot), calls 1 and 2 never
    return, call 3 waits for a slot. The run's task is cancelled: call 0 is recorded, 1
    and 2 stay claimed in flight (they may have sent), 3 has no record. The resume names 1
    and 2; once the operator says what happened, 1 (never ran) and 3 go out once, 0 is
    replayed, 2 is settled, and the model reads four results in its order."""
    effects: Counter[str] = Counter()
    hang = {"on": True}
    idem, cps, leases = MemoryIdempotencyStore(), MemoryCheckpointStore(), MemoryLeaseStore()

    @tool
    async def step(n: int, ctx: ToolContext) -> int:
        """A step; 1 and 2 never return in the first attempt (2 after its effect)."""
        assert ctx.idempotency_key is not None
        if hang["on"] and n == 1:
            await asyncio.Event().wait()
        effects[ctx.idempotency_key] += 1
        if hang["on"] and n == 2:
            await asyncio.Event().wait()
        return n * 10

    agent = Agent("cx", "Do steps.", [step], parallel_tool_calls=2)
    turn = [("step", {"n": n}) for n in range(4)]
    provider = Recording(ScriptedProvider([turn, "done"]))
    task = asyncio.ensure_future(
        _runner(provider, idem, cps, leases=leases).run(agent, "go", tenant=T, run_id="cx")
    )
    for _ in range(200):
        await asyncio.sleep(0.005)
        if len(effects) == 2:
            break
    await asyncio.sleep(0.02)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    table = _table(idem, "cx")
    assert {c: r.status for c, r in table.items()} == {
        "call_0_0": RecordStatus.completed,
        "call_0_1": RecordStatus.in_flight,
        "call_0_2": RecordStatus.in_flight,
    }
    hang["on"] = False
    with pytest.raises(IndeterminateToolCallError) as refused:
        await _runner(provider, idem, cps, leases=leases).resume(agent, "cx", tenant=T)
    assert sorted(str(c.call_id) for c in refused.value.calls) == ["call_0_1", "call_0_2"]
    await _resolve_truthfully(idem, "cx", "call_0_1", None)
    await _resolve_truthfully(idem, "cx", "call_0_2", 20)
    run = await _runner(provider, idem, cps, leases=leases).resume(agent, "cx", tenant=T)
    assert run.status is RunStatus.completed
    assert _results(provider) == [(f"call_0_{n}", str(n * 10)) for n in range(4)]
    assert sorted(effects.values()) == [1, 1, 1, 1]


async def test_a_drain_mid_turn_stops_at_the_boundary_every_call_recorded_once() -> None:
    """The worker is asked to stop while calls are out: the turn's calls finish (none is
    cut short or re-sent), the run stops at the next boundary, and the resume goes on from
    there with every result replayed in the model's order, one effect per key."""
    from tesserix_adk.errors import RunStoppedError

    effects: Counter[str] = Counter()
    asked = {"stop": False}

    @tool
    async def step(n: int, ctx: ToolContext) -> int:
        """A step with an effect; the first to run asks the worker to drain."""
        assert ctx.idempotency_key is not None
        asked["stop"] = True
        await asyncio.sleep(0.01 * (3 - n))
        effects[ctx.idempotency_key] += 1
        return n

    agent = Agent("drain", "Do steps.", [step], parallel_tool_calls=2)
    turn = [("step", {"n": n}) for n in range(4)]
    idem, cps, leases = MemoryIdempotencyStore(), MemoryCheckpointStore(), MemoryLeaseStore()
    provider = Recording(ScriptedProvider([turn, "done"]))
    with pytest.raises(RunStoppedError):
        await _runner(provider, idem, cps, leases=leases).run(
            agent,
            "go",
            tenant=T,
            run_id="dr",
            stop=lambda: "draining" if asked["stop"] else None,
        )
    table = _table(idem, "dr")
    assert {r.status for r in table.values()} == {RecordStatus.completed} and len(table) == 4
    run = await _runner(provider, idem, cps, leases=leases).resume(agent, "dr", tenant=T)
    assert run.status is RunStatus.completed
    assert _results(provider) == [(f"call_0_{n}", str(n)) for n in range(4)]
    assert sorted(effects.values()) == [1, 1, 1, 1]


async def test_a_cancel_requested_mid_turn_ends_the_run_with_nothing_in_flight() -> None:
    """``tesserix cancel`` while a parallel turn is out: the run ends cancelled at the next
    boundary; every call it sent is recorded (none left in flight, none sent twice)."""
    effects: Counter[str] = Counter()
    idem = MemoryIdempotencyStore()

    @tool
    async def step(n: int, ctx: ToolContext) -> int:
        """A step with an effect; call 0 has the run cancelled meanwhile."""
        assert ctx.idempotency_key is not None
        if n == 0:
            await request_cancel(idem, T, "cc", by="ops", reason="enough", redactor=Redactor())
        await asyncio.sleep(0.01 * (3 - n))
        effects[ctx.idempotency_key] += 1
        return n

    agent = Agent("cc", "Do steps.", [step], parallel_tool_calls=2)
    turn = [("step", {"n": n}) for n in range(4)]
    provider = Recording(ScriptedProvider([turn, turn, "done"]))
    run = await _runner(provider, idem, MemoryCheckpointStore()).run(
        agent, "go", tenant=T, run_id="cc"
    )
    assert run.status is RunStatus.cancelled
    table = _table(idem, "cc")
    assert all(r.status is RecordStatus.completed for r in table.values())
    assert all(effects[r.key] == 1 for r in table.values())
    assert len(provider.requests) == 1  # the next turn was never asked for


# --- store faults on some calls, not others ---------------------------------------------


async def test_lost_store_replies_on_some_calls_are_settled_by_reading_back() -> None:
    """Four calls side by side: one claim and two completes are applied with their replies
    lost. Each is read back, never assumed: the run completes, every call sent once, every
    record completed, results in the model's order."""
    effects: Counter[str] = Counter()
    inner = MemoryIdempotencyStore()
    faulty = FaultyIdempotencyStore(inner)
    faulty.lose_claim_replies = 1
    faulty.lose_complete_replies = 2

    @tool
    async def step(n: int, ctx: ToolContext) -> int:
        """A step with an effect."""
        assert ctx.idempotency_key is not None
        await asyncio.sleep(0.005 * (4 - n))
        effects[ctx.idempotency_key] += 1
        return n

    agent = Agent("lost", "Do steps.", [step], parallel_tool_calls=4)
    turn = [("step", {"n": n}) for n in range(4)]
    provider = Recording(ScriptedProvider([turn, "done"]))
    run = await _runner(provider, faulty, MemoryCheckpointStore()).run(
        agent, "go", tenant=T, run_id="l"
    )
    assert run.status is RunStatus.completed
    assert _results(provider) == [(f"call_0_{n}", str(n)) for n in range(4)]
    assert sorted(effects.values()) == [1, 1, 1, 1]
    assert {r.status for r in _table(inner, "l").values()} == {RecordStatus.completed}


async def test_a_claim_that_cannot_be_read_back_sends_nothing_and_siblings_finish() -> None:
    """Call 1's claim is applied, its reply lost, and reading it back fails too: it is not
    sent, its claim is dropped (never left in doubt), call 0 finishes and is recorded; the
    resume sends each call that had not gone out once."""
    effects: Counter[str] = Counter()
    inner = MemoryIdempotencyStore()
    broken = {"key": "", "on": True}
    claims: list[str] = []

    def hook(phase: str, op: str, key: str) -> None:
        if not broken["on"]:
            return
        if phase == "before" and op == "claim":
            claims.append(key)
            if len(claims) == 2:
                broken["key"] = key
                faulty.lose_claim_replies = 1
        if phase == "before" and op == "lookup" and key == broken["key"]:
            raise ConnectionError("cannot read back (simulated)")

    faulty = FaultyIdempotencyStore(inner, hook=hook)

    @tool
    async def step(n: int, ctx: ToolContext) -> int:
        """A step with an effect."""
        assert ctx.idempotency_key is not None
        if n == 0 and broken["on"]:
            await asyncio.sleep(0.2)  # out while its sibling's claim is lost and read back
        effects[ctx.idempotency_key] += 1
        return n

    agent = Agent("rb", "Do steps.", [step], parallel_tool_calls=2)
    turn = [("step", {"n": n}) for n in range(4)]
    idem_cps, leases = MemoryCheckpointStore(), MemoryLeaseStore()
    provider = Recording(ScriptedProvider([turn, "done"]))
    from tesserix_adk import StoreUnavailableError

    with pytest.raises(StoreUnavailableError):
        await _runner(provider, faulty, idem_cps, leases=leases).run(
            agent, "go", tenant=T, run_id="rb"
        )
    table = _table(inner, "rb")
    # Calls handed out while call 1 was still reading back (its slot and call 0's) ran and
    # are recorded; call 1 itself has no claim left.
    assert "call_0_1" not in table and "call_0_0" in table
    assert {r.status for r in table.values()} == {RecordStatus.completed}
    broken["on"] = False
    run = await _runner(provider, faulty, idem_cps, leases=leases).resume(agent, "rb", tenant=T)
    assert run.status is RunStatus.completed
    assert _results(provider) == [(f"call_0_{n}", str(n)) for n in range(4)]
    assert sorted(effects.values()) == [1, 1, 1, 1]


# --- widths --------------------------------------------------------------------------------


async def test_n_larger_than_the_turn_runs_every_call_at_once_and_keeps_order() -> None:
    active = {"now": 0, "peak": 0}

    @tool
    async def step(n: int) -> int:
        """A step."""
        active["now"] += 1
        active["peak"] = max(active["peak"], active["now"])
        await asyncio.sleep(0.01 * (3 - n))
        active["now"] -= 1
        return n

    agent = Agent("wide", "Do steps.", [step], parallel_tool_calls=50)
    turn = [("step", {"n": n}) for n in range(3)]
    provider = Recording(ScriptedProvider([turn, "done"]))
    run = await _runner(provider, MemoryIdempotencyStore(), MemoryCheckpointStore()).run(
        agent, "go", tenant=T, run_id="w"
    )
    assert run.status is RunStatus.completed
    assert active["peak"] == 3
    assert _results(provider) == [(f"call_0_{n}", str(n)) for n in range(3)]


async def test_n1_claims_sends_and_records_each_call_before_the_next_is_claimed() -> None:
    """N=1 is the sequential turn: the store sees claim, complete for each call in the
    model's order, never a claim before the previous call's complete."""
    inner = MemoryIdempotencyStore()
    faulty = FaultyIdempotencyStore(inner)

    @tool
    async def step(n: int) -> int:
        """A step."""
        await asyncio.sleep(0.01 * (3 - n))
        return n

    agent = Agent("n1", "Do steps.", [step])
    turn = [("step", {"n": n}) for n in range(4)]
    run = await _runner(ScriptedProvider([turn, "done"]), faulty, MemoryCheckpointStore()).run(
        agent, "go", tenant=T, run_id="n1"
    )
    assert run.status is RunStatus.completed
    ops = [(op, key) for op, key in faulty.calls if op in ("claim", "complete")]
    keys = {r.call_id: r.key for r in _table(inner, "n1").values()}
    expected = []
    for n in range(4):
        expected += [("claim", keys[f"call_0_{n}"]), ("complete", keys[f"call_0_{n}"])]
    assert ops == expected


# --- sync work kept off the event loop ----------------------------------------------------


def _spy_redactor(marker: str, loop_thread: int, on_loop: list[str]) -> Redactor:
    class Spy(Redactor):
        def text(self, value: str) -> str:
            if marker in value and threading.get_ident() == loop_thread:
                on_loop.append("text")
            return Redactor.text(self, value)

        def value(self, data: Any) -> Any:
            if marker in repr(data)[:64] and threading.get_ident() == loop_thread:
                on_loop.append("value")
            return Redactor.value(self, data)

    return Spy()


@pytest.mark.parametrize(
    "keyed", [pytest.param(True, id="keyed"), pytest.param(False, id="unkeyed")]
)
async def test_a_large_result_is_redacted_off_the_event_loop_while_siblings_run(
    keyed: bool,
) -> None:
    """A call returning a large result while its siblings are out: masking it is work
    linear in its size, done in a worker thread (as the recorded outcome's is), so the
    event loop keeps renewing the lease and serving the siblings meanwhile."""
    marker = "BIGRESULT"
    on_loop: list[str] = []
    opts: dict[str, Any] = {} if keyed else {"key": None}

    @tool(**opts)
    async def big(n: int) -> str:
        """Returns a large text."""
        return marker + "x" * 200_000

    @tool
    async def step(n: int) -> int:
        """A sibling."""
        await asyncio.sleep(0.01)
        return n

    agent = Agent("big", "Do steps.", [big, step], parallel_tool_calls=2)
    checkpointer = Checkpointer(MemoryCheckpointStore())
    checkpointer.redactor = _spy_redactor(marker, threading.get_ident(), on_loop)
    runner = AgentRunner(
        ScriptedProvider([[("big", {"n": 0}), ("step", {"n": 1})], "done"]),
        idempotency=MemoryIdempotencyStore(),
        checkpoints=checkpointer,
        leases=MemoryLeaseStore(),
    )
    run = await runner.run(agent, "go", tenant=T, run_id="big")
    assert run.status is RunStatus.completed
    assert on_loop == []


# --- resume past the frontier ("ahead") -----------------------------------------------------


def _ahead_setup() -> tuple[Agent, Counter[str], dict[str, bool], list[Any]]:
    from tesserix_adk.testing.faults import SimulatedCrash

    effects: Counter[str] = Counter()
    live = {"crash": True}

    @tool
    async def step(n: int, ctx: ToolContext) -> int:
        """A step with an effect; in the first attempt, n = 2 dies before its effect while
        n = 3 is still out."""
        assert ctx.idempotency_key is not None
        if live["crash"] and n == 2:
            await asyncio.sleep(0.01)
            raise SimulatedCrash
        if live["crash"] and n == 3:
            await asyncio.sleep(0.05)
        effects[ctx.idempotency_key] += 1
        return n

    agent = Agent("ahead", "Do steps.", [step], parallel_tool_calls=3)
    turns: list[Any] = [[("step", {"n": 9})], [("step", {"n": n}) for n in range(4)], "done"]
    return agent, effects, live, turns


async def _crash_ahead(
    agent: Agent, turns: list[Any], idem: MemoryIdempotencyStore, cps: MemoryCheckpointStore
) -> None:
    """Only after_tool_result frontiers are written: iteration 1's parallel turn runs past
    the frontier of iteration 0 and dies there."""
    from tesserix_adk import CheckpointPolicy
    from tesserix_adk.checkpoint.payload import Boundary
    from tesserix_adk.testing.faults import SimulatedCrash

    policy = CheckpointPolicy(boundaries=frozenset({Boundary.after_tool_result}))
    runner = AgentRunner(
        ScriptedProvider(turns),
        idempotency=idem,
        checkpoints=Checkpointer(cps, policy=policy),
        leases=MemoryLeaseStore(),
    )
    with pytest.raises(SimulatedCrash):
        await runner.run(agent, "go", tenant=T, run_id="ah")


async def test_a_parallel_turn_past_its_frontier_resumes_per_call_with_no_duplicate() -> None:
    agent, effects, live, turns = _ahead_setup()
    idem, cps = MemoryIdempotencyStore(), MemoryCheckpointStore()
    await _crash_ahead(agent, turns, idem, cps)
    table = _table(idem, "ah")
    assert {c: r.status for c, r in table.items() if c.startswith("call_1")} == {
        "call_1_0": RecordStatus.completed,
        "call_1_1": RecordStatus.completed,
        "call_1_2": RecordStatus.in_flight,
        "call_1_3": RecordStatus.completed,
    }
    live["crash"] = False
    provider = Recording(ScriptedProvider(turns))

    def again() -> AgentRunner:
        return AgentRunner(
            provider, idempotency=idem, checkpoints=Checkpointer(cps), leases=MemoryLeaseStore()
        )

    with pytest.raises(IndeterminateToolCallError) as refused:
        await again().resume(agent, "ah", tenant=T)
    assert [c.call_id for c in refused.value.calls] == ["call_1_2"]
    await _resolve_truthfully(idem, "ah", "call_1_2", None)
    run = await again().resume(agent, "ah", tenant=T)
    assert run.status is RunStatus.completed
    assert _results(provider)[1:] == [(f"call_1_{n}", str(n)) for n in range(4)]
    assert sorted(effects.values()) == [1, 1, 1, 1, 1]


async def test_a_resumed_turn_dropping_a_call_already_made_is_refused_unsent() -> None:
    """On resume the model asks again for calls 0-2 of the dead turn but not 3, which ran:
    the turn is refused before anything of it is sent (call 2, decided never ran, stays
    unsent)."""
    from tesserix_adk.errors import DivergedRunError

    agent, effects, live, turns = _ahead_setup()
    idem, cps = MemoryIdempotencyStore(), MemoryCheckpointStore()
    await _crash_ahead(agent, turns, idem, cps)
    await _resolve_truthfully(idem, "ah", "call_1_2", None)
    live["crash"] = False
    before = Counter(effects)
    diverged = [turns[0], [("step", {"n": n}) for n in range(3)], "done"]
    runner = AgentRunner(
        ScriptedProvider(diverged),
        idempotency=idem,
        checkpoints=Checkpointer(cps),
        leases=MemoryLeaseStore(),
    )
    with pytest.raises(DivergedRunError, match="call_1_3"):
        await runner.resume(agent, "ah", tenant=T)
    assert effects == before


# --- approvals --------------------------------------------------------------------------


async def test_a_mixed_turn_gates_only_calls_needing_approval_in_model_order() -> None:
    """One turn side by side: two calls needing approval, a read-only call, an unknown tool
    and a twin of the read-only call. Nothing needing approval goes out before the
    decision; after approval each approved call goes out once; the model reads five results
    in its order, the unknown tool refused."""
    from tesserix_adk import MemoryApprovalStore

    booked: list[str] = []
    looked: list[str] = []

    @tool(requires_approval=True)
    async def book(flight: str) -> str:
        """Books a seat, once a person agrees."""
        await asyncio.sleep(0.01)
        booked.append(flight)
        return f"booked {flight}"

    @tool(side_effects=False)
    async def look(flight: str) -> str:
        """Looks a flight up."""
        looked.append(flight)
        return f"seen {flight}"

    agent = Agent("mix", "Book.", [book, look], parallel_tool_calls=4)
    turn = [
        ("book", {"flight": "LH1"}),
        ("look", {"flight": "LH1"}),
        ("nope", {}),
        ("look", {"flight": "LH1"}),
        ("book", {"flight": "UA2"}),
    ]
    idem, cps, approvals = MemoryIdempotencyStore(), MemoryCheckpointStore(), MemoryApprovalStore()
    provider = Recording(ScriptedProvider([turn, "done"]))
    waiting = await _runner(provider, idem, cps, approvals=approvals).run(
        agent, "go", tenant=T, run_id="mix"
    )
    assert waiting.status is RunStatus.waiting_approval
    assert booked == [] and looked == []
    assert waiting.pending_approval is not None
    await approvals.decide(T, waiting.pending_approval.id, approved=True, by="ops")
    run = await _runner(provider, idem, cps, approvals=approvals).resume(agent, "mix", tenant=T)
    assert run.status is RunStatus.completed
    assert sorted(booked) == ["LH1", "UA2"] and looked == ["LH1", "LH1"]
    results = [m for m in provider.requests[-1].messages if m.role is Role.tool]
    assert [m.tool_call_id for m in results] == [f"call_0_{n}" for n in range(5)]
    assert [m.is_error for m in results] == [False, False, True, False, False]
    assert len({r.key for r in _table(idem, "mix").values()}) == 4  # twins: two keys


# --- tools that hold on -------------------------------------------------------------------


async def test_a_call_that_holds_on_past_the_lease_ttl_keeps_the_run_held() -> None:
    """One call is out for several lease ttls while its sibling is done: the lease is
    renewed meanwhile, so another attempt cannot take the run, and the turn completes."""
    from tesserix_adk import LeasePolicy
    from tesserix_adk.errors import AdkError

    release = asyncio.Event()

    @tool
    async def step(n: int) -> int:
        """Call 0 waits to be let go."""
        if n == 0:
            await asyncio.wait_for(release.wait(), 5)
        return n

    agent = Agent("hold", "Do steps.", [step], parallel_tool_calls=2)
    turn = [("step", {"n": n}) for n in range(2)]
    idem, cps, leases = MemoryIdempotencyStore(), MemoryCheckpointStore(), MemoryLeaseStore()
    policy = LeasePolicy(ttl=0.3, renew_within=0.1)
    task = asyncio.ensure_future(
        _runner(
            ScriptedProvider([turn, "done"]), idem, cps, leases=leases, lease_policy=policy
        ).run(agent, "go", tenant=T, run_id="hold")
    )
    await asyncio.sleep(0.9)  # three ttls
    with pytest.raises(AdkError):
        await _runner(ScriptedProvider([turn, "done"]), idem, cps, leases=leases).resume(
            agent, "hold", tenant=T
        )
    release.set()
    run = await task
    assert run.status is RunStatus.completed


async def test_a_sync_tool_waiting_on_an_async_sibling_does_not_block_it() -> None:
    """A sync tool blocks its worker thread until an async sibling, on the event loop, lets
    it go: both finish only if the sync one is off the loop."""
    gate = threading.Event()

    @tool
    def wait_sync(n: int) -> str:
        """Blocks until the sibling sets the gate."""
        return "through" if gate.wait(5) else "timed out"

    @tool
    async def open_gate(n: int) -> str:
        """Lets the sync sibling go, from the event loop."""
        await asyncio.sleep(0.02)
        gate.set()
        return "opened"

    agent = Agent("mixsync", "Do.", [wait_sync, open_gate], parallel_tool_calls=2)
    turn = [("wait_sync", {"n": 0}), ("open_gate", {"n": 1})]
    provider = Recording(ScriptedProvider([turn, "done"]))
    run = await _runner(provider, MemoryIdempotencyStore(), MemoryCheckpointStore()).run(
        agent, "go", tenant=T, run_id="ms"
    )
    assert run.status is RunStatus.completed
    assert _results(provider) == [("call_0_0", "through"), ("call_0_1", "opened")]


# --- the oracle ---------------------------------------------------------------------------

KINDS = (
    "ok",
    "unknown_after",
    "unknown_before",
    "claim_reply_lost",
    "complete_reply_lost",
    "complete_down",
    "err",
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    limit=st.integers(1, 5),
    plan=st.lists(st.tuples(st.sampled_from(KINDS), st.integers(0, 3)), min_size=1, max_size=5),
)
def test_oracle_outcomes_unknown_and_lost_replies_at_any_width_and_finish_order(
    limit: int, plan: list[tuple[str, int]]
) -> None:
    """Each call of one turn gets a fault: none, its reply lost by the tool after or before
    its effect (``ToolOutcomeUnknownError``), its claim's or its complete's store reply
    lost, its complete never reaching the store, or an ordinary error. Lost store replies
    are settled by reading back; a call in doubt stops the run retryably once every
    started call finished (those recorded, none started after), is named by the resume,
    and once the operator says truthfully what happened the model reads every result in
    its order and each effect happened once."""
    asyncio.run(_oracle(limit, plan))


async def _oracle(limit: int, plan: list[tuple[str, int]]) -> None:
    from tesserix_adk.errors import StoreReplyLostError, StoreUnavailableError
    from tesserix_adk.run.dispatch import COMPLETE_TRIES

    effects: Counter[str] = Counter()
    active = {"now": 0, "peak": 0}
    live = {"faults": True}
    claims = [0]
    by_key: dict[str, int] = {}
    entered: list[int] = []
    after_failure: list[int] = []
    failed_at: list[int] = []
    inner = MemoryIdempotencyStore()

    tries: Counter[str] = Counter()

    def hook(phase: str, op: str, key: str) -> None:
        if not live["faults"]:
            return
        if phase == "before" and op == "complete" and plan[by_key[key]][0] == "complete_down":
            tries[key] += 1
            if tries[key] == COMPLETE_TRIES:  # the call gives up: the failure is seen now
                failed_at.append(by_key[key])
            raise StoreUnavailableError("complete never reached the store (simulated)")
        if phase != "after":
            return
        if op == "claim":
            claims[0] += 1
            if plan[claims[0] - 1][0] == "claim_reply_lost":
                raise StoreReplyLostError("claim applied, reply lost (simulated)")
        if op == "complete" and plan[by_key[key]][0] == "complete_reply_lost":
            raise StoreReplyLostError("complete applied, reply lost (simulated)")

    idem = FaultyIdempotencyStore(inner, hook=hook)

    @tool
    async def step(n: int, ctx: ToolContext) -> int:
        """A step with an effect after a delay, and the fault the plan gives it."""
        assert ctx.idempotency_key is not None
        by_key[ctx.idempotency_key] = n
        kind, delay = plan[n]
        if not live["faults"] and kind != "err":  # an error is the call's own answer
            kind, delay = "ok", 0
        (after_failure if failed_at else entered).append(n)
        active["now"] += 1
        active["peak"] = max(active["peak"], active["now"])
        try:
            await asyncio.sleep(delay / 200)
            if kind == "unknown_before":
                failed_at.append(n)
                raise ToolOutcomeUnknownError("lost before the effect")
            if kind == "err":
                raise ValueError("no such seat")
            effects[ctx.idempotency_key] += 1
            if kind == "unknown_after":
                failed_at.append(n)
                raise ToolOutcomeUnknownError("lost after the effect")
        finally:
            active["now"] -= 1
        return n * 10

    agent = Agent("oracle", "Do steps.", [step], parallel_tool_calls=limit)
    turn = [("step", {"n": n}) for n in range(len(plan))]
    cps, leases = MemoryCheckpointStore(), MemoryLeaseStore()
    provider = Recording(ScriptedProvider([turn, "done"]))
    doubtful = any(k.startswith("unknown") or k == "complete_down" for k, _ in plan)

    def runner() -> AgentRunner:
        return AgentRunner(provider, idempotency=idem, checkpoints=Checkpointer(cps), leases=leases)

    if not doubtful:
        run = await runner().run(agent, "go", tenant=T, run_id="o")
    else:
        with pytest.raises((ToolOutcomeUnknownError, StoreUnavailableError)):
            await runner().run(agent, "go", tenant=T, run_id="o")
        live["faults"] = False
        first = failed_at[0]
        records = _table(inner, "o")
        started = {f"call_0_{n}" for n in entered + after_failure}
        assert set(records) == started
        # Nothing handed out once the failure was seen: a call entering after it was
        # already running (at most ``limit`` were).
        assert all(n <= max(entered) + limit for n in after_failure), (entered, after_failure)
        assert first in entered
        in_doubt = sorted(f"call_0_{n}" for n in set(failed_at))
        for call_id, rec in records.items():
            want = RecordStatus.in_flight if call_id in in_doubt else RecordStatus.completed
            assert rec.status is want, call_id
        with pytest.raises(IndeterminateToolCallError) as refused:
            await runner().resume(agent, "o", tenant=T)
        assert sorted(str(c.call_id) for c in refused.value.calls) == in_doubt
        for call_id in in_doubt:
            n = int(call_id.rsplit("_", 1)[1])
            ran = plan[n][0] in ("unknown_after", "complete_down")
            await _resolve_truthfully(inner, "o", call_id, n * 10 if ran else None)
        run = await runner().resume(agent, "o", tenant=T)
    assert run.status is RunStatus.completed
    results = _results(provider)
    assert [c for c, _ in results] == [f"call_0_{n}" for n in range(len(plan))]
    for n, (kind, _) in enumerate(plan):
        content = results[n][1]
        assert ("no such seat" in content) if kind == "err" else content == str(n * 10)
    assert all(v == 1 for v in effects.values())
    assert len(effects) == sum(1 for k, _ in plan if k != "err")
    assert active["peak"] <= limit


# --- more on calls in doubt ---------------------------------------------------------------


async def test_an_unkeyed_call_losing_its_reply_is_not_sent_again() -> None:
    """An unkeyed tool (no idempotency key, so no claim) raises ToolOutcomeUnknownError
    beside a keyed sibling: the resume must not send it again as if it never ran."""
    sent: Counter[str] = Counter()
    lose = {"on": True}

    @tool(key=None)
    async def ping(n: int) -> str:
        """An unkeyed call that may lose its reply."""
        sent["ping"] += 1
        await asyncio.sleep(0.01)
        if lose["on"]:
            raise ToolOutcomeUnknownError("sent; reply lost")
        return "pong"

    @tool
    async def step(n: int) -> int:
        """A keyed sibling."""
        sent["step"] += 1
        await asyncio.sleep(0.02)
        return n

    agent = Agent("unkeyed", "Do.", [ping, step], parallel_tool_calls=2)
    turn = [("ping", {"n": 0}), ("step", {"n": 1})]
    idem, cps, leases = MemoryIdempotencyStore(), MemoryCheckpointStore(), MemoryLeaseStore()
    provider = Recording(ScriptedProvider([turn, "done"]))
    with pytest.raises(ToolOutcomeUnknownError):
        await _runner(provider, idem, cps, leases=leases).run(agent, "go", tenant=T, run_id="uk")
    lose["on"] = False
    try:
        await _runner(provider, idem, cps, leases=leases).resume(agent, "uk", tenant=T)
    except IndeterminateToolCallError as exc:
        assert "ping" in str(exc)
    assert sent["ping"] == 1 and sent["step"] == 1


async def test_a_sync_call_that_finishes_after_the_run_is_cancelled_is_recorded() -> None:
    """The run's task is cancelled while a sync call (in its worker thread, which cannot be
    stopped) is out; the turn waits for the thread to return, as it says. What the call
    returned is then known: it must be recorded, not left in doubt."""
    gate = threading.Event()
    effects: Counter[str] = Counter()

    @tool
    def book(n: int, ctx: ToolContext) -> int:
        """A blocking call with an effect."""
        assert ctx.idempotency_key is not None
        gate.wait(5)
        effects[ctx.idempotency_key] += 1
        return n

    agent = Agent("cxs", "Do.", [book], parallel_tool_calls=2)
    turn = [("book", {"n": n}) for n in range(2)]
    idem = MemoryIdempotencyStore()
    task = asyncio.ensure_future(
        _runner(ScriptedProvider([turn, "done"]), idem, MemoryCheckpointStore()).run(
            agent, "go", tenant=T, run_id="cxs"
        )
    )
    for _ in range(200):
        await asyncio.sleep(0.005)
        if len(_table(idem, "cxs")) == 2:
            break
    task.cancel()
    await asyncio.sleep(0.02)
    gate.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert sorted(effects.values()) == [1, 1]
    assert {r.status for r in _table(idem, "cxs").values()} == {RecordStatus.completed}


# --- business keys shared within one turn ---------------------------------------------------


@pytest.mark.parametrize(
    "limit",
    [
        pytest.param(1, id="n1"),
        pytest.param(2, id="n2"),
        pytest.param(3, id="n3"),
    ],
)
async def test_calls_sharing_a_business_key_in_one_turn_are_sent_once(limit: int) -> None:
    """``key`` names the order only: two calls of one turn for the same order share a key,
    and the far side deduplicates by it. Whatever N, the order is placed once."""
    placed: list[str] = []

    def by_order(**kw: Any) -> str:
        return f"order-{kw['arguments']['order']}"

    @tool(key=by_order)
    async def place(order: int, note: str) -> str:
        """Places an order."""
        placed.append(note)
        await asyncio.sleep(0.02)
        return f"placed {order}"

    agent = Agent("biz", "Order.", [place], parallel_tool_calls=limit)
    turn = [("place", {"order": 5, "note": "a"}), ("place", {"order": 5, "note": "b"})]
    provider = Recording(ScriptedProvider([turn, "done"]))
    run = await _runner(provider, MemoryIdempotencyStore(), MemoryCheckpointStore()).run(
        agent, "go", tenant=T, run_id="biz"
    )
    assert run.status is RunStatus.completed
    assert len(placed) == 1


async def test_a_death_mid_turn_after_approval_resumes_with_the_approval_standing() -> None:
    """Both calls of a turn were approved; call 1 dies before its effect while call 0 is
    out. Once the operator says call 1 never ran, the resume sends it once under the
    approval given (neither asking again for what was decided nor telling the model it was
    not approved) and replays call 0."""
    from tesserix_adk import MemoryApprovalStore
    from tesserix_adk.testing.faults import SimulatedCrash

    booked: Counter[str] = Counter()
    live = {"crash": True}

    @tool(requires_approval=True)
    async def book(flight: str) -> str:
        """Books a seat, once a person agrees."""
        if live["crash"] and flight == "UA2":
            await asyncio.sleep(0.01)
            raise SimulatedCrash
        await asyncio.sleep(0.03 if live["crash"] else 0)
        booked[flight] += 1
        return f"booked {flight}"

    agent = Agent("apx", "Book.", [book], parallel_tool_calls=2)
    turn = [("book", {"flight": "LH1"}), ("book", {"flight": "UA2"})]
    idem, cps, approvals = MemoryIdempotencyStore(), MemoryCheckpointStore(), MemoryApprovalStore()
    leases = MemoryLeaseStore()
    provider = Recording(ScriptedProvider([turn, "done"]))

    def runner() -> AgentRunner:
        return _runner(
            provider, idem, cps, approvals=approvals, leases=leases, resume_claim_ttl=0.1
        )

    waiting = await runner().run(agent, "go", tenant=T, run_id="apx")
    assert waiting.pending_approval is not None
    await approvals.decide(T, waiting.pending_approval.id, approved=True, by="ops")
    with pytest.raises(SimulatedCrash):
        await runner().resume(agent, "apx", tenant=T)
    assert booked == Counter({"LH1": 1})
    live["crash"] = False
    await asyncio.sleep(0.15)  # the dead attempt's resume claim lapses
    await _resolve_truthfully(idem, "apx", "call_0_1", None)
    run = await runner().resume(agent, "apx", tenant=T)
    assert run.status is RunStatus.completed
    assert _results(provider) == [("call_0_0", "booked LH1"), ("call_0_1", "booked UA2")]
    assert booked == Counter({"LH1": 1, "UA2": 1})


async def test_calls_in_doubt_side_by_side_are_each_settled_by_their_reconciler() -> None:
    """Calls 0 and 2 lose their replies, 0 after its effect and 2 before; call 1 is done.
    The resume asks the reconciler for each: 0 is found (replayed, not sent again), 2 is not
    (sent once), and the model reads three results in its order."""
    from tesserix_adk import Reconciled

    effects: Counter[str] = Counter()
    lose = {"on": True}

    def look_up(call: Any, ctx: Any) -> Reconciled:
        if effects[ctx.idempotency_key]:
            return Reconciled.completed(call.arguments["n"] * 10)
        return Reconciled.never_ran()

    @tool(reconcile=look_up)
    async def step(n: int, ctx: ToolContext) -> int:
        """A step with an effect."""
        assert ctx.idempotency_key is not None
        await asyncio.sleep(0.01 * n)
        if lose["on"] and n == 2:
            raise ToolOutcomeUnknownError("lost before the effect landed")
        effects[ctx.idempotency_key] += 1
        if lose["on"] and n == 0:
            raise ToolOutcomeUnknownError("lost after the effect")
        return n * 10

    agent = Agent("rec", "Do steps.", [step], parallel_tool_calls=3)
    turn = [("step", {"n": n}) for n in range(3)]
    idem, cps, leases = MemoryIdempotencyStore(), MemoryCheckpointStore(), MemoryLeaseStore()
    provider = Recording(ScriptedProvider([turn, "done"]))
    with pytest.raises(ToolOutcomeUnknownError):
        await _runner(provider, idem, cps, leases=leases).run(agent, "go", tenant=T, run_id="rc")
    lose["on"] = False
    run = await _runner(provider, idem, cps, leases=leases, never_ran_margin=0).resume(
        agent, "rc", tenant=T
    )
    assert run.status is RunStatus.completed
    assert _results(provider) == [(f"call_0_{n}", str(n * 10)) for n in range(3)]
    assert sorted(effects.values()) == [1, 1, 1]


# --- the lease taken while calls are out --------------------------------------------------


async def test_a_lease_taken_over_mid_turn_lets_sent_calls_finish_and_claims_no_more() -> None:
    """Calls 0 and 1 are out when another holder takes the run's lease and seals the
    stores with its fence (the store's clock says the lease lapsed). The calls out finish
    and record what they did; no later call is dispatched under the superseded fence."""
    from tesserix_adk.errors import AdkError

    now = {"t": 1000.0}
    leases = MemoryLeaseStore(clock=lambda: now["t"])
    idem = MemoryIdempotencyStore()
    entered: list[int] = []
    stolen = asyncio.Event()

    @tool
    async def step(n: int) -> int:
        """A step; the first two wait until the run was taken."""
        entered.append(n)
        if n < 2:
            await asyncio.wait_for(stolen.wait(), 5)
            await asyncio.sleep(0.01 * n)
        return n

    agent = Agent("steal", "Do steps.", [step], parallel_tool_calls=2)
    turn = [("step", {"n": n}) for n in range(4)]
    task = asyncio.ensure_future(
        _runner(ScriptedProvider([turn, "done"]), idem, MemoryCheckpointStore(), leases=leases).run(
            agent, "go", tenant=T, run_id="st"
        )
    )
    for _ in range(200):
        await asyncio.sleep(0.005)
        if len(entered) == 2:
            break
    now["t"] += 3600  # the lease lapsed by the store's clock
    thief = await leases.acquire(T, "st", "thief", 30.0)
    await idem.seal(T, "st", thief.fence)
    stolen.set()
    with pytest.raises(AdkError):
        await task
    assert sorted(entered) == [0, 1]
    assert {c: r.status for c, r in _table(idem, "st").items()} == {
        "call_0_0": RecordStatus.completed,
        "call_0_1": RecordStatus.completed,
    }


class _SlowCompletes(FaultyIdempotencyStore):
    """Each complete takes a while to reach the store."""

    async def complete(self, key: str, outcome: bytes, *, tenant: str, holder: str) -> Any:
        await asyncio.sleep(0.1)
        return await super().complete(key, outcome, tenant=tenant, holder=holder)


async def test_a_cancel_while_an_outcome_is_being_recorded_still_records_it() -> None:
    inner = MemoryIdempotencyStore()
    idem = _SlowCompletes(inner)
    effects: Counter[str] = Counter()

    @tool
    async def step(n: int, ctx: ToolContext) -> int:
        """A quick step with an effect."""
        assert ctx.idempotency_key is not None
        effects[ctx.idempotency_key] += 1
        return n

    agent = Agent("cxr", "Do steps.", [step], parallel_tool_calls=2)
    turn = [("step", {"n": n}) for n in range(2)]
    task = asyncio.ensure_future(
        _runner(ScriptedProvider([turn, "done"]), idem, MemoryCheckpointStore()).run(
            agent, "go", tenant=T, run_id="cxr"
        )
    )
    for _ in range(200):
        await asyncio.sleep(0.005)
        if len(effects) == 2:
            break
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert sorted(effects.values()) == [1, 1]
    assert {r.status for r in _table(inner, "cxr").values()} == {RecordStatus.completed}


# --- resume of a turn with a call in doubt, at another width -------------------------------


@pytest.mark.parametrize(("first", "then"), [(3, 1), (1, 3), (2, 5)])
async def test_a_turn_with_a_call_in_doubt_resumes_at_any_width_sending_nothing_first(
    first: int, then: int
) -> None:
    """A death mid-turn leaves call 1 in flight, call 0 done and later calls never
    started. While call 1 is in doubt the resume sends nothing of the turn (not even the
    calls never started); once it is settled, the resume at another width sends each
    remaining call once and the model reads the results in its order."""
    from tesserix_adk.testing.faults import SimulatedCrash

    effects: Counter[str] = Counter()
    live = {"crash": True}

    def build(limit: int) -> Agent:
        @tool
        async def step(n: int, ctx: ToolContext) -> int:
            """A step with an effect; n = 1 dies after its effect in the first attempt."""
            assert ctx.idempotency_key is not None
            await asyncio.sleep(0.005 * n)
            effects[ctx.idempotency_key] += 1
            if live["crash"] and n == 1:
                raise SimulatedCrash
            return n

        return Agent("width", "Do steps.", [step], parallel_tool_calls=limit)

    turn = [("step", {"n": n}) for n in range(5)]
    idem, cps, leases = MemoryIdempotencyStore(), MemoryCheckpointStore(), MemoryLeaseStore()
    provider = Recording(ScriptedProvider([turn, "done"]))

    def runner() -> AgentRunner:
        return _runner(provider, idem, cps, leases=leases, resume_claim_ttl=0.05)

    with pytest.raises(SimulatedCrash):
        await runner().run(build(first), "go", tenant=T, run_id="wd")
    live["crash"] = False
    before = Counter(effects)
    table = dict(_table(idem, "wd"))
    assert table["call_0_1"].status is RecordStatus.in_flight
    with pytest.raises(IndeterminateToolCallError) as refused:
        await runner().resume(build(then), "wd", tenant=T)
    assert [c.call_id for c in refused.value.calls] == ["call_0_1"]
    assert effects == before
    assert set(_table(idem, "wd")) == set(table)
    await _resolve_truthfully(idem, "wd", "call_0_1", 1)
    run = await runner().resume(build(then), "wd", tenant=T)
    assert run.status is RunStatus.completed
    assert _results(provider) == [(f"call_0_{n}", str(n)) for n in range(5)]
    assert sorted(effects.values()) == [1] * 5


# --- N=1 as before ------------------------------------------------------------------------


async def test_n1_runs_each_async_call_in_the_runs_own_context_as_before() -> None:
    """Before parallel turns, the sequential turn awaited each async call directly: a
    context variable one call set (a session a client library keeps, say) was there for
    the next. N=1 is meant to be that turn exactly."""
    import contextvars

    session: contextvars.ContextVar[str] = contextvars.ContextVar("session", default="none")

    @tool(side_effects=False)
    async def login(n: int) -> str:
        """Opens a session the way a client library might."""
        session.set("open")
        return "logged in"

    @tool(side_effects=False)
    async def whoami(n: int) -> str:
        """Reads the session."""
        return session.get()

    agent = Agent("ctx", "Do.", [login, whoami])
    turn = [("login", {"n": 0}), ("whoami", {"n": 1})]
    provider = Recording(ScriptedProvider([turn, "done"]))
    run = await _runner(provider, MemoryIdempotencyStore(), MemoryCheckpointStore()).run(
        agent, "go", tenant=T, run_id="ctx"
    )
    assert run.status is RunStatus.completed
    assert _results(provider) == [("call_0_0", "logged in"), ("call_0_1", "open")]
