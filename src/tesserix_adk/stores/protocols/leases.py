"""Run leases, numbered by a fence."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

__all__ = ["LeaseStore", "RunLease"]


@dataclass(frozen=True, slots=True, kw_only=True)
class RunLease:
    """The right to carry one run, numbered by a fence that rises on every acquisition.

    ``expires_at`` is the store's clock in epoch seconds, for display only.
    ``previous_end`` is set by ``acquire`` only: when the run's lease before this one ended
    by the store's clock (the last deadline it was renewed to if it lapsed, the moment it
    was released if it was released), ``None`` when no earlier end is on record. A claimant
    of that earlier lease may have started a call up to that moment, so whoever says such a
    call never ran waits a margin past it (``leases.never_ran_wait``). It is not part of the
    lease's identity.
    """

    tenant: str
    run_id: str
    holder: str
    fence: int
    expires_at: float
    previous_end: float | None = field(default=None, compare=False)

    def superseded_by(self, other: RunLease) -> bool:
        """``other`` is a later acquisition of the same run."""
        return (
            other.tenant == self.tenant and other.run_id == self.run_id and other.fence > self.fence
        )


@runtime_checkable
class LeaseStore(Protocol):
    """Hands out one lease per run at a time; expiry decided by the store's clock only."""

    async def acquire(self, tenant: str, run_id: str, holder: str, ttl: float) -> RunLease:
        """Take the run (raising its fence) or raise ``LeaseHeldError`` naming the holder."""
        ...

    async def renew(self, lease: RunLease, ttl: float) -> RunLease:
        """Extend a live lease, keeping its fence, or raise ``LeaseLostError``."""
        ...

    async def release(self, lease: RunLease) -> None:
        """Free the run, only for the holder at that fence; never lowers the fence."""
        ...

    async def current(self, tenant: str, run_id: str) -> RunLease | None:
        """The lease live by the store's clock, else ``None``."""
        ...

    async def ended_ago(self, tenant: str, run_id: str) -> float | None:
        """Seconds, by the store's clock, since the run's last lease ended (the last
        deadline it was renewed to if it lapsed, the moment of its release if released);
        ``None`` while a lease is live or when none ever ended. Reads only."""
        ...
