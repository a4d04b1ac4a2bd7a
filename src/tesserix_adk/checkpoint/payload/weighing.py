"""Bounded walks of JSON data: what a value weighs, counted item by item only until past a
line, so that a value of millions of items costs no more than one just over it. The event
loop asks before it redacts a frontier on its own thread; a call's record, before it scans
a result; a tool's result, before pydantic converts it in one call."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator
from typing import Any

__all__ = ["HEAVY", "Weight", "weighed"]

Weight = Callable[[Any], int]
"""What one item weighs by itself, a container without what it holds."""

HEAVY = 1 << 62
"""A weight past any line: what a ``Weight`` answers for an item it will not count."""


def weighed(value: Any, weight: Weight, *, past: int) -> int:
    """The sum of ``weight`` over ``value`` and every item its lists, tuples and dicts hold
    (a dict's keys and values; not a subclass's), however deep; once the sum is over
    ``past``, that sum, read no further."""
    total = weight(value)
    if total > past:
        return total
    pending: list[Iterator[Any]] = [iter(_held(value))]
    while pending:
        for item in pending[-1]:
            total += weight(item)
            if total > past:
                return total
            kind = type(item)
            if kind is str or kind is int or kind is float or item is None:
                continue
            held = _held(item)
            if held:
                pending.append(iter(held))
                break  # the one pushed is read first; this one goes on after it
        else:
            pending.pop()
    return total


def _held(value: Any) -> Iterable[Any]:
    # Plain containers only: a subclass may read itself otherwise (its own ``__iter__`` or
    # ``items``, which may raise or never end), so it is weighed whole, as one item.
    kind = type(value)
    if kind is list or kind is tuple:
        return value  # type: ignore[no-any-return]
    if kind is dict:
        return itertools.chain.from_iterable(value.items()) if value else ()
    return ()
