"""The idempotency record state machine, as pure functions.

Stores that decide in Python (memory, SQLite) read the live record, call one of these inside
their own atomic section, and save what comes back; Redis and PostgreSQL decide the same in
their scripts and statements. Each function returns the record as it stands afterwards and
whether it must be written.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

from tesserix_adk.errors import StaleFenceError
from tesserix_adk.stores.protocols import IdempotencyRecord, RecordStatus, ToolFlags

__all__ = [
    "after_claim",
    "after_complete",
    "after_resolve",
    "checked_resolution",
    "listed_by",
    "listed_for",
    "run_order",
]


def after_claim(
    existing: IdempotencyRecord | None,
    *,
    key: str,
    holder: str,
    tenant: str,
    run_id: str,
    iteration: int | None,
    tool: str | None,
    call_id: str | None,
    flags: ToolFlags | None,
    fence: int | None,
    now: float,
    expires_at: float | None,
    takeover: bool,
) -> tuple[IdempotencyRecord, bool]:
    """A claim on the live record ``existing`` (``None``: absent)."""
    if existing is None or existing.status is RecordStatus.never_ran:
        fresh = IdempotencyRecord(
            key=key,
            status=RecordStatus.in_flight,
            holder=holder,
            tenant=tenant,
            run_id=run_id,
            iteration=iteration,
            tool=tool,
            call_id=call_id,
            flags=flags,
            fence=fence,
            since=now,
            expires_at=expires_at,
            never_ran_by=existing.by if existing is not None else None,
        )
        return fresh, True
    if existing.status is RecordStatus.in_flight and existing.holder == holder:
        renewed = replace(
            existing,
            fence=existing.fence if fence is None else fence,
            expires_at=existing.expires_at if expires_at is None else expires_at,
        )
        return renewed, True
    if existing.status is RecordStatus.in_flight and takeover:
        # The call stays its first run's (that run's listing finds it, turn and call id
        # as it asked); the run whose holder took it is kept beside, with its own turn and
        # call id: its lease is the one looked at, and its listing finds the call too.
        other = run_id != existing.run_id
        taken = replace(
            existing,
            holder=holder,
            holder_run=run_id if other else None,
            holder_iteration=iteration if other else None,
            holder_call_id=call_id if other else None,
            fence=fence,
            since=now,
            expires_at=expires_at,
        )
        return taken, True
    # Completed, or in flight under another holder without takeover: unchanged.
    return existing, False


def after_complete(
    existing: IdempotencyRecord | None, *, key: str, outcome: bytes, holder: str, now: float
) -> tuple[IdempotencyRecord, bool]:
    """A holder records the outcome of its claim (``StaleFenceError`` if it holds none)."""
    if existing is None:
        raise StaleFenceError(f"{holder!r} holds no claim on {key!r}")
    if existing.status is RecordStatus.completed and existing.holder == holder and not existing.by:
        return existing, False
    if existing.status is not RecordStatus.in_flight or existing.holder != holder:
        raise StaleFenceError(
            f"{holder!r} does not hold {key!r} in flight "
            f"({existing.status} under {existing.holder!r})"
        )
    done = replace(
        existing,
        status=RecordStatus.completed,
        outcome=bytes(outcome),
        completed_at=now,
        expires_at=None,
    )
    return done, True


def checked_resolution(outcome: bytes | None, never_ran: bool) -> None:
    """``ValueError`` unless exactly one of an outcome or ``never_ran`` is given."""
    if never_ran == (outcome is not None):
        raise ValueError("resolve needs exactly one of an outcome or never_ran=True")


def after_resolve(
    existing: IdempotencyRecord | None,
    *,
    key: str,
    outcome: bytes | None,
    never_ran: bool,
    by: str,
    now: float,
    holder: str | None = None,
) -> IdempotencyRecord:
    """An operator settles an in-flight call (``KeyError`` absent, ``ValueError`` settled,
    or in flight under another holder than ``holder`` when it is given)."""
    if existing is None:
        raise KeyError(key)
    if existing.status is not RecordStatus.in_flight:
        raise ValueError(f"{key!r} is {existing.status}, not in flight")
    if holder is not None and existing.holder != holder:
        raise ValueError(f"{key!r} is in flight under {existing.holder!r}, not {holder!r}")
    if never_ran:
        return replace(existing, status=RecordStatus.never_ran, by=by, expires_at=None)
    return replace(
        existing,
        status=RecordStatus.completed,
        outcome=None if outcome is None else bytes(outcome),
        by=by,
        completed_at=now,
        expires_at=None,
    )


def run_order(record: IdempotencyRecord) -> tuple[int, float, str]:
    """Where ``records`` (and ``records_from``) place a record: by iteration (a run claim,
    which has none, first), then by when it was claimed, then by key."""
    return (-1 if record.iteration is None else record.iteration, record.since, record.key)


def listed_by(record: IdempotencyRecord, run_id: str) -> IdempotencyRecord:
    """``record`` as the listing of ``run_id`` shows it: a call the run took over from
    another run at the run's own turn and call id (``holder_iteration``, ``holder_call_id``),
    so planning sees whether it is ahead of the run's frontier; any other unchanged."""
    if record.run_id != run_id and record.holder_run == run_id:
        return replace(record, iteration=record.holder_iteration, call_id=record.holder_call_id)
    return record


def listed_for(
    records: Iterable[IdempotencyRecord], tenant: str, run_id: str
) -> list[IdempotencyRecord]:
    """Those of ``records`` the listing of the tenant's ``run_id`` holds (its own calls and
    those it took over), each as ``listed_by`` shows it, in ``run_order``."""
    mine = [
        listed_by(r, run_id)
        for r in records
        if r.tenant == tenant and run_id in (r.run_id, r.holder_run)
    ]
    return sorted(mine, key=run_order)
