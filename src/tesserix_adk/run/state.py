"""``RunState``: what a frontier persists, and nothing that belongs to one attempt.

A run's state survives the process: it is written into every frontier and read back from
the latest one on resume. Who carries the run now (holder, lease, claims) is the
``Attempt``'s business and never enters a frontier.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tesserix_adk.agent import Agent
from tesserix_adk.checkpoint.checkpointer import TranscriptCursor
from tesserix_adk.checkpoint.payload import (
    Boundary,
    Carrier,
    Checkpoint,
    CheckpointStatus,
    Grant,
    OutstandingCall,
    PendingApproval,
)
from tesserix_adk.checkpoint.state_json import secret_typed, state_to_json
from tesserix_adk.messages import Message, Usage
from tesserix_adk.run.result import Run, RunStatus
from tesserix_adk.stores.protocols import ApprovalRequest

__all__ = ["RunState", "as_messages"]


@dataclass(slots=True, kw_only=True)
class RunState:
    """The run as its next frontier will record it."""

    agent: Agent
    tenant: str
    run_id: str
    messages: list[Message]
    iteration: int = 0
    step: int = 0
    steps_used: int = 0
    usage: Usage = field(default_factory=Usage)
    spent: int = 0
    # Micros spent before this run began that its budget counts as well (a replay: the
    # original's spend at the step), never charged, recorded or reported as its own.
    spent_before: int = 0
    state: Any = None
    grants: list[Grant] = field(default_factory=list)
    replay_of: str | None = None
    cursor: TranscriptCursor = field(default_factory=TranscriptCursor)
    observation: Any = None
    # A workflow engine carrying the run in the kit's place: every frontier names it.
    carried_by: Carrier | None = None

    @property
    def budget_spent(self) -> int:
        """What the agent's budget is measured against: this run's spend and any before it."""
        return self.spent + self.spent_before

    def frontier(
        self,
        boundary: Boundary,
        *,
        fence: int | None,
        outstanding: tuple[OutstandingCall, ...],
        status: CheckpointStatus,
        pending: PendingApproval | None,
        output: str | None,
    ) -> Checkpoint:
        """The frontier for the next step (``state_to_json`` may raise a typed error)."""
        state = state_to_json(self.state, self.agent.state_schema)
        return Checkpoint(
            tenant=self.tenant,
            run_id=self.run_id,
            agent_name=self.agent.name,
            agent_revision=self.agent.revision,
            step=self.step,
            boundary=boundary,
            status=status,
            iteration=self.iteration,
            fence=fence,
            messages=tuple(self.messages),
            outstanding=outstanding,
            pending_approval=pending,
            grants=tuple(self.grants),
            usage=self.usage,
            micros=self.spent,
            state=state,
            # The redactor's own masks are found as the frontier is encoded.
            state_redacted=secret_typed(self.state, self.agent.state_schema),
            steps_used=self.steps_used,
            replay_of=self.replay_of,
            output=output,
            written_at=time.time(),
            observation=self.observation,
            carried_by=self.carried_by,
        )

    def result(
        self,
        status: RunStatus,
        *,
        fence: int | None,
        output: str | None = None,
        pending_approval: ApprovalRequest | None = None,
    ) -> Run:
        """The ``Run`` handed back to the caller."""
        return Run(
            run_id=self.run_id,
            tenant=self.tenant,
            agent_name=self.agent.name,
            status=status,
            output=output,
            iteration=self.iteration,
            usage=self.usage,
            spent_micros=self.spent,
            pending_approval=pending_approval,
            replay_of=self.replay_of,
            fence=fence,
        )


def as_messages(input: str | Message | Sequence[Message]) -> list[Message]:
    """A run's input as messages: a string is one user message."""
    if isinstance(input, str | Message):
        return [Message.user(input) if isinstance(input, str) else input]
    return list(input)
