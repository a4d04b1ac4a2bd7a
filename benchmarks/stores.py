"""Every store backend side by side: figures, never asserts.

    python benchmarks/stores.py [--stores memory,sqlite,redis,postgres] [--quick]

For memory, SQLite, Redis and PostgreSQL it prints:

- the cost of one checkpoint (``Checkpointer.write``: redact, encode, append the new messages
  to the transcript, put the frontier), median of the writes at turns 90-99 of a run of
  two frontiers per turn, as ``benchmarks/checkpoint_cost.py`` simulates it;
- lease acquire+release pairs per second, with 1 and with 8 concurrent workers (asyncio
  tasks in this process, each on a run of its own, sharing the backend's client or pool —
  the PostgreSQL pool holds at most 4 connections by default; the memory store never
  yields, so its workers take turns rather than overlap);
- resume latency (``Resumer.resume``: lease, seals, frontier, plan, transcript) on that run,
  which then holds 201 messages;
- round trips per resume: Redis commands or pipelines sent (counted on the connection),
  PostgreSQL statements executed (counted on the cursor), SQLite transactions
  (``SqliteDatabase.read``/``write``); memory has none.

Servers come from ``ADK_TEST_REDIS_URL`` / ``ADK_TEST_POSTGRES_URL`` (defaults: the local
ones). The benchmark works under a key prefix / in a schema of its own and removes them
after; a server that cannot be reached is reported and left out.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

from checkpoint_cost import conversation

from tesserix_adk import Boundary, Checkpoint, CheckpointStatus, Message, OutstandingCall
from tesserix_adk.checkpoint.checkpointer import Checkpointer, TranscriptCursor
from tesserix_adk.resumer import Resumer
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.stores.urls import open_stores

REDIS_URL = os.environ.get("ADK_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
POSTGRES_URL = os.environ.get("ADK_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test")
TENANT = "bench"


@dataclass
class Figures:
    write: float = 0.0
    leases_1: float = 0.0
    leases_8: float = 0.0
    resume: float = 0.0
    resume_messages: int = 0
    round_trips: int | None = None


# --- counting round trips ----------------------------------------------------------------


@contextmanager
def counting(owner: type, *names: str) -> Iterator[list[int]]:
    """Count calls of ``owner``'s methods ``names`` (class-wide) while the block runs."""
    count = [0]
    originals = {name: getattr(owner, name) for name in names}

    def counted(original: Callable[..., Any]) -> Callable[..., Any]:
        async def wrapper(*args: Any, **kwargs: Any) -> Any:
            count[0] += 1
            return await original(*args, **kwargs)

        return wrapper

    for name, original in originals.items():
        setattr(owner, name, counted(original))
    try:
        yield count
    finally:
        for name, original in originals.items():
            setattr(owner, name, original)


@contextmanager
def round_trips(backend: str) -> Iterator[list[int] | None]:
    if backend == "redis":
        from redis.asyncio.connection import AbstractConnection

        # One send per command, or per pipeline: what reaches the wire.
        with counting(AbstractConnection, "send_packed_command") as count:
            yield count
    elif backend == "postgres":
        import psycopg

        # Every statement the stores run goes through a cursor (conn.execute makes one).
        with counting(psycopg.AsyncCursor, "execute", "executemany") as count:
            yield count
    elif backend == "sqlite":
        from tesserix_adk.stores.sqlite import SqliteDatabase

        with counting(SqliteDatabase, "read", "write") as count:
            yield count
    else:
        yield None


# --- the measurements --------------------------------------------------------------------


async def checkpoint_run(stores: Stores, run_id: str, turns: int) -> float:
    """Write ``turns`` turns of a fenced run; the median write at the last ten turns."""
    checkpointer = Checkpointer.from_stores(stores)
    lease = await stores.leases.acquire(TENANT, run_id, "bench", 600)
    for store in (stores.checkpoints, stores.history):
        await store.seal(TENANT, run_id, lease.fence)
    cursor = TranscriptCursor()
    messages: list[Message] = [Message.user("Find me everything about the order.")]
    late: list[float] = []
    step = 0
    for i, (assistant, result) in enumerate(conversation(turns)):
        messages.append(assistant)
        for boundary in (Boundary.after_model_call, Boundary.after_tool_result):
            if boundary is Boundary.after_tool_result:
                messages.append(result)
            step += 1
            frontier = Checkpoint(
                tenant=TENANT,
                run_id=run_id,
                agent_name="bench",
                agent_revision="sha256:x",
                step=step,
                boundary=boundary,
                status=CheckpointStatus.running,
                iteration=i,
                fence=lease.fence,
                messages=tuple(messages),
                outstanding=(
                    (OutstandingCall(call=assistant.tool_calls[0], key=f"k1:{i}"),)
                    if boundary is Boundary.after_model_call
                    else ()
                ),
                steps_used=i + 1,
                written_at=time.time(),
            )
            started = time.perf_counter()
            written = await checkpointer.write(frontier, cursor=cursor)
            elapsed = time.perf_counter() - started
            if not written:
                raise RuntimeError(f"write failed: {checkpointer.last_error!r}")
            if i >= turns - 10:
                late.append(elapsed)
    await stores.leases.release(lease)
    return statistics.median(late)


async def lease_rate(stores: Stores, workers: int, seconds: float) -> float:
    """Acquire+release pairs per second, ``workers`` tasks each on a run of its own."""
    tag = secrets.token_hex(4)
    deadline = time.perf_counter() + seconds
    done = [0] * workers

    async def worker(n: int) -> None:
        run_id = f"lease-{tag}-{n}"
        while time.perf_counter() < deadline:
            lease = await stores.leases.acquire(TENANT, run_id, f"w{n}", 30)
            await stores.leases.release(lease)
            done[n] += 1

    started = time.perf_counter()
    await asyncio.gather(*(worker(n) for n in range(workers)))
    return sum(done) / (time.perf_counter() - started)


async def resume_figures(
    stores: Stores, backend: str, run_id: str, times: int
) -> tuple[float, int, int | None]:
    """Median ``Resumer.resume`` latency, messages carried, round trips of one resume."""
    checkpointer = Checkpointer.from_stores(stores)
    resumer = Resumer(checkpointer, stores.leases, stores.history, stores.idempotency)
    latencies = []
    carried = None
    for _ in range(times):
        started = time.perf_counter()
        carried = await resumer.resume(run_id, tenant=TENANT, worker="bench")
        latencies.append(time.perf_counter() - started)
        await stores.leases.release(carried.lease)
    assert carried is not None
    # Counted on a warm client (connected, scripts loaded), as a long-lived worker has it.
    with round_trips(backend) as count:
        carried = await resumer.resume(run_id, tenant=TENANT, worker="bench")
        trips = None if count is None else count[0]
    await stores.leases.release(carried.lease)
    return statistics.median(latencies), len(carried.messages), trips


async def measure(backend: str, url: str, args: argparse.Namespace) -> Figures:
    stores = open_stores(url)
    try:
        await stores.create_schema()
        run_id = f"bench-{secrets.token_hex(4)}"
        figures = Figures()
        figures.write = await checkpoint_run(stores, run_id, args.turns)
        figures.leases_1 = await lease_rate(stores, 1, args.seconds)
        figures.leases_8 = await lease_rate(stores, 8, args.seconds)
        figures.resume, figures.resume_messages, figures.round_trips = await resume_figures(
            stores, backend, run_id, args.resumes
        )
        return figures
    finally:
        await stores.aclose()


# --- the backends' corners ---------------------------------------------------------------


class Unreachable(Exception):
    pass


async def redis_corner() -> tuple[str, Callable[[], Any]]:
    import redis.asyncio as aioredis
    from redis.exceptions import RedisError

    client = aioredis.from_url(REDIS_URL, socket_connect_timeout=3)
    try:
        await client.ping()
    except (RedisError, OSError) as exc:
        await client.aclose()
        raise Unreachable(f"Redis at {REDIS_URL}: {exc}") from exc
    prefix = f"adkbench-{secrets.token_hex(6)}:"

    async def cleanup() -> None:
        try:
            keys = [key async for key in client.scan_iter(match=f"{prefix}*", count=1000)]
            for i in range(0, len(keys), 500):
                await client.delete(*keys[i : i + 500])
        finally:
            await client.aclose()

    # The local server runs without persistence; a benchmark may accept that.
    query = urlencode({"prefix": prefix, "allow_volatile": "true"}, quote_via=quote)
    return f"{REDIS_URL}{'&' if '?' in REDIS_URL else '?'}{query}", cleanup


async def postgres_corner() -> tuple[str, Callable[[], Any]]:
    import psycopg

    try:
        admin = await psycopg.AsyncConnection.connect(
            POSTGRES_URL, autocommit=True, connect_timeout=3
        )
    except psycopg.OperationalError as exc:
        raise Unreachable(f"PostgreSQL at {POSTGRES_URL}: {exc}") from exc
    schema = f"adkbench_{secrets.token_hex(6)}"
    await admin.execute(f'CREATE SCHEMA "{schema}"')

    async def cleanup() -> None:
        try:
            await admin.execute(f'DROP SCHEMA "{schema}" CASCADE')
        finally:
            await admin.close()

    query = urlencode({"options": f"-csearch_path={schema}"}, quote_via=quote)
    return f"{POSTGRES_URL}{'&' if '?' in POSTGRES_URL else '?'}{query}", cleanup


# --- printing ----------------------------------------------------------------------------


def table(results: dict[str, Figures], args: argparse.Namespace) -> None:
    names = list(results)
    messages = {f.resume_messages for f in results.values()}
    rows: list[tuple[str, Callable[[Figures], str]]] = [
        (f"checkpoint write, turn ~{args.turns} (ms)", lambda f: f"{f.write * 1000:.3f}"),
        ("lease acquire+release /s, 1 worker", lambda f: f"{f.leases_1:,.0f}"),
        ("lease acquire+release /s, 8 workers", lambda f: f"{f.leases_8:,.0f}"),
        (
            f"resume, {'/'.join(map(str, sorted(messages)))} messages (ms)",
            lambda f: f"{f.resume * 1000:.3f}",
        ),
        (
            "round trips per resume",
            lambda f: "-" if f.round_trips is None else str(f.round_trips),
        ),
    ]
    width = max(len(label) for label, _ in rows)
    print(f"{'':<{width}}" + "".join(f"{name:>12}" for name in names))
    for label, cell in rows:
        print(f"{label:<{width}}" + "".join(f"{cell(results[n]):>12}" for n in names))


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stores", default="memory,sqlite,redis,postgres")
    parser.add_argument("--turns", type=int, default=100)
    parser.add_argument("--seconds", type=float, default=2.0, help="per lease measurement")
    parser.add_argument("--resumes", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="short lease loops, 5 resumes")
    args = parser.parse_args()
    if args.quick:
        args.seconds, args.resumes = 0.5, 5
    if args.turns < 10:
        parser.error("--turns must be at least 10")
    print(
        f"stores side by side: {args.turns} turns (2 checkpoints each), lease loops of "
        f"{args.seconds:g} s, resume median of {args.resumes}; SQLite synchronous=FULL"
    )
    results: dict[str, Figures] = {}
    with tempfile.TemporaryDirectory(prefix="tesserix-bench-") as tmp:
        for backend in args.stores.split(","):
            cleanup: Callable[[], Any] | None = None
            try:
                if backend == "memory":
                    url = "memory://"
                elif backend == "sqlite":
                    url = f"sqlite:///{Path(tmp) / 'bench.sqlite3'}"
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
                results[backend] = await measure(backend, url, args)
            finally:
                if cleanup is not None:
                    await cleanup()
    print()
    if results:
        table(results, args)
    print(
        "\nround trips: Redis commands or pipelines sent, PostgreSQL statements, SQLite "
        "transactions; counted on a warm client."
    )


if __name__ == "__main__":
    asyncio.run(main())
