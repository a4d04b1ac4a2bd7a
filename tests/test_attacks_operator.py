"""Attacks on the operator features: the web console (``tesserix_adk.console`` served by a
real uvicorn on loopback) and the operator CLI (``tesserix show``/``runs``/``inspect`` with
``--json``, run as real subprocesses). A test marked ``xfail(strict=True)`` is a defect,
written as the behaviour it should have; a plain test is a promise that held."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from console.console_world import OTHER, SECRET, TENANT, World, seed, served
from processes import TENANT as SITE_TENANT
from processes import Site
from tesserix_adk import Checkpointer, open_stores
from tesserix_adk.console import create_app

# A PostgreSQL nobody listens on, with a password that must never reach a page or a line.
DOWN = "postgresql://postgres:hunter2pw@127.0.0.1:1/test"
TOKEN = "tok-" + "q" * 40
_TESSERIX = Path(sys.executable).with_name("tesserix")
_ISO = re.compile(r"\A\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ\Z")


@pytest.fixture(scope="module")
def store_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    url = f"sqlite:///{tmp_path_factory.mktemp('attacks') / 'adk.sqlite3'}"
    asyncio.run(seed(url, World()))
    return url


@pytest.fixture(scope="module")
def console(store_url: str) -> Iterator[str]:
    with served(create_app(store_url)) as base:
        yield base


def _csrf(client: httpx.Client, path: str) -> str:
    page = client.get(path)
    assert page.status_code == 200, page.text
    found = re.search(r'name="csrf" value="([0-9a-f]{64})"', page.text)
    assert found is not None
    return found.group(1)


async def _status(url: str, tenant: str, run_id: str) -> str:
    async with open_stores(url) as stores:
        cp = await Checkpointer.from_stores(stores).latest(tenant, run_id)
        assert cp is not None
        return str(cp.status)


async def _keys(url: str) -> list[str]:
    async with open_stores(url) as stores:
        found: list[str] = []
        for tenant, run_id in ((TENANT, "r-park"), (TENANT, "r-wait"), (OTHER, "r-other")):
            found += [r.key for r in await stores.idempotency.records(tenant, run_id)]
        return found


def _tesserix(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    command = [str(_TESSERIX)] if _TESSERIX.exists() else [sys.executable, "-m", "tesserix_adk"]
    return subprocess.run(
        [*command, "--store", url, *args], capture_output=True, text=True, timeout=60
    )


def _one_sentence(stderr: str) -> None:
    assert stderr.endswith("\n") and stderr.count("\n") == 1, repr(stderr)
    assert "Traceback" not in stderr


# --- the console -------------------------------------------------------------------------


def test_console_answers_loopback_names_only(console: str) -> None:
    port = console.rsplit(":", 1)[1]
    with httpx.Client(base_url=console) as client:
        for host in (
            "evil.example",
            f"evil.example:{port}",
            f"localhost.evil.example:{port}",
            "127.0.0.1.nip.io",
            "localhost.",
            "127.1",
            "2130706433",
            "",
        ):
            got = client.get(f"/t/{TENANT}/runs", headers={"host": host})
            assert got.status_code == 421, host
            assert "r-wait" not in got.text
        assert client.get(f"/t/{TENANT}/runs", headers={"host": f"[::1]:{port}"}).is_success
        assert client.get(f"/t/{TENANT}/runs", headers={"host": "LOCALHOST"}).is_success


def test_console_refuses_changes_from_other_origins_and_changes_nothing(
    console: str, store_url: str
) -> None:
    host = console.split("//", 1)[1]
    with httpx.Client(base_url=console) as client:
        csrf = _csrf(client, f"/t/{TENANT}/runs/r-wait")
        tries: list[dict[str, str]] = [
            {"origin": "null"},
            {"origin": "null", "referer": f"{console}/t/{TENANT}/runs/r-wait"},
            {},  # neither Origin nor Referer
            {"origin": "http://evil.example"},
            {"origin": f"http://{host}.evil.example"},
            {"referer": f"http://{host}.evil.example/t/{TENANT}/runs/r-wait"},
            {"referer": f"http://evil.example/?{host}"},
        ]
        for headers in tries:
            got = client.post(
                f"/t/{TENANT}/runs/r-wait/cancel", data={"csrf": csrf, "by": "eve"}, headers=headers
            )
            assert got.status_code == 403, headers
        # The right Origin with another browser's (or no) CSRF token is refused too.
        for sent in ("", "0" * 64):
            got = client.post(
                f"/t/{TENANT}/runs/r-wait/cancel",
                data={"csrf": sent, "by": "eve"},
                headers={"origin": console},
            )
            assert got.status_code == 403
    assert asyncio.run(_status(store_url, TENANT, "r-wait")) == "waiting_approval"


def test_console_redirects_and_filters_cannot_inject(console: str) -> None:
    with httpx.Client(base_url=console) as client:
        for name in ("//evil.example", "\r\nSet-Cookie: x=1", "https://evil.example/"):
            got = client.get("/tenant", params={"tenant": name})
            assert got.status_code == 303
            location = got.headers["location"]
            assert location.startswith("/t/") and not location.startswith("//"), location
            assert "\r" not in location and "\n" not in location
            assert "x=1" not in got.headers.get("set-cookie", "")
        page = client.get(
            f"/t/{TENANT}/runs", params={"status": "<script>x</script>", "agent": '"><b>a</b>'}
        )
        assert page.status_code == 200
        assert "<script>x" not in page.text and '"><b>' not in page.text
        assert page.headers["x-frame-options"] == "DENY"


def test_console_a_secret_in_a_reason_is_masked_and_a_name_cannot_forge_lines(
    console: str, store_url: str
) -> None:
    with httpx.Client(base_url=console) as client:
        csrf = _csrf(client, f"/t/{OTHER}/runs/r-other")
        got = client.post(
            f"/t/{OTHER}/runs/r-other/cancel",
            data={"csrf": csrf, "by": "bob\x1b[31m\nforged", "reason": f"key {SECRET}"},
            headers={"origin": console},
        )
        assert got.status_code == 200, got.text
        assert SECRET not in got.text and "\x1b" not in got.text
        assert SECRET not in client.get(f"/t/{OTHER}/runs/r-other").text
    # The same audit trail as `tesserix cancel`: who (as typed, escaped where shown) and why.
    shown = _tesserix(store_url, "show", "r-other", "--tenant", OTHER, "--json")
    assert shown.returncode == 0, shown.stderr
    assert SECRET not in shown.stdout
    told = json.loads(shown.stdout)
    assert told["status"] == "cancelled"
    assert told["cancel"]["by"] == "bob\x1b[31m\nforged"
    assert told["cancel"]["reason"].startswith("key ")
    text = _tesserix(store_url, "show", "r-other", "--tenant", OTHER)
    assert text.returncode == 0 and "\x1b" not in text.stdout and SECRET not in text.stdout


def test_console_static_files_are_behind_the_host_check_and_the_token(
    console: str, store_url: str
) -> None:
    with httpx.Client(base_url=console) as client:
        assert client.get("/static/console.css").status_code == 200
        got = client.get("/static/console.css", headers={"host": "evil.example"})
        assert got.status_code == 421
    app = create_app(store_url, token=TOKEN, loopback_only=False)
    with served(app) as base, httpx.Client(base_url=base) as client:
        got = client.get("/static/console.css", follow_redirects=False)
        assert got.status_code in (401, 303)


def test_console_refuses_a_huge_body_before_reading_it(console: str) -> None:
    host = console.split("//", 1)[1]
    with httpx.Client(base_url=console) as client:
        csrf = _csrf(client, f"/t/{TENANT}/runs/r-park")
    head = (
        f"POST /t/{TENANT}/runs/r-park/cancel HTTP/1.1\r\nHost: {host}\r\n"
        f"Origin: {console}\r\nCookie: tesserix_csrf={csrf}\r\n"
        "Content-Type: application/x-www-form-urlencoded\r\n"
        "Content-Length: 500000000\r\n\r\n"
    )
    port = int(host.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(head.encode() + b"a" * 100_000)
        try:
            answer = sock.recv(64)
        except TimeoutError:
            answer = b""
    assert answer.startswith(b"HTTP/1.1 413"), answer


def test_console_on_a_store_that_is_down_shows_no_traceback_or_password() -> None:
    with served(create_app(DOWN)) as base, httpx.Client(base_url=base, timeout=30) as client:
        got = client.get(f"/t/{TENANT}/runs")
        assert got.status_code >= 500
        for text in ("Traceback", "hunter2pw", "psycopg", 'File "'):
            assert text not in got.text


def test_console_on_a_store_that_never_answers_still_answers() -> None:
    # A PostgreSQL that accepts and then says nothing: the page must come back, not hang.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        url = f"postgresql://postgres:hunter2pw@127.0.0.1:{silent.getsockname()[1]}/test"
        with served(create_app(url)) as base, httpx.Client(base_url=base, timeout=60) as client:
            got = client.get(f"/t/{TENANT}/runs")
            assert got.status_code >= 500
            assert "Traceback" not in got.text and "hunter2pw" not in got.text


def test_console_on_a_store_that_is_down_says_so() -> None:
    with served(create_app(DOWN)) as base, httpx.Client(base_url=base, timeout=30) as client:
        got = client.get(f"/t/{TENANT}/runs")
        assert got.status_code == 503
        assert "could not be reached" in got.text
        assert "hunter2pw" not in got.text


def test_console_refuses_a_tenant_that_is_not_utf8(console: str) -> None:
    with httpx.Client(base_url=console) as client:
        for raw in ("%FF", "%FE%FD"):
            got = client.get(f"/t/{raw}/runs")
            assert got.status_code in (400, 404), raw


# --- the operator CLI --------------------------------------------------------------------


def _walk(value: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _walk(v, f"{path}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _walk(v, f"{path}[{i}]")
    else:
        yield path, value


def test_cli_json_shows_no_secret_no_raw_key_and_iso_utc_times(store_url: str) -> None:
    keys = asyncio.run(_keys(store_url))
    assert keys, "the seeded store has idempotency records"
    for args in (
        ("show", "r-park", "--tenant", TENANT, "--json"),
        ("show", "r-other", "--tenant", OTHER, "--json"),
        ("steps", "r-park", "--tenant", TENANT, "--json"),
        ("runs", "--tenant", TENANT, "--json"),
        ("show", "r-park", "--tenant", TENANT),
    ):
        done = _tesserix(store_url, *args)
        assert done.returncode == 0 and done.stderr == "", (args, done.stderr)
        assert SECRET not in done.stdout, args
        assert not [k for k in keys if k in done.stdout], args
        if "--json" not in args:
            continue
        for where, value in _walk(json.loads(done.stdout)):
            name = where.rsplit(".", 1)[-1]
            if name.endswith("_at") and value is not None:
                assert isinstance(value, str) and _ISO.match(value), (args, where, value)


def test_cli_bad_filters_and_odd_ids_are_json_errors_with_one_sentence(store_url: str) -> None:
    for args, code in (
        (("runs", "--tenant", TENANT, "--since", "yesterday"), 2),
        (("runs", "--tenant", TENANT, "--since", ""), 2),
        (("runs", "--tenant", TENANT, "--since", "-5m"), 2),
        (("runs", "--tenant", TENANT, "--limit", "-1"), 2),
        (("runs", "--tenant", TENANT, "--limit", "0"), 2),
        (("runs", "--tenant", TENANT, "--limit", "1e3"), 2),
        (("show", "r\x1b[31m\nx", "--tenant", TENANT), 1),
        (("show", "r-park", "--tenant", "t\x07"), 1),
    ):
        done = _tesserix(store_url, *args, "--json")
        assert done.returncode == code, (args, done.stdout, done.stderr)
        _one_sentence(done.stderr)
        assert "\x1b" not in done.stderr and "\x07" not in done.stderr
        error = json.loads(done.stdout)["error"]
        assert error["exit_code"] == code and isinstance(error["message"], str)


def test_cli_since_at_the_edges_of_time_is_no_crash(store_url: str) -> None:
    for since in ("9" * 400 + "d", "0001-01-01T00:00:00+14:00", "9999-12-31T23:59:59-14:00"):
        done = _tesserix(store_url, "runs", "--tenant", TENANT, "--since", since, "--json")
        assert done.returncode == 0, (since, done.stderr)
        assert isinstance(json.loads(done.stdout)["runs"], list)


def test_cli_a_store_that_is_down_is_exit_3_as_json_without_its_password() -> None:
    for args in (("runs", "--tenant", TENANT), ("show", "r", "--tenant", TENANT)):
        done = _tesserix(DOWN, *args, "--json")
        assert done.returncode == 3, done.stderr
        _one_sentence(done.stderr)
        assert "hunter2pw" not in done.stdout + done.stderr
        assert json.loads(done.stdout)["error"]["exit_code"] == 3


def test_cli_an_unknown_status_filter_is_a_usage_error(store_url: str) -> None:
    done = _tesserix(store_url, "runs", "--tenant", TENANT, "--status", "parkd", "--json")
    assert done.returncode == 2, done.stdout
    _one_sentence(done.stderr)


def test_a_worker_never_imports_the_revision_upgrade() -> None:
    # Only an operator's command accepts a revision: no worker path may reach accept_revision.
    source = Path(__file__).parents[1] / "src" / "tesserix_adk"
    users = sorted(
        str(p.relative_to(source))
        for p in source.rglob("*.py")
        if "accept_revision(" in p.read_text(encoding="utf-8")
    )
    assert users == ["cli/resuming.py", "run/upgrade.py"], users


# --- accepting a revision ----------------------------------------------------------------


def _book(flight: str) -> str:
    """Book."""
    return flight


def test_accept_revision_names_an_in_flight_call_whose_tool_lost_its_key() -> None:
    from tesserix_adk import Agent, Checkpoint, CheckpointStatus, tool
    from tesserix_adk.run.upgrade import revision_differences
    from tesserix_adk.stores.protocols import IdempotencyRecord, RecordStatus, ToolFlags

    frontier = Checkpoint(
        tenant="t",
        run_id="r",
        agent_name="a",
        agent_revision="old",
        step=3,
        status=CheckpointStatus.running,
        messages=(),
    )
    record = IdempotencyRecord(
        key="k1:x",
        status=RecordStatus.in_flight,
        holder="h",
        tenant="t",
        run_id="r",
        tool="book",
        call_id="c1",
        flags=ToolFlags(side_effects=True, idempotent=False),
    )
    keyed = Agent("a", "x", [tool(name="book")(_book)])
    assert revision_differences(frontier, keyed, [record]) == []
    unkeyed = Agent("a", "x", [tool(name="book", key=None)(_book)])
    found = revision_differences(frontier, unkeyed, [record])
    assert any("keyed" in text for text in found), found


UPGRADED = """
from tesserix_adk import Agent
from tesserix_adk.cli.demo_agent import PROVIDER, book_seat, search_flights

agent = Agent(
    "booking",
    "Find the flight the user asks for and book one seat on it, politely.",
    [search_flights, book_seat],
    max_iterations=6,
)
"""


def test_two_operators_accepting_at_once_carry_the_run_on_once(tmp_path: Path) -> None:
    site = Site(tmp_path)
    (tmp_path / "attack_upgraded_agent.py").write_text(UPGRADED)
    site.env = {**site.env, "PYTHONPATH": str(tmp_path)}
    site.kill_at("r", "model_call")
    site.wait_lease_lapsed("r")
    command = [sys.executable, "-m", "tesserix_adk", "run", "--resume", "r"]
    command += ["--tenant", SITE_TENANT, "--agent", "attack_upgraded_agent:agent"]
    racers = [
        subprocess.Popen(
            [*command, "--accept-revision", "--by", who, "--json"],
            env=site.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for who in ("alice", "bob")
    ]
    said = [p.communicate(timeout=60) for p in racers]
    codes = [p.returncode for p in racers]
    for (stdout, stderr), code in zip(said, codes, strict=True):
        assert "Traceback" not in stderr and stderr.count("\n") <= 1, stderr
        json.loads(stdout)  # valid JSON, an error object or the run
        assert code in (0, 3), (code, stdout, stderr)
    assert 0 in codes, said
    assert site.bookings("r") == 1
    shown = site.tesserix("show", "r", "--tenant", SITE_TENANT, "--json")
    told = json.loads(shown.stdout)
    assert told["status"] == "completed"
    assert len(told["accepted_revisions"]) == 1, told["accepted_revisions"]
