"""A turn's writes on PostgreSQL in the fewest commits (``run.grouping``), on the real
server: the group's statements share one pooled connection and one COMMIT; other runs use
other connections; a group whose connection is lost commits nothing and says so."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import psycopg
import pytest

from adapters import services
from tesserix_adk import Agent, AgentRunner, ScriptedProvider, ScriptedTurn, tool
from tesserix_adk.adapters.postgres import open_postgres_stores
from tesserix_adk.adapters.postgres.grouping import PostgresWriteGroup
from tesserix_adk.errors import StoreUnavailableError
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.stores.grouping import joined
from tesserix_adk.stores.protocols import RecordStatus

pytestmark = [pytest.mark.postgres, pytest.mark.usefixtures("grouped_writes")]


TENANT = "t"
SLEEPER = "adk-test-grouping"  # its own schema's trigger sleeps under this name


def _turns(calls_per_turn: int, turns: int) -> list[Any]:
    script: list[Any] = [
        ScriptedTurn(
            calls=[("book", {"seat": f"{t}-{c}"}) for c in range(calls_per_turn)], cost_micros=5
        )
        for t in range(turns)
    ]
    return [*script, "done"]


@pytest.fixture
async def small_pool(pg_url: str) -> AsyncIterator[Stores]:
    """The stores on a pool of two connections, fewer than the runs that share it."""
    stores = open_postgres_stores(services.with_query(pg_url, pool_max="2"))
    try:
        await stores.create_schema()
        yield stores
    finally:
        await stores.aclose()


async def _commits(
    stores: Stores, monkeypatch: pytest.MonkeyPatch, calls: int, turns: int, run_id: str
) -> int:
    sent: list[str] = []
    execute = psycopg.AsyncCursor.execute

    async def counting(self: Any, query: Any, *args: Any, **kwargs: Any) -> Any:
        # A COMMIT goes alone or as the last statement of a group's message.
        if isinstance(query, str):
            sent.extend(s for s in query.split(";\n") if s.strip().upper() == "COMMIT")
        return await execute(self, query, *args, **kwargs)

    @tool
    def book(seat: str) -> str:
        return f"booked {seat}"

    runner = AgentRunner.from_stores(ScriptedProvider(_turns(calls, turns)), stores)
    with monkeypatch.context() as patch:
        patch.setattr(psycopg.AsyncCursor, "execute", counting)
        run = await runner.run(
            Agent("g", "b", tools=[book], max_iterations=20), "go", tenant=TENANT, run_id=run_id
        )
    assert run.status == "completed"
    return len(sent)


@pytest.mark.parametrize(("calls", "per_turn"), [(1, 2), (3, 4)])
async def test_a_turn_commits_once_per_claim_plus_once_for_its_last_outcome_and_frontier(
    pg_stores: Stores, monkeypatch: pytest.MonkeyPatch, calls: int, per_turn: int
) -> None:
    # As on SQLite: one call, 2 commits a turn (8 with the reads' transactions, 3 while
    # the last outcome committed on its own); three calls, 4 (12 and 5).
    short = await _commits(pg_stores, monkeypatch, calls, 2, "a")
    long = await _commits(pg_stores, monkeypatch, calls, 6, "b")
    assert (long - short) / 4 == per_turn


async def test_each_claim_and_the_earlier_outcomes_are_committed_before_a_call_is_sent(
    pg_stores: Stores, pg_url: str
) -> None:
    seen: list[dict[str, str]] = []

    @tool
    async def book(seat: str) -> str:
        # Another connection: only what is committed shows.
        async with await psycopg.AsyncConnection.connect(pg_url, autocommit=True) as other:
            cur = await other.execute(
                "SELECT call_id, status FROM adk_idempotency WHERE run_id = 'r'"
            )
            seen.append({str(c): str(s) for c, s in await cur.fetchall()})
        return f"booked {seat}"

    runner = AgentRunner.from_stores(ScriptedProvider(_turns(3, 1)), pg_stores)
    run = await runner.run(Agent("g", "b", tools=[book]), "go", tenant=TENANT, run_id="r")
    assert run.status == "completed"
    assert seen == [
        {"call_0_0": "in_flight"},
        {"call_0_0": "completed", "call_0_1": "in_flight"},
        {"call_0_0": "completed", "call_0_1": "completed", "call_0_2": "in_flight"},
    ]


async def test_more_runs_than_pooled_connections_all_complete(small_pool: Stores) -> None:
    import asyncio

    @tool
    async def book(seat: str) -> str:
        await asyncio.sleep(0.01)
        return f"booked {seat}"

    runner = AgentRunner.from_stores(ScriptedProvider(_turns(2, 2)), small_pool)
    agent = Agent("g", "b", tools=[book])
    runs = await asyncio.wait_for(
        asyncio.gather(*(runner.run(agent, "go", tenant=TENANT, run_id=f"r{i}") for i in range(6))),
        120,
    )
    assert [r.status for r in runs] == ["completed"] * 6
    for i in range(6):
        records = await small_pool.idempotency.records(TENANT, f"r{i}")
        assert sorted(r.status for r in records) == [RecordStatus.completed] * 4


async def test_a_group_whose_connection_is_lost_sends_nothing_and_charges_once(
    pg_stores: Stores, pg_url: str
) -> None:
    sent: list[str] = []
    checkpoints = pg_stores.checkpoints
    # The frontier and its transcript append go together (``put_with_history``).
    put = checkpoints.put_with_history  # type: ignore[attr-defined]

    async def cut_then_put(*args: Any, **kwargs: Any) -> Any:
        # The turn's group holds its charge; its connection dies before the frontier.
        group = joined(checkpoints.database)  # type: ignore[attr-defined]
        assert isinstance(group, PostgresWriteGroup) and group._conn is not None
        pid = group._conn.info.backend_pid
        async with await psycopg.AsyncConnection.connect(pg_url, autocommit=True) as admin:
            await admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
        return await put(*args, **kwargs)

    checkpoints.put_with_history = cut_then_put  # type: ignore[attr-defined]

    @tool
    def book(seat: str) -> str:
        sent.append(seat)
        return f"booked {seat}"

    runner = AgentRunner.from_stores(ScriptedProvider(_turns(1, 1)), pg_stores)
    with pytest.raises(StoreUnavailableError):
        await runner.run(Agent("g", "b", tools=[book]), "go", tenant=TENANT, run_id="r")
    assert sent == []
    assert await pg_stores.idempotency.records(TENANT, "r") == []
    assert pg_stores.ledger is not None
    # Lost with the group, then charged again: the model call is paid for once.
    assert await pg_stores.ledger.spent(TENANT, "r") == 5


async def test_a_claim_whose_reply_is_lost_with_the_commit_is_dropped_and_sent_once_later(
    pg_stores: Stores, pg_admin: psycopg.AsyncConnection[Any]
) -> None:
    """The turn's claim carries the group's COMMIT; its connection dies while the server
    runs it, so nobody knows whether the charge, the frontier and the claim committed. The
    run stops retryably with nothing sent and its claim dropped (never left in doubt), and
    the run retried books once."""
    import asyncio

    await pg_admin.execute(
        "CREATE FUNCTION adk_test_trap() RETURNS trigger LANGUAGE plpgsql AS "
        f"$$ BEGIN {services.marked_sleep(SLEEPER)}; RETURN NEW; END $$"
    )
    await pg_admin.execute(
        "CREATE TRIGGER adk_test_trap BEFORE INSERT ON adk_idempotency "
        "FOR EACH ROW EXECUTE FUNCTION adk_test_trap()"
    )

    async def cut() -> None:
        pid = await services.asleep(pg_admin, SLEEPER)
        await pg_admin.execute("SELECT pg_terminate_backend(%s)", (pid,))

    sent: list[str] = []

    @tool
    def book(seat: str) -> str:
        sent.append(seat)
        return f"booked {seat}"

    agent = Agent("g", "b", tools=[book])
    runner = AgentRunner.from_stores(ScriptedProvider(_turns(1, 1)), pg_stores)
    cutting = asyncio.ensure_future(cut())
    with pytest.raises(StoreUnavailableError) as stopped:
        await runner.run(agent, "go", tenant=TENANT, run_id="r")
    await cutting
    assert stopped.value.retryable
    assert sent == []
    assert [r for r in await pg_stores.idempotency.records(TENANT, "r")] == []
    await pg_admin.execute("DROP TRIGGER adk_test_trap ON adk_idempotency")
    # Nothing of the turn is known to be durable: the run is retried from its start.
    again = AgentRunner.from_stores(ScriptedProvider(_turns(1, 1)), pg_stores)
    run = await again.run(agent, "go", tenant=TENANT, run_id="r")
    assert run.status == "completed"
    assert sent == ["0-0"]


async def test_a_claim_committed_with_its_group_whose_reply_is_lost_is_dropped_not_in_doubt(
    pg_stores: Stores, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The message carrying the group's COMMIT after the turn's claim (the cancel check) is
    applied, and then its reply is lost: the charge, the frontier and the claim are durable,
    and the run cannot know it. Nothing was sent, so the claim is dropped; the resume sends
    the call once instead of refusing it as in doubt."""
    from tesserix_adk.adapters.postgres import grouping as pg_grouping

    batched = pg_grouping.batched
    claimed: list[str] = []

    async def reply_lost(conn: Any, before: Any, statements: Any, *rest: Any, **named: Any) -> Any:
        answer = await batched(conn, before, statements, *rest, **named)
        if "claim_fenced" in statements[0][0]:
            claimed.append(statements[0][0])
        elif claimed and "COMMIT" in (rest[0] if rest else ()):
            raise psycopg.OperationalError("the reply was lost (the test)")
        return answer

    sent: list[str] = []

    @tool
    def book(seat: str) -> str:
        sent.append(seat)
        return f"booked {seat}"

    agent = Agent("g", "b", tools=[book])
    runner = AgentRunner.from_stores(ScriptedProvider(_turns(1, 1)), pg_stores)
    with monkeypatch.context() as patch:
        patch.setattr(pg_grouping, "batched", reply_lost)
        with pytest.raises(StoreUnavailableError) as stopped:
            await runner.run(agent, "go", tenant=TENANT, run_id="r")
    assert stopped.value.retryable
    assert sent == []
    assert await pg_stores.checkpoints.latest(TENANT, "r") is not None, "it was committed"
    assert await pg_stores.idempotency.records(TENANT, "r") == []
    resumed = AgentRunner.from_stores(ScriptedProvider(_turns(1, 1)), pg_stores)
    run = await resumed.resume(agent, "r", tenant=TENANT)
    assert run.status == "completed"
    assert sent == ["0-0"]
