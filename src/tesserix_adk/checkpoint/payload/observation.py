"""A frontier's observation (the last turn's tool results), written by reference.

A frontier that names its transcript in a ``HistoryStore`` already holds every result of
the last turn there, redacted the same way: an observation entry whose content is a
transcript entry's word for word (text, same call, same error flag) is written as that
entry's position (``content_at``) instead of a second copy. Anything else is written
whole. A reader gets the same observation back from ``resolve_observation`` with the
transcript the frontier names, verified by its chained digest, so a position is only as
good as the transcript it points into; one that points anywhere but that call's result is
corrupt, never read as something else. Such a frontier is format 3 (``NAMING_FORMAT``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tesserix_adk.checkpoint.payload.envelope import _bounded
from tesserix_adk.checkpoint.payload.redacting import _redacted_observation
from tesserix_adk.checkpoint.redaction import Redactor
from tesserix_adk.errors import CheckpointCorruptError
from tesserix_adk.messages import Message, Role

__all__ = ["NAMING_FORMAT", "last_results", "observation_refers", "resolve_observation"]

_AT = "content_at"

NAMING_FORMAT = 3
"""The format of a frontier whose observation names transcript entries: a kit that reads
only format 2 refuses it (``CheckpointFormatError``) instead of reading entries without
their content. Every other payload is still written as format 2."""
_NAMED_KEYS = frozenset({"call_id", "tool", "is_error", _AT})


def _encoded_observation(
    observation: Any, redactor: Redactor, messages: Sequence[Message] | None
) -> Any:
    """The observation as a frontier writes it: redacted, and with ``messages`` (the whole
    transcript the frontier names) each entry its last results hold word for word named
    by position, its content neither redacted again nor copied."""
    if messages is None or not isinstance(observation, list | tuple):
        return _redacted_observation(observation, redactor)
    _bounded(observation, "the observation")
    held = {
        (m.tool_call_id, m.content, m.is_error): at
        for at in last_results(messages)
        if (m := messages[at]).tool_call_id is not None and isinstance(m.content, str)
    }
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


def last_results(messages: Sequence[Message]) -> range:
    """Where the transcript's last run of tool results is: at its end, or just before its
    last message (the model's next one, an approval's, a final answer). The last turn's
    results are there, and a position elsewhere is never one of them, so a frontier costs
    the same at turn 1,000 as at turn 10, and an id the provider reuses every turn never
    names an earlier turn's result."""
    end = len(messages)
    if end and messages[end - 1].role is not Role.tool:
        end -= 1
    start = end
    while start > 0 and messages[start - 1].role is Role.tool:
        start -= 1
    return range(start, end)


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


def check_observation(observation: Any, count: int | None, fmt: int) -> None:
    """Refuse (``ValueError``, which the decoder reports as corrupt) a named entry that is
    malformed, in a format before ``NAMING_FORMAT``, or points past the ``count`` entries
    of the transcript the frontier names (``None``: it names none)."""
    if not observation_refers(observation):
        return
    if fmt < NAMING_FORMAT:
        raise ValueError(f"the observation names a transcript entry in a format-{fmt} frontier")
    for entry in observation:
        if not isinstance(entry, dict) or _AT not in entry:
            continue
        if entry.keys() != _NAMED_KEYS:
            raise ValueError(f"the observation names a transcript entry with keys {sorted(entry)}")
        if not (
            type(entry["call_id"]) is str
            and type(entry["tool"]) is str
            and type(entry["is_error"]) is bool
        ):
            raise ValueError("the observation names a transcript entry with a field mistyped")
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
    last = last_results(messages)
    out: list[Any] = []
    for entry in observation:
        if not isinstance(entry, dict) or _AT not in entry:
            out.append(entry)
            continue
        at = entry[_AT]
        m = messages[at] if type(at) is int and at in last else None
        if (
            m is None
            or m.role is not Role.tool
            or m.tool_call_id != entry["call_id"]
            or m.is_error != entry["is_error"]
            or not isinstance(m.content, str)
        ):
            raise CheckpointCorruptError(
                f"the frontier's observation names transcript entry {at!r}, which is not the "
                f"result of call {entry['call_id']!r} in the transcript's last turn"
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
