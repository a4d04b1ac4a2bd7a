"""Fixtures of the console's tests: a seeded SQLite store and the console served on it."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from console_world import World, seed, served

from tesserix_adk.console import create_app


@pytest.fixture(scope="module")
def store_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A store seeded once per module (tests that change it seed their own)."""
    url = f"sqlite:///{tmp_path_factory.mktemp('console') / 'adk.sqlite3'}"
    asyncio.run(seed(url, World()))
    return url


@pytest.fixture(scope="module")
def console(store_url: str) -> Iterator[str]:
    """The console (no token, loopback only) on ``store_url``; its base URL."""
    with served(create_app(store_url)) as base:
        yield base
