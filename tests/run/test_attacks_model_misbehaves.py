"""An attacker's model and provider against the runner's promises: call ids reused, confusable,
empty, enormous or holding NUL; arguments that make keys no store can hold; a model that
changes its answer after a crash (same runner, fresh runner); a call of a turn crashing
inside its tool; provider errors carrying secrets. Memory and SQLite under ``tmp_path``,
the test PostgreSQL (``fresh_stores("postgres")``) where a store's limits are the point.

The oracle throughout: each side-effecting call with a given idempotency key takes effect
at most once; a run that is refused loses nothing and says why with a typed error.

Defects it found, both fixed: a NUL in a call id now has the id replaced, and a key
holding NUL from the arguments, or too long for PostgreSQL's index, is answered "not sent":

1. (MEDIUM) ``test_nul_from_the_model_never_wedges_a_postgres_run``. A model's call id
   holding NUL (``"c\\x00"``), or an argument holding NUL that a business key function
   puts in the key (``f"order-{order}"``, as the README shows), cannot be kept in
   PostgreSQL's ``text`` columns (``call_id``, ``key``). ``screening._carriable`` refuses
   exactly this class of call for lone surrogates ("no store keeps it as asked") but not
   for NUL, so the claim fails: the run ends with ``StoreUnavailableError`` ("PostgreSQL
   failed while claiming ...": a model's id, told as a store outage), the frontier already
   holds the call, and every resume fails the same way: the run is wedged for good. The same
   run completes on SQLite and Redis. The call should be answered "not sent" (or its id
   replaced, as ids holding a secret are) and the run carry on.
2. (MEDIUM) ``test_an_argument_making_a_huge_business_key_is_not_a_retryable_outage``.
   A model's 6000-character order id under ``key=f"order-{order}"`` makes a key past
   PostgreSQL's b-tree row limit: the claim is refused by the server, and the kit reports
   ``StoreUnavailableError(retryable=True)``, "the claim ... lost its reply and could not be
   read back" ("lost the connection"). Every resume and worker retry meets the same refusal:
   an operator is told to wait out an outage that is a model's argument. Should be a
   non-retryable typed refusal (the call answered "not sent", or a ``ConfigurationError``
   naming the key), as a lone surrogate in a key is.

What held (plain tests): a model that changes its answer on resume, by hypothesis (dropped,
added, reordered, twinned calls, another tool, a final answer; any ids, confusable,
empty or enormous; the crash before the turn's frontier or inside one call's tool; the
resume on the same runner or a fresh one): every key takes effect at most once, a turn that
drops a call that ran is a ``DivergedRunError`` before anything of it is sent, a call in
doubt is an ``IndeterminateToolCallError`` with nothing sent, and otherwise the model is
told each call's outcome under its own id in its order; approval twins under confusable ids
are each sent once after one approval; provider errors (typed or not, retryable or not,
plain or streamed after text) carrying an API key put it in no store.
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path
from typing import Any

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, event, given, settings

from run.helpers import fresh_stores
from tesserix_adk import (
    Agent,
    AgentRunner,
    Boundary,
    Checkpointer,
    DivergedRunError,
    IndeterminateToolCallError,
    Message,
    ModelRequest,
    ModelResponse,
    ProviderError,
    Role,
    RunStatus,
    ToolCall,
    ToolContext,
    tool,
)
from tesserix_adk.checkpoint.checkpointer import CheckpointPolicy
from tesserix_adk.errors import AdkError, StoreUnavailableError
from tesserix_adk.testing.faults import FaultyCheckpointStore, SimulatedCrash

T = "acme"
ONLY_AFTER_TOOLS = CheckpointPolicy(boundaries={Boundary.after_tool_result})
SECRET = "sk-proj-" + "Ab3dEf9hIjK1mNoPqRsTuVwXyZ0123456789abcd"

# Ids a model may reuse or confuse: case, whitespace, NFC/NFD, full width, empty, enormous.
IDS = ["c1", "C1", "c1 ", " c1", "\uff431", "caf\u00e9", "cafe\u0301", "", "x" * 5000]


def _by_order(**kw: Any) -> str:
    return f"order-{kw['arguments']['order']}"


def _told(request: ModelRequest) -> list[tuple[str | None, str]]:
    """The tool results of ``request``: (the call id they answer, their text)."""
    return [(m.tool_call_id, m.text) for m in request.messages if m.role is Role.tool]


class World:
    """Tools that count their effects by idempotency key; ``crash_on`` makes the tool die
    (``SimulatedCrash``) right after its effect, on that (tool, arguments)."""

    def __init__(self) -> None:
        self.effects: list[tuple[str, str, str]] = []  # (tool, argument, key)
        self.crash_on: tuple[str, str] | None = None

    def _effect(self, name: str, value: str, ctx: ToolContext) -> str:
        assert ctx.idempotency_key is not None
        self.effects.append((name, value, ctx.idempotency_key))
        if self.crash_on == (name, value):
            self.crash_on = None
            raise SimulatedCrash(f"died inside {name}({value})")
        return f"{name} {value}"

    def agent(self) -> Agent:
        world = self

        @tool
        def book(flight: str, ctx: ToolContext) -> str:
            """Book a seat."""
            return world._effect("book", flight, ctx)

        @tool(key=_by_order)
        def charge(order: str, ctx: ToolContext) -> str:
            """Charge an order."""
            return world._effect("charge", order, ctx)

        @tool(side_effects=False)
        def look(flight: str) -> str:
            """Look at a flight."""
            return f"look {flight}"

        return Agent("trip", "Book.", [book, charge, look])


class Changing:
    """A model that asks ``first`` at iteration 1, and ``then`` once ``resumed`` is set
    (a model is not deterministic; a fresh process asks it again)."""

    def __init__(self, first: list[ToolCall], then: list[ToolCall]) -> None:
        self.first, self.then = first, then
        self.resumed = False
        self.requests: list[ModelRequest] = []

    async def complete(self, request: ModelRequest) -> ModelResponse:
        self.requests.append(request)
        asked = sum(1 for m in request.messages if m.role is Role.assistant)
        if asked == 0:
            calls = [ToolCall(id="c1", name="look", arguments={"flight": "LH400"})]
        elif asked == 1:
            calls = self.then if self.resumed else self.first
        else:
            calls = []
        return ModelResponse(message=Message(role="assistant", content="done", tool_calls=calls))


POOL = [
    ("book", "flight", "LH400"),
    ("book", "flight", "UA961"),
    ("charge", "order", "5"),
    ("look", "flight", "LH400"),
]
_call = st.tuples(st.sampled_from(POOL), st.sampled_from(IDS)).map(
    lambda c: ToolCall(id=c[1], name=c[0][0], arguments={c[0][1]: c[0][2]})
)


def _effectful(calls: list[ToolCall]) -> Counter[tuple[str, str]]:
    return Counter(
        (c.name, next(iter(c.arguments.values()))) for c in calls if c.name in ("book", "charge")
    )


# --- a model that changes its answer on resume ------------------------------------------


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    first=st.lists(_call, min_size=1, max_size=3),
    then=st.lists(_call, max_size=4),
    crash_inside=st.integers(min_value=-1, max_value=2),
    same_runner=st.booleans(),
)
async def test_a_model_changing_its_answer_on_resume_never_gets_a_second_effect(
    first: list[ToolCall], then: list[ToolCall], crash_inside: int, same_runner: bool
) -> None:
    world = World()
    agent = world.agent()
    model = Changing(first, then)
    ran_first = [c for c in first if c.name in ("book", "charge")]
    in_tool = 0 <= crash_inside < len(ran_first)
    if in_tool:
        dies = ran_first[crash_inside]
        world.crash_on = (dies.name, next(iter(dies.arguments.values())))
    async with fresh_stores("memory", Path()) as stores:
        faulty = FaultyCheckpointStore(
            stores.checkpoints,
            # The turn's after_tool_result is lost: the resume asks the model again.
            crash_before=lambda body: (
                body.get("boundary") == "after_tool_result" and body.get("iteration") == 1
            ),
        )

        def runner(store: Any) -> AgentRunner:
            return AgentRunner(
                model,
                idempotency=stores.idempotency,
                checkpoints=Checkpointer(store, history=stores.history, policy=ONLY_AFTER_TOOLS),
                leases=stores.leases,
                ledger=stores.ledger,
                approvals=stores.approvals,
                work=stores.work,
            )

        dying = runner(faulty)
        with pytest.raises(SimulatedCrash):
            await dying.run(agent, "go", tenant=T, run_id="r")
        before = list(world.effects)
        faulty.crash_before = None
        model.resumed = True
        resuming = dying if same_runner else runner(stores.checkpoints)
        try:
            run = await resuming.resume(agent, "r", tenant=T)
        except (DivergedRunError, IndeterminateToolCallError) as exc:
            refused: AdkError | None = exc
        else:
            refused = None

    keys = Counter(k for _, _, k in world.effects)
    assert all(n == 1 for n in keys.values()), world.effects  # never a second effect
    ran, asked = _effectful(first), _effectful(then)
    event(f"in_tool={in_tool} refused={type(refused).__name__}")
    if in_tool:
        # The call in doubt: nothing of the turn goes out; the resume says why, typed.
        assert refused is not None, run
        assert world.effects == before
        return
    dropped = any(asked[c] < n for c, n in ran.items())
    if dropped:
        assert isinstance(refused, DivergedRunError)
        assert world.effects == before
        return
    assert refused is None and run.status is RunStatus.completed
    assert Counter((t, v) for t, v, _ in world.effects) == ran | asked
    # Each of the resumed turn's calls answered under its own id, in the model's order.
    told = _told(model.requests[-1])[1:]
    assert [i for i, _ in told] == [c.id for c in then]
    assert [t for _, t in told] == [f"{c.name} {next(iter(c.arguments.values()))}" for c in then]


# --- approvals under confusable ids -------------------------------------------------------


@pytest.mark.parametrize("where", ["memory", "sqlite"])
async def test_approval_twins_under_confusable_ids_are_each_sent_once(
    tmp_path: Path, where: str
) -> None:
    sent: list[str] = []

    @tool(requires_approval=True)
    def wire(amount: int) -> str:
        """Wire money."""
        sent.append(str(amount))
        return f"wired {amount}"

    agent = Agent("bank", "Wire.", [wire])
    ids = ["c1", "C1", "c1 ", "", "cafe\u0301", "caf\u00e9"]
    calls = [ToolCall(id=i, name="wire", arguments={"amount": n}) for n, i in enumerate(ids)]
    model = Changing(calls, calls)
    async with fresh_stores(where, tmp_path) as stores:
        waiting = await AgentRunner.from_stores(model, stores).run(
            agent, "go", tenant=T, run_id="r"
        )
        assert waiting.status is RunStatus.waiting_approval
        assert waiting.pending_approval is not None
        assert sent == []
        await stores.approvals.decide(T, waiting.pending_approval.id, approved=True, by="alice")
        run = await AgentRunner.from_stores(model, stores).resume(agent, "r", tenant=T)
        again = await AgentRunner.from_stores(model, stores).resume(agent, "r", tenant=T)
    assert run.status is RunStatus.completed and again.status is RunStatus.completed
    assert sent == [str(n) for n in range(len(ids))]
    told = _told(model.requests[-1])[1:]
    assert told == [(i, f"wired {n}") for n, i in enumerate(ids)]


# --- provider errors carrying secrets --------------------------------------------------------


class Failing:
    """A provider that fails, after streaming some text when it streams."""

    def __init__(self, exc: Exception) -> None:
        self.exc = exc

    async def complete(self, request: ModelRequest) -> ModelResponse:
        raise self.exc

    async def complete_streaming(self, request: ModelRequest, on_text: Any) -> ModelResponse:
        on_text(f"calling book with {SECRET}")
        raise self.exc


def _bytes_under(folder: Path) -> bytes:
    """Every byte of the files in ``folder`` (the SQLite file and its journal)."""
    return b"".join(p.read_bytes() for p in folder.iterdir() if p.is_file())


@pytest.mark.parametrize(
    "exc",
    [
        ProviderError(f"upstream: bad key {SECRET}", retryable=False),
        ProviderError(f"upstream: key {SECRET} rate limited", retryable=True),
        RuntimeError(f"adapter bug with {SECRET}"),
        ConnectionResetError(f"reset talking with {SECRET}"),
    ],
    ids=["fatal", "retryable", "untyped", "oserror"],
)
@pytest.mark.parametrize("streamed", [False, True])
async def test_a_provider_error_carrying_a_key_reaches_no_store(
    tmp_path: Path, exc: Exception, streamed: bool
) -> None:
    world = World()
    async with fresh_stores("sqlite", tmp_path) as stores:
        runner = AgentRunner.from_stores(Failing(exc), stores)
        try:
            if streamed:
                async for _ in runner.stream(world.agent(), "go", tenant=T, run_id="r"):
                    pass
            else:
                run = await runner.run(world.agent(), "go", tenant=T, run_id="r")
                assert run.status is RunStatus.failed and SECRET not in (run.output or "")
        except (ProviderError, RuntimeError):
            pass
    stored = _bytes_under(tmp_path)
    assert stored and SECRET.encode() not in stored
    assert world.effects == []


# --- what PostgreSQL cannot keep ------------------------------------------------------------


async def _run_twice(agent: Agent, calls: list[ToolCall]) -> list[Any]:
    """A run on the test PostgreSQL, then a resume on a fresh runner: each its Run or the
    error it raised."""
    model = Changing(calls, calls)
    seen: list[Any] = []
    async with fresh_stores("postgres", Path()) as stores:
        for resume in (False, True):
            runner = AgentRunner.from_stores(model, stores)
            try:
                if resume:
                    seen.append(await runner.resume(agent, "r", tenant=T))
                else:
                    seen.append(await runner.run(agent, "go", tenant=T, run_id="r"))
            except AdkError as exc:
                seen.append(exc)
    return seen


@pytest.mark.parametrize(
    ("call_id", "order"), [("c\x00", "5"), ("c1", "5\x00")], ids=["in_the_id", "in_the_key"]
)
async def test_nul_from_the_model_never_wedges_a_postgres_run(call_id: str, order: str) -> None:
    world = World()
    seen = await _run_twice(
        world.agent(), [ToolCall(id=call_id, name="charge", arguments={"order": order})]
    )
    assert len(world.effects) <= 1
    # The same run completes on SQLite and Redis; here it must not end in a store error
    # that every resume repeats.
    assert not any(isinstance(s, StoreUnavailableError) for s in seen), seen
    assert all(getattr(s, "status", None) is RunStatus.completed for s in seen), seen


async def test_an_argument_making_a_huge_business_key_is_not_a_retryable_outage() -> None:
    world = World()
    order = os.urandom(3000).hex()  # incompressible: the key's index row is over 2704 bytes
    seen = await _run_twice(
        world.agent(), [ToolCall(id="c1", name="charge", arguments={"order": order})]
    )
    assert len(world.effects) <= 1
    for s in seen:
        # Completed (the call answered, sent at most once) or refused for good, typed:
        # never "retry later" for what no retry can mend.
        assert getattr(s, "status", None) is RunStatus.completed or (
            isinstance(s, AdkError) and not s.retryable
        ), repr(s)[:300]
