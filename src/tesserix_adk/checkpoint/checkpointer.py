"""``Checkpointer``: redact, size and write frontiers; read and verify them back.

A checkpoint failure never fails the live run: it is kept in ``last_error`` and logged, and
the run carries on. The exceptions are ``StaleFenceError`` and ``LeaseLostError``, which
mean another worker carries the run now and this one must stop at once.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TypeGuard

from tesserix_adk.checkpoint.payload import (
    DEFAULT_MAX_BYTES,
    Boundary,
    Checkpoint,
    decode_checkpoint,
    decode_messages,
    encode_checkpoint,
    encode_message,
    observation_refers,
    resolve_observation,
    tombstone_payload,
)
from tesserix_adk.checkpoint.payload.weighing import HEAVY, weighed
from tesserix_adk.checkpoint.redaction import Masked, Redactor
from tesserix_adk.checkpoint.state_json import state_from_json, state_to_json
from tesserix_adk.errors import (
    AdkError,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointFormatError,
    CheckpointTooLargeError,
    ConfigurationError,
    HistoryUnavailableError,
    LeaseLostError,
    StaleFenceError,
)
from tesserix_adk.messages import Message
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.stores.capabilities import step_history
from tesserix_adk.stores.protocols import (
    EMPTY_HISTORY_DIGEST,
    CheckpointStore,
    FrontierWithHistory,
    GroupedWrites,
    HistoryHandle,
    HistoryStore,
    StepHistory,
    WriteGroup,
    chained,
)

__all__ = [
    "DEFAULT_MAX_BYTES",
    "CheckpointPolicy",
    "Checkpointer",
    "TranscriptCursor",
    "state_from_json",
    "state_to_json",
]

_log = logging.getLogger("tesserix_adk.checkpoint")


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckpointPolicy:
    """At which boundaries frontiers are written. Fewer boundaries cost less and repeat
    more work on resume. ``before_approval`` and final frontiers are written regardless."""

    boundaries: frozenset[Boundary] = field(default_factory=lambda: frozenset(Boundary))

    def __post_init__(self) -> None:
        object.__setattr__(self, "boundaries", frozenset(Boundary(b) for b in self.boundaries))


@dataclass(slots=True)
class TranscriptCursor:
    """How much of a live run's transcript the history store already holds."""

    handle: HistoryHandle | None = None
    persisted: int = 0


class Checkpointer:
    """Writes a run's frontiers to a ``CheckpointStore`` and reads them back."""

    def __init__(
        self,
        store: CheckpointStore,
        *,
        policy: CheckpointPolicy | None = None,
        max_bytes: int = DEFAULT_MAX_BYTES,
        redact: bool = True,
        extra_patterns: Sequence[str] = (),
        history: HistoryStore | None = None,
    ) -> None:
        self.store = store
        self.policy = policy or CheckpointPolicy()
        self.max_bytes = max_bytes
        self.history = history
        self.redactor = Redactor(extra_patterns=tuple(extra_patterns), enabled=redact)
        self.last_error: Exception | None = None
        # What a store offers, asked once per store object: a runtime protocol check walks
        # every member of the protocol, and a frontier is written twice a turn.
        self._offered: dict[tuple[int, type], tuple[object, bool]] = {}

    @classmethod
    def from_stores(
        cls,
        stores: Stores,
        *,
        policy: CheckpointPolicy | None = None,
        max_bytes: int = DEFAULT_MAX_BYTES,
        redact: bool = True,
        extra_patterns: Sequence[str] = (),
    ) -> Checkpointer:
        """A ``Checkpointer`` over an ``open_stores`` bundle, its transcript in ``history``."""
        return cls(
            stores.checkpoints,
            policy=policy,
            max_bytes=max_bytes,
            redact=redact,
            extra_patterns=extra_patterns,
            history=stores.history,
        )

    # --- writing -------------------------------------------------------------------------

    async def write(
        self, frontier: Checkpoint, *, cursor: TranscriptCursor, off_loop: bool | None = None
    ) -> bool:
        """Write ``frontier`` (its ``messages`` the whole live transcript); ``True`` if the
        store took it. Failures land in ``last_error``; fence and lease errors propagate.
        ``off_loop``: what ``encodes_off_loop`` said of it, if the caller asked already."""
        try:
            await self._write(frontier, cursor, off_loop)
        except (StaleFenceError, LeaseLostError):
            raise
        except CheckpointTooLargeError as exc:
            self._failed(frontier, exc)
            await self._tombstone(frontier, str(exc))
            return False
        except Exception as exc:
            self._failed(frontier, exc)
            return False
        return True

    def joins(self, group: WriteGroup) -> bool:
        """Whether a frontier written now, with its transcript append, joins ``group``
        (both stores are on the group's database); a store that does not say so is taken
        to commit on its own."""
        stores: list[object] = [self.store]
        if self.history is not None:
            stores.append(self.history)
        return all(self._grouped(s) and s.joins(group) for s in stores)

    def _grouped(self, store: object) -> TypeGuard[GroupedWrites]:
        return self._offers(store, GroupedWrites)

    def _with_history(self, store: object) -> TypeGuard[FrontierWithHistory]:
        return self._offers(store, FrontierWithHistory)

    def _offers(self, store: object, capability: type) -> bool:
        """``isinstance(store, capability)``, remembered for as long as it is that store."""
        key = (id(store), capability)
        known = self._offered.get(key)
        if known is None or known[0] is not store:
            known = (store, isinstance(store, capability))
            self._offered[key] = known
        return known[1]

    def encodes_off_loop(self, frontier: Checkpoint, cursor: TranscriptCursor) -> bool:
        """Whether writing ``frontier`` redacts and encodes enough to do it in a worker
        thread (a while: nothing should wait on this run's writes meanwhile)."""
        messages = frontier.messages or ()
        fresh = messages[cursor.persisted :] if self.history is not None else messages
        return _weight(fresh, frontier) > OFF_LOOP_BYTES

    async def _write(
        self, frontier: Checkpoint, cursor: TranscriptCursor, off_loop: bool | None
    ) -> None:
        frontier_messages = frontier.messages or ()
        if off_loop is None:
            off_loop = self.encodes_off_loop(frontier, cursor)
        if off_loop:
            # Redacting and encoding a large payload takes a while even in linear time: in
            # a worker thread the event loop keeps renewing leases in the meantime.
            new, expected, payload = await asyncio.to_thread(self._encoded, frontier, cursor)
        else:
            new, expected, payload = self._encoded(frontier, cursor)
        if self.history is None or expected is None:
            await self.store.put(
                frontier.tenant, frontier.run_id, payload, step=frontier.step, fence=frontier.fence
            )
            return
        stored: HistoryHandle | None = None
        if new or cursor.handle is None:
            if self._with_history(self.store):
                # One transaction for both where the backend can (one commit, one sync).
                stored = await self.store.put_with_history(
                    self.history,
                    frontier.tenant,
                    frontier.run_id,
                    payload,
                    step=frontier.step,
                    fence=frontier.fence,
                    encoded=new,
                    after=cursor.handle,
                )
            if stored is not None:
                _same_handle(stored, expected)
            else:
                stored = await self.history.append(
                    frontier.tenant, frontier.run_id, new, fence=frontier.fence, after=cursor.handle
                )
                _same_handle(stored, expected)
                await self.store.put(
                    frontier.tenant,
                    frontier.run_id,
                    payload,
                    step=frontier.step,
                    fence=frontier.fence,
                )
        else:
            await self.store.put(
                frontier.tenant, frontier.run_id, payload, step=frontier.step, fence=frontier.fence
            )
        cursor.handle = expected
        cursor.persisted = len(frontier_messages)

    def check_input(self, messages: Sequence[Message], state: Any = None) -> None:
        """``CheckpointTooLargeError`` (not retryable) for a run's input no frontier could
        hold: a message over ``max_bytes``, a state (its JSON form) that is, or, with the
        transcript inline (no history store), messages and state that together are. Such a
        run would be carried with tombstones only, its answer kept nowhere."""
        entries = [encode_message(m, self.redactor) for m in messages]
        # Every frontier holds the state: its most compact JSON is a floor on its share.
        kept = json.dumps(self.redactor.value(state), ensure_ascii=False, separators=(",", ":"))
        held = len(kept.encode()) if state is not None else 0
        if self.history is not None:
            sizes = [len(e) for e in entries] + [held]
        else:
            sizes = [sum(map(len, entries)) + held]
        for size in sizes:
            if size > self.max_bytes:
                raise CheckpointTooLargeError(
                    f"an input of {size} bytes is over max_bytes={self.max_bytes}: no frontier "
                    "of the run could hold it",
                    retryable=False,
                )

    def _encoded(
        self, frontier: Checkpoint, cursor: TranscriptCursor
    ) -> tuple[list[bytes], HistoryHandle | None, bytes]:
        """The new transcript entries, the handle of the transcript they extend (``None``
        with no history store: the transcript goes inline) and the frontier's payload,
        naming that handle: redacted, encoded and sized, nothing written yet."""
        messages = frontier.messages or ()
        new: list[bytes] = []
        handle = None
        if self.history is not None:
            new = [encode_message(m, self.redactor) for m in messages[cursor.persisted :]]
            for entry in new:
                if len(entry) > self.max_bytes:
                    raise CheckpointTooLargeError(
                        f"a message of {len(entry)} bytes is over max_bytes={self.max_bytes}; "
                        "it was not written",
                        retryable=False,
                    )
            # The handle is a pure function of the bytes, so the frontier can name it before
            # anything is written, and everything is sized before anything is stored.
            handle = _extended(cursor.handle, new, frontier.tenant, frontier.run_id)
        payload = encode_checkpoint(frontier, self.redactor, history=handle)
        if len(payload) > self.max_bytes:
            raise CheckpointTooLargeError(
                f"the frontier of run {frontier.run_id!r} at step {frontier.step} is "
                f"{len(payload)} bytes, over max_bytes={self.max_bytes}; it was not written",
                retryable=False,
            )
        return new, handle, payload

    async def _tombstone(self, frontier: Checkpoint, reason: str) -> None:
        payload = tombstone_payload(
            tenant=frontier.tenant,
            run_id=frontier.run_id,
            agent_name=frontier.agent_name,
            step=frontier.step,
            reason=reason,
            fence=frontier.fence,
        )
        try:
            await self.store.put(
                frontier.tenant, frontier.run_id, payload, step=frontier.step, fence=frontier.fence
            )
        except (StaleFenceError, LeaseLostError):
            raise
        except Exception as exc:
            _log.error(
                "tombstone for run %s step %s not written: %r",
                frontier.run_id,
                frontier.step,
                Masked(exc),
            )

    def _failed(self, frontier: Checkpoint, exc: Exception) -> None:
        self.last_error = redacted_error(exc, self.redactor)
        _log.warning(
            "checkpoint of run %s (tenant %s) at step %s not written: %s",
            frontier.run_id,
            frontier.tenant,
            frontier.step,
            self.last_error,
        )

    # --- reading -------------------------------------------------------------------------

    async def latest(self, tenant: str, run_id: str) -> Checkpoint | None:
        """The run's frontier, decoded and verified, or ``None``."""
        stored = await self.store.latest(tenant, run_id)
        if stored is None:
            return None
        return decode_checkpoint(stored.payload, tenant=tenant, run_id=run_id, step=stored.step)

    async def at(self, tenant: str, run_id: str, step: int) -> Checkpoint | None:
        """The snapshot of ``step``, or ``None``; a corrupt one raises."""
        if isinstance(step, bool) or not isinstance(step, int):
            raise ConfigurationError(f"a step is a whole number, got {step!r}")
        if not _STEPS_MIN <= step <= _STEPS_MAX:
            return None  # no store keeps a step past a 64-bit integer (and some refuse it)
        stored = await self._step_history().at(tenant, run_id, step)
        if stored is None:
            return None
        return decode_checkpoint(stored.payload, tenant=tenant, run_id=run_id, step=step)

    async def steps(self, tenant: str, run_id: str) -> list[int]:
        """The steps kept for the run, ascending."""
        return await self._step_history().steps(tenant, run_id)

    def _step_history(self) -> StepHistory:
        return step_history(self.store)

    async def observation(self, checkpoint: Checkpoint) -> Any:
        """The frontier's observation (the last turn's tool results) as the run kept it:
        entries it names in its transcript (``content_at``) are read from there, verified
        (the errors of ``messages``)."""
        if not observation_refers(checkpoint.observation):
            return checkpoint.observation
        return resolve_observation(checkpoint.observation, await self.messages(checkpoint))

    async def last_written_whole(self, checkpoint: Checkpoint) -> Checkpoint | None:
        """``checkpoint``, or for a tombstone (a frontier refused as too large, which keeps
        no transcript) the latest step before it that was written whole and reads, where
        the store keeps step snapshots; ``None`` when there is none to read. What an operator is
        shown of such a run: the conversation as far as it was kept."""
        if not checkpoint.is_tombstone:
            return checkpoint
        if not isinstance(self.store, StepHistory):
            return None
        kept = await self.steps(checkpoint.tenant, checkpoint.run_id)
        for step in reversed([s for s in kept if s < checkpoint.step]):
            try:
                earlier = await self.at(checkpoint.tenant, checkpoint.run_id, step)
            except (CheckpointCorruptError, CheckpointFormatError):
                continue  # a damaged step tells nothing; an earlier one may
            if earlier is not None and not earlier.is_tombstone:
                return earlier
        return None

    async def messages(self, checkpoint: Checkpoint) -> list[Message]:
        """The transcript a frontier names, verified.

        ``CheckpointCorruptError`` if an entry was damaged (it fails its own checksum);
        ``HistoryUnavailableError`` if the transcript is gone, shorter, or intact entries
        that are not the ones the frontier names (its chained digest differs).
        """
        if checkpoint.messages is not None:
            return list(checkpoint.messages)
        handle = checkpoint.history_handle
        if handle is None:  # pragma: no cover - decode_checkpoint refuses this
            raise CheckpointCorruptError("the frontier names no transcript")
        if self.history is None:
            raise HistoryUnavailableError(
                f"the frontier of run {checkpoint.run_id!r} keeps its transcript in a history "
                "store, and this Checkpointer has none"
            )
        entries = await self.history.fetch(handle)
        if len(entries) != handle.count:
            raise HistoryUnavailableError(
                f"the transcript of run {checkpoint.run_id!r} does not match its frontier "
                f"({len(entries)} of {handle.count} message(s) resolve)"
            )
        # Each entry verifies its own checksum first: a damaged entry is corrupt (exit 4,
        # an operator's case), not merely a transcript that is gone or was replaced.
        messages = decode_messages(entries)
        if chained(EMPTY_HISTORY_DIGEST, entries) != handle.digest:
            raise HistoryUnavailableError(
                f"the transcript of run {checkpoint.run_id!r} does not match its frontier "
                f"(its {handle.count} message(s) are not the ones it names)"
            )
        return messages


_STEPS_MIN, _STEPS_MAX = -(2**63), 2**63 - 1


def _extended(
    handle: HistoryHandle | None, new: Sequence[bytes], tenant: str, run_id: str
) -> HistoryHandle:
    """The handle of ``handle``'s prefix extended by ``new``."""
    count, digest = (0, EMPTY_HISTORY_DIGEST) if handle is None else (handle.count, handle.digest)
    return HistoryHandle(
        tenant=tenant, run_id=run_id, count=count + len(new), digest=chained(digest, new)
    )


def _same_handle(stored: HistoryHandle, expected: HistoryHandle) -> None:
    if (stored.count, stored.digest) != (expected.count, expected.digest):
        raise HistoryUnavailableError(
            f"the history store answered an append with prefix {stored.count}/{stored.digest}, "
            f"not the {expected.count}/{expected.digest} the frontier names"
        )


# Above this many characters of new content, a frontier is redacted and encoded in a worker
# thread (a few milliseconds of work at the slowest redaction rate).
OFF_LOOP_BYTES = 16 * 1024


def text_weight(value: Any, *, past: int = OFF_LOOP_BYTES) -> int:
    """A cheap estimate of how much text redacting ``value`` goes through, counted only
    until it is over ``past``: JSON data (text, numbers, lists, tuples, dicts) is walked
    item by item, so a result of millions of items costs the event loop no more than one
    just over the line; anything else is its ``str`` (a value too deep to print, or holding
    an int too long to, counts as heavy: it is handled in a thread)."""
    return weighed(value, _text_cost, past=past)


def _text_cost(item: Any) -> int:
    kind = type(item)
    if kind is str:
        return len(item) + 2
    if item is None or kind is bool or kind is float:
        return 5
    if kind is int:
        # A huge int is printed in a thread, never counted digit by digit here.
        return 20 if -(10**18) < item < 10**18 else HEAVY
    if kind is list or kind is tuple or kind is dict:
        return 2  # what it holds is weighed item by item
    try:
        return len(str(item))
    except (RecursionError, ValueError):
        return HEAVY


def _weight(messages: Sequence[Message], frontier: Checkpoint) -> int:
    size = sum(text_weight(m.content) + text_weight(m.tool_calls) for m in messages)
    size += text_weight(frontier.observation) + text_weight(frontier.state)
    return size + sum(text_weight(oc.call.arguments) for oc in frontier.outstanding)


def redacted_error(exc: Exception, redactor: Redactor) -> Exception:
    """``exc`` as ``last_error`` keeps it: its text redacted (a validation error quotes the
    value it refused, which may be a secret), its type and retryability kept."""
    text = str(exc)
    masked = redactor.text(text)
    if masked == text:
        return exc
    try:
        copy = type(exc)(masked)
    except Exception:
        return CheckpointError(f"{type(exc).__name__}: {masked}")
    if isinstance(exc, AdkError) and isinstance(copy, AdkError):
        copy.retryable = exc.retryable
    return copy
