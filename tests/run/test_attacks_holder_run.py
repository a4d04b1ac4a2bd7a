"""An attacker's look at 97f0b85: a claim another run takes over (a business key two runs
share, a tool safe to send again) stays its first run's call and names the taker in
``IdempotencyRecord.holder_run`` (``holding_run``: whose lease is looked at). Memory,
SQLite, Redis (127.0.0.1:6379) and PostgreSQL (``test``).

Defects (all four fixed since, their tests plain. 1 and 3: a record taken over keeps the
taker's turn and call id, ``holder_iteration``/``holder_call_id``, and the taker's
``records``/``records_from`` list it as its own call, ``stores.records.listed_by``. 2: a
claim is taken over only by a call of its own tool, safe to send again today and as it was
sent, ``claims.may_take_over``; its test is changed to that design, r2's look is refused in
doubt naming r1. 4: ``_fences`` files only claims the run itself holds):

1. (MEDIUM, not new with the change, left by it)
   ``test_a_taker_whose_call_completed_ahead_of_its_frontier_is_asked_again``. The mirror of
   ``test_attacks_takeover_run.py`` defect 1, now on the taker. Run r1 dies with ``book``
   (``idempotent=True``, key ``order-5``) in flight. Run r2 (frontiers at
   ``after_tool_result`` only) takes the claim over, books, records its outcome and dies
   before the frontier after it is written: its booking is ahead of r2's frontier. The
   record names r2 (``holder_run``) but stays r1's call, and ``records``/``records_from``
   of r2 (``checkpoint/planning.py`` ``plan_resume`` -> ``_plan_ahead``) list by ``run_id``
   alone, so r2's plan holds nothing ahead: ``note_ahead`` files nothing, the divergence
   guard (``DivergedRunError``) is gone, and r2 resumed with a model that says "Nothing to
   book." ends ``completed`` though it booked order 5. The same run without another run's
   claim in the way (r2's own fresh claim) raises ``DivergedRunError`` (checked here too).
2. (MEDIUM, not new with the change; fixed)
   ``test_a_read_only_tool_does_not_settle_another_runs_call_in_doubt_under_the_key``.
   r1's ``book`` (not idempotent) dies in flight: whether it went out is unknown. r2
   calls ``look`` (``side_effects=False``), keyed by the same order.
   ``run/dispatch.py`` ``_call_tool`` asks ``safe_to_resend(tool)`` of the *taker's* tool,
   never the record's (``rec.tool``, ``rec.flags``): r2 takes r1's claim over, and
   ``look``'s answer is recorded as the outcome of r1's ``book`` (the record keeps
   ``tool='book'``, ``call_id='c1'``, ``holder_run='r2'``). r1 resumed replays "order 5
   looks free" as its booking's outcome and ends ``completed``: a call in doubt was
   settled by a guess, where it should be refused in doubt (``IndeterminateToolCallError``)
   until someone says what the booking did.
3. (LOW) ``test_show_of_the_taker_lists_the_call_it_sent``. ``tesserix show r2``
   (``cli/show.py`` ``story``: calls from ``idempotency.records(r2)``) lists no call,
   though r2's transcript asks ``book`` (x9) and r2 sent it; the record naming r2 in
   ``holder_run`` shows only under r1 ("taken over by run r2").
4. (LOW, fixed: ``_fences`` files only claims the run itself holds)
   ``test_show_of_the_first_run_does_not_put_the_takers_holder_under_its_fence``.
   ``tesserix show r1`` (``cli/show.py`` ``_fences``) files each record's ``holder`` under
   its ``fence`` among r1's fences; the taken-over record's holder and fence are r2's, so
   r1's "fence 1: holders ..." names r2's worker, which never held r1's lease.

What held (plain tests): at the store, on all four backends, a chain r1 -> r2 -> r3 -> r1
(``holder_run`` r2, r3, then none), the taker's ``complete`` and an operator's ``resolve``
keeping it, a fresh claim after ``never_ran`` or after a lapsed ttl claim naming no taker
and the new run as the call's; a SQLite file at schema version 6 refused until ``tesserix
schema apply`` (``create_schema``), which keeps its record and adds ``holder_run``. In runs:
r1 dies, r2 takes over and dies, r3 takes over and is sending: r2 resumed (and r1 resumed)
come back later (``ResumeConflictError``), nothing sent meanwhile, and after r3 records
both replay r3's outcome; ``tesserix show r1`` names the taker.

Not looked at: the Temporal activity path, the console's pages (they show ``holder`` only,
no ``holder_run``; read, not run), a PostgreSQL schema at version 6 (its 0007 migration is
one ``ADD COLUMN IF NOT EXISTS``; read, not run), a Redis Cluster, mixed kit versions on
Redis (the README says to stop every earlier worker first).
"""

from __future__ import annotations

import asyncio
import sqlite3
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest

from run.helpers import Asks, at, faulty_runner, fresh_stores
from run.shared_key import (
    EVERY,
    FAST,
    KEY,
    ORDER,
    RESULTS_ONLY,
    T,
    peek,
)
from run.shared_key import booking as _booking
from run.shared_key import books as _books
from run.shared_key import by_order as _by_order
from run.shared_key import crashes as _crashes
from run.shared_key import told as _told
from tesserix_adk import (
    Agent,
    AgentRunner,
    DivergedRunError,
    IndeterminateToolCallError,
    RunStatus,
    ToolCall,
    ToolContext,
    tool,
)
from tesserix_adk.cli.show import render, story
from tesserix_adk.errors import ResumeConflictError
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.stores.protocols import IdempotencyRecord, RecordStatus, ToolFlags
from tesserix_adk.stores.urls import open_stores
from tesserix_adk.testing.faults import SimulatedCrash

SAFE = ToolFlags(side_effects=True, idempotent=True)


async def _r1_dies_r2_books(stores: Stores, agent: Agent) -> None:
    """r1 dies with book in flight; r2 takes it over and records its outcome."""
    await _crashes(AgentRunner.from_stores(_books("c1"), stores, lease_policy=FAST), agent, "r1")
    two = await AgentRunner.from_stores(_books("x9"), stores, lease_policy=FAST).run(
        agent, "go", tenant=T, run_id="r2"
    )
    assert two.status is RunStatus.completed


# --- defects -----------------------------------------------------------------------------


@pytest.mark.parametrize("where", EVERY)
@pytest.mark.parametrize(
    "taken",
    [True, False],
)
async def test_a_taker_whose_call_completed_ahead_of_its_frontier_is_asked_again(
    tmp_path: Path, where: str, taken: bool
) -> None:
    sent: list[str] = []
    agent = Agent("shop", "Book.", [_booking(sent, {"r1"}, idempotent=True), peek])
    async with fresh_stores(where, tmp_path) as stores:
        if taken:  # r1 dies with its booking in flight; r2 takes it over
            await _crashes(
                AgentRunner.from_stores(_books("c1"), stores, lease_policy=FAST), agent, "r1"
            )
        asks = Asks(
            [ToolCall(id="p1", name="peek", arguments=ORDER)],
            [ToolCall(id="x9", name="book", arguments=ORDER)],
            "done",
        )
        two = faulty_runner(
            stores,
            asks,
            crash_before=at("after_tool_result", 1),
            lease_policy=FAST,
            policy=RESULTS_ONLY,
        )
        await _crashes(two, agent, "r2")  # r2 booked and recorded it, ahead of its frontier
        rec = (await stores.idempotency.lookup([KEY], tenant=T))[KEY]
        forgetful = Asks([ToolCall(id="p1", name="peek", arguments=ORDER)], "Nothing to book.")
        again = AgentRunner.from_stores(forgetful, stores, lease_policy=FAST, policy=RESULTS_ONLY)
        try:
            resumed: Any = await again.resume(agent, "r2", tenant=T)
        except DivergedRunError as exc:
            resumed = exc
    assert rec.status is RecordStatus.completed and rec.holding_run == "r2"
    assert sent[-1] == "r2"
    # What should hold: r2 booked order 5, so its model is asked for that booking again.
    assert isinstance(resumed, DivergedRunError), f"r2 ended {resumed.status}"


@pytest.mark.parametrize("where", EVERY)
async def test_a_read_only_tool_does_not_settle_another_runs_call_in_doubt_under_the_key(
    tmp_path: Path, where: str
) -> None:
    sent: list[str] = []

    @tool(key=_by_order, side_effects=False)
    async def look(order: str, ctx: ToolContext) -> str:
        """Read an order (read-only), keyed by the order."""
        sent.append(f"look {ctx.run_id}")
        return f"order {order} looks free"

    agent = Agent("shop", "Book.", [_booking(sent, {"r1"}), look])  # book: not idempotent
    async with fresh_stores(where, tmp_path) as stores:
        await _crashes(
            AgentRunner.from_stores(_books("c1"), stores, lease_policy=FAST), agent, "r1"
        )
        looks = Asks([ToolCall(id="l1", name="look", arguments=ORDER)], "done")
        # (Changed to the fix's design: a claim is taken over only by a call of its own
        # tool; and a key another tool's call holds answers a call "not sent", so r2's look
        # is not sent, and r2 goes on.)
        r2 = await AgentRunner.from_stores(looks, stores, lease_policy=FAST).run(
            agent, "go", tenant=T, run_id="r2"
        )
        assert str(r2.status) == "completed"
        rec = (await stores.idempotency.lookup([KEY], tenant=T))[KEY]
        model = _books("c1")
        try:
            one: Any = await AgentRunner.from_stores(model, stores, lease_policy=FAST).resume(
                agent, "r1", tenant=T
            )
        except IndeterminateToolCallError as exc:
            one = exc
    # What holds: the booking went out once, and nothing sent it again; the record is
    # still r1's booking, taken over by r2.
    assert sent == ["r1"]
    # What should hold: nobody knows what r1's booking did; r1 is refused in doubt, not told
    # a read-only look's answer as its booking's outcome.
    assert (rec.tool, rec.call_id, rec.holding_run) == ("book", "c1", "r1")
    assert isinstance(one, IndeterminateToolCallError), (one.status, _told(model), rec.outcome)


@pytest.mark.parametrize("where", EVERY)
async def test_show_of_the_taker_lists_the_call_it_sent(tmp_path: Path, where: str) -> None:
    sent: list[str] = []
    agent = Agent("shop", "Book.", [_booking(sent, {"r1"}, idempotent=True)])
    async with fresh_stores(where, tmp_path) as stores:
        await _r1_dies_r2_books(stores, agent)
        shown = await story(stores, T, "r2", step=None)
    assert sent == ["r1", "r2"]
    assert shown["calls"], render(shown)


@pytest.mark.parametrize("where", EVERY)
async def test_show_of_the_first_run_does_not_put_the_takers_holder_under_its_fence(
    tmp_path: Path, where: str
) -> None:
    sent: list[str] = []
    agent = Agent("shop", "Book.", [_booking(sent, {"r1"}, idempotent=True)])
    async with fresh_stores(where, tmp_path) as stores:
        await _r1_dies_r2_books(stores, agent)
        rec = (await stores.idempotency.lookup([KEY], tenant=T))[KEY]
        shown = await story(stores, T, "r1", step=None)
    assert rec.holding_run == "r2"
    # What holds: the call is listed, naming its taker.
    assert "taken over by run r2" in render(shown)
    # What should hold: r2's worker never held r1's lease.
    holders = [h for f in shown["fences"] for h in f["holders"]]
    assert rec.holder not in holders, shown["fences"]


# --- what held ---------------------------------------------------------------------------


async def _claim(
    stores: Stores, key: str, holder: str, run_id: str, *, ttl: float | None = None
) -> IdempotencyRecord:
    return await stores.idempotency.claim(
        key,
        holder=holder,
        tenant=T,
        run_id=run_id,
        iteration=1,
        tool="book",
        call_id=f"call-{run_id}",
        flags=SAFE,
        takeover=True,
        ttl=ttl,
    )


def _whose(rec: IdempotencyRecord) -> tuple[str, str | None, str, str | None]:
    return (rec.run_id, rec.holder_run, rec.holding_run, rec.call_id)


@pytest.mark.parametrize("where", EVERY)
async def test_a_chain_of_takeovers_names_each_taker_and_a_fresh_claim_none(
    tmp_path: Path, where: str
) -> None:
    async with fresh_stores(where, tmp_path) as stores:
        await _claim(stores, "k", "a", "r1")
        assert _whose(await _claim(stores, "k", "b", "r2")) == ("r1", "r2", "r2", "call-r1")
        assert _whose(await _claim(stores, "k", "c", "r3")) == ("r1", "r3", "r3", "call-r1")
        assert _whose(await _claim(stores, "k", "d", "r1")) == ("r1", None, "r1", "call-r1")
        assert _whose(await _claim(stores, "k", "e", "r3")) == ("r1", "r3", "r3", "call-r1")
        done = await stores.idempotency.complete("k", b"ok", tenant=T, holder="e")
        assert (done.status, done.holder_run) == (RecordStatus.completed, "r3")
        # An operator's word keeps the taker; a fresh claim after "never ran" names none.
        await _claim(stores, "n", "a", "r1")
        await _claim(stores, "n", "b", "r2")
        said = await stores.idempotency.resolve("n", tenant=T, never_ran=True, by="ops")
        assert (said.status, said.holder_run) == (RecordStatus.never_ran, "r2")
        assert _whose(await _claim(stores, "n", "c", "r3")) == ("r3", None, "r3", "call-r3")
        settled = await stores.idempotency.resolve("n", b"x", tenant=T, by="ops")
        assert (settled.by, settled.holder_run) == ("ops", None)
        # A ttl claim taken over and lapsed: the next claim is fresh, its own run's.
        await _claim(stores, "t", "a", "r1", ttl=0.3)
        taken = await _claim(stores, "t", "b", "r2", ttl=0.3)
        assert _whose(taken) == ("r1", "r2", "r2", "call-r1")
        await asyncio.sleep(0.6)
        assert _whose(await _claim(stores, "t", "c", "r3")) == ("r3", None, "r3", "call-r3")
        listed = {r.key for r in await stores.idempotency.records(T, "r3") if r.tool}
    # (Changed since: the taker lists a call it took over too; r3 last took "k".)
    assert listed == {"k", "n", "t"}


async def test_a_version_6_sqlite_file_is_refused_then_migrated_keeping_its_records(
    tmp_path: Path,
) -> None:
    from tesserix_adk.errors import ConfigurationError
    from tesserix_adk.stores.sqlite import SQLITE_MIGRATIONS, SQLITE_SCHEMA_VERSION

    assert SQLITE_SCHEMA_VERSION == 7
    path = tmp_path / "adk.sqlite3"
    with closing(sqlite3.connect(path)) as conn:  # a file as version 6 of the kit left it
        for migration in SQLITE_MIGRATIONS[:6]:
            conn.executescript(migration)
        conn.execute("INSERT INTO adk_schema_version (id, version) VALUES (1, 6)")
        conn.execute(
            "INSERT INTO adk_idempotency (key, status, holder, tenant, run_id, iteration, "
            "tool, call_id, side_effects, idempotent, fence, since, never_ran_by) "
            "VALUES ('k', 'in_flight', 'w', ?, 'r1', 0, 'book', 'c1', 1, 1, 1, 0, 'ops')",
            (T,),
        )
        conn.commit()
    url = f"sqlite:///{path}"
    async with open_stores(url) as stores:
        with pytest.raises(ConfigurationError, match="tesserix schema apply"):
            await stores.idempotency.lookup(["k"], tenant=T)
    async with open_stores(url) as stores:
        await stores.create_schema()
        await stores.verify()
        kept = (await stores.idempotency.lookup(["k"], tenant=T))["k"]
        taken = await _claim(stores, "k", "b", "r2")
    assert (kept.run_id, kept.never_ran_by, kept.holder_run) == ("r1", "ops", None)
    assert _whose(taken) == ("r1", "r2", "r2", "c1")


@pytest.mark.parametrize("where", EVERY)
async def test_a_second_taker_carried_holds_off_both_earlier_runs_then_both_replay(
    tmp_path: Path, where: str
) -> None:
    sent: list[str] = []
    inside = asyncio.Event()
    go_on = asyncio.Event()

    @tool(key=_by_order, idempotent=True)
    async def book(order: str, ctx: ToolContext) -> str:
        """Book an order; the far side dedupes by our key."""
        sent.append(ctx.run_id)
        if ctx.run_id in ("r1", "r2") and sent.count(ctx.run_id) == 1:
            raise SimulatedCrash
        if ctx.run_id == "r3":
            inside.set()
            await go_on.wait()
        return f"booked {order} by {ctx.run_id}"

    agent = Agent("shop", "Book.", [book])
    async with fresh_stores(where, tmp_path) as stores:
        await _crashes(
            AgentRunner.from_stores(_books("c1"), stores, lease_policy=FAST), agent, "r1"
        )
        await _crashes(
            AgentRunner.from_stores(_books("x9"), stores, lease_policy=FAST), agent, "r2"
        )
        three = asyncio.create_task(
            AgentRunner.from_stores(_books("z3"), stores, lease_policy=FAST).run(
                agent, "go", tenant=T, run_id="r3"
            )
        )
        await inside.wait()  # r3 took the claim over from r2 and is sending it now
        held = (await stores.idempotency.lookup([KEY], tenant=T))[KEY]
        refused: list[Any] = []
        try:
            for run_id, call_id in (("r2", "x9"), ("r1", "c1")):
                runner = AgentRunner.from_stores(_books(call_id), stores, lease_policy=FAST)
                try:
                    refused.append(await runner.resume(agent, run_id, tenant=T))
                except ResumeConflictError as exc:
                    refused.append(exc)
        finally:
            go_on.set()
            await three
        models = {"r2": _books("x9"), "r1": _books("c1")}
        for run_id, model in models.items():
            done = await AgentRunner.from_stores(model, stores, lease_policy=FAST).resume(
                agent, run_id, tenant=T
            )
            assert done.status is RunStatus.completed
        shown = render(await story(stores, T, "r1", step=None))
    assert _whose(held) == ("r1", "r3", "r3", "c1")
    assert all(isinstance(r, ResumeConflictError) for r in refused), refused
    assert all("'r3'" in str(r) for r in refused), refused
    assert sent == ["r1", "r2", "r3"]
    assert _told(models["r1"]) == _told(models["r2"]) == ["booked 5 by r3"]
    assert "taken over by run r3" in shown
