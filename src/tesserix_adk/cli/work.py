"""``tesserix submit`` and ``tesserix worker``: runs that carry on by themselves.

``submit`` records a run for a worker to start and prints its id (the same id twice makes
one run). ``worker`` carries every run its agents can carry: decided approvals, runs whose
holder died, submitted runs; it prints one line per run started, carried on, parked and
finished, and on SIGTERM or SIGINT it drains (takes nothing new, stops each run at its
next boundary, releases its leases) and exits 0.

With ``--temporal HOST:PORT --task-queue Q`` both go through Temporal instead: ``submit``
starts the run as an ``AgentWorkflow`` (workflow id = run id), ``worker`` is a Temporal
worker carrying those workflows' activities with the same stores. ``temporalio`` is
imported only then.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import secrets
import signal
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any, TextIO

from tesserix_adk.agent import Agent
from tesserix_adk.cli.failures import ExitCode, UsageError
from tesserix_adk.cli.jsonout import emit, json_text
from tesserix_adk.cli.loading import built_provider, load_agent
from tesserix_adk.cli.text import escaped
from tesserix_adk.errors import AdkError, CheckpointTooLargeError, NoCheckpointError
from tesserix_adk.leases import LeasePolicy
from tesserix_adk.run.cancelling import cancel_requested
from tesserix_adk.run.ids import check_ids
from tesserix_adk.run.runner import AgentRunner
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.timestamps import iso_time
from tesserix_adk.worker import Worker

__all__ = ["WORK_COMMANDS", "add_work_commands", "run_work_command"]

WORK_COMMANDS = frozenset({"submit", "worker", "cancel"})


def add_work_commands(
    sub: Any,
    parents: Any = (),
    *,
    named: Any,
    seconds: Any,
    note: Any = str,
    text: Any = str,
    operator: Any = str,
) -> None:
    """Add ``submit``, ``worker`` and ``cancel`` to ``sub``; ``named``/``seconds``/``note``/
    ``text``/``operator`` read ids, durations, notes, free text and who acts as the other
    commands do."""
    p = sub.add_parser(
        "submit", help="record a run for a worker to start; prints its id", parents=parents
    )
    p.add_argument("--agent", required=True, type=named, help="module:attr of the agent")
    p.add_argument("--tenant", required=True, type=named)
    p.add_argument("--input", required=True, type=text, help="the user's message (stored redacted)")
    p.add_argument("--run-id", type=named, help="the run's id (default: a new one)")
    _add_json(p)
    _add_temporal(p, named)
    p = sub.add_parser(
        "worker",
        help="carry runs on by themselves: decided, lapsed, submitted (SIGTERM drains)",
        parents=parents,
    )
    p.add_argument(
        "--agent",
        required=True,
        action="append",
        type=named,
        help="module:attr of an agent whose runs this worker carries (repeatable)",
    )
    p.add_argument(
        "--provider", type=named, help="module:attr of the model provider (all its runs)"
    )
    p.add_argument("--concurrency", type=_positive_int, default=8, metavar="N")
    p.add_argument(
        "--json", action="store_true", help="one JSON object per line: worker, at, message"
    )
    p.add_argument("--worker", type=named, help="a name for this worker (a suffix is added)")
    p.add_argument("--lease-ttl", type=seconds, default=30.0, metavar="SECONDS")
    p.add_argument(
        "--exit-when-idle", action="store_true", help="exit once nothing is due or running"
    )
    p.add_argument("--poll", type=seconds, default=0.5, metavar="SECONDS", help=argparse.SUPPRESS)
    _add_temporal(p, named)
    p = sub.add_parser(
        "cancel",
        help="cancel a run: its holder stops it at the next boundary (audited)",
        parents=parents,
    )
    p.add_argument("run", metavar="RUN", type=named)
    p.add_argument("--tenant", required=True, type=named)
    p.add_argument("--by", required=True, type=operator, help="who cancels")
    p.add_argument("--reason", type=note, help="why (secrets in it are masked before it is stored)")
    _add_json(p)


def _add_json(p: Any) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _add_temporal(p: Any, named: Any) -> None:
    p.add_argument(
        "--temporal", metavar="HOST:PORT", help="go through this Temporal server (frontend)"
    )
    p.add_argument("--task-queue", type=named, metavar="Q", help="the Temporal task queue")
    p.add_argument("--namespace", type=named, default="default", help="the Temporal namespace")


def _temporal(args: argparse.Namespace) -> Any:
    """The Temporal half of the command line, or ``None`` without ``--temporal``."""
    if args.temporal is None:
        if args.task_queue is not None:
            raise UsageError("--task-queue names a Temporal task queue; give --temporal too")
        return None
    if args.task_queue is None:
        raise UsageError("--temporal needs --task-queue, the queue its workers poll")
    try:
        from tesserix_adk.temporal import commands
    except ImportError as exc:
        raise UsageError(
            'running on Temporal needs temporalio: pip install "tesserix-adk[temporal]"'
        ) from exc
    return commands


# More runs at once than any one process carries: a bound every store's query takes (a
# worker asks its index for about twice this many runs at a time).
MAX_CONCURRENCY = 10_000

# The lease ttls a worker takes, in seconds (see ``_work``).
MIN_LEASE_TTL = 1.0
MAX_LEASE_TTL = 86_400.0


def _positive_int(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a whole number") from None
    if not 1 <= n <= MAX_CONCURRENCY:
        raise argparse.ArgumentTypeError(f"{value!r} is not from 1 to {MAX_CONCURRENCY:,}")
    return n


async def run_work_command(
    args: argparse.Namespace, stores: Stores, agents: Mapping[str, Agent], out: TextIO
) -> ExitCode:
    """Run a parsed ``submit`` or ``worker``."""
    if args.command == "submit":
        return await _submit(args, stores, agents, out)
    if args.command == "cancel":
        return await _cancel(args, stores, out)
    return await _work(args, stores, agents, out)


async def _ended(runner: AgentRunner, tenant: str, run_id: str) -> bool:
    """Whether the run's frontier says it ended (one that cannot be read: not known to)."""
    assert runner.checkpoints is not None
    try:
        cp = await runner.checkpoints.latest(tenant, run_id)
    except AdkError:
        return False
    return cp is not None and cp.status.finished and not cp.is_tombstone


async def _cancel(args: argparse.Namespace, stores: Stores, out: TextIO) -> ExitCode:
    runner = AgentRunner.from_stores(_NoModel(), stores, worker="tesserix-cancel")
    assert runner.checkpoints is not None
    known = await runner.checkpoints.store.latest(args.tenant, args.run)
    if (
        known is None
        and (stores.work is None or await stores.work.input(args.tenant, args.run) is None)
        # A run started in-process holds its lease before its first frontier.
        and await stores.leases.current(args.tenant, args.run) is None
    ):
        raise NoCheckpointError(
            f"nothing is checkpointed or submitted under run {args.run!r} for tenant "
            f"{args.tenant!r}"
        )
    # A run that had ended already (cancelled by someone else too) is left as it is: this
    # cancel records nothing, and says so.
    ended_before = await _ended(runner, args.tenant, args.run)
    asked_before = await cancel_requested(stores.idempotency, args.tenant, args.run)
    unrecoverable: CheckpointTooLargeError | None = None
    try:
        run = await runner.cancel(args.run, tenant=args.tenant, by=args.by, reason=args.reason)
    except CheckpointTooLargeError as exc:
        # A tombstoned run: the cancel is recorded (what was asked), and it says the run
        # cannot be carried on anyway. Not a refusal of the decision.
        run, unrecoverable = None, exc
    # The first request stands (asking again records nothing): say whose it is.
    standing = await cancel_requested(stores.idempotency, args.tenant, args.run)
    by = args.by if standing is None else standing.by
    if standing is not None:
        reason = standing.reason
    else:
        reason = None if args.reason is None else runner.redactor.text(args.reason)
    shown = escaped(args.run)
    held = run is None and await stores.leases.current(args.tenant, args.run) is not None
    if unrecoverable is not None:
        state = "recorded_cannot_carry_on"
        said = (
            f"cancel of run {shown} recorded, by {escaped(by)}; "
            f"{escaped(runner.redactor.text(str(unrecoverable)))}"
        )
    elif run is None and (known is not None or held):
        state = "requested"
        said = (
            f"cancel of run {shown} recorded, by {escaped(by)}; the worker holding it "
            "stops it at its next boundary"
        )
    elif run is None and asked_before is not None:
        state = "already_ended"
        said = (
            f"run {shown} had already been cancelled before it started, by {escaped(by)}; "
            "nothing to cancel"
        )
    elif run is None:
        state = "cancelled_before_start"
        said = f"run {shown} cancelled before it started, by {escaped(by)}"
    elif run.status.value == "cancelled" and not ended_before:
        state = "cancelled"
        said = f"run {shown} cancelled, by {escaped(by)}: {escaped(run.output or '')}"
    else:
        state = "already_ended"
        said = f"run {shown} had already ended {run.status}; nothing to cancel"
    # What became of it, for a caller that runs the command in-process (the console).
    args.cancel_state = state
    if args.json:
        emit(
            out,
            {
                "run_id": args.run,
                "tenant": args.tenant,
                "by": by,
                "reason": reason,
                "state": state,
                "status": None if run is None else run.status.value,
                "at": iso_time(time.time()),
            },
        )
    else:
        out.write(said + "\n")
    return ExitCode.CARRIED_ON


async def _submit(
    args: argparse.Namespace, stores: Stores, agents: Mapping[str, Agent], out: TextIO
) -> ExitCode:
    agent = load_agent(args.agent, agents)
    on_temporal = _temporal(args)
    if on_temporal is not None:
        run_id = args.run_id or f"run_{secrets.token_hex(8)}"
        check_ids(tenant=args.tenant, run_id=run_id)
        started = await on_temporal.submit(
            args.temporal,
            args.namespace,
            agent,
            args.input,
            tenant=args.tenant,
            run_id=run_id,
            task_queue=args.task_queue,
            stores=stores,
        )
        _submitted(args, out, started, agent)
        return ExitCode.CARRIED_ON
    # Submitting calls no model: no provider is built.
    runner = AgentRunner.from_stores(_NoModel(), stores)
    run_id = await runner.submit(agent, args.input, tenant=args.tenant, run_id=args.run_id)
    _submitted(args, out, run_id, agent)
    return ExitCode.CARRIED_ON


def _submitted(args: argparse.Namespace, out: TextIO, run_id: str, agent: Agent) -> None:
    if args.json:
        emit(out, {"run_id": run_id, "tenant": args.tenant, "agent": agent.name})
    else:
        out.write(f"{escaped(run_id)}\n")


class _NoModel:
    async def complete(self, request: Any) -> Any:
        raise AssertionError("submit never calls the model")


async def _work(
    args: argparse.Namespace, stores: Stores, agents: Mapping[str, Agent], out: TextIO
) -> ExitCode:
    loaded = [load_agent(ref, agents) for ref in args.agent]
    names = [a.name for a in loaded]
    if len(set(names)) != len(names):
        raise UsageError(f"two --agent options name agents of the same name: {names}")
    on_temporal = _temporal(args)
    if on_temporal is None and stores.work is None:
        raise UsageError("this store keeps no work index, so no worker can find runs in it")
    if on_temporal is not None and args.exit_when_idle:
        raise UsageError("--exit-when-idle is for workers of the store's own work index")
    ttl = args.lease_ttl
    if not MIN_LEASE_TTL <= ttl <= MAX_LEASE_TTL:
        # Shorter, a pause of the event loop (a collection, a busy CPU) loses every lease
        # and the runs are parked as if their workers died; longer, a SIGKILLed worker
        # strands its runs for more than a day, and a store may not hold the expiry.
        raise UsageError(
            f"--lease-ttl must be from {MIN_LEASE_TTL:g} to {MAX_LEASE_TTL:g} seconds, not {ttl:g}"
        )
    if on_temporal is not None:
        return await _work_on_temporal(on_temporal, args, stores, loaded, out)
    async with built_provider(args.provider, loaded[0], args.agent[0]) as provider:
        runner = AgentRunner.from_stores(
            provider,
            stores,
            worker=args.worker,
            lease_policy=LeasePolicy(ttl=ttl, renew_within=ttl / 3),
            # A worker killed with SIGKILL strands its runs for a lease ttl, no longer.
            resume_claim_ttl=ttl,
        )
        worker = Worker(
            runner,
            loaded,
            concurrency=args.concurrency,
            exit_when_idle=args.exit_when_idle,
            poll_interval=args.poll,
        )
        name = escaped(runner.worker)
        say = _sayer(out, name, json_lines=args.json)
        with _printing(say), _draining_on_signals(worker, say):
            say(
                f"carrying runs of {', '.join(escaped(n) for n in names)}, "
                f"{args.concurrency} at a time, lease ttl {ttl:g} s"
            )
            await worker.run()
        say(f"stopped; {len(worker.carried)} run(s) taken")
    return ExitCode.CARRIED_ON


async def _work_on_temporal(
    on_temporal: Any,
    args: argparse.Namespace,
    stores: Stores,
    loaded: list[Agent],
    out: TextIO,
) -> ExitCode:
    ttl = args.lease_ttl
    async with built_provider(args.provider, loaded[0], args.agent[0]) as provider:
        runner = AgentRunner.from_stores(
            provider,
            stores,
            worker=args.worker,
            lease_policy=LeasePolicy(ttl=ttl, renew_within=ttl / 3),
        )
        name = escaped(runner.worker)
        await on_temporal.serve(
            args.temporal,
            args.namespace,
            runner=runner,
            agents=loaded,
            task_queue=args.task_queue,
            concurrency=args.concurrency,
            out=out,
            name=name,
        )
        out.write(f"worker {name}: stopped\n")
    return ExitCode.CARRIED_ON


Say = Callable[[str], None]


def _sayer(out: TextIO, name: str, *, json_lines: bool) -> Say:
    """One line of the worker's on ``out``: ``worker NAME: text``, or a JSON object."""

    def say(text: str) -> None:
        if json_lines:
            line = {"worker": name, "at": iso_time(time.time()), "message": text}
            out.write(json_text(line) + "\n")
        else:
            out.write(f"worker {name}: {text}\n")
        out.flush()

    return say


class _Saying(logging.Handler):
    def __init__(self, say: Say) -> None:
        super().__init__(logging.INFO)
        self.say = say

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.say(record.getMessage())
        except Exception:
            self.handleError(record)


@contextlib.contextmanager
def _printing(say: Say) -> Any:
    """The worker's own log lines, one per run event."""
    handler = _Saying(say)
    log = logging.getLogger("tesserix_adk.worker")
    before = log.level, log.propagate
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
    try:
        yield
    finally:
        log.removeHandler(handler)
        log.setLevel(before[0])
        log.propagate = before[1]


@contextlib.contextmanager
def _draining_on_signals(worker: Worker, say: Say) -> Any:
    loop = asyncio.get_running_loop()

    def drain(signum: int) -> None:
        if not worker.draining:
            say(f"{signal.Signals(signum).name}: draining (runs stop at their next boundary)")
        worker.drain()

    installed = []
    for signum in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(signum, drain, signum)
            installed.append(signum)
    try:
        yield
    finally:
        for signum in installed:
            loop.remove_signal_handler(signum)
        with contextlib.suppress(Exception):
            sys.stdout.flush()
