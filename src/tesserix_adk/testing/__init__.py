"""Conformance suites for every store protocol, and a clock tests move by hand.

A backend joins by subclassing a suite in its own test module and providing the fixtures
its docstring names; the suites are plain pytest classes. Importing this package imports
nothing but ``FakeClock``; a suite (and pytest with it) is imported on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from tesserix_adk.testing.clock import FakeClock

if TYPE_CHECKING:
    from tesserix_adk.testing.approval_store import ApprovalStoreConformance
    from tesserix_adk.testing.checkpoint_store import CheckpointStoreConformance
    from tesserix_adk.testing.corruption import CorruptionConformance
    from tesserix_adk.testing.frontier_with_history import FrontierWithHistoryConformance
    from tesserix_adk.testing.history_store import HistoryStoreConformance
    from tesserix_adk.testing.idempotency_store import IdempotencyStoreConformance
    from tesserix_adk.testing.lease_store import LeaseStoreConformance
    from tesserix_adk.testing.ledger import LedgerConformance
    from tesserix_adk.testing.secrets import PlantedSecretsSuite
    from tesserix_adk.testing.work_index import WorkIndexConformance

__all__ = [
    "ApprovalStoreConformance",
    "CheckpointStoreConformance",
    "CorruptionConformance",
    "FakeClock",
    "FrontierWithHistoryConformance",
    "HistoryStoreConformance",
    "IdempotencyStoreConformance",
    "LeaseStoreConformance",
    "LedgerConformance",
    "PlantedSecretsSuite",
    "WorkIndexConformance",
]

_SUITES = {
    "ApprovalStoreConformance": "approval_store",
    "CheckpointStoreConformance": "checkpoint_store",
    "CorruptionConformance": "corruption",
    "FrontierWithHistoryConformance": "frontier_with_history",
    "HistoryStoreConformance": "history_store",
    "IdempotencyStoreConformance": "idempotency_store",
    "LeaseStoreConformance": "lease_store",
    "LedgerConformance": "ledger",
    "PlantedSecretsSuite": "secrets",
    "WorkIndexConformance": "work_index",
}


def __getattr__(name: str) -> Any:
    # The suites import pytest; FakeClock users should not need it installed.
    module = _SUITES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


def __dir__() -> list[str]:
    return sorted(__all__)
