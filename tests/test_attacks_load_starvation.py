"""Attacks under load: one worker process carrying many runs at once.

Tried: many concurrent runs on PostgreSQL with a one-connection pool and grouped writes
(do lease renewals wait behind the groups holding the connection?); many sync tools that
block their threads (do they starve what the kit itself needs of the default executor?);
a CPU-bound async tool that stalls the event loop past the lease ttl while another
worker process takes a run over (is anything sent twice, or recorded over the taker?);
many runs on Redis.

Defect found (strict xfail):
- a sync tool's lease check (``Attempt.guard``) runs on the event loop right before the
  call is handed to ``asyncio.to_thread``; when every thread of the default executor is
  busy with other runs' blocking tools, the call waits in the executor's queue with its
  check already passed. The holder's lease can lapse meanwhile (its event loop stalled by
  another run's CPU-bound tool) and another worker take the run over, find the call
  claimed and never made, and make it (its reconciler answering ``never_ran`` after the
  margin); then the queued call starts in the first process as the threads free up, and
  the booking is made twice.

Holds: 18 runs at once with blocking sync tools and heavy results (queued behind them in
the executor) on SQLite and on PostgreSQL (grouped writes, one pooled connection, 1 s
deadline) and Redis, each taken once, finished, booked once; one worker alone does not
take a run again while its first take still waits for a queued call; a CPU-bound async
tool past its lease is refused in doubt by the taker, never sent again, and its late
outcome is recorded and replayed once.
"""

from __future__ import annotations

import asyncio
import collections
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tesserix_adk import (
    Agent,
    AgentRunner,
    Backoff,
    Checkpointer,
    LeasePolicy,
    ModelRequest,
    ModelResponse,
    Reconciled,
    ToolCall,
    ToolContext,
    Worker,
    open_stores,
    tool,
)
from tesserix_adk.errors import IndeterminateToolCallError
from tesserix_adk.messages import Message, Role
from tesserix_adk.stores.protocols import WorkState

T = "load"
FAST = Backoff(base=0.05, cap=0.2)
HERE = Path(__file__).resolve()
# The default executor's threads (``asyncio.to_thread``), as Python sizes it.
EXECUTOR_THREADS = min(32, (os.cpu_count() or 1) + 4)
# A tool result heavy enough to be redacted and encoded in a worker thread (16 KiB and up).
BIG = 40_000


# --- the world: an effects file the tools append to, one line per call made ---------------


def _effects(path: Path) -> list[str]:
    if not path.exists():
        return []
    return [line for line in path.read_text().splitlines() if line]


def _append(path: Path, line: str) -> None:
    with open(path, "a") as f:
        f.write(line + "\n")
        f.flush()
        os.fsync(f.fileno())


def _say(text: str) -> ModelResponse:
    return ModelResponse(message=Message(role=Role.assistant, content=text))


class Plan:
    """Asks for the one call the user's message names (``book``, ``hold``, ``spin``), then
    says ``done``; the turn is chosen by counting assistant messages, so a fresh process
    carries on where another stopped. ``gate`` (optional) is awaited before a first turn."""

    def __init__(self, gate: Any = None) -> None:
        self.gate = gate

    async def complete(self, request: ModelRequest) -> ModelResponse:
        user = next(m for m in request.messages if m.role is Role.user)
        words = str(user.content).split()
        asked = sum(1 for m in request.messages if m.role is Role.assistant)
        if asked >= len(words):
            return _say("done")
        if self.gate is not None:
            await self.gate(words[asked])
        name, _, arg = words[asked].partition(":")
        call = ToolCall(id=f"c{asked}", name=name, arguments={"n": arg or "0"})
        return ModelResponse(message=Message(role=Role.assistant, content="", tool_calls=[call]))


def _load_agent(
    effects: Path,
    *,
    hold_s: float = 0.0,
    spin_s: float = 0.0,
    started: Any = None,
    hold_until: float | None = None,
) -> Agent:
    """``book`` (side-effecting, keyed, reconciled from the effects file), ``hold`` (a
    read-only sync call that blocks its thread ``hold_s``) and ``spin`` (an async tool that
    keeps the event loop busy ``spin_s`` without awaiting). With ``hold_until`` (a
    monotonic time), ``hold`` blocks until then instead: calls sent again later return."""

    def lookup(key: str) -> Reconciled:
        made = [line for line in _effects(effects) if line.split()[-1] == key]
        return Reconciled.completed("booked") if made else Reconciled.never_ran()

    @tool(reconcile=lambda call, ctx: lookup(ctx.idempotency_key))
    def book(n: str, ctx: ToolContext) -> str:
        """Book a seat (one line in the effects file); ``big``: a large confirmation."""
        _append(effects, f"{ctx.run_id} {os.getpid()} {ctx.idempotency_key}")
        return "booked" + ("x" * BIG if n == "big" else "")

    @tool(side_effects=False)
    def hold(n: str) -> str:
        """A slow read (an HTTP GET that takes a while)."""
        if started is not None:
            started()
        time.sleep(hold_s if hold_until is None else max(0.0, hold_until - time.monotonic()))
        return "held"

    @tool(side_effects=False)
    async def spin(n: str) -> str:
        """CPU-bound work with no await in it."""
        end = time.monotonic() + spin_s
        x = 0
        while time.monotonic() < end:
            x += 1
        return "spun"

    return Agent("load", "Carry the plan out.", [book, hold, spin])


# --- the first worker process of the queued-call attack -----------------------------------


async def _first_worker(
    store: str, effects: Path, hold_s: float, spin_s: float, ttl: float, margin: float = 10.0
) -> None:
    """One worker process carrying ``EXECUTOR_THREADS`` runs that each block a thread in
    ``hold``, run ``a`` that books once every thread is busy (so its call waits in the
    executor's queue), and run ``h`` whose ``spin`` stalls the event loop past the ttl once
    ``a``'s call is queued."""
    loop = asyncio.get_running_loop()
    holding = 0
    lock = threading.Lock()

    def started() -> None:
        nonlocal holding
        with lock:
            holding += 1

    def queued() -> int:
        executor = getattr(loop, "_default_executor", None)
        return 0 if executor is None else executor._work_queue.qsize()

    async def gate(word: str) -> None:
        if word == "book":
            while holding < EXECUTOR_THREADS:  # noqa: ASYNC110
                await asyncio.sleep(0.02)
        elif word == "spin":
            while holding < EXECUTOR_THREADS or queued() < 1:  # noqa: ASYNC110
                await asyncio.sleep(0.02)
            print("QUEUED", flush=True)

    until = time.monotonic() + hold_s
    agent = _load_agent(effects, spin_s=spin_s, started=started, hold_until=until)
    async with open_stores(store) as stores:
        runner = AgentRunner.from_stores(
            Plan(gate),
            stores,
            worker="first",
            lease_policy=LeasePolicy(ttl=ttl, renew_within=ttl / 2),
            never_ran_margin=margin,
        )
        for i in range(EXECUTOR_THREADS):
            await runner.submit(agent, "hold", tenant=T, run_id=f"f{i}")
        await runner.submit(agent, "book", tenant=T, run_id="a")
        await runner.submit(agent, "spin", tenant=T, run_id="h")
        worker = Worker(
            runner, [agent], concurrency=EXECUTOR_THREADS + 4, poll_interval=0.05, backoff=FAST
        )
        await worker.run()


# --- helpers -------------------------------------------------------------------------------


async def _wait_lapsed(stores: Any, run_id: str) -> None:
    deadline = time.monotonic() + 15.0
    while await stores.leases.current(T, run_id) is not None:
        assert time.monotonic() < deadline, f"the lease of {run_id} never lapsed"
        await asyncio.sleep(0.05)


def _spawn(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(HERE), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=str(HERE.parent),
    )


def _kill(proc: subprocess.Popen[str]) -> str:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
    _, err = proc.communicate(timeout=10)
    return err


# --- the defect ----------------------------------------------------------------------------


async def test_a_sync_call_queued_behind_busy_threads_is_not_made_after_its_lease_lapsed(
    tmp_path: Path,
) -> None:
    store = f"sqlite:///{tmp_path / 'adk.sqlite3'}"
    effects = tmp_path / "effects.txt"
    ttl, hold_s, spin_s = 1.5, 9.0, 4.0
    async with open_stores(store) as stores:
        await stores.create_schema()
    first = _spawn("first", store, str(effects), str(hold_s), str(spin_s), str(ttl), "10")
    try:
        assert first.stdout is not None
        line = await asyncio.to_thread(first.stdout.readline)
        assert line.strip() == "QUEUED", (line, _kill(first))
        async with open_stores(store) as stores:
            # The first process's loop is stalled: run a's lease lapses by the store's clock,
            # with its call claimed, checked, and waiting for a thread.
            await _wait_lapsed(stores, "a")
            assert _effects(effects) == []
            second = AgentRunner.from_stores(
                Plan(),
                stores,
                worker="second",
                lease_policy=LeasePolicy(ttl=ttl, renew_within=ttl / 2),
                never_ran_margin=1.0,
            )
            run = await second.resume(_load_agent(effects), "a", tenant=T)
            assert run.status.value == "completed"
        # The first process's threads free up once its blocking tools return.
        deadline = time.monotonic() + hold_s + 3
        while time.monotonic() < deadline and len(_effects(effects)) < 2:  # noqa: ASYNC110
            await asyncio.sleep(0.1)
    finally:
        err = _kill(first)
    made = [line for line in _effects(effects) if line.startswith("a ")]
    assert len(made) == 1, (made, err[-2000:])


async def test_one_worker_alone_never_makes_a_queued_sync_call_twice(tmp_path: Path) -> None:
    """No second process: the worker's lease on run ``a`` lapses while its call waits for
    a thread (its loop stalled by run ``h``), with a 1 s never-ran margin; the worker does
    not take ``a`` again while its first take still waits for that call, so the booking is
    made once, by the queued call, and the run then finishes."""
    store = f"sqlite:///{tmp_path / 'adk.sqlite3'}"
    effects = tmp_path / "effects.txt"
    hold_s = 6.0
    async with open_stores(store) as stores:
        await stores.create_schema()
    first = _spawn("first", store, str(effects), str(hold_s), "3.0", "1.5", "1")
    try:
        assert first.stdout is not None
        line = await asyncio.to_thread(first.stdout.readline)
        assert line.strip() == "QUEUED", (line, _kill(first))
        async with open_stores(store) as stores:
            deadline = time.monotonic() + hold_s + 6
            status = None
            while time.monotonic() < deadline and status != "completed":
                await asyncio.sleep(0.2)
                cp = await Checkpointer.from_stores(stores).latest(T, "a")
                status = None if cp is None else str(cp.status.value)
        await asyncio.sleep(1.0)  # a second booking would land right after
    finally:
        err = _kill(first)
    assert status == "completed", err[-2000:]
    made = [line for line in _effects(effects) if line.startswith("a ")]
    assert len(made) == 1, (made, err[-2000:])


# --- what holds --------------------------------------------------------------------------


async def _fleet(
    url: str,
    effects: Path,
    *,
    runs: int,
    plan: str,
    hold_s: float,
    ttl: float,
    group_writes: bool,
) -> tuple[Worker, dict[str, str]]:
    """``runs`` runs of ``plan`` carried by one worker, all at once; the worker and each
    run's final frontier status."""
    agent = _load_agent(effects, hold_s=hold_s)
    async with open_stores(url) as stores:
        await stores.create_schema()
        runner = AgentRunner.from_stores(
            Plan(),
            stores,
            worker="fleet",
            lease_policy=LeasePolicy(ttl=ttl, renew_within=ttl / 2),
            group_writes=group_writes,
        )
        for i in range(runs):
            await runner.submit(agent, plan, tenant=T, run_id=f"r{i}")
        worker = Worker(
            runner,
            [agent],
            concurrency=runs,
            exit_when_idle=True,
            poll_interval=0.05,
            backoff=FAST,
        )
        await asyncio.wait_for(worker.run(), 60)
        assert runner.checkpoints is not None
        statuses = {}
        for i in range(runs):
            cp = await runner.checkpoints.latest(T, f"r{i}")
            statuses[f"r{i}"] = "none" if cp is None else str(cp.status.value)
        assert stores.work is not None
        parked = await stores.work.items(T, state=WorkState.parked)
        assert parked == [], parked
    return worker, statuses


def _once_each(effects: Path, runs: int, calls: int) -> None:
    lines = _effects(effects)
    keys = collections.Counter(line.split()[-1] for line in lines)
    twice = {k: n for k, n in keys.items() if n > 1}
    assert twice == {}, twice
    per_run = collections.Counter(line.split()[0] for line in lines)
    assert per_run == {f"r{i}": calls for i in range(runs)}, per_run


@pytest.mark.parametrize(
    ("backend", "options"),
    [
        pytest.param("sqlite", {}, id="sqlite"),
        pytest.param(
            "postgres",
            {"pool_max": "1", "timeout": "1"},
            id="postgres-one-connection",
            marks=pytest.mark.postgres,
        ),
        pytest.param("redis", {}, id="redis", marks=pytest.mark.redis),
    ],
)
async def test_many_grouped_runs_with_blocking_sync_tools_each_finish_once_without_losing_a_lease(
    tmp_path: Path, backend: str, options: dict[str, str]
) -> None:
    """Three times as many runs as the default executor has threads, each blocking a
    thread for longer than half the lease ttl and recording results heavy enough to be
    redacted in a worker thread (queued behind the blocked ones), on one worker with
    grouped writes (PostgreSQL: one pooled connection and a 1 s deadline to get it): every
    run is taken once and finishes, every booking is made once, none is parked."""
    from adapters import services
    from processes import store_url

    runs = 3 * EXECUTOR_THREADS
    effects = tmp_path / "effects.txt"
    async with store_url(backend, tmp_path) as url:
        if options:
            url = services.with_query(url, **options)
        worker, statuses = await _fleet(
            url,
            effects,
            runs=runs,
            plan="hold book:big book",
            hold_s=0.9,
            ttl=1.5,
            group_writes=backend != "redis",
        )
    assert set(statuses.values()) == {"completed"}, statuses
    assert sorted(how.value for _, how in worker.carried) == ["finished"] * runs
    _once_each(effects, runs, calls=2)


def _charge_agent(effects: Path, spin_s: float = 0.0) -> Agent:
    """``charge``: an async tool that keeps the event loop busy ``spin_s`` (a CPU-heavy
    check, no await in it) before it writes the effect."""

    @tool
    async def charge(n: str, ctx: ToolContext) -> str:
        """Charge a card after a CPU-heavy check."""
        if spin_s:
            print("CHARGING", flush=True)
        end = time.monotonic() + spin_s
        while time.monotonic() < end:
            pass
        _append(effects, f"{ctx.run_id} {os.getpid()} {ctx.idempotency_key}")
        return "charged"

    return Agent("spinner", "Charge.", [charge])


async def _spinner(store: str, effects: Path, spin_s: float, ttl: float) -> None:
    """One process carrying run ``s``, whose charge stalls the event loop past the ttl."""
    async with open_stores(store) as stores:
        runner = AgentRunner.from_stores(
            Plan(),
            stores,
            worker="spinner",
            lease_policy=LeasePolicy(ttl=ttl, renew_within=ttl / 2),
        )
        try:
            run = await runner.run(_charge_agent(effects, spin_s), "charge", tenant=T, run_id="s")
            print("ENDED", run.status.value, flush=True)
        except Exception as exc:
            print("STOPPED", type(exc).__name__, flush=True)


async def test_a_cpu_bound_async_tool_past_its_lease_is_refused_in_doubt_then_replayed_once(
    tmp_path: Path,
) -> None:
    """A process's async tool stalls its event loop past the lease ttl; another process
    takes the run over meanwhile: it refuses the call as in doubt (naming it) instead of
    sending it; the stalled process stops once its tool returns (it does not finish the
    run), the outcome it records is replayed by the next resume, and the charge is made
    once."""
    store = f"sqlite:///{tmp_path / 'adk.sqlite3'}"
    effects = tmp_path / "effects.txt"
    ttl = 1.0
    async with open_stores(store) as stores:
        await stores.create_schema()
    first = _spawn("spinner", store, str(effects), "3.0", str(ttl))
    try:
        assert first.stdout is not None
        line = await asyncio.to_thread(first.stdout.readline)
        assert line.strip() == "CHARGING", (line, _kill(first))
        async with open_stores(store) as stores:
            await _wait_lapsed(stores, "s")
            second = AgentRunner.from_stores(
                Plan(), stores, worker="second", lease_policy=LeasePolicy(ttl=ttl, renew_within=0.5)
            )
            with pytest.raises(IndeterminateToolCallError) as refused:
                await second.resume(_charge_agent(effects), "s", tenant=T)
            assert "charge" in str(refused.value)
            last = await asyncio.to_thread(first.stdout.readline)
            assert last.split()[0] in ("STOPPED", "ENDED"), last
            assert last.split() != ["ENDED", "completed"], last
            # What the superseded holder's call produced is recorded (not fenced, by
            # design): the next resume replays it instead of sending the charge again.
            run = await second.resume(_charge_agent(effects), "s", tenant=T)
            assert run.status.value == "completed"
    finally:
        _kill(first)
    made = [line for line in _effects(effects) if line.startswith("s ")]
    assert len(made) == 1, made


def main() -> None:
    role, *args = sys.argv[1:]
    if role == "first":
        store, effects, hold_s, spin_s, ttl, margin = args
        asyncio.run(
            _first_worker(
                store, Path(effects), float(hold_s), float(spin_s), float(ttl), float(margin)
            )
        )
    elif role == "spinner":
        store, effects, spin_s, ttl = args
        asyncio.run(_spinner(store, Path(effects), float(spin_s), float(ttl)))


if __name__ == "__main__":
    main()
