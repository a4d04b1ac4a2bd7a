"""In-process approval requests; times by the injected clock."""

from __future__ import annotations

import copy
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

from tesserix_adk.messages import ToolCall
from tesserix_adk.stores.memory.fencing import Fences
from tesserix_adk.stores.protocols import ApprovalRequest, ApprovalStatus
from tesserix_adk.stores.protocols.approvals import decision_texts

__all__ = ["MemoryApprovalStore"]


class MemoryApprovalStore:
    """An ``ApprovalStore`` in a dictionary; times by the injected ``clock``."""

    def __init__(self, *, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._requests: dict[str, ApprovalRequest] = {}
        self._fences = Fences()

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
        self._fences.check(tenant, run_id, fence)
        self._fences.accept(tenant, run_id, fence)
        if id is not None:
            existing = self._requests.get(id)
            if existing is not None:
                if existing.tenant != tenant:
                    raise ValueError(f"approval request id {id!r} is taken")
                return existing
        while id is None or id in self._requests:
            id = f"req-{secrets.token_hex(6)}"
        request = ApprovalRequest(
            id=id,
            tenant=tenant,
            run_id=run_id,
            # A copy, as a store that serialises would keep: later edits by the caller to
            # the arguments do not reach the stored request.
            calls=tuple(copy.deepcopy(list(calls))),
            iteration=iteration,
            requested_at=self._clock(),
        )
        self._requests[id] = request
        return request

    async def decide(
        self, tenant: str, id: str, *, approved: bool, by: str, note: str | None = None
    ) -> ApprovalRequest:
        """Decide a request: the same decision again is a no-op, the other way raises
        ``ValueError``; an id unknown for the tenant raises ``KeyError``."""
        request = self._requests.get(id)
        if request is None or request.tenant != tenant:
            raise KeyError(id)
        status = ApprovalStatus.approved if approved else ApprovalStatus.denied
        by, note = decision_texts(by, note)
        if request.status is status:
            return request
        if request.status is not ApprovalStatus.pending:
            raise ValueError(f"request {id!r} was already {request.status} by {request.by!r}")
        request = replace(request, status=status, by=by, note=note, decided_at=self._clock())
        self._requests[id] = request
        return request

    async def get(self, tenant: str, id: str) -> ApprovalRequest | None:
        """The request, or ``None`` when no request with that id belongs to the tenant."""
        request = self._requests.get(id)
        return request if request is not None and request.tenant == tenant else None

    async def seal(self, tenant: str, run_id: str, fence: int) -> None:
        """Raise the highest-seen fence for the run without writing data."""
        self._fences.seal(tenant, run_id, fence)
