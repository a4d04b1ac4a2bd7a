"""An attacker's look at a first design of "a record taken over names the run that took it":
``stores/records.py`` ``after_claim`` (memory, SQLite), ``adapters/redis/scripts/claim.lua``
and ``adapters/postgres/sql/idempotency/claim_(un)fenced.sql`` gave a claim taken over
(``takeover=True``, a tool safe to send again) the new claimant's ``run_id``, ``iteration``
and ``call_id``. Defects 1-3 below came with that design, which did not land: the record
now stays its first run's call and names the taker in ``IdempotencyRecord.holder_run``
(``holding_run``: whose lease is looked at), and their tests pass as plain tests. Defect 4
was there before either, and is fixed (``run/holding.py`` ``carried_elsewhere`` looks at a
planned takeover's holding run). Tests that pinned the first design were changed to the
one that landed, saying so. Memory, SQLite, Redis (127.0.0.1:6379) and PostgreSQL.

Defects (all fixed or gone since; plain tests):

1. (MEDIUM, new with the change)
   ``test_a_call_sent_ahead_of_the_frontier_is_still_asked_again_after_a_takeover``.
   Run r1 (frontiers at ``after_tool_result`` only) sends ``book`` (``idempotent=True``,
   business key ``order-5``) and dies before the frontier after it is written: its record is
   *ahead* of r1's frontier, and only ``records_from``/``records`` of r1 find it
   (``checkpoint/planning.py`` ``plan_resume`` -> ``_plan_ahead``). Run r2 books order 5,
   takes the claim over and records its outcome; the record now names r2. r1 resumed no
   longer sees its own booking: ``plan.completed`` misses it, ``run/resume.py``
   ``note_ahead`` files nothing in ``attempt.ahead``, and the divergence guard
   (``run/loop.py`` ``_refuse_divergence``/``_finish``, ``DivergedRunError``) is gone. r1's
   model says "Nothing to book." and r1 ends ``completed`` though it booked order 5: the
   booking is hidden from its model. Before the change (checked by patching the old
   ``after_claim`` back in) the resume raised ``DivergedRunError``.
2. (MEDIUM, new with the change)
   ``test_a_call_in_doubt_ahead_of_the_frontier_stays_in_doubt_after_a_takeover``.
   The same with r1's call in doubt: r1's ``charge`` is not idempotent (its agent, say an
   older revision), r2's is (``idempotent=True``, the far side dedupes now). r1 dies with the
   charge sent and ahead of its frontier; r2 takes the claim over (the taker's flags decide,
   ``run/claims.py`` ``safe_to_resend``) and dies too. The record, in flight and still
   flagged non-idempotent, now names r2, so r1's plan holds nothing in doubt: r1 resumed is
   carried on and ends ``completed`` not knowing whether its charge went out, and
   ``tesserix inspect`` of r1 (``plan_as_told``) shows no call in doubt. Before the change
   r1 was refused in doubt (``IndeterminateToolCallError``): resume now guesses.
3. (LOW, new with the change)
   ``test_show_of_the_run_that_sent_a_call_still_lists_it_after_a_takeover``. ``tesserix
   show`` (``cli/show.py`` ``story``, calls from ``idempotency.records(run)``) of r1, whose
   ``book`` went out (and whose transcript holds that call and the outcome it replayed),
   lists no call at all once r2 took the claim over; the call shows only under r2. An
   operator auditing what r1 sent is told it sent nothing. (Before, it was the other way
   round: r2's show missed the call it sent.) One record per key cannot name both runs.
4. (LOW-MEDIUM, not caused by the change, found beside it)
   ``test_a_resume_does_not_take_over_a_claim_a_carried_run_took_over``. r1 dies with
   ``book`` (idempotent) in flight; r2 takes it over and is sending it now (r2 carried). r1
   resumed plans the call ``takeover=True`` (``plan_resume``, ``safe_to_resend``: the run
   that holds the claim is never looked at), ``note_ahead`` puts the key in
   ``attempt.takeover_keys``, and ``dispatch._call_tool``'s very first ``claim`` takes the
   live run's claim over, before ``unless_carried`` could ever be asked. r1 books order 5
   a second time while r2 is sending it, and r2's outcome is fenced out. The README says
   such a claim "is never taken over while its run is carried", and now (the change's own
   line) that "its lease is the one looked at": on a resume it is not looked at. The same
   behaviour with the old ``after_claim`` (checked).

What held (plain tests): an operator's answer on the holder looked at before a takeover
(``resolve(..., holder=)``) is refused and nothing is recorded. A call the frontier lists,
taken over by r2 which then died, is taken over again by r1's resume and sent once more
(idempotent), and r2 resumed replays it; each run's model told an outcome. A
non-idempotent call the frontier lists, whose claim r2 took over and died with, refuses r1
in doubt naming r2, nothing sent again. Added with the design that landed: the record stays
r1's in both runs' listings as it was, taken back it names no taker; ``tesserix resolve``
is on r1 (r2's names r1), and waits while r2 is carried.

Not looked at: the Temporal activity path, a Redis Cluster (the cross-run key is refused
there by design), real SIGKILLs.
"""

from __future__ import annotations

import asyncio
import io
from pathlib import Path
from typing import Any

import pytest

from run.helpers import Asks, fresh_stores
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
from run.shared_key import peek_then_book as _peek_then_book
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
from tesserix_adk.checkpoint.checkpointer import Checkpointer
from tesserix_adk.checkpoint.planning import plan_as_told
from tesserix_adk.cli.commands import _subcommands, add_frontier_commands, new_parser
from tesserix_adk.cli.failures import Refused
from tesserix_adk.cli.frontier import run_frontier_command
from tesserix_adk.cli.show import story
from tesserix_adk.errors import ResumeConflictError
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.stores.protocols import RecordsFrom, RecordStatus, ToolFlags
from tesserix_adk.testing.faults import SimulatedCrash

# --- defects -----------------------------------------------------------------------------


@pytest.mark.parametrize("where", EVERY)
async def test_a_call_sent_ahead_of_the_frontier_is_still_asked_again_after_a_takeover(
    tmp_path: Path, where: str
) -> None:
    sent: list[str] = []
    agent = Agent("shop", "Book.", [_booking(sent, {"r1"}, idempotent=True), peek])
    async with fresh_stores(where, tmp_path) as stores:
        one = AgentRunner.from_stores(
            _peek_then_book(), stores, lease_policy=FAST, policy=RESULTS_ONLY
        )
        await _crashes(one, agent, "r1")  # r1 booked order 5, ahead of its frontier
        two = await AgentRunner.from_stores(_books("x9"), stores, lease_policy=FAST).run(
            agent, "go", tenant=T, run_id="r2"
        )
        forgetful = Asks([ToolCall(id="p1", name="peek", arguments=ORDER)], "Nothing to book.")
        again = AgentRunner.from_stores(forgetful, stores, lease_policy=FAST, policy=RESULTS_ONLY)
        try:
            resumed: Any = await again.resume(agent, "r1", tenant=T)
        except DivergedRunError as exc:
            resumed = exc
    # What holds: r2 took the claim over (safe) and booked once more; nothing else went out.
    assert two.status is RunStatus.completed
    assert sent == ["r1", "r2"]
    # What should hold: r1 booked order 5, so it may not finish without its model asking
    # for that booking again (as before the change).
    assert isinstance(resumed, DivergedRunError), f"r1 ended {resumed.status}"


@pytest.mark.parametrize("where", EVERY)
async def test_a_call_in_doubt_ahead_of_the_frontier_stays_in_doubt_after_a_takeover(
    tmp_path: Path, where: str
) -> None:
    sent: list[str] = []
    crashes = {"r1", "r2"}
    old = Agent("shop", "Book.", [_booking(sent, crashes), peek])  # not idempotent
    new = Agent("shop", "Book.", [_booking(sent, crashes, idempotent=True), peek])
    async with fresh_stores(where, tmp_path) as stores:
        one = AgentRunner.from_stores(
            _peek_then_book(), stores, lease_policy=FAST, policy=RESULTS_ONLY
        )
        await _crashes(one, old, "r1")  # r1's charge went out, in doubt, ahead
        # (Changed since: a claim sent as not safe to send again is never taken over,
        # whatever today's tool says; r2 is refused in doubt naming r1, nothing sent.)
        with pytest.raises(IndeterminateToolCallError, match="r1"):
            await AgentRunner.from_stores(_books("x9"), stores, lease_policy=FAST).run(
                new, "go", tenant=T, run_id="r2"
            )
        record = (await stores.idempotency.lookup([KEY], tenant=T))[KEY]
        cp = await Checkpointer.from_stores(stores).latest(T, "r1")
        assert cp is not None
        told = await plan_as_told(cp, stores.idempotency, None)
        forgetful = Asks([ToolCall(id="p1", name="peek", arguments=ORDER)], "Nothing to book.")
        again = AgentRunner.from_stores(forgetful, stores, lease_policy=FAST, policy=RESULTS_ONLY)
        try:
            resumed: Any = await again.resume(old, "r1", tenant=T)
        except IndeterminateToolCallError as exc:
            resumed = exc
    # What holds: nothing was sent again, and the record is in flight, flagged as r1's
    # non-idempotent call, under r1's holder.
    assert sent == ["r1"]
    assert record.status is RecordStatus.in_flight
    assert (record.run_id, record.holding_run) == ("r1", "r1")
    assert record.flags == ToolFlags(side_effects=True, idempotent=False)
    # What should hold: r1 sent a charge nobody can vouch for; inspect says so, and r1's
    # resume is refused in doubt rather than carried on as if it never happened.
    assert isinstance(resumed, IndeterminateToolCallError), f"r1 ended {resumed.status}"
    assert [p.key for p in told.indeterminate] == [KEY], "inspect of r1 shows nothing in doubt"


@pytest.mark.parametrize("where", EVERY)
async def test_show_of_the_run_that_sent_a_call_still_lists_it_after_a_takeover(
    tmp_path: Path, where: str
) -> None:
    sent: list[str] = []
    agent = Agent("shop", "Book.", [_booking(sent, {"r1"}, idempotent=True)])
    async with fresh_stores(where, tmp_path) as stores:
        await _crashes(
            AgentRunner.from_stores(_books("c1"), stores, lease_policy=FAST), agent, "r1"
        )
        await AgentRunner.from_stores(_books("x9"), stores, lease_policy=FAST).run(
            agent, "go", tenant=T, run_id="r2"
        )
        model = _books("c1")
        one = await AgentRunner.from_stores(model, stores, lease_policy=FAST).resume(
            agent, "r1", tenant=T
        )
        shown = await story(stores, T, "r1", step=None)
    # What holds: r1 replays r2's outcome, nothing sent a third time.
    assert one.status is RunStatus.completed and _told(model) == ["booked 5 by r2"]
    assert sent == ["r1", "r2"]
    # What should hold: r1 sent c1; its story lists it.
    assert [c.get("call_id") for c in shown["calls"]] == ["c1"], shown["calls"]


@pytest.mark.parametrize("where", EVERY)
async def test_a_resume_does_not_take_over_a_claim_a_carried_run_took_over(
    tmp_path: Path, where: str
) -> None:
    sent: list[str] = []
    inside = asyncio.Event()
    go_on = asyncio.Event()

    @tool(key=_by_order, idempotent=True)
    async def book(order: str, ctx: ToolContext) -> str:
        """Book an order; the far side dedupes by our key."""
        sent.append(ctx.run_id)
        if sent == ["r1"]:
            raise SimulatedCrash
        if ctx.run_id == "r2":
            inside.set()
            await go_on.wait()
        return f"booked {order} by {ctx.run_id}"

    agent = Agent("shop", "Book.", [book])
    async with fresh_stores(where, tmp_path) as stores:
        await _crashes(
            AgentRunner.from_stores(_books("c1"), stores, lease_policy=FAST), agent, "r1"
        )
        second = _books("x9")
        two = asyncio.create_task(
            AgentRunner.from_stores(second, stores, lease_policy=FAST).run(
                agent, "go", tenant=T, run_id="r2"
            )
        )
        await inside.wait()  # r2 took r1's claim over and is sending it now
        held = (await stores.idempotency.lookup([KEY], tenant=T))[KEY]
        try:
            try:
                resumed: Any = await AgentRunner.from_stores(
                    _books("c1"), stores, lease_policy=FAST
                ).resume(agent, "r1", tenant=T)
            except ResumeConflictError as exc:
                resumed = exc
        finally:
            go_on.set()
            await two
    assert (held.run_id, held.holding_run) == ("r1", "r2")
    # What should hold: r2 is carried and sending, so r1 comes back later, sending nothing.
    assert sent == ["r1", "r2"], sent
    assert isinstance(resumed, ResumeConflictError), resumed


# --- what held ---------------------------------------------------------------------------


async def _claim(
    stores: Stores, key: str, holder: str, run_id: str, iteration: int, call_id: str
) -> Any:
    return await stores.idempotency.claim(
        key,
        holder=holder,
        tenant=T,
        run_id=run_id,
        iteration=iteration,
        tool="book",
        call_id=call_id,
        flags=ToolFlags(side_effects=True, idempotent=True),
        takeover=True,
    )


async def _listed(stores: Stores, run_id: str, iteration: int | None = None) -> list[str]:
    store = stores.idempotency
    if iteration is None:
        return [r.key for r in await store.records(T, run_id) if r.tool is not None]
    assert isinstance(store, RecordsFrom)
    return [r.key for r in await store.records_from(T, run_id, iteration)]


@pytest.mark.parametrize("where", EVERY)
async def test_a_record_stays_its_first_runs_call_and_names_the_taker(
    tmp_path: Path, where: str
) -> None:
    # (Changed to the fix's design: a takeover names the taker's run in holder_run and
    # leaves the call its first run's, so that run's listing keeps finding what it sent;
    # the taker lists it too, at its own turn, until it is taken from it.)
    async with fresh_stores(where, tmp_path) as stores:
        await _claim(stores, "k", "a", "r1", 2, "c1")  # r1 names it first
        await _claim(stores, "j", "b", "r2", 4, "x1")  # r2 names this one first
        taken = await _claim(stores, "k", "b", "r2", 5, "x9")
        assert (taken.run_id, taken.iteration, taken.call_id) == ("r1", 2, "c1")
        assert taken.holding_run == "r2"
        assert await _listed(stores, "r1") == ["k"]
        assert await _listed(stores, "r2") == ["j", "k"]
        if isinstance(stores.idempotency, RecordsFrom):
            assert await _listed(stores, "r1", 2) == ["k"]
            assert await _listed(stores, "r1", 3) == []
            assert await _listed(stores, "r2", 4) == ["j", "k"]
            assert await _listed(stores, "r2", 5) == ["k"]
        # r1 takes both back: its own call is its own again; r2's names r1 as its taker.
        back = await _claim(stores, "k", "c", "r1", 1, "c1")
        other = await _claim(stores, "j", "c", "r1", 1, "c2")
        assert (back.holding_run, back.holder_run) == ("r1", None)
        assert (other.run_id, other.holding_run) == ("r2", "r1")
        assert sorted(await _listed(stores, "r1")) == ["j", "k"]
        assert await _listed(stores, "r2") == ["j"]


@pytest.mark.parametrize("where", EVERY)
async def test_an_answer_on_the_holder_seen_before_a_takeover_is_refused(
    tmp_path: Path, where: str
) -> None:
    async with fresh_stores(where, tmp_path) as stores:
        await _claim(stores, "k", "a", "r1", 1, "c1")
        await _claim(stores, "k", "b", "r2", 3, "x9")
        with pytest.raises(ValueError):
            await stores.idempotency.resolve("k", tenant=T, never_ran=True, by="ops", holder="a")
        found = (await stores.idempotency.lookup(["k"], tenant=T))["k"]
    assert found.status is RecordStatus.in_flight and found.holder == "b"
    assert found.holding_run == "r2" and found.by is None


@pytest.mark.parametrize("where", EVERY)
async def test_a_listed_call_taken_over_by_a_run_that_died_is_sent_again_by_the_first(
    tmp_path: Path, where: str
) -> None:
    sent: list[str] = []
    agent = Agent("shop", "Book.", [_booking(sent, {"r1", "r2"}, idempotent=True)])
    async with fresh_stores(where, tmp_path) as stores:
        await _crashes(
            AgentRunner.from_stores(_books("c1"), stores, lease_policy=FAST), agent, "r1"
        )
        await _crashes(
            AgentRunner.from_stores(_books("x9"), stores, lease_policy=FAST), agent, "r2"
        )
        first = _books("c1")
        one = await AgentRunner.from_stores(first, stores, lease_policy=FAST).resume(
            agent, "r1", tenant=T
        )
        second = _books("x9")
        two = await AgentRunner.from_stores(second, stores, lease_policy=FAST).resume(
            agent, "r2", tenant=T
        )
        found = (await stores.idempotency.lookup([KEY], tenant=T))[KEY]
    assert (one.status, two.status) == (RunStatus.completed, RunStatus.completed)
    assert sent == ["r1", "r2", "r1"]
    assert _told(first) == _told(second) == ["booked 5 by r1"]
    assert found.status is RecordStatus.completed
    assert (found.run_id, found.holder_run) == ("r1", None)


async def _resolve(stores: Stores, *argv: str) -> tuple[Any, str]:
    parser = new_parser()
    add_frontier_commands(_subcommands(parser))
    args = parser.parse_args(["resolve", *argv, "--tenant", T, "--by", "ops"])
    out = io.StringIO()
    try:
        return await run_frontier_command(args, stores, out), out.getvalue()
    except Exception as exc:
        return exc, out.getvalue()


@pytest.mark.parametrize("where", EVERY)
async def test_resolve_is_on_the_run_whose_call_it_is_once_the_taker_is_not_carried(
    tmp_path: Path, where: str
) -> None:
    # (Changed to the fix's design: the record stays r1's call, so it is resolved on r1,
    # and r2's resolve names r1; r2's lease is looked at before anything is recorded.)
    sent: list[str] = []
    agent = Agent("shop", "Book.", [_booking(sent, {"r1", "r2"}, idempotent=True)])
    async with fresh_stores(where, tmp_path) as stores:
        await _crashes(
            AgentRunner.from_stores(_books("c1"), stores, lease_policy=FAST), agent, "r1"
        )
        await _crashes(
            AgentRunner.from_stores(_books("x9"), stores, lease_policy=FAST), agent, "r2"
        )
        on_second, _ = await _resolve(stores, "r2", "--call", "x9", "--outcome", '"booked 5"')
        untouched = (await stores.idempotency.lookup([KEY], tenant=T))[KEY]
        on_first, said = await _resolve(stores, "r1", "--call", "c1", "--outcome", '"booked 5"')
        model, later = _books("c1"), _books("x9")
        one = await AgentRunner.from_stores(model, stores, lease_policy=FAST).resume(
            agent, "r1", tenant=T
        )
        two = await AgentRunner.from_stores(later, stores, lease_policy=FAST).resume(
            agent, "r2", tenant=T
        )
    assert isinstance(on_second, Refused), on_second
    assert "'r1'" in str(on_second) and "c1" in str(on_second)
    assert untouched.status is RecordStatus.in_flight
    assert not isinstance(on_first, Exception), on_first
    assert "recorded" in said
    assert (one.status, two.status) == (RunStatus.completed, RunStatus.completed)
    assert _told(model) == _told(later) == ["booked 5"]
    assert sent == ["r1", "r2"]


@pytest.mark.parametrize("where", EVERY)
async def test_resolve_waits_while_the_run_that_took_the_call_over_is_carried(
    tmp_path: Path, where: str
) -> None:
    sent: list[str] = []
    inside = asyncio.Event()
    go_on = asyncio.Event()

    @tool(key=_by_order, idempotent=True)
    async def book(order: str, ctx: ToolContext) -> str:
        """Book an order; the far side dedupes by our key."""
        sent.append(ctx.run_id)
        if ctx.run_id == "r1":
            raise SimulatedCrash
        inside.set()
        await go_on.wait()
        return f"booked {order} by {ctx.run_id}"

    agent = Agent("shop", "Book.", [book])
    async with fresh_stores(where, tmp_path) as stores:
        await _crashes(
            AgentRunner.from_stores(_books("c1"), stores, lease_policy=FAST), agent, "r1"
        )
        two = asyncio.create_task(
            AgentRunner.from_stores(_books("x9"), stores, lease_policy=FAST).run(
                agent, "go", tenant=T, run_id="r2"
            )
        )
        await inside.wait()  # r2 took r1's claim over and is sending it now
        try:
            said, _ = await _resolve(stores, "r1", "--call", "c1", "--outcome", '"never mind"')
            held = (await stores.idempotency.lookup([KEY], tenant=T))[KEY]
        finally:
            go_on.set()
            await two
        done = (await stores.idempotency.lookup([KEY], tenant=T))[KEY]
    # An operator's word on r1 while r2's holder is sending would fence r2's outcome out.
    assert isinstance(said, ResumeConflictError), said
    assert "'r2'" in str(said)
    assert held.status is RecordStatus.in_flight and held.by is None
    assert done.status is RecordStatus.completed and done.by is None
    assert sent == ["r1", "r2"]


@pytest.mark.parametrize("where", EVERY)
async def test_a_listed_unsafe_call_taken_over_by_a_dead_run_is_in_doubt_naming_it(
    tmp_path: Path, where: str
) -> None:
    sent: list[str] = []
    crashes = {"r1", "r2"}
    old = Agent("shop", "Book.", [_booking(sent, crashes)])
    new = Agent("shop", "Book.", [_booking(sent, crashes, idempotent=True)])
    async with fresh_stores(where, tmp_path) as stores:
        await _crashes(AgentRunner.from_stores(_books("c1"), stores, lease_policy=FAST), old, "r1")
        # (Changed since: r2's idempotent call no longer takes over r1's claim, sent as not
        # safe to send again: r2 is refused in doubt naming r1, and so is r1's resume.)
        with pytest.raises(IndeterminateToolCallError, match="r1"):
            await AgentRunner.from_stores(_books("x9"), stores, lease_policy=FAST).run(
                new, "go", tenant=T, run_id="r2"
            )
        with pytest.raises(IndeterminateToolCallError) as refused:
            await AgentRunner.from_stores(_books("c1"), stores, lease_policy=FAST).resume(
                old, "r1", tenant=T
            )
    assert [c.key for c in refused.value.calls] == [KEY]
    assert sent == ["r1"]
