"""Attacks on what operators see of runs no worker will find (e58264a): ``tesserix runs
--stuck``, the console's stuck filter and ``tesserix inspect`` list a running run nobody
holds whose work index entry is gone, saying ``run --resume`` puts it back. On SQLite,
Redis and PostgreSQL: false alarms (healthy runs listed as missing from the index), misses
(runs no worker finds that are not listed), and whether ``resume``, ``approve`` and
``cancel`` handle a run with no entry, each side-effecting call made once.

Held: a finished run, a run waiting on a person and a run of another tenant under the same
id are never said to be missing from the index, and a lost entry is named for its own
tenant only; an entry lost while a run waits for approval is put back by ``tesserix
approve``, and a worker then sends the approved call once; ``tesserix cancel`` of a run with
no entry ends it (exit 0) and nothing is listed or sent after; a worker racing a ``resume``
that puts the entry back books each seat once and finishes the run.

Found, and fixed (their tests pass now):
- MEDIUM: an entry in the wrong state (``done`` while the run is running and unheld, as an
  index restored from an older copy leaves it) hid the run from every worker, yet nothing
  listed it: an entry in any state counted as "indexed". Now ``done`` counts as nothing a
  worker takes (``TenantEntries.taken_by_no_worker``, ``cli/reasons.lost_to_workers``).
- MEDIUM: a run whose approval was decided and whose entry was lost afterwards was never
  carried on by a worker and never listed: only a ``running`` frontier was looked at. A
  ``waiting_approval`` run whose request is decided counts too.
- LOW: the stuck listing read the index once, before each run's frontier and lease, so a
  run whose entry a ``resume`` put back in between was said to be missing. A run about to
  be flagged has its entry read again.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sqlite3
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import psycopg
import pytest
from redis.asyncio import Redis

from operator_cli import cli
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
from tesserix_adk.console import reads
from tesserix_adk.console.reads import RunFilter, runs
from tesserix_adk.errors import RunStoppedError
from tesserix_adk.stores import open_stores
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.testing.faults import SimulatedCrash

T = "acme"
SHORT = LeasePolicy(ttl=0.3, renew_within=0.1)


def _booking(sent: list[str], *, approval: bool = False) -> tuple[Agent, list[Any]]:
    @tool(requires_approval=approval)
    def book(seat: str) -> str:
        sent.append(seat)
        return f"booked {seat}"

    if approval:
        return Agent("g", "book", tools=[book]), [
            ScriptedTurn(calls=[("book", {"seat": "1"})]),
            "done",
        ]
    script: list[Any] = [
        ScriptedTurn(calls=[("book", {"seat": "1"})]),
        ScriptedTurn(calls=[("book", {"seat": "2"})]),
        "done",
    ]
    return Agent("g", "book", tools=[book]), script


async def _died(stores: Stores, sent: list[str], *, tenant: str = T) -> None:
    """Run ``r`` of ``tenant`` books seat 1 and dies before its next frontier; its lease
    lapses. Its work index entry is kept (``wanted``)."""
    agent, script = _booking(sent)
    runner = faulty_runner(
        stores,
        ScriptedProvider(script),
        crash_before=at("after_tool_result", 0),
        lease_policy=SHORT,
    )
    with pytest.raises(SimulatedCrash):
        await runner.run(agent, "go", tenant=tenant, run_id="r")
    await asyncio.sleep(SHORT.ttl + 0.2)


async def _lose(backend: str, url: str, run_id: str = "r", tenant: str = T) -> None:
    """The run's work index entry is lost as each backend loses one: a row deleted by
    hand, an evicted Redis hash."""
    if backend == "sqlite":
        path = url.removeprefix("sqlite:///")

        def delete() -> int:
            with contextlib.closing(sqlite3.connect(path)) as conn, conn:
                sql = "DELETE FROM adk_work WHERE tenant = ? AND run_id = ?"
                return conn.execute(sql, (tenant, run_id)).rowcount

        assert await asyncio.to_thread(delete) == 1
    elif backend == "postgres":
        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
            cur = await conn.execute(
                "DELETE FROM adk_work WHERE tenant = %s AND run_id = %s", (tenant, run_id)
            )
            assert cur.rowcount == 1
    else:
        prefix = parse_qs(urlsplit(url).query)["prefix"][0]
        client = Redis.from_url(url.split("?", 1)[0])
        try:
            assert await client.unlink(f"{prefix}{{{tenant}:{run_id}}}:work") == 1
        finally:
            await client.aclose()


def _stuck(url: str, tenant: str = T) -> dict[str, Any]:
    code, out, err = cli("--store", url, "runs", "--tenant", tenant, "--stuck", "--json")
    assert code == 0, err
    return {r["run_id"]: r for r in json.loads(out)["runs"]}


async def _console_stuck(stores: Stores, tenant: str = T) -> dict[str, Any]:
    return {s.run_id: s for s in await runs(stores, tenant, RunFilter(stuck=True))}


async def _worker_pass(stores: Stores, sent: list[str], *, approval: bool = False) -> None:
    agent, script = _booking(sent, approval=approval)
    runner = AgentRunner.from_stores(ScriptedProvider(script), stores)
    worker = Worker(runner, [agent], exit_when_idle=True, poll_interval=0.05)
    await asyncio.wait_for(worker.run(), timeout=20)


async def _status(stores: Stores, run_id: str = "r", tenant: str = T) -> str:
    cp = await Checkpointer.from_stores(stores).latest(tenant, run_id)
    assert cp is not None
    return str(cp.status)


# --- false alarms ----------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_healthy_runs_are_never_said_to_be_missing_and_a_lost_entry_is_its_tenants_only(
    backend: str, tmp_path: Path
) -> None:
    """A finished run whose entry is lost, a run waiting on a person whose entry is lost,
    and another tenant's run under the same id are not "missing from the index"; the
    lost one of ``acme`` is, in ``acme`` only."""
    sent: list[str] = []

    async def scenario() -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
        async with store_url(backend, tmp_path) as url:
            async with open_stores(url) as stores:
                await stores.create_schema()
                # acme/r dies and loses its entry; rival/r dies and keeps its own.
                await _died(stores, sent)
                await _died(stores, sent, tenant="rival")
                await _lose(backend, url)
                # acme/done finishes, then loses its entry.
                agent, script = _booking(sent)
                runner = AgentRunner.from_stores(ScriptedProvider(script), stores)
                await runner.run(agent, "go", tenant=T, run_id="done")
                await _lose(backend, url, "done")
                # acme/wait waits on an approval, then loses its entry.
                agent, script = _booking([], approval=True)
                runner = AgentRunner.from_stores(ScriptedProvider(script), stores)
                await runner.run(agent, "go", tenant=T, run_id="wait")
                await _lose(backend, url, "wait")
                console = await _console_stuck(stores)
                console_rival = await _console_stuck(stores, "rival")
            return (
                await asyncio.to_thread(_stuck, url),
                await asyncio.to_thread(_stuck, url, "rival"),
                {"console": console, "rival": console_rival},
            )

    acme, rival, console = asyncio.run(scenario())
    assert set(acme) == {"r"} == set(console["console"]), (acme, console)
    assert "work index" in acme["r"]["blocked"]
    assert rival == {} == console["rival"], (rival, console)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_run_resumed_while_the_listing_reads_is_not_said_to_be_missing(
    backend: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sent: list[str] = []

    async def scenario() -> dict[str, Any]:
        async with store_url(backend, tmp_path) as url, open_stores(url) as stores:
            await stores.create_schema()
            await _died(stores, sent)
            await _lose(backend, url)
            real = reads.tenant_entries

            async def then_resumed(*args: Any) -> Any:
                read = await real(*args)
                # Right after the index was read, an operator's resume puts the entry
                # back and is stopped (a drain) before the run ends.
                agent, script = _booking(sent)
                again = AgentRunner.from_stores(ScriptedProvider(script), stores)
                with pytest.raises(RunStoppedError):
                    await again.resume(
                        agent, "r", tenant=T, stop=lambda: "drain" if len(sent) > 1 else None
                    )
                return read

            monkeypatch.setattr(reads, "tenant_entries", then_resumed)
            listed = await _console_stuck(stores)
            assert await stores.work.entry(T, "r") is not None
            assert await _status(stores) == "running"
            return listed

    listed = asyncio.run(scenario())
    assert sent == ["1", "2"]
    # Indexed, unheld and running: a worker finds it; nothing waits for a person.
    assert "r" not in listed, listed["r"].blocked


# --- misses ----------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_running_run_whose_entry_says_done_is_listed_as_no_worker_finds_it(
    backend: str, tmp_path: Path
) -> None:
    sent: list[str] = []

    async def scenario() -> tuple[dict[str, Any], dict[str, Any]]:
        async with store_url(backend, tmp_path) as url:
            async with open_stores(url) as stores:
                await stores.create_schema()
                await _died(stores, sent)
                # The entry reads "done" (an older copy of the index restored, a paused
                # holder's late word) while the frontier is running and nobody holds it.
                await stores.work.done(T, "r")
                await _worker_pass(stores, sent)
                assert sent == ["1"], "a worker carried it on after all"
                assert await _status(stores) == "running"
                console = await _console_stuck(stores)
            return await asyncio.to_thread(_stuck, url), console

    listed, console = asyncio.run(scenario())
    assert "r" in listed and "r" in console, (listed, console)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_decided_run_whose_entry_is_lost_after_the_wake_is_carried_on_or_listed(
    backend: str, tmp_path: Path
) -> None:
    sent: list[str] = []

    async def scenario() -> tuple[dict[str, Any], dict[str, Any]]:
        async with store_url(backend, tmp_path) as url:
            async with open_stores(url) as stores:
                await stores.create_schema()
                agent, script = _booking(sent, approval=True)
                runner = AgentRunner.from_stores(ScriptedProvider(script), stores)
                waiting = await runner.run(agent, "go", tenant=T, run_id="r")
                assert waiting.pending_approval is not None
                request = waiting.pending_approval.id
            code, _, err = await asyncio.to_thread(
                cli, "--store", url, "approve", request, "--tenant", T, "--by", "ops"
            )
            assert code == 0, err
            async with open_stores(url) as stores:
                assert await stores.work.entry(T, "r") is not None  # woken
                await _lose(backend, url)
                await _worker_pass(stores, sent, approval=True)
                console = await _console_stuck(stores)
            return await asyncio.to_thread(_stuck, url), console

    listed, console = asyncio.run(scenario())
    assert sent == ["1"] or ("r" in listed and "r" in console), (sent, listed, console)


# --- putting the entry back ------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_entry_lost_while_waiting_is_put_back_by_approve_and_the_call_sent_once(
    backend: str, tmp_path: Path
) -> None:
    sent: list[str] = []

    async def scenario() -> tuple[str, dict[str, Any]]:
        async with store_url(backend, tmp_path) as url:
            async with open_stores(url) as stores:
                await stores.create_schema()
                agent, script = _booking(sent, approval=True)
                runner = AgentRunner.from_stores(ScriptedProvider(script), stores)
                waiting = await runner.run(agent, "go", tenant=T, run_id="r")
                assert waiting.pending_approval is not None
                await _lose(backend, url)
                assert await _console_stuck(stores) == {}  # it waits on a person
            code, out, err = await asyncio.to_thread(
                cli,
                "--store",
                url,
                "approve",
                waiting.pending_approval.id,
                "--tenant",
                T,
                "--by",
                "ops",
            )
            assert code == 0, (out, err)
            async with open_stores(url) as stores:
                await _worker_pass(stores, sent, approval=True)
                await _worker_pass(stores, sent, approval=True)
                status = await _status(stores)
            return status, await asyncio.to_thread(_stuck, url)

    status, listed = asyncio.run(scenario())
    assert (status, listed, sent) == ("completed", {}, ["1"])


@pytest.mark.parametrize("backend", BACKENDS)
def test_cancel_of_a_run_with_no_entry_ends_it_in_one_go(backend: str, tmp_path: Path) -> None:
    sent: list[str] = []

    async def scenario() -> tuple[int, str, str, str, dict[str, Any]]:
        async with store_url(backend, tmp_path) as url:
            async with open_stores(url) as stores:
                await stores.create_schema()
                await _died(stores, sent)
                await _lose(backend, url)
            code, out, err = await asyncio.to_thread(
                cli, "--store", url, "cancel", "r", "--tenant", T, "--by", "ops"
            )
            async with open_stores(url) as stores:
                await _worker_pass(stores, sent)
                status = await _status(stores)
            return code, out, err, status, await asyncio.to_thread(_stuck, url)

    code, out, err, status, listed = asyncio.run(scenario())
    assert code == 0, (out, err)
    assert "Traceback" not in err
    assert (status, listed, sent) == ("cancelled", {}, ["1"])


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_worker_racing_the_resume_that_puts_the_entry_back_books_each_seat_once(
    backend: str, tmp_path: Path
) -> None:
    sent: list[str] = []

    async def scenario() -> str:
        async with store_url(backend, tmp_path) as url, open_stores(url) as stores:
            await stores.create_schema()
            await _died(stores, sent)
            await _lose(backend, url)
            agent, script = _booking(sent)
            worker_runner = AgentRunner.from_stores(
                ScriptedProvider(script), stores, lease_policy=SHORT
            )
            worker = Worker(worker_runner, [agent], poll_interval=0.02)
            polling = asyncio.create_task(worker.run())
            try:
                other, other_script = _booking(sent)
                again = AgentRunner.from_stores(ScriptedProvider(other_script), stores)
                # Stopped right after seat 2: the worker, polling all along, takes the
                # entry the resume put back and carries the run to its end.
                with pytest.raises(RunStoppedError):
                    await again.resume(
                        other, "r", tenant=T, stop=lambda: "drain" if len(sent) > 1 else None
                    )
                for _ in range(400):
                    if await _status(stores) == "completed":
                        break
                    await asyncio.sleep(0.025)
            finally:
                worker.drain()
                await asyncio.wait_for(polling, timeout=20)
            return await _status(stores)

    assert asyncio.run(scenario()) == "completed"
    assert sent == ["1", "2"]
