"""A process streaming a run is SIGKILLed mid-stream; a new process resumes it.

The fake model server holds the last answer's stream open after a few events, so the kill
lands while the model is streaming: the frontier after the booking is the last one, the
resume (streamed, in a new process) asks the model again, and the seat is booked once.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

from processes import Site

from .fake_server import ModelServer
from .vendors import Vendor

CHILD = Path(__file__).parent / "streaming_process.py"
SEARCH = ("call_search_1", "search_flights", {"origin": "FRA", "destination": "JFK"})
BOOK = ("call_book_1", "book_seat", {"flight": "LH400", "passenger": "Ada Lovelace"})
ANSWER = "Booked LH400 from Frankfurt to New York for Ada Lovelace."


def child(site: Site, vendor: Vendor, server: ModelServer, verb: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(CHILD), site.store, vendor.name, server.url, "r1", verb],
        env=site.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_sigkill_mid_stream_then_a_new_process_resumes_and_books_once(
    vendor: Vendor, model_server: ModelServer, tmp_path: Path
) -> None:
    site = Site(tmp_path)
    model_server.queue(
        vendor.streamed(calls=[SEARCH]),
        vendor.streamed(calls=[BOOK]),
        vendor.streamed(ANSWER, hold_after=3),  # a text piece out, then the stream hangs
    )
    proc = child(site, vendor, model_server, "stream")
    assert proc.stdout is not None
    watchdog = threading.Timer(60, proc.kill)  # a child stuck before the kill point fails
    watchdog.start()
    seen: list[str] = []
    try:
        while not seen or seen[-1] != "TextDelta 2":
            out = proc.stdout.readline()
            if not out:
                proc.kill()
                raise AssertionError(f"the stream ended early: {seen} {proc.communicate()[1]}")
            seen.append(out.strip())
    finally:
        watchdog.cancel()
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=10)
    assert proc.returncode == -signal.SIGKILL
    assert "FrontierWritten 4 after_tool_result" in seen
    assert site.bookings("r1") == 1
    assert len(model_server.requests) == 3

    site.wait_lease_lapsed("r1")
    model_server.queue(vendor.streamed(ANSWER))
    done = child(site, vendor, model_server, "resume")
    out, err = done.communicate(timeout=60)
    assert done.returncode == 0, out + err
    lines = out.splitlines()
    assert "TextDelta 2" in lines  # the answer streamed again, from its start
    assert lines[-1] == f"RunFinished completed {ANSWER}"
    assert site.bookings("r1") == 1
    assert len(model_server.requests) == 4
    # The model was asked again with exactly what it was asked when the process died.
    assert model_server.bodies[3]["messages"] == model_server.bodies[2]["messages"]
