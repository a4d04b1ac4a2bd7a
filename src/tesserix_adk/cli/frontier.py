"""The commands that look and decide, never carry a run on: ``inspect``, ``runs``, ``steps``,
``approve``, ``resolve``, ``schema``. Every id they print goes through ``escaped``."""

from __future__ import annotations

import argparse
import contextlib
import json
import secrets
import time
from typing import Any, TextIO

from tesserix_adk.checkpoint.checkpointer import Checkpointer
from tesserix_adk.checkpoint.payload import Checkpoint, encode_outcome
from tesserix_adk.checkpoint.planning import ResumePlan, plan_resume
from tesserix_adk.checkpoint.redaction import Redactor
from tesserix_adk.cli.describe import describe
from tesserix_adk.cli.failures import ExitCode, Refused, UsageError
from tesserix_adk.cli.text import escaped
from tesserix_adk.errors import (
    AdkError,
    CheckpointCorruptError,
    CheckpointFormatError,
    LeaseHeldError,
    NoCheckpointError,
    ResumeConflictError,
)
from tesserix_adk.leases import never_ran_wait, previous_end_ago
from tesserix_adk.messages import ToolOutcome
from tesserix_adk.run.attempt import run_claim_key
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.stores.capabilities import run_listing, step_history
from tesserix_adk.stores.protocols import (
    IdempotencyRecord,
    RecordStatus,
    RunLease,
    WorkState,
)
from tesserix_adk.timestamps import iso_time

__all__ = ["RESOLVE_LEASE_TTL", "run_frontier_command"]

# Long enough for one resolution; short enough that a resolver killed half-way holds the
# run up only briefly (its lease lapses by the store's clock).
RESOLVE_LEASE_TTL = 30.0


async def run_frontier_command(args: argparse.Namespace, stores: Stores, out: TextIO) -> ExitCode:
    """Run the parsed ``inspect``/``runs``/``steps``/``approve``/``resolve``/``schema``."""
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


def _held_by(lease: RunLease) -> str:
    return (
        f"held by {escaped(lease.holder)} (fence {lease.fence}) until {iso_time(lease.expires_at)} "
        "by the store's clock, unless renewed"
    )


async def _inspect(args: argparse.Namespace, stores: Stores, out: TextIO) -> ExitCode:
    checkpointer = Checkpointer.from_stores(stores)
    cp = await checkpointer.latest(args.tenant, args.run)
    if cp is None:
        raise NoCheckpointError(
            f"nothing is checkpointed under run {args.run!r} for tenant {args.tenant!r}"
        )
    plan = await plan_resume(cp, stores.idempotency)
    spent = await stores.ledger.spent(args.tenant, args.run)
    lease = await stores.leases.current(args.tenant, args.run)
    parked = None
    if stores.work is not None:
        parked = next(
            (
                i
                for i in await stores.work.items(args.tenant, state=WorkState.parked)
                if i.run_id == args.run
            ),
            None,
        )
    if args.json:
        shown = _as_json(cp, plan, spent, lease)
        shown["parked"] = None if parked is None else parked.reason
        out.write(json.dumps(shown, indent=2, default=str) + "\n")
        return ExitCode.CARRIED_ON
    out.write(describe(cp, plan=plan, spent=spent) + "\n")
    if lease is not None:
        out.write(_held_by(lease) + "\n")
    if parked is not None:
        out.write(
            f"parked: {escaped(parked.reason or '')}; a worker takes it again once you resolve, "
            "approve or cancel\n"
        )
    return ExitCode.CARRIED_ON


def _as_json(cp: Checkpoint, plan: ResumePlan, spent: int, lease: Any) -> dict[str, Any]:
    # json.dumps escapes control characters itself: ids go in as they are.
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
    checkpointer = Checkpointer.from_stores(stores)
    parked = {}
    if stores.work is not None:
        parked = {i.run_id: i for i in await stores.work.items(args.tenant, state=WorkState.parked)}
    for run_id in await run_listing(stores.checkpoints).runs(args.tenant):
        shown = escaped(run_id)
        try:
            cp = await checkpointer.latest(args.tenant, run_id)
        except (CheckpointCorruptError, CheckpointFormatError) as exc:
            out.write(f"{shown}  unreadable: {escaped(str(exc))}\n")
            continue
        if cp is None:
            continue
        lease = await stores.leases.current(args.tenant, run_id)
        records = await stores.idempotency.records(args.tenant, run_id)
        in_flight = [
            r for r in records if r.tool is not None and r.status is RecordStatus.in_flight
        ]
        park = parked.get(run_id)
        lapsed = not cp.status.finished and lease is None and bool(in_flight)
        if args.stuck and park is None and not lapsed:
            continue
        held = f"  {_held_by(lease)}" if lease else ""
        flight = f"  {len(in_flight)} call(s) in flight" if in_flight else ""
        where = f"{cp.status} at step {cp.step}"
        why = f"  parked: {escaped(park.reason or '')}" if park is not None else ""
        out.write(f"{shown}  {escaped(cp.agent_name)}  {where}{flight}{held}{why}\n")
    return ExitCode.CARRIED_ON


async def _steps(args: argparse.Namespace, stores: Stores, out: TextIO) -> ExitCode:
    steps = await step_history(stores.checkpoints).steps(args.tenant, args.run)
    if not steps:
        raise NoCheckpointError(
            f"nothing is checkpointed under run {args.run!r} for tenant {args.tenant!r}"
        )
    checkpointer = Checkpointer.from_stores(stores)
    out.write("step  boundary           iteration  status            written              bytes\n")
    for step in steps:
        stored = await step_history(stores.checkpoints).at(args.tenant, args.run, step)
        if stored is None:
            continue
        try:
            cp = await checkpointer.at(args.tenant, args.run, step)
        except (CheckpointCorruptError, CheckpointFormatError) as exc:
            out.write(f"{step:<5} unreadable: {escaped(str(exc))}\n")
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
    woken = await _wake(stores, args.tenant, decided.run_id, WorkState.decided)
    then = (
        "a worker carries it on"
        if woken
        else f"carry it on with `tesserix run --resume {run} --tenant {escaped(args.tenant)} "
        "--agent module:attr`"
    )
    out.write(
        f"approval {escaped(decided.id)} {decided.status} by {escaped(decided.by or args.by)} "
        f"for run {run}; {then}\n"
    )
    return ExitCode.CARRIED_ON


async def _wake(stores: Stores, tenant: str, run_id: str, state: WorkState) -> bool:
    """Tell the work index the run wants a worker again (an operator acted on it): whether
    a worker will find it. A parked run is unparked."""
    if stores.work is None:
        return False
    agent: str | None = None
    with contextlib.suppress(CheckpointCorruptError, CheckpointFormatError):
        cp = await Checkpointer.from_stores(stores).latest(tenant, run_id)
        agent = None if cp is None else cp.agent_name
    if agent is None:
        known = [i for i in await stores.work.items(tenant) if i.run_id == run_id]
        agent = known[0].agent if known else None
    if agent is None:
        return False
    await stores.work.want(tenant, run_id, agent=agent, state=state)
    return True


async def _resolve(args: argparse.Namespace, stores: Stores, out: TextIO) -> ExitCode:
    record = _the_call(await stores.idempotency.records(args.tenant, args.run), args)
    content: Any = None
    if not args.never_ran:
        try:
            content = json.loads(args.outcome)
        except ValueError as exc:
            raise UsageError(f"--outcome is not valid JSON: {exc}") from exc
    await _no_live_resumer(stores, args)
    if await stores.leases.current(args.tenant, args.run) is None:
        # Asked before the lease is taken: a refused try must not itself end a lease (and
        # so push back the margin of every other call in doubt).
        _in_flight(record, args)
        if args.never_ran:
            _margin_passed(args, record, await stores.leases.ended_ago(args.tenant, args.run))
    # The operator carries the run while recording what happened, so no worker can take it
    # (and run on with, or re-send, the call being decided) in between; the acquisition also
    # raises the run's fence, so a worker whose lease lapsed is fenced out of its writes.
    holder = f"tesserix-resolve-{secrets.token_hex(6)}"
    try:
        lease = await stores.leases.acquire(args.tenant, args.run, holder, RESOLVE_LEASE_TTL)
    except LeaseHeldError as exc:
        who = "another worker" if exc.holder is None else escaped(exc.holder)
        raise ResumeConflictError(
            f"another worker holds the run {args.run!r} ({who}); resolve a call only once "
            "nobody carries the run",
            holder=exc.holder,
        ) from exc
    try:
        # Read again under the lease: what was in flight before may have completed since.
        record = _the_call(await stores.idempotency.records(args.tenant, args.run), args)
        if args.never_ran:
            # Another holder may have come and gone since the first look.
            _margin_passed(args, record, previous_end_ago(lease, RESOLVE_LEASE_TTL))
        _in_flight(record, args)
        return await _record_resolution(args, stores, out, record, content)
    finally:
        try:
            await stores.leases.release(lease)
        except AdkError as exc:  # it lapses by itself within RESOLVE_LEASE_TTL
            out.write(
                f"the operator's lease on the run could not be released ({escaped(str(exc))}); "
                f"it lapses within {RESOLVE_LEASE_TTL:g} s\n"
            )


async def _no_live_resumer(stores: Stores, args: argparse.Namespace) -> None:
    """A run carried without a lease store is held by its resume claim alone: while that
    claim is live, its holder may be sending the very call being decided."""
    key = run_claim_key(args.tenant, args.run)
    claim = (await stores.idempotency.lookup([key], tenant=args.tenant)).get(key)
    if claim is None or claim.status is not RecordStatus.in_flight:
        return
    # The claim's expiry is the store's clock; this host's clock only reads it, and a host
    # clock that is behind keeps the refusal longer, never shorter.
    if claim.expires_at is not None and claim.expires_at <= time.time():
        return
    until = "" if claim.expires_at is None else f" until {iso_time(claim.expires_at)}"
    raise ResumeConflictError(
        f"run {args.run!r} is being resumed by {claim.holder}{until}; resolve a call only "
        "once nobody carries the run",
        holder=claim.holder,
    )


def _in_flight(record: IdempotencyRecord, args: argparse.Namespace) -> None:
    if record.status is not RecordStatus.in_flight:
        raise Refused(f"{record.tool} ({args.call}) is not in flight; it is {record.status}")


def _margin_passed(
    args: argparse.Namespace, record: IdempotencyRecord, ended_ago: float | None
) -> None:
    wait = never_ran_wait(ended_ago, args.margin)
    if wait > 0:
        _in_flight(record, args)  # a call already settled is refused as such, not "wait"
        raise ResumeConflictError(
            f"the run's last lease ended {ended_ago or 0:.1f} s ago by the store's clock, and "
            f"its holder may still be sending {record.tool} ({args.call}); --never-ran is "
            f"taken only after a margin of {args.margin:g} s: look at the outside world "
            f"again in {wait:.1f} s, then resolve"
        )


def _the_call(records: list[IdempotencyRecord], args: argparse.Namespace) -> IdempotencyRecord:
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
    return matches[0]


async def _record_resolution(
    args: argparse.Namespace,
    stores: Stores,
    out: TextIO,
    record: IdempotencyRecord,
    content: Any,
) -> ExitCode:
    call = f"{escaped(record.tool or '')} ({escaped(args.call)})"
    if args.never_ran:
        await stores.idempotency.resolve(record.key, tenant=args.tenant, never_ran=True, by=args.by)
        out.write(f"recorded: {call} never ran, by {escaped(args.by)}\n")
    else:
        outcome = ToolOutcome(call_id=record.call_id or "", content=content)
        encoded = encode_outcome(outcome, Redactor())
        await stores.idempotency.resolve(record.key, encoded, tenant=args.tenant, by=args.by)
        out.write(f"recorded: {call} completed with the given outcome, by {escaped(args.by)}\n")
    if await _wake(stores, args.tenant, args.run, WorkState.wanted):
        out.write("a worker carries the run on\n")
    return ExitCode.CARRIED_ON


async def _schema(args: argparse.Namespace, stores: Stores, out: TextIO) -> ExitCode:
    if args.action == "show":
        out.write((stores.schema or "-- this store has no schema to apply\n").rstrip() + "\n")
        return ExitCode.CARRIED_ON
    await stores.create_schema()
    out.write("schema applied\n")
    return ExitCode.CARRIED_ON
