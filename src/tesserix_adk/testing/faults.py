"""Fault injection for tests of code built on the kit: simulated deaths and broken stores.

``SimulatedCrash`` is a ``BaseException``: the runner lets it through untouched and writes
nothing more, which is exactly what a process death looks like from the stores' side. Real
process deaths (SIGKILL) are covered by the kit's own crash tests.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from tesserix_adk.stores.protocols import (
    CheckpointStore,
    IdempotencyRecord,
    IdempotencyStore,
    StoredCheckpoint,
    ToolFlags,
)

__all__ = ["FaultyCheckpointStore", "FaultyIdempotencyStore", "SimulatedCrash"]


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

    async def at(self, tenant: str, run_id: str, step: int) -> StoredCheckpoint | None:
        """Delegates (counted)."""
        self.reads += 1
        return await self.inner.at(tenant, run_id, step)

    async def steps(self, tenant: str, run_id: str) -> list[int]:
        """Delegates."""
        return await self.inner.steps(tenant, run_id)

    async def runs(self, tenant: str) -> list[str]:
        """Delegates."""
        return await self.inner.runs(tenant)

    async def forget(self, tenant: str, run_id: str) -> None:
        """Delegates."""
        await self.inner.forget(tenant, run_id)

    async def seal(self, tenant: str, run_id: str, fence: int) -> None:
        """Delegates."""
        await self.inner.seal(tenant, run_id, fence)


class FaultyIdempotencyStore:
    """Wraps an idempotency store; ``unreachable`` makes tool-call claims fail like a
    dropped connection (the run's own resume claim still works)."""

    def __init__(self, inner: IdempotencyStore) -> None:
        self.inner = inner
        self.unreachable = False

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
        """Claim, unless the store is "unreachable" for tool calls."""
        if self.unreachable and tool is not None:
            raise ConnectionError("idempotency store unreachable (simulated)")
        return await self.inner.claim(
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

    async def complete(self, key: str, outcome: bytes, *, holder: str) -> IdempotencyRecord:
        """Delegates."""
        return await self.inner.complete(key, outcome, holder=holder)

    async def release(self, key: str, *, holder: str) -> None:
        """Delegates."""
        await self.inner.release(key, holder=holder)

    async def lookup(self, keys: Sequence[str]) -> dict[str, IdempotencyRecord]:
        """Delegates."""
        return await self.inner.lookup(keys)

    async def records(self, tenant: str, run_id: str) -> list[IdempotencyRecord]:
        """Delegates."""
        return await self.inner.records(tenant, run_id)

    async def resolve(
        self, key: str, outcome: bytes | None = None, *, never_ran: bool = False, by: str
    ) -> IdempotencyRecord:
        """Delegates."""
        return await self.inner.resolve(key, outcome, never_ran=never_ran, by=by)

    async def seal(self, tenant: str, run_id: str, fence: int) -> None:
        """Delegates."""
        await self.inner.seal(tenant, run_id, fence)
