"""Attacks on README guarantee 7 (redaction) with secrets in the shapes ordinary tools and
models produce: keys glued to a word, URL query strings, HTTP header lines and Python
reprs in a tool's error text, environment-style ``KEY=value`` lines, credential keys in
every casing, structured results (nested dicts, pydantic models), a typed state, a model's
streamed text, a tool name, and false positives (ordinary content that looks like a key).

Every test runs the real ``AgentRunner`` on a SQLite file with a scripted model and looks
for each planted needle in every byte of the database (and its WAL), in the CLI's output
(in process and through ``.venv/bin/tesserix`` as a subprocess) and in the log records.

A strict xfail is a defect (its reason says which); a plain test is a promise that held.

Defects:

1. (known, not new) ``test_a_key_glued_to_a_word_is_masked``: ``call_sk-proj-…`` and
   ``xsk-ant-…``: a token character right before the prefix stops the key patterns.
2. (MEDIUM) ``test_a_bytes_repr_under_a_credential_key_is_masked``: a tool error holding
   ``{'password': b'…'}`` (the repr of a dict with a bytes value, as an HTTP client's raw
   headers or a driver's kwargs print) masks only the ``b`` prefix and stores the secret.
3. (MEDIUM) ``test_a_list_or_object_under_a_credential_key_in_free_text_is_masked``:
   JSON inside free text (``HTTP 422: {...}``, JSON lines) masks a credential key's value
   only when it is a scalar: ``{"token": ["…"]}`` and ``{"credentials": {"pass": "…"}}``
   stay raw, while the same JSON as a whole tool result is masked.
4. (LOW-MEDIUM) ``test_header_pairs_as_tuples_are_masked``: ``[('Authorization', 'Token
   …')]`` / ``[('X-Api-Key', '…')]``, headers as (name, value) pairs (``headers.items()``,
   raw header lists), are not masked: the key and its value are not in ``key: value`` form.
5. (LOW) ``test_an_unquoted_passphrase_with_spaces_is_masked_whole``: ``password: correct
   horse battery staple`` masks the first word only.
6. (LOW) ``test_common_env_password_variables_are_masked``: ``MYSQL_PWD=…`` (MySQL's own
   variable, the twin of ``PGPASSWORD`` which README names) and ``DB_PASS=…`` stay raw.
7. (MEDIUM, false positive) ``test_an_ordinary_url_argument_is_not_taken_for_an_aws_key``:
   an ordinary URL whose host tail and path make a 40-character ``[A-Za-z0-9/+]`` run with
   both cases (``https://example.com/Users/JohnSmith/Documents/Reports/AB.txt``) is masked as
   ``aws_secret_key``; the stored transcript holds a mangled URL and, once an approval
   is given, the ordinary call is answered "not sent" and never goes out.

Fixed (markers removed): 1 (a glued key is masked in the shapes keys are issued in:
``sk-proj-``/``sk-svcacct-``/``sk-admin-`` and ``sk-ant-api03-`` with a mixed body), 2 (a
string prefix opens a quoted value), 3 (a list or object under a credential key is masked
whole), 6 for ``MYSQL_PWD`` (``_pwd`` as a name's last word; ``DB_PASS`` stays, since
``pass`` ends ordinary names: ``boarding_pass``), 7 (the standalone AWS secret wants a digit
and is never glued to a ``.`` or ``:`` before it), and later 4 (a quoted credential-named
key, a comma and a quoted value mask the value: a result written as its text held
``Headers([('x-api-key', '…')])`` and stored the key raw, which outweighs the ordinary
``'token', 'expires'`` it masks too). 5 stays: a passphrase with spaces cannot be told
from ordinary text without masking it too, and a keyed call whose arguments were masked is
never sent.
"""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pydantic
import pytest

from tesserix_adk import Agent, RunStatus, ScriptedProvider, ScriptedTurn, ToolContext, tool
from test_attacks_secrets import (
    Recording,
    _opened,
    _runner,
    cli,
    cli_views,
    log_text,
    sqlite_everything,
)

T = "acme"
TESSERIX = Path(sys.executable).with_name("tesserix")


def subprocess_views(url: str, run_id: str) -> str:
    """The CLI's views of a run, run as the real ``tesserix`` command."""
    out = []
    for argv in (
        ["runs", "--tenant", T, "--store", url, "--json"],
        ["show", run_id, "--tenant", T, "--store", url],
        ["show", run_id, "--tenant", T, "--store", url, "--json"],
        ["inspect", run_id, "--tenant", T, "--store", url, "--json"],
    ):
        done = subprocess.run(
            [str(TESSERIX), *argv], capture_output=True, text=True, timeout=60, check=False
        )
        out.append(f"exit {done.returncode}\n{done.stdout}\n{done.stderr}")
    return "\n".join(out)


def everything_about(tmp_path: Path, url: str, caplog: pytest.LogCaptureFixture) -> str:
    stored = sqlite_everything(tmp_path / "adk.sqlite3").decode("utf-8", "replace")
    shown = subprocess_views(url, "r1")
    assert shown.count("exit 0") == 4 and "r1" in shown, shown[:2000]
    return "\n".join([stored, cli_views(url, "r1"), shown, log_text(caplog)])


def leaked(needles: dict[str, str], blob: str) -> list[str]:
    return sorted(name for name, needle in needles.items() if needle in blob)


def run_tool(
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    body: Callable[[], Any],
    *,
    final: str = "done",
    text: str = "",
) -> tuple[str, Recording]:
    """One run: the model calls ``probe`` (whose body returns or raises), then answers
    ``final``. Everything an operator or a store sees about it, as one text."""
    caplog.set_level(logging.DEBUG)
    url = f"sqlite:///{tmp_path / 'adk.sqlite3'}"

    @tool(side_effects=False)
    def probe() -> Any:
        """Read-only probe."""
        return body()

    agent = Agent("probe", "Probe.", [probe])
    provider = Recording([ScriptedTurn(text=text, calls=[("probe", {})]), final])

    async def go() -> Any:
        stores = await _opened(url)
        try:
            return await _runner(provider, stores).run(agent, "go", tenant=T, run_id="r1")
        finally:
            await stores.aclose()

    assert asyncio.run(go()).status is RunStatus.completed
    return everything_about(tmp_path, url, caplog), provider


def raises(message: str) -> Callable[[], Any]:
    def body() -> Any:
        raise RuntimeError(message)

    return body


def returns(value: Any) -> Callable[[], Any]:
    return lambda: value


# --- 1. known gap: a key glued to a word -----------------------------------------------------


def test_a_key_glued_to_a_word_is_masked(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    needles = {"glued_openai": "QZGLUEAQZ", "glued_anthropic": "QZGLUEBQZ"}
    result = (
        # As long as issued keys are: a glued one needs 40 characters and a run of 16
        # letters and digits (a slug of words has none).
        f"ids: call_sk-proj-{needles['glued_openai']}aaaaaaaaaaaaaaaaaaaa1{'Xy7' * 8} "
        f"and xsk-ant-api03-{needles['glued_anthropic']}bbbbbbbbbbbbbbbbbbbb2"
    )
    seen, _ = run_tool(tmp_path, caplog, returns(result))
    assert "ids: " in seen  # the result was stored and shown
    assert leaked(needles, seen) == []


# --- what held: the shapes README names, through a whole run ---------------------------------


class Creds(pydantic.BaseModel):
    user: str
    password: str
    api_key: str


class Reply(pydantic.BaseModel):
    status: int
    creds: Creds
    headers: dict[str, str]
    history: list[dict[str, Any]]


def test_query_strings_headers_reprs_env_lines_and_key_casings_are_masked(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    n = {
        name: f"QZ{i:02d}{name.upper().replace('_', '')}QZ"
        for i, name in enumerate(
            [
                "q_api_key",
                "q_access_token",
                "q_apikey",
                "q_client_secret",
                "q_password",
                "h_bearer",
                "h_xapikey",
                "h_token_scheme",
                "h_cookie",
                "h_curl",
                "keyerror",
                "env_openai",
                "env_dburl",
                "env_aws",
                "env_pg",
                "env_export",
                "case_upper",
                "case_apikey_hdr",
                "case_camel",
                "case_secret_key",
                "case_private_key",
                "case_refresh",
                "repr_dict",
                "repr_kwargs",
                "connstr",
            ]
        )
    }
    key = f"sk-proj-{n['keyerror']}aaaaaaaaaaaaaaaaaaaa1"
    error = "\n".join(
        [
            f"GET https://api.example/v1/items?api_key={n['q_api_key']}&page=2 failed",
            f"redirect to https://app.example/cb?state=x&access_token={n['q_access_token']}",
            f"https://maps.example/geo?apiKey={n['q_apikey']}",
            f"POST /oauth?client_secret={n['q_client_secret']}&grant=x",
            f"jdbc:postgresql://h/db?user=u&password={n['q_password']}",
            f"Authorization: Bearer {n['h_bearer']}abcdef0123456789",
            f"X-Api-Key: {n['h_xapikey']}",
            f"Authorization: Token {n['h_token_scheme']}",
            f"Cookie: sessionid={n['h_cookie']}; csrftoken=abc",
            f"curl -H 'Authorization: Bearer {n['h_curl']}0123456789' https://x",
            repr(KeyError(key)),
            f"OPENAI_API_KEY={n['env_openai']}",
            f"DATABASE_URL=postgres://app:{n['env_dburl']}@db.internal:5432/app",
            f"AWS_SECRET_ACCESS_KEY={n['env_aws']}",
            f"PGPASSWORD={n['env_pg']}",
            f"export GITHUB_TOKEN='{n['env_export']}'",
            f"PASSWORD={n['case_upper']}",
            f"Api-Key: {n['case_apikey_hdr']}",
            f"apiKey={n['case_camel']}",
            f"secret_key={n['case_secret_key']}",
            f"private_key: {n['case_private_key']}",
            f"refresh_token={n['case_refresh']}",
            repr({"user": "bob", "password": n["repr_dict"]}),
            f"Creds(user='bob', api_key='{n['repr_kwargs']}')",
            f"Server=db;User Id=sa;Password={n['connstr']};",
        ]
    )
    seen, provider = run_tool(tmp_path, caplog, raises(error))
    assert "api.example/v1/items" in seen and "[redacted:" in seen
    assert leaked(n, seen) == []
    told = "\n".join(provider.told())
    assert "RuntimeError" in told  # the model was told the (masked) error, the run went on


def test_structured_results_pydantic_models_state_stream_and_tool_name_are_masked(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    url = f"sqlite:///{tmp_path / 'adk.sqlite3'}"
    n = {
        name: f"QZ{i:02d}{name.upper().replace('_', '')}QZ"
        for i, name in enumerate(
            [
                "model_pw",
                "model_key",
                "model_hdr",
                "nested_list",
                "json_text_u",
                "json_text_sp",
                "state_pw",
                "state_nested",
                "stream",
                "tool_name",
                "final_env",
            ]
        )
    }

    class State(pydantic.BaseModel):
        db_password: str = ""
        settings: dict[str, Any] = {}
        visits: int = 0
        token: int = 7

    reply = Reply(
        status=200,
        creds=Creds(user="bob", password=f"p-{n['model_pw']}", api_key=f"k-{n['model_key']}"),
        headers={"Authorization": f"Basic {n['model_hdr']}", "Accept": "json"},
        history=[{"refresh_token": [f"r-{n['nested_list']}", 1]}, {"ok": True}],
    )

    @tool(side_effects=False)
    def lookup(ctx: ToolContext) -> Reply:
        """Returns a pydantic model; writes secrets into the typed state."""
        ctx.state.db_password = f"s-{n['state_pw']}"
        ctx.state.settings = {"smtp": {"Password": f"m-{n['state_nested']}"}}
        ctx.state.visits += 1
        return reply

    @tool(side_effects=False)
    def raw_json() -> str:
        """JSON text with an escaped key name and odd spacing."""
        return (
            '{"pass\\u0077ord" :\n  "'
            + n["json_text_u"]
            + '" ,\t"accessToken"   :   "'
            + n["json_text_sp"]
            + '"}'
        )

    streamed = f"thinking about the key sk-proj-{n['stream']}aaaaaaaaaaaaaaaaaaaa1 now ok"
    secret_tool = f"sk-proj-{n['tool_name']}aaaaaaaaaaaaaaaaaaaa1"
    provider = ScriptedProvider(
        [
            ScriptedTurn(text=streamed, calls=[("lookup", {}), ("raw_json", {})]),
            [(secret_tool, {"x": 1})],
            f"done; set OPENAI_API_KEY={n['final_env']} and go",
        ]
    )
    agent = Agent("typed", "Look.", [lookup, raw_json], state_schema=State)
    deltas: list[str] = []

    async def go() -> Any:
        stores = await _opened(url)
        try:
            runner = _runner(provider, stores)
            result = None
            async for event in runner.stream(agent, "go", tenant=T, run_id="r1", state=State()):
                text = getattr(event, "text", None)
                if type(event).__name__ == "TextDelta" and text:
                    deltas.append(text)
                result = event
            return result
        finally:
            await stores.aclose()

    asyncio.run(go())
    assert len(deltas) > 1  # the text really came in pieces
    seen = everything_about(tmp_path, url, caplog)
    assert "[redacted:" in seen and "bob" in seen and '"visits":1' in seen.replace(" ", "")
    assert leaked(n, seen) == []


# --- 2. a bytes repr under a credential key ----------------------------------------------------


def test_a_bytes_repr_under_a_credential_key_is_masked(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    needles = {"bytes_dict": "QZBYTESAQZ", "bytes_kwarg": "QZBYTESBQZ"}
    creds = {"user": "bob", "password": needles["bytes_dict"].encode()}
    error = (
        f"login refused for {creds!r}; connect(user='bob', password=b'{needles['bytes_kwarg']}')"
    )
    seen, _ = run_tool(tmp_path, caplog, raises(error))
    assert "login refused" in seen
    assert leaked(needles, seen) == []


# --- 3. a list or object under a credential key, in free text ---------------------------------


def test_the_same_json_as_a_whole_result_is_masked(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    needles = {"list": "QZLISTAQZ", "object": "QZOBJAQZ"}
    body = json.dumps(
        {
            "note": "plainword",
            "token": [needles["list"]],
            "credentials": {"user": "bob", "pass": needles["object"]},
        }
    )
    seen, _ = run_tool(tmp_path, caplog, returns(body))
    assert "plainword" in seen
    assert leaked(needles, seen) == []


def test_a_list_or_object_under_a_credential_key_in_free_text_is_masked(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    needles = {"list": "QZLISTBQZ", "object": "QZOBJBQZ", "jsonl": "QZJSONLBQZ"}
    body = json.dumps(
        {"token": [needles["list"]], "credentials": {"user": "bob", "pass": needles["object"]}}
    )
    lines = json.dumps({"n": 1}) + "\n" + json.dumps({"api_key": [needles["jsonl"]]})
    seen, _ = run_tool(tmp_path, caplog, raises(f"HTTP 422: {body}\n{lines}"))
    assert "HTTP 422" in seen
    assert leaked(needles, seen) == []


# --- 4. header pairs ---------------------------------------------------------------------------


def test_header_pairs_as_tuples_are_masked(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    needles = {"auth_pair": "QZPAIRAQZ", "apikey_pair": "QZPAIRBQZ"}
    headers = [
        ("Accept", "application/json"),
        ("Authorization", f"Token {needles['auth_pair']}"),
        ("X-Api-Key", needles["apikey_pair"]),
    ]
    seen, _ = run_tool(tmp_path, caplog, raises(f"401 Unauthorized, sent headers={headers!r}"))
    assert "401 Unauthorized" in seen
    assert leaked(needles, seen) == []


# --- 5. a passphrase with spaces ---------------------------------------------------------------


@pytest.mark.xfail(
    strict=True,
    reason="free_text._value_span's _UNQUOTED stops at the first space, so 'password: "
    "correct horse battery staple' masks 'correct' and stores the rest of the passphrase "
    "(an authorization/cookie header masks to the line end; a password does not)",
)
def test_an_unquoted_passphrase_with_spaces_is_masked_whole(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    needles = {"passphrase_tail": "QZPHRASEQZ"}
    text = f"vault unlock failed\npassword: correct horse {needles['passphrase_tail']} staple"
    seen, _ = run_tool(tmp_path, caplog, raises(text))
    assert "vault unlock failed" in seen
    assert leaked(needles, seen) == []


# --- 6. env password variables -----------------------------------------------------------------


def test_common_env_password_variables_are_masked(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    needles = {"mysql_pwd": "QZMYSQLQZ", "db_pwd": "QZDBPWDQZ"}
    text = f"env dump:\nMYSQL_PWD={needles['mysql_pwd']}\nDB_PWD: {needles['db_pwd']}\n"
    seen, _ = run_tool(tmp_path, caplog, raises(text))
    assert "env dump" in seen
    assert leaked(needles, seen) == []


def test_a_name_ending_in_pass_is_not_taken_for_a_password(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Why ``DB_PASS`` is not masked: ``pass`` ends ordinary names too, and a keyed call
    whose arguments were masked is never sent after a crash or an approval."""
    seen, _ = run_tool(tmp_path, caplog, returns("boarding_pass=QZBOARDINGQZ hall_pass: QZHALLQZ"))
    assert "boarding_pass=QZBOARDINGQZ hall_pass: QZHALLQZ" in seen


def test_pwd_the_working_directory_is_not_masked(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The other side of 6: ``PWD=/home/app`` is a directory, not a password."""
    seen, _ = run_tool(tmp_path, caplog, returns("PWD=/home/app/QZDIRQZ"))
    assert "PWD=/home/app/QZDIRQZ" in seen


# --- 7. false positives ------------------------------------------------------------------------


ORDINARY_URL = "https://example.com/Users/JohnSmith/Documents/Reports/AB.txt"


def test_ordinary_content_that_looks_near_a_key_survives_a_run_and_resume(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Prose, ids and paths close to the patterns stay as they are, in the store and in
    what the resumed model is told; the run completes after a pause for approval."""
    caplog.set_level(logging.DEBUG)
    url = f"sqlite:///{tmp_path / 'adk.sqlite3'}"
    ordinary = [
        "task-ask-ant-colony-optimisation-2024",
        "risk-assessment-2024-quarterly-review-final-v3",
        "desk-proj-alpha-2024-quarterly-roadmap-v3",
        "/Users/JohnSmith/Documents/Reports/Annual",
        "next_page_token",
        "{'token_type': 'Bearer', 'expires_in': 3600}",
        "max_tokens=4096 input_tokens=12",
    ]
    sent: list[str] = []

    @tool(requires_approval=True)
    def file_it(ref: str) -> str:
        """Files a reference (needs a person)."""
        sent.append(ref)
        return f"filed {ref}"

    agent = Agent("filer", "File.", [file_it])
    provider = Recording([[("file_it", {"ref": " | ".join(ordinary)})], "ok"])

    async def go(resume: bool) -> Any:
        stores = await _opened(url)
        try:
            runner = _runner(provider, stores)
            if resume:
                return await runner.resume(agent, "r1", tenant=T)
            return await runner.run(agent, "file", tenant=T, run_id="r1")
        finally:
            await stores.aclose()

    run = asyncio.run(go(False))
    assert run.status is RunStatus.waiting_approval and run.pending_approval is not None
    said = cli("approve", run.pending_approval.id, "--tenant", T, "--by", "al", "--store", url)
    assert said.startswith("exit 0"), said
    assert asyncio.run(go(True)).status is RunStatus.completed
    assert sent == [" | ".join(ordinary)]
    stored = sqlite_everything(tmp_path / "adk.sqlite3").decode("utf-8", "replace")
    for item in ordinary:
        assert json.dumps(item)[1:-1] in stored or item in stored, item


def test_an_ordinary_url_argument_is_not_taken_for_an_aws_key(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    url = f"sqlite:///{tmp_path / 'adk.sqlite3'}"
    sent: list[str] = []

    @tool(requires_approval=True)
    def download(link: str) -> str:
        """Downloads a report (needs a person)."""
        sent.append(link)
        return "saved"

    agent = Agent("reports", "Fetch.", [download])
    provider = Recording([[("download", {"link": ORDINARY_URL})], "ok"])

    async def go(resume: bool) -> Any:
        stores = await _opened(url)
        try:
            runner = _runner(provider, stores)
            if resume:
                return await runner.resume(agent, "r1", tenant=T)
            return await runner.run(agent, "get it", tenant=T, run_id="r1")
        finally:
            await stores.aclose()

    run = asyncio.run(go(False))
    assert run.status is RunStatus.waiting_approval and run.pending_approval is not None
    said = cli("approve", run.pending_approval.id, "--tenant", T, "--by", "al", "--store", url)
    assert said.startswith("exit 0"), said
    assert asyncio.run(go(True)).status is RunStatus.completed
    told = provider.told()
    assert not any(t.startswith("not sent") for t in told), told
    assert sent == [ORDINARY_URL], told
    stored = sqlite_everything(tmp_path / "adk.sqlite3").decode("utf-8", "replace")
    assert "[redacted:aws_secret_key]" not in stored
