"""What goes wrong with a SQLite store, said as the kit's errors: the driver's errors
translated, and a file whose schema is missing or of another version."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from tesserix_adk.errors import (
    AdkError,
    CheckpointCorruptError,
    ConfigurationError,
    SchemaMismatchError,
    StorePermissionError,
    StoreUnavailableError,
)
from tesserix_adk.stores.sqlite.schema import IndexShape, TableShape, index_shape, table_shape

__all__ = [
    "foreign_tables",
    "missing_schema",
    "missing_tables",
    "refuse_null_keys",
    "sqlite_url",
    "translate",
    "wrong_version",
]


def sqlite_url(path: str) -> str:
    """The ``open_stores`` URL of a file."""
    # SQLAlchemy style: three slashes, then the path (absolute paths add their own slash).
    return "sqlite:///" + path


def missing_schema(path: str) -> SchemaMismatchError:
    """No schema (or no file) where the stores were pointed."""
    return SchemaMismatchError(
        f"the SQLite store {path} has no tesserix schema (or does not exist); "
        f"create it with `tesserix schema apply --store {sqlite_url(path)}`"
    )


def missing_tables(path: str, tables: list[str]) -> SchemaMismatchError:
    """Tables of the schema gone from a file that has it (dropped by hand, say)."""
    return SchemaMismatchError(
        f"the SQLite store {path} lacks {', '.join(tables)}; put them back with "
        f"`tesserix schema apply --store {sqlite_url(path)}`"
    )


def wrong_version(path: str, found: object, version: int) -> SchemaMismatchError:
    """A schema version this kit does not use, with what to do about it."""
    # Version 1 is the first: anything lower was not written by a release of the kit.
    if isinstance(found, int) and found > version:
        hint = "upgrade tesserix-adk to use it"
    elif isinstance(found, int) and found >= 1:
        hint = (
            f"migrate it, keeping its data, with `tesserix schema apply --store {sqlite_url(path)}`"
        )
    else:
        hint = "it was not created by `tesserix schema apply`"
    return SchemaMismatchError(
        f"the SQLite store {path} has schema version {found!r}, this kit needs {version}; {hint}"
    )


def translate(exc: sqlite3.Error, path: str, busy_timeout: float) -> AdkError:
    """A driver error as the kit's error."""
    code = getattr(exc, "sqlite_errorcode", -1) & 0xFF
    if code in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED):
        return StoreUnavailableError(
            f"the SQLite store {path} is locked by another writer "
            f"(waited up to {busy_timeout:g} s): {exc}"
        )
    if code == sqlite3.SQLITE_CANTOPEN and Path(path).is_file():
        # Like a database user refused a write: the store's matter (a worker stops on it).
        return StorePermissionError(
            f"the SQLite store {path} exists but cannot be opened ({exc}): a read-only "
            "filesystem, or a directory this process may not write (WAL keeps its -wal and "
            "-shm files beside it), makes it read-only; where it can be read, it can be "
            "inspected, not written"
        )
    if code == sqlite3.SQLITE_CANTOPEN:
        return ConfigurationError(
            f"the SQLite store {path} does not exist or cannot be opened; "
            f"create it with `tesserix schema apply --store {sqlite_url(path)}`"
        )
    if code == sqlite3.SQLITE_NOTADB:
        return ConfigurationError(f"{path} is not a SQLite database: {exc}")
    if code == sqlite3.SQLITE_CORRUPT:
        return CheckpointCorruptError(
            f"the SQLite store {path} is damaged ({exc}); restore it from a backup"
        )
    if code == sqlite3.SQLITE_READONLY:
        return StorePermissionError(
            f"the SQLite store {path} is read-only for this process ({exc}); it can "
            "be inspected, not written"
        )
    if isinstance(exc, sqlite3.OperationalError) and "no such table" in str(exc):
        return missing_schema(path)
    said = str(exc)
    if isinstance(exc, sqlite3.OperationalError) and (
        "there is already a" in said or " already exists" in said
    ):
        # Another object under a name the kit creates (an index named like a kit table, a
        # table named like a kit index): the kit's CREATE refuses it, no retry moves it.
        return SchemaMismatchError(
            f"the SQLite store {path} holds an object under a name the kit creates that is "
            f"not the kit's ({exc}); move it aside or restore the file from a backup"
        )
    if isinstance(exc, sqlite3.OperationalError) and "no such column" in str(exc):
        # No retry brings the column back: the table was changed by hand or restored from
        # another copy.
        return CheckpointCorruptError(
            f"the SQLite store {path} is not as the kit made it ({exc}): a table was changed "
            "by hand or restored from another copy; restore the file from a backup"
        )
    return StoreUnavailableError(f"the SQLite store {path} failed: {exc}")


def foreign_tables(
    conn: sqlite3.Connection,
    path: str,
    expected: tuple[dict[str, TableShape], dict[str, IndexShape]],
) -> None:
    """Refuse a file whose objects of the kit's table names are not the kit's tables (a
    view, a table lacking the kit's columns or primary key, or one that wants a column the
    kit never writes): another program's, or changed by hand. ``SchemaMismatchError``
    naming them. A column's type is not compared: a migration may declare it otherwise."""
    tables, indexes = expected
    problems = []
    for table, kits in tables.items():
        found = table_shape(conn, table)
        missing = sorted(kits.columns - found.columns)
        if found.kind != "table":
            problems.append(f"{table} is a {found.kind or 'missing table'}")
        elif missing:
            problems.append(f"{table} lacks {', '.join(missing)}")
        elif found.key != kits.key:
            problems.append(f"{table} is keyed by ({', '.join(found.key)})")
        elif found.required - kits.columns:
            problems.append(f"{table} requires {', '.join(sorted(found.required - kits.columns))}")
    for name, kits_index in indexes.items():
        if index_shape(conn, name) != kits_index:
            problems.append(f"{name} is not the kit's index")
    if problems:
        raise SchemaMismatchError(
            f"the SQLite store {path} holds objects of the kit's names that are not the kit's "
            f"tables ({'; '.join(problems)}): another program's, or changed by hand; move them "
            "aside or restore the file from a backup"
        )


def refuse_null_keys(conn: sqlite3.Connection, path: str, version: int) -> None:
    """Refuse to migrate a version-1 file holding rows with no key (version 2 makes keys
    NOT NULL). Such a row can never be found by its key, so it is not silently dropped:
    an operator decides what it was."""
    (records,) = conn.execute("SELECT count(*) FROM adk_idempotency WHERE key IS NULL").fetchone()
    (approvals,) = conn.execute("SELECT count(*) FROM adk_approvals WHERE id IS NULL").fetchone()
    if records or approvals:
        raise ConfigurationError(
            f"the SQLite store {path} holds {records} idempotency record(s) with no key and "
            f"{approvals} approval(s) with no id; version {version} of the schema refuses "
            "them. Inspect and delete them (e.g. DELETE FROM adk_idempotency WHERE key IS "
            "NULL), then run `tesserix schema apply` again"
        )
