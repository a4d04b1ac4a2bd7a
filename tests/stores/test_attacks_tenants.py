"""Attacks on tenant isolation and on damaged rows, on every backend.

Each backend is opened fresh per test (its own SQLite file, Redis prefix or PostgreSQL
schema); damage is done to this test's own rows only, with the backend's own client.
"""

from __future__ import annotations

import asyncio
import io
import sqlite3
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote, urlsplit

import pytest

from adapters import services
from tesserix_adk.cli import frontier_main
from tesserix_adk.errors import CheckpointCorruptError, StaleFenceError
from tesserix_adk.messages import ToolCall
from tesserix_adk.stores import open_stores
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.stores.protocols import RecordStatus, ToolFlags


@dataclass
class Opened:
    name: str
    stores: Stores
    raw: Any = None  # sqlite path, (redis client, prefix) or postgres url


@asynccontextmanager
async def _memory(tmp_path: Path) -> AsyncIterator[Opened]:
    stores = open_stores("memory://")
    async with stores:
        yield Opened("memory", stores)


@asynccontextmanager
async def _sqlite(tmp_path: Path) -> AsyncIterator[Opened]:
    path = tmp_path / "x.db"
    stores = open_stores(f"sqlite:///{path}")
    await stores.create_schema()
    async with stores:
        yield Opened("sqlite", stores, path)


@asynccontextmanager
async def _redis(tmp_path: Path) -> AsyncIterator[Opened]:
    async with services.redis_stores() as stores:
        client = await services.redis_client()
        prefix = parse_qs(urlsplit(str(stores.url)).query)["prefix"][0]
        try:
            yield Opened("redis", stores, (client, prefix))
        finally:
            await client.aclose()


@asynccontextmanager
async def _postgres(tmp_path: Path) -> AsyncIterator[Opened]:
    async with services.postgres_stores() as stores:
        yield Opened("postgres", stores, str(stores.url))


ALL = {
    "memory": _memory,
    "sqlite": _sqlite,
    "redis": pytest.param(_redis, marks=pytest.mark.redis),
    "postgres": pytest.param(_postgres, marks=pytest.mark.postgres),
}
DAMAGEABLE = {k: v for k, v in ALL.items() if k != "memory"}


def each(backends: dict[str, Any]) -> Any:
    return pytest.mark.parametrize("opener", list(backends.values()), ids=list(backends))


async def _claim(stores: Stores, key: str, tenant: str, run_id: str, holder: str, **kw: Any) -> Any:
    return await stores.idempotency.claim(
        key,
        holder=holder,
        tenant=tenant,
        run_id=run_id,
        iteration=kw.pop("iteration", 0),
        tool=kw.pop("tool", "book_seat"),
        call_id=kw.pop("call_id", "c1"),
        flags=kw.pop("flags", ToolFlags()),
        **kw,
    )


HOSTILE = [
    "a:b",
    "a",
    "b:c",
    "c",
    "a%3Ab",
    "a%b",
    "a/b",
    "{a}",
    "}{",
    "a b",
    "ä:ß",
    "日本",
    "*",
    "a\\b",
    "%",
    "%25",
]


# --- isolation that held -----------------------------------------------------------------


@each(ALL)
async def test_same_key_under_hostile_tenants_is_one_record_each(
    opener: Any, tmp_path: Path
) -> None:
    async with opener(tmp_path) as o:
        idem = o.stores.idempotency
        keys = ["order-5", "a:b", "x/y", "{k}", "a b", "ключ", "%41"]
        for key in keys:
            for i, tenant in enumerate(HOSTILE):
                rec = await _claim(o.stores, key, tenant, "r", f"h{i}", takeover=True)
                assert (rec.tenant, rec.holder, rec.status) == (tenant, f"h{i}", "in_flight")
            for i, tenant in enumerate(HOSTILE):
                if i % 2:
                    await idem.complete(key, f"{tenant}".encode(), tenant=tenant, holder=f"h{i}")
            for i, tenant in enumerate(HOSTILE):
                found = await idem.lookup([key], tenant=tenant)
                assert found[key].tenant == tenant and found[key].holder == f"h{i}"
                assert found[key].outcome == (tenant.encode() if i % 2 else None)
        for i, tenant in enumerate(HOSTILE):
            mine = await idem.records(tenant, "r")
            assert {r.key for r in mine} == set(keys)
            assert {(r.tenant, r.holder) for r in mine} == {(tenant, f"h{i}")}


@each(ALL)
async def test_join_alike_tenant_and_run_pairs_stay_apart(opener: Any, tmp_path: Path) -> None:
    async with opener(tmp_path) as o:
        idem = o.stores.idempotency
        await _claim(o.stores, "k", "a:b", "c", "h1")
        await idem.complete("k", b"one", tenant="a:b", holder="h1")
        second = await _claim(o.stores, "k", "a", "b:c", "h2", takeover=True)
        assert second.status is RecordStatus.in_flight and second.holder == "h2"
        assert [r.run_id for r in await idem.records("a", "b:c")] == ["b:c"]
        assert [r.run_id for r in await idem.records("a:b", "c")] == ["c"]
        assert await idem.records("a", "b") == []


@each(ALL)
async def test_the_wrong_tenant_can_neither_settle_nor_release_nor_take(
    opener: Any, tmp_path: Path
) -> None:
    async with opener(tmp_path) as o:
        idem = o.stores.idempotency
        await _claim(o.stores, "k", "a", "r", "h")
        await _claim(
            o.stores, "run-claim", "a", "r", "h", tool=None, call_id=None, flags=None, ttl=60
        )
        with pytest.raises(StaleFenceError):
            await idem.complete("k", b"x", tenant="b", holder="h")
        with pytest.raises(KeyError):
            await idem.resolve("k", never_ran=True, tenant="b", by="op")
        with pytest.raises(KeyError):
            await idem.resolve("k", b"x", tenant="a:r", by="op")
        await idem.release("run-claim", tenant="b", holder="h")
        await idem.release("k", tenant="b", holder="h", undispatched=True)
        assert await idem.lookup(["k"], tenant="b") == {}
        found = await idem.lookup(["k", "run-claim"], tenant="a")
        assert set(found) == {"k", "run-claim"}
        assert found["k"].status is RecordStatus.in_flight and found["k"].holder == "h"
        # b taking over "k" takes its own, fresh record; a's stays with h.
        taken = await _claim(o.stores, "k", "b", "r", "thief", takeover=True)
        assert taken.tenant == "b"
        assert (await idem.lookup(["k"], tenant="a"))["k"].holder == "h"


@each(ALL)
async def test_records_of_a_run_whose_key_another_tenant_used_first(
    opener: Any, tmp_path: Path
) -> None:
    async with opener(tmp_path) as o:
        idem = o.stores.idempotency
        await _claim(o.stores, "order-5", "a", "r", "ha")
        await idem.complete("order-5", b"a's", tenant="a", holder="ha")
        got = await _claim(o.stores, "order-5", "b", "r", "hb")
        assert got.status is RecordStatus.in_flight and got.outcome is None
        [rec] = await idem.records("b", "r")
        assert (rec.tenant, rec.holder, rec.outcome) == ("b", "hb", None)
        [rec] = await idem.records("a", "r")
        assert (rec.tenant, rec.outcome) == ("a", b"a's")


@pytest.mark.redis
async def test_redis_old_index_serves_only_its_own_tenant_and_one_record(tmp_path: Path) -> None:
    """An older kit's key-only index naming tenant a's run: a settles on that record (never
    claims it a second time), b is not handed it."""
    async with _redis(tmp_path) as o:
        client, prefix = o.raw
        idem = o.stores.idempotency
        # What an older kit left: the record under a's run r1 and the key-only index.
        await _claim(o.stores, "order-5", "a", "r1", "old")
        await idem.complete("order-5", b"booked", tenant="a", holder="old")
        tag = f"{quote('a', safe='')}:{quote('r1', safe='')}"
        await client.delete(f"{prefix}idem-key:{{a:order-5}}")
        await client.set(f"{prefix}idem-key:{{order-5}}", tag)
        # a, in another run, claiming the same custom key: the old record, completed.
        again = await _claim(o.stores, "order-5", "a", "r2", "new", takeover=True)
        assert again.status is RecordStatus.completed and again.outcome == b"booked"
        # The new index now names r2, but the old index still wins: one record.
        assert (await idem.lookup(["order-5"], tenant="a"))["order-5"].outcome == b"booked"
        # b never receives a's record, and gets one of its own.
        assert await idem.lookup(["order-5"], tenant="b") == {}
        mine = await _claim(o.stores, "order-5", "b", "r1", "hb")
        assert mine.tenant == "b" and mine.status is RecordStatus.in_flight
        with pytest.raises(KeyError):
            await idem.resolve("order-5", b"x", tenant="b:r1", by="op")
        # An old index naming tenant "a:b"'s run is not read for tenant "a".
        await _claim(o.stores, "k2", "a:b", "r", "hab")
        await client.set(f"{prefix}idem-key:{{k2}}", f"{quote('a:b', safe='')}:r")
        assert await idem.lookup(["k2"], tenant="a") == {}
        fresh = await _claim(o.stores, "k2", "a", "r", "ha")
        assert fresh.tenant == "a" and fresh.holder == "ha"


async def _migrate_sqlite_from_v2(path: Path) -> None:
    from tesserix_adk.stores.sqlite import SQLITE_MIGRATIONS

    with sqlite3.connect(path) as conn:
        for script in SQLITE_MIGRATIONS[:2]:
            conn.executescript(script)
        conn.execute("INSERT INTO adk_schema_version (id, version) VALUES (1, 2)")
        row = (
            "order-5",
            "completed",
            "h",
            "a",
            "r",
            0,
            "book_seat",
            "c1",
            1,
            0,
            1,
            b"o",
            1.0,
            2.0,
            None,
            None,
        )
        conn.execute("INSERT INTO adk_idempotency VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)", row)
        # Version 2 is keyed by key alone: a second tenant's record of the same key cannot
        # even be written, so a migration never meets two.
        with pytest.raises(sqlite3.IntegrityError):
            conn.execute(
                "INSERT INTO adk_idempotency VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                ("order-5", *row[1:3], "b", *row[4:]),
            )
    conn.close()


async def test_sqlite_migration_keeps_the_record_and_then_keys_by_tenant(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    await _migrate_sqlite_from_v2(path)
    stores = open_stores(f"sqlite:///{path}")
    await stores.create_schema()
    async with stores:
        idem = stores.idempotency
        found = await idem.lookup(["order-5"], tenant="a")
        assert found["order-5"].outcome == b"o"
        assert await idem.lookup(["order-5"], tenant="b") == {}
        other = await _claim(stores, "order-5", "b", "r", "hb")
        assert other.status is RecordStatus.in_flight
        again = await _claim(stores, "order-5", "a", "r", "h2")
        assert again.status is RecordStatus.completed


@pytest.mark.postgres
async def test_postgres_migration_keeps_the_record_and_then_keys_by_tenant() -> None:
    import psycopg

    from tesserix_adk.adapters.postgres import MIGRATIONS, open_postgres_stores
    from tesserix_adk.adapters.postgres.schema import Schema

    async with services.postgres_schema() as schema:
        url = services.schema_url(schema)
        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
            await conn.execute(MIGRATIONS[0])
            # A database left at version 1, as that release applied it.
            await conn.execute(Schema.load().version_table)
            await conn.execute("INSERT INTO adk_schema_version (id, version) VALUES (1, 1)")
            await conn.execute(
                "INSERT INTO adk_idempotency (key, status, holder, tenant, run_id, tool, "
                "side_effects, idempotent, outcome, since) VALUES ('order-5', 'completed', "
                "'h', 'a', 'r', 'book_seat', true, false, 'o', now())"
            )
            with pytest.raises(psycopg.errors.UniqueViolation):
                await conn.execute(
                    "INSERT INTO adk_idempotency (key, status, holder, tenant, run_id, since) "
                    "VALUES ('order-5', 'in_flight', 'h', 'b', 'r', now())"
                )
        stores = open_postgres_stores(url)
        try:
            await stores.create_schema()
            idem = stores.idempotency
            assert (await idem.lookup(["order-5"], tenant="a"))["order-5"].outcome == b"o"
            assert await idem.lookup(["order-5"], tenant="b") == {}
            other = await _claim(stores, "order-5", "b", "r", "hb")
            assert other.status is RecordStatus.in_flight and other.tenant == "b"
            again = await _claim(stores, "order-5", "a", "r", "h2")
            assert again.status is RecordStatus.completed
        finally:
            await stores.aclose()


# --- damaged rows ------------------------------------------------------------------------


async def _redis_record_key(o: Opened, tenant: str, run_id: str, key: str) -> str:
    _, prefix = o.raw
    tag = f"{quote(tenant, safe='')}:{quote(run_id, safe='')}"
    return f"{prefix}{{{tag}}}:idem:rec:{quote(key, safe='')}"


@pytest.mark.redis
async def test_redis_completed_record_without_its_status_is_not_claimed_again(
    tmp_path: Path,
) -> None:
    """A completed record whose ``status`` field is gone must fail closed: claiming it as if
    absent would send a completed side-effecting call a second time."""
    async with _redis(tmp_path) as o:
        client, _ = o.raw
        await _claim(o.stores, "k", "t", "r", "h")
        await o.stores.idempotency.complete("k", b"booked", tenant="t", holder="h")
        await client.hdel(await _redis_record_key(o, "t", "r", "k"), "status")
        with pytest.raises(CheckpointCorruptError):
            await o.stores.idempotency.lookup(["k"], tenant="t")
        with pytest.raises(CheckpointCorruptError):
            await _claim(o.stores, "k", "t", "r", "h2")
        left = await client.hgetall(await _redis_record_key(o, "t", "r", "k"))
        assert left.get(b"outcome") == b"booked"


@pytest.mark.redis
async def test_redis_expiry_of_the_wrong_type_reads_as_corrupt(tmp_path: Path) -> None:
    async with _redis(tmp_path) as o:
        client, _ = o.raw
        await _claim(o.stores, "k", "t", "r", "h", tool=None, call_id=None, flags=None, ttl=60)
        await client.hset(await _redis_record_key(o, "t", "r", "k"), "expires_at", "soon")
        with pytest.raises(CheckpointCorruptError):
            await o.stores.idempotency.lookup(["k"], tenant="t")
        with pytest.raises(CheckpointCorruptError):
            await o.stores.idempotency.records("t", "r")
        with pytest.raises(CheckpointCorruptError):
            await _claim(o.stores, "k", "t", "r", "h2", tool=None, call_id=None, flags=None, ttl=60)


@pytest.mark.redis
async def test_redis_record_of_the_wrong_redis_type_reads_as_corrupt(tmp_path: Path) -> None:
    """A record key that is not a hash is damage (exit 4), not a store to retry (exit 3)."""
    async with _redis(tmp_path) as o:
        client, _ = o.raw
        await _claim(o.stores, "k", "t", "r", "h")
        rec = await _redis_record_key(o, "t", "r", "k")
        await client.delete(rec)
        await client.set(rec, "not a hash")
        with pytest.raises(CheckpointCorruptError):
            await o.stores.idempotency.lookup(["k"], tenant="t")


@pytest.mark.redis
async def test_redis_removed_or_mistyped_fields_read_as_corrupt(tmp_path: Path) -> None:
    async with _redis(tmp_path) as o:
        client, _ = o.raw
        for n, (field, value) in enumerate(
            [
                ("key", None),
                ("holder", None),
                ("since", None),
                ("tenant", None),
                ("iteration", "x"),
                ("fence", "1.5"),
                ("since", "x"),
                ("status", "\xff"),
            ]
        ):
            key = f"k{n}"
            await _claim(o.stores, key, "t", "r", "h")
            rec = await _redis_record_key(o, "t", "r", key)
            if value is None:
                await client.hdel(rec, field)
            else:
                await client.hset(rec, field, value)
            with pytest.raises(CheckpointCorruptError):
                await o.stores.idempotency.lookup([key], tenant="t")
            with pytest.raises(CheckpointCorruptError):
                await _claim(o.stores, key, "t", "r", "h")
            await client.delete(rec)


async def test_sqlite_iteration_of_the_wrong_type_reads_as_corrupt(tmp_path: Path) -> None:
    async with _sqlite(tmp_path) as o:
        await _claim(o.stores, "k1", "t", "r", "h", iteration=0)
        await _claim(o.stores, "k2", "t", "r", "h", iteration=1)
        with sqlite3.connect(o.raw) as conn:
            conn.execute("UPDATE adk_idempotency SET iteration = 'one' WHERE key = 'k2'")
        conn.close()
        with pytest.raises(CheckpointCorruptError):
            await o.stores.idempotency.records("t", "r")
        with pytest.raises(CheckpointCorruptError):
            await o.stores.idempotency.lookup(["k2"], tenant="t")


async def _damage_calls(o: Opened, calls: str) -> None:
    if o.name == "sqlite":
        with sqlite3.connect(o.raw) as conn:
            conn.execute("UPDATE adk_approvals SET calls = ?", (calls,))
        conn.close()
    elif o.name == "redis":
        client, prefix = o.raw
        async for key in client.scan_iter(match=f"{prefix}*"):
            if await client.type(key) == b"hash" and await client.hexists(key, "calls"):
                await client.hset(key, "calls", calls)
    else:
        import psycopg

        async with await psycopg.AsyncConnection.connect(o.raw, autocommit=True) as conn:
            await conn.execute("UPDATE adk_approvals SET calls = %s::json", (calls,))


WRONG_SHAPES = [
    '[{"id": "c1", "name": "book_seat", "arguments": 3}]',
    '[{"id": "c1", "name": "book_seat", "arguments": "seat=1A"}]',
    '[{"id": "c1", "name": "book_seat", "arguments": [["seat", "1A"]]}]',
    '[{"id": 7, "name": "book_seat", "arguments": {}}]',
    '[{"id": "c1", "name": null, "arguments": {}}]',
    '{"id": "c1", "name": "book_seat", "arguments": {}}',
]


@each(DAMAGEABLE)
@pytest.mark.parametrize("calls", WRONG_SHAPES)
async def test_approval_calls_of_the_wrong_shape_read_as_corrupt(
    opener: Any, calls: str, tmp_path: Path
) -> None:
    async with opener(tmp_path) as o:
        asked = [ToolCall(id="c1", name="book_seat", arguments={"seat": "1A"})]
        await o.stores.approvals.request("t", "r", asked, iteration=0, id="req-1")
        await _damage_calls(o, calls)
        with pytest.raises(CheckpointCorruptError, match="approval request"):
            await o.stores.approvals.get("t", "req-1")
        with pytest.raises(CheckpointCorruptError, match="approval request"):
            await o.stores.approvals.decide("t", "req-1", approved=True, by="op")


# --- the CLI with tenant-prefixed keys ---------------------------------------------------


@pytest.mark.parametrize("tenant", ["acme", "a/b", "a:b", "50% off", "日本"])
def test_cli_resolves_a_call_by_its_tenant_prefixed_key(tenant: str, tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'x.db'}"
    key = f"{quote(tenant, safe='')}/order-5"

    async def setup() -> None:
        stores = open_stores(url)
        await stores.create_schema()
        async with stores:
            await _claim(stores, key, tenant, "r", "dead-worker", call_id="call_9")
            # Another tenant's record under the same key and run must not be touched.
            await _claim(stores, key, "other", "r", "other-worker", call_id="call_9")

    asyncio.run(setup())
    out, err = io.StringIO(), io.StringIO()
    code = frontier_main(
        [
            "resolve",
            "r",
            "--tenant",
            tenant,
            "--call",
            key,
            "--outcome",
            '{"ok": true}',
            "--by",
            "op",
        ],
        stores=open_stores(url),
        out=out,
        err=err,
    )
    assert code == 0, err.getvalue()

    async def check() -> None:
        stores = open_stores(url)
        async with stores:
            mine = (await stores.idempotency.lookup([key], tenant=tenant))[key]
            theirs = (await stores.idempotency.lookup([key], tenant="other"))[key]
            assert mine.status is RecordStatus.completed and mine.by == "op"
            assert mine.outcome
            assert theirs.status is RecordStatus.in_flight and theirs.holder == "other-worker"

    asyncio.run(check())
