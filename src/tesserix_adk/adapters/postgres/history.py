"""Transcripts in PostgreSQL: ``adk_history``, one row per message with its chained digest.

Row ``position`` holds message ``position`` (from 0) and the digest of the prefix that ends
with it. An append writes only the new rows and drops a dead writer's tail in the same fenced
statement (``sql/history/append.sql``), which passes the gate only if the prefix it follows
still resolves.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tesserix_adk.adapters.postgres.connection import PostgresDatabase, Row
from tesserix_adk.adapters.postgres.fenced import FencedStore, refusal, run_params, stale
from tesserix_adk.adapters.postgres.statements import Statements
from tesserix_adk.errors import HistoryUnavailableError
from tesserix_adk.stores._common import chained_digests, prefix_of
from tesserix_adk.stores.protocols import EMPTY_HISTORY_DIGEST, HistoryHandle

__all__ = ["Appending", "PostgresHistoryStore"]


@dataclass(frozen=True, slots=True, kw_only=True)
class _SQL(Statements):
    seal: str
    append: str
    fetch: str
    forget: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Appending:
    """An append not yet sent: its statement, the handle it makes, and the check of the
    row it answers (``HistoryUnavailableError`` or ``StaleFenceError`` if refused)."""

    sql: str
    params: Mapping[str, Any]
    handle: HistoryHandle
    check: Callable[[Row | None], None]


def _stale_by(row: Row, fence: int | None) -> bool:
    """Whether the fences in ``row`` alone refuse a write carrying ``fence``."""
    known = [f for f in (row["seen"], row["leased"]) if f is not None]
    return bool(known) if fence is None else any(f > fence for f in known)


class PostgresHistoryStore(FencedStore):
    """A ``HistoryStore`` in ``adk_history``: one row per message with its chained digest.

    An append writes only the new rows and drops a dead writer's tail in the same statement.
    """

    def __init__(self, database: PostgresDatabase) -> None:
        self._sql = _SQL.load("history", database.schema.schema)
        super().__init__(database, seal=self._sql.seal)

    async def append(
        self,
        tenant: str,
        run_id: str,
        encoded: Sequence[bytes],
        *,
        fence: int | None = None,
        after: HistoryHandle | None,
    ) -> HistoryHandle:
        """Append after the prefix ``after`` names (``None``: the empty prefix), dropping
        any tail beyond it; ``HistoryUnavailableError`` if that prefix does not resolve."""
        append = self.appending(tenant, run_id, encoded, fence=fence, after=after)
        row = await self.database.row(
            f"appending to the transcript of run {run_id!r}", append.sql, append.params
        )
        append.check(row)
        return append.handle

    def appending(
        self,
        tenant: str,
        run_id: str,
        encoded: Sequence[bytes],
        *,
        fence: int | None,
        after: HistoryHandle | None,
    ) -> Appending:
        """The append's statement, the handle it makes, and the check of its row (which
        raises as ``append`` does), for a caller that sends it with other statements."""
        count, digest = prefix_of(tenant, run_id, after)
        items = [bytes(item) for item in encoded]
        digests = chained_digests(digest, items)
        params = run_params(
            tenant,
            run_id,
            fence,
            count=count,
            digest=digest,
            empty=EMPTY_HISTORY_DIGEST,
            items=items,
            digests=digests,
        )

        def check(row: Row | None) -> None:
            refused_by = refusal(row, fence)
            if refused_by is None:
                return
            assert row is not None
            # A stale fence is reported first, as if checked before the prefix.
            if row["resolves"] is False and not _stale_by(row, fence):
                raise HistoryUnavailableError(
                    f"the transcript of run {run_id!r} no longer has the prefix of {count} "
                    f"messages this append follows"
                )
            raise stale("append", run_id, fence, refused_by)

        last = digests[-1] if digests else digest
        handle = HistoryHandle(tenant=tenant, run_id=run_id, count=count + len(items), digest=last)
        return Appending(sql=self._sql.append, params=params, handle=handle, check=check)

    async def fetch(self, handle: HistoryHandle) -> list[bytes]:
        """The bytes of the prefix; ``HistoryUnavailableError`` if it does not resolve."""
        rows = (
            await self.database.rows(
                f"reading the transcript of run {handle.run_id!r}",
                self._sql.fetch,
                run_params(handle.tenant, handle.run_id, count=handle.count),
            )
            if handle.count > 0
            else []
        )
        last = EMPTY_HISTORY_DIGEST if not rows else rows[-1]["digest"]
        if handle.count < 0 or len(rows) != handle.count or last != handle.digest:
            raise HistoryUnavailableError(
                f"the transcript of run {handle.run_id!r} no longer has the prefix of "
                f"{handle.count} messages the handle names"
            )
        return [bytes(row["item"]) for row in rows]

    async def forget(self, tenant: str, run_id: str) -> None:
        """Remove the run's transcript; its fence stays."""
        await self.database.rows(
            f"forgetting the transcript of run {run_id!r}",
            self._sql.forget,
            run_params(tenant, run_id),
        )
