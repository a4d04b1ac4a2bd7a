"""What the fenced PostgreSQL stores share: their database, ``seal``, and reading a verdict.

Fences. ``adk_fences`` keeps the highest fence each kind of store has seen per run. A fenced
write is one statement whose first part upserts that row (which locks it, serialising the
run's writes) only if the write's fence is at least the highest seen *and* at least the
run's current lease fence in ``adk_run_leases``; its data parts run only if that row came
back. So a takeover fences the old holder out at once, without waiting for a seal. The
statement's last row is its verdict (``accepted``, ``seen``, ``leased``; see
``statements.py``), which ``refusal`` reads.
"""

from __future__ import annotations

from typing import Any

from tesserix_adk.adapters.postgres.connection import PostgresDatabase, Row
from tesserix_adk.adapters.postgres.grouping import PostgresWriteGroup
from tesserix_adk.errors import StaleFenceError
from tesserix_adk.stores._common import stale_fence, unsealable

__all__ = ["ATTEMPTS", "FencedStore", "refusal", "run_params", "stale"]

# A decision that found the row changed under it after its snapshot is run again.
ATTEMPTS = 5


def run_params(tenant: str, run_id: str, fence: int | None = None, **more: Any) -> dict[str, Any]:
    """The parameters of a statement on one run: ``tenant``, ``run_id``, ``fence`` and more."""
    return {"tenant": tenant, "run_id": run_id, "fence": fence, **more}


def refusal(row: Row | None, fence: int | None) -> int | None:
    """The fence that refused a write (``-1``: a higher one, not named), or ``None`` if the
    gate let it through."""
    if row is None:
        return -1
    if row["accepted"]:
        return None
    known = [f for f in (row["seen"], row["leased"]) if f is not None]
    return max(known) if known else -1


def stale(what: str, run_id: str, fence: int | None, refused_by: int) -> StaleFenceError:
    """The refusal of a write ``what`` carrying ``fence``, refused by fence ``refused_by``."""
    return stale_fence(what, run_id, fence, refused_by if refused_by >= 0 else None)


class FencedStore:
    """A store whose writes pass the gate: its database and ``seal``."""

    def __init__(self, database: PostgresDatabase, *, seal: str) -> None:
        self.database = database
        self._seal = seal

    def write_group(self) -> PostgresWriteGroup:
        """A write group on the shared database: every store of it joins
        (``protocols.grouping.GroupedWrites``)."""
        return self.database.write_group()

    def joins(self, group: object) -> bool:
        """Whether this store's writes join ``group`` (one on the same database)."""
        return isinstance(group, PostgresWriteGroup) and group.database is self.database

    def commit_with_next(self, group: object) -> None:
        """``group``'s COMMIT goes with its next single statement
        (``protocols.grouping.CommitsWithNext``)."""
        if self.joins(group):
            assert isinstance(group, PostgresWriteGroup)
            group.commit_with_next()

    async def seal(self, tenant: str, run_id: str, fence: int) -> None:
        """Raise the highest-seen fence for the run without writing data."""
        row = await self.database.row(
            f"sealing run {run_id!r}", self._seal, run_params(tenant, run_id, int(fence))
        )
        refused_by = refusal(row, fence)
        if refused_by is not None:
            raise unsealable(run_id, fence, refused_by if refused_by >= 0 else None)
