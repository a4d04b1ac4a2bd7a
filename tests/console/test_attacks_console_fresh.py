"""Fresh attacks on the operator console (README "### The console"), with Starlette's
``TestClient`` on SQLite in ``tmp_path``, where the other console attack files have not gone.

Attacked: odd methods (HEAD, OPTIONS, DELETE, PUT, TRACE, GET on a form's address), odd
paths (trailing slashes, an empty run id, ``%2F`` alone, 20,000-character ids, unicode, raw
non-ASCII, a tenant page without ``/runs``), a POST with a trailing slash (redirected, still
checked), ids past 512 bytes and blank ids in a decision; markup in a tenant, in a tool name
the model made up, in a tool's error text, in the user's input, in a run id and in the
filters of the runs list; a decision posted twice (double click) and after the run moved on
(completed); a resolve form naming another run's call (by digest or call id) or posted
under another tenant; what the console shows while a live worker holds a run (its call in
flight), and after that worker's process is killed (``os._exit`` in the tool, a real
subprocess) and its lease lapses.

Found, and fixed (their tests pass now: ``cli/frontier._carry_on_with`` says a run that ended is
carried on by nothing; the console heads a cancel that recorded nothing "Nothing to cancel"):
- LOW: approving again, from a page left open, a request whose run has since completed
  answers 200 "approved ... carry it on now with `tesserix run --resume ...`": the operator
  is told to carry on a run that has ended (``cli/frontier.py`` ``_approve`` /
  ``_carry_on_with`` never look at ``cp.status.finished``) --
  ``test_approving_again_after_the_run_completed_does_not_say_to_carry_it_on``.
- LOW: cancelling, from a page left open, a run that has since completed is headed
  "Cancel recorded" although the text says "nothing to cancel" and nothing was recorded
  (``console/app.py`` ``_result`` heads every exit 0 as recorded; ``cli/work.py`` ends
  ``already_ended`` with exit 0) --
  ``test_a_cancel_after_the_run_completed_is_not_headed_recorded``.

Held: HEAD of the runs list and a run page is 200 without a body; OPTIONS, DELETE, PUT,
TRACE and GET on a decision's address are 405 and change nothing; trailing slashes, an empty
run id, ``%2F``, ``..``, 20,000-character ids, unicode ids and a blank tenant get a page,
never a 500 (raw non-ASCII and NUL a 400); a POST to a decision's address with a trailing
slash is redirected (307) and still needs the CSRF token and Origin; ids past 512 bytes and
blank ids or names in a decision are refused with the CLI's sentence, nothing recorded;
markup from every stored value and from the filters is escaped on every page; a double
click on approve decides once (first note and time stand) and the worker books once; a deny
after the run completed is refused naming who decided; a resolve naming another run's call
or posted under another tenant is refused and that call stays in flight; a double click on
resolve records once and the second is refused saying the call is completed; while a live
worker holds the run its page names the holder and says the call is being carried now, the
run is not listed as stuck, and a resolve is refused (503) and records nothing; after the
worker's process is killed the page names the holder until the lease lapses, then says
nobody holds it, lists it as stuck, and a resolve with its outcome is recorded once.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
from console_world import TENANT, WAIT_TURNS, World, runner
from starlette.testclient import TestClient

from tesserix_adk import Agent, Checkpointer, RunStatus, Worker, open_stores, tool
from tesserix_adk.console import create_app
from tesserix_adk.console.pages import tenant_path
from tesserix_adk.run.cancelling import cancel_requested
from tesserix_adk.stores.protocols import ApprovalStatus, RecordStatus
from tesserix_adk.testing.faults import SimulatedCrash
from tesserix_adk.tools import key_digest

BASE = "http://127.0.0.1:8765"
ORIGIN = {"origin": BASE}
MARKUP = "<img src=x onerror=alert(1)>"
ODD_TENANT = "<i>t</i>\"'&"
SRC = Path(__file__).resolve().parents[2] / "src"


# --- helpers ------------------------------------------------------------------------------


def _url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'adk.sqlite3'}"


def _client(url: str) -> TestClient:
    return TestClient(create_app(url), base_url=BASE, raise_server_exceptions=False)


def _csrf(client: TestClient) -> str:
    assert client.get("/").status_code == 200
    cookie = client.cookies.get("tesserix_csrf")
    assert cookie is not None and len(cookie) == 64
    return str(cookie)


def _said(response: Any) -> str:
    found = re.search(r'<p (?:id="said"|class="refused")[^>]*>(.*?)</p>', response.text, re.S)
    return "" if found is None else found.group(1)


def _heading(response: Any) -> str:
    found = re.search(r"<h1[^>]*>(.*?)</h1>", response.text, re.S)
    return "" if found is None else re.sub(r"<[^>]+>", "", found.group(1))


def _text(response: Any) -> str:
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", response.text))


def _no_raw_markup(text: str) -> None:
    assert "<img" not in text and "<i>t</i>" not in text, text
    assert "onerror=alert(1)>" not in text


async def _waiting(url: str, world: World, run_id: str = "r-wait") -> str:
    """A run of acme waiting on approval; its request id."""
    async with open_stores(url) as stores:
        await stores.create_schema()
        run = await runner(stores, WAIT_TURNS).run(
            world.approver(), "book", tenant=TENANT, run_id=run_id
        )
        assert run.status is RunStatus.waiting_approval
        cp = await Checkpointer.from_stores(stores).latest(TENANT, run_id)
        assert cp is not None and cp.pending_approval is not None
        return cp.pending_approval.id


async def _work(url: str, world: World) -> RunStatus:
    """A worker carries r-wait on until nothing is left; the run's status then."""
    async with open_stores(url) as stores:
        worker = Worker(
            runner(stores, WAIT_TURNS), [world.approver()], exit_when_idle=True, poll_interval=0.01
        )
        await asyncio.wait_for(worker.run(), 20)
        cp = await Checkpointer.from_stores(stores).latest(TENANT, "r-wait")
        assert cp is not None
        return RunStatus(str(cp.status))


async def _approval(url: str, request_id: str) -> Any:
    async with open_stores(url) as stores:
        got = await stores.approvals.get(TENANT, request_id)
        assert got is not None
        return got


async def _in_flight(url: str, *runs: tuple[str, str]) -> None:
    """For each (run, call id): a call in flight under that run of acme, holder gone, no
    lease ever held on the run."""
    async with open_stores(url) as stores:
        await stores.create_schema()
        for run_id, call_id in runs:
            await stores.idempotency.claim(
                f"k1:{run_id}-{call_id}",
                holder="worker-dead",
                tenant=TENANT,
                run_id=run_id,
                iteration=0,
                tool="charge",
                call_id=call_id,
                flags=None,
            )


async def _records(url: str, run_id: str, tenant: str = TENANT) -> list[Any]:
    async with open_stores(url) as stores:
        return [r for r in await stores.idempotency.records(tenant, run_id) if r.tool]


# --- a store seeded once: a waiting run and markup everywhere -------------------------------


@tool
def explode(ctx: Any) -> dict[str, str]:
    """Fails with markup in its error."""
    raise RuntimeError(MARKUP + " exploded")


async def _seed_odd(url: str) -> str:
    async with open_stores(url) as stores:
        await stores.create_schema()
        world = World()
        await runner(stores, WAIT_TURNS).run(
            world.approver(), "book", tenant=TENANT, run_id="r-wait"
        )
        cases: list[tuple[str, list[Any]]] = [
            ("r-unknown", [[(MARKUP, {"x": MARKUP})], "done"]),
            ("r-explode", [[("explode", {})], "done"]),
            (MARKUP, [MARKUP]),
        ]
        for run_id, turns in cases:
            await runner(stores, turns).run(
                Agent("odd", "x", [explode]), MARKUP, tenant=ODD_TENANT, run_id=run_id
            )
        cp = await Checkpointer.from_stores(stores).latest(TENANT, "r-wait")
        assert cp is not None and cp.pending_approval is not None
        return cp.pending_approval.id


@pytest.fixture(scope="module")
def odd(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """A store: r-wait of acme waiting on approval, and three runs of a tenant with markup
    in its name (a tool name, a tool error, a run id and an input with markup)."""
    url = f"sqlite:///{tmp_path_factory.mktemp('fresh') / 'adk.sqlite3'}"
    return url, asyncio.run(_seed_odd(url))


# --- odd methods and paths ------------------------------------------------------------------


def test_head_is_served_without_a_body_and_other_methods_change_nothing(
    odd: tuple[str, str],
) -> None:
    url, request_id = odd
    with _client(url) as client:
        for path in (tenant_path(TENANT, "runs"), tenant_path(TENANT, "runs", "r-wait")):
            head = client.head(path)
            assert head.status_code == 200 and head.content == b""
            assert head.headers["x-frame-options"] == "DENY"
        decision = tenant_path(TENANT, "approvals", request_id)
        cancel = tenant_path(TENANT, "runs", "r-wait", "cancel")
        for method, path in [
            ("OPTIONS", tenant_path(TENANT, "runs")),
            ("OPTIONS", decision),
            ("DELETE", tenant_path(TENANT, "runs", "r-wait")),
            ("PUT", cancel),
            ("PATCH", decision),
            ("TRACE", tenant_path(TENANT, "runs")),
            ("GET", decision),
            ("HEAD", decision),
            ("POST", tenant_path(TENANT, "runs")),
        ]:
            got = client.request(method, path, follow_redirects=False)
            assert got.status_code == 405, (method, path, got.status_code)
    assert asyncio.run(_approval(url, request_id)).status is ApprovalStatus.pending


@pytest.mark.parametrize(
    ("path", "statuses"),
    [
        ("/t/acme/runs/", {404}),
        ("/t/acme/runs/r-wait/", {404}),
        ("/t/acme/runs/%2F", {404}),
        ("/t/acme/runs/%2e%2e", {404}),
        ("/t/acme/runs/" + "x" * 20000, {404}),
        ("/t/" + "a" * 20000 + "/runs", {200}),
        ("/t/%E2%9C%93/runs/%F0%9F%98%80", {404}),
        ("/t/acme/runs/" + "%C3%A9" * 3000, {404}),
        ("/t/%20/runs", {200}),
        ("/t/acme", {404}),
        ("/t/acme/", {404}),
        ("//t/acme/runs", {404}),
        ("/t/acme/runs/r-wait/cancel", {404}),
        ("/t/acme/runs/%FF", {400}),
    ],
)
def test_odd_paths_get_a_page_never_a_server_error(
    odd: tuple[str, str], path: str, statuses: set[int]
) -> None:
    url, _ = odd
    with _client(url) as client:
        got = client.get(path, follow_redirects=False)
    assert got.status_code in statuses, (path[:60], got.status_code, got.text[:300])
    assert "Traceback" not in got.text


def test_raw_unicode_in_an_address_is_refused_as_not_percent_encoded(
    odd: tuple[str, str],
) -> None:
    url, _ = odd
    # httpx percent-encodes what it is given; a raw byte path has to go as the ASGI scope.
    scope_path = "/t/acme/runs/r-\u00e9"
    app = create_app(url)
    sent: list[dict[str, Any]] = []

    async def call() -> None:
        scope = {
            "type": "http",
            "http_version": "1.1",
            "method": "GET",
            "scheme": "http",
            "path": scope_path,
            "raw_path": scope_path.encode("utf-8"),
            "root_path": "",
            "query_string": b"",
            "headers": [(b"host", b"127.0.0.1:8765")],
            "client": ("127.0.0.1", 1),
            "server": ("127.0.0.1", 8765),
        }

        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        # The app is used without its lifespan: it must refuse before any store is read.
        await app(scope, receive, send)  # type: ignore[arg-type]

    asyncio.run(call())
    start = next(m for m in sent if m["type"] == "http.response.start")
    assert start["status"] == 400
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    assert b"not percent-encoded" in body


def test_a_post_with_a_trailing_slash_is_still_checked(tmp_path: Path) -> None:
    url = _url(tmp_path)
    request_id = asyncio.run(_waiting(url, World()))
    slashed = tenant_path(TENANT, "approvals", request_id) + "/"
    with _client(url) as client:
        csrf = _csrf(client)
        moved = client.post(
            slashed,
            data={"csrf": csrf, "by": "alice", "decision": "approve"},
            headers=ORIGIN,
            follow_redirects=False,
        )
        assert moved.status_code in (307, 308, 404, 405), moved.status_code
        forged = client.post(
            slashed,
            data={"csrf": "0" * 64, "by": "mallory", "decision": "approve"},
            headers=ORIGIN,
        )
        assert forged.status_code == 403, forged.status_code
        other_site = client.post(
            slashed,
            data={"csrf": csrf, "by": "mallory", "decision": "approve"},
            headers={"origin": "http://evil.example"},
        )
        assert other_site.status_code == 403, other_site.status_code
    assert asyncio.run(_approval(url, request_id)).status is ApprovalStatus.pending


def test_oversized_and_blank_ids_in_a_decision_are_refused_clearly(tmp_path: Path) -> None:
    url = _url(tmp_path)
    request_id = asyncio.run(_waiting(url, World()))
    with _client(url) as client:
        csrf = _csrf(client)
        cases = [
            (tenant_path(TENANT, "runs", "x" * 5000, "cancel"), {"by": "op"}, "512 bytes"),
            (
                tenant_path(TENANT, "approvals", "y" * 5000),
                {"by": "op", "decision": "approve"},
                "512 bytes",
            ),
            ("/t/acme/runs//cancel", {"by": "op"}, "empty"),
            ("/t/acme/approvals/%20", {"by": "op", "decision": "approve"}, "empty"),
            (tenant_path(TENANT, "runs", "r-wait", "cancel"), {"by": ""}, "--by"),
            (tenant_path("x" * 600, "runs", "r-wait", "cancel"), {"by": "op"}, "512 bytes"),
        ]
        for path, form, why in cases:
            got = client.post(path, data={"csrf": csrf, **form}, headers=ORIGIN)
            assert 400 <= got.status_code < 500, (path[:50], got.status_code)
            assert why in _said(got), (path[:50], _said(got))
            assert "Traceback" not in got.text

    async def state() -> tuple[Any, Any]:
        async with open_stores(url) as stores:
            cp = await Checkpointer.from_stores(stores).latest(TENANT, "r-wait")
            return cp, await stores.approvals.get(TENANT, request_id)

    cp, approval = asyncio.run(state())
    assert str(cp.status) == "waiting_approval"
    assert approval.status is ApprovalStatus.pending


# --- markup from every stored value ---------------------------------------------------------


def test_markup_from_tool_names_errors_inputs_ids_tenants_and_filters_is_escaped(
    odd: tuple[str, str],
) -> None:
    url, _ = odd
    runs = tenant_path(ODD_TENANT, "runs")
    with _client(url) as client:
        pages = [
            client.get(runs),
            client.get(tenant_path(ODD_TENANT, "runs", "r-unknown")),
            client.get(tenant_path(ODD_TENANT, "runs", "r-explode")),
            client.get(tenant_path(ODD_TENANT, "runs", MARKUP)),
            client.get(
                runs + "?agent=" + quote('"><script>x</script>') + "&status=" + quote(MARKUP)
            ),
            client.get(tenant_path(ODD_TENANT, "runs", MARKUP + "-nope")),
            client.get("/tenant?tenant=" + quote(MARKUP), follow_redirects=True),
        ]
    for got in pages:
        assert got.status_code in (200, 404), got.status_code
        _no_raw_markup(got.text)
        assert "<script>x" not in got.text
    listed, unknown, exploded, odd_id = (_text(p) for p in pages[:4])
    # The values are shown, as text.
    assert "r-unknown" in listed and "r-explode" in listed
    assert "unknown tool" in unknown and "&lt;img src=x" in pages[1].text
    assert "exploded" in exploded and "&lt;img src=x" in pages[2].text
    assert "&lt;img src=x onerror=alert(1)&gt;" in pages[3].text and "completed" in odd_id
    assert "&lt;i&gt;t&lt;/i&gt;" in pages[0].text


# --- decisions twice and after the run moved on ---------------------------------------------


def test_a_double_click_on_approve_decides_once_and_the_worker_books_once(
    tmp_path: Path,
) -> None:
    url = _url(tmp_path)
    world = World()
    request_id = asyncio.run(_waiting(url, world))
    path = tenant_path(TENANT, "approvals", request_id)
    with _client(url) as client:
        csrf = _csrf(client)
        first = client.post(
            path,
            data={"csrf": csrf, "by": "alice", "decision": "approve", "note": "first"},
            headers=ORIGIN,
        )
        decided = asyncio.run(_approval(url, request_id))
        again = client.post(
            path,
            data={"csrf": csrf, "by": "alice", "decision": "approve", "note": "second"},
            headers=ORIGIN,
        )
        assert first.status_code == 200 and again.status_code in (200, 409)
        assert "approved by alice" in _said(again)
    after = asyncio.run(_approval(url, request_id))
    assert after.status is ApprovalStatus.approved
    assert after.note == "first" and after.decided_at == decided.decided_at
    assert asyncio.run(_work(url, world)) is RunStatus.completed
    assert len(world.bookings) == 1, world.bookings


def _completed_after_approval(url: str, world: World) -> str:
    request_id = asyncio.run(_waiting(url, world))
    with _client(url) as client:
        csrf = _csrf(client)
        first = client.post(
            tenant_path(TENANT, "approvals", request_id),
            data={"csrf": csrf, "by": "alice", "decision": "approve"},
            headers=ORIGIN,
        )
        assert first.status_code == 200, _said(first)
    assert asyncio.run(_work(url, world)) is RunStatus.completed
    return request_id


def test_a_deny_after_the_run_completed_is_refused_naming_who_decided(tmp_path: Path) -> None:
    url = _url(tmp_path)
    world = World()
    request_id = _completed_after_approval(url, world)
    with _client(url) as client:
        csrf = _csrf(client)
        late = client.post(
            tenant_path(TENANT, "approvals", request_id),
            data={"csrf": csrf, "by": "bob", "decision": "deny"},
            headers=ORIGIN,
        )
    assert late.status_code == 409 and "refused" in _heading(late).lower()
    assert "alice" in _said(late)
    assert asyncio.run(_approval(url, request_id)).by == "alice"
    assert len(world.bookings) == 1


def test_approving_again_after_the_run_completed_does_not_say_to_carry_it_on(
    tmp_path: Path,
) -> None:
    url = _url(tmp_path)
    world = World()
    request_id = _completed_after_approval(url, world)
    with _client(url) as client:
        csrf = _csrf(client)
        late = client.post(
            tenant_path(TENANT, "approvals", request_id),
            data={"csrf": csrf, "by": "alice", "decision": "approve"},
            headers=ORIGIN,
        )
    assert late.status_code in (200, 409)
    said = _said(late)
    assert "approved by alice" in said
    assert "--resume" not in said and "carry it on" not in said, said
    assert len(world.bookings) == 1


def test_a_cancel_after_the_run_completed_is_not_headed_recorded(tmp_path: Path) -> None:
    url = _url(tmp_path)
    world = World()
    _completed_after_approval(url, world)
    with _client(url) as client:
        csrf = _csrf(client)
        late = client.post(
            tenant_path(TENANT, "runs", "r-wait", "cancel"),
            data={"csrf": csrf, "by": "bob", "reason": "stale page"},
            headers=ORIGIN,
        )
        page = client.get(tenant_path(TENANT, "runs", "r-wait"))
    assert "nothing to cancel" in _said(late)
    assert "completed" in _text(page) and "cancelled" not in _text(page).split("Steps")[0]
    assert asyncio.run(_cancel_request(url, "r-wait")) is None  # nothing recorded...
    assert "recorded" not in _heading(late).lower(), _heading(late)  # ...yet it says so


async def _cancel_request(url: str, run_id: str) -> Any:
    async with open_stores(url) as stores:
        return await cancel_requested(stores.idempotency, TENANT, run_id)


def test_a_resolve_naming_another_runs_call_or_tenant_is_refused(tmp_path: Path) -> None:
    url = _url(tmp_path)
    asyncio.run(_in_flight(url, ("r-a", "c1"), ("r-b", "c2")))
    resolve = tenant_path(TENANT, "runs", "r-a", "resolve")
    with _client(url) as client:
        csrf = _csrf(client)
        for path, call in [
            (resolve, key_digest("k1:r-b-c2")),
            (resolve, "c2"),
            (tenant_path("globex", "runs", "r-a", "resolve"), "c1"),
            (tenant_path("globex", "runs", "r-a", "resolve"), key_digest("k1:r-a-c1")),
        ]:
            got = client.post(
                path,
                data={"csrf": csrf, "by": "op", "call": call, "what": "never_ran"},
                headers=ORIGIN,
            )
            assert got.status_code == 409, (path, call, got.status_code)
            assert "on record" in _said(got)
    for run_id in ("r-a", "r-b"):
        (rec,) = asyncio.run(_records(url, run_id))
        assert rec.status is RecordStatus.in_flight and rec.by is None


def test_a_double_click_on_resolve_records_once(tmp_path: Path) -> None:
    url = _url(tmp_path)
    asyncio.run(_in_flight(url, ("r-a", "c1")))
    form = {"by": "op", "call": key_digest("k1:r-a-c1"), "what": "outcome"}
    with _client(url) as client:
        csrf = _csrf(client)
        first = client.post(
            tenant_path(TENANT, "runs", "r-a", "resolve"),
            data={"csrf": csrf, **form, "outcome": '{"charged": 12}'},
            headers=ORIGIN,
        )
        again = client.post(
            tenant_path(TENANT, "runs", "r-a", "resolve"),
            data={"csrf": csrf, **form, "outcome": '{"charged": 13}'},
            headers=ORIGIN,
        )
    assert first.status_code == 200, _said(first)
    assert again.status_code == 409 and "not in flight" in _said(again)
    (rec,) = asyncio.run(_records(url, "r-a"))
    assert rec.status is RecordStatus.completed and rec.by == "op"
    assert "12" in str(rec.outcome) and "13" not in str(rec.outcome)


# --- a run held by a live worker, and after the worker dies ---------------------------------


def test_while_a_live_worker_holds_a_run_the_page_says_so_and_refuses_a_resolve(
    tmp_path: Path,
) -> None:
    url = _url(tmp_path)
    started, release = threading.Event(), threading.Event()
    sent: list[str] = []

    @tool
    def charge_card(amount: int, ctx: Any) -> dict[str, str]:
        """Charge (blocks until the test lets it end, then the worker dies)."""
        sent.append(ctx.idempotency_key)
        started.set()
        release.wait(10)
        raise SimulatedCrash("worker died mid-call")

    async def carry() -> None:
        async with open_stores(url) as stores:
            await stores.create_schema()
            with contextlib.suppress(SimulatedCrash):
                await runner(stores, [[("charge_card", {"amount": 12})], "done"]).run(
                    Agent("charger", "Charge.", [charge_card]),
                    "charge",
                    tenant=TENANT,
                    run_id="r-live",
                )

    thread = threading.Thread(target=lambda: asyncio.run(carry()), daemon=True)
    thread.start()
    try:
        assert started.wait(10)
        with _client(url) as client:
            csrf = _csrf(client)
            page = client.get(tenant_path(TENANT, "runs", "r-live"))
            stuck = client.get(tenant_path(TENANT, "runs") + "?stuck=1")
            listed = client.get(tenant_path(TENANT, "runs"))
            refused = client.post(
                tenant_path(TENANT, "runs", "r-live", "resolve"),
                data={
                    "csrf": csrf,
                    "by": "op",
                    "call": key_digest(sent[0]),
                    "what": "never_ran",
                },
                headers=ORIGIN,
            )
    finally:
        release.set()
        thread.join(15)
    text = _text(page)
    assert page.status_code == 200
    assert re.search(r"lease worker-[0-9a-f]+ \(fence 1\)", text), text[:800]
    assert "being carried now" in text
    assert "r-live" not in stuck.text
    assert re.search(r"r-live.*worker-[0-9a-f]+ \(fence 1\)", _text(listed))
    assert refused.status_code == 503 and "another worker holds the run" in _said(refused)
    (rec,) = asyncio.run(_records(url, "r-live"))
    assert rec.by is None and len(sent) == 1


_DYING_WORKER = textwrap.dedent(
    """
    import asyncio, os, sys
    from tesserix_adk import Agent, AgentRunner, LeasePolicy, ScriptedProvider
    from tesserix_adk import open_stores, tool

    @tool
    def charge_card(amount: int, ctx) -> dict:
        '''Charge, and the process dies before the outcome is recorded.'''
        print(ctx.idempotency_key, flush=True)
        os._exit(9)

    async def main():
        async with open_stores(sys.argv[1]) as stores:
            await stores.create_schema()
            runner = AgentRunner.from_stores(
                ScriptedProvider([[("charge_card", {"amount": 12})], "done"]),
                stores,
                lease_policy=LeasePolicy(ttl=2.0, renew_within=1.0),
            )
            await runner.run(
                Agent("charger", "Charge.", [charge_card]),
                "charge", tenant="acme", run_id="r-dead",
            )

    asyncio.run(main())
    """
)


def test_after_the_worker_process_dies_the_page_tells_it_once_the_lease_lapses(
    tmp_path: Path,
) -> None:
    url = _url(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    done = subprocess.run(
        [sys.executable, "-c", _DYING_WORKER, url],
        capture_output=True,
        text=True,
        timeout=30,
        env=env,
    )
    assert done.returncode == 9, done.stderr[-2000:]
    key = done.stdout.strip()
    assert key.startswith("k1:")
    died = time.monotonic()
    with _client(url) as client:
        csrf = _csrf(client)
        held = _text(client.get(tenant_path(TENANT, "runs", "r-dead")))
        # Until the dead worker's lease lapses the store cannot tell it from a live one.
        if time.monotonic() - died < 1.5:
            assert re.search(r"lease worker-[0-9a-f]+ \(fence 1\)", held), held[:800]
        time.sleep(max(0.0, 2.2 - (time.monotonic() - died)))
        page = client.get(tenant_path(TENANT, "runs", "r-dead"))
        stuck = client.get(tenant_path(TENANT, "runs") + "?stuck=1")
        resolved = client.post(
            tenant_path(TENANT, "runs", "r-dead", "resolve"),
            data={
                "csrf": csrf,
                "by": "op",
                "call": key_digest(key),
                "what": "outcome",
                "outcome": '{"charged": 12}',
            },
            headers=ORIGIN,
        )
        again = client.post(
            tenant_path(TENANT, "runs", "r-dead", "resolve"),
            data={
                "csrf": csrf,
                "by": "op2",
                "call": key_digest(key),
                "what": "outcome",
                "outcome": '{"charged": 12}',
            },
            headers=ORIGIN,
        )
    text = _text(page)
    assert "lease nobody" in text, text[:800]
    assert "no longer carries the run" in text and "in_flight" in text
    assert key not in page.text  # the key only as a digest
    assert "r-dead" in stuck.text
    assert resolved.status_code == 200, _said(resolved)
    assert again.status_code == 409
    (rec,) = asyncio.run(_records(url, "r-dead"))
    assert rec.status is RecordStatus.completed and rec.by == "op"
