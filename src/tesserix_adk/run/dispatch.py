"""One turn's tool calls, and the dispatch unit each keyed call goes through:
claim → (lease check) → invoke → complete.

A turn's calls go out side by side when the agent allows it (``parallel_tool_calls``), each
through the whole unit on its own; results reach the model in the model's order. Each call
reports ``ToolCallStarted`` right before it is sent or its outcome replayed and
``ToolCallFinished`` once it has its result (a call answered without being sent reports
only the latter, ``refused``).

No claim, no dispatch. A claim or complete whose reply was lost (``StoreReplyLostError``, or
a driver error the store did not translate) is settled by reading the record back, never by
assuming; one that never reached the store (``StoreUnavailableError``) is not. A call whose
arguments were masked in the frontier is never sent: the model is told why instead.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic_core import to_jsonable_python

from tesserix_adk.checkpoint.checkpointer import OFF_LOOP_BYTES, text_weight
from tesserix_adk.checkpoint.payload import (
    Grant,
    OutstandingCall,
    RecordedOutcome,
    decode_outcome,
    recorded_outcome,
)
from tesserix_adk.checkpoint.planning import PlannedCall, ToolDisposition
from tesserix_adk.errors import (
    AdkError,
    CheckpointCorruptError,
    IndeterminateToolCallError,
    StaleFenceError,
    StoreReplyLostError,
    StoreUnavailableError,
    ToolOutcomeUnknownError,
)
from tesserix_adk.messages import Message, ToolCall, ToolOutcome
from tesserix_adk.run.attempt import Attempt
from tesserix_adk.run.events import (
    CallDisposition,
    ToolCallFinished,
    ToolCallStarted,
    ToolCallUnsent,
)
from tesserix_adk.run.parallel import first_error, in_model_order
from tesserix_adk.run.parts import RunParts
from tesserix_adk.run.state import RunState
from tesserix_adk.stores.protocols import IdempotencyRecord, RecordStatus, ToolFlags
from tesserix_adk.tools import Tool, ToolContext, accepts_ctx, call_maybe_async

__all__ = ["COMPLETE_TRIES", "MASKED_CALL", "REFUSED_ARGUMENTS", "call_tool", "dispatch_turn"]

# Stands in for arguments the kit refused to carry (nested too deep); such a call is
# answered with the reason, never sent.
REFUSED_ARGUMENTS = "__tesserix_refused__"

_log = logging.getLogger("tesserix_adk.runner")

# How often this attempt tries to record an outcome it still holds before giving up.
COMPLETE_TRIES = 3
_BACKOFF = (0.05, 0.2, 0.5)

MASKED_CALL = (
    "not sent: its arguments held a secret, and the kit never stores secrets, so the "
    "arguments this run kept are masked and sending them would be wrong; ask for the call "
    "again with the real values if it is still needed"
)


async def dispatch_turn(
    parts: RunParts, run: RunState, attempt: Attempt, calls: Sequence[OutstandingCall]
) -> None:
    """Run the turn's calls, at most ``agent.parallel_tool_calls`` at a time, each through
    its own claim, and append their results in the model's order, whatever order they
    finished in. A failure starts no more calls but lets those started finish (see
    ``run.parallel``); then it is raised, and nothing of the turn is appended."""
    grants = {g.call_id: g for g in run.grants}
    jobs = [functools.partial(_answer, parts, run, attempt, oc, grants) for oc in calls]
    outcomes = await in_model_order(jobs, run.agent.parallel_tool_calls, choose=_turn_error)
    run.messages.extend(Message.tool_result(outcome) for outcome in outcomes)
    run.observation = [
        {
            "call_id": oc.call.id,
            "tool": oc.call.name,
            "content": outcome.content,
            "is_error": outcome.is_error,
        }
        for oc, outcome in zip(calls, outcomes, strict=True)
    ]
    # Grants of a finished turn are settled, every grant of its requests with them (a
    # request found again may have named calls by ids this turn does not use): a later
    # call that happens to get such an id is never taken for decided.
    answered = {c.call.id for c in calls}
    settled = {g.request for g in run.grants if g.call_id in answered}
    run.grants = [g for g in run.grants if g.call_id not in answered and g.request not in settled]


async def _answer(
    parts: RunParts,
    run: RunState,
    attempt: Attempt,
    oc: OutstandingCall,
    grants: Mapping[str, Grant],
) -> ToolOutcome:
    """One call's result: refused without a dispatch (unknown tool, refused arguments, not
    approved), or through the dispatch unit."""
    tool = run.agent.tools.get(oc.call.name)
    refused = oc.call.arguments.get(REFUSED_ARGUMENTS)
    if refused is not None:
        content = f"not sent: {refused}"
    elif tool is None:
        content = f"unknown tool {oc.call.name!r}"
    elif tool.requires_approval and not _approved(grants.get(oc.call.id)):
        content = _denial(grants.get(oc.call.id))
    else:
        return await call_tool(parts, run, attempt, tool, oc)
    outcome = ToolOutcome(call_id=oc.call.id, content=content, is_error=True)
    _finished(run, attempt, oc, outcome, CallDisposition.refused)
    return outcome


def _turn_error(errors: Sequence[BaseException]) -> BaseException:
    """The error a failed turn raises: every call found in doubt named in one refusal
    (several may be, side by side), else the first failure."""
    chosen = first_error(errors)
    doubts = [e for e in errors if isinstance(e, IndeterminateToolCallError)]
    if not isinstance(chosen, IndeterminateToolCallError) or len(doubts) < 2:
        return chosen
    calls = [c for e in doubts for c in e.calls]
    return IndeterminateToolCallError(
        f"cannot tell whether {len(calls)} call(s) ran: "
        f"{'; '.join(c.describe() for c in calls)}; check the tools' own systems and record "
        "what happened with `tesserix resolve`",
        calls=calls,
    )


def _started(run: RunState, attempt: Attempt, oc: OutstandingCall) -> None:
    attempt.emit(
        ToolCallStarted(
            run_id=run.run_id, iteration=run.iteration, call_id=oc.call.id, name=oc.call.name
        )
    )


def _finished(
    run: RunState,
    attempt: Attempt,
    oc: OutstandingCall,
    outcome: ToolOutcome,
    disposition: CallDisposition,
) -> ToolOutcome:
    return _finished_by(run, attempt, oc, outcome, disposition, None)


def _finished_by(
    run: RunState,
    attempt: Attempt,
    oc: OutstandingCall,
    outcome: ToolOutcome,
    disposition: CallDisposition,
    by: str | None,
) -> ToolOutcome:
    """``ToolCallFinished`` reported, naming who settled it (a reconciler, a person)."""
    attempt.emit(
        ToolCallFinished(
            run_id=run.run_id,
            iteration=run.iteration,
            call_id=oc.call.id,
            name=oc.call.name,
            disposition=disposition,
            is_error=outcome.is_error,
            by=by,
            content=outcome.content,
        )
    )
    return outcome


def _unsent(run: RunState, attempt: Attempt, oc: OutstandingCall, error: AdkError) -> None:
    attempt.emit(
        ToolCallUnsent(
            run_id=run.run_id,
            iteration=run.iteration,
            call_id=oc.call.id,
            name=oc.call.name,
            error=type(error).__name__,
        )
    )


async def call_tool(
    parts: RunParts, run: RunState, attempt: Attempt, tool: Tool, oc: OutstandingCall
) -> ToolOutcome:
    """One call through the dispatch unit; the outcome the model is told.

    Two calls of one attempt under one key (a key function that names the business
    object, twice in a parallel turn) go one after the other: the claim is the attempt's
    own either way, so only this keeps the second from being sent beside the first; it
    then finds the first's outcome recorded and replays it."""
    if oc.key is None:
        return await _call_tool(parts, run, attempt, tool, oc)
    while (busy := attempt.sending.get(oc.key)) is not None:
        await busy.wait()
    done = attempt.sending[oc.key] = asyncio.Event()
    try:
        return await _call_tool(parts, run, attempt, tool, oc)
    finally:
        del attempt.sending[oc.key]
        done.set()


async def _call_tool(
    parts: RunParts, run: RunState, attempt: Attempt, tool: Tool, oc: OutstandingCall
) -> ToolOutcome:
    ctx = ToolContext(
        tenant=run.tenant,
        run_id=run.run_id,
        call=oc.call,
        idempotency_key=oc.key,
        fence=attempt.fence,
        iteration=run.iteration,
        state=run.state,
    )
    # Before every dispatch, keyed or not: a holder that may have lost the run sends
    # nothing (an unkeyed call has no fence downstream to stop it).
    attempt.guard()
    if oc.key is None:
        if oc.redacted:
            masked = ToolOutcome(call_id=oc.call.id, content=MASKED_CALL, is_error=True)
            return _finished(run, attempt, oc, masked, CallDisposition.refused)
        _started(run, attempt, oc)
        try:
            outcome = await _invoke(attempt, tool, oc.call, ctx)
        except _NotSent as stop:
            _unsent(run, attempt, oc, stop.error)
            raise stop.error from None
        return _finished(run, attempt, oc, await _told(parts, outcome), CallDisposition.dispatched)
    rec = await _claim(parts, run, attempt, tool, oc)
    if _held_elsewhere(rec, attempt) and not oc.redacted and _safe_to_resend(tool):
        # Another attempt's claim (an earlier one of this run, or a live run sharing a
        # business key) on a call that may be sent again (no side effects, or the far side
        # deduplicates by our key): take it over, as a resume would; the other attempt
        # then finds its outcome recorded or keeps its own (see ``_complete``).
        attempt.takeover_keys.add(oc.key)
        rec = await _claim(parts, run, attempt, tool, oc)
    if rec.status is RecordStatus.completed and rec.outcome is not None:
        _started(run, attempt, oc)
        known = decode_outcome(rec.outcome, oc.call.id)
        # Recorded with a ``by``: a reconciler or an operator said what happened.
        how = CallDisposition.settled if rec.by else CallDisposition.replayed
        return _finished_by(run, attempt, oc, known, how, rec.by)
    if _held_elsewhere(rec, attempt):
        doubt = PlannedCall(
            call_id=oc.call.id,
            tool=tool.name,
            key=oc.key,
            disposition=ToolDisposition.indeterminate,
            reason=f"claimed in flight by {rec.holder} (fence {rec.fence}), another attempt; "
            "nobody can say whether it ran",
            iteration=run.iteration,
            arguments=oc.call.arguments,
            side_effects=tool.side_effects,
            record=rec,
        )
        raise IndeterminateToolCallError(
            f"cannot tell whether 1 call(s) ran: {doubt.describe()}; check the tool's own "
            "system and record what happened with `tesserix resolve`",
            calls=[doubt],
        )
    if rec.status is not RecordStatus.in_flight:
        raise CheckpointCorruptError(
            f"the record of {tool.name} ({oc.call.id}) is {rec.status} without an outcome; "
            "it is not sent again"
        )
    how = CallDisposition.dispatched
    if oc.redacted:
        how = CallDisposition.refused
        outcome = ToolOutcome(call_id=oc.call.id, content=MASKED_CALL, is_error=True)
    else:
        _started(run, attempt, oc)
        try:
            outcome = await _invoke(attempt, tool, oc.call, ctx)
        except _NotSent as stop:
            # The lease check stopped the call before it started: nothing is in doubt, so
            # the claim goes rather than leave every later resume refusing it.
            _unsent(run, attempt, oc, stop.error)
            await _release_unsent(parts, run, attempt, oc.key)
            raise stop.error from None
    recorded = await _recorded(parts, outcome)
    try:
        await _complete(parts, run, attempt, tool, oc, recorded.payload)
    except StaleFenceError:
        if not _safe_to_resend(tool):
            raise
        # Taken over meanwhile by an attempt that sent it again (safe for this tool): what
        # it recorded is the answer, or ours while it has recorded nothing yet.
        taken = await _read_back(parts, run, oc.key)
        if taken is not None and taken.status is RecordStatus.completed and taken.outcome:
            return _finished(run, attempt, oc, decode_outcome(taken.outcome, oc.call.id), how)
    return _finished(run, attempt, oc, recorded.outcome if recorded.replaced else outcome, how)


def _held_elsewhere(rec: IdempotencyRecord, attempt: Attempt) -> bool:
    return rec.status is RecordStatus.in_flight and rec.holder != attempt.holder


def _safe_to_resend(tool: Tool) -> bool:
    return not tool.side_effects or tool.idempotent


async def _recorded(parts: RunParts, outcome: ToolOutcome) -> RecordedOutcome:
    """The outcome as the record keeps it; a large one is redacted in a worker thread so
    the event loop keeps renewing leases meanwhile."""
    if text_weight(outcome.content) > OFF_LOOP_BYTES:
        return await asyncio.to_thread(recorded_outcome, outcome, parts.redactor)
    return recorded_outcome(outcome, parts.redactor)


async def _told(parts: RunParts, outcome: ToolOutcome) -> ToolOutcome:
    """What the model is told of an unkeyed call: what a record would have said (redacted
    off the event loop when large, as a keyed call's record is)."""
    recorded = await _recorded(parts, outcome)
    return recorded.outcome if recorded.replaced else outcome


async def _claim(
    parts: RunParts, run: RunState, attempt: Attempt, tool: Tool, oc: OutstandingCall
) -> IdempotencyRecord:
    assert oc.key is not None
    try:
        return await parts.idempotency.claim(
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
        await _release_unsent(parts, run, attempt, oc.key)
        raise
    except AdkError:
        raise  # a stale fence, ...: nothing was claimed
    except Exception as exc:
        lost = exc  # a driver error the store did not translate: the outcome is unknown
    rec = await _read_back(parts, run, oc.key)
    if rec is not None and (
        rec.status is RecordStatus.completed
        or (rec.status is RecordStatus.in_flight and rec.holder == attempt.holder)
    ):
        return rec
    # Perhaps applied, certainly not sent: drop the claim if it is there, so a retry does
    # not find a claim of ours in doubt.
    await _release_unsent(parts, run, attempt, oc.key)
    raise StoreUnavailableError(
        f"the claim of {tool.name} ({oc.call.id}) lost its reply and could not be read back, "
        f"so it was not dispatched: {lost}"
    ) from lost


async def _complete(
    parts: RunParts,
    run: RunState,
    attempt: Attempt,
    tool: Tool,
    oc: OutstandingCall,
    payload: bytes,
) -> None:
    """Record the outcome, retrying while this attempt still holds it in memory."""
    assert oc.key is not None
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
            rec = await _read_back(parts, run, oc.key)
            if rec is not None and rec.status is RecordStatus.completed:
                return
        if attempt_no + 1 < COMPLETE_TRIES:  # no wait after the last: the turn stops now
            await asyncio.sleep(_BACKOFF[attempt_no])
    raise StoreUnavailableError(
        f"{tool.name} ({oc.call.id}) ran but its outcome could not be recorded after "
        f"{COMPLETE_TRIES} tries ({last}); it stays claimed in flight, so a resume refuses it "
        "as indeterminate until an operator records what happened (`tesserix resolve`)"
    ) from last


async def _release_unsent(parts: RunParts, run: RunState, attempt: Attempt, key: str) -> None:
    """Drop this attempt's claim on a call it did not send (a no-op if there is none)."""
    try:
        await asyncio.shield(
            parts.idempotency.release(
                key, tenant=run.tenant, holder=attempt.holder, undispatched=True
            )
        )
    except Exception as exc:  # then it stays in flight, and a resume says so
        _log.warning("dropping the unsent claim %s failed: %r", key, exc)


class _NotSent(Exception):
    """The guard refused right before the tool started: nothing was sent."""

    def __init__(self, error: AdkError) -> None:
        super().__init__(str(error))
        self.error = error


async def _read_back(parts: RunParts, run: RunState, key: str) -> IdempotencyRecord | None:
    """The record as the store holds it now, or ``None`` if it cannot be read either."""
    for attempt_no in range(COMPLETE_TRIES):
        try:
            found = await parts.idempotency.lookup([key], tenant=run.tenant)
        except Exception as exc:
            _log.warning("reading back %s failed: %r", key, exc)
            await asyncio.sleep(_BACKOFF[attempt_no])
            continue
        return found.get(key)
    return None


async def _invoke(attempt: Attempt, tool: Tool, call: ToolCall, ctx: ToolContext) -> ToolOutcome:
    """Run the tool (or its replay stub); an ``Exception`` is the call's error outcome,
    except the guard's own refusal, which stops the run with nothing sent, and a
    ``ToolOutcomeUnknownError``, which stops it with the call left in doubt."""
    refused: list[AdkError] = []

    def guard() -> None:
        try:
            attempt.guard()
        except AdkError as exc:
            refused.append(exc)
            raise

    try:
        stub = None if attempt.stubs is None else attempt.stubs.get(tool.name)
        if stub is not None:
            guard()
            args = dict(call.arguments)
            value = await call_maybe_async(
                stub, args, ctx if accepts_ctx(stub) else None, thread=True
            )
            result = _stub_result(value)
        else:
            result = await tool.invoke(call.arguments, ctx, guard=guard)
        return ToolOutcome(call_id=call.id, content=to_jsonable_python(result, fallback=str))
    except ToolOutcomeUnknownError as exc:
        # Sent, and whether it took effect is unknown: told to the model as an error it
        # would be asked for again under a new key. Its claim stays in flight, for the
        # reconciler or an operator, as if the process had died inside the call.
        _log.warning("%s (%s) may have run, its outcome unknown: %s", tool.name, call.id, exc)
        exc.add_note(f"the call {tool.name} ({call.id}) is left in doubt, its claim in flight")
        raise
    except Exception as exc:
        if refused and exc is refused[0]:
            raise _NotSent(refused[0]) from None
        return ToolOutcome(call_id=call.id, content=f"{type(exc).__name__}: {exc}", is_error=True)


def _stub_result(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {**value, "stub": True}
    return {"stub": True, "value": value}


def _approved(grant: Grant | None) -> bool:
    return grant is not None and grant.approved


def _denial(grant: Grant | None) -> str:
    if grant is None:  # pragma: no cover - approvals are asked before every dispatch
        return "not approved"
    note = f": {grant.note}" if grant.note else ""
    return f"denied by {grant.by}{note}"
