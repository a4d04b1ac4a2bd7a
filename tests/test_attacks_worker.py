"""Attacks on issue 14 (workers, submit, reconcilers, parking, backoff, drain, cancel).

Each test that shows a real defect is a strict xfail naming it; the plain ones show a
promise that held under the attack. Memory stores throughout (SQLite too where its work
index exists); the CLI attacks run ``tesserix`` in-process through ``main``.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from booking import BOOK_TURNS, Airline
from tesserix_adk import (
    Agent,
    AgentRunner,
    Backoff,
    Carried,
    LeasePolicy,
    ProviderError,
    Reconciled,
    ScriptedProvider,
    Worker,
    WorkState,
    open_stores,
    tool,
)
from tesserix_adk.cli.main import main as tesserix
from tesserix_adk.errors import (
    CheckpointTooLargeError,
    ConfigurationError,
    RunStartedError,
    StoreUnavailableError,
)
from tesserix_adk.run import reconciling
from tesserix_adk.run.cancelling import cancel_requested
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.stores.memory import MemoryWorkIndex
from tesserix_adk.stores.protocols import RecordStatus, WorkItem
from tesserix_adk.testing.faults import SimulatedCrash

T = "acme"
MARGIN = 0.05
TESTS = str(Path(__file__).parent)


def _stores() -> Stores:
    stores = open_stores("memory://")
    stores.work = MemoryWorkIndex(stores.leases)
    return stores


def _runner(
    stores: Stores, turns: list[Any] | None = None, provider: Any = None, **kwargs: Any
) -> AgentRunner:
    return AgentRunner.from_stores(
        provider or ScriptedProvider(list(turns or BOOK_TURNS)),
        stores,
        lease_policy=LeasePolicy(ttl=2.0, renew_within=1.0),
        never_ran_margin=MARGIN,
        **kwargs,
    )


def _agent(airline: Airline, *, reconcile: Callable[..., Any] | None = None) -> Agent:
    @tool
    def search_flights(origin: str, dest: str) -> list[str]:
        """Find flights."""
        return ["LH123"]

    @tool(reconcile=reconcile)
    def book_seat(flight: str, ctx: Any) -> dict[str, str]:
        """Book a seat."""
        if airline.hook is not None:
            airline.hook("before")
        airline.bookings.append(f"{flight}:{ctx.idempotency_key}")
        if airline.hook is not None:
            airline.hook("after")
        return {"booking": f"B{len(airline.bookings)}"}

    return Agent("booking", "Book.", [search_flights, book_seat])


def _die_inside_book_seat(airline: Airline, stage: str) -> None:
    def hook(at: str) -> None:
        if at == stage:
            airline.hook = None
            raise SimulatedCrash(f"died {stage} booking")

    airline.hook = hook


async def _work_until_idle(
    stores: Stores, agent: Agent, runner: AgentRunner | None = None, **kwargs: Any
) -> Worker:
    worker = Worker(
        runner or _runner(stores), [agent], exit_when_idle=True, poll_interval=0.01, **kwargs
    )
    await asyncio.wait_for(worker.run(), 30)
    return worker


async def _in_doubt(stores: Stores, airline: Airline, agent: Agent, stage: str) -> None:
    """Leave run r1 with its booking call in doubt: the holder died ``stage`` booking."""
    _die_inside_book_seat(airline, stage)
    with pytest.raises(SimulatedCrash):
        await _runner(stores).run(agent, "book", tenant=T, run_id="r1")


async def _book_record(stores: Stores) -> Any:
    (record,) = [r for r in await stores.idempotency.records(T, "r1") if r.tool == "book_seat"]
    return record


# --- reconcilers: never a guess ----------------------------------------------------------


@pytest.mark.parametrize("found", ["unknown", "never_ran", "maybe"])
async def test_a_reconciled_built_from_a_plain_string_is_never_recorded_as_completed(
    found: str,
) -> None:
    stores, airline = _stores(), Airline()
    # Reconciled is a public dataclass; ReconciledAs is a StrEnum, so "unknown" ==
    # ReconciledAs.unknown: Reconciled("unknown") is a natural mistake, and junk is junk.
    agent = _agent(airline, reconcile=lambda call, ctx: Reconciled(found))  # type: ignore[arg-type]
    await _in_doubt(stores, airline, agent, "after")
    await _work_until_idle(stores, agent)
    record = await _book_record(stores)
    assert not (record.status is RecordStatus.completed and record.by == "reconciler:book_seat")


async def test_a_reconciler_answer_with_odd_content_is_recorded_once_and_never_resent() -> None:
    stores, airline = _stores(), Airline()
    agent = _agent(airline, reconcile=lambda call, ctx: Reconciled.completed(object()))
    await _in_doubt(stores, airline, agent, "after")
    await _work_until_idle(stores, agent)
    assert len(airline.bookings) == 1


async def test_a_hanging_reconciler_counts_as_unknown_and_parks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(reconciling, "RECONCILE_TIMEOUT", 0.2)
    stores, airline = _stores(), Airline()

    async def hangs(call: Any, ctx: Any) -> Reconciled:
        await asyncio.sleep(3600)
        raise AssertionError("unreachable")

    agent = _agent(airline, reconcile=hangs)
    await _in_doubt(stores, airline, agent, "after")
    worker = await _work_until_idle(stores, agent)
    assert [how for _, how in worker.carried] == [Carried.parked]
    assert len(airline.bookings) == 1
    assert (await _book_record(stores)).status is not RecordStatus.completed


async def test_a_reconciler_that_lies_never_ran_is_asked_only_after_the_margin() -> None:
    """The lie cannot be helped, but it must be asked no earlier than the margin past the
    dead holder's lease: check the wait is honoured on a worker's take."""
    stores, airline = _stores(), Airline()
    asked_after: list[float] = []
    loop = asyncio.get_running_loop()
    died_at: list[float] = []

    def lies(call: Any, ctx: Any) -> Reconciled:
        asked_after.append(loop.time() - died_at[0])
        return Reconciled.never_ran()

    agent = _agent(airline, reconcile=lies)
    _die_inside_book_seat(airline, "after")
    runner = AgentRunner.from_stores(
        ScriptedProvider(list(BOOK_TURNS)),
        stores,
        lease_policy=LeasePolicy(ttl=2.0, renew_within=1.0),
        never_ran_margin=0.5,
    )
    with pytest.raises(SimulatedCrash):
        await runner.run(agent, "book", tenant=T, run_id="r1")
    died_at.append(loop.time())
    worker_runner = AgentRunner.from_stores(
        ScriptedProvider(list(BOOK_TURNS)),
        stores,
        lease_policy=LeasePolicy(ttl=2.0, renew_within=1.0),
        never_ran_margin=0.5,
    )
    await _work_until_idle(stores, agent, runner=worker_runner)
    assert asked_after and asked_after[0] >= 0.45, asked_after


# --- one worker per run ----------------------------------------------------------------


async def test_two_workers_racing_on_many_submitted_runs_book_each_once() -> None:
    stores, airline = _stores(), Airline()
    agent = _agent(airline)
    ids = [f"r{i}" for i in range(12)]
    for run_id in ids:
        await _runner(stores).submit(agent, "book", tenant=T, run_id=run_id)

    workers = [
        Worker(
            _runner(stores),  # the scripted model answers by the request
            [agent],
            exit_when_idle=True,
            poll_interval=0.001,
            concurrency=4,
        )
        for _ in range(3)
    ]
    await asyncio.wait_for(asyncio.gather(*(w.run() for w in workers)), 60)
    keys = [b.split(":", 1)[1] for b in airline.bookings]
    assert len(keys) == len(set(keys)) == len(ids), airline.bookings
    assert stores.work is not None and await stores.work.items(T) == []


async def test_a_submitted_run_started_by_hand_while_a_worker_takes_it_runs_once() -> None:
    stores, airline = _stores(), Airline()
    agent = _agent(airline)
    await _runner(stores).submit(agent, "book", tenant=T, run_id="r1")
    worker = Worker(_runner(stores), [agent], exit_when_idle=True, poll_interval=0.001)
    by_hand = _runner(stores).run(agent, "book", tenant=T, run_id="r1")
    results = await asyncio.gather(worker.run(), by_hand, return_exceptions=True)
    assert len(airline.bookings) == 1, (airline.bookings, results)


async def test_resume_of_a_submitted_run_that_never_started_starts_nothing() -> None:
    stores, airline = _stores(), Airline()
    agent = _agent(airline)
    await _runner(stores).submit(agent, "book", tenant=T, run_id="r1")
    with pytest.raises(Exception):  # noqa: B017 - any refusal; what matters is nothing ran
        await _runner(stores).resume(agent, "r1", tenant=T)
    assert airline.bookings == []
    await _work_until_idle(stores, agent)
    assert len(airline.bookings) == 1


class _RefusingModel:
    """A model call that fails for good (as a misconfigured provider does), counted."""

    def __init__(self) -> None:
        self.calls = 0

    async def complete(self, request: Any) -> Any:
        self.calls += 1
        await asyncio.sleep(0.01)
        raise ConfigurationError("the model refuses this request for good")


async def test_runs_that_must_be_parked_are_parked_by_racing_workers_without_an_effect() -> None:
    """Four workers race over twelve runs the model refuses for good: every run is parked
    and nothing is booked. (A worker whose due list went stale may take a run another one
    parked a moment before: one more model call, never a side effect.)"""
    stores, airline = _stores(), Airline()
    agent = _agent(airline)
    for i in range(12):
        await _runner(stores).submit(agent, "book", tenant=T, run_id=f"r{i}")
    model = _RefusingModel()
    workers = [
        Worker(_runner(stores, provider=model), [agent], exit_when_idle=True, poll_interval=0.001)
        for _ in range(4)
    ]
    await asyncio.wait_for(asyncio.gather(*(w.run() for w in workers)), 30)
    parked = [how for w in workers for _, how in w.carried if how is Carried.parked]
    assert len(parked) >= 12 and model.calls >= 12, (model.calls, len(parked))
    assert stores.work is not None
    assert len(await stores.work.items(T, state=WorkState.parked)) == 12
    assert airline.bookings == []


# --- submit --------------------------------------------------------------------------


async def test_submit_the_same_id_concurrently_makes_one_run() -> None:
    stores, airline = _stores(), Airline()
    agent = _agent(airline)
    got = await asyncio.gather(
        *(_runner(stores).submit(agent, "book", tenant=T, run_id="r1") for _ in range(8))
    )
    assert set(got) == {"r1"}
    # Other requests under that id at once: one is recorded, every other one is told.
    others = await asyncio.gather(
        *(_runner(stores).submit(agent, f"book {i}", tenant=T, run_id="r2") for i in range(8)),
        return_exceptions=True,
    )
    assert others.count("r2") == 1
    assert all(isinstance(o, RunStartedError) for o in others if o != "r2"), others
    assert stores.work is not None and len(await stores.work.items(T)) == 2
    await _work_until_idle(stores, agent)
    assert len(airline.bookings) == 2


async def test_submit_after_cancel_does_not_revive_the_run() -> None:
    stores, airline = _stores(), Airline()
    agent = _agent(airline)
    runner = _runner(stores)
    await runner.submit(agent, "book", tenant=T, run_id="r1")
    await runner.cancel("r1", tenant=T, by="ops")
    assert await runner.submit(agent, "book", tenant=T, run_id="r1") == "r1"
    await _work_until_idle(stores, agent)
    assert airline.bookings == []


async def test_submit_keeps_no_secret_of_the_state() -> None:
    """A state holding a secret is refused, nothing recorded: stored, it would be masked,
    and the worker starting the run would hand its tools the mask. The refusal names
    where, never the value."""
    stores, airline = _stores(), Airline()
    agent = _agent(airline)
    secret = "sk-live-" + "A1b2C3d4E5f6G7h8I9j0K1l2M3n4O5p6"
    with pytest.raises(ConfigurationError) as refused:
        await _runner(stores).submit(
            agent, "book", tenant=T, run_id="r1", state={"api_key": secret, "note": secret}
        )
    assert "api_key" in str(refused.value) and "note" in str(refused.value)
    assert secret not in str(refused.value)
    assert stores.work is not None
    assert await stores.work.input(T, "r1") is None


async def test_a_large_input_submitted_is_started_as_given_or_refused_whole() -> None:
    """Never cut: an input some frontier can hold is started as given; one none could
    (over ``max_bytes``) is refused at submit, typed and final, nothing recorded (carried,
    it would leave only tombstones and its answer kept nowhere)."""
    stores, airline = _stores(), Airline()
    agent = _agent(airline)
    runner = _runner(stores, max_bytes=16 * 1024)
    with pytest.raises(CheckpointTooLargeError) as refused:
        await runner.submit(agent, "x" * (64 * 1024), tenant=T, run_id="big")
    assert refused.value.retryable is False
    assert stores.work is not None and await stores.work.entry(T, "big") is None
    await runner.submit(agent, "x" * (12 * 1024), tenant=T, run_id="r1")
    worker = await _work_until_idle(stores, agent, runner=_runner(stores, max_bytes=16 * 1024))
    assert [how for _, how in worker.carried] == [Carried.finished]
    assert len(airline.bookings) == 1
    started = await _runner(stores).checkpoints.at(T, "r1", 1)  # type: ignore[union-attr]
    assert started is not None
    messages = await _runner(stores).checkpoints.messages(started)  # type: ignore[union-attr]
    assert messages[0].text == "x" * (12 * 1024)


# No NUL: a run id holding one is refused on every store (tests/adapters/test_nul_text.py).
@pytest.mark.parametrize("run_id", ["a/b", "a:b", "a b\n", "ü-ñ-☃", "a\x01b", "%s'\";--"])
async def test_odd_run_ids_round_trip_through_submit_and_a_worker(run_id: str) -> None:
    stores, airline = _stores(), Airline()
    agent = _agent(airline)
    assert await _runner(stores).submit(agent, "book", tenant=T, run_id=run_id) == run_id
    await _work_until_idle(stores, agent)
    assert len(airline.bookings) == 1


# --- cancel ---------------------------------------------------------------------------


async def test_a_worker_that_took_a_run_just_before_its_cancel_dispatches_nothing() -> None:
    stores, airline = _stores(), Airline()
    agent = _agent(airline)
    runner = _runner(stores)
    await runner.submit(agent, "book", tenant=T, run_id="r1")
    assert stores.work is not None
    (item,) = await stores.work.due(limit=5)
    await runner.cancel("r1", tenant=T, by="ops", reason="customer asked")
    worker = Worker(_runner(stores), [agent], poll_interval=0.01)
    await worker._carry(item)
    assert airline.bookings == []


async def test_a_cancel_seen_by_nobody_before_its_holder_died_still_stops_the_run() -> None:
    stores, airline = _stores(), Airline()
    agent = _agent(airline)
    runner = _runner(stores)
    _die_inside_book_seat(airline, "after")
    with pytest.raises(SimulatedCrash):
        await runner.run(agent, "book", tenant=T, run_id="r1")
    # The holder died with its call in doubt; the cancel comes before any worker took it.
    await _runner(stores).cancel("r1", tenant=T, by="ops")
    worker = await _work_until_idle(stores, agent)
    assert len(airline.bookings) == 1
    assert runner.checkpoints is not None
    cp = await runner.checkpoints.latest(T, "r1")
    assert cp is not None and cp.status.value == "cancelled", cp
    assert worker.carried == []


# --- backoff, store blips -------------------------------------------------------------


class _AlwaysRateLimited:
    async def complete(self, request: Any) -> Any:
        raise ProviderError("rate limited", retryable=True, status_code=429)


async def test_a_zero_backoff_still_parks_after_max_attempts() -> None:
    stores, airline = _stores(), Airline()
    agent = _agent(airline)
    runner = _runner(stores, provider=_AlwaysRateLimited())
    await runner.submit(agent, "book", tenant=T, run_id="r1")
    worker = Worker(
        runner,
        [agent],
        poll_interval=0.001,
        max_attempts=3,
        backoff=Backoff(base=0.001, cap=0.001),
    )
    with pytest.raises(ConfigurationError, match="Backoff needs"):
        Backoff(base=0.0, cap=0.0)
    # The worker never goes idle on its own (no exit_when_idle): the deadline stops it.
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(worker.run(), 2)
    assert stores.work is not None
    assert await stores.work.items(T, state=WorkState.parked) != []


async def test_a_retryable_failure_backs_off_with_growing_delays() -> None:
    rng = random.Random(7)
    delays = [Backoff(base=1.0, cap=60.0).delay(n, rng) for n in range(8)]
    assert all(d >= 0.5 for d in delays)
    assert delays[-1] > delays[0]
    assert max(delays) <= 60.0


class _BlinkingWork(MemoryWorkIndex):
    """A work index whose ``due`` fails once with a passing store error."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.blinks = 1

    async def due(self, *, limit: int, agents: Sequence[str] | None = None) -> list[WorkItem]:
        if self.blinks:
            self.blinks -= 1
            raise StoreUnavailableError("connection reset while finding work")
        return await super().due(limit=limit, agents=agents)


async def test_a_store_blip_while_finding_work_does_not_kill_the_worker() -> None:
    stores, airline = _stores(), Airline()
    stores.work = _BlinkingWork(stores.leases)
    agent = _agent(airline)
    await _runner(stores).submit(agent, "book", tenant=T, run_id="r1")
    worker = await _work_until_idle(stores, agent)
    assert [how for _, how in worker.carried] == [Carried.finished]


# --- parked stays parked; the work index loses nothing ---------------------------------


async def test_a_parked_run_is_not_taken_by_a_by_hand_run_of_another_worker_poll() -> None:
    stores, airline = _stores(), Airline()
    agent = _agent(airline)
    await _in_doubt(stores, airline, agent, "before")
    for _ in range(3):
        await _work_until_idle(stores, agent)
    assert airline.bookings == []
    assert stores.work is not None
    (parked,) = await stores.work.items(T, state=WorkState.parked)
    assert parked.reason and "book_seat" in parked.reason


async def test_a_run_whose_done_failed_is_finished_by_a_later_worker_not_rerun() -> None:
    stores, airline = _stores(), Airline()
    agent = _agent(airline)
    assert stores.work is not None
    real_done = stores.work.done
    fails = [1]

    async def done(tenant: str, run_id: str) -> None:
        if fails:
            fails.pop()
            raise StoreUnavailableError("lost the connection marking it done")
        await real_done(tenant, run_id)

    stores.work.done = done  # type: ignore[method-assign]
    await _runner(stores).submit(agent, "book", tenant=T, run_id="r1")
    # exit_when_idle leaves while the retry is delayed: go round until nothing is left.
    for _ in range(50):
        await _work_until_idle(stores, agent, backoff=Backoff(base=0.01))
        if not await stores.work.items(T):
            break
        await asyncio.sleep(0.02)
    assert len(airline.bookings) == 1
    assert await stores.work.items(T) == []
    cp = await stores.checkpoints.latest(T, "r1")
    assert cp is not None


# --- SQLite, when its work index exists -------------------------------------------------


async def test_two_workers_on_sqlite_book_each_submitted_run_once(tmp_path: Path) -> None:
    stores = open_stores(f"sqlite:///{tmp_path / 'adk.sqlite3'}")
    if stores.work is None:
        pytest.skip("SQLite keeps no work index yet")
    await stores.create_schema()
    airline = Airline()
    agent = _agent(airline)
    ids = [f"r{i}" for i in range(6)]
    for run_id in ids:
        await _runner(stores).submit(agent, "book", tenant=T, run_id=run_id)
    await _runner(stores).submit(agent, "book", tenant=T, run_id="r0")
    workers = [
        Worker(
            _runner(stores, turns=BOOK_TURNS * len(ids)),
            [agent],
            exit_when_idle=True,
            poll_interval=0.01,
        )
        for _ in range(2)
    ]
    await asyncio.wait_for(asyncio.gather(*(w.run() for w in workers)), 60)
    keys = [b.split(":", 1)[1] for b in airline.bookings]
    assert len(keys) == len(set(keys)) == len(ids)


# --- the CLI: exit codes and one-sentence errors ----------------------------------------


def _cli(
    argv: list[str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> tuple[int, str]:
    monkeypatch.syspath_prepend(TESTS)
    code = tesserix(argv)
    err = capsys.readouterr().err
    return code, err


def _one_sentence(err: str) -> bool:
    lines = [line for line in err.strip().splitlines() if line.strip()]
    return len(lines) == 1 and "Traceback" not in err


@pytest.mark.parametrize(
    "extra",
    [["--concurrency", "0"], ["--concurrency", "-3"], ["--lease-ttl", "-1"], ["--lease-ttl", "0"]],
    ids=["concurrency-0", "concurrency-negative", "ttl-negative", "ttl-0"],
)
def test_worker_bad_numbers_are_usage_errors(
    extra: list[str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    store = f"sqlite:///{tmp_path / 'adk.sqlite3'}"
    code, err = _cli(
        ["worker", "--agent", "chaos_agent:agent", "--store", store, *extra], capsys, monkeypatch
    )
    assert code == 2, err
    assert "Traceback" not in err


def test_worker_with_an_unknown_agent_says_so_in_one_sentence(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    store = f"sqlite:///{tmp_path / 'adk.sqlite3'}"
    code, err = _cli(
        ["worker", "--agent", "chaos_agent:no_such_agent", "--store", store], capsys, monkeypatch
    )
    assert code == 2, err
    assert _one_sentence(err), err


def test_submit_with_an_unknown_agent_module_says_so_in_one_sentence(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    store = f"sqlite:///{tmp_path / 'adk.sqlite3'}"
    code, err = _cli(
        [
            *("submit", "--agent", "no_such_module_xyz:agent", "--tenant", T),
            *("--input", "hi", "--store", store),
        ],
        capsys,
        monkeypatch,
    )
    assert code == 2, err
    assert _one_sentence(err), err


def test_cancel_of_an_unknown_run_exits_1_in_one_sentence(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    store = f"sqlite:///{tmp_path / 'adk.sqlite3'}"
    code, err = _cli(
        ["cancel", "nope", "--tenant", T, "--by", "ops", "--store", store], capsys, monkeypatch
    )
    assert code == 1, err
    assert _one_sentence(err), err


async def test_a_cancel_is_audited_and_its_reason_kept_without_secrets() -> None:
    stores, airline = _stores(), Airline()
    agent = _agent(airline)
    runner = _runner(stores)
    await runner.submit(agent, "book", tenant=T, run_id="r1")
    secret = "sk-live-" + "Z9y8X7w6V5u4T3s2R1q0P9o8N7m6L5k4"
    await runner.cancel("r1", tenant=T, by="ops-anna", reason=f"leaked key {secret}")
    # Asked again by someone else: the first request stands.
    await runner.cancel("r1", tenant=T, by="mallory", reason="me too")
    request = await cancel_requested(stores.idempotency, T, "r1")
    assert request is not None and request.by == "ops-anna" and request.at > 0
    assert request.reason is not None and secret not in request.reason
    for record in await stores.idempotency.records(T, "r1"):
        assert record.outcome is None or secret.encode() not in bytes(record.outcome)


async def test_a_hanging_sync_reconciler_parks_the_run_and_cannot_hold_up_an_exit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import threading

    monkeypatch.setattr(reconciling, "RECONCILE_TIMEOUT", 0.2)
    stores, airline = _stores(), Airline()
    release = threading.Event()

    def hangs(call: Any, ctx: Any) -> Reconciled:
        release.wait(3600)
        return Reconciled.never_ran()

    agent = _agent(airline, reconcile=hangs)
    await _in_doubt(stores, airline, agent, "after")
    try:
        worker = await _work_until_idle(stores, agent)
        assert [how for _, how in worker.carried] == [Carried.parked]
        hung = [t for t in threading.enumerate() if t.name == "tesserix-reconciler"]
        assert hung and all(t.daemon for t in hung)  # the interpreter does not wait for it
    finally:
        release.set()
    assert len(airline.bookings) == 1
