"""A PostgreSQL write group whose COMMIT rides in the message of its last statement
(``WriteGroup.commit_with_next``), on the real server: durable once that statement has
answered, with no round trip of its own; a statement that fails is undone alone and the
group goes on; a COMMIT the server refuses loses the group for certain; a reply lost with
the COMMIT in it leaves the group in doubt, never said to have certainly failed.

The failures are made by triggers in the test's own schema (``pg_admin``)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import psycopg
import pytest

from adapters import services
from adapters.wire import Wire
from tesserix_adk.errors import StoreReplyLostError, StoreUnavailableError
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.stores.protocols import RecordStatus, ToolFlags

pytestmark = pytest.mark.postgres

T = "acme"
FLAGS = ToolFlags(side_effects=True, idempotent=False)
SLEEPER = "adk-test-commit-with-next"  # its own schema's trigger sleeps under this name


async def _claim(stores: Stores, key: str, run_id: str = "r") -> Any:
    return await stores.idempotency.claim(
        key,
        holder="h",
        tenant=T,
        run_id=run_id,
        iteration=0,
        tool="book",
        call_id=key,
        flags=FLAGS,
    )


async def _seen(admin: psycopg.AsyncConnection[Any]) -> tuple[int, list[str]]:
    """What another connection sees: history entries and claimed keys."""
    cur = await admin.execute("SELECT count(*) FROM adk_history")
    row = await cur.fetchone()
    assert row is not None
    cur = await admin.execute("SELECT key FROM adk_idempotency ORDER BY key")
    return int(row[0]), [str(k) for (k,) in await cur.fetchall()]


async def _trigger(admin: psycopg.AsyncConnection[Any], body: str, *, deferred: bool) -> None:
    """A trigger on claims: ``body`` runs for each claimed row, at once or at COMMIT."""
    await admin.execute(
        f"CREATE FUNCTION adk_test_trap() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
        f"{body}; RETURN NEW; END $$"
    )
    if deferred:
        await admin.execute(
            "CREATE CONSTRAINT TRIGGER adk_test_trap AFTER INSERT ON adk_idempotency "
            "DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION adk_test_trap()"
        )
    else:
        await admin.execute(
            "CREATE TRIGGER adk_test_trap BEFORE INSERT ON adk_idempotency "
            "FOR EACH ROW EXECUTE FUNCTION adk_test_trap()"
        )


async def test_the_next_statement_carries_the_commit_and_is_durable_when_it_answers(
    pg_url: str,
    pg_admin: psycopg.AsyncConnection[Any],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    wire = Wire(monkeypatch, tmp_path)
    async with (
        services.postgres_stores_applied(pg_url) as stores,
        services.write_group(stores) as group,
    ):
        await stores.history.append(T, "r", [b"{}"], fence=None, after=None)
        group.commit_with_next()
        before = wire.waits()
        record = await _claim(stores, "k1")
        assert wire.waits() - before == 1, "the claim and the COMMIT in one message"
        assert record.status is RecordStatus.in_flight
        # Committed before ``commit`` is called: another connection sees both writes.
        assert await _seen(pg_admin) == (1, ["k1"])
        before = wire.waits()
        await group.commit()
        assert wire.waits() - before == 0, "nothing left to send"
        # The group is closed: a later write goes alone, and commits alone.
        await _claim(stores, "k2")
        assert await _seen(pg_admin) == (1, ["k1", "k2"])


async def test_statements_sent_together_leave_the_commit_to_the_next_single_one(
    pg_url: str, pg_admin: psycopg.AsyncConnection[Any]
) -> None:
    """A frontier and its transcript append are refused together after they ran (their
    check), so a COMMIT never rides with them: the next single statement carries it."""
    async with (
        services.postgres_stores_applied(pg_url) as stores,
        services.write_group(stores) as group,
    ):
        group.commit_with_next()
        put = stores.checkpoints.put_with_history  # type: ignore[attr-defined]
        handle = await put(
            stores.history, T, "r", b"{}", step=1, fence=None, encoded=[b"{}"], after=None
        )
        assert handle is not None and handle.count == 1
        assert await _seen(pg_admin) == (0, []), "not committed by the pair"
        await _claim(stores, "k1")
        assert await _seen(pg_admin) == (1, ["k1"])
        await group.commit()


async def test_a_statement_that_fails_with_the_commit_is_undone_alone_and_the_group_goes_on(
    pg_stores: Stores, pg_admin: psycopg.AsyncConnection[Any]
) -> None:
    await _trigger(pg_admin, "RAISE EXCEPTION 'refused by the test'", deferred=False)
    stores = pg_stores
    async with services.write_group(stores) as group:
        await stores.history.append(T, "r", [b"{}"], fence=None, after=None)
        group.commit_with_next()
        with pytest.raises(StoreUnavailableError, match="refused by the test"):
            await _claim(stores, "k1")
        # Nothing committed yet: the COMMIT was not reached.
        assert await _seen(pg_admin) == (0, [])
        await stores.history.append(T, "r2", [b"{}"], fence=None, after=None)
        await group.commit()
    assert await _seen(pg_admin) == (2, [])


async def test_a_commit_the_server_refuses_loses_the_group_for_certain(
    pg_stores: Stores, pg_admin: psycopg.AsyncConnection[Any]
) -> None:
    await _trigger(pg_admin, "RAISE EXCEPTION 'refused at commit'", deferred=True)
    stores = pg_stores
    async with services.write_group(stores) as group:
        await stores.history.append(T, "r", [b"{}"], fence=None, after=None)
        group.commit_with_next()
        with pytest.raises(StoreUnavailableError, match="refused at commit") as raised:
            await _claim(stores, "k1")
        assert not isinstance(raised.value, StoreReplyLostError)
        with pytest.raises(StoreUnavailableError) as failed:
            await group.commit()
        assert not isinstance(failed.value, StoreReplyLostError), "certainly not committed"
    assert await _seen(pg_admin) == (0, [])


async def test_a_reply_lost_with_the_commit_in_it_leaves_the_group_in_doubt(
    pg_stores: Stores, pg_admin: psycopg.AsyncConnection[Any]
) -> None:
    await _trigger(pg_admin, services.marked_sleep(SLEEPER), deferred=False)
    stores = pg_stores
    async with services.write_group(stores) as group:
        await stores.history.append(T, "r", [b"{}"], fence=None, after=None)
        group.commit_with_next()
        claiming = asyncio.ensure_future(_claim(stores, "k1"))
        # The claim is on the server, asleep in the trigger: its connection dies.
        pid = await services.asleep(pg_admin, SLEEPER)
        await pg_admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
        with pytest.raises(StoreReplyLostError):
            await claiming
        # The COMMIT was in the message: nobody can say it did not run.
        with pytest.raises(StoreReplyLostError):
            await group.commit()
    assert await _seen(pg_admin) == (0, [])


async def test_a_reply_lost_without_the_commit_in_it_loses_the_group_for_certain(
    pg_stores: Stores, pg_admin: psycopg.AsyncConnection[Any]
) -> None:
    """The same death without ``commit_with_next``: no COMMIT was sent, so the group
    certainly did not commit (its charge is then made again by the runner)."""
    await _trigger(pg_admin, services.marked_sleep(SLEEPER), deferred=False)
    stores = pg_stores
    async with services.write_group(stores) as group:
        await stores.history.append(T, "r", [b"{}"], fence=None, after=None)
        claiming = asyncio.ensure_future(_claim(stores, "k1"))
        pid = await services.asleep(pg_admin, SLEEPER)
        await pg_admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
        with pytest.raises(StoreReplyLostError):
            await claiming
        with pytest.raises(StoreUnavailableError) as failed:
            await group.commit()
        assert not isinstance(failed.value, StoreReplyLostError)
    assert await _seen(pg_admin) == (0, [])
