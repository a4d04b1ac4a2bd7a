"""The reliability suite's sites (a store of the test's own on each backend, with its
schema applied). Their figures are printed by ``tests/conftest.py``, which gathers them from
every test process."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from processes import BACKENDS, held_open, store_url
from reliability.harness import Site
from reliability.profile import PROFILE, SEED
from tesserix_adk.stores.urls import open_stores


async def apply_schema(url: str) -> None:
    async with open_stores(url) as stores:
        await stores.create_schema()


def make_site(url: str, tmp: Path, backend: str, **kw: float) -> Site:
    """A site on ``url`` with the schema applied (outside any running loop)."""
    asyncio.run(apply_schema(url))
    return Site(url, tmp, backend=backend, **kw)


@pytest.fixture(params=BACKENDS)
def site(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Site]:
    """A fresh store (SQLite file, Redis prefix, PostgreSQL schema) and history.

    SQLite runs with ``synchronous=normal``: these trials kill and stop processes, never
    the machine, and a commit in WAL mode outlives its process either way. With ``full``
    every commit waits for an fsync, and on a slow disk (a CI runner's, or fsyncs made 40 ms
    by ``strace`` fault injection) a dozen workers renewing 0.6 s leases queue for the
    file's one write lock until each gives up (``database is locked``): the suite then
    measured the disk, not the kit."""
    with held_open(store_url(request.param, tmp_path)) as url:
        if request.param == "sqlite":
            url += "?synchronous=normal"
        yield make_site(url, tmp_path, request.param)


@pytest.fixture
def rng(request: pytest.FixtureRequest) -> random.Random:
    """Seeded per test, so a failure can be run again (``ADK_TORTURE_SEED``)."""
    return random.Random(f"{SEED}:{request.node.nodeid}")


def pytest_report_header() -> str:
    return f"reliability profile: {PROFILE.name} (ADK_TORTURE=1 for the full one), seed {SEED}"
