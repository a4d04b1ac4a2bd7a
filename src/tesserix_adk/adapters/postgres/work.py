"""The work index in PostgreSQL: ``adk_work``, one row per run ever submitted, wanted or
parked (``migrations/0003_work_index.sql``).

``take_order`` is a column generated from ``state`` (decided 0, wanted 1, submitted 2;
NULL for parked and done), and the partial indexes ``adk_work_due`` and
``adk_work_due_by_agent`` hold only the rows that want a worker, ordered by (take order,
since). ``due`` is one statement (``sql/work/due.sql``) that reads at most ``scan`` entries
from the head of one of them (per agent asked for), skips those backing off or with a lease
live by ``clock_timestamp()`` (joined from ``adk_run_leases`` in that statement) and
returns the first ``limit``. Every other call is one statement too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tesserix_adk.adapters.postgres.connection import PostgresDatabase, Row
from tesserix_adk.adapters.postgres.fenced import run_params
from tesserix_adk.adapters.postgres.statements import Statements, words
from tesserix_adk.stores.protocols import WorkItem, WorkListing, WorkState
from tesserix_adk.stores.rows import (
    decoded,
    due_items,
    listed_items,
    listing_around_damage,
    typed,
    with_damaged,
)

__all__ = ["DEFAULT_SCAN", "PostgresWorkIndex"]

DEFAULT_SCAN = 1024
"""How many entries past ``limit`` one ``due`` reads from a head at most: that many runs
held by live leases or backing off can come first and still not hide a due run."""

_WANTING = (WorkState.decided, WorkState.wanted, WorkState.submitted)


@dataclass(frozen=True, slots=True, kw_only=True)
class _SQL(Statements):
    submit: str
    input: str
    entry: str
    want: str
    wake: str
    park: str
    done: str
    due: str
    items: str


def _where(row: Row) -> str:
    return f"{row.get('tenant')}/{row.get('run_id')}"


def _names(row: Row) -> tuple[str | None, str | None]:
    tenant, run_id = row.get("tenant"), row.get("run_id")
    return (
        tenant if isinstance(tenant, str) else None,
        run_id if isinstance(run_id, str) else None,
    )


@decoded("work index entry")
def _item(row: Row) -> WorkItem:
    not_before = typed(row["not_before"], float, type(None), what="not_before")
    return WorkItem(
        tenant=typed(row["tenant"], str, what="tenant"),
        run_id=typed(row["run_id"], str, what="run_id"),
        agent=typed(row["agent"], str, what="agent"),
        state=WorkState(row["state"]),
        since=float(typed(row["since"], float, what="since")),
        not_before=not_before,
        attempts=int(typed(row["attempts"], int, what="attempts")),
        reason=typed(row["reason"], str, type(None), what="reason"),
    )


@decoded("work index input")
def _input(row: Row) -> bytes | None:
    raw = typed(row["input"], bytes, memoryview, type(None), what="input")
    return None if raw is None else bytes(raw)


class PostgresWorkIndex:
    """A ``WorkIndex`` in ``adk_work``; leases are live by ``clock_timestamp()``.

    ``scan`` bounds what one ``due`` reads: ``limit + scan`` entries from the head of the
    index (per agent asked for). When more runs than ``scan`` at the head are held by live
    leases or backing off, ``due`` returns fewer than it could until some of them move on.
    """

    def __init__(self, database: PostgresDatabase, *, scan: int = DEFAULT_SCAN) -> None:
        if scan < 0:
            raise ValueError(f"scan must be at least 0, got {scan}")
        self.database = database
        self.scan = scan
        self._sql = _SQL.load("work", database.schema.schema)
        self._damaged: set[str] = set()  # damaged entries already named in the log

    async def submit(self, tenant: str, run_id: str, *, agent: str, input: bytes) -> bool:
        """Record a run as submitted; ``False`` (nothing written) when the run is known."""
        row = await self.database.row(
            f"submitting run {run_id!r}",
            self._sql.submit,
            run_params(tenant, run_id, agent=agent, input=bytes(input)),
        )
        return row is not None

    async def input(self, tenant: str, run_id: str) -> bytes | None:
        """The encoded input the run was submitted with, or ``None``."""
        row = await self.database.row(
            f"reading the input of run {run_id!r}", self._sql.input, run_params(tenant, run_id)
        )
        return None if row is None else _input(row)

    async def entry(self, tenant: str, run_id: str) -> WorkItem | None:
        """The run's entry in any state, or ``None``."""
        row = await self.database.row(
            f"reading the work index entry of run {run_id!r}",
            self._sql.entry,
            run_params(tenant, run_id),
        )
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
        """The run wants a worker, not before ``delay`` seconds from now (server clock)."""
        if state not in _WANTING:
            raise ValueError(
                f"a run that wants a worker is decided, wanted or submitted, not {state}"
            )
        await self.database.rows(
            f"marking run {run_id!r} as wanting a worker",
            self._sql.want,
            run_params(
                tenant,
                run_id,
                agent=agent,
                state=state.value,
                delay=max(0.0, float(delay)),
                reason=words(reason),
                count=None if count is None else int(count),
            ),
        )

    async def wake(
        self, tenant: str, run_id: str, *, agent: str, attempts: int, reason: str | None
    ) -> bool:
        """Wanted now with one more attempt, if still parked as read: one statement."""
        rows = await self.database.rows(
            f"waking parked run {run_id!r}",
            self._sql.wake,
            run_params(tenant, run_id, agent=agent, attempts=int(attempts), reason=words(reason)),
        )
        return bool(rows)

    async def park(self, tenant: str, run_id: str, *, agent: str, reason: str) -> None:
        """The run must not be carried on until an operator acts."""
        await self.database.rows(
            f"parking run {run_id!r}",
            self._sql.park,
            run_params(tenant, run_id, agent=agent, reason=words(reason)),
        )

    async def done(self, tenant: str, run_id: str) -> None:
        """The run wants no worker now; a no-op for a run the index does not hold."""
        await self.database.rows(
            f"marking run {run_id!r} as done", self._sql.done, run_params(tenant, run_id)
        )

    async def due(self, *, limit: int, agents: Sequence[str] | None = None) -> list[WorkItem]:
        """Up to ``limit`` runs a worker may take now, in take order: one statement."""
        if limit <= 0:
            return []
        asked = with_damaged(limit, self._damaged)
        rows = await self.database.rows(
            "finding runs that want a worker",
            self._sql.due,
            {
                "row_limit": int(asked),
                "scan": int(asked) + self.scan,
                "agents": None if agents is None else [str(a) for a in agents],
            },
        )
        return due_items(rows, _item, self._damaged, _where)[:limit]

    async def items(
        self, tenant: str | None = None, *, state: WorkState | None = None
    ) -> list[WorkItem]:
        """The entries of ``tenant`` in ``state`` (any but ``done``), oldest first."""
        return listed_items(await self.listing(tenant, state=state))

    async def listing(
        self, tenant: str | None = None, *, state: WorkState | None = None
    ) -> WorkListing:
        """``items``, going on past a damaged entry and naming it."""
        rows = await self.database.rows(
            "listing the work index",
            self._sql.items,
            {"tenant": tenant, "state": None if state is None else WorkState(state).value},
        )
        return listing_around_damage(rows, _item, _names)
