"""Leases: ``LeasePolicy`` and ``Leaseholder``, which keeps one run's lease alive.

The store's clock decides expiry; the holder keeps its own, more pessimistic deadline:
``time.monotonic()`` when the acquire or renew was *sent*, plus the ttl. Past that deadline
the holder can no longer know it holds the run, so the run stops before its next durable
write (``check()`` raises ``LeaseLostError``), whatever the store would say.

Closing never hangs and never leaves a lease renewed for ever: the renewal loop stops on a
flag it checks after every wait and every renewal (a driver may lose a cancellation, as
redis-py on Python 3.11 does), and every wait in ``close()`` is bounded by
``close_timeout``. A release that does not answer in time is abandoned: the lease then
lapses by the store's clock. A cancelled caller still gets its ``CancelledError``, after
the shielded cleanup.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType

from tesserix_adk.checkpoint.redaction import Masked
from tesserix_adk.errors import ConfigurationError, LeaseLostError
from tesserix_adk.stores.protocols import LeaseStore, RunLease

__all__ = [
    "MAX_TTL",
    "NEVER_RAN_MARGIN",
    "LeasePolicy",
    "Leaseholder",
    "never_ran_wait",
    "previous_end_ago",
]

_log = logging.getLogger("tesserix_adk.leases")

MAX_TTL = 365 * 86_400.0
"""The longest lease ttl (seconds): a year, an expiry every store can hold (PostgreSQL's
timestamps end in the year 294276; a ttl of 1e300 seconds would not be stored)."""

# Upper bound, in seconds, of each wait in Leaseholder.close() (the renewal loop, the release).
_CLOSE_TIMEOUT = 5.0


NEVER_RAN_MARGIN = 10.0
"""Seconds past the end of a run's last lease before a call claimed under it may be said
never to have run. A claimant checks its lease (by its own, earlier deadline) immediately
before it sends a call, so a call it sent left before its lease ended; the margin covers
that call still being on its way (a connection being opened, a request in a socket) and
the small drift between the claimant's clock and the store's. It cannot cover a tool that
stalls for longer inside itself: only a downstream system that checks the fence does."""


def never_ran_wait(ended_ago: float | None, margin: float = NEVER_RAN_MARGIN) -> float:
    """Seconds still to wait before a claim of the run may be recorded as never run, given
    ``LeaseStore.ended_ago`` (``None``: no lease ever ended, so no claimant can be
    sending; a live lease is refused before this is asked)."""
    if ended_ago is None:
        return 0.0
    return max(0.0, margin - ended_ago)


def previous_end_ago(lease: RunLease, ttl: float) -> float | None:
    """Seconds of store time between the end of the run's lease before ``lease`` and the
    moment ``lease`` (of ``ttl`` seconds) was granted or last renewed; ``None`` when no
    lease ended before it."""
    if lease.previous_end is None:
        return None
    return max(0.0, lease.expires_at - ttl - lease.previous_end)


@dataclass(frozen=True, slots=True, kw_only=True)
class LeasePolicy:
    """How long a lease lasts and when it is renewed (seconds).

    The holder renews once less than ``renew_within`` remains, i.e. every
    ``ttl - renew_within`` seconds.
    """

    ttl: float = 30.0
    renew_within: float = 10.0

    def __post_init__(self) -> None:
        if not 0 < self.renew_within < self.ttl <= MAX_TTL:
            raise ConfigurationError(
                f"LeasePolicy needs {MAX_TTL:g} >= ttl > renew_within > 0 (seconds)"
            )

    @property
    def renew_every(self) -> float:
        """Seconds between renewals."""
        return self.ttl - self.renew_within


async def _hand_back(store: LeaseStore, tenant: str, run_id: str, holder: str) -> None:
    """Release the run's lease if ``holder`` (unique to one attempt) holds it."""
    try:
        current = await store.current(tenant, run_id)
        if current is not None and current.holder == holder:
            await store.release(current)
    except Exception as exc:  # it lapses by the store's clock
        _log.warning("handing back the lease of run %s failed: %r", run_id, Masked(exc))


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
        close_timeout: float | None = None,
    ) -> None:
        self.store = store
        self.lease = lease
        self.policy = policy or LeasePolicy()
        if close_timeout is not None and not close_timeout > 0:
            raise ConfigurationError(f"close_timeout must be > 0 seconds, got {close_timeout!r}")
        # Past this a release is not worth waiting for: the store's clock frees the run.
        self.close_timeout = (
            min(_CLOSE_TIMEOUT, self.policy.renew_within)
            if close_timeout is None
            else close_timeout
        )
        self._monotonic = monotonic
        self._sent_at = monotonic() if sent_at is None else sent_at
        # When the grant's reply came back: later than the store's moment of granting, so
        # store time elapsed since then is never overstated from it.
        self._granted_at = monotonic()
        self._lost: BaseException | None = None
        self._task: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()
        # Tasks close() stopped waiting for; held so they are not collected mid-flight.
        self._abandoned: set[asyncio.Future[None]] = set()
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
        try:
            lease = await store.acquire(tenant, run_id, holder, policy.ttl)
        except asyncio.CancelledError:
            # The store may have granted it with the reply still on its way: hand back what
            # this holder may hold, or the next attempt waits out a whole ttl for nobody.
            cleanup = asyncio.ensure_future(_hand_back(store, tenant, run_id, holder))
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(asyncio.shield(cleanup), _CLOSE_TIMEOUT)
            raise
        return cls(store, lease, policy, sent_at=sent_at)

    @property
    def fence(self) -> int:
        """The fence every durable write of this holder carries."""
        return self.lease.fence

    @property
    def deadline(self) -> float:
        """Monotonic time after which this holder no longer trusts its lease."""
        return self._sent_at + self.policy.ttl

    def since_previous_end(self) -> float | None:
        """Seconds of store time, at least, since the run's lease before this one ended
        (``None``: none ended before it). What ``never_ran_wait`` is given before a call
        claimed under that lease is said never to have run."""
        at_grant = previous_end_ago(self.lease, self.policy.ttl)
        if at_grant is None:
            return None
        return at_grant + max(0.0, self._monotonic() - self._granted_at)

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
        self._granted_at = self._monotonic()
        self.renewals += 1

    async def _renew_loop(self) -> None:
        while not self._stopping.is_set():
            wait = self._sent_at + self.policy.renew_every - self._monotonic()
            if await self._stopped_within(wait):
                return
            try:
                await self.renew()
            except LeaseLostError:
                return
            except Exception as exc:  # a store blip: try again until the deadline says no
                _log.warning("renewing lease on run %s failed: %r", self.lease.run_id, Masked(exc))
                if self._monotonic() >= self.deadline:
                    self._lost = exc
                    return
                if await self._stopped_within(min(1.0, self.policy.renew_within / 4)):
                    return

    async def _stopped_within(self, seconds: float) -> bool:
        """Wait up to ``seconds``; whether ``close()`` asked the loop to stop."""
        if seconds > 0 and not self._stopping.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), seconds)
        return self._stopping.is_set()

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
        """Stop renewing and hand the lease back; shielded from cancellation, each wait
        bounded by ``close_timeout``. A cancelled caller's ``CancelledError`` is re-raised
        once the cleanup is done."""
        self._stopping.set()
        cleanup = asyncio.ensure_future(self._stop_and_release())
        try:
            await asyncio.shield(cleanup)
        except asyncio.CancelledError:
            # The cleanup is bounded; finish it, then let the cancellation through.
            while not cleanup.done():
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.wait({cleanup})
            raise

    async def _stop_and_release(self) -> None:
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()  # also a signal, but one a driver may lose: the flag is the one
            if not await self._settled(task):
                _log.warning(
                    "the lease renewal of run %s did not stop within %g s; it stops after "
                    "its current call",
                    self.lease.run_id,
                    self.close_timeout,
                )
        if self._lost is not None:
            return
        release = asyncio.ensure_future(self.store.release(self.lease))
        if not await self._settled(release):
            release.cancel()
            _log.warning(
                "releasing lease on run %s took over %g s; it lapses by the store's clock",
                self.lease.run_id,
                self.close_timeout,
            )
            return
        exc = None if release.cancelled() else release.exception()
        if exc is not None:
            _log.warning("releasing lease on run %s failed: %r", self.lease.run_id, Masked(exc))

    async def _settled(self, future: asyncio.Future[None]) -> bool:
        """Whether ``future`` ends within ``close_timeout``; if not, it is kept (and its
        outcome retrieved whenever it comes) but no longer waited for."""
        done, _ = await asyncio.wait({future}, timeout=self.close_timeout)
        if future in done:
            if not future.cancelled():
                future.exception()  # retrieved: a renewal's failure was logged already
            return True
        self._abandoned.add(future)
        future.add_done_callback(self._forget)
        return False

    def _forget(self, future: asyncio.Future[None]) -> None:
        self._abandoned.discard(future)
        if not future.cancelled():
            future.exception()
