"""An attacker's look at this stop's later fixes: tool definitions (a partial's bound
keywords hidden, async generators refused, pydantic property names refused, mistyped flags
refused), a call whose arguments are not JSON answered unsent, a SQLite file opened
read-only where it cannot be written, and a replay's budget counting the step's spend.

Defects found (each a strict xfail asserting the promised behaviour):

1. MEDIUM ``test_an_async_generator_call_inherited_from_a_base_class_is_refused``: the
   async-generator check reads ``type(fn).__dict__["__call__"]`` only, so a callable
   object whose ``async def __call__ ... yield`` comes from a base class is accepted; it is
   run as a sync tool, its body never runs, and the call is recorded completed with
   ``<async_generator ...>`` as its outcome (the defect the fix closed for the class's own
   ``__call__``).
2. MEDIUM ``test_a_decorated_partials_bound_keyword_is_not_the_models_to_change``: a
   partial wrapped by a decorator (``functools.wraps``, as logging and retry decorators
   do) is not a ``functools.partial`` itself, yet ``inspect.signature`` follows
   ``__wrapped__`` to it: its bound ``account`` is offered to the model with a default, and
   the model's ``account`` overrides the author's (charged to "attacker").
3. HIGH ``test_a_read_only_store_held_open_sees_what_is_written_once_it_is_writable``: a
   file opened read-only with no -wal is opened ``immutable=1``, which SQLite takes as a
   promise the file never changes: a long-lived reader (the console, an embedding process)
   keeps that connection, and once the file is written (the filesystem made writable again,
   or by a process that may write a directory this one may not) it never sees the new runs.
4. LOW ``test_a_read_only_store_held_open_can_write_once_it_is_writable``: the same held
   connection refuses every write forever (``StorePermissionError``), although the file is
   writable: the console must be restarted to approve or cancel.
5. MEDIUM ``test_a_replay_of_a_replay_is_held_to_the_originals_budget``: a replay's
   frontiers record only its own spend (``replayed_frontier``: ``micros=run.spent``), and a
   replay of them starts ``spent_before`` from that: a replay of a replay gets the whole
   budget again and asks the model where the original (and the first replay) had none left.

What held (plain tests): nested partials, a partial of a bound method, a ``partialmethod``
and a partial binding ``ctx`` hide their bound keywords; a coroutine ``__call__`` inherited
from a base class runs; a numpy bool flag and a non-callable ``reconcile`` are refused typed
at definition while ``key=functools.partial(...)`` works; a turn holding a non-JSON call
beside good calls and a twin sends each good call once and answers the bad one unsent, also
across a crash after the turn and a resume on SQLite, and a non-JSON call to a tool needing
approval parks nothing; a SQLite store whose -wal holds transactions is read whole on a
read-only mount.
"""

from __future__ import annotations

import asyncio
import datetime
import functools
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from run.helpers import Recording, answers, faulty_runner
from tesserix_adk import (
    Agent,
    AgentRunner,
    ConfigurationError,
    RunStatus,
    ScriptedProvider,
    Tool,
    ToolCall,
    ToolContext,
    tool,
)
from tesserix_adk.errors import StorePermissionError
from tesserix_adk.stores.urls import open_stores
from tesserix_adk.testing.faults import SimulatedCrash
from test_attacks_session_fixes_replay_ledger import ORIG, Shop, runner, turns

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

T = "acme"
TESTS = Path(__file__).resolve().parent


def _charge(amount: int, account: str) -> str:
    return account


# --- tool definitions -----------------------------------------------------------------------


class _Shop:
    def charge(self, amount: int, account: str) -> str:
        return account

    fixed = functools.partialmethod(charge, account="acme-main")


@pytest.mark.parametrize(
    "fn",
    [
        pytest.param(
            functools.partial(functools.partial(_charge, account="acme-main"), amount=1),
            id="nested-partials",
        ),
        pytest.param(functools.partial(_Shop().charge, account="acme-main"), id="bound-method"),
        pytest.param(_Shop().fixed, id="partialmethod"),
    ],
)
def test_a_partials_bound_keywords_are_hidden_however_it_is_built(fn: Any) -> None:
    t = Tool(fn, name="charge")
    assert "account" not in t.parameters["properties"]
    assert t.invalid_arguments({"amount": 1, "account": "attacker"}) is not None


async def test_a_partial_binding_ctx_keeps_its_own_ctx() -> None:
    got: list[Any] = []

    def look(query: str, ctx: Any) -> str:
        got.append(ctx)
        return "found"

    t = Tool(functools.partial(look, ctx="mine"), name="look", side_effects=False)
    assert list(t.parameters["properties"]) == ["query"]
    model = ScriptedProvider([[("look", {"query": "q"})], "done"])
    async with open_stores("memory://") as stores:
        await stores.create_schema()
        await AgentRunner.from_stores(model, stores).run(Agent("l", "Go.", [t]), "go", tenant=T)
    assert got == ["mine"]


class _StreamingBooker:
    def __init__(self) -> None:
        self.sent: list[str] = []

    async def __call__(self, flight: str) -> Any:
        self.sent.append(flight)
        yield "booked"


class _Booker(_StreamingBooker):
    """Book a flight (its ``__call__`` is its base class's)."""


async def test_an_async_generator_call_inherited_from_a_base_class_is_refused() -> None:
    booker = _Booker()
    try:
        t = Tool(booker, name="book")
    except ConfigurationError:
        return
    model = Recording(ScriptedProvider([[("book", {"flight": "LH400"})], "done"]))
    async with open_stores("memory://") as stores:
        await stores.create_schema()
        run = await AgentRunner.from_stores(model, stores).run(
            Agent("g", "Go.", [t]), "go", tenant=T
        )
    told = [m.text for m in answers(model.requests[-1], "book")]
    assert run.status is RunStatus.completed
    assert "async_generator" not in told[0], told
    assert booker.sent == ["LH400"]


async def test_a_coroutine_call_inherited_from_a_base_class_runs() -> None:
    sent: list[str] = []

    class Base:
        async def __call__(self, flight: str) -> str:
            await asyncio.sleep(0)
            sent.append(flight)
            return "booked"

    class Child(Base):
        pass

    model = Recording(ScriptedProvider([[("book", {"flight": "LH1"})], "done"]))
    async with open_stores("memory://") as stores:
        await stores.create_schema()
        await AgentRunner.from_stores(model, stores).run(
            Agent("c", "Go.", [Tool(Child(), name="book")]), "go", tenant=T
        )
    assert sent == ["LH1"]
    assert [m.text for m in answers(model.requests[-1], "book")] == ["booked"]


def _logged(fn: Any) -> Any:
    """A decorator as logging or retry libraries write them."""

    @functools.wraps(fn)
    def inner(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    return inner


async def test_a_decorated_partials_bound_keyword_is_not_the_models_to_change() -> None:
    charged: list[str] = []

    def charge(amount: int, account: str) -> str:
        charged.append(account)
        return "charged"

    t = Tool(_logged(functools.partial(charge, account="acme-main")), name="charge")
    model = ScriptedProvider([[("charge", {"amount": 5, "account": "attacker"})], "done"])
    async with open_stores("memory://") as stores:
        await stores.create_schema()
        await AgentRunner.from_stores(model, stores).run(Agent("p", "Pay.", [t]), "go", tenant=T)
    assert charged in ([], ["acme-main"]), charged
    assert "account" not in t.parameters["properties"]


def test_a_numpy_bool_flag_is_refused_at_definition() -> None:
    numpy = pytest.importorskip("numpy")
    with pytest.raises(ConfigurationError):
        Tool(_charge, side_effects=numpy.False_)
    assert Tool(_charge, side_effects=bool(numpy.False_)).side_effects is False


def test_an_uncallable_reconciler_is_refused_and_a_partial_key_is_used() -> None:
    with pytest.raises(ConfigurationError):
        Tool(_charge, reconcile=object())  # type: ignore[arg-type]

    def keyed(*, prefix: str, arguments: Any, **_: Any) -> str:
        return f"{prefix}-{arguments['account']}"

    t = Tool(_charge, key=functools.partial(keyed, prefix="pay"))
    call = ToolCall(id="c1", name="_charge", arguments={"amount": 1, "account": "a"})
    assert t.key_for(tenant=T, run_id="r", iteration=0, call=call) == f"{T}/pay-a"


# --- a call whose arguments are not JSON ----------------------------------------------------


class _Payments:
    def __init__(self) -> None:
        self.sent: list[Any] = []

    def agent(self, *, approval: bool = False) -> Agent:
        @tool(requires_approval=approval)
        def pay(order: str, when: str = "", ctx: ToolContext | None = None) -> str:
            """Pay an order."""
            self.sent.append((order, ctx.idempotency_key if ctx else None))
            return f"paid {order}"

        return Agent("pay", "Pay.", [pay])


def _mixed_turn() -> list[Any]:
    bad = datetime.datetime(2024, 1, 1, tzinfo=datetime.UTC)
    return [
        [
            ("pay", {"order": "o-1"}),
            ("pay", {"order": "o-bad", "when": bad}),
            ("pay", {"order": "o-1"}),
            ("pay", {"order": "o-2"}),
        ],
        "done",
    ]


def _after_tools(body: dict[str, Any]) -> bool:
    return body.get("boundary") == "after_tool_result"


async def test_a_non_json_call_beside_good_calls_and_a_twin_sends_each_good_one_once_across_a_crash(
    tmp_path: Path,
) -> None:
    shop = _Payments()
    url = f"sqlite:///{tmp_path / 'adk.sqlite3'}"
    async with open_stores(url) as stores:
        await stores.create_schema()
        crashing = faulty_runner(stores, ScriptedProvider(_mixed_turn()), crash_before=_after_tools)
        with pytest.raises(SimulatedCrash):
            await crashing.run(shop.agent(), "go", tenant=T, run_id="mixed")
    sent_before = list(shop.sent)
    model = Recording(ScriptedProvider(_mixed_turn()))
    async with open_stores(url) as stores:
        run = await AgentRunner.from_stores(model, stores).resume(shop.agent(), "mixed", tenant=T)
        records = await stores.idempotency.records(T, "mixed")
    assert run.status is RunStatus.completed
    orders = sorted(o for o, _ in shop.sent)
    assert orders == ["o-1", "o-1", "o-2"], (sent_before, shop.sent)
    assert len({k for _, k in shop.sent}) == 3  # the twins under keys of their own
    assert len(records) == 3
    told = [m.text for m in answers(model.requests[-1], "pay")]
    assert sum("not JSON" in t for t in told) == 1, told


async def test_a_non_json_call_to_a_tool_needing_approval_parks_nothing() -> None:
    shop = _Payments()
    model = ScriptedProvider(
        [[("pay", {"order": "o-1", "when": datetime.date(2024, 1, 1)})], "done"]
    )
    async with open_stores("memory://") as stores:
        await stores.create_schema()
        run = await AgentRunner.from_stores(model, stores).run(
            shop.agent(approval=True), "go", tenant=T
        )
    assert run.status is RunStatus.completed
    assert shop.sent == []


# --- SQLite read-only -------------------------------------------------------------------------


@pytest.fixture
def own_fs(tmp_path: Path) -> Iterator[Path]:
    """A small tmpfs of the test's own (skipped where mount is refused)."""
    mount = tmp_path / "fs"
    mount.mkdir()
    made = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
    )
    if made.returncode != 0:
        pytest.skip(f"cannot mount a filesystem here: {made.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def _remount(mount: Path, options: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{options}", str(mount)], check=True)


SUBMIT = """
import asyncio, os, signal, sys
from tesserix_adk.stores.urls import open_stores

async def main() -> None:
    async with open_stores(sys.argv[1]) as stores:
        await stores.work.submit("acme", sys.argv[2], agent="chaos", input=b"{}")
        if sys.argv[3] == "die":
            os.kill(os.getpid(), signal.SIGKILL)  # the -wal and -shm are left as they are

asyncio.run(main())
"""


def _submit(url: str, run_id: str, *, die: bool = False) -> None:
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(SUBMIT), url, run_id, "die" if die else "live"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if die:
        assert done.returncode == -signal.SIGKILL, done.stderr
    else:
        assert done.returncode == 0, done.stderr


async def _store_made(url: str) -> None:
    async with open_stores(url) as stores:
        await stores.create_schema()
        await stores.work.submit(T, "a", agent="chaos", input=b"{}")


async def test_a_store_whose_wal_holds_transactions_is_read_whole_on_a_read_only_mount(
    own_fs: Path,
) -> None:
    url = f"sqlite:///{own_fs / 'adk.sqlite3'}"
    await _store_made(url)
    _submit(url, "only-in-the-wal", die=True)
    assert (own_fs / "adk.sqlite3-wal").stat().st_size > 0
    _remount(own_fs, "ro")
    async with open_stores(url) as stores:
        assert await stores.work.entry(T, "a") is not None
        assert await stores.work.entry(T, "only-in-the-wal") is not None
        with pytest.raises(StorePermissionError):
            await stores.work.submit(T, "x", agent="chaos", input=b"{}")


async def test_a_read_only_store_held_open_sees_what_is_written_once_it_is_writable(
    own_fs: Path,
) -> None:
    url = f"sqlite:///{own_fs / 'adk.sqlite3'}"
    await _store_made(url)
    _remount(own_fs, "ro")
    async with open_stores(url) as held:
        assert await held.work.entry(T, "a") is not None
        _remount(own_fs, "rw")
        _submit(url, "b")  # a worker's or an operator's write, in another process
        async with open_stores(url) as fresh:
            assert await fresh.work.entry(T, "b") is not None
        assert await held.work.entry(T, "b") is not None


async def test_a_read_only_store_held_open_can_write_once_it_is_writable(own_fs: Path) -> None:
    url = f"sqlite:///{own_fs / 'adk.sqlite3'}"
    await _store_made(url)
    _remount(own_fs, "ro")
    async with open_stores(url) as held:
        with pytest.raises(StorePermissionError):
            await held.work.submit(T, "x", agent="chaos", input=b"{}")
        _remount(own_fs, "rw")
        await held.work.submit(T, "y", agent="chaos", input=b"{}")
    async with open_stores(url) as fresh:
        assert await fresh.work.entry(T, "y") is not None
        assert await fresh.work.entry(T, "x") is None


# --- a replay's budget --------------------------------------------------------------------


async def _steps(stores: Any, run_id: str) -> list[tuple[int, list[str]]]:
    checkpoints = runner(stores).checkpoints
    assert checkpoints is not None
    out = []
    for step in await stores.checkpoints.steps(T, run_id):
        cp = await checkpoints.at(T, run_id, step)
        assert cp is not None
        out.append((step, [oc.call.name for oc in cp.outstanding]))
    return out


async def test_a_replay_of_a_replay_is_held_to_the_originals_budget() -> None:
    budget = 250  # the original stops after its second model call (300 spent)
    stub = {"pay": lambda order, amount: {"ok": amount}}
    async with open_stores("memory://") as stores:
        await stores.create_schema()
        shop = Shop()
        run = await runner(stores).run(shop.agent(budget), "pay o-1", tenant=T, run_id=ORIG)
        assert run.status is RunStatus.budget_exhausted
        step = next(s for s, names in await _steps(stores, ORIG) if "pay" in names)
        first = await runner(stores).replay(
            shop.agent(budget), ORIG, tenant=T, from_step=step, stubs=stub, new_run_id="rep-1"
        )
        # The first replay holds: no model call, the step's spend counted.
        assert first.status is RunStatus.budget_exhausted
        (again, _), *_ = await _steps(stores, "rep-1")
        model = Recording(ScriptedProvider(turns()))
        second = await runner(stores, model).replay(
            shop.agent(budget), "rep-1", tenant=T, from_step=again, stubs=stub, new_run_id="rep-2"
        )
    assert model.requests == [], "the model was asked past the original's budget"
    assert second.status is RunStatus.budget_exhausted
    assert shop.paid == [("o-1", 40)]
