"""Resume: what a frontier and its plan hand to the next attempt, and what refuses it."""

from __future__ import annotations

from typing import Any

from tesserix_adk.agent import Agent
from tesserix_adk.checkpoint.checkpointer import Checkpointer, TranscriptCursor, state_from_json
from tesserix_adk.checkpoint.payload import (
    Boundary,
    Checkpoint,
    CheckpointStatus,
    OutcomeState,
    outcome_state,
    record_tag,
    resolve_observation,
)
from tesserix_adk.checkpoint.planning import ResumePlan
from tesserix_adk.errors import (
    AdkError,
    CarriedByWorkflowError,
    CheckpointTooLargeError,
    ReplayNotResumableError,
    RevisionMismatchError,
    RunFailedError,
    StateRedactedError,
)
from tesserix_adk.messages import Usage
from tesserix_adk.run.attempt import AheadCall, Attempt
from tesserix_adk.run.state import RunState
from tesserix_adk.stores.capabilities import ledger_totals
from tesserix_adk.stores.protocols import IdempotencyRecord, IdempotencyStore, Ledger

__all__ = [
    "carried_state",
    "note_ahead",
    "nothing_ran_since_approval_asked",
    "refuse_carried_by_workflow",
    "refuse_uncarriable",
    "refuse_unresumable",
    "restore",
    "resumable",
    "uncarriable",
    "unfinished_replay",
]


async def restore(
    checkpoints: Checkpointer,
    ledger: Ledger | None,
    run: RunState,
    attempt: Attempt,
    cp: Checkpoint,
    plan: ResumePlan,
    idempotency: IdempotencyStore,
) -> None:
    """Fill ``run`` from the frontier and ``attempt`` from the plan: the state is the one
    the run's last call completed since the frontier recorded, if any (its tool may have
    written into it; the call is replayed, not run again), else the frontier's."""
    run.messages = await checkpoints.messages(cp)
    run.iteration = cp.iteration
    run.step = cp.step
    run.steps_used = cp.steps_used
    run.usage = cp.usage
    state = await carried_state(idempotency, run.tenant, run.run_id, cp, plan)
    run.state = state_from_json(state, run.agent.state_schema)
    run.grants = list(cp.grants)
    run.replay_of = cp.replay_of
    run.observation = resolve_observation(cp.observation, run.messages)
    run.cursor = TranscriptCursor(handle=cp.history_handle, persisted=len(run.messages))
    note_ahead(attempt, plan)
    if ledger is not None:
        # The ledger's figures, not the frontier's: a call charged right before a death
        # is counted there only.
        run.spent, run.usage = await ledger_totals(ledger, run.tenant, run.run_id)
        if run.spent < cp.micros:
            # The ledger holds less than the frontier saw it hold: it lost charges (a
            # store that forgets keys). What is known spent is charged back, so the budget
            # and every later charge count from there, not from less.
            missing = Usage(
                input_tokens=max(0, cp.usage.input_tokens - run.usage.input_tokens),
                output_tokens=max(0, cp.usage.output_tokens - run.usage.output_tokens),
            )
            await ledger.charge(
                run.tenant, run.run_id, cp.micros - run.spent, missing, fence=attempt.fence
            )
            run.spent, run.usage = cp.micros, run.usage + missing
    else:
        run.spent = cp.micros


async def carried_state(
    idempotency: IdempotencyStore, tenant: str, run_id: str, cp: Checkpoint, plan: ResumePlan
) -> Any:
    """The run's state to carry on from ``cp``, as stored (JSON): the one the run's last
    call completed since the frontier recorded (``state_since``; its tool may have written
    into it, and the call is replayed, not run again), else the frontier's. A run without
    state has none a call could have changed (and no read is spent on it).
    ``StateRedactedError`` when the state recorded lost a secret to masking."""
    if cp.state is None:
        return None
    since = await state_since(idempotency, tenant, run_id, plan, cp.iteration)
    if since is None:
        return cp.state
    if since.redacted:
        raise StateRedactedError(
            f"run {run_id!r} cannot be carried on: its state, as its last completed call "
            "recorded it, held a secret, which every store keeps masked, so its tools would "
            "be handed the mask as if it were the value; keep credentials out of the run's "
            "state"
        )
    return since.state


async def state_since(
    idempotency: IdempotencyStore, tenant: str, run_id: str, plan: ResumePlan, iteration: int
) -> OutcomeState | None:
    """The state the run's calls completed since the frontier (at ``iteration``) recorded:
    that of the one completed last of those that recorded one. Only this run's own calls
    of the frontier's turn or later count: a business key another run completed holds that
    run's state, and one this run completed in an earlier turn (asked for again, replayed)
    holds an older state than the frontier's. Completions at the same moment of the
    store's clock are told apart by turn, then by the order the plan lists them in. An
    outcome the plan read without its bytes is read once more."""
    own: list[tuple[float, int, int, IdempotencyRecord]] = []
    for position, p in enumerate(plan.completed):
        rec = p.record
        if rec is None or rec.completed_at is None or rec.holding_run != run_id:
            continue
        turn = rec.iteration if rec.holder_run is None else rec.holder_iteration
        if turn is None or turn < iteration:
            continue
        own.append((rec.completed_at, turn, position, rec))
    for *_, rec in sorted(own, key=lambda o: o[:3], reverse=True):
        outcome = rec.outcome
        if outcome is None:
            again = (await idempotency.lookup([rec.key], tenant=tenant)).get(rec.key)
            outcome = None if again is None else again.outcome
        if outcome is None:
            continue
        kept = outcome_state(bytes(outcome), record=record_tag(tenant, rec.key))
        if kept is not None:
            return kept
    return None


def note_ahead(attempt: Attempt, plan: ResumePlan) -> None:
    """What the attempt must honour of a plan: in-flight claims it may take over and send
    again, and completed side-effecting calls the model must ask for again."""
    attempt.takeover_keys = {p.key for p in plan.to_dispatch if p.takeover and p.key}
    for p in plan.completed:
        if p.ahead and p.side_effects and p.key and p.iteration is not None:
            attempt.ahead.setdefault(p.iteration, {})[p.key] = AheadCall(
                key=p.key, tool=p.tool, call_id=p.call_id
            )


def refuse_unresumable(cp: Checkpoint, agent: Agent) -> None:
    """Refuse a tombstone, a changed agent, a run that ended ``failed``, an unfinished run
    whose stored state lost a secret to masking, or a replay that did not finish."""
    if cp.is_tombstone:
        raise CheckpointTooLargeError(
            f"run {cp.run_id!r} cannot be carried on: its frontier at step {cp.step} was "
            f"refused ({cp.reason})",
            retryable=False,
        )
    if cp.agent_revision != agent.revision:
        raise RevisionMismatchError(
            f"run {cp.run_id!r} was checkpointed by agent {cp.agent_name!r} revision "
            f"{cp.agent_revision}; this agent is revision {agent.revision}"
        )
    refuse_uncarriable(cp)


def refuse_uncarriable(cp: Checkpoint) -> None:
    """Refuse, whatever the agent, a run that ended ``failed``, an unfinished run whose
    stored state lost a secret to masking, or a replay that did not finish."""
    refused = uncarriable(cp)
    if refused is not None:
        raise refused


def uncarriable(cp: Checkpoint) -> AdkError | None:
    """What ``refuse_uncarriable`` refuses ``cp`` with, or ``None``."""
    if cp.status is CheckpointStatus.failed:
        return RunFailedError(f"run {cp.run_id!r} ended failed at step {cp.step}")
    if cp.state_redacted and not cp.status.finished:
        return StateRedactedError(
            f"run {cp.run_id!r} cannot be carried on: its state at step {cp.step} held a "
            "secret, which every store keeps masked, so its tools would be handed the mask "
            "as if it were the value; keep credentials out of the run's state"
        )
    if unfinished_replay(cp):
        return ReplayNotResumableError(
            f"run {cp.run_id!r} is a replay of {cp.replay_of} that stopped at step {cp.step}; "
            "its stubs lived only in the replay call that started it, so it is never carried "
            "on (its tools would be sent for real): replay again from the step instead"
        )
    return None


def refuse_carried_by_workflow(cp: Checkpoint) -> None:
    """Refuse, for the kit's own resume, an unfinished run a workflow engine carries: two
    carriers of one run would each take its turns. (Its engine's steps never ask this.)"""
    if cp.carried_by is not None and not cp.status.finished:
        raise CarriedByWorkflowError(
            f"run {cp.run_id!r} is carried by its {cp.carried_by} workflow, not by the kit's "
            "resume or workers; it goes on there (once its workflow closed, `tesserix submit "
            f"--temporal ... --run-id {cp.run_id}` starts a new one from its frontier)"
        )


def unfinished_replay(cp: Checkpoint) -> bool:
    """A replay that stopped before it finished: nothing carries it on (its stubs lived
    only in the ``replay`` call). A tombstone is refused before it is asked this."""
    return cp.replay_of is not None and not cp.status.finished


def resumable(cp: Checkpoint, agent: Agent) -> bool:
    """Whether ``refuse_unresumable`` lets the run be carried on by ``agent``."""
    return not cp.is_tombstone and cp.agent_revision == agent.revision and uncarriable(cp) is None


def nothing_ran_since_approval_asked(cp: Checkpoint, plan: ResumePlan) -> bool:
    """A ``before_approval`` frontier is only ever followed by a dispatch after a newer
    frontier named the turn's unkeyed calls; so while it is the latest, those calls did not
    run, and only a claimed record can make a call indeterminate."""
    return cp.boundary is Boundary.before_approval and all(
        p.record is None and not p.ahead for p in plan.indeterminate
    )
