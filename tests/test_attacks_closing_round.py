"""Closing attack round: the newest GitHub token rules, ``tesserix cancel``, the layer rule.

Attacked: ``checkpoint/redaction/patterns.py``'s ``github_token`` rules (a classic token
wrapped across lines anywhere, a short first line too, via ``_prefixed_token``; a
fine-grained one of 82 characters with a digit; the rule for a token glued to a name, now
last), compared with an ``sk-proj-`` key in the same shape, through the redactor and end to
end into SQLite (the file's bytes read back); ``cli/work.py`` ``_cancel``/``_ended`` (text,
``--json`` and the console) for a run cancelled before, completed, failed, damaged (a
frontier row changed in SQLite), submitted but not started; ``tests/test_import_layers.py``'s
new allowance (a store module importing ``tesserix_adk.checkpoint.redaction`` first, in a
fresh interpreter).

Found, and fixed (their tests pass now: a wrapped GitHub token's head is masked when its tail
reads as no token's, a wrapped key may end a sentence, a head needs 8 characters (or the
whole token on the next line), and a second cancel of a run cancelled before it started
says nothing was recorded):
- HIGH: a classic GitHub token wrapped across lines whose last line is short and holds no
  digit (``ghp_`` + 30 characters, then ``AbCdEf``), or whose last line ends a sentence
  (``….``/``…:``), is stored wholly raw: no alternative of the rule matches, and nothing else
  does; an ``sk-proj-`` key in the same shape has at least its first line masked
  (``test_a_wrapped_github_token_with_a_short_or_punctuated_tail_is_masked``,
  ``test_a_wrapped_github_token_with_a_short_tail_never_reaches_sqlite``).
- MEDIUM: a wrapped key whose last line ends a sentence is half masked: the first line goes,
  the rest (most of an ``sk-proj-`` key) stays visible
  (``test_a_wrapped_key_ending_a_sentence_is_masked_whole``).
- LOW: ``ghp_`` ending a line with a word-and-digit line after it takes that line as a
  token: ordinary text is masked (``ghp_\\nREADME2``, ``prefix ghp_\\n2024``)
  (``test_ghp_prefix_ending_a_line_leaves_the_next_line_alone``).
- LOW: a second cancel of a run submitted but not started says again "cancelled before it
  started" (``--json`` ``state: cancelled_before_start``; the console heads it "Cancel
  recorded") though nothing was recorded, as a second cancel of a cancelled run now says
  (``test_a_second_cancel_of_a_run_cancelled_before_it_started_says_nothing_recorded``).

Held: a token on its own, with ``_old`` after it, in CSV, in a URL, after ``Bearer``,
glued to a name (with a digit and an upper-case letter), wrapped with a long or digit tail
(newline, CRLF, tab-indented, JSON-escaped ``\\n``), with an empty first line; a
fine-grained token, wrapped too; ``github_pat_expiration_warning_days``, an all-lower-case
glued run and a hash glued to ``ghs_`` stay; cancel of a completed/failed run and a second
cancel of a cancelled one say ``already_ended``/"Nothing to cancel" (text, ``--json``,
console); a damaged frontier makes cancel exit 4 with the checksum error (``--json`` too),
the console says "Cancel refused", nothing is recorded; an approval store module imported
first (the top-level package bare) pulls in the redaction package and nothing else of
``checkpoint``, and imports in a plain fresh interpreter.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import re
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

import tesserix_adk
from tesserix_adk import Agent, AgentRunner, RunStatus, ScriptedProvider, open_stores, tool
from tesserix_adk.checkpoint.payload import CheckpointStatus
from tesserix_adk.checkpoint.redaction import default_redactor
from tesserix_adk.cli.main import main as cli_main
from tesserix_adk.console import create_app
from tesserix_adk.console.pages import tenant_path
from tesserix_adk.run.cancelling import cancel_requested

T = "acme"
BODY = "aB3dE5gH7jK9mN1pQ2rS4tU6vW8xY0zAbCdE"  # 36 base62
GHP = "ghp_" + BODY
PAT = "github_pat_11ABCDEFG0" + "aBcDeFgHiJkL_" + "Zq9" * 19 + "ab"
SKP = "sk-proj-Xy7Qw2Er4Ty6Ui8Op0AsDfGhJkLzXcVbNmQwErTyUiOpAsDfGhJkL1234567890abcdEFGHijkl"
BASE = "http://127.0.0.1:8765"


def _text(value: str) -> str:
    return default_redactor().text(value)


def _url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'adk.sqlite3'}"


def _db_bytes(tmp_path: Path) -> bytes:
    return b"".join(p.read_bytes() for p in tmp_path.iterdir() if p.name.startswith("adk"))


# --- GitHub tokens: what holds -------------------------------------------------------------


@pytest.mark.parametrize(
    "text,secret",
    [
        (f"token {GHP} end", GHP),
        (f"{GHP}_old", GHP),
        (f"id,{GHP},x", GHP),
        (f"https://{GHP}@github.com/o/r.git", GHP),
        (f"Authorization: Bearer {GHP}", BODY),
        (f"lookup_{GHP}", BODY),
        (f"ghp_{BODY[:20]}\n{BODY[20:]}\n", BODY[:20]),
        (f"ghp_{BODY[:20]}\r\n{BODY[20:]}\r\n", BODY[:20]),
        (f"ghp_{BODY[:20]}\n\t{BODY[20:]}\t\n", BODY[:20]),
        ('{"t": "ghp_' + BODY[:20] + "\\n" + BODY[20:] + '"}', BODY[:20]),
        (f"ghp_{BODY[:12]}\n{BODY[12:24]}\n{BODY[24:]}\n", BODY[24:]),
        (f"ghp_\n{BODY}\n", BODY),
        (PAT, PAT[11:]),
        (f"{PAT[:30]}\n{PAT[30:]}\n", PAT[30:]),
    ],
)
def test_a_github_token_in_a_masked_shape_is_masked(text: str, secret: str) -> None:
    masked = _text(text)
    assert secret not in masked and "[redacted:" in masked, masked


@pytest.mark.parametrize(
    "text",
    [
        "github_pat_expiration_warning_days",
        "lookup_ghp_" + BODY.lower(),
        "the prefix is ghp_\nsee the docs",
        "fetch_ghs_ClassificationAndLabellingOfChemicals",
    ],
)
def test_ordinary_text_with_github_prefixes_stays(text: str) -> None:
    assert _text(text) == text


# --- GitHub tokens: defects ----------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        f"pushing with ghp_{BODY[:30]}\nAbCdEf\n",  # a 6-letter tail: no digit, under 16
        f"pushing with ghp_{BODY[:25]}\nAbCdEfGhIjK\n",
        f'"ghp_{BODY[:30]}\nAbCdEf"',
        f"Your token is ghp_{BODY[:20]}\n{BODY[20:]}.\n",  # the sentence ends after it
        f"ghp_{BODY[:30]}\n{BODY[30:]}: use it once",
    ],
)
def test_a_wrapped_github_token_with_a_short_or_punctuated_tail_is_masked(text: str) -> None:
    head = text.split("ghp_")[1].split("\n")[0]
    # The yardstick: an sk-proj- key in the same shape has its first line masked.
    sk = text.replace("ghp_", "sk-proj-")
    assert head not in _text(sk), _text(sk)
    masked = _text(text)
    assert head not in masked, masked


async def test_a_wrapped_github_token_with_a_short_tail_never_reaches_sqlite(
    tmp_path: Path,
) -> None:
    token = "ghp_" + BODY[:30] + "AbCdEf"

    @tool(side_effects=False)
    def show_token_screen() -> str:
        """A terminal screen, 34 columns wide."""
        return f"New token created:\n{token[:34]}\n{token[34:]}\n"

    agent = Agent("gh", "Show it.", [show_token_screen])
    async with open_stores(_url(tmp_path)) as stores:
        await stores.create_schema()
        run = await AgentRunner.from_stores(
            ScriptedProvider([[("show_token_screen", {})], "done"]), stores
        ).run(agent, "make a token", tenant=T, run_id="r1")
        assert run.status is RunStatus.completed
    raw = _db_bytes(tmp_path)
    assert token[4:34].encode() not in raw


def test_a_wrapped_key_ending_a_sentence_is_masked_whole() -> None:
    masked = _text(f"Your key is {SKP[:28]}\n{SKP[28:]}.\n")
    assert SKP[:28] not in masked
    assert SKP[28:] not in masked, masked


@pytest.mark.parametrize("text", ["ghp_\nREADME2\nsetup.py\n", "prefix ghp_\n2024\n"])
def test_ghp_prefix_ending_a_line_leaves_the_next_line_alone(text: str) -> None:
    assert _text(text) == text


# --- tesserix cancel -----------------------------------------------------------------------


def _approver() -> Agent:
    @tool(requires_approval=True)
    def book_seat(flight: str) -> dict[str, str]:
        """Book a seat."""
        return {"booking": "B1"}

    return Agent("approver", "Book.", [book_seat])


async def _waiting(url: str) -> None:
    async with open_stores(url) as stores:
        await stores.create_schema()
        run = await AgentRunner.from_stores(
            ScriptedProvider([[("book_seat", {"flight": "LH123"})], "Booked."]), stores
        ).run(_approver(), "book", tenant=T, run_id="r1")
        assert run.status is RunStatus.waiting_approval


async def _ended(url: str, status: CheckpointStatus) -> None:
    import dataclasses

    from tesserix_adk import Checkpointer
    from tesserix_adk.checkpoint.payload import encode_checkpoint
    from tesserix_adk.checkpoint.redaction import Redactor

    async with open_stores(url) as stores:
        cp = await Checkpointer.from_stores(stores).latest(T, "r1")
        assert cp is not None
        step = cp.step + 1
        payload = encode_checkpoint(dataclasses.replace(cp, step=step, status=status), Redactor())
        await stores.checkpoints.put(T, "r1", payload, step=step, fence=cp.fence)


async def _standing(url: str) -> Any:
    async with open_stores(url) as stores:
        return await cancel_requested(stores.idempotency, T, "r1")


def _cli(url: str, by: str, *extra: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli_main(["cancel", "r1", "--tenant", T, "--by", by, "--store", url, *extra])
    return rc, out.getvalue(), err.getvalue()


def _heading(response: Any) -> str:
    found = re.search(r"<h1[^>]*>(.*?)</h1>", response.text, re.S)
    return "" if found is None else re.sub(r"<[^>]+>", "", found.group(1)).strip()


def _console_cancel(url: str, by: str) -> Any:
    with TestClient(create_app(url), base_url=BASE, raise_server_exceptions=False) as client:
        assert client.get("/").status_code == 200
        csrf = client.cookies.get("tesserix_csrf")
        return client.post(
            tenant_path(T, "runs", "r1", "cancel"),
            data={"csrf": csrf, "by": by, "reason": "stale"},
            headers={"origin": BASE},
        )


def _damage_frontier(tmp_path: Path) -> None:
    con = sqlite3.connect(tmp_path / "adk.sqlite3")
    try:
        step = con.execute("select max(step) from adk_checkpoint_steps").fetchone()[0]
        (payload,) = con.execute(
            "select payload from adk_checkpoint_steps where step = ?", (step,)
        ).fetchone()
        damaged = bytearray(payload)
        damaged[len(damaged) // 2] ^= 0x01
        con.execute(
            "update adk_checkpoint_steps set payload = ? where step = ?", (bytes(damaged), step)
        )
        con.commit()
    finally:
        con.close()


@pytest.mark.parametrize("status", [CheckpointStatus.completed, CheckpointStatus.failed])
def test_cancel_of_an_ended_run_records_nothing_and_says_so(
    tmp_path: Path, status: CheckpointStatus
) -> None:
    url = _url(tmp_path)
    asyncio.run(_waiting(url))
    asyncio.run(_ended(url, status))
    rc, out, _ = _cli(url, "bob", "--json")
    said = json.loads(out)
    assert rc == 0 and said["state"] == "already_ended" and said["status"] == status.value
    rc, out, _ = _cli(url, "carol")
    assert rc == 0 and "nothing to cancel" in out, out
    assert _heading(_console_cancel(url, "dave")) == "Nothing to cancel"
    assert asyncio.run(_standing(url)) is None


def test_a_second_cancel_of_a_cancelled_run_says_already_ended(tmp_path: Path) -> None:
    url = _url(tmp_path)
    asyncio.run(_waiting(url))
    first = json.loads(_cli(url, "alice", "--json")[1])
    assert first["state"] == "cancelled" and first["by"] == "alice"
    second = json.loads(_cli(url, "bob", "--json")[1])
    assert second["state"] == "already_ended" and second["by"] == "alice", second
    assert "nothing to cancel" in _cli(url, "bob")[1]


def test_cancel_of_a_damaged_frontier_is_refused_and_records_nothing(tmp_path: Path) -> None:
    url = _url(tmp_path)
    asyncio.run(_waiting(url))
    _damage_frontier(tmp_path)
    rc, out, err = _cli(url, "bob", "--json")
    assert rc == 4 and "checksum" in json.loads(out)["error"]["message"], (out, err)
    rc, _, err = _cli(url, "bob")
    assert rc == 4 and "checksum" in err
    page = _console_cancel(url, "carol")
    assert page.status_code == 409 and _heading(page) == "Cancel refused"
    assert asyncio.run(_standing(url)) is None


async def _submitted(url: str) -> None:
    async with open_stores(url) as stores:
        await stores.create_schema()
        await AgentRunner.from_stores(ScriptedProvider(["x"]), stores).submit(
            _approver(), "book", tenant=T, run_id="r1"
        )


def test_a_second_cancel_of_a_run_cancelled_before_it_started_says_nothing_recorded(
    tmp_path: Path,
) -> None:
    url = _url(tmp_path)
    asyncio.run(_submitted(url))
    first = json.loads(_cli(url, "alice", "--json")[1])
    assert first["state"] == "cancelled_before_start"
    second = json.loads(_cli(url, "bob", "--json")[1])
    assert second["by"] == "alice"
    assert second["state"] != "cancelled_before_start", second
    assert _heading(_console_cancel(url, "carol")) == "Nothing to cancel"


# --- the layer rule ------------------------------------------------------------------------

_BARE_IMPORT = """
import importlib, json, sys, types
bare = types.ModuleType("tesserix_adk")
bare.__path__ = [sys.argv[1]]
sys.modules["tesserix_adk"] = bare
importlib.import_module(sys.argv[2])
print(json.dumps(sorted(m for m in sys.modules if m.startswith("tesserix_adk."))))
"""

APPROVAL_STORES = [
    "tesserix_adk.stores.protocols.approvals",
    "tesserix_adk.stores.sqlite.approvals",
    "tesserix_adk.stores.memory.approvals",
]


@pytest.mark.parametrize("module", APPROVAL_STORES)
def test_an_approval_store_imported_first_pulls_in_no_checkpointer(module: str) -> None:
    root = str(Path(tesserix_adk.__file__).parent)
    done = subprocess.run(
        [sys.executable, "-c", _BARE_IMPORT, root, module],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    loaded = json.loads(done.stdout)
    checkpoint = [
        m
        for m in loaded
        if m.startswith("tesserix_adk.checkpoint")
        and m != "tesserix_adk.checkpoint"
        and not m.startswith("tesserix_adk.checkpoint.redaction")
    ]
    assert "tesserix_adk.checkpoint.redaction" in loaded
    assert checkpoint == [] and not any(m.startswith("tesserix_adk.run") for m in loaded)


def test_an_approval_store_imports_first_in_a_plain_fresh_interpreter() -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "import tesserix_adk.stores.sqlite.approvals as m; print(m.__name__)",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0 and "approvals" in done.stdout, done.stderr
