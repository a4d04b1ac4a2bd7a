"""Helpers for tests that run real OS processes: workers, the console script, SIGKILL."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any, TypeVar

import pytest

from adapters import services
from adapters.cluster import ThrowawayCluster, delete_prefixed
from adapters.pooler import pgbouncer
from tesserix_adk.cli.demo_agent import AIRLINE_ENV, airline_bookings, create_airline
from tesserix_adk.stores.urls import open_stores

TENANT = "demo"
AGENT = "tesserix_adk.cli.demo_agent:agent"

# Every durable backend, as pytest parameters marked with the server they need.
BACKENDS = [
    pytest.param("sqlite", id="sqlite"),
    pytest.param("redis", id="redis", marks=pytest.mark.redis),
    pytest.param("postgres", id="postgres", marks=pytest.mark.postgres),
]
# A three-master Redis Cluster of the session's own: added to the representative crash tests
# only (it needs the ``redis_cluster`` fixture; see ``store_url``).
REDIS_CLUSTER = pytest.param("redis-cluster", id="redis-cluster", marks=pytest.mark.redis)
# The test PostgreSQL behind a PgBouncer of the test's own in transaction mode (the URL names
# its schema with schema= and turns prepared statements off): the representative tests only.
POSTGRES_PGBOUNCER = pytest.param(
    "postgres-pgbouncer", id="postgres-pgbouncer", marks=pytest.mark.postgres
)

T = TypeVar("T")


@asynccontextmanager
async def store_url(
    backend: str, tmp: Path, cluster: ThrowawayCluster | None = None
) -> AsyncIterator[str]:
    """A store URL on ``backend`` that no other test shares, cleaned up afterwards.

    SQLite: a file in ``tmp``. Redis: a fresh key prefix (its keys deleted after), with
    ``allow_volatile=true`` because the local server runs without persistence. PostgreSQL: a
    fresh schema chosen with ``options=-csearch_path%3D…`` (dropped CASCADE after). Redis
    Cluster: a fresh key prefix on ``cluster`` (whose nodes keep AOF, so no
    ``allow_volatile``), its keys deleted after. PostgreSQL behind PgBouncer: a fresh schema
    named by ``schema=``, through a PgBouncer started for the test (stopped after). The URL
    is plain text, so it passes through a subprocess's argv and environment unchanged. An
    unreachable server skips the test (fails it under CI=true). No schema is applied here.
    """
    if backend == "sqlite":
        yield f"sqlite:///{tmp / 'adk.sqlite3'}"
    elif backend == "redis":
        client = await services.redis_client()
        prefix = services.redis_prefix()
        try:
            yield services.with_query(services.REDIS_URL, prefix=prefix, allow_volatile="true")
        finally:
            try:
                await services.delete_prefixed(client, prefix)
            finally:
                await client.aclose()
    elif backend == "postgres":
        async with services.postgres_schema() as schema:
            yield services.schema_url(schema)
    elif backend == "postgres-pgbouncer":
        async with services.postgres_schema() as schema:
            with pgbouncer() as bouncer:
                yield bouncer.stores_url(schema)
    elif backend == "redis-cluster":
        assert cluster is not None, "the redis-cluster backend needs the redis_cluster fixture"
        prefix = services.redis_prefix()
        try:
            yield services.with_query(cluster.url, prefix=prefix)
        finally:
            await delete_prefixed(cluster, prefix)
    else:
        raise ValueError(f"unknown backend {backend!r}")


@contextmanager
def held_open(context: AbstractAsyncContextManager[T]) -> Iterator[T]:
    """An async context held open around synchronous code, on an event loop of its own.

    The loop sits idle in between, so the code inside may call ``asyncio.run`` itself.
    """
    with asyncio.Runner() as runner:
        value = runner.run(context.__aenter__())
        try:
            yield value
        except BaseException as exc:
            if not runner.run(context.__aexit__(type(exc), exc, exc.__traceback__)):
                raise
        else:
            runner.run(context.__aexit__(None, None, None))


class Site:
    """A store URL and an airline file shared by every process of one test."""

    def __init__(self, tmp: Path, store: str | None = None) -> None:
        self.tmp = tmp
        self.store = store or f"sqlite:///{tmp / 'adk.sqlite3'}"
        self.airline = str(tmp / "airline.sqlite3")
        create_airline(self.airline)
        self.env = {**os.environ, AIRLINE_ENV: self.airline, "ADK_STORE": self.store}
        self.env.pop("ADK_DEMO_PAUSE", None)
        asyncio.run(self._apply_schema())

    async def _apply_schema(self) -> None:
        async with open_stores(self.store) as stores:
            await stores.create_schema()

    def bookings(self, run_id: str) -> int:
        return len(airline_bookings(self.airline, run_id))

    def worker(self, run_id: str, *extra: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tesserix_adk.cli.worker",
                "--store",
                self.store,
                "--run",
                run_id,
                "--tenant",
                TENANT,
                *extra,
            ],
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def kill_at(self, run_id: str, pause: str, *extra: str) -> None:
        """Run a worker to ``pause`` and SIGKILL it there."""
        proc = self.worker(run_id, "--pause", pause, "--lease-ttl", "1", *extra)
        assert proc.stdout is not None
        line = proc.stdout.readline().strip()
        if line != f"PAUSED {pause}":
            proc.kill()
            _, err = proc.communicate(timeout=10)
            raise AssertionError(f"worker did not reach {pause}: {line!r} {err}")
        os.kill(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=10)
        assert proc.returncode == -signal.SIGKILL

    def wait_lease_lapsed(self, run_id: str, timeout: float = 10.0) -> None:
        async def current() -> Any:
            async with open_stores(self.store) as stores:
                return await stores.leases.current(TENANT, run_id)

        deadline = time.monotonic() + timeout
        while asyncio.run(current()) is not None:
            assert time.monotonic() < deadline, "lease never lapsed"
            time.sleep(0.05)

    def tesserix(
        self, *args: str, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        """The console script, as a real subprocess."""
        return subprocess.run(
            [sys.executable, "-m", "tesserix_adk", *args],
            env=env or self.env,
            capture_output=True,
            text=True,
            timeout=120,
        )
