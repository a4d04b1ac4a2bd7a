"""Whether a Redis server keeps what the kit's safety rests on: its persistence check.

A Redis that loses its data on restart loses fences and in-flight claims, which could let a
call run twice. Persistent means AOF on with ``appendfsync always`` (every write on disk
before its reply) or ``everysec`` (an OS crash or power loss can lose up to about one second
of acknowledged writes; a killed Redis process loses nothing). RDB save points alone are
volatile for this purpose: a crash rolls the server back to its last snapshot, fences and
claims with it. ``RedisLeaseStore`` and ``RedisIdempotencyStore`` refuse any other server,
or one with an ``allkeys-*`` eviction policy, unless they are built with
``allow_volatile=True`` (URL ``?allow_volatile=true``). On a Redis Cluster the check runs
on every node.
"""

from __future__ import annotations

import logging
from typing import Any

from tesserix_adk.adapters.redis.connection import (
    Client,
    ClusterNode,
    RedisCluster,
    ResponseError,
    _driver_errors,
    cluster_nodes,
)
from tesserix_adk.errors import ConfigurationError

__all__ = ["check_persistence"]

# The package's name, as before it was a package: operators filter on it.
_log = logging.getLogger("tesserix_adk.adapters.redis")


async def check_persistence(client: Client) -> None:
    """Raise ``ConfigurationError`` unless the server keeps fences and claims across a
    crash and never evicts them: AOF on with ``appendfsync always`` or ``everysec`` (the
    latter may lose up to about one second of acknowledged writes to an OS crash or power
    loss, and says so in a warning), and no ``allkeys-*`` maxmemory-policy. RDB save points
    alone do not count: a crash rolls the server back to its last snapshot.

    On a Redis Cluster every node is checked, primaries and replicas (a replica becomes a
    primary on failover), and one volatile node is enough to refuse."""
    if isinstance(client, RedisCluster):
        with _driver_errors("finding the nodes of the cluster to check their persistence"):
            nodes = await cluster_nodes(client)
        # Each problem once, with the nodes that have it.
        where: dict[str, list[str]] = {}
        fsyncs: set[str | None] = set()
        for node in nodes:
            found, fsync = await _node_problems(client, node)
            for problem in found:
                where.setdefault(problem, []).append(f"{node.name} ({node.server_type})")
            fsyncs.add(fsync)
        problems = [f"{p} — on node(s) {', '.join(names)}" for p, names in where.items()]
        everysec = "everysec" in fsyncs
    else:
        problems, fsync = await _node_problems(client, None)
        everysec = fsync == "everysec"
    if problems:
        server = (
            "this Redis Cluster is" if isinstance(client, RedisCluster) else "this Redis server is"
        )
        raise ConfigurationError(
            f"{server} not durable enough for leases and idempotency claims: "
            + "; ".join(problems)
            + ". Fix the server settings, or accept the risk with allow_volatile=true in the "
            "store URL (allow_volatile=True in code)."
        )
    if everysec:
        _log.warning(
            "Redis runs appendfsync everysec: an OS crash or power loss can lose up to about "
            "one second of acknowledged writes (a claim among them); appendfsync always "
            "closes that window"
        )


async def _node_problems(client: Client, node: ClusterNode | None) -> tuple[list[str], str | None]:
    """What keeps one server (``node`` of a cluster, or the one server) from being durable,
    and its ``appendfsync`` (``None`` when it cannot be read)."""
    target: dict[str, Any] = {} if node is None else {"target_nodes": node}
    where = "checking its persistence settings"
    if node is not None:
        where = f"checking the persistence settings of node {node.name}"
    with _driver_errors(where):
        persistence = await client.info("persistence", **target)
        memory = await client.info("memory", **target)
        try:
            config = await client.config_get("appendfsync", **target)
            fsync: str | None = str(config.get("appendfsync", "")).lower()
        except ResponseError:
            # CONFIG is often renamed away on managed servers; then fsync cannot be known.
            fsync = None
    problems: list[str] = []
    policy = str(memory.get("maxmemory_policy", "noeviction"))
    if policy.startswith("allkeys-"):
        problems.append(
            f"its maxmemory-policy is {policy}, which may evict fences and in-flight claims "
            f"(use noeviction or a volatile-* policy)"
        )
    aof = str(persistence.get("aof_enabled", "0")) == "1"
    if not aof:
        problems.append(
            "it has no AOF (appendonly yes, with appendfsync always or everysec); RDB save "
            "points alone are not enough, since a crash rolls the server back to its last "
            "snapshot and loses fences and claims"
        )
    elif fsync is None:
        problems.append(
            "its appendfsync setting cannot be read (CONFIG GET is not allowed), so it "
            "cannot be told to be always or everysec"
        )
    elif fsync not in ("always", "everysec"):
        problems.append(
            f"its appendfsync is {fsync}, which leaves syncing to the OS and can lose many "
            f"seconds of acknowledged writes (use always, or everysec)"
        )
    return problems, fsync


class _Durability:
    """Runs ``check_persistence`` once, on first use, unless volatility was allowed."""

    __slots__ = ("_allowed", "_checked", "_client")

    def __init__(self, client: Client, *, allow_volatile: bool) -> None:
        self._client = client
        self._allowed = allow_volatile
        self._checked = False

    async def ensure(self) -> None:
        if self._allowed or self._checked:
            return
        await check_persistence(self._client)
        self._checked = True

    async def check(self) -> None:
        if not self._allowed:
            await check_persistence(self._client)
            self._checked = True
