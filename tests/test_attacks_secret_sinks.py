"""Attacks on README guarantee 7 (secrets never reach what the kit keeps or shows), sink by
sink rather than pattern by pattern. A few plainly secret values (an ``sk-proj-`` key, a
``password=`` pair, an ``Authorization: Bearer`` header, an AWS key id and secret) are
pushed through the places the kit writes or shows text, each carrying a needle of its own,
and every byte the kit kept (the SQLite file, WAL included; Redis keys under a prefix of
our own; PostgreSQL rows in a schema of our own) and showed (the CLI's ``runs``/``show``/
``inspect``/``steps`` in text and ``--json``, the console's HTML, log records at DEBUG,
OpenTelemetry spans with their events) is searched for the needles. What the model is
told live, and events handed to ``on_event`` (documented as unmasked), do not count.

Sinks: an approval's deny note and the decider's name (CLI and the store's own API), a
tool exception's notes (``add_note``) and chained cause, a reconciler's answer, a replay
stub's result and error, a worker name (the leases' holder), a cancel reason given
through ``runner.cancel``, a submitted input on Redis and PostgreSQL.

Found, and fixed (their tests pass now: a rule for 40 base64 characters right after a masked
key id, ``checkpoint/redaction/patterns.py``; every approval store masks the note and the
decider itself, ``stores/protocols/approvals.decision_texts``; a worker name is masked as
the runner and ``Resumer`` keep it):

1. (HIGH) ``test_an_aws_key_pair_whose_secret_has_no_slash_is_masked``: an AWS secret key
   after its key id (``AKIA…:<secret>``, the shape README names, or ``AKIA… <secret>``) is
   stored raw when its 40 characters hold no ``/`` or ``+`` (about 28% of real keys): the
   standalone ``aws_secret_key`` rule in ``checkpoint/redaction/patterns.py`` demands one.
2. (MEDIUM) ``test_a_note_decided_through_the_stores_api_is_not_stored_raw``: a note given
   to ``ApprovalStore.decide`` (README names deciding "through the store's API") is kept
   raw in ``adk_approvals.note``; only ``cli/frontier.py`` masks a note before deciding.
3. (MEDIUM) ``test_a_note_decided_through_the_stores_api_is_not_shown_by_show_or_the_console``:
   the same note is printed unmasked by ``tesserix show`` (text and ``--json``) and the
   console's run page, which print the row as stored ("Nothing secret is shown").
4. (LOW) ``test_a_secret_worker_name_is_not_kept_in_claims_or_shown``: a worker name holding
   a key is kept raw as a claim's holder (``adk_idempotency.holder``) and printed by
   ``show``/``inspect``/the console; ``run/ids.check_worker`` masks nothing (a cancel's
   ``by`` is masked before it names a holder).

Held: a deny note and the decider given to ``tesserix approve --deny`` (approvals row,
transcript, every CLI view, console, logs); a note decided through the store's API in the
run's own frontiers, steps and transcript (the model is told it masked), and in
``inspect``/``steps``; a tool exception's message, ``add_note`` notes and chained cause
(store, CLI, console, logs, spans with and without captured content); a provider's error
and its notes (store, views, spans, logs); a reconciler's answer (a secret-named key and
free text) recorded as ``reconciler:book``; a replay stub's result and error; a cancel's
reason and ``by`` through ``runner.cancel`` and a submitted input; on Redis (own prefix) and
PostgreSQL (own schema) a deny note, a tool error with notes and a submitted input.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import logging
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from tesserix_adk import (
    Agent,
    AgentRunner,
    LeasePolicy,
    RunStatus,
    ScriptedProvider,
    ToolContext,
    open_stores,
    tool,
)
from tesserix_adk.cli.main import main as cli_main
from tesserix_adk.reconcile import Reconciled
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.testing.faults import SimulatedCrash

T = "acme"


# --- the secrets -----------------------------------------------------------------------------


class Planted:
    """Needles, one per (channel, kind); each secret value carries its needle."""

    def __init__(self) -> None:
        self.needles: dict[str, str] = {}

    def _tag(self, name: str) -> str:
        needle = f"QZ{len(self.needles):02d}{name.upper().replace('_', '')[:10]}QZ"
        self.needles[name] = needle
        return needle

    def text(self, channel: str) -> str:
        """Free text holding the four secrets of ``channel``."""
        key = "sk-proj-" + (self._tag(f"{channel}_key") + "A1b2C3d4" * 6)[:40]
        pw = self._tag(f"{channel}_pw") + "x9"
        bearer = self._tag(f"{channel}_bearer") + "c3c3c3c3c3c3c3"
        akid = "AKIA" + (self._tag(f"{channel}_akid") + "Z" * 16)[:16]
        secret = (self._tag(f"{channel}_aws") + "wJalrXUtnFEMI/K7MDENG/bPxRfiCY9EXAMPLEKEY")[:40]
        return (
            f"used {key} with password={pw}; sent Authorization: Bearer {bearer}\n"
            f"aws {akid} {secret}"
        )

    def found_in(self, blob: str | bytes) -> list[str]:
        text = blob.decode("utf-8", "replace") if isinstance(blob, bytes) else blob
        return sorted(name for name, needle in self.needles.items() if needle in text)


# --- what the kit kept and showed ------------------------------------------------------------


def sqlite_bytes(path: Path) -> str:
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
    return bytes(out).decode("utf-8", "replace")


def cli(*argv: str) -> str:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli_main(list(argv))
    return f"exit {code}\n{out.getvalue()}\n{err.getvalue()}"


def cli_views(url: str, *run_ids: str) -> str:
    views = [
        cli("runs", "--tenant", T, "--store", url),
        cli("runs", "--tenant", T, "--store", url, "--json"),
        cli("runs", "--tenant", T, "--store", url, "--stuck"),
    ]
    for run_id in run_ids:
        for command in ("show", "inspect", "steps"):
            views.append(cli(command, run_id, "--tenant", T, "--store", url))
            views.append(cli(command, run_id, "--tenant", T, "--store", url, "--json"))
        listed = cli("steps", run_id, "--tenant", T, "--store", url, "--json")
        if listed.startswith("exit 0"):
            for step in json.loads(listed[7:].split("\n\n")[0]).get("steps", []):
                n = str(step["step"])
                views.append(cli("show", run_id, "--tenant", T, "--store", url, "--step", n))
    return "\n".join(views)


def console_pages(url: str, *run_ids: str) -> str:
    from starlette.testclient import TestClient

    from tesserix_adk.console import create_app

    pages = []
    with TestClient(create_app(url), base_url="http://127.0.0.1:8765") as client:
        for path in ["/", f"/t/{T}/runs"] + [f"/t/{T}/runs/{r}" for r in run_ids]:
            page = client.get(path)
            assert page.status_code == 200, (path, page.text[:300])
            pages.append(page.text)
    return "\n".join(pages)


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


# --- approvals: a deny note and the decider ------------------------------------------------


def _waiting(url: str, provider: Any) -> tuple[Agent, Any, list[Any]]:
    sent: list[Any] = []

    @tool(requires_approval=True)
    def refund(order: str) -> str:
        """Refund an order (needs a person)."""
        sent.append(order)
        return "refunded"

    agent = Agent("refunder", "Refund.", [refund])

    async def start() -> Any:
        stores = await _opened(url)
        try:
            return await _runner(provider, stores).run(agent, "refund", tenant=T, run_id="r1")
        finally:
            await stores.aclose()

    run = asyncio.run(start())
    assert run.status is RunStatus.waiting_approval and run.pending_approval is not None
    return agent, run, sent


def _resume(url: str, provider: Any, agent: Agent, run_id: str = "r1") -> Any:
    async def go() -> Any:
        stores = await _opened(url)
        try:
            return await _runner(provider, stores).resume(agent, run_id, tenant=T)
        finally:
            await stores.aclose()

    return asyncio.run(go())


def test_a_cli_deny_note_is_masked_in_every_store_view_page_and_log(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    p = Planted()
    url = f"sqlite:///{tmp_path / 'adk.sqlite3'}"
    provider = Recording([[("refund", {"order": "o-1"})], "ok"])
    agent, run, sent = _waiting(url, provider)
    note = "no: " + p.text("deny_note")
    said = cli(
        "approve", run.pending_approval.id, "--tenant", T, "--by", "alice", "--deny",
        "--note", note, "--store", url, "--json",
    )  # fmt: skip
    assert said.startswith("exit 0"), said
    assert _resume(url, provider, agent).status is RunStatus.completed
    assert sent == []
    # The model is told the (masked) note: the transcript keeps what it was told.
    assert any(t.startswith("denied by alice") for t in provider.told()), provider.told()
    everything = sqlite_bytes(tmp_path / "adk.sqlite3")
    assert "[redacted:" in everything
    shown = said + cli_views(url, "r1") + console_pages(url, "r1") + log_text(caplog)
    assert p.found_in(everything) == []
    assert p.found_in(shown) == []


def _decided_through_the_store(tmp_path: Path) -> tuple[Planted, str, Any, Any, list[Any]]:
    p = Planted()
    url = f"sqlite:///{tmp_path / 'adk.sqlite3'}"
    provider = Recording([[("refund", {"order": "o-1"})], "ok"])
    agent, run, sent = _waiting(url, provider)

    async def decide() -> None:
        stores = await _opened(url)
        try:
            await stores.approvals.decide(
                T, run.pending_approval.id, approved=False, by="ops", note=p.text("api_note")
            )
        finally:
            await stores.aclose()

    asyncio.run(decide())
    return p, url, agent, provider, sent


def test_a_note_decided_through_the_stores_api_is_not_stored_raw(tmp_path: Path) -> None:
    p, *_ = _decided_through_the_store(tmp_path)
    assert p.found_in(sqlite_bytes(tmp_path / "adk.sqlite3")) == []


def test_a_note_decided_through_the_stores_api_is_not_shown_by_show_or_the_console(
    tmp_path: Path,
) -> None:
    p, url, *_ = _decided_through_the_store(tmp_path)
    shown = cli("show", "r1", "--tenant", T, "--store", url)
    shown += cli("show", "r1", "--tenant", T, "--store", url, "--json")
    assert p.found_in(shown + console_pages(url, "r1")) == []


def test_a_note_decided_through_the_stores_api_is_masked_in_the_runs_own_records(
    tmp_path: Path,
) -> None:
    """The run carries the note on masked: its frontiers, steps and transcript hold none
    of it, nor what ``inspect`` and ``steps`` print."""
    p, url, agent, provider, sent = _decided_through_the_store(tmp_path)
    assert _resume(url, provider, agent).status is RunStatus.completed
    assert sent == []
    assert any("[redacted:" in t for t in provider.told()), provider.told()
    with contextlib.closing(sqlite3.connect(tmp_path / "adk.sqlite3")) as db:
        tables = [
            r[0]
            for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")
            if r[0] != "adk_approvals"
        ]
        kept = "\n".join(
            str(cell) for t in tables for row in db.execute(f'SELECT * FROM "{t}"') for cell in row
        )
    assert p.found_in(kept) == []
    views = [
        cli(c, "r1", "--tenant", T, "--store", url, *j)
        for c in ("inspect", "steps")
        for j in ((), ("--json",))
    ]
    assert p.found_in("\n".join(views)) == []


# --- a tool exception's notes and cause ---------------------------------------------------


def _telemetry(capture: bool) -> tuple[Any, Any]:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from tesserix_adk.telemetry import Telemetry

    exporter = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    return Telemetry(tracer_provider=tracer_provider, capture_content=capture), exporter


def spans_text(exporter: Any) -> str:
    out = []
    for span in exporter.get_finished_spans():
        out.append(span.name)
        out.append(repr(dict(span.attributes or {})))
        out.append(repr(span.status.description))
        for event in span.events:
            out.append(event.name + repr(dict(event.attributes or {})))
    return "\n".join(out)


@pytest.mark.parametrize("capture", [False, True])
def test_a_tool_exceptions_notes_and_cause_are_masked_everywhere(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, capture: bool
) -> None:
    caplog.set_level(logging.DEBUG)
    p = Planted()
    url = f"sqlite:///{tmp_path / 'adk.sqlite3'}"
    message, note, cause = p.text("exc_msg"), p.text("exc_note"), p.text("exc_cause")

    @tool(side_effects=False)
    def lookup(order: str) -> str:
        """Look an order up (read-only)."""
        try:
            raise ConnectionError(cause)
        except ConnectionError as inner:
            error = RuntimeError(message)
            error.add_note(note)
            raise error from inner

    agent = Agent("looker", "Look.", [lookup])
    provider = Recording([[("lookup", {"order": "o-1"})], "ok"])
    telemetry, exporter = _telemetry(capture)

    async def go() -> Any:
        stores = await _opened(url)
        try:
            return await _runner(provider, stores, telemetry=telemetry).run(
                agent, "look", tenant=T, run_id="r1"
            )
        finally:
            await stores.aclose()

    assert asyncio.run(go()).status is RunStatus.completed
    everything = sqlite_bytes(tmp_path / "adk.sqlite3")
    shown = cli_views(url, "r1") + console_pages(url, "r1") + log_text(caplog)
    assert p.found_in(everything) == []
    assert p.found_in(shown) == []
    assert p.found_in(spans_text(exporter)) == []


# --- a provider's error seen by the spans -----------------------------------------------------


def test_a_provider_error_is_masked_in_spans_logs_store_and_views(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    p = Planted()
    url = f"sqlite:///{tmp_path / 'adk.sqlite3'}"
    blow = p.text("provider")

    class Broken:
        async def complete(self, request: Any) -> Any:
            error = RuntimeError(blow)
            error.add_note(p.text("provider_note"))
            raise error

    telemetry, exporter = _telemetry(True)

    async def go() -> None:
        stores = await _opened(url)
        try:
            with contextlib.suppress(Exception):
                await _runner(Broken(), stores, telemetry=telemetry).run(
                    Agent("a", "i"), "hi", tenant=T, run_id="r1"
                )
        finally:
            await stores.aclose()

    asyncio.run(go())
    everything = sqlite_bytes(tmp_path / "adk.sqlite3")
    shown = cli_views(url, "r1") + console_pages(url, "r1") + log_text(caplog)
    assert p.found_in(everything + shown + spans_text(exporter)) == []


# --- a reconciler's answer --------------------------------------------------------------------


def test_a_reconcilers_answer_is_recorded_and_shown_masked(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    p = Planted()
    url = f"sqlite:///{tmp_path / 'adk.sqlite3'}"
    die = [True]
    answer = {"booking": "BK-1", "password": "hunter2-" + p._tag("rec_pwkey"), "log": p.text("rec")}

    def lookup(call: Any, ctx: ToolContext) -> Reconciled:
        return Reconciled.completed(answer)

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
    run = None
    for _ in range(30):  # the dead attempt's 1 s lease lapses
        try:
            run = asyncio.run(go(True))
            break
        except Exception as exc:  # held elsewhere, for a moment
            if not getattr(exc, "retryable", False):
                raise
            import time

            time.sleep(0.2)
    assert run is not None and run.status is RunStatus.completed
    everything = sqlite_bytes(tmp_path / "adk.sqlite3")
    assert "reconciler:book" in everything
    shown = cli_views(url, "r1") + console_pages(url, "r1") + log_text(caplog)
    assert p.found_in(everything) == []
    assert p.found_in(shown) == []


# --- a replay's stubs -----------------------------------------------------------------------


def test_a_replay_stubs_result_and_error_are_stored_masked(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    p = Planted()
    url = f"sqlite:///{tmp_path / 'adk.sqlite3'}"

    @tool
    def charge(order: str) -> str:
        """Charge an order (side-effecting)."""
        return "charged"

    agent = Agent("charger", "Charge.", [charge])
    turns = [[("charge", {"order": "o-1"})], [("charge", {"order": "o-2"})], "ok"]
    stub_result, stub_error = p.text("stub_ok"), p.text("stub_err")

    def stub(order: str) -> Any:
        if order == "o-2":
            raise RuntimeError(stub_error)
        return {"receipt": stub_result, "clientSecret": "cs-" + p._tag("stub_cs")}

    async def go() -> Any:
        stores = await _opened(url)
        try:
            runner = _runner(ScriptedProvider(turns), stores)
            await runner.run(agent, "charge", tenant=T, run_id="r1")
            return await runner.replay(
                agent, "r1", tenant=T, from_step=1, stubs={"charge": stub}, new_run_id="rp"
            )
        finally:
            await stores.aclose()

    replayed = asyncio.run(go())
    assert replayed.status is RunStatus.completed, replayed
    everything = sqlite_bytes(tmp_path / "adk.sqlite3")
    assert '"stub": true' in everything or '"stub":true' in everything
    shown = cli_views(url, "rp") + console_pages(url, "rp") + log_text(caplog)
    assert p.found_in(everything) == []
    assert p.found_in(shown) == []


# --- a worker name: the leases' holder --------------------------------------------------------


def test_a_secret_worker_name_is_not_kept_in_claims_or_shown(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    p = Planted()
    url = f"sqlite:///{tmp_path / 'adk.sqlite3'}"
    worker = "sk-proj-" + (p._tag("worker_key") + "A1b2C3d4" * 6)[:40]

    async def go() -> Any:
        stores = await _opened(url)
        try:
            runner = _runner(ScriptedProvider([[("slow", {})], "ok"]), stores, worker=worker)
            return await runner.run(agent, "go", tenant=T, run_id="r1")
        finally:
            await stores.aclose()

    @tool(side_effects=False)
    def slow() -> str:
        """A tool that crashes the process (its lease stays, holder and all)."""
        raise SimulatedCrash("died")

    agent = Agent("w", "Work.", [slow])
    with pytest.raises(SimulatedCrash):
        asyncio.run(go())
    everything = sqlite_bytes(tmp_path / "adk.sqlite3")
    shown = cli_views(url, "r1") + console_pages(url, "r1") + log_text(caplog)
    assert p.found_in(everything) == []
    assert p.found_in(shown) == []


# --- runner.cancel's reason and by ----------------------------------------------------------


def test_runner_cancel_reason_and_by_are_masked(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    p = Planted()
    url = f"sqlite:///{tmp_path / 'adk.sqlite3'}"
    agent = Agent("idle", "Wait.", [])

    async def go() -> None:
        stores = await _opened(url)
        try:
            runner = _runner(ScriptedProvider(["ok"]), stores)
            await runner.submit(agent, "go " + p.text("submitted"), tenant=T, run_id="c1")
            await runner.cancel(
                "c1",
                tenant=T,
                by="ops " + "sk-proj-" + (p._tag("cancel_by") + "A1b2C3d4" * 6)[:40],
                reason=p.text("cancel_reason"),
            )
        finally:
            await stores.aclose()

    asyncio.run(go())
    everything = sqlite_bytes(tmp_path / "adk.sqlite3")
    shown = cli_views(url, "c1") + console_pages(url, "c1") + log_text(caplog)
    assert p.found_in(everything) == []
    assert p.found_in(shown) == []


# --- an AWS key pair in the shape README names ---------------------------------------------


def test_an_aws_key_pair_whose_secret_has_no_slash_is_masked(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'adk.sqlite3'}"
    needle = "QZ99AWSPAIRQZ"
    secret = (needle + "wJalrXUtnFEMI1K7MDENGabPxRfiCYEXAMPLEKEY")[:40]
    assert "/" not in secret and "+" not in secret and len(secret) == 40

    @tool(side_effects=False)
    def creds() -> str:
        """Read the s3fs password file."""
        return f"AKIAIOSFODNN7EXAMPLE:{secret}\nAKIAIOSFODNN7EXAMPLE {secret}"

    async def go() -> Any:
        stores = await _opened(url)
        try:
            runner = _runner(ScriptedProvider([[("creds", {})], "ok"]), stores)
            return await runner.run(Agent("c", "C.", [creds]), "go", tenant=T, run_id="r1")
        finally:
            await stores.aclose()

    assert asyncio.run(go()).status is RunStatus.completed
    everything = sqlite_bytes(tmp_path / "adk.sqlite3")
    assert "[redacted:aws_access_key_id]" in everything
    assert needle not in everything


# --- Redis and PostgreSQL, under a prefix / schema of our own -----------------------------


def _redis_bytes(prefix: str) -> str:
    import redis

    client = redis.Redis.from_url(REDIS_URL)
    out: list[str] = []
    try:
        for key in client.scan_iter(match=prefix + "*", count=1000):
            out.append(key.decode("utf-8", "replace"))
            kind = client.type(key).decode()
            if kind == "string":
                items: list[Any] = [client.get(key)]
            elif kind == "hash":
                items = [x for kv in client.hgetall(key).items() for x in kv]
            elif kind == "list":
                items = client.lrange(key, 0, -1)
            elif kind == "set":
                items = list(client.smembers(key))
            elif kind == "zset":
                items = [m for m, _ in client.zrange(key, 0, -1, withscores=True)]
            elif kind == "stream":
                items = [
                    x for _id, fields in client.xrange(key) for kv in fields.items() for x in kv
                ]
            else:
                items = [kind]
            out.extend(
                i.decode("utf-8", "replace") if isinstance(i, bytes) else str(i) for i in items
            )
    finally:
        for key in client.scan_iter(match=prefix + "*", count=1000):
            client.delete(key)
        client.close()
    return "\n".join(out)


def _postgres_rows(schema: str) -> str:
    import psycopg

    with psycopg.connect(POSTGRES_URL, autocommit=True) as db:
        tables = [
            r[0]
            for r in db.execute(
                "SELECT table_name FROM information_schema.tables WHERE table_schema = %s",
                (schema,),
            )
        ]
        rows = [
            str(r[0])
            for t in tables
            for r in db.execute(f'SELECT t::text FROM "{schema}"."{t}" t').fetchall()
        ]
    return "\n".join(rows)


REDIS_URL = "redis://127.0.0.1:6379/0"
POSTGRES_URL = "postgresql://postgres@127.0.0.1:5432/test"


@pytest.mark.parametrize("backend", ["redis", "postgres"])
def test_a_deny_note_a_tool_error_and_a_submitted_input_are_masked_on_the_server(
    backend: str,
) -> None:
    import secrets as pysecrets

    p = Planted()
    name = f"sinks_{pysecrets.token_hex(4)}"
    if backend == "redis":
        url = f"{REDIS_URL}?prefix={name}:&allow_volatile=true"
    else:
        import psycopg

        with psycopg.connect(POSTGRES_URL, autocommit=True) as admin:
            admin.execute(f'CREATE SCHEMA "{name}"')
        url = f"{POSTGRES_URL}?schema={name}"
    message, note = p.text("srv_exc"), p.text("srv_exc_note")

    @tool(side_effects=False)
    def lookup(order: str) -> str:
        """Look an order up (read-only)."""
        error = RuntimeError(message)
        error.add_note(note)
        raise error

    @tool(requires_approval=True)
    def refund(order: str) -> str:
        """Refund (needs a person)."""
        return "refunded"

    agent = Agent("srv", "Serve.", [lookup, refund])
    provider = ScriptedProvider([[("lookup", {"order": "o-1"})], [("refund", {"order": "o"})], "k"])

    async def start() -> Any:
        stores = await _opened(url)
        try:
            runner = _runner(provider, stores)
            await runner.submit(agent, "go " + p.text("srv_input"), tenant=T, run_id="s1")
            return await runner.run(agent, "look", tenant=T, run_id="r1")
        finally:
            await stores.aclose()

    try:
        run = asyncio.run(start())
        assert run.status is RunStatus.waiting_approval, run
        said = cli(
            "approve", run.pending_approval.id, "--tenant", T, "--by", "bob", "--deny",
            "--note", p.text("srv_note"), "--store", url,
        )  # fmt: skip
        assert said.startswith("exit 0"), said

        async def resume() -> Any:
            stores = await _opened(url)
            try:
                return await _runner(provider, stores).resume(agent, "r1", tenant=T)
            finally:
                await stores.aclose()

        assert asyncio.run(resume()).status is RunStatus.completed
        shown = said + cli_views(url, "r1", "s1")
    finally:
        if backend == "redis":
            kept = _redis_bytes(name)
        else:
            kept = _postgres_rows(name)
            import psycopg

            with psycopg.connect(POSTGRES_URL, autocommit=True) as admin:
                admin.execute(f'DROP SCHEMA "{name}" CASCADE')
    assert "[redacted:" in kept
    assert p.found_in(kept) == []
    assert p.found_in(shown) == []
