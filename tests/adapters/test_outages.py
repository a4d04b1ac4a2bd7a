"""A store's server stopped in the middle of a live run, and started again.

The run keeps its checkpoints and transcript on the server and its idempotency records in
memory, so it needs nothing from the server to go on: a frontier that cannot be written is
kept in ``Checkpointer.last_error`` and the run completes. After the restart, whatever the
server holds must be whole — every frontier decodes and its transcript resolves.

These tests stop and start the machine's own servers, so they run only where that is
allowed: ``ADK_TEST_CONTROL_SERVERS=1``, or always under ``CI=true``. The server is started
again in a ``finally``, whatever happened, and is answering before the next test runs.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import pytest

from adapters import services
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


def _may_control_servers() -> bool:
    return (
        os.environ.get("ADK_TEST_CONTROL_SERVERS", "").strip() == "1"
        or os.environ.get("CI", "").strip().lower() == "true"
    )


pytestmark = pytest.mark.skipif(
    not _may_control_servers(),
    reason="stops and starts the local Redis and PostgreSQL servers; runs only with "
    "ADK_TEST_CONTROL_SERVERS=1 or under CI=true",
)

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


def command(*argv: str, cwd: str | None = None) -> None:
    """Run a server-control command; its output is shown if it fails."""
    done = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, f"{argv} exited {done.returncode}: {done.stdout}{done.stderr}"


def answers(*argv: str) -> bool:
    return subprocess.run(argv, capture_output=True, timeout=10, check=False).returncode == 0


def wait_until(condition: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what} not within {timeout:.0f}s"
        time.sleep(0.1)


def require(*programs: str) -> None:
    for program in programs:
        if shutil.which(program) is None:
            services.unavailable(f"{program} is not installed, so the server cannot be controlled")


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
        checkpointer = stores.checkpointer()
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
    require("redis-cli", "redis-server")
    client = await services.redis_client()
    # Started again where it ran before, so any file it keeps lands where it did.
    directory = str((await client.config_get("dir"))["dir"])
    await client.aclose()
    where = urlsplit(services.REDIS_URL)
    host, port = where.hostname or "127.0.0.1", str(where.port or 6379)
    cli = ("redis-cli", "-h", host, "-p", port)
    prefix = services.redis_prefix()
    url = services.with_query(services.REDIS_URL, prefix=prefix, allow_volatile="true")

    def stop_redis() -> None:
        command(*cli, "shutdown", "nosave")
        wait_until(lambda: not answers(*cli, "ping"), "Redis stopping")

    try:
        status, error = await run_through_an_outage(url, stop_redis)
    finally:
        if not answers(*cli, "ping"):
            # Exactly as this machine runs it: no persistence.
            restart = ("--daemonize", "yes", "--bind", host, "--port", port)
            command("redis-server", *restart, "--save", "", "--appendonly", "no", cwd=directory)
            wait_until(lambda: answers(*cli, "ping"), "Redis answering again")
    assert status is RunStatus.completed
    assert isinstance(error, StoreUnavailableError), error

    # This Redis keeps nothing across a restart, so the run may be gone; whatever is there
    # must still be whole, and the started-again server serves new clients.
    client = await services.redis_client()
    try:
        async with open_stores(url) as stores:
            await assert_whole(stores.checkpointer(), required=False)
    finally:
        await services.delete_prefixed(client, prefix)
        await client.aclose()


# --- PostgreSQL --------------------------------------------------------------------------


def postgres_version() -> str:
    """The one PostgreSQL version installed as a Debian cluster (``ls /etc/postgresql``)."""
    clusters = sorted(os.listdir("/etc/postgresql")) if os.path.isdir("/etc/postgresql") else []
    if len(clusters) != 1:
        services.unavailable(f"expected one PostgreSQL version in /etc/postgresql: {clusters}")
    return clusters[0]


async def execute(sql: str) -> None:
    """One statement on a connection of its own (none is held across the outage)."""
    import psycopg

    try:
        conn = await psycopg.AsyncConnection.connect(
            services.POSTGRES_URL, autocommit=True, connect_timeout=3
        )
    except psycopg.OperationalError as exc:
        services.unavailable(f"PostgreSQL at {services.POSTGRES_URL} cannot be reached: {exc}")
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


@pytest.mark.postgres
async def test_postgres_stopped_mid_run_the_run_completes_and_the_last_frontier_is_whole() -> None:
    require("pg_ctlcluster", "pg_isready")
    ctl = ("pg_ctlcluster", "--skip-systemctl-redirect", postgres_version(), "main")
    where = urlsplit(services.POSTGRES_URL)
    ready = ("pg_isready", "-h", where.hostname or "127.0.0.1", "-p", str(where.port or 5432))
    schema = f"adktest_{secrets.token_hex(6)}"
    await execute(f'CREATE SCHEMA "{schema}"')
    url = services.schema_url(schema)
    try:
        async with open_stores(url) as stores:
            await stores.create_schema()

        def stop_postgres() -> None:
            command(*ctl, "stop")

        try:
            status, error = await run_through_an_outage(url, stop_postgres)
        finally:
            if not answers(*ready):
                command(*ctl, "start")
                wait_until(lambda: answers(*ready), "PostgreSQL accepting connections again")
        assert status is RunStatus.completed
        assert isinstance(error, StoreUnavailableError), error

        # PostgreSQL keeps what it committed: the frontier written just before the outage
        # (the model asking for the tool that stopped the server), whole, with its transcript.
        async with open_stores(url) as stores:
            checkpointer = stores.checkpointer()
            await assert_whole(checkpointer, required=True)
            latest = await checkpointer.latest(T, R)
        assert latest is not None
        assert latest.boundary is Boundary.after_model_call
        assert [c.call.name for c in latest.outstanding] == ["take_the_server_down"]
    finally:
        await execute(f'DROP SCHEMA "{schema}" CASCADE')
