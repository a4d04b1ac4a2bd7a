"""Every conformance suite against every backend, through one parametrised fixture.

A backend joins by adding an entry to ``BACKENDS``: a function that opens its whole set of
stores (and closes them afterwards) and whether they run on the test's ``FakeClock``.
"""

from __future__ import annotations

import itertools
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from adapters.services import postgres_stores, redis_stores
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.stores.memory import (
    MemoryApprovalStore,
    MemoryCheckpointStore,
    MemoryHistoryStore,
    MemoryIdempotencyStore,
    MemoryLeaseStore,
    MemoryLedger,
)
from tesserix_adk.stores.protocols import (
    ApprovalStore,
    CheckpointStore,
    HistoryStore,
    IdempotencyStore,
    LeaseStore,
    Ledger,
)
from tesserix_adk.stores.sqlite import open_sqlite_stores
from tesserix_adk.testing import (
    ApprovalStoreConformance,
    CheckpointStoreConformance,
    FakeClock,
    HistoryStoreConformance,
    IdempotencyStoreConformance,
    LeaseStoreConformance,
    LedgerConformance,
)
from tesserix_adk.testing.checkpoint_store import MakeCheckpointStore
from tesserix_adk.testing.corruption import CorruptionConformance


@dataclass(frozen=True, slots=True, kw_only=True)
class StoreSet:
    """One backend's stores, named as ``open_stores`` names them."""

    checkpoints: CheckpointStore
    idempotency: IdempotencyStore
    leases: LeaseStore
    history: HistoryStore
    ledger: Ledger
    approvals: ApprovalStore


OpenStores = Callable[[FakeClock | None, int | None, Path], AbstractAsyncContextManager[StoreSet]]


@dataclass(frozen=True, slots=True, kw_only=True)
class Backend:
    """How to open a backend's stores for one test."""

    open: OpenStores
    # False for stores that read a database or server clock: time then passes for real.
    runs_on_fake_clock: bool


@asynccontextmanager
async def open_memory(
    clock: FakeClock | None, keep_last: int | None, tmp_path: Path
) -> AsyncIterator[StoreSet]:
    assert clock is not None
    yield StoreSet(
        checkpoints=MemoryCheckpointStore(keep_last=keep_last),
        idempotency=MemoryIdempotencyStore(clock=clock),
        leases=MemoryLeaseStore(clock=clock),
        history=MemoryHistoryStore(),
        ledger=MemoryLedger(),
        approvals=MemoryApprovalStore(clock=clock),
    )


@asynccontextmanager
async def open_sqlite(
    clock: FakeClock | None, keep_last: int | None, tmp_path: Path
) -> AsyncIterator[StoreSet]:
    # SQLite decides expiry by its own clock: the suites wait for real (clock is None).
    assert clock is None
    async with open_sqlite_stores(tmp_path / "adk.sqlite3", keep_last=keep_last) as opened:
        await opened.create_schema()
        yield StoreSet(
            checkpoints=opened.checkpoints,
            idempotency=opened.idempotency,
            leases=opened.leases,
            history=opened.history,
            ledger=opened.ledger,
            approvals=opened.approvals,
        )


@asynccontextmanager
async def open_redis(
    clock: FakeClock | None, keep_last: int | None, tmp_path: Path
) -> AsyncIterator[StoreSet]:
    # Redis decides expiry by its TIME: the suites wait for real. Skips (or fails under
    # CI=true) when the server cannot be reached; the test's keys are deleted after.
    assert clock is None
    async with redis_stores(keep_last=keep_last) as opened:
        yield _store_set(opened)


@asynccontextmanager
async def open_postgres(
    clock: FakeClock | None, keep_last: int | None, tmp_path: Path
) -> AsyncIterator[StoreSet]:
    # PostgreSQL decides expiry by clock_timestamp(); each test gets its own schema.
    assert clock is None
    async with postgres_stores(keep_last=keep_last) as opened:
        yield _store_set(opened)


def _store_set(opened: Stores) -> StoreSet:
    return StoreSet(
        checkpoints=opened.checkpoints,
        idempotency=opened.idempotency,
        leases=opened.leases,
        history=opened.history,
        ledger=opened.ledger,
        approvals=opened.approvals,
    )


BACKENDS: dict[str, Backend] = {
    "memory": Backend(open=open_memory, runs_on_fake_clock=True),
    "sqlite": Backend(open=open_sqlite, runs_on_fake_clock=False),
    "redis": Backend(open=open_redis, runs_on_fake_clock=False),
    "postgres": Backend(open=open_postgres, runs_on_fake_clock=False),
}


@pytest.fixture(params=list(BACKENDS))
def backend(request: pytest.FixtureRequest) -> Backend:
    return BACKENDS[request.param]


@pytest.fixture
def clock(backend: Backend) -> FakeClock | None:
    return FakeClock() if backend.runs_on_fake_clock else None


@pytest.fixture
async def stores(
    backend: Backend, clock: FakeClock | None, tmp_path: Path
) -> AsyncIterator[StoreSet]:
    async with backend.open(clock, None, tmp_path) as opened:
        yield opened


@pytest.fixture
def checkpoint_store(stores: StoreSet) -> CheckpointStore:
    return stores.checkpoints


@pytest.fixture
async def make_checkpoint_store(
    backend: Backend, clock: FakeClock | None, tmp_path: Path
) -> AsyncIterator[MakeCheckpointStore]:
    made = itertools.count()
    async with AsyncExitStack() as stack:

        async def make(keep_last: int) -> CheckpointStore:
            folder = tmp_path / f"keep_last_{next(made)}"
            folder.mkdir()
            opened = await stack.enter_async_context(backend.open(clock, keep_last, folder))
            return opened.checkpoints

        yield make


@pytest.fixture
def idempotency_store(stores: StoreSet) -> IdempotencyStore:
    return stores.idempotency


@pytest.fixture
def lease_store(stores: StoreSet) -> LeaseStore:
    return stores.leases


@pytest.fixture
def history_store(stores: StoreSet) -> HistoryStore:
    return stores.history


@pytest.fixture
def ledger(stores: StoreSet) -> Ledger:
    return stores.ledger


@pytest.fixture
def approval_store(stores: StoreSet) -> ApprovalStore:
    return stores.approvals


class TestCheckpointStore(CheckpointStoreConformance):
    pass


class TestIdempotencyStore(IdempotencyStoreConformance):
    pass


class TestLeaseStore(LeaseStoreConformance):
    pass


class TestHistoryStore(HistoryStoreConformance):
    pass


class TestLedger(LedgerConformance):
    pass


class TestApprovalStore(ApprovalStoreConformance):
    pass


class TestCorruption(CorruptionConformance):
    pass


def test_importing_the_testing_package_needs_no_pytest() -> None:
    code = (
        "import sys\n"
        "from tesserix_adk.testing import FakeClock\n"
        "assert 'pytest' not in sys.modules, 'tesserix_adk.testing imported pytest'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
