"""An attacker's look at 26bd6d6 (a claim in flight under another holder is taken over only
by a call of its own tool, safe to send again today and as it was sent: ``run/claims.py``
``may_take_over``, ``checkpoint/planning.py`` ``_same_call_sent_safe``) and 1ae54c3 (a run
that took a claim over lists it too, at its own turn and call id: ``holder_iteration``,
``holder_call_id``, ``stores/records.py`` ``listed_by``; ``tesserix resolve`` refuses on
the taker). Memory, SQLite, Redis (127.0.0.1:6379) and PostgreSQL (``test``).

Defects (both fixed since, their tests plain: 1, ``reconciling._askable`` asks no reconciler
about a claim of another tool; 2, ``tesserix show`` of the taker says whose call it is and
where it is resolved):

1. (HIGH, not new with the changes, left by 26bd6d6's own rule)
   ``test_another_tools_reconciler_does_not_settle_another_runs_call_in_doubt``. 26bd6d6
   says a key two tools share names another tool's call, "whose claim this one may neither
   send again nor settle with its own outcome"; dispatch keeps that, the reconciler does
   not. r1's ``book`` (not idempotent, key ``order-5``) dies in flight: in doubt. r2 calls
   ``release`` (another tool, keyed by the same order, with a reconciler that asks the
   hold system and finds no release): dispatch refuses it in doubt naming r1, as designed.
   r2 resumed: ``plan_resume`` files the call indeterminate with ``record`` = r1's
   ``book`` claim and ``tool`` = ``release`` (the frontier's), and ``run/reconciling.py``
   ``_askable`` picks the reconciler by ``pc.tool`` (``agent.tools.get(pc.tool)``), never
   comparing it with ``pc.record.tool``; ``reconcile_in_doubt`` records release's answer
   on r1's booking (``by='reconciler:release'``). With "never ran": should r2's worker die
   before it sends its release (here: right after the reconcile, in ``on_frontier``), r1
   resumed finds its booking "never ran" and books order 5 a second time, a call that may
   have gone out sent twice (``sent == ['r1', 'r1']``). Should r2 live, its release claims
   the key afresh and completes, and r1 resumed replays "released 5" as its booking's
   outcome and ends ``completed``: a guess told to the model as the truth. Either way r1
   should stay refused in doubt (``IndeterminateToolCallError``) until someone says what
   the booking did. The Temporal activity path (``temporal/calls.py``
   ``_settle_in_doubt`` -> ``plan_resume`` -> ``reconcile_in_doubt``) goes the same way
   (read, not run).
2. (LOW) ``test_show_of_the_taker_names_the_run_whose_call_it_is``. ``tesserix show r2``
   now lists the call r2 took over (``book (x9)``), but says "taken over by run r2" (its
   own name, from ``holder_run``) and never names r1, the run whose call it is and the
   only run ``tesserix resolve`` accepts for it (``cli/show.py`` ``_call``/``render``:
   the record's ``run_id``/``call_id`` as stored are not shown; the JSON has no field for
   them either). An operator reading r2's page is sent to a resolve that refuses.

What held (plain tests): at the store, on all four backends, a chain r1 -> r2 -> r3 with
r2 taking over at a turn lower than r1's: each listing (``records``, ``records_from``)
holds the key at most once; only the latest taker lists it, at its own turn and call id,
and ``records_from`` of that taker finds it from that turn and not after; taken back by
r1 it leaves every taker's listing and shows r1's turn and call id again; a key the run
claimed itself and took back is never listed twice (no row with ``run_id == holder_run``).
In runs: a read-only tool under another tool's key is refused in doubt and its call is
not taken over (26bd6d6), and ``tesserix resolve`` on the taker refuses naming r1.

Not looked at: the console's pages (read: they list ``records`` as ``tesserix show``
does), ``tesserix list`` counts (a record in flight counts for both runs; read), a Redis
Cluster.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest

from run.helpers import Asks, fresh_stores
from run.shared_key import EVERY, FAST, KEY, ORDER, T, booking, books, by_order, crashes, told
from tesserix_adk import (
    Agent,
    AgentRunner,
    IndeterminateToolCallError,
    Reconciled,
    RunStatus,
    ToolCall,
    ToolContext,
    tool,
)
from tesserix_adk.cli.commands import _subcommands, add_frontier_commands, new_parser
from tesserix_adk.cli.failures import Refused
from tesserix_adk.cli.frontier import run_frontier_command
from tesserix_adk.cli.show import render, story
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.stores.protocols import IdempotencyRecord, RecordsFrom, RecordStatus, ToolFlags
from tesserix_adk.testing.faults import SimulatedCrash

SAFE = ToolFlags(side_effects=True, idempotent=True)


def _release(sent: list[str]) -> Any:
    """``release``: another tool keyed by the same order, whose reconciler asks the hold
    system and finds nothing released."""

    @tool(key=by_order, reconcile=lambda call, ctx: Reconciled.never_ran())
    async def release(order: str, ctx: ToolContext) -> str:
        """Release an order's hold."""
        sent.append(f"release {ctx.run_id}")
        return f"released {order}"

    return release


def _dies(*_: Any) -> None:
    raise SimulatedCrash  # the worker dies right after the reconcile, before sending


# --- defects -----------------------------------------------------------------------------


@pytest.mark.parametrize("where", EVERY)
async def test_another_tools_reconciler_does_not_settle_another_runs_call_in_doubt(
    tmp_path: Path, where: str
) -> None:
    sent: list[str] = []
    agent = Agent("shop", "Book.", [booking(sent, {"r1"}), _release(sent)])  # not idempotent
    async with fresh_stores(where, tmp_path) as stores:
        await crashes(AgentRunner.from_stores(books("c1"), stores, lease_policy=FAST), agent, "r1")
        releases = Asks([ToolCall(id="l1", name="release", arguments=ORDER)], "done")
        two = AgentRunner.from_stores(releases, stores, lease_policy=FAST, never_ran_margin=0.0)
        # What holds (26bd6d6): r2's release does not take r1's booking over. Since a key
        # another tool's call holds answers a call "not sent" (run.dispatch), r2's release
        # is not sent, its reconciler never asked, and r2 goes on.
        r2 = await two.run(agent, "go", tenant=T, run_id="r2")
        assert str(r2.status) == "completed"
        assert sent == ["r1"]
        rec = (await stores.idempotency.lookup([KEY], tenant=T))[KEY]
        model = books("c1")
        try:
            one: Any = await AgentRunner.from_stores(model, stores, lease_policy=FAST).resume(
                agent, "r1", tenant=T
            )
        except IndeterminateToolCallError as exc:
            one = exc
    # What should hold: nobody knows what r1's booking did. It went out once, its record
    # is still r1's booking in flight, and r1 is refused in doubt.
    assert sent.count("r1") == 1, sent
    said = told(model) if not isinstance(one, Exception) else []
    assert not any("released" in t for t in said), said
    assert (rec.tool, rec.status, rec.by) == ("book", RecordStatus.in_flight, None), rec
    assert isinstance(one, IndeterminateToolCallError), (one.status, rec.outcome)


@pytest.mark.parametrize("where", ["memory", "sqlite"])
async def test_show_of_the_taker_names_the_run_whose_call_it_is(tmp_path: Path, where: str) -> None:
    sent: list[str] = []
    agent = Agent("shop", "Book.", [booking(sent, {"r1"}, idempotent=True)])
    async with fresh_stores(where, tmp_path) as stores:
        await _r1_dies_r2_books(stores, agent)
        shown = render(await story(stores, T, "r2", step=None))
    assert sent == ["r1", "r2"]
    # What holds (1ae54c3): r2 lists the call it sent, at its own call id.
    assert "book (x9)" in shown
    # What should hold: the page names r1, whose call it is, and where it is resolved.
    assert "run r1's call taken over by this run (resolved on run r1)" in shown, shown


# --- what held ---------------------------------------------------------------------------


async def _r1_dies_r2_books(stores: Stores, agent: Agent) -> None:
    await crashes(AgentRunner.from_stores(books("c1"), stores, lease_policy=FAST), agent, "r1")
    two = await AgentRunner.from_stores(books("x9"), stores, lease_policy=FAST).run(
        agent, "go", tenant=T, run_id="r2"
    )
    assert two.status is RunStatus.completed


async def _take(stores: Stores, run_id: str, iteration: int, call_id: str) -> IdempotencyRecord:
    return await stores.idempotency.claim(
        "k",
        holder=f"w-{run_id}-{iteration}",
        tenant=T,
        run_id=run_id,
        iteration=iteration,
        tool="book",
        call_id=call_id,
        flags=SAFE,
        takeover=True,
    )


async def _listed(stores: Stores, run_id: str, iteration: int = 0) -> list[tuple[Any, ...]]:
    store = stores.idempotency
    whole = [(r.key, r.iteration, r.call_id) for r in await store.records(T, run_id)]
    if isinstance(store, RecordsFrom):
        found = [(r.key, r.iteration, r.call_id) for r in await store.records_from(T, run_id, 0)]
        assert found == whole, (run_id, found, whole)
        if iteration:
            later = await store.records_from(T, run_id, iteration + 1)
            assert [r.key for r in later] == [], (run_id, later)
    return whole


@pytest.mark.parametrize("where", EVERY)
async def test_a_chain_of_takers_lists_the_key_once_under_the_latest(
    tmp_path: Path, where: str
) -> None:
    async with fresh_stores(where, tmp_path) as stores:
        await _take(stores, "r1", 3, "c1")
        await _take(stores, "r2", 1, "x2")  # a taker at a turn lower than r1's
        assert await _listed(stores, "r2", 1) == [("k", 1, "x2")]
        assert await _listed(stores, "r1", 3) == [("k", 3, "c1")]
        await _take(stores, "r3", 7, "z3")
        assert await _listed(stores, "r2") == []  # documented: only the latest taker
        assert await _listed(stores, "r3", 7) == [("k", 7, "z3")]
        assert await _listed(stores, "r1", 3) == [("k", 3, "c1")]
        back = await _take(stores, "r1", 4, "c9")  # r1's resume takes it back
        assert (back.holder_run, back.holder_iteration, back.holder_call_id) == (None,) * 3
        assert await _listed(stores, "r3") == []
        assert await _listed(stores, "r2") == []
        assert await _listed(stores, "r1", 3) == [("k", 3, "c1")]


@pytest.mark.parametrize("where", EVERY)
async def test_resolve_on_the_taker_refuses_naming_the_first_run(
    tmp_path: Path, where: str
) -> None:
    sent: list[str] = []
    agent = Agent("shop", "Book.", [booking(sent, {"r1", "r2"}, idempotent=True)])
    async with fresh_stores(where, tmp_path) as stores:
        await crashes(AgentRunner.from_stores(books("c1"), stores, lease_policy=FAST), agent, "r1")
        await crashes(AgentRunner.from_stores(books("x9"), stores, lease_policy=FAST), agent, "r2")
        parser = new_parser()
        add_frontier_commands(_subcommands(parser))
        argv = ["resolve", "r2", "--call", "x9", "--never-ran", "--tenant", T, "--by", "ops"]
        with pytest.raises(Refused, match=r"resolve it on run 'r1' \(call c1\)"):
            await run_frontier_command(parser.parse_args(argv), stores, io.StringIO())
        rec = (await stores.idempotency.lookup([KEY], tenant=T))[KEY]
    assert sent == ["r1", "r2"]
    assert (rec.status, rec.run_id, rec.holder_run) == (RecordStatus.in_flight, "r1", "r2")
