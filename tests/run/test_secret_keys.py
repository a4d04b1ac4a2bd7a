"""An idempotency key a tool's key function would build from a secret: the call is refused
("not sent", with why), so no store keeps the secret, whatever redaction setting a process
has; a key without one is kept as written."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from run.helpers import Recording, answers
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


async def test_a_call_whose_key_would_hold_a_secret_is_refused_and_nothing_stores_it(
    tmp_path: Path,
) -> None:
    path = tmp_path / "adk.sqlite3"
    url = f"sqlite:///{path}"
    sent: list[str | None] = []
    agent = _payer(sent)
    provider = Recording(ScriptedProvider([[("charge", {"card": SECRET})], "done"]))
    async with open_stores(url) as stores:
        await stores.create_schema()
        run = await AgentRunner.from_stores(provider, stores).run(
            agent, "charge it", tenant="t", run_id="r"
        )
    assert run.status.value == "completed"
    assert sent == []  # never sent: nothing could key it without keeping the secret
    [told] = answers(provider.requests[-1], "charge")
    assert told.is_error and "not sent" in told.text and "key" in told.text
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
