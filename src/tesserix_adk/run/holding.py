"""Holding a run for one attempt: its lease, and every store sealed with the lease's fence.

The lease decides who carries the run; the seal makes a superseded holder's writes fail
in every store, even before this holder's first write. A resume that finds the lease held
says ``ResumeConflictError`` and when, by the store's clock, the lease lapses.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Protocol

from tesserix_adk.checkpoint.planning import ResumePlan
from tesserix_adk.errors import (
    AdkError,
    DivergedRunError,
    IndeterminateToolCallError,
    LeaseHeldError,
    ResumeConflictError,
    StoreUnavailableError,
)
from tesserix_adk.leases import Leaseholder, LeasePolicy
from tesserix_adk.run.attempt import Attempt, RunClaim
from tesserix_adk.stores.protocols import IdempotencyRecord, IdempotencyStore, LeaseStore
from tesserix_adk.timestamps import iso_time

__all__ = [
    "Sealable",
    "carried_elsewhere",
    "carried_now",
    "come_back_later",
    "held_to_decide",
    "holding",
    "lease_lapses",
]


class Sealable(Protocol):
    """A store that refuses writes carrying a fence below the one it was sealed with."""

    async def seal(self, tenant: str, run_id: str, fence: int) -> None:
        """Refuse every later write of the run with a lower fence."""
        ...


@contextlib.asynccontextmanager
async def holding(
    leases: LeaseStore | None,
    policy: LeasePolicy,
    stores: Sequence[Sealable],
    attempt: Attempt,
    tenant: str,
    run_id: str,
    *,
    resuming: bool = False,
) -> AsyncIterator[None]:
    """Hold the run's lease (with a lease store) and seal ``stores`` with its fence, for
    the length of the block; release it on the way out, shielded."""
    if leases is None:
        with _told_while_held(attempt):
            yield
        return
    try:
        lease = await Leaseholder.acquire(leases, tenant, run_id, attempt.holder, policy)
    except LeaseHeldError as exc:
        if not resuming:
            raise
        raise ResumeConflictError(
            f"run {run_id!r} is held by {exc.holder or 'another worker'}"
            + await lease_lapses(leases, tenant, run_id),
            holder=exc.holder,
        ) from exc
    async with lease:
        attempt.lease = lease
        # Before reading anything: a superseded holder is refused from here on.
        for store in stores:
            await store.seal(tenant, run_id, lease.fence)
        with _told_while_held(attempt):
            yield


@contextlib.asynccontextmanager
async def held_to_decide(
    idempotency: IdempotencyStore,
    leases: LeaseStore | None,
    policy: LeasePolicy,
    *,
    tenant: str,
    run_id: str,
    holder: str,
    claim_ttl: float,
) -> AsyncIterator[None]:
    """Hold the run as a take does (its resume claim, then its lease) for the block, to
    decide what only a run nobody carries may be told (parked, say):
    ``ResumeConflictError`` or ``LeaseHeldError`` while another attempt carries it, or has
    begun to (a take claims the run before it leases it)."""
    claim = RunClaim(idempotency, tenant=tenant, run_id=run_id, holder=holder, ttl=claim_ttl)
    await claim.take()
    try:
        if leases is None:
            yield
        else:
            async with await Leaseholder.acquire(leases, tenant, run_id, holder, policy):
                yield
    finally:
        await claim.release()


# What an attempt decides from what it read of the run (records, the cancel request): a
# worker parks the run on it and an operator is paged.
_TOLD_FROM_READS = (IndeterminateToolCallError, DivergedRunError)


@contextlib.contextmanager
def _told_while_held(attempt: Attempt) -> Iterator[None]:
    """``LeaseLostError`` in place of a refusal decided from reads (``_TOLD_FROM_READS``)
    when the attempt's lease may have lapsed since: its replies came back late, and what
    it read may be the live holder's doing (a claim in flight, a call made ahead). Planning
    calls another holder's claim abandoned because this attempt holds the lease; only its
    own lease can say whether it did while it read."""
    try:
        yield
    except _TOLD_FROM_READS:
        attempt.guard()
        raise


async def lease_lapses(leases: LeaseStore, tenant: str, run_id: str) -> str:
    """When the live lease lapses by the store's clock, for a "retry later" message."""
    try:
        current = await leases.current(tenant, run_id)
    except Exception:  # only the message is at stake
        return ""
    if current is None:
        return ""
    return (
        f"; its lease lapses at {iso_time(current.expires_at)} by the store's clock unless renewed"
    )


async def carried_now(leases: LeaseStore | None, tenant: str, run_id: str) -> bool:
    """Whether run ``run_id`` is carried now: its lease is live, so its holder may be sending
    a call it claimed. ``False`` without a lease store or when the lease cannot be read for
    a reason other than the store being away (that one is raised: retryable)."""
    if leases is None:
        return False
    try:
        return await leases.current(tenant, run_id) is not None
    except StoreUnavailableError:
        raise
    except AdkError:
        return False


async def carried_elsewhere(
    plan: ResumePlan, leases: LeaseStore | None, *, tenant: str, run_id: str
) -> bool:
    """Raise ``ResumeConflictError`` when every call in doubt in ``plan`` is claimed by
    another run (a business key two runs share) that is carried now: its holder may be
    sending it, so this run comes back later (it then replays that run's outcome), instead
    of being refused and left to an operator who could not decide it either; and when a
    call planned to be taken over is held by such a run. Else whether ``plan`` holds
    another run's claim at all: that run may have recorded its outcome and let go since the
    plan was read, so the plan is to be read again before refusing."""
    for pc in plan.to_dispatch:
        # Safe to send again, and so taken over, unless its holder's run is carried now:
        # it may be sending the call, and its outcome would be fenced out and lost.
        rec = pc.record
        taken = pc.takeover and rec is not None and rec.holding_run != run_id
        if taken and rec is not None and await carried_now(leases, tenant, rec.holding_run):
            raise come_back_later(f"{pc.tool} ({pc.call_id})", rec)
    others = [
        p for p in plan.indeterminate if p.record is not None and p.record.holding_run != run_id
    ]
    if not others:
        return False
    if len(others) != len(plan.indeterminate):
        return True
    for pc in others:
        assert pc.record is not None
        if not await carried_now(leases, tenant, pc.record.holding_run):
            return True
    first = others[0].record
    assert first is not None
    raise come_back_later(", ".join(f"{p.tool} ({p.call_id})" for p in others), first)


def come_back_later(calls: str, rec: IdempotencyRecord) -> ResumeConflictError:
    """The refusal of a run whose ``calls`` another run, carried now, claimed under the
    same key (``rec``, its claim): its holder may be sending them."""
    return ResumeConflictError(
        f"{calls}: claimed under the same key by run {rec.holding_run!r}, which is carried now "
        "and may be sending it; carry this run on once that run has its outcome",
        holder=rec.holder,
    )
