"""Fault injection for tests of code built on the kit: simulated deaths and broken stores.

``SimulatedCrash`` is a ``BaseException``: the runner lets it through untouched and writes
nothing more, which is exactly what a process death looks like from the stores' side. Real
process deaths (SIGKILL) are covered by the kit's own crash tests.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from tesserix_adk.errors import StoreReplyLostError, StoreUnavailableError
from tesserix_adk.stores.protocols import (
    CheckpointStore,
    IdempotencyRecord,
    IdempotencyStore,
    StoredCheckpoint,
    ToolFlags,
)

__all__ = ["FaultyCheckpointStore", "FaultyIdempotencyStore", "IdempotencyHook", "SimulatedCrash"]


class SimulatedCrash(BaseException):
    """Stands in for the process dying at this exact point."""


PayloadTest = Callable[[dict[str, Any]], bool]


class FaultyCheckpointStore:
    """Wraps a checkpoint store; records every put and can fail or "die" around one.

    ``crash_after`` is called with each decoded payload after it was stored: ``True``
    raises ``SimulatedCrash`` (the process died right after that write). ``crash_before``
    does the same before the write. ``fail_with`` makes every put raise that exception.
    """

    def __init__(
        self,
        inner: CheckpointStore,
        *,
        crash_after: PayloadTest | None = None,
        crash_before: PayloadTest | None = None,
        fail_with: Exception | None = None,
    ) -> None:
        self.inner = inner
        self.crash_after = crash_after
        self.crash_before = crash_before
        self.fail_with = fail_with
        self.puts: list[dict[str, Any]] = []
        self.payloads: list[bytes] = []
        self.reads = 0

    async def put(
        self, tenant: str, run_id: str, payload: bytes, *, step: int, fence: int | None = None
    ) -> None:
        """Put, unless told to fail or die first."""
        body = json.loads(payload)
        if self.crash_before is not None and self.crash_before(body):
            raise SimulatedCrash(f"died before writing step {step}")
        if self.fail_with is not None:
            raise self.fail_with
        await self.inner.put(tenant, run_id, payload, step=step, fence=fence)
        self.puts.append(body)
        self.payloads.append(payload)
        if self.crash_after is not None and self.crash_after(body):
            raise SimulatedCrash(f"died right after writing step {step}")

    async def latest(self, tenant: str, run_id: str) -> StoredCheckpoint | None:
        """Delegates (counted)."""
        self.reads += 1
        return await self.inner.latest(tenant, run_id)

    def __getattr__(self, name: str) -> Any:
        # The optional capabilities (step history, run listing) are the inner store's own:
        # offered here exactly when it offers them, so an isinstance check tells the truth.
        if name not in ("at", "steps", "runs"):
            raise AttributeError(name)
        inner = getattr(self.inner, name)  # AttributeError: the inner store lacks it too

        async def delegated(*args: Any, **kwargs: Any) -> Any:
            if name == "at":
                self.reads += 1
            return await inner(*args, **kwargs)

        return delegated

    async def forget(self, tenant: str, run_id: str) -> None:
        """Delegates."""
        await self.inner.forget(tenant, run_id)

    async def seal(self, tenant: str, run_id: str, fence: int) -> None:
        """Delegates."""
        await self.inner.seal(tenant, run_id, fence)


IdempotencyHook = Callable[[str, str, str], None]
"""``hook(phase, op, key)``: ``phase`` is ``"before"`` (the request has not reached the store)
or ``"after"`` (the store applied it, the reply is on its way); ``op`` is ``claim``,
``complete``, ``lookup`` or ``records``. Raising from it stands in for the fault."""


class FaultyIdempotencyStore:
    """Wraps an idempotency store and breaks it on purpose.

    - ``unreachable``: tool-call claims fail like a dropped connection (the run's own resume
      claim still works);
    - ``fail_completes`` / ``fail_claims``: the next N completes / tool-call claims never
      reach the store (``StoreUnavailableError``);
    - ``lose_complete_replies`` / ``lose_claim_replies``: the next N are applied, then the
      reply is lost (``StoreReplyLostError``);
    - ``hook``: called around every call (see ``IdempotencyHook``), for arbitrary faults.
    """

    def __init__(self, inner: IdempotencyStore, *, hook: IdempotencyHook | None = None) -> None:
        self.inner = inner
        self.unreachable = False
        self.fail_completes = 0
        self.fail_claims = 0
        self.lose_complete_replies = 0
        self.lose_claim_replies = 0
        self.hook = hook
        self.calls: list[tuple[str, str]] = []

    def _before(self, op: str, key: str) -> None:
        self.calls.append((op, key))
        if self.hook is not None:
            self.hook("before", op, key)

    def _after(self, op: str, key: str) -> None:
        if self.hook is not None:
            self.hook("after", op, key)

    async def claim(
        self,
        key: str,
        *,
        holder: str,
        tenant: str,
        run_id: str,
        iteration: int | None,
        tool: str | None,
        call_id: str | None,
        flags: ToolFlags | None,
        fence: int | None = None,
        ttl: float | None = None,
        takeover: bool = False,
    ) -> IdempotencyRecord:
        """Claim, unless told to fail (before the store) or to lose the reply (after)."""
        if self.unreachable and tool is not None:
            raise ConnectionError("idempotency store unreachable (simulated)")
        if tool is not None:
            self._before("claim", key)
            if self.fail_claims > 0:
                self.fail_claims -= 1
                raise StoreUnavailableError("claim never reached the store (simulated)")
        rec = await self.inner.claim(
            key,
            holder=holder,
            tenant=tenant,
            run_id=run_id,
            iteration=iteration,
            tool=tool,
            call_id=call_id,
            flags=flags,
            fence=fence,
            ttl=ttl,
            takeover=takeover,
        )
        if tool is not None:
            self._after("claim", key)
            if self.lose_claim_replies > 0:
                self.lose_claim_replies -= 1
                raise StoreReplyLostError("the claim was applied; its reply was lost (simulated)")
        return rec

    async def complete(
        self, key: str, outcome: bytes, *, tenant: str, holder: str
    ) -> IdempotencyRecord:
        """Complete, unless told to fail (before the store) or to lose the reply (after)."""
        self._before("complete", key)
        if self.fail_completes > 0:
            self.fail_completes -= 1
            raise StoreUnavailableError("complete never reached the store (simulated)")
        rec = await self.inner.complete(key, outcome, tenant=tenant, holder=holder)
        self._after("complete", key)
        if self.lose_complete_replies > 0:
            self.lose_complete_replies -= 1
            raise StoreReplyLostError("the outcome was recorded; its reply was lost (simulated)")
        return rec

    async def release(
        self, key: str, *, tenant: str, holder: str, undispatched: bool = False
    ) -> None:
        """Delegates (through the hook)."""
        self._before("release", key)
        await self.inner.release(key, tenant=tenant, holder=holder, undispatched=undispatched)
        self._after("release", key)

    async def lookup(self, keys: Sequence[str], *, tenant: str) -> dict[str, IdempotencyRecord]:
        """Delegates (through the hook)."""
        self._before("lookup", ",".join(keys))
        found = await self.inner.lookup(keys, tenant=tenant)
        self._after("lookup", ",".join(keys))
        return found

    async def records(self, tenant: str, run_id: str) -> list[IdempotencyRecord]:
        """Delegates (through the hook)."""
        self._before("records", run_id)
        found = await self.inner.records(tenant, run_id)
        self._after("records", run_id)
        return found

    async def resolve(
        self,
        key: str,
        outcome: bytes | None = None,
        *,
        tenant: str,
        never_ran: bool = False,
        by: str,
        holder: str | None = None,
    ) -> IdempotencyRecord:
        """Delegates."""
        return await self.inner.resolve(
            key, outcome, tenant=tenant, never_ran=never_ran, by=by, holder=holder
        )

    async def seal(self, tenant: str, run_id: str, fence: int) -> None:
        """Delegates."""
        await self.inner.seal(tenant, run_id, fence)
