"""What a caller gets back: ``Run`` and ``RunStatus``."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from tesserix_adk.checkpoint.payload import Checkpoint
from tesserix_adk.messages import Usage
from tesserix_adk.stores.protocols import ApprovalRequest

__all__ = ["Run", "RunStatus", "finished_run"]


class RunStatus(StrEnum):
    """How a call to ``run``/``resume``/``replay`` left the run."""

    completed = "completed"
    waiting_approval = "waiting_approval"
    budget_exhausted = "budget_exhausted"
    max_iterations = "max_iterations"
    failed = "failed"
    cancelled = "cancelled"


@dataclass(frozen=True, slots=True, kw_only=True)
class Run:
    """Where a run stands after the runner let go of it."""

    run_id: str
    tenant: str
    agent_name: str
    status: RunStatus
    output: str | None = None
    iteration: int = 0
    usage: Usage = field(default_factory=Usage)
    spent_micros: int = 0
    pending_approval: ApprovalRequest | None = None
    replay_of: str | None = None
    fence: int | None = None


def finished_run(cp: Checkpoint) -> Run:
    """The ``Run`` a finished frontier stands for (resuming it changes nothing)."""
    return Run(
        run_id=cp.run_id,
        tenant=cp.tenant,
        agent_name=cp.agent_name,
        status=RunStatus(cp.status.value),
        output=cp.output,
        iteration=cp.iteration,
        usage=cp.usage,
        spent_micros=cp.micros,
        replay_of=cp.replay_of,
    )
