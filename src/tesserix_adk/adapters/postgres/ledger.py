"""Spend in PostgreSQL: ``adk_ledger``, micros and tokens per run, added by a fenced charge."""

from __future__ import annotations

from dataclasses import dataclass

from tesserix_adk.adapters.postgres.connection import PostgresDatabase, Row
from tesserix_adk.adapters.postgres.fenced import FencedStore, refusal, run_params, stale
from tesserix_adk.adapters.postgres.statements import Statements
from tesserix_adk.messages import Usage

__all__ = ["PostgresLedger"]


@dataclass(frozen=True, slots=True, kw_only=True)
class _SQL(Statements):
    seal: str
    charge: str
    totals: str


class PostgresLedger(FencedStore):
    """A ``Ledger`` in ``adk_ledger``: micros and tokens per run."""

    def __init__(self, database: PostgresDatabase) -> None:
        self._sql = _SQL.load("ledger", database.schema.schema)
        super().__init__(database, seal=self._sql.seal)

    async def charge(
        self, tenant: str, run_id: str, micros: int, usage: Usage, *, fence: int | None = None
    ) -> None:
        """Add a model call's cost and usage to the run."""
        params = run_params(
            tenant,
            run_id,
            fence,
            micros=int(micros),
            input_tokens=int(usage.input_tokens),
            output_tokens=int(usage.output_tokens),
        )
        row = await self.database.row(f"charging run {run_id!r}", self._sql.charge, params)
        refused_by = refusal(row, fence)
        if refused_by is not None:
            raise stale("charge", run_id, fence, refused_by)

    async def _totals(self, tenant: str, run_id: str) -> Row | None:
        return await self.database.row(
            f"reading the spend of run {run_id!r}", self._sql.totals, run_params(tenant, run_id)
        )

    async def totals(self, tenant: str, run_id: str) -> tuple[int, Usage]:
        """Micros and tokens charged to the run so far, in one request (``LedgerTotals``)."""
        row = await self._totals(tenant, run_id)
        if row is None:
            return 0, Usage()
        return int(row["micros"]), Usage(
            input_tokens=int(row["input_tokens"]), output_tokens=int(row["output_tokens"])
        )

    async def spent(self, tenant: str, run_id: str) -> int:
        """Micros charged to the run so far (0 for an unknown run)."""
        return (await self.totals(tenant, run_id))[0]

    async def usage(self, tenant: str, run_id: str) -> Usage:
        """Tokens charged to the run so far."""
        return (await self.totals(tenant, run_id))[1]
