"""``RedisLedger``: what each run spent, in micros and tokens."""

from __future__ import annotations

import secrets

from tesserix_adk.adapters.redis.base import _fence_arg, _FencedRedisStore, _stale
from tesserix_adk.adapters.redis.connection import Client, _driver_errors
from tesserix_adk.adapters.redis.keys import DEFAULT_PREFIX
from tesserix_adk.adapters.redis.lua import register
from tesserix_adk.messages import Usage

__all__ = ["RedisLedger"]


class RedisLedger(_FencedRedisStore):
    """A ``Ledger`` on Redis: one hash of micros and tokens per run."""

    _store = "ledger"

    def __init__(self, client: Client, *, prefix: str = DEFAULT_PREFIX) -> None:
        super().__init__(client, prefix=prefix)
        (self._charge,) = register(client, "charge")

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

    async def totals(self, tenant: str, run_id: str) -> tuple[int, Usage]:
        """Micros and tokens charged to the run so far, in one request (``LedgerTotals``)."""
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
        return (await self.totals(tenant, run_id))[0]

    async def usage(self, tenant: str, run_id: str) -> Usage:
        """Tokens charged to the run so far."""
        return (await self.totals(tenant, run_id))[1]
