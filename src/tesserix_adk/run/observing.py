"""Observing attempts: the hook a runner calls around each one, with nothing behind it
unless an observer (``tesserix_adk.telemetry.Telemetry``) is configured.

An observer hears an attempt begin, every event it reports (through ``Attempt.emit``,
beside whoever streams it) and how it ended. Observing decides nothing and writes nothing
durable, and a failing observer never fails a run: what it raises is logged and dropped.
"""

from __future__ import annotations

import logging
from collections.abc import Coroutine
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Protocol

from tesserix_adk.agent import Agent
from tesserix_adk.checkpoint.redaction import Redactor
from tesserix_adk.run.attempt import Attempt
from tesserix_adk.run.events import EventSink, RunEvent
from tesserix_adk.run.result import Run

__all__ = [
    "AttemptKind",
    "AttemptObserver",
    "AttemptWatch",
    "Watched",
    "observe",
    "observed",
]

_log = logging.getLogger("tesserix_adk.runner")


class AttemptKind(StrEnum):
    """Which verb an attempt carries the run under."""

    run = "run"
    resume = "resume"


@dataclass(frozen=True, slots=True, kw_only=True)
class Watched:
    """What an observer is told of an attempt as it begins."""

    kind: AttemptKind
    agent: str
    tenant: str
    run_id: str | None  # None: a new run whose id the runner picks (its events name it)
    streamed: bool
    worker: str
    redactor: Redactor
    attempt: Attempt  # read, never changed: its fence once the lease is held


class AttemptWatch(Protocol):
    """One attempt, observed."""

    def event(self, event: RunEvent) -> None:
        """An event the attempt reported."""
        ...

    def end(self, run: Run | None, error: BaseException | None) -> None:
        """The attempt ended with ``run`` (finished or waiting), or raised ``error``."""
        ...


class AttemptObserver(Protocol):
    """Watches attempts (``AgentRunner(telemetry=...)``)."""

    def watch(self, watched: Watched) -> AttemptWatch:
        """Begin watching one attempt."""
        ...


async def observed(
    observer: AttemptObserver | None, watched: Watched, work: Coroutine[Any, Any, Run]
) -> Run:
    """Await ``work`` (the attempt), its events and its end reported to ``observer``."""
    if observer is None:
        return await work
    attempt = watched.attempt
    try:
        watch = observer.watch(watched)
    except Exception as exc:
        _log.warning("observing an attempt failed: %s", watched.redactor.text(repr(exc)))
        return await work
    redactor = watched.redactor
    attempt.events = _both(_guarded(watch, redactor), attempt.events)
    try:
        run = await work
    except BaseException as exc:
        _end(watch, None, exc, redactor)
        raise
    _end(watch, run, None, redactor)
    return run


def _guarded(watch: AttemptWatch, redactor: Redactor) -> EventSink:
    def hear(event: RunEvent) -> None:
        try:
            watch.event(event)
        except Exception as exc:
            _log.warning("observing an event failed: %s", redactor.text(repr(exc)))

    return hear


def _both(first: EventSink, then: EventSink | None) -> EventSink:
    if then is None:
        return first

    def both(event: RunEvent) -> None:
        first(event)
        then(event)

    return both


def _end(
    watch: AttemptWatch, run: Run | None, error: BaseException | None, redactor: Redactor
) -> None:
    try:
        watch.end(run, error)
    except Exception as exc:
        _log.warning("observing the end of an attempt failed: %s", redactor.text(repr(exc)))


class _Observable(Protocol):
    """What ``observe`` reads of a runner."""

    telemetry: AttemptObserver | None
    worker: str

    @property
    def redactor(self) -> Redactor: ...


def observe(
    runner: _Observable,
    attempt: Attempt,
    kind: AttemptKind,
    agent: Agent,
    tenant: str,
    run_id: str | None,
    work: Coroutine[Any, Any, Run],
) -> Coroutine[Any, Any, Run]:
    """``work``, one attempt of ``runner``, observed by its telemetry (if it has any)."""
    watched = Watched(
        kind=kind,
        agent=agent.name,
        tenant=tenant,
        run_id=run_id,
        streamed=attempt.streams,
        worker=runner.worker,
        redactor=runner.redactor,
        attempt=attempt,
    )
    return observed(runner.telemetry, watched, work)
