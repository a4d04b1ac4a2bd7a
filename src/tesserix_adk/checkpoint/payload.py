"""The frontier (``Checkpoint``) and its JSON payload: format, encoding, decoding.

``CHECKPOINT_FORMAT`` is the payload version. A reader refuses a newer format with
``CheckpointFormatError`` (the bytes stay where they are for a newer kit) and anything it
cannot decode with ``CheckpointCorruptError``; it never fills a gap with a default. Every
released format has a golden payload under ``tests/`` that later readers must still read.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from tesserix_adk.checkpoint.redaction import Redactor
from tesserix_adk.errors import CheckpointCorruptError, CheckpointFormatError
from tesserix_adk.messages import Message, ToolCall, ToolOutcome, Usage, message_from_json
from tesserix_adk.messages import message_to_json as _message_to_json
from tesserix_adk.stores.protocols import HistoryHandle

__all__ = [
    "CHECKPOINT_FORMAT",
    "Boundary",
    "Checkpoint",
    "CheckpointStatus",
    "Grant",
    "OutstandingCall",
    "PendingApproval",
    "decode_checkpoint",
    "decode_message",
    "decode_outcome",
    "encode_checkpoint",
    "encode_message",
    "encode_outcome",
    "tombstone_payload",
]

CHECKPOINT_FORMAT = 1


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


# --- encoding ----------------------------------------------------------------------------


def encode_message(message: Message, redactor: Redactor) -> bytes:
    """One transcript entry as bytes, redacted (text and tool arguments; never binary)."""
    return _dumps(_redacted_message(message, redactor))


def decode_message(data: bytes) -> Message:
    """Read one transcript entry; ``CheckpointCorruptError`` if it cannot be read."""
    try:
        return message_from_json(json.loads(data))
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointCorruptError(f"a transcript entry cannot be decoded: {exc}") from exc


def encode_outcome(outcome: ToolOutcome, redactor: Redactor) -> bytes:
    """A tool call's outcome as the idempotency store keeps it (redacted)."""
    return _dumps({"content": redactor.value(outcome.content), "is_error": outcome.is_error})


def decode_outcome(data: bytes, call_id: str) -> ToolOutcome:
    """Read a recorded outcome back as the answer to ``call_id``."""
    try:
        raw = json.loads(data)
        return ToolOutcome(call_id=call_id, content=raw["content"], is_error=bool(raw["is_error"]))
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointCorruptError(f"a recorded outcome cannot be decoded: {exc}") from exc


def _redacted_message(message: Message, redactor: Redactor) -> dict[str, Any]:
    data = _message_to_json(message)
    if isinstance(data["content"], str):
        data["content"] = _redacted_text(
            data["content"], redactor, structured=data["role"] == "tool"
        )
    else:
        data["content"] = [
            {**p, "text": redactor.text(p["text"])} if p["type"] == "text" else p
            for p in data["content"]
        ]
    for call in data.get("tool_calls", ()):
        call["arguments"] = redactor.value(call["arguments"])
    return data


def _redacted_text(text: str, redactor: Redactor, *, structured: bool) -> str:
    """Mask secrets in text; a tool result that is JSON is redacted as data, so values
    under keys like ``password`` are masked as they would be in any other payload."""
    if structured and text[:1] in ("{", "["):
        try:
            data = json.loads(text)
        except ValueError:
            pass
        else:
            if redactor.changed(data):
                return json.dumps(redactor.value(data), sort_keys=True, default=str)
            return text
    return redactor.text(text)


def _dumps(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def encode_checkpoint(cp: Checkpoint, redactor: Redactor) -> bytes:
    """The payload of a frontier, with user data redacted."""
    outstanding = []
    for oc in cp.outstanding:
        args = redactor.value(dict(oc.call.arguments))
        redacted = oc.redacted or redactor.changed(dict(oc.call.arguments))
        outstanding.append(
            {
                "id": oc.call.id,
                "name": oc.call.name,
                "arguments": args,
                "key": oc.key,
                "side_effects": oc.side_effects,
                "idempotent": oc.idempotent,
                "redacted": redacted,
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
        "state": redactor.value(cp.state),
        "steps_used": cp.steps_used,
        "replay_of": cp.replay_of,
        "output": None if cp.output is None else redactor.text(cp.output),
        "written_at": cp.written_at,
        "observation": redactor.value(cp.observation),
    }
    if cp.history_handle is not None:
        body["history"] = {"count": cp.history_handle.count, "digest": cp.history_handle.digest}
    if cp.messages is not None:
        body["messages"] = [_redacted_message(m, redactor) for m in cp.messages]
    return _dumps(body)


def tombstone_payload(
    *, tenant: str, run_id: str, agent_name: str, step: int, reason: str, fence: int | None
) -> bytes:
    """The small record written in place of a refused frontier."""
    return _dumps(
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


# --- decoding ----------------------------------------------------------------------------


def decode_checkpoint(payload: bytes, *, tenant: str, run_id: str) -> Checkpoint:
    """Read a payload; typed errors for newer formats and anything unreadable."""
    try:
        raw = json.loads(payload)
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointCorruptError(
            f"the checkpoint of run {run_id!r} is not valid JSON ({len(payload)} bytes)"
        ) from exc
    if not isinstance(raw, dict):
        raise CheckpointCorruptError(f"the checkpoint of run {run_id!r} is not a JSON object")
    fmt = raw.get("format")
    if not isinstance(fmt, int) or isinstance(fmt, bool) or fmt < 1:
        raise CheckpointCorruptError(f"the checkpoint of run {run_id!r} has no valid format")
    if fmt > CHECKPOINT_FORMAT:
        raise CheckpointFormatError(
            f"the checkpoint of run {run_id!r} has format {fmt}, newer than the "
            f"{CHECKPOINT_FORMAT} this kit reads; resume it with a newer tesserix-adk"
        )
    try:
        cp = _from_json(raw)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointCorruptError(
            f"the checkpoint of run {run_id!r} cannot be decoded: {exc!r}"
        ) from exc
    if cp.tenant != tenant or cp.run_id != run_id:
        raise CheckpointCorruptError(
            f"the checkpoint stored under run {run_id!r} belongs to another run"
        )
    return cp


def _from_json(raw: Mapping[str, Any]) -> Checkpoint:
    agent = raw["agent"]
    status = CheckpointStatus(raw["status"])
    if status is CheckpointStatus.tombstone:
        return Checkpoint(
            tenant=_str(raw["tenant"]),
            run_id=_str(raw["run_id"]),
            agent_name=_str(agent["name"]),
            step=_int(raw["step"]),
            status=status,
            fence=_opt_int(raw.get("fence")),
            reason=_str(raw["reason"]),
        )
    history = raw["history"]
    handle = (
        None
        if history is None
        else HistoryHandle(
            tenant=_str(raw["tenant"]),
            run_id=_str(raw["run_id"]),
            count=_int(history["count"]),
            digest=_str(history["digest"]),
        )
    )
    messages = raw.get("messages")
    if handle is None and messages is None:
        raise ValueError("the frontier has neither a transcript nor a history handle")
    pending = raw["pending_approval"]
    usage = raw["usage"]
    boundary = raw["boundary"]
    if boundary is None and not status.finished:
        raise ValueError(f"a {status} frontier names no boundary")
    return Checkpoint(
        format=_int(raw["format"]),
        tenant=_str(raw["tenant"]),
        run_id=_str(raw["run_id"]),
        agent_name=_str(agent["name"]),
        agent_revision=_opt_str(agent["revision"]),
        step=_int(raw["step"]),
        boundary=None if boundary is None else Boundary(boundary),
        status=status,
        iteration=_int(raw["iteration"]),
        fence=_opt_int(raw["fence"]),
        messages=None if messages is None else tuple(message_from_json(m) for m in messages),
        history_handle=handle,
        outstanding=tuple(
            OutstandingCall(
                call=ToolCall(
                    id=_str(o["id"]), name=_str(o["name"]), arguments=_obj(o["arguments"])
                ),
                key=_opt_str(o["key"]),
                side_effects=_bool(o["side_effects"]),
                idempotent=_bool(o["idempotent"]),
                redacted=_bool(o.get("redacted", False)),
            )
            for o in raw["outstanding"]
        ),
        pending_approval=None
        if pending is None
        else PendingApproval(
            id=_str(pending["id"]), calls=tuple(_str(c) for c in pending["calls"])
        ),
        grants=tuple(
            Grant(
                request=_str(g["request"]),
                call_id=_str(g["call_id"]),
                key=_opt_str(g["key"]),
                approved=_bool(g["approved"]),
                by=_opt_str(g["by"]),
                note=_opt_str(g.get("note")),
            )
            for g in raw["grants"]
        ),
        usage=Usage(
            input_tokens=_int(usage["input_tokens"]), output_tokens=_int(usage["output_tokens"])
        ),
        micros=_int(usage["micros"]),
        state=raw["state"],
        steps_used=_int(raw["steps_used"]),
        replay_of=_opt_str(raw["replay_of"]),
        output=_opt_str(raw.get("output")),
        written_at=raw.get("written_at"),
        observation=raw.get("observation"),
    )


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
