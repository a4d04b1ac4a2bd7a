"""What the SQLite stores guarantee beyond the conformance suites: the file, its schema,
durability settings, writes that grow with the step, and several real processes on one file.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import closing, contextmanager
from pathlib import Path

import pytest

from tesserix_adk import Checkpointer
from tesserix_adk.errors import (
    CheckpointCorruptError,
    CheckpointFormatError,
    ConfigurationError,
    StaleFenceError,
    StoreUnavailableError,
)
from tesserix_adk.stores.protocols import RecordStatus, RunLease, ToolFlags
from tesserix_adk.stores.sqlite import (
    SQLITE_SCHEMA,
    SQLITE_SCHEMA_VERSION,
    SqliteCheckpointStore,
    SqliteDatabase,
    SqliteHistoryStore,
    SqliteIdempotencyStore,
    SqliteLeaseStore,
    SqliteSchema,
    open_sqlite_stores,
)

GOLDEN = Path(__file__).parent.parent / "checkpoint" / "golden" / "format1_frontier.json"
INJECTION = "x'); DROP TABLE adk_frontiers; --"


@contextmanager
def raw(path: Path) -> Iterator[sqlite3.Connection]:
    """A plain connection to the file, outside the stores, committing on exit."""
    with closing(sqlite3.connect(path)) as conn, conn:
        yield conn


@pytest.fixture
async def database(tmp_path: Path) -> AsyncIterator[SqliteDatabase]:
    db = SqliteDatabase(tmp_path / "adk.sqlite3")
    await db.create_schema()
    yield db
    await db.aclose()


# --- the file and its schema -------------------------------------------------------------


def test_importing_and_opening_creates_nothing(tmp_path: Path) -> None:
    code = textwrap.dedent(
        """
        import tesserix_adk.stores.sqlite
        from tesserix_adk.stores import open_stores
        from tesserix_adk.stores.sqlite import open_sqlite_stores
        open_stores("sqlite:///data/adk.sqlite3")
        open_sqlite_stores("more/adk.sqlite3")
        """
    )
    subprocess.run([sys.executable, "-c", code], cwd=tmp_path, check=True)
    assert list(tmp_path.iterdir()) == []


async def test_a_store_used_on_a_missing_file_names_schema_apply_and_creates_nothing(
    tmp_path: Path,
) -> None:
    path = tmp_path / "absent" / "adk.sqlite3"
    async with open_sqlite_stores(path) as stores:
        with pytest.raises(ConfigurationError, match="tesserix schema apply"):
            await stores.checkpoints.latest("acme", "run-1")
        with pytest.raises(ConfigurationError, match="tesserix schema apply"):
            await stores.leases.acquire("acme", "run-1", "worker-a", 30)
        with pytest.raises(ConfigurationError, match="tesserix schema apply"):
            await stores.verify()
    assert not path.parent.exists()


async def test_a_store_used_on_a_file_without_the_schema_names_schema_apply(
    tmp_path: Path,
) -> None:
    path = tmp_path / "adk.sqlite3"
    with raw(path):
        pass  # an empty database file, as another tool might leave it
    async with open_sqlite_stores(path) as stores:
        with pytest.raises(ConfigurationError, match="tesserix schema apply") as refused:
            await stores.idempotency.lookup(["k1"], tenant="acme")
        assert "\n" not in str(refused.value)
        with pytest.raises(ConfigurationError, match="tesserix schema apply"):
            await stores.verify()
    with raw(path) as conn:
        assert conn.execute("SELECT count(*) FROM sqlite_master").fetchone() == (0,)


async def test_create_schema_creates_the_directory_file_and_tables(tmp_path: Path) -> None:
    path = tmp_path / "nested" / "dir" / "adk.sqlite3"
    async with open_sqlite_stores(path) as stores:
        await stores.create_schema()
        await stores.verify()
        await stores.checkpoints.put("acme", "run-1", b"frontier", step=1, fence=1)
    with raw(path) as conn:
        tables = {name for (name,) in conn.execute("SELECT name FROM sqlite_master")}
    for table in (
        "adk_schema_version",
        "adk_fences",
        "adk_frontiers",
        "adk_checkpoint_steps",
        "adk_idempotency",
        "adk_run_leases",
        "adk_history",
        "adk_ledger",
        "adk_approvals",
        "adk_work",
    ):
        assert table in tables
        assert table in SQLITE_SCHEMA


async def test_create_schema_twice_is_fine_and_keeps_the_data(tmp_path: Path) -> None:
    path = tmp_path / "adk.sqlite3"
    async with open_sqlite_stores(path) as stores:
        await stores.create_schema()
        await stores.checkpoints.put("acme", "run-1", b"kept", step=1)
        await stores.create_schema()
    async with open_sqlite_stores(path) as again:
        await again.create_schema()
        latest = await again.checkpoints.latest("acme", "run-1")
        assert latest is not None and latest.payload == b"kept"
    with raw(path) as conn:
        versions = conn.execute("SELECT id, version FROM adk_schema_version").fetchall()
    assert versions == [(1, SQLITE_SCHEMA_VERSION)]


async def test_create_schema_sets_wal(database: SqliteDatabase) -> None:
    with raw(Path(database.path)) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone() == ("wal",)


@pytest.mark.parametrize("found", [SQLITE_SCHEMA_VERSION + 1, 0])
async def test_verify_refuses_a_different_schema_version(tmp_path: Path, found: int) -> None:
    path = tmp_path / "adk.sqlite3"
    async with open_sqlite_stores(path) as stores:
        await stores.create_schema()
    with raw(path) as conn:
        conn.execute("UPDATE adk_schema_version SET version = ?", (found,))
    async with open_sqlite_stores(path) as stores:
        with pytest.raises(ConfigurationError, match=f"schema version {found}"):
            await stores.verify()
        with pytest.raises(ConfigurationError, match=f"schema version {found}"):
            await stores.checkpoints.latest("acme", "run-1")


async def test_create_schema_refuses_a_newer_schema(tmp_path: Path) -> None:
    path = tmp_path / "adk.sqlite3"
    async with open_sqlite_stores(path) as stores:
        await stores.create_schema()
    with raw(path) as conn:
        conn.execute("UPDATE adk_schema_version SET version = ?", (SQLITE_SCHEMA_VERSION + 1,))
    async with open_sqlite_stores(path) as stores:
        with pytest.raises(ConfigurationError, match="upgrade tesserix-adk"):
            await stores.create_schema()


def _insert_record(conn: sqlite3.Connection, key: str | None) -> None:
    conn.execute(
        "INSERT INTO adk_idempotency (key, status, holder, tenant, run_id, iteration, tool, "
        "call_id, side_effects, idempotent, since) "
        "VALUES (?, 'completed', 'w', 'acme', 'run-1', 0, 'book_seat', 'c1', 1, 0, 0)",
        (key,),
    )


async def test_a_null_idempotency_key_cannot_be_stored(database: SqliteDatabase) -> None:
    with raw(Path(database.path)) as conn:
        with pytest.raises(sqlite3.IntegrityError, match="NOT NULL"):
            _insert_record(conn, None)
        with pytest.raises(sqlite3.IntegrityError, match="NOT NULL"):
            conn.execute(
                "INSERT INTO adk_approvals (id, tenant, run_id, calls, iteration, status, "
                "requested_at) VALUES (NULL, 'acme', 'run-1', '[]', 0, 'pending', 0)"
            )


async def test_a_version_1_file_is_migrated_by_schema_apply_and_keeps_its_records(
    tmp_path: Path,
) -> None:
    from tesserix_adk.stores.sqlite import SQLITE_MIGRATIONS

    path = tmp_path / "adk.sqlite3"
    with raw(path) as conn:  # a file exactly as version 1 of the kit left it
        conn.executescript(SQLITE_MIGRATIONS[0])
        conn.execute("INSERT INTO adk_schema_version (id, version) VALUES (1, 1)")
        _insert_record(conn, "k1")
    async with open_sqlite_stores(path) as stores:
        with pytest.raises(ConfigurationError, match="tesserix schema apply"):
            await stores.idempotency.lookup(["k1"], tenant="acme")
    async with open_sqlite_stores(path) as stores:
        await stores.create_schema()
        await stores.verify()
        assert (await stores.idempotency.lookup(["k1"], tenant="acme"))["k1"].tool == "book_seat"
    with raw(path) as conn:
        assert conn.execute("SELECT version FROM adk_schema_version").fetchone() == (
            SQLITE_SCHEMA_VERSION,
        )
        with pytest.raises(sqlite3.IntegrityError, match="NOT NULL"):
            _insert_record(conn, None)


def _idempotency_layout(conn: sqlite3.Connection) -> tuple[object, ...]:
    """The columns (name, type, not null, place in the primary key) and the indexes of
    ``adk_idempotency``."""
    columns = [
        (name, kind, notnull, pk)
        for _, name, kind, notnull, _, pk in conn.execute("PRAGMA table_info(adk_idempotency)")
    ]
    indexes = conn.execute(
        "SELECT name, sql FROM sqlite_master WHERE type = 'index' "
        "AND tbl_name = 'adk_idempotency' AND sql IS NOT NULL ORDER BY name"
    ).fetchall()
    return tuple(columns), tuple(indexes)


async def test_a_version_2_file_is_migrated_to_tenant_scoped_records_and_keeps_them(
    tmp_path: Path,
) -> None:
    from tesserix_adk.stores.sqlite import SQLITE_MIGRATIONS

    path = tmp_path / "adk.sqlite3"
    with raw(path) as conn:  # a file exactly as version 2 of the kit left it
        conn.executescript(SQLITE_MIGRATIONS[0] + SQLITE_MIGRATIONS[1])
        conn.execute("INSERT INTO adk_schema_version (id, version) VALUES (1, 2)")
        conn.execute(
            "INSERT INTO adk_idempotency (key, status, holder, tenant, run_id, iteration, "
            "tool, call_id, side_effects, idempotent, fence, outcome, since, completed_at) "
            "VALUES ('order-5', 'completed', 'worker-a', 'acme', 'run-1', 3, 'book_seat', "
            "'c1', 1, 0, 7, X'00FF', 100.5, 101.25)"
        )
    async with open_sqlite_stores(path) as stores:
        with pytest.raises(ConfigurationError, match=r"schema version 2\b.*tesserix schema apply"):
            await stores.idempotency.lookup(["order-5"], tenant="acme")
    async with open_sqlite_stores(path) as stores:
        await stores.create_schema()
        await stores.verify()
        kept = (await stores.idempotency.lookup(["order-5"], tenant="acme"))["order-5"]
        assert (kept.status, kept.holder, kept.tenant, kept.run_id) == (
            RecordStatus.completed,
            "worker-a",
            "acme",
            "run-1",
        )
        assert (kept.iteration, kept.tool, kept.call_id, kept.fence) == (3, "book_seat", "c1", 7)
        assert kept.flags == ToolFlags(side_effects=True, idempotent=False)
        assert (kept.outcome, kept.since, kept.completed_at) == (b"\x00\xff", 100.5, 101.25)
        assert await stores.idempotency.records("acme", "run-1") == [kept]
        # The same key is now a record of its own under another tenant.
        assert await stores.idempotency.lookup(["order-5"], tenant="globex") == {}
        theirs = await stores.idempotency.claim(
            "order-5",
            holder="worker-b",
            tenant="globex",
            run_id="run-1",
            iteration=0,
            tool="book_seat",
            call_id="c9",
            flags=ToolFlags(),
        )
        assert (theirs.status, theirs.tenant, theirs.holder) == (
            RecordStatus.in_flight,
            "globex",
            "worker-b",
        )
        assert (await stores.idempotency.lookup(["order-5"], tenant="acme"))["order-5"] == kept
    fresh_path = tmp_path / "fresh.sqlite3"
    async with open_sqlite_stores(fresh_path) as fresh:
        await fresh.create_schema()
    with raw(path) as migrated, raw(fresh_path) as created:
        assert migrated.execute("SELECT version FROM adk_schema_version").fetchone() == (
            SQLITE_SCHEMA_VERSION,
        )
        # Migrated and created files end up alike: (tenant, key) is the primary key and
        # the run index is kept.
        assert _idempotency_layout(migrated) == _idempotency_layout(created)
        primary_key = sorted(
            (place, name)
            for _, name, _, _, _, place in migrated.execute("PRAGMA table_info(adk_idempotency)")
            if place
        )
        assert primary_key == [(1, "tenant"), (2, "key")]
        index_names = [
            name
            for name, _ in migrated.execute(
                "SELECT name, sql FROM sqlite_master WHERE type = 'index' "
                "AND tbl_name = 'adk_idempotency'"
            )
        ]
        # A run's records are found by index (since version 5, by run and iteration).
        assert "adk_idempotency_run_iteration" in index_names
        with pytest.raises(sqlite3.IntegrityError, match="NOT NULL"):
            _insert_record(migrated, None)


async def test_a_version_1_file_holding_a_null_key_is_refused_not_migrated(
    tmp_path: Path,
) -> None:
    from tesserix_adk.stores.sqlite import SQLITE_MIGRATIONS

    path = tmp_path / "adk.sqlite3"
    with raw(path) as conn:
        conn.executescript(SQLITE_MIGRATIONS[0])
        conn.execute("INSERT INTO adk_schema_version (id, version) VALUES (1, 1)")
        _insert_record(conn, None)
    async with open_sqlite_stores(path) as stores:
        with pytest.raises(ConfigurationError, match="no key"):
            await stores.create_schema()
    with raw(path) as conn:  # left as it was
        assert conn.execute("SELECT version FROM adk_schema_version").fetchone() == (1,)


def _layout(conn: sqlite3.Connection) -> list[tuple[object, ...]]:
    """Every object of the file's schema as ``sqlite_master`` holds it (its page aside)."""
    return conn.execute(
        "SELECT type, name, tbl_name, sql FROM sqlite_master ORDER BY type, name"
    ).fetchall()


async def test_a_file_built_from_the_migrations_matches_a_created_one(tmp_path: Path) -> None:
    from tesserix_adk.stores.sqlite import SQLITE_MIGRATIONS

    assert len(SQLITE_MIGRATIONS) == SQLITE_SCHEMA_VERSION
    built = tmp_path / "built.sqlite3"
    with raw(built) as conn:  # the migrations alone, one after another, as a reader would
        for migration in SQLITE_MIGRATIONS:
            conn.executescript(migration)
    created = tmp_path / "created.sqlite3"
    async with open_sqlite_stores(created) as stores:
        await stores.create_schema()
    upgraded = tmp_path / "upgraded.sqlite3"
    with raw(upgraded) as conn:  # a version-1 file, brought up by schema apply
        conn.executescript(SQLITE_MIGRATIONS[0])
        conn.execute("INSERT INTO adk_schema_version (id, version) VALUES (1, 1)")
    async with open_sqlite_stores(upgraded) as stores:
        await stores.create_schema()
    with raw(built) as b, raw(created) as c, raw(upgraded) as u:
        assert _layout(c) == _layout(b)
        assert _layout(u) == _layout(b)
        assert len(_layout(c)) > 9


async def test_schema_apply_on_a_current_file_puts_back_a_table_dropped_by_hand(
    tmp_path: Path,
) -> None:
    path = tmp_path / "adk.sqlite3"
    fresh = tmp_path / "fresh.sqlite3"
    async with open_sqlite_stores(path) as stores, open_sqlite_stores(fresh) as other:
        await stores.create_schema()
        await other.create_schema()
        await stores.idempotency.claim(
            "k1",
            holder="w",
            tenant="acme",
            run_id="run-1",
            iteration=0,
            tool="book_seat",
            call_id="c1",
            flags=ToolFlags(),
        )
    with raw(path) as conn:
        conn.execute("DROP TABLE adk_approvals")
        conn.execute("DROP INDEX adk_idempotency_run_iteration")
    async with open_sqlite_stores(path) as stores:
        await stores.create_schema()
        assert (await stores.idempotency.lookup(["k1"], tenant="acme"))["k1"].holder == "w"
    with raw(path) as conn, raw(fresh) as created:
        assert _layout(conn) == _layout(created)


def test_migrations_are_read_in_their_numbered_order(tmp_path: Path) -> None:
    (tmp_path / "0002_second.sql").write_text("CREATE TABLE IF NOT EXISTS b (x);\n")
    (tmp_path / "0001_first.sql").write_text("CREATE TABLE IF NOT EXISTS a (x);\n")
    (tmp_path / "README.md").write_text("not a migration")
    schema = SqliteSchema.read(tmp_path)
    assert schema.migrations == (
        "CREATE TABLE IF NOT EXISTS a (x);\n",
        "CREATE TABLE IF NOT EXISTS b (x);\n",
    )
    assert schema.version == 2
    assert "CREATE TABLE IF NOT EXISTS a (x);" in schema.ddl


@pytest.mark.parametrize(
    "names", [["0001_a.sql", "0003_c.sql"], ["0002_b.sql"], [], ["0001_a.sql", "0001_b.sql"]]
)
def test_migrations_with_a_gap_or_a_repeated_number_are_refused(
    tmp_path: Path, names: list[str]
) -> None:
    for name in names:
        (tmp_path / name).write_text("CREATE TABLE IF NOT EXISTS t (x);\n")
    with pytest.raises(ConfigurationError, match=r"without a gap|two SQLite migrations"):
        SqliteSchema.read(tmp_path)


def test_the_written_out_schema_applies_to_an_empty_file_and_again(tmp_path: Path) -> None:
    with raw(tmp_path / "adk.sqlite3") as conn:
        conn.executescript(SQLITE_SCHEMA)
        conn.executescript(SQLITE_SCHEMA)
        assert conn.execute("SELECT id, version FROM adk_schema_version").fetchall() == [
            (1, SQLITE_SCHEMA_VERSION)
        ]
    assert f"version {SQLITE_SCHEMA_VERSION}" in SQLITE_SCHEMA.splitlines()[0]


@pytest.mark.parametrize(("synchronous", "pragma"), [("full", 2), ("normal", 1)])
async def test_synchronous_setting_is_honoured(
    tmp_path: Path, synchronous: str, pragma: int
) -> None:
    db = SqliteDatabase(tmp_path / "adk.sqlite3", synchronous=synchronous)
    try:
        await db.create_schema()
        setting = await db.read(lambda conn: conn.execute("PRAGMA synchronous").fetchone()[0])
        assert setting == pragma
    finally:
        await db.aclose()


def test_full_is_the_default_and_anything_else_is_refused(tmp_path: Path) -> None:
    assert SqliteDatabase(tmp_path / "adk.sqlite3").synchronous == "full"
    with pytest.raises(ConfigurationError, match="synchronous"):
        SqliteDatabase(tmp_path / "adk.sqlite3", synchronous="off")


async def test_a_closed_database_refuses_work(database: SqliteDatabase) -> None:
    store = SqliteCheckpointStore(database)
    await store.put("acme", "run-1", b"x", step=1)
    await database.aclose()
    await database.aclose()
    with pytest.raises(ConfigurationError, match="closed"):
        await store.latest("acme", "run-1")


async def test_a_writer_that_holds_the_file_too_long_is_a_retryable_error(
    tmp_path: Path,
) -> None:
    path = tmp_path / "adk.sqlite3"
    db = SqliteDatabase(path, busy_timeout=0.2)
    try:
        await db.create_schema()
        store = SqliteIdempotencyStore(db)
        with closing(sqlite3.connect(path, isolation_level=None)) as other:
            other.execute("BEGIN IMMEDIATE")
            with pytest.raises(StoreUnavailableError) as refused:
                await store.claim(
                    "k1",
                    holder="worker-a",
                    tenant="acme",
                    run_id="run-1",
                    iteration=0,
                    tool="book_seat",
                    call_id="call_1",
                    flags=ToolFlags(),
                )
            assert refused.value.retryable
            other.execute("ROLLBACK")
        # The refused claim left nothing behind, and the store works once the file is free.
        assert await store.lookup(["k1"], tenant="acme") == {}
    finally:
        await db.aclose()


# --- writes grow with the step -----------------------------------------------------------


async def test_history_append_writes_only_the_new_rows(database: SqliteDatabase) -> None:
    path = Path(database.path)
    with raw(path) as conn:
        conn.execute("CREATE TABLE audit (action TEXT NOT NULL)")
        for action in ("INSERT", "UPDATE", "DELETE"):
            conn.execute(
                f"CREATE TRIGGER audit_{action.lower()} AFTER {action} ON adk_history "
                f"BEGIN INSERT INTO audit (action) VALUES ('{action}'); END"
            )

    def audit() -> dict[str, int]:
        with raw(path) as conn:
            rows = conn.execute("SELECT action, count(*) FROM audit GROUP BY action").fetchall()
            conn.execute("DELETE FROM audit")
        return dict(rows)

    def rows() -> int:
        with raw(path) as conn:
            return int(conn.execute("SELECT count(*) FROM adk_history").fetchone()[0])

    store = SqliteHistoryStore(database)
    handle = await store.append("acme", "run-1", [b"system", b"user"], fence=1, after=None)
    assert audit() == {"INSERT": 2}
    for turn in range(50):
        before = rows()
        handle = await store.append(
            "acme", "run-1", [f"assistant {turn}".encode(), b"tool"], fence=1, after=handle
        )
        assert rows() == before + 2
        assert audit() == {"INSERT": 2}
    assert handle.count == 102

    # A dead writer's tail is dropped row by row; the prefix is never rewritten.
    await store.append("acme", "run-1", [b"dead-1", b"dead-2", b"dead-3"], fence=1, after=handle)
    audit()
    carried = await store.append("acme", "run-1", [b"new"], fence=2, after=handle)
    assert audit() == {"DELETE": 3, "INSERT": 1}
    assert carried.count == 103 and rows() == 103
    assert (await store.fetch(carried))[-1] == b"new"


async def test_checkpoint_put_writes_one_step_row_and_one_frontier(
    database: SqliteDatabase,
) -> None:
    store = SqliteCheckpointStore(database, keep_last=3)
    for step in range(1, 11):
        await store.put("acme", "run-1", f"step {step}".encode(), step=step, fence=1)
    with raw(Path(database.path)) as conn:
        assert conn.execute("SELECT count(*) FROM adk_frontiers").fetchone() == (1,)
        assert conn.execute("SELECT step FROM adk_checkpoint_steps").fetchall() == [
            (8,),
            (9,),
            (10,),
        ]


async def test_a_frontier_is_stored_once_in_its_step_snapshot(database: SqliteDatabase) -> None:
    store = SqliteCheckpointStore(database)
    payload = b"a frontier of some size " * 40
    for step in range(1, 6):
        await store.put("acme", "run-1", payload + bytes([step]), step=step, fence=1)
    with raw(Path(database.path)) as conn:
        stored = conn.execute(
            "SELECT (SELECT sum(length(payload)) FROM adk_frontiers), "
            "(SELECT sum(length(payload)) FROM adk_checkpoint_steps)"
        ).fetchone()
    # Five snapshots, and the frontier row adds not one byte of payload to them.
    assert stored == (0, 5 * (len(payload) + 1))
    latest = await store.latest("acme", "run-1")
    assert latest is not None and latest.step == 5 and latest.payload == payload + b"\x05"


async def test_a_frontier_whose_snapshot_was_deleted_is_damaged_not_empty(
    database: SqliteDatabase,
) -> None:
    store = SqliteCheckpointStore(database)
    await store.put("acme", "run-1", b"frontier", step=1, fence=1)
    with raw(Path(database.path)) as conn:
        conn.execute("DELETE FROM adk_checkpoint_steps")
    with pytest.raises(CheckpointCorruptError):
        await Checkpointer(store).latest("acme", "run-1")


async def test_frontier_and_transcript_are_written_in_one_transaction(
    database: SqliteDatabase, tmp_path: Path
) -> None:
    checkpoints = SqliteCheckpointStore(database)
    history = SqliteHistoryStore(database)
    handle = await checkpoints.put_with_history(
        history, "acme", "run-1", b"frontier-1", step=1, fence=1, encoded=[b"m1"], after=None
    )
    assert handle is not None and handle.count == 1
    assert (await checkpoints.latest("acme", "run-1")).payload == b"frontier-1"  # type: ignore[union-attr]
    await history.seal("acme", "run-1", 2)
    # The transcript half is refused by the fence, so the frontier half is not written either.
    with pytest.raises(StaleFenceError):
        await checkpoints.put_with_history(
            history,
            "acme",
            "run-1",
            b"frontier-2",
            step=2,
            fence=1,
            encoded=[b"m2"],
            after=handle,
        )
    assert (await checkpoints.latest("acme", "run-1")).payload == b"frontier-1"  # type: ignore[union-attr]
    assert await history.fetch(handle) == [b"m1"]
    # A history store in another file cannot share the transaction: the caller writes twice.
    other = SqliteDatabase(tmp_path / "other.sqlite3")
    await other.create_schema()
    assert (
        await checkpoints.put_with_history(
            SqliteHistoryStore(other),
            "acme",
            "run-2",
            b"f",
            step=1,
            fence=None,
            encoded=[],
            after=None,
        )
        is None
    )
    await other.aclose()


# --- ids are data, never SQL -------------------------------------------------------------


async def test_ids_with_sql_injection_text_are_stored_verbatim(tmp_path: Path) -> None:
    path = tmp_path / "adk.sqlite3"
    async with open_sqlite_stores(path) as stores:
        await stores.create_schema()
        await stores.checkpoints.put(INJECTION, INJECTION, b"frontier", step=1, fence=1)
        lease = await stores.leases.acquire(INJECTION, INJECTION, INJECTION, 30)
        await stores.idempotency.claim(
            INJECTION,
            holder=INJECTION,
            tenant=INJECTION,
            run_id=INJECTION,
            iteration=0,
            tool=INJECTION,
            call_id=INJECTION,
            flags=ToolFlags(),
            fence=1,
        )
        assert await stores.checkpoints.runs(INJECTION) == [INJECTION]
        assert await stores.leases.current(INJECTION, INJECTION) == lease
        records = await stores.idempotency.records(INJECTION, INJECTION)
        assert [(r.key, r.holder, r.tool) for r in records] == [(INJECTION,) * 3]
    with raw(path) as conn:
        assert conn.execute("SELECT tenant, run_id FROM adk_frontiers").fetchall() == [
            (INJECTION, INJECTION)
        ]
        assert conn.execute("SELECT holder FROM adk_run_leases").fetchall() == [(INJECTION,)]


# --- several processes on one file -------------------------------------------------------

RACER = textwrap.dedent(
    """
    import asyncio, sys, time
    from tesserix_adk.errors import LeaseHeldError
    from tesserix_adk.stores.sqlite import SqliteDatabase, SqliteLeaseStore

    async def main() -> None:
        path, start, holder = sys.argv[1], float(sys.argv[2]), sys.argv[3]
        db = SqliteDatabase(path)
        try:
            await db.verify()  # connected before the start line, so all race at once
            await asyncio.sleep(max(0.0, start - time.time()))
            try:
                lease = await SqliteLeaseStore(db).acquire("acme", "run-1", holder, 3600)
            except LeaseHeldError as exc:
                print("HELD", exc.holder)
            else:
                print("WON", lease.fence)
        finally:
            await db.aclose()

    asyncio.run(main())
    """
)


def test_processes_racing_for_one_lease_have_exactly_one_winner(tmp_path: Path) -> None:
    path = tmp_path / "adk.sqlite3"

    async def create() -> None:
        async with open_sqlite_stores(path) as stores:
            await stores.create_schema()

    async def current() -> RunLease | None:
        async with open_sqlite_stores(path) as stores:
            return await stores.leases.current("acme", "run-1")

    asyncio.run(create())
    racers = 8
    start = time.time() + 3.0
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RACER, str(path), repr(start), f"worker-{i}"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(racers)
    ]
    outputs = []
    for proc in procs:
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        outputs.append(out.split())
    winners = [holder for holder, (verdict, _) in enumerate(outputs) if verdict == "WON"]
    assert len(winners) == 1, outputs
    winner = f"worker-{winners[0]}"
    assert sorted(outputs) == sorted([["WON", "1"]] + [["HELD", winner]] * (racers - 1))
    lease = asyncio.run(current())
    assert lease is not None and (lease.holder, lease.fence) == (winner, 1)


# --- payloads written straight into the database fail closed -----------------------------


def _newer_format() -> bytes:
    body = json.loads(GOLDEN.read_bytes())
    body["format"] = 99
    return json.dumps(body).encode()


@pytest.mark.parametrize(
    ("payload", "error"),
    [
        (b"\x00\xffnot a checkpoint at all", CheckpointCorruptError),
        (GOLDEN.read_bytes()[: len(GOLDEN.read_bytes()) // 2], CheckpointCorruptError),
        (b"", CheckpointCorruptError),
        (b"[1, 2, 3]", CheckpointCorruptError),
        (_newer_format(), CheckpointFormatError),
    ],
    ids=["garbage", "truncated", "empty", "not-an-object", "newer-format"],
)
async def test_a_bad_payload_in_the_frontier_table_fails_closed(
    database: SqliteDatabase, payload: bytes, error: type[Exception]
) -> None:
    with raw(Path(database.path)) as conn:
        for table in ("adk_frontiers", "adk_checkpoint_steps"):
            conn.execute(
                f"INSERT INTO {table} (tenant, run_id, step, fence, payload) "
                "VALUES (?, ?, ?, ?, ?)",
                ("acme", "run_1", 3, 1, payload),
            )
    checkpointer = Checkpointer(SqliteCheckpointStore(database))
    with pytest.raises(error):
        await checkpointer.latest("acme", "run_1")
    with pytest.raises(error):
        await checkpointer.at("acme", "run_1", 3)
    # Left untouched, for a newer reader or an operator.
    stored = await SqliteCheckpointStore(database).latest("acme", "run_1")
    assert stored is not None and stored.payload == payload


async def test_the_golden_payload_written_straight_in_reads_back(
    database: SqliteDatabase,
) -> None:
    with raw(Path(database.path)) as conn:
        conn.execute(
            "INSERT INTO adk_frontiers (tenant, run_id, step, fence, payload) "
            "VALUES (?, ?, ?, ?, ?)",
            ("acme", "run_1", 3, 1, GOLDEN.read_bytes()),
        )
    frontier = await Checkpointer(SqliteCheckpointStore(database)).latest("acme", "run_1")
    assert frontier is not None and frontier.step == 3


# --- the store's clock -------------------------------------------------------------------


async def test_lease_expiry_is_stamped_by_sqlites_clock(
    database: SqliteDatabase, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_time = time.time
    monkeypatch.setattr(time, "time", lambda: real_time() + 86400.0)
    lease = await SqliteLeaseStore(database).acquire("acme", "run-1", "worker-a", 30)
    assert abs(lease.expires_at - (real_time() + 30)) < 60


async def test_a_lease_in_the_same_file_counts_as_a_seen_fence(
    database: SqliteDatabase,
) -> None:
    checkpoints = SqliteCheckpointStore(database)
    leases = SqliteLeaseStore(database)
    first = await leases.acquire("acme", "run-1", "worker-a", 0.2)
    with pytest.raises(StaleFenceError):
        await checkpoints.put("acme", "run-1", b"unfenced", step=1)
    await checkpoints.put("acme", "run-1", b"a", step=1, fence=first.fence)
    await asyncio.sleep(0.3)
    second = await leases.acquire("acme", "run-1", "worker-b", 30)
    # Fenced out by the takeover itself, before the new holder sealed anything.
    with pytest.raises(StaleFenceError):
        await checkpoints.put("acme", "run-1", b"late", step=2, fence=first.fence)
    with pytest.raises(StaleFenceError):
        await checkpoints.seal("acme", "run-1", first.fence)
    await checkpoints.put("acme", "run-1", b"b", step=2, fence=second.fence)
    assert (await checkpoints.latest("acme", "run-1")).payload == b"b"  # type: ignore[union-attr]


_COMMIT_FAILS = textwrap.dedent(
    """
    import asyncio, os, resource, signal, sys
    from tesserix_adk.errors import StoreReplyLostError, StoreUnavailableError
    from tesserix_adk.stores.sqlite import SqliteCheckpointStore, SqliteDatabase

    async def main(path):
        db = SqliteDatabase(path)
        await db.create_schema()
        checkpoints = SqliteCheckpointStore(db)
        await checkpoints.put("acme", "r", b"small", step=0)
        # The file may not grow much more: the next commit's WAL write fails (EFBIG).
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        limit = os.path.getsize(path + "-wal") + 20000
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
        try:
            await checkpoints.put("acme", "r", b"y" * 200000, step=1)
        except StoreReplyLostError as exc:
            print("reply-lost", exc)
        except StoreUnavailableError as exc:
            print("unavailable", exc)
        else:
            print("written")
        await db.aclose()

    asyncio.run(main(sys.argv[1]))
    """
)


def test_a_commit_that_fails_midway_is_outcome_unknown(tmp_path: Path) -> None:
    # The failure comes at COMMIT, after SQLite began writing the transaction out: from the
    # caller's side it may have been committed, so the runner must read it back.
    done = subprocess.run(
        [sys.executable, "-c", _COMMIT_FAILS, str(tmp_path / "adk.sqlite3")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("reply-lost"), done.stdout
