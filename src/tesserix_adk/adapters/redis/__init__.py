"""Redis stores: every protocol of ``stores.protocols`` on one Redis server (``redis.asyncio``),
or all but the work index on a Redis Cluster (``redis+cluster://`` URLs, ``RedisCluster``).

Where each part lives: ``keys`` draws the key layout (every key of a run shares one hash
tag, so one script decides over all of them); ``lua`` loads the scripts, one file each
under ``scripts/``, that make every decision atomically by the server's clock;
``durability`` says which servers keep fences and claims across a crash; ``connection``
builds the client and translates its errors into the kit's, saying whether an outcome is
unknown, and reads each cluster node's clock; one module per store; ``work`` is the work
index (global sorted sets read from their heads, a single server's layout for now);
``opening`` reads a store URL.
"""

from __future__ import annotations

# The connection first: it is the module that imports the driver, and says what to install
# when it is missing.
from tesserix_adk.adapters.redis.connection import Client  # isort: skip
from tesserix_adk.adapters.redis.approvals import RedisApprovalStore
from tesserix_adk.adapters.redis.checkpoints import RedisCheckpointStore
from tesserix_adk.adapters.redis.durability import check_persistence
from tesserix_adk.adapters.redis.history import RedisHistoryStore
from tesserix_adk.adapters.redis.idempotency import RedisIdempotencyStore
from tesserix_adk.adapters.redis.keys import DEFAULT_PREFIX
from tesserix_adk.adapters.redis.leases import RedisLeaseStore
from tesserix_adk.adapters.redis.ledger import RedisLedger
from tesserix_adk.adapters.redis.opening import open_redis_stores
from tesserix_adk.adapters.redis.work import RedisWorkIndex

__all__ = [
    "DEFAULT_PREFIX",
    "Client",
    "RedisApprovalStore",
    "RedisCheckpointStore",
    "RedisHistoryStore",
    "RedisIdempotencyStore",
    "RedisLeaseStore",
    "RedisLedger",
    "RedisWorkIndex",
    "check_persistence",
    "open_redis_stores",
]
