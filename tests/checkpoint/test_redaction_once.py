"""Content is redacted once on its way into a run: a tool's result reaches its record, the
transcript and the frontier's observation, and a call's arguments the transcript and the
outstanding call, but each text is scanned for secrets once."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tesserix_adk import Agent, AgentRunner, ScriptedProvider, ScriptedTurn, tool
from tesserix_adk.checkpoint.redaction import Redactor
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
