"""Fixtures every test may use."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

from booking import Airline
from tesserix_adk.testing import FakeClock

if TYPE_CHECKING:
    from adapters.cluster import ThrowawayCluster
    from adapters.pooler import PgBouncer


@pytest.fixture
def airline() -> Airline:
    return Airline()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[ThrowawayCluster]:
    """A three-master Redis Cluster of the session's own (AOF on every node), started on
    first use and stopped at the end; skips without redis-server (fails under CI=true)."""
    from adapters.cluster import redis_cluster as start_cluster

    with start_cluster() as cluster:
        yield cluster


@pytest.fixture(scope="session")
def shared_pgbouncer() -> Iterator[PgBouncer]:
    """A PgBouncer in transaction mode of the session's own, for tests that only connect
    through it (one per test costs a process start each); skips without pgbouncer (fails
    under CI=true). Tests that configure a pooler start their own."""
    from adapters.pooler import pgbouncer

    with pgbouncer() as bouncer:
        yield bouncer


@pytest.fixture
def grouped_writes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every ``AgentRunner`` the test builds groups its writes (``group_writes=True``)."""
    from tesserix_adk import AgentRunner

    defaults = AgentRunner.__init__.__kwdefaults__
    assert defaults is not None
    monkeypatch.setitem(defaults, "group_writes", True)
