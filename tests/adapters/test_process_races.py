"""One lease, many OS processes, on every durable backend: the store alone decides.

Each racer is a real Python process with its own connection, driven over its stdin: it
connects first, says ``READY`` and then blocks reading its next order, so the parent can
release all of them within microseconds of each other.
"""

from __future__ import annotations

import asyncio
import sys
import textwrap
from collections.abc import AsyncIterator
from itertools import pairwise
from pathlib import Path

import pytest

from processes import BACKENDS, POSTGRES_PGBOUNCER, store_url
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.stores.urls import open_stores

TENANT = "acme"

RACER = textwrap.dedent(
    """
    import asyncio, sys
    from tesserix_adk.errors import LeaseHeldError
    from tesserix_adk.stores.urls import open_stores

    async def main() -> None:
        url, holder = sys.argv[1], sys.argv[2]
        async with open_stores(url) as stores:
            # Connected (and, on Redis, the persistence check done) before the start line,
            # so what races is the acquisition itself.
            await stores.leases.current("acme", "warm-up")
            print("READY", flush=True)
            # One order per line: "<run> <ttl>". Reading blocks, so an order starts at once.
            while order := sys.stdin.readline().split():
                run_id, ttl = order[0], float(order[1])
                try:
                    lease = await stores.leases.acquire("acme", run_id, holder, ttl)
                except LeaseHeldError as exc:
                    print("HELD", exc.holder, flush=True)
                else:
                    print("WON", lease.fence, flush=True)

    asyncio.run(main())
    """
)


class Racer:
    """One racing process, named by its holder id."""

    def __init__(self, holder: str, proc: asyncio.subprocess.Process) -> None:
        self.holder = holder
        self.proc = proc

    async def line(self) -> str:
        assert self.proc.stdout is not None
        raw = await asyncio.wait_for(self.proc.stdout.readline(), timeout=60)
        if not raw:
            assert self.proc.stderr is not None
            err = await self.proc.stderr.read()
            raise AssertionError(f"{self.holder} exited: {err.decode()}")
        return raw.decode().strip()

    def order(self, run_id: str, ttl: float) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{run_id} {ttl}\n".encode())

    async def acquire(self, run_id: str, ttl: float) -> list[str]:
        self.order(run_id, ttl)
        return (await self.line()).split()


async def lapsed(stores: Stores, run_id: str) -> None:
    """Return once, by the store's clock, nobody holds ``run_id``."""
    async with asyncio.timeout(10):
        while True:
            if await stores.leases.current(TENANT, run_id) is None:
                return
            await asyncio.sleep(0.01)


@pytest.fixture(params=BACKENDS)
async def url(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[str]:
    """A store of this test's own on each backend, with its schema applied."""
    async with store_url(request.param, tmp_path) as url:
        async with open_stores(url) as stores:
            await stores.create_schema()
        yield url


async def start_racers(url: str, count: int) -> list[Racer]:
    """``count`` connected processes, each waiting for its first order."""
    racers: list[Racer] = []
    try:
        for i in range(count):
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-c",
                RACER,
                url,
                f"worker-{i}",
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )
            racers.append(Racer(f"worker-{i}", proc))
        for racer in racers:
            assert await racer.line() == "READY"
    except BaseException:
        await stop_racers(racers)
        raise
    return racers


async def stop_racers(racers: list[Racer]) -> None:
    """End every racer (EOF on its stdin), or kill it if it is stuck."""
    for racer in racers:
        if racer.proc.returncode is None and racer.proc.stdin is not None:
            racer.proc.stdin.close()
    for racer in racers:
        try:
            await asyncio.wait_for(racer.proc.communicate(), timeout=30)
        except TimeoutError:
            racer.proc.kill()
            await racer.proc.communicate()


@pytest.fixture
async def racers(url: str) -> AsyncIterator[list[Racer]]:
    racers = await start_racers(url, 20)
    try:
        yield racers
    finally:
        await stop_racers(racers)


@pytest.mark.parametrize("url", [*BACKENDS, POSTGRES_PGBOUNCER], indirect=True)
async def test_twenty_processes_acquiring_one_lease_at_once_have_exactly_one_winner(
    url: str, racers: list[Racer]
) -> None:
    # Every order is in its pipe before any answer is read: they all go at once.
    for racer in racers:
        racer.order("run-1", 60)
    answers = {racer.holder: (await racer.line()).split() for racer in racers}

    winners = [holder for holder, (verdict, _) in answers.items() if verdict == "WON"]
    assert len(winners) == 1, answers
    [winner] = winners
    assert answers[winner] == ["WON", "1"]
    # Every loser is refused with the winner's name, never with a lease of its own.
    assert {h: a for h, a in answers.items() if h != winner} == {
        h: ["HELD", winner] for h in answers if h != winner
    }
    async with open_stores(url) as stores:
        lease = await stores.leases.current(TENANT, "run-1")
    assert lease is not None and (lease.holder, lease.fence) == (winner, 1)


async def test_fences_rise_strictly_as_a_lease_passes_between_processes_by_expiry(
    url: str,
) -> None:
    # The lease goes round four processes 20 times, each holder letting it expire rather
    # than releasing it: the fence counter must live in the store, survive every expiry and
    # never go back, whoever acquires next.
    racers = await start_racers(url, 4)
    try:
        fences: list[int] = []
        async with open_stores(url) as stores:
            for cycle in range(20):
                await lapsed(stores, "relay")
                verdict, fence = await racers[cycle % len(racers)].acquire("relay", 0.1)
                assert verdict == "WON", (cycle, verdict, fence)
                fences.append(int(fence))
    finally:
        await stop_racers(racers)
    assert all(a < b for a, b in pairwise(fences)), fences
    assert len(fences) == 20
