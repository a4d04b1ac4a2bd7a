"""The SQLite file the stores share: its one connection, the thread that uses it, the
schema check and upgrade, and the translation of driver errors into the kit's.

One connection, used from one worker thread of its own, so the event loop never waits on
SQLite. Every decision (a fence, a claim, a lease) is read, decided and written inside
``BEGIN IMMEDIATE``, which takes the file's write lock first, so several processes on one
file see each decision as atomic; ``busy_timeout`` (5 s) is how long one waits for
another's write.

Durability: ``synchronous="full"`` (the default) syncs the WAL on every commit, so a
committed claim or frontier survives a power loss, not only a process death.
``synchronous="normal"`` syncs only at WAL checkpoints: faster, and still safe when the
*process* dies, but a power loss or OS crash may lose the last commits — a claim among them,
which could let a call run twice. Choose it only where that is acceptable.

Group commit across runs (``batching``): writes that queue up while the thread is busy run
in one transaction, a savepoint each, and share its COMMIT, so K runs in one process pay
for far fewer than K fsyncs; each write decides as it would have alone.

Write groups (``protocols.grouping``): while a run has a group open, that run's writes go
into one ``BEGIN IMMEDIATE`` transaction, each in a savepoint of its own (a write that
fails is undone alone), committed by ``SqliteWriteGroup.commit``; everybody else's calls
wait for that commit, since the one connection is inside the group's transaction till then.
The group takes the connection at its first call; who holds it is kept in the worker
thread, so callers on other threads and event loops wait alike; a waiter is woken on its
own loop, and no thread blocks. Once the group's transaction is open, its small calls run
on the caller's own thread (``grouping``); ``_lock`` keeps the connection to one thread at
a time.

Nothing here creates a file, a directory or a table, except ``create_schema()`` (what
``tesserix schema apply`` runs).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import sqlite3
import threading
import weakref
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Literal, TypeVar

from tesserix_adk.errors import (
    ConfigurationError,
    StoreReplyLostError,
)
from tesserix_adk.stores.grouping import joined
from tesserix_adk.stores.sqlite.batching import (
    BatchOutcome,
    CommitInDoubt,
    PendingWrite,
    run_batch,
    savepoint_name,
)
from tesserix_adk.stores.sqlite.failures import (
    foreign_tables,
    missing_schema,
    missing_tables,
    refuse_null_keys,
    sqlite_url,
    translate,
    wrong_version,
)
from tesserix_adk.stores.sqlite.grouping import HELD, Held, SqliteWriteGroup, Weight, wake
from tesserix_adk.stores.sqlite.schema import SqliteSchema, statements

__all__ = ["SqliteDatabase"]

_log = logging.getLogger("tesserix_adk.stores.sqlite")

_SYNCHRONOUS = {"full": "FULL", "normal": "NORMAL"}

T = TypeVar("T")


class SqliteDatabase:
    """One SQLite file shared by the six stores: its connection, thread and schema.

    Nothing touches the file until the first store call; that call opens it read-write
    (never creating it) and checks the schema version, so a missing file or schema is a
    ``ConfigurationError`` naming ``tesserix schema apply``. ``create_schema()`` is the one
    call that creates the file (and its directory). Close with ``aclose()``.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        synchronous: Literal["full", "normal"] | str = "full",
        busy_timeout: float = 5.0,
    ) -> None:
        mode = str(synchronous).lower()
        if mode not in _SYNCHRONOUS:
            raise ConfigurationError(f"synchronous must be 'full' or 'normal', got {synchronous!r}")
        if not busy_timeout >= 0:
            raise ConfigurationError(f"busy_timeout must be >= 0 seconds, got {busy_timeout!r}")
        # Resolved now, so a relative path means the directory the stores were opened in.
        self.path = os.path.abspath(os.fspath(path))
        self.synchronous = mode
        self.busy_timeout = float(busy_timeout)
        self._executor: ThreadPoolExecutor | None = None
        # Touched by the executor's one thread, or by a group's caller on its own thread
        # (``SqliteWriteGroup._here``), always under ``_lock``.
        self._conn: sqlite3.Connection | None = None
        # Opened read-only (the file or its directory could not be written): not kept.
        self._read_only = False
        # Whether that connection's file is in WAL mode, where a call inside a write
        # transaction never waits on another connection's lock (``grouping``).
        self._wal = False
        self._lock = threading.Lock()
        self._handoffs = 0
        self._closed = False
        # The write group holding the connection, from its first call to its commit, and
        # the callers waiting for it to let go, each woken on its own event loop. Changed
        # only in the executor's thread (under ``_lock``), so whichever thread or loop a
        # caller runs on, they are one state (see the docstring).
        self._held: SqliteWriteGroup | None = None
        self._waiting: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        self._commits = 0
        # Writes waiting for the thread; whatever is here when it gets to them shares one
        # transaction (``batching``). A deque: appended on loops, emptied in the thread.
        self._writes: deque[PendingWrite] = deque()
        self._savepoint = savepoint_name()
        # Read from the package's migration files now, so the first call cannot fail on it.
        self.schema = SqliteSchema.load()

    def __repr__(self) -> str:
        return f"SqliteDatabase({self.path!r}, synchronous={self.synchronous!r})"

    @property
    def url(self) -> str:
        """The ``open_stores`` URL of this file."""
        return sqlite_url(self.path)

    @property
    def commits(self) -> int:
        """How many transactions this process committed on the file (for counting in
        tests and benchmarks)."""
        return self._commits

    @property
    def handoffs(self) -> int:
        """How many jobs this process handed to the worker thread (for counting in tests
        and benchmarks: each is a hop there and back)."""
        return self._handoffs

    # --- running SQL ---------------------------------------------------------------------

    async def write(self, fn: Callable[[sqlite3.Connection], T], *, weight: Weight = None) -> T:
        """Run ``fn(connection)`` in ``BEGIN IMMEDIATE``, in the worker thread; committed
        (with the other writes queued meanwhile) if it returns, undone if it raises; the
        answer comes after the COMMIT. Inside the caller's open write group it runs in the
        group's transaction instead, committed with the group; ``weight``, the bytes it
        moves where the caller can tell (``grouping.Weight``), lets a small one run on the
        caller's thread once the group's transaction is open."""
        group = joined(self)
        if isinstance(group, SqliteWriteGroup):
            return await group.join(fn, savepoint=True, weight=weight)
        while True:
            loop = asyncio.get_running_loop()
            pending = PendingWrite(fn, loop, loop.create_future())
            if self._closed:
                raise ConfigurationError(f"the SQLite store {self.path} was closed")
            self._writes.append(pending)
            try:
                # Its own turn in the thread: an earlier turn may have run it by then.
                self._queue(self._drain)
            except BaseException:
                try:
                    self._writes.remove(pending)
                except ValueError:
                    pass  # an earlier turn took it (before a close): its answer comes
                else:
                    raise
            outcome = await pending.done
            if not isinstance(outcome, Held):
                return outcome  # type: ignore[no-any-return]
            await pending.woken

    def _drain(self) -> None:
        """Run every write queued so far in one transaction (the worker thread)."""
        batch: list[PendingWrite] = []
        with contextlib.suppress(IndexError):
            while True:
                batch.append(self._writes.popleft())
        if not batch:
            return
        if self._held is not None:
            for pending in batch:
                self._waiting.append((pending.loop, pending.woken))
                pending.settle(HELD)
            return
        try:
            outcomes, committed = run_batch(
                self._connection(),
                [p.fn for p in batch],
                path=self.path,
                savepoint=self._savepoint,
            )
        except BaseException as exc:  # opening the connection: nothing of it was written
            outcomes, committed = [BatchOutcome(error=exc)] * len(batch), False
        if committed:
            self._commits += 1
        for pending, outcome in zip(batch, outcomes, strict=True):
            if outcome.error is not None:
                outcome = BatchOutcome(error=self._translated(outcome.error))
            pending.settle(outcome)

    async def read(self, fn: Callable[[sqlite3.Connection], T], *, weight: Weight = None) -> T:
        """Run ``fn(connection)`` in a read transaction (one snapshot), in the worker thread
        (inside the caller's open write group: in its transaction, seeing its writes, and
        on the caller's thread if ``weight``, the bytes it reads, is small)."""
        group = joined(self)
        if isinstance(group, SqliteWriteGroup):
            # A read undoes nothing if it fails: no savepoint.
            return await group.join(fn, savepoint=False, weight=weight)
        return await self._when_free(functools.partial(self._reading, fn))

    def write_group(self) -> SqliteWriteGroup:
        """A new write group on this file (``protocols.grouping``)."""
        return SqliteWriteGroup(self)

    async def _when_free(self, job: Callable[[], T]) -> T:
        """``job`` in the worker thread once no write group holds the connection: while one
        does, wait (on this caller's own loop) for it to let go, then try again."""
        while True:
            loop = asyncio.get_running_loop()
            woken: asyncio.Future[None] = loop.create_future()
            done = await self._submit(functools.partial(self._unless_held, job, loop, woken))
            if not isinstance(done, Held):
                return done
            await woken

    def _unless_held(
        self,
        job: Callable[[], T],
        loop: asyncio.AbstractEventLoop,
        woken: asyncio.Future[None],
    ) -> T | Held:
        if self._held is not None:
            self._waiting.append((loop, woken))
            return HELD
        return job()

    def _let_go(self) -> None:
        self._held = None
        waiting, self._waiting = self._waiting, []
        for loop, woken in waiting:
            with contextlib.suppress(RuntimeError):  # a loop closed meanwhile
                loop.call_soon_threadsafe(wake, woken)

    async def create_schema(self) -> None:
        """Create the file, its directory and the tables (idempotent); set WAL mode.

        Refuses (``ConfigurationError``) a file whose schema is newer than this kit's.
        """
        await self._submit(self._create_schema)

    async def verify(self) -> None:
        """Check the file exists with this kit's schema version and every table of it
        (``SchemaMismatchError``)."""

        def check() -> None:
            conn = self._connection()
            self._check_schema(conn)
            tables = "SELECT name FROM sqlite_master WHERE type = 'table'"
            found = {row[0] for row in conn.execute(tables)}
            missing = [t for t in self.schema.tables if t not in found]
            if missing:
                raise missing_tables(self.path, missing)

        await self._submit(check)

    async def aclose(self) -> None:
        """Close the connection and stop the worker thread; idempotent."""
        if self._closed:
            return
        self._closed = True
        executor = self._executor
        if executor is None:
            return
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(executor, self._close_connection)
        finally:
            executor.shutdown(wait=False)

    async def _submit(self, call: Callable[[], T]) -> T:
        # A cancelled caller stops waiting: its call either never starts or runs to its
        # commit or rollback in the thread, so the connection is never left inside one.
        return await self._queue(call)

    def _queue(self, call: Callable[[], T]) -> asyncio.Future[T]:
        """``call`` queued for the worker thread now (calls run in the order queued)."""
        if self._closed:
            raise ConfigurationError(f"the SQLite store {self.path} was closed")
        self._handoffs += 1
        if self._executor is None:
            executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tesserix-sqlite")
            # A database dropped without aclose() still lets its thread go.
            weakref.finalize(self, executor.shutdown, wait=False)
            self._executor = executor
        loop = asyncio.get_running_loop()
        return loop.run_in_executor(self._executor, self._translating, call)

    def _translating(self, call: Callable[[], T]) -> T:
        try:
            with self._lock:
                return call()
        except (CommitInDoubt, sqlite3.Error) as exc:
            raise self._translated(exc) from exc

    def _translated(self, exc: BaseException) -> BaseException:
        """A driver error as the kit's (others unchanged), its cause kept."""
        if isinstance(exc, CommitInDoubt):
            error: BaseException = StoreReplyLostError(
                f"the SQLite store {self.path} failed while committing, after SQLite began "
                f"writing the transaction out; it may have been committed: {exc.error}"
            )
            error.__cause__ = exc.error
            return error
        if isinstance(exc, sqlite3.Error):
            error = translate(exc, self.path, self.busy_timeout)
            error.__cause__ = exc
            return error
        return exc

    def _reading(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """``fn`` in a read transaction (one snapshot of the file)."""
        conn = self._connection()
        if conn.in_transaction:
            # A group whose owner vanished without committing: what it held is lost, as it
            # would be had the process died there.
            _log.warning("rolling back a write group left open on %s", self.path)
            conn.execute("ROLLBACK")
        try:
            conn.execute("BEGIN")
            result = fn(conn)
            conn.execute("COMMIT")
            return result
        finally:
            if conn.in_transaction:
                with contextlib.suppress(sqlite3.Error):
                    conn.execute("ROLLBACK")

    def _open(self, mode: str) -> sqlite3.Connection:
        uri = Path(self.path).as_uri() + f"?mode={mode}"
        # Used by one thread at a time (``_lock``), not always the same one (``_inline``).
        conn = sqlite3.connect(
            uri,
            uri=True,
            timeout=self.busy_timeout,
            isolation_level=None,
            cached_statements=256,
            check_same_thread=False,
        )
        try:
            # PRAGMAs take no bound parameters; both values come from closed sets.
            conn.execute(f"PRAGMA busy_timeout = {int(self.busy_timeout * 1000)}")
            conn.execute(f"PRAGMA synchronous = {_SYNCHRONOUS[self.synchronous]}")
        except BaseException:
            conn.close()
            raise
        return conn

    def _connection(self) -> sqlite3.Connection:
        if self._conn is not None and self._read_only and not self._conn.in_transaction:
            # A read-only connection is opened afresh for each use: immutable=1 promises
            # SQLite the file never changes, so a kept one would never see what others
            # write, and the file may have turned writable since.
            self._conn.close()
            self._conn = None
        if self._conn is None:
            # mode=rw: a missing file is an error, never an empty new database.
            try:
                self._conn = self._checked("rw")
            except sqlite3.OperationalError as exc:
                code = getattr(exc, "sqlite_errorcode", -1) & 0xFF
                # A directory this process may not write (WAL needs its -shm file there),
                # or a read-only filesystem (which SQLite reports as "cannot open"): open
                # read-only, so the store can still be inspected; writes are refused.
                unwritable = code == sqlite3.SQLITE_READONLY or (
                    code == sqlite3.SQLITE_CANTOPEN and Path(self.path).is_file()
                )
                if not unwritable:
                    raise
                self._conn = self._checked(self._read_only_mode())
                self._read_only = True
            else:
                self._read_only = False
            (mode,) = self._conn.execute("PRAGMA journal_mode").fetchone()
            self._wal = str(mode).lower() == "wal"
        return self._conn

    def _checked(self, mode: str) -> sqlite3.Connection:
        """A connection opened in ``mode`` whose schema is the one this kit needs."""
        conn = self._open(mode)
        try:
            self._check_schema(conn)
        except BaseException:
            conn.close()
            raise
        return conn

    def _read_only_mode(self) -> str:
        # immutable=1 reads without the -shm file, which is only right while no write-ahead
        # log holds transactions the main file does not have yet.
        wal = Path(f"{self.path}-wal")
        if wal.exists() and wal.stat().st_size > 0:
            return "ro"
        return "ro&immutable=1"

    def _close_connection(self) -> None:
        with self._lock:  # never under a group's call running on its caller's thread
            self._close_held()

    def _close_held(self) -> None:
        if self._held is not None:
            # A group can no longer commit on a closed store: it is lost, and whoever waits
            # for it is woken to find the store closed.
            self._held.lost = f"the SQLite store {self.path} was closed"
            self._let_go()
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _check_schema(self, conn: sqlite3.Connection) -> None:
        try:
            row = conn.execute("SELECT version FROM adk_schema_version WHERE id = 1").fetchone()
        except sqlite3.OperationalError as exc:
            if "no such table" not in str(exc):
                raise
            row = None
        if row is None:
            raise missing_schema(self.path)
        if row[0] != self.schema.version:
            raise wrong_version(self.path, row[0], self.schema.version)

    def _create_schema(self) -> None:
        directory = os.path.dirname(self.path)
        try:
            os.makedirs(directory, exist_ok=True)
        except OSError as exc:
            raise ConfigurationError(
                f"cannot create the directory of the SQLite store {self.path}: {exc}"
            ) from exc
        conn = self._open("rwc")
        try:
            # WAL is a property of the file and cannot change inside a transaction: a new
            # file takes it first (one that cannot is left empty), a file holding anything
            # after the schema commits (one refused below is left as it was).
            ((objects,),) = conn.execute("SELECT count(*) FROM sqlite_master").fetchall()
            if not objects:
                self._use_wal(conn)
            conn.execute("BEGIN IMMEDIATE")
            try:
                exists = conn.execute(
                    "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?",
                    ("adk_schema_version",),
                ).fetchone()
                version = self.schema.version
                if exists is not None:
                    row = conn.execute(
                        "SELECT version FROM adk_schema_version WHERE id = 1"
                    ).fetchone()
                    if row is not None:
                        version = row[0]
                if not isinstance(version, int) or not 1 <= version <= self.schema.version:
                    raise wrong_version(self.path, version, self.schema.version)
                if version < 2:
                    refuse_null_keys(conn, self.path, self.schema.version)
                for migration in self.schema.migrations[version:]:
                    for statement in statements(migration):
                        conn.execute(statement)
                # Idempotent: on a file at this version it puts back a table dropped by hand.
                for statement in statements(self.schema.ddl):
                    conn.execute(statement)
                # CREATE TABLE IF NOT EXISTS leaves a table of the name alone, whatever it
                # holds: one that lacks a column of the kit's is not the kit's to stamp.
                foreign_tables(conn, self.path, self.schema.shapes())
                conn.execute(
                    "UPDATE adk_schema_version SET version = ? WHERE id = 1",
                    (self.schema.version,),
                )
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise
            if objects:
                self._use_wal(conn)
        finally:
            conn.close()

    def _use_wal(self, conn: sqlite3.Connection) -> None:
        (mode,) = conn.execute("PRAGMA journal_mode = WAL").fetchone()
        if str(mode).lower() != "wal":
            raise ConfigurationError(
                f"the SQLite store {self.path} cannot use WAL mode (it stays {mode!r}); "
                f"put it on a local file system"
            )
