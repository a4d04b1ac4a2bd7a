"""``show`` through ``frontier_main`` on in-memory stores: what a backend does not keep is
said, hostile ids are escaped, a run of another tenant is not shown."""

from __future__ import annotations

import asyncio
import io
import json

from booking import BOOK_TURNS, Airline, booking_agent
from tesserix_adk import AgentRunner, Checkpointer, ScriptedProvider
from tesserix_adk.cli import ExitCode, frontier_main
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.stores.memory.checkpoints import MemoryCheckpointStore
from tesserix_adk.stores.protocols import StoredCheckpoint
from tesserix_adk.stores.urls import open_stores

HOSTILE_RUN = "r\nrun forged\x1b[2J"


class LatestOnly:
    """A checkpoint store with the required methods only: no step snapshots."""

    def __init__(self) -> None:
        self._inner = MemoryCheckpointStore()

    async def put(
        self, tenant: str, run_id: str, payload: bytes, *, step: int, fence: int | None = None
    ) -> None:
        await self._inner.put(tenant, run_id, payload, step=step, fence=fence)

    async def latest(self, tenant: str, run_id: str) -> StoredCheckpoint | None:
        return await self._inner.latest(tenant, run_id)

    async def forget(self, tenant: str, run_id: str) -> None:
        await self._inner.forget(tenant, run_id)

    async def seal(self, tenant: str, run_id: str, fence: int) -> None:
        await self._inner.seal(tenant, run_id, fence)


def _run(stores: Stores, run_id: str) -> None:
    async def go() -> None:
        runner = AgentRunner(
            ScriptedProvider(BOOK_TURNS),
            idempotency=stores.idempotency,
            checkpoints=Checkpointer.from_stores(stores),
            leases=stores.leases,
            ledger=stores.ledger,
        )
        await runner.run(booking_agent(Airline()), "book", tenant="acme", run_id=run_id)

    asyncio.run(go())


def _show(stores: Stores, *argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = frontier_main(["show", *argv], stores=stores, out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def test_show_on_a_store_without_step_snapshots_says_so_and_shows_the_frontier() -> None:
    base = open_stores("memory://")
    stores = Stores(
        checkpoints=LatestOnly(),
        idempotency=base.idempotency,
        leases=base.leases,
        history=base.history,
        ledger=base.ledger,
        approvals=base.approvals,
    )
    _run(stores, "r")
    code, out, err = _show(stores, "r", "--tenant", "acme", "--json")
    assert code == ExitCode.CARRIED_ON, err
    told = json.loads(out)
    assert told["status"] == "completed" and [s["step"] for s in told["steps"]] == [told["step"]]
    assert any("LatestOnly keeps no step snapshots" in n for n in told["not_kept"])
    assert {c["tool"]: c["disposition"] for c in told["calls"]} == {
        "search_flights": "dispatched",
        "book_seat": "dispatched",
    }
    code, out, _ = _show(stores, "r", "--tenant", "acme")
    assert "not kept: the store LatestOnly keeps no step snapshots" in out


def test_show_escapes_hostile_ids_and_keeps_tenants_apart() -> None:
    stores = open_stores("memory://")
    _run(stores, HOSTILE_RUN)
    code, out, _ = _show(stores, HOSTILE_RUN, "--tenant", "acme")
    assert code == ExitCode.CARRIED_ON
    assert out.startswith("run r\\nrun forged\\x1b[2J  tenant acme")
    assert all(c.isprintable() for line in out.split("\n") for c in line)
    code, out, err = _show(stores, HOSTILE_RUN, "--tenant", "other")
    assert code == ExitCode.NOTHING_CHECKPOINTED and out == ""
    assert err.count("\n") == 1


def test_runs_json_gives_an_unreadable_run_the_same_fields_as_the_others() -> None:
    stores = open_stores("memory://")
    _run(stores, "good")
    asyncio.run(stores.checkpoints.put("acme", "bad", b"not a checkpoint", step=1))
    out = io.StringIO()
    assert frontier_main(["runs", "--tenant", "acme", "--json"], stores=stores, out=out) == 0
    rows = {r["run_id"]: r for r in json.loads(out.getvalue())["runs"]}
    assert rows["bad"]["status"] == "unreadable" and rows["bad"]["reason"]
    assert set(rows["bad"]) == set(rows["good"])
    text = io.StringIO()
    assert frontier_main(["runs", "--tenant", "acme"], stores=stores, out=text) == 0
    assert any(line.startswith("bad  unreadable: ") for line in text.getvalue().splitlines())
