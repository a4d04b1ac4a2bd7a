"""``tesserix run --resume RUN`` (optionally ``--accept-revision --by NAME``) and
``tesserix replay``: the commands that carry a run on."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from typing import Any, TextIO

from tesserix_adk.agent import Agent
from tesserix_adk.checkpoint.checkpointer import Checkpointer, state_from_json
from tesserix_adk.checkpoint.payload import Checkpoint, CheckpointStatus
from tesserix_adk.checkpoint.payload.submission import decode_submission
from tesserix_adk.checkpoint.planning import ResumePlan
from tesserix_adk.cli.describe import describe
from tesserix_adk.cli.failures import ExitCode, UsageError, output_closed
from tesserix_adk.cli.inspecting import asked_approval
from tesserix_adk.cli.jsonout import emit, when
from tesserix_adk.cli.loading import ProviderSource, built_provider, import_ref, load_agent
from tesserix_adk.cli.reasons import no_frontier, parked_item
from tesserix_adk.cli.text import escaped
from tesserix_adk.errors import ResumeConflictError, RunFailedError, RunStartedError
from tesserix_adk.run.holding import carried_now, lease_lapses
from tesserix_adk.run.result import Run
from tesserix_adk.run.upgrade import RevisionAcceptance, accept_revision
from tesserix_adk.runner import AgentRunner, RunStatus
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.stores.capabilities import ledger_totals

__all__ = ["run_resume_command"]


async def run_resume_command(
    args: argparse.Namespace,
    stores: Stores,
    agents: Mapping[str, Agent],
    out: TextIO,
    *,
    provider: ProviderSource = None,
) -> ExitCode:
    """Run the parsed ``run``/``replay``; ``provider`` is the product's (``resume_main``)."""
    if args.command == "replay":
        return await _replay(args, stores, agents, out, provider)
    if not args.resume:
        raise UsageError("`run` only carries existing runs on: pass --resume RUN")
    accepting = getattr(args, "accept_revision", False)
    if accepting and not args.by:
        raise UsageError("--accept-revision needs --by NAME: who accepts the change")
    if not accepting and (args.by or args.note):
        raise UsageError("--by and --note go with --accept-revision")
    as_json = getattr(args, "json", False)
    agent = load_agent(args.agent, agents)
    seen = await Checkpointer.from_stores(stores).latest(args.tenant, args.resume)
    submitted = None
    parked = None if seen is not None or accepting else await parked_item(stores, *_run(args))
    if parked is not None:
        # Parked before its first checkpoint: no worker takes it, so the operator starts it
        # (one only queued is a worker's to start, and is told so), with its own agent.
        if parked.agent != agent.name:
            raise UsageError(
                f"run {args.resume!r} was submitted for agent {parked.agent!r}, and --agent "
                f"names {agent.name!r}: nothing was started"
            )
        submitted = await stores.work.input(*_run(args)) if stores.work else None
    if seen is None and submitted is None:
        if await carried_now(stores.leases, *_run(args)):
            raise ResumeConflictError(
                f"run {args.resume!r} is being started by another attempt, before its first "
                "checkpoint" + await lease_lapses(stores.leases, *_run(args))
            )
        raise await no_frontier(stores, args.tenant, args.resume)
    if seen is not None and not accepting and await _already_ended(seen, args, stores, out):
        return ExitCode.CARRIED_ON
    # The decision on the approval it waits on, for the summary.
    approval = None if seen is None else await asked_approval(stores, seen)
    async with built_provider(args.provider, agent, args.agent, default=provider) as model:
        runner = AgentRunner.from_stores(model, stores, worker=args.worker)
        accepted: RevisionAcceptance | None = None
        if accepting:
            accepted = await accept_revision(
                runner, agent, args.resume, tenant=args.tenant, by=args.by, note=args.note
            )
            if accepted is not None and not as_json:
                _told(out, escaped(accepted.describe()) + f" (step {accepted.step})\n")
        spent, usage = await ledger_totals(stores.ledger, args.tenant, args.resume)
        held: dict[str, Any] = {}

        def found(cp: Checkpoint, plan: ResumePlan | None, fence: int | None, holder: str) -> None:
            held.update(holder=holder, fence=fence)
            if as_json:
                return
            _told(out, describe(cp, plan=plan, spent=spent, usage=usage, approval=approval) + "\n")
            holding = f"fence {fence}" if fence is not None else "no lease store"
            _told(out, f"holding the run as {escaped(holder)} ({holding})\n")
            out.flush()

        if submitted is not None:
            run = await _start(runner, agent, args, submitted, found)
            held.update(fence=run.fence)  # a start names no holder (``runner.run``)
        else:
            run = await runner.resume(agent, args.resume, tenant=args.tenant, on_frontier=found)
        output = _shown_output(run, runner)
    if as_json:
        # The step it stopped at, as inspect and show name it (a Run does not carry it).
        latest = await Checkpointer.from_stores(stores).store.latest(run.tenant, run.run_id)
        step = None if latest is None else latest.step
        emit(out, _run_json(run, output, held, accepted, step=step))
    else:
        tail = f": {escaped(output)}" if output else ""
        if run.pending_approval is not None:
            tail = f": waiting on approval {escaped(run.pending_approval.id)}"
        _told(
            out, f"now {run.status} at iteration {run.iteration}, {run.spent_micros} micros{tail}\n"
        )
    if run.status is RunStatus.failed:
        return ExitCode.MUST_NOT_CARRY_ON
    return ExitCode.CARRIED_ON


async def _start(
    runner: AgentRunner,
    agent: Agent,
    args: argparse.Namespace,
    submitted: bytes,
    found: Callable[[Checkpoint, ResumePlan | None, int | None, str], None],
) -> Run:
    """Start a run submitted and parked before its first checkpoint, as a worker would
    (the operator carries it on); one started meanwhile is resumed instead."""
    submission = decode_submission(submitted)
    try:
        return await runner.run(
            agent,
            list(submission.messages),
            tenant=args.tenant,
            run_id=args.resume,
            state=state_from_json(submission.state, agent.state_schema),
        )
    except RunStartedError:
        return await runner.resume(agent, args.resume, tenant=args.tenant, on_frontier=found)


def _run(args: argparse.Namespace) -> tuple[str, str]:
    return args.tenant, args.resume


def _shown_output(run: Run, runner: AgentRunner) -> str | None:
    """The run's output as an operator may see it: redacted, as the stores keep it (the
    live ``Run`` holds the model's answer as it came)."""
    return None if run.output is None else runner.redactor.text(str(run.output))


def _run_json(
    run: Run,
    output: str | None,
    held: dict[str, Any],
    accepted: RevisionAcceptance | None,
    *,
    step: int | None,
) -> dict[str, Any]:
    return {
        "run_id": run.run_id,
        "tenant": run.tenant,
        "status": str(run.status),
        "step": step,
        "iteration": run.iteration,
        "spent_micros": run.spent_micros,
        "output": output,
        "reason": output if run.status is RunStatus.failed and output else None,
        "pending_approval": None if run.pending_approval is None else run.pending_approval.id,
        "holder": held.get("holder"),
        "fence": held.get("fence"),
        "carried_on": True,
        "accepted_revision": None
        if accepted is None
        else {
            "by": accepted.by,
            "at": when(accepted.at),
            "from_revision": accepted.from_revision,
            "to_revision": accepted.to_revision,
            "step": accepted.step,
            "note": accepted.note,
        },
    }


async def _already_ended(
    cp: Checkpoint, args: argparse.Namespace, stores: Stores, out: TextIO
) -> bool:
    """A run whose frontier says it ended is not carried on: say so without taking a lease
    (an ended frontier is the run's last, so reading it unheld is safe). ``True`` when it
    ended well; a run that ended ``failed`` raises ``RunFailedError`` (exit 4)."""
    if cp.is_tombstone or not cp.status.finished:
        return False  # the runner reads it again under the lease and says what it finds
    spent, usage = await ledger_totals(stores.ledger, args.tenant, args.resume)
    if cp.status is CheckpointStatus.failed:
        if not getattr(args, "json", False):
            _told(out, describe(cp, spent=spent, usage=usage) + "\n")
        raise RunFailedError(
            f"run {args.resume!r} ended failed at step {cp.step}; nothing was done (no lease "
            "taken, nothing sent)"
        )
    if getattr(args, "json", False):
        emit(
            out,
            {
                "run_id": cp.run_id,
                "tenant": cp.tenant,
                "status": str(cp.status),
                "step": cp.step,
                "iteration": cp.iteration,
                "spent_micros": spent,
                "output": cp.output,
                "reason": None,
                "pending_approval": None,
                "holder": None,
                "fence": None,
                "accepted_revision": None,
                "carried_on": False,
            },
        )
        return True
    _told(out, describe(cp, spent=spent, usage=usage) + "\n")
    _told(
        out,
        f"nothing was done: run {escaped(cp.run_id)} already ended {cp.status} at step "
        f"{cp.step} (no lease taken, nothing sent)\n",
    )
    return True


async def _replay(
    args: argparse.Namespace,
    stores: Stores,
    agents: Mapping[str, Agent],
    out: TextIO,
    default: ProviderSource,
) -> ExitCode:
    agent = load_agent(args.agent, agents)
    async with built_provider(args.provider, agent, args.agent, default=default) as provider:
        stubs: dict[str, Callable[..., Any]] = {}
        for spec in args.stub:
            name, sep, ref = spec.partition("=")
            if not sep or not name or not ref:
                raise UsageError(f"--stub {spec!r} is not of the form TOOL=module:attr")
            stub = import_ref(ref, "stub")
            if not callable(stub):
                raise UsageError(f"--stub {spec}: {ref} is not callable")
            stubs[name] = stub
        runner = AgentRunner.from_stores(provider, stores, worker="replay")
        run = await runner.replay(
            agent,
            args.run,
            tenant=args.tenant,
            from_step=args.from_step,
            stubs=stubs,
            live=tuple(args.live),
            new_run_id=args.new_run_id,
        )
        output = _shown_output(run, runner)
    # A replay that ended failed is told as a resume that did is: exit 4.
    code = ExitCode.MUST_NOT_CARRY_ON if run.status is RunStatus.failed else ExitCode.CARRIED_ON
    if getattr(args, "json", False):
        emit(
            out,
            {
                "run_id": run.run_id,
                "replay_of": run.replay_of,
                "status": str(run.status),
                "iteration": run.iteration,
                "output": output,
            },
        )
        return code
    tail = f": {escaped(output)}" if output else ""
    _told(
        out,
        f"replay {escaped(run.run_id)} (replay of {escaped(run.replay_of or '')}) now "
        f"{run.status} at iteration {run.iteration}{tail}\n",
    )
    return code


def _told(out: TextIO, text: str) -> None:
    """Write ``text``; once the reader is gone, write no more but carry on: a resume is
    work someone asked for, and stopping it half-way for want of a reader helps nobody
    (the exit code still says how it ended)."""
    try:
        out.write(text)
    except (BrokenPipeError, ValueError):
        output_closed(out)
