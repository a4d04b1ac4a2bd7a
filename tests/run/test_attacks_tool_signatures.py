"""Tool signatures as real tool authors write them, against what the kit promises about
tools (SPEC section 3, README "Tools, keys and approvals"): defaults, keyword-only
parameters, Optional/Union, Literal, Enum, datetime/date/Decimal/UUID, nested pydantic
models, TypedDict, list/dict parameters, parameters named like kit or pydantic internals,
methods, staticmethods, ``functools.partial``, callable objects, async generators; flags
that contradict each other; arguments a model sends in another JSON spelling after a crash;
the agent revision and call keys computed in two real processes with different
``PYTHONHASHSEED``s, and a SIGKILL inside a tool resumed by another process.

The oracles: what the model is told (the JSON schema) is what the tool takes; validated
arguments reach the tool as validated; one call keeps one key across processes and resumes
(or the kit refuses rather than sending it twice); the revision is stable across processes
and follows what the model sees; a definition mistake is a ``ConfigurationError`` when the
tool is made.

A strict xfail is a defect (its reason names it); a plain test is a promise that held.
Fixed later: a parameter named ``ctx`` annotated as another type (a ``str``) was hidden from
the model and handed a ``ToolContext`` (LOW); it is refused when the tool is made now
(``tool_schema._holds_a_context``).
"""

from __future__ import annotations

import asyncio
import datetime
import decimal
import enum
import functools
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import unicodedata
import uuid
from pathlib import Path
from typing import Any, Literal

import pydantic
import pytest
from typing_extensions import TypedDict

from run.helpers import Recording, answers, faulty_runner
from tesserix_adk import (
    Agent,
    AgentRunner,
    Boundary,
    CheckpointPolicy,
    ConfigurationError,
    DivergedRunError,
    LeasePolicy,
    RunStatus,
    ScriptedProvider,
    Tool,
    ToolContext,
    tool,
)
from tesserix_adk.stores.urls import open_stores
from tesserix_adk.testing.faults import SimulatedCrash

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

T = "acme"
FAST = LeasePolicy(ttl=1.0, renew_within=0.5)
ONLY_AFTER_TOOLS = CheckpointPolicy(boundaries=frozenset({Boundary.after_tool_result}))
HANG = 30.0  # a deadline for a hang, never a measure of speed
REPO = Path(__file__).resolve().parents[2]


def _after_result(body: dict[str, Any]) -> bool:
    return body.get("boundary") == "after_tool_result"


# --- rich signatures: what the model is told is what the tool takes ------------------------


class Color(enum.Enum):
    red = "r"
    blue = "b"


class Address(pydantic.BaseModel):
    street: str
    since: datetime.date | None = None


class Line(TypedDict):
    sku: str
    qty: int


def _rich(
    when: datetime.datetime,
    day: datetime.date,
    price: decimal.Decimal,
    order_id: uuid.UUID,
    color: Color,
    mode: Literal["fast", "slow"],
    ship_to: Address,
    lines: list[Line],
    note: str | None = None,
    ref: int | str = 1,
    *,
    tags: frozenset[str] = frozenset({"b", "a", "c"}),
    meta: dict[str, int] | None = None,
    ctx: ToolContext,
) -> dict[str, Any]:
    """Place an order with every kind of parameter a tool author writes."""
    return {}


RICH_ARGS: dict[str, Any] = {
    "when": "2024-03-01T10:00:00+01:00",
    "day": "2024-03-01",
    "price": "10.10",
    "order_id": "12345678-1234-5678-1234-567812345678",
    "color": "b",
    "mode": "slow",
    "ship_to": {"street": "Main 1", "since": "2020-01-02"},
    "lines": [{"sku": "x", "qty": 2}],
    "ref": "abc",
    "tags": ["z", "y"],
}


def test_a_rich_signature_is_told_as_it_is_taken() -> None:
    """Every parameter but ``ctx`` is in the schema, keyword-only ones too; the required
    ones are exactly those without a default; nothing else is accepted."""
    t = tool(_rich)
    schema = t.parameters
    assert list(schema["properties"]) == [
        "when",
        "day",
        "price",
        "order_id",
        "color",
        "mode",
        "ship_to",
        "lines",
        "note",
        "ref",
        "tags",
        "meta",
    ]
    assert schema["required"] == [
        "when",
        "day",
        "price",
        "order_id",
        "color",
        "mode",
        "ship_to",
        "lines",
    ]
    assert schema["additionalProperties"] is False
    assert schema["properties"]["mode"]["enum"] == ["fast", "slow"]
    assert t.invalid_arguments(RICH_ARGS) is None
    assert t.invalid_arguments({**RICH_ARGS, "ctx": "x"}) is not None  # the kit's, not the model's
    assert t.invalid_arguments({**RICH_ARGS, "mode": "warp"}) is not None
    assert t.invalid_arguments({**RICH_ARGS, "surprise": 1}) is not None
    without = dict(RICH_ARGS)
    del without["lines"]
    assert t.invalid_arguments(without) is not None


async def test_validated_rich_arguments_reach_the_tool_as_their_types() -> None:
    got: list[dict[str, Any]] = []

    def place(**kwargs: Any) -> str:
        got.append(kwargs)
        return "placed"

    @functools.wraps(_rich)
    def rich(*args: Any, **kwargs: Any) -> str:
        return place(**kwargs)

    model = Recording(ScriptedProvider([[("_rich", RICH_ARGS)], "done"]))
    agent = Agent("rich", "Order.", [Tool(rich, name="_rich")])
    async with open_stores("memory://") as stores:
        await stores.create_schema()
        run = await AgentRunner.from_stores(model, stores).run(agent, "go", tenant=T)
    assert run.status is RunStatus.completed
    (kw,) = got
    assert kw["when"] == datetime.datetime(2024, 3, 1, 9, 0, tzinfo=datetime.UTC)
    assert kw["when"].utcoffset() == datetime.timedelta(hours=1)
    assert kw["day"] == datetime.date(2024, 3, 1)
    assert kw["price"] == decimal.Decimal("10.10") and str(kw["price"]) == "10.10"
    assert kw["order_id"] == uuid.UUID(RICH_ARGS["order_id"])
    assert kw["color"] is Color.blue
    assert kw["ship_to"] == Address(street="Main 1", since=datetime.date(2020, 1, 2))
    assert kw["lines"] == [{"sku": "x", "qty": 2}]
    assert kw["note"] is None and kw["ref"] == "abc"
    assert kw["tags"] == frozenset({"z", "y"}) and kw["meta"] is None
    assert isinstance(kw["ctx"], ToolContext) and kw["ctx"].idempotency_key
    assert [m.text for m in answers(model.requests[-1], "_rich")] == ["placed"]


def test_var_keyword_and_var_positional_tools_are_refused_at_definition() -> None:
    def a(*orders: str) -> str:
        return ""

    def b(order: str, **extra: Any) -> str:
        return ""

    for fn in (a, b):
        with pytest.raises(ConfigurationError):
            tool(fn)


def test_a_static_method_a_bound_method_and_a_callable_object_are_told_without_self() -> None:
    class Shop:
        @staticmethod
        def refund(order: str) -> str:
            """Refund."""
            return order

        def charge(self, order: str, amount: int = 1) -> str:
            """Charge."""
            return order

        def __call__(self, order: str) -> str:
            return order

    shop = Shop()
    for t in (tool(Shop.refund), tool(shop.charge), Tool(shop, name="call")):
        assert "self" not in t.parameters["properties"]
        assert t.parameters["required"] == ["order"]


def test_tool_on_a_method_in_its_class_body_is_refused_or_never_asks_for_self() -> None:
    """Refused at definition (it used to ask the model for ``self``); a function nested in
    a method, and a bound method made a tool, are tools as ever."""
    with pytest.raises(ConfigurationError, match="self"):

        class Shop:
            @tool
            def charge(self, order: str) -> str:
                """Charge."""
                return order

    class Till:
        def charge(self, order: str) -> str:
            """Charge."""
            return order

        def helper(self) -> Tool:
            def inner(self: int) -> str:
                """A parameter merely named self."""
                return str(self)

            return tool(inner)

    assert "self" not in tool(Till().charge).parameters["properties"]
    assert Till().helper().parameters["required"] == ["self"]


async def test_a_partials_bound_keyword_is_not_the_models_to_change() -> None:
    charged: list[str] = []

    def charge(amount: int, account: str) -> str:
        charged.append(account)
        return "charged"

    t = Tool(functools.partial(charge, account="acme-main"), name="charge")
    model = ScriptedProvider([[("charge", {"amount": 5, "account": "attacker"})], "done"])
    async with open_stores("memory://") as stores:
        await stores.create_schema()
        await AgentRunner.from_stores(model, stores).run(Agent("p", "Pay.", [t]), "go", tenant=T)
    assert charged in ([], ["acme-main"])  # refused, or charged to the bound account
    assert "account" not in t.parameters["properties"]


async def test_a_parameter_named_like_a_pydantic_property_gets_the_models_value() -> None:
    got: list[tuple[Any, Any]] = []

    def tag(model_extra: int, model_fields_set: int = 0) -> str:
        """Tag."""
        got.append((model_extra, model_fields_set))
        return "ok"

    try:
        t = tool(tag)
    except ConfigurationError:
        return  # refused at definition, as model_config is: also kept
    model = ScriptedProvider([[("tag", {"model_extra": 3, "model_fields_set": 4})], "done"])
    async with open_stores("memory://") as stores:
        await stores.create_schema()
        await AgentRunner.from_stores(model, stores).run(Agent("m", "Tag.", [t]), "go", tenant=T)
    assert got == [(3, 4)]


@pytest.mark.parametrize("name", ["self", "key", "run_id", "tenant", "iteration", "json"])
async def test_a_parameter_named_like_a_kit_internal_gets_the_models_value(name: str) -> None:
    got: list[Any] = []
    namespace: dict[str, Any] = {"got": got}
    exec(  # a function whose parameter has this name
        f"def fn({name}: int, ctx=None) -> str:\n    got.append({name})\n    return 'ok'\n",
        namespace,
    )
    t = Tool(namespace["fn"], name="fn", key=lambda **kw: f"k-{kw['arguments'][name]}")
    assert t.parameters["required"] == [name]
    model = ScriptedProvider([[("fn", {name: 7})], "done"])
    async with open_stores("memory://") as stores:
        await stores.create_schema()
        run = await AgentRunner.from_stores(model, stores).run(
            Agent("n", "Go.", [t]), "go", tenant=T
        )
        (record,) = await stores.idempotency.records(T, run.run_id)
    assert got == [7]
    assert record.key == f"{T}/k-7"


async def test_a_ctx_parameter_of_another_type_is_refused_or_left_to_the_model() -> None:
    got: list[Any] = []

    def search(query: str, ctx: str = "") -> str:
        """Search, with optional context text."""
        got.append(ctx)
        return "found"

    try:
        t = tool(search)
    except ConfigurationError:
        return
    model = ScriptedProvider([[("search", {"query": "q"})], "done"])
    async with open_stores("memory://") as stores:
        await stores.create_schema()
        await AgentRunner.from_stores(model, stores).run(Agent("s", "Go.", [t]), "go", tenant=T)
    assert all(isinstance(g, str) for g in got)


async def test_an_async_generator_tool_runs_or_is_refused_at_definition() -> None:
    sent: list[str] = []

    async def book(flight: str) -> Any:
        """Book, streaming progress."""
        sent.append(flight)
        yield "booked"

    try:
        t = tool(book)
    except ConfigurationError:
        return
    model = Recording(ScriptedProvider([[("book", {"flight": "LH400"})], "done"]))
    async with open_stores("memory://") as stores:
        await stores.create_schema()
        await AgentRunner.from_stores(model, stores).run(Agent("g", "Go.", [t]), "go", tenant=T)
    told = [m.text for m in answers(model.requests[-1], "book")]
    assert "async_generator" not in told[0], told
    assert sent == ["LH400"]


# --- flags ---------------------------------------------------------------------------------


def _order(order: str) -> str:
    """Act on an order."""
    return order


def test_a_reconciler_without_a_key_is_refused_at_definition() -> None:
    with pytest.raises(ConfigurationError):
        tool(key=None, reconcile=lambda call, ctx: None)(_order)


@pytest.mark.parametrize(
    "flags",
    [
        pytest.param({"key": "order"}, id="key-names-an-argument"),
        pytest.param({"reconcile": "by_key"}, id="reconcile-not-callable"),
        pytest.param({"description": 5}, id="description-not-text"),
        pytest.param({"side_effects": "no"}, id="side-effects-not-a-bool"),
    ],
)
def test_contradictory_or_mistyped_flags_are_a_configuration_error_at_definition(
    flags: dict[str, Any],
) -> None:
    with pytest.raises(ConfigurationError):
        Tool(_order, **flags)


async def test_a_key_that_is_not_callable_sends_nothing() -> None:
    """A mistyped ``key=`` is refused when the tool is made: nothing is sent."""
    sent: list[str] = []

    def pay(order: str) -> str:
        sent.append(order)
        return "paid"

    # Refused when the tool is made now (it was at the first call, once the model was paid).
    with pytest.raises(ConfigurationError):
        Tool(pay, key="order")  # type: ignore[arg-type]
    assert sent == []


def test_an_agent_changed_after_it_was_made_does_not_keep_a_stale_revision() -> None:
    agent = Agent("a", "Book one seat.", [tool(_order)])
    before = agent.revision
    try:
        agent.instructions = "Book every seat on the plane."
    except (AttributeError, ConfigurationError):
        return
    assert agent.revision != before


def test_the_revision_follows_each_flag_and_the_schema() -> None:
    base = Agent("a", "i", [tool(_order)]).revision

    def _order2(order: str, qty: int = 1) -> str:
        """Act on an order."""
        return order

    changed = [
        Agent("a", "i", [tool(side_effects=False)(_order)]),
        Agent("a", "i", [tool(idempotent=True)(_order)]),
        Agent("a", "i", [tool(requires_approval=True)(_order)]),
        Agent("a", "i", [tool(key=None)(_order)]),
        Agent("a", "i", [tool(description="Other.")(_order)]),
        Agent("a", "i", [tool(name="_order")(_order2)]),
    ]
    revisions = {base, *(a.revision for a in changed)}
    assert len(revisions) == len(changed) + 1
    # Not the body, the module, nor a key function that still keys.
    same = Agent("a", "i", [tool(key=lambda **kw: "x")(_order)])
    assert same.revision == base


# --- keys after a crash, when the model asks again in another JSON spelling ----------------


def _charging(sent: list[Any]) -> Tool:
    @tool
    def charge(
        amount: int = 0,
        note: str = "",
        when: datetime.datetime | None = None,
        meta: dict[str, Any] | None = None,
    ) -> str:
        """Charge."""
        sent.append((amount, note, when, meta))
        return "charged"

    return charge


@pytest.mark.parametrize(
    ("first", "again"),
    [
        pytest.param({"amount": 5}, {"amount": 5.0}, id="int-then-float"),
        pytest.param({"amount": 5}, {"amount": "5"}, id="int-then-text"),
        pytest.param(
            {"note": "café"}, {"note": unicodedata.normalize("NFD", "café")}, id="nfc-then-nfd"
        ),
        pytest.param(
            {"when": "2024-01-01T00:00:00Z"},
            {"when": "2024-01-01T00:00:00+00:00"},
            id="z-then-offset",
        ),
        pytest.param(
            {"when": "2024-01-01T00:00:00"},
            {"when": "2024-01-01T00:00:00+00:00"},
            id="naive-then-aware",
        ),
    ],
)
async def test_a_call_asked_again_in_another_spelling_is_refused_never_sent_twice(
    tmp_path: Path, first: dict[str, Any], again: dict[str, Any]
) -> None:
    """No frontier names the call (only ``after_tool_result`` is kept, and the process
    dies before it): the retried ``run()`` asks the model again, which asks for the same
    call spelled otherwise. Its key differs, so the kit must refuse the turn (diverged),
    never charge again."""
    sent: list[Any] = []
    agent = Agent("c", "Charge.", [_charging(sent)])
    async with open_stores(f"sqlite:///{tmp_path / 'adk.sqlite3'}") as stores:
        await stores.create_schema()
        dying = faulty_runner(
            stores,
            ScriptedProvider([[("charge", first)], "done"]),
            crash_before=_after_result,
            lease_policy=FAST,
            policy=ONLY_AFTER_TOOLS,
        )
        with pytest.raises(SimulatedCrash):
            await dying.run(agent, "go", tenant=T, run_id="r")
        await asyncio.sleep(FAST.ttl + 0.2)
        runner = AgentRunner.from_stores(ScriptedProvider([[("charge", again)], "done"]), stores)
        with pytest.raises(DivergedRunError):
            await runner.run(agent, "go", tenant=T, run_id="r")
    assert len(sent) == 1


async def test_a_call_asked_again_with_its_keys_reordered_is_replayed(tmp_path: Path) -> None:
    sent: list[Any] = []
    agent = Agent("c", "Charge.", [_charging(sent)])
    first = {"amount": 5, "meta": {"b": 1, "a": [1, {"y": 2, "x": 1}]}}
    again = {"meta": {"a": [1, {"x": 1, "y": 2}], "b": 1}, "amount": 5}
    async with open_stores(f"sqlite:///{tmp_path / 'adk.sqlite3'}") as stores:
        await stores.create_schema()
        dying = faulty_runner(
            stores,
            ScriptedProvider([[("charge", first)], "done"]),
            crash_before=_after_result,
            lease_policy=FAST,
            policy=ONLY_AFTER_TOOLS,
        )
        with pytest.raises(SimulatedCrash):
            await dying.run(agent, "go", tenant=T, run_id="r")
        await asyncio.sleep(FAST.ttl + 0.2)
        runner = AgentRunner.from_stores(ScriptedProvider([[("charge", again)], "done"]), stores)
        run = await runner.run(agent, "go", tenant=T, run_id="r")
    assert run.status is RunStatus.completed
    assert len(sent) == 1


@pytest.mark.parametrize(
    "value",
    [
        pytest.param(datetime.datetime(2024, 1, 1, tzinfo=datetime.UTC), id="datetime"),
        pytest.param(decimal.Decimal("1.10"), id="decimal"),
    ],
)
async def test_arguments_that_are_not_json_are_refused_typed(value: Any) -> None:
    sent: list[Any] = []
    agent = Agent("c", "Charge.", [_charging(sent)])
    model = ScriptedProvider([[("charge", {"when": value})], "done"])
    async with open_stores("memory://") as stores:
        await stores.create_schema()
        try:
            await AgentRunner.from_stores(model, stores).run(agent, "go", tenant=T, run_id="r")
        except ConfigurationError:
            pass
        except Exception as exc:  # the defect: anything untyped
            pytest.fail(f"untyped {type(exc).__name__}: {exc}")
    assert len(sent) <= 1


# --- two real processes: revision and keys, and a SIGKILL inside a tool --------------------

AGENT_MODULE = '''
"""Tools with rich signatures, for two processes to compare (written by the test)."""
import asyncio, datetime, decimal, enum, functools, json, os, sys, time, unicodedata, uuid
from typing import Literal

import pydantic
from typing_extensions import TypedDict

from tesserix_adk import (
    Agent, AgentRunner, LeasePolicy, ScriptedProvider, Tool, ToolCall, ToolContext, tool,
)
from tesserix_adk.stores.urls import open_stores

HERE = os.path.dirname(os.path.abspath(__file__))


class Color(enum.Enum):
    red = "r"
    blue = "b"
    green = "g"


class Address(pydantic.BaseModel):
    street: str
    tags: frozenset[str] = frozenset({"home", "work", "billing", "legal"})


class Line(TypedDict):
    sku: str
    qty: int


def place(
    when: datetime.datetime, price: decimal.Decimal, order_id: uuid.UUID, color: Color,
    mode: Literal["fast", "slow"], ship_to: Address, lines: list[Line],
    note: str | None = None, *, labels: set[str] = {"urgent", "fragile", "gift", "cold"},
    extra: dict[str, int] = {"b": 1, "a": 2}, ctx: ToolContext,
) -> str:
    """Place an order (the tool writes a line per call, then sleeps while SLOW is set)."""
    with open(os.path.join(HERE, "placed.txt"), "a") as f:
        f.write(f"{ctx.idempotency_key}\\n")
    time.sleep(float(os.environ.get("SLOW", "0")))
    return "placed"


class Shop:
    def charge(self, amount: int, currency: str = "EUR") -> str:
        """Charge."""
        return "charged"

    @staticmethod
    def refund(amount: int) -> str:
        """Refund."""
        return "refunded"


class Lookup:
    def __call__(self, query: str, limit: int = 10) -> list[str]:
        return []


def _convert(amount: decimal.Decimal, rate: float) -> str:
    return "converted"


agent = Agent(
    "signatures",
    "Place orders.",
    [
        tool(place),
        tool(Shop().charge),
        tool(side_effects=False)(Shop.refund),
        Tool(Lookup(), name="lookup", side_effects=False, description="Look up. " * 500),
        Tool(functools.partial(_convert, 1), name="convert", side_effects=False),
    ],
)

CALL_ARGS = {
    "when": "2024-03-01T10:00:00+01:00",
    "price": 10.1,
    "order_id": "12345678-1234-5678-1234-567812345678",
    "color": "g",
    "mode": "slow",
    "ship_to": {"street": unicodedata.normalize("NFD", "Straße café"), "tags": ["b", "a"]},
    "lines": [{"qty": 2, "sku": "x"}, {"sku": "\\u00e9\\U0001f600", "qty": 2**70}],
    "note": None,
    "labels": ["z", "y"],
}


def describe() -> dict:
    keys = {}
    for label, args in {
        "rich": CALL_ARGS,
        "float": {"amount": 1e16, "neg": -0.0, "nan": float("nan")},
        "nested": {"b": {"d": 1, "c": [3, {"z": 1, "a": 2}]}, "a": True},
    }.items():
        call = ToolCall(id="any", name="place", arguments=args)
        keys[label] = agent.tools["place"].key_for(
            tenant="acme", run_id="r", iteration=0, call=call
        )
    return {
        "revision": agent.revision,
        "keys": keys,
        "schemas": {n: t.parameters for n, t in agent.tools.items()},
    }


PROVIDER = ScriptedProvider([[("place", CALL_ARGS), ("lookup", {"query": "q"})], "done"])


async def main(mode: str, url: str) -> None:
    async with open_stores(url) as stores:
        await stores.create_schema()
        runner = AgentRunner.from_stores(
            PROVIDER, stores, lease_policy=LeasePolicy(ttl=1, renew_within=0.5)
        )
        try:
            if mode == "run":
                run = await runner.run(agent, "Order.", tenant="acme", run_id="r")
            else:
                run = await runner.resume(agent, "r", tenant="acme")
            print(json.dumps({"status": run.status.value}))
        except Exception as exc:
            print(json.dumps({"error": type(exc).__name__, "text": str(exc)}))


if __name__ == "__main__":
    if sys.argv[1] == "describe":
        print(json.dumps(describe(), sort_keys=True))
    else:
        asyncio.run(main(sys.argv[1], sys.argv[2]))
'''


def _write_agent(tmp_path: Path) -> Path:
    module = tmp_path / "sig_agent.py"
    module.write_text(textwrap.dedent(AGENT_MODULE))
    return module


def _env(seed: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "SLOW"}
    env["PYTHONHASHSEED"] = seed
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO / "src"), *filter(None, [os.environ.get("PYTHONPATH")])]
    )
    env.update(extra)
    return env


def _python(tmp_path: Path, *args: str, seed: str, **extra: str) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-W", "ignore", str(tmp_path / "sig_agent.py"), *args],
        cwd=tmp_path,
        env=_env(seed, **extra),
        capture_output=True,
        text=True,
        timeout=HANG,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return out


def test_revision_keys_and_schemas_agree_across_processes_with_other_hash_seeds(
    tmp_path: Path,
) -> None:
    """Two real processes, different ``PYTHONHASHSEED``: the agent of rich signatures
    (Enum, Literal, datetime, Decimal, UUID, a nested model with a frozenset default,
    TypedDict, a set-of-text default, a bound method, a staticmethod, a callable object, a
    partial, a very long description) has one revision and one key per call (NFD text,
    non-BMP text, an int past 2**64, 1e16, -0.0, NaN, nested key order), and the same
    schemas."""
    _write_agent(tmp_path)
    one = _python(tmp_path, "describe", seed="1")
    two = _python(tmp_path, "describe", seed="4242")
    assert one["revision"] == two["revision"]
    assert one["keys"] == two["keys"]
    assert one["schemas"] == two["schemas"]
    assert all(k.startswith("k1:") for k in one["keys"].values())
    assert "self" not in json.dumps(one["schemas"]["charge"])
    assert list(one["schemas"]["convert"]["properties"]) == ["rate"]


MIXED_SET_MODULE = '''
import json
import pydantic
from tesserix_adk import Agent, tool


def label(tags: set[str | int] = {"urgent", "fragile", 1, 2, "gift", "cold"}) -> str:
    """Label a parcel."""
    return ""


def stamp(
    kinds: frozenset[str] = pydantic.Field(
        frozenset(), examples=[frozenset({"air", "sea", "rail", "road"})]
    ),
) -> str:
    """Stamp a parcel."""
    return ""


print(json.dumps(Agent("parcels", "Label.", [tool(label), tool(stamp)]).revision))
'''


def test_a_set_in_a_schema_keeps_the_revision_across_processes(tmp_path: Path) -> None:
    (tmp_path / "mixed.py").write_text(textwrap.dedent(MIXED_SET_MODULE))
    revisions = set()
    for seed in ("1", "2", "3", "4"):
        done = subprocess.run(
            [sys.executable, "-W", "ignore", str(tmp_path / "mixed.py")],
            cwd=tmp_path,
            env=_env(seed),
            capture_output=True,
            text=True,
            timeout=HANG,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        revisions.add(json.loads(done.stdout))
    assert len(revisions) == 1, revisions


def test_a_sigkill_inside_a_rich_call_is_refused_by_another_process_never_sent_again(
    tmp_path: Path,
) -> None:
    """One process places an order with rich arguments (NFD text, an int past 2**64, a
    float price, a UUID, nested models) and is killed with SIGKILL inside the tool; a
    second process with another hash seed re-keys the call from the frontier and finds
    the claim in flight: it refuses, naming the call, and places nothing again."""
    _write_agent(tmp_path)
    url = f"sqlite:///{tmp_path / 'adk.sqlite3'}"
    placed = tmp_path / "placed.txt"
    proc = subprocess.Popen(
        [sys.executable, "-W", "ignore", str(tmp_path / "sig_agent.py"), "run", url],
        cwd=tmp_path,
        env=_env("7", SLOW="60"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + HANG
        while not (placed.exists() and placed.read_text().strip()):
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the tool never started"
            time.sleep(0.05)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.communicate()
    (key,) = placed.read_text().split()
    time.sleep(FAST.ttl + 0.3)  # the dead process's lease lapses
    resumed = _python(tmp_path, "resume", url, seed="99")
    assert resumed.get("error") == "IndeterminateToolCallError", resumed
    assert placed.read_text().split() == [key]
    # The key the second process would give the call is the one the tool was sent.
    described = _python(tmp_path, "describe", seed="123")
    assert described["keys"]["rich"] == key
