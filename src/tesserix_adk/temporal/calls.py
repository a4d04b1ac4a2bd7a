"""One call of a turn, the body of the workflow's tool activity: the call read back from
the run's frontier and answered through the kit's dispatch unit, under the run's lease.

Only what the dispatch unit replayed, settled or sent has its outcome in the record under
its key; that crosses Temporal's history as ``recorded`` alone, anything else (a refusal)
as its redacted text.
"""

from __future__ import annotations

from collections.abc import Sequence

from tesserix_adk.agent import Agent
from tesserix_adk.checkpoint.checkpointer import Checkpointer, state_from_json
from tesserix_adk.checkpoint.payload import Boundary, Carrier, Checkpoint, OutstandingCall
from tesserix_adk.checkpoint.planning import (
    ResumePlan,
    plan_resume,
)
from tesserix_adk.errors import (
    CheckpointCorruptError,
    ConfigurationError,
    IndeterminateToolCallError,
    NoCheckpointError,
    ResumeConflictError,
    RevisionMismatchError,
)
from tesserix_adk.run.attempt import Attempt
from tesserix_adk.run.cancelling import cancel_requested
from tesserix_adk.run.dispatch import _answer
from tesserix_adk.run.events import CallDisposition, EventSink, RunEvent, ToolCallFinished
from tesserix_adk.run.reconciling import reconcile_in_doubt
from tesserix_adk.run.recording import redacted_record
from tesserix_adk.run.resume import refuse_unresumable
from tesserix_adk.run.runner import AgentRunner
from tesserix_adk.run.state import RunState
from tesserix_adk.stores.protocols import RecordStatus
from tesserix_adk.temporal.marks import UnkeyedMarks, unkeyed_in_doubt
from tesserix_adk.temporal.shapes import ToolInput, ToolResult

__all__ = ["check_revision", "checkpoints_of", "tool_call"]


def check_revision(agent: Agent, revision: str, run_id: str) -> None:
    """A worker whose agent changed since the run was started refuses to carry it."""
    if agent.revision != revision:
        raise RevisionMismatchError(
            f"run {run_id!r} was started by agent {agent.name!r} revision {revision}; this "
            f"worker's agent is revision {agent.revision}"
        )


async def tool_call(
    runner: AgentRunner, agent: Agent, call: ToolInput, holder: str, *, retried: bool
) -> ToolResult:
    """One call of the turn through the kit's dispatch unit: claimed, sent once, recorded;
    a completed record replayed; a call a predecessor may have sent settled by its
    reconciler, else refused as indeterminate, naming it. ``retried``: an earlier attempt
    of this activity may have run."""
    check_revision(agent, call.agent_revision, call.run_id)
    checkpoints = checkpoints_of(runner)
    parts = runner._parts
    # How the dispatch unit answered: only a call it replayed, settled or sent has its
    # outcome in the record under its key (a refused one, denied say, may meet another
    # run's outcome there, under a business key they share).
    finished: list[ToolCallFinished] = []
    attempt = Attempt(holder=holder, events=_kept_in(finished))
    async with runner._holding(attempt, call.tenant, call.run_id):
        cp = await checkpoints.latest(call.tenant, call.run_id)
        if cp is None:
            raise NoCheckpointError(f"nothing is checkpointed under run {call.run_id!r}")
        refuse_unresumable(cp, agent)
        if cp.status.finished:
            # Ended meanwhile (``tesserix cancel``): nothing more is sent; the next model
            # turn finds the final frontier and ends the workflow with its status.
            return ToolResult(
                call_id=call.call_id,
                content=f"not sent: the run ended {cp.status.value}",
                is_error=True,
                position=call.position,
            )
        if cp.boundary is not Boundary.after_model_call or cp.iteration != call.iteration:
            raise CheckpointCorruptError(
                f"run {call.run_id!r}: call {call.call_id} of iteration {call.iteration} was "
                f"asked for, but the frontier stands at iteration {cp.iteration} "
                f"({cp.boundary}); it is not sent"
            )
        oc = _the_call(cp.outstanding, call)
        if oc is None:
            raise CheckpointCorruptError(
                f"run {call.run_id!r}: the frontier of iteration {call.iteration} names no "
                f"call {call.call_id}; it is not sent"
            )
        run = RunState(
            agent=agent,
            tenant=call.tenant,
            run_id=call.run_id,
            messages=[],
            iteration=cp.iteration,
            step=cp.step,
            state=state_from_json(cp.state, agent.state_schema),
            grants=list(cp.grants),
            carried_by=Carrier.temporal,
        )
        try:
            if oc.key is None:
                if retried and oc.side_effects:
                    raise unkeyed_in_doubt(oc, cp)
                attempt.send_marks = UnkeyedMarks(parts.idempotency, holder, cp, call.position)
            else:
                await _settle_in_doubt(runner, agent, attempt, cp, oc)
            # A call about to be sent asks for a cancel once claimed (one asked since the
            # model's answer stops it; the next model turn ends the run cancelled), after a
            # recorded outcome is replayed or a call in doubt settled or refused.
            outcome = await _answer(parts, run, attempt, oc, {g.call_id: g for g in run.grants})
        except (IndeterminateToolCallError, ResumeConflictError) as exc:
            cancelled = await cancel_requested(parts.idempotency, call.tenant, call.run_id)
            if cancelled is None:
                raise
            # A cancelled run ends where it stands, as the kit's own resume ends it: this
            # call is neither sent again nor guessed at (its record stays in flight), nor
            # waits on another run's claim, and the next model turn ends the run cancelled
            # before the model hears of it.
            unsent = "left in doubt, not sent again"
            if isinstance(exc, ResumeConflictError):
                unsent = "not sent"
            return ToolResult(
                call_id=call.call_id,
                content=f"{unsent}: the run was {cancelled.describe()}",
                is_error=True,
                position=call.position,
            )
        answered = next((e for e in finished if e.call_id == call.call_id), None)
        if (
            oc.key is not None
            and answered is not None
            and answered.disposition is not CallDisposition.refused
        ):
            rec = (await parts.idempotency.lookup([oc.key], tenant=call.tenant)).get(oc.key)
            if rec is not None and rec.status is RecordStatus.completed and rec.outcome:
                return ToolResult(call_id=outcome.call_id, recorded=True, position=call.position)
        told = await redacted_record(parts, outcome)
        return ToolResult(
            call_id=outcome.call_id,
            content=told.outcome.content,
            is_error=told.outcome.is_error,
            position=call.position,
        )


async def _settle_in_doubt(
    runner: AgentRunner, agent: Agent, attempt: Attempt, cp: Checkpoint, oc: OutstandingCall
) -> None:
    """A claim another attempt left in flight is asked of the tool's reconciler, under the
    lease, before the dispatch unit sees it (which replays what it recorded, or refuses)."""
    plan = await plan_resume(cp, runner.idempotency)
    doubt = tuple(p for p in plan.indeterminate if p.key == oc.key)
    if doubt:
        await reconcile_in_doubt(
            runner._parts,
            agent,
            ResumePlan(indeterminate=doubt),
            attempt,
            tenant=cp.tenant,
            run_id=cp.run_id,
            margin=runner.never_ran_margin,
            leases=runner.leases,
        )


def _the_call(outstanding: Sequence[OutstandingCall], call: ToolInput) -> OutstandingCall | None:
    """The frontier's call ``call`` names: at its place, with its id (a model may give two
    calls one id); by id alone for a kit that did not carry the place."""
    if 0 <= call.position < len(outstanding) and outstanding[call.position].call.id == call.call_id:
        return outstanding[call.position]
    return next((c for c in outstanding if c.call.id == call.call_id), None)


def _kept_in(finished: list[ToolCallFinished]) -> EventSink:
    """An event sink keeping each ``ToolCallFinished`` in ``finished``."""

    def keep(event: RunEvent) -> None:
        if isinstance(event, ToolCallFinished):
            finished.append(event)

    return keep


def checkpoints_of(runner: AgentRunner) -> Checkpointer:
    """The runner's checkpointer, which a Temporal worker cannot do without."""
    if runner.checkpoints is None:
        raise ConfigurationError(
            "a Temporal worker keeps every run's state in frontiers: give its runner a "
            "Checkpointer (AgentRunner.from_stores)"
        )
    return runner.checkpoints
