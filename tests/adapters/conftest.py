"""Service fixtures for the adapter tests: a Redis key prefix and a PostgreSQL schema each.

See ``adapters.services``: an unreachable server skips (fails under ``CI=true``); every
test cleans up after itself, so the suite passes twice in a row on the same servers.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import pytest

from adapters import services
from tesserix_adk.stores.bundle import Stores

if TYPE_CHECKING:
    import psycopg
    from redis.asyncio import Redis


@pytest.fixture
async def redis_client() -> AsyncIterator[Redis]:
    """A raw client on the test Redis, for looking behind the stores."""
    client = await services.redis_client()
    try:
        yield client
    finally:
        await client.aclose()


@pytest.fixture
async def redis_prefix(redis_client: Redis) -> AsyncIterator[str]:
    """A key prefix of this test's own; its keys are deleted afterwards."""
    prefix = services.redis_prefix()
    try:
        yield prefix
    finally:
        await services.delete_prefixed(redis_client, prefix)


@pytest.fixture
def redis_url(redis_prefix: str) -> str:
    """A store URL under this test's prefix, accepting the local server's volatility."""
    return services.with_query(services.REDIS_URL, prefix=redis_prefix, allow_volatile="true")


@pytest.fixture
async def redis_stores(redis_url: str) -> AsyncIterator[Stores]:
    from tesserix_adk.adapters.redis import open_redis_stores

    stores = open_redis_stores(redis_url)
    try:
        yield stores
    finally:
        await stores.aclose()


@pytest.fixture
async def pg_schema() -> AsyncIterator[str]:
    """An empty schema of this test's own, dropped CASCADE afterwards."""
    async with services.postgres_schema() as schema:
        yield schema


@pytest.fixture
def pg_url(pg_schema: str) -> str:
    """A store URL whose search_path is this test's schema."""
    return services.schema_url(pg_schema)


@pytest.fixture
async def pg_stores(pg_url: str) -> AsyncIterator[Stores]:
    """The PostgreSQL stores in this test's schema, with the schema applied."""
    async with services.postgres_stores_applied(pg_url) as stores:
        yield stores


@pytest.fixture
async def pg_admin(pg_url: str) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
    """A plain autocommit connection in this test's schema, for looking behind the stores."""
    import psycopg

    conn = await psycopg.AsyncConnection.connect(pg_url, autocommit=True)
    try:
        yield conn
    finally:
        await conn.close()
