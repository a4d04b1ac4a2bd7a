"""Every store protocol of the kit, and the small records that cross a store boundary.

Stores are dumb: the kit encodes, redacts and sizes; a store keeps bytes and metadata and
decides only what must be decided atomically (fences, claims, leases). Every store that
takes writes for a run is *fenced*:

- it remembers the highest fence it has seen per (tenant, run_id);
- a write whose fence is lower raises ``StaleFenceError``;
- ``fence=None`` is accepted only until the store has seen a fence for that run;
- ``seal(tenant, run_id, fence)`` raises the highest-seen fence without writing data
  (idempotent; ``StaleFenceError`` if a higher fence was seen);
- ``forget`` removes a run's data but never its fence.

Time that decides anything (claim expiry, lease expiry) is the store's own clock, never
the caller's.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol, runtime_checkable

from tesserix_adk.messages import ToolCall, Usage

__all__ = [
    "EMPTY_HISTORY_DIGEST",
    "ApprovalRequest",
    "ApprovalStatus",
    "ApprovalStore",
    "CheckpointStore",
    "FencedStore",
    "FrontierWithHistory",
    "HistoryHandle",
    "HistoryStore",
    "IdempotencyRecord",
    "IdempotencyStore",
    "LeaseStore",
    "Ledger",
    "RecordStatus",
    "RunLease",
    "RunListing",
    "StepHistory",
    "StoredCheckpoint",
    "ToolFlags",
    "WorkIndex",
    "WorkItem",
    "WorkState",
    "chain_digest",
]


# --- checkpoints -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class StoredCheckpoint:
    """A frontier or step snapshot as a store keeps it: opaque bytes plus metadata."""

    payload: bytes
    step: int
    fence: int | None = None


@runtime_checkable
class FencedStore(Protocol):
    """A store that refuses writes from a superseded holder."""

    async def seal(self, tenant: str, run_id: str, fence: int) -> None:
        """Raise the highest-seen fence for the run without writing data."""
        ...


@runtime_checkable
class CheckpointStore(Protocol):
    """Keeps one frontier per run (``latest``).

    What a backend may offer beyond this is declared as a capability protocol of its own
    and asked for by type: ``StepHistory`` (numbered step snapshots), ``RunListing`` (the
    runs of a tenant) and ``FrontierWithHistory`` (a frontier and its transcript in one
    transaction). Every backend the kit ships offers all three.
    """

    async def put(
        self, tenant: str, run_id: str, payload: bytes, *, step: int, fence: int | None = None
    ) -> None:
        """Write a frontier; it becomes ``latest`` and step ``step`` (last write wins)."""
        ...

    async def latest(self, tenant: str, run_id: str) -> StoredCheckpoint | None:
        """The last accepted put, or ``None``."""
        ...

    async def forget(self, tenant: str, run_id: str) -> None:
        """Remove the run's frontier and steps; its fence stays."""
        ...

    async def seal(self, tenant: str, run_id: str, fence: int) -> None:
        """Raise the highest-seen fence for the run without writing data."""
        ...


@runtime_checkable
class StepHistory(Protocol):
    """A capability of a ``CheckpointStore``: every put is also kept as the snapshot of
    its step, for ``tesserix steps``, ``inspect --step`` and replay."""

    async def at(self, tenant: str, run_id: str, step: int) -> StoredCheckpoint | None:
        """The snapshot written under ``step``, or ``None`` (never a default)."""
        ...

    async def steps(self, tenant: str, run_id: str) -> list[int]:
        """The steps still kept for the run, ascending."""
        ...


@runtime_checkable
class RunListing(Protocol):
    """A capability of a ``CheckpointStore``: the runs of a tenant, for ``tesserix runs``."""

    async def runs(self, tenant: str) -> list[str]:
        """The run ids with a frontier for the tenant, sorted."""
        ...


@runtime_checkable
class FrontierWithHistory(Protocol):
    """A capability of a ``CheckpointStore``: a transcript append and the frontier that
    names it written in one transaction (one commit, one sync)."""

    async def put_with_history(
        self,
        history: HistoryStore,
        tenant: str,
        run_id: str,
        payload: bytes,
        *,
        step: int,
        fence: int | None,
        encoded: Sequence[bytes],
        after: HistoryHandle | None,
    ) -> HistoryHandle | None:
        """Append ``encoded`` after ``after`` and put the frontier, atomically; ``None``
        (and nothing written) when ``history`` is not in this store's database, and the
        caller writes them one after the other."""
        ...


# --- idempotency -------------------------------------------------------------------------


class RecordStatus(StrEnum):
    """Where an idempotency record stands."""

    in_flight = "in_flight"
    completed = "completed"
    never_ran = "never_ran"


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolFlags:
    """The flags of the tool a record belongs to, so planning needs no agent."""

    side_effects: bool = True
    idempotent: bool = False

    @property
    def safe_to_resend(self) -> bool:
        """A call of this tool may be sent again when nobody knows whether it ran."""
        return not self.side_effects or self.idempotent


@dataclass(frozen=True, slots=True, kw_only=True)
class IdempotencyRecord:
    """One claim: a tool call's (``tool`` set) or a run's resume claim (``tool`` is ``None``).

    ``since``, ``completed_at`` and ``expires_at`` are the store's clock (epoch seconds).
    ``outcome`` is bytes the kit encoded and redacted.
    """

    key: str
    status: RecordStatus
    holder: str
    tenant: str
    run_id: str
    iteration: int | None = None
    tool: str | None = None
    call_id: str | None = None
    flags: ToolFlags | None = None
    fence: int | None = None
    outcome: bytes | None = None
    since: float = 0.0
    completed_at: float | None = None
    expires_at: float | None = None
    by: str | None = None


@runtime_checkable
class IdempotencyStore(Protocol):
    """Records which calls were claimed and what they produced.

    Tenant-scoped: every method takes the tenant, and records are keyed by (tenant, key),
    so two tenants using the same key (a business key such as ``order-5``) never see,
    complete, take over or resolve each other's record.

    State machine::

        absent ──claim──▶ in_flight(holder, fence, since, …)
        in_flight ──complete(outcome), same holder──▶ completed(outcome, at)
        in_flight ──resolve by an operator──▶ completed(outcome, by) | never_ran(by)
        in_flight ──release / ttl expiry──▶ absent   (only claims taken with a ttl)
        in_flight ──release(undispatched), same holder──▶ absent   (a call never sent)
        completed ──claim──▶ returned unchanged
        never_ran ──claim──▶ in_flight               (the operator said it never ran)
    """

    async def claim(
        self,
        key: str,
        *,
        holder: str,
        tenant: str,
        run_id: str,
        iteration: int | None,
        tool: str | None,
        call_id: str | None,
        flags: ToolFlags | None,
        fence: int | None = None,
        ttl: float | None = None,
        takeover: bool = False,
    ) -> IdempotencyRecord:
        """Claim ``key`` and return the record as it stands after the call.

        The caller owns the claim iff the result is ``in_flight`` under ``holder``. A claim
        by the same holder on its own in-flight record renews its ttl. A record in flight
        under another holder is returned unchanged unless ``takeover=True``. For a tool-call
        claim (``tool`` set) the fence is checked (``StaleFenceError``) before anything else.
        A run's resume claim (``tool is None``, with a ttl) is taken before any lease exists,
        so it is not fenced: its ``fence`` is ignored and never raises the highest seen.
        """
        ...

    async def complete(
        self, key: str, outcome: bytes, *, tenant: str, holder: str
    ) -> IdempotencyRecord:
        """Record the outcome of a claim held by ``holder``.

        Not fenced: a superseded holder may still record what a call it started produced.
        Completing a record this holder does not hold in flight raises ``StaleFenceError``;
        completing one already completed by this holder returns it unchanged.
        """
        ...

    async def release(
        self, key: str, *, tenant: str, holder: str, undispatched: bool = False
    ) -> None:
        """Drop a ttl claim held in flight by ``holder``. Tool-call claims are never
        released, except with ``undispatched=True``: the holder says it claimed the call
        and then did not send it (its lease check stopped it), so nothing is in doubt."""
        ...

    async def lookup(self, keys: Sequence[str], *, tenant: str) -> dict[str, IdempotencyRecord]:
        """The tenant's live records of ``keys`` in one round trip; absent keys are left
        out."""
        ...

    async def records(self, tenant: str, run_id: str) -> list[IdempotencyRecord]:
        """Every live record of the run (tool calls and the run claim)."""
        ...

    async def resolve(
        self,
        key: str,
        outcome: bytes | None = None,
        *,
        tenant: str,
        never_ran: bool = False,
        by: str,
    ) -> IdempotencyRecord:
        """An operator settles an in-flight call: its outcome, or that it never ran.

        Raises ``KeyError`` for an unknown key and ``ValueError`` when it is not in flight.
        """
        ...

    async def seal(self, tenant: str, run_id: str, fence: int) -> None:
        """Raise the highest-seen fence for the run without writing data."""
        ...


# --- leases ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class RunLease:
    """The right to carry one run, numbered by a fence that rises on every acquisition.

    ``expires_at`` is the store's clock in epoch seconds, for display only.
    ``previous_end`` is set by ``acquire`` only: when the run's lease before this one ended
    by the store's clock (the last deadline it was renewed to if it lapsed, the moment it
    was released if it was released), ``None`` when no earlier end is on record. A claimant
    of that earlier lease may have started a call up to that moment, so whoever says such a
    call never ran waits a margin past it (``leases.never_ran_wait``). It is not part of the
    lease's identity.
    """

    tenant: str
    run_id: str
    holder: str
    fence: int
    expires_at: float
    previous_end: float | None = field(default=None, compare=False)

    def superseded_by(self, other: RunLease) -> bool:
        """``other`` is a later acquisition of the same run."""
        return (
            other.tenant == self.tenant and other.run_id == self.run_id and other.fence > self.fence
        )


@runtime_checkable
class LeaseStore(Protocol):
    """Hands out one lease per run at a time; expiry decided by the store's clock only."""

    async def acquire(self, tenant: str, run_id: str, holder: str, ttl: float) -> RunLease:
        """Take the run (raising its fence) or raise ``LeaseHeldError`` naming the holder."""
        ...

    async def renew(self, lease: RunLease, ttl: float) -> RunLease:
        """Extend a live lease, keeping its fence, or raise ``LeaseLostError``."""
        ...

    async def release(self, lease: RunLease) -> None:
        """Free the run, only for the holder at that fence; never lowers the fence."""
        ...

    async def current(self, tenant: str, run_id: str) -> RunLease | None:
        """The lease live by the store's clock, else ``None``."""
        ...

    async def ended_ago(self, tenant: str, run_id: str) -> float | None:
        """Seconds, by the store's clock, since the run's last lease ended (the last
        deadline it was renewed to if it lapsed, the moment of its release if released);
        ``None`` while a lease is live or when none ever ended. Reads only."""
        ...


# --- transcripts -------------------------------------------------------------------------


EMPTY_HISTORY_DIGEST = "sha256:" + hashlib.sha256(b"").hexdigest()


def chain_digest(previous: str, item: bytes) -> str:
    """The digest of a transcript prefix extended by one encoded message."""
    h = hashlib.sha256()
    h.update(previous.encode("ascii"))
    h.update(b"\x00")
    h.update(hashlib.sha256(item).digest())
    return "sha256:" + h.hexdigest()


@dataclass(frozen=True, slots=True, kw_only=True)
class HistoryHandle:
    """Names an exact prefix of a run's transcript: its length and chained digest."""

    tenant: str
    run_id: str
    count: int
    digest: str


@runtime_checkable
class HistoryStore(Protocol):
    """Keeps a run's encoded messages out of line, appended as the run goes."""

    async def append(
        self,
        tenant: str,
        run_id: str,
        encoded: Sequence[bytes],
        *,
        fence: int | None = None,
        after: HistoryHandle | None,
    ) -> HistoryHandle:
        """Append after the prefix ``after`` names (``None``: the empty prefix), dropping
        any tail beyond it; ``HistoryUnavailableError`` if that prefix does not resolve."""
        ...

    async def fetch(self, handle: HistoryHandle) -> list[bytes]:
        """The bytes of the prefix; ``HistoryUnavailableError`` if it does not resolve."""
        ...

    async def forget(self, tenant: str, run_id: str) -> None:
        """Remove the run's transcript; its fence stays."""
        ...

    async def seal(self, tenant: str, run_id: str, fence: int) -> None:
        """Raise the highest-seen fence for the run without writing data."""
        ...


# --- spend -------------------------------------------------------------------------------


@runtime_checkable
class Ledger(Protocol):
    """The authority on what a run has spent."""

    async def charge(
        self, tenant: str, run_id: str, micros: int, usage: Usage, *, fence: int | None = None
    ) -> None:
        """Add a model call's cost and usage to the run."""
        ...

    async def spent(self, tenant: str, run_id: str) -> int:
        """Micros charged to the run so far (0 for an unknown run)."""
        ...

    async def usage(self, tenant: str, run_id: str) -> Usage:
        """Tokens charged to the run so far."""
        ...

    async def seal(self, tenant: str, run_id: str, fence: int) -> None:
        """Raise the highest-seen fence for the run without writing data."""
        ...


# --- approvals ---------------------------------------------------------------------------


class ApprovalStatus(StrEnum):
    """Where an approval request stands."""

    pending = "pending"
    approved = "approved"
    denied = "denied"


@dataclass(frozen=True, slots=True, kw_only=True)
class ApprovalRequest:
    """One request per turn, covering every call of that turn that needs a person."""

    id: str
    tenant: str
    run_id: str
    calls: tuple[ToolCall, ...]
    iteration: int
    status: ApprovalStatus = ApprovalStatus.pending
    by: str | None = None
    note: str | None = None
    requested_at: float = 0.0
    decided_at: float | None = None


@runtime_checkable
class ApprovalStore(Protocol):
    """Approval requests and the decisions people make on them."""

    async def request(
        self,
        tenant: str,
        run_id: str,
        calls: Sequence[ToolCall],
        *,
        iteration: int,
        fence: int | None = None,
        id: str | None = None,
    ) -> ApprovalRequest:
        """Record a pending request; ids are unique per store.

        With ``id`` the request is made once: while a request with that id exists for the
        tenant, it is returned as it stands (pending or decided) and nothing is written. A
        runner that died between asking and checkpointing asks again under the same id
        and finds the request a person may already have decided.
        """
        ...

    async def decide(
        self, tenant: str, id: str, *, approved: bool, by: str, note: str | None = None
    ) -> ApprovalRequest:
        """Decide a request: the same decision again is a no-op, the other way raises
        ``ValueError``; an id unknown for the tenant raises ``KeyError``."""
        ...

    async def get(self, tenant: str, id: str) -> ApprovalRequest | None:
        """The request, or ``None`` when no request with that id belongs to the tenant."""
        ...

    async def seal(self, tenant: str, run_id: str, fence: int) -> None:
        """Raise the highest-seen fence for the run without writing data."""
        ...


# --- work --------------------------------------------------------------------------------


class WorkState(StrEnum):
    """Why a run is in the work index; the order workers take them in, first to last."""

    decided = "decided"  # an approval it waited on was decided
    wanted = "wanted"  # started and not finished: carried on whenever no lease is live
    submitted = "submitted"  # never started
    parked = "parked"  # must not carry on until an operator acts; never taken
    done = "done"  # wants no worker now (finished, cancelled, waiting on a person)


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkItem:
    """A run that wants a worker (or is parked). ``since`` and ``not_before`` are the
    store's clock (epoch seconds); ``agent`` names the agent that carries it."""

    tenant: str
    run_id: str
    agent: str
    state: WorkState
    since: float
    not_before: float | None = None
    attempts: int = 0
    reason: str | None = None


@runtime_checkable
class WorkIndex(Protocol):
    """A capability of a backend: the runs that want a worker, so that a worker finds its
    next runs without reading every run. It is an index, not the truth: a worker takes a
    run it finds through the run's lease, resume claim and frontier like anyone else, so an
    entry that is stale (a run finished a moment ago, or just taken) costs a look, never a
    duplicate. The store's clock decides which leases are live.
    """

    async def submit(self, tenant: str, run_id: str, *, agent: str, input: bytes) -> bool:
        """Record a run as submitted with its encoded input; ``False`` (and nothing
        written) when the index already knows the run, in any state or finished."""
        ...

    async def input(self, tenant: str, run_id: str) -> bytes | None:
        """The encoded input the run was submitted with, or ``None``."""
        ...

    async def want(
        self,
        tenant: str,
        run_id: str,
        *,
        agent: str,
        state: WorkState = WorkState.wanted,
        delay: float = 0.0,
        reason: str | None = None,
    ) -> None:
        """The run wants a worker (``decided``, ``wanted`` or ``submitted``), not before
        ``delay`` seconds from now by the store's clock. A retry with a delay counts one
        more attempt; without one the count starts again. Unparks a parked run."""
        ...

    async def park(self, tenant: str, run_id: str, *, agent: str, reason: str) -> None:
        """The run must not be carried on until an operator acts; ``reason`` says why."""
        ...

    async def done(self, tenant: str, run_id: str) -> None:
        """The run wants no worker now (finished, cancelled or waiting on a person): it
        becomes ``done``; a no-op for a run the index does not hold. Its submission (and so
        ``submit``'s answer for its id) is kept."""
        ...

    async def due(self, *, limit: int, agents: Sequence[str] | None = None) -> list[WorkItem]:
        """Up to ``limit`` runs a worker may take now: not parked, past ``not_before``, no
        live lease; ``decided`` first, then ``wanted``, then ``submitted``, oldest first
        within each. Only runs of ``agents`` when given."""
        ...

    async def items(
        self, tenant: str | None = None, *, state: WorkState | None = None
    ) -> list[WorkItem]:
        """The entries of ``tenant`` (every tenant: ``None``) in ``state`` (any but
        ``done``: ``None``), oldest first: for operators."""
        ...
