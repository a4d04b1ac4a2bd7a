"""The operator commands: ``frontier_main`` (look, decide) and ``resume_main`` (carry on).

Both take ``argv`` and already-opened ``Stores``, return an ``ExitCode`` and never call
``sys.exit``, so an embedding product can wire them under its own command name. Every error
is one sentence on stderr; a script reads the exit code:

    0 carried on (or printed what was asked)      3 not now: held elsewhere / store down
    1 nothing checkpointed under that id          4 must not be carried on
    2 a command line it could not read
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import sys
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from enum import IntEnum
from typing import Any, NoReturn, TextIO

from tesserix_adk.agent import Agent
from tesserix_adk.checkpoint.payload import Checkpoint, encode_outcome
from tesserix_adk.checkpoint.planning import ResumePlan, plan_resume
from tesserix_adk.checkpoint.redaction import Redactor
from tesserix_adk.cli.describe import describe
from tesserix_adk.errors import (
    AdkError,
    CheckpointCorruptError,
    CheckpointFormatError,
    CheckpointTooLargeError,
    ConfigurationError,
    DivergedRunError,
    HistoryUnavailableError,
    IndeterminateToolCallError,
    LeaseError,
    NoCheckpointError,
    ResumeConflictError,
    RevisionMismatchError,
    RunFailedError,
    StaleFenceError,
    StoreUnavailableError,
)
from tesserix_adk.messages import ToolOutcome
from tesserix_adk.providers.base import Provider
from tesserix_adk.runner import AgentRunner, RunStatus
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.stores.protocols import IdempotencyRecord, RecordStatus

__all__ = ["ExitCode", "UsageError", "frontier_main", "load_agent", "load_provider", "resume_main"]


class ExitCode(IntEnum):
    """What a script reads from a command."""

    CARRIED_ON = 0
    NOTHING_CHECKPOINTED = 1
    USAGE = 2
    HELD = 3
    MUST_NOT_CARRY_ON = 4


class UsageError(Exception):
    """A command line that could not be read (exit 2)."""


class _Parser(argparse.ArgumentParser):
    """argparse that raises instead of exiting, so callers get an exit code back."""

    def error(self, message: str) -> NoReturn:
        # "tesserix: inspect: ..." rather than "tesserix: tesserix inspect: ...".
        where = self.prog.partition(" ")[2]
        raise UsageError(f"{where}: {message}" if where else message)

    def exit(self, status: int = 0, message: str | None = None) -> NoReturn:
        if message:
            raise UsageError(message.strip())
        raise _HelpShown


class _HelpShown(Exception):
    pass


# --- frontier_main: look and decide, never carry on ---------------------------------------


def frontier_main(
    argv: Sequence[str], *, stores: Stores, out: TextIO | None = None, err: TextIO | None = None
) -> int:
    """``inspect``, ``runs``, ``steps``, ``approve``, ``resolve``, ``schema``."""
    out = out or sys.stdout
    err = err or sys.stderr
    parser = _frontier_parser()
    return _run(lambda: _frontier(parser.parse_args(list(argv)), stores, out), stores, err, out)


def _frontier_parser(prog: str = "tesserix") -> _Parser:
    parser = _Parser(prog=prog, description="Inspect and decide on checkpointed runs.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    p = sub.add_parser("inspect", help="show a run's frontier and plan (takes no lease)")
    p.add_argument("run")
    p.add_argument("--tenant", required=True)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p = sub.add_parser("runs", help="list a tenant's runs")
    p.add_argument("--tenant", required=True)
    p.add_argument("--stuck", action="store_true", help="only runs in flight, lease lapsed")
    p = sub.add_parser("steps", help="list a run's step snapshots")
    p.add_argument("run")
    p.add_argument("--tenant", required=True)
    p = sub.add_parser("approve", help="decide an approval request")
    p.add_argument("request")
    p.add_argument("--tenant", required=True)
    p.add_argument("--by", required=True)
    p.add_argument("--deny", action="store_true")
    p.add_argument("--note")
    p = sub.add_parser("resolve", help="record what an indeterminate call did")
    p.add_argument("run")
    p.add_argument("--tenant", required=True)
    p.add_argument("--call", required=True, help="provider call id or idempotency key")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--outcome", help="the call's outcome as JSON")
    what.add_argument("--never-ran", action="store_true")
    p.add_argument("--by", required=True)
    p = sub.add_parser("schema", help="show or apply the store's schema")
    p.add_argument("action", choices=["show", "apply"])
    return parser


async def _frontier(args: argparse.Namespace, stores: Stores, out: TextIO) -> ExitCode:
    command = args.command
    if command == "inspect":
        return await _inspect(args, stores, out)
    if command == "runs":
        return await _runs(args, stores, out)
    if command == "steps":
        return await _steps(args, stores, out)
    if command == "approve":
        return await _approve(args, stores, out)
    if command == "resolve":
        return await _resolve(args, stores, out)
    return await _schema(args, stores, out)


async def _inspect(args: argparse.Namespace, stores: Stores, out: TextIO) -> ExitCode:
    checkpointer = stores.checkpointer()
    cp = await checkpointer.latest(args.tenant, args.run)
    if cp is None:
        raise NoCheckpointError(
            f"nothing is checkpointed under run {args.run!r} for tenant {args.tenant!r}"
        )
    plan = await plan_resume(cp, stores.idempotency)
    spent = await stores.ledger.spent(args.tenant, args.run)
    lease = await stores.leases.current(args.tenant, args.run)
    if args.json:
        out.write(json.dumps(_as_json(cp, plan, spent, lease), indent=2, default=str) + "\n")
        return ExitCode.CARRIED_ON
    out.write(describe(cp, plan=plan, spent=spent) + "\n")
    if lease is not None:
        out.write(f"held by {lease.holder} (fence {lease.fence})\n")
    return ExitCode.CARRIED_ON


def _as_json(cp: Checkpoint, plan: ResumePlan, spent: int, lease: Any) -> dict[str, Any]:
    return {
        "run_id": cp.run_id,
        "tenant": cp.tenant,
        "agent": cp.agent_name,
        "revision": cp.agent_revision,
        "status": str(cp.status),
        "step": cp.step,
        "boundary": None if cp.boundary is None else str(cp.boundary),
        "iteration": cp.iteration,
        "usage": {"input_tokens": cp.usage.input_tokens, "output_tokens": cp.usage.output_tokens},
        "spent_micros": spent,
        "pending_approval": None if cp.pending_approval is None else cp.pending_approval.id,
        "reason": cp.reason,
        "replay_of": cp.replay_of,
        "lease": None if lease is None else {"holder": lease.holder, "fence": lease.fence},
        "safe": plan.safe,
        "calls": [
            {
                "tool": p.tool,
                "call_id": p.call_id,
                "key": p.key,
                "disposition": str(p.disposition),
                "reason": p.reason,
                "ahead": p.ahead,
            }
            for p in plan.calls
        ],
    }


async def _runs(args: argparse.Namespace, stores: Stores, out: TextIO) -> ExitCode:
    checkpointer = stores.checkpointer()
    for run_id in await stores.checkpoints.runs(args.tenant):
        try:
            cp = await checkpointer.latest(args.tenant, run_id)
        except (CheckpointCorruptError, CheckpointFormatError) as exc:
            out.write(f"{run_id}  unreadable: {exc}\n")
            continue
        if cp is None:
            continue
        lease = await stores.leases.current(args.tenant, run_id)
        records = await stores.idempotency.records(args.tenant, run_id)
        in_flight = [
            r for r in records if r.tool is not None and r.status is RecordStatus.in_flight
        ]
        if args.stuck and (cp.status.finished or lease is not None or not in_flight):
            continue
        held = f"  held by {lease.holder} (fence {lease.fence})" if lease else ""
        flight = f"  {len(in_flight)} call(s) in flight" if in_flight else ""
        where = f"{cp.status} at step {cp.step}"
        out.write(f"{run_id}  {cp.agent_name}  {where}{flight}{held}\n")
    return ExitCode.CARRIED_ON


async def _steps(args: argparse.Namespace, stores: Stores, out: TextIO) -> ExitCode:
    steps = await stores.checkpoints.steps(args.tenant, args.run)
    if not steps:
        raise NoCheckpointError(
            f"nothing is checkpointed under run {args.run!r} for tenant {args.tenant!r}"
        )
    checkpointer = stores.checkpointer()
    out.write("step  boundary           iteration  status            written              bytes\n")
    for step in steps:
        stored = await stores.checkpoints.at(args.tenant, args.run, step)
        if stored is None:
            continue
        try:
            cp = await checkpointer.at(args.tenant, args.run, step)
        except (CheckpointCorruptError, CheckpointFormatError) as exc:
            out.write(f"{step:<5} unreadable: {exc}\n")
            continue
        assert cp is not None
        written = (
            "-"
            if cp.written_at is None
            else time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(cp.written_at))
        )
        boundary = "-" if cp.boundary is None else str(cp.boundary)
        out.write(
            f"{step:<5} {boundary:<18} {cp.iteration:<10} {cp.status!s:<17} {written:<20} "
            f"{len(stored.payload)}\n"
        )
    return ExitCode.CARRIED_ON


async def _approve(args: argparse.Namespace, stores: Stores, out: TextIO) -> ExitCode:
    request = await stores.approvals.get(args.tenant, args.request)
    if request is None:
        raise NoCheckpointError(
            f"no approval request {args.request!r} belongs to tenant {args.tenant!r}"
        )
    try:
        decided = await stores.approvals.decide(
            args.tenant, args.request, approved=not args.deny, by=args.by, note=args.note
        )
    except ValueError as exc:
        raise _Refused(
            f"approval request {args.request!r} was already decided the other way: {exc}"
        ) from exc
    out.write(
        f"approval {decided.id} {decided.status} by {decided.by} for run {decided.run_id}; "
        f"carry it on with `tesserix run --resume {decided.run_id} --tenant {args.tenant}`\n"
    )
    return ExitCode.CARRIED_ON


async def _resolve(args: argparse.Namespace, stores: Stores, out: TextIO) -> ExitCode:
    records = await stores.idempotency.records(args.tenant, args.run)
    matches = [r for r in records if r.tool is not None and args.call in (r.call_id, r.key)]
    if not matches:
        raise NoCheckpointError(
            f"run {args.run!r} of tenant {args.tenant!r} has no call {args.call!r} on record"
        )
    if len(matches) > 1:
        raise UsageError(
            f"call id {args.call!r} matches {len(matches)} records; pass the idempotency key "
            f"instead ({', '.join(r.key for r in matches)})"
        )
    record: IdempotencyRecord = matches[0]
    lease = await stores.leases.current(args.tenant, args.run)
    if lease is not None:
        # A live worker may still be running the call and about to record its outcome.
        raise ResumeConflictError(
            f"run {args.run!r} is held by {lease.holder} (fence {lease.fence}); resolve a call "
            "only once nobody carries the run",
            holder=lease.holder,
        )
    if record.status is not RecordStatus.in_flight:
        raise _Refused(f"{record.tool} ({args.call}) is not in flight; it is {record.status}")
    if args.never_ran:
        await stores.idempotency.resolve(record.key, never_ran=True, by=args.by)
        out.write(f"recorded: {record.tool} ({args.call}) never ran, by {args.by}\n")
        return ExitCode.CARRIED_ON
    try:
        content = json.loads(args.outcome)
    except ValueError as exc:
        raise UsageError(f"--outcome is not valid JSON: {exc}") from exc
    encoded = encode_outcome(ToolOutcome(call_id=record.call_id or "", content=content), Redactor())
    await stores.idempotency.resolve(record.key, encoded, by=args.by)
    out.write(
        f"recorded: {record.tool} ({args.call}) completed with the given outcome, by {args.by}\n"
    )
    return ExitCode.CARRIED_ON


async def _schema(args: argparse.Namespace, stores: Stores, out: TextIO) -> ExitCode:
    if args.action == "show":
        out.write((stores.schema or "-- this store has no schema to apply\n").rstrip() + "\n")
        return ExitCode.CARRIED_ON
    await stores.create_schema()
    out.write("schema applied\n")
    return ExitCode.CARRIED_ON


# --- resume_main: carry a run on ----------------------------------------------------------


def resume_main(
    argv: Sequence[str],
    *,
    stores: Stores,
    agents: Mapping[str, Agent],
    out: TextIO | None = None,
    err: TextIO | None = None,
) -> int:
    """``run --resume RUN`` (and ``replay``): take the lease and carry the run on."""
    out = out or sys.stdout
    err = err or sys.stderr
    parser = _resume_parser()
    return _run(
        lambda: _resume(parser.parse_args(list(argv)), stores, agents, out), stores, err, out
    )


def _resume_parser(prog: str = "tesserix") -> _Parser:
    parser = _Parser(prog=prog, description="Carry checkpointed runs on.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    p = sub.add_parser("run", help="carry a run on from its frontier")
    p.add_argument("--resume", metavar="RUN", help="the run to carry on")
    p.add_argument("--tenant", required=True)
    p.add_argument("--agent", required=True, help="a name known to the product, or module:attr")
    p.add_argument("--provider", help="module:attr of the model provider")
    p.add_argument("--worker", help="a name for this worker (a random suffix is added)")
    p = sub.add_parser("replay", help="run forward from a past step as a new run (debugging)")
    p.add_argument("run")
    p.add_argument("--tenant", required=True)
    p.add_argument("--from-step", type=int, required=True)
    p.add_argument("--agent", required=True, help="a name known to the product, or module:attr")
    p.add_argument("--provider", help="module:attr of the model provider")
    p.add_argument(
        "--stub",
        action="append",
        default=[],
        metavar="TOOL=module:attr",
        help="replace a tool with a stub (repeatable)",
    )
    p.add_argument(
        "--live",
        action="append",
        default=[],
        metavar="TOOL",
        help="let a side-effecting tool run for real (repeatable; never in production)",
    )
    p.add_argument("--new-run-id")
    return parser


async def _resume(
    args: argparse.Namespace, stores: Stores, agents: Mapping[str, Agent], out: TextIO
) -> ExitCode:
    if args.command == "replay":
        return await _replay(args, stores, agents, out)
    if not args.resume:
        raise UsageError("`run` only carries existing runs on: pass --resume RUN")
    agent = load_agent(args.agent, agents)
    provider = load_provider(args.provider, agent, args.agent)
    runner = AgentRunner(
        provider,
        idempotency=stores.idempotency,
        checkpoints=stores.checkpointer(),
        leases=stores.leases,
        ledger=stores.ledger,
        approvals=stores.approvals,
        worker=args.worker,
    )
    spent = await stores.ledger.spent(args.tenant, args.resume)

    def found(cp: Checkpoint, plan: ResumePlan | None, fence: int | None) -> None:
        out.write(describe(cp, plan=plan, spent=spent) + "\n")
        holding = f"fence {fence}" if fence is not None else "no lease store"
        out.write(f"holding the run as {runner.holder} ({holding})\n")
        out.flush()

    run = await runner.resume(agent, args.resume, tenant=args.tenant, on_frontier=found)
    tail = f": {run.output}" if run.output else ""
    if run.pending_approval is not None:
        tail = f": waiting on approval {run.pending_approval.id}"
    out.write(f"now {run.status} at iteration {run.iteration}, {run.spent_micros} micros{tail}\n")
    if run.status is RunStatus.failed:
        return ExitCode.MUST_NOT_CARRY_ON
    return ExitCode.CARRIED_ON


async def _replay(
    args: argparse.Namespace, stores: Stores, agents: Mapping[str, Agent], out: TextIO
) -> ExitCode:
    agent = load_agent(args.agent, agents)
    provider = load_provider(args.provider, agent, args.agent)
    stubs: dict[str, Callable[..., Any]] = {}
    for spec in args.stub:
        name, sep, ref = spec.partition("=")
        if not sep or not name or not ref:
            raise UsageError(f"--stub {spec!r} is not of the form TOOL=module:attr")
        stub = _import_ref(ref, "stub")
        if not callable(stub):
            raise UsageError(f"--stub {spec}: {ref} is not callable")
        stubs[name] = stub
    runner = AgentRunner(
        provider,
        idempotency=stores.idempotency,
        checkpoints=stores.checkpointer(),
        leases=stores.leases,
        ledger=stores.ledger,
        approvals=stores.approvals,
        worker="replay",
    )
    run = await runner.replay(
        agent,
        args.run,
        tenant=args.tenant,
        from_step=args.from_step,
        stubs=stubs,
        live=tuple(args.live),
        new_run_id=args.new_run_id,
    )
    tail = f": {run.output}" if run.output else ""
    out.write(
        f"replay {run.run_id} (replay of {run.replay_of}) now {run.status} at iteration "
        f"{run.iteration}{tail}\n"
    )
    return ExitCode.CARRIED_ON


# --- loading agents and providers ---------------------------------------------------------


def load_agent(ref: str, agents: Mapping[str, Agent]) -> Agent:
    """An agent by name from ``agents``, else by ``module:attr`` (cwd importable)."""
    if ref in agents:
        return agents[ref]
    value = _import_ref(ref, "agent")
    if not isinstance(value, Agent):
        raise UsageError(f"--agent {ref} is a {type(value).__name__}, not an Agent")
    return value


def load_provider(ref: str | None, agent: Agent, agent_ref: str) -> Provider:
    """``--provider module:attr``, else the agent module's ``PROVIDER``, else ``agent.model``."""
    value: Any = None
    if ref is not None:
        value = _import_ref(ref, "provider")
    elif ":" in agent_ref:
        module = _import_module(agent_ref.split(":", 1)[0], "agent")
        value = getattr(module, "PROVIDER", None)
    if value is None and agent.model:
        value = _provider_from_model(agent.model)
    if value is None:
        raise UsageError(
            f"no model provider for agent {agent.name!r}: pass --provider module:attr, or set "
            "PROVIDER in the agent's module, or give the agent a model like 'openai:gpt-4o'"
        )
    if isinstance(value, type) or (callable(value) and not hasattr(value, "complete")):
        try:
            value = value()
        except Exception as exc:  # e.g. an API key that is not set
            raise UsageError(
                f"the provider for agent {agent.name!r} could not be built: {exc}"
            ) from exc
    if not hasattr(value, "complete"):
        raise UsageError(f"the provider for agent {agent.name!r} has no complete() method")
    provider: Provider = value
    return provider


def _provider_from_model(model: str) -> Any:
    vendor, _, name = model.partition(":")
    if vendor == "openai":
        module = _import_module("tesserix_adk.providers.openai", "provider")
        return module.OpenAIProvider(name)
    if vendor == "anthropic":
        module = _import_module("tesserix_adk.providers.anthropic", "provider")
        return module.AnthropicProvider(name)
    return None


def _import_ref(ref: str, what: str) -> Any:
    module_name, sep, attr = ref.partition(":")
    if not sep or not module_name or not attr:
        raise UsageError(f"--{what} {ref!r} is not of the form module:attr")
    module = _import_module(module_name, what)
    value: Any = module
    for part in attr.split("."):
        try:
            value = getattr(value, part)
        except AttributeError:
            raise UsageError(f"--{what} {ref}: {module_name} has no attribute {attr!r}") from None
    return value


def _import_module(name: str, what: str) -> Any:
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise UsageError(f"cannot load the {what} module {name!r}: {exc}") from exc
    except Exception as exc:  # its import raised: still not something we can run
        raise UsageError(f"loading the {what} module {name!r} failed: {exc!r}") from exc


# --- errors to exit codes -----------------------------------------------------------------


class _Refused(Exception):
    """A decision that conflicts with one already made (exit 4)."""


_HELD = (ResumeConflictError, LeaseError, StoreUnavailableError, StaleFenceError)
_MUST_NOT = (
    IndeterminateToolCallError,
    DivergedRunError,
    HistoryUnavailableError,
    CheckpointFormatError,
    CheckpointCorruptError,
    CheckpointTooLargeError,
    RevisionMismatchError,
    RunFailedError,
)


def exit_code_for(exc: BaseException) -> ExitCode:
    """The documented exit code of an error."""
    if isinstance(exc, UsageError):
        return ExitCode.USAGE
    if isinstance(exc, NoCheckpointError):
        return ExitCode.NOTHING_CHECKPOINTED
    if isinstance(exc, _HELD):
        return ExitCode.HELD
    if isinstance(exc, (*_MUST_NOT, _Refused)):
        return ExitCode.MUST_NOT_CARRY_ON
    if isinstance(exc, ConfigurationError):
        # A store file or schema that does not exist: nothing can be checkpointed there.
        if "schema apply" in str(exc):
            return ExitCode.NOTHING_CHECKPOINTED
        return ExitCode.USAGE
    if isinstance(exc, AdkError) and exc.retryable:
        return ExitCode.HELD
    return ExitCode.MUST_NOT_CARRY_ON


def _run(body: Callable[[], Awaitable[ExitCode]], stores: Stores, err: TextIO, out: TextIO) -> int:
    import asyncio

    async def main() -> ExitCode:
        # Connections belong to this event loop: close them before it ends.
        try:
            return await body()
        finally:
            await stores.aclose()

    try:
        return int(asyncio.run(main()))
    except _HelpShown:
        return int(ExitCode.CARRIED_ON)
    except KeyboardInterrupt:
        err.write("tesserix: interrupted\n")
        return 130
    except Exception as exc:
        code = exit_code_for(exc)
        err.write(_sentence(exc) + "\n")
        if os.environ.get("ADK_DEBUG"):
            import traceback

            traceback.print_exception(exc, file=err)
        return int(code)
    finally:
        with contextlib.suppress(Exception):
            out.flush()


def _sentence(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    if isinstance(exc, (AdkError, UsageError, _Refused)):
        return "tesserix: " + text
    return f"tesserix: {type(exc).__name__}: {text}"
