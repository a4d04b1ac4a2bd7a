"""Approvals: ask a person before a call that needs one, and take their decision.

A turn whose calls need approval records one ``ApprovalRequest`` (arguments redacted) and a
``before_approval`` frontier naming it, then the run waits. Once decided, the decision
becomes the run's grants and the turn goes on as any other.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence

from tesserix_adk.checkpoint.payload import (
    Boundary,
    CheckpointStatus,
    Grant,
    OutstandingCall,
    PendingApproval,
)
from tesserix_adk.checkpoint.redaction import Masked, Redactor
from tesserix_adk.errors import (
    CheckpointCorruptError,
    CheckpointTooLargeError,
    ConfigurationError,
)
from tesserix_adk.messages import ToolCall, refusal_of
from tesserix_adk.run.attempt import Attempt
from tesserix_adk.run.frontier import write_frontier
from tesserix_adk.run.parts import RunParts
from tesserix_adk.run.result import Run, RunStatus
from tesserix_adk.run.state import RunState
from tesserix_adk.stores.protocols import (
    ApprovalRequest,
    ApprovalStatus,
    ApprovalStore,
    WorkIndex,
    WorkState,
)
from tesserix_adk.tools import canonical_json

# The longest note a grant carries into the run's frontiers, in characters: one turn's
# grants each hold it, and each denied call's answer repeats it, so a long one would make
# every frontier of the run too large to write. The approval keeps the whole note.
GRANT_NOTE_CHARS = 4000

__all__ = [
    "approval_request_id",
    "ask_approval",
    "of_the_turn",
    "take_decision",
    "told_waiting",
    "whose",
]

_log = logging.getLogger("tesserix_adk.runner")

KIT_DECIDER = "tesserix (the run cannot go on)"
"""Who an approval request the kit withdraws is decided by, in the approvals' audit."""


async def ask_approval(
    parts: RunParts, run: RunState, attempt: Attempt, calls: Sequence[OutstandingCall]
) -> Run | None:
    """The waiting run if some call of the turn needs an approval not yet given; else
    ``None`` (nothing to ask)."""
    decided = {g.call_id for g in run.grants}
    asking = [
        oc
        for oc in calls
        if (tool := run.agent.tools.get(oc.call.name)) is not None
        and tool.requires_approval
        and oc.call.id not in decided
        # A call the kit refuses is never sent: nobody is asked about it.
        and refusal_of(oc.call) is None
    ]
    needing = [oc.call for oc in asking]
    if not needing:
        return None
    assert parts.approvals is not None  # AgentRunner checks the agent
    attempt.guard()
    redactor = parts.redactor
    request = await parts.approvals.request(
        run.tenant,
        run.run_id,
        [
            ToolCall(id=c.id, name=c.name, arguments=redactor.value(dict(c.arguments)))
            for c in needing
        ],
        iteration=run.iteration,
        fence=attempt.fence,
        id=approval_request_id(run.tenant, run.run_id, run.iteration, asking, redactor),
    )
    _own_request(request, run)
    _same_calls(request, needing, redactor)
    if request.status is not ApprovalStatus.pending:
        # Asked before by an attempt that died before its frontier named the request, and
        # decided since: the decision stands, for the calls of this turn it was made on
        # (a model asked again names its calls anew; the request keeps the old ids).
        _grant(parts, run, request, calls, now_named=needing)
        return None
    pending = PendingApproval(id=request.id, calls=tuple(c.id for c in needing))
    written = await write_frontier(
        parts,
        run,
        attempt,
        Boundary.before_approval,
        outstanding=calls,
        status=CheckpointStatus.waiting_approval,
        pending=pending,
    )
    if written is False:
        await _refuse_too_large(parts, run, request)
    return run.result(RunStatus.waiting_approval, fence=attempt.fence, pending_approval=request)


async def _refuse_too_large(parts: RunParts, run: RunState, request: ApprovalRequest) -> None:
    """A frontier asking for approval refused as too large: a tombstone stands in its
    place and no resume can act on the decision, so the run stops here, typed and final,
    and the request is withdrawn (denied by the kit, saying why) rather than left for a
    person whose approval nothing would carry out. (Any other failure to write it leaves
    the run resumable from its last frontier, which asks for the same request again.)"""
    error = None if parts.checkpoints is None else parts.checkpoints.last_error
    if not isinstance(error, CheckpointTooLargeError):
        return
    why = (
        f"the frontier asking for approval of {', '.join(c.name for c in request.calls)} is "
        f"too large to write ({error}); nothing was sent, a tombstone stands in its place and "
        f"the run cannot be carried on (approval request {request.id} is withdrawn): start "
        "it again with smaller arguments"
    )
    assert parts.approvals is not None
    try:
        await parts.approvals.decide(
            run.tenant, request.id, approved=False, by=KIT_DECIDER, note=why
        )
    except Exception as exc:  # the refusal below is what matters; the request stays
        _log.warning(
            "run %s: approval request %s not withdrawn: %r", run.run_id, request.id, Masked(exc)
        )
    raise CheckpointTooLargeError(why, retryable=False) from error


async def take_decision(
    parts: RunParts,
    run: RunState,
    attempt: Attempt,
    pending: PendingApproval,
    calls: Sequence[OutstandingCall],
) -> Run | None:
    """``None`` once the request is decided (its grants added); else the waiting run."""
    if parts.approvals is None:
        raise ConfigurationError("this run waits on an approval; the runner has no store")
    request = await parts.approvals.get(run.tenant, pending.id)
    if request is None:
        # The frontier stands and names it: a store that lost it was damaged, or restored
        # apart from the checkpoints; not a run that never was (exit 4, not 1).
        raise CheckpointCorruptError(
            f"approval request {pending.id!r}, which run {run.run_id!r} waits on, is gone "
            "from the approval store"
        )
    _own_request(request, run)
    if request.status is ApprovalStatus.pending:
        return run.result(RunStatus.waiting_approval, fence=attempt.fence, pending_approval=request)
    # The frontier names the calls as this run's transcript does; a request found again
    # after a death may carry the ids an earlier answer of the model gave them.
    # Matched among the calls a request can name (refused calls ask nobody).
    askable = [
        oc
        for oc in calls
        if refusal_of(oc.call) is None
        and (tool := run.agent.tools.get(oc.call.name)) is not None
        and tool.requires_approval
    ]
    named = _in_request_order(pending.calls, askable)
    _same_calls(request, named, parts.redactor, masked=True)
    _grant(
        parts, run, request, calls, now_named=named if len(named) == len(request.calls) else None
    )
    return None


def of_the_turn(request: ApprovalRequest, tenant: str, run_id: str, iteration: int) -> bool:
    """Whether ``request`` is run ``run_id``'s of ``tenant``, of turn ``iteration``: another
    run's row under its id (rows swapped or copied, another tenant's run of the same id
    too) carries that run's decision, never this one's. A resume refuses such a request,
    and ``inspect`` and the console say so (``whose``)."""
    return (request.tenant, request.run_id, request.iteration) == (tenant, run_id, iteration)


def whose(request: ApprovalRequest) -> str:
    """Whose request it is, in words: ``run 'r' of tenant 't' at turn 2``."""
    return f"run {request.run_id!r} of tenant {request.tenant!r} at turn {request.iteration}"


def _own_request(request: ApprovalRequest, run: RunState) -> None:
    """A request found under this run's id must be this run's, of this turn."""
    if not of_the_turn(request, run.tenant, run.run_id, run.iteration):
        raise CheckpointCorruptError(
            f"approval request {request.id!r} names {whose(request)}, not run "
            f"{run.run_id!r} at turn {run.iteration}; the approval store holds a damaged row"
        )


async def told_waiting(approvals: ApprovalStore | None, work: WorkIndex, result: Run) -> None:
    """Tell the work index that ``result``, a run waiting on a person, wants no worker,
    then look at its request again: decided meanwhile, the operator's wake may have landed
    before this ``done`` (or, from a holder paused in between, long before) and been
    overwritten, so the run is woken again here. The operator decides before waking it, so
    one of the two looks sees the decision."""
    await work.done(result.tenant, result.run_id)
    pending = result.pending_approval
    if approvals is None or pending is None:
        return
    try:
        request = await approvals.get(result.tenant, pending.id)
        decided = request is not None and request.status is not ApprovalStatus.pending
    except Exception:
        # Cannot tell: a needless wake costs a worker one look; a lost one, the run.
        decided = True
    if decided:
        await work.want(
            result.tenant, result.run_id, agent=result.agent_name, state=WorkState.decided
        )


def _in_request_order(ids: Sequence[str], calls: Sequence[OutstandingCall]) -> list[ToolCall]:
    """The turn's calls the request names, in its order: each id takes the next call under
    it not taken yet, so calls a model gave one id (it happens) stay apart."""
    waiting: dict[str, list[ToolCall]] = {}
    for oc in calls:
        waiting.setdefault(oc.call.id, []).append(oc.call)
    return [waiting[i].pop(0) for i in ids if waiting.get(i)]


def _same_calls(
    request: ApprovalRequest,
    calls: Sequence[ToolCall],
    redactor: Redactor,
    *,
    masked: bool = False,
) -> None:
    """The decision is only ever taken for what the operator was shown: the request's calls
    must be the turn's (tool and redacted arguments, in order). A request that says
    otherwise was damaged or rewritten in its store; it is refused, never acted on.
    ``masked``: the turn's arguments come from a frontier, redacted already."""
    shown = [(c.name, dict(c.arguments)) for c in request.calls]
    asked = [
        (c.name, dict(c.arguments) if masked else redactor.value(dict(c.arguments))) for c in calls
    ]
    if shown != asked:
        raise CheckpointCorruptError(
            f"approval request {request.id!r} does not hold the calls it was asked for "
            f"(it shows {[n for n, _ in shown]}, the run asked about {[n for n, _ in asked]}); "
            "it is not acted on"
        )


def approval_request_id(
    tenant: str,
    run_id: str,
    iteration: int,
    calls: Sequence[OutstandingCall],
    redactor: Redactor,
) -> str:
    """The id a turn's approval request is made under: the same for every attempt at that
    turn, so a request orphaned by a death is found again, never asked twice. It names each
    call by its key, its tool and its arguments as the operator is shown them (redacted),
    never by the provider's call id, which a model asked again makes up anew: a decision is
    only ever found for exactly what the operator saw."""
    named = [[oc.key, oc.call.name, redactor.value(dict(oc.call.arguments))] for oc in calls]
    body = canonical_json(["approval", tenant, run_id, iteration, named])
    return "req-" + hashlib.sha256(body.encode("utf-8")).hexdigest()[:24]


def _granted_note(parts: RunParts, request: ApprovalRequest) -> str:
    """The request's note as its grants carry it: masked, and at most GRANT_NOTE_CHARS
    (a longer one is cut there and says where the rest is)."""
    note = parts.redactor.text(request.note or "")
    if len(note) <= GRANT_NOTE_CHARS:
        return note
    rest = len(note) - GRANT_NOTE_CHARS
    return f"{note[:GRANT_NOTE_CHARS]}… ({rest} characters more in approval {request.id})"


def _grant(
    parts: RunParts,
    run: RunState,
    request: ApprovalRequest,
    calls: Sequence[OutstandingCall],
    *,
    now_named: Sequence[ToolCall] | None = None,
) -> None:
    """A decided request's calls become the run's grants (``now_named``: the same calls
    as this turn names them, in the request's order)."""
    approved = request.status is ApprovalStatus.approved
    known = {g.call_id for g in run.grants}
    keys = {oc.call.id: oc.key for oc in calls}
    decided = request.calls if now_named is None else tuple(now_named)
    for call in decided:
        if call.id not in known:
            run.grants.append(
                Grant(
                    request=request.id,
                    call_id=call.id,
                    key=keys.get(call.id),
                    approved=approved,
                    by=request.by,
                    note=None if request.note is None else _granted_note(parts, request),
                )
            )
