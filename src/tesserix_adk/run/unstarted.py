"""Runs that have no frontier yet, as operators see them: submitted and waiting for a
worker (or parked by one before it began), or cancelled before any worker started them.

Their only traces are the work index entry and, for a cancelled one, its cancel request;
the runs list of the CLI and of the console both read them here, so the two agree.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from tesserix_adk.errors import CheckpointCorruptError, CheckpointFormatError
from tesserix_adk.run.cancelling import CancelRequest, cancel_requested
from tesserix_adk.run.entries import shown_entry
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.stores.protocols import (
    DamagedEntry,
    RunLease,
    WorkIndex,
    WorkItem,
    WorkState,
)
from tesserix_adk.stores.rows import listed_past_damage

__all__ = ["Unstarted", "unstarted_runs"]


async def _listed(
    work: WorkIndex, tenant: str, state: WorkState | None
) -> tuple[list[WorkItem], list[DamagedEntry]]:
    """The tenant's entries in ``state`` as operators are shown them, past any damaged one
    where the index can (``stores.rows.listed_past_damage``)."""
    listing = await listed_past_damage(work, tenant, state)
    return [shown_entry(i) for i in listing.items], list(listing.damaged)


@dataclass(frozen=True, slots=True)
class Unstarted:
    """A run with no frontier: its work entry, its cancel request if one ended it, the live
    lease of a worker starting it, or why its cancel request cannot be read."""

    item: WorkItem
    cancel: CancelRequest | None = None
    lease: RunLease | None = None
    unreadable: str | None = None

    @property
    def status(self) -> str:
        """``cancelled`` (before it started) or ``submitted``."""
        return "cancelled" if self.cancel is not None else "submitted"

    @property
    def parked(self) -> str | None:
        """Why a worker parked it before its first frontier, or ``None``."""
        if self.item.state is not WorkState.parked:
            return None
        return self.item.reason or ""

    @property
    def said(self) -> str | None:
        """One line on how it ended, for a cancelled one."""
        if self.cancel is None:
            return None
        reason = f": {self.cancel.reason}" if self.cancel.reason else ""
        return f"cancelled before it started, by {self.cancel.by}{reason}"


async def unstarted_runs(
    stores: Stores,
    tenant: str,
    *,
    with_frontier: Collection[str],
    cancelled: bool = True,
    only: str | None = None,
) -> list[Unstarted]:
    """The tenant's runs the work index knows and ``with_frontier`` does not (only run
    ``only``, when given): every one still waiting (or parked, or being started by a worker
    whose lease is live), then, with ``cancelled``, those a cancel ended before they
    started. A finished entry without a cancel request is left out: its run ended with a
    frontier, listed elsewhere (or since removed). A cancel request that cannot be read
    makes its run ``unreadable``, never the whole list."""
    if stores.work is None:
        return []
    if only is not None:
        # One run: its entry alone, not every entry of the tenant.
        one = await stores.work.entry(tenant, only)
        entries = [] if one is None or only in with_frontier else [shown_entry(one)]
        waiting = [i for i in entries if i.state is not WorkState.done]
        ended = [i for i in entries if i.state is WorkState.done and cancelled]
    else:
        listed, damaged = await _listed(stores.work, tenant, None)
        waiting = [i for i in listed if i.run_id not in with_frontier]
        ended = []
        if cancelled:
            done, more = await _listed(stores.work, tenant, WorkState.done)
            ended = [i for i in done if i.run_id not in with_frontier]
            damaged += more
    found = [Unstarted(i, lease=await stores.leases.current(tenant, i.run_id)) for i in waiting]
    if only is None:
        # One damaged entry hides no other run; itself, it is named (a run with a frontier
        # is named where its frontier is listed).
        seen: set[tuple[str | None, str | None]] = set()
        for d in damaged:
            if d.run_id in with_frontier or (d.tenant, d.run_id) in seen:
                continue
            seen.add((d.tenant, d.run_id))
            placeholder = WorkItem(
                tenant=d.tenant or tenant,
                run_id=d.run_id or "?",
                agent="",
                state=WorkState.parked,
                since=0.0,
            )
            found.append(Unstarted(placeholder, unreadable=f"its work index entry: {d.why}"))
    for item in ended:
        try:
            request = await cancel_requested(stores.idempotency, tenant, item.run_id)
        except (CheckpointCorruptError, CheckpointFormatError) as exc:
            found.append(Unstarted(item, unreadable=str(exc)))
            continue
        if request is not None:
            found.append(Unstarted(item, request))
    return found
