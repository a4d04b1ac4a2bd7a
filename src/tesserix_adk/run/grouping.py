"""A run's writes grouped into the fewest commits that keep the order the promises rest on.

Between two moments when something leaves the process (a model call, a tool call), a run's
writes need not each be durable on their own: they must be durable before the next thing
leaves. With ``AgentRunner(group_writes=True)``, on a backend that offers write groups
(``GroupedWrites``, asked of the idempotency store; the stores sharing its database join),
the runner opens a group once the model's answer is in and commits it right before anything
is sent (off by default: a process paused inside a group holds SQLite's write lock until it
wakes):

- the ledger's charge, the ``after_model_call`` frontier (with its transcript append) and
  the turn's first claim commit together, before the call goes out;
- with several calls in a turn, one at a time, each call's outcome commits with the next
  call's claim;
- the turn's last outcome commits with the ``after_tool_result`` frontier and its
  transcript append (and the next boundary's reads), before the model is asked again. That
  saves a commit a turn, and widens the window in which a death leaves a call that ran in
  doubt (until an operator decides) by the frontier's making, which runs on the event loop
  only when small (``Checkpointer.encodes_off_loop``; a heavy one commits the group
  first). A frontier whose stores do not join the group commits the group first too: a
  frontier is never durable before what the group holds.

What this changes for a death: between the model's answer and the first call's claim,
nothing of the turn is durable, so a resume asks the model again (as it did for a death
before the charge); the charge, the frontier and the claim are all there or none is. A
group that fails to commit stops the run retryably, after recording again, one by one, the
outcomes it held and dropping the claims it held (none of those calls was sent). An outcome
asks to be recorded again before its first write in the group, so one whose write itself
lost the group is recorded too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

from tesserix_adk.checkpoint.redaction import Masked
from tesserix_adk.errors import AdkError, StoreReplyLostError, StoreUnavailableError
from tesserix_adk.run.events import RunEvent
from tesserix_adk.run.recording import to_the_end
from tesserix_adk.stores.grouping import group_scope, in_scope
from tesserix_adk.stores.protocols import CommitsWithNext, GroupedWrites, WriteGroup

if TYPE_CHECKING:
    from tesserix_adk.run.attempt import Attempt

__all__ = [
    "PendingGroup",
    "announce",
    "begin",
    "commit",
    "committing_with",
    "grouped",
    "held_and_grouped",
]

_log = logging.getLogger("tesserix_adk.runner")

T = TypeVar("T")


@dataclass(slots=True, eq=False)
class PendingGroup:
    """An open group and what the runner must do should its commit fail."""

    group: WriteGroup
    # Outcomes recorded in it: recorded again, one by one, if it fails.
    redo: list[Callable[[], Awaitable[None]]] = field(default_factory=list)
    # Writes made again only if it certainly failed (a charge must not count twice).
    retry: list[Callable[[], Awaitable[None]]] = field(default_factory=list)
    # Claims taken in it (never sent): dropped again if it fails; and their keys, whose
    # answers (a call refused unsent) go with the claim, not recorded again.
    undo: list[Callable[[], Awaitable[None]]] = field(default_factory=list)
    claimed: set[str] = field(default_factory=set)
    # What a listener hears once the group is durable, never before (``FrontierWritten``).
    events: list[RunEvent] = field(default_factory=list)


@contextlib.asynccontextmanager
async def grouped(attempt: Attempt) -> AsyncIterator[None]:
    """The scope of one attempt's groups; whatever is still open is committed on the way
    out (shielded), and its failure raised unless the block already raises."""
    with group_scope():
        try:
            yield
        except (Exception, asyncio.CancelledError):
            pending = attempt.group
            if pending is not None:
                # A claim still in an open group was never sent (a call goes out only once
                # its claim's group committed): the attempt failed or was cancelled on the
                # way, so it goes, in the group (so it never commits), or every resume
                # would find a call in doubt that never left. (Should the group be lost,
                # its failed commit drops them again.)
                for drop in pending.undo:
                    with contextlib.suppress(Exception):
                        await to_the_end(drop())
            with contextlib.suppress(Exception):
                await to_the_end(commit(attempt))
            raise
        except BaseException:
            with contextlib.suppress(Exception):
                await to_the_end(commit(attempt))
            raise
        await to_the_end(commit(attempt))


@contextlib.asynccontextmanager
async def held_and_grouped(
    held: contextlib.AbstractAsyncContextManager[None], attempt: Attempt
) -> AsyncIterator[None]:
    """The run held (its lease), and inside that its write groups: the last group commits
    before the lease goes."""
    async with held, grouped(attempt):
        yield


async def begin(groups: GroupedWrites | None, attempt: Attempt) -> None:
    """Open a group for the attempt's next writes, where the backend offers them and the
    attempt is folding (one call at a time); a no-op if one is open already."""
    if groups is None or attempt.group is not None or not attempt.folding or not in_scope():
        return
    group = groups.write_group()
    try:
        await group.begin()
    except Exception as exc:
        # Grouping only saves commits: without it every write commits on its own, as
        # always (an outcome in hand is then still recorded).
        _log.warning("writes not grouped: opening a write group failed: %r", Masked(exc))
        return
    attempt.group = PendingGroup(group=group)


async def commit(attempt: Attempt) -> None:
    """Make the open group durable (a no-op without one): called before anything leaves
    the process. A failure is cleaned up (see the module docstring), then raised as
    ``StoreUnavailableError``: nothing more of the turn is sent. Cancelled meanwhile, the
    commit still runs to its end (an outcome it holds must not be lost with it), its claims
    are dropped (nothing of them was sent), and the cancellation goes on."""
    pending = attempt.group
    if pending is None:
        return
    attempt.group = None
    committing = asyncio.ensure_future(pending.group.commit())
    try:
        await to_the_end(committing)
    except asyncio.CancelledError:
        failure: BaseException | None = (
            StoreReplyLostError("the write group's commit was called off")
            if committing.cancelled()
            else committing.exception()
        )
        with contextlib.suppress(Exception):
            await to_the_end(_called_off(attempt, pending, failure))
        raise
    except AdkError as exc:
        _log.warning("a write group failed to commit: %s", Masked(exc))
        first = await _cleaned_up(pending, exc)
        if first is not None:
            raise first from exc
        raise StoreUnavailableError(
            f"the run's writes could not be committed ({exc}); nothing more was sent, and "
            "the run is resumable"
        ) from exc
    for event in pending.events:
        attempt.emit(event)


async def _cleaned_up(pending: PendingGroup, exc: AdkError) -> Exception | None:
    """After a failed commit: its outcomes recorded again, its charge made again if it
    certainly failed, its claims dropped; the first of these that fails."""
    certain = not isinstance(exc, StoreReplyLostError)
    first: Exception | None = None
    for step in [*pending.redo, *(pending.retry if certain else ()), *pending.undo]:
        try:
            await step()
        except Exception as again:  # each step is tried; the first failure is told
            first = first or again
    return first


async def _called_off(
    attempt: Attempt, pending: PendingGroup, failure: BaseException | None
) -> None:
    """After a commit the run was cancelled during: it failed (or nobody knows), and is
    cleaned up as any failed commit; or it held, and its claims go, since the run stops
    before sending them."""
    if failure is not None:
        if not isinstance(failure, AdkError):
            failure = StoreReplyLostError(f"the write group's commit failed: {failure!r}")
        await _cleaned_up(pending, failure)
        return
    for step in pending.undo:
        with contextlib.suppress(Exception):
            await step()
    for event in pending.events:
        attempt.emit(event)


async def committing_with(
    backend: CommitsWithNext | None, attempt: Attempt, last: Awaitable[T]
) -> T:
    """``last`` (the open group's last statement: a claim, the cancel check), then the
    group committed: a ``backend`` that can sends the COMMIT in the same message, which
    saves a round trip. ``last`` failing leaves the group open, as it was; what ends the
    attempt commits it, or says why not."""
    pending = attempt.group
    if pending is not None and backend is not None:
        backend.commit_with_next(pending.group)
    answer = await last
    await commit(attempt)
    return answer


def announce(attempt: Attempt, event: RunEvent) -> None:
    """Report ``event`` once what it reports is durable: now, or at the group's commit."""
    if attempt.group is not None:
        attempt.group.events.append(event)
    else:
        attempt.emit(event)
