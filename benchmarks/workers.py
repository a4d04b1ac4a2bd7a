"""Workers on every backend: recovery after SIGKILL against the lease ttl, and throughput.

    python benchmarks/workers.py [--stores sqlite,redis,postgres] [--quick]

For each backend with a work index it prints:

- recovery: a ``tesserix worker`` process carrying one run is killed with SIGKILL inside a
  tool call; a second worker, already running, carries the run to its end. The figure is
  the time from the kill to the run's completion, as a multiple of the lease ttl (the
  floor is one ttl: the dead worker's lease must lapse; then ``NEVER_RAN_MARGIN``, 10 s,
  past it before the reconciler is asked whether the call in doubt never ran, the poll
  interval and the run's remaining turn);
- throughput: durable steps per second (frontiers written) of one in-process ``Worker``
  carrying 64 submitted two-call runs at concurrency 1, 8 and 32, and each as a ratio to
  concurrency 1 measured in the same run.

Figures only, never asserts. Servers as in ``benchmarks/servers.py`` (Redis: a throwaway
AOF server).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from servers import Unreachable, postgres_corner, redis_corner

from tesserix_adk import AgentRunner, Checkpointer, LeasePolicy, Worker, open_stores

TESTS = Path(__file__).resolve().parent.parent / "tests"
sys.path.insert(0, str(TESTS))

import chaos_agent  # noqa: E402 - the tests' two-call booking agent and its airline

T = "bench"


async def throughput(url: str, concurrency: int, runs: int) -> float:
    async with open_stores(url) as stores:
        await stores.create_schema()
        runner = AgentRunner.from_stores(chaos_agent.ChaosModel(), stores, worker="bench")
        tag = f"c{concurrency}-{time.monotonic_ns()}"
        for n in range(runs):
            await runner.submit(chaos_agent.agent, "book", tenant=T, run_id=f"{tag}-{n}")
        worker = Worker(
            runner,
            [chaos_agent.agent],
            concurrency=concurrency,
            exit_when_idle=True,
            poll_interval=0.01,
        )
        started = time.perf_counter()
        await worker.run()
        elapsed = time.perf_counter() - started
        steps = 0
        checkpointer = Checkpointer.from_stores(stores)
        for n in range(runs):
            cp = await checkpointer.latest(T, f"{tag}-{n}")
            steps += 0 if cp is None else cp.step + 1
        return steps / elapsed


def _worker(env: dict[str, str], ttl: float) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tesserix_adk",
            "worker",
            "--agent",
            "chaos_agent:agent",
            "--lease-ttl",
            str(ttl),
            "--poll",
            "0.05",
        ],
        env=env,
        cwd=TESTS,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


async def recovery(url: str, airline: str, ttl: float) -> float:
    async with open_stores(url) as stores:
        await stores.create_schema()
        runner = AgentRunner.from_stores(
            chaos_agent.ChaosModel(),
            stores,
            lease_policy=LeasePolicy(ttl=ttl, renew_within=ttl / 3),
        )
        run_id = f"recover-{time.monotonic_ns()}"
        env = {
            **os.environ,
            "ADK_STORE": url,
            chaos_agent.AIRLINE_ENV: airline,
            "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
            "CHAOS_SLOW": "1",
        }
        first = _worker(env, ttl)
        await runner.submit(chaos_agent.agent, "book", tenant=T, run_id=run_id)
        while await stores.leases.current(T, run_id) is None:  # noqa: ASYNC110 - polls a store
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)  # inside the first booking
        first.send_signal(signal.SIGKILL)
        killed = time.perf_counter()
        first.wait()
        second = _worker(env, ttl)
        checkpointer = Checkpointer.from_stores(stores)
        try:
            while True:
                cp = await checkpointer.latest(T, run_id)
                if cp is not None and cp.status.finished:
                    return (time.perf_counter() - killed) / ttl
                await asyncio.sleep(0.02)
        finally:
            second.send_signal(signal.SIGTERM)
            second.wait()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stores", default="sqlite,redis,postgres")
    parser.add_argument("--runs", type=int, default=64)
    parser.add_argument("--ttl", type=float, default=2.0)
    parser.add_argument("--quick", action="store_true", help="16 runs")
    args = parser.parse_args()
    runs = 16 if args.quick else args.runs
    print(f"workers: {runs} two-call runs per figure; recovery with a {args.ttl:g} s lease ttl")
    with tempfile.TemporaryDirectory(prefix="tesserix-bench-") as tmp:
        airline = str(Path(tmp) / "airline.sqlite3")
        chaos_agent.create_airline(airline)
        os.environ[chaos_agent.AIRLINE_ENV] = airline
        for backend in args.stores.split(","):
            cleanup: Callable[[], Any] | None = None
            try:
                if backend == "sqlite":
                    url = f"sqlite:///{Path(tmp) / f'{backend}.sqlite3'}"
                elif backend == "redis":
                    url, cleanup = await redis_corner()
                elif backend == "postgres":
                    url, cleanup = await postgres_corner()
                else:
                    parser.error(f"unknown store {backend!r}")
            except Unreachable as exc:
                print(f"{backend}: cannot be reached, left out ({exc})")
                continue
            try:
                async with open_stores(url) as stores:
                    if stores.work is None:
                        print(f"{backend}: keeps no work index, left out")
                        continue
                rates = {c: await throughput(url, c, runs) for c in (1, 8, 32)}
                ratio = await recovery(url, airline, args.ttl)
                print(
                    f"{backend}: recovery after SIGKILL {ratio:.2f} x the lease ttl; "
                    + ", ".join(
                        f"concurrency {c}: {r:,.0f} steps/s ({r / rates[1]:.1f}x)"
                        for c, r in rates.items()
                    )
                )
            finally:
                if cleanup is not None:
                    await cleanup()


if __name__ == "__main__":
    asyncio.run(main())
