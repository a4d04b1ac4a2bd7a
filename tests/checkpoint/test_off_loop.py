"""Large payloads are redacted off the event loop; errors the kit keeps carry no secret."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from pydantic import BaseModel, field_validator

from tesserix_adk import (
    Agent,
    AgentRunner,
    Checkpointer,
    MemoryCheckpointStore,
    MemoryHistoryStore,
    MemoryIdempotencyStore,
    ScriptedProvider,
    tool,
)
from tesserix_adk.checkpoint.redaction import Redactor
from tesserix_adk.errors import ConfigurationError

SECRET = "sk-proj-" + "Zx9Yw8Vu7Ts6Rq5Po4Nm" * 2


class _Watching:
    """A redactor that notes the threads it ran on."""

    def __init__(self) -> None:
        self.inner = Redactor()
        self.threads: set[threading.Thread] = set()

    def __getattr__(self, name: str) -> Any:
        self.threads.add(threading.current_thread())
        return getattr(self.inner, name)


async def test_a_large_frontier_is_redacted_in_a_worker_thread() -> None:
    @tool(side_effects=False)
    def fetch(url: str) -> str:
        """Fetch a page."""
        return "http://x/ " + "a." * 40_000

    agent = Agent("reader", "Read.", [fetch])
    checkpointer = Checkpointer(MemoryCheckpointStore(), history=MemoryHistoryStore())
    watching = _Watching()
    checkpointer.redactor = watching  # type: ignore[assignment]
    turns: list[Any] = [[("fetch", {"url": "http://x/"})], "read"]
    runner = AgentRunner(
        ScriptedProvider(turns), idempotency=MemoryIdempotencyStore(), checkpoints=checkpointer
    )
    await runner.run(agent, "read it", tenant="acme", run_id="r")
    assert checkpointer.last_error is None
    assert any(t is not threading.main_thread() for t in watching.threads)


class Session(BaseModel):
    api_key: str

    @field_validator("api_key")
    @classmethod
    def short(cls, value: str) -> str:
        if len(value) > 10:
            raise ValueError(f"api_key {value} is too long")
        return value


async def test_an_invalid_states_error_is_kept_and_logged_without_its_secret(
    caplog: Any,
) -> None:
    agent = Agent("s", "Say hi.", [], state_schema=Session)
    checkpointer = Checkpointer(MemoryCheckpointStore())
    runner = AgentRunner(
        ScriptedProvider(["hi"]), idempotency=MemoryIdempotencyStore(), checkpoints=checkpointer
    )
    state = Session.model_construct(api_key=SECRET)
    # Refused before it starts now (it used to run with no frontier kept), its error still
    # without the secret the validation error quotes.
    with pytest.raises(ConfigurationError) as refused:
        await runner.run(agent, "hi", tenant="acme", run_id="r", state=state)
    assert "does not validate" in str(refused.value)
    assert SECRET not in str(refused.value)
    assert SECRET not in caplog.text
