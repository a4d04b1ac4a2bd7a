"""A worker process that runs the demo agent and can stop at a chosen point to be killed.

``python -m tesserix_adk.cli.worker --store URL --run R --tenant T --pause WHERE``. It
prints ``PAUSED <where>`` and then blocks (or stops itself with SIGSTOP), so a parent can
kill it at exactly that point. Used by ``tesserix demo`` and the crash tests.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import time
from typing import Any

from tesserix_adk.cli.demo_agent import DELAY_ENV, PAUSE_ENV, PROVIDER, agent
from tesserix_adk.errors import AdkError
from tesserix_adk.leases import LeasePolicy
from tesserix_adk.providers.base import ModelRequest, ModelResponse
from tesserix_adk.runner import AgentRunner
from tesserix_adk.stores.urls import open_stores
from tesserix_adk.testing.faults import FaultyCheckpointStore

PAUSES = ("none", "booked", "in_flight", "model_call", "stop_before_put")


def _pause(where: str) -> bool:
    """Tell the parent where we are, then wait to be killed (or stop until SIGCONT).

    Returns ``False``: the fault hook does not raise, the write goes ahead after SIGCONT.
    """
    sys.stdout.write(f"PAUSED {where}\n")
    sys.stdout.flush()
    if where == "stop_before_put":
        os.kill(os.getpid(), signal.SIGSTOP)  # the parent sends SIGCONT later
        return False
    time.sleep(3600)
    return False


class _Slow:
    """A model that takes its time, so a kill at a random moment lands anywhere in a run."""

    def __init__(self, inner: Any, delay: float) -> None:
        self.inner = inner
        self.delay = delay

    async def complete(self, request: ModelRequest) -> ModelResponse:
        await asyncio.sleep(self.delay)
        response: ModelResponse = await self.inner.complete(request)
        return response


def _at(body: dict[str, Any], boundary: str) -> bool:
    return body.get("boundary") == boundary and body.get("iteration") == 1


async def _main(args: argparse.Namespace) -> int:
    # On stderr, so the PAUSED/RESULT protocol on stdout stays as it is: a parent timing a
    # kill from here lands it inside the run, not in interpreter start-up.
    sys.stderr.write("STARTED\n")
    sys.stderr.flush()
    stores = open_stores(args.store)
    store = FaultyCheckpointStore(stores.checkpoints)
    if args.pause == "booked":  # book_seat completed; its after_tool_result not yet written
        store.crash_before = lambda b: _at(b, "after_tool_result") and _pause("booked")
    elif args.pause == "model_call":  # the model asked for book_seat; frontier written
        store.crash_after = lambda b: _at(b, "after_model_call") and _pause("model_call")
    elif args.pause == "stop_before_put":
        store.crash_before = lambda b: (
            _at(b, "after_tool_result") and bool(_pause("stop_before_put"))
        )
    elif args.pause == "in_flight":
        os.environ[PAUSE_ENV] = "in_flight"
    stores.checkpoints = store
    ttl = args.lease_ttl
    provider: Any = PROVIDER()
    if args.delay:
        provider = _Slow(provider, args.delay)
        os.environ[DELAY_ENV] = str(args.delay)
    runner = AgentRunner.from_stores(
        provider,
        stores,
        lease_policy=LeasePolicy(ttl=ttl, renew_within=ttl / 2),
        worker=args.worker,
        resume_claim_ttl=args.claim_ttl,
    )
    try:
        if args.resume:
            run = await runner.resume(agent, args.run, tenant=args.tenant)
        else:
            run = await runner.run(agent, args.input, tenant=args.tenant, run_id=args.run)
    except AdkError as exc:
        sys.stdout.write(f"ERROR {type(exc).__name__}: {exc}\n")
        return 4
    finally:
        await stores.aclose()
    sys.stdout.write(f"RESULT {run.status} fence={run.fence}\n")
    return 0


def main() -> int:
    """Parse the command line and run."""
    parser = argparse.ArgumentParser(prog="tesserix-worker")
    parser.add_argument("--store", required=True)
    parser.add_argument("--run", required=True)
    parser.add_argument("--tenant", default="demo")
    parser.add_argument("--input", default="Book me a seat from Frankfurt to New York.")
    parser.add_argument("--pause", choices=PAUSES, default="none")
    parser.add_argument("--lease-ttl", type=float, default=30.0)
    parser.add_argument("--worker", default="demo-worker")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--claim-ttl", type=float, default=300.0)
    parser.add_argument(
        "--delay", type=float, default=0.0, help="seconds each model call and tool takes"
    )
    return asyncio.run(_main(parser.parse_args()))


if __name__ == "__main__":
    raise SystemExit(main())
