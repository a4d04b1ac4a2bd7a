"""The codec of frontiers, step snapshots and tombstones (the same bytes): encoded with
user data redacted and checksummed, decoded checksum first, then format, then every field's
type."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tesserix_adk.checkpoint.payload.envelope import (
    CHECKPOINT_FORMAT,
    _bounded,
    _sealed_within,
    seal,
    unseal,
)
from tesserix_adk.checkpoint.payload.fields import (
    _bool,
    _fields,
    _int,
    _list,
    _obj,
    _opt_int,
    _opt_str,
    _str,
)
from tesserix_adk.checkpoint.payload.frontier import (
    Boundary,
    Carrier,
    Checkpoint,
    CheckpointStatus,
    Grant,
    OutstandingCall,
    PendingApproval,
)
from tesserix_adk.checkpoint.payload.observation import (
    NAMING_FORMAT,
    _encoded_observation,
    check_observation,
    observation_refers,
)
from tesserix_adk.checkpoint.payload.redacting import _redacted_message
from tesserix_adk.checkpoint.payload.transcript import _message
from tesserix_adk.checkpoint.redaction import Redactor
from tesserix_adk.errors import CheckpointCorruptError, CheckpointFormatError
from tesserix_adk.messages import ToolCall, Usage
from tesserix_adk.stores.protocols import HistoryHandle

__all__ = [
    "CARRIER_FORMAT",
    "MASKED_STATE_FORMAT",
    "decode_checkpoint",
    "encode_checkpoint",
    "tombstone_payload",
]

CARRIER_FORMAT = 4
"""The format of a frontier that names its carrier (``carried_by``, a Temporal run): a kit
that reads only up to format 3 refuses it (``CheckpointFormatError``) instead of taking a
run its workflow carries for one of its own. Other frontiers keep their format."""

MASKED_STATE_FORMAT = 5
"""The format of a frontier whose state lost a value to masking (``state_redacted``): a
kit that reads only up to format 4 refuses it instead of handing its tools the mask. Such
a frontier names its carrier, if it has one, in this format too."""


def encode_checkpoint(
    cp: Checkpoint, redactor: Redactor, *, history: HistoryHandle | None = None
) -> bytes:
    """The payload of a frontier, with user data redacted, checksummed; with ``history``,
    naming that transcript in place of its own ``messages`` and ``history_handle``.

    ``CheckpointTooLargeError(retryable=False)`` if it would nest deeper than
    ``MAX_NESTING`` (nothing is truncated); the size cap is the ``Checkpointer``'s.

    With ``history`` naming exactly ``cp.messages``, the observation names the results
    that transcript holds instead of copying them (``observation``).
    """
    outstanding = []
    for oc in cp.outstanding:
        arguments = _bounded(
            dict(oc.call.arguments), f"the arguments of {oc.call.name} ({oc.call.id})"
        )
        outstanding.append(
            {
                "id": oc.call.id,
                "name": redactor.text(oc.call.name),
                "arguments": redactor.value(arguments),
                "key": oc.key,
                "side_effects": oc.side_effects,
                "idempotent": oc.idempotent,
                "redacted": oc.redacted or redactor.changed(arguments),
            }
        )
    observation = _encoded_observation(
        cp.observation,
        redactor,
        cp.messages
        if history is not None and cp.messages is not None and len(cp.messages) == history.count
        else None,
    )
    state, masked = redactor.masks(_bounded(cp.state, "the run state"))
    masked = masked or cp.state_redacted
    if masked:
        fmt = MASKED_STATE_FORMAT
    elif cp.carried_by is not None:
        fmt = CARRIER_FORMAT
    else:
        fmt = NAMING_FORMAT if observation_refers(observation) else CHECKPOINT_FORMAT
    body: dict[str, Any] = {
        "format": fmt,
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
        "state": state,
        "steps_used": cp.steps_used,
        "replay_of": cp.replay_of,
        "output": None if cp.output is None else redactor.text(cp.output),
        "written_at": cp.written_at,
        "observation": observation,
    }
    if cp.carried_by is not None:
        body["carried_by"] = str(cp.carried_by)
    if masked:
        body["state_redacted"] = True
    handle = cp.history_handle if history is None else history
    if handle is not None:
        body["history"] = {"count": handle.count, "digest": handle.digest}
    if cp.messages is not None and history is None:
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


def decode_checkpoint(
    payload: bytes, *, tenant: str, run_id: str, step: int | None = None
) -> Checkpoint:
    """Read a frontier, step snapshot or tombstone: the checksum is verified first, then
    the format, then every field's type. ``CheckpointFormatError`` for a newer format,
    ``CheckpointCorruptError`` for anything else that cannot be read as written, or for a
    checkpoint of another run or, given ``step``, of another step than the one it was
    stored as."""
    what = f"the checkpoint of run {run_id!r}"
    raw, sealed = unseal(payload, what=what)
    fmt = raw.get("format")
    if not isinstance(fmt, int) or isinstance(fmt, bool) or fmt < 1:
        raise CheckpointCorruptError(f"{what} has no valid format")
    if fmt > MASKED_STATE_FORMAT:
        raise CheckpointFormatError(
            f"{what} has format {fmt}, newer than the {MASKED_STATE_FORMAT} this kit reads; "
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
    if step is not None and cp.step != step:
        # An intact snapshot in another step's place: believed, it is a different state
        # (an earlier one sends again what the run already did).
        raise CheckpointCorruptError(
            f"the checkpoint stored as step {step} of run {run_id!r} is step {cp.step}'s"
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
    # Format 4 is written for a carried run only; format 5 for a masked state, carried or not.
    carrier = {"carried_by"} if fmt == CARRIER_FORMAT else set()
    masked = {"state_redacted"} if fmt >= MASKED_STATE_FORMAT else set()
    allowed = _FRONTIER_KEYS | _LATER_FRONTIER_KEYS | {"messages"}
    if fmt >= MASKED_STATE_FORMAT:
        allowed |= {"carried_by"}
    _fields(raw, required | carrier | masked, allowed | carrier | masked, "a frontier")
    if masked and raw["state_redacted"] is not True:
        raise ValueError("a format 5 frontier says its state was not masked")
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
    check_observation(raw.get("observation"), None if handle is None else handle.count, fmt)
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
        state_redacted=bool(masked),
        steps_used=_int(raw["steps_used"]),
        replay_of=_opt_str(raw["replay_of"]),
        output=_opt_str(raw.get("output")),
        written_at=written_at,
        observation=raw.get("observation"),
        carried_by=Carrier(_str(raw["carried_by"])) if "carried_by" in raw else None,
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
