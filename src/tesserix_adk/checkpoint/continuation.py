"""Continuation: starting a workflow engine's execution again without losing the run.

A workflow engine's history is finite (Temporal warns at 10,240 events or 10 MB).
``ContinuationPolicy.due`` says when an execution has run long enough to be worth starting
again, and ``continued`` builds the ``Continuation`` that crosses over: the transcript as a
handle, the ledger figure and the iteration as numbers, the approvals and grants the run acts
under — never the journal, whose results are already folded into the state. A continuation
that drops an approval or grant the run acts under cannot be built: the new execution would
otherwise carry on unapproved.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from tesserix_adk.checkpoint.payload import Grant, PendingApproval
from tesserix_adk.errors import ConfigurationError
from tesserix_adk.stores.protocols import HistoryHandle

__all__ = [
    "DEFAULT_CONTINUATION",
    "ContinuableState",
    "Continuation",
    "ContinuationPolicy",
    "continued",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class ContinuationPolicy:
    """When to start the execution again: ``max_steps`` journal entries, or
    ``max_history_bytes`` of engine history (as the engine reports it)."""

    max_steps: int = 1000
    max_history_bytes: int = 8 * 1024 * 1024

    def __post_init__(self) -> None:
        if self.max_steps < 1 or self.max_history_bytes < 1:
            raise ConfigurationError("ContinuationPolicy limits must be positive")

    def due(self, journal: Sequence[Any], *, history_bytes: int | None = None) -> bool:
        """The execution has run long enough to be worth starting again."""
        if len(journal) >= self.max_steps:
            return True
        return history_bytes is not None and history_bytes >= self.max_history_bytes


DEFAULT_CONTINUATION = ContinuationPolicy()


class ContinuableState(Protocol):
    """What an engine's run state exposes for ``continued`` (any object with these)."""

    run_id: str
    journal: Sequence[Any]
    history_handle: HistoryHandle | None
    spent_micros: int
    iteration: int
    grants: Sequence[Grant]
    pending_approval: PendingApproval | None


@dataclass(frozen=True, slots=True, kw_only=True)
class Continuation:
    """What crosses into the new execution. ``acting_under`` names the approvals (request
    ids) the run acts under; each must still be carried, as a grant or as the pending one."""

    tenant: str
    agent_name: str
    run_id: str
    history_handle: HistoryHandle | None
    spent_micros: int
    iteration: int
    grants: tuple[Grant, ...] = ()
    pending_approval: PendingApproval | None = None
    acting_under: frozenset[str] = field(default_factory=frozenset)

    def __post_init__(self) -> None:
        carried = {g.request for g in self.grants}
        if self.pending_approval is not None:
            carried.add(self.pending_approval.id)
        dropped = sorted(self.acting_under - carried)
        if dropped:
            raise ConfigurationError(
                f"a continuation of run {self.run_id!r} would drop approval(s) "
                f"{', '.join(dropped)} the run acts under; the new execution would carry on "
                "unapproved"
            )


def continued(state: ContinuableState, *, tenant: str, agent_name: str) -> Continuation:
    """The ``Continuation`` of ``state``: handle, spend, iteration, approvals — not the journal."""
    grants = tuple(state.grants)
    acting = {g.request for g in grants}
    if state.pending_approval is not None:
        acting.add(state.pending_approval.id)
    return Continuation(
        tenant=tenant,
        agent_name=agent_name,
        run_id=state.run_id,
        history_handle=state.history_handle,
        spent_micros=state.spent_micros,
        iteration=state.iteration,
        grants=grants,
        pending_approval=state.pending_approval,
        acting_under=frozenset(acting),
    )
