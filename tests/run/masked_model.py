"""What the attacks on a result's or an error's text share: a pydantic model whose own
serializer alone masks a field (a secret no built-in pattern knows), and a keyed tool run
on SQLite that returns or raises what a test makes, the SQLite bytes and what the model was
told searched for the secret."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pydantic
import pytest

from operator_cli import sqlite_bytes
from tesserix_adk import Agent, AgentRunner, ScriptedProvider, tool
from tesserix_adk.checkpoint.payload import decode_outcome
from tesserix_adk.stores.protocols import RecordStatus
from tesserix_adk.stores.urls import open_stores

SECRET = "SIGNKEYwq73zp"  # no built-in pattern knows it: only the model's serializer masks it


class Card(pydantic.BaseModel):
    """Frozen, so it may sit in a dict key or an enum's value too."""

    model_config = pydantic.ConfigDict(frozen=True)

    memo: str

    @pydantic.field_serializer("memo", when_used="json")
    def _masked(self, memo: str) -> str:
        return "****" + memo[-2:]


def card() -> Card:
    return Card(memo=SECRET)


class Recording:
    """A scripted model that keeps what it was asked."""

    def __init__(self, turns: list[Any]) -> None:
        self.inner = ScriptedProvider(turns)
        self.requests: list[Any] = []

    async def complete(self, request: Any) -> Any:
        self.requests.append(request)
        return await self.inner.complete(request)

    def told(self) -> str:
        return "".join(
            m.text for r in self.requests for m in r.messages if m.tool_call_id is not None
        )


class Crash(Exception):
    pass


class CrashAfter(Recording):
    """Asks for the call, then fails the next turn (a crash before the run moves on)."""

    async def complete(self, request: Any) -> Any:
        if self.requests:
            self.requests.append(request)
            raise Crash("the process died")
        return await super().complete(request)


def chain(exc: BaseException) -> list[BaseException]:
    out: list[BaseException] = []
    seen: BaseException | None = exc
    while seen is not None and seen not in out:
        out.append(seen)
        seen = seen.__cause__ or seen.__context__
    return out


def raising(make: Callable[[], BaseException]) -> Callable[[], Any]:
    """A tool body that raises what ``make`` makes."""

    def act() -> Any:
        raise make()

    return act


async def run_on_sqlite(
    tmp_path: Path, act: Callable[[], Any], *, tenant: str, resumed: bool = True
) -> tuple[Any, bytes, str, int]:
    """One run whose keyed call does ``act()`` (returns or raises), and with ``resumed``
    interrupted after the call and resumed (the model asks for the same call again): the
    record's outcome, the SQLite bytes, what the model was told, and how many times the
    tool ran."""
    sent: list[int] = []

    @tool(key=lambda **kw: "send-1")
    def send(what: str) -> Any:
        """Send a thing (a side effect, keyed)."""
        sent.append(1)
        return act()

    turns: list[Any] = [[("send", {"what": "x"})], "ok"]
    first = CrashAfter(turns) if resumed else Recording(turns)
    second = Recording([[("send", {"what": "x"})], "ok"])
    async with open_stores(f"sqlite:///{tmp_path / 'adk.sqlite3'}") as stores:
        await stores.create_schema()
        agent = Agent("a", "x", [send])
        runner = AgentRunner.from_stores(first, stores)
        if resumed:
            with pytest.raises(Exception) as crashed:
                await runner.run(agent, "go", tenant=tenant, run_id="r0")
            assert Crash in {type(e) for e in chain(crashed.value)}, crashed.value
        else:
            await runner.run(agent, "go", tenant=tenant, run_id="r0")
        [rec] = list(await stores.idempotency.records(tenant, "r0"))
        assert rec.status is RecordStatus.completed
        outcome = decode_outcome(rec.outcome, "c")
        if resumed:
            await AgentRunner.from_stores(second, stores).resume(agent, "r0", tenant=tenant)
            records = list(await stores.idempotency.records(tenant, "r0"))
            assert len(records) == 1
            assert all(r.status is RecordStatus.completed for r in records)
    return outcome, sqlite_bytes(tmp_path), first.told() + second.told(), len(sent)


async def assert_never_shown(
    tmp_path: Path, act: Callable[[], Any], *, tenant: str, resumed: bool = True
) -> Any:
    """``run_on_sqlite``, asserting the call ran once and the secret is nowhere: not in the
    SQLite bytes, what the model was told, or the recorded outcome. The outcome."""
    outcome, raw, told, sent = await run_on_sqlite(tmp_path, act, tenant=tenant, resumed=resumed)
    assert sent == 1, "sent again"
    assert told  # the model was told the recorded outcome
    assert SECRET.encode() not in raw, "raw in the SQLite file"
    assert SECRET not in told, told[-300:]
    assert SECRET not in str(outcome.content)
    return outcome
