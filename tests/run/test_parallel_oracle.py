"""Parallel turns against an oracle, by hypothesis: random widths (``parallel_tool_calls``),
random finish orders and one failure in one call, in one process with memory stores.

The oracle: results reach the model in its order; at most N calls run at once; a failure
cancels no started call and starts no more; a call in doubt is refused by name and, once an
operator says truthfully what happened, every key has exactly one effect.
"""

from __future__ import annotations

import asyncio
from collections import Counter

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
    StoreUnavailableError,
    ToolContext,
    tool,
)
from tesserix_adk.checkpoint.payload import encode_outcome
from tesserix_adk.messages import Role, ToolOutcome
from tesserix_adk.run.dispatch import COMPLETE_TRIES
from tesserix_adk.stores.protocols import RecordStatus
from tesserix_adk.testing.faults import FaultyIdempotencyStore, SimulatedCrash

T = "acme"


def _runner(
    provider: Recording,
    idem: FaultyIdempotencyStore,
    cps: MemoryCheckpointStore,
    leases: MemoryLeaseStore,
) -> AgentRunner:
    return AgentRunner(provider, idempotency=idem, checkpoints=Checkpointer(cps), leases=leases)


def _result_ids(provider: Recording) -> list[str | None]:
    """The tool results of the last request, as the model reads them."""
    return [m.tool_call_id for m in provider.requests[-1].messages if m.role is Role.tool]


FAULTS = ("crash", "claim_down", "complete_down")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    limit=st.integers(1, 4),
    delays=st.lists(st.integers(0, 3), min_size=1, max_size=5),
    fault=st.none() | st.tuples(st.sampled_from(FAULTS), st.integers(0, 4)),
)
def test_any_finish_order_and_failure_keeps_model_order_and_one_effect_per_key(
    limit: int, delays: list[int], fault: tuple[str, int] | None
) -> None:
    """Random widths, finish orders and one failure in one call: a death stand-in before
    its effect, a claim that never reaches the store, or an outcome that cannot be recorded
    after its effect. The run stops once the calls already started have finished (each
    recorded, none cancelled); no call is started once the failure is seen, and calls never
    started have no record; a call in doubt is refused by name,
    and an operator says truthfully what happened; the resume gives the model every result
    in its order, and every key has exactly one effect."""
    if fault is not None and fault[1] >= len(delays):
        fault = None
    asyncio.run(_oracle(limit, delays, fault))


async def _oracle(limit: int, delays: list[int], fault: tuple[str, int] | None) -> None:
    effects: Counter[str] = Counter()
    active = {"now": 0, "peak": 0}
    live = {"fault": fault}
    by_key: dict[str, int] = {}
    entered: list[int] = []
    after_failure: list[int] = []
    failed: list[int] = []
    claims = [0]
    tries = [0]
    dropped: dict[str, str] = {}
    inner = MemoryIdempotencyStore()

    def hook(phase: str, op: str, key: str) -> None:
        f = live["fault"]
        if f is None:
            return
        if phase == "after" and op == "release" and key == dropped.get("key"):
            failed.append(f[1])  # the call dropped its unsent claim: it fails now
        if phase != "before":
            return
        # Raised from the hook before the store: that one call's request never reaches it.
        if op == "claim":
            claims[0] += 1
            if f == ("claim_down", claims[0] - 1):
                dropped["key"] = key
                raise StoreUnavailableError("claim never reached the store (simulated)")
        elif op == "complete" and f == ("complete_down", by_key.get(key)):
            tries[0] += 1
            if tries[0] == COMPLETE_TRIES:  # the call gives up: the failure is seen now
                failed.append(f[1])
            raise StoreUnavailableError("complete never reached the store (simulated)")

    idem = FaultyIdempotencyStore(inner, hook=hook)

    @tool
    async def step(n: int, ctx: ToolContext) -> int:
        """A step with an effect, done after a delay."""
        assert ctx.idempotency_key is not None
        by_key[ctx.idempotency_key] = n
        (after_failure if failed else entered).append(n)
        active["now"] += 1
        active["peak"] = max(active["peak"], active["now"])
        try:
            await asyncio.sleep(delays[n] / 200)
            if live["fault"] == ("crash", n):
                failed.append(n)
                raise SimulatedCrash
            effects[ctx.idempotency_key] += 1
        finally:
            active["now"] -= 1
        return n * 10

    agent = Agent("oracle", "Do steps.", [step], parallel_tool_calls=limit)
    turn = [("step", {"n": n}) for n in range(len(delays))]
    cps, leases = MemoryCheckpointStore(), MemoryLeaseStore()
    provider = Recording(ScriptedProvider([turn, "done"]))
    if fault is None:
        run = await _runner(provider, idem, cps, leases).run(agent, "go", tenant=T, run_id="o")
    else:
        kind, at = fault
        expected: type[BaseException] = SimulatedCrash if kind == "crash" else StoreUnavailableError
        with pytest.raises(expected):
            await _runner(provider, idem, cps, leases).run(agent, "go", tenant=T, run_id="o")
        live["fault"] = None
        assert failed == [at]
        records = {r.call_id: r for r in await inner.records(T, "o") if r.tool == "step"}
        failing = f"call_0_{at}"
        # No call was started once the failure was seen: a call entering its tool after it
        # was handed out before (its claim was on its way); whatever had started finished
        # and is recorded.
        # (At most ``limit`` calls run at once, so fewer than that many beyond those that
        # had entered and the failing one were handed out.)
        window = len({at, *entered}) + limit
        assert all(n < window for n in after_failure), (after_failure, window)
        entered += after_failure
        started = {f"call_0_{n}" for n in entered}
        if kind == "claim_down":
            assert failing not in records
            assert set(records) == started
        else:
            assert records[failing].status is RecordStatus.in_flight
            assert set(records) == started | {failing}
        for call_id, rec in records.items():
            if call_id != failing:
                assert rec.status is RecordStatus.completed
        if kind != "claim_down":
            with pytest.raises(IndeterminateToolCallError) as refused:
                await _runner(provider, idem, cps, leases).resume(agent, "o", tenant=T)
            assert [c.call_id for c in refused.value.calls] == [failing]
            key = records[failing].key
            if kind == "crash":  # it died before its effect
                await inner.resolve(key, tenant=T, never_ran=True, by="ops")
            else:  # its effect happened; the operator records it
                told = encode_outcome(ToolOutcome(call_id=failing, content=at * 10), Redactor())
                await inner.resolve(key, told, tenant=T, by="ops")
        run = await _runner(provider, idem, cps, leases).resume(agent, "o", tenant=T)
    assert run.status is RunStatus.completed
    assert _result_ids(provider) == [f"call_0_{n}" for n in range(len(delays))]
    results = [m.content for m in provider.requests[-1].messages if m.role is Role.tool]
    assert results == [str(n * 10) for n in range(len(delays))]
    assert len(effects) == len(delays) and set(effects.values()) == {1}
    assert active["peak"] <= limit
