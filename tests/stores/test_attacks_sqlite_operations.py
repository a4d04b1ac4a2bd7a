"""Attacks on the embedded SQLite store as operators really run it: real ``tesserix``
processes (workers, operator commands, the console) on one file, odd paths and URL forms,
a read-only or full filesystem, and the -wal/-shm files damaged under a live worker.

The agent is ``tests/chaos_agent.py``: each run books two seats, each booking a row of an
"airline" file carrying the call's idempotency key, so one booking per key is checked.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

import chaos_agent
from tesserix_adk import AgentRunner
from tesserix_adk.stores.urls import open_stores

TESTS = Path(__file__).resolve().parent.parent
T = "acme"
TRACEBACK = "Traceback (most recent call last)"


class Site:
    """One SQLite store file and one airline file, the env every process of a test uses."""

    def __init__(self, db: Path, airline: Path, store: str | None = None) -> None:
        self.db = db
        self.store = store or f"sqlite:///{db}"
        self.airline = str(airline)
        chaos_agent.create_airline(self.airline)
        self.env = {
            **os.environ,
            "ADK_STORE": self.store,
            chaos_agent.AIRLINE_ENV: self.airline,
            "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
            "CHAOS_SLOW": "0.005",
        }
        self.env.pop("ADK_DEBUG", None)

    def apply_and_submit(self, runs: int, prefix: str = "run") -> list[str]:
        async def go() -> list[str]:
            async with open_stores(self.store) as stores:
                await stores.create_schema()
                runner = AgentRunner.from_stores(chaos_agent.ChaosModel(), stores)
                return [
                    await runner.submit(
                        chaos_agent.agent, "book", tenant=T, run_id=f"{prefix}-{n:03d}"
                    )
                    for n in range(runs)
                ]

        return asyncio.run(go())

    def tesserix(self, *args: str, store: str | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "tesserix_adk", "--store", store or self.store, *args],
            env=self.env,
            cwd=TESTS,
            capture_output=True,
            text=True,
            timeout=120,
        )

    def worker(self, *extra: str, store: str | None = None) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tesserix_adk",
                "--store",
                store or self.store,
                "worker",
                "--agent",
                "chaos_agent:agent",
                "--exit-when-idle",
                "--lease-ttl",
                "1",
                "--poll",
                "0.02",
                "--concurrency",
                "4",
                *extra,
            ],
            env=self.env,
            cwd=TESTS,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )

    def bookings(self) -> Counter[str]:
        return Counter(key for key, _, _ in chaos_agent.effects(self.airline))

    def statuses(self) -> Counter[str]:
        done = self.tesserix("runs", "--tenant", T, "--no-header")
        assert done.returncode == 0, done.stderr
        return Counter(line.split("  ")[2] for line in done.stdout.splitlines() if "  " in line)


def _finish(proc: subprocess.Popen[str], timeout: float = 120) -> str:
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        raise AssertionError(f"the worker did not finish: {err[-2000:]}") from None
    return err


def _one_sentence(err: str) -> bool:
    return TRACEBACK not in err and len(err.strip().splitlines()) == 1


def _once_each(site: Site, runs: int) -> None:
    booked = site.bookings()
    assert not [key for key, n in booked.items() if n > 1], "a booking was made twice"
    assert len(booked) == 2 * runs


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A tmpfs of 3 MiB of the test's own (root only: skipped where mount is refused)."""
    mount = tmp_path / "fs"
    mount.mkdir()
    made = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
    )
    if made.returncode != 0:
        pytest.skip(f"cannot mount a small filesystem here: {made.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def _remount(mount: Path, options: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{options}", str(mount)], check=True)


# --- operators while workers write hard ----------------------------------------------------


def test_operators_a_console_and_schema_apply_beside_two_busy_workers_book_each_call_once(
    tmp_path: Path,
) -> None:
    site = Site(tmp_path / "adk.sqlite3", tmp_path / "airline.sqlite3")
    runs = 60
    site.apply_and_submit(runs)
    canceled = "run-059"
    ui = subprocess.Popen(
        [sys.executable, "-m", "tesserix_adk", "ui", "--store", site.store, "--port", "0"],
        env=site.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    workers = [site.worker(), site.worker()]
    commands = [
        ("runs", "--tenant", T),
        ("runs", "--tenant", T, "--stuck"),
        ("runs", "--tenant", T, "--json"),
        ("show", "run-001", "--tenant", T),
        ("inspect", "run-002", "--tenant", T),
        ("steps", "run-003", "--tenant", T),
        ("cancel", canceled, "--tenant", T, "--by", "op"),
        ("approve", "no-such-request", "--tenant", T, "--by", "op"),
        ("schema", "apply"),
    ]
    wrong: list[tuple[tuple[str, ...], int, str]] = []
    pages: list[int] = []

    def operator(start: int) -> None:
        n = start
        while any(w.poll() is None for w in workers):
            command = commands[n % len(commands)]
            n += 1
            done = site.tesserix(*command)
            # 3 (retry later) is allowed while the file is busy; anything else is not.
            allowed = {0, 1, 3} if command[0] == "approve" else {0, 3}
            if done.returncode not in allowed or (done.stderr and not _one_sentence(done.stderr)):
                wrong.append((command, done.returncode, done.stderr[-500:]))

    def console() -> None:
        assert ui.stdout is not None
        found = re.search(r"http://127\.0\.0\.1:([0-9]+)/", ui.stdout.readline())
        assert found is not None
        url = f"http://127.0.0.1:{found.group(1)}/t/{T}/runs"
        while any(w.poll() is None for w in workers):
            try:
                pages.append(httpx.get(url, timeout=10).status_code)
            except httpx.TransportError:
                time.sleep(0.05)

    threads = [threading.Thread(target=operator, args=(k,)) for k in range(2)]
    threads.append(threading.Thread(target=console))
    try:
        for thread in threads:
            thread.start()
        errors = [_finish(w) for w in workers]
        for thread in threads:
            thread.join(60)
    finally:
        ui.send_signal(signal.SIGINT)
        try:
            ui.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            ui.kill()
            ui.communicate()
    assert [w.returncode for w in workers] == [0, 0], errors
    assert not [e for e in errors if TRACEBACK in e], errors
    assert wrong == []
    assert pages and set(pages) == {200}
    booked = site.bookings()
    assert not [key for key, n in booked.items() if n > 1], "a booking was made twice"
    statuses = site.statuses()
    assert sum(statuses.values()) == runs
    assert statuses["completed at step 5"] >= runs - 1, statuses
    assert site.tesserix("runs", "--tenant", T, "--stuck").stdout.strip() == "no runs"


# --- paths and URL forms ---------------------------------------------------------------------


def test_one_file_named_through_spaces_unicode_a_symlink_and_four_url_forms_is_one_store(
    tmp_path: Path,
) -> None:
    home = tmp_path / f"dir with space {uuid.uuid4().hex[:6]}" / "ünïcødé café"
    home.mkdir(parents=True)
    (tmp_path / "link").symlink_to(home)
    db = home / "adk store.sqlite3"
    site = Site(db, tmp_path / "airline.sqlite3", store=f"sqlite:///{db}")
    site.apply_and_submit(4, prefix="a")
    through_link = f"sqlite:////{tmp_path.as_posix().lstrip('/')}/link/adk%20store.sqlite3"
    relative = "sqlite:///link/adk store.sqlite3?synchronous=normal"
    site.env["ADK_STORE"] = through_link
    done = site.tesserix(
        "submit", "--agent", "chaos_agent:agent", "--tenant", T, "--input", "book",
        "--run-id", "b-000", store=through_link,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    # Two workers on two spellings at once, one of them relative to its own directory.
    relative_worker = subprocess.Popen(
        [
            sys.executable, "-m", "tesserix_adk", "--store", relative, "worker",
            "--agent", "chaos_agent:agent", "--exit-when-idle", "--lease-ttl", "1",
            "--poll", "0.02",
        ],
        env={**site.env, "PYTHONPATH": site.env["PYTHONPATH"]},
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    absolute_worker = site.worker(store=f"sqlite:///{db}")
    for w in (relative_worker, absolute_worker):
        err = _finish(w)
        assert w.returncode == 0, err
    _once_each(site, 5)
    listed = site.tesserix("runs", "--tenant", T, "--no-header", store=through_link)
    assert listed.returncode == 0, listed.stderr
    assert len(listed.stdout.splitlines()) == 5
    assert all("completed at step 5" in line for line in listed.stdout.splitlines())
    # No second file appeared beside the link or under an undecoded twin name.
    assert {p.name for p in tmp_path.iterdir() if not p.name.startswith("airline")} == {
        home.parent.name,
        "link",
    }
    assert {p.name.split("-")[0] for p in home.iterdir()} == {"adk store.sqlite3"}


# --- a read-only filesystem -----------------------------------------------------------------


def _store_on_read_only_fs(small_fs: Path, tmp_path: Path) -> Site:
    site = Site(small_fs / "adk.sqlite3", tmp_path / "airline.sqlite3")
    site.apply_and_submit(2)
    worker = site.worker()
    err = _finish(worker)
    assert worker.returncode == 0, err
    site.apply_and_submit(1, prefix="waiting")  # one run submitted, not started
    _remount(small_fs, "ro")
    return site


def test_a_store_on_a_read_only_filesystem_can_be_inspected(small_fs: Path, tmp_path: Path) -> None:
    site = _store_on_read_only_fs(small_fs, tmp_path)
    for command in (
        ("inspect", "run-000", "--tenant", T),
        ("show", "run-001", "--tenant", T),
        ("runs", "--tenant", T),
    ):
        done = site.tesserix(*command)
        assert done.returncode == 0, (command, done.stderr)
        assert "completed at step 5" in done.stdout


def test_a_write_on_a_read_only_filesystem_says_read_only_and_records_nothing(
    small_fs: Path, tmp_path: Path
) -> None:
    site = _store_on_read_only_fs(small_fs, tmp_path)
    before = site.bookings()
    for command in (
        ("submit", "--agent", "chaos_agent:agent", "--tenant", T, "--input", "x"),
        ("cancel", "waiting-000", "--tenant", T, "--by", "op"),
        ("schema", "apply"),
    ):
        done = site.tesserix(*command)
        assert done.returncode != 0 and _one_sentence(done.stderr), (command, done.stderr)
        assert "read-only" in done.stderr, (command, done.stderr)
        assert "create it" not in done.stderr, (command, done.stderr)
    worker = site.worker()
    err = _finish(worker, 60)
    assert worker.returncode != 0 and "read-only" in err.splitlines()[-1], err
    assert site.bookings() == before


def test_a_store_on_a_read_only_filesystem_loses_nothing_and_carries_on_once_writable(
    small_fs: Path, tmp_path: Path
) -> None:
    site = _store_on_read_only_fs(small_fs, tmp_path)
    done = site.tesserix("cancel", "waiting-000", "--tenant", T, "--by", "op")
    assert done.returncode != 0 and _one_sentence(done.stderr), done.stderr
    # Read-only, the store is still listed (it failed as "does not exist" before).
    assert site.tesserix("runs", "--tenant", T).returncode == 0
    worker = site.worker()
    err = _finish(worker, 60)
    assert worker.returncode in (1, 2, 3) and TRACEBACK not in err, err
    _remount(small_fs, "rw")
    worker = site.worker()
    err = _finish(worker)
    assert worker.returncode == 0, err
    _once_each(site, 3)
    assert site.statuses() == Counter({"completed at step 5": 3})


# --- the disk fills up ------------------------------------------------------------------------


@pytest.mark.slow  # 12 s: in the ADK_SLOW=1 run (README, Testing)
def test_a_disk_filling_under_a_worker_is_retried_and_carried_on_once_room_is_made(
    small_fs: Path, tmp_path: Path
) -> None:
    site = Site(small_fs / "adk.sqlite3", tmp_path / "airline.sqlite3")
    runs = 40
    site.apply_and_submit(runs)
    worker = site.worker()
    deadline = time.monotonic() + 60
    while shutil.disk_usage(small_fs).free > 0 and worker.poll() is None:
        assert time.monotonic() < deadline, "the disk never filled"
        time.sleep(0.1)
    assert worker.poll() is None, "the worker ended before the disk was full"
    time.sleep(1.0)  # a few retries against a full disk
    # An operator meanwhile: a typed answer (retry later), one sentence, never a traceback.
    for command in (
        ("runs", "--tenant", T, "--stuck"),
        ("cancel", "run-039", "--tenant", T, "--by", "op"),
    ):
        done = site.tesserix(*command)
        assert done.returncode in (0, 3), done.stderr
        assert not done.stderr or _one_sentence(done.stderr), done.stderr
    worker.send_signal(signal.SIGTERM)
    err = _finish(worker, 60)
    assert TRACEBACK not in err, err
    _remount(small_fs, "size=64m")
    worker = site.worker()
    err = _finish(worker)
    assert worker.returncode == 0, err
    booked = site.bookings()
    assert not [key for key, n in booked.items() if n > 1], "a booking was made twice"
    statuses = site.statuses()
    assert sum(statuses.values()) == runs, statuses
    assert set(statuses) <= {"completed at step 5", "cancelled at step 1", "cancelled at step 3"}


# --- the -wal and -shm files under a live worker ---------------------------------------------


@pytest.mark.parametrize(
    "damage",
    [
        "delete-wal",
        "delete-wal-and-shm",
        # 12 s (the worker dies of SIGBUS, the next one carries 40 runs): ADK_SLOW=1.
        pytest.param("truncate-shm", marks=pytest.mark.slow),
    ],
)
def test_wal_or_shm_damaged_under_a_live_worker_sends_no_call_twice(
    tmp_path: Path, damage: str
) -> None:
    site = Site(tmp_path / "adk.sqlite3", tmp_path / "airline.sqlite3")
    runs = 40
    site.apply_and_submit(runs)
    wal, shm = Path(f"{site.db}-wal"), Path(f"{site.db}-shm")
    worker = site.worker()
    deadline = time.monotonic() + 60
    while len(chaos_agent.effects(site.airline)) < 10:
        assert worker.poll() is None and time.monotonic() < deadline, "the worker made no calls"
        time.sleep(0.05)
    if damage == "truncate-shm":
        os.truncate(shm, 0)  # the live worker's mapping: it dies of SIGBUS
    else:
        wal.unlink()
        if damage == "delete-wal-and-shm":
            shm.unlink()
    done = site.tesserix("runs", "--tenant", T, "--stuck")
    assert done.returncode in (0, 3), done.stderr
    assert not done.stderr or _one_sentence(done.stderr), done.stderr
    _finish(worker)
    # Whatever became of the first worker, the next one finishes every run, once.
    again = site.worker()
    err = _finish(again)
    assert again.returncode == 0, err
    _once_each(site, runs)
    assert site.statuses() == Counter({"completed at step 5": runs})


# --- a naive backup ---------------------------------------------------------------------------


def test_a_main_file_copied_without_its_wal_is_an_earlier_store_that_resends_under_the_same_keys(
    tmp_path: Path,
) -> None:
    """``cp adk.sqlite3`` under a live worker copies an earlier, consistent state (what the
    -wal held is not in it). A worker on the copy starts again what it does not know was done:
    the outside system sees the same idempotency keys again (never a new key for a call), so
    one that deduplicates by key books each seat once."""
    site = Site(tmp_path / "adk.sqlite3", tmp_path / "airline.sqlite3")
    runs = 30
    site.apply_and_submit(runs)
    worker = site.worker()
    deadline = time.monotonic() + 60
    while len(chaos_agent.effects(site.airline)) < 10:
        assert worker.poll() is None and time.monotonic() < deadline, "the worker made no calls"
        time.sleep(0.05)
    copy = tmp_path / "copy.sqlite3"
    shutil.copyfile(site.db, copy)
    assert _finish(worker) is not None and worker.returncode == 0
    keys = set(site.bookings())
    assert len(keys) == 2 * runs
    listed = site.tesserix("runs", "--tenant", T, store=f"sqlite:///{copy}")
    assert listed.returncode == 0 and not listed.stderr, listed.stderr
    again = site.worker(store=f"sqlite:///{copy}")
    err = _finish(again)
    assert again.returncode == 0, err
    assert set(site.bookings()) == keys  # no new key: every call re-sent is an old one


# --- messages -----------------------------------------------------------------------------------


def test_a_damaged_store_file_is_told_in_one_plain_sentence(tmp_path: Path) -> None:
    site = Site(tmp_path / "adk.sqlite3", tmp_path / "airline.sqlite3")
    site.apply_and_submit(30)
    size = site.db.stat().st_size
    with site.db.open("r+b") as f:  # the header page stays; the rest is noise
        f.seek(4096)
        f.write(b"\xa5" * (size - 4096))
    done = site.tesserix("runs", "--tenant", T)
    assert done.returncode == 4, done.stderr
    assert _one_sentence(done.stderr), done.stderr
    assert done.stderr.count("restore it from a backup") == 1, done.stderr
