"""The commands that look and decide, never carry a run on: ``inspect``, ``show``, ``runs``,
``steps``, ``approve``, ``resolve`` (``cli/resolving.py``), ``schema``. Every id they print
goes through ``escaped``; with ``--json`` each prints one JSON object instead
(``cli/jsonout.py``)."""

from __future__ import annotations

import argparse
import re
import shlex
from typing import Any, TextIO

from tesserix_adk.checkpoint.checkpointer import Checkpointer
from tesserix_adk.checkpoint.payload import (
    Checkpoint,
)
from tesserix_adk.checkpoint.redaction import Redactor
from tesserix_adk.cli.failures import ExitCode, Refused
from tesserix_adk.cli.inspecting import run_inspect
from tesserix_adk.cli.jsonout import emit, when
from tesserix_adk.cli.listing import run_runs
from tesserix_adk.cli.reasons import no_frontier
from tesserix_adk.cli.resolving import RESOLVE_LEASE_TTL, run_resolve
from tesserix_adk.cli.show import run_show
from tesserix_adk.cli.text import escaped
from tesserix_adk.cli.waking import wake
from tesserix_adk.errors import (
    CheckpointCorruptError,
    CheckpointFormatError,
    NoCheckpointError,
)
from tesserix_adk.run.cancelling import cancel_requested
from tesserix_adk.run.resume import unfinished_replay
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.stores.capabilities import step_history
from tesserix_adk.stores.protocols import WorkState
from tesserix_adk.stores.urls import redact_url
from tesserix_adk.timestamps import shown_time

__all__ = ["RESOLVE_LEASE_TTL", "run_frontier_command"]

_PLAIN_WORD = re.compile(r"[A-Za-z0-9_./:=@%+,-]+")

_STEPS_HEADER = "step  boundary           iteration  status            written              bytes\n"


async def run_frontier_command(args: argparse.Namespace, stores: Stores, out: TextIO) -> ExitCode:
    """Run the parsed ``inspect``/``show``/``runs``/``steps``/``approve``/``resolve``/
    ``schema``."""
    command = args.command
    if command == "inspect":
        return await run_inspect(args, stores, out)
    if command == "show":
        return await run_show(args, stores, out)
    if command == "runs":
        return await run_runs(args, stores, out)
    if command == "steps":
        return await _steps(args, stores, out)
    if command == "approve":
        return await _approve(args, stores, out)
    if command == "resolve":
        return await run_resolve(args, stores, out)
    return await _schema(args, stores, out)


async def _steps(args: argparse.Namespace, stores: Stores, out: TextIO) -> ExitCode:
    steps = await step_history(stores.checkpoints).steps(args.tenant, args.run)
    if not steps:
        raise await no_frontier(stores, args.tenant, args.run)
    checkpointer = Checkpointer.from_stores(stores)
    as_json = getattr(args, "json", False)
    rows: list[dict[str, Any]] = []
    if not as_json:
        out.write(_STEPS_HEADER)
    for step in steps:
        stored = await step_history(stores.checkpoints).at(args.tenant, args.run, step)
        if stored is None:
            continue
        try:
            cp = await checkpointer.at(args.tenant, args.run, step)
        except (CheckpointCorruptError, CheckpointFormatError) as exc:
            rows.append({"step": step, "status": "unreadable", "reason": str(exc)})
            if not as_json:
                out.write(f"{step:<5} unreadable: {escaped(str(exc))}\n")
            continue
        assert cp is not None
        rows.append(
            {
                "step": step,
                "boundary": None if cp.boundary is None else str(cp.boundary),
                "iteration": cp.iteration,
                "status": str(cp.status),
                "fence": stored.fence,
                "written_at": when(cp.written_at),
                "bytes": len(stored.payload),
            }
        )
        if as_json:
            continue
        written = "-" if cp.written_at is None else shown_time(cp.written_at, "%Y-%m-%d %H:%M:%S")
        boundary = "-" if cp.boundary is None else str(cp.boundary)
        out.write(
            f"{step:<5} {boundary:<18} {cp.iteration:<10} {cp.status!s:<17} {written:<20} "
            f"{len(stored.payload)}\n"
        )
    if as_json:
        emit(out, {"run_id": args.run, "tenant": args.tenant, "steps": rows})
    return ExitCode.CARRIED_ON


async def _approve(args: argparse.Namespace, stores: Stores, out: TextIO) -> ExitCode:
    request = await stores.approvals.get(args.tenant, args.request)
    if request is None:
        raise NoCheckpointError(
            f"no approval request {args.request!r} belongs to tenant {args.tenant!r}"
        )
    cancelled = await cancel_requested(stores.idempotency, args.tenant, request.run_id)
    if cancelled is not None:
        # A page or a script that still shows the request: the run waits on nothing now.
        raise Refused(
            f"run {request.run_id!r} was cancelled ({cancelled.describe()}); nothing waits "
            f"on approval request {args.request!r} any more"
        )
    cp = await Checkpointer.from_stores(stores).latest(args.tenant, request.run_id)
    if cp is not None and unfinished_replay(cp):
        # Nothing carries a replay on (``ReplayNotResumableError``): approving it would only
        # wake a worker that parks it.
        raise Refused(
            f"run {request.run_id!r} is a replay of {cp.replay_of}, which is never carried on "
            "(its stubs lived only in the replay call); replay again instead"
        )
    # The note is user data bound for a store like any other: an operator pasting what they
    # saw ("the key sk-... works again") must not leave the key in the approval record.
    note = None if args.note is None else Redactor().text(args.note)
    try:
        decided = await stores.approvals.decide(
            args.tenant, args.request, approved=not args.deny, by=args.by, note=note
        )
    except ValueError as exc:
        raise Refused(
            f"approval request {args.request!r} was already decided the other way: {exc}"
        ) from exc
    run = escaped(decided.run_id)
    # The frontier read above (a decision writes none): what wakes, and what to say.
    woken = await wake(stores, args.tenant, decided.run_id, WorkState.decided, cp)
    then = _carry_on_with(args, decided.run_id, woken, cp)
    if getattr(args, "json", False):
        emit(
            out,
            {
                "request": decided.id,
                "run_id": decided.run_id,
                "tenant": args.tenant,
                "status": str(decided.status),
                "by": decided.by or args.by,
                "note": decided.note,
                "decided_at": when(decided.decided_at),
                "woken": woken,
            },
        )
        return ExitCode.CARRIED_ON
    out.write(
        f"approval {escaped(decided.id)} {decided.status} by {escaped(decided.by or args.by)} "
        f"for run {run}; {then}\n"
    )
    return ExitCode.CARRIED_ON


def _by_its_workflow(cp: Checkpoint) -> str:
    return (
        f"its {cp.carried_by} workflow takes the decision at its next look at the approval "
        "store (its approval signal has it look now); no kit worker takes it"
    )


def _carry_on_with(
    args: argparse.Namespace, run_id: str, woken: bool, cp: Checkpoint | None
) -> str:
    """What carries the run on now: its workflow (a Temporal run), a running ``tesserix
    worker``, or the exact resume command (``--agent`` as given to ``approve``; else a
    placeholder naming the agent). ``cp``: the run's frontier, if it has one."""
    if cp is not None and cp.status.finished:
        # A page left open, or a late second click: the run went on and ended meanwhile
        # (its workflow too, if one carried it).
        return f"the run has ended {cp.status}; nothing carries it on"
    if cp is not None and cp.carried_by is not None:
        return _by_its_workflow(cp)
    agent = getattr(args, "agent", None)
    if agent is None:
        name = "" if cp is None else f" of agent {escaped(cp.agent_name)!r}"
        agent = "MODULE:ATTR"
        hint = (
            f" (MODULE:ATTR: where the agent{name} is defined, e.g. my_agent:agent; "
            "`approve --agent` prints the whole command)"
        )
    else:
        hint = ""
    parts = ["tesserix", "run", "--resume", run_id, "--tenant", args.tenant, "--agent", agent]
    store = getattr(args, "store", None)
    if store:  # as given, a password masked (this line may land in a log)
        parts += ["--store", redact_url(store)]
    command = " ".join(_shell_word(p) for p in parts)
    worker = "a worker carries it on (a running `tesserix worker`), or " if woken else ""
    return f"{worker}carry it on now with `{command}`{hint}"


def _shell_word(word: str) -> str:
    """A word a shell reads back as it is (an id with control characters is escaped)."""
    return escaped(word) if _PLAIN_WORD.fullmatch(word) else shlex.quote(escaped(word))


async def _schema(args: argparse.Namespace, stores: Stores, out: TextIO) -> ExitCode:
    as_json = getattr(args, "json", False)
    if args.action == "show":
        if as_json:
            emit(out, {"schema": stores.schema})
        else:
            out.write((stores.schema or "-- this store has no schema to apply\n").rstrip() + "\n")
        return ExitCode.CARRIED_ON
    await stores.create_schema()
    if as_json:
        emit(out, {"schema": "applied"})
    else:
        out.write("schema applied\n")
    return ExitCode.CARRIED_ON
