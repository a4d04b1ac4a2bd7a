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
import sqlite3
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tesserix_adk.errors import StoreUnavailableError

__all__ = ["BatchOutcome", "PendingWrite", "run_batch"]

_log = logging.getLogger("tesserix_adk.stores.sqlite")


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
) -> tuple[list[BatchOutcome], bool]:
    """Run ``fns`` in one ``BEGIN IMMEDIATE`` … ``COMMIT``, each in a savepoint; the
    outcome of each (errors raw: the caller translates them) and whether it committed.

    A raw ``sqlite3.Error`` or ``CommitInDoubt`` in an outcome is for the caller to
    translate, as it does for a transaction of one.
    """
    if conn.in_transaction:
        # A write group whose owner vanished without committing: what it held is lost, as
        # it would be had the process died there.
        _log.warning("rolling back a write group left open on %s", path)
        conn.execute("ROLLBACK")
    try:
        conn.execute("BEGIN IMMEDIATE")
    except sqlite3.Error as exc:
        return [BatchOutcome(error=exc)] * len(fns), False
    outcomes: list[BatchOutcome] = []
    kept: list[int] = []  # the writes that stand, to be committed
    try:
        for i, fn in enumerate(fns):
            if not conn.in_transaction:
                # An earlier write's failure ended the whole transaction: none of this
                # batch was written, and the rest are not tried in one nobody commits.
                outcomes.append(BatchOutcome(error=_lost(path)))
                continue
            conn.execute("SAVEPOINT adk_batch")
            try:
                value = fn(conn)
            except Exception as exc:
                if conn.in_transaction:
                    conn.execute("ROLLBACK TO adk_batch")
                    conn.execute("RELEASE adk_batch")
                else:
                    for j in kept:
                        outcomes[j] = BatchOutcome(error=_lost(path))
                    kept.clear()
                outcomes.append(BatchOutcome(error=exc))
                continue
            conn.execute("RELEASE adk_batch")
            kept.append(i)
            outcomes.append(BatchOutcome(value=value))
        if not conn.in_transaction:
            return outcomes, False
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
            return outcomes, False
        return outcomes, True
    finally:
        if conn.in_transaction:
            with contextlib.suppress(sqlite3.Error):
                conn.execute("ROLLBACK")


def _lost(path: str) -> StoreUnavailableError:
    return StoreUnavailableError(
        f"SQLite rolled back the transaction on {path} this write was batched in (another "
        "write of it failed); nothing of it was written"
    )
