"""``describe()``: the one summary of a frontier that ``inspect`` and ``run --resume`` print,
so the two can never drift. Ids in it are ``escaped``: one of them cannot forge a line."""

from __future__ import annotations

from tesserix_adk.checkpoint.payload import Checkpoint, CheckpointStatus
from tesserix_adk.checkpoint.planning import ResumePlan
from tesserix_adk.cli.reasons import failure_reason
from tesserix_adk.cli.text import escaped
from tesserix_adk.messages import Usage
from tesserix_adk.run.approvals import of_the_turn, whose
from tesserix_adk.stores.protocols import ApprovalRequest, ApprovalStatus

__all__ = ["describe"]


def describe(
    checkpoint: Checkpoint,
    *,
    plan: ResumePlan | None = None,
    spent: int | None = None,
    usage: Usage | None = None,
    approval: ApprovalRequest | None = None,
    approval_asked: bool = False,
) -> str:
    """Three lines about the run (who, how far, where it stands), then one per planned call.

    ``spent`` and ``usage`` are the ledger's figures; without them the frontier's
    (reporting-only) ones are shown: a charge made just before a death is in the ledger only.
    ``approval`` is the request the frontier waits on, as the approval store has it now:
    once a person decided it, the third line says so instead of "waiting on approval".
    ``approval_asked``: the store was asked, so no ``approval`` means it is gone.
    """
    cp = checkpoint
    micros = cp.micros if spent is None else spent
    tokens = cp.usage if usage is None else usage
    lines = [
        f"run {escaped(cp.run_id)}  tenant {escaped(cp.tenant)}  agent {escaped(cp.agent_name)}",
        f"iteration {cp.iteration}  {tokens.input_tokens} in, {tokens.output_tokens} out  "
        f"{micros} micros",
        _where(cp, approval, approval_asked),
    ]
    if cp.replay_of:
        lines.append(f"replay of {escaped(cp.replay_of)}")
    if cp.carried_by is not None:
        lines.append(
            f"carried by its {cp.carried_by} workflow (the kit's resume and workers leave it)"
        )
    if plan is not None:
        # A planned call's line names its call id and, in its reason, the holder seen.
        lines.extend(escaped(p.describe()) for p in plan.calls)
    return "\n".join(lines)


def _where(cp: Checkpoint, approval: ApprovalRequest | None, approval_asked: bool) -> str:
    if cp.status is CheckpointStatus.tombstone:
        return f"tombstone at step {cp.step}: {escaped(str(cp.reason))}"
    if cp.status is CheckpointStatus.waiting_approval and cp.pending_approval is not None:
        asked = cp.pending_approval.id
        # What a resume refuses (``run.approvals``), said here first: no person can decide
        # a request that is gone, or act through one that is another run's.
        if approval_asked and approval is None:
            return (
                f"waiting on approval {escaped(asked)}, which is gone from the approval "
                "store: a resume refuses the run (exit 4)"
            )
        if approval is not None and not of_the_turn(approval, cp.tenant, cp.run_id, cp.iteration):
            return (
                f"approval {escaped(asked)} in the store names {escaped(whose(approval))}: "
                "a resume refuses the run (exit 4)"
            )
        if (
            approval is not None
            and approval.id == asked
            and approval.status is not ApprovalStatus.pending
        ):
            then = (
                "a resume carries it on"
                if cp.carried_by is None
                else f"its {cp.carried_by} workflow carries it on"
            )
            return (
                f"approval {escaped(asked)} {approval.status} by {escaped(approval.by or '?')}; "
                + then
            )
        return f"waiting on approval {escaped(asked)}"
    if cp.status is CheckpointStatus.failed:
        return f"failed at step {cp.step}: {escaped(str(failure_reason(cp)))}"
    if cp.status.finished:
        return f"{cp.status} at step {cp.step}"
    outstanding = len(cp.outstanding)
    return f"running: step {cp.step} {cp.boundary}, {outstanding} call(s) outstanding"
