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
import contextlib
import functools
import logging
from collections.abc import Mapping, Sequence

from tesserix_adk.checkpoint.payload import (
    Grant,
    OutstandingCall,
    RecordedOutcome,
    decode_outcome,
    record_tag,
)
from tesserix_adk.checkpoint.planning import damaged_owner
from tesserix_adk.errors import (
    AdkError,
    CheckpointCorruptError,
    IndeterminateToolCallError,
    StaleFenceError,
)
from tesserix_adk.messages import REFUSED_ARGUMENTS, Message, Role, ToolOutcome, refusal_of
from tesserix_adk.run import grouping
from tesserix_adk.run.attempt import Attempt
from tesserix_adk.run.cancelling import not_sent_if_cancelled
from tesserix_adk.run.claims import (
    held_elsewhere,
    in_doubt_elsewhere,
    in_doubt_here,
    in_doubt_here_error,
    may_take_over,
    safe_to_resend,
    unless_carried,
)
from tesserix_adk.run.events import (
    CallDisposition,
    ToolCallFinished,
    ToolCallStarted,
    ToolCallUnsent,
)
from tesserix_adk.run.invoking import NotSent, invoke
from tesserix_adk.run.parallel import first_error, in_model_order
from tesserix_adk.run.parts import RunParts
from tesserix_adk.run.recording import (
    COMPLETE_TRIES,
    claim,
    complete,
    read_back,
    record,
    redacted_record,
    release_unsent,
    returned_outcome,
    state_now,
    to_the_end,
    told,
)
from tesserix_adk.run.state import RunState
from tesserix_adk.run.unsendable import invalid_arguments, masked, unsendable
from tesserix_adk.stores.protocols import IdempotencyRecord, RecordStatus
from tesserix_adk.tools import NotStarted, ThreadReturned, Tool, ToolContext

__all__ = [
    "COMPLETE_TRIES",
    "REFUSED_ARGUMENTS",
    "call_tool",
    "refusal_of",
    "close_turn",
    "dispatch_turn",
]


_log = logging.getLogger("tesserix_adk.runner")


async def dispatch_turn(
    parts: RunParts, run: RunState, attempt: Attempt, calls: Sequence[OutstandingCall]
) -> None:
    """Run the turn's calls, at most ``agent.parallel_tool_calls`` at a time, each through
    its own claim, and append their results in the model's order, whatever order they
    finished in. A failure starts no more calls but lets those started finish (see
    ``run.parallel``); then it is raised, and nothing of the turn is appended."""
    grants = {g.call_id: g for g in run.grants}
    attempt.positions = {id(oc): i for i, oc in enumerate(calls)}
    # Every call about to be sent asks for a cancel once it is claimed (``call_tool``): one
    # acknowledged before the claim, while the model thought or an earlier call was out,
    # stops it.
    jobs = [functools.partial(_answer, parts, run, attempt, oc, grants) for oc in calls]
    side_by_side = run.agent.parallel_tool_calls > 1 and len(calls) > 1
    if side_by_side:
        # Calls in flight together share no transaction: each claim commits on its own.
        await grouping.commit(attempt)
        attempt.folding = False
    try:
        outcomes = await in_model_order(jobs, run.agent.parallel_tool_calls, choose=_turn_error)
    finally:
        attempt.folding = True
    # The last outcome commits with the ``after_tool_result`` frontier (``run.grouping``).
    close_turn(run, calls, outcomes)


def close_turn(
    run: RunState, calls: Sequence[OutstandingCall], outcomes: Sequence[ToolOutcome]
) -> None:
    """The turn's results (``outcomes``, in the model's order) appended to the run, its
    observation kept, and its grants settled: what ``after_tool_result`` writes."""
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
    approved), or through the dispatch unit (which asks for a cancel before sending it)."""
    tool = run.agent.tools.get(oc.call.name)
    refused = refusal_of(oc.call)
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
            run_id=run.run_id,
            iteration=run.iteration,
            call_id=oc.call.id,
            name=oc.call.name,
            position=attempt.position_of(oc),
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
            position=attempt.position_of(oc),
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
            position=attempt.position_of(oc),
            error=type(error).__name__,
        )
    )


async def _record_returned(
    parts: RunParts,
    run: RunState,
    attempt: Attempt,
    tool: Tool,
    oc: OutstandingCall,
    cancelled: ThreadReturned,
) -> None:
    returned = await returned_outcome(oc.call, cancelled)
    if returned is not None:
        await record(parts, run, attempt, tool, oc, returned)


async def call_tool(
    parts: RunParts,
    run: RunState,
    attempt: Attempt,
    tool: Tool,
    oc: OutstandingCall,
) -> ToolOutcome:
    """One call through the dispatch unit; the outcome the model is told. A call about to
    be sent for the first time is answered "not sent" instead if the run's cancel was
    asked: a keyed one asks once its claim is durable, so a cancel acknowledged before the
    claim stops it (the canceller's record is written before its acknowledgement, the
    claim before this look); an unkeyed one asks just before it goes out. A recorded call
    is still replayed, one in doubt still refused.

    Two calls of one attempt under one key (a key function that names the business
    object, twice in a parallel turn) go one after the other: the claim is the attempt's
    own either way, so only this keeps the second from being sent beside the first; it
    then finds the first's outcome recorded and replays it, or, the first's outcome
    unknown (its claim still in flight), is refused as in doubt. The first having failed
    (its claim refused, the store down), the second is not sent either: it fails as the
    first did, as in a turn of one call at a time, which stops at the first failure."""
    if oc.key is None:
        return await _call_tool(parts, run, attempt, tool, oc)
    while (busy := attempt.sending.get(oc.key)) is not None:
        await busy.wait()
    if (failed := attempt.failed_keys.get(oc.key)) is not None:
        raise failed
    done = attempt.sending[oc.key] = asyncio.Event()
    try:
        return await _call_tool(parts, run, attempt, tool, oc)
    except BaseException as exc:
        attempt.failed_keys[oc.key] = exc
        raise
    finally:
        del attempt.sending[oc.key]
        done.set()


async def _call_tool(
    parts: RunParts,
    run: RunState,
    attempt: Attempt,
    tool: Tool,
    oc: OutstandingCall,
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
            hidden = ToolOutcome(call_id=oc.call.id, content=masked(run), is_error=True)
            return _finished(run, attempt, oc, hidden, CallDisposition.refused)
        # The frontier naming it is durable before it goes out; the cancel is looked at
        # last, with that COMMIT sent along.
        unsent = await grouping.committing_with(
            parts.commits_with_next, attempt, not_sent_if_cancelled(parts, run, oc)
        )
        if unsent is not None:
            return _finished(run, attempt, oc, unsent, CallDisposition.refused)
        invalid = invalid_arguments(attempt, tool, oc)
        if invalid is not None:
            return _finished(run, attempt, oc, invalid, CallDisposition.refused)
        marks = attempt.send_marks if oc.side_effects else None
        if marks is not None:
            await marks.mark(oc)
        _started(run, attempt, oc)
        try:
            outcome = await invoke(attempt, tool, oc.call, ctx, parts.redactor)
        except NotSent as stop:
            if marks is not None:
                await marks.unsent(oc)
            _unsent(run, attempt, oc, stop.error)
            raise stop.error from None
        return _finished(run, attempt, oc, await told(parts, outcome), CallDisposition.dispatched)
    refusal = unsendable(run, attempt, tool, oc)
    if refusal is not None:
        return await _not_claimed(parts, run, attempt, tool, oc, refusal)
    rec = await claim(parts, run, attempt, tool, oc)
    if (other := _keyed_by_another_tool(run, attempt, oc, rec)) is not None:
        return other
    if held_elsewhere(rec, attempt) and rec.holding_run != run.run_id:
        # Another run's claim (a business key two runs share): while that run is carried it
        # comes back later, never taken over under it (its outcome would then be fenced
        # out and lost). Not carried: it may have recorded its outcome, or let its claim
        # go, since the claim was read.
        await unless_carried(attempt, run, tool, oc, rec)
        rec = await claim(parts, run, attempt, tool, oc)
    if held_elsewhere(rec, attempt) and may_take_over(rec, tool):
        # Another attempt's claim (an earlier one of this run, or a run no longer carried
        # that shares a business key) on a call that may be sent again (no side effects, or
        # the far side deduplicates by our key): take it over, as a resume would; the other
        # attempt then finds its outcome recorded or keeps its own (see ``_complete``).
        attempt.takeover_keys.add(oc.key)
        rec = await claim(parts, run, attempt, tool, oc)
    if in_doubt_here(rec, attempt):
        # This attempt's own claim, still in flight, of a call it sent under this key (a
        # twin whose sibling lost its reply): that call may have happened. Neither sent
        # again nor its claim dropped.
        raise in_doubt_here_error(run, tool, oc, rec)
    unsent = None
    if rec.status is RecordStatus.in_flight and not held_elsewhere(rec, attempt):
        # No claim, no dispatch: the claim (and what joined it) is durable before the call
        # goes out. The cancel is looked at after the claim, in its transaction, with the
        # COMMIT sent along: a cancel recorded before the claim is seen (its canceller
        # acknowledges only once it is recorded), and one recorded after finds the call in
        # hand.
        try:
            unsent = await grouping.committing_with(
                parts.commits_with_next, attempt, not_sent_if_cancelled(parts, run, oc)
            )
        except (Exception, asyncio.CancelledError):
            # The look or its COMMIT failed, or the run was cancelled: the call is not
            # sent, so its claim goes (in the group while it is open, so none of it
            # commits; else alone), or every resume would find it in doubt.
            await to_the_end(release_unsent(parts, run, attempt, oc.key))
            raise
    # Else nothing goes out here (replayed, refused in doubt): the group stays open for the
    # turn's next writes, committed before anything leaves.
    if rec.status is RecordStatus.completed and rec.outcome is not None:
        return _replayed(run, attempt, oc, rec)
    if held_elsewhere(rec, attempt):
        raise in_doubt_elsewhere(run, tool, oc, rec)
    if rec.status is not RecordStatus.in_flight:
        raise CheckpointCorruptError(
            f"the record of {tool.name} ({oc.call.id}) is {rec.status} without an outcome; "
            "it is not sent again"
        )
    if unsent is not None:
        # Claimed by this attempt and never sent: the claim goes.
        await release_unsent(parts, run, attempt, oc.key)
        return _finished(run, attempt, oc, unsent, CallDisposition.refused)
    _started(run, attempt, oc)
    attempt.sent_keys.add(oc.key)
    try:
        outcome = await invoke(attempt, tool, oc.call, ctx, parts.redactor)
    except NotSent as stop:
        # The lease check stopped the call before it started: nothing is in doubt, so
        # the claim goes rather than leave every later resume refusing it.
        attempt.sent_keys.discard(oc.key)
        _unsent(run, attempt, oc, stop.error)
        await release_unsent(parts, run, attempt, oc.key)
        raise stop.error from None
    except ThreadReturned as cancelled:
        if isinstance(cancelled.done.exception(), NotStarted):
            # Cancelled while the call waited for a thread, which then refused to start
            # it: nothing went out, so the claim goes (fenced: if the run was taken over,
            # the taker decides the call).
            attempt.sent_keys.discard(oc.key)
            with contextlib.suppress(Exception):
                await to_the_end(release_unsent(parts, run, attempt, oc.key))
            raise
        # Cancelled while a sync tool ran, and its thread has returned: what it did is
        # known, so it is recorded (to the end, however often cancelled) and the
        # cancellation goes on, rather than leaving the call in doubt.
        with contextlib.suppress(Exception):
            await to_the_end(_record_returned(parts, run, attempt, tool, oc, cancelled))
        raise
    # The outcome is in hand: redacted and recorded to the end, however often the run is
    # cancelled meanwhile, with no cancellation point between the tool's return and its
    # record. It commits with the next call's claim, or at the turn's end.
    kept: list[RecordedOutcome] = []
    try:
        await to_the_end(_redacted_and_completed(parts, run, attempt, tool, oc, outcome, kept))
    except StaleFenceError:
        if not safe_to_resend(tool):
            raise
        # Taken over meanwhile by an attempt that sent it again (safe for this tool): what
        # it recorded is the answer, or ours while it has recorded nothing yet.
        taken = await read_back(parts, run, oc.key)
        if taken is not None and taken.status is RecordStatus.completed and taken.outcome:
            known = decode_outcome(
                taken.outcome, oc.call.id, record=record_tag(run.tenant, taken.key)
            )
            return _finished(run, attempt, oc, known, CallDisposition.dispatched)
    [recorded] = kept
    answer = recorded.outcome if recorded.replaced else outcome
    return _finished(run, attempt, oc, answer, CallDisposition.dispatched)


async def _redacted_and_completed(
    parts: RunParts,
    run: RunState,
    attempt: Attempt,
    tool: Tool,
    oc: OutstandingCall,
    outcome: ToolOutcome,
    kept: list[RecordedOutcome],
) -> None:
    """The outcome redacted as the record keeps it (into ``kept``), then recorded: in a
    group where the attempt folds, committed with the next call's claim or, the turn's
    last, with its ``after_tool_result`` frontier."""
    assert oc.key is not None
    recorded = await redacted_record(
        parts, outcome, record=record_tag(run.tenant, oc.key), state=state_now(run)
    )
    kept.append(recorded)
    await grouping.begin(parts.groups, attempt)
    await complete(parts, run, attempt, tool, oc, recorded.payload)


async def _not_claimed(
    parts: RunParts,
    run: RunState,
    attempt: Attempt,
    tool: Tool,
    oc: OutstandingCall,
    refusal: ToolOutcome,
) -> ToolOutcome:
    """A keyed call that cannot go out, looked up and never claimed, so nothing is kept
    under its key (a business key names the order, not this call: a refusal kept there
    would answer every later call of that order), and no death between a claim and its
    release can leave it in doubt. A recorded outcome is still replayed (a call that ran,
    whatever its validation says today); a claim in flight elsewhere may be a call that ran
    (an earlier attempt's, or a run sharing the key): in doubt, or come back later while
    its run is carried."""
    assert oc.key is not None
    rec = (await parts.idempotency.lookup([oc.key], tenant=run.tenant)).get(oc.key)
    if rec is not None and (other := _keyed_by_another_tool(run, attempt, oc, rec)) is not None:
        return other
    if rec is not None and held_elsewhere(rec, attempt) and rec.holding_run != run.run_id:
        await unless_carried(attempt, run, tool, oc, rec)
        rec = (await parts.idempotency.lookup([oc.key], tenant=run.tenant)).get(oc.key)
    if rec is not None and in_doubt_here(rec, attempt):
        raise in_doubt_here_error(run, tool, oc, rec)
    if rec is not None and rec.status is RecordStatus.completed and rec.outcome is not None:
        return _replayed(run, attempt, oc, rec)
    if rec is not None and held_elsewhere(rec, attempt):
        raise in_doubt_elsewhere(run, tool, oc, rec)
    return _finished(run, attempt, oc, refusal, CallDisposition.refused)


def _replayed(
    run: RunState, attempt: Attempt, oc: OutstandingCall, rec: IdempotencyRecord
) -> ToolOutcome:
    """The recorded outcome, replayed. Read before it is reported started: one that cannot
    be read is no replay, and an attempt ending with a call started reports it as sent."""
    assert rec.outcome is not None
    if (other := _keyed_by_another_tool(run, attempt, oc, rec)) is not None:
        return other
    known = decode_outcome(rec.outcome, oc.call.id, record=record_tag(run.tenant, rec.key))
    _started(run, attempt, oc)
    # Recorded with a ``by``: a reconciler or an operator said what happened.
    how = CallDisposition.settled if rec.by else CallDisposition.replayed
    return _finished_by(run, attempt, oc, known, how, rec.by)


def _keyed_by_another_tool(
    run: RunState, attempt: Attempt, oc: OutstandingCall, rec: IdempotencyRecord
) -> ToolOutcome | None:
    """``oc`` answered "not sent" when ``rec``, the record under its key, is another tool's
    call (two tools keyed alike: ``order-5`` for a charge and for its refund); else
    ``None``. In flight or done, that call's outcome is no answer to this one, and this
    one cannot be sent under a key that is taken."""
    if rec.tool is None or rec.tool == oc.call.name:
        return None
    turn = _turn_tools(run)
    if turn is not None and damaged_owner(rec, run.run_id, run.iteration, turn):
        # This run's record of this turn naming a tool the turn never asked for: not two
        # tools keyed alike but a damaged row, and never a different answer.
        raise CheckpointCorruptError(
            f"the record under the key of {oc.call.name} ({oc.call.id}) names tool "
            f"{rec.tool!r}, which this turn never asked for; the store holds a damaged row"
        )
    refusal = ToolOutcome(
        call_id=oc.call.id,
        content=f"not sent: its idempotency key names a call of {rec.tool} made already; "
        f"{oc.call.name} and {rec.tool} make the same keys, and each tool needs keys of its "
        "own",
        is_error=True,
    )
    return _finished(run, attempt, oc, refusal, CallDisposition.refused)


def _turn_tools(run: RunState) -> set[str] | None:
    """The tools the turn being dispatched asked for: its assistant message is the run's
    last (its results are appended once the turn closes). ``None`` when the run holds no
    messages (a Temporal call activity's): not known, so no record is judged damaged by it
    (the turn's plan, from its frontier, still is)."""
    for message in reversed(run.messages):
        if message.role is Role.assistant:
            return {c.name for c in message.tool_calls}
    return None


def _approved(grant: Grant | None) -> bool:
    return grant is not None and grant.approved


def _denial(grant: Grant | None) -> str:
    if grant is None:  # pragma: no cover - approvals are asked before every dispatch
        return "not approved"
    note = f": {grant.note}" if grant.note else ""
    return f"denied by {grant.by}{note}"
