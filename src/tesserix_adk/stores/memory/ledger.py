"""In-process spend: micros and tokens per run."""

from __future__ import annotations

from tesserix_adk.messages import Usage
from tesserix_adk.stores.memory.fencing import Fences, RunKey

__all__ = ["MemoryLedger"]


class MemoryLedger:
    """A ``Ledger`` in a dictionary: micros and tokens per run."""

    def __init__(self) -> None:
        self._spent: dict[RunKey, int] = {}
        self._usage: dict[RunKey, Usage] = {}
        self._fences = Fences()

    async def charge(
        self, tenant: str, run_id: str, micros: int, usage: Usage, *, fence: int | None = None
    ) -> None:
        """Add a model call's cost and usage to the run."""
        self._fences.check(tenant, run_id, fence)
        self._fences.accept(tenant, run_id, fence)
        key = (tenant, run_id)
        self._spent[key] = self._spent.get(key, 0) + micros
        self._usage[key] = self._usage.get(key, Usage()) + usage

    async def spent(self, tenant: str, run_id: str) -> int:
        """Micros charged to the run so far (0 for an unknown run)."""
        return self._spent.get((tenant, run_id), 0)

    async def totals(self, tenant: str, run_id: str) -> tuple[int, Usage]:
        """Micros and tokens charged to the run so far (``LedgerTotals``)."""
        return await self.spent(tenant, run_id), await self.usage(tenant, run_id)

    async def usage(self, tenant: str, run_id: str) -> Usage:
        """Tokens charged to the run so far."""
        return self._usage.get((tenant, run_id), Usage())

    async def seal(self, tenant: str, run_id: str, fence: int) -> None:
        """Raise the highest-seen fence for the run without writing data."""
        self._fences.seal(tenant, run_id, fence)
