"""Attacks on the latest round (7d8b3fb..HEAD): ``tools.Tool`` refusing a name that reads as
holding a secret; the GitHub token rule glued to a name before it; the AWS key pair rule
across quotes, separators, line breaks and table bars, and ``redactor._pair_name_kind`` /
``_fits_pair`` for two-item lists; ``cli/frontier._carry_on_with`` and the console's cancel
heading. SQLite in ``tmp_path`` end to end.

Found, and fixed (their tests pass now: the GitHub rule allows a word after a token and, glued
to a name before it, wants a digit among its 36 characters; a mapping from a key id to 40
base64 characters masks the value; a run that ended is said to have ended before who
carries it is asked; the console reads what the cancel became, not what stands):
- HIGH: a GitHub token followed by ``_`` and a word (``ghp_…_search``,
  ``lookup_ghp_…_v2``) is not masked, so ``Tool`` accepts it as a name and a run stores the
  token raw in SQLite -- ``test_a_github_token_with_a_word_after_it_never_reaches_the_store``.
- LOW: an ordinary tool name holding ``_ghs_`` and 36 letters (GHS, the chemicals'
  "Globally Harmonized System") is refused as a secret although it has no digit --
  ``test_a_ghs_tool_name_without_a_digit_is_accepted``.
- LOW: approving a request of a Temporal-carried run that has ended says "its temporal
  workflow takes the decision" -- ``test_approving_after_a_temporal_run_ended_says_it_ended``.
- LOW: the console heads "Cancel recorded" a cancel of an ended run that recorded nothing,
  when an earlier request stands -- ``test_a_late_cancel_of_an_ended_run_is_not_headed_recorded``.
- LOW: a JSON object or dict keyed by an AWS key id keeps its 40-character secret raw (no
  digit in it), while every other way of writing the pair masks it --
  ``test_an_aws_pair_written_as_an_object_is_masked``.

Held: ordinary tool names (``get_token``, ``rotate_api_key``, ``reset_password``, ``auth``,
80-character names, 40 hex characters, MCP names with dots, slashes and ``__``,
``ghp_helper``, kebab-case names with ``sk-`` inside, long CamelCase names with digits) are
accepted; an empty name and names with a token glued after ``_``, ``.`` or ``/`` are refused;
the AWS pair is masked as a tuple's repr, quoted CSV, a Markdown table, JSON arrays (pretty,
escaped with ``\\u``), two lines and in two-item lists and tuples of data; git SHAs, sha1 hex
in CSV, base64 hashes and identifiers with ``ghp_`` stay; an id beside a sentence is no pair;
approving a waiting run gives the resume command, approving after it completed says it
ended; a cancel of a completed run with no request on record is headed "Nothing to cancel".
"""

from __future__ import annotations

import asyncio
import dataclasses
import io
import json
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
from tesserix_adk.checkpoint.payload import Carrier, CheckpointStatus, encode_checkpoint
from tesserix_adk.checkpoint.redaction import Redactor, default_redactor
from tesserix_adk.cli import frontier_main
from tesserix_adk.console import create_app
from tesserix_adk.console.pages import tenant_path
from tesserix_adk.errors import ConfigurationError
from tesserix_adk.run.cancelling import cancel_requested, request_cancel
from tesserix_adk.tools import Tool

T = "acme"
GHP = "ghp_" + "A1b2C3d4E5f6G7h8I9j0K1l2M3n4O5p6Q7r8"
KID = "AKIAIOSFODNN7EXAMPLE"
# A secret key with no digit (about one in a thousand real ones): only the pair rule masks it.
SEC = "wJalrXUtnFEMIxKxMDENGxbPxRfiCYEXAMPLEKEY"
BASE = "http://127.0.0.1:8765"


def _url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'adk.sqlite3'}"


def _db_bytes(tmp_path: Path) -> bytes:
    return b"".join(p.read_bytes() for p in tmp_path.iterdir() if p.name.startswith("adk"))


# --- tool names -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    [
        "get_token",
        "refresh_token",
        "rotate_api_key",
        "reset_password",
        "get_secret",
        "auth",
        "oauth_login",
        "a" * 80,
        "deadbeef" * 5,
        "github.search_repositories",
        "fs/read_file",
        "mcp__github__create_issue",
        "ghp_helper",
        "lookup_ghp_status",
        "task-Manager2024CreateNewProjectWithDefaultsV2",
        "fetchUserProfileV2WithPermissionsAndRoles2024",
        "BearerTokenValidatorForServiceAccounts2024",
        "x-api-key",
        "getAWSKeyForUserAKIAIOSFODNN7EXAMPLE",
    ],
)
def test_ordinary_tool_names_are_accepted(name: str) -> None:
    assert Tool(lambda: 1, name=name).name == name


@pytest.mark.parametrize("name", ["", f"lookup_{GHP}", f"server.{GHP}", f"srv/{GHP}"])
def test_an_empty_name_or_one_holding_a_token_is_refused(name: str) -> None:
    with pytest.raises(ConfigurationError):
        Tool(lambda: 1, name=name)


def test_a_ghs_tool_name_without_a_digit_is_accepted() -> None:
    name = "fetch_ghs_ClassificationAndLabellingOfChemicals"
    assert Tool(lambda: 1, name=name).name == name


async def test_a_github_token_with_a_word_after_it_never_reaches_the_store(
    tmp_path: Path,
) -> None:
    name = f"lookup_{GHP}_v2"
    try:
        made = Tool(lambda q: {"found": q}, name=name)
    except ConfigurationError:
        return  # refused as it is made: nothing stored
    agent = Agent("mcp", "Look it up.", [made])
    async with open_stores(_url(tmp_path)) as stores:
        await stores.create_schema()
        run = await AgentRunner.from_stores(
            ScriptedProvider([[(name, {"q": "x"})], "done"]), stores
        ).run(agent, f"the token {GHP}_old was rotated", tenant=T, run_id="r1")
        assert run.status is RunStatus.completed
    assert GHP.encode() not in _db_bytes(tmp_path)


# --- redaction ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        repr((KID, SEC)),
        f'"{KID}","{SEC}"',
        f"| {KID} | {SEC} |",
        json.dumps([KID, SEC]),
        json.dumps([KID, SEC], indent=2),
        f"{KID}\r\n{SEC}",
        f"{KID}:{SEC}",
        f"{KID} ; {SEC}",
    ],
)
def test_an_aws_pair_is_masked_as_text(text: str) -> None:
    masked = default_redactor().text(text)
    assert SEC not in masked and KID not in masked, masked


@pytest.mark.parametrize("data", [[KID, SEC], (KID, SEC), {"creds": [[KID, SEC]]}])
def test_an_aws_pair_is_masked_as_data(data: Any) -> None:
    assert SEC not in json.dumps(default_redactor().value(data))


@pytest.mark.parametrize("data", [{KID: SEC}, json.dumps({KID: SEC})], ids=["dict", "json"])
def test_an_aws_pair_written_as_an_object_is_masked(data: Any) -> None:
    assert SEC not in json.dumps(default_redactor().value(data))


@pytest.mark.parametrize(
    "text",
    [
        "commit 3f786850e387550fdab836ed7e6dc881de23001b",
        "id,digest\nusr_1,3f786850e387550fdab836ed7e6dc881de23001b\n",
        "sha1-base64 Pz9+bC4dM3Q0TbF7f+kGWaZvLyM= etc",
        "the var my_ghp_value and ghp_enabled are fine",
        f"{KID} see the runbook for rotating this key!!",
    ],
)
def test_ordinary_text_stays(text: str) -> None:
    masked = default_redactor().text(text)
    assert masked.replace("[redacted:aws_access_key_id]", KID) == text


def test_a_key_id_beside_a_sentence_is_no_pair() -> None:
    said = "see the runbook for rotating this key!!"
    assert default_redactor().value([KID, said])[1] == said


# --- approving and cancelling ----------------------------------------------------------


def _approver() -> Agent:
    @tool(requires_approval=True)
    def book_seat(flight: str) -> dict[str, str]:
        """Book a seat."""
        return {"booking": "B1"}

    return Agent("approver", "Book.", [book_seat])


TURNS: list[Any] = [[("book_seat", {"flight": "LH123"})], "Booked."]


async def _waiting(stores: Any, run_id: str = "r1") -> str:
    await stores.create_schema()
    run = await AgentRunner.from_stores(ScriptedProvider(list(TURNS)), stores).run(
        _approver(), "book", tenant=T, run_id=run_id
    )
    assert run.status is RunStatus.waiting_approval and run.pending_approval is not None
    return run.pending_approval.id


async def _rewrite(stores: Any, run_id: str, **changes: Any) -> None:
    cp = await Checkpointer.from_stores(stores).latest(T, run_id)
    assert cp is not None
    step = cp.step + 1
    payload = encode_checkpoint(dataclasses.replace(cp, step=step, **changes), Redactor())
    await stores.checkpoints.put(T, run_id, payload, step=step, fence=cp.fence)


def _approve(stores: Any, request: str) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    code = frontier_main(
        ["approve", request, "--tenant", T, "--by", "op"], stores=stores, out=out, err=err
    )
    return code, out.getvalue() + err.getvalue()


async def test_approving_a_waiting_run_gives_its_resume_command(tmp_path: Path) -> None:
    async with open_stores(_url(tmp_path)) as stores:
        request = await _waiting(stores)
        code, said = await asyncio.to_thread(_approve, stores, request)
    assert code == 0, said
    assert "tesserix run --resume r1 --tenant acme" in said, said


async def test_approving_after_the_run_ended_says_it_ended(tmp_path: Path) -> None:
    async with open_stores(_url(tmp_path)) as stores:
        request = await _waiting(stores)
        await _rewrite(stores, "r1", status=CheckpointStatus.failed)
        code, said = await asyncio.to_thread(_approve, stores, request)
    assert code == 0, said
    assert "ended" in said and "--resume" not in said, said


async def test_approving_after_a_temporal_run_ended_says_it_ended(tmp_path: Path) -> None:
    async with open_stores(_url(tmp_path)) as stores:
        request = await _waiting(stores)
        await _rewrite(stores, "r1", carried_by=Carrier.temporal, status=CheckpointStatus.failed)
        code, said = await asyncio.to_thread(_approve, stores, request)
    assert code == 0, said
    assert "ended" in said and "workflow takes the decision" not in said, said


def _heading(response: Any) -> str:
    found = re.search(r"<h1[^>]*>(.*?)</h1>", response.text, re.S)
    return "" if found is None else re.sub(r"<[^>]+>", "", found.group(1))


def _console_cancel(url: str, run_id: str) -> Any:
    with TestClient(create_app(url), base_url=BASE, raise_server_exceptions=False) as client:
        assert client.get("/").status_code == 200
        csrf = client.cookies.get("tesserix_csrf")
        return client.post(
            tenant_path(T, "runs", run_id, "cancel"),
            data={"csrf": csrf, "by": "bob", "reason": "stale page"},
            headers={"origin": BASE},
        )


async def _completed(url: str, *, earlier_request: bool) -> None:
    async with open_stores(url) as stores:
        await _waiting(stores)
        await _rewrite(stores, "r1", status=CheckpointStatus.completed)
        if earlier_request:
            # A cancel asked while a live worker held the run, which completed it meanwhile.
            await request_cancel(
                stores.idempotency, T, "r1", by="alice", reason=None, redactor=Redactor()
            )


async def _standing(url: str) -> Any:
    async with open_stores(url) as stores:
        return await cancel_requested(stores.idempotency, T, "r1")


def test_a_cancel_of_a_completed_run_is_headed_nothing_to_cancel(tmp_path: Path) -> None:
    url = _url(tmp_path)
    asyncio.run(_completed(url, earlier_request=False))
    late = _console_cancel(url, "r1")
    assert "nothing to cancel" in late.text.lower()
    assert _heading(late) == "Nothing to cancel", _heading(late)
    assert asyncio.run(_standing(url)) is None


def test_a_late_cancel_of_an_ended_run_is_not_headed_recorded(tmp_path: Path) -> None:
    url = _url(tmp_path)
    asyncio.run(_completed(url, earlier_request=True))
    late = _console_cancel(url, "r1")
    assert "nothing to cancel" in late.text.lower(), late.text
    assert "recorded" not in _heading(late).lower(), _heading(late)
