"""An attacker's tries at the day's fixes: costs read through ``run.costs.paid``, the cancel
check after the model's answer, the worker's leaked-CancelledError and wake-after-park,
the work index leaving a damaged entry out of a poll, SQLite rows of the wrong type, and
the CLI's bad-input refusals.

Twelve defects were found; all are fixed and their tests pass now: a cost or token
count past a float's or a ledger's range (an OverflowError, a retried uncharged call, a
half-applied Redis charge); a damaged work entry at the head of the index starving a
worker with one free slot, and its log line unescaped; a cancel during a sequential
turn's first call letting the rest go out; `run --resume` stopped by its reader's going
(it now carries on, writing no more); a closed stdout or stderr misreporting the exit; a
`connect_timeout` libpq takes refused; a cancel acknowledged in the moment between the
check after the model's answer and the call's claim (every call now looks at the cancel
once its claim is durable, on every backend). Each promise that held is an ordinary test.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import sqlite3
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from decimal import Decimal
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest

from booking import BOOK_TURNS, Airline
from processes import store_url
from tesserix_adk import (
    Agent,
    AgentRunner,
    LeasePolicy,
    ModelRequest,
    ModelResponse,
    RunStatus,
    ScriptedProvider,
    ScriptedTurn,
    Worker,
    open_stores,
    tool,
)
from tesserix_adk.errors import AdkError, ProviderError
from tesserix_adk.messages import Message, Usage
from tesserix_adk.run.costs import MAX_COST_MICROS, paid
from tesserix_adk.stores.bundle import Stores

T = "acme"

DURABLE = [
    pytest.param("sqlite", id="sqlite"),
    pytest.param("redis", id="redis", marks=pytest.mark.redis),
    pytest.param("postgres", id="postgres", marks=pytest.mark.postgres),
]


@asynccontextmanager
async def _opened(backend: str, tmp: Path) -> AsyncIterator[Stores]:
    if backend == "memory":
        async with open_stores("memory://") as stores:
            yield stores
        return
    async with store_url(backend, tmp) as url, open_stores(url) as stores:
        await stores.create_schema()
        yield stores


@tool(side_effects=False)
def look(q: str) -> str:
    """Look something up (read-only)."""
    return f"seen {q}"


class _Odd:
    """Scripted looks costing 10 each; the second answer is rewritten by ``odd``."""

    def __init__(self, odd: Any, turns: int = 4) -> None:
        self.inner = ScriptedProvider(
            [ScriptedTurn(calls=[("look", {"q": str(i)})], cost_micros=10) for i in range(turns)]
            + ["done"]
        )
        self.odd = odd
        self.calls = 0

    async def complete(self, request: ModelRequest) -> ModelResponse:
        response: ModelResponse = await self.inner.complete(request)
        self.calls += 1
        if self.calls == 2:
            response = self.odd(response)
        return response


async def _three_tries(stores: Stores, provider: Any, run_id: str) -> tuple[list[Any], Any]:
    """What a worker does with a retryable error: carry the run on again (3 tries)."""
    agent = Agent("spender", "Look.", [look], budget_micros=1_000, max_iterations=10)
    errors: list[Any] = []
    run = None
    for attempt in range(3):
        runner = AgentRunner.from_stores(provider, stores)
        try:
            if attempt == 0:
                run = await runner.run(agent, "go", tenant=T, run_id=run_id)
            else:
                run = await runner.resume(agent, run_id, tenant=T)
            break
        except AdkError as exc:
            errors.append(("adk", exc.retryable))
            if not exc.retryable:
                break
        except Exception as exc:
            errors.append((type(exc).__name__, None))
    return errors, run


# =========================================================================================
# run.costs.paid
# =========================================================================================


def _response(cost: Any = 0, usage: Usage | None = None) -> ModelResponse:
    return ModelResponse(
        message=Message(role="assistant", content="x"), usage=usage or Usage(), cost_micros=cost
    )


class _Micros(int):
    """An int subclass a provider SDK might hand back."""


@pytest.mark.parametrize(
    ("cost", "expected"),
    [
        pytest.param(-0.0, 0, id="negative-zero"),
        pytest.param(Fraction(1, 3), 1, id="fraction"),
        pytest.param(_Micros(7), 7, id="int-subclass"),
        pytest.param(MAX_COST_MICROS, MAX_COST_MICROS, id="max-int"),
        pytest.param(float(MAX_COST_MICROS), MAX_COST_MICROS, id="max-float"),
        pytest.param(0.000001, 1, id="tiny-float"),
    ],
)
def test_paid_reads_odd_but_valid_numbers_as_whole_micros(cost: Any, expected: int) -> None:
    micros, _ = paid(_response(cost))
    assert micros == expected and type(micros) is int


@pytest.mark.parametrize(
    "cost",
    [
        pytest.param(MAX_COST_MICROS + 1, id="past-max"),
        pytest.param(float("-inf"), id="-inf"),
        pytest.param(Decimal("sNaN"), id="decimal-snan"),
        pytest.param(Decimal("NaN"), id="decimal-nan"),
        pytest.param("12", id="str"),
        pytest.param(None, id="none"),
        pytest.param(True, id="bool"),
        pytest.param(complex(1, 0), id="complex"),
    ],
)
def test_paid_refuses_what_no_ledger_charges_as_a_provider_error(cost: Any) -> None:
    with pytest.raises(ProviderError) as caught:
        paid(_response(cost))
    assert caught.value.retryable is False


@pytest.mark.parametrize(
    "cost", [pytest.param(10**400, id="int-1e400"), pytest.param(Fraction(10**400, 3), id="frac")]
)
def test_paid_refuses_a_cost_past_a_floats_range(cost: Any) -> None:
    with pytest.raises(ProviderError):
        paid(_response(cost))


async def test_a_cost_past_a_floats_range_ends_the_run_failed(tmp_path: Path) -> None:
    provider = _Odd(lambda r: dataclasses.replace(r, cost_micros=10**400))
    async with _opened("sqlite", tmp_path) as stores:
        errors, run = await _three_tries(stores, provider, "huge")
    assert errors == [] and run is not None and run.status is RunStatus.failed, errors
    assert provider.calls == 2


async def test_a_token_count_no_ledger_holds_is_refused_not_retried_on_sqlite(
    tmp_path: Path,
) -> None:
    provider = _Odd(lambda r: dataclasses.replace(r, usage=Usage(input_tokens=2**70)))
    async with _opened("sqlite", tmp_path) as stores:
        errors, run = await _three_tries(stores, provider, "tokens")
        charged = await stores.ledger.spent(T, "tokens")
    assert errors == [] and run is not None and run.status is RunStatus.failed, errors
    assert provider.calls == 2 and charged == 10


@pytest.mark.redis
async def test_a_token_count_no_ledger_holds_is_refused_on_redis(tmp_path: Path) -> None:
    provider = _Odd(lambda r: dataclasses.replace(r, usage=Usage(input_tokens=2**70)))
    async with _opened("redis", tmp_path) as stores:
        errors, run = await _three_tries(stores, provider, "tokens")
    assert errors == [] and run is not None and run.status is RunStatus.failed, errors


# =========================================================================================
# The work index: a damaged entry left out of a poll
# =========================================================================================


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


async def _damage_first_entry(backend: str, stores: Stores, tmp: Path, run_id: str) -> None:
    """Make ``run_id``'s work entry one no kit writes (attempts = 'many')."""
    if backend == "sqlite":
        with sqlite3.connect(tmp / "adk.sqlite3") as db:
            db.execute("UPDATE adk_work SET attempts = 'many' WHERE run_id = ?", (run_id,))
        return
    from adapters import services

    client = await services.redis_client()
    try:
        keys = [k async for k in client.scan_iter(match="*")]
        mine = [k for k in keys if k.endswith(f"{{{T}:{run_id}}}:work".encode())]
        assert mine, "no work entry found"
        for k in mine:
            await client.hset(k, "attempts", "many")
    finally:
        await client.aclose()


async def _carry_for(worker: Worker, airline: Airline, want: int, seconds: float) -> None:
    task = asyncio.create_task(worker.run())
    deadline = time.monotonic() + seconds
    while len(airline.bookings) < want and time.monotonic() < deadline:  # noqa: ASYNC110
        await asyncio.sleep(0.05)
    worker.drain()
    await asyncio.wait_for(task, 30)


@pytest.mark.parametrize("concurrency", [4, 8])
async def test_a_damaged_entry_beside_fewer_than_the_free_slots_hides_nothing(
    concurrency: int, tmp_path: Path
) -> None:
    async with _opened("sqlite", tmp_path) as stores:
        airline = Airline()
        agent = _booking_agent(airline)
        for run_id in ("r0", "r1", "r2"):
            await _runner(stores).submit(agent, "book", tenant=T, run_id=run_id)
        await _damage_first_entry("sqlite", stores, tmp_path, "r0")
        worker = Worker(
            _runner(stores, provider=ScriptedProvider(list(BOOK_TURNS) * 2)),
            [agent],
            poll_interval=0.05,
            concurrency=concurrency,
        )
        await _carry_for(worker, airline, 2, 4)
    assert len(airline.bookings) == 2


@pytest.mark.parametrize(
    "backend",
    [
        pytest.param("sqlite", id="sqlite"),
        pytest.param("redis", id="redis", marks=pytest.mark.redis),
    ],
)
async def test_one_damaged_entry_at_the_head_does_not_starve_a_worker_of_concurrency_1(
    backend: str, tmp_path: Path
) -> None:
    async with _opened(backend, tmp_path) as stores:
        airline = Airline()
        agent = _booking_agent(airline)
        for run_id in ("r0", "r1", "r2"):
            await _runner(stores).submit(agent, "book", tenant=T, run_id=run_id)
        await _damage_first_entry(backend, stores, tmp_path, "r0")
        worker = Worker(
            _runner(stores, provider=ScriptedProvider(list(BOOK_TURNS) * 2)),
            [agent],
            poll_interval=0.05,
            concurrency=1,
        )
        await _carry_for(worker, airline, 2, 3)
    assert len(airline.bookings) == 2, "r1 and r2 were never carried"


async def test_a_damaged_entry_is_named_in_the_log_on_one_escaped_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with _opened("sqlite", tmp_path) as stores:
        agent = _booking_agent(Airline())
        await _runner(stores).submit(agent, "book", tenant=T, run_id="r0")
        with sqlite3.connect(tmp_path / "adk.sqlite3") as db:
            db.execute(
                "UPDATE adk_work SET attempts = 'many', "
                "tenant = 'x' || char(10) || 'CRITICAL forged: all runs done' WHERE run_id = 'r0'"
            )
        assert stores.work is not None
        with caplog.at_level(logging.WARNING, logger="tesserix_adk.stores"):
            assert await stores.work.due(limit=5) == []
    (named,) = [r for r in caplog.records if "left out" in r.getMessage()]
    assert "\n" not in named.getMessage(), named.getMessage()


async def test_a_run_parked_in_doubt_with_its_call_still_in_flight_is_not_woken_again(
    tmp_path: Path,
) -> None:
    """The wake-after-park looks at the records: one still in flight keeps the run parked,
    once, however long the worker polls (no park-wake-park loop)."""
    from tesserix_adk import Carried, WorkState
    from tesserix_adk.testing.faults import SimulatedCrash

    async with _opened("sqlite", tmp_path) as stores:
        airline = Airline()
        agent = _booking_agent(airline)

        def die(at: str) -> None:
            if at == "after":
                airline.hook = None
                raise SimulatedCrash("died after booking")

        airline.hook = die
        with pytest.raises(SimulatedCrash):
            await _runner(stores).run(agent, "book", tenant=T, run_id="d")
        await asyncio.sleep(1.1)  # the dead holder's lease lapses
        assert stores.work is not None
        await stores.work.want(T, "d", agent=agent.name)
        worker = Worker(_runner(stores), [agent], poll_interval=0.02)
        task = asyncio.create_task(worker.run())
        await asyncio.sleep(1.0)
        worker.drain()
        await asyncio.wait_for(task, 30)
        parked = await stores.work.items(T, state=WorkState.parked)
    takes = [how for item, how in worker.carried if item.run_id == "d"]
    assert takes == [Carried.parked], takes
    assert [p.run_id for p in parked] == ["d"]


# =========================================================================================
# Cancel: the check after the model's answer
# =========================================================================================


class _Thinking:
    """A provider that waits for ``go`` before answering: the test acts meanwhile."""

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


class _Desk:
    """Side-effecting tools that count what reached the outside world."""

    def __init__(self) -> None:
        self.sent: list[str] = []
        self.inside = asyncio.Event()
        self.release = asyncio.Event()
        self.hold_first = False

        @tool
        async def book(flight: str) -> str:
            """Book a seat."""
            self.sent.append(flight)
            if self.hold_first and len(self.sent) == 1:
                self.inside.set()
                await self.release.wait()
            return f"BK-{flight}"

        @tool(requires_approval=True)
        def pay(amount: int) -> str:
            """Pay."""
            self.sent.append(f"pay{amount}")
            return "paid"

        self.book = book
        self.pay = pay


@pytest.mark.parametrize(
    "parallel", [pytest.param(1, id="sequential"), pytest.param(3, id="parallel")]
)
async def test_a_cancel_while_the_model_thinks_sends_none_of_a_multi_call_turn(
    parallel: int, tmp_path: Path
) -> None:
    desk = _Desk()
    agent = Agent("booker", "Book.", [desk.book], parallel_tool_calls=parallel)
    turn = [("book", {"flight": f"LH{n}"}) for n in range(3)]
    provider = _Thinking([turn, "done"])
    async with _opened("sqlite", tmp_path) as stores:
        running = asyncio.create_task(
            AgentRunner.from_stores(provider, stores).run(agent, "go", tenant=T, run_id="m")
        )
        await asyncio.wait_for(provider.started.wait(), 10)
        assert (
            await AgentRunner.from_stores(provider, stores).cancel("m", tenant=T, by="ops") is None
        )
        provider.go.set()
        run = await asyncio.wait_for(running, 10)
        records = [r for r in await stores.idempotency.records(T, "m") if r.tool is not None]
    assert run.status is RunStatus.cancelled and desk.sent == [] and records == []


async def test_a_cancel_while_the_model_thinks_of_a_call_needing_approval_asks_nobody(
    tmp_path: Path,
) -> None:
    desk = _Desk()
    agent = Agent("payer", "Pay.", [desk.pay])
    provider = _Thinking([[("pay", {"amount": 5})], "done"])
    async with _opened("sqlite", tmp_path) as stores:
        running = asyncio.create_task(
            AgentRunner.from_stores(provider, stores).run(agent, "go", tenant=T, run_id="ap")
        )
        await asyncio.wait_for(provider.started.wait(), 10)
        await AgentRunner.from_stores(provider, stores).cancel("ap", tenant=T, by="ops")
        provider.go.set()
        run = await asyncio.wait_for(running, 10)
        again = await AgentRunner.from_stores(provider, stores).resume(agent, "ap", tenant=T)
    assert run.status is RunStatus.cancelled and run.pending_approval is None
    assert again.status is RunStatus.cancelled and desk.sent == [] and provider.calls == 1


async def test_a_cancel_while_a_streamed_run_thinks_sends_nothing(tmp_path: Path) -> None:
    desk = _Desk()
    agent = Agent("booker", "Book.", [desk.book])
    provider = _Thinking([[("book", {"flight": "LH1"})], "done"])
    kinds: list[str] = []
    async with _opened("sqlite", tmp_path) as stores:

        async def consume() -> None:
            events = AgentRunner.from_stores(provider, stores).stream(
                agent, "go", tenant=T, run_id="s"
            )
            async for event in events:
                kinds.append(type(event).__name__)

        consuming = asyncio.create_task(consume())
        await asyncio.wait_for(provider.started.wait(), 10)
        await AgentRunner.from_stores(provider, stores).cancel("s", tenant=T, by="ops")
        provider.go.set()
        await asyncio.wait_for(consuming, 10)
        cp = await __import__("tesserix_adk").Checkpointer.from_stores(stores).latest(T, "s")
    assert desk.sent == [] and "ToolCallStarted" not in kinds
    assert cp is not None and str(cp.status) == "cancelled"


async def test_a_cancel_while_a_resumed_run_thinks_sends_nothing(tmp_path: Path) -> None:
    """A run carried on from after_tool_result (a process that died between turns)."""
    desk = _Desk()
    agent = Agent("booker", "Book.", [desk.book])
    async with _opened("sqlite", tmp_path) as stores:
        first = ScriptedProvider([[("book", {"flight": "LH1"})]])
        with pytest.raises(Exception):  # noqa: B017 - the script runs out: the run stops
            await AgentRunner.from_stores(first, stores).run(agent, "go", tenant=T, run_id="r")
        assert desk.sent == ["LH1"]
        # ScriptedProvider answers by iteration: iteration 1 asks for LH2.
        provider = _Thinking([[("book", {"flight": "LH1"})], [("book", {"flight": "LH2"})], "done"])
        running = asyncio.create_task(
            AgentRunner.from_stores(provider, stores).resume(agent, "r", tenant=T)
        )
        await asyncio.wait_for(provider.started.wait(), 10)
        await AgentRunner.from_stores(provider, stores).cancel("r", tenant=T, by="ops")
        provider.go.set()
        run = await asyncio.wait_for(running, 10)
    assert run.status is RunStatus.cancelled and desk.sent == ["LH1"]


async def test_a_cancel_during_the_first_call_of_a_sequential_turn_sends_no_more(
    tmp_path: Path,
) -> None:
    desk = _Desk()
    desk.hold_first = True
    agent = Agent("booker", "Book.", [desk.book], parallel_tool_calls=1)
    turn = [("book", {"flight": f"LH{n}"}) for n in range(3)]
    provider = ScriptedProvider([turn, "done"])
    async with _opened("sqlite", tmp_path) as stores:
        running = asyncio.create_task(
            AgentRunner.from_stores(provider, stores).run(agent, "go", tenant=T, run_id="q")
        )
        await asyncio.wait_for(desk.inside.wait(), 10)
        # Acknowledged: the live holder "stops it ... and sends nothing more".
        assert (
            await AgentRunner.from_stores(provider, stores).cancel("q", tenant=T, by="ops") is None
        )
        desk.release.set()
        run = await asyncio.wait_for(running, 10)
    assert run.status is RunStatus.cancelled
    assert desk.sent == ["LH0"], desk.sent


@pytest.mark.parametrize(
    ("backend", "grouped"),
    [
        ("memory", False),
        ("sqlite", False),
        ("sqlite", True),
        pytest.param("redis", False, marks=pytest.mark.redis),
        pytest.param("postgres", False, marks=pytest.mark.postgres),
        pytest.param("postgres", True, marks=pytest.mark.postgres),
    ],
)
async def test_a_cancel_acknowledged_before_the_claim_stops_the_call(
    tmp_path: Path, backend: str, grouped: bool
) -> None:
    desk = _Desk()
    agent = Agent("booker", "Book.", [desk.book])
    provider = ScriptedProvider([[("book", {"flight": "LH1"})], "done"])
    async with _opened(backend, tmp_path) as stores:
        real_claim = stores.idempotency.claim
        acknowledged: list[Any] = []

        async def claim(key: str, **kwargs: Any) -> Any:
            if kwargs.get("tool") == "book" and not acknowledged:
                # The operator's cancel lands in the moment between the check and the claim.
                other = AgentRunner.from_stores(provider, stores)
                acknowledged.append(await other.cancel("w", tenant=T, by="ops"))
            return await real_claim(key, **kwargs)

        stores.idempotency.claim = claim  # type: ignore[method-assign]
        runner = AgentRunner.from_stores(provider, stores, group_writes=grouped)
        run = await runner.run(agent, "go", tenant=T, run_id="w")
        records = await stores.idempotency.records(T, "w")
    assert acknowledged == [None]  # "a live holder will end it"
    assert run.status is RunStatus.cancelled and desk.sent == [], (run.status, desk.sent)
    # Its claim went with it: nothing is left in doubt for a later look.
    assert [r for r in records if r.tool == "book"] == []


# =========================================================================================
# The CLI: closed outputs, and URLs a server takes
# =========================================================================================

import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

from tesserix_adk.cli import ExitCode  # noqa: E402
from tesserix_adk.errors import ConfigurationError  # noqa: E402

TESSERIX = [sys.executable, "-m", "tesserix_adk"]
TESTS = Path(__file__).parent

AGENT_MODULE = '''
"""The booking agent of tests/test_attacks_session_fixes.py, for `tesserix run --resume`."""
import os
from booking import BOOK_TURNS, Airline, booking_agent
from tesserix_adk import ScriptedProvider

class _Airline(Airline):
    pass

airline = Airline()
agent = booking_agent(airline)

def book_hook(stage):
    if stage == "after":
        with open(os.environ["ATK_BOOKED"], "a") as f:
            f.write("booked\\n")

airline.hook = book_hook

def provider():
    return ScriptedProvider(BOOK_TURNS)
'''


def _env(tmp: Path) -> dict[str, str]:
    env = {**os.environ}
    env.pop("ADK_DEBUG", None)
    env["PYTHONPATH"] = os.pathsep.join([str(tmp), str(TESTS), env.get("PYTHONPATH", "")])
    env["ATK_BOOKED"] = str(tmp / "booked.txt")
    return env


def _half_done(url: str) -> None:
    """Run ``r`` of tenant ``t`` searched, then its model went away: resumable."""

    async def go() -> None:
        async with open_stores(url) as stores:
            await stores.create_schema()
            short = ScriptedProvider(BOOK_TURNS[:1])
            with pytest.raises(Exception):  # noqa: B017 - the script runs out
                await AgentRunner.from_stores(short, stores).run(
                    _booking_agent_plain(), "book", tenant="t", run_id="r"
                )

    asyncio.run(go())


def _booking_agent_plain() -> Agent:
    from booking import booking_agent

    return booking_agent(Airline())


def _status(url: str) -> str:
    async def go() -> str:
        async with open_stores(url) as stores:
            from tesserix_adk import Checkpointer

            cp = await Checkpointer.from_stores(stores).latest("t", "r")
            assert cp is not None
            return str(cp.status)

    return asyncio.run(go())


def _broken_pipe() -> int:
    """The write end of a pipe whose reader is gone: every write is EPIPE."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    return write_end


def _resume_argv(url: str) -> list[str]:
    return [
        *TESSERIX,
        *("--store", url, "run", "--resume", "r", "--tenant", "t"),
        *("--agent", "atk_cli_agent:agent", "--provider", "atk_cli_agent:provider"),
    ]


def test_a_resume_with_its_reader_gone_carries_the_run_on_or_says_it_did_not(
    tmp_path: Path,
) -> None:
    url = f"sqlite:///{tmp_path / 'adk.sqlite3'}"
    _half_done(url)
    (tmp_path / "atk_cli_agent.py").write_text(AGENT_MODULE)
    write_end = _broken_pipe()
    try:
        done = subprocess.run(
            _resume_argv(url),
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
            env=_env(tmp_path),
        )
    finally:
        os.close(write_end)
    status = _status(url)
    # Exit 0 or 141 says nothing is left to do: then the run must have been carried on
    # (it is: the resume writes no more once its reader is gone, and carries on).
    if done.returncode in (0, 141):
        assert status == "completed", (status, done.stderr)
    else:
        assert done.stderr.startswith("tesserix") and "Traceback" not in done.stderr


def test_a_resume_stopped_by_a_gone_reader_loses_nothing(tmp_path: Path) -> None:
    """The resume whose reader is gone carries the run on, booking once; the next has
    nothing left to do. (Before, it stopped at its first line of output, having sent
    nothing, and the next resume carried the run on.)"""
    url = f"sqlite:///{tmp_path / 'adk.sqlite3'}"
    _half_done(url)
    (tmp_path / "atk_cli_agent.py").write_text(AGENT_MODULE)
    write_end = _broken_pipe()
    try:
        subprocess.run(
            _resume_argv(url),
            stdout=write_end,
            stderr=subprocess.PIPE,
            timeout=60,
            env=_env(tmp_path),
        )
    finally:
        os.close(write_end)
    assert (tmp_path / "booked.txt").read_text().count("booked") == 1
    again = subprocess.run(
        _resume_argv(url), capture_output=True, text=True, timeout=60, env=_env(tmp_path)
    )
    assert again.returncode == 0, again.stderr
    assert _status(url) == "completed"
    assert (tmp_path / "booked.txt").read_text().count("booked") == 1


def test_a_stdout_closed_outright_is_not_a_run_that_must_not_be_carried_on(
    tmp_path: Path,
) -> None:
    url = f"sqlite:///{tmp_path / 'adk.sqlite3'}"
    _half_done(url)
    done = subprocess.run(
        [*TESSERIX, "--store", url, "runs", "--tenant", "t"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        timeout=30,
        env=_env(tmp_path),
        # fd 1 closed in the child, as the shell's `>&-` does
        preexec_fn=lambda: os.close(1),
    )
    assert done.returncode != ExitCode.MUST_NOT_CARRY_ON, done.stderr
    assert "AttributeError" not in done.stderr, done.stderr


@pytest.mark.redis
@pytest.mark.parametrize("how", ["closed", "broken-pipe"])
def test_an_unreachable_store_is_exit_3_even_when_stderr_cannot_be_written(
    how: str, tmp_path: Path
) -> None:
    argv = [*TESSERIX, "--store", "redis://127.0.0.1:1/0", "show", "x", "--tenant", "t"]
    plain = subprocess.run(argv, capture_output=True, text=True, timeout=30, env=_env(tmp_path))
    assert plain.returncode == ExitCode.HELD, plain.stderr  # held: with stderr open
    if how == "closed":
        done = subprocess.run(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            timeout=30,
            env=_env(tmp_path),
            preexec_fn=lambda: os.close(2),
        )
    else:
        write_end = _broken_pipe()
        try:
            done = subprocess.run(
                argv, stdout=subprocess.PIPE, stderr=write_end, timeout=30, env=_env(tmp_path)
            )
        finally:
            os.close(write_end)
    assert done.returncode == ExitCode.HELD, done.returncode


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://postgres@127.0.0.1:5432/test",
        "postgresql://postgres@[::1]:5432/test",
        "postgresql:///test?host=/var/run/postgresql&user=postgres",
        "postgresql://postgres@127.0.0.1:5432,127.0.0.1:5433/test",
        "postgresql://postgres@127.0.0.1:5432,/test",
        "postgresql://postgres@127.0.0.1/test?port=5432&connect_timeout=0",
        "postgresql://postgres@127.0.0.1/test?connect_timeout=%2010&sslmode=verify-full",
        "postgresql://postgres@127.0.0.1/test?timeout=0.001",
        "postgresql://postgres@127.0.0.1/test?timeout=86400",
        "postgresql:///test?service=nothing",
        "redis://127.0.0.1:6379/0",
        "redis://127.0.0.1:6379/",
        "redis://127.0.0.1:6379",
        "redis://[::1]:6379/15",
        "redis://127.0.0.1:6379/2147483647",
        "redis+cluster://127.0.0.1:7000,127.0.0.1:7001/",
        "redis+cluster://127.0.0.1:7000/0",
        "rediss://user:pw@127.0.0.1:6380/3?ssl_cert_reqs=none",
    ],
)
async def test_urls_a_server_takes_are_not_refused_as_usage_errors(url: str) -> None:
    pytest.importorskip("psycopg")
    pytest.importorskip("redis")
    stores = open_stores(url)  # no I/O: a refusal here is the URL check's
    await stores.aclose()


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://postgres@127.0.0.1:65536/test",
        "postgresql://postgres@127.0.0.1:5432,:0/test",
        "postgresql://postgres@127.0.0.1/test?sslmode=REQUIRE",
        "postgresql://postgres@127.0.0.1/test?connect_timeout=1.5",
        "postgresql://postgres@127.0.0.1/test?timeout=86401",
        "postgresql://postgres@127.0.0.1/test?timeout=nan",
        "redis://127.0.0.1:6379/2147483648",
        "redis://127.0.0.1:6379/-1",
        "redis://127.0.0.1:6379/db0",
    ],
)
async def test_values_no_server_takes_are_usage_errors(url: str) -> None:
    pytest.importorskip("psycopg")
    pytest.importorskip("redis")
    with pytest.raises(ConfigurationError):
        stores = open_stores(url)
        await stores.aclose()


async def test_a_connect_timeout_libpq_takes_is_not_refused() -> None:
    pytest.importorskip("psycopg")
    stores = open_stores("postgresql://postgres@127.0.0.1/test?connect_timeout=%2B5")
    await stores.aclose()
