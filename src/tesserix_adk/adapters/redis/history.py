"""``RedisHistoryStore``: a run's transcript, with a chained digest of each prefix."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tesserix_adk.adapters.redis.base import (
    _fence_arg,
    _FencedRedisStore,
    _refuse_damaged_key,
    _stale,
)
from tesserix_adk.adapters.redis.connection import Client, _driver_errors
from tesserix_adk.adapters.redis.keys import DEFAULT_PREFIX
from tesserix_adk.adapters.redis.lua import register
from tesserix_adk.errors import HistoryUnavailableError
from tesserix_adk.stores._common import chained_digests, prefix_of
from tesserix_adk.stores.protocols import EMPTY_HISTORY_DIGEST, HistoryHandle

__all__ = ["Appending", "RedisHistoryStore"]


@dataclass(frozen=True, slots=True)
class Appending:
    """One append as a script sends it: the transcript's keys (items, digests, its seen
    fence) and the arguments after the fence; ``handle`` once it is written."""

    keys: list[str]
    args: list[str | bytes]
    handle: HistoryHandle
    after: int

    def answer(self, result: Any) -> HistoryHandle:
        """The handle, or ``HistoryUnavailableError`` if the script found the prefix gone."""
        if result[0] == b"unavailable":
            raise HistoryUnavailableError(
                f"the transcript of run {self.handle.run_id!r} no longer has the prefix of "
                f"{self.after} messages this append follows"
            )
        return self.handle


class RedisHistoryStore(_FencedRedisStore):
    """A ``HistoryStore`` on Redis: per run, a list of items and a list of chained digests.

    An append pushes only the new items; the tail a dead writer left beyond ``after`` is
    trimmed in the same script that checks the fence and the prefix.
    """

    _store = "history"

    def __init__(self, client: Client, *, prefix: str = DEFAULT_PREFIX) -> None:
        super().__init__(client, prefix=prefix)
        self._append, self._fetch = register(client, "append", "fetch")

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
        pending = self._appending(tenant, run_id, encoded, after)
        with _driver_errors(f"appending to the transcript of run {run_id!r}"):
            result = await self._append(
                keys=[*pending.keys, self._lease_fence(tenant, run_id)],
                args=[_fence_arg(fence), *pending.args],
            )
        if result[0] == b"stale":
            raise _stale("append", run_id, fence, result[1])
        _refuse_damaged_key(result, run_id)
        return pending.answer(result)

    def _appending(
        self,
        tenant: str,
        run_id: str,
        encoded: Sequence[bytes],
        after: HistoryHandle | None,
    ) -> Appending:
        """An append's keys and arguments (``append.lua``, after its fence), and what its
        reply comes to; ``put_with_history`` sends the same in its own script."""
        count, digest = prefix_of(tenant, run_id, after)
        items = [bytes(item) for item in encoded]
        digests = chained_digests(digest, items)
        last = digests[-1] if digests else digest
        return Appending(
            keys=[*self._lists(tenant, run_id), self._seen(tenant, run_id)],
            args=[str(count), digest, EMPTY_HISTORY_DIGEST, str(len(items)), *items, *digests],
            handle=HistoryHandle(
                tenant=tenant, run_id=run_id, count=count + len(items), digest=last
            ),
            after=count,
        )

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
