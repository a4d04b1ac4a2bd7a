"""An independent attack on today's fixes: replay (7ce6214), the console's routing and
forms (98f8ef5) and redaction after escape sequences (2cf9fa2).

Tests marked ``xfail(strict=True)`` show a defect found by these attacks (the reason says
which promise breaks); the others are attacks the fixes withstood, kept as regression tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import re
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import pytest

from tesserix_adk import (
    Agent,
    AgentRunner,
    ConfigurationError,
    LeasePolicy,
    ReplayNotResumableError,
    RunStatus,
    ScriptedProvider,
    ToolContext,
    Worker,
    WorkState,
    open_stores,
    tool,
)
from tesserix_adk.checkpoint.redaction import Redactor
from tesserix_adk.cli import ExitCode, frontier_main, resume_main
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.stores.capabilities import step_history

T = "acme"
TURNS: list[Any] = [
    [("search", {"origin": "FRA"})],
    [("book", {"flight": "LH1"})],
    "Booked LH1.",
]


class Airline:
    """The outside world: each real booking, with the idempotency key it was sent under.
    An airline that deduplicates by key books once per key."""

    def __init__(self) -> None:
        self.sent: Counter[str] = Counter()
        self.keys: list[str] = []

    def agent(self, *, approval: bool = False, key: Any = "default") -> Agent:
        airline = self

        @tool(side_effects=False)
        def search(origin: str) -> list[str]:
            """Find flights."""
            return ["LH1"]

        options: dict[str, Any] = {"requires_approval": approval}
        if key != "default":
            options["key"] = key

        @tool(**options)
        def book(flight: str, ctx: ToolContext) -> dict[str, str]:
            """Book one seat (the real thing)."""
            airline.sent[flight] += 1
            airline.keys.append(str(ctx.idempotency_key))
            return {"booking": f"BK-{flight}-{airline.sent[flight]}"}

        return Agent("booking", "Book the flight asked for.", [search, book])


def _by_flight(**kw: Any) -> str:
    return f"booking-{kw['arguments']['flight']}"


def _stub(flight: str) -> dict[str, str]:
    return {"booking": "BK-STUB"}


def _runner(stores: Stores, turns: list[Any] | None = None) -> AgentRunner:
    return AgentRunner.from_stores(
        ScriptedProvider(list(TURNS if turns is None else turns)),
        stores,
        lease_policy=LeasePolicy(ttl=5.0, renew_within=2.0),
        never_ran_margin=0.0,
        resume_claim_ttl=0.2,
    )


def _url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path}/adk.sqlite3"


@contextlib.asynccontextmanager
async def _opened(url: str) -> AsyncIterator[Stores]:
    stores = open_stores(url)
    await stores.create_schema()
    async with stores:
        yield stores


async def _steps(stores: Stores, run_id: str) -> list[int]:
    return list(await step_history(stores.checkpoints).steps(T, run_id))


async def _completed(stores: Stores, agent: Agent, run_id: str = "r") -> list[int]:
    run = await _runner(stores).run(agent, "book LH1", tenant=T, run_id=run_id)
    assert run.status is RunStatus.completed
    return await _steps(stores, run_id)


def _resume_cli(url: str, run_id: str, agent: Agent) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = resume_main(
        ["run", "--resume", run_id, "--tenant", T, "--agent", "booking"],
        stores=open_stores(url),
        agents={"booking": agent},
        provider=ScriptedProvider(list(TURNS)),
        out=out,
        err=err,
    )
    return code, out.getvalue(), err.getvalue()


# --- replay ------------------------------------------------------------------------------


async def test_a_replay_of_a_replay_never_books_and_is_labelled_by_its_parent(
    tmp_path: Path,
) -> None:
    airline = Airline()
    agent = airline.agent(key=_by_flight)
    async with _opened(_url(tmp_path)) as stores:
        steps = await _completed(stores, agent)
        assert airline.sent == Counter({"LH1": 1})
        first = await _runner(stores).replay(
            agent, "r", tenant=T, from_step=steps[0], stubs={"book": _stub}, new_run_id="rp1"
        )
        assert first.status is RunStatus.completed
        again = await _runner(stores).replay(
            agent,
            "rp1",
            tenant=T,
            from_step=min(await _steps(stores, "rp1")),
            stubs={"book": _stub},
            new_run_id="rp2",
        )
        assert again.status is RunStatus.completed
        assert again.replay_of is not None and again.replay_of.startswith("rp1@")
        # Each replay's records are under keys of its own, none under the business key.
        for run_id in ("rp1", "rp2"):
            keys = {r.key for r in await stores.idempotency.records(T, run_id) if r.tool}
            assert keys and all(k.startswith("r1:") for k in keys), keys
        rp1 = {r.key for r in await stores.idempotency.records(T, "rp1") if r.tool}
        rp2 = {r.key for r in await stores.idempotency.records(T, "rp2") if r.tool}
        assert not rp1 & rp2
    assert airline.sent == Counter({"LH1": 1})


async def test_a_finished_replay_resumed_is_only_described(tmp_path: Path) -> None:
    url = _url(tmp_path)
    airline = Airline()
    agent = airline.agent()
    async with _opened(url) as stores:
        steps = await _completed(stores, agent)
        replayed = await _runner(stores).replay(
            agent, "r", tenant=T, from_step=steps[0], stubs={"book": _stub}, new_run_id="rp"
        )
        assert replayed.status is RunStatus.completed
        again = await _runner(stores).resume(agent, "rp", tenant=T)
        assert again.status is RunStatus.completed
        assert again.replay_of == replayed.replay_of
    code, out, err = await asyncio.to_thread(_resume_cli, url, "rp", agent)
    assert code == ExitCode.CARRIED_ON, err
    assert "nothing was done" in out
    assert airline.sent == Counter({"LH1": 1})


async def test_run_resume_of_an_unfinished_replay_exits_4_and_books_nothing(
    tmp_path: Path,
) -> None:
    url = _url(tmp_path)
    airline2 = Airline()
    async with _opened(url) as stores:
        run = await _runner(stores).run(
            airline2.agent(approval=True), "book LH1", tenant=T, run_id="r"
        )
        assert run.pending_approval is not None
        await stores.approvals.decide(T, run.pending_approval.id, approved=True, by="alice")
        done = await _runner(stores).resume(airline2.agent(approval=True), "r", tenant=T)
        assert done.status is RunStatus.completed
        first = min(await _steps(stores, "r"))
        replayed = await _runner(stores).replay(
            airline2.agent(approval=True),
            "r",
            tenant=T,
            from_step=first,
            stubs={"book": _stub},
            new_run_id="rp",
        )
        assert replayed.pending_approval is not None
        await stores.approvals.decide(T, replayed.pending_approval.id, approved=True, by="bob")
    code, out, err = await asyncio.to_thread(_resume_cli, url, "rp", airline2.agent(approval=True))
    assert code == ExitCode.MUST_NOT_CARRY_ON, (code, out, err)
    assert "replay again" in err
    assert airline2.sent == Counter({"LH1": 1})


async def test_a_live_tool_keyed_by_its_business_object_is_sent_again_by_a_replay(
    tmp_path: Path,
) -> None:
    """As the README says (the replay's calls never read the original's outcome from a
    business key), a tool named ``live`` goes out for real, under a key of the replay's own:
    an airline deduplicating by the key it is given books the seat a second time. Kept as
    the documented behaviour (see the report: ``live`` with a business key defeats it)."""
    airline = Airline()
    agent = airline.agent(key=_by_flight)
    async with _opened(_url(tmp_path)) as stores:
        steps = await _completed(stores, agent)
        assert airline.keys == ["acme/booking-LH1"]
        replayed = await _runner(stores).replay(
            agent, "r", tenant=T, from_step=steps[0], stubs={}, live=("book",), new_run_id="rp"
        )
        assert replayed.status is RunStatus.completed
    assert airline.sent == Counter({"LH1": 2})
    assert airline.keys[0] == "acme/booking-LH1"
    assert airline.keys[1].startswith("r1:")


class _SlowFirstLook:
    """An idempotency store whose first ``records`` of one run waits for a signal: the
    moment between a replay's check that its new id is free and its taking the run."""

    def __init__(self, inner: Any, run_id: str) -> None:
        self._inner = inner
        self._run_id = run_id
        self.looked = asyncio.Event()
        self.go_on = asyncio.Event()
        self._first = True

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def records(self, tenant: str, run_id: str, *args: Any, **kwargs: Any) -> Any:
        found = await self._inner.records(tenant, run_id, *args, **kwargs)
        if run_id == self._run_id and self._first:
            self._first = False
            self.looked.set()
            await self.go_on.wait()
        return found


async def test_two_replays_naming_the_same_new_run_id_never_share_a_run(tmp_path: Path) -> None:
    airline = Airline()
    agent = airline.agent()
    async with _opened(_url(tmp_path)) as stores:
        steps = await _completed(stores, agent)
        slow = _runner(stores)
        looking = _SlowFirstLook(stores.idempotency, "rp")
        slow.idempotency = looking  # type: ignore[assignment]
        second = asyncio.create_task(
            slow.replay(
                agent, "r", tenant=T, from_step=steps[0], stubs={"book": _stub}, new_run_id="rp"
            )
        )
        await asyncio.wait_for(looking.looked.wait(), 10)
        first = await _runner(stores).replay(
            agent, "r", tenant=T, from_step=steps[0], stubs={"book": _stub}, new_run_id="rp"
        )
        assert first.status is RunStatus.completed
        written = await _steps(stores, "rp")
        looking.go_on.set()
        outcome = await asyncio.gather(second, return_exceptions=True)
        # The second must be refused: "rp" is the first replay's run now.
        assert isinstance(outcome[0], ConfigurationError), outcome
        assert await _steps(stores, "rp") == written


# --- the console -------------------------------------------------------------------------

HOST = "127.0.0.1:8765"
CSRF = "c" * 64
WAIT: list[Any] = [[("book", {"flight": "LH1"})], "Booked LH1."]


class _Console:
    """The console app over open stores, asked through raw ASGI requests: the address goes
    as sent (no client normalising ``..`` or re-encoding), with or without a form."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def call(
        self,
        method: str,
        raw_path: bytes,
        *,
        host: str = HOST,
        form: bytes | None = None,
        origin: str | None = "http://" + HOST,
    ) -> tuple[int, str]:
        headers = [(b"host", host.encode("latin-1")), (b"cookie", f"tesserix_csrf={CSRF}".encode())]
        if form is not None:
            headers.append((b"content-type", b"application/x-www-form-urlencoded"))
            headers.append((b"content-length", str(len(form)).encode()))
            if origin is not None:
                headers.append((b"origin", origin.encode()))
        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": method,
            "scheme": "http",
            "path": unquote(raw_path.decode("latin-1")),
            "raw_path": raw_path,
            "query_string": b"",
            "root_path": "",
            "headers": headers,
            "client": ("127.0.0.1", 50000),
            "server": ("127.0.0.1", 8765),
        }
        pending = [{"type": "http.request", "body": form or b"", "more_body": False}]
        status: list[int] = []
        body: list[bytes] = []

        async def receive() -> dict[str, Any]:
            if pending:
                return pending.pop()
            await asyncio.Event().wait()
            raise AssertionError("unreachable")

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])
            elif message["type"] == "http.response.body":
                body.append(message.get("body", b""))

        await self.app(scope, receive, send)
        return status[0], b"".join(body).decode("utf-8", "replace")


def _title(page: str) -> str:
    found = re.search(r"<title>(.*?)</title>", page, re.S)
    return "" if found is None else found.group(1)


def _approver() -> Agent:
    @tool(requires_approval=True)
    def book(flight: str) -> dict[str, str]:
        """Book (needs a person's approval)."""
        return {"booking": flight}

    return Agent("approver", "Book.", [book])


@contextlib.asynccontextmanager
async def _console(
    tmp_path: Path, *runs: tuple[str, str]
) -> AsyncIterator[tuple[_Console, Stores]]:
    """The console over a store in which each (tenant, run) waits on an approval."""
    from tesserix_adk.console import create_app

    async with _opened(_url(tmp_path)) as stores:
        for tenant, run_id in runs:
            run = await _runner(stores, WAIT).run(_approver(), "book", tenant=tenant, run_id=run_id)
            assert run.status is RunStatus.waiting_approval
        app = create_app(stores)
        async with app.router.lifespan_context(app):
            yield _Console(app), stores


async def _status(stores: Stores, tenant: str, run_id: str) -> str:
    cp = await _runner(stores).checkpoints.latest(tenant, run_id)  # type: ignore[union-attr]
    assert cp is not None
    return str(cp.status)


@pytest.mark.parametrize(
    ("path", "title"),
    [
        (b"/t/acme/runs", "runs of acme"),
        (b"/t/acme%2Fruns%2Feu/runs", "runs of acme/runs/eu"),
        (b"/t/acme%2fruns%2feu/runs", "runs of acme/runs/eu"),
        (b"/t/acme%252Fruns%252Feu/runs", "runs of acme%2Fruns%2Feu"),
        (b"/t/runs/runs/approvals", "run approvals"),
        (b"/t/acme/runs/a/b", "run a/b"),
        (b"/t/acme/runs/a%2Fb", "run a/b"),
    ],
)
async def test_every_address_names_the_tenant_and_run_it_spells(
    tmp_path: Path, path: bytes, title: str
) -> None:
    async with _console(
        tmp_path, (T, "r1"), ("acme/runs/eu", "r1"), ("runs", "approvals"), (T, "a/b")
    ) as (
        console,
        _stores,
    ):
        status, page = await console.call("GET", path)
        assert status == 200, page
        assert _title(page).startswith(title), _title(page)


@pytest.mark.parametrize(
    "path",
    [b"/t/acme/runs/..", b"/t/acme/runs/%2e%2e", b"/t/acme/runs/.", b"/t/acme/runs//r1",
     b"/t/acme/runs/r1%3F", b"/t/acme/runs/r1%23", b"/t/acme/runs/r1%00"],
)  # fmt: skip
async def test_dot_empty_and_encoded_run_ids_name_no_other_run(tmp_path: Path, path: bytes) -> None:
    async with _console(tmp_path, (T, "r1")) as (console, _stores):
        status, page = await console.call("GET", path)
        # 400 for a NUL, which no id holds (run.ids); 404 for the others.
        assert status == (400 if b"%00" in path else 404), page
        assert "r1 ·" not in _title(page)


@pytest.mark.parametrize(
    "path",
    [b"/static/%2e%2e%2fapp.py", b"/static/../app.py", b"/static/%2e%2e/templates/home.html",
     b"/static/..%2f__init__.py", b"/static/%252e%252e%252fapp.py", b"/static/%2fetc%2fpasswd",
     b"/static//etc/passwd", b"/static/%5c..%5capp.py", b"/static/%00", b"/static/x%00y"],
)  # fmt: skip
async def test_no_encoded_path_reads_a_file_outside_the_static_folder(
    tmp_path: Path, path: bytes
) -> None:
    async with _console(tmp_path) as (console, _stores):
        ok, css = await console.call("GET", b"/static/console.css")
        assert ok == 200 and "font-family" in css
        status, body = await console.call("GET", path)
        assert status in (400, 404), (status, body[:200])
        assert "import" not in body and "<section" not in body and "root:" not in body


@pytest.mark.parametrize(
    ("host", "served"),
    [("LOCALHOST", True), ("Localhost:8765", True), ("[::1]:8765", True),
     ("localhost.", False), ("[::1%25lo]", False), ("[fe80::1%25eth0]:8765", False),
     ("127.1", False), ("0x7f000001", False), ("[::ffff:7f00:1]", False),
     ("evil\\@localhost", False), ("localhost@evil.example", False),
     ("localhost:8765/evil", False), ("", False), ("127.0.0.1.nip.io", False)],
)  # fmt: skip
async def test_only_a_loopback_host_is_answered(tmp_path: Path, host: str, served: bool) -> None:
    async with _console(tmp_path) as (console, _stores):
        status, _page = await console.call("GET", b"/t/acme/runs", host=host)
        assert (status == 200) is served, status


async def test_an_unencoded_utf8_tenant_is_read_as_itself_or_refused(tmp_path: Path) -> None:
    async with _console(tmp_path, ("caf\u00e9", "r1")) as (console, _stores):
        status, page = await console.call("GET", "/t/café/runs".encode())
        assert status == 400 or _title(page).startswith("runs of café"), _title(page)


async def test_a_cancel_for_a_slashed_tenant_never_cancels_the_prefix_tenants_run(
    tmp_path: Path,
) -> None:
    async with _console(tmp_path, (T, "r1"), ("acme/runs/r1", "x")) as (console, stores):
        form = f"csrf={CSRF}&by=mallory&reason=x".encode()
        for path in (b"/t/acme%2Fruns%2Fr1/runs/x/cancel", b"/t/acme%252Fruns/runs/r1/cancel"):
            await console.call("POST", path, form=form)
        assert await _status(stores, T, "r1") == "waiting_approval"
        assert await _status(stores, "acme/runs/r1", "x") == "cancelled"


async def test_a_decision_note_past_the_limit_is_refused_and_decides_nothing(
    tmp_path: Path,
) -> None:
    async with _console(tmp_path, (T, "r1")) as (console, stores):
        cp = await _runner(stores).checkpoints.latest(T, "r1")  # type: ignore[union-attr]
        assert cp is not None and cp.pending_approval is not None
        request = cp.pending_approval.id
        form = f"csrf={CSRF}&by=op&decision=deny&note={'n' * 4001}".encode()
        status, _page = await console.call(
            "POST", f"/t/acme/approvals/{request}".encode(), form=form
        )
        assert 400 <= status < 500, status
        got = await stores.approvals.get(T, request)
        assert got is not None and str(got.status) == "pending"


async def test_a_form_saying_both_approve_and_deny_is_refused(tmp_path: Path) -> None:
    async with _console(tmp_path, (T, "r1")) as (console, stores):
        cp = await _runner(stores).checkpoints.latest(T, "r1")  # type: ignore[union-attr]
        assert cp is not None and cp.pending_approval is not None
        request = cp.pending_approval.id
        form = f"csrf={CSRF}&by=op&decision=deny&decision=approve".encode()
        status, _page = await console.call(
            "POST", f"/t/acme/approvals/{request}".encode(), form=form
        )
        got = await stores.approvals.get(T, request)
        assert got is not None
        assert status == 400 and str(got.status) == "pending", (status, got.status)


async def _claim(stores: Stores, run_id: str, key: str, call_id: str) -> None:
    await stores.idempotency.claim(
        key,
        holder="worker-dead",
        tenant=T,
        run_id=run_id,
        iteration=0,
        tool="charge",
        call_id=call_id,
        flags=None,
    )


def _frontier_cli(url: str, *argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = frontier_main(list(argv), stores=open_stores(url), out=out, err=err)
    return code, out.getvalue(), err.getvalue()


async def test_a_call_id_equal_to_another_records_digest_is_ambiguous_never_guessed(
    tmp_path: Path,
) -> None:
    """A model picks call ids: one equal to another call's key digest makes ``--call
    <digest>`` name two records. Refused (exit 2), nothing recorded; the raw key still
    names one record."""
    from tesserix_adk.stores.protocols import RecordStatus
    from tesserix_adk.tools import key_digest

    url = _url(tmp_path)
    async with _opened(url) as stores:
        await _claim(stores, "r9", "k1:aaaa", "c1")
        await _claim(stores, "r9", "k1:bbbb", key_digest("k1:aaaa"))
    resolve = ("resolve", "r9", "--tenant", T, "--by", "op", "--never-ran", "--margin", "0")
    code, _out, err = await asyncio.to_thread(
        _frontier_cli, url, *resolve, "--call", key_digest("k1:aaaa")
    )
    assert code == ExitCode.USAGE, err
    async with _opened(url) as stores:
        records = {r.key: r.status for r in await stores.idempotency.records(T, "r9")}
    assert records == {"k1:aaaa": RecordStatus.in_flight, "k1:bbbb": RecordStatus.in_flight}
    code, _out, err = await asyncio.to_thread(_frontier_cli, url, *resolve, "--call", "k1:aaaa")
    assert code == ExitCode.CARRIED_ON, err
    async with _opened(url) as stores:
        records = {r.key: r.status for r in await stores.idempotency.records(T, "r9")}
    assert records["k1:bbbb"] is RecordStatus.in_flight
    assert records["k1:aaaa"] is not RecordStatus.in_flight


async def test_enter_in_the_note_field_never_sends_a_decision(tmp_path: Path) -> None:
    async with _console(tmp_path, (T, "r1")) as (console, _stores):
        status, page = await console.call("GET", b"/t/acme/runs/r1")
        assert status == 200
        form = re.search(r'<section class="approval".*?<form.*?</form>', page, re.S)
        assert form is not None and 'name="note"' in form.group(0)
        # HTML's implicit submission: the form's first submit button, its name and value sent.
        first = re.search(r"<button[^>]*>", form.group(0))
        assert first is not None
        assert 'name="decision"' not in first.group(0), first.group(0)


# --- redaction ---------------------------------------------------------------------------

KEY = "sk-" + "A1b2C3d4E5f6G7h8I9j0K1l2"
GHP = "ghp_" + "a1B2" * 9


@pytest.mark.parametrize(
    "text",
    [
        "x\\n" + KEY,
        "\\t" + KEY,
        "\\r" + KEY,
        "\\f" + KEY,
        "x\\\\n" + KEY,
        "C:\\keys\\" + KEY,
        repr("line\n" + KEY),
        json.dumps({"a": "line\n" + KEY})[:-1],  # JSON text cut short: free text
        "\\n" + GHP,
        "\\nAKIAABCDEFGHIJKLMNOP",
        "\\tBearer abcdefgh12345678",
        "\\nAuthorization: Basic dXNlcjpwYXNz",
    ],
)
def test_a_key_after_a_letter_escape_is_masked(text: str) -> None:
    masked = Redactor().text(text)
    assert "[redacted:" in masked, masked
    for secret in (KEY, GHP, "AKIAABCDEFGHIJKLMNOP", "abcdefgh12345678", "dXNlcjpwYXNz"):
        assert secret not in masked


@pytest.mark.parametrize(
    ("text", "secret"),
    [
        ("\\npassword=hunter2hunter2", "hunter2hunter2"),
        ("\\u000apassword=hunter2hunter2", "hunter2hunter2"),
        ("\\x0bdb_password=hunter2hunter2", "hunter2hunter2"),
        ("PGPASSWORD=hunter2hunter2", "hunter2hunter2"),
        ('{"MYSQL_PWD_X": 1, "DBPASSWORD": "hunter2hunter2"}', "hunter2hunter2"),
        ('{"big": ' + "9" * 5000 + ', "password": "hunter2hunter2"}', "hunter2hunter2"),
    ],
)
def test_password_keys_mask_their_values(text: str, secret: str) -> None:
    assert secret not in Redactor().text(text)


# Escapes ``repr`` and JSON really write before a key: a vertical tab or form feed as repr
# writes it (``\x0b``), a control character or any non-ASCII one as ``json.dumps`` writes it
# (``\u000b``, ``\u201c`` for a typographic quote), an ANSI colour as repr writes it.
ESCAPED_BEFORE_A_KEY = [
    pytest.param(repr("\x0b" + KEY), id="repr-vertical-tab"),
    pytest.param(repr("\x0c" + KEY), id="repr-form-feed"),
    pytest.param("body: " + json.dumps({"said": "\u201c" + KEY + "\u201d"})[:-1], id="json-quote"),
    pytest.param(
        "body: " + json.dumps({"said": "cl\u00e9:\u00ab" + KEY})[:-1], id="json-guillemet"
    ),
    pytest.param("body: " + json.dumps({"said": "\x0b" + KEY})[:-1], id="json-control"),
    pytest.param("\\u000a" + KEY, id="json-u000a"),
    pytest.param(repr("\x0b" + GHP), id="repr-vt-github"),
    pytest.param(repr("\x0btoken=hunter2hunter2"), id="repr-vt-token"),
    pytest.param("\\u0009Bearer abcdefgh12345678", id="json-tab-bearer"),
]


@pytest.mark.parametrize("text", ESCAPED_BEFORE_A_KEY)
def test_a_key_after_a_hex_or_unicode_escape_is_masked(text: str) -> None:
    masked = Redactor().text(text)
    for secret in (KEY, GHP, "hunter2hunter2", "abcdefgh12345678"):
        assert secret not in masked, masked


@pytest.mark.parametrize(
    "text",
    [
        "see \\nbasic usage here",
        "\\nskip-list-of-things-and-more-stuff",
        "C:\\new_password_policy.txt",
        "set \\ntoken=<your token> in the config",
        "USERPASSWORDHINT=abc",
        "passwords_count=3",
        "password_hint=blue",
        "\\ntask-abcdefghijklmnopqrstuvw",
        "\\nasks-abcdefghijklmnopqrstuvw",
        "C:\\new\\ghp_folder",
        "\\nbasic authentication is off",
    ],
)
def test_ordinary_text_with_escapes_stays(text: str) -> None:
    assert Redactor().text(text) == text


@pytest.mark.parametrize(
    "unit",
    ["\\nsk-", "\\npassword=", "\\nbasic ", "\\nsecret_key=", "\\\\\\\\n", "\\nsk-aaaa\\n", "a\\"],
)
def test_escape_heavy_text_is_redacted_whole_and_still_masks_a_key_after_it(unit: str) -> None:
    """400 KB of hostile escapes, then a real key: it finishes, and the key is masked. (How
    long it takes, against inputs of other sizes, is ``benchmarks/redaction.py``'s
    "escaped …" rows: tests time nothing.)"""
    hostile = (unit * (400_000 // len(unit) + 1))[:400_000]
    masked = Redactor().text(hostile + " " + KEY)
    assert masked.endswith(" [redacted:openai_key]")
    assert KEY not in masked


def _dump(url: str) -> str:
    import sqlite3

    path = url.removeprefix("sqlite:///")
    with contextlib.closing(sqlite3.connect(path)) as db:
        return "\n".join(
            line.decode("utf-8", "replace") if isinstance(line, bytes) else line
            for line in db.iterdump()
        ) + "".join(
            str(row)
            for (table,) in db.execute("SELECT name FROM sqlite_master WHERE type='table'")
            for row in db.execute(f'SELECT * FROM "{table}"')
        )


async def test_a_key_in_an_upstream_json_body_quoted_by_a_tool_never_reaches_the_store(
    tmp_path: Path,
) -> None:
    body = json.dumps({"said": "your new key is \u201c" + KEY + "\u201d"})

    @tool(side_effects=False)
    def fetch(url: str) -> str:
        """Fetch a page."""
        return f"HTTP 200 from {url}: {body}"

    agent = Agent("fetcher", "Fetch.", [fetch])
    turns: list[Any] = [[("fetch", {"url": "https://example.com"})], "Done."]
    url = _url(tmp_path)
    async with _opened(url) as stores:
        run = await _runner(stores, turns).run(agent, "go", tenant=T, run_id="f")
        assert run.status is RunStatus.completed
    stored = _dump(url)
    assert "\\u201c" in stored or "\u201c" in stored or "redacted" in stored
    assert KEY not in stored


async def test_a_replay_stopped_by_a_lost_reply_is_parked_by_a_worker_and_never_sent(
    tmp_path: Path,
) -> None:
    """A stub that loses its reply (ToolOutcomeUnknownError) stops the replay with its call in
    doubt: resume refuses it, and a worker that finds it wanted parks it, the real tool
    never called."""
    from tesserix_adk import ToolOutcomeUnknownError

    airline = Airline()
    agent = airline.agent(key=_by_flight)

    def lost(flight: str) -> dict[str, str]:
        raise ToolOutcomeUnknownError("the stub's reply was lost")

    async with _opened(_url(tmp_path)) as stores:
        steps = await _completed(stores, agent)
        with contextlib.suppress(ToolOutcomeUnknownError):
            await _runner(stores).replay(
                agent, "r", tenant=T, from_step=steps[0], stubs={"book": lost}, new_run_id="rp"
            )
        with pytest.raises(ReplayNotResumableError):
            await _runner(stores).resume(agent, "rp", tenant=T)
        assert stores.work is not None
        await stores.work.want(T, "rp", agent=agent.name)
        worker = Worker(_runner(stores), [agent], exit_when_idle=True, poll_interval=0.01)
        await asyncio.wait_for(worker.run(), 30)
        [item] = [i for i in await stores.work.items(T) if i.run_id == "rp"]
        assert item.state is WorkState.parked
        assert "ReplayNotResumableError" in (item.reason or "")
    assert airline.sent == Counter({"LH1": 1})
