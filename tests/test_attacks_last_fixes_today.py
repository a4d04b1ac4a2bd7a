"""An attack on the last fixes (b1ce55b, 8e645d2, a248215): ``runs --stuck`` counting only
calls a resume cannot send again (``cli.reasons.open_calls``), the console's escaping of
characters that reorder or hide text (``console.templates._text``), and
``tesserix.lease.takeovers`` counted after a worker's resume (``Worker._took_over``).

Real SQLite files, the real ``tesserix`` command in this process, the console served by
uvicorn, the real OpenTelemetry SDK; no mock of a store. A process death is the kit's own
``SimulatedCrash`` raised inside a tool (the run's holder stops there, its lease lapses).
"""

from __future__ import annotations

import asyncio
import contextlib
import html
import json
import re
import sqlite3
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from otel_spans.world import Pipeline
from tesserix_adk import (
    Agent,
    AgentRunner,
    Backoff,
    LeasePolicy,
    ScriptedProvider,
    Worker,
    open_stores,
    tool,
)
from tesserix_adk.console import create_app
from tesserix_adk.stores.protocols import WorkState
from tesserix_adk.testing.faults import SimulatedCrash
from test_attacks_lifecycle_oracle import cli

sys.path.insert(0, str(Path(__file__).parent / "console"))
from console_world import served

T = "acme-last-fixes-today"
SECRET = "sk-live-PLANTEDlastF1xesT0day0123456789ab"
POLICY = LeasePolicy(ttl=0.3, renew_within=0.15)


def _url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'adk.sqlite3'}"


def _docs_agent(crash: list[bool], *, idempotent: bool = True) -> Agent:
    @tool(idempotent=idempotent)
    def put_doc(body: str) -> str:
        """Store a document under its key (the store deduplicates)."""
        if crash[0]:
            crash[0] = False
            raise SimulatedCrash("the process died with the call in flight")
        return "stored"

    return Agent("docs", "Store documents.", [put_doc])


async def _died_in_flight(url: str, run_id: str, body: str, agent: Agent) -> None:
    """``run_id`` dies with its ``put_doc`` call in flight; its lease lapses."""
    async with open_stores(url) as stores:
        await stores.create_schema()
        runner = AgentRunner.from_stores(
            ScriptedProvider([[("put_doc", {"body": body})], "Stored."]),
            stores,
            lease_policy=POLICY,
        )
        with contextlib.suppress(SimulatedCrash):
            await runner.run(agent, "store it", tenant=T, run_id=run_id)
    await asyncio.sleep(0.6)


def _stuck(url: str) -> list[str]:
    code, out, err = cli(url, "runs", "--tenant", T, "--stuck", "--json")
    assert code == 0, err
    return [r["run_id"] for r in json.loads(out)["runs"]]


def _safe(url: str, run_id: str) -> bool:
    code, out, err = cli(url, "inspect", run_id, "--tenant", T, "--json")
    assert code == 0, err
    safe: bool = json.loads(out)["safe"]
    return safe


async def _worker_pass(url: str, agent: Agent, turns: list[Any]) -> list[tuple[str, str]]:
    async with open_stores(url) as stores:
        worker = Worker(
            AgentRunner.from_stores(ScriptedProvider(turns), stores, lease_policy=POLICY),
            [agent],
            exit_when_idle=True,
            poll_interval=0.01,
        )
        await asyncio.wait_for(worker.run(), 30)
        return [(i.run_id, how.value) for i, how in worker.carried]


# --- runs --stuck and cli.reasons.open_calls -------------------------------------------------


async def test_an_idempotent_call_in_flight_is_not_stuck_and_a_worker_carries_it_on(
    tmp_path: Path,
) -> None:
    url, crash = _url(tmp_path), [True]
    agent = _docs_agent(crash)
    await _died_in_flight(url, "r-plain", "plain text", agent)
    assert _stuck(url) == []
    assert _safe(url, "r-plain") is True
    carried = await _worker_pass(url, agent, [[("put_doc", {"body": "plain text"})], "Stored."])
    assert carried == [("r-plain", "finished")]


async def test_stuck_lists_an_unheld_run_whose_idempotent_call_in_flight_was_redacted(
    tmp_path: Path,
) -> None:
    url, crash = _url(tmp_path), [True]
    agent = _docs_agent(crash)
    await _died_in_flight(url, "r-masked", f"the key is {SECRET}", agent)
    # A resume cannot send it again (its arguments are masked): indeterminate.
    assert _safe(url, "r-masked") is False
    listed_before_a_worker = _stuck(url)
    # What a worker does with it: parks it, for a person (so the operator must act).
    carried = await _worker_pass(url, agent, ["Stored."])
    assert carried == [("r-masked", "parked")]
    assert _stuck(url) == ["r-masked"]
    # The same run, in the same need of a person, before a worker met it.
    assert listed_before_a_worker == ["r-masked"]


async def test_stuck_leaves_out_a_flagless_record_the_resume_sends_again(tmp_path: Path) -> None:
    url, crash = _url(tmp_path), [True]
    agent = _docs_agent(crash)
    await _died_in_flight(url, "r-old", "plain text", agent)
    db = sqlite3.connect(tmp_path / "adk.sqlite3")
    with db:
        db.execute(
            "UPDATE adk_idempotency SET side_effects = NULL, idempotent = NULL "
            "WHERE tenant = ? AND tool = 'put_doc'",
            (T,),
        )
    db.close()
    assert _safe(url, "r-old") is True  # the resume would send it again
    carried_by_a_worker = ["r-old"]
    assert _stuck(url) == []  # so nobody need act
    assert await _worker_pass(url, agent, [[("put_doc", {"body": "plain text"})], "Stored."]) == [
        (carried_by_a_worker[0], "finished")
    ]


async def test_a_non_idempotent_call_in_flight_is_stuck_until_resolved(tmp_path: Path) -> None:
    url, crash = _url(tmp_path), [True]
    agent = _docs_agent(crash, idempotent=False)
    await _died_in_flight(url, "r-charge", "plain text", agent)
    assert _stuck(url) == ["r-charge"]
    assert _safe(url, "r-charge") is False


# --- the console's escaping of invisible and reordering characters ---------------------------

INVISIBLE = {
    "zero width space": "\u200b",
    "byte order mark": "\ufeff",
    "line separator": "\u2028",
    "soft hyphen": "\u00ad",
    "word joiner": "\u2060",
}


async def _two_runs_alike(url: str, hidden: str) -> None:
    async with open_stores(url) as stores:
        await stores.create_schema()
        for run_id in ("inv-7", f"inv{hidden}-7"):
            runner = AgentRunner.from_stores(ScriptedProvider(["Done."]), stores)
            await runner.run(Agent("desk", "Answer.", []), "hi", tenant=T, run_id=run_id)


def _shown(page: str) -> str:
    """The page's text as a person reads it: tags dropped, entities decoded."""
    return html.unescape(re.sub(r"<[^>]+>", " ", page))


@pytest.mark.parametrize("name", sorted(INVISIBLE))
async def test_the_console_runs_page_tells_apart_run_ids_that_differ_by_an_invisible_character(
    tmp_path: Path, name: str
) -> None:
    hidden = INVISIBLE[name]
    url = _url(tmp_path)
    await _two_runs_alike(url, hidden)
    code, out, err = cli(url, "runs", "--tenant", T)
    assert code == 0, err
    cli_escape = repr(hidden)[1:-1]
    assert f"inv{cli_escape}-7" in out  # the CLI tells them apart
    with served(create_app(url)) as base:
        async with httpx.AsyncClient(base_url=base) as client:
            page = await client.get(f"/t/{T}/runs")
    assert page.status_code == 200
    assert f"inv{cli_escape}-7" in _shown(page.text)
    assert hidden not in _shown(page.text)


# --- tesserix.lease.takeovers ------------------------------------------------------------------


async def test_a_resume_failing_on_the_store_before_holding_the_run_counts_no_takeover(
    tmp_path: Path,
) -> None:
    url, path = _url(tmp_path), tmp_path / "adk.sqlite3"
    crash = [True]

    @tool(side_effects=False)
    def look(q: str) -> str:
        """Look something up."""
        if crash[0]:
            crash[0] = False
            raise SimulatedCrash("the process died looking")
        return "found"

    agent = Agent("looker", "Look.", [look])
    turns: list[Any] = [[("look", {"q": "a"})], "Found."]
    otel = Pipeline()
    async with open_stores(url) as stores:
        await stores.create_schema()
        first = AgentRunner.from_stores(ScriptedProvider(turns), stores, lease_policy=POLICY)
        with contextlib.suppress(SimulatedCrash):
            await first.run(agent, "look", tenant=T, run_id="r-down")
        await asyncio.sleep(0.6)  # the dead holder's lease lapses
        db = sqlite3.connect(path)
        with db:
            fences = db.execute(
                "SELECT fence FROM adk_run_leases WHERE run_id = 'r-down'"
            ).fetchall()
            # The idempotency store refuses every write (a store down, for it alone).
            db.execute(
                "CREATE TRIGGER down BEFORE INSERT ON adk_idempotency "
                "BEGIN SELECT RAISE(ABORT, 'the store is down'); END"
            )
        worker = Worker(
            AgentRunner.from_stores(ScriptedProvider(turns), stores, lease_policy=POLICY),
            [agent],
            exit_when_idle=True,
            poll_interval=0.01,
            backoff=Backoff(base=5.0, cap=5.0),
            telemetry=otel.telemetry,
        )
        await asyncio.wait_for(worker.run(), 30)
        assert [how.value for _, how in worker.carried] == ["retry"]
        assert stores.work is not None
        item = await stores.work.entry(T, "r-down")
        assert item is not None and item.state is WorkState.wanted
        assert item.reason is not None and "StoreUnavailableError" in item.reason
        with db:
            # No lease was taken: the fence is the dead holder's still.
            after = db.execute(
                "SELECT fence FROM adk_run_leases WHERE run_id = 'r-down'"
            ).fetchall()
        db.close()
        assert after == fences
    taken = otel.points("tesserix.lease.takeovers")
    assert sum(p.value for p in taken) == 0
