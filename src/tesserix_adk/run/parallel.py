"""Running a turn's calls side by side: at most N at a time, results in the model's order.

A call that fails stops the turn from starting any more calls, but never cancels one that
already started: a started call may already have reached the outside world, and cancelling
it would leave it claimed in flight, in doubt, when letting it finish records what it did.
Once every started call has finished, the first failure is raised (a stand-in for a process
death, a ``BaseException`` that is not an ``Exception``, before any ordinary error).

Cancelling the turn itself (an interrupt) still reaches every started call, as it reaches
the one call of a sequential turn, and the turn waits for each before it lets go.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

__all__ = ["FirstError", "first_error", "in_model_order"]

T = TypeVar("T")

# Chooses the error a failed turn raises, from every failure in the order they happened.
FirstError = Callable[[Sequence[BaseException]], BaseException]


def first_error(errors: Sequence[BaseException]) -> BaseException:
    """The error a failed turn raises: the first death stand-in if any call died, else the
    first call left in doubt (whether it ran is unknown), else the first error. The others
    are attached as notes, so every failed call is named."""
    chosen = next((e for e in errors if not isinstance(e, Exception)), None)
    if chosen is None:
        chosen = next((e for e in errors if _in_doubt(e)), errors[0])
    for other in errors:
        if other is not chosen:
            notes = "".join(f" ({n})" for n in getattr(other, "__notes__", ()))
            chosen.add_note(f"beside it: {type(other).__name__}: {other}{notes}")
    return chosen


def _in_doubt(error: BaseException) -> bool:
    # An outcome unknown (a lost reply) or a refusal naming calls in doubt: raising a
    # sibling's certain failure instead would say nothing is in doubt.
    return bool(getattr(error, "outcome_unknown", False)) or hasattr(error, "calls")


class _Escaped(Exception):
    """A tool's ``KeyboardInterrupt`` or ``SystemExit``, carried as an ordinary failure:
    raised in a task, asyncio would re-raise it out of the event loop at once, and the
    loop's teardown would cancel the siblings already sent, leaving them in doubt."""

    def __init__(self, original: BaseException) -> None:
        super().__init__(str(original))
        self.original = original


async def _carried(job: Callable[[], Awaitable[T]]) -> T:
    try:
        return await job()
    except (KeyboardInterrupt, SystemExit) as exc:
        raise _Escaped(exc) from exc


async def in_model_order(
    jobs: Sequence[Callable[[], Awaitable[T]]],
    limit: int,
    *,
    choose: FirstError = first_error,
) -> list[T]:
    """Run ``jobs`` in their order, at most ``limit`` at a time; their results in that order.

    ``limit=1`` is the sequential turn exactly: each job starts once the one before it
    finished, and the first failure stops the turn there.
    """
    if limit < 1:
        raise ValueError("limit must be at least 1")
    if limit == 1:
        # In the run's own task and context, one after the other: what a tool sets in a
        # context variable is seen by the next call, as before parallel turns existed.
        return [await job() for job in jobs]
    results: dict[int, T] = {}
    errors: list[BaseException] = []
    running: dict[asyncio.Task[T], int] = {}
    started = 0
    try:
        while started < len(jobs) or running:
            while not errors and started < len(jobs) and len(running) < limit:
                task = asyncio.ensure_future(_carried(jobs[started]))
                running[task] = started
                started += 1
            done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=running.__getitem__):
                index = running.pop(task)
                if task.cancelled():
                    errors.append(asyncio.CancelledError())
                elif (error := task.exception()) is not None:
                    errors.append(error.original if isinstance(error, _Escaped) else error)
                else:
                    results[index] = task.result()
            if errors:
                started = len(jobs)  # start nothing more; what runs finishes
    except asyncio.CancelledError:
        await _cancelled_and_waited(running)
        raise
    if errors:
        raise choose(errors)
    return [results[i] for i in range(len(jobs))]


async def _cancelled_and_waited(running: dict[asyncio.Task[T], int]) -> None:
    """Cancel every started call and wait until each has stopped (a sync tool's thread
    cannot be stopped: its call waits for it), so nothing outlives the turn."""
    for task in running:
        task.cancel()
    pending = set(running)
    while pending:
        with contextlib.suppress(asyncio.CancelledError):
            _, pending = await asyncio.wait(pending)
    for task in running:
        if not task.cancelled():
            task.exception()  # retrieved: the cancellation is what the caller gets
