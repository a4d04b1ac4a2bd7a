"""A slow and a half-open network between a worker and its server (Redis, PostgreSQL).

Each trial's first worker reaches the server through a proxy of its own, which holds some
replies back (longer than the lease's renewal interval, on some longer than its ttl) or goes
half-open (forwards nothing either way, keeps the sockets open: the client learns only by its
own timeouts). A second worker, connected directly, starts at a random moment once the
fault is at work, so a slow old worker meets a new one (issue 20, defect 1 "also under
network delay"); then the run is carried to its end directly. Every worker must end on its
own (completed, superseded, unavailable, or refused naming exactly the calls in doubt)
before its deadline.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from adapters import services
from processes import held_open, store_url
from reliability.conftest import make_site
from reliability.figures import TALLY
from reliability.harness import Site, in_parallel
from reliability.profile import PROFILE
from reliability.proxy import FaultyProxy
from reliability.servers import ProxyThread

# Client-side bounds below the worker's deadline (60 s) and above the lease's ttl (0.6 s).
CLIENT_TIMEOUT = {"redis": {"socket_timeout": "2"}, "postgres": {"timeout": "2"}}
DIRECT = {"redis": ("127.0.0.1", 6379), "postgres": ("127.0.0.1", 5432)}


@pytest.fixture(
    params=[
        pytest.param("redis", marks=pytest.mark.redis),
        pytest.param("postgres", marks=pytest.mark.postgres),
    ]
)
def networked(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Site]:
    """A site on the shared server, its workers connected directly (with client timeouts)."""
    backend = request.param
    with held_open(store_url(backend, tmp_path)) as url:
        host, port = DIRECT[backend]
        assert f"{host}:{port}" in url, url
        make_site(url, tmp_path, backend)  # the schema
        yield Site(
            services.with_query(url, **CLIENT_TIMEOUT[backend]),
            tmp_path,
            backend=backend,
            delay=0.1,
        )


def _trial(site: Site, run: str, kind: str) -> tuple[int, int]:
    """One run; how many replies were held back and how often the proxy went dark."""
    rng = random.Random(run)
    host, port = DIRECT[site.backend]
    proxy = ProxyThread(host, port, FaultyProxy(host, port, random.Random(rng.random())))
    faulty = proxy.proxy
    try:
        if kind == "delay":
            count, skip = rng.randint(3, 12), rng.randrange(0, 15)
            proxy.call(lambda: faulty.slow(skip=skip, count=count, lo=0.05, hi=0.9))
        else:
            skip, forward = rng.randrange(0, 15), rng.random() < 0.5
            proxy.call(lambda: faulty.half_open(skip=skip, forward=forward, dark_for=3.0))
        through = site.store.replace(f"{host}:{port}", f"127.0.0.1:{proxy.port}")
        old = site.start(run, store=through)
        # The new worker comes once the fault is at work (or the old worker is done), and
        # a random while later: a machine under load must not let it finish the run first.
        deadline = time.monotonic() + 30
        while not (faulty.delayed or faulty.darkened) and old.wait(0.02) is None:
            if time.monotonic() > deadline:
                break
        old.wait(rng.uniform(0.0, 1.0))
        new = site.start(run)
        new.finish()
        old.finish()
        site.carry(run, rng)
        return faulty.delayed, faulty.darkened
    finally:
        proxy.close()


@pytest.mark.parametrize("kind", ["delay", "half-open"])
def test_slow_and_half_open_networks_end_every_run_without_a_guess(
    networked: Site, kind: str
) -> None:
    site = networked
    runs = PROFILE.delay_runs if kind == "delay" else PROFILE.half_open_runs
    landed: dict[str, tuple[int, int]] = {}

    def job(run: str) -> None:
        landed[run] = _trial(site, run, kind)

    in_parallel([lambda r=r: job(r) for r in (f"{kind}-{n}" for n in range(runs))], PROFILE.width)  # type: ignore[misc]
    verdict = site.verdict()
    scenario = "delayed replies" if kind == "delay" else "half-open connections"
    TALLY.add(site.backend, scenario, runs, verdict, workers=site.stats.workers)
    assert verdict.ok, verdict.explain()
    # Worth something only if the proxy did what it was armed to.
    missed = [run for run, (delayed, dark) in landed.items() if not (delayed or dark)]
    assert not missed, f"the proxy's fault never landed in {missed}"
