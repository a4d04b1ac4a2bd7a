"""Talking to PostgreSQL through psycopg: driver errors translated into the kit's, once,
saying whether an outcome is unknown; and the transactions every call runs in (each its own,
begun READ COMMITTED with its bounds set ``LOCAL``, so nothing lives in the session).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager, contextmanager, suppress
from typing import Any

import psycopg
from psycopg import errors as pg_errors
from psycopg.pq import TransactionStatus
from psycopg.rows import dict_row

from tesserix_adk.adapters.postgres.prepared import (
    Outgoing,
    PreparedStatements,
    as_text,
    lost_statement,
)
from tesserix_adk.adapters.postgres.schema import APPLY
from tesserix_adk.errors import (
    SchemaMismatchError,
    StorePermissionError,
    StoreReplyLostError,
    StoreUnavailableError,
)

__all__ = [
    "Call",
    "Row",
    "Statement",
    "alone",
    "batched",
    "begin_statements",
    "driver_errors",
    "roll_back",
    "transaction",
]

Row = dict[str, Any]

# The server's own bounds, as fractions of the deadline: a statement the server can cancel
# is cancelled (and rolled back, outcome known) before the client stops waiting for it.
_STATEMENT_SHARE = 0.8
_LOCK_SHARE = 0.6


class Call:
    """Whether the statement of the call in progress was handed to the server."""

    __slots__ = ("sent",)

    def __init__(self) -> None:
        self.sent = False


@contextmanager
def driver_errors(action: str) -> Iterator[Call]:
    """Translate psycopg errors into the kit's, once, at the boundary, saying whether the
    outcome is unknown (``call.sent`` and no reply) or certainly nothing happened."""
    call = Call()
    try:
        yield call
    except pg_errors.UndefinedTable as exc:
        raise SchemaMismatchError(
            f"a tesserix-adk table is missing while {action} ({exc.diag.message_primary}); {APPLY}"
        ) from exc
    except pg_errors.UndefinedColumn as exc:
        # A schema from an earlier kit, not yet migrated: applying the schema adds it.
        raise SchemaMismatchError(
            f"a tesserix-adk column is missing while {action} ({exc.diag.message_primary}): "
            f"the schema is from an earlier kit; {APPLY}"
        ) from exc
    except pg_errors.InsufficientPrivilege as exc:
        raise StorePermissionError(f"PostgreSQL refused {action}: {exc}") from exc
    except pg_errors.ReadOnlySqlTransaction as exc:
        # A read-only database (default_transaction_read_only, a hot standby): the store's
        # matter, as a refused grant is; a worker stops instead of trying for ever.
        raise StorePermissionError(
            f"PostgreSQL refused {action}: the database is read-only here ({exc}); point the "
            "kit at a writable primary"
        ) from exc
    except pg_errors.InvalidSchemaName as exc:
        raise SchemaMismatchError(f"PostgreSQL refused {action}: {exc}") from exc
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
    except (pg_errors.InvalidSqlStatementName, pg_errors.FeatureNotSupported) as exc:
        if not lost_statement(exc):
            raise StoreUnavailableError(
                f"PostgreSQL failed while {action}: {exc}", retryable=False
            ) from exc
        # Statements the kit prepared were dropped or outdated under it (``prepared``): it
        # prepares them again, so trying again works.
        raise StoreUnavailableError(
            f"PostgreSQL no longer had a statement the kit prepared while {action} ({exc}); "
            "the connection prepares it again"
        ) from exc
    except psycopg.Error as exc:
        raise StoreUnavailableError(
            f"PostgreSQL failed while {action}: {exc}", retryable=False
        ) from exc


def begin_statements(timeout: float) -> tuple[str, ...]:
    """The statements that open every transaction: READ COMMITTED whatever the server's or
    the pooler's default, and the server's own bounds for this transaction only."""
    statement_ms = max(1, int(timeout * _STATEMENT_SHARE * 1000))
    lock_ms = max(1, int(timeout * _LOCK_SHARE * 1000))
    return (
        "BEGIN ISOLATION LEVEL READ COMMITTED",
        f"SELECT set_config('statement_timeout', '{statement_ms}', true), "
        f"set_config('lock_timeout', '{lock_ms}', true)",
    )


async def roll_back(conn: psycopg.AsyncConnection[Any]) -> None:
    # After a failure, if the connection can still say so (a broken one the pool drops).
    if conn.info.transaction_status in (TransactionStatus.INTRANS, TransactionStatus.INERROR):
        with suppress(psycopg.Error):
            await conn.execute("ROLLBACK", prepare=False)


@asynccontextmanager
async def transaction(
    conn: psycopg.AsyncConnection[Any], begin: tuple[str, ...]
) -> AsyncIterator[None]:
    """One transaction on ``conn``: ``begin``, the body, COMMIT; ROLLBACK if the body
    fails."""
    if not conn.autocommit:  # a pool built by hand: psycopg would begin one of its own
        await conn.set_autocommit(True)
    # Several statements in one string, no parameters: one round trip, never prepared.
    await conn.execute("; ".join(begin), prepare=False)
    try:
        yield
    except BaseException:
        await roll_back(conn)
        raise
    await conn.execute("COMMIT", prepare=False)


async def alone(
    conn: psycopg.AsyncConnection[Any],
    begin: tuple[str, ...],
    sql: str,
    params: Mapping[str, Any],
    prepared: PreparedStatements | None = None,
) -> list[Row]:
    """``sql`` in a transaction of its own, sent with its ``begin`` and COMMIT in one
    round trip; its rows. With ``prepared``, as one message that runs the statement
    prepared (``batched``); else as one pipeline, bound on the server."""
    if not conn.autocommit:
        await conn.set_autocommit(True)
    if prepared is not None:
        try:
            (rows,) = await batched(conn, begin, [(sql, params)], ("COMMIT",), prepared)
        except BaseException:
            await roll_back(conn)
            raise
        return rows
    try:
        async with conn.cursor(row_factory=dict_row) as cur:
            # The pipeline's exit is its one Sync (a sync() inside it would cost a second
            # round trip): the rows are read once every reply is in.
            async with conn.pipeline():
                for statement in begin:
                    await conn.execute(statement, prepare=False)
                await cur.execute(sql, params)
                await conn.execute("COMMIT", prepare=False)
            return await cur.fetchall() if cur.description is not None else []
    except BaseException:
        await roll_back(conn)
        raise


Statement = tuple[str, Mapping[str, Any]]


async def batched(
    conn: psycopg.AsyncConnection[Any],
    before: Sequence[str],
    statements: Sequence[Statement],
    after: Sequence[str] = (),
    prepared: PreparedStatements | None = None,
) -> list[list[Row]]:
    """``before``, ``statements`` and ``after`` in one message of the simple query protocol,
    their parameters bound by psycopg on the client: one round trip; each statement's rows.
    With ``prepared``, each statement is prepared on a direct connection once it has run
    there often enough as text, and executed by name after (``prepared`` says why and how).

    For writes inside a transaction that stays open after them (a write group), or ended by
    a COMMIT in ``after`` (``alone``). The server ends the message with the ReadyForQuery
    that arms its idle-in-transaction timer, so a holder frozen inside the transaction is
    ended by the server. A pipeline would not do: psycopg ends one with a Flush after its
    Sync, and the server disarms that timer on the Flush without arming it again.
    """
    # Binds the values on the client (``mogrify``) and sends nothing: the message goes on a
    # cursor of the connection's own, without parameters, so as one simple Query.
    binder = psycopg.AsyncClientCursor(conn)
    out = (
        Outgoing([as_text(binder, sql, params) for sql, params in statements])
        if prepared is None
        else await prepared.compose(conn, binder, statements)
    )
    # A newline after each: an SQL file's last line may be a comment.
    message = ";\n".join([*before, *out.head, *out.bound, *after])
    first = len(before) + len(out.head)
    async with conn.cursor(row_factory=dict_row) as cur:
        try:
            await cur.execute(message, prepare=False)
        except BaseException as exc:
            out.done(exc)
            raise
        out.done(None)
        results: list[list[Row]] = []
        index = 0
        while True:
            if out.asks and index == len(before):
                out.answered(conn, await cur.fetchall())
            if first <= index < first + len(statements):
                results.append(await cur.fetchall() if cur.description is not None else [])
            index += 1
            if not cur.nextset():
                break
    if len(results) != len(statements):  # pragma: no cover - the server answers each one
        raise StoreUnavailableError(
            f"PostgreSQL answered {len(results)} of {len(statements)} statements sent together"
        )
    return results
