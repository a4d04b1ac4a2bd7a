"""A careful newcomer's use of the public API, from README alone: tools defined every legal
way (partials, methods, callable objects, odd parameters), key functions, store URLs, run
ids and tenants, concurrency in one process and a runner used after its stores closed.
Real SQLite files; PostgreSQL (127.0.0.1:5432, ``test``) and Redis where cheap.

A strict xfail is a defect (its reason names it); a plain test is a promise that held:
misuse is a typed error from the kit's tree before anything happens, a completed call's
record is never lost, and no effect is made twice.
"""

from __future__ import annotations

import asyncio
import functools
import socket
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from adapters import services
from run.helpers import faulty_runner
from tesserix_adk import (
    AdkError,
    Agent,
    AgentRunner,
    ConfigurationError,
    IndeterminateToolCallError,
    LeasePolicy,
    ModelRequest,
    ModelResponse,
    Role,
    RunStartedError,
    RunStatus,
    ScriptedProvider,
    StoreUnavailableError,
    Tool,
    open_stores,
    tool,
)
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.testing.faults import SimulatedCrash

T = "acme"
FAST = LeasePolicy(ttl=1.0, renew_within=0.5)
SECRET = "hunter2-Zq9"


class Seeing(ScriptedProvider):
    """The scripted model, keeping every request it was sent."""

    def __init__(self, turns: list[Any]) -> None:
        super().__init__(turns)
        self.seen: list[ModelRequest] = []

    async def complete(self, request: ModelRequest) -> ModelResponse:
        self.seen.append(request)
        return await super().complete(request)


def _told(model: Seeing) -> list[str]:
    return [m.text for m in model.seen[-1].messages if m.role is Role.tool]


async def _sqlite(tmp_path: Path, name: str = "adk.sqlite3") -> Stores:
    stores = open_stores(f"sqlite:///{tmp_path / name}")
    await stores.create_schema()
    return stores


def _after_result(body: dict[str, Any]) -> bool:
    return body.get("boundary") == "after_tool_result"


# --- defining tools ------------------------------------------------------------------------


def _amount(a: int, currency: str = "EUR") -> str:
    """Charge an amount."""
    return f"{a * 2} {currency}"


class _Callable:
    def __call__(self, a: int) -> str:
        """Charge an amount."""
        return str(a * 2)


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: Tool(functools.partial(_amount, currency="USD")), id="partial"),
        pytest.param(lambda: Tool(_Callable()), id="callable-object"),
        pytest.param(lambda: Tool(5), id="not-callable"),  # type: ignore[arg-type]
        pytest.param(lambda: Tool(_takes_a_socket), id="unsupported-annotation"),
    ],
)
def test_a_tool_that_cannot_be_made_is_a_configuration_error(make: Any) -> None:
    with pytest.raises(ConfigurationError):
        make()


def _takes_a_socket(s: socket.socket) -> str:
    """Use a socket."""
    return "ok"


@pytest.mark.parametrize(
    "fn",
    [
        pytest.param(functools.partial(_amount, currency="USD"), id="partial"),
        pytest.param(_Callable(), id="callable-object"),
    ],
)
def test_a_partial_or_callable_object_keeps_its_parameter_types(fn: Any) -> None:
    charge = Tool(fn, name="charge")
    assert charge.parameters["properties"]["a"].get("type") == "integer"
    assert charge.invalid_arguments({"a": "not a number"}) is not None


def _positional_only(a: int, /) -> str:
    """Positional only."""
    return str(a)


def _private(_order: str) -> str:
    """A parameter pydantic takes for private."""
    return _order


def _model_config(model_config: str) -> str:
    """A parameter named like pydantic's own attribute."""
    return model_config


@pytest.mark.parametrize("fn", [_positional_only, _private, _model_config])
def test_a_parameter_no_call_can_pass_is_refused_at_definition(fn: Any) -> None:
    with pytest.raises(ConfigurationError):
        Tool(fn)


async def test_a_method_tool_and_a_typed_pydantic_argument_are_keyed_and_sent_once(
    tmp_path: Path,
) -> None:
    """A bound method as a tool: ``self`` is not asked of the model, its types hold, and a
    crash before the result's frontier replays the recorded outcome on resume."""

    class Shop:
        def __init__(self) -> None:
            self.charged: list[int] = []

        def charge(self, a: int) -> str:
            """Charge an amount."""
            self.charged.append(a)
            return f"charged {a}"

    shop = Shop()
    charge = Tool(shop.charge)
    assert set(charge.parameters["properties"]) == {"a"}
    assert charge.invalid_arguments({"a": "x"}) is not None
    agent = Agent("shop", "Charge.", [charge])
    stores = await _sqlite(tmp_path)
    async with stores:
        model = ScriptedProvider([[("charge", {"a": 5})], "done"])
        dying = faulty_runner(stores, model, crash_before=_after_result, lease_policy=FAST)
        with pytest.raises(SimulatedCrash):
            await dying.run(agent, "go", tenant=T, run_id="r")
        await asyncio.sleep(FAST.ttl + 0.2)
        model = Seeing([[("charge", {"a": 5})], "done"])
        run = await AgentRunner.from_stores(model, stores).resume(agent, "r", tenant=T)
        assert run.status is RunStatus.completed
    assert shop.charged == [5]
    assert _told(model) == ["charged 5"]


# --- key functions -------------------------------------------------------------------------


async def test_a_key_function_giving_a_new_key_each_time_still_sends_once(tmp_path: Path) -> None:
    """A key function that breaks its contract (not a pure function: a fresh uuid each
    call): the resume uses the key the claim was made under, not a new one."""
    sent: list[str] = []

    @tool(key=lambda **kw: f"pay-{uuid.uuid4()}")
    def pay(order: str) -> str:
        """Pay an order."""
        sent.append(order)
        return "paid"

    agent = Agent("shop", "Pay.", [pay])
    stores = await _sqlite(tmp_path)
    async with stores:
        model = ScriptedProvider([[("pay", {"order": "o1"})], "done"])
        dying = faulty_runner(stores, model, crash_before=_after_result, lease_policy=FAST)
        with pytest.raises(SimulatedCrash):
            await dying.run(agent, "go", tenant=T, run_id="r")
        await asyncio.sleep(FAST.ttl + 0.2)
        model = ScriptedProvider([[("pay", {"order": "o1"})], "done"])
        run = await AgentRunner.from_stores(model, stores).resume(agent, "r", tenant=T)
        assert run.status is RunStatus.completed
        (record,) = await stores.idempotency.records(T, "r")
        assert record.status.value == "completed" and record.key.startswith(f"{T}/pay-")
    assert sent == ["o1"]


async def test_a_key_function_returning_a_number_refuses_the_turn_before_anything_is_sent(
    tmp_path: Path,
) -> None:
    sent: list[str] = []

    @tool
    def pay(order: str) -> str:
        """Pay an order."""
        sent.append(f"pay {order}")
        return "paid"

    @tool(key=lambda **kw: 5)  # type: ignore[arg-type, return-value]
    def refund(order: str) -> str:
        """Refund an order."""
        sent.append(f"refund {order}")
        return "refunded"

    agent = Agent("shop", "Pay.", [pay, refund])
    stores = await _sqlite(tmp_path)
    async with stores:
        model = ScriptedProvider([[("pay", {"order": "1"}), ("refund", {"order": "2"})], "done"])
        with pytest.raises(ConfigurationError, match="refund") as raised:
            await AgentRunner.from_stores(model, stores).run(agent, "go", tenant=T, run_id="r")
        assert raised.value.retryable is False
        assert await stores.idempotency.records(T, "r") == []
    assert sent == []


async def test_a_key_two_tools_share_never_answers_one_with_the_others_outcome(
    tmp_path: Path,
) -> None:
    sent: list[str] = []

    def by_order(**kw: Any) -> str:
        return f"order-{kw['arguments']['order']}"

    @tool(key=by_order)
    def charge(order: str) -> str:
        """Charge an order."""
        sent.append(f"charge {order}")
        return f"charged order {order}"

    @tool(key=by_order)
    def refund(order: str) -> str:
        """Refund an order."""
        sent.append(f"refund {order}")
        return f"refunded order {order}"

    agent = Agent("shop", "Charge, then refund.", [charge, refund])
    stores = await _sqlite(tmp_path)
    async with stores:
        model = Seeing([[("charge", {"order": "5"})], [("refund", {"order": "5"})], "done"])
        runner = AgentRunner.from_stores(model, stores)
        try:
            await runner.run(agent, "go", tenant=T, run_id="r")
        except AdkError:
            return  # refused, typed: what the kit should do (or send the refund)
        told = _told(model)
    assert sent == ["charge 5"] or sent == ["charge 5", "refund 5"]
    assert told[-1] != "charged order 5", (sent, told)


# --- tools renamed or removed under a pinned revision ----------------------------------


def _pay_tool(sent: list[str], *, name: str = "pay", dies: bool = False) -> Tool:
    @tool(name=name)
    def pay(order: str) -> str:
        """Pay an order."""
        sent.append(order)
        if dies:
            raise SimulatedCrash("died inside the call, after it went out")
        return "paid"

    return pay


@pytest.mark.parametrize(
    ("dies", "later"),
    [
        pytest.param(False, "removed", id="completed-tool-removed"),
        pytest.param(True, "removed", id="in-doubt-tool-removed"),
        pytest.param(True, "renamed", id="in-doubt-tool-renamed"),
    ],
)
async def test_a_tool_gone_from_a_pinned_revision_never_loses_or_resends_its_call(
    tmp_path: Path, dies: bool, later: str
) -> None:
    """``Agent(revision="v1")`` pins the revision by hand, so removing or renaming a tool
    is not refused as a changed revision: the call's record must still decide."""
    sent: list[str] = []
    agent = Agent("shop", "Pay.", [_pay_tool(sent, dies=dies)], revision="v1")
    stores = await _sqlite(tmp_path)
    async with stores:
        model = ScriptedProvider([[("pay", {"order": "o1"})], "done"])
        dying = faulty_runner(stores, model, crash_before=_after_result, lease_policy=FAST)
        with pytest.raises(SimulatedCrash):
            await dying.run(agent, "go", tenant=T, run_id="r")
        await asyncio.sleep(FAST.ttl + 0.2)
        tools = [] if later == "removed" else [_pay_tool(sent, name="charge")]
        now = Agent("shop", "Pay.", tools, revision="v1")
        model = ScriptedProvider([[("pay", {"order": "o1"})], "done"])
        runner = AgentRunner.from_stores(model, stores)
        if dies:
            with pytest.raises(IndeterminateToolCallError) as raised:
                await runner.resume(now, "r", tenant=T)
            assert raised.value.retryable is False
        else:
            run = await runner.resume(now, "r", tenant=T)
            assert run.status is RunStatus.completed
        (record,) = await stores.idempotency.records(T, "r")
        assert record.tool == "pay"
        assert record.status.value == ("in_flight" if dies else "completed")
    assert sent == ["o1"]


# --- run ids, tenants, concurrency, a closed runner ----------------------------------------


async def test_one_run_id_twice_at_once_in_one_process_and_again_when_done_sends_once(
    tmp_path: Path,
) -> None:
    sent: list[str] = []

    @tool
    async def pay(order: str) -> str:
        """Pay an order (slowly)."""
        sent.append(order)
        await asyncio.sleep(0.2)
        return "paid"

    agent = Agent("shop", "Pay.", [pay])
    stores = await _sqlite(tmp_path)
    async with stores:
        runner = AgentRunner.from_stores(
            ScriptedProvider([[("pay", {"order": "o1"})], "done"]), stores
        )
        both = await asyncio.gather(
            runner.run(agent, "go", tenant=T, run_id="r"),
            runner.run(agent, "go", tenant=T, run_id="r"),
            runner.resume(agent, "r", tenant=T),
            return_exceptions=True,
        )
        done = [x for x in both if not isinstance(x, BaseException)]
        refused = [x for x in both if isinstance(x, BaseException)]
        assert len(done) == 1 and done[0].status is RunStatus.completed, both
        assert len(refused) == 2, both
        assert all(isinstance(x, AdkError) and x.retryable for x in refused), both
        with pytest.raises(RunStartedError, match="resume it"):
            await runner.run(agent, "go again", tenant=T, run_id="r")
        (record,) = await stores.idempotency.records(T, "r")
        assert record.status.value == "completed"
        run = await runner.resume(agent, "r", tenant=T)
        assert run.status is RunStatus.completed
    assert sent == ["o1"]


async def test_a_runner_used_after_its_stores_closed_is_a_typed_error_sending_nothing(
    tmp_path: Path,
) -> None:
    sent: list[str] = []
    agent = Agent("shop", "Pay.", [_pay_tool(sent)])
    stores = await _sqlite(tmp_path)
    async with stores:
        runner = AgentRunner.from_stores(
            ScriptedProvider([[("pay", {"order": "o1"})], "done"]), stores
        )
        await runner.run(agent, "go", tenant=T, run_id="r")
    for attempt in (
        runner.run(agent, "go", tenant=T, run_id="r2"),
        runner.resume(agent, "r", tenant=T),
    ):
        with pytest.raises(ConfigurationError, match="closed") as raised:
            await attempt
        assert raised.value.retryable is False
    assert sent == ["o1"]
    async with open_stores(f"sqlite:///{tmp_path / 'adk.sqlite3'}") as again:
        (record,) = await again.idempotency.records(T, "r")
        assert record.status.value == "completed"
        assert await again.checkpoints.latest(T, "r2") is None


# No NUL: a tenant holding one is refused on every store (the NUL test below).
_ODD = st.text(
    st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"),
    min_size=1,
    max_size=12,
) | st.sampled_from(["a/b", "..", "%2F", "a:b", "*", " ", "\n", "ACME", "acme "])


@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(tenant=_ODD, other=_ODD)
async def test_odd_tenants_on_sqlite_keep_their_records_apart(
    tmp_path_factory: pytest.TempPathFactory, tenant: str, other: str
) -> None:
    """Oracle: each tenant's run sends its call once, lists exactly its own record, and a
    resume of it replays: two tenants never share a record, however their names look."""
    sent: list[tuple[str, str]] = []

    @tool
    def book(order: str, ctx: Any) -> str:
        """Book an order."""
        sent.append((ctx.tenant, order))
        return f"booked for {ctx.tenant!r}"

    agent = Agent("shop", "Book.", [book])
    stores = await _sqlite(tmp_path_factory.mktemp("odd"))
    async with stores:
        tenants = list(dict.fromkeys([tenant, other]))
        for t in tenants:
            model = ScriptedProvider([[("book", {"order": "5"})], "done"])
            run = await AgentRunner.from_stores(model, stores).run(
                agent, "go", tenant=t, run_id="r"
            )
            assert run.status is RunStatus.completed
        for t in tenants:
            (record,) = await stores.idempotency.records(t, "r")
            assert record.tenant == t and record.status.value == "completed"
            model = ScriptedProvider([[("book", {"order": "5"})], "done"])
            run = await AgentRunner.from_stores(model, stores).resume(agent, "r", tenant=t)
            assert run.status is RunStatus.completed
    assert sorted(sent) == sorted((t, "5") for t in tenants)


@pytest.mark.postgres
@pytest.mark.parametrize(
    ("tenant", "run_id", "key"),
    [
        pytest.param("acme\x00x", "r", None, id="tenant"),
        pytest.param(T, "r\x00x", None, id="run-id"),
        pytest.param(T, "r", "order\x005", id="key"),
    ],
)
async def test_a_nul_in_an_id_is_a_configuration_error_on_postgres(
    tenant: str, run_id: str, key: str | None
) -> None:
    sent: list[str] = []

    @tool(key=(lambda **kw: key) if key else None)
    def pay(order: str) -> str:
        """Pay an order."""
        sent.append(order)
        return "paid"

    agent = Agent("shop", "Pay.", [pay])
    async with services.postgres_stores() as stores:
        model = ScriptedProvider([[("pay", {"order": "o1"})], "done"])
        with pytest.raises(ConfigurationError):
            await AgentRunner.from_stores(model, stores).run(
                agent, "go", tenant=tenant, run_id=run_id
            )
    assert sent == []


# --- store URLs ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "url",
    [
        f"sqlite://admin:{SECRET}@db.internal/adk.sqlite3",
        f"memory://admin:{SECRET}@localhost",
        f"sqlite://admin:{SECRET}@/adk.sqlite3",
    ],
)
def test_a_store_url_error_never_shows_its_password(url: str) -> None:
    with pytest.raises(ConfigurationError) as raised:
        open_stores(url)
    assert SECRET not in str(raised.value)


async def test_a_one_slash_sqlite_url_is_refused_or_absolute(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    absolute = tmp_path / "store" / "adk.sqlite3"
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    try:
        stores = open_stores(f"sqlite:{absolute}")
    except ConfigurationError:
        return
    async with stores:
        await stores.create_schema()
    assert absolute.is_file()
    assert not any(elsewhere.iterdir())


@pytest.mark.parametrize(
    "url",
    [
        pytest.param(
            f"postgresql://postgres:{SECRET}@127.0.0.1:1/test?timeout=2",
            marks=pytest.mark.postgres,
            id="postgres-unreachable",
        ),
        pytest.param(
            f"redis://:{SECRET}@127.0.0.1:1/0?allow_volatile=true",
            marks=pytest.mark.redis,
            id="redis-unreachable",
        ),
        pytest.param(
            f"postgresql://nobody-here:{SECRET}@127.0.0.1:5432/test?timeout=5",
            marks=pytest.mark.postgres,
            id="postgres-unknown-role",
        ),
    ],
)
async def test_an_unusable_server_store_is_typed_and_keeps_the_password_out(
    url: str, caplog: pytest.LogCaptureFixture
) -> None:
    sent: list[str] = []
    agent = Agent("shop", "Pay.", [_pay_tool(sent)])
    caplog.set_level("DEBUG")
    async with open_stores(url) as stores:
        runner = AgentRunner.from_stores(ScriptedProvider([[("pay", {"order": "o"})]]), stores)
        with pytest.raises(AdkError) as raised:
            await runner.run(agent, "go", tenant=T, run_id="r")
    error = raised.value
    if "unknown-role" in url or "nobody-here" in url:
        assert isinstance(error, ConfigurationError) and not error.retryable
    else:
        assert isinstance(error, StoreUnavailableError) and error.retryable
    chain = [error, error.__cause__, error.__context__]
    assert all(SECRET not in str(e) for e in chain if e is not None)
    assert SECRET not in caplog.text
    assert sent == []


def test_the_cli_never_prints_a_sqlite_urls_password(tmp_path: Path) -> None:
    url = f"sqlite://admin:{SECRET}@db.internal/adk.sqlite3"
    done = subprocess.run(
        [sys.executable, "-m", "tesserix_adk", "runs", "--tenant", T, "--store", url],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert SECRET not in done.stderr + done.stdout, done.stderr
