"""SQLite transcripts: one row per message with the chained digest of its prefix."""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence

from tesserix_adk.errors import HistoryUnavailableError
from tesserix_adk.stores._common import prefix_of
from tesserix_adk.stores.protocols import EMPTY_HISTORY_DIGEST, HistoryHandle, chain_digest
from tesserix_adk.stores.sqlite.fencing import FencedSqliteStore, accept_fence, check_fence

__all__ = ["SqliteHistoryStore", "append_history"]

_HISTORY = "history"


def _prefix_resolves(
    conn: sqlite3.Connection, tenant: str, run_id: str, count: int, digest: str
) -> bool:
    if count == 0:
        return digest == EMPTY_HISTORY_DIGEST
    if count < 0:
        return False
    row = conn.execute(
        "SELECT digest FROM adk_history WHERE tenant = ? AND run_id = ? AND position = ?",
        (tenant, run_id, count),
    ).fetchone()
    return row is not None and row[0] == digest


def append_history(
    conn: sqlite3.Connection,
    tenant: str,
    run_id: str,
    items: Sequence[bytes],
    fence: int | None,
    after: HistoryHandle | None,
) -> HistoryHandle:
    """Append ``items`` after the prefix ``after`` names, inside the caller's transaction."""
    recorded = check_fence(conn, _HISTORY, tenant, run_id, fence)
    count, digest = prefix_of(tenant, run_id, after)
    if not _prefix_resolves(conn, tenant, run_id, count, digest):
        raise HistoryUnavailableError(
            f"the transcript of run {run_id!r} no longer has the prefix of {count} "
            f"messages this append follows"
        )
    accept_fence(conn, _HISTORY, tenant, run_id, fence, recorded=recorded)
    # A dead writer may have appended past ``after``; that tail is dropped.
    conn.execute(
        "DELETE FROM adk_history WHERE tenant = ? AND run_id = ? AND position > ?",
        (tenant, run_id, count),
    )
    rows = []
    position, chained = count, digest
    for item in items:
        position += 1
        chained = chain_digest(chained, item)
        rows.append((tenant, run_id, position, chained, item))
    conn.executemany(
        "INSERT INTO adk_history (tenant, run_id, position, digest, item) VALUES (?, ?, ?, ?, ?)",
        rows,
    )
    return HistoryHandle(tenant=tenant, run_id=run_id, count=position, digest=chained)


class SqliteHistoryStore(FencedSqliteStore):
    """A ``HistoryStore``: one row per message with its chained digest.

    An append writes only its new messages (and drops a dead writer's tail), so its cost
    grows with the step, not with the run.
    """

    _kind = _HISTORY

    async def append(
        self,
        tenant: str,
        run_id: str,
        encoded: Sequence[bytes],
        *,
        fence: int | None = None,
        after: HistoryHandle | None,
    ) -> HistoryHandle:
        """Append after the prefix ``after`` names (``None``: the empty prefix), dropping
        any tail beyond it; ``HistoryUnavailableError`` if that prefix does not resolve."""
        items = [bytes(item) for item in encoded]

        return await self.database.write(
            lambda conn: append_history(conn, tenant, run_id, items, fence, after),
            weight=sum(map(len, items)),
        )

    async def fetch(self, handle: HistoryHandle) -> list[bytes]:
        """The bytes of the prefix; ``HistoryUnavailableError`` if it does not resolve."""

        def fetch(conn: sqlite3.Connection) -> list[bytes]:
            if handle.count == 0 and handle.digest == EMPTY_HISTORY_DIGEST:
                return []
            rows = conn.execute(
                "SELECT digest, item FROM adk_history WHERE tenant = ? AND run_id = ? "
                "AND position BETWEEN 1 AND ? ORDER BY position",
                (handle.tenant, handle.run_id, handle.count),
            ).fetchall()
            if handle.count < 1 or len(rows) != handle.count or rows[-1][0] != handle.digest:
                raise HistoryUnavailableError(
                    f"the transcript of run {handle.run_id!r} no longer has the prefix of "
                    f"{handle.count} messages the handle names"
                )
            return [bytes(item) for _, item in rows]

        return await self.database.read(fetch)

    async def forget(self, tenant: str, run_id: str) -> None:
        """Remove the run's transcript; its fence stays."""

        def forget(conn: sqlite3.Connection) -> None:
            conn.execute(
                "DELETE FROM adk_history WHERE tenant = ? AND run_id = ?", (tenant, run_id)
            )

        await self.database.write(forget)
