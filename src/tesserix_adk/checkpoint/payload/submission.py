"""Submissions: a run's input and state as ``AgentRunner.submit`` records them, for the
worker that starts the run later. Redacted like everything else the kit stores (the run then
starts from the redacted input, as a resumed run goes on from a redacted transcript), and
sealed: a submission that does not verify is refused, never started with a guess."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tesserix_adk.checkpoint.payload.envelope import (
    CHECKPOINT_FORMAT,
    _bounded,
    _sealed_within,
    _versioned,
)
from tesserix_adk.checkpoint.payload.fields import _fields, _list
from tesserix_adk.checkpoint.payload.redacting import _redacted_message
from tesserix_adk.checkpoint.payload.transcript import _message
from tesserix_adk.checkpoint.redaction import Redactor
from tesserix_adk.errors import CheckpointCorruptError
from tesserix_adk.messages import Message

__all__ = ["Submission", "decode_submission", "encode_submission"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Submission:
    """What a submitted run starts from."""

    messages: tuple[Message, ...]
    state: Any = None


def encode_submission(messages: Sequence[Message], state: Any, redactor: Redactor) -> bytes:
    """The submission as sealed bytes, redacted."""
    body = {
        "format": CHECKPOINT_FORMAT,
        "kind": "submission",
        "messages": [_redacted_message(m, redactor) for m in messages],
        "state": redactor.value(_bounded(state, "the run state")),
    }
    return _sealed_within(body, "a submission")


def decode_submission(data: bytes) -> Submission:
    """Read a submission; ``CheckpointCorruptError`` unless it verifies."""
    raw, sealed = _versioned(data, "a submission")
    if not sealed:
        raise CheckpointCorruptError("a submission carries no checksum")
    try:
        fields = _fields(raw, {"kind", "messages", "state"}, where="a submission")
        if fields["kind"] != "submission":
            raise ValueError(f"its kind is {fields['kind']!r}")
        messages = tuple(_message(m) for m in _list(fields["messages"]))
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointCorruptError(f"a submission cannot be decoded: {exc}") from exc
    return Submission(messages=messages, state=fields["state"])
