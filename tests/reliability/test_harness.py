"""The harness itself: a worker held while the test did something else is not called hung."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from reliability.conftest import make_site
from reliability.harness import _STATUS_LOST, WORKER_DEADLINE, Proc, stopped
from reliability.history import read_history


def test_a_worker_woken_after_its_deadline_is_judged_from_its_waking(tmp_path: Path) -> None:
    site = make_site(f"sqlite:///{tmp_path / 'adk.sqlite3'}", tmp_path, "sqlite")
    proc = site.start("held", "--fault=stop:after_claim@1")
    try:
        deadline = time.monotonic() + 30
        while not stopped(proc.pid):
            assert proc.exitcode is None and time.monotonic() < deadline, proc.output()
            time.sleep(0.01)
        # As if carrying the run on with other workers had taken longer than a worker's
        # deadline, as it did on a loaded CI machine.
        proc.started -= WORKER_DEADLINE + 1
        proc.wake()
        assert proc.finish() == 0, proc.output()
    finally:
        if proc.exitcode is None:
            proc.kill()
    assert not [e for e in read_history(site.history) if e.ev == "hang"]
    assert site.verdict().ok, site.verdict().explain()


def test_a_worker_whose_exit_status_was_lost_counts_as_killed_when_it_left_no_verdict(
    tmp_path: Path,
) -> None:
    """The fork server sometimes cannot tell a child's exit status (multiprocessing says
    255); a worker that killed itself at its fault left no verdict, and the run must go on
    with the next worker rather than end there, unfinished."""
    site = make_site(f"sqlite:///{tmp_path / 'adk.sqlite3'}", tmp_path, "sqlite")
    proc = site.start("lost", "--fault=kill:after_claim@1")
    assert proc.finish() == -signal.SIGKILL, proc.output()
    assert proc._recorded_code(_STATUS_LOST) == -signal.SIGKILL
    site.carry("lost", random.Random(0))
    assert site.verdict().ok, site.verdict().explain()


_HOLDER = """
import os, signal, sqlite3, sys
db = sqlite3.connect(sys.argv[1], isolation_level=None)
db.execute("BEGIN IMMEDIATE")
db.execute("CREATE TABLE IF NOT EXISTS held_open (x)")
os.kill(os.getpid(), signal.SIGSTOP)
db.execute("COMMIT")
"""


def test_a_stopped_process_holding_the_sqlite_write_lock_is_woken_so_the_run_goes_on(
    tmp_path: Path,
) -> None:
    """A worker SIGSTOPped while its SQLite thread was inside a write (a lease renewal)
    blocks every writer of the file until it wakes; the trial would wake it only once the
    run is carried, so the carry wakes it as soon as a worker finds the file locked."""
    path = tmp_path / "adk.sqlite3"
    site = make_site(f"sqlite:///{path}", tmp_path, "sqlite")
    holder = Proc.__new__(Proc)
    holder.site, holder.run, holder.label = site, "other", "other.w0"
    holder.out, holder.process, holder.started = tmp_path / "holder.out", None, time.monotonic()
    holder.popen = subprocess.Popen([sys.executable, "-c", _HOLDER, str(path)])
    site.procs[holder.pid] = holder
    try:
        deadline = time.monotonic() + 30
        while not stopped(holder.pid):
            assert holder.exitcode is None and time.monotonic() < deadline
            time.sleep(0.01)
        site.carry("blocked", random.Random(0))
        assert holder.wait(10) == 0
    finally:
        if holder.exitcode is None:
            holder.kill()
    events = read_history(site.history)
    assert [e["worker"] for e in events if e.ev == "woke_lock_holder"] == ["other.w0"]
    assert site.woken_early == {"other.w0"}
    results = [e for e in events if e.ev == "result" and e.run == "blocked"]
    assert results[0]["verdict"] == "unavailable" and "locked" in results[0]["error"], results
    assert results[-1]["verdict"] == "completed", results
    assert site.verdict().ok, site.verdict().explain()
