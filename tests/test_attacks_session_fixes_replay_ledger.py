"""An attacker's look at this morning's fixes to replay (stubs called with the tool's
validated arguments, ``stubs``/``live`` checked) and to spend (a resumed run, ``inspect``,
``show`` and the console read micros AND tokens from the ledger, ``LedgerTotals``).

Defects found (each a strict xfail asserting the promised behaviour):

1. MEDIUM ``test_a_replays_run_and_every_view_of_it_tell_the_same_spend``: a replay's
   state starts from the step's figures (``replay_state``: usage and micros of the step),
   its ledger from nothing. ``Run.usage``/``spent_micros`` (and the frontier) say what the
   original spent up to the step plus what the replay spent; ``inspect``, ``inspect
   --json``, ``show --json`` and the console, now reading both figures from the ledger, say
   only the replay's own. The same completed run is told with two different spends.
2. MEDIUM ``test_live_given_as_none_is_a_typed_refusal``: ``live=None`` (an Optional left
   unset) is a bare ``TypeError: 'NoneType' object is not iterable`` from ``check_stubs``,
   not the ``ConfigurationError`` a bad replay gets.
3. MEDIUM ``test_live_given_as_a_generator_naming_the_tool_is_not_refused_as_unnamed``:
   ``live=(n for n in ["pay"])`` is consumed by the "all names are text" check, so the
   later ``set(live)`` is empty and the replay is refused with the false sentence "pay
   ... neither stubbed nor named in live".
4. LOW ``test_a_stub_the_check_accepts_is_called_not_failed_on_its_signature``: a builtin
   callable (``dict``, which takes the keyword arguments fine) passes the "can be called"
   check, but ``invoke`` asks ``inspect.signature`` whether it takes ``ctx`` and that
   raises: the model is told the call failed with ``ValueError: no signature found``, the
   stub never ran.
5. LOW ``test_a_stream_does_not_tell_a_refused_usage_as_a_clean_call_of_no_tokens``: an
   answer whose ``usage`` is not a ``Usage`` is refused (typed) after ``loop._asked``
   emitted ``ModelCallFinished`` with ``error=None`` and 0 tokens: a stream (and the span
   made from it) tells a clean call that cost nothing.

What held (plain tests): stubs as a ``Mapping`` subclass, a ``functools.partial`` and a bound
method are called with validated arguments; ``live`` as a tuple, set or dict of names is
accepted, and odd ``stubs``/``live`` types (list, None, bytes, bytearray, a non-callable)
are ``ConfigurationError`` with nothing sent; a stub that gets a pydantic model with a
password and a ``SecretStr``, a datetime and an enum and returns them writes JSON and no
secret reaches the SQLite file or a Redis key; a masked call in a parallel turn reaches its
stub with the arguments as stored while its unmasked sibling gets validated ones; a run
resumed after an approval wait on a ledger with no ``totals`` (a wrapper exposing only the
protocol) counts the same figures as one with it.
"""

from __future__ import annotations

import argparse
import collections.abc
import contextlib
import datetime
import enum
import functools
import io
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel, SecretStr

from adapters import services
from tesserix_adk import (
    Agent,
    AgentRunner,
    ConfigurationError,
    RunStatus,
    ScriptedProvider,
    ScriptedTurn,
    open_stores,
    tool,
)
from tesserix_adk.cli.inspecting import run_inspect
from tesserix_adk.cli.show import story
from tesserix_adk.console.reads import run_detail
from tesserix_adk.messages import Usage
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.stores.protocols import LedgerTotals

T = "acme"
ORIG = "orig-r5"
SECRET = "ghp_" + "Z9y8X7w6V5u4T3s2R1q0P9o8N7m6L5k4J3i2"
PASSWORD = "hunter2-pw-Q7xK"


class Shop:
    """``look`` (read-only) and ``pay`` (side-effecting), counting real payments."""

    def __init__(self, *, approval: bool = False) -> None:
        self.paid: list[Any] = []
        self.approval = approval

    def agent(self, budget: int | None = None) -> Agent:
        @tool(side_effects=False)
        def look(order: str) -> dict[str, Any]:
            """Read an order."""
            return {"order": order}

        @tool(requires_approval=self.approval)
        def pay(order: str, amount: int) -> dict[str, Any]:
            """Pay (the real thing)."""
            self.paid.append((order, amount))
            return {"paid": amount}

        return Agent("shop", "Pay for orders.", [look, pay], budget_micros=budget)


def turns(amount: Any = 40) -> list[ScriptedTurn]:
    return [
        ScriptedTurn(
            calls=[("look", {"order": "o-1"})],
            usage=Usage(input_tokens=100, output_tokens=10),
            cost_micros=100,
        ),
        ScriptedTurn(
            calls=[("pay", {"order": "o-1", "amount": amount})],
            usage=Usage(input_tokens=200, output_tokens=20),
            cost_micros=200,
        ),
        ScriptedTurn(text="done", usage=Usage(input_tokens=300, output_tokens=30), cost_micros=300),
    ]


def runner(stores: Stores, provider: Any = None, **kw: Any) -> AgentRunner:
    return AgentRunner.from_stores(provider or ScriptedProvider(turns()), stores, worker="w5", **kw)


@contextlib.asynccontextmanager
async def backend(kind: str, tmp_path: Path) -> AsyncIterator[tuple[Stores, str]]:
    """Stores of one backend and a tag naming where their bytes are (file or key prefix)."""
    if kind == "sqlite":
        path = str(tmp_path / "adk.sqlite3")
        async with open_stores(f"sqlite:///{path}") as stores:
            await stores.create_schema()
            yield stores, path
        return
    from tesserix_adk.adapters.redis import open_redis_stores

    client = await services.redis_client()
    prefix = services.redis_prefix()
    stores = open_redis_stores(
        services.with_query(services.REDIS_URL, prefix=prefix, allow_volatile="true")
    )
    try:
        yield stores, prefix
    finally:
        await stores.aclose()
        await services.delete_prefixed(client, prefix)
        await client.aclose()


def sqlite_bytes(tmp_path: Path) -> str:
    return "".join(p.read_bytes().decode("latin-1") for p in tmp_path.glob("adk.sqlite3*"))


async def raw_bytes(kind: str, tag: str, tmp_path: Path) -> str:
    """Everything the backend holds, as text: the SQLite file and its journal, or every
    key and value under the Redis prefix."""
    if kind == "sqlite":
        return sqlite_bytes(tmp_path)
    client = await services.redis_client()
    try:
        parts: list[str] = []
        async for key in client.scan_iter(match=f"{tag}*"):
            parts.append(key.decode("latin-1"))
            kind_ = (await client.type(key)).decode()
            if kind_ == "string":
                parts.append(repr(await client.get(key)))
            elif kind_ == "hash":
                parts.append(repr(await client.hgetall(key)))
            elif kind_ == "list":
                parts.append(repr(await client.lrange(key, 0, -1)))
            elif kind_ == "set":
                parts.append(repr(await client.smembers(key)))
            elif kind_ == "zset":
                parts.append(repr(await client.zrange(key, 0, -1, withscores=True)))
            elif kind_ == "stream":
                parts.append(repr(await client.xrange(key)))
        return "\n".join(parts)
    finally:
        await client.aclose()


async def original(stores: Stores, shop: Shop) -> None:
    run = await runner(stores).run(shop.agent(), "pay o-1", tenant=T, run_id=ORIG)
    assert run.status is RunStatus.completed
    assert shop.paid == [("o-1", 40)]


async def step_with(stores: Stores, name: str) -> int:
    """The step whose outstanding calls include ``name``."""
    checkpoints = runner(stores).checkpoints
    assert checkpoints is not None
    for step in await stores.checkpoints.steps(T, ORIG):
        cp = await checkpoints.at(T, ORIG, step)
        if cp is not None and any(oc.call.name == name for oc in cp.outstanding):
            return step
    raise AssertionError(f"no step holds {name}")


async def inspect_json(stores: Stores, run_id: str) -> dict[str, Any]:
    out = io.StringIO()
    await run_inspect(argparse.Namespace(tenant=T, run=run_id, json=True), stores, out)
    found: dict[str, Any] = json.loads(out.getvalue())
    return found


async def inspect_text(stores: Stores, run_id: str) -> str:
    out = io.StringIO()
    await run_inspect(argparse.Namespace(tenant=T, run=run_id, json=False), stores, out)
    return out.getvalue()


# --- defect: a replay's spend told two ways -----------------------------------------------


@pytest.mark.parametrize("kind", ["sqlite", "redis"])
async def test_a_replays_run_and_every_view_of_it_tell_the_same_spend(
    kind: str, tmp_path: Path
) -> None:
    async with backend(kind, tmp_path) as (stores, _):
        shop = Shop()
        await original(stores, shop)
        step = await step_with(stores, "pay")
        run = await runner(stores).replay(
            shop.agent(),
            ORIG,
            tenant=T,
            from_step=step,
            stubs={"pay": lambda order, amount: {"ok": amount}},
            new_run_id="rep-views",
        )
        assert run.status is RunStatus.completed
        assert shop.paid == [("o-1", 40)]  # the stub stood in
        told = {
            "Run": (run.spent_micros, run.usage.input_tokens, run.usage.output_tokens),
        }
        found = await inspect_json(stores, "rep-views")
        told["inspect --json"] = (
            found["spent_micros"],
            found["usage"]["input_tokens"],
            found["usage"]["output_tokens"],
        )
        shown = await story(stores, T, "rep-views", step=None)
        told["show --json"] = (
            shown["spent"]["micros"],
            shown["spent"]["input_tokens"],
            shown["spent"]["output_tokens"],
        )
        detail = await run_detail(stores, T, "rep-views")
        assert detail is not None
        told["console"] = (detail.spent, detail.usage.input_tokens, detail.usage.output_tokens)
        text = await inspect_text(stores, "rep-views")
        line = next(ln for ln in text.splitlines() if ln.startswith("iteration"))
        words = line.split()
        told["inspect"] = (int(words[6]), int(words[2]), int(words[4]))
    assert len(set(told.values())) == 1, f"one run, several spends: {told}"


# --- defects: odd ``live`` and stubs ------------------------------------------------------


async def test_live_given_as_none_is_a_typed_refusal(tmp_path: Path) -> None:
    async with backend("sqlite", tmp_path) as (stores, _):
        shop = Shop()
        await original(stores, shop)
        try:
            await runner(stores).replay(
                shop.agent(),
                ORIG,
                tenant=T,
                from_step=1,
                stubs={"pay": lambda order, amount: {}},
                live=None,  # type: ignore[arg-type]
            )
        except ConfigurationError:
            pass
        except Exception as exc:
            pytest.fail(f"untyped: {type(exc).__name__}: {exc}")
        assert shop.paid == [("o-1", 40)]


async def test_live_given_as_a_generator_naming_the_tool_is_not_refused_as_unnamed(
    tmp_path: Path,
) -> None:
    async with backend("sqlite", tmp_path) as (stores, _):
        shop = Shop()
        await original(stores, shop)
        refused = None
        try:
            run = await runner(stores).replay(
                shop.agent(),
                ORIG,
                tenant=T,
                from_step=1,
                stubs={},
                live=(name for name in ["pay"]),
            )
        except ConfigurationError as exc:
            refused = str(exc)
        # Either taken as named (pay live, as asked), or refused for what it is (not a
        # list): never "neither stubbed nor named in live" about a tool it names.
        assert refused is None or "named in live" not in refused, refused
        if refused is None:
            assert run.status is RunStatus.completed


async def test_a_stub_the_check_accepts_is_called_not_failed_on_its_signature(
    tmp_path: Path,
) -> None:
    async with backend("sqlite", tmp_path) as (stores, _):
        shop = Shop()
        await original(stores, shop)
        step = await step_with(stores, "pay")
        outcome: Any = None
        with contextlib.suppress(ConfigurationError):  # refused up front: fine too
            await runner(stores).replay(
                shop.agent(),
                ORIG,
                tenant=T,
                from_step=step,
                stubs={"pay": dict},
                new_run_id="rep-dict",
            )
            records = await stores.idempotency.records(T, "rep-dict")
            outcome = [r.outcome for r in records if r.outcome is not None]
            outcome = [json.loads(o)["content"] for o in outcome]
            assert {"order": "o-1", "amount": 40, "stub": True} in outcome, outcome
        assert shop.paid == [("o-1", 40)]


# --- held: odd stubs and live that work, and those refused typed --------------------------


class Stubs(collections.abc.Mapping[str, Any]):
    def __init__(self, inner: dict[str, Any]) -> None:
        self._inner = inner

    def __getitem__(self, key: str) -> Any:
        return self._inner[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._inner)

    def __len__(self) -> int:
        return len(self._inner)


class Teller:
    def __init__(self) -> None:
        self.got: list[Any] = []

    def pay(self, order: str, amount: int) -> dict[str, Any]:
        self.got.append(amount)
        return {"told": amount}


async def test_mapping_partial_and_bound_method_stubs_get_validated_arguments(
    tmp_path: Path,
) -> None:
    async with backend("sqlite", tmp_path) as (stores, _):
        shop = Shop()
        run = await runner(stores, ScriptedProvider(turns(amount="40"))).run(
            shop.agent(), "go", tenant=T, run_id=ORIG
        )
        assert run.status is RunStatus.completed
        step = await step_with(stores, "pay")
        got: list[Any] = []

        def tagged(tag: str, order: str, amount: int) -> dict[str, Any]:
            got.append((tag, amount))
            return {}

        teller = Teller()
        for i, stubs in enumerate(
            [
                Stubs({"pay": lambda order, amount: got.append(("map", amount)) or {}}),
                {"pay": functools.partial(tagged, "partial")},
                {"pay": teller.pay},
            ]
        ):
            rep = await runner(stores, ScriptedProvider(turns(amount="40"))).replay(
                shop.agent(), ORIG, tenant=T, from_step=step, stubs=stubs, new_run_id=f"m{i}"
            )
            assert rep.status is RunStatus.completed
        assert got == [("map", 40), ("partial", 40)]
        assert teller.got == [40]
        assert shop.paid == [("o-1", 40)]


@pytest.mark.parametrize(
    ("stubs", "live"),
    [
        pytest.param([("pay", lambda **kw: {})], (), id="stubs-list"),
        pytest.param(None, (), id="stubs-none"),
        pytest.param({"pay": "module:attr"}, (), id="stub-text"),
        pytest.param({}, b"pay", id="live-bytes"),
        pytest.param({}, bytearray(b"pay"), id="live-bytearray"),
        pytest.param({}, ["pay", 3], id="live-not-text"),
        pytest.param({}, ["pay", "refund"], id="live-unknown"),
    ],
)
async def test_odd_stubs_and_live_are_refused_typed_and_send_nothing(
    stubs: Any, live: Any, tmp_path: Path
) -> None:
    async with backend("sqlite", tmp_path) as (stores, _):
        shop = Shop()
        await original(stores, shop)
        with pytest.raises(ConfigurationError):
            await runner(stores).replay(
                shop.agent(), ORIG, tenant=T, from_step=1, stubs=stubs, live=live
            )
        assert shop.paid == [("o-1", 40)]
        assert await stores.checkpoints.latest(T, f"{ORIG}-x") is None


@pytest.mark.parametrize(
    "live",
    [("pay",), {"pay"}, {"pay": True}],
    ids=["tuple", "set", "dict"],
)
async def test_live_as_a_collection_of_names_sends_the_named_tool(
    live: Any, tmp_path: Path
) -> None:
    async with backend("sqlite", tmp_path) as (stores, _):
        shop = Shop()
        await original(stores, shop)
        step = await step_with(stores, "pay")
        run = await runner(stores).replay(
            shop.agent(), ORIG, tenant=T, from_step=step, stubs={}, live=live
        )
        assert run.status is RunStatus.completed
        assert shop.paid == [("o-1", 40), ("o-1", 40)]  # named live: sent, as asked


# --- held: validated arguments of rich types reach the stub and are stored as JSON ---------


class Color(enum.Enum):
    red = "red"


class Card(BaseModel):
    holder: str
    password: str
    token: SecretStr


def card_agent(paid: list[Any]) -> Agent:
    @tool(side_effects=False)
    def look(order: str) -> dict[str, Any]:
        """Read."""
        return {"order": order}

    @tool
    def charge(order: str, card: Card, when: datetime.datetime, color: Color) -> dict[str, Any]:
        """Charge a card."""
        paid.append(order)
        return {"ok": True}

    return Agent("cards", "Charge cards.", [look, charge])


CARD_ARGS = {
    "order": "o-1",
    "card": {"holder": "ann", "password": PASSWORD, "token": SECRET},
    "when": "2026-01-02T03:04:05Z",
    "color": "red",
}


@pytest.mark.parametrize("kind", ["sqlite", "redis"])
async def test_a_stub_returning_its_model_datetime_and_enum_arguments_stores_json_masked(
    kind: str, tmp_path: Path
) -> None:
    def provider() -> ScriptedProvider:
        return ScriptedProvider([[("look", {"order": "o-1"})], [("charge", CARD_ARGS)], "done"])

    async with backend(kind, tmp_path) as (stores, tag):
        paid: list[Any] = []
        run = await runner(stores, provider()).run(card_agent(paid), "go", tenant=T, run_id=ORIG)
        assert run.status is RunStatus.completed
        seen: list[Any] = []

        def echo(order: str, card: Card, when: Any, color: Any) -> dict[str, Any]:
            seen.append((type(card), type(when), color))
            return {"card": card, "when": when, "color": color}

        rep = await runner(stores, provider()).replay(
            card_agent(paid), ORIG, tenant=T, from_step=1, stubs={"charge": echo}, new_run_id="rc"
        )
        assert rep.status is RunStatus.completed
        assert seen == [(Card, datetime.datetime, Color.red)]
        assert paid == ["o-1"]
        records = await stores.idempotency.records(T, "rc")
        contents = [json.loads(r.outcome)["content"] for r in records if r.outcome is not None]
        card = next(c for c in contents if isinstance(c, dict) and "card" in c)
        assert card["stub"] is True
        assert card["when"] == "2026-01-02T03:04:05Z" and card["color"] == "red"
        assert card["card"]["holder"] == "ann"
        everything = await raw_bytes(kind, tag, tmp_path)
    assert PASSWORD not in everything
    assert SECRET not in everything


# --- held: a masked call in a parallel turn gets its arguments as stored -----------------


async def test_a_masked_call_in_a_parallel_turn_gets_stored_arguments_its_sibling_validated(
    tmp_path: Path,
) -> None:
    @tool
    def send(to: str, body: str, copies: int = 1) -> dict[str, Any]:
        """Send a message."""
        sent.append((to, body))
        return {"sent": True}

    sent: list[Any] = []
    agent = Agent("mail", "Send.", [send], parallel_tool_calls=2)
    turn = [
        ("send", {"to": "a", "body": f"key {SECRET}", "copies": "2"}),
        ("send", {"to": "b", "body": "hello", "copies": "3"}),
    ]
    async with backend("sqlite", tmp_path) as (stores, _):
        checkpoints = runner(stores).checkpoints
        assert checkpoints is not None
        run = await runner(stores, ScriptedProvider([turn, "done"])).run(
            agent, "go", tenant=T, run_id=ORIG
        )
        assert run.status is RunStatus.completed
        assert len(sent) == 2
        step = None
        for s in await stores.checkpoints.steps(T, ORIG):
            cp = await checkpoints.at(T, ORIG, s)
            if cp is not None and len(cp.outstanding) == 2:
                step, masked = s, [oc.redacted for oc in cp.outstanding]
        assert step is not None and masked == [True, False], masked
        got: list[Any] = []

        def stub(to: str, body: Any, copies: Any) -> dict[str, Any]:
            got.append((to, body, copies))
            return {}

        rep = await runner(stores, ScriptedProvider([turn, "done"])).replay(
            agent, ORIG, tenant=T, from_step=step, stubs={"send": stub}, new_run_id="rp"
        )
        assert rep.status is RunStatus.completed
    assert len(sent) == 2
    by_to = dict((to, (body, copies)) for to, body, copies in got)
    assert SECRET not in repr(by_to["a"]) and by_to["a"][1] == "2"  # as stored, masked
    assert by_to["b"] == ("hello", 3)  # validated


# --- held: a ledger without totals counts what one with it counts --------------------------


class PlainLedger:
    """The ``Ledger`` protocol only (no ``totals``), over a real ledger."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    async def charge(self, *a: Any, **kw: Any) -> None:
        await self._inner.charge(*a, **kw)

    async def spent(self, tenant: str, run_id: str) -> int:
        return int(await self._inner.spent(tenant, run_id))

    async def usage(self, tenant: str, run_id: str) -> Usage:
        return await self._inner.usage(tenant, run_id)  # type: ignore[no-any-return]

    async def seal(self, tenant: str, run_id: str, fence: int) -> None:
        await self._inner.seal(tenant, run_id, fence)


@pytest.mark.parametrize("kind", ["sqlite", "redis"])
async def test_a_resume_counts_the_same_with_or_without_ledger_totals(
    kind: str, tmp_path: Path
) -> None:
    async with backend(kind, tmp_path) as (stores, _):
        assert isinstance(stores.ledger, LedgerTotals)
        assert not isinstance(PlainLedger(stores.ledger), LedgerTotals)
        results = []
        for i, ledger in enumerate([stores.ledger, PlainLedger(stores.ledger)]):
            shop = Shop(approval=True)
            rid = f"appr-{i}"

            def make(ledger: Any = ledger) -> AgentRunner:
                return AgentRunner(
                    ScriptedProvider(turns()),
                    idempotency=stores.idempotency,
                    checkpoints=runner(stores).checkpoints,
                    leases=stores.leases,
                    ledger=ledger,
                    approvals=stores.approvals,
                    worker="w5",
                )

            run = await make().run(shop.agent(), "go", tenant=T, run_id=rid)
            assert run.status is RunStatus.waiting_approval and run.pending_approval
            await stores.approvals.decide(T, run.pending_approval.id, approved=True, by="ann")
            done = await make().resume(shop.agent(), rid, tenant=T)
            assert done.status is RunStatus.completed
            results.append(
                (done.spent_micros, done.usage, await stores.ledger.spent(T, rid), shop.paid)
            )
    assert (
        results[0]
        == results[1]
        == (600, Usage(input_tokens=600, output_tokens=60), 600, [("o-1", 40)])
    )


# --- defect: a refused usage told as a clean model call ------------------------------------


class DictUsage:
    """A provider whose answer carries its usage as a dict, not a ``Usage``."""

    async def complete(self, request: Any) -> Any:
        from tesserix_adk.messages import Message
        from tesserix_adk.providers.base import ModelResponse

        return ModelResponse(
            message=Message.assistant("hi"),
            usage={"input_tokens": 3, "output_tokens": 1},  # type: ignore[arg-type]
            cost_micros=5,
        )


async def test_a_stream_does_not_tell_a_refused_usage_as_a_clean_call_of_no_tokens(
    tmp_path: Path,
) -> None:
    from tesserix_adk.run.events import ModelCallFinished

    @tool(side_effects=False)
    def look(q: str) -> str:
        """Look."""
        return q

    async with backend("sqlite", tmp_path) as (stores, _):
        events = [
            ev
            async for ev in runner(stores, DictUsage()).stream(
                Agent("a", "x", [look]), "go", tenant=T, run_id="s-usage"
            )
        ]
        assert await stores.ledger.spent(T, "s-usage") == 0
    finished = [ev for ev in events if isinstance(ev, ModelCallFinished)]
    assert finished, events
    assert finished[-1].error is not None, f"told as a clean call: {finished[-1]}"
