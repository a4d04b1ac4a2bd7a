"""``open_redis_stores(url)``: the six Redis stores and the work index on one client,
named by a URL."""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit

from tesserix_adk.adapters.redis.approvals import RedisApprovalStore
from tesserix_adk.adapters.redis.checkpoints import RedisCheckpointStore
from tesserix_adk.adapters.redis.connection import _client_from_url, is_cluster
from tesserix_adk.adapters.redis.history import RedisHistoryStore
from tesserix_adk.adapters.redis.idempotency import RedisIdempotencyStore
from tesserix_adk.adapters.redis.keys import DEFAULT_PREFIX
from tesserix_adk.adapters.redis.leases import RedisLeaseStore
from tesserix_adk.adapters.redis.ledger import RedisLedger
from tesserix_adk.adapters.redis.work import RedisWorkIndex
from tesserix_adk.errors import ConfigurationError
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.stores.urls import keep_last_option, store_options

__all__ = ["open_redis_stores"]


def _flag(name: str, raw: str) -> bool:
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ConfigurationError(f"{name} in the Redis store URL must be true or false, got {raw!r}")


def _split_url(url: str) -> tuple[str, dict[str, str]]:
    """The URL for redis-py and the kit's own options, taken out of its query."""
    parts = urlsplit(url)
    options, rest = store_options(url, parts.query, "Redis", driver=True)
    db = parts.path.strip("/")
    # A database number the server could never hold is a mistake in the URL, not an outage
    # (one the server lacks, it refuses itself: also a usage error).
    if db and "," not in parts.netloc and not (db.isdigit() and int(db) < 2**31):
        raise ConfigurationError(
            f"the database in the Redis store URL must be a number from 0, got {db!r}"
        )
    driver_url = urlunsplit((parts.scheme, parts.netloc, parts.path, rest, parts.fragment))
    return driver_url, options


def open_redis_stores(url: str) -> Stores:
    """The six Redis stores and the work index on one client, as a ``Stores`` bundle; no
    I/O until first use.

    Options in the query: ``prefix`` (default ``adk:``), ``allow_volatile=true`` (accept a
    server without persistence or with an ``allkeys-*`` eviction policy) and ``keep_last``;
    the rest of the URL goes to ``redis.asyncio.from_url``. ``create_schema()`` and
    ``verify()`` check the server's persistence; ``aclose()`` closes the client.

    ``redis+cluster://host:port,host:port/`` (``rediss+cluster://`` with TLS) opens the
    stores on a Redis Cluster through those startup nodes, with the same options; the
    persistence check then runs on every node. A cluster has no work index yet
    (``Stores.work`` is ``None``): runs are started and resumed by the runner or
    ``tesserix run``, but ``tesserix worker`` and submissions need a single server, since
    the work index keeps global sorted sets that its scripts read beside each run's keys.
    """
    driver_url, options = _split_url(url)
    prefix = options.get("prefix", DEFAULT_PREFIX)
    allow_volatile = _flag("allow_volatile", options.get("allow_volatile", "false"))
    keep_last = keep_last_option(url, options)
    client = _client_from_url(driver_url)
    # Nothing connects before first use, so a refusal below leaves nothing to close.
    leases = RedisLeaseStore(client, prefix=prefix, allow_volatile=allow_volatile)
    idempotency = RedisIdempotencyStore(client, prefix=prefix, allow_volatile=allow_volatile)
    checkpoints = RedisCheckpointStore(client, prefix=prefix, keep_last=keep_last)

    async def check() -> None:
        await leases.check_persistence()
        await idempotency.check_persistence()

    return Stores(
        checkpoints=checkpoints,
        idempotency=idempotency,
        leases=leases,
        history=RedisHistoryStore(client, prefix=prefix),
        ledger=RedisLedger(client, prefix=prefix),
        approvals=RedisApprovalStore(client, prefix=prefix),
        work=(
            None
            if is_cluster(client)
            else RedisWorkIndex(client, prefix=prefix, allow_volatile=allow_volatile)
        ),
        url=url,
        on_create_schema=check,
        on_verify=check,
        on_close=(client.aclose,),
    )
