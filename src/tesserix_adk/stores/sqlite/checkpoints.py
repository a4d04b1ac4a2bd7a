"""SQLite checkpoints: one frontier row per run, plus step snapshots pruned to keep_last.

A frontier is stored once (schema version 5): its payload lives in its step snapshot, and
the frontier row names the step with an empty payload, unless keep_last pruned that step
(then the row keeps the payload). An empty payload whose snapshot is missing too reads as
damaged, never as an empty frontier.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from typing import Any

from tesserix_adk.errors import ConfigurationError
from tesserix_adk.stores.protocols import HistoryHandle, StoredCheckpoint
from tesserix_adk.stores.rows import decoded, typed
from tesserix_adk.stores.sqlite.database import SqliteDatabase
from tesserix_adk.stores.sqlite.fencing import FencedSqliteStore, fenced
from tesserix_adk.stores.sqlite.history import SqliteHistoryStore, append_history

__all__ = ["SqliteCheckpointStore"]

_CHECKPOINTS = "checkpoints"


def _put_frontier(
    conn: sqlite3.Connection,
    tenant: str,
    run_id: str,
    data: bytes,
    step: int,
    fence: int | None,
    keep_last: int | None,
) -> None:
    fenced(conn, _CHECKPOINTS, tenant, run_id, fence)
    conn.execute(
        "INSERT INTO adk_checkpoint_steps (tenant, run_id, step, fence, payload) "
        "VALUES (?, ?, ?, ?, ?) ON CONFLICT (tenant, run_id, step) DO UPDATE SET "
        "fence = excluded.fence, payload = excluded.payload",
        (tenant, run_id, step, fence, data),
    )
    kept = True
    if keep_last is not None:
        # Below the keep_last-th highest step; NULL (nothing pruned) while fewer.
        pruned = conn.execute(
            "DELETE FROM adk_checkpoint_steps WHERE tenant = ? AND run_id = ? "
            "AND step < (SELECT step FROM adk_checkpoint_steps "
            "WHERE tenant = ? AND run_id = ? ORDER BY step DESC LIMIT 1 OFFSET ?) "
            "RETURNING step",
            (tenant, run_id, tenant, run_id, keep_last - 1),
        ).fetchall()
        kept = (step,) not in pruned
    conn.execute(
        "INSERT INTO adk_frontiers (tenant, run_id, step, fence, payload) "
        "VALUES (?, ?, ?, ?, ?) ON CONFLICT (tenant, run_id) DO UPDATE SET "
        "step = excluded.step, fence = excluded.fence, payload = excluded.payload",
        (tenant, run_id, step, fence, b"" if kept else data),
    )


class SqliteCheckpointStore(FencedSqliteStore):
    """A ``CheckpointStore``: one frontier row per run plus step snapshots.

    ``keep_last=N`` keeps the N highest steps per run; the frontier is kept apart from the
    steps, so pruning its step never loses it.
    """

    _kind = _CHECKPOINTS

    def __init__(self, database: SqliteDatabase, *, keep_last: int | None = None) -> None:
        if keep_last is not None and keep_last < 1:
            raise ConfigurationError(f"keep_last must be at least 1, got {keep_last}")
        super().__init__(database)
        self.keep_last = keep_last

    async def put(
        self, tenant: str, run_id: str, payload: bytes, *, step: int, fence: int | None = None
    ) -> None:
        """Write a frontier; it becomes ``latest`` and step ``step`` (last write wins)."""
        data = bytes(payload)
        keep_last = self.keep_last
        await self.database.write(
            lambda conn: _put_frontier(conn, tenant, run_id, data, step, fence, keep_last),
            weight=len(data),
        )

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
        """Append the transcript and put the frontier in ONE transaction (one commit, one
        sync) when ``history`` lives in this same database; ``None`` when it does not, and
        the caller writes them one after the other."""
        if not isinstance(history, SqliteHistoryStore) or history.database is not self.database:
            return None
        data = bytes(payload)
        items = [bytes(item) for item in encoded]
        keep_last = self.keep_last

        def both(conn: sqlite3.Connection) -> HistoryHandle:
            handle = append_history(conn, tenant, run_id, items, fence, after)
            _put_frontier(conn, tenant, run_id, data, step, fence, keep_last)
            return handle

        return await self.database.write(both, weight=len(data) + sum(map(len, items)))

    async def latest(self, tenant: str, run_id: str) -> StoredCheckpoint | None:
        """The last accepted put, or ``None``."""

        def latest(conn: sqlite3.Connection) -> StoredCheckpoint | None:
            row = conn.execute(
                "SELECT CASE WHEN length(f.payload) > 0 THEN f.payload ELSE s.payload END, "
                "f.step, f.fence FROM adk_frontiers AS f LEFT JOIN adk_checkpoint_steps AS s "
                "ON s.tenant = f.tenant AND s.run_id = f.run_id AND s.step = f.step "
                "WHERE f.tenant = ? AND f.run_id = ?",
                (tenant, run_id),
            ).fetchone()
            if row is not None and row[0] is None:
                # Its snapshot is gone (deleted by hand): the frontier cannot be read, and
                # an empty one is never made up.
                row = (b"", row[1], row[2])
            return None if row is None else _stored_checkpoint(row)

        return await self.database.read(latest)

    async def at(self, tenant: str, run_id: str, step: int) -> StoredCheckpoint | None:
        """The snapshot written under ``step``, or ``None`` (never a default)."""

        def at(conn: sqlite3.Connection) -> StoredCheckpoint | None:
            row = conn.execute(
                "SELECT payload, step, fence FROM adk_checkpoint_steps "
                "WHERE tenant = ? AND run_id = ? AND step = ?",
                (tenant, run_id, step),
            ).fetchone()
            return None if row is None else _stored_checkpoint(row)

        return await self.database.read(at)

    async def steps(self, tenant: str, run_id: str) -> list[int]:
        """The steps still kept for the run, ascending."""

        @decoded("checkpoint step")
        def steps(conn: sqlite3.Connection) -> list[int]:
            rows = conn.execute(
                "SELECT step FROM adk_checkpoint_steps WHERE tenant = ? AND run_id = ? "
                "ORDER BY step",
                (tenant, run_id),
            ).fetchall()
            return [int(step) for (step,) in rows]

        return await self.database.read(steps)

    async def runs(self, tenant: str) -> list[str]:
        """The run ids with a frontier for the tenant, sorted."""

        def runs(conn: sqlite3.Connection) -> list[str]:
            rows = conn.execute(
                "SELECT run_id FROM adk_frontiers WHERE tenant = ?", (tenant,)
            ).fetchall()
            return sorted(str(run_id) for (run_id,) in rows)

        return await self.database.read(runs)

    async def forget(self, tenant: str, run_id: str) -> None:
        """Remove the run's frontier and steps; its fence stays."""

        def forget(conn: sqlite3.Connection) -> None:
            conn.execute(
                "DELETE FROM adk_frontiers WHERE tenant = ? AND run_id = ?", (tenant, run_id)
            )
            conn.execute(
                "DELETE FROM adk_checkpoint_steps WHERE tenant = ? AND run_id = ?",
                (tenant, run_id),
            )

        await self.database.write(forget)


@decoded("checkpoint")
def _stored_checkpoint(row: Sequence[Any]) -> StoredCheckpoint:
    payload, step, fence = row
    return StoredCheckpoint(
        payload=bytes(typed(payload, bytes, what="its payload")),
        step=typed(step, int, what="its step"),
        fence=typed(fence, int, type(None), what="its fence"),
    )
