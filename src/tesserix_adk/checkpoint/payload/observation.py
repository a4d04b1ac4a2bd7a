"""A frontier's observation (the last turn's tool results), written by reference.

A frontier that names its transcript in a ``HistoryStore`` already holds every result of
the last turn there, redacted the same way: an observation entry whose content is a
transcript entry's word for word (text, same call, same error flag) is written as that
entry's position (``content_at``) instead of a second copy. Anything else is written
whole. A reader gets the same observation back from ``resolve_observation`` with the
transcript the frontier names, verified by its chained digest, so a position is only as
good as the transcript it points into; one that points anywhere but that call's result is
corrupt, never read as something else.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tesserix_adk.checkpoint.payload.envelope import _bounded
from tesserix_adk.checkpoint.payload.redacting import _redacted_observation
from tesserix_adk.checkpoint.redaction import Redactor
from tesserix_adk.errors import CheckpointCorruptError
from tesserix_adk.messages import Message, Role

__all__ = ["observation_refers", "resolve_observation"]

_AT = "content_at"
_NAMED_KEYS = frozenset({"call_id", "tool", "is_error", _AT})


def _encoded_observation(
    observation: Any, redactor: Redactor, messages: Sequence[Message] | None
) -> Any:
    """The observation as a frontier writes it: redacted, and with ``messages`` (the whole
    transcript the frontier names) each entry it holds word for word named by position,
    its content neither redacted again nor copied."""
    if messages is None or not isinstance(observation, list | tuple):
        return _redacted_observation(observation, redactor)
    _bounded(observation, "the observation")
    held = _results(messages, len(observation))
    out: list[Any] = []
    for entry in observation:
        at = _position(entry, held)
        if at is not None:
            named = redactor.value({k: v for k, v in entry.items() if k != "content"})
            # A call id redaction changed (it looked like a key) is not the transcript's.
            if named["call_id"] == entry["call_id"]:
                out.append({**named, _AT: at})
                continue
        out.append(_redacted_observation([entry], redactor)[0])
    return out


def _results(messages: Sequence[Message], entries: int) -> dict[tuple[str, str, bool], int]:
    """Where the transcript's last tool results are, by (call id, text, error flag).

    The last turn's results end the transcript, or come just before the model's next
    message (and an approval's or a final answer's): only that tail is looked at, so a
    frontier costs the same at turn 1,000 as at turn 10. A result not found is copied.
    """
    held: dict[tuple[str, str, bool], int] = {}
    start = max(0, len(messages) - 2 * entries - 4)
    for at in range(start, len(messages)):
        m = messages[at]
        if m.role is Role.tool and m.tool_call_id is not None and isinstance(m.content, str):
            held[(m.tool_call_id, m.content, m.is_error)] = at
    return held


def _position(entry: Any, held: Mapping[tuple[str, str, bool], int]) -> int | None:
    if not isinstance(entry, Mapping) or entry.keys() != {"call_id", "tool", "content", "is_error"}:
        return None
    call_id, content, failed = entry["call_id"], entry["content"], entry["is_error"]
    if type(call_id) is not str or type(content) is not str or type(failed) is not bool:
        return None
    return held.get((call_id, content, failed))


def observation_refers(observation: Any) -> bool:
    """Whether a decoded observation names transcript entries (``resolve_observation``
    needs the transcript)."""
    return isinstance(observation, list) and any(
        isinstance(e, dict) and _AT in e for e in observation
    )


def check_observation(observation: Any, count: int | None) -> None:
    """Refuse (``ValueError``, which the decoder reports as corrupt) a named entry that is
    malformed or points past the ``count`` entries of the transcript the frontier names
    (``None``: it names none)."""
    if not observation_refers(observation):
        return
    for entry in observation:
        if not isinstance(entry, dict) or _AT not in entry:
            continue
        if entry.keys() != _NAMED_KEYS:
            raise ValueError(f"the observation names a transcript entry with keys {sorted(entry)}")
        at = entry[_AT]
        if count is None:
            raise ValueError("the observation names a transcript entry, and the frontier none")
        if type(at) is not int or not 0 <= at < count:
            raise ValueError(
                f"the observation names transcript entry {at!r} of a transcript of {count}"
            )


def resolve_observation(observation: Any, messages: Sequence[Message]) -> Any:
    """The observation as the run kept it: each entry named by position read from
    ``messages``, the transcript its frontier names (verified). ``CheckpointCorruptError``
    if a position is not that call's result there."""
    if not observation_refers(observation):
        return observation
    out: list[Any] = []
    for entry in observation:
        if not isinstance(entry, dict) or _AT not in entry:
            out.append(entry)
            continue
        at = entry[_AT]
        m = messages[at] if type(at) is int and 0 <= at < len(messages) else None
        if (
            m is None
            or m.role is not Role.tool
            or m.tool_call_id != entry["call_id"]
            or m.is_error != entry["is_error"]
            or not isinstance(m.content, str)
        ):
            raise CheckpointCorruptError(
                f"the frontier's observation names transcript entry {at!r}, which is not the "
                f"result of call {entry['call_id']!r}"
            )
        out.append(
            {
                "call_id": entry["call_id"],
                "tool": entry["tool"],
                "content": m.content,
                "is_error": entry["is_error"],
            }
        )
    return out
