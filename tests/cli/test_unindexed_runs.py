"""A run no worker will ever find: mid-run, nobody holding it, and no entry in the work
index (the entry was lost, or a runner without a work index ran it). Workers find runs
only through the index, so such a run waits for a person: ``tesserix runs --stuck`` and
the console's stuck filter list it and say what to do, and carrying it on by hand
(``resume``) puts the entry back, so that workers carry it on from then.

The backends' own ways of losing an entry (an evicting Redis, a row deleted by hand) are
attacked in ``tests/adapters/test_attacks_redis_forgets.py`` and
``test_attacks_postgres_forgets.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
from pathlib import Path
from typing import Any

import pytest

from processes import BACKENDS, store_url
from run.helpers import at, faulty_runner
from tesserix_adk import (
    Agent,
    AgentRunner,
    LeasePolicy,
    ScriptedProvider,
    ScriptedTurn,
    Worker,
    tool,
)
from tesserix_adk.checkpoint.checkpointer import Checkpointer
from tesserix_adk.cli.main import main
from tesserix_adk.console.reads import RunFilter, runs
from tesserix_adk.errors import RunStoppedError
from tesserix_adk.stores import open_stores
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.testing.faults import SimulatedCrash

T = "acme"
SHORT = LeasePolicy(ttl=0.3, renew_within=0.1)


def _booking(sent: list[str]) -> tuple[Agent, list[Any]]:
    @tool
    def book(seat: str) -> str:
        sent.append(seat)
        return f"booked {seat}"

    script: list[Any] = [
        ScriptedTurn(calls=[("book", {"seat": "1"})]),
        ScriptedTurn(calls=[("book", {"seat": "2"})]),
        "done",
    ]
    return Agent("g", "book", tools=[book]), script


async def _died(stores: Stores, sent: list[str], *, indexed: bool) -> None:
    """Run ``r`` books seat 1 and dies before its next frontier; its lease lapses."""
    agent, script = _booking(sent)
    runner = faulty_runner(
        stores,
        ScriptedProvider(script),
        crash_before=at("after_tool_result", 0),
        lease_policy=SHORT,
    )
    if not indexed:
        runner.work = None  # a runner composed without the work index
    with pytest.raises(SimulatedCrash):
        await runner.run(agent, "go", tenant=T, run_id="r")
    await asyncio.sleep(SHORT.ttl + 0.2)


def _stuck(url: str) -> dict[str, Any]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["--store", url, "runs", "--tenant", T, "--stuck", "--json"])
    assert code == 0, err.getvalue()
    return {r["run_id"]: r for r in json.loads(out.getvalue())["runs"]}


def _inspect(url: str) -> str:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["--store", url, "inspect", "r", "--tenant", T])
    assert code == 0, err.getvalue()
    return out.getvalue()


async def _worker_pass(stores: Stores, sent: list[str]) -> None:
    agent, script = _booking(sent)
    runner = AgentRunner.from_stores(ScriptedProvider(script), stores)
    worker = Worker(runner, [agent], exit_when_idle=True, poll_interval=0.05)
    await asyncio.wait_for(worker.run(), timeout=20)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_run_missing_from_the_work_index_is_stuck_until_a_resume_puts_it_back(
    backend: str, tmp_path: Path
) -> None:
    sent: list[str] = []

    async def setup() -> str:
        async with store_url(backend, tmp_path) as url:
            async with open_stores(url) as stores:
                await stores.create_schema()
                await _died(stores, sent, indexed=False)
                assert await stores.work.entry(T, "r") is None
                # No worker finds it: that is why it must be listed.
                await _worker_pass(stores, sent)
                assert sent == ["1"]
                console = {s.run_id: s for s in await runs(stores, T, RunFilter(stuck=True))}
            listed = await asyncio.to_thread(_stuck, url)
            assert set(listed) == {"r"} == set(console), (listed, console)
            assert "work index" in listed["r"]["blocked"], listed
            assert "--resume" in listed["r"]["blocked"], listed
            assert console["r"].blocked == listed["r"]["blocked"]
            said = await asyncio.to_thread(_inspect, url)
            assert listed["r"]["blocked"] in said, said

            async with open_stores(url) as stores:
                # Carried on by hand and stopped (a drain) after seat 2: the entry is back,
                # so a worker now carries the run to its end by itself, seat 2 booked once.
                agent, script = _booking(sent)
                again = AgentRunner.from_stores(ScriptedProvider(script), stores)
                with pytest.raises(RunStoppedError):
                    await again.resume(
                        agent, "r", tenant=T, stop=lambda: "drain" if len(sent) > 1 else None
                    )
                assert sent == ["1", "2"]
                assert await stores.work.entry(T, "r") is not None
                await _worker_pass(stores, sent)
                cp = await Checkpointer.from_stores(stores).latest(T, "r")
                assert cp is not None
            assert await asyncio.to_thread(_stuck, url) == {}
            return str(cp.status) if cp is not None else ""

    assert asyncio.run(setup()) == "completed"
    assert sent == ["1", "2"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_run_in_the_work_index_is_not_listed_as_missing(backend: str, tmp_path: Path) -> None:
    """The same death with the index kept: a worker finds the run, nothing is stuck."""
    sent: list[str] = []

    async def setup() -> dict[str, Any]:
        async with store_url(backend, tmp_path) as url:
            async with open_stores(url) as stores:
                await stores.create_schema()
                await _died(stores, sent, indexed=True)
            before = await asyncio.to_thread(_stuck, url)
            assert "work index" not in await asyncio.to_thread(_inspect, url)
            async with open_stores(url) as stores:
                await _worker_pass(stores, sent)
            return before

    assert asyncio.run(setup()) == {}
    assert sent == ["1", "2"]
