"""``RedisWorkIndex``: the runs that want a worker, as sorted sets read from their heads.

A run's entry is a hash beside its other keys (``adk:{<tenant>:<run>}:work``); the due
index is one sorted set per take order (decided, wanted, submitted), each by ``since``, so
``due`` reads only their heads; parked and done runs are in none of them, and runs backing
off wait in a sorted set of their own by ``not_before``. Every call is one script that
reads the server's ``TIME``, and ``due`` looks at each candidate's lease hash in that same
script, so a lease is live by exactly the clock the lease store uses.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from typing import Any
from urllib.parse import unquote

from tesserix_adk.adapters.redis.base import _bytes, _seconds
from tesserix_adk.adapters.redis.connection import Client, _driver_errors, _require_bytes
from tesserix_adk.adapters.redis.durability import _Durability
from tesserix_adk.adapters.redis.keys import DEFAULT_PREFIX, _enc, _Keys
from tesserix_adk.adapters.redis.lua import register
from tesserix_adk.errors import CheckpointCorruptError
from tesserix_adk.stores.protocols import WorkItem, WorkListing, WorkState
from tesserix_adk.stores.rows import (
    decoded,
    due_items,
    leading,
    listed_items,
    listing_around_damage,
    with_damaged,
)

__all__ = ["DEFAULT_SCAN", "RedisWorkIndex"]

DEFAULT_SCAN = 1000
"""How many entries past ``limit`` one ``due`` call examines in each state's index at most
(runs of other agents or with a live lease are skipped); runs further back are found once
fewer runs ahead of them are being carried."""

_TAKEN = (WorkState.decided, WorkState.wanted, WorkState.submitted)


def _required(value: Any) -> str:
    # bytes(None) is a TypeError: a missing field is damage, never a None in a str field.
    return bytes(value).decode()


def _optional(value: Any) -> str | None:
    return None if value is None else bytes(value).decode()


_FIELDS = ("tenant", "run_id", "agent", "state", "since", "not_before", "attempts", "reason")


@decoded("work index entry")
def _item(row: Sequence[Any]) -> WorkItem:
    tenant, run_id, agent, state, since, not_before, attempts, reason = row
    return WorkItem(
        tenant=_required(tenant),
        run_id=_required(run_id),
        agent=_required(agent),
        state=WorkState(_required(state)),
        since=_seconds(_required(since)),
        not_before=None if not_before is None else _seconds(_required(not_before)),
        attempts=int(_required(attempts)),
        reason=_optional(reason),
    )


def _listed_item(row: Sequence[Any]) -> WorkItem:
    if len(row) == 2:  # {tag, error}: the entry's key holds another type
        raise CheckpointCorruptError(
            f"a stored work index entry cannot be read ({_optional(row[1])}); the store "
            "holds a damaged key"
        )
    return _item(row)


def _names(row: Sequence[Any]) -> tuple[str | None, str | None]:
    if len(row) == 2:
        tenant, _, run_id = bytes(row[0]).decode().partition(":")
        return unquote(tenant), unquote(run_id)
    return _optional(row[0]), _optional(row[1])


class RedisWorkIndex:
    """A ``WorkIndex`` on Redis; leases are live by the server's ``TIME``.

    ``scan`` bounds ``due``: per state it examines at most ``limit + scan`` entries from the
    head of the index and moves at most ``scan`` delayed runs whose time has come.
    """

    def __init__(
        self,
        client: Client,
        *,
        prefix: str = DEFAULT_PREFIX,
        allow_volatile: bool = False,
        scan: int = DEFAULT_SCAN,
    ) -> None:
        if scan < 1:
            raise ValueError(f"scan must be at least 1, got {scan}")
        self._damaged: set[str] = set()  # damaged entries already named in the log
        _require_bytes(client)
        self._client = client
        self._keys = _Keys(prefix)
        self._scan = scan
        # A submission is the only record of a run that never started: keep it only where
        # fences and claims are kept.
        self._durability = _Durability(client, allow_volatile=allow_volatile)
        (
            self._submit,
            self._want,
            self._wake,
            self._park,
            self._done,
            self._due,
            self._items,
        ) = register(
            client,
            "work_submit",
            "work_want",
            "work_wake",
            "work_park",
            "work_done",
            "work_due",
            "work_items",
        )

    @property
    def prefix(self) -> str:
        """The prefix of every key this index writes."""
        return self._keys.prefix

    def _entry(self, tenant: str, run_id: str) -> str:
        return self._keys.run(tenant, run_id, "work")

    def _indexes(self) -> list[str]:
        return [
            *(self._keys.work(f"due:{state.value}") for state in _TAKEN),
            self._keys.work("delayed"),
        ]

    def _all_keys(self, tenant: str, run_id: str) -> list[str]:
        return [self._entry(tenant, run_id), *self._indexes(), self._keys.work("runs")]

    async def submit(self, tenant: str, run_id: str, *, agent: str, input: bytes) -> bool:
        """Record a run as submitted; ``False`` (nothing written) when the run is known."""
        await self._durability.ensure()
        with _driver_errors(f"submitting run {run_id!r}"):
            recorded = await self._submit(
                keys=[
                    self._entry(tenant, run_id),
                    self._keys.work(f"due:{WorkState.submitted.value}"),
                    self._keys.work("runs"),
                ],
                args=[
                    _Keys.tag(tenant, run_id),
                    tenant,
                    run_id,
                    agent,
                    bytes(input),
                    secrets.token_hex(8),
                ],
            )
        return int(recorded) == 1

    async def input(self, tenant: str, run_id: str) -> bytes | None:
        """The encoded input the run was submitted with, or ``None``."""
        await self._durability.ensure()
        with _driver_errors(f"reading the submission of run {run_id!r}"):
            raw = await self._client.hget(self._entry(tenant, run_id), "input")
        return None if raw is None else _bytes(raw)

    async def entry(self, tenant: str, run_id: str) -> WorkItem | None:
        """The run's entry in any state, or ``None``: one ``HMGET`` of its hash."""
        await self._durability.ensure()
        with _driver_errors(f"reading the work index entry of run {run_id!r}"):
            row = await self._client.hmget(self._entry(tenant, run_id), _FIELDS)
        # A hash with some fields and not others is damage, which ``_item`` names.
        return None if all(f is None for f in row) else _item(row)

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
        if state not in _TAKEN:
            raise ValueError(
                f"a run that wants a worker is decided, wanted or submitted, not {state}"
            )
        delay_micros = max(0, round(delay * 1_000_000)) if delay > 0 else 0
        await self._durability.ensure()
        with _driver_errors(f"marking run {run_id!r} as wanting a worker"):
            await self._want(
                keys=self._all_keys(tenant, run_id),
                args=[
                    _Keys.tag(tenant, run_id),
                    tenant,
                    run_id,
                    agent,
                    state.value,
                    str(delay_micros),
                    "0" if reason is None else "1",
                    reason or "",
                    secrets.token_hex(8),
                    "" if count is None else str(int(count)),
                ],
            )

    async def wake(
        self, tenant: str, run_id: str, *, agent: str, attempts: int, reason: str | None
    ) -> bool:
        """Wanted now with one more attempt, if still parked as read: one script."""
        await self._durability.ensure()
        with _driver_errors(f"waking parked run {run_id!r}"):
            woken = await self._wake(
                keys=self._all_keys(tenant, run_id),
                args=[
                    _Keys.tag(tenant, run_id),
                    agent,
                    str(int(attempts)),
                    "0" if reason is None else "1",
                    reason or "",
                ],
            )
        return bool(woken)

    async def park(self, tenant: str, run_id: str, *, agent: str, reason: str) -> None:
        """The run must not be carried on until an operator acts."""
        await self._durability.ensure()
        with _driver_errors(f"parking run {run_id!r}"):
            await self._park(
                keys=self._all_keys(tenant, run_id),
                args=[_Keys.tag(tenant, run_id), tenant, run_id, agent, reason],
            )

    async def done(self, tenant: str, run_id: str) -> None:
        """The run wants no worker now; a no-op for a run the index does not hold."""
        await self._durability.ensure()
        with _driver_errors(f"marking run {run_id!r} as done"):
            await self._done(keys=self._all_keys(tenant, run_id), args=[_Keys.tag(tenant, run_id)])

    async def due(self, *, limit: int, agents: Sequence[str] | None = None) -> list[WorkItem]:
        """Up to ``limit`` runs a worker may take now, in take order; one script."""
        if limit <= 0:
            return []
        await self._durability.ensure()
        wanted = [] if agents is None else ["1", *agents]
        asked = with_damaged(limit, self._damaged)
        with _driver_errors("finding runs that want a worker"):
            rows = await self._due(
                keys=self._indexes(),
                args=[self._keys.prefix, str(asked), str(self._scan), *(wanted or ["0"])],
            )
        return due_items(rows, _item, self._damaged, leading)[:limit]

    async def items(
        self, tenant: str | None = None, *, state: WorkState | None = None
    ) -> list[WorkItem]:
        """The entries of ``tenant`` in ``state`` (any but ``done``), oldest first; reads
        every entry of the index (an operator's listing, not a worker's poll)."""
        return listed_items(await self.listing(tenant, state=state))

    async def listing(
        self, tenant: str | None = None, *, state: WorkState | None = None
    ) -> WorkListing:
        """``items``, going on past a damaged entry and naming it."""
        await self._durability.ensure()
        with _driver_errors("listing the work index"):
            rows = await self._items(
                keys=[self._keys.work("runs")],
                args=[
                    self._keys.prefix,
                    "" if tenant is None else f"{_enc(tenant)}:",
                    "" if state is None else state.value,
                ],
            )
        return listing_around_damage(rows, _listed_item, _names)
