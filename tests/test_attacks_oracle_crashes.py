"""The first promise against an oracle, by hypothesis: agent runs of 1-4 turns with 1-3
calls each (side-effecting tools under the default key and under a business key several
calls share, an idempotent tool, a read-only one), ``parallel_tool_calls`` 1 or 2, a typed
state (``state_schema``) the tools append to, killed at generated points (before or after
a frontier is written, a claim or a completion reaches the store, inside a tool before or
after its effect), killed again while resuming, and resumed by two runners racing for the
run; on memory and SQLite stores (one example each pinned on Redis and PostgreSQL).

The oracle: every side-effecting call of the script reaches the world exactly once (a key
two calls share once), or, when the kit refuses (``IndeterminateToolCallError``), at most
once with the refused call named, and after an operator says truthfully what happened the
run goes on to exactly once; the final transcript holds each tool result once, in the
script's order, each the result the oracle computes (a call replayed under a shared key
gets the first call's result); and ``ctx.state`` at the end is the oracle's: every change
once, in order (in a parallel turn, as a multiset), save the change of a call an operator
answered by hand, which README says records no state (and, with parallel calls, the limit
README names: a call beside one in doubt may carry that one's change).

Held: all of the above over the generated runs (hunted with 400 examples per run, several
runs; the CI profile is small) and the pinned examples, the defect below left out of the
property: a death inside a side-effecting call is refused naming it (both calls named
when they share a key), read-only and idempotent calls are sent again instead, a racing
second resumer is told the run is held (``ResumeConflictError``, or ``LeaseHeldError`` for
a second ``run()`` before any frontier), and a resumer that died leaves its resume claim
to lapse (README: held off for ``resume_claim_ttl``), never sends anything twice.
Found, and fixed (its test passes now): DEFECT LOW, two calls of one parallel turn under
one business key: when the first call's claim failed, the second (waiting on it in
``run/dispatch.py`` ``call_tool``) was still sent, with its own arguments, after the turn
failed; the resume replayed that outcome for the model's first call (the world got the
second call's charge, the first was told it), which one call at a time never does
(``test_a_shared_key_in_a_failed_parallel_turn_keeps_the_models_first_call``). Hypothesis
found it first with a simulated death at the first call's claim. The second call now fails
as the first did, unsent; the property no longer leaves such turns out.
"""

from __future__ import annotations

import asyncio
import tempfile
import threading
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hypothesis.strategies as st
import pydantic
import pytest
from hypothesis import HealthCheck, event, given, settings

from run.helpers import fresh_stores
from tesserix_adk import (
    Agent,
    AgentRunner,
    Checkpointer,
    IndeterminateToolCallError,
    Redactor,
    ScriptedProvider,
    ToolContext,
    tool,
)
from tesserix_adk.checkpoint.payload import encode_outcome
from tesserix_adk.errors import (
    LeaseHeldError,
    NoCheckpointError,
    ResumeConflictError,
    RunStartedError,
    StoreUnavailableError,
)
from tesserix_adk.messages import Role, ToolOutcome
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.testing.faults import (
    FaultyCheckpointStore,
    FaultyIdempotencyStore,
    SimulatedCrash,
)

T = "acme"
RUN = "r"

CLAIM_TTL = 0.2

# Where an attempt may die: the k-th of these events the attempt meets.
SITES = (
    "frontier_before",
    "frontier_after",
    "claim_before",
    "claim_after",
    "complete_before",
    "complete_after",
    "tool_before_effect",
    "tool_after_effect",
)


class Book(pydantic.BaseModel):
    """The run's state: the ids of the calls whose tool changed it, in order."""

    log: list[str] = []


@dataclass
class World:
    """The outside world and the crash plan of the attempt under way."""

    effects: Counter[str] = field(default_factory=Counter)  # effect key -> times
    dedup: set[str] = field(default_factory=set)  # keys the idempotent system saw
    key_of: dict[str, str] = field(default_factory=dict)  # call id -> oracle's key
    entered: Counter[str] = field(default_factory=Counter)  # call id -> tool entered
    crash_at: int | None = None
    events: int = 0
    crashed_sites: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def site(self, name: str) -> None:
        """One event the attempt meets: dies here if it is the planned one."""
        with self.lock:
            self.events += 1
            die = self.crash_at is not None and self.events == self.crash_at
            if die:
                self.crash_at = None
                self.crashed_sites.append(name)
        if die:
            raise SimulatedCrash(f"died at {name}")


def _tools(world: World) -> list[Any]:
    def charge(order: str, amount: int, ctx: ToolContext) -> str:
        """Charge an order (a side effect, keyed by the order)."""
        world.entered[ctx.call.id] += 1
        world.site("tool_before_effect")
        assert ctx.idempotency_key is not None
        world.effects[world.key_of[ctx.call.id]] += 1
        world.site("tool_after_effect")
        ctx.state.log.append(ctx.call.id)
        return f"charged {order} {amount}"

    async def send(msg: str, ctx: ToolContext) -> str:
        """Send a message (a side effect, the default key)."""
        world.entered[ctx.call.id] += 1
        world.site("tool_before_effect")
        assert ctx.idempotency_key is not None
        world.effects[world.key_of[ctx.call.id]] += 1
        world.site("tool_after_effect")
        ctx.state.log.append(ctx.call.id)
        return f"sent {msg}"

    async def flag(name: str, ctx: ToolContext) -> str:
        """Set a flag in a system that deduplicates by our key."""
        world.entered[ctx.call.id] += 1
        world.site("tool_before_effect")
        assert ctx.idempotency_key is not None
        if ctx.idempotency_key not in world.dedup:
            world.dedup.add(ctx.idempotency_key)
            world.effects[world.key_of[ctx.call.id]] += 1
        world.site("tool_after_effect")
        ctx.state.log.append(ctx.call.id)
        return f"flagged {name}"

    async def look(tag: str) -> str:
        """Look (no side effects)."""
        world.site("tool_before_effect")
        return f"saw {tag}"

    return [
        tool(key=lambda **kw: f"charge-{kw['arguments']['order']}")(charge),
        tool(send),
        tool(idempotent=True)(flag),
        tool(side_effects=False)(look),
    ]


CALLS = st.one_of(
    st.tuples(
        st.just("charge"),
        st.fixed_dictionaries(
            {"order": st.sampled_from(["o1", "o2"]), "amount": st.sampled_from([5, 7])}
        ),
    ),
    st.tuples(st.just("send"), st.fixed_dictionaries({"msg": st.sampled_from(["a", "b"])})),
    st.tuples(st.just("flag"), st.fixed_dictionaries({"name": st.sampled_from(["x", "y"])})),
    st.tuples(st.just("look"), st.fixed_dictionaries({"tag": st.sampled_from(["p", "q"])})),
)

Script = list[list[tuple[str, dict[str, Any]]]]


@dataclass
class Expected:
    """What the oracle computes of a script."""

    results: list[tuple[str, str]]  # (call id, content), in the script's order
    key_of: dict[str, str]  # call id -> the key its world effect counts under
    sent_keys: set[str]  # keys whose effect the world must hold exactly once
    changes: list[str]  # call ids whose tool changes the state, in order
    result_of_key: dict[str, str]


def _oracle(script: Script) -> Expected:
    results: list[tuple[str, str]] = []
    key_of: dict[str, str] = {}
    sent: set[str] = set()
    changes: list[str] = []
    result_of_key: dict[str, str] = {}
    for i, turn in enumerate(script):
        seen: Counter[str] = Counter()
        for j, (name, args) in enumerate(turn):
            call_id = f"call_{i}_{j}"
            twin = repr((name, sorted(args.items())))
            occurrence = seen[twin]
            seen[twin] += 1
            own = {
                "charge": f"charged {args.get('order')} {args.get('amount')}",
                "send": f"sent {args.get('msg')}",
                "flag": f"flagged {args.get('name')}",
                "look": f"saw {args.get('tag')}",
            }[name]
            if name == "charge":
                key = f"{T}/charge-{args['order']}" + (f"#{occurrence}" if occurrence else "")
            elif name == "look":
                results.append((call_id, own))
                continue
            else:
                key = f"{name}:{i}:{sorted(args.items())}:{occurrence}"  # unique per call
            key_of[call_id] = key
            if key in result_of_key:  # a shared business key: replayed, not sent again
                results.append((call_id, result_of_key[key]))
                continue
            result_of_key[key] = own
            sent.add(key)
            changes.append(call_id)
            results.append((call_id, own))
    return Expected(results, key_of, sent, changes, result_of_key)


def _runner(stores: Stores, world: World, script: Script) -> AgentRunner:
    def before(body: dict[str, Any]) -> bool:
        world.site("frontier_before")
        return False

    def after(body: dict[str, Any]) -> bool:
        world.site("frontier_after")
        return False

    def hook(phase: str, op: str, key: str) -> None:
        if op in ("claim", "complete"):
            world.site(f"{op}_{phase}")

    return AgentRunner(
        ScriptedProvider([*script, "done"]),
        idempotency=FaultyIdempotencyStore(stores.idempotency, hook=hook),
        checkpoints=Checkpointer(
            FaultyCheckpointStore(stores.checkpoints, crash_before=before, crash_after=after),
            history=stores.history,
        ),
        leases=stores.leases,
        ledger=stores.ledger,
        approvals=stores.approvals,
        work=stores.work,
        # A resumer's death leaves its resume claim to expire (as a killed process's
        # would); short here, so the next resume waits briefly.
        resume_claim_ttl=CLAIM_TTL,
    )


@dataclass
class Outcome:
    """What a scenario ended with."""

    refused: list[list[str]] = field(default_factory=list)  # call ids named, each refusal
    by_hand: set[str] = field(default_factory=set)  # call ids answered with an outcome
    world_at_refusal: list[Counter[str]] = field(default_factory=list)
    attempts: int = 0


async def _attempt(stores: Stores, world: World, script: Script, agent: Agent) -> Any:
    runner = _runner(stores, world, script)
    assert runner.checkpoints is not None
    if await runner.checkpoints.latest(T, RUN) is None:
        try:
            return await runner.run(agent, "go", tenant=T, run_id=RUN, state=Book())
        except RunStartedError:
            pass
    try:
        return await runner.resume(agent, RUN, tenant=T)
    except NoCheckpointError:
        # Died before the first frontier: the run is started again under its id.
        return await runner.run(agent, "go", tenant=T, run_id=RUN, state=Book())


async def _operator(
    stores: Stores, world: World, exp: Expected, refused: IndeterminateToolCallError, out: Outcome
) -> None:
    """Says truthfully what happened to each refused call (once per record: two calls
    under one business key are one record, named for each call)."""
    decided: set[str] = set()
    for call in refused.calls:
        assert call.key is not None and call.call_id is not None, call.describe()
        world_key = exp.key_of[call.call_id]
        if call.key in decided:
            continue
        decided.add(call.key)
        if world.effects[world_key]:
            told = ToolOutcome(call_id=call.call_id, content=exp.result_of_key[world_key])
            await stores.idempotency.resolve(
                call.key, encode_outcome(told, Redactor()), tenant=T, by="ops"
            )
            out.by_hand.add(call.call_id)
        else:
            await stores.idempotency.resolve(call.key, tenant=T, never_ran=True, by="ops")


async def _scenario(
    stores: Stores,
    script: Script,
    parallel: int,
    crashes: list[int],
    race: bool,
) -> tuple[World, Outcome, Any]:
    exp = _oracle(script)
    world = World(key_of=dict(exp.key_of))
    out = Outcome()
    tools = _tools(world)
    agent = Agent("oracle", "Do it.", tools, state_schema=Book, parallel_tool_calls=parallel)
    plan = list(crashes)
    while True:
        out.attempts += 1
        assert out.attempts < 40, "the run never ended"
        world.events = 0
        world.crash_at = plan.pop(0) if plan else None
        racing = race and out.attempts == 2
        try:
            if racing:
                results = await asyncio.gather(
                    _attempt(stores, world, script, agent),
                    _attempt(stores, world, script, agent),
                    return_exceptions=True,
                )
                # The loser is told the run is held (a resume), or leased (a second run()
                # of a run with no frontier yet).
                lost = (ResumeConflictError, LeaseHeldError)
                for r in results:
                    if isinstance(r, BaseException) and not isinstance(r, lost):
                        raise r
                if all(isinstance(r, lost) for r in results):
                    await asyncio.sleep(CLAIM_TTL)
                    continue
                run = next(r for r in results if not isinstance(r, BaseException))
            else:
                run = await _attempt(stores, world, script, agent)
        except SimulatedCrash:
            continue
        except IndeterminateToolCallError as refused:
            named = [c.call_id or "" for c in refused.calls]
            out.refused.append(named)
            out.world_at_refusal.append(Counter(world.effects))
            # Only a side-effecting, non-idempotent call is ever refused.
            for c in refused.calls:
                assert c.tool in ("charge", "send"), c.describe()
            await _operator(stores, world, exp, refused, out)
            continue
        except (ResumeConflictError, LeaseHeldError):
            await asyncio.sleep(CLAIM_TTL)  # the dead resumer's claim lapses: retry
            continue
        return world, out, run


async def _check(
    stores: Stores, script: Script, parallel: int, crashes: list[int], race: bool
) -> tuple[World, Outcome]:
    world, out, run = await _scenario(stores, script, parallel, crashes, race)
    exp = _oracle(script)
    assert str(run.status) == "completed", run
    # 1. The world: each side-effecting key exactly once; at a refusal, at most once.
    for seen in out.world_at_refusal:
        assert all(n <= 1 for n in seen.values()), seen
    assert dict(world.effects) == dict.fromkeys(exp.sent_keys, 1), (world.effects, out)
    # 2. The transcript: each result once, in the script's order.
    cps = Checkpointer(stores.checkpoints, history=stores.history)
    latest = await cps.latest(T, RUN)
    assert latest is not None and str(latest.status) == "completed"
    messages = await cps.messages(latest)
    told = [(m.tool_call_id, str(m.content)) for m in messages if m.role is Role.tool]
    assert told == exp.results, (told, exp.results, out)
    # 3. The state.
    want = [c for c in exp.changes if c not in out.by_hand]
    got = list(latest.state["log"])
    if parallel == 1:
        assert got == want, (got, want, out, world.crashed_sites)
    else:
        # README's limit: a call beside one in doubt may carry that one's change in its
        # snapshot (so a call in doubt may show up once more, or at all when answered by hand).
        doubtful = {c for named in out.refused for c in named}
        doubtful |= {c for c, n in world.entered.items() if n > 1}
        firm = Counter(c for c in got if c not in doubtful)
        assert firm == Counter(c for c in want if c not in doubtful), (got, want, out)
        assert all(got.count(c) <= 2 for c in doubtful), (got, doubtful)
    return world, out


SCRIPTS = st.lists(st.lists(CALLS, min_size=1, max_size=3), min_size=1, max_size=4)


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    script=SCRIPTS,
    parallel=st.sampled_from([1, 2]),
    crashes=st.lists(st.integers(1, 12), min_size=1, max_size=4),
    race=st.booleans(),
    backend=st.sampled_from(["memory", "sqlite"]),
)
def test_crashed_runs_resume_to_the_oracles_world_transcript_and_state(
    script: Script, parallel: int, crashes: list[int], race: bool, backend: str
) -> None:
    async def go() -> None:
        with tempfile.TemporaryDirectory() as tmp:
            async with fresh_stores(backend, Path(tmp)) as stores:
                world, out = await _check(stores, script, parallel, crashes, race)
        event(f"deaths: {len(world.crashed_sites)}, refusals: {len(out.refused)}")

    asyncio.run(go())


# -- pinned examples ----------------------------------------------------------------------


async def test_a_shared_key_in_a_failed_parallel_turn_keeps_the_models_first_call() -> None:
    charged: list[tuple[str, int]] = []

    @tool(key=lambda **kw: f"charge-{kw['arguments']['order']}")
    async def charge(order: str, amount: int) -> str:
        """Charge an order."""
        charged.append((order, amount))
        return f"charged {order} {amount}"

    agent = Agent("shop", "Charge.", [charge], parallel_tool_calls=2)
    script = [[("charge", {"order": "o1", "amount": 5}), ("charge", {"order": "o1", "amount": 7})]]
    async with fresh_stores("memory", Path(".")) as stores:
        idem = FaultyIdempotencyStore(stores.idempotency)
        idem.fail_claims = 1  # the first call's claim never reaches the store
        first = AgentRunner(
            ScriptedProvider([*script, "done"]),
            idempotency=idem,
            checkpoints=Checkpointer(stores.checkpoints, history=stores.history),
            leases=stores.leases,
        )
        with pytest.raises(StoreUnavailableError):
            await first.run(agent, "go", tenant=T, run_id=RUN)
        again = AgentRunner.from_stores(ScriptedProvider([*script, "done"]), stores)
        await again.resume(agent, RUN, tenant=T)
        cps = Checkpointer(stores.checkpoints, history=stores.history)
        latest = await cps.latest(T, RUN)
        assert latest is not None
        told = [str(m.content) for m in await cps.messages(latest) if m.role is Role.tool]
    # As with one call at a time: the model's first call goes out (the second waits on
    # it under the key, so is not sent once it failed), and the second replays it.
    assert charged == [("o1", 5)]
    assert told == ["charged o1 5", "charged o1 5"]


@pytest.mark.parametrize("backend", ["redis", "postgres"])
async def test_a_run_killed_twice_and_raced_on_a_server_store_matches_the_oracle(
    backend: str, tmp_path: Path
) -> None:
    script: Script = [
        [("charge", {"order": "o1", "amount": 5}), ("send", {"msg": "a"})],
        [("flag", {"name": "x"}), ("look", {"tag": "p"})],
        [("charge", {"order": "o1", "amount": 7}), ("send", {"msg": "a"})],
    ]
    async with fresh_stores(backend, tmp_path) as stores:
        # Dies in the first frontier's write, then in a resume's first tool, then raced.
        await _check(stores, script, 2, [2, 4], True)


async def test_a_death_inside_a_side_effecting_call_is_refused_by_name_then_exactly_once(
    tmp_path: Path,
) -> None:
    script: Script = [[("send", {"msg": "a"}), ("charge", {"order": "o2", "amount": 5})]]
    async with fresh_stores("sqlite", tmp_path) as stores:
        world, out = await _check(stores, script, 1, [12], False)
        assert world.crashed_sites == ["tool_after_effect"]
        assert out.refused == [["call_0_1"]] and out.by_hand == {"call_0_1"}
        # The charge happened, was answered by hand, and keeps no state (README).
        assert dict(world.effects) == {f"{T}/charge-o2": 1, world.key_of["call_0_0"]: 1}
