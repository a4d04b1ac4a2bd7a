"""Fixtures every test may use."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from booking import Airline
from providers.fake_server import SDK_ENVIRONMENT, ModelServer
from reliability.figures import TALLY, details, lines
from reliability.profile import PROFILE
from tesserix_adk.testing import FakeClock

if TYPE_CHECKING:
    from adapters.cluster import ThrowawayCluster
    from adapters.pooler import PgBouncer


def pytest_configure(config: pytest.Config) -> None:
    # Property tests draw the same examples on every run, so a suite that passed passes
    # again; ADK_HYPOTHESIS=explore draws fresh ones each run (what found the last bugs).
    from hypothesis import settings

    settings.register_profile("repeatable", derandomize=True)
    settings.register_profile("explore", derandomize=False)
    settings.load_profile(
        "explore" if os.environ.get("ADK_HYPOTHESIS") == "explore" else "repeatable"
    )


@pytest.fixture
def model_server(monkeypatch: pytest.MonkeyPatch) -> Iterator[ModelServer]:
    """A fresh fake model server (OpenAI and Anthropic wire) on an ephemeral port, stopped
    after the test; the SDKs' environment is cleared so nothing reaches a real vendor."""
    for name in SDK_ENVIRONMENT:
        monkeypatch.delenv(name, raising=False)
    # Keep the SDKs away from any credentials file on this machine.
    monkeypatch.setenv("ANTHROPIC_CONFIG_DIR", "/nonexistent/tesserix-adk-tests")
    server = ModelServer()
    server.start()
    try:
        yield server
    finally:
        server.stop()


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


# --- the order files are handed to the test processes ------------------------------------
# `make test` hands whole files to its three processes in collection order
# (--no-loadscope-reorder). These files take a minute or more each, mostly waiting on
# processes and leases; started last, one of them kept one process busy long after the
# others had run out of work. Started first, the processes finish together. Order inside a file is
# kept (the README's blocks build on each other).
_SLOW_FIRST = (
    "tests/test_worker_chaos.py",
    "tests/reliability/test_races.py",
    "tests/on_temporal/",
    "tests/reliability/",
    "tests/test_crash_processes.py",
    "tests/mcp_tools/test_mcp_crash.py",
    "tests/cli/test_operator_story.py",
    "tests/adapters/test_process_races.py",
)


def _rank(item: pytest.Item) -> int:
    try:
        path = Path(str(item.path)).relative_to(item.config.rootpath).as_posix()
    except ValueError:  # collected from outside the checkout
        return len(_SLOW_FIRST)
    return next(
        (n for n, head in enumerate(_SLOW_FIRST) if path.startswith(head)), len(_SLOW_FIRST)
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items.sort(key=_rank)  # stable: each file's tests keep their order
    if os.environ.get("ADK_SLOW", "").strip() in ("", "0"):
        # Opt-in (ADK_SLOW=1): tests that wait out a dead server for most of a minute.
        slow = [item for item in items if item.get_closest_marker("slow") is not None]
        if slow:
            config.hook.pytest_deselected(items=slow)
            items[:] = [item for item in items if item.get_closest_marker("slow") is None]


# --- the reliability figures, gathered from every test process ---------------------------
# `make test` runs the suite in three processes (pytest-xdist): each worker hands its tally
# to the controller, which prints them all at the end.


def pytest_sessionfinish(session: pytest.Session) -> None:
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput["reliability_figures"] = json.dumps(TALLY.as_json())


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    rows = getattr(node, "workeroutput", {}).get("reliability_figures")
    if rows:
        TALLY.merge(json.loads(rows))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    rows = TALLY.as_json()
    if not rows:
        return
    terminalreporter.section(f"reliability figures ({PROFILE.name} profile)")
    for line in details(rows) + lines(rows):
        terminalreporter.write_line(line)
    target = os.environ.get("ADK_TORTURE_FIGURES")
    if target:
        Path(target).write_text(json.dumps(rows, indent=2))
