"""Writing frontiers: at the policy's boundaries, and whenever a call would leave no record.

A frontier is written only at a settled boundary (after the model's whole answer, after all
results of a turn, before an approval), never mid-dispatch. A checkpoint failure never
fails the live run — except where the frontier is the only record a call will ever have.
A streamed run hears of each frontier once it is durable (``FrontierWritten``), never before.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from tesserix_adk.checkpoint.checkpointer import redacted_error
from tesserix_adk.checkpoint.payload import (
    Boundary,
    CheckpointStatus,
    OutstandingCall,
    PendingApproval,
)
from tesserix_adk.checkpoint.redaction import Masked
from tesserix_adk.errors import AdkError, CheckpointTooLargeError, StoreUnavailableError
from tesserix_adk.run import grouping
from tesserix_adk.run.attempt import Attempt
from tesserix_adk.run.events import FrontierWritten
from tesserix_adk.run.grouping import announce
from tesserix_adk.run.parts import RunParts
from tesserix_adk.run.state import RunState

__all__ = ["write_frontier", "write_frontier_naming_unkeyed"]

_log = logging.getLogger("tesserix_adk.runner")


async def write_frontier(
    parts: RunParts,
    run: RunState,
    attempt: Attempt,
    boundary: Boundary,
    *,
    outstanding: Sequence[OutstandingCall] = (),
    status: CheckpointStatus = CheckpointStatus.running,
    pending: PendingApproval | None = None,
    final: bool = False,
    force: bool = False,
    output: str | None = None,
) -> bool | None:
    """Write a frontier if the policy (or ``final``/``force``/an approval) asks for one:
    ``True`` written, ``False`` attempted and failed, ``None`` not attempted."""
    checkpoints = parts.checkpoints
    if checkpoints is None:
        return None
    forced = final or force or boundary is Boundary.before_approval
    if not forced and boundary not in checkpoints.policy.boundaries:
        return None
    attempt.guard()
    run.step += 1
    try:
        frontier = run.frontier(
            boundary,
            fence=attempt.fence,
            outstanding=tuple(outstanding),
            status=status,
            pending=pending,
            output=output,
        )
    except AdkError as exc:
        # The run's own state no longer validates or encodes (a tool spoiled it): every
        # frontier from here on would fail alike, so the run stops, typed, rather than go
        # on with nothing of it kept while its last frontier says it is running.
        error = redacted_error(exc, parts.redactor)
        checkpoints.last_error = error
        _log.error("run %s: state not checkpointed: %s", run.run_id, Masked(error))
        raise error from None
    held = attempt.group
    off_loop = None if held is None else checkpoints.encodes_off_loop(frontier, run.cursor)
    if held is not None and (off_loop or not checkpoints.joins(held.group)):
        # A while of redacting and encoding: what the group holds commits first, so no
        # lease renewal and no other writer waits on this run's open transaction. And a
        # frontier that commits on its own never goes before what the group holds: not
        # before an outcome (a resume from it would never look at that call's record
        # again), and not into a wait for the group's own lock (its stores on another
        # connection to the same file).
        await grouping.commit(attempt)
    written = await checkpoints.write(frontier, cursor=run.cursor, off_loop=off_loop)
    if written:
        announce(attempt, FrontierWritten(run_id=run.run_id, step=run.step, boundary=boundary))
    return written


async def write_frontier_naming_unkeyed(
    parts: RunParts,
    run: RunState,
    attempt: Attempt,
    calls: Sequence[OutstandingCall],
    *,
    policy_asks: bool,
) -> None:
    """Write the ``after_model_call`` frontier when the policy asks (``policy_asks``) or,
    whatever the policy, when a side-effecting call without a key is about to be sent: it
    leaves no record, so only a frontier naming it lets a resume refuse instead of sending
    it again. Such a call is not sent if that frontier was not written."""
    unkeyed = [oc.call.name for oc in calls if oc.key is None and oc.side_effects]
    if not unkeyed and not policy_asks:
        return
    written = await write_frontier(
        parts, run, attempt, Boundary.after_model_call, outstanding=calls, force=bool(unkeyed)
    )
    if not unkeyed or written is not False:
        return
    names = ", ".join(unkeyed)
    error = None if parts.checkpoints is None else parts.checkpoints.last_error
    if isinstance(error, CheckpointTooLargeError):
        # A tombstone stands in its place: no resume can carry this run on, so saying
        # "try again" would only send the operator round in circles.
        raise CheckpointTooLargeError(
            f"the frontier naming {names} (no idempotency key) is too large to write "
            f"({error}), so the call was not sent; a tombstone stands in its place and the "
            "run cannot be carried on: start it again with smaller arguments",
            retryable=False,
        ) from error
    raise StoreUnavailableError(
        f"the frontier naming {names} (no idempotency key) could not be written, so it was "
        "not sent; the run is resumable"
    ) from error
