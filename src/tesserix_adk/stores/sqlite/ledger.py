"""SQLite spend: micros and tokens per run."""

from __future__ import annotations

import sqlite3

from tesserix_adk.messages import Usage
from tesserix_adk.stores.rows import decoded
from tesserix_adk.stores.sqlite.fencing import FencedSqliteStore, fenced

__all__ = ["SqliteLedger"]

_LEDGER = "ledger"


class SqliteLedger(FencedSqliteStore):
    """A ``Ledger``: micros and tokens per run."""

    _kind = _LEDGER

    async def charge(
        self, tenant: str, run_id: str, micros: int, usage: Usage, *, fence: int | None = None
    ) -> None:
        """Add a model call's cost and usage to the run."""

        def charge(conn: sqlite3.Connection) -> None:
            fenced(conn, _LEDGER, tenant, run_id, fence)
            conn.execute(
                "INSERT INTO adk_ledger (tenant, run_id, micros, input_tokens, output_tokens) "
                "VALUES (?, ?, ?, ?, ?) ON CONFLICT (tenant, run_id) DO UPDATE SET "
                "micros = adk_ledger.micros + excluded.micros, "
                "input_tokens = adk_ledger.input_tokens + excluded.input_tokens, "
                "output_tokens = adk_ledger.output_tokens + excluded.output_tokens",
                (tenant, run_id, int(micros), usage.input_tokens, usage.output_tokens),
            )

        await self.database.write(charge, weight=0)

    async def totals(self, tenant: str, run_id: str) -> tuple[int, Usage]:
        """Micros and tokens charged to the run so far, in one read (``LedgerTotals``)."""

        @decoded("ledger row")
        def totals(conn: sqlite3.Connection) -> tuple[int, Usage]:
            row = conn.execute(
                "SELECT micros, input_tokens, output_tokens FROM adk_ledger "
                "WHERE tenant = ? AND run_id = ?",
                (tenant, run_id),
            ).fetchone()
            if row is None:
                return 0, Usage()
            return int(row[0]), Usage(input_tokens=int(row[1]), output_tokens=int(row[2]))

        return await self.database.read(totals)

    async def spent(self, tenant: str, run_id: str) -> int:
        """Micros charged to the run so far (0 for an unknown run)."""
        return (await self.totals(tenant, run_id))[0]

    async def usage(self, tenant: str, run_id: str) -> Usage:
        """Tokens charged to the run so far."""
        return (await self.totals(tenant, run_id))[1]
