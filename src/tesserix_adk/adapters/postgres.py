"""PostgreSQL stores: every protocol of ``stores.protocols`` in one database (psycopg 3).

``PostgresDatabase`` owns an ``AsyncConnectionPool`` (opened on first use) whose connections
are pinned to autocommit at READ COMMITTED: every statement is its own transaction, so no
refusal ever leaves one open. Every decision — a fence, a claim, a lease — is one statement;
time that decides anything is the server's ``clock_timestamp()``, never the caller's.

Fences. ``adk_fences`` keeps the highest fence each kind of store has seen per run. A fenced
write is one statement whose first part upserts that row (which locks it, serialising the
run's writes) only if the write's fence is at least the highest seen *and* at least the
run's current lease fence in ``adk_run_leases``; its data parts run only if that row came
back. So a takeover fences the old holder out at once, without waiting for a seal.

Schema. ``EXPECTED_CHECKPOINT_SCHEMA`` is the whole DDL; ``MIGRATIONS[i]`` takes a database
from version ``i`` to ``i + 1`` (``SCHEMA_VERSION`` is their number). Nothing applies them
implicitly: ``create_schema()`` (what ``tesserix schema apply`` runs) does, idempotently
and safely from several processes at once (an advisory lock serialises it); ``verify()``
checks the version. Tables live in the first schema of the connection's search_path, which
a URL chooses with ``options=-csearch_path%3D<schema>``.

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
import json
import math
import secrets
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any
from urllib.parse import unquote

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

from tesserix_adk.errors import (
    ConfigurationError,
    HistoryUnavailableError,
    LeaseHeldError,
    LeaseLostError,
    StaleFenceError,
    StoreReplyLostError,
    StoreUnavailableError,
)
from tesserix_adk.messages import ToolCall, Usage
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.stores.protocols import (
    EMPTY_HISTORY_DIGEST,
    ApprovalRequest,
    ApprovalStatus,
    HistoryHandle,
    IdempotencyRecord,
    RecordStatus,
    RunLease,
    StoredCheckpoint,
    ToolFlags,
    chain_digest,
)
from tesserix_adk.stores.rows import decoded, stored_calls

__all__ = [
    "EXPECTED_CHECKPOINT_SCHEMA",
    "MIGRATIONS",
    "SCHEMA_VERSION",
    "PostgresApprovalStore",
    "PostgresCheckpointStore",
    "PostgresDatabase",
    "PostgresHistoryStore",
    "PostgresIdempotencyStore",
    "PostgresLeaseStore",
    "PostgresLedger",
    "DEFAULT_TIMEOUT",
    "open_postgres_stores",
]

Pool = AsyncConnectionPool[psycopg.AsyncConnection[Any]]
Row = dict[str, Any]

# --- schema ------------------------------------------------------------------------------

_VERSION_TABLE = """\
CREATE TABLE IF NOT EXISTS adk_schema_version (
    id         integer PRIMARY KEY CHECK (id = 1),
    version    integer NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT clock_timestamp()
);
"""

_V1 = """\
-- The highest fence each kind of store has seen per run; NULL while only unfenced writes
-- were made. Rows are never deleted: forgetting a run must not let an old holder back in.
CREATE TABLE IF NOT EXISTS adk_fences (
    store  text NOT NULL,
    tenant text NOT NULL,
    run_id text NOT NULL,
    fence  bigint,
    PRIMARY KEY (store, tenant, run_id)
);

-- One frontier per run: the last accepted put, what resume reads.
CREATE TABLE IF NOT EXISTS adk_checkpoints (
    tenant     text NOT NULL,
    run_id     text NOT NULL,
    step       bigint NOT NULL,
    fence      bigint,
    payload    bytea NOT NULL,
    written_at timestamptz NOT NULL,
    PRIMARY KEY (tenant, run_id)
);

-- Step snapshots, for replay and inspection; pruned to keep_last per run.
CREATE TABLE IF NOT EXISTS adk_checkpoint_steps (
    tenant  text NOT NULL,
    run_id  text NOT NULL,
    step    bigint NOT NULL,
    fence   bigint,
    payload bytea NOT NULL,
    PRIMARY KEY (tenant, run_id, step)
);

-- One row per run ever leased: fence counts acquisitions and never goes back; holder is
-- NULL once released, and expires_at then keeps when the lease ended.
CREATE TABLE IF NOT EXISTS adk_run_leases (
    tenant     text NOT NULL,
    run_id     text NOT NULL,
    fence      bigint NOT NULL,
    holder     text,
    expires_at timestamptz,
    PRIMARY KEY (tenant, run_id)
);

-- Idempotency records. In-flight tool-call claims have no expires_at: they never lapse.
CREATE TABLE IF NOT EXISTS adk_idempotency (
    key          text PRIMARY KEY,
    status       text NOT NULL CHECK (status IN ('in_flight', 'completed', 'never_ran')),
    holder       text NOT NULL,
    tenant       text NOT NULL,
    run_id       text NOT NULL,
    iteration    integer,
    tool         text,
    call_id      text,
    side_effects boolean,
    idempotent   boolean,
    fence        bigint,
    outcome      bytea,
    since        timestamptz NOT NULL,
    completed_at timestamptz,
    expires_at   timestamptz,
    resolved_by  text
);
CREATE INDEX IF NOT EXISTS adk_idempotency_run ON adk_idempotency (tenant, run_id);

-- Transcripts out of line: row `position` holds message `position` (from 0) and the
-- chained digest of the prefix that ends with it.
CREATE TABLE IF NOT EXISTS adk_history (
    tenant   text NOT NULL,
    run_id   text NOT NULL,
    position integer NOT NULL,
    digest   text NOT NULL,
    item     bytea NOT NULL,
    PRIMARY KEY (tenant, run_id, position)
);

CREATE TABLE IF NOT EXISTS adk_ledger (
    tenant        text NOT NULL,
    run_id        text NOT NULL,
    micros        bigint NOT NULL,
    input_tokens  bigint NOT NULL,
    output_tokens bigint NOT NULL,
    PRIMARY KEY (tenant, run_id)
);

CREATE TABLE IF NOT EXISTS adk_approvals (
    id           text PRIMARY KEY,
    tenant       text NOT NULL,
    run_id       text NOT NULL,
    calls        json NOT NULL,
    iteration    integer NOT NULL,
    status       text NOT NULL CHECK (status IN ('pending', 'approved', 'denied')),
    decided_by   text,
    note         text,
    requested_at timestamptz NOT NULL,
    decided_at   timestamptz
);
CREATE INDEX IF NOT EXISTS adk_approvals_run ON adk_approvals (tenant, run_id);
"""

_V2 = """\
-- Idempotency records are keyed by (tenant, key): two tenants using the same key (a
-- business key such as order-5) hold two records. The rows are kept as they are.
DO $$
DECLARE
    pkey name;
    keyed boolean;
BEGIN
    SELECT c.conname, c.conkey = ARRAY[
          (SELECT attnum FROM pg_attribute
            WHERE attrelid = 'adk_idempotency'::regclass AND attname = 'tenant'),
          (SELECT attnum FROM pg_attribute
            WHERE attrelid = 'adk_idempotency'::regclass AND attname = 'key')
      ]::int2[]
    INTO pkey, keyed
    FROM pg_constraint AS c
    WHERE c.conrelid = 'adk_idempotency'::regclass AND c.contype = 'p';
    IF keyed IS NOT TRUE THEN
        IF pkey IS NOT NULL THEN
            EXECUTE format('ALTER TABLE adk_idempotency DROP CONSTRAINT %I', pkey);
        END IF;
        ALTER TABLE adk_idempotency ADD PRIMARY KEY (tenant, key);
    END IF;
END
$$;
"""

MIGRATIONS: tuple[str, ...] = (_V1, _V2)
"""``MIGRATIONS[i]`` takes the schema from version ``i`` to ``i + 1``; each is idempotent."""

SCHEMA_VERSION = len(MIGRATIONS)

EXPECTED_CHECKPOINT_SCHEMA = (
    f"-- tesserix-adk PostgreSQL schema, version {SCHEMA_VERSION}.\n"
    "-- Applied by `tesserix schema apply` (PostgresDatabase.create_schema); idempotent.\n\n"
    + _VERSION_TABLE
    + "\n"
    + "\n".join(MIGRATIONS)
    + f"\nINSERT INTO adk_schema_version (id, version) VALUES (1, {SCHEMA_VERSION})\n"
    "    ON CONFLICT (id) DO UPDATE SET version = EXCLUDED.version, "
    "applied_at = clock_timestamp();\n"
)
"""The whole DDL of the PostgreSQL stores, as ``create_schema()`` leaves the database."""

_TABLES = (
    "adk_schema_version",
    "adk_fences",
    "adk_checkpoints",
    "adk_checkpoint_steps",
    "adk_run_leases",
    "adk_idempotency",
    "adk_history",
    "adk_ledger",
    "adk_approvals",
)

# Serialises create_schema() per schema: (this class, hash of the schema name).
_SCHEMA_LOCK_CLASS = 0x7E55E12

_APPLY = "run `tesserix schema apply --store URL` (or `await stores.create_schema()`)"

# The kit's own URL options; everything else in the URL goes to psycopg.
_KIT_OPTIONS = ("keep_last", "pool_min", "pool_max", "timeout")
# Options of the kit's other backends: refused here rather than handed to the driver.
_OTHER_KIT_OPTIONS = frozenset(
    {"prefix", "allow_volatile", "keep_last", "pool_min", "pool_max", "synchronous"}
) - set(_KIT_OPTIONS)

# Seconds: the client-side deadline of every call, unless the URL says ``timeout=``.
DEFAULT_TIMEOUT = 5.0
# The server's own bounds, as fractions of the deadline: a statement the server can cancel
# is cancelled (and rolled back, outcome known) before the client stops waiting for it.
_STATEMENT_SHARE = 0.8
_LOCK_SHARE = 0.6


# --- the database ------------------------------------------------------------------------


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
            f"a tesserix-adk table is missing while {action} ({exc.diag.message_primary}); {_APPLY}"
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


def _positive_seconds(name: str, raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (value > 0 and math.isfinite(value)):
        raise ConfigurationError(
            f"{name} in the PostgreSQL store URL must be a positive number of seconds, got {raw!r}"
        )
    return value


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
                    (_SCHEMA_LOCK_CLASS,),
                )
                await conn.execute(_VERSION_TABLE)
                cur = await conn.execute("SELECT version FROM adk_schema_version WHERE id = 1")
                found = await cur.fetchone()
                version = 0 if found is None else int(found[0])
                if version > SCHEMA_VERSION:
                    raise ConfigurationError(
                        f"schema {schema!r} is at version {version}, newer than the "
                        f"{SCHEMA_VERSION} this tesserix-adk applies; upgrade tesserix-adk"
                    )
                cur = await conn.execute(
                    "SELECT count(*) FROM unnest(%s::text[]) AS t WHERE to_regclass(t) IS NULL",
                    (list(_TABLES),),
                )
                missing = await cur.fetchone()
                # A table dropped by hand is put back: every migration is idempotent, so
                # running them all again repairs it without touching what is there.
                start = 0 if missing is not None and missing[0] else version
                for migration in MIGRATIONS[start:]:
                    await conn.execute(migration)
                await conn.execute(
                    "INSERT INTO adk_schema_version (id, version) VALUES (1, %s::integer) "
                    "ON CONFLICT (id) DO UPDATE SET version = EXCLUDED.version, "
                    "applied_at = clock_timestamp()",
                    (SCHEMA_VERSION,),
                )

    async def verify(self) -> None:
        """Check every table is there at this kit's schema version (``ConfigurationError``
        naming ``tesserix schema apply`` if not)."""
        row = await self.row(
            "checking the schema",
            "SELECT current_schema() AS schema, "
            "array(SELECT t FROM unnest(%(tables)s::text[]) AS t "
            "      WHERE to_regclass(t) IS NULL) AS missing",
            {"tables": list(_TABLES)},
        )
        assert row is not None
        where = f"schema {row['schema']!r}" if row["schema"] else "the search_path"
        missing: list[str] = list(row["missing"])
        if "adk_schema_version" in missing:
            raise ConfigurationError(
                f"the tesserix-adk schema is missing from {where} (this kit needs version "
                f"{SCHEMA_VERSION}); {_APPLY}"
            )
        found = await self.row(
            "checking the schema", "SELECT version FROM adk_schema_version WHERE id = 1", {}
        )
        version = 0 if found is None else int(found["version"])
        if version > SCHEMA_VERSION:
            raise ConfigurationError(
                f"the tesserix-adk schema in {where} is at version {version}, newer than the "
                f"{SCHEMA_VERSION} this kit reads; upgrade tesserix-adk"
            )
        if version < SCHEMA_VERSION:
            raise ConfigurationError(
                f"the tesserix-adk schema in {where} is at version {version}, older than the "
                f"{SCHEMA_VERSION} this kit needs; {_APPLY}"
            )
        if missing:
            raise ConfigurationError(
                f"the tesserix-adk schema in {where} lacks {', '.join(missing)}; {_APPLY}"
            )

    async def aclose(self) -> None:
        """Close the pool; idempotent."""
        self._closed = True
        if not self.pool.closed:
            await self.pool.close()


# --- shared SQL --------------------------------------------------------------------------

_LAPSED = "({a}.status = 'in_flight' AND {a}.expires_at IS NOT NULL AND {a}.expires_at <= {now})"


def _epoch(column: str, name: str) -> str:
    return f"extract(epoch FROM {column})::float8 AS {name}"


def _gate(store: str, *, also: str = "") -> str:
    """The ``lease`` and ``gate`` CTEs of a fenced write by ``store``.

    ``gate`` has a row iff the write may go on: its fence (``%(fence)s``) is at least the
    run's lease fence (an unfenced write: no lease was ever taken) and at least the highest
    the store has seen (unfenced: none seen). The upsert locks the run's fence row, so the
    writes of one run are decided one at a time, and raises it. ``also`` is one more
    condition the write needs (the refusal it stands for raises no fence).
    """
    return f"""
lease AS (
    SELECT fence FROM adk_run_leases WHERE tenant = %(tenant)s AND run_id = %(run_id)s
),
gate AS (
    INSERT INTO adk_fences AS f (store, tenant, run_id, fence)
    SELECT '{store}', %(tenant)s, %(run_id)s, %(fence)s::bigint
    WHERE CASE WHEN %(fence)s::bigint IS NULL THEN NOT EXISTS (SELECT 1 FROM lease)
               ELSE %(fence)s::bigint >= COALESCE((SELECT fence FROM lease), %(fence)s::bigint)
          END
          {also}
    ON CONFLICT (store, tenant, run_id) DO UPDATE SET fence = GREATEST(f.fence, EXCLUDED.fence)
    WHERE (EXCLUDED.fence IS NULL AND f.fence IS NULL)
       OR (EXCLUDED.fence IS NOT NULL AND (f.fence IS NULL OR f.fence <= EXCLUDED.fence))
    RETURNING 1
)"""


def _verdict(store: str) -> str:
    """Whether the gate let the write through, and the fences that may have refused it."""
    return f"""
    EXISTS (SELECT 1 FROM gate) AS accepted,
    (SELECT fence FROM adk_fences
      WHERE store = '{store}' AND tenant = %(tenant)s AND run_id = %(run_id)s) AS seen,
    (SELECT fence FROM lease) AS leased"""


def _refusal(row: Row | None, fence: int | None) -> int | None:
    """The fence that refused a write, or ``None`` if the gate let it through."""
    if row is None:
        return -1
    if row["accepted"]:
        return None
    known = [f for f in (row["seen"], row["leased"]) if f is not None]
    return max(known) if known else -1


def _stale(what: str, run_id: str, fence: int | None, refused_by: int) -> StaleFenceError:
    seen = f"fence {refused_by} was seen" if refused_by >= 0 else "a higher fence was seen"
    if fence is None:
        return StaleFenceError(f"unfenced {what} refused for run {run_id!r}: {seen}")
    return StaleFenceError(f"fence {fence} is stale for run {run_id!r}: {seen}")


def _run(tenant: str, run_id: str, fence: int | None = None, **more: Any) -> dict[str, Any]:
    return {"tenant": tenant, "run_id": run_id, "fence": fence, **more}


class _FencedPostgresStore:
    """What every fenced PostgreSQL store shares: its database and ``seal``."""

    _store = ""

    def __init__(self, database: PostgresDatabase) -> None:
        self.database = database

    async def seal(self, tenant: str, run_id: str, fence: int) -> None:
        """Raise the highest-seen fence for the run without writing data."""
        sql = f"WITH {_gate(self._store)}\nSELECT {_verdict(self._store)}"
        row = await self.database.row(
            f"sealing run {run_id!r}", sql, _run(tenant, run_id, int(fence))
        )
        refused_by = _refusal(row, fence)
        if refused_by is not None:
            seen = f"fence {refused_by}" if refused_by >= 0 else "a higher fence"
            raise StaleFenceError(f"cannot seal run {run_id!r} at fence {fence}: {seen} was seen")


# --- checkpoints -------------------------------------------------------------------------

_CHECKPOINTS = "checkpoints"

_PUT_FRONTIER = """
frontier AS (
    INSERT INTO adk_checkpoints (tenant, run_id, step, fence, payload, written_at)
    SELECT %(tenant)s, %(run_id)s, %(step)s::bigint, %(fence)s::bigint, %(payload)s,
           clock_timestamp()
    FROM gate
    ON CONFLICT (tenant, run_id) DO UPDATE SET
        step = EXCLUDED.step, fence = EXCLUDED.fence, payload = EXCLUDED.payload,
        written_at = EXCLUDED.written_at
)"""

_PUT_STEP = """
snapshot AS (
    INSERT INTO adk_checkpoint_steps (tenant, run_id, step, fence, payload)
    SELECT %(tenant)s, %(run_id)s, %(step)s::bigint, %(fence)s::bigint, %(payload)s
    FROM gate {kept}
    ON CONFLICT (tenant, run_id, step) DO UPDATE SET
        fence = EXCLUDED.fence, payload = EXCLUDED.payload
)"""

_PUT = (
    "WITH "
    + _gate(_CHECKPOINTS)
    + ","
    + _PUT_FRONTIER
    + ","
    + _PUT_STEP.format(kept="")
    + f"\nSELECT {_verdict(_CHECKPOINTS)}"
)

# With retention: the new step joins the steps kept, the ``keep_last`` highest of them stay
# (the new one too only if it is among them, as a put then prune would leave it).
_PUT_KEEPING = (
    "WITH "
    + _gate(_CHECKPOINTS)
    + """,
top AS (
    SELECT step FROM (
        SELECT step FROM adk_checkpoint_steps WHERE tenant = %(tenant)s AND run_id = %(run_id)s
        UNION SELECT %(step)s::bigint
    ) AS steps
    ORDER BY step DESC LIMIT %(keep_last)s::bigint
),"""
    + _PUT_FRONTIER
    + ","
    + _PUT_STEP.format(kept="WHERE %(step)s::bigint IN (SELECT step FROM top)")
    + """,
pruned AS (
    DELETE FROM adk_checkpoint_steps
    WHERE tenant = %(tenant)s AND run_id = %(run_id)s
      AND step NOT IN (SELECT step FROM top) AND EXISTS (SELECT 1 FROM gate)
)"""
    + f"\nSELECT {_verdict(_CHECKPOINTS)}"
)


class PostgresCheckpointStore(_FencedPostgresStore):
    """A ``CheckpointStore`` in ``adk_checkpoints`` (the frontier, one row per run) and
    ``adk_checkpoint_steps``; ``keep_last=N`` keeps the N highest steps."""

    _store = _CHECKPOINTS

    def __init__(self, database: PostgresDatabase, *, keep_last: int | None = None) -> None:
        super().__init__(database)
        if keep_last is not None and keep_last < 1:
            raise ConfigurationError(f"keep_last must be at least 1, got {keep_last}")
        self.keep_last = keep_last

    async def put(
        self, tenant: str, run_id: str, payload: bytes, *, step: int, fence: int | None = None
    ) -> None:
        """Write a frontier; it becomes ``latest`` and step ``step`` (last write wins)."""
        sql = _PUT if self.keep_last is None else _PUT_KEEPING
        params = _run(
            tenant, run_id, fence, step=int(step), payload=bytes(payload), keep_last=self.keep_last
        )
        row = await self.database.row(f"writing a frontier of run {run_id!r}", sql, params)
        refused_by = _refusal(row, fence)
        if refused_by is not None:
            raise _stale("write", run_id, fence, refused_by)

    async def latest(self, tenant: str, run_id: str) -> StoredCheckpoint | None:
        """The last accepted put, or ``None``."""
        row = await self.database.row(
            f"reading the frontier of run {run_id!r}",
            "SELECT payload, step, fence FROM adk_checkpoints "
            "WHERE tenant = %(tenant)s AND run_id = %(run_id)s",
            _run(tenant, run_id),
        )
        return None if row is None else StoredCheckpoint(**row)

    async def at(self, tenant: str, run_id: str, step: int) -> StoredCheckpoint | None:
        """The snapshot written under ``step``, or ``None`` (never a default)."""
        row = await self.database.row(
            f"reading step {step} of run {run_id!r}",
            "SELECT payload, step, fence FROM adk_checkpoint_steps "
            "WHERE tenant = %(tenant)s AND run_id = %(run_id)s AND step = %(step)s::bigint",
            _run(tenant, run_id, step=int(step)),
        )
        return None if row is None else StoredCheckpoint(**row)

    async def steps(self, tenant: str, run_id: str) -> list[int]:
        """The steps still kept for the run, ascending."""
        rows = await self.database.rows(
            f"listing the steps of run {run_id!r}",
            "SELECT step FROM adk_checkpoint_steps "
            "WHERE tenant = %(tenant)s AND run_id = %(run_id)s ORDER BY step",
            _run(tenant, run_id),
        )
        return [int(row["step"]) for row in rows]

    async def runs(self, tenant: str) -> list[str]:
        """The run ids with a frontier for the tenant, sorted (by code point)."""
        rows = await self.database.rows(
            f"listing the runs of tenant {tenant!r}",
            "SELECT run_id FROM adk_checkpoints WHERE tenant = %(tenant)s "
            'ORDER BY run_id COLLATE "C"',
            {"tenant": tenant},
        )
        return [str(row["run_id"]) for row in rows]

    async def forget(self, tenant: str, run_id: str) -> None:
        """Remove the run's frontier and steps; its fence stays."""
        await self.database.rows(
            f"forgetting run {run_id!r}",
            "WITH frontier AS (DELETE FROM adk_checkpoints "
            "                  WHERE tenant = %(tenant)s AND run_id = %(run_id)s) "
            "DELETE FROM adk_checkpoint_steps WHERE tenant = %(tenant)s AND run_id = %(run_id)s",
            _run(tenant, run_id),
        )


# --- idempotency -------------------------------------------------------------------------

_IDEMPOTENCY = "idempotency"


def _record_columns(a: str) -> str:
    return (
        f"{a}.key, {a}.status, {a}.holder, {a}.tenant, {a}.run_id, {a}.iteration, {a}.tool, "
        f"{a}.call_id, {a}.side_effects, {a}.idempotent, {a}.fence, {a}.outcome, "
        f"{_epoch(f'{a}.since', 'since')}, {_epoch(f'{a}.completed_at', 'completed_at')}, "
        f"{_epoch(f'{a}.expires_at', 'expires_at')}, {a}.resolved_by"
    )


# How an existing record ``r`` meets a claim (``EXCLUDED``; its ``since`` is now).
_FRESH = (
    "(r.status = 'never_ran' OR (r.status = 'in_flight' AND r.expires_at IS NOT NULL "
    "AND r.expires_at <= EXCLUDED.since))"
)
_RENEW = f"(NOT {_FRESH} AND r.status = 'in_flight' AND r.holder = EXCLUDED.holder)"
_TAKE = (
    f"(NOT {_FRESH} AND r.status = 'in_flight' AND r.holder <> EXCLUDED.holder "
    f"AND %(takeover)s::boolean)"
)


def _on_claim(column: str, *, take: bool = False, renew: bool = False) -> str:
    """What a claim leaves in ``column``: a fresh record's value, a takeover's or renewal's,
    or the record's own (a completed record, or another holder's without takeover)."""
    cases = [f"WHEN {_FRESH} THEN EXCLUDED.{column}"]
    if take:
        cases.append(f"WHEN {_TAKE} THEN EXCLUDED.{column}")
    if renew:
        cases.append(f"WHEN {_RENEW} THEN COALESCE(EXCLUDED.{column}, r.{column})")
    return f"{column} = CASE {' '.join(cases)} ELSE r.{column} END"


def _claim_sql(*, fenced: bool) -> str:
    # The record is always "updated", also when nothing changes, so that RETURNING hands
    # back the record as it stands after the claim in the same statement.
    gate = _gate(_IDEMPOTENCY) if fenced else "\ngate AS (SELECT 1)"
    updates = ",\n        ".join(
        [
            _on_claim("status"),
            _on_claim("holder", take=True),
            *(
                _on_claim(column)
                for column in (
                    "run_id",
                    "iteration",
                    "tool",
                    "call_id",
                    "side_effects",
                    "idempotent",
                    "outcome",
                    "completed_at",
                    "resolved_by",
                )
            ),
            _on_claim("fence", take=True, renew=True),
            _on_claim("since", take=True),
            _on_claim("expires_at", take=True, renew=True),
        ]
    )
    return f"""WITH now_ AS (SELECT clock_timestamp() AS t),{gate},
claimed AS (
    INSERT INTO adk_idempotency AS r (key, status, holder, tenant, run_id, iteration, tool,
        call_id, side_effects, idempotent, fence, outcome, since, completed_at, expires_at,
        resolved_by)
    SELECT %(key)s, 'in_flight', %(holder)s, %(tenant)s, %(run_id)s, %(iteration)s::integer,
        %(tool)s, %(call_id)s, %(side_effects)s::boolean, %(idempotent)s::boolean,
        %(claim_fence)s::bigint, NULL, now_.t, NULL,
        now_.t + make_interval(secs => %(ttl)s::float8), NULL
    FROM now_ WHERE EXISTS (SELECT 1 FROM gate)
    ON CONFLICT (tenant, key) DO UPDATE SET
        {updates}
    RETURNING {_record_columns("r")}
)
SELECT * FROM claimed"""


_CLAIM_FENCED = _claim_sql(fenced=True)
_CLAIM_UNFENCED = _claim_sql(fenced=False)

_COMPLETE = f"""WITH now_ AS (SELECT clock_timestamp() AS t),
done AS (
    UPDATE adk_idempotency AS r
    SET status = 'completed', outcome = %(outcome)s, completed_at = now_.t, expires_at = NULL
    FROM now_
    WHERE r.tenant = %(tenant)s AND r.key = %(key)s AND r.status = 'in_flight'
      AND r.holder = %(holder)s
      AND NOT {_LAPSED.format(a="r", now="now_.t")}
    RETURNING {_record_columns("r")}
)
SELECT true AS changed, false AS lapsed, done.* FROM done
UNION ALL
SELECT false, {_LAPSED.format(a="r", now="now_.t")}, {_record_columns("r")}
FROM adk_idempotency AS r, now_
WHERE r.tenant = %(tenant)s AND r.key = %(key)s AND NOT EXISTS (SELECT 1 FROM done)"""

_RESOLVE = f"""WITH now_ AS (SELECT clock_timestamp() AS t),
settled AS (
    UPDATE adk_idempotency AS r SET
        status = CASE WHEN %(never_ran)s::boolean THEN 'never_ran' ELSE 'completed' END,
        outcome = CASE WHEN %(never_ran)s::boolean THEN r.outcome ELSE %(outcome)s::bytea END,
        completed_at = CASE WHEN %(never_ran)s::boolean THEN r.completed_at ELSE now_.t END,
        expires_at = NULL,
        resolved_by = %(by)s
    FROM now_
    WHERE r.tenant = %(tenant)s AND r.key = %(key)s AND r.status = 'in_flight'
      AND NOT {_LAPSED.format(a="r", now="now_.t")}
    RETURNING {_record_columns("r")}
)
SELECT true AS changed, false AS lapsed, settled.* FROM settled
UNION ALL
SELECT false, {_LAPSED.format(a="r", now="now_.t")}, {_record_columns("r")}
FROM adk_idempotency AS r, now_
WHERE r.tenant = %(tenant)s AND r.key = %(key)s AND NOT EXISTS (SELECT 1 FROM settled)"""

_LIVE_RECORDS = f"""WITH now_ AS (SELECT clock_timestamp() AS t)
SELECT {_record_columns("r")} FROM adk_idempotency AS r, now_
WHERE {{where}} AND NOT {_LAPSED.format(a="r", now="now_.t")}"""

_LOOKUP = _LIVE_RECORDS.format(where="r.tenant = %(tenant)s AND r.key = ANY(%(keys)s::text[])")
_RECORDS = (
    _LIVE_RECORDS.format(where="r.tenant = %(tenant)s AND r.run_id = %(run_id)s")
    + '\nORDER BY COALESCE(r.iteration, -1), r.since, r.key COLLATE "C"'
)

# A decision that found the row changed under it after its snapshot is run again.
_ATTEMPTS = 5


@decoded("idempotency record")
def _record(row: Row) -> IdempotencyRecord:
    flags = None
    if row["side_effects"] is not None:
        flags = ToolFlags(side_effects=row["side_effects"], idempotent=bool(row["idempotent"]))
    outcome = row["outcome"]
    return IdempotencyRecord(
        key=row["key"],
        status=RecordStatus(row["status"]),
        holder=row["holder"],
        tenant=row["tenant"],
        run_id=row["run_id"],
        iteration=row["iteration"],
        tool=row["tool"],
        call_id=row["call_id"],
        flags=flags,
        fence=row["fence"],
        outcome=None if outcome is None else bytes(outcome),
        since=row["since"],
        completed_at=row["completed_at"],
        expires_at=row["expires_at"],
        by=row["resolved_by"],
    )


def _positive_ttl(ttl: float) -> float:
    if not ttl > 0:
        raise ValueError(f"ttl must be a positive number of seconds, got {ttl!r}")
    return float(ttl)


class PostgresIdempotencyStore(_FencedPostgresStore):
    """An ``IdempotencyStore`` in ``adk_idempotency``, keyed by (tenant, key); ttl claims
    lapse by ``clock_timestamp()``. Each claim, completion and resolution is one
    statement."""

    _store = _IDEMPOTENCY

    async def claim(
        self,
        key: str,
        *,
        holder: str,
        tenant: str,
        run_id: str,
        iteration: int | None,
        tool: str | None,
        call_id: str | None,
        flags: ToolFlags | None,
        fence: int | None = None,
        ttl: float | None = None,
        takeover: bool = False,
    ) -> IdempotencyRecord:
        """Claim ``key`` and return the record as it stands after the call."""
        fenced = tool is not None
        params = _run(
            tenant,
            run_id,
            fence,
            key=key,
            holder=holder,
            iteration=iteration,
            tool=tool,
            call_id=call_id,
            side_effects=None if flags is None else flags.side_effects,
            idempotent=None if flags is None else flags.idempotent,
            # A resume claim is taken before any lease exists: never fenced.
            claim_fence=fence if fenced else None,
            ttl=None if ttl is None else _positive_ttl(ttl),
            takeover=takeover,
        )
        sql = _CLAIM_FENCED if fenced else _CLAIM_UNFENCED
        row = await self.database.row(f"claiming {key!r}", sql, params)
        if row is None:
            raise _stale("claim", run_id, fence, -1)
        return _record(row)

    async def complete(
        self, key: str, outcome: bytes, *, tenant: str, holder: str
    ) -> IdempotencyRecord:
        """Record the outcome of a claim held by ``holder`` (not fenced)."""
        params = {"tenant": tenant, "key": key, "holder": holder, "outcome": bytes(outcome)}
        for _ in range(_ATTEMPTS):
            row = await self.database.row(f"completing {key!r}", _COMPLETE, params)
            if row is None or row["lapsed"]:
                raise StaleFenceError(f"{holder!r} holds no claim on {key!r}")
            record = _record(row)
            if row["changed"]:
                return record
            if record.status is RecordStatus.completed and record.holder == holder:
                if record.by is None:
                    return record
            elif record.status is RecordStatus.in_flight and record.holder == holder:
                continue  # it changed after this statement's snapshot; look again
            raise StaleFenceError(
                f"{holder!r} does not hold {key!r} in flight "
                f"({record.status} under {record.holder!r})"
            )
        raise StoreUnavailableError(f"{key!r} kept changing while {holder!r} completed it")

    async def release(
        self, key: str, *, tenant: str, holder: str, undispatched: bool = False
    ) -> None:
        """Drop a ttl claim held by ``holder``; anything else is left alone."""
        await self.database.rows(
            f"releasing {key!r}",
            "DELETE FROM adk_idempotency WHERE tenant = %(tenant)s AND key = %(key)s "
            "AND status = 'in_flight' AND holder = %(holder)s "
            "AND (expires_at IS NOT NULL OR (%(undispatched)s AND tool IS NOT NULL))",
            {"tenant": tenant, "key": key, "holder": holder, "undispatched": undispatched},
        )

    async def lookup(self, keys: Sequence[str], *, tenant: str) -> dict[str, IdempotencyRecord]:
        """The tenant's live records of ``keys`` in one statement; absent keys are left
        out."""
        wanted = list(dict.fromkeys(keys))
        if not wanted:
            return {}
        rows = await self.database.rows(
            f"looking up {len(wanted)} idempotency key(s)",
            _LOOKUP,
            {"tenant": tenant, "keys": wanted},
        )
        return {row["key"]: _record(row) for row in rows}

    async def records(self, tenant: str, run_id: str) -> list[IdempotencyRecord]:
        """Every live record of the run, by (iteration, since, key); the run claim first."""
        rows = await self.database.rows(
            f"listing the records of run {run_id!r}", _RECORDS, _run(tenant, run_id)
        )
        return [_record(row) for row in rows]

    async def resolve(
        self,
        key: str,
        outcome: bytes | None = None,
        *,
        tenant: str,
        never_ran: bool = False,
        by: str,
    ) -> IdempotencyRecord:
        """An operator settles an in-flight call: its outcome, or that it never ran."""
        if never_ran == (outcome is not None):
            raise ValueError("resolve needs exactly one of an outcome or never_ran=True")
        params = {
            "tenant": tenant,
            "key": key,
            "never_ran": never_ran,
            "outcome": None if outcome is None else bytes(outcome),
            "by": by,
        }
        for _ in range(_ATTEMPTS):
            row = await self.database.row(f"resolving {key!r}", _RESOLVE, params)
            if row is None or row["lapsed"]:
                raise KeyError(key)
            record = _record(row)
            if row["changed"]:
                return record
            if record.status is not RecordStatus.in_flight:
                raise ValueError(f"{key!r} is {record.status}, not in flight")
        raise StoreUnavailableError(f"{key!r} kept changing while it was resolved")


# --- leases ------------------------------------------------------------------------------

# The one statement that decides an acquisition: a new run's row, or a lapsed or released
# lease taken over at the next fence; a live lease leaves the row alone and returns nothing.
# ``before`` reads, in the statement's snapshot, when the previous lease ended; the upsert
# overwrites it and RETURNING sees only the new row. (Not FOR UPDATE: that would skip the
# row this very statement updates.) If the upsert succeeds, any change committed since the
# snapshot can only have been that lease's release, which moves its end earlier, so the
# value read is never earlier than the true end.
_ACQUIRE = f"""WITH before AS (
    SELECT expires_at FROM adk_run_leases
    WHERE tenant = %(tenant)s AND run_id = %(run_id)s
)
INSERT INTO adk_run_leases AS l (tenant, run_id, fence, holder, expires_at)
VALUES (%(tenant)s, %(run_id)s, 1, %(holder)s,
        clock_timestamp() + make_interval(secs => %(ttl)s::float8))
ON CONFLICT (tenant, run_id) DO UPDATE SET
    fence = l.fence + 1,
    holder = EXCLUDED.holder,
    expires_at = clock_timestamp() + make_interval(secs => %(ttl)s::float8)
WHERE l.holder IS NULL OR l.expires_at <= clock_timestamp()
RETURNING l.fence, {_epoch("l.expires_at", "expires_at")},
    {_epoch("(SELECT expires_at FROM before)", "previous_end")}"""

_LIVE_LEASE = f"""SELECT holder, fence, {_epoch("expires_at", "expires_at")}
FROM adk_run_leases
WHERE tenant = %(tenant)s AND run_id = %(run_id)s
  AND holder IS NOT NULL AND expires_at > clock_timestamp()"""

_RENEW_LEASE = f"""UPDATE adk_run_leases
SET expires_at = clock_timestamp() + make_interval(secs => %(ttl)s::float8)
WHERE tenant = %(tenant)s AND run_id = %(run_id)s AND holder = %(holder)s
  AND fence = %(fence)s::bigint AND expires_at > clock_timestamp()
RETURNING {_epoch("expires_at", "expires_at")}"""

_LEASE_END = f"""SELECT {_epoch("clock_timestamp() - expires_at", "ago")}
FROM adk_run_leases
WHERE tenant = %(tenant)s AND run_id = %(run_id)s
  AND expires_at IS NOT NULL AND (holder IS NULL OR expires_at <= clock_timestamp())"""

# The row stays: its fence is what the next acquisition counts on from, and expires_at
# keeps when the lease ended, which that acquisition reports.
_RELEASE_LEASE = """UPDATE adk_run_leases
SET holder = NULL, expires_at = LEAST(expires_at, clock_timestamp())
WHERE tenant = %(tenant)s AND run_id = %(run_id)s AND holder = %(holder)s
  AND fence = %(fence)s::bigint"""


class PostgresLeaseStore:
    """A ``LeaseStore`` in ``adk_run_leases``; expiry decided by ``clock_timestamp()``.

    One ``INSERT … ON CONFLICT … DO UPDATE … WHERE … RETURNING`` decides an acquisition;
    the fence is the row's counter, which release keeps and every acquisition raises.
    """

    def __init__(self, database: PostgresDatabase) -> None:
        self.database = database

    async def acquire(self, tenant: str, run_id: str, holder: str, ttl: float) -> RunLease:
        """Take the run (raising its fence) or raise ``LeaseHeldError`` naming the holder."""
        params = _run(tenant, run_id, holder=holder, ttl=_positive_ttl(ttl))
        action = f"acquiring the lease on run {run_id!r}"
        row = await self.database.row(action, _ACQUIRE, params)
        if row is None:
            # Informational only: who holds it right after the refusal (None if it lapsed).
            current = await self.database.row(action, _LIVE_LEASE, params)
            holding = None if current is None else str(current["holder"])
            whom = "another holder" if holding is None else repr(holding)
            raise LeaseHeldError(f"run {run_id!r} is leased to {whom}", holder=holding)
        return RunLease(
            tenant=tenant,
            run_id=run_id,
            holder=holder,
            fence=int(row["fence"]),
            expires_at=row["expires_at"],
            previous_end=row["previous_end"],
        )

    async def renew(self, lease: RunLease, ttl: float) -> RunLease:
        """Extend a live lease, keeping its fence, or raise ``LeaseLostError``."""
        params = _run(
            lease.tenant, lease.run_id, lease.fence, holder=lease.holder, ttl=_positive_ttl(ttl)
        )
        row = await self.database.row(
            f"renewing the lease on run {lease.run_id!r}", _RENEW_LEASE, params
        )
        if row is None:
            raise LeaseLostError(
                f"lease on run {lease.run_id!r} at fence {lease.fence} lapsed or was taken"
            )
        return RunLease(
            tenant=lease.tenant,
            run_id=lease.run_id,
            holder=lease.holder,
            fence=lease.fence,
            expires_at=row["expires_at"],
            previous_end=lease.previous_end,
        )

    async def release(self, lease: RunLease) -> None:
        """Free the run, only for the holder at that fence; the fence stays."""
        await self.database.rows(
            f"releasing the lease on run {lease.run_id!r}",
            _RELEASE_LEASE,
            _run(lease.tenant, lease.run_id, lease.fence, holder=lease.holder),
        )

    async def current(self, tenant: str, run_id: str) -> RunLease | None:
        """The lease live by the server's clock, else ``None``."""
        row = await self.database.row(
            f"reading the lease on run {run_id!r}", _LIVE_LEASE, _run(tenant, run_id)
        )
        if row is None:
            return None
        return RunLease(
            tenant=tenant,
            run_id=run_id,
            holder=row["holder"],
            fence=int(row["fence"]),
            expires_at=row["expires_at"],
        )

    async def ended_ago(self, tenant: str, run_id: str) -> float | None:
        """Seconds since the run's last lease ended; ``None`` if one is live or none ended."""
        row = await self.database.row(
            f"reading when the lease on run {run_id!r} ended", _LEASE_END, _run(tenant, run_id)
        )
        return None if row is None else max(0.0, row["ago"])


# --- transcripts -------------------------------------------------------------------------

_HISTORY = "history"

# The prefix ``after`` names resolves when its last message carries its digest (the empty
# prefix always does). Only then may the gate pass; a refusal for that reason raises no fence.
_APPEND = (
    """WITH prefix AS (
    SELECT CASE WHEN %(count)s::integer = 0 THEN %(digest)s = %(empty)s
                ELSE EXISTS (SELECT 1 FROM adk_history
                             WHERE tenant = %(tenant)s AND run_id = %(run_id)s
                               AND position = %(count)s::integer - 1
                               AND digest = %(digest)s)
           END AS resolves
),"""
    + _gate(_HISTORY, also="AND (SELECT resolves FROM prefix)")
    + """,
dropped AS (
    -- A dead writer may have appended past this prefix; its tail goes.
    DELETE FROM adk_history
    WHERE tenant = %(tenant)s AND run_id = %(run_id)s
      AND position >= %(count)s::integer + cardinality(%(items)s::bytea[])
      AND EXISTS (SELECT 1 FROM gate)
),
added AS (
    INSERT INTO adk_history (tenant, run_id, position, digest, item)
    SELECT %(tenant)s, %(run_id)s, %(count)s::integer + (new.n - 1)::integer, new.digest,
           new.item
    FROM unnest(%(items)s::bytea[], %(digests)s::text[]) WITH ORDINALITY
         AS new(item, digest, n)
    WHERE EXISTS (SELECT 1 FROM gate)
    ON CONFLICT (tenant, run_id, position) DO UPDATE SET
        digest = EXCLUDED.digest, item = EXCLUDED.item
)
SELECT (SELECT resolves FROM prefix) AS resolves,"""
    + _verdict(_HISTORY)
)


class PostgresHistoryStore(_FencedPostgresStore):
    """A ``HistoryStore`` in ``adk_history``: one row per message with its chained digest.

    An append writes only the new rows and drops a dead writer's tail in the same statement.
    """

    _store = _HISTORY

    async def append(
        self,
        tenant: str,
        run_id: str,
        encoded: Sequence[bytes],
        *,
        fence: int | None = None,
        after: HistoryHandle | None,
    ) -> HistoryHandle:
        """Append after the prefix ``after`` names (``None``: the empty prefix), dropping
        any tail beyond it; ``HistoryUnavailableError`` if that prefix does not resolve."""
        if after is not None and (after.tenant, after.run_id) != (tenant, run_id):
            raise ValueError(
                f"handle names run {after.run_id!r} of {after.tenant!r}, "
                f"not run {run_id!r} of {tenant!r}"
            )
        count, digest = (0, EMPTY_HISTORY_DIGEST) if after is None else (after.count, after.digest)
        items = [bytes(item) for item in encoded]
        digests: list[str] = []
        last = digest
        for item in items:
            last = chain_digest(last, item)
            digests.append(last)
        params = _run(
            tenant,
            run_id,
            fence,
            count=count,
            digest=digest,
            empty=EMPTY_HISTORY_DIGEST,
            items=items,
            digests=digests,
        )
        row = await self.database.row(
            f"appending to the transcript of run {run_id!r}", _APPEND, params
        )
        refused_by = _refusal(row, fence)
        if refused_by is not None:
            assert row is not None
            # A stale fence is reported first, as if checked before the prefix.
            if row["resolves"] is False and not _stale_by(row, fence):
                raise HistoryUnavailableError(
                    f"the transcript of run {run_id!r} no longer has the prefix of {count} "
                    f"messages this append follows"
                )
            raise _stale("append", run_id, fence, refused_by)
        return HistoryHandle(tenant=tenant, run_id=run_id, count=count + len(items), digest=last)

    async def fetch(self, handle: HistoryHandle) -> list[bytes]:
        """The bytes of the prefix; ``HistoryUnavailableError`` if it does not resolve."""
        rows = (
            await self.database.rows(
                f"reading the transcript of run {handle.run_id!r}",
                "SELECT position, digest, item FROM adk_history "
                "WHERE tenant = %(tenant)s AND run_id = %(run_id)s "
                "AND position < %(count)s::integer ORDER BY position",
                _run(handle.tenant, handle.run_id, count=handle.count),
            )
            if handle.count > 0
            else []
        )
        last = EMPTY_HISTORY_DIGEST if not rows else rows[-1]["digest"]
        if handle.count < 0 or len(rows) != handle.count or last != handle.digest:
            raise HistoryUnavailableError(
                f"the transcript of run {handle.run_id!r} no longer has the prefix of "
                f"{handle.count} messages the handle names"
            )
        return [bytes(row["item"]) for row in rows]

    async def forget(self, tenant: str, run_id: str) -> None:
        """Remove the run's transcript; its fence stays."""
        await self.database.rows(
            f"forgetting the transcript of run {run_id!r}",
            "DELETE FROM adk_history WHERE tenant = %(tenant)s AND run_id = %(run_id)s",
            _run(tenant, run_id),
        )


def _stale_by(row: Row, fence: int | None) -> bool:
    """Whether the fences in ``row`` alone refuse a write carrying ``fence``."""
    known = [f for f in (row["seen"], row["leased"]) if f is not None]
    return bool(known) if fence is None else any(f > fence for f in known)


# --- spend -------------------------------------------------------------------------------

_LEDGER = "ledger"

_CHARGE = (
    "WITH "
    + _gate(_LEDGER)
    + """,
charged AS (
    INSERT INTO adk_ledger AS l (tenant, run_id, micros, input_tokens, output_tokens)
    SELECT %(tenant)s, %(run_id)s, %(micros)s::bigint, %(input_tokens)s::bigint,
           %(output_tokens)s::bigint
    FROM gate
    ON CONFLICT (tenant, run_id) DO UPDATE SET
        micros = l.micros + EXCLUDED.micros,
        input_tokens = l.input_tokens + EXCLUDED.input_tokens,
        output_tokens = l.output_tokens + EXCLUDED.output_tokens
)"""
    + f"\nSELECT {_verdict(_LEDGER)}"
)


class PostgresLedger(_FencedPostgresStore):
    """A ``Ledger`` in ``adk_ledger``: micros and tokens per run."""

    _store = _LEDGER

    async def charge(
        self, tenant: str, run_id: str, micros: int, usage: Usage, *, fence: int | None = None
    ) -> None:
        """Add a model call's cost and usage to the run."""
        params = _run(
            tenant,
            run_id,
            fence,
            micros=int(micros),
            input_tokens=int(usage.input_tokens),
            output_tokens=int(usage.output_tokens),
        )
        row = await self.database.row(f"charging run {run_id!r}", _CHARGE, params)
        refused_by = _refusal(row, fence)
        if refused_by is not None:
            raise _stale("charge", run_id, fence, refused_by)

    async def _totals(self, tenant: str, run_id: str) -> Row | None:
        return await self.database.row(
            f"reading the spend of run {run_id!r}",
            "SELECT micros, input_tokens, output_tokens FROM adk_ledger "
            "WHERE tenant = %(tenant)s AND run_id = %(run_id)s",
            _run(tenant, run_id),
        )

    async def spent(self, tenant: str, run_id: str) -> int:
        """Micros charged to the run so far (0 for an unknown run)."""
        row = await self._totals(tenant, run_id)
        return 0 if row is None else int(row["micros"])

    async def usage(self, tenant: str, run_id: str) -> Usage:
        """Tokens charged to the run so far."""
        row = await self._totals(tenant, run_id)
        if row is None:
            return Usage()
        return Usage(input_tokens=int(row["input_tokens"]), output_tokens=int(row["output_tokens"]))


# --- approvals ---------------------------------------------------------------------------

_APPROVALS = "approvals"


def _approval_columns(a: str) -> str:
    return (
        f"{a}.id, {a}.tenant, {a}.run_id, {a}.calls::text AS calls, {a}.iteration, {a}.status, "
        f"{a}.decided_by, {a}.note, {_epoch(f'{a}.requested_at', 'requested_at')}, "
        f"{_epoch(f'{a}.decided_at', 'decided_at')}"
    )


_REQUEST = (
    "WITH "
    + _gate(_APPROVALS)
    + f""",
made AS (
    INSERT INTO adk_approvals AS a (id, tenant, run_id, calls, iteration, status, requested_at)
    SELECT %(id)s, %(tenant)s, %(run_id)s, %(calls)s::json, %(iteration)s::integer, 'pending',
           clock_timestamp()
    FROM gate
    ON CONFLICT (id) DO NOTHING
    RETURNING {_approval_columns("a")}
)
SELECT {_verdict(_APPROVALS)}, made.*
FROM (SELECT 1) AS one LEFT JOIN made ON true"""
)

_DECIDE = f"""WITH now_ AS (SELECT clock_timestamp() AS t),
decided AS (
    UPDATE adk_approvals AS a
    SET status = %(status)s, decided_by = %(by)s, note = %(note)s, decided_at = now_.t
    FROM now_
    WHERE a.id = %(id)s AND a.tenant = %(tenant)s AND a.status = 'pending'
    RETURNING {_approval_columns("a")}
)
SELECT true AS changed, decided.* FROM decided
UNION ALL
SELECT false, {_approval_columns("a")} FROM adk_approvals AS a
WHERE a.id = %(id)s AND a.tenant = %(tenant)s AND NOT EXISTS (SELECT 1 FROM decided)"""

_GET_APPROVAL = f"""SELECT {_approval_columns("a")} FROM adk_approvals AS a
WHERE a.id = %(id)s AND a.tenant = %(tenant)s"""


def _calls_to_json(calls: Sequence[ToolCall]) -> str:
    return json.dumps(
        [{"id": c.id, "name": c.name, "arguments": dict(c.arguments)} for c in calls],
        separators=(",", ":"),
    )


@decoded("approval request")
def _approval(row: Row) -> ApprovalRequest:
    return ApprovalRequest(
        id=row["id"],
        tenant=row["tenant"],
        run_id=row["run_id"],
        calls=stored_calls(json.loads(row["calls"])),
        iteration=int(row["iteration"]),
        status=ApprovalStatus(row["status"]),
        by=row["decided_by"],
        note=row["note"],
        requested_at=row["requested_at"],
        decided_at=row["decided_at"],
    )


class PostgresApprovalStore(_FencedPostgresStore):
    """An ``ApprovalStore`` in ``adk_approvals``; ids are unique across the table."""

    _store = _APPROVALS

    async def request(
        self,
        tenant: str,
        run_id: str,
        calls: Sequence[ToolCall],
        *,
        iteration: int,
        fence: int | None = None,
        id: str | None = None,
    ) -> ApprovalRequest:
        """Record a pending request (made once under a chosen ``id``)."""
        encoded = _calls_to_json(calls)
        while True:
            params = _run(
                tenant,
                run_id,
                fence,
                id=id or f"req-{secrets.token_hex(6)}",
                calls=encoded,
                iteration=int(iteration),
            )
            row = await self.database.row(
                f"recording an approval request of run {run_id!r}", _REQUEST, params
            )
            refused_by = _refusal(row, fence)
            if refused_by is not None:
                raise _stale("approval request", run_id, fence, refused_by)
            assert row is not None
            if row["id"] is not None:
                return _approval(row)
            if id is not None:
                existing = await self.get(tenant, id)
                if existing is None:
                    raise ValueError(f"approval request id {id!r} is taken")
                return existing
            # That id was taken already: draw another.

    async def decide(
        self, tenant: str, id: str, *, approved: bool, by: str, note: str | None = None
    ) -> ApprovalRequest:
        """Decide a request: the same decision again is a no-op, the other way raises
        ``ValueError``; an id unknown for the tenant raises ``KeyError``."""
        status = ApprovalStatus.approved if approved else ApprovalStatus.denied
        params = {"id": id, "tenant": tenant, "status": status.value, "by": by, "note": note}
        for _ in range(_ATTEMPTS):
            row = await self.database.row(f"deciding approval request {id!r}", _DECIDE, params)
            if row is None:
                raise KeyError(id)
            request = _approval(row)
            if row["changed"] or request.status is status:
                return request
            if request.status is not ApprovalStatus.pending:
                raise ValueError(f"request {id!r} was already {request.status} by {request.by!r}")
            # Decided by someone else after this statement's snapshot; look again.
        raise StoreUnavailableError(f"approval request {id!r} kept changing while decided")

    async def get(self, tenant: str, id: str) -> ApprovalRequest | None:
        """The request, or ``None`` when no request with that id belongs to the tenant."""
        row = await self.database.row(
            f"reading approval request {id!r}", _GET_APPROVAL, {"id": id, "tenant": tenant}
        )
        return None if row is None else _approval(row)


# --- opening -----------------------------------------------------------------------------


def _whole(url: str, name: str, raw: str, *, least: int) -> int:
    try:
        value = int(raw)
    except ValueError:
        value = least - 1
    if value < least:
        raise ConfigurationError(
            f"{name} in the PostgreSQL store URL must be a whole number of at least {least}, "
            f"got {raw!r}"
        )
    return value


def _split_url(url: str) -> tuple[str, dict[str, str]]:
    """The URL for psycopg and the kit's own options, taken out of its query.

    Everything but the kit's options is handed on byte for byte: no re-encoding (libpq reads
    ``+`` literally) and no rebuilding (``postgresql:///db?host=/socket`` has no host part).
    """
    base, _, rest = url.partition("?")
    query, hash_, fragment = rest.partition("#")
    kept: list[str] = []
    options: dict[str, str] = {}
    for segment in query.split("&") if query else ():
        raw_name, _, raw_value = segment.partition("=")
        name, value = unquote(raw_name), unquote(raw_value)
        if name in _OTHER_KIT_OPTIONS:
            raise ConfigurationError(
                f"{name!r} is not an option of PostgreSQL stores "
                f"(theirs: {', '.join(_KIT_OPTIONS)})"
            )
        if name in _KIT_OPTIONS:
            if name in options:
                raise ConfigurationError(f"the PostgreSQL store URL sets {name!r} twice")
            options[name] = value
        else:
            kept.append(segment)
    out = base + ("?" + "&".join(kept) if kept else "") + (hash_ + fragment if fragment else "")
    try:
        conninfo_to_dict(out)  # parses only: a typo'd option is a usage mistake, not an outage
    except psycopg.ProgrammingError as exc:
        raise ConfigurationError(f"the PostgreSQL store URL is not usable: {exc}") from exc
    return out, options


def open_postgres_stores(url: str) -> Stores:
    """The six PostgreSQL stores on one pool, as a ``Stores`` bundle; no I/O until first use.

    Options in the query: ``keep_last``, ``pool_min`` (default 1), ``pool_max`` (default
    4) and ``timeout`` (seconds, default 5: the client-side deadline of every call, kept
    below the lease ttl; the server's statement and lock timeouts are set below it);
    everything else goes to psycopg (e.g. ``options=-csearch_path%3Dmy_schema``).
    ``create_schema()`` applies ``EXPECTED_CHECKPOINT_SCHEMA``; ``verify()`` checks it;
    ``aclose()`` closes the pool.
    """
    conninfo, options = _split_url(url)
    keep_last = (
        _whole(url, "keep_last", options["keep_last"], least=1) if "keep_last" in options else None
    )
    pool_min = _whole(url, "pool_min", options.get("pool_min", "1"), least=0)
    pool_max = _whole(url, "pool_max", options.get("pool_max", "4"), least=1)
    timeout = (
        _positive_seconds("timeout", options["timeout"])
        if "timeout" in options
        else DEFAULT_TIMEOUT
    )
    database = PostgresDatabase.from_url(
        conninfo, pool_min=pool_min, pool_max=pool_max, timeout=timeout
    )
    return Stores(
        checkpoints=PostgresCheckpointStore(database, keep_last=keep_last),
        idempotency=PostgresIdempotencyStore(database),
        leases=PostgresLeaseStore(database),
        history=PostgresHistoryStore(database),
        ledger=PostgresLedger(database),
        approvals=PostgresApprovalStore(database),
        url=url,
        on_create_schema=database.create_schema,
        on_verify=database.verify,
        on_close=(database.aclose,),
        schema=EXPECTED_CHECKPOINT_SCHEMA,
    )
