"""An attacker's tries at commits 3abb5df, a4b17b0 and 1450b41: ``AgentRunner.verify_stores``
(set by ``from_stores``), ``Worker._the_stores_own`` and ``_STORE_WIDE`` (a worker stops on
a ``SchemaMismatchError`` only when its own store's ``verify()`` fails too, and always on a
``StorePermissionError``), SQLite ``verify()`` checking every table, ``StorePermissionError``
for PostgreSQL ``InsufficientPrivilege`` and Redis ``NOPERM``, and Temporal's
``_translated`` retrying both.

A strict xfail is a defect; its reason names where in ``src``. A plain test is a promise
that held.

Findings (defects; 2, 4 and 5 are fixed since and their tests plain: a check that cannot
be made now (an outage, a timeout) retries the run later, a take drained during the check is
given back, SQLite's ``verify()`` counts tables only; ``_the_stores_own`` is now
``Worker._whose``. 1 and 3 stay strict xfails, limits README's "Upgrading a store" now
names):

1. (medium) A ``StorePermissionError`` that is not about the worker's store (the run's own
   provider raised it, about a store of its own) stops every worker that takes the run and
   gives the attempt back each time: the run is never counted, never parked, and a
   supervised fleet stops on it forever - the very defect 3abb5df fixed for
   ``SchemaMismatchError``, left open for its sibling (``worker.py``
   ``Worker._the_stores_own`` returns True for any ``StorePermissionError`` unchecked).
2. (medium-low) A store that cannot be reached for a moment while the worker checks it
   (``verify()`` raising ``StoreUnavailableError``) stops the worker for good with the
   *foreign* schema sentence (naming another system's store and ``schema apply``), though
   its own schema is fine: the worker's main loop waits out outages, this path turns one
   into a stop (``worker.py`` ``Worker._the_stores_own``: ``except Exception: return True``).
3. (low) A runner built by hand (``AgentRunner(...)``, no ``from_stores``) has
   ``verify_stores`` None, so every ``SchemaMismatchError`` is taken for the store's: a
   foreign one stops every worker forever, as before 3abb5df (``worker.py``
   ``Worker._the_stores_own``: ``verify is None`` -> True).
4. (low) SQLite ``verify()`` takes any ``sqlite_master`` entry for a table: an index, a
   trigger or a view named ``adk_approvals`` where the table was dropped passes it
   (``stores/sqlite/database.py`` ``SqliteDatabase.verify``: ``SELECT name FROM
   sqlite_master`` with no ``type = 'table'``); a worker then parks runs meeting the missing
   table as their own, the very thing the check was added to prevent.
5. (low) A ``verify()`` that hangs (no time limit) holds the take past the drain deadline;
   the drain cancels it (the drain does not hang) but the take's counted attempt is never
   given back, unlike a take the drain cancels inside the run (``worker.py`` ``Worker._carry``
   awaits ``_after_error`` - and so ``verify`` - outside its ``CancelledError`` handling).

Documentation: README's upgrade paragraph says a worker meeting a refused grant
(``StorePermissionError``) "stops with that sentence (exit 1)"; ``tesserix worker`` exits 2
(as docs/deploying.md says of a missing privilege). The code agrees with deploying.md; the
README sentence should say exit 2 for the grant.

Promises that held: a tool raising ``StorePermissionError`` is the run's (its error is the
tool's result; the run finishes, no worker stops); ``tesserix worker`` on PostgreSQL meeting
``insufficient_privilege`` on a kit table mid-run exits 2 with one line and no traceback,
gives the run back (wanted, attempts 0, nothing sent) and carries it on once the grant is
back; a Redis ACL user without ``EVALSHA`` (``NOPERM``) gets exit 2 and one line from
``runs`` and ``worker``; ``explain`` gives ``StorePermissionError`` exit 2 and a SQLite
table-gone ``SchemaMismatchError`` exit 1 naming ``tesserix schema apply``; SQLite
``verify()`` passes with a user's own extra tables and views and fails naming each kit table
dropped; Temporal's ``_translated`` retries ``StorePermissionError``; a hung ``verify()``
does not hang the drain (the worker returns at its drain deadline, the run stays wanted).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import secrets
import sqlite3
import time
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
    Worker,
    open_stores,
)
from tesserix_adk.cli import ExitCode
from tesserix_adk.cli.failures import explain
from tesserix_adk.cli.main import main as tesserix
from tesserix_adk.errors import (
    SchemaMismatchError,
    StorePermissionError,
    StoreUnavailableError,
)
from tesserix_adk.stores.protocols import WorkState

T = "acme"


async def _act(n: str) -> str:
    """Act."""
    return "ok"


def _agent() -> Agent:
    return Agent("a", "Act.", [Tool(_act, name="act")])


def _turns() -> ScriptedProvider:
    return ScriptedProvider([[("act", {"n": "1"})], "done"])


class _ForeignPermission:
    """A provider of the run's own whose cache (a Redis of its own) refuses its ACL user."""

    async def complete(self, request: Any) -> Any:
        raise StorePermissionError(
            "Redis refused reading the prompt cache: this user has no permissions to run "
            "the 'get' command"
        )


class _ForeignSchema:
    """A provider of the run's own that reads a store of its own, whose schema is old."""

    async def complete(self, request: Any) -> Any:
        raise SchemaMismatchError(
            "the SQLite store /srv/catalog.sqlite3 has schema version 5, this kit needs 6"
        )


@contextlib.asynccontextmanager
async def _sqlite(tmp_path: Path) -> AsyncIterator[Any]:
    async with open_stores(f"sqlite:///{tmp_path / 'adk.sqlite3'}") as stores:
        await stores.create_schema()
        yield stores


async def _workers_stopped(stores: Any, make_runner: Any, tries: int = 4) -> int:
    stopped = 0
    for _ in range(tries):
        worker = Worker(
            make_runner(), [_agent()], poll_interval=0.01, exit_when_idle=True, max_attempts=2
        )
        try:
            await asyncio.wait_for(worker.run(), 15)
        except (SchemaMismatchError, StorePermissionError):
            stopped += 1
    return stopped


# --- 1. a permission error not about the worker's store ------------------------------------


@pytest.mark.xfail(
    strict=True,
    reason=(
        "a limit README's 'Upgrading a store' names: a StorePermissionError a run meets "
        "always stops its worker (worker.py Worker._whose): a grant missing may be a "
        "write's, which the store's read-only check cannot see, so one from a run's own "
        "model (a second store of the kit) cannot be told apart"
    ),
)
async def test_a_permission_error_not_about_the_workers_store_does_not_stop_every_worker(
    tmp_path: Path,
) -> None:
    async with _sqlite(tmp_path) as stores:
        await AgentRunner.from_stores(_turns(), stores).submit(
            _agent(), "go", tenant=T, run_id="p1"
        )
        stopped = await _workers_stopped(
            stores, lambda: AgentRunner.from_stores(_ForeignPermission(), stores)
        )
        [item] = await stores.work.items(T)
        assert stopped <= 2 and item.state is WorkState.parked, (stopped, item)


async def test_a_tool_raising_a_permission_error_is_the_runs_and_no_worker_stops(
    tmp_path: Path,
) -> None:
    async def act(n: str) -> str:
        """Act."""
        raise StorePermissionError("Redis refused reading the catalog: NOPERM")

    agent = Agent("a", "Act.", [Tool(act, name="act")])
    async with _sqlite(tmp_path) as stores:
        await AgentRunner.from_stores(_turns(), stores).submit(agent, "go", tenant=T, run_id="t1")
        worker = Worker(
            AgentRunner.from_stores(_turns(), stores),
            [agent],
            poll_interval=0.01,
            exit_when_idle=True,
        )
        await asyncio.wait_for(worker.run(), 15)  # does not raise
        assert [(i.run_id, str(h)) for i, h in worker.carried] == [("t1", "finished")]
        assert await stores.work.items(T) == []


# --- 2, 3. the check itself: an outage, none at all, a hang --------------------------------


async def test_a_blip_during_the_check_does_not_stop_the_worker_on_a_foreign_schema_error(
    tmp_path: Path,
) -> None:
    async with _sqlite(tmp_path) as stores:
        await AgentRunner.from_stores(_turns(), stores).submit(
            _agent(), "go", tenant=T, run_id="f1"
        )
        runner = AgentRunner.from_stores(_ForeignSchema(), stores)
        blips = [StoreUnavailableError("the store did not answer in time", retryable=True)]

        async def verify_once_down() -> None:
            if blips:
                raise blips.pop()
            await stores.verify()

        runner.verify_stores = verify_once_down
        await stores.verify()  # the worker's own schema is fine
        worker = Worker(runner, [_agent()], poll_interval=0.01, exit_when_idle=True, max_attempts=3)
        await asyncio.wait_for(worker.run(), 15)  # raises SchemaMismatchError today


@pytest.mark.xfail(
    strict=True,
    reason=(
        "a limit README's 'Upgrading a store' names: a runner built without "
        "AgentRunner.from_stores has no verify_stores, so worker.py Worker._whose takes "
        "every schema error as the store's"
    ),
)
async def test_a_hand_built_runner_does_not_stop_every_worker_on_a_foreign_schema_error(
    tmp_path: Path,
) -> None:
    async with _sqlite(tmp_path) as stores:
        await AgentRunner.from_stores(_turns(), stores).submit(
            _agent(), "go", tenant=T, run_id="h1"
        )

        def by_hand() -> AgentRunner:
            return AgentRunner(
                _ForeignSchema(),
                idempotency=stores.idempotency,
                checkpoints=Checkpointer.from_stores(stores),
                leases=stores.leases,
                ledger=stores.ledger,
                approvals=stores.approvals,
                work=stores.work,
            )

        assert by_hand().verify_stores is None
        stopped = await _workers_stopped(stores, by_hand)
        [item] = await stores.work.items(T)
        assert stopped <= 2 and item.state is WorkState.parked, (stopped, item)


async def _hung_check_drained(tmp_path: Path) -> tuple[float, Any]:
    """A worker whose verify() never returns, drained: how long the drain took, the item."""
    async with _sqlite(tmp_path) as stores:
        await AgentRunner.from_stores(_turns(), stores).submit(
            _agent(), "go", tenant=T, run_id="g1"
        )
        runner = AgentRunner.from_stores(_ForeignSchema(), stores)
        checking = asyncio.Event()

        async def hangs() -> None:
            checking.set()
            await asyncio.Event().wait()

        runner.verify_stores = hangs
        worker = Worker(runner, [_agent()], poll_interval=0.01, drain_timeout=0.5)
        task = asyncio.create_task(worker.run())
        try:
            await asyncio.wait_for(checking.wait(), 10)
            began = time.monotonic()
            worker.drain()
            await asyncio.wait_for(task, 10)
            took = time.monotonic() - began
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
        [item] = await stores.work.items(T)
        return took, item


async def test_a_hung_check_does_not_hang_the_drain(tmp_path: Path) -> None:
    took, item = await _hung_check_drained(tmp_path)
    assert took < 5, took
    assert item.state is WorkState.wanted, item


async def test_a_take_the_drain_cancels_during_the_check_is_given_back(tmp_path: Path) -> None:
    _, item = await _hung_check_drained(tmp_path)
    assert item.attempts == 0, item


# --- 4. SQLite verify ---------------------------------------------------------------------


def _alter(path: Path, *statements: str) -> None:
    conn = sqlite3.connect(path)
    try:
        for statement in statements:
            conn.execute(statement)
        conn.commit()
    finally:
        conn.close()


async def test_sqlite_verify_passes_with_a_users_own_tables_and_names_each_gone(
    tmp_path: Path,
) -> None:
    path = tmp_path / "adk.sqlite3"
    url = f"sqlite:///{path}"
    async with open_stores(url) as stores:
        await stores.create_schema()
    _alter(path, "CREATE TABLE mine (x)", "CREATE VIEW my_view AS SELECT 1 AS one")
    async with open_stores(url) as stores:
        await stores.verify()
    _alter(path, "DROP TABLE adk_approvals", "DROP TABLE adk_ledger")
    async with open_stores(url) as stores:
        with pytest.raises(SchemaMismatchError) as raised:
            await stores.verify()
    said = str(raised.value)
    assert "adk_approvals" in said and "adk_ledger" in said and "schema apply" in said, said
    code, line = explain(raised.value)
    assert code == ExitCode.NOTHING_CHECKPOINTED and "\n" not in line, (code, line)


@pytest.mark.parametrize(
    "stand_in",
    [
        "CREATE INDEX adk_approvals ON adk_work (tenant)",
        "CREATE TRIGGER adk_approvals AFTER INSERT ON adk_work BEGIN SELECT 1; END",
        "CREATE VIEW adk_approvals AS SELECT 1 AS one",
    ],
    ids=["index", "trigger", "view"],
)
async def test_sqlite_verify_is_not_fooled_by_another_object_named_like_a_kit_table(
    tmp_path: Path, stand_in: str
) -> None:
    path = tmp_path / "adk.sqlite3"
    url = f"sqlite:///{path}"
    async with open_stores(url) as stores:
        await stores.create_schema()
    _alter(path, "DROP TABLE adk_approvals", stand_in)
    async with open_stores(url) as stores:
        with pytest.raises(SchemaMismatchError):
            await stores.verify()


# --- the command line and explain ----------------------------------------------------------


def _cli(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = tesserix(argv)
    return code, out.getvalue(), err.getvalue()


def _one_line(err: str) -> None:
    assert err.count("\n") == 1 and err.startswith("tesserix: "), err
    assert "Traceback" not in err, err


def test_explain_gives_a_permission_refusal_exit_2() -> None:
    code, line = explain(
        StorePermissionError("PostgreSQL refused claiming 'k': permission denied for table x")
    )
    assert code == ExitCode.USAGE and line.startswith("tesserix: PostgreSQL refused"), line


async def test_postgres_worker_meeting_a_missing_grant_exits_2_and_gives_the_run_back(
    tmp_path: Path,
) -> None:
    import psycopg

    agent_ref, sent = booking_agent_file(tmp_path, approval=True)
    name = f"store_wide_{secrets.token_hex(5)}"
    try:
        admin = await psycopg.AsyncConnection.connect(
            services.POSTGRES_URL, autocommit=True, connect_timeout=3
        )
    except psycopg.OperationalError as exc:
        services.unavailable(f"PostgreSQL cannot be reached: {exc}")
    try:
        await admin.execute(f'CREATE SCHEMA "{name}"')
        url = services.with_query(services.POSTGRES_URL, schema=name)
        async with open_stores(url) as stores:
            await stores.create_schema()
            agent = Agent("booking", "Book.", [Tool(_act, name="book", requires_approval=True)])
            await AgentRunner.from_stores(_turns(), stores).submit(
                agent, "go", tenant=T, run_id="r1"
            )
        # A grant missing on adk_approvals, as the server says it, in this test's own schema.
        await admin.execute(
            f'CREATE FUNCTION "{name}".deny() RETURNS trigger LANGUAGE plpgsql AS $$ '
            "BEGIN RAISE EXCEPTION 'permission denied for table adk_approvals' "
            "USING ERRCODE = 'insufficient_privilege'; END $$"
        )
        await admin.execute(
            f'CREATE TRIGGER deny BEFORE INSERT ON "{name}".adk_approvals '
            f'FOR EACH ROW EXECUTE FUNCTION "{name}".deny()'
        )
        argv = ["--store", url, "worker", "--agent", agent_ref, "--exit-when-idle"]
        for _ in range(2):
            code, out, err = await asyncio.to_thread(_cli, argv)
            assert code == ExitCode.USAGE, (code, err)  # docs/deploying.md: exit 2
            _one_line(err)
            assert "permission denied for table adk_approvals" in err, err
            assert "the worker stops" in out, out
        async with open_stores(url) as stores:
            [item] = await stores.work.items(T)
        assert (item.state, item.attempts) == (WorkState.wanted, 0), item
        await admin.execute(f'DROP TRIGGER deny ON "{name}".adk_approvals')
        code, _, err = await asyncio.to_thread(_cli, argv)
        assert code == ExitCode.CARRIED_ON, err
        async with open_stores(url) as stores:
            assert await stores.work.items(T) == []  # not parked: waiting on its approval
        code, out, err = await asyncio.to_thread(
            _cli, ["--store", url, "inspect", "r1", "--tenant", T]
        )
        assert code == ExitCode.CARRIED_ON and "waiting on approval" in out, (code, out, err)
        assert not sent.exists()  # the call needs an approval: nothing went out
    finally:
        with contextlib.suppress(Exception):
            await admin.execute(f'DROP SCHEMA "{name}" CASCADE')
        await admin.close()


def test_redis_user_without_a_command_gets_exit_2_in_one_line(tmp_path: Path) -> None:
    import redis

    from adapters.throwaway import redis_server

    agent_ref, _ = booking_agent_file(tmp_path, approval=True)
    with redis_server() as server:
        client = redis.Redis.from_url(server.url)
        try:
            client.execute_command(
                "ACL", "SETUSER", "lim", "on", ">pw", "~*", "&*", "+@all", "-evalsha", "-eval"
            )
        finally:
            client.close()
        url = f"redis://lim:pw@127.0.0.1:{server.port}/0?allow_volatile=true"
        for argv in (
            ["runs", "--tenant", T],
            ["worker", "--agent", agent_ref, "--exit-when-idle"],
        ):
            code, _, err = _cli(["--store", url, *argv])
            assert code == ExitCode.USAGE, (argv, code, err)
            _one_line(err)
            assert "Redis refused" in err and "evalsha" in err, err


async def test_on_temporal_a_permission_refusal_is_retried() -> None:
    pytest.importorskip("temporalio")
    from temporalio.exceptions import ApplicationError

    from tesserix_adk.checkpoint.redaction import Redactor
    from tesserix_adk.temporal.activities import _translated

    async def refused() -> None:
        raise StorePermissionError("PostgreSQL refused claiming 'k': permission denied")

    with pytest.raises(ApplicationError) as raised:
        await _translated(refused(), Redactor())
    assert raised.value.type == "StorePermissionError"
    assert not raised.value.non_retryable
