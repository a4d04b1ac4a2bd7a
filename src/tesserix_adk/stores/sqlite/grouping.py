"""Write groups on one SQLite file: the group a run opens, and what a caller finds while
another's group holds the connection (``SqliteDatabase``'s docstring says how they wait)."""

from __future__ import annotations

import asyncio
import functools
from typing import TYPE_CHECKING

from tesserix_adk.stores.grouping import OpenGroup

if TYPE_CHECKING:
    from tesserix_adk.stores.sqlite.database import SqliteDatabase

__all__ = ["HELD", "Held", "SqliteWriteGroup", "wake"]


class Held:
    """What a call finds while another's write group holds the connection."""


HELD = Held()


def wake(woken: asyncio.Future[None]) -> None:
    if not woken.done():
        woken.set_result(None)


class SqliteWriteGroup(OpenGroup):
    """A run's writes on one SQLite file, committed as one transaction."""

    def __init__(self, database: SqliteDatabase) -> None:
        super().__init__(database)
        self.database = database
        # Touched only in the database's thread: whether the group's transaction began,
        # and why it is lost if SQLite rolled it back.
        self.begun = False
        self.lost: str | None = None

    async def begin(self) -> None:
        """Open the group for the current attempt: from here its writes on the file join
        it, and everybody else's (any thread, any event loop) wait for its commit."""
        database = self.database
        try:
            await database._when_free(functools.partial(database._hold, self))
            self._enter()
        except BaseException:
            # Cancelled while the thread took the connection for it, or not entered: the
            # thread lets go after the taking, in queue order; nothing need wait for it.
            database._queue(functools.partial(database._release, self))
            raise

    async def commit(self) -> None:
        """Commit what joined; the group is closed after, whatever happened."""
        if not self.active:
            return
        # Closed to late writes first: one that comes now waits for the connection, and so
        # runs after the COMMIT in a transaction of its own, never in one nobody commits.
        self._leave()
        # Queued behind every write already sent: the thread runs them in order, and lets
        # go of the connection once the COMMIT is done, however this caller fares.
        await self.database._submit(functools.partial(self.database._commit_group, self))
