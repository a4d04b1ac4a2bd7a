"""Attacks on worker recovery: real worker processes on one store, killed, stopped, drained
and restarted, and runs that must be parked or must not hot-loop.

Four defects were found, all fixed, and their tests pass now: a CancelledError leaking
from a run's own code was retaken at once in a hot loop; an operator's resolve landing
between a worker's release and its park was overwritten by the park; one damaged work
entry stopped the worker from carrying any run (Redis, and SQLite and PostgreSQL alike); a
run that kills every worker process taking it was never parked, since a take was counted
only when the worker lived to see it fail (takes are counted now). The plain tests show a
promise that held. The worker processes are ``Worker``s of a small script written to the
test's ``tmp_path`` (with an agent module beside it), so each can be given a short lease
and fault points: a fault is a line in a counter file, then SIGKILL or SIGSTOP of the
process itself. Every side effect is one ``write(2)`` of a line to a file opened
``O_APPEND`` (key, run, flight, fence, pid), so a process killed right after it cannot
lose it and concurrent lines never interleave.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from booking import BOOK_TURNS, Airline
from processes import held_open, store_url
from tesserix_adk import (
    Agent,
    AgentRunner,
    Carried,
    Checkpointer,
    LeasePolicy,
    ScriptedProvider,
    Worker,
    WorkState,
    open_stores,
    tool,
)
from tesserix_adk.cli.main import main as tesserix
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.testing.faults import SimulatedCrash

T = "acme"

# --- the agent and the worker of the process tests (written to tmp_path) -----------------

AGENT_SRC = '''
"""The agent of tests/test_attacks_worker_recovery.py: books two seats, one per turn."""

import json
import os
import signal
import time
from typing import Any

from tesserix_adk import Agent, ModelRequest, ModelResponse, Reconciled, tool
from tesserix_adk.messages import Message, Role, ToolCall

FLIGHTS = ("LH400", "UA901")


def append(path: str, line: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\\n").encode())
    finally:
        os.close(fd)


def lines(path: str) -> list[str]:
    try:
        with open(path) as f:
            return f.read().splitlines()
    except FileNotFoundError:
        return []


def fault(point: str, run_id: str) -> None:
    """WR_FAULTS: [{"point", "run", "action": kill|stop|mark, "times"}]; each fires at most
    ``times`` times over every process, counted in WR_DIR/fault-<n>."""
    for n, f in enumerate(json.loads(os.environ.get("WR_FAULTS", "[]"))):
        if f["point"] != point or f.get("run", run_id) != run_id:
            continue
        counter = os.path.join(os.environ["WR_DIR"], f"fault-{n}")
        if len(lines(counter)) >= f.get("times", 1):
            continue
        append(counter, f"{os.getpid()} {point} {run_id}")
        if f["action"] == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif f["action"] == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        return


def run_of(request: ModelRequest) -> str:
    first = next(m for m in request.messages if m.role is Role.user)
    return str(first.content).split()[1]


class Model:
    async def complete(self, request: ModelRequest) -> ModelResponse:
        run_id = run_of(request)
        done = sum(1 for m in request.messages if m.role is Role.tool)
        append(os.path.join(os.environ["WR_DIR"], "model-calls"), f"{os.getpid()} {run_id} {done}")
        fault(f"model{done}", run_id)
        if done < len(FLIGHTS):
            flight = {"flight": FLIGHTS[done]}
            call = ToolCall(id=f"call_{done}", name="book_seat", arguments=flight)
            return ModelResponse(message=Message(Role.assistant, "", tool_calls=[call]))
        return ModelResponse(message=Message(Role.assistant, "Booked both."))


def look_up(call: Any, ctx: Any) -> Reconciled:
    for line in lines(os.environ["WR_EFFECTS"]):
        if line.split()[0] == ctx.idempotency_key:
            return Reconciled.completed({"booked": line.split()[2]})
    return Reconciled.never_ran()


@tool(reconcile=look_up)
def book_seat(flight: str, ctx: Any) -> dict[str, str]:
    """Book one seat."""
    fault("tool_before", ctx.run_id)
    time.sleep(float(os.environ.get("WR_SLOW", "0")))
    append(
        os.environ["WR_EFFECTS"],
        f"{ctx.idempotency_key} {ctx.run_id} {flight} {ctx.fence} {os.getpid()}",
    )
    fault("tool_after", ctx.run_id)
    return {"booked": flight}


agent = Agent("wr", "Book two seats.", [book_seat])
'''

WORKER_SRC = '''
"""One worker process of tests/test_attacks_worker_recovery.py (config: argv[1], JSON)."""

import asyncio
import json
import logging
import os
import signal
import sys

from tesserix_adk import AgentRunner, Backoff, LeasePolicy, Worker, open_stores

import wr_agent


async def main() -> None:
    cfg = json.loads(sys.argv[1])
    ttl = cfg.get("ttl", 1.0)
    async with open_stores(cfg["store"]) as stores:
        runner = AgentRunner.from_stores(
            wr_agent.Model(),
            stores,
            lease_policy=LeasePolicy(ttl=ttl, renew_within=ttl / 3),
            never_ran_margin=cfg.get("margin", 0.2),
            resume_claim_ttl=ttl,
            worker="wr",
        )
        worker = Worker(
            runner,
            [wr_agent.agent],
            concurrency=cfg.get("concurrency", 4),
            poll_interval=0.05,
            max_attempts=cfg.get("max_attempts", 20),
            exit_when_idle=cfg.get("idle", False),
            backoff=Backoff(base=0.05, cap=0.2),
        )
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, worker.drain)
        print("READY", os.getpid(), flush=True)
        await worker.run()
        print("CARRIED", json.dumps([[i.run_id, str(h)] for i, h in worker.carried]), flush=True)


logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(levelname)s %(message)s")
asyncio.run(main())
'''

SUBMIT_SRC = """
import asyncio, os, sys
from tesserix_adk import AgentRunner, open_stores
import wr_agent

async def main():
    async with open_stores(sys.argv[1]) as stores:
        runner = AgentRunner.from_stores(wr_agent.Model(), stores)
        for run_id in sys.argv[2:]:
            await runner.submit(
                # The same request from each process: a client retrying it. (Another input
                # under an id submitted before is refused, RunStartedError.)
                wr_agent.agent, f"book {run_id}", tenant="acme", run_id=run_id
            )

asyncio.run(main())
"""


class Site:
    """A store every process of one test shares, the script files and the effects file."""

    def __init__(self, tmp: Path, url: str) -> None:
        self.tmp = tmp
        self.url = url
        (tmp / "wr_agent.py").write_text(AGENT_SRC)
        (tmp / "wr_worker.py").write_text(WORKER_SRC)
        self.effects_path = tmp / "effects.log"
        self.logs = tmp / "logs"
        self.logs.mkdir()
        path = os.pathsep.join([str(tmp), os.environ.get("PYTHONPATH", "")])
        self.env = {
            **os.environ,
            "PYTHONPATH": path,
            "WR_DIR": str(tmp),
            "WR_EFFECTS": str(self.effects_path),
        }
        self.spawned: list[subprocess.Popen[str]] = []

    def stores(self, fn: Callable[[Stores], Any]) -> Any:
        async def go() -> Any:
            async with open_stores(self.url) as stores:
                return await fn(stores)

        return asyncio.run(go())

    def submit(self, run_ids: list[str], *, processes: int = 1) -> None:
        """``processes`` submitters at once, each submitting every id."""
        subs = [
            subprocess.Popen(
                [sys.executable, "-c", SUBMIT_SRC, self.url, *run_ids],
                env=self.env,
                cwd=self.tmp,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for _ in range(processes)
        ]
        for sub in subs:
            _, err = sub.communicate(timeout=60)
            assert sub.returncode == 0, err

    def worker(
        self, faults: list[dict[str, Any]] | None = None, **cfg: Any
    ) -> subprocess.Popen[str]:
        env = {**self.env, "WR_FAULTS": json.dumps(faults or [])}
        env.update({k: str(v) for k, v in cfg.pop("env", {}).items()})
        log = self.logs / f"worker-{len(self.spawned)}.log"
        with log.open("w") as out:
            proc = subprocess.Popen(
                [
                    sys.executable,
                    str(self.tmp / "wr_worker.py"),
                    json.dumps({"store": self.url, **cfg}),
                ],
                env=env,
                cwd=self.tmp,
                stdout=out,
                stderr=subprocess.STDOUT,
                text=True,
            )
        proc.log = log  # type: ignore[attr-defined]
        self.spawned.append(proc)
        return proc

    def output(self, proc: subprocess.Popen[str]) -> str:
        return Path(proc.log).read_text()  # type: ignore[attr-defined]

    def all_logs(self, tail: int = 30) -> str:
        parts = []
        for log in sorted(self.logs.iterdir()):
            parts.append(f"--- {log.name}\n" + "\n".join(log.read_text().splitlines()[-tail:]))
        return "\n".join(parts)

    def effects(self) -> list[list[str]]:
        if not self.effects_path.exists():
            return []
        return [line.split() for line in self.effects_path.read_text().splitlines()]

    def fired(self, n: int) -> list[str]:
        path = self.tmp / f"fault-{n}"
        return path.read_text().splitlines() if path.exists() else []

    def model_calls(self, run_id: str) -> int:
        path = self.tmp / "model-calls"
        if not path.exists():
            return 0
        return sum(1 for line in path.read_text().splitlines() if line.split()[1] == run_id)

    def statuses(self, run_ids: list[str]) -> dict[str, str | None]:
        async def go(stores: Stores) -> dict[str, str | None]:
            checkpointer = Checkpointer.from_stores(stores)
            found: dict[str, str | None] = {}
            for run_id in run_ids:
                cp = await checkpointer.latest(T, run_id)
                found[run_id] = None if cp is None else str(cp.status)
            return found

        return self.stores(go)  # type: ignore[no-any-return]

    def parked(self) -> list[Any]:
        return self.stores(lambda s: s.work.items(T, state=WorkState.parked))  # type: ignore[no-any-return]

    def completed(self, run_ids: list[str]) -> bool:
        return set(self.statuses(run_ids).values()) == {"completed"}

    def one_effect_per_key(self, run_ids: list[str]) -> None:
        effects = self.effects()
        per_key = Counter(e[0] for e in effects)
        assert [k for k, n in per_key.items() if n > 1] == [], (
            f"a call took effect twice: {effects}"
        )
        per_run = Counter(e[1] for e in effects)
        assert per_run == dict.fromkeys(run_ids, 2), per_run

    def drain(self, procs: list[subprocess.Popen[str]]) -> None:
        # A worker still importing has no SIGTERM handler yet: wait until it is up.
        deadline = time.monotonic() + 60
        for p in procs:
            while p.poll() is None and "READY" not in self.output(p):
                assert time.monotonic() < deadline, self.output(p)[-3000:]
                time.sleep(0.02)
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            p.wait(timeout=60)
            assert p.returncode == 0, (p.returncode, self.output(p)[-3000:])

    def kill_all(self) -> None:
        for p in self.spawned:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    p.send_signal(signal.SIGCONT)
                p.kill()
                p.wait(timeout=30)


def _apply_schema(url: str) -> bool:
    async def go() -> bool:
        async with open_stores(url) as stores:
            await stores.create_schema()
            return stores.work is not None

    return asyncio.run(go())


@contextlib.contextmanager
def _site(backend: str, tmp_path: Path) -> Iterator[Site]:
    with held_open(store_url(backend, tmp_path)) as url:
        if not _apply_schema(url):
            pytest.skip(f"the {backend} backend keeps no work index")
        site = Site(tmp_path, url)
        try:
            yield site
        finally:
            site.kill_all()


SQLITE_REDIS = [
    pytest.param("sqlite", id="sqlite"),
    pytest.param("redis", id="redis", marks=pytest.mark.redis),
]
EVERY = [*SQLITE_REDIS, pytest.param("postgres", id="postgres", marks=pytest.mark.postgres)]


def _wait(cond: Callable[[], bool], seconds: float, what: Callable[[], str]) -> None:
    deadline = time.monotonic() + seconds
    while not cond():
        assert time.monotonic() < deadline, what()
        time.sleep(0.05)


def _is_stopped(pid: int) -> bool:
    with contextlib.suppress(FileNotFoundError):
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] == "T"
    return False


# --- many worker processes on one store ---------------------------------------------------


@pytest.mark.parametrize("backend", EVERY)
def test_worker_processes_racing_over_runs_submitted_twice_from_two_processes_book_once(
    backend: str, tmp_path: Path
) -> None:
    """Two processes submit the same ten ids at once; three worker processes race over
    them. One run per id, each booking exactly once, nothing parked."""
    with _site(backend, tmp_path) as site:
        run_ids = [f"r{n:02d}" for n in range(10)]
        site.submit(run_ids, processes=2)
        assert {i.run_id for i in site.stores(lambda s: s.work.items(T))} == set(run_ids)
        workers = [site.worker(concurrency=3) for _ in range(3)]
        _wait(lambda: site.completed(run_ids), 60, site.all_logs)
        site.drain(workers)
        site.one_effect_per_key(run_ids)
        assert site.parked() == []
        # Every run was started once, from the one submission the two made.
        per_run_starts = Counter(
            line.split()[1]
            for line in (tmp_path / "model-calls").read_text().splitlines()
            if line.split()[2] == "0"
        )
        assert per_run_starts == dict.fromkeys(run_ids, 1), per_run_starts
        # A client retrying its submissions after the runs finished starts nothing again.
        calls = (tmp_path / "model-calls").read_text()
        site.submit(run_ids)
        again = site.worker(concurrency=3, idle=True)
        again.wait(timeout=60)
        assert again.returncode == 0, site.output(again)
        assert (tmp_path / "model-calls").read_text() == calls
        site.one_effect_per_key(run_ids)


@pytest.mark.parametrize("backend", SQLITE_REDIS)
def test_workers_sigkilled_inside_the_booking_again_and_again_book_each_call_once(
    backend: str, tmp_path: Path
) -> None:
    """Run r0's worker is SIGKILLed three times right after a tool claim (inside the tool,
    before its effect) and twice right after the effect (before the outcome is recorded);
    each time a new worker process takes over. The reconciler settles each call in doubt:
    every booking happens exactly once, and the runs beside r0 finish too."""
    with _site(backend, tmp_path) as site:
        run_ids = ["r0", "r1", "r2"]
        site.submit(run_ids)
        faults = [
            {"point": "tool_before", "run": "r0", "action": "kill", "times": 3},
            {"point": "tool_after", "run": "r0", "action": "kill", "times": 2},
        ]
        live = [site.worker(faults, concurrency=3, ttl=0.6)]
        kills = 0
        deadline = time.monotonic() + 60
        while not site.completed(run_ids):
            assert time.monotonic() < deadline, site.all_logs()
            for p in list(live):
                if p.poll() is not None:
                    assert p.returncode == -signal.SIGKILL, site.output(p)[-3000:]
                    live.remove(p)
                    kills += 1
                    live.append(site.worker(faults, concurrency=3, ttl=0.6))
            time.sleep(0.05)
        site.drain(live)
        assert kills == 5 and len(site.fired(0)) == 3 and len(site.fired(1)) == 2
        site.one_effect_per_key(run_ids)
        assert site.parked() == []


@pytest.mark.parametrize("backend", SQLITE_REDIS)
def test_a_worker_sigstopped_past_its_lease_is_fenced_out_after_sigcont(
    backend: str, tmp_path: Path
) -> None:
    """Worker A stops itself (SIGSTOP) inside r0's second model call, after r0's first
    booking; worker B takes r0 once A's lease lapsed and finishes it. Then A is woken: its
    model answers with the second booking, which it must never send. A goes on working
    (and drains cleanly)."""
    with _site(backend, tmp_path) as site:
        run_ids = ["r0", "r1", "r2"]
        site.submit(run_ids)
        faults = [{"point": "model1", "run": "r0", "action": "stop", "times": 1}]
        # One run at a time: when A stops, it holds r0 alone (a stop inside another run's
        # tool would be the documented limit, not this attack).
        a = site.worker(faults, concurrency=1, ttl=0.8)
        _wait(lambda: _is_stopped(a.pid), 30, site.all_logs)
        b = site.worker(faults, concurrency=3, ttl=0.8)
        _wait(lambda: site.completed(run_ids), 30, site.all_logs)
        site.drain([b])
        before = site.effects()
        a.send_signal(signal.SIGCONT)
        # A wakes, finds it lost the run, and must send nothing; give it time to try.
        time.sleep(1.5)
        site.submit(["r3"])  # and A still carries new work
        _wait(lambda: site.completed([*run_ids, "r3"]), 30, site.all_logs)
        site.drain([a])
        after = site.effects()
        assert [e for e in after[len(before) :] if e[1] != "r3"] == [], after
        site.one_effect_per_key([*run_ids, "r3"])
        assert "Traceback" not in site.output(a)


@pytest.mark.parametrize(
    "backend", [pytest.param("postgres", id="postgres", marks=pytest.mark.postgres)]
)
def test_sigterm_inside_a_tool_drains_at_the_boundary_and_another_worker_goes_on_at_once(
    backend: str, tmp_path: Path
) -> None:
    """SIGTERM while r0's booking is inside the tool (slow, 0.8 s): the worker lets it
    finish, stops at the boundary, releases the lease and exits 0; another worker carries
    every run on at once, long before the 20 s lease would lapse."""
    with _site(backend, tmp_path) as site:
        run_ids = ["r0", "r1"]
        site.submit(run_ids)
        faults = [{"point": "tool_before", "run": "r0", "action": "mark", "times": 1}]
        a = site.worker(faults, concurrency=2, ttl=20.0, env={"WR_SLOW": "0.8"})
        _wait(lambda: bool(site.fired(0)), 30, site.all_logs)
        a.send_signal(signal.SIGTERM)
        a.wait(timeout=30)
        assert a.returncode == 0, site.output(a)
        assert "stopped" in site.output(a)
        started = time.monotonic()
        b = site.worker(concurrency=2, ttl=20.0)
        _wait(lambda: site.completed(run_ids), 15, site.all_logs)
        assert time.monotonic() - started < 15
        site.drain([b])
        site.one_effect_per_key(run_ids)


# --- poison: runs that keep failing --------------------------------------------------------


def test_a_run_that_kills_every_worker_taking_it_is_parked_after_max_attempts(
    tmp_path: Path,
) -> None:
    """Run 'poison' kills its worker process in its first model call (a segfaulting native
    library, the OOM killer): every worker that takes it dies. With max_attempts=3 it must
    end parked with a reason after a few deaths, while the other runs finish. (It was taken
    again by each of eight workers in a row, and never parked, until takes were counted.)"""
    with _site("sqlite", tmp_path) as site:
        good = ["g0", "g1"]
        site.submit(good)
        site.submit(["poison"])
        faults = [{"point": "model0", "run": "poison", "action": "kill", "times": 1000}]
        cfg = {"concurrency": 1, "ttl": 0.5, "max_attempts": 3}
        live = site.worker(faults, **cfg)
        deaths = 0
        deadline = time.monotonic() + 40
        while deaths < 8 and not site.parked():
            assert time.monotonic() < deadline, site.all_logs()
            if live.poll() is not None:
                assert live.returncode == -signal.SIGKILL, site.output(live)[-3000:]
                deaths += 1
                live = site.worker(faults, **cfg)
            time.sleep(0.05)
        # The other runs went on meanwhile (this holds).
        _wait(lambda: site.completed(good), 20, site.all_logs)
        site.one_effect_per_key(good)
        parked = site.parked()
        assert [i.run_id for i in parked] == ["poison"], (
            f"{deaths} workers died taking 'poison'; its model was asked "
            f"{site.model_calls('poison')} times; not parked"
        )
        assert parked[0].reason


class _LeakingCancel:
    """A model client that leaks a ``CancelledError`` for one run (as some HTTP stacks do
    when their connection pool shuts a request down): not a cancellation of the worker."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.inner = ScriptedProvider(list(BOOK_TURNS) * 10)

    async def complete(self, request: Any) -> Any:
        run = str(request.messages[0].content).split()[-1]
        self.calls[run] += 1
        if run == "bad":
            raise asyncio.CancelledError()
        return await self.inner.complete(request)


def _booking_agent(airline: Airline) -> Agent:
    @tool(side_effects=False)
    def search_flights(origin: str, dest: str) -> list[str]:
        """Find flights."""
        return ["LH123"]

    @tool
    def book_seat(flight: str, ctx: Any) -> dict[str, str]:
        """Book a seat."""
        if airline.hook is not None:
            airline.hook("before")
        airline.bookings.append(f"{flight}:{ctx.idempotency_key}")
        if airline.hook is not None:
            airline.hook("after")
        return {"booking": f"B{len(airline.bookings)}"}

    return Agent("booking", "Book.", [search_flights, book_seat])


def _runner(stores: Stores, provider: Any = None, **kwargs: Any) -> AgentRunner:
    return AgentRunner.from_stores(
        provider or ScriptedProvider(list(BOOK_TURNS)),
        stores,
        lease_policy=LeasePolicy(ttl=1.0, renew_within=0.5),
        never_ran_margin=0.05,
        **kwargs,
    )


async def _sqlite(tmp_path: Path) -> Stores:
    stores = open_stores(f"sqlite:///{tmp_path / 'adk.sqlite3'}")
    await stores.create_schema()
    return stores


async def test_a_cancelled_error_leaking_from_the_model_is_not_retaken_in_a_hot_loop(
    tmp_path: Path,
) -> None:
    stores = await _sqlite(tmp_path)
    try:
        airline = Airline()
        agent = _booking_agent(airline)
        model = _LeakingCancel()
        await _runner(stores).submit(agent, "book bad", tenant=T, run_id="bad")
        await _runner(stores).submit(agent, "book good", tenant=T, run_id="good")
        # The default poll interval (0.5 s) and backoff (1 s doubling): at most a handful
        # of tries in 1.5 s if the failure were counted and backed off from.
        worker = Worker(_runner(stores, provider=model), [agent], max_attempts=20)
        task = asyncio.create_task(worker.run())
        await asyncio.sleep(1.5)
        worker.drain()
        await asyncio.wait_for(task, 30)
        assert len(airline.bookings) == 1  # the good run went on (this holds)
        assert model.calls["bad"] <= 5, f"the model was asked {model.calls['bad']} times in 1.5 s"
    finally:
        await stores.aclose()


# --- parking: once, with a reason, and an operator's action is not lost -------------------


async def test_an_operator_resolve_between_a_workers_release_and_its_park_is_not_lost(
    tmp_path: Path,
) -> None:
    url = f"sqlite:///{tmp_path / 'adk.sqlite3'}"
    stores = await _sqlite(tmp_path)
    try:
        airline = Airline()
        agent = _booking_agent(airline)

        def die_after_booking(at: str) -> None:
            if at == "after":
                airline.hook = None
                raise SimulatedCrash("died after the airline booked")

        airline.hook = die_after_booking
        with pytest.raises(SimulatedCrash):
            await _runner(stores).run(agent, "book", tenant=T, run_id="r1")
        await asyncio.sleep(1.1)  # the dead holder's lease lapses
        (record,) = [r for r in await stores.idempotency.records(T, "r1") if r.tool == "book_seat"]
        assert stores.work is not None
        real_park = stores.work.park
        codes: list[int] = []

        async def park(tenant: str, run_id: str, *, agent: str, reason: str) -> None:
            # The on-call engineer looked the booking up and records it, in the moment
            # between the worker's release of the run and its park.
            argv = [
                *("resolve", "r1", "--tenant", T, "--call", str(record.call_id)),
                *("--outcome", '{"booking": "B1"}', "--by", "ops", "--store", url),
            ]
            codes.append(await asyncio.to_thread(tesserix, argv))
            await real_park(tenant, run_id, agent=agent, reason=reason)

        stores.work.park = park  # type: ignore[method-assign]
        first = Worker(_runner(stores), [agent], poll_interval=0.02, exit_when_idle=True)
        await asyncio.wait_for(first.run(), 30)
        stores.work.park = real_park  # type: ignore[method-assign]
        assert codes == [0]  # the resolve went through and said a worker carries it on
        # Woken again by the worker itself on seeing its call settled, after a backoff
        # delay (the crashed first carrier's take counted: at most twice Backoff.base).
        assert await stores.work.items(T, state=WorkState.parked) == []
        (woken,) = await stores.work.items(T)
        assert woken.not_before is not None and woken.not_before - time.time() <= 2.1
        await asyncio.sleep(max(0.0, woken.not_before - time.time()) + 0.1)
        second = Worker(_runner(stores), [agent], poll_interval=0.02, exit_when_idle=True)
        await asyncio.wait_for(second.run(), 30)
        parked = await stores.work.items(T, state=WorkState.parked)
        assert parked == [], f"still parked after the resolve: {parked[0].reason[:80]}..."
        # Parked, then woken by the worker itself on seeing the call settled meanwhile, and
        # carried to the end by the next worker.
        carried = [how for _, how in first.carried + second.carried]
        assert carried[0] is Carried.parked and carried[-1] is Carried.finished, carried
        assert len(airline.bookings) == 1
    finally:
        await stores.aclose()


async def test_a_run_of_a_changed_agent_revision_is_parked_once_and_others_go_on(
    tmp_path: Path,
) -> None:
    """A run whose holder died under the old revision meets workers of a new one: parked
    once, naming the revision, its model never asked; restarted workers leave it alone and
    carry a new run of the new revision."""
    stores = await _sqlite(tmp_path)
    try:
        airline = Airline()
        old = _booking_agent(airline)
        with pytest.raises(SimulatedCrash):
            crashing = _runner(stores)

            def die(at: str) -> None:
                airline.hook = None
                raise SimulatedCrash("died before booking")

            airline.hook = die
            await crashing.run(old, "book old-run", tenant=T, run_id="old-run")
        await asyncio.sleep(1.1)

        @tool(side_effects=False)
        def search_flights(origin: str, dest: str, cabin: str = "economy") -> list[str]:
            """Find flights, now by cabin."""
            return ["LH123"]

        new = Agent("booking", "Book, politely.", [search_flights, old.tools["book_seat"]])
        await _runner(stores).submit(new, "book new-run", tenant=T, run_id="new-run")
        model = _LeakingCancel()  # counts the model calls; no run here is "bad"
        for _ in range(3):  # three restarts of the new revision's worker
            worker = Worker(
                _runner(stores, provider=model), [new], poll_interval=0.02, exit_when_idle=True
            )
            await asyncio.wait_for(worker.run(), 30)
        assert stores.work is not None
        (parked,) = await stores.work.items(T, state=WorkState.parked)
        assert parked.run_id == "old-run" and "Revision" in (parked.reason or ""), parked
        assert model.calls["new-run"] == 3 and model.calls["old-run"] == 0, model.calls
        cp = await Checkpointer.from_stores(stores).latest(T, "new-run")
        assert cp is not None and str(cp.status) == "completed"
        assert airline.bookings and all(b.startswith("LH123:") for b in airline.bookings)
    finally:
        await stores.aclose()


async def test_a_worker_of_another_agent_leaves_a_run_alone_and_goes_idle(
    tmp_path: Path,
) -> None:
    stores = await _sqlite(tmp_path)
    try:
        airline = Airline()
        agent = _booking_agent(airline)
        await _runner(stores).submit(agent, "book", tenant=T, run_id="r1")
        other = Agent("other", "Something else.", [])
        model = _LeakingCancel()
        worker = Worker(_runner(stores, provider=model), [other], exit_when_idle=True)
        await asyncio.wait_for(worker.run(), 10)
        assert worker.carried == [] and sum(model.calls.values()) == 0
        assert stores.work is not None
        (item,) = await stores.work.items(T)
        assert item.state is WorkState.submitted and item.attempts == 0
    finally:
        await stores.aclose()


# --- a damaged work index entry ------------------------------------------------------------


@pytest.mark.redis
async def test_one_damaged_work_entry_does_not_stop_the_worker_carrying_every_other_run(
    tmp_path: Path,
) -> None:
    from adapters import services

    client = await services.redis_client()
    prefix = services.redis_prefix()
    url = services.with_query(services.REDIS_URL, prefix=prefix, allow_volatile="true")
    try:
        async with open_stores(url) as stores:
            await stores.create_schema()
            airline = Airline()
            agent = _booking_agent(airline)
            for run_id in ("r0", "r1", "r2"):
                await _runner(stores).submit(agent, "book", tenant=T, run_id=run_id)
            keys = [k async for k in client.scan_iter(match=f"{prefix}*")]
            (entry,) = [k for k in keys if k.endswith(b"{acme:r0}:work")]
            # A field no kit writes this way (a hand edit, an older or newer kit).
            await client.hset(entry, "attempts", "many")
            worker = Worker(
                _runner(stores, provider=ScriptedProvider(list(BOOK_TURNS) * 2)),
                [agent],
                poll_interval=0.05,
            )
            task = asyncio.create_task(worker.run())
            deadline = time.monotonic() + 4
            while len(airline.bookings) < 2 and time.monotonic() < deadline:  # noqa: ASYNC110
                await asyncio.sleep(0.05)
            worker.drain()
            await asyncio.wait_for(task, 30)
            assert len(airline.bookings) == 2, "r1 and r2 were never carried"
    finally:
        await services.delete_prefixed(client, prefix)
        await client.aclose()


async def test_one_damaged_sqlite_work_row_does_not_stop_the_worker_carrying_every_other_run(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The Redis case above, on SQLite: the row is left out (named once in the log)."""
    stores = await _sqlite(tmp_path)
    try:
        airline = Airline()
        agent = _booking_agent(airline)
        for run_id in ("r0", "r1", "r2"):
            await _runner(stores).submit(agent, "book", tenant=T, run_id=run_id)
        with sqlite3.connect(tmp_path / "adk.sqlite3") as db:
            db.execute("UPDATE adk_work SET attempts = 'many' WHERE run_id = 'r0'")
        worker = Worker(
            _runner(stores, provider=ScriptedProvider(list(BOOK_TURNS) * 2)),
            [agent],
            poll_interval=0.05,
        )
        task = asyncio.create_task(worker.run())
        deadline = time.monotonic() + 4
        while len(airline.bookings) < 2 and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.05)
        worker.drain()
        await asyncio.wait_for(task, 30)
        assert len(airline.bookings) == 2, "r1 and r2 were never carried"
        named = [r for r in caplog.records if "acme/r0" in r.getMessage()]
        assert len(named) == 1 and "left out" in named[0].getMessage()
    finally:
        await stores.aclose()
