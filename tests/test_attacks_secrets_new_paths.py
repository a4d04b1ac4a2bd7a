"""Attacks on README guarantee 7 (redaction) through the paths the recent changes added:
idempotency records carrying ``holder_run``/``holder_iteration``/``holder_call_id`` (a run
taking over another run's claim under a shared business key), ``tesserix show`` naming
"run X's call taken over by this run" (``call_of`` in its JSON), ``tesserix resolve`` in
``cli/resolving.py`` and its refusals naming runs and call ids, the operator's ``--by``,
and MCP error texts naming a server (``shown_url``). SQLite file bytes, the real CLI and
the real console (Starlette ``TestClient``).

Each defect below was found as a strict xfail and is fixed (the marker removed):
call ids holding a secret are replaced when the model's answer comes in
(``run/screening.py``, a digest of the id, so ids still pair calls with their results and
never collide), ``--by`` is masked as it is read (``cli/commands.py``), and a cancel's
``by`` is masked before it names the cancel claim's holder (``run/cancelling.py``).

Defects:

1. (MEDIUM) ``test_a_secret_in_a_models_call_id_is_not_printed_by_show_or_inspect``: a call
   id is the model's word (spans mask it: "they are the model's words"; a frontier's
   observation masks it), yet ``tesserix show`` and ``inspect`` (text and ``--json``) print
   it as the model gave it, on the run whose call it is and on the run that took it over.
2. (MEDIUM) ``test_a_secret_in_a_models_call_id_is_not_stored_raw``: the same id reaches
   the transcript (``tool_calls[].id``, ``tool_call_id``), the frontier's ``outstanding``
   and the idempotency row (``call_id`` and the taker's ``holder_call_id``) unmasked.
3. (MEDIUM) ``test_the_console_run_page_does_not_show_a_secret_call_id``: the console's run
   page shows it too ("Nothing secret is shown").
4. (LOW-MEDIUM) ``test_resolve_by_holding_a_secret_is_masked_where_stored_and_printed``:
   ``tesserix resolve --by`` is stored raw (``resolved_by``), printed raw by ``resolve
   --json`` and by ``show`` ("resolved by ..."), and ``resolve --json`` prints the model's
   raw call id; ``cancel --by`` of the same text is masked (the decision's own text).
5. (LOW-MEDIUM) ``test_cancel_by_holding_a_secret_is_not_kept_raw_in_the_cancel_claim``:
   ``cancel --by`` is masked in the cancel request's outcome, but the claim recording it is
   held by ``cancel:<by>`` (``run/cancelling.py``), stored raw in the ``holder`` column.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import sqlite3
import threading
from pathlib import Path
from typing import Any

import pytest

from mcp_tools.servers import JsonHttpHandler, QuietHTTPServer
from run.helpers import Asks
from run.shared_key import T, booking, crashes
from tesserix_adk import Agent, AgentRunner, LeasePolicy, RunStatus, ToolCall, open_stores, tool
from tesserix_adk.cli.jsonout import key_digest
from tesserix_adk.cli.main import main as cli_main
from test_attacks_secrets import sqlite_everything as sqlite_bytes

CALL_A = "sk-proj-QZCALLAQZaaaaaaaaaaaaaaaaaaaa1"
CALL_B = "sk-proj-QZCALLBQZbbbbbbbbbbbbbbbbbbbb2"
NEEDLES = ("QZCALLAQZ", "QZCALLBQZ")
BY = "ops Bearer QZBYQZ0123456789abcdef"
QUICK = LeasePolicy(ttl=0.5, renew_within=0.25)
KEY = "acme/order-5"


def cli(*argv: str) -> str:
    """``tesserix ARGV`` in process: exit code, stdout and stderr together."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli_main(list(argv))
    return f"exit {code}\n{out.getvalue()}\n{err.getvalue()}"


def books(call_id: str) -> Asks:
    return Asks([ToolCall(id=call_id, name="book", arguments={"order": "5"})], "done")


def takeover_world(tmp_path: Path) -> str:
    """r1 books order 5 under call id CALL_A and dies in the call (idempotent tool); r2
    books the same order under call id CALL_B and takes r1's claim over. SQLite URL."""
    url = f"sqlite:///{tmp_path / 'adk.sqlite3'}"

    async def go() -> None:
        async with open_stores(url) as stores:
            await stores.create_schema()
            sent: list[str] = []
            agent = Agent("shop", "Book.", [booking(sent, {"r1"}, idempotent=True)])
            one = AgentRunner.from_stores(books(CALL_A), stores, lease_policy=QUICK)
            await crashes(one, agent, "r1")
            two = AgentRunner.from_stores(books(CALL_B), stores, lease_policy=QUICK)
            done = await two.run(agent, "go", tenant=T, run_id="r2")
            assert done.status is RunStatus.completed
            assert sent == ["r1", "r2"]
            rec = (await stores.idempotency.lookup([KEY], tenant=T))[KEY]
            # The ids were replaced when the model's answers came in (a digest of each).
            assert (rec.run_id, rec.holder_run) == ("r1", "r2"), rec
            assert rec.call_id is not None and rec.holder_call_id is not None, rec
            assert rec.call_id.startswith("call_masked_"), rec
            assert rec.holder_call_id.startswith("call_masked_"), rec
            assert rec.call_id != rec.holder_call_id, rec

    asyncio.run(go())
    return url


def in_doubt_world(tmp_path: Path) -> str:
    """r1's non-idempotent booking, call id CALL_A, dies in flight: in doubt."""
    url = f"sqlite:///{tmp_path / 'adk.sqlite3'}"

    async def go() -> None:
        async with open_stores(url) as stores:
            await stores.create_schema()
            agent = Agent("shop", "Book.", [booking([], {"r1"})])
            one = AgentRunner.from_stores(books(CALL_A), stores, lease_policy=QUICK)
            await crashes(one, agent, "r1")

    asyncio.run(go())
    return url


def views(url: str, run_id: str) -> str:
    out = []
    for command in ("show", "inspect"):
        out.append(cli(command, run_id, "--tenant", T, "--store", url))
        out.append(cli(command, run_id, "--tenant", T, "--store", url, "--json"))
    return "\n".join(out)


# --- defects ------------------------------------------------------------------------------


def test_a_secret_in_a_models_call_id_is_not_printed_by_show_or_inspect(
    tmp_path: Path,
) -> None:
    url = takeover_world(tmp_path)
    shown = views(url, "r1") + views(url, "r2")
    # The new takeover lines are there (what the page is about) ...
    assert "run r1's call taken over by this run" in shown
    assert '"call_of": "r1"' in shown
    # ... and no byte of either model's secret.
    leaked = [n for n in NEEDLES if n in shown]
    assert leaked == [], [line for line in shown.splitlines() if "QZCALL" in line][:6]


def test_a_secret_in_a_models_call_id_is_not_stored_raw(tmp_path: Path) -> None:
    url = takeover_world(tmp_path)
    raw = sqlite_bytes(tmp_path / "adk.sqlite3")
    with contextlib.closing(sqlite3.connect(tmp_path / "adk.sqlite3")) as db:
        row = db.execute(
            "SELECT call_id, holder_call_id FROM adk_idempotency WHERE key = ?", (KEY,)
        ).fetchone()
    assert url and row is not None
    assert [n for n in NEEDLES if n.encode() in raw] == [], row


def test_the_console_run_page_does_not_show_a_secret_call_id(tmp_path: Path) -> None:
    from starlette.testclient import TestClient

    from tesserix_adk.console import create_app

    url = takeover_world(tmp_path)
    with TestClient(create_app(url), base_url="http://127.0.0.1:8765") as client:
        pages = {
            path: client.get(path)
            for path in ("/t/acme/runs", "/t/acme/runs/r1", "/t/acme/runs/r2")
        }
    for path, page in pages.items():
        assert page.status_code == 200, (path, page.text[:300])
    leaked = {path: [n for n in NEEDLES if n in page.text] for path, page in pages.items()}
    assert leaked == {path: [] for path in pages}, leaked


def test_resolve_by_holding_a_secret_is_masked_where_stored_and_printed(tmp_path: Path) -> None:
    url = in_doubt_world(tmp_path)
    said = cli(
        "resolve", "r1", "--tenant", T, "--store", url, "--call", key_digest(KEY),
        "--outcome", '{"booking": "BK-1"}', "--by", BY, "--json",
    )  # fmt: skip
    assert said.startswith("exit 0"), said
    shown = said + views(url, "r1")
    raw = sqlite_bytes(tmp_path / "adk.sqlite3")
    found = {
        "stored by": b"QZBYQZ" in raw,
        "printed by": "QZBYQZ" in shown,
        "printed call id": "QZCALLAQZ" in said,
    }
    assert found == dict.fromkeys(found, False), said


def test_cancel_by_holding_a_secret_is_not_kept_raw_in_the_cancel_claim(tmp_path: Path) -> None:
    url = in_doubt_world(tmp_path)
    said = cli("cancel", "r1", "--tenant", T, "--store", url, "--by", BY, "--reason", "x")
    assert said.startswith("exit 0"), said
    # What holds: the command's output and the request's stored outcome mask it.
    assert "QZBYQZ" not in said + cli("show", "r1", "--tenant", T, "--store", url, "--json")
    with contextlib.closing(sqlite3.connect(tmp_path / "adk.sqlite3")) as db:
        holders = [r[0] for r in db.execute("SELECT holder FROM adk_idempotency")]
    assert not any("QZBYQZ" in h for h in holders), holders
    assert b"QZBYQZ" not in sqlite_bytes(tmp_path / "adk.sqlite3")


# --- what held ----------------------------------------------------------------------------


def test_resolve_on_the_taker_refuses_naming_the_first_run_with_the_call_id_masked(
    tmp_path: Path,
) -> None:
    """The refusal names r1 (whose call it is), and no secret id: r2's call is named by
    the id the kit gave it in place of the model's (as ``show`` names it)."""
    url = takeover_world(tmp_path)
    said = cli("show", "r2", "--tenant", T, "--store", url, "--json")
    assert said.startswith("exit 0\n"), said
    shown = json.loads(said.removeprefix("exit 0\n"))
    (taken,) = [c["call_id"] for c in shown["calls"]]
    said = cli("resolve", "r2", "--tenant", T, "--store", url, "--call", taken, "--never-ran",
               "--by", "op")  # fmt: skip
    assert said.startswith("exit 4"), said
    assert "claimed under the same key by run 'r1'" in said, said
    assert "QZCALLAQZ" not in said, said


def test_a_business_key_holding_a_secret_is_refused_not_sent_nor_stored(tmp_path: Path) -> None:
    """A custom key that would hold a Bearer token is refused ("not sent"), never masked
    into a key another call could share; the plain key beside it dedupes as before."""
    url = f"sqlite:///{tmp_path / 'adk.sqlite3'}"
    sent: list[str] = []

    @tool(key=lambda **kw: f"order-{kw['arguments']['ref']}")
    def order(ref: str) -> str:
        """Place an order."""
        sent.append(ref)
        return f"placed {ref}"

    secret_ref = "Bearer QZKEYQZ0123456789abcdef"
    model = Asks(
        [
            ToolCall(id="a", name="order", arguments={"ref": secret_ref}),
            ToolCall(id="b", name="order", arguments={"ref": "Bearer QZKEYQZ0123456789zzzzzz"}),
            ToolCall(id="c", name="order", arguments={"ref": "5"}),
        ],
        "done",
    )

    async def go() -> None:
        async with open_stores(url) as stores:
            await stores.create_schema()
            agent = Agent("shop", "Order.", [order])
            run = await AgentRunner.from_stores(model, stores).run(
                agent, "go", tenant=T, run_id="r1"
            )
            assert run.status is RunStatus.completed
            again = Asks([ToolCall(id="d", name="order", arguments={"ref": "5"})], "done")
            # Another run under the same business key replays, it does not send again.
            await AgentRunner.from_stores(again, stores).run(agent, "go", tenant=T, run_id="r2")

    asyncio.run(go())
    assert sent == ["5"]
    told = [m.text for m in model.requests[-1].messages if m.role == "tool"]
    assert sum("not sent" in t for t in told) == 2, told
    assert b"QZKEYQZ" not in sqlite_bytes(tmp_path / "adk.sqlite3")


class _Refusing(JsonHttpHandler):
    status = 401

    def do_POST(self) -> None:
        self._request()
        self._reply(self.status, {"detail": "nope"})


@pytest.mark.parametrize("status", [401, 404, 500])
def test_an_mcp_server_refusing_the_connection_is_named_without_its_credentials(
    status: int,
) -> None:
    from tesserix_adk.mcp import MCPToolset, MCPUnavailableError

    handler = type("H", (_Refusing,), {"status": status})
    server = QuietHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    url = (
        f"http://bob:QZPWQZhunter2@127.0.0.1:{port}/s/QZPATHQZabcdef0123456789/mcp"
        "?api_key=QZQUERYQZ123456#QZFRAGQZ"
    )

    async def go() -> BaseException:
        try:
            async with MCPToolset.http(url, connect_timeout=5):
                pass
        except MCPUnavailableError as exc:
            return exc
        raise AssertionError("entered")

    try:
        exc = asyncio.run(go())
    finally:
        server.shutdown()
        server.server_close()
    import traceback

    text = "".join(traceback.format_exception(exc))
    assert f"http://127.0.0.1:{port}/s/…/mcp" in str(exc), exc
    for needle in ("QZPWQZ", "QZPATHQZ", "QZQUERYQZ", "QZFRAGQZ"):
        assert needle not in text, (needle, text[-500:])


def test_json_shows_call_of_for_the_taker(tmp_path: Path) -> None:
    """``show --json`` of r2 says whose call it took over."""
    url = takeover_world(tmp_path)
    said = cli("show", "r2", "--tenant", T, "--store", url, "--json")
    assert said.startswith("exit 0"), said
    story = json.loads(said[len("exit 0\n") :].rsplit("\n\n", 1)[0])
    found: list[Any] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if "call_of" in node:
                found.append(node["call_of"])
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(story)
    assert found == ["r1"], found
