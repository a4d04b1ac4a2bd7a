"""Writes on a bare ``SqliteDatabase``, for the tests of its group commit: one ledger row
per write, and the rows the file holds (the fresh file is ``tests/stores/conftest.py``'s
``database``)."""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Callable


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


def stored_rows(path: str) -> list[str]:
    """The run ids of the ledger rows in the file at ``path``, read outside the stores."""
    with contextlib.closing(sqlite3.connect(path)) as conn:
        return [r[0] for r in conn.execute("SELECT run_id FROM adk_ledger ORDER BY run_id")]
