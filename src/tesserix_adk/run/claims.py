"""Where a keyed call stands by its record, from the dispatch unit's side: claimed by this
attempt, by another attempt of the run, or by another run sharing a business key; whether
it may be sent again; and the refusals, in doubt or "come back later", that follow."""

from __future__ import annotations

from tesserix_adk.checkpoint.payload import OutstandingCall
from tesserix_adk.checkpoint.planning import PlannedCall, ToolDisposition
from tesserix_adk.errors import IndeterminateToolCallError
from tesserix_adk.run.attempt import Attempt
from tesserix_adk.run.holding import carried_now, come_back_later
from tesserix_adk.run.state import RunState
from tesserix_adk.stores.protocols import IdempotencyRecord, RecordStatus
from tesserix_adk.tools import Tool

__all__ = [
    "held_elsewhere",
    "in_doubt_elsewhere",
    "in_doubt_here",
    "in_doubt_here_error",
    "may_take_over",
    "safe_to_resend",
    "unless_carried",
]


def held_elsewhere(rec: IdempotencyRecord, attempt: Attempt) -> bool:
    """Whether ``rec`` is a claim in flight under another holder than this attempt."""
    return rec.status is RecordStatus.in_flight and rec.holder != attempt.holder


def in_doubt_here(rec: IdempotencyRecord, attempt: Attempt) -> bool:
    """Whether ``rec`` is this attempt's own claim still in flight under a key it sent a
    call under (a twin whose sibling lost its reply)."""
    return (
        rec.status is RecordStatus.in_flight
        and rec.holder == attempt.holder
        and rec.key in attempt.sent_keys
    )


def safe_to_resend(tool: Tool) -> bool:
    """Whether a call of ``tool`` may be sent again: no side effects, or the far side
    deduplicates by our key."""
    return not tool.side_effects or tool.idempotent


def may_take_over(rec: IdempotencyRecord, tool: Tool) -> bool:
    """Whether a call of ``tool`` may take over ``rec``, a claim another attempt holds in
    flight: only a call of the same tool, safe to send again both today and as it was sent
    (its record's flags). A key two tools share (a business key) names another call, whose
    claim this one may neither send again nor settle with its own outcome."""
    return safe_to_resend(tool) and rec.resendable_as(tool.name)


def _in_doubt_call(
    run: RunState, tool: Tool, oc: OutstandingCall, rec: IdempotencyRecord
) -> PlannedCall:
    return PlannedCall(
        call_id=oc.call.id,
        tool=tool.name,
        key=oc.key,
        disposition=ToolDisposition.indeterminate,
        reason="a call of this attempt under the same key was sent and its outcome is unknown",
        iteration=run.iteration,
        arguments=oc.call.arguments,
        side_effects=tool.side_effects,
        record=rec,
    )


def in_doubt_elsewhere(
    run: RunState, tool: Tool, oc: OutstandingCall, rec: IdempotencyRecord
) -> IndeterminateToolCallError:
    """The refusal of a call whose claim another attempt (of this run, or another run's
    under a shared key) holds in flight: that call may have run."""
    who = f"{rec.holder} (fence {rec.fence})"
    if rec.holding_run != run.run_id:
        who = f"run {rec.holding_run!r} ({rec.holder}, fence {rec.fence})"
    doubt = PlannedCall(
        call_id=oc.call.id,
        tool=tool.name,
        key=oc.key,
        disposition=ToolDisposition.indeterminate,
        reason=f"claimed in flight by {who}, another attempt; nobody can say whether it ran",
        iteration=run.iteration,
        arguments=oc.call.arguments,
        side_effects=tool.side_effects,
        record=rec,
    )
    return IndeterminateToolCallError(
        f"cannot tell whether 1 call(s) ran: {doubt.describe()}; check the tool's own "
        "system and record what happened with `tesserix resolve`",
        calls=[doubt],
    )


async def unless_carried(
    attempt: Attempt, run: RunState, tool: Tool, oc: OutstandingCall, rec: IdempotencyRecord
) -> None:
    """``ResumeConflictError`` while the other run whose claim ``rec`` is (a business key
    two runs share) is carried: its holder may be sending the call, so this run comes back
    once it has its outcome (replayed then), rather than be refused in doubt and parked."""
    leases = attempt.lease.store if attempt.lease is not None else None
    if await carried_now(leases, run.tenant, rec.holding_run):
        raise come_back_later(f"{tool.name} ({oc.call.id})", rec)


def in_doubt_here_error(
    run: RunState, tool: Tool, oc: OutstandingCall, rec: IdempotencyRecord
) -> IndeterminateToolCallError:
    """This attempt's own claim, still in flight, of a call it sent under this key (a twin
    whose sibling lost its reply): that call may have happened."""
    return IndeterminateToolCallError(
        f"cannot tell whether {tool.name} ({oc.call.id}) ran: a call of this attempt "
        f"under the same key was sent and its outcome is unknown; check the tool's own "
        "system and record what happened with `tesserix resolve`",
        calls=[_in_doubt_call(run, tool, oc, rec)],
    )
