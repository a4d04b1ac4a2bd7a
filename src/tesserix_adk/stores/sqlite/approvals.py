"""SQLite approval requests; times by SQLite's clock."""

from __future__ import annotations

import json
import secrets
import sqlite3
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from tesserix_adk.messages import ToolCall
from tesserix_adk.stores._common import calls_to_json
from tesserix_adk.stores.protocols import ApprovalRequest, ApprovalStatus
from tesserix_adk.stores.protocols.approvals import decision_texts
from tesserix_adk.stores.rows import decoded, stored_calls
from tesserix_adk.stores.sqlite.fencing import (
    FencedSqliteStore,
    fenced,
    sqlite_now,
)

__all__ = ["SqliteApprovalStore"]

_APPROVALS = "approvals"

_APPROVAL_COLUMNS = (
    "id, tenant, run_id, calls, iteration, status, decided_by, note, requested_at, decided_at"
)


@decoded("approval request")
def _approval_from_row(row: Sequence[Any]) -> ApprovalRequest:
    id, tenant, run_id, calls, iteration, status, by, note, requested_at, decided_at = row
    return ApprovalRequest(
        id=id,
        tenant=tenant,
        run_id=run_id,
        calls=stored_calls(json.loads(calls)),
        iteration=int(iteration),
        status=ApprovalStatus(status),
        by=by,
        note=note,
        requested_at=float(requested_at),
        decided_at=decided_at,
    )


def _get_approval(conn: sqlite3.Connection, id: str) -> ApprovalRequest | None:
    row = conn.execute(
        f"SELECT {_APPROVAL_COLUMNS} FROM adk_approvals WHERE id = ?", (id,)
    ).fetchone()
    return None if row is None else _approval_from_row(row)


class SqliteApprovalStore(FencedSqliteStore):
    """An ``ApprovalStore``; times by SQLite's clock."""

    _kind = _APPROVALS

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
        chosen = id

        def request(conn: sqlite3.Connection) -> ApprovalRequest:
            fenced(conn, _APPROVALS, tenant, run_id, fence)
            now = sqlite_now(conn)
            if chosen is not None:
                existing = _get_approval(conn, chosen)
                if existing is not None:
                    if existing.tenant != tenant:
                        raise ValueError(f"approval request id {chosen!r} is taken")
                    return existing
            while True:
                id = chosen or f"req-{secrets.token_hex(6)}"
                inserted = conn.execute(
                    f"INSERT INTO adk_approvals ({_APPROVAL_COLUMNS}) "
                    "VALUES (?, ?, ?, ?, ?, ?, NULL, NULL, ?, NULL) ON CONFLICT (id) DO NOTHING",
                    (id, tenant, run_id, encoded, iteration, ApprovalStatus.pending.value, now),
                ).rowcount
                if inserted:
                    break
            stored = _get_approval(conn, id)
            assert stored is not None
            return stored

        return await self.database.write(request)

    async def decide(
        self, tenant: str, id: str, *, approved: bool, by: str, note: str | None = None
    ) -> ApprovalRequest:
        """Decide a request: the same decision again is a no-op, the other way raises
        ``ValueError``; an id unknown for the tenant raises ``KeyError``."""
        status = ApprovalStatus.approved if approved else ApprovalStatus.denied
        by, note = decision_texts(by, note)

        def decide(conn: sqlite3.Connection) -> ApprovalRequest:
            request = _get_approval(conn, id)
            if request is None or request.tenant != tenant:
                raise KeyError(id)
            if request.status is status:
                return request
            if request.status is not ApprovalStatus.pending:
                raise ValueError(f"request {id!r} was already {request.status} by {request.by!r}")
            request = replace(request, status=status, by=by, note=note, decided_at=sqlite_now(conn))
            conn.execute(
                "UPDATE adk_approvals SET status = ?, decided_by = ?, note = ?, decided_at = ? "
                "WHERE id = ?",
                (status.value, by, note, request.decided_at, id),
            )
            return request

        return await self.database.write(decide)

    async def get(self, tenant: str, id: str) -> ApprovalRequest | None:
        """The request, or ``None`` when no request with that id belongs to the tenant."""
        request = await self.database.read(lambda conn: _get_approval(conn, id))
        return request if request is not None and request.tenant == tenant else None
