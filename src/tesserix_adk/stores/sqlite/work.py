"""The work index in SQLite: ``adk_work``, one row per run ever submitted, wanted or parked
(``migrations/0004_work_index.sql``).

``take_order`` is a column generated from ``state`` (decided 0, wanted 1, submitted 2; NULL
for parked and done), and the partial indexes ``adk_work_due`` and ``adk_work_due_by_agent``
hold only the rows that want a worker, ordered by (take order, since). ``due`` is one
statement that reads at most ``limit + scan`` entries from the head of one of them (per
agent asked for), skips those backing off or with a lease live by SQLite's clock (joined
from ``adk_run_leases`` in that statement, with the "now" the lease store uses) and returns
the first ``limit``. Every other call is one statement too, each in its own transaction.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Sequence
from typing import Any

from tesserix_adk.stores.protocols import WorkItem, WorkListing, WorkState
from tesserix_adk.stores.rows import (
    decoded,
    due_items,
    leading,
    listed_items,
    listing_around_damage,
    typed,
    with_damaged,
)
from tesserix_adk.stores.sqlite.database import SqliteDatabase
from tesserix_adk.stores.sqlite.fencing import NOW_SQL

__all__ = ["DEFAULT_SCAN", "MAX_AGENT_HEADS", "SqliteWorkIndex"]

DEFAULT_SCAN = 1024
"""How many entries past ``limit`` one ``due`` reads from a head at most: that many runs
held by live leases or backing off can come first and still not hide a due run."""

MAX_AGENT_HEADS = 64
"""Up to this many agents asked for, ``due`` reads a head per agent; past it (SQLite caps
the arms of one compound statement), one head of every agent, filtered by agent."""

_WANTING = (WorkState.decided, WorkState.wanted, WorkState.submitted)

_ITEM_COLUMNS = "tenant, run_id, agent, state, since, not_before, attempts, reason"

_SUBMIT = (
    "INSERT INTO adk_work (tenant, run_id, agent, state, since, input) "
    f"VALUES (:tenant, :run_id, :agent, 'submitted', {NOW_SQL}, :input) "
    "ON CONFLICT (tenant, run_id) DO NOTHING"
)

_INPUT = "SELECT input FROM adk_work WHERE tenant = :tenant AND run_id = :run_id"

_ENTRY = f"SELECT {_ITEM_COLUMNS} FROM adk_work WHERE tenant = :tenant AND run_id = :run_id"

# A run keeps its place (since) when it was in that state already. A given count moves
# the count of attempts by that much (never below 0); without one a delayed want counts one
# more attempt, and a prompt one keeps the count in the same state and starts it again in
# another. The input stays.
_WANT = (
    "INSERT INTO adk_work (tenant, run_id, agent, state, since, not_before, attempts, reason) "
    f"VALUES (:tenant, :run_id, :agent, :state, {NOW_SQL}, "
    f"CASE WHEN :delay > 0 THEN {NOW_SQL} + :delay END, "
    "CASE WHEN :count IS NOT NULL THEN MAX(0, :count) WHEN :delay > 0 THEN 1 ELSE 0 END, "
    ":reason) "
    "ON CONFLICT (tenant, run_id) DO UPDATE SET "
    "agent = excluded.agent, "
    "state = excluded.state, "
    "since = CASE WHEN adk_work.state = excluded.state THEN adk_work.since "
    "ELSE excluded.since END, "
    "not_before = excluded.not_before, "
    "attempts = CASE WHEN :count IS NOT NULL THEN MAX(0, adk_work.attempts + :count) "
    "WHEN :delay > 0 THEN adk_work.attempts + 1 "
    "WHEN adk_work.state = excluded.state THEN adk_work.attempts ELSE 0 END, "
    "reason = excluded.reason "
    # A worker's count (a take, a give-back) never unparks a run or revives a finished one.
    "WHERE :count IS NULL OR adk_work.state NOT IN ('parked', 'done')"
)

# Only an entry still parked as it was read; the input stays.
_WAKE = (
    f"UPDATE adk_work SET state = 'wanted', since = {NOW_SQL}, not_before = NULL, "
    "attempts = attempts + 1, reason = NULL "
    "WHERE tenant = :tenant AND run_id = :run_id AND state = 'parked' AND agent = :agent "
    "AND attempts = :attempts AND reason IS :reason"
)

# Attempts and input are kept.
_PARK = (
    "INSERT INTO adk_work (tenant, run_id, agent, state, since, reason) "
    f"VALUES (:tenant, :run_id, :agent, 'parked', {NOW_SQL}, :reason) "
    "ON CONFLICT (tenant, run_id) DO UPDATE SET "
    "agent = excluded.agent, state = 'parked', since = excluded.since, "
    "not_before = NULL, reason = excluded.reason"
)

# The row (and so its submission) stays; a run the index does not hold is left unknown.
_DONE = (
    f"UPDATE adk_work SET state = 'done', since = {NOW_SQL}, not_before = NULL, "
    "reason = NULL, attempts = 0 WHERE tenant = :tenant AND run_id = :run_id"
)

_HEAD_ORDER = "ORDER BY take_order, since, tenant, run_id"

_HEAD = (
    f"SELECT {_ITEM_COLUMNS}, take_order FROM adk_work "
    f"WHERE take_order IS NOT NULL {{agent}}{_HEAD_ORDER} LIMIT :scan"
)

# The heads read (and no other row of adk_work): the bound on what one call reads however
# many runs there are. A run of them is due when it is past not_before and no lease on it
# is live by SQLite's clock, read once ("now") for the whole statement.
_DUE = (
    f"WITH now (t) AS (SELECT {NOW_SQL}), head AS ({{heads}}) "
    f"SELECT {', '.join(f'h.{c}' for c in _ITEM_COLUMNS.split(', '))} "
    "FROM head AS h, now "
    "WHERE (h.not_before IS NULL OR h.not_before <= now.t) "
    "AND NOT EXISTS (SELECT 1 FROM adk_run_leases AS l "
    "WHERE l.tenant = h.tenant AND l.run_id = h.run_id "
    "AND l.holder IS NOT NULL AND l.expires_at > now.t) "
    "ORDER BY h.take_order, h.since, h.tenant, h.run_id LIMIT :row_limit"
)


def _due_statement(agents: Sequence[str] | None) -> str:
    """``_DUE`` over one head (every agent, or past ``MAX_AGENT_HEADS`` agents) or one
    head per agent asked for (``:agent0``, ``:agent1``, …)."""
    if agents is None:
        return _DUE.format(heads=_HEAD.format(agent=""))
    if len(agents) > MAX_AGENT_HEADS:
        # Runs of other agents at the head then use up part of the scan.
        where = "AND agent IN (SELECT value FROM json_each(:agents)) "
        return _DUE.format(heads=_HEAD.format(agent=where))
    # Each arm in a subquery of its own: a compound SELECT takes one ORDER BY and LIMIT.
    heads = " UNION ALL ".join(
        f"SELECT * FROM ({_HEAD.format(agent=f'AND agent = :agent{n} ')})"
        for n in range(len(agents))
    )
    return _DUE.format(heads=heads)


def _items_statement(tenant: str | None, state: WorkState | None) -> str:
    # Conditions left out rather than made always true, so the planner can use the
    # partial index adk_work_listed for "everything not done".
    where = ["state <> 'done'" if state is None else "state = :state"]
    if tenant is not None:
        where.append("tenant = :tenant")
    return (
        f"SELECT {_ITEM_COLUMNS} FROM adk_work WHERE {' AND '.join(where)} "
        "ORDER BY since, tenant, run_id"
    )


@decoded("work index entry")
def _item(row: Sequence[Any]) -> WorkItem:
    tenant, run_id, agent, state, since, not_before, attempts, reason = row
    return WorkItem(
        tenant=typed(tenant, str, what="tenant"),
        run_id=typed(run_id, str, what="run_id"),
        agent=typed(agent, str, what="agent"),
        state=WorkState(state),
        since=float(typed(since, float, int, what="since")),
        not_before=(
            None if not_before is None else float(typed(not_before, float, int, what="not_before"))
        ),
        attempts=int(typed(attempts, int, what="attempts")),
        reason=typed(reason, str, type(None), what="reason"),
    )


def _names(row: Sequence[Any]) -> tuple[str | None, str | None]:
    tenant, run_id = row[0], row[1]
    return (
        tenant if isinstance(tenant, str) else None,
        run_id if isinstance(run_id, str) else None,
    )


@decoded("work index input")
def _input(raw: Any) -> bytes | None:
    return None if raw is None else bytes(typed(raw, bytes, what="input"))


class SqliteWorkIndex:
    """A ``WorkIndex`` in ``adk_work``; leases are live by SQLite's clock, as
    ``SqliteLeaseStore`` decides them.

    ``scan`` bounds what one ``due`` reads: ``limit + scan`` entries from the head of the
    index (per agent asked for). When more than ``scan`` runs at the head are held by live
    leases or backing off, ``due`` returns fewer than it could until some of them move on.
    """

    def __init__(self, database: SqliteDatabase, *, scan: int = DEFAULT_SCAN) -> None:
        if scan < 0:
            raise ValueError(f"scan must be at least 0, got {scan}")
        self.database = database
        self.scan = scan
        self._damaged: set[str] = set()  # damaged entries already named in the log

    async def submit(self, tenant: str, run_id: str, *, agent: str, input: bytes) -> bool:
        """Record a run as submitted; ``False`` (nothing written) when the run is known."""
        params = {"tenant": tenant, "run_id": run_id, "agent": agent, "input": bytes(input)}
        inserted = await self.database.write(lambda conn: conn.execute(_SUBMIT, params).rowcount)
        return inserted == 1

    async def input(self, tenant: str, run_id: str) -> bytes | None:
        """The encoded input the run was submitted with, or ``None``."""
        params = {"tenant": tenant, "run_id": run_id}
        row = await self.database.read(lambda conn: conn.execute(_INPUT, params).fetchone())
        return None if row is None else _input(row[0])

    async def entry(self, tenant: str, run_id: str) -> WorkItem | None:
        """The run's entry in any state, or ``None``."""
        params = {"tenant": tenant, "run_id": run_id}
        row = await self.database.read(lambda conn: conn.execute(_ENTRY, params).fetchone())
        return None if row is None else _item(row)

    async def want(
        self,
        tenant: str,
        run_id: str,
        *,
        agent: str,
        state: WorkState = WorkState.wanted,
        delay: float = 0.0,
        reason: str | None = None,
        count: int | None = None,
    ) -> None:
        """The run wants a worker, not before ``delay`` seconds from now (SQLite's clock)."""
        if state not in _WANTING:
            raise ValueError(
                f"a run that wants a worker is decided, wanted or submitted, not {state}"
            )
        params = {
            "tenant": tenant,
            "run_id": run_id,
            "agent": agent,
            "state": WorkState(state).value,
            "delay": max(0.0, float(delay)),
            "reason": reason,
            "count": None if count is None else int(count),
        }
        await self.database.write(lambda conn: conn.execute(_WANT, params))

    async def wake(
        self, tenant: str, run_id: str, *, agent: str, attempts: int, reason: str | None
    ) -> bool:
        """Wanted now with one more attempt, if still parked as read: one statement."""
        params = {
            "tenant": tenant,
            "run_id": run_id,
            "agent": agent,
            "attempts": int(attempts),
            "reason": reason,
        }

        def wake(conn: sqlite3.Connection) -> bool:
            return conn.execute(_WAKE, params).rowcount == 1

        return await self.database.write(wake)

    async def park(self, tenant: str, run_id: str, *, agent: str, reason: str) -> None:
        """The run must not be carried on until an operator acts."""
        params = {"tenant": tenant, "run_id": run_id, "agent": agent, "reason": reason}
        await self.database.write(lambda conn: conn.execute(_PARK, params))

    async def done(self, tenant: str, run_id: str) -> None:
        """The run wants no worker now; a no-op for a run the index does not hold."""
        params = {"tenant": tenant, "run_id": run_id}
        await self.database.write(lambda conn: conn.execute(_DONE, params))

    async def due(self, *, limit: int, agents: Sequence[str] | None = None) -> list[WorkItem]:
        """Up to ``limit`` runs a worker may take now, in take order: one statement."""
        if limit <= 0:
            return []
        wanted, limit = limit, with_damaged(limit, self._damaged)
        params: dict[str, Any] = {"row_limit": int(limit), "scan": int(limit) + self.scan}
        asked = None if agents is None else list(dict.fromkeys(str(a) for a in agents))
        if asked is not None:
            if not asked:
                return []
            if len(asked) > MAX_AGENT_HEADS:
                params["agents"] = json.dumps(asked)
            else:
                params.update({f"agent{n}": agent for n, agent in enumerate(asked)})
        sql = _due_statement(asked)

        def due(conn: sqlite3.Connection) -> list[Any]:
            return conn.execute(sql, params).fetchall()

        return due_items(await self.database.read(due), _item, self._damaged, leading)[:wanted]

    async def items(
        self, tenant: str | None = None, *, state: WorkState | None = None
    ) -> list[WorkItem]:
        """The entries of ``tenant`` in ``state`` (any but ``done``), oldest first."""
        return listed_items(await self.listing(tenant, state=state))

    async def listing(
        self, tenant: str | None = None, *, state: WorkState | None = None
    ) -> WorkListing:
        """``items``, going on past a damaged entry and naming it."""
        chosen = None if state is None else WorkState(state)
        sql = _items_statement(tenant, chosen)
        params = {"tenant": tenant, "state": None if chosen is None else chosen.value}

        def items(conn: sqlite3.Connection) -> list[Any]:
            return conn.execute(sql, params).fetchall()

        return listing_around_damage(await self.database.read(items), _item, _names)
