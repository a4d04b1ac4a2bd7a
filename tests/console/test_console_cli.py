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


def test_tesserix_ui_serves_the_console_until_stopped(store_url: str) -> None:
    with subprocess.Popen(
        [sys.executable, "-m", "tesserix_adk", "ui", "--store", store_url, "--port", "0"],
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as proc:
        _serves(proc)
    assert proc.returncode == 0


def _serves(proc: subprocess.Popen[str]) -> None:
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()
        found = re.search(r"on http://127\.0\.0\.1:([0-9]+)/ \(loopback, no token\)", first)
        assert found is not None, first
        port = int(found.group(1))
        deadline = time.monotonic() + 30
        while True:
            try:
                page = httpx.get(f"http://127.0.0.1:{port}/t/{TENANT}/runs", timeout=5)
                break
            except httpx.TransportError:
                assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
                assert time.monotonic() < deadline, "tesserix ui did not answer"
                time.sleep(0.1)
        assert page.status_code == 200 and "r-wait" in page.text and "r-park" in page.text
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


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
