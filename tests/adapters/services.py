"""The Redis and PostgreSQL servers the adapter tests use, and each test's own corner of them.

Redis: ``ADK_TEST_REDIS_URL`` (default ``redis://127.0.0.1:6379/0``); every test writes under
a random key prefix and deletes its keys (by ``SCAN`` on that prefix) afterwards.
PostgreSQL: ``ADK_TEST_POSTGRES_URL`` (default ``postgresql://postgres@127.0.0.1:5432/test``);
every test gets a schema of its own, chosen with ``options=-csearch_path=…`` and dropped
``CASCADE`` afterwards. Nothing else on either server is touched.

A server that cannot be reached skips the test with the reason, except under ``CI=true``,
where it fails it: CI must never pass by skipping.

Imported as ``adapters.services`` (``tests/`` is on ``sys.path``) by the adapter tests and by
the conformance harness in ``tests/stores``.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar
from urllib.parse import quote, urlencode

import pytest

from tesserix_adk.stores.bundle import Stores

if TYPE_CHECKING:
    from redis.asyncio import Redis

REDIS_URL = os.environ.get("ADK_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
POSTGRES_URL = os.environ.get("ADK_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test")


def unavailable(reason: str) -> NoReturn:
    """Skip the test, or fail it when ``CI=true``."""
    if os.environ.get("CI", "").strip().lower() == "true":
        pytest.fail(f"{reason} (CI=true: a service that cannot be reached is a failure)")
    pytest.skip(reason)


def with_query(url: str, **options: str) -> str:
    """``url`` with ``options`` added to its query."""
    joiner = "&" if "?" in url else "?"
    return url + joiner + urlencode(options, quote_via=quote)


# --- Redis -------------------------------------------------------------------------------


async def redis_client() -> Redis:
    """A connected ``redis.asyncio`` client on the test server (the caller closes it)."""
    import redis.asyncio as aioredis
    from redis.exceptions import RedisError

    client = aioredis.from_url(REDIS_URL, socket_connect_timeout=3)
    try:
        await client.ping()
    except (RedisError, OSError) as exc:
        await client.aclose()
        unavailable(f"Redis at {REDIS_URL} cannot be reached: {exc}")
    return client


def redis_prefix() -> str:
    """A key prefix no other test uses."""
    return f"adktest-{secrets.token_hex(6)}:"


async def delete_prefixed(client: Redis, prefix: str) -> None:
    """Delete every key under ``prefix`` (found by ``SCAN``; the prefix has no glob chars)."""
    assert not any(c in prefix for c in "*?[]\\")
    batch: list[bytes] = []
    async for key in client.scan_iter(match=f"{prefix}*", count=1000):
        batch.append(key)
        if len(batch) >= 500:
            await client.delete(*batch)
            batch.clear()
    if batch:
        await client.delete(*batch)


@asynccontextmanager
async def redis_stores(
    *, keep_last: int | None = None, allow_volatile: bool = True
) -> AsyncIterator[Stores]:
    """``open_stores`` on the test Redis under a fresh prefix; its keys are deleted after."""
    from tesserix_adk.adapters.redis import open_redis_stores

    client = await redis_client()
    prefix = redis_prefix()
    options = {"prefix": prefix}
    if allow_volatile:
        # The local server runs without persistence; the refusal has tests of its own.
        options["allow_volatile"] = "true"
    if keep_last is not None:
        options["keep_last"] = str(keep_last)
    stores = open_redis_stores(with_query(REDIS_URL, **options))
    try:
        yield stores
    finally:
        await stores.aclose()
        try:
            await delete_prefixed(client, prefix)
        finally:
            await client.aclose()


# --- PostgreSQL --------------------------------------------------------------------------


def schema_url(schema: str, url: str = POSTGRES_URL) -> str:
    """``url`` with its search_path set to ``schema`` only."""
    return with_query(url, options=f"-csearch_path={schema}")


@asynccontextmanager
async def write_group(stores: Stores) -> AsyncIterator[Any]:
    """A write group of its own on ``stores``' database, begun inside a group scope of its
    own; the caller commits it (or shows that its commit fails)."""
    from tesserix_adk.stores.grouping import group_scope

    with group_scope():
        group = stores.history.write_group()  # type: ignore[attr-defined]
        await group.begin()
        yield group


def marked_sleep(tag: str, seconds: float = 30) -> str:
    """PL/pgSQL that names its backend ``tag`` (for this transaction) and then sleeps, so
    a test can find the backend it put to sleep, never another test's (``asleep``)."""
    return f"PERFORM set_config('application_name', '{tag}', true); PERFORM pg_sleep({seconds})"


async def asleep(admin: Any, tag: str) -> int:
    """The pid of the backend sleeping under ``tag`` (``marked_sleep``), once it does."""
    import asyncio

    for _ in range(1000):
        cur = await admin.execute(
            "SELECT pid FROM pg_stat_activity WHERE wait_event = 'PgSleep' "
            "AND application_name = %s",
            (tag,),
        )
        pids = [pid for (pid,) in await cur.fetchall()]
        if pids:
            assert len(pids) == 1, pids
            return int(pids[0])
        await asyncio.sleep(0.01)
    raise AssertionError(f"no backend ever slept as {tag!r}")


async def still_asleep(admin: Any, tag: str) -> int:
    """How many backends sleep under ``tag`` now."""
    cur = await admin.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'PgSleep' "
        "AND application_name = %s",
        (tag,),
    )
    row = await cur.fetchone()
    return 0 if row is None else int(row[0])


@asynccontextmanager
async def postgres_schema() -> AsyncIterator[str]:
    """A fresh, empty schema of its own (its name); dropped ``CASCADE`` after."""
    import psycopg

    name = f"adktest_{secrets.token_hex(6)}"
    try:
        admin = await psycopg.AsyncConnection.connect(
            POSTGRES_URL, autocommit=True, connect_timeout=3
        )
    except psycopg.OperationalError as exc:
        unavailable(f"PostgreSQL at {POSTGRES_URL} cannot be reached: {exc}")
    try:
        await admin.execute(f'CREATE SCHEMA "{name}"')
        try:
            yield name
        finally:
            await admin.execute(f'DROP SCHEMA "{name}" CASCADE')
    finally:
        await admin.close()


@asynccontextmanager
async def postgres_stores(
    *, keep_last: int | None = None, create_schema: bool = True
) -> AsyncIterator[Stores]:
    """``open_stores`` on the test PostgreSQL in a schema of its own, applied unless
    ``create_schema=False``; the schema is dropped after."""
    async with postgres_schema() as schema:
        url = schema_url(schema)
        if keep_last is not None:
            url = with_query(url, keep_last=str(keep_last))
        async with postgres_stores_at(url) as stores:
            if create_schema:
                await stores.create_schema()
            yield stores


@asynccontextmanager
async def postgres_stores_at(url: str) -> AsyncIterator[Stores]:
    """``open_postgres_stores(url)``, closed after; nothing created or dropped."""
    from tesserix_adk.adapters.postgres import open_postgres_stores

    stores = open_postgres_stores(url)
    try:
        yield stores
    finally:
        await stores.aclose()


@asynccontextmanager
async def postgres_stores_applied(url: str) -> AsyncIterator[Stores]:
    """``postgres_stores_at(url)`` with the kit's schema applied first."""
    async with postgres_stores_at(url) as stores:
        await stores.create_schema()
        yield stores


class SharedSchema:
    """One schema with the kit's tables applied once for a whole session, emptied before
    each use: the conformance suites need empty stores, not a schema built for each test
    (creating, applying and dropping one costs more than most of their tests)."""

    def __init__(self) -> None:
        self.name = f"adktest_shared_{secrets.token_hex(6)}"
        self._admin: Any = None

    def open(self) -> None:
        """Create the schema and apply the kit's tables (skips when PostgreSQL is down)."""
        import asyncio

        import psycopg

        from tesserix_adk.adapters.postgres import open_postgres_stores

        try:
            self._admin = psycopg.connect(POSTGRES_URL, autocommit=True, connect_timeout=3)
        except psycopg.OperationalError as exc:
            unavailable(f"PostgreSQL at {POSTGRES_URL} cannot be reached: {exc}")
        self._admin.execute(f'CREATE SCHEMA "{self.name}"')

        async def apply() -> None:
            stores = open_postgres_stores(schema_url(self.name))
            try:
                await stores.create_schema()
            finally:
                await stores.aclose()

        asyncio.run(apply())

    def emptied(self) -> str:
        """Empty every kit table but the schema version; the schema's name."""
        from tesserix_adk.adapters.postgres.statements import TABLES

        # DELETE, not TRUNCATE: a test leaves a few rows, and TRUNCATE swaps every
        # table's files, which costs more than the test.
        with self._admin.transaction():
            for table in TABLES:
                if table != "adk_schema_version":
                    self._admin.execute(f'DELETE FROM "{self.name}".{table}')
        return self.name

    def close(self) -> None:
        if self._admin is not None:
            try:
                self._admin.execute(f'DROP SCHEMA IF EXISTS "{self.name}" CASCADE')
            finally:
                self._admin.close()


T = TypeVar("T")


async def on_every_idempotency_store(
    sqlite_path: Any, check: Callable[[Any], Awaitable[T]]
) -> dict[str, T]:
    """``check`` run on a fresh idempotency store of each backend (memory, a SQLite file at
    ``sqlite_path``, the shared Redis under a prefix of its own, PostgreSQL in a schema of
    its own), what it gave by backend: for tests that hold the backends to one another."""
    from tesserix_adk.stores.urls import open_stores

    seen = {"memory": await check(open_stores("memory://").idempotency)}
    async with open_stores(f"sqlite:///{sqlite_path}") as stores:
        await stores.create_schema()
        seen["sqlite"] = await check(stores.idempotency)
    async with redis_stores() as stores:
        seen["redis"] = await check(stores.idempotency)
    async with postgres_schema() as name, postgres_stores_applied(schema_url(name)) as stores:
        seen["postgres"] = await check(stores.idempotency)
    return seen
