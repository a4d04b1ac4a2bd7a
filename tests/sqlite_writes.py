"""Writes on a bare ``SqliteDatabase``, for the tests of its group commit and write groups:
one ledger row per write (noting its thread, if asked), a write that fills the disk or
interrupts itself, the rows the file holds, and writes from event loops in threads (the
fresh file is ``tests/stores/conftest.py``'s ``database``)."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import threading
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tesserix_adk.stores.sqlite import SqliteDatabase


def put(key: str) -> Callable[[sqlite3.Connection], str]:
    """A write of one ledger row under run ``key``; it returns ``key``."""

    def fn(conn: sqlite3.Connection) -> str:
        conn.execute(
            "INSERT INTO adk_ledger (tenant, run_id, micros, input_tokens, output_tokens) "
            "VALUES ('t', ?, 1, 0, 0)",
            (key,),
        )
        return key

    return fn


def fills_the_disk(conn: sqlite3.Connection) -> None:
    """SQLITE_FULL (as on a full disk): SQLite rolls back the whole transaction."""
    (pages,) = conn.execute("PRAGMA page_count").fetchone()
    conn.execute(f"PRAGMA max_page_count = {pages}")
    try:
        conn.execute(
            "INSERT INTO adk_ledger (tenant, run_id, micros, input_tokens, output_tokens) "
            "VALUES ('t', ?, 1, 0, 0)",
            ("full" * 50_000,),
        )
    finally:
        conn.execute("PRAGMA max_page_count = 4294967294")


def interrupts_itself(conn: sqlite3.Connection) -> None:
    """An endless INSERT SQLite interrupts (SQLITE_INTERRUPT): it rolls back the whole
    transaction, as an I/O error can."""
    threading.Timer(0.05, conn.interrupt).start()
    conn.execute(
        "WITH RECURSIVE n(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM n) "
        "INSERT INTO adk_ledger (tenant, run_id, micros, input_tokens, output_tokens) "
        "SELECT 'u', 'n' || x, 1, 0, 0 FROM n"
    )


def noting_thread(key: str, seen: dict[str, str]) -> Callable[[sqlite3.Connection], str]:
    """``put(key)``, noting in ``seen`` the name of the thread it ran on."""
    write = put(key)

    def fn(conn: sqlite3.Connection) -> str:
        seen[key] = threading.current_thread().name
        return write(conn)

    return fn


def stored_rows(path: str) -> list[str]:
    """The run ids of the ledger rows in the file at ``path``, read outside the stores."""
    with contextlib.closing(sqlite3.connect(path)) as conn:
        return [r[0] for r in conn.execute("SELECT run_id FROM adk_ledger ORDER BY run_id")]


def on_loops_in_threads(
    db: SqliteDatabase,
    worker: Callable[[int], Coroutine[Any, Any, None]],
    acked: list[str],
    *,
    loops: int = 4,
    limit: float = 3.0,
) -> None:
    """``worker(w)`` on ``loops`` event loops, each in a thread of its own; then no loop
    hangs, none failed, the file holds exactly the rows ``acked`` names, and ``db`` is
    closed."""
    failures: list[BaseException] = []

    def run(w: int) -> None:
        try:
            asyncio.run(asyncio.wait_for(worker(w), 10 * limit))
        except BaseException as exc:  # reported below
            failures.append(exc)

    threads = [threading.Thread(target=run, args=(w,)) for w in range(loops)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(12 * limit)
    try:
        assert not any(t.is_alive() for t in threads), "a loop's caller hangs"
        assert not failures, failures
        assert sorted(acked) == stored_rows(db.path)
    finally:
        asyncio.run(db.aclose())
