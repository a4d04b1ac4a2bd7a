"""What a tool returned, as text where JSON cannot hold it (a cycle, a value nothing can
write), and what of it the JSON writer must not look into itself: a pydantic model is
written by its own serializers, or as a note, never as its ``repr``, which shows every
field as held, what its serializers mask too."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import fields, is_dataclass
from types import MethodType, ModuleType
from typing import Any

from pydantic import BaseModel

from tesserix_adk.checkpoint.payload.envelope import MAX_NESTING

__all__ = [
    "ModelSight",
    "held_a_model",
    "holds_a_model",
    "last_text",
    "mapping_items",
    "plain_dataclass",
    "pydantic_writes",
]

# How many objects ``ModelSight`` looks at for one result; past them an object JSON cannot
# hold is written as a note, not as its text.
MOST_LOOKED_AT = 1_000_000


def plain_dataclass(value: Any) -> bool:
    """A dataclass instance pydantic writes as the dict of its fields: not a class, and not
    a pydantic dataclass (which writes itself, as a model does)."""
    return is_dataclass(value) and not isinstance(value, type) and not pydantic_writes(value)


def mapping_items(mapping: Mapping[Any, Any]) -> list[tuple[Any, Any]]:
    """The items of a mapping, a key its items repeat (a multidict: query parameters,
    headers) holding the list of its values, in their order. A multidict whose ``items``
    gives one value a key (starlette's, httpx's) gives every one through ``multi_items``."""
    if type(mapping) is dict:
        return list(mapping.items())
    every = getattr(mapping, "multi_items", None)
    try:
        pairs = every() if callable(every) else mapping.items()
    except Exception:
        pairs = mapping.items()  # a multidict that reads one way only
    values: dict[Any, list[Any]] = {}
    for key, value in pairs:
        values.setdefault(key, []).append(value)
    return [(k, vs[0] if len(vs) == 1 else vs) for k, vs in values.items()]


def last_text(result: Any, sight: ModelSight | None = None) -> str:
    """A result nothing else can write, as text: its ``repr``, written container by
    container (a cycle as ``[...]``), or what it is when even that raises. Never a pydantic
    model's (or pydantic dataclass's) ``repr``, wherever it sits: it shows every field as
    held, what its JSON serializers mask too."""
    return _text_of(result, set(), ModelSight() if sight is None else sight)


def _text_of(value: Any, path: set[int], sight: ModelSight) -> str:
    try:
        return _text_inside(value, path, sight)
    except Exception:
        # An object whose own class or attribute lookup raises (a lazy proxy whose setup
        # failed): said for what it is, never raised out of a completed call's result.
        return f"<a {type(value).__name__} that cannot be written as text>"


def _text_inside(value: Any, path: set[int], sight: ModelSight) -> str:
    if pydantic_writes(value):
        return f"<a {type(value).__name__} that cannot be written as JSON>"
    dataclass = plain_dataclass(value)
    if not dataclass and not isinstance(value, (Mapping, list, tuple, set, frozenset, deque)):
        if sight.shows(value):
            return held_a_model(value)
        try:
            return repr(value)
        except Exception:
            return f"<a {type(value).__name__} that cannot be written as text>"
    name = type(value).__name__
    if id(value) in path:
        return f"<{name} ...>"
    if len(path) >= MAX_NESTING:
        return f"<a {name} nested too deep to write>"
    path.add(id(value))
    try:
        if dataclass or isinstance(value, Mapping):
            pairs = (
                [(f.name, getattr(value, f.name)) for f in fields(value)]
                if dataclass
                else mapping_items(value)
            )
            inner = ", ".join(
                f"{_text_of(k, path, sight)}: {_text_of(v, path, sight)}" for k, v in pairs
            )
            return f"{name}{{{inner}}}" if type(value) is not dict else f"{{{inner}}}"
        inner = ", ".join(_text_of(v, path, sight) for v in value)
        if type(value) is list:
            return f"[{inner}]"
        return f"{name}([{inner}])"
    except Exception:
        return f"<a {name} that cannot be written as text>"
    finally:
        path.discard(id(value))


def holds_a_model(key: Any, depth: int) -> bool:
    """Whether a dict key is, or holds in its tuples, frozensets and dataclasses, a
    pydantic model (written as its ``str`` by pydantic, every field as held)."""
    if pydantic_writes(key):
        return True
    if depth >= MAX_NESTING:
        return True  # too deep to look: written as text, a model in it as a note
    if isinstance(key, (tuple, frozenset)):
        return any(holds_a_model(k, depth + 1) for k in key)
    if plain_dataclass(key):
        return any(holds_a_model(getattr(key, f.name), depth + 1) for f in fields(key))
    return False


def pydantic_writes(value: Any) -> bool:
    """Whether ``value`` is a pydantic model or pydantic dataclass (asked of its type: an
    object's own attribute lookup may raise)."""
    kind = type(value)  # never the object's own ``__class__``, which may raise
    return issubclass(kind, BaseModel) or hasattr(kind, "__pydantic_serializer__")


def held_a_model(value: Any) -> str:
    """The note written for an object whose own text would show a model's ``repr``."""
    return f"<a {type(value).__name__} holding a pydantic model, not written as text>"


class ModelSight:
    """Whether the text of an object JSON cannot hold may show a pydantic model's ``repr``
    (an attrs class's, a plain class's that prints its attributes): a model is reachable
    from it through its attributes, slots, containers, an exception's arguments or a bound
    method's object. Taken as so when looking raises, or once ``MOST_LOOKED_AT`` objects
    have been looked at for one result: what the object prints is not known otherwise.
    An object found to reach none is not looked at again (it stays held meanwhile, so its
    id names no other object)."""

    def __init__(self) -> None:
        self._clear: dict[int, Any] = {}
        self._looked = 0

    def shows(self, value: Any) -> bool:
        """Whether ``value``'s ``str`` or ``repr`` may show a pydantic model's."""
        seen: dict[int, Any] = {}
        waiting: list[Any] = [value]
        while waiting:
            part = waiting.pop()
            if id(part) in seen or id(part) in self._clear:
                continue
            seen[id(part)] = part
            self._looked += 1
            if self._looked > MOST_LOOKED_AT or pydantic_writes(part):
                return True
            try:
                waiting.extend(_parts(part))
            except Exception:
                return True
        self._clear.update(seen)
        return False


def _parts(value: Any) -> Iterable[Any]:
    kind = type(value)  # never the object's own ``__class__``, which may raise
    if kind in (str, bytes, int, float, bool, type(None)) or issubclass(kind, (type, ModuleType)):
        return ()
    if isinstance(value, Mapping):
        return [p for pair in mapping_items(value) for p in pair]
    if isinstance(value, (list, tuple, set, frozenset, deque)):
        return list(value)
    parts: list[Any] = []
    if isinstance(value, MethodType):
        parts.append(value.__self__)
    if isinstance(value, BaseException):
        parts.extend(value.args)
    held = getattr(value, "__dict__", None)
    if isinstance(held, dict):
        parts.extend(held.values())
    for owner in kind.__mro__:
        slots = owner.__dict__.get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name not in ("__dict__", "__weakref__") and hasattr(value, name):
                parts.append(getattr(value, name))
    return parts
