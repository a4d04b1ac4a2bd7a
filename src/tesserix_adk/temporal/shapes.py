"""What crosses Temporal: the workflow's input and result, each activity's input and result.

Only identifiers, numbers and the results the model is told cross: the transcript stays in
the kit's stores and crosses as a ``HistoryHandle``, so no payload grows with the
conversation. Plain frozen dataclasses of primitives, so Temporal's default converter
carries them and the workflow sandbox needs nothing else. This module imports nothing of
``temporalio``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any

from tesserix_adk.checkpoint.continuation import Continuation
from tesserix_adk.checkpoint.payload import Boundary, Checkpoint, Grant, PendingApproval
from tesserix_adk.errors import ResumeError
from tesserix_adk.stores.protocols import HistoryHandle

__all__ = [
    "MODEL_ACTIVITY",
    "TOOL_ACTIVITY",
    "WORKFLOW_NAME",
    "ActivityOptions",
    "CallRef",
    "Carried",
    "ContinueReason",
    "ModelStep",
    "RunInput",
    "RunOutcome",
    "StepKind",
    "StepResult",
    "ToolInput",
    "ToolResult",
    "carried_from",
    "carried_from_frontier",
    "continuation_from",
]

WORKFLOW_NAME = "tesserix.AgentWorkflow"
MODEL_ACTIVITY = "tesserix.model_turn"
TOOL_ACTIVITY = "tesserix.tool_call"


class StepKind(StrEnum):
    """What a model turn ended with."""

    calls = "calls"  # the model asked for tool calls: dispatch them
    finished = "finished"  # the run ended (completed, out of budget, cancelled, ...)
    waiting = "waiting"  # a call needs an approval nobody has given yet
    folded = "folded"  # the turn's results were written, no model was asked (continuing)


class ContinueReason(StrEnum):
    """Why an execution continued-as-new."""

    policy = "policy"  # ContinuationPolicy.due (steps or history bytes)
    suggested = "suggested"  # the server's is_continue_as_new_suggested()


@dataclass(frozen=True, slots=True, kw_only=True)
class ActivityOptions:
    """Timeouts of the workflow's activities, in seconds (Temporal retries each attempt)."""

    model_timeout: float = 300.0
    tool_timeout: float = 3600.0
    heartbeat_timeout: float = 30.0
    retry_initial: float = 0.5
    retry_max: float = 10.0


@dataclass(frozen=True, slots=True, kw_only=True)
class Carried:
    """A ``Continuation`` as plain data: handle, spend and iteration as numbers, approvals
    and grants as they are (see ``carried_from``/``continuation_from``)."""

    history: dict[str, Any] | None
    spent_micros: int
    iteration: int
    grants: list[dict[str, Any]] = field(default_factory=list)
    pending_approval: dict[str, Any] | None = None
    acting_under: list[str] = field(default_factory=list)


def carried_from(c: Continuation) -> Carried:
    """The plain form of a continuation."""
    pending = None
    if c.pending_approval is not None:
        pending = {"id": c.pending_approval.id, "calls": list(c.pending_approval.calls)}
    return Carried(
        history=None if c.history_handle is None else asdict(c.history_handle),
        spent_micros=c.spent_micros,
        iteration=c.iteration,
        grants=[asdict(g) for g in c.grants],
        pending_approval=pending,
        acting_under=sorted(c.acting_under),
    )


def carried_from_frontier(cp: Checkpoint, spent_micros: int) -> Carried:
    """What a new execution carries to go on from the frontier ``cp`` of an unfinished run
    (``carry_on_run``): the iteration it stands at (the next one after a turn whose results
    are folded in), its transcript handle, spend, approvals and grants."""
    if cp.status.finished or cp.is_tombstone:
        raise ResumeError(f"run {cp.run_id!r} has ended ({cp.status}); nothing carries on")
    if cp.boundary is Boundary.after_tool_result and cp.outstanding:
        # Only the kit's own runner leaves a turn half folded; it carries such a run on.
        raise ResumeError(
            f"run {cp.run_id!r} stands inside a turn its workflow did not write; carry it on "
            "with `tesserix run --resume` or a `tesserix worker` on the store"
        )
    folded = cp.boundary is Boundary.after_tool_result
    grants = tuple(cp.grants)
    acting = {g.request for g in grants}
    pending = None
    if cp.pending_approval is not None:
        pending = {"id": cp.pending_approval.id, "calls": list(cp.pending_approval.calls)}
        acting.add(cp.pending_approval.id)
    return Carried(
        history=None if cp.history_handle is None else asdict(cp.history_handle),
        spent_micros=spent_micros,
        iteration=cp.iteration + 1 if folded else cp.iteration,
        grants=[asdict(g) for g in grants],
        pending_approval=pending,
        acting_under=sorted(acting),
    )


def continuation_from(c: Carried, *, tenant: str, agent_name: str, run_id: str) -> Continuation:
    """The continuation back (its checks run again: a dropped approval cannot cross)."""
    pending = None
    if c.pending_approval is not None:
        pending = PendingApproval(
            id=c.pending_approval["id"], calls=tuple(c.pending_approval["calls"])
        )
    return Continuation(
        tenant=tenant,
        agent_name=agent_name,
        run_id=run_id,
        history_handle=None if c.history is None else HistoryHandle(**c.history),
        spent_micros=c.spent_micros,
        iteration=c.iteration,
        grants=tuple(Grant(**g) for g in c.grants),
        pending_approval=pending,
        acting_under=frozenset(c.acting_under),
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class RunInput:
    """The workflow's input: the run, the agent revision it is pinned to, and either the
    user's input (a new run) or what the previous execution carried over."""

    tenant: str
    run_id: str
    agent_name: str
    agent_revision: str
    input: str | None = None
    carried: Carried | None = None
    max_steps: int = 1000
    max_history_bytes: int = 8 * 1024 * 1024
    options: ActivityOptions = field(default_factory=ActivityOptions)
    # Why each earlier execution of this chain continued-as-new, oldest first.
    chain: list[ContinueReason] = field(default_factory=list)
    # Seconds between looks at the approval store while the run waits on a person.
    approval_poll: float = 2.0
    # Started by ``carry_on_run`` after an execution closed unfinished (not continued).
    carried_on: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class RunOutcome:
    """How the run ended, and the chain of executions that got it there."""

    run_id: str
    status: str
    output: str | None
    iteration: int
    chain: list[ContinueReason] = field(default_factory=list)


@dataclass(frozen=True, slots=True, kw_only=True)
class CallRef:
    """A call of a turn, named as its frontier names it: by its id and its place among the
    turn's calls (a model may give two calls one id)."""

    call_id: str
    tool: str
    position: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolResult:
    """What the model is told of one call. A call with a completed record crosses as
    ``recorded`` alone: the next model activity reads its outcome from the idempotency
    store, so no tool's result (redacted or not, large or not) ever enters Temporal's
    history; only an unrecorded answer (refused, unkeyed) crosses, redacted and capped."""

    call_id: str
    content: Any = None
    is_error: bool = False
    recorded: bool = False
    # The call's place among its turn's calls (0 from a kit before it was carried).
    position: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelStep:
    """The model activity's input: fold the previous turn's results (if any), then ask the
    model at ``iteration`` — or only fold (``fold_only``), before continuing-as-new. A turn
    the frontier holds open at ``iteration`` is never asked again: its approval's decision
    is looked for, or its calls handed back."""

    tenant: str
    run_id: str
    agent_name: str
    agent_revision: str
    iteration: int
    input: str | None = None
    results: list[ToolResult] | None = None
    fold_only: bool = False
    # What the previous execution carried: the frontier must name the same transcript.
    history: dict[str, Any] | None = None
    # The first turn of an execution carrying on a run whose workflow closed unfinished
    # (``carry_on_run``): a call of its open turn the closed one may have sent is in doubt.
    resumed: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class StepResult:
    """What a model turn ended with, and what a continuation would carry from here."""

    kind: StepKind
    iteration: int
    calls: list[CallRef] = field(default_factory=list)
    status: str | None = None
    output: str | None = None
    approval: str | None = None
    history: dict[str, Any] | None = None
    spent_micros: int = 0
    grants: list[dict[str, Any]] = field(default_factory=list)


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolInput:
    """One tool call's activity input: the run, the turn and the call, as the frontier
    names it (its key is computed from the frontier, never from Temporal's ids)."""

    tenant: str
    run_id: str
    agent_name: str
    agent_revision: str
    iteration: int
    call_id: str
    # The call's place among its turn's calls (0 from a kit before it was carried).
    position: int = 0
