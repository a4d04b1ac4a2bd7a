"""Recorded tool outcomes: what an ``IdempotencyStore`` keeps for a completed call.

``recorded_outcome`` encodes a tool's outcome and returns the ``RecordedOutcome``: the bytes
to store and the ``ToolOutcome`` the model must be told (the decoded record). An outcome
over ``max_bytes`` (``DEFAULT_MAX_BYTES``, 1 MiB) or nested too deep is never truncated: it
is replaced by a small error outcome saying the call completed and its result was too large,
so the record still says the call completed (it never runs again). Its content goes through
``redact_outcome_content``, the one redaction path for a tool's result.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tesserix_adk.checkpoint.payload.envelope import (
    CHECKPOINT_FORMAT,
    DEFAULT_MAX_BYTES,
    MAX_NESTING,
    _sealed_within,
    _versioned,
    seal,
)
from tesserix_adk.checkpoint.payload.fields import _bool, _fields, _obj, _str
from tesserix_adk.checkpoint.payload.redacting import redact_outcome_content
from tesserix_adk.checkpoint.redaction import Redactor
from tesserix_adk.errors import CheckpointCorruptError, CheckpointTooLargeError
from tesserix_adk.messages import ToolOutcome

__all__ = ["RecordedOutcome", "decode_outcome", "encode_outcome", "recorded_outcome"]


@dataclass(frozen=True, slots=True, kw_only=True)
class RecordedOutcome:
    """A tool's outcome as the idempotency store keeps it.

    ``payload`` is the bytes to store; ``outcome`` is what the model must be told, which
    is exactly what ``decode_outcome(payload, call_id)`` gives back (redacted, and when
    ``replaced`` the small error outcome that stands for a result too large or too deep).
    """

    payload: bytes
    outcome: ToolOutcome
    replaced: bool = False


def recorded_outcome(
    outcome: ToolOutcome, redactor: Redactor, *, max_bytes: int = DEFAULT_MAX_BYTES
) -> RecordedOutcome:
    """Encode ``outcome`` (redacted) for the idempotency store, within ``max_bytes``.

    Over the cap, or nested deeper than ``MAX_NESTING``, the result is not truncated: it
    is replaced by an ``is_error`` outcome telling the model the call completed and its
    result was too large (by how much, against which cap). The replacement is written
    whatever ``max_bytes`` is, since a completed call must be recorded as completed.
    """
    content: Any
    try:
        content = redact_outcome_content(outcome.content, redactor)
        payload = _sealed_within(
            {"format": CHECKPOINT_FORMAT, "content": content, "is_error": outcome.is_error},
            "a recorded outcome",
        )
    except CheckpointTooLargeError:
        return _replaced(
            outcome.call_id,
            f"the result of this call was too large to keep: it nests deeper than the limit "
            f"of {MAX_NESTING} levels. The call completed; its result is not available.",
            {"reason": "too_deep", "max_nesting": MAX_NESTING},
        )
    if len(payload) > max_bytes:
        over = len(payload) - max_bytes
        return _replaced(
            outcome.call_id,
            f"the result of this call was too large to keep: {len(payload)} bytes, {over} "
            f"bytes over the cap of {max_bytes}. The call completed; its result is not "
            "available.",
            {"reason": "too_large", "bytes": len(payload), "max_bytes": max_bytes},
        )
    return RecordedOutcome(
        payload=payload,
        outcome=ToolOutcome(call_id=outcome.call_id, content=content, is_error=outcome.is_error),
    )


def _replaced(call_id: str, text: str, why: dict[str, Any]) -> RecordedOutcome:
    payload = seal(
        {"format": CHECKPOINT_FORMAT, "content": text, "is_error": True, "replaced": why}
    )
    return RecordedOutcome(
        payload=payload,
        outcome=ToolOutcome(call_id=call_id, content=text, is_error=True),
        replaced=True,
    )


def encode_outcome(
    outcome: ToolOutcome, redactor: Redactor, *, max_bytes: int = DEFAULT_MAX_BYTES
) -> bytes:
    """A tool call's outcome as the idempotency store keeps it (redacted, checksummed,
    within ``max_bytes``): ``recorded_outcome(...).payload``."""
    return recorded_outcome(outcome, redactor, max_bytes=max_bytes).payload


def decode_outcome(data: bytes, call_id: str) -> ToolOutcome:
    """Read a recorded outcome back as the answer to ``call_id``; ``CheckpointCorruptError``
    if it cannot be read or does not verify."""
    raw, sealed = _versioned(data, "a recorded outcome")
    try:
        allowed = {"content", "is_error", "replaced"} if sealed else {"content", "is_error"}
        body = _fields(raw, {"content", "is_error"}, allowed, "a recorded outcome")
        if "replaced" in body:
            _str(_obj(body["replaced"]).get("reason"))
        return ToolOutcome(
            call_id=call_id, content=body["content"], is_error=_bool(body["is_error"])
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointCorruptError(f"a recorded outcome cannot be decoded: {exc}") from exc
