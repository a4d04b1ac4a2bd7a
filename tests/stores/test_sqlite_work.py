"""The SQLite work index's own traps (its conformance suite, ``TestWorkIndex``, runs in
``tests/stores/test_conformance.py``): the file it lives in, the bound on what ``due``
reads, and damaged rows."""

from __future__ import annotations

import sqlite3
from collections.abc import AsyncIterator, Iterator
from contextlib import closing, contextmanager
from pathlib import Path

import pytest

from tesserix_adk.errors import CheckpointCorruptError, ConfigurationError
from tesserix_adk.stores import open_stores
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.stores.protocols import WorkState
from tesserix_adk.stores.sqlite import SqliteWorkIndex, open_sqlite_stores
from tesserix_adk.stores.sqlite.work import MAX_AGENT_HEADS

T = "acme"
A = "booking"
LONG = 3600.0


@contextmanager
def raw(path: Path) -> Iterator[sqlite3.Connection]:
    """A plain connection to the file, outside the stores, committing on exit."""
    with closing(sqlite3.connect(path)) as conn, conn:
        yield conn


@pytest.fixture
async def stores(tmp_path: Path) -> AsyncIterator[Stores]:
    async with open_sqlite_stores(tmp_path / "adk.sqlite3") as opened:
        await opened.create_schema()
        yield opened


def _work(stores: Stores) -> SqliteWorkIndex:
    assert isinstance(stores.work, SqliteWorkIndex)
    return stores.work


def _ids(items: list) -> list[str]:  # type: ignore[type-arg]
    return [i.run_id for i in items]


async def test_open_stores_keeps_a_work_index_on_the_leases_file(tmp_path: Path) -> None:
    stores = open_stores(f"sqlite:///{tmp_path}/adk.sqlite3")
    async with stores:
        assert _work(stores).database is stores.leases.database  # type: ignore[attr-defined]


async def test_a_version_3_file_gains_the_work_index_on_schema_apply(tmp_path: Path) -> None:
    from tesserix_adk.stores.sqlite import SQLITE_MIGRATIONS

    path = tmp_path / "adk.sqlite3"
    with raw(path) as conn:  # a file exactly as version 3 of the kit left it
        conn.executescript("".join(SQLITE_MIGRATIONS[:3]))
        conn.execute("INSERT INTO adk_schema_version (id, version) VALUES (1, 3)")
        conn.execute(
            "INSERT INTO adk_run_leases (tenant, run_id, fence, holder, expires_at) "
            "VALUES ('acme', 'kept', 4, NULL, 0)"
        )
    async with open_sqlite_stores(path) as stores:
        with pytest.raises(ConfigurationError, match=r"schema version 3\b.*tesserix schema apply"):
            await _work(stores).due(limit=10)
    async with open_sqlite_stores(path) as stores:
        await stores.create_schema()
        await stores.verify()
        work = _work(stores)
        assert await work.submit(T, "r1", agent=A, input=b"in")
        assert _ids(await work.due(limit=10)) == ["r1"]
        lease = await stores.leases.acquire(T, "kept", "worker-a", 30)
        assert lease.fence == 5  # the rows already there are kept


async def test_due_finds_runs_behind_many_held_ones_in_one_statement(stores: Stores) -> None:
    work = _work(stores)
    for n in range(40):
        await work.want(T, f"held-{n:02}", agent=A)
        await stores.leases.acquire(T, f"held-{n:02}", "worker-a", LONG)
    await work.want(T, "free-1", agent=A)
    await work.want(T, "free-2", agent=A)
    assert _ids(await work.due(limit=2)) == ["free-1", "free-2"]


async def test_a_lease_is_live_by_the_lease_table_as_the_lease_store_sees_it(
    stores: Stores, tmp_path: Path
) -> None:
    work = _work(stores)
    for run_id in ("lapsed", "released", "live"):
        await work.want(T, run_id, agent=A)
    with raw(tmp_path / "adk.sqlite3") as conn:
        now = conn.execute("SELECT (julianday('now') - 2440587.5) * 86400.0").fetchone()[0]
        conn.executemany(
            "INSERT INTO adk_run_leases (tenant, run_id, fence, holder, expires_at) "
            "VALUES (?, ?, 1, ?, ?)",
            [
                (T, "lapsed", "worker-a", now - 1),
                (T, "released", None, now + LONG),
                (T, "live", "worker-a", now + LONG),
            ],
        )
    assert sorted(_ids(await work.due(limit=10))) == ["lapsed", "released"]
    assert await stores.leases.current(T, "live") is not None
    assert await stores.leases.current(T, "lapsed") is None


async def test_the_scan_is_bounded_past_the_limit(stores: Stores) -> None:
    # A bound that cannot be seen cannot be trusted: with scan 3, three held runs at the
    # head are skipped and a fourth hides the due run behind it. The ids sort as the runs
    # were wanted: SQLite's clock has millisecond steps, and ties are taken by id.
    work = SqliteWorkIndex(_work(stores).database, scan=3)
    for n in range(3):
        await work.want(T, f"r{n}-held", agent=A)
        await stores.leases.acquire(T, f"r{n}-held", "worker-a", LONG)
    await work.want(T, "r3-free", agent=A)
    assert _ids(await work.due(limit=1)) == ["r3-free"]
    await stores.leases.acquire(T, "r3-free", "worker-a", LONG)
    await work.want(T, "r4-behind", agent=A)
    assert await work.due(limit=1) == []
    assert _ids(await work.due(limit=2)) == ["r4-behind"]


async def test_each_agent_asked_for_has_a_head_of_its_own(stores: Stores) -> None:
    # Runs of other agents at the head use up no part of the scan.
    work = SqliteWorkIndex(_work(stores).database, scan=0)
    for n in range(5):
        await work.want(T, f"other-{n}", agent="refunds")
    await work.want(T, "mine", agent=A)
    assert _ids(await work.due(limit=1, agents=[A, A])) == ["mine"]
    assert _ids(await work.due(limit=2, agents=["refunds", A])) == ["other-0", "other-1"]
    assert await work.due(limit=5, agents=[]) == []


async def test_more_agents_than_heads_are_still_kept_to(stores: Stores) -> None:
    work = _work(stores)
    await work.want(T, "b", agent="booking")
    await work.want(T, "r", agent="refunds")
    many = [f"agent-{n}" for n in range(MAX_AGENT_HEADS)] + ["refunds"]
    assert _ids(await work.due(limit=10, agents=many)) == ["r"]
    assert _ids(await work.due(limit=10, agents=[*many, "booking"])) == ["b", "r"]


async def _steps_of_due(stores: Stores, work: SqliteWorkIndex) -> int:
    """How many SQLite virtual-machine steps one ``due(limit=2)`` runs: what it reads."""
    steps = [0]

    def count() -> int:
        steps[0] += 1
        return 0

    await work.database.read(lambda conn: conn.set_progress_handler(count, 1))
    try:
        await work.due(limit=2)  # a first call may read the schema
        steps[0] = 0
        assert len(await work.due(limit=2)) == 2
        return steps[0]
    finally:
        await work.database.read(lambda conn: conn.set_progress_handler(None, 1))


async def test_finding_work_reads_the_same_however_many_runs_are_behind_the_head(
    stores: Stores,
) -> None:
    work = SqliteWorkIndex(_work(stores).database, scan=3)
    for n in range(10):
        await work.want(T, f"w{n:04}", agent=A)
        await work.submit(T, f"d{n:04}", agent=A, input=b"")
        await work.done(T, f"d{n:04}")
        await work.park(T, f"p{n:04}", agent=A, reason="in doubt")
    few = await _steps_of_due(stores, work)
    for n in range(10, 400):
        await work.want(T, f"w{n:04}", agent=A)
        await work.submit(T, f"d{n:04}", agent=A, input=b"")
        await work.done(T, f"d{n:04}")
        await work.park(T, f"p{n:04}", agent=A, reason="in doubt")
    many = await _steps_of_due(stores, work)
    assert many == few, f"due ran {many} steps with 1200 runs, {few} with 30"


async def test_due_reads_the_partial_indexes(stores: Stores, tmp_path: Path) -> None:
    from tesserix_adk.stores.sqlite.work import _due_statement

    with raw(tmp_path / "adk.sqlite3") as conn:
        for agents, index in ((None, "adk_work_due"), ([A, "refunds"], "adk_work_due_by_agent")):
            plan = conn.execute(
                "EXPLAIN QUERY PLAN " + _due_statement(agents),
                {"row_limit": 5, "scan": 10, "agent0": A, "agent1": "refunds"},
            ).fetchall()
            lines = [detail for *_, detail in plan if "adk_work " in f"{detail} "]
            assert lines and all(f"USING INDEX {index}" in line for line in lines), plan
        # Rows that want no worker are not in the due index at all.
        await _work(stores).submit(T, "r1", agent=A, input=b"")
        await _work(stores).done(T, "r1")
        (indexed,) = conn.execute(
            "SELECT count(*) FROM adk_work INDEXED BY adk_work_due WHERE take_order IS NOT NULL"
        ).fetchone()
        assert indexed == 0


@pytest.mark.parametrize(
    ("damage", "what"),
    [
        ("UPDATE adk_work SET since = 'yesterday'", "work index entry"),
        ("UPDATE adk_work SET attempts = 'many'", "work index entry"),
        ("UPDATE adk_work SET state = 'someday'", "work index entry"),
    ],
)
async def test_a_damaged_entry_is_a_typed_error(
    stores: Stores, tmp_path: Path, damage: str, what: str
) -> None:
    work = _work(stores)
    await work.park(T, "r1", agent=A, reason="why")
    with raw(tmp_path / "adk.sqlite3") as conn:
        conn.execute("PRAGMA ignore_check_constraints = ON")  # as a hand edit might
        conn.execute(damage)
    with pytest.raises(CheckpointCorruptError, match=what):
        await work.items(T)


async def test_a_damaged_entry_or_input_is_a_typed_error_and_left_out_of_a_poll(
    stores: Stores, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    work = _work(stores)
    await work.submit(T, "r1", agent=A, input=b"in")
    await work.submit(T, "r2", agent=A, input=b"in")
    with raw(tmp_path / "adk.sqlite3") as conn:
        conn.execute(
            "UPDATE adk_work SET input = 'text, not bytes', agent = X'00' WHERE run_id = 'r1'"
        )
    with pytest.raises(CheckpointCorruptError, match="work index input"):
        await work.input(T, "r1")
    with pytest.raises(CheckpointCorruptError, match="work index entry"):
        await work.items(T)  # an operator's listing says so
    # A worker's poll leaves it out, naming it once, and still finds the others.
    assert [i.run_id for i in await work.due(limit=10)] == ["r2"]
    assert [i.run_id for i in await work.due(limit=10)] == ["r2"]
    named = [r.getMessage() for r in caplog.records if "acme/r1" in r.getMessage()]
    assert len(named) == 1 and "left out" in named[0]


async def test_the_schema_refuses_a_state_no_kit_writes(stores: Stores, tmp_path: Path) -> None:
    await _work(stores).submit(T, "r1", agent=A, input=b"")
    with raw(tmp_path / "adk.sqlite3") as conn, pytest.raises(sqlite3.IntegrityError):
        conn.execute("UPDATE adk_work SET state = 'someday'")


async def test_a_want_in_a_state_that_wants_no_worker_is_refused(stores: Stores) -> None:
    work = _work(stores)
    for state in (WorkState.parked, WorkState.done):
        with pytest.raises(ValueError, match="decided, wanted or submitted"):
            await work.want(T, "r1", agent=A, state=state)
    assert await work.items() == []


def test_a_negative_scan_is_refused(tmp_path: Path) -> None:
    stores = open_sqlite_stores(tmp_path / "adk.sqlite3")
    with pytest.raises(ValueError, match="scan"):
        SqliteWorkIndex(_work(stores).database, scan=-1)
