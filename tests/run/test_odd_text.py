"""Text JSON can carry but UTF-8 cannot: a lone surrogate from a tool or a model is kept
as it came, not a crash after the tool ran (which left its call in doubt)."""

from __future__ import annotations

from pathlib import Path

from tesserix_adk import Agent, AgentRunner, RunStatus, ScriptedProvider, tool
from tesserix_adk.checkpoint.checkpointer import Checkpointer
from tesserix_adk.stores.urls import open_stores

ODD = "half a pair: \ud83d, then on"


async def test_a_lone_surrogate_in_a_result_and_an_answer_is_recorded_as_it_came(
    tmp_path: Path,
) -> None:
    sent: list[str] = []

    @tool
    def fetch(page: str) -> str:
        sent.append(page)
        return ODD

    url = f"sqlite:///{tmp_path / 'adk.sqlite3'}"
    async with open_stores(url) as stores:
        await stores.create_schema()
        provider = ScriptedProvider([[("fetch", {"page": "1"})], "answer: " + ODD])
        run = await AgentRunner.from_stores(provider, stores).run(
            Agent("reader", "Read.", [fetch]), "read it", tenant="t", run_id="r"
        )
        assert run.status is RunStatus.completed, run
        assert run.output == "answer: " + ODD
        assert sent == ["1"]
        checkpoints = Checkpointer(stores.checkpoints, history=stores.history)
        frontier = await checkpoints.latest("t", "r")
        assert frontier is not None
        texts = [m.text for m in await checkpoints.messages(frontier)]
        assert ODD in texts and "answer: " + ODD in texts
        [record] = [r for r in await stores.idempotency.records("t", "r") if r.tool == "fetch"]
        assert record.status.value == "completed"
