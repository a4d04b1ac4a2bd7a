"""``RunParts``: the stores and provider one runner carries every run with."""

from __future__ import annotations

from dataclasses import dataclass

from tesserix_adk.checkpoint.checkpointer import Checkpointer
from tesserix_adk.checkpoint.redaction import Redactor
from tesserix_adk.providers.base import Provider
from tesserix_adk.stores.protocols import (
    ApprovalStore,
    CommitsWithNext,
    GroupedWrites,
    IdempotencyStore,
    Ledger,
)

__all__ = ["RunParts"]


@dataclass(frozen=True, slots=True, kw_only=True)
class RunParts:
    """What every piece of the loop reaches for; the same for every run of a runner."""

    provider: Provider
    idempotency: IdempotencyStore
    checkpoints: Checkpointer | None
    ledger: Ledger | None
    approvals: ApprovalStore | None
    redactor: Redactor
    # The idempotency store's write groups, where its backend offers them (``run.grouping``).
    groups: GroupedWrites | None = None
    # The ledger, where it may join such a group (asked once: a runtime protocol check
    # walks every member of the protocol each time).
    ledger_groups: GroupedWrites | None = None
    # The idempotency store, where its groups can send their COMMIT with their last
    # statement (asked once, as above).
    commits_with_next: CommitsWithNext | None = None
