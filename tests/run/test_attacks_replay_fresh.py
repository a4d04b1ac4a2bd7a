"""A fresh attacker's look at replay for debugging (README "Replay", ``run/replay.py``,
``tesserix replay``), going where ``tests/test_attacks_replay_debugging.py``,
``tests/cli/test_attacks_replay_display.py``, ``tests/run/test_attacks_replay_today.py`` and
``tests/run/test_attacks_decisions.py`` did not: a state that lost a secret, a tool whose
revision changed, a replay from a run's final step, a start that left only spend behind,
approvals, removed tools, concurrent replays of one id, failed and cancelled originals on
Redis and PostgreSQL, and a worker carrying the original while it is replayed.

Found, and fixed (``replay.usable_step`` refuses an unstubbed call the step recorded as
side-effecting and, on a step whose state lost a secret, any unstubbed tool that takes
``ctx``; a replay from a final step writes that frontier as its own
(``loop.end_as_ended``); ``_refuse_taken`` reads the ledger; ``runner.submit`` refuses a
replay's id and another agent's run, ``submitting.refuse_another_start``):

1. MEDIUM ``test_a_read_only_tool_is_not_handed_the_mask_of_a_redacted_state``: a replay
   from a step whose state lost a token to masking (``state_redacted``) refuses only tools
   named ``live``; a read-only tool (neither stubbed nor live) runs for real and reads
   ``[redacted:token]`` from ``ctx.state`` as if it were the credential
   (``replay.usable_step`` checks ``live`` only, while a masked *argument* demands a stub
   of any tool).
2. MEDIUM ``test_a_call_the_step_recorded_as_side_effecting_is_never_sent_unstubbed``: the
   step's outstanding ``pay`` is recorded ``side_effects=True``; replayed under an agent
   revision that re-marks ``pay`` read-only, ``check_stubs`` (which reads only the agent
   given) lets it through and the real payment goes out a second time, unstubbed and not
   named live. (``resume`` refuses such a revision change; ``replay.check_stubs`` never
   looks at ``OutstandingCall.side_effects``.)
3. MEDIUM ``test_a_replay_from_the_final_step_leaves_a_run_the_operator_can_show``: a
   replay from a run's final step (``cp.status.finished``) returns, and ``tesserix replay
   --json`` prints, a ``run_id`` no store holds (``replay_from`` returns
   ``finished_run(replayed)`` without writing): ``tesserix show`` of the id it printed
   says there is no such run, and the same ``--new-run-id`` is accepted again.
4. MEDIUM ``test_a_replay_never_takes_the_id_of_a_start_that_left_only_its_spend``: on a
   runner without a work index, a start that died before its first frontier leaves spend in
   the ledger and nothing else; ``replay._refuse_taken`` looks only at frontiers,
   submissions and call records, so a replay takes the id: the replay's ledger holds the
   dead start's spend (its own is 0), and the real run's retry is refused
   ("already has a frontier; resume it"), a resume giving back the replay's stubbed end.
5. MEDIUM ``test_a_submission_under_a_replays_id_is_refused``: ``submit()`` of another
   input under a finished replay's id returns the id as if submitted (no error); a client
   then reads the replay's stubbed booking as its run's outcome. ``runner.submit`` tells
   another request apart only by a kept submission, and a replay keeps none.

Held: a replay naming the approval-guarded tool ``live`` asks again under its own id from
every step (before, at and after the original's approval), never booking; a tool removed
from the agent is answered "unknown tool" and a tool whose parameters changed refuses the
call, stub unused, nothing sent; two concurrent replays under one ``new_run_id`` make one
replay (one stub call), the other refused; an id that only holds a cancel request is
refused; on Redis and PostgreSQL, replays from every step of a failed and of a cancelled
original complete with stubs, send nothing real, leave the original's frontier and steps
as they were, and keep the secret masked in the replay's own frontier; a worker resuming a
crashed original while it is replayed (PostgreSQL) books once, the replay's stub once; a
``run()`` under a replay's id is refused (``RunStartedError``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from adapters import services
from booking import BOOK_TURNS, Airline, booking_agent
from operator_cli import cli
from tesserix_adk import (
    Agent,
    AgentRunner,
    Checkpointer,
    ConfigurationError,
    ProviderError,
    RunStatus,
    ScriptedProvider,
    ScriptedTurn,
    ToolContext,
    open_stores,
    tool,
)
from tesserix_adk.errors import LeaseHeldError, RunStartedError
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.testing.faults import FaultyCheckpointStore, SimulatedCrash

from .helpers import at
from .replaying import TOKEN, fresh, new_id, sqlite, step_with, stub_booking

HERE = "run.test_attacks_replay_fresh"


# ==========================================================================================
# Defects
# ==========================================================================================


class Creds(BaseModel):
    token: str = ""


async def test_a_read_only_tool_is_not_handed_the_mask_of_a_redacted_state(
    tmp_path: Path,
) -> None:
    seen: list[str] = []

    @tool
    def login(order: str, ctx: ToolContext) -> str:
        """Log in: keeps the session token in the run's state."""
        ctx.state.token = TOKEN
        return "in"

    @tool(side_effects=False)
    def fetch(order: str, ctx: ToolContext) -> str:
        """Read the order from an API with the session token."""
        seen.append(ctx.state.token)
        return "ok"

    agent = Agent("creds", "x", [login, fetch], state_schema=Creds)
    turns = [[("login", {"order": "o"})], [("fetch", {"order": "o"})], "done"]
    rid = new_id()
    async with sqlite(tmp_path) as stores:
        run = await fresh(stores, turns).run(agent, "go", tenant="t", run_id=rid, state=Creds())
        assert run.status is RunStatus.completed and seen == [TOKEN]
        step = await step_with(stores, rid, "fetch")
        cp = await fresh(stores).checkpoints.at("t", rid, step)  # type: ignore[union-attr]
        assert cp is not None and cp.state_redacted
        seen.clear()
        with contextlib.suppress(ConfigurationError):
            await fresh(stores, turns).replay(
                agent, rid, tenant="t", from_step=step, stubs={"login": lambda order: "in"}
            )
    # Refused before anything ran, or fetch went to a stub: never the mask as a credential.
    assert seen == [], f"a real read-only call was handed {seen!r} as its credential"


async def test_a_call_the_step_recorded_as_side_effecting_is_never_sent_unstubbed(
    tmp_path: Path,
) -> None:
    airline = Airline()
    rid = new_id()
    async with sqlite(tmp_path) as stores:
        await fresh(stores).run(booking_agent(airline), "go", tenant="t", run_id=rid)
        assert airline.bookings == ["LH123"]
        step = await step_with(stores, rid, "book_seat")
        cp = await fresh(stores).checkpoints.at("t", rid, step)  # type: ignore[union-attr]
        assert cp is not None and [oc.side_effects for oc in cp.outstanding] == [True]

        # The next revision (wrongly) says booking is read-only.
        @tool(side_effects=False)
        def search_flights(origin: str, dest: str) -> list[str]:
            """Find flights."""
            return ["LH123"]

        @tool(side_effects=False)
        def book_seat(flight: str) -> dict[str, str]:
            """Book one seat."""
            airline.bookings.append(flight)
            return {"booking": "B2"}

        changed = Agent("booking", "Book.", [search_flights, book_seat])
        with contextlib.suppress(ConfigurationError):
            await fresh(stores).replay(changed, rid, tenant="t", from_step=step, stubs={})
    assert airline.bookings == ["LH123"], "the replay booked the seat a second time for real"


AIRLINE = Airline()
AGENT = booking_agent(AIRLINE)


def provider() -> ScriptedProvider:
    return ScriptedProvider(BOOK_TURNS)


def test_a_replay_from_the_final_step_leaves_a_run_the_operator_can_show(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("ADK_DEBUG", raising=False)
    url = f"sqlite:///{tmp_path / 'adk.sqlite3'}"
    rid, new = new_id(), new_id("rep")

    async def build() -> int:
        async with open_stores(url) as stores:
            await stores.create_schema()
            await fresh(stores).run(AGENT, "go", tenant="t", run_id=rid)
            return max(await stores.checkpoints.steps("t", rid))

    last = asyncio.run(build())
    replay = ("--store", url, "replay", rid, "--tenant", "t", "--from-step", str(last))
    code, out, err = cli(
        *replay,
        *("--agent", f"{HERE}:AGENT", "--provider", f"{HERE}:provider"),
        *("--stub", "book_seat=booking:fake_booking", "--new-run-id", new, "--json"),
    )
    if code != 0:
        return  # refused (one sentence): nothing to show, as it should be
    printed = json.loads(out)
    assert printed["run_id"] == new
    code, _shown, err = cli("--store", url, "show", new, "--tenant", "t", "--json")
    assert code == 0, f"replay printed run {new!r}, and show says: {err.strip()}"


async def test_a_replay_never_takes_the_id_of_a_start_that_left_only_its_spend(
    tmp_path: Path,
) -> None:
    turns = [
        ScriptedTurn(calls=[("search_flights", {"origin": "FRA", "dest": "JFK"})], cost_micros=500),
        ScriptedTurn(calls=[("book_seat", {"flight": "LH123"})], cost_micros=500),
        "Booked.",
    ]
    agent = booking_agent(Airline())

    def bare(stores: Stores, store: Any = None) -> AgentRunner:
        return AgentRunner(
            ScriptedProvider(turns),
            idempotency=stores.idempotency,
            checkpoints=Checkpointer(store or stores.checkpoints, history=stores.history),
            leases=stores.leases,
            ledger=stores.ledger,
            approvals=stores.approvals,
        )

    rid, dead = new_id(), new_id("dead")
    async with sqlite(tmp_path) as stores:
        await bare(stores).run(agent, "go", tenant="t", run_id=rid)
        crashing = FaultyCheckpointStore(stores.checkpoints, crash_before=at("after_model_call", 0))
        with pytest.raises(SimulatedCrash):
            await bare(stores, crashing).run(agent, "go", tenant="t", run_id=dead)
        assert stores.ledger is not None and await stores.ledger.spent("t", dead) == 500
        assert await stores.checkpoints.latest("t", dead) is None
        with pytest.raises(ConfigurationError, match="already exists"):
            await bare(stores).replay(
                agent, rid, tenant="t", from_step=3, stubs={"book_seat": stub_booking},
                new_run_id=dead,
            )  # fmt: skip


async def test_a_submission_under_a_replays_id_is_refused(tmp_path: Path) -> None:
    airline = Airline()
    agent = booking_agent(airline)
    rid = new_id()
    async with sqlite(tmp_path) as stores:
        await fresh(stores).run(agent, "go", tenant="t", run_id=rid)
        rep = await fresh(stores).replay(
            agent, rid, tenant="t", from_step=3, stubs={"book_seat": stub_booking}
        )
        assert rep.status is RunStatus.completed
        with pytest.raises(RunStartedError):
            await fresh(stores).submit(agent, "book UA456", tenant="t", run_id=rep.run_id)


# ==========================================================================================
# What held
# ==========================================================================================


async def test_a_live_replay_asks_for_approval_again_from_every_step(tmp_path: Path) -> None:
    """The original's booking was approved by a person; a replay naming ``book_seat``
    live, from every step that holds it, asks under its own id and books nothing."""
    airline = Airline()
    agent = booking_agent(airline, approval=True)
    rid = new_id()
    async with sqlite(tmp_path) as stores:
        run = await fresh(stores).run(agent, "go", tenant="t", run_id=rid)
        assert run.pending_approval is not None
        await stores.approvals.decide("t", run.pending_approval.id, approved=True, by="alice")  # type: ignore[union-attr]
        assert (await fresh(stores).resume(agent, rid, tenant="t")).status is RunStatus.completed
        assert airline.bookings == ["LH123"]
        checkpoints = fresh(stores).checkpoints
        assert checkpoints is not None
        replayed_from = []
        for step in await stores.checkpoints.steps("t", rid):
            cp = await checkpoints.at("t", rid, step)
            assert cp is not None
            if not any(oc.call.name == "book_seat" for oc in cp.outstanding):
                continue
            replayed_from.append(step)
            rep = await fresh(stores).replay(
                agent, rid, tenant="t", from_step=step, stubs={}, live=["book_seat"]
            )
            assert rep.status is RunStatus.waiting_approval
            assert rep.pending_approval is not None and rep.pending_approval.run_id == rep.run_id
        assert len(replayed_from) >= 2
    assert airline.bookings == ["LH123"]


async def test_a_removed_or_changed_tool_sends_nothing_and_leaves_the_stub_unused(
    tmp_path: Path,
) -> None:
    airline = Airline()
    sent: list[Any] = []
    rid = new_id()

    @tool(side_effects=False)
    def search_flights(origin: str, dest: str) -> list[str]:
        """Find flights."""
        return ["LH123"]

    @tool
    def reserve(flight: str) -> str:
        """The booking tool's new name."""
        sent.append(flight)
        return "reserved"

    @tool
    def book_seat(flight: str, seats: int) -> str:
        """Booking now wants a seat count."""
        sent.append(flight)
        return "booked"

    async with sqlite(tmp_path) as stores:
        await fresh(stores).run(booking_agent(airline), "go", tenant="t", run_id=rid)
        step = await step_with(stores, rid, "book_seat")
        removed = Agent("booking", "Book.", [search_flights, reserve])
        rep = await fresh(stores).replay(
            removed, rid, tenant="t", from_step=step, stubs={"reserve": lambda flight: "s"}
        )
        assert rep.status is RunStatus.completed
        checkpoints = fresh(stores).checkpoints
        assert checkpoints is not None
        cp = await checkpoints.latest("t", rep.run_id)
        assert cp is not None
        told = [m.content for m in await checkpoints.messages(cp) if m.role == "tool"]
        assert any("unknown tool" in str(t) for t in told), told
        stubbed: list[Any] = []
        changed = Agent("booking", "Book.", [search_flights, book_seat])
        rep = await fresh(stores).replay(
            changed, rid, tenant="t", from_step=step,
            stubs={"book_seat": lambda **kw: stubbed.append(kw) or "s"},
        )  # fmt: skip
        assert rep.status is RunStatus.completed
        assert stubbed == []
    assert sent == [] and airline.bookings == ["LH123"]


async def test_concurrent_replays_under_one_id_make_one_replay(tmp_path: Path) -> None:
    airline = Airline()
    agent = booking_agent(airline)
    rid, new = new_id(), new_id("rep")
    calls: list[str] = []

    def stub(flight: str) -> str:
        calls.append(flight)
        return "stub"

    async with sqlite(tmp_path) as stores:
        await fresh(stores).run(agent, "go", tenant="t", run_id=rid)

        async def one() -> Any:
            return await fresh(stores).replay(
                agent, rid, tenant="t", from_step=3, stubs={"book_seat": stub}, new_run_id=new
            )

        results = await asyncio.gather(one(), one(), return_exceptions=True)
        done = [r for r in results if not isinstance(r, BaseException)]
        refused = [r for r in results if isinstance(r, BaseException)]
        assert len(done) == 1 and done[0].status is RunStatus.completed
        assert len(refused) == 1
        assert isinstance(refused[0], ConfigurationError | LeaseHeldError), refused
        # Once the first is over, the id is refused outright.
        with pytest.raises(ConfigurationError, match="already exists"):
            await one()
    assert calls == ["LH123"] and airline.bookings == ["LH123"]


async def test_an_id_holding_only_a_cancel_request_is_refused(tmp_path: Path) -> None:
    airline = Airline()
    agent = booking_agent(airline)
    rid, new = new_id(), new_id("rep")
    async with sqlite(tmp_path) as stores:
        await fresh(stores).run(agent, "go", tenant="t", run_id=rid)
        assert await fresh(stores).cancel(new, tenant="t", by="op") is None
        with pytest.raises(ConfigurationError, match="already exists"):
            await fresh(stores).replay(
                agent, rid, tenant="t", from_step=3, stubs={"book_seat": stub_booking},
                new_run_id=new,
            )  # fmt: skip
        assert await stores.checkpoints.latest("t", new) is None


class _FailsAtTurn:
    """The booking conversation, until the model rejects the request at turn ``n``."""

    def __init__(self, n: int) -> None:
        self.inner, self.n, self.asked = ScriptedProvider(BOOK_TURNS), n, 0

    async def complete(self, request: Any) -> Any:
        self.asked += 1
        if self.asked == self.n:
            raise ProviderError("400 bad request", retryable=False)
        return await self.inner.complete(request)


@pytest.mark.parametrize("kind", ["redis", "postgres"])
@pytest.mark.parametrize("ending", ["failed", "cancelled"])
async def test_replays_of_failed_and_cancelled_originals_on_redis_and_postgres(
    kind: str, ending: str
) -> None:
    airline = Airline()
    agent = booking_agent(airline)
    rid = new_id()
    opened = services.redis_stores() if kind == "redis" else services.postgres_stores()
    async with opened as stores:
        if ending == "failed":
            r = AgentRunner.from_stores(_FailsAtTurn(3), stores)
            run = await r.run(agent, f"go {TOKEN}", tenant="t", run_id=rid)
        else:
            agent = booking_agent(airline, approval=True)
            first = await fresh(stores).run(agent, f"go {TOKEN}", tenant="t", run_id=rid)
            assert first.status is RunStatus.waiting_approval
            ended = await fresh(stores).cancel(rid, tenant="t", by="op")
            assert ended is not None
            run = ended
        assert run.status is RunStatus(ending)
        checkpoints = fresh(stores).checkpoints
        assert checkpoints is not None
        before_latest = await stores.checkpoints.latest("t", rid)
        steps = await stores.checkpoints.steps("t", rid)
        booked = list(airline.bookings)
        stubbed: list[str] = []
        for step in steps[:-1]:
            rep = await fresh(stores).replay(
                agent, rid, tenant="t", from_step=step,
                stubs={"book_seat": lambda flight: stubbed.append(flight) or {"ok": TOKEN}},
            )  # fmt: skip
            assert rep.status in (RunStatus.completed, RunStatus.waiting_approval), rep
            latest = await checkpoints.latest("t", rep.run_id)
            assert latest is not None and latest.replay_of == f"{rid}@{step}"
            raw = await stores.checkpoints.latest("t", rep.run_id)
            assert raw is not None and TOKEN not in repr(raw)
            assert TOKEN not in repr(await checkpoints.messages(latest))
        assert await stores.checkpoints.latest("t", rid) == before_latest
        assert await stores.checkpoints.steps("t", rid) == steps
        assert airline.bookings == booked


async def test_a_worker_resuming_the_original_while_it_is_replayed_books_once() -> None:
    """The original died after its booking, before the frontier saying so; a worker
    carries it on while a replay from the booking step runs beside it (PostgreSQL)."""
    from tesserix_adk.worker import Worker

    airline = Airline()
    agent = booking_agent(airline)
    rid = new_id()
    stubbed: list[str] = []
    async with services.postgres_stores() as stores:
        crashing = FaultyCheckpointStore(
            stores.checkpoints, crash_before=at("after_tool_result", 1)
        )
        runner = AgentRunner(
            ScriptedProvider(BOOK_TURNS),
            idempotency=stores.idempotency,
            checkpoints=Checkpointer(crashing, history=stores.history),
            leases=stores.leases,
            ledger=stores.ledger,
            approvals=stores.approvals,
            work=stores.work,
        )
        with pytest.raises(SimulatedCrash):
            await runner.run(agent, "go", tenant="t", run_id=rid)
        assert airline.bookings == ["LH123"]
        step = await step_with(stores, rid, "book_seat")
        worker = Worker(
            fresh(stores), [agent], exit_when_idle=True, poll_interval=0.05, concurrency=1
        )

        async def replay() -> Any:
            return await fresh(stores).replay(
                agent, rid, tenant="t", from_step=step,
                stubs={"book_seat": lambda flight: stubbed.append(flight) or "stub"},
            )  # fmt: skip

        _, rep = await asyncio.wait_for(asyncio.gather(worker.run(), replay()), 30)
        assert rep.status is RunStatus.completed
        latest = await fresh(stores).checkpoints.latest("t", rid)  # type: ignore[union-attr]
        assert latest is not None and latest.status.value == "completed"
        assert latest.replay_of is None
        # A finished replay's resume is its ending again, nothing sent.
        again = await fresh(stores).resume(agent, rep.run_id, tenant="t")
        assert again.status is RunStatus.completed
    assert airline.bookings == ["LH123"] and stubbed == ["LH123"]


async def test_a_start_refused_under_a_replays_id(tmp_path: Path) -> None:
    """A real run never starts under a replay's id (it would carry the stub's outcome)."""
    airline = Airline()
    agent = booking_agent(airline)
    rid = new_id()
    async with sqlite(tmp_path) as stores:
        await fresh(stores).run(agent, "go", tenant="t", run_id=rid)
        rep = await fresh(stores).replay(
            agent, rid, tenant="t", from_step=3, stubs={"book_seat": stub_booking}
        )
        with pytest.raises(RunStartedError):
            await fresh(stores).run(agent, "go", tenant="t", run_id=rep.run_id)
        # A resume of the finished replay is its ending again, nothing sent.
        again = await fresh(stores).resume(agent, rep.run_id, tenant="t")
        assert again.status is RunStatus.completed
    assert airline.bookings == ["LH123"]
