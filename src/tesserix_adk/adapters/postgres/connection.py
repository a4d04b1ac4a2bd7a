"""The database the PostgreSQL stores share: a psycopg 3 pool, its bounds, and driver errors.

``PostgresDatabase`` owns an ``AsyncConnectionPool`` (opened on first use) whose connections
are pinned to autocommit at READ COMMITTED: every statement is its own transaction, so no
refusal ever leaves one open. Every decision — a fence, a claim, a lease — is one statement;
time that decides anything is the server's ``clock_timestamp()``, never the caller's. It also
applies and checks the schema (``schema.py``): ``create_schema()`` (what ``tesserix schema
apply`` runs) does, idempotently and safely from several processes at once (an advisory lock
serialises it); ``verify()`` checks the version. Tables live in the first schema of the
connection's search_path, which a URL chooses with ``options=-csearch_path%3D<schema>``.

Bounds. Every call has a client-side deadline, ``timeout`` seconds (URL ``?timeout=``,
default 5 s, kept well below the default 30 s lease ttl), for getting a connection and again
for the statement. Each pooled connection sets ``statement_timeout`` and ``lock_timeout``
below that deadline (so the server cancels, and rolls back, a statement it can before the
client gives up on it) and TCP keepalives with ``tcp_user_timeout`` (so a dead peer is
noticed); options given in the URL win. Errors say whether the outcome is unknown: no
connection could be had, or the server cancelled or rolled the statement back
(``statement_timeout``, ``lock_timeout``, a deadlock) — ``StoreUnavailableError``; the
statement was sent and then the connection was lost or the deadline passed —
``StoreReplyLostError``.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

try:
    import psycopg
    from psycopg import errors as pg_errors
    from psycopg.conninfo import conninfo_to_dict
    from psycopg.rows import dict_row
    from psycopg_pool import AsyncConnectionPool
except ImportError as exc:  # pragma: no cover - exercised in a subprocess test
    raise ImportError(
        "tesserix_adk.adapters.postgres needs psycopg 3 and psycopg-pool: "
        'pip install "tesserix-adk[postgres]"'
    ) from exc

from tesserix_adk.adapters.postgres.schema import APPLY, SCHEMA_LOCK_CLASS, TABLES, Schema
from tesserix_adk.errors import ConfigurationError, StoreReplyLostError, StoreUnavailableError

__all__ = ["DEFAULT_TIMEOUT", "Pool", "PostgresDatabase", "Row"]

Pool = AsyncConnectionPool[psycopg.AsyncConnection[Any]]
Row = dict[str, Any]

# Seconds: the client-side deadline of every call, unless the URL says ``timeout=``.
DEFAULT_TIMEOUT = 5.0
# The server's own bounds, as fractions of the deadline: a statement the server can cancel
# is cancelled (and rolled back, outcome known) before the client stops waiting for it.
_STATEMENT_SHARE = 0.8
_LOCK_SHARE = 0.6

_MISCONFIGURED = (
    "does not exist",
    "authentication failed",
    "no pg_hba.conf entry",
    "password is required",
)


class _Call:
    """Whether the statement of the call in progress was handed to the server."""

    __slots__ = ("sent",)

    def __init__(self) -> None:
        self.sent = False


@contextmanager
def _driver_errors(action: str) -> Iterator[_Call]:
    """Translate psycopg errors into the kit's, once, at the boundary, saying whether the
    outcome is unknown (``call.sent`` and no reply) or certainly nothing happened."""
    call = _Call()
    try:
        yield call
    except pg_errors.UndefinedTable as exc:
        raise ConfigurationError(
            f"a tesserix-adk table is missing while {action} ({exc.diag.message_primary}); {APPLY}"
        ) from exc
    except (pg_errors.InsufficientPrivilege, pg_errors.InvalidSchemaName) as exc:
        raise ConfigurationError(f"PostgreSQL refused {action}: {exc}") from exc
    except (
        pg_errors.QueryCanceled,
        pg_errors.LockNotAvailable,
        pg_errors.TransactionRollback,
    ) as exc:
        # The server answered: it cancelled or rolled the statement back, whole.
        raise StoreUnavailableError(
            f"PostgreSQL gave up on {action} and rolled it back ({exc.diag.message_primary})"
        ) from exc
    except (psycopg.OperationalError, psycopg.InterfaceError) as exc:
        if call.sent:
            raise StoreReplyLostError(
                f"PostgreSQL lost the connection while {action}, after the statement was "
                f"sent; it may have been applied: {exc}"
            ) from exc
        raise StoreUnavailableError(
            f"PostgreSQL could not be reached while {action}: {exc}"
        ) from exc
    except psycopg.Error as exc:
        raise StoreUnavailableError(
            f"PostgreSQL failed while {action}: {exc}", retryable=False
        ) from exc


def _configurer(timeout: float) -> Callable[[psycopg.AsyncConnection[Any]], Awaitable[None]]:
    statement_ms = max(1, int(timeout * _STATEMENT_SHARE * 1000))
    lock_ms = max(1, int(timeout * _LOCK_SHARE * 1000))

    async def configure(conn: psycopg.AsyncConnection[Any]) -> None:
        # Pinned on every pooled connection: each statement commits on its own, at READ
        # COMMITTED whatever the server's default, and explicit transactions use it too.
        await conn.set_autocommit(True)
        await conn.set_isolation_level(psycopg.IsolationLevel.READ_COMMITTED)
        await conn.execute(
            "SET SESSION CHARACTERISTICS AS TRANSACTION ISOLATION LEVEL READ COMMITTED"
        )
        await conn.execute(f"SET statement_timeout = {statement_ms}")
        await conn.execute(f"SET lock_timeout = {lock_ms}")

    return configure


def _socket_options(conninfo: str, timeout: float) -> dict[str, Any]:
    """Keepalives and a connect timeout for libpq, except where ``conninfo`` sets its own."""
    given = conninfo_to_dict(conninfo) if conninfo else {}
    wanted: dict[str, Any] = {
        "connect_timeout": max(2, math.ceil(timeout)),
        "keepalives": 1,
        "keepalives_idle": max(1, math.ceil(timeout)),
        "keepalives_interval": 1,
        "keepalives_count": 3,
        # Unacknowledged data past this (ms) drops the connection: a peer gone mid-reply.
        "tcp_user_timeout": max(1000, int(timeout * 2000)),
    }
    return {name: value for name, value in wanted.items() if name not in given}


class PostgresDatabase:
    """A connection pool the stores share, opened on first use; schema and lifetime."""

    def __init__(
        self, pool: Pool, *, conninfo: str | None = None, timeout: float = DEFAULT_TIMEOUT
    ) -> None:
        if not (timeout > 0 and math.isfinite(timeout)):
            raise ConfigurationError(f"timeout must be a positive number of seconds, got {timeout}")
        self.pool = pool
        self.conninfo = conninfo
        # Seconds each call may wait for a connection, and then for its statement's reply.
        self.timeout = float(timeout)
        # The schema this kit applies and reads, from the package's migrations/ folder.
        self.schema = Schema.load()
        self._opening = asyncio.Lock()
        self._closed = False

    @classmethod
    def from_url(
        cls,
        conninfo: str,
        *,
        pool_min: int = 1,
        pool_max: int = 4,
        timeout: float = DEFAULT_TIMEOUT,
    ) -> PostgresDatabase:
        """A database over a new pool on ``conninfo`` (a URL or key=value string); no I/O.

        Its connections carry ``statement_timeout``/``lock_timeout`` below ``timeout`` and
        TCP keepalives (a pool built by hand gets only the client-side deadline)."""
        if pool_min < 0 or pool_max < 1 or pool_max < pool_min:
            raise ConfigurationError(
                f"pool_min must be at least 0 and pool_max at least 1 and at least pool_min, "
                f"got pool_min={pool_min} and pool_max={pool_max}"
            )
        if not (timeout > 0 and math.isfinite(timeout)):
            raise ConfigurationError(f"timeout must be a positive number of seconds, got {timeout}")
        pool: Pool = AsyncConnectionPool(
            conninfo,
            kwargs=_socket_options(conninfo, timeout),
            min_size=pool_min,
            max_size=pool_max,
            open=False,
            configure=_configurer(timeout),
            # How long a statement waits for a connection: a stopped server should fail a
            # write as unavailable soon, so the live run can carry on without it.
            timeout=timeout,
            name="tesserix-adk",
        )
        return cls(pool, conninfo=conninfo, timeout=timeout)

    async def _open(self) -> None:
        if self._closed:
            raise ConfigurationError("the PostgreSQL stores were closed")
        if self.pool.closed:
            async with self._opening:
                if self.pool.closed:
                    await self._probe()
                    await self.pool.open()

    async def _probe(self) -> None:
        """One direct connection first: a pool only logs why it cannot connect, and a
        database, role or password that does not exist is a setting to fix, not an outage."""
        if self.conninfo is None:
            return
        try:
            conn = await psycopg.AsyncConnection.connect(
                self.conninfo, autocommit=True, **_socket_options(self.conninfo, self.timeout)
            )
        except psycopg.OperationalError as exc:
            text = " ".join(str(exc).split())
            if any(mark in text for mark in _MISCONFIGURED):
                raise ConfigurationError(f"PostgreSQL refused the connection: {text}") from exc
            raise
        await conn.close()

    async def rows(self, action: str, sql: str, params: Mapping[str, Any]) -> list[Row]:
        """Run one statement on a pooled connection and return its rows as dicts; waits at
        most ``timeout`` for a connection and ``timeout`` for the reply."""
        with _driver_errors(action) as call:
            await self._open()
            async with (
                self.pool.connection(timeout=self.timeout) as conn,
                conn.cursor(row_factory=dict_row) as cur,
            ):
                call.sent = True
                try:
                    async with asyncio.timeout(self.timeout):
                        await cur.execute(sql, params)
                        return await cur.fetchall() if cur.description is not None else []
                except TimeoutError as exc:
                    raise StoreReplyLostError(
                        f"PostgreSQL did not answer {action} within {self.timeout:g} s; the "
                        f"statement may have been applied"
                    ) from exc

    async def row(self, action: str, sql: str, params: Mapping[str, Any]) -> Row | None:
        """Run one statement and return its first row, if any."""
        rows = await self.rows(action, sql, params)
        return rows[0] if rows else None

    async def create_schema(self) -> None:
        """Create or upgrade the tables in the search_path's first schema; idempotent, and
        safe to run from several processes at once."""
        with _driver_errors("applying the schema") as call:
            await self._open()
            async with self.pool.connection(timeout=self.timeout) as conn, conn.transaction():
                call.sent = True
                cur = await conn.execute("SELECT current_schema()")
                found = await cur.fetchone()
                schema = None if found is None else found[0]
                if schema is None:
                    raise ConfigurationError(
                        "no schema of the connection's search_path exists; create it first "
                        "(CREATE SCHEMA …) or choose another with options=-csearch_path%3D…"
                    )
                await conn.execute(
                    "SELECT pg_advisory_xact_lock(%s::integer, hashtext(current_schema()))",
                    (SCHEMA_LOCK_CLASS,),
                )
                await conn.execute(self.schema.version_table)
                cur = await conn.execute("SELECT version FROM adk_schema_version WHERE id = 1")
                found = await cur.fetchone()
                version = 0 if found is None else int(found[0])
                if version > self.schema.version:
                    raise ConfigurationError(
                        f"schema {schema!r} is at version {version}, newer than the "
                        f"{self.schema.version} this tesserix-adk applies; upgrade tesserix-adk"
                    )
                cur = await conn.execute(
                    "SELECT count(*) FROM unnest(%s::text[]) AS t WHERE to_regclass(t) IS NULL",
                    (list(TABLES),),
                )
                missing = await cur.fetchone()
                # A table dropped by hand is put back: every migration is idempotent, so
                # running them all again repairs it without touching what is there.
                start = 0 if missing is not None and missing[0] else version
                for migration in self.schema.migrations[start:]:
                    await conn.execute(migration)
                await conn.execute(
                    "INSERT INTO adk_schema_version (id, version) VALUES (1, %s::integer) "
                    "ON CONFLICT (id) DO UPDATE SET version = EXCLUDED.version, "
                    "applied_at = clock_timestamp()",
                    (self.schema.version,),
                )

    async def verify(self) -> None:
        """Check every table is there at this kit's schema version (``ConfigurationError``
        naming ``tesserix schema apply`` if not)."""
        row = await self.row(
            "checking the schema",
            "SELECT current_schema() AS schema, "
            "array(SELECT t FROM unnest(%(tables)s::text[]) AS t "
            "      WHERE to_regclass(t) IS NULL) AS missing",
            {"tables": list(TABLES)},
        )
        assert row is not None
        where = f"schema {row['schema']!r}" if row["schema"] else "the search_path"
        missing: list[str] = list(row["missing"])
        if "adk_schema_version" in missing:
            raise ConfigurationError(
                f"the tesserix-adk schema is missing from {where} (this kit needs version "
                f"{self.schema.version}); {APPLY}"
            )
        found = await self.row(
            "checking the schema", "SELECT version FROM adk_schema_version WHERE id = 1", {}
        )
        version = 0 if found is None else int(found["version"])
        if version > self.schema.version:
            raise ConfigurationError(
                f"the tesserix-adk schema in {where} is at version {version}, newer than the "
                f"{self.schema.version} this kit reads; upgrade tesserix-adk"
            )
        if version < self.schema.version:
            raise ConfigurationError(
                f"the tesserix-adk schema in {where} is at version {version}, older than the "
                f"{self.schema.version} this kit needs; {APPLY}"
            )
        if missing:
            raise ConfigurationError(
                f"the tesserix-adk schema in {where} lacks {', '.join(missing)}; {APPLY}"
            )

    async def aclose(self) -> None:
        """Close the pool; idempotent."""
        self._closed = True
        if not self.pool.closed:
            await self.pool.close()
