"""Whether the text of an object JSON cannot hold may show a pydantic model's ``repr``,
which shows every field as held, what the model's serializers mask too: such an object is
written as a note instead (``ModelSight``)."""

from __future__ import annotations

import contextlib
import functools
import itertools
import operator
from collections import deque
from collections.abc import ItemsView, Iterable, Iterator, KeysView, Mapping, ValuesView
from dataclasses import dataclass, field
from types import FunctionType, MemberDescriptorType, MethodType, ModuleType
from typing import Any, cast

from pydantic_core import ValidationError

from tesserix_adk.run.result_kinds import mapping_items, pydantic_writes

__all__ = ["MOST_LOOKED_AT", "MOST_LOOKED_AT_IN_AN_ERROR", "ModelSight"]

MOST_LOOKED_AT = 1_000_000
"""How many objects ``ModelSight`` looks at for one result; past them an object JSON cannot
hold is taken to show a model."""

MOST_LOOKED_AT_IN_AN_ERROR = 100_000
"""The same for a tool's exception, whose text is written on the event loop (each value
read counts, text and numbers too: about a tenth of a second at most)."""


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
    is answered from memory after (it stays held meanwhile, so its id names no other).
    ``most``: how many objects it looks at in all (``MOST_LOOKED_AT`` when ``None``)."""

    def __init__(self, most: int | None = None) -> None:
        self._most = MOST_LOOKED_AT if most is None else most
        self._clear: dict[int, Any] = {}
        self._showing: dict[int, Any] = {}
        self._kinds: dict[type, tuple[list[MemberDescriptorType], tuple[Any, ...]]] = {}
        self._looked = 0

    def near(self, value: Any, most_read: int) -> bool:
        """Whether a pydantic model is found from ``value`` level by level, nearest first,
        reading ``most_read`` values at most (text and numbers counted too): a model a few
        levels down is found even when a large value beside it would spend ``shows``'s
        budget first (``ValueError(ids, card)``). A model found is remembered."""
        waiting: deque[Any] = deque([value])
        seen: set[int] = set()
        read = 0
        while waiting:
            part = waiting.popleft()
            if id(part) in seen or id(part) in self._clear:
                continue
            seen.add(id(part))
            if id(part) in self._showing or pydantic_writes(part):
                self._showing[id(value)] = value
                return True
            try:
                for child in _parts(part, self._kind(type(part))):
                    read += 1
                    if read > most_read:
                        return False
                    if type(child) in _SCALARS:
                        continue
                    if id(child) in self._showing or pydantic_writes(child):
                        # Found as it is read, not when its turn comes: a model beside a
                        # large value is the second value read.
                        self._showing[id(value)] = value
                        return True
                    waiting.append(child)
            except Exception:
                return False  # ``shows`` takes what cannot be looked into as showing one
        return False

    def past_the_budget(self, value: Any) -> bool:
        """Whether ``shows`` took ``value`` to show a model only because its budget ran
        out: no model was found from it, nor an object it could not look into."""
        return id(value) not in self._showing and self._looked > self._most

    def note(self, value: Any) -> str:
        """The note written in place of ``value``, whose text ``shows`` a model's or may."""
        name = type(value).__name__
        if id(value) in self._showing:
            return f"<a {name} holding a pydantic model, not written as text>"
        return f"<a {name} too large to look through for a pydantic model, not written as text>"

    def shows(self, value: Any) -> bool:
        """Whether ``value``'s ``str`` or ``repr`` may show a pydantic model's."""
        # A depth-first walk that finds the strongly connected parts of what the object
        # holds (Tarjan's): a part is clear only once everything it reaches has been
        # looked through, cycles and all; the walk stops at the first model found.
        if type(value) in _SCALARS or id(value) in self._clear:
            return False
        scan = _Scan()
        if self._reaches(value, scan):
            return True
        while scan.path:
            part, held = scan.path[-1]
            try:
                child = next(held, _END)
            except Exception:  # changed while read (another thread), or reading raised
                return self._reached(part, scan)
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
        self._looked += 1  # text and numbers too: each is still read
        if self._looked > self._most:
            return True
        if type(part) in _SCALARS:
            return False  # written as itself, held nothing
        if id(part) in self._showing or pydantic_writes(part):
            return self._reached(part, scan)
        try:
            held = iter(_parts(part, self._kind(type(part))))
        except Exception:
            return self._reached(part, scan)
        scan.index[id(part)] = scan.low[id(part)] = len(scan.index)
        scan.open_parts.append(part)
        scan.inside.add(id(part))
        scan.path.append((part, held))
        return False

    def _kind(self, kind: type) -> tuple[list[MemberDescriptorType], tuple[Any, ...]]:
        """What ``kind``'s instances hold beyond their ``__dict__``: its fields (slots,
        private names too, and a built-in's, ``OSError.filename``), and its class
        attributes, which a ``repr`` may show, as one tuple every instance shares (looked
        through once, not once per instance); read once per type."""
        known = self._kinds.get(kind)
        if known is None:
            fields: list[MemberDescriptorType] = []
            shared: list[Any] = []
            for owner in kind.__mro__[:-1]:  # not ``object``'s
                for name, attribute in vars(owner).items():
                    if isinstance(attribute, MemberDescriptorType):
                        fields.append(attribute)
                    elif not name.startswith("__") and not hasattr(type(attribute), "__get__"):
                        shared.append(attribute)
            known = self._kinds[kind] = (fields, tuple(shared))
        return known

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


_SCALARS = frozenset({str, bytes, bytearray, int, float, complex, bool, type(None)})
_CONTAINERS = (list, tuple, set, frozenset, deque, KeysView, ValuesView, ItemsView)


def _parts(
    value: Any, kind_holds: tuple[list[MemberDescriptorType], tuple[Any, ...]]
) -> Iterable[Any]:
    """What ``value`` holds that its text may show, read lazily: the look may end at its
    budget before a large container is read through. A dict, set or deque changed while
    read raises (the look then takes it to show a model); a list does not, so it is copied
    first, in one step: another thread taking an item off it cannot slide one past."""
    kind = type(value)  # never the object's own ``__class__``, which may raise
    if issubclass(kind, (type, ModuleType, FunctionType)):
        return ()
    if kind is tuple:
        return cast("Iterable[Any]", value)
    if kind is list:
        return list(value)
    if isinstance(value, dict) and not hasattr(value, "multi_items"):
        # A dict's subclass too (a ``Counter``): its items as ``repr`` shows them.
        items: Iterable[Any] = itertools.chain.from_iterable(dict.items(value))
        if kind is dict:
            return items
    elif isinstance(value, Mapping):
        items = [p for pair in mapping_items(value) for p in pair]
    elif isinstance(value, _CONTAINERS):
        items = iter(value)
        if kind in (set, frozenset, deque):
            return items
    else:
        items = ()
    # Anything else, a container's subclass too (``class Page(list)`` with a ``meta``):
    # what it holds besides, which its ``repr`` may show.
    return itertools.chain(items, _held_besides(value, kind, kind_holds))


def _held_besides(
    value: Any, kind: type, kind_holds: tuple[list[MemberDescriptorType], tuple[Any, ...]]
) -> list[Any]:
    parts: list[Any] = []
    if isinstance(value, MethodType):
        parts.append(value.__self__)
    if isinstance(value, functools.partial):
        parts.extend((value.func, *value.args, *value.keywords.values()))
    if isinstance(value, _REDUCED):
        parts.append(value.__reduce__())  # what it was made from, which its repr shows
    if isinstance(value, BaseException):
        # A custom ``__str__`` may tell its cause too.
        parts.extend((*value.args, value.__cause__, value.__context__))
    if isinstance(value, ValidationError):
        if value.error_count() > _MOST_ERRORS:
            raise ValueError("too many errors to look through")  # taken as showing one
        # Its text quotes each input it refused, and what it was told, held inside
        # pydantic-core.
        for error in value.errors(include_url=False):
            parts.extend((error.get("input"), *error.get("ctx", {}).values()))
    held = getattr(value, "__dict__", None)
    if isinstance(held, dict):
        parts.extend(held.values())
    fields, shared = kind_holds
    for field_ in fields:
        with contextlib.suppress(AttributeError):  # a slot never set
            parts.append(field_.__get__(value, kind))
    if shared:
        parts.append(shared)
    return parts


# A ValidationError's errors are built whole when asked for: past this many, it is not
# looked into (and is written as a count, ``error_text``).
_MOST_ERRORS = 1_000
_REDUCED = (operator.attrgetter, operator.itemgetter, operator.methodcaller)
