"""``tesserix ui`` as a real process: it serves the console on loopback, and refuses a
host that is not loopback without a token (exit 2, one sentence)."""

from __future__ import annotations

import os
import signal
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
    port = free_port()
    with subprocess.Popen(
        [sys.executable, "-m", "tesserix_adk", "ui", "--store", store_url, "--port", str(port)],
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as proc:
        _serves(proc, port)
    assert proc.returncode == 0


def _serves(proc: subprocess.Popen[str], port: int) -> None:
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()
        assert f"http://127.0.0.1:{port}/" in first and "loopback" in first
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
