"""An idempotency key built from a secret: no store keeps the secret, and the key still
names one business object (a second run asking for it is answered, not sent again)."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

from tesserix_adk import Agent, AgentRunner, ScriptedProvider, ToolContext, tool
from tesserix_adk.stores.urls import open_stores

SECRET = "sk-proj-AbCdEfGhIjKlMnOpQrStUvWxYz0123456789abcd"


def _payer(sent: list[str | None]) -> Agent:
    @tool(key=lambda **kw: f"charge-{kw['arguments']['card']}")
    def charge(card: str, ctx: ToolContext) -> str:
        sent.append(ctx.idempotency_key)
        return "charged"

    return Agent("payer", "Charge the card.", [charge])


def _everything_stored(path: Path) -> bytes:
    with sqlite3.connect(path) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        dump = "\n".join(conn.iterdump())
    return dump.encode() + path.read_bytes()


async def _run(url: str, agent: Agent, run_id: str) -> Any:
    async with open_stores(url) as stores:
        await stores.create_schema()
        provider = ScriptedProvider([[("charge", {"card": SECRET})], "done"])
        runner = AgentRunner.from_stores(provider, stores)
        return await runner.run(agent, "charge it", tenant="t", run_id=run_id)


async def test_a_key_built_from_a_secret_is_stored_as_a_digest_and_still_dedupes(
    tmp_path: Path,
) -> None:
    path = tmp_path / "adk.sqlite3"
    url = f"sqlite:///{path}"
    sent: list[str | None] = []
    agent = _payer(sent)
    first = await _run(url, agent, "first")
    second = await _run(url, agent, "second")
    assert (first.status.value, second.status.value) == ("completed", "completed")
    # One business object, one charge: the second run is answered from the first's record.
    assert len(sent) == 1, sent
    [key] = sent
    assert key is not None and SECRET not in key
    assert SECRET.encode() not in _everything_stored(path)


async def test_a_key_without_a_secret_is_kept_as_written(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'adk.sqlite3'}"
    seen: list[str | None] = []

    @tool(key=lambda **kw: f"order-{kw['arguments']['order']}")
    def ship(order: str, ctx: ToolContext) -> str:
        seen.append(ctx.idempotency_key)
        return "shipped"

    async with open_stores(url) as stores:
        await stores.create_schema()
        provider = ScriptedProvider([[("ship", {"order": "5"})], "done"])
        await AgentRunner.from_stores(provider, stores).run(
            Agent("shipper", "Ship.", [ship]), "ship it", tenant="t", run_id="r"
        )
    assert seen == ["t/order-5"]
