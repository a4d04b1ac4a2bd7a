"""Helpers the runner's tests share: frontier predicates, a provider that records, and
what a SQLite file holds as another process sees it."""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from adapters import services
from tesserix_adk import (
    AgentRunner,
    Checkpointer,
    LeasePolicy,
    Message,
    ModelRequest,
    ModelResponse,
    Role,
    ScriptedTurn,
    ToolCall,
)
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.stores.sqlite.database import SqliteDatabase
from tesserix_adk.stores.urls import open_stores
from tesserix_adk.testing.faults import FaultyCheckpointStore

__all__ = [
    "Asks",
    "Recording",
    "answers",
    "at",
    "database_of",
    "faulty_runner",
    "fresh_stores",
    "scripted",
    "statuses",
]


def at(boundary: str, iteration: int) -> Any:
    """A payload test for ``FaultyCheckpointStore``: the frontier at ``boundary`` of
    ``iteration``."""
    return lambda body: body.get("boundary") == boundary and body.get("iteration") == iteration


class Recording:
    """A provider that keeps every request it was sent."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.requests: list[ModelRequest] = []

    async def complete(self, request: ModelRequest) -> ModelResponse:
        self.requests.append(request)
        response: ModelResponse = await self.inner.complete(request)
        return response


def faulty_runner(
    stores: Stores,
    provider: Any,
    *,
    crash_before: Any,
    lease_policy: LeasePolicy | None = None,
    **checkpointer: Any,
) -> AgentRunner:
    """A runner over ``stores`` whose checkpoint store "dies" (``SimulatedCrash``) before
    the frontier ``crash_before`` picks (``at``)."""
    return AgentRunner(
        provider,
        idempotency=stores.idempotency,
        checkpoints=Checkpointer(
            FaultyCheckpointStore(stores.checkpoints, crash_before=crash_before),
            history=stores.history,
            **checkpointer,
        ),
        leases=stores.leases,
        ledger=stores.ledger,
        approvals=stores.approvals,
        work=stores.work,
        lease_policy=lease_policy,
    )


class Asks:
    """A model that asks for each turn's calls as given (ids included), then ``done``."""

    def __init__(self, *turns: list[ToolCall] | str) -> None:
        self.turns = turns
        self.requests: list[ModelRequest] = []

    async def complete(self, request: ModelRequest) -> ModelResponse:
        self.requests.append(request)
        asked = sum(1 for m in request.messages if m.role is Role.assistant)
        turn = self.turns[asked] if asked < len(self.turns) else "done"
        if isinstance(turn, str):
            return ModelResponse(message=Message(role="assistant", content=turn))
        return ModelResponse(message=Message(role="assistant", content="", tool_calls=turn))


@contextlib.asynccontextmanager
async def fresh_stores(where: str, tmp_path: Path) -> AsyncIterator[Stores]:
    """Empty stores with the kit's schema: a SQLite file under ``tmp_path`` (``where``
    ``"sqlite"``), the test Redis or PostgreSQL (``"redis"``, ``"postgres"``, under a
    prefix or schema of their own), else memory."""
    if where in ("redis", "postgres"):
        opened = services.redis_stores() if where == "redis" else services.postgres_stores()
        async with opened as stores:
            yield stores
        return
    url = f"sqlite:///{tmp_path / 'adk.sqlite3'}" if where == "sqlite" else "memory://"
    async with open_stores(url) as stores:
        await stores.create_schema()
        yield stores


def answers(request: ModelRequest, name: str) -> list[Message]:
    """The tool results in ``request`` answering calls of the tool ``name``."""
    ids = {c.id for m in request.messages for c in m.tool_calls if c.name == name}
    return [m for m in request.messages if m.tool_call_id in ids]


def database_of(stores: Stores) -> SqliteDatabase:
    """The SQLite file the stores share."""
    database = stores.idempotency.database  # type: ignore[attr-defined]
    assert isinstance(database, SqliteDatabase)
    return database


def scripted(*turns: list[tuple[str, dict[str, Any]]]) -> list[Any]:
    """A script of ``turns`` (each its calls, 7 micros a model call), then ``done``."""
    return [*(ScriptedTurn(calls=calls, cost_micros=7) for calls in turns), "done"]


def statuses(path: str, run_id: str = "r") -> dict[str, str]:
    """call id -> status, as another connection (another process) sees the file now."""
    with contextlib.closing(sqlite3.connect(path)) as other:
        rows = other.execute(
            "SELECT call_id, status FROM adk_idempotency WHERE run_id = ? AND call_id IS NOT NULL",
            (run_id,),
        ).fetchall()
    return {str(c): str(s) for c, s in rows}
