"""An attacker's look at 1bb4b03 (now ``run/dispatch.py`` ``_not_claimed`` and
``run/claims.py`` after 7857b75): a keyed call that cannot go out (refused by its tool's
validation, or masked) is looked up and never claimed, and ``recording.release_unsent``
never releases a claim this attempt took over (``attempt.takeover_keys``). Memory, SQLite,
Redis (127.0.0.1:6379) and PostgreSQL (``test``).

Defects (both fixed since, their tests plain and changed to the fixes' designs. 1: a
record taken over names its taker's run, ``IdempotencyRecord.holder_run``, whose lease is
the one looked at; the record stays the first run's call. 2: a run no longer takes over a
claim another run is carried with, it comes back later, and carried on then it ends
cancelled, its cancel read first):

1. (LOW-MEDIUM) ``test_a_refused_call_comes_back_while_the_run_that_took_over_is_sending``.
   A cross-run takeover keeps the original run's id on the record: ``stores/records.py``
   ``after_claim`` (``takeover``) replaces only ``holder``/``fence``/``since`` (Redis and
   PostgreSQL do the same), so the record names run r1 (crashed) while run r2's holder has
   it and is sending now. ``claims.unless_carried`` (from ``dispatch._not_claimed``) asks
   whether r1 (``rec.run_id``) is carried, not r2: r3's refused call under the shared key
   raises ``IndeterminateToolCallError`` ("claimed in flight by run 'r1' (<r2's holder>)")
   when it should be ``ResumeConflictError`` (come back later; r2 is live). The run is
   stopped in doubt, and the operator is sent to the wrong run. (Resumed after r2 records,
   r3 does replay r2's outcome: nothing is sent twice, nothing is guessed.) All four
   backends.
2. (LOW) ``test_a_takeover_found_cancelled_leaves_the_live_runs_outcome_recorded``.
   Run r2's valid call of an ``idempotent=True`` tool takes over live run r1's claim
   (``dispatch._call_tool``: the takeover comes before ``unless_carried`` and before the
   cancel is looked at), then finds r2's cancel after the claim and is not sent. The claim is
   now never released (``release_unsent`` with ``takeover_keys``), which is honest for r2, but
   r1's charge, which went out and came back, cannot be recorded: ``complete`` raises
   ``StaleFenceError`` and ``_call_tool``'s ``StaleFenceError`` branch finds the claim still in
   flight (``read_back``) and goes on without recording anything. The record stays in flight
   for good, under the holder of a cancelled run that never sent it, and run r3 takes it over
   and charges order 5 again (the far side deduplicates, so this is within the kit's design
   for idempotent tools, but a known outcome was dropped). By reading, not run: the same
   follows when the lease check stops the taken-over call (``NotSent``). All four backends.

What held (plain tests): grouped writes (SQLite, PostgreSQL), one at a time and
``parallel_tool_calls=2``: a valid twin sent and then a refused twin under the same key in
the same open group. The refused twin's lookup sees the completed record the group has not
committed yet (same connection and transaction), replays it, and is not in doubt. A refused
call whose record an operator resolved ``never_ran`` is answered "invalid arguments", the
``never_ran`` record is left as it was, and a later valid call is sent once. A refused call
under a key that a crashed run (non-idempotent tool) left in flight is in doubt and names
that run, with nothing sent. A refused call that replays an operator's recorded outcome
reports ``ToolCallFinished.disposition`` ``settled`` with ``by``. Refused calls racing a
claim: a refused call only ever answers "not sent" about itself, which is true whatever
another holder is doing under the key, so no lie was found there.

Not looked at: the Temporal activity path (``temporal/steps.py``), replay with masked
arguments, and a real SIGKILL.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

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
from tesserix_adk.checkpoint.payload import encode_outcome
from tesserix_adk.checkpoint.redaction import Redactor
from tesserix_adk.errors import IndeterminateToolCallError, ResumeConflictError
from tesserix_adk.messages import ToolOutcome
from tesserix_adk.run.events import CallDisposition, ToolCallFinished
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.stores.protocols import RecordStatus
from tesserix_adk.testing.faults import SimulatedCrash

T = "acme"
KEY = "acme/order-5"
FAST = LeasePolicy(ttl=2.0, renew_within=1.0)
EVERY = [
    "memory",
    "sqlite",
    pytest.param("redis", marks=pytest.mark.redis),
    pytest.param("postgres", marks=pytest.mark.postgres),
]
GROUPED = ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
GOOD = {"order": "5", "amount": 10}
BAD = {"order": "5", "amount": "ten"}


def _by_order(**kw: Any) -> str:
    return f"order-{kw['arguments']['order']}"


def _told(model: Any) -> list[str]:
    return [m.text for m in model.requests[-1].messages if m.role is Role.tool]


def _asks(args: dict[str, Any]) -> Asks:
    return Asks([ToolCall(id="c1", name="charge", arguments=args)], "done")


def _charger(charged: list[Any], **flags: Any) -> Any:
    @tool(key=_by_order, **flags)
    def charge(order: str, amount: int, ctx: ToolContext) -> str:
        """Charge an order once."""
        charged.append((ctx.run_id, amount))
        if ctx.run_id == "crash":
            raise SimulatedCrash
        return f"charged {order}: {amount}"

    return charge


class CancelsItself(Asks):
    """A model whose first answer comes once its own run's cancel is recorded: the cancel
    lands after the model answered and before the call's claim."""

    def __init__(self, stores: Stores, run_id: str, *turns: Any) -> None:
        super().__init__(*turns)
        self.stores = stores
        self.run_id = run_id

    async def complete(self, request: Any) -> Any:
        if not self.requests:
            await AgentRunner.from_stores(Asks(), self.stores).cancel(
                self.run_id, tenant=T, by="ops"
            )
        return await super().complete(request)


@pytest.mark.parametrize("where", EVERY)
async def test_a_refused_call_comes_back_while_the_run_that_took_over_is_sending(
    tmp_path: Path, where: str
) -> None:
    inside = asyncio.Event()
    go_on = asyncio.Event()
    charged: list[Any] = []

    @tool(key=_by_order, idempotent=True)
    async def charge(order: str, amount: int, ctx: ToolContext) -> str:
        """Charge an order; the payment service dedupes by our key."""
        charged.append((ctx.run_id, amount))
        if ctx.run_id == "r1":
            raise SimulatedCrash
        inside.set()
        await go_on.wait()
        return f"charged {order}: {amount}"

    agent = Agent("shop", "Charge.", [charge])
    async with fresh_stores(where, tmp_path) as stores:
        with pytest.raises(SimulatedCrash):  # r1 sent order 5 and died, its claim in flight
            await AgentRunner.from_stores(_asks(GOOD), stores, lease_policy=FAST).run(
                agent, "go", tenant=T, run_id="r1"
            )
        two = asyncio.create_task(
            AgentRunner.from_stores(_asks(GOOD), stores, lease_policy=FAST).run(
                agent, "go", tenant=T, run_id="r2"
            )
        )
        await inside.wait()  # r2 took r1's claim over and is sending order 5 now
        held = (await stores.idempotency.lookup([KEY], tenant=T))[KEY]
        try:
            with pytest.raises(Exception) as raised:
                await AgentRunner.from_stores(_asks(BAD), stores, lease_policy=FAST).run(
                    agent, "go", tenant=T, run_id="r3"
                )
        finally:
            go_on.set()
            await two
        later = _asks(BAD)
        three = await AgentRunner.from_stores(later, stores, lease_policy=FAST).resume(
            agent, "r3", tenant=T
        )
    # What holds: nothing sent twice by r3, and it replays r2's outcome once resumed.
    assert charged == [("r1", 10), ("r2", 10)]
    assert three.status is RunStatus.completed and _told(later) == ["charged 5: 10"]
    # What should hold: r2 is carried and sending, so r3 comes back later, told so by r2.
    assert isinstance(raised.value, ResumeConflictError), raised.value
    assert "r2" in str(raised.value)
    # (Changed to the fix's design: the record stays r1's call and names r2 as its taker.)
    assert (held.run_id, held.holding_run) == ("r1", "r2"), held


@pytest.mark.parametrize("where", EVERY)
async def test_a_takeover_found_cancelled_leaves_the_live_runs_outcome_recorded(
    tmp_path: Path, where: str
) -> None:
    inside = asyncio.Event()
    go_on = asyncio.Event()
    charged: list[Any] = []

    @tool(key=_by_order, idempotent=True)
    async def charge(order: str, amount: int, ctx: ToolContext) -> str:
        """Charge an order; the payment service dedupes by our key."""
        charged.append((ctx.run_id, amount))
        if ctx.run_id == "r1":
            inside.set()
            await go_on.wait()
        return f"charged {order}: {amount}"

    agent = Agent("shop", "Charge.", [charge])
    async with fresh_stores(where, tmp_path) as stores:
        first = _asks(GOOD)
        one = asyncio.create_task(
            AgentRunner.from_stores(first, stores).run(agent, "go", tenant=T, run_id="r1")
        )
        await inside.wait()  # r1's charge is out
        second = CancelsItself(stores, "r2", [ToolCall(id="c1", name="charge", arguments=GOOD)])
        # (Since the fix r2 does not take over live r1's claim: it comes back later, and
        # carried on then it ends cancelled, its cancel read first.)
        with pytest.raises(ResumeConflictError, match="r1"):
            await AgentRunner.from_stores(second, stores).run(agent, "go", tenant=T, run_id="r2")
        go_on.set()
        await one
        two = await AgentRunner.from_stores(second, stores).resume(agent, "r2", tenant=T)
        found = (await stores.idempotency.lookup([KEY], tenant=T))[KEY]
        third = _asks(GOOD)
        await AgentRunner.from_stores(third, stores).run(agent, "go", tenant=T, run_id="r3")
    # What holds: r2 ends cancelled, sends nothing, and r1 is told its own outcome.
    assert two.status is RunStatus.cancelled
    assert _told(first) == ["charged 5: 10"]
    assert ("r2", 10) not in charged
    # What should hold: r1's outcome is recorded, and r3 replays it.
    assert found.status is RecordStatus.completed, found
    assert charged == [("r1", 10)], charged


@pytest.mark.parametrize("where", GROUPED)
@pytest.mark.parametrize("side_by_side", [1, 2])
async def test_grouped_writes_a_refused_twin_after_a_sent_one_replays_it_from_the_group(
    tmp_path: Path, where: str, side_by_side: int
) -> None:
    charged: list[Any] = []
    agent = Agent("shop", "Charge.", [_charger(charged)], parallel_tool_calls=side_by_side)
    turn = [
        ToolCall(id="a", name="charge", arguments=GOOD),
        ToolCall(id="b", name="charge", arguments=BAD),
    ]
    async with fresh_stores(where, tmp_path) as stores:
        model = Asks(turn)
        run = await AgentRunner.from_stores(model, stores, group_writes=True).run(
            agent, "go", tenant=T, run_id="r"
        )
        found = await stores.idempotency.lookup([KEY], tenant=T)
    assert run.status is RunStatus.completed
    assert charged == [("r", 10)]
    assert _told(model) == ["charged 5: 10", "charged 5: 10"]
    assert found[KEY].status is RecordStatus.completed


@pytest.mark.parametrize("where", EVERY)
async def test_a_refused_call_over_a_never_ran_record_keeps_it_and_the_valid_one_goes_once(
    tmp_path: Path, where: str
) -> None:
    charged: list[Any] = []
    agent = Agent("shop", "Charge.", [_charger(charged)])
    async with fresh_stores(where, tmp_path) as stores:
        with pytest.raises(SimulatedCrash):
            await AgentRunner.from_stores(_asks(GOOD), stores, lease_policy=FAST).run(
                agent, "go", tenant=T, run_id="crash"
            )
        await stores.idempotency.resolve(KEY, tenant=T, never_ran=True, by="ops")
        slip = _asks(BAD)
        two = await AgentRunner.from_stores(slip, stores).run(agent, "go", tenant=T, run_id="r2")
        kept = (await stores.idempotency.lookup([KEY], tenant=T))[KEY]
        good = _asks(GOOD)
        await AgentRunner.from_stores(good, stores).run(agent, "go", tenant=T, run_id="r3")
        again = _asks(GOOD)
        await AgentRunner.from_stores(again, stores).run(agent, "go", tenant=T, run_id="r4")
    assert two.status is RunStatus.completed
    assert "invalid arguments" in _told(slip)[0]
    assert kept.status is RecordStatus.never_ran
    assert charged == [("crash", 10), ("r3", 10)]
    assert _told(again) == ["charged 5: 10"]


@pytest.mark.parametrize("where", EVERY)
async def test_a_refused_call_under_a_crashed_runs_claim_is_in_doubt_and_names_it(
    tmp_path: Path, where: str
) -> None:
    charged: list[Any] = []
    agent = Agent("shop", "Charge.", [_charger(charged)])
    async with fresh_stores(where, tmp_path) as stores:
        with pytest.raises(SimulatedCrash):
            await AgentRunner.from_stores(_asks(GOOD), stores, lease_policy=FAST).run(
                agent, "go", tenant=T, run_id="crash"
            )
        with pytest.raises(IndeterminateToolCallError, match="crash"):
            await AgentRunner.from_stores(_asks(BAD), stores, lease_policy=FAST).run(
                agent, "go", tenant=T, run_id="r2"
            )
        found = (await stores.idempotency.lookup([KEY], tenant=T))[KEY]
    assert charged == [("crash", 10)]
    assert found.status is RecordStatus.in_flight and found.run_id == "crash"


@pytest.mark.parametrize("where", ["memory", "sqlite"])
async def test_a_refused_call_replaying_an_operators_outcome_reports_it_settled(
    tmp_path: Path, where: str
) -> None:
    charged: list[Any] = []
    agent = Agent("shop", "Charge.", [_charger(charged)])
    async with fresh_stores(where, tmp_path) as stores:
        with pytest.raises(SimulatedCrash):
            await AgentRunner.from_stores(_asks(GOOD), stores, lease_policy=FAST).run(
                agent, "go", tenant=T, run_id="crash"
            )
        said = encode_outcome(ToolOutcome(call_id="c1", content="charged 5 (ops)"), Redactor())
        await stores.idempotency.resolve(KEY, said, tenant=T, by="ops")
        slip = _asks(BAD)
        events: list[Any] = []
        await AgentRunner.from_stores(slip, stores).run(
            agent, "go", tenant=T, run_id="r2", on_event=events.append
        )
    finished = [e for e in events if isinstance(e, ToolCallFinished)]
    assert [(e.disposition, e.by) for e in finished] == [(CallDisposition.settled, "ops")]
    assert _told(slip) == ["charged 5 (ops)"]
    assert charged == [("crash", 10)]
