"""Attacks on the count of attempts (commit 88b2403: ``WorkIndex.want(count=...)``, a take
counted by the runner once the run is held and planned, the worker parking a run taken
``max_attempts`` times, a drain stop giving its take back).

Attacked: a model failing with a plain exception vs a retryable ``AdkError``; a passing
failure met before the take (the run's frontier unreadable for a while); a store that
answers reads and refuses writes (a read-only replica, Redis over ``maxmemory``); a healthy
run carried beside a run that kills its process (concurrency 2); deploys that drain a run
inside a long tool (past ``drain_timeout``) vs at a boundary, on every real backend; two
workers racing over one due run, on every real backend; the count after ``done``, a park
and an operator's wake, on every real backend; a resent Redis ``want`` with a count; a run
whose carrier dies at every take (parked, ``tesserix runs --stuck``, other runs go on); an
operator's ``tesserix resolve`` starting the count again; an operator's
``tesserix run --resume`` of a run parked after ``max_attempts``.

Since then the worker counts its own takes, as each begins (given back when the run was
found held elsewhere or a drain stopped it, including one cancelled inside a tool), and a
failure after a take is not counted again; carrying a run in-process counts nothing; and a
take that writes a new frontier forgets the run's earlier attempts (the worker's
``TakeProgress``, told through ``on_event``). All six defects below are fixed and their tests
pass.

Defects found:
- a run whose model raises a plain exception (``KeyError`` from a hand-written provider)
  is counted twice a try (the take, then ``count=1``): parked after half of
  ``max_attempts`` tries, with a false reason ("each time the process carrying it died");
- a passing failure before the take writes ``count=0``, so the count never grows and the
  delay never doubles: the run is tried every ``Backoff.base`` forever (about 70 tries in
  1.5 s at base 0.02);
- a store refusing writes (the ``want`` with the delay fails, suppressed) leaves the run
  due: the worker retakes it as fast as it fails (thousands of takes a second; this one
  predates 88b2403);
- a healthy run carried beside a poison run is counted for every process the poison run
  kills, and parked with it, though it advanced a step in each process;
- a run inside a long tool when a deploy drains its worker (cancelled at
  ``drain_timeout``) keeps its take: after ``max_attempts`` deploys it is parked, saying
  the process carrying it died;
- an operator's ``tesserix run --resume`` of a run parked after ``max_attempts`` unparks it
  without starting its count again: once that resume fails, the next worker parks it on
  sight without trying it.

Held: a retryable model failure is tried exactly ``max_attempts`` times and parked saying
so; a run stopped at a boundary by many drains is never parked (SQLite, PostgreSQL,
Redis); two workers racing over one due run count one take and carry it once (every
backend); the count restarts after ``done`` and after an operator's wake, and a park keeps
it (every backend); a resent Redis ``want`` counts once; a run whose carrier dies at every
take is parked after ``max_attempts`` with its reason, listed by ``tesserix runs --stuck``,
while another run finishes; ``tesserix resolve`` starts the count again and the call
resolved is not sent again.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import itertools
import json
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from processes import store_url
from tesserix_adk import (
    Agent,
    AgentRunner,
    Backoff,
    Carried,
    Checkpointer,
    LeasePolicy,
    ProviderError,
    Worker,
    WorkState,
    open_stores,
    tool,
)
from tesserix_adk.checkpoint.payload import CheckpointStatus
from tesserix_adk.cli.main import main as tesserix
from tesserix_adk.errors import StoreUnavailableError
from tesserix_adk.messages import Message, Role, ToolCall
from tesserix_adk.providers import ModelResponse
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.stores.memory import MemoryWorkIndex
from tesserix_adk.testing.faults import SimulatedCrash

T = "acme"
FAST = Backoff(base=0.01, cap=0.02)

BACKENDS = [
    pytest.param("sqlite", id="sqlite"),
    pytest.param("redis", id="redis", marks=pytest.mark.redis),
    pytest.param("postgres", id="postgres", marks=pytest.mark.postgres),
]


# --- helpers ------------------------------------------------------------------------------


def _mem() -> Stores:
    stores = open_stores("memory://")
    stores.work = MemoryWorkIndex(stores.leases)
    return stores


@contextlib.asynccontextmanager
async def _real(backend: str, tmp_path: Path) -> AsyncIterator[Stores]:
    async with store_url(backend, tmp_path) as url, open_stores(url) as stores:
        await stores.create_schema()
        assert stores.work is not None
        yield stores


def _runner(stores: Stores, provider: Any, ttl: float = 2.0, **kw: Any) -> AgentRunner:
    return AgentRunner.from_stores(
        provider,
        stores,
        lease_policy=LeasePolicy(ttl=ttl, renew_within=ttl / 2),
        never_ran_margin=0.05,
        resume_claim_ttl=ttl,
        **kw,
    )


def _run_of(request: Any) -> str:
    first = next(m for m in request.messages if m.role is Role.user)
    return str(first.content).split()[-1]


def _done_steps(request: Any) -> int:
    return sum(1 for m in request.messages if m.role is Role.tool)


class Steps:
    """Asks for ``steps`` read-only steps, one a turn, then answers; counts its calls."""

    def __init__(self, steps: int = 2) -> None:
        self.steps = steps
        self.calls: Counter[str] = Counter()

    async def complete(self, request: Any) -> Any:
        self.calls[_run_of(request)] += 1
        done = _done_steps(request)
        if done < self.steps:
            call = ToolCall(id=f"call_{done}", name="step", arguments={"n": done})
            return ModelResponse(message=Message(Role.assistant, "", tool_calls=[call]))
        return ModelResponse(message=Message(Role.assistant, "done"))


class KeyErrorModel(Steps):
    """A hand-written provider meeting a malformed response: a plain exception."""

    async def complete(self, request: Any) -> Any:
        self.calls[_run_of(request)] += 1
        raise KeyError("choices")


class RateLimited(Steps):
    async def complete(self, request: Any) -> Any:
        self.calls[_run_of(request)] += 1
        raise ProviderError("rate limited", retryable=True, status_code=429)


def _step_agent(hook: Callable[[str, int], Any] | None = None) -> Agent:
    @tool(side_effects=False)
    async def step(n: int, ctx: Any) -> dict[str, int]:
        """One read-only step."""
        if hook is not None:
            await hook(ctx.run_id, n)
        return {"n": n}

    return Agent("steps", "Take steps.", [step])


async def _until(cond: Callable[[], Any], seconds: float, what: str = "") -> None:
    deadline = time.monotonic() + seconds
    while not await cond():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.01)


async def _parked(stores: Stores) -> list[Any]:
    assert stores.work is not None
    return await stores.work.items(T, state=WorkState.parked)


async def _entry(stores: Stores, run_id: str) -> Any:
    assert stores.work is not None
    found = [i for i in await stores.work.items(T) if i.run_id == run_id]
    return found[0] if found else None


async def _work_until_parked(stores: Stores, worker: Worker, seconds: float = 10.0) -> Any:
    task = asyncio.create_task(worker.run())
    try:
        await _until(lambda: _parked(stores), seconds, f"never parked: {worker.carried}")
    finally:
        worker.drain()
        await asyncio.wait_for(task, 10)
    (parked,) = await _parked(stores)
    return parked


# --- failures: counted once a try, backed off, parked after max_attempts ---------------------


async def test_a_retryable_model_failure_is_tried_max_attempts_times_then_parked_saying_so() -> (
    None
):
    stores, model = _mem(), RateLimited()
    agent = _step_agent()
    runner = _runner(stores, model)
    await runner.submit(agent, "go r1", tenant=T, run_id="r1")
    worker = Worker(runner, [agent], poll_interval=0.01, max_attempts=4, backoff=FAST)
    parked = await _work_until_parked(stores, worker)
    assert model.calls["r1"] == 4
    assert parked.reason.startswith("failed 4 times, last ProviderError: rate limited")


async def test_a_run_failing_with_a_plain_exception_is_tried_max_attempts_times_and_parked() -> (
    None
):
    stores, model = _mem(), KeyErrorModel()
    agent = _step_agent()
    runner = _runner(stores, model)
    await runner.submit(agent, "go r1", tenant=T, run_id="r1")
    worker = Worker(runner, [agent], poll_interval=0.01, max_attempts=4, backoff=FAST)
    parked = await _work_until_parked(stores, worker)
    assert model.calls["r1"] == 4, parked.reason
    assert parked.reason.startswith("failed 4 times, last KeyError: 'choices'")


async def test_a_passing_failure_before_the_take_backs_off_with_doubling_delays() -> None:
    """The run's frontier cannot be read for a while (the read times out: a passing store
    error, met before the take). Retries must back off, doubling from 0.02 s: at most about
    eight tries in 1.5 s."""
    stores = _mem()
    agent = _step_agent()
    runner = _runner(stores, Steps())
    await runner.submit(agent, "go slow", tenant=T, run_id="slow")
    assert runner.checkpoints is not None
    store = runner.checkpoints.store
    real_latest = store.latest
    tries: list[float] = []

    async def latest(tenant: str, run_id: str) -> Any:
        if run_id == "slow":
            tries.append(time.monotonic())
            raise StoreUnavailableError("reading the frontier of run 'slow' timed out")
        return await real_latest(tenant, run_id)

    store.latest = latest  # type: ignore[method-assign]
    worker = Worker(
        runner, [agent], poll_interval=0.01, max_attempts=5, backoff=Backoff(base=0.02, cap=2.0)
    )
    task = asyncio.create_task(worker.run())
    await asyncio.sleep(1.5)
    worker.drain()
    await asyncio.wait_for(task, 10)
    gaps = [round(b - a, 3) for a, b in itertools.pairwise(tries)]
    assert len(tries) <= 10, f"{len(tries)} tries in 1.5 s, gaps {gaps[:8]}..."


async def test_a_store_refusing_writes_does_not_make_the_worker_retake_a_run_in_a_hot_loop() -> (
    None
):
    """A read-only replica after a failover, or Redis over maxmemory: reads answer, every
    write is refused. The lease cannot be taken, so the run fails before its take; the
    worker must still wait about its backoff (0.25-0.5 s) between tries."""
    stores = _mem()
    agent = _step_agent()
    runner = _runner(stores, Steps())
    await runner.submit(agent, "go r1", tenant=T, run_id="r1")
    assert stores.work is not None

    async def refused(*args: Any, **kwargs: Any) -> Any:
        raise StoreUnavailableError("READONLY You can't write against a read only replica.")

    stores.leases.acquire = refused  # type: ignore[method-assign]
    stores.work.want = refused  # type: ignore[method-assign]
    worker = Worker(runner, [agent], poll_interval=0.05, backoff=Backoff(base=0.5, cap=5.0))
    task = asyncio.create_task(worker.run())
    await asyncio.sleep(1.0)
    worker.drain()
    await asyncio.wait_for(task, 10)
    assert len(worker.carried) <= 10, f"taken {len(worker.carried)} times in 1 s"


# --- deaths, drains and innocent neighbours ----------------------------------------------------


class _Process:
    """One worker process of the simulation: it dies when the poison run kills it."""

    def __init__(self) -> None:
        self.healthy_steps = 0
        self.mid = asyncio.Event()  # the healthy run is in its second step here
        self.dying = asyncio.Event()
        self.worker: Worker | None = None


async def test_a_healthy_run_carried_beside_a_poison_run_is_not_parked_with_it() -> None:
    """Each round is one worker process carrying two runs. 'poison' kills the process (a
    native crash: SimulatedCrash, leases left to lapse) once 'healthy' has finished a step
    in it and is inside the next. With max_attempts=3, 'poison' is parked; 'healthy' made
    progress every time and must go on to its end."""
    stores = _mem()
    now = {"proc": _Process()}

    async def hook(run_id: str, n: int) -> None:
        proc = now["proc"]
        if run_id != "healthy":
            return
        proc.healthy_steps += 1
        if proc.healthy_steps >= 2:  # one step done in this process; inside the next
            proc.mid.set()
            with contextlib.suppress(TimeoutError):  # once 'poison' is parked, none dies
                await asyncio.wait_for(proc.dying.wait(), 1)
            if proc.dying.is_set():
                raise SimulatedCrash("the process died under this run")

    class Model(Steps):
        async def complete(self, request: Any) -> Any:
            if _run_of(request) != "poison":
                return await super().complete(request)
            self.calls["poison"] += 1
            proc = now["proc"]
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(proc.mid.wait(), 1)
            assert proc.worker is not None
            proc.worker.drain()  # a dead process takes nothing more
            proc.dying.set()
            raise SimulatedCrash("a native library crashed the process")

    agent = _step_agent(hook)
    model = Model(steps=6)
    await _runner(stores, model).submit(agent, "go healthy", tenant=T, run_id="healthy")
    await _runner(stores, model).submit(agent, "go poison", tenant=T, run_id="poison")
    ttl = 0.3
    for _ in range(7):
        if await _entry(stores, "healthy") is None:  # finished (done: no entry listed)
            break
        proc = now["proc"] = _Process()
        proc.worker = Worker(
            _runner(stores, model, ttl=ttl),
            [agent],
            concurrency=2,
            poll_interval=0.01,
            max_attempts=3,
            backoff=FAST,
            exit_when_idle=True,
        )
        with contextlib.suppress(BaseException):
            await asyncio.wait_for(proc.worker.run(), 10)
        await asyncio.sleep(ttl + 0.05)  # the dead process's leases lapse
    assert [i.run_id for i in await _parked(stores)] == ["poison"]
    healthy = await Checkpointer.from_stores(stores).latest(T, "healthy")
    assert healthy is not None and healthy.status is CheckpointStatus.completed


@pytest.mark.parametrize("backend", ["memory", *BACKENDS])
async def test_a_run_that_moved_on_once_and_then_dies_in_one_place_is_still_parked(
    backend: str, tmp_path: Path
) -> None:
    """The count starts again only on a new frontier: a run whose third step kills each
    process carrying it moved on in the first take (two steps), never after. It is parked
    after max_attempts, and the step that kills it was tried exactly max_attempts times."""
    async with contextlib.AsyncExitStack() as stack:
        stores = (
            _mem()
            if backend == "memory"
            else await stack.enter_async_context(_real(backend, tmp_path))
        )
        deaths: list[int] = []
        now: dict[str, Worker | None] = {"worker": None}

        async def hook(run_id: str, n: int) -> None:
            if n == 2:
                deaths.append(n)
                assert now["worker"] is not None
                now["worker"].drain()  # a dead process takes nothing more
                raise SimulatedCrash("the process died in step 2")

        agent = _step_agent(hook)
        model = Steps(steps=4)
        await _runner(stores, model).submit(agent, "go r1", tenant=T, run_id="r1")
        ttl = 0.3
        for _ in range(6):
            entry = await _entry(stores, "r1")
            if entry is None or entry.state is WorkState.parked:
                break
            worker = now["worker"] = Worker(
                _runner(stores, model, ttl=ttl),
                [agent],
                poll_interval=0.01,
                max_attempts=3,
                backoff=FAST,
                exit_when_idle=True,
            )
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(worker.run(), 10)
            await asyncio.sleep(ttl + 0.05)  # the dead process's lease lapses
        assert [i.run_id for i in await _parked(stores)] == ["r1"]
        assert "taken 3 times" in (await _parked(stores))[0].reason
        assert deaths == [2, 2, 2]


async def test_a_run_drained_inside_a_long_tool_by_many_deploys_is_never_parked_for_it() -> None:
    stores = _mem()
    inside = asyncio.Event()

    async def hook(run_id: str, n: int) -> None:
        inside.set()
        await asyncio.sleep(30)  # a long read-only search, longer than drain_timeout

    agent = _step_agent(hook)
    model = Steps(steps=1)
    await _runner(stores, model).submit(agent, "go r1", tenant=T, run_id="r1")
    for _ in range(4):  # four deploys
        inside.clear()
        worker = Worker(
            _runner(stores, model),
            [agent],
            poll_interval=0.01,
            max_attempts=2,
            backoff=FAST,
            drain_timeout=0.05,
        )
        task = asyncio.create_task(worker.run())
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(inside.wait(), 2)
        worker.drain()  # SIGTERM
        await asyncio.wait_for(task, 10)
    assert await _parked(stores) == []


@pytest.mark.parametrize("backend", BACKENDS)
async def test_a_run_drained_at_a_boundary_many_times_is_never_parked(
    backend: str, tmp_path: Path
) -> None:
    """Each take counts one; each drain that stops the run at a boundary gives it back
    (count=-1 through each backend's SQL or Lua): three drains with max_attempts=2, then
    a worker carries it to its end."""
    async with _real(backend, tmp_path) as stores:
        started, gate = asyncio.Event(), asyncio.Event()
        gated = {"on": True}

        async def hook(run_id: str, n: int) -> None:
            started.set()
            if gated["on"]:
                await gate.wait()

        agent = _step_agent(hook)
        model = Steps(steps=4)
        await _runner(stores, model).submit(agent, "go r1", tenant=T, run_id="r1")
        for _ in range(3):
            started.clear()
            gate.clear()
            worker = Worker(
                _runner(stores, model), [agent], poll_interval=0.01, max_attempts=2, backoff=FAST
            )
            task = asyncio.create_task(worker.run())
            await asyncio.wait_for(started.wait(), 10)
            assert (await _entry(stores, "r1")).attempts == 1  # counted while carried
            worker.drain()
            gate.set()
            await asyncio.wait_for(task, 10)
            assert [how for _, how in worker.carried] == [Carried.stopped]
            back = await _entry(stores, "r1")
            assert (back.state, back.attempts) == (WorkState.wanted, 0)
        gated["on"] = False
        last = Worker(
            _runner(stores, model), [agent], poll_interval=0.01, max_attempts=2, exit_when_idle=True
        )
        await asyncio.wait_for(last.run(), 20)
        assert [how for _, how in last.carried] == [Carried.finished]
        assert await _parked(stores) == []


class _Barrier:
    """A work index whose first ``due`` answers each worker only once both have asked: the
    two workers take the same snapshot of one due run."""

    def __init__(self, inner: Any, parties: int) -> None:
        self._inner = inner
        self._arrived = 0
        self._parties = parties
        self._all = asyncio.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def due(self, *, limit: int, agents: Any = None) -> Any:
        items = await self._inner.due(limit=limit, agents=agents)
        if not self._all.is_set():
            self._arrived += 1
            if self._arrived >= self._parties:
                self._all.set()
            await asyncio.wait_for(self._all.wait(), 10)
        return items


@pytest.mark.parametrize("backend", BACKENDS)
async def test_two_workers_racing_over_one_due_run_count_one_take_and_carry_it_once(
    backend: str, tmp_path: Path
) -> None:
    async with _real(backend, tmp_path) as stores:
        started, gate = asyncio.Event(), asyncio.Event()
        runs: Counter[int] = Counter()

        async def hook(run_id: str, n: int) -> None:
            runs[n] += 1
            started.set()
            await gate.wait()

        agent = _step_agent(hook)
        model = Steps(steps=2)
        await _runner(stores, model).submit(agent, "go r1", tenant=T, run_id="r1")
        barrier = _Barrier(stores.work, 2)
        workers = []
        for name in ("w1", "w2"):
            runner = _runner(stores, model, worker=name)
            runner.work = barrier  # type: ignore[assignment]
            workers.append(Worker(runner, [agent], poll_interval=0.01, backoff=FAST))
        tasks = [asyncio.create_task(w.run()) for w in workers]
        try:
            await asyncio.wait_for(started.wait(), 10)
            await asyncio.sleep(0.3)  # the loser's refused take has landed
            carried = await _entry(stores, "r1")
            assert (carried.state, carried.attempts) == (WorkState.wanted, 1)
            gate.set()
            await _until(lambda: _no_entry(stores, "r1"), 20, "never finished")
        finally:
            gate.set()
            for w in workers:
                w.drain()
            await asyncio.wait_for(asyncio.gather(*tasks), 20)
        hows = sorted(str(how) for w in workers for _, how in w.carried)
        assert hows == ["elsewhere", "finished"], hows
        assert runs == {0: 1, 1: 1}  # each step ran once: one carrier
        assert model.calls["r1"] == 3


async def _no_entry(stores: Stores, run_id: str) -> bool:
    return await _entry(stores, run_id) is None


@pytest.mark.parametrize("backend", BACKENDS)
async def test_the_count_restarts_after_done_and_an_operators_wake_and_a_park_keeps_it(
    backend: str, tmp_path: Path
) -> None:
    async with _real(backend, tmp_path) as stores:
        work = stores.work
        assert work is not None
        await work.submit(T, "r", agent="a", input=b"in")
        for _ in range(3):
            await work.want(T, "r", agent="a", count=1)  # three takes
        await work.done(T, "r")  # waiting on a person
        await work.want(T, "r", agent="a", state=WorkState.decided)  # approved
        assert (await _entry(stores, "r")).attempts == 0
        await work.want(T, "r", agent="a", count=1)  # the worker's take
        await work.want(T, "r", agent="a", count=1)  # and another (its carrier died)
        await work.park(T, "r", agent="a", reason="taken 2 times")
        parked = await _entry(stores, "r")
        assert (parked.state, parked.attempts, parked.reason) == (
            WorkState.parked,
            2,
            "taken 2 times",
        )
        assert await work.due(limit=10) == []
        await work.want(T, "r", agent="a")  # an operator's resolve: unparked
        woken = await _entry(stores, "r")
        assert (woken.state, woken.attempts, woken.not_before) == (WorkState.wanted, 0, None)
        await work.want(T, "r", agent="a", count=-1)  # a stray give-back: never below 0
        await work.want(T, "r", agent="a", count=1)
        assert (await _entry(stores, "r")).attempts == 1
        assert await work.input(T, "r") == b"in"


@pytest.mark.redis
async def test_a_resent_want_with_a_count_counts_once_on_redis(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reply lost on the way back: the same call (same token) sent again must not count
    the take twice."""
    from tesserix_adk.adapters.redis import work as redis_work

    async with _real("redis", tmp_path) as stores:
        work = stores.work
        assert work is not None
        await work.want(T, "r", agent="a", count=1)
        monkeypatch.setattr(redis_work.secrets, "token_hex", lambda n=None: "f" * 16)
        await work.want(T, "r", agent="a", count=1)
        await work.want(T, "r", agent="a", count=1)  # the resend
        assert (await _entry(stores, "r")).attempts == 2
        monkeypatch.undo()
        await work.want(T, "r", agent="a", count=-1)
        assert (await _entry(stores, "r")).attempts == 1


# --- the operator's side: runs --stuck, resolve, run --resume ----------------------------------

AGENT_MODULE = '''
"""The agent of tests/test_attacks_attempts.py's operator tests."""
from collections import Counter
from typing import Any

from tesserix_adk import Agent, ProviderError, tool
from tesserix_adk.messages import Message, Role, ToolCall
from tesserix_adk.providers import ModelResponse
from tesserix_adk.testing.faults import SimulatedCrash

CALLS: Counter = Counter()
EFFECTS: list = []
MODE = {"fail_after_step": False, "crash_in_step": 0, "crash_in_book": False}


class Model:
    async def complete(self, request: Any) -> Any:
        CALLS["model"] += 1
        done = sum(1 for m in request.messages if m.role is Role.tool)
        if MODE["fail_after_step"] and done >= 1:
            raise ProviderError("the model is unreachable", retryable=True, status_code=503)
        if done == 0:
            call = ToolCall(id="call_step", name="step", arguments={"n": 0})
        elif done == 1:
            call = ToolCall(id="call_book", name="book", arguments={"flight": "LH1"})
        else:
            return ModelResponse(message=Message(Role.assistant, "booked"))
        return ModelResponse(message=Message(Role.assistant, "", tool_calls=[call]))


provider = Model()


@tool(side_effects=False)
def step(n: int) -> dict:
    """A read-only step."""
    if MODE["crash_in_step"]:
        MODE["crash_in_step"] -= 1
        raise SimulatedCrash("the process died in a read-only step")
    return {"n": n}


@tool
def book(flight: str, ctx: Any) -> dict:
    """Book a seat."""
    EFFECTS.append(ctx.idempotency_key)
    if MODE["crash_in_book"]:
        MODE["crash_in_book"] = False
        raise SimulatedCrash("the process died after the booking went out")
    return {"booking": "B1"}


agent = Agent("att", "Book.", [step, book])
'''

MODULE = "att_attempts_agent"
TTL = 0.3


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    (tmp_path / f"{MODULE}.py").write_text(AGENT_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, MODULE, raising=False)
    import importlib

    mod = importlib.import_module(MODULE)
    mod.MODE.update(fail_after_step=False, crash_in_step=0, crash_in_book=False)
    mod.CALLS.clear()
    mod.EFFECTS.clear()
    url = f"sqlite:///{tmp_path / 'adk.sqlite3'}"
    yield url, mod
    monkeypatch.delitem(sys.modules, MODULE, raising=False)


def _cli(url: str, *args: str) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = tesserix([*args, "--store", url])
    return code, out.getvalue()


def _on(url: str, fn: Callable[[Stores], Any]) -> Any:
    async def go() -> Any:
        async with open_stores(url) as stores:
            await stores.create_schema()
            return await fn(stores)

    return asyncio.run(go())


def _worker(stores: Stores, mod: Any, **kw: Any) -> Worker:
    return Worker(
        _runner(stores, mod.provider, ttl=TTL),
        [mod.agent],
        poll_interval=0.01,
        backoff=FAST,
        **kw,
    )


def test_a_run_whose_carrier_dies_at_every_take_is_parked_listed_as_stuck_and_others_go_on(
    site: Any,
) -> None:
    """'poison' dies in its read-only step at each of three takes (its carrier is gone each
    time: nobody lives to count a failure). The next worker parks it without taking it,
    saying so, while run 'ok' finishes; `tesserix runs --stuck` lists it with its reason.
    (A worker counts its own takes as they begin; each crash here stands for a worker
    process killed after it counted, as tests/test_attacks_worker_recovery.py does with
    real processes: carrying a run in-process with runner.run/resume counts nothing.)"""
    url, mod = site

    async def go(stores: Stores) -> Worker:
        runner = _runner(stores, mod.provider, ttl=TTL)
        await runner.submit(mod.agent, "book ok", tenant=T, run_id="ok")
        assert stores.work is not None
        mod.MODE["crash_in_step"] = 3
        await stores.work.want(T, "poison", agent=mod.agent.name, count=1)
        with pytest.raises(SimulatedCrash):
            await runner.run(mod.agent, "book poison", tenant=T, run_id="poison")
        for _ in range(2):
            await asyncio.sleep(TTL + 0.05)
            await stores.work.want(T, "poison", agent=mod.agent.name, count=1)
            with pytest.raises(SimulatedCrash):
                await runner.resume(mod.agent, "poison", tenant=T)
        await asyncio.sleep(TTL + 0.05)
        assert (await _entry(stores, "poison")).attempts == 3
        calls = mod.CALLS["model"]
        worker = _worker(stores, mod, max_attempts=3, exit_when_idle=True)
        await asyncio.wait_for(worker.run(), 20)
        assert mod.CALLS["model"] - calls == 3  # only 'ok' was asked: step, book, answer
        return worker

    worker = _on(url, go)
    assert sorted((i.run_id, str(h)) for i, h in worker.carried) == [
        ("ok", "finished"),
        ("poison", "parked"),
    ]
    code, out = _cli(url, "runs", "--tenant", T, "--stuck", "--json")
    assert code == 0, out
    (row,) = json.loads(out)["runs"]
    assert row["run_id"] == "poison"
    assert row["parked"].startswith("taken 3 times without finishing")


def test_an_operator_resolve_starts_the_count_again_and_the_call_is_not_sent_again(
    site: Any,
) -> None:
    url, mod = site

    async def in_doubt(stores: Stores) -> str:
        runner = _runner(stores, mod.provider, ttl=TTL)
        mod.MODE.update(crash_in_step=1, crash_in_book=True)
        with pytest.raises(SimulatedCrash):  # died in the step
            await runner.run(mod.agent, "book r1", tenant=T, run_id="r1")
        await asyncio.sleep(TTL + 0.05)
        with pytest.raises(SimulatedCrash):  # died after the booking went out
            await runner.resume(mod.agent, "r1", tenant=T)
        await asyncio.sleep(TTL + 0.05)
        worker = _worker(stores, mod, max_attempts=3, exit_when_idle=True)
        await asyncio.wait_for(worker.run(), 20)
        (parked,) = await _parked(stores)
        # The worker's take counted; the in-process carriers that died count nothing.
        assert parked.attempts == 1 and "IndeterminateToolCallError" in parked.reason
        (record,) = [r for r in await stores.idempotency.records(T, "r1") if r.tool == "book"]
        return str(record.call_id)

    call_id = _on(url, in_doubt)
    code, out = _cli(
        url, "resolve", "r1", "--tenant", T, "--call", call_id,
        "--outcome", '{"booking": "B1"}', "--by", "ops",
    )  # fmt: skip
    assert code == 0, out

    async def carried_on(stores: Stores) -> None:
        woken = await _entry(stores, "r1")
        assert (woken.state, woken.attempts) == (WorkState.wanted, 0)
        worker = _worker(stores, mod, max_attempts=3, exit_when_idle=True)
        await asyncio.wait_for(worker.run(), 20)
        assert [str(h) for _, h in worker.carried] == ["finished"]

    _on(url, carried_on)
    assert len(mod.EFFECTS) == 1  # the booking resolved by the operator was not sent again


def test_an_operators_resume_of_a_run_parked_after_max_attempts_starts_its_count_again(
    site: Any,
) -> None:
    url, mod = site

    async def parked_after_failures(stores: Stores) -> None:
        await _runner(stores, mod.provider).submit(mod.agent, "book r1", tenant=T, run_id="r1")
        mod.MODE["fail_after_step"] = True  # the model goes down after the first step
        parked = await _work_until_parked(stores, _worker(stores, mod, max_attempts=3))
        assert parked.reason.startswith("failed 3 times, last ProviderError")

    _on(url, parked_after_failures)
    code, out = _cli(url, "runs", "--tenant", T, "--stuck", "--json")
    assert code == 0 and json.loads(out)["runs"][0]["parked"].startswith("failed 3 times")
    # The on-call engineer tries it by hand; the model is still down.
    code, out = _cli(
        url, "run", "--resume", "r1", "--tenant", T,
        "--agent", f"{MODULE}:agent", "--provider", f"{MODULE}:provider",
    )  # fmt: skip
    assert code != 0, out
    mod.MODE["fail_after_step"] = False  # the model is back

    async def carried(stores: Stores) -> list[str]:
        worker = _worker(stores, mod, max_attempts=3, exit_when_idle=True)
        await asyncio.wait_for(worker.run(), 20)
        return [str(h) for _, h in worker.carried]

    assert _on(url, carried) == ["finished"]
