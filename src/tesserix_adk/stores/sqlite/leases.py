"""SQLite run leases: one row per run ever leased, expiry by SQLite's clock only."""

from __future__ import annotations

import sqlite3
from dataclasses import replace

from tesserix_adk.errors import LeaseHeldError, LeaseLostError
from tesserix_adk.stores._common import positive_ttl
from tesserix_adk.stores.protocols import RunLease
from tesserix_adk.stores.rows import decoded
from tesserix_adk.stores.sqlite.database import SqliteDatabase
from tesserix_adk.stores.sqlite.fencing import NOW_SQL, sqlite_now

__all__ = ["SqliteLeaseStore"]


class SqliteLeaseStore:
    """A ``LeaseStore``; expiry decided by SQLite's clock only.

    Each run keeps one row whose fence counts acquisitions; release frees the run but keeps
    the row, so a fence is never handed out twice.

    The clock's limit: SQLite's ``julianday('now')`` is the wall clock of whichever process
    runs the statement. A process whose clock is off, or a host whose clock is stepped, moves
    every lease's expiry as seen by that process: a clock stepped forward by S seconds can
    take a live lease up to S seconds early; one stepped back blocks a lapsed run for up to
    S seconds. Fences still prevent a duplicate: the earlier holder's next write or claim is
    refused, and its own monotonic deadline (``Leaseholder``) stops it at its ttl whatever
    the wall clock says. Keep the host's clock slewed (NTP), not stepped, if that matters.
    """

    def __init__(self, database: SqliteDatabase) -> None:
        self.database = database

    async def acquire(self, tenant: str, run_id: str, holder: str, ttl: float) -> RunLease:
        """Take the run (raising its fence) or raise ``LeaseHeldError`` naming the holder."""
        ttl = positive_ttl(ttl)

        @decoded("lease")
        def acquire(conn: sqlite3.Connection) -> RunLease:
            now = sqlite_now(conn)
            row = conn.execute(
                "SELECT fence, holder, expires_at FROM adk_run_leases "
                "WHERE tenant = ? AND run_id = ?",
                (tenant, run_id),
            ).fetchone()
            if row is not None and row[1] is not None and now < row[2]:
                raise LeaseHeldError(f"run {run_id!r} is leased to {row[1]!r}", holder=row[1])
            lease = RunLease(
                tenant=tenant,
                run_id=run_id,
                holder=holder,
                fence=(0 if row is None else int(row[0])) + 1,
                expires_at=now + ttl,
                previous_end=None if row is None or row[2] is None else float(row[2]),
            )
            conn.execute(
                "INSERT INTO adk_run_leases (tenant, run_id, fence, holder, expires_at) "
                "VALUES (?, ?, ?, ?, ?) ON CONFLICT (tenant, run_id) DO UPDATE SET "
                "fence = excluded.fence, holder = excluded.holder, "
                "expires_at = excluded.expires_at",
                (tenant, run_id, lease.fence, holder, lease.expires_at),
            )
            return lease

        return await self.database.write(acquire)

    async def renew(self, lease: RunLease, ttl: float) -> RunLease:
        """Extend a live lease, keeping its fence, or raise ``LeaseLostError``."""
        ttl = positive_ttl(ttl)

        @decoded("lease")
        def renew(conn: sqlite3.Connection) -> RunLease:
            now = sqlite_now(conn)
            row = conn.execute(
                "SELECT fence, holder, expires_at FROM adk_run_leases "
                "WHERE tenant = ? AND run_id = ?",
                (lease.tenant, lease.run_id),
            ).fetchone()
            if (
                row is None
                or row[1] is None
                or row[0] != lease.fence
                or row[1] != lease.holder
                or now >= row[2]
            ):
                raise LeaseLostError(
                    f"lease on run {lease.run_id!r} at fence {lease.fence} lapsed or was taken"
                )
            renewed = replace(lease, expires_at=now + ttl)
            conn.execute(
                "UPDATE adk_run_leases SET expires_at = ? WHERE tenant = ? AND run_id = ?",
                (renewed.expires_at, lease.tenant, lease.run_id),
            )
            return renewed

        return await self.database.write(renew)

    async def release(self, lease: RunLease) -> None:
        """Free the run, only for the holder at that fence; the fence stays."""

        def release(conn: sqlite3.Connection) -> None:
            # expires_at keeps when the lease ended, which the next acquisition reports.
            now = sqlite_now(conn)
            conn.execute(
                "UPDATE adk_run_leases SET holder = NULL, "
                "expires_at = CASE WHEN expires_at IS NULL OR expires_at > ? THEN ? "
                "ELSE expires_at END "
                "WHERE tenant = ? AND run_id = ? AND fence = ? AND holder = ?",
                (now, now, lease.tenant, lease.run_id, lease.fence, lease.holder),
            )

        await self.database.write(release)

    async def current(self, tenant: str, run_id: str) -> RunLease | None:
        """The lease live by the store's clock, else ``None``."""

        @decoded("lease")
        def current(conn: sqlite3.Connection) -> RunLease | None:
            row = conn.execute(
                "SELECT fence, holder, expires_at FROM adk_run_leases "
                f"WHERE tenant = ? AND run_id = ? AND holder IS NOT NULL "
                f"AND expires_at > {NOW_SQL}",
                (tenant, run_id),
            ).fetchone()
            if row is None:
                return None
            return RunLease(
                tenant=tenant,
                run_id=run_id,
                holder=row[1],
                fence=int(row[0]),
                expires_at=float(row[2]),
            )

        return await self.database.read(current)

    async def ended_ago(self, tenant: str, run_id: str) -> float | None:
        """Seconds since the run's last lease ended; ``None`` if one is live or none ended."""

        @decoded("lease")
        def ended_ago(conn: sqlite3.Connection) -> float | None:
            now = sqlite_now(conn)
            row = conn.execute(
                "SELECT expires_at FROM adk_run_leases WHERE tenant = ? AND run_id = ? "
                "AND expires_at IS NOT NULL AND (holder IS NULL OR expires_at <= ?)",
                (tenant, run_id, now),
            ).fetchone()
            return None if row is None else max(0.0, now - float(row[0]))

        return await self.database.read(ended_ago)
