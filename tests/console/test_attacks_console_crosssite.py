"""Fresh eyes on the operator console (README "### The console") as a hostile web page and
a careless operator would meet it, on SQLite stores in ``tmp_path``, with Starlette's
``TestClient`` (httpx over ASGI), uvicorn on loopback for raw requests, and ``tesserix ui``
through the CLI's ``main``. Angles the earlier console attack files had not taken.

Found, and fixed unless marked left (``_split_url`` masks a quoted piece of the URL's user
and password in libpq's error, and ``tesserix ui`` masks its error as every command does;
``create_app`` refuses serving off loopback with no token or a blank one):

- HIGH: ``tesserix ui --store postgresql://app:Pa%ssw0rd...@db/prod`` (a password holding a
  literal ``%``, as a careless operator pastes it) prints the password in clear on stderr:
  libpq's "invalid percent-encoded token" (or "forbidden value %00") quotes the password
  alone, ``adapters/postgres/opening.py`` ``_split_url`` only masks a quote of the whole URL,
  and ``cli/ui.py`` ``run_ui`` writes the ``ConfigurationError`` unredacted (the other
  commands mask the ``%zz`` shape only because the redactor reads ``token: "…"`` as a
  key/value pair, and print the ``%00`` shape in clear) --
  ``test_tesserix_ui_never_prints_a_postgres_password_holding_a_percent_sign``.
- MEDIUM: ``create_app(url, token="", loopback_only=False)`` (an embedder passing a token
  read from an environment variable that is unset) serves every page and takes every
  decision with no token at all: ``console/app.py`` ``create_app`` turns a blank token into
  "no token" (``token or None``) and nothing refuses serving off loopback without one, as
  ``tesserix ui`` does (exit 2) --
  ``test_a_blank_token_never_opens_the_console_off_loopback``.
- LOW (left): a run whose id is ``..`` or ``.``, and a tenant named ``.``, cannot be reached from
  the console's own links: ``pages.tenant_path`` writes the id as a bare dot segment
  (``/t/acme/runs/..``), which a browser (and httpx) resolves away before sending, so the
  runs list links to ``/t/acme/`` (Not Found) and ``/tenant?tenant=.`` redirects to
  ``/t/runs`` (Not Found) -- ``test_runs_and_tenants_named_with_dots_are_reachable_by_link``.

Held: no page read writes a byte to the store (a cross-site ``<img>`` can reach a GET on
loopback: every page, filter, 404, login form and static file leaves the database dump
identical); no address redirects off the console (``//evil.test/``, ``/login/?x=//evil``,
``/tenant?tenant=//evil.test``: same-host Locations only); a store down, misconfigured or
damaged is one sentence on an error page (a read 5xx) with the console's headers (no traceback, no
password: PostgreSQL closed port and unknown role, Redis closed port, a file that is not a
database, a database without the schema); a damaged ledger or approval row makes only that
run's page a clear error, as ``tesserix inspect`` (exit 4), the runs list stays up;
decisions the CLI refuses (a name past 512 bytes, a note or reason past 4,000 characters,
an outcome that is not JSON, a call id) never quote a secret the operator pasted in them,
and record nothing; stored markup meant to leave an attribute, a URL or an element (in a
run id, tenant, agent name, tool name, tool arguments, the user's input and an approval
note) leaves no element, attribute or link on any page that the templates did not write.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import re
import socket
import sqlite3
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest
from console_world import WAIT_TURNS, World, runner, served
from starlette.testclient import TestClient

from tesserix_adk import Agent, AgentRunner, RunStatus, ScriptedProvider, open_stores, tool
from tesserix_adk.cli.main import main
from tesserix_adk.console import create_app
from tesserix_adk.console.pages import tenant_path
from tesserix_adk.stores.protocols import ApprovalStatus

BASE = "http://127.0.0.1:8765"
ORIGIN = {"origin": BASE}
TENANT = "acme"
SECRET = "sk-live-CR0SSs1teSecret0123456789abcd"
PG_PASSWORD = "Pa%ssw0rd-Pr0d-2024"


# --- helpers ------------------------------------------------------------------------------


def _url(tmp_path: Path, name: str = "adk.sqlite3") -> str:
    return f"sqlite:///{tmp_path / name}"


def _client(app: Any) -> TestClient:
    return TestClient(app, base_url=BASE, raise_server_exceptions=False)


def _csrf(client: TestClient) -> str:
    assert client.get("/").status_code == 200
    cookie = client.cookies.get("tesserix_csrf")
    assert cookie is not None and len(cookie) == 64
    return str(cookie)


def _said(response: Any) -> str:
    found = re.search(r'<p (?:id="said"|class="refused")[^>]*>(.*?)</p>', response.text, re.S)
    return "" if found is None else found.group(1)


async def _waiting(url: str, *, tenant: str = TENANT, run_id: str = "r-wait") -> str:
    """A run of ``tenant`` waiting on approval; its request id."""
    async with open_stores(url) as stores:
        await stores.create_schema()
        result = await runner(stores, WAIT_TURNS).run(
            World().approver(), "book", tenant=tenant, run_id=run_id
        )
        assert result.status is RunStatus.waiting_approval
        assert result.pending_approval is not None
        return str(result.pending_approval.id)


async def _approval_status(url: str, request_id: str, tenant: str = TENANT) -> ApprovalStatus:
    async with open_stores(url) as stores:
        got = await stores.approvals.get(tenant, request_id)
        assert got is not None
        return got.status


async def _run_status(url: str, run_id: str, tenant: str = TENANT) -> str:
    from tesserix_adk import Checkpointer

    async with open_stores(url) as stores:
        cp = await Checkpointer.from_stores(stores).latest(tenant, run_id)
        assert cp is not None
        return str(cp.status)


def _dump(path: Path) -> str:
    with contextlib.closing(sqlite3.connect(path)) as conn:
        return "\n".join(conn.iterdump())


def _cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


def _raw_get(base: str, path: str) -> tuple[str, str]:
    """``GET path`` sent byte for byte (no client normalising it): status line, Location."""
    host_port = base.split("//", 1)[1]
    host, port = host_port.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(
            f"GET {path} HTTP/1.1\r\nHost: {host_port}\r\nConnection: close\r\n\r\n".encode()
        )
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head = data.split(b"\r\n\r\n", 1)[0].decode("latin-1").splitlines()
    location = next(
        (h.split(":", 1)[1].strip() for h in head if h.lower().startswith("location:")), ""
    )
    return head[0], location


# --- found --------------------------------------------------------------------------------


@pytest.mark.parametrize("password", [PG_PASSWORD, "Pa%00ssw0rd-Pr0d-2024"])
def test_tesserix_ui_never_prints_a_postgres_password_holding_a_percent_sign(
    password: str,
) -> None:
    """A careless operator pastes the database password as it is, ``%`` unescaped. The
    console must refuse the URL in one sentence (it does, exit 2) without printing the
    password: stderr is a terminal, a CI log, a ticket."""
    url = f"postgresql://app:{password}@db.internal.invalid/prod"
    code, out, err = _cli("--store", url, "ui", "--port", "0")
    assert code == 2
    assert "not usable" in err  # the sentence is about the URL...
    assert "ssw0rd-Pr0d-2024" not in out + err  # ...and never quotes the password


def test_a_blank_token_never_opens_the_console_off_loopback(tmp_path: Path) -> None:
    """An embedding product serves ``create_app(url, token=os.environ.get("UI_TOKEN", ""),
    loopback_only=False)`` on 0.0.0.0 and the variable is unset in one deployment. Either
    ``create_app`` refuses (as the CLI does, exit 2) or every request still needs a token;
    what must not happen is a console on the network deciding approvals for anyone."""
    url = _url(tmp_path)
    request_id = asyncio.run(_waiting(url))
    try:
        app = create_app(url, token="", loopback_only=False)
    except Exception as exc:  # refused at creation: what the CLI does
        assert "token" in str(exc)
        return
    with TestClient(app, base_url="http://console.corp.example") as stranger:
        listing = stranger.get(f"/t/{TENANT}/runs", follow_redirects=False)
        csrf = stranger.cookies.get("tesserix_csrf") or ""
        decided = stranger.post(
            f"/t/{TENANT}/approvals/{request_id}",
            data={"csrf": csrf, "by": "anyone", "decision": "approve"},
            headers={"origin": "http://console.corp.example"},
        )
    assert listing.status_code in (303, 401), listing.status_code
    assert decided.status_code == 401, decided.status_code
    assert asyncio.run(_approval_status(url, request_id)) is ApprovalStatus.pending


@pytest.mark.xfail(
    strict=True,
    reason="DEFECT LOW: console/pages.py tenant_path writes an id '.' or '..' as a bare dot "
    "segment, which a browser resolves away: such a run's link (and a tenant '.') leads to "
    "Not Found",
)
def test_runs_and_tenants_named_with_dots_are_reachable_by_link(tmp_path: Path) -> None:
    """Ids the kit takes (``run.ids`` refuses neither) must be reachable the way an operator
    reaches them: by the runs list's link, and by the tenant form."""
    url = _url(tmp_path)
    for run_id in ("..", "."):
        asyncio.run(_waiting(url, run_id=run_id))
    asyncio.run(_waiting(url, tenant=".", run_id="r-dot"))
    with _client(create_app(url)) as client:
        listing = client.get(f"/t/{TENANT}/runs")
        links = re.findall(r'<td><a href="([^"]+)">', listing.text)
        assert len(links) == 2
        pages = [client.get(link) for link in links]  # httpx resolves dot segments as browsers do
        assert [p.status_code for p in pages] == [200, 200]
        assert all("Waiting on approval" in p.text for p in pages)
        dotted = client.get("/tenant", params={"tenant": "."})
        assert dotted.status_code == 200 and ">r-dot</a>" in dotted.text


# --- held: a cross-site GET changes nothing, no redirect leaves the console --------------


def test_no_page_read_writes_to_the_store(tmp_path: Path) -> None:
    """Held. On loopback without a token a page of any site can make the browser GET any
    console address (``<img src>``); no read may change the store (a lease taken, a row
    repaired, an entry re-indexed)."""
    url = _url(tmp_path)
    asyncio.run(_waiting(url))
    asyncio.run(_waiting(url, tenant="globex", run_id="r-other"))
    path = tmp_path / "adk.sqlite3"
    before = _dump(path)
    with _client(create_app(url)) as client:
        for address in (
            "/",
            "/login",
            f"/tenant?tenant={TENANT}",
            f"/t/{TENANT}/runs",
            f"/t/{TENANT}/runs?stuck=1&status=waiting_approval&agent=approver",
            f"/t/{TENANT}/runs/r-wait",
            f"/t/{TENANT}/runs/r-wait/cancel",
            f"/t/{TENANT}/runs/r-wait/resolve",
            f"/t/{TENANT}/runs/never-was",
            "/t/globex/runs/r-other",
            "/static/console.css",
        ):
            assert client.get(address).status_code < 500, address
            assert client.head(address).status_code < 500, address
    assert _dump(path) == before


def test_no_address_redirects_off_the_console(tmp_path: Path) -> None:
    """Held. Starlette's slash redirects and the tenant form are the console's only
    redirects; none sends a browser to another host (raw requests, nothing normalised)."""
    url = _url(tmp_path)
    asyncio.run(_waiting(url))
    with served(create_app(url)) as base:
        for path in (
            "//evil.test",
            "//evil.test/",
            "///evil.test/",
            "/\\\\evil.test/",
            "//evil.test/login/",
            "/login/?x=//evil.test",
            "/tenant/?tenant=//evil.test",
            "/tenant?tenant=//evil.test",
            "/tenant?tenant=https://evil.test/",
            "/tenant?tenant=%0d%0aLocation:%20http://evil.test",
        ):
            status, location = _raw_get(base, path)
            assert not status.split()[1].startswith("5"), (path, status)
            if location:
                assert location.startswith((base + "/", "/")), (path, location)
                assert not location.startswith("//"), (path, location)
                assert "evil.test" not in location.split("?")[0].split("/t/")[0], (path, location)


# --- held: a store down or damaged --------------------------------------------------------


@pytest.mark.parametrize(
    "store",
    [
        f"postgresql://postgres:{SECRET}@127.0.0.1:1/test",
        f"postgresql://nosuchrole:{SECRET}@127.0.0.1:5432/test",
        f"redis://:{SECRET}@127.0.0.1:1/0",
        "garbage",
        "no-schema",
    ],
)
def test_a_store_down_or_misconfigured_is_one_sentence_without_a_password(
    tmp_path: Path, store: str
) -> None:
    """Held. Every read and decision on a store that cannot serve answers an error page with
    one sentence and the console's headers: no traceback, no password of the URL."""
    if store == "garbage":
        (tmp_path / "bad.sqlite3").write_bytes(b"not a database at all " * 64)
        store = _url(tmp_path, "bad.sqlite3")
    elif store == "no-schema":
        with contextlib.closing(sqlite3.connect(tmp_path / "empty.sqlite3")) as conn:
            conn.execute("CREATE TABLE unrelated (x)")
            conn.commit()
        store = _url(tmp_path, "empty.sqlite3")
    with _client(create_app(store)) as client:
        csrf = _csrf(client)
        answers = [
            client.get(f"/t/{TENANT}/runs"),
            client.get(f"/t/{TENANT}/runs/r-wait"),
            client.post(
                f"/t/{TENANT}/runs/r-wait/cancel", data={"csrf": csrf, "by": "op"}, headers=ORIGIN
            ),
        ]
    for answer in answers:
        assert answer.status_code >= 400, answer.text
        said = _said(answer)
        assert said.startswith("tesserix: "), answer.text
        assert SECRET not in answer.text and "Traceback" not in answer.text
        assert answer.headers["x-frame-options"] == "DENY"


@pytest.mark.parametrize(
    ("damage", "said"),
    [
        ("UPDATE adk_ledger SET micros = 'x' WHERE run_id = 'r-wait'", "ledger row"),
        ("UPDATE adk_approvals SET calls = '{not json' WHERE run_id = 'r-wait'", "approval"),
        ("UPDATE adk_approvals SET status = 'bogus' WHERE run_id = 'r-wait'", "approval"),
    ],
)
def test_a_damaged_ledger_or_approval_row_is_a_clear_page_as_the_cli_says(
    tmp_path: Path, damage: str, said: str
) -> None:
    """Held. The run's own page is one sentence naming the damaged row (no 500 without a
    word), as ``tesserix inspect`` exits 4 with it; the runs list and other runs stay up."""
    url = _url(tmp_path)
    asyncio.run(_waiting(url))
    asyncio.run(_waiting(url, run_id="r-fine"))
    with contextlib.closing(sqlite3.connect(tmp_path / "adk.sqlite3")) as conn:
        assert conn.execute(damage).rowcount == 1
        conn.commit()
    with _client(create_app(url)) as client:
        page = client.get(f"/t/{TENANT}/runs/r-wait")
        assert page.status_code == 500 and said in _said(page) and "damaged" in _said(page)
        assert client.get(f"/t/{TENANT}/runs").status_code == 200
        assert client.get(f"/t/{TENANT}/runs/r-fine").status_code == 200
    code, _, err = _cli("--store", url, "inspect", "r-wait", "--tenant", TENANT)
    assert code == 4 and said in err


# --- held: refused decisions quote no secret ----------------------------------------------


def test_refused_decisions_never_quote_a_secret_pasted_into_the_form(tmp_path: Path) -> None:
    """Held. A token pasted into the wrong field of a form the CLI then refuses (too long,
    not JSON, no such call) is never quoted back, and nothing is recorded."""
    url = _url(tmp_path)
    request_id = asyncio.run(_waiting(url))
    approve = f"/t/{TENANT}/approvals/{request_id}"
    cancel = f"/t/{TENANT}/runs/r-wait/cancel"
    with _client(create_app(url)) as client:
        csrf = _csrf(client)
        forms = [
            (approve, {"by": SECRET + "x" * 600, "decision": "deny"}),
            (approve, {"by": "x" * 500 + SECRET, "decision": "deny"}),
            (approve, {"by": "op", "note": SECRET + " " + "y" * 5000, "decision": "deny"}),
            (cancel, {"by": "op", "reason": SECRET + "z" * 5000}),
            (cancel, {"by": SECRET * 20}),
        ]
        for path, form in forms:
            answer = client.post(path, data={**form, "csrf": csrf}, headers=ORIGIN)
            assert answer.status_code == 409, answer.text
            assert "c0ns0le" not in answer.text and "CR0SSs1te" not in answer.text, form
    assert asyncio.run(_approval_status(url, request_id)) is ApprovalStatus.pending
    assert asyncio.run(_run_status(url, "r-wait")) == "waiting_approval"


# --- held: stored markup leaves no element, attribute or link ----------------------------

BREAKOUTS = (
    '"><svg onload=alert(1)>',
    "'><script>alert(2)</script>",
    "javascript:alert(3)",
    "</code></td></tr><form action=//evil.test>",
    "${csrf}$$run",
    "&#x3C;img src=x onerror=alert(4)&#x3E;",
    "<!--",
)

# What the console's own templates write.
TAGS = {
    "html", "head", "meta", "title", "link", "body", "header", "main", "a", "h1", "h2", "p",
    "dl", "dt", "dd", "code", "section", "ul", "ol", "li", "b", "table", "thead", "tbody",
    "tr", "th", "td", "form", "input", "label", "button", "select", "option", "span",
}  # fmt: skip
ATTRS = {
    "lang", "charset", "name", "content", "rel", "href", "id", "class", "method", "action",
    "type", "value", "required", "disabled", "hidden", "aria-hidden", "tabindex", "selected",
    "checked", "autofocus",
}  # fmt: skip


class _Shape(HTMLParser):
    """Every tag, attribute, link and comment of a page."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: set[str] = set()
        self.attrs: set[str] = set()
        self.links: list[str] = []
        self.comments: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.add(tag)
        for name, value in attrs:
            self.attrs.add(name)
            if name in ("href", "action", "src"):
                self.links.append(value or "")

    def handle_comment(self, data: str) -> None:
        self.comments.append(data)


async def _marked(url: str) -> None:
    """Runs whose id, agent, tool name, arguments, input and approval note carry markup that
    means to leave its element, attribute or URL; in a tenant of markup too."""
    hostile = "".join(BREAKOUTS)

    @tool(requires_approval=True)
    def book(flight: str) -> str:
        """Book."""
        return "booked " + hostile

    async with open_stores(url) as stores:
        await stores.create_schema()
        for tenant, run_id in ((TENANT, "r" + hostile), (hostile, "r-plain")):
            made = AgentRunner.from_stores(
                ScriptedProvider([[("book", {"flight": hostile, "x": [hostile]})], hostile]),
                stores,
            )
            result = await made.run(
                Agent("agent" + BREAKOUTS[0], "B.", [book]),
                "hi " + hostile,
                tenant=tenant,
                run_id=run_id,
            )
            assert result.status is RunStatus.waiting_approval
            assert result.pending_approval is not None
            await stores.approvals.decide(
                tenant, result.pending_approval.id, approved=False, by="op", note=hostile
            )
        # A tool name the model made up, kept in the frontier and the transcript.
        made_up = AgentRunner.from_stores(
            ScriptedProvider([[(BREAKOUTS[0][:20], {"q": hostile})], "done"]), stores
        )
        await made_up.run(Agent("plain", "P.", [book]), "go", tenant=TENANT, run_id="r-made-up")


def test_stored_markup_leaves_no_element_attribute_or_link_of_its_own(tmp_path: Path) -> None:
    """Held. The page is parsed as a browser would: only the templates' own tags and
    attributes, every link and form action on the console (``/`` then not ``/``), no
    comment but the templates' own, on the runs lists and the run pages of both tenants."""
    url = _url(tmp_path)
    asyncio.run(_marked(url))
    hostile = "".join(BREAKOUTS)
    with _client(create_app(url)) as client:
        pages = []
        for tenant in (TENANT, hostile):
            listing = client.get(tenant_path(tenant, "runs"), params={"agent": hostile})
            pages.append(listing)
            everything = client.get(tenant_path(tenant, "runs"))
            pages.append(everything)
            for link in re.findall(r'<td><a href="([^"]+)">', everything.text):
                pages.append(client.get(link.replace("&amp;", "&")))
        assert len(pages) == 7, [p.url for p in pages]
        for page in pages:
            assert page.status_code == 200, page.url
            shape = _Shape()
            shape.feed(page.text)
            assert shape.tags <= TAGS, (page.url, shape.tags - TAGS)
            assert shape.attrs <= ATTRS, (page.url, shape.attrs - ATTRS)
            # The approval form's own comment, and nothing a value opened.
            assert all(c.startswith(" The form's default button") for c in shape.comments)
            for link in shape.links:
                assert link.startswith(("/", "?")) and not link.startswith("//"), (page.url, link)
            assert "alert(" not in " ".join(shape.links)
