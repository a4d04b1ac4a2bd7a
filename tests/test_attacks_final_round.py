"""Attacks on the final round (3ac0681..HEAD): the two ``github_token`` rules of
``checkpoint/redaction/patterns.py`` (a word glued after a token; glued to a name before it,
a digit among its 36 characters); ``redactor._value_kind`` / ``_value_kind_after_key_id`` (a
mapping from an AWS key id to 40 base64 characters); ``console/actions.Done.cancel_state``
with ``cli/work._cancel`` (the console's cancel heading for each outcome); ``tools.Tool``
refusing a name that reads as holding a secret. SQLite in ``tmp_path`` end to end.

Found, and fixed (their tests pass now: a classic GitHub token may wrap anywhere, a
fine-grained one is 82 characters with a digit, one glued to a name wants a digit and an
upper-case letter; `tesserix cancel` reads whether the run had ended before it asked):
- HIGH: a GitHub token wrapped across lines (a real line break or a JSON-escaped ``\\n``)
  before its 36th character (classic) or its 22nd (fine-grained) is not masked at all, where
  an ``sk-proj-`` key wrapped the same way is; a run stores both halves raw in SQLite --
  ``test_a_wrapped_github_token_never_reaches_the_store``,
  ``test_a_wrapped_github_token_is_masked_like_an_openai_key``.
- MEDIUM: ``github_pat_`` and any 22 word characters is taken for a fine-grained token, so a
  tool named ``list_github_pat_grant_requests_for_organization`` or
  ``github_pat_expiration_reminder_service`` is refused, and a setting named so is masked --
  ``test_a_tool_named_after_github_pats_is_accepted``,
  ``test_a_setting_named_after_github_pats_stays``.
- LOW: a lower-case hex hash glued after a word ending in ``gh`` + ``s`` (``highs_``,
  ``laughs_``, ``troughs_`` + a sha1) is masked as a GitHub token (new with the glued rule;
  the README wants a glued key to hold upper-case letters as chance gives) --
  ``test_a_hash_after_a_word_ending_in_ghs_stays``.
- LOW: cancelling from the console a run that had already ended *cancelled* is headed
  "Cancel recorded" and ``cancel --json`` says ``state: cancelled``, though nothing was
  recorded ("one that already ended is left as it is") --
  ``test_a_second_cancel_of_a_cancelled_run_is_headed_nothing_to_cancel``.

Held: a classic token in URLs (``https://ghp_…@``, ``x-access-token:``, ``oauth2:``), env
lines, JSON, headers, ``Bearer%20``, ``_old``/``-old``/``.``/``é`` after it, glued after ``_``,
a digit, ``é`` or ``\\x00``, base64 of it (and of ``user:token``), a ``\\u`` escape inside a
whole JSON text, fine-grained tokens standalone and glued; ``lookup_ghp_`` + 36 letters, GHS
names without an early digit and many MCP/user tool names stay; a key id mapped to a 40
base64 secret is masked in dicts (nested, in lists), JSON text (indented, CRLF, escaped key,
inside JSON text, in Markdown, truncated, trailing comma), reprs (pprint), YAML, TOML, HCL,
INI and JS literals; a key id mapped to a word, an ARN or a name stays; the console heads a
cancel of a waiting run, of a submitted run, of a held run "Cancel recorded" (with what
became of it), of a completed or failed run "Nothing to cancel", of an unknown run "Cancel
refused".
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import pprint
import re
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from tesserix_adk import (
    Agent,
    AgentRunner,
    Checkpointer,
    RunStatus,
    ScriptedProvider,
    open_stores,
    tool,
)
from tesserix_adk.checkpoint.payload import CheckpointStatus, encode_checkpoint
from tesserix_adk.checkpoint.redaction import Redactor, default_redactor
from tesserix_adk.console import create_app
from tesserix_adk.console.pages import tenant_path
from tesserix_adk.errors import ConfigurationError
from tesserix_adk.tools import Tool

T = "acme"
GHP = "ghp_aB3dE5fG7hJ9kL1mN2pQ4rS6tU8vW0xY2zA4"
PAT = "github_pat_11ABCDEFG0aBcDeFgHiJkL_" + "Zq9" * 19 + "ab"
SKP = "sk-proj-aB3dE5fG7hJ9kL1mN2pQ4rS6tU8vW0xY2zA4bC5dE6fG7"
KID = "AKIAIOSFODNN7EXAMPLE"
SEC = "wJalrXUtnFEMIxKxMDENGxbPxRfiCYEXAMPLEKEY"  # no digit: only the pair rules mask it
BASE = "http://127.0.0.1:8765"


def _url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'adk.sqlite3'}"


def _db_bytes(tmp_path: Path) -> bytes:
    return b"".join(p.read_bytes() for p in tmp_path.iterdir() if p.name.startswith("adk"))


def _text(value: str) -> str:
    return default_redactor().text(value)


# --- GitHub tokens -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        f"https://{GHP}@github.com/o/r.git",
        f"https://x-access-token:{GHP}@github.com/o/r.git",
        f"git clone https://oauth2:{GHP}@gitlab.com/o/r",
        f"x-access-token:{GHP}",
        f"GITHUB_TOKEN={GHP}\n",
        f"export GH_TOKEN='{GHP}'",
        json.dumps({"gh": GHP}),
        json.dumps({"gh": GHP}, indent=2),
        f"Authorization: token {GHP}",
        f"Bearer%20{GHP}",
        f"{GHP}_old",
        f"{GHP}-old",
        f"{GHP}.",
        f"<{GHP}>",
        f"v1.{GHP}",
        f"é{GHP}é",
        f"1{GHP}",
        f"lookup_{GHP}",
        f"lookup_{GHP}_old",
        f"\\x00{GHP}",
        f"%22{GHP}%22",
        GHP.replace("ghp_", "ghs_"),
        GHP.replace("ghp_", "gho_"),
        '{"a": "' + GHP[:10] + "\\u0041" + GHP[11:] + '"}',
        PAT,
        f"x{PAT}",
        f"GITHUB_PAT={PAT}",
    ],
)
def test_a_github_token_in_an_ordinary_shape_is_masked(text: str) -> None:
    masked = _text(text)
    assert GHP[8:30] not in masked and "Zq9Zq9" not in masked, masked


@pytest.mark.parametrize("token", [GHP, f"user:{GHP}", f"{GHP}\n"])
def test_base64_of_a_github_token_is_masked(token: str) -> None:
    import base64

    encoded = base64.b64encode(token.encode()).decode()
    assert _text(f"blob: {encoded}") == "blob: [redacted:encoded]"


@pytest.mark.parametrize("cut", [10, 20, 30])
def test_an_openai_key_wrapped_across_lines_is_masked(cut: int) -> None:
    # The yardstick: what the kit does for a key wrapped with a short first line.
    for brk in ("\n", "\\n"):
        masked = _text(f"key: {SKP[:cut]}{brk}{SKP[cut:]}{brk}")
        assert SKP[:cut] not in masked and SKP[cut:] not in masked, masked


@pytest.mark.parametrize(
    "token,cut",
    [(GHP, 20), (GHP, 30), (GHP.replace("ghp_", "gho_"), 24), (PAT, 20), (PAT, 30)],
)
@pytest.mark.parametrize("brk", ["\n", "\\n"], ids=["newline", "json-escaped"])
def test_a_wrapped_github_token_is_masked_like_an_openai_key(
    token: str, cut: int, brk: str
) -> None:
    masked = _text(f"key: {token[:cut]}{brk}{token[cut:]}{brk}")
    assert token[:cut] not in masked and token[cut:] not in masked, masked


async def test_a_wrapped_github_token_never_reaches_the_store(tmp_path: Path) -> None:
    @tool(side_effects=False)
    def show_token_screen() -> str:
        """A terminal screen, 24 columns wide."""
        return f"Your new token:\n{GHP[:24]}\n{GHP[24:]}\n"

    agent = Agent("gh", "Show it.", [show_token_screen])
    async with open_stores(_url(tmp_path)) as stores:
        await stores.create_schema()
        run = await AgentRunner.from_stores(
            ScriptedProvider([[("show_token_screen", {})], "done"]), stores
        ).run(agent, "make a token", tenant=T, run_id="r1")
        assert run.status is RunStatus.completed
    raw = _db_bytes(tmp_path)
    assert GHP[:24].encode() not in raw and GHP[24:].encode() not in raw


# --- ordinary text and tool names --------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        "lookup_ghp_" + "a" * 36,
        "fetch_ghs_ClassificationAndLabellingOfChemicals2024",
        "the column thighs_20240101T000000ZAggregatedCounts",
        "sighs_0123456789abcdef0123456789abcdef",
        "commit 3f786850e387550fdab836ed7e6dc881de23001b",
        "get_highs_and_lows ghs_pictogram_lookup revoke_ghp_token",
    ],
)
def test_ordinary_text_with_gh_prefixes_stays(text: str) -> None:
    assert _text(text) == text


@pytest.mark.parametrize(
    "text",
    [
        "assets/laughs_da39a3ee5e6b4b0d3255bfef95601890afd80709.wav",
        "cache key: highs_9f86d081884c7d659a2feaa0c55ad015a3bf4f1b",
        "s3://bucket/troughs_7c222fb2927d828af22f592134e8932480637c0d/part-0.parquet",
    ],
)
def test_a_hash_after_a_word_ending_in_ghs_stays(text: str) -> None:
    assert _text(text) == text


@pytest.mark.parametrize(
    "name",
    [
        "get_me",
        "search_code",
        "get_secret_scanning_alert",
        "mcp__github__list_secret_scanning_alerts",
        "aws_secretsmanager_get_secret_value",
        "getSecretValue",
        "put_password",
        "generate_jwt",
        "rotate_access_key",
        "AWSAccessKeyRotation",
        "review_pat_grant_requests_in_bulk",
        "create_fine_grained_github_pat_for_repository",
        "github_pat_audit",
        "ghs_hazard_classification_lookup_by_cas_number",
        "get_ghs_label_elements_for_substance",
        "highs_and_lows_for_ticker",
        "weighs_package_and_returns_grams",
        "bearer_token_introspect",
        "basic_auth_login",
        "oauth2_token",
        "xoxb_bot_info",
        "get_AKIA_key_metadata",
        "search_issues_by_label_and_milestone_for_repository_with_pagination_v2",
        "filesystem.read_text_file",
    ],
)
def test_ordinary_tool_names_are_accepted(name: str) -> None:
    assert Tool(lambda: 1, name=name).name == name


@pytest.mark.parametrize("name", [f"lookup_{GHP}", f"{GHP}_v2", f"get_{PAT}"])
def test_a_tool_name_holding_a_github_token_is_refused(name: str) -> None:
    with pytest.raises(ConfigurationError):
        Tool(lambda: 1, name=name)


@pytest.mark.parametrize(
    "name",
    [
        "list_github_pat_grant_requests_for_organization",
        "check_github_pat_expiration_for_all_users",
        "github_pat_expiration_reminder_service",
    ],
)
def test_a_tool_named_after_github_pats_is_accepted(name: str) -> None:
    assert Tool(lambda: 1, name=name).name == name


def test_a_setting_named_after_github_pats_stays() -> None:
    data = {"github_pat_expiration_warning_days": 7, "cfg": "github_pat_expiration_warning_days=7"}
    assert default_redactor().value(data) == data


# --- AWS key id mappings ----------------------------------------------------------------


@pytest.mark.parametrize(
    "data",
    [
        {KID: SEC},
        {"creds": {KID: SEC}},
        [{KID: SEC}],
        json.dumps({KID: SEC}),
        json.dumps({"creds": {KID: SEC}}, indent=2),
        json.dumps({"body": json.dumps({KID: SEC})}),
        {"body": json.dumps({"keys": {KID: SEC}})},
        json.dumps({KID: SEC, "other": 1}),
        '{\r\n  "' + KID + '":\r\n    "' + SEC + '"\r\n}',
        '{"\\u0041KIAIOSFODNN7EXAMPLE": "' + SEC + '"}',
        '{"' + KID + '": "' + SEC + '"',
        '{"' + KID + '": "' + SEC + '",}',
        'Here:\n```json\n{"' + KID + '": "' + SEC + '"}\n```',
        repr({KID: SEC}),
        repr({"c": {KID: SEC}}),
        pprint.pformat({"a" * 30: 1, KID: SEC, "b" * 30: 2}, width=40),
        json.dumps({"out": repr({KID: SEC})}),
        f"{KID}: {SEC}\n",
        f"creds:\n  {KID}: {SEC}\n",
        f"'{KID}': '{SEC}'",
        f'[creds]\n{KID} = "{SEC}"\n',
        f'"{KID}" = "{SEC}"',
        f"{KID}={SEC}\n",
        "{" + KID + ": '" + SEC + "'}",
        {"ASIAIOSFODNN7EXAMPLE": SEC},
    ],
)
def test_a_key_id_mapped_to_its_secret_is_masked(data: Any) -> None:
    masked = json.dumps(default_redactor().value(data))
    assert SEC[2:30] not in masked, masked


@pytest.mark.parametrize(
    "value",
    ["see the runbook for rotating this key!!", "arn:aws:iam::123456789012:user/alice", "alice"],
)
def test_a_key_id_mapped_to_a_word_keeps_it(value: str) -> None:
    out = default_redactor().value({KID: value})
    assert list(out.values()) == [value]
    out_text = default_redactor().text(json.dumps({KID: value, "n": 1}))
    assert json.loads(out_text)["n"] == 1 and value in out_text


# --- the console's cancel heading ----------------------------------------------------------


def _approver() -> Agent:
    @tool(requires_approval=True)
    def book_seat(flight: str) -> dict[str, str]:
        """Book a seat."""
        return {"booking": "B1"}

    return Agent("approver", "Book.", [book_seat])


async def _waiting(url: str, run_id: str = "r1") -> None:
    async with open_stores(url) as stores:
        await stores.create_schema()
        run = await AgentRunner.from_stores(
            ScriptedProvider([[("book_seat", {"flight": "LH123"})], "Booked."]), stores
        ).run(_approver(), "book", tenant=T, run_id=run_id)
        assert run.status is RunStatus.waiting_approval


async def _rewrite(url: str, run_id: str, status: CheckpointStatus) -> None:
    async with open_stores(url) as stores:
        cp = await Checkpointer.from_stores(stores).latest(T, run_id)
        assert cp is not None
        step = cp.step + 1
        payload = encode_checkpoint(dataclasses.replace(cp, step=step, status=status), Redactor())
        await stores.checkpoints.put(T, run_id, payload, step=step, fence=cp.fence)


def _heading(response: Any) -> str:
    found = re.search(r"<h1[^>]*>(.*?)</h1>", response.text, re.S)
    return "" if found is None else re.sub(r"<[^>]+>", "", found.group(1)).strip()


def _console_cancel(url: str, run_id: str, by: str = "bob") -> Any:
    with TestClient(create_app(url), base_url=BASE, raise_server_exceptions=False) as client:
        assert client.get("/").status_code == 200
        csrf = client.cookies.get("tesserix_csrf")
        return client.post(
            tenant_path(T, "runs", run_id, "cancel"),
            data={"csrf": csrf, "by": by, "reason": "stale"},
            headers={"origin": BASE},
        )


def test_cancelling_a_waiting_run_is_headed_recorded(tmp_path: Path) -> None:
    url = _url(tmp_path)
    asyncio.run(_waiting(url))
    page = _console_cancel(url, "r1")
    assert page.status_code == 200
    assert _heading(page) == "Cancel recorded", _heading(page)
    assert "cancelled, by bob" in page.text


def test_cancelling_a_submitted_run_is_headed_recorded(tmp_path: Path) -> None:
    url = _url(tmp_path)

    async def submit() -> None:
        async with open_stores(url) as stores:
            await stores.create_schema()
            await AgentRunner.from_stores(ScriptedProvider(["x"]), stores).submit(
                _approver(), "book", tenant=T, run_id="r1"
            )

    asyncio.run(submit())
    page = _console_cancel(url, "r1")
    assert _heading(page) == "Cancel recorded", _heading(page)
    assert "before it started" in page.text


def test_cancelling_a_held_run_is_headed_recorded(tmp_path: Path) -> None:
    url = _url(tmp_path)
    asyncio.run(_waiting(url))

    async def hold() -> None:
        async with open_stores(url) as stores:
            await stores.leases.acquire(T, "r1", "someone-else", 60)

    asyncio.run(hold())
    page = _console_cancel(url, "r1")
    assert _heading(page) == "Cancel recorded", _heading(page)
    assert "next boundary" in page.text


@pytest.mark.parametrize("status", [CheckpointStatus.completed, CheckpointStatus.failed])
def test_cancelling_an_ended_run_is_headed_nothing_to_cancel(
    tmp_path: Path, status: CheckpointStatus
) -> None:
    url = _url(tmp_path)
    asyncio.run(_waiting(url))
    asyncio.run(_rewrite(url, "r1", status))
    page = _console_cancel(url, "r1")
    assert _heading(page) == "Nothing to cancel", _heading(page)


def test_cancelling_an_unknown_run_is_headed_refused(tmp_path: Path) -> None:
    url = _url(tmp_path)

    async def schema() -> None:
        async with open_stores(url) as stores:
            await stores.create_schema()

    asyncio.run(schema())
    page = _console_cancel(url, "nope")
    assert _heading(page) == "Cancel refused", _heading(page)


def test_a_second_cancel_of_a_cancelled_run_is_headed_nothing_to_cancel(tmp_path: Path) -> None:
    url = _url(tmp_path)
    asyncio.run(_waiting(url))
    first = _console_cancel(url, "r1", by="alice")
    assert _heading(first) == "Cancel recorded"
    second = _console_cancel(url, "r1", by="bob")
    assert _heading(second) == "Nothing to cancel", (_heading(second), second.text[-400:])
