"""``RedisLeaseStore``: run leases and their fences on Redis."""

from __future__ import annotations

import secrets

from tesserix_adk.adapters.redis.base import _seconds, _text, _ttl_micros
from tesserix_adk.adapters.redis.connection import Client, _driver_errors, _require_bytes
from tesserix_adk.adapters.redis.durability import _Durability
from tesserix_adk.adapters.redis.keys import DEFAULT_PREFIX, _Keys
from tesserix_adk.adapters.redis.lua import register
from tesserix_adk.errors import LeaseHeldError, LeaseLostError
from tesserix_adk.stores.protocols import RunLease

__all__ = ["RedisLeaseStore"]


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
        self._acquire, self._renew, self._release, self._current, self._lease_end = register(
            client, "acquire", "renew", "release_lease", "current", "lease_end"
        )

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
