"""SQLite stores: every protocol of ``stores.protocols`` in one database file.

The embedded default. ``SqliteDatabase`` (``database.py``) owns the file: one connection,
used from one worker thread, every decision taken inside ``BEGIN IMMEDIATE``. The stores
(``checkpoints.py``, ``idempotency.py``, ``leases.py``, ``history.py``, ``ledger.py``,
``approvals.py``) share their fence and clock helpers (``fencing.py``); ``work.py`` is the
work index (the runs that want a worker), which reads the leases' table by the same clock.
The schema is the SQL files in ``migrations/`` (``schema.py`` reads them).
``open_sqlite_stores`` (``bundle.py``) puts the six and the work index on one file.

``SQLITE_MIGRATIONS``, ``SQLITE_SCHEMA_VERSION`` and ``SQLITE_SCHEMA`` are read from the
migration files when asked for, never at import; a database reads them once, when built
(``SqliteDatabase.schema``).
"""

from __future__ import annotations

from tesserix_adk.stores.sqlite.approvals import SqliteApprovalStore
from tesserix_adk.stores.sqlite.bundle import open_sqlite_stores
from tesserix_adk.stores.sqlite.checkpoints import SqliteCheckpointStore
from tesserix_adk.stores.sqlite.database import SqliteDatabase
from tesserix_adk.stores.sqlite.history import SqliteHistoryStore
from tesserix_adk.stores.sqlite.idempotency import SqliteIdempotencyStore
from tesserix_adk.stores.sqlite.leases import SqliteLeaseStore
from tesserix_adk.stores.sqlite.ledger import SqliteLedger
from tesserix_adk.stores.sqlite.schema import SqliteSchema
from tesserix_adk.stores.sqlite.work import SqliteWorkIndex

__all__ = [
    "SQLITE_MIGRATIONS",
    "SQLITE_SCHEMA",
    "SQLITE_SCHEMA_VERSION",
    "SqliteApprovalStore",
    "SqliteCheckpointStore",
    "SqliteDatabase",
    "SqliteHistoryStore",
    "SqliteIdempotencyStore",
    "SqliteLeaseStore",
    "SqliteLedger",
    "SqliteSchema",
    "SqliteWorkIndex",
    "open_sqlite_stores",
]

SQLITE_MIGRATIONS: tuple[str, ...]
"""``SQLITE_MIGRATIONS[i]`` takes a file from schema version ``i`` to ``i + 1`` (the file of
``migrations/`` numbered ``i + 1``); ``create_schema()`` applies the steps an older file
lacks."""

SQLITE_SCHEMA_VERSION: int
"""The schema version this kit reads and writes: the number of migrations."""

SQLITE_SCHEMA: str
"""The whole DDL of the SQLite stores, as ``create_schema()`` applies it to a new file:
written out from the migrations, idempotent."""


def __getattr__(name: str) -> object:
    # The three constants are read from the package's files on each access: reading them
    # at import would be work at import time, and keeping them would be global state.
    if name == "SQLITE_MIGRATIONS":
        return SqliteSchema.load().migrations
    if name == "SQLITE_SCHEMA_VERSION":
        return SqliteSchema.load().version
    if name == "SQLITE_SCHEMA":
        return SqliteSchema.load().ddl
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
