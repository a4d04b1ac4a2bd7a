"""Attacks on 148904d: a run meeting a claim another LIVE run holds under a shared business
key raises ``ResumeConflictError`` (retryable, a worker looks again later) instead of being
refused in doubt and parked.

Findings (the one defect was two strict xfails, fixed since and their tests plain: once
that run is known not carried, dispatch claims again and the resume plans again, so a
recorded outcome is replayed):

1. (low-moderate) A stale read of the other run's claim: dispatch (``run/dispatch.py``,
   ``_call_tool``: ``claim`` read, then ``carried_now``) and resume (``run/runner.py``:
   ``plan_resume`` read, then ``holding.carried_elsewhere``) read the claim FIRST and look
   at the other run's lease SECOND. If that run records its outcome and lets its lease go
   between the two reads, this run sees "in flight" and "not carried": it is refused in
   doubt (``IndeterminateToolCallError``, exit 4, "nobody can say whether it ran") about a
   call whose outcome is recorded, where the change promises it replays that outcome. A
   lease that is not live should be followed by a fresh read of the claim (a run records
   its outcome before it lets its lease go). A worker heals it after parking
   (``_unless_settled_meanwhile`` finds the record completed), a caller of ``run`` or
   ``resume`` and ``tesserix run --resume`` do not.
   ``test_the_other_run_finishing_between_the_claim_read_and_the_lease_look_is_replayed``
   ``test_on_resume_the_other_run_finishing_after_the_plan_was_read_is_replayed``

What held (plain tests): the come-back and replay on Redis and PostgreSQL; one model
charge across come-backs with ``group_writes=True`` on SQLite and PostgreSQL, and a sibling
sent before the conflict in the same turn replayed, not sent again; two runs whose calls
cross (each holds the key the other needs next) both finish, each key sent once; a mixed
plan (own call in doubt beside another run's live claim) and a parallel turn meeting a
live and a dead run's claims are refused in doubt, not sent back round; an approved call
meeting a live claim comes back and is not asked again; the lease looked at is the
tenant's (the same run id live in another tenant does not make a dead claim wait);
a cancel still ends a run that was told to come back (directly and by a worker), nothing
sent; ``tesserix run --resume`` says it in one line, exit 3, no traceback; a worker whose
holder of the claim is SIGKILLed mid-call (real process, before or after the effect) ends
up parked in doubt, the run not looped forever and nothing sent twice. By design, and not
asserted as a defect: while the other run's lease is live (even if its tool hangs for
ever) the waiting run is never parked nor counted toward ``max_attempts``, and its work
item records no reason naming the run it waits on.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import signal
import sqlite3
import sys
import textwrap
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from tesserix_adk import (
    Agent,
    AgentRunner,
    Carried,
    IndeterminateToolCallError,
    LeasePolicy,
    RunStatus,
    ScriptedProvider,
    ScriptedTurn,
    ToolContext,
    Worker,
    WorkState,
    open_stores,
    tool,
)
from tesserix_adk.cli import ExitCode, resume_main
from tesserix_adk.errors import ResumeConflictError
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.stores.protocols import RecordStatus
from tesserix_adk.testing.faults import SimulatedCrash

T = "acme"
TURNS: list[Any] = [[("charge", {"order": "5"})], "done"]


class Shop:
    """The payment system: what it charged, and gates that hold named runs inside a call."""

    def __init__(self, held: tuple[str, ...] = ("r1",)) -> None:
        self.charged: list[tuple[str, str]] = []
        self.held = held
        self.inside: dict[str, asyncio.Event] = {r: asyncio.Event() for r in held}
        self.gate: dict[str, asyncio.Event] = {r: asyncio.Event() for r in held}
        self.die_in: str | None = None

    def agent(self, parallel: int = 1) -> Agent:
        @tool(key=lambda **kw: f"order-{kw['arguments']['order']}")
        async def charge(order: str, ctx: ToolContext) -> dict[str, str]:
            """Charge an order."""
            if ctx.run_id in self.held and not self.gate[ctx.run_id].is_set():
                self.inside[ctx.run_id].set()
                await self.gate[ctx.run_id].wait()
                if self.die_in == ctx.run_id:
                    raise SimulatedCrash(f"{ctx.run_id} died with the call in hand")
            assert ctx.idempotency_key is not None
            self.charged.append((ctx.run_id, ctx.idempotency_key))
            return {"charged": order, "by": ctx.run_id}

        return Agent("shop", "Charge.", [charge], parallel_tool_calls=parallel)

    def keys(self) -> list[str]:
        return sorted(k for _, k in self.charged)


@contextlib.asynccontextmanager
async def _backend(name: str, tmp_path: Path) -> AsyncIterator[Stores]:
    if name == "memory":
        async with open_stores("memory://") as stores:
            yield stores
    elif name == "sqlite":
        async with open_stores(f"sqlite:///{tmp_path / 'a.sqlite3'}") as stores:
            await stores.create_schema()
            yield stores
    elif name == "redis":
        from adapters.services import redis_stores

        async with redis_stores() as stores:
            yield stores
    else:
        from adapters.services import postgres_stores

        async with postgres_stores() as stores:
            yield stores


ALL = [
    "memory",
    "sqlite",
    pytest.param("redis", marks=pytest.mark.redis),
    pytest.param("postgres", marks=pytest.mark.postgres),
]
GROUPING = ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]


def _runner(
    stores: Stores,
    turns: list[Any] | None = None,
    *,
    ttl: float = 2.0,
    provider: Any = None,
    group_writes: bool = False,
) -> AgentRunner:
    return AgentRunner.from_stores(
        provider if provider is not None else ScriptedProvider(list(turns or TURNS)),
        stores,
        lease_policy=LeasePolicy(ttl=ttl, renew_within=ttl / 2),
        never_ran_margin=0.0,
        group_writes=group_writes,
    )


async def _until_free(stores: Stores, run_id: str, tenant: str = T) -> None:
    deadline = time.monotonic() + 10
    while await stores.leases.current(tenant, run_id) is not None:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)


# --- the defect: the claim read before the lease, never again --------------------------------


@pytest.mark.parametrize("backend", ALL)
async def test_the_other_run_finishing_between_the_claim_read_and_the_lease_look_is_replayed(
    backend: str, tmp_path: Path
) -> None:
    async with _backend(backend, tmp_path) as stores:
        shop = Shop()
        agent = shop.agent()
        r1 = asyncio.create_task(_runner(stores).run(agent, "go", tenant=T, run_id="r1"))
        await asyncio.wait_for(shop.inside["r1"].wait(), 10)
        real = stores.leases.current

        async def current(tenant: str, run_id: str) -> Any:
            if run_id == "r1" and not shop.gate["r1"].is_set():
                # r2 has read r1's claim in flight; r1 finishes now, before r2 looks at
                # r1's lease: an interleaving two processes can always produce.
                shop.gate["r1"].set()
                assert (await r1).status is RunStatus.completed
            return await real(tenant, run_id)

        stores.leases.current = current  # type: ignore[method-assign]
        run = await _runner(stores).run(agent, "go", tenant=T, run_id="r2")
        assert run.status is RunStatus.completed  # r1's outcome replayed
        assert shop.charged == [("r1", "acme/order-5")]


@pytest.mark.parametrize("backend", ALL)
async def test_on_resume_the_other_run_finishing_after_the_plan_was_read_is_replayed(
    backend: str, tmp_path: Path
) -> None:
    async with _backend(backend, tmp_path) as stores:
        shop = Shop()
        agent = shop.agent()
        r1 = asyncio.create_task(_runner(stores).run(agent, "go", tenant=T, run_id="r1"))
        await asyncio.wait_for(shop.inside["r1"].wait(), 10)
        with pytest.raises(ResumeConflictError):
            await _runner(stores).run(agent, "go", tenant=T, run_id="r2")
        real = stores.leases.current

        async def current(tenant: str, run_id: str) -> Any:
            if run_id == "r1" and not shop.gate["r1"].is_set():
                shop.gate["r1"].set()
                assert (await r1).status is RunStatus.completed
            return await real(tenant, run_id)

        stores.leases.current = current  # type: ignore[method-assign]
        run = await _runner(stores).resume(agent, "r2", tenant=T)
        assert run.status is RunStatus.completed
        assert shop.charged == [("r1", "acme/order-5")]


# --- what held ------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ALL)
async def test_come_back_then_replay_on_every_backend(backend: str, tmp_path: Path) -> None:
    async with _backend(backend, tmp_path) as stores:
        shop = Shop()
        agent = shop.agent()
        r1 = asyncio.create_task(_runner(stores).run(agent, "go", tenant=T, run_id="r1"))
        await asyncio.wait_for(shop.inside["r1"].wait(), 10)
        with pytest.raises(ResumeConflictError, match="'r1'") as met:
            await _runner(stores).run(agent, "go", tenant=T, run_id="r2")
        assert met.value.retryable
        for _ in range(3):  # come back, again and again, while r1 sends it
            with pytest.raises(ResumeConflictError):
                await _runner(stores).resume(agent, "r2", tenant=T)
        shop.gate["r1"].set()
        assert (await asyncio.wait_for(r1, 10)).status is RunStatus.completed
        run = await _runner(stores).resume(agent, "r2", tenant=T)
        assert run.status is RunStatus.completed and run.output == "done"
        assert shop.charged == [("r1", "acme/order-5")]
        rec = (await stores.idempotency.lookup(["acme/order-5"], tenant=T))["acme/order-5"]
        assert rec.status is RecordStatus.completed and rec.run_id == "r1"


class Counting:
    """A scripted model that counts what each run asked (and what it charges: 1000 micros a
    turn)."""

    def __init__(self, turns: list[Any]) -> None:
        self.inner = ScriptedProvider(
            [
                ScriptedTurn(calls=tuple(t), cost_micros=1000)
                if isinstance(t, list)
                else ScriptedTurn(text=t, cost_micros=1000)
                for t in turns
            ]
        )
        self.asked = 0

    async def complete(self, request: Any) -> Any:
        self.asked += 1
        return await self.inner.complete(request)


@pytest.mark.parametrize("backend", GROUPING)
async def test_grouped_writes_the_model_charged_once_and_a_sibling_sent_before_is_replayed(
    backend: str, tmp_path: Path
) -> None:
    async with _backend(backend, tmp_path) as stores:
        shop = Shop()
        agent = shop.agent()
        r1 = asyncio.create_task(
            _runner(stores, group_writes=True).run(agent, "go", tenant=T, run_id="r1")
        )
        await asyncio.wait_for(shop.inside["r1"].wait(), 10)
        # r2's turn: order 6 (free, sent) then order 5 (r1 sends it): come back.
        model = Counting([[("charge", {"order": "6"}), ("charge", {"order": "5"})], "done"])
        with pytest.raises(ResumeConflictError):
            await _runner(stores, provider=model, group_writes=True).run(
                agent, "go", tenant=T, run_id="r2"
            )
        assert shop.charged == [("r2", "acme/order-6")]
        for _ in range(2):
            with pytest.raises(ResumeConflictError):
                await _runner(stores, provider=model, group_writes=True).resume(
                    agent, "r2", tenant=T
                )
        assert model.asked == 1  # the come-backs ask the model nothing
        shop.gate["r1"].set()
        await asyncio.wait_for(r1, 10)
        run = await _runner(stores, provider=model, group_writes=True).resume(agent, "r2", tenant=T)
        assert run.status is RunStatus.completed
        assert model.asked == 2 and run.spent_micros == 2000  # each turn charged once
        assert shop.keys() == ["acme/order-5", "acme/order-6"]  # each sent once


@pytest.mark.parametrize("backend", ["memory", "sqlite"])
async def test_an_approved_call_meeting_a_live_runs_claim_comes_back_and_is_not_asked_again(
    backend: str, tmp_path: Path
) -> None:
    async with _backend(backend, tmp_path) as stores:
        shop = Shop()
        agent = shop.agent()

        @tool(key=lambda **kw: f"order-{kw['arguments']['order']}", requires_approval=True)
        def charge(order: str, ctx: ToolContext) -> dict[str, str]:
            """Charge an order, once a person says so."""
            assert ctx.idempotency_key is not None
            shop.charged.append((ctx.run_id, ctx.idempotency_key))
            return {"charged": order, "by": ctx.run_id}

        asking = Agent("asking", "Charge.", [charge])
        r1 = asyncio.create_task(_runner(stores).run(agent, "go", tenant=T, run_id="r1"))
        await asyncio.wait_for(shop.inside["r1"].wait(), 10)
        run = await _runner(stores).run(asking, "go", tenant=T, run_id="r2")
        assert run.status is RunStatus.waiting_approval and run.pending_approval is not None
        await stores.approvals.decide(T, run.pending_approval.id, approved=True, by="ops")
        with pytest.raises(ResumeConflictError, match="'r1'"):
            await _runner(stores).resume(asking, "r2", tenant=T)
        shop.gate["r1"].set()
        await asyncio.wait_for(r1, 10)
        run = await _runner(stores).resume(asking, "r2", tenant=T)
        assert run.status is RunStatus.completed  # not asked again, r1's outcome replayed
        assert shop.charged == [("r1", "acme/order-5")]


async def test_crossed_keys_two_runs_each_needing_the_others_both_finish(tmp_path: Path) -> None:
    """r1 sends order 1 then 2; r2 sends 2 then 1: each holds what the other needs next."""
    async with _backend("sqlite", tmp_path) as stores:
        shop = Shop(held=("r1", "r2"))
        agent = shop.agent()
        one = [("charge", {"order": "1"}), ("charge", {"order": "2"})]
        two = [("charge", {"order": "2"}), ("charge", {"order": "1"})]
        r1 = asyncio.create_task(
            _runner(stores, [one, "done"]).run(agent, "go", tenant=T, run_id="r1")
        )
        r2 = asyncio.create_task(
            _runner(stores, [two, "done"]).run(agent, "go", tenant=T, run_id="r2")
        )
        await asyncio.wait_for(shop.inside["r1"].wait(), 10)
        await asyncio.wait_for(shop.inside["r2"].wait(), 10)
        shop.gate["r1"].set()  # r1's order 1 lands; r1 meets r2's live order 2
        with pytest.raises(ResumeConflictError, match="'r2'"):
            await asyncio.wait_for(r1, 10)
        shop.gate["r2"].set()  # r2's order 2 lands; r2 replays r1's order 1
        assert (await asyncio.wait_for(r2, 10)).status is RunStatus.completed
        run = await _runner(stores, [one, "done"]).resume(agent, "r1", tenant=T)
        assert run.status is RunStatus.completed
        assert shop.keys() == ["acme/order-1", "acme/order-2"]


async def test_a_parallel_turn_meeting_a_live_and_a_dead_runs_claims_is_refused_in_doubt(
    tmp_path: Path,
) -> None:
    async with _backend("sqlite", tmp_path) as stores:
        shop = Shop(held=("r0", "r1"))
        shop.die_in = "r0"
        agent = shop.agent(parallel=2)
        r0 = asyncio.create_task(
            _runner(stores, [[("charge", {"order": "6"})], "done"]).run(
                agent, "go", tenant=T, run_id="r0"
            )
        )
        await asyncio.wait_for(shop.inside["r0"].wait(), 10)
        shop.gate["r0"].set()
        with pytest.raises(SimulatedCrash):
            await asyncio.wait_for(r0, 10)
        await _until_free(stores, "r0")
        r1 = asyncio.create_task(_runner(stores).run(agent, "go", tenant=T, run_id="r1"))
        await asyncio.wait_for(shop.inside["r1"].wait(), 10)
        both = [[("charge", {"order": "5"}), ("charge", {"order": "6"})], "done"]
        with pytest.raises(IndeterminateToolCallError, match="r0"):
            await _runner(stores, both).run(agent, "go", tenant=T, run_id="r2")
        # Carried on: still in doubt (order 6 needs an operator), never "come back".
        with pytest.raises(IndeterminateToolCallError):
            await _runner(stores, both).resume(agent, "r2", tenant=T)
        shop.gate["r1"].set()
        await asyncio.wait_for(r1, 10)
        assert shop.charged == [("r1", "acme/order-5")]


async def test_a_mixed_plan_own_call_in_doubt_beside_a_live_runs_claim_is_refused_in_doubt(
    tmp_path: Path,
) -> None:
    async with _backend("sqlite", tmp_path) as stores:
        shop = Shop(held=("r1", "r2"))
        shop.die_in = "r2"
        agent = shop.agent(parallel=2)
        r1 = asyncio.create_task(_runner(stores).run(agent, "go", tenant=T, run_id="r1"))
        await asyncio.wait_for(shop.inside["r1"].wait(), 10)
        # r2: order 7 (its own, it dies with it in hand) beside order 5 (r1 sends it).
        both = [[("charge", {"order": "7"}), ("charge", {"order": "5"})], "done"]
        r2 = asyncio.create_task(_runner(stores, both).run(agent, "go", tenant=T, run_id="r2"))
        await asyncio.wait_for(shop.inside["r2"].wait(), 10)
        shop.gate["r2"].set()
        with pytest.raises(SimulatedCrash):
            await asyncio.wait_for(r2, 10)
        await _until_free(stores, "r2")
        with pytest.raises(IndeterminateToolCallError, match="charge") as doubt:
            await _runner(stores, both).resume(agent, "r2", tenant=T)
        assert any(c.call_id == "call_0_0" for c in doubt.value.calls)
        shop.gate["r1"].set()
        await asyncio.wait_for(r1, 10)
        assert shop.charged == [("r1", "acme/order-5")]


@pytest.mark.parametrize("backend", ALL)
async def test_the_lease_looked_at_is_the_tenants_own(backend: str, tmp_path: Path) -> None:
    """acme's r1 died with order 5 in hand; beta's r1 (same id, other tenant) is live: acme's
    r2 is in doubt, not told to wait on beta's run."""
    async with _backend(backend, tmp_path) as stores:
        shop = Shop()
        shop.die_in = "r1"
        agent = shop.agent()
        dead = asyncio.create_task(_runner(stores).run(agent, "go", tenant=T, run_id="r1"))
        await asyncio.wait_for(shop.inside["r1"].wait(), 10)
        shop.gate["r1"].set()
        with pytest.raises(SimulatedCrash):
            await asyncio.wait_for(dead, 10)
        await _until_free(stores, "r1")
        shop.die_in = None
        shop.gate["r1"].clear()
        shop.inside["r1"].clear()
        live = asyncio.create_task(_runner(stores).run(agent, "go", tenant="beta", run_id="r1"))
        await asyncio.wait_for(shop.inside["r1"].wait(), 10)
        assert await stores.leases.current("beta", "r1") is not None
        with pytest.raises(IndeterminateToolCallError, match="r1"):
            await _runner(stores).run(agent, "go", tenant=T, run_id="r2")
        shop.gate["r1"].set()
        assert (await asyncio.wait_for(live, 10)).status is RunStatus.completed
        assert shop.charged == [("r1", "beta/order-5")]


@pytest.mark.parametrize("backend", ["memory", "sqlite"])
async def test_a_cancel_ends_a_run_told_to_come_back(backend: str, tmp_path: Path) -> None:
    async with _backend(backend, tmp_path) as stores:
        shop = Shop()
        agent = shop.agent()
        r1 = asyncio.create_task(_runner(stores).run(agent, "go", tenant=T, run_id="r1"))
        await asyncio.wait_for(shop.inside["r1"].wait(), 10)
        with pytest.raises(ResumeConflictError):
            await _runner(stores).run(agent, "go", tenant=T, run_id="r2")
        ended = await _runner(stores).cancel("r2", tenant=T, by="ops")
        assert ended is not None and ended.status is RunStatus.cancelled
        run = await _runner(stores).resume(agent, "r2", tenant=T)
        assert run.status is RunStatus.cancelled
        shop.gate["r1"].set()
        await asyncio.wait_for(r1, 10)
        run = await _runner(stores).resume(agent, "r2", tenant=T)
        assert run.status is RunStatus.cancelled
        assert shop.charged == [("r1", "acme/order-5")]


async def test_a_worker_ends_a_waiting_run_once_it_is_cancelled(tmp_path: Path) -> None:
    async with _backend("sqlite", tmp_path) as stores:
        shop = Shop()
        agent = shop.agent()
        r1 = asyncio.create_task(_runner(stores).run(agent, "go", tenant=T, run_id="r1"))
        await asyncio.wait_for(shop.inside["r1"].wait(), 10)
        await _runner(stores).submit(agent, "go", tenant=T, run_id="r2")
        worker = Worker(_runner(stores, ttl=0.4), [agent], poll_interval=0.01)
        running = asyncio.create_task(worker.run())
        try:
            deadline = time.monotonic() + 10
            while Carried.elsewhere not in _hows(worker, "r2"):
                assert time.monotonic() < deadline, worker.carried
                await asyncio.sleep(0.02)
            # A cancel while the worker keeps looking again (nobody holds r2 between takes,
            # or its holder ends it at its next boundary).
            ended = None
            while ended is None or ended.status is not RunStatus.cancelled:
                # None: the worker held r2 just then; its next take ends it.
                ended = await _runner(stores).cancel("r2", tenant=T, by="ops")
                if ended is None:
                    checkpoints = _runner(stores).checkpoints
                    assert checkpoints is not None
                    cp = await checkpoints.latest(T, "r2")
                    if cp is not None and cp.status.value == "cancelled":
                        break
                assert time.monotonic() < deadline + 10, worker.carried
                await asyncio.sleep(0.05)
            await asyncio.sleep(1.0)  # more than the worker's "look again" (ttl 0.4)
            assert Carried.parked not in _hows(worker, "r2"), worker.carried
            assert await stores.leases.current(T, "r1") is not None  # r1 still sends
        finally:
            worker.drain()
            await asyncio.wait_for(running, 30)
        cp = await _runner(stores).checkpoints.latest(T, "r2")  # type: ignore[union-attr]
        assert cp is not None and cp.status.value == "cancelled"
        shop.gate["r1"].set()
        await asyncio.wait_for(r1, 10)
        assert shop.charged == [("r1", "acme/order-5")]


def _hows(worker: Worker, run_id: str) -> list[Carried]:
    return [how for item, how in worker.carried if item.run_id == run_id]


async def test_the_cli_says_come_back_in_one_line_exit_3(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'a.sqlite3'}"
    async with _backend("sqlite", tmp_path) as stores:
        shop = Shop()
        agent = shop.agent()
        r1 = asyncio.create_task(_runner(stores).run(agent, "go", tenant=T, run_id="r1"))
        await asyncio.wait_for(shop.inside["r1"].wait(), 10)
        with pytest.raises(ResumeConflictError):
            await _runner(stores).run(agent, "go", tenant=T, run_id="r2")
        out, err = io.StringIO(), io.StringIO()
        code = await asyncio.to_thread(
            resume_main,
            ["run", "--resume", "r2", "--tenant", T, "--agent", "shop"],
            stores=open_stores(url),
            agents={"shop": agent},
            provider=ScriptedProvider(list(TURNS)),
            out=out,
            err=err,
        )
        said = err.getvalue()
        assert code == ExitCode.HELD, (out.getvalue(), said)
        assert said.count("\n") == 1 and said.startswith("tesserix: "), said
        assert "Traceback" not in said and "'r1'" in said and "carry this run on" in said
        shop.gate["r1"].set()
        await asyncio.wait_for(r1, 10)
        assert shop.charged == [("r1", "acme/order-5")]


# --- a real holder, SIGKILLed mid-call, while a worker carries the waiting run ---------------

_HOLDER = textwrap.dedent(
    """
    import asyncio, sqlite3, sys, time
    from tesserix_adk import Agent, AgentRunner, LeasePolicy, ScriptedProvider, ToolContext
    from tesserix_adk import open_stores, tool

    store, shop, when = sys.argv[1:4]

    @tool(key=lambda **kw: f"order-{kw['arguments']['order']}")
    def charge(order: str, ctx: ToolContext) -> dict:
        "Charge an order."
        if when == "before":
            print("SENDING", flush=True)
            time.sleep(3600)
        conn = sqlite3.connect(shop)
        with conn:
            conn.execute("INSERT INTO c (run, k) VALUES (?, ?)", (ctx.run_id, ctx.idempotency_key))
        conn.close()
        print("CHARGED", flush=True)
        time.sleep(3600)
        return {"charged": order}

    agent = Agent("shop", "Charge.", [charge])

    async def main():
        async with open_stores(store) as stores:
            runner = AgentRunner.from_stores(
                ScriptedProvider([[("charge", {"order": "5"})], "done"]), stores,
                lease_policy=LeasePolicy(ttl=1.0, renew_within=0.5), never_ran_margin=0.0)
            await runner.run(agent, "go", tenant="acme", run_id="r1")

    asyncio.run(main())
    """
)


@contextlib.asynccontextmanager
async def _url(name: str, tmp_path: Path) -> AsyncIterator[str]:
    if name == "sqlite":
        url = f"sqlite:///{tmp_path / 'a.sqlite3'}"
        async with open_stores(url) as stores:
            await stores.create_schema()
        yield url
    elif name == "redis":
        from adapters.services import (
            REDIS_URL,
            delete_prefixed,
            redis_client,
            redis_prefix,
            with_query,
        )

        client = await redis_client()
        prefix = redis_prefix()
        try:
            yield with_query(REDIS_URL, prefix=prefix, allow_volatile="true")
        finally:
            await delete_prefixed(client, prefix)
            await client.aclose()
    else:
        from adapters.services import postgres_schema, schema_url

        async with postgres_schema() as schema:
            url = schema_url(schema)
            async with open_stores(url) as stores:
                await stores.create_schema()
            yield url


@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize(
    "backend",
    [
        "sqlite",
        pytest.param("redis", marks=pytest.mark.redis),
        pytest.param("postgres", marks=pytest.mark.postgres),
    ],
)
async def test_a_worker_parks_the_waiting_run_in_doubt_once_the_holder_is_sigkilled(
    backend: str, when: str, tmp_path: Path
) -> None:
    script = tmp_path / "holder.py"
    script.write_text(_HOLDER)
    shop_db = tmp_path / "shop.sqlite3"
    with sqlite3.connect(shop_db) as conn:
        conn.execute("CREATE TABLE c (run TEXT, k TEXT)")
    conn.close()

    @tool(key=lambda **kw: f"order-{kw['arguments']['order']}")
    def charge(order: str, ctx: ToolContext) -> dict[str, str]:
        """Charge an order."""
        c = sqlite3.connect(shop_db)
        with c:
            c.execute("INSERT INTO c (run, k) VALUES (?, ?)", (ctx.run_id, ctx.idempotency_key))
        c.close()
        return {"charged": order}

    agent = Agent("shop", "Charge.", [charge])
    async with _url(backend, tmp_path) as url:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            str(script),
            url,
            str(shop_db),
            when,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        try:
            assert proc.stdout is not None
            word = "SENDING" if when == "before" else "CHARGED"
            line = await asyncio.wait_for(proc.stdout.readline(), 60)
            assert line.decode().startswith(word), line
            async with open_stores(url) as stores:
                runner = _runner(stores, ttl=1.0)
                await runner.submit(agent, "go", tenant=T, run_id="r2")
                worker = Worker(runner, [agent], poll_interval=0.01)
                running = asyncio.create_task(worker.run())
                try:
                    deadline = time.monotonic() + 20
                    while _hows(worker, "r2").count(Carried.elsewhere) < 2:
                        assert time.monotonic() < deadline, worker.carried
                        await asyncio.sleep(0.02)
                    proc.send_signal(signal.SIGKILL)
                    await proc.wait()
                    while Carried.parked not in _hows(worker, "r2"):
                        assert time.monotonic() < deadline + 20, worker.carried
                        await asyncio.sleep(0.05)
                finally:
                    worker.drain()
                    await asyncio.wait_for(running, 30)
                hows = _hows(worker, "r2")
                assert hows[-1] is Carried.parked and set(hows) <= {
                    Carried.elsewhere,
                    Carried.parked,
                }, hows
                assert stores.work is not None
                (item,) = [i for i in await stores.work.items(T) if i.run_id == "r2"]
                assert item.state is WorkState.parked
                assert "IndeterminateToolCallError" in (item.reason or ""), item.reason
        finally:
            if proc.returncode is None:
                proc.send_signal(signal.SIGKILL)
                await proc.wait()
    with sqlite3.connect(shop_db) as conn:
        rows = conn.execute("SELECT run, k FROM c").fetchall()
    conn.close()
    assert rows == ([] if when == "before" else [("r1", "acme/order-5")])
