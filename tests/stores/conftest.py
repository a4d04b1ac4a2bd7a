"""Fixtures of the store tests."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tesserix_adk.stores.sqlite import SqliteDatabase


@pytest.fixture
async def database(tmp_path: Path) -> AsyncIterator[SqliteDatabase]:
    """A fresh SQLite file with the schema applied (``synchronous=normal``: the group
    commit tests are not about power loss; ``test_sqlite.py`` has its own, FULL)."""
    db = SqliteDatabase(tmp_path / "adk.sqlite3", synchronous="normal")
    await db.create_schema()
    yield db
    await db.aclose()
