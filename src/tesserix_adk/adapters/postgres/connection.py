"""The database the PostgreSQL stores share: a psycopg 3 pool, its bounds, and driver errors.

``PostgresDatabase`` owns an ``AsyncConnectionPool`` (opened on first use). Every call is one
transaction of its own, begun as ``BEGIN ISOLATION LEVEL READ COMMITTED`` with its
``statement_timeout`` and ``lock_timeout`` set ``LOCAL``: nothing the kit needs lives in the
session, so a transaction pooler (PgBouncer, a managed pooler) that hands each transaction
to another server connection, or a server or pooler whose default isolation is
SERIALIZABLE, changes nothing, and the kit leaves no setting behind on a shared server
connection. Every decision — a fence, a claim, a lease — is one statement; time that decides
anything is the server's ``clock_timestamp()``, never the caller's. It also applies and
checks the schema (``schema.py``): ``create_schema()`` (what ``tesserix schema apply`` runs)
does, idempotently and safely from several processes at once (an advisory lock serialises
it), and changes nothing (so needs no CREATE privilege) when the schema is already current;
``verify()`` checks the version. Tables live in the schema the URL's ``schema=`` names, else
in the first schema of the connection's search_path.

Bounds. Every call has a client-side deadline, ``timeout`` seconds (URL ``?timeout=``,
default 5 s, kept well below the default 30 s lease ttl), for getting a connection and again
for the statement. Each transaction sets ``statement_timeout`` and ``lock_timeout`` below
that deadline (so the server cancels, and rolls back, a statement it can before the client
gives up on it); each connection has TCP keepalives with ``tcp_user_timeout`` (so a dead
peer is noticed); options given in the URL win. Errors say whether the outcome is unknown:
no connection could be had, or the server cancelled or rolled the statement back
(``statement_timeout``, ``lock_timeout``, a deadlock) — ``StoreUnavailableError``; the
statement was sent and then the connection was lost or the deadline passed —
``StoreReplyLostError``. A refusal that is a setting to fix (a role, password or database
that does not exist, a pooler refusing a startup parameter, a missing privilege) is a
``ConfigurationError``.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Mapping
from typing import Any

try:
    import psycopg
    from psycopg.conninfo import conninfo_to_dict
    from psycopg_pool import AsyncConnectionPool
except ImportError as exc:  # pragma: no cover - exercised in a subprocess test
    raise ImportError(
        "tesserix_adk.adapters.postgres needs psycopg 3 and psycopg-pool: "
        'pip install "tesserix-adk[postgres]"'
    ) from exc

from tesserix_adk.adapters.postgres.driver import (
    Row,
    alone,
    begin_statements,
    driver_errors,
    transaction,
)
from tesserix_adk.adapters.postgres.grouping import PostgresWriteGroup
from tesserix_adk.adapters.postgres.prepared import PreparedStatements
from tesserix_adk.adapters.postgres.schema import APPLY, SCHEMA_LOCK_CLASS, TABLES, Schema
from tesserix_adk.adapters.postgres.statements import qualified_tables, qualify
from tesserix_adk.errors import ConfigurationError, SchemaMismatchError, StoreReplyLostError
from tesserix_adk.stores.grouping import joined

__all__ = ["DEFAULT_TIMEOUT", "Pool", "PostgresDatabase", "Row"]

Pool = AsyncConnectionPool[psycopg.AsyncConnection[Any]]

# Seconds: the client-side deadline of every call, unless the URL says ``timeout=``.
DEFAULT_TIMEOUT = 5.0
# Runs of a statement as text on a connection before the kit prepares it there (psycopg's
# own default for its own preparing, which is off on the kit's connections: ``prepared``).
PREPARE_THRESHOLD = 5
# A connection refused for one of these is a setting to fix, not an outage: by the server
# (unknown database or role, bad password, no CONNECT privilege) or by a pooler (PgBouncer's
# words for an unknown database or user, and for a startup parameter it does not pass on).
_MISCONFIGURED = (
    "does not exist",
    "authentication failed",
    "no pg_hba.conf entry",
    "password is required",
    "permission denied",
    "no such database",
    "no such user",
    "is not permitted to log in",
    "unsupported startup parameter",
)
# What to do instead when a pooler refuses the ``options`` startup parameter.
_NO_OPTIONS = (
    "; a transaction pooler takes no options= startup parameter: name the schema with the "
    "URL's schema= option and turn prepared statements off with prepare_threshold=none"
)


async def _autocommit(conn: psycopg.AsyncConnection[Any]) -> None:
    # Each call begins and ends its own transaction (``transaction``); no session setting.
    await conn.set_autocommit(True)


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
        self,
        pool: Pool,
        *,
        conninfo: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        schema: str | None = None,
        prepare_threshold: int | None = PREPARE_THRESHOLD,
    ) -> None:
        if not (timeout > 0 and math.isfinite(timeout)):
            raise ConfigurationError(f"timeout must be a positive number of seconds, got {timeout}")
        self.pool = pool
        self.conninfo = conninfo
        # Seconds each call may wait for a connection, and then for its statement's reply.
        self.timeout = float(timeout)
        # The schema this kit applies and reads, from the package's migrations/ folder, its
        # tables qualified by ``schema`` when one is named (checked: ConfigurationError).
        self.schema = Schema.load(schema)
        self.tables = qualified_tables(schema)
        # Runs of a statement as text on a connection before the kit prepares it there, on
        # direct connections only (``prepared``); None: never (behind a transaction pooler,
        # as prepared statements live in one session).
        self.prepare_threshold = prepare_threshold
        self.prepared = None if prepare_threshold is None else PreparedStatements(prepare_threshold)
        self.begin_statements = begin_statements(self.timeout)
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
        schema: str | None = None,
        prepare_threshold: int | None = PREPARE_THRESHOLD,
    ) -> PostgresDatabase:
        """A database over a new pool on ``conninfo`` (a URL or key=value string); no I/O.

        ``schema`` qualifies the kit's tables (else the search_path decides);
        ``prepare_threshold=None`` never prepares a statement (behind a transaction pooler).
        Its connections carry TCP keepalives (a pool built by hand does not)."""
        if pool_min < 0 or pool_max < 1 or pool_max < pool_min:
            raise ConfigurationError(
                f"pool_min must be at least 0 and pool_max at least 1 and at least pool_min, "
                f"got pool_min={pool_min} and pool_max={pool_max}"
            )
        if not (timeout > 0 and math.isfinite(timeout)):
            raise ConfigurationError(f"timeout must be a positive number of seconds, got {timeout}")
        if prepare_threshold is not None and prepare_threshold < 0:
            raise ConfigurationError(
                f"prepare_threshold must be None or at least 0, got {prepare_threshold}"
            )
        pool: Pool = AsyncConnectionPool(
            conninfo,
            kwargs={
                **_socket_options(conninfo, timeout),
                # The kit prepares its statements itself (``prepared``): psycopg never.
                "prepare_threshold": None,
            },
            min_size=pool_min,
            max_size=pool_max,
            open=False,
            configure=_autocommit,
            # How long a statement waits for a connection: a stopped server should fail a
            # write as unavailable soon, so the live run can carry on without it.
            timeout=timeout,
            name="tesserix-adk",
        )
        return cls(
            pool,
            conninfo=conninfo,
            timeout=timeout,
            schema=schema,
            prepare_threshold=prepare_threshold,
        )

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
                self.conninfo,
                autocommit=True,
                prepare_threshold=self.prepare_threshold,
                **_socket_options(self.conninfo, self.timeout),
            )
        except psycopg.OperationalError as exc:
            text = " ".join(str(exc).split())
            if any(mark in text for mark in _MISCONFIGURED):
                hint = _NO_OPTIONS if "unsupported startup parameter" in text else ""
                raise ConfigurationError(
                    f"PostgreSQL refused the connection: {text}{hint}"
                ) from exc
            raise
        try:
            scs = conn.info.parameter_status("standard_conforming_strings")
        finally:
            await conn.close()
        if scs is not None and scs != "on":
            # Arrays of bytes (a transcript append) would be stored escaped twice, as
            # other bytes than those written, and their digests would not tell.
            raise ConfigurationError(
                "PostgreSQL has standard_conforming_strings set to "
                f"{scs!r}; tesserix-adk needs it on (the default since PostgreSQL 9.1)"
            )

    def write_group(self) -> PostgresWriteGroup:
        """A new write group on this database (``protocols.grouping``)."""
        return PostgresWriteGroup(self)

    async def rows(self, action: str, sql: str, params: Mapping[str, Any]) -> list[Row]:
        """Run one statement on a pooled connection and return its rows as dicts; waits at
        most ``timeout`` for a connection and ``timeout`` for the reply. Inside the
        caller's open write group it runs in the group's transaction instead."""
        group = joined(self)
        if isinstance(group, PostgresWriteGroup):
            return await group.rows(action, sql, params)
        with driver_errors(action) as call:
            await self._open()
            async with self.pool.connection(timeout=self.timeout) as conn:
                call.sent = True
                try:
                    async with asyncio.timeout(self.timeout):
                        return await alone(conn, self.begin_statements, sql, params, self.prepared)
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
        """Create or upgrade the tables in the URL's ``schema=`` (else the search_path's
        first schema); idempotent, safe to run from several processes at once, and a no-op
        that needs no CREATE privilege when the schema is already at this kit's version."""
        with driver_errors("applying the schema") as call:
            await self._open()
            async with (
                self.pool.connection(timeout=self.timeout) as conn,
                transaction(conn, self.begin_statements),
            ):
                call.sent = True
                schema = await self._target_schema(conn)
                await conn.execute(
                    "SELECT pg_advisory_xact_lock(%s::integer, hashtext(%s))",
                    (SCHEMA_LOCK_CLASS, schema),
                )
                cur = await conn.execute(
                    "SELECT t FROM unnest(%s::text[]) AS t WHERE to_regclass(t) IS NULL",
                    (list(self.tables),),
                )
                missing = [row[0] for row in await cur.fetchall()]
                version = 0
                if self.tables[0] not in missing:
                    cur = await conn.execute(self._version_query)
                    found = await cur.fetchone()
                    version = 0 if found is None else int(found[0])
                if version > self.schema.version:
                    raise ConfigurationError(
                        f"schema {schema!r} is at version {version}, newer than the "
                        f"{self.schema.version} this tesserix-adk applies; upgrade tesserix-adk"
                    )
                if version == self.schema.version and not missing:
                    return  # current: nothing to create, so no CREATE privilege is needed
                await conn.execute(self.schema.version_table)
                # A table dropped by hand is put back: every migration is idempotent, so
                # running them all again repairs it without touching what is there.
                start = 0 if missing else version
                for migration in self.schema.migrations[start:]:
                    await conn.execute(migration)
                await conn.execute(
                    qualify(
                        "INSERT INTO adk_schema_version (id, version) VALUES (1, %s::integer) "
                        "ON CONFLICT (id) DO UPDATE SET version = EXCLUDED.version, "
                        "applied_at = clock_timestamp()",
                        self.schema.schema,
                    ),
                    (self.schema.version,),
                )

    @property
    def _version_query(self) -> str:
        return qualify("SELECT version FROM adk_schema_version WHERE id = 1", self.schema.schema)

    async def _target_schema(self, conn: psycopg.AsyncConnection[Any]) -> str:
        """The schema the tables are in: the one ``schema=`` names, which must exist, or
        the search_path's first that exists."""
        named = self.schema.schema
        if named is not None:
            cur = await conn.execute(
                "SELECT nspname FROM pg_namespace WHERE nspname = %s", (named,)
            )
            if await cur.fetchone() is None:
                raise ConfigurationError(
                    f"the schema {named!r} the store URL names does not exist; create it "
                    f'first (CREATE SCHEMA "{named}", as a role allowed to), then apply the '
                    "kit's tables"
                )
            return named
        cur = await conn.execute("SELECT current_schema()")
        found = await cur.fetchone()
        if found is None or found[0] is None:
            raise ConfigurationError(
                "no schema of the connection's search_path exists; create it first "
                "(CREATE SCHEMA …) or name one with the store URL's schema= option"
            )
        return str(found[0])

    async def verify(self) -> None:
        """Check every table is there at this kit's schema version (``ConfigurationError``
        naming ``tesserix schema apply`` if not)."""
        row = await self.row(
            "checking the schema",
            "SELECT coalesce(%(schema)s::text, current_schema()) AS schema, "
            "array(SELECT t FROM unnest(%(tables)s::text[]) AS t "
            "      WHERE to_regclass(t) IS NULL) AS missing",
            {"schema": self.schema.schema, "tables": list(self.tables)},
        )
        assert row is not None
        where = f"schema {row['schema']!r}" if row["schema"] else "the search_path"
        bare = dict(zip(self.tables, TABLES, strict=True))
        missing: list[str] = [bare[t] for t in row["missing"]]
        if "adk_schema_version" in missing:
            raise SchemaMismatchError(
                f"the tesserix-adk schema is missing from {where} (this kit needs version "
                f"{self.schema.version}); {APPLY}"
            )
        found = await self.row("checking the schema", self._version_query, {})
        version = 0 if found is None else int(found["version"])
        if version > self.schema.version:
            raise SchemaMismatchError(
                f"the tesserix-adk schema in {where} is at version {version}, newer than the "
                f"{self.schema.version} this kit reads; upgrade tesserix-adk"
            )
        if version < self.schema.version:
            raise SchemaMismatchError(
                f"the tesserix-adk schema in {where} is at version {version}, older than the "
                f"{self.schema.version} this kit needs; {APPLY}"
            )
        if missing:
            raise SchemaMismatchError(
                f"the tesserix-adk schema in {where} lacks {', '.join(missing)}; {APPLY}"
            )

    async def aclose(self) -> None:
        """Close the pool; idempotent."""
        self._closed = True
        if not self.pool.closed:
            await self.pool.close()
