"""``Attempt``: one try at carrying a run — its holder, lease, run claim and takeover keys.

Ownership belongs to an attempt, never to a runner object: every ``run``/``resume``/
``replay`` call is a new attempt with a holder id of its own, so a retry on the same runner
treats an earlier attempt's in-flight claim like any other holder's (it may have run).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from tesserix_adk.checkpoint.redaction import Masked, Redactor
from tesserix_adk.errors import (
    AdkError,
    ResumeConflictError,
    RunStoppedError,
    StoreReplyLostError,
    StoreUnavailableError,
)
from tesserix_adk.leases import Leaseholder
from tesserix_adk.run.events import EventSink, ProgressListener, RunEvent
from tesserix_adk.stores.protocols import IdempotencyRecord, IdempotencyStore, RecordStatus
from tesserix_adk.timestamps import iso_time
from tesserix_adk.tools import canonical_json

if TYPE_CHECKING:
    from tesserix_adk.checkpoint.payload import OutstandingCall
    from tesserix_adk.run.grouping import PendingGroup

__all__ = [
    "RESUME_CLAIM_TTL",
    "AheadCall",
    "Attempt",
    "RunClaim",
    "SendMarks",
    "new_holder",
    "run_claim_key",
]

RESUME_CLAIM_TTL = 300.0

_log = logging.getLogger("tesserix_adk.runner")


def new_holder(worker: str | None) -> str:
    """A holder id no other attempt has: the worker's name and a random suffix."""
    return f"{worker or 'worker'}-{secrets.token_hex(6)}"


def run_claim_key(tenant: str, run_id: str) -> str:
    """The idempotency key of a run's resume claim (one per tenant and run)."""
    body = canonical_json(["resume", tenant, run_id])
    return "run1:" + hashlib.sha256(body.encode("utf-8")).hexdigest()


class SendMarks(Protocol):
    """Durable marks of unkeyed side-effecting calls about to go out."""

    async def mark(self, oc: OutstandingCall) -> None:
        """Leave the call's mark, with nothing else left to stop it going out; raise to keep
        it in (``IndeterminateToolCallError`` when an earlier attempt left one)."""
        ...

    async def unsent(self, oc: OutstandingCall) -> None:
        """Drop the mark of a call that was stopped after all (its lease check); never
        raises: a mark left is a call refused in doubt, never one sent twice."""
        ...


@dataclass(frozen=True, slots=True, kw_only=True)
class AheadCall:
    """A completed side-effecting call the run made past its frontier."""

    key: str
    tool: str
    call_id: str | None

    def describe(self) -> str:
        """``<tool> (<call id>)``."""
        return f"{self.tool} ({self.call_id or self.key})"


class RunClaim:
    """A resume's at-most-once claim on the run, renewed in the background while it goes on.

    It only saves work (correctness comes from fences and call keys), so a renewal that
    cannot reach the store is retried, and only another holder's claim stops the run.
    """

    def __init__(
        self, store: IdempotencyStore, *, tenant: str, run_id: str, holder: str, ttl: float
    ) -> None:
        self.store = store
        self.tenant = tenant
        self.run_id = run_id
        self.holder = holder
        self.ttl = ttl
        self.key = run_claim_key(tenant, run_id)
        self.taken_by: str | None = None
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def take(self, *, renewing: bool = False) -> None:
        """Claim the run (``ResumeConflictError`` if another attempt holds it). A reply
        lost on the way back is settled by reading the claim back; failing that, a first
        claim is dropped, so a retry does not wait out the ttl behind a claim of its own (a
        renewal keeps what it holds)."""
        try:
            rec = await self.store.claim(
                self.key,
                holder=self.holder,
                tenant=self.tenant,
                run_id=self.run_id,
                iteration=None,
                tool=None,
                call_id=None,
                flags=None,
                ttl=self.ttl,
            )
        except StoreReplyLostError as exc:
            rec = await self._read_back(exc, renewing=renewing)
        except asyncio.CancelledError:
            # Taken, maybe, with the reply cut off (Ctrl-C): dropped (a no-op if not ours)
            # so the next resume need not wait out a claim nobody holds.
            if not renewing:
                cleanup = asyncio.ensure_future(self.release())  # bounded: 5 s at most
                while not cleanup.done():
                    with contextlib.suppress(asyncio.CancelledError):
                        await asyncio.wait({cleanup})
            raise
        except StoreUnavailableError:
            # Said not to have taken effect; should a driver have misjudged that, dropping
            # the claim (a no-op if absent) spares the retry a wait of the whole ttl.
            if not renewing:
                with contextlib.suppress(Exception):
                    await self.store.release(self.key, tenant=self.tenant, holder=self.holder)
            raise
        except AdkError:
            raise
        except Exception as exc:
            rec = await self._read_back(exc, renewing=renewing)
        if rec.status is not RecordStatus.in_flight or rec.holder != self.holder:
            lapses = ""
            if rec.expires_at is not None:
                lapses = (
                    f"; its resume claim lapses at {iso_time(rec.expires_at)} by the store's "
                    "clock unless renewed"
                )
            raise ResumeConflictError(
                f"run {self.run_id!r} is being resumed by {rec.holder}{lapses}", holder=rec.holder
            )

    async def _read_back(self, lost: Exception, *, renewing: bool) -> IdempotencyRecord:
        try:
            found = (await self.store.lookup([self.key], tenant=self.tenant)).get(self.key)
        except Exception:
            found = None
        if not renewing and (found is None or found.holder != self.holder):
            with contextlib.suppress(Exception):
                await self.store.release(self.key, tenant=self.tenant, holder=self.holder)
        if found is None:
            raise StoreUnavailableError(
                f"the resume claim of run {self.run_id!r} lost its reply: {lost}"
            ) from lost
        return found

    def start_renewing(self) -> None:
        """Renew every third of the ttl until ``release``."""
        self._task = asyncio.create_task(self._renew(), name=f"run-claim:{self.run_id}")

    def check(self) -> None:
        """``ResumeConflictError`` once another attempt took the claim over."""
        if self.taken_by is not None:
            raise ResumeConflictError(
                f"run {self.run_id!r} is being resumed by {self.taken_by}", holder=self.taken_by
            )

    async def _renew(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), self.ttl / 3)
            if self._stop.is_set():
                return
            try:
                await self.take(renewing=True)
            except ResumeConflictError as exc:
                self.taken_by = exc.holder or "another worker"
                return
            except Exception as exc:  # it expires on its own; only work is at stake
                _log.warning(
                    "renewing the resume claim of run %s failed: %r", self.run_id, Masked(exc)
                )

    def abandon(self) -> None:
        """Stop renewing and leave the claim to expire, as a dead process would."""
        self._stop.set()
        if self._task is not None:
            self._task.cancel()
            self._task = None

    async def release(self) -> None:
        """Stop renewing and drop the claim (bounded; a failure leaves it to expire)."""
        self._stop.set()
        if self._task is not None:
            with contextlib.suppress(Exception, asyncio.CancelledError, TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._task), 5.0)
            self._task.cancel()
            self._task = None
        try:
            await asyncio.wait_for(
                self.store.release(self.key, tenant=self.tenant, holder=self.holder), 5.0
            )
        except Exception as exc:
            _log.warning("releasing the resume claim failed: %r", Masked(exc))


@dataclass(slots=True, kw_only=True)
class Attempt:
    """Who carries the run right now, and what this attempt may do that another may not."""

    holder: str
    lease: Leaseholder | None = None
    run_claim: RunClaim | None = None
    # In-flight claims the plan found safe to take over and send again (idempotent or
    # side-effect free tools).
    takeover_keys: set[str] = field(default_factory=set)
    # Completed side-effecting records the run left ahead of its frontier, by iteration.
    ahead: dict[int, dict[str, AheadCall]] = field(default_factory=dict)
    stubs: Mapping[str, Callable[..., Any]] | None = None
    # A replay's calls whose arguments its step kept masked (their stubs take them as kept).
    masked_calls: frozenset[str] = frozenset()
    # Asked at each boundary between turns: a reason to stop there (a draining worker), or
    # None to go on.
    stop: Callable[[], str | None] | None = None
    # Keys this attempt is sending right now, each set once its call has its outcome.
    sending: dict[str, asyncio.Event] = field(default_factory=dict)
    # Keys whose call this attempt failed to carry through (its claim refused, the store
    # down, a death): a call waiting on one of them must not go out in its place.
    failed_keys: dict[str, BaseException] = field(default_factory=dict)
    # Keys under which this attempt sent a call: its own claim found still in flight under
    # one (a twin after its sibling lost the reply) is a call that may have happened.
    sent_keys: set[str] = field(default_factory=set)
    # Where a streamed run's events go (``AgentRunner.stream``); None: nobody listens.
    events: EventSink | None = None
    # Marks left just before an unkeyed side-effecting call goes out, by a carrier whose
    # history can be rewound (a Temporal reset); None: the kit's own runs, whose frontier
    # naming the call is mark enough.
    send_marks: SendMarks | None = None
    # Whether the model's text is streamed: asked for by whoever started the attempt (events
    # to hear), not by telemetry added to ``events`` later, which must not change the wire.
    streams: bool = field(init=False, default=False)
    # Each call of the turn being dispatched at its place in the turn, by the call object's
    # id(): events name a call by its place too, as a model may give two calls one id.
    positions: dict[int, int] = field(default_factory=dict)
    # What masks a listener's error before it is logged (the runner's; built-in patterns
    # when none was given).
    redactor: Redactor | None = None
    # The write group open right now (``run.grouping``), and whether writes may be grouped
    # at all (not while a turn's calls go out side by side).
    group: PendingGroup | None = None
    folding: bool = True

    def __post_init__(self) -> None:
        # A listener of progress alone does not want the model's text: the wire stays plain.
        self.streams = self.events is not None and not isinstance(self.events, ProgressListener)

    def position_of(self, call: object) -> int:
        """The place of ``call`` (an outstanding call of the turn) among its turn's calls."""
        return self.positions.get(id(call), 0)

    def emit(self, event: RunEvent) -> None:
        """Report ``event`` to whoever streams the run (a no-op when nobody does). A
        listener that raises is logged, never heard by the run: it is told at points where
        stopping would leave a claimed call unsent and in doubt."""
        if self.events is not None:
            try:
                self.events(event)
            except Exception as exc:
                shown = (self.redactor or Redactor()).text(repr(exc))
                _log.warning(
                    "a listener of run events failed on %s: %s", type(event).__name__, shown
                )

    @property
    def fence(self) -> int | None:
        """The fence every durable write of this attempt carries."""
        return None if self.lease is None else self.lease.fence

    def guard(self) -> None:
        """Raise before a durable write or a dispatch if this attempt may no longer carry
        the run: its lease lapsed or was taken, or its resume claim was."""
        if self.lease is not None:
            self.lease.check()
        elif self.run_claim is not None:
            # With a lease store the lease decides who carries the run; the claim only
            # saves work, and losing it to a resumer the lease refused stops nothing.
            self.run_claim.check()

    def stop_if_asked(self, run_id: str) -> None:
        """``RunStoppedError`` at a boundary if the attempt was asked to stop: nothing is
        half-done there, and the frontier already written is where the run goes on."""
        reason = None if self.stop is None else self.stop()
        if reason is not None:
            raise RunStoppedError(f"run {run_id!r} stopped at a boundary: {reason}")
