"""Cancelling a run: an audited request any holder sees at its next boundary.

The request is a record in the idempotency store under the run's cancel key (a record with
no tool, as a resume claim is), so it is durable on every backend and needs no schema of
its own; its outcome says who asked, when and why. The holder carrying the run finds it at
the next boundary (before the model is asked again; once it has answered, when that is
its last answer or asks for an approval) and ends the run there with a final
``cancelled`` frontier, dispatching nothing more. Every call looks at it once its claim is
durable (an unkeyed call, just before it goes out), so a call claimed after the request
was recorded is answered "not sent": a cancel acknowledged before a call was claimed
stops it. A run nobody holds is ended by whoever asked.

The same boundary hears an interrupt a store driver lost: a cancellation of the task
carrying the run (Ctrl-C is ``asyncio.run`` cancelling its main task) that an await
swallowed, as Python 3.11's ``asyncio.wait_for`` does when the awaited result is in by the
time the cancelled caller wakes (redis-py sends every command through one). The task still
says it is being cancelled, so the run raises ``CancelledError`` there rather than carry
on to completion.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import time
from dataclasses import dataclass

from tesserix_adk.checkpoint.checkpointer import Checkpointer, TranscriptCursor
from tesserix_adk.checkpoint.payload import (
    Checkpoint,
    CheckpointStatus,
    OutstandingCall,
    decode_outcome,
    encode_outcome,
    record_tag,
)
from tesserix_adk.checkpoint.redaction import Redactor
from tesserix_adk.errors import CheckpointCorruptError, ConfigurationError, StoreUnavailableError
from tesserix_adk.messages import ToolOutcome
from tesserix_adk.run.parts import RunParts
from tesserix_adk.run.state import RunState
from tesserix_adk.stores.protocols import IdempotencyStore, RecordStatus
from tesserix_adk.tools import canonical_json

__all__ = [
    "CancelRequest",
    "cancel_key",
    "UNREAD",
    "Unread",
    "cancel_requested",
    "check_cancel_request",
    "cancelled_frontier",
    "not_sent_if_cancelled",
    "request_cancel",
]

REASON_CHARS = 4000
"""How much of a cancel's reason its cancelled frontier carries (the request keeps it all),
as a grant carries an approval's note (``approvals.GRANT_NOTE_CHARS``)."""

REASON_MAX_CHARS = 50_000
"""The longest reason a cancel request keeps: written out as JSON (12 bytes a character at
worst, an astral one written as two escaped halves when the text holds a lone surrogate), it
stays under an outcome's 1 MiB cap."""

BY_CHARS = 512
"""The longest name of who cancels: it goes whole into the cancelled frontier."""


@dataclass(frozen=True, slots=True, kw_only=True)
class CancelRequest:
    """Who asked for the run to be cancelled, when (epoch seconds) and why."""

    by: str
    at: float
    reason: str | None = None

    def describe(self) -> str:
        """``cancelled by <by>[: <reason>]``, the reason cut at ``REASON_CHARS`` saying how
        much more the request keeps: it is the cancelled frontier's output, and a long one
        would make that frontier too large to write (a tombstone, not a cancelled run)."""
        if not self.reason:
            return f"cancelled by {self.by}"
        reason = self.reason
        if len(reason) > REASON_CHARS:
            rest = len(reason) - REASON_CHARS
            reason = f"{reason[:REASON_CHARS]}… ({rest} characters more in the cancel request)"
        return f"cancelled by {self.by}: {reason}"


def cancel_key(tenant: str, run_id: str) -> str:
    """The idempotency key of a run's cancel request."""
    body = canonical_json(["cancel", tenant, run_id])
    return "cancel1:" + hashlib.sha256(body.encode("utf-8")).hexdigest()


def check_cancel_request(*, by: str, reason: str | None) -> None:
    """Refuse a ``by`` past ``BY_CHARS`` or a reason past ``REASON_MAX_CHARS``
    (``ConfigurationError``), whatever the run's state: a request that could not be
    recorded is refused alike when there is nothing to cancel."""
    if len(by) > BY_CHARS:
        raise ConfigurationError(
            f"who cancels is named in {len(by)} characters; a name is at most {BY_CHARS}"
        )
    if reason is not None and len(reason) > REASON_MAX_CHARS:
        raise ConfigurationError(
            f"the cancel's reason is {len(reason)} characters long; a reason is at most "
            f"{REASON_MAX_CHARS}"
        )


async def request_cancel(
    idempotency: IdempotencyStore,
    tenant: str,
    run_id: str,
    *,
    by: str,
    reason: str | None,
    redactor: Redactor,
) -> CancelRequest:
    """Record the request (the first one stands: asking again returns it). A ``by`` past
    ``BY_CHARS`` or a reason past ``REASON_MAX_CHARS`` is refused, ``ConfigurationError``,
    nothing recorded: the request is a record of at most 1 MiB, read at every boundary."""
    check_cancel_request(by=by, reason=reason)
    key = cancel_key(tenant, run_id)
    # Who asked is kept as the request's holder too: a NUL in it, which PostgreSQL's text
    # cannot keep, is written ``\x00`` on every store alike.
    by = redactor.text(by).replace("\x00", "\\x00")
    holder = f"cancel:{by}"
    request = CancelRequest(
        by=by, at=time.time(), reason=None if reason is None else redactor.text(reason)
    )
    content = {"by": request.by, "at": request.at, "reason": request.reason}
    # Encoded before the claim: a request that cannot be written must not leave a claim in
    # flight that nobody completes (it never expires, and would stop every later cancel).
    encoded = encode_outcome(
        ToolOutcome(call_id="cancel", content=content), redactor, record=record_tag(tenant, key)
    )
    rec = await idempotency.claim(
        key,
        holder=holder,
        tenant=tenant,
        run_id=run_id,
        iteration=None,
        tool=None,
        call_id=None,
        flags=None,
    )
    if rec.status is RecordStatus.completed or rec.holder != holder:
        found = await cancel_requested(idempotency, tenant, run_id)
        if found is not None:
            return found
    await idempotency.complete(key, encoded, tenant=tenant, holder=holder)
    return request


class Unread:
    """The cancel request was not read yet (``UNREAD``): the reader reads it itself."""


UNREAD = Unread()


async def cancel_requested(
    idempotency: IdempotencyStore, tenant: str, run_id: str
) -> CancelRequest | None:
    """The run's recorded cancel request, or ``None``; ``CancelledError`` if the task
    asking is being cancelled, however an await on the way lost the cancellation."""
    key = cancel_key(tenant, run_id)
    rec = (await idempotency.lookup([key], tenant=tenant)).get(key)
    _cancellation_kept()
    if rec is None or rec.status is not RecordStatus.completed or rec.outcome is None:
        return None
    try:
        content = decode_outcome(
            bytes(rec.outcome), "cancel", record=record_tag(tenant, rec.key)
        ).content
    except CheckpointCorruptError as exc:
        raise CheckpointCorruptError(
            f"the cancel request of run {run_id!r} cannot be read: {exc}"
        ) from exc
    if not isinstance(content, dict) or not isinstance(content.get("by"), str):
        raise CheckpointCorruptError(f"the cancel request of run {run_id!r} cannot be read")
    at = content.get("at")
    reason = content.get("reason")
    return CancelRequest(
        by=content["by"],
        at=float(at) if isinstance(at, (int, float)) else 0.0,
        reason=reason if isinstance(reason, str) else None,
    )


async def not_sent_if_cancelled(
    parts: RunParts, run: RunState, oc: OutstandingCall
) -> ToolOutcome | None:
    """The "not sent" answer of a call about to go out, if the run's cancel was asked."""
    cancelled = await cancel_requested(parts.idempotency, run.tenant, run.run_id)
    if cancelled is None:
        return None
    return ToolOutcome(
        call_id=oc.call.id, content=f"not sent: the run was {cancelled.describe()}", is_error=True
    )


def _cancellation_kept() -> None:
    """Raise ``CancelledError`` if the current task was asked to cancel and an await lost
    it (nothing uncancelled it): the run stops at this boundary instead of running on."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError("the run was cancelled (an await on the way lost it)")


async def cancelled_frontier(
    checkpointer: Checkpointer, cp: Checkpoint, *, fence: int | None, request: CancelRequest
) -> None:
    """Write the final ``cancelled`` frontier after ``cp``, by a holder of the run's lease
    that has no agent at hand (the run is ended where it stands: nothing more is sent)."""
    messages = await checkpointer.messages(cp)
    frontier = dataclasses.replace(
        cp,
        step=cp.step + 1,
        status=CheckpointStatus.cancelled,
        fence=fence,
        messages=tuple(messages),
        outstanding=(),
        pending_approval=None,
        grants=(),
        output=request.describe(),
        written_at=time.time(),
    )
    cursor = TranscriptCursor(handle=cp.history_handle, persisted=len(messages))
    if not await checkpointer.write(frontier, cursor=cursor):
        raise checkpointer.last_error or StoreUnavailableError(
            f"the cancelled frontier of run {cp.run_id!r} was not written"
        )
