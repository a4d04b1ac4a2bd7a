"""Attacks on reconcilers and calls in doubt (``reconcile.py``, ``run/reconciling.py`` and
how resume, workers and ``tesserix resolve`` reach them).

A strict xfail is a defect found (its reason names what goes wrong and where); a plain test
is a promise that held under the attack.

Defects found (each was a strict xfail; all are fixed since, their tests plain: a claim of
another run is asked about only once that run's lease is not live and the margin past its
end has passed, and its plan says that run may still be sending it; twins under one key are
asked once; a completed answer is recorded off the loop when large, and one that cannot be
recorded leaves the call in doubt; ``sys.exit()`` or a ``CancelledError`` of a reconciler's
own is an answer of unknown):

1. A call keyed by a business key (``key=lambda **kw: f"order-{...}"``) that a *live* run r1
   holds in flight is reconciled by another run r2 of the same key: ``plan_resume`` looks the
   key up across runs and calls r1's live claim "no longer carried", and
   ``reconcile_in_doubt`` waits the margin past r2's lease only, so a reconciler asked while
   r1's call is still on its way says ``never_ran``, r2 records it over r1's claim and sends
   the call again: two charges (and r1's own outcome is then refused, StaleFenceError).
   Without a reconciler r2 is refused, as it should be (its reason wrongly says r1's holder
   "no longer carries the run"). (Since then r2 is told to come back while r1 is carried,
   ``ResumeConflictError``, rather than refused in doubt: ``test_held_by_another_run.py``.)
2. Twin calls under one key (a key function that takes ``occurrence`` and names the business
   object) left in doubt are asked of the reconciler once per twin, and the second answer's
   ``resolve`` finds the record settled: the resume dies with a raw ``ValueError`` from the
   store, not a typed error.
3. A reconciler's ``completed`` content that cannot be encoded (an int past Python's 4300
   digit limit) raises a raw ``ValueError`` out of ``reconcile_in_doubt`` (``encode_outcome``
   runs outside ``_ask``'s guard), instead of counting as an answer that leaves the call in
   doubt, refused with ``IndeterminateToolCallError``.
4. A large ``completed`` content is redacted on the event loop (``encode_outcome`` called
   inline in ``reconcile_in_doubt``), where a tool's large result is redacted in a worker
   thread "so lease renewals go on" (README, guarantee 7).
5. A sync reconciler whose code calls ``sys.exit()`` in its daemon thread takes the whole
   worker process down (``_in_daemon_thread`` hands ``SystemExit`` to the awaiting task and
   ``_ask`` catches ``Exception`` only), instead of counting as an exception: unknown,
   parked.
6. An async reconciler that raises ``CancelledError`` on its own (nobody cancelled the run)
   escapes ``_ask`` as a cancellation: the resume raises ``CancelledError``, not the typed
   refusal naming the call.

Promises that held: a reconciler is never asked while the run's own holder is alive (the
lease refuses the resume); a reconciler asked again after its ``never_ran`` let the call go out and
the process died again mid-send (in-process and with real SIGKILLed processes): one effect;
a slow reconciler keeps the lease; one that blocks the event loop past the lease records
nothing; a cancel asked while a reconciler hangs ends the run cancelled, sending nothing; an
operator's ``tesserix resolve`` while a reconciler asks is refused (exit 3) and one before it
means the reconciler is never asked; two resumes at once ask it once; each twin of default
keys is settled on its own; a custom key is what the reconciler is given; a secret in a
reconciled answer reaches no byte of the SQLite file; a lone surrogate is kept; an answer
over 1 MiB is recorded as too large and never sent again; a call whose arguments were
masked is answered "not sent" after ``never_ran``; ``inspect``, ``show`` and
``runs --stuck`` name a call no reconciler settled and say ``reconciled`` once one did.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import signal
import sqlite3
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest

from run.helpers import Recording, answers
from tesserix_adk import (
    Agent,
    AgentRunner,
    Carried,
    IndeterminateToolCallError,
    LeasePolicy,
    Message,
    Reconciled,
    Run,
    RunStatus,
    ScriptedProvider,
    ToolContext,
    ToolOutcome,
    Worker,
    WorkState,
    open_stores,
    tool,
)
from tesserix_adk.checkpoint.payload import outcomes
from tesserix_adk.cli import ExitCode, frontier_main
from tesserix_adk.errors import LeaseLostError, ResumeConflictError
from tesserix_adk.run import reconciling
from tesserix_adk.run.invoking import result_content
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.stores.protocols import RecordStatus
from tesserix_adk.testing.faults import SimulatedCrash

T = "acme"
TURNS: list[Any] = [
    [("search_flights", {"origin": "FRA", "dest": "JFK"})],
    [("book_seat", {"flight": "LH123"})],
    "Booked LH123.",
]
SECRET = "sk-" + "Q" * 40


class World:
    """The outside system: what it took, keyed; and a crash planted inside the tool."""

    def __init__(self) -> None:
        self.took: list[str] = []
        self.die: str | None = None  # "before" or "after" the effect, once
        self.asked: list[str] = []

    def effect(self, key: str) -> None:
        if self.die == "before":
            self.die = None
            raise SimulatedCrash("died before the effect")
        self.took.append(key)
        if self.die == "after":
            self.die = None
            raise SimulatedCrash("died after the effect")

    def by_key(self, call: Any, ctx: ToolContext) -> Reconciled:
        assert ctx.idempotency_key is not None
        self.asked.append(ctx.idempotency_key)
        if ctx.idempotency_key in self.took:
            return Reconciled.completed({"booking": "found", "key_seen": True})
        return Reconciled.never_ran()


def _agent(world: World, reconcile: Any = None, **kw: Any) -> Agent:
    @tool(side_effects=False)
    def search_flights(origin: str, dest: str) -> list[str]:
        """Find flights."""
        return ["LH123"]

    @tool(reconcile=world.by_key if reconcile is None else reconcile)
    def book_seat(flight: str, ctx: ToolContext) -> dict[str, str]:
        """Book a seat."""
        assert ctx.idempotency_key is not None
        world.effect(ctx.idempotency_key)
        return {"booking": f"B{len(world.took)}"}

    return Agent("booking", "Book.", [search_flights, book_seat], **kw)


def _runner(
    stores: Stores,
    turns: list[Any] | None = None,
    *,
    ttl: float = 2.0,
    margin: float = 0.0,
    provider: Any = None,
) -> AgentRunner:
    return AgentRunner.from_stores(
        provider or ScriptedProvider(list(TURNS if turns is None else turns)),
        stores,
        lease_policy=LeasePolicy(ttl=ttl, renew_within=ttl / 2),
        never_ran_margin=margin,
        resume_claim_ttl=ttl,  # a resume "killed" (SimulatedCrash) strands the run this long
    )


async def _resume_when_free(runner: AgentRunner, agent: Agent) -> Run:
    """Resume r1 once the resume claim a "killed" resume left has lapsed."""
    for _ in range(200):
        try:
            return await runner.resume(agent, "r1", tenant=T)
        except ResumeConflictError:
            await asyncio.sleep(0.05)
    raise AssertionError("the run was never free to resume")


def _told(provider: Recording, tool_name: str) -> list[Any]:
    """What the model was last told of the calls of ``tool_name``."""
    return [m.content for m in answers(provider.requests[-1], tool_name)]


async def _in_doubt(stores: Stores, world: World, agent: Agent, stage: str) -> None:
    """Run r1 until its holder "dies" ``stage`` the booking: the call is left in flight."""
    world.die = stage
    with pytest.raises(SimulatedCrash):
        await _runner(stores).run(agent, "book", tenant=T, run_id="r1")


async def _record(stores: Stores, tool_name: str = "book_seat", run_id: str = "r1") -> Any:
    (rec,) = [r for r in await stores.idempotency.records(T, run_id) if r.tool == tool_name]
    return rec


def _sqlite(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'adk.sqlite3'}"


def _file_bytes(where: Path) -> bytes:
    """Every byte the SQLite file (and its journal, if any is left) holds."""
    return b"".join(p.read_bytes() for p in where.iterdir() if p.name.startswith("adk."))


async def _cli(url: str, *argv: str) -> tuple[int, str, str]:
    """A frontier command in a thread of its own (it runs its own event loop), over its own
    connection to the file, as another process would."""
    out, err = io.StringIO(), io.StringIO()
    code = await asyncio.to_thread(
        frontier_main, list(argv), stores=open_stores(url), out=out, err=err
    )
    return code, out.getvalue(), err.getvalue()


# --- defects ----------------------------------------------------------------------------------


async def test_a_claim_a_live_run_holds_under_a_shared_business_key_is_never_reconciled_away() -> (
    None
):
    stores = open_stores("memory://")
    charged: list[str] = []
    inside, gate = asyncio.Event(), asyncio.Event()

    def reconcile(call: Any, ctx: ToolContext) -> Reconciled:
        # Honest: the payment system has not seen the key yet (r1's call is on its way).
        if ctx.idempotency_key in charged:
            return Reconciled.completed({"charged": True})
        return Reconciled.never_ran()

    @tool(key=lambda **kw: f"order-{kw['arguments']['order']}", reconcile=reconcile)
    async def charge(order: str, ctx: ToolContext) -> dict[str, str]:
        """Charge an order."""
        if ctx.run_id == "r1":
            inside.set()
            await gate.wait()  # r1's request is slow to land; r1 keeps its lease
        assert ctx.idempotency_key is not None
        charged.append(ctx.idempotency_key)
        return {"charged": order}

    agent = Agent("shop", "Charge.", [charge])
    turns: list[Any] = [[("charge", {"order": "5"})], "done"]
    r1 = asyncio.create_task(
        _runner(stores, turns, margin=0.05).run(agent, "go", tenant=T, run_id="r1")
    )
    await asyncio.wait_for(inside.wait(), 10)
    with pytest.raises(ResumeConflictError):  # come back once r1 has its outcome
        await _runner(stores, turns, margin=0.05).run(agent, "go", tenant=T, run_id="r2")
    lease = await stores.leases.current(T, "r1")
    assert lease is not None  # r1 is alive and carrying its call
    with contextlib.suppress(Exception):  # whatever it says, it must not charge again
        await _runner(stores, turns, margin=0.05).resume(agent, "r2", tenant=T)
    gate.set()
    with contextlib.suppress(Exception):
        await asyncio.wait_for(r1, 10)
    assert charged == ["acme/order-5"], charged


@pytest.mark.parametrize("parallel", [1, 2])
async def test_twins_sharing_one_business_key_are_reconciled_once_without_a_raw_error(
    parallel: int,
) -> None:
    stores, world = open_stores("memory://"), World()

    def key(
        *, tenant: str, run_id: str, iteration: int, tool: str, arguments: Any, occurrence: int = 0
    ) -> str:
        return f"order-{arguments['order']}"  # the business object, twins and all

    @tool(key=key, reconcile=world.by_key)
    def charge(order: str, ctx: ToolContext) -> dict[str, str]:
        """Charge an order."""
        assert ctx.idempotency_key is not None
        world.effect(ctx.idempotency_key)
        return {"charged": order}

    agent = Agent("shop", "Charge.", [charge], parallel_tool_calls=parallel)
    turns: list[Any] = [[("charge", {"order": "5"}), ("charge", {"order": "5"})], "done"]
    world.die = "after"
    with pytest.raises(SimulatedCrash):
        await _runner(stores, turns).run(agent, "go", tenant=T, run_id="r1")
    run = await _runner(stores, turns).resume(agent, "r1", tenant=T)
    assert run.status.value == "completed"
    assert world.took == ["acme/order-5"]


class _Unwritable:
    """A value that cannot be written even as text. (An int past Python's limit for text,
    once this test's value, is now kept as its hex text: ``messages.content_json``.)"""

    def __str__(self) -> str:
        raise RuntimeError("no text")


async def test_a_reconciled_content_that_cannot_be_encoded_settles_the_call_as_text() -> None:
    """The reconciler says the call completed: it is settled so, its content told as the
    text it can be written as (a tool's own result that odd is told alike), never sent
    again. (It was left in doubt before tool results were made text this way.)"""
    stores, world = open_stores("memory://"), World()
    agent = _agent(world, reconcile=lambda call, ctx: Reconciled.completed({"x": _Unwritable()}))
    await _in_doubt(stores, world, agent, "after")
    provider = Recording(ScriptedProvider(list(TURNS)))
    run = await _runner(stores, provider=provider).resume(agent, "r1", tenant=T)
    assert run.status is RunStatus.completed
    assert world.took == [(await _record(stores)).key]
    assert (await _record(stores)).status is RecordStatus.completed
    (told,) = _told(provider, "book_seat")
    assert "_Unwritable" in str(told)


@pytest.mark.parametrize(
    "found",
    [b"\x89PNG\r\n\x1a\n\xff", 7**6000, {"receipt": b"\xff\xfe", "n": -(10**5000)}],
    ids=["binary-bytes", "huge-int", "both-nested"],
)
async def test_a_reconciled_content_a_tool_could_return_settles_the_call_as_it_would(
    found: Any,
) -> None:
    """A reconciler's ``completed`` content is what the tool would have returned: what a
    tool may return (a screenshot's bytes, an int past 4,300 digits) settles the call,
    told to the model as the tool's own result would be, not left in doubt."""
    stores, world = open_stores("memory://"), World()
    agent = _agent(world, reconcile=lambda call, ctx: Reconciled.completed(found))
    await _in_doubt(stores, world, agent, "after")
    provider = Recording(ScriptedProvider(list(TURNS)))
    run = await _runner(stores, provider=provider).resume(agent, "r1", tenant=T)
    assert run.status is RunStatus.completed
    assert (await _record(stores)).status is RecordStatus.completed
    assert len(world.took) == 1
    told = _told(provider, "book_seat")
    assert told == [
        Message.tool_result(ToolOutcome(call_id="x", content=result_content(found))).content
    ]


async def test_a_large_reconciled_outcome_is_redacted_off_the_event_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    stores, world = open_stores("memory://"), World()
    big = {"pages": ["x" * 1000] * 200}  # 200 KB: well past the off-loop threshold
    where: list[bool] = []
    redact = outcomes.redact_outcome_content

    def spy(content: Any, redactor: Any) -> Any:
        if content == big:
            where.append(threading.current_thread() is threading.main_thread())
        return redact(content, redactor)

    monkeypatch.setattr(outcomes, "redact_outcome_content", spy)
    agent = _agent(world, reconcile=lambda call, ctx: Reconciled.completed(big))
    await _in_doubt(stores, world, agent, "after")
    run = await _runner(stores).resume(agent, "r1", tenant=T)
    assert run.status.value == "completed"
    assert where and not any(where), where


_EXITING_WORKER = textwrap.dedent(
    """
    import asyncio, sys
    from tesserix_adk import (Agent, AgentRunner, LeasePolicy, ScriptedProvider, Worker,
                              WorkState, open_stores, tool)
    from tesserix_adk.stores.memory import MemoryWorkIndex
    from tesserix_adk.testing.faults import SimulatedCrash

    crash = [True]

    def reconcile(call, ctx):
        sys.exit(3)  # deep in some client library

    @tool(reconcile=reconcile)
    def book_seat(flight: str) -> dict:
        "Book a seat."
        if crash[0]:
            crash[0] = False
            raise SimulatedCrash("died in the call")
        return {"booking": "B1"}

    agent = Agent("booking", "Book.", [book_seat])

    def runner(stores):
        return AgentRunner.from_stores(
            ScriptedProvider([[("book_seat", {"flight": "LH1"})], "done"]), stores,
            lease_policy=LeasePolicy(ttl=2.0, renew_within=1.0), never_ran_margin=0)

    async def main():
        stores = open_stores("memory://")
        stores.work = MemoryWorkIndex(stores.leases)
        try:
            await runner(stores).run(agent, "book", tenant="acme", run_id="r1")
        except SimulatedCrash:
            pass
        worker = Worker(runner(stores), [agent], exit_when_idle=True, poll_interval=0.01)
        await asyncio.wait_for(worker.run(), 30)
        parked = await stores.work.items("acme", state=WorkState.parked)
        print("WORKER RETURNED", [how.value for _, how in worker.carried], len(parked),
              flush=True)

    asyncio.run(main())
    """
)


async def test_a_sync_reconciler_calling_sys_exit_parks_the_run_and_the_worker_lives_on(
    tmp_path: Path,
) -> None:
    script = tmp_path / "exiting_worker.py"
    script.write_text(_EXITING_WORKER)
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        str(script),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, (proc.returncode, err.decode()[-600:])
    assert "WORKER RETURNED ['parked'] 1" in out.decode()


async def test_an_async_reconciler_raising_cancelled_error_by_itself_counts_as_unknown() -> None:
    stores, world = open_stores("memory://"), World()

    async def cancels(call: Any, ctx: ToolContext) -> Reconciled:
        raise asyncio.CancelledError  # a client library's own cancelled request

    agent = _agent(world, reconcile=cancels)
    await _in_doubt(stores, world, agent, "after")
    with pytest.raises(IndeterminateToolCallError, match="book_seat"):
        await _runner(stores).resume(agent, "r1", tenant=T)
    assert len(world.took) == 1


# --- promises that held: asking again, leases, cancels ---------------------------------------


@pytest.mark.parametrize("where", ["memory", "sqlite"])
async def test_never_ran_then_a_resend_that_dies_again_is_asked_again_and_books_once(
    where: str, tmp_path: Path
) -> None:
    url = "memory://" if where == "memory" else _sqlite(tmp_path)
    async with open_stores(url) as stores:
        await stores.create_schema()
        world = World()
        agent = _agent(world)
        await _in_doubt(stores, world, agent, "before")  # nothing took it
        world.die = "after"  # the resend lands, then that process dies too
        with pytest.raises(SimulatedCrash):
            await _runner(stores).resume(agent, "r1", tenant=T)
        key = (await _record(stores)).key
        assert world.asked == [key] and world.took == [key]
        run = await _resume_when_free(_runner(stores), agent)
        assert run.status.value == "completed"
        assert world.asked == [key, key]  # asked again, not trusted from the first answer
        assert world.took == [key]
        rec = await _record(stores)
        assert rec.status is RecordStatus.completed and rec.by == "reconciler:book_seat"


async def test_a_reconciler_is_never_asked_while_the_runs_own_holder_is_alive() -> None:
    """The same run, its holder alive inside the call: the resume is refused by the lease
    and the reconciler is asked nothing (contrast with a business key shared by two runs)."""
    stores, world = open_stores("memory://"), World()
    inside, gate = asyncio.Event(), asyncio.Event()

    @tool(side_effects=False)
    def search_flights(origin: str, dest: str) -> list[str]:
        """Find flights."""
        return ["LH123"]

    @tool(reconcile=world.by_key)
    async def book_seat(flight: str, ctx: ToolContext) -> dict[str, str]:
        """Book a seat."""
        inside.set()
        await gate.wait()
        assert ctx.idempotency_key is not None
        world.effect(ctx.idempotency_key)
        return {"booking": "B1"}

    agent = Agent("booking", "Book.", [search_flights, book_seat])
    live = asyncio.create_task(_runner(stores, ttl=1.0).run(agent, "book", tenant=T, run_id="r1"))
    await asyncio.wait_for(inside.wait(), 10)
    await asyncio.sleep(1.2)  # past a ttl: only renewals keep the live holder's lease
    with pytest.raises(ResumeConflictError):
        await _runner(stores, ttl=1.0).resume(agent, "r1", tenant=T)
    assert world.asked == []
    gate.set()
    assert (await asyncio.wait_for(live, 10)).status.value == "completed"
    assert len(world.took) == 1


async def test_a_slow_reconciler_keeps_the_lease_and_its_answer_is_recorded() -> None:
    stores, world = open_stores("memory://"), World()

    def slow(call: Any, ctx: ToolContext) -> Reconciled:
        threading.Event().wait(2.5)  # over two lease ttls: renewals must go on meanwhile
        return world.by_key(call, ctx)

    agent = _agent(world, reconcile=slow)
    await _in_doubt(stores, world, agent, "after")
    runner = _runner(stores, ttl=1.0)
    run = await runner.resume(agent, "r1", tenant=T)
    assert run.status.value == "completed"
    assert len(world.took) == 1
    assert (await _record(stores)).by == "reconciler:book_seat"


async def test_a_reconciler_that_blocks_the_loop_past_the_lease_records_nothing() -> None:
    stores, world = open_stores("memory://"), World()

    async def blocks(call: Any, ctx: ToolContext) -> Reconciled:
        threading.Event().wait(0.8)  # a sync client inside an async def: no renewals
        return Reconciled.never_ran()

    agent = _agent(world, reconcile=blocks)
    await _in_doubt(stores, world, agent, "after")
    with pytest.raises(LeaseLostError):
        await _runner(stores, ttl=0.3).resume(agent, "r1", tenant=T)
    assert (await _record(stores)).status is RecordStatus.in_flight
    assert len(world.took) == 1


async def test_a_cancel_asked_while_a_reconciler_hangs_ends_the_run_cancelled_sending_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(reconciling, "RECONCILE_TIMEOUT", 0.6)
    stores, world = open_stores("memory://"), World()
    asking = asyncio.Event()

    async def hangs(call: Any, ctx: ToolContext) -> Reconciled:
        asking.set()
        await asyncio.sleep(3600)
        raise AssertionError("unreachable")

    agent = _agent(world, reconcile=hangs)
    await _in_doubt(stores, world, agent, "before")
    resuming = asyncio.create_task(_runner(stores, ttl=1.0).resume(agent, "r1", tenant=T))
    await asyncio.wait_for(asking.wait(), 10)
    # The resume holds the run: the cancel is recorded for it to find.
    assert await _runner(stores).cancel("r1", tenant=T, by="alice", reason="stop") is None
    run = await asyncio.wait_for(resuming, 10)
    assert run.status.value == "cancelled"
    assert world.took == []
    assert (await _record(stores)).status is RecordStatus.in_flight  # left for a person


async def test_two_resumes_at_once_ask_the_reconciler_once(tmp_path: Path) -> None:
    async with open_stores(_sqlite(tmp_path)) as stores:
        await stores.create_schema()
        world = World()
        calls: list[str] = []

        def counted(call: Any, ctx: ToolContext) -> Reconciled:
            calls.append(str(ctx.fence))
            threading.Event().wait(0.3)
            return world.by_key(call, ctx)

        agent = _agent(world, reconcile=counted)
        await _in_doubt(stores, world, agent, "before")
        async with open_stores(_sqlite(tmp_path)) as other:  # another process's connection
            results = await asyncio.gather(
                _runner(stores).resume(agent, "r1", tenant=T),
                _runner(other).resume(agent, "r1", tenant=T),
                return_exceptions=True,
            )
        finished = [r for r in results if not isinstance(r, BaseException)]
        assert len(finished) == 1 and finished[0].status.value == "completed", results
        assert len(calls) == 1
        assert len(world.took) == 1


# --- operators and reconcilers ---------------------------------------------------------------


async def test_an_operator_resolve_while_a_reconciler_asks_is_refused_and_the_answer_stands(
    tmp_path: Path,
) -> None:
    url = _sqlite(tmp_path)
    async with open_stores(url) as stores:
        await stores.create_schema()
        world = World()
        asking, answer = threading.Event(), threading.Event()

        def waits(call: Any, ctx: ToolContext) -> Reconciled:
            asking.set()
            answer.wait(20)
            return world.by_key(call, ctx)

        agent = _agent(world, reconcile=waits)
        await _in_doubt(stores, world, agent, "after")
        resuming = asyncio.create_task(_runner(stores).resume(agent, "r1", tenant=T))
        assert await asyncio.to_thread(asking.wait, 10)
        rec = await _record(stores)
        code, _, err = await _cli(
            url, "resolve", "r1", "--tenant", T, "--call", rec.call_id, "--never-ran",
            "--margin", "0", "--by", "alice",
        )  # fmt: skip
        assert code == ExitCode.HELD, err
        answer.set()
        run = await asyncio.wait_for(resuming, 20)
        assert run.status.value == "completed"
        rec = await _record(stores)
        assert rec.status is RecordStatus.completed and rec.by == "reconciler:book_seat"
        assert len(world.took) == 1


async def test_an_operator_resolve_first_means_the_reconciler_is_never_asked(
    tmp_path: Path,
) -> None:
    url = _sqlite(tmp_path)
    async with open_stores(url) as stores:
        await stores.create_schema()
        world = World()
        agent = _agent(world)
        await _in_doubt(stores, world, agent, "after")
        rec = await _record(stores)
        code, _, err = await _cli(
            url, "resolve", "r1", "--tenant", T, "--call", rec.call_id,
            "--outcome", '{"booking": "BK-7"}', "--by", "alice",
        )  # fmt: skip
        assert code == ExitCode.CARRIED_ON, err
        run = await _runner(stores).resume(agent, "r1", tenant=T)
        assert run.status.value == "completed"
        assert world.asked == []
        assert len(world.took) == 1
        assert (await _record(stores)).by == "alice"


# --- twins, keys, masked arguments -----------------------------------------------------------


@pytest.mark.parametrize("parallel", [1, 2])
async def test_each_twin_of_default_keys_is_settled_on_its_own(parallel: int) -> None:
    stores, world = open_stores("memory://"), World()
    agent = _agent(world, parallel_tool_calls=parallel)
    turns: list[Any] = [
        TURNS[0],
        [("book_seat", {"flight": "LH123"}), ("book_seat", {"flight": "LH123"})],
        "Booked two.",
    ]
    calls = [0]

    def second_dies(key: str) -> None:
        calls[0] += 1
        if calls[0] == 2:
            world.die = "after"

    inner = world.effect

    def effect(key: str) -> None:
        second_dies(key)
        inner(key)

    world.effect = effect  # type: ignore[method-assign]
    with pytest.raises(SimulatedCrash):
        await _runner(stores, turns).run(agent, "book", tenant=T, run_id="r1")
    first, second = world.took
    assert first != second
    world.effect = inner  # type: ignore[method-assign]
    run = await _runner(stores, turns).resume(agent, "r1", tenant=T)
    assert run.status.value == "completed"
    assert world.took == [first, second]  # neither twin sent again
    assert world.asked == [second]  # the first twin finished: replayed, never asked about
    records = {r.key: r for r in await stores.idempotency.records(T, "r1")}
    assert records[second].by == "reconciler:book_seat" and records[first].by is None


async def test_a_reconciler_is_given_the_custom_key_the_tool_was_given() -> None:
    stores, world = open_stores("memory://"), World()
    given: list[str | None] = []

    def by_key(call: Any, ctx: ToolContext) -> Reconciled:
        given.append(ctx.idempotency_key)
        return world.by_key(call, ctx)

    @tool(side_effects=False)
    def search_flights(origin: str, dest: str) -> list[str]:
        """Find flights."""
        return ["LH123"]

    @tool(key=lambda **kw: f"seat-{kw['arguments']['flight']}", reconcile=by_key)
    def book_seat(flight: str, ctx: ToolContext) -> dict[str, str]:
        """Book a seat."""
        assert ctx.idempotency_key is not None
        world.effect(ctx.idempotency_key)
        return {"booking": "B1"}

    agent = Agent("booking", "Book.", [search_flights, book_seat])
    await _in_doubt(stores, world, agent, "after")
    run = await _runner(stores).resume(agent, "r1", tenant=T)
    assert run.status.value == "completed"
    assert given == world.took == ["acme/seat-LH123"]


async def test_never_ran_for_a_call_whose_arguments_were_masked_is_answered_not_sent() -> None:
    stores, world = open_stores("memory://"), World()
    told: list[Any] = []

    @tool(reconcile=world.by_key)
    def send_key(api_key: str, ctx: ToolContext) -> str:
        """Send a key somewhere."""
        assert ctx.idempotency_key is not None
        world.effect(ctx.idempotency_key)
        return "sent"

    agent = Agent("k", "Send.", [send_key])
    turns: list[Any] = [[("send_key", {"api_key": SECRET})], "done"]
    world.die = "before"
    with pytest.raises(SimulatedCrash):
        await _runner(stores, turns).run(agent, "go", tenant=T, run_id="r1")
    model = Recording(ScriptedProvider(list(turns)))
    run = await _runner(stores, provider=model).resume(agent, "r1", tenant=T)
    assert run.status.value == "completed"
    assert world.took == []
    (told,) = _told(model, "send_key")
    assert "not sent" in str(told)


# --- what a reconciled answer stores ---------------------------------------------------------


async def test_a_secret_in_a_reconciled_answer_reaches_no_byte_of_the_store(
    tmp_path: Path,
) -> None:
    async with open_stores(_sqlite(tmp_path)) as stores:
        await stores.create_schema()
        world = World()
        answer = {"password": "hunter2-hunter2", "note": f"use {SECRET}", "ok": True}
        agent = _agent(world, reconcile=lambda call, ctx: Reconciled.completed(answer))
        await _in_doubt(stores, world, agent, "after")
        model = Recording(ScriptedProvider(list(TURNS)))
        run = await _runner(stores, provider=model).resume(agent, "r1", tenant=T)
        assert run.status.value == "completed"
        (told,) = _told(model, "book_seat")
        assert "hunter2" not in str(told) and SECRET not in str(told) and "ok" in str(told)
    data = _file_bytes(tmp_path)
    assert b"hunter2" not in data and SECRET.encode() not in data


async def test_a_lone_surrogate_in_a_reconciled_answer_is_kept_and_the_run_finishes(
    tmp_path: Path,
) -> None:
    async with open_stores(_sqlite(tmp_path)) as stores:
        await stores.create_schema()
        world = World()
        answer = {"name": "Ada \ud800 Lovelace"}
        agent = _agent(world, reconcile=lambda call, ctx: Reconciled.completed(answer))
        await _in_doubt(stores, world, agent, "after")
        model = Recording(ScriptedProvider(list(TURNS)))
        run = await _runner(stores, provider=model).resume(agent, "r1", tenant=T)
        assert run.status.value == "completed"
        (told,) = _told(model, "book_seat")
        # Kept, as the JSON escape a tool result's lone surrogate is written as.
        assert json.loads(told) == answer
        assert len(world.took) == 1


async def test_a_reconciled_answer_over_a_mebibyte_is_recorded_too_large_and_not_sent_again() -> (
    None
):
    stores, world = open_stores("memory://"), World()
    huge = {"blob": "y" * (1 << 21)}
    agent = _agent(world, reconcile=lambda call, ctx: Reconciled.completed(huge))
    await _in_doubt(stores, world, agent, "after")
    model = Recording(ScriptedProvider(list(TURNS)))
    run = await _runner(stores, provider=model).resume(agent, "r1", tenant=T)
    assert run.status.value == "completed"
    assert len(world.took) == 1
    rec = await _record(stores)
    assert rec.status is RecordStatus.completed and rec.by == "reconciler:book_seat"
    (told,) = _told(model, "book_seat")
    assert "too large" in str(told)


# --- what the CLI says -----------------------------------------------------------------------


async def test_inspect_show_and_runs_stuck_name_a_call_no_reconciler_settled(
    tmp_path: Path,
) -> None:
    url = _sqlite(tmp_path)
    async with open_stores(url) as stores:
        await stores.create_schema()
        world = World()
        agent = _agent(world, reconcile=lambda call, ctx: Reconciled.unknown())
        await _in_doubt(stores, world, agent, "after")
        worker = Worker(_runner(stores), [agent], exit_when_idle=True, poll_interval=0.01)
        await asyncio.wait_for(worker.run(), 30)
        assert [how for _, how in worker.carried] == [Carried.parked]
        assert stores.work is not None
        assert len(await stores.work.items(T, state=WorkState.parked)) == 1
        call_id = (await _record(stores)).call_id
    code, out, err = await _cli(url, "runs", "--tenant", T, "--stuck")
    assert code == 0 and "r1" in out and "book_seat" in out, (out, err)
    code, out, err = await _cli(url, "inspect", "r1", "--tenant", T)
    assert "book_seat" in out and "indeterminate" in out and call_id in out, (out, err)
    code, out, err = await _cli(url, "show", "r1", "--tenant", T)
    assert "book_seat" in out and "reconciled" not in out, (out, err)


async def test_show_says_reconciled_once_a_reconciler_settled_the_call(tmp_path: Path) -> None:
    url = _sqlite(tmp_path)
    async with open_stores(url) as stores:
        await stores.create_schema()
        world = World()
        agent = _agent(world)
        await _in_doubt(stores, world, agent, "after")
        run = await _runner(stores).resume(agent, "r1", tenant=T)
        assert run.status.value == "completed"
    code, out, err = await _cli(url, "show", "r1", "--tenant", T)
    assert code == 0 and "reconciled" in out and "reconciler:book_seat" in out, (out, err)
    code, out, err = await _cli(url, "runs", "--tenant", T, "--stuck")
    assert code == 0 and "r1" not in out, (out, err)


# --- real processes, SIGKILLed ---------------------------------------------------------------

_KILLED_AGENT = textwrap.dedent(
    """
    import asyncio, sqlite3, sys, time
    from tesserix_adk import (Agent, AgentRunner, LeasePolicy, Reconciled, ScriptedProvider,
                              ToolContext, open_stores, tool)
    from tesserix_adk.errors import ResumeConflictError

    store, airline, mode, kill_at = sys.argv[1:5]

    def booked(key):
        conn = sqlite3.connect(airline)
        try:
            return conn.execute("SELECT count(*) FROM b WHERE k = ?", (key,)).fetchone()[0]
        finally:
            conn.close()

    def reconcile(call, ctx):
        print("ASKED", flush=True)
        return Reconciled.completed({"booking": "found"}) if booked(ctx.idempotency_key) \\
            else Reconciled.never_ran()

    @tool(reconcile=reconcile)
    def book_seat(flight: str, ctx: ToolContext) -> dict:
        "Book a seat."
        if kill_at == "before":
            print("SENDING", flush=True)
            time.sleep(3600)
        conn = sqlite3.connect(airline)
        with conn:
            conn.execute("INSERT INTO b (k) VALUES (?)", (ctx.idempotency_key,))
        conn.close()
        if kill_at == "after":
            print("BOOKED", flush=True)
            time.sleep(3600)
        return {"booking": "B1"}

    agent = Agent("booking", "Book.", [book_seat])

    async def main():
        async with open_stores(store) as stores:
            runner = AgentRunner.from_stores(
                ScriptedProvider([[("book_seat", {"flight": "LH1"})], "done"]), stores,
                lease_policy=LeasePolicy(ttl=1.0, renew_within=0.5), never_ran_margin=0.2,
                resume_claim_ttl=1.0)
            if mode == "run":
                await stores.create_schema()
                result = await runner.run(agent, "book", tenant="acme", run_id="r1")
            else:
                result = None
                for _ in range(300):
                    try:
                        result = await runner.resume(agent, "r1", tenant="acme")
                        break
                    except ResumeConflictError:
                        await asyncio.sleep(0.1)
            print("STATUS", result.status.value, flush=True)

    asyncio.run(main())
    """
)


async def _until(proc: asyncio.subprocess.Process, word: str) -> list[str]:
    seen: list[str] = []
    assert proc.stdout is not None
    while True:
        line = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode()
        assert line, f"the process ended before {word!r}: {seen}"
        seen.append(line.strip())
        if line.startswith(word):
            return seen


async def test_sigkilled_before_then_during_the_resend_the_reconciler_books_once(
    tmp_path: Path,
) -> None:
    script = tmp_path / "killed_agent.py"
    script.write_text(_KILLED_AGENT)
    airline = tmp_path / "airline.sqlite3"
    with sqlite3.connect(airline) as conn:
        conn.execute("CREATE TABLE b (k TEXT)")
    conn.close()
    store = _sqlite(tmp_path)

    async def start(mode: str, kill_at: str) -> asyncio.subprocess.Process:
        return await asyncio.create_subprocess_exec(
            sys.executable,
            str(script),
            store,
            str(airline),
            mode,
            kill_at,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )

    async def killed(proc: asyncio.subprocess.Process, word: str) -> list[str]:
        try:
            return await _until(proc, word)
        finally:
            proc.send_signal(signal.SIGKILL)
            await proc.wait()

    # 1: killed with the claim durable and nothing sent.
    await killed(await start("run", "before"), "SENDING")
    # 2: the reconciler says never_ran; the resend lands, and that process is killed too.
    second = await killed(await start("resume", "after"), "BOOKED")
    assert "ASKED" in second
    # 3: asked again, it finds the booking: nothing more is sent.
    third = await start("resume", "none")
    out, err = await asyncio.wait_for(third.communicate(), 60)
    lines = out.decode().split()
    assert "ASKED" in lines and "completed" in lines, (lines, err.decode()[-1500:])
    conn = sqlite3.connect(airline)
    try:
        (count,) = conn.execute("SELECT count(*) FROM b").fetchone()
    finally:
        conn.close()
    assert count == 1
    async with open_stores(store) as stores:
        rec = await _record(stores)
        assert rec.status is RecordStatus.completed and rec.by == "reconciler:book_seat"
