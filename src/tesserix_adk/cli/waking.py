"""What an operator's decision does next: the run's frontier read if it can be, and the
work index told the run wants a worker again."""

from __future__ import annotations

import contextlib

from tesserix_adk.checkpoint.checkpointer import Checkpointer
from tesserix_adk.checkpoint.payload import Checkpoint
from tesserix_adk.errors import CheckpointCorruptError, CheckpointFormatError
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.stores.protocols import WorkState

__all__ = ["readable_frontier", "wake"]


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
