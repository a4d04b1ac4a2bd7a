"""Idempotency records in PostgreSQL: ``adk_idempotency``, keyed by (tenant, key).

Each claim, completion and resolution is one statement (``sql/idempotency/``) that decides
as ``stores/records.py`` does in Python and returns the record as it stands afterwards. In-flight
tool-call claims have no ``expires_at``: they never lapse; ttl claims lapse by
``clock_timestamp()``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tesserix_adk.adapters.postgres.connection import PostgresDatabase, Row
from tesserix_adk.adapters.postgres.fenced import ATTEMPTS, FencedStore, run_params, stale
from tesserix_adk.adapters.postgres.statements import Statements, words
from tesserix_adk.errors import StaleFenceError, StoreUnavailableError
from tesserix_adk.stores._common import no_claim, positive_ttl
from tesserix_adk.stores.protocols import IdempotencyRecord, RecordStatus, ToolFlags
from tesserix_adk.stores.records import checked_resolution, listed_by, run_order
from tesserix_adk.stores.rows import decoded

__all__ = ["PostgresIdempotencyStore"]


@dataclass(frozen=True, slots=True, kw_only=True)
class _SQL(Statements):
    seal: str
    claim_fenced: str
    claim_unfenced: str
    complete: str
    release: str
    lookup: str
    records: str
    records_from: str
    resolve: str


@decoded("idempotency record")
def _record(row: Row) -> IdempotencyRecord:
    flags = None
    if row["side_effects"] is not None:
        flags = ToolFlags(side_effects=row["side_effects"], idempotent=bool(row["idempotent"]))
    outcome = row["outcome"]
    return IdempotencyRecord(
        key=row["key"],
        status=RecordStatus(row["status"]),
        holder=row["holder"],
        tenant=row["tenant"],
        run_id=row["run_id"],
        iteration=row["iteration"],
        tool=row["tool"],
        call_id=row["call_id"],
        flags=flags,
        fence=row["fence"],
        outcome=None if outcome is None else bytes(outcome),
        since=row["since"],
        completed_at=row["completed_at"],
        expires_at=row["expires_at"],
        by=row["resolved_by"],
        never_ran_by=row["never_ran_by"],
        holder_run=row["holder_run"],
        holder_iteration=row["holder_iteration"],
        holder_call_id=row["holder_call_id"],
    )


class PostgresIdempotencyStore(FencedStore):
    """An ``IdempotencyStore`` in ``adk_idempotency``, keyed by (tenant, key); ttl claims
    lapse by ``clock_timestamp()``. Each claim, completion and resolution is one
    statement."""

    def __init__(self, database: PostgresDatabase) -> None:
        self._sql = _SQL.load("idempotency", database.schema.schema)
        super().__init__(database, seal=self._sql.seal)

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
        """Claim ``key`` and return the record as it stands after the call."""
        fenced = tool is not None
        params = run_params(
            tenant,
            run_id,
            fence,
            key=key,
            holder=holder,
            iteration=iteration,
            tool=tool,
            call_id=call_id,
            side_effects=None if flags is None else flags.side_effects,
            idempotent=None if flags is None else flags.idempotent,
            # A resume claim is taken before any lease exists: never fenced.
            claim_fence=fence if fenced else None,
            ttl=None if ttl is None else positive_ttl(ttl),
            takeover=takeover,
        )
        sql = self._sql.claim_fenced if fenced else self._sql.claim_unfenced
        row = await self.database.row(f"claiming {key!r}", sql, params)
        if row is None:
            raise stale("claim", run_id, fence, -1)
        return _record(row)

    async def complete(
        self, key: str, outcome: bytes, *, tenant: str, holder: str
    ) -> IdempotencyRecord:
        """Record the outcome of a claim held by ``holder`` (not fenced)."""
        params = {"tenant": tenant, "key": key, "holder": holder, "outcome": bytes(outcome)}
        for _ in range(ATTEMPTS):
            row = await self.database.row(f"completing {key!r}", self._sql.complete, params)
            if row is None or row["lapsed"]:
                raise no_claim(holder, key)
            record = _record(row)
            if row["changed"]:
                return record
            if record.status is RecordStatus.completed and record.holder == holder:
                if record.by is None:
                    return record
            elif record.status is RecordStatus.in_flight and record.holder == holder:
                continue  # it changed after this statement's snapshot; look again
            raise StaleFenceError(
                f"{holder!r} does not hold {key!r} in flight "
                f"({record.status} under {record.holder!r})"
            )
        raise StoreUnavailableError(f"{key!r} kept changing while {holder!r} completed it")

    async def release(
        self, key: str, *, tenant: str, holder: str, undispatched: bool = False
    ) -> None:
        """Drop a ttl claim held by ``holder``; anything else is left alone."""
        await self.database.rows(
            f"releasing {key!r}",
            self._sql.release,
            {"tenant": tenant, "key": key, "holder": holder, "undispatched": undispatched},
        )

    async def lookup(self, keys: Sequence[str], *, tenant: str) -> dict[str, IdempotencyRecord]:
        """The tenant's live records of ``keys`` in one statement; absent keys are left
        out."""
        wanted = list(dict.fromkeys(keys))
        if not wanted:
            return {}
        rows = await self.database.rows(
            f"looking up {len(wanted)} idempotency key(s)",
            self._sql.lookup,
            {"tenant": tenant, "keys": wanted},
        )
        return {row["key"]: _record(row) for row in rows}

    async def records(self, tenant: str, run_id: str) -> list[IdempotencyRecord]:
        """Every live record of the run, by (iteration, since, key); the run claim first."""
        rows = await self.database.rows(
            f"listing the records of run {run_id!r}", self._sql.records, run_params(tenant, run_id)
        )
        return sorted((listed_by(_record(row), run_id) for row in rows), key=run_order)

    async def records_from(
        self, tenant: str, run_id: str, iteration: int
    ) -> list[IdempotencyRecord]:
        """The run's live tool-call records from ``iteration`` on, outcomes left out
        (``RecordsFrom``): what planning a resume reads, however long the run is."""
        rows = await self.database.rows(
            f"listing the records of run {run_id!r} from iteration {iteration}",
            self._sql.records_from,
            run_params(tenant, run_id, iteration=iteration),
        )
        return sorted((listed_by(_record(row), run_id) for row in rows), key=run_order)

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
        """An operator settles an in-flight call: its outcome, or that it never ran."""
        checked_resolution(outcome, never_ran)
        params = {
            "tenant": tenant,
            "key": key,
            "never_ran": never_ran,
            "outcome": None if outcome is None else bytes(outcome),
            "by": words(by),
            "holder": holder,
        }
        for _ in range(ATTEMPTS):
            row = await self.database.row(f"resolving {key!r}", self._sql.resolve, params)
            if row is None or row["lapsed"]:
                raise KeyError(key)
            record = _record(row)
            if row["changed"]:
                return record
            if record.status is not RecordStatus.in_flight:
                raise ValueError(f"{key!r} is {record.status}, not in flight")
            if holder is not None and record.holder != holder:
                raise ValueError(f"{key!r} is in flight under {record.holder!r}, not {holder!r}")
        raise StoreUnavailableError(f"{key!r} kept changing while it was resolved")
