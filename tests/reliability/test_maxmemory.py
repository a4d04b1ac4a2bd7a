"""A Redis at ``maxmemory`` under running workers: ``noeviction``, ``volatile-lru`` and
``volatile-ttl``, on a server the suite starts (AOF, ``appendfsync always``).

Mid-run the test fills the server with keys of its own (some with a ttl, which is all a
``volatile-*`` policy may evict: the kit sets no key ttl, a lease's expiry is a hash field)
until it refuses writes, so the kit's writes get OOM replies; a little later it frees the
memory (raises ``maxmemory``, or deletes its keys) and the run is carried to its end. No
call may take effect twice, no refusal may be wrong, and no key of the kit may be evicted
(keyspace notifications name every evicted and expired key). An ``allkeys-*`` policy, which
could evict a fence, is refused by the workers outright.
"""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import redis

from adapters import services
from reliability.conftest import make_site
from reliability.figures import TALLY
from reliability.harness import Site
from reliability.history import read_history
from reliability.profile import PROFILE
from reliability.servers import RedisAof

PREFIX = "torture:"
FILLER = "filler:"
CHUNK = b"x" * 32768
ROOM = 2 * 1024 * 1024  # bytes above what the server uses when a run starts

pytestmark = pytest.mark.redis


class Watcher:
    """Every key the server evicts or expires, from its keyspace notifications."""

    def __init__(self, client: redis.Redis) -> None:
        self.keys: dict[str, list[str]] = {"evicted": [], "expired": []}
        self.pubsub = client.pubsub()

        def handler(what: str) -> Any:
            return lambda message: self.keys[what].append(message["data"].decode())

        self.pubsub.subscribe(
            **{f"__keyevent@0__:{what}": handler(what) for what in ("evicted", "expired")}
        )
        self.thread = self.pubsub.run_in_thread(sleep_time=0.01, daemon=True)

    def close(self) -> None:
        self.thread.stop()
        self.thread.join(10)
        self.pubsub.close()


def _fill(client: redis.Redis, n: int) -> int:
    """Keys of the test's own until the server refuses one: the first third with a ttl (what
    a volatile-* policy evicts first); how many went in."""
    for i in range(100_000):
        try:
            if i < 20:
                client.set(f"{FILLER}{n}:{i}", CHUNK, ex=3600)
            else:
                client.set(f"{FILLER}{n}:{i}", CHUNK)
        except redis.exceptions.OutOfMemoryError:
            return i
    raise AssertionError("the server never ran out of memory")


def _drop_filler(client: redis.Redis) -> None:
    keys = list(client.scan_iter(match=f"{FILLER}*", count=1000))
    if keys:
        client.delete(*keys)


def _oom_seen(site: Site, run: str) -> bool:
    return any(
        e.run == run and ("OOM" in str(e.get("error")) or "maxmemory" in str(e.get("error")))
        for e in read_history(site.history, live=True)
    )


def _trial(site: Site, client: redis.Redis, run: str, rng: random.Random) -> bool:
    """One run into a full server and out again; whether the kit got an OOM reply."""
    _drop_filler(client)
    client.config_set("maxmemory", 0)
    used = int(client.info("memory")["used_memory"])
    client.config_set("maxmemory", used + ROOM)
    carrier = threading.Thread(target=site.carry, args=(run, random.Random(run)))
    carrier.start()
    time.sleep(rng.uniform(0.05, 0.5))
    _fill(client, int(run.rsplit("-", 1)[1]))
    # Memory in use dips once the refused write's buffers are freed; a limit well below
    # it keeps the server full for the kit's small writes too.
    used = int(client.info("memory")["used_memory"])
    client.config_set("maxmemory", used - 256 * 1024)
    # Long enough for a worker still starting on a busy machine to reach its next write;
    # the wait ends as soon as a worker met the full server.
    deadline = time.monotonic() + 30
    while carrier.is_alive() and not _oom_seen(site, run) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(rng.uniform(0.0, 1.0))  # workers keep meeting a full server meanwhile
    if rng.random() < 0.5:
        client.config_set("maxmemory", 0)
    else:
        _drop_filler(client)
    carrier.join(300)
    assert not carrier.is_alive(), f"{run} still going after 300 s"
    return _oom_seen(site, run)


@pytest.mark.parametrize("policy", ["noeviction", "volatile-lru", "volatile-ttl"])
def test_redis_at_maxmemory_makes_no_call_twice_and_evicts_no_kit_key(
    tmp_path: Path, rng: random.Random, policy: str
) -> None:
    server = RedisAof(tmp_path, "--maxmemory-policy", policy, "--notify-keyspace-events", "Exe")
    server.start()
    client = redis.Redis(port=server.port)
    watcher = Watcher(client)
    try:
        # Slow runs (about 2.5 s of model and tool time each): the fill lands mid-run.
        url = services.with_query(server.url, prefix=PREFIX)
        site = make_site(url, tmp_path, "redis", delay=0.3)
        runs = [f"oom-{n}" for n in range(PROFILE.maxmemory_runs)]
        landed = [_trial(site, client, run, rng) for run in runs]
        time.sleep(0.2)  # the last notifications
        verdict = site.verdict()
        TALLY.add(
            site.backend,
            f"maxmemory {policy}",
            len(runs),
            verdict,
            workers=site.stats.workers,
            notes={"OOM replies met": sum(landed)},
        )
        assert verdict.ok, verdict.explain()
        assert all(landed), f"runs whose workers never met a full server: {landed}"
        kit = [k for keys in watcher.keys.values() for k in keys if k.startswith(PREFIX)]
        assert kit == [], f"kit keys evicted or expired: {kit}"
        if policy != "noeviction":
            # The policy was at work: it evicted the filler's keys with a ttl.
            assert watcher.keys["evicted"], watcher.keys
    finally:
        watcher.close()
        client.close()
        server.stop()


def test_an_allkeys_policy_is_refused_by_every_worker(tmp_path: Path) -> None:
    server = RedisAof(tmp_path, "--maxmemory-policy", "allkeys-lru")
    server.start()
    try:
        url = services.with_query(server.url, prefix=PREFIX)
        site = Site(url, tmp_path, backend="redis")
        assert site.start("allkeys").finish() == 5  # anything else than held or refused
        (result,) = [e for e in read_history(site.history) if e.ev == "result"]
        assert "maxmemory-policy" in result["error"] and "allkeys-lru" in result["error"]
        assert not [e for e in read_history(site.history) if e.ev == "effect"]
    finally:
        server.stop()
