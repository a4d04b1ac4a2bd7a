"""SQLite stores: every protocol of ``stores.protocols`` in one database file.

The embedded default. ``SqliteDatabase`` owns the file: one connection, used from one
worker thread of its own, so the event loop never waits on SQLite. Every decision (a fence,
a claim, a lease) is read, decided and written inside ``BEGIN IMMEDIATE``, which takes the
file's write lock first, so several processes on one file see each decision as atomic;
``busy_timeout`` (5 s) is how long one waits for another's write.

Time that decides anything is SQLite's own clock (``julianday('now')``), never the caller's.

Durability: ``synchronous="full"`` (the default) syncs the WAL on every commit, so a
committed claim or frontier survives a power loss, not only a process death.
``synchronous="normal"`` syncs only at WAL checkpoints: faster, and still safe when the
*process* dies, but a power loss or OS crash may lose the last commits — a claim among them,
which could let a call run twice. Choose it only where that is acceptable.

Nothing here creates a file, a directory or a table, except ``create_schema()`` (what
``tesserix schema apply`` runs). The DDL is published as ``SQLITE_SCHEMA``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import secrets
import sqlite3
import weakref
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal, TypeVar

from tesserix_adk.errors import (
    AdkError,
    CheckpointCorruptError,
    ConfigurationError,
    HistoryUnavailableError,
    LeaseHeldError,
    LeaseLostError,
    StaleFenceError,
    StoreReplyLostError,
    StoreUnavailableError,
)
from tesserix_adk.messages import ToolCall, Usage
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.stores.protocols import (
    EMPTY_HISTORY_DIGEST,
    ApprovalRequest,
    ApprovalStatus,
    HistoryHandle,
    IdempotencyRecord,
    RecordStatus,
    RunLease,
    StoredCheckpoint,
    ToolFlags,
    chain_digest,
)
from tesserix_adk.stores.records import (
    after_claim,
    after_complete,
    after_resolve,
    checked_resolution,
)
from tesserix_adk.stores.rows import decoded, stored_calls, typed

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
    "open_sqlite_stores",
]

# Version 1, exactly as it was released: kept so that a test can build a file of that
# version, and as the record of what version 2 starts from.
_V1 = """\
CREATE TABLE IF NOT EXISTS adk_schema_version (
    id      INTEGER PRIMARY KEY CHECK (id = 1),
    version INTEGER NOT NULL
);

-- The highest fence each kind of store has seen per run. Rows are never deleted: forgetting
-- a run must not let a superseded holder write again.
CREATE TABLE IF NOT EXISTS adk_fences (
    store  TEXT NOT NULL,
    tenant TEXT NOT NULL,
    run_id TEXT NOT NULL,
    fence  INTEGER NOT NULL,
    PRIMARY KEY (store, tenant, run_id)
) WITHOUT ROWID;

-- One frontier per run: the last accepted put, what resume reads.
CREATE TABLE IF NOT EXISTS adk_frontiers (
    tenant  TEXT NOT NULL,
    run_id  TEXT NOT NULL,
    step    INTEGER NOT NULL,
    fence   INTEGER,
    payload BLOB NOT NULL,
    PRIMARY KEY (tenant, run_id)
);

-- Step snapshots, for replay and inspection; pruned to keep_last per run.
CREATE TABLE IF NOT EXISTS adk_checkpoint_steps (
    tenant  TEXT NOT NULL,
    run_id  TEXT NOT NULL,
    step    INTEGER NOT NULL,
    fence   INTEGER,
    payload BLOB NOT NULL,
    PRIMARY KEY (tenant, run_id, step)
);

-- Idempotency records; times are SQLite's clock in epoch seconds.
CREATE TABLE IF NOT EXISTS adk_idempotency (
    key          TEXT PRIMARY KEY,
    status       TEXT NOT NULL,
    holder       TEXT NOT NULL,
    tenant       TEXT NOT NULL,
    run_id       TEXT NOT NULL,
    iteration    INTEGER,
    tool         TEXT,
    call_id      TEXT,
    side_effects INTEGER,
    idempotent   INTEGER,
    fence        INTEGER,
    outcome      BLOB,
    since        REAL NOT NULL,
    completed_at REAL,
    expires_at   REAL,
    resolved_by  TEXT
);
CREATE INDEX IF NOT EXISTS adk_idempotency_run ON adk_idempotency (tenant, run_id);

-- One row per run ever leased: fence counts acquisitions and never goes back; holder is
-- NULL once released.
CREATE TABLE IF NOT EXISTS adk_run_leases (
    tenant     TEXT NOT NULL,
    run_id     TEXT NOT NULL,
    fence      INTEGER NOT NULL,
    holder     TEXT,
    expires_at REAL,
    PRIMARY KEY (tenant, run_id)
);

-- Transcripts out of line: row `position` holds message position-1 and the chained digest
-- of the prefix of `position` messages.
CREATE TABLE IF NOT EXISTS adk_history (
    tenant   TEXT NOT NULL,
    run_id   TEXT NOT NULL,
    position INTEGER NOT NULL,
    digest   TEXT NOT NULL,
    item     BLOB NOT NULL,
    PRIMARY KEY (tenant, run_id, position)
);

CREATE TABLE IF NOT EXISTS adk_ledger (
    tenant        TEXT NOT NULL,
    run_id        TEXT NOT NULL,
    micros        INTEGER NOT NULL,
    input_tokens  INTEGER NOT NULL,
    output_tokens INTEGER NOT NULL,
    PRIMARY KEY (tenant, run_id)
);

CREATE TABLE IF NOT EXISTS adk_approvals (
    id           TEXT PRIMARY KEY,
    tenant       TEXT NOT NULL,
    run_id       TEXT NOT NULL,
    calls        TEXT NOT NULL,
    iteration    INTEGER NOT NULL,
    status       TEXT NOT NULL,
    decided_by   TEXT,
    note         TEXT,
    requested_at REAL NOT NULL,
    decided_at   REAL
);
"""

_V2 = """\
-- Version 2: the idempotency key and the approval id are NOT NULL. SQLite lets a PRIMARY
-- KEY that is not an INTEGER hold NULL, and a record with a NULL key can never be found
-- by its key: its call would look as if it never ran. SQLite cannot add NOT NULL to a
-- column, so both tables are rebuilt, rows and all.
CREATE TABLE adk_idempotency_v2 (
    key          TEXT NOT NULL PRIMARY KEY,
    status       TEXT NOT NULL,
    holder       TEXT NOT NULL,
    tenant       TEXT NOT NULL,
    run_id       TEXT NOT NULL,
    iteration    INTEGER,
    tool         TEXT,
    call_id      TEXT,
    side_effects INTEGER,
    idempotent   INTEGER,
    fence        INTEGER,
    outcome      BLOB,
    since        REAL NOT NULL,
    completed_at REAL,
    expires_at   REAL,
    resolved_by  TEXT
);
INSERT INTO adk_idempotency_v2 (key, status, holder, tenant, run_id, iteration, tool, call_id,
    side_effects, idempotent, fence, outcome, since, completed_at, expires_at, resolved_by)
    SELECT key, status, holder, tenant, run_id, iteration, tool, call_id, side_effects,
        idempotent, fence, outcome, since, completed_at, expires_at,
        resolved_by FROM adk_idempotency;
DROP TABLE adk_idempotency;
ALTER TABLE adk_idempotency_v2 RENAME TO adk_idempotency;
CREATE INDEX IF NOT EXISTS adk_idempotency_run ON adk_idempotency (tenant, run_id);

CREATE TABLE adk_approvals_v2 (
    id           TEXT NOT NULL PRIMARY KEY,
    tenant       TEXT NOT NULL,
    run_id       TEXT NOT NULL,
    calls        TEXT NOT NULL,
    iteration    INTEGER NOT NULL,
    status       TEXT NOT NULL,
    decided_by   TEXT,
    note         TEXT,
    requested_at REAL NOT NULL,
    decided_at   REAL
);
INSERT INTO adk_approvals_v2 (id, tenant, run_id, calls, iteration, status, decided_by, note,
    requested_at, decided_at)
    SELECT id, tenant, run_id, calls, iteration, status, decided_by, note, requested_at,
        decided_at FROM adk_approvals;
DROP TABLE adk_approvals;
ALTER TABLE adk_approvals_v2 RENAME TO adk_approvals;
"""

_V3 = """\
-- Version 3: idempotency records are keyed by (tenant, key). Two tenants may choose the same
-- key (a business key such as order-5); keyed by key alone, one tenant's claim would find,
-- complete or take over the other's record. SQLite cannot change a primary key, so the
-- table is rebuilt, rows and all.
CREATE TABLE adk_idempotency_v3 (
    key          TEXT NOT NULL,
    status       TEXT NOT NULL,
    holder       TEXT NOT NULL,
    tenant       TEXT NOT NULL,
    run_id       TEXT NOT NULL,
    iteration    INTEGER,
    tool         TEXT,
    call_id      TEXT,
    side_effects INTEGER,
    idempotent   INTEGER,
    fence        INTEGER,
    outcome      BLOB,
    since        REAL NOT NULL,
    completed_at REAL,
    expires_at   REAL,
    resolved_by  TEXT,
    PRIMARY KEY (tenant, key)
);
INSERT INTO adk_idempotency_v3 (key, status, holder, tenant, run_id, iteration, tool, call_id,
    side_effects, idempotent, fence, outcome, since, completed_at, expires_at, resolved_by)
    SELECT key, status, holder, tenant, run_id, iteration, tool, call_id, side_effects,
        idempotent, fence, outcome, since, completed_at, expires_at,
        resolved_by FROM adk_idempotency;
DROP TABLE adk_idempotency;
ALTER TABLE adk_idempotency_v3 RENAME TO adk_idempotency;
CREATE INDEX IF NOT EXISTS adk_idempotency_run ON adk_idempotency (tenant, run_id);
"""

SQLITE_MIGRATIONS: tuple[str, ...] = (_V1, _V2, _V3)
"""``SQLITE_MIGRATIONS[i]`` takes a file from schema version ``i`` to ``i + 1``. A new file
gets ``SQLITE_SCHEMA`` at once; ``create_schema()`` applies the steps an older file lacks."""

SQLITE_SCHEMA_VERSION = len(SQLITE_MIGRATIONS)

SQLITE_SCHEMA = f"""\
-- tesserix-adk SQLite schema, version {SQLITE_SCHEMA_VERSION}.
-- Applied by `tesserix schema apply` (SqliteDatabase.create_schema); idempotent.

CREATE TABLE IF NOT EXISTS adk_schema_version (
    id      INTEGER PRIMARY KEY CHECK (id = 1),
    version INTEGER NOT NULL
);

-- The highest fence each kind of store has seen per run. Rows are never deleted: forgetting
-- a run must not let a superseded holder write again.
CREATE TABLE IF NOT EXISTS adk_fences (
    store  TEXT NOT NULL,
    tenant TEXT NOT NULL,
    run_id TEXT NOT NULL,
    fence  INTEGER NOT NULL,
    PRIMARY KEY (store, tenant, run_id)
) WITHOUT ROWID;

-- One frontier per run: the last accepted put, what resume reads.
CREATE TABLE IF NOT EXISTS adk_frontiers (
    tenant  TEXT NOT NULL,
    run_id  TEXT NOT NULL,
    step    INTEGER NOT NULL,
    fence   INTEGER,
    payload BLOB NOT NULL,
    PRIMARY KEY (tenant, run_id)
);

-- Step snapshots, for replay and inspection; pruned to keep_last per run.
CREATE TABLE IF NOT EXISTS adk_checkpoint_steps (
    tenant  TEXT NOT NULL,
    run_id  TEXT NOT NULL,
    step    INTEGER NOT NULL,
    fence   INTEGER,
    payload BLOB NOT NULL,
    PRIMARY KEY (tenant, run_id, step)
);

-- Idempotency records, keyed by (tenant, key); times are SQLite's clock in epoch seconds.
CREATE TABLE IF NOT EXISTS adk_idempotency (
    key          TEXT NOT NULL,
    status       TEXT NOT NULL,
    holder       TEXT NOT NULL,
    tenant       TEXT NOT NULL,
    run_id       TEXT NOT NULL,
    iteration    INTEGER,
    tool         TEXT,
    call_id      TEXT,
    side_effects INTEGER,
    idempotent   INTEGER,
    fence        INTEGER,
    outcome      BLOB,
    since        REAL NOT NULL,
    completed_at REAL,
    expires_at   REAL,
    resolved_by  TEXT,
    PRIMARY KEY (tenant, key)
);
CREATE INDEX IF NOT EXISTS adk_idempotency_run ON adk_idempotency (tenant, run_id);

-- One row per run ever leased: fence counts acquisitions and never goes back; holder is
-- NULL once released.
CREATE TABLE IF NOT EXISTS adk_run_leases (
    tenant     TEXT NOT NULL,
    run_id     TEXT NOT NULL,
    fence      INTEGER NOT NULL,
    holder     TEXT,
    expires_at REAL,
    PRIMARY KEY (tenant, run_id)
);

-- Transcripts out of line: row `position` holds message position-1 and the chained digest
-- of the prefix of `position` messages.
CREATE TABLE IF NOT EXISTS adk_history (
    tenant   TEXT NOT NULL,
    run_id   TEXT NOT NULL,
    position INTEGER NOT NULL,
    digest   TEXT NOT NULL,
    item     BLOB NOT NULL,
    PRIMARY KEY (tenant, run_id, position)
);

CREATE TABLE IF NOT EXISTS adk_ledger (
    tenant        TEXT NOT NULL,
    run_id        TEXT NOT NULL,
    micros        INTEGER NOT NULL,
    input_tokens  INTEGER NOT NULL,
    output_tokens INTEGER NOT NULL,
    PRIMARY KEY (tenant, run_id)
);

CREATE TABLE IF NOT EXISTS adk_approvals (
    id           TEXT NOT NULL PRIMARY KEY,
    tenant       TEXT NOT NULL,
    run_id       TEXT NOT NULL,
    calls        TEXT NOT NULL,
    iteration    INTEGER NOT NULL,
    status       TEXT NOT NULL,
    decided_by   TEXT,
    note         TEXT,
    requested_at REAL NOT NULL,
    decided_at   REAL
);

INSERT INTO adk_schema_version (id, version) VALUES (1, {SQLITE_SCHEMA_VERSION})
    ON CONFLICT (id) DO NOTHING;
"""
"""The whole DDL of the SQLite stores, as ``create_schema()`` applies it."""

# SQLite's clock in epoch seconds. Python's SQLite (3.40) has no unixepoch('subsec').
_NOW_SQL = "((julianday('now') - 2440587.5) * 86400.0)"

_SYNCHRONOUS = {"full": "FULL", "normal": "NORMAL"}

# Kinds of fenced store, each with its own highest-seen fence per run.
_CHECKPOINTS = "checkpoints"
_IDEMPOTENCY = "idempotency"
_HISTORY = "history"
_LEDGER = "ledger"
_APPROVALS = "approvals"

# Keys per statement in a batched lookup, well under SQLite's limit on bound parameters.
_LOOKUP_CHUNK = 500

T = TypeVar("T")


def _schema_statements(schema: str) -> Iterator[str]:
    """Split ``schema`` into whole statements, as SQLite's tokenizer sees them."""
    buffer = ""
    for line in schema.splitlines(keepends=True):
        buffer += line
        if sqlite3.complete_statement(buffer):
            yield buffer.strip()
            buffer = ""
    leftover = "".join(
        line for line in buffer.splitlines() if line.strip() and not line.strip().startswith("--")
    )
    if leftover:
        raise ConfigurationError(f"the SQLite schema ends in an incomplete statement: {leftover}")


class _CommitInDoubt(Exception):
    """COMMIT failed after SQLite ended the transaction: committed or not, unknown."""

    def __init__(self, error: sqlite3.Error) -> None:
        super().__init__(str(error))
        self.error = error


def _sqlite_url(path: str) -> str:
    # SQLAlchemy style: three slashes, then the path (absolute paths add their own slash).
    return "sqlite:///" + path


class SqliteDatabase:
    """One SQLite file shared by the six stores: its connection, thread and schema.

    Nothing touches the file until the first store call; that call opens it read-write
    (never creating it) and checks the schema version, so a missing file or schema is a
    ``ConfigurationError`` naming ``tesserix schema apply``. ``create_schema()`` is the one
    call that creates the file (and its directory). Close with ``aclose()``.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        synchronous: Literal["full", "normal"] | str = "full",
        busy_timeout: float = 5.0,
    ) -> None:
        mode = str(synchronous).lower()
        if mode not in _SYNCHRONOUS:
            raise ConfigurationError(f"synchronous must be 'full' or 'normal', got {synchronous!r}")
        if not busy_timeout >= 0:
            raise ConfigurationError(f"busy_timeout must be >= 0 seconds, got {busy_timeout!r}")
        # Resolved now, so a relative path means the directory the stores were opened in.
        self.path = os.path.abspath(os.fspath(path))
        self.synchronous = mode
        self.busy_timeout = float(busy_timeout)
        self._executor: ThreadPoolExecutor | None = None
        # Only ever touched from the executor's one thread.
        self._conn: sqlite3.Connection | None = None
        self._closed = False

    def __repr__(self) -> str:
        return f"SqliteDatabase({self.path!r}, synchronous={self.synchronous!r})"

    @property
    def url(self) -> str:
        """The ``open_stores`` URL of this file."""
        return _sqlite_url(self.path)

    # --- running SQL ---------------------------------------------------------------------

    async def write(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """Run ``fn(connection)`` in ``BEGIN IMMEDIATE``, in the worker thread; commit
        if it returns, roll back if it raises."""
        return await self._submit(functools.partial(self._transaction, fn, "BEGIN IMMEDIATE"))

    async def read(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """Run ``fn(connection)`` in a read transaction (one snapshot), in the worker thread."""
        return await self._submit(functools.partial(self._transaction, fn, "BEGIN"))

    async def create_schema(self) -> None:
        """Create the file, its directory and the tables (idempotent); set WAL mode.

        Refuses (``ConfigurationError``) a file whose schema is newer than this kit's.
        """
        await self._submit(self._create_schema)

    async def verify(self) -> None:
        """Check the file exists with this kit's schema version (``ConfigurationError``)."""
        await self._submit(lambda: self._check_schema(self._connection()))

    async def aclose(self) -> None:
        """Close the connection and stop the worker thread; idempotent."""
        if self._closed:
            return
        self._closed = True
        executor = self._executor
        if executor is None:
            return
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(executor, self._close_connection)
        finally:
            executor.shutdown(wait=False)

    async def _submit(self, call: Callable[[], T]) -> T:
        if self._closed:
            raise ConfigurationError(f"the SQLite store {self.path} was closed")
        if self._executor is None:
            executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tesserix-sqlite")
            # A database dropped without aclose() still lets its thread go.
            weakref.finalize(self, executor.shutdown, wait=False)
            self._executor = executor
        loop = asyncio.get_running_loop()
        # A cancelled caller stops waiting: its call either never starts or runs to its
        # commit or rollback in the thread, so the connection is never left inside one.
        return await loop.run_in_executor(self._executor, self._translating, call)

    def _translating(self, call: Callable[[], T]) -> T:
        try:
            return call()
        except _CommitInDoubt as doubt:
            raise StoreReplyLostError(
                f"the SQLite store {self.path} failed while committing, after SQLite began "
                f"writing the transaction out; it may have been committed: {doubt.error}"
            ) from doubt.error
        except sqlite3.Error as exc:
            raise self._translate(exc) from exc

    def _transaction(self, fn: Callable[[sqlite3.Connection], T], begin: str) -> T:
        conn = self._connection()
        try:
            conn.execute(begin)
            result = fn(conn)
            try:
                conn.execute("COMMIT")
            except sqlite3.Error as exc:
                # Still in the transaction (SQLITE_BUSY, a deferred constraint): nothing was
                # committed, and the rollback below makes sure. Otherwise SQLite ended it
                # while writing it out (an I/O error, a full disk), and from here it cannot
                # be told whether the commit record reached the file.
                if conn.in_transaction:
                    raise
                raise _CommitInDoubt(exc) from exc
            return result
        finally:
            if conn.in_transaction:
                with contextlib.suppress(sqlite3.Error):
                    conn.execute("ROLLBACK")

    def _open(self, mode: str) -> sqlite3.Connection:
        uri = Path(self.path).as_uri() + f"?mode={mode}"
        conn = sqlite3.connect(
            uri, uri=True, timeout=self.busy_timeout, isolation_level=None, cached_statements=256
        )
        try:
            # PRAGMAs take no bound parameters; both values come from closed sets.
            conn.execute(f"PRAGMA busy_timeout = {int(self.busy_timeout * 1000)}")
            conn.execute(f"PRAGMA synchronous = {_SYNCHRONOUS[self.synchronous]}")
        except BaseException:
            conn.close()
            raise
        return conn

    def _connection(self) -> sqlite3.Connection:
        if self._conn is None:
            # mode=rw: a missing file is an error, never an empty new database.
            try:
                self._conn = self._checked("rw")
            except sqlite3.OperationalError as exc:
                if getattr(exc, "sqlite_errorcode", -1) & 0xFF != sqlite3.SQLITE_READONLY:
                    raise
                # A directory this process may not write (WAL needs its -shm file there):
                # open read-only, so the store can still be inspected; writes are refused.
                self._conn = self._checked(self._read_only_mode())
        return self._conn

    def _checked(self, mode: str) -> sqlite3.Connection:
        """A connection opened in ``mode`` whose schema is the one this kit needs."""
        conn = self._open(mode)
        try:
            self._check_schema(conn)
        except BaseException:
            conn.close()
            raise
        return conn

    def _read_only_mode(self) -> str:
        # immutable=1 reads without the -shm file, which is only right while no write-ahead
        # log holds transactions the main file does not have yet.
        wal = Path(f"{self.path}-wal")
        if wal.exists() and wal.stat().st_size > 0:
            return "ro"
        return "ro&immutable=1"

    def _close_connection(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _check_schema(self, conn: sqlite3.Connection) -> None:
        try:
            row = conn.execute("SELECT version FROM adk_schema_version WHERE id = 1").fetchone()
        except sqlite3.OperationalError as exc:
            if "no such table" not in str(exc):
                raise
            row = None
        if row is None:
            raise self._missing()
        if row[0] != SQLITE_SCHEMA_VERSION:
            raise self._wrong_version(row[0])

    def _create_schema(self) -> None:
        directory = os.path.dirname(self.path)
        try:
            os.makedirs(directory, exist_ok=True)
        except OSError as exc:
            raise ConfigurationError(
                f"cannot create the directory of the SQLite store {self.path}: {exc}"
            ) from exc
        conn = self._open("rwc")
        try:
            # WAL is a property of the file; it cannot change inside a transaction.
            (mode,) = conn.execute("PRAGMA journal_mode = WAL").fetchone()
            if str(mode).lower() != "wal":
                raise ConfigurationError(
                    f"the SQLite store {self.path} cannot use WAL mode (it stays {mode!r}); "
                    f"put it on a local file system"
                )
            conn.execute("BEGIN IMMEDIATE")
            try:
                exists = conn.execute(
                    "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?",
                    ("adk_schema_version",),
                ).fetchone()
                version = SQLITE_SCHEMA_VERSION
                if exists is not None:
                    row = conn.execute(
                        "SELECT version FROM adk_schema_version WHERE id = 1"
                    ).fetchone()
                    if row is not None:
                        version = row[0]
                if not isinstance(version, int) or not 1 <= version <= SQLITE_SCHEMA_VERSION:
                    raise self._wrong_version(version)
                if version < 2:
                    self._refuse_null_keys(conn)
                for migration in SQLITE_MIGRATIONS[version:]:
                    for statement in _schema_statements(migration):
                        conn.execute(statement)
                # Idempotent: on a file at this version it puts back a table dropped by hand.
                for statement in _schema_statements(SQLITE_SCHEMA):
                    conn.execute(statement)
                conn.execute(
                    "UPDATE adk_schema_version SET version = ? WHERE id = 1",
                    (SQLITE_SCHEMA_VERSION,),
                )
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise
        finally:
            conn.close()

    def _refuse_null_keys(self, conn: sqlite3.Connection) -> None:
        # Version 2 makes these NOT NULL. Such a row can never be found by its key, so it
        # is not silently dropped: an operator decides what it was.
        (records,) = conn.execute(
            "SELECT count(*) FROM adk_idempotency WHERE key IS NULL"
        ).fetchone()
        (approvals,) = conn.execute(
            "SELECT count(*) FROM adk_approvals WHERE id IS NULL"
        ).fetchone()
        if records or approvals:
            raise ConfigurationError(
                f"the SQLite store {self.path} holds {records} idempotency record(s) with no "
                f"key and {approvals} approval(s) with no id; version {SQLITE_SCHEMA_VERSION} "
                f"of the schema refuses them. Inspect and delete them (e.g. DELETE FROM "
                f"adk_idempotency WHERE key IS NULL), then run `tesserix schema apply` again"
            )

    def _missing(self) -> ConfigurationError:
        return ConfigurationError(
            f"the SQLite store {self.path} has no tesserix schema (or does not exist); "
            f"create it with `tesserix schema apply --store {self.url}`"
        )

    def _wrong_version(self, found: object) -> ConfigurationError:
        # Version 1 is the first: anything lower was not written by a release of the kit.
        if isinstance(found, int) and found > SQLITE_SCHEMA_VERSION:
            hint = "upgrade tesserix-adk to use it"
        elif isinstance(found, int) and found >= 1:
            hint = f"migrate it, keeping its data, with `tesserix schema apply --store {self.url}`"
        else:
            hint = "it was not created by `tesserix schema apply`"
        return ConfigurationError(
            f"the SQLite store {self.path} has schema version {found!r}, this kit needs "
            f"{SQLITE_SCHEMA_VERSION}; {hint}"
        )

    def _translate(self, exc: sqlite3.Error) -> AdkError:
        code = getattr(exc, "sqlite_errorcode", -1) & 0xFF
        if code in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED):
            return StoreUnavailableError(
                f"the SQLite store {self.path} is locked by another writer "
                f"(waited up to {self.busy_timeout:g} s): {exc}"
            )
        if code == sqlite3.SQLITE_CANTOPEN:
            return ConfigurationError(
                f"the SQLite store {self.path} does not exist or cannot be opened; "
                f"create it with `tesserix schema apply --store {self.url}`"
            )
        if code == sqlite3.SQLITE_NOTADB:
            return ConfigurationError(f"{self.path} is not a SQLite database: {exc}")
        if code == sqlite3.SQLITE_CORRUPT:
            return CheckpointCorruptError(
                f"the SQLite store {self.path} is damaged ({exc}); restore it from a backup"
            )
        if code == sqlite3.SQLITE_READONLY:
            return ConfigurationError(
                f"the SQLite store {self.path} is read-only for this process ({exc}); it can "
                "be inspected, not written"
            )
        if isinstance(exc, sqlite3.OperationalError) and "no such table" in str(exc):
            return self._missing()
        return StoreUnavailableError(f"the SQLite store {self.path} failed: {exc}")


# --- helpers shared by the stores (run inside a transaction, in the worker thread) -------


def _now(conn: sqlite3.Connection) -> float:
    return float(conn.execute(f"SELECT {_NOW_SQL}").fetchone()[0])


def _positive_ttl(ttl: float) -> float:
    if not ttl > 0:
        raise ValueError(f"ttl must be a positive number of seconds, got {ttl!r}")
    return float(ttl)


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


def _check_fence(
    conn: sqlite3.Connection, store: str, tenant: str, run_id: str, fence: int | None
) -> None:
    highest = _seen_fence(conn, store, tenant, run_id)
    if highest is None:
        return
    if fence is None:
        raise StaleFenceError(
            f"unfenced write refused for run {run_id!r}: fence {highest} was seen"
        )
    if fence < highest:
        raise StaleFenceError(
            f"fence {fence} is stale for run {run_id!r}: fence {highest} was seen"
        )


def _accept_fence(
    conn: sqlite3.Connection, store: str, tenant: str, run_id: str, fence: int | None
) -> None:
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
        raise StaleFenceError(
            f"cannot seal run {run_id!r} at fence {fence}: fence {highest} was seen"
        )
    conn.execute(
        "INSERT INTO adk_fences (store, tenant, run_id, fence) VALUES (?, ?, ?, ?) "
        "ON CONFLICT (store, tenant, run_id) DO UPDATE SET fence = excluded.fence",
        (store, tenant, run_id, fence),
    )


class _FencedSqliteStore:
    """A store kind in the shared database, with its own highest-seen fences."""

    _kind: str = ""

    def __init__(self, database: SqliteDatabase) -> None:
        self.database = database

    async def seal(self, tenant: str, run_id: str, fence: int) -> None:
        """Raise the highest-seen fence for the run without writing data."""
        await self.database.write(lambda conn: _seal(conn, self._kind, tenant, run_id, fence))


# --- checkpoints -------------------------------------------------------------------------


def _put_frontier(
    conn: sqlite3.Connection,
    tenant: str,
    run_id: str,
    data: bytes,
    step: int,
    fence: int | None,
    keep_last: int | None,
) -> None:
    _check_fence(conn, _CHECKPOINTS, tenant, run_id, fence)
    _accept_fence(conn, _CHECKPOINTS, tenant, run_id, fence)
    row = (tenant, run_id, step, fence, data)
    conn.execute(
        "INSERT INTO adk_frontiers (tenant, run_id, step, fence, payload) "
        "VALUES (?, ?, ?, ?, ?) ON CONFLICT (tenant, run_id) DO UPDATE SET "
        "step = excluded.step, fence = excluded.fence, payload = excluded.payload",
        row,
    )
    conn.execute(
        "INSERT INTO adk_checkpoint_steps (tenant, run_id, step, fence, payload) "
        "VALUES (?, ?, ?, ?, ?) ON CONFLICT (tenant, run_id, step) DO UPDATE SET "
        "fence = excluded.fence, payload = excluded.payload",
        row,
    )
    if keep_last is not None:
        # Below the keep_last-th highest step; NULL (nothing pruned) while fewer.
        conn.execute(
            "DELETE FROM adk_checkpoint_steps WHERE tenant = ? AND run_id = ? "
            "AND step < (SELECT step FROM adk_checkpoint_steps "
            "WHERE tenant = ? AND run_id = ? ORDER BY step DESC LIMIT 1 OFFSET ?)",
            (tenant, run_id, tenant, run_id, keep_last - 1),
        )


class SqliteCheckpointStore(_FencedSqliteStore):
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
            lambda conn: _put_frontier(conn, tenant, run_id, data, step, fence, keep_last)
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
            handle = _append_history(conn, tenant, run_id, items, fence, after)
            _put_frontier(conn, tenant, run_id, data, step, fence, keep_last)
            return handle

        return await self.database.write(both)

    async def latest(self, tenant: str, run_id: str) -> StoredCheckpoint | None:
        """The last accepted put, or ``None``."""

        def latest(conn: sqlite3.Connection) -> StoredCheckpoint | None:
            row = conn.execute(
                "SELECT payload, step, fence FROM adk_frontiers WHERE tenant = ? AND run_id = ?",
                (tenant, run_id),
            ).fetchone()
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


def _stored_checkpoint(row: Sequence[Any]) -> StoredCheckpoint:
    payload, step, fence = row
    return StoredCheckpoint(
        payload=bytes(payload), step=int(step), fence=None if fence is None else int(fence)
    )


# --- idempotency -------------------------------------------------------------------------

_RECORD_COLUMNS = (
    "key, status, holder, tenant, run_id, iteration, tool, call_id, side_effects, "
    "idempotent, fence, outcome, since, completed_at, expires_at, resolved_by"
)
# A ttl claim past its expiry is absent everywhere.
_LIVE_SQL = f"NOT (status = 'in_flight' AND expires_at IS NOT NULL AND expires_at <= {_NOW_SQL})"


@decoded("idempotency record")
def _record_from_row(row: Sequence[Any]) -> IdempotencyRecord:
    (
        key,
        status,
        holder,
        tenant,
        run_id,
        iteration,
        tool,
        call_id,
        side_effects,
        idempotent,
        fence,
        outcome,
        since,
        completed_at,
        expires_at,
        by,
    ) = row
    flags = (
        None
        if side_effects is None
        else ToolFlags(side_effects=bool(side_effects), idempotent=bool(idempotent))
    )
    # SQLite keeps any type in any column: a value of the wrong type is damage.
    none, number = type(None), (int, float)
    return IdempotencyRecord(
        key=typed(key, str, what="key"),
        status=RecordStatus(status),
        holder=typed(holder, str, what="holder"),
        tenant=typed(tenant, str, what="tenant"),
        run_id=typed(run_id, str, what="run_id"),
        iteration=typed(iteration, int, none, what="iteration"),
        tool=typed(tool, str, none, what="tool"),
        call_id=typed(call_id, str, none, what="call_id"),
        flags=flags,
        fence=typed(fence, int, none, what="fence"),
        outcome=None if outcome is None else bytes(outcome),
        since=float(typed(since, *number, what="since")),
        completed_at=typed(completed_at, *number, none, what="completed_at"),
        expires_at=typed(expires_at, *number, none, what="expires_at"),
        by=typed(by, str, none, what="by"),
    )


def _record_to_row(record: IdempotencyRecord) -> tuple[Any, ...]:
    flags = record.flags
    return (
        record.key,
        record.status.value,
        record.holder,
        record.tenant,
        record.run_id,
        record.iteration,
        record.tool,
        record.call_id,
        None if flags is None else int(flags.side_effects),
        None if flags is None else int(flags.idempotent),
        record.fence,
        record.outcome,
        record.since,
        record.completed_at,
        record.expires_at,
        record.by,
    )


def _save_record(conn: sqlite3.Connection, record: IdempotencyRecord) -> None:
    conn.execute(
        f"INSERT OR REPLACE INTO adk_idempotency ({_RECORD_COLUMNS}) "
        "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        _record_to_row(record),
    )


def _live_record(
    conn: sqlite3.Connection, tenant: str, key: str, now: float
) -> IdempotencyRecord | None:
    """The tenant's record of ``key`` as of ``now``; a lapsed ttl claim is dropped (in a
    write)."""
    row = conn.execute(
        f"SELECT {_RECORD_COLUMNS} FROM adk_idempotency WHERE tenant = ? AND key = ?",
        (tenant, key),
    ).fetchone()
    if row is None:
        return None
    record = _record_from_row(row)
    if (
        record.status is RecordStatus.in_flight
        and record.expires_at is not None
        and now >= record.expires_at
    ):
        conn.execute("DELETE FROM adk_idempotency WHERE tenant = ? AND key = ?", (tenant, key))
        return None
    return record


class SqliteIdempotencyStore(_FencedSqliteStore):
    """An ``IdempotencyStore``; ttl claims lapse by SQLite's clock."""

    _kind = _IDEMPOTENCY

    async def claim(
        self,
        key: str,
        *,
        holder: str,
        tenant: str,
        run_id: str,
        iteration: int | None,
        tool: str | None,
        call_id: str | None,
        flags: ToolFlags | None,
        fence: int | None = None,
        ttl: float | None = None,
        takeover: bool = False,
    ) -> IdempotencyRecord:
        """Claim the tenant's ``key`` and return the record as it stands after the call."""
        if tool is None:
            # A resume claim is taken before any lease exists: never fenced.
            fence = None

        def claim(conn: sqlite3.Connection) -> IdempotencyRecord:
            if tool is not None:
                _check_fence(conn, _IDEMPOTENCY, tenant, run_id, fence)
            now = _now(conn)
            record, changed = after_claim(
                _live_record(conn, tenant, key, now),
                key=key,
                holder=holder,
                tenant=tenant,
                run_id=run_id,
                iteration=iteration,
                tool=tool,
                call_id=call_id,
                flags=flags,
                fence=fence,
                now=now,
                expires_at=None if ttl is None else now + _positive_ttl(ttl),
                takeover=takeover,
            )
            if tool is not None:
                _accept_fence(conn, _IDEMPOTENCY, tenant, run_id, fence)
            if changed:
                _save_record(conn, record)
            return record

        return await self.database.write(claim)

    async def complete(
        self, key: str, outcome: bytes, *, tenant: str, holder: str
    ) -> IdempotencyRecord:
        """Record the outcome of a claim held by ``holder`` (not fenced)."""
        data = bytes(outcome)

        def complete(conn: sqlite3.Connection) -> IdempotencyRecord:
            now = _now(conn)
            record, changed = after_complete(
                _live_record(conn, tenant, key, now),
                key=key,
                outcome=data,
                holder=holder,
                now=now,
            )
            if changed:
                _save_record(conn, record)
            return record

        return await self.database.write(complete)

    async def release(
        self, key: str, *, tenant: str, holder: str, undispatched: bool = False
    ) -> None:
        """Drop a ttl claim held by ``holder``; anything else is left alone."""

        def release(conn: sqlite3.Connection) -> None:
            conn.execute(
                "DELETE FROM adk_idempotency WHERE tenant = ? AND key = ? "
                "AND status = 'in_flight' AND holder = ? "
                "AND (expires_at IS NOT NULL OR (? AND tool IS NOT NULL))",
                (tenant, key, holder, int(undispatched)),
            )

        await self.database.write(release)

    async def lookup(self, keys: Sequence[str], *, tenant: str) -> dict[str, IdempotencyRecord]:
        """The tenant's live records of ``keys`` in one round trip; absent keys are left
        out."""
        wanted = list(dict.fromkeys(keys))
        if not wanted:
            return {}

        def lookup(conn: sqlite3.Connection) -> dict[str, IdempotencyRecord]:
            found: dict[str, IdempotencyRecord] = {}
            for start in range(0, len(wanted), _LOOKUP_CHUNK):
                chunk = wanted[start : start + _LOOKUP_CHUNK]
                marks = ", ".join("?" * len(chunk))
                for row in conn.execute(
                    f"SELECT {_RECORD_COLUMNS} FROM adk_idempotency "
                    f"WHERE tenant = ? AND key IN ({marks}) AND {_LIVE_SQL}",
                    [tenant, *chunk],
                ):
                    record = _record_from_row(row)
                    found[record.key] = record
            return {key: found[key] for key in wanted if key in found}

        return await self.database.read(lookup)

    async def records(self, tenant: str, run_id: str) -> list[IdempotencyRecord]:
        """Every live record of the run, by (iteration, since, key); the run claim first."""

        def records(conn: sqlite3.Connection) -> list[IdempotencyRecord]:
            rows = conn.execute(
                f"SELECT {_RECORD_COLUMNS} FROM adk_idempotency "
                f"WHERE tenant = ? AND run_id = ? AND {_LIVE_SQL}",
                (tenant, run_id),
            ).fetchall()
            return [_record_from_row(row) for row in rows]

        mine = await self.database.read(records)
        return sorted(
            mine, key=lambda r: (-1 if r.iteration is None else r.iteration, r.since, r.key)
        )

    async def resolve(
        self,
        key: str,
        outcome: bytes | None = None,
        *,
        tenant: str,
        never_ran: bool = False,
        by: str,
    ) -> IdempotencyRecord:
        """An operator settles the tenant's in-flight call: its outcome, or that it never
        ran."""
        checked_resolution(outcome, never_ran)
        data = None if outcome is None else bytes(outcome)

        def resolve(conn: sqlite3.Connection) -> IdempotencyRecord:
            now = _now(conn)
            record = after_resolve(
                _live_record(conn, tenant, key, now),
                key=key,
                outcome=data,
                never_ran=never_ran,
                by=by,
                now=now,
            )
            _save_record(conn, record)
            return record

        return await self.database.write(resolve)


# --- leases ------------------------------------------------------------------------------


class SqliteLeaseStore:
    """A ``LeaseStore``; expiry decided by SQLite's clock only.

    Each run keeps one row whose fence counts acquisitions; release frees the run but keeps
    the row, so a fence is never handed out twice.

    The clock's limit: SQLite's ``julianday('now')`` is the wall clock of whichever process
    runs the statement. A process whose clock is off, or a host whose clock is stepped, moves
    every lease's expiry as seen by that process: a clock stepped forward by S seconds can
    take a live lease up to S seconds early; one stepped back blocks a lapsed run for up to
    S seconds. Fences still prevent a duplicate: the earlier holder's next write or claim is
    refused, and its own monotonic deadline (``Leaseholder``) stops it at its ttl whatever
    the wall clock says. Keep the host's clock slewed (NTP), not stepped, if that matters.
    """

    def __init__(self, database: SqliteDatabase) -> None:
        self.database = database

    async def acquire(self, tenant: str, run_id: str, holder: str, ttl: float) -> RunLease:
        """Take the run (raising its fence) or raise ``LeaseHeldError`` naming the holder."""
        ttl = _positive_ttl(ttl)

        def acquire(conn: sqlite3.Connection) -> RunLease:
            now = _now(conn)
            row = conn.execute(
                "SELECT fence, holder, expires_at FROM adk_run_leases "
                "WHERE tenant = ? AND run_id = ?",
                (tenant, run_id),
            ).fetchone()
            if row is not None and row[1] is not None and now < row[2]:
                raise LeaseHeldError(f"run {run_id!r} is leased to {row[1]!r}", holder=row[1])
            lease = RunLease(
                tenant=tenant,
                run_id=run_id,
                holder=holder,
                fence=(0 if row is None else int(row[0])) + 1,
                expires_at=now + ttl,
                previous_end=None if row is None or row[2] is None else float(row[2]),
            )
            conn.execute(
                "INSERT INTO adk_run_leases (tenant, run_id, fence, holder, expires_at) "
                "VALUES (?, ?, ?, ?, ?) ON CONFLICT (tenant, run_id) DO UPDATE SET "
                "fence = excluded.fence, holder = excluded.holder, "
                "expires_at = excluded.expires_at",
                (tenant, run_id, lease.fence, holder, lease.expires_at),
            )
            return lease

        return await self.database.write(acquire)

    async def renew(self, lease: RunLease, ttl: float) -> RunLease:
        """Extend a live lease, keeping its fence, or raise ``LeaseLostError``."""
        ttl = _positive_ttl(ttl)

        def renew(conn: sqlite3.Connection) -> RunLease:
            now = _now(conn)
            row = conn.execute(
                "SELECT fence, holder, expires_at FROM adk_run_leases "
                "WHERE tenant = ? AND run_id = ?",
                (lease.tenant, lease.run_id),
            ).fetchone()
            if (
                row is None
                or row[1] is None
                or row[0] != lease.fence
                or row[1] != lease.holder
                or now >= row[2]
            ):
                raise LeaseLostError(
                    f"lease on run {lease.run_id!r} at fence {lease.fence} lapsed or was taken"
                )
            renewed = replace(lease, expires_at=now + ttl)
            conn.execute(
                "UPDATE adk_run_leases SET expires_at = ? WHERE tenant = ? AND run_id = ?",
                (renewed.expires_at, lease.tenant, lease.run_id),
            )
            return renewed

        return await self.database.write(renew)

    async def release(self, lease: RunLease) -> None:
        """Free the run, only for the holder at that fence; the fence stays."""

        def release(conn: sqlite3.Connection) -> None:
            # expires_at keeps when the lease ended, which the next acquisition reports.
            now = _now(conn)
            conn.execute(
                "UPDATE adk_run_leases SET holder = NULL, "
                "expires_at = CASE WHEN expires_at IS NULL OR expires_at > ? THEN ? "
                "ELSE expires_at END "
                "WHERE tenant = ? AND run_id = ? AND fence = ? AND holder = ?",
                (now, now, lease.tenant, lease.run_id, lease.fence, lease.holder),
            )

        await self.database.write(release)

    async def current(self, tenant: str, run_id: str) -> RunLease | None:
        """The lease live by the store's clock, else ``None``."""

        def current(conn: sqlite3.Connection) -> RunLease | None:
            row = conn.execute(
                "SELECT fence, holder, expires_at FROM adk_run_leases "
                f"WHERE tenant = ? AND run_id = ? AND holder IS NOT NULL "
                f"AND expires_at > {_NOW_SQL}",
                (tenant, run_id),
            ).fetchone()
            if row is None:
                return None
            return RunLease(
                tenant=tenant,
                run_id=run_id,
                holder=row[1],
                fence=int(row[0]),
                expires_at=float(row[2]),
            )

        return await self.database.read(current)

    async def ended_ago(self, tenant: str, run_id: str) -> float | None:
        """Seconds since the run's last lease ended; ``None`` if one is live or none ended."""

        def ended_ago(conn: sqlite3.Connection) -> float | None:
            now = _now(conn)
            row = conn.execute(
                "SELECT expires_at FROM adk_run_leases WHERE tenant = ? AND run_id = ? "
                "AND expires_at IS NOT NULL AND (holder IS NULL OR expires_at <= ?)",
                (tenant, run_id, now),
            ).fetchone()
            return None if row is None else max(0.0, now - float(row[0]))

        return await self.database.read(ended_ago)


# --- transcripts -------------------------------------------------------------------------


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


def _append_history(
    conn: sqlite3.Connection,
    tenant: str,
    run_id: str,
    items: Sequence[bytes],
    fence: int | None,
    after: HistoryHandle | None,
) -> HistoryHandle:
    count, digest = (0, EMPTY_HISTORY_DIGEST) if after is None else (after.count, after.digest)
    _check_fence(conn, _HISTORY, tenant, run_id, fence)
    if after is not None and (after.tenant, after.run_id) != (tenant, run_id):
        raise ValueError(
            f"handle names run {after.run_id!r} of {after.tenant!r}, "
            f"not run {run_id!r} of {tenant!r}"
        )
    if not _prefix_resolves(conn, tenant, run_id, count, digest):
        raise HistoryUnavailableError(
            f"the transcript of run {run_id!r} no longer has the prefix of {count} "
            f"messages this append follows"
        )
    _accept_fence(conn, _HISTORY, tenant, run_id, fence)
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


class SqliteHistoryStore(_FencedSqliteStore):
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
            lambda conn: _append_history(conn, tenant, run_id, items, fence, after)
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


# --- spend -------------------------------------------------------------------------------


class SqliteLedger(_FencedSqliteStore):
    """A ``Ledger``: micros and tokens per run."""

    _kind = _LEDGER

    async def charge(
        self, tenant: str, run_id: str, micros: int, usage: Usage, *, fence: int | None = None
    ) -> None:
        """Add a model call's cost and usage to the run."""

        def charge(conn: sqlite3.Connection) -> None:
            _check_fence(conn, _LEDGER, tenant, run_id, fence)
            _accept_fence(conn, _LEDGER, tenant, run_id, fence)
            conn.execute(
                "INSERT INTO adk_ledger (tenant, run_id, micros, input_tokens, output_tokens) "
                "VALUES (?, ?, ?, ?, ?) ON CONFLICT (tenant, run_id) DO UPDATE SET "
                "micros = adk_ledger.micros + excluded.micros, "
                "input_tokens = adk_ledger.input_tokens + excluded.input_tokens, "
                "output_tokens = adk_ledger.output_tokens + excluded.output_tokens",
                (tenant, run_id, int(micros), usage.input_tokens, usage.output_tokens),
            )

        await self.database.write(charge)

    async def spent(self, tenant: str, run_id: str) -> int:
        """Micros charged to the run so far (0 for an unknown run)."""

        def spent(conn: sqlite3.Connection) -> int:
            row = conn.execute(
                "SELECT micros FROM adk_ledger WHERE tenant = ? AND run_id = ?", (tenant, run_id)
            ).fetchone()
            return 0 if row is None else int(row[0])

        return await self.database.read(spent)

    async def usage(self, tenant: str, run_id: str) -> Usage:
        """Tokens charged to the run so far."""

        def usage(conn: sqlite3.Connection) -> Usage:
            row = conn.execute(
                "SELECT input_tokens, output_tokens FROM adk_ledger "
                "WHERE tenant = ? AND run_id = ?",
                (tenant, run_id),
            ).fetchone()
            if row is None:
                return Usage()
            return Usage(input_tokens=int(row[0]), output_tokens=int(row[1]))

        return await self.database.read(usage)


# --- approvals ---------------------------------------------------------------------------

_APPROVAL_COLUMNS = (
    "id, tenant, run_id, calls, iteration, status, decided_by, note, requested_at, decided_at"
)


def _calls_to_json(calls: Sequence[ToolCall]) -> str:
    return json.dumps(
        [{"id": c.id, "name": c.name, "arguments": dict(c.arguments)} for c in calls],
        separators=(",", ":"),
        ensure_ascii=False,
    )


@decoded("approval request")
def _approval_from_row(row: Sequence[Any]) -> ApprovalRequest:
    id, tenant, run_id, calls, iteration, status, by, note, requested_at, decided_at = row
    return ApprovalRequest(
        id=id,
        tenant=tenant,
        run_id=run_id,
        calls=stored_calls(json.loads(calls)),
        iteration=int(iteration),
        status=ApprovalStatus(status),
        by=by,
        note=note,
        requested_at=float(requested_at),
        decided_at=decided_at,
    )


def _get_approval(conn: sqlite3.Connection, id: str) -> ApprovalRequest | None:
    row = conn.execute(
        f"SELECT {_APPROVAL_COLUMNS} FROM adk_approvals WHERE id = ?", (id,)
    ).fetchone()
    return None if row is None else _approval_from_row(row)


class SqliteApprovalStore(_FencedSqliteStore):
    """An ``ApprovalStore``; times by SQLite's clock."""

    _kind = _APPROVALS

    async def request(
        self,
        tenant: str,
        run_id: str,
        calls: Sequence[ToolCall],
        *,
        iteration: int,
        fence: int | None = None,
        id: str | None = None,
    ) -> ApprovalRequest:
        """Record a pending request (made once under a chosen ``id``)."""
        encoded = _calls_to_json(calls)
        chosen = id

        def request(conn: sqlite3.Connection) -> ApprovalRequest:
            _check_fence(conn, _APPROVALS, tenant, run_id, fence)
            _accept_fence(conn, _APPROVALS, tenant, run_id, fence)
            now = _now(conn)
            if chosen is not None:
                existing = _get_approval(conn, chosen)
                if existing is not None:
                    if existing.tenant != tenant:
                        raise ValueError(f"approval request id {chosen!r} is taken")
                    return existing
            while True:
                id = chosen or f"req-{secrets.token_hex(6)}"
                inserted = conn.execute(
                    f"INSERT INTO adk_approvals ({_APPROVAL_COLUMNS}) "
                    "VALUES (?, ?, ?, ?, ?, ?, NULL, NULL, ?, NULL) ON CONFLICT (id) DO NOTHING",
                    (id, tenant, run_id, encoded, iteration, ApprovalStatus.pending.value, now),
                ).rowcount
                if inserted:
                    break
            stored = _get_approval(conn, id)
            assert stored is not None
            return stored

        return await self.database.write(request)

    async def decide(
        self, tenant: str, id: str, *, approved: bool, by: str, note: str | None = None
    ) -> ApprovalRequest:
        """Decide a request: the same decision again is a no-op, the other way raises
        ``ValueError``; an id unknown for the tenant raises ``KeyError``."""
        status = ApprovalStatus.approved if approved else ApprovalStatus.denied

        def decide(conn: sqlite3.Connection) -> ApprovalRequest:
            request = _get_approval(conn, id)
            if request is None or request.tenant != tenant:
                raise KeyError(id)
            if request.status is status:
                return request
            if request.status is not ApprovalStatus.pending:
                raise ValueError(f"request {id!r} was already {request.status} by {request.by!r}")
            request = replace(request, status=status, by=by, note=note, decided_at=_now(conn))
            conn.execute(
                "UPDATE adk_approvals SET status = ?, decided_by = ?, note = ?, decided_at = ? "
                "WHERE id = ?",
                (status.value, by, note, request.decided_at, id),
            )
            return request

        return await self.database.write(decide)

    async def get(self, tenant: str, id: str) -> ApprovalRequest | None:
        """The request, or ``None`` when no request with that id belongs to the tenant."""
        request = await self.database.read(lambda conn: _get_approval(conn, id))
        return request if request is not None and request.tenant == tenant else None


# --- the bundle --------------------------------------------------------------------------


def open_sqlite_stores(
    path: str | os.PathLike[str],
    *,
    keep_last: int | None = None,
    synchronous: Literal["full", "normal"] | str = "full",
    url: str | None = None,
) -> Stores:
    """The six SQLite stores on one file, as a ``Stores`` bundle; no I/O until first use.

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
        url=database.url if url is None else url,
        on_create_schema=database.create_schema,
        on_verify=database.verify,
        on_close=(database.aclose,),
        schema=SQLITE_SCHEMA,
    )
