"""Tool authors' mistakes against the runner's promises: tools that mutate their arguments,
raise odd things (a cancelled future's ``CancelledError``, ``GeneratorExit``, an exception
whose ``__str__`` raises or holds a secret, an ``ExceptionGroup``), return odd objects
(a self-referencing list, an object whose ``__str__`` raises, NaN, sets, huge ints, bytes,
dataclasses, pydantic models), outlive their run in a worker thread, or come with a
reconciler that misbehaves; two tools of one name; a key function changed between a crash
(a real SIGKILL too) and the resume.

The oracle throughout: every side effect is made at most once across a crash and resume,
the record is truthful (a call that returned is not left in doubt, a call that completed is
not told as failed), no secret reaches a store, and every refusal is typed.

Defects (xfail, strict) are named in each test's reason; what held is a plain test.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import datetime
import decimal
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pydantic
import pytest

from run.helpers import Recording, answers, at, faulty_runner, fresh_stores
from tesserix_adk import (
    Agent,
    AgentRunner,
    Boundary,
    Checkpointer,
    CheckpointPolicy,
    ConfigurationError,
    DivergedRunError,
    IndeterminateToolCallError,
    LeasePolicy,
    Reconciled,
    RunStatus,
    ScriptedProvider,
    ToolContext,
    tool,
)
from tesserix_adk.stores.urls import open_stores
from tesserix_adk.testing.faults import SimulatedCrash

T = "acme"
SECRET = "sk-proj-" + "Ab3dEf9hIjK1mNoPqRsTuVwXyZ0123456789abcd"
ONLY_AFTER_TOOLS = CheckpointPolicy(boundaries=frozenset({Boundary.after_tool_result}))
# A deadline for a hang, never a measure of speed.
HANG = 15.0
SHORT = LeasePolicy(ttl=1, renew_within=0.5)


def _stored(folder: Path) -> bytes:
    """Every byte of the files in ``folder`` (the SQLite file and its journal)."""
    return b"".join(p.read_bytes() for p in folder.iterdir() if p.is_file())


def _one_call_agent(fn: Any, **options: Any) -> Agent:
    return Agent("authors", "Do it.", [tool(name="t", **options)(fn)])


def _script() -> Recording:
    return Recording(ScriptedProvider([[("t", {"x": 1})], "done"]))


class _StrRaises(Exception):
    """An exception whose text cannot be read (a tool author's ``__str__`` bug)."""

    def __str__(self) -> str:
        raise RuntimeError("the __str__ of this exception is broken")


class _ReprRaises:
    def __repr__(self) -> str:
        raise RuntimeError("the __repr__ of this object is broken")

    __str__ = __repr__


# --- odd things raised ---------------------------------------------------------------------


async def test_a_sync_tool_raising_a_cancelled_futures_error_is_its_error_outcome(
    tmp_path: Path,
) -> None:
    effects: list[int] = []

    def t(x: int) -> str:
        """Waits on a future another part of the tool cancelled."""
        effects.append(x)
        future: concurrent.futures.Future[str] = concurrent.futures.Future()
        future.cancel()
        return future.result()  # raises concurrent.futures.CancelledError

    agent = _one_call_agent(t)
    provider = _script()
    async with fresh_stores("sqlite", tmp_path) as stores:
        try:
            run = await asyncio.wait_for(
                AgentRunner.from_stores(provider, stores).run(agent, "go", tenant=T, run_id="cf"),
                HANG,
            )
        except asyncio.CancelledError:
            # What happens: nothing cancelled the run, yet it ends cancelled, its call in
            # doubt; a resume refuses it (IndeterminateToolCallError) for good.
            run = await AgentRunner.from_stores(provider, stores).resume(agent, "cf", tenant=T)
    assert run.status is RunStatus.completed
    [told] = answers(provider.requests[-1], "t")
    assert told.is_error and "CancelledError" in told.text
    assert effects == [1]


async def test_a_tool_raising_an_exception_whose_str_raises_is_an_error_outcome(
    tmp_path: Path,
) -> None:
    effects: list[int] = []

    def t(x: int) -> str:
        """Fails with an exception of the author's own, whose text is broken."""
        effects.append(x)
        raise _StrRaises()

    agent = _one_call_agent(t)
    provider = _script()
    async with fresh_stores("sqlite", tmp_path) as stores:
        try:
            run = await AgentRunner.from_stores(provider, stores).run(
                agent, "go", tenant=T, run_id="s"
            )
        except RuntimeError:
            run = await AgentRunner.from_stores(provider, stores).resume(agent, "s", tenant=T)
    assert run.status is RunStatus.completed
    [told] = answers(provider.requests[-1], "t")
    assert told.is_error and "_StrRaises" in told.text
    assert effects == [1]


_GENERATOR_EXIT = """
import asyncio, sys
from tesserix_adk import Agent, AgentRunner, ScriptedProvider, tool
from tesserix_adk.errors import AdkError
from tesserix_adk.stores.urls import open_stores

@tool(name="t")
def t(x: int) -> str:
    \"\"\"A tool that closes a generator the wrong way.\"\"\"
    print("effect", flush=True)
    raise GeneratorExit("closed")

agent = Agent("authors", "Do it.", [t])

async def main(url):
    provider = ScriptedProvider([[("t", {"x": 1})], "done"])
    async with open_stores(url) as stores:
        await stores.create_schema()
        try:
            runner = AgentRunner.from_stores(provider, stores)
            run = await runner.run(agent, "go", tenant="acme", run_id="g")
            print("run", run.status.value, flush=True)
        except BaseException as exc:
            print("run raised", type(exc).__name__, flush=True)
        cp = await runner.checkpoints.latest("acme", "g")
        told = [m for m in await runner.checkpoints.messages(cp) if m.role.value == "tool"]
        print("told", told[-1].text if told else None, flush=True)
        try:
            again = await AgentRunner.from_stores(provider, stores).resume(
                agent, "g", tenant="acme"
            )
            print("resume", again.status.value, flush=True)
        except AdkError as exc:
            print("resume raised", type(exc).__name__, flush=True)
        print("lease", await stores.leases.current("acme", "g"), flush=True)

asyncio.run(main(sys.argv[1]))
"""


def test_a_sync_tool_raising_generator_exit_lets_go_of_the_run(tmp_path: Path) -> None:
    """In a process of its own: the broken unwinding leaves generators that complain when
    collected, which would land in whatever test ran next."""
    script = tmp_path / "generator_exit.py"
    script.write_text(_GENERATOR_EXIT)
    done = subprocess.run(
        [sys.executable, str(script), f"sqlite:///{tmp_path / 'adk.sqlite3'}"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    lines = done.stdout.splitlines()
    assert lines[0] == "effect", (done.stdout, done.stderr)
    # Found as a defect: run() raised an untyped RuntimeError and kept the lease. Nothing
    # cancels or closes a thread, so a sync tool's GeneratorExit is its own failure: the
    # call's error outcome, told to the model, the run going on to its end and letting go.
    assert lines[1:] == [
        "run completed",
        "told RuntimeError: the tool raised GeneratorExit: GeneratorExit('closed')",
        "resume completed",
        "lease None",
    ], (done.stdout, done.stderr)


@pytest.mark.parametrize(
    "raised",
    [
        pytest.param(lambda: ValueError(f"upstream refused key {SECRET}"), id="message"),
        pytest.param(
            lambda: ExceptionGroup(
                f"batch failed with {SECRET}", [ValueError("a"), KeyError(SECRET)]
            ),
            id="exception-group",
        ),
        pytest.param(lambda: StopAsyncIteration(f"page token {SECRET}"), id="stop-async"),
    ],
)
async def test_a_tool_error_holding_a_secret_is_an_error_outcome_and_reaches_no_store(
    tmp_path: Path, raised: Any
) -> None:
    effects: list[int] = []

    async def t(x: int) -> str:
        """Fails, saying too much."""
        effects.append(x)
        raise raised()

    agent = _one_call_agent(t)
    provider = _script()
    async with fresh_stores("sqlite", tmp_path) as stores:
        run = await AgentRunner.from_stores(provider, stores).run(agent, "go", tenant=T, run_id="e")
        again = await AgentRunner.from_stores(provider, stores).resume(agent, "e", tenant=T)
    assert run.status is RunStatus.completed and again.status is RunStatus.completed
    [told] = answers(provider.requests[-1], "t")
    assert told.is_error
    assert effects == [1]
    assert SECRET.encode() not in _stored(tmp_path)


# --- odd things returned -------------------------------------------------------------------


@pytest.mark.parametrize("odd", ["cycle", "repr-raises"])
async def test_a_completed_call_with_an_unwritable_result_is_not_told_as_failed(
    tmp_path: Path, odd: str
) -> None:
    effects: list[int] = []

    def t(x: int) -> Any:
        """Books, then returns what the author had at hand."""
        effects.append(x)
        if odd == "cycle":
            loop: list[Any] = ["booked"]
            loop.append(loop)
            return loop
        return {"booking": "BK-1", "handle": _ReprRaises()}

    agent = _one_call_agent(t)
    provider = _script()
    async with fresh_stores("sqlite", tmp_path) as stores:
        run = await AgentRunner.from_stores(provider, stores).run(agent, "go", tenant=T, run_id="o")
    assert run.status is RunStatus.completed
    assert effects == [1]
    [told] = answers(provider.requests[-1], "t")
    assert not told.is_error, told.text


@dataclasses.dataclass
class _Booking:
    ref: str
    at: datetime.datetime
    price: decimal.Decimal


class _Receipt(pydantic.BaseModel):
    ref: str
    total: float


def _odd_result() -> dict[str, Any]:
    return {
        "when": datetime.datetime(2024, 5, 1, 12, 30, tzinfo=datetime.UTC),
        "price": decimal.Decimal("12.30"),
        "id": uuid.UUID(int=7),
        "seats": {3, 1, 2},
        "raw": b"\xff\xfe binary",
        "text_bytes": b"plain",
        "nan": float("nan"),
        "inf": float("inf"),
        "negative_zero": -0.0,
        "huge": 10**5000,
        "nested_huge": [10**5000, 2**70],
        1: "an int key",
        "booking": _Booking("BK-1", datetime.datetime(2024, 1, 1), decimal.Decimal("1E+2")),
        "receipt": _Receipt(ref="R-9", total=0.1),
        "tuple": (1, "a"),
    }


@pytest.mark.parametrize("where", ["sqlite", "postgres", "redis"])
async def test_odd_results_are_told_alike_live_and_replayed_after_a_crash(
    tmp_path: Path, where: str
) -> None:
    """A result of every odd type is completed, told the model the same live and when its
    record is replayed after a death between the tool and the turn's frontier."""
    effects: list[str] = []

    def t(x: int, ctx: ToolContext) -> Any:
        """Returns a bag of odd values."""
        assert ctx.idempotency_key is not None
        effects.append(ctx.idempotency_key)
        return _odd_result()

    agent = _one_call_agent(t)
    async with fresh_stores(where, tmp_path) as stores:
        live = _script()
        run_id = f"odd-live-{uuid.uuid4().hex[:8]}"
        await AgentRunner.from_stores(live, stores).run(agent, "go", tenant=T, run_id=run_id)
        [told_live] = answers(live.requests[-1], "t")

        crashing = _script()
        run_id = f"odd-crash-{uuid.uuid4().hex[:8]}"
        with pytest.raises(SimulatedCrash):
            await faulty_runner(stores, crashing, crash_before=at("after_tool_result", 0)).run(
                agent, "go", tenant=T, run_id=run_id
            )
        resumed = _script()
        run = await AgentRunner.from_stores(resumed, stores).resume(agent, run_id, tenant=T)
    assert run.status is RunStatus.completed
    assert len(effects) == 2 and len(set(effects)) == 2  # once per run, never again
    [told_replayed] = answers(resumed.requests[-1], "t")
    assert not told_live.is_error and not told_replayed.is_error
    assert told_replayed.text == told_live.text


# --- arguments mutated by the tool ---------------------------------------------------------


async def test_a_tool_mutating_its_arguments_does_not_change_what_the_model_asked(
    tmp_path: Path,
) -> None:
    seen: list[list[str]] = []

    @tool
    def book(items, ctx: ToolContext) -> str:  # type: ignore[no-untyped-def]
        """Book the items (and, carelessly, note a fee in the list it was given)."""
        seen.append(list(items))
        items.append("service-fee")
        return "booked"

    agent = Agent("authors", "Book.", [book])
    provider = Recording(ScriptedProvider([[("book", {"items": ["seat"]})], "done"]))
    async with fresh_stores("sqlite", tmp_path) as stores:
        run = await AgentRunner.from_stores(provider, stores).run(agent, "go", tenant=T, run_id="m")
        checkpoints = Checkpointer(stores.checkpoints, history=stores.history)
        frontier = await checkpoints.latest(T, "m")
        assert frontier is not None
        kept = [c.arguments for m in await checkpoints.messages(frontier) for c in m.tool_calls]
    assert run.status is RunStatus.completed and seen == [["seat"]]
    assert kept == [{"items": ["seat"]}]  # the record holds what the model asked
    asked = [c.arguments for m in provider.requests[-1].messages for c in m.tool_calls]
    assert asked == kept


async def test_a_tool_mutating_its_arguments_is_replayed_not_sent_again_after_a_crash(
    tmp_path: Path,
) -> None:
    """The key is derived before the tool runs and kept in the frontier: a tool that
    changes its arguments in place makes no other key, so the resume replays its outcome."""
    effects: list[str] = []

    @tool
    def book(items, ctx: ToolContext) -> str:  # type: ignore[no-untyped-def]
        """Book, changing the list it was given."""
        assert ctx.idempotency_key is not None
        effects.append(ctx.idempotency_key)
        items.append("service-fee")
        items.sort()
        return "booked"

    agent = Agent("authors", "Book.", [book])
    script = [[("book", {"items": ["seat", "bag"]})], "done"]
    async with fresh_stores("sqlite", tmp_path) as stores:
        with pytest.raises(SimulatedCrash):
            await faulty_runner(
                stores, ScriptedProvider(script), crash_before=at("after_tool_result", 0)
            ).run(agent, "go", tenant=T, run_id="m2")
        run = await AgentRunner.from_stores(ScriptedProvider(script), stores).resume(
            agent, "m2", tenant=T
        )
    assert run.status is RunStatus.completed
    assert len(effects) == 1


# --- a sync tool that outlives its run's task ----------------------------------------------


async def test_a_sync_tool_outliving_its_cancelled_task_is_recorded_and_never_sent_again(
    tmp_path: Path,
) -> None:
    started, release = threading.Event(), threading.Event()
    effects: list[str] = []

    def t(x: int, ctx: ToolContext) -> str:
        """A slow booking in a worker thread."""
        started.set()
        release.wait(HANG)
        assert ctx.idempotency_key is not None
        effects.append(ctx.idempotency_key)
        return "booked late"

    agent = _one_call_agent(t)
    async with fresh_stores("sqlite", tmp_path) as stores:
        task = asyncio.create_task(
            AgentRunner.from_stores(_script(), stores).run(agent, "go", tenant=T, run_id="c")
        )
        assert await asyncio.to_thread(started.wait, HANG)
        task.cancel()
        await asyncio.sleep(0.1)
        assert not task.done()  # the run waits for the thread: it may still be sending
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        provider = _script()
        run = await AgentRunner.from_stores(provider, stores).resume(agent, "c", tenant=T)
    assert run.status is RunStatus.completed
    assert len(effects) == 1
    [told] = answers(provider.requests[-1], "t")
    assert not told.is_error and "booked late" in told.text


# --- reconcilers that misbehave ------------------------------------------------------------


def _dies_in_the_call(reconcile: Any) -> tuple[list[int], Agent, Recording]:
    """An agent whose one call dies inside its tool the first time (the effect made)."""
    effects: list[int] = []
    dying = {"now": True}

    def t(x: int) -> str:
        """Pays."""
        effects.append(x)
        if dying["now"]:
            dying["now"] = False
            raise SimulatedCrash("died inside the payment")
        return "paid"

    agent = _one_call_agent(t, reconcile=reconcile)
    return effects, agent, _script()


async def test_a_reconciler_raising_an_unprintable_error_leaves_the_call_in_doubt(
    tmp_path: Path,
) -> None:
    def reconcile(call: Any, ctx: ToolContext) -> Reconciled:
        raise _StrRaises()

    effects, agent, provider = _dies_in_the_call(reconcile)
    async with fresh_stores("sqlite", tmp_path) as stores:
        with pytest.raises(SimulatedCrash):
            await AgentRunner.from_stores(provider, stores, lease_policy=SHORT).run(
                agent, "go", tenant=T, run_id="rc"
            )
        await asyncio.sleep(1.3)  # the dead attempt's lease lapses
        with pytest.raises(IndeterminateToolCallError):
            await AgentRunner.from_stores(provider, stores, never_ran_margin=0.2).resume(
                agent, "rc", tenant=T
            )
    assert effects == [1]


@pytest.mark.parametrize(
    "answer",
    [
        pytest.param(lambda: "completed", id="a-string"),
        pytest.param(lambda: None, id="none"),
        pytest.param(lambda: {"found": "completed"}, id="a-dict"),
    ],
)
async def test_a_reconciler_answering_no_reconciled_leaves_the_call_in_doubt(
    tmp_path: Path, answer: Any
) -> None:
    def reconcile(call: Any, ctx: ToolContext) -> Any:
        return answer()

    effects, agent, provider = _dies_in_the_call(reconcile)
    async with fresh_stores("sqlite", tmp_path) as stores:
        with pytest.raises(SimulatedCrash):
            await AgentRunner.from_stores(provider, stores, lease_policy=SHORT).run(
                agent, "go", tenant=T, run_id="rn"
            )
        await asyncio.sleep(1.3)
        with pytest.raises(IndeterminateToolCallError):
            await AgentRunner.from_stores(provider, stores, never_ran_margin=0.2).resume(
                agent, "rn", tenant=T
            )
    assert effects == [1]


async def test_a_reconciler_answering_completed_with_a_secret_stores_it_masked(
    tmp_path: Path,
) -> None:
    def reconcile(call: Any, ctx: ToolContext) -> Reconciled:
        return Reconciled.completed({"receipt": f"paid with {SECRET}", "api_key": "zq" * 10})

    effects, agent, provider = _dies_in_the_call(reconcile)
    async with fresh_stores("sqlite", tmp_path) as stores:
        with pytest.raises(SimulatedCrash):
            await AgentRunner.from_stores(provider, stores, lease_policy=SHORT).run(
                agent, "go", tenant=T, run_id="rs"
            )
        await asyncio.sleep(1.3)
        run = await AgentRunner.from_stores(provider, stores, never_ran_margin=0.2).resume(
            agent, "rs", tenant=T
        )
    assert run.status is RunStatus.completed
    assert effects == [1]  # settled by the reconciler, never sent again
    stored = _stored(tmp_path)
    assert SECRET.encode() not in stored and b"zq" * 10 not in stored


# --- names, descriptions and keys ------------------------------------------------------------


def test_two_tools_of_one_name_in_an_agent_are_refused() -> None:
    @tool
    def pay(amount: int) -> str:
        """Pay."""
        return "paid"

    @tool(name="pay")
    def refund(amount: int) -> str:
        """Refund."""
        return "refunded"

    with pytest.raises(ConfigurationError, match="same name"):
        Agent("authors", "Pay.", [pay, refund])


async def test_a_secret_in_a_tool_description_reaches_no_store(tmp_path: Path) -> None:
    def t(x: int) -> str:
        return "ok"

    agent = _one_call_agent(t, description=f"Calls the API with {SECRET}.")
    async with fresh_stores("sqlite", tmp_path) as stores:
        run = await AgentRunner.from_stores(_script(), stores).run(
            agent, "go", tenant=T, run_id="d"
        )
    assert run.status is RunStatus.completed
    assert SECRET.encode() not in _stored(tmp_path)


def _by_order(**kw: Any) -> str:
    return f"order-{kw['arguments']['order']}"


def _by_order_renamed(**kw: Any) -> str:
    return f"ORDER:{kw['arguments']['order']}"


def _charging(key: Any, effects: list[str]) -> Agent:
    @tool(key=key)
    def charge(order: str, ctx: ToolContext) -> str:
        """Charge an order."""
        assert ctx.idempotency_key is not None
        effects.append(ctx.idempotency_key)
        return "charged"

    return Agent("authors", "Charge.", [charge])


async def test_a_key_function_changed_after_a_crash_replays_the_frontiers_key(
    tmp_path: Path,
) -> None:
    effects: list[str] = []
    script = [[("charge", {"order": "5"})], "done"]
    async with fresh_stores("sqlite", tmp_path) as stores:
        with pytest.raises(SimulatedCrash):
            await faulty_runner(
                stores, ScriptedProvider(script), crash_before=at("after_tool_result", 0)
            ).run(_charging(_by_order, effects), "go", tenant=T, run_id="k")
        run = await AgentRunner.from_stores(ScriptedProvider(script), stores).resume(
            _charging(_by_order_renamed, effects), "k", tenant=T
        )
    assert run.status is RunStatus.completed
    assert effects == ["acme/order-5"]


async def test_a_key_function_changed_past_the_frontier_is_a_divergence_not_a_second_charge(
    tmp_path: Path,
) -> None:
    effects: list[str] = []
    script = [[("charge", {"order": "5"})], "done"]
    async with fresh_stores("sqlite", tmp_path) as stores:
        with pytest.raises(SimulatedCrash):
            await faulty_runner(
                stores,
                ScriptedProvider(script),
                crash_before=at("after_tool_result", 0),
                policy=ONLY_AFTER_TOOLS,
            ).run(_charging(_by_order, effects), "go", tenant=T, run_id="kd")
        runner = AgentRunner(
            ScriptedProvider(script),
            idempotency=stores.idempotency,
            checkpoints=Checkpointer(
                stores.checkpoints, history=stores.history, policy=ONLY_AFTER_TOOLS
            ),
            leases=stores.leases,
            ledger=stores.ledger,
            approvals=stores.approvals,
            work=stores.work,
        )
        with pytest.raises(DivergedRunError):
            await runner.run(_charging(_by_order_renamed, effects), "go", tenant=T, run_id="kd")
    assert effects == ["acme/order-5"]


# --- a real SIGKILL inside the tool, the key function changed before the resume ----------

_AGENT_FILE = '''
import asyncio, os, sys, time
from tesserix_adk import Agent, AgentRunner, LeasePolicy, ScriptedProvider, ToolContext
from tesserix_adk import open_stores, tool

def v1(**kw):
    return f"order-{kw['arguments']['order']}"

def v2(**kw):
    return f"ORDER:{kw['arguments']['order']}"

@tool(key=v1 if os.environ["KEYS"] == "v1" else v2)
def charge(order: str, ctx: ToolContext) -> str:
    """Charge an order."""
    with open(os.environ["EFFECTS"], "a") as f:
        f.write(f"{order} {ctx.idempotency_key}\\n")
    print("charged", flush=True)
    time.sleep(float(os.environ.get("SLOW", "0")))
    return "charged"

agent = Agent("shop", "Charge.", [charge])
PROVIDER = ScriptedProvider([[("charge", {"order": "5"})], "done"])

async def main(store, run_id):
    async with open_stores(store) as stores:
        await stores.create_schema()
        runner = AgentRunner.from_stores(
            PROVIDER, stores, lease_policy=LeasePolicy(ttl=1, renew_within=0.5)
        )
        await runner.run(agent, "go", tenant="acme", run_id=run_id)

if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2]))
'''


def test_a_key_function_changed_after_a_sigkill_inside_the_tool_refuses_not_charges_again(
    tmp_path: Path,
) -> None:
    agent_file = tmp_path / "shop_agent.py"
    agent_file.write_text(_AGENT_FILE)
    effects = tmp_path / "effects.txt"
    store = f"sqlite:///{tmp_path / 'adk.sqlite3'}"
    env = {**os.environ, "EFFECTS": str(effects), "KEYS": "v1", "SLOW": "60"}
    proc = subprocess.Popen(
        [sys.executable, str(agent_file), store, "sk"],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "charged"
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=10)
    assert proc.returncode == -signal.SIGKILL

    async def lease() -> Any:
        async with open_stores(store) as stores:
            return await stores.leases.current("acme", "sk")

    deadline = time.monotonic() + HANG
    while asyncio.run(lease()) is not None:
        assert time.monotonic() < deadline, "the dead process's lease never lapsed"
        time.sleep(0.1)
    resume = [
        sys.executable,
        "-m",
        "tesserix_adk",
        "run",
        "--resume",
        "sk",
        "--tenant",
        "acme",
        "--agent",
        f"{agent_file}:agent",
        "--store",
        store,
    ]
    changed = {**env, "KEYS": "v2", "SLOW": "0"}
    done = subprocess.run(
        resume, env=changed, cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 4, (done.stdout, done.stderr)  # in doubt: refused
    assert "Traceback" not in done.stderr
    assert effects.read_text().splitlines() == ["5 acme/order-5"]
