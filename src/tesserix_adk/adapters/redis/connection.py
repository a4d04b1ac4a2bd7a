"""The Redis client the stores share: building it from a URL, and translating its errors.

A ``redis://`` or ``rediss://`` URL builds a ``redis.asyncio.Redis``; a
``redis+cluster://host:port,host:port/`` (or ``rediss+cluster://``) URL builds a
``redis.asyncio.cluster.RedisCluster`` on those startup nodes, which finds the rest of the
cluster itself and follows ``MOVED``/``ASK`` redirections. Every key of a run shares its
hash tag, so each script runs on the one node that holds the run.

Errors say whether the outcome is unknown: a failure before any command of the call left
the client (connection refused, connect timeout, a full pool) and a server's refusal of a
command as a whole (OOM, READONLY, LOADING, BUSY, ...) are ``StoreUnavailableError``; a
timeout or a dropped connection once a command was sent is ``StoreReplyLostError``. What
was sent is known because every connection of a client the stores use marks, for the kit
call in progress, the moment it writes a command (not its own handshake, nor a cluster
client's discovery of the cluster's layout). A cluster's refusal of keys in different hash
slots (``CROSSSLOT``, or the client's own refusal before sending) is a
``ConfigurationError``: the same call would be refused again.

This is the one module of the package that imports the driver.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, TypeAlias
from urllib.parse import urlsplit, urlunsplit

try:
    import redis.asyncio as aioredis
    from redis.asyncio.cluster import ClusterNode, RedisCluster
    from redis.asyncio.connection import SSLConnection, parse_url
    from redis.commands.core import AsyncScript
    from redis.exceptions import (
        AskError,
        AuthenticationError,
        BusyLoadingError,
        ClusterCrossSlotError,
        ClusterDownError,
        CrossSlotTransactionError,
        NoPermissionError,
        OutOfMemoryError,
        ReadOnlyError,
        RedisClusterException,
        RedisError,
        ResponseError,
        SlotNotCoveredError,
        TryAgainError,
    )
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import TimeoutError as RedisTimeoutError
except ImportError as exc:  # pragma: no cover - exercised in a subprocess test
    raise ImportError(
        'tesserix_adk.adapters.redis needs the redis package: pip install "tesserix-adk[redis]"'
    ) from exc

from tesserix_adk.errors import (
    CheckpointCorruptError,
    ConfigurationError,
    StorePermissionError,
    StoreReplyLostError,
    StoreUnavailableError,
)
from tesserix_adk.stores.urls import redact_url

__all__ = [
    "CLUSTER_SCHEMES",
    "AsyncScript",
    "Client",
    "ClusterNode",
    "RedisCluster",
    "ResponseError",
    "cluster_nodes",
    "is_cluster",
    "read_hashes_with_clocks",
]

Client: TypeAlias = aioredis.Redis | RedisCluster
"""A client the stores take: one server (``Redis``) or a cluster (``RedisCluster``)."""

CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
"""URL schemes that name a Redis Cluster (``rediss+`` with TLS)."""

# Server refusals that mean "not now" rather than "never"; each refuses a command whole.
# redis-py raises a class for most and strips the code from the message, so the classes
# are what is matched (BusyLoadingError is LOADING; ClusterDownError covers MASTERDOWN).
_TRANSIENT_ERRORS = (
    OutOfMemoryError,
    ReadOnlyError,
    BusyLoadingError,
    TryAgainError,
    ClusterDownError,
)
# Codes redis-py leaves in the message, as the server sent it.
# MISCONF: persistence failing (a full disk), NOREPLICAS: too few replicas for
# min-replicas-to-write; the server refused the write whole, and may take it once mended.
_TRANSIENT_REPLIES = (
    "BUSY",
    "OOM",
    "READONLY",
    "LOADING",
    "MASTERDOWN",
    "TRYAGAIN",
    "CLUSTERDOWN",
    "MISCONF",
    "NOREPLICAS",
)
_PERMISSION_REPLIES = ("NOPERM", "NOAUTH", "WRONGPASS")


def _client_from_url(url: str) -> Client:
    """A client on ``url`` (redis-py's own options only); no I/O. ``ConfigurationError`` for
    a URL or an option the driver cannot use."""
    if urlsplit(url).scheme.lower() in CLUSTER_SCHEMES:
        return _cluster_from_url(url)
    try:
        # Defaults only: options in the URL win. Without them a server that stops answering
        # would hold a live run for minutes instead of failing its write as unavailable.
        client = aioredis.from_url(url, socket_connect_timeout=5.0, socket_timeout=10.0)
        # Builds a connection object without connecting: an option the driver does not
        # know fails here, as a usage mistake, instead of as a TypeError on first use.
        client.connection_pool.make_connection()  # type: ignore[no-untyped-call]
    except (ValueError, TypeError, RedisError) as exc:
        raise ConfigurationError(f"cannot read the Redis store URL: {exc}") from exc
    return client


def _startup_nodes(url: str, hosts: str) -> list[tuple[str, int]]:
    """``host:port,host:port`` (``[v6]:port`` too; port 6379 when absent) as pairs."""
    nodes = []
    for raw in hosts.split(","):
        host, port = raw.strip(), "6379"
        if host.startswith("["):
            host, _, rest = host[1:].partition("]")
            if rest.startswith(":"):
                port = rest[1:]
        elif ":" in host:
            host, _, port = host.rpartition(":")
        if not host or not port.isdigit():
            raise ConfigurationError(
                f"cannot read the Redis Cluster store URL {redact_url(url)!r}: "
                f"{raw.strip()!r} is not host:port"
            )
        nodes.append((host, int(port)))
    return nodes


def _cluster_from_url(url: str) -> RedisCluster:
    """A ``RedisCluster`` on the startup nodes a ``redis+cluster://`` URL names; no I/O."""
    parts = urlsplit(url)
    userinfo, at, hosts = parts.netloc.rpartition("@")
    nodes = _startup_nodes(url, hosts)
    # redis-py reads one host's URL: its first node stands in for the host, and its
    # credentials, database (0 only) and options are the cluster's.
    scheme = parts.scheme.lower().removesuffix("+cluster")
    host, port = nodes[0]
    shown = f"[{host}]" if ":" in host else host
    single = urlunsplit((scheme, f"{userinfo}{at}{shown}:{port}", parts.path, parts.query, ""))
    try:
        options: dict[str, Any] = {"socket_connect_timeout": 5.0, "socket_timeout": 10.0}
        options.update(parse_url(single))
        del options["host"], options["port"]
        if options.pop("connection_class", None) is SSLConnection:
            options["ssl"] = True
        for name in ("read_from_replicas", "load_balancing_strategy"):
            if name in options:
                # A replica lags its primary: a frontier or a record read there may be
                # stale, and the kit reads in order to decide.
                raise ConfigurationError(
                    f"{name} is refused in a Redis Cluster store URL: the stores read from "
                    "primaries only, since a replica's copy may lag the decisions made"
                )
        client = RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in nodes], **options)
    except (ValueError, TypeError, RedisError, RedisClusterException) as exc:
        raise ConfigurationError(f"cannot read the Redis Cluster store URL: {exc}") from exc
    return client


def _require_bytes(client: Client) -> None:
    """Refuse a client that decodes replies, and make it mark what it sends."""
    # Payloads are bytes; a client that decodes replies would hand back str or fail on them.
    if client.get_encoder().decode_responses:
        raise ConfigurationError(
            "the Redis client decodes responses (decode_responses=True); the stores keep "
            "bytes and need a client built with decode_responses=False"
        )
    _track_sends(client)


# --- what was sent -----------------------------------------------------------------------


class _Sends:
    """Whether any command of the kit call in progress left the client."""

    __slots__ = ("sent",)

    def __init__(self) -> None:
        self.sent = False


_sends: ContextVar[_Sends | None] = ContextVar("tesserix_adk_redis_sends", default=None)


class _MarksSends:
    """Mixed into the client's connection class: a command written for a kit call marks
    that call's ``_Sends``; the connection's own handshake does not."""

    _adk_connecting = 0

    async def connect(self, *args: Any, **kwargs: Any) -> Any:
        self._adk_connecting += 1
        try:
            return await super().connect(*args, **kwargs)  # type: ignore[misc]
        finally:
            self._adk_connecting -= 1

    async def connect_check_health(self, *args: Any, **kwargs: Any) -> Any:
        self._adk_connecting += 1
        try:
            return await super().connect_check_health(*args, **kwargs)  # type: ignore[misc]
        finally:
            self._adk_connecting -= 1

    async def send_packed_command(self, *args: Any, **kwargs: Any) -> Any:
        sends = _sends.get()
        if sends is not None and not self._adk_connecting and not _discovering.get():
            if not self.is_connected:  # type: ignore[attr-defined]
                await self.connect()  # a refused connection is not a sent command
            sends.sent = True
        return await super().send_packed_command(*args, **kwargs)  # type: ignore[misc]


_MARKING: dict[type[Any], type[Any]] = {}


def _marking(cls: type[Any]) -> type[Any]:
    if issubclass(cls, _MarksSends):
        return cls
    if cls not in _MARKING:
        _MARKING[cls] = type(f"Marking{cls.__name__}", (_MarksSends, cls), {})
    return _MARKING[cls]


def _track_sends(client: Client) -> None:
    """Make every connection of ``client`` mark what it sends (idempotent)."""
    if isinstance(client, RedisCluster):
        _track_cluster_sends(client)
        return
    pool = client.connection_pool
    pool.connection_class = _marking(pool.connection_class)
    existing: list[Any] = [getattr(client, "connection", None)]
    for name in ("_available_connections", "_in_use_connections", "_connections"):
        existing.extend(getattr(pool, name, None) or ())
    _mark_existing(existing)


def _mark_existing(connections: Sequence[Any]) -> None:
    for conn in connections:
        if conn is not None and not isinstance(conn, _MarksSends):
            # Only a method override is added, so the object's layout is unchanged.
            conn.__class__ = _marking(type(conn))


_discovering: ContextVar[bool] = ContextVar("tesserix_adk_redis_discovering", default=False)


class _Discovers:
    """Mixed into a cluster client's nodes manager and commands parser: their
    ``initialize`` (``CLUSTER SLOTS`` on first use and after a ``MOVED``, ``COMMAND`` once)
    sends commands of its own, which are no command of a kit call."""

    __slots__ = ()

    async def initialize(self, *args: Any, **kwargs: Any) -> Any:
        token = _discovering.set(True)
        try:
            return await super().initialize(*args, **kwargs)  # type: ignore[misc]
        finally:
            _discovering.reset(token)


_DISCOVERING: dict[type[Any], type[Any]] = {}


def _quiet(obj: Any) -> None:
    """Make ``obj``'s ``initialize`` mark nothing as sent (idempotent)."""
    cls = type(obj)
    if issubclass(cls, _Discovers):
        return
    if cls not in _DISCOVERING:
        # Only a method override is added (no slots), so the object's layout is unchanged.
        _DISCOVERING[cls] = type(f"Discovering{cls.__name__}", (_Discovers, cls), {"__slots__": ()})
    obj.__class__ = _DISCOVERING[cls]


def _track_cluster_sends(client: RedisCluster) -> None:
    # Nodes found later are built from the client's connection options, which the
    # nodes manager shares; the ones known now are marked in place.
    kwargs = client.connection_kwargs
    kwargs["connection_class"] = _marking(kwargs["connection_class"])
    manager = client.nodes_manager
    _quiet(manager)
    _quiet(client.commands_parser)
    nodes = [*manager.startup_nodes.values(), *manager.nodes_cache.values()]
    for node in nodes:
        node.connection_class = _marking(node.connection_class)
        _mark_existing([*node._connections, *node._free])


def _node_of(client: RedisCluster, key: str) -> ClusterNode:
    node = client.get_node_from_key(key)
    if node is None:
        raise SlotNotCoveredError(f"no node of the cluster serves the slot of {key!r}")
    return node


def is_cluster(client: Client) -> bool:
    """Whether ``client`` is a Redis Cluster client."""
    return isinstance(client, RedisCluster)


async def cluster_nodes(client: RedisCluster) -> list[ClusterNode]:
    """Every node of the cluster, primaries first (discovering the layout if needed)."""
    await client.initialize()
    return [*client.get_primaries(), *client.get_replicas()]


async def read_hashes_with_clocks(
    client: Client, keys: Sequence[str], fields: Sequence[str] | None = None
) -> list[tuple[dict[bytes, bytes], int]]:
    """Each hash at ``keys`` (only ``fields`` of it, when given) with its server's ``TIME``
    (microseconds) read after it.

    On one server, one pipeline carrying ``TIME``; a cluster pipeline cannot carry ``TIME``
    (it names no key, so no node), so there each key's own node is asked for its clock after
    the hashes are read: a deadline one node wrote is compared with that node's clock.
    """
    async with client.pipeline(transaction=False) as pipe:
        for key in keys:
            if fields is None:
                pipe.hgetall(key)
            else:
                pipe.hmget(key, list(fields))
        if not isinstance(client, RedisCluster):
            pipe.time()
        replies = await pipe.execute()
    if fields is not None:
        named = [name.encode() for name in fields]
        hashes = replies[: len(keys)]
        replies[: len(keys)] = [
            {n: v for n, v in zip(named, values, strict=True) if v is not None} for values in hashes
        ]
    if not isinstance(client, RedisCluster):
        *hashes, (seconds, micros) = replies
        now = int(seconds) * 1_000_000 + int(micros)
        return [(fields, now) for fields in hashes]
    owners = [_node_of(client, key) for key in keys]
    distinct = {node.name: node for node in owners}
    times = await asyncio.gather(*(client.time(target_nodes=n) for n in distinct.values()))
    clocks = {
        name: int(seconds) * 1_000_000 + int(micros)
        for name, (seconds, micros) in zip(distinct, times, strict=True)
    }
    return [(fields, clocks[node.name]) for fields, node in zip(replies, owners, strict=True)]


# --- error translation -------------------------------------------------------------------


@contextmanager
def _driver_errors(action: str) -> Iterator[None]:
    """Translate redis-py errors into the kit's, once, at the boundary, saying whether the
    outcome is unknown (a command was sent) or certainly nothing happened."""
    sends = _Sends()
    token = _sends.set(sends)
    try:
        yield
    except AuthenticationError as exc:
        raise ConfigurationError(f"Redis refused the credentials while {action}: {exc}") from exc
    except (ClusterCrossSlotError, CrossSlotTransactionError) as exc:
        raise _cross_slot(action, exc) from exc
    except AskError as exc:
        # A cluster client follows MOVED and ASK itself; a single-server client hears them
        # from a node of a cluster it was pointed at, for every key another node serves.
        raise ConfigurationError(
            f"Redis redirected {action} to another node ({type(exc).__name__} {exc}): the "
            "server is a node of a Redis Cluster, which a redis:// URL cannot follow; name "
            "the cluster with redis+cluster://host:port,host:port/ instead"
        ) from exc
    except _TRANSIENT_ERRORS as exc:
        raise StoreUnavailableError(
            f"Redis refused {action} for now ({type(exc).__name__}): {exc}", retryable=True
        ) from exc
    except NoPermissionError as exc:
        raise StorePermissionError(f"Redis refused {action}: {exc}") from exc
    except (RedisConnectionError, RedisTimeoutError) as exc:
        if sends.sent:
            raise StoreReplyLostError(
                f"Redis did not answer while {action} after the command was sent; it may "
                f"have been applied: {exc}"
            ) from exc
        raise StoreUnavailableError(f"Redis could not be reached while {action}: {exc}") from exc
    except ResponseError as exc:
        reply = str(exc)
        if "CROSSSLOT" in reply or "not hash to the same slot" in reply:
            raise _cross_slot(action, exc) from exc
        if reply.startswith(_PERMISSION_REPLIES):
            raise StorePermissionError(f"Redis refused {action}: {reply}") from exc
        if "non local key" in reply:
            # A script reached a key its node no longer serves (the slot is migrating):
            # Redis does not undo what the script wrote before, so it may be part done.
            raise StoreReplyLostError(
                f"Redis stopped {action} part way, as its slot is moving to another node; "
                f"it may have been partly applied: {reply}"
            ) from exc
        if "WRONGTYPE" in reply:
            # A key of the kit's holds another kind of value: damage, not "retry later".
            raise CheckpointCorruptError(
                f"Redis holds a damaged key while {action}: {reply}"
            ) from exc
        raise StoreUnavailableError(
            f"Redis refused {action}: {reply}",
            retryable=reply.startswith(_TRANSIENT_REPLIES),
        ) from exc
    except RedisError as exc:
        if sends.sent:
            raise StoreReplyLostError(
                f"Redis failed while {action} after the command was sent: {exc}"
            ) from exc
        raise StoreUnavailableError(f"Redis failed while {action}: {exc}") from exc
    except SlotNotCoveredError as exc:
        # The cluster is being resharded or lost a primary: nothing was sent for the slot.
        raise StoreUnavailableError(
            f"Redis Cluster serves no node for a key while {action}: {exc}", retryable=True
        ) from exc
    except RedisClusterException as exc:
        # Not a RedisError: the cluster client's own refusals and failures.
        if "same key slot" in str(exc) or "same slot" in str(exc):
            raise _cross_slot(action, exc) from exc
        if sends.sent:
            raise StoreReplyLostError(
                f"Redis Cluster failed while {action} after the command was sent: {exc}"
            ) from exc
        raise StoreUnavailableError(f"Redis Cluster failed while {action}: {exc}") from exc
    finally:
        _sends.reset(token)


def _cross_slot(action: str, exc: Exception) -> ConfigurationError:
    return ConfigurationError(
        f"Redis Cluster refused {action}: its keys hash to different slots (CROSSSLOT), so "
        f"no one node can decide over them, and the command was refused whole. Every key of "
        f"a run shares "
        f"the run's hash tag; a custom idempotency key reused by another run of the tenant "
        f"brings two runs' keys into one call, which a cluster cannot serve ({exc})",
        retryable=False,
    )
