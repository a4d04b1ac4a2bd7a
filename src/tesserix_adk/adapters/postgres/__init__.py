"""PostgreSQL stores: every protocol of ``stores.protocols`` in one database (psycopg 3).

Open them with ``open_postgres_stores(url)`` (or ``open_stores("postgresql://…")``). The
package, one concept a module:

- ``connection.py``: ``PostgresDatabase``, the pool every store shares, its bounds, the
  translation of driver errors, and applying (``create_schema``) and checking (``verify``)
  the schema;
- ``schema.py`` and ``migrations/NNNN_<name>.sql``: the schema, one file per version;
- ``statements.py`` and ``sql/<store>/<name>.sql``: every statement the stores run, written
  out as it is sent;
- ``fenced.py``: the gate every fenced write passes, and ``seal``;
- ``checkpoints.py``, ``idempotency.py``, ``leases.py``, ``history.py``, ``ledger.py``,
  ``approvals.py``: the six stores;
- ``work.py``: the work index (``WorkIndex``), the runs that want a worker;
- ``opening.py``: ``open_postgres_stores`` and the kit's URL options.

``MIGRATIONS``, ``SCHEMA_VERSION`` and ``EXPECTED_CHECKPOINT_SCHEMA`` are read from the
package's files each time they are asked for (``Schema.load()``), not at import.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tesserix_adk.adapters.postgres.approvals import PostgresApprovalStore
from tesserix_adk.adapters.postgres.checkpoints import PostgresCheckpointStore
from tesserix_adk.adapters.postgres.connection import DEFAULT_TIMEOUT, PostgresDatabase
from tesserix_adk.adapters.postgres.history import PostgresHistoryStore
from tesserix_adk.adapters.postgres.idempotency import PostgresIdempotencyStore
from tesserix_adk.adapters.postgres.leases import PostgresLeaseStore
from tesserix_adk.adapters.postgres.ledger import PostgresLedger
from tesserix_adk.adapters.postgres.opening import open_postgres_stores
from tesserix_adk.adapters.postgres.schema import Schema
from tesserix_adk.adapters.postgres.work import PostgresWorkIndex

__all__ = [
    "EXPECTED_CHECKPOINT_SCHEMA",
    "MIGRATIONS",
    "SCHEMA_VERSION",
    "PostgresApprovalStore",
    "PostgresCheckpointStore",
    "PostgresDatabase",
    "PostgresHistoryStore",
    "PostgresIdempotencyStore",
    "PostgresLeaseStore",
    "PostgresLedger",
    "PostgresWorkIndex",
    "DEFAULT_TIMEOUT",
    "open_postgres_stores",
]

if TYPE_CHECKING:
    MIGRATIONS: tuple[str, ...]
    """``MIGRATIONS[i]`` takes the schema from version ``i`` to ``i + 1``; each is idempotent."""
    SCHEMA_VERSION: int
    """The version this kit applies and reads: the number of migrations."""
    EXPECTED_CHECKPOINT_SCHEMA: str
    """The whole DDL of the PostgreSQL stores, as ``create_schema()`` leaves the database."""


def __getattr__(name: str) -> object:
    # The schema's names are read from the package's files when asked for: no work at import.
    if name == "MIGRATIONS":
        return Schema.load().migrations
    if name == "SCHEMA_VERSION":
        return Schema.load().version
    if name == "EXPECTED_CHECKPOINT_SCHEMA":
        return Schema.load().ddl
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
