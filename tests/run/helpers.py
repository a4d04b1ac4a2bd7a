"""Helpers the runner's tests share: frontier predicates, a provider that records, and
what a SQLite file holds as another process sees it."""

from __future__ import annotations

import contextlib
import sqlite3
from typing import Any

from tesserix_adk import Message, ModelRequest, ModelResponse, ScriptedTurn
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.stores.sqlite.database import SqliteDatabase

__all__ = ["Recording", "answers", "at", "database_of", "scripted", "statuses"]


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
