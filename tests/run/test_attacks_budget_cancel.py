"""An attacker's tries at the money and stopping promises: the budget (the ledger is the
authority, a run never spends past its budget, across crashes and resumes), cancel (a
cancelled run sends nothing more) and ``max_iterations``.

Seven defects were found. Six are fixed and their tests pass now: a cancel asked while the
model thought did not stop the calls it answered with; a negative cost lowered the ledger
and switched the budget off; NaN did on memory; NaN, inf and 2**70 were paid uncharged and
retried as "ledger unreachable"; SQLite charged 0.9 micros as 0; a replay started with a
fresh budget. The seventh stays a strict xfail, as documented (README, the write groups'
crash windows): a process killed between the model's answer and its charge leaves that
call uncharged. Everything that held is an ordinary test.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from processes import store_url
from tesserix_adk import (
    Agent,
    AgentRunner,
    Checkpointer,
    ModelRequest,
    ModelResponse,
    RunStatus,
    ScriptedProvider,
    ScriptedTurn,
    ToolContext,
    open_stores,
    tool,
)
from tesserix_adk.errors import AdkError
from tesserix_adk.stores.bundle import Stores

T = "acme"

DURABLE = [
    pytest.param("sqlite", id="sqlite"),
    pytest.param("redis", id="redis", marks=pytest.mark.redis),
    pytest.param("postgres", id="postgres", marks=pytest.mark.postgres),
]
ALL = [pytest.param("memory", id="memory"), *DURABLE]


@asynccontextmanager
async def _opened(backend: str, tmp: Path) -> AsyncIterator[Stores]:
    """Fresh stores on ``backend`` (schema applied), removed afterwards."""
    if backend == "memory":
        async with open_stores("memory://") as stores:
            yield stores
        return
    async with store_url(backend, tmp) as url, open_stores(url) as stores:
        await stores.create_schema()
        yield stores


class Counting:
    """A provider that counts the model calls it answered (each one is paid)."""

    def __init__(self, turns: list[Any]) -> None:
        self.inner = ScriptedProvider(turns)
        self.calls = 0

    async def complete(self, request: ModelRequest) -> ModelResponse:
        response: ModelResponse = await self.inner.complete(request)
        self.calls += 1
        return response


@tool(side_effects=False)
def look(q: str) -> str:
    """Look something up (read-only)."""
    return f"seen {q}"


def _looks(costs: list[Any]) -> list[Any]:
    """One ``look`` per turn, each turn costing what ``costs`` says, then the answer."""
    return [
        *(
            ScriptedTurn(calls=[("look", {"q": str(i)})], cost_micros=c)
            for i, c in enumerate(costs)
        ),
        "done",
    ]


# =========================================================================================
# Budget: what a provider reports
# =========================================================================================


@pytest.mark.parametrize("backend", ALL)
async def test_a_negative_cost_never_lowers_the_spend(backend: str, tmp_path: Path) -> None:
    # 60 a call, except one answer claiming -1000: with budget 100 the run must stop after at
    # most a few calls, and the ledger must never go below what was paid before.
    provider = Counting(_looks([60, -1000, *[60] * 10]))
    agent = Agent("spender", "Look.", [look], budget_micros=100, max_iterations=10)
    async with _opened(backend, tmp_path) as stores:
        run = await AgentRunner.from_stores(provider, stores).run(
            agent, "go", tenant=T, run_id="neg"
        )
        spent = await stores.ledger.spent(T, "neg")
    # Was: 10 model calls (max_iterations), 9 x 60 micros paid, ledger at -460. Now the
    # cost is refused (a provider reporting a refund is broken): the run fails at once.
    assert spent == 60
    assert run.status is RunStatus.failed and "-1000" in (run.output or "")
    assert provider.calls == 2


async def test_a_nan_cost_does_not_switch_the_budget_off(tmp_path: Path) -> None:
    provider = Counting(_looks([float("nan"), *[60] * 10]))
    agent = Agent("spender", "Look.", [look], budget_micros=100, max_iterations=10)
    async with _opened("memory", tmp_path) as stores:
        try:
            run = await AgentRunner.from_stores(provider, stores).run(
                agent, "go", tenant=T, run_id="nan"
            )
        except AdkError:
            return  # refusing the cost outright would be fine
        spent = await stores.ledger.spent(T, "nan")
    # Was: max_iterations after 10 model calls, spent NaN. Now refused: the run fails.
    assert not math.isnan(spent)
    assert run.status is RunStatus.failed
    assert provider.calls == 1


@pytest.mark.parametrize(
    ("backend", "cost"),
    [
        pytest.param("sqlite", float("nan"), id="sqlite-nan"),
        pytest.param("sqlite", float("inf"), id="sqlite-inf"),
        pytest.param("sqlite", 2**70, id="sqlite-huge"),
        pytest.param("redis", float("nan"), id="redis-nan", marks=pytest.mark.redis),
        pytest.param("postgres", float("nan"), id="postgres-nan", marks=pytest.mark.postgres),
    ],
)
async def test_an_unchargeable_cost_is_not_retried_uncharged(
    backend: str, cost: Any, tmp_path: Path
) -> None:
    agent = Agent("spender", "Look.", [look], budget_micros=1_000, max_iterations=10)
    turns = _looks([10, cost, 10])
    provider = Counting(turns)
    retryable = []
    async with _opened(backend, tmp_path) as stores:
        # What a worker does with a retryable error: carry the run on again (3 tries here).
        starter = AgentRunner.from_stores(provider, stores)
        for attempt in range(3):
            try:
                if attempt == 0:
                    await starter.run(agent, "go", tenant=T, run_id="odd")
                else:
                    await AgentRunner.from_stores(provider, stores).resume(agent, "odd", tenant=T)
                break
            except AdkError as exc:
                retryable.append(exc.retryable)
                if not exc.retryable:
                    break
        charged = await stores.ledger.spent(T, "odd")
    # Was: 4 model calls answered (1 + 3 tries of the odd one), 10 micros charged, and every
    # error said "retry": the ledger is unreachable. Now the cost is refused where it is
    # read: the run ends failed, nothing to retry, one uncharged call and no more.
    assert retryable == [] and provider.calls == 2 and charged == 10, (
        provider.calls,
        charged,
        retryable,
    )


async def test_a_fractional_cost_is_never_charged_less_than_the_run_counted(
    tmp_path: Path,
) -> None:
    provider = Counting(_looks([0.9] * 10))
    agent = Agent("spender", "Look.", [look], budget_micros=5, max_iterations=10)
    async with _opened("sqlite", tmp_path) as stores:
        run = await AgentRunner.from_stores(provider, stores).run(
            agent, "go", tenant=T, run_id="frac"
        )
        charged = await stores.ledger.spent(T, "frac")
    # Today: run.spent_micros == 5.4 (6 model calls), ledger 0.
    assert charged >= run.spent_micros


# =========================================================================================
# Budget: crashes, resumes, replays, parallel calls, approvals
# =========================================================================================

_CHILD = textwrap.dedent(
    '''
    """A worker whose ledger stalls on its second charge: the process is killed there."""
    import asyncio, os, sys

    from tesserix_adk import (
        Agent, AgentRunner, Checkpointer, LeasePolicy, ScriptedProvider, ScriptedTurn,
        open_stores, tool,
    )

    url, marks = sys.argv[1], sys.argv[2]

    @tool(side_effects=False)
    def look(q: str) -> str:
        """Look something up (read-only)."""
        return "seen " + q

    TURNS = [ScriptedTurn(calls=[("look", {"q": str(i)})], cost_micros=60) for i in range(5)]
    TURNS.append("done")

    class Counting:
        def __init__(self):
            self.inner = ScriptedProvider(TURNS)

        async def complete(self, request):
            response = await self.inner.complete(request)
            with open(os.path.join(marks, "answered"), "a") as f:
                f.write("1\\n")
            return response

    class StallingLedger:
        """The real ledger, slow to answer its second charge (a remote store's latency)."""

        def __init__(self, inner):
            self.inner, self.charges = inner, 0

        async def charge(self, tenant, run_id, micros, usage, *, fence=None):
            self.charges += 1
            if self.charges == 2:
                open(os.path.join(marks, "charging"), "w").close()
                await asyncio.sleep(120)
            await self.inner.charge(tenant, run_id, micros, usage, fence=fence)

        async def spent(self, tenant, run_id):
            return await self.inner.spent(tenant, run_id)

        async def usage(self, tenant, run_id):
            return await self.inner.usage(tenant, run_id)

        async def seal(self, tenant, run_id, fence):
            await self.inner.seal(tenant, run_id, fence)

    async def main():
        async with open_stores(url) as stores:
            runner = AgentRunner(
                Counting(),
                idempotency=stores.idempotency,
                checkpoints=Checkpointer.from_stores(stores),
                leases=stores.leases,
                ledger=StallingLedger(stores.ledger),
                approvals=stores.approvals,
                lease_policy=LeasePolicy(ttl=1, renew_within=0.5),
            )
            agent = Agent("spender", "Look.", [look], budget_micros=100, max_iterations=10)
            await runner.run(agent, "go", tenant="acme", run_id="killed")

    asyncio.run(main())
    '''
)


def _child(script: Path, url: str, marks: Path) -> subprocess.Popen[str]:
    """The worker process of ``script`` on ``url``, leaving its marks in ``marks``."""
    return subprocess.Popen(
        [sys.executable, str(script), url, str(marks)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.xfail(
    strict=True,
    reason="SIGKILL between the model's answer and its charge: that paid model call is never "
    "charged, the resume asks again, and the run spends a model call past its budget "
    "(the window README's group_writes table mentions)",
)
@pytest.mark.skipif(os.name != "posix", reason="needs POSIX signals")
async def test_a_model_call_answered_before_a_sigkill_is_charged(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'adk.sqlite3'}"
    async with open_stores(url) as stores:
        await stores.create_schema()
    script = tmp_path / "child.py"
    script.write_text(_CHILD)
    marks = tmp_path / "marks"
    marks.mkdir()
    proc = _child(script, url, marks)
    deadline = time.monotonic() + 30
    while not (marks / "charging").exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            _, err = proc.communicate(timeout=10)
            raise AssertionError(f"the worker never reached its second charge: {err}")
        await asyncio.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=10)
    assert proc.returncode == -signal.SIGKILL
    answered_before = len((marks / "answered").read_text().splitlines())
    assert answered_before == 2  # the second answer is in; its charge never landed

    provider = Counting(_looks([60] * 5))
    agent = Agent("spender", "Look.", [look], budget_micros=100, max_iterations=10)
    async with open_stores(url) as stores:
        deadline = time.monotonic() + 10
        while await stores.leases.current(T, "killed") is not None:
            assert time.monotonic() < deadline, "the dead worker's lease never lapsed"
            await asyncio.sleep(0.05)
        run = await AgentRunner.from_stores(provider, stores).resume(agent, "killed", tenant=T)
        charged = await stores.ledger.spent(T, "killed")
    assert run.status is RunStatus.budget_exhausted
    paid = 60 * (answered_before + provider.calls)
    # Today: 3 model calls answered (180 micros), the ledger holds 120; budget 100 allowed 2.
    assert charged == paid, (charged, paid)


async def test_a_replay_does_not_get_a_fresh_budget(tmp_path: Path) -> None:
    agent = Agent("spender", "Look.", [look], budget_micros=100, max_iterations=10)
    async with _opened("sqlite", tmp_path) as stores:
        run = await AgentRunner.from_stores(Counting(_looks([60] * 6)), stores).run(
            agent, "go", tenant=T, run_id="orig"
        )
        assert run.status is RunStatus.budget_exhausted and run.spent_micros == 120
        first = await Checkpointer.from_stores(stores).at(T, "orig", 1)
        assert first is not None and first.micros == 60  # one model call paid at step 1
        provider = Counting(_looks([60] * 6))
        replayed = await AgentRunner.from_stores(provider, stores).replay(
            agent, "orig", tenant=T, from_step=1, stubs={}
        )
    # From step 1 (60 of 100 spent) the budget allows one more model call, as in the original.
    # Was: the replay made 2 (spent_micros 120 on its own ledger, 180 for the conversation).
    assert provider.calls <= 1, (provider.calls, replayed.spent_micros)
    # It reports what it spent itself (its ledger's figure, which every view shows), while its
    # budget counted the step's 60 too.
    assert replayed.status is RunStatus.budget_exhausted and replayed.spent_micros == 60


@pytest.mark.parametrize("backend", ALL)
async def test_parallel_calls_and_resumes_charge_each_model_call_once(
    backend: str, tmp_path: Path
) -> None:
    """Four calls at once per turn, a crash-free stop on a retryable error mid-run, then a
    resume: the ledger holds exactly what the answered model calls cost, and the budget
    stops the run at the first boundary past it."""
    gate = {"fail": True}

    @tool
    async def step(n: int, ctx: ToolContext) -> int:
        """A side-effecting step."""
        await asyncio.sleep(0.001 * n)
        return n

    turn = [("step", {"n": n}) for n in range(4)]
    turns = [ScriptedTurn(calls=turn, cost_micros=40) for _ in range(6)] + ["done"]

    class Flaky(Counting):
        async def complete(self, request: ModelRequest) -> ModelResponse:
            if len(request.messages) > 6 and gate["fail"]:
                gate["fail"] = False
                from tesserix_adk.errors import ProviderError

                raise ProviderError("429", retryable=True)
            return await super().complete(request)

    provider = Flaky(turns)
    agent = Agent("par", "Step.", [step], budget_micros=100, parallel_tool_calls=4)
    async with _opened(backend, tmp_path) as stores:
        with pytest.raises(AdkError):
            await AgentRunner.from_stores(provider, stores).run(agent, "go", tenant=T, run_id="p")
        run = await AgentRunner.from_stores(provider, stores).resume(agent, "p", tenant=T)
        charged = await stores.ledger.spent(T, "p")
        again = await AgentRunner.from_stores(provider, stores).resume(agent, "p", tenant=T)
    assert run.status is RunStatus.budget_exhausted
    assert provider.calls == 3  # 40, 80, 120: stopped before a fourth
    assert charged == 40 * provider.calls == run.spent_micros
    assert again.status is RunStatus.budget_exhausted and provider.calls == 3


async def test_a_budget_exhausted_run_resumed_by_a_richer_agent_spends_nothing(
    tmp_path: Path,
) -> None:
    """The budget is not in the revision, so a resume may come with a larger one: a run that
    already ended on its budget stays ended, asks no model and charges nothing."""
    async with _opened("sqlite", tmp_path) as stores:
        poor = Agent("spender", "Look.", [look], budget_micros=100)
        run = await AgentRunner.from_stores(Counting(_looks([60] * 6)), stores).run(
            poor, "go", tenant=T, run_id="b"
        )
        assert run.status is RunStatus.budget_exhausted
        rich = Agent("spender", "Look.", [look], budget_micros=10_000)
        provider = Counting(_looks([60] * 6))
        again = await AgentRunner.from_stores(provider, stores).resume(rich, "b", tenant=T)
        assert again.status is RunStatus.budget_exhausted
        assert provider.calls == 0 and await stores.ledger.spent(T, "b") == 120


async def test_approvals_neither_reset_the_budget_nor_the_iterations(tmp_path: Path) -> None:
    """Every turn waits on a person; each approve or deny is a new attempt. The spend comes
    from the ledger each time, and the iterations from the frontier."""
    sent: list[str] = []

    @tool(requires_approval=True)
    def pay(amount: int) -> str:
        """Pay."""
        sent.append(str(amount))
        return "paid"

    for approve, budget, limit in ((True, 10_000, 3), (False, 100, 10)):
        sent.clear()
        turns = [ScriptedTurn(calls=[("pay", {"amount": i})], cost_micros=40) for i in range(12)]
        agent = Agent("payer", "Pay.", [pay], budget_micros=budget, max_iterations=limit)
        async with _opened("sqlite", tmp_path / str(approve)) as stores:
            provider = Counting([*turns, "done"])
            run = await AgentRunner.from_stores(provider, stores).run(
                agent, "go", tenant=T, run_id="a"
            )
            for _ in range(20):
                if run.status is not RunStatus.waiting_approval:
                    break
                assert run.pending_approval is not None
                await stores.approvals.decide(T, run.pending_approval.id, approved=approve, by="x")
                run = await AgentRunner.from_stores(provider, stores).resume(agent, "a", tenant=T)
            charged = await stores.ledger.spent(T, "a")
        if approve:
            assert run.status is RunStatus.max_iterations and provider.calls == 3
            assert sent == ["0", "1", "2"]
        else:
            assert run.status is RunStatus.budget_exhausted and provider.calls == 3
            assert sent == []
        assert charged == 40 * provider.calls


async def test_a_replay_keeps_max_iterations(tmp_path: Path) -> None:
    agent = Agent("spender", "Look.", [look], max_iterations=3)
    async with _opened("sqlite", tmp_path) as stores:
        run = await AgentRunner.from_stores(Counting(_looks([1] * 8)), stores).run(
            agent, "go", tenant=T, run_id="m"
        )
        assert run.status is RunStatus.max_iterations
        provider = Counting(_looks([1] * 8))
        replayed = await AgentRunner.from_stores(provider, stores).replay(
            agent, "m", tenant=T, from_step=3, stubs={}
        )
        again = await AgentRunner.from_stores(provider, stores).resume(agent, "m", tenant=T)
    assert replayed.status is RunStatus.max_iterations
    assert provider.calls == 1  # step 3 is iteration 1's answer: only iteration 2 is left
    assert again.status is RunStatus.max_iterations and provider.calls == 1


# =========================================================================================
# Cancel
# =========================================================================================


class _Booking:
    """A side-effecting tool that counts what reached the 'airline'."""

    def __init__(self) -> None:
        self.sent: list[str] = []
        self.inside = asyncio.Event()
        self.go = asyncio.Event()
        self.hold = False

        @tool
        async def book(flight: str) -> str:
            """Book a seat."""
            self.sent.append(flight)
            if self.hold:
                self.inside.set()
                await self.go.wait()
            return f"BK-{flight}"

        self.tool = book


class _Thinking:
    """A provider that takes its time: the test acts while the model is thinking."""

    def __init__(self, turns: list[Any]) -> None:
        self.inner = ScriptedProvider(turns)
        self.started = asyncio.Event()
        self.go = asyncio.Event()
        self.calls = 0

    async def complete(self, request: ModelRequest) -> ModelResponse:
        self.started.set()
        await self.go.wait()
        self.calls += 1
        response: ModelResponse = await self.inner.complete(request)
        return response


@pytest.mark.parametrize("backend", [pytest.param("memory", id="memory"), *DURABLE])
async def test_a_cancel_while_the_model_thinks_sends_nothing(backend: str, tmp_path: Path) -> None:
    airline = _Booking()
    agent = Agent("booker", "Book.", [airline.tool])
    provider = _Thinking([[("book", {"flight": "LH1"})], "done"])
    async with _opened(backend, tmp_path) as stores:
        running = asyncio.create_task(
            AgentRunner.from_stores(provider, stores).run(agent, "book", tenant=T, run_id="c")
        )
        await asyncio.wait_for(provider.started.wait(), 10)
        # Acknowledged: the live holder "ends it at its next boundary and sends nothing more".
        assert (
            await AgentRunner.from_stores(provider, stores).cancel(
                "c", tenant=T, by="ops", reason="customer left"
            )
            is None
        )
        provider.go.set()
        run = await asyncio.wait_for(running, 10)
    assert run.status is RunStatus.cancelled
    # Was: ["LH1"], booked after the cancel was recorded.
    assert airline.sent == []


@pytest.mark.parametrize("backend", [pytest.param("memory", id="memory"), *DURABLE])
async def test_a_cancel_while_the_model_thinks_ends_the_run_cancelled_whatever_it_answers(
    backend: str, tmp_path: Path
) -> None:
    """The cancel was acknowledged ("ends it at its next boundary"): the model's last answer
    arriving after it does not end the run completed (it had, found by an attack)."""
    agent = Agent("booker", "Book.", [_Booking().tool])
    provider = _Thinking(["All done, nothing booked."])
    async with _opened(backend, tmp_path) as stores:
        running = asyncio.create_task(
            AgentRunner.from_stores(provider, stores).run(agent, "book", tenant=T, run_id="c")
        )
        await asyncio.wait_for(provider.started.wait(), 10)
        other = AgentRunner.from_stores(provider, stores)
        assert await other.cancel("c", tenant=T, by="ops", reason="customer left") is None
        provider.go.set()
        run = await asyncio.wait_for(running, 10)
    assert run.status is RunStatus.cancelled
    assert run.output is not None and "ops" in run.output


@pytest.mark.parametrize("backend", ALL)
async def test_a_cancel_while_a_call_is_in_flight_records_it_and_asks_no_more(
    backend: str, tmp_path: Path
) -> None:
    airline = _Booking()
    airline.hold = True
    agent = Agent("booker", "Book.", [airline.tool])
    provider = Counting([[("book", {"flight": "LH1"})], [("book", {"flight": "LH2"})], "done"])
    async with _opened(backend, tmp_path) as stores:
        running = asyncio.create_task(
            AgentRunner.from_stores(provider, stores).run(agent, "book", tenant=T, run_id="c")
        )
        await asyncio.wait_for(airline.inside.wait(), 10)
        other = AgentRunner.from_stores(provider, stores)
        assert await other.cancel("c", tenant=T, by="ops") is None
        assert await other.cancel("c", tenant=T, by="mallory", reason="again") is None
        airline.go.set()
        run = await asyncio.wait_for(running, 10)
        assert run.status is RunStatus.cancelled and run.output == "cancelled by ops"
        records = [r for r in await stores.idempotency.records(T, "c") if r.tool == "book"]
        assert [r.status.value for r in records] == ["completed"]
        again = await AgentRunner.from_stores(provider, stores).resume(agent, "c", tenant=T)
        # Cancelling a finished run changes nothing.
        ended = await AgentRunner.from_stores(provider, stores).cancel("c", tenant=T, by="z")
        charged = await stores.ledger.spent(T, "c")
    assert again.status is RunStatus.cancelled
    assert ended is not None and ended.status is RunStatus.cancelled
    assert airline.sent == ["LH1"]
    assert provider.calls == 1 and charged == 0  # ScriptedTurn lists cost 0


async def test_a_task_cancelled_while_the_model_answers_is_still_charged(tmp_path: Path) -> None:
    """asyncio cancellation of the run right as the answer lands: the answer was paid, so
    the charge is made (shielded), nothing is sent, and the resume charges its own call."""
    airline = _Booking()
    agent = Agent("booker", "Book.", [airline.tool])
    turns = [ScriptedTurn(calls=[("book", {"flight": "LH1"})], cost_micros=50), "done"]

    class CancelsItself(Counting):
        async def complete(self, request: ModelRequest) -> ModelResponse:
            response = await super().complete(request)
            if self.calls == 1:
                task = asyncio.current_task()
                assert task is not None
                task.cancel()  # delivered at the runner's next await: the charge
            return response

    provider = CancelsItself(turns)
    async with _opened("sqlite", tmp_path) as stores:
        first = asyncio.create_task(
            AgentRunner.from_stores(provider, stores).run(agent, "b", tenant=T, run_id="k")
        )
        with pytest.raises(asyncio.CancelledError):
            await first
        assert await stores.ledger.spent(T, "k") == 50
        assert airline.sent == []
        second = await AgentRunner.from_stores(provider, stores).run(
            agent, "b", tenant=T, run_id="k"
        )
        assert second.status is RunStatus.completed
        charged = await stores.ledger.spent(T, "k")
    assert airline.sent == ["LH1"]
    assert provider.calls == 3 and charged == 100  # 50 + 50, and the final answer costs 0


async def test_a_cancel_for_another_tenants_run_touches_nothing(tmp_path: Path) -> None:
    airline = _Booking()
    agent = Agent("booker", "Book.", [airline.tool])
    async with _opened("sqlite", tmp_path) as stores:
        runner = AgentRunner.from_stores(
            ScriptedProvider([[("book", {"flight": "LH1"})], "done"]), stores
        )
        assert await runner.cancel("r", tenant="evil", by="mallory") is None
        run = await runner.run(agent, "book", tenant=T, run_id="r")
        assert run.status is RunStatus.completed
        # ... and the other way round: the real tenant's cancel does not end evil's run.
        await runner.cancel("r", tenant=T, by="ops")
        evil = await AgentRunner.from_stores(
            ScriptedProvider([[("book", {"flight": "EV1"})], "done"]), stores
        ).run(agent, "book", tenant="evil-2", run_id="r")
    assert evil.status is RunStatus.completed
    assert airline.sent == ["LH1", "EV1"]


async def test_cancel_while_waiting_for_approval_then_approve_and_resume_sends_nothing(
    tmp_path: Path,
) -> None:
    sent: list[str] = []

    @tool(requires_approval=True)
    def pay(amount: int) -> str:
        """Pay."""
        sent.append(str(amount))
        return "paid"

    agent = Agent("payer", "Pay.", [pay])
    provider = Counting([[("pay", {"amount": 5})], "done"])
    async with _opened("sqlite", tmp_path) as stores:
        run = await AgentRunner.from_stores(provider, stores).run(agent, "go", tenant=T, run_id="w")
        assert run.status is RunStatus.waiting_approval and run.pending_approval is not None
        ended = await AgentRunner.from_stores(provider, stores).cancel("w", tenant=T, by="ops")
        assert ended is not None and ended.status is RunStatus.cancelled
        with contextlib.suppress(AdkError):  # refusing the late decision is fine too
            await stores.approvals.decide(T, run.pending_approval.id, approved=True, by="alice")
        resumed = await AgentRunner.from_stores(provider, stores).resume(agent, "w", tenant=T)
        replay = await AgentRunner.from_stores(provider, stores).replay(
            agent, "w", tenant=T, from_step=2, stubs={"pay": lambda amount: 0}
        )
    assert resumed.status is RunStatus.cancelled
    assert replay.replay_of == "w@2" and replay.status is RunStatus.waiting_approval
    assert sent == []
    assert provider.calls == 1
