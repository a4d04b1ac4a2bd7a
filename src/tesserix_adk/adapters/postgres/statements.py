"""The SQL the stores run, as shipped: one statement per file, ``sql/<store>/<name>.sql``.

Each file is the statement exactly as it is sent, headed by comments that say what it
decides, its parameters (``%(name)s``, psycopg's named placeholders) and what it returns.
A store declares the statements it runs as a ``Statements`` dataclass, one field per file,
and reads them when it is built (never at import).

Every fenced write starts with the same two CTEs, written out in each file (the test suite
checks the copies agree): ``lease`` reads the run's lease fence, and ``gate`` has a row iff
the write may go on — its fence (``%(fence)s``) is at least the run's lease fence (an
unfenced write: no lease was ever taken) and at least the highest the store has seen
(unfenced: none seen). The upsert of ``gate`` locks the run's row of ``adk_fences``, so the
writes of one run are decided one at a time, and raises it. The statement ends with the
verdict: ``accepted``, and the fences ``seen`` and ``leased`` that may have refused it.

Schema. The files name the kit's tables unqualified (``adk_run_leases``), so they live in the
first schema of the connection's search_path. With the URL's ``schema=`` option the tables
are qualified instead (``"my_schema".adk_run_leases``) as the files are read: no startup
parameter is needed, so it works behind a pooler that refuses ``options``. The name is
checked (``schema_identifier``) before it is quoted into any statement.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from importlib import resources
from typing import Self

from tesserix_adk.errors import ConfigurationError

__all__ = [
    "PACKAGE",
    "TABLES",
    "Statements",
    "qualified_tables",
    "qualify",
    "schema_identifier",
    "words",
]

PACKAGE = "tesserix_adk.adapters.postgres"

TABLES = (
    "adk_schema_version",
    "adk_fences",
    "adk_checkpoints",
    "adk_checkpoint_steps",
    "adk_run_leases",
    "adk_idempotency",
    "adk_history",
    "adk_ledger",
    "adk_approvals",
    "adk_work",
)

# A table's name as a whole word: ``adk_work`` but not the index ``adk_work_due``.
_TABLE = re.compile(r"\b(?<![.\"])(" + "|".join(sorted(TABLES, key=len, reverse=True)) + r")\b")
# What a schema= name may be: an identifier PostgreSQL takes (at most 63 bytes), with no
# quote, percent sign (psycopg's placeholders) or anything else that could end it early.
_SCHEMA_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_$-]{0,62}")


def schema_identifier(name: str) -> str:
    """``name`` quoted as a PostgreSQL identifier, or ``ConfigurationError`` if it is not a
    plain name (letters, digits, ``_``, ``$``, ``-``; starting with a letter or ``_``; at
    most 63 characters). Quoted, it is used exactly as written: case counts."""
    if not _SCHEMA_NAME.fullmatch(name):
        raise ConfigurationError(
            f"schema in the PostgreSQL store URL must be a plain name (letters, digits, _, $ "
            f"or -, starting with a letter or _, at most 63 characters), got {name!r}"
        )
    return '"' + name.replace('"', '""') + '"'


def qualify(sql: str, schema: str | None) -> str:
    """``sql`` with every kit table qualified by ``schema`` (a plain name, checked here);
    unchanged when ``schema`` is ``None``."""
    if schema is None:
        return sql
    prefix = schema_identifier(schema) + "."
    return _TABLE.sub(lambda found: prefix + found.group(1), sql)


def qualified_tables(schema: str | None) -> tuple[str, ...]:
    """The kit's tables as ``to_regclass`` should find them."""
    return tuple(qualify(table, schema) for table in TABLES)


@dataclass(frozen=True, slots=True)
class Statements:
    """The statements of one store: a subclass names one field per file of its folder."""

    @classmethod
    def load(cls, store: str, schema: str | None = None) -> Self:
        """Read ``sql/<store>/<field>.sql`` for every field, its tables qualified by
        ``schema`` when one is given."""
        folder = resources.files(PACKAGE).joinpath("sql", store)
        return cls(
            **{
                field.name: qualify(
                    folder.joinpath(f"{field.name}.sql").read_text(encoding="utf-8"), schema
                )
                for field in fields(cls)
            }
        )


def words(text: str | None) -> str | None:
    """Free text (a reason, a note, who decided) as PostgreSQL's ``text`` keeps it: each
    NUL, which it cannot keep, written ``\\x00``. A tool's error or an operator's note may
    hold one; refused, the worker could neither park the run nor say why it waits."""
    return None if text is None else text.replace("\x00", "\\x00")
