"""An attacker's bad input for the ``tesserix`` command line.

The promise under attack: on ANY bad input the CLI prints exactly one sentence on stderr
(never a traceback, never a Python internal such as ``TypeError: ...``), exits with the
documented code (README "Exit codes": 1 nothing checkpointed / no store, 2 a command line
it could not read, 3 not now, 4 must not be carried on), and loses nothing: a command that
fails on bad input leaves the store as it found it.

Fourteen defects were found (20 cases) and are fixed; their tests pass now: non-UTF-8
text (a cancel reason left a half-made cancel that stopped every later one; an outcome took
the lease first; a note was called "already decided"; an input), an outcome nested too deep
(stored replaced) or past the recursion limit, `ui` over an unknown scheme and `demo --keep`
under a file (tracebacks), a worker concurrency no store takes, a damaged row hiding every
run from `runs` or named by a Python error, a PostgreSQL port, timeout, sslmode or
connect_timeout and a Redis database number no server takes (exit 3 or 4, not 2), and a
closed stdout read as a run that must not be carried on (now 141, as SIGPIPE). The others
are attacks that held.
"""

from __future__ import annotations

import asyncio
import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest

from adapters import services
from booking import BOOK_TURNS, Airline, booking_agent
from tesserix_adk import AgentRunner, Checkpointer, ScriptedProvider, ToolCall
from tesserix_adk.cli import ExitCode
from tesserix_adk.cli.main import main
from tesserix_adk.stores.urls import open_stores

TESSERIX = [sys.executable, "-m", "tesserix_adk"]
DEMO_AGENT = "tesserix_adk.cli.demo_agent:agent"
NON_UTF8 = "x\udcff"  # what Python makes of the argv byte 0xff (surrogateescape)


# --- helpers ------------------------------------------------------------------------------


def _main(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    seen = capsys.readouterr()
    return code, seen.out, seen.err


def _one_sentence(err: str) -> bool:
    return err.startswith("tesserix") and err.count("\n") == 1 and "Traceback" not in err


_PY_INTERNALS = (
    "TypeError:",
    "ValueError:",
    "OverflowError:",
    "RecursionError:",
    "UnicodeEncodeError:",
    "BrokenPipeError:",
    "KeyError:",
    "AttributeError:",
)


def _plain(err: str) -> bool:
    """One sentence that says the trouble in the kit's words, not a Python exception."""
    return _one_sentence(err) and not any(name in err for name in _PY_INTERNALS)


def _cli(*argv: str, timeout: float = 30, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    env = {**os.environ}
    env.pop("ADK_DEBUG", None)
    return subprocess.run(
        [*TESSERIX, *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        **kwargs,
    )


def _dump(path: Path) -> list[str]:
    """Every row of every table, as SQL: what "the store is unchanged" compares."""
    conn = sqlite3.connect(path)
    try:
        return list(conn.iterdump())
    finally:
        conn.close()


def _rows(path: Path, sql: str, *params: Any) -> list[tuple[Any, ...]]:
    conn = sqlite3.connect(path)
    try:
        return conn.execute(sql, params).fetchall()
    finally:
        conn.close()


def _execute(path: Path, sql: str, *params: Any) -> None:
    conn = sqlite3.connect(path)
    try:
        conn.execute(sql, params)
        conn.commit()
    finally:
        conn.close()


def _finished(url: str, *run_ids: str, tenant: str = "t") -> None:
    async def go() -> None:
        async with open_stores(url) as stores:
            await stores.create_schema()
            for run_id in run_ids:
                runner = AgentRunner(
                    ScriptedProvider(BOOK_TURNS),
                    idempotency=stores.idempotency,
                    checkpoints=Checkpointer.from_stores(stores),
                    leases=stores.leases,
                    ledger=stores.ledger,
                )
                await runner.run(booking_agent(Airline()), "book", tenant=tenant, run_id=run_id)

    asyncio.run(go())


@pytest.fixture
def finished(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, str]:
    """A SQLite store holding one completed run ``r`` of tenant ``t``; ``ADK_STORE`` is
    garbage, so a command that ignored ``--store`` would fail."""
    path = tmp_path / "adk.sqlite3"
    url = f"sqlite:///{path}"
    _finished(url, "r")
    monkeypatch.setenv("ADK_STORE", "ftp://garbage")
    return path, url


def _lapsed_claim(url: str) -> None:
    """Run ``r`` of tenant ``acme`` died inside book_seat: call_1_0 is claimed in flight by
    a holder whose lease has lapsed (an indeterminate call, for ``resolve``)."""

    async def go() -> None:
        async with open_stores(url) as stores:
            await stores.create_schema()
            lease = await stores.leases.acquire("acme", "r", "w-dead", 0.2)
            await stores.idempotency.claim(
                "k-1",
                holder="w-dead",
                tenant="acme",
                run_id="r",
                iteration=1,
                tool="book_seat",
                call_id="call_1_0",
                flags=None,
                fence=lease.fence,
            )
            await asyncio.sleep(0.3)

    asyncio.run(go())


@pytest.fixture
def in_doubt(tmp_path: Path) -> tuple[Path, str]:
    path = tmp_path / "doubt.sqlite3"
    url = f"sqlite:///{path}"
    _lapsed_claim(url)
    return path, url


def _status_of_call(path: Path) -> str:
    [(status,)] = _rows(path, "SELECT status FROM adk_idempotency WHERE key = 'k-1'")
    return str(status)


# ==========================================================================================
# Defects
# ==========================================================================================


def test_resolve_an_outcome_nested_too_deep_is_refused_not_silently_replaced(
    in_doubt: tuple[Path, str], capsys: pytest.CaptureFixture[str]
) -> None:
    path, url = in_doubt
    deep = "[" * 70 + '{"booking": "BK-7"}' + "]" * 70
    code, out, err = _main(
        capsys, "--store", url, "resolve", "r", "--tenant", "acme", "--call", "call_1_0",
        "--outcome", deep, "--by", "alice",
    )  # fmt: skip
    stored = _rows(path, "SELECT outcome FROM adk_idempotency WHERE key = 'k-1'")[0][0]
    # Either it is refused as a bad command line and nothing is recorded, or what is
    # recorded is what the operator said (it says "completed with the given outcome").
    if code == ExitCode.USAGE:
        assert _plain(err) and _status_of_call(path) == "in_flight"
    else:
        assert b"BK-7" in bytes(stored), (code, out, err, stored)


def test_resolve_an_outcome_nested_past_the_recursion_limit_is_a_usage_error(
    in_doubt: tuple[Path, str], capsys: pytest.CaptureFixture[str]
) -> None:
    path, url = in_doubt
    deep = "[" * 50_000 + "]" * 50_000  # fits one argv string (128 KiB on Linux)
    code, _, err = _main(
        capsys, "--store", url, "resolve", "r", "--tenant", "acme", "--call", "call_1_0",
        "--outcome", deep, "--by", "alice",
    )  # fmt: skip
    assert _status_of_call(path) == "in_flight"
    assert code == ExitCode.USAGE, err
    assert _plain(err), err


def test_resolve_an_outcome_with_a_non_utf8_byte_is_a_usage_error_and_changes_nothing(
    in_doubt: tuple[Path, str], capsys: pytest.CaptureFixture[str]
) -> None:
    path, url = in_doubt
    before = _dump(path)
    code, _, err = _main(
        capsys, "--store", url, "resolve", "r", "--tenant", "acme", "--call", "call_1_0",
        "--outcome", json.dumps(NON_UTF8, ensure_ascii=False), "--by", "alice",
    )  # fmt: skip
    assert _status_of_call(path) == "in_flight"
    unchanged = _dump(path) == before  # today: the run's lease fence went from 1 to 2
    assert (code, _plain(err), unchanged) == (ExitCode.USAGE, True, True), err


def test_cancel_with_a_non_utf8_reason_leaves_no_half_made_cancel(
    finished: tuple[Path, str], capsys: pytest.CaptureFixture[str]
) -> None:
    path, url = finished
    code, _, err = _main(capsys, "--store", url, "submit", "--agent", DEMO_AGENT, "--tenant", "t",
                         "--input", "book", "--run-id", "s1")  # fmt: skip
    assert code == ExitCode.CARRIED_ON, err
    before = _dump(path)
    code, _, err = _main(
        capsys, "--store", url, "cancel", "s1", "--tenant", "t", "--by", "bob", "--reason", NON_UTF8
    )
    after = _dump(path)
    # Whatever that first attempt said, another operator can still cancel the run.
    code2, _, err2 = _main(capsys, "--store", url, "cancel", "s1", "--tenant", "t", "--by", "alice")
    assert code2 == ExitCode.CARRIED_ON, err2
    assert (code, _plain(err)) == (ExitCode.USAGE, True), err
    assert after == before


def test_submit_with_a_non_utf8_input_is_a_usage_error(
    finished: tuple[Path, str], capsys: pytest.CaptureFixture[str]
) -> None:
    path, url = finished
    before = _dump(path)
    code, _, err = _main(capsys, "--store", url, "submit", "--agent", DEMO_AGENT, "--tenant", "t",
                         "--input", NON_UTF8, "--run-id", "s1")  # fmt: skip
    assert _dump(path) == before
    assert (code, _plain(err)) == (ExitCode.USAGE, True), err


def test_approve_with_a_non_utf8_note_is_not_called_already_decided(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "ap.sqlite3"
    url = f"sqlite:///{path}"

    async def ask() -> str:
        async with open_stores(url) as stores:
            await stores.create_schema()
            call = ToolCall(id="call_1_0", name="book_seat", arguments={"flight": "LH400"})
            return (await stores.approvals.request("acme", "r", [call], iteration=1)).id

    request = asyncio.run(ask())
    before = _dump(path)
    code, _, err = _main(capsys, "--store", url, "approve", request, "--tenant", "acme",
                         "--by", "alice", "--note", NON_UTF8)  # fmt: skip
    assert _dump(path) == before
    assert "already decided" not in err, err
    assert (code, _plain(err)) == (ExitCode.USAGE, True), err


def test_demo_keep_under_a_file_is_one_sentence(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory\n")
    done = _cli("demo", "--keep", str(blocker / "sub"))
    assert "Traceback" not in done.stderr, done.stderr
    assert done.returncode == ExitCode.USAGE and _one_sentence(done.stderr), done.stderr


def test_ui_over_an_unknown_store_scheme_is_one_sentence_exit_2() -> None:
    done = _cli("--store", "ftp://nowhere", "ui", "--port", "0", timeout=30)
    assert "Traceback" not in done.stderr, done.stderr
    assert done.returncode == ExitCode.USAGE and _one_sentence(done.stderr), done.stderr


def test_worker_with_a_concurrency_no_store_can_take_is_a_usage_error(
    finished: tuple[Path, str],
) -> None:
    _, url = finished
    try:
        done = _cli("--store", url, "worker", "--agent", DEMO_AGENT, "--exit-when-idle",
                    "--concurrency", "1" + "0" * 20, timeout=6)  # fmt: skip
    except subprocess.TimeoutExpired:
        pytest.fail("the worker never exited (it retries a poll that can never succeed)")
    assert done.returncode == ExitCode.USAGE and _one_sentence(done.stderr), done.stderr


def _postgres_url(netloc: str | None = None, **query: str) -> str:
    url = (
        services.POSTGRES_URL if not query else services.with_query(services.POSTGRES_URL, **query)
    )
    if netloc is None:
        return url
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


@pytest.mark.postgres
def test_a_postgres_port_out_of_range_is_exit_2_like_redis(
    capsys: pytest.CaptureFixture[str],
) -> None:
    redis = _main(capsys, "--store", "redis://127.0.0.1:99999/0", "inspect", "r", "--tenant", "t")
    assert redis[0] == ExitCode.USAGE, redis  # held: Redis says it is a bad URL
    user = urlsplit(services.POSTGRES_URL).username or "postgres"
    url = _postgres_url(f"{user}@127.0.0.1:99999")
    code, _, err = _main(capsys, "--store", url, "inspect", "r", "--tenant", "t")
    assert (code, _plain(err)) == (ExitCode.USAGE, True), (code, err)


@pytest.mark.postgres
def test_a_postgres_timeout_too_large_is_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _main(
        capsys, "--store", _postgres_url(timeout="1e308"), "inspect", "r", "--tenant", "t"
    )
    assert (code, _plain(err)) == (ExitCode.USAGE, True), (code, err)


def _redis_reachable() -> None:
    async def ping() -> None:
        client = await services.redis_client()
        await client.aclose()

    asyncio.run(ping())


@pytest.mark.redis
def test_a_redis_database_number_too_large_is_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    _redis_reachable()
    parts = urlsplit(services.REDIS_URL)

    def url(db: str) -> str:
        return urlunsplit((parts.scheme, parts.netloc, db, "allow_volatile=true", ""))

    held = _main(capsys, "--store", url("/16"), "runs", "--tenant", "t")
    assert held[0] == ExitCode.USAGE, held  # held: a number the server lacks is exit 2
    code, _, err = _main(capsys, "--store", url("/99999999999999999999"), "runs", "--tenant", "t")
    assert code == ExitCode.USAGE, (code, err)


def test_runs_still_lists_healthy_runs_beside_a_damaged_row(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "two.sqlite3"
    url = f"sqlite:///{path}"
    _finished(url, "healthy", "damaged")
    _execute(path, "UPDATE adk_frontiers SET payload = 'hello' WHERE run_id = 'damaged'")
    code, out, err = _main(capsys, "--store", url, "runs", "--tenant", "t", "--no-header")
    assert code == ExitCode.CARRIED_ON, err
    assert "healthy" in out and "damaged" in out, out


@pytest.mark.parametrize(
    ("command", "damage"),
    [
        (("inspect", "r"), "UPDATE adk_frontiers SET payload = 'hello'"),
        (("show", "r"), "UPDATE adk_checkpoint_steps SET payload = '{}' WHERE step = 5"),
        (("inspect", "r"), "UPDATE adk_frontiers SET step = 'abc'"),
        (("inspect", "r"), "UPDATE adk_ledger SET micros = 'zz'"),
        (("show", "r"), "UPDATE adk_run_leases SET expires_at = 'soon'"),
        (("steps", "r"), "UPDATE adk_checkpoint_steps SET fence = 'x' WHERE step = 5"),
    ],
    ids=["frontier-text", "step-text", "step-number-text", "ledger-text", "lease-text", "fence"],
)
def test_a_row_of_the_wrong_type_is_named_as_damage_not_a_python_internal(
    finished: tuple[Path, str],
    capsys: pytest.CaptureFixture[str],
    command: tuple[str, ...],
    damage: str,
) -> None:
    path, url = finished
    _execute(path, damage)
    before = _dump(path)
    code, _, err = _main(capsys, "--store", url, *command, "--tenant", "t")
    assert _dump(path) == before
    assert code == ExitCode.MUST_NOT_CARRY_ON, err
    assert _plain(err), err


def test_a_closed_stdout_is_not_reported_as_a_run_that_must_not_be_carried_on(
    finished: tuple[Path, str],
) -> None:
    _, url = finished
    read_end, write_end = os.pipe()
    os.close(read_end)  # nobody will ever read: every write is EPIPE
    try:
        done = subprocess.run(
            [*TESSERIX, "--store", url, "runs", "--tenant", "t"],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=30,
        )
    finally:
        os.close(write_end)
    assert "Traceback" not in done.stderr, done.stderr  # held
    assert done.returncode != ExitCode.MUST_NOT_CARRY_ON, done.stderr
    assert "BrokenPipeError" not in done.stderr, done.stderr


# ==========================================================================================
# What held
# ==========================================================================================


@pytest.mark.parametrize(
    "url",
    [
        "ftp://x",
        "nope",
        "sqlite://",
        "sqlite:///",
        "sqlite://host/x.db",
        "memory://somewhere",
        "memory://?keep_last=x",
        "postgresql://postgres@[::1:5432/test",
    ],
)
def test_a_malformed_store_url_is_exit_2_with_json_too(
    url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = _main(capsys, "--store", url, "runs", "--tenant", "t", "--json")
    assert code == ExitCode.USAGE, err
    assert _plain(err), err
    assert json.loads(out)["error"]["exit_code"] == ExitCode.USAGE


def test_a_garbage_adk_store_is_exit_2(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ADK_STORE", "ftp://garbage")
    code, _, err = _main(capsys, "inspect", "r", "--tenant", "t")
    assert code == ExitCode.USAGE and _plain(err), err


@pytest.mark.parametrize(
    "query",
    ["synchronous=off", "keep_last=0", "keep_last=-3", "mode=ro", "keep_last=1&keep_last=2"],
)
def test_a_bad_sqlite_option_is_exit_2_and_the_store_is_unchanged(
    finished: tuple[Path, str], query: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path, url = finished
    before = _dump(path)
    code, _, err = _main(capsys, "--store", f"{url}?{query}", "cancel", "r", "--tenant", "t",
                         "--by", "alice")  # fmt: skip
    assert code == ExitCode.USAGE and _plain(err), err
    assert _dump(path) == before


def test_a_directory_or_missing_file_is_exit_1_and_creates_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for target in (tmp_path, tmp_path / "absent.sqlite3", tmp_path / "no" / "such.sqlite3"):
        code, _, err = _main(capsys, "--store", f"sqlite:///{target}", "inspect", "r",
                             "--tenant", "t")  # fmt: skip
        assert code == ExitCode.NOTHING_CHECKPOINTED, err
        assert _plain(err) and "schema apply" in err, err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "argv",
    [
        ("inspect", "r", "--tenant", "t"),
        ("runs", "--tenant", "t"),
        ("show", "r", "--tenant", "t"),
        ("steps", "r", "--tenant", "t"),
        ("cancel", "r", "--tenant", "t", "--by", "a"),
        ("approve", "q", "--tenant", "t", "--by", "a"),
        ("resolve", "r", "--tenant", "t", "--call", "c", "--never-ran", "--by", "a"),
        ("submit", "--agent", DEMO_AGENT, "--tenant", "t", "--input", "hi"),
    ],
    ids=lambda a: a[0],
)
def test_an_sqlite_file_of_another_app_is_exit_1_and_untouched(
    tmp_path: Path, argv: tuple[str, ...], capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "other.db"
    _execute(path, "CREATE TABLE notes (body TEXT)")
    _execute(path, "INSERT INTO notes VALUES ('keep me')")
    before = path.read_bytes()
    code, _, err = _main(capsys, "--store", f"sqlite:///{path}", *argv)
    assert code == ExitCode.NOTHING_CHECKPOINTED and _plain(err), err
    assert path.read_bytes() == before


@pytest.mark.parametrize(
    "argv",
    [
        ("inspect", "r", "--tenant", "t"),
        ("cancel", "r", "--tenant", "t", "--by", "a"),
        ("schema", "apply"),
        ("submit", "--agent", DEMO_AGENT, "--tenant", "t", "--input", "hi"),
    ],
    ids=lambda a: a[0],
)
def test_a_newer_schema_is_refused_and_untouched(
    finished: tuple[Path, str], argv: tuple[str, ...], capsys: pytest.CaptureFixture[str]
) -> None:
    path, url = finished
    _execute(path, "UPDATE adk_schema_version SET version = 99")
    before = _dump(path)
    code, _, err = _main(capsys, "--store", url, *argv)
    assert code == ExitCode.USAGE and _plain(err) and "upgrade" in err, err
    assert _dump(path) == before


def test_a_schema_whose_version_row_was_deleted_is_applied_again_keeping_every_row(
    finished: tuple[Path, str], capsys: pytest.CaptureFixture[str]
) -> None:
    path, url = finished
    _execute(path, "DELETE FROM adk_schema_version")
    code, _, err = _main(capsys, "--store", url, "inspect", "r", "--tenant", "t")
    assert code == ExitCode.NOTHING_CHECKPOINTED and "schema apply" in err, err
    rows = _rows(path, "SELECT count(*) FROM adk_checkpoint_steps")
    code, _, err = _main(capsys, "--store", url, "schema", "apply")
    assert code == ExitCode.CARRIED_ON, err
    assert _rows(path, "SELECT count(*) FROM adk_checkpoint_steps") == rows
    code, out, err = _main(capsys, "--store", url, "inspect", "r", "--tenant", "t")
    assert code == ExitCode.CARRIED_ON and "completed at step 5" in out, err


@pytest.mark.parametrize(
    "damage",
    [
        "flip-step",
        "delete-step",
        "flip-history",
        "delete-history",
        "frontier-not-utf8",
        "frontier-points-nowhere",
    ],
)
def test_a_store_damaged_by_hand_is_exit_4_and_left_as_it_is(
    finished: tuple[Path, str], damage: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path, url = finished
    if damage == "flip-step":
        [(payload,)] = _rows(path, "SELECT payload FROM adk_checkpoint_steps WHERE step = 5")
        flipped = bytearray(payload)
        flipped[len(flipped) // 2] ^= 1
        _execute(path, "UPDATE adk_checkpoint_steps SET payload = ? WHERE step = 5", bytes(flipped))
    elif damage == "delete-step":
        _execute(path, "DELETE FROM adk_checkpoint_steps WHERE step = 5")
    elif damage == "flip-history":
        [(item,)] = _rows(path, "SELECT item FROM adk_history WHERE position = 3")
        flipped = bytearray(item)
        flipped[len(flipped) // 2] ^= 1
        _execute(path, "UPDATE adk_history SET item = ? WHERE position = 3", bytes(flipped))
    elif damage == "delete-history":
        _execute(path, "DELETE FROM adk_history WHERE position = 3")
    elif damage == "frontier-not-utf8":
        _execute(path, "UPDATE adk_frontiers SET payload = x'00ff00ff'")
    else:
        _execute(path, "UPDATE adk_frontiers SET step = 999")
    before = _dump(path)
    for argv in (("inspect", "r"), ("show", "r")):
        code, _, err = _main(capsys, "--store", url, *argv, "--tenant", "t")
        assert code == ExitCode.MUST_NOT_CARRY_ON, (argv, err)
        assert _plain(err), err
    if "history" not in damage:  # an ended run's transcript is not read by a resume
        code, _, err = _main(capsys, "--store", url, "run", "--resume", "r", "--tenant", "t",
                             "--agent", DEMO_AGENT)  # fmt: skip
        assert code == ExitCode.MUST_NOT_CARRY_ON and _plain(err), err
    assert _dump(path) == before


@pytest.mark.parametrize(
    "argv",
    [
        ("inspect", "r\udcff"),
        ("inspect", "r" * 100_000),
        ("inspect", ""),
        ("inspect", "   "),
        ("show", "r", "--step", "x"),
        ("runs", "--limit", "0"),
        ("runs", "--limit", "nan"),
        ("runs", "--since", "\udcff"),
        ("runs", "--since", "yesterday"),
        ("runs", "--status", "bogus"),
        ("runs", "--header", "--no-header"),
        ("resolve", "r", "--call", "c", "--by", "a"),
        ("resolve", "r", "--call", "c", "--by", "a", "--never-ran", "--outcome", "{}"),
        ("resolve", "r", "--call", "c", "--by", "a", "--never-ran", "--margin", "nan"),
        ("resolve", "r", "--call", "c", "--by", "a", "--never-ran", "--margin", "-1"),
        ("resolve", "r", "--call", "c", "--by", "a", "--never-ran", "--margin", "1e999"),
        ("resolve", "r", "--call", "c\udcff", "--by", "a", "--never-ran"),
        ("approve", "q", "--by", "a", "--note", "n" * 4001),
        ("cancel", "r", "--by", "a", "--reason", "n" * 4001),
        ("cancel", "r"),
        ("run", "--agent", DEMO_AGENT),
        ("run", "--resume", "r", "--agent", DEMO_AGENT, "--by", "a"),
        ("run", "--resume", "r", "--agent", DEMO_AGENT, "--accept-revision"),
        ("run", "--resume", "r", "--agent", "no_such_module:agent"),
        ("run", "--resume", "r", "--agent", "os:path"),
        ("run", "--resume", "r", "--agent", "nocolon"),
        ("replay", "r", "--from-step", "one", "--agent", DEMO_AGENT),
        ("replay", "r", "--from-step", "1", "--agent", DEMO_AGENT, "--new-run-id", "r"),
        ("replay", "r", "--from-step", "1", "--agent", DEMO_AGENT, "--stub", "=os:getcwd"),
    ],
)
def test_a_bad_command_line_is_exit_2_and_changes_nothing(
    finished: tuple[Path, str], argv: tuple[str, ...], capsys: pytest.CaptureFixture[str]
) -> None:
    path, url = finished
    before = _dump(path)
    tenant = () if argv[0] == "runs" and argv[1:2] == ("--tenant",) else ("--tenant", "t")
    code, out, err = _main(capsys, "--store", url, *argv, *tenant, "--json")
    assert code == ExitCode.USAGE, (argv, err)
    assert _plain(err), err
    assert len(err) < 2000, err
    assert _dump(path) == before
    if out:
        assert json.loads(out)["error"]["exit_code"] == ExitCode.USAGE


@pytest.mark.parametrize(
    "argv",
    [
        ("worker", "--agent", DEMO_AGENT, "--lease-ttl", "0"),
        ("worker", "--agent", DEMO_AGENT, "--lease-ttl", "nan"),
        ("worker", "--agent", DEMO_AGENT, "--lease-ttl", "-1"),
        ("worker", "--agent", DEMO_AGENT, "--concurrency", "0"),
        ("worker", "--agent", DEMO_AGENT, "--concurrency", "1.5"),
        ("worker", "--agent", DEMO_AGENT, "--task-queue", "q"),
        ("submit", "--agent", DEMO_AGENT, "--tenant", "t"),
        ("submit", "--agent", DEMO_AGENT, "--tenant", "", "--input", "x"),
        ("--tenant", "t", "inspect", "r"),
        ("bogus",),
        (),
    ],
)
def test_work_and_top_level_usage_errors_are_exit_2(
    finished: tuple[Path, str], argv: tuple[str, ...], capsys: pytest.CaptureFixture[str]
) -> None:
    path, url = finished
    before = _dump(path)
    code, _, err = _main(capsys, *argv, "--store", url) if argv else _main(capsys)
    assert code == ExitCode.USAGE and _plain(err), (argv, err)
    assert _dump(path) == before


def test_ids_with_control_characters_print_escaped_on_one_line(
    finished: tuple[Path, str], capsys: pytest.CaptureFixture[str]
) -> None:
    _, url = finished
    code, _, err = _main(capsys, "--store", url, "inspect", "r\n\x1b[2Jforged", "--tenant", "t")
    assert code == ExitCode.NOTHING_CHECKPOINTED, err
    assert _plain(err) and "\x1b" not in err and "\\x1b" in err, err


def test_huge_step_numbers_are_answered_not_overflowed(
    finished: tuple[Path, str], capsys: pytest.CaptureFixture[str]
) -> None:
    _, url = finished
    for step in ("99999999999999999999", "-1"):
        code, _, err = _main(capsys, "--store", url, "show", "r", "--tenant", "t", "--step", step)
        assert code == ExitCode.NOTHING_CHECKPOINTED and _plain(err), err
    code, _, err = _main(capsys, "--store", url, "runs", "--tenant", "t", "--limit",
                         "99999999999999999999", "--since", "99999999999999999999d")  # fmt: skip
    assert code == ExitCode.CARRIED_ON, err


def test_unreachable_services_are_exit_3_in_one_sentence(
    capsys: pytest.CaptureFixture[str],
) -> None:
    for url in ("redis://127.0.0.1:1/0", "postgresql://postgres@127.0.0.1:1/test"):
        code, out, err = _main(capsys, "--store", url, "inspect", "r", "--tenant", "t", "--json")
        assert code == ExitCode.HELD and _plain(err), (url, err)
        assert json.loads(out)["error"]["exit_code"] == ExitCode.HELD


@pytest.mark.parametrize("outcome", ["{oops", "NaN", '{"a": Infinity}', ""])
def test_resolve_with_a_bad_outcome_takes_no_lease(
    in_doubt: tuple[Path, str], outcome: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path, url = in_doubt
    before = _dump(path)
    code, _, err = _main(capsys, "--store", url, "resolve", "r", "--tenant", "acme", "--call",
                         "call_1_0", "--outcome", outcome, "--by", "alice")  # fmt: skip
    assert code == ExitCode.USAGE and _plain(err), err
    assert _dump(path) == before


def test_a_nul_in_an_id_is_refused_as_usage_and_changes_nothing(
    finished: tuple[Path, str], capsys: pytest.CaptureFixture[str]
) -> None:
    """No id the kit keeps holds a NUL (``run.ids``: PostgreSQL's text cannot)."""
    path, url = finished
    before = _dump(path)
    code, _, err = _main(capsys, "--store", url, "inspect", "r\x00", "--tenant", "t")
    assert code == ExitCode.USAGE and _plain(err) and "NUL" in err, err
    assert _dump(path) == before


def test_the_demo_refuses_a_file_or_a_full_directory_in_one_sentence(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep").write_text("mine")
    for target in (blocker, full):
        done = _cli("demo", "--keep", str(target))
        assert done.returncode == ExitCode.USAGE and _one_sentence(done.stderr), done.stderr
    assert blocker.read_text() == "x" and [p.name for p in full.iterdir()] == ["keep"]


def test_ui_refuses_bad_ports_and_open_hosts_in_one_sentence(
    finished: tuple[Path, str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("uvicorn")
    _, url = finished
    monkeypatch.delenv("TESSERIX_UI_TOKEN", raising=False)
    for argv in (("--port", "99999"), ("--port", "-1"), ("--port", "http"), ("--host", "0.0.0.0")):
        code, _, err = _main(capsys, "--store", url, "ui", *argv)
        assert code == ExitCode.USAGE and _plain(err), (argv, err)


def test_stdin_closed_and_stderr_only_one_line(finished: tuple[Path, str]) -> None:
    _, url = finished
    done = _cli("--store", url, "inspect", "nope", "--tenant", "t", stdin=subprocess.DEVNULL)
    assert done.returncode == ExitCode.NOTHING_CHECKPOINTED and _plain(done.stderr), done.stderr
    done = _cli("--store", url, "inspect", "r", "--tenant", "t", stdin=subprocess.DEVNULL)
    assert done.returncode == ExitCode.CARRIED_ON and done.stderr == "", done.stderr
