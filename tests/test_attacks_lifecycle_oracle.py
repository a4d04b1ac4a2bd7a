"""A run's whole life against an oracle, as a hypothesis state machine, on a SQLite file.

A few run ids of one booking agent (two inputs: an economy seat, or a business seat that
needs a person and then an economy one). What users, workers and operators do to them:
``submit``; ``run()`` in process dying at a chosen point (``SimulatedCrash`` from
``tesserix_adk.testing.faults``: before the first frontier is written, right after a
booking's claim, inside the booking before or after the airline took it, right after its
outcome was recorded); a carry on (``resume``, as ``tesserix run --resume``) dying the same
way; a ``Worker(exit_when_idle=True)`` pass dying the same way; a drain asked at a chosen
boundary; ``tesserix cancel`` with a short or a long reason; ``tesserix resolve
--never-ran/--outcome`` as an operator would after looking the call up in the airline (the
oracle knows whether the airline took it); ``tesserix approve``/``--deny``; leases lapsing.

The oracle (``Airline``) keeps every booking by idempotency key and run. After every step:
one booking per key; a completed run has exactly its bookings and its final frontier
(``tesserix show``) holds a result for each; a run parked (work index ``parked``, or
``runs --stuck``) has a call truly in doubt (a death left its claim in flight) or a person
to decide; a cancelled run books nothing after its cancel was recorded. In the teardown
workers and truthful operators act until nothing moves: every run must be finished or
waiting on a person.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import shutil
import tempfile
import threading
from collections import Counter
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, Phase, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tesserix_adk import (
    Agent,
    AgentRunner,
    Backoff,
    Checkpointer,
    LeasePolicy,
    ModelRequest,
    ModelResponse,
    ToolCall,
    ToolContext,
    Worker,
    open_stores,
    tool,
)
from tesserix_adk.cli.main import main as tesserix
from tesserix_adk.errors import AdkError
from tesserix_adk.messages import Message, Role
from tesserix_adk.stores.protocols import WorkState
from tesserix_adk.testing.faults import (
    FaultyCheckpointStore,
    FaultyIdempotencyStore,
    SimulatedCrash,
)

T = "lifecycle-oracle"
TTL = 0.3
FAST = Backoff(base=0.01, cap=0.05)
ECONOMY = "Book me FRA to JFK."
BUSINESS = "Book me LH400 in business, then a seat on UA961."
PLANS: dict[str, list[Any]] = {
    ECONOMY: [
        [("search_flights", {"origin": "FRA", "dest": "JFK"})],
        [("book_seat", {"flight": "LH400"})],
        "Booked LH400.",
    ],
    BUSINESS: [
        [("book_business", {"flight": "LH400"})],
        [("book_seat", {"flight": "UA961"})],
        "Done.",
    ],
}
FAULTS = (
    "none",
    "before_first_frontier",
    "after_claim",
    "tool_before",
    "tool_after",
    "after_outcome",
    "after_any_claim",  # the first claim of any tool (the search's too)
    "after_any_outcome",
)
# Deaths that leave a booking's claim in flight with no outcome: truly in doubt.
IN_DOUBT = ("after_claim", "after_any_claim", "tool_before", "tool_after")
EXIT_CODES = {0, 1, 3, 4}
LONG_REASON = "the traveller called to say the trip is off; " * 120  # past 4,000 characters


class Airline:
    """The outside world and the oracle: every booking by idempotency key, the next death,
    and the keys a death left in flight (the oracle knows whether each was booked)."""

    def __init__(self) -> None:
        self.effects: Counter[str] = Counter()
        self.of_run: dict[str, list[tuple[str, str, str]]] = {}  # run -> (tool, flight, key)
        self.fault = "none"
        self.died_in_flight: dict[str, str] = {}  # key -> run, a claim a death left
        self.fired: list[str] = []

    def fire(self, point: str, key: str | None = None, run_id: str | None = None) -> None:
        if self.fault != point:
            return
        self.fault = "none"
        self.fired.append(point)
        if point in IN_DOUBT and key is not None and run_id is not None:
            self.died_in_flight[key] = run_id
        raise SimulatedCrash(f"died at {point}")

    async def book(self, tool_name: str, flight: str, ctx: ToolContext) -> dict[str, str]:
        key = ctx.idempotency_key
        assert key is not None
        self.fire("tool_before", key, ctx.run_id)
        self.effects[key] += 1
        self.of_run.setdefault(ctx.run_id, []).append((tool_name, flight, key))
        self.fire("tool_after", key, ctx.run_id)
        return {"booking": f"BK-{flight}", "tool": tool_name}

    def booked(self, run_id: str) -> Counter[tuple[str, str]]:
        return Counter((t, f) for t, f, _ in self.of_run.get(run_id, []))


def booking_agent(airline: Airline) -> Agent:
    @tool(side_effects=False)
    async def search_flights(origin: str, dest: str) -> list[str]:
        """Find flights between two airports."""
        return ["LH400", "UA961"]

    @tool
    async def book_seat(flight: str, ctx: ToolContext) -> dict[str, str]:
        """Book one economy seat on a flight."""
        return await airline.book("book_seat", flight, ctx)

    @tool(requires_approval=True)
    async def book_business(flight: str, ctx: ToolContext) -> dict[str, str]:
        """Book one business seat on a flight (a person approves it)."""
        return await airline.book("book_business", flight, ctx)

    return Agent(
        "booking", "Book the flight the user asks for.", [search_flights, book_seat, book_business]
    )


class PlanModel:
    """Plays the plan of the user's message, turn by turn; the turn is chosen by counting
    assistant messages, so a fresh attempt carries on where a dead one stopped."""

    async def complete(self, request: ModelRequest) -> ModelResponse:
        user = next(m for m in request.messages if m.role is Role.user)
        plan = PLANS[str(user.content)]
        asked = sum(1 for m in request.messages if m.role is Role.assistant)
        turn = plan[min(asked, len(plan) - 1)]
        if isinstance(turn, str):
            return ModelResponse(message=Message(role=Role.assistant, content=turn))
        calls = [
            ToolCall(id=f"c{asked}_{n}", name=name, arguments=args)
            for n, (name, args) in enumerate(turn)
        ]
        return ModelResponse(message=Message(role=Role.assistant, content="", tool_calls=calls))


def cli(url: str, *argv: str) -> tuple[int, str, str]:
    """``tesserix ARGV --store URL`` in this process (its own event loop, in a thread)."""
    out, err = io.StringIO(), io.StringIO()
    got: list[int] = []
    raised: list[BaseException] = []

    def go() -> None:
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                got.append(tesserix([*argv, "--store", url]))
        except BaseException as exc:  # a traceback out of the CLI is a finding
            raised.append(exc)

    thread = threading.Thread(target=go)
    thread.start()
    thread.join(60)
    assert not raised, f"tesserix {argv} raised {raised[0]!r}"
    assert got, f"tesserix {argv} did not return"
    return got[0], out.getvalue(), err.getvalue()


def typed(code: int, err: str, what: Any) -> None:
    """A refusal is a known exit code and one sentence, never a traceback."""
    assert code in EXIT_CODES, (what, code, err)
    if code:
        assert "Traceback" not in err, (what, err)


class Site:
    """One SQLite file, its stores open on one event loop, the airline and the agent."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="lifecycle-oracle-"))
        self.url = f"sqlite:///{self.dir / 'adk.sqlite3'}"
        self.loop = asyncio.new_event_loop()
        self.airline = Airline()
        self.agent = booking_agent(self.airline)
        self.stores: Any = self.wait(self._open())

    async def _open(self) -> Any:
        stores = open_stores(self.url)
        await stores.__aenter__()
        await stores.create_schema()
        return stores

    def wait(self, coro: Any, timeout: float = 30.0) -> Any:
        return self.loop.run_until_complete(asyncio.wait_for(coro, timeout))

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.wait(self.stores.__aexit__(None, None, None))
        self.loop.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def runner(self) -> AgentRunner:
        """A runner over the file's stores, its checkpoints and claims wrapped by the kit's
        fault stand-ins, which die where the airline's armed fault says."""
        airline = self.airline

        def idempotency_hook(phase: str, op: str, key: str) -> None:
            if phase != "after" or key not in calls:
                return
            run_id, tool_name = calls[key]
            if op == "claim":
                airline.fire("after_any_claim", key, run_id)
            if op == "complete":
                airline.fire("after_any_outcome", key)
            if not tool_name.startswith("book_"):  # the other deaths: around bookings
                return
            if op == "claim":
                airline.fire("after_claim", key, run_id)
            if op == "complete":
                airline.fire("after_outcome", key)

        calls: dict[str, tuple[str, str]] = {}  # a tool call's key -> its run and tool

        class Claims(FaultyIdempotencyStore):
            async def claim(self, key: str, **kwargs: Any) -> Any:
                if kwargs.get("tool") is not None:
                    calls[key] = (kwargs["run_id"], str(kwargs["tool"]))
                return await super().claim(key, **kwargs)

        def first_frontier(body: dict[str, Any]) -> bool:
            if airline.fault == "before_first_frontier" and body.get("step") in (0, 1, None):
                airline.fire("before_first_frontier")
            return False

        checkpoints = Checkpointer(
            FaultyCheckpointStore(self.stores.checkpoints, crash_before=first_frontier),
            history=self.stores.history,
        )
        return AgentRunner(
            PlanModel(),
            idempotency=Claims(self.stores.idempotency, hook=idempotency_hook),
            checkpoints=checkpoints,
            leases=self.stores.leases,
            ledger=self.stores.ledger,
            approvals=self.stores.approvals,
            work=self.stores.work,
            lease_policy=LeasePolicy(ttl=TTL, renew_within=TTL / 2),
            resume_claim_ttl=TTL,
            never_ran_margin=0.05,
        )

    # --- what users, workers and operators do ------------------------------------------

    async def start(self, run_id: str, text: str, fault: str, stop_at: int | None) -> str:
        self.airline.fault = fault
        try:
            run = await self.runner().run(
                self.agent, text, tenant=T, run_id=run_id, stop=_stop_at(stop_at)
            )
            return str(run.status)
        except AdkError as exc:
            return type(exc).__name__
        except SimulatedCrash:
            return "died"
        finally:
            self.airline.fault = "none"

    async def carry(self, run_id: str, fault: str, stop_at: int | None) -> str:
        self.airline.fault = fault
        try:
            run = await self.runner().resume(self.agent, run_id, tenant=T, stop=_stop_at(stop_at))
            return str(run.status)
        except AdkError as exc:
            return type(exc).__name__
        except SimulatedCrash:
            return "died"
        finally:
            self.airline.fault = "none"

    async def work(self, fault: str) -> list[str]:
        self.airline.fault = fault
        try:
            worker = Worker(
                self.runner(),
                [self.agent],
                exit_when_idle=True,
                poll_interval=0.01,
                backoff=FAST,
                drain_timeout=5,
            )
            with contextlib.suppress(SimulatedCrash):
                await asyncio.wait_for(worker.run(), 20)
            return [str(how) for _, how in worker.carried]
        finally:
            self.airline.fault = "none"

    async def cancel(self, run_id: str, reason: str) -> str:
        try:
            run = await self.runner().cancel(run_id, tenant=T, by="carol", reason=reason)
        except AdkError as exc:
            return type(exc).__name__
        return "requested" if run is None else str(run.status)

    def lapse(self) -> None:
        self.wait(asyncio.sleep(TTL + 0.1))

    # --- what the stores and the CLI say -----------------------------------------------

    def runs(self, *extra: str) -> dict[str, dict[str, Any]]:
        code, out, err = cli(self.url, "runs", "--tenant", T, "--json", *extra)
        assert code == 0, err
        return {r["run_id"]: r for r in json.loads(out)["runs"]}

    def inspect(self, run_id: str) -> dict[str, Any] | None:
        code, out, err = cli(self.url, "inspect", run_id, "--tenant", T, "--json")
        typed(code, err, ("inspect", run_id))
        return json.loads(out) if code == 0 else None

    def show(self, run_id: str) -> dict[str, Any] | None:
        code, out, err = cli(self.url, "show", run_id, "--tenant", T, "--json")
        typed(code, err, ("show", run_id))
        return json.loads(out) if code == 0 else None

    def index(self) -> dict[str, Any]:
        return {i.run_id: i for i in self.wait(self.stores.work.items(T))}


def _stop_at(n: int | None) -> Any:
    """A drain asked at the n-th boundary the run asks about (``None``: never)."""
    if n is None:
        return None
    asked = [0]

    def stop() -> str | None:
        asked[0] += 1
        return "its worker is draining" if asked[0] == n else None

    return stop


def expected_bookings(text: str, approved: bool | None) -> Counter[tuple[str, str]]:
    """What a completed run of ``text`` booked: its economy seat, and its business seat
    when the person approved it."""
    if text == ECONOMY:
        return Counter({("book_seat", "LH400"): 1})
    want = Counter({("book_seat", "UA961"): 1})
    if approved:
        want[("book_business", "LH400")] += 1
    return want


class LifeOfARun(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.site = Site()
        self.texts: dict[str, str] = {}  # run -> its input
        self.approved: dict[str, bool] = {}  # run -> the person's decision
        self.cancel_mark: dict[str, int] = {}  # run -> bookings when its cancel was recorded
        self.checked_done: set[str] = set()

    def teardown(self) -> None:
        try:
            if self.texts:
                self.drive_to_rest()
        finally:
            self.site.close()

    @property
    def run_ids(self) -> list[str]:
        return list(self.texts)

    def _run(self, i: int) -> str:
        return self.run_ids[i % len(self.run_ids)]

    # --- rules ---------------------------------------------------------------------------

    @precondition(lambda self: len(self.texts) < 4)
    @rule(text=st.sampled_from((ECONOMY, BUSINESS)))
    def submit(self, text: str) -> None:
        run_id = f"r{len(self.texts)}"
        self.site.wait(self.site.runner().submit(self.site.agent, text, tenant=T, run_id=run_id))
        self.texts[run_id] = text

    @precondition(lambda self: len(self.texts) < 4)
    @rule(
        text=st.sampled_from((ECONOMY, BUSINESS)),
        fault=st.sampled_from(FAULTS),
        stop_at=st.sampled_from((None, None, 1, 2, 3)),
    )
    def start(self, text: str, fault: str, stop_at: int | None) -> None:
        run_id = f"r{len(self.texts)}"
        self.texts[run_id] = text
        got = self.site.wait(self.site.start(run_id, text, fault, stop_at))
        event(f"run() {fault} stop@{stop_at}: {got}")

    @precondition(lambda self: self.texts)
    @rule(
        i=st.integers(0, 3),
        fault=st.sampled_from(FAULTS),
        stop_at=st.sampled_from((None, None, 1, 2, 3)),
    )
    def carry(self, i: int, fault: str, stop_at: int | None) -> None:
        got = self.site.wait(self.site.carry(self._run(i), fault, stop_at))
        event(f"resume {fault} stop@{stop_at}: {got}")

    @precondition(lambda self: self.texts)
    @rule(fault=st.sampled_from(FAULTS))
    def work(self, fault: str) -> None:
        got = self.site.wait(self.site.work(fault), timeout=40)
        event(f"worker {fault}: {sorted(got)}")

    @rule()
    def leases_lapse(self) -> None:
        self.site.lapse()

    @precondition(lambda self: self.texts)
    @rule(i=st.integers(0, 3), long=st.booleans())
    def cancel(self, i: int, long: bool) -> None:
        """``tesserix cancel`` with a short reason; a long one (past the CLI's 4,000
        characters) through the Python API, which cuts it in the cancelled frontier."""
        run_id = self._run(i)
        if long:
            got = self.site.wait(self.site.cancel(run_id, LONG_REASON))
            event(f"cancel long: {got}")
            code = 0
        else:
            code, _out, err = cli(
                self.site.url, "cancel", run_id, "--tenant", T, "--by", "carol", "--reason", "off"
            )
            typed(code, err, ("cancel", run_id))
            event(f"cancel short: exit {code}")
        if code == 0:
            self.cancel_mark.setdefault(run_id, len(self.site.airline.of_run.get(run_id, [])))

    @precondition(lambda self: self.texts)
    @rule(i=st.integers(0, 3))
    def resolve(self, i: int) -> None:
        self._resolve_truthfully(self._run(i))

    def _resolve_truthfully(self, run_id: str) -> bool:
        """An operator looks each call in doubt up in the airline and says what happened."""
        shown = self.site.inspect(run_id)
        moved = False
        for call in [] if shown is None else shown["calls"]:
            if call["disposition"] != "indeterminate":
                continue
            code, _out, err = resolve_as_airline_knows(self.site, run_id, call)
            typed(code, err, ("resolve", run_id, call))
            event(f"resolve: exit {code}")
            if code == 0:
                self.site.airline.died_in_flight.pop(call["key"], None)
                moved = True
        return moved

    @precondition(lambda self: self.texts)
    @rule(i=st.integers(0, 3), deny=st.booleans())
    def decide(self, i: int, deny: bool) -> None:
        run_id = self._run(i)
        shown = self.site.inspect(run_id)
        approval = (shown or {}).get("approval") or {}
        if not approval.get("id"):
            return
        argv = ["approve", approval["id"], "--tenant", T, "--by", "dana", "--json"]
        code, out, err = cli(self.site.url, *([*argv, "--deny"] if deny else argv))
        typed(code, err, ("approve", run_id, deny))
        event(f"decide deny={deny}: exit {code}")
        if code == 0:
            self.approved.setdefault(run_id, bool(json.loads(out).get("approved", not deny)))

    # --- invariants ----------------------------------------------------------------------

    @invariant()
    def one_booking_per_idempotency_key(self) -> None:
        twice = {k: n for k, n in self.site.airline.effects.items() if n > 1}
        assert not twice, f"booked twice: {twice}"

    @invariant()
    def a_cancelled_run_books_nothing_after_its_cancel(self) -> None:
        for run_id, mark in self.cancel_mark.items():
            now = len(self.site.airline.of_run.get(run_id, []))
            assert now == mark, f"{run_id} booked {now - mark} after its cancel was recorded"

    @invariant()
    def runs_are_where_the_oracle_says(self) -> None:
        if not self.texts:
            return
        check_runs(self)

    def drive_to_rest(self) -> None:
        """Workers and truthful operators until nothing moves; then every run has finished
        or waits on a person."""
        site = self.site
        for _ in range(8):
            site.lapse()
            site.wait(site.work("none"), timeout=40)
            moved = False
            for run_id in self.run_ids:
                moved = self._resolve_truthfully(run_id) or moved
            if not moved and not site.wait(site.stores.work.due(limit=10)):
                break
        self.one_booking_per_idempotency_key()
        self.a_cancelled_run_books_nothing_after_its_cancel()
        check_runs(self)
        unended = {r: e for r in self.run_ids if (e := not_at_rest(site, r)) is not None}
        assert not unended, f"runs not at rest once everyone acted: {unended}"


def resolve_as_airline_knows(site: Site, run_id: str, call: dict[str, Any]) -> Any:
    """``tesserix resolve`` saying what the airline says of the call's key: never ran, or
    its booking."""
    key = call["key"]
    booked = [(t, f) for t, f, k in site.airline.of_run.get(run_id, []) if k == key]
    if not booked and not site.airline.effects[key]:
        how = ["--never-ran", "--margin", "0"]
    else:
        tool_name, flight = booked[0] if booked else (call["tool"], "?")
        how = ["--outcome", json.dumps({"booking": f"BK-{flight}", "tool": tool_name})]
    return cli(
        site.url, "resolve", run_id, "--tenant", T, "--call", call["call_id"], *how, "--by", "ops"
    )


def not_at_rest(site: Site, run_id: str) -> Any:
    """``None`` for a run that finished or waits on a person; else what it is."""
    listed = site.runs().get(run_id)
    if listed is None:
        return ("not listed", site.index().get(run_id))
    if listed["status"] in ("completed", "cancelled"):
        return None
    if listed["status"] == "waiting_approval":
        shown = site.inspect(run_id)
        if (shown or {}).get("approval", {}) and shown["approval"].get("status") == "pending":
            return None
    return listed


def check_runs(machine: LifeOfARun) -> None:
    site = machine.site
    airline = site.airline
    runs = site.runs()
    stuck = site.runs("--stuck")
    index = site.index()
    for run_id, text in machine.texts.items():
        listed = runs.get(run_id)
        item = index.get(run_id)
        status = None if listed is None else listed["status"]
        # A completed run has exactly its bookings, and its final frontier says so.
        if status == "completed" and run_id not in machine.checked_done:
            want = expected_bookings(text, machine.approved.get(run_id))
            assert airline.booked(run_id) == want, (run_id, airline.booked(run_id), want)
            shown = site.show(run_id)
            assert shown is not None and shown["status"] == "completed", (run_id, shown)
            assert shown["output"] == PLANS[text][-1], (run_id, shown["output"])
            said = Counter(
                (c["outcome"]["tool"], c["outcome"]["booking"].removeprefix("BK-"))
                for c in shown["calls"]
                if c["tool"].startswith("book")
                and c["status"] == "completed"
                and not c["is_error"]
                and isinstance(c["outcome"], dict)
            )
            assert said == want, ("the final frontier says otherwise", run_id, said, want)
            machine.checked_done.add(run_id)
        # Parked (or listed by ``runs --stuck``) only while a call is truly in doubt, or a
        # person must decide.
        parked = (item is not None and item.state is WorkState.parked) or run_id in stuck
        if parked:
            shown = site.inspect(run_id)
            assert shown is not None, (run_id, "parked, and inspect refuses")
            doubt = [
                c
                for c in shown["calls"]
                if c["disposition"] == "indeterminate" and c["key"] in airline.died_in_flight
            ]
            pending = (shown.get("approval") or {}).get("status") == "pending"
            assert doubt or pending, (
                f"{run_id} parked with no call truly in doubt and nobody to decide",
                status,
                item,
                shown["parked"] or shown["reason"],
                [(c["tool"], c["disposition"]) for c in shown["calls"]],
                airline.fired,
            )
        # Never stranded: unfinished, not waiting on a person, not parked: due for a worker.
        if status in ("completed", "cancelled") or parked:
            continue
        if item is not None and item.state in (
            WorkState.decided,
            WorkState.wanted,
            WorkState.submitted,
        ):
            continue
        if status == "waiting_approval":
            shown = site.inspect(run_id)
            if ((shown or {}).get("approval") or {}).get("status") == "pending":
                continue
        raise AssertionError(("stranded", run_id, listed, item))


LifeOfARun.TestCase.settings = settings(
    # A short profile in CI; ADK_SLOW=1 (or LIFECYCLE_EXAMPLES=N) looks further.
    max_examples=int(
        os.environ.get("LIFECYCLE_EXAMPLES", "25" if os.environ.get("ADK_SLOW") == "1" else "6")
    ),
    phases=[Phase.explicit, Phase.reuse, Phase.generate]
    + ([] if os.environ.get("LIFECYCLE_NO_SHRINK") else [Phase.shrink]),
    stateful_step_count=10,
    deadline=None,
    suppress_health_check=list(HealthCheck),
)
TestLifeOfARun = LifeOfARun.TestCase


# --- the machine's points, one by one, as plain reproductions -----------------------------


def _site_run(site: Site, run_id: str) -> dict[str, Any]:
    listed = site.runs().get(run_id)
    assert listed is not None, run_id
    return listed


def test_a_start_dead_before_its_first_frontier_is_started_by_a_worker_and_books_once() -> None:
    site = Site()
    try:
        assert site.wait(site.start("a", ECONOMY, "before_first_frontier", None)) == "died"
        site.lapse()
        site.wait(site.work("none"))
        assert _site_run(site, "a")["status"] == "completed"
        assert site.airline.booked("a") == Counter({("book_seat", "LH400"): 1})
    finally:
        site.close()


def test_a_death_inside_the_booking_parks_the_run_until_an_operator_says_it_was_made() -> None:
    site = Site()
    try:
        assert site.wait(site.start("a", ECONOMY, "tool_after", None)) == "died"
        site.lapse()
        site.wait(site.work("none"))
        shown = site.inspect("a")
        assert shown is not None
        doubt = [c for c in shown["calls"] if c["disposition"] == "indeterminate"]
        assert [c["tool"] for c in doubt] == ["book_seat"], shown["calls"]
        assert site.index()["a"].state is WorkState.parked
        code, _out, err = resolve_as_airline_knows(site, "a", doubt[0])
        assert code == 0, err
        site.lapse()
        site.wait(site.work("none"))
        assert _site_run(site, "a")["status"] == "completed"
        assert site.airline.effects and set(site.airline.effects.values()) == {1}
    finally:
        site.close()


def test_a_death_right_after_the_claim_is_sent_once_the_operator_says_it_never_ran() -> None:
    site = Site()
    try:
        assert site.wait(site.start("a", ECONOMY, "after_claim", None)) == "died"
        assert not site.airline.effects
        site.lapse()
        site.wait(site.work("none"))
        shown = site.inspect("a")
        assert shown is not None
        doubt = [c for c in shown["calls"] if c["disposition"] == "indeterminate"]
        assert len(doubt) == 1, shown["calls"]
        code, _out, err = resolve_as_airline_knows(site, "a", doubt[0])
        assert code == 0, err
        site.lapse()
        site.wait(site.work("none"))
        assert _site_run(site, "a")["status"] == "completed"
        assert site.airline.booked("a") == Counter({("book_seat", "LH400"): 1})
    finally:
        site.close()


def test_a_cancel_recorded_under_a_dead_attempts_lease_ends_the_run_sending_nothing() -> None:
    site = Site()
    try:
        site.wait(site.runner().submit(site.agent, BUSINESS, tenant=T, run_id="a"))
        site.wait(site.work("none"))  # waits for a person
        shown = site.inspect("a")
        assert shown is not None and shown["approval"]["status"] == "pending"
        code, _out, err = cli(
            site.url, "approve", shown["approval"]["id"], "--tenant", T, "--by", "dana"
        )
        assert code == 0, err
        code, _out, err = cli(site.url, "cancel", "a", "--tenant", T, "--by", "carol")
        assert code == 0, err
        site.lapse()
        site.wait(site.work("none"))
        assert _site_run(site, "a")["status"] == "cancelled"
        assert not site.airline.effects, site.airline.of_run
    finally:
        site.close()


def test_a_long_cancel_reason_is_cut_in_the_frontier_and_the_run_sends_nothing_more() -> None:
    site = Site()
    try:
        assert site.wait(site.start("a", ECONOMY, "none", 2)) == "RunStoppedError"
        assert site.wait(site.cancel("a", LONG_REASON)) == "cancelled"
        shown = site.show("a")
        assert shown is not None and shown["status"] == "cancelled"
        assert len(shown["reason"] or "") < len(LONG_REASON), len(shown["reason"] or "")
        site.lapse()
        site.wait(site.work("none"))
        assert site.wait(site.carry("a", "none", None)) == "cancelled"
        assert not site.airline.effects
    finally:
        site.close()


def test_runs_stuck_leaves_out_a_due_run_whose_only_open_call_is_safe_to_send_again() -> None:
    site = Site()
    try:
        # The process dies right after the read-only search's claim.
        assert site.wait(site.start("a", ECONOMY, "after_any_claim", None)) == "died"
        site.lapse()
        shown = site.inspect("a")
        assert shown is not None
        assert [(c["tool"], c["disposition"]) for c in shown["calls"]] == [
            ("search_flights", "never_ran")
        ]
        assert site.index()["a"].state is WorkState.wanted  # due: a worker carries it on
        assert "a" not in site.runs("--stuck"), "listed as waiting for a person"
    finally:
        site.close()


def test_a_death_after_a_read_only_claim_is_carried_on_by_a_worker_with_one_booking() -> None:
    site = Site()
    try:
        assert site.wait(site.start("a", ECONOMY, "after_any_claim", None)) == "died"
        site.lapse()
        site.wait(site.work("none"))
        assert _site_run(site, "a")["status"] == "completed"
        assert site.airline.booked("a") == Counter({("book_seat", "LH400"): 1})
        assert "a" not in site.runs("--stuck")
    finally:
        site.close()
