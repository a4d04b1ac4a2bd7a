"""Deciding what already ran: ``plan_resume`` and the ``ResumePlan`` it returns.

The plan decides; it does not act. For each call the frontier lists, and for each record
the run left *ahead* of its frontier, the idempotency store's record says whether it
completed (replay the outcome), never ran (dispatch it), or is in flight under a holder
that no longer carries the run (indeterminate: nobody can say, so nobody guesses). A holder
is never called "gone": its lease lapsed or was taken, yet it may still be running — only
its fences stop it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from tesserix_adk.checkpoint.payload import Boundary, Checkpoint
from tesserix_adk.errors import CheckpointCorruptError, IndeterminateToolCallError
from tesserix_adk.messages import refusal_of
from tesserix_adk.stores.protocols import (
    IdempotencyRecord,
    IdempotencyStore,
    RecordsFrom,
    RecordStatus,
    RunLease,
)
from tesserix_adk.timestamps import shown_time
from tesserix_adk.tools import key_digest

__all__ = [
    "as_seen_now",
    "damaged_owner",
    "plan_as_told",
    "left_in_doubt",
    "left_open",
    "PlannedCall",
    "ResumePlan",
    "ToolDisposition",
    "plan_resume",
    "plan_without_frontier",
    "refuse_if_undecidable",
]


class ToolDisposition(StrEnum):
    """What resume does with a call."""

    completed = "completed"
    never_ran = "never_ran"
    indeterminate = "indeterminate"


@dataclass(frozen=True, slots=True, kw_only=True)
class PlannedCall:
    """One call and the decision about it, with the reason in words an operator reads.

    ``ahead`` marks a record written after the frontier (the frontier does not list it);
    ``takeover`` marks an in-flight claim that is safe to take over and re-send.
    """

    call_id: str | None
    tool: str
    key: str | None
    disposition: ToolDisposition
    reason: str
    iteration: int | None
    arguments: Mapping[str, Any] | None = None
    ahead: bool = False
    takeover: bool = False
    side_effects: bool = True
    record: IdempotencyRecord | None = None

    def describe(self) -> str:
        """``<tool> (<call id>): <disposition> - <reason>``."""
        # A call without a call id is named by its key's digest: the key itself is what the
        # tool passes on to the world, and this sentence reaches logs, parked reasons, pages.
        name = self.call_id or (key_digest(self.key) if self.key else "no call id")
        return f"{self.tool} ({name}): {self.disposition} - {self.reason}"


@dataclass(frozen=True, slots=True, kw_only=True)
class ResumePlan:
    """The decision for every call a resume has to account for."""

    completed: tuple[PlannedCall, ...] = ()
    to_dispatch: tuple[PlannedCall, ...] = ()
    indeterminate: tuple[PlannedCall, ...] = ()

    @property
    def safe(self) -> bool:
        """Nothing is indeterminate: the run may be carried on."""
        return not self.indeterminate

    @property
    def calls(self) -> tuple[PlannedCall, ...]:
        """Every planned call, frontier calls first, in order."""
        return tuple(
            sorted(
                (*self.completed, *self.to_dispatch, *self.indeterminate),
                key=lambda p: (p.ahead, p.iteration if p.iteration is not None else -1),
            )
        )


async def left_in_doubt(checkpoint: Checkpoint, idempotency: IdempotencyStore) -> ResumePlan:
    """For a run that ended (a resume plans nothing for it): the calls it left in flight
    that may have acted (``left_open``), each indeterminate. A run cancelled while a call
    was in doubt ends so, and that call waits for an operator to say what it did."""
    records = await idempotency.records(checkpoint.tenant, checkpoint.run_id)
    return ResumePlan(
        indeterminate=tuple(
            PlannedCall(
                call_id=rec.call_id,
                tool=rec.tool,
                key=rec.key,
                disposition=ToolDisposition.indeterminate,
                reason=f"claimed in flight by {rec.holder} (fence {rec.fence}) at "
                f"{_when(rec.since)} and left so when the run ended {checkpoint.status}: "
                "nobody can say whether it ran; check the tool's own system and record what "
                "happened with `tesserix resolve`",
                iteration=rec.iteration,
                record=rec,
            )
            for rec in records
            if rec.tool is not None and left_open(rec)
        )
    )


def left_open(rec: IdempotencyRecord) -> bool:
    """Whether ``rec`` is a call of an ended run that may have acted and that nobody will
    send again: in flight, of a tool with side effects (an idempotent one too: it is sent
    again only if the model asks again, and a run that ended will not). A read-only call
    left in flight did nothing to ask a person about."""
    return (
        rec.tool is not None
        and rec.status is RecordStatus.in_flight
        and not (rec.flags is not None and not rec.flags.side_effects)
    )


async def plan_as_told(
    checkpoint: Checkpoint, idempotency: IdempotencyStore, lease: RunLease | None
) -> ResumePlan:
    """What a reader who takes no lease (``inspect``, the console) tells of the run's calls:
    the calls an ended run left open (``left_in_doubt``), else the resume's plan, as seen
    beside the run's live ``lease`` (``as_seen_now``)."""
    planned = (
        await left_in_doubt(checkpoint, idempotency)
        if checkpoint.status.finished
        else await plan_resume(checkpoint, idempotency)
    )
    return as_seen_now(planned, lease)


def as_seen_now(plan: ResumePlan, lease: RunLease | None) -> ResumePlan:
    """``plan`` as a reader who takes no lease tells it, given the run's live ``lease``
    (``None`` when none is live): a call in flight under that very holder is being carried
    now, not left by a holder that no longer carries the run. The disposition stays what a
    resume would find were that holder to stop."""
    if lease is None:
        return plan
    holder, fence = lease.holder, lease.fence

    def seen(p: PlannedCall) -> PlannedCall:
        rec = p.record
        if rec is None or rec.status is not RecordStatus.in_flight or rec.holder != holder:
            return p
        if rec.fence is not None and fence is not None and rec.fence != fence:
            return p
        return dataclasses.replace(
            p,
            reason=f"claimed in flight by {rec.holder} (fence {rec.fence}) at "
            f"{_when(rec.since)}, which holds the run's live lease: it is being carried now "
            "(should that holder stop before its outcome is recorded, nobody can say whether "
            "it ran)",
        )

    return ResumePlan(
        completed=tuple(map(seen, plan.completed)),
        to_dispatch=tuple(map(seen, plan.to_dispatch)),
        indeterminate=tuple(map(seen, plan.indeterminate)),
    )


def damaged_owner(rec: IdempotencyRecord, run_id: str, iteration: int, turn: set[str]) -> bool:
    """Whether ``rec``, found under the key of a call of another tool, is damage rather
    than two tools keyed alike: it is this run's record of this turn, yet names a tool the
    turn (``turn``: the tools it asked for) never asked for. Not by call id: a model may
    give two calls one id, and a turn asked again numbers its calls anew."""
    return (rec.run_id, rec.iteration) == (run_id, iteration) and rec.tool not in turn


def _said_never_ran(rec: IdempotencyRecord) -> None:
    """``CheckpointCorruptError`` unless ``rec`` reads as a ``never_ran`` record is made:
    only a person (or a reconciler) says a claimed call never ran, and says it of a call in
    flight, so such a record names who said it and holds no outcome and no completion. A
    completed record whose status alone was changed would otherwise send its call again."""
    if rec.by is None or rec.completed_at is not None or rec.outcome is not None:
        raise CheckpointCorruptError(
            f"the record of call {rec.call_id or '?'} ({rec.tool or 'a tool'}) says it never "
            "ran, but "
            + (
                "it holds the call's completion"
                if rec.completed_at is not None or rec.outcome is not None
                else "nobody is named as having said so"
            )
            + ": it was changed after it was written; it is not sent again"
        )


async def plan_resume(checkpoint: Checkpoint, idempotency: IdempotencyStore) -> ResumePlan:
    """Decide, with one batched look-up and one read of the run's records, what ran (from
    the frontier's iteration on, outcomes left out, where the store offers ``RecordsFrom``)."""
    if checkpoint.status.finished or checkpoint.is_tombstone:
        return ResumePlan()
    keys = [oc.key for oc in checkpoint.outstanding if oc.key is not None]
    found = await idempotency.lookup(keys, tenant=checkpoint.tenant) if keys else {}
    if isinstance(idempotency, RecordsFrom):
        # Only records at the frontier's iteration or later can be ahead of it.
        records = await idempotency.records_from(
            checkpoint.tenant, checkpoint.run_id, checkpoint.iteration
        )
    else:
        records = await idempotency.records(checkpoint.tenant, checkpoint.run_id)
    completed: list[PlannedCall] = []
    to_dispatch: list[PlannedCall] = []
    indeterminate: list[PlannedCall] = []
    buckets = {
        ToolDisposition.completed: completed,
        ToolDisposition.never_ran: to_dispatch,
        ToolDisposition.indeterminate: indeterminate,
    }

    for oc in checkpoint.outstanding:
        base: dict[str, Any] = {
            "call_id": oc.call.id,
            "tool": oc.call.name,
            "key": oc.key,
            "iteration": checkpoint.iteration,
            "arguments": oc.call.arguments,
            "side_effects": oc.side_effects,
        }
        safe_to_resend = not oc.side_effects or oc.idempotent
        if oc.key is None:
            if oc.side_effects:
                planned = PlannedCall(
                    **base,
                    disposition=ToolDisposition.indeterminate,
                    reason="side-effecting call without an idempotency key; nothing records "
                    "whether it ran",
                )
            else:
                refused = refusal_of(oc.call)
                planned = PlannedCall(
                    **base,
                    disposition=ToolDisposition.never_ran,
                    reason="no side effects; sent again"
                    if refused is None
                    else f"refused, never sent ({refused}); answered 'not sent' again",
                )
            buckets[planned.disposition].append(planned)
            continue
        rec = found.get(oc.key)
        if rec is None:
            planned = PlannedCall(
                **base, disposition=ToolDisposition.never_ran, reason="no record under its key"
            )
        elif rec.tool is not None and rec.tool != oc.call.name:
            turn = {o.call.name for o in checkpoint.outstanding}
            if damaged_owner(rec, checkpoint.run_id, checkpoint.iteration, turn):
                raise CheckpointCorruptError(
                    f"the record under the key of {oc.call.name} ({oc.call.id}) names tool "
                    f"{rec.tool!r}, which this turn never asked for; the store holds a "
                    "damaged row"
                )
            # Two tools keyed alike: the record is the other tool's call (run.dispatch).
            planned = PlannedCall(
                **base,
                disposition=ToolDisposition.never_ran,
                reason=f"its key names a call of {rec.tool}; answered 'not sent', never sent",
            )
        elif rec.status is RecordStatus.never_ran:
            _said_never_ran(rec)
            planned = PlannedCall(
                **base,
                disposition=ToolDisposition.never_ran,
                reason=f"{rec.by or 'an operator'} recorded that it never ran",
                record=rec,
            )
        elif rec.status is RecordStatus.completed:
            planned = PlannedCall(
                **base,
                disposition=ToolDisposition.completed,
                reason=_completed_reason(rec),
                record=rec,
            )
        elif oc.redacted:
            planned = PlannedCall(
                **base,
                disposition=ToolDisposition.indeterminate,
                reason=f"claimed in flight by {rec.holder} (fence {rec.fence}), and its "
                "arguments were redacted in the frontier; nobody can say whether it ran",
                record=rec,
            )
        elif safe_to_resend and rec.resendable_as(oc.call.name):
            planned = PlannedCall(
                **base,
                disposition=ToolDisposition.never_ran,
                reason=f"in flight under {rec.holder}; safe to send again "
                f"({'idempotent' if oc.idempotent else 'no side effects'})",
                takeover=True,
                record=rec,
            )
        elif rec.holding_run != checkpoint.run_id:
            # A business key two runs share: the other run may be sending it right now.
            whose = "that run's call"
            if rec.run_id != rec.holding_run:
                whose = f"run {rec.run_id}'s call, taken over by that run"
            planned = PlannedCall(
                **base,
                disposition=ToolDisposition.indeterminate,
                reason=f"claimed in flight under the same key by run {rec.holding_run} "
                f"({rec.holder}, fence {rec.fence}) at {_when(rec.since)}: {whose}, "
                "which it may still be sending; this run replays what that run records "
                "(while that run is carried, this one comes back later), and if that run "
                f"died with it in hand, it is resolved on run {rec.run_id}",
                record=rec,
            )
        else:
            planned = PlannedCall(
                **base,
                disposition=ToolDisposition.indeterminate,
                reason=f"claimed in flight by {rec.holder} (fence {rec.fence}) at "
                f"{_when(rec.since)}; that holder no longer carries the run (its lease lapsed "
                "or was taken), so nobody can say whether it ran",
                record=rec,
            )
        if oc.redacted and planned.disposition is ToolDisposition.never_ran:
            if planned.takeover:
                # In flight under a holder that may have sent it: re-sending is out (the
                # arguments are masked), so whether it ran is for an operator to say.
                planned = dataclasses.replace(
                    planned,
                    disposition=ToolDisposition.indeterminate,
                    takeover=False,
                    reason=f"in flight under {rec.holder if rec else 'a holder'}, and its "
                    "arguments were redacted in the frontier; it is not sent again with "
                    "masked arguments",
                )
            else:
                planned = dataclasses.replace(
                    planned,
                    reason=planned.reason + "; its arguments were redacted in the frontier, so "
                    "it is not sent: the model is told it was not sent",
                )
        buckets[planned.disposition].append(planned)

    listed = set(keys)
    at_model_call = checkpoint.boundary in (Boundary.after_model_call, Boundary.before_approval)
    _plan_ahead(
        records,
        listed=listed,
        iteration=checkpoint.iteration,
        at_model_call=at_model_call,
        completed=completed,
        to_dispatch=to_dispatch,
        indeterminate=indeterminate,
    )
    return ResumePlan(
        completed=tuple(completed),
        to_dispatch=tuple(to_dispatch),
        indeterminate=tuple(indeterminate),
    )


def _plan_ahead(
    records: list[IdempotencyRecord],
    *,
    listed: set[str],
    iteration: int,
    at_model_call: bool,
    completed: list[PlannedCall],
    to_dispatch: list[PlannedCall],
    indeterminate: list[PlannedCall],
) -> None:
    """Plan the records a run left ahead of its frontier (at ``iteration``)."""
    for rec in records:
        if rec.tool is None or rec.iteration is None or rec.key in listed:
            continue
        ahead = rec.iteration > iteration or (rec.iteration == iteration and at_model_call)
        if not ahead:
            continue
        if rec.status is RecordStatus.never_ran:
            _said_never_ran(rec)
            continue
        flags = rec.flags
        side_effects = True if flags is None else flags.side_effects
        base: dict[str, Any] = {
            "call_id": rec.call_id,
            "tool": rec.tool,
            "key": rec.key,
            "iteration": rec.iteration,
            "ahead": True,
            "side_effects": side_effects,
            "record": rec,
        }
        if rec.status is RecordStatus.completed:
            completed.append(
                PlannedCall(
                    **base,
                    disposition=ToolDisposition.completed,
                    reason=_completed_reason(rec) + f", ahead of the frontier (iteration "
                    f"{rec.iteration}); replayed if the model asks for it again",
                )
            )
        elif flags is not None and flags.safe_to_resend:
            to_dispatch.append(
                PlannedCall(
                    **base,
                    disposition=ToolDisposition.never_ran,
                    reason=f"in flight under {rec.holder} ahead of the frontier; safe to send "
                    "again",
                    takeover=True,
                )
            )
        else:
            indeterminate.append(
                PlannedCall(
                    **base,
                    disposition=ToolDisposition.indeterminate,
                    reason=f"claimed in flight by {rec.holder} (fence {rec.fence}) ahead of the "
                    f"frontier (iteration {rec.iteration}); nobody can say whether it ran",
                )
            )


async def plan_without_frontier(
    tenant: str, run_id: str, idempotency: IdempotencyStore
) -> ResumePlan:
    """The plan of a run that has records but no frontier (its first frontier could not
    be written): every record is ahead. One scan of the run's records."""
    records = await idempotency.records(tenant, run_id)
    completed: list[PlannedCall] = []
    to_dispatch: list[PlannedCall] = []
    indeterminate: list[PlannedCall] = []
    _plan_ahead(
        records,
        listed=set(),
        iteration=-1,
        at_model_call=False,
        completed=completed,
        to_dispatch=to_dispatch,
        indeterminate=indeterminate,
    )
    return ResumePlan(
        completed=tuple(completed),
        to_dispatch=tuple(to_dispatch),
        indeterminate=tuple(indeterminate),
    )


def _when(epoch: float) -> str:
    """A store-clock time as an operator reads it (UTC)."""
    return shown_time(epoch, "%Y-%m-%d %H:%M:%S UTC")


def _completed_reason(rec: IdempotencyRecord) -> str:
    if rec.by:
        return f"outcome recorded by {rec.by}"
    return "outcome recorded"


def refuse_if_undecidable(plan: ResumePlan) -> None:
    """Raise ``IndeterminateToolCallError`` naming every call nobody can decide."""
    if plan.safe:
        return
    names = ", ".join(p.describe() for p in plan.indeterminate)
    raise IndeterminateToolCallError(
        f"cannot tell whether {len(plan.indeterminate)} call(s) ran: {names}; check the "
        "tool's own system and record what happened with `tesserix resolve`",
        calls=plan.indeterminate,
    )
