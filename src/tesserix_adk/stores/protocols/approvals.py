"""Approval requests and the decisions people make on them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol, runtime_checkable

from tesserix_adk.checkpoint.redaction import default_redactor
from tesserix_adk.messages import ToolCall

__all__ = ["ApprovalRequest", "ApprovalStatus", "ApprovalStore", "decision_texts"]


class ApprovalStatus(StrEnum):
    """Where an approval request stands."""

    pending = "pending"
    approved = "approved"
    denied = "denied"


@dataclass(frozen=True, slots=True, kw_only=True)
class ApprovalRequest:
    """One request per turn, covering every call of that turn that needs a person."""

    id: str
    tenant: str
    run_id: str
    calls: tuple[ToolCall, ...]
    iteration: int
    status: ApprovalStatus = ApprovalStatus.pending
    by: str | None = None
    note: str | None = None
    requested_at: float = 0.0
    decided_at: float | None = None


@runtime_checkable
class ApprovalStore(Protocol):
    """Approval requests and the decisions people make on them."""

    async def request(
        self,
        tenant: str,
        run_id: str,
        calls: Sequence[ToolCall],
        *,
        iteration: int,
        fence: int | None = None,
        id: str | None = None,
    ) -> ApprovalRequest:
        """Record a pending request; ids are unique per store.

        With ``id`` the request is made once: while a request with that id exists for the
        tenant, it is returned as it stands (pending or decided) and nothing is written. A
        runner that died between asking and checkpointing asks again under the same id
        and finds the request a person may already have decided.
        """
        ...

    async def decide(
        self, tenant: str, id: str, *, approved: bool, by: str, note: str | None = None
    ) -> ApprovalRequest:
        """Decide a request: the same decision again is a no-op, the other way raises
        ``ValueError``; an id unknown for the tenant raises ``KeyError``. ``by`` and
        ``note`` are kept as ``decision_texts`` masks them."""
        ...

    async def get(self, tenant: str, id: str) -> ApprovalRequest | None:
        """The request, or ``None`` when no request with that id belongs to the tenant."""
        ...

    async def seal(self, tenant: str, run_id: str, fence: int) -> None:
        """Raise the highest-seen fence for the run without writing data."""
        ...


def decision_texts(by: str, note: str | None) -> tuple[str, str | None]:
    """Who decided and the note, as an approval store keeps them: masked by the built-in
    patterns. A decision made through the store's own ``decide`` (an application's
    approval page) never passes the runner, whose settings mask everything else it keeps,
    and a note pasted from a log may hold a key."""
    redactor = default_redactor()
    return redactor.text(by), None if note is None else redactor.text(note)
