"""Writes that commit together: an optional capability of a backend whose stores share one
database (SQLite's file; a PostgreSQL pool).

A run's writes between two moments when something leaves the process (a model call, a tool
call) need not each be durable on their own: only the order the promises rest on matters,
and that order holds when they commit as one transaction *before* the next thing leaves.
The runner opens a group, the stores' writes of the run join it (whichever store makes
them, as long as it shares the group's database), and the runner commits it before it sends
anything. Writes of other runs, and of stores elsewhere, commit on their own as always.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

__all__ = ["CommitsWithNext", "GroupedWrites", "WriteGroup"]


class WriteGroup(Protocol):
    """One transaction that a run's writes join from ``begin`` until ``commit``."""

    async def begin(self) -> None:
        """Open the group for the calling attempt (inside ``stores.grouping.group_scope``);
        it may wait for another run's group on the same database to commit first."""
        ...

    async def commit(self) -> None:
        """Commit whatever joined (nothing to do if nothing did); the group is closed after,
        whether it succeeded or not. A failure is the backend's typed error:
        ``StoreReplyLostError`` when it cannot be told whether the commit took effect,
        ``StoreUnavailableError`` when it certainly did not."""
        ...


@runtime_checkable
class GroupedWrites(Protocol):
    """A store whose writes, and those of the stores sharing its database, can join one
    transaction (``stores.grouping``)."""

    def write_group(self) -> WriteGroup:
        """A new, not yet open, group on this store's database (``grouping.begin``)."""
        ...

    def joins(self, group: WriteGroup) -> bool:
        """Whether this store's writes join ``group`` while it is open (it is a group on
        this store's database)."""
        ...


@runtime_checkable
class CommitsWithNext(Protocol):
    """A ``GroupedWrites`` store whose groups can send their COMMIT with their last
    statement (optional; asked once a run)."""

    def commit_with_next(self, group: WriteGroup) -> None:
        """A hint about ``group`` (one of this store's): its next single statement is its
        last before ``commit``, so the COMMIT may go with it (one round trip fewer). Once
        that statement has answered, the group is committed and closed, and ``commit`` has
        nothing left to do; a statement that fails is undone alone and the group goes on,
        uncommitted. ``commit`` is called all the same, and says how the group ended
        (``StoreReplyLostError`` when the reply of the statement carrying the COMMIT was
        lost: it may have committed). Any other group: nothing."""
        ...
