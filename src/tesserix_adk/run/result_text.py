"""What a tool returned, as text where JSON cannot hold it (a cycle, a value nothing can
write): container by container, a pydantic model as a note, never as its ``repr``, which
shows every field as held, what its serializers mask too."""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import fields
from typing import Any

from tesserix_adk.checkpoint.payload.envelope import MAX_NESTING
from tesserix_adk.run.model_sight import ModelSight
from tesserix_adk.run.result_kinds import mapping_items, plain_dataclass, pydantic_writes

__all__ = ["last_text"]


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
            return sight.note(value)
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
