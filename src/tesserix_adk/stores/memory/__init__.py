"""In-process stores: every protocol of ``stores.protocols``, kept in dictionaries.

For tests, demos and single-process runs. Nothing survives the process. Each public method
reads, decides and writes without awaiting in between, so concurrent tasks on one event
loop see every decision as atomic; the stores are not thread-safe.

One module per store; ``fencing.py`` holds the highest-seen fences each of them keeps.
"""

from __future__ import annotations

from tesserix_adk.stores.memory.approvals import MemoryApprovalStore
from tesserix_adk.stores.memory.checkpoints import MemoryCheckpointStore
from tesserix_adk.stores.memory.history import MemoryHistoryStore
from tesserix_adk.stores.memory.idempotency import MemoryIdempotencyStore
from tesserix_adk.stores.memory.leases import MemoryLeaseStore
from tesserix_adk.stores.memory.ledger import MemoryLedger
from tesserix_adk.stores.memory.work import MemoryWorkIndex

__all__ = [
    "MemoryApprovalStore",
    "MemoryCheckpointStore",
    "MemoryHistoryStore",
    "MemoryIdempotencyStore",
    "MemoryLeaseStore",
    "MemoryLedger",
    "MemoryWorkIndex",
]
