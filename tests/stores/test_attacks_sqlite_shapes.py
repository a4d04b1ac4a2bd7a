"""An attack on cc4d59b: SQLite ``schema apply`` refusing objects of the kit's table names that
are not the kit's tables (stores/sqlite/failures.py ``foreign_tables``, schema.py
``table_shape``/``TableShape``) and "there is already an index named …" being a schema
mismatch (``translate``), through ``tesserix schema apply --store sqlite:///…``.

Attacked: legitimate files (every older schema version migrated with rows in it, a current
file applied again, extra nullable or defaulted columns, column types declared otherwise,
WITHOUT ROWID tables, three processes applying at once, a reader opening the file while
another process migrates it); other programs' objects the shape check does not see (a
column NOT NULL DEFAULT NULL, a UNIQUE index under a kit index's name, a table or view
under a kit index's or a migration's scratch table's name, a trigger named like a kit
table, a kit table named in another letter case); whether refusals are one sentence, exit 2,
with nothing stamped.

Found, and fixed (``sqlite/schema.index_shape``: the kit's indexes are compared too; a name is
looked up as SQLite compares names, without case, and only among tables, views and indexes; a
default of NULL is none; "there is already a …" and "… already exists" are a schema mismatch):
- HIGH ``test_a_unique_index_under_a_kit_index_name_loses_no_record``: a UNIQUE index named
  ``adk_idempotency_run_iteration`` on (tenant, run_id, iteration) passes ``schema apply``
  ("schema applied": ``foreign_tables`` looks at tables only); then the second call claimed in
  a turn silently deletes the first call's in-flight record (``INSERT OR REPLACE`` in
  stores/sqlite/idempotency.py removes any row a unique index conflicts with): that call
  would look as if it never ran.
- MEDIUM ``test_an_object_under_a_name_the_kit_creates_is_not_retry_later`` (3 cases): a
  table or view named like a kit index (``adk_work_due``, ``adk_idempotency_taken``), or a
  view named ``adk_idempotency_v2`` in a version-1 file, makes ``schema apply`` exit 3 "failed:
  there is already a table named …" / "view … already exists" (retry later), which no retry
  fixes (failures.py ``translate`` matches only "there is already an").
- MEDIUM ``test_a_not_null_default_null_column_is_refused_or_works``: a kit-named table with an
  extra ``owner TEXT NOT NULL DEFAULT NULL`` is "schema applied", then every lease acquire is
  StoreUnavailableError (exit 3) for ever (schema.py ``table_shape`` reads the default
  ``'null'`` as a default, so the column is not "required").
- LOW ``test_a_trigger_named_like_a_kit_table_does_not_refuse_a_migrated_file``: a version-1
  file with the user's trigger ``adk_approvals`` (on the user's own table) is refused after
  migration 2 rebuilds ``adk_approvals`` ("adk_approvals is a trigger"); the same file at the
  current version is accepted (``table_shape`` takes the first ``sqlite_master`` row of the
  name, whatever its type).
- LOW ``test_a_kit_table_named_in_another_case_is_not_called_missing``: ``ADK_LEDGER`` with the
  kit's exact shape (which SQLite serves as ``adk_ledger``) is refused as "adk_ledger is a
  missing table" (``table_shape`` compares ``sqlite_master.name`` case-sensitively).

Held: files at versions 1..N-1 holding rows migrate, rows kept; a current file with data
applied again is exit 0 with nothing changed; extra nullable / defaulted columns, types
declared otherwise and WITHOUT ROWID tables of the kit's shape are accepted and the store then
works; a view, another primary key, a required extra column, a missing column and an index
under a kit table's name are refused exit 2 in one sentence naming the table, with no version
stamped and no kit table created; three concurrent applies all succeed; a reader opening the
file while another process migrates it gets exit 0/1/2/3 in one sentence, never 4.
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from operator_cli import cli
from tesserix_adk.cli import ExitCode
from tesserix_adk.errors import StoreUnavailableError
from tesserix_adk.stores.sqlite.schema import SqliteSchema, statements
from tesserix_adk.stores.urls import open_stores

SCHEMA = SqliteSchema.load()
PYTHON = sys.executable


# --- helpers ------------------------------------------------------------------------------


def _one_sentence(err: str) -> bool:
    return err.startswith("tesserix") and err.count("\n") == 1 and "Traceback" not in err


def _file(path: Path, *sql: str) -> Path:
    conn = sqlite3.connect(path)
    try:
        for statement in sql:
            conn.execute(statement)
        conn.commit()
    finally:
        conn.close()
    return path


def _older(path: Path, version: int, *extra: str) -> Path:
    """A file as the kit at ``version`` left it, then ``extra``."""
    conn = sqlite3.connect(path)
    try:
        for migration in SCHEMA.migrations[:version]:
            for statement in statements(migration):
                conn.execute(statement)
        conn.execute("INSERT INTO adk_schema_version (id, version) VALUES (1, ?)", (version,))
        for statement in extra:
            conn.execute(statement)
        conn.commit()
    finally:
        conn.close()
    return path


def _url(path: Path) -> str:
    return f"sqlite:///{path}"


def _apply(path: Path) -> tuple[int, str, str]:
    return cli("--store", _url(path), "schema", "apply")


def _query(path: Path, sql: str) -> Any:
    conn = sqlite3.connect(path)
    try:
        return conn.execute(sql).fetchall()
    except sqlite3.OperationalError:
        return None
    finally:
        conn.close()


def _version(path: Path) -> Any:
    return _query(path, "SELECT version FROM adk_schema_version")


def _acquire(path: Path) -> None:
    async def go() -> None:
        async with open_stores(_url(path)) as stores:
            await stores.leases.acquire("t", "r", "w1", 5.0)

    asyncio.run(go())


_ROWS_V1 = (
    "INSERT INTO adk_run_leases VALUES ('t', 'r', 3, NULL, NULL)",
    "INSERT INTO adk_ledger VALUES ('t', 'r', 12, 3, 4)",
    "INSERT INTO adk_idempotency (key, status, holder, tenant, run_id, iteration, tool, since) "
    "VALUES ('k-1', 'completed', 'w', 't', 'r', 1, 'book', 1.0)",
    "INSERT INTO adk_approvals (id, tenant, run_id, calls, iteration, status, requested_at) "
    "VALUES ('a-1', 't', 'r', '[]', 1, 'pending', 1.0)",
)

_LEASES = (
    "CREATE TABLE adk_run_leases (tenant TEXT NOT NULL, run_id TEXT NOT NULL, fence INTEGER "
    "NOT NULL, holder TEXT, expires_at REAL{extra}, PRIMARY KEY (tenant, run_id)){tail}"
)


# ==========================================================================================
# Defects
# ==========================================================================================


def test_a_unique_index_under_a_kit_index_name_loses_no_record(tmp_path: Path) -> None:
    path = tmp_path / "adk.sqlite3"
    assert _apply(path)[0] == ExitCode.CARRIED_ON
    _file(
        path,
        "DROP INDEX adk_idempotency_run_iteration",
        "CREATE UNIQUE INDEX adk_idempotency_run_iteration "
        "ON adk_idempotency (tenant, run_id, iteration)",
    )
    code, out, err = _apply(path)
    if code != ExitCode.CARRIED_ON:  # refused: that is right too
        assert code == ExitCode.USAGE and _one_sentence(err), (code, err)
        return

    async def go() -> None:
        async with open_stores(_url(path)) as stores:
            lease = await stores.leases.acquire("t", "r", "w", 30.0)
            for n, key in enumerate(("k-1", "k-2")):
                # A refusal keeps the first record; the check below says so.
                with contextlib.suppress(StoreUnavailableError):
                    await stores.idempotency.claim(
                        key, holder="w", tenant="t", run_id="r", iteration=1,
                        tool="book", call_id=f"call_1_{n}", flags=None, fence=lease.fence,
                    )  # fmt: skip

    asyncio.run(go())
    kept = _query(path, "SELECT key FROM adk_idempotency ORDER BY key")
    assert ("k-1",) in kept, f"'schema applied' ({out!r}), then call k-1's record was lost: {kept}"


_NAMES_THE_KIT_CREATES = {
    "table-named-like-a-kit-index": (None, "CREATE TABLE adk_work_due (x)"),
    "view-named-like-a-kit-index": (None, "CREATE VIEW adk_idempotency_taken AS SELECT 1 AS x"),
    "view-named-like-a-migration-table": (1, "CREATE VIEW adk_idempotency_v2 AS SELECT 1 AS x"),
}


@pytest.mark.parametrize(
    ("version", "sql"), list(_NAMES_THE_KIT_CREATES.values()), ids=list(_NAMES_THE_KIT_CREATES)
)
def test_an_object_under_a_name_the_kit_creates_is_not_retry_later(
    tmp_path: Path, version: int | None, sql: str
) -> None:
    path = tmp_path / "adk.sqlite3"
    if version is None:
        _file(path, sql)
    else:
        _older(path, version, sql)
    code, _, err = _apply(path)
    assert _one_sentence(err), err
    assert code in (ExitCode.USAGE, ExitCode.MUST_NOT_CARRY_ON), (code, err)


def test_a_not_null_default_null_column_is_refused_or_works(tmp_path: Path) -> None:
    path = _file(
        tmp_path / "adk.sqlite3",
        _LEASES.format(extra=", owner TEXT NOT NULL DEFAULT NULL", tail=""),
    )
    code, out, err = _apply(path)
    if code != ExitCode.CARRIED_ON:
        assert code == ExitCode.USAGE and _one_sentence(err), (code, err)
        assert "adk_run_leases" in err and _version(path) is None, err
        return
    try:
        _acquire(path)
    except StoreUnavailableError as exc:
        pytest.fail(f"'schema applied' ({out!r}), then: {exc}")


def test_a_trigger_named_like_a_kit_table_does_not_refuse_a_migrated_file(
    tmp_path: Path,
) -> None:
    trigger = (
        "CREATE TABLE my_audit (x)",
        "CREATE TRIGGER adk_approvals AFTER INSERT ON my_audit BEGIN SELECT 1; END",
    )
    # The same objects at the current version: accepted.
    current = _file(tmp_path / "current.sqlite3")
    assert _apply(current)[0] == ExitCode.CARRIED_ON
    _file(current, *trigger)
    assert _apply(current)[0] == ExitCode.CARRIED_ON
    # At version 1: refused once migration 2 has rebuilt adk_approvals.
    path = _older(tmp_path / "v1.sqlite3", 1, *trigger)
    code, _, err = _apply(path)
    assert code == ExitCode.CARRIED_ON, err
    assert _version(path) == [(SCHEMA.version,)]


def test_a_kit_table_named_in_another_case_is_not_called_missing(tmp_path: Path) -> None:
    path = _file(
        tmp_path / "adk.sqlite3",
        "CREATE TABLE ADK_LEDGER (tenant TEXT NOT NULL, run_id TEXT NOT NULL, micros INTEGER "
        "NOT NULL, input_tokens INTEGER NOT NULL, output_tokens INTEGER NOT NULL, "
        "PRIMARY KEY (tenant, run_id))",
    )
    code, _, err = _apply(path)
    assert code == ExitCode.CARRIED_ON or "missing table" not in err, err


# ==========================================================================================
# Held
# ==========================================================================================


def test_every_older_version_with_rows_migrates_and_keeps_them(tmp_path: Path) -> None:
    for version in range(1, SCHEMA.version):
        path = _older(tmp_path / f"v{version}.sqlite3", version, *_ROWS_V1)
        code, _, err = _apply(path)
        assert code == ExitCode.CARRIED_ON, (version, err)
        assert _version(path) == [(SCHEMA.version,)]
        assert _query(path, "SELECT key, tenant, status FROM adk_idempotency") == [
            ("k-1", "t", "completed")
        ], version
        assert _query(path, "SELECT id FROM adk_approvals") == [("a-1",)], version
        assert _query(path, "SELECT micros FROM adk_ledger") == [(12,)], version
        # Applied again at the current version: nothing to do, nothing refused.
        assert _apply(path)[0] == ExitCode.CARRIED_ON, version


def test_a_current_file_with_data_applied_again_is_left_alone(tmp_path: Path) -> None:
    path = tmp_path / "adk.sqlite3"
    assert _apply(path)[0] == ExitCode.CARRIED_ON
    code, _, err = cli(
        "--store", _url(path), "submit", "--agent", "chaos_agent:agent", "--tenant", "t",
        "--input", "book", "--run-id", "r-1",
    )  # fmt: skip
    assert code == ExitCode.CARRIED_ON, err
    _acquire(path)
    before = _query(path, "SELECT type, name, sql FROM sqlite_master ORDER BY name")
    work = _query(path, "SELECT tenant, run_id, state FROM adk_work")
    for _ in range(2):
        code, _, err = _apply(path)
        assert code == ExitCode.CARRIED_ON, err
    assert _query(path, "SELECT type, name, sql FROM sqlite_master ORDER BY name") == before
    assert _query(path, "SELECT tenant, run_id, state FROM adk_work") == work
    assert _query(path, "SELECT holder FROM adk_run_leases") == [("w1",)]


_ACCEPTED = {
    "extra-nullable": _LEASES.format(extra=", note TEXT", tail=""),
    "extra-defaulted": _LEASES.format(extra=", owner TEXT NOT NULL DEFAULT 'me'", tail=""),
    "without-rowid": _LEASES.format(extra="", tail=" WITHOUT ROWID"),
    "types-declared-otherwise": (
        "CREATE TABLE adk_run_leases (tenant VARCHAR(64) NOT NULL, run_id NVARCHAR(200) NOT "
        "NULL, fence BIGINT NOT NULL, holder CLOB, expires_at DOUBLE PRECISION, "
        "PRIMARY KEY (tenant, run_id))"
    ),
}


@pytest.mark.parametrize("sql", list(_ACCEPTED.values()), ids=list(_ACCEPTED))
def test_a_kit_shaped_table_declared_otherwise_is_accepted_and_works(
    tmp_path: Path, sql: str
) -> None:
    path = _file(tmp_path / "adk.sqlite3", sql)
    code, _, err = _apply(path)
    assert code == ExitCode.CARRIED_ON, err
    assert _version(path) == [(SCHEMA.version,)]
    _acquire(path)
    assert _query(path, "SELECT tenant, run_id, fence, holder FROM adk_run_leases") == [
        ("t", "r", 1, "w1")
    ]


_REFUSED = {
    "view": "CREATE VIEW adk_ledger AS SELECT 't' AS tenant, 'r' AS run_id, 1 AS micros, "
    "1 AS input_tokens, 1 AS output_tokens",
    "other-key": "CREATE TABLE adk_ledger (tenant TEXT, run_id TEXT, micros INTEGER, "
    "input_tokens INTEGER, output_tokens INTEGER, PRIMARY KEY (run_id, tenant))",
    "required-extra": "CREATE TABLE adk_ledger (tenant TEXT NOT NULL, run_id TEXT NOT NULL, "
    "micros INTEGER NOT NULL, input_tokens INTEGER NOT NULL, output_tokens INTEGER NOT NULL, "
    "currency TEXT NOT NULL, PRIMARY KEY (tenant, run_id))",
    "missing-column": "CREATE TABLE adk_ledger (tenant TEXT NOT NULL, run_id TEXT NOT NULL, "
    "micros INTEGER NOT NULL, PRIMARY KEY (tenant, run_id))",
    "index": "CREATE TABLE other (x); CREATE INDEX adk_ledger ON other (x)",
}


@pytest.mark.parametrize("sql", list(_REFUSED.values()), ids=list(_REFUSED))
def test_a_foreign_object_under_a_kit_table_name_is_refused_with_nothing_made(
    tmp_path: Path, sql: str
) -> None:
    path = _file(tmp_path / "adk.sqlite3", *sql.split("; "))
    before = _query(path, "SELECT type, name, sql FROM sqlite_master ORDER BY name")
    code, _, err = _apply(path)
    assert code == ExitCode.USAGE and _one_sentence(err), (code, err)
    assert "adk_ledger" in err, err
    assert _version(path) is None
    assert _query(path, "SELECT type, name, sql FROM sqlite_master ORDER BY name") == before


def test_concurrent_applies_and_a_reader_during_a_migration(tmp_path: Path) -> None:
    path = _older(tmp_path / "v1.sqlite3", 1, *_ROWS_V1)
    argv = [PYTHON, "-m", "tesserix_adk", "--store", _url(path), "schema", "apply"]
    procs = [
        subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(3)
    ]
    seen = []
    try:
        while any(p.poll() is None for p in procs):
            code, _, err = cli("--store", _url(path), "runs", "--tenant", "t")
            seen.append(code)
            assert code in (0, 1, 2, 3) and (not err or _one_sentence(err)), (code, err)
    finally:
        results = [(p.wait(timeout=60), p.communicate()[1]) for p in procs]
    assert all(code == 0 for code, _ in results), results
    assert _version(path) == [(SCHEMA.version,)]
    assert _query(path, "SELECT key FROM adk_idempotency") == [("k-1",)]
    code, _, err = cli("--store", _url(path), "runs", "--tenant", "t")
    assert code in (ExitCode.CARRIED_ON, ExitCode.NOTHING_CHECKPOINTED), (code, err, seen)
