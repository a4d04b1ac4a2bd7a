"""An attacker of the CLI's machine-readable contract (README "Operating it from the CLI",
"``--json``" and "Exit codes").

The promise: a command given ``--json`` prints ONE JSON document on stdout and nothing else;
an error is ``{"error": {"exit_code": N, "message": ...}}`` with N the process's exit code
and the same sentence on stderr; times are ISO 8601 UTC; ids and texts of any kind come out
as strict JSON in valid UTF-8; secrets never appear; large outputs are whole; a reader that
goes away ends the command as SIGPIPE would (141), saying nothing; ``--store`` defaults to
``$ADK_STORE``.

Defects found (xfail, strict): a usage error under ``--json`` into a closed stdout is a
traceback and exit 1; ``frontier_main``/``resume_main`` print no JSON error for a command
line they cannot read; a secret typed as a stray word is echoed in the usage error; a reader
that leaves part-way through a large JSON document gets exit 0, not 141; the spend is named
``spent_micros`` by ``inspect``/``run`` and ``spent.micros`` by ``show``; ``run --resume
--json`` has no ``tenant`` and no ``step``.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from processes import BACKENDS, held_open, store_url
from tesserix_adk import Agent, AgentRunner, ScriptedProvider, tool
from tesserix_adk.cli import frontier_main, resume_main
from tesserix_adk.providers.scripted import ScriptedTurn
from tesserix_adk.stores import open_stores

TESSERIX = [sys.executable, "-m", "tesserix_adk"]
DEMO_AGENT = "tesserix_adk.cli.demo_agent:agent"
T = "acme"
SECRET = "sk-live-" + "q7Zr2LmN8xVw4Kp9Tb3Hc6Yd"
# Control characters, a NUL, bidi and line-separator marks, an astral character, DEL and a C1
# control: in texts. Ids take all but the NUL (refused as usage) and lone surrogates.
HOSTILE_TEXT = "a\x00b\x01\x1b[31m\u202e\u2028\u2029\U0001f600\ud800z\x7f\x85"
HOSTILE_ID = "ev\x1b[2J\u202eil\n\U0001f600\x85"
ISO = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ")


@tool
def fetch(n: int) -> str:
    """Read a lot (no side effects)."""
    return (HOSTILE_TEXT + "y" * 1000) * n


@tool(requires_approval=True)
def pay(memo: str) -> str:
    """Pay (a side effect, approved first)."""
    return f"paid {memo}"


READER = Agent("reader", "Read.", [fetch])
PAYER = Agent("payer", "Pay.", [pay])


# --- helpers ------------------------------------------------------------------------------


def _env(store: str | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ADK_")}
    if store is not None:
        env["ADK_STORE"] = store
    return env


def _cli(*argv: str, store: str | None = None) -> tuple[int, bytes, str]:
    done = subprocess.run(
        [*TESSERIX, *argv], env=_env(store), capture_output=True, timeout=120, check=False
    )
    return done.returncode, done.stdout, done.stderr.decode("utf-8", "replace")


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [k for k, _ in pairs]
    assert len(keys) == len(set(keys)), f"duplicate keys {keys}"
    return dict(pairs)


def _bad_constant(name: str) -> Any:
    raise AssertionError(f"{name} is not JSON")


def _document(stdout: bytes) -> Any:
    """The one JSON document on stdout, read as strictly as a careful script would: valid
    UTF-8, no control characters raw, no NaN, no duplicate keys, nothing before or after."""
    text = stdout.decode("utf-8")  # strict: invalid UTF-8 raises
    return json.loads(
        text, strict=True, object_pairs_hook=_no_duplicates, parse_constant=_bad_constant
    )


def _error(code: int, stdout: bytes, stderr: str) -> dict[str, Any]:
    doc = _document(stdout)
    assert set(doc) == {"error"}, doc
    error = doc["error"]
    assert set(error) == {"exit_code", "message"}, error
    assert error["exit_code"] == code, (error, code)
    assert isinstance(error["message"], str) and error["message"]
    assert stderr.count("\n") == 1 and "Traceback" not in stderr, stderr
    assert stderr == f"tesserix: {error['message']}\n", (stderr, error)
    return error


def _strings(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for k, v in value.items() for s in (k, *_strings(v))]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    return []


def _times(value: Any, key: str = "") -> list[tuple[str, Any]]:
    """Every field named like a time (``*_at``, ``since``, ``at``), with its value."""
    found: list[tuple[str, Any]] = []
    if isinstance(value, dict):
        for k, v in value.items():
            if k.endswith("_at") or k in ("since", "at"):
                found.append((k, v))
            found += _times(v, k)
    elif isinstance(value, list):
        for v in value:
            found += _times(v, key)
    return found


async def _populate(url: str, *, runs: int = 0, big: bool = False) -> str:
    """A finished run under a hostile id, one waiting on an approval, optionally one whose
    tool returned near the cap, and ``runs`` submitted runs. Returns the approval id."""
    async with open_stores(url) as stores:
        await stores.create_schema()
        turns = [ScriptedTurn(calls=[("fetch", {"n": 1})]), "done " + HOSTILE_TEXT]
        runner = AgentRunner.from_stores(ScriptedProvider(turns), stores)
        await runner.run(READER, "go " + HOSTILE_TEXT, tenant=T, run_id=HOSTILE_ID)
        if big:
            turns = [ScriptedTurn(calls=[("fetch", {"n": 900})]), "read it all"]
            runner = AgentRunner.from_stores(ScriptedProvider(turns), stores)
            await runner.run(READER, "go", tenant=T, run_id="big")
        payer = AgentRunner.from_stores(
            ScriptedProvider([ScriptedTurn(calls=[("pay", {"memo": "m"})]), "paid"]), stores
        )
        waiting = await payer.run(PAYER, "pay", tenant=T, run_id="waits")
        assert waiting.pending_approval is not None
        for i in range(runs):
            await runner.submit(READER, "go", tenant=T, run_id=f"queued-{i:05d}")
        return waiting.pending_approval.id


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """A SQLite store shared by the read-only tests: (url, approval id)."""
    url = f"sqlite:///{tmp_path_factory.mktemp('json') / 'adk.sqlite3'}"
    request = asyncio.run(_populate(url, runs=2000, big=True))
    return url, request


# --- what held ----------------------------------------------------------------------------


def test_every_documented_exit_code_is_one_error_object_with_the_same_code(
    tmp_path: Path,
) -> None:
    url = f"sqlite:///{tmp_path / 'adk.sqlite3'}"
    request = asyncio.run(_populate(url))
    # 0: the answer itself, one document.
    code, out, err = _cli("inspect", "waits", "--tenant", T, "--json", store=url)
    assert code == 0 and err == "", err
    assert _document(out)["approval"]["status"] == "pending"
    # 1: nothing under that id; and no store file at all.
    code, out, err = _cli("inspect", "nope", "--tenant", T, "--json", store=url)
    assert code == 1
    _error(1, out, err)
    missing = f"sqlite:///{tmp_path / 'absent.sqlite3'}"
    code, out, err = _cli("runs", "--tenant", T, "--json", store=missing)
    assert code == 1 and "schema apply" in _error(1, out, err)["message"]
    # 2: an option no command has, `--json` before the command, an empty tenant.
    for argv in (
        ["inspect", "waits", "--tenant", T, "--json", "--bogus"],
        ["--json", "inspect", "waits", "--tenant", T],
        ["runs", "--tenant", "", "--json"],
        ["run", "--tenant", T, "--agent", DEMO_AGENT, "--json"],
    ):
        code, out, err = _cli(*argv, store=url)
        assert code == 2, argv
        _error(2, out, err)
    # 3: a server that cannot be reached, its password masked everywhere.
    for down in (
        "redis://:hunter2pass@127.0.0.1:1/0",
        "postgresql://postgres:hunter2pass@127.0.0.1:1/test",
    ):
        code, out, err = _cli("--store", down, "runs", "--tenant", T, "--json")
        assert code == 3, (down, err)
        _error(3, out, err)
        assert "hunter2pass" not in out.decode() + err
    # 4: a decision that conflicts with one already made. The note's secret is masked in
    # the decision printed as JSON.
    code, out, err = _cli(
        "approve",
        request,
        "--tenant",
        T,
        "--by",
        "alice",
        "--note",
        f"use {SECRET}",
        "--json",
        store=url,
    )
    assert code == 0, err
    decided = _document(out)
    assert decided["status"] == "approved" and decided["run_id"] == "waits"
    assert ISO.fullmatch(decided["decided_at"]) and SECRET not in out.decode()
    code, out, err = _cli(
        "approve", request, "--tenant", T, "--by", "bob", "--deny", "--json", store=url
    )
    assert code == 4
    _error(4, out, err)


def test_hostile_ids_and_texts_come_out_as_strict_json_in_ascii(site: tuple[str, str]) -> None:
    url, _ = site
    for argv in (
        ["inspect", HOSTILE_ID, "--tenant", T, "--json"],
        ["show", HOSTILE_ID, "--tenant", T, "--json"],
        ["steps", HOSTILE_ID, "--tenant", T, "--json"],
        ["run", "--resume", HOSTILE_ID, "--tenant", T, "--agent", DEMO_AGENT, "--json"],
    ):
        code, out, err = _cli(*argv, store=url)
        assert code == 0 and err == "", (argv, err)
        assert out.isascii(), argv  # nothing raw reaches a terminal or a byte-strict reader
        doc = _document(out)
        assert doc["run_id"] == HOSTILE_ID, argv
        # No lone surrogate survives: I-JSON readers refuse one.
        for s in _strings(doc):
            s.encode("utf-8")
        if "output" in doc:
            assert doc["output"].startswith("done a\x00b\x01\x1b[31m\u202e"), argv
            assert "\U0001f600" in doc["output"], argv
        for key, value in _times(doc):
            assert value is None or ISO.fullmatch(value), (argv, key, value)
    # An error naming a hostile id: still one object, the id escaped on one stderr line.
    code, out, err = _cli("inspect", HOSTILE_ID + "x", "--tenant", T, "--json", store=url)
    assert code == 1
    _error(1, out, err)


def test_thousands_of_runs_and_a_large_outcome_stay_whole(site: tuple[str, str]) -> None:
    url, _ = site
    code, out, err = _cli("runs", "--tenant", T, "--json", store=url)
    assert code == 0 and err == "", err
    rows = _document(out)["runs"]
    ids = [r["run_id"] for r in rows]
    assert len(ids) == 2003 and len(set(ids)) == 2003
    assert {f"queued-{i:05d}" for i in range(2000)} <= set(ids)
    assert all(ISO.fullmatch(r["updated_at"]) for r in rows)
    assert all(set(r) == set(rows[0]) for r in rows)  # every row the same fields
    code, out, err = _cli("show", "big", "--tenant", T, "--json", store=url)
    assert code == 0 and err == "", err
    (call,) = _document(out)["calls"]
    assert len(out) > 900_000
    expected = (HOSTILE_TEXT.replace("\ud800", "\ufffd") + "y" * 1000) * 900
    assert call["outcome"] == expected


def test_a_stdout_closed_before_the_first_byte_is_141_and_says_nothing(
    site: tuple[str, str],
) -> None:
    url, _ = site
    for argv in (
        ["runs", "--tenant", T, "--json"],
        ["show", "big", "--tenant", T, "--json"],
        ["inspect", "waits", "--tenant", T, "--json"],
        ["run", "--resume", "big", "--tenant", T, "--agent", DEMO_AGENT, "--json"],
    ):
        read, write = os.pipe()
        os.close(read)
        try:
            done = subprocess.run(
                [*TESSERIX, *argv],
                env=_env(url),
                stdout=write,
                stderr=subprocess.PIPE,
                timeout=120,
                check=False,
            )
        finally:
            os.close(write)
        assert done.returncode == 141, (argv, done.stderr)
        assert done.stderr == b"", (argv, done.stderr)


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b.id != "sqlite"])
def test_store_from_the_environment_on_a_server(backend: str, tmp_path: Path) -> None:
    with held_open(store_url(backend, tmp_path)) as url:
        asyncio.run(_populate(url))
        code, out, err = _cli("runs", "--tenant", T, "--json", store=url)
        assert code == 0 and err == "", err
        assert {r["run_id"] for r in _document(out)["runs"]} == {HOSTILE_ID, "waits"}
        code, out, err = _cli("inspect", HOSTILE_ID, "--tenant", T, "--json", store=url)
        assert code == 0 and out.isascii()
        assert _document(out)["output"].endswith("z\x7f\x85")
        code, out, err = _cli("show", "nope", "--tenant", T, "--json", store=url)
        assert code == 1
        _error(1, out, err)


# --- defects ------------------------------------------------------------------------------


def test_a_usage_error_under_json_into_a_closed_stdout_is_exit_2_and_quiet(
    site: tuple[str, str],
) -> None:
    url, _ = site
    read, write = os.pipe()
    os.close(read)
    try:
        done = subprocess.run(
            [*TESSERIX, "inspect", "waits", "--tenant", "", "--json"],
            env=_env(url),
            stdout=write,
            stderr=subprocess.PIPE,
            timeout=120,
            check=False,
        )
    finally:
        os.close(write)
    err = done.stderr.decode()
    assert "Traceback" not in err, err
    assert done.returncode in (2, 141), (done.returncode, err)


def test_the_embedded_commands_print_a_json_error_for_a_usage_error(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'adk.sqlite3'}"
    asyncio.run(_populate(url))
    for call, argv in (
        (frontier_main, ["inspect", "waits", "--tenant", T, "--json", "--bogus"]),
        (resume_main, ["run", "--resume", "waits", "--tenant", "", "--agent", "x", "--json"]),
    ):
        out, err = io.StringIO(), io.StringIO()
        kwargs: dict[str, Any] = {"stores": open_stores(url), "out": out, "err": err}
        if call is resume_main:
            kwargs["agents"] = {}
        code = call(argv, **kwargs)
        assert code == 2, argv
        _error(2, out.getvalue().encode(), err.getvalue())


def test_a_secret_in_a_stray_word_is_masked_in_the_usage_error(site: tuple[str, str]) -> None:
    url, request = site
    code, out, err = _cli(
        "approve",
        request,
        "--tenant",
        T,
        "--by",
        "alice",
        "--note",
        "the",
        "key",
        "is",
        SECRET,
        "--json",
        store=url,
    )
    assert code == 2
    _error(2, out, err)
    assert SECRET not in out.decode() + err


def test_a_reader_leaving_mid_document_is_141_as_for_text(site: tuple[str, str]) -> None:
    url, _ = site
    proc = subprocess.Popen(
        [*TESSERIX, "runs", "--tenant", T, "--json"],
        env=_env(url),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None and proc.stderr is not None
    assert proc.stdout.read(10) == b'{\n  "runs"'
    proc.stdout.close()  # `| head -c 10`: the document is far larger than a pipe holds
    err = proc.stderr.read().decode()
    proc.stderr.close()
    code = proc.wait(timeout=120)
    assert err == "", err
    assert code == 141, code


@pytest.mark.xfail(
    strict=True,
    reason="DEFECT LOW: the spend is spent_micros (a number) in inspect and run --resume "
    "but spent.micros (an object) in show",
)
def test_the_spend_has_one_name_and_type_across_commands(site: tuple[str, str]) -> None:
    url, _ = site
    docs = {}
    for argv in (
        ["inspect", "waits", "--tenant", T, "--json"],
        ["show", "waits", "--tenant", T, "--json"],
    ):
        code, out, err = _cli(*argv, store=url)
        assert code == 0, err
        docs[argv[0]] = _document(out)
    spend_keys = {name: {k for k in doc if k.startswith("spent")} for name, doc in docs.items()}
    assert spend_keys["inspect"] == spend_keys["show"], spend_keys
    for key in spend_keys["inspect"]:
        assert type(docs["inspect"][key]) is type(docs["show"][key]), key


def test_run_resume_json_names_the_tenant_and_step_like_inspect(site: tuple[str, str]) -> None:
    url, _ = site
    code, out, err = _cli("inspect", "big", "--tenant", T, "--json", store=url)
    assert code == 0, err
    inspected = _document(out)
    code, out, err = _cli(
        "run", "--resume", "big", "--tenant", T, "--agent", DEMO_AGENT, "--json", store=url
    )
    assert code == 0, err
    resumed = _document(out)
    assert resumed["carried_on"] is False
    for field in ("run_id", "tenant", "status", "step", "iteration"):
        assert field in resumed, field
        assert resumed[field] == inspected[field], field
