"""The kit's statements prepared on the server, once per connection.

Every call goes as one simple query (``driver.batched``: one round trip, and a write
group's idle timer stays armed), so PostgreSQL would parse and plan each statement again on
every call: a fifth of a millisecond of the server's time for each of the kit's CTEs, a
dozen a turn. Instead, once a statement has run ``prepare_threshold`` times as text on a
connection, it is prepared there (``PREPARE``, in the message that next runs it) and sent
as ``EXECUTE name(values)`` from then on: the server keeps its plan, and the wire carries
the values, not the statement.

What a connection has prepared is known exactly, never assumed:

- a name is recorded once the message that prepared it has succeeded;
- a message that failed or was abandoned leaves its names *in doubt* (``PREPARE`` is not
  undone with a transaction, so it may or may not have run); before the connection's next
  statement one query asks the server which of them exist, and the rest are forgotten;
- every ``PREPARE`` uses a fresh name, so none can collide with one in doubt (or with
  another database object's over the same pool);
- while names are in doubt and the server cannot be asked (a failed transaction), the
  statements go as text, preparing nothing;
- a statement the server no longer has (``DEALLOCATE`` or ``DISCARD`` run by someone else)
  or can no longer run as prepared (a table changed under it) fails that write once, and
  the connection's statements are prepared again from then on.

This holds for every statement the kit runs, in a group or alone (``driver.alone``), and
psycopg's own preparing is off on the kit's connections. It must be: psycopg answers every
ROLLBACK on a connection where it has prepared anything with ``DEALLOCATE ALL``, which would
take the kit's statements with it after any failed write.

A prepared statement lives in one server session, so nothing is prepared unless the
connection is that session's own: the first message on each connection also asks the
server its backend's pid, and statements are prepared from then on only if it is the pid
the connection was given at start-up. A pooler (PgBouncer, in any mode, or a managed one)
hands out a pid of its own, so behind one nothing is prepared, whatever
``prepare_threshold`` says; with ``prepare_threshold=None`` nothing is prepared anywhere.
"""

from __future__ import annotations

import itertools
import re
import secrets
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import psycopg
from psycopg import errors as pg_errors
from psycopg.pq import TransactionStatus

__all__ = [
    "BACKEND_PID",
    "Outgoing",
    "Prepared",
    "PreparedStatements",
    "as_text",
    "lost_statement",
]

# Asked in the first message on a connection, beside its statements (no round trip more).
BACKEND_PID = "SELECT pg_backend_pid() AS adk_backend_pid"

# A psycopg named placeholder, or an escaped percent sign ("%%"), read left to right: in
# "7 %%%(n)s" the "%%" is a literal and "%(n)s" the placeholder.
_TOKEN = re.compile(r"%%|%\((\w+)\)s")


@dataclass(frozen=True, slots=True)
class _Form:
    """A statement as ``PREPARE`` takes it: placeholders numbered in order of first use."""

    text: str
    names: tuple[str, ...]


@lru_cache(maxsize=256)
def _form(sql: str) -> _Form:
    # The kit's statements are a few dozen fixed texts: each is rewritten once.
    names: list[str] = []

    def numbered(found: re.Match[str]) -> str:
        name = found.group(1)
        if name is None:
            return "%"  # PREPARE takes the statement as it is: no escapes
        if name not in names:
            names.append(name)
        return f"(${names.index(name) + 1})"

    return _Form(_TOKEN.sub(numbered, sql), tuple(names))


@lru_cache(maxsize=256)
def _parenthesised(sql: str) -> str:
    # Each bound value in parentheses: psycopg writes -2**63 as " -9223372036854775808",
    # and in "%(step)s::bigint" the cast binds tighter than the minus, which would
    # overflow. Rewritten once per statement, not on every call (tens of microseconds).
    return _TOKEN.sub(lambda found: found[0] if found[1] is None else f"({found[0]})", sql)


def as_text(cur: psycopg.AsyncClientCursor[Any], sql: str, params: Mapping[str, Any]) -> str:
    """``sql`` with its values bound by psycopg, to send as text."""
    return cur.mogrify(_parenthesised(sql), params).rstrip().rstrip(";")


@dataclass(slots=True, eq=False)
class Prepared:
    """What one connection has prepared: statement text to name, and names in doubt; and
    whether it is its server session's own (``None`` until the server has said)."""

    names: dict[str, str] = field(default_factory=dict)
    doubt: dict[str, str] = field(default_factory=dict)
    direct: bool | None = None
    # Times each statement went as text, towards ``prepare_threshold``.
    runs: dict[str, int] = field(default_factory=dict)


class PreparedStatements:
    """The kit's statements prepared on each connection of one database's pool."""

    def __init__(self, threshold: int = 0) -> None:
        self.threshold = threshold
        self._on: weakref.WeakKeyDictionary[psycopg.AsyncConnection[Any], Prepared] = (
            weakref.WeakKeyDictionary()
        )
        self._serial = itertools.count(1)
        # Two databases over one pool each keep a record: their names never meet.
        self._prefix = f"adk_{secrets.token_hex(4)}_"

    def on(self, conn: psycopg.AsyncConnection[Any]) -> Prepared:
        """The record of ``conn`` (empty for a connection not seen before)."""
        known = self._on.get(conn)
        if known is None:
            known = self._on[conn] = Prepared()
            # Built by hand, a pool's connections may prepare by psycopg's count too.
            conn.prepare_threshold = None
        return known

    @staticmethod
    async def _settle(conn: psycopg.AsyncConnection[Any], known: Prepared) -> None:
        """Ask the server which names in doubt exist on ``conn``: those are prepared, the
        rest forgotten. A no-op with none in doubt, or while the transaction has failed
        (the next statement fails anyway, and they stay in doubt)."""
        if not known.doubt or conn.info.transaction_status not in (
            TransactionStatus.IDLE,
            TransactionStatus.INTRANS,
        ):
            return
        cur = await conn.execute(
            "SELECT name FROM pg_prepared_statements WHERE name = ANY(%s)",
            (list(known.doubt.values()),),
            prepare=False,
        )
        there = {row[0] for row in await cur.fetchall()}
        for sql, name in known.doubt.items():
            if name in there:
                known.names[sql] = name
        known.doubt.clear()

    async def compose(
        self,
        conn: psycopg.AsyncConnection[Any],
        binder: psycopg.AsyncClientCursor[Any],
        statements: Sequence[tuple[str, Mapping[str, Any]]],
    ) -> Outgoing:
        """The statements as ``conn``'s next message sends them: prepared and executed by
        name where the connection may (direct, nothing in doubt), else as text, with the
        pid question on a connection not yet asked."""
        known = self.on(conn)
        if known.direct:
            await self._settle(conn, known)
        if not known.direct or known.doubt:
            bound = [as_text(binder, sql, params) for sql, params in statements]
            return Outgoing(bound, [BACKEND_PID] if known.direct is None else [], known)
        preparing: dict[str, str] = {}
        prepares: list[str] = []
        executes: list[str] = []
        for sql, params in statements:
            name = known.names.get(sql) or preparing.get(sql)
            if name is None and known.runs.get(sql, 0) < self.threshold:
                known.runs[sql] = known.runs.get(sql, 0) + 1
                executes.append(as_text(binder, sql, params))
                continue
            form = _form(sql)
            if name is None:
                name = preparing[sql] = f"{self._prefix}{next(self._serial)}"
                prepares.append(f"PREPARE {name} AS {form.text.rstrip().rstrip(';')}\n")
            values = ", ".join(f"%({n})s" for n in form.names)
            executes.append(
                binder.mogrify(f"EXECUTE {name}({values})" if values else f"EXECUTE {name}", params)
            )
        return Outgoing(executes, prepares, known, preparing)


@dataclass(slots=True, eq=False)
class Outgoing:
    """One message's statements as they go (``bound``), what goes before them (``head``:
    the pid question, or the ``PREPARE``s), and what the connection's record learns once
    the message has been answered."""

    bound: list[str]
    head: list[str] = field(default_factory=list)
    known: Prepared | None = None
    preparing: dict[str, str] = field(default_factory=dict)

    @property
    def asks(self) -> bool:
        """Whether ``head`` is the pid question (its answer is read by ``answered``)."""
        return self.head == [BACKEND_PID]

    def answered(self, conn: psycopg.AsyncConnection[Any], rows: list[Any]) -> None:
        """The server's answer to ``BACKEND_PID``: the connection is its session's own if
        it names the backend the connection was given at start-up."""
        if self.known is not None:
            pid = rows[0]["adk_backend_pid"] if rows else None
            self.known.direct = pid is not None and pid == conn.info.backend_pid

    def done(self, error: BaseException | None) -> None:
        """After the message: what it prepared is recorded, or in doubt if it failed; a
        statement the server lost takes the connection's whole record with it."""
        known = self.known
        if known is None or not known.direct:
            return
        if error is None:
            known.names.update(self.preparing)
            return
        known.doubt.update(self.preparing)
        if isinstance(error, pg_errors.InvalidSqlStatementName):
            # Some recorded name is gone (DEALLOCATE ALL, DISCARD ALL): each is asked about
            # again before the next statement.
            known.doubt.update(known.names)
            known.names.clear()
        elif lost_statement(error):
            # A table changed under them ("cached plan must not change result type"): they
            # still exist and would fail again, so the connection prepares afresh.
            known.names.clear()


def lost_statement(error: BaseException) -> bool:
    """Whether ``error`` says a prepared statement is gone or can no longer run."""
    if isinstance(error, pg_errors.InvalidSqlStatementName):
        return True
    return isinstance(error, pg_errors.FeatureNotSupported) and "cached plan" in str(error)
