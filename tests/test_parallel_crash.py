"""A process carrying a parallel turn is killed with SIGKILL mid-turn, on every durable
backend; a new process resumes it and handles each call on its own.

The trip agent (``tests/parallel_agent.py``) asks for four side-effecting calls at once and
holds chosen calls at chosen points, so the kill leaves a known mix: completed (outcome
recorded), in flight (claimed, effect made or not), never started. After the resume:
each completed call's outcome is replayed (still one effect), each never-started call is sent
once, each in-flight call is refused naming it (``IndeterminateToolCallError``) until an
operator or its reconciler says what happened, and the model gets the four results in the
order it asked for them. The resume runs four at a time whatever the dead process ran:
``parallel_tool_calls`` is not part of the revision.
"""

from __future__ import annotations

import asyncio
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from parallel_agent import AIRLINE_ENV, CALL_IDS, PLAN_ENV, TENANT, TOOLS, create_airline, effects
from processes import BACKENDS, held_open, store_url
from tesserix_adk.stores.urls import open_stores

pytestmark = pytest.mark.skipif(os.name != "posix", reason="needs POSIX signals")

AGENT_SCRIPT = str(Path(__file__).resolve().parent / "parallel_agent.py")
BOOK, CHARGE, HOTEL, EMAIL = TOOLS


class Trip:
    """A store URL (schema applied) and an airline shared by every process of one test."""

    def __init__(self, tmp: Path, store: str) -> None:
        self.store = store
        self.airline = str(tmp / "airline.sqlite3")
        create_airline(self.airline)
        self.env = {**os.environ, AIRLINE_ENV: self.airline}
        self.env.pop(PLAN_ENV, None)
        asyncio.run(self._apply_schema())

    async def _apply_schema(self) -> None:
        async with open_stores(self.store) as stores:
            await stores.create_schema()

    def _start(
        self, command: str, run_id: str, parallel: int, plan: dict[str, str], reconcile: bool
    ) -> subprocess.Popen[str]:
        env = {**self.env, PLAN_ENV: json.dumps(plan)} if plan else self.env
        argv = [sys.executable, AGENT_SCRIPT, command, run_id, "--store", self.store]
        argv += ["--parallel", str(parallel)] + (["--reconcile"] if reconcile else [])
        # One pipe for both, so a log line on stderr can never fill a pipe nobody reads.
        return subprocess.Popen(
            argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )

    def kill_when(
        self, run_id: str, *, parallel: int, plan: dict[str, str], reached: set[str]
    ) -> None:
        """Run the turn until every line of ``reached`` is printed (each held call at its
        point: nothing moves after that), SIGKILL the process, wait out its lease."""
        proc = self._start("run", run_id, parallel, plan, reconcile=False)
        lines: queue.Queue[str] = queue.Queue()
        assert proc.stdout is not None
        out = proc.stdout

        def read() -> None:
            for line in out:
                lines.put(line.strip())

        reader = threading.Thread(target=read)
        reader.start()
        seen: list[str] = []
        deadline = time.monotonic() + 60
        while not reached <= set(seen):
            try:
                seen.append(lines.get(timeout=max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                seen.append("(nothing more)")
                break
            if seen[-1].startswith(("RESULT", "ERROR", "Traceback")):
                break
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        reader.join(timeout=10)
        out.close()
        assert reached <= set(seen), f"the turn never reached {reached}: {seen}"
        assert proc.returncode == -signal.SIGKILL
        self._wait_lease_lapsed(run_id)

    def _wait_lease_lapsed(self, run_id: str) -> None:
        async def current() -> Any:
            async with open_stores(self.store) as stores:
                return await stores.leases.current(TENANT, run_id)

        deadline = time.monotonic() + 15
        while asyncio.run(current()) is not None:
            assert time.monotonic() < deadline, "the dead process's lease never lapsed"
            time.sleep(0.05)

    def resume(self, run_id: str, *, reconcile: bool = False) -> tuple[int, str]:
        proc = self._start("resume", run_id, 4, {}, reconcile)
        out, _ = proc.communicate(timeout=120)
        return proc.returncode, out

    def resolve(self, run_id: str, call_id: str, *how: str) -> None:
        """`tesserix resolve`; the dead process was SIGKILLed, so nothing it sent lands
        late and the never-ran margin can be short."""
        done = subprocess.run(
            [
                *(sys.executable, "-m", "tesserix_adk", "resolve", run_id, "--tenant", TENANT),
                *("--call", call_id, *how, "--by", "ops", "--margin", "0.2"),
                *("--store", self.store),
            ],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stdout + done.stderr

    def effects(self, run_id: str) -> Counter[str]:
        found = effects(self.airline, run_id)
        assert len({key for _, key in found}) == len(found), "two effects under one key"
        return Counter(t for t, _ in found)


@pytest.fixture(params=BACKENDS)
def trip(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Trip]:
    with held_open(store_url(request.param, tmp_path)) as url:
        yield Trip(tmp_path, url)


def _told(out: str) -> list[list[Any]]:
    """What the model was told, as its final answer repeats it: [call id, is_error, content]."""
    line = next(x for x in out.splitlines() if x.startswith("RESULT "))
    status, _, output = line.removeprefix("RESULT ").partition(" ")
    assert status == "completed", out
    told: list[list[Any]] = json.loads(output)
    return told


def _in_model_order(told: list[list[Any]]) -> None:
    assert [t[0] for t in told] == list(CALL_IDS)
    assert [t[2]["done"] for t in told] == list(TOOLS)
    assert not any(t[1] for t in told)


ONE_EACH = Counter({BOOK: 1, CHARGE: 1, HOTEL: 1, EMAIL: 1})


def test_four_calls_completed_before_the_frontier_are_all_replayed(trip: Trip) -> None:
    plan = dict.fromkeys(TOOLS, "hold_done")
    trip.kill_when("all", parallel=4, plan=plan, reached={f"AT {t} hold_done" for t in TOOLS})
    assert trip.effects("all") == ONE_EACH
    code, out = trip.resume("all")
    assert code == 0, out
    _in_model_order(_told(out))
    assert trip.effects("all") == ONE_EACH


def test_completed_calls_are_replayed_and_never_started_ones_sent_once(trip: Trip) -> None:
    plan = {BOOK: "hold_done", CHARGE: "hold_done"}
    reached = {f"AT {BOOK} hold_done", f"AT {CHARGE} hold_done"}
    trip.kill_when("half", parallel=2, plan=plan, reached=reached)
    assert trip.effects("half") == Counter({BOOK: 1, CHARGE: 1})
    code, out = trip.resume("half")
    assert code == 0, out
    _in_model_order(_told(out))
    assert trip.effects("half") == ONE_EACH


def _three_way_mix(trip: Trip, run_id: str) -> None:
    """book_seat completed, charge_card in flight after its effect, reserve_hotel in flight
    before it, send_email never started (three slots, all held)."""
    plan = {BOOK: "hold_done", CHARGE: "hang_after", HOTEL: "hang_before"}
    reached = {f"AT {BOOK} hold_done", f"AT {CHARGE} hang_after", f"AT {HOTEL} hang_before"}
    trip.kill_when(run_id, parallel=3, plan=plan, reached=reached)
    assert trip.effects(run_id) == Counter({BOOK: 1, CHARGE: 1})


def test_calls_in_flight_are_refused_naming_each_until_an_operator_settles_them(
    trip: Trip,
) -> None:
    _three_way_mix(trip, "mix")
    code, out = trip.resume("mix")
    assert code == 4, out
    error = next(x for x in out.splitlines() if x.startswith("ERROR "))
    assert error.startswith("ERROR IndeterminateToolCallError")
    assert CHARGE in error and HOTEL in error
    assert BOOK not in error and EMAIL not in error
    assert trip.effects("mix") == Counter({BOOK: 1, CHARGE: 1})  # nothing sent, nothing replayed

    # The operator finds the charge in the card system and no hotel reservation.
    found = {"done": CHARGE, "item": f"{CHARGE}-1", "by": "ops"}
    trip.resolve("mix", "call_b", "--outcome", json.dumps(found))
    trip.resolve("mix", "call_c", "--never-ran")
    code, out = trip.resume("mix")
    assert code == 0, out
    told = _told(out)
    _in_model_order(told)
    assert told[1][2] == found  # the operator's word, not a second charge
    assert trip.effects("mix") == ONE_EACH


def test_calls_in_flight_are_settled_by_their_reconcilers(trip: Trip) -> None:
    _three_way_mix(trip, "rec")
    code, out = trip.resume("rec", reconcile=True)
    assert code == 0, out
    told = _told(out)
    _in_model_order(told)
    assert told[1][2].get("by") == "rec"  # found by its key, not sent again
    assert "by" not in told[2][2]  # found never to have run: sent now, once
    assert trip.effects("rec") == ONE_EACH


def test_a_call_that_finished_freed_its_slot_and_each_call_resumes_on_its_own(
    trip: Trip,
) -> None:
    """Two slots: book_seat finishes and reserve_hotel takes its slot; charge_card and
    reserve_hotel are in flight when the process dies, send_email never started."""
    plan = {CHARGE: "hang_after", HOTEL: "hang_before"}
    reached = {f"COMPLETED {BOOK}", f"AT {CHARGE} hang_after", f"AT {HOTEL} hang_before"}
    trip.kill_when("slot", parallel=2, plan=plan, reached=reached)
    assert trip.effects("slot") == Counter({BOOK: 1, CHARGE: 1})
    code, out = trip.resume("slot", reconcile=True)
    assert code == 0, out
    _in_model_order(_told(out))
    assert trip.effects("slot") == ONE_EACH


def test_calls_asked_later_that_finished_first_still_reach_the_model_in_its_order(
    trip: Trip,
) -> None:
    """The two calls asked last completed while the two asked first were in flight."""
    plan = {BOOK: "hang_after", CHARGE: "hang_before", HOTEL: "hold_done"}
    reached = {
        f"AT {BOOK} hang_after",
        f"AT {CHARGE} hang_before",
        f"AT {HOTEL} hold_done",
        f"COMPLETED {EMAIL}",
    }
    trip.kill_when("late", parallel=4, plan=plan, reached=reached)
    assert trip.effects("late") == Counter({BOOK: 1, HOTEL: 1, EMAIL: 1})
    code, out = trip.resume("late", reconcile=True)
    assert code == 0, out
    told = _told(out)
    _in_model_order(told)
    assert told[0][2].get("by") == "rec"
    assert trip.effects("late") == ONE_EACH
