"""``RedisIdempotencyStore``: idempotency records, each with the run that first claimed it."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import unquote

from tesserix_adk.adapters.redis.base import (
    _fence_arg,
    _FencedRedisStore,
    _pairs,
    _seconds,
    _stale,
    _text,
    _ttl_micros,
)
from tesserix_adk.adapters.redis.connection import (
    Client,
    _driver_errors,
    read_hashes_with_clocks,
)
from tesserix_adk.adapters.redis.durability import _Durability
from tesserix_adk.adapters.redis.keys import DEFAULT_PREFIX, _enc, _Keys
from tesserix_adk.adapters.redis.lua import register
from tesserix_adk.errors import CheckpointCorruptError, StaleFenceError
from tesserix_adk.stores._common import no_claim
from tesserix_adk.stores.protocols import IdempotencyRecord, RecordStatus, ToolFlags
from tesserix_adk.stores.records import checked_resolution, listed_for, run_order
from tesserix_adk.stores.rows import decoded

__all__ = ["RedisIdempotencyStore"]


@decoded("idempotency record")
def _record(fields: Mapping[bytes, bytes]) -> IdempotencyRecord:
    def text(name: bytes) -> str | None:
        value = fields.get(name)
        return None if value is None else value.decode()

    def number(name: bytes) -> int | None:
        value = fields.get(name)
        return None if value is None else int(value)

    def when(name: bytes) -> float | None:
        value = fields.get(name)
        return None if value is None else _seconds(value)

    flags = None
    if b"side_effects" in fields:
        flags = ToolFlags(
            side_effects=fields[b"side_effects"] == b"1",
            idempotent=fields.get(b"idempotent") == b"1",
        )
    return IdempotencyRecord(
        key=fields[b"key"].decode(),
        status=RecordStatus(fields[b"status"].decode()),
        holder=fields[b"holder"].decode(),
        tenant=fields[b"tenant"].decode(),
        run_id=fields[b"run_id"].decode(),
        iteration=number(b"iteration"),
        tool=text(b"tool"),
        call_id=text(b"call_id"),
        flags=flags,
        fence=number(b"fence"),
        outcome=fields.get(b"outcome"),
        since=_seconds(fields[b"since"]),
        completed_at=when(b"completed_at"),
        expires_at=when(b"expires_at"),
        by=text(b"by"),
        never_ran_by=text(b"never_ran_by"),
        holder_run=text(b"holder_run"),
        holder_iteration=number(b"holder_iteration"),
        holder_call_id=text(b"holder_call_id"),
    )


# Every field of a record but its outcome: what planning reads.
_PLANNED_FIELDS = (
    "key",
    "status",
    "holder",
    "tenant",
    "run_id",
    "iteration",
    "tool",
    "call_id",
    "side_effects",
    "idempotent",
    "fence",
    "since",
    "completed_at",
    "expires_at",
    "by",
    "never_ran_by",
    "holder_run",
    "holder_iteration",
    "holder_call_id",
)


@decoded("idempotency record")
def _lapsed(fields: Mapping[bytes, bytes], now_micros: int) -> bool:
    expires = fields.get(b"expires_at")
    return (
        fields.get(b"status") == b"in_flight" and expires is not None and now_micros >= int(expires)
    )


class RedisIdempotencyStore(_FencedRedisStore):
    """An ``IdempotencyStore`` on Redis; ttl claims lapse by the server's ``TIME``.

    Records are keyed by (tenant, key). A record lives with the run of its tenant that
    first claimed its key (so one script sees the record, the run's fences and its lease
    together); ``adk:idem-key:{<tenant>:<key>}`` says which run that is, and is written
    *before* the record so that no record is ever unreachable by key. (A key that two runs
    claim — a custom key reused across runs — brings both runs' keys into one script, which
    a Redis Cluster would refuse; the kit's own keys are per run.)

    Kits before tenant-scoped records indexed by key alone (``adk:idem-key:{<key>}``). That
    index is still read, and wins when it names a run of the same tenant: it is never
    written again, so every caller settles on the same run, and a record written before an
    upgrade is neither lost nor claimed a second time. One naming another tenant's run is
    ignored.
    """

    _store = "idem"

    def __init__(
        self, client: Client, *, prefix: str = DEFAULT_PREFIX, allow_volatile: bool = False
    ) -> None:
        super().__init__(client, prefix=prefix)
        self._durability = _Durability(client, allow_volatile=allow_volatile)
        self._claim, self._complete, self._release, self._resolve = register(
            client, "claim", "complete", "release_claim", "resolve"
        )

    async def check_persistence(self) -> None:
        """Refuse a volatile server now (``ConfigurationError``) unless it was allowed."""
        await self._durability.check()

    async def _ready(self) -> None:
        await self._durability.ensure()

    def _record_key(self, tag: str, key: str) -> str:
        return self._keys.tagged(tag, f"idem:rec:{_enc(key)}")

    @staticmethod
    def _settle(tenant: str, indexed: Any, legacy: Any) -> str | None:
        """The tag of the run holding a record, from its index and its legacy index."""
        if legacy is not None:
            tag = _text(legacy)
            if tag.partition(":")[0] == _enc(tenant):
                return tag
        return None if indexed is None else _text(indexed)

    async def _owners(self, tenant: str, keys: Sequence[str]) -> list[str | None]:
        """The tag of the run whose keys hold each key's record, if it was ever claimed."""
        async with self._client.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.get(self._keys.key_index(tenant, key))
                pipe.get(self._keys.legacy_key_index(key))
            replies = await pipe.execute()
        return [self._settle(tenant, replies[i], replies[i + 1]) for i in range(0, len(replies), 2)]

    async def _owner(self, tenant: str, key: str) -> str | None:
        [tag] = await self._owners(tenant, [key])
        return tag

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
        ttl_micros = None if ttl is None else _ttl_micros(ttl)
        fenced = tool is not None
        fresh: list[str | bytes] = ["key", key, "tenant", tenant, "run_id", run_id]
        if iteration is not None:
            fresh += ["iteration", str(int(iteration))]
        if tool is not None:
            fresh += ["tool", tool]
        if call_id is not None:
            fresh += ["call_id", call_id]
        if flags is not None:
            fresh += [
                "side_effects",
                "1" if flags.side_effects else "0",
                "idempotent",
                "1" if flags.idempotent else "0",
            ]
        # Where the run's iteration index files the record; -inf (a run claim) sorts before
        # every turn.
        score = "-inf" if iteration is None else str(int(iteration))
        await self._ready()
        mine = _Keys.tag(tenant, run_id)
        with _driver_errors(f"claiming {key!r}"):
            # The index goes first: a record the index does not name could not be found
            # by key, and its call would look as if it never ran.
            index = self._keys.key_index(tenant, key)
            async with self._client.pipeline(transaction=False) as pipe:
                pipe.set(index, mine, nx=True)
                pipe.get(index)
                pipe.get(self._keys.legacy_key_index(key))
                _, owner, legacy = await pipe.execute()
            tag = self._settle(tenant, owner, legacy)
            assert tag is not None  # the index was just set if it was not there
            if tag != mine:
                # A key another run named first (a custom key reused across runs): the
                # record lives under that run's tag, so this run's own list names it too,
                # before the claim, or records() of this run could never find it. Its
                # iteration index only ever rises (GT), and before the claim: whatever the
                # claim decides, the score is never below the record's own turn, so
                # records_from reads it (a higher one costs a read the filter drops).
                async with self._client.pipeline(transaction=False) as pipe:
                    pipe.sadd(self._keys.tagged(mine, "idem:keys"), _enc(key))
                    pipe.zadd(self._keys.tagged(mine, "idem:iter"), {_enc(key): score}, gt=True)
                    await pipe.execute()
            result = await self._claim(
                keys=[
                    self._record_key(tag, key),
                    self._keys.tagged(tag, "idem:keys"),
                    self._seen(tenant, run_id),
                    self._lease_fence(tenant, run_id),
                    self._keys.tagged(tag, "idem:iter"),
                ],
                args=[
                    holder,
                    _fence_arg(fence),
                    "" if ttl_micros is None else str(ttl_micros),
                    "1" if takeover else "0",
                    "1" if fenced else "0",
                    _enc(key),
                    score,
                    *fresh,
                ],
            )
        if result[0] == b"stale":
            raise _stale("claim", run_id, fence, result[1])
        _refuse_damaged(result, key)
        return _record(_pairs(result[1]))

    async def complete(
        self, key: str, outcome: bytes, *, tenant: str, holder: str
    ) -> IdempotencyRecord:
        """Record the outcome of a claim held by ``holder`` (not fenced)."""
        await self._ready()
        with _driver_errors(f"completing {key!r}"):
            tag = await self._owner(tenant, key)
            if tag is None:
                raise no_claim(holder, key)
            result = await self._complete(
                keys=[self._record_key(tag, key)], args=[bytes(outcome), holder]
            )
        _refuse_damaged(result, key)
        if result[0] == b"absent":
            raise no_claim(holder, key)
        if result[0] == b"refused":
            raise StaleFenceError(
                f"{holder!r} does not hold {key!r} in flight "
                f"({_text(result[1])} under {_text(result[2])!r})"
            )
        return _record(_pairs(result[1]))

    async def release(
        self, key: str, *, tenant: str, holder: str, undispatched: bool = False
    ) -> None:
        """Drop a ttl claim held by ``holder``, or any claim it held and did not act on
        (``undispatched``); anything else is left alone."""
        await self._ready()
        with _driver_errors(f"releasing {key!r}"):
            tag = await self._owner(tenant, key)
            if tag is None:
                return
            await self._release(
                keys=[
                    self._record_key(tag, key),
                    self._keys.tagged(tag, "idem:keys"),
                    self._keys.tagged(tag, "idem:iter"),
                ],
                args=[holder, _enc(key), "1" if undispatched else "0"],
            )

    async def _fetch(self, located: Sequence[tuple[str, str]]) -> list[IdempotencyRecord]:
        """The live records at (tag, key) in one round trip, in the order given."""
        if not located:
            return []
        keys = [self._record_key(tag, key) for tag, key in located]
        read = await read_hashes_with_clocks(self._client, keys)
        return [_record(fields) for fields, now in read if fields and not _lapsed(fields, now)]

    async def lookup(self, keys: Sequence[str], *, tenant: str) -> dict[str, IdempotencyRecord]:
        """The tenant's live records of ``keys`` in two round trips whatever their number."""
        wanted = list(dict.fromkeys(keys))
        if not wanted:
            return {}
        await self._ready()
        with _driver_errors(f"looking up {len(wanted)} idempotency key(s)"):
            owners = await self._owners(tenant, wanted)
            located = [(owner, key) for key, owner in zip(wanted, owners, strict=True) if owner]
            read = (
                await read_hashes_with_clocks(
                    self._client, [self._record_key(tag, key) for tag, key in located]
                )
                if located
                else []
            )
            gone = [loc for loc, (fields, _) in zip(located, read, strict=True) if not fields]
            await self._refuse_lost(gone)
        records = [_record(fields) for fields, now in read if fields and not _lapsed(fields, now)]
        return {record.key: record for record in records if record.tenant == tenant}

    async def _refuse_lost(self, gone: Sequence[tuple[str, str]]) -> None:
        """``CheckpointCorruptError`` for a record its run's record set or iteration index
        still names: the kit drops the three together (a released claim), so the store lost
        it (an eviction, a key deleted, a server restored from an older copy). Read as no
        record, its call would be sent again though it may have run."""
        if not gone:
            return
        async with self._client.pipeline(transaction=False) as pipe:
            for tag, key in gone:
                pipe.sismember(self._keys.tagged(tag, "idem:keys"), _enc(key))
                pipe.zscore(self._keys.tagged(tag, "idem:iter"), _enc(key))
            named = await pipe.execute()
        # Either of the run's two indexes naming it will do: the claim wrote both.
        lost = [
            key for i, (_, key) in enumerate(gone) if named[2 * i] or named[2 * i + 1] is not None
        ]
        if lost:
            raise CheckpointCorruptError(
                f"the idempotency record of {lost[0]!r} is gone though its run still lists "
                "it: the store lost it (evicted, deleted, or restored from an older copy), "
                "so nobody can say whether that call ran; nothing is sent"
            )

    async def records(self, tenant: str, run_id: str) -> list[IdempotencyRecord]:
        """Every live record of the run, by (iteration, since, key); the run claim first."""
        await self._ready()
        tag = _Keys.tag(tenant, run_id)
        with _driver_errors(f"listing the records of run {run_id!r}"):
            members = [
                unquote(_text(m))
                for m in await self._client.smembers(self._keys.tagged(tag, "idem:keys"))
            ]
            # Almost every record lives under its own run's tag; the index says where one
            # claimed under another run's key lives.
            owners = await self._owners(tenant, members)
            located = [(owner or tag, key) for key, owner in zip(members, owners, strict=True)]
            found = await self._fetch(located)
        return listed_for(found, tenant, run_id)

    async def records_from(
        self, tenant: str, run_id: str, iteration: int
    ) -> list[IdempotencyRecord]:
        """The run's live tool-call records of ``iteration`` or later, outcomes left out,
        found through the run's iteration index in three round trips however long the run.

        A run that a kit before the index wrote (its record set and its index disagree, or
        the index names a record that is gone) is read whole instead, as ``records`` reads.
        """
        await self._ready()
        tag = _Keys.tag(tenant, run_id)
        with _driver_errors(f"listing the records of run {run_id!r} from turn {iteration}"):
            async with self._client.pipeline(transaction=False) as pipe:
                pipe.scard(self._keys.tagged(tag, "idem:keys"))
                pipe.zcard(self._keys.tagged(tag, "idem:iter"))
                pipe.zrangebyscore(self._keys.tagged(tag, "idem:iter"), int(iteration), "+inf")
                listed, indexed, members = await pipe.execute()
            found: list[IdempotencyRecord] | None = None
            if listed == indexed:
                found = await self._indexed(tenant, tag, [unquote(_text(m)) for m in members])
        if found is None:
            found = await self.records(tenant, run_id)
        return [
            dataclasses.replace(r, outcome=None)
            for r in listed_for(found, tenant, run_id)
            if r.tool is not None and r.iteration is not None and r.iteration >= iteration
        ]

    async def _indexed(
        self, tenant: str, tag: str, members: Sequence[str]
    ) -> list[IdempotencyRecord] | None:
        """The records the iteration index names, in order; ``None`` if it names one that
        is not there (an older kit released it and left the index behind)."""
        if not members:
            return []
        owners = await self._owners(tenant, members)
        keys = [
            self._record_key(owner or tag, key) for key, owner in zip(members, owners, strict=True)
        ]
        read = await read_hashes_with_clocks(self._client, keys, _PLANNED_FIELDS)
        if not all(fields for fields, _ in read):
            return None
        live = [_record(fields) for fields, now in read if not _lapsed(fields, now)]
        return sorted(live, key=run_order)

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
        await self._ready()
        with _driver_errors(f"resolving {key!r}"):
            tag = await self._owner(tenant, key)
            if tag is None:
                raise KeyError(key)
            result = await self._resolve(
                keys=[self._record_key(tag, key)],
                args=[
                    "1" if never_ran else "0",
                    b"" if outcome is None else bytes(outcome),
                    by,
                    "" if holder is None else holder,
                    "0" if holder is None else "1",
                ],
            )
        _refuse_damaged(result, key)
        if result[0] == b"absent":
            raise KeyError(key)
        if result[0] == b"settled":
            raise ValueError(f"{key!r} is {_text(result[1])}, not in flight")
        if result[0] == b"held":
            raise ValueError(f"{key!r} is in flight under {_text(result[1])!r}, not {holder!r}")
        return _record(_pairs(result[1]))


def _refuse_damaged(result: Sequence[Any], key: str) -> None:
    """A script found the record there but not as a kit writes it: it wrote nothing."""
    if result and result[0] == b"damaged":
        raise CheckpointCorruptError(
            f"a stored idempotency record cannot be read ({key!r} is damaged); the store "
            "holds a damaged row and nothing was written over it"
        )
