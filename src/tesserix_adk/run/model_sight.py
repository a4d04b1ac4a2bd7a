"""Whether the text of an object JSON cannot hold may show a pydantic model's ``repr``,
which shows every field as held, what the model's serializers mask too: such an object is
written as a note instead (``ModelSight``)."""

from __future__ import annotations

import contextlib
import functools
import operator
from collections import deque
from collections.abc import ItemsView, Iterable, Iterator, KeysView, Mapping, ValuesView
from dataclasses import dataclass, field
from types import FunctionType, MemberDescriptorType, MethodType, ModuleType
from typing import Any

from tesserix_adk.run.result_kinds import mapping_items, pydantic_writes

__all__ = ["MOST_LOOKED_AT", "ModelSight", "held_a_model"]

MOST_LOOKED_AT = 1_000_000
"""How many objects ``ModelSight`` looks at for one result; past them an object JSON cannot
hold is taken to show a model."""


def held_a_model(value: Any) -> str:
    """The note written for an object whose own text would show a model's ``repr``."""
    return f"<a {type(value).__name__} holding a pydantic model, not written as text>"


class ModelSight:
    """Whether the text of an object JSON cannot hold may show a pydantic model's ``repr``
    (an attrs class's, a plain class's that prints its attributes): a model is reachable
    from it through its attributes, slots, class attributes, containers, dict views, an
    exception's arguments, a built-in's fields, or what a bound method, a
    ``functools.partial`` or an ``operator`` getter was made from. Taken as
    so when looking raises, or once ``MOST_LOOKED_AT`` objects have been looked at for one
    result. What an object computes to print (a property, a registry it looks up) is not
    looked at: a model only reachable so is not found.

    Each object is looked through once per result: one found to reach a model, or none,
    is answered from memory after (it stays held meanwhile, so its id names no other)."""

    def __init__(self) -> None:
        self._clear: dict[int, Any] = {}
        self._showing: dict[int, Any] = {}
        self._looked = 0

    def shows(self, value: Any) -> bool:
        """Whether ``value``'s ``str`` or ``repr`` may show a pydantic model's."""
        # A depth-first walk that finds the strongly connected parts of what the object
        # holds (Tarjan's): a part is clear only once everything it reaches has been
        # looked through, cycles and all; the walk stops at the first model found.
        if id(value) in self._clear:
            return False
        scan = _Scan()
        if self._reaches(value, scan):
            return True
        while scan.path:
            part, held = scan.path[-1]
            child = next(held, _END)
            if child is _END:
                self._leave(part, scan)
            elif id(child) in self._clear:
                continue
            elif id(child) in scan.index:
                if id(child) in scan.inside:  # a cycle back to a part being looked through
                    scan.low[id(part)] = min(scan.low[id(part)], scan.index[id(child)])
            elif self._reaches(child, scan):
                return True
        return False

    def _reaches(self, part: Any, scan: _Scan) -> bool:
        """``part`` looked into, or ``True`` when it is, or is known to reach, a model, or
        cannot be looked into, or the looking is over: each object ``scan`` is looking
        through then reaches it, and shows it too."""
        self._looked += 1
        if self._looked > MOST_LOOKED_AT:
            return True
        if id(part) in self._showing or pydantic_writes(part):
            return self._reached(part, scan)
        try:
            held = iter(_parts(part))
        except Exception:
            return self._reached(part, scan)
        scan.index[id(part)] = scan.low[id(part)] = len(scan.index)
        scan.open_parts.append(part)
        scan.inside.add(id(part))
        scan.path.append((part, held))
        return False

    def _reached(self, part: Any, scan: _Scan) -> bool:
        self._showing.update((id(p), p) for p, _ in scan.path)
        self._showing[id(part)] = part
        return True

    def _leave(self, part: Any, scan: _Scan) -> None:
        """``part`` looked through: the cycle it closes, if any, all of it clear."""
        scan.path.pop()
        if scan.low[id(part)] == scan.index[id(part)]:
            while True:
                done = scan.open_parts.pop()
                scan.inside.discard(id(done))
                self._clear[id(done)] = done
                if done is part:
                    break
        if scan.path:
            above = id(scan.path[-1][0])
            scan.low[above] = min(scan.low[above], scan.low[id(part)])


@dataclass(slots=True)
class _Scan:
    """One look through an object: the order parts were met in (``index``), the earliest
    part each reaches still being looked through (``low``), the parts whose cycle is not
    closed yet, and the path from the object to the part looked at."""

    index: dict[int, int] = field(default_factory=dict)
    low: dict[int, int] = field(default_factory=dict)
    open_parts: list[Any] = field(default_factory=list)
    inside: set[int] = field(default_factory=set)
    path: list[tuple[Any, Iterator[Any]]] = field(default_factory=list)


_END = object()


_SCALARS = (str, bytes, bytearray, int, float, complex, bool, type(None))


def _parts(value: Any) -> Iterable[Any]:
    kind = type(value)  # never the object's own ``__class__``, which may raise
    if kind in _SCALARS or issubclass(kind, (type, ModuleType, FunctionType)):
        return ()
    if isinstance(value, Mapping):
        return [p for pair in mapping_items(value) for p in pair]
    if isinstance(value, (list, tuple, set, frozenset, deque, KeysView, ValuesView, ItemsView)):
        return list(value)
    parts: list[Any] = []
    if isinstance(value, MethodType):
        parts.append(value.__self__)
    if isinstance(value, functools.partial):
        parts.extend((value.func, *value.args, *value.keywords.values()))
    if isinstance(value, _REDUCED):
        parts.append(value.__reduce__())  # what it was made from, which its repr shows
    if isinstance(value, BaseException):
        parts.extend(value.args)
    held = getattr(value, "__dict__", None)
    if isinstance(held, dict):
        parts.extend(held.values())
    for owner in kind.__mro__[:-1]:  # not ``object``'s
        for name, attribute in vars(owner).items():
            if isinstance(attribute, MemberDescriptorType):
                # A slot (private names too) or a built-in's field (``OSError.filename``).
                with contextlib.suppress(AttributeError):  # a slot never set
                    parts.append(attribute.__get__(value, kind))
            elif not name.startswith("__") and not hasattr(type(attribute), "__get__"):
                parts.append(attribute)  # a class attribute, which ``repr`` may show
    return parts


_REDUCED = (operator.attrgetter, operator.itemgetter, operator.methodcaller)
