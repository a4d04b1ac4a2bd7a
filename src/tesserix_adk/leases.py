"""Leases: ``LeasePolicy`` and ``Leaseholder``, which keeps one run's lease alive.

The store's clock decides expiry; the holder keeps its own, more pessimistic deadline:
``time.monotonic()`` when the acquire or renew was *sent*, plus the ttl. Past that deadline
the holder can no longer know it holds the run, so the run stops before its next durable
write (``check()`` raises ``LeaseLostError``), whatever the store would say.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType

from tesserix_adk.errors import ConfigurationError, LeaseLostError
from tesserix_adk.stores.protocols import LeaseStore, RunLease

__all__ = ["LeasePolicy", "Leaseholder"]

_log = logging.getLogger("tesserix_adk.leases")


@dataclass(frozen=True, slots=True, kw_only=True)
class LeasePolicy:
    """How long a lease lasts and when it is renewed (seconds).

    The holder renews once less than ``renew_within`` remains, i.e. every
    ``ttl - renew_within`` seconds.
    """

    ttl: float = 30.0
    renew_within: float = 10.0

    def __post_init__(self) -> None:
        if self.ttl <= 0 or not 0 < self.renew_within < self.ttl:
            raise ConfigurationError("LeasePolicy needs ttl > renew_within > 0")

    @property
    def renew_every(self) -> float:
        """Seconds between renewals."""
        return self.ttl - self.renew_within


class Leaseholder:
    """Holds a lease for the length of an ``async with`` block.

    Renews in the background, releases on exit (also on error and cancellation, shielded)
    and, once it can no longer be sure it holds the run, makes ``check()`` raise.
    """

    def __init__(
        self,
        store: LeaseStore,
        lease: RunLease,
        policy: LeasePolicy | None = None,
        *,
        sent_at: float | None = None,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.lease = lease
        self.policy = policy or LeasePolicy()
        self._monotonic = monotonic
        self._sent_at = monotonic() if sent_at is None else sent_at
        self._lost: BaseException | None = None
        self._task: asyncio.Task[None] | None = None
        self.renewals = 0

    @classmethod
    async def acquire(
        cls,
        store: LeaseStore,
        tenant: str,
        run_id: str,
        holder: str,
        policy: LeasePolicy | None = None,
    ) -> Leaseholder:
        """Take the run's lease (``LeaseHeldError`` if another holder has it)."""
        policy = policy or LeasePolicy()
        sent_at = time.monotonic()
        lease = await store.acquire(tenant, run_id, holder, policy.ttl)
        return cls(store, lease, policy, sent_at=sent_at)

    @property
    def fence(self) -> int:
        """The fence every durable write of this holder carries."""
        return self.lease.fence

    @property
    def deadline(self) -> float:
        """Monotonic time after which this holder no longer trusts its lease."""
        return self._sent_at + self.policy.ttl

    def check(self) -> None:
        """Raise ``LeaseLostError`` if the lease may have lapsed or was taken."""
        if self._lost is not None:
            raise LeaseLostError(
                f"lease on run {self.lease.run_id!r} (fence {self.fence}) was lost: {self._lost}"
            )
        if self._monotonic() >= self.deadline:
            raise LeaseLostError(
                f"lease on run {self.lease.run_id!r} (fence {self.fence}) lapsed before it "
                "could be renewed"
            )

    async def renew(self) -> None:
        """Renew once now; on ``LeaseLostError`` the holder is marked lost and it re-raises."""
        sent_at = self._monotonic()
        try:
            self.lease = await self.store.renew(self.lease, self.policy.ttl)
        except LeaseLostError as exc:
            self._lost = exc
            raise
        self._sent_at = sent_at
        self.renewals += 1

    async def _renew_loop(self) -> None:
        while True:
            wait = self._sent_at + self.policy.renew_every - self._monotonic()
            await asyncio.sleep(max(wait, 0.0))
            try:
                await self.renew()
            except LeaseLostError:
                return
            except Exception as exc:  # a store blip: try again until the deadline says no
                _log.warning("renewing lease on run %s failed: %r", self.lease.run_id, exc)
                if self._monotonic() >= self.deadline:
                    self._lost = exc
                    return
                await asyncio.sleep(min(1.0, self.policy.renew_within / 4))

    async def __aenter__(self) -> Leaseholder:
        self._task = asyncio.create_task(self._renew_loop(), name=f"lease:{self.lease.run_id}")
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        """Stop renewing and hand the lease back, shielded from cancellation."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(_wait(self._task))
            self._task = None
        if self._lost is None:
            release = asyncio.ensure_future(self.store.release(self.lease))
            try:
                await asyncio.shield(release)
            except asyncio.CancelledError:
                # Let the release finish, then let the cancellation through.
                with contextlib.suppress(Exception):
                    await release
                raise
            except Exception as exc:
                _log.warning("releasing lease on run %s failed: %r", self.lease.run_id, exc)


async def _wait(task: asyncio.Task[None]) -> None:
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
