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
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from importlib import resources
from typing import Self

__all__ = ["PACKAGE", "Statements"]

PACKAGE = "tesserix_adk.adapters.postgres"


@dataclass(frozen=True, slots=True)
class Statements:
    """The statements of one store: a subclass names one field per file of its folder."""

    @classmethod
    def load(cls, store: str) -> Self:
        """Read ``sql/<store>/<field>.sql`` for every field."""
        folder = resources.files(PACKAGE).joinpath("sql", store)
        return cls(
            **{
                field.name: folder.joinpath(f"{field.name}.sql").read_text(encoding="utf-8")
                for field in fields(cls)
            }
        )
