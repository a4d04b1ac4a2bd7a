"""An attacker's look at cc55d93: a call claimed and then not sent (its tool's validation
refuses it, ``_invalid``; masked, ``MASKED_CALL``; a cancel found) lets its claim go
(``recording.release_unsent``) instead of recording the refusal under its key. Memory,
SQLite, Redis (127.0.0.1:6379) and PostgreSQL (``test``).

Defects (each was an ``xfail(strict=True)``; all fixed since, their tests plain: a call
that cannot go out, refused by its tool's validation or masked, is now looked up and never
claimed, so no takeover and no release happen for it. Two tests were changed to that
design, saying so: a resumed takeover refused today is in doubt, not completed, and r2 comes
back while r1 is carried, then replays r1's outcome):

1. (MEDIUM) ``test_a_live_runs_sent_call_keeps_its_record_when_another_run_is_refused``.
   ``dispatch._call_tool`` takes over another holder's in-flight claim of a safe-to-resend
   tool (``idempotent=True``) before it judges the arguments: run r2's call under the
   business key ``order-5`` takes over live run r1's claim while r1's charge is out, is
   refused by ``_invalid`` and ``release_unsent`` deletes the key. r1's ``complete`` then
   raises ``StaleFenceError``, ``read_back`` finds nothing and r1's outcome is never
   recorded; a third run's charge of order 5 is sent again (the kit relies on the far side
   deduplicating by key). A never-sent call erased the record of one that went out. (Before
   cc55d93 r2's refusal was recorded over r1's claim and r1 adopted it as its own outcome:
   also wrong, differently.)
2. (MEDIUM) ``test_a_resumed_takeover_refused_today_keeps_the_sent_calls_record``. Same path
   on a resume: attempt 1 sent an idempotent charge and died; the resume plans a takeover,
   the validator (which asks the world) now refuses, the model is told "invalid arguments"
   for a call that went out, and the record is dropped: nothing in the store says it ran.
3. (LOW) ``test_a_death_between_a_refused_calls_claim_and_its_release_leaves_nothing_in_doubt``.
   The claim of a call about to be refused is durable before ``_invalid`` is asked (with
   ``group_writes`` too: ``grouping.grouped`` commits the open group on a BaseException);
   a death before ``release_unsent`` leaves a call never sent in flight, and the resume
   raises ``IndeterminateToolCallError`` (parked, for an operator), though it could tell.
   Conservative: nothing sent twice, nothing guessed. (A real SIGKILL inside a group leaves
   the claim uncommitted; not run here.)

What held (plain tests): twins under one business key, one refused and one valid, either
order, one at a time and ``parallel_tool_calls=2``, on all four backends: the valid one is
sent once, its record completed, the refused one never releases it (``sent_keys`` and the
per-key ``attempt.sending`` lock), a later run replays it; grouped writes (SQLite,
PostgreSQL): refused-then-valid twins in one group, sent once, recorded, a later slip
answered the real outcome; an approved ``requires_approval`` call its tool refuses is never
sent, the run goes on and the corrected call (approved) is sent once; a replay of a run with
a refused call sends nothing real and leaves the original's records as they were.

Observed, not pinned: ``tesserix show`` of a run whose only call was refused lists the
turn ("asks charge (a)") but nothing under ``calls:``: the refusal is only in the
transcript now. Not looked at: a real SIGKILL of a subprocess mid-group, a masked
(``redacted``) call under a takeover, Redis/PostgreSQL group commit failures.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Annotated, Any

import pytest
from pydantic import AfterValidator

from run.helpers import Asks, fresh_stores
from tesserix_adk import (
    Agent,
    AgentRunner,
    LeasePolicy,
    Role,
    RunStatus,
    ToolCall,
    ToolContext,
    tool,
)
from tesserix_adk.errors import IndeterminateToolCallError, ResumeConflictError
from tesserix_adk.stores.protocols import RecordStatus
from tesserix_adk.testing.faults import SimulatedCrash

T = "acme"
FAST = LeasePolicy(ttl=2.0, renew_within=1.0)
WHERE = ["memory", "sqlite"]
EVERY = [
    "memory",
    "sqlite",
    pytest.param("redis", marks=pytest.mark.redis),
    pytest.param("postgres", marks=pytest.mark.postgres),
]


def _by_order(**kw: Any) -> str:
    return f"order-{kw['arguments']['order']}"


def _told(model: Any) -> list[str]:
    return [m.text for m in model.requests[-1].messages if m.role is Role.tool]


class World:
    """What a validator asks: whether orders are open (its answer changes)."""

    def __init__(self) -> None:
        self.open = True
        self.charged: list[tuple[str, str | None]] = []


WORLD = World()


def _open_order(order: str) -> str:
    if not WORLD.open:
        raise ValueError("orders are closed")
    return order


Order = Annotated[str, AfterValidator(_open_order)]


@pytest.fixture
def world() -> World:
    WORLD.__init__()  # type: ignore[misc]
    return WORLD


@pytest.mark.parametrize("where", EVERY)
async def test_a_resumed_takeover_refused_today_keeps_the_sent_calls_record(
    tmp_path: Path, where: str, world: World
) -> None:
    crash = [True]

    @tool(key=_by_order, idempotent=True)
    async def charge(order: Order, ctx: ToolContext) -> str:
        """Charge an order; the payment service dedupes by our key."""
        world.charged.append((order, ctx.idempotency_key))
        if crash[0]:
            crash[0] = False
            raise SimulatedCrash
        return f"charged {order}"

    agent = Agent("shop", "Charge.", [charge])
    turns = [[ToolCall(id="c1", name="charge", arguments={"order": "5"})], "done"]
    async with fresh_stores(where, tmp_path) as stores:
        with pytest.raises(SimulatedCrash):
            await AgentRunner.from_stores(Asks(*turns), stores, lease_policy=FAST).run(
                agent, "go", tenant=T, run_id="r"
            )
        assert len(world.charged) == 1  # it went out
        world.open = False  # the validator's world changed
        model = Asks(*turns)
        # It may have run and cannot be sent again (refused today): in doubt, not "invalid
        # arguments" (the attacker asked for a completed run; no outcome is known to tell).
        with pytest.raises(IndeterminateToolCallError, match="charge"):
            await AgentRunner.from_stores(model, stores, lease_policy=FAST).resume(
                agent, "r", tenant=T
            )
        found = await stores.idempotency.lookup(["acme/order-5"], tenant=T)
    assert found, "the record of a call that went out was released"
    assert found["acme/order-5"].status is RecordStatus.in_flight
    assert len(world.charged) == 1  # never sent again


@pytest.mark.parametrize("where", EVERY)
async def test_a_live_runs_sent_call_keeps_its_record_when_another_run_is_refused(
    tmp_path: Path, where: str, world: World
) -> None:
    inside = asyncio.Event()
    go_on = asyncio.Event()

    @tool(key=_by_order, idempotent=True)
    async def charge(order: Order, amount: int, ctx: ToolContext) -> str:
        """Charge an order; the payment service dedupes by our key."""
        world.charged.append((order, ctx.idempotency_key))
        inside.set()
        await go_on.wait()
        return f"charged {order}: {amount}"

    agent = Agent("shop", "Charge.", [charge])

    def asks(args: dict[str, Any]) -> Asks:
        return Asks([ToolCall(id="c1", name="charge", arguments=args)], "done")

    async with fresh_stores(where, tmp_path) as stores:
        first = asks({"order": "5", "amount": 10})
        one = asyncio.create_task(
            AgentRunner.from_stores(first, stores).run(agent, "go", tenant=T, run_id="r1")
        )
        await inside.wait()  # r1's charge is out, its claim in flight
        slip = asks({"order": "5", "amount": "ten"})
        # r1 is carried and may be sending order 5: r2 comes back later (as a valid call
        # would), its claim untouched; the attacker asked for "invalid arguments" at once.
        with pytest.raises(ResumeConflictError, match="r1"):
            await AgentRunner.from_stores(slip, stores).run(agent, "go", tenant=T, run_id="r2")
        go_on.set()
        await one
        found = await stores.idempotency.lookup(["acme/order-5"], tenant=T)
        two = await AgentRunner.from_stores(slip, stores).resume(agent, "r2", tenant=T)
        later = asks({"order": "5", "amount": 10})
        await AgentRunner.from_stores(later, stores).run(agent, "go", tenant=T, run_id="r3")
    assert two.status is RunStatus.completed
    assert _told(first) == ["charged 5: 10"]
    assert "acme/order-5" in found, "r1's charge went out; r2's refusal let its record go"
    assert found["acme/order-5"].status is RecordStatus.completed
    assert len(world.charged) == 1, world.charged


@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("where", EVERY)
async def test_a_refused_call_is_never_claimed_so_no_death_leaves_it_in_doubt(
    tmp_path: Path, where: str, world: World, monkeypatch: pytest.MonkeyPatch, grouped: bool
) -> None:
    """(Was: a death between the refused call's claim and its release left it in doubt.)
    A call that cannot go out is looked up, never claimed: there is no claim to die with."""

    @tool(key=_by_order)
    def charge(order: str, amount: int) -> str:
        """Charge an order once."""
        world.charged.append((order, None))
        return f"charged {order}: {amount}"

    agent = Agent("shop", "Charge.", [charge])
    turns = [[ToolCall(id="c1", name="charge", arguments={"order": "5", "amount": "ten"})]]
    async with fresh_stores(where, tmp_path) as stores:
        real = stores.idempotency.claim
        claimed: list[str] = []

        async def claiming(key: str, **kw: Any) -> Any:
            if kw.get("tool") is not None:
                claimed.append(key)
            return await real(key, **kw)

        monkeypatch.setattr(stores.idempotency, "claim", claiming)
        run = await AgentRunner.from_stores(
            Asks(*turns), stores, lease_policy=FAST, group_writes=grouped
        ).run(agent, "go", tenant=T, run_id="r")
        found = await stores.idempotency.lookup(["acme/order-5"], tenant=T)
    assert run.status is RunStatus.completed
    assert claimed == [] and found == {}
    assert world.charged == []


def _charger(world: World, **flags: Any) -> Any:
    @tool(key=_by_order, **flags)
    def charge(order: str, amount: int) -> str:
        """Charge an order once."""
        world.charged.append((order, str(amount)))
        return f"charged {order}: {amount}"

    return charge


def _twins(first: dict[str, Any], second: dict[str, Any]) -> list[ToolCall]:
    return [
        ToolCall(id="a", name="charge", arguments=first),
        ToolCall(id="b", name="charge", arguments=second),
    ]


GOOD = {"order": "5", "amount": 10}
BAD = {"order": "5", "amount": "ten"}


@pytest.mark.parametrize("where", EVERY)
@pytest.mark.parametrize("side_by_side", [1, 2])
@pytest.mark.parametrize("bad_first", [True, False])
async def test_twins_under_one_key_one_refused_send_the_valid_one_once(
    tmp_path: Path, where: str, world: World, side_by_side: int, bad_first: bool
) -> None:
    agent = Agent("shop", "Charge.", [_charger(world)], parallel_tool_calls=side_by_side)
    turn = _twins(BAD, GOOD) if bad_first else _twins(GOOD, BAD)
    async with fresh_stores(where, tmp_path) as stores:
        model = Asks(turn)
        run = await AgentRunner.from_stores(model, stores).run(agent, "go", tenant=T, run_id="r")
        assert run.status is RunStatus.completed
        [rec] = (await stores.idempotency.lookup(["acme/order-5"], tenant=T)).values()
        again = Asks([ToolCall(id="c", name="charge", arguments=GOOD)])
        await AgentRunner.from_stores(again, stores).run(agent, "go", tenant=T, run_id="r2")
    assert world.charged == [("5", "10")]
    assert rec.status.value == "completed"
    assert _told(again) == ["charged 5: 10"]
    told = _told(model)
    if bad_first:
        assert "invalid arguments" in told[0] and told[1] == "charged 5: 10"
    else:  # the twin under the same key is answered the outcome of the one that went out
        assert told == ["charged 5: 10", "charged 5: 10"]


@pytest.mark.parametrize(
    "where",
    ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)],
)
async def test_grouped_writes_refused_then_valid_twin_are_sent_once_and_recorded(
    tmp_path: Path, where: str, world: World
) -> None:
    agent = Agent("shop", "Charge.", [_charger(world)])
    async with fresh_stores(where, tmp_path) as stores:
        model = Asks(_twins(BAD, GOOD), [ToolCall(id="c", name="charge", arguments=BAD)])
        runner = AgentRunner.from_stores(model, stores, group_writes=True)
        run = await runner.run(agent, "go", tenant=T, run_id="r")
        found = await stores.idempotency.lookup(["acme/order-5"], tenant=T)
    assert run.status is RunStatus.completed
    assert world.charged == [("5", "10")]
    assert found["acme/order-5"].status.value == "completed"
    # The later slip under the same order finds the charge that happened.
    assert _told(model)[-1] == "charged 5: 10"


@pytest.mark.parametrize("where", WHERE)
async def test_an_approved_call_its_tool_refuses_is_never_sent_and_the_run_goes_on(
    tmp_path: Path, where: str, world: World
) -> None:
    agent = Agent("shop", "Charge.", [_charger(world, requires_approval=True)])
    turns = (
        [ToolCall(id="a", name="charge", arguments=BAD)],
        [ToolCall(id="b", name="charge", arguments=GOOD)],
    )
    async with fresh_stores(where, tmp_path) as stores:
        runner = AgentRunner.from_stores(Asks(*turns), stores)
        run = await runner.run(agent, "go", tenant=T, run_id="r")
        assert run.status is RunStatus.waiting_approval and run.pending_approval is not None
        await stores.approvals.decide(T, run.pending_approval.id, approved=True, by="ops")
        model = Asks(*turns)
        run = await AgentRunner.from_stores(model, stores).resume(agent, "r", tenant=T)
        assert run.status is RunStatus.waiting_approval and run.pending_approval is not None
        await stores.approvals.decide(T, run.pending_approval.id, approved=True, by="ops")
        model = Asks(*turns)
        run = await AgentRunner.from_stores(model, stores).resume(agent, "r", tenant=T)
    assert run.status is RunStatus.completed
    assert world.charged == [("5", "10")]
    told = _told(model)
    assert "invalid arguments" in told[0] and told[1] == "charged 5: 10"


@pytest.mark.parametrize("where", WHERE)
async def test_a_replay_of_a_run_with_a_refused_call_sends_nothing_real(
    tmp_path: Path, where: str, world: World
) -> None:
    agent = Agent("shop", "Charge.", [_charger(world)])
    turns = (
        [ToolCall(id="a", name="charge", arguments=BAD)],
        [ToolCall(id="b", name="charge", arguments=GOOD)],
    )
    async with fresh_stores(where, tmp_path) as stores:
        await AgentRunner.from_stores(Asks(*turns), stores).run(agent, "go", tenant=T, run_id="r")
        before = await stores.idempotency.records(T, "r")
        stubbed: list[Any] = []
        replayed = await AgentRunner.from_stores(Asks(*turns), stores).replay(
            agent,
            "r",
            tenant=T,
            from_step=1,
            stubs={"charge": lambda **kw: stubbed.append(kw) or "stubbed"},
            new_run_id="r-replay",
        )
        after = await stores.idempotency.records(T, "r")
    assert replayed.status is RunStatus.completed
    assert world.charged == [("5", "10")]
    assert [(r.key, r.status, r.outcome) for r in before] == [
        (r.key, r.status, r.outcome) for r in after
    ]
