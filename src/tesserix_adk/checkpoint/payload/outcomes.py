"""Recorded tool outcomes: what an ``IdempotencyStore`` keeps for a completed call.

``recorded_outcome`` encodes a tool's outcome and returns the ``RecordedOutcome``: the bytes
to store and the ``ToolOutcome`` the model must be told (the decoded record). An outcome
over ``max_bytes`` (``DEFAULT_MAX_BYTES``, 1 MiB) or nested too deep is never truncated: it
is replaced by a small error outcome saying the call completed and its result was too large,
so the record still says the call completed (it never runs again). Its content goes through
``redact_outcome_content``, the one redaction path for a tool's result.

An outcome written for a record names it (``record_tag``: a digest of its tenant and key,
format ``BOUND_FORMAT``), so one read back under another record (outcomes swapped between
two records, or copied from another run's) is corrupt, never another call's answer. An
outcome from before (format 2) names none and is read as it is.

A run's call recorded with the run's state as it stood when the call completed (format
``STATE_FORMAT``, ``outcome_state``) lets a resume restore what the tool wrote into
``ctx.state`` after the last frontier: the call itself is replayed from its record, never
run again.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from tesserix_adk.checkpoint.payload.envelope import (
    CHECKPOINT_FORMAT,
    DEFAULT_MAX_BYTES,
    MAX_NESTING,
    _bounded,
    _sealed_within,
    _versioned_up_to,
    seal,
)
from tesserix_adk.checkpoint.payload.fields import _bool, _fields, _obj, _str
from tesserix_adk.checkpoint.payload.redacting import redact_outcome_content
from tesserix_adk.checkpoint.payload.weighing import weighed
from tesserix_adk.checkpoint.redaction import Redactor
from tesserix_adk.errors import CheckpointCorruptError, CheckpointTooLargeError
from tesserix_adk.messages import ToolOutcome

__all__ = [
    "BOUND_FORMAT",
    "STATE_FORMAT",
    "OutcomeState",
    "RecordedOutcome",
    "decode_outcome",
    "encode_outcome",
    "outcome_state",
    "record_tag",
    "recorded_outcome",
]

BOUND_FORMAT = 3
"""The format of an outcome that names its record; a release before it refuses one with
``CheckpointFormatError`` and leaves it untouched."""


STATE_FORMAT = 4
"""The format of an outcome that also keeps its run's state (``state``, and
``state_redacted`` when that state lost a secret to masking); it names its record too."""


@dataclass(frozen=True, slots=True)
class OutcomeState:
    """The run's state as it stood when the call completed (JSON, redacted), and whether
    it lost a secret to masking (then no run is carried on from it)."""

    state: Any
    redacted: bool = False


def record_tag(tenant: str, key: str) -> str:
    """What an outcome names its record by: a digest of the record's tenant and key (the
    key itself may hold a business's words, and is kept in the record already)."""
    named = tenant.encode("utf-8", "surrogatepass")
    # The tenant's length first: a tenant may hold any character, NUL included, so no
    # separator alone keeps two (tenant, key) pairs from joining into the same bytes.
    h = hashlib.sha256(b"%d:" % len(named))
    h.update(named)
    h.update(key.encode("utf-8", "surrogatepass"))
    return h.hexdigest()[:32]


def _head(record: str | None) -> dict[str, Any]:
    if record is None:
        return {"format": CHECKPOINT_FORMAT}
    return {"format": BOUND_FORMAT, "record": record}


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
    outcome: ToolOutcome,
    redactor: Redactor,
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
    record: str | None = None,
    state: OutcomeState | None = None,
) -> RecordedOutcome:
    """Encode ``outcome`` (redacted) for the idempotency store, within ``max_bytes``, naming
    ``record`` (its ``record_tag``) when given, with the run's ``state`` (redacted here;
    only with ``record``), which ``max_bytes`` does not count: every frontier holds it too.

    Over the cap, or nested deeper than ``MAX_NESTING``, the result is not truncated: it
    is replaced by an ``is_error`` outcome telling the model the call completed and its
    result was too large (by how much, against which cap). The replacement is written
    whatever ``max_bytes`` is, since a completed call must be recorded as completed.
    """
    content: Any
    scanned_at_most = max(_UNSCANNED_OVER * max_bytes, _SCANNED_ANYWAY)
    least = _least_bytes(outcome.content, past=scanned_at_most)
    if least > scanned_at_most:
        # Far past the cap: replaced without being redacted first. Only masking most of it
        # away could bring it under (then the model is told it was too large, and nothing
        # of it is kept), and scanning it would hold the interpreter (the regular
        # expressions keep the GIL) for seconds, stopping the lease renewals meanwhile.
        return _replaced(
            outcome.call_id,
            record,
            f"the result of this call was too large to keep: more than {least} bytes, over "
            f"the cap of {max_bytes}. The call completed; its result is not available.",
            {"reason": "too_large", "bytes": least, "max_bytes": max_bytes},
            state,
            redactor,
        )
    try:
        content = redact_outcome_content(outcome.content, redactor)
        payload = _sealed_within(
            {**_head(record), "content": content, "is_error": outcome.is_error},
            "a recorded outcome",
        )
    except CheckpointTooLargeError:
        return _replaced(
            outcome.call_id,
            record,
            f"the result of this call was too large to keep: it nests deeper than the limit "
            f"of {MAX_NESTING} levels. The call completed; its result is not available.",
            {"reason": "too_deep", "max_nesting": MAX_NESTING},
            state,
            redactor,
        )
    if len(payload) > max_bytes:
        over = len(payload) - max_bytes
        return _replaced(
            outcome.call_id,
            record,
            f"the result of this call was too large to keep: {len(payload)} bytes, {over} "
            f"bytes over the cap of {max_bytes}. The call completed; its result is not "
            "available.",
            {"reason": "too_large", "bytes": len(payload), "max_bytes": max_bytes},
            state,
            redactor,
        )
    if state is not None and record is not None:
        payload = seal(
            {
                **_head(record),
                "content": content,
                "is_error": outcome.is_error,
                **_kept_state(state, redactor),
            }
        )
    return RecordedOutcome(
        payload=payload,
        outcome=ToolOutcome(call_id=outcome.call_id, content=content, is_error=outcome.is_error),
    )


# A result whose text alone is this many times the cap (and over a mebibyte: scanning
# less takes a fraction of a second) is replaced unscanned.
_UNSCANNED_OVER = 2
_SCANNED_ANYWAY = 1024 * 1024


def _least_bytes(value: Any, *, past: int) -> int:
    """A lower bound of the bytes ``value`` takes as JSON (each text at least its length
    and its quotes, anything else at least one byte), counted only until over ``past``."""
    return weighed(value, _least_cost, past=past)


def _least_cost(item: Any) -> int:
    if isinstance(item, str):
        return len(item) + 2
    kind = type(item)
    if kind is list or kind is tuple or kind is dict:
        return 2
    return 1


def _kept_state(state: OutcomeState, redactor: Redactor) -> dict[str, Any]:
    """The members that keep ``state`` in an outcome (its format, its state, its mark);
    none for a state too deep to keep: the call's record must be written whatever its
    state (a frontier refuses that state anyway)."""
    try:
        kept, masked = redactor.masks(_bounded(state.state, "the run state"))
    except CheckpointTooLargeError:
        return {}
    members: dict[str, Any] = {"format": STATE_FORMAT, "state": kept}
    if masked or state.redacted:
        members["state_redacted"] = True
    return members


def _replaced(
    call_id: str,
    record: str | None,
    text: str,
    why: dict[str, Any],
    state: OutcomeState | None = None,
    redactor: Redactor | None = None,
) -> RecordedOutcome:
    body = {**_head(record), "content": text, "is_error": True, "replaced": why}
    if state is not None and record is not None and redactor is not None:
        body.update(_kept_state(state, redactor))
    payload = seal(body)
    return RecordedOutcome(
        payload=payload,
        outcome=ToolOutcome(call_id=call_id, content=text, is_error=True),
        replaced=True,
    )


def encode_outcome(
    outcome: ToolOutcome,
    redactor: Redactor,
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
    record: str | None = None,
) -> bytes:
    """A tool call's outcome as the idempotency store keeps it (redacted, checksummed,
    within ``max_bytes``, naming ``record`` when given): ``recorded_outcome(...).payload``."""
    return recorded_outcome(outcome, redactor, max_bytes=max_bytes, record=record).payload


def decode_outcome(data: bytes, call_id: str, *, record: str | None = None) -> ToolOutcome:
    """Read a recorded outcome back as the answer to ``call_id``; ``CheckpointCorruptError``
    if it cannot be read or does not verify, or names another record than ``record`` (the
    ``record_tag`` of the record it was read from; ``None``: not checked)."""
    body, _ = _body(data, record)
    return ToolOutcome(call_id=call_id, content=body["content"], is_error=body["is_error"])


def outcome_state(data: bytes, *, record: str | None = None) -> OutcomeState | None:
    """The run's state a recorded outcome keeps (``None`` for one that keeps none); the
    same checks as ``decode_outcome``."""
    body, fmt = _body(data, record)
    if fmt != STATE_FORMAT:
        return None
    return OutcomeState(state=body["state"], redacted=body.get("state_redacted", False))


def _body(data: bytes, record: str | None) -> tuple[dict[str, Any], int | None]:
    """A recorded outcome's members, verified (see ``decode_outcome``), and its format."""
    raw, sealed, fmt = _versioned_up_to(data, "a recorded outcome", STATE_FORMAT)
    named = raw.pop("record", None)
    if named is not None and type(named) is not str:
        raise CheckpointCorruptError("a recorded outcome names its record wrongly")
    if (fmt in (BOUND_FORMAT, STATE_FORMAT)) != (named is not None):
        raise CheckpointCorruptError(
            f"a recorded outcome of format {fmt} {'names no' if named is None else 'names a'} "
            "record"
        )
    if named is not None and record is not None and named != record:
        raise CheckpointCorruptError(
            "a recorded outcome names another record than the one it was read from: it was "
            "moved or copied after it was written"
        )
    try:
        required = {"content", "is_error"}
        allowed = required | ({"replaced"} if sealed else set())
        if fmt == STATE_FORMAT:
            required |= {"state"}
            allowed |= {"state", "state_redacted"}
        body = _fields(raw, required, allowed, "a recorded outcome")
        if "replaced" in body:
            _str(_obj(body["replaced"]).get("reason"))
        _bool(body["is_error"])
        if "state_redacted" in body and body["state_redacted"] is not True:
            raise ValueError("it marks its state unmasked")
        return body, fmt
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointCorruptError(f"a recorded outcome cannot be decoded: {exc}") from exc
