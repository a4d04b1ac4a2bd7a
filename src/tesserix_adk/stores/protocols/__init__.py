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

from tesserix_adk.stores.protocols.approvals import ApprovalRequest, ApprovalStatus, ApprovalStore
from tesserix_adk.stores.protocols.checkpoints import (
    CheckpointStore,
    FencedStore,
    FrontierWithHistory,
    RunListing,
    StepHistory,
    StoredCheckpoint,
)
from tesserix_adk.stores.protocols.grouping import CommitsWithNext, GroupedWrites, WriteGroup
from tesserix_adk.stores.protocols.idempotency import (
    IdempotencyRecord,
    IdempotencyStore,
    RecordsFrom,
    RecordStatus,
    ToolFlags,
)
from tesserix_adk.stores.protocols.leases import LeaseStore, RunLease
from tesserix_adk.stores.protocols.spend import Ledger, LedgerTotals
from tesserix_adk.stores.protocols.transcripts import (
    EMPTY_HISTORY_DIGEST,
    HistoryHandle,
    HistoryStore,
    chain_digest,
    chained,
)
from tesserix_adk.stores.protocols.work import (
    DamagedEntry,
    WakesParked,
    WorkIndex,
    WorkItem,
    WorkListing,
    WorksAroundDamage,
    WorkState,
)

__all__ = [
    "EMPTY_HISTORY_DIGEST",
    "ApprovalRequest",
    "ApprovalStatus",
    "ApprovalStore",
    "CheckpointStore",
    "CommitsWithNext",
    "FencedStore",
    "FrontierWithHistory",
    "GroupedWrites",
    "HistoryHandle",
    "HistoryStore",
    "IdempotencyRecord",
    "IdempotencyStore",
    "LeaseStore",
    "Ledger",
    "LedgerTotals",
    "RecordStatus",
    "RecordsFrom",
    "RunLease",
    "RunListing",
    "StepHistory",
    "StoredCheckpoint",
    "ToolFlags",
    "WakesParked",
    "WorkIndex",
    "WorkItem",
    "WorkListing",
    "WorksAroundDamage",
    "DamagedEntry",
    "WorkState",
    "WriteGroup",
    "chain_digest",
    "chained",
]
