"""``open_stores(url)``: which stores a URL names, its options, and that opening does no I/O."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

from tesserix_adk.errors import ConfigurationError
from tesserix_adk.stores import Stores, open_stores, redact_url
from tesserix_adk.stores.memory import (
    MemoryApprovalStore,
    MemoryCheckpointStore,
    MemoryHistoryStore,
    MemoryIdempotencyStore,
    MemoryLeaseStore,
    MemoryLedger,
)
from tesserix_adk.stores.sqlite import (
    SQLITE_SCHEMA,
    SqliteApprovalStore,
    SqliteCheckpointStore,
    SqliteHistoryStore,
    SqliteIdempotencyStore,
    SqliteLeaseStore,
    SqliteLedger,
)


def _sqlite_path(stores: Stores) -> str:
    assert isinstance(stores.checkpoints, SqliteCheckpointStore)
    return stores.checkpoints.database.path


# --- memory ------------------------------------------------------------------------------


async def test_memory_url_opens_memory_stores() -> None:
    async with open_stores("memory://") as stores:
        assert isinstance(stores.checkpoints, MemoryCheckpointStore)
        assert isinstance(stores.idempotency, MemoryIdempotencyStore)
        assert isinstance(stores.leases, MemoryLeaseStore)
        assert isinstance(stores.history, MemoryHistoryStore)
        assert isinstance(stores.ledger, MemoryLedger)
        assert isinstance(stores.approvals, MemoryApprovalStore)
        assert stores.checkpoints.keep_last is None
        assert stores.schema is None
        await stores.create_schema()  # nothing to apply: a no-op
        await stores.verify()
        await stores.checkpoints.put("acme", "run-1", b"frontier", step=1)
        latest = await stores.checkpoints.latest("acme", "run-1")
        assert latest is not None and latest.payload == b"frontier"


def test_memory_url_takes_keep_last() -> None:
    stores = open_stores("memory://?keep_last=3")
    assert isinstance(stores.checkpoints, MemoryCheckpointStore)
    assert stores.checkpoints.keep_last == 3


def test_each_memory_url_opens_a_fresh_set() -> None:
    assert open_stores("memory://").checkpoints is not open_stores("memory://").checkpoints


# --- sqlite ------------------------------------------------------------------------------


def test_sqlite_url_opens_the_six_sqlite_stores_on_one_file(tmp_path: Path) -> None:
    stores = open_stores(f"sqlite:///{tmp_path}/adk.sqlite3")
    assert isinstance(stores.checkpoints, SqliteCheckpointStore)
    assert isinstance(stores.idempotency, SqliteIdempotencyStore)
    assert isinstance(stores.leases, SqliteLeaseStore)
    assert isinstance(stores.history, SqliteHistoryStore)
    assert isinstance(stores.ledger, SqliteLedger)
    assert isinstance(stores.approvals, SqliteApprovalStore)
    databases = {
        id(store.database)
        for store in (
            stores.checkpoints,
            stores.idempotency,
            stores.leases,
            stores.history,
            stores.ledger,
            stores.approvals,
        )
    }
    assert len(databases) == 1
    assert stores.schema == SQLITE_SCHEMA


def test_sqlite_url_with_three_slashes_is_relative_to_the_current_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    stores = open_stores("sqlite:///data/adk.sqlite3")
    assert _sqlite_path(stores) == str(tmp_path / "data" / "adk.sqlite3")


def test_sqlite_url_with_four_slashes_is_absolute(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    absolute = tmp_path / "elsewhere" / "adk.sqlite3"
    assert str(absolute).startswith("/")
    stores = open_stores(f"sqlite:///{absolute}")  # sqlite:////tmp/...
    assert _sqlite_path(stores) == str(absolute)


def test_sqlite_url_path_is_percent_decoded(tmp_path: Path) -> None:
    stores = open_stores(f"sqlite:///{tmp_path}/my%20store.sqlite3")
    assert _sqlite_path(stores) == str(tmp_path / "my store.sqlite3")


def test_sqlite_url_options(tmp_path: Path) -> None:
    stores = open_stores(f"sqlite:///{tmp_path}/adk.sqlite3?keep_last=5&synchronous=NORMAL")
    assert isinstance(stores.checkpoints, SqliteCheckpointStore)
    assert stores.checkpoints.keep_last == 5
    assert stores.checkpoints.database.synchronous == "normal"


def test_sqlite_defaults_are_full_sync_and_every_step_kept(tmp_path: Path) -> None:
    stores = open_stores(f"sqlite:///{tmp_path}/adk.sqlite3")
    assert isinstance(stores.checkpoints, SqliteCheckpointStore)
    assert stores.checkpoints.keep_last is None
    assert stores.checkpoints.database.synchronous == "full"


async def test_opening_a_sqlite_url_on_a_missing_directory_creates_nothing(
    tmp_path: Path,
) -> None:
    missing = tmp_path / "not" / "yet"
    url = f"sqlite:///{missing}/adk.sqlite3"
    async with open_stores(url) as stores:
        assert stores.url == url
    assert not (tmp_path / "not").exists()
    async with open_stores(url) as stores:
        await stores.create_schema()
    assert (missing / "adk.sqlite3").is_file()


async def test_data_written_through_one_url_is_read_through_another(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/adk.sqlite3"
    async with open_stores(url) as stores:
        await stores.create_schema()
        await stores.checkpoints.put("acme", "run-1", b"frontier", step=4, fence=2)
    async with open_stores(url) as stores:
        await stores.verify()
        latest = await stores.checkpoints.latest("acme", "run-1")
        assert latest is not None and (latest.payload, latest.step) == (b"frontier", 4)


# --- servers, delegated to their adapters -------------------------------------------------


@pytest.mark.parametrize(
    ("url", "module", "opener"),
    [
        ("redis://localhost:6379/0?prefix=adk", "redis", "open_redis_stores"),
        ("rediss://user:pw@cache.example:6380/1", "redis", "open_redis_stores"),
        ("postgresql://adk@db.example/adk?pool_max=8", "postgres", "open_postgres_stores"),
        ("postgres://adk@db.example/adk", "postgres", "open_postgres_stores"),
    ],
)
def test_server_urls_are_handed_whole_to_their_adapter(
    monkeypatch: pytest.MonkeyPatch, url: str, module: str, opener: str
) -> None:
    seen: list[str] = []
    sentinel = open_stores("memory://")

    def fake_open(given: str) -> Stores:
        seen.append(given)
        return sentinel

    fake = types.ModuleType(f"tesserix_adk.adapters.{module}")
    setattr(fake, opener, fake_open)
    monkeypatch.setitem(sys.modules, f"tesserix_adk.adapters.{module}", fake)
    assert open_stores(url) is sentinel
    assert seen == [url]


# --- refusals ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("mysql://localhost/adk", "unknown scheme 'mysql'"),
        ("adk.sqlite3", "no scheme"),
        ("", "no scheme"),
        ("sqlite://host/adk.sqlite3", "no host"),
        ("sqlite://", "names no file"),
        ("sqlite:///", "names no file"),
        ("sqlite:///adk.sqlite3?keep_last=0", "keep_last"),
        ("sqlite:///adk.sqlite3?keep_last=many", "keep_last"),
        ("sqlite:///adk.sqlite3?synchronous=off", "synchronous"),
        ("sqlite:///adk.sqlite3?keep_last=1&keep_last=2", "twice"),
        ("sqlite:///adk.sqlite3?journal=delete", "unknown option 'journal'"),
        ("sqlite:///adk.sqlite3?keep_last", "options"),
        ("memory://?synchronous=full", "unknown option 'synchronous'"),
        ("memory://somewhere", "no host or path"),
        ("memory://?keep_last=-1", "keep_last"),
    ],
)
def test_a_url_it_cannot_use_is_a_configuration_error_in_one_sentence(
    url: str, says: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigurationError) as refused:
        open_stores(url)
    message = str(refused.value)
    assert says in message
    assert "\n" not in message
    assert list(tmp_path.iterdir()) == []


def test_an_unknown_scheme_never_shows_the_password() -> None:
    with pytest.raises(ConfigurationError) as refused:
        open_stores("mysql://adk:hunter2@db.example/adk")
    assert "hunter2" not in str(refused.value)


# --- redaction for display ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("postgresql://adk:s3cret@db:5432/adk", "postgresql://adk:***@db:5432/adk"),
        ("redis://:s3cret@cache:6379/0", "redis://:***@cache:6379/0"),
        ("rediss://user:p%40ss@cache/0?prefix=x", "rediss://user:***@cache/0?prefix=x"),
        (
            "postgresql://db/adk?user=adk&password=s3cret&sslmode=require",
            "postgresql://db/adk?user=adk&password=***&sslmode=require",
        ),
        ("redis://cache:6379/0", "redis://cache:6379/0"),
        ("postgresql://adk@db/adk", "postgresql://adk@db/adk"),
        ("sqlite:///.adk/adk.sqlite3", "sqlite:///.adk/adk.sqlite3"),
        ("memory://", "memory://"),
    ],
)
def test_redact_url_masks_only_the_password(url: str, shown: str) -> None:
    assert redact_url(url) == shown


def test_a_postgres_url_carries_its_call_timeout_through_open_stores() -> None:
    pytest.importorskip("psycopg")
    stores = open_stores("postgresql://adk@db.example/adk?timeout=2.5")
    assert stores.leases.database.timeout == 2.5  # type: ignore[attr-defined]
