"""The bodies of the workflow's activities, made of the kit's own run machinery.

Each activity is one attempt in the kit's sense: a holder id of its own (one per Temporal
activity attempt), the run's lease and the fence it seals every store with, the latest
frontier read back, then exactly one piece of the loop — a model turn (``model_turn``) or
one call through the dispatch unit (``tool_call``, in ``calls``). The frontier, not the
workflow, holds the transcript, so a retried attempt, a second worker or a new execution of
the chain all pick up from the same durable state, and ``tesserix inspect`` reads it as for
any run.

Keys are the kit's (``loop.outstanding_calls``: run id, iteration, call), computed once
when the model's turn is written into its frontier and read from there by every attempt of
the call: never from Temporal's run or activity ids.

This module imports nothing of ``temporalio``; ``activities`` translates its errors.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict

from tesserix_adk.agent import Agent
from tesserix_adk.checkpoint.checkpointer import Checkpointer
from tesserix_adk.checkpoint.payload import (
    Boundary,
    Carrier,
    Checkpoint,
    Grant,
    OutstandingCall,
    decode_outcome,
    record_tag,
)
from tesserix_adk.checkpoint.planning import (
    ResumePlan,
    plan_resume,
    refuse_if_undecidable,
)
from tesserix_adk.errors import (
    AdkError,
    CheckpointCorruptError,
    NoCheckpointError,
    StoreUnavailableError,
)
from tesserix_adk.messages import Message, ToolOutcome
from tesserix_adk.run import loop, screening
from tesserix_adk.run.approvals import ask_approval, take_decision
from tesserix_adk.run.attempt import Attempt
from tesserix_adk.run.cancelling import cancel_requested
from tesserix_adk.run.dispatch import close_turn
from tesserix_adk.run.frontier import write_frontier
from tesserix_adk.run.parts import RunParts
from tesserix_adk.run.result import RunStatus
from tesserix_adk.run.resume import (
    nothing_ran_since_approval_asked,
    refuse_unresumable,
    restore,
)
from tesserix_adk.run.runner import AgentRunner
from tesserix_adk.run.state import RunState
from tesserix_adk.stores.protocols import HistoryHandle, IdempotencyRecord, RecordStatus
from tesserix_adk.temporal.calls import check_revision, checkpoints_of, tool_call
from tesserix_adk.temporal.shapes import (
    CallRef,
    ModelStep,
    StepKind,
    StepResult,
    ToolResult,
)

__all__ = ["model_turn", "tool_call"]

_OPEN = (Boundary.after_model_call, Boundary.before_approval)


async def model_turn(runner: AgentRunner, agent: Agent, step: ModelStep, holder: str) -> StepResult:
    """Fold the previous turn's results into the frontier, then ask the model (or only
    fold, or only look for an approval's decision); what the turn ended with."""
    check_revision(agent, step.agent_revision, step.run_id)
    checkpoints = checkpoints_of(runner)
    parts = runner._parts
    attempt = Attempt(holder=holder)
    async with runner._holding(attempt, step.tenant, step.run_id):
        cp = await checkpoints.latest(step.tenant, step.run_id)
        run = RunState(
            agent=agent,
            tenant=step.tenant,
            run_id=step.run_id,
            messages=[],
            carried_by=Carrier.temporal,  # every frontier says so: no kit worker takes it
        )
        if cp is None:
            if step.iteration != 0 or step.input is None:
                raise NoCheckpointError(
                    f"nothing is checkpointed under run {step.run_id!r} at iteration "
                    f"{step.iteration}; the workflow cannot go on without its frontier"
                )
            run.messages = [Message.user(step.input)]
            if runner.ledger is not None:
                run.spent = await runner.ledger.spent(step.tenant, step.run_id)
        else:
            refuse_unresumable(cp, agent)
            if cp.status.finished:
                return _ended(cp.status.value, cp.output, cp.iteration)
            plan = await plan_resume(cp, runner.idempotency)
            await restore(checkpoints, runner.ledger, run, attempt, cp, plan, runner.idempotency)
            # A frontier an earlier carrier wrote (a closed execution, or a kit process
            # whose run this execution adopts: no carrier named): that carrier may have
            # sent a call no key records: never again.
            adopted = step.resumed or cp.carried_by is None
            if adopted and not nothing_ran_since_approval_asked(cp, plan):
                unkeyed = [p for p in plan.indeterminate if p.key is None]
                if unkeyed:
                    refuse_if_undecidable(ResumePlan(indeterminate=tuple(unkeyed)))
            if cp.boundary in _OPEN and cp.iteration == step.iteration and not step.fold_only:
                # This turn's model answer stands (a retried attempt, or a decision looked
                # for): never ask the model again, its calls' keys are in the frontier.
                await _adopted(checkpoints, run, attempt, cp)
                turn = await _open_turn(parts, run, attempt, cp)
                if cp.pending_approval is not None and turn.kind is not StepKind.waiting:
                    await _taken(runner, run)
                return turn
            _check_handle(cp, step)
            if cp.boundary in _OPEN and cp.iteration == step.iteration - 1:
                await _fold(parts, run, attempt, cp.outstanding, step)  # its frontier names it
            elif not (
                cp.boundary is Boundary.after_tool_result and cp.iteration == step.iteration - 1
            ):
                raise CheckpointCorruptError(
                    f"run {step.run_id!r}: its frontier (step {cp.step}, iteration "
                    f"{cp.iteration}, {cp.boundary}) is not where the workflow stands "
                    f"(iteration {step.iteration}); it is not carried on"
                )
            else:
                await _adopted(checkpoints, run, attempt, cp)  # the model may take a while
            run.iteration = step.iteration
        if step.fold_only:
            return _standing(StepKind.folded, run)
        return await _ask_model(parts, run, attempt)


async def _adopted(
    checkpoints: Checkpointer, run: RunState, attempt: Attempt, cp: Checkpoint
) -> None:
    """The frontier again, naming this workflow as its carrier, once the workflow found it
    where it stands and before it goes on, when it names none: a run the kit started
    (handed over by ``carry_on_run``) or one written before frontiers named their carrier.
    Else, while the workflow only looks for an approval's decision (which writes nothing),
    an operator's approve would wake a kit worker to carry it beside it. (A frontier the
    workflow refuses is left as it was.)"""
    if cp.carried_by is not None:
        return
    frontier = dataclasses.replace(
        cp,
        step=cp.step + 1,
        fence=attempt.fence,
        messages=tuple(run.messages),
        written_at=time.time(),
        carried_by=Carrier.temporal,
    )
    if not await checkpoints.write(frontier, cursor=run.cursor):
        raise _not_written_by(checkpoints, run)
    run.step = frontier.step


async def _taken(runner: AgentRunner, run: RunState) -> None:
    """``tesserix approve`` tells the kit's work index that the run wants a worker: this
    workflow took the decision, so none of the kit's own workers is to take it as well."""
    if runner.work is not None:
        await runner.work.done(run.tenant, run.run_id)


async def _open_turn(
    parts: RunParts, run: RunState, attempt: Attempt, cp: Checkpoint
) -> StepResult:
    """The turn the frontier holds open: its decision taken if one was asked for, its
    approval asked if not yet (idempotent by request id), then its calls."""
    calls = list(cp.outstanding)
    if cp.pending_approval is not None:
        waiting = await take_decision(parts, run, attempt, cp.pending_approval, calls)
        if waiting is not None:
            return _standing(StepKind.waiting, run, approval=cp.pending_approval.id)
        # The grants go into a frontier without the pending request, which every call's
        # activity reads.
        await _must_write(parts, run, attempt, calls)
    return await _asked(parts, run, attempt, calls)


async def _ask_model(parts: RunParts, run: RunState, attempt: Attempt) -> StepResult:
    """SPEC §2's first half: the model's answer charged, appended and, with its calls and
    their keys, made durable in an ``after_model_call`` frontier before anything is sent."""
    agent = run.agent
    cancelled = await cancel_requested(parts.idempotency, run.tenant, run.run_id)
    if cancelled is not None:
        return await _finish(parts, run, attempt, RunStatus.cancelled, cancelled.describe())
    if agent.budget_micros is not None and run.budget_spent >= agent.budget_micros:
        return await _finish(parts, run, attempt, RunStatus.budget_exhausted)
    if run.iteration >= agent.max_iterations:
        return await _finish(parts, run, attempt, RunStatus.max_iterations)
    attempt.guard()
    response = await loop._call_model(parts, run, attempt)
    if isinstance(response, str):
        return await _finish(parts, run, attempt, RunStatus.failed, response)
    message = screening.screened(
        run,
        response.message,
        parts.redactor,
        recorded=attempt.ahead.get(run.iteration, {}).keys(),
    )
    run.steps_used += 1
    run.messages.append(message)
    # A cancel asked while the model thought ends the run here, before anything is sent
    # and before a last answer ends it completed.
    cancelled = await cancel_requested(parts.idempotency, run.tenant, run.run_id)
    if cancelled is not None:
        return await _finish(parts, run, attempt, RunStatus.cancelled, cancelled.describe())
    if not message.tool_calls:
        return await _finish(parts, run, attempt, RunStatus.completed, message.text)
    calls = loop.outstanding_calls(run, message.tool_calls)
    loop._refuse_divergence(run, attempt, calls)
    await _must_write(parts, run, attempt, calls)
    return await _asked(parts, run, attempt, calls)


async def _asked(
    parts: RunParts, run: RunState, attempt: Attempt, calls: Sequence[OutstandingCall]
) -> StepResult:
    waiting = await ask_approval(parts, run, attempt, calls)
    if waiting is not None:
        request = waiting.pending_approval
        return _standing(StepKind.waiting, run, approval=None if request is None else request.id)
    refs = [
        CallRef(call_id=oc.call.id, tool=oc.call.name, position=i) for i, oc in enumerate(calls)
    ]
    return _standing(StepKind.calls, run, calls=refs)


async def _fold(
    parts: RunParts,
    run: RunState,
    attempt: Attempt,
    calls: Sequence[OutstandingCall],
    step: ModelStep,
) -> None:
    """The previous turn's results, in the model's order, into an ``after_tool_result``
    frontier (as ``dispatch_turn`` appends them): its grants settled."""
    if step.results is None:
        raise CheckpointCorruptError(
            f"run {step.run_id!r}: the turn of iteration {run.iteration} is open but the "
            "workflow brought no results for it; it is not carried on"
        )
    told = _results_in_place(calls, step.results)
    missing = [oc.call.id for oc, r in zip(calls, told, strict=True) if r is None]
    if missing:
        raise CheckpointCorruptError(
            f"run {step.run_id!r}: no result for call(s) {', '.join(missing)} of iteration "
            f"{run.iteration}; the turn is not closed"
        )
    found = [(oc, r) for oc, r in zip(calls, told, strict=True) if r is not None]
    keys = [oc.key for oc, r in found if oc.key is not None and r.recorded]
    records = await parts.idempotency.lookup(keys, tenant=run.tenant) if keys else {}
    close_turn(run, calls, [_told(oc, r, records, step) for oc, r in found])
    written = await write_frontier(parts, run, attempt, Boundary.after_tool_result, force=True)
    if not written:
        raise _not_written(parts, run)


def _results_in_place(
    calls: Sequence[OutstandingCall], results: Sequence[ToolResult]
) -> list[ToolResult | None]:
    """Each call's result, by its place and id (a model may give two calls one id); a
    result from a kit that did not carry the place (all at 0) by id alone."""
    placed = {(r.position, r.call_id): r for r in results}
    by_id: dict[str, ToolResult] = {}
    for r in results:
        by_id.setdefault(r.call_id, r)
    return [placed.get((i, oc.call.id)) or by_id.get(oc.call.id) for i, oc in enumerate(calls)]


def _told(
    oc: OutstandingCall,
    result: ToolResult,
    records: Mapping[str, IdempotencyRecord],
    step: ModelStep,
) -> ToolOutcome:
    """A call's outcome for the transcript: from its record when it crossed as
    ``recorded``, else as the tool activity answered it."""
    if not result.recorded:
        return ToolOutcome(call_id=result.call_id, content=result.content, is_error=result.is_error)
    rec = None if oc.key is None else records.get(oc.key)
    if rec is None or rec.status is not RecordStatus.completed or not rec.outcome:
        raise CheckpointCorruptError(
            f"run {step.run_id!r}: call {oc.call.id} was recorded, but its record is gone; "
            "the turn is not closed"
        )
    return decode_outcome(rec.outcome, oc.call.id, record=record_tag(step.tenant, rec.key))


async def _must_write(
    parts: RunParts, run: RunState, attempt: Attempt, calls: Sequence[OutstandingCall]
) -> None:
    """The turn's ``after_model_call`` frontier, whatever the policy: every call's
    activity reads its call and key from it, so nothing is sent without it."""
    written = await write_frontier(
        parts, run, attempt, Boundary.after_model_call, outstanding=calls, force=True
    )
    if not written:
        raise _not_written(parts, run)


def _not_written(parts: RunParts, run: RunState) -> Exception:
    return _not_written_by(parts.checkpoints, run)


def _not_written_by(checkpoints: Checkpointer | None, run: RunState) -> Exception:
    error = None if checkpoints is None else checkpoints.last_error
    if isinstance(error, AdkError) and not error.retryable:
        return error
    return StoreUnavailableError(
        f"run {run.run_id!r}: the frontier of iteration {run.iteration} could not be "
        f"written ({error}); nothing was sent"
    )


async def _finish(
    parts: RunParts,
    run: RunState,
    attempt: Attempt,
    status: RunStatus,
    output: str | None = None,
) -> StepResult:
    ended = await loop._finish(parts, run, attempt, status, output=output)
    # What crosses into Temporal's history is what the frontier keeps: redacted.
    told = None if ended.output is None else parts.redactor.text(ended.output)
    return _ended(ended.status.value, told, ended.iteration)


def _ended(status: str, output: str | None, iteration: int) -> StepResult:
    return StepResult(kind=StepKind.finished, iteration=iteration, status=status, output=output)


def _standing(
    kind: StepKind,
    run: RunState,
    *,
    calls: list[CallRef] | None = None,
    approval: str | None = None,
) -> StepResult:
    handle = run.cursor.handle
    return StepResult(
        kind=kind,
        iteration=run.iteration,
        calls=calls or [],
        approval=approval,
        history=None if handle is None else _handle_dict(handle),
        spent_micros=run.spent,
        grants=[_grant_dict(g) for g in run.grants],
    )


def _check_handle(cp: Checkpoint, step: ModelStep) -> None:
    """The first turn of a continued execution must find the transcript it was handed."""
    if step.history is None:
        return
    if cp.history_handle is None or _handle_dict(cp.history_handle) != step.history:
        raise CheckpointCorruptError(
            f"run {step.run_id!r}: the execution was continued with a transcript handle its "
            "frontier does not hold; it is not carried on"
        )


def _handle_dict(handle: HistoryHandle) -> dict[str, object]:
    return {
        "tenant": handle.tenant,
        "run_id": handle.run_id,
        "count": handle.count,
        "digest": handle.digest,
    }


def _grant_dict(g: Grant) -> dict[str, object]:
    return asdict(g)
