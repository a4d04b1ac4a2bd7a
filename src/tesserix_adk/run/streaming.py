"""Streaming a run: the run goes on in a task of its own and its events reach the caller
through a queue, as an async iterator (``AgentRunner.stream`` and ``stream_resume``).

What the iterator promises:

- events in the order they happened, then ``RunFinished`` with the same ``Run`` that
  ``run()``/``resume()`` return; an error the run raises is raised from the iterator after
  every event before it (a retryable one leaves the run resumable, as with ``run()``);
- the run's task is the consumer's: a consumer that stops early (``break``, ``aclose``, an
  error of its own, or being cancelled) cancels the run, and the iterator returns only once
  the run has let go of its lease and resume claim, exactly as a cancelled ``run()`` would.
  Nothing is written on the way out; the last boundary frontier is where a later resume (or
  a worker, with a work index) carries it on. A run is never left going with nobody
  listening: whoever wants a run to outlive its viewer submits it to a worker instead.

An event is put on the queue without waiting (``put_nowait`` on an unbounded queue), so a
slow consumer never holds the run back: the run's pace is the model's and the tools'.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

from tesserix_adk.run.events import EventSink, RunEvent, RunFinished
from tesserix_adk.run.result import Run

__all__ = ["RunStarter", "stream_run"]

RunStarter = Callable[[EventSink], Coroutine[Any, Any, Run]]
"""Starts the run with its events going to the sink it is given; the run it ended with."""


class _Ended:
    """Put on the queue once the run's task is done, after every event it emitted."""


_ENDED = _Ended()


async def stream_run(start: RunStarter, *, name: str) -> AsyncIterator[RunEvent]:
    """The events of the run ``start`` carries, ending with ``RunFinished``.

    Close it (``contextlib.aclosing``, or ``aclose()``) to stop the run at once; a ``break``
    out of an ``async for`` stops it too, once the iterator is collected.
    """
    queue: asyncio.Queue[RunEvent | _Ended] = asyncio.Queue()
    task = asyncio.create_task(start(_sink(queue)), name=name)
    # Events are put on the queue from the run's own task, so the end marker, put once the
    # task is done, comes after every event the run emitted.
    task.add_done_callback(lambda _: queue.put_nowait(_ENDED))
    try:
        while not isinstance(item := await queue.get(), _Ended):
            yield item
        yield RunFinished(run=task.result())
    finally:
        if not task.done():
            task.cancel()
            await _let_go(task)
        elif not task.cancelled():
            task.exception()  # heard or not, the run's error is retrieved: no stray warning


async def _let_go(task: asyncio.Task[Run]) -> None:
    """Wait out a cancelled run's own cleanup (lease and claim released, shielded there),
    so a resume started right after the consumer left finds the run free. Should the
    consumer itself be cancelled meanwhile, that cancellation goes on up, never swallowed;
    the cleanup carries on in the run's task."""
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        current = asyncio.current_task()
        if not task.done() or (current is not None and current.cancelling()):
            raise
    except Exception:
        pass  # what a run raised as it was cancelled has nobody to hear it now


def _sink(queue: asyncio.Queue[RunEvent | _Ended]) -> EventSink:
    """Puts an event on ``queue`` from the loop's thread at once, and from any other
    thread (a sync tool's, should one report) through the loop, since a queue is not
    thread-safe."""
    loop = asyncio.get_running_loop()
    home = threading.get_ident()

    def put(event: RunEvent) -> None:
        if threading.get_ident() == home:
            queue.put_nowait(event)
        else:
            loop.call_soon_threadsafe(queue.put_nowait, event)

    return put
