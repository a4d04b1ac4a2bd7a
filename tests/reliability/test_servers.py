"""Server faults under running workers: restarts of servers the suite starts (Redis with
AOF: ``SHUTDOWN NOSAVE`` and SIGKILL; PostgreSQL: ``pg_ctl -m fast`` and ``-m immediate``),
and a proxy that drops a reply after the server applied the command (issue 20, defect 8).
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from adapters import services
from processes import held_open, store_url
from reliability.conftest import make_site
from reliability.figures import TALLY
from reliability.harness import Site
from reliability.profile import PROFILE
from reliability.servers import PostgresCluster, ProxyThread, RedisAof


def _restarted(site: Site, restart: Callable[[random.Random], None], rng: random.Random) -> int:
    """Runs carried while the server restarts at a random moment of each; how many
    restarts landed while a run was still going."""
    landed = 0
    for n in range(PROFILE.restart_runs):
        run = f"restart-{n}"
        carrier = threading.Thread(target=site.carry, args=(run, random.Random(run)))
        carrier.start()
        time.sleep(rng.uniform(0.05, 0.6))
        alive = carrier.is_alive()
        restart(rng)
        carrier.join(300)
        assert not carrier.is_alive(), f"{run} still going after 300 s"
        landed += alive
    return landed


def _tally(site: Site, scenario: str, trials: int) -> None:
    verdict = site.verdict()
    TALLY.add(site.backend, scenario, trials, verdict, workers=site.stats.workers)
    assert verdict.ok, verdict.explain()


@pytest.mark.redis
def test_redis_with_aof_restarted_under_running_workers(tmp_path: Path, rng: random.Random) -> None:
    server = RedisAof(tmp_path)
    server.start()
    try:
        url = services.with_query(server.url, prefix="torture:")
        site = make_site(url, tmp_path, "redis", delay=0.1)
        landed = _restarted(site, server.restart, rng)
        assert landed >= 1, "no restart landed during a run"
        _tally(site, "server restarts", PROFILE.restart_runs)
    finally:
        server.stop()


@pytest.mark.postgres
def test_postgres_cluster_restarted_under_running_workers(
    tmp_path: Path, rng: random.Random
) -> None:
    cluster = PostgresCluster()
    cluster.start()
    try:
        # Bounded calls well below the worker's deadline (issue 20, defect 3).
        url = services.with_query(cluster.url, timeout="2")
        site = make_site(url, tmp_path, "postgres", delay=0.1)
        landed = _restarted(site, cluster.restart, rng)
        assert landed >= 1, "no restart landed during a run"
        _tally(site, "server restarts", PROFILE.restart_runs)
    finally:
        cluster.stop()


@pytest.fixture(
    params=[
        pytest.param("redis", marks=pytest.mark.redis),
        pytest.param("postgres", marks=pytest.mark.postgres),
    ]
)
def proxied(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[Site, ProxyThread]]:
    """A site whose workers reach the shared server through a reply-dropping proxy."""
    with held_open(store_url(request.param, tmp_path)) as url:
        direct = "127.0.0.1:6379" if request.param == "redis" else "127.0.0.1:5432"
        assert direct in url, url
        host, port = direct.split(":")
        proxy = ProxyThread(host, int(port))
        try:
            make_site(url, tmp_path, request.param)  # the schema, applied directly
            through = url.replace(direct, f"127.0.0.1:{proxy.port}")
            if request.param == "postgres":
                through = services.with_query(through, timeout="2")
            site = Site(through, tmp_path, backend=request.param, delay=0.02)
            yield site, proxy
        finally:
            proxy.close()


def test_replies_dropped_after_the_server_applied_the_command(
    proxied: tuple[Site, ProxyThread], rng: random.Random
) -> None:
    site, proxy = proxied
    # One reply lost per run, at a random request of it (a run makes about 30); a silent
    # connection ("hang") costs the client's whole timeout, so the CI profile only cuts.
    endings = ("close", "hang") if PROFILE.name == "full" else ("close",)
    for n in range(PROFILE.proxy_runs):
        proxy.drop(skip=rng.randrange(0, 30), then=rng.choice(endings))
        site.carry(f"proxy-{n}", random.Random(n))
    assert proxy.proxy.dropped >= 1, "no reply was dropped"
    _tally(site, "dropped replies", PROFILE.proxy_runs)
