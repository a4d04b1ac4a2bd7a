"""What the replay attack files share: a SQLite store in a test's folder, a runner on a
script, a stubbed booking, and the step that holds a tool's call."""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from booking import BOOK_TURNS
from tesserix_adk import AgentRunner, ScriptedProvider
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.stores.urls import open_stores

__all__ = ["TOKEN", "fresh", "new_id", "sqlite", "step_with", "stub_booking"]

TOKEN = "ghp_" + "a1B2c3D4e5F6g7H8i9J0k1L2m3N4o5P6q7R8"


def new_id(prefix: str = "r") -> str:
    """A run id no earlier run of the test holds."""
    return f"{prefix}-{secrets.token_hex(4)}"


@contextlib.asynccontextmanager
async def sqlite(tmp_path: Path) -> AsyncIterator[Stores]:
    """Stores on a SQLite file in ``tmp_path``, schema applied."""
    async with open_stores(f"sqlite:///{tmp_path / 'adk.sqlite3'}") as stores:
        await stores.create_schema()
        yield stores


def fresh(stores: Stores, turns: Any = BOOK_TURNS, **kw: Any) -> AgentRunner:
    """A runner on ``stores`` whose model answers ``turns``."""
    return AgentRunner.from_stores(ScriptedProvider(turns), stores, **kw)


def stub_booking(flight: str) -> dict[str, str]:
    """The stub a replay books with: nothing leaves the process."""
    return {"booking": "STUB", "flight": flight}


async def step_with(stores: Stores, run_id: str, tool_name: str, tenant: str = "t") -> int:
    """The first step whose frontier holds a call of ``tool_name``."""
    checkpoints = fresh(stores).checkpoints
    assert checkpoints is not None
    for step in await stores.checkpoints.steps(tenant, run_id):
        cp = await checkpoints.at(tenant, run_id, step)
        if cp is not None and any(oc.call.name == tool_name for oc in cp.outstanding):
            return step
    raise AssertionError(f"no step holds {tool_name}")
