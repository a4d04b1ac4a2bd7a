"""Frontiers and step snapshots in PostgreSQL: ``adk_checkpoints`` and ``adk_checkpoint_steps``.

A put writes the frontier (one row per run, what resume reads) and the step's snapshot in one
fenced statement (``sql/checkpoints/put.sql``); with ``keep_last=N`` the same statement also
prunes the steps to the N highest (``put_keeping.sql``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tesserix_adk.adapters.postgres.connection import PostgresDatabase, Row
from tesserix_adk.adapters.postgres.driver import Statement
from tesserix_adk.adapters.postgres.fenced import FencedStore, refusal, run_params, stale
from tesserix_adk.adapters.postgres.grouping import PostgresWriteGroup
from tesserix_adk.adapters.postgres.history import PostgresHistoryStore
from tesserix_adk.adapters.postgres.statements import Statements
from tesserix_adk.errors import ConfigurationError
from tesserix_adk.stores.grouping import joined
from tesserix_adk.stores.protocols import HistoryHandle, StoredCheckpoint

__all__ = ["PostgresCheckpointStore"]


@dataclass(frozen=True, slots=True, kw_only=True)
class _SQL(Statements):
    seal: str
    put: str
    put_keeping: str
    latest: str
    at: str
    steps: str
    runs: str
    forget: str


def _check_put(row: Row | None, run_id: str, fence: int | None) -> None:
    refused_by = refusal(row, fence)
    if refused_by is not None:
        raise stale("write", run_id, fence, refused_by)


class PostgresCheckpointStore(FencedStore):
    """A ``CheckpointStore`` in ``adk_checkpoints`` (the frontier, one row per run) and
    ``adk_checkpoint_steps``; ``keep_last=N`` keeps the N highest steps."""

    def __init__(self, database: PostgresDatabase, *, keep_last: int | None = None) -> None:
        if keep_last is not None and keep_last < 1:
            raise ConfigurationError(f"keep_last must be at least 1, got {keep_last}")
        self._sql = _SQL.load("checkpoints", database.schema.schema)
        super().__init__(database, seal=self._sql.seal)
        self.keep_last = keep_last

    async def put(
        self, tenant: str, run_id: str, payload: bytes, *, step: int, fence: int | None = None
    ) -> None:
        """Write a frontier; it becomes ``latest`` and step ``step`` (last write wins)."""
        sql, params = self._putting(tenant, run_id, payload, step=step, fence=fence)
        row = await self.database.row(f"writing a frontier of run {run_id!r}", sql, params)
        _check_put(row, run_id, fence)

    async def put_with_history(
        self,
        history: object,
        tenant: str,
        run_id: str,
        payload: bytes,
        *,
        step: int,
        fence: int | None,
        encoded: Sequence[bytes],
        after: HistoryHandle | None,
    ) -> HistoryHandle | None:
        """Inside the caller's open write group: append the transcript and put the frontier
        in one savepoint of the group's transaction, sent in one round trip; if either is
        refused, neither is written, and the append's refusal is told first. ``None``
        outside a group, or when ``history`` is not a PostgreSQL history store on this same
        database: the caller writes them one after the other. Alone, the pair would hold a
        transaction open between its statements and its COMMIT, where no idle bound can
        end it (a holder frozen there would lock the run's fences for every other writer);
        a group already spans round trips, so the pair costs it nothing of the kind."""
        group = joined(self.database)
        if (
            not isinstance(group, PostgresWriteGroup)
            or not isinstance(history, PostgresHistoryStore)
            or history.database is not self.database
        ):
            return None
        append = history.appending(tenant, run_id, encoded, fence=fence, after=after)
        put = self._putting(tenant, run_id, payload, step=step, fence=fence)

        def check(results: list[list[Row]]) -> None:
            appended, written = (rows[0] if rows else None for rows in results)
            append.check(appended)
            _check_put(written, run_id, fence)

        await group.rows_together(
            f"writing a frontier of run {run_id!r} with its transcript",
            [(append.sql, append.params), put],
            check,
        )
        return append.handle

    def _putting(
        self, tenant: str, run_id: str, payload: bytes, *, step: int, fence: int | None
    ) -> Statement:
        sql = self._sql.put if self.keep_last is None else self._sql.put_keeping
        params = run_params(
            tenant, run_id, fence, step=int(step), payload=bytes(payload), keep_last=self.keep_last
        )
        return sql, params

    async def latest(self, tenant: str, run_id: str) -> StoredCheckpoint | None:
        """The last accepted put, or ``None``."""
        row = await self.database.row(
            f"reading the frontier of run {run_id!r}", self._sql.latest, run_params(tenant, run_id)
        )
        return None if row is None else StoredCheckpoint(**row)

    async def at(self, tenant: str, run_id: str, step: int) -> StoredCheckpoint | None:
        """The snapshot written under ``step``, or ``None`` (never a default)."""
        row = await self.database.row(
            f"reading step {step} of run {run_id!r}",
            self._sql.at,
            run_params(tenant, run_id, step=int(step)),
        )
        return None if row is None else StoredCheckpoint(**row)

    async def steps(self, tenant: str, run_id: str) -> list[int]:
        """The steps still kept for the run, ascending."""
        rows = await self.database.rows(
            f"listing the steps of run {run_id!r}", self._sql.steps, run_params(tenant, run_id)
        )
        return [int(row["step"]) for row in rows]

    async def runs(self, tenant: str) -> list[str]:
        """The run ids with a frontier for the tenant, sorted (by code point)."""
        rows = await self.database.rows(
            f"listing the runs of tenant {tenant!r}", self._sql.runs, {"tenant": tenant}
        )
        return [str(row["run_id"]) for row in rows]

    async def forget(self, tenant: str, run_id: str) -> None:
        """Remove the run's frontier and steps; its fence stays."""
        await self.database.rows(
            f"forgetting run {run_id!r}", self._sql.forget, run_params(tenant, run_id)
        )
