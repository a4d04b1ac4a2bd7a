"""The six SQLite stores and the work index on one file, as a ``Stores`` bundle."""

from __future__ import annotations

import os
from typing import Literal

from tesserix_adk.stores.bundle import Stores
from tesserix_adk.stores.sqlite.approvals import SqliteApprovalStore
from tesserix_adk.stores.sqlite.checkpoints import SqliteCheckpointStore
from tesserix_adk.stores.sqlite.database import SqliteDatabase
from tesserix_adk.stores.sqlite.history import SqliteHistoryStore
from tesserix_adk.stores.sqlite.idempotency import SqliteIdempotencyStore
from tesserix_adk.stores.sqlite.leases import SqliteLeaseStore
from tesserix_adk.stores.sqlite.ledger import SqliteLedger
from tesserix_adk.stores.sqlite.work import SqliteWorkIndex

__all__ = ["open_sqlite_stores"]


def open_sqlite_stores(
    path: str | os.PathLike[str],
    *,
    keep_last: int | None = None,
    synchronous: Literal["full", "normal"] | str = "full",
    url: str | None = None,
) -> Stores:
    """The six SQLite stores and the work index on one file, as a ``Stores`` bundle; no
    I/O until first use.

    ``await stores.create_schema()`` creates the file and its tables; ``aclose()`` closes it.
    """
    database = SqliteDatabase(path, synchronous=synchronous)
    return Stores(
        checkpoints=SqliteCheckpointStore(database, keep_last=keep_last),
        idempotency=SqliteIdempotencyStore(database),
        leases=SqliteLeaseStore(database),
        history=SqliteHistoryStore(database),
        ledger=SqliteLedger(database),
        approvals=SqliteApprovalStore(database),
        # On the same file as the leases: due skips runs whose lease is live there.
        work=SqliteWorkIndex(database),
        url=database.url if url is None else url,
        on_create_schema=database.create_schema,
        on_verify=database.verify,
        on_close=(database.aclose,),
        schema=database.schema.ddl,
    )
