"""In-process run leases; expiry by the injected clock only."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from tesserix_adk.errors import LeaseHeldError, LeaseLostError
from tesserix_adk.stores._common import positive_ttl
from tesserix_adk.stores.memory.fencing import RunKey
from tesserix_adk.stores.protocols import RunLease

__all__ = ["MemoryLeaseStore"]


@dataclass(slots=True, kw_only=True)
class _LeaseSlot:
    lease: RunLease | None = None
    # Counts acquisitions; it never goes back, so a fence is never handed out twice.
    fence: int = 0
    # When the last lease was released; a lapsed one's end is its own ``expires_at``.
    ended_at: float | None = None


class MemoryLeaseStore:
    """A ``LeaseStore`` in a dictionary; expiry decided by the injected ``clock`` only."""

    def __init__(self, *, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._slots: dict[RunKey, _LeaseSlot] = {}

    async def acquire(self, tenant: str, run_id: str, holder: str, ttl: float) -> RunLease:
        """Take the run (raising its fence) or raise ``LeaseHeldError`` naming the holder."""
        ttl = positive_ttl(ttl)
        now = self._clock()
        slot = self._slots.setdefault((tenant, run_id), _LeaseSlot())
        if slot.lease is not None and now < slot.lease.expires_at:
            raise LeaseHeldError(
                f"run {run_id!r} is leased to {slot.lease.holder!r}", holder=slot.lease.holder
            )
        previous_end = slot.ended_at if slot.lease is None else slot.lease.expires_at
        slot.fence += 1
        slot.lease = RunLease(
            tenant=tenant,
            run_id=run_id,
            holder=holder,
            fence=slot.fence,
            expires_at=now + ttl,
            previous_end=previous_end,
        )
        return slot.lease

    async def renew(self, lease: RunLease, ttl: float) -> RunLease:
        """Extend a live lease, keeping its fence, or raise ``LeaseLostError``."""
        ttl = positive_ttl(ttl)
        now = self._clock()
        slot = self._slots.get((lease.tenant, lease.run_id))
        current = None if slot is None else slot.lease
        if (
            slot is None
            or current is None
            or current.fence != lease.fence
            or current.holder != lease.holder
            or now >= current.expires_at
        ):
            raise LeaseLostError(
                f"lease on run {lease.run_id!r} at fence {lease.fence} lapsed or was taken"
            )
        slot.lease = replace(current, expires_at=now + ttl)
        return slot.lease

    async def release(self, lease: RunLease) -> None:
        """Free the run, only for the holder at that fence; the fence stays."""
        slot = self._slots.get((lease.tenant, lease.run_id))
        if (
            slot is not None
            and slot.lease is not None
            and slot.lease.fence == lease.fence
            and slot.lease.holder == lease.holder
        ):
            slot.ended_at = min(slot.lease.expires_at, self._clock())
            slot.lease = None

    async def current(self, tenant: str, run_id: str) -> RunLease | None:
        """The lease live by the store's clock, else ``None``."""
        slot = self._slots.get((tenant, run_id))
        if slot is None or slot.lease is None or self._clock() >= slot.lease.expires_at:
            return None
        return slot.lease

    async def ended_ago(self, tenant: str, run_id: str) -> float | None:
        """Seconds since the run's last lease ended; ``None`` if one is live or none ended."""
        slot = self._slots.get((tenant, run_id))
        now = self._clock()
        if slot is None:
            return None
        end = slot.ended_at if slot.lease is None else slot.lease.expires_at
        return None if end is None or now < end else now - end
