"""Runs that have no frontier yet, as operators see them: submitted and waiting for a
worker (or parked by one before it began), or cancelled before any worker started them.

Their only traces are the work index entry and, for a cancelled one, its cancel request;
the runs list of the CLI and of the console both read them here, so the two agree.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from tesserix_adk.run.cancelling import CancelRequest, cancel_requested
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.stores.protocols import WorkItem, WorkState

__all__ = ["Unstarted", "unstarted_runs"]


@dataclass(frozen=True, slots=True)
class Unstarted:
    """A run with no frontier: its work entry, and its cancel request if one ended it."""

    item: WorkItem
    cancel: CancelRequest | None = None

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
    stores: Stores, tenant: str, *, with_frontier: Collection[str], cancelled: bool = True
) -> list[Unstarted]:
    """The tenant's runs the work index knows and ``with_frontier`` does not: every one
    still waiting (or parked), then, with ``cancelled``, those a cancel ended before they
    started. A finished entry without a cancel request is left out: its run ended with a
    frontier, listed elsewhere (or since removed)."""
    if stores.work is None:
        return []
    found = [
        Unstarted(item)
        for item in await stores.work.items(tenant)
        if item.run_id not in with_frontier
    ]
    if cancelled:
        for item in await stores.work.items(tenant, state=WorkState.done):
            if item.run_id in with_frontier:
                continue
            request = await cancel_requested(stores.idempotency, tenant, item.run_id)
            if request is not None:
                found.append(Unstarted(item, request))
    return found
