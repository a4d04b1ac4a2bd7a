"""The ledger of what a run spent."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from tesserix_adk.messages import Usage

__all__ = ["Ledger", "LedgerTotals"]


@runtime_checkable
class Ledger(Protocol):
    """The authority on what a run has spent."""

    async def charge(
        self, tenant: str, run_id: str, micros: int, usage: Usage, *, fence: int | None = None
    ) -> None:
        """Add a model call's cost and usage to the run."""
        ...

    async def spent(self, tenant: str, run_id: str) -> int:
        """Micros charged to the run so far (0 for an unknown run)."""
        ...

    async def usage(self, tenant: str, run_id: str) -> Usage:
        """Tokens charged to the run so far."""
        ...

    async def seal(self, tenant: str, run_id: str, fence: int) -> None:
        """Raise the highest-seen fence for the run without writing data."""
        ...


@runtime_checkable
class LedgerTotals(Protocol):
    """Optional: a ledger that reads a run's micros and tokens in one request (a resume
    needs both; without this it asks ``spent`` and ``usage`` one after the other)."""

    async def totals(self, tenant: str, run_id: str) -> tuple[int, Usage]:
        """Micros and tokens charged to the run so far, read together."""
        ...
