"""A store's server stopped in the middle of a live run, and started again.

The run keeps its checkpoints and transcript on the server and its idempotency records in
memory, so it needs nothing from the server to go on: a frontier that cannot be written is
kept in ``Checkpointer.last_error`` and the run completes. After the restart, whatever the
server holds must be whole — every frontier decodes and its transcript resolves.

Each test stops and starts a server of its own on a free loopback port (a throwaway
``redis-server``; a PostgreSQL cluster made with ``initdb``), never the shared ones. A
missing server binary skips the test with the reason, except under ``CI=true``, where it
fails it.
"""

from __future__ import annotations

import os
import pwd
import shutil
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest

from adapters import services
from adapters.throwaway import redis_server
from reliability.servers import PostgresCluster
from tesserix_adk import (
    Agent,
    AgentRunner,
    Boundary,
    Checkpointer,
    RunStatus,
    ScriptedProvider,
    tool,
)
from tesserix_adk.errors import StoreUnavailableError
from tesserix_adk.stores.memory import MemoryIdempotencyStore
from tesserix_adk.stores.urls import open_stores

T = "acme"
R = "outage"
TURNS: list[Any] = [
    [("search_flights", {"origin": "FRA", "dest": "JFK"})],
    [("take_the_server_down", {})],
    "Found LH123; nothing was booked.",
]


def outage_agent(stop_server: Callable[[], None]) -> Agent:
    """An agent whose second turn stops the store's server from inside a read-only tool:
    the outage falls between two turns, after a frontier was written."""

    @tool(side_effects=False)
    def search_flights(origin: str, dest: str) -> list[str]:
        """Find flights between two airports."""
        return ["LH123"]

    @tool(side_effects=False)
    def take_the_server_down() -> str:
        """Stops the store's server (the test's doing, not the model's)."""
        stop_server()
        return "done"

    return Agent("outage", "Look up a flight.", [search_flights, take_the_server_down])


def require(*programs: str) -> None:
    """Each of ``programs`` is installed, or the test is ``services.unavailable``."""
    for program in programs:
        if shutil.which(program) is None:
            services.unavailable(f"{program} is not installed, so no server of its own can run")


async def assert_whole(checkpointer: Checkpointer, *, required: bool) -> None:
    """Every frontier the server kept decodes, and the transcript it names resolves."""
    latest = await checkpointer.latest(T, R)
    if latest is None:
        assert not required, "the frontiers written before the outage are gone"
        return
    assert latest.history_handle is not None
    assert len(await checkpointer.messages(latest)) == latest.history_handle.count
    for step in await checkpointer.steps(T, R):
        snapshot = await checkpointer.at(T, R, step)
        assert snapshot is not None
        await checkpointer.messages(snapshot)


async def run_through_an_outage(
    url: str, stop_server: Callable[[], None]
) -> tuple[RunStatus, Exception | None]:
    """Run the agent with checkpoints and transcript on ``url``, idempotency in memory."""
    async with open_stores(url) as stores:
        checkpointer = Checkpointer.from_stores(stores)
        runner = AgentRunner(
            ScriptedProvider(TURNS),
            idempotency=MemoryIdempotencyStore(),
            checkpoints=checkpointer,
        )
        run = await runner.run(outage_agent(stop_server), "Find a flight.", tenant=T, run_id=R)
        return run.status, checkpointer.last_error


# --- Redis -------------------------------------------------------------------------------


@pytest.mark.redis
async def test_redis_stopped_mid_run_the_run_completes_and_nothing_is_half_written() -> None:
    require("redis-server")
    # As the shared server runs: no persistence, so the URL must accept volatility.
    with redis_server() as server:
        url = services.with_query(server.url, prefix="outage:", allow_volatile="true")
        status, error = await run_through_an_outage(url, server.shutdown)
        stopped = server.process.poll() is not None
    assert stopped, "the tool that stops the server never ran"
    assert status is RunStatus.completed
    assert isinstance(error, StoreUnavailableError), error

    # This Redis keeps nothing across a restart, so the run may be gone; whatever is there
    # must still be whole, and the server started again where it ran serves new clients.
    with redis_server(port=server.port) as again:
        async with open_stores(url) as stores:
            await assert_whole(Checkpointer.from_stores(stores), required=False)
        assert again.process.poll() is None


# --- PostgreSQL --------------------------------------------------------------------------


def require_postgres_cluster() -> None:
    """What ``PostgresCluster`` needs, checked here so CI fails where it would skip."""
    require("initdb", "pg_ctl")
    if os.geteuid() == 0:
        require("runuser")
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            services.unavailable("running as root and there is no postgres user for a cluster")


@asynccontextmanager
async def postgres_cluster() -> AsyncIterator[PostgresCluster]:
    """A running cluster of this test's own; stopped and removed after."""
    require_postgres_cluster()
    cluster = PostgresCluster()
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


def stop_cluster(cluster: PostgresCluster) -> None:
    """``pg_ctl -m fast stop``: the server closes every connection and is down on return."""
    # PostgresCluster only stops to restart at once or for good; the outage lasts the run.
    cluster._run("pg_ctl", "-D", str(cluster.data), "-m", "fast", "-w", "stop")


@pytest.mark.postgres
async def test_postgres_stopped_mid_run_the_run_completes_and_the_last_frontier_is_whole() -> None:
    async with postgres_cluster() as cluster:
        async with open_stores(cluster.url) as stores:
            await stores.create_schema()
        status, error = await run_through_an_outage(cluster.url, lambda: stop_cluster(cluster))
        assert status is RunStatus.completed
        assert isinstance(error, StoreUnavailableError), error

        cluster.start()
        # PostgreSQL keeps what it committed: the frontier written just before the outage
        # (the model asking for the tool that stopped the server), whole, with its transcript.
        async with open_stores(cluster.url) as stores:
            checkpointer = Checkpointer.from_stores(stores)
            await assert_whole(checkpointer, required=True)
            latest = await checkpointer.latest(T, R)
        assert latest is not None
        assert latest.boundary is Boundary.after_model_call
        assert [c.call.name for c in latest.outstanding] == ["take_the_server_down"]
