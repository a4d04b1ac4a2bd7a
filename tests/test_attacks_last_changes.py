"""An attack on three recent changes: the Temporal activities' cancel checks (b6c90e8),
``tesserix runs`` listing submitted runs (4fb88a1), and the worker waking a run parked as
indeterminate once its calls are settled (f9cb7e0, be28b40).

The Temporal activity bodies (``temporal.steps``) are driven in-process, as the activity
wrapper calls them (``retried`` is ``activity.info().attempt > 1``): no dev server is
needed to put a retried attempt after a dead one. Four defects were found, all fixed, and
their tests pass now: a retried Temporal call activity answered "not sent" after a cancel
for a call an earlier attempt had claimed (in doubt) or recorded (the cancel is now asked
only of a call this attempt is about to send, in the runner's loop too), a run parked
before its first frontier was listed nowhere, and a run cancelled before any worker started
it left `tesserix runs` (it is listed as cancelled now). What held is a plain test.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest

from tesserix_adk import (
    Agent,
    AgentRunner,
    Backoff,
    IndeterminateToolCallError,
    LeasePolicy,
    PlannedCall,
    Redactor,
    ScriptedProvider,
    Stores,
    ToolDisposition,
    Worker,
    WorkState,
    open_stores,
    tool,
)
from tesserix_adk.checkpoint.payload import encode_outcome
from tesserix_adk.cli.demo_agent import AIRLINE_ENV, create_airline
from tesserix_adk.cli.main import main
from tesserix_adk.messages import ToolOutcome
from tesserix_adk.run.cancelling import request_cancel
from tesserix_adk.temporal import steps
from tesserix_adk.temporal.shapes import ModelStep, StepKind, ToolInput, ToolResult

T = "acme"

# --- Temporal: the cancel checks of the activities (b6c90e8) -------------------------------


class _Airline:
    def __init__(self) -> None:
        self.sent: list[str] = []


def _agent(airline: _Airline, *, parallel: int = 1) -> Agent:
    @tool
    def book(flight: str) -> str:
        """Book a seat."""
        airline.sent.append(flight)
        return f"booked {flight}"

    return Agent(name="booker", instructions="book", tools=[book], parallel_tool_calls=parallel)


async def _stores(tmp_path: Path, name: str = "adk") -> Stores:
    stores = open_stores(f"sqlite:///{tmp_path / (name + '.sqlite3')}")
    await stores.create_schema()
    return stores


def _runner(stores: Stores, turns: list[Any]) -> AgentRunner:
    return AgentRunner.from_stores(
        ScriptedProvider(turns),
        stores,
        lease_policy=LeasePolicy(ttl=2.0, renew_within=1.0),
        never_ran_margin=0.05,
    )


async def _first_turn(runner: AgentRunner, agent: Agent, rid: str) -> list[ToolInput]:
    """The model turn of iteration 0 (its ``after_model_call`` frontier written), and the
    inputs of its call activities."""
    step = ModelStep(
        tenant=T,
        run_id=rid,
        agent_name=agent.name,
        agent_revision=agent.revision,
        iteration=0,
        input="book",
    )
    turn = await steps.model_turn(runner, agent, step, "model-attempt-1")
    assert turn.kind is StepKind.calls, turn
    return [
        ToolInput(
            tenant=T,
            run_id=rid,
            agent_name=agent.name,
            agent_revision=agent.revision,
            iteration=0,
            call_id=ref.call_id,
        )
        for ref in turn.calls
    ]


async def _fold(
    runner: AgentRunner, agent: Agent, rid: str, results: list[ToolResult]
) -> tuple[str | None, list[Any]]:
    """The next model turn (folding ``results``): the status it ended with, and the
    transcript's tool results."""
    step = ModelStep(
        tenant=T,
        run_id=rid,
        agent_name=agent.name,
        agent_revision=agent.revision,
        iteration=1,
        results=results,
    )
    turn = await steps.model_turn(runner, agent, step, "model-attempt-2")
    assert runner.checkpoints is not None
    cp = await runner.checkpoints.latest(T, rid)
    assert cp is not None
    messages = await runner.checkpoints.messages(cp)
    return turn.status, [m for m in messages if m.tool_call_id is not None]


async def _cancel(runner: AgentRunner, rid: str) -> None:
    await request_cancel(
        runner.idempotency, T, rid, by="ops", reason="stop", redactor=runner.redactor
    )


async def _key(runner: AgentRunner, rid: str, call_id: str) -> str:
    assert runner.checkpoints is not None
    cp = await runner.checkpoints.latest(T, rid)
    assert cp is not None
    (oc,) = [c for c in cp.outstanding if c.call.id == call_id]
    assert oc.key is not None
    return oc.key


async def test_a_retried_call_left_in_flight_is_not_told_not_sent_after_a_cancel(
    tmp_path: Path,
) -> None:
    stores = await _stores(tmp_path)
    try:
        airline = _Airline()
        agent = _agent(airline)
        runner = _runner(stores, [[("book", {"flight": "LH1"})], "done"])
        rid = "run-inflight"
        (call,) = await _first_turn(runner, agent, rid)
        key = await _key(runner, rid, call.call_id)
        # The first attempt of the activity claimed the call and died inside the send.
        await stores.idempotency.claim(
            key,
            holder="attempt-that-died",
            tenant=T,
            run_id=rid,
            iteration=0,
            tool="book",
            call_id=call.call_id,
            flags=None,
            fence=1,
        )
        await _cancel(runner, rid)
        # Temporal retries the activity (its worker died): attempt 2.
        try:
            result = await steps.tool_call(runner, agent, call, "tool-attempt-2", retried=True)
        except IndeterminateToolCallError:
            return  # refused, naming the call: nobody guesses
        # Whatever it answers, it must not say the call was not sent: nobody knows that.
        assert result.recorded or not str(result.content).startswith("not sent"), result
    finally:
        await stores.aclose()


async def test_a_retried_call_already_recorded_is_replayed_not_told_not_sent_after_a_cancel(
    tmp_path: Path,
) -> None:
    stores = await _stores(tmp_path)
    try:
        airline = _Airline()
        agent = _agent(airline)
        runner = _runner(stores, [[("book", {"flight": "LH1"})], "done"])
        rid = "run-recorded"
        (call,) = await _first_turn(runner, agent, rid)
        # Attempt 1 sent and recorded the booking; its result never reached the workflow.
        first = await steps.tool_call(runner, agent, call, "tool-attempt-1", retried=False)
        assert first.recorded and airline.sent == ["LH1"]
        await _cancel(runner, rid)
        retry = await steps.tool_call(runner, agent, call, "tool-attempt-2", retried=True)
        status, results = await _fold(runner, agent, rid, [retry])
        assert status == "cancelled"
        assert airline.sent == ["LH1"]  # never twice: this part holds
        # The transcript tells what happened: the booking was made.
        assert not str(results[-1].content).startswith("not sent"), results[-1]
    finally:
        await stores.aclose()


async def test_a_cancel_before_a_parallel_turns_calls_sends_none_and_ends_cancelled(
    tmp_path: Path,
) -> None:
    # Held: a cancel acknowledged after the model's answer was written stops every call of
    # a parallel turn (each activity asks first); the next model turn ends it cancelled.
    stores = await _stores(tmp_path)
    try:
        airline = _Airline()
        agent = _agent(airline, parallel=4)
        turns: list[Any] = [[("book", {"flight": "LH1"}), ("book", {"flight": "UA2"})], "done"]
        runner = _runner(stores, turns)
        rid = "run-parallel"
        calls = await _first_turn(runner, agent, rid)
        await _cancel(runner, rid)
        # Side by side on Temporal, each under the run's lease in turn (one held makes the
        # other's activity retry): here one after the other.
        results = [
            await steps.tool_call(runner, agent, c, f"tool-{c.call_id}", retried=False)
            for c in calls
        ]
        assert all(str(r.content).startswith("not sent") for r in results)
        status, told = await _fold(runner, agent, rid, list(results))
        assert status == "cancelled" and airline.sent == []
        assert len(told) == 2
        # A call activity retried after the run ended sends nothing either.
        again = await steps.tool_call(runner, agent, calls[0], "late", retried=True)
        assert str(again.content).startswith("not sent") and airline.sent == []
    finally:
        await stores.aclose()


async def test_a_cancel_while_the_model_thinks_ends_the_turn_before_any_call(
    tmp_path: Path,
) -> None:
    # Held: the model turn asks again after the answer; its calls are never written.
    stores = await _stores(tmp_path)
    try:
        airline = _Airline()
        agent = _agent(airline)
        rid = "run-thinking"

        class Slow(ScriptedProvider):
            async def complete(self, request: Any) -> Any:
                await _cancel(runner, rid)  # acknowledged while it thinks
                return await super().complete(request)

        runner = AgentRunner.from_stores(
            Slow([[("book", {"flight": "LH1"})], "done"]),
            stores,
            lease_policy=LeasePolicy(ttl=2.0, renew_within=1.0),
        )
        step = ModelStep(
            tenant=T,
            run_id=rid,
            agent_name=agent.name,
            agent_revision=agent.revision,
            iteration=0,
            input="book",
        )
        turn = await steps.model_turn(runner, agent, step, "m1")
        assert turn.kind is StepKind.finished and turn.status == "cancelled"
        assert runner.checkpoints is not None
        cp = await runner.checkpoints.latest(T, rid)
        assert cp is not None and cp.outstanding == () and airline.sent == []
    finally:
        await stores.aclose()


# --- tesserix runs: submitted runs (4fb88a1) ---------------------------------------------

AGENT = "tesserix_adk.cli.demo_agent:agent"


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    airline = tmp_path / "airline.sqlite3"
    create_airline(str(airline))
    monkeypatch.setenv(AIRLINE_ENV, str(airline))
    url = f"sqlite:///{tmp_path / 'adk.sqlite3'}"
    assert _cli(url, "schema", "apply")[0] == 0
    return url


def _cli(url: str, *args: str) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["--store", url, *args])
    return code, out.getvalue()


def _runs(url: str, *extra: str, tenant: str = T) -> list[dict[str, Any]]:
    code, out = _cli(url, "runs", "--tenant", tenant, "--json", *extra)
    assert code == 0, out
    rows: list[dict[str, Any]] = json.loads(out)["runs"]
    return rows


def _submit(url: str, run_id: str, tenant: str = T) -> None:
    code, out = _cli(
        url, "submit", "--agent", AGENT, "--tenant", tenant, "--input", "book", "--run-id", run_id
    )
    assert code == 0, out


def _db(url: str) -> sqlite3.Connection:
    return sqlite3.connect(url.removeprefix("sqlite:///"))


def test_a_submitted_run_parked_before_its_first_frontier_is_listed_as_stuck(
    store: str,
) -> None:
    _submit(store, "damaged")
    with _db(store) as con:  # a hand edit, or another kit's entry
        con.execute("UPDATE adk_work SET input = x'00010203' WHERE run_id = 'damaged'")
    assert _cli(store, "worker", "--agent", AGENT, "--exit-when-idle")[0] == 0
    with _db(store) as con:
        (state,) = con.execute("SELECT state FROM adk_work WHERE run_id = 'damaged'").fetchone()
    assert state == "parked"
    assert [r["run_id"] for r in _runs(store, "--stuck")] == ["damaged"]


def test_a_submitted_run_cancelled_before_start_is_still_listed(store: str) -> None:
    _submit(store, "queued")
    code, out = _cli(store, "cancel", "queued", "--tenant", T, "--by", "ops", "--json")
    assert code == 0 and json.loads(out)["state"] == "cancelled_before_start"
    assert [r["run_id"] for r in _runs(store)] == ["queued"]
    (row,) = _runs(store, "--status", "cancelled")
    assert (row["status"], row["step"]) == ("cancelled", None)
    assert row["reason"].startswith("cancelled before it started, by ops")
    assert _runs(store, "--status", "completed") == []
    assert _runs(store, "--stuck") == []
    code, text = _cli(store, "runs", "--tenant", T, "--no-header")
    assert code == 0 and "queued  booking  cancelled" in text
    assert "cancelled before it started, by ops" in text


def test_submitted_rows_have_the_shape_order_filters_and_escaping_of_other_rows(
    store: str,
) -> None:
    # Held: one run carried to its end, then two submitted (one with control characters in
    # its id), one in another tenant.
    _submit(store, "carried")
    assert _cli(store, "worker", "--agent", AGENT, "--exit-when-idle")[0] == 0
    time.sleep(0.05)
    _submit(store, "queued-1")
    time.sleep(0.05)
    _submit(store, "q\x1b[2Jx\n2")
    _submit(store, "theirs", tenant="globex")
    rows = _runs(store)
    assert [r["run_id"] for r in rows] == ["q\x1b[2Jx\n2", "queued-1", "carried"]
    assert len({frozenset(r) for r in rows}) == 1  # every row has the same fields
    assert [r["status"] for r in rows] == ["submitted", "submitted", "completed"]
    # --limit keeps the newest, whatever their kind.
    assert [r["run_id"] for r in _runs(store, "--limit", "2")] == ["q\x1b[2Jx\n2", "queued-1"]
    assert [r["run_id"] for r in _runs(store, "--limit", "1")] == ["q\x1b[2Jx\n2"]
    # --agent by name or module:attr keeps them; another agent's filter leaves them out.
    assert len(_runs(store, "--agent", "booking")) == 3
    assert len(_runs(store, "--agent", AGENT)) == 3
    assert _runs(store, "--agent", "nobody") == []
    # --since: a future time leaves all out, a long duration keeps all.
    assert _runs(store, "--since", "2999-01-01T00:00:00Z") == []
    assert len(_runs(store, "--since", "1d")) == 3
    # Another tenant's submission is its own.
    assert [r["run_id"] for r in _runs(store, tenant="globex")] == ["theirs"]
    # Text: the control characters are printed escaped, one line a row.
    code, out = _cli(store, "runs", "--tenant", T, "--no-header")
    assert code == 0
    lines = out.splitlines()
    assert len(lines) == 3 and "\x1b" not in out
    assert lines[0].split()[1:3] == ["booking", "submitted"]
    # --status and --stuck leave them out (documented).
    assert [r["run_id"] for r in _runs(store, "--status", "completed")] == ["carried"]
    assert _runs(store, "--stuck") == []


def test_a_run_submitted_and_started_is_listed_once_with_its_frontier(
    store: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Held: the worker started it (a frontier) while its entry could still read submitted:
    # put the entry back to 'submitted' by hand; the run is listed once, by its frontier.
    _submit(store, "both")
    assert _cli(store, "worker", "--agent", AGENT, "--exit-when-idle")[0] == 0
    with _db(store) as con:
        con.execute("UPDATE adk_work SET state = 'submitted' WHERE run_id = 'both'")
    rows = _runs(store)
    assert [(r["run_id"], r["status"]) for r in rows] == [("both", "completed")]


def test_many_submitted_runs_are_all_listed_newest_first(store: str) -> None:
    async def submit_many() -> None:
        stores = open_stores(store)
        try:
            from tesserix_adk.cli.demo_agent import agent as demo

            runner = AgentRunner.from_stores(ScriptedProvider(["x"]), stores)
            for n in range(150):
                await runner.submit(demo, "book", tenant=T, run_id=f"r{n:03d}")
        finally:
            await stores.aclose()

    asyncio.run(submit_many())
    rows = _runs(store)
    assert len(rows) == 150 and {r["status"] for r in rows} == {"submitted"}
    assert len(_runs(store, "--limit", "7")) == 7


# --- the worker waking a run parked as indeterminate (f9cb7e0, be28b40) --------------------


def _doubt(key: str) -> IndeterminateToolCallError:
    call = PlannedCall(
        call_id="call_0_0",
        tool="book",
        key=key,
        disposition=ToolDisposition.indeterminate,
        reason="claimed in flight by a holder that died",
        iteration=0,
    )
    return IndeterminateToolCallError("cannot tell whether 1 call(s) ran", calls=[call])


async def _completed(stores: Stores, key: str, tenant: str, run_id: str) -> None:
    await stores.idempotency.claim(
        key,
        holder="h",
        tenant=tenant,
        run_id=run_id,
        iteration=0,
        tool="book",
        call_id="call_0_0",
        flags=None,
    )
    encoded = encode_outcome(ToolOutcome(call_id="call_0_0", content="BK-1"), Redactor())
    await stores.idempotency.complete(key, encoded, tenant=tenant, holder="h")


async def _refusing_worker(
    stores: Stores, agent: Agent, key: str, *, max_attempts: int, seconds: float
) -> list[int]:
    """A worker whose every take of the run is refused as indeterminate for ``key``
    (whose records look settled): the attempts count it saw at each take."""
    runner = _runner(stores, ["done"])
    worker = Worker(
        runner,
        [agent],
        poll_interval=0.01,
        backoff=Backoff(base=0.02, cap=0.05),
        max_attempts=max_attempts,
    )
    seen: list[int] = []

    async def refused(item: Any, *_: Any) -> Any:
        seen.append(item.attempts)
        raise _doubt(key)

    worker._take = refused  # type: ignore[method-assign]
    task = asyncio.create_task(worker.run())
    await asyncio.sleep(seconds)
    worker.drain()
    await asyncio.wait_for(task, 10)
    return seen


async def test_a_run_whose_records_look_settled_while_resume_refuses_stops_cycling(
    tmp_path: Path,
) -> None:
    # Held: woken after a delay, counted, and left parked once max_attempts is reached.
    stores = await _stores(tmp_path)
    try:
        agent = _agent(_Airline())
        await _completed(stores, "k-settled", T, "cyc")
        assert stores.work is not None
        await stores.work.want(T, "cyc", agent=agent.name)
        seen = await _refusing_worker(stores, agent, "k-settled", max_attempts=4, seconds=1.5)
        assert 1 <= len(seen) <= 4, seen
        assert seen == sorted(seen)
        (parked,) = await stores.work.items(T, state=WorkState.parked)
        assert parked.run_id == "cyc"
    finally:
        await stores.aclose()


async def test_a_settled_record_of_another_tenant_does_not_wake_a_parked_run(
    tmp_path: Path,
) -> None:
    # Held: the look is the run's tenant's; another tenant's record under the same key
    # (a business key both use) leaves it parked after one take.
    stores = await _stores(tmp_path)
    try:
        agent = _agent(_Airline())
        await _completed(stores, "k-shared", "globex", "theirs")
        assert stores.work is not None
        await stores.work.want(T, "ours", agent=agent.name)
        seen = await _refusing_worker(stores, agent, "k-shared", max_attempts=10, seconds=0.6)
        assert seen == [0]
        (parked,) = await stores.work.items(T, state=WorkState.parked)
        assert parked.run_id == "ours"
    finally:
        await stores.aclose()


async def test_two_workers_racing_over_a_refusing_run_stay_bounded(tmp_path: Path) -> None:
    # Held: two workers sharing the index (the take patched, so no lease keeps them
    # apart and both may take it in the same round) each stop within max_attempts, and
    # the run ends parked.
    stores = await _stores(tmp_path)
    try:
        agent = _agent(_Airline())
        await _completed(stores, "k-race", T, "race")
        assert stores.work is not None
        await stores.work.want(T, "race", agent=agent.name)
        a, b = await asyncio.gather(
            _refusing_worker(stores, agent, "k-race", max_attempts=4, seconds=1.5),
            _refusing_worker(stores, agent, "k-race", max_attempts=4, seconds=1.5),
        )
        assert 1 <= len(a) <= 4 and len(b) <= 4, (a, b)
        assert await stores.work.items(T, state=WorkState.parked)
    finally:
        await stores.aclose()
