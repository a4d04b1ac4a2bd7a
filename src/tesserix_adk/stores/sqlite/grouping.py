"""Write groups on one SQLite file: the group a run opens, how its calls join its
transaction, and what a caller finds while another's group holds the connection
(``SqliteDatabase``'s docstring says how they wait).

A group takes the connection at its first call, in the database's worker thread: that call
begins the transaction (``BEGIN IMMEDIATE`` may wait on another process). From then on a
small call (``weight`` at most ``INLINE_BYTES``) runs on the caller's own thread, under the
database's lock: inside the open transaction, on a file in WAL mode, it cannot wait on a
lock, and the hop to the thread and back would cost more than its statements. A caller
that finds the lock taken (the thread is using the connection) queues for the thread
instead of waiting on its loop. A call that reads back what it cannot know the size of (a
record and its outcome) weighs it first, with a statement of its own (``Weight``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import sqlite3
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from tesserix_adk.errors import ConfigurationError, StoreReplyLostError, StoreUnavailableError
from tesserix_adk.stores.grouping import OpenGroup
from tesserix_adk.stores.sqlite.batching import CommitInDoubt

if TYPE_CHECKING:
    from tesserix_adk.stores.sqlite.database import SqliteDatabase

__all__ = ["HELD", "INLINE_BYTES", "Held", "SqliteWriteGroup", "Weight", "wake"]

T = TypeVar("T")

Weight = int | Callable[[sqlite3.Connection], int] | None
"""What a call moves, in bytes: known, measured on the connection right before the call
would run on the caller's thread, or unknown (``None``: it goes to the thread)."""

# A call of a group moving at most this many bytes runs on the caller's thread: the bound
# the checkpointer uses to encode a payload on the loop, so a large one still never stalls
# it (leases renew on that loop).
INLINE_BYTES = 16 * 1024


class Held:
    """What a call finds while another's write group holds the connection."""


HELD = Held()


class _NotRun:
    """What ``_here`` returns when the call must go to the worker thread instead."""


_NOT_RUN = _NotRun()


def _light(conn: sqlite3.Connection, weigh: Callable[[sqlite3.Connection], int]) -> bool:
    """Whether what ``weigh`` measures is small enough for the caller's thread; an error
    measuring it sends the call to the thread, which reports the call's own."""
    try:
        return weigh(conn) <= INLINE_BYTES
    except sqlite3.Error:
        return False


def wake(woken: asyncio.Future[None]) -> None:
    if not woken.done():
        woken.set_result(None)


class SqliteWriteGroup(OpenGroup):
    """A run's writes on one SQLite file, committed as one transaction."""

    def __init__(self, database: SqliteDatabase) -> None:
        super().__init__(database)
        self.database = database
        # Changed only under the database's lock: whether the group's transaction began,
        # whether its commit ran, and why it is lost if SQLite rolled it back.
        self.begun = False
        self.ended = False
        self.lost: str | None = None
        self.in_doubt = False  # lost, and what joined may have been committed
        # Set on the caller's side at its first call: a group nothing joined holds nothing,
        # so its commit need not go to the thread.
        self.used = False

    async def begin(self) -> None:
        """Open the group for the current attempt: from here its calls on the file join
        it. It takes the connection at its first call (which waits while another group
        holds it), and from then everybody else's calls (any thread, any event loop) wait
        for its commit."""
        self._enter()

    async def commit(self) -> None:
        """Commit what joined; the group is closed after, whatever happened."""
        if not self.active:
            return
        # Closed to late writes first: one that comes now waits for the connection, and so
        # runs after the COMMIT in a transaction of its own, never in one nobody commits.
        self._leave()
        if not self.used:
            return
        # Queued behind every write already sent: the thread runs them in order, and lets
        # go of the connection once the COMMIT is done, however this caller fares.
        database = self.database
        try:
            await database._submit(self._commit)
        except asyncio.CancelledError:
            # Cancelled before the thread began the COMMIT, that job never runs: the group
            # is rolled back and lets go instead (after it in queue order, so a COMMIT that
            # did begin is left alone), or it would hold the connection for good.
            with contextlib.suppress(ConfigurationError):  # closed: nothing is held
                database._queue(self._abandon)
            raise

    async def join(
        self, fn: Callable[[sqlite3.Connection], T], *, savepoint: bool, weight: Weight
    ) -> T:
        """``fn`` in the group's transaction: here if it is small and the transaction is
        open, else in the worker thread, waiting (never blocking) while another group holds
        the connection."""
        self.used = True
        if weight is not None and (callable(weight) or weight <= INLINE_BYTES):
            done = self._here(fn, savepoint, weight)
            if not isinstance(done, _NotRun):
                return done
        while True:
            loop = asyncio.get_running_loop()
            woken: asyncio.Future[None] = loop.create_future()
            result = await self.database._submit(
                functools.partial(self._in_thread, fn, savepoint, loop, woken)
            )
            if not isinstance(result, Held):
                return result
            await woken

    def _here(
        self,
        fn: Callable[[sqlite3.Connection], T],
        savepoint: bool,
        weight: int | Callable[[sqlite3.Connection], int],
    ) -> T | _NotRun:
        """``fn`` on the caller's thread, if the group holds the connection inside its open
        transaction on a file in WAL mode, no other thread is using it, and what it moves
        is small; ``_NOT_RUN`` otherwise."""
        database = self.database
        if not database._lock.acquire(blocking=False):
            return _NOT_RUN  # the worker thread is in it: queue behind it, do not wait here
        try:
            conn = database._conn
            if (
                database._closed
                or conn is None
                or not database._wal
                or database._held is not self
                or not self.begun
                or self.lost is not None
                or not conn.in_transaction
            ):
                return _NOT_RUN  # the thread's path says what is wrong, or begins
            if callable(weight) and not _light(conn, weight):
                return _NOT_RUN
            try:
                return self._joined(conn, fn, savepoint)
            except (CommitInDoubt, sqlite3.Error) as exc:
                raise database._translated(exc) from exc
        finally:
            database._lock.release()

    def _in_thread(
        self,
        fn: Callable[[sqlite3.Connection], T],
        savepoint: bool,
        loop: asyncio.AbstractEventLoop,
        woken: asyncio.Future[None],
    ) -> T | Held:
        """``fn`` inside the group's transaction (the worker thread): the group's first call
        takes the connection (``HELD`` while another group has it: the caller waits for
        ``woken``) and begins the transaction."""
        database = self.database
        if self.lost is None and database._held is not self:
            if self.ended:
                # Never a fresh transaction nobody commits after the group's own ended.
                self.lost = f"the write group on {database.path} had already ended"
            elif self.begun:
                self.lost = f"the write group on {database.path} no longer holds its connection"
            elif database._held is not None:
                database._waiting.append((loop, woken))
                return HELD
            else:
                database._held = self
        if self.lost is not None:
            raise StoreUnavailableError(self.lost)
        conn = database._connection()
        if not conn.in_transaction:
            if self.begun:
                self.lost = f"the write group on {database.path} had already ended"
                raise StoreUnavailableError(self.lost)
            conn.execute("BEGIN IMMEDIATE")
            self.begun = True
        return self._joined(conn, fn, savepoint)

    def _joined(
        self, conn: sqlite3.Connection, fn: Callable[[sqlite3.Connection], T], savepoint: bool
    ) -> T:
        """``fn`` in the open transaction, in a savepoint (a write; a read needs none): a
        failing write is undone alone and the group goes on, unless SQLite rolled the whole
        transaction back (then the group is lost: see ``lost``)."""
        # A name no write can know, so none can shadow it (``batching.savepoint_name``).
        name = self.database._savepoint
        if savepoint:
            conn.execute(f"SAVEPOINT {name}")
        try:
            result = fn(conn)
        except BaseException as exc:
            if conn.in_transaction:
                if savepoint:
                    conn.execute(f"ROLLBACK TO {name}")
                    conn.execute(f"RELEASE {name}")
            elif isinstance(exc, sqlite3.Error):
                # SQLite ended the whole transaction (a full disk, an I/O error): what
                # joined before is gone, and nothing more may join as if it were not.
                self.lost = (
                    f"SQLite rolled back the write group on {self.database.path} ({exc}); "
                    "nothing of it was committed"
                )
            else:
                raise self._ended_by_a_write() from exc
            raise
        if not conn.in_transaction:
            raise self._ended_by_a_write()
        if savepoint:
            conn.execute(f"RELEASE {name}")
        return result

    def _ended_by_a_write(self) -> StoreReplyLostError:
        """A write ran COMMIT or ROLLBACK itself: what joined before it may be committed or
        not, and nothing more may join."""
        self.lost = (
            f"a write ended the write group's transaction on {self.database.path} itself; "
            "what joined it may or may not have been committed"
        )
        self.in_doubt = True
        return StoreReplyLostError(self.lost)

    def _commit(self) -> None:
        """COMMIT (the worker thread), then let go of the connection whatever happened."""
        database = self.database
        self.ended = True
        try:
            self._commit_held()
        finally:
            if database._held is self:
                database._let_go()

    def _commit_held(self) -> None:
        database = self.database
        if self.lost is not None:
            raise (StoreReplyLostError if self.in_doubt else StoreUnavailableError)(self.lost)
        if database._held is not self:
            # Its first call never took the connection (cancelled, or still waiting for
            # another group): nothing joined, and the transaction open now is not its own.
            return
        conn = database._connection()
        if not conn.in_transaction:
            if self.begun:
                raise StoreUnavailableError(
                    f"the write group on {database.path} lost its transaction; nothing of it "
                    "was committed"
                )
            return  # its first write could not begin
        try:
            conn.execute("COMMIT")
        except sqlite3.Error as exc:
            if conn.in_transaction:
                with contextlib.suppress(sqlite3.Error):
                    conn.execute("ROLLBACK")
                raise
            raise CommitInDoubt(exc) from exc
        database._commits += 1

    def _abandon(self) -> None:
        """Roll back and let go of the connection (the worker thread) when the commit was
        called off before it began; nothing if that commit ran."""
        if self.ended:
            return
        self.ended = True
        database = self.database
        if database._held is not self:
            return
        try:
            conn = database._conn
            if conn is not None and conn.in_transaction:
                conn.execute("ROLLBACK")
        finally:
            database._let_go()
