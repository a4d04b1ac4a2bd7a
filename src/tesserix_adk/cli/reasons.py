"""Why a run stands where it stands: a failed run's reason, a parked run's, and whether a
run cannot be carried on (and what it would need), for ``inspect``, ``show`` and ``runs``."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from tesserix_adk.checkpoint.payload import Checkpoint, CheckpointStatus
from tesserix_adk.checkpoint.planning import ResumePlan, left_open, plan_resume
from tesserix_adk.errors import (
    CheckpointCorruptError,
    CheckpointFormatError,
    NoCheckpointError,
    ResumeConflictError,
    RevisionMismatchError,
    StateRedactedError,
)
from tesserix_adk.run.cancelling import cancel_requested
from tesserix_adk.run.entries import TenantEntries, damage, shown_entry
from tesserix_adk.run.holding import carried_elsewhere
from tesserix_adk.run.resume import carried_state, nothing_ran_since_approval_asked, uncarriable
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.stores.protocols import (
    ApprovalStatus,
    IdempotencyRecord,
    IdempotencyStore,
    LeaseStore,
    RunLease,
    WorkItem,
    WorkState,
)
from tesserix_adk.worker_parking import parked_for

__all__ = [
    "LeftOpen",
    "blocked",
    "carriable",
    "failure_reason",
    "left_for_a_person",
    "no_frontier",
    "parked_item",
    "state_refused",
    "told_from",
    "waits",
]


def failure_reason(cp: Checkpoint, parked: WorkItem | None = None) -> str | None:
    """Why the run failed, was refused or was parked; ``None`` for a run that did not.

    A failed frontier carries the model's error as its output (stored redacted)."""
    if cp.status is CheckpointStatus.failed:
        return cp.reason or cp.output or "failed (the frontier records no reason)"
    if cp.is_tombstone:
        return cp.reason
    if parked is not None:
        return parked.reason
    return cp.reason


async def no_frontier(stores: Stores, tenant: str, run_id: str) -> NoCheckpointError:
    """What a command that reads a frontier says when there is none (exit 1): also that the
    run was submitted, when it was, so the operator does not doubt the id."""
    said = f"nothing is checkpointed under run {run_id!r} for tenant {tenant!r}"
    if stores.work is not None and await stores.work.input(tenant, run_id) is not None:
        parked = await parked_item(stores, tenant, run_id)
        cancelled = await cancel_requested(stores.idempotency, tenant, run_id)
        try:
            await stores.work.entry(tenant, run_id)
        except CheckpointCorruptError as exc:
            # No worker takes a run whose entry it cannot read: said, not promised away.
            return NoCheckpointError(
                f"{said}; it was submitted, and its work index entry cannot be read "
                f"({damage(exc)}): no worker starts it, `tesserix run --resume` does"
            )
        if cancelled is not None:
            said += (
                f"; it was submitted and cancelled ({cancelled.describe()}) before its first "
                "checkpoint: nothing will start it"
            )
        elif parked is not None and any(
            parked_for(parked, e) for e in (CheckpointCorruptError, CheckpointFormatError)
        ):
            # The submission itself cannot be read: `run --resume` refuses it as well.
            said += (
                "; it was submitted and parked before its first checkpoint "
                f"({parked.reason}): nothing can start it from that submission; cancel it "
                "(`tesserix cancel`) and submit its input again under a new run id"
            )
        elif parked is not None:
            said += (
                "; it was submitted and parked before its first checkpoint "
                f"({parked.reason}); `tesserix run --resume` starts it"
            )
        else:
            said += (
                "; it was submitted and has not reached its first checkpoint (`tesserix "
                "runs` lists it; a running `tesserix worker` starts it)"
            )
    return NoCheckpointError(said)


async def parked_item(stores: Stores, tenant: str, run_id: str) -> WorkItem | None:
    """The run's parked work item, if the store has a work index and the run is parked
    (``None`` too when its entry cannot be read: the run's frontier still tells its story,
    and ``tesserix runs`` names the damaged entry)."""
    if stores.work is None:
        return None
    try:
        item = await stores.work.entry(tenant, run_id)
    except CheckpointCorruptError:
        return None
    return shown_entry(item) if item is not None and item.state is WorkState.parked else None


async def lost_to_workers(
    stores: Stores,
    tenant: str,
    cp: Checkpoint,
    lease: RunLease | None,
    entries: TenantEntries | None = None,
) -> bool:
    """Whether no worker will ever find the run (``blocked``'s ``unindexed``): nobody
    holds it, its frontier wants a worker (running, or waiting on an approval already
    decided) and the work index holds nothing a worker takes for it (no entry, or one
    marked ``done``: a lost entry, a row deleted, an older index restored). ``entries``:
    the tenant's, as a listing read them; the run's own entry is read again here, since a
    resume may have put it back meanwhile."""
    if lease is not None or stores.work is None or cp.carried_by is not None:
        return False
    if entries is not None and not entries.taken_by_no_worker(cp.run_id):
        return False
    if cp.status is CheckpointStatus.waiting_approval:
        if cp.pending_approval is None or stores.approvals is None:
            return False
        try:
            request = await stores.approvals.get(tenant, cp.pending_approval.id)
        except CheckpointCorruptError:
            return False  # a damaged request is named where the run's page reads it
        if request is None or request.status is ApprovalStatus.pending:
            return False  # it waits for a person, who wakes it by deciding
    elif cp.status is not CheckpointStatus.running:
        return False
    try:
        item = await stores.work.entry(tenant, cp.run_id)
    except CheckpointCorruptError:
        return False  # a damaged entry is named as such
    return item is None or item.state is WorkState.done


@dataclass(frozen=True, slots=True)
class LeftOpen:
    """What a run leaves for a person, as a resume would find it: the calls it leaves open
    (``calls``), and why else a resume refuses it whatever the agent (``refused``: its
    state lost a secret to masking, a replay that stopped), in words."""

    calls: int = 0
    refused: str | None = None


async def left_for_a_person(
    idempotency: IdempotencyStore,
    leases: LeaseStore | None,
    cp: Checkpoint,
    records: Iterable[IdempotencyRecord],
    lease: RunLease | None,
) -> LeftOpen:
    """What ``cp``'s run leaves for a person (``waits``): of an ended run, the calls
    ``left_open`` says (``records``: the run's); of one to be carried on, what its resume
    would refuse it for, asked as the resume asks (its plan: a call whose record has no
    flags, a read-only one with masked arguments, an unkeyed one in doubt; the state the
    frontier or its last completed call kept). A run a resume carries on waits for nobody,
    nor one whose calls in doubt another run carried now holds (``carried_elsewhere``).
    While the run's own ``lease`` is live, nothing is ``refused``: its holder has the run's
    state in hand, and carries it on.
    One whose calls in doubt a tool's reconciler would settle is counted too: what tools
    the agent has is not known here."""
    if cp.status.finished:
        return LeftOpen(calls=sum(map(left_open, records)))
    if cp.is_tombstone or cp.carried_by is not None:
        return LeftOpen()  # told by ``blocked``
    refused = uncarriable(cp)
    if refused is not None:
        return LeftOpen(refused=None if lease is not None else str(refused))
    plan = await plan_resume(cp, idempotency)
    calls = 0 if nothing_ran_since_approval_asked(cp, plan) else len(plan.indeterminate)
    if calls:
        try:
            await carried_elsewhere(plan, leases, tenant=cp.tenant, run_id=cp.run_id)
        except ResumeConflictError:
            calls = 0  # its calls wait on another run carried now: it comes back by itself
    if lease is not None:
        return LeftOpen(calls=calls)
    return LeftOpen(calls=calls, refused=await state_refused(idempotency, cp, plan))


async def state_refused(
    idempotency: IdempotencyStore, cp: Checkpoint, plan: ResumePlan
) -> str | None:
    """Why a resume refuses the unfinished run for the state its last completed call since
    the frontier recorded (``carried_state``: it lost a secret to masking), or ``None``. A
    record of a newer release, or damaged, raises as it does for the resume."""
    if cp.status.finished or cp.is_tombstone:
        return None
    try:
        await carried_state(idempotency, cp.tenant, cp.run_id, cp, plan)
    except StateRedactedError as exc:
        return str(exc)
    return None


def carriable(cp: Checkpoint, plan: ResumePlan, refused: str | None = None) -> bool:
    """Whether a resume may carry the run on as its plan stands (``inspect``'s ``safe``,
    the console's "can be carried on"): nothing in doubt (an unkeyed call of a turn waiting
    on its approval is not: it never went out), not a tombstone, which plans nothing yet no
    resume carries on, and nothing else a resume refuses it for whatever the agent
    (``uncarriable``: it failed, its state lost a secret, a replay that stopped; or
    ``refused``, ``state_refused``'s answer)."""
    if cp.is_tombstone or uncarriable(cp) is not None or refused is not None:
        return False
    return plan.safe or nothing_ran_since_approval_asked(cp, plan)


def told_from(shown: Checkpoint, told_by: Checkpoint | None) -> str | None:
    """Whose conversation is shown for ``shown`` when it is a tombstone and ``told_by``
    (``Checkpointer.last_written_whole``) is another step, or none; ``None`` otherwise."""
    if told_by is shown:
        return None
    kept = (
        "no step before it was written whole"
        if told_by is None
        else f"the conversation shown is step {told_by.step}'s, the last written whole"
    )
    return f"step {shown.step} is a tombstone ({shown.reason}): {kept}"


def waits(*, parked: bool, open_calls: int, lease: RunLease | None, blocked: str | None) -> bool:
    """Whether a run waits for a person (``runs --stuck``, the console's "stuck"): parked,
    calls left open (``open_calls``) with nobody holding the run, or ``blocked`` (no worker
    carries it on)."""
    return parked or (open_calls > 0 and lease is None) or blocked is not None


def blocked(
    cp: Checkpoint,
    parked: WorkItem | None,
    revision: str | None,
    *,
    unindexed: bool = False,
    refused: str | None = None,
) -> str | None:
    """Why no worker carries the run on, in words, or ``None``: it failed, its frontier
    was refused, a resume ``refused`` it (``LeftOpen.refused``), it was parked, it is pinned
    to another revision than ``revision`` (the current agent's, when known) and needs
    ``tesserix run --resume --accept-revision``, or it is ``unindexed``: no worker ever
    finds it (``lost_to_workers``)."""
    if cp.status is CheckpointStatus.failed:
        return f"failed: {failure_reason(cp)}"
    if cp.is_tombstone:
        return f"refused frontier: {cp.reason}"
    if cp.carried_by is not None:
        return None  # its workflow carries it (or reports it stuck), never a kit worker
    if cp.status.finished:
        return None
    if refused is not None:
        return f"every resume refuses it: {refused}"
    if unindexed:
        why = (
            "its approval was decided, but the work index was not told"
            if cp.status is CheckpointStatus.waiting_approval
            else "the work index holds no entry a worker takes for it"
        )
        return (
            f"no worker will find it: {why} (an entry lost or marked done, or a runner "
            "without the index); carry it on with `tesserix run --resume RUN --tenant T "
            "--agent MODULE:ATTR`, which puts the entry back"
        )
    refused_revision = parked is not None and parked_for(parked, RevisionMismatchError)
    if revision is not None and cp.agent_revision == revision:
        if refused_revision:
            # A worker of another revision parked it (a rolling deploy): nothing to accept.
            return (
                f"parked by a worker of another agent revision; it is pinned to the current "
                f"one ({revision}), whose workers take it again by themselves, or carry it on "
                "with `tesserix run --resume RUN --tenant T --agent MODULE:ATTR`"
            )
        return None
    if revision is not None or refused_revision:
        return (
            f"needs agent revision {cp.agent_revision}"
            + ("" if revision is None else f" (the agent is now {revision})")
            + ": a worker of that revision takes it again by itself; with another, carry it "
            "on with `tesserix run --resume RUN --tenant T --agent MODULE:ATTR "
            "--accept-revision --by NAME`"
        )
    return None
