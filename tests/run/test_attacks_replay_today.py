"""Attacks on replay (``AgentRunner.replay``) after today's dispatch change (arguments
validated by ``Tool.invalid_arguments`` only once a call's record says it is to go out).

Defect (was a strict xfail; fixed since, its test plain: a call whose arguments the
replayed step kept masked goes to its stub unjudged by the tool's validation,
``Attempt.masked_calls``, while one refused as invalid at the original is refused alike):

* ``test_masked_argument_reaches_the_stub_replay_demanded``: a step whose call's arguments
  were masked must be stubbed (``replay.usable_step``), yet ``dispatch._call_tool`` runs
  ``_invalid`` on the masked arguments before ``invoking.invoke`` consults the stub; a
  tool whose schema constrains the masked string (a pattern) refuses the call, the stub is
  never called, and the model is told "invalid arguments" about a call that went out fine
  in the original. Nothing is sent twice; the replay silently diverges.

Promises that held (plain tests, memory and SQLite):

* no stub, no ``live`` for a side-effecting tool: refused before anything runs, nothing
  written under the original or the new id, nothing sent;
* a stub that raises, returns unencodable data, or has another signature: an error/str
  outcome told to the model, the real tool untouched;
* a stub raising ``ToolOutcomeUnknownError``: the replay stops, the original untouched;
* the same ``new_run_id`` twice: the second replay is refused, its stub never called;
* a call refused at the original (cut off, invalid arguments): refused alike at the
  replay, its stub unused, the refusal recorded under the replay's own key;
* a replay while a live worker carries the original (inside its side-effecting call): the
  original's lease and records are untouched, and the original finishes, sending once;
* a corrupt recorded outcome under a business key of the original: never read by the
  replay, which records under a key of its own.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Annotated, Any

import pytest
from pydantic import Field

from tesserix_adk import (
    Agent,
    AgentRunner,
    Checkpointer,
    ConfigurationError,
    RunStatus,
    ToolCall,
    tool,
)
from tesserix_adk.messages import REFUSED_ARGUMENTS
from tesserix_adk.stores.bundle import Stores

from .helpers import Asks, answers, fresh_stores

pytestmark = pytest.mark.parametrize("where", ["memory", "sqlite"])


def runner_of(stores: Stores, provider: Any) -> AgentRunner:
    return AgentRunner(
        provider,
        idempotency=stores.idempotency,
        checkpoints=Checkpointer(stores.checkpoints, history=stores.history),
        leases=stores.leases,
        ledger=stores.ledger,
        approvals=stores.approvals,
        work=stores.work,
    )


class Shop:
    """A side-effecting ``refund`` that counts real sends."""

    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []
        self.gate: asyncio.Event | None = None
        self.entered = asyncio.Event()

    def agent(self) -> Agent:
        @tool(side_effects=False)
        def look(order: str) -> dict[str, Any]:
            """Read an order."""
            return {"order": order, "total": 40}

        @tool
        async def refund(order: str, amount: int) -> dict[str, Any]:
            """Refund money (the real thing)."""
            self.entered.set()
            if self.gate is not None:
                await self.gate.wait()
            self.sent.append({"order": order, "amount": amount})
            return {"refunded": amount}

        return Agent("shop", "Refund.", [look, refund])


def turns(refund_args: dict[str, Any] | None = None) -> Asks:
    return Asks(
        [ToolCall(id="c-look", name="look", arguments={"order": "o-1"})],
        [
            ToolCall(
                id="c-refund",
                name="refund",
                arguments=refund_args or {"order": "o-1", "amount": 40},
            )
        ],
        "done",
    )


async def step_before(stores: Stores, run_id: str, name: str) -> int:
    """The step whose outstanding calls include one to ``name``."""
    cps = Checkpointer(stores.checkpoints, history=stores.history)
    for step in await stores.checkpoints.steps("acme", run_id):
        cp = await cps.at("acme", run_id, step)
        if cp is not None and any(oc.call.name == name for oc in cp.outstanding):
            return step
    raise AssertionError(f"no step holds a call to {name}")


async def original(stores: Stores, run_id: str) -> list[Any]:
    steps = await stores.checkpoints.steps("acme", run_id)
    return [
        await stores.checkpoints.latest("acme", run_id),
        steps,
        [await stores.checkpoints.at("acme", run_id, s) for s in steps],
        await stores.idempotency.records("acme", run_id),
    ]


async def _original_run(stores: Stores, shop: Shop, provider: Any) -> None:
    run = await runner_of(stores, provider).run(shop.agent(), "go", tenant="acme", run_id="r")
    assert run.status is RunStatus.completed


# --- promises that held ---------------------------------------------------------------


async def test_no_stub_no_live_refuses_before_anything(where: str, tmp_path: Path) -> None:
    async with fresh_stores(where, tmp_path) as stores:
        shop = Shop()
        await _original_run(stores, shop, turns())
        assert len(shop.sent) == 1
        step = await step_before(stores, "r", "look")
        before = await original(stores, "r")
        replayer = runner_of(stores, turns())
        with pytest.raises(ConfigurationError, match="neither stubbed nor named in live"):
            await replayer.replay(
                shop.agent(), "r", tenant="acme", from_step=step, stubs={}, new_run_id="x"
            )
        assert len(shop.sent) == 1
        assert await original(stores, "r") == before
        assert await stores.checkpoints.latest("acme", "x") is None
        assert await stores.idempotency.records("acme", "x") == []


async def _replay(
    stores: Stores, shop: Shop, stub: Any, *, provider: Any = None, new: str = "x"
) -> tuple[Any, Any]:
    provider = provider or turns()
    step = await step_before(stores, "r", "refund")
    from .helpers import Recording

    rec = Recording(provider)
    run = await runner_of(stores, rec).replay(
        shop.agent(), "r", tenant="acme", from_step=step, stubs={"refund": stub}, new_run_id=new
    )
    return run, rec


def _told(rec: Any) -> str:
    [told] = answers(rec.requests[-1], "refund")
    return str(told.content)


async def test_stub_that_raises_is_an_error_outcome(where: str, tmp_path: Path) -> None:
    async with fresh_stores(where, tmp_path) as stores:
        shop = Shop()
        await _original_run(stores, shop, turns())

        def boom(order: str, amount: int) -> Any:
            raise RuntimeError("stub exploded")

        run, rec = await _replay(stores, shop, boom)
        assert run.status is RunStatus.completed
        assert "stub exploded" in _told(rec)
        assert len(shop.sent) == 1


async def test_stub_with_unencodable_result(where: str, tmp_path: Path) -> None:
    async with fresh_stores(where, tmp_path) as stores:
        shop = Shop()
        await _original_run(stores, shop, turns())

        class Opaque:
            def __repr__(self) -> str:
                return "<opaque>"

        run, rec = await _replay(stores, shop, lambda order, amount: {"x": Opaque(), 1: {2}})
        assert run.status is RunStatus.completed
        assert "opaque" in _told(rec) or "<" in _told(rec)
        assert len(shop.sent) == 1


async def test_stub_with_other_signature_is_an_error(where: str, tmp_path: Path) -> None:
    async with fresh_stores(where, tmp_path) as stores:
        shop = Shop()
        await _original_run(stores, shop, turns())
        run, rec = await _replay(stores, shop, lambda flight: {"ok": True})
        assert run.status is RunStatus.completed
        assert "TypeError" in _told(rec)
        assert len(shop.sent) == 1


async def test_same_new_run_id_twice_refused(where: str, tmp_path: Path) -> None:
    async with fresh_stores(where, tmp_path) as stores:
        shop = Shop()
        await _original_run(stores, shop, turns())
        calls: list[Any] = []
        await _replay(stores, shop, lambda **kw: calls.append(kw) or {"ok": 1})
        with pytest.raises(ConfigurationError, match="already exists"):
            await _replay(stores, shop, lambda **kw: calls.append(kw) or {"ok": 1})
        assert len(calls) == 1 and len(shop.sent) == 1


# --- masked arguments, validation, refusals at the original ---------------------------


class Vault:
    def __init__(self) -> None:
        self.sent: list[Any] = []

    def agent(self) -> Agent:
        @tool
        def charge(order: str, token: Annotated[str, Field(pattern=r"^tok_")]) -> str:
            """Charge with a numeric token (the real thing)."""
            self.sent.append(token)
            return "charged"

        return Agent("vault", "Charge.", [charge])


async def test_masked_argument_reaches_the_stub_replay_demanded(where: str, tmp_path: Path) -> None:
    async with fresh_stores(where, tmp_path) as stores:
        vault = Vault()
        asks = Asks(
            [
                ToolCall(
                    id="c1",
                    name="charge",
                    arguments={"order": "o-1", "token": "tok_live_abcdef123456"},
                )
            ],
            "done",
        )
        run = await runner_of(stores, asks).run(vault.agent(), "go", tenant="acme", run_id="r")
        assert run.status is RunStatus.completed and vault.sent == ["tok_live_abcdef123456"]
        step = await step_before(stores, "r", "charge")
        cp = await Checkpointer(stores.checkpoints, history=stores.history).at("acme", "r", step)
        assert cp is not None and cp.outstanding[0].redacted
        got: list[Any] = []
        from .helpers import Recording

        rec = Recording(
            Asks(
                [
                    ToolCall(
                        id="c1",
                        name="charge",
                        arguments={"order": "o-1", "token": "tok_live_abcdef123456"},
                    )
                ],
                "done",
            )
        )
        replayed = await runner_of(stores, rec).replay(
            vault.agent(),
            "r",
            tenant="acme",
            from_step=step,
            stubs={"charge": lambda **kw: got.append(kw) or "stubbed"},
            new_run_id="x",
        )
        assert replayed.status is RunStatus.completed
        assert vault.sent == ["tok_live_abcdef123456"]
        [told] = answers(rec.requests[-1], "charge")
        assert got, f"stub never called; model told {told.content!r}"


async def test_refused_cut_off_call_stays_refused_and_stub_unused(
    where: str, tmp_path: Path
) -> None:
    async with fresh_stores(where, tmp_path) as stores:
        shop = Shop()
        cut = {REFUSED_ARGUMENTS: "nested too deep"}
        await _original_run(stores, shop, turns(cut))
        assert shop.sent == []
        got: list[Any] = []
        run, rec = await _replay(
            stores, shop, lambda **kw: got.append(kw) or {"ok": 1}, provider=turns(cut)
        )
        assert run.status is RunStatus.completed
        assert got == [] and shop.sent == []
        assert _told(rec).startswith("not sent: nested too deep")


async def test_invalid_at_original_is_refused_alike_at_replay(where: str, tmp_path: Path) -> None:
    async with fresh_stores(where, tmp_path) as stores:
        shop = Shop()
        bad = {"order": "o-1", "amount": "forty"}
        await _original_run(stores, shop, turns(bad))
        assert shop.sent == []
        got: list[Any] = []
        run, rec = await _replay(
            stores, shop, lambda **kw: got.append(kw) or {"ok": 1}, provider=turns(bad)
        )
        assert run.status is RunStatus.completed
        assert got == [] and shop.sent == []
        assert _told(rec).startswith("invalid arguments for refund")
        # nothing is recorded for a refused call: its claim goes
        assert [
            r for r in await stores.idempotency.records("acme", "x") if r.tool == "refund"
        ] == []


async def test_replay_while_original_is_carried_leaves_its_lease(
    where: str, tmp_path: Path
) -> None:
    async with fresh_stores(where, tmp_path) as stores:
        shop = Shop()
        shop.gate = asyncio.Event()
        carrier = asyncio.create_task(
            runner_of(stores, turns()).run(shop.agent(), "go", tenant="acme", run_id="r")
        )
        await asyncio.wait_for(shop.entered.wait(), 5)
        lease = await stores.leases.current("acme", "r")
        assert lease is not None
        records = await stores.idempotency.records("acme", "r")
        got: list[Any] = []
        run, _ = await _replay(stores, shop, lambda **kw: got.append(kw) or {"ok": 1})
        assert run.status is RunStatus.completed and len(got) == 1
        assert await stores.leases.current("acme", "r") == lease
        assert await stores.idempotency.records("acme", "r") == records
        shop.gate.set()
        done = await asyncio.wait_for(carrier, 5)
        assert done.status is RunStatus.completed
        assert shop.sent == [{"order": "o-1", "amount": 40}]


class Keyed:
    """A refund keyed by the business object: the replay shares the key's text."""

    def __init__(self) -> None:
        self.sent: list[Any] = []

    def agent(self) -> Agent:
        @tool(key=lambda **kw: f"order-{kw['arguments']['order']}")
        def refund(order: str, amount: int) -> dict[str, Any]:
            """Refund money (the real thing)."""
            self.sent.append(order)
            return {"refunded": amount}

        return Agent("keyed", "Refund.", [refund])


async def test_corrupt_original_record_is_never_read_by_replay(where: str, tmp_path: Path) -> None:
    if where != "sqlite":
        pytest.skip("corrupts the SQLite file's record")
    async with fresh_stores(where, tmp_path) as stores:
        keyed = Keyed()
        asks = Asks(
            [ToolCall(id="c1", name="refund", arguments={"order": "o-1", "amount": 40})], "done"
        )
        run = await runner_of(stores, asks).run(keyed.agent(), "go", tenant="acme", run_id="r")
        assert run.status is RunStatus.completed and keyed.sent == ["o-1"]
        from .helpers import database_of

        db = database_of(stores)
        import sqlite3

        with sqlite3.connect(db.path) as con:  # type: ignore[attr-defined]
            n = con.execute(
                "UPDATE adk_idempotency SET outcome = ? WHERE run_id = 'r' AND outcome IS NOT NULL",
                (b"\x00not json",),
            ).rowcount
        assert n >= 1
        step = await step_before(stores, "r", "refund")
        got: list[Any] = []
        replayed = await runner_of(stores, asks).replay(
            keyed.agent(),
            "r",
            tenant="acme",
            from_step=step,
            stubs={"refund": lambda **kw: got.append(kw) or {"ok": 1}},
            new_run_id="x",
        )
        assert replayed.status is RunStatus.completed
        assert len(got) == 1 and keyed.sent == ["o-1"]
        keys = {r.key for r in await stores.idempotency.records("acme", "x")}
        assert "order-o-1" not in keys


async def test_stub_raising_outcome_unknown(where: str, tmp_path: Path) -> None:
    from tesserix_adk.errors import IndeterminateToolCallError, ToolOutcomeUnknownError

    async with fresh_stores(where, tmp_path) as stores:
        shop = Shop()
        await _original_run(stores, shop, turns())
        before = await original(stores, "r")

        def unknown(**kw: Any) -> Any:
            raise ToolOutcomeUnknownError("stub timed out")

        with pytest.raises((ToolOutcomeUnknownError, IndeterminateToolCallError)):
            await _replay(stores, shop, unknown)
        assert len(shop.sent) == 1
        assert await original(stores, "r") == before
