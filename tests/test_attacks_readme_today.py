"""A reviewer's tries at what today's README changes say (``git diff d7805e9..HEAD --
README.md``), as a careful user would meet them: the operator's words in CLI error
sentences, ``tesserix show`` naming who said a re-sent call never ran, the upgrade of a
SQLite file or PostgreSQL schema from an earlier kit (schema version 5, made by applying the
schema and undoing migration 0006 by hand), guarantee 2's Redis failover sentence, the
``redis+cluster`` row of the store table, replies cut short, and the telemetry paragraph.

A strict xfail is a place where the kit does not do what README (or the commit that made the
change) says; its reason names where in ``src``. A plain test is a claim that held.

Four were found, each a strict xfail, all fixed since and their tests plain: a worker of the
new kit meeting a PostgreSQL schema not yet migrated parked every run it took, for good (it
now gives the run back and stops with the schema sentence, ``SchemaMismatchError``); ``show``
said "sent again" of a call answered "not sent" (it now says "claimed again"); ``tesserix
run --resume`` masked the run id the operator gave (``told_by`` reads ``resume``,
``request`` and ``call`` too); the README's "16 KiB" of captured content was characters
(the README now says so).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import re
import secrets
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from adapters import services
from providers.fake_server import (
    ModelServer,
    Reply,
    anthropic_message,
    openai_completion,
    openai_stream,
)
from tesserix_adk import (
    Agent,
    AgentRunner,
    Checkpointer,
    LeasePolicy,
    MemoryCheckpointStore,
    MemoryIdempotencyStore,
    MemoryLeaseStore,
    Reconciled,
    ScriptedProvider,
    ToolContext,
    Worker,
    open_stores,
    tool,
)
from tesserix_adk.cli import ExitCode, frontier_main
from tesserix_adk.cli.main import main as tesserix
from tesserix_adk.errors import ConfigurationError, ResumeConflictError
from tesserix_adk.providers.anthropic import AnthropicProvider
from tesserix_adk.providers.openai import OpenAIProvider
from tesserix_adk.stores.protocols import RecordStatus
from tesserix_adk.telemetry import DeterministicIds, Telemetry
from tesserix_adk.testing.faults import SimulatedCrash

T = "acme"
SRC = Path(__file__).resolve().parents[1] / "src" / "tesserix_adk"
# A run id an operator may well be given: it has the shape of an AWS access key id.
AWS_SHAPED = "AKIAIOSFODNN7EXAMPLE"


async def _cli(stores: Any, *argv: str) -> tuple[int, str, str]:
    """A frontier command in a thread of its own (it runs its own event loop)."""
    out, err = io.StringIO(), io.StringIO()
    code = await asyncio.to_thread(frontier_main, list(argv), stores=stores, out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def _agent_file(tmp_path: Path) -> str:
    """``path/to/file.py:attr`` of an agent with one harmless tool, for ``--agent``."""
    # A module name of its own: the CLI refuses a second file under a name already loaded.
    module = tmp_path / f"today_agent_{secrets.token_hex(4)}.py"
    module.write_text(
        "from tesserix_adk import Agent, ScriptedProvider, tool\n"
        "@tool\n"
        "def noop(x: str) -> str:\n"
        '    """Nothing."""\n'
        "    return x\n"
        'agent = Agent("a", "Nothing.", [noop])\n'
        'PROVIDER = ScriptedProvider(["done"])\n',
        encoding="utf-8",
    )
    return f"{module}:agent"


@tool
def book_flight(flight: str) -> str:
    """Book a seat."""
    return f"booked {flight}"


BOOKING = Agent("a", "Book.", [book_flight])


def _booking_provider() -> ScriptedProvider:
    return ScriptedProvider([[("book_flight", {"flight": "LH1"})], "done"])


# --- 1. the operator's words in CLI error sentences (9e44fe2) --------------------------------


@pytest.mark.parametrize(
    "command",
    [
        ["inspect", AWS_SHAPED, "--tenant", T],
        ["show", AWS_SHAPED, "--tenant", T],
        ["cancel", AWS_SHAPED, "--tenant", T, "--by", "ops"],
        ["inspect", "r1", "--tenant", AWS_SHAPED],
    ],
    ids=["inspect", "show", "cancel", "tenant"],
)
def test_a_run_id_or_tenant_shaped_like_a_key_is_shown_as_given(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: list[str]
) -> None:
    url = f"sqlite:///{tmp_path / 'adk.sqlite3'}"
    assert tesserix(["--store", url, "schema", "apply"]) == 0
    capsys.readouterr()
    code = tesserix(["--store", url, *command])
    err = capsys.readouterr().err
    assert code == ExitCode.NOTHING_CHECKPOINTED, err
    assert AWS_SHAPED in err and "redacted" not in err, err


def test_run_resume_shows_a_run_id_shaped_like_a_key_as_given(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"sqlite:///{tmp_path / 'adk.sqlite3'}"
    assert tesserix(["--store", url, "schema", "apply"]) == 0
    capsys.readouterr()
    argv = ["run", "--resume", AWS_SHAPED, "--tenant", T, "--agent", _agent_file(tmp_path)]
    code = tesserix(["--store", url, *argv])
    err = capsys.readouterr().err
    assert code == ExitCode.NOTHING_CHECKPOINTED, err
    assert AWS_SHAPED in err, err


# --- 2. tesserix show: who said a re-sent call never ran ---------------------------------------


def _redis_url(prefix: str) -> str:
    return services.with_query(services.REDIS_URL, prefix=prefix, allow_volatile="true")


@contextlib.asynccontextmanager
async def _redis_prefix() -> AsyncIterator[str]:
    client = await services.redis_client()
    prefix = f"readme-today-{secrets.token_hex(6)}:"
    try:
        yield prefix
    finally:
        try:
            await services.delete_prefixed(client, prefix)
        finally:
            await client.aclose()


async def _resume_when_free(runner: AgentRunner, agent: Agent, run_id: str) -> Any:
    for _ in range(60):
        with contextlib.suppress(ResumeConflictError):
            return await runner.resume(agent, run_id, tenant=T)
        await asyncio.sleep(0.05)
    raise AssertionError(f"{run_id} was never free to resume")


async def test_show_names_the_reconciler_that_said_a_resent_call_never_ran_on_redis() -> None:
    sent: list[str] = []
    die = [True]

    def reconcile(call: Any, ctx: ToolContext) -> Reconciled:
        return Reconciled.completed("charged") if sent else Reconciled.never_ran()

    @tool(reconcile=reconcile)
    def charge(order: str) -> str:
        """Charge an order."""
        if die[0]:
            die[0] = False
            raise SimulatedCrash("died before the effect")
        sent.append(order)
        return "charged"

    agent = Agent("shop", "Charge.", [charge])

    def runner(stores: Any) -> AgentRunner:
        return AgentRunner.from_stores(
            ScriptedProvider([[("charge", {"order": "5"})], "done"]),
            stores,
            lease_policy=LeasePolicy(ttl=0.3, renew_within=0.15),
            resume_claim_ttl=0.3,
            never_ran_margin=0.0,
        )

    async with _redis_prefix() as prefix:
        url = _redis_url(prefix)
        async with open_stores(url) as stores:
            with pytest.raises(SimulatedCrash):
                await runner(stores).run(agent, "go", tenant=T, run_id="r1")
            await asyncio.sleep(0.4)  # the dead holder's lease lapses
            run = await _resume_when_free(runner(stores), agent, "r1")
            assert run.status.value == "completed"
        assert sent == ["5"]
        code, out, err = await _cli(open_stores(url), "show", "r1", "--tenant", T, "--json")
        assert code == ExitCode.CARRIED_ON, err
        [call] = [c for c in json.loads(out)["calls"] if c["tool"] == "charge"]
        assert (call["never_ran_by"], call["by"]) == ("reconciler:charge", None)
        code, out, err = await _cli(open_stores(url), "show", "r1", "--tenant", T)
        assert "claimed again after reconciler:charge said it never ran" in out, out


async def test_show_never_says_sent_again_for_a_call_answered_not_sent(tmp_path: Path) -> None:
    secret = "sk-proj-" + "Ab3" * 12
    sent: list[int] = []
    die = [True]

    @tool(reconcile=lambda call, ctx: Reconciled.never_ran())
    def send_key(api_key: str) -> str:
        """Send a key somewhere."""
        if die[0]:
            die[0] = False
            raise SimulatedCrash("died before the effect")
        sent.append(1)
        return "sent"

    agent = Agent("k", "Send.", [send_key])

    def runner(stores: Any) -> AgentRunner:
        return AgentRunner.from_stores(
            ScriptedProvider([[("send_key", {"api_key": secret})], "done"]),
            stores,
            lease_policy=LeasePolicy(ttl=0.3, renew_within=0.15),
            resume_claim_ttl=0.3,
            never_ran_margin=0.0,
        )

    url = f"sqlite:///{tmp_path / 'adk.sqlite3'}"
    async with open_stores(url) as stores:
        await stores.create_schema()
        with pytest.raises(SimulatedCrash):
            await runner(stores).run(agent, "go", tenant=T, run_id="r1")
        await asyncio.sleep(0.4)
        run = await _resume_when_free(runner(stores), agent, "r1")
        assert run.status.value == "completed"
        [rec] = [r for r in await stores.idempotency.records(T, "r1") if r.tool == "send_key"]
        # A masked call is looked up and never claimed: the reconciler's never-ran stands
        # (it was answered "not sent" and completed before 1bb4b03).
        assert rec.status is RecordStatus.never_ran and rec.by == "reconciler:send_key"
    assert sent == []  # the masked call was never sent again
    code, out, err = await _cli(open_stores(url), "show", "r1", "--tenant", T)
    assert code == ExitCode.CARRIED_ON, err
    assert "sent again" not in out, out


# --- 3. upgrading a store from an earlier kit (schema version 5) -------------------------------


async def _records(stores: Any) -> list[Any]:
    return sorted(await stores.idempotency.records(T, "r1"), key=lambda r: r.key)


def _sqlite_to_version_5(path: Path) -> None:
    """Undo migrations 0007 and 0006 by hand: what the kit of schema version 5 left."""
    conn = sqlite3.connect(path)
    try:
        conn.execute("DROP INDEX adk_idempotency_taken")
        for column in ("holder_run", "holder_iteration", "holder_call_id"):
            conn.execute(f"ALTER TABLE adk_idempotency DROP COLUMN {column}")
        conn.execute("ALTER TABLE adk_idempotency DROP COLUMN never_ran_by")
        conn.execute("UPDATE adk_schema_version SET version = 5")
        conn.commit()
    finally:
        conn.close()


async def test_a_sqlite_file_from_an_earlier_kit_is_refused_everywhere_then_migrated(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "adk.sqlite3"
    url = f"sqlite:///{path}"
    async with open_stores(url) as stores:
        await stores.create_schema()
        await AgentRunner.from_stores(_booking_provider(), stores).run(
            BOOKING, "go", tenant=T, run_id="r1"
        )
        before = await _records(stores)
    _sqlite_to_version_5(path)
    apply = f"`tesserix schema apply --store sqlite:///{path}`"
    for argv in (
        ["runs", "--tenant", T],
        ["inspect", "r1", "--tenant", T],
        ["show", "r1", "--tenant", T],
        ["steps", "r1", "--tenant", T],
        ["resolve", "r1", "--tenant", T, "--call", "call_0_0", "--never-ran", "--by", "ops"],
        ["run", "--resume", "r1", "--tenant", T, "--agent", _agent_file(tmp_path)],
    ):
        code = await asyncio.to_thread(tesserix, ["--store", url, *argv])
        err = capsys.readouterr().err
        assert code == ExitCode.NOTHING_CHECKPOINTED, (argv, err)
        assert "schema version 5" in err and apply in err, (argv, err)
        assert err.count("\n") == 1 and "Traceback" not in err
    # A runner and a worker of this kit are refused too, at their first look.
    async with open_stores(url) as stores:
        with pytest.raises(ConfigurationError, match="schema apply"):
            await AgentRunner.from_stores(_booking_provider(), stores).run(
                BOOKING, "go", tenant=T, run_id="r2"
            )
        worker = Worker(
            AgentRunner.from_stores(_booking_provider(), stores),
            [BOOKING],
            exit_when_idle=True,
            poll_interval=0.01,
        )
        with pytest.raises(ConfigurationError, match="schema apply"):
            await asyncio.wait_for(worker.run(), 10)
    # `tesserix schema apply` migrates it in place, keeping every record.
    code = await asyncio.to_thread(tesserix, ["--store", url, "schema", "apply"])
    assert code == ExitCode.CARRIED_ON, capsys.readouterr().err
    async with open_stores(url) as stores:
        await stores.verify()
        assert await _records(stores) == before
    code = await asyncio.to_thread(tesserix, ["--store", url, "show", "r1", "--tenant", T])
    assert code == ExitCode.CARRIED_ON
    assert "book_flight (call_0_0)" in capsys.readouterr().out


@contextlib.asynccontextmanager
async def _pg_schema() -> AsyncIterator[str]:
    """A PostgreSQL schema of this file's own, dropped after; its store URL."""
    import psycopg

    name = f"readme_today_{secrets.token_hex(5)}"
    try:
        admin = await psycopg.AsyncConnection.connect(
            services.POSTGRES_URL, autocommit=True, connect_timeout=3
        )
    except psycopg.OperationalError as exc:
        services.unavailable(f"PostgreSQL cannot be reached: {exc}")
    try:
        await admin.execute(f'CREATE SCHEMA "{name}"')
        try:
            yield services.with_query(services.POSTGRES_URL, schema=name)
        finally:
            await admin.execute(f'DROP SCHEMA "{name}" CASCADE')
    finally:
        await admin.close()


async def _pg_to_version_5(url: str) -> None:
    """Undo migration 0006 by hand: what the kit of schema version 5 left."""
    import psycopg

    schema = re.search(r"schema=([a-z0-9_]+)", url)
    assert schema is not None
    async with await psycopg.AsyncConnection.connect(
        services.POSTGRES_URL, autocommit=True
    ) as admin:
        await admin.execute(f'ALTER TABLE "{schema[1]}".adk_idempotency DROP COLUMN never_ran_by')
        await admin.execute(f'UPDATE "{schema[1]}".adk_schema_version SET version = 5')


async def test_a_postgres_schema_from_an_earlier_kit_is_refused_then_migrated() -> None:
    async with _pg_schema() as url:
        async with open_stores(url) as stores:
            await stores.create_schema()
            await AgentRunner.from_stores(_booking_provider(), stores).run(
                BOOKING, "go", tenant=T, run_id="r1"
            )
            before = await _records(stores)
        await _pg_to_version_5(url)
        for argv in (["inspect", "r1"], ["show", "r1"], ["runs"]):
            code, _, err = await _cli(open_stores(url), *argv, "--tenant", T)
            assert code == ExitCode.NOTHING_CHECKPOINTED, (argv, err)
            assert "from an earlier kit" in err and "tesserix schema apply" in err, err
        async with open_stores(url) as stores:
            with pytest.raises(ConfigurationError, match="schema apply") as refused:
                await AgentRunner.from_stores(_booking_provider(), stores).run(
                    BOOKING, "go", tenant=T, run_id="r2"
                )
            assert not refused.value.retryable
            with pytest.raises(ConfigurationError, match="version 5, older"):
                await stores.verify()
            # Refused before anything of r2 was checkpointed.
            assert await stores.checkpoints.latest(T, "r2") is None
        code, out, err = await _cli(open_stores(url), "schema", "apply")
        assert code == ExitCode.CARRIED_ON, err
        async with open_stores(url) as stores:
            await stores.verify()
            assert await _records(stores) == before
            assert await stores.idempotency.records(T, "r2") == []
        code, out, err = await _cli(open_stores(url), "show", "r1", "--tenant", T)
        assert code == ExitCode.CARRIED_ON and "book_flight (call_0_0)" in out, err


async def test_a_worker_started_before_the_postgres_migration_strands_no_run() -> None:
    async with _pg_schema() as url:
        async with open_stores(url) as stores:
            await stores.create_schema()
        await _pg_to_version_5(url)
        async with open_stores(url) as stores:
            runner = AgentRunner.from_stores(_booking_provider(), stores)
            await runner.submit(BOOKING, "go", tenant=T, run_id="r1")
            worker = Worker(runner, [BOOKING], exit_when_idle=True, poll_interval=0.01)
            # README: a store that is not the kit's stops the worker at its first look.
            with contextlib.suppress(ConfigurationError):
                await asyncio.wait_for(worker.run(), 10)
        code, _, err = await _cli(open_stores(url), "schema", "apply")
        assert code == ExitCode.CARRIED_ON, err
        async with open_stores(url) as stores:
            runner = AgentRunner.from_stores(_booking_provider(), stores)
            worker = Worker(runner, [BOOKING], exit_when_idle=True, poll_interval=0.01)
            await asyncio.wait_for(worker.run(), 10)
            latest = await stores.checkpoints.latest(T, "r1")
        assert latest is not None, "r1 is still parked: the migrated store strands it"


# --- 4. guarantee 2 and the redis+cluster row ---------------------------------------------------


def test_the_kit_never_waits_for_redis_replicas_as_guarantee_2_says() -> None:
    redis_code = "\n".join(
        p.read_text(encoding="utf-8") for p in (SRC / "adapters" / "redis").rglob("*.*")
    )
    assert not re.search(r"""['"]WAIT(AOF)?['"]|\.wait\(|\bwaitaof\(""", redis_code)
    deploying = (SRC.parents[1] / "docs" / "deploying.md").read_text(encoding="utf-8")
    assert "`WAIT`" in deploying and "failover" in deploying


def test_a_redis_cluster_store_has_no_work_index_so_no_worker_or_submit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Port 9 (discard): nothing listens there, and nothing may be reached before refusing.
    url = "redis+cluster://127.0.0.1:9/?prefix=readme-today:"
    assert open_stores(url).work is None
    agent = _agent_file(tmp_path)
    for argv in (
        ["submit", "--agent", agent, "--tenant", T, "--input", "hi"],
        ["worker", "--agent", agent, "--exit-when-idle"],
    ):
        code = tesserix(["--store", url, *argv])
        err = capsys.readouterr().err
        assert code == ExitCode.USAGE, (argv, err)
        assert "work index" in err, err


# --- 5. replies cut short, run() on the plain endpoint with telemetry ---------------------------


def _memory_pipeline() -> tuple[Any, Telemetry]:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    traces = TracerProvider(id_generator=DeterministicIds())
    traces.add_span_processor(SimpleSpanProcessor(exporter))
    return exporter, Telemetry(tracer_provider=traces)


CUT_OFF = [
    ("openai", "length"),
    ("openai", "content_filter"),
    ("anthropic", "max_tokens"),
    ("anthropic", "model_context_window_exceeded"),
    ("anthropic", "refusal"),
]


@pytest.mark.parametrize(("vendor", "reason"), CUT_OFF, ids=[r for _, r in CUT_OFF])
async def test_a_cut_off_reply_under_telemetry_is_plain_refused_and_said(
    model_server: ModelServer, vendor: str, reason: str
) -> None:
    transfers: list[int] = []

    @tool
    def transfer(amount: int) -> str:
        """Send money."""
        transfers.append(amount)
        return f"sent {amount}"

    provider: Any
    if vendor == "openai":
        body = openai_completion(None, [("call_1", "transfer", {"amount": 10})])
        body["choices"][0]["finish_reason"] = reason
        model_server.queue(body, openai_completion("Stopped."))
        provider = OpenAIProvider(
            "openai:gpt-4o", base_url=model_server.url + "/v1", api_key="k", max_retries=0
        )
    else:
        body = anthropic_message(None, [("toolu_1", "transfer", {"amount": 10})])
        body["stop_reason"] = reason
        model_server.queue(body, anthropic_message("Stopped."))
        provider = AnthropicProvider(
            "anthropic:claude-haiku-4-5", base_url=model_server.url, api_key="k", max_retries=0
        )
    exporter, telemetry = _memory_pipeline()
    try:
        run = await AgentRunner.from_stores(
            provider, open_stores("memory://"), telemetry=telemetry
        ).run(Agent("bank", "Pay.", [transfer]), "pay 1000", tenant=T, run_id="r1")
    finally:
        await provider.aclose()
    assert (run.status.value, transfers) == ("completed", [])
    # run() stayed on the non-streaming endpoint with telemetry on.
    assert [b.get("stream") for b in model_server.bodies] == [None, None]
    told = json.dumps(model_server.bodies[1])
    assert "not sent" in told and "cut off" in told and reason in told
    spans = exporter.get_finished_spans()
    [tool_span] = [s for s in spans if s.name.startswith("execute_tool")]
    assert (tool_span.attributes or {})["tesserix.tool.disposition"] == "refused"
    chats = [s for s in spans if s.name.startswith("chat")]
    assert [tuple((s.attributes or {})["gen_ai.response.finish_reasons"]) for s in chats] == [
        (reason,),
        ("stop",) if vendor == "openai" else ("end_turn",),
    ]


async def test_run_with_on_event_takes_the_streaming_endpoint(model_server: ModelServer) -> None:
    model_server.queue(Reply(events=openai_stream("Hi.")))
    provider = OpenAIProvider(
        "openai:gpt-4o", base_url=model_server.url + "/v1", api_key="k", max_retries=0
    )
    heard: list[Any] = []
    try:
        run = await AgentRunner.from_stores(provider, open_stores("memory://")).run(
            BOOKING, "hi", tenant=T, run_id="r1", on_event=heard.append
        )
    finally:
        await provider.aclose()
    assert run.status.value == "completed" and heard
    assert model_server.bodies[0].get("stream") is True


# --- 6. telemetry ---------------------------------------------------------------------------


async def test_tesserix_attempt_is_absent_without_a_lease_and_the_fence_with_one() -> None:
    exporter, telemetry = _memory_pipeline()
    idempotency, checkpoints = MemoryIdempotencyStore(), Checkpointer(MemoryCheckpointStore())
    for run_id, leases in (("r1", None), ("r2", MemoryLeaseStore())):
        await AgentRunner(
            ScriptedProvider(["done"]),
            idempotency=idempotency,
            checkpoints=checkpoints,
            leases=leases,
            telemetry=telemetry,
        ).run(BOOKING, "hi", tenant=T, run_id=run_id)
    roots = {
        (s.attributes or {})["tesserix.run.id"]: dict(s.attributes or {})
        for s in exporter.get_finished_spans()
        if s.name.startswith("invoke_agent")
    }
    assert "tesserix.attempt" not in roots["r1"]
    assert roots["r2"]["tesserix.attempt"] == 1


async def test_a_tool_name_and_call_id_holding_a_secret_are_masked_on_spans() -> None:
    from tesserix_adk import Message, ModelResponse, Role, ToolCall

    secret = "ghp_" + "a1B2" * 9

    class Asks:
        async def complete(self, request: Any) -> ModelResponse:
            if any(m.role is Role.assistant for m in request.messages):
                return ModelResponse(message=Message.assistant("done", []))
            call = ToolCall(id=f"call-{secret}", name=f"tool-{secret}", arguments={})
            return ModelResponse(message=Message.assistant("", [call]))

    exporter, telemetry = _memory_pipeline()
    await AgentRunner(
        Asks(), idempotency=MemoryIdempotencyStore(), leases=MemoryLeaseStore(), telemetry=telemetry
    ).run(BOOKING, "hi", tenant=T, run_id="r1")
    [span] = [s for s in exporter.get_finished_spans() if s.name.startswith("execute_tool")]
    shown = [span.name, *map(str, (span.attributes or {}).values())]
    assert not any("a1B2a1B2" in v for v in shown), shown
    assert (span.attributes or {})["tesserix.tool.disposition"] == "refused"


async def test_content_longer_than_about_16000_characters_is_not_captured() -> None:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    # The README's figure is characters (what is measured before anything is masked).
    big = "é" * 17_000

    @tool
    def fetch(n: int) -> str:
        """Fetch a page."""
        return big

    exporter = InMemorySpanExporter()
    traces = TracerProvider()
    traces.add_span_processor(SimpleSpanProcessor(exporter))
    telemetry = Telemetry(tracer_provider=traces, capture_content=True)
    await AgentRunner(
        ScriptedProvider([[("fetch", {"n": 1})], "done"]),
        idempotency=MemoryIdempotencyStore(),
        leases=MemoryLeaseStore(),
        telemetry=telemetry,
    ).run(Agent("f", "Fetch.", [fetch]), "go", tenant=T, run_id="r1")
    [span] = [s for s in exporter.get_finished_spans() if s.name.startswith("execute_tool")]
    shown = str((span.attributes or {})["gen_ai.tool.call.result"])
    assert shown.startswith("(not captured"), shown[:80]


async def test_nothing_of_a_run_refused_by_an_earlier_postgres_schema_is_left_to_resume() -> None:
    """The refusal comes before the first checkpoint and holds no lease: once the schema is
    applied, the same run id starts afresh and completes."""
    async with _pg_schema() as url:
        async with open_stores(url) as stores:
            await stores.create_schema()
        await _pg_to_version_5(url)
        async with open_stores(url) as stores:
            runner = AgentRunner.from_stores(_booking_provider(), stores)
            with pytest.raises(ConfigurationError):
                await runner.run(BOOKING, "go", tenant=T, run_id="r9")
            with pytest.raises(ConfigurationError, match="schema apply"):
                await runner.resume(BOOKING, "r9", tenant=T)
            assert await stores.leases.current(T, "r9") is None
            await stores.create_schema()
            run = await runner.run(BOOKING, "go", tenant=T, run_id="r9")
            assert run.status.value == "completed"
            [rec] = [r for r in await stores.idempotency.records(T, "r9") if r.tool]
            assert rec.status is RecordStatus.completed
