"""Attacks on README guarantee 7 ("Redact before sizing, once, everywhere"): secrets planted
in every input channel of a real ``AgentRunner`` run on SQLite (and memory://), then looked
for in every byte the kit persists or emits: every table and the raw database, WAL and shm
files, log records at DEBUG, OpenTelemetry spans, the CLI's output, ``last_error`` and the
work queue's reasons. Also "a masked call is never sent", after approval, after
``resolve --never-ran``, after a crash before the claim, and on replay.

A strict xfail is a defect found (its reason says which); a plain test is a promise that held.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import logging
import sqlite3
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pydantic
import pytest

from tesserix_adk import (
    Agent,
    AgentRunner,
    LeasePolicy,
    Message,
    RunStatus,
    ScriptedProvider,
    ScriptedTurn,
    TextPart,
    ToolContext,
    ToolOutcomeUnknownError,
    open_stores,
    tool,
)
from tesserix_adk.cli.main import main as cli_main
from tesserix_adk.errors import IndeterminateToolCallError
from tesserix_adk.reconcile import Reconciled
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.testing.faults import SimulatedCrash

T = "acme"


# --- planted secrets ------------------------------------------------------------------------


def openai(tag: str) -> str:
    return f"sk-proj-{tag}aaaaaaaaaaaaaaaaaaaa1"


def anthropic(tag: str) -> str:
    return f"sk-ant-api03-{tag}bbbbbbbbbbbbbbbbbbbb2"


def bearer(tag: str) -> str:
    return f"Bearer {tag}c3c3c3c3c3c3c3"


def github(tag: str) -> str:
    return "ghp_" + (tag + "d" * 40)[:40]


def slack(tag: str) -> str:
    return f"xoxb-1234567890-{tag}"


def jwt(tag: str) -> str:
    return f"eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxIn0.{tag}sig0123"


def aws_id(tag: str) -> str:
    return "AKIA" + (tag.upper() + "Z" * 16)[:16]


def pem(tag: str) -> str:
    return (
        "-----BEGIN RSA PRIVATE KEY-----\n"
        f"MIIEowIBAAKCAQEA{tag}0123456789abcdefghijklmnopqrstuv\n"
        "MIIEowIBAAKCAQEA0123456789abcdefghijklmnopqrstuvwxyz\n"
        "-----END RSA PRIVATE KEY-----"
    )


def url_password(tag: str) -> str:
    return f"postgres://bob:{tag}pw@db.example:5432/app"


class Planted:
    """Distinct needles, one per channel; each secret carries its needle."""

    def __init__(self) -> None:
        self.needles: dict[str, str] = {}

    def tag(self, channel: str) -> str:
        needle = f"QZ{len(self.needles):02d}{channel.upper().replace('_', '')}QZ"
        assert needle.isalnum()
        self.needles[channel] = needle
        return needle

    def found_in(self, blob: str | bytes) -> list[str]:
        text = blob.decode("utf-8", "replace") if isinstance(blob, bytes) else blob
        return sorted(ch for ch, needle in self.needles.items() if needle in text)


# --- what the kit left behind ---------------------------------------------------------------


def sqlite_everything(path: Path) -> bytes:
    """The database, WAL and shm files as raw bytes, and every row of every table."""
    out = bytearray()
    for suffix in ("", "-wal", "-shm", "-journal"):
        f = Path(str(path) + suffix)
        if f.exists():
            out += f.read_bytes()
    with contextlib.closing(sqlite3.connect(path)) as db:
        tables = [r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")]
        for table in tables:
            for row in db.execute(f'SELECT * FROM "{table}"'):
                for cell in row:
                    out += cell if isinstance(cell, bytes) else str(cell).encode()
                    out += b"\n"
    return bytes(out)


def object_graph_text(root: Any) -> str:
    """Every string and bytes reachable from ``root`` (memory stores hold them in objects)."""
    seen: set[int] = set()
    out: list[str] = []
    stack = [root]
    while stack:
        item = stack.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, str):
            out.append(item)
        elif isinstance(item, bytes | bytearray):
            out.append(bytes(item).decode("utf-8", "replace"))
        elif isinstance(item, Mapping):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list | tuple | set | frozenset):
            stack.extend(item)
        elif item is None or isinstance(item, int | float | bool):
            continue
        else:
            mod = type(item).__module__
            if not (mod.startswith("tesserix_adk") or mod.startswith("collections")):
                continue
            if hasattr(item, "__dict__"):
                stack.extend(vars(item).values())
            for slot in getattr(type(item), "__slots__", ()):
                with contextlib.suppress(AttributeError):
                    stack.append(getattr(item, slot))
    return "\n".join(out)


def cli(*argv: str) -> str:
    """``tesserix ARGV``, in process; stdout and stderr together, whatever the exit code."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli_main(list(argv))
    return f"exit {code}\n{out.getvalue()}\n{err.getvalue()}"


def cli_views(url: str, run_id: str, tenant: str = T) -> str:
    """Everything an operator reads about a run from the command line."""
    views = [
        cli("runs", "--tenant", tenant, "--store", url, "--json"),
        cli("runs", "--tenant", tenant, "--store", url, "--stuck"),
        cli("runs", "--tenant", tenant, "--store", url, "--header"),
    ]
    for command in ("show", "inspect", "steps"):
        views.append(cli(command, run_id, "--tenant", tenant, "--store", url))
        views.append(cli(command, run_id, "--tenant", tenant, "--store", url, "--json"))
    listed = cli("steps", run_id, "--tenant", tenant, "--store", url, "--json")
    steps = json.loads(listed[7:].split("\n\n")[0]) if listed.startswith("exit 0") else {}
    for step in steps.get("steps", []):
        n = str(step["step"])
        views.append(cli("show", run_id, "--tenant", tenant, "--store", url, "--step", n))
        views.append(cli("show", run_id, "--tenant", tenant, "--store", url, "--step", n, "--json"))
    return "\n".join(views)


def log_text(caplog: pytest.LogCaptureFixture) -> str:
    return "\n".join(
        f"{r.name} {r.getMessage()} {r.exc_text or ''} {r.args!r}" for r in caplog.records
    )


async def _opened(url: str) -> Stores:
    stores = open_stores(url)
    await stores.create_schema()
    return stores


def _runner(provider: Any, stores: Stores, **kwargs: Any) -> AgentRunner:
    return AgentRunner.from_stores(
        provider, stores, lease_policy=LeasePolicy(ttl=1, renew_within=0.5), **kwargs
    )


# --- the whole run, every channel at once ----------------------------------------------------


class Profile(pydantic.BaseModel):
    """A typed state with secrets in it, and a numeric "token" that must survive."""

    password: str = ""
    token: int = 0
    openai_api_key: str = ""
    notes: dict[str, Any] = {}
    visits: int = 0


@dataclass
class Everything:
    planted: Planted
    agent: Agent
    provider: ScriptedProvider
    sent: list[Any]
    user_in: str
    state: Profile


def everything_run() -> Everything:
    """An agent whose every channel carries a planted secret of its own."""
    p = Planted()
    sent: list[Any] = []
    user_in = f"my key is {openai(p.tag('input'))} and {bearer(p.tag('input_bearer'))}"
    args = {
        "query": "flights",
        "headers": {"x-api-key": f"k-{p.tag('arg_xapikey')}"},
        "nested": {"clientSecret": f"s-{p.tag('arg_clientsecret')}", "list": [1, 2]},
        "accessToken": f"t-{p.tag('arg_accesstoken')}",
    }
    pw_a, pw_b = p.tag("json_dup_a"), p.tag("json_dup_b")
    results = {
        "plain": f"here: {github(p.tag('result_github'))} done",
        "json_text": json.dumps(
            {"ok": True, "db": {"password": f"x{pw_a}"}, "url": url_password(p.tag("json_url"))}
        )[:-1]
        + f', "password": "y{pw_b}"}}',
        "nested": {
            "items": [
                {"accessToken": f"a-{p.tag('nested_access')}", "id": 1},
                ["deep", {"token": [f"l-{p.tag('nested_list_token')}", 2]}],
            ],
            "pem": pem(p.tag("nested_pem")),
            f"{openai(p.tag('dict_key'))}": "a secret as a dict KEY",
            "aws": aws_id(p.tag("aws")),
            "jwt": jwt(p.tag("jwt")),
        },
        "bytes": f"bytes {anthropic(p.tag('bytes'))}".encode(),
        "mcp": {
            "content": [{"type": "text", "text": f"see {slack(p.tag('mcp_text'))}"}],
            "structuredContent": {"apiKey": f"m-{p.tag('mcp_struct')}", "n": 3},
            "isError": False,
        },
        "large": "x" * 40_000
        + f" {openai(p.tag('large_mid'))} "
        + "y" * 40_000
        + f"\npassword: z{p.tag('large_tail')}",
        "unicode_escaped": '{"note": "\\u0073k-proj-'
        + p.tag("json_u_escape")
        + 'aaaaaaaaaaaaaaaaaaaa"}',
        "url_encoded": f"dsn https://bob:p%40ss%3A{p.tag('url_encoded')}@api.example/x",
    }
    deep: Any = f"at the bottom {openai(p.tag('near_cap'))}"
    for _ in range(40):
        deep = {"level": deep}
    results["near_cap"] = deep
    boom = f"upstream refused {aws_id(p.tag('exc_aws'))} with password={p.tag('exc_pw')}"
    model_text_1 = f"looking, {slack(p.tag('model_text'))}"
    final = f"done, {jwt(p.tag('final'))} / clientSecret: {p.tag('final_kv')}"
    # A run may not start with a secret in its state (it could not be resumed), so the
    # tool puts them there mid-run: every later frontier keeps them masked.
    state = Profile(token=42)
    secret_state = {
        "password": f"s3cret-{p.tag('state_pw')}",
        "openai_api_key": f"o-{p.tag('state_key')}",
        "notes": {"refreshToken": f"r-{p.tag('state_refresh')}", "free": bearer(p.tag("state"))},
    }

    @tool(side_effects=False)
    def search(
        query: str,
        ctx: ToolContext,
        nested: dict[str, Any] | None = None,
        headers: dict[str, str] | None = None,
        accessToken: str = "",
    ) -> dict[str, Any]:
        """Search (read-only); stores a secret in the typed state too."""
        sent.append(("search", query))
        ctx.state.visits += 1
        for name, value in secret_state.items():
            setattr(ctx.state, name, value)
        return {"found": 2}

    @tool(side_effects=False)
    def fetch(kind: str) -> Any:
        """Return one of the planted results."""
        sent.append(("fetch", kind))
        return results[kind]

    @tool(side_effects=False)
    def explode() -> str:
        """Raise with a secret in the message."""
        raise RuntimeError(boom)

    turns: list[Any] = [
        ScriptedTurn(text=model_text_1, calls=[("search", args)]),
        [("fetch", {"kind": k}) for k in results],
        [("explode", {})],
        final,
    ]
    agent = Agent("everything", "Plant.", [search, fetch, explode], state_schema=Profile)
    return Everything(
        planted=p,
        agent=agent,
        provider=ScriptedProvider(turns),
        sent=sent,
        user_in=user_in,
        state=state,
    )


def test_every_channel_of_a_whole_run_is_masked_in_sqlite_logs_and_cli(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    world = everything_run()
    db = tmp_path / "adk.sqlite3"
    url = f"sqlite:///{db}"

    async def go() -> Any:
        stores = await _opened(url)
        try:
            runner = _runner(world.provider, stores)
            return await runner.run(
                world.agent, world.user_in, tenant=T, run_id="r1", state=world.state
            )
        finally:
            await stores.aclose()

    run = asyncio.run(go())
    assert run.status is RunStatus.completed
    assert ("search", "flights") in world.sent  # live, the real arguments go out once
    stored = sqlite_everything(db)
    assert b"[redacted:" in stored
    assert world.planted.found_in(stored) == []
    assert world.planted.found_in(log_text(caplog)) == []
    views = cli_views(url, "r1")
    assert "[redacted:" in views
    assert world.planted.found_in(views) == []
    # The numeric token under a secret-named key stays (documented), so the state resumes.
    assert b'"token":42' in stored or b'"token": 42' in stored


def test_every_channel_of_a_whole_run_is_masked_in_memory_stores(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    world = everything_run()

    async def go() -> tuple[Any, str]:
        stores = await _opened("memory://")
        runner = _runner(world.provider, stores)
        run = await runner.run(world.agent, world.user_in, tenant=T, run_id="r1", state=world.state)
        held = object_graph_text(stores)
        await stores.aclose()
        return run, held

    run, held = asyncio.run(go())
    assert run.status is RunStatus.completed
    assert "[redacted:" in held and "flights" in held  # the walk reached the stored payloads
    assert world.planted.found_in(held) == []
    assert world.planted.found_in(log_text(caplog)) == []


def test_spans_with_captured_content_hold_no_planted_secret(tmp_path: Path) -> None:
    from otel_spans.world import Pipeline

    world = everything_run()
    pipeline = Pipeline(capture_content=True)
    url = f"sqlite:///{tmp_path / 'adk.sqlite3'}"

    async def go() -> Any:
        stores = await _opened(url)
        try:
            runner = _runner(world.provider, stores, telemetry=pipeline.telemetry)
            return await runner.run(
                world.agent, world.user_in, tenant=T, run_id="r1", state=world.state
            )
        finally:
            await stores.aclose()

    assert asyncio.run(go()).status is RunStatus.completed
    spans = pipeline.spans()
    dumped = "\n".join(
        f"{s.name} {dict(s.attributes or {})} {s.status.description} "
        f"{[(e.name, dict(e.attributes or {})) for e in s.events]} "
        f"{[dict(link.attributes or {}) for link in s.links]}"
        for s in spans
    )
    assert "gen_ai.tool.call.result" in dumped and "[redacted:" in dumped
    assert world.planted.found_in(dumped) == []


# --- a masked call is never sent --------------------------------------------------------------


class Recording:
    """A provider that keeps every request (what the model was told)."""

    def __init__(self, turns: list[Any]) -> None:
        self.inner = ScriptedProvider(turns)
        self.requests: list[Any] = []

    async def complete(self, request: Any) -> Any:
        self.requests.append(request)
        return await self.inner.complete(request)

    def told(self) -> list[str]:
        return [m.text for r in self.requests for m in r.messages if m.role == "tool"]


def test_an_approved_call_with_a_secret_is_not_sent_and_the_note_is_masked(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    p = Planted()
    url = f"sqlite:///{tmp_path / 'adk.sqlite3'}"
    sent: list[dict[str, Any]] = []

    @tool(requires_approval=True)
    def pay(card: str, amount: int) -> str:
        """Pay (needs a person)."""
        sent.append({"card": card, "amount": amount})
        return "paid"

    agent = Agent("payer", "Pay.", [pay])
    provider = Recording([[("pay", {"card": openai(p.tag("approval_arg")), "amount": 5})], "ok"])

    async def start() -> Any:
        stores = await _opened(url)
        try:
            return await _runner(provider, stores).run(agent, "pay", tenant=T, run_id="r1")
        finally:
            await stores.aclose()

    run = asyncio.run(start())
    assert run.status is RunStatus.waiting_approval and run.pending_approval is not None
    note = f"fine, charge it with {anthropic(p.tag('note'))} / password={p.tag('note_kv')}"
    said = cli(
        "approve",
        run.pending_approval.id,
        "--tenant",
        T,
        "--by",
        "alice",
        "--note",
        note,
        "--store",
        url,
    )
    assert said.startswith("exit 0"), said

    async def resume() -> Any:
        stores = await _opened(url)
        try:
            return await _runner(provider, stores).resume(agent, "r1", tenant=T)
        finally:
            await stores.aclose()

    assert asyncio.run(resume()).status is RunStatus.completed
    assert sent == []  # never sent with masked arguments
    assert any(t.startswith("not sent") for t in provider.told()), provider.told()
    everything = sqlite_everything(tmp_path / "adk.sqlite3").decode("utf-8", "replace")
    everything += said + cli_views(url, "r1") + log_text(caplog)
    assert p.found_in(everything) == []


def _crash_inside(sent: list[Any], die: list[bool]) -> Any:
    @tool
    def book(flight: str, note: str) -> dict[str, str]:
        """Book a seat (side-effecting, keyed)."""
        sent.append((flight, note))
        if die and die.pop():
            raise SimulatedCrash("killed inside book")
        return {"booking": "BK-1"}

    return book


def _until_not_held(*argv: str) -> str:
    """The command, again while it says "held elsewhere" (a lapsing lease), a few times."""
    for _ in range(40):
        said = cli(*argv)
        if not said.startswith("exit 3"):
            return said
        import time

        time.sleep(0.25)
    return said


def test_resolve_never_ran_does_not_send_a_masked_call_and_resolve_outcome_is_masked(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    p = Planted()
    url = f"sqlite:///{tmp_path / 'adk.sqlite3'}"
    sent: list[Any] = []
    agent = Agent("booker", "Book.", [_crash_inside(sent, [True, True])])
    masked = Recording([[("book", {"flight": "LH1", "note": bearer(p.tag("crash_arg"))})], "ok"])
    clean = Recording([[("book", {"flight": "LH2", "note": "window seat"})], "ok"])

    async def go(provider: Recording, run_id: str, *, resume: bool) -> Any:
        stores = await _opened(url)
        try:
            runner = _runner(provider, stores)
            if resume:
                return await runner.resume(agent, run_id, tenant=T)
            return await runner.run(agent, "book", tenant=T, run_id=run_id)
        finally:
            await stores.aclose()

    for provider, run_id in ((masked, "r1"), (clean, "r2")):
        with pytest.raises(SimulatedCrash):  # killed inside the tool: the call is in doubt
            asyncio.run(go(provider, run_id, resume=False))
        with pytest.raises(IndeterminateToolCallError):
            asyncio.run(go(provider, run_id, resume=True))
    assert [flight for flight, _ in sent] == ["LH1", "LH2"]
    said = _until_not_held(
        "resolve",
        "r1",
        "--tenant",
        T,
        "--call",
        "call_0_0",
        "--never-ran",
        "--margin",
        "0",
        "--by",
        "oncall",
        "--store",
        url,
    )
    assert said.startswith("exit 0"), said
    outcome = json.dumps(
        {
            "booking": "BK-2",
            "credentials": {"user": "bob", "pw": f"p-{p.tag('outcome_nested')}"},
            "receipt": f"charged with {openai(p.tag('outcome_text'))}",
            "token": [f"t-{p.tag('outcome_list')}"],
        }
    )
    resolved = _until_not_held(
        "resolve",
        "r2",
        "--tenant",
        T,
        "--call",
        "call_0_0",
        "--outcome",
        outcome,
        "--by",
        "oncall",
        "--store",
        url,
    )
    assert resolved.startswith("exit 0"), resolved
    assert asyncio.run(go(masked, "r1", resume=True)).status is RunStatus.completed
    assert asyncio.run(go(clean, "r2", resume=True)).status is RunStatus.completed
    assert len(sent) == 2  # the masked call was not sent again after --never-ran
    assert any(t.startswith("not sent") for t in masked.told()), masked.told()
    assert any("BK-2" in t and "[redacted:" in t for t in clean.told()), clean.told()
    everything = sqlite_everything(tmp_path / "adk.sqlite3").decode("utf-8", "replace")
    everything += said + resolved + cli_views(url, "r1") + cli_views(url, "r2")
    assert p.found_in(everything + log_text(caplog)) == []


def test_a_masked_call_never_claimed_before_a_crash_is_not_sent_on_resume(tmp_path: Path) -> None:
    from tesserix_adk import Checkpointer
    from tesserix_adk.testing.faults import FaultyIdempotencyStore

    p = Planted()
    url = f"sqlite:///{tmp_path / 'adk.sqlite3'}"
    sent: list[Any] = []
    book = _crash_inside(sent, [])
    agent = Agent("booker", "Book.", [book])
    provider = Recording([[("book", {"flight": "LH1", "note": slack(p.tag("unclaimed"))})], "ok"])

    def die_at_claim(when: str, op: str, key: str) -> None:
        if when == "before" and op == "claim":
            raise SimulatedCrash("killed before the claim")

    async def once(crash: bool) -> Any:
        stores = await _opened(url)
        idem: Any = stores.idempotency
        if crash:
            idem = FaultyIdempotencyStore(stores.idempotency, hook=die_at_claim)
        runner = AgentRunner(
            provider,
            idempotency=idem,
            checkpoints=Checkpointer.from_stores(stores),
            leases=stores.leases,
            lease_policy=LeasePolicy(ttl=1, renew_within=0.5),
        )
        try:
            if crash:
                return await runner.run(agent, "book", tenant=T, run_id="r1")
            for _ in range(40):
                try:
                    return await runner.resume(agent, "r1", tenant=T)
                except Exception as exc:  # the dead attempt's lease lapses first
                    if "held" not in str(exc) and "leased" not in str(exc):
                        raise
                    await asyncio.sleep(0.25)
            raise AssertionError("the lease never lapsed")
        finally:
            await stores.aclose()

    with pytest.raises(SimulatedCrash):
        asyncio.run(once(crash=True))
    run = asyncio.run(once(crash=False))
    assert run.status is RunStatus.completed
    assert sent == []
    assert any(t.startswith("not sent") for t in provider.told()), provider.told()
    assert p.found_in(sqlite_everything(tmp_path / "adk.sqlite3")) == []


def test_replay_refuses_a_live_tool_with_masked_arguments(tmp_path: Path) -> None:
    from tesserix_adk.errors import ConfigurationError

    p = Planted()
    sent: list[Any] = []

    @tool(side_effects=False)
    def look(q: str) -> str:
        """Read-only."""
        sent.append(q)
        return "seen"

    agent = Agent("looker", "Look.", [look])
    provider = ScriptedProvider([[("look", {"q": openai(p.tag("replay_arg"))})], "ok"])

    async def go() -> None:
        stores = await _opened(f"sqlite:///{tmp_path / 'adk.sqlite3'}")
        try:
            runner = _runner(provider, stores)
            await runner.run(agent, "look", tenant=T, run_id="r1")
            assert len(sent) == 1
            with pytest.raises(ConfigurationError, match="redacted"):
                await runner.replay(agent, "r1", tenant=T, from_step=1, stubs={}, live=("look",))
            got: list[Any] = []
            replayed = await runner.replay(
                agent, "r1", tenant=T, from_step=1, stubs={"look": lambda q: got.append(q)}
            )
            assert replayed.status is RunStatus.completed
            assert len(sent) == 1 and got == ["[redacted:openai_key]"]
        finally:
            await stores.aclose()

    asyncio.run(go())
    assert p.found_in(sqlite_everything(tmp_path / "adk.sqlite3")) == []


# --- operator and worker channels ------------------------------------------------------------


def test_cancel_reason_and_worker_park_reason_are_masked(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from tesserix_adk import Worker

    caplog.set_level(logging.DEBUG)
    p = Planted()
    url = f"sqlite:///{tmp_path / 'adk.sqlite3'}"
    agent = Agent("sleepy", "Wait.", [])
    reason = f"leaked key {openai(p.tag('cancel'))}; token={p.tag('cancel_kv')}"
    blow = f"model gateway refused {bearer(p.tag('park'))} password={p.tag('park_kv')}"

    class Broken:
        async def complete(self, request: Any) -> Any:
            raise RuntimeError(blow)

    async def submit_and_work() -> None:
        stores = await _opened(url)
        try:
            runner = _runner(Broken(), stores)
            await runner.submit(agent, f"go {jwt(p.tag('submitted'))}", tenant=T, run_id="w1")
            await Worker(runner, [agent], exit_when_idle=True, max_attempts=1).run()
            await runner.submit(agent, "go", tenant=T, run_id="c1")
        finally:
            await stores.aclose()

    asyncio.run(submit_and_work())
    said = cli("cancel", "c1", "--tenant", T, "--by", "alice", "--reason", reason, "--store", url)
    assert said.startswith("exit 0"), said
    views = cli_views(url, "w1") + cli_views(url, "c1") + said
    everything = sqlite_everything(tmp_path / "adk.sqlite3").decode("utf-8", "replace")
    assert "model gateway refused Bearer [redacted:bearer]" in everything  # the park reason
    assert "leaked key [redacted:openai_key]; token=[redacted:token]" in everything
    assert p.found_in(everything + views + log_text(caplog)) == []


def test_last_error_and_its_log_line_are_masked(caplog: pytest.LogCaptureFixture) -> None:
    from tesserix_adk import Checkpointer, MemoryCheckpointStore, MemoryIdempotencyStore
    from tesserix_adk.errors import StoreUnavailableError
    from tesserix_adk.testing.faults import FaultyCheckpointStore

    caplog.set_level(logging.DEBUG)
    p = Planted()
    failing = FaultyCheckpointStore(
        MemoryCheckpointStore(),
        fail_with=StoreUnavailableError(f"cannot reach {url_password(p.tag('last_error'))}"),
    )
    checkpoints = Checkpointer(failing)
    runner = AgentRunner(
        ScriptedProvider(["done"]), idempotency=MemoryIdempotencyStore(), checkpoints=checkpoints
    )
    run = asyncio.run(runner.run(Agent("a", "i"), "hi", tenant=T, run_id="r1"))
    assert run.status is RunStatus.completed
    assert checkpoints.last_error is not None
    assert "[redacted:url_password]" in str(checkpoints.last_error)
    assert p.found_in(str(checkpoints.last_error) + repr(checkpoints.last_error)) == []
    assert p.found_in(log_text(caplog)) == []


def test_a_secret_split_across_stream_chunks_is_stored_masked(tmp_path: Path) -> None:
    from tesserix_adk import ModelResponse, RunFinished, TextDelta

    p = Planted()
    secret = openai(p.tag("stream"))

    class Chunky:
        async def complete(self, request: Any) -> Any:
            return ModelResponse(message=Message.assistant(f"key: {secret} end"))

        async def complete_streaming(self, request: Any, on_text: Any) -> Any:
            text = f"key: {secret} end"
            for i in range(0, len(text), 3):  # cut mid-token
                on_text(text[i : i + 3])
                await asyncio.sleep(0)
            return await self.complete(request)

    url = f"sqlite:///{tmp_path / 'adk.sqlite3'}"

    async def go() -> list[Any]:
        stores = await _opened(url)
        events: list[Any] = []
        try:
            runner = _runner(Chunky(), stores)
            async with contextlib.aclosing(
                runner.stream(Agent("s", "i"), "hi", tenant=T, run_id="r1")
            ) as stream:
                async for event in stream:
                    events.append(event)
        finally:
            await stores.aclose()
        return events

    events = asyncio.run(go())
    assert isinstance(events[-1], RunFinished)
    assert len([e for e in events if isinstance(e, TextDelta)]) > 5
    assert p.found_in(sqlite_everything(tmp_path / "adk.sqlite3")) == []
    assert p.found_in(cli_views(url, "r1")) == []


# --- free text and keys: what held ----------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        "plain {s}",
        "quoted '{s}' and \"{s}\"",
        "line one\n{s}\nline two",  # a real newline before it
        "in a url https://x.example/?k={s}",
        "after a backslash \\{s}",
    ],
)
def test_a_secret_in_free_text_forms_is_masked_in_the_stored_error(
    tmp_path: Path, text: str
) -> None:
    p = Planted()
    message = text.format(s=openai(p.tag("form")))
    stored, _ = _tool_error_run(tmp_path, RuntimeError(message))
    assert p.found_in(stored) == []


def _tool_error_run(tmp_path: Path, error: BaseException, **kwargs: Any) -> tuple[str, Any]:
    """A run whose one tool raises ``error``; what SQLite and ``show`` hold, and the run."""
    url = f"sqlite:///{tmp_path / 'adk.sqlite3'}"

    @tool(side_effects=False)
    def call_api(path: str) -> str:
        """Call an upstream API."""
        raise error

    async def go() -> Any:
        stores = await _opened(url)
        try:
            runner = _runner(
                ScriptedProvider([[("call_api", {"path": "/v1/x"})], "done"]), stores, **kwargs
            )
            return await runner.run(Agent("api", "Call.", [call_api]), "go", tenant=T, run_id="r1")
        finally:
            await stores.aclose()

    try:
        run: Any = asyncio.run(go())
    except Exception as exc:  # the tool's own exception, raised to the caller
        run = exc
    stored = sqlite_everything(tmp_path / "adk.sqlite3").decode("utf-8", "replace")
    return stored + cli_views(url, "r1"), run


# --- defects ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(
            lambda p: f"upstream said {('error' + chr(10) + openai(p.tag('e')))!r}",
            id="repr-newline-openai",
        ),
        pytest.param(
            lambda p: 'HTTP 400: {"error": "bad key\\n' + github(p.tag("e")) + '"}',
            id="json-body-in-text-github",
        ),
        pytest.param(
            lambda p: repr({"hdr": "x\tBearer " + p.tag("e") + "c3c3c3c3c3"}),
            id="repr-tab-bearer",
        ),
        pytest.param(
            lambda p: repr("config:\npassword=" + p.tag("e")), id="repr-newline-password-kv"
        ),
    ],
)
def test_a_secret_after_an_escaped_newline_in_a_tool_error_is_masked(
    tmp_path: Path, make: Any
) -> None:
    p = Planted()
    stored, run = _tool_error_run(tmp_path, RuntimeError(make(p)))
    assert run.status is RunStatus.completed
    assert p.found_in(stored) == []


def test_a_lost_reply_message_is_masked_in_the_runner_log(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    p = Planted()
    error = ToolOutcomeUnknownError(
        f"timed out after sending to {url_password(p.tag('lost_url'))} "
        f"with {bearer(p.tag('lost_bearer'))}"
    )
    stored, run = _tool_error_run(tmp_path, error)
    assert isinstance(run, ToolOutcomeUnknownError)
    assert p.found_in(stored) == []  # the stores hold nothing of it (this part holds)
    assert p.found_in(log_text(caplog)) == []


def test_a_failing_reconciler_message_is_masked_in_the_runner_log(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    p = Planted()
    url = f"sqlite:///{tmp_path / 'adk.sqlite3'}"
    die = [True]

    def lookup(call: Any, ctx: ToolContext) -> Reconciled:
        raise RuntimeError(f"airline API rejected {github(p.tag('reconciler'))}")

    @tool(reconcile=lookup)
    def book(flight: str) -> str:
        """Book (keyed, with a reconciler)."""
        if die and die.pop():
            raise SimulatedCrash("killed inside book")
        return "BK-1"

    agent = Agent("booker", "Book.", [book])
    provider = ScriptedProvider([[("book", {"flight": "LH1"})], "ok"])

    async def go(resume: bool) -> Any:
        stores = await _opened(url)
        try:
            runner = _runner(provider, stores, never_ran_margin=0)
            if resume:
                return await runner.resume(agent, "r1", tenant=T)
            return await runner.run(agent, "book", tenant=T, run_id="r1")
        finally:
            await stores.aclose()

    with pytest.raises(SimulatedCrash):
        asyncio.run(go(False))
    with pytest.raises(IndeterminateToolCallError):
        asyncio.run(go(True))
    assert any("reconciler of book" in r.getMessage() for r in caplog.records)
    assert p.found_in(sqlite_everything(tmp_path / "adk.sqlite3")) == []  # holds
    assert p.found_in(log_text(caplog)) == []


def test_a_secret_as_a_model_asked_tool_name_is_masked(tmp_path: Path) -> None:
    p = Planted()
    url = f"sqlite:///{tmp_path / 'adk.sqlite3'}"
    name = openai(p.tag("tool_name"))

    async def go() -> Any:
        stores = await _opened(url)
        try:
            runner = _runner(ScriptedProvider([[(name, {"x": 1})], "ok"]), stores)
            return await runner.run(Agent("a", "i"), "hi", tenant=T, run_id="r1")
        finally:
            await stores.aclose()

    assert asyncio.run(go()).status is RunStatus.completed
    assert p.found_in(sqlite_everything(tmp_path / "adk.sqlite3")) == []


def test_a_secret_split_across_two_text_parts_is_masked(tmp_path: Path) -> None:
    p = Planted()
    url = f"sqlite:///{tmp_path / 'adk.sqlite3'}"
    secret = openai(p.tag("split"))  # sk-proj-QZ00SPLITQZaaaa...
    head, tail = secret[:14], secret[14:]
    message = Message.user([TextPart(text=f"my key is {head}"), TextPart(text=tail)])
    assert message.text.endswith(secret)

    async def go() -> Any:
        stores = await _opened(url)
        try:
            runner = _runner(ScriptedProvider(["ok"]), stores)
            return await runner.run(Agent("a", "i"), [message], tenant=T, run_id="r1")
        finally:
            await stores.aclose()

    assert asyncio.run(go()).status is RunStatus.completed
    stored = sqlite_everything(tmp_path / "adk.sqlite3").decode("utf-8", "replace")
    assert not (head in stored and tail in stored)


def test_a_value_under_pgpassword_is_masked(tmp_path: Path) -> None:
    p = Planted()
    env = {"PGPASSWORD": f"pw-{p.tag('pgpassword')}"}
    stored, run = _result_run(tmp_path, {"env": env})
    assert run.status is RunStatus.completed
    assert p.found_in(stored) == []


def test_values_under_documented_secret_names_are_masked(tmp_path: Path) -> None:
    p = Planted()
    names = [
        "password",
        "token",
        "accessToken",
        "clientSecret",
        "openai_api_key",
        "x-api-key",
        "X-Api-Key",
        "db.password",
        "PG_PASSWORD",
        "Authorization",
        "Cookie",
        "credentials",
        "secret_access_key",
        "private_key",
        "apiKey",
        "APIKey",
    ]
    result = {
        name: f"v-{p.tag(name.replace('.', '').replace('-', '').replace('_', ''))}"
        for name in names
    }
    result["paging"] = {"next_page_token": "keep-me", "input_tokens": 12, "token": 7}
    stored, run = _result_run(tmp_path, result)
    assert run.status is RunStatus.completed
    assert p.found_in(stored) == []
    assert "keep-me" in stored  # pagination tokens stay, as documented


def _result_run(tmp_path: Path, result: Any) -> tuple[str, Any]:
    """A run whose one tool returns ``result``; what SQLite and ``show`` hold, and the run."""
    url = f"sqlite:///{tmp_path / 'adk.sqlite3'}"

    @tool(side_effects=False)
    def read() -> Any:
        """Return the planted result."""
        return result

    async def go() -> Any:
        stores = await _opened(url)
        try:
            runner = _runner(ScriptedProvider([[("read", {})], "done"]), stores)
            return await runner.run(Agent("r", "Read.", [read]), "go", tenant=T, run_id="r1")
        finally:
            await stores.aclose()

    run = asyncio.run(go())
    stored = sqlite_everything(tmp_path / "adk.sqlite3").decode("utf-8", "replace")
    return stored + cli_views(url, "r1"), run


def test_json_text_with_a_long_integer_still_masks_nested_credentials(tmp_path: Path) -> None:
    p = Planted()
    text = (
        '{"serial": '
        + "7" * 5000
        + ', "credentials": {"user": "bob", "pw": "'
        + p.tag("long_int_json")
        + '"}, "token": ["'
        + p.tag("long_int_list")
        + '"]}'
    )
    stored, run = _result_run(tmp_path, text)
    assert run.status is RunStatus.completed
    assert p.found_in(stored) == []


def test_json_text_masks_strings_nested_under_secret_named_keys(tmp_path: Path) -> None:
    p = Planted()
    text = json.dumps(
        {
            "msg": f"escaped newline\n{openai(p.tag('json_escaped_nl'))}",
            "serial": 7,
            "credentials": {"user": "bob", "pw": p.tag("json_nested")},
            "token": [p.tag("json_list")],
        }
    )
    stored, run = _result_run(tmp_path, text)
    assert run.status is RunStatus.completed
    assert p.found_in(stored) == []


@pytest.mark.parametrize("depth", [60, 63, 64, 70, 200])
def test_arguments_nested_near_and_past_the_cap_keep_their_secret_out_and_are_not_sent(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, depth: int
) -> None:
    caplog.set_level(logging.DEBUG)
    p = Planted()
    url = f"sqlite:///{tmp_path / 'adk.sqlite3'}"
    sent: list[Any] = []
    deep: Any = {openai(p.tag("deep_key")): f"v {bearer(p.tag('deep_value'))}"}
    for _ in range(depth):
        deep = {"d": deep}

    @tool(side_effects=False)
    def take(blob: dict[str, Any]) -> str:
        """Take a nested blob."""
        sent.append(1)
        return "taken"

    async def go() -> Any:
        stores = await _opened(url)
        try:
            runner = _runner(ScriptedProvider([[("take", {"blob": deep})], "ok"]), stores)
            return await runner.run(Agent("n", "i", [take]), "go", tenant=T, run_id="r1")
        finally:
            await stores.aclose()

    try:
        asyncio.run(go())
    except Exception as exc:  # a refusal to store is fine; a leak is not
        assert p.found_in(f"{exc!r} {exc}") == []
    stored = sqlite_everything(tmp_path / "adk.sqlite3").decode("utf-8", "replace")
    assert p.found_in(stored + cli_views(url, "r1") + log_text(caplog)) == []
    if depth >= 64:
        assert sent == []  # deeper than the cap: answered "not sent"
