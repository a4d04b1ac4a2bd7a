"""What every fenced Redis store shares: its client, its keys, ``seal``, and how replies
and arguments are read and written."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tesserix_adk.adapters.redis.connection import Client, _driver_errors, _require_bytes
from tesserix_adk.adapters.redis.keys import DEFAULT_PREFIX, _Keys
from tesserix_adk.adapters.redis.lua import register
from tesserix_adk.errors import CheckpointCorruptError, StaleFenceError
from tesserix_adk.stores._common import positive_ttl, stale_fence, unsealable


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
    return max(1, round(positive_ttl(ttl) * 1_000_000))


def _pairs(flat: Sequence[Any]) -> dict[bytes, bytes]:
    """A Lua ``HGETALL`` reply (flat list) as a mapping."""
    return {bytes(flat[i]): bytes(flat[i + 1]) for i in range(0, len(flat), 2)}


def _refuse_damaged_key(result: Sequence[Any], run_id: str) -> None:
    """``CheckpointCorruptError`` if a script answered ``{'damaged', key}``: a key of the
    run holds another type than the kit writes there, and the script wrote nothing."""
    if result and result[0] == b"damaged":
        raise CheckpointCorruptError(
            f"the key {_text(result[1])!r} of run {run_id!r} holds another type than the "
            "kit writes there; nothing was written"
        )


def _stale(what: str, run_id: str, fence: int | None, seen: bytes | str) -> StaleFenceError:
    return stale_fence(what, run_id, fence, int(seen))


class _FencedRedisStore:
    """What every fenced Redis store shares: its client, keys and ``seal``."""

    _store: str = ""

    def __init__(self, client: Client, *, prefix: str = DEFAULT_PREFIX) -> None:
        _require_bytes(client)
        self._client = client
        self._keys = _Keys(prefix)
        (self._seal_script,) = register(client, "seal")

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
            raise unsealable(run_id, fence, int(result[1]))
