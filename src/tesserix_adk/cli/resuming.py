"""``tesserix run --resume RUN`` (optionally ``--accept-revision --by NAME``) and
``tesserix replay``: the commands that carry a run on."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from typing import Any, TextIO

from tesserix_adk.agent import Agent
from tesserix_adk.checkpoint.payload import Checkpoint
from tesserix_adk.checkpoint.planning import ResumePlan
from tesserix_adk.cli.describe import describe
from tesserix_adk.cli.failures import ExitCode, UsageError
from tesserix_adk.cli.jsonout import emit, when
from tesserix_adk.cli.loading import built_provider, import_ref, load_agent
from tesserix_adk.cli.text import escaped
from tesserix_adk.run.result import Run
from tesserix_adk.run.upgrade import RevisionAcceptance, accept_revision
from tesserix_adk.runner import AgentRunner, RunStatus
from tesserix_adk.stores.bundle import Stores

__all__ = ["run_resume_command"]


async def run_resume_command(
    args: argparse.Namespace, stores: Stores, agents: Mapping[str, Agent], out: TextIO
) -> ExitCode:
    """Run the parsed ``run``/``replay``."""
    if args.command == "replay":
        return await _replay(args, stores, agents, out)
    if not args.resume:
        raise UsageError("`run` only carries existing runs on: pass --resume RUN")
    accepting = getattr(args, "accept_revision", False)
    if accepting and not args.by:
        raise UsageError("--accept-revision needs --by NAME: who accepts the change")
    if not accepting and (args.by or args.note):
        raise UsageError("--by and --note go with --accept-revision")
    as_json = getattr(args, "json", False)
    agent = load_agent(args.agent, agents)
    async with built_provider(args.provider, agent, args.agent) as provider:
        runner = AgentRunner.from_stores(provider, stores, worker=args.worker)
        accepted: RevisionAcceptance | None = None
        if accepting:
            accepted = await accept_revision(
                runner, agent, args.resume, tenant=args.tenant, by=args.by, note=args.note
            )
            if accepted is not None and not as_json:
                out.write(escaped(accepted.describe()) + f" (step {accepted.step})\n")
        spent = await stores.ledger.spent(args.tenant, args.resume)
        held: dict[str, Any] = {}

        def found(cp: Checkpoint, plan: ResumePlan | None, fence: int | None, holder: str) -> None:
            held.update(holder=holder, fence=fence)
            if as_json:
                return
            out.write(describe(cp, plan=plan, spent=spent) + "\n")
            holding = f"fence {fence}" if fence is not None else "no lease store"
            out.write(f"holding the run as {escaped(holder)} ({holding})\n")
            out.flush()

        run = await runner.resume(agent, args.resume, tenant=args.tenant, on_frontier=found)
    if as_json:
        emit(out, _run_json(run, held, accepted))
    else:
        tail = f": {escaped(str(run.output))}" if run.output else ""
        if run.pending_approval is not None:
            tail = f": waiting on approval {escaped(run.pending_approval.id)}"
        out.write(
            f"now {run.status} at iteration {run.iteration}, {run.spent_micros} micros{tail}\n"
        )
    if run.status is RunStatus.failed:
        return ExitCode.MUST_NOT_CARRY_ON
    return ExitCode.CARRIED_ON


def _run_json(
    run: Run, held: dict[str, Any], accepted: RevisionAcceptance | None
) -> dict[str, Any]:
    return {
        "run_id": run.run_id,
        "status": str(run.status),
        "iteration": run.iteration,
        "spent_micros": run.spent_micros,
        "output": None if run.output is None else str(run.output),
        "reason": str(run.output) if run.status is RunStatus.failed and run.output else None,
        "pending_approval": None if run.pending_approval is None else run.pending_approval.id,
        "holder": held.get("holder"),
        "fence": held.get("fence"),
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


async def _replay(
    args: argparse.Namespace, stores: Stores, agents: Mapping[str, Agent], out: TextIO
) -> ExitCode:
    agent = load_agent(args.agent, agents)
    async with built_provider(args.provider, agent, args.agent) as provider:
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
    if getattr(args, "json", False):
        emit(
            out,
            {
                "run_id": run.run_id,
                "replay_of": run.replay_of,
                "status": str(run.status),
                "iteration": run.iteration,
                "output": None if run.output is None else str(run.output),
            },
        )
        return ExitCode.CARRIED_ON
    tail = f": {escaped(str(run.output))}" if run.output else ""
    out.write(
        f"replay {escaped(run.run_id)} (replay of {escaped(run.replay_of or '')}) now "
        f"{run.status} at iteration {run.iteration}{tail}\n"
    )
    return ExitCode.CARRIED_ON
