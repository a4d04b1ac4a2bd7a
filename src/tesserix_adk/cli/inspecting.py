"""``tesserix inspect RUN``: a run's frontier and plan, what holds it, and why it stands
where it stands; takes no lease.

Exit 0 whenever the run could be read (whatever a resume would do with it), 1 when nothing
is checkpointed, 4 when it cannot be read: the frontier, or the transcript it names (the
frontier is printed first then, as far as it goes, and the sentence says why a resume
refuses)."""

from __future__ import annotations

import argparse
from typing import Any, TextIO

from tesserix_adk.checkpoint.checkpointer import Checkpointer
from tesserix_adk.checkpoint.payload import Checkpoint
from tesserix_adk.checkpoint.planning import ResumePlan, plan_as_told
from tesserix_adk.cli.describe import describe
from tesserix_adk.cli.failures import ExitCode
from tesserix_adk.cli.jsonout import claim_json, emit, key_digest, lease_json, when
from tesserix_adk.cli.reasons import (
    blocked,
    carriable,
    failure_reason,
    lost_to_workers,
    no_frontier,
    parked_item,
    state_refused,
)
from tesserix_adk.cli.text import escaped
from tesserix_adk.errors import (
    CheckpointCorruptError,
    HistoryUnavailableError,
)
from tesserix_adk.messages import Usage
from tesserix_adk.run.attempt import run_claim_key
from tesserix_adk.run.cancelling import cancel_requested
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.stores.capabilities import ledger_totals
from tesserix_adk.stores.protocols import (
    ApprovalRequest,
    IdempotencyRecord,
    RunLease,
    WorkItem,
)

__all__ = ["asked_approval", "held_by", "inspect_json", "run_inspect"]


async def asked_approval(stores: Stores, cp: Checkpoint) -> ApprovalRequest | None:
    """The approval request the frontier waits on, as the approval store has it now."""
    if cp.pending_approval is None:
        return None
    return await stores.approvals.get(cp.tenant, cp.pending_approval.id)


def held_by(lease: RunLease) -> str:
    """The live lease in words."""
    return (
        f"held by {escaped(lease.holder)} (fence {lease.fence}) until {when(lease.expires_at)} "
        "by the store's clock, unless renewed"
    )


async def run_inspect(args: argparse.Namespace, stores: Stores, out: TextIO) -> ExitCode:
    """Print the run's frontier and plan (text, or JSON with ``args.json``)."""
    checkpointer = Checkpointer.from_stores(stores)
    cp = await checkpointer.latest(args.tenant, args.run)
    if cp is None:
        raise await no_frontier(stores, args.tenant, args.run)
    unreadable: Exception | None = None
    if not cp.is_tombstone:
        try:  # what a resume reads first: a transcript it cannot read refuses it (exit 4)
            await checkpointer.messages(cp)
        except (CheckpointCorruptError, HistoryUnavailableError) as exc:
            unreadable = exc
    if unreadable is not None and args.json:
        raise _cannot_be_carried_on(unreadable)
    lease = await stores.leases.current(args.tenant, args.run)
    plan = await plan_as_told(cp, stores.idempotency, lease)
    spent, usage = await ledger_totals(stores.ledger, args.tenant, args.run)
    parked = await parked_item(stores, args.tenant, args.run)
    approval = await asked_approval(stores, cp)
    # What a resume reads before it refuses anything: a cancel that stands ends the run.
    cancel = None
    if not cp.status.finished:
        cancel = await cancel_requested(stores.idempotency, args.tenant, args.run)
    if args.json:
        key = run_claim_key(args.tenant, args.run)
        claim = (await stores.idempotency.lookup([key], tenant=args.tenant)).get(key)
        refused = await state_refused(stores.idempotency, cp, plan)
        found = inspect_json(
            cp, plan, spent, lease, parked, claim, approval=approval, usage=usage, refused=refused
        )
        found["cancel"] = (
            None
            if cancel is None
            else {"by": cancel.by, "at": when(cancel.at), "reason": cancel.reason}
        )
        emit(out, found)
        return ExitCode.CARRIED_ON
    out.write(
        describe(
            cp,
            plan=plan,
            spent=spent,
            usage=usage,
            approval=approval,
            approval_asked=cp.pending_approval is not None,
        )
        + "\n"
    )
    if cancel is not None:
        out.write(
            f"{escaped(cancel.describe())} at {when(cancel.at)}: a resume ends it cancelled, "
            "sending nothing (calls in doubt are left as they are)\n"
        )
    if lease is not None:
        out.write(held_by(lease) + "\n")
    if parked is not None:
        out.write(
            f"parked: {escaped(parked.reason or '')}; a worker takes it again once you resolve, "
            "approve or cancel\n"
        )
    if await lost_to_workers(stores, args.tenant, cp, lease):
        out.write(f"{blocked(cp, None, None, unindexed=True)}\n")
    if unreadable is not None:
        raise _cannot_be_carried_on(unreadable)
    return ExitCode.CARRIED_ON


def _cannot_be_carried_on(exc: Exception) -> Exception:
    """The transcript's error, saying what it means for the run (exit 4, as for a resume)."""
    said = f"{exc}; the run cannot be carried on (a resume refuses it, exit 4)"
    if isinstance(exc, HistoryUnavailableError):
        return HistoryUnavailableError(said)
    return CheckpointCorruptError(said)


def inspect_json(
    cp: Checkpoint,
    plan: ResumePlan,
    spent: int,
    lease: RunLease | None,
    parked: WorkItem | None,
    claim: IdempotencyRecord | None,
    *,
    approval: ApprovalRequest | None = None,
    usage: Usage | None = None,
    refused: str | None = None,
) -> dict[str, Any]:
    """The fields of ``inspect --json`` (json escapes control characters: ids go in as
    they are). ``approval``: the request the frontier waits on, as decided so far;
    ``usage``: the ledger's tokens (else the frontier's); ``refused``: why a resume refuses
    the run for its recorded state (``state_refused``)."""
    tokens = cp.usage if usage is None else usage
    return {
        "run_id": cp.run_id,
        "tenant": cp.tenant,
        "agent": cp.agent_name,
        "revision": cp.agent_revision,
        "status": str(cp.status),
        "step": cp.step,
        "boundary": None if cp.boundary is None else str(cp.boundary),
        "iteration": cp.iteration,
        "written_at": when(cp.written_at),
        "usage": {"input_tokens": tokens.input_tokens, "output_tokens": tokens.output_tokens},
        "spent_micros": spent,
        "pending_approval": None if cp.pending_approval is None else cp.pending_approval.id,
        "approval": None
        if approval is None
        else {
            "id": approval.id,
            "status": str(approval.status),
            "by": approval.by,
            "decided_at": when(approval.decided_at),
        },
        "output": cp.output,
        "reason": failure_reason(cp, parked),
        "parked": None if parked is None else parked.reason,
        "replay_of": cp.replay_of,
        "carried_by": None if cp.carried_by is None else str(cp.carried_by),
        "lease": lease_json(lease),
        "resume_claim": claim_json(claim),
        "safe": carriable(cp, plan, refused),
        "calls": [
            {
                "tool": p.tool,
                "call_id": p.call_id,
                "key": p.key,
                "key_digest": key_digest(p.key),
                "disposition": str(p.disposition),
                "reason": p.reason,
                "ahead": p.ahead,
                "claim_expires_at": None if p.record is None else when(p.record.expires_at),
            }
            for p in plan.calls
        ],
    }
