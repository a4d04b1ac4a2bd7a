"""The in-process work index: runs that want a worker, ordered as workers take them."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from tesserix_adk.stores.memory.fencing import RunKey
from tesserix_adk.stores.protocols import LeaseStore, WorkItem, WorkListing, WorkState

__all__ = ["MemoryWorkIndex", "TAKE_ORDER"]

# What a want carrying a count (a worker's bookkeeping) leaves as it is.
_LEFT_ALONE = (WorkState.parked, WorkState.done)

TAKE_ORDER = {WorkState.decided: 0, WorkState.wanted: 1, WorkState.submitted: 2}
"""The order ``due`` hands runs out in, by state."""


@dataclass(slots=True, kw_only=True)
class _Entry:
    item: WorkItem
    input: bytes | None = None


def _as_read(item: WorkItem, agent: str, attempts: int, reason: str | None) -> bool:
    return (
        item.state is WorkState.parked
        and item.agent == agent
        and item.attempts == attempts
        and item.reason == reason
    )


class MemoryWorkIndex:
    """A ``WorkIndex`` in a dictionary; a lease is live by ``leases`` (the same clock)."""

    def __init__(self, leases: LeaseStore, *, clock: Callable[[], float] = time.time) -> None:
        self._leases = leases
        self._clock = clock
        self._entries: dict[RunKey, _Entry] = {}

    async def submit(self, tenant: str, run_id: str, *, agent: str, input: bytes) -> bool:
        """Record a run as submitted; ``False`` when the run is known already."""
        if (tenant, run_id) in self._entries:
            return False
        item = WorkItem(
            tenant=tenant,
            run_id=run_id,
            agent=agent,
            state=WorkState.submitted,
            since=self._clock(),
        )
        self._entries[(tenant, run_id)] = _Entry(item=item, input=bytes(input))
        return True

    async def input(self, tenant: str, run_id: str) -> bytes | None:
        """The encoded input the run was submitted with, or ``None``."""
        entry = self._entries.get((tenant, run_id))
        return None if entry is None else entry.input

    async def entry(self, tenant: str, run_id: str) -> WorkItem | None:
        """The run's entry in any state, or ``None``."""
        entry = self._entries.get((tenant, run_id))
        return None if entry is None else entry.item

    async def want(
        self,
        tenant: str,
        run_id: str,
        *,
        agent: str,
        state: WorkState = WorkState.wanted,
        delay: float = 0.0,
        reason: str | None = None,
        count: int | None = None,
    ) -> None:
        """The run wants a worker, not before ``delay`` seconds from now."""
        if state not in TAKE_ORDER:
            raise ValueError(
                f"a run that wants a worker is decided, wanted or submitted, not {state}"
            )
        now = self._clock()
        entry = self._entries.get((tenant, run_id))
        if count is not None and entry is not None and entry.item.state in _LEFT_ALONE:
            return  # a worker's count never unparks a run nor revives a finished one
        if count is not None:
            attempts = max(0, (entry.item.attempts if entry is not None else 0) + count)
        elif delay > 0:
            attempts = (entry.item.attempts if entry is not None else 0) + 1
        elif entry is not None and entry.item.state is state:
            attempts = entry.item.attempts  # the runner carrying it keeps the retry count
        else:
            attempts = 0
        since = entry.item.since if entry is not None and entry.item.state is state else now
        item = WorkItem(
            tenant=tenant,
            run_id=run_id,
            agent=agent,
            state=state,
            since=since,
            not_before=now + delay if delay > 0 else None,
            attempts=attempts,
            reason=reason,
        )
        if entry is None:
            self._entries[(tenant, run_id)] = _Entry(item=item)
        else:
            entry.item = item

    async def wake(
        self, tenant: str, run_id: str, *, agent: str, attempts: int, reason: str | None
    ) -> bool:
        """Wanted now with one more attempt, if still parked as read (``WakesParked``)."""
        entry = self._entries.get((tenant, run_id))
        if entry is None or not _as_read(entry.item, agent, attempts, reason):
            return False
        entry.item = replace(
            entry.item,
            state=WorkState.wanted,
            since=self._clock(),
            not_before=None,
            attempts=attempts + 1,
            reason=None,
        )
        return True

    async def park(self, tenant: str, run_id: str, *, agent: str, reason: str) -> None:
        """The run must not be carried on until an operator acts."""
        now = self._clock()
        item = WorkItem(
            tenant=tenant,
            run_id=run_id,
            agent=agent,
            state=WorkState.parked,
            since=now,
            reason=reason,
        )
        entry = self._entries.get((tenant, run_id))
        if entry is None:
            self._entries[(tenant, run_id)] = _Entry(item=item)
        else:
            entry.item = replace(item, attempts=entry.item.attempts)

    async def done(self, tenant: str, run_id: str) -> None:
        """The run wants no worker now."""
        entry = self._entries.get((tenant, run_id))
        if entry is not None:
            entry.item = replace(
                entry.item,
                state=WorkState.done,
                since=self._clock(),
                not_before=None,
                reason=None,
                attempts=0,
            )

    async def due(self, *, limit: int, agents: Sequence[str] | None = None) -> list[WorkItem]:
        """Runs a worker may take now, in take order."""
        if limit <= 0:
            return []
        now = self._clock()
        wanted = sorted(
            (
                e.item
                for e in self._entries.values()
                if e.item.state in TAKE_ORDER
                and (e.item.not_before is None or e.item.not_before <= now)
                and (agents is None or e.item.agent in agents)
            ),
            key=lambda i: (TAKE_ORDER[i.state], i.since, i.tenant, i.run_id),
        )
        taken: list[WorkItem] = []
        for item in wanted:
            if await self._leases.current(item.tenant, item.run_id) is None:
                taken.append(item)
                if len(taken) == limit:
                    break
        return taken

    async def listing(
        self, tenant: str | None = None, *, state: WorkState | None = None
    ) -> WorkListing:
        """``items``: memory holds no damaged entry."""
        return WorkListing(tuple(await self.items(tenant, state=state)))

    async def items(
        self, tenant: str | None = None, *, state: WorkState | None = None
    ) -> list[WorkItem]:
        """The entries of ``tenant`` in ``state`` (any but ``done``), oldest first."""
        return sorted(
            (
                e.item
                for e in self._entries.values()
                if (tenant is None or e.item.tenant == tenant)
                and (
                    e.item.state is state
                    if state is not None
                    else e.item.state is not WorkState.done
                )
            ),
            key=lambda i: (i.since, i.tenant, i.run_id),
        )
