"""Drives real worker processes through faults and hands the history to the checker.

Workers are forked from a fork server that has the kit imported already, so a worker costs
a fork, not an interpreter start (each is still a separate OS process with its own
connections, killed with real signals). Every worker has a deadline: one still running at
it has its asyncio tasks (SIGUSR1) and threads (SIGUSR2, faulthandler) dumped, is killed,
and goes on the record as a hang, dump included.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from reliability import worker
from reliability.checker import Verdict, check
from reliability.history import Recorder, read_history

# Deadline of one worker process: a whole run takes well under a second.
WORKER_DEADLINE = float(os.environ.get("ADK_TORTURE_WORKER_DEADLINE", "60"))
# How many workers one run may take, and how long, before the suite calls it stuck.
MAX_WORKERS = 80
CARRY_DEADLINE = 240.0

_CTX = multiprocessing.get_context("forkserver")
_CTX.set_forkserver_preload(["reliability.worker"])


def stopped(pid: int) -> bool:
    """The process is in state T (stopped by a signal)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "T"
    except (FileNotFoundError, ProcessLookupError):
        # Gone before the open, or between the open and the read (ESRCH): not stopped.
        return False


_STATUS_LOST = 255


class Proc:
    """One worker process: a fork of the fork server, or (``env`` given) an interpreter of
    its own started with that environment, which is what ``LD_PRELOAD`` needs."""

    def __init__(
        self,
        site: Site,
        run: str,
        argv: Sequence[str],
        label: str,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.site = site
        self.run = run
        self.label = label
        self.out = site.tmp / f"{label}.out"
        self.process: Any = None
        self.popen: subprocess.Popen[bytes] | None = None
        if env is None:
            self.process = _CTX.Process(target=worker.child, args=(list(argv), str(self.out)))
            self.process.start()
        else:
            with open(self.out, "ab") as out:
                self.popen = subprocess.Popen(
                    [sys.executable, worker.__file__, *argv],
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env={**os.environ, **env},
                )
        self.started = time.monotonic()
        site.procs[self.pid] = self

    @property
    def pid(self) -> int:
        pid = self.popen.pid if self.popen is not None else self.process.pid
        assert pid is not None
        return int(pid)

    @property
    def exitcode(self) -> int | None:
        """The exit code (``-signal`` if a signal ended it), ``None`` while it runs."""
        if self.popen is not None:
            return self.popen.poll()
        code: int | None = self.process.exitcode
        return code

    def wait(self, timeout: float) -> int | None:
        """The exit code, or ``None`` if it still runs after ``timeout``."""
        if self.popen is not None:
            try:
                return self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                return None
        self.process.join(timeout)
        return self.exitcode

    def kill(self) -> None:
        # It may have ended, and been reaped, on its own just before.
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        self.wait(10)

    def wake(self) -> None:
        """SIGCONT a stopped worker; its deadline counts from now, not from its start,
        since the time it spent stopped (the run carried on by others) was the test's."""
        os.kill(self.pid, signal.SIGCONT)
        self.restart_clock()

    def restart_clock(self) -> None:
        """Count the deadline from now: the worker was held (stopped, or waiting on a
        release file) while the test did something else."""
        self.started = time.monotonic()

    def finish(self, deadline: float = WORKER_DEADLINE) -> int:
        """Its exit code; past the deadline, a hang on the record and ``-SIGKILL``."""
        left = max(0.0, self.started + deadline - time.monotonic())
        code = self.wait(left)
        if code == _STATUS_LOST:
            return self._recorded_code(code)
        if code is not None:
            return code
        for sig in (signal.SIGCONT, signal.SIGUSR1, signal.SIGUSR2):
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                break
            time.sleep(0.5)
        self.kill()
        self.site.hang(self.run, self.label, self.output())
        return -signal.SIGKILL

    def result(self) -> dict[str, Any] | None:
        """The verdict the worker put on the record as it ended (``None`` if it put none)."""
        results = [
            e
            for e in read_history(self.site.history, live=True)
            if e.ev == "result" and e.proc == self.label
        ]
        return results[-1].fields if results else None

    def _recorded_code(self, default: int) -> int:
        # multiprocessing reports 255 when it could not read a child's exit status from the
        # fork server (seen under load); the worker's own verdict is on the record.
        result = self.result()
        if result is not None:
            return int(result["code"])
        if "Traceback" in self.output():
            return default  # it crashed: an error on the record, which ends the trial
        # No verdict and no crash: it was killed before it finished (by its own fault, or
        # the harness), which is how the run is carried on; taken for an error, the run was
        # left unfinished after its first worker (seen under load).
        return -signal.SIGKILL

    def output(self) -> str:
        try:
            return self.out.read_text()[-20000:]
        except FileNotFoundError:
            return ""


@dataclass
class Stats:
    """What a batch of trials did, for the figures."""

    trials: int = 0
    kills: int = 0
    refusals: int = 0
    resolutions: int = 0
    workers: int = 0
    notes: dict[str, int] = field(default_factory=dict)


class Site:
    """One store URL, one history file, and the workers of every trial on them."""

    def __init__(
        self,
        store: str,
        tmp: Path,
        *,
        backend: str = "?",
        lease_ttl: float = 0.6,
        delay: float = 0.01,
        margin: float = 1.0,
    ) -> None:
        self.store = store
        self.backend = backend
        self.tmp = tmp
        self.history = tmp / "history.jsonl"
        self.lease_ttl = lease_ttl
        self.delay = delay
        # resolve --never-ran's margin past the run's last lease: above the lease ttl, which
        # bounds how long after its lease ended a worker of the suite can still dispatch.
        self.margin = margin
        self.recorder = Recorder(self.history, "harness")
        self.stats = Stats()
        # Every worker started, by pid; the labels of stopped ones woken early (below).
        self.procs: dict[int, Proc] = {}
        self.woken_early: set[str] = set()
        self._n = 0
        self._lock = threading.Lock()

    # --- processes ---------------------------------------------------------------------

    def _label(self, run: str) -> str:
        with self._lock:
            self._n += 1
            self.stats.workers += 1
            return f"{run}.w{self._n}"

    def start(
        self,
        run: str,
        *extra: str,
        label: str | None = None,
        store: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> Proc:
        """A worker on ``run``; ``store`` instead of the site's URL (through a proxy, say),
        ``env`` to start it as an interpreter of its own with that environment."""
        label = label or self._label(run)
        argv = [
            "--store",
            store or self.store,
            "--run",
            run,
            "--history",
            str(self.history),
            "--worker",
            label,
            "--lease-ttl",
            str(self.lease_ttl),
            "--claim-ttl",
            str(self.lease_ttl),
            "--delay",
            str(self.delay),
            *extra,
        ]
        return Proc(self, run, argv, label, env)

    def hang(self, run: str, label: str, detail: str) -> None:
        self.recorder.event("hang", run, worker=label, detail=detail)

    def count(self, what: str, n: int = 1) -> None:
        with self._lock:
            setattr(self.stats, what, getattr(self.stats, what) + n)

    def note(self, what: str) -> None:
        with self._lock:
            self.stats.notes[what] = self.stats.notes.get(what, 0) + 1

    # --- carrying a run to its end -----------------------------------------------------

    def carry(
        self,
        run: str,
        rng: random.Random,
        *,
        faults: Sequence[Sequence[str]] = (),
        first: Sequence[str] = (),
        kill_within: float | None = None,
        kills: int = 0,
        store: str | None = None,
        env_for: Callable[[int], Mapping[str, str] | None] | None = None,
    ) -> None:
        """Start, fault, resume, resolve ... until the run completes.

        ``faults[i]`` are the named faults of the i-th worker, ``first`` more arguments of
        the first; the first ``kills`` workers are also SIGKILLed at a random moment within
        ``kill_within`` seconds. ``store`` replaces the site's URL for these workers;
        ``env_for(i)``, if given, is the environment the i-th worker starts with (``None``:
        a fork, as usual).
        """
        deadline = time.monotonic() + CARRY_DEADLINE
        for n in range(MAX_WORKERS):
            if time.monotonic() > deadline:
                break
            extra = [f"--fault={f}" for f in (faults[n] if n < len(faults) else ())]
            if n == 0:
                extra += first
            env = env_for(n) if env_for is not None else None
            proc = self.start(run, *extra, store=store, env=env)
            cut = n < kills and kill_within is not None
            if cut and proc.wait(rng.uniform(0.0, kill_within or 0.0)) is None:
                proc.kill()
                self.count("kills")
                continue
            code = proc.finish()
            if code == -signal.SIGKILL:
                self.count("kills")
            if code == worker.EXIT_COMPLETED:
                return
            if code == worker.EXIT_REFUSED:
                self.count("refusals")
                self.resolve_from_the_world(run, proc.label)
            elif code == worker.EXIT_NOT_NOW:
                self.wake_lock_holders(proc)
            elif code not in (worker.EXIT_NOT_NOW, -signal.SIGKILL):
                return  # on the record as an error; the checker reports it
            time.sleep(0.05)
        self.recorder.event("gave_up", run, workers=MAX_WORKERS, seconds=CARRY_DEADLINE)

    def wake_lock_holders(self, proc: Proc) -> None:
        """``proc`` found the SQLite file locked: if a stopped worker holds a write lock on
        it (SIGSTOPped while its SQLite thread was inside a transaction: a lease renewal,
        say), no other process can write until it wakes, which the trial would only do
        once the run is carried, so wake it now. A paused SQLite writer blocks the file
        for as long as it is paused (README); that is SQLite's, not a fault of the kit's."""
        result = proc.result() or {}
        if result.get("verdict") != "unavailable" or "locked" not in str(result.get("error")):
            return
        holders = set()
        with contextlib.suppress(OSError), open("/proc/locks") as locks:
            for line in locks:
                fields = line.split()
                if "WRITE" in fields and len(fields) > 4 and fields[4].isdigit():
                    holders.add(int(fields[4]))
        for pid in holders:
            held = self.procs.get(pid)
            if held is not None and not stopped(pid):
                # On the record, for a failure's reading: a live writer that held on.
                self.recorder.event("lock_held", proc.run, worker=held.label, by=proc.label)
                self.note("found the file locked by a running worker")
            elif held is not None:
                self.recorder.event("woke_lock_holder", proc.run, worker=held.label)
                self.note("stopped workers woken early: they held SQLite's write lock")
                self.woken_early.add(held.label)
                held.wake()

    def resolve_from_the_world(self, run: str, label: str) -> None:
        """What an on-call engineer does when worker ``label`` was refused: look each call
        in doubt up in the outside world (the effects on the record) and record what was
        found; told to retry later (exit 3: someone holds the run, or ``--never-ran`` is
        inside its margin past the run's last lease), wait, look again, and retry."""
        events = read_history(self.history, live=True)
        refusal = [e for e in events if e.proc == label and e.ev == "result"][-1]
        assert refusal["verdict"] == "refused", refusal
        for key in refusal["keys"]:
            # Past this, leave it to the next worker: on SQLite a lease ended by a process
            # whose clock is ahead ends, by the operator's clock, in the future.
            deadline = time.monotonic() + max(5.0, 3 * self.margin)
            while time.monotonic() < deadline:
                # Looked up afresh each time: a slow worker may have made the call since.
                world = read_history(self.history, live=True)
                effects = {e["key"]: e for e in world if e.run == run and e.ev == "effect"}
                what = ["--margin", str(self.margin)]
                if key in effects:
                    what = ["--outcome", json.dumps({"booked": effects[key]["item"]})]
                code = self.start(run, "--resolve", key, *what).finish()
                if code != worker.EXIT_NOT_NOW:
                    break
                self.note("resolve told to retry later")
                time.sleep(0.2)
            self.count("resolutions")

    # --- verdict -----------------------------------------------------------------------

    def verdict(self) -> Verdict:
        return check(read_history(self.history), expected_items=worker.ITEMS)


def in_parallel(jobs: Iterable[Callable[[], Any]], width: int = 3) -> None:
    """Run trials side by side (each its own run); the first failure is raised."""
    with ThreadPoolExecutor(max_workers=width) as pool:
        for future in [pool.submit(job) for job in jobs]:
            future.result()
