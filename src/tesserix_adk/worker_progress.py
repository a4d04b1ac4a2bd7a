"""A worker's take of a run, told how it goes: once it writes a new frontier, the run's
earlier attempts are forgotten, so the count ``max_attempts`` bounds is of takes that did
not move the run on (``Worker``'s count of attempts)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading

from tesserix_adk.checkpoint.redaction import Masked
from tesserix_adk.run.events import AttemptResumed, FrontierWritten, ProgressListener, RunEvent
from tesserix_adk.stores.protocols import WorkIndex, WorkItem

__all__ = ["TakeProgress"]

_log = logging.getLogger("tesserix_adk.worker")


class TakeProgress(ProgressListener):
    """Starts a run's count of attempts again once a take writes a new frontier: the count
    is of takes that ended without moving the run on, so a run carried beside one that
    kills their process is not parked with it. The take that moved it on stays counted.

    An ``on_event`` sink of progress alone (the model's text is not streamed for it): told
    ``AttemptResumed`` (the step the take picked up at) and ``FrontierWritten`` (announced
    once durable), it writes at most once per take, and only for a run that had earlier
    attempts."""

    def __init__(self, work: WorkIndex, item: WorkItem) -> None:
        self._work = work
        self._item = item
        self._home = threading.get_ident()
        self._loop = asyncio.get_running_loop()
        self._picked_up_at: int | None = None  # None: a start, every frontier is new
        self.made = False
        self._forgotten = False  # the store counts no earlier attempts any more
        self._write: asyncio.Task[None] | None = None

    @property
    def item(self) -> WorkItem:
        """The item as the rest of this take should count it: no earlier attempts once the
        run moved on and the store forgot them (its delay and any park are this take's
        alone); as polled while that write has not landed."""
        return dataclasses.replace(self._item, attempts=0) if self._forgotten else self._item

    def __call__(self, event: RunEvent) -> None:
        if not isinstance(event, (AttemptResumed, FrontierWritten)):
            return
        if threading.get_ident() != self._home:
            self._loop.call_soon_threadsafe(self, event)
            return
        if isinstance(event, AttemptResumed):
            self._picked_up_at = event.step
        elif not self.made and (self._picked_up_at is None or event.step > self._picked_up_at):
            self.made = True
            if self._item.attempts > 0:
                self._write = self._loop.create_task(self._start_again())
            else:
                self._forgotten = True

    async def _start_again(self) -> None:
        item = self._item
        try:
            # A delta, as every count is: only this run's holder moves it meanwhile.
            await self._work.want(item.tenant, item.run_id, agent=item.agent, count=-item.attempts)
            self._forgotten = True
        except Exception as exc:  # the old count stands: at worst the run parks sooner
            _log.warning(
                "run %s/%s: could not start its count of attempts again: %r",
                item.tenant,
                item.run_id,
                Masked(exc),
            )

    async def settled(self) -> None:
        """Wait for the write, so it is never left running past the take, nor lands after
        the failure's own write (a whole ``want``: it would clear that delay and reason)."""
        if self._write is not None:
            await asyncio.shield(self._write)
