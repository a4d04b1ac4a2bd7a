"""A run's writes on PostgreSQL committed as one transaction (``protocols.grouping``).

The group takes a pooled connection at its first write and keeps it to its commit: each
write of the run's stores goes there, in a savepoint of its own (a statement that fails is
undone alone; the group goes on), sent with the savepoint in one message, so a write costs
one round trip as before and the group one COMMIT, which rides in the message of the
group's last statement when the runner says which that is (``commit_with_next``). Other runs
use other connections and wait for nothing. If the connection is lost or the server ends the
transaction, the group is lost: nothing joins it afresh, and its commit says so, in doubt
when the lost message carried the COMMIT.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import suppress
from typing import TYPE_CHECKING, Any, TypeVar

import psycopg
from psycopg.pq import TransactionStatus

from tesserix_adk.adapters.postgres.driver import Row, Statement, batched, driver_errors
from tesserix_adk.errors import StoreReplyLostError, StoreUnavailableError
from tesserix_adk.stores.grouping import OpenGroup

if TYPE_CHECKING:
    from tesserix_adk.adapters.postgres.connection import PostgresDatabase

__all__ = ["PostgresWriteGroup"]

T = TypeVar("T")


class PostgresWriteGroup(OpenGroup):
    """A run's writes on one PostgreSQL database, committed as one transaction."""

    def __init__(self, database: PostgresDatabase) -> None:
        super().__init__(database)
        self.database = database
        self._conn: psycopg.AsyncConnection[Any] | None = None
        self._begun = False
        self._lost: str | None = None
        # Whether the group's next single statement carries its COMMIT; and, once lost,
        # whether the message it was lost with carried it (then it may have committed).
        self._commit_next = False
        self._in_doubt = False

    async def begin(self) -> None:
        """Open the group for the current attempt; its connection is taken at its first
        write, so a group nothing joins costs nothing."""
        self._enter()

    def commit_with_next(self) -> None:
        """Send the COMMIT with the group's next single statement (``protocols.grouping``);
        statements sent together never carry it (their check may refuse them after they
        ran, and they are undone together), so it waits for the next one alone."""
        self._commit_next = True

    async def rows(self, action: str, sql: str, params: Mapping[str, Any]) -> list[Row]:
        """``sql`` in the group's transaction; its rows."""
        return await self._on_connection(action, lambda conn: self._in_group(conn, sql, params))

    async def rows_together(
        self,
        action: str,
        statements: Sequence[Statement],
        check: Callable[[list[list[Row]]], None],
    ) -> list[list[Row]]:
        """``statements`` in the group's transaction, in one savepoint and one round trip;
        each one's rows. If ``check`` refuses them (raises), they are undone together, the
        group goes on, and its error is raised."""
        return await self._on_connection(
            action, lambda conn: self._together_in_group(conn, statements, check)
        )

    async def _on_connection(
        self, action: str, work: Callable[[psycopg.AsyncConnection[Any]], Awaitable[T]]
    ) -> T:
        if self._lost is not None:
            raise StoreUnavailableError(self._lost)
        db = self.database
        with driver_errors(action) as call:
            await db._open()
            if self._conn is None:
                self._conn = await db.pool.getconn(timeout=db.timeout)
            conn = self._conn
            call.sent = True
            try:
                async with asyncio.timeout(db.timeout):
                    if not conn.autocommit:
                        await conn.set_autocommit(True)
                    return await work(conn)
            except TimeoutError as exc:
                self._lost = f"PostgreSQL did not answer {action} within {db.timeout:g} s"
                fate = "may have been committed" if self._in_doubt else "is lost, not committed"
                raise StoreReplyLostError(
                    f"{self._lost}; the run's group of writes {fate}"
                ) from exc

    def _begin(self) -> tuple[str, ...]:
        return () if self._begun else (*self.database.begin_statements, self._idle_bound())

    async def _in_group(
        self, conn: psycopg.AsyncConnection[Any], sql: str, params: Mapping[str, Any]
    ) -> list[Row]:
        committing, self._commit_next = self._commit_next, False
        after = ("RELEASE SAVEPOINT adk_write", *(("COMMIT",) if committing else ()))
        try:
            # One round trip, which leaves the server's idle timer armed (``batched``),
            # unless it ends the transaction.
            (rows,) = await batched(
                conn,
                (*self._begin(), "SAVEPOINT adk_write"),
                [(sql, params)],
                after,
                self.database.prepared,
            )
        except BaseException as exc:
            await self._undone(conn, "adk_write", TransactionStatus.INERROR)
            if committing and self._lost is not None:
                self._in_doubt = _commit_in_doubt(conn, exc)
                if self._in_doubt:
                    self._lost = (
                        "the reply to the message that carried the COMMIT of the run's group "
                        "of writes was lost; it may have been committed"
                    )
            raise
        if committing:
            await self._committed()
        else:
            self._begun = True
        return rows

    async def _committed(self) -> None:
        """The COMMIT rode with the statement that just answered: the group is closed (a
        later write goes alone) and its connection goes back."""
        self._leave()
        conn, self._conn = self._conn, None
        self._begun = False
        if conn is not None:
            with suppress(Exception):
                await self.database.pool.putconn(conn)

    async def _together_in_group(
        self,
        conn: psycopg.AsyncConnection[Any],
        statements: Sequence[Statement],
        check: Callable[[list[list[Row]]], None],
    ) -> list[list[Row]]:
        try:
            # Rolled back to if ``check`` refuses; otherwise left for the group's COMMIT
            # to end, rather than released in a round trip of its own.
            results = await batched(
                conn,
                (*self._begin(), "SAVEPOINT adk_together"),
                statements,
                prepared=self.database.prepared,
            )
            self._begun = True
            check(results)
        except BaseException:
            await self._undone(
                conn, "adk_together", TransactionStatus.INERROR, TransactionStatus.INTRANS
            )
            raise
        return results

    async def _undone(
        self, conn: psycopg.AsyncConnection[Any], savepoint: str, *when: TransactionStatus
    ) -> None:
        """After a write failed: back to its savepoint (when the transaction is in one of
        ``when``), the group going on; or the group lost, if its transaction is gone."""
        if conn.info.transaction_status in when:
            with suppress(psycopg.Error):
                await conn.execute(f"ROLLBACK TO SAVEPOINT {savepoint}", prepare=False)
                await conn.execute(f"RELEASE SAVEPOINT {savepoint}", prepare=False)
        status = conn.info.transaction_status
        if status is TransactionStatus.INTRANS:
            self._begun = True
        elif self._begun or status is not TransactionStatus.IDLE:
            self._lost = (
                "the run's group of writes was rolled back by PostgreSQL or lost with its "
                "connection; nothing of it was committed"
            )

    def _idle_bound(self) -> str:
        # A holder paused inside its group (SIGSTOP, a frozen VM) would hold the run's rows
        # until it woke: the server ends such a session instead, and the group is lost.
        # (It fires only because each write ends with a ReadyForQuery: see ``batched``.)
        idle_ms = max(1000, int(self.database.timeout * 2000))
        return f"SELECT set_config('idle_in_transaction_session_timeout', '{idle_ms}', true)"

    async def commit(self) -> None:
        """Commit what joined and give the connection back; the group is closed after,
        whatever happened."""
        if not self.active:
            return
        # Closed to late writes first: they go on connections of their own.
        self._leave()
        conn, self._conn = self._conn, None
        try:
            if self._lost is not None:
                if self._in_doubt:
                    raise StoreReplyLostError(self._lost)
                raise StoreUnavailableError(self._lost)
            if conn is None or not self._begun:
                return
            timeout = self.database.timeout
            with driver_errors("committing a run's writes") as call:
                call.sent = True
                try:
                    async with asyncio.timeout(timeout):
                        await conn.execute("COMMIT", prepare=False)
                except TimeoutError as exc:
                    raise StoreReplyLostError(
                        f"PostgreSQL did not answer the COMMIT of a run's writes within "
                        f"{timeout:g} s; they may have been committed"
                    ) from exc
        finally:
            if conn is not None:
                # One still inside a transaction (lost, or a COMMIT that timed out) is
                # rolled back or discarded by the pool, never handed out as it is.
                with suppress(Exception):
                    await self.database.pool.putconn(conn)


def _commit_in_doubt(conn: psycopg.AsyncConnection[Any], exc: BaseException) -> bool:
    """Whether a message that ended with the group's COMMIT, and failed with ``exc``, may
    have committed. Not if the transaction is still open (the COMMIT was never reached);
    nor if the server answered with an error once it was over (the COMMIT itself failed,
    a serialization failure or a timeout as much as a constraint: a statement failing
    before it leaves the transaction aborted, not over); nor if the server had ended the
    session for idling in the transaction before the message came. Anything else (the
    connection lost, the wait cancelled) cannot tell."""
    status = conn.info.transaction_status
    if status in (TransactionStatus.INTRANS, TransactionStatus.INERROR):
        return False
    sqlstate = exc.sqlstate if isinstance(exc, psycopg.Error) else None
    if sqlstate == _IDLE_SESSION_ENDED:
        return False
    return not (status is TransactionStatus.IDLE and sqlstate is not None)


# The server ended the session for idling inside its transaction (``_idle_bound``).
_IDLE_SESSION_ENDED = "25P03"
