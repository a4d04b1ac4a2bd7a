"""A damaged row in a backend reads back as a typed error, never a ValueError from a decoder.

Each backend's own rows are damaged the way a bad disk, a hand edit or a half-migrated
database would leave them (a status no kit writes, calls that are not JSON), then read
through the store protocols.
"""

from __future__ import annotations

import sqlite3
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest

from adapters import services
from tesserix_adk.errors import CheckpointCorruptError
from tesserix_adk.stores import open_stores
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.stores.protocols import ToolFlags

Damage = Callable[[], Awaitable[None]]


async def _write_rows(stores: Stores) -> None:
    await stores.idempotency.claim(
        "k1",
        holder="h",
        tenant="t",
        run_id="r",
        iteration=0,
        tool="book_seat",
        call_id="c1",
        flags=ToolFlags(),
    )
    await stores.approvals.request("t", "r", [], iteration=0, id="req-1")


@asynccontextmanager
async def _sqlite(tmp_path: Path) -> AsyncIterator[tuple[Stores, Damage]]:
    path = tmp_path / "adk.sqlite3"
    stores = open_stores(f"sqlite:///{path}")
    await stores.create_schema()
    await _write_rows(stores)

    async def damage() -> None:
        with sqlite3.connect(path) as conn:
            conn.execute("UPDATE adk_idempotency SET status = 'bogus'")
            conn.execute("UPDATE adk_approvals SET calls = '[{]', status = 'weird'")

    async with stores:
        yield stores, damage


@asynccontextmanager
async def _redis(tmp_path: Path) -> AsyncIterator[tuple[Stores, Damage]]:
    async with services.redis_stores() as stores:
        await _write_rows(stores)
        client = await services.redis_client()

        # Only this test's keys: other tests share the server.
        prefix = parse_qs(urlsplit(str(stores.url)).query)["prefix"][0]

        async def damage() -> None:
            async for key in client.scan_iter(match=f"{prefix}*"):
                if await client.type(key) != b"hash":
                    continue
                fields = await client.hgetall(key)
                if b"status" in fields and b"holder" in fields:
                    await client.hset(key, "status", "bogus")
                if b"calls" in fields:
                    await client.hset(key, mapping={"calls": "[{]", "status": "weird"})

        try:
            yield stores, damage
        finally:
            await client.aclose()


@asynccontextmanager
async def _postgres(tmp_path: Path) -> AsyncIterator[tuple[Stores, Damage]]:
    import psycopg

    async with services.postgres_stores() as stores:
        await _write_rows(stores)
        url = str(getattr(stores, "url", ""))

        async def damage() -> None:
            async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
                # The schema's own constraints refuse a status no kit writes...
                with pytest.raises(psycopg.errors.CheckViolation):
                    await conn.execute("UPDATE adk_idempotency SET status = 'bogus'")
                # ...and JSON columns refuse text that is not JSON; JSON of the wrong shape
                # is what is left to damage.
                await conn.execute("""UPDATE adk_approvals SET calls = '[1]'""")

        yield stores, damage


BACKENDS: dict[str, Any] = {
    "sqlite": _sqlite,
    "redis": pytest.param(_redis, marks=pytest.mark.redis),
    "postgres": pytest.param(_postgres, marks=pytest.mark.postgres),
}


@pytest.mark.parametrize("opened", list(BACKENDS.values()), ids=list(BACKENDS))
async def test_a_damaged_record_or_request_is_a_typed_error(opened: Any, tmp_path: Path) -> None:
    async with opened(tmp_path) as (stores, damage):
        await damage()
        if opened is not _postgres:
            with pytest.raises(CheckpointCorruptError, match="idempotency record"):
                await stores.idempotency.lookup(["k1"], tenant="t")
            with pytest.raises(CheckpointCorruptError, match="idempotency record"):
                await stores.idempotency.records("t", "r")
        with pytest.raises(CheckpointCorruptError, match="approval request"):
            await stores.approvals.get("t", "req-1")
