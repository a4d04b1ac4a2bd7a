"""Approval requests in PostgreSQL: ``adk_approvals``; ids are unique across the table.

A request is made once per id by a fenced statement (``sql/approvals/request.sql``); a
decision is one statement that changes only a pending request (``decide.sql``).
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Sequence
from dataclasses import dataclass

from tesserix_adk.adapters.postgres.connection import PostgresDatabase, Row
from tesserix_adk.adapters.postgres.fenced import ATTEMPTS, FencedStore, refusal, run_params, stale
from tesserix_adk.adapters.postgres.statements import Statements, words
from tesserix_adk.errors import StoreUnavailableError
from tesserix_adk.messages import ToolCall
from tesserix_adk.stores._common import calls_to_json
from tesserix_adk.stores.protocols import ApprovalRequest, ApprovalStatus
from tesserix_adk.stores.protocols.approvals import decision_texts
from tesserix_adk.stores.rows import decoded, stored_calls

__all__ = ["PostgresApprovalStore"]


@dataclass(frozen=True, slots=True, kw_only=True)
class _SQL(Statements):
    seal: str
    request: str
    decide: str
    get: str


@decoded("approval request")
def _approval(row: Row) -> ApprovalRequest:
    return ApprovalRequest(
        id=row["id"],
        tenant=row["tenant"],
        run_id=row["run_id"],
        calls=stored_calls(json.loads(row["calls"])),
        iteration=int(row["iteration"]),
        status=ApprovalStatus(row["status"]),
        by=row["decided_by"],
        note=row["note"],
        requested_at=row["requested_at"],
        decided_at=row["decided_at"],
    )


class PostgresApprovalStore(FencedStore):
    """An ``ApprovalStore`` in ``adk_approvals``; ids are unique across the table."""

    def __init__(self, database: PostgresDatabase) -> None:
        self._sql = _SQL.load("approvals", database.schema.schema)
        super().__init__(database, seal=self._sql.seal)

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
        """Record a pending request (made once under a chosen ``id``)."""
        encoded = calls_to_json(calls)
        while True:
            params = run_params(
                tenant,
                run_id,
                fence,
                id=id or f"req-{secrets.token_hex(6)}",
                calls=encoded,
                iteration=int(iteration),
            )
            row = await self.database.row(
                f"recording an approval request of run {run_id!r}", self._sql.request, params
            )
            refused_by = refusal(row, fence)
            if refused_by is not None:
                raise stale("approval request", run_id, fence, refused_by)
            assert row is not None
            if row["id"] is not None:
                return _approval(row)
            if id is not None:
                existing = await self.get(tenant, id)
                if existing is None:
                    raise ValueError(f"approval request id {id!r} is taken")
                return existing
            # That id was taken already: draw another.

    async def decide(
        self, tenant: str, id: str, *, approved: bool, by: str, note: str | None = None
    ) -> ApprovalRequest:
        """Decide a request: the same decision again is a no-op, the other way raises
        ``ValueError``; an id unknown for the tenant raises ``KeyError``."""
        status = ApprovalStatus.approved if approved else ApprovalStatus.denied
        by, note = decision_texts(by, note)
        params = {
            "id": id,
            "tenant": tenant,
            "status": status.value,
            "by": words(by),
            "note": words(note),
        }
        for _ in range(ATTEMPTS):
            row = await self.database.row(
                f"deciding approval request {id!r}", self._sql.decide, params
            )
            if row is None:
                raise KeyError(id)
            request = _approval(row)
            if row["changed"] or request.status is status:
                return request
            if request.status is not ApprovalStatus.pending:
                raise ValueError(f"request {id!r} was already {request.status} by {request.by!r}")
            # Decided by someone else after this statement's snapshot; look again.
        raise StoreUnavailableError(f"approval request {id!r} kept changing while decided")

    async def get(self, tenant: str, id: str) -> ApprovalRequest | None:
        """The request, or ``None`` when no request with that id belongs to the tenant."""
        row = await self.database.row(
            f"reading approval request {id!r}", self._sql.get, {"id": id, "tenant": tenant}
        )
        return None if row is None else _approval(row)
