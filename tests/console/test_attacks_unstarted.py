"""Attacks on runs that have no frontier yet (eec2528, ``run/unstarted.py``): a run submitted
and not started by a worker, and a run cancelled before any worker started it, as
``tesserix runs`` and the web console (runs list, the run's page, its cancel form) show them.

Attacked: run ids, agent names, cancellers and reasons with HTML, control characters and
unicode (console and CLI escaping); a cancel reason carrying an OpenAI-style key and a
``password=`` (redaction on every surface); the same run id submitted in two tenants, one
cancelled (reads and the cancel form stay in the tenant of the address); the cancel form's
CSRF token and Origin; a damaged cancel record in the idempotency store (the CLI list, the
console list, the page of another run); cancelling twice from the console; cancelling while
a worker carries the run before its first frontier; cancelling from a page left open while
a worker finished the run; resubmitting a cancelled id; a run parked before its first
frontier; ``--status``/``--stuck``/``--since``/``--limit``/``--agent`` mixed with real runs
and many finished runs; bad CLI input; the same listings on Redis and PostgreSQL.

Defects found, all fixed since, and their tests pass now (they were strict xfails):

- a damaged cancel record of ONE run makes ``tesserix runs`` exit 4 with no list at all (the
  message does not even name the run), instead of an ``unreadable`` row among the others;
- the same damaged record makes the console's runs page a 500 for the whole tenant;
- ...and the page of every OTHER submitted run of the tenant a 500 too (``unstarted_run``
  reads every done entry's cancel record to find one run);
- cancelling again a run already cancelled before it started: the answer (console and CLI)
  says it was cancelled "by bob", while the record that stands says erin (the first request
  stands; bob's was never recorded);
- cancelling a run a worker is carrying before its first frontier (its first model call
  in progress, the lease live) answers "cancelled before it started" (CLI JSON state
  ``cancelled_before_start``, and the console's answer) although nothing was cancelled:
  the worker stops it at its next boundary at best, and when the model answers without a
  call the run the operator was told was cancelled ends ``completed``;
- meanwhile the console's page of that run says "no worker has started it yet" (with the
  cancel form), and ``tesserix runs`` lists it as ``submitted`` with no lease, although a
  worker holds it.

Held (plain tests): every value is escaped on the console and in the CLI text; the secret in
a cancel reason is masked in the CLI text and JSON, the console list and the page; reads and
cancels stay in the tenant of the address; the cancel form needs the CSRF token and this
console's Origin; a cancelled-before-start run is listed once, as cancelled, among many
finished runs, by ``--status cancelled`` and not by ``--stuck``; ``--since`` and ``--limit``
order it with real runs by when it was cancelled; resubmitting its id keeps it cancelled and
no worker runs it; a run parked before its first frontier has a page saying why, is listed
as stuck and can be cancelled from it; cancelling from a page left open after a worker
finished the run says so and leaves it completed; a run cancelled while a worker carries it
before its first frontier ends cancelled (the call the model asked for never sent) when
the model answers with a call; a damaged cancel record ends the CLI in one line without a
traceback and its own run's page in a clear error; bad ``runs`` input ends in one sentence,
exit 2, no traceback; Redis and PostgreSQL list and isolate these runs the same way (a
tenant name with ``:`` in it too).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import re
import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from tesserix_adk import Agent, AgentRunner, ScriptedProvider, Worker, open_stores, tool
from tesserix_adk.cli.main import main
from tesserix_adk.console import create_app
from tesserix_adk.console.pages import tenant_path
from tesserix_adk.run.cancelling import cancel_key

BASE = "http://127.0.0.1:8765"
ORIGIN = {"origin": BASE}
T, OTHER = "acme", "globex"
KEY = "sk-proj-Zq3Xv9Lm2Nb7Tc5Rd1Wf8Hg4Jk6Ps0Yu2Ei9Oa3"
PASSWORD = "hunter2-Secr3t-pw"
SECRET_REASON = f"customer sent {KEY} and password={PASSWORD} by mail"
MARKUP = "<script>alert(1)</script>"


SENT: list[str] = []


@tool
def lookup(code: str) -> str:
    """Look a code up."""
    SENT.append(code)
    return code


def _agent(name: str = "booking") -> Agent:
    return Agent(name, "Book.", [lookup])


def _url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'adk.sqlite3'}"


async def _schema(url: str) -> None:
    async with open_stores(url) as stores:
        await stores.create_schema()


async def _submit(url: str, *run_ids: str, tenant: str = T, agent: str = "booking") -> None:
    async with open_stores(url) as stores:
        runner = AgentRunner.from_stores(ScriptedProvider([]), stores)
        for run_id in run_ids:
            await runner.submit(_agent(agent), "book", tenant=tenant, run_id=run_id)


async def _cancel(
    url: str, run_id: str, *, tenant: str = T, by: str = "erin", reason: str | None = None
) -> None:
    async with open_stores(url) as stores:
        runner = AgentRunner.from_stores(ScriptedProvider([]), stores)
        assert await runner.cancel(run_id, tenant=tenant, by=by, reason=reason) is None


async def _work(url: str, turns: int) -> None:
    """A worker carries every run due (each run answers "done" at once) and exits."""
    async with open_stores(url) as stores:
        runner = AgentRunner.from_stores(ScriptedProvider(["done"] * turns), stores)
        worker = Worker(runner, [_agent()], exit_when_idle=True, poll_interval=0.01)
        await asyncio.wait_for(worker.run(), 60)


def _cli(url: str, *args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(["--store", url, *args])
        except SystemExit as exc:  # argparse's own exit, if it ever escapes main
            code = exc.code if isinstance(exc.code, int) else 2
    return code, out.getvalue(), err.getvalue()


def _runs(url: str, *extra: str, tenant: str = T) -> list[dict[str, Any]]:
    code, out, err = _cli(url, "runs", "--tenant", tenant, "--json", *extra)
    assert code == 0, (out, err)
    rows: list[dict[str, Any]] = json.loads(out)["runs"]
    return rows


def _client(url: str) -> TestClient:
    return TestClient(create_app(url), base_url=BASE, raise_server_exceptions=False)


def _csrf(client: TestClient, path: str) -> str:
    page = client.get(path)
    assert page.status_code == 200, page.text
    found = re.search(r'name="csrf" value="([0-9a-f]{64})"', page.text)
    assert found is not None, "the page has no cancel form"
    return found.group(1)


def _main(text: str) -> str:
    found = re.search(r"<main>(.*)</main>", text, re.S)
    assert found is not None, text
    return found.group(1)


def _rows(text: str) -> list[str]:
    return re.findall(r'<tr class="[^"]*">.*?</tr>', text, re.S)


def _row_of(text: str, run_id_html: str) -> str:
    found = [r for r in _rows(text) if f">{run_id_html}</a>" in r]
    assert len(found) == 1, (run_id_html, _rows(text))
    return found[0]


def _damage_cancel_record(url: str, run_id: str, tenant: str = T) -> None:
    path = url.removeprefix("sqlite:///")
    with contextlib.closing(sqlite3.connect(path)) as con, con:
        changed = con.execute(
            "UPDATE adk_idempotency SET outcome = x'00ff10' WHERE key = ? AND tenant = ?",
            (cancel_key(tenant, run_id), tenant),
        ).rowcount
    assert changed == 1


# --- escaping and secrets -------------------------------------------------------------------


ODD_ID = '<img src=x onerror=alert(1)>"/q\x1b[2J\u202e\u00e9'


def test_odd_ids_names_and_reasons_are_escaped_on_the_console_and_in_the_cli(
    tmp_path: Path,
) -> None:
    url = _url(tmp_path)
    asyncio.run(_schema(url))
    asyncio.run(_submit(url, ODD_ID, ODD_ID + "-2", agent=f"bo{MARKUP}k\x1b[1m"))
    asyncio.run(
        _cancel(url, ODD_ID, by=f"{MARKUP}\x1b[31m", reason=f"{MARKUP}\x1b]0;pwn\x07\nnext")
    )
    code, out, err = _cli(url, "runs", "--tenant", T, "--no-header")
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert len(lines) == 2, out  # the newline in the reason is not a new row
    assert not any(c in out for c in "\x1b\x07\u202e")
    (cancelled,) = [line for line in lines if "cancelled before it started" in line]
    assert "\\x1b]0;pwn\\x07\\nnext" in cancelled
    with _client(url) as client:
        listing = client.get(tenant_path(T, "runs"))
        assert listing.status_code == 200
        assert "<script>" not in listing.text and "<img" not in listing.text
        assert "&lt;img src=x onerror=alert(1)&gt;&quot;/q" in listing.text
        assert len(_rows(listing.text)) == 2
        for run_id in (ODD_ID, ODD_ID + "-2"):
            page = client.get(tenant_path(T, "runs", run_id))
            assert page.status_code == 200, page.text
            body = _main(page.text)
            assert "<script>" not in body and "<img" not in body
            assert "&lt;script&gt;alert(1)&lt;/script&gt;" in body  # the agent's name
        cancelled_page = client.get(tenant_path(T, "runs", ODD_ID)).text
        assert "cancelled before it started, by &lt;script&gt;" in cancelled_page


def test_a_secret_in_a_cancel_reason_is_masked_in_the_cli_and_on_the_console(
    tmp_path: Path,
) -> None:
    url = _url(tmp_path)
    asyncio.run(_schema(url))
    asyncio.run(_submit(url, "r-cli", "r-web"))
    code, out, err = _cli(
        url, "cancel", "r-cli", "--tenant", T, "--by", "ops", "--reason", SECRET_REASON
    )
    assert code == 0, err
    assert "cancelled before it started, by ops" in out and KEY not in out
    with _client(url) as client:
        csrf = _csrf(client, tenant_path(T, "runs", "r-web"))
        done = client.post(
            tenant_path(T, "runs", "r-web", "cancel"),
            data={"csrf": csrf, "by": "erin", "reason": SECRET_REASON},
            headers=ORIGIN,
        )
        assert done.status_code == 200, done.text
        shown = [done.text, client.get(tenant_path(T, "runs")).text]
        shown += [client.get(tenant_path(T, "runs", r)).text for r in ("r-cli", "r-web")]
        shown.append(client.get(tenant_path(T, "runs"), params={"status": "cancelled"}).text)
    shown += [_cli(url, "runs", "--tenant", T, *extra)[1] for extra in ((), ("--json",))]
    for text in shown:
        assert KEY not in text and PASSWORD not in text and "Zq3Xv9Lm2Nb7" not in text
    assert shown[1].count("cancelled before it started") == 2
    assert "[redacted:" in shown[1] and "[redacted:" in shown[-1]
    rows = {r["run_id"]: r for r in _runs(url, "--status", "cancelled")}
    assert set(rows) == {"r-cli", "r-web"}
    assert rows["r-web"]["reason"].startswith("cancelled before it started, by erin: customer sent")


# --- tenants, CSRF and Origin ----------------------------------------------------------------


def test_the_same_run_id_in_two_tenants_stays_in_the_tenant_of_the_address(
    tmp_path: Path,
) -> None:
    url = _url(tmp_path)
    asyncio.run(_schema(url))
    asyncio.run(_submit(url, "same", tenant=T))
    asyncio.run(_submit(url, "same", tenant=OTHER))
    asyncio.run(_cancel(url, "same", tenant=T, by="erin", reason="acme gave up"))
    assert [(r["run_id"], r["status"]) for r in _runs(url)] == [("same", "cancelled")]
    assert [(r["run_id"], r["status"]) for r in _runs(url, tenant=OTHER)] == [("same", "submitted")]
    assert _runs(url, "--status", "cancelled", tenant=OTHER) == []
    with _client(url) as client:
        theirs = client.get(tenant_path(OTHER, "runs", "same")).text
        assert "no worker has started it yet" in theirs and "Cancel the run" in theirs
        assert "acme gave up" not in theirs
        assert "acme gave up" not in client.get(tenant_path(OTHER, "runs")).text
        ours = client.get(tenant_path(T, "runs", "same")).text
        assert "cancelled before it started, by erin: acme gave up" in ours
        assert "Cancel the run" not in ours
        # Cancelling globex's run from its page cancels globex's, by whom it says.
        csrf = _csrf(client, tenant_path(OTHER, "runs", "same"))
        done = client.post(
            tenant_path(OTHER, "runs", "same", "cancel"),
            data={"csrf": csrf, "by": "gus", "reason": "globex too"},
            headers=ORIGIN,
        )
        assert done.status_code == 200, done.text
        theirs = client.get(tenant_path(OTHER, "runs", "same")).text
        assert "cancelled before it started, by gus: globex too" in theirs
        assert "by erin" not in theirs
        ours = client.get(tenant_path(T, "runs", "same")).text
        assert "by erin: acme gave up" in ours and "gus" not in ours
        # A tenant that never had the run: no page.
        assert client.get(tenant_path("initech", "runs", "same")).status_code == 404


def test_cancelling_a_submitted_run_needs_the_csrf_token_and_this_consoles_origin(
    tmp_path: Path,
) -> None:
    url = _url(tmp_path)
    asyncio.run(_schema(url))
    asyncio.run(_submit(url, "r-q"))
    path = tenant_path(T, "runs", "r-q", "cancel")
    with _client(url) as client:
        csrf = _csrf(client, tenant_path(T, "runs", "r-q"))
        form = {"csrf": csrf, "by": "mallory"}
        assert client.post(path, data=form).status_code == 403  # no Origin
        assert (
            client.post(path, data=form, headers={"origin": "http://evil.example"}).status_code
            == 403
        )
        assert client.post(path, data={"by": "mallory"}, headers=ORIGIN).status_code == 403
        assert client.post(path, data={**form, "csrf": "0" * 64}, headers=ORIGIN).status_code == 403
        page = client.get(tenant_path(T, "runs", "r-q")).text
        assert "no worker has started it yet" in page and "Cancel the run" in page
    assert [(r["run_id"], r["status"]) for r in _runs(url)] == [("r-q", "submitted")]


# --- a damaged cancel record -------------------------------------------------------------------


def _damaged_world(tmp_path: Path) -> str:
    """acme: a run carried to its end, a submitted run, and one cancelled before it started
    whose cancel record is damaged."""
    url = _url(tmp_path)
    asyncio.run(_schema(url))
    asyncio.run(_submit(url, "r-done"))
    asyncio.run(_work(url, 1))
    asyncio.run(_submit(url, "r-waiting", "r-broken"))
    asyncio.run(_cancel(url, "r-broken", reason="gone"))
    _damage_cancel_record(url, "r-broken")
    return url


def test_cli_runs_lists_a_damaged_cancel_record_as_an_unreadable_row(tmp_path: Path) -> None:
    url = _damaged_world(tmp_path)
    code, out, err = _cli(url, "runs", "--tenant", T, "--json")
    assert "Traceback" not in err
    assert code == 0, err
    rows = {r["run_id"]: r for r in json.loads(out)["runs"]}
    assert rows["r-done"]["status"] == "completed"
    assert rows["r-waiting"]["status"] == "submitted"
    assert rows["r-broken"]["status"] == "unreadable"


def test_a_damaged_cancel_record_ends_the_cli_in_one_sentence_without_a_traceback(
    tmp_path: Path,
) -> None:
    # Held (as far as it goes): whatever it exits with, one line on stderr, no traceback,
    # and a filter that needs no cancel record (--status completed) still lists.
    url = _damaged_world(tmp_path)
    code, out, err = _cli(url, "runs", "--tenant", T)
    assert "Traceback" not in err and len(err.strip().splitlines()) <= 1
    assert code in (0, 4) and "Traceback" not in out
    assert _runs(url, "--status", "completed")[0]["run_id"] == "r-done"


def test_console_runs_list_survives_a_damaged_cancel_record(tmp_path: Path) -> None:
    url = _damaged_world(tmp_path)
    with _client(url) as client:
        listing = client.get(tenant_path(T, "runs"))
        assert listing.status_code == 200, listing.text
        assert ">r-done</a>" in listing.text and ">r-waiting</a>" in listing.text
        assert "unreadable" in _row_of(listing.text, "r-broken")


def _damaged_record_world(tmp_path: Path) -> str:
    """acme: two runs carried to their end, one of whose call records is damaged."""
    url = _url(tmp_path)
    asyncio.run(_schema(url))

    async def carried(run_id: str) -> None:
        async with open_stores(url) as stores:
            turns = [[("lookup", {"code": run_id})], "done"]
            runner = AgentRunner.from_stores(ScriptedProvider(turns), stores)
            await runner.run(_agent(), "book", tenant=T, run_id=run_id)

    asyncio.run(carried("r-done"))
    asyncio.run(carried("r-bad"))
    path = url.removeprefix("sqlite:///")
    with contextlib.closing(sqlite3.connect(path)) as con, con:
        damaged = con.execute(
            "UPDATE adk_idempotency SET status = 'bogus' WHERE run_id = 'r-bad'"
        ).rowcount
    assert damaged >= 1
    return url


def test_one_runs_damaged_call_record_hides_no_other_run(tmp_path: Path) -> None:
    url = _damaged_record_world(tmp_path)
    code, out, err = _cli(url, "runs", "--tenant", T, "--json")
    assert code == 0, err
    rows = {r["run_id"]: r for r in json.loads(out)["runs"]}
    assert rows["r-done"]["status"] == "completed"
    assert rows["r-bad"]["status"] == "unreadable" and "damaged" in rows["r-bad"]["reason"]
    with _client(url) as client:
        listing = client.get(tenant_path(T, "runs"))
        assert listing.status_code == 200, listing.text
        assert ">r-done</a>" in listing.text
        assert "unreadable" in _row_of(listing.text, "r-bad")


def test_the_page_of_another_submitted_run_survives_a_damaged_cancel_record(
    tmp_path: Path,
) -> None:
    url = _damaged_world(tmp_path)
    with _client(url) as client:
        page = client.get(tenant_path(T, "runs", "r-waiting"))
        assert page.status_code == 200, page.text
        assert "no worker has started it yet" in page.text and "Cancel the run" in page.text


def test_the_page_of_the_run_with_the_damaged_cancel_record_is_a_clear_error(
    tmp_path: Path,
) -> None:
    url = _damaged_world(tmp_path)
    with _client(url) as client:
        page = client.get(tenant_path(T, "runs", "r-broken"))
        assert page.status_code in (200, 500), page.text
        assert "Traceback" not in page.text
        if page.status_code == 500:
            assert "recorded outcome" in page.text or "cannot be read" in page.text
        # The run carried to its end keeps its own page (it has a frontier).
        assert client.get(tenant_path(T, "runs", "r-done")).status_code == 200


# --- cancelling twice, while carried, after it finished -------------------------------------


def test_a_second_cancel_names_who_actually_cancelled_the_run(tmp_path: Path) -> None:
    url = _url(tmp_path)
    asyncio.run(_schema(url))
    asyncio.run(_submit(url, "r-twice"))
    with _client(url) as client:
        path = tenant_path(T, "runs", "r-twice")
        csrf = _csrf(client, path)  # two tabs open on the page, both with the form
        first = client.post(
            f"{path}/cancel", data={"csrf": csrf, "by": "erin", "reason": "gone"}, headers=ORIGIN
        )
        assert first.status_code == 200 and "by erin" in first.text
        second = client.post(
            f"{path}/cancel", data={"csrf": csrf, "by": "bob", "reason": "me too"}, headers=ORIGIN
        )
        # The run stays cancelled by erin, whatever the second answer is...
        assert "cancelled before it started, by erin: gone" in client.get(path).text
        (row,) = _runs(url)
        assert row["reason"] == "cancelled before it started, by erin: gone"
        # ...and the answer to bob must not say bob cancelled it.
        assert "by bob" not in second.text, second.text
    code, out, _ = _cli(url, "cancel", "r-twice", "--tenant", T, "--by", "carol", "--json")
    assert code == 0 and json.loads(out)["by"] != "carol"


class _SlowFirstTurn(ScriptedProvider):
    """Plays ``turns``, the first once ``gate`` is set; ``asked`` is set when the model is
    first asked."""

    def __init__(self, turns: list[Any], asked: threading.Event, gate: threading.Event) -> None:
        super().__init__(turns)
        self.asked, self.gate = asked, gate

    async def _wait(self) -> None:
        self.asked.set()
        for _ in range(3000):
            if self.gate.is_set():
                return
            await asyncio.sleep(0.01)

    async def complete(self, request: Any) -> Any:
        await self._wait()
        return await super().complete(request)

    async def complete_streaming(self, request: Any, on_text: Any) -> Any:
        await self._wait()
        return await super().complete_streaming(request, on_text)


@contextlib.contextmanager
def _carried(url: str, run_id: str, turns: tuple[Any, ...] = ("done",)) -> Iterator[dict[str, Any]]:
    """A worker's runner carrying the submitted ``run_id`` in another thread, held in its
    first model call (lease live, no frontier yet) until the block ends; yields what it
    ended with (filled once the block is left)."""
    asked, gate = threading.Event(), threading.Event()
    ended: dict[str, Any] = {}

    async def carry() -> None:
        async with open_stores(url) as stores:
            runner = AgentRunner.from_stores(_SlowFirstTurn(list(turns), asked, gate), stores)
            try:
                ended["run"] = await runner.run(_agent(), "book", tenant=T, run_id=run_id)
            except Exception as exc:
                ended["error"] = exc

    thread = threading.Thread(target=lambda: asyncio.run(carry()), daemon=True)
    thread.start()
    try:
        assert asked.wait(30), "the run never reached its first model call"
        yield ended
    finally:
        gate.set()
        thread.join(60)


def _carried_world(tmp_path: Path) -> str:
    url = _url(tmp_path)
    asyncio.run(_schema(url))
    asyncio.run(_submit(url, "r-busy"))
    return url


def test_a_run_carried_before_its_first_frontier_still_ends_cancelled_when_cancelled(
    tmp_path: Path,
) -> None:
    # Held: the cancel request reaches the worker once the model has answered with a call
    # (after_model_call, before the call is sent); the run ends cancelled, listed once, with
    # its frontier, and the call was never sent.
    url = _carried_world(tmp_path)
    turns = ([("lookup", {"code": "X1"})], "done")
    with _carried(url, "r-busy", turns) as ended:
        assert _cli(url, "cancel", "r-busy", "--tenant", T, "--by", "erin")[0] == 0
    assert "error" not in ended, ended
    assert str(ended["run"].status) == "cancelled"
    assert "X1" not in SENT
    (row,) = _runs(url)
    assert (row["run_id"], row["status"]) == ("r-busy", "cancelled") and row["step"] is not None


def test_cancelling_a_run_a_worker_carries_does_not_claim_it_never_started(
    tmp_path: Path,
) -> None:
    url = _carried_world(tmp_path)
    with _carried(url, "r-busy") as ended:
        code, out, _ = _cli(url, "cancel", "r-busy", "--tenant", T, "--by", "erin", "--json")
        assert code == 0
        answer = json.loads(out)
    assert "error" not in ended, ended
    if answer["state"] == "cancelled_before_start":
        # What the operator was told must be what became of the run.
        assert str(ended["run"].status) == "cancelled", (answer, ended["run"].status)
    assert answer["state"] != "cancelled_before_start", answer


def test_the_console_cancel_of_a_carried_run_does_not_claim_it_never_started(
    tmp_path: Path,
) -> None:
    url = _carried_world(tmp_path)
    with _carried(url, "r-busy"):
        with _client(url) as client:
            assert client.get(tenant_path(T, "runs")).status_code == 200
            csrf = str(client.cookies.get("tesserix_csrf"))
            said = client.post(
                tenant_path(T, "runs", "r-busy", "cancel"),
                data={"csrf": csrf, "by": "bob"},
                headers=ORIGIN,
            ).text
        assert "cancelled before it started" not in said, said


def test_the_page_of_a_run_a_worker_carries_does_not_say_no_worker_started_it(
    tmp_path: Path,
) -> None:
    url = _carried_world(tmp_path)
    with _carried(url, "r-busy"), _client(url) as client:
        page = client.get(tenant_path(T, "runs", "r-busy"))
        assert page.status_code == 200
        assert "no worker has started it yet" not in page.text, _main(page.text)
        assert "worker-" in _main(page.text)  # who holds it


def test_cli_runs_shows_the_live_lease_of_a_run_carried_before_its_first_frontier(
    tmp_path: Path,
) -> None:
    url = _carried_world(tmp_path)
    with _carried(url, "r-busy"):
        (row,) = _runs(url)
        assert row["run_id"] == "r-busy"
        assert row["lease"] is not None, row


def test_cancelling_from_a_page_left_open_after_a_worker_finished_the_run(
    tmp_path: Path,
) -> None:
    url = _url(tmp_path)
    asyncio.run(_schema(url))
    asyncio.run(_submit(url, "r-late"))
    with _client(url) as client:
        path = tenant_path(T, "runs", "r-late")
        csrf = _csrf(client, path)
        assert "Cancel the run" in client.get(path).text
        asyncio.run(_work(url, 1))  # meanwhile a worker carries it to its end
        said = client.post(f"{path}/cancel", data={"csrf": csrf, "by": "erin"}, headers=ORIGIN)
        assert "had already ended completed; nothing to cancel" in said.text
        assert "cancelled before it started" not in said.text
        row = _row_of(client.get(tenant_path(T, "runs")).text, "r-late")
        assert "<td>completed</td>" in row
    ((run_id, status),) = [(r["run_id"], r["status"]) for r in _runs(url)]
    assert (run_id, status) == ("r-late", "completed")
    assert _runs(url, "--status", "cancelled") == []


# --- resubmitting, parking, filters, many finished runs ---------------------------------------


def test_resubmitting_a_cancelled_id_keeps_it_cancelled_and_no_worker_runs_it(
    tmp_path: Path,
) -> None:
    url = _url(tmp_path)
    asyncio.run(_schema(url))
    asyncio.run(_submit(url, "r-again"))
    asyncio.run(_cancel(url, "r-again", reason="first"))
    asyncio.run(_submit(url, "r-again"))  # a client retrying its request
    asyncio.run(_work(url, 0))  # a worker with no turn to give: it must find nothing due
    (row,) = _runs(url)
    assert (row["status"], row["step"]) == ("cancelled", None)
    assert row["reason"] == "cancelled before it started, by erin: first"


def test_a_run_parked_before_its_first_frontier_has_a_page_saying_why_and_can_be_cancelled(
    tmp_path: Path,
) -> None:
    url = _url(tmp_path)
    asyncio.run(_schema(url))
    asyncio.run(_submit(url, "r-parked", "r-fine"))
    path = url.removeprefix("sqlite:///")
    with contextlib.closing(sqlite3.connect(path)) as con, con:
        con.execute("UPDATE adk_work SET input = x'00010203' WHERE run_id = 'r-parked'")
    asyncio.run(_work(url, 1))
    assert {r["run_id"]: r["status"] for r in _runs(url)} == {
        "r-parked": "submitted",
        "r-fine": "completed",
    }
    (stuck,) = _runs(url, "--stuck")
    assert stuck["run_id"] == "r-parked" and stuck["parked"]
    with _client(url) as client:
        page = client.get(tenant_path(T, "runs", "r-parked"))
        assert page.status_code == 200
        assert 'id="parked"' in page.text and stuck["parked"].split(":")[0] in page.text
        assert "Cancel the run" in page.text
        listed = client.get(tenant_path(T, "runs"), params={"stuck": "1"}).text
        assert [">r-parked</a>" in r for r in _rows(listed)] == [True]
        csrf = _csrf(client, tenant_path(T, "runs", "r-parked"))
        done = client.post(
            tenant_path(T, "runs", "r-parked", "cancel"),
            data={"csrf": csrf, "by": "erin", "reason": "bad input"},
            headers=ORIGIN,
        )
        assert done.status_code == 200 and "cancelled before it started" in done.text
        assert client.get(tenant_path(T, "runs"), params={"stuck": "1"}).text.count("<td>") == 0
    (row,) = _runs(url, "--status", "cancelled")
    assert row["run_id"] == "r-parked" and row["parked"] is None
    assert row["reason"] == "cancelled before it started, by erin: bad input"
    assert _runs(url, "--stuck") == []


def test_filters_and_order_mix_unstarted_rows_with_many_finished_runs(tmp_path: Path) -> None:
    url = _url(tmp_path)
    asyncio.run(_schema(url))
    finished = [f"f{n:02d}" for n in range(25)]
    asyncio.run(_submit(url, *finished))
    asyncio.run(_work(url, len(finished)))  # 25 done entries with frontiers
    asyncio.run(_submit(url, "s-old"))
    asyncio.run(_submit(url, "c-1", "c-2", "other-agent", agent="booking"))
    asyncio.run(_submit(url, "x-theirs", agent="ticketing"))
    asyncio.run(_cancel(url, "c-1", reason="one"))
    asyncio.run(_cancel(url, "c-2", reason="two"))
    rows = _runs(url)
    assert len(rows) == 25 + 5 and len({r["run_id"] for r in rows}) == 30
    assert [r["run_id"] for r in rows[:2]] == ["c-2", "c-1"]  # newest first: when cancelled
    assert {r["status"] for r in rows[2:]} <= {"submitted", "completed"}
    cancelled = _runs(url, "--status", "cancelled")
    assert [r["run_id"] for r in cancelled] == ["c-2", "c-1"]
    assert _runs(url, "--status", "cancelled", "--stuck") == []
    assert _runs(url, "--stuck") == []
    assert [r["run_id"] for r in _runs(url, "--status", "cancelled", "--limit", "1")] == ["c-2"]
    assert [r["run_id"] for r in _runs(url, "--limit", "3")][:2] == ["c-2", "c-1"]
    assert _runs(url, "--status", "cancelled", "--since", "2999-01-01T00:00:00Z") == []
    assert len(_runs(url, "--status", "cancelled", "--since", "1h")) == 2
    assert len(_runs(url, "--status", "completed")) == 25
    assert [r["run_id"] for r in _runs(url, "--agent", "ticketing")] == ["x-theirs"]
    assert [r["run_id"] for r in _runs(url, "--agent", "ticketing", "--status", "cancelled")] == []
    with _client(url) as client:
        listing = client.get(tenant_path(T, "runs")).text
        assert len(_rows(listing)) == 30
        only = client.get(tenant_path(T, "runs"), params={"status": "cancelled"}).text
        assert sorted(re.findall(r">(c-\d)</a>", only)) == ["c-1", "c-2"] and len(_rows(only)) == 2
        agent = client.get(tenant_path(T, "runs"), params={"agent": "ticketing"}).text
        assert [">x-theirs</a>" in r for r in _rows(agent)] == [True]
        assert (
            len(_rows(client.get(tenant_path(T, "runs"), params={"status": "completed"}).text))
            == 25
        )


@pytest.mark.parametrize(
    "args",
    [
        ("--since", "yesterday"),
        ("--limit", "0"),
        ("--limit", "many"),
        ("--status", "submitted"),
        ("--status", "nope"),
    ],
)
def test_bad_runs_input_ends_in_one_sentence_with_exit_2(
    tmp_path: Path, args: tuple[str, str]
) -> None:
    url = _url(tmp_path)
    asyncio.run(_schema(url))
    asyncio.run(_submit(url, "r-q"))
    asyncio.run(_cancel(url, "r-q"))
    code, out, err = _cli(url, "runs", "--tenant", T, *args)
    assert code == 2, (out, err)
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert "r-q" not in out


# --- Redis and PostgreSQL ---------------------------------------------------------------------


@contextlib.contextmanager
def _server_url(kind: str) -> Iterator[str]:
    from adapters.services import (
        REDIS_URL,
        delete_prefixed,
        postgres_schema,
        redis_client,
        redis_prefix,
        schema_url,
        with_query,
    )

    if kind == "redis":
        prefix = redis_prefix()
        try:
            yield with_query(REDIS_URL, prefix=prefix, allow_volatile="true")
        finally:

            async def clean() -> None:
                client = await redis_client()
                try:
                    await delete_prefixed(client, prefix)
                finally:
                    await client.aclose()

            asyncio.run(clean())
        return
    loop = asyncio.new_event_loop()
    schema = postgres_schema()
    try:
        name = loop.run_until_complete(schema.__aenter__())
        yield schema_url(name)
    finally:
        loop.run_until_complete(schema.__aexit__(None, None, None))
        loop.close()


@pytest.mark.parametrize("kind", ["redis", "postgres"])
def test_unstarted_runs_on_redis_and_postgres_are_listed_isolated_and_masked(kind: str) -> None:
    with _server_url(kind) as url:
        asyncio.run(_schema(url))
        asyncio.run(_submit(url, "same", "a-b", tenant=T))
        asyncio.run(_submit(url, "same", tenant=OTHER))
        asyncio.run(_submit(url, "b", tenant="acme:a"))  # a tenant name with the separator
        asyncio.run(_cancel(url, "same", tenant=T, reason=SECRET_REASON))
        rows = {r["run_id"]: r for r in _runs(url)}
        assert set(rows) == {"same", "a-b"}
        assert rows["same"]["status"] == "cancelled" and rows["a-b"]["status"] == "submitted"
        assert KEY not in rows["same"]["reason"] and PASSWORD not in rows["same"]["reason"]
        assert rows["same"]["reason"].startswith("cancelled before it started, by erin")
        assert [(r["run_id"], r["status"]) for r in _runs(url, tenant=OTHER)] == [
            ("same", "submitted")
        ]
        assert [r["run_id"] for r in _runs(url, tenant="acme:a")] == ["b"]
        assert [r["run_id"] for r in _runs(url, "--status", "cancelled")] == ["same"]
        with _client(url) as client:
            ours = client.get(tenant_path(T, "runs", "same"))
            assert ours.status_code == 200 and "cancelled before it started" in ours.text
            assert KEY not in ours.text and PASSWORD not in ours.text
            theirs = client.get(tenant_path(OTHER, "runs", "same")).text
            assert "no worker has started it yet" in theirs and "erin" not in theirs
            assert client.get(tenant_path(OTHER, "runs", "a-b")).status_code == 404
