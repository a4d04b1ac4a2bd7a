"""Group commit across runs on one SQLite file: the writes queued while the thread was busy
run in one transaction, each in a savepoint of its own, and share one COMMIT (one fsync).

The one connection already runs every write in turn; what batching changes is only where
the COMMITs fall. Each write is still read, decided and written in queue order, seeing the
writes before it, so the outcome is the one the same writes had as transactions of their
own. A write that raises is undone alone (its savepoint), as its own transaction would have
been rolled back. Nobody hears of a write before the COMMIT that makes it durable; if that
COMMIT fails, every write of the batch hears it (undone, or in doubt, as SQLite says).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import sqlite3
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["BatchOutcome", "PendingWrite", "run_batch", "savepoint_name"]

_log = logging.getLogger("tesserix_adk.stores.sqlite")


def savepoint_name() -> str:
    """A savepoint name for one database: random, so no write can know it, and the same
    for every write, so its statements stay in the connection's statement cache."""
    return f"adk_{secrets.token_hex(6)}"


@dataclass(slots=True)
class PendingWrite:
    """One caller's write waiting for the thread: what to run, and where to say how it
    went (the caller's own event loop)."""

    fn: Callable[[sqlite3.Connection], Any]
    loop: asyncio.AbstractEventLoop
    done: asyncio.Future[Any]
    woken: asyncio.Future[None] = field(init=False)

    def __post_init__(self) -> None:
        self.woken = self.loop.create_future()

    def settle(self, outcome: BatchOutcome | object) -> None:
        """Hand ``outcome`` (a ``BatchOutcome`` or a sentinel) to the caller, thread-safe."""
        with contextlib.suppress(RuntimeError):  # a loop closed meanwhile
            self.loop.call_soon_threadsafe(_settle, self.done, outcome)


def _settle(done: asyncio.Future[Any], outcome: BatchOutcome | object) -> None:
    if done.done():  # the caller was cancelled; the write ran (or not) all the same
        return
    if isinstance(outcome, BatchOutcome) and outcome.error is not None:
        done.set_exception(outcome.error)
    elif isinstance(outcome, BatchOutcome):
        done.set_result(outcome.value)
    else:
        done.set_result(outcome)


@dataclass(frozen=True, slots=True)
class BatchOutcome:
    """What one write of a batch came to: its value, or the error its caller raises."""

    value: Any = None
    error: BaseException | None = None


class CommitInDoubt(Exception):
    """COMMIT failed after SQLite ended the transaction: committed or not, unknown."""

    def __init__(self, error: sqlite3.Error) -> None:
        super().__init__(str(error))
        self.error = error


def run_batch(
    conn: sqlite3.Connection,
    fns: Sequence[Callable[[sqlite3.Connection], Any]],
    *,
    path: str,
    savepoint: str,
) -> tuple[list[BatchOutcome], bool]:
    """Run ``fns`` in one ``BEGIN IMMEDIATE`` … ``COMMIT``, each in a savepoint; the
    outcome of each and whether anything was committed.

    A write whose error made SQLite roll the whole transaction back (a full disk, an I/O
    error, an interrupt) fails alone: the others, unanswered so far, run again in a fresh
    transaction, as they would have alone. Errors come back raw (a ``sqlite3.Error`` or a
    ``CommitInDoubt``): the caller translates them, as it does for a transaction of one.
    ``savepoint`` is the name each write's savepoint takes: one no write can know (see
    ``savepoint_name``), so none can shadow it and be rolled back only in part.
    """
    outcomes = [BatchOutcome() for _ in fns]
    todo = list(range(len(fns)))
    committed = False
    while todo:  # each round answers at least one write, so this ends
        try:
            todo, done = _round(conn, fns, todo, outcomes, path, savepoint)
        except Exception as exc:  # a savepoint statement: the round was rolled back
            for i in todo:
                outcomes[i] = BatchOutcome(error=exc)
            break
        committed = committed or done
    return outcomes, committed


def _round(
    conn: sqlite3.Connection,
    fns: Sequence[Callable[[sqlite3.Connection], Any]],
    todo: list[int],
    outcomes: list[BatchOutcome],
    path: str,
    savepoint: str,
) -> tuple[list[int], bool]:
    """One transaction over the writes ``todo``; the ones to run again, and whether it
    committed."""
    if conn.in_transaction:
        # A write group whose owner vanished without committing: what it held is lost, as
        # it would be had the process died there.
        _log.warning("rolling back a write group left open on %s", path)
        conn.execute("ROLLBACK")
    try:
        conn.execute("BEGIN IMMEDIATE")
    except sqlite3.Error as exc:
        for i in todo:
            outcomes[i] = BatchOutcome(error=exc)
        return [], False
    kept: list[int] = []  # the writes that stand, to be committed
    try:
        for at, i in enumerate(todo):
            conn.execute(f"SAVEPOINT {savepoint}")
            try:
                value = fns[i](conn)
            except BaseException as exc:
                outcomes[i] = BatchOutcome(error=exc)
                if conn.in_transaction:
                    conn.execute(f"ROLLBACK TO {savepoint}")
                    conn.execute(f"RELEASE {savepoint}")
                    continue
                if _rolled_back_by_sqlite(exc):
                    # SQLite rolled the whole transaction back for this write: the others
                    # were not written and nobody heard of them; they go again.
                    return kept + todo[at + 1 :], False
                # The write ended the transaction itself, then raised: whether what came
                # before was committed cannot be told.
                _in_doubt(kept, outcomes, "a write of the batch ended its transaction")
                return todo[at + 1 :], False
            if not conn.in_transaction:
                # The write ran COMMIT or ROLLBACK itself: it and those before it were
                # committed or undone, which cannot be told.
                _in_doubt([*kept, i], outcomes, "a write of the batch ended its transaction")
                return todo[at + 1 :], False
            conn.execute(f"RELEASE {savepoint}")
            kept.append(i)
            outcomes[i] = BatchOutcome(value=value)
        try:
            conn.execute("COMMIT")
        except sqlite3.Error as exc:
            # Still in the transaction (SQLITE_BUSY, a deferred constraint): nothing was
            # committed, and the rollback below makes sure. Otherwise SQLite ended it while
            # writing it out (an I/O error, a full disk): whether it reached the file
            # cannot be told.
            error: Exception = exc if conn.in_transaction else CommitInDoubt(exc)
            for j in kept:
                outcomes[j] = BatchOutcome(error=error)
            return [], False
        return [], True
    finally:
        if conn.in_transaction:
            with contextlib.suppress(sqlite3.Error):
                conn.execute("ROLLBACK")


def _in_doubt(indices: Sequence[int], outcomes: list[BatchOutcome], why: str) -> None:
    for j in indices:
        outcomes[j] = BatchOutcome(error=CommitInDoubt(sqlite3.OperationalError(why)))


# The errors after which SQLite may roll back the whole transaction by itself
# (https://www.sqlite.org/lang_transaction.html, "Response To Errors Within A Transaction").
_ROLLING_BACK = frozenset(
    {
        sqlite3.SQLITE_FULL,
        sqlite3.SQLITE_IOERR,
        sqlite3.SQLITE_BUSY,
        sqlite3.SQLITE_NOMEM,
        sqlite3.SQLITE_INTERRUPT,
    }
)


def _rolled_back_by_sqlite(exc: BaseException) -> bool:
    code = getattr(exc, "sqlite_errorcode", -1) & 0xFF
    return isinstance(exc, sqlite3.Error) and code in _ROLLING_BACK
