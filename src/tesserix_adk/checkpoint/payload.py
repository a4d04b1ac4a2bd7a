"""The frontier (``Checkpoint``) and the one codec for every payload the kit encodes.

Four kinds of payload cross into a store, all written and read here: frontiers (and step
snapshots and tombstones, the same bytes), transcript entries (what a ``HistoryStore``
keeps), and recorded tool outcomes (what an ``IdempotencyStore`` keeps).

**Checksum.** Every payload is a JSON object whose last member is
``"checksum":"sha256:<64 hex>"``; the digest covers the exact bytes of the payload with that
member cut out (``{...,"checksum":"…"}`` → ``{...}``). Bytes, not a re-serialised form, so
any changed byte is caught: in the body the digest no longer matches, in the checksum member
either the digest or the member's shape is broken. The payload stays plain JSON, so stores,
operators and tests can still read it. A checksum guards against damage, not against a
forger: anyone who can rewrite the bytes can recompute sha256.

**Formats.** ``CHECKPOINT_FORMAT`` is the frontier version; 2 added the checksum. A reader
verifies the checksum *before* it believes the ``format`` field, so a changed format digit is
corrupt, not a newer format. A newer format is refused with ``CheckpointFormatError`` (its
bytes left for a newer kit) when it verifies, or when it carries no checksum this reader
recognises (a newer kit may seal differently). Format 1 payloads (released before the
checksum; golden payloads under ``tests/``) are still read, strictly:

- a payload that verifies but claims format 1 is corrupt (one changed digit of a format-2
  payload cannot pass as format 1);
- a payload claiming format 1 that has a ``checksum`` member at all is corrupt;
- a payload claiming format 2 without a verifying checksum is corrupt.

No single-byte change turns a format-2 payload into a readable format-1 one: that needs the
checksum member removed (about 80 bytes) *and* the digit changed. Such a deliberate edit is
forgery, which a checksum cannot stop, so format 1 stays readable (refusing it would strand
every run written before the upgrade). Transcript entries and outcomes carry no format
field; one without a checksum is read only in the exact shape the kit wrote before
checksums (no other key, every type right).

**Nesting.** No payload nests more than ``MAX_NESTING`` (64) JSON arrays/objects deep, the
envelope included: a tool call's arguments object may nest 58 levels below itself. Encoding
something deeper raises ``CheckpointTooLargeError(retryable=False)`` (refused, like an
oversized frontier: the ``Checkpointer`` writes a tombstone), except an outcome, which is
replaced (below); decoding it raises ``CheckpointCorruptError``. Depth is measured on the
bytes before ``json.loads`` runs, so no payload reaches a recursive parser or redactor.

**Outcomes.** ``recorded_outcome`` encodes a tool's outcome and returns the
``RecordedOutcome``: the bytes to store and the ``ToolOutcome`` the model must be told (the
decoded record). An outcome over ``max_bytes`` (``DEFAULT_MAX_BYTES``, 1 MiB) or nested too
deep is never truncated: it is replaced by a small error outcome saying the call completed
and its result was too large, so the record still says the call completed (it never runs
again). ``redact_outcome_content`` is the one redaction path for a tool's result, used for
the recorded outcome, the transcript entry and the frontier's ``observation`` alike.

Every decode failure is ``CheckpointCorruptError`` (or ``CheckpointFormatError``); a reader
never fills a gap with a default.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import re
from collections.abc import Mapping, Set
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from tesserix_adk.checkpoint.redaction import Redactor
from tesserix_adk.errors import (
    CheckpointCorruptError,
    CheckpointFormatError,
    CheckpointTooLargeError,
)
from tesserix_adk.messages import (
    BinaryPart,
    Message,
    Part,
    Role,
    TextPart,
    ToolCall,
    ToolOutcome,
    Usage,
)
from tesserix_adk.messages import message_to_json as _message_to_json
from tesserix_adk.stores.protocols import HistoryHandle

__all__ = [
    "CHECKPOINT_FORMAT",
    "DEFAULT_MAX_BYTES",
    "MAX_NESTING",
    "Boundary",
    "Checkpoint",
    "CheckpointStatus",
    "Grant",
    "OutstandingCall",
    "PendingApproval",
    "RecordedOutcome",
    "decode_checkpoint",
    "decode_message",
    "decode_outcome",
    "encode_checkpoint",
    "encode_message",
    "encode_outcome",
    "recorded_outcome",
    "redact_outcome_content",
    "seal",
    "tombstone_payload",
    "unseal",
    "within_nesting",
]

CHECKPOINT_FORMAT = 2
"""The frontier format this kit writes; 2 added the checksum."""

DEFAULT_MAX_BYTES = 1024 * 1024
"""The default cap on one frontier, one transcript entry and one recorded outcome."""

MAX_NESTING = 64
"""How deep any payload may nest JSON arrays and objects, its envelope included."""


class Boundary(StrEnum):
    """The only places a frontier is written: nothing is half-done at any of them."""

    after_model_call = "after_model_call"
    after_tool_result = "after_tool_result"
    before_approval = "before_approval"


class CheckpointStatus(StrEnum):
    """Where the run stood when the frontier was written."""

    running = "running"
    waiting_approval = "waiting_approval"
    completed = "completed"
    budget_exhausted = "budget_exhausted"
    max_iterations = "max_iterations"
    failed = "failed"
    tombstone = "tombstone"

    @property
    def finished(self) -> bool:
        """A final frontier: resuming it calls no model and dispatches nothing."""
        return self in _FINISHED


_FINISHED = frozenset(
    {
        CheckpointStatus.completed,
        CheckpointStatus.budget_exhausted,
        CheckpointStatus.max_iterations,
        CheckpointStatus.failed,
    }
)


@dataclass(frozen=True, slots=True, kw_only=True)
class OutstandingCall:
    """A call the model asked for and the frontier has no result for yet.

    It carries its key and its tool's flags so planning needs no agent. ``redacted`` says
    redaction changed its arguments: such a call is never re-sent from the frontier.
    """

    call: ToolCall
    key: str | None
    side_effects: bool = True
    idempotent: bool = False
    redacted: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class PendingApproval:
    """The approval request a waiting run stopped on."""

    id: str
    calls: tuple[str, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class Grant:
    """A person's decision on one call."""

    request: str
    call_id: str
    key: str | None
    approved: bool
    by: str | None
    note: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Checkpoint:
    """A run's frontier (or a step snapshot, or a tombstone), decoded and verified.

    ``messages`` is set when the transcript is inline, ``history_handle`` when it lives in a
    ``HistoryStore``. ``usage``/``micros`` are for reporting: the ledger decides spend.
    ``observation`` is the last turn's tool results (what an operator replaying a step
    wants to see first); ``state`` is the agent's typed state as JSON.
    """

    format: int = CHECKPOINT_FORMAT
    tenant: str
    run_id: str
    agent_name: str
    agent_revision: str | None = None
    step: int
    boundary: Boundary | None = None
    status: CheckpointStatus
    iteration: int = 0
    fence: int | None = None
    messages: tuple[Message, ...] | None = None
    history_handle: HistoryHandle | None = None
    outstanding: tuple[OutstandingCall, ...] = ()
    pending_approval: PendingApproval | None = None
    grants: tuple[Grant, ...] = ()
    usage: Usage = field(default_factory=Usage)
    micros: int = 0
    state: Any = None
    steps_used: int = 0
    replay_of: str | None = None
    output: str | None = None
    reason: str | None = None
    written_at: float | None = None
    observation: Any = None

    @property
    def is_tombstone(self) -> bool:
        """An oversized frontier was refused here; resuming must refuse too."""
        return self.status is CheckpointStatus.tombstone


# --- the envelope: checksum and nesting ---------------------------------------------------

_CHECKSUM_HEAD = b',"checksum":"sha256:'
_CHECKSUM = re.compile(rb',"checksum":"sha256:([0-9a-f]{64})"\}')
_CHECKSUM_LEN = len(_CHECKSUM_HEAD) + 64 + 2

# JSON strings (escapes included) are cut out before brackets are counted.
_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_A_BRACKET = re.compile(r"[^\[\]{}]+")
_INNERMOST = re.compile(r"\[\]|\{\}")


def seal(body: Mapping[str, Any] | bytes) -> bytes:
    """``body`` (an object, or the exact bytes of a non-empty JSON object) as payload
    bytes, its checksum member last."""
    raw = body if isinstance(body, bytes) else _dumps(body)
    if not (raw.startswith(b"{") and raw.endswith(b"}") and raw != b"{}"):
        raise ValueError("only a non-empty JSON object can be sealed")
    digest = hashlib.sha256(raw).hexdigest().encode("ascii")
    return raw[:-1] + _CHECKSUM_HEAD + digest + b'"}'


def unseal(payload: bytes, *, what: str) -> tuple[dict[str, Any], bool]:
    """The JSON object of a payload and whether it carried a verifying checksum.

    ``CheckpointCorruptError`` (naming ``what``) if it is not a JSON object within
    ``MAX_NESTING``, or its checksum member is there and does not match. A payload with no
    checksum member in the place the kit writes it comes back with ``False``; the caller
    decides whether that shape may be read unverified.
    """
    tail = _CHECKSUM.fullmatch(payload, max(len(payload) - _CHECKSUM_LEN, 0))
    if tail is not None and len(payload) > _CHECKSUM_LEN:
        body = payload[:-_CHECKSUM_LEN] + b"}"
        digest = hashlib.sha256(body).hexdigest().encode("ascii")
        if not hmac.compare_digest(digest, tail.group(1)):
            raise CheckpointCorruptError(
                f"{what} does not match its checksum ({len(payload)} bytes): it was changed "
                "after it was written"
            )
        raw = _object(_loads(body, what), what)
        if "checksum" in raw:
            raise CheckpointCorruptError(f"{what} has two checksum members")
        return raw, True
    return _object(_loads(payload, what), what), False


def _loads(data: bytes, what: str) -> Any:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CheckpointCorruptError(f"{what} is not UTF-8 ({len(data)} bytes)") from exc
    depth = _nesting(text)
    if depth is None:
        raise CheckpointCorruptError(f"{what} is not valid JSON ({len(data)} bytes)")
    if depth > MAX_NESTING:
        raise CheckpointCorruptError(f"{what} nests deeper than the limit of {MAX_NESTING} levels")
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise CheckpointCorruptError(f"{what} is not valid JSON ({len(data)} bytes)") from exc


def _nesting(text: str) -> int | None:
    """How deep ``text`` nests arrays and objects, counting at most ``MAX_NESTING + 1``;
    ``None`` if its brackets do not pair up (it cannot be JSON)."""
    brackets = _NOT_A_BRACKET.sub("", _JSON_STRING.sub("", text))
    depth = 0
    # Each pass removes the innermost level; passes are capped, so hostile depth is cheap.
    while brackets and depth <= MAX_NESTING:
        fewer = _INNERMOST.sub("", brackets)
        if fewer == brackets:
            return None
        brackets = fewer
        depth += 1
    return depth


def _object(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise CheckpointCorruptError(f"{what} is not a JSON object")
    return value


def _versioned(payload: bytes, what: str) -> tuple[dict[str, Any], bool]:
    """The body of a transcript entry or outcome, its ``format`` member checked and removed,
    and whether it was sealed.

    Sealed ones open with ``"format"`` and close with the checksum, so no single cut of
    their bytes leaves a well-formed payload without either. One with neither is read as
    the kit wrote it before checksums; one with only one of them is corrupt.
    """
    raw, sealed = unseal(payload, what=what)
    fmt = raw.pop("format", None)
    if fmt is not None and (not isinstance(fmt, int) or isinstance(fmt, bool)):
        raise CheckpointCorruptError(f"{what} has no valid format")
    if fmt is not None and fmt > CHECKPOINT_FORMAT:
        raise CheckpointFormatError(
            f"{what} has format {fmt}, newer than the {CHECKPOINT_FORMAT} this kit reads; "
            "read it with a newer tesserix-adk"
        )
    if sealed and (fmt is None or fmt < 2):
        raise CheckpointCorruptError(f"{what} has a checksum but no format that has one")
    if not sealed and (fmt is not None or "checksum" in raw):
        raise CheckpointCorruptError(f"{what} has no checksum that verifies")
    return raw, sealed


def within_nesting(value: Any, limit: int = MAX_NESTING) -> bool:
    """Whether ``value`` nests at most ``limit`` containers deep; iterative, so a value
    nested thousands deep is measured without recursion (and without walking it all)."""
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, Mapping):
            children: Any = item.values()
        elif isinstance(item, list | tuple):
            children = item
        else:
            continue
        if depth + 1 > limit:
            return False
        stack.extend((child, depth + 1) for child in children)
    return True


def _bounded(value: Any, what: str) -> Any:
    """``value`` unchanged, or ``CheckpointTooLargeError`` if it alone nests too deep to be
    redacted or encoded (checked before anything recursive sees it)."""
    if not within_nesting(value):
        raise CheckpointTooLargeError(
            f"{what} nests deeper than the limit of {MAX_NESTING} levels; it was not written",
            retryable=False,
        )
    return value


def _sealed_within(body: Mapping[str, Any], what: str) -> bytes:
    payload = seal(body)
    depth = _nesting(payload.decode("utf-8"))
    if depth is None or depth > MAX_NESTING:
        raise CheckpointTooLargeError(
            f"{what} nests deeper than the limit of {MAX_NESTING} levels; it was not written",
            retryable=False,
        )
    return payload


def _dumps(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


# --- redaction: one path for a tool's result ----------------------------------------------


def redact_outcome_content(content: Any, redactor: Redactor) -> Any:
    """A tool result's content, redacted: the one path for the recorded outcome, the
    transcript entry and the frontier's observation, so all three mask alike.

    Text that is a JSON object or array is redacted as data (values under keys like
    ``password`` are masked) and written back as JSON text; other text by pattern; any
    other value as data.
    """
    if isinstance(content, str):
        return _redacted_text(content, redactor)
    # As JSON data first, the way the transcript entry writes it (``default=str``): a
    # result the codec cannot write would leave a completed call's claim in flight.
    data = json.loads(json.dumps(_bounded(content, "a tool result"), default=str))
    return redactor.value(data)


def _redacted_text(text: str, redactor: Redactor) -> str:
    # Redactor.text masks JSON text in place (every duplicate of a key included, which a
    # json.loads round trip would drop) and anything else as free text.
    return redactor.text(text)


def _redacted_message(message: Message, redactor: Redactor) -> dict[str, Any]:
    for call in message.tool_calls:
        _bounded(call.arguments, f"the arguments of {call.name} ({call.id})")
    data = _message_to_json(message)
    if isinstance(data["content"], str):
        if data["role"] == "tool":
            data["content"] = redact_outcome_content(data["content"], redactor)
        else:
            data["content"] = redactor.text(data["content"])
    else:
        data["content"] = [
            {**p, "text": redactor.text(p["text"])} if p["type"] == "text" else p
            for p in data["content"]
        ]
    for call in data.get("tool_calls", ()):
        call["arguments"] = redactor.value(call["arguments"])
    return data


def _redacted_observation(observation: Any, redactor: Redactor) -> Any:
    """The last turn's tool results: each entry's ``content`` through the outcome path."""
    _bounded(observation, "the observation")
    if not isinstance(observation, list | tuple):
        return redactor.value(observation)
    out: list[Any] = []
    for entry in observation:
        if isinstance(entry, Mapping) and "content" in entry:
            rest = redactor.value({k: v for k, v in entry.items() if k != "content"})
            out.append({**rest, "content": redact_outcome_content(entry["content"], redactor)})
        else:
            out.append(redactor.value(entry))
    return out


# --- transcript entries -------------------------------------------------------------------


def encode_message(message: Message, redactor: Redactor) -> bytes:
    """One transcript entry as checksummed bytes, redacted (text, tool results and tool
    arguments; never binary). ``CheckpointTooLargeError`` if it nests too deep."""
    body = {"format": CHECKPOINT_FORMAT, **_redacted_message(message, redactor)}
    return _sealed_within(body, "a transcript entry")


def decode_message(data: bytes) -> Message:
    """Read one transcript entry; ``CheckpointCorruptError`` if it cannot be read or does
    not verify (an entry from before checksums is read in its exact old shape only)."""
    raw, _ = _versioned(data, "a transcript entry")
    try:
        return _message(raw)
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointCorruptError(f"a transcript entry cannot be decoded: {exc}") from exc


_MESSAGE_KEYS = frozenset({"role", "content", "tool_calls", "tool_call_id", "is_error"})


def _message(raw: Any) -> Message:
    data = _fields(raw, {"role", "content"}, _MESSAGE_KEYS, "a message")
    content_raw = data["content"]
    content: str | list[Part]
    if isinstance(content_raw, str):
        content = content_raw
    elif isinstance(content_raw, list):
        content = [_part(p) for p in content_raw]
    else:
        raise TypeError("message content is neither text nor a list of parts")
    calls = [
        ToolCall(id=_str(c["id"]), name=_str(c["name"]), arguments=_obj(c["arguments"]))
        for c in (
            _fields(c, {"id", "name", "arguments"}, where="a tool call")
            for c in _list(data.get("tool_calls", []))
        )
    ]
    is_error = _bool(data.get("is_error", False))
    return Message(
        Role(_str(data["role"])),
        content,
        calls,
        tool_call_id=_opt_str(data.get("tool_call_id")),
        is_error=is_error,
    )


def _part(raw: Any) -> Part:
    kind = _str(_obj(raw).get("type"))
    if kind == "text":
        return TextPart(text=_str(_fields(raw, {"type", "text"}, where="a text part")["text"]))
    if kind == "binary":
        part = _fields(raw, {"type", "media_type", "data"}, where="a binary part")
        try:
            data = base64.b64decode(_str(part["data"]), validate=True)
        except binascii.Error as exc:
            raise ValueError(f"a binary part is not base64: {exc}") from exc
        return BinaryPart(data=data, media_type=_str(part["media_type"]))
    raise ValueError(f"unknown part type {kind!r}")


# --- recorded outcomes --------------------------------------------------------------------


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


# --- frontiers ----------------------------------------------------------------------------


def encode_checkpoint(cp: Checkpoint, redactor: Redactor) -> bytes:
    """The payload of a frontier, with user data redacted, checksummed.

    ``CheckpointTooLargeError(retryable=False)`` if it would nest deeper than
    ``MAX_NESTING`` (nothing is truncated); the size cap is the ``Checkpointer``'s.
    """
    outstanding = []
    for oc in cp.outstanding:
        arguments = _bounded(
            dict(oc.call.arguments), f"the arguments of {oc.call.name} ({oc.call.id})"
        )
        outstanding.append(
            {
                "id": oc.call.id,
                "name": oc.call.name,
                "arguments": redactor.value(arguments),
                "key": oc.key,
                "side_effects": oc.side_effects,
                "idempotent": oc.idempotent,
                "redacted": oc.redacted or redactor.changed(arguments),
            }
        )
    body: dict[str, Any] = {
        "format": CHECKPOINT_FORMAT,
        "tenant": cp.tenant,
        "run_id": cp.run_id,
        "agent": {"name": cp.agent_name, "revision": cp.agent_revision},
        "step": cp.step,
        "boundary": None if cp.boundary is None else str(cp.boundary),
        "status": str(cp.status),
        "iteration": cp.iteration,
        "fence": cp.fence,
        "history": None,
        "outstanding": outstanding,
        "pending_approval": None
        if cp.pending_approval is None
        else {"id": cp.pending_approval.id, "calls": list(cp.pending_approval.calls)},
        "grants": [
            {
                "request": g.request,
                "call_id": g.call_id,
                "key": g.key,
                "approved": g.approved,
                "by": g.by,
                "note": None if g.note is None else redactor.text(g.note),
            }
            for g in cp.grants
        ],
        "usage": {
            "input_tokens": cp.usage.input_tokens,
            "output_tokens": cp.usage.output_tokens,
            "micros": cp.micros,
        },
        "state": redactor.value(_bounded(cp.state, "the run state")),
        "steps_used": cp.steps_used,
        "replay_of": cp.replay_of,
        "output": None if cp.output is None else redactor.text(cp.output),
        "written_at": cp.written_at,
        "observation": _redacted_observation(cp.observation, redactor),
    }
    if cp.history_handle is not None:
        body["history"] = {"count": cp.history_handle.count, "digest": cp.history_handle.digest}
    if cp.messages is not None:
        body["messages"] = [_redacted_message(m, redactor) for m in cp.messages]
    return _sealed_within(body, f"the frontier of run {cp.run_id!r} at step {cp.step}")


def tombstone_payload(
    *, tenant: str, run_id: str, agent_name: str, step: int, reason: str, fence: int | None
) -> bytes:
    """The small record written in place of a refused frontier (checksummed too)."""
    return seal(
        {
            "format": CHECKPOINT_FORMAT,
            "tenant": tenant,
            "run_id": run_id,
            "agent": {"name": agent_name},
            "step": step,
            "status": "tombstone",
            "reason": reason,
            "fence": fence,
        }
    )


def decode_checkpoint(payload: bytes, *, tenant: str, run_id: str) -> Checkpoint:
    """Read a frontier, step snapshot or tombstone: the checksum is verified first, then
    the format, then every field's type. ``CheckpointFormatError`` for a newer format,
    ``CheckpointCorruptError`` for anything else that cannot be read as written."""
    what = f"the checkpoint of run {run_id!r}"
    raw, sealed = unseal(payload, what=what)
    fmt = raw.get("format")
    if not isinstance(fmt, int) or isinstance(fmt, bool) or fmt < 1:
        raise CheckpointCorruptError(f"{what} has no valid format")
    if fmt > CHECKPOINT_FORMAT:
        raise CheckpointFormatError(
            f"{what} has format {fmt}, newer than the {CHECKPOINT_FORMAT} this kit reads; "
            "resume it with a newer tesserix-adk"
        )
    if sealed and fmt < 2:
        raise CheckpointCorruptError(f"{what} has a checksum but claims format {fmt}")
    if not sealed and (fmt >= 2 or "checksum" in raw):
        raise CheckpointCorruptError(f"{what} has no checksum that verifies (format {fmt})")
    try:
        cp = _from_json(raw, fmt)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointCorruptError(f"{what} cannot be decoded: {exc!r}") from exc
    if cp.tenant != tenant or cp.run_id != run_id:
        raise CheckpointCorruptError(
            f"the checkpoint stored under run {run_id!r} belongs to another run"
        )
    return cp


_TOMBSTONE_KEYS = frozenset({"format", "tenant", "run_id", "agent", "step", "status", "reason"})
_FRONTIER_KEYS = frozenset(
    {
        "format",
        "tenant",
        "run_id",
        "agent",
        "step",
        "boundary",
        "status",
        "iteration",
        "fence",
        "history",
        "outstanding",
        "pending_approval",
        "grants",
        "usage",
        "state",
        "steps_used",
        "replay_of",
    }
)
# Format 1 grew these without a new number; format 2 writes every one of them.
_LATER_FRONTIER_KEYS = frozenset({"output", "written_at", "observation"})


def _from_json(raw: Mapping[str, Any], fmt: int) -> Checkpoint:
    status = CheckpointStatus(_str(raw.get("status")))
    if status is CheckpointStatus.tombstone:
        required = _TOMBSTONE_KEYS | ({"fence"} if fmt >= 2 else set())
        _fields(raw, required, required | {"fence"}, "a tombstone")
        agent = _fields(raw["agent"], {"name"}, where="the agent")
        return Checkpoint(
            format=fmt,
            tenant=_str(raw["tenant"]),
            run_id=_str(raw["run_id"]),
            agent_name=_str(agent["name"]),
            step=_int(raw["step"]),
            status=status,
            fence=_opt_int(raw.get("fence")),
            reason=_str(raw["reason"]),
        )
    required = _FRONTIER_KEYS | (_LATER_FRONTIER_KEYS if fmt >= 2 else set())
    _fields(raw, required, _FRONTIER_KEYS | _LATER_FRONTIER_KEYS | {"messages"}, "a frontier")
    agent = _fields(raw["agent"], {"name", "revision"}, where="the agent")
    history = raw["history"]
    handle = (
        None
        if history is None
        else HistoryHandle(
            tenant=_str(raw["tenant"]),
            run_id=_str(raw["run_id"]),
            count=_int(_fields(history, {"count", "digest"}, where="the history")["count"]),
            digest=_str(history["digest"]),
        )
    )
    messages = raw.get("messages")
    if handle is None and messages is None:
        raise ValueError("the frontier has neither a transcript nor a history handle")
    pending = raw["pending_approval"]
    usage = _fields(raw["usage"], {"input_tokens", "output_tokens", "micros"}, where="usage")
    boundary = raw["boundary"]
    if boundary is None and not status.finished:
        raise ValueError(f"a {status} frontier names no boundary")
    written_at = raw.get("written_at")
    if written_at is not None and (
        not isinstance(written_at, int | float) or isinstance(written_at, bool)
    ):
        raise TypeError(f"written_at is a {type(written_at).__name__}, not a number")
    return Checkpoint(
        format=fmt,
        tenant=_str(raw["tenant"]),
        run_id=_str(raw["run_id"]),
        agent_name=_str(agent["name"]),
        agent_revision=_opt_str(agent["revision"]),
        step=_int(raw["step"]),
        boundary=None if boundary is None else Boundary(_str(boundary)),
        status=status,
        iteration=_int(raw["iteration"]),
        fence=_opt_int(raw["fence"]),
        messages=None if messages is None else tuple(_message(m) for m in _list(messages)),
        history_handle=handle,
        outstanding=tuple(_outstanding(o, fmt) for o in _list(raw["outstanding"])),
        pending_approval=None
        if pending is None
        else PendingApproval(
            id=_str(_fields(pending, {"id", "calls"}, where="the approval")["id"]),
            calls=tuple(_str(c) for c in _list(pending["calls"])),
        ),
        grants=tuple(_grant(g, fmt) for g in _list(raw["grants"])),
        usage=Usage(
            input_tokens=_int(usage["input_tokens"]), output_tokens=_int(usage["output_tokens"])
        ),
        micros=_int(usage["micros"]),
        state=raw["state"],
        steps_used=_int(raw["steps_used"]),
        replay_of=_opt_str(raw["replay_of"]),
        output=_opt_str(raw.get("output")),
        written_at=written_at,
        observation=raw.get("observation"),
    )


_CALL_KEYS = frozenset({"id", "name", "arguments", "key", "side_effects", "idempotent"})


def _outstanding(raw: Any, fmt: int) -> OutstandingCall:
    required = _CALL_KEYS | ({"redacted"} if fmt >= 2 else set())
    o = _fields(raw, required, _CALL_KEYS | {"redacted"}, "an outstanding call")
    return OutstandingCall(
        call=ToolCall(id=_str(o["id"]), name=_str(o["name"]), arguments=_obj(o["arguments"])),
        key=_opt_str(o["key"]),
        side_effects=_bool(o["side_effects"]),
        idempotent=_bool(o["idempotent"]),
        redacted=_bool(o.get("redacted", False)),
    )


_GRANT_KEYS = frozenset({"request", "call_id", "key", "approved", "by"})


def _grant(raw: Any, fmt: int) -> Grant:
    required = _GRANT_KEYS | ({"note"} if fmt >= 2 else set())
    g = _fields(raw, required, _GRANT_KEYS | {"note"}, "a grant")
    return Grant(
        request=_str(g["request"]),
        call_id=_str(g["call_id"]),
        key=_opt_str(g["key"]),
        approved=_bool(g["approved"]),
        by=_opt_str(g["by"]),
        note=_opt_str(g.get("note")),
    )


# --- strict field readers -----------------------------------------------------------------


def _fields(
    value: Any,
    required: Set[str],
    allowed: Set[str] | None = None,
    where: str = "an object",
) -> dict[str, Any]:
    """``value`` as a JSON object with every ``required`` key and nothing outside
    ``allowed`` (default: exactly ``required``); a stray key is damage, not an extension."""
    obj = _obj(value)
    missing = required - obj.keys()
    if missing:
        raise KeyError(f"{where} lacks {sorted(missing)}")
    extra = obj.keys() - (required if allowed is None else allowed)
    if extra:
        raise ValueError(f"{where} has unknown field(s) {sorted(extra)}")
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
