"""Attacks on this session's changes: the operator's own words in error sentences (9e44fe2),
``never_ran_by`` (2277b7f), cut-off replies (34e727d), reconcilers of a claim another run
holds (57c7584) and the Redis claim rewriting its record in place (fc5a341).

A strict xfail is a defect found (its reason names what goes wrong and where in src); a plain
test is a promise that held under the attack.

Defects found (each was a strict xfail; all are fixed since, their tests plain: a
reconciler's answer is recorded only on the claim its plan saw, ``resolve(holder=)``; a
told word is kept only where the redactor would mask it alone, and a SQLite store is told
without its query; a missing column is the ``tesserix schema apply`` sentence; every stop
reason of a reply cut short refuses its calls):

1. (high) Two runs sharing a business key both send the call. r1 claims ``order-5`` and
   dies; r2's call of the same key is left in doubt. Both are resumed: r2 checks r1's lease
   (not live, margin passed) and asks its reconciler, which looks (nothing charged) and is
   slow to answer; meanwhile r1's own reconciler says ``never_ran``, r1 claims the key again
   and starts sending. r2's ``never_ran`` then lands with an unconditional
   ``idempotency.resolve(never_ran=True)`` over r1's *new* in-flight claim
   (``run/reconciling.py`` ``reconcile_in_doubt``; ``stores/records.py`` ``after_resolve``
   checks only that the record is in flight, not that it is still the claim the plan saw),
   r2 claims and charges, and r1's charge lands too: two charges.
2. (medium) An error sentence's secret is shown when a told word (tenant, run id) sits
   inside or next to it: ``cli/failures.py`` ``_redacting`` splits the text at every told
   word and redacts each piece alone, so a pattern that needs its context (``://user:``
   before a URL password, ``password=`` before a value) no longer matches. A PostgreSQL
   URL whose user is the tenant (``postgresql://acme-prod:hunter2…@db``), or a password
   beginning with the tenant (``password=acme-prod-S3cret``) is printed whole.
3. (medium) ``told_by`` tells a SQLite store URL whole, query and all: a secret in its
   query (``?token=ghp_…``, ``?api_key=…``) is printed unmasked by ``tesserix
   --store 'sqlite:///…?token=ghp_…' inspect …`` ("has an unknown option 'token'"),
   where without ``told`` the redactor masks it (``cli/failures.py`` ``told_by``).
4. (medium) A PostgreSQL schema at version 5 (before ``never_ran_by``) is not refused with
   the ``tesserix schema apply`` sentence: every idempotency statement fails on the missing
   column, ``adapters/postgres/driver.py`` ``driver_errors`` maps ``UndefinedColumn`` to a
   ``StoreUnavailableError`` ("column r.never_ran_by does not exist"), so ``tesserix show``
   / ``inspect`` / ``runs`` exit 3 (store down, try later) and a run fails the same way;
   README "Upgrading a store" promises the refusal naming ``tesserix schema apply``.
5. (medium) An Anthropic reply that ended at the model's context window
   (``stop_reason: model_context_window_exceeded``, in the installed SDK's ``StopReason``)
   is cut off for want of tokens just as ``max_tokens`` is, but its ``tool_use`` is sent
   with the input it had: ``providers/anthropic.py`` ``_read_message`` refuses calls only
   for ``max_tokens``.

Promises that held (plain tests): a SQLite file at schema version 5 is refused naming
``tesserix schema apply`` (exit 1) and migrated keeping its records, whose re-claim then
names who said the call never ran; memory, SQLite, Redis and PostgreSQL agree field for
field over claim / never_ran / re-claim / takeover / lapse / complete cycles (the Redis
claim leaves no stale ``outcome``, ``by``, ``expires_at``, ``fence``, ``never_ran_by``,
``call_id``, ``iteration`` or flags behind); ``tesserix show`` (text and ``--json``) names
who said a re-sent call never ran; a claim under a key whose named run never had a lease
is never reconciled away (its reconciler is not asked, the call stays in doubt).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import io
import json
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from adapters import services
from providers.fake_server import ModelServer, anthropic_message
from tesserix_adk import (
    Agent,
    AgentRunner,
    IndeterminateToolCallError,
    LeasePolicy,
    Reconciled,
    ScriptedProvider,
    ToolContext,
    open_stores,
    tool,
)
from tesserix_adk.cli import ExitCode, frontier_main
from tesserix_adk.cli.failures import explain
from tesserix_adk.errors import ResumeConflictError, StoreUnavailableError
from tesserix_adk.providers.anthropic import AnthropicProvider
from tesserix_adk.stores.protocols import IdempotencyStore, RecordStatus, ToolFlags
from tesserix_adk.stores.sqlite.schema import SqliteSchema, statements
from tesserix_adk.testing.faults import SimulatedCrash

T = "acme"


async def _cli(stores: Any, *argv: str) -> tuple[int, str, str]:
    """A frontier command in a thread of its own (it runs its own event loop)."""
    out, err = io.StringIO(), io.StringIO()
    code = await asyncio.to_thread(frontier_main, list(argv), stores=stores, out=out, err=err)
    return code, out.getvalue(), err.getvalue()


# --- 1. the operator's own words in error sentences (cli/failures.py) -----------------------


def test_a_database_password_whose_user_is_the_tenant_stays_masked() -> None:
    exc = StoreUnavailableError("cannot reach postgresql://acme-prod:hunter2hunter2@db/adk")
    assert "hunter2hunter2" not in explain(exc)[1]  # masked without told
    _, said = explain(exc, told=("acme-prod",))
    assert "acme-prod" in said
    assert "hunter2hunter2" not in said, said


def test_a_password_beginning_with_the_tenant_stays_masked() -> None:
    exc = StoreUnavailableError("login refused: password=acme-prod-S3cret!x")
    assert "S3cret" not in explain(exc)[1]  # masked without told
    _, said = explain(exc, told=("acme-prod",))
    assert "S3cret" not in said, said


def test_a_secret_in_a_sqlite_urls_query_is_masked_on_stderr(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tesserix_adk.cli.main import main

    token = "ghp_" + "a1B2" * 9
    url = f"sqlite:///{tmp_path / 'adk.sqlite3'}?token={token}"
    code = main(["--store", url, "inspect", "r1", "--tenant", T])
    err = capsys.readouterr().err
    assert code == ExitCode.USAGE, err
    assert "unknown option 'token'" in err
    assert token not in err and "a1B2a1B2" not in err, err


def test_a_key_next_to_the_told_run_id_is_masked_and_the_run_id_kept() -> None:
    run = "Acme/Orders/2026/Invoice/Q3Batch/Item007"
    key = "sk-proj-" + "Zq9" * 12
    _, said = explain(StoreUnavailableError(f"run {run} refused {key} now"), told=(run,))
    assert run in said and key not in said and "Zq9Zq9" not in said


# --- 2. never_ran_by: upgrades, stores, show ---------------------------------------------------


def _sqlite_v5(path: Path) -> None:
    """A SQLite file as the kit of schema version 5 left it, with a call an operator said
    never ran."""
    schema = SqliteSchema.load()
    assert schema.version == 7  # (6 when written; 7 adds holder_run)
    conn = sqlite3.connect(path)
    try:
        for migration in schema.migrations[:5]:
            for statement in statements(migration):
                conn.execute(statement)
        conn.execute("INSERT INTO adk_schema_version (id, version) VALUES (1, 5)")
        conn.execute(
            "INSERT INTO adk_idempotency (key, status, holder, tenant, run_id, iteration, tool, "
            "call_id, side_effects, idempotent, fence, since, resolved_by) VALUES "
            "('acme/k', 'never_ran', 'w1', 'acme', 'r1', 0, 'book', 'c1', 1, 0, 1, 1000.0, "
            "'alice')"
        )
        conn.commit()
    finally:
        conn.close()


async def test_a_sqlite_file_at_version_5_is_refused_then_migrated_keeping_its_records(
    tmp_path: Path,
) -> None:
    path = tmp_path / "old.sqlite3"
    _sqlite_v5(path)
    url = f"sqlite:///{path}"
    code, _, err = await _cli(open_stores(url), "show", "r1", "--tenant", T)
    assert code == ExitCode.NOTHING_CHECKPOINTED, err
    assert "schema version 5" in err and "tesserix schema apply" in err, err
    assert "Traceback" not in err and err.count("\n") == 1
    async with open_stores(url) as stores:
        await stores.create_schema()
        [rec] = (await stores.idempotency.lookup(["acme/k"], tenant=T)).values()
        assert (rec.status, rec.by, rec.never_ran_by) == (RecordStatus.never_ran, "alice", None)
        again = await stores.idempotency.claim(
            "acme/k", holder="w2", tenant=T, run_id="r1", iteration=0, tool="book",
            call_id="c1", flags=ToolFlags(), fence=2,
        )  # fmt: skip
        assert (again.status, again.by, again.never_ran_by) == (
            RecordStatus.in_flight,
            None,
            "alice",
        )


@tool
def book_flight(flight: str) -> str:
    """Book a seat."""
    return f"booked {flight}"


async def test_a_postgres_schema_at_version_5_is_refused_naming_schema_apply() -> None:
    import psycopg

    agent = Agent("a", "Book.", [book_flight])
    async with services.postgres_schema() as name:
        url = services.schema_url(name)
        async with open_stores(url) as stores:
            await stores.create_schema()
            provider = ScriptedProvider([[("book_flight", {"flight": "LH1"})], "done"])
            await AgentRunner.from_stores(provider, stores).run(agent, "go", tenant=T, run_id="r1")
        # What a schema the version-5 kit applied looks like, with its data.
        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as admin:
            await admin.execute("ALTER TABLE adk_idempotency DROP COLUMN never_ran_by")
            await admin.execute("UPDATE adk_schema_version SET version = 5")
        code, _, err = await _cli(open_stores(url), "show", "r1", "--tenant", T)
        assert "tesserix schema apply" in err, err
        assert code == ExitCode.NOTHING_CHECKPOINTED, err


async def _cycles(store: IdempotencyStore) -> list[dict[str, Any]]:
    """Claim, never_ran, re-claim by another run with other fields, takeover with a ttl
    that lapses, fresh claim, never_ran again, re-claim, complete, claim a completed one."""
    seen: list[dict[str, Any]] = []

    def snap(rec: Any) -> None:
        d = dataclasses.asdict(rec)
        for name in ("since", "completed_at", "expires_at"):
            d[name] = d[name] is not None
        seen.append(d)

    async def claim(holder: str, **kw: Any) -> Any:
        kw.setdefault("run_id", "r1")
        kw.setdefault("iteration", 0)
        kw.setdefault("call_id", "c1")
        kw.setdefault("flags", ToolFlags())
        return await store.claim("k", holder=holder, tenant=T, tool="book", **kw)

    snap(await claim("A", fence=1, ttl=30))
    snap(await store.resolve("k", never_ran=True, tenant=T, by="alice"))
    flags = ToolFlags(side_effects=True, idempotent=True)
    snap(await claim("B", fence=2, run_id="r2", iteration=3, call_id=None, flags=flags))
    snap(await claim("C", fence=3, takeover=True, ttl=0.2))
    await asyncio.sleep(0.35)
    snap(await claim("D", fence=4))
    snap(await store.resolve("k", never_ran=True, tenant=T, by="bob"))
    snap(await claim("E", fence=5, ttl=30))
    snap(await store.complete("k", b"done", tenant=T, holder="E"))
    snap(await claim("F", fence=6))
    return seen


async def test_every_store_rewrites_a_reclaimed_record_alike_leaving_no_stale_field(
    tmp_path: Path,
) -> None:
    seen = await services.on_every_idempotency_store(tmp_path / "adk.sqlite3", _cycles)
    memory = seen["memory"]
    # The model itself: what each re-claim keeps and drops.
    assert [(r["holder"], r["by"], r["never_ran_by"]) for r in memory] == [
        ("A", None, None),
        ("A", "alice", None),
        ("B", None, "alice"),
        ("C", None, "alice"),
        ("D", None, None),  # the takeover's ttl lapsed: a fresh claim keeps no name
        ("D", "bob", None),
        ("E", None, "bob"),
        ("E", None, "bob"),
        ("E", None, "bob"),
    ]
    assert (memory[2]["call_id"], memory[2]["iteration"], memory[4]["call_id"]) == (None, 3, "c1")
    assert not memory[4]["expires_at"] and memory[6]["expires_at"] and not memory[7]["expires_at"]
    for backend, records in seen.items():
        assert records == memory, backend


async def test_show_names_who_said_a_resent_call_never_ran(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'adk.sqlite3'}"
    sent: list[str] = []
    die = [True]

    @tool
    def charge(order: str) -> str:
        """Charge an order."""
        if die[0]:
            die[0] = False
            raise SimulatedCrash("died before the effect")
        sent.append(order)
        return "charged"

    agent = Agent("shop", "Charge.", [charge])

    def runner(stores: Any) -> AgentRunner:
        provider = ScriptedProvider([[("charge", {"order": "5"})], "done"])
        policy = LeasePolicy(ttl=0.3, renew_within=0.15)
        return AgentRunner.from_stores(
            provider, stores, lease_policy=policy, resume_claim_ttl=0.3, never_ran_margin=0.0
        )

    async with open_stores(url) as stores:
        await stores.create_schema()
        with pytest.raises(SimulatedCrash):
            await runner(stores).run(agent, "go", tenant=T, run_id="r1")
        [rec] = [r for r in await stores.idempotency.records(T, "r1") if r.tool == "charge"]
        await asyncio.sleep(0.4)  # the dead holder's lease lapses
        code, _, err = await _cli(
            open_stores(url), "resolve", "r1", "--tenant", T, "--call", str(rec.call_id),
            "--never-ran", "--margin", "0", "--by", "alice@ops",
        )  # fmt: skip
        assert code == ExitCode.CARRIED_ON, err
        run = None
        for _ in range(40):
            with contextlib.suppress(ResumeConflictError):
                run = await runner(stores).resume(agent, "r1", tenant=T)
                break
            await asyncio.sleep(0.05)
        assert run is not None and run.status.value == "completed"
    assert sent == ["5"]
    code, out, err = await _cli(open_stores(url), "show", "r1", "--tenant", T, "--json")
    assert code == ExitCode.CARRIED_ON, err
    told = json.loads(out)
    [call] = [c for c in told["calls"] if c["tool"] == "charge"]
    assert (call["never_ran_by"], call["by"]) == ("alice@ops", None)
    code, out, err = await _cli(open_stores(url), "show", "r1", "--tenant", T)
    assert "claimed again after alice@ops said it never ran" in out, out


# --- 3. a reply cut off for want of tokens (providers) ---------------------------------------


async def test_a_tool_use_cut_off_at_the_context_window_is_never_sent(
    model_server: ModelServer,
) -> None:
    transfers: list[int] = []

    @tool
    def transfer(amount: int) -> str:
        """Send money."""
        transfers.append(amount)
        return f"sent {amount}"

    # The model was writing {"amount": 1000} when the context window ran out at 10.
    body = anthropic_message(None, [("toolu_1", "transfer", {"amount": 10})])
    body["stop_reason"] = "model_context_window_exceeded"
    model_server.queue(body, anthropic_message("Stopped."))
    provider = AnthropicProvider(
        "anthropic:claude-haiku-4-5",
        base_url=model_server.url,
        api_key="test-key",
        max_retries=0,
        timeout=5.0,
    )
    try:
        with contextlib.suppress(Exception):  # refusing the reply is fine; sending is not
            await AgentRunner.from_stores(provider, open_stores("memory://")).run(
                Agent("bank", "Pay.", [transfer]), "pay 1000", tenant=T, run_id="r1"
            )
    finally:
        await provider.aclose()
    assert transfers == []


# --- 4. reconcilers of a claim another run holds (run/reconciling.py) -------------------------


def _shop_runner(stores: Any, *, margin: float = 0.1) -> AgentRunner:
    return AgentRunner.from_stores(
        ScriptedProvider([[("charge", {"order": "5"})], "done"]),
        stores,
        lease_policy=LeasePolicy(ttl=0.4, renew_within=0.2),
        never_ran_margin=margin,
        resume_claim_ttl=0.4,
    )


async def _resume(stores: Any, agent: Agent, run_id: str) -> Any:
    for _ in range(100):
        try:
            return await _shop_runner(stores).resume(agent, run_id, tenant=T)
        except ResumeConflictError:
            await asyncio.sleep(0.05)
    raise AssertionError(f"{run_id} was never free to resume")


async def test_two_runs_sharing_a_key_resumed_together_charge_once() -> None:
    stores = open_stores("memory://")
    charged: list[tuple[str, str]] = []
    r2_looked, r1_sending, r2_charged = asyncio.Event(), asyncio.Event(), asyncio.Event()
    die = [True]

    async def reconcile(call: Any, ctx: ToolContext) -> Reconciled:
        # Honest: it looks at the payment system, then its answer takes a while to come back.
        seen = any(key == ctx.idempotency_key for _, key in charged)
        if ctx.run_id == "r2":
            r2_looked.set()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(r1_sending.wait(), 5)
        return Reconciled.completed({"charged": True}) if seen else Reconciled.never_ran()

    @tool(key=lambda **kw: f"order-{kw['arguments']['order']}", reconcile=reconcile)
    async def charge(order: str, ctx: ToolContext) -> dict[str, str]:
        """Charge an order."""
        assert ctx.idempotency_key is not None
        if ctx.run_id == "r1" and die[0]:
            die[0] = False
            raise SimulatedCrash("died before the effect")
        if ctx.run_id == "r1":
            r1_sending.set()  # r1's request is on its way, slow to land
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(r2_charged.wait(), 2)
        charged.append((ctx.run_id, ctx.idempotency_key))
        if ctx.run_id == "r2":
            r2_charged.set()
        return {"charged": order}

    agent = Agent("shop", "Charge.", [charge])
    with pytest.raises(SimulatedCrash):
        await _shop_runner(stores).run(agent, "go", tenant=T, run_id="r1")
    with pytest.raises(IndeterminateToolCallError):
        await _shop_runner(stores).run(agent, "go", tenant=T, run_id="r2")
    await asyncio.sleep(0.6)  # r1's lease and resume claim have lapsed
    r2 = asyncio.create_task(_resume(stores, agent, "r2"))
    await asyncio.wait_for(r2_looked.wait(), 10)
    r1 = asyncio.create_task(_resume(stores, agent, "r1"))
    await asyncio.gather(r1, r2, return_exceptions=True)
    assert charged == [("r1", "acme/order-5")] or charged == [("r2", "acme/order-5")], charged


async def test_a_claim_whose_run_never_had_a_lease_is_never_reconciled_away() -> None:
    stores = open_stores("memory://")
    asked: list[str] = []
    charged: list[str] = []

    def reconcile(call: Any, ctx: ToolContext) -> Reconciled:
        asked.append(ctx.run_id)
        return Reconciled.never_ran()

    @tool(key=lambda **kw: f"order-{kw['arguments']['order']}", reconcile=reconcile)
    def charge(order: str, ctx: ToolContext) -> str:
        """Charge an order."""
        charged.append(ctx.run_id)
        return "charged"

    # Claimed by a run the lease store never heard of (another deployment, or one gone).
    await stores.idempotency.claim(
        "acme/order-5", holder="elsewhere", tenant=T, run_id="ghost", iteration=0,
        tool="charge", call_id="x", flags=ToolFlags(), fence=1,
    )  # fmt: skip
    agent = Agent("shop", "Charge.", [charge])
    with pytest.raises(IndeterminateToolCallError):
        await _shop_runner(stores, margin=0.0).run(agent, "go", tenant=T, run_id="r2")
    with pytest.raises(IndeterminateToolCallError, match="charge"):
        await _shop_runner(stores, margin=0.0).resume(agent, "r2", tenant=T)
    assert (asked, charged) == ([], [])
    [rec] = (await stores.idempotency.lookup(["acme/order-5"], tenant=T)).values()
    assert (rec.status, rec.run_id) == (RecordStatus.in_flight, "ghost")
