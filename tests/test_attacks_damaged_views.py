"""What an on-call engineer sees when one run's rows are damaged by hand (a bad restore, a
hand ``UPDATE``, a Redis ``HSET``/``DEL``/``SET``), after the listings learnt to read the
parked entries run by run (``run.entries.tenant_entries``, ``stores.rows.listed_items``).

Real ``tesserix`` commands (in process), the console (``TestClient``) and ``Worker``s over a
SQLite file, the test Redis (a key prefix of its own) and PostgreSQL (a schema of its own),
with the booking world of ``tests/test_attacks_stateful_operators.py``. Secrets are planted
in every damaged value.

Defects it found, each a strict xfail until fixed, all fixed now (``WorksAroundDamage``:
the built-in work indexes list past a damaged entry and name it):
- one damaged work index entry, of a run that HAS a frontier, hides every run of the tenant
  that has none (submitted, parked before it started) from ``tesserix runs`` (with
  ``--stuck`` and ``--json``) and from the console's runs page and stuck filter: one row
  ``-`` names the damaged run instead;
- Redis: a run whose entry hash is gone (``DEL``) while the index still lists it is named
  ``'None/None'`` and hides the tenant's unstarted runs, though ``entry`` reads it as no
  entry and a worker's poll drops it;
- Redis: a never-started run whose entry key holds another type (``SET``) is named nowhere:
  ``tesserix runs`` says only that "Redis holds a damaged key" (with the script's sha);
- ``inspect``/``show`` of a never-started run whose entry is damaged says a running worker
  starts it and ``tesserix runs`` lists it; neither is true;
- the console's ``?status=``/``?agent=`` filters drop a run whose frontier reads (status and
  agent known) because its work entry is damaged, while ``tesserix runs --status``/``--agent``
  list it as unreadable;
- the worker's log line naming a damaged entry it passes by quotes the damaged value with
  the secret in it, unredacted.

Held: the worker passes a damaged entry by (logged by run) and carries every other run;
cancelling the other runs and approving another run's request work past the damage; the
damaged values are redacted in every listing and sentence (any damaged column of
adk_work, adk_run_leases or adk_idempotency, a property); a never-started run's damaged
entry (SQLite, Redis field) is named in ``tesserix runs`` with and without ``--stuck``;
PostgreSQL: one run's damaged approval request leaves the listings, the console and the
other run's approval working, and ``inspect`` of it says one redacted sentence (exit 4).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import shutil
import sqlite3
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tesserix_adk import (
    Agent,
    AgentRunner,
    RunStatus,
    ScriptedProvider,
    tool,
)
from tesserix_adk.stores.protocols import WorkState
from tesserix_adk.stores.urls import open_stores
from test_attacks_waking_others import Rig, T, rig

SECRET = "sk-live-PLANTEDdamagedV1ewSecret0123456789"
BASE = "http://127.0.0.1:8765"
DAMAGEABLE = [
    pytest.param("sqlite", id="sqlite"),
    pytest.param("redis", id="redis", marks=pytest.mark.redis),
]


# --- helpers ------------------------------------------------------------------------------


async def damage_entry(r: Rig, run_id: str) -> None:
    """The run's work index entry damaged by hand, a secret in the damaged value: SQLite,
    ``since`` that is not a number; Redis, ``attempts`` that is not a number."""
    junk = f"password={SECRET}"
    if r.backend == "sqlite":
        sql = "UPDATE adk_work SET since = ? WHERE tenant = ? AND run_id = ?"
        await r.stores.work.database.write(lambda conn: conn.execute(sql, (junk, T, run_id)))
    else:
        work = r.stores.work
        await work._client.hset(work._entry(T, run_id), "attempts", junk)


async def runs_json(r: Rig, *extra: str) -> tuple[list[dict[str, Any]], str]:
    code, out, err = await r.cli("runs", "--tenant", T, "--json", *extra)
    assert code == 0 and "Traceback" not in err, (code, err)
    assert SECRET not in out + err
    return json.loads(out)["runs"], out


def ids(rows: list[dict[str, Any]]) -> set[str]:
    return {row["run_id"] for row in rows}


def console(url: str, *paths: str) -> list[tuple[int, str]]:
    """GET each path on the console (in this thread); status and text of each."""
    from starlette.testclient import TestClient

    from tesserix_adk.console import create_app

    with TestClient(create_app(url), base_url=BASE, raise_server_exceptions=False) as client:
        got = [client.get(p) for p in paths]
    return [(g.status_code, g.text) for g in got]


def linked(page: str) -> set[str]:
    """The runs a runs page lists (each row links to its run's page)."""
    return set(re.findall(r'href="/t/acme/runs/([^"?/]+)"', page))


async def finished_and_unstarted(r: Rig) -> None:
    """``done1`` finished (a frontier, its entry done); ``fresh-parked`` submitted and parked
    before it started (an operator must act: stuck); ``fresh-new`` submitted, not started."""
    await r.submit("done1", "book:k1")
    assert await r.work() == ["finished"]
    await r.submit("fresh-parked", "book:k2")
    await r.stores.work.park(T, "fresh-parked", agent="booker", reason="held for review")
    await r.submit("fresh-new", "book:k3")


# --- one damaged entry of a started run hides every run that has no frontier ---------------


@pytest.mark.parametrize("backend", DAMAGEABLE)
async def test_a_started_runs_damaged_entry_hides_no_unstarted_run_from_tesserix_runs(
    backend: str, tmp_path: Path
) -> None:
    async with rig(backend, tmp_path) as r:
        await finished_and_unstarted(r)
        await damage_entry(r, "done1")
        rows, _ = await runs_json(r)
        assert {"done1", "fresh-parked", "fresh-new"} <= ids(rows), rows
        stuck, _ = await runs_json(r, "--stuck")
        # The run parked before it started waits for a person: it never leaves --stuck.
        assert "fresh-parked" in ids(stuck), stuck


async def test_a_started_runs_damaged_entry_hides_no_unstarted_run_from_the_console(
    tmp_path: Path,
) -> None:
    async with rig("sqlite", tmp_path) as r:
        await finished_and_unstarted(r)
        await damage_entry(r, "done1")
        (all_, all_page), (stuck, stuck_page) = await asyncio.to_thread(
            console, r.url, f"/t/{T}/runs", f"/t/{T}/runs?stuck=1"
        )
        assert (all_, stuck) == (200, 200)
        assert SECRET not in all_page + stuck_page
        assert {"fresh-parked", "fresh-new"} <= linked(all_page), linked(all_page)
        assert "fresh-parked" in linked(stuck_page), linked(stuck_page)


# --- a never-started run's own damaged entry: named somewhere -----------------------------


async def wrongtype(r: Rig, run_id: str) -> None:
    work = r.stores.work
    await work._client.delete(work._entry(T, run_id))
    await work._client.set(work._entry(T, run_id), f"password={SECRET}")


NEVER_STARTED = [
    pytest.param("sqlite", id="sqlite-since-not-a-number"),
    pytest.param("redis", id="redis-attempts-not-a-number", marks=pytest.mark.redis),
    pytest.param(
        "redis-wrongtype",
        id="redis-entry-of-another-type",
        marks=pytest.mark.redis,
    ),
]


@pytest.mark.parametrize("how", NEVER_STARTED)
async def test_a_never_started_runs_damaged_entry_is_named_in_tesserix_runs(
    how: str, tmp_path: Path
) -> None:
    async with rig(how.split("-")[0], tmp_path) as r:
        await r.submit("fresh-bad", "book:k4")
        if how == "redis-wrongtype":
            await wrongtype(r, "fresh-bad")
        else:
            await damage_entry(r, "fresh-bad")
        rows, out = await runs_json(r)
        code, text, err = await r.cli("runs", "--tenant", T)
        assert code == 0 and SECRET not in text + err, err
        _stuck, stuck_out = await runs_json(r, "--stuck")
        for said in (out, text, stuck_out):
            assert "fresh-bad" in said, said
        assert all(row["status"] == "unreadable" for row in rows), rows


@pytest.mark.redis
async def test_a_redis_entry_hash_gone_hides_no_unstarted_run_and_is_not_named_none(
    tmp_path: Path,
) -> None:
    async with rig("redis", tmp_path) as r:
        await finished_and_unstarted(r)
        work = r.stores.work
        await work._client.delete(work._entry(T, "done1"))
        # The one-run read and a worker's poll take it as no entry at all.
        assert await work.entry(T, "done1") is None
        rows, out = await runs_json(r)
        assert "None/None" not in out, out
        assert {"done1", "fresh-parked", "fresh-new"} <= ids(rows), rows


@pytest.mark.parametrize("backend", DAMAGEABLE)
async def test_inspect_of_a_never_started_run_whose_entry_is_damaged_promises_no_worker(
    backend: str, tmp_path: Path
) -> None:
    async with rig(backend, tmp_path) as r:
        await r.submit("fresh-bad", "book:k4")
        await r.submit("fresh-good", "book:k5")
        await damage_entry(r, "fresh-bad")
        # What the sentence below promises, checked first: a worker leaves the run alone.
        assert await r.work() == ["finished"]
        assert r.world.effects == Counter({"book-k5": 1})
        for command in ("inspect", "show"):
            _code, out, err = await r.cli(command, "fresh-bad", "--tenant", T)
            assert "Traceback" not in err and SECRET not in out + err
            assert len(err.strip().splitlines()) <= 1, err
            assert "worker` starts it" not in err, (command, err)
            assert "cannot be read" in err or "damaged" in err, (command, err)


# --- the console's filters and the CLI's disagree on a damaged entry -----------------------


async def test_the_consoles_status_and_agent_filters_keep_a_run_whose_entry_is_damaged(
    tmp_path: Path,
) -> None:
    async with rig("sqlite", tmp_path) as r:
        await r.submit("done1", "book:k1")
        await r.submit("done2", "book:k2")
        assert await r.work() == ["finished", "finished"]
        # An operator parked the finished run (its entry is read by every listing), then
        # its entry was damaged.
        await r.stores.work.park(T, "done1", agent="booker", reason="audit")
        await damage_entry(r, "done1")
        for flag in (("--status", "completed"), ("--agent", "booker")):
            rows, _ = await runs_json(r, *flag)
            assert {"done1", "done2"} <= ids(rows), (flag, rows)
        pages = await asyncio.to_thread(
            console, r.url, f"/t/{T}/runs?status=completed", f"/t/{T}/runs?agent=booker"
        )
        for status, page in pages:
            assert status == 200 and SECRET not in page
            assert "done2" in linked(page)
            assert "done1" in linked(page), linked(page)


# --- what held --------------------------------------------------------------------------


async def _worker_past_damage(
    backend: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> str:
    """Four runs submitted, the second's entry damaged; a worker carries the others. What
    the worker's log said."""
    async with rig(backend, tmp_path) as r:
        for n in range(4):
            await r.submit(f"run-{n}", f"book:k{n}")
        await damage_entry(r, "run-1")
        with caplog.at_level(logging.WARNING, logger="tesserix_adk.stores"):
            carried = await r.work(concurrency=2)
        assert carried == ["finished"] * 3, carried
        assert r.world.effects == Counter({"book-k0": 1, "book-k2": 1, "book-k3": 1})
        # A second worker neither takes it nor carries a finished run again.
        assert await r.work() == []
        said = " ".join(rec.getMessage() for rec in caplog.records)
        assert "run-1" in said, said
        return said


@pytest.mark.parametrize("backend", DAMAGEABLE)
async def test_the_worker_passes_a_damaged_entry_by_names_it_and_carries_every_other_run(
    backend: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    await _worker_past_damage(backend, tmp_path, caplog)


@pytest.mark.parametrize("backend", DAMAGEABLE)
async def test_the_workers_log_of_a_damaged_entry_masks_the_secret_it_holds(
    backend: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    said = await _worker_past_damage(backend, tmp_path, caplog)
    assert SECRET not in said, said


async def test_operators_act_on_the_other_runs_past_one_runs_damaged_entry(
    tmp_path: Path,
) -> None:
    async with rig("sqlite", tmp_path) as r:
        await finished_and_unstarted(r)
        await r.submit("victim", "book:k9")
        await damage_entry(r, "victim")
        for run_id in ("fresh-new", "fresh-parked"):
            code, _out, err = await r.cli("cancel", run_id, "--tenant", T, "--by", "ops")
            assert code == 0, (run_id, err)
            code, _out, err = await r.cli("inspect", run_id, "--tenant", T)
            assert code == 1 and "cancelled" in err, (run_id, err)
            assert await r.state(run_id) is WorkState.done
        assert await r.work() == []
        assert r.world.effects == Counter({"book-k1": 1})
        code, text, err = await r.cli("runs", "--tenant", T)
        assert code == 0 and SECRET not in text + err and "Traceback" not in err
        assert "victim" in text


# --- approvals: one run's request damaged, another run decided ----------------------------


def _approver(booked: list[str]) -> Agent:
    @tool(requires_approval=True)
    def book_seat(flight: str, ctx: Any) -> dict[str, str]:
        """Book a seat (needs a person's approval)."""
        booked.append(f"{flight}:{ctx.idempotency_key}")
        return {"booking": f"B{len(booked)}"}

    return Agent("approver", "Book.", [book_seat])


TURNS: list[Any] = [[("book_seat", {"flight": "LH123"})], "Booked."]


@asynccontextmanager
async def _two_waiting(backend: str, tmp_path: Path) -> AsyncIterator[tuple[str, Any, Agent]]:
    from processes import store_url

    booked: list[str] = []
    agent = _approver(booked)
    async with store_url(backend, tmp_path) as url, open_stores(url) as stores:
        await stores.create_schema()
        for run_id in ("w-bad", "w-good"):
            runner = AgentRunner.from_stores(ScriptedProvider(list(TURNS)), stores)
            waiting = await runner.run(agent, "book", tenant=T, run_id=run_id)
            assert waiting.status is RunStatus.waiting_approval
        yield url, stores, agent


async def _request_of(stores: Any, run_id: str) -> str:
    from tesserix_adk import Checkpointer

    cp = await Checkpointer.from_stores(stores).latest(T, run_id)
    assert cp is not None and cp.pending_approval is not None
    return str(cp.pending_approval.id)


@pytest.mark.postgres
async def test_postgres_one_runs_damaged_approval_leaves_the_listings_and_the_other_approval(
    tmp_path: Path,
) -> None:
    import psycopg

    from test_attacks_stateful_operators import cli

    async with _two_waiting("postgres", tmp_path) as (url, stores, _agent):
        bad, good = await _request_of(stores, "w-bad"), await _request_of(stores, "w-good")
        dsn = url
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
            # JSON of the wrong shape (the column takes only JSON), a secret in it.
            shape = json.dumps([{"password": SECRET}])
            await conn.execute("UPDATE adk_approvals SET calls = %s WHERE id = %s", (shape, bad))
        code, out, err = await asyncio.to_thread(cli, url, "runs", "--tenant", T, "--json")
        assert code == 0 and SECRET not in out + err, err
        assert {"w-bad", "w-good"} <= ids(json.loads(out)["runs"])
        code, out, err = await asyncio.to_thread(cli, url, "inspect", "w-bad", "--tenant", T)
        assert code == 4 and SECRET not in out + err and "Traceback" not in err, (code, err)
        assert len(err.strip().splitlines()) == 1, err
        argv = ("approve", good, "--tenant", T, "--by", "ops")
        code, out, err = await asyncio.to_thread(cli, url, *argv)
        assert code == 0, err
        pages = await asyncio.to_thread(
            console, url, f"/t/{T}/runs", f"/t/{T}/runs/w-good", f"/t/{T}/runs/w-bad"
        )
        (lst, lst_page), (page, good_page), (_, bad_page) = pages
        assert (lst, page) == (200, 200), (lst, page)
        assert {"w-bad", "w-good"} <= linked(lst_page)
        assert SECRET not in lst_page + good_page + bad_page
        assert "Traceback" not in bad_page


# --- property: whichever column is damaged with whatever text, the run is named, redacted --

_COLUMNS = st.sampled_from(
    [
        ("adk_work", "attempts"),
        ("adk_work", "since"),
        ("adk_work", "not_before"),
        ("adk_run_leases", "fence"),
        ("adk_run_leases", "expires_at"),
        ("adk_idempotency", "status"),
        ("adk_idempotency", "iteration"),
    ]
)
# Text around the secret, never a letter or digit glued to its front (a redactor cannot
# tell "ask-live-..." from a word).
_JUNK = st.builds(
    lambda pre, post: f"{pre}{SECRET}{post}",
    st.sampled_from(["", "password=", "token: ", "'", '"', "\n", "\x1b[2J ", "<b>"]),
    st.text(alphabet=" ;,'\")\n", max_size=4),
)


@pytest.fixture(scope="module")
def seeded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A SQLite store: ``victim`` and ``other`` finished (entries, records, leases kept)."""
    tmp = tmp_path_factory.mktemp("seeded")

    async def seed() -> Path:
        async with rig("sqlite", tmp) as r:
            for run_id, key in (("victim", "k1"), ("other", "k2")):
                await r.submit(run_id, f"book:{key}")
            assert await r.work() == ["finished", "finished"]
            # A lease row for each (as a holder that let go leaves one).
            for run_id in ("victim", "other"):
                lease = await r.stores.leases.acquire(T, run_id, "ops", 5.0)
                await r.stores.leases.release(lease)
            return Path(r.url.removeprefix("sqlite:///"))

    return asyncio.run(seed())


@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(column=_COLUMNS, junk=_JUNK)
def test_any_damaged_column_of_one_run_names_that_run_redacted_and_lists_the_other(
    seeded: Path, tmp_path: Path, column: tuple[str, str], junk: str
) -> None:
    from test_attacks_stateful_operators import cli

    target = tmp_path / f"copy-{abs(hash((column, junk)))}.sqlite3"
    for suffix in ("", "-wal", "-shm"):
        if Path(f"{seeded}{suffix}").exists():
            shutil.copy(f"{seeded}{suffix}", f"{target}{suffix}")
    table, name = column
    # A lease row is read only while it has a holder: the damaged one looks held.
    held = {"fence": ", holder = 'w-1', expires_at = 1e12", "expires_at": ", holder = 'w-1'"}
    extra = held.get(name, "") if table == "adk_run_leases" else ""
    with sqlite3.connect(target) as conn:
        changed = conn.execute(
            f"UPDATE {table} SET {name} = ?{extra} WHERE run_id = 'victim'", (junk,)
        ).rowcount
    assert changed >= 1
    url = f"sqlite:///{target}"
    code, out, err = cli(url, "runs", "--tenant", T, "--json")
    assert code == 0 and "Traceback" not in err, err
    assert SECRET not in out + err
    rows = {row["run_id"]: row for row in json.loads(out)["runs"]}
    assert rows["other"]["status"] == "completed", rows
    # The damage is named with its run: the victim's own row, or (a finished run's entry,
    # read only by the listing of runs with no frontier) the row saying what stopped it.
    named = [
        row
        for row in rows.values()
        if row["status"] == "unreadable"
        and (row["run_id"] == "victim" or "victim" in row["reason"])
    ]
    assert named, rows
    code, text, err = cli(url, "runs", "--tenant", T)
    assert code == 0 and SECRET not in text and "\x1b" not in text
    assert any("victim" in line and "unreadable: " in line for line in text.splitlines()), text
    code, out, err = cli(url, "inspect", "other", "--tenant", T, "--json")
    assert code == 0 and json.loads(out)["status"] == "completed", err
