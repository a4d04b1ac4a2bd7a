"""A second, fresh attack on the ``tesserix`` command line's handling of bad input.

Attacked, where ``test_attacks_cli_input.py`` did not go: outcomes given to ``resolve`` that
parse as JSON yet are not what gets stored (an overflowing number, one past 1 MiB, an
integer past Python's digit limit); a SQLite file whose ``adk_*`` table belongs to another
program, or lost a column (a table restored from an older copy); PostgreSQL URL options the
server, not the driver, refuses (a startup setting it does not know, TLS it does not speak);
``submit`` under the id of a run another agent already carried; ``approve``/``cancel``/
``resolve`` across tenants and of things that do not exist; option-like run ids; passwords
in every error path of a store URL; ``--json`` on each error path.

Found, and fixed unless marked left (``cli/resolving`` refuses an overflowing number, a
long integer in one sentence and an outcome over the record's cap; ``schema apply`` refuses
tables of the kit's names lacking its columns, ``sqlite/failures.foreign_tables``; "no such
column" is a damaged store, exit 4, and ``runs`` says so per run; ``submit`` refuses another
agent's run, ``submitting.refuse_another_start``; a setting, TLS mode, user or password the
PostgreSQL server refuses is exit 2, ``cli/failures._REFUSED_SETTING``):
- LOW ``test_resolve_outcome_that_overflows_to_infinity_is_refused_like_infinity``:
  ``--outcome 1e400`` is recorded as ``Infinity`` (not JSON; the model is told "Infinity")
  while ``--outcome Infinity`` is refused: cli/resolving.py ``run_resolve`` checks only
  ``parse_constant``, not an overflowing float.
- MEDIUM ``test_resolve_outcome_past_the_outcome_cap_is_refused_not_replaced``: a 2 MiB
  outcome is answered "resolved_as completed", exit 0, and stored replaced by "too large to
  keep" (the operator's booking id lost); only the nesting limit is checked up front
  (cli/resolving.py ``run_resolve``). Reachable through ``main``/``frontier_main`` only: a
  shell's argv caps one argument at 128 KiB.
- LOW ``test_resolve_outcome_with_too_many_digits_names_no_python_internal``: the sentence
  tells the operator to "use sys.set_int_max_str_digits()" (cli/resolving.py passes the
  ValueError's text through).
- MEDIUM ``test_schema_apply_refuses_a_foreign_table_under_the_kits_name``: ``schema apply``
  on a file where another program's ``adk_frontiers`` exists says "schema applied" (exit 0),
  stamps the current version, and from then on every command is exit 3 "retry later"
  (stores/sqlite/database.py ``_create_schema`` runs ``CREATE TABLE IF NOT EXISTS`` and
  never compares columns).
- MEDIUM ``test_a_table_missing_a_column_is_not_retry_later``: a table that lost a column
  (restored from an older copy) makes inspect/show/runs exit 3 ("retry later") forever,
  and ``schema apply`` does not fix it: stores/sqlite/failures.py ``translate`` maps
  "no such column" to ``StoreUnavailableError``.
- MEDIUM ``test_an_option_the_postgres_server_refuses_is_exit_2_not_unreachable``:
  ``?options=-cbogus=1`` is "PostgreSQL could not be reached", exit 3; the server answered
  and refused a setting no retry fixes (cli/failures.py ``_store_trouble`` knows only the
  driver's unknown-keyword text).
- LOW ``test_sslmode_require_on_a_server_without_tls_is_exit_2``: exit 3 "could not be
  reached" for a server that says it does not support SSL.
- MEDIUM ``test_submit_another_agent_under_a_carried_runs_id_is_refused``: ``submit`` of
  agent ``other`` under the id of a run agent ``booking`` carried prints the id, exit 0,
  and nothing will ever run it (run/runner.py ``submit`` returns early for a started run
  with no submission kept, without comparing the frontier's agent).

Held: approve/cancel/resolve across tenants and of requests, runs or calls that do not
exist are exit 1 with one sentence and change nothing; approve after a deny is exit 4 with
a JSON error object; a run id that looks like an option is reachable after ``--``; ids
over 512 bytes and NULs in names are exit 2; store URLs' passwords are masked in every
error we provoked; a Redis URL pointed at the PostgreSQL port is exit 3 in one sentence;
every error path tried under ``--json`` printed one JSON object with the same exit code.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from adapters import services
from booking import BOOK_TURNS, Airline, booking_agent
from operator_cli import cli
from tesserix_adk import AgentRunner, Checkpointer, ScriptedProvider, ToolCall
from tesserix_adk.cli import ExitCode
from tesserix_adk.stores.urls import open_stores

SECRET_PW = "hunter2secretpw"


# --- helpers ------------------------------------------------------------------------------


def _one_sentence(err: str) -> bool:
    return err.startswith("tesserix") and err.count("\n") == 1 and "Traceback" not in err


def _dump(path: Path) -> list[str]:
    conn = sqlite3.connect(path)
    try:
        return list(conn.iterdump())
    finally:
        conn.close()


def _execute(path: Path, *sql: str) -> None:
    conn = sqlite3.connect(path)
    try:
        for statement in sql:
            conn.execute(statement)
        conn.commit()
    finally:
        conn.close()


def _json_error(out: str, code: int) -> None:
    doc = json.loads(out, parse_constant=_no_constant)
    assert doc["error"]["exit_code"] == code, doc


def _no_constant(name: str) -> Any:
    raise ValueError(f"not JSON: {name}")


def _setup(url: str) -> str:
    """Run ``r`` of tenant ``t`` (agent ``booking``) completed; run ``d`` of tenant ``acme``
    has call_1_0 claimed in flight by a holder whose lease lapsed; an approval request of
    run ``ap`` (tenant ``acme``) is open. Returns the request's id."""

    async def go() -> str:
        async with open_stores(url) as stores:
            await stores.create_schema()
            runner = AgentRunner(
                ScriptedProvider(BOOK_TURNS),
                idempotency=stores.idempotency,
                checkpoints=Checkpointer.from_stores(stores),
                leases=stores.leases,
                ledger=stores.ledger,
            )
            await runner.run(booking_agent(Airline()), "book", tenant="t", run_id="r")
            lease = await stores.leases.acquire("acme", "d", "w-dead", 0.2)
            await stores.idempotency.claim(
                "k-1",
                holder="w-dead",
                tenant="acme",
                run_id="d",
                iteration=1,
                tool="book_seat",
                call_id="call_1_0",
                flags=None,
                fence=lease.fence,
            )
            call = ToolCall(id="call_1_0", name="book_seat", arguments={"flight": "LH400"})
            request = await stores.approvals.request("acme", "ap", [call], iteration=1)
            await asyncio.sleep(0.3)
            return request.id

    return asyncio.run(go())


@pytest.fixture
def site(tmp_path: Path) -> tuple[Path, str, str]:
    path = tmp_path / "adk.sqlite3"
    url = f"sqlite:///{path}"
    return path, url, _setup(url)


def _stored_outcome(path: Path) -> bytes:
    conn = sqlite3.connect(path)
    try:
        [(status, outcome)] = conn.execute(
            "SELECT status, outcome FROM adk_idempotency WHERE key = 'k-1'"
        ).fetchall()
    finally:
        conn.close()
    return bytes(outcome) if status == "completed" else b""


def _resolve(url: str, outcome: str) -> tuple[int, str, str]:
    return cli("--store", url, "resolve", "d", "--tenant", "acme", "--call", "call_1_0",
               "--outcome", outcome, "--by", "alice", "--json")  # fmt: skip


# ==========================================================================================
# Defects
# ==========================================================================================


def test_resolve_outcome_that_overflows_to_infinity_is_refused_like_infinity(
    site: tuple[Path, str, str],
) -> None:
    path, url, _ = site
    refused, _, _ = _resolve(url, "Infinity")
    assert refused == ExitCode.USAGE  # held
    code, out, err = _resolve(url, "1e400")
    stored = _stored_outcome(path)
    assert b"Infinity" not in stored, stored
    assert code == ExitCode.USAGE and _one_sentence(err), (code, err)
    _json_error(out, ExitCode.USAGE)


def test_resolve_outcome_past_the_outcome_cap_is_refused_not_replaced(
    site: tuple[Path, str, str],
) -> None:
    path, url, _ = site
    outcome = json.dumps({"booking": "BK-7", "receipt": "x" * (2 << 20)})
    code, _, err = _resolve(url, outcome)
    stored = _stored_outcome(path)
    if code == ExitCode.CARRIED_ON:
        # It says the call completed with the given outcome: then that is what is kept.
        assert b"BK-7" in stored, stored[:300]
    else:
        assert code == ExitCode.USAGE and _one_sentence(err), (code, err)
        assert stored == b""


def test_resolve_outcome_with_too_many_digits_names_no_python_internal(
    site: tuple[Path, str, str],
) -> None:
    path, url, _ = site
    before = _dump(path)
    code, out, err = _resolve(url, "1" + "0" * 5000)
    assert code == ExitCode.USAGE and _one_sentence(err), err  # held
    _json_error(out, ExitCode.USAGE)
    assert _dump(path) == before
    assert "sys.set_int_max_str_digits" not in err, err


def test_schema_apply_refuses_a_foreign_table_under_the_kits_name(tmp_path: Path) -> None:
    path = tmp_path / "other.db"
    url = f"sqlite:///{path}"
    _execute(
        path, "CREATE TABLE adk_frontiers (note TEXT)", "INSERT INTO adk_frontiers VALUES ('x')"
    )
    code, _, err = cli("--store", url, "schema", "apply")
    conn = sqlite3.connect(path)
    try:
        assert conn.execute("SELECT note FROM adk_frontiers").fetchall() == [("x",)]
    finally:
        conn.close()
    if code == ExitCode.CARRIED_ON:
        # It said the schema is applied: then the store must work.
        code, _, err = cli("--store", url, "runs", "--tenant", "t")
        assert code == ExitCode.CARRIED_ON, err
    else:
        assert code != ExitCode.HELD and _one_sentence(err), (code, err)
        assert "adk_frontiers" in err, err


def test_a_table_missing_a_column_is_not_retry_later(site: tuple[Path, str, str]) -> None:
    path, url, _ = site
    _execute(path, "ALTER TABLE adk_idempotency DROP COLUMN never_ran_by")
    before = _dump(path)
    for argv in (("inspect", "r"), ("show", "r")):
        code, out, err = cli("--store", url, *argv, "--tenant", "t", "--json")
        assert _one_sentence(err), err  # held
        _json_error(out, code)  # held
        assert _dump(path) == before
        # Retrying never helps: a person must repair or restore the store.
        assert code in (ExitCode.NOTHING_CHECKPOINTED, ExitCode.MUST_NOT_CARRY_ON), (argv, err)
        assert "restore the file from a backup" in err, err
    # `runs` says of each run what cannot be read, as of a damaged frontier (one run's
    # damage must not hide the others): here, that the store is to be restored.
    code, out, err = cli("--store", url, "runs", "--tenant", "t", "--json")
    assert code == ExitCode.CARRIED_ON, err
    (row,) = json.loads(out)["runs"]
    assert "restore the file from a backup" in json.dumps(row), row
    assert _dump(path) == before


def _postgres_reachable() -> None:
    code, _, err = cli("--store", services.POSTGRES_URL, "schema", "show")
    if code != ExitCode.CARRIED_ON:
        services.unavailable(f"PostgreSQL at {services.POSTGRES_URL}: {err}")
    code, _, err = cli("--store", services.POSTGRES_URL, "runs", "--tenant", "t")
    if code == ExitCode.HELD:
        services.unavailable(f"PostgreSQL at {services.POSTGRES_URL} cannot be reached: {err}")


@pytest.mark.postgres
def test_an_option_the_postgres_server_refuses_is_exit_2_not_unreachable() -> None:
    _postgres_reachable()
    url = services.with_query(services.POSTGRES_URL, options="-ctesserix_bogus_setting=1")
    code, out, err = cli("--store", url, "runs", "--tenant", "t", "--json")
    assert _one_sentence(err), err  # held
    _json_error(out, code)  # held
    assert "could not be reached" not in err, err
    assert code == ExitCode.USAGE, (code, err)


@pytest.mark.postgres
def test_sslmode_require_on_a_server_without_tls_is_exit_2() -> None:
    _postgres_reachable()
    url = services.with_query(services.POSTGRES_URL, sslmode="require")
    code, _, err = cli("--store", url, "runs", "--tenant", "t")
    if "does not support SSL" not in err:
        pytest.skip(f"this server speaks TLS: {err}")
    assert _one_sentence(err), err  # held
    assert code == ExitCode.USAGE, (code, err)


def test_submit_another_agent_under_a_carried_runs_id_is_refused(
    site: tuple[Path, str, str], tmp_path: Path
) -> None:
    path, url, _ = site
    module = tmp_path / "other_agent.py"
    module.write_text("from tesserix_adk import Agent\nagent = Agent('other', 'other', [])\n")
    before = _dump(path)
    code, out, err = cli("--store", url, "submit", "--agent", f"{module}:agent", "--tenant", "t",
                         "--input", "hi", "--run-id", "r", "--json")  # fmt: skip
    assert _dump(path) == before  # held: nothing recorded
    assert code == ExitCode.MUST_NOT_CARRY_ON and _one_sentence(err), (code, out, err)
    _json_error(out, ExitCode.MUST_NOT_CARRY_ON)


# ==========================================================================================
# What held
# ==========================================================================================


def test_decisions_across_tenants_or_on_nothing_are_exit_1_and_change_nothing(
    site: tuple[Path, str, str],
) -> None:
    path, url, request = site
    before = _dump(path)
    cases = [
        ("approve", request, "--tenant", "other", "--by", "a"),
        ("approve", request, "--tenant", "other", "--by", "a", "--deny"),
        ("approve", "req-nope", "--tenant", "acme", "--by", "a"),
        ("cancel", "d", "--tenant", "other", "--by", "a"),
        ("cancel", "r", "--tenant", "acme", "--by", "a"),
        ("cancel", "nope", "--tenant", "acme", "--by", "a"),
        ("resolve", "d", "--tenant", "other", "--call", "call_1_0", "--outcome", "{}", "--by", "a"),
        ("resolve", "d", "--tenant", "acme", "--call", "nope", "--never-ran", "--by", "a"),
        ("resolve", "nope", "--tenant", "acme", "--call", "call_1_0", "--never-ran", "--by", "a"),
        ("inspect", "r", "--tenant", "acme"),
        ("show", "d", "--tenant", "other"),
    ]
    for argv in cases:
        code, out, err = cli("--store", url, *argv, "--json")
        assert code == ExitCode.NOTHING_CHECKPOINTED and _one_sentence(err), (argv, err)
        _json_error(out, ExitCode.NOTHING_CHECKPOINTED)
        assert "Traceback" not in out
    assert _dump(path) == before


def test_approve_after_deny_is_exit_4_and_the_deny_stands(site: tuple[Path, str, str]) -> None:
    path, url, request = site
    code, out, err = cli("--store", url, "approve", request, "--tenant", "acme", "--by", "bob",
                         "--deny", "--json")  # fmt: skip
    assert code == ExitCode.CARRIED_ON and json.loads(out)["status"] == "denied", err
    before = _dump(path)
    code, out, err = cli("--store", url, "approve", request, "--tenant", "acme", "--by", "eve",
                         "--json")  # fmt: skip
    assert code == ExitCode.MUST_NOT_CARRY_ON and _one_sentence(err), err
    _json_error(out, ExitCode.MUST_NOT_CARRY_ON)
    assert "denied" in err and _dump(path) == before


def test_a_run_id_that_looks_like_an_option_is_reached_after_a_double_dash(
    tmp_path: Path,
) -> None:
    url = f"sqlite:///{tmp_path / 'adk.sqlite3'}"

    async def go() -> None:
        async with open_stores(url) as stores:
            await stores.create_schema()
            runner = AgentRunner(
                ScriptedProvider(BOOK_TURNS),
                idempotency=stores.idempotency,
                checkpoints=Checkpointer.from_stores(stores),
                ledger=stores.ledger,
            )
            await runner.run(booking_agent(Airline()), "book", tenant="t", run_id="--json")

    asyncio.run(go())
    code, out, err = cli("--store", url, "inspect", "--tenant", "t", "--", "--json")
    assert code == ExitCode.CARRIED_ON and "run --json" in out, err
    code, _, err = cli("--store", url, "inspect", "--tenant", "t", "--json")
    assert code == ExitCode.USAGE and _one_sentence(err), err


@pytest.mark.parametrize(
    "argv",
    [
        ("cancel", "r", "--tenant", "t", "--by", "a" * 600),
        ("cancel", "r", "--tenant", "t", "--by", "a\x00b"),
        ("approve", "q" * 600, "--tenant", "t", "--by", "a"),
        ("resolve", "r", "--tenant", "t", "--call", "c" * 3000, "--never-ran", "--by", "a"),
        ("inspect", "r", "--tenant", "\N{LATIN SMALL LETTER E WITH ACUTE}" * 300),
        ("runs", "--tenant", "t", "--since", "2026-13-45T00:00:00Z"),
        ("schema", "drop"),
    ],
    ids=["by-long", "by-nul", "request-long", "call-long", "tenant-utf8-long", "since", "drop"],
)
def test_more_bad_command_lines_are_exit_2_with_json(
    site: tuple[Path, str, str], argv: tuple[str, ...]
) -> None:
    path, url, _ = site
    before = _dump(path)
    code, out, err = cli("--store", url, *argv, "--json")
    assert code == ExitCode.USAGE and _one_sentence(err), (argv, err)
    _json_error(out, ExitCode.USAGE)
    assert _dump(path) == before


@pytest.mark.parametrize(
    "url",
    [
        f"redis://:{SECRET_PW}@127.0.0.1:6379/0?keep_last=abc",
        f"postgresql://postgres:{SECRET_PW}@127.0.0.1:5432/test?keep_last=abc",
        f"postgresql://postgres:{SECRET_PW}@127.0.0.1:99999/test",
        f"postgresql://postgres:{SECRET_PW}@127.0.0.1:1/test",
        f"redis://:{SECRET_PW}@127.0.0.1:1/0",
        f"redis://:{SECRET_PW}@127.0.0.1:6379/abc",
        f"postgresql://postgres:{SECRET_PW}@127.0.0.1:5432/test?sslmode=bogus",
    ],
)
def test_a_store_urls_password_never_reaches_an_error(url: str) -> None:
    code, out, err = cli("--store", url, "runs", "--tenant", "t", "--json")
    assert code in (ExitCode.USAGE, ExitCode.HELD) and _one_sentence(err), err
    _json_error(out, code)
    assert SECRET_PW not in err and SECRET_PW not in out, err


@pytest.mark.redis
def test_a_redis_url_pointed_at_another_protocol_is_exit_3_in_one_sentence() -> None:
    # PostgreSQL's port answers Redis's first command by closing the connection.
    code, out, err = cli("--store", "redis://127.0.0.1:5432/0", "runs", "--tenant", "t", "--json")
    assert code == ExitCode.HELD and _one_sentence(err), err
    _json_error(out, ExitCode.HELD)


def test_an_operator_cannot_resolve_a_call_as_a_reconciler(site: tuple[Path, str, str]) -> None:
    """``show`` and spans call a resolution ``reconciled`` when its ``by`` starts
    ``reconciler:``: an operator's answer given so would be told as the tool's own."""
    path, url, _ = site
    before = _dump(path)
    code, out, err = cli("--store", url, "resolve", "d", "--tenant", "acme", "--call", "call_1_0",
                         "--never-ran", "--by", "reconciler:book_seat", "--json")  # fmt: skip
    assert code == ExitCode.USAGE and _one_sentence(err), (code, err)
    _json_error(out, ExitCode.USAGE)
    assert "reconciler" in err, err
    assert _dump(path) == before
