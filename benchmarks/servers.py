"""The servers the benchmarks run against, each in a corner of its own.

- Redis: a throwaway ``redis-server`` started here on a free loopback port, with
  ``appendonly yes`` and the ``appendfsync`` asked for (``everysec`` or ``always``), in a
  temporary directory, stopped after. The shared server on 6379 runs without persistence
  (the kit refuses it unless ``allow_volatile=true``), so it is never what we measure.
- PostgreSQL: ``ADK_TEST_POSTGRES_URL`` (default ``postgresql://postgres@127.0.0.1:5432/test``),
  in a schema of the benchmark's own (``search_path`` in the URL), dropped after.

``redis_corner()`` and ``postgres_corner()`` are the async forms the other benchmarks
(``workers.py``, ``parallel_calls.py``) use: ``(url, cleanup)``.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from urllib.parse import quote, urlencode

POSTGRES_URL = os.environ.get("ADK_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test")


class Unreachable(Exception):
    """A server the benchmark needs cannot be had; the backend is left out, and said so."""


def _with_query(url: str, **options: str) -> str:
    query = urlencode(options, quote_via=quote)
    return f"{url}{'&' if '?' in url else '?'}{query}"


# --- Redis -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RedisServer:
    port: int
    pid: int
    appendfsync: str
    directory: str

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def redis_server(appendfsync: str = "everysec") -> Iterator[RedisServer]:
    """A throwaway persistent Redis (AOF on, ``appendfsync`` as asked) on a free port."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise Unreachable("redis-server is not installed")
    directory = tempfile.mkdtemp(prefix="tesserix-bench-redis-")
    port = _free_port()
    proc = subprocess.Popen(
        [
            binary,
            "--bind",
            "127.0.0.1",
            "--port",
            str(port),
            "--dir",
            directory,
            "--appendonly",
            "yes",
            "--appendfsync",
            appendfsync,
            "--save",
            "",
            "--auto-aof-rewrite-percentage",
            "0",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise Unreachable(f"redis-server did not start on port {port}") from None
                time.sleep(0.05)
        yield RedisServer(port=port, pid=proc.pid, appendfsync=appendfsync, directory=directory)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(directory, ignore_errors=True)


async def redis_corner() -> tuple[str, Callable[[], Awaitable[None]]]:
    """A throwaway AOF (``everysec``) Redis for the other benchmarks: its URL and cleanup."""
    stack = contextlib.ExitStack()
    server = stack.enter_context(redis_server("everysec"))

    async def cleanup() -> None:
        stack.close()

    return _with_query(server.url, prefix=f"adkbench-{secrets.token_hex(4)}:"), cleanup


# --- PostgreSQL --------------------------------------------------------------------------


def postgres_reachable() -> str | None:
    """Why PostgreSQL cannot be used, or ``None``."""
    try:
        import psycopg
    except ImportError:
        return 'psycopg is not installed (pip install -e ".[postgres]")'
    try:
        psycopg.connect(POSTGRES_URL, connect_timeout=3).close()
    except psycopg.Error as exc:
        return f"PostgreSQL at {POSTGRES_URL}: {exc}".strip()
    return None


@contextlib.contextmanager
def postgres_schema() -> Iterator[tuple[str, str]]:
    """A schema of our own: ``(url with search_path, schema name)``; dropped after."""
    import psycopg

    schema = f"adkbench_{secrets.token_hex(6)}"
    try:
        admin = psycopg.connect(POSTGRES_URL, autocommit=True, connect_timeout=3)
    except psycopg.Error as exc:
        raise Unreachable(f"PostgreSQL at {POSTGRES_URL}: {exc}") from exc
    with admin:
        admin.execute(f'CREATE SCHEMA "{schema}"')
        try:
            yield _with_query(POSTGRES_URL, options=f"-csearch_path={schema}"), schema
        finally:
            admin.execute(f'DROP SCHEMA "{schema}" CASCADE')


def postgres_schema_bytes(schema: str) -> int:
    """Every table of ``schema`` with its indexes and TOAST, in bytes."""
    import psycopg

    with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
        row = conn.execute(
            "SELECT coalesce(sum(pg_total_relation_size(c.oid)), 0) FROM pg_class c "
            "JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE n.nspname = %s AND c.relkind IN ('r', 'm')",
            (schema,),
        ).fetchone()
    return int(row[0]) if row else 0


async def postgres_corner() -> tuple[str, Callable[[], Awaitable[None]]]:
    """A schema of our own for the other benchmarks: its URL and cleanup."""
    stack = contextlib.ExitStack()
    url, _ = stack.enter_context(postgres_schema())

    async def cleanup() -> None:
        stack.close()

    return url, cleanup
