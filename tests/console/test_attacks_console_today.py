"""The console in a real headless Chromium on today's new states, attacked as an on-call
engineer would meet them: a run whose latest frontier is a tombstone, an approval request the
kit withdrew (its frontier too large), a run started with ``run()`` whose process was killed
(SIGKILL) before its first frontier, a run refused as "submitted with another input", and
cancels with reasons near 4,000 and 50,000 characters and names near 512.

Every page must render (no 500, no traceback), tell the truth about the state, refuse bad
input with a clear sentence, show what it shows as text (HTML, script, bidi overrides), keep
the CSRF and Origin guard, and never show a secret planted in an input, a reason, a name or
a tool's result. The browser is Debian's ``chromium`` driven by Playwright's sync API; the
console is served by uvicorn in a thread (``console_world.served``) on a real SQLite file.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import sqlite3
import threading
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
from console_world import TENANT, WAIT_TURNS, World, runner, served

from tesserix_adk import (
    Agent,
    AgentRunner,
    Checkpointer,
    CheckpointTooLargeError,
    RunStatus,
    ScriptedProvider,
    open_stores,
    tool,
)
from tesserix_adk.console import create_app
from tesserix_adk.run.approvals import KIT_DECIDER
from tesserix_adk.stores.protocols import ApprovalStatus

CHROMIUM = Path("/usr/bin/chromium")
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
SECRET = "sk-live-PLANTEDt0dayC0ns0leS3cret0123456789"
NAME_SECRET = "sk-proj-PLANTEDnameS3cretABCDEFGH0123456789xyz"
# Runs waiting on approval that the cancel tests end, one each.
WAITING = ("w-4000", "w-past", "w-html", "w-bidi", "w-secret", "w-csrf", "w-origin")

T = TypeVar("T")


def _in_thread(make: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """``asyncio.run(make())`` in a thread of its own: Playwright's sync API holds a loop in
    this one."""
    return _off_loop(lambda: asyncio.run(make()))


def _off_loop(call: Callable[[], T]) -> T:
    """``call()`` in a thread of its own (it may run an event loop of its own there)."""
    box: dict[str, Any] = {}

    def go() -> None:
        try:
            box["value"] = call()
        except BaseException as exc:  # handed back to the test
            box["error"] = exc

    thread = threading.Thread(target=go)
    thread.start()
    thread.join(60)
    if "error" in box:
        raise box["error"]
    return box["value"]  # type: ignore[no-any-return]


def _desk(*, approval: bool = False) -> Agent:
    @tool(side_effects=False)
    def fetch_report(size: int) -> str:
        """Fetch a report of ``size`` characters."""
        return "R" * size

    @tool(requires_approval=approval)
    def post_entry(memo: str) -> str:
        """Post one ledger entry; its receipt holds a token (a secret in a tool result)."""
        return f"posted; receipt token={SECRET}"

    return Agent("desk", "Do the books.", [fetch_report, post_entry])


async def _seed(url: str) -> str:
    """r-tomb: steps 1-3 whole, tombstones from step 4 (a report too large for any frontier),
    its input and a tool result holding a secret. r-withdrawn: a call needing approval whose
    frontier was too large (the request withdrawn, denied by the kit). r-twice: submitted with
    one input (a secret in it), then run() with another (refused). The WAITING runs wait on
    approval. Returns the withdrawn request's id."""
    async with open_stores(url) as stores:
        await stores.create_schema()
        turns: list[Any] = [
            [("post_entry", {"memo": "small"})],
            [("fetch_report", {"size": 30_000})],
            "Done.",
        ]
        tiny = AgentRunner.from_stores(ScriptedProvider(turns), stores, max_bytes=20_000)
        run = await tiny.run(_desk(), f"go, my key is {SECRET}", tenant=TENANT, run_id="r-tomb")
        assert run.status is RunStatus.completed
        asked: list[Any] = [[("post_entry", {"memo": "m" * 30_000})], "Posted."]
        tiny = AgentRunner.from_stores(ScriptedProvider(asked), stores, max_bytes=20_000)
        with contextlib.suppress(CheckpointTooLargeError):
            await tiny.run(_desk(approval=True), "post", tenant=TENANT, run_id="r-withdrawn")
        plain = AgentRunner.from_stores(ScriptedProvider(["ok"]), stores)
        await plain.submit(_desk(), f"first {SECRET}", tenant=TENANT, run_id="r-twice")
        with contextlib.suppress(Exception):
            await plain.run(_desk(), "another input", tenant=TENANT, run_id="r-twice")
        world = World()
        for run_id in WAITING:
            waiting = await runner(stores, WAIT_TURNS).run(
                world.approver(), "book", tenant=TENANT, run_id=run_id
            )
            assert waiting.status is RunStatus.waiting_approval
    with contextlib.closing(sqlite3.connect(url.removeprefix("sqlite:///"))) as db:
        rows = db.execute("SELECT id, run_id FROM adk_approvals").fetchall()
    [request_id] = [r for r, run_id in rows if run_id == "r-withdrawn"]
    return str(request_id)


class Site:
    """The seeded store, the console served on it, and the withdrawn request's id."""

    def __init__(self, url: str, base: str, withdrawn: str) -> None:
        self.url = url
        self.base = base
        self.withdrawn = withdrawn

    def run_path(self, run_id: str) -> str:
        return f"{self.base}/t/{TENANT}/runs/{run_id}"


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    url = f"sqlite:///{tmp_path_factory.mktemp('today') / 'adk.sqlite3'}"
    withdrawn = asyncio.run(_seed(url))
    with served(create_app(url)) as base:
        yield Site(url, base, withdrawn)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if not CHROMIUM.exists():
        reason = "Debian's chromium is absent (make chromium installs it)"
        if os.environ.get("CI") == "true":
            pytest.fail(reason)
        pytest.skip(reason)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        launched = p.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=ARGS)
        try:
            yield launched
        finally:
            launched.close()


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    """A fresh browser context (its own cookies) and page; any script dialog is recorded in
    ``page.dialogs`` (an alert would mean markup from the store ran)."""
    context = browser.new_context()
    tab = context.new_page()
    dialogs: list[str] = []
    tab.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
    tab.dialogs = dialogs
    try:
        yield tab
    finally:
        context.close()


def _fact(page: Any, name: str) -> str:
    """The value of the run page's fact ``name`` (its ``<dt>``/``<dd>`` pair)."""
    text: str = page.locator(f"dl.facts dt:text-is('{name}') + dd").inner_text()
    return text.strip()


def _cancel(page: Any, by: str, reason: str) -> Any:
    """Fill and send the page's cancel form; the response of the POST."""
    page.fill("section.cancel input[name=by]", by)
    page.fill("section.cancel input[name=reason]", reason)
    with page.expect_navigation() as nav:
        page.click("section.cancel button[type=submit]")
    return nav.value


async def _latest(url: str, run_id: str) -> Any:
    async with open_stores(url) as stores:
        return await Checkpointer.from_stores(stores).latest(TENANT, run_id)


def _no_trace(text: str) -> None:
    assert "Traceback" not in text and "Internal Server Error" not in text, text[-2000:]


# --- every page of today's states ---------------------------------------------------------


def test_every_page_of_todays_states_renders_and_shows_no_secret(site: Site, page: Any) -> None:
    response = page.goto(f"{site.base}/t/{TENANT}/runs")
    assert response.status == 200
    rows = page.inner_text("#runs")
    for run_id in ("r-tomb", "r-withdrawn", "r-twice"):
        assert run_id in rows
    assert SECRET not in page.content()
    for run_id in ("r-tomb", "r-withdrawn", "r-twice"):
        response = page.goto(site.run_path(run_id))
        assert response.status == 200, run_id
        content = page.content()
        _no_trace(content)
        assert SECRET not in content, run_id
    for query in ("?status=tombstone", "?stuck=1", "?status=submitted", "?agent=%3Cb%3E"):
        response = page.goto(f"{site.base}/t/{TENANT}/runs{query}")
        assert response.status == 200, query
        assert SECRET not in page.content()


def test_a_tombstoned_run_shows_its_conversation_from_the_last_step_written_whole(
    site: Site, page: Any
) -> None:
    page.goto(site.run_path("r-tomb"))
    assert _fact(page, "status") == "tombstone"
    said = page.inner_text("#messages")
    # Step 3's conversation: the input (masked), the post and its receipt (masked), the ask
    # for the report; the report itself was never written whole.
    assert "post_entry" in said and "fetch_report" in said and "[redacted" in said
    assert "RRRRRRRRRR" not in said and SECRET not in page.content()


def test_a_tombstoned_runs_page_says_which_step_its_conversation_is_from(
    site: Site, page: Any
) -> None:
    page.goto(site.run_path("r-tomb"))
    main = page.inner_text("main")
    # The latest frontier is step 5 (a tombstone); the conversation is step 3's.
    assert re.search(r"\bstep 3\b", main), main[-1500:]


@pytest.mark.parametrize("run_id", ["r-tomb", "r-withdrawn"])
def test_a_tombstoned_run_is_not_said_to_be_one_that_can_be_carried_on(
    site: Site, page: Any, run_id: str
) -> None:
    page.goto(site.run_path(run_id))
    assert _fact(page, "status") == "tombstone"
    assert _fact(page, "can be carried on") == "no"


def test_a_tombstoned_run_offers_no_resolve_or_approval_form(site: Site, page: Any) -> None:
    for run_id in ("r-tomb", "r-withdrawn"):
        page.goto(site.run_path(run_id))
        assert page.locator("form.resolve").count() == 0, run_id
        assert page.locator("#approval form").count() == 0, run_id
        assert page.locator("button[value=approve]").count() == 0, run_id


@pytest.mark.xfail(
    strict=True,
    reason="limit (README names it): the page of a run whose approval request the kit "
    "withdrew does not show that request (a tombstone names no request, and the approval "
    "store lists none by run); the run's error, and the reason a worker parks it for, name it",
)
def test_a_withdrawn_approval_is_shown_as_denied_by_the_kit(site: Site, page: Any) -> None:
    page.goto(site.run_path("r-withdrawn"))
    main = page.inner_text("main")
    assert KIT_DECIDER in main, main


def test_approving_a_withdrawn_request_from_the_browser_is_refused_and_it_stays_denied(
    site: Site, page: Any
) -> None:
    """A request the kit withdrew, approved by a form an attacker (or a stale tab) builds
    in a console page with that page's own CSRF token: refused, saying who decided; the
    request stays denied by the kit."""
    page.goto(site.run_path("r-twice"))
    csrf = page.locator("section.cancel input[name=csrf]").get_attribute("value")
    action = f"/t/{TENANT}/approvals/{site.withdrawn}"
    page.evaluate(
        """([action, csrf]) => {
            const f = document.createElement('form');
            f.method = 'post'; f.action = action;
            for (const [k, v] of [['csrf', csrf], ['by', 'alice'], ['decision', 'approve']]) {
                const i = document.createElement('input');
                i.type = 'hidden'; i.name = k; i.value = v; f.appendChild(i);
            }
            document.body.appendChild(f);
        }""",
        [action, csrf],
    )
    with page.expect_navigation() as nav:
        page.evaluate("document.forms[document.forms.length - 1].submit()")
    assert nav.value.status == 409
    said = page.inner_text("#said")
    _no_trace(page.content())
    assert "tesserix (the run cannot go on)" in said, said

    async def decided() -> Any:
        async with open_stores(site.url) as stores:
            return await stores.approvals.get(TENANT, site.withdrawn)

    asked = _in_thread(decided)
    assert asked.status is ApprovalStatus.denied and asked.by == KIT_DECIDER


def test_cancelling_a_tombstoned_run_does_not_say_refused_when_it_was_recorded(
    site: Site, page: Any
) -> None:
    page.goto(site.run_path("r-tomb"))
    response = _cancel(page, "oncall", "stop it")
    heading = page.inner_text("h1")
    said = page.inner_text("#said")
    _no_trace(page.content())
    assert "cannot be carried on" in said and "the cancel is recorded" in said, said
    assert "refused" not in heading.lower(), (response.status, heading, said)


# --- cancels: long reasons, long names, markup, bidi, secrets --------------------------------


def test_a_cancel_reason_of_4000_characters_and_a_name_of_512_are_kept(
    site: Site, page: Any
) -> None:
    reason = ("why " * 1000)[:3999] + "!"
    by = "o" * 511 + "n"
    page.goto(site.run_path("w-4000"))
    response = _cancel(page, by, reason)
    assert response.status == 200, page.inner_text("main")
    assert "Cancel recorded" in page.inner_text("h1")
    page.goto(site.run_path("w-4000"))
    assert _fact(page, "status") == "cancelled"
    assert page.locator("section.cancel").count() == 0
    cp = _in_thread(lambda: _latest(site.url, "w-4000"))
    assert cp.output == f"cancelled by {by}: {reason}"


def test_a_reason_past_4000_or_a_name_past_512_is_refused_clearly_and_nothing_is_recorded(
    site: Site, page: Any
) -> None:
    for by, reason, says in [
        ("oncall", "z" * 50_000, "4000"),
        ("oncall", "z" * 4001, "4000"),
        ("n" * 513, "stop", "512"),
    ]:
        page.goto(site.run_path("w-past"))
        response = _cancel(page, by, reason)
        assert 400 <= response.status < 500, response.status
        said = page.inner_text("main")
        _no_trace(page.content())
        assert says in said and "refused" in said.lower(), said[:500]
    cp = _in_thread(lambda: _latest(site.url, "w-past"))
    assert str(cp.status) == "waiting_approval"
    page.goto(site.run_path("w-past"))
    assert page.locator("#approval form").count() == 1


def test_html_and_script_in_a_cancel_name_and_reason_are_shown_as_text(
    site: Site, page: Any
) -> None:
    by = "<img src=x onerror=alert(1)>"
    reason = "</dd><script>alert(2)</script><b>bold</b>"
    page.goto(site.run_path("w-html"))
    _cancel(page, by, reason)
    page.goto(site.run_path("w-html"))
    page.goto(f"{site.base}/t/{TENANT}/runs")
    page.goto(site.run_path("w-html"))
    assert page.dialogs == []
    assert page.locator("main script").count() == 0
    assert page.locator("main img").count() == 0
    assert by in _fact(page, "output") and "<script>" in _fact(page, "output")


def test_a_bidi_override_in_a_cancel_name_is_not_shown_raw(site: Site, page: Any) -> None:
    by = "mallory\u202e,decnalab"
    page.goto(site.run_path("w-bidi"))
    _cancel(page, by, "spoof \u202eyrtne")
    page.goto(site.run_path("w-bidi"))
    assert _fact(page, "status") == "cancelled"
    assert "\u202e" not in page.content()


def test_a_secret_in_a_cancel_reason_or_name_never_reaches_a_page(site: Site, page: Any) -> None:
    page.goto(site.run_path("w-secret"))
    response = _cancel(page, f"ops {NAME_SECRET}", f"leaked key {SECRET} in the ticket")
    assert response.status == 200, page.inner_text("main")
    assert SECRET not in page.content() and NAME_SECRET not in page.content()
    for where in (site.run_path("w-secret"), f"{site.base}/t/{TENANT}/runs"):
        page.goto(where)
        content = page.content()
        assert SECRET not in content and NAME_SECRET not in content
    page.goto(site.run_path("w-secret"))
    assert "[redacted" in _fact(page, "output")


# --- the guard --------------------------------------------------------------------------------


def test_a_cancel_with_a_tampered_csrf_token_is_refused_and_the_run_waits_on(
    site: Site, page: Any
) -> None:
    page.goto(site.run_path("w-csrf"))
    page.evaluate(
        "document.querySelector('section.cancel input[name=csrf]').value = '0'.repeat(64)"
    )
    response = _cancel(page, "oncall", "stop")
    assert response.status == 403
    assert "CSRF" in page.inner_text("main")
    cp = _in_thread(lambda: _latest(site.url, "w-csrf"))
    assert str(cp.status) == "waiting_approval"


def test_a_cancel_posted_from_another_origin_on_the_same_host_is_refused(
    site: Site, page: Any, tmp_path: Path
) -> None:
    """A page of another port on 127.0.0.1 (same site, so SameSite cookies go along) posts
    the cancel form with the real CSRF token it somehow learnt: the Origin check refuses."""
    page.goto(site.run_path("w-origin"))
    csrf = page.locator("section.cancel input[name=csrf]").get_attribute("value")
    from starlette.applications import Starlette
    from starlette.responses import HTMLResponse
    from starlette.routing import Route

    action = site.run_path("w-origin") + "/cancel"
    evil = (
        f"<form id=f method=post action='{action}'><input name=csrf value='{csrf}'>"
        "<input name=by value=mallory><input name=reason value=gone></form>"
    )

    async def attacker(request: Any) -> HTMLResponse:
        return HTMLResponse(evil)

    with served(Starlette(routes=[Route("/", attacker)])) as other:
        page.goto(other + "/")
        with page.expect_navigation() as nav:
            page.evaluate("document.getElementById('f').submit()")
        assert nav.value.status == 403
        assert "Origin" in page.inner_text("main")
    cp = _in_thread(lambda: _latest(site.url, "w-origin"))
    assert str(cp.status) == "waiting_approval"


def test_behind_a_token_a_tombstoned_run_is_shown_only_after_login(site: Site, page: Any) -> None:
    with served(create_app(site.url, token="t0ken-of-the-console")) as base:
        page.goto(f"{base}/t/{TENANT}/runs/r-tomb")
        assert page.url.endswith("/login")
        assert "r-tomb" not in page.content()
        page.fill("input[name=token]", "wrong")
        with page.expect_navigation() as nav:
            page.click("button[type=submit]")
        assert nav.value.status == 401
        page.goto(f"{base}/login")
        page.fill("input[name=token]", "t0ken-of-the-console")
        with page.expect_navigation():
            page.click("button[type=submit]")
        page.goto(f"{base}/t/{TENANT}/runs/r-tomb")
        assert _fact(page, "status") == "tombstone"
        assert "t0ken-of-the-console" not in page.content()


# --- submissions: refused as another input, and killed before the first frontier ------------


def test_a_run_refused_as_submitted_with_another_input_shows_as_waiting_for_a_worker(
    site: Site, page: Any
) -> None:
    page.goto(site.run_path("r-twice"))
    assert _fact(page, "status") == "submitted"
    assert "no worker has started it yet" in _fact(page, "where")
    content = page.content()
    assert SECRET not in content and "another input" not in content
    assert page.locator("section.cancel form").count() == 1


def test_a_run_killed_before_its_first_frontier_shows_as_submitted_and_cancels_once(
    page: Any, tmp_path: Path
) -> None:
    """A real worker process started by ``run()`` semantics (its input kept as a
    submission), SIGKILLed in its first model call: the console shows the run as submitted
    (not "no such run"), and a cancel from the browser ends it before it started."""
    from processes import TENANT as DEMO
    from processes import Site as ProcessSite

    def killed() -> ProcessSite:
        proc = ProcessSite(tmp_path)
        proc.kill_at("first", "first_model_call")
        proc.wait_lease_lapsed("first")
        return proc

    proc = _off_loop(killed)
    with served(create_app(proc.store)) as base:
        response = page.goto(f"{base}/t/{DEMO}/runs/first")
        assert response.status == 200, page.inner_text("main")
        assert _fact(page, "status") == "submitted"
        page.goto(f"{base}/t/{DEMO}/runs")
        assert "first" in page.inner_text("#runs")
        page.goto(f"{base}/t/{DEMO}/runs/first")
        response = _cancel(page, "oncall", "not needed any more")
        assert response.status == 200, page.inner_text("main")
        page.goto(f"{base}/t/{DEMO}/runs/first")
        assert _fact(page, "status") == "cancelled"
        assert "cancelled before it started, by oncall" in _fact(page, "where")
        assert page.locator("section.cancel").count() == 0
    assert _off_loop(lambda: proc.bookings("first")) == 0
