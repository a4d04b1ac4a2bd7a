"""Asking a store for an optional capability by type, with one clear error when it lacks it.

The capabilities are protocols in ``stores.protocols`` (``StepHistory``, ``RunListing``,
``FrontierWithHistory``); the conformance suites skip their tests for a store without one.
"""

from __future__ import annotations

from tesserix_adk.errors import ConfigurationError
from tesserix_adk.messages import Usage
from tesserix_adk.stores.protocols import Ledger, LedgerTotals, RunListing, StepHistory

__all__ = ["lacks", "ledger_totals", "run_listing", "step_history"]


def lacks(store: object, capability: type) -> ConfigurationError:
    """The error for ``store`` not offering ``capability``, with what the capability is."""
    summary = " ".join((capability.__doc__ or "").strip().split("\n\n")[0].split())
    return ConfigurationError(
        f"the store {type(store).__name__} does not offer {capability.__name__}: {summary}"
    )


def step_history(store: object) -> StepHistory:
    """``store``'s step snapshots, or ``ConfigurationError`` if it keeps none."""
    if not isinstance(store, StepHistory):
        raise lacks(store, StepHistory)
    return store


def run_listing(store: object) -> RunListing:
    """``store``'s run listing, or ``ConfigurationError`` if it cannot list runs."""
    if not isinstance(store, RunListing):
        raise lacks(store, RunListing)
    return store


async def ledger_totals(ledger: Ledger, tenant: str, run_id: str) -> tuple[int, Usage]:
    """What the run spent, micros and tokens: in one request where ``ledger`` offers
    ``LedgerTotals``, else in two."""
    if isinstance(ledger, LedgerTotals):
        return await ledger.totals(tenant, run_id)
    return await ledger.spent(tenant, run_id), await ledger.usage(tenant, run_id)
