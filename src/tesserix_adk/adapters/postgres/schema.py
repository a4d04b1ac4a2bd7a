"""The PostgreSQL schema as this package ships it: ``migrations/*.sql``, read as package data.

``migrations/NNNN_<name>.sql`` takes a database from version ``NNNN - 1`` to ``NNNN``: in
``Schema.migrations`` (``MIGRATIONS`` of the package) index ``i`` holds the file numbered
``i + 1``, and ``Schema.version`` (``SCHEMA_VERSION``) is their number. Each is idempotent.
``migrations/version_table.sql`` is the table that records the version reached; it is created
before any migration runs. ``Schema.ddl`` (``EXPECTED_CHECKPOINT_SCHEMA``) is the whole DDL,
as ``tesserix schema show`` prints it and ``create_schema()`` leaves the database.

Nothing applies the schema implicitly: ``PostgresDatabase.create_schema()`` (what
``tesserix schema apply`` runs) does, and ``verify()`` checks the version. The files are read
when a database is built, never at import.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import resources

from tesserix_adk.adapters.postgres.statements import PACKAGE, TABLES, qualify

__all__ = ["APPLY", "SCHEMA_LOCK_CLASS", "TABLES", "Schema"]

# Serialises create_schema() per schema: (this class, hash of the schema name).
SCHEMA_LOCK_CLASS = 0x7E55E12

APPLY = "run `tesserix schema apply --store URL` (or `await stores.create_schema()`)"

_MIGRATION = re.compile(r"(\d{4})_[a-z0-9_]+\.sql")


@dataclass(frozen=True, slots=True, kw_only=True)
class Schema:
    """The version table and the migrations, in order: ``migrations[i]`` takes the schema
    from version ``i`` to ``i + 1``."""

    version_table: str
    migrations: tuple[str, ...]
    # The schema the tables are qualified by (the URL's ``schema=``); None: the search_path's.
    schema: str | None = None

    @classmethod
    def load(cls, schema: str | None = None) -> Schema:
        """Read the schema from the package's ``migrations/`` folder, its tables qualified
        by ``schema`` when one is given (the URL's ``schema=``)."""
        folder = resources.files(PACKAGE).joinpath("migrations")
        numbered: dict[int, str] = {}
        for entry in folder.iterdir():
            found = _MIGRATION.fullmatch(entry.name)
            if found is not None:
                numbered[int(found.group(1))] = qualify(entry.read_text(encoding="utf-8"), schema)
        if sorted(numbered) != list(range(1, len(numbered) + 1)):
            raise RuntimeError(
                f"the PostgreSQL migrations shipped are not numbered 1, 2, …: {sorted(numbered)}"
            )
        return cls(
            version_table=qualify(
                folder.joinpath("version_table.sql").read_text(encoding="utf-8"), schema
            ),
            migrations=tuple(numbered[n] for n in sorted(numbered)),
            schema=schema,
        )

    @property
    def version(self) -> int:
        """The version the migrations take a database to."""
        return len(self.migrations)

    @property
    def ddl(self) -> str:
        """The whole DDL of the PostgreSQL stores, as ``create_schema()`` leaves the
        database (``EXPECTED_CHECKPOINT_SCHEMA``)."""
        return (
            f"-- tesserix-adk PostgreSQL schema, version {self.version}.\n"
            "-- Applied by `tesserix schema apply` (PostgresDatabase.create_schema); "
            "idempotent.\n\n"
            + self.version_table
            + "\n"
            + "\n".join(self.migrations)
            + qualify(
                f"\nINSERT INTO adk_schema_version (id, version) VALUES (1, {self.version})\n"
                "    ON CONFLICT (id) DO UPDATE SET version = EXCLUDED.version, "
                "applied_at = clock_timestamp();\n",
                self.schema,
            )
        )
