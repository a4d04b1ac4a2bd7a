"""The work index: runs that want a worker."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol, runtime_checkable

__all__ = [
    "DamagedEntry",
    "WakesParked",
    "WorkIndex",
    "WorkItem",
    "WorkListing",
    "WorkState",
    "WorksAroundDamage",
]


class WorkState(StrEnum):
    """Why a run is in the work index; the order workers take them in, first to last."""

    decided = "decided"  # an approval it waited on was decided
    wanted = "wanted"  # started and not finished: carried on whenever no lease is live
    submitted = "submitted"  # never started
    parked = "parked"  # must not carry on until an operator acts; never taken
    done = "done"  # wants no worker now (finished, cancelled, waiting on a person)


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkItem:
    """A run that wants a worker (or is parked). ``since`` and ``not_before`` are the
    store's clock (epoch seconds); ``agent`` names the agent that carries it."""

    tenant: str
    run_id: str
    agent: str
    state: WorkState
    since: float
    not_before: float | None = None
    attempts: int = 0
    reason: str | None = None


@runtime_checkable
class WorkIndex(Protocol):
    """A capability of a backend: the runs that want a worker, so that a worker finds its
    next runs without reading every run. It is an index, not the truth: a worker takes a
    run it finds through the run's lease, resume claim and frontier like anyone else, so an
    entry that is stale (a run finished a moment ago, or just taken) costs a look, never a
    duplicate. The store's clock decides which leases are live.
    """

    async def submit(self, tenant: str, run_id: str, *, agent: str, input: bytes) -> bool:
        """Record a run as submitted with its encoded input; ``False`` (and nothing
        written) when the index already knows the run, in any state or finished."""
        ...

    async def input(self, tenant: str, run_id: str) -> bytes | None:
        """The encoded input the run was submitted with, or ``None``."""
        ...

    async def entry(self, tenant: str, run_id: str) -> WorkItem | None:
        """The run's entry in whatever state (``done`` included), or ``None`` when the
        index does not hold it: one run's read, for a worker or an operator looking at
        one run, where ``items`` reads the tenant's every entry."""
        ...

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
        """The run wants a worker (``decided``, ``wanted`` or ``submitted``), not before
        ``delay`` seconds from now by the store's clock. Unparks a parked run.

        ``count`` changes the count of attempts by that much, whatever the states (never
        below 0): a worker taking the run counts ``1`` as it begins, a failure after it
        ``0`` (the take counted it), a take that found the run held elsewhere or was
        stopped by a drain is given back with ``-1``. A want with a count leaves a parked
        or done entry as it is: a worker's bookkeeping never unparks a run another worker
        parked meanwhile, nor revives one that finished. Without a count a delayed want
        counts one more attempt, and a prompt one keeps the count in the same state and
        starts it again in another (an operator unparking a run)."""
        ...

    async def park(self, tenant: str, run_id: str, *, agent: str, reason: str) -> None:
        """The run must not be carried on until an operator acts; ``reason`` says why."""
        ...

    async def done(self, tenant: str, run_id: str) -> None:
        """The run wants no worker now (finished, cancelled or waiting on a person): it
        becomes ``done``; a no-op for a run the index does not hold. Its submission (and so
        ``submit``'s answer for its id) is kept."""
        ...

    async def due(self, *, limit: int, agents: Sequence[str] | None = None) -> list[WorkItem]:
        """Up to ``limit`` runs a worker may take now: not parked, past ``not_before``, no
        live lease; ``decided`` first, then ``wanted``, then ``submitted``, oldest first
        within each. Only runs of ``agents`` when given."""
        ...

    async def items(
        self, tenant: str | None = None, *, state: WorkState | None = None
    ) -> list[WorkItem]:
        """The entries of ``tenant`` (every tenant: ``None``) in ``state`` (any but
        ``done``: ``None``), oldest first: for operators."""
        ...


@dataclass(frozen=True, slots=True)
class DamagedEntry:
    """A work index entry that cannot be read: its tenant and run as far as they read
    (``None``: not at all), and why (which quotes the stored values: redact it)."""

    tenant: str | None
    run_id: str | None
    why: str

    @property
    def named(self) -> str:
        """Whose entry it is, in words, as far as that reads."""
        if self.tenant is None and self.run_id is None:
            return "an entry whose tenant and run cannot be read"
        return f"the entry of run '{self.tenant or '?'}/{self.run_id or '?'}'"


@dataclass(frozen=True, slots=True)
class WorkListing:
    """An operator's listing of the work index: the entries that read, oldest first, and
    the damaged ones, named."""

    items: tuple[WorkItem, ...]
    damaged: tuple[DamagedEntry, ...] = ()


@runtime_checkable
class WorksAroundDamage(Protocol):
    """A capability of a work index: an operator's listing that goes on past a damaged
    entry and names it (``WorkIndex.items`` stops at the first), so one hand-edited row
    hides no other run from the people looking for it."""

    async def listing(
        self, tenant: str | None = None, *, state: WorkState | None = None
    ) -> WorkListing:
        """``items``' entries, and the damaged entries among them (in any state, when
        their state cannot be read)."""
        ...


@runtime_checkable
class WakesParked(Protocol):
    """A capability of a work index: a parked run woken in one write that goes on counting
    its attempts. A worker waking a run another worker parked (a worker of another
    revision, in a rolling deploy) must not start the count again, or a run handed back
    and forth would never meet ``max_attempts``; with ``WorkIndex.want`` alone that takes
    two writes (unpark, then count), and a failure between them loses the count."""

    async def wake(
        self, tenant: str, run_id: str, *, agent: str, attempts: int, reason: str | None
    ) -> bool:
        """If the run's entry is still parked as it was read (of ``agent``, with
        ``attempts`` counted and parked for ``reason``), it becomes ``wanted`` now with
        one more attempt counted and no reason; ``True``. Otherwise nothing is written
        (another worker woke or took it, or parked it again, since): ``False``."""
        ...
