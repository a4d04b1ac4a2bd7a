"""Counting what a store does, so "one batched look-up" and "two calls per plan" are tested.

Two counts, because they answer different questions:

- ``counted(store)`` wraps any store and counts the calls made *to it* by method name: what
  the planner promises ("at most two store calls per plan") is a promise about calls.
- ``RoundTrips`` counts the requests a backend *sends* to its server or database: what a
  store promises ("one batched look-up whatever the number of keys") is a promise about the
  wire, which a wrapper around the store cannot see. The suites cannot reach a driver
  generically, so a backend's test fixture ``round_trips`` returns one with a ``wire``
  step that hooks it to its driver (a connection trace callback, a wrapped client method)
  so that ``sent()`` is called per request; a backend that cannot supply one returns
  ``None``, and the tests that need it skip, saying so. (The fixture itself stays
  synchronous, because a suite asks for it by name from inside a running test; the
  wiring, which may need the driver's own thread or loop, runs when the test awaits it.)
"""

from __future__ import annotations

import functools
import inspect
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, cast

import pytest

__all__ = ["CallCounter", "RoundTrips", "counted", "round_trips_of"]

S = TypeVar("S")


class RoundTrips:
    """How many requests a backend has sent so far (``count``); fed by ``sent()``.

    ``wire(trips)`` hooks the counter to the driver; it runs once, on ``wired()``.
    """

    def __init__(self, wire: Callable[[RoundTrips], Awaitable[None]] | None = None) -> None:
        self.count = 0
        self._wire = wire

    async def wired(self) -> RoundTrips:
        """Hook the counter to the driver (once) and return it."""
        wire, self._wire = self._wire, None
        if wire is not None:
            await wire(self)
        return self

    def sent(self, requests: int = 1) -> None:
        """Count ``requests`` more requests sent to the backend."""
        self.count += requests


class CallCounter:
    """Stands in for a store: every method call is counted by name in ``calls``, then
    delegated; attributes that are not methods are read through."""

    def __init__(self, inner: object) -> None:
        self.inner = inner
        self.calls: Counter[str] = Counter()

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)
        if not callable(attr):
            return attr
        if inspect.iscoroutinefunction(attr):

            @functools.wraps(attr)
            async def counted_async(*args: Any, **kwargs: Any) -> Any:
                self.calls[name] += 1
                return await attr(*args, **kwargs)

            return counted_async

        @functools.wraps(attr)
        def counted_sync(*args: Any, **kwargs: Any) -> Any:
            self.calls[name] += 1
            return attr(*args, **kwargs)

        return counted_sync


def counted(store: S) -> tuple[S, Counter[str]]:
    """``store`` behind a ``CallCounter`` (typed as the store), and its counts by method."""
    counter = CallCounter(store)
    return cast(S, counter), counter.calls


async def round_trips_of(request: pytest.FixtureRequest) -> RoundTrips:
    """The backend's ``round_trips`` fixture, wired; skips, with the reason, when there is
    none. The fixture must be synchronous (see the module docstring)."""
    try:
        trips = request.getfixturevalue("round_trips")
    except pytest.FixtureLookupError:
        pytest.skip("no round_trips fixture: this backend counts no requests sent")
    if trips is None:
        pytest.skip("this backend sends no requests that can be counted (round_trips is None)")
    if not isinstance(trips, RoundTrips):
        raise TypeError(f"round_trips must be a RoundTrips or None, not {type(trips).__name__}")
    return await trips.wired()
