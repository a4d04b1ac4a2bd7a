"""An attack on this morning's fixes (55734ae..e5481c0), each attacked again.

1. ``WakesParked.wake``: the revision sweep wakes a run another revision's worker parked in
   one compare-and-set write; reasons holding NULs, odd code points or a great length, on
   SQLite, Redis and PostgreSQL; sweepers racing each other, and an operator's cancel.
2. ``run()``/``stream()`` keep the run's input as a submission (``AgentRunner._submitted``):
   a state the frontier leaves out, a run started after a ``submit()`` of the same id with
   another input, the user's own retry racing a worker after a crash before the first
   frontier, a secret in the input.
3. A drain honoured at ``after_model_call`` before any call is sent: with an open write
   group on SQLite and PostgreSQL (frontier and charge durable, nothing claimed), with
   parallel calls, with a call that needs an approval.
4. ``LeasePolicy``'s bounds.
5. Results that cannot be written (``invoking.result_content``): what the model is told,
   and whether a repr text keeps a secret.

Real SQLite files, the shared Redis and PostgreSQL servers (fresh prefixes and schemas).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import math
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from adapters import services
from booking import BOOK_TURNS, Airline, booking_agent
from run.helpers import fresh_stores
from tesserix_adk import (
    Agent,
    AgentRunner,
    Carried,
    LeasePolicy,
    Message,
    ModelRequest,
    ModelResponse,
    Role,
    RunStatus,
    RunStoppedError,
    ScriptedProvider,
    ToolCall,
    Worker,
    WorkState,
    open_stores,
    tool,
)
from tesserix_adk.errors import ConfigurationError, RunStartedError
from tesserix_adk.leases import MAX_TTL
from tesserix_adk.providers.scripted import ScriptedTurn
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.stores.protocols import RecordStatus, WakesParked
from tesserix_adk.testing.faults import SimulatedCrash
from test_attacks_revision_sweep import T as SWEEP_T
from test_attacks_revision_sweep import _agents, _entry, _lapsed, _mismatch, _runner, _started

T = "morning-acme"
A = "booking"
SECRET = "sk-proj-" + "Z9y8X7w6V5u4T3s2R1q0P9o8N7m6L5k4J3i2H1g0"

BACKENDS = [
    pytest.param("sqlite", id="sqlite"),
    pytest.param("redis", id="redis", marks=pytest.mark.redis),
    pytest.param("postgres", id="postgres", marks=pytest.mark.postgres),
]
GROUPED = [
    pytest.param("sqlite", id="sqlite"),
    pytest.param("postgres", id="postgres", marks=pytest.mark.postgres),
]


def _fast(stores: Stores, provider: Any, **kwargs: Any) -> AgentRunner:
    return AgentRunner.from_stores(
        provider, stores, lease_policy=LeasePolicy(ttl=0.6, renew_within=0.3), **kwargs
    )


class _DiesFirst:
    """The process "dies" in the run's first model call: nothing is checkpointed yet."""

    def __init__(self) -> None:
        self.requests: list[ModelRequest] = []

    async def complete(self, request: ModelRequest) -> ModelResponse:
        self.requests.append(request)
        raise SimulatedCrash("died in the first model call")


class _Recording:
    def __init__(self, turns: list[Any]) -> None:
        self.inner = ScriptedProvider(list(turns))
        self.requests: list[ModelRequest] = []

    async def complete(self, request: ModelRequest) -> ModelResponse:
        self.requests.append(request)
        response: ModelResponse = await self.inner.complete(request)
        return response


def _user_texts(request: ModelRequest) -> list[str]:
    return [str(m.content) for m in request.messages if m.role is Role.user]


async def _book_records(stores: Stores, run_id: str) -> list[Any]:
    return [r for r in await stores.idempotency.records(T, run_id) if r.tool == "book_seat"]


# --- 1. WakesParked.wake on every backend --------------------------------------------------

ODD_REASONS = [
    pytest.param("RevisionMismatchError: a\x00b\x00", id="nuls"),
    pytest.param("RevisionMismatchError: \u202e\u0301\U0001f600 \ufeff\u00a0\t\r\n", id="odd"),
    pytest.param("RevisionMismatchError: " + "x" * 300_000, id="long"),
    pytest.param("RevisionMismatchError: \\x00 literally, then a real \x00", id="nul-alike"),
]


@pytest.mark.parametrize("reason", ODD_REASONS)
@pytest.mark.parametrize("where", BACKENDS)
async def test_a_run_parked_for_an_odd_reason_is_woken_as_read_with_its_count(
    where: str, reason: str, tmp_path: Path
) -> None:
    async with fresh_stores(where, tmp_path) as stores:
        work = stores.work
        assert isinstance(work, WakesParked) and work is not None
        await work.submit(T, "odd", agent=A, input=b"in")
        for _ in range(2):
            await work.want(T, "odd", agent=A, count=1)
        await work.park(T, "odd", agent=A, reason=reason)
        (parked,) = await work.items(T, state=WorkState.parked)
        assert parked.attempts == 2
        woken = await work.wake(T, "odd", agent=A, attempts=parked.attempts, reason=parked.reason)
        assert woken is True, (where, parked.reason and parked.reason[:80])
        item = await work.entry(T, "odd")
        assert item is not None
        assert (item.state, item.attempts, item.reason) == (WorkState.wanted, 3, None)
        assert await work.input(T, "odd") == b"in"


@pytest.mark.parametrize("where", BACKENDS)
async def test_sweepers_racing_wake_a_parked_run_once_and_count_it_once(
    where: str, tmp_path: Path
) -> None:
    async with fresh_stores(where, tmp_path) as stores:
        work = stores.work
        assert isinstance(work, WakesParked) and work is not None
        await work.want(T, "raced", agent=A, count=4)
        reason = _mismatch("raced")
        await work.park(T, "raced", agent=A, reason=reason)
        (parked,) = await work.items(T, state=WorkState.parked)
        results = await asyncio.gather(
            *(
                work.wake(T, "raced", agent=A, attempts=parked.attempts, reason=parked.reason)
                for _ in range(12)
            )
        )
        assert results.count(True) == 1, results
        item = await work.entry(T, "raced")
        assert item is not None
        assert (item.state, item.attempts) == (WorkState.wanted, parked.attempts + 1)


@pytest.mark.parametrize("where", BACKENDS)
async def test_a_wake_of_a_run_done_meanwhile_revives_nothing(where: str, tmp_path: Path) -> None:
    async with fresh_stores(where, tmp_path) as stores:
        work = stores.work
        assert isinstance(work, WakesParked) and work is not None
        await work.want(T, "fin", agent=A, count=1)
        await work.park(T, "fin", agent=A, reason=_mismatch("fin"))
        (parked,) = await work.items(T, state=WorkState.parked)
        await work.done(T, "fin")
        assert (
            await work.wake(T, "fin", agent=A, attempts=parked.attempts, reason=parked.reason)
            is False
        )
        assert [i for i in await work.items(T) if i.state is not WorkState.done] == []
        assert await work.due(limit=10) == []


async def test_the_sweep_racing_an_operators_cancel_leaves_the_run_ended(
    tmp_path: Path,
) -> None:
    """Many sweepers of the new revision and an operator's cancel of the parked run, all at
    once: the run ends cancelled, no worker carries it on, nothing is booked."""
    async with fresh_stores("sqlite", tmp_path) as stores:
        airline = Airline()
        old, new = _agents(airline)
        await _started(stores, new, "cx")
        await _lapsed(stores, "cx")
        taken = await Worker(_runner(stores), [old])._carry(await _entry(stores, "cx"))
        assert taken is Carried.parked
        sweepers = [Worker(_runner(stores), [new], parked_sweep=0) for _ in range(3)]
        operator = _runner(stores)
        await asyncio.gather(
            *(s._wake_parked(formats=False) for s in sweepers),
            operator.cancel("cx", tenant=SWEEP_T, by="al", reason="customer withdrew"),
        )
        workers = [
            Worker(_runner(stores), [new], exit_when_idle=True, poll_interval=0.01)
            for _ in range(2)
        ]
        await asyncio.wait_for(asyncio.gather(*(w.run() for w in workers)), 30)
        assert airline.bookings == []
        assert operator.checkpoints is not None
        cp = await operator.checkpoints.latest(SWEEP_T, "cx")
        assert cp is not None and cp.status.value == "cancelled", cp
        assert (await _entry(stores, "cx")).state is WorkState.done


# --- 2. run() keeps its input as a submission ----------------------------------------------


async def test_a_state_the_frontier_leaves_out_does_not_fail_run_on_a_runner_with_a_work_index(
    tmp_path: Path,
) -> None:
    async with fresh_stores("sqlite", tmp_path) as stores:
        airline = Airline()
        agent = booking_agent(airline)
        plain = AgentRunner.from_stores(ScriptedProvider(list(BOOK_TURNS)), stores)
        plain.work = None
        done = await plain.run(agent, "book", tenant=T, run_id="no-index", state={"seen"})
        assert done.status is RunStatus.completed
        with_index = AgentRunner.from_stores(ScriptedProvider(list(BOOK_TURNS)), stores)
        assert with_index.work is not None
        run = await with_index.run(agent, "book", tenant=T, run_id="with-index", state={"seen"})
        assert run.status is RunStatus.completed
        assert len(airline.bookings) == 2


async def test_run_after_a_submit_with_another_input_is_refused_or_carried_on_its_own_input(
    tmp_path: Path,
) -> None:
    async with fresh_stores("sqlite", tmp_path) as stores:
        agent = booking_agent(Airline())
        await _fast(stores, ScriptedProvider(["x"])).submit(
            agent, "INPUT-A: book LH123", tenant=T, run_id="twice"
        )
        dies = _DiesFirst()
        # Refused outright, typed, nothing asked: the run is the submission's, which a
        # worker starts (found as a defect: a crash decided which input it went on with).
        with pytest.raises(RunStartedError, match="submitted with another input"):
            await _fast(stores, dies).run(agent, "INPUT-B: book UA456", tenant=T, run_id="twice")
        assert dies.requests == []
        # The same input again is the submission's own run: it goes on.
        same = _Recording(BOOK_TURNS)
        run = await _fast(stores, same).run(agent, "INPUT-A: book LH123", tenant=T, run_id="twice")
        assert run.status is RunStatus.completed
        assert _user_texts(same.requests[0]) == ["INPUT-A: book LH123"]


@pytest.mark.parametrize("where", BACKENDS)
async def test_the_users_retry_racing_a_worker_after_a_crash_before_the_first_frontier_books_once(
    where: str, tmp_path: Path
) -> None:
    async with fresh_stores(where, tmp_path) as stores:
        airline = Airline()
        agent = booking_agent(airline)
        with pytest.raises(SimulatedCrash):
            await _fast(stores, _DiesFirst()).run(agent, "book", tenant=T, run_id="retry")
        await _lapsed(stores, "retry", tenant=T)
        item = await _entry(stores, "retry", tenant=T)
        assert item.state is not WorkState.parked, item
        worker = Worker(
            _fast(stores, ScriptedProvider(list(BOOK_TURNS))),
            [agent],
            exit_when_idle=True,
            poll_interval=0.005,
        )

        async def users_retry() -> str:
            try:
                run = await _fast(stores, ScriptedProvider(list(BOOK_TURNS))).run(
                    agent, "book", tenant=T, run_id="retry"
                )
            except Exception as exc:  # the worker has it, or started it first
                return type(exc).__name__
            return run.status.value

        outcomes = await asyncio.wait_for(asyncio.gather(users_retry(), worker.run()), 30)
        assert outcomes[0] in ("completed", "LeaseHeldError", "RunStartedError"), outcomes
        if outcomes[0] != "completed":
            # The user's retry lost the race: any worker finishes it.
            again = Worker(
                _fast(stores, ScriptedProvider(list(BOOK_TURNS))),
                [agent],
                exit_when_idle=True,
                poll_interval=0.01,
            )
            await _lapsed(stores, "retry", tenant=T)
            await asyncio.wait_for(again.run(), 30)
        assert airline.bookings == ["LH123"]
        records = await _book_records(stores, "retry")
        assert [r.status for r in records] == [RecordStatus.completed]
        assert (await _entry(stores, "retry", tenant=T)).state is WorkState.done


async def test_one_run_id_in_two_tenants_is_started_by_a_worker_on_each_ones_own_input(
    tmp_path: Path,
) -> None:
    async with fresh_stores("sqlite", tmp_path) as stores:
        agent = booking_agent(Airline())
        for tenant in ("tenant-one", "tenant-two"):
            with pytest.raises(SimulatedCrash):
                await _fast(stores, _DiesFirst()).run(
                    agent, f"book for {tenant}", tenant=tenant, run_id="same"
                )
        for tenant in ("tenant-one", "tenant-two"):
            await _lapsed(stores, "same", tenant=tenant)
        seen = _Recording(BOOK_TURNS * 2)
        worker = Worker(_fast(stores, seen), [agent], exit_when_idle=True, poll_interval=0.01)
        await asyncio.wait_for(worker.run(), 30)
        firsts = sorted(_user_texts(r)[0] for r in seen.requests if len(r.messages) == 1)
        assert firsts == ["book for tenant-one", "book for tenant-two"], firsts


async def test_one_run_id_started_twice_at_once_books_once(tmp_path: Path) -> None:
    async with fresh_stores("sqlite", tmp_path) as stores:
        airline = Airline()
        agent = booking_agent(airline)

        async def start() -> str:
            try:
                run = await _fast(stores, ScriptedProvider(list(BOOK_TURNS))).run(
                    agent, "book", tenant=T, run_id="dup"
                )
            except Exception as exc:
                return type(exc).__name__
            return run.status.value

        outcomes = sorted(await asyncio.gather(start(), start(), start()))
        assert outcomes.count("completed") == 1, outcomes
        assert set(outcomes) <= {"completed", "LeaseHeldError", "RunStartedError"}, outcomes
        assert airline.bookings == ["LH123"]
        assert (await _entry(stores, "dup", tenant=T)).state is WorkState.done


async def test_a_secret_in_a_run_input_is_not_in_the_stored_submission(tmp_path: Path) -> None:
    async with fresh_stores("sqlite", tmp_path) as stores:
        agent = booking_agent(Airline())
        with pytest.raises(SimulatedCrash):
            await _fast(stores, _DiesFirst()).run(
                agent, f"book, my key is {SECRET} password=hunter2-plain", tenant=T, run_id="s"
            )
        assert stores.work is not None
        data = await stores.work.input(T, "s")
        assert data is not None
    raw = (tmp_path / "adk.sqlite3").read_bytes()
    for leak in (SECRET.encode(), SECRET[8:28].encode(), b"hunter2-plain"):
        assert leak not in data
        assert leak not in raw
    with sqlite3.connect(tmp_path / "adk.sqlite3") as conn:
        for (table,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'"):
            for row in conn.execute(f"SELECT * FROM {table}"):
                assert SECRET[8:28] not in repr(row), table


async def test_a_run_started_on_a_runner_without_a_work_index_still_runs(tmp_path: Path) -> None:
    async with fresh_stores("sqlite", tmp_path) as stores:
        airline = Airline()
        runner = AgentRunner.from_stores(ScriptedProvider(list(BOOK_TURNS)), stores)
        runner.work = None
        run = await runner.run(booking_agent(airline), "book", tenant=T, run_id="bare")
        assert run.status is RunStatus.completed
        assert stores.work is not None
        assert await stores.work.entry(T, "bare") is None
        assert airline.bookings == ["LH123"]


# --- 3. a drain at after_model_call ---------------------------------------------------------


class _Charged:
    """The scripted model, each answer costing ``cost`` micros; the drain is asked as the
    ``drain_at``-th answer comes back (while the model "thinks")."""

    def __init__(self, turns: list[Any], *, cost: int, drain_at: int) -> None:
        self.inner = ScriptedProvider(list(turns))
        self.cost = cost
        self.drain_at = drain_at
        self.asked = 0
        self.drain: str | None = None

    def stop(self) -> str | None:
        return self.drain

    async def complete(self, request: ModelRequest) -> ModelResponse:
        self.asked += 1
        response: ModelResponse = await self.inner.complete(request)
        if self.asked == self.drain_at:
            self.drain = "its worker is draining"
        return dataclasses.replace(response, cost_micros=self.cost)


PARALLEL_TURNS: list[Any] = [
    [("search_flights", {"origin": "FRA", "dest": "JFK"})],
    ScriptedTurn(
        text="Both.",
        calls=[("book_seat", {"flight": "LH123"}), ("book_seat", {"flight": "UA456"})],
    ),
    "Booked both.",
]


@contextlib.asynccontextmanager
async def _grouped_url(where: str, tmp_path: Path) -> AsyncIterator[str]:
    """A store URL of the test's own with the kit's schema: a SQLite file, or a fresh
    PostgreSQL schema (dropped after)."""
    if where == "sqlite":
        url = f"sqlite:///{tmp_path / 'adk.sqlite3'}"
    else:
        cm = services.postgres_schema()
        url = services.schema_url(await cm.__aenter__())
    try:
        async with open_stores(url) as stores:
            await stores.create_schema()
        yield url
    finally:
        if where != "sqlite":
            await cm.__aexit__(None, None, None)


@pytest.mark.parametrize("where", GROUPED)
async def test_a_drain_at_after_model_call_with_an_open_write_group_is_durable_and_claims_nothing(
    where: str, tmp_path: Path
) -> None:
    async with _grouped_url(where, tmp_path) as url:
        airline = Airline()
        agent = booking_agent(airline)
        model = _Charged(PARALLEL_TURNS, cost=1_000, drain_at=2)
        async with open_stores(url) as stores:
            runner = AgentRunner.from_stores(model, stores, group_writes=True)
            with pytest.raises(RunStoppedError):
                await runner.run(agent, "book both", tenant=T, run_id="drained", stop=model.stop)
            assert airline.bookings == []
            # Read by another process's connections while the writer's are still open.
            async with open_stores(url) as reader:
                assert await reader.leases.current(T, "drained") is None
                assert reader.ledger is not None
                assert await reader.ledger.spent(T, "drained") == 2_000
                assert await _book_records(reader, "drained") == []
                seen = AgentRunner.from_stores(ScriptedProvider(["x"]), reader)
                assert seen.checkpoints is not None
                cp = await seen.checkpoints.latest(T, "drained")
                assert cp is not None
                assert (cp.iteration, cp.boundary.value) == (1, "after_model_call"), cp
        async with open_stores(url) as again:
            resumed = await AgentRunner.from_stores(
                ScriptedProvider(list(PARALLEL_TURNS)), again
            ).resume(agent, "drained", tenant=T)
            assert resumed.status is RunStatus.completed
            assert sorted(airline.bookings) == ["LH123", "UA456"]
            assert again.ledger is not None
            assert await again.ledger.spent(T, "drained") == 2_000


async def test_a_drain_before_a_call_that_needs_an_approval_asks_on_resume_and_books_nothing(
    tmp_path: Path,
) -> None:
    async with fresh_stores("sqlite", tmp_path) as stores:
        airline = Airline()
        agent = booking_agent(airline, approval=True)
        model = _Charged(BOOK_TURNS, cost=0, drain_at=2)
        runner = AgentRunner.from_stores(model, stores, group_writes=True)
        with pytest.raises(RunStoppedError):
            await runner.run(agent, "book", tenant=T, run_id="appr", stop=model.stop)
        assert stores.approvals is not None
        resumed = await AgentRunner.from_stores(ScriptedProvider(["x"]), stores).resume(
            agent, "appr", tenant=T
        )
        assert resumed.status is RunStatus.waiting_approval
        assert resumed.pending_approval is not None
        assert airline.bookings == []
        assert await _book_records(stores, "appr") == []


async def test_a_cancel_racing_a_drain_at_after_model_call_ends_the_run_cancelled(
    tmp_path: Path,
) -> None:
    async with fresh_stores("sqlite", tmp_path) as stores:
        airline = Airline()
        agent = booking_agent(airline)
        model = _Charged(BOOK_TURNS, cost=0, drain_at=2)
        runner = AgentRunner.from_stores(model, stores, group_writes=True)
        operator = AgentRunner.from_stores(ScriptedProvider(["x"]), stores)
        original = model.complete

        async def complete(request: ModelRequest) -> ModelResponse:
            response = await original(request)
            if model.asked == 2:  # the operator cancels while the model thinks
                await operator.cancel("both", tenant=T, by="al", reason="withdrawn")
            return response

        model.complete = complete  # type: ignore[method-assign]
        with pytest.raises(RunStoppedError):
            await runner.run(agent, "book", tenant=T, run_id="both", stop=model.stop)
        ended = await AgentRunner.from_stores(ScriptedProvider(["x"]), stores).resume(
            agent, "both", tenant=T
        )
        assert ended.status is RunStatus.cancelled
        assert airline.bookings == []


# --- 4. LeasePolicy bounds -------------------------------------------------------------------


@pytest.mark.parametrize(
    "ttl",
    [math.inf, math.nan, MAX_TTL * 1.000001, 1e300, -1.0, 0.0],
    ids=["inf", "nan", "past-max", "1e300", "negative", "zero"],
)
def test_lease_policy_refuses_a_ttl_out_of_bounds(ttl: float) -> None:
    with pytest.raises(ConfigurationError):
        LeasePolicy(ttl=ttl, renew_within=0.5)


@pytest.mark.parametrize("where", BACKENDS)
async def test_a_lease_of_the_longest_ttl_is_held_and_renewed_on_every_backend(
    where: str, tmp_path: Path
) -> None:
    async with fresh_stores(where, tmp_path) as stores:
        airline = Airline()
        runner = AgentRunner.from_stores(
            ScriptedProvider(list(BOOK_TURNS)),
            stores,
            lease_policy=LeasePolicy(ttl=MAX_TTL, renew_within=MAX_TTL / 2),
        )
        run = await runner.run(booking_agent(airline), "book", tenant=T, run_id="year")
        assert run.status is RunStatus.completed
        assert airline.bookings == ["LH123"]
        assert await stores.leases.current(T, "year") is None


# --- 5. results that cannot be written ------------------------------------------------------


class _RetriesOnError:
    """A model that books, and books again when told the booking failed (as a real model
    would), then answers."""

    def __init__(self) -> None:
        self.requests: list[ModelRequest] = []

    async def complete(self, request: ModelRequest) -> ModelResponse:
        self.requests.append(request)
        results = [m for m in request.messages if m.role is Role.tool]
        if not results or (results[-1].is_error and len(results) < 2):
            n = len(results)
            call = ToolCall(id=f"c{n}", name="book_seat", arguments={"flight": "LH123"})
            return ModelResponse(message=Message(role="assistant", content="", tool_calls=[call]))
        return ModelResponse(message=Message(role="assistant", content="Booked."))


def _photo_agent(airline: Airline, result: Any) -> Agent:
    @tool
    def book_seat(flight: str) -> Any:
        """Book a seat; answers with the boarding pass images, keyed by (leg, page)."""
        airline.bookings.append(flight)
        return result

    return Agent("photos", "Book.", [book_seat])


async def test_a_result_with_tuple_keys_and_image_bytes_is_told_as_completed(
    tmp_path: Path,
) -> None:
    async with fresh_stores("sqlite", tmp_path) as stores:
        airline = Airline()
        agent = _photo_agent(airline, {("LH123", 1): b"\x89PNG\r\n\x1a\n\xff\xd8"})
        model = _RetriesOnError()
        run = await AgentRunner.from_stores(model, stores).run(
            agent, "book", tenant=T, run_id="png"
        )
        told = [m for m in model.requests[-1].messages if m.role is Role.tool]
        assert airline.bookings == ["LH123"], [str(m.content)[:120] for m in told]
        assert [m.is_error for m in told] == [False]
        assert run.status is RunStatus.completed


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: _cyclic({"password": "hunter2-plain", "api_key": SECRET}), id="dict"),
        pytest.param(lambda: _cyclic({"note": f"token={SECRET}"}), id="token-in-text"),
        pytest.param(lambda: _Unprintable(f"Bearer {SECRET}"), id="str-raises"),
    ],
)
async def test_a_result_told_as_its_repr_text_is_stored_masked(make: Any, tmp_path: Path) -> None:
    async with fresh_stores("sqlite", tmp_path) as stores:
        airline = Airline()
        agent = _photo_agent(airline, make())
        run = await AgentRunner.from_stores(_RetriesOnError(), stores).run(
            agent, "book", tenant=T, run_id="repr"
        )
        assert run.status is RunStatus.completed
        assert airline.bookings == ["LH123"]
    raw = (tmp_path / "adk.sqlite3").read_bytes()
    wal = tmp_path / "adk.sqlite3-wal"
    if wal.exists():
        raw += wal.read_bytes()
    for leak in (SECRET[8:28].encode(), b"hunter2-plain"):
        assert leak not in raw


def _cyclic(value: dict[str, Any]) -> dict[str, Any]:
    value["me"] = value
    return value


class _Unprintable:
    def __init__(self, held: str) -> None:
        self.held = held

    def __str__(self) -> str:
        raise RuntimeError("no text")

    def __repr__(self) -> str:
        return f"_Unprintable(authorization={self.held!r})"


@pytest.mark.parametrize(
    "raised",
    [
        pytest.param(lambda: asyncio.CancelledError("its own"), id="asyncio-cancelled"),
        pytest.param(lambda: concurrent.futures.CancelledError(), id="futures-cancelled"),
        pytest.param(lambda: GeneratorExit(), id="generator-exit"),
    ],
)
async def test_a_sync_tool_raising_a_cancellation_is_its_recorded_error_not_a_call_in_doubt(
    raised: Any, tmp_path: Path
) -> None:
    async with fresh_stores("sqlite", tmp_path) as stores:
        airline = Airline()

        @tool
        def book_seat(flight: str) -> str:
            """Book a seat, then trip over its own future."""
            airline.bookings.append(flight)
            raise raised()

        agent = Agent("cancels", "Book.", [book_seat])
        model = _RetriesOnError()
        run = await AgentRunner.from_stores(model, stores).run(
            agent, "book", tenant=T, run_id="own-cancel"
        )
        assert run.status is RunStatus.completed
        records = await _book_records(stores, "own-cancel")
        assert records and all(r.status is RecordStatus.completed for r in records), records
        assert await stores.leases.current(T, "own-cancel") is None
