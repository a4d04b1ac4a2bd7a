"""Content is redacted once on its way into a run: a tool's result reaches its record, the
transcript and the frontier's observation, and a call's arguments the transcript and the
outstanding call, but each text is scanned for secrets once."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tesserix_adk import Agent, AgentRunner, ScriptedProvider, ScriptedTurn, tool
from tesserix_adk.checkpoint.redaction import Redactor
from tesserix_adk.checkpoint.redaction.redactor import _hinted
from tesserix_adk.stores.urls import open_stores

RESULT = "the fare rules say: " + "refundable within 24 hours, " * 20
SECRET = "sk-proj-" + "A1b2C3d4" * 6


@pytest.mark.parametrize("store", ["memory://", "sqlite"])
async def test_a_turns_content_is_scanned_once_and_its_secret_masked_everywhere(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, store: str
) -> None:
    scanned: Counter[str] = Counter()
    builtin = Redactor._builtin

    def counting(self: Redactor, value: str) -> str:
        scanned[value] += 1
        return builtin(self, value)

    monkeypatch.setattr(Redactor, "_builtin", counting)
    url = store if store != "sqlite" else f"sqlite:///{tmp_path / 'adk.sqlite3'}"
    stores = open_stores(url)
    await stores.create_schema()

    @tool
    def fare_rules(note: str) -> str:
        return f"{RESULT} {SECRET}"

    note = "please look up the fare rules for seat 12A " * 12
    script: list[Any] = [ScriptedTurn(calls=[("fare_rules", {"note": note})]), "done"]
    try:
        runner = AgentRunner.from_stores(ScriptedProvider(script), stores)
        run = await runner.run(Agent("r", "x", tools=[fare_rules]), "go", tenant="t", run_id="r")
        assert run.status == "completed"
        # Scanned once each, though each was stored three times or more.
        assert scanned[f"{RESULT} {SECRET}"] == 1
        assert scanned[note] == 1
        cp = await runner.checkpoints.latest("t", "r")  # type: ignore[union-attr]
        messages = await runner.checkpoints.messages(cp)  # type: ignore[union-attr,arg-type]
        told = [m for m in messages if m.tool_call_id is not None]
        assert SECRET not in str(told[0].content) and "[redacted:" in str(told[0].content)
        (record,) = await stores.idempotency.records("t", "r")
        assert record.outcome is not None and SECRET.encode() not in record.outcome
    finally:
        await stores.aclose()


def test_a_text_masked_from_memory_is_masked_as_a_fresh_scan_would() -> None:
    remembering, fresh = Redactor(), Redactor()
    texts = [f"token {SECRET} number {i}" for i in range(300)] * 2
    assert [remembering.text(t) for t in texts] == [Redactor().text(t) for t in texts]
    assert all(SECRET not in remembering.text(t) for t in texts)
    assert fresh.text(texts[0]) == remembering.text(texts[0])


# The quick look before the rules run, as one regex (what it was before substring tests).
_ONE_REGEX = re.compile(
    r"-----begin|sk-|gh[pousr]_|github_pat_|xox|akia|asia|eyj|basic|bearer|://|secret|[/+]"
    r"|pass|pwd|token|key|auth|cookie|credential|input_value="
)
_PIECES = st.sampled_from(
    [
        "-",
        "-----begin",
        "sk",
        "gh",
        "p",
        "o",
        "u",
        "s",
        "r",
        "_",
        "github",
        "pat",
        "xo",
        "x",
        "ak",
        "ia",
        "as",
        "eyj",
        "ba",
        "sic",
        "bear",
        "er",
        ":/",
        "/",
        "+",
        "se",
        "cret",
        "pa",
        "ss",
        "tok",
        "en",
        "ke",
        "y",
        "au",
        "th",
        "coo",
        "kie",
        "cred",
        "ential",
        "input_value",
        "=",
        " ",
        "é",
        "K",
    ]
)


@settings(max_examples=2000, deadline=None)
@given(st.lists(_PIECES, max_size=4).map("".join), st.text(max_size=20))
def test_the_quick_look_finds_a_hint_exactly_where_the_one_regex_did(
    pieces: str, noise: str
) -> None:
    for text in (pieces, noise + pieces, pieces + noise, pieces.lower()):
        assert _hinted(text) is (_ONE_REGEX.search(text) is not None), text


_LITERALS = [
    *("-----begin", "sk-", "github_pat_", "xox", "akia", "asia", "eyj", "basic", "bearer"),
    *("://", "secret", "/", "+", "pass", "pwd", "token", "key", "auth", "cookie", "credential"),
    *("input_value=", *(f"gh{c}_" for c in "pousr")),
]


@pytest.mark.parametrize("literal", _LITERALS)
def test_the_quick_look_finds_each_hint_alone_and_not_a_piece_of_it(literal: str) -> None:
    assert _ONE_REGEX.fullmatch(literal)
    assert _hinted(f"zz {literal} zz")
    for cut in range(1, len(literal)):
        for piece in (literal[:cut], literal[cut:]):
            assert _hinted(f"zz {piece} zz") is (_ONE_REGEX.search(piece) is not None), piece
