"""A runner process for the crash tests: the booking agent over the test MCP server (stdio).

``python agent_process.py STORE_URL RUN_ID EFFECTS_DB [--hold DIR] [--hold-tool NAME]
[--resume] [--reconcile]`` runs (or resumes) the run and prints ``RESULT <status>`` or
``ERROR <type>: <message>``. ``--hold`` makes the server hold inside ``book_seat`` (or
``--hold-tool``) for the parent to kill this process there; ``--reconcile`` gives
``book_seat`` a reconciler that asks the server, by the call's idempotency key, whether the
booking was made.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from typing import Any

from tesserix_adk import (
    Agent,
    AgentRunner,
    LeasePolicy,
    Reconciled,
    ScriptedProvider,
    open_stores,
)
from tesserix_adk.errors import AdkError
from tesserix_adk.mcp import MCPToolOverride, MCPToolset

SERVER = str(Path(__file__).with_name("server.py"))
TENANT = "acme"
TURNS: list[Any] = [
    [("find_flights", {"origin": "FRA", "dest": "JFK"})],
    [("book_seat", {"flight": "LH123"})],
    "Booked.",
]


def _toolset(args: argparse.Namespace) -> MCPToolset:
    async def by_key(call: Any, ctx: Any) -> Reconciled:
        found = await toolset.call("booking_for", {"key": ctx.idempotency_key})
        return Reconciled.never_ran() if found == "none" else Reconciled.completed(found)

    env = {"MCP_EFFECTS_DB": args.effects}
    if args.hold:
        env["MCP_HOLD_DIR"] = args.hold
        env["MCP_HOLD_TOOL"] = args.hold_tool
    overrides = {"book_seat": MCPToolOverride(reconcile=by_key)} if args.reconcile else None
    toolset = MCPToolset.stdio(sys.executable, [SERVER], env=env, overrides=overrides)
    return toolset


async def _main(args: argparse.Namespace) -> int:
    async with open_stores(args.store) as stores, _toolset(args) as toolset:
        await stores.create_schema()
        agent = Agent("booking", "Book.", toolset.tools)
        # A ttl of 3 s renewed 2 s ahead: a loaded machine (the suite runs in two processes)
        # can stall this loop past half a second, and a resume waits out a dead holder's
        # lease of at most 3 s.
        runner = AgentRunner.from_stores(
            ScriptedProvider(TURNS), stores, lease_policy=LeasePolicy(ttl=3.0, renew_within=2.0)
        )
        deadline = time.monotonic() + 20
        while True:
            try:
                if args.resume:
                    run = await runner.resume(agent, args.run, tenant=TENANT)
                else:
                    run = await runner.run(agent, "book", tenant=TENANT, run_id=args.run)
                break
            except AdkError as exc:
                # The dead holder's lease lapses within its ttl: a retryable refusal waits.
                if exc.retryable and time.monotonic() < deadline:
                    await asyncio.sleep(0.1)
                    continue
                print(f"ERROR {type(exc).__name__}: {exc}", flush=True)
                return 4
    print(f"RESULT {run.status}", flush=True)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("store")
    parser.add_argument("run")
    parser.add_argument("effects")
    parser.add_argument("--hold")
    parser.add_argument("--hold-tool", default="book_seat")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--reconcile", action="store_true")
    return asyncio.run(_main(parser.parse_args()))


if __name__ == "__main__":
    raise SystemExit(main())
