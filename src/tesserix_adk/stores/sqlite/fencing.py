"""What every SQLite store does inside its transaction: read SQLite's clock, and check,
accept and seal fences.

Time that decides anything is SQLite's own clock (``julianday('now')``), never the caller's.
Each kind of fenced store keeps its own highest-seen fence per run in ``adk_fences``; a
lease taken in the same file counts as seen by all of them.
"""

from __future__ import annotations

import sqlite3

from tesserix_adk.stores._common import stale_fence, unsealable
from tesserix_adk.stores.sqlite.database import SqliteDatabase
from tesserix_adk.stores.sqlite.grouping import SqliteWriteGroup

__all__ = [
    "NOW_SQL",
    "FencedSqliteStore",
    "accept_fence",
    "check_fence",
    "fenced",
    "sqlite_now",
]

# SQLite's clock in epoch seconds. Python's SQLite (3.40) has no unixepoch('subsec').
NOW_SQL = "((julianday('now') - 2440587.5) * 86400.0)"


def sqlite_now(conn: sqlite3.Connection) -> float:
    """SQLite's clock, in epoch seconds."""
    return float(conn.execute(f"SELECT {NOW_SQL}").fetchone()[0])


def _highest_fence(conn: sqlite3.Connection, store: str, tenant: str, run_id: str) -> int | None:
    row = conn.execute(
        "SELECT fence FROM adk_fences WHERE store = ? AND tenant = ? AND run_id = ?",
        (store, tenant, run_id),
    ).fetchone()
    return None if row is None else int(row[0])


def _seen_fence(conn: sqlite3.Connection, store: str, tenant: str, run_id: str) -> int | None:
    """The highest fence this store kind has seen for the run. A lease taken in this same
    file counts as seen: a takeover fences the old holder out at once, before any seal."""
    highest = _highest_fence(conn, store, tenant, run_id)
    leased = conn.execute(
        "SELECT fence FROM adk_run_leases WHERE tenant = ? AND run_id = ?", (tenant, run_id)
    ).fetchone()
    if leased is not None:
        highest = max(int(leased[0]), highest or 0)
    return highest


# Both fences a write is checked against, in one statement (a write runs it every time).
_FENCES_SQL = (
    "SELECT (SELECT fence FROM adk_fences WHERE store = ?1 AND tenant = ?2 AND run_id = ?3), "
    "(SELECT fence FROM adk_run_leases WHERE tenant = ?2 AND run_id = ?3)"
)


def check_fence(
    conn: sqlite3.Connection, store: str, tenant: str, run_id: str, fence: int | None
) -> int | None:
    """Raise ``StaleFenceError`` if a write of kind ``store`` carrying ``fence`` must be
    refused; else the fence this kind has on record for the run (for ``accept_fence``)."""
    own_raw, leased = conn.execute(_FENCES_SQL, (store, tenant, run_id)).fetchone()
    own = None if own_raw is None else int(own_raw)
    highest = own
    if leased is not None:
        highest = max(int(leased), highest or 0)
    if highest is not None and (fence is None or fence < highest):
        raise stale_fence("write", run_id, fence, highest)
    return own


def accept_fence(
    conn: sqlite3.Connection,
    store: str,
    tenant: str,
    run_id: str,
    fence: int | None,
    *,
    recorded: int | None = None,
) -> None:
    """Remember ``fence`` once a write of kind ``store`` carrying it was accepted; only
    when it rises above ``recorded`` (what ``check_fence`` returned), so the steady state of
    a run rewrites no row."""
    if fence is None or (recorded is not None and recorded >= fence):
        return
    conn.execute(
        "INSERT INTO adk_fences (store, tenant, run_id, fence) VALUES (?, ?, ?, ?) "
        "ON CONFLICT (store, tenant, run_id) "
        "DO UPDATE SET fence = excluded.fence WHERE excluded.fence > adk_fences.fence",
        (store, tenant, run_id, fence),
    )


def fenced(
    conn: sqlite3.Connection, store: str, tenant: str, run_id: str, fence: int | None
) -> None:
    """``check_fence`` then ``accept_fence``: a write of kind ``store`` carrying ``fence``
    is let through and remembered, or refused."""
    recorded = check_fence(conn, store, tenant, run_id, fence)
    accept_fence(conn, store, tenant, run_id, fence, recorded=recorded)


def _seal(conn: sqlite3.Connection, store: str, tenant: str, run_id: str, fence: int) -> None:
    highest = _seen_fence(conn, store, tenant, run_id)
    if highest is not None and highest > fence:
        raise unsealable(run_id, fence, highest)
    conn.execute(
        "INSERT INTO adk_fences (store, tenant, run_id, fence) VALUES (?, ?, ?, ?) "
        "ON CONFLICT (store, tenant, run_id) DO UPDATE SET fence = excluded.fence",
        (store, tenant, run_id, fence),
    )


class FencedSqliteStore:
    """A store kind in the shared database, with its own highest-seen fences."""

    _kind: str = ""

    def __init__(self, database: SqliteDatabase) -> None:
        self.database = database

    def write_group(self) -> SqliteWriteGroup:
        """A write group on the shared file: every store of the file joins it
        (``protocols.grouping.GroupedWrites``)."""
        return self.database.write_group()

    def joins(self, group: object) -> bool:
        """Whether this store's writes join ``group`` (one on the same file)."""
        return isinstance(group, SqliteWriteGroup) and group.database is self.database

    async def seal(self, tenant: str, run_id: str, fence: int) -> None:
        """Raise the highest-seen fence for the run without writing data."""
        await self.database.write(
            lambda conn: _seal(conn, self._kind, tenant, run_id, fence), weight=0
        )
