"""What the console shows, read from the stores' own (redacted) data.

Every read names its tenant; nothing here lists tenants or guesses one. Tool arguments,
outcomes, messages and notes come from the checkpoint, approval and idempotency stores,
which keep them redacted, and an idempotency key is shown only as a short digest.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from tesserix_adk.checkpoint.checkpointer import Checkpointer
from tesserix_adk.checkpoint.payload import Checkpoint
from tesserix_adk.checkpoint.planning import ResumePlan, plan_as_told
from tesserix_adk.cli.reasons import (
    blocked,
    left_for_a_person,
    lost_to_workers,
    state_refused,
    told_from,
    waits,
)
from tesserix_adk.errors import (
    AdkError,
    CheckpointCorruptError,
    CheckpointFormatError,
    ConfigurationError,
)
from tesserix_adk.messages import Message, Usage
from tesserix_adk.run.entries import damage, shown_entry, tenant_entries
from tesserix_adk.run.unstarted import Unstarted, unstarted_runs
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.stores.capabilities import ledger_totals, run_listing, step_history
from tesserix_adk.stores.protocols import (
    ApprovalRequest,
    IdempotencyRecord,
    RecordStatus,
    RunLease,
    WorkItem,
    WorkState,
)

__all__ = [
    "RunDetail",
    "RunFilter",
    "RunSummary",
    "StepRow",
    "key_digest",
    "run_detail",
    "runs",
    "shown_value",
    "unstarted_run",
]


@dataclass(frozen=True, slots=True)
class RunFilter:
    """The runs list's filters; ``None`` shows every value."""

    status: str | None = None
    agent: str | None = None
    stuck: bool = False


@dataclass(frozen=True, slots=True)
class RunSummary:
    """One line of the runs list; ``unreadable`` holds why a frontier could not be read."""

    run_id: str
    agent: str = ""
    status: str = ""
    step: int = 0
    written_at: float | None = None
    in_flight: int = 0
    # The calls it leaves open for a person (``cli.reasons.left_for_a_person``).
    in_doubt: int = 0
    lease: RunLease | None = None
    parked: str | None = None
    pending_approval: str | None = None
    unreadable: str | None = None
    # Why no worker carries it on (failed, refused, pinned elsewhere: ``cli.reasons.blocked``).
    blocked: str | None = None
    finished: bool = False
    # No frontier yet (``run.unstarted``): submitted, or cancelled before it started.
    unstarted: bool = False
    said: str | None = None

    @property
    def stuck(self) -> bool:
        """Whether it waits for a person, as ``tesserix runs --stuck`` tells (``waits``)."""
        return waits(
            parked=self.parked is not None,
            open_calls=self.in_doubt,
            lease=self.lease,
            blocked=self.blocked,
        )


@dataclass(frozen=True, slots=True)
class StepRow:
    """One step snapshot of a run."""

    step: int
    boundary: str
    iteration: int
    status: str
    written_at: float | None
    size: int
    unreadable: str | None = None


@dataclass(frozen=True, slots=True)
class RunDetail:
    """Everything the run page shows."""

    checkpoint: Checkpoint
    plan: ResumePlan
    spent: int
    usage: Usage
    lease: RunLease | None
    parked: WorkItem | None
    approval: ApprovalRequest | None
    records: tuple[IdempotencyRecord, ...]
    steps: tuple[StepRow, ...]
    messages: tuple[Message, ...] = ()
    # Why the transcript could not be read (gone, damaged), or ``None``.
    transcript_problem: str | None = None
    # Why the run's work index entry could not be read, or ``None``.
    entry_problem: str | None = None
    # Why its step snapshots cannot be listed (a store keeping none), or ``None``.
    steps_problem: str | None = None
    # For a tombstone (no transcript of its own): whose conversation is shown, in words.
    told_from: str | None = None
    # Why a resume refuses it for the state its last completed call kept, or ``None``.
    refused: str | None = None


def key_digest(key: str | None) -> str:
    """A short digest of an idempotency key: enough to tell calls apart, not the key."""
    if not key:
        return "-"
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()[:12]


async def runs(stores: Stores, tenant: str, where: RunFilter) -> list[RunSummary]:
    """The tenant's runs that pass ``where``, in the store's order."""
    checkpointer = Checkpointer.from_stores(stores)
    shown: list[RunSummary] = []
    # A run that cannot be read is shown whatever the filter (its status or agent cannot
    # be told), as `tesserix runs` shows it: it waits for a person, as a parked one does.
    listed = await run_listing(stores.checkpoints).runs(tenant)
    entries = await tenant_entries(stores, tenant, listed)
    for run_id in listed:
        try:
            cp = await checkpointer.latest(tenant, run_id)
        except (CheckpointCorruptError, CheckpointFormatError) as exc:
            shown.append(RunSummary(run_id, unreadable=damage(exc)))
            continue
        if cp is None:
            continue
        try:
            records = await stores.idempotency.records(tenant, run_id)
            lease = await stores.leases.current(tenant, run_id)
            if run_id in entries.damaged:
                raise CheckpointCorruptError(entries.damaged[run_id])
            left = await left_for_a_person(stores.idempotency, stores.leases, cp, records, lease)
        except (CheckpointCorruptError, CheckpointFormatError) as exc:
            # One run's damaged row hides no other run, as a damaged frontier does not.
            shown.append(RunSummary(run_id, unreadable=damage(exc)))
            continue
        park = entries.parked.get(run_id)
        lost = await lost_to_workers(stores, tenant, cp, lease, entries)
        summary = RunSummary(
            run_id,
            agent=cp.agent_name,
            status=str(cp.status),
            step=cp.step,
            written_at=cp.written_at,
            in_flight=sum(
                1 for r in records if r.tool is not None and r.status is RecordStatus.in_flight
            ),
            in_doubt=left.calls,
            lease=lease,
            parked=None if park is None else (park.reason or ""),
            pending_approval=None if cp.pending_approval is None else cp.pending_approval.id,
            blocked=blocked(cp, park, None, unindexed=lost, refused=left.refused),
            finished=cp.status.finished,
        )
        if where.status and summary.status != where.status:
            continue
        if where.agent and summary.agent != where.agent:
            continue
        if where.stuck and not summary.stuck:
            continue
        shown.append(summary)
    try:
        unstarted = await unstarted_runs(stores, tenant, with_frontier=set(listed))
    except CheckpointCorruptError as exc:
        # The runs with no frontier are known only by listing the index, which one
        # damaged entry stops: said in a row of its own, the rest still shown.
        shown.append(RunSummary("-", unreadable=f"runs not started yet: {damage(exc)}"))
        unstarted = []
    for run in unstarted:
        if run.unreadable is not None:
            shown.append(RunSummary(run.item.run_id, unreadable=damage(run.unreadable)))
            continue
        summary = RunSummary(
            run.item.run_id,
            agent=run.item.agent,
            status=run.status,
            written_at=run.item.since,
            lease=run.lease,
            parked=run.parked,
            finished=run.cancel is not None,
            unstarted=True,
            said=run.said,
        )
        if where.status and summary.status != where.status:
            continue
        if where.agent and summary.agent != where.agent:
            continue
        if where.stuck and not summary.stuck:
            continue
        shown.append(summary)
    return shown


async def unstarted_run(stores: Stores, tenant: str, run_id: str) -> Unstarted | None:
    """A run with no frontier that the work index knows (submitted, or cancelled before it
    started), or ``None``."""
    found = await unstarted_runs(stores, tenant, with_frontier=(), only=run_id)
    return found[0] if found else None


async def run_detail(stores: Stores, tenant: str, run_id: str) -> RunDetail | None:
    """The run page's data, or ``None`` when nothing is checkpointed under ``run_id``."""
    checkpointer = Checkpointer.from_stores(stores)
    cp = await checkpointer.latest(tenant, run_id)
    if cp is None:
        return None
    messages: tuple[Message, ...] = ()
    problem = None
    said = None
    try:
        # A tombstone keeps no transcript: the conversation as far as it was kept.
        told_by = await checkpointer.last_written_whole(cp)
        if told_by is not None:
            messages = tuple(await checkpointer.messages(told_by))
        said = told_from(cp, told_by)
    except AdkError as exc:  # the rest of the page still helps the operator
        problem = damage(exc)
    approval = None
    if cp.pending_approval is not None:
        approval = await stores.approvals.get(tenant, cp.pending_approval.id)
    lease = await stores.leases.current(tenant, run_id)
    parked, entry_problem = None, None
    steps: tuple[StepRow, ...] = ()
    steps_problem = None
    try:
        steps = tuple(await _steps(stores, tenant, run_id))
    except ConfigurationError as exc:  # a store keeping no steps: the rest still helps
        steps_problem = str(exc)
    if stores.work is not None:
        try:
            entry = await stores.work.entry(tenant, run_id)
            parked = None if entry is None else shown_entry(entry)
        except CheckpointCorruptError as exc:  # its own entry: the page still helps
            entry_problem = damage(exc)
    spent, usage = await ledger_totals(stores.ledger, tenant, run_id)
    # As `tesserix inspect` tells it.
    plan = await plan_as_told(cp, stores.idempotency, lease)
    return RunDetail(
        checkpoint=cp,
        plan=plan,
        refused=await state_refused(stores.idempotency, cp, plan),
        spent=spent,
        usage=usage,
        lease=lease,
        parked=parked if parked is not None and parked.state is WorkState.parked else None,
        entry_problem=entry_problem,
        approval=approval,
        records=tuple(
            r for r in await stores.idempotency.records(tenant, run_id) if r.tool is not None
        ),
        steps=steps,
        steps_problem=steps_problem,
        messages=messages,
        transcript_problem=problem,
        told_from=said,
    )


async def _steps(stores: Stores, tenant: str, run_id: str) -> list[StepRow]:
    history = step_history(stores.checkpoints)
    checkpointer = Checkpointer.from_stores(stores)
    rows = []
    for step in await history.steps(tenant, run_id):
        stored = await history.at(tenant, run_id, step)
        if stored is None:
            continue
        try:
            cp = await checkpointer.at(tenant, run_id, step)
        except (CheckpointCorruptError, CheckpointFormatError) as exc:
            rows.append(StepRow(step, "-", 0, "-", None, len(stored.payload), damage(exc)))
            continue
        if cp is None:
            continue
        rows.append(
            StepRow(
                step,
                "-" if cp.boundary is None else str(cp.boundary),
                cp.iteration,
                str(cp.status),
                cp.written_at,
                len(stored.payload),
            )
        )
    return rows


def shown_value(value: Any) -> str:
    """A (redacted) value as compact JSON text for a page."""
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    if isinstance(value, str):
        return value
    return json.dumps(value, default=str, ensure_ascii=False, sort_keys=True)
