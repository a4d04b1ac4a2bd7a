"""Attacks on a502afd: a PostgreSQL write group's COMMIT rides in the message of its last
single statement (the turn's claim, the cancel check at the top of the loop), on the real
server with the runner on top (``group_writes=True``).

The oracle is a counting tool (each real dispatch appends to a list) and the ledger's
spend against the model calls the provider counted; another connection looks at what is
committed at the moment a tool is sent. Failures are made by triggers in the test's own
schema, by terminating the group's backend, by wrapping ``batched`` in the group module (to
raise before or after the real message), and by cancelling the run's task.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

import psycopg
import pytest
from psycopg.pq import TransactionStatus

from adapters import services
from tesserix_adk import Agent, AgentRunner, ScriptedProvider, ScriptedTurn, tool
from tesserix_adk.adapters.postgres import grouping as pg_grouping
from tesserix_adk.adapters.postgres import open_postgres_stores
from tesserix_adk.errors import (
    AdkError,
    IndeterminateToolCallError,
    StoreReplyLostError,
    StoreUnavailableError,
)
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.stores.protocols import RecordStatus, ToolFlags

pytestmark = [pytest.mark.postgres, pytest.mark.usefixtures("grouped_writes")]

T = "acme"
COST = 100
REAL_BATCHED = pg_grouping.batched


def _script(turns: int, calls: int) -> list[Any]:
    return [
        *(
            ScriptedTurn(
                calls=[("book", {"seat": f"{t}-{c}"}) for c in range(calls)], cost_micros=COST
            )
            for t in range(turns)
        ),
        ScriptedTurn(text="done", cost_micros=COST),
    ]


class Oracle:
    """A counting tool; at each dispatch, what another connection sees committed."""

    def __init__(self, url: str | None = None) -> None:
        self.url = url
        self.sent: list[str] = []
        self.seen_at_dispatch: list[dict[str, Any]] = []

        @tool
        async def book(seat: str) -> str:
            self.sent.append(seat)
            if self.url is not None:
                self.seen_at_dispatch.append(await self._look())
            await asyncio.sleep(0)
            return f"booked {seat}"

        self.tool = book

    async def _look(self) -> dict[str, Any]:
        assert self.url is not None
        async with await psycopg.AsyncConnection.connect(self.url, autocommit=True) as other:
            cur = await other.execute("SELECT call_id, status FROM adk_idempotency")
            claims = {str(c): str(s) for c, s in await cur.fetchall()}
            cur = await other.execute("SELECT coalesce(sum(micros), 0) FROM adk_ledger")
            row = await cur.fetchone()
        return {"claims": claims, "spent": int(row[0]) if row else 0}

    def agent(self, **kwargs: Any) -> Agent:
        return Agent("g", "b", tools=[self.tool], max_iterations=20, **kwargs)


async def _spent(stores: Stores, run_id: str) -> int:
    assert stores.ledger is not None
    return await stores.ledger.spent(T, run_id)


async def _statuses(stores: Stores, run_id: str) -> dict[str, str]:
    records = await stores.idempotency.records(T, run_id)
    return {str(r.call_id): str(r.status) for r in records if r.tool}


def _pool_is_clean(stores: Stores) -> None:
    pool = stores.idempotency.database.pool  # type: ignore[attr-defined]
    for conn in list(pool._pool):
        assert conn.info.transaction_status is TransactionStatus.IDLE


async def _no_open_transactions(admin: psycopg.AsyncConnection[Any], stores: Stores) -> None:
    pool = stores.idempotency.database.pool  # type: ignore[attr-defined]
    pids = [c.info.backend_pid for c in list(pool._pool)]
    cur = await admin.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE pid = ANY(%s) AND state <> 'idle'",
        (pids,),
    )
    row = await cur.fetchone()
    assert row is not None and row[0] == 0


async def _resume_to_the_end(
    runner: AgentRunner, agent: Agent, run_id: str, tries: int = 4
) -> Any:
    """Resume until the run finishes or is refused as in doubt (then that error)."""
    last: BaseException | None = None
    for _ in range(tries):
        try:
            return await runner.resume(agent, run_id, tenant=T)
        except IndeterminateToolCallError as exc:
            return exc
        except AdkError as exc:
            if not exc.retryable:
                raise
            last = exc
    raise AssertionError(f"never finished: {last!r}")


def _wrap_batched(
    monkeypatch: pytest.MonkeyPatch,
    wanted: Callable[[Any, Any, Any, Any], bool],
    *,
    after: bool,
    error: Callable[[], BaseException] = lambda: psycopg.OperationalError("reply lost"),
    times: int = 1,
) -> list[int]:
    """``batched`` in the group module raising ``error`` before or after the real message
    when ``wanted(before, statements, after_statements, conn)`` (``times`` times)."""
    hits: list[int] = []

    async def wrapped(conn: Any, before: Any, statements: Any, tail: Any = (), prepared: Any = None):
        hit = len(hits) < times and wanted(before, statements, tail, conn)
        if hit:
            hits.append(1)
            if not after:
                raise error()
        result = await REAL_BATCHED(conn, before, statements, tail, prepared)
        if hit:
            raise error()
        return result

    monkeypatch.setattr(pg_grouping, "batched", wrapped)
    return hits


def _claim_with_commit(before: Any, statements: Any, tail: Any, conn: Any) -> bool:
    return "COMMIT" in tail and "adk_idempotency" in statements[0][0] and "INSERT" in (
        statements[0][0].upper()
    )


def _lookup_with_commit(before: Any, statements: Any, tail: Any, conn: Any) -> bool:
    return "COMMIT" in tail and "INSERT" not in statements[0][0].upper()


# --- (1) claim durable before dispatch ---------------------------------------------------


@pytest.mark.parametrize(("calls", "parallel"), [(1, 1), (3, 1), (3, 3)])
async def test_every_dispatch_finds_its_claim_and_the_turns_charge_committed(
    pg_stores: Stores, pg_url: str, calls: int, parallel: int
) -> None:
    oracle = Oracle(pg_url)
    provider = ScriptedProvider(_script(2, calls))
    runner = AgentRunner.from_stores(provider, pg_stores)
    run = await runner.run(oracle.agent(parallel_tool_calls=parallel), "go", tenant=T, run_id="d")
    assert run.status == "completed"
    assert sorted(oracle.sent) == sorted(f"{t}-{c}" for t in range(2) for c in range(calls))
    # Each dispatch: its own claim committed in flight, and every model call so far charged.
    for seat, seen in zip(oracle.sent, oracle.seen_at_dispatch, strict=True):
        turn, index = (int(x) for x in seat.split("-"))
        assert seen["claims"].get(f"call_{turn}_{index}") == RecordStatus.in_flight.value
        assert seen["spent"] == COST * (turn + 1)
    assert await _spent(pg_stores, "d") == COST * provider.calls
