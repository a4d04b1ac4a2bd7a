"""What kind of value a tool returned, as the JSON writer must know it: a pydantic model (or
pydantic dataclass) writes itself, a plain dataclass is the dict of its fields, a mapping
is its items (a multidict's every value), and a dict key holding a model cannot be handed
to pydantic, which writes such a key as the model's ``str``."""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import fields, is_dataclass
from typing import Annotated, Any, get_args, get_origin

from pydantic import BaseModel, PlainSerializer, WrapSerializer

from tesserix_adk.checkpoint.payload.envelope import MAX_NESTING

__all__ = [
    "held_inside",
    "holds_a_model",
    "mapping_items",
    "plain_dataclass",
    "pydantic_writes",
    "written_fields",
]


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


def held_inside(value: Any) -> list[Any]:
    """What pydantic writes of ``value``, one level down (``written_fields`` of a model),
    for counting what a result holds; nothing of what cannot be looked into."""
    try:
        if pydantic_writes(value):
            return written_fields(value)
        if plain_dataclass(value):
            return [getattr(value, f.name) for f in fields(value)]
        if isinstance(value, Mapping):
            return [v for pair in mapping_items(value) for v in pair]
        if isinstance(value, (list, tuple, set, frozenset, deque)):
            return list(value)
    except Exception:
        pass  # what cannot be looked into is pydantic's to refuse
    return []


def written_fields(model: Any) -> list[Any]:
    """What pydantic writes as it is of a model or pydantic dataclass (slotted too): its
    fields' values but those it excludes (``Field(exclude=True)``, ``exclude_if``) or
    writes through a serializer of their own (which may write anything, a summary of a
    large field as readily as a large value of a small one: not counted), and its extra
    values; nothing of one written by a ``model_serializer``."""
    kind = type(model)
    decorators = getattr(kind, "__pydantic_decorators__", None)
    if decorators is not None and decorators.model_serializers:
        return []
    serialized = set()
    if decorators is not None:
        for found in decorators.field_serializers.values():
            serialized.update(found.info.fields)
    declared = getattr(kind, "__pydantic_fields__", None) or {}
    values = [
        getattr(model, name)
        for name, info in declared.items()
        if not info.exclude
        and getattr(info, "exclude_if", None) is None
        and name not in serialized
        and not any(isinstance(m, _SERIALIZERS) for m in info.metadata)
        and not _serialized_inside(info.annotation, 0)
        and hasattr(model, name)
    ]
    extra = getattr(model, "__pydantic_extra__", None)
    if isinstance(extra, dict):
        values.extend(extra.values())
    return values


_SERIALIZERS = (PlainSerializer, WrapSerializer)


def _serialized_inside(annotation: Any, depth: int) -> bool:
    """Whether a serializer of its own sits inside a field's type (``Embedding | None``,
    ``list[Embedding]``, where ``Embedding = Annotated[..., PlainSerializer(...)]``)."""
    if depth > MAX_NESTING:
        return True
    value = getattr(annotation, "__value__", None)
    if value is not None and type(annotation).__name__ == "TypeAliasType":
        return _serialized_inside(value, depth + 1)  # ``type Embedding = Annotated[...]``
    if get_origin(annotation) is Annotated and any(
        isinstance(m, _SERIALIZERS) for m in annotation.__metadata__
    ):
        return True
    return any(_serialized_inside(a, depth + 1) for a in get_args(annotation))
