"""Cleanup that finishes even while its caller is being cancelled."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable

__all__ = ["shielded"]


async def shielded(awaitable: Awaitable[None]) -> None:
    """Finish ``awaitable`` even when the caller is being cancelled, then let the cancel
    through; its own failure is the caller's unless a cancel is."""
    task = asyncio.ensure_future(awaitable)
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        # Waited for, never awaited: awaiting it would pass a second cancel on to it.
        while not task.done():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait({task})
        if not task.cancelled():
            task.exception()
        raise
