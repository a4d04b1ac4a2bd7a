"""Redis stores: every protocol of ``stores.protocols`` on one Redis server (``redis.asyncio``).

Layout. Every key starts with the prefix (default ``adk:``); every id is percent-encoded
(everything outside ``A-Z a-z 0-9 . _ ~ -``) before it enters a key, so ids that contain
``:``, ``{`` or ``*`` can neither collide nor change a key's meaning. All keys of a run share
the hash tag ``{<tenant>:<run>}``, so one script can decide over all of them atomically::

    adk:{acme:run-1}:cp:frontier      hash   the frontier (one key per run)
    adk:{acme:run-1}:cp:steps         hash   step -> payload    (step history, with
    adk:{acme:run-1}:cp:step-fences   hash   step -> fence       retention keep_last)
    adk:{acme:run-1}:cp:step-index    zset   the steps kept, by number
    adk:{acme:run-1}:lease            hash   holder, fence, deadline (server microseconds)
    adk:{acme:run-1}:lease:fence      string the acquisition counter; never expires, never
                                             goes back, survives release and expiry
    adk:{acme:run-1}:<store>:fence    string the highest fence each store has seen
    adk:{acme:run-1}:idem:rec:<key>   hash   one idempotency record
    adk:{acme:run-1}:idem:keys        set    the records of the run
    adk:{acme:run-1}:history:items    list   the transcript (appends push only new items)
    adk:{acme:run-1}:history:digests  list   chained digest of each prefix
    adk:{acme:run-1}:ledger           hash   micros and tokens
    adk:{acme:run-1}:approval:<id>    hash   one approval request
    adk:idem-key:{<tenant>:<key>}     string which run of the tenant holds a record
    adk:approval-id:{<id>}            string which run holds a request (lookup by id)

No key that holds a fence or a record ever has a TTL. Time that decides anything is the
server's ``TIME``, read inside the script that decides: key expiry is frozen for the length
of a script, so ttl claims and leases keep their deadline as data and compare it with
``TIME``. Fenced writes are decided inside one Lua script each, which compares the write's
fence with the highest the store has seen *and* with the run's current lease fence, so a
takeover fences the old holder out at once. Scripts are registered once per store and run
with ``EVALSHA`` (reloaded on ``NOSCRIPT``).

Resends: redis-py sends a command again when its reply was lost, so every script must give
the same answer when run twice. Most do by their nature; a lease acquisition and a ledger
charge carry a random token per call, so the second run recognises the first.

Durability: a Redis that loses its data on restart loses fences and in-flight claims, which
could let a call run twice. Persistent means AOF on with ``appendfsync always`` (every write
on disk before its reply) or ``everysec`` (an OS crash or power loss can lose up to about
one second of acknowledged writes; a killed Redis process loses nothing). RDB save points
alone are volatile for this purpose: a crash rolls the server back to its last snapshot,
fences and claims with it. ``RedisLeaseStore`` and ``RedisIdempotencyStore`` refuse any
other server, or one with an ``allkeys-*`` eviction policy, unless they are built with
``allow_volatile=True`` (URL ``?allow_volatile=true``).

Errors say whether the outcome is unknown: a failure before any command of the call left
the client (connection refused, connect timeout, a full pool) and a server's refusal of a
command as a whole (OOM, READONLY, LOADING, BUSY, ...) are ``StoreUnavailableError``; a
timeout or a dropped connection once a command was sent is ``StoreReplyLostError``. What
was sent is known because every connection of a client the stores use marks, for the kit
call in progress, the moment it writes a command (not its own handshake).
"""

from __future__ import annotations

import json
import logging
import secrets
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, quote, unquote, urlencode, urlsplit, urlunsplit

try:
    import redis.asyncio as aioredis
    from redis.exceptions import (
        AuthenticationError,
        BusyLoadingError,
        ClusterDownError,
        NoPermissionError,
        OutOfMemoryError,
        ReadOnlyError,
        RedisError,
        ResponseError,
        TryAgainError,
    )
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import TimeoutError as RedisTimeoutError
except ImportError as exc:  # pragma: no cover - exercised in a subprocess test
    raise ImportError(
        'tesserix_adk.adapters.redis needs the redis package: pip install "tesserix-adk[redis]"'
    ) from exc

from tesserix_adk.errors import (
    CheckpointCorruptError,
    CheckpointTooLargeError,
    ConfigurationError,
    HistoryUnavailableError,
    LeaseHeldError,
    LeaseLostError,
    StaleFenceError,
    StoreReplyLostError,
    StoreUnavailableError,
)
from tesserix_adk.messages import ToolCall, Usage
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.stores.protocols import (
    EMPTY_HISTORY_DIGEST,
    ApprovalRequest,
    ApprovalStatus,
    HistoryHandle,
    IdempotencyRecord,
    RecordStatus,
    RunLease,
    StoredCheckpoint,
    ToolFlags,
    chain_digest,
)
from tesserix_adk.stores.rows import decoded, stored_calls

__all__ = [
    "DEFAULT_PREFIX",
    "RedisApprovalStore",
    "RedisCheckpointStore",
    "RedisHistoryStore",
    "RedisIdempotencyStore",
    "RedisLeaseStore",
    "RedisLedger",
    "check_persistence",
    "open_redis_stores",
]

DEFAULT_PREFIX = "adk:"

Client = aioredis.Redis

# The kit's own URL options; everything else in the query goes to redis-py.
_KIT_OPTIONS = ("prefix", "allow_volatile", "keep_last")
# Options of the kit's other backends: refused here rather than handed to the driver.
_OTHER_KIT_OPTIONS = frozenset(
    {"prefix", "allow_volatile", "keep_last", "pool_min", "pool_max", "synchronous"}
) - set(_KIT_OPTIONS)

# Server refusals that mean "not now" rather than "never"; each refuses a command whole.
# redis-py raises a class for most and strips the code from the message, so the classes
# are what is matched (BusyLoadingError is LOADING; ClusterDownError covers MASTERDOWN).
_TRANSIENT_ERRORS = (
    OutOfMemoryError,
    ReadOnlyError,
    BusyLoadingError,
    TryAgainError,
    ClusterDownError,
)
# Codes redis-py leaves in the message, as the server sent it.
_TRANSIENT_REPLIES = ("BUSY", "OOM", "READONLY", "LOADING", "MASTERDOWN", "TRYAGAIN", "CLUSTERDOWN")
_PERMISSION_REPLIES = ("NOPERM", "NOAUTH", "WRONGPASS")

_log = logging.getLogger("tesserix_adk.adapters.redis")


# --- shared plumbing ---------------------------------------------------------------------


class _Sends:
    """Whether any command of the kit call in progress left the client."""

    __slots__ = ("sent",)

    def __init__(self) -> None:
        self.sent = False


_sends: ContextVar[_Sends | None] = ContextVar("tesserix_adk_redis_sends", default=None)


class _MarksSends:
    """Mixed into the client's connection class: a command written for a kit call marks
    that call's ``_Sends``; the connection's own handshake does not."""

    _adk_connecting = 0

    async def connect(self, *args: Any, **kwargs: Any) -> Any:
        self._adk_connecting += 1
        try:
            return await super().connect(*args, **kwargs)  # type: ignore[misc]
        finally:
            self._adk_connecting -= 1

    async def connect_check_health(self, *args: Any, **kwargs: Any) -> Any:
        self._adk_connecting += 1
        try:
            return await super().connect_check_health(*args, **kwargs)  # type: ignore[misc]
        finally:
            self._adk_connecting -= 1

    async def send_packed_command(self, *args: Any, **kwargs: Any) -> Any:
        sends = _sends.get()
        if sends is not None and not self._adk_connecting:
            if not self.is_connected:  # type: ignore[attr-defined]
                await self.connect()  # a refused connection is not a sent command
            sends.sent = True
        return await super().send_packed_command(*args, **kwargs)  # type: ignore[misc]


_MARKING: dict[type[Any], type[Any]] = {}


def _marking(cls: type[Any]) -> type[Any]:
    if issubclass(cls, _MarksSends):
        return cls
    if cls not in _MARKING:
        _MARKING[cls] = type(f"Marking{cls.__name__}", (_MarksSends, cls), {})
    return _MARKING[cls]


def _track_sends(client: Client) -> None:
    """Make every connection of ``client`` mark what it sends (idempotent)."""
    pool = client.connection_pool
    pool.connection_class = _marking(pool.connection_class)
    existing: list[Any] = [getattr(client, "connection", None)]
    for name in ("_available_connections", "_in_use_connections", "_connections"):
        existing.extend(getattr(pool, name, None) or ())
    for conn in existing:
        if conn is not None and not isinstance(conn, _MarksSends):
            # Only a method override is added, so the object's layout is unchanged.
            conn.__class__ = _marking(type(conn))


@contextmanager
def _driver_errors(action: str) -> Iterator[None]:
    """Translate redis-py errors into the kit's, once, at the boundary, saying whether the
    outcome is unknown (a command was sent) or certainly nothing happened."""
    sends = _Sends()
    token = _sends.set(sends)
    try:
        yield
    except AuthenticationError as exc:
        raise ConfigurationError(f"Redis refused the credentials while {action}: {exc}") from exc
    except _TRANSIENT_ERRORS as exc:
        raise StoreUnavailableError(
            f"Redis refused {action} for now ({type(exc).__name__}): {exc}", retryable=True
        ) from exc
    except NoPermissionError as exc:
        raise ConfigurationError(f"Redis refused {action}: {exc}") from exc
    except (RedisConnectionError, RedisTimeoutError) as exc:
        if sends.sent:
            raise StoreReplyLostError(
                f"Redis did not answer while {action} after the command was sent; it may "
                f"have been applied: {exc}"
            ) from exc
        raise StoreUnavailableError(f"Redis could not be reached while {action}: {exc}") from exc
    except ResponseError as exc:
        reply = str(exc)
        if reply.startswith(_PERMISSION_REPLIES):
            raise ConfigurationError(f"Redis refused {action}: {reply}") from exc
        if "WRONGTYPE" in reply:
            # A key of the kit's holds another kind of value: damage, not "retry later".
            raise CheckpointCorruptError(
                f"Redis holds a damaged key while {action}: {reply}"
            ) from exc
        raise StoreUnavailableError(
            f"Redis refused {action}: {reply}",
            retryable=reply.startswith(_TRANSIENT_REPLIES),
        ) from exc
    except RedisError as exc:
        if sends.sent:
            raise StoreReplyLostError(
                f"Redis failed while {action} after the command was sent: {exc}"
            ) from exc
        raise StoreUnavailableError(f"Redis failed while {action}: {exc}") from exc
    finally:
        _sends.reset(token)


def _enc(value: str) -> str:
    # quote() keeps exactly A-Z a-z 0-9 and "_.-~" with safe="", and encodes UTF-8.
    return quote(value, safe="")


def _glob_escape(value: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in value)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _bytes(value: Any) -> bytes:
    # The client is built without decode_responses, so replies are bytes; str is the
    # typing's other branch.
    return value.encode() if isinstance(value, str) else bytes(value)


def _fence_arg(fence: int | None) -> str:
    return "" if fence is None else str(int(fence))


def _fence_of(raw: bytes | str | None) -> int | None:
    return None if raw is None or raw in (b"", "") else int(raw)


def _seconds(micros: bytes | str | int) -> float:
    return int(micros) / 1_000_000


def _ttl_micros(ttl: float) -> int:
    if not ttl > 0:
        raise ValueError(f"ttl must be a positive number of seconds, got {ttl!r}")
    return max(1, round(float(ttl) * 1_000_000))


def _pairs(flat: Sequence[Any]) -> dict[bytes, bytes]:
    """A Lua ``HGETALL`` reply (flat list) as a mapping."""
    return {bytes(flat[i]): bytes(flat[i + 1]) for i in range(0, len(flat), 2)}


def _stale(what: str, run_id: str, fence: int | None, seen: bytes | str) -> StaleFenceError:
    seen_fence = int(seen)
    if fence is None:
        return StaleFenceError(
            f"unfenced {what} refused for run {run_id!r}: fence {seen_fence} was seen"
        )
    return StaleFenceError(
        f"fence {fence} is stale for run {run_id!r}: fence {seen_fence} was seen"
    )


def _require_bytes(client: Client) -> None:
    # Payloads are bytes; a client that decodes replies would hand back str or fail on them.
    if client.get_encoder().decode_responses:  # type: ignore[no-untyped-call]
        raise ConfigurationError(
            "the Redis client decodes responses (decode_responses=True); the stores keep "
            "bytes and need a client built with decode_responses=False"
        )
    _track_sends(client)


def _check_prefix(prefix: str) -> str:
    if "{" in prefix or "}" in prefix:
        # A brace in the prefix would become the hash tag and split a run across slots.
        raise ConfigurationError(f"a Redis key prefix may not contain braces, got {prefix!r}")
    return prefix


@dataclass(frozen=True, slots=True)
class _Keys:
    """Names every key of the layout drawn in the module docstring."""

    prefix: str

    def __post_init__(self) -> None:
        _check_prefix(self.prefix)

    @staticmethod
    def tag(tenant: str, run_id: str) -> str:
        return f"{_enc(tenant)}:{_enc(run_id)}"

    def run(self, tenant: str, run_id: str, name: str) -> str:
        return self.tagged(self.tag(tenant, run_id), name)

    def tagged(self, tag: str, name: str) -> str:
        return f"{self.prefix}{{{tag}}}:{name}"

    def key_index(self, tenant: str, key: str) -> str:
        return f"{self.prefix}idem-key:{{{_enc(tenant)}:{_enc(key)}}}"

    def legacy_key_index(self, key: str) -> str:
        # Written by kits before records were keyed by (tenant, key); still read, never
        # written, so that an upgrade finds every record those kits left.
        return f"{self.prefix}idem-key:{{{_enc(key)}}}"

    def approval_index(self, id: str) -> str:
        return f"{self.prefix}approval-id:{{{_enc(id)}}}"


# --- durability check --------------------------------------------------------------------


async def check_persistence(client: Client) -> None:
    """Raise ``ConfigurationError`` unless the server keeps fences and claims across a
    crash and never evicts them: AOF on with ``appendfsync always`` or ``everysec`` (the
    latter may lose up to about one second of acknowledged writes to an OS crash or power
    loss, and says so in a warning), and no ``allkeys-*`` maxmemory-policy. RDB save points
    alone do not count: a crash rolls the server back to its last snapshot."""
    with _driver_errors("checking its persistence settings"):
        persistence = await client.info("persistence")
        memory = await client.info("memory")
        try:
            config = await client.config_get("appendfsync")
            fsync: str | None = str(config.get("appendfsync", "")).lower()
        except ResponseError:
            # CONFIG is often renamed away on managed servers; then fsync cannot be known.
            fsync = None
    problems: list[str] = []
    policy = str(memory.get("maxmemory_policy", "noeviction"))
    if policy.startswith("allkeys-"):
        problems.append(
            f"its maxmemory-policy is {policy}, which may evict fences and in-flight claims "
            f"(use noeviction or a volatile-* policy)"
        )
    aof = str(persistence.get("aof_enabled", "0")) == "1"
    if not aof:
        problems.append(
            "it has no AOF (appendonly yes, with appendfsync always or everysec); RDB save "
            "points alone are not enough, since a crash rolls the server back to its last "
            "snapshot and loses fences and claims"
        )
    elif fsync is None:
        problems.append(
            "its appendfsync setting cannot be read (CONFIG GET is not allowed), so it "
            "cannot be told to be always or everysec"
        )
    elif fsync not in ("always", "everysec"):
        problems.append(
            f"its appendfsync is {fsync}, which leaves syncing to the OS and can lose many "
            f"seconds of acknowledged writes (use always, or everysec)"
        )
    if problems:
        raise ConfigurationError(
            "this Redis server is not durable enough for leases and idempotency claims: "
            + "; ".join(problems)
            + ". Fix the server settings, or accept the risk with allow_volatile=true in the "
            "store URL (allow_volatile=True in code)."
        )
    if fsync == "everysec":
        _log.warning(
            "Redis runs appendfsync everysec: an OS crash or power loss can lose up to about "
            "one second of acknowledged writes (a claim among them); appendfsync always "
            "closes that window"
        )


class _Durability:
    """Runs ``check_persistence`` once, on first use, unless volatility was allowed."""

    __slots__ = ("_allowed", "_checked", "_client")

    def __init__(self, client: Client, *, allow_volatile: bool) -> None:
        self._client = client
        self._allowed = allow_volatile
        self._checked = False

    async def ensure(self) -> None:
        if self._allowed or self._checked:
            return
        await check_persistence(self._client)
        self._checked = True

    async def check(self) -> None:
        if not self._allowed:
            await check_persistence(self._client)
            self._checked = True


# --- Lua ---------------------------------------------------------------------------------

# Shared by every script that decides something. ``refusal`` returns the fence that refuses
# a write (the highest seen by this store, or the run's current lease fence), else false.
_LUA_COMMON = r"""
local function now_us()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2])
end
local function int(x)
  return string.format('%.0f', x)
end
local function refusal(seen_key, lease_key, fence)
  local seen = redis.call('GET', seen_key)
  local leased = redis.call('GET', lease_key)
  if fence == '' then
    if seen then return seen end
    return leased
  end
  local f = tonumber(fence)
  if seen and tonumber(seen) > f then return seen end
  if leased and tonumber(leased) > f then return leased end
  return false
end
-- A record that is there but cannot be what a kit wrote (not a hash, no known status, an
-- expiry that is not a number): never taken for absent, never overwritten.
local function damaged(key)
  local kind = redis.call('TYPE', key)['ok']
  if kind == 'none' then return false end
  if kind ~= 'hash' then return true end
  local fields = redis.call('HMGET', key, 'status', 'expires_at')
  local status = fields[1]
  if status ~= 'in_flight' and status ~= 'completed' and status ~= 'never_ran' then
    return true
  end
  return fields[2] and not tonumber(fields[2])
end
local function accept(seen_key, fence)
  if fence == '' then return end
  local seen = redis.call('GET', seen_key)
  if (not seen) or tonumber(seen) < tonumber(fence) then
    redis.call('SET', seen_key, fence)
  end
end
local function push(key, first, last)
  for i = first, last, 1000 do
    redis.call('RPUSH', key, unpack(ARGV, i, math.min(i + 999, last)))
  end
end
"""

# KEYS: seen, lease fence. ARGV: fence.
_SEAL = (
    _LUA_COMMON
    + r"""
local refused = refusal(KEYS[1], KEYS[2], ARGV[1])
if refused then return {'stale', refused} end
accept(KEYS[1], ARGV[1])
return {'ok'}
"""
)

# KEYS: frontier, steps, step fences, step index, seen, lease fence.
# ARGV: fence, step, payload, keep_last ('' = keep every step).
_PUT = (
    _LUA_COMMON
    + r"""
local refused = refusal(KEYS[5], KEYS[6], ARGV[1])
if refused then return {'stale', refused} end
accept(KEYS[5], ARGV[1])
redis.call('HSET', KEYS[1], 'payload', ARGV[3], 'step', ARGV[2], 'fence', ARGV[1])
redis.call('HSET', KEYS[2], ARGV[2], ARGV[3])
redis.call('HSET', KEYS[3], ARGV[2], ARGV[1])
redis.call('ZADD', KEYS[4], ARGV[2], ARGV[2])
if ARGV[4] ~= '' then
  local extra = redis.call('ZCARD', KEYS[4]) - tonumber(ARGV[4])
  while extra > 0 do
    local old = redis.call('ZRANGE', KEYS[4], 0, math.min(extra, 1000) - 1)
    redis.call('ZREM', KEYS[4], unpack(old))
    redis.call('HDEL', KEYS[2], unpack(old))
    redis.call('HDEL', KEYS[3], unpack(old))
    extra = extra - #old
  end
end
return {'ok'}
"""
)

# KEYS: lease, lease fence. ARGV: holder, ttl (microseconds), token of this call.
# redis-py sends a command again when its reply was lost; the token tells that resend (which
# must get the lease it already took) from a second acquisition (which must be refused).
_ACQUIRE = (
    _LUA_COMMON
    + r"""
local now = now_us()
local current = redis.call('HMGET', KEYS[1], 'holder', 'deadline', 'fence', 'token',
                            'previous_end')
if current[1] and now < tonumber(current[2]) then
  if current[4] == ARGV[3] then return {'ok', current[3], current[2], current[5] or ''} end
  return {'held', current[1]}
end
local fence = redis.call('INCR', KEYS[2])
local deadline = now + tonumber(ARGV[2])
-- A lapsed lease ended at its deadline, a released one when it was released (its deadline
-- field then holds that moment); '' when no lease ended before.
local previous_end = current[2] or ''
redis.call('HSET', KEYS[1], 'holder', ARGV[1], 'fence', int(fence), 'deadline', int(deadline),
           'token', ARGV[3], 'previous_end', previous_end)
return {'ok', int(fence), int(deadline), previous_end}
"""
)

# KEYS: lease. ARGV: holder, fence, ttl (microseconds).
_RENEW = (
    _LUA_COMMON
    + r"""
local now = now_us()
local current = redis.call('HMGET', KEYS[1], 'holder', 'fence', 'deadline')
if (not current[1]) or current[1] ~= ARGV[1] or current[2] ~= ARGV[2]
    or now >= tonumber(current[3]) then
  return {'lost'}
end
local deadline = now + tonumber(ARGV[3])
redis.call('HSET', KEYS[1], 'deadline', int(deadline))
return {'ok', int(deadline)}
"""
)

# KEYS: lease. ARGV: holder, fence. The fence counter is another key and stays; the hash
# stays too, holderless, its deadline moved back to the release, which the next acquisition
# reports as the moment the previous lease ended.
_RELEASE_LEASE = (
    _LUA_COMMON
    + r"""
local current = redis.call('HMGET', KEYS[1], 'holder', 'fence', 'deadline')
if current[1] == ARGV[1] and current[2] == ARGV[2] then
  local ended = now_us()
  if current[3] and tonumber(current[3]) < ended then ended = tonumber(current[3]) end
  redis.call('HDEL', KEYS[1], 'holder', 'token', 'previous_end')
  redis.call('HSET', KEYS[1], 'deadline', int(ended))
  return 1
end
return 0
"""
)

# KEYS: lease. Microseconds since a lapsed or released lease ended; '' while live or if none.
_LEASE_END = (
    _LUA_COMMON
    + r"""
local current = redis.call('HMGET', KEYS[1], 'holder', 'deadline')
local now = now_us()
if current[2] and ((not current[1]) or now >= tonumber(current[2])) then
  return int(math.max(0, now - tonumber(current[2])))
end
return ''
"""
)

# KEYS: lease.
_CURRENT = (
    _LUA_COMMON
    + r"""
local now = now_us()
local current = redis.call('HMGET', KEYS[1], 'holder', 'fence', 'deadline')
if current[1] and now < tonumber(current[3]) then
  return {current[1], current[2], current[3]}
end
return {}
"""
)

# KEYS: record, the run's record set, seen, lease fence.
# ARGV: holder, fence, ttl ('' = none), takeover, fenced, member, then the fresh record's
# other fields as name/value pairs.
_CLAIM = (
    _LUA_COMMON
    + r"""
local holder, fence, ttl = ARGV[1], ARGV[2], ARGV[3]
if ARGV[5] == '1' then
  local refused = refusal(KEYS[3], KEYS[4], fence)
  if refused then return {'stale', refused} end
else
  fence = ''
end
if damaged(KEYS[1]) then return {'damaged'} end
local now = now_us()
local expires = ''
if ttl ~= '' then expires = int(now + tonumber(ttl)) end
local current = redis.call('HMGET', KEYS[1], 'status', 'holder', 'expires_at')
local status = current[1]
if status == 'in_flight' and current[3] and now >= tonumber(current[3]) then
  status = false
end
local function set_or_drop(field, value)
  if value == '' then
    redis.call('HDEL', KEYS[1], field)
  else
    redis.call('HSET', KEYS[1], field, value)
  end
end
if (not status) or status == 'never_ran' then
  redis.call('DEL', KEYS[1])
  redis.call('HSET', KEYS[1], 'status', 'in_flight', 'holder', holder, 'since', int(now),
             unpack(ARGV, 7))
  set_or_drop('fence', fence)
  set_or_drop('expires_at', expires)
  redis.call('SADD', KEYS[2], ARGV[6])
elseif status == 'in_flight' and current[2] == holder then
  if fence ~= '' then redis.call('HSET', KEYS[1], 'fence', fence) end
  if expires ~= '' then redis.call('HSET', KEYS[1], 'expires_at', expires) end
elseif status == 'in_flight' and ARGV[4] == '1' then
  redis.call('HSET', KEYS[1], 'holder', holder, 'since', int(now))
  set_or_drop('fence', fence)
  set_or_drop('expires_at', expires)
end
if ARGV[5] == '1' then accept(KEYS[3], fence) end
return {'ok', redis.call('HGETALL', KEYS[1])}
"""
)

# KEYS: record. ARGV: outcome, holder.
_COMPLETE = (
    _LUA_COMMON
    + r"""
if damaged(KEYS[1]) then return {'damaged'} end
local now = now_us()
local current = redis.call('HMGET', KEYS[1], 'status', 'holder', 'expires_at', 'by')
local status = current[1]
if status == 'in_flight' and current[3] and now >= tonumber(current[3]) then
  status = false
end
if not status then return {'absent'} end
if status == 'completed' and current[2] == ARGV[2] and not current[4] then
  return {'ok', redis.call('HGETALL', KEYS[1])}
end
if status ~= 'in_flight' or current[2] ~= ARGV[2] then
  return {'refused', status, current[2]}
end
redis.call('HSET', KEYS[1], 'status', 'completed', 'outcome', ARGV[1], 'completed_at', int(now))
redis.call('HDEL', KEYS[1], 'expires_at')
return {'ok', redis.call('HGETALL', KEYS[1])}
"""
)

# KEYS: record, the run's record set. ARGV: holder, member, undispatched ('1'/'0').
_RELEASE_CLAIM = r"""
local current = redis.call('HMGET', KEYS[1], 'status', 'holder', 'expires_at', 'tool')
local releasable = current[3] or (ARGV[3] == '1' and current[4])
if current[1] == 'in_flight' and current[2] == ARGV[1] and releasable then
  redis.call('DEL', KEYS[1])
  redis.call('SREM', KEYS[2], ARGV[2])
  return 1
end
return 0
"""

# KEYS: record. ARGV: never_ran ('1'/'0'), outcome, by.
_RESOLVE = (
    _LUA_COMMON
    + r"""
if damaged(KEYS[1]) then return {'damaged'} end
local now = now_us()
local current = redis.call('HMGET', KEYS[1], 'status', 'expires_at')
local status = current[1]
if status == 'in_flight' and current[2] and now >= tonumber(current[2]) then
  status = false
end
if not status then return {'absent'} end
if status ~= 'in_flight' then return {'settled', status} end
if ARGV[1] == '1' then
  redis.call('HSET', KEYS[1], 'status', 'never_ran', 'by', ARGV[3])
else
  redis.call('HSET', KEYS[1], 'status', 'completed', 'outcome', ARGV[2], 'by', ARGV[3],
             'completed_at', int(now))
end
redis.call('HDEL', KEYS[1], 'expires_at')
return {'ok', redis.call('HGETALL', KEYS[1])}
"""
)

# KEYS: items, digests, seen, lease fence.
# ARGV: fence, count, digest, empty digest, n, then n items, then n digests.
_APPEND = (
    _LUA_COMMON
    + r"""
local refused = refusal(KEYS[3], KEYS[4], ARGV[1])
if refused then return {'stale', refused} end
local count = tonumber(ARGV[2])
local resolves
if count == 0 then
  resolves = ARGV[3] == ARGV[4]
else
  resolves = redis.call('LINDEX', KEYS[2], count - 1) == ARGV[3]
end
if not resolves then return {'unavailable'} end
accept(KEYS[3], ARGV[1])
if count == 0 then
  redis.call('DEL', KEYS[1], KEYS[2])
else
  -- A dead writer may have appended past this prefix; its tail goes.
  redis.call('LTRIM', KEYS[1], 0, count - 1)
  redis.call('LTRIM', KEYS[2], 0, count - 1)
end
local n = tonumber(ARGV[5])
if n > 0 then
  push(KEYS[1], 6, 5 + n)
  push(KEYS[2], 6 + n, 5 + 2 * n)
end
return {'ok'}
"""
)

# KEYS: items, digests. ARGV: count, digest, empty digest.
_FETCH = r"""
local count = tonumber(ARGV[1])
if count == 0 then
  if ARGV[2] == ARGV[3] then return {'ok', {}} end
  return {'unavailable'}
end
if redis.call('LINDEX', KEYS[2], count - 1) ~= ARGV[2] then return {'unavailable'} end
return {'ok', redis.call('LRANGE', KEYS[1], 0, count - 1)}
"""

# KEYS: ledger, seen, lease fence. ARGV: fence, micros, input tokens, output tokens, token.
# A charge is the one write that is not idempotent; its token makes redis-py's resend of a
# command whose reply was lost count once. (One writer charges a run at a time, so the last
# token is enough.)
_CHARGE = (
    _LUA_COMMON
    + r"""
if redis.call('HGET', KEYS[1], 'last_charge') == ARGV[5] then return {'ok'} end
local refused = refusal(KEYS[2], KEYS[3], ARGV[1])
if refused then return {'stale', refused} end
accept(KEYS[2], ARGV[1])
redis.call('HINCRBY', KEYS[1], 'micros', ARGV[2])
redis.call('HINCRBY', KEYS[1], 'input_tokens', ARGV[3])
redis.call('HINCRBY', KEYS[1], 'output_tokens', ARGV[4])
redis.call('HSET', KEYS[1], 'last_charge', ARGV[5])
return {'ok'}
"""
)

# KEYS: request, seen, lease fence. ARGV: fence, then the request's fields as pairs.
_REQUEST = (
    _LUA_COMMON
    + r"""
local refused = refusal(KEYS[2], KEYS[3], ARGV[1])
if refused then return {'stale', refused} end
accept(KEYS[2], ARGV[1])
redis.call('HSET', KEYS[1], 'status', 'pending', 'requested_at', int(now_us()), unpack(ARGV, 2))
return {'ok', redis.call('HGETALL', KEYS[1])}
"""
)

# KEYS: request. ARGV: status, by, has note ('1'/'0'), note.
_DECIDE = (
    _LUA_COMMON
    + r"""
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return {'absent'} end
if status == ARGV[1] then return {'ok', redis.call('HGETALL', KEYS[1])} end
if status ~= 'pending' then
  return {'decided', redis.call('HGETALL', KEYS[1])}
end
redis.call('HSET', KEYS[1], 'status', ARGV[1], 'by', ARGV[2], 'decided_at', int(now_us()))
if ARGV[3] == '1' then redis.call('HSET', KEYS[1], 'note', ARGV[4]) end
return {'ok', redis.call('HGETALL', KEYS[1])}
"""
)


class _FencedRedisStore:
    """What every fenced Redis store shares: its client, keys and ``seal``."""

    _store: str = ""

    def __init__(self, client: Client, *, prefix: str = DEFAULT_PREFIX) -> None:
        _require_bytes(client)
        self._client = client
        self._keys = _Keys(prefix)
        self._seal_script = client.register_script(_SEAL)

    @property
    def prefix(self) -> str:
        """The prefix of every key this store writes."""
        return self._keys.prefix

    def _seen(self, tenant: str, run_id: str) -> str:
        return self._keys.run(tenant, run_id, f"{self._store}:fence")

    def _lease_fence(self, tenant: str, run_id: str) -> str:
        return self._keys.run(tenant, run_id, "lease:fence")

    async def _ready(self) -> None:
        """Called before every operation; a store with preconditions checks them here."""

    async def seal(self, tenant: str, run_id: str, fence: int) -> None:
        """Raise the highest-seen fence for the run without writing data."""
        await self._ready()
        with _driver_errors(f"sealing run {run_id!r}"):
            result = await self._seal_script(
                keys=[self._seen(tenant, run_id), self._lease_fence(tenant, run_id)],
                args=[_fence_arg(fence)],
            )
        if result[0] == b"stale":
            raise StaleFenceError(
                f"cannot seal run {run_id!r} at fence {fence}: fence {int(result[1])} was seen"
            )


# --- checkpoints -------------------------------------------------------------------------


class RedisCheckpointStore(_FencedRedisStore):
    """A ``CheckpointStore`` on Redis: one hash per run for the frontier, step snapshots in
    their own keys (``keep_last=N`` keeps the N highest steps). ``max_value_bytes`` refuses
    a larger payload with ``CheckpointTooLargeError`` before any call to the server."""

    _store = "cp"

    def __init__(
        self,
        client: Client,
        *,
        prefix: str = DEFAULT_PREFIX,
        keep_last: int | None = None,
        max_value_bytes: int | None = None,
    ) -> None:
        super().__init__(client, prefix=prefix)
        if keep_last is not None and keep_last < 1:
            raise ConfigurationError(f"keep_last must be at least 1, got {keep_last}")
        if max_value_bytes is not None and max_value_bytes < 1:
            raise ConfigurationError(f"max_value_bytes must be at least 1, got {max_value_bytes}")
        self.keep_last = keep_last
        self.max_value_bytes = max_value_bytes
        self._put = client.register_script(_PUT)

    def _data_keys(self, tenant: str, run_id: str) -> list[str]:
        return [
            self._keys.run(tenant, run_id, name)
            for name in ("cp:frontier", "cp:steps", "cp:step-fences", "cp:step-index")
        ]

    async def put(
        self, tenant: str, run_id: str, payload: bytes, *, step: int, fence: int | None = None
    ) -> None:
        """Write a frontier; it becomes ``latest`` and step ``step`` (last write wins)."""
        if self.max_value_bytes is not None and len(payload) > self.max_value_bytes:
            raise CheckpointTooLargeError(
                f"the frontier of run {run_id!r} is {len(payload)} bytes, over this Redis "
                f"store's max_value_bytes of {self.max_value_bytes}; it was not written"
            )
        keys = [
            *self._data_keys(tenant, run_id),
            self._seen(tenant, run_id),
            self._lease_fence(tenant, run_id),
        ]
        args: list[str | bytes] = [
            _fence_arg(fence),
            str(int(step)),
            bytes(payload),
            "" if self.keep_last is None else str(self.keep_last),
        ]
        with _driver_errors(f"writing a frontier of run {run_id!r}"):
            result = await self._put(keys=keys, args=args)
        if result[0] == b"stale":
            raise _stale("write", run_id, fence, result[1])

    async def latest(self, tenant: str, run_id: str) -> StoredCheckpoint | None:
        """The last accepted put, or ``None``."""
        key = self._keys.run(tenant, run_id, "cp:frontier")
        with _driver_errors(f"reading the frontier of run {run_id!r}"):
            payload, step, fence = await self._client.hmget(key, ["payload", "step", "fence"])
        if payload is None or step is None:
            return None
        return StoredCheckpoint(payload=_bytes(payload), step=int(step), fence=_fence_of(fence))

    async def at(self, tenant: str, run_id: str, step: int) -> StoredCheckpoint | None:
        """The snapshot written under ``step``, or ``None`` (never a default)."""
        field = str(int(step))
        with _driver_errors(f"reading step {step} of run {run_id!r}"):
            async with self._client.pipeline(transaction=True) as pipe:
                pipe.hget(self._keys.run(tenant, run_id, "cp:steps"), field)
                pipe.hget(self._keys.run(tenant, run_id, "cp:step-fences"), field)
                payload, fence = await pipe.execute()
        if payload is None:
            return None
        return StoredCheckpoint(payload=bytes(payload), step=int(step), fence=_fence_of(fence))

    async def steps(self, tenant: str, run_id: str) -> list[int]:
        """The steps still kept for the run, ascending."""
        key = self._keys.run(tenant, run_id, "cp:step-index")
        with _driver_errors(f"listing the steps of run {run_id!r}"):
            members = await self._client.zrange(key, 0, -1)
        return [int(_bytes(member)) for member in members]

    async def runs(self, tenant: str) -> list[str]:
        """The run ids with a frontier for the tenant, sorted.

        Found with ``SCAN`` over the tenant's frontier keys: an operator's listing, not a
        hot path, and it needs no index that a crash could leave out of step.
        """
        head = f"{self._keys.prefix}{{{_enc(tenant)}:"
        tail = "}:cp:frontier"
        pattern = f"{_glob_escape(head)}*{_glob_escape(tail)}"
        found: set[str] = set()
        with _driver_errors(f"listing the runs of tenant {tenant!r}"):
            async for raw in self._client.scan_iter(match=pattern, count=1000):
                key = _text(raw)
                encoded = key[len(head) : -len(tail)]
                if key.startswith(head) and key.endswith(tail) and ":" not in encoded:
                    found.add(unquote(encoded))
        return sorted(found)

    async def forget(self, tenant: str, run_id: str) -> None:
        """Remove the run's frontier and steps; its fence stays."""
        with _driver_errors(f"forgetting run {run_id!r}"):
            await self._client.delete(*self._data_keys(tenant, run_id))


# --- idempotency -------------------------------------------------------------------------


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
        self._claim = client.register_script(_CLAIM)
        self._complete = client.register_script(_COMPLETE)
        self._release = client.register_script(_RELEASE_CLAIM)
        self._resolve = client.register_script(_RESOLVE)

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
                # before the claim, or records() of this run could never find it.
                await self._client.sadd(self._keys.tagged(mine, "idem:keys"), _enc(key))
            result = await self._claim(
                keys=[
                    self._record_key(tag, key),
                    self._keys.tagged(tag, "idem:keys"),
                    self._seen(tenant, run_id),
                    self._lease_fence(tenant, run_id),
                ],
                args=[
                    holder,
                    "" if fence is None else str(int(fence)),
                    "" if ttl_micros is None else str(ttl_micros),
                    "1" if takeover else "0",
                    "1" if fenced else "0",
                    _enc(key),
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
                raise StaleFenceError(f"{holder!r} holds no claim on {key!r}")
            result = await self._complete(
                keys=[self._record_key(tag, key)], args=[bytes(outcome), holder]
            )
        _refuse_damaged(result, key)
        if result[0] == b"absent":
            raise StaleFenceError(f"{holder!r} holds no claim on {key!r}")
        if result[0] == b"refused":
            raise StaleFenceError(
                f"{holder!r} does not hold {key!r} in flight "
                f"({_text(result[1])} under {_text(result[2])!r})"
            )
        return _record(_pairs(result[1]))

    async def release(
        self, key: str, *, tenant: str, holder: str, undispatched: bool = False
    ) -> None:
        """Drop a ttl claim held by ``holder``; anything else is left alone."""
        await self._ready()
        with _driver_errors(f"releasing {key!r}"):
            tag = await self._owner(tenant, key)
            if tag is None:
                return
            await self._release(
                keys=[self._record_key(tag, key), self._keys.tagged(tag, "idem:keys")],
                args=[holder, _enc(key), "1" if undispatched else "0"],
            )

    async def _fetch(self, located: Sequence[tuple[str, str]]) -> list[IdempotencyRecord]:
        """The live records at (tag, key) in one round trip, in the order given."""
        if not located:
            return []
        async with self._client.pipeline(transaction=False) as pipe:
            for tag, key in located:
                pipe.hgetall(self._record_key(tag, key))
            pipe.time()
            *replies, (seconds, micros) = await pipe.execute()
        now = int(seconds) * 1_000_000 + int(micros)
        return [_record(fields) for fields in replies if fields and not _lapsed(fields, now)]

    async def lookup(self, keys: Sequence[str], *, tenant: str) -> dict[str, IdempotencyRecord]:
        """The tenant's live records of ``keys`` in two round trips whatever their number."""
        wanted = list(dict.fromkeys(keys))
        if not wanted:
            return {}
        await self._ready()
        with _driver_errors(f"looking up {len(wanted)} idempotency key(s)"):
            owners = await self._owners(tenant, wanted)
            located = [(owner, key) for key, owner in zip(wanted, owners, strict=True) if owner]
            records = await self._fetch(located)
        return {record.key: record for record in records if record.tenant == tenant}

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
        mine = [r for r in found if r.tenant == tenant and r.run_id == run_id]
        return sorted(
            mine, key=lambda r: (-1 if r.iteration is None else r.iteration, r.since, r.key)
        )

    async def resolve(
        self,
        key: str,
        outcome: bytes | None = None,
        *,
        tenant: str,
        never_ran: bool = False,
        by: str,
    ) -> IdempotencyRecord:
        """An operator settles an in-flight call: its outcome, or that it never ran."""
        if never_ran == (outcome is not None):
            raise ValueError("resolve needs exactly one of an outcome or never_ran=True")
        await self._ready()
        with _driver_errors(f"resolving {key!r}"):
            tag = await self._owner(tenant, key)
            if tag is None:
                raise KeyError(key)
            result = await self._resolve(
                keys=[self._record_key(tag, key)],
                args=["1" if never_ran else "0", b"" if outcome is None else bytes(outcome), by],
            )
        _refuse_damaged(result, key)
        if result[0] == b"absent":
            raise KeyError(key)
        if result[0] == b"settled":
            raise ValueError(f"{key!r} is {_text(result[1])}, not in flight")
        return _record(_pairs(result[1]))


def _refuse_damaged(result: Sequence[Any], key: str) -> None:
    """A script found the record there but not as a kit writes it: it wrote nothing."""
    if result and result[0] == b"damaged":
        raise CheckpointCorruptError(
            f"a stored idempotency record cannot be read ({key!r} is damaged); the store "
            "holds a damaged row and nothing was written over it"
        )


# --- leases ------------------------------------------------------------------------------


class RedisLeaseStore:
    """A ``LeaseStore`` on Redis; expiry decided by the server's ``TIME`` only.

    Each operation is one Lua script. The fence is an ``INCR`` counter in a key of its own
    that never expires and is never deleted, so it keeps rising across expiry and release.
    """

    def __init__(
        self, client: Client, *, prefix: str = DEFAULT_PREFIX, allow_volatile: bool = False
    ) -> None:
        _require_bytes(client)
        self._client = client
        self._keys = _Keys(prefix)
        self._durability = _Durability(client, allow_volatile=allow_volatile)
        self._acquire = client.register_script(_ACQUIRE)
        self._renew = client.register_script(_RENEW)
        self._release = client.register_script(_RELEASE_LEASE)
        self._current = client.register_script(_CURRENT)
        self._lease_end = client.register_script(_LEASE_END)

    @property
    def prefix(self) -> str:
        """The prefix of every key this store writes."""
        return self._keys.prefix

    async def check_persistence(self) -> None:
        """Refuse a volatile server now (``ConfigurationError``) unless it was allowed."""
        await self._durability.check()

    def _lease(self, tenant: str, run_id: str) -> str:
        return self._keys.run(tenant, run_id, "lease")

    async def acquire(self, tenant: str, run_id: str, holder: str, ttl: float) -> RunLease:
        """Take the run (raising its fence) or raise ``LeaseHeldError`` naming the holder."""
        ttl_micros = _ttl_micros(ttl)
        await self._durability.ensure()
        with _driver_errors(f"acquiring the lease on run {run_id!r}"):
            result = await self._acquire(
                keys=[self._lease(tenant, run_id), self._keys.run(tenant, run_id, "lease:fence")],
                args=[holder, str(ttl_micros), secrets.token_hex(8)],
            )
        if result[0] == b"held":
            current = _text(result[1])
            raise LeaseHeldError(f"run {run_id!r} is leased to {current!r}", holder=current)
        return RunLease(
            tenant=tenant,
            run_id=run_id,
            holder=holder,
            fence=int(result[1]),
            expires_at=_seconds(result[2]),
            previous_end=_seconds(result[3]) if result[3] else None,
        )

    async def renew(self, lease: RunLease, ttl: float) -> RunLease:
        """Extend a live lease, keeping its fence, or raise ``LeaseLostError``."""
        ttl_micros = _ttl_micros(ttl)
        await self._durability.ensure()
        with _driver_errors(f"renewing the lease on run {lease.run_id!r}"):
            result = await self._renew(
                keys=[self._lease(lease.tenant, lease.run_id)],
                args=[lease.holder, str(lease.fence), str(ttl_micros)],
            )
        if result[0] != b"ok":
            raise LeaseLostError(
                f"lease on run {lease.run_id!r} at fence {lease.fence} lapsed or was taken"
            )
        return RunLease(
            tenant=lease.tenant,
            run_id=lease.run_id,
            holder=lease.holder,
            fence=lease.fence,
            expires_at=_seconds(result[1]),
            previous_end=lease.previous_end,
        )

    async def release(self, lease: RunLease) -> None:
        """Free the run, only for the holder at that fence; the fence stays."""
        await self._durability.ensure()
        with _driver_errors(f"releasing the lease on run {lease.run_id!r}"):
            await self._release(
                keys=[self._lease(lease.tenant, lease.run_id)],
                args=[lease.holder, str(lease.fence)],
            )

    async def current(self, tenant: str, run_id: str) -> RunLease | None:
        """The lease live by the server's clock, else ``None``."""
        await self._durability.ensure()
        with _driver_errors(f"reading the lease on run {run_id!r}"):
            result = await self._current(keys=[self._lease(tenant, run_id)])
        if not result:
            return None
        holder, fence, deadline = result
        return RunLease(
            tenant=tenant,
            run_id=run_id,
            holder=_text(holder),
            fence=int(fence),
            expires_at=_seconds(deadline),
        )

    async def ended_ago(self, tenant: str, run_id: str) -> float | None:
        """Seconds since the run's last lease ended; ``None`` if one is live or none ended."""
        await self._durability.ensure()
        with _driver_errors(f"reading when the lease on run {run_id!r} ended"):
            ago = await self._lease_end(keys=[self._lease(tenant, run_id)])
        return _seconds(ago) if ago else None


# --- transcripts -------------------------------------------------------------------------


class RedisHistoryStore(_FencedRedisStore):
    """A ``HistoryStore`` on Redis: per run, a list of items and a list of chained digests.

    An append pushes only the new items; the tail a dead writer left beyond ``after`` is
    trimmed in the same script that checks the fence and the prefix.
    """

    _store = "history"

    def __init__(self, client: Client, *, prefix: str = DEFAULT_PREFIX) -> None:
        super().__init__(client, prefix=prefix)
        self._append = client.register_script(_APPEND)
        self._fetch = client.register_script(_FETCH)

    def _lists(self, tenant: str, run_id: str) -> list[str]:
        return [
            self._keys.run(tenant, run_id, "history:items"),
            self._keys.run(tenant, run_id, "history:digests"),
        ]

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
        if after is not None and (after.tenant, after.run_id) != (tenant, run_id):
            raise ValueError(
                f"handle names run {after.run_id!r} of {after.tenant!r}, "
                f"not run {run_id!r} of {tenant!r}"
            )
        count, digest = (0, EMPTY_HISTORY_DIGEST) if after is None else (after.count, after.digest)
        items = [bytes(item) for item in encoded]
        digests: list[str] = []
        last = digest
        for item in items:
            last = chain_digest(last, item)
            digests.append(last)
        with _driver_errors(f"appending to the transcript of run {run_id!r}"):
            result = await self._append(
                keys=[
                    *self._lists(tenant, run_id),
                    self._seen(tenant, run_id),
                    self._lease_fence(tenant, run_id),
                ],
                args=[
                    _fence_arg(fence),
                    str(count),
                    digest,
                    EMPTY_HISTORY_DIGEST,
                    str(len(items)),
                    *items,
                    *digests,
                ],
            )
        if result[0] == b"stale":
            raise _stale("append", run_id, fence, result[1])
        if result[0] == b"unavailable":
            raise HistoryUnavailableError(
                f"the transcript of run {run_id!r} no longer has the prefix of {count} "
                f"messages this append follows"
            )
        return HistoryHandle(tenant=tenant, run_id=run_id, count=count + len(items), digest=last)

    async def fetch(self, handle: HistoryHandle) -> list[bytes]:
        """The bytes of the prefix; ``HistoryUnavailableError`` if it does not resolve."""
        if handle.count < 0:
            raise HistoryUnavailableError(f"a transcript prefix of {handle.count} messages")
        with _driver_errors(f"reading the transcript of run {handle.run_id!r}"):
            result = await self._fetch(
                keys=self._lists(handle.tenant, handle.run_id),
                args=[str(handle.count), handle.digest, EMPTY_HISTORY_DIGEST],
            )
        if result[0] != b"ok":
            raise HistoryUnavailableError(
                f"the transcript of run {handle.run_id!r} no longer has the prefix of "
                f"{handle.count} messages the handle names"
            )
        return [bytes(item) for item in result[1]]

    async def forget(self, tenant: str, run_id: str) -> None:
        """Remove the run's transcript; its fence stays."""
        with _driver_errors(f"forgetting the transcript of run {run_id!r}"):
            await self._client.delete(*self._lists(tenant, run_id))


# --- spend -------------------------------------------------------------------------------


class RedisLedger(_FencedRedisStore):
    """A ``Ledger`` on Redis: one hash of micros and tokens per run."""

    _store = "ledger"

    def __init__(self, client: Client, *, prefix: str = DEFAULT_PREFIX) -> None:
        super().__init__(client, prefix=prefix)
        self._charge = client.register_script(_CHARGE)

    async def charge(
        self, tenant: str, run_id: str, micros: int, usage: Usage, *, fence: int | None = None
    ) -> None:
        """Add a model call's cost and usage to the run."""
        with _driver_errors(f"charging run {run_id!r}"):
            result = await self._charge(
                keys=[
                    self._keys.run(tenant, run_id, "ledger"),
                    self._seen(tenant, run_id),
                    self._lease_fence(tenant, run_id),
                ],
                args=[
                    _fence_arg(fence),
                    str(int(micros)),
                    str(int(usage.input_tokens)),
                    str(int(usage.output_tokens)),
                    secrets.token_hex(8),
                ],
            )
        if result[0] == b"stale":
            raise _stale("charge", run_id, fence, result[1])

    async def _totals(self, tenant: str, run_id: str) -> tuple[int, Usage]:
        key = self._keys.run(tenant, run_id, "ledger")
        with _driver_errors(f"reading the spend of run {run_id!r}"):
            micros, input_tokens, output_tokens = await self._client.hmget(
                key, ["micros", "input_tokens", "output_tokens"]
            )
        return int(micros or 0), Usage(
            input_tokens=int(input_tokens or 0), output_tokens=int(output_tokens or 0)
        )

    async def spent(self, tenant: str, run_id: str) -> int:
        """Micros charged to the run so far (0 for an unknown run)."""
        return (await self._totals(tenant, run_id))[0]

    async def usage(self, tenant: str, run_id: str) -> Usage:
        """Tokens charged to the run so far."""
        return (await self._totals(tenant, run_id))[1]


# --- approvals ---------------------------------------------------------------------------


def _calls_to_json(calls: Sequence[ToolCall]) -> str:
    return json.dumps(
        [{"id": c.id, "name": c.name, "arguments": dict(c.arguments)} for c in calls],
        separators=(",", ":"),
    )


def _calls_from_json(raw: bytes) -> tuple[ToolCall, ...]:
    return stored_calls(json.loads(raw))


@decoded("approval request")
def _approval(fields: Mapping[bytes, bytes]) -> ApprovalRequest:
    def text(name: bytes) -> str | None:
        value = fields.get(name)
        return None if value is None else value.decode()

    decided = fields.get(b"decided_at")
    return ApprovalRequest(
        id=fields[b"id"].decode(),
        tenant=fields[b"tenant"].decode(),
        run_id=fields[b"run_id"].decode(),
        calls=_calls_from_json(fields[b"calls"]),
        iteration=int(fields[b"iteration"]),
        status=ApprovalStatus(fields[b"status"].decode()),
        by=text(b"by"),
        note=text(b"note"),
        requested_at=_seconds(fields[b"requested_at"]),
        decided_at=None if decided is None else _seconds(decided),
    )


class RedisApprovalStore(_FencedRedisStore):
    """An ``ApprovalStore`` on Redis; a request lives with its run, found by id through
    ``adk:approval-id:{<id>}``, which also keeps ids unique across the store."""

    _store = "approvals"

    def __init__(self, client: Client, *, prefix: str = DEFAULT_PREFIX) -> None:
        super().__init__(client, prefix=prefix)
        self._request = client.register_script(_REQUEST)
        self._decide = client.register_script(_DECIDE)

    def _request_key(self, tag: str, id: str) -> str:
        return self._keys.tagged(tag, f"approval:{_enc(id)}")

    async def _locate(self, tenant: str, id: str) -> str | None:
        """The run tag holding request ``id`` if it belongs to ``tenant``."""
        raw = await self._client.get(self._keys.approval_index(id))
        if raw is None:
            return None
        tag = _text(raw)
        return tag if unquote(tag.split(":", 1)[0]) == tenant else None

    async def request(
        self,
        tenant: str,
        run_id: str,
        calls: Sequence[ToolCall],
        *,
        iteration: int,
        fence: int | None = None,
        id: str | None = None,
    ) -> ApprovalRequest:
        """Record a pending request (made once under a chosen ``id``)."""
        chosen = id
        tag = _Keys.tag(tenant, run_id)
        fields = [
            "tenant",
            tenant,
            "run_id",
            run_id,
            "calls",
            _calls_to_json(calls),
            "iteration",
            str(int(iteration)),
        ]
        with _driver_errors(f"recording an approval request of run {run_id!r}"):
            while True:
                id = chosen or f"req-{secrets.token_hex(6)}"
                if await self._client.set(self._keys.approval_index(id), tag, nx=True):
                    break
                if chosen is not None:
                    existing = await self.get(tenant, chosen)
                    if existing is None:
                        raise ValueError(f"approval request id {chosen!r} is taken")
                    return existing
            result = await self._request(
                keys=[
                    self._request_key(tag, id),
                    self._seen(tenant, run_id),
                    self._lease_fence(tenant, run_id),
                ],
                args=[_fence_arg(fence), "id", id, *fields],
            )
            if result[0] == b"stale":
                # The id names nothing now; let it go rather than keep a dangling pointer.
                await self._client.delete(self._keys.approval_index(id))
        if result[0] == b"stale":
            raise _stale("approval request", run_id, fence, result[1])
        return _approval(_pairs(result[1]))

    async def decide(
        self, tenant: str, id: str, *, approved: bool, by: str, note: str | None = None
    ) -> ApprovalRequest:
        """Decide a request: the same decision again is a no-op, the other way raises
        ``ValueError``; an id unknown for the tenant raises ``KeyError``."""
        status = ApprovalStatus.approved if approved else ApprovalStatus.denied
        with _driver_errors(f"deciding approval request {id!r}"):
            tag = await self._locate(tenant, id)
            if tag is None:
                raise KeyError(id)
            result = await self._decide(
                keys=[self._request_key(tag, id)],
                args=[status.value, by, "0" if note is None else "1", note or ""],
            )
        if result[0] == b"absent":
            raise KeyError(id)
        request = _approval(_pairs(result[1]))
        if result[0] == b"decided":
            raise ValueError(f"request {id!r} was already {request.status} by {request.by!r}")
        return request

    async def get(self, tenant: str, id: str) -> ApprovalRequest | None:
        """The request, or ``None`` when no request with that id belongs to the tenant."""
        with _driver_errors(f"reading approval request {id!r}"):
            tag = await self._locate(tenant, id)
            if tag is None:
                return None
            fields = await self._client.hgetall(self._request_key(tag, id))
        return _approval({_bytes(k): _bytes(v) for k, v in fields.items()}) if fields else None


# --- opening -----------------------------------------------------------------------------


def _flag(url: str, name: str, raw: str) -> bool:
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ConfigurationError(f"{name} in the Redis store URL must be true or false, got {raw!r}")


def _split_url(url: str) -> tuple[str, dict[str, str]]:
    """The URL for redis-py and the kit's own options, taken out of its query."""
    parts = urlsplit(url)
    kept: list[tuple[str, str]] = []
    options: dict[str, str] = {}
    for name, value in parse_qsl(parts.query, keep_blank_values=True):
        if name in _OTHER_KIT_OPTIONS:
            raise ConfigurationError(
                f"{name!r} is not an option of Redis stores (theirs: {', '.join(_KIT_OPTIONS)})"
            )
        if name in _KIT_OPTIONS:
            if name in options:
                raise ConfigurationError(f"the Redis store URL sets {name!r} twice")
            options[name] = value
        else:
            kept.append((name, value))
    driver_url = urlunsplit(
        (parts.scheme, parts.netloc, parts.path, urlencode(kept), parts.fragment)
    )
    return driver_url, options


def open_redis_stores(url: str) -> Stores:
    """The six Redis stores on one client, as a ``Stores`` bundle; no I/O until first use.

    Options in the query: ``prefix`` (default ``adk:``), ``allow_volatile=true`` (accept a
    server without persistence or with an ``allkeys-*`` eviction policy) and ``keep_last``;
    the rest of the URL goes to ``redis.asyncio.from_url``. ``create_schema()`` and
    ``verify()`` check the server's persistence; ``aclose()`` closes the client.
    """
    driver_url, options = _split_url(url)
    prefix = options.get("prefix", DEFAULT_PREFIX)
    allow_volatile = _flag(url, "allow_volatile", options.get("allow_volatile", "false"))
    keep_last: int | None = None
    if "keep_last" in options:
        try:
            keep_last = int(options["keep_last"])
        except ValueError:
            keep_last = 0
        if keep_last < 1:
            raise ConfigurationError(
                f"keep_last in the Redis store URL must be a whole number of at least 1, "
                f"got {options['keep_last']!r}"
            )
    try:
        # Defaults only: options in the URL win. Without them a server that stops answering
        # would hold a live run for minutes instead of failing its write as unavailable.
        client = aioredis.from_url(driver_url, socket_connect_timeout=5.0, socket_timeout=10.0)
        # Builds a connection object without connecting: an option the driver does not
        # know fails here, as a usage mistake, instead of as a TypeError on first use.
        client.connection_pool.make_connection()  # type: ignore[no-untyped-call]
    except (ValueError, TypeError, RedisError) as exc:
        raise ConfigurationError(f"cannot read the Redis store URL: {exc}") from exc
    # Nothing connects before first use, so a refusal below leaves nothing to close.
    leases = RedisLeaseStore(client, prefix=prefix, allow_volatile=allow_volatile)
    idempotency = RedisIdempotencyStore(client, prefix=prefix, allow_volatile=allow_volatile)
    checkpoints = RedisCheckpointStore(client, prefix=prefix, keep_last=keep_last)

    async def check() -> None:
        await leases.check_persistence()
        await idempotency.check_persistence()

    return Stores(
        checkpoints=checkpoints,
        idempotency=idempotency,
        leases=leases,
        history=RedisHistoryStore(client, prefix=prefix),
        ledger=RedisLedger(client, prefix=prefix),
        approvals=RedisApprovalStore(client, prefix=prefix),
        url=url,
        on_create_schema=check,
        on_verify=check,
        on_close=(client.aclose,),
    )
