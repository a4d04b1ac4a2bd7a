"""Upgrading an in-flight run: an operator accepts that a run pinned to one agent revision
is carried on under another.

Pinning a run to its revision is right by default (a resumed run does what the run that
was checkpointed would have done), but alone it strands every run in flight after a deploy.
An operator who knows the change is harmless accepts it, by name: under the run's lease the
frontier is rewritten with the current revision (a new step, same transcript, same calls),
and the acceptance is recorded in the idempotency store under the run's acceptance key (a
record with no tool, as a cancel request is): who, when, from which revision to which, and
why. The run is then resumed as any other. It is refused when any outstanding call's tool
is gone or its flags changed, since the plan for that call was made with the old flags.
A worker never does this by itself.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from dataclasses import dataclass

from tesserix_adk.agent import Agent
from tesserix_adk.checkpoint.checkpointer import TranscriptCursor
from tesserix_adk.checkpoint.payload import (
    Checkpoint,
    CheckpointStatus,
    decode_outcome,
    encode_outcome,
    record_tag,
)
from tesserix_adk.checkpoint.redaction import Redactor
from tesserix_adk.errors import (
    CheckpointCorruptError,
    CheckpointTooLargeError,
    ConfigurationError,
    NoCheckpointError,
    RevisionMismatchError,
    RunFailedError,
    StoreUnavailableError,
)
from tesserix_adk.messages import ToolOutcome
from tesserix_adk.run.attempt import Attempt, RunClaim, new_holder
from tesserix_adk.run.holding import holding
from tesserix_adk.run.resume import refuse_carried_by_workflow
from tesserix_adk.run.runner import AgentRunner
from tesserix_adk.stores.protocols import IdempotencyRecord, IdempotencyStore, RecordStatus
from tesserix_adk.tools import canonical_json

__all__ = [
    "RevisionAcceptance",
    "acceptance_key",
    "accept_revision",
    "accepted_revisions",
    "revision_differences",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class RevisionAcceptance:
    """Who accepted carrying the run on from ``from_revision`` to ``to_revision``, when
    (epoch seconds), why, and at which step the rewritten frontier was written."""

    by: str
    at: float
    from_revision: str | None
    to_revision: str
    step: int
    note: str | None = None

    def describe(self) -> str:
        """``revision <from> accepted as <to> by <by>[: <note>]``."""
        text = f"revision {self.from_revision} accepted as {self.to_revision} by {self.by}"
        return text + (f": {self.note}" if self.note else "")


def acceptance_key(tenant: str, run_id: str, from_revision: str | None, to_revision: str) -> str:
    """The idempotency key of one accepted revision change of a run."""
    body = canonical_json(["accept-revision", tenant, run_id, from_revision, to_revision])
    return "accept1:" + hashlib.sha256(body.encode("utf-8")).hexdigest()


def revision_differences(
    cp: Checkpoint, agent: Agent, records: list[IdempotencyRecord]
) -> list[str]:
    """What stops ``agent`` from carrying ``cp`` on: each outstanding or in-flight call whose
    tool is gone or whose flags differ, and each call that ran past the frontier whose tool
    is gone, in words; empty when nothing does."""
    found: list[str] = []
    if cp.agent_name != agent.name:
        found.append(f"the run belongs to agent {cp.agent_name!r}, not {agent.name!r}")
    pending = set() if cp.pending_approval is None else set(cp.pending_approval.calls)
    for out in cp.outstanding:
        call = f"{out.call.name} ({out.call.id})"
        tool = agent.tools.get(out.call.name)
        if tool is None:
            found.append(f"{call}: the tool no longer exists")
            continue
        for flag, was in (("side_effects", out.side_effects), ("idempotent", out.idempotent)):
            now = getattr(tool, flag)
            if now != was:
                found.append(f"{call}: {flag} was {was}, now {now}")
        if (out.key is not None) != tool.keyed:
            # The frontier's key (or its absence) decides how resume treats the call.
            found.append(f"{call}: keyed was {out.key is not None}, now {tool.keyed}")
        if out.call.id in pending and not tool.requires_approval:
            found.append(f"{call}: requires_approval was True, now False")
    for rec in records:
        if rec.tool is None:
            continue
        call = f"{rec.tool} ({rec.call_id})"
        if (
            rec.status is RecordStatus.completed
            and rec.iteration is not None
            and rec.iteration > cp.iteration
            and rec.tool not in agent.tools
        ):
            # It ran past the frontier: the model must ask for it again (run.loop refuses
            # a turn that does not), which a revision without the tool never can.
            found.append(f"{call} (ran past the frontier): the tool no longer exists")
            continue
        if rec.status is not RecordStatus.in_flight:
            continue
        tool = agent.tools.get(rec.tool)
        if tool is None:
            found.append(f"{call} (in flight): the tool no longer exists")
            continue
        if not tool.keyed:
            # Its record is keyed; unkeyed now, a resume would treat the call another way.
            found.append(f"{call} (in flight): keyed was True, now False")
        if rec.flags is not None:
            for flag in ("side_effects", "idempotent"):
                was, now = getattr(rec.flags, flag), getattr(tool, flag)
                if was != now:
                    found.append(f"{call} (in flight): {flag} was {was}, now {now}")
    return list(dict.fromkeys(found))


async def accept_revision(
    runner: AgentRunner,
    agent: Agent,
    run_id: str,
    *,
    tenant: str,
    by: str,
    note: str | None = None,
) -> RevisionAcceptance | None:
    """Under the run's lease, rewrite its frontier with ``agent``'s revision and record who
    accepted the change; ``None`` if the run is already on that revision. Refused with
    ``RevisionMismatchError`` (naming what differs) when a call's tool is gone or changed.

    ``runner`` is the ``AgentRunner`` that resumes the run afterwards (its stores, lease
    policy and redactor are used here).
    """
    idempotency = runner.idempotency
    if runner.checkpoints is None:
        raise ConfigurationError("accepting a revision needs a checkpoint store")
    attempt = Attempt(holder=new_holder("accept-revision"))
    # The resume claim as a resume takes it: without a lease store it alone keeps a live
    # resumer from carrying the run on while its frontier is rewritten.
    claim = RunClaim(
        idempotency,
        tenant=tenant,
        run_id=run_id,
        holder=attempt.holder,
        ttl=runner.resume_claim_ttl,
    )
    await claim.take()
    try:
        return await _accept_held(
            runner, agent, run_id, tenant=tenant, by=by, note=note, attempt=attempt
        )
    finally:
        await claim.release()


async def _accept_held(
    runner: AgentRunner,
    agent: Agent,
    run_id: str,
    *,
    tenant: str,
    by: str,
    note: str | None,
    attempt: Attempt,
) -> RevisionAcceptance | None:
    checkpoints = runner.checkpoints
    idempotency = runner.idempotency
    redactor = runner.redactor
    assert checkpoints is not None
    sealed = [
        s
        for s in (
            idempotency,
            runner.ledger,
            runner.approvals,
            checkpoints.store,
            checkpoints.history,
        )
        if s is not None
    ]
    async with holding(
        runner.leases, runner.lease_policy, sealed, attempt, tenant, run_id, resuming=True
    ):
        cp = await checkpoints.latest(tenant, run_id)
        if cp is None:
            raise NoCheckpointError(
                f"nothing is checkpointed under run {run_id!r} for tenant {tenant!r}"
            )
        # Before anything is written: a run its workflow carries is its workflow's.
        refuse_carried_by_workflow(cp)
        if cp.agent_revision == agent.revision:
            return None
        _carriable(cp)
        records = await idempotency.records(tenant, run_id)
        differences = revision_differences(cp, agent, records)
        if differences:
            raise RevisionMismatchError(
                f"run {run_id!r} cannot be carried on under agent revision {agent.revision}: "
                + "; ".join(differences)
            )
        acceptance = RevisionAcceptance(
            by=by,
            at=time.time(),
            from_revision=cp.agent_revision,
            to_revision=agent.revision,
            step=cp.step + 1,
            note=None if note is None else redactor.text(note),
        )
        await _record(idempotency, tenant, run_id, acceptance, redactor)
        messages = await checkpoints.messages(cp)
        frontier = dataclasses.replace(
            cp,
            step=cp.step + 1,
            agent_revision=agent.revision,
            fence=attempt.fence,
            messages=tuple(messages),
            written_at=time.time(),
        )
        cursor = TranscriptCursor(handle=cp.history_handle, persisted=len(messages))
        if not await checkpoints.write(frontier, cursor=cursor):
            raise checkpoints.last_error or StoreUnavailableError(
                f"the upgraded frontier of run {run_id!r} was not written"
            )
    return acceptance


def _carriable(cp: Checkpoint) -> None:
    if cp.is_tombstone:
        raise CheckpointTooLargeError(
            f"run {cp.run_id!r} cannot be carried on: its frontier at step {cp.step} was "
            f"refused ({cp.reason})",
            retryable=False,
        )
    if cp.status is CheckpointStatus.failed:
        raise RunFailedError(f"run {cp.run_id!r} ended failed at step {cp.step}: {cp.reason}")
    if cp.status.finished:
        raise RunFailedError(
            f"run {cp.run_id!r} already ended {cp.status} at step {cp.step}; there is "
            "nothing to carry on"
        )


async def _record(
    idempotency: IdempotencyStore,
    tenant: str,
    run_id: str,
    acceptance: RevisionAcceptance,
    redactor: Redactor,
) -> None:
    key = acceptance_key(tenant, run_id, acceptance.from_revision, acceptance.to_revision)
    holder = f"accept-revision:{acceptance.by}"
    rec = await idempotency.claim(
        key,
        holder=holder,
        tenant=tenant,
        run_id=run_id,
        iteration=None,
        tool=None,
        call_id=None,
        flags=None,
    )
    if rec.status is RecordStatus.completed:
        return  # the same change accepted before (a retry after a lost reply): it stands
    content = {
        "by": acceptance.by,
        "at": acceptance.at,
        "from": acceptance.from_revision,
        "to": acceptance.to_revision,
        "step": acceptance.step,
        "note": acceptance.note,
    }
    encoded = encode_outcome(
        ToolOutcome(call_id="accept-revision", content=content),
        redactor,
        record=record_tag(tenant, key),
    )
    await idempotency.complete(key, encoded, tenant=tenant, holder=holder)


async def accepted_revisions(
    idempotency: IdempotencyStore, tenant: str, run_id: str
) -> list[RevisionAcceptance]:
    """Every revision change accepted for the run, oldest first."""
    found: list[RevisionAcceptance] = []
    for rec in await idempotency.records(tenant, run_id):
        if not rec.key.startswith("accept1:") or rec.status is not RecordStatus.completed:
            continue
        if rec.outcome is None:
            continue
        content = decode_outcome(
            bytes(rec.outcome), "accept-revision", record=record_tag(tenant, rec.key)
        ).content
        if not isinstance(content, dict) or not isinstance(content.get("by"), str):
            raise CheckpointCorruptError(f"a revision acceptance of run {run_id!r} cannot be read")
        found.append(
            RevisionAcceptance(
                by=content["by"],
                at=float(content.get("at") or 0.0),
                from_revision=content.get("from"),
                to_revision=str(content.get("to")),
                step=int(content.get("step") or 0),
                note=content.get("note"),
            )
        )
    return sorted(found, key=lambda a: a.at)
