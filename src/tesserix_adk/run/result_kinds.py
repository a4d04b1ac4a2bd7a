"""What kind of value a tool returned, as the JSON writer must know it: a pydantic model (or
pydantic dataclass) writes itself, a plain dataclass is the dict of its fields, a mapping
is its items (a multidict's every value), and a dict key holding a model cannot be handed
to pydantic, which writes such a key as the model's ``str``."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields, is_dataclass
from typing import Any

from pydantic import BaseModel

from tesserix_adk.checkpoint.payload.envelope import MAX_NESTING

__all__ = ["holds_a_model", "mapping_items", "plain_dataclass", "pydantic_writes"]


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
