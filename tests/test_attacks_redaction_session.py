"""Attacks on README guarantee 7 (redaction) through the newest surfaces: tool results that
are bytes (UTF-8, and non-UTF-8 stored as base64 text), huge ints stored as hex text, dict
keys, tool and provider errors, approval requests, rows an operator reads (hand-written or
damaged work index entries), store URLs in every scheme's errors, and the names of keys
(plural and decorated forms). Every run is a real ``AgentRunner`` on a SQLite file; what
is looked at is every byte of the file (and its WAL), every row, the CLI's views (text and
``--json``) and the log records. A secret "stored" also counts when it is stored in an
encoding anyone reverses (base64): the needles are looked for in decoded base64 runs too.

A strict xfail is a defect (its reason says which); a plain test is a promise that held.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import dataclasses
import io
import json
import logging
import re
import sqlite3
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tesserix_adk import (
    Agent,
    ModelRequest,
    ModelResponse,
    RunStatus,
    ScriptedTurn,
    open_stores,
    tool,
)
from tesserix_adk.checkpoint.redaction import Redactor
from tesserix_adk.cli.main import main as cli_main
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
KEY = "sk-proj-QZKEYQZaaaaaaaaaaaaaaaaaaaa1"  # an OpenAI-shaped key; needle QZKEYQZ
PLAIN = "QZPLAINQZ-horse-battery-7f3e"  # a secret no pattern knows: only its key name masks it


# --- helpers ------------------------------------------------------------------------------

_B64_RUN = re.compile(r"[A-Za-z0-9+/_-]{16,}={0,2}")


def with_base64_decoded(blob: str) -> str:
    """``blob`` and, after it, every run of base64 (standard or URL-safe) in it decoded as
    Latin-1: a secret stored as base64 text is a secret stored."""
    out = [blob]
    for run in _B64_RUN.findall(blob):
        body = run.rstrip("=")
        padded = body + "=" * (-len(body) % 4)
        for decode in (base64.b64decode, base64.urlsafe_b64decode):
            with contextlib.suppress(binascii.Error, ValueError):
                out.append(decode(padded).decode("latin-1"))
    return "\n".join(out)


def stored(tmp_path: Path) -> str:
    return sqlite_everything(tmp_path / "adk.sqlite3").decode("utf-8", "replace")


def probe_run(
    tmp_path: Path,
    result: Any,
    caplog: pytest.LogCaptureFixture,
    *,
    arguments: dict[str, Any] | None = None,
) -> tuple[str, Recording]:
    """One run whose read-only tool ``probe`` returns ``result`` (or raises it, if it is an
    exception); everything stored or shown about it as one text, and the recording model."""
    caplog.set_level(logging.DEBUG)
    url = f"sqlite:///{tmp_path / 'adk.sqlite3'}"

    @tool(side_effects=False)
    def probe(arguments: dict[str, Any] | None = None) -> Any:
        """Read-only probe."""
        if isinstance(result, BaseException):
            raise result
        return result

    agent = Agent("probe", "Probe.", [probe])
    provider = Recording([[("probe", {"arguments": arguments or {}})], "done"])

    async def go() -> Any:
        stores = await _opened(url)
        try:
            return await _runner(provider, stores).run(agent, "go", tenant=T, run_id="r1")
        finally:
            await stores.aclose()

    assert asyncio.run(go()).status is RunStatus.completed
    views = cli_views(url, "r1")
    assert "exit 0" in views and "r1" in views, views[:2000]
    return "\n".join([stored(tmp_path), views, log_text(caplog)]), provider


# --- bytes, huge ints, dict keys ------------------------------------------------------------


def test_a_utf8_bytes_result_holding_a_key_is_masked(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    everything, provider = probe_run(tmp_path, f"here is {KEY} ok".encode(), caplog)
    assert "QZKEYQZ" not in with_base64_decoded(everything)
    # The model was told the tool's own text, live.
    assert any("QZKEYQZ" in t for t in provider.told()), provider.told()


def test_bytes_under_a_credential_key_are_masked_binary_or_not(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    result = {
        "password": b"\xff\xfeQZPWBINQZ-0123456789",
        "api_key": PLAIN.encode(),
        "nested": [{"clientSecret": b"\x80QZCSBINQZ"}],
    }
    everything, _ = probe_run(tmp_path, result, caplog)
    decoded = with_base64_decoded(everything)
    for needle in ("QZPWBINQZ", "QZPLAINQZ", "QZCSBINQZ"):
        assert needle not in decoded, needle


def test_a_latin1_bytes_result_holding_a_key_is_not_stored_recoverable(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # An HTTP body in Latin-1 (one "é"), as an old API returns it, with a key in it.
    body = f"Caf\xe9 API: use {KEY} / password={PLAIN}".encode("latin-1")
    everything, _ = probe_run(tmp_path, body, caplog)
    assert "QZKEYQZ" not in everything and "QZPLAINQZ" not in everything  # not as text
    decoded = with_base64_decoded(everything)
    assert "QZKEYQZ" not in decoded, "the key is stored as base64"
    assert "QZPLAINQZ" not in decoded, "the password is stored as base64"


@dataclasses.dataclass
class Download:
    """A result object: a binary thumbnail and the request's headers, as bytes."""

    thumbnail: bytes
    headers: bytes


def test_a_utf8_secret_beside_binary_bytes_in_one_object_is_masked(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    result = Download(
        thumbnail=b"\x89PNG\r\n\x1a\n\xff\x00",
        headers=f"Authorization: Bearer {KEY}\r\nX-Api-Key: {PLAIN}".encode(),
    )
    everything, _ = probe_run(tmp_path, result, caplog)
    decoded = with_base64_decoded(everything)
    assert "QZKEYQZ" not in decoded and "QZPLAINQZ" not in decoded


def test_the_same_object_without_binary_bytes_is_masked(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # The control of the test above: all its bytes UTF-8, the secrets are masked.
    result = Download(
        thumbnail=b"PNG",
        headers=f"Authorization: Bearer {KEY}\r\nX-Api-Key: {PLAIN}".encode(),
    )
    everything, _ = probe_run(tmp_path, result, caplog)
    decoded = with_base64_decoded(everything)
    assert "QZKEYQZ" not in decoded and "QZPLAINQZ" not in decoded


def test_a_huge_int_result_stored_as_hex_keeps_its_neighbours_masked(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    big = 7**6000  # past Python's 4,300 digits: written as hex text
    result = {
        "n": big,
        "apiKey": PLAIN,
        "note": f"use {KEY}",
        "rows": [big, {"refreshToken": "QZREFRESHQZ-0000"}],
        "password": big,  # a number under a credential key stays a number (README)
    }
    everything, _ = probe_run(tmp_path, result, caplog)
    for needle in ("QZKEYQZ", "QZPLAINQZ", "QZREFRESHQZ"):
        assert needle not in everything, needle
    assert hex(big)[:40] in everything  # the int itself was kept, as hex text


def test_a_huge_int_as_a_dict_key_beside_a_secret_value_is_masked(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    result = {7**6000: f"token={PLAIN}", "x": {"password": PLAIN}}
    everything, _ = probe_run(tmp_path, result, caplog)
    assert "QZPLAINQZ" not in everything


def test_secrets_as_dict_keys_are_masked(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    result = {
        KEY: "a key as a key",
        "outer": [{f"Bearer {PLAIN}aaaaaaa": 1}],
        "postgres://bob:QZURLPWQZ@db/app": "dsn as a key",
    }
    everything, _ = probe_run(tmp_path, result, caplog)
    for needle in ("QZKEYQZ", "QZPLAINQZ", "QZURLPWQZ"):
        assert needle not in everything, needle


# --- errors: a tool's, a provider's --------------------------------------------------------


def test_a_tool_exception_holding_secrets_is_masked_everywhere(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    boom = PermissionError(
        f"401 from upstream: headers={{'Authorization': 'Bearer {KEY}', "
        f"'x-api-key': '{PLAIN}'}} body=b'{{\"password\": \"QZPWBODYQZ\"}}'"
    )
    everything, provider = probe_run(tmp_path, boom, caplog)
    for needle in ("QZKEYQZ", "QZPLAINQZ", "QZPWBODYQZ"):
        assert needle not in everything, needle
    assert any("PermissionError" in t for t in provider.told()), provider.told()


class LeakyProvider:
    """A provider whose SDK says the API key in its error (OpenAI's 401 does)."""

    async def complete(self, request: ModelRequest) -> ModelResponse:
        raise RuntimeError(
            f"Error code: 401 - {{'error': {{'message': 'Incorrect API key provided: "
            f"{KEY}.', 'api_key': '{PLAIN}'}}}}"
        )


def test_a_provider_error_echoing_its_api_key_is_masked_in_store_cli_and_logs(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    url = f"sqlite:///{tmp_path / 'adk.sqlite3'}"

    @tool(side_effects=False)
    def noop() -> str:
        """Nothing."""
        return "ok"

    agent = Agent("probe", "Probe.", [noop])

    async def go() -> Any:
        stores = await _opened(url)
        try:
            return await _runner(LeakyProvider(), stores).run(agent, "go", tenant=T, run_id="r1")
        finally:
            await stores.aclose()

    try:
        outcome: Any = asyncio.run(go())
    except Exception as exc:  # the caller's own exception: its text is the SDK's
        outcome = exc
    said = cli("runs", "--tenant", T, "--store", url, "--json") + cli_views(url, "r1")
    everything = "\n".join([stored(tmp_path), said, log_text(caplog)])
    assert "QZKEYQZ" not in everything and "QZPLAINQZ" not in everything
    if not isinstance(outcome, BaseException):
        assert outcome.status is RunStatus.failed, outcome


# --- key names ------------------------------------------------------------------------------

DOCUMENTED_NAMES = (
    "password",
    "token",
    "accessToken",
    "clientSecret",
    "openai_api_key",
    "x-api-key",
    "X-Api-Key",
    "Authorization",
    "refreshToken",
    "AWS_SECRET_ACCESS_KEY",
    "PGPASSWORD",
    "MYSQL_PWD",
    "credentials",
    "db.password",
    "Set-Cookie",
)

PLURAL_NAMES = (
    "tokens",
    "api_keys",
    "apiKeys",
    "passwords",
    "client_secrets",
    "secrets",
    "accessTokens",
    "private_keys",
    "cookies",
)


def _masked_in_every_form(name: str) -> dict[str, bool]:
    r = Redactor()
    return {
        "data": PLAIN not in json.dumps(r.value({name: PLAIN})),
        "data_list": PLAIN not in json.dumps(r.value({name: [PLAIN]})),
        "json_text": PLAIN not in r.text(json.dumps({"a": {name: PLAIN}})),
        "free_text": PLAIN not in r.text(f"config {name}={PLAIN} done"),
    }


@pytest.mark.parametrize("name", DOCUMENTED_NAMES)
def test_a_documented_secret_name_masks_its_value_in_every_form(name: str) -> None:
    forms = _masked_in_every_form(name)
    assert all(forms.values()), forms


@pytest.mark.parametrize(
    "name",
    PLURAL_NAMES,
)
def test_a_plural_secret_name_masks_its_value(name: str) -> None:
    forms = _masked_in_every_form(name)
    assert all(forms.values()), forms


def test_a_trailing_separator_name_is_masked_in_free_text_as_in_data() -> None:
    r = Redactor()
    for name in ("DB_PASSWORD_", "secret_", "api_key_"):
        assert PLAIN not in json.dumps(r.value({name: PLAIN})), name
        assert PLAIN not in r.text(f"{name}={PLAIN}"), name


def test_a_whole_run_masks_every_documented_name_in_arguments_and_results(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    needles = {name: f"QZN{i:02d}QZ-value" for i, name in enumerate(DOCUMENTED_NAMES)}
    result = {"deep": [{"x": {name: value}} for name, value in needles.items()]}
    arguments = {name: value.replace("QZN", "QZA") for name, value in needles.items()}
    everything, _ = probe_run(tmp_path, result, caplog, arguments=arguments)
    leaked = [n for n in needles.values() if n[:6] in everything]
    leaked += [n for n in arguments.values() if n[:6] in everything]
    assert leaked == []


def test_a_plural_name_in_a_whole_run_is_not_stored_nor_shown(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    result = {"tokens": ["QZTOKENSQZ-aaaa"], "client_secrets": {"prod": "QZCSQZ-bbbb"}}
    everything, _ = probe_run(tmp_path, result, caplog, arguments={"api_keys": ["QZAKQZ-cccc"]})
    db = stored(tmp_path)
    views = cli_views(f"sqlite:///{tmp_path / 'adk.sqlite3'}", "r1")
    assert [n for n in ("QZTOKENSQZ", "QZCSQZ", "QZAKQZ") if n in db] == []
    assert [n for n in ("QZTOKENSQZ", "QZCSQZ", "QZAKQZ") if n in views] == []
    assert [n for n in ("QZTOKENSQZ", "QZCSQZ", "QZAKQZ") if n in everything] == []


# --- approvals ------------------------------------------------------------------------------


def _waiting_on_approval(
    tmp_path: Path, arguments: dict[str, Any]
) -> tuple[str, Any, list[Any], Agent, Recording]:
    url = f"sqlite:///{tmp_path / 'adk.sqlite3'}"
    sent: list[Any] = []

    @tool(requires_approval=True)
    def deploy(target: str, headers: dict[str, Any] | None = None) -> str:
        """Deploy (needs a person)."""
        sent.append({"target": target, "headers": headers})
        return "deployed"

    agent = Agent("deployer", "Deploy.", [deploy])
    provider = Recording([[("deploy", arguments)], "ok"])

    async def start() -> Any:
        stores = await _opened(url)
        try:
            return await _runner(provider, stores).run(agent, "go", tenant=T, run_id="r1")
        finally:
            await stores.aclose()

    run = asyncio.run(start())
    assert run.status is RunStatus.waiting_approval and run.pending_approval is not None
    return url, run, sent, agent, provider


def _approvals_rows(tmp_path: Path) -> str:
    with contextlib.closing(sqlite3.connect(tmp_path / "adk.sqlite3")) as db:
        return "\n".join(str(row) for row in db.execute("SELECT * FROM adk_approvals"))


def test_an_approval_request_masks_secret_arguments_in_the_store_and_every_view(
    tmp_path: Path,
) -> None:
    url, run, sent, agent, provider = _waiting_on_approval(
        tmp_path, {"target": "prod", "headers": {"x-api-key": PLAIN, "Authorization": KEY}}
    )
    rows = _approvals_rows(tmp_path)
    assert "deploy" in rows  # the request is there
    said = cli("approvals", "--tenant", T, "--store", url, "--json") + cli_views(url, "r1")
    assert "QZPLAINQZ" not in rows + said and "QZKEYQZ" not in rows + said
    # Approved, the call is not sent with its masked arguments (README: "a masked call is
    # never sent"), and the run goes on, the model told why.
    approved = cli("approve", run.pending_approval.id, "--tenant", T, "--by", "al", "--store", url)
    assert approved.startswith("exit 0"), approved

    async def resume() -> Any:
        stores = await _opened(url)
        try:
            return await _runner(provider, stores).resume(agent, "r1", tenant=T)
        finally:
            await stores.aclose()

    assert asyncio.run(resume()).status is RunStatus.completed
    assert sent == []
    assert any(t.startswith("not sent") for t in provider.told()), provider.told()
    everything = stored(tmp_path) + cli_views(url, "r1")
    assert "QZPLAINQZ" not in everything and "QZKEYQZ" not in everything


def test_an_approval_request_masks_a_plural_secret_name(tmp_path: Path) -> None:
    url, *_ = _waiting_on_approval(
        tmp_path, {"target": "prod", "headers": {"api_keys": ["QZAPPRQZ-dddd"]}}
    )
    rows = _approvals_rows(tmp_path)
    assert "deploy" in rows
    said = cli("approvals", "--tenant", T, "--store", url, "--json") + cli_views(url, "r1")
    assert "QZAPPRQZ" not in rows
    assert "QZAPPRQZ" not in said


# --- rows an operator reads ----------------------------------------------------------------


def _parked_world(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path / 'adk.sqlite3'}"

    async def go() -> None:
        async with open_stores(url) as stores:
            await stores.create_schema()
            await stores.work.submit(T, "r-park", agent="probe", input=b"{}")
            await stores.work.park(T, "r-park", agent="probe", reason="waiting")
            await stores.work.submit(T, "r-ok", agent="probe", input=b"{}")

    asyncio.run(go())
    return url


def _damage(tmp_path: Path, sql: str, *params: Any) -> None:
    with contextlib.closing(sqlite3.connect(tmp_path / "adk.sqlite3")) as db:
        db.execute(sql, params)
        db.commit()


def _operator_views(url: str) -> str:
    from starlette.testclient import TestClient

    from tesserix_adk.console import create_app

    out = [
        cli("runs", "--tenant", T, "--store", url),
        cli("runs", "--tenant", T, "--store", url, "--stuck"),
        cli("runs", "--tenant", T, "--store", url, "--stuck", "--json"),
        cli("runs", "--tenant", T, "--store", url, "--json"),
        cli("inspect", "r-park", "--tenant", T, "--store", url),
        cli("inspect", "r-park", "--tenant", T, "--store", url, "--json"),
        cli("show", "r-park", "--tenant", T, "--store", url, "--json"),
    ]
    app = create_app(url)
    with TestClient(app, base_url="http://127.0.0.1", raise_server_exceptions=False) as client:
        for page in ("/t/acme/runs", "/t/acme/runs/r-park", "/t/acme/runs?state=parked"):
            got = client.get(page)
            out.append(f"{page} {got.status_code}\n{got.text}")
    return "\n".join(out)


def test_a_parked_reason_written_by_another_writer_is_masked_when_shown(
    tmp_path: Path,
) -> None:
    url = _parked_world(tmp_path)

    async def park() -> None:
        async with open_stores(url) as stores:
            await stores.work.park(
                T, "r-park", agent="probe", reason=f"gave up: password={PLAIN} and {KEY}"
            )

    asyncio.run(park())
    shown = _operator_views(url)
    assert "r-park" in shown and "gave up" in shown, shown[:3000]
    assert "QZPLAINQZ" not in shown and "QZKEYQZ" not in shown


@pytest.mark.parametrize(
    ("column", "value"),
    [
        ("since", f"password={PLAIN}"),
        ("reason", f"\xffcookie={PLAIN} {KEY}".encode("latin-1")),
        ("agent", f'{{"Authorization": "Bearer {KEY}", "clientSecret": "{PLAIN}"}}'.encode()),
        ("attempts", f"refreshToken: {PLAIN} {KEY}"),
    ],
)
def test_a_damaged_work_entry_holding_a_secret_is_masked_in_every_operator_view(
    tmp_path: Path, column: str, value: Any
) -> None:
    url = _parked_world(tmp_path)
    _damage(tmp_path, f"UPDATE adk_work SET {column} = ? WHERE run_id = 'r-park'", value)
    shown = _operator_views(url)
    assert "r-park" in shown, shown[:3000]
    assert "QZPLAINQZ" not in shown and "QZKEYQZ" not in shown
    assert "Traceback" not in shown


# --- store URLs -----------------------------------------------------------------------------

PW = "QZURLPWQZ9x"


def _url_errors(url: str) -> str:
    async def op() -> str:
        try:
            async with open_stores(url) as stores:
                await stores.create_schema()
        except Exception as exc:
            return f"{type(exc).__name__}: {exc!s} {exc!r} {exc.__cause__!s}"
        return "opened"

    said = asyncio.run(op())
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli_main(["runs", "--tenant", T, "--store", url])
    return f"{said}\nexit {code}\n{out.getvalue()}\n{err.getvalue()}"


@pytest.mark.parametrize(
    "url",
    [
        f"postgres://bob:{PW}@127.0.0.1:1/test",
        f"postgresql://bob:{PW}@127.0.0.1:1/test",
        f"postgresql://qz_no_role:{PW}@127.0.0.1:5432/qz_no_db",  # a real server refuses
        f"postgres://127.0.0.1:1/test?password={PW}",
        f"postgres://bob:{PW}@127.0.0.1:notaport/test",
        f"postgres://bob:{PW}@[::1/test",
        f"redis://:{PW}@127.0.0.1:1/0",
        f"rediss://bob:{PW}@127.0.0.1:1/0",
        f"redis://bob:se@{PW}@127.0.0.1:1/0",
        f"redis://127.0.0.1:1/0?password={PW}",
        f"redis+cluster://bob:{PW}@127.0.0.1:1",
        f"redis://bob:{PW}@127.0.0.1:notaport/0",
        f"sqlite:////tmp/x.db?password={PW}",
        f"sqlite://bob:{PW}@/tmp/x.db",
        f"memory://bob:{PW}@x",
        f"mysql://bob:{PW}@127.0.0.1:1/db",
        f"postgresql+psycopg://bob:{PW}@127.0.0.1:1/test",
    ],
)
def test_a_store_urls_password_is_masked_in_its_errors(url: str) -> None:
    said = _url_errors(url)
    assert "exit 0" not in said, said
    assert PW not in said, said


def test_a_postgres_password_holding_an_at_sign_is_masked_in_its_error() -> None:
    said = _url_errors(f"postgres://bob:se@{PW}@127.0.0.1:1/test")
    assert "exit 0" not in said, said
    assert PW not in said, said


def test_a_store_url_without_its_scheme_is_masked_in_its_error() -> None:
    said = _url_errors(f"bob:{PW}@127.0.0.1:5432")
    assert "exit 0" not in said, said
    assert PW not in said, said


# --- the property ---------------------------------------------------------------------------

_ORDINARY = st.sampled_from(["data", "items", "config", "meta", "x", "env", "headers"])
_SENSITIVE = st.sampled_from(DOCUMENTED_NAMES)


def _planted(needle: str) -> st.SearchStrategy[Any]:
    """A value holding ``needle`` under a sensitive name at a random depth; below the
    name, the secret may itself be nested in lists and objects."""
    below: st.SearchStrategy[Any] = st.recursive(
        st.just(needle),
        lambda inner: st.one_of(
            st.lists(inner, min_size=1, max_size=2),
            st.dictionaries(_ORDINARY, inner, min_size=1, max_size=2),
        ),
        max_leaves=3,
    )
    under = st.builds(lambda name, value: {name: value}, _SENSITIVE, below)
    return st.recursive(
        under,
        lambda inner: st.one_of(
            st.lists(inner, min_size=1, max_size=2),
            st.builds(lambda k, v: {k: v, "n": 1}, _ORDINARY, inner),
        ),
        max_leaves=4,
    )


@settings(
    max_examples=8,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    result=_planted("QZPROPRQZ-9d8c7b"),
    arguments=_planted("QZPROPAQZ-1a2b3c"),
    form=st.sampled_from(["data", "json_text", "utf8_bytes", "model_text"]),
)
def test_property_a_secret_under_a_sensitive_name_is_never_stored_nor_shown(
    tmp_path_factory: pytest.TempPathFactory, result: Any, arguments: Any, form: str
) -> None:
    tmp_path = tmp_path_factory.mktemp("prop")
    url = f"sqlite:///{tmp_path / 'adk.sqlite3'}"
    shaped: Any = {
        "data": result,
        "json_text": json.dumps(result),
        "utf8_bytes": json.dumps(result).encode(),
        "model_text": result,
    }[form]

    @tool(side_effects=False)
    def probe(arguments: Any = None) -> Any:
        """Read-only probe."""
        return shaped

    text = f"I found {json.dumps(result)}" if form == "model_text" else ""
    agent = Agent("probe", "Probe.", [probe])
    provider = Recording(
        [ScriptedTurn(text=text, calls=[("probe", {"arguments": arguments})]), "done"]
    )

    async def go() -> Any:
        stores = await _opened(url)
        try:
            return await _runner(provider, stores).run(agent, "go", tenant=T, run_id="r1")
        finally:
            await stores.aclose()

    assert asyncio.run(go()).status is RunStatus.completed
    db = with_base64_decoded(stored(tmp_path))
    shown = "\n".join(
        cli(command, "r1", "--tenant", T, "--store", url, *extra)
        for command in ("show", "inspect")
        for extra in ((), ("--json",))
    )
    assert "exit 0" in shown
    for needle in ("QZPROPRQZ", "QZPROPAQZ"):
        assert needle not in db, (needle, form)
        assert needle not in shown, (needle, form)
