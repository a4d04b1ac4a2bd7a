"""``tesserix show RUN --tenant T [--step N]``: the run's story, from what the stores keep.

Each step's boundary (from the step snapshots), the model's turns (from the transcript),
each call with its key digest, disposition, outcome (as stored: redacted) and who resolved
it (or, for a call claimed again, who said it never ran), the approvals and who decided
them, the fences the run was written under and the holders seen at each, a cancel request,
accepted revision changes, and spend. What a backend does not keep is said in
``not_kept`` rather than left out silently.

The story is built once as a JSON-able dict (``--json`` prints it as it is) and the text
is rendered from it, so the two cannot drift.
"""

from __future__ import annotations

import argparse
import json
from typing import Any, TextIO

from tesserix_adk.checkpoint.checkpointer import Checkpointer
from tesserix_adk.checkpoint.payload import Checkpoint, decode_outcome, record_tag
from tesserix_adk.checkpoint.planning import as_seen_now, plan_resume
from tesserix_adk.cli.failures import ExitCode
from tesserix_adk.cli.jsonout import claim_json, emit, key_digest, lease_json, when
from tesserix_adk.cli.reasons import failure_reason, no_frontier, parked_item, told_from
from tesserix_adk.cli.text import escaped
from tesserix_adk.errors import CheckpointCorruptError, CheckpointFormatError, NoCheckpointError
from tesserix_adk.messages import Message, Role
from tesserix_adk.run.attempt import run_claim_key
from tesserix_adk.run.cancelling import cancel_requested
from tesserix_adk.run.upgrade import accepted_revisions
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.stores.capabilities import ledger_totals
from tesserix_adk.stores.protocols import IdempotencyRecord, RecordStatus, StepHistory

__all__ = ["run_show", "story"]

_LEASES_KEEP = (
    "the lease store keeps only the live lease and when the last one ended; earlier "
    "holders are known only from the fence of each step and the holder of each call record"
)


async def run_show(args: argparse.Namespace, stores: Stores, out: TextIO) -> ExitCode:
    """Print the story of ``args.run`` (text, or JSON with ``args.json``)."""
    told = await story(stores, args.tenant, args.run, step=args.step)
    if args.json:
        emit(out, told)
    else:
        out.write(render(told))
    return ExitCode.CARRIED_ON


async def story(stores: Stores, tenant: str, run_id: str, *, step: int | None) -> dict[str, Any]:
    """The run's story as a dict of stable field names (see the module docstring)."""
    checkpointer = Checkpointer.from_stores(stores)
    cp = await checkpointer.latest(tenant, run_id)
    if cp is None:
        raise await no_frontier(stores, tenant, run_id)
    not_kept = [_LEASES_KEEP]
    snapshots = await _snapshots(stores, checkpointer, cp, not_kept)
    if step is not None:
        snapshots = [s for s in snapshots if s.step == step]
        if not snapshots:
            # Read again, alone: a damaged snapshot raises its own error (exit 4), never
            # "no such step".
            await checkpointer.at(tenant, run_id, step)
            raise NoCheckpointError(f"run {run_id!r} has no step {step} on record")
    shown = snapshots[-1] if step is not None else cp
    told_by = await checkpointer.last_written_whole(shown)
    transcript = [] if told_by is None else await checkpointer.messages(told_by)
    said = told_from(shown, told_by)
    if said is not None:
        not_kept.append(said)
    shown_until = _message_count(told_by) if told_by is not None else 0
    records = await stores.idempotency.records(tenant, run_id)
    calls = [r for r in records if r.tool is not None]
    fences = {s.step: s.fence for s in snapshots}
    approvals = await _approvals(stores, tenant, snapshots)
    decided = {
        c["call_id"]: {"request": a["id"], "approved": a["status"] == "approved", "by": a["by"]}
        for a in approvals
        if a["status"] != "pending"
        for c in a["calls"]
    }
    first_result = _first_result_step(snapshots, transcript)
    lease = await stores.leases.current(tenant, run_id)
    plan = as_seen_now(await plan_resume(cp, stores.idempotency), lease)
    planned = {p.key: str(p.disposition) for p in plan.calls if p.key is not None}
    claim_key = run_claim_key(tenant, run_id)
    claim = next((r for r in records if r.key == claim_key), None)
    cancel = await cancel_requested(stores.idempotency, tenant, run_id)
    parked = await parked_item(stores, tenant, run_id)
    spent, usage = await ledger_totals(stores.ledger, tenant, run_id)
    return {
        "run_id": cp.run_id,
        "tenant": cp.tenant,
        "agent": cp.agent_name,
        "revision": cp.agent_revision,
        "replay_of": cp.replay_of,
        "status": str(cp.status),
        "step": cp.step,
        "boundary": None if cp.boundary is None else str(cp.boundary),
        "iteration": cp.iteration,
        "output": cp.output,
        "reason": failure_reason(cp, parked),
        "parked": None if parked is None else parked.reason,
        "written_at": when(cp.written_at),
        "spent": {
            "micros": spent,
            "input_tokens": usage.input_tokens,
            "output_tokens": usage.output_tokens,
        },
        "lease": lease_json(lease),
        "last_lease_ended_ago": await stores.leases.ended_ago(tenant, run_id),
        "resume_claim": claim_json(claim),
        "fences": _fences(snapshots, calls, run_id),
        "steps": [_step_json(s) for s in snapshots],
        "turns": _turns(transcript[:shown_until]),
        "calls": [
            _call_json(tenant, r, planned, fences, first_result, decided)
            for r in calls
            if step is None or _in_view(r, transcript[:shown_until], snapshots[-1])
        ],
        "approvals": approvals,
        "cancel": None
        if cancel is None
        else {"by": cancel.by, "at": when(cancel.at), "reason": cancel.reason},
        "accepted_revisions": [
            {
                "by": a.by,
                "at": when(a.at),
                "from_revision": a.from_revision,
                "to_revision": a.to_revision,
                "step": a.step,
                "note": a.note,
            }
            for a in await accepted_revisions(stores.idempotency, tenant, run_id)
        ],
        "not_kept": not_kept,
    }


async def _snapshots(
    stores: Stores, checkpointer: Checkpointer, cp: Checkpoint, not_kept: list[str]
) -> list[Checkpoint]:
    if not isinstance(stores.checkpoints, StepHistory):
        not_kept.append(
            f"the store {type(stores.checkpoints).__name__} keeps no step snapshots: only the "
            "latest frontier is shown"
        )
        return [cp]
    found: list[Checkpoint] = []
    for step in await checkpointer.steps(cp.tenant, cp.run_id):
        try:
            snapshot = await checkpointer.at(cp.tenant, cp.run_id, step)
        except (CheckpointCorruptError, CheckpointFormatError) as exc:
            not_kept.append(f"step {step} cannot be read: {exc}")
            continue
        if snapshot is not None:
            found.append(snapshot)
    if not found or found[-1].step != cp.step:
        found.append(cp)
    return found


def _message_count(cp: Checkpoint) -> int:
    if cp.messages is not None:
        return len(cp.messages)
    return 0 if cp.history_handle is None else cp.history_handle.count


def _first_result_step(snapshots: list[Checkpoint], transcript: list[Message]) -> dict[str, int]:
    """For each call id, the first step whose transcript holds its result."""
    at: dict[str, int] = {}
    for snap in snapshots:
        for message in transcript[: _message_count(snap)]:
            if message.role is Role.tool and message.tool_call_id is not None:
                at.setdefault(message.tool_call_id, snap.step)
    return at


def _fences(
    snapshots: list[Checkpoint], calls: list[IdempotencyRecord], run_id: str
) -> list[dict[str, Any]]:
    by_fence: dict[int, dict[str, Any]] = {}

    def entry(fence: int) -> dict[str, Any]:
        return by_fence.setdefault(fence, {"fence": fence, "steps": [], "holders": []})

    for snap in snapshots:
        if snap.fence is not None:
            entry(snap.fence)["steps"].append(snap.step)
    for rec in calls:
        # A claim another run took over carries that run's holder and fence, not this run's.
        if rec.fence is not None and rec.holding_run == run_id:
            holders = entry(rec.fence)["holders"]
            if rec.holder not in holders:
                holders.append(rec.holder)
    return [by_fence[f] for f in sorted(by_fence)]


def _step_json(snap: Checkpoint) -> dict[str, Any]:
    return {
        "step": snap.step,
        "boundary": None if snap.boundary is None else str(snap.boundary),
        "status": str(snap.status),
        "iteration": snap.iteration,
        "fence": snap.fence,
        "revision": snap.agent_revision,
        "written_at": when(snap.written_at),
        "outstanding": [
            {"tool": o.call.name, "call_id": o.call.id, "key_digest": key_digest(o.key)}
            for o in snap.outstanding
        ],
        "pending_approval": None if snap.pending_approval is None else snap.pending_approval.id,
    }


def _turns(messages: list[Message]) -> list[dict[str, Any]]:
    turns: list[dict[str, Any]] = []
    for message in messages:
        if message.role is Role.assistant:
            turns.append(
                {
                    "turn": len(turns) + 1,
                    "text": message.text,
                    "calls": [{"tool": c.name, "call_id": c.id} for c in message.tool_calls],
                }
            )
    return turns


def _in_view(rec: IdempotencyRecord, messages: list[Message], snap: Checkpoint) -> bool:
    asked = {c.id for m in messages for c in m.tool_calls}
    return rec.call_id in asked or rec.key in {o.key for o in snap.outstanding}


def _disposition(
    rec: IdempotencyRecord, fences: dict[int, int | None], first_result: dict[str, int]
) -> str:
    """dispatched / replayed / reconciled / resolved, or where a call still stands."""
    if rec.by is not None:
        return "reconciled" if rec.by.startswith("reconciler:") else "resolved"
    if rec.status is not RecordStatus.completed:
        return str(rec.status)
    step = first_result.get(rec.call_id or "")
    if step is not None and rec.fence is not None:
        written = fences.get(step)
        if written is not None and written != rec.fence:
            return "replayed"  # a later holder delivered the recorded outcome
    return "dispatched"


def _call_json(
    tenant: str,
    rec: IdempotencyRecord,
    planned: dict[str, str],
    fences: dict[int, int | None],
    first_result: dict[str, int],
    decided: dict[str, dict[str, Any]],
) -> dict[str, Any]:
    outcome: Any = None
    error = False
    if rec.outcome is not None:
        try:
            decoded = decode_outcome(
                bytes(rec.outcome), rec.call_id or "", record=record_tag(tenant, rec.key)
            )
            outcome, error = decoded.content, decoded.is_error
        except CheckpointCorruptError as exc:
            outcome = f"(unreadable: {exc})"
    return {
        "tool": rec.tool,
        "call_id": rec.call_id,
        "key_digest": key_digest(rec.key),
        "iteration": rec.iteration,
        "status": str(rec.status),
        "disposition": _disposition(rec, fences, first_result),
        "plan": planned.get(rec.key),
        "holder": rec.holder,
        "fence": rec.fence,
        "since": when(rec.since),
        "completed_at": when(rec.completed_at),
        "expires_at": when(rec.expires_at),
        "by": rec.by,
        "never_ran_by": rec.never_ran_by,
        "holder_run": rec.holder_run,
        # The run whose call it is: another run's, on a call this run took over.
        "call_of": rec.run_id,
        "approval": decided.get(rec.call_id or ""),
        "outcome": outcome,
        "is_error": error,
    }


async def _approvals(
    stores: Stores, tenant: str, snapshots: list[Checkpoint]
) -> list[dict[str, Any]]:
    ids: list[str] = []
    for snap in snapshots:
        if snap.pending_approval is not None:
            ids.append(snap.pending_approval.id)
        ids.extend(g.request for g in snap.grants)
    shown = []
    for request_id in dict.fromkeys(ids):
        request = await stores.approvals.get(tenant, request_id)
        if request is None:
            continue
        shown.append(
            {
                "id": request.id,
                "status": str(request.status),
                "by": request.by,
                "note": request.note,
                "calls": [{"tool": c.name, "call_id": c.id} for c in request.calls],
                "requested_at": when(request.requested_at),
                "decided_at": when(request.decided_at),
            }
        )
    return shown


# --- text ---------------------------------------------------------------------------------


def _e(value: Any) -> str:
    return "-" if value is None else escaped(str(value))


def render(told: dict[str, Any]) -> str:
    """The story as lines an operator reads; every value from a store is ``escaped``."""
    t = told
    spent = t["spent"]
    lines = [
        f"run {_e(t['run_id'])}  tenant {_e(t['tenant'])}  agent {_e(t['agent'])}  "
        f"revision {_e(t['revision'])}",
        f"{t['status']} at step {t['step']} ({_e(t['boundary'])}), iteration {t['iteration']}, "
        f"written {_e(t['written_at'])}",
        f"spent {spent['micros']} micros, {spent['input_tokens']} in, {spent['output_tokens']} out",
    ]
    if t["replay_of"]:
        # A replay's calls went to stubs (or tools named live), never in the original's name.
        lines.insert(1, f"replay of {_e(t['replay_of'])} (debugging: never carried on)")
    if t["reason"]:
        lines.append(f"why: {_e(t['reason'])}")
    if t["output"] and not t["reason"]:
        lines.append(f"output: {_e(t['output'])}")
    lease = t["lease"]
    if lease is not None:
        lines.append(
            f"lease: held by {_e(lease['holder'])} (fence {lease['fence']}) until "
            f"{lease['expires_at']}"
        )
    else:
        ago = t["last_lease_ended_ago"]
        ended = "" if ago is None else f"; the last one ended {ago:.1f} s ago by the store's clock"
        lines.append(f"lease: none live{ended}")
    lines.append("fences:")
    for f in t["fences"]:
        steps = ", ".join(str(s) for s in f["steps"]) or "-"
        holders = ", ".join(escaped(h) for h in f["holders"]) or "no call record names one"
        lines.append(f"  fence {f['fence']}: steps {steps}; holders {holders}")
    lines.append("steps:")
    for s in t["steps"]:
        extra = "".join(f"  asks {_e(o['tool'])} ({_e(o['call_id'])})" for o in s["outstanding"])
        if s["pending_approval"]:
            extra += f"  waits on {_e(s['pending_approval'])}"
        lines.append(
            f"  step {s['step']:<3} {_e(s['boundary']):<18} {s['status']:<16} "
            f"iteration {s['iteration']}  fence {_e(s['fence'])}  {_e(s['written_at'])}{extra}"
        )
    lines.append("turns:")
    for turn in t["turns"]:
        asked = ", ".join(f"{_e(c['tool'])} ({_e(c['call_id'])})" for c in turn["calls"])
        said = f" says {_e(_short(turn['text']))}" if turn["text"] else ""
        lines.append(f"  turn {turn['turn']}:{said}" + (f" asks {asked}" if asked else ""))
    lines.append("calls:")
    for c in t["calls"]:
        who = f" by {_e(c['by'])}" if c["by"] else ""
        if c["approval"] is not None:
            verdict = "approved" if c["approval"]["approved"] else "denied"
            who += f", {verdict} by {_e(c['approval']['by'])}"
        if c["never_ran_by"]:
            who += f", claimed again after {_e(c['never_ran_by'])} said it never ran"
        if c["call_of"] != t["run_id"]:
            first = _e(c["call_of"])
            who += f", run {first}'s call taken over by this run (resolved on run {first})"
        elif c["holder_run"]:
            who += f", taken over by run {_e(c['holder_run'])}"
        lines.append(
            f"  {_e(c['tool'])} ({_e(c['call_id'])}) key {c['key_digest']}: {c['disposition']}"
            f"{who}; holder {_e(c['holder'])} fence {_e(c['fence'])}; outcome "
            f"{_e(_short(c['outcome']))}"
        )
    for a in t["approvals"]:
        note = f": {_e(a['note'])}" if a["note"] else ""
        lines.append(f"approval {_e(a['id'])} {a['status']} by {_e(a['by'])}{note}")
    if t["cancel"]:
        lines.append(f"cancel requested by {_e(t['cancel']['by'])} at {t['cancel']['at']}")
    for a in t["accepted_revisions"]:
        note = f": {_e(a['note'])}" if a["note"] else ""
        lines.append(
            f"revision {_e(a['from_revision'])} accepted as {_e(a['to_revision'])} by "
            f"{_e(a['by'])} at {a['at']} (step {a['step']}){note}"
        )
    lines.extend(f"not kept: {_e(n)}" for n in t["not_kept"])
    return "\n".join(lines) + "\n"


def _short(value: Any, limit: int = 160) -> str:
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= limit else text[: limit - 1] + "…"
