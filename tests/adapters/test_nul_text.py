"""A NUL character on every backend: PostgreSQL's ``text`` keeps none, so what would be one
there is refused or shown before a store sees it, and the same on SQLite and Redis.

- A tool's error text (a worker's reason for trying again or parking), an operator's note
  and name: kept, each NUL shown as ``\\x00`` where the store cannot keep it. Refused, a
  worker on PostgreSQL could neither park the run nor say why it waits.
- A tenant or run id holding NUL: ``ConfigurationError`` before anything is read or
  written, not the store's error (``StoreUnavailableError``, "retry later").
- A model's call id holding NUL is replaced as one holding a secret is, and a key a tool's
  key function makes holding NUL, or too long for PostgreSQL's index, is answered "not
  sent" (``tests/run/test_attacks_model_misbehaves.py``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from run.helpers import fresh_stores
from tesserix_adk import (
    Agent,
    AgentRunner,
    ConfigurationError,
    ModelRequest,
    ModelResponse,
    ScriptedProvider,
    ScriptedTurn,
    ToolCall,
    tool,
)
from tesserix_adk.stores.protocols import WorkState

BACKENDS = ["sqlite", pytest.param("redis", marks=pytest.mark.redis), "postgres"]
T = "acme"
KEPT = ("it broke\x00here", "it broke\\x00here")


@pytest.mark.parametrize("backend", BACKENDS)
async def test_a_reason_holding_nul_is_kept_when_a_run_waits_or_is_parked(
    backend: str, tmp_path: Path
) -> None:
    async with fresh_stores(backend, tmp_path) as stores:
        work = stores.work
        assert work is not None
        await work.submit(T, "r", agent="a", input=b"{}")
        await work.want(T, "r", agent="a", state=WorkState.wanted, reason="it broke\x00here")
        wanted = await work.entry(T, "r")
        assert wanted is not None and wanted.reason in KEPT
        await work.park(T, "r", agent="a", reason="it broke\x00here")
        parked = await work.entry(T, "r")
        assert parked is not None
        assert parked.state is WorkState.parked and parked.reason in KEPT


@pytest.mark.parametrize("backend", BACKENDS)
async def test_an_operators_note_and_name_holding_nul_are_kept(
    backend: str, tmp_path: Path
) -> None:
    call = ToolCall(id="c1", name="book", arguments={"flight": "LH1"})
    async with fresh_stores(backend, tmp_path) as stores:
        request = await stores.approvals.request(T, "r", [call], iteration=1)
        decided = await stores.approvals.decide(
            T, request.id, approved=True, by="on\x00call", note="it broke\x00here"
        )
        assert decided.note in KEPT and decided.by in ("on\x00call", "on\\x00call")
        key = "acme/order-5"
        await stores.idempotency.claim(
            key,
            holder="w",
            tenant=T,
            run_id="r",
            iteration=1,
            tool="book",
            call_id="c1",
            flags=None,
        )
        record = await stores.idempotency.resolve(key, b"{}", tenant=T, by="on\x00call")
        assert record.by in ("on\x00call", "on\\x00call")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("tenant", "run_id"), [("ac\x00me", "r"), (T, "r\x00")])
async def test_an_id_holding_nul_is_refused_as_configuration_before_anything_is_written(
    backend: str, tmp_path: Path, tenant: str, run_id: str
) -> None:
    @tool
    def book(flight: str) -> str:
        """Book a seat."""
        return flight

    model = Counting([ScriptedTurn(calls=[("book", {"flight": "LH1"})]), "done"])
    async with fresh_stores(backend, tmp_path) as stores:
        runner = AgentRunner.from_stores(model, stores)
        with pytest.raises(ConfigurationError, match="NUL"):
            await runner.run(Agent("a", "Book.", [book]), "go", tenant=tenant, run_id=run_id)
        assert model.asked == 0


class Counting(ScriptedProvider):
    asked = 0

    async def complete(self, request: ModelRequest) -> ModelResponse:
        self.asked += 1
        return await super().complete(request)
