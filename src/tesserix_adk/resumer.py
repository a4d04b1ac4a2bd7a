"""``Resumer``: take a run's lease, then — and only then — read its frontier and plan.

For code that drives the loop itself (a workflow engine, a custom worker). The lease is
taken before anything is read, so the worker that loses the race never sees the run.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

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
from tesserix_adk.stores.protocols import HistoryStore, IdempotencyStore, LeaseStore, RunLease

__all__ = ["CarriedRun", "Resumer"]


@dataclass(frozen=True, slots=True, kw_only=True)
class CarriedRun:
    """A run this worker now holds: its lease, frontier, plan and transcript."""

    lease: RunLease
    checkpoint: Checkpoint
    plan: ResumePlan
    messages: tuple[Message, ...]


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
    ) -> None:
        if history is not None and checkpoints.history is not history:
            raise ConfigurationError(
                "the history store is configured once, on the Checkpointer; pass the same one"
            )
        self.checkpoints = checkpoints
        self.leases = leases
        self.idempotency = idempotency
        self.policy = policy or LeasePolicy()

    async def resume(self, run_id: str, *, tenant: str, worker: str) -> CarriedRun:
        """Take the run for ``worker`` (``ResumeConflictError`` if someone holds it).

        The caller owns the returned lease: renew it (``Leaseholder``) and release it.
        """
        holder = f"{worker}-{secrets.token_hex(6)}"
        try:
            lease = await self.leases.acquire(tenant, run_id, holder, self.policy.ttl)
        except LeaseHeldError as exc:
            raise ResumeConflictError(
                f"run {run_id!r} is held by {exc.holder or 'another worker'}", holder=exc.holder
            ) from exc
        try:
            for store in (self.checkpoints.store, self.checkpoints.history, self.idempotency):
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
            plan = await plan_resume(cp, self.idempotency)
            messages = await self.checkpoints.messages(cp)
        except BaseException:
            await self.leases.release(lease)
            raise
        return CarriedRun(lease=lease, checkpoint=cp, plan=plan, messages=tuple(messages))
