"""``tesserix ui`` as a real process: it serves the console on loopback, and refuses a
host that is not loopback without a token (exit 2, one sentence)."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest
from console_world import TENANT, free_port


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("TESSERIX_UI_TOKEN", None)
    return env


def test_a_host_that_is_not_loopback_needs_a_token() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "tesserix_adk", "ui", "--host", "0.0.0.0"],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    (line,) = done.stderr.splitlines()
    assert "0.0.0.0 is not loopback" in line and "--token" in line and "TESSERIX_UI_TOKEN" in line
    assert done.stdout == ""


@pytest.mark.parametrize("token", [None, "from-the-env"], ids=["no-token", "env-token"])
def test_tesserix_ui_serves_the_console_until_stopped(store_url: str, token: str | None) -> None:
    env = _env()
    if token is not None:
        env["TESSERIX_UI_TOKEN"] = token
    with subprocess.Popen(
        [sys.executable, "-m", "tesserix_adk", "ui", "--store", store_url, "--port", "0"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as proc:
        try:
            _serves(proc, token)
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    assert proc.returncode == 0


def _serves(proc: subprocess.Popen[str], token: str | None) -> None:
    assert proc.stdout is not None
    first = proc.stdout.readline()
    said = "token required" if token else "loopback, no token"
    found = re.search(rf"on http://127\.0\.0\.1:([0-9]+)/ \({said}\)", first)
    assert found is not None, first
    runs = f"http://127.0.0.1:{found.group(1)}/t/{TENANT}/runs"
    deadline = time.monotonic() + 30
    while True:
        try:
            page = httpx.get(runs, timeout=5)
            break
        except httpx.TransportError:
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            assert time.monotonic() < deadline, "tesserix ui did not answer"
            time.sleep(0.1)
    if token is not None:
        assert page.status_code == 303  # to the login form
        page = httpx.get(runs, headers={"authorization": f"Bearer {token}"}, timeout=5)
    assert page.status_code == 200 and "r-wait" in page.text and "r-park" in page.text


def test_a_port_in_use_is_one_sentence_and_exit_3() -> None:
    port = free_port()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", port))
        busy.listen()
        done = subprocess.run(
            [sys.executable, "-m", "tesserix_adk", "ui", "--port", str(port)],
            env=_env(),
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert done.returncode == 3
    (line,) = done.stderr.splitlines()
    assert line.startswith(f"tesserix: ui: cannot listen on 127.0.0.1 port {port}:")


def test_importing_the_kit_and_its_cli_imports_no_web_framework() -> None:
    probe = (
        "import sys, tesserix_adk, tesserix_adk.cli.main; "
        "bad = [m for m in ('starlette', 'uvicorn') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", probe], check=True, timeout=60)
