"""The frontier (``Checkpoint``) and the records it holds: outstanding calls, the pending
approval, grants. Encoded and decoded by ``frontier_codec``."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from tesserix_adk.checkpoint.payload.envelope import CHECKPOINT_FORMAT
from tesserix_adk.messages import Message, ToolCall, Usage
from tesserix_adk.stores.protocols import HistoryHandle

__all__ = [
    "Boundary",
    "Carrier",
    "Checkpoint",
    "CheckpointStatus",
    "Grant",
    "OutstandingCall",
    "PendingApproval",
]


class Boundary(StrEnum):
    """The only places a frontier is written: nothing is half-done at any of them."""

    after_model_call = "after_model_call"
    after_tool_result = "after_tool_result"
    before_approval = "before_approval"


class Carrier(StrEnum):
    """A workflow engine that carries a run in the kit's place (``Checkpoint.carried_by``)."""

    temporal = "temporal"


class CheckpointStatus(StrEnum):
    """Where the run stood when the frontier was written."""

    running = "running"
    waiting_approval = "waiting_approval"
    completed = "completed"
    budget_exhausted = "budget_exhausted"
    max_iterations = "max_iterations"
    failed = "failed"
    cancelled = "cancelled"
    tombstone = "tombstone"

    @property
    def finished(self) -> bool:
        """A final frontier: resuming it calls no model and dispatches nothing."""
        return self in _FINISHED


_FINISHED = frozenset(
    {
        CheckpointStatus.completed,
        CheckpointStatus.budget_exhausted,
        CheckpointStatus.max_iterations,
        CheckpointStatus.failed,
        CheckpointStatus.cancelled,
    }
)


@dataclass(frozen=True, slots=True, kw_only=True)
class OutstandingCall:
    """A call the model asked for and the frontier has no result for yet.

    It carries its key and its tool's flags so planning needs no agent. ``redacted`` says
    redaction changed its arguments: such a call is never re-sent from the frontier.
    """

    call: ToolCall
    key: str | None
    side_effects: bool = True
    idempotent: bool = False
    redacted: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class PendingApproval:
    """The approval request a waiting run stopped on."""

    id: str
    calls: tuple[str, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class Grant:
    """A person's decision on one call."""

    request: str
    call_id: str
    key: str | None
    approved: bool
    by: str | None
    note: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Checkpoint:
    """A run's frontier (or a step snapshot, or a tombstone), decoded and verified.

    ``messages`` is set when the transcript is inline, ``history_handle`` when it lives in a
    ``HistoryStore``. ``usage``/``micros`` are for reporting: the ledger decides spend.
    ``observation`` is the last turn's tool results (what an operator replaying a step
    wants to see first). Where the transcript lives in a ``HistoryStore``, an entry it holds
    word for word is stored as its position there (``content_at``) instead of a copy:
    ``Checkpointer.observation`` reads it back whole. ``state`` is the agent's typed state
    as JSON; ``state_redacted`` says it lost a value to masking (a secret the redactor
    masked, or a pydantic secret type), so no run is carried on from it. ``carried_by``
    names the workflow engine that carries the run (``Carrier.temporal``); ``None`` for a
    run the kit carries itself. The kit's own resume and workers leave such a run to its
    engine.
    """

    format: int = CHECKPOINT_FORMAT
    tenant: str
    run_id: str
    agent_name: str
    agent_revision: str | None = None
    step: int
    boundary: Boundary | None = None
    status: CheckpointStatus
    iteration: int = 0
    fence: int | None = None
    messages: tuple[Message, ...] | None = None
    history_handle: HistoryHandle | None = None
    outstanding: tuple[OutstandingCall, ...] = ()
    pending_approval: PendingApproval | None = None
    grants: tuple[Grant, ...] = ()
    usage: Usage = field(default_factory=Usage)
    micros: int = 0
    state: Any = None
    state_redacted: bool = False
    steps_used: int = 0
    replay_of: str | None = None
    output: str | None = None
    reason: str | None = None
    written_at: float | None = None
    observation: Any = None
    carried_by: Carrier | None = None

    @property
    def is_tombstone(self) -> bool:
        """An oversized frontier was refused here; resuming must refuse too."""
        return self.status is CheckpointStatus.tombstone
