"""``tesserix demo``: a run dies with SIGKILL and carries on with exactly one booking.

Real OS processes against a temporary SQLite store and a SQLite "airline". Act one kills the
worker right after the seat was booked and before the next checkpoint: the resume replays
the recorded outcome. Act two kills it while ``book_seat`` is in flight: the resume refuses
(exit 4) naming the call, the operator checks the airline and records what it found with
``tesserix resolve``, and the run finishes. Offline and deterministic.
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tesserix_adk.cli.demo_agent import AIRLINE_ENV, airline_bookings, create_airline

__all__ = ["run_demo"]

TENANT = "demo"
AGENT = "tesserix_adk.cli.demo_agent:agent"


class _Demo:
    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.store = f"sqlite:///{workdir / 'adk.sqlite3'}"
        self.airline = str(workdir / "airline.sqlite3")
        self.env = {**os.environ, AIRLINE_ENV: self.airline, "ADK_STORE": self.store}
        self.env.pop("ADK_DEMO_PAUSE", None)

    def say(self, text: str = "") -> None:
        sys.stdout.write(text + "\n")
        sys.stdout.flush()

    def tesserix(self, *args: str) -> subprocess.CompletedProcess[str]:
        """Run the real console entry point in its own process and show what it printed."""
        self.say("  $ tesserix " + " ".join(_quote(a) for a in args))
        done = subprocess.run(
            [sys.executable, "-m", "tesserix_adk", *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        for line in (done.stdout + done.stderr).splitlines():
            self.say("    " + line)
        self.say(f"    (exit {done.returncode})")
        return done

    def kill_worker_at(self, run_id: str, pause: str) -> None:
        """Start a worker, let it reach ``pause``, then SIGKILL it."""
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tesserix_adk.cli.worker",
                "--store",
                self.store,
                "--run",
                run_id,
                "--tenant",
                TENANT,
                "--pause",
                pause,
                "--lease-ttl",
                str(_LEASE_TTL_S),
            ],
            env=self.env,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout is not None
        line = proc.stdout.readline().strip()
        if line != f"PAUSED {pause}":
            proc.kill()
            raise RuntimeError(f"the worker did not reach {pause!r}: {line!r}")
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        self.say(f"  worker pid {proc.pid} killed with SIGKILL ({_PAUSES[pause]})")

    def wait_for_lease_to_lapse(self, run_id: str) -> None:
        """The dead worker's lease must lapse by the store's clock before a takeover."""
        from tesserix_adk.stores.urls import open_stores

        async def lapsed() -> bool:
            async with open_stores(self.store) as stores:
                return await stores.leases.current(TENANT, run_id) is None

        deadline = time.monotonic() + 10
        while not asyncio.run(lapsed()):
            if time.monotonic() > deadline:
                raise RuntimeError("the dead worker's lease did not lapse")
            time.sleep(0.1)
        self.say(f"  the dead worker's {_LEASE_TTL_S} s lease has lapsed by the store's clock")

    def count(self, run_id: str) -> int:
        n = len(airline_bookings(self.airline, run_id))
        self.say(f"airline holds {n} booking(s) for {run_id}")
        return n


# Short, so the takeover comes soon after the kill, but not 1 s: a worker starved of CPU
# that long (a loaded CI machine) rightly loses its lease before reaching its pause.
_LEASE_TTL_S = 3

_BOOKINGS = "SELECT id, run_id, flight, passenger FROM bookings"

_PAUSES = {
    "booked": "seat booked and recorded, next checkpoint not yet written",
    "in_flight": "inside book_seat: the airline booked it, the kit has no outcome",
}


def run_demo(*, keep: str | None = None) -> int:
    """Run both acts; 0 only if each ends with exactly one booking.

    ``keep``: a directory to leave the store and the airline in (``""``: the temporary
    one), with the commands to explore them printed at the end; ``None`` removes them."""
    if keep:
        refused = f"tesserix demo: {keep!r} is not a new or empty directory"
        try:
            workdir = Path(keep).expanduser().resolve()
            if workdir.exists() and (not workdir.is_dir() or any(workdir.iterdir())):
                sys.stderr.write(f"{refused}; pass one for the demo's store and airline\n")
                return 2
            workdir.mkdir(parents=True, exist_ok=True)
        except (OSError, RuntimeError) as exc:  # under a file, unwritable, a symlink loop
            sys.stderr.write(f"{refused} it can make ({getattr(exc, 'strerror', None) or exc})\n")
            return 2
    else:
        workdir = Path(tempfile.mkdtemp(prefix="tesserix-demo-"))
    demo = _Demo(workdir)
    started = time.monotonic()
    try:
        create_airline(demo.airline)
        demo.say("tesserix demo: a booking agent whose worker dies mid-run, twice.")
        demo.say(f"store {demo.store}; airline {demo.airline}")
        demo.say()
        demo.tesserix("schema", "apply")
        ones = [_act_one(demo), _act_two(demo)]
    except Exception as exc:
        sys.stderr.write(f"tesserix demo: {exc}\n")
        return 1
    finally:
        if keep is None:
            shutil.rmtree(workdir, ignore_errors=True)
    demo.say()
    if ones == [1, 1]:
        demo.say(
            f"Both runs carried on after SIGKILL with exactly one booking each "
            f"({time.monotonic() - started:.1f} s)."
        )
        if keep is not None:
            _explore(demo)
        return 0
    demo.say("Something is wrong: a run did not end with exactly one booking.")
    return 1


def _explore(demo: _Demo) -> None:
    """The commands that look at what the demo left behind (each exits 0)."""
    store = _quote(demo.store)
    demo.say()
    demo.say(f"The store and the airline are kept in {demo.workdir}. Explore them:")
    if sys.prefix != sys.base_prefix and os.environ.get("VIRTUAL_ENV") != sys.prefix:
        # Started as .venv/bin/tesserix (make demo): put the kit's commands on PATH first.
        demo.say(f"  . {_quote(str(Path(sys.prefix) / 'bin' / 'activate'))}")
    for command in (
        "runs --tenant demo",
        "show run-1 --tenant demo",
        "inspect run-2 --tenant demo",
        "steps run-2 --tenant demo",
        f"run --resume run-1 --tenant demo --agent {AGENT}",
    ):
        demo.say(f"  tesserix {command} --store {store}")
    look = (
        f'import sqlite3; print(*sqlite3.connect("{demo.airline}").execute("{_BOOKINGS}"), '
        'sep="\\n")'
    )
    demo.say(f"  python -c {shlex.quote(look)}")
    demo.say("(the last `run --resume` does nothing: the run already completed)")


def _act_one(demo: _Demo) -> int:
    run_id = "run-1"
    demo.say()
    demo.say("Act one: the worker dies right after book_seat returned, before its checkpoint.")
    demo.kill_worker_at(run_id, "booked")
    demo.say(f"  the airline already holds {len(airline_bookings(demo.airline, run_id))} booking")
    demo.say("  what the kit knows, without taking the run:")
    demo.tesserix("inspect", run_id, "--tenant", TENANT)
    demo.wait_for_lease_to_lapse(run_id)
    demo.say("  a new process carries the run on: book_seat's outcome is on record, so it is")
    demo.say("  replayed into the conversation instead of booking a second seat:")
    done = demo.tesserix("run", "--resume", run_id, "--tenant", TENANT, "--agent", AGENT)
    if done.returncode != 0:
        raise RuntimeError(f"resuming {run_id} exited {done.returncode}")
    return demo.count(run_id)


def _act_two(demo: _Demo) -> int:
    run_id = "run-2"
    demo.say()
    demo.say("Act two: the worker dies inside book_seat, after the airline booked the seat.")
    demo.kill_worker_at(run_id, "in_flight")
    demo.wait_for_lease_to_lapse(run_id)
    demo.say("  the kit cannot know whether the call ran, so it refuses to guess (exit 4):")
    refused = demo.tesserix("run", "--resume", run_id, "--tenant", TENANT, "--agent", AGENT)
    if refused.returncode != 4:
        raise RuntimeError(f"expected exit 4 for {run_id}, got {refused.returncode}")
    found = airline_bookings(demo.airline, run_id)
    if len(found) != 1:
        raise RuntimeError(f"expected the airline to hold one booking, found {len(found)}")
    booking_id, flight, passenger, key = found[0]
    demo.say(f"  the operator checks the airline by the idempotency key {key[:14]}…:")
    demo.say(f"  booking BK-{booking_id} exists ({flight}, {passenger}); they record that:")
    outcome = json.dumps(
        {"booking_id": f"BK-{booking_id}", "flight": flight, "passenger": passenger}
    )
    resolved = demo.tesserix(
        "resolve",
        run_id,
        "--tenant",
        TENANT,
        "--call",
        "call_1_0",
        "--outcome",
        outcome,
        "--by",
        "on-call",
    )
    if resolved.returncode != 0:
        raise RuntimeError(f"resolve exited {resolved.returncode}")
    demo.say("  now the run carries on with the recorded outcome:")
    done = demo.tesserix("run", "--resume", run_id, "--tenant", TENANT, "--agent", AGENT)
    if done.returncode != 0:
        raise RuntimeError(f"resuming {run_id} exited {done.returncode}")
    return demo.count(run_id)


def _quote(arg: str) -> str:
    return arg if arg and all(c.isalnum() or c in "-_:./=" for c in arg) else f"'{arg}'"
