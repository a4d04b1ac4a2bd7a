"""The SQLite schema: the migration files, and the whole DDL written out from them.

``migrations/NNNN_name.sql`` takes a file from schema version ``NNNN - 1`` to ``NNNN``; the
files are the only place the tables are written down. What a new file gets is what applying
all of them to an empty database leaves, read back from ``sqlite_master`` and written out
as ``CREATE … IF NOT EXISTS`` statements: that text (``SqliteSchema.ddl``) is what
``tesserix schema show`` prints, and applying it again puts back a table dropped by hand.

The files are read when a database is built (``SqliteSchema.load()``), never at import.
"""

from __future__ import annotations

import re
import sqlite3
from collections.abc import Iterator, Sequence
from contextlib import closing
from dataclasses import dataclass
from importlib.resources import files
from importlib.resources.abc import Traversable

from tesserix_adk.errors import ConfigurationError

__all__ = ["SqliteSchema", "statements"]

_MIGRATION_FILE = re.compile(r"^(\d{4})_[a-z0-9_]+\.sql$")
_TABLE = re.compile(r'^CREATE TABLE IF NOT EXISTS "?(\w+)"?', re.MULTILINE)

# sqlite_master keeps each CREATE with its first two keywords single-spaced and any
# IF NOT EXISTS removed, so this finds where to put it back.
_CREATE = re.compile(r"^CREATE (TABLE|INDEX|UNIQUE INDEX|VIEW|TRIGGER) ")


@dataclass(frozen=True, slots=True)
class SqliteSchema:
    """The schema as this kit's migration files define it."""

    migrations: tuple[str, ...]
    """``migrations[i]`` takes a file from schema version ``i`` to ``i + 1``."""
    ddl: str
    """The whole DDL of the current version, idempotent, with the version row."""

    @property
    def version(self) -> int:
        """The schema version this kit reads and writes: the number of migrations."""
        return len(self.migrations)

    @property
    def tables(self) -> tuple[str, ...]:
        """The tables the schema holds, as the DDL creates them."""
        return tuple(_TABLE.findall(self.ddl))

    def shapes(self) -> tuple[dict[str, TableShape], dict[str, IndexShape]]:
        """Each table's shape and each index's, as the DDL makes them (built in memory: the
        DDL is the one place that says)."""
        conn = sqlite3.connect(":memory:")
        try:
            for statement in statements(self.ddl):
                conn.execute(statement)
            indexes = conn.execute(
                "SELECT name FROM sqlite_master WHERE type = 'index' AND sql IS NOT NULL"
            ).fetchall()
            return (
                {t: table_shape(conn, t) for t in self.tables},
                {name: index_shape(conn, name) for (name,) in indexes},
            )
        finally:
            conn.close()

    @classmethod
    def load(cls) -> SqliteSchema:
        """Read the migration files shipped with the package and write the DDL out."""
        return cls.read(files("tesserix_adk.stores.sqlite").joinpath("migrations"))

    @classmethod
    def read(cls, folder: Traversable) -> SqliteSchema:
        """Read the ``NNNN_name.sql`` files of ``folder`` (numbered from 0001 without a
        gap; other files are ignored) and write the DDL out."""
        migrations = _read_migrations(folder)
        return cls(migrations=migrations, ddl=_written_out(migrations))


@dataclass(frozen=True, slots=True)
class TableShape:
    """What of a table tells the kit's from another's: what it is (``table``, ``view``,
    ``index``; empty when absent), its columns, its primary key, and the columns an insert
    must give (NOT NULL without a default)."""

    kind: str
    columns: frozenset[str]
    key: tuple[str, ...]
    required: frozenset[str]


@dataclass(frozen=True, slots=True)
class IndexShape:
    """What of an index tells the kit's from another's: what the object of its name is,
    the table it is on, its columns and whether it is unique (a unique index the kit did
    not make turns its INSERT OR REPLACE into a delete of another row)."""

    kind: str
    table: str
    columns: tuple[str, ...]
    unique: bool


def _kind(conn: sqlite3.Connection, name: str) -> tuple[str, str]:
    """What the object named ``name`` is (``table``, ``view``, ``index``; empty when there
    is none; names are compared as SQLite compares them, without case) and its table."""
    found = conn.execute(
        "SELECT type, tbl_name FROM sqlite_master WHERE name = ? COLLATE NOCASE "
        "AND type IN ('table', 'view', 'index') ORDER BY type = 'table' DESC",
        (name,),
    ).fetchone()
    return ("", "") if found is None else (str(found[0]), str(found[1]))


def table_shape(conn: sqlite3.Connection, table: str) -> TableShape:
    """``table`` as ``conn``'s database holds it."""
    kind, _ = _kind(conn, table)
    # (cid, name, type, notnull, default, pk); a default of NULL is none.
    rows = conn.execute(f'PRAGMA table_info("{table}")').fetchall()
    return TableShape(
        kind=kind,
        columns=frozenset(row[1] for row in rows),
        key=tuple(row[1] for row in sorted((r for r in rows if r[5]), key=lambda r: r[5])),
        required=frozenset(
            row[1]
            for row in rows
            if row[3] and (row[4] is None or str(row[4]).upper() == "NULL") and not row[5]
        ),
    )


def index_shape(conn: sqlite3.Connection, name: str) -> IndexShape:
    """The index ``name`` as ``conn``'s database holds it."""
    kind, table = _kind(conn, name)
    if kind != "index":
        return IndexShape(kind=kind, table=table, columns=(), unique=False)
    columns = tuple(row[2] for row in conn.execute(f'PRAGMA index_info("{name}")'))
    listed = conn.execute(f'PRAGMA index_list("{table}")').fetchall()
    unique = any(row[1].lower() == name.lower() and row[2] for row in listed)
    return IndexShape(kind=kind, table=table.lower(), columns=columns, unique=bool(unique))


def statements(script: str) -> Iterator[str]:
    """Split ``script`` into whole statements, as SQLite's tokenizer sees them."""
    buffer = ""
    for line in script.splitlines(keepends=True):
        buffer += line
        if sqlite3.complete_statement(buffer):
            yield buffer.strip()
            buffer = ""
    leftover = "".join(
        line for line in buffer.splitlines() if line.strip() and not line.strip().startswith("--")
    )
    if leftover:
        raise ConfigurationError(f"the SQLite schema ends in an incomplete statement: {leftover}")


def _read_migrations(folder: Traversable) -> tuple[str, ...]:
    numbered: dict[int, str] = {}
    for entry in folder.iterdir():
        match = _MIGRATION_FILE.match(entry.name)
        if match is None:
            continue
        number = int(match.group(1))
        if number in numbered:
            raise ConfigurationError(f"two SQLite migrations are numbered {number:04d}")
        numbered[number] = entry.read_text(encoding="utf-8")
    # The index is the version a migration starts from: a gap would skip a step.
    if not numbered or sorted(numbered) != list(range(1, len(numbered) + 1)):
        raise ConfigurationError(
            f"the SQLite migrations must be numbered 0001 up without a gap, found "
            f"{', '.join(f'{n:04d}' for n in sorted(numbered)) or 'none'}"
        )
    return tuple(numbered[n] for n in sorted(numbered))


def _written_out(migrations: Sequence[str]) -> str:
    """What ``migrations`` leave in an empty database, as idempotent DDL."""
    with closing(sqlite3.connect(":memory:")) as conn:
        for migration in migrations:
            for statement in statements(migration):
                conn.execute(statement)
        # Tables before the indexes (and anything else) built on them; an automatic
        # index (sql NULL) comes back with its table.
        rows = conn.execute(
            "SELECT sql FROM sqlite_master WHERE sql IS NOT NULL "
            "ORDER BY CASE type WHEN 'table' THEN 0 WHEN 'index' THEN 1 ELSE 2 END, rowid"
        ).fetchall()
    created = []
    for (sql,) in rows:
        text, found = _CREATE.subn(r"CREATE \1 IF NOT EXISTS ", sql, count=1)
        if not found:
            raise ConfigurationError(f"cannot write out this SQLite schema statement: {sql}")
        created.append(text + ";")
    version = len(migrations)
    return (
        f"-- tesserix-adk SQLite schema, version {version}: what migrations 0001 to "
        f"{version:04d} leave in an empty file.\n"
        "-- Applied by `tesserix schema apply` (SqliteDatabase.create_schema); idempotent.\n"
        "-- Why each table is as it is: the migration files, stores/sqlite/migrations/.\n"
        "\n" + "\n\n".join(created) + "\n\n"
        f"INSERT INTO adk_schema_version (id, version) VALUES (1, {version})\n"
        "    ON CONFLICT (id) DO NOTHING;\n"
    )
