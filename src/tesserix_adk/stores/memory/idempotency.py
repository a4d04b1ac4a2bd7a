"""In-process idempotency records, keyed by (tenant, key); ttl claims lapse by the clock."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

from tesserix_adk.stores._common import positive_ttl
from tesserix_adk.stores.memory.fencing import Fences
from tesserix_adk.stores.protocols import IdempotencyRecord, RecordStatus, ToolFlags
from tesserix_adk.stores.records import (
    after_claim,
    after_complete,
    after_resolve,
    checked_resolution,
    listed_for,
)

__all__ = ["MemoryIdempotencyStore"]


class MemoryIdempotencyStore:
    """An ``IdempotencyStore`` in a dictionary; ttl claims lapse by the injected ``clock``."""

    def __init__(self, *, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        # Keyed by (tenant, key): two tenants' records of one key never meet.
        self._records: dict[tuple[str, str], IdempotencyRecord] = {}
        self._fences = Fences()

    def _live(self, tenant: str, key: str, now: float) -> IdempotencyRecord | None:
        record = self._records.get((tenant, key))
        if record is None:
            return None
        if (
            record.status is RecordStatus.in_flight
            and record.expires_at is not None
            and now >= record.expires_at
        ):
            # A lapsed ttl claim is absent everywhere; dropping it keeps that true.
            del self._records[(tenant, key)]
            return None
        return record

    async def claim(
        self,
        key: str,
        *,
        holder: str,
        tenant: str,
        run_id: str,
        iteration: int | None,
        tool: str | None,
        call_id: str | None,
        flags: ToolFlags | None,
        fence: int | None = None,
        ttl: float | None = None,
        takeover: bool = False,
    ) -> IdempotencyRecord:
        """Claim the tenant's ``key`` and return the record as it stands after the call."""
        if tool is None:
            # A resume claim is taken before any lease exists: never fenced.
            fence = None
        else:
            self._fences.check(tenant, run_id, fence)
        if ttl is not None:
            ttl = positive_ttl(ttl)
        now = self._clock()
        record, changed = after_claim(
            self._live(tenant, key, now),
            key=key,
            holder=holder,
            tenant=tenant,
            run_id=run_id,
            iteration=iteration,
            tool=tool,
            call_id=call_id,
            flags=flags,
            fence=fence,
            now=now,
            expires_at=None if ttl is None else now + ttl,
            takeover=takeover,
        )
        if tool is not None:
            self._fences.accept(tenant, run_id, fence)
        if changed:
            self._records[(tenant, key)] = record
        return record

    async def complete(
        self, key: str, outcome: bytes, *, tenant: str, holder: str
    ) -> IdempotencyRecord:
        """Record the outcome of a claim held by ``holder`` (not fenced)."""
        now = self._clock()
        record, changed = after_complete(
            self._live(tenant, key, now), key=key, outcome=outcome, holder=holder, now=now
        )
        if changed:
            self._records[(tenant, key)] = record
        return record

    async def release(
        self, key: str, *, tenant: str, holder: str, undispatched: bool = False
    ) -> None:
        """Drop a ttl claim held by ``holder``, or any claim it held and did not act on
        (``undispatched``); anything else is left alone."""
        record = self._live(tenant, key, self._clock())
        if (
            record is not None
            and record.status is RecordStatus.in_flight
            and record.holder == holder
            and (record.expires_at is not None or undispatched)
        ):
            del self._records[(tenant, key)]

    async def lookup(self, keys: Sequence[str], *, tenant: str) -> dict[str, IdempotencyRecord]:
        """The tenant's live records of ``keys``; absent keys are left out."""
        now = self._clock()
        found: dict[str, IdempotencyRecord] = {}
        for key in keys:
            record = self._live(tenant, key, now)
            if record is not None:
                found[key] = record
        return found

    async def records(self, tenant: str, run_id: str) -> list[IdempotencyRecord]:
        """Every live record of the run, by (iteration, since, key); the run claim first."""
        return self._of_run(tenant, run_id)

    def _of_run(self, tenant: str, run_id: str) -> list[IdempotencyRecord]:
        now = self._clock()
        live = (self._live(owner, key, now) for owner, key in list(self._records))
        return listed_for((r for r in live if r is not None), tenant, run_id)

    async def records_from(
        self, tenant: str, run_id: str, iteration: int
    ) -> list[IdempotencyRecord]:
        """The run's live tool-call records from ``iteration`` on, outcomes left out."""
        return [
            dataclasses.replace(r, outcome=None)
            for r in self._of_run(tenant, run_id)
            if r.tool is not None and r.iteration is not None and r.iteration >= iteration
        ]

    async def resolve(
        self,
        key: str,
        outcome: bytes | None = None,
        *,
        tenant: str,
        never_ran: bool = False,
        by: str,
        holder: str | None = None,
    ) -> IdempotencyRecord:
        """An operator settles the tenant's in-flight call: its outcome, or that it never
        ran."""
        checked_resolution(outcome, never_ran)
        now = self._clock()
        record = after_resolve(
            self._live(tenant, key, now),
            key=key,
            outcome=outcome,
            never_ran=never_ran,
            by=by,
            now=now,
            holder=holder,
        )
        self._records[(tenant, key)] = record
        return record

    async def seal(self, tenant: str, run_id: str, fence: int) -> None:
        """Raise the highest-seen fence for the run without writing data."""
        self._fences.seal(tenant, run_id, fence)
