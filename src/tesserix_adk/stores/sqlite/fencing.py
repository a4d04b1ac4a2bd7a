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

__all__ = ["NOW_SQL", "FencedSqliteStore", "accept_fence", "check_fence", "sqlite_now"]

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


def check_fence(
    conn: sqlite3.Connection, store: str, tenant: str, run_id: str, fence: int | None
) -> None:
    """Raise ``StaleFenceError`` if a write of kind ``store`` carrying ``fence`` must be
    refused."""
    highest = _seen_fence(conn, store, tenant, run_id)
    if highest is None:
        return
    if fence is None or fence < highest:
        raise stale_fence("write", run_id, fence, highest)


def accept_fence(
    conn: sqlite3.Connection, store: str, tenant: str, run_id: str, fence: int | None
) -> None:
    """Remember ``fence`` once a write of kind ``store`` carrying it was accepted."""
    if fence is None:
        return
    conn.execute(
        "INSERT INTO adk_fences (store, tenant, run_id, fence) VALUES (?, ?, ?, ?) "
        "ON CONFLICT (store, tenant, run_id) "
        "DO UPDATE SET fence = max(adk_fences.fence, excluded.fence)",
        (store, tenant, run_id, fence),
    )


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

    async def seal(self, tenant: str, run_id: str, fence: int) -> None:
        """Raise the highest-seen fence for the run without writing data."""
        await self.database.write(lambda conn: _seal(conn, self._kind, tenant, run_id, fence))
