"""What a checkpoint costs as a run grows, and what a resume costs: figures, never asserts.

    python benchmarks/checkpoint_cost.py [--turns 1000] [--stores memory,sqlite] [--quick]

Per turn the simulated run writes two frontiers, as the runner does: ``after_model_call``
(one assistant message whose single tool call carries ~500 characters of arguments) and
``after_tool_result`` (a ~500-character tool result). Each write is the whole kit path:
redact, encode, append the new messages to the transcript, put the frontier.

If ``langgraph`` and ``langgraph-checkpoint-sqlite`` are installed (``pip install -e
".[bench]"``), the same conversation goes through LangGraph's ``SqliteSaver`` in the same
process and both are printed side by side, with the ratios.

Redis and PostgreSQL join with ``--stores memory,sqlite,redis,postgres`` (URLs from
``ADK_TEST_REDIS_URL`` / ``ADK_TEST_POSTGRES_URL``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import string
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from tesserix_adk import Boundary, Checkpoint, CheckpointStatus, Message, OutstandingCall, ToolCall
from tesserix_adk.checkpoint.checkpointer import Checkpointer, TranscriptCursor
from tesserix_adk.checkpoint.planning import plan_resume
from tesserix_adk.resumer import Resumer
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.stores.urls import open_stores

CHECKPOINTS = (10, 100, 1000)


def _text(rng: random.Random, n: int) -> str:
    words = []
    size = 0
    while size < n:
        word = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(2, 9)))
        words.append(word)
        size += len(word) + 1
    return " ".join(words)[:n]


def conversation(turns: int, seed: int = 7) -> list[tuple[Message, Message]]:
    """Per turn: an assistant message with one ~500-char tool call, and its ~500-char result."""
    rng = random.Random(seed)
    out = []
    for i in range(turns):
        call = ToolCall(
            id=f"call_{i}", name="lookup", arguments={"query": _text(rng, 480), "page": i}
        )
        out.append(
            (
                Message.assistant("", [call]),
                Message("tool", _text(rng, 500), tool_call_id=call.id),
            )
        )
    return out


class _Counting:
    """Wraps a store's write methods to count the bytes the kit hands it."""

    def __init__(self, stores: Stores) -> None:
        self.bytes = 0
        put, append = stores.checkpoints.put, stores.history.append

        async def counted_put(tenant: str, run_id: str, payload: bytes, **kw: Any) -> None:
            self.bytes += len(payload)
            await put(tenant, run_id, payload, **kw)

        async def counted_append(tenant: str, run_id: str, encoded: Any, **kw: Any) -> Any:
            self.bytes += sum(len(e) for e in encoded)
            return await append(tenant, run_id, encoded, **kw)

        stores.checkpoints.put = counted_put  # type: ignore[method-assign]
        stores.history.append = counted_append  # type: ignore[method-assign]
        both = getattr(stores.checkpoints, "put_with_history", None)
        if both is not None:

            async def counted_both(
                history: Any, tenant: str, run_id: str, payload: bytes, **kw: Any
            ) -> Any:
                self.bytes += len(payload) + sum(len(e) for e in kw["encoded"])
                return await both(history, tenant, run_id, payload, **kw)

            stores.checkpoints.put_with_history = counted_both  # type: ignore[attr-defined]


async def bench_kit(url: str, turns: int) -> dict[str, Any]:
    """Per-step write cost and bytes for the kit on one store."""
    stores = open_stores(url)
    await stores.create_schema()
    counting = _Counting(stores)
    checkpointer = Checkpointer.from_stores(stores)
    run_id = f"bench-{uuid.uuid4().hex[:8]}"
    lease = await stores.leases.acquire("bench", run_id, "bench", 600)
    for s in (stores.checkpoints, stores.history):
        await s.seal("bench", run_id, lease.fence)
    cursor = TranscriptCursor()
    messages: list[Message] = [Message.user("Find me everything about the order.")]
    step_cost: list[float] = []
    step_bytes: list[int] = []
    step = 0
    for i, (assistant, result) in enumerate(conversation(turns)):
        started, before = time.perf_counter(), counting.bytes
        messages.append(assistant)
        for boundary in (Boundary.after_model_call, Boundary.after_tool_result):
            if boundary is Boundary.after_tool_result:
                messages.append(result)
            step += 1
            outstanding = (
                (OutstandingCall(call=assistant.tool_calls[0], key=f"k1:{i}"),)
                if boundary is Boundary.after_model_call
                else ()
            )
            frontier = Checkpoint(
                tenant="bench",
                run_id=run_id,
                agent_name="bench",
                agent_revision="sha256:x",
                step=step,
                boundary=boundary,
                status=CheckpointStatus.running,
                iteration=i,
                fence=lease.fence,
                messages=tuple(messages),
                outstanding=outstanding,
                steps_used=i + 1,
                written_at=time.time(),
            )
            if not await checkpointer.write(frontier, cursor=cursor):
                raise RuntimeError(f"write failed: {checkpointer.last_error!r}")
        step_cost.append(time.perf_counter() - started)
        step_bytes.append(counting.bytes - before)
    await stores.leases.release(lease)

    # Resume: lease + seal + frontier + plan + transcript, as a new worker does it.
    resume_times = []
    for _ in range(5):
        resumer = Resumer(checkpointer, stores.leases, stores.history, stores.idempotency)
        started = time.perf_counter()
        carried = await resumer.resume(run_id, tenant="bench", worker="bench")
        resume_times.append(time.perf_counter() - started)
        await stores.leases.release(carried.lease)
    frontier_size = len((await stores.checkpoints.latest("bench", run_id)).payload)  # type: ignore[union-attr]
    plan = await plan_resume(carried.checkpoint, stores.idempotency)
    await stores.checkpoints.forget("bench", run_id)
    await stores.history.forget("bench", run_id)
    await stores.aclose()
    return {
        "step_cost": step_cost,
        "step_bytes": step_bytes,
        "resume": statistics.median(resume_times),
        "resume_messages": len(carried.messages),
        "frontier_bytes": frontier_size,
        "plan_calls": len(plan.calls),
    }


def bench_langgraph(turns: int, path: Path, synchronous: str) -> dict[str, Any] | None:
    """The same conversation through LangGraph's SqliteSaver (whole state per step)."""
    try:
        import sqlite3

        from langgraph.checkpoint.base import empty_checkpoint
        from langgraph.checkpoint.sqlite import SqliteSaver
    except ImportError:
        return None
    conn = sqlite3.connect(str(path), check_same_thread=False)
    saver = SqliteSaver(conn)
    saver.setup()
    conn.execute(f"PRAGMA synchronous={synchronous.upper()}")
    config: dict[str, Any] = {"configurable": {"thread_id": "bench", "checkpoint_ns": ""}}
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Find me everything."}]
    step_cost: list[float] = []
    version = 0
    for assistant, result in conversation(turns):
        started = time.perf_counter()
        for message in (assistant, result):
            call = assistant.tool_calls[0]
            messages.append(
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [
                        {"id": call.id, "name": call.name, "args": dict(call.arguments)}
                    ],
                }
                if message is assistant
                else {"role": "tool", "content": message.text, "tool_call_id": call.id}
            )
            version += 1
            checkpoint = empty_checkpoint()
            checkpoint["channel_values"] = {"messages": list(messages)}
            checkpoint["channel_versions"] = {"messages": version}
            config = saver.put(
                config, checkpoint, {"source": "loop", "step": version}, {"messages": version}
            )
        step_cost.append(time.perf_counter() - started)
    total = conn.execute("SELECT sum(length(checkpoint)) FROM checkpoints").fetchone()[0]
    conn.close()
    size = _size(path.parent, path.name)
    return {"step_cost": step_cost, "bytes": int(total), "db_size": size}


def _size(folder: Path, name: str) -> int:
    """Bytes of a SQLite database with its WAL and shared-memory files."""
    return sum(p.stat().st_size for p in folder.glob(name + "*"))


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:8.3f} ms"


def _median_at(costs: list[float], turn: int) -> float:
    lo, hi = max(0, turn - 5), min(len(costs), turn + 5)
    return statistics.median(costs[lo:hi])


def _tenth(costs: list[float], last: bool) -> float:
    n = max(1, len(costs) // 10)
    return statistics.median(costs[-n:] if last else costs[:n])


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=1000)
    parser.add_argument("--stores", default="memory,sqlite")
    parser.add_argument("--langgraph-turns", type=int, default=400)
    parser.add_argument("--quick", action="store_true", help="100 turns, for a smoke run")
    args = parser.parse_args()
    if args.quick:
        args.turns, args.langgraph_turns = 100, 100
    tmp = Path(tempfile.mkdtemp(prefix="tesserix-bench-"))
    urls = {
        "memory": "memory://",
        "sqlite": f"sqlite:///{tmp / 'kit.sqlite3'}",
        "redis": os.environ.get("ADK_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
        + f"?prefix=bench-{uuid.uuid4().hex[:6]}:&allow_volatile=true",
        "postgres": os.environ.get(
            "ADK_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test"
        ),
    }
    print(f"checkpoint cost, {args.turns} turns (2 frontiers per turn); SQLite synchronous=FULL")
    print(f"{'store':<10} {'turn':>6} {'per turn':>12} {'bytes/turn':>11}")
    results = {}
    for name in args.stores.split(","):
        res = await bench_kit(urls[name], args.turns)
        results[name] = res
        for turn in CHECKPOINTS:
            if turn <= args.turns:
                print(
                    f"{name:<10} {turn:>6} {_ms(_median_at(res['step_cost'], turn - 1)):>12} "
                    f"{res['step_bytes'][turn - 1]:>11}"
                )
        first, last = _tenth(res["step_cost"], False), _tenth(res["step_cost"], True)
        print(
            f"{name:<10} last 10% / first 10% per-turn cost: {last / first:.2f}x "
            f"(target <= 1.5x); frontier {res['frontier_bytes']} bytes"
        )
        print(
            f"{name:<10} resume (lease + seal + frontier + plan + {res['resume_messages']} "
            f"messages): {_ms(res['resume'])}"
        )
    n = args.langgraph_turns
    for synchronous in ("full", "normal"):
        lg = bench_langgraph(n, tmp / f"langgraph-{synchronous}.sqlite3", synchronous)
        if lg is None:
            print("\nLangGraph not installed: pip install -e '.[bench]' to compare")
            return
        path = tmp / f"side-{synchronous}.sqlite3"
        ours = await bench_kit(f"sqlite:///{path}?synchronous={synchronous}", n)
        ours_bytes = sum(ours["step_bytes"])
        print(
            f"\nside by side, {n} turns, one SQLite file each, same content, "
            f"synchronous={synchronous.upper()} on both"
        )
        print(f"{'':<28} {'tesserix':>14} {'langgraph':>14} {'ratio':>8}")
        print(
            f"{'bytes written':<28} {ours_bytes:>14} {lg['bytes']:>14} "
            f"{lg['bytes'] / ours_bytes:>7.1f}x  (target >= 100x)"
        )
        print(f"{'bytes per turn':<28} {ours_bytes // n:>14} {lg['bytes'] // n:>14}")
        ours_last, lg_last = _tenth(ours["step_cost"], True), _tenth(lg["step_cost"], True)
        print(
            f"{'per turn, last 10%':<28} {_ms(ours_last):>14} {_ms(lg_last):>14} "
            f"{lg_last / ours_last:>7.1f}x  (target >= 5x)"
        )
        print(
            f"{'per turn, first 10%':<28} {_ms(_tenth(ours['step_cost'], False)):>14} "
            f"{_ms(_tenth(lg['step_cost'], False)):>14}"
        )
        kit_db = _size(tmp, path.name)
        print(f"{'database size at the end':<28} {kit_db:>14} {lg['db_size']:>14}")
    print(
        "\nA turn is two steps (two frontiers and two transcript appends) on both sides; with "
        "synchronous=FULL each of our steps is one SQLite commit, so a turn costs at least two "
        "WAL syncs."
    )


if __name__ == "__main__":
    asyncio.run(main())
