"""Run leases in PostgreSQL: ``adk_run_leases``, one row per run ever leased.

The row's ``fence`` counts acquisitions and never goes back; ``holder`` is NULL once
released, and ``expires_at`` then keeps when the lease ended. One ``INSERT … ON CONFLICT …
DO UPDATE … WHERE … RETURNING`` decides an acquisition (``sql/leases/acquire.sql``); expiry
is decided by the server's ``clock_timestamp()``.
"""

from __future__ import annotations

from dataclasses import dataclass

from tesserix_adk.adapters.postgres.connection import PostgresDatabase
from tesserix_adk.adapters.postgres.fenced import run_params
from tesserix_adk.adapters.postgres.statements import Statements
from tesserix_adk.errors import LeaseHeldError, LeaseLostError
from tesserix_adk.stores._common import positive_ttl
from tesserix_adk.stores.protocols import RunLease

__all__ = ["PostgresLeaseStore"]


@dataclass(frozen=True, slots=True, kw_only=True)
class _SQL(Statements):
    acquire: str
    live: str
    renew: str
    release: str
    ended: str


class PostgresLeaseStore:
    """A ``LeaseStore`` in ``adk_run_leases``; expiry decided by ``clock_timestamp()``.

    One ``INSERT … ON CONFLICT … DO UPDATE … WHERE … RETURNING`` decides an acquisition;
    the fence is the row's counter, which release keeps and every acquisition raises.
    """

    def __init__(self, database: PostgresDatabase) -> None:
        self.database = database
        self._sql = _SQL.load("leases", database.schema.schema)

    async def acquire(self, tenant: str, run_id: str, holder: str, ttl: float) -> RunLease:
        """Take the run (raising its fence) or raise ``LeaseHeldError`` naming the holder."""
        params = run_params(tenant, run_id, holder=holder, ttl=positive_ttl(ttl))
        action = f"acquiring the lease on run {run_id!r}"
        row = await self.database.row(action, self._sql.acquire, params)
        if row is None:
            # Informational only: who holds it right after the refusal (None if it lapsed).
            current = await self.database.row(action, self._sql.live, params)
            holding = None if current is None else str(current["holder"])
            whom = "another holder" if holding is None else repr(holding)
            raise LeaseHeldError(f"run {run_id!r} is leased to {whom}", holder=holding)
        return RunLease(
            tenant=tenant,
            run_id=run_id,
            holder=holder,
            fence=int(row["fence"]),
            expires_at=row["expires_at"],
            previous_end=row["previous_end"],
        )

    async def renew(self, lease: RunLease, ttl: float) -> RunLease:
        """Extend a live lease, keeping its fence, or raise ``LeaseLostError``."""
        params = run_params(
            lease.tenant, lease.run_id, lease.fence, holder=lease.holder, ttl=positive_ttl(ttl)
        )
        row = await self.database.row(
            f"renewing the lease on run {lease.run_id!r}", self._sql.renew, params
        )
        if row is None:
            raise LeaseLostError(
                f"lease on run {lease.run_id!r} at fence {lease.fence} lapsed or was taken"
            )
        return RunLease(
            tenant=lease.tenant,
            run_id=lease.run_id,
            holder=lease.holder,
            fence=lease.fence,
            expires_at=row["expires_at"],
            previous_end=lease.previous_end,
        )

    async def release(self, lease: RunLease) -> None:
        """Free the run, only for the holder at that fence; the fence stays."""
        await self.database.rows(
            f"releasing the lease on run {lease.run_id!r}",
            self._sql.release,
            run_params(lease.tenant, lease.run_id, lease.fence, holder=lease.holder),
        )

    async def current(self, tenant: str, run_id: str) -> RunLease | None:
        """The lease live by the server's clock, else ``None``."""
        row = await self.database.row(
            f"reading the lease on run {run_id!r}", self._sql.live, run_params(tenant, run_id)
        )
        if row is None:
            return None
        return RunLease(
            tenant=tenant,
            run_id=run_id,
            holder=row["holder"],
            fence=int(row["fence"]),
            expires_at=row["expires_at"],
        )

    async def ended_ago(self, tenant: str, run_id: str) -> float | None:
        """Seconds since the run's last lease ended; ``None`` if one is live or none ended."""
        row = await self.database.row(
            f"reading when the lease on run {run_id!r} ended",
            self._sql.ended,
            run_params(tenant, run_id),
        )
        return None if row is None else max(0.0, row["ago"])
