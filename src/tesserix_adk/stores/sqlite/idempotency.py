"""SQLite idempotency records, keyed by (tenant, key); ttl claims lapse by SQLite's clock.

A claim, completion or resolution reads the live record, decides with ``stores.records``
and saves what comes back, all in one ``BEGIN IMMEDIATE`` transaction.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from tesserix_adk.stores._common import positive_ttl
from tesserix_adk.stores.protocols import IdempotencyRecord, RecordStatus, ToolFlags
from tesserix_adk.stores.records import (
    after_claim,
    after_complete,
    after_resolve,
    checked_resolution,
    listed_by,
    run_order,
)
from tesserix_adk.stores.rows import decoded, typed
from tesserix_adk.stores.sqlite.fencing import (
    NOW_SQL,
    FencedSqliteStore,
    accept_fence,
    check_fence,
    sqlite_now,
)

__all__ = ["SqliteIdempotencyStore"]

_IDEMPOTENCY = "idempotency"

# Keys per statement in a batched lookup, well under SQLite's limit on bound parameters.
_LOOKUP_CHUNK = 500

_RECORD_COLUMNS = (
    "key, status, holder, tenant, run_id, iteration, tool, call_id, side_effects, "
    "idempotent, fence, outcome, since, completed_at, expires_at, resolved_by, never_ran_by, "
    "holder_run, holder_iteration, holder_call_id"
)
# A ttl claim past its expiry is absent everywhere.
_LIVE_SQL = f"NOT (status = 'in_flight' AND expires_at IS NOT NULL AND expires_at <= {NOW_SQL})"


@decoded("idempotency record")
def _record_from_row(row: Sequence[Any]) -> IdempotencyRecord:
    (
        key,
        status,
        holder,
        tenant,
        run_id,
        iteration,
        tool,
        call_id,
        side_effects,
        idempotent,
        fence,
        outcome,
        since,
        completed_at,
        expires_at,
        by,
        never_ran_by,
        holder_run,
        holder_iteration,
        holder_call_id,
    ) = row
    flags = (
        None
        if side_effects is None
        else ToolFlags(side_effects=bool(side_effects), idempotent=bool(idempotent))
    )
    # SQLite keeps any type in any column: a value of the wrong type is damage.
    none, number = type(None), (int, float)
    return IdempotencyRecord(
        key=typed(key, str, what="key"),
        status=RecordStatus(status),
        holder=typed(holder, str, what="holder"),
        tenant=typed(tenant, str, what="tenant"),
        run_id=typed(run_id, str, what="run_id"),
        iteration=typed(iteration, int, none, what="iteration"),
        tool=typed(tool, str, none, what="tool"),
        call_id=typed(call_id, str, none, what="call_id"),
        flags=flags,
        fence=typed(fence, int, none, what="fence"),
        outcome=None if outcome is None else bytes(outcome),
        since=float(typed(since, *number, what="since")),
        completed_at=typed(completed_at, *number, none, what="completed_at"),
        expires_at=typed(expires_at, *number, none, what="expires_at"),
        by=typed(by, str, none, what="by"),
        never_ran_by=typed(never_ran_by, str, none, what="never_ran_by"),
        holder_run=typed(holder_run, str, none, what="holder_run"),
        holder_iteration=typed(holder_iteration, int, none, what="holder_iteration"),
        holder_call_id=typed(holder_call_id, str, none, what="holder_call_id"),
    )


def _record_to_row(record: IdempotencyRecord) -> tuple[Any, ...]:
    flags = record.flags
    return (
        record.key,
        record.status.value,
        record.holder,
        record.tenant,
        record.run_id,
        record.iteration,
        record.tool,
        record.call_id,
        None if flags is None else int(flags.side_effects),
        None if flags is None else int(flags.idempotent),
        record.fence,
        record.outcome,
        record.since,
        record.completed_at,
        record.expires_at,
        record.by,
        record.never_ran_by,
        record.holder_run,
        record.holder_iteration,
        record.holder_call_id,
    )


def _save_record(conn: sqlite3.Connection, record: IdempotencyRecord) -> None:
    conn.execute(
        f"INSERT OR REPLACE INTO adk_idempotency ({_RECORD_COLUMNS}) "
        "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        _record_to_row(record),
    )


def _live_record(
    conn: sqlite3.Connection, tenant: str, key: str, now: float
) -> IdempotencyRecord | None:
    """The tenant's record of ``key`` as of ``now``; a lapsed ttl claim is dropped (in a
    write)."""
    row = conn.execute(
        f"SELECT {_RECORD_COLUMNS} FROM adk_idempotency WHERE tenant = ? AND key = ?",
        (tenant, key),
    ).fetchone()
    if row is None:
        return None
    record = _record_from_row(row)
    if (
        record.status is RecordStatus.in_flight
        and record.expires_at is not None
        and now >= record.expires_at
    ):
        conn.execute("DELETE FROM adk_idempotency WHERE tenant = ? AND key = ?", (tenant, key))
        return None
    return record


def _in_chunks(keys: Sequence[str]) -> Iterator[tuple[Sequence[str], str]]:
    """``keys`` in statement-sized chunks, each with its ``?`` placeholders."""
    for start in range(0, len(keys), _LOOKUP_CHUNK):
        chunk = keys[start : start + _LOOKUP_CHUNK]
        yield chunk, ", ".join("?" * len(chunk))


def _outcome_bytes(tenant: str, keys: Sequence[str]) -> Callable[[sqlite3.Connection], int]:
    """What reading back the records of ``keys`` moves: their outcomes' bytes (a call in a
    write group weighs it before it runs on the caller's thread)."""

    def weigh(conn: sqlite3.Connection) -> int:
        total = 0
        for chunk, marks in _in_chunks(keys):
            (size,) = conn.execute(
                "SELECT coalesce(sum(length(outcome)), 0) FROM adk_idempotency "
                f"WHERE tenant = ? AND key IN ({marks})",
                [tenant, *chunk],
            ).fetchone()
            total += size
        return int(total)

    return weigh


class SqliteIdempotencyStore(FencedSqliteStore):
    """An ``IdempotencyStore``; ttl claims lapse by SQLite's clock."""

    _kind = _IDEMPOTENCY

    async def claim(
        self,
        key: str,
        *,
        holder: str,
        tenant: str,
        run_id: str,
        iteration: int | None,
        tool: str | None,
        call_id: str | None,
        flags: ToolFlags | None,
        fence: int | None = None,
        ttl: float | None = None,
        takeover: bool = False,
    ) -> IdempotencyRecord:
        """Claim the tenant's ``key`` and return the record as it stands after the call."""
        if tool is None:
            # A resume claim is taken before any lease exists: never fenced.
            fence = None

        def claim(conn: sqlite3.Connection) -> IdempotencyRecord:
            recorded = None
            if tool is not None:
                recorded = check_fence(conn, _IDEMPOTENCY, tenant, run_id, fence)
            now = sqlite_now(conn)
            record, changed = after_claim(
                _live_record(conn, tenant, key, now),
                key=key,
                holder=holder,
                tenant=tenant,
                run_id=run_id,
                iteration=iteration,
                tool=tool,
                call_id=call_id,
                flags=flags,
                fence=fence,
                now=now,
                expires_at=None if ttl is None else now + positive_ttl(ttl),
                takeover=takeover,
            )
            if tool is not None:
                accept_fence(conn, _IDEMPOTENCY, tenant, run_id, fence, recorded=recorded)
            if changed:
                _save_record(conn, record)
            return record

        # What it writes is small; what it reads back is one record, of its outcome's size.
        return await self.database.write(claim, weight=_outcome_bytes(tenant, [key]))

    async def complete(
        self, key: str, outcome: bytes, *, tenant: str, holder: str
    ) -> IdempotencyRecord:
        """Record the outcome of a claim held by ``holder`` (not fenced)."""
        data = bytes(outcome)

        def complete(conn: sqlite3.Connection) -> IdempotencyRecord:
            now = sqlite_now(conn)
            record, changed = after_complete(
                _live_record(conn, tenant, key, now),
                key=key,
                outcome=data,
                holder=holder,
                now=now,
            )
            if changed:
                _save_record(conn, record)
            return record

        return await self.database.write(complete, weight=len(data))

    async def release(
        self, key: str, *, tenant: str, holder: str, undispatched: bool = False
    ) -> None:
        """Drop a ttl claim held by ``holder``, or any claim it held and did not act on
        (``undispatched``); anything else is left alone."""

        def release(conn: sqlite3.Connection) -> None:
            conn.execute(
                "DELETE FROM adk_idempotency WHERE tenant = ? AND key = ? "
                "AND status = 'in_flight' AND holder = ? "
                "AND (expires_at IS NOT NULL OR ?)",
                (tenant, key, holder, int(undispatched)),
            )

        await self.database.write(release, weight=0)

    async def lookup(self, keys: Sequence[str], *, tenant: str) -> dict[str, IdempotencyRecord]:
        """The tenant's live records of ``keys`` in one round trip; absent keys are left
        out."""
        wanted = list(dict.fromkeys(keys))
        if not wanted:
            return {}

        def lookup(conn: sqlite3.Connection) -> dict[str, IdempotencyRecord]:
            found: dict[str, IdempotencyRecord] = {}
            for chunk, marks in _in_chunks(wanted):
                for row in conn.execute(
                    f"SELECT {_RECORD_COLUMNS} FROM adk_idempotency "
                    f"WHERE tenant = ? AND key IN ({marks}) AND {_LIVE_SQL}",
                    [tenant, *chunk],
                ):
                    record = _record_from_row(row)
                    found[record.key] = record
            return {key: found[key] for key in wanted if key in found}

        return await self.database.read(lookup, weight=_outcome_bytes(tenant, wanted))

    async def records(self, tenant: str, run_id: str) -> list[IdempotencyRecord]:
        """Every live record of the run, by (iteration, since, key); the run claim first."""

        def records(conn: sqlite3.Connection) -> list[IdempotencyRecord]:
            # Its own calls, then those it took over from another run (by their index each).
            rows = conn.execute(
                f"SELECT {_RECORD_COLUMNS} FROM adk_idempotency "
                f"WHERE tenant = ? AND run_id = ? AND {_LIVE_SQL} "
                f"UNION ALL SELECT {_RECORD_COLUMNS} FROM adk_idempotency "
                f"WHERE tenant = ? AND holder_run = ? AND run_id <> ? AND {_LIVE_SQL}",
                (tenant, run_id, tenant, run_id, run_id),
            ).fetchall()
            return [listed_by(_record_from_row(row), run_id) for row in rows]

        mine = await self.database.read(records)
        return sorted(mine, key=run_order)

    async def records_from(
        self, tenant: str, run_id: str, iteration: int
    ) -> list[IdempotencyRecord]:
        """The run's live tool-call records from ``iteration`` on, outcomes left out: the
        run's index by iteration reads those rows alone, however long the run is."""
        columns = _RECORD_COLUMNS.replace("outcome", "NULL")

        def records_from(conn: sqlite3.Connection) -> list[IdempotencyRecord]:
            rows = conn.execute(
                f"SELECT {columns} FROM adk_idempotency "
                f"WHERE tenant = ? AND run_id = ? AND iteration >= ? AND tool IS NOT NULL "
                f"AND {_LIVE_SQL} "
                f"UNION ALL SELECT {columns} FROM adk_idempotency "
                f"WHERE tenant = ? AND holder_run = ? AND holder_iteration >= ? "
                f"AND run_id <> ? AND tool IS NOT NULL AND {_LIVE_SQL}",
                (tenant, run_id, iteration, tenant, run_id, iteration, run_id),
            ).fetchall()
            return [listed_by(_record_from_row(row), run_id) for row in rows]

        mine = await self.database.read(records_from)
        return sorted(mine, key=lambda r: (r.iteration or 0, r.since, r.key))

    async def resolve(
        self,
        key: str,
        outcome: bytes | None = None,
        *,
        tenant: str,
        never_ran: bool = False,
        by: str,
        holder: str | None = None,
    ) -> IdempotencyRecord:
        """An operator settles the tenant's in-flight call: its outcome, or that it never
        ran."""
        checked_resolution(outcome, never_ran)
        data = None if outcome is None else bytes(outcome)

        def resolve(conn: sqlite3.Connection) -> IdempotencyRecord:
            now = sqlite_now(conn)
            record = after_resolve(
                _live_record(conn, tenant, key, now),
                key=key,
                outcome=data,
                never_ran=never_ran,
                by=by,
                now=now,
                holder=holder,
            )
            _save_record(conn, record)
            return record

        return await self.database.write(resolve)
