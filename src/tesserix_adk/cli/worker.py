"""A worker process that runs the demo agent and can stop at a chosen point to be killed.

``python -m tesserix_adk.cli.worker --store URL --run R --tenant T --pause WHERE``. It
prints ``PAUSED <where>`` and then blocks (or stops itself with SIGSTOP), so a parent can
kill it at exactly that point. Used by ``tesserix demo`` and the crash tests.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

from tesserix_adk.cli.demo_agent import DELAY_ENV, PAUSE_ENV, PROVIDER, agent
from tesserix_adk.errors import AdkError
from tesserix_adk.leases import LeasePolicy
from tesserix_adk.providers.base import ModelRequest, ModelResponse
from tesserix_adk.runner import AgentRunner
from tesserix_adk.stores.protocols import CheckpointStore, StoredCheckpoint
from tesserix_adk.stores.urls import open_stores

PAUSES = (
    "none",
    "booked",
    "in_flight",
    "model_call",
    "in_group",
    "stop_before_put",
    "asked_again",
    "first_model_call",
)


def _pause(where: str) -> bool:
    """Tell the parent where we are, then wait to be killed (or stop until SIGCONT).

    Returns ``False``; after SIGCONT the write goes ahead.
    """
    sys.stdout.write(f"PAUSED {where}\n")
    sys.stdout.flush()
    if where == "stop_before_put":
        os.kill(os.getpid(), signal.SIGSTOP)  # the parent sends SIGCONT later
        return False
    time.sleep(3600)
    return False


PayloadHook = Callable[[dict[str, Any]], object]


class PausingCheckpointStore:
    """The demo's one fault point: a checkpoint store that calls a hook around each put.

    ``before`` is called with the decoded payload before it is written, ``after`` once it
    is; a hook that pauses (``_pause``) holds the process at that write for the parent to
    kill. Kept here rather than borrowed from ``tesserix_adk.testing``, so the shipped demo
    needs none of the test helpers. Every other method delegates; the combined
    frontier+transcript write is left out on purpose, so each frontier passes through ``put``.
    """

    def __init__(
        self,
        inner: CheckpointStore,
        *,
        before: PayloadHook | None = None,
        after: PayloadHook | None = None,
    ) -> None:
        self.inner = inner
        self.before = before
        self.after = after

    async def put(
        self, tenant: str, run_id: str, payload: bytes, *, step: int, fence: int | None = None
    ) -> None:
        """Put, with the hooks around it."""
        body = json.loads(payload) if self.before or self.after else {}
        if self.before is not None:
            self.before(body)
        await self.inner.put(tenant, run_id, payload, step=step, fence=fence)
        if self.after is not None:
            self.after(body)

    async def latest(self, tenant: str, run_id: str) -> StoredCheckpoint | None:
        """Delegates."""
        return await self.inner.latest(tenant, run_id)

    def __getattr__(self, name: str) -> Any:
        # The optional capabilities (step history, run listing, write groups) are the inner
        # store's own: offered here exactly when it offers them, so an isinstance check
        # tells the truth.
        if name in ("write_group", "joins"):
            return getattr(self.inner, name)
        if name not in ("at", "steps", "runs"):
            raise AttributeError(name)
        inner = getattr(self.inner, name)  # AttributeError: the inner store lacks it too

        async def delegated(*args: Any, **kwargs: Any) -> Any:
            return await inner(*args, **kwargs)

        return delegated

    async def forget(self, tenant: str, run_id: str) -> None:
        """Delegates."""
        await self.inner.forget(tenant, run_id)

    async def seal(self, tenant: str, run_id: str, fence: int) -> None:
        """Delegates."""
        await self.inner.seal(tenant, run_id, fence)


def pausing(inner: CheckpointStore, where: str) -> PausingCheckpointStore:
    """``inner`` with the pause ``where`` (one of ``PAUSES``) set on its puts.

    Wrapped even with no pause, so every demo run writes its frontiers the same way.
    """
    if where == "booked":  # book_seat completed; its after_tool_result not yet written
        return PausingCheckpointStore(
            inner, before=lambda b: _at(b, "after_tool_result") and _pause("booked")
        )
    if where == "model_call":  # the model asked for book_seat; frontier written
        return PausingCheckpointStore(
            inner, after=lambda b: _at(b, "after_model_call") and _pause("model_call")
        )
    if where == "in_group":  # that frontier in the turn's write group, not yet committed
        return PausingCheckpointStore(
            inner, after=lambda b: _at(b, "after_model_call") and _pause("in_group")
        )
    if where == "stop_before_put":
        return PausingCheckpointStore(
            inner, before=lambda b: _at(b, "after_tool_result") and _pause("stop_before_put")
        )
    return PausingCheckpointStore(inner)


class _Slow:
    """A model that takes its time, so a kill at a random moment lands anywhere in a run."""

    def __init__(self, inner: Any, delay: float) -> None:
        self.inner = inner
        self.delay = delay

    async def complete(self, request: ModelRequest) -> ModelResponse:
        await asyncio.sleep(self.delay)
        response: ModelResponse = await self.inner.complete(request)
        return response


class _PausingModel:
    """A model that pauses the worker when asked the ``at``-th time: by default the third,
    once book_seat's turn (its outcome and ``after_tool_result``) is durable, as everything
    is before the model is asked again; the first, before anything is checkpointed."""

    def __init__(self, inner: Any, where: str, at: int = 3) -> None:
        self.inner = inner
        self.where = where
        self.at = at
        self.asked = 0

    async def complete(self, request: ModelRequest) -> ModelResponse:
        self.asked += 1
        if self.asked == self.at:
            _pause(self.where)
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
    if args.pause == "in_flight":
        os.environ[PAUSE_ENV] = "in_flight"
    stores.checkpoints = pausing(stores.checkpoints, args.pause)
    ttl = args.lease_ttl
    provider: Any = PROVIDER()
    if args.delay:
        provider = _Slow(provider, args.delay)
        os.environ[DELAY_ENV] = str(args.delay)
    if args.pause == "asked_again":
        provider = _PausingModel(provider, args.pause)
    elif args.pause == "first_model_call":
        # Before anything of the run is checkpointed: only its submission is kept.
        provider = _PausingModel(provider, args.pause, at=1)
    runner = AgentRunner.from_stores(
        provider,
        stores,
        lease_policy=LeasePolicy(ttl=ttl, renew_within=ttl / 2),
        worker=args.worker,
        resume_claim_ttl=args.claim_ttl,
        # Writes grouped only when asked (as AgentRunner's default), and always for the
        # "in_group" pause, which kills the worker inside a turn's open group.
        group_writes=args.group_writes or args.pause == "in_group",
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
    parser.add_argument("--group-writes", action="store_true")
    parser.add_argument("--claim-ttl", type=float, default=300.0)
    parser.add_argument(
        "--delay", type=float, default=0.0, help="seconds each model call and tool takes"
    )
    return asyncio.run(_main(parser.parse_args()))


if __name__ == "__main__":
    raise SystemExit(main())
