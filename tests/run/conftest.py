"""Fixtures the runner's tests share: a SQLite file with the schema, and its stores."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tesserix_adk.stores.bundle import Stores
from tesserix_adk.stores.urls import open_stores


@pytest.fixture
def path(tmp_path: Path) -> str:
    """Where the test's SQLite file is."""
    return str(tmp_path / "adk.sqlite3")


@pytest.fixture
async def stores(path: str) -> AsyncIterator[Stores]:
    """The stores of the file at ``path``, its schema applied; closed after the test."""
    opened = open_stores(f"sqlite:///{path}")
    await opened.create_schema()
    try:
        yield opened
    finally:
        await opened.aclose()
