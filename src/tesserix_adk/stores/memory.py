"""In-process stores: every protocol of ``stores.protocols``, kept in dictionaries.

For tests, demos and single-process runs. Nothing survives the process. Each public method
reads, decides and writes without awaiting in between, so concurrent tasks on one event
loop see every decision as atomic; the stores are not thread-safe.
"""

from __future__ import annotations

import copy
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from tesserix_adk.errors import (
    ConfigurationError,
    HistoryUnavailableError,
    LeaseHeldError,
    LeaseLostError,
    StaleFenceError,
)
from tesserix_adk.messages import ToolCall, Usage
from tesserix_adk.stores.protocols import (
    EMPTY_HISTORY_DIGEST,
    ApprovalRequest,
    ApprovalStatus,
    HistoryHandle,
    IdempotencyRecord,
    RecordStatus,
    RunLease,
    StoredCheckpoint,
    ToolFlags,
    chain_digest,
)
from tesserix_adk.stores.records import (
    after_claim,
    after_complete,
    after_resolve,
    checked_resolution,
)

__all__ = [
    "MemoryApprovalStore",
    "MemoryCheckpointStore",
    "MemoryHistoryStore",
    "MemoryIdempotencyStore",
    "MemoryLeaseStore",
    "MemoryLedger",
]

_RunKey = tuple[str, str]


class _Fences:
    """The highest fence seen per (tenant, run_id); entries are never dropped."""

    def __init__(self) -> None:
        self._highest: dict[_RunKey, int] = {}

    def check(self, tenant: str, run_id: str, fence: int | None) -> None:
        """Raise ``StaleFenceError`` if a write carrying ``fence`` must be refused."""
        highest = self._highest.get((tenant, run_id))
        if highest is None:
            return
        if fence is None:
            raise StaleFenceError(
                f"unfenced write refused for run {run_id!r}: fence {highest} was seen"
            )
        if fence < highest:
            raise StaleFenceError(
                f"fence {fence} is stale for run {run_id!r}: fence {highest} was seen"
            )

    def accept(self, tenant: str, run_id: str, fence: int | None) -> None:
        """Remember ``fence`` once a write carrying it was accepted."""
        if fence is None:
            return
        key = (tenant, run_id)
        self._highest[key] = max(fence, self._highest.get(key, fence))

    def seal(self, tenant: str, run_id: str, fence: int) -> None:
        """Raise the highest-seen fence to ``fence``; refuse to lower it."""
        highest = self._highest.get((tenant, run_id))
        if highest is not None and highest > fence:
            raise StaleFenceError(
                f"cannot seal run {run_id!r} at fence {fence}: fence {highest} was seen"
            )
        self._highest[(tenant, run_id)] = fence


def _positive_ttl(ttl: float) -> float:
    if not ttl > 0:
        raise ValueError(f"ttl must be a positive number of seconds, got {ttl!r}")
    return float(ttl)


# --- checkpoints -------------------------------------------------------------------------


@dataclass(slots=True, kw_only=True)
class _CheckpointRun:
    frontier: StoredCheckpoint | None = None
    steps: dict[int, StoredCheckpoint] = field(default_factory=dict)


class MemoryCheckpointStore:
    """A ``CheckpointStore`` in a dictionary; ``keep_last=N`` keeps the N highest steps."""

    def __init__(self, *, keep_last: int | None = None) -> None:
        if keep_last is not None and keep_last < 1:
            raise ConfigurationError(f"keep_last must be at least 1, got {keep_last}")
        self.keep_last = keep_last
        self._runs: dict[_RunKey, _CheckpointRun] = {}
        self._fences = _Fences()

    async def put(
        self, tenant: str, run_id: str, payload: bytes, *, step: int, fence: int | None = None
    ) -> None:
        """Write a frontier; it becomes ``latest`` and step ``step`` (last write wins)."""
        self._fences.check(tenant, run_id, fence)
        self._fences.accept(tenant, run_id, fence)
        checkpoint = StoredCheckpoint(payload=bytes(payload), step=step, fence=fence)
        run = self._runs.setdefault((tenant, run_id), _CheckpointRun())
        run.frontier = checkpoint
        run.steps[step] = checkpoint
        if self.keep_last is not None and len(run.steps) > self.keep_last:
            # The frontier is kept apart from the steps, so pruning its step never loses it.
            for old in sorted(run.steps)[: -self.keep_last]:
                del run.steps[old]

    async def latest(self, tenant: str, run_id: str) -> StoredCheckpoint | None:
        """The last accepted put, or ``None``."""
        run = self._runs.get((tenant, run_id))
        return None if run is None else run.frontier

    async def at(self, tenant: str, run_id: str, step: int) -> StoredCheckpoint | None:
        """The snapshot written under ``step``, or ``None`` (never a default)."""
        run = self._runs.get((tenant, run_id))
        return None if run is None else run.steps.get(step)

    async def steps(self, tenant: str, run_id: str) -> list[int]:
        """The steps still kept for the run, ascending."""
        run = self._runs.get((tenant, run_id))
        return [] if run is None else sorted(run.steps)

    async def runs(self, tenant: str) -> list[str]:
        """The run ids with a frontier for the tenant, sorted."""
        return sorted(
            run_id
            for (owner, run_id), run in self._runs.items()
            if owner == tenant and run.frontier is not None
        )

    async def forget(self, tenant: str, run_id: str) -> None:
        """Remove the run's frontier and steps; its fence stays."""
        self._runs.pop((tenant, run_id), None)

    async def seal(self, tenant: str, run_id: str, fence: int) -> None:
        """Raise the highest-seen fence for the run without writing data."""
        self._fences.seal(tenant, run_id, fence)


# --- idempotency -------------------------------------------------------------------------


class MemoryIdempotencyStore:
    """An ``IdempotencyStore`` in a dictionary; ttl claims lapse by the injected ``clock``."""

    def __init__(self, *, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        # Keyed by (tenant, key): two tenants' records of one key never meet.
        self._records: dict[tuple[str, str], IdempotencyRecord] = {}
        self._fences = _Fences()

    def _live(self, tenant: str, key: str, now: float) -> IdempotencyRecord | None:
        record = self._records.get((tenant, key))
        if record is None:
            return None
        if (
            record.status is RecordStatus.in_flight
            and record.expires_at is not None
            and now >= record.expires_at
        ):
            # A lapsed ttl claim is absent everywhere; dropping it keeps that true.
            del self._records[(tenant, key)]
            return None
        return record

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
        """Claim the tenant's ``key`` and return the record as it stands after the call."""
        if tool is None:
            # A resume claim is taken before any lease exists: never fenced.
            fence = None
        else:
            self._fences.check(tenant, run_id, fence)
        if ttl is not None:
            ttl = _positive_ttl(ttl)
        now = self._clock()
        record, changed = after_claim(
            self._live(tenant, key, now),
            key=key,
            holder=holder,
            tenant=tenant,
            run_id=run_id,
            iteration=iteration,
            tool=tool,
            call_id=call_id,
            flags=flags,
            fence=fence,
            now=now,
            expires_at=None if ttl is None else now + ttl,
            takeover=takeover,
        )
        if tool is not None:
            self._fences.accept(tenant, run_id, fence)
        if changed:
            self._records[(tenant, key)] = record
        return record

    async def complete(
        self, key: str, outcome: bytes, *, tenant: str, holder: str
    ) -> IdempotencyRecord:
        """Record the outcome of a claim held by ``holder`` (not fenced)."""
        now = self._clock()
        record, changed = after_complete(
            self._live(tenant, key, now), key=key, outcome=outcome, holder=holder, now=now
        )
        if changed:
            self._records[(tenant, key)] = record
        return record

    async def release(
        self, key: str, *, tenant: str, holder: str, undispatched: bool = False
    ) -> None:
        """Drop a ttl claim held by ``holder``; anything else is left alone."""
        record = self._live(tenant, key, self._clock())
        if (
            record is not None
            and record.status is RecordStatus.in_flight
            and record.holder == holder
            and (record.expires_at is not None or (undispatched and record.tool is not None))
        ):
            del self._records[(tenant, key)]

    async def lookup(self, keys: Sequence[str], *, tenant: str) -> dict[str, IdempotencyRecord]:
        """The tenant's live records of ``keys``; absent keys are left out."""
        now = self._clock()
        found: dict[str, IdempotencyRecord] = {}
        for key in keys:
            record = self._live(tenant, key, now)
            if record is not None:
                found[key] = record
        return found

    async def records(self, tenant: str, run_id: str) -> list[IdempotencyRecord]:
        """Every live record of the run, by (iteration, since, key); the run claim first."""
        now = self._clock()
        mine = [
            record
            for owner, key in list(self._records)
            if owner == tenant
            and (record := self._live(owner, key, now)) is not None
            and record.run_id == run_id
        ]
        return sorted(
            mine, key=lambda r: (-1 if r.iteration is None else r.iteration, r.since, r.key)
        )

    async def resolve(
        self,
        key: str,
        outcome: bytes | None = None,
        *,
        tenant: str,
        never_ran: bool = False,
        by: str,
    ) -> IdempotencyRecord:
        """An operator settles the tenant's in-flight call: its outcome, or that it never
        ran."""
        checked_resolution(outcome, never_ran)
        now = self._clock()
        record = after_resolve(
            self._live(tenant, key, now),
            key=key,
            outcome=outcome,
            never_ran=never_ran,
            by=by,
            now=now,
        )
        self._records[(tenant, key)] = record
        return record

    async def seal(self, tenant: str, run_id: str, fence: int) -> None:
        """Raise the highest-seen fence for the run without writing data."""
        self._fences.seal(tenant, run_id, fence)


# --- leases ------------------------------------------------------------------------------


@dataclass(slots=True, kw_only=True)
class _LeaseSlot:
    lease: RunLease | None = None
    # Counts acquisitions; it never goes back, so a fence is never handed out twice.
    fence: int = 0
    # When the last lease was released; a lapsed one's end is its own ``expires_at``.
    ended_at: float | None = None


class MemoryLeaseStore:
    """A ``LeaseStore`` in a dictionary; expiry decided by the injected ``clock`` only."""

    def __init__(self, *, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._slots: dict[_RunKey, _LeaseSlot] = {}

    async def acquire(self, tenant: str, run_id: str, holder: str, ttl: float) -> RunLease:
        """Take the run (raising its fence) or raise ``LeaseHeldError`` naming the holder."""
        ttl = _positive_ttl(ttl)
        now = self._clock()
        slot = self._slots.setdefault((tenant, run_id), _LeaseSlot())
        if slot.lease is not None and now < slot.lease.expires_at:
            raise LeaseHeldError(
                f"run {run_id!r} is leased to {slot.lease.holder!r}", holder=slot.lease.holder
            )
        previous_end = slot.ended_at if slot.lease is None else slot.lease.expires_at
        slot.fence += 1
        slot.lease = RunLease(
            tenant=tenant,
            run_id=run_id,
            holder=holder,
            fence=slot.fence,
            expires_at=now + ttl,
            previous_end=previous_end,
        )
        return slot.lease

    async def renew(self, lease: RunLease, ttl: float) -> RunLease:
        """Extend a live lease, keeping its fence, or raise ``LeaseLostError``."""
        ttl = _positive_ttl(ttl)
        now = self._clock()
        slot = self._slots.get((lease.tenant, lease.run_id))
        current = None if slot is None else slot.lease
        if (
            slot is None
            or current is None
            or current.fence != lease.fence
            or current.holder != lease.holder
            or now >= current.expires_at
        ):
            raise LeaseLostError(
                f"lease on run {lease.run_id!r} at fence {lease.fence} lapsed or was taken"
            )
        slot.lease = replace(current, expires_at=now + ttl)
        return slot.lease

    async def release(self, lease: RunLease) -> None:
        """Free the run, only for the holder at that fence; the fence stays."""
        slot = self._slots.get((lease.tenant, lease.run_id))
        if (
            slot is not None
            and slot.lease is not None
            and slot.lease.fence == lease.fence
            and slot.lease.holder == lease.holder
        ):
            slot.ended_at = min(slot.lease.expires_at, self._clock())
            slot.lease = None

    async def current(self, tenant: str, run_id: str) -> RunLease | None:
        """The lease live by the store's clock, else ``None``."""
        slot = self._slots.get((tenant, run_id))
        if slot is None or slot.lease is None or self._clock() >= slot.lease.expires_at:
            return None
        return slot.lease

    async def ended_ago(self, tenant: str, run_id: str) -> float | None:
        """Seconds since the run's last lease ended; ``None`` if one is live or none ended."""
        slot = self._slots.get((tenant, run_id))
        now = self._clock()
        if slot is None:
            return None
        end = slot.ended_at if slot.lease is None else slot.lease.expires_at
        return None if end is None or now < end else now - end


# --- transcripts -------------------------------------------------------------------------


@dataclass(slots=True, kw_only=True)
class _Transcript:
    items: list[bytes] = field(default_factory=list)
    # digests[n] names the prefix of length n, so digests[0] is the empty prefix.
    digests: list[str] = field(default_factory=lambda: [EMPTY_HISTORY_DIGEST])

    def resolves(self, count: int, digest: str) -> bool:
        return 0 <= count < len(self.digests) and self.digests[count] == digest


class MemoryHistoryStore:
    """A ``HistoryStore`` in a dictionary: each run's items with their chained digests."""

    def __init__(self) -> None:
        self._runs: dict[_RunKey, _Transcript] = {}
        self._fences = _Fences()

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
        self._fences.check(tenant, run_id, fence)
        if after is not None and (after.tenant, after.run_id) != (tenant, run_id):
            raise ValueError(
                f"handle names run {after.run_id!r} of {after.tenant!r}, "
                f"not run {run_id!r} of {tenant!r}"
            )
        count, digest = (0, EMPTY_HISTORY_DIGEST) if after is None else (after.count, after.digest)
        transcript = self._runs.get((tenant, run_id), _Transcript())
        if not transcript.resolves(count, digest):
            raise HistoryUnavailableError(
                f"the transcript of run {run_id!r} no longer has the prefix of {count} "
                f"messages this append follows"
            )
        self._fences.accept(tenant, run_id, fence)
        # A dead writer may have appended past ``after``; that tail is dropped.
        del transcript.items[count:]
        del transcript.digests[count + 1 :]
        for item in encoded:
            transcript.items.append(bytes(item))
            transcript.digests.append(chain_digest(transcript.digests[-1], item))
        self._runs[(tenant, run_id)] = transcript
        return HistoryHandle(
            tenant=tenant,
            run_id=run_id,
            count=len(transcript.items),
            digest=transcript.digests[-1],
        )

    async def fetch(self, handle: HistoryHandle) -> list[bytes]:
        """The bytes of the prefix; ``HistoryUnavailableError`` if it does not resolve."""
        transcript = self._runs.get((handle.tenant, handle.run_id), _Transcript())
        if not transcript.resolves(handle.count, handle.digest):
            raise HistoryUnavailableError(
                f"the transcript of run {handle.run_id!r} no longer has the prefix of "
                f"{handle.count} messages the handle names"
            )
        return transcript.items[: handle.count]

    async def forget(self, tenant: str, run_id: str) -> None:
        """Remove the run's transcript; its fence stays."""
        self._runs.pop((tenant, run_id), None)

    async def seal(self, tenant: str, run_id: str, fence: int) -> None:
        """Raise the highest-seen fence for the run without writing data."""
        self._fences.seal(tenant, run_id, fence)


# --- spend -------------------------------------------------------------------------------


class MemoryLedger:
    """A ``Ledger`` in a dictionary: micros and tokens per run."""

    def __init__(self) -> None:
        self._spent: dict[_RunKey, int] = {}
        self._usage: dict[_RunKey, Usage] = {}
        self._fences = _Fences()

    async def charge(
        self, tenant: str, run_id: str, micros: int, usage: Usage, *, fence: int | None = None
    ) -> None:
        """Add a model call's cost and usage to the run."""
        self._fences.check(tenant, run_id, fence)
        self._fences.accept(tenant, run_id, fence)
        key = (tenant, run_id)
        self._spent[key] = self._spent.get(key, 0) + micros
        self._usage[key] = self._usage.get(key, Usage()) + usage

    async def spent(self, tenant: str, run_id: str) -> int:
        """Micros charged to the run so far (0 for an unknown run)."""
        return self._spent.get((tenant, run_id), 0)

    async def usage(self, tenant: str, run_id: str) -> Usage:
        """Tokens charged to the run so far."""
        return self._usage.get((tenant, run_id), Usage())

    async def seal(self, tenant: str, run_id: str, fence: int) -> None:
        """Raise the highest-seen fence for the run without writing data."""
        self._fences.seal(tenant, run_id, fence)


# --- approvals ---------------------------------------------------------------------------


class MemoryApprovalStore:
    """An ``ApprovalStore`` in a dictionary; times by the injected ``clock``."""

    def __init__(self, *, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._requests: dict[str, ApprovalRequest] = {}
        self._fences = _Fences()

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
        """Record a pending request (made once under a chosen ``id``)."""
        self._fences.check(tenant, run_id, fence)
        self._fences.accept(tenant, run_id, fence)
        if id is not None:
            existing = self._requests.get(id)
            if existing is not None:
                if existing.tenant != tenant:
                    raise ValueError(f"approval request id {id!r} is taken")
                return existing
        while id is None or id in self._requests:
            id = f"req-{secrets.token_hex(6)}"
        request = ApprovalRequest(
            id=id,
            tenant=tenant,
            run_id=run_id,
            # A copy, as a store that serialises would keep: later edits by the caller to
            # the arguments do not reach the stored request.
            calls=tuple(copy.deepcopy(list(calls))),
            iteration=iteration,
            requested_at=self._clock(),
        )
        self._requests[id] = request
        return request

    async def decide(
        self, tenant: str, id: str, *, approved: bool, by: str, note: str | None = None
    ) -> ApprovalRequest:
        """Decide a request: the same decision again is a no-op, the other way raises
        ``ValueError``; an id unknown for the tenant raises ``KeyError``."""
        request = self._requests.get(id)
        if request is None or request.tenant != tenant:
            raise KeyError(id)
        status = ApprovalStatus.approved if approved else ApprovalStatus.denied
        if request.status is status:
            return request
        if request.status is not ApprovalStatus.pending:
            raise ValueError(f"request {id!r} was already {request.status} by {request.by!r}")
        request = replace(request, status=status, by=by, note=note, decided_at=self._clock())
        self._requests[id] = request
        return request

    async def get(self, tenant: str, id: str) -> ApprovalRequest | None:
        """The request, or ``None`` when no request with that id belongs to the tenant."""
        request = self._requests.get(id)
        return request if request is not None and request.tenant == tenant else None

    async def seal(self, tenant: str, run_id: str, fence: int) -> None:
        """Raise the highest-seen fence for the run without writing data."""
        self._fences.seal(tenant, run_id, fence)
