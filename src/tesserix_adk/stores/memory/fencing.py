"""The highest fence each in-process store has seen per run."""

from __future__ import annotations

from tesserix_adk.stores._common import stale_fence, unsealable

__all__ = ["Fences", "RunKey"]

RunKey = tuple[str, str]
"""(tenant, run_id)."""


class Fences:
    """The highest fence seen per (tenant, run_id); entries are never dropped."""

    def __init__(self) -> None:
        self._highest: dict[RunKey, int] = {}

    def check(self, tenant: str, run_id: str, fence: int | None) -> None:
        """Raise ``StaleFenceError`` if a write carrying ``fence`` must be refused."""
        highest = self._highest.get((tenant, run_id))
        if highest is None:
            return
        if fence is None or fence < highest:
            raise stale_fence("write", run_id, fence, highest)

    def accept(self, tenant: str, run_id: str, fence: int | None) -> None:
        """Remember ``fence`` once a write carrying it was accepted."""
        if fence is None:
            return
        key = (tenant, run_id)
        self._highest[key] = max(fence, self._highest.get(key, fence))

    def seal(self, tenant: str, run_id: str, fence: int) -> None:
        """Raise the highest-seen fence to ``fence``; refuse to lower it."""
        highest = self._highest.get((tenant, run_id))
        if highest is not None and highest > fence:
            raise unsealable(run_id, fence, highest)
        self._highest[(tenant, run_id)] = fence
