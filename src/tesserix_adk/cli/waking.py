"""What an operator's decision does next: the run's frontier read if it can be, and the
work index told the run wants a worker again."""

from __future__ import annotations

import contextlib

from tesserix_adk.checkpoint.checkpointer import Checkpointer
from tesserix_adk.checkpoint.payload import Checkpoint
from tesserix_adk.errors import (
    AdkError,
    CheckpointCorruptError,
    CheckpointFormatError,
    IndeterminateToolCallError,
)
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.stores.protocols import WorkState
from tesserix_adk.worker_parking import parked_for

__all__ = ["readable_frontier", "wake", "wake_waiting_on"]


async def readable_frontier(stores: Stores, tenant: str, run_id: str) -> Checkpoint | None:
    """The run's frontier, or ``None`` when there is none or it cannot be read."""
    with contextlib.suppress(CheckpointCorruptError, CheckpointFormatError):
        return await Checkpointer.from_stores(stores).latest(tenant, run_id)
    return None


async def wake(
    stores: Stores, tenant: str, run_id: str, state: WorkState, cp: Checkpoint | None
) -> bool:
    """Tell the work index the run wants a worker again (an operator acted on it): whether
    a worker will find it. A parked run is unparked. ``cp``: its frontier, if readable."""
    if stores.work is None:
        return False
    if cp is not None and cp.carried_by is not None:
        return False  # its workflow carries it: a kit worker told of it would only refuse it
    if cp is not None and cp.status.finished:
        return False  # it ended (a cancel, say): nothing is carried on
    agent = None if cp is None else cp.agent_name
    if agent is None:
        known = await stores.work.entry(tenant, run_id)
        agent = None if known is None else known.agent
    if agent is None:
        return False
    await stores.work.want(tenant, run_id, agent=agent, state=state)
    return True


async def wake_waiting_on(
    stores: Stores, tenant: str, key: str, *, but: str
) -> tuple[list[str], str | None]:
    """Wake the tenant's runs (other than ``but``) parked in doubt whose frontier waits on
    the call under ``key``: a business key they share with ``but``, whose claim an operator
    just settled there, so nothing is in doubt for them any more. A run parked for another
    reason (too many attempts) stays parked. Returns the runs woken, in the index's order,
    and what kept it from looking at every parked run (``None``: nothing); a worker that
    finds a woken run still in doubt parks it again (the index is not the truth)."""
    if stores.work is None:
        return [], None
    try:
        parked = await stores.work.items(tenant, state=WorkState.parked)
    except AdkError as exc:
        return [], f"could not look for other runs parked on this call: {exc}"
    woken: list[str] = []
    missed: list[str] = []
    for item in parked:
        if item.run_id == but or not parked_for(item, IndeterminateToolCallError):
            continue
        try:
            cp = await readable_frontier(stores, tenant, item.run_id)
            if cp is None or all(oc.key != key for oc in cp.outstanding):
                continue
            if await wake(stores, tenant, item.run_id, WorkState.wanted, cp):
                woken.append(item.run_id)
        except AdkError as exc:
            missed.append(f"{item.run_id} ({exc})")
    trouble = None if not missed else "could not look at or wake " + "; ".join(missed)
    return woken, trouble
