"""The record side of the dispatch unit: a call's claim, its outcome recorded, an unsent
claim dropped, a record read back when a reply was lost.

A claim or complete whose reply was lost (``StoreReplyLostError``, or a driver error the
store did not translate) is settled by reading the record back, never by assuming; one
that never reached the store (``StoreUnavailableError``) is not. An outcome in hand is
recorded to the end even if the run is cancelled meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Awaitable
from typing import TypeVar

from tesserix_adk.checkpoint.checkpointer import OFF_LOOP_BYTES, text_weight
from tesserix_adk.checkpoint.payload import (
    OutcomeState,
    OutstandingCall,
    RecordedOutcome,
    record_tag,
    recorded_outcome,
)
from tesserix_adk.checkpoint.redaction import Masked
from tesserix_adk.checkpoint.state_json import secret_typed, state_to_json
from tesserix_adk.errors import (
    AdkError,
    CheckpointError,
    StoreReplyLostError,
    StoreUnavailableError,
    ToolOutcomeUnknownError,
)
from tesserix_adk.messages import ToolCall, ToolOutcome
from tesserix_adk.run.attempt import Attempt
from tesserix_adk.run.invoking import converted, error_text
from tesserix_adk.run.parts import RunParts
from tesserix_adk.run.state import RunState
from tesserix_adk.stores.protocols import IdempotencyRecord, RecordStatus, ToolFlags
from tesserix_adk.tools import ThreadReturned, Tool

__all__ = [
    "COMPLETE_TRIES",
    "claim",
    "complete",
    "read_back",
    "record",
    "redacted_record",
    "release_unsent",
    "returned_outcome",
    "state_now",
    "to_the_end",
    "told",
]

_log = logging.getLogger("tesserix_adk.runner")

T = TypeVar("T")

# How often this attempt tries to record an outcome it still holds before giving up.
COMPLETE_TRIES = 3
_BACKOFF = (0.05, 0.2, 0.5)


async def claim(
    parts: RunParts, run: RunState, attempt: Attempt, tool: Tool, oc: OutstandingCall
) -> IdempotencyRecord:
    assert oc.key is not None
    group, key = attempt.group, oc.key

    async def drop() -> None:
        await release_unsent(parts, run, attempt, key)

    if group is not None:
        # Dropped again should the group fail, asked for before the claim is sent: a claim
        # whose reply was lost with the group's COMMIT in its message may be durable.
        group.undo.append(drop)
        group.claimed.add(key)

    def answered(rec: IdempotencyRecord) -> IdempotencyRecord:
        if group is not None and not (
            rec.status is RecordStatus.in_flight and rec.holder == attempt.holder
        ):
            # Not a claim this call took (an outcome recorded under the key, a twin's or
            # another run's): nothing of it is dropped, whatever becomes of the group.
            group.undo.remove(drop)
        return rec

    try:
        taken = await parts.idempotency.claim(
            oc.key,
            holder=attempt.holder,
            tenant=run.tenant,
            run_id=run.run_id,
            iteration=run.iteration,
            tool=tool.name,
            call_id=oc.call.id,
            flags=ToolFlags(side_effects=tool.side_effects, idempotent=tool.idempotent),
            fence=attempt.fence,
            takeover=oc.key in attempt.takeover_keys,
        )
    except StoreReplyLostError as exc:
        lost: Exception = exc
    except StoreUnavailableError:
        # Said not to have taken effect; should a driver have misjudged that, dropping the
        # claim (a no-op if absent) keeps a call never sent from being called in doubt.
        await release_unsent(parts, run, attempt, oc.key)
        raise
    except AdkError:
        raise  # a stale fence, ...: nothing was claimed
    except Exception as exc:
        lost = exc  # a driver error the store did not translate: the outcome is unknown
    else:
        return answered(taken)
    rec = await read_back(parts, run, oc.key)
    if rec is not None and (
        rec.status is RecordStatus.completed
        or (rec.status is RecordStatus.in_flight and rec.holder == attempt.holder)
    ):
        return answered(rec)
    # Perhaps applied, certainly not sent: drop the claim if it is there, so a retry does
    # not find a claim of ours in doubt.
    await release_unsent(parts, run, attempt, oc.key)
    raise StoreUnavailableError(
        f"the claim of {tool.name} ({oc.call.id}) lost its reply and could not be read back, "
        f"so it was not dispatched: {lost}"
    ) from lost


async def complete(
    parts: RunParts,
    run: RunState,
    attempt: Attempt,
    tool: Tool,
    oc: OutstandingCall,
    payload: bytes,
) -> None:
    """Record the outcome, retrying while this attempt still holds it in memory."""
    assert oc.key is not None
    if attempt.group is not None and oc.key not in attempt.group.claimed:
        # Recorded in the open group: should it fail to commit, recorded again, on its own.
        # Asked before the first try: a try that loses the group (SQLite rolled the whole
        # transaction back; PostgreSQL lost the connection) sends every later one to the
        # lost group too, and then only this records it. (A call claimed in this same
        # group was never sent: its claim and answer stand or fall together.)
        attempt.group.redo.append(lambda: complete(parts, run, attempt, tool, oc, payload))
    last: Exception | None = None
    for attempt_no in range(COMPLETE_TRIES):
        unknown = True  # whether the store may have applied it: then read it back
        try:
            await parts.idempotency.complete(
                oc.key, payload, tenant=run.tenant, holder=attempt.holder
            )
            return
        except StoreReplyLostError as exc:
            last = exc
        except StoreUnavailableError as exc:
            last, unknown = exc, False
        except AdkError:
            raise
        except Exception as exc:
            last = exc
        if unknown:
            rec = await read_back(parts, run, oc.key)
            if rec is not None and rec.status is RecordStatus.completed:
                return
        if attempt_no + 1 < COMPLETE_TRIES:  # no wait after the last: the turn stops now
            await asyncio.sleep(_BACKOFF[attempt_no])
    raise StoreUnavailableError(
        f"{tool.name} ({oc.call.id}) ran but its outcome could not be recorded after "
        f"{COMPLETE_TRIES} tries ({last}); it stays claimed in flight, so a resume refuses it "
        "as indeterminate until an operator records what happened (`tesserix resolve`)"
    ) from last


async def release_unsent(parts: RunParts, run: RunState, attempt: Attempt, key: str) -> None:
    """Drop this attempt's claim on a call it did not send (a no-op if there is none). Never
    under a key this attempt sent a call under: the claim in flight there may be that
    call's (a twin's failed claim must not drop its sibling's, which went out). Nor one it
    took over: the holder it took it from may have sent the call."""
    if key in attempt.sent_keys or key in attempt.takeover_keys:
        _log.warning("the claim %s may be a sent call's, left in flight (in doubt)", key)
        return
    try:
        await asyncio.shield(
            parts.idempotency.release(
                key, tenant=run.tenant, holder=attempt.holder, undispatched=True
            )
        )
    except Exception as exc:  # then it stays in flight, and a resume says so
        _log.warning("dropping the unsent claim %s failed: %r", key, Masked(exc))


async def read_back(parts: RunParts, run: RunState, key: str) -> IdempotencyRecord | None:
    """The record as the store holds it now, or ``None`` if it cannot be read either."""
    for attempt_no in range(COMPLETE_TRIES):
        try:
            found = await parts.idempotency.lookup([key], tenant=run.tenant)
        except Exception as exc:
            _log.warning("reading back %s failed: %r", key, Masked(exc))
            await asyncio.sleep(_BACKOFF[attempt_no])
            continue
        return found.get(key)
    return None


async def redacted_record(
    parts: RunParts,
    outcome: ToolOutcome,
    *,
    record: str | None = None,
    state: OutcomeState | None = None,
) -> RecordedOutcome:
    """The outcome as the record keeps it, naming ``record`` (its ``record_tag``) when
    given, with the run's ``state``; a large one is redacted in a worker thread so the
    event loop keeps renewing leases meanwhile."""
    encode = functools.partial(
        recorded_outcome, outcome, parts.redactor, record=record, state=state
    )
    weight = text_weight(outcome.content) + (0 if state is None else text_weight(state.state))
    if weight > OFF_LOOP_BYTES:
        return await asyncio.to_thread(encode)
    return encode()


async def told(parts: RunParts, outcome: ToolOutcome) -> ToolOutcome:
    """What the model is told of an unkeyed call: what a record would have said (redacted
    off the event loop when large, as a keyed call's record is)."""
    recorded = await redacted_record(parts, outcome)
    return recorded.outcome if recorded.replaced else outcome


async def record(
    parts: RunParts,
    run: RunState,
    attempt: Attempt,
    tool: Tool,
    oc: OutstandingCall,
    outcome: ToolOutcome,
) -> RecordedOutcome:
    assert oc.key is not None
    recorded = await redacted_record(
        parts, outcome, record=record_tag(run.tenant, oc.key), state=state_now(run)
    )
    await complete(parts, run, attempt, tool, oc, recorded.payload)
    return recorded


def state_now(run: RunState) -> OutcomeState | None:
    """The run's state as the call's record keeps it: what the tool wrote into it after
    the last frontier, which a resume replaying this call restores. ``None`` for a run
    without state, or one whose state no frontier can hold (the run stops at its next
    frontier for that; the call's record is written all the same)."""
    if run.state is None:
        return None
    schema = run.agent.state_schema
    try:
        data = state_to_json(run.state, schema)
        return OutcomeState(state=data, redacted=secret_typed(run.state, schema))
    except CheckpointError:
        return None


async def to_the_end(awaitable: Awaitable[T], *, grace: float | None = None) -> T:
    """``awaitable`` finished even if the caller is cancelled meanwhile (then the
    cancellation goes on once it has); with ``grace``, waited for at most that many seconds
    after the cancellation, then cancelled too."""
    task = asyncio.ensure_future(awaitable)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        deadline = None if grace is None else asyncio.get_running_loop().time() + grace
        while not task.done():
            left = None if deadline is None else deadline - asyncio.get_running_loop().time()
            if left is not None and left <= 0:
                _log.warning("gave up waiting for %r after the run was cancelled", task)
                task.cancel()
                left = None
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait({task}, timeout=left)
        if not task.cancelled():
            task.exception()  # retrieved; the cancellation is what the caller gets
        raise


async def returned_outcome(call: ToolCall, cancelled: ThreadReturned) -> ToolOutcome | None:
    """The outcome a sync tool's thread returned after its call was cancelled (converted
    off the event loop when it is not plainly cheap, as a live call's is); ``None`` when it
    is unknown (a lost reply) or the thread died another way."""
    error = cancelled.done.exception()
    if error is None:
        return ToolOutcome(call_id=call.id, content=await converted(cancelled.done.result()))
    if isinstance(error, ToolOutcomeUnknownError) or not isinstance(error, Exception):
        return None
    return ToolOutcome(call_id=call.id, content=error_text(error), is_error=True)
