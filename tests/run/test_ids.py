"""The one rule for ids (``run/ids``): what a run id, a tenant or a worker name may be, asked
before anything is read or written, so that no store is handed a name it cannot keep."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tesserix_adk import AgentRunner, ScriptedProvider, open_stores
from tesserix_adk.errors import ConfigurationError, NoCheckpointError
from tesserix_adk.resumer import Resumer
from tesserix_adk.run.ids import MAX_ID_BYTES

_UNKEEPABLE = {
    "empty": "",
    "lone-surrogate": "w\udcff",
    "nul": "w\x00x",
    "too-long": "w" * (MAX_ID_BYTES + 1),
}


@pytest.mark.parametrize("worker", list(_UNKEEPABLE.values()), ids=list(_UNKEEPABLE))
def test_a_runner_refuses_a_worker_name_no_store_can_keep(worker: str) -> None:
    with pytest.raises(ConfigurationError, match="worker"):
        AgentRunner(ScriptedProvider(["ok"]), idempotency=object(), worker=worker)  # type: ignore[arg-type]


@pytest.mark.parametrize("worker", list(_UNKEEPABLE.values()), ids=list(_UNKEEPABLE))
async def test_a_resumer_refuses_a_worker_name_before_it_takes_a_lease(
    worker: str, tmp_path: Path
) -> None:
    async with open_stores(f"sqlite:///{tmp_path / 'adk.sqlite3'}") as stores:
        await stores.create_schema()
        with pytest.raises(ConfigurationError, match="worker"):
            await Resumer.from_stores(stores).resume("r1", tenant="acme", worker=worker)
        assert stores.leases is not None
        # Nothing was taken: the next worker's lease is the run's first.
        lease = await stores.leases.acquire("acme", "r1", holder="next", ttl=5.0)
        assert lease.fence == 1


def test_a_default_and_an_ordinary_worker_name_are_kept() -> None:
    assert AgentRunner(ScriptedProvider(["ok"]), idempotency=object()).worker == "worker"  # type: ignore[arg-type]
    named = AgentRunner(ScriptedProvider(["ok"]), idempotency=object(), worker="w-1 ☃")  # type: ignore[arg-type]
    assert named.worker == "w-1 ☃"


async def test_a_worker_name_holding_a_key_is_kept_masked(tmp_path: Path) -> None:
    key = "sk-proj-" + "Zz9yXw8vUt7sRq6pOn5mLk4jIh3gFe2dCb1aZz9yXw8v"
    async with open_stores(f"sqlite:///{tmp_path / 'adk.sqlite3'}") as stores:
        await stores.create_schema()
        runner = AgentRunner.from_stores(ScriptedProvider(["ok"]), stores, worker=f"w {key}")
        assert key not in runner.worker and runner.worker.startswith("w [redacted:")
        assert stores.leases is not None
        holders: list[str] = []
        acquire = stores.leases.acquire

        async def noted(tenant: str, run_id: str, holder: str, ttl: float) -> Any:
            holders.append(holder)
            return await acquire(tenant, run_id, holder, ttl)

        stores.leases.acquire = noted  # type: ignore[method-assign]
        with pytest.raises(NoCheckpointError):
            await Resumer.from_stores(stores).resume("r1", tenant="acme", worker=key)
        assert holders and all(key not in h and h.startswith("[redacted:") for h in holders)
