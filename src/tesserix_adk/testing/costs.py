"""The request-count checks the conformance suites run, as functions of their own.

A suite's test calls one with the store under test and its backend's ``RoundTrips`` (see
``testing.counting``); a test of the checks themselves calls one with a store built to fail
it (a look-up per key, a read that scans every step), to show the check can fail.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from tesserix_adk.checkpoint.payload import (
    Boundary,
    Checkpoint,
    CheckpointStatus,
    OutstandingCall,
)
from tesserix_adk.checkpoint.planning import ResumePlan, plan_resume
from tesserix_adk.messages import ToolCall
from tesserix_adk.stores.capabilities import step_history
from tesserix_adk.stores.protocols import (
    CheckpointStore,
    HistoryStore,
    IdempotencyRecord,
    IdempotencyStore,
    StoredCheckpoint,
    ToolFlags,
)
from tesserix_adk.testing.counting import RoundTrips, counted

__all__ = [
    "Planner",
    "check_fetch_is_constant",
    "check_lookup_is_batched",
    "check_plan_calls",
    "check_reads_are_constant",
]

T = "acme"
R = "run-1"


async def _claim(
    store: IdempotencyStore, key: str, *, call_id: str, iteration: int
) -> IdempotencyRecord:
    return await store.claim(
        key,
        holder="worker-a",
        tenant=T,
        run_id=R,
        iteration=iteration,
        tool="book_seat",
        call_id=call_id,
        flags=ToolFlags(),
    )


# --- idempotency -----------------------------------------------------------------------


async def check_lookup_is_batched(store: IdempotencyStore, trips: RoundTrips) -> None:
    """Looking up ten keys sends the backend as many requests as looking up one.

    ``trips`` counts what ``store``'s backend sends; a store making a round trip per key
    fails here whatever else it does right.
    """
    keys = [f"batch-{i}" for i in range(8)]
    for i, key in enumerate(keys):
        await _claim(store, key, call_id=f"call_{i}", iteration=0)
    await store.complete(keys[0], b"x", tenant=T, holder="worker-a")
    # A backend may check its server once on first use; that is not the look-up's cost.
    await store.lookup(keys[:1], tenant=T)
    before = trips.count
    one = await store.lookup(keys[:1], tenant=T)
    single = trips.count - before
    before = trips.count
    many = await store.lookup([*keys, "absent-1", "absent-2"], tenant=T)
    batched = trips.count - before
    assert set(one) == {keys[0]}
    assert set(many) == set(keys)
    assert single >= 1, "round_trips saw nothing sent: it is not wired to this store's driver"
    assert batched == single, (
        f"looking up 10 keys sent {batched} requests where 1 key sent {single}: "
        "the look-up is not one batched call"
    )


Planner = Callable[[Checkpoint, IdempotencyStore], Awaitable[ResumePlan]]


async def check_plan_calls(store: IdempotencyStore, planner: Planner = plan_resume) -> None:
    """Planning a resume of six outstanding calls makes at most two calls to ``store``
    (one batched ``lookup`` and one ``records``), never one per call. ``planner`` is the
    kit's ``plan_resume``; another can be passed to show what this check refuses."""
    keys = [f"plan-{i}" for i in range(6)]
    for i, key in enumerate(keys[:4]):
        await _claim(store, key, call_id=f"call_{i}", iteration=1)
    for key in keys[:2]:
        await store.complete(key, b'{"ok": true}', tenant=T, holder="worker-a")
    frontier = Checkpoint(
        tenant=T,
        run_id=R,
        agent_name="agent",
        step=3,
        boundary=Boundary.after_model_call,
        status=CheckpointStatus.running,
        iteration=1,
        outstanding=tuple(
            OutstandingCall(call=ToolCall(id=f"call_{i}", name="book_seat"), key=key)
            for i, key in enumerate(keys)
        ),
    )
    watched, calls = counted(store)
    plan = await planner(frontier, watched)
    assert sorted(p.key or "" for p in plan.completed) == keys[:2]
    assert sorted(p.key or "" for p in plan.indeterminate) == keys[2:4]
    assert sorted(p.key or "" for p in plan.to_dispatch) == keys[4:]
    assert sum(calls.values()) <= 2, f"planning made {dict(calls)} store calls, at most 2 allowed"
    assert calls["lookup"] <= 1, f"planning looked keys up {calls['lookup']} times, not once"


# --- checkpoints -----------------------------------------------------------------------


async def check_reads_are_constant(store: CheckpointStore, trips: RoundTrips) -> None:
    """``latest`` and ``at`` send as many requests after 12 steps as after 1: a resume reads
    one frontier in a constant number of round trips (SPEC §8). ``trips`` counts what the
    store's backend sends."""
    await store.put(T, R, b"step-1", step=1, fence=1)
    await store.latest(T, R)  # a first use may check the server once
    short = await _read_costs(store, trips)
    for step in range(2, 13):
        await store.put(T, R, b"step-%d" % step, step=step, fence=1)
    long = await _read_costs(store, trips)
    assert short["latest"] >= 1, "round_trips saw nothing sent: it is not wired to the driver"
    assert long == short, f"after 12 steps the reads sent {long} requests, after 1 step {short}"


async def _read_costs(store: CheckpointStore, trips: RoundTrips) -> dict[str, int]:
    """Requests sent by ``latest`` and by ``at`` of step 1."""
    costs: dict[str, int] = {}
    before = trips.count
    assert await store.latest(T, R) is not None
    costs["latest"] = trips.count - before
    before = trips.count
    assert await step_history(store).at(T, R, 1) == StoredCheckpoint(
        payload=b"step-1", step=1, fence=1
    )
    costs["at"] = trips.count - before
    return costs


# --- history ---------------------------------------------------------------------------


async def check_fetch_is_constant(store: HistoryStore, trips: RoundTrips) -> None:
    """Fetching a 40-message transcript sends as many requests as fetching one message: a
    resume reads the transcript in a constant number of round trips (SPEC §8), never one
    per message. ``trips`` counts what the store's backend sends."""
    first = await store.append(T, R, [b"m-0"], fence=1, after=None)
    await store.fetch(first)  # a first use may check the server once
    before = trips.count
    assert await store.fetch(first) == [b"m-0"]
    short = trips.count - before
    longer = await store.append(T, R, [b"m-%d" % i for i in range(1, 40)], fence=1, after=first)
    before = trips.count
    assert len(await store.fetch(longer)) == 40
    long = trips.count - before
    assert short >= 1, "round_trips saw nothing sent: it is not wired to the driver"
    assert long == short, f"fetching 40 messages sent {long} requests, 1 message {short}"
