"""The agent of the parallel crash tests, and the process that runs it until it is killed.

One turn asks for four side-effecting calls at once (``book_seat``, ``charge_card``,
``reserve_hotel``, ``send_email``, in that order); the next turn answers with every result it
was given, in the order it was given them. Each effect is a row in an "airline" table of its
own SQLite file (``PARALLEL_AIRLINE``) carrying the call's idempotency key, so a test counts
effects per key and the reconcilers look them up by it.

``PARALLEL_PLAN`` (JSON, tool name → where it stops) holds a call at a chosen point, so a
SIGKILL lands on a known mix of calls:

- ``hang_before``: the call is claimed and running, its effect not made (in flight);
- ``hang_after``: its effect made, the tool not returned (in flight);
- ``hold_done``: its outcome recorded, its slot still held (completed).

A call with no entry runs through. The process prints ``AT <tool> <point>`` when a call is
held and ``COMPLETED <tool>`` once a call's outcome is recorded; a call that never started
prints nothing (every slot is held).

    python tests/parallel_agent.py run|resume RUN --store URL --parallel N [--reconcile]

prints ``RESULT <status> <output>``, or ``ERROR <type>: <message>`` and exits 4 (3 if the
error is retryable).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sqlite3
import sys
import threading
import time
from typing import Any

from tesserix_adk import (
    Agent,
    AgentRunner,
    LeasePolicy,
    ModelRequest,
    ModelResponse,
    Reconciled,
    ToolContext,
    open_stores,
    tool,
)
from tesserix_adk.errors import AdkError
from tesserix_adk.messages import Message, Role, ToolCall
from tesserix_adk.stores.protocols import IdempotencyRecord, IdempotencyStore
from tesserix_adk.testing.faults import FaultyIdempotencyStore

AIRLINE_ENV = "PARALLEL_AIRLINE"
PLAN_ENV = "PARALLEL_PLAN"
TENANT = "demo"
TOOLS = ("book_seat", "charge_card", "reserve_hotel", "send_email")
CALL_IDS = ("call_a", "call_b", "call_c", "call_d")

_say_lock = threading.Lock()


def create_airline(path: str) -> None:
    with sqlite3.connect(path) as conn:
        conn.execute("PRAGMA journal_mode = WAL")
        conn.execute(
            "CREATE TABLE IF NOT EXISTS effects (id INTEGER PRIMARY KEY, key TEXT, tool TEXT, "
            "run_id TEXT)"
        )
    conn.close()


def effects(path: str, run_id: str) -> list[tuple[str, str]]:
    """Every effect the airline took for ``run_id``: (tool, idempotency key)."""
    conn = sqlite3.connect(path, timeout=30)
    try:
        rows = conn.execute(
            "SELECT tool, key FROM effects WHERE run_id = ? ORDER BY id", (run_id,)
        ).fetchall()
    finally:
        conn.close()
    return [(str(t), str(k)) for t, k in rows]


def _say(line: str) -> None:
    with _say_lock:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


def _plan() -> dict[str, str]:
    raw = os.environ.get(PLAN_ENV, "")
    return dict(json.loads(raw)) if raw else {}


def _hold(name: str, point: str) -> None:
    _say(f"AT {name} {point}")
    time.sleep(3600)  # until the parent's SIGKILL


def _connect() -> sqlite3.Connection:
    return sqlite3.connect(os.environ[AIRLINE_ENV], timeout=30, isolation_level=None)


def _effect(name: str, item: str, ctx: ToolContext) -> dict[str, str]:
    point = _plan().get(name)
    if point == "hang_before":
        _hold(name, point)
    conn = _connect()
    try:
        conn.execute(
            "INSERT INTO effects (key, tool, run_id) VALUES (?, ?, ?)",
            (ctx.idempotency_key, name, ctx.run_id),
        )
    finally:
        conn.close()
    if point == "hang_after":
        _hold(name, point)
    return {"done": name, "item": item}


def _look_up(call: ToolCall, ctx: ToolContext) -> Reconciled:
    conn = _connect()
    try:
        row = conn.execute(
            "SELECT tool FROM effects WHERE key = ?", (ctx.idempotency_key,)
        ).fetchone()
    finally:
        conn.close()
    if row is None:
        return Reconciled.never_ran()
    return Reconciled.completed({"done": row[0], "item": call.arguments.get("item"), "by": "rec"})


def _tools(*, reconcile: bool) -> list[Any]:
    rec = _look_up if reconcile else None

    @tool(name="book_seat", reconcile=rec)
    def book_seat(item: str, ctx: ToolContext) -> dict[str, str]:
        """Book a seat."""
        return _effect("book_seat", item, ctx)

    @tool(name="charge_card", reconcile=rec)
    def charge_card(item: str, ctx: ToolContext) -> dict[str, str]:
        """Charge the card."""
        return _effect("charge_card", item, ctx)

    @tool(name="reserve_hotel", reconcile=rec)
    def reserve_hotel(item: str, ctx: ToolContext) -> dict[str, str]:
        """Reserve a hotel room."""
        return _effect("reserve_hotel", item, ctx)

    @tool(name="send_email", reconcile=rec)
    def send_email(item: str, ctx: ToolContext) -> dict[str, str]:
        """Send the confirmation."""
        return _effect("send_email", item, ctx)

    return [book_seat, charge_card, reserve_hotel, send_email]


def make_agent(parallel: int, *, reconcile: bool = False) -> Agent:
    """The trip agent; its revision is the same whatever ``parallel`` and ``reconcile``."""
    return Agent(
        "trip", "Book the trip.", _tools(reconcile=reconcile), parallel_tool_calls=parallel
    )


class TripModel:
    """Asks for the four calls at once, then answers with the results it was given."""

    async def complete(self, request: ModelRequest) -> ModelResponse:
        results = [m for m in request.messages if m.role is Role.tool]
        if not results:
            calls = [
                ToolCall(id=cid, name=name, arguments={"item": f"{name}-1"})
                for cid, name in zip(CALL_IDS, TOOLS, strict=True)
            ]
            return ModelResponse(message=Message(Role.assistant, "", tool_calls=calls))
        told = [[m.tool_call_id, m.is_error, json.loads(str(m.content))] for m in results]
        return ModelResponse(message=Message(Role.assistant, json.dumps(told)))


class _Holding(FaultyIdempotencyStore):
    """Says when a call's outcome is recorded; holds its slot if the plan says so."""

    async def complete(
        self, key: str, outcome: bytes, *, tenant: str, holder: str
    ) -> IdempotencyRecord:
        rec = await super().complete(key, outcome, tenant=tenant, holder=holder)
        _say(f"COMPLETED {rec.tool}")
        if rec.tool is not None and _plan().get(rec.tool) == "hold_done":
            _say(f"AT {rec.tool} hold_done")
            await asyncio.sleep(3600)
        return rec


async def _main(args: argparse.Namespace) -> int:
    stores = open_stores(args.store)
    idem: IdempotencyStore = _Holding(stores.idempotency)
    stores.idempotency = idem
    agent = make_agent(args.parallel, reconcile=args.reconcile)
    async with stores:
        runner = AgentRunner.from_stores(
            TripModel(),
            stores,
            worker=f"trip-{args.command}",
            lease_policy=LeasePolicy(ttl=1.0, renew_within=0.5),
            # The dead worker was SIGKILLed: nothing it sent lands late, so the reconcilers
            # need not wait the full margin past its lease.
            never_ran_margin=0.2,
        )
        try:
            if args.command == "run":
                run = await runner.run(agent, "book the trip", tenant=TENANT, run_id=args.run)
            else:
                run = await runner.resume(agent, args.run, tenant=TENANT)
        except AdkError as exc:
            _say(f"ERROR {type(exc).__name__}: {exc}")
            return 3 if exc.retryable else 4
    _say(f"RESULT {run.status} {run.output}")
    return 0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("command", choices=["run", "resume"])
    parser.add_argument("run")
    parser.add_argument("--store", required=True)
    parser.add_argument("--parallel", type=int, default=4)
    parser.add_argument("--reconcile", action="store_true")
    sys.exit(asyncio.run(_main(parser.parse_args())))


if __name__ == "__main__":
    main()
