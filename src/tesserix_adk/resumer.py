"""``Resumer``: take a run's lease, then — and only then — read its frontier and plan.

For code that drives the loop itself (a workflow engine, a custom worker). The lease is
taken before anything is read, so the worker that loses the race never sees the run.
"""

from __future__ import annotations

import dataclasses
import secrets
from dataclasses import dataclass
from typing import Any

from tesserix_adk.checkpoint.checkpointer import Checkpointer
from tesserix_adk.checkpoint.payload import Checkpoint
from tesserix_adk.checkpoint.planning import ResumePlan, plan_resume
from tesserix_adk.errors import (
    CheckpointTooLargeError,
    ConfigurationError,
    LeaseHeldError,
    NoCheckpointError,
    ResumeConflictError,
)
from tesserix_adk.leases import LeasePolicy
from tesserix_adk.messages import Message
from tesserix_adk.run.cancelling import CancelRequest, cancel_requested
from tesserix_adk.run.ids import check_ids, check_worker
from tesserix_adk.run.resume import (
    carried_state,
    refuse_carried_by_workflow,
    refuse_uncarriable,
)
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.stores.protocols import (
    ApprovalStore,
    HistoryStore,
    IdempotencyStore,
    LeaseStore,
    Ledger,
    RunLease,
)

__all__ = ["CarriedRun", "Resumer"]


@dataclass(frozen=True, slots=True, kw_only=True)
class CarriedRun:
    """A run this worker now holds: its lease, frontier, plan and transcript.

    ``state`` is the run's state to carry on, as stored (JSON; validate it with the
    agent's ``state_schema``): the frontier's, or the one a call that completed after the
    frontier was written recorded (its tool may have changed it; ``checkpoint.state`` is
    the frontier's alone). ``cancel`` is the run's cancel request when one stands (asked
    while its last holder carried it, which died before its next boundary): the driver
    sends nothing more and ends the run cancelled, so the plan then offers nothing to
    dispatch."""

    lease: RunLease
    checkpoint: Checkpoint
    plan: ResumePlan
    messages: tuple[Message, ...]
    cancel: CancelRequest | None = None
    state: Any = None


class Resumer:
    """Takes runs over for a worker: lease, seal, frontier, plan, transcript — in that order."""

    def __init__(
        self,
        checkpoints: Checkpointer,
        leases: LeaseStore,
        history: HistoryStore | None,
        idempotency: IdempotencyStore,
        *,
        policy: LeasePolicy | None = None,
        ledger: Ledger | None = None,
        approvals: ApprovalStore | None = None,
    ) -> None:
        """``ledger`` and ``approvals``, when the run has them, are sealed at each takeover
        too, so a superseded holder can neither charge nor ask for approval
        (``from_stores`` passes every store)."""
        if history is not None and checkpoints.history is not history:
            raise ConfigurationError(
                "the history store is configured once, on the Checkpointer; pass the same one"
            )
        self.checkpoints = checkpoints
        self.leases = leases
        self.idempotency = idempotency
        self.ledger = ledger
        self.approvals = approvals
        self.policy = policy or LeasePolicy()

    @classmethod
    def from_stores(
        cls,
        stores: Stores,
        *,
        checkpoints: Checkpointer | None = None,
        policy: LeasePolicy | None = None,
    ) -> Resumer:
        """A resumer over a bundle of stores (``open_stores``), sealing all of them."""
        if checkpoints is None:
            checkpoints = Checkpointer(stores.checkpoints, history=stores.history)
        return cls(
            checkpoints,
            stores.leases,
            stores.history,
            stores.idempotency,
            policy=policy,
            ledger=stores.ledger,
            approvals=stores.approvals,
        )

    async def resume(self, run_id: str, *, tenant: str, worker: str) -> CarriedRun:
        """Take the run for ``worker`` (``ResumeConflictError`` if someone holds it).

        The caller owns the returned lease: renew it (``Leaseholder``) and release it. A
        run the kit must not carry on is refused as the runner's resume refuses it (a
        tombstone, a run that ended failed, an unfinished replay, a run a workflow engine
        carries, a state that lost a secret to masking), the lease handed back; ids no
        store can keep are refused before anything is written (``ConfigurationError``).
        """
        check_ids(tenant=tenant, run_id=run_id)
        check_worker(worker)
        # Kept as the lease's holder and shown to operators: masked as the runner masks it.
        holder = f"{self.checkpoints.redactor.text(worker)}-{secrets.token_hex(6)}"
        try:
            lease = await self.leases.acquire(tenant, run_id, holder, self.policy.ttl)
        except LeaseHeldError as exc:
            raise ResumeConflictError(
                f"run {run_id!r} is held by {exc.holder or 'another worker'}", holder=exc.holder
            ) from exc
        try:
            sealed = (
                self.checkpoints.store,
                self.checkpoints.history,
                self.idempotency,
                self.ledger,
                self.approvals,
            )
            for store in sealed:
                if store is not None:
                    await store.seal(tenant, run_id, lease.fence)
            cp = await self.checkpoints.latest(tenant, run_id)
            if cp is None:
                raise NoCheckpointError(
                    f"nothing is checkpointed under run {run_id!r} for tenant {tenant!r}"
                )
            if cp.is_tombstone:
                raise CheckpointTooLargeError(
                    f"run {run_id!r} cannot be carried on: {cp.reason}", retryable=False
                )
            refuse_carried_by_workflow(cp)
            refuse_uncarriable(cp)
            plan = await plan_resume(cp, self.idempotency)
            state = await carried_state(self.idempotency, tenant, run_id, cp, plan)
            cancel = None
            if not cp.status.finished:
                cancel = await cancel_requested(self.idempotency, tenant, run_id)
            if cancel is not None:
                plan = dataclasses.replace(plan, to_dispatch=())
            messages = await self.checkpoints.messages(cp)
        except BaseException:
            await self.leases.release(lease)
            raise
        return CarriedRun(
            lease=lease,
            checkpoint=cp,
            plan=plan,
            messages=tuple(messages),
            cancel=cancel,
            state=state,
        )
