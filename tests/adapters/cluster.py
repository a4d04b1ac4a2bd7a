"""A throwaway Redis Cluster: three masters (no replicas) on free loopback ports, each a
``redis-server --cluster-enabled yes`` in a temporary directory, joined by
``redis-cli --cluster create``; stopped (SIGKILL) and its directory removed after.

Missing ``redis-server`` or ``redis-cli`` skips the test with the reason (fails it under
``CI=true``, like an unreachable shared server). The shared Redis is never touched.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from adapters.services import redis_prefix, unavailable, with_query
from adapters.throwaway import free_port
from tesserix_adk.stores.bundle import Stores

if TYPE_CHECKING:
    from redis.asyncio.cluster import RedisCluster

__all__ = ["ThrowawayCluster", "cluster_stores", "delete_prefixed", "redis_cluster"]


@dataclass(frozen=True, slots=True, kw_only=True)
class ThrowawayCluster:
    """A running three-master cluster: its ports and a ``redis+cluster://`` URL naming
    every master."""

    ports: tuple[int, ...]
    directory: Path

    @property
    def url(self) -> str:
        """The kit's cluster URL over every master, with no options."""
        hosts = ",".join(f"127.0.0.1:{port}" for port in self.ports)
        return f"redis+cluster://{hosts}/"

    def command(self, port: int, *args: str) -> str:
        """One ``redis-cli`` command on the node at ``port``; its output."""
        cli = shutil.which("redis-cli")
        assert cli is not None
        done = subprocess.run(
            [cli, "-h", "127.0.0.1", "-p", str(port), *args],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
        return done.stdout


def _cluster_state(port: int) -> str:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
            sock.sendall(b"CLUSTER INFO\r\n")
            return sock.recv(4096).decode(errors="replace")
    except OSError:
        return ""


def _wait(ready: str, ports: Sequence[int], processes: Sequence[subprocess.Popen[bytes]]) -> None:
    deadline = time.monotonic() + 30
    while not all(ready in _cluster_state(port) for port in ports):
        for process in processes:
            if process.poll() is not None:
                pytest.fail(f"a cluster redis-server exited with {process.returncode}")
        if time.monotonic() > deadline:
            pytest.fail(f"the throwaway Redis Cluster did not reach {ready!r} within 30 s")
        time.sleep(0.05)


@contextmanager
def redis_cluster(*per_node: Sequence[str]) -> Iterator[ThrowawayCluster]:
    """A three-master cluster; ``per_node`` gives each node's extra ``"--name", "value"``
    pairs (default: AOF on, ``appendfsync everysec``, no save points)."""
    server, cli = shutil.which("redis-server"), shutil.which("redis-cli")
    if server is None or cli is None:
        unavailable("redis-server and redis-cli are needed for a throwaway Redis Cluster")
    configs = list(per_node) or [("--appendonly", "yes", "--appendfsync", "everysec")] * 3
    assert len(configs) == 3
    processes: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory(prefix="adk-cluster-") as tmp:
        directory = Path(tmp)
        ports = tuple(free_port() for _ in configs)
        try:
            for port, config in zip(ports, configs, strict=True):
                node = directory / str(port)
                node.mkdir()
                args = [server, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(node)]
                # The bus port is chosen too: port + 10000 may be taken or past 65535.
                args += ["--cluster-enabled", "yes", "--cluster-port", str(free_port())]
                args += ["--cluster-config-file", "nodes.conf"]
                args += ["--cluster-node-timeout", "5000", "--protected-mode", "no"]
                args += ["--save", "", "--appendonly", "no", *config]
                processes.append(
                    subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                )
            _wait("cluster_state", ports, processes)
            nodes = [f"127.0.0.1:{port}" for port in ports]
            subprocess.run(
                [cli, "--cluster", "create", *nodes, "--cluster-replicas", "0", "--cluster-yes"],
                capture_output=True,
                timeout=60,
                check=True,
            )
            _wait("cluster_state:ok", ports, processes)
            yield ThrowawayCluster(ports=ports, directory=directory)
        finally:
            for process in processes:
                if process.poll() is None:
                    process.kill()
                process.wait(timeout=10)


def raw_client(cluster: ThrowawayCluster) -> RedisCluster:
    """A plain ``RedisCluster`` on the cluster, for looking behind the stores."""
    from redis.asyncio.cluster import ClusterNode, RedisCluster

    return RedisCluster(startup_nodes=[ClusterNode("127.0.0.1", p) for p in cluster.ports])


async def delete_prefixed(
    cluster: ThrowawayCluster, prefix: str, client: RedisCluster | None = None
) -> list[bytes]:
    """Delete every key under ``prefix`` on every master (through ``client``, or a client
    of its own); the keys deleted."""
    assert not any(c in prefix for c in "*?[]\\")
    own = client is None
    client = raw_client(cluster) if client is None else client
    try:
        found = [key async for key in client.scan_iter(match=f"{prefix}*", count=1000)]
        if found:
            await client.delete(*found)  # split by slot, and sent to each slot's node
        return found
    finally:
        if own:
            await client.aclose()


@asynccontextmanager
async def cluster_stores(
    cluster: ThrowawayCluster, *, keep_last: int | None = None
) -> AsyncIterator[Stores]:
    """``open_stores`` on the cluster under a fresh prefix (its nodes keep AOF, so no
    ``allow_volatile``); its keys are deleted after."""
    from tesserix_adk.stores.urls import open_stores

    prefix = redis_prefix()
    options = {"prefix": prefix}
    if keep_last is not None:
        options["keep_last"] = str(keep_last)
    stores = open_stores(with_query(cluster.url, **options))
    try:
        yield stores
    finally:
        try:
            # The stores' own client knows the cluster already: no second discovery.
            await delete_prefixed(cluster, prefix, stores.checkpoints._client)  # type: ignore[attr-defined]
        finally:
            await stores.aclose()
