"""An attacker's tries at commit 6f6f1d1: ``SchemaMismatchError`` (a ``ConfigurationError``)
raised by the SQLite schema checks and by PostgreSQL's ``verify`` and driver errors
(``UndefinedTable``, ``UndefinedColumn``), and a ``Worker`` that, meeting one while carrying
a run, gives the run back and stops with the store's sentence instead of parking it.

An earlier-version store is built by applying the schema and undoing migration 0006 by
hand (as ``tests/test_attacks_readme_today.py`` does). A table dropped by hand mid-run
(``adk_approvals``, which only a run asking for an approval touches) lets one run meet the
error while the others are inside a tool call.

A strict xfail is a defect; its reason names where in ``src``. A plain test is a promise
that held.

Findings (defects; each was a strict xfail, all fixed since and their tests plain: a worker
stops on a schema error only when its own store's check (``runner.verify_stores``, which a
SQLite file now fails for a table gone too) fails as well, else the run is parked as the
run's; a permission refusal is ``StorePermissionError``, on which a worker stops; on
Temporal both are retried):

1. A ``SchemaMismatchError`` that is not about the worker's store (the run's own provider
   raised it, about a store of its own) stops every worker that takes the run, and gives
   the attempt back each time: the run is never counted, never parked, and a supervised
   fleet stops on it forever (``worker.py`` ``Worker._after_error`` trusts the type alone).
2. A store-wide refusal that is not a schema mismatch (PostgreSQL ``InsufficientPrivilege``,
   a grant missing on a kit table) still parks each run the worker takes, for good: fixing
   the grant leaves them parked (``adapters/postgres/driver.py`` ``driver_errors`` makes it
   a plain ``ConfigurationError``; ``worker.py`` ``_PARK`` parks it) - the very failure the
   commit fixed for schemas.
3. On Temporal (``tesserix worker --temporal``) a ``SchemaMismatchError`` is translated to a
   non-retryable ``ApplicationError`` (``temporal/activities.py`` ``_translated``): the run's
   workflow fails for good instead of being retried once the schema is applied, where the
   README says a worker meeting the old schema gives the run back and never parks it.

Promises that held: with concurrency 3 on SQLite and on PostgreSQL, the runs inside a tool
call when another run met the dropped table finished their calls, recorded them completed
and stopped at a boundary, were given back (attempts 0, not parked) and, once the schema was
applied, finished without a call sent twice; several workers stopping on one run never
count it towards ``too_many_attempts``; ``tesserix worker`` on an earlier PostgreSQL schema
exits 1 with one line on stderr (no traceback) and leaves the run wanted; the CLI's other
commands on an earlier SQLite or PostgreSQL schema exit 1 with one line and change nothing
(an approval stays pending, no cancel is recorded); a ``ConfigurationError`` of one run (a
scripted provider out of turns) still parks that run and the worker carries the others on.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import secrets
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from adapters import services
from agent_files import booking_agent_file
from tesserix_adk import (
    Agent,
    AgentRunner,
    Checkpointer,
    ScriptedProvider,
    Tool,
    ToolContext,
    Worker,
    open_stores,
)
from tesserix_adk.cli import ExitCode
from tesserix_adk.cli.main import main as tesserix
from tesserix_adk.errors import SchemaMismatchError
from tesserix_adk.stores.protocols import RecordStatus, WorkState

T = "acme"


def _two_turns() -> ScriptedProvider:
    return ScriptedProvider([[("act", {"n": "1"})], "done"])


def _agents(entered: list[str], release: asyncio.Event, sent: list[str]) -> list[Agent]:
    """``slow``: a side-effecting call that waits for ``release``; ``asker``: a call that
    needs an approval (so its run writes to ``adk_approvals``). Both tools are ``act``."""

    async def slow_act(n: str, ctx: ToolContext) -> str:
        """Act slowly."""
        entered.append(ctx.run_id)
        await release.wait()
        sent.append(f"slow:{ctx.run_id}")
        return "done slowly"

    async def asked_act(n: str, ctx: ToolContext) -> str:
        """Act once approved."""
        sent.append(f"asked:{ctx.run_id}")
        return "done"

    return [
        Agent("slow", "Act.", [Tool(slow_act, name="act")]),
        Agent("asker", "Act.", [Tool(asked_act, name="act", requires_approval=True)]),
    ]


async def _until(predicate: Any, what: str, seconds: float = 10.0) -> None:
    for _ in range(int(seconds / 0.01)):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never: {what}")


async def _mid_call_stop(stores: Any, drop_approvals: Any) -> tuple[Worker, list[str]]:
    """Two slow runs inside their calls; the approvals table dropped; an asking run
    submitted. The worker must stop with the schema error, the slow calls let go once it
    drains. The worker and what was sent."""
    entered: list[str] = []
    sent: list[str] = []
    release = asyncio.Event()
    slow, asker = _agents(entered, release, sent)
    runner = AgentRunner.from_stores(_two_turns(), stores)
    for run_id in ("s1", "s2"):
        await runner.submit(slow, "go", tenant=T, run_id=run_id)
    worker = Worker(
        runner, [slow, asker], concurrency=3, poll_interval=0.01, drain_timeout=10, max_attempts=2
    )
    task = asyncio.create_task(worker.run())
    try:
        await _until(lambda: len(entered) == 2, "both slow calls started")
        await drop_approvals()
        await runner.submit(asker, "go", tenant=T, run_id="a1")
        await _until(lambda: worker.draining, "the worker drains on the schema error")
        release.set()
        with pytest.raises(SchemaMismatchError):
            await asyncio.wait_for(task, 15)
    finally:
        release.set()
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
    assert sorted(sent) == ["slow:s1", "slow:s2"]
    assert {(i.run_id, str(how)) for i, how in worker.carried} == {
        ("s1", "stopped"),
        ("s2", "stopped"),
        ("a1", "stopped"),
    }
    # Given back, not parked, not counted; the slow calls recorded as completed.
    items = {i.run_id: i for i in await stores.work.items(T)}
    assert {r: (i.state, i.attempts) for r, i in items.items()} == {
        r: (WorkState.wanted, 0) for r in ("s1", "s2", "a1")
    }, items
    for run_id in ("s1", "s2"):
        [rec] = await stores.idempotency.records(T, run_id)
        assert rec.status is RecordStatus.completed, rec
    assert await stores.idempotency.records(T, "a1") == []
    # Several more workers stopping on a1 (max_attempts=2) never park it as too_many_attempts.
    for _ in range(3):
        again = Worker(
            AgentRunner.from_stores(_two_turns(), stores),
            [slow, asker],
            concurrency=3,
            poll_interval=0.01,
            exit_when_idle=True,
            max_attempts=2,
        )
        with pytest.raises(SchemaMismatchError):
            await asyncio.wait_for(again.run(), 15)
    [a1] = [i for i in await stores.work.items(T) if i.run_id == "a1"]
    assert (a1.state, a1.attempts) == (WorkState.wanted, 0), a1
    # The schema applied (it puts the table back), every run carries on; nothing sent twice.
    await stores.create_schema()
    last = Worker(
        AgentRunner.from_stores(_two_turns(), stores),
        [slow, asker],
        concurrency=3,
        poll_interval=0.01,
        exit_when_idle=True,
    )
    await asyncio.wait_for(last.run(), 15)
    assert {(i.run_id, str(how)) for i, how in last.carried} == {("a1", "waiting")}
    assert sorted(sent) == ["slow:s1", "slow:s2"]
    for run_id in ("s1", "s2"):
        cp = await Checkpointer.from_stores(stores).latest(T, run_id)
        assert cp is not None and str(cp.status) == "completed", cp
    assert await stores.work.items(T) == []
    return worker, sent


async def test_sqlite_runs_inside_a_call_stop_cleanly_when_another_meets_a_dropped_table(
    tmp_path: Path,
) -> None:
    path = tmp_path / "adk.sqlite3"

    async def drop() -> None:
        conn = sqlite3.connect(path)
        try:
            conn.execute("DROP TABLE adk_approvals")
            conn.commit()
        finally:
            conn.close()

    async with open_stores(f"sqlite:///{path}") as stores:
        await stores.create_schema()
        await _mid_call_stop(stores, drop)


@contextlib.asynccontextmanager
async def _pg_schema() -> AsyncIterator[tuple[str, Any, str]]:
    """A PostgreSQL schema of this file's own, dropped after: its URL, an admin connection
    and its name."""
    import psycopg

    name = f"schema_stop_{secrets.token_hex(5)}"
    try:
        admin = await psycopg.AsyncConnection.connect(
            services.POSTGRES_URL, autocommit=True, connect_timeout=3
        )
    except psycopg.OperationalError as exc:
        services.unavailable(f"PostgreSQL cannot be reached: {exc}")
    try:
        await admin.execute(f'CREATE SCHEMA "{name}"')
        try:
            yield services.with_query(services.POSTGRES_URL, schema=name), admin, name
        finally:
            await admin.execute(f'DROP SCHEMA "{name}" CASCADE')
    finally:
        await admin.close()


async def _pg_to_version_5(admin: Any, name: str) -> None:
    """Undo migrations 0007 and 0006 by hand: what the kit of schema version 5 left."""
    await admin.execute(f'DROP INDEX "{name}".adk_idempotency_taken')
    for column in ("holder_run", "holder_iteration", "holder_call_id"):
        await admin.execute(f'ALTER TABLE "{name}".adk_idempotency DROP COLUMN {column}')
    await admin.execute(f'ALTER TABLE "{name}".adk_idempotency DROP COLUMN never_ran_by')
    await admin.execute(f'UPDATE "{name}".adk_schema_version SET version = 5')


async def test_postgres_runs_inside_a_call_stop_cleanly_when_another_meets_a_dropped_table() -> (
    None
):
    async with _pg_schema() as (url, admin, name):

        async def drop() -> None:
            await admin.execute(f'DROP TABLE "{name}".adk_approvals')

        async with open_stores(url) as stores:
            await stores.create_schema()
            await _mid_call_stop(stores, drop)


# --- the command line on an earlier schema ---------------------------------------------------


def _booking_agent(sent: Path, *, approval: bool = False) -> tuple[Agent, ScriptedProvider]:
    def book(flight: str) -> str:
        """Book a seat."""
        with sent.open("a") as f:
            f.write(flight + "\n")
        return "booked"

    agent = Agent("booking", "Book.", [Tool(book, requires_approval=approval)])
    return agent, ScriptedProvider([[("book", {"flight": "LH1"})], "done"])


def _one_sentence(err: str) -> None:
    assert err.count("\n") == 1 and err.startswith("tesserix: "), err
    assert "Traceback" not in err and "tesserix schema apply" in err, err


async def test_tesserix_worker_on_an_earlier_postgres_schema_exits_1_and_gives_the_run_back(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    agent_ref, sent = booking_agent_file(tmp_path)
    async with _pg_schema() as (url, admin, name):
        async with open_stores(url) as stores:
            await stores.create_schema()
        await _pg_to_version_5(admin, name)
        agent, provider = _booking_agent(sent)
        async with open_stores(url) as stores:
            await AgentRunner.from_stores(provider, stores).submit(
                agent, "go", tenant=T, run_id="r1"
            )
        argv = ["--store", url, "worker", "--agent", agent_ref, "--exit-when-idle"]
        for _ in range(3):
            code = await asyncio.to_thread(tesserix, argv)
            captured = capsys.readouterr()
            assert code == ExitCode.NOTHING_CHECKPOINTED, captured
            _one_sentence(captured.err)
            assert "the worker stops" in captured.out  # its own log line, on stdout
        async with open_stores(url) as stores:
            [item] = await stores.work.items(T)
        assert (item.run_id, item.state, item.attempts) == ("r1", WorkState.wanted, 0), item
        assert not sent.exists()  # the claim was refused: nothing went out
        assert await asyncio.to_thread(tesserix, ["--store", url, "schema", "apply"]) == 0
        assert await asyncio.to_thread(tesserix, argv) == ExitCode.CARRIED_ON
        capsys.readouterr()
        async with open_stores(url) as stores:
            cp = await Checkpointer.from_stores(stores).latest(T, "r1")
            assert cp is not None and str(cp.status) == "completed"
            assert await stores.work.items(T) == []
    assert sent.read_text() == "LH1\n"


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
async def test_other_commands_on_an_earlier_schema_exit_1_in_one_line_and_change_nothing(
    backend: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    agent_ref, sent = booking_agent_file(tmp_path, approval=True)
    agent, provider = _booking_agent(sent, approval=True)

    async def seed(url: str) -> str:
        async with open_stores(url) as stores:
            await stores.create_schema()
            run = await AgentRunner.from_stores(provider, stores).run(
                agent, "go", tenant=T, run_id="r1"
            )
        assert run.pending_approval is not None
        return run.pending_approval.id

    async def check(url: str, downgrade: Any) -> None:
        request = await seed(url)
        await downgrade()
        for argv in (
            ["approve", request, "--tenant", T, "--by", "ops"],
            ["approve", request, "--tenant", T, "--by", "ops", "--deny"],
            ["cancel", "r1", "--tenant", T, "--by", "ops"],
            ["resolve", "r1", "--tenant", T, "--call", "call_0_0", "--never-ran", "--by", "o"],
            ["run", "--resume", "r1", "--tenant", T, "--agent", agent_ref],
            ["inspect", "r1", "--tenant", T],
        ):
            code = await asyncio.to_thread(tesserix, ["--store", url, *argv])
            err = capsys.readouterr().err
            assert code == ExitCode.NOTHING_CHECKPOINTED, (argv, err)
            _one_sentence(err)
        assert await asyncio.to_thread(tesserix, ["--store", url, "schema", "apply"]) == 0
        async with open_stores(url) as stores:
            decided = await stores.approvals.get(T, request)
            assert decided is not None and str(decided.status) == "pending", decided
            records = await stores.idempotency.records(T, "r1")
            assert [r.key for r in records if r.key.startswith("cancel")] == [], records
        assert not sent.exists()

    if backend == "sqlite":
        path = tmp_path / "adk.sqlite3"

        async def to_5() -> None:
            conn = sqlite3.connect(path)
            try:
                # (Since schema version 7, its index and columns are undone too.)
                conn.execute("DROP INDEX adk_idempotency_taken")
                for column in ("holder_run", "holder_iteration", "holder_call_id"):
                    conn.execute(f"ALTER TABLE adk_idempotency DROP COLUMN {column}")
                conn.execute("ALTER TABLE adk_idempotency DROP COLUMN never_ran_by")
                conn.execute("UPDATE adk_schema_version SET version = 5")
                conn.commit()
            finally:
                conn.close()

        await check(f"sqlite:///{path}", to_5)
        return
    async with _pg_schema() as (url, admin, name):

        async def pg_to_5() -> None:
            await _pg_to_version_5(admin, name)

        await check(url, pg_to_5)


# --- other ConfigurationErrors, other SchemaMismatchErrors -------------------------------------


async def test_a_configuration_error_of_one_run_still_parks_it_and_the_worker_carries_on(
    tmp_path: Path,
) -> None:
    async def act(n: str) -> str:
        """Act."""
        return "ok"

    short = Agent("short", "Act.", [Tool(act, name="act")])
    fine = Agent("fine", "Say done.", [Tool(act, name="act")])

    class ByAgent:
        """One scripted turn for ``short`` (it asks for a second: a ConfigurationError)."""

        async def complete(self, request: Any) -> Any:
            turns = [[("act", {"n": "1"})]] if request.agent_name == "short" else ["done"]
            return await ScriptedProvider(turns).complete(request)

    async with open_stores(f"sqlite:///{tmp_path / 'adk.sqlite3'}") as stores:
        await stores.create_schema()
        runner = AgentRunner.from_stores(ByAgent(), stores)
        await runner.submit(short, "go", tenant=T, run_id="bad")
        await runner.submit(fine, "go", tenant=T, run_id="good")
        worker = Worker(runner, [short, fine], poll_interval=0.01, exit_when_idle=True)
        await asyncio.wait_for(worker.run(), 15)  # does not raise: not the store's
        carried = {i.run_id: str(how) for i, how in worker.carried}
        assert carried == {"bad": "parked", "good": "finished"}, carried
        [bad] = await stores.work.items(T)
        assert bad.state is WorkState.parked and "ConfigurationError" in (bad.reason or "")


class _OtherStoreProvider:
    """A provider of the run's own that reads a store of its own, whose schema is old."""

    async def complete(self, request: Any) -> Any:
        raise SchemaMismatchError(
            "the SQLite store /srv/catalog.sqlite3 has schema version 5, this kit needs 6"
        )


async def test_a_schema_error_not_about_the_workers_store_does_not_stop_every_worker(
    tmp_path: Path,
) -> None:
    async def act(n: str) -> str:
        """Act."""
        return "ok"

    agent = Agent("a", "Act.", [Tool(act, name="act")])
    async with open_stores(f"sqlite:///{tmp_path / 'adk.sqlite3'}") as stores:
        await stores.create_schema()
        runner = AgentRunner.from_stores(_OtherStoreProvider(), stores)
        await runner.submit(agent, "go", tenant=T, run_id="p1")
        stopped = 0
        for _ in range(4):
            worker = Worker(
                AgentRunner.from_stores(_OtherStoreProvider(), stores),
                [agent],
                poll_interval=0.01,
                exit_when_idle=True,
                max_attempts=2,
            )
            try:
                await asyncio.wait_for(worker.run(), 15)
            except SchemaMismatchError:
                stopped += 1
        [item] = await stores.work.items(T)
        # The worker's own store is fine: at most max_attempts workers stop on the run, and
        # then it is parked for an operator rather than stopping the fleet forever.
        assert stopped <= 2 and item.state is WorkState.parked, (stopped, item)


async def test_a_store_wide_permission_refusal_does_not_park_runs_for_good() -> None:
    async with _pg_schema() as (url, admin, name):
        agent, provider = _booking_agent(Path("/dev/null"), approval=True)
        async with open_stores(url) as stores:
            await stores.create_schema()
            # A grant missing on adk_approvals, as the server says it (a trigger in this
            # test's own schema, so no role is created on the server).
            await admin.execute(
                f'CREATE FUNCTION "{name}".deny() RETURNS trigger LANGUAGE plpgsql AS $$ '
                "BEGIN RAISE EXCEPTION 'permission denied for table adk_approvals' "
                "USING ERRCODE = 'insufficient_privilege'; END $$"
            )
            await admin.execute(
                f'CREATE TRIGGER deny BEFORE INSERT ON "{name}".adk_approvals '
                f'FOR EACH ROW EXECUTE FUNCTION "{name}".deny()'
            )
            runner = AgentRunner.from_stores(provider, stores)
            await runner.submit(agent, "go", tenant=T, run_id="b1")
            worker = Worker(runner, [agent], poll_interval=0.01, exit_when_idle=True)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(worker.run(), 15)
            # The grant is given: the run must carry on by itself.
            await admin.execute(f'DROP TRIGGER deny ON "{name}".adk_approvals')
            _, provider2 = _booking_agent(Path("/dev/null"), approval=True)
            again = Worker(
                AgentRunner.from_stores(provider2, stores),
                [agent],
                poll_interval=0.01,
                exit_when_idle=True,
            )
            await asyncio.wait_for(again.run(), 15)
            items = await stores.work.items(T)
            assert [i.state for i in items] != [WorkState.parked], items
            assert {(i.run_id, str(h)) for i, h in again.carried} == {("b1", "waiting")}


async def test_on_temporal_a_schema_mismatch_is_retried_not_the_end_of_the_workflow() -> None:
    pytest.importorskip("temporalio")
    from temporalio.exceptions import ApplicationError

    from tesserix_adk.checkpoint.redaction import Redactor
    from tesserix_adk.temporal.activities import _translated

    async def meets_old_schema() -> None:
        raise SchemaMismatchError(
            "a tesserix-adk column is missing while claiming 'k' (column r.never_ran_by "
            "does not exist): the schema is from an earlier kit; run `tesserix schema apply`"
        )

    with pytest.raises(ApplicationError) as raised:
        await _translated(meets_old_schema(), Redactor())
    assert raised.value.type == "SchemaMismatchError"
    assert re.search("schema apply", raised.value.message)
    assert not raised.value.non_retryable
