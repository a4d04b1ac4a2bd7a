"""A turn of four 200 ms tool calls, one at a time and side by side: figures, never asserts.

    python benchmarks/parallel_calls.py [--stores memory,sqlite] [--calls 4] [--ms 200]
                                        [--repeat 3]

For each store, and for sync tools (run in worker threads) and async tools alike, it times
whole runs of an agent whose one turn asks for ``--calls`` side-effecting, keyed calls that
each take ``--ms`` (the second model turn answers): every call claimed, sent and recorded,
both frontiers written. It prints the best wall time of ``--repeat`` runs with
``parallel_tool_calls=1`` (the default) and with ``parallel_tool_calls=--calls``, and their
ratio, measured in the same process one after the other.

Redis and PostgreSQL join with ``--stores memory,sqlite,redis,postgres`` (servers as in
``benchmarks/servers.py``, each run in a key prefix or schema of its own).
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from servers import postgres_corner, redis_corner  # the benchmarks' server corners

from tesserix_adk import (
    Agent,
    AgentRunner,
    Checkpointer,
    MemoryCheckpointStore,
    MemoryIdempotencyStore,
    MemoryLeaseStore,
    ScriptedProvider,
    open_stores,
    tool,
)

T = "bench"


def _agent(parallel: int, seconds: float, sync: bool) -> Agent:
    if sync:

        @tool(name="work")
        def work_sync(n: int) -> int:
            """Work that blocks for a while (a worker thread)."""
            time.sleep(seconds)
            return n

        chosen = work_sync
    else:

        @tool(name="work")
        async def work_async(n: int) -> int:
            """Work that waits for a while."""
            await asyncio.sleep(seconds)
            return n

        chosen = work_async
    return Agent("bench", "Work.", [chosen], parallel_tool_calls=parallel)


@asynccontextmanager
async def _runner(kind: str, provider: Any) -> AsyncIterator[AgentRunner]:
    if kind == "memory":
        yield AgentRunner(
            provider,
            idempotency=MemoryIdempotencyStore(),
            checkpoints=Checkpointer(MemoryCheckpointStore()),
            leases=MemoryLeaseStore(),
        )
        return
    cleanup = None
    with tempfile.TemporaryDirectory() as tmp:
        if kind == "sqlite":
            url = f"sqlite:///{Path(tmp) / 'bench.sqlite3'}"
        elif kind == "redis":
            url, cleanup = await redis_corner()
        elif kind == "postgres":
            url, cleanup = await postgres_corner()
        else:
            raise SystemExit(f"unknown store {kind!r}")
        try:
            async with open_stores(url) as stores:
                await stores.create_schema()
                yield AgentRunner.from_stores(provider, stores, worker="bench")
        finally:
            if cleanup is not None:
                await cleanup()


async def _best(kind: str, parallel: int, args: argparse.Namespace, sync: bool) -> float:
    agent = _agent(parallel, args.ms / 1000, sync)
    turn = [("work", {"n": n}) for n in range(args.calls)]
    best = float("inf")
    for _ in range(args.repeat):
        provider = ScriptedProvider([turn, "done"])
        async with _runner(kind, provider) as runner:
            run_id = f"p{parallel}-{uuid.uuid4().hex[:8]}"
            started = time.perf_counter()
            await runner.run(agent, "go", tenant=T, run_id=run_id)
            best = min(best, time.perf_counter() - started)
    return best


async def main(args: argparse.Namespace) -> None:
    print(f"a turn of {args.calls} calls of {args.ms} ms; best of {args.repeat} runs")
    print(f"{'store':<10}{'tools':<7}{'sequential':>12}{'parallel':>12}{'ratio':>8}")
    for kind in args.stores.split(","):
        for sync in (True, False):
            one = await _best(kind, 1, args, sync)
            many = await _best(kind, args.calls, args, sync)
            label = "sync" if sync else "async"
            print(
                f"{kind:<10}{label:<7}{one * 1000:>10.0f}ms{many * 1000:>10.0f}ms"
                f"{one / many:>7.2f}x"
            )


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--stores", default="memory,sqlite")
    parser.add_argument("--calls", type=int, default=4)
    parser.add_argument("--ms", type=float, default=200.0)
    parser.add_argument("--repeat", type=int, default=3)
    asyncio.run(main(parser.parse_args()))
