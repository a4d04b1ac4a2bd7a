"""Strict field readers for decoding: a missing key, a stray key or a wrong type is damage,
never a gap to fill with a default (each raises, and the decoder turns that into
``CheckpointCorruptError``)."""

from __future__ import annotations

from collections.abc import Set
from typing import Any


def _fields(
    value: Any,
    required: Set[str],
    allowed: Set[str] | None = None,
    where: str = "an object",
) -> dict[str, Any]:
    """``value`` as a JSON object with every ``required`` key and nothing outside
    ``allowed`` (default: exactly ``required``); a stray key is damage, not an extension."""
    obj = _obj(value)
    keys = obj.keys()
    # Two subset tests, which build nothing; the differences only to say what is wrong.
    if not required <= keys:
        raise KeyError(f"{where} lacks {sorted(required - keys)}")
    bound = required if allowed is None else allowed
    if not keys <= bound:
        raise ValueError(f"{where} has unknown field(s) {sorted(keys - bound)}")
    return obj


def _list(value: Any) -> list[Any]:
    if not isinstance(value, list):
        raise TypeError(f"expected a JSON array, got {type(value).__name__}")
    return value


def _str(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(f"expected a string, got {type(value).__name__}")
    return value


def _int(value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"expected an integer, got {type(value).__name__}")
    return value


def _opt_str(value: Any) -> str | None:
    return None if value is None else _str(value)


def _opt_int(value: Any) -> int | None:
    return None if value is None else _int(value)


def _bool(value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"expected true or false, got {type(value).__name__}")
    return value


def _obj(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise TypeError(f"expected a JSON object, got {type(value).__name__}")
    return value
