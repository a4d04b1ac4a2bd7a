"""``RedisApprovalStore``: approval requests, each with its run, found by id."""

from __future__ import annotations

import json
import secrets
from collections.abc import Mapping, Sequence
from urllib.parse import unquote

from tesserix_adk.adapters.redis.base import (
    _bytes,
    _fence_arg,
    _FencedRedisStore,
    _pairs,
    _seconds,
    _stale,
    _text,
)
from tesserix_adk.adapters.redis.connection import Client, _driver_errors
from tesserix_adk.adapters.redis.keys import DEFAULT_PREFIX, _enc, _Keys
from tesserix_adk.adapters.redis.lua import register
from tesserix_adk.messages import ToolCall
from tesserix_adk.stores._common import calls_to_json
from tesserix_adk.stores.protocols import ApprovalRequest, ApprovalStatus
from tesserix_adk.stores.protocols.approvals import decision_texts
from tesserix_adk.stores.rows import decoded, stored_calls

__all__ = ["RedisApprovalStore"]


def _calls_from_json(raw: bytes) -> tuple[ToolCall, ...]:
    return stored_calls(json.loads(raw))


@decoded("approval request")
def _approval(fields: Mapping[bytes, bytes]) -> ApprovalRequest:
    def text(name: bytes) -> str | None:
        value = fields.get(name)
        return None if value is None else value.decode()

    decided = fields.get(b"decided_at")
    return ApprovalRequest(
        id=fields[b"id"].decode(),
        tenant=fields[b"tenant"].decode(),
        run_id=fields[b"run_id"].decode(),
        calls=_calls_from_json(fields[b"calls"]),
        iteration=int(fields[b"iteration"]),
        status=ApprovalStatus(fields[b"status"].decode()),
        by=text(b"by"),
        note=text(b"note"),
        requested_at=_seconds(fields[b"requested_at"]),
        decided_at=None if decided is None else _seconds(decided),
    )


class RedisApprovalStore(_FencedRedisStore):
    """An ``ApprovalStore`` on Redis; a request lives with its run, found by id through
    ``adk:approval-id:{<id>}``, which also keeps ids unique across the store."""

    _store = "approvals"

    def __init__(self, client: Client, *, prefix: str = DEFAULT_PREFIX) -> None:
        super().__init__(client, prefix=prefix)
        self._request, self._decide = register(client, "request", "decide")

    def _request_key(self, tag: str, id: str) -> str:
        return self._keys.tagged(tag, f"approval:{_enc(id)}")

    async def _locate(self, tenant: str, id: str) -> str | None:
        """The run tag holding request ``id`` if it belongs to ``tenant``."""
        raw = await self._client.get(self._keys.approval_index(id))
        if raw is None:
            return None
        tag = _text(raw)
        return tag if unquote(tag.split(":", 1)[0]) == tenant else None

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
        chosen = id
        tag = _Keys.tag(tenant, run_id)
        fields = [
            "tenant",
            tenant,
            "run_id",
            run_id,
            "calls",
            calls_to_json(calls),
            "iteration",
            str(int(iteration)),
        ]
        with _driver_errors(f"recording an approval request of run {run_id!r}"):
            while True:
                id = chosen or f"req-{secrets.token_hex(6)}"
                if await self._client.set(self._keys.approval_index(id), tag, nx=True):
                    break
                if chosen is not None:
                    if await self._locate(tenant, chosen) != tag:
                        existing = await self.get(tenant, chosen)
                        if existing is None:
                            raise ValueError(f"approval request id {chosen!r} is taken")
                        return existing
                    # This run's own id, asked before: the script checks the fence, then
                    # returns the request there (decided, perhaps) or, when an attempt
                    # died (or lost its connection) between the pointer and the request,
                    # writes it now.
                    break
            result = await self._request(
                keys=[
                    self._request_key(tag, id),
                    self._seen(tenant, run_id),
                    self._lease_fence(tenant, run_id),
                ],
                args=[_fence_arg(fence), "id", id, *fields],
            )
            if result[0] == b"stale" and chosen is None:
                # A drawn id names nothing now; let it go rather than keep a dangling
                # pointer. A chosen one is the run's own, which a fresher attempt may have
                # set, or written its request under, meanwhile: it stays.
                await self._client.delete(self._keys.approval_index(id))
        if result[0] == b"stale":
            raise _stale("approval request", run_id, fence, result[1])
        return _approval(_pairs(result[1]))

    async def decide(
        self, tenant: str, id: str, *, approved: bool, by: str, note: str | None = None
    ) -> ApprovalRequest:
        """Decide a request: the same decision again is a no-op, the other way raises
        ``ValueError``; an id unknown for the tenant raises ``KeyError``."""
        status = ApprovalStatus.approved if approved else ApprovalStatus.denied
        by, note = decision_texts(by, note)
        with _driver_errors(f"deciding approval request {id!r}"):
            tag = await self._locate(tenant, id)
            if tag is None:
                raise KeyError(id)
            result = await self._decide(
                keys=[self._request_key(tag, id)],
                args=[status.value, by, "0" if note is None else "1", note or ""],
            )
        if result[0] == b"absent":
            raise KeyError(id)
        request = _approval(_pairs(result[1]))
        if result[0] == b"decided":
            raise ValueError(f"request {id!r} was already {request.status} by {request.by!r}")
        return request

    async def get(self, tenant: str, id: str) -> ApprovalRequest | None:
        """The request, or ``None`` when no request with that id belongs to the tenant."""
        with _driver_errors(f"reading approval request {id!r}"):
            tag = await self._locate(tenant, id)
            if tag is None:
                return None
            fields = await self._client.hgetall(self._request_key(tag, id))
        return _approval({_bytes(k): _bytes(v) for k, v in fields.items()}) if fields else None
