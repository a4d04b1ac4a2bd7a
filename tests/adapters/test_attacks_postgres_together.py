"""Attacks on the PostgreSQL frontier written with its transcript append
(``PostgresCheckpointStore.put_with_history`` over ``PostgresWriteGroup.rows_together``),
in a group of its own ("alone") and among other writes of a write group, against the real
server (a pair written outside any group, in a transaction of its own, was dropped after
this file found that a holder frozen before its COMMIT kept the run's rows locked):
statement errors in either half, terminated backends, server and client timeouts,
cancellation, savepoints of several pairs in one group, a takeover between the two gates,
and the runner's turns on top."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import psycopg
import pytest
from psycopg.pq import TransactionStatus

from adapters import services
from tesserix_adk import Agent, AgentRunner, ScriptedProvider, ScriptedTurn, tool
from tesserix_adk.adapters.postgres import open_postgres_stores
from tesserix_adk.adapters.postgres.grouping import PostgresWriteGroup
from tesserix_adk.errors import (
    StaleFenceError,
    StoreReplyLostError,
    StoreUnavailableError,
)
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.stores.grouping import group_scope, joined
from tesserix_adk.stores.protocols import FrontierWithHistory, HistoryHandle, RecordStatus

pytestmark = pytest.mark.postgres

T = "acme"
# A step PostgreSQL cannot cast to bigint: the put (the second statement) fails, not refuses.
HUGE_STEP = 2**63
# A prefix length past integer: the append (the first statement) fails, not refuses.
HUGE_COUNT = 2**31


async def _pair(
    stores: Stores,
    run_id: str,
    payload: bytes,
    *,
    step: int,
    items: list[bytes],
    after: HistoryHandle | None,
    fence: int | None = 1,
) -> HistoryHandle | None:
    checkpoints = stores.checkpoints
    assert isinstance(checkpoints, FrontierWithHistory)
    if joined(checkpoints.database) is not None:  # type: ignore[attr-defined]
        return await checkpoints.put_with_history(
            stores.history, T, run_id, payload, step=step, fence=fence, encoded=items, after=after
        )
    # Outside a group the store declines the pair (the caller would write them one after
    # the other): here it goes in a group of its own, begun and committed around it.
    async with services.write_group(stores) as group:
        try:
            handle = await checkpoints.put_with_history(
                stores.history,
                T,
                run_id,
                payload,
                step=step,
                fence=fence,
                encoded=items,
                after=after,
            )
        finally:
            await asyncio.shield(group.commit())
    return handle


async def _first(stores: Stores, run_id: str) -> HistoryHandle:
    handle = await _pair(stores, run_id, b"f1", step=1, items=[b"m1"], after=None)
    assert handle is not None and handle.count == 1
    return handle


async def _state(admin: psycopg.AsyncConnection[Any], run_id: str) -> tuple[Any, ...]:
    """What is committed of ``run_id``: frontier payload, step rows, transcript items."""
    cur = await admin.execute(
        "SELECT payload FROM adk_checkpoints WHERE tenant = %s AND run_id = %s", (T, run_id)
    )
    frontier = await cur.fetchone()
    cur = await admin.execute(
        "SELECT step FROM adk_checkpoint_steps WHERE tenant = %s AND run_id = %s ORDER BY step",
        (T, run_id),
    )
    steps = [r[0] for r in await cur.fetchall()]
    cur = await admin.execute(
        "SELECT item FROM adk_history WHERE tenant = %s AND run_id = %s ORDER BY position",
        (T, run_id),
    )
    items = [bytes(r[0]) for r in await cur.fetchall()]
    return (bytes(frontier[0]) if frontier else None, steps, items)


def _pool_is_clean(stores: Stores) -> None:
    """No idle pooled connection is left inside a transaction."""
    pool = stores.checkpoints.database.pool  # type: ignore[attr-defined]
    for conn in list(pool._pool):
        assert conn.info.transaction_status is TransactionStatus.IDLE


async def _no_open_transactions(admin: psycopg.AsyncConnection[Any], stores: Stores) -> None:
    pool = stores.checkpoints.database.pool  # type: ignore[attr-defined]
    pids = [c.info.backend_pid for c in list(pool._pool)]
    cur = await admin.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE pid = ANY(%s) AND state <> 'idle'", (pids,)
    )
    row = await cur.fetchone()
    assert row is not None and row[0] == 0


async def _still_writes(stores: Stores, run_id: str) -> None:
    await stores.checkpoints.put(T, f"{run_id}-after", b"after", step=1, fence=None)
    latest = await stores.checkpoints.latest(T, f"{run_id}-after")
    assert latest is not None and latest.payload == b"after"


# --- a statement error in either half, alone ---------------------------------------------


@pytest.mark.parametrize("failing", ["append", "put"])
async def test_a_statement_error_alone_writes_neither_and_leaves_the_pool_clean(
    pg_stores: Stores, pg_admin: psycopg.AsyncConnection[Any], failing: str
) -> None:
    run_id = f"alone-{failing}"
    handle = await _first(pg_stores, run_id)
    before = await _state(pg_admin, run_id)
    after = (
        HistoryHandle(tenant=T, run_id=run_id, count=HUGE_COUNT, digest=handle.digest)
        if failing == "append"
        else handle
    )
    step = HUGE_STEP if failing == "put" else 2
    with pytest.raises(StoreUnavailableError) as caught:
        await _pair(pg_stores, run_id, b"f2", step=step, items=[b"m2"], after=after)
    assert not isinstance(caught.value, StoreReplyLostError)
    assert "out of range" in str(caught.value)
    assert await _state(pg_admin, run_id) == before
    _pool_is_clean(pg_stores)
    await _no_open_transactions(pg_admin, pg_stores)
    second = await _pair(pg_stores, run_id, b"f2", step=2, items=[b"m2"], after=handle)
    assert second is not None
    assert await _state(pg_admin, run_id) == (b"f2", [1, 2], [b"m1", b"m2"])


# --- a statement error in either half, in a group ----------------------------------------


@pytest.mark.parametrize("failing", ["append", "put"])
async def test_a_statement_error_in_a_group_undoes_the_pair_only_and_the_group_goes_on(
    pg_stores: Stores, pg_admin: psycopg.AsyncConnection[Any], failing: str
) -> None:
    run_id = f"group-{failing}"
    handle = await _first(pg_stores, run_id)
    async with services.write_group(pg_stores) as group:
        await pg_stores.checkpoints.put(T, "before", b"b", step=1, fence=None)
        after = (
            HistoryHandle(tenant=T, run_id=run_id, count=HUGE_COUNT, digest=handle.digest)
            if failing == "append"
            else handle
        )
        step = HUGE_STEP if failing == "put" else 2
        with pytest.raises(StoreUnavailableError):
            await _pair(pg_stores, run_id, b"f2", step=step, items=[b"m2"], after=after)
        assert group._lost is None
        await pg_stores.checkpoints.put(T, "later", b"l", step=1, fence=None)
        # Nothing of the group is visible before its commit.
        assert await _state(pg_admin, "before") == (None, [], [])
        await group.commit()
    assert await _state(pg_admin, run_id) == (b"f1", [1], [b"m1"])
    assert (await _state(pg_admin, "before"))[0] == b"b"
    assert (await _state(pg_admin, "later"))[0] == b"l"
    _pool_is_clean(pg_stores)
    await _no_open_transactions(pg_admin, pg_stores)
    await _still_writes(pg_stores, run_id)


async def test_a_failed_pair_as_the_groups_first_write_keeps_the_group_usable(
    pg_stores: Stores, pg_admin: psycopg.AsyncConnection[Any]
) -> None:
    handle = await _first(pg_stores, "first-write")
    async with services.write_group(pg_stores) as group:
        with pytest.raises(StoreUnavailableError):
            await _pair(
                pg_stores, "first-write", b"f2", step=HUGE_STEP, items=[b"m2"], after=handle
            )
        await pg_stores.checkpoints.put(T, "later", b"l", step=1, fence=None)
        await group.commit()
    assert await _state(pg_admin, "first-write") == (b"f1", [1], [b"m1"])
    assert (await _state(pg_admin, "later"))[0] == b"l"
    _pool_is_clean(pg_stores)


# --- several pairs and plain writes in one group: savepoints ------------------------------


async def test_a_refused_second_pair_undoes_only_itself_not_the_first_pair_or_writes_between(
    pg_stores: Stores, pg_admin: psycopg.AsyncConnection[Any]
) -> None:
    async with services.write_group(pg_stores) as group:
        handle = await _first(pg_stores, "two")
        await pg_stores.checkpoints.put(T, "between", b"x", step=1, fence=None)
        # Refused: a fence below the one the group wrote.
        with pytest.raises(StaleFenceError):
            await _pair(pg_stores, "two", b"f2", step=2, items=[b"m2"], after=handle, fence=0)
        # A plain write that fails after the refusal (adk_write inside adk_together).
        with pytest.raises(StoreUnavailableError):
            await pg_stores.checkpoints.put(T, "bad", b"b", step=HUGE_STEP, fence=None)
        third = await _pair(pg_stores, "two", b"f3", step=3, items=[b"m3"], after=handle)
        assert third is not None
        # Refused again, after a pair that succeeded on top of a refused one.
        with pytest.raises(StaleFenceError):
            await _pair(pg_stores, "two", b"f4", step=4, items=[b"m4"], after=third, fence=0)
        await pg_stores.checkpoints.put(T, "end", b"e", step=1, fence=None)
        await group.commit()
    assert await _state(pg_admin, "two") == (b"f3", [1, 3], [b"m1", b"m3"])
    assert (await _state(pg_admin, "between"))[0] == b"x"
    assert (await _state(pg_admin, "end"))[0] == b"e"
    assert await _state(pg_admin, "bad") == (None, [], [])
    _pool_is_clean(pg_stores)
    await _no_open_transactions(pg_admin, pg_stores)


async def test_a_statement_error_in_a_second_pair_keeps_the_first_pair(
    pg_stores: Stores, pg_admin: psycopg.AsyncConnection[Any]
) -> None:
    async with services.write_group(pg_stores) as group:
        handle = await _first(pg_stores, "err2")
        with pytest.raises(StoreUnavailableError):
            await _pair(pg_stores, "err2", b"f2", step=HUGE_STEP, items=[b"m2"], after=handle)
        await group.commit()
    assert await _state(pg_admin, "err2") == (b"f1", [1], [b"m1"])


# --- the connection lost -----------------------------------------------------------------


async def _terminate(url: str, pid: int) -> None:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as admin:
        await admin.execute("SELECT pg_terminate_backend(%s)", (pid,))


async def test_a_group_whose_backend_is_killed_before_a_pair_is_lost_and_commits_nothing(
    pg_stores: Stores, pg_admin: psycopg.AsyncConnection[Any], pg_url: str
) -> None:
    async with services.write_group(pg_stores) as group:
        handle = await _first(pg_stores, "killed")
        assert isinstance(group, PostgresWriteGroup) and group._conn is not None
        await _terminate(pg_url, group._conn.info.backend_pid)
        with pytest.raises(StoreUnavailableError):
            await _pair(pg_stores, "killed", b"f2", step=2, items=[b"m2"], after=handle)
        # Nothing joins it afresh.
        with pytest.raises(StoreUnavailableError):
            await pg_stores.checkpoints.put(T, "later", b"l", step=1, fence=None)
        with pytest.raises(StoreUnavailableError):
            await group.commit()
    assert await _state(pg_admin, "killed") == (None, [], [])
    assert await _state(pg_admin, "later") == (None, [], [])
    await _still_writes(pg_stores, "killed")


async def test_a_backend_killed_between_the_pair_and_its_commit_alone_writes_neither(
    pg_stores: Stores,
    pg_admin: psycopg.AsyncConnection[Any],
    pg_url: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    handle = await _first(pg_stores, "gap")
    execute = psycopg.AsyncConnection.execute
    armed = [True]

    async def killing(self: Any, query: Any, *args: Any, **kwargs: Any) -> Any:
        if armed[0] and query == "COMMIT" and self.pgconn.pipeline_status == 0:
            armed[0] = False
            await _terminate(pg_url, self.info.backend_pid)
        return await execute(self, query, *args, **kwargs)

    monkeypatch.setattr(psycopg.AsyncConnection, "execute", killing)
    with pytest.raises(StoreReplyLostError):
        await _pair(pg_stores, "gap", b"f2", step=2, items=[b"m2"], after=handle)
    monkeypatch.undo()
    assert not armed[0]
    assert await _state(pg_admin, "gap") == (b"f1", [1], [b"m1"])
    await _still_writes(pg_stores, "gap")
    second = await _pair(pg_stores, "gap", b"f2", step=2, items=[b"m2"], after=handle)
    assert second is not None
    assert await _state(pg_admin, "gap") == (b"f2", [1, 2], [b"m1", b"m2"])


# --- slow statements: the server's timeout, the client's, cancellation --------------------


@pytest.fixture
async def slow_history(pg_admin: psycopg.AsyncConnection[Any]) -> AsyncIterator[None]:
    """Every insert into adk_history whose item is b'slow' sleeps 0.6 s first; b'slower'
    sleeps past ``quick_stores``' deadline."""
    await pg_admin.execute(
        """
        CREATE FUNCTION adk_test_slow() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            IF NEW.item = 'slow'::bytea THEN PERFORM pg_sleep(0.6); END IF;
            IF NEW.item = 'slower'::bytea THEN PERFORM pg_sleep(3); END IF;
            RETURN NEW;
        END $$;
        CREATE TRIGGER adk_test_slow BEFORE INSERT ON adk_history
            FOR EACH ROW EXECUTE FUNCTION adk_test_slow();
        """
    )
    yield


@pytest.fixture
async def quick_stores(pg_url: str) -> AsyncIterator[Stores]:
    """The stores with a 2 s deadline (the server's statement_timeout: 1.6 s): the server
    cancels first with 0.4 s to spare, enough on a loaded machine (0.1 s was not: a CI run
    beside other test runs saw the client give up first and the group lost)."""
    stores = open_postgres_stores(services.with_query(pg_url, timeout="2"))
    try:
        yield stores
    finally:
        await stores.aclose()


async def test_a_pair_the_server_times_out_alone_writes_neither(
    pg_stores: Stores,
    quick_stores: Stores,
    pg_admin: psycopg.AsyncConnection[Any],
    slow_history: None,
) -> None:
    handle = await _first(pg_stores, "slow")
    with pytest.raises(StoreUnavailableError) as caught:
        await _pair(quick_stores, "slow", b"f2", step=2, items=[b"slower"], after=handle)
    # Cancelled by the server (statement_timeout) before the client gave up: a known outcome.
    assert not isinstance(caught.value, StoreReplyLostError)
    assert await _state(pg_admin, "slow") == (b"f1", [1], [b"m1"])
    _pool_is_clean(quick_stores)
    await _still_writes(quick_stores, "slow")


async def test_a_pair_the_server_times_out_in_a_group_is_undone_alone(
    pg_stores: Stores,
    quick_stores: Stores,
    pg_admin: psycopg.AsyncConnection[Any],
    slow_history: None,
) -> None:
    handle = await _first(pg_stores, "slowg")
    async with services.write_group(quick_stores) as group:
        await quick_stores.checkpoints.put(T, "before", b"b", step=1, fence=None)
        with pytest.raises(StoreUnavailableError):
            await _pair(quick_stores, "slowg", b"f2", step=2, items=[b"slower"], after=handle)
        await group.commit()
    assert await _state(pg_admin, "slowg") == (b"f1", [1], [b"m1"])
    assert (await _state(pg_admin, "before"))[0] == b"b"
    _pool_is_clean(quick_stores)


@pytest.mark.parametrize("grouped", [False, True])
async def test_a_pair_cancelled_midway_writes_neither(
    pg_stores: Stores,
    pg_admin: psycopg.AsyncConnection[Any],
    slow_history: None,
    grouped: bool,
) -> None:
    run_id = f"cancel-{grouped}"
    handle = await _first(pg_stores, run_id)

    async def write() -> None:
        with group_scope():
            group = None
            if grouped:
                group = pg_stores.checkpoints.write_group()  # type: ignore[attr-defined]
                await group.begin()
                await pg_stores.checkpoints.put(T, "before", b"b", step=1, fence=None)
            try:
                await _pair(pg_stores, run_id, b"f2", step=2, items=[b"slow"], after=handle)
            finally:
                if group is not None:
                    # The group's own commit, as ``run.grouping.grouped`` does on the way out.
                    await asyncio.shield(group.commit())

    task = asyncio.create_task(write())
    await asyncio.sleep(0.2)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await _state(pg_admin, run_id) == (b"f1", [1], [b"m1"])
    if grouped:
        # The group went on without the pair: what came before it committed.
        assert (await _state(pg_admin, "before"))[0] == b"b"
    _pool_is_clean(pg_stores)
    await _no_open_transactions(pg_admin, pg_stores)
    # No lock is left behind on the run's gate rows: the next pair passes at once.
    second = await asyncio.wait_for(
        _pair(pg_stores, run_id, b"f2", step=2, items=[b"m2"], after=handle), 2
    )
    assert second is not None


# --- a takeover between the two gates ----------------------------------------------------


async def test_a_takeover_between_the_append_and_the_put_writes_neither(
    pg_stores: Stores, pg_admin: psycopg.AsyncConnection[Any], slow_history: None
) -> None:
    leases = pg_stores.leases
    assert leases is not None
    first = await leases.acquire(T, "race", "old", ttl=0.3)
    assert first is not None
    fence = first.fence
    handle = await _pair(pg_stores, "race", b"f1", step=1, items=[b"m1"], after=None, fence=fence)
    assert handle is not None

    async def take_over() -> None:
        # While the append (slow) holds its gate, the lease lapses and another takes it.
        await asyncio.sleep(0.35)
        taken = await leases.acquire(T, "race", "new", ttl=30)
        assert taken is not None and taken.fence == fence + 1

    racer = asyncio.create_task(take_over())
    with pytest.raises(StaleFenceError):
        await _pair(pg_stores, "race", b"f2", step=2, items=[b"slow"], after=handle, fence=fence)
    await racer
    assert await _state(pg_admin, "race") == (b"f1", [1], [b"m1"])
    # The new holder goes on from the old frontier's prefix.
    new = await _pair(
        pg_stores, "race", b"g2", step=2, items=[b"n2"], after=handle, fence=fence + 1
    )
    assert new is not None
    assert await _state(pg_admin, "race") == (b"g2", [1, 2], [b"m1", b"n2"])


# --- the runner on top -------------------------------------------------------------------


@pytest.mark.usefixtures("grouped_writes")
@pytest.mark.parametrize("parallel", [1, 3])
async def test_several_calls_a_turn_are_each_sent_once_and_all_recorded(
    pg_stores: Stores, parallel: int
) -> None:
    sent: list[str] = []

    @tool
    async def book(seat: str) -> str:
        sent.append(seat)
        await asyncio.sleep(0)
        return f"booked {seat}"

    script: list[Any] = [
        ScriptedTurn(calls=[("book", {"seat": f"{t}-{c}"}) for c in range(3)], cost_micros=1)
        for t in range(2)
    ]
    runner = AgentRunner.from_stores(ScriptedProvider([*script, "done"]), pg_stores)
    agent = Agent("g", "b", tools=[book], parallel_tool_calls=parallel)
    run = await runner.run(agent, "go", tenant=T, run_id=f"calls-{parallel}")
    assert run.status == "completed"
    assert sorted(sent) == sorted(f"{t}-{c}" for t in range(2) for c in range(3))
    records = await pg_stores.idempotency.records(T, f"calls-{parallel}")
    assert sorted(r.status for r in records) == [RecordStatus.completed] * 6


@pytest.mark.usefixtures("grouped_writes")
async def test_the_last_outcome_of_a_turn_is_committed_before_the_frontier_after_it(
    pg_stores: Stores, pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[dict[str, str]] = []
    checkpoints = pg_stores.checkpoints
    put = checkpoints.put_with_history  # type: ignore[attr-defined]

    async def looking(*args: Any, **kwargs: Any) -> Any:
        # What another connection sees, each time a frontier is about to be written.
        group = joined(checkpoints.database)  # type: ignore[attr-defined]
        async with await psycopg.AsyncConnection.connect(pg_url, autocommit=True) as other:
            cur = await other.execute(
                "SELECT call_id, status FROM adk_idempotency WHERE run_id = 'last'"
            )
            seen.append({str(c): str(s) for c, s in await cur.fetchall()})
        seen[-1]["grouped"] = str(group is not None)
        return await put(*args, **kwargs)

    monkeypatch.setattr(checkpoints, "put_with_history", looking)

    @tool
    def book(seat: str) -> str:
        return f"booked {seat}"

    script = [ScriptedTurn(calls=[("book", {"seat": "a"}), ("book", {"seat": "b"})]), "done"]
    runner = AgentRunner.from_stores(ScriptedProvider(script), pg_stores)
    run = await runner.run(Agent("g", "b", tools=[book]), "go", tenant=T, run_id="last")
    assert run.status == "completed"
    # The frontier after the tool results finds both outcomes already committed.
    assert any(s.get("call_0_0") == "completed" and s.get("call_0_1") == "completed" for s in seen)


# --- a holder frozen between the pair and its COMMIT --------------------------------------


def _lock_gate_row(url: str, run_id: str, out: dict[str, Any]) -> None:
    """Another holder, in a thread: wait at most 2.5 s for the run's history gate row."""
    import time

    start = time.monotonic()
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("SET lock_timeout = '2500ms'")
        try:
            conn.execute(
                "SELECT 1 FROM adk_fences WHERE store = 'history' AND tenant = %s "
                "AND run_id = %s FOR UPDATE",
                (T, run_id),
            )
            out["locked"] = True
        except psycopg.errors.LockNotAvailable:
            out["locked"] = False
    out["waited"] = time.monotonic() - start


def _frozen_while_another_waits(url: str, run_id: str) -> dict[str, Any]:
    """The whole process frozen 3 s (SIGSTOP, a paused VM: no timer fires) while another
    holder waits for the run's gate row."""
    import threading
    import time

    out: dict[str, Any] = {}
    other = threading.Thread(target=_lock_gate_row, args=(url, run_id, out))
    other.start()
    time.sleep(3.0)
    other.join()
    return out


@pytest.fixture
async def short_idle_stores(pg_url: str) -> AsyncIterator[Stores]:
    """The stores with a 0.5 s deadline, so a group's idle bound is 1 s."""
    stores = open_postgres_stores(services.with_query(pg_url, timeout="0.5"))
    try:
        yield stores
    finally:
        await stores.aclose()


async def test_a_group_frozen_inside_its_transaction_is_ended_by_the_server(
    short_idle_stores: Stores, pg_admin: psycopg.AsyncConnection[Any], pg_url: str
) -> None:
    quick_stores = short_idle_stores
    # The kit's own bound for a group (``_idle_bound``, 1 s here): a frozen holder's rows
    # are freed by the server. It never fired while each write ended a psycopg pipeline,
    # whose Flush after its Sync disarms the server's idle timer (a strict xfail until
    # group writes went as one simple-protocol message each, ``driver.batched``).
    await quick_stores.create_schema()
    handle = await _first(quick_stores, "frozen-group")
    async with services.write_group(quick_stores) as group:
        await _pair(quick_stores, "frozen-group", b"f2", step=2, items=[b"m2"], after=handle)
        out = _frozen_while_another_waits(pg_url, "frozen-group")
        with contextlib.suppress(StoreUnavailableError):  # ended by the server: lost
            await group.commit()
    assert out["locked"] is True and out["waited"] < 2.0
    assert await _state(pg_admin, "frozen-group") == (b"f1", [1], [b"m1"])


# --- a takeover between the gates and the COMMIT ------------------------------------------


async def test_a_takeover_before_the_old_holders_commit_waits_and_wins(
    pg_stores: Stores,
    pg_admin: psycopg.AsyncConnection[Any],
    pg_url: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    leases = pg_stores.leases
    assert leases is not None
    first = await leases.acquire(T, "late", "old", ttl=0.05)
    handle = await _pair(
        pg_stores, "late", b"f1", step=1, items=[b"m1"], after=None, fence=first.fence
    )
    assert handle is not None
    other = open_postgres_stores(pg_url)
    execute = psycopg.AsyncConnection.execute
    racers: list[asyncio.Task[Any]] = []

    async def new_holder() -> HistoryHandle | None:
        assert other.leases is not None
        taken = await other.leases.acquire(T, "late", "new", ttl=30)
        # Resumes from what is committed: the old holder's first frontier.
        latest = await other.checkpoints.latest(T, "late")
        assert latest is not None and latest.payload == b"f1"
        return await _pair(
            other, "late", b"g2", step=2, items=[b"n2"], after=handle, fence=taken.fence
        )

    async def racing(self: Any, query: Any, *args: Any, **kwargs: Any) -> Any:
        if query == "COMMIT" and self.pgconn.pipeline_status == 0 and not racers:
            await asyncio.sleep(0.1)  # the old lease lapses
            racers.append(asyncio.create_task(new_holder()))
            await asyncio.sleep(0.3)  # the new holder is now waiting on the gate rows
            assert not racers[0].done()
        return await execute(self, query, *args, **kwargs)

    try:
        monkeypatch.setattr(psycopg.AsyncConnection, "execute", racing)
        # The old holder's gates passed before the takeover: its pair commits.
        await _pair(
            pg_stores, "late", b"f2", step=2, items=[b"m2"], after=handle, fence=first.fence
        )
        monkeypatch.undo()
        new = await asyncio.wait_for(racers[0], 5)
    finally:
        await other.aclose()
    assert new is not None
    # The new holder's pair replaced the old's, and the frontier names a stored prefix.
    assert await _state(pg_admin, "late") == (b"g2", [1, 2], [b"m1", b"n2"])
    assert await pg_stores.history.fetch(new) == [b"m1", b"n2"]
    with pytest.raises(StaleFenceError):
        await _pair(pg_stores, "late", b"f3", step=3, items=[b"m3"], after=new, fence=first.fence)


async def test_a_group_whose_backend_is_killed_midway_through_a_pair_commits_nothing(
    pg_stores: Stores,
    pg_admin: psycopg.AsyncConnection[Any],
    pg_url: str,
    slow_history: None,
) -> None:
    handle = await _first(pg_stores, "mid")
    async with services.write_group(pg_stores) as group:
        await pg_stores.checkpoints.put(T, "before", b"b", step=1, fence=None)
        assert isinstance(group, PostgresWriteGroup) and group._conn is not None
        pid = group._conn.info.backend_pid

        async def kill() -> None:
            await asyncio.sleep(0.2)
            await _terminate(pg_url, pid)

        killer = asyncio.create_task(kill())
        with pytest.raises(StoreUnavailableError):
            await _pair(pg_stores, "mid", b"f2", step=2, items=[b"slow"], after=handle)
        await killer
        assert group._lost is not None
        with pytest.raises(StoreUnavailableError):
            await group.commit()
    assert await _state(pg_admin, "mid") == (b"f1", [1], [b"m1"])
    assert await _state(pg_admin, "before") == (None, [], [])
    await _still_writes(pg_stores, "mid")


async def test_a_pair_cancelled_after_another_pair_in_its_group_undoes_only_itself(
    pg_stores: Stores, pg_admin: psycopg.AsyncConnection[Any], slow_history: None
) -> None:
    async def write() -> None:
        async with services.write_group(pg_stores) as group:
            try:
                handle = await _first(pg_stores, "shadow")  # its savepoint left open
                await pg_stores.checkpoints.put(T, "between", b"x", step=1, fence=None)
                await _pair(pg_stores, "shadow", b"f2", step=2, items=[b"slow"], after=handle)
            finally:
                await asyncio.shield(group.commit())

    task = asyncio.create_task(write())
    await asyncio.sleep(0.2)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    # ROLLBACK TO SAVEPOINT adk_together went back to the cancelled pair's own savepoint,
    # not to the first pair's of the same name.
    assert await _state(pg_admin, "shadow") == (b"f1", [1], [b"m1"])
    assert (await _state(pg_admin, "between"))[0] == b"x"
    _pool_is_clean(pg_stores)
