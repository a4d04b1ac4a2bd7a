"""``RedisCheckpointStore``: a run's frontier and its step snapshots on Redis."""

from __future__ import annotations

from collections.abc import Sequence
from urllib.parse import unquote

from tesserix_adk.adapters.redis.base import (
    _bytes,
    _fence_arg,
    _fence_of,
    _FencedRedisStore,
    _refuse_damaged_key,
    _stale,
    _text,
)
from tesserix_adk.adapters.redis.connection import Client, _driver_errors
from tesserix_adk.adapters.redis.history import RedisHistoryStore
from tesserix_adk.adapters.redis.keys import DEFAULT_PREFIX, _enc, _glob_escape
from tesserix_adk.adapters.redis.lua import register
from tesserix_adk.errors import CheckpointTooLargeError, ConfigurationError
from tesserix_adk.stores.protocols import HistoryHandle, StoredCheckpoint

__all__ = ["RedisCheckpointStore"]

_EXACT_SCORE = 2**53


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
        self._put, self._put_with_history = register(client, "put", "put_with_history")

    def _data_keys(self, tenant: str, run_id: str) -> list[str]:
        return [
            self._keys.run(tenant, run_id, name)
            for name in ("cp:frontier", "cp:steps", "cp:step-fences", "cp:step-index")
        ]

    async def put(
        self, tenant: str, run_id: str, payload: bytes, *, step: int, fence: int | None = None
    ) -> None:
        """Write a frontier; it becomes ``latest`` and step ``step`` (last write wins)."""
        self._refuse_too_large(run_id, payload)
        keys = [
            *self._data_keys(tenant, run_id),
            self._seen(tenant, run_id),
            self._lease_fence(tenant, run_id),
        ]
        with _driver_errors(f"writing a frontier of run {run_id!r}"):
            result = await self._put(keys=keys, args=self._put_args(payload, step, fence))
        if result[0] == b"stale":
            raise _stale("write", run_id, fence, result[1])
        _refuse_damaged_key(result, run_id)

    async def put_with_history(
        self,
        history: object,
        tenant: str,
        run_id: str,
        payload: bytes,
        *,
        step: int,
        fence: int | None,
        encoded: Sequence[bytes],
        after: HistoryHandle | None,
    ) -> HistoryHandle | None:
        """Append the transcript and put the frontier in ONE script (one round trip; both
        or neither) when ``history`` keeps its keys beside this store's (the same client
        and prefix, so the run's keys share its hash tag); ``None`` when it does not, and
        the caller writes them one after the other."""
        if not (
            isinstance(history, RedisHistoryStore)
            and history._client is self._client
            and history.prefix == self.prefix
        ):
            return None
        self._refuse_too_large(run_id, payload)
        appending = history._appending(tenant, run_id, encoded, after)
        keys = [
            *appending.keys,
            *self._data_keys(tenant, run_id),
            self._seen(tenant, run_id),
            self._lease_fence(tenant, run_id),
        ]
        with _driver_errors(f"writing a frontier and the transcript of run {run_id!r}"):
            result = await self._put_with_history(
                keys=keys, args=[*self._put_args(payload, step, fence), *appending.args]
            )
        if result[0] == b"stale":
            raise _stale(_text(result[1]), run_id, fence, result[2])
        _refuse_damaged_key(result, run_id)
        return appending.answer(result)

    def _put_args(self, payload: bytes, step: int, fence: int | None) -> list[str | bytes]:
        if not -_EXACT_SCORE <= int(step) <= _EXACT_SCORE:
            # The step index scores steps as doubles: past this, Redis refuses the score
            # mid-script, or two steps share one.
            raise ValueError(f"step {step} is outside what the Redis store keeps exactly (2**53)")
        return [
            _fence_arg(fence),
            str(int(step)),
            bytes(payload),
            "" if self.keep_last is None else str(self.keep_last),
        ]

    def _refuse_too_large(self, run_id: str, payload: bytes) -> None:
        if self.max_value_bytes is not None and len(payload) > self.max_value_bytes:
            raise CheckpointTooLargeError(
                f"the frontier of run {run_id!r} is {len(payload)} bytes, over this Redis "
                f"store's max_value_bytes of {self.max_value_bytes}; it was not written"
            )

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
