"""A run's state as the stores keep it: its JSON form, validated by the agent's
``state_schema``, and where that form loses a value a resumed run would need.

A secret in the state is masked before it is stored, as everything is, and a pydantic
secret type (``SecretStr``, ``SecretBytes``, ``Secret[...]``) is written by pydantic itself
as ``'**********'``. Either way the stored state no longer holds the value: a run restored
from it would hand its tools the mask as if it were the credential. ``lost_values`` names
where, so the kit refuses such a run instead of carrying it on with a guess.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from pydantic import Secret, SecretBytes, SecretStr, TypeAdapter, ValidationError

from tesserix_adk.checkpoint.payload.envelope import _bounded
from tesserix_adk.checkpoint.redaction import Redactor
from tesserix_adk.errors import CheckpointCorruptError, CheckpointError, ConfigurationError

__all__ = [
    "describe_lost",
    "keepable_state",
    "lost_values",
    "secret_typed",
    "state_from_json",
    "state_to_json",
]

_SECRET_TYPES = (SecretStr, SecretBytes, Secret)
# Places named, at most: enough for an operator to find them.
_NAMED = 5


def state_to_json(state: Any, schema: type[Any] | None) -> Any:
    """The run state as JSON data, validated by ``schema`` when there is one.

    Validation runs on the JSON form, so a model mutated into an invalid shape is caught;
    the result is a deep copy, so later mutation never rewrites a stored step. Without a
    schema, a set is written in one order (its members' JSON, sorted), so the same state
    gives the same JSON in every process: a set's own order follows its hash seed.
    """
    if state is None:
        return None
    try:
        if schema is None:
            data = _untyped_json(state)
        else:
            data = TypeAdapter(schema).dump_python(state, mode="json")
            TypeAdapter(schema).validate_python(data)
    except ValidationError as exc:
        raise CheckpointError(f"the run state does not validate: {exc}") from exc
    except Exception as exc:
        raise CheckpointError(f"the run state is not JSON-serialisable: {exc}") from exc
    return data


def _untyped_json(state: Any) -> Any:
    """``state`` as JSON data by its own type, its sets (if any) in one order."""
    adapter = TypeAdapter(type(state))
    kept = adapter.dump_python(state)
    if not _holds_set(kept):
        return adapter.dump_python(state, mode="json")
    return TypeAdapter(Any).dump_python(_sets_sorted(kept), mode="json")


def _holds_set(value: Any) -> bool:
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, set | frozenset):
            return True
        if isinstance(item, Mapping):
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)
    return False


def _sets_sorted(value: Any) -> Any:
    if isinstance(value, set | frozenset):
        members = [_sets_sorted(item) for item in value]
        return sorted(members, key=_order_of)
    if isinstance(value, Mapping):
        return {key: _sets_sorted(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_sets_sorted(item) for item in value]
    return value


def _order_of(member: Any) -> str:
    as_json = TypeAdapter(Any).dump_python(member, mode="json")
    return json.dumps(as_json, sort_keys=True, default=str)


def state_from_json(data: Any, schema: type[Any] | None) -> Any:
    """The run state read back, validated the same way it was on save."""
    if data is None or schema is None:
        return data
    try:
        return TypeAdapter(schema).validate_python(data)
    except ValidationError as exc:
        raise CheckpointCorruptError(f"the stored run state does not validate: {exc}") from exc


def keepable_state(
    state: Any, schema: type[Any] | None, redactor: Redactor, *, refused: str
) -> Any:
    """The state's JSON form, checked before a run starts: ``ConfigurationError`` (its text
    opening with ``refused``) for a state no frontier can hold, or one that would lose a
    value once stored. Every frontier keeps the state: a run none of them could hold would
    go on (sending calls) with nothing of it kept, and one whose stored state lost a secret
    could only be carried on by handing its tools the mask."""
    try:
        data = state_to_json(state, schema)
        lost = lost_values(state, data, schema, redactor)
    except CheckpointError as exc:
        said = redactor.text(str(exc))  # a validation error quotes the value
        raise ConfigurationError(
            f"{refused}: {said} (a run's state is checkpointed with it)"
        ) from None
    if lost:
        raise ConfigurationError(
            f"{refused}: its state holds a secret at {describe_lost(lost)}, which every store "
            "keeps masked, so a run carried on after a crash would hand its tools the mask; "
            "give tools their credentials from their own configuration, not the run's state"
        )
    return data


def lost_values(state: Any, data: Any, schema: type[Any] | None, redactor: Redactor) -> list[str]:
    """Where ``data`` (``state_to_json(state, schema)``) loses a value once stored: masked
    by ``redactor``, or a pydantic secret type. Paths such as ``api_token`` or
    ``creds.keys[1]`` (a key that is itself a secret is named by its mask); never values.
    Empty when the stored state is the state. ``CheckpointTooLargeError`` for data that
    nests too deep to be walked."""
    if data is None:
        return []
    lost: list[str] = []
    _masked(data, redactor.value(_bounded(data, "the run state")), "", lost)
    _secret_typed(state, schema, lost)
    return lost


def secret_typed(state: Any, schema: type[Any] | None) -> bool:
    """Whether ``state`` holds a pydantic secret type, which its JSON form holds only as
    its mask (the redactor's masks are found where it runs)."""
    lost: list[str] = []
    _secret_typed(state, schema, lost)
    return bool(lost)


def describe_lost(lost: list[str]) -> str:
    """``lost`` as a phrase: ``api_token and pin`` (at most a few named)."""
    named = [p or "the whole state" for p in dict.fromkeys(lost)]
    more = len(named) - _NAMED
    shown = ", ".join(named[:_NAMED])
    return shown + (f" and {more} more" if more > 0 else "")


def _join(path: str, key: Any) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else str(key)


def _masked(before: Any, after: Any, path: str, lost: list[str]) -> None:
    if isinstance(before, Mapping) and isinstance(after, Mapping):
        if len(before) != len(after):  # two keys masked to one
            lost.append(path)
            return
        for (key, item), (shown, masked) in zip(before.items(), after.items(), strict=True):
            where = _join(path, shown)
            if key != shown:
                lost.append(where)
            else:
                _masked(item, masked, where, lost)
        return
    if isinstance(before, list | tuple) and isinstance(after, list | tuple):
        for i, (item, masked) in enumerate(zip(before, after, strict=True)):
            _masked(item, masked, _join(path, i), lost)
        return
    if before != after:
        lost.append(path)


def _secret_typed(state: Any, schema: type[Any] | None, lost: list[str]) -> None:
    # The state dumped keeping its objects: a secret type shows as itself wherever it is
    # (a set's member, a mapping's key), whatever text its JSON form would carry.
    if state is not None:
        dumped = TypeAdapter(type(state) if schema is None else schema).dump_python(state)
        _secrets_in(dumped, "", lost)


def _secrets_in(value: Any, path: str, lost: list[str]) -> None:
    if isinstance(value, _SECRET_TYPES):
        lost.append(path)
    elif isinstance(value, Mapping):
        for key, item in value.items():
            if isinstance(key, _SECRET_TYPES):
                lost.append(_join(path, "<a key>"))
                continue
            _secrets_in(item, _join(path, key), lost)
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            _secrets_in(item, _join(path, i), lost)
    elif isinstance(value, set | frozenset):
        for item in value:
            _secrets_in(item, _join(path, "<a member>"), lost)
