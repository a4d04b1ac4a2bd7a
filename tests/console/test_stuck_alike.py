"""The console's "stuck" filter and `tesserix runs --stuck` keep the same runs: a run that
waits for a person (a failed run, a refused frontier, a call in doubt with nobody holding
the run) is found by either, as README says of both."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
from pathlib import Path
from typing import Any

from console_world import World, runner
from starlette.testclient import TestClient

from tesserix_adk import AgentRunner, LeasePolicy, ProviderError, ScriptedProvider, open_stores
from tesserix_adk.cli.main import main
from tesserix_adk.console.app import create_app
from tesserix_adk.console.reads import RunFilter, runs
from tesserix_adk.providers.base import ModelRequest, ModelResponse
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.testing.faults import SimulatedCrash

T = "acme"
CHARGE: list[Any] = [[("charge_card", {"amount": 12, "password": "hunter2"})], "Charged."]


class Refusing:
    """A model whose every answer is a non-retryable error: the run fails."""

    async def complete(self, request: ModelRequest) -> ModelResponse:
        raise ProviderError("the model refused the request", retryable=False)


async def _seed(stores: Stores, world: World) -> None:
    await stores.create_schema()
    agent = world.charger()
    await runner(stores, CHARGE).run(agent, "charge", tenant=T, run_id="r-done")
    await AgentRunner.from_stores(Refusing(), stores).run(
        agent, "charge", tenant=T, run_id="r-failed"
    )
    # A frontier over the size limit is refused and a tombstone written in its place.
    tiny = AgentRunner.from_stores(ScriptedProvider(list(CHARGE)), stores, max_bytes=300)
    with contextlib.suppress(Exception):
        await tiny.run(agent, "charge " * 100, tenant=T, run_id="r-refused")
    world.crash_charge = True
    short = AgentRunner.from_stores(
        ScriptedProvider(list(CHARGE)), stores, lease_policy=LeasePolicy(ttl=0.3, renew_within=0.1)
    )
    with contextlib.suppress(SimulatedCrash):
        await short.run(agent, "charge", tenant=T, run_id="r-in-doubt")
    await asyncio.sleep(0.4)  # its lease lapses: nobody holds the run


def _cli_stuck(url: str) -> set[str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["--store", url, "runs", "--tenant", T, "--stuck", "--json"])
    assert code == 0, err.getvalue()
    return {r["run_id"] for r in json.loads(out.getvalue())["runs"]}


def test_the_console_and_the_cli_keep_the_same_runs_as_stuck(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'adk.sqlite3'}"

    async def seed_and_read() -> set[str]:
        async with open_stores(url) as stores:
            await _seed(stores, World())
            statuses = {}
            for run_id in ("r-done", "r-failed", "r-refused", "r-in-doubt"):
                cp = await stores.checkpoints.latest(T, run_id)
                statuses[run_id] = cp is not None
            assert all(statuses.values()), statuses
            return {r.run_id for r in await runs(stores, T, RunFilter(stuck=True))}

    console = asyncio.run(seed_and_read())
    cli = _cli_stuck(url)
    # Each waits for a person: failed, refused (a tombstone), a charge in doubt.
    assert cli == {"r-failed", "r-refused", "r-in-doubt"}, cli
    assert console == cli


def test_the_runs_page_says_why_a_blocked_run_waits(tmp_path: Path) -> None:
    """The runs page's stuck list says why each blocked run waits, as the CLI's row does."""
    url = f"sqlite:///{tmp_path / 'adk.sqlite3'}"

    async def seed() -> None:
        async with open_stores(url) as stores:
            await _seed(stores, World())

    asyncio.run(seed())
    with TestClient(create_app(url), base_url="http://127.0.0.1") as client:
        page = client.get(f"/t/{T}/runs?stuck=1")
    assert page.status_code == 200, page.text
    assert "failed: ProviderError: the model refused the request" in page.text
    assert "refused frontier: a message of" in page.text
    assert "r-done" not in page.text
