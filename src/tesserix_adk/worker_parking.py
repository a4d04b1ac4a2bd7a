"""How a worker parks a run, and how one take of it ends: ``Carried``, ``Backoff`` and
``Parking``, the part of ``Worker`` that parks a run and decides when a parked or
waiting run is looked at again."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING

from tesserix_adk.checkpoint.redaction import Masked
from tesserix_adk.errors import (
    AdkError,
    CheckpointFormatError,
    ConfigurationError,
    IndeterminateToolCallError,
    LeaseError,
    LeaseHeldError,
    LeaseLostError,
    ResumeConflictError,
    RevisionMismatchError,
    StaleFenceError,
)
from tesserix_adk.run.attempt import new_holder
from tesserix_adk.run.holding import held_to_decide
from tesserix_adk.run.invoking import error_text
from tesserix_adk.stores.protocols import (
    RecordStatus,
    WakesParked,
    WorkIndex,
    WorkItem,
    WorkState,
)
from tesserix_adk.stores.rows import listed_past_damage

if TYPE_CHECKING:
    from tesserix_adk.agent import Agent
    from tesserix_adk.run.runner import AgentRunner
    from tesserix_adk.telemetry import Telemetry

__all__ = ["NOT_TAKEN", "Backoff", "Carried", "Parking", "parked_for", "parked_reason"]

_log = logging.getLogger("tesserix_adk.worker")

# Found held as the take began (not lost while carried): the take did not happen.
NOT_TAKEN = (ResumeConflictError, LeaseHeldError)


@dataclass(frozen=True, slots=True, kw_only=True)
class Backoff:
    """Delays between tries of a run that failed for a passing reason: doubling from
    ``base`` up to ``cap`` seconds, half of it random, so workers do not retry in step."""

    base: float = 1.0
    cap: float = 60.0

    def __post_init__(self) -> None:
        # A zero delay retries in a tight loop; the attempts would never be counted either.
        if not (0 < self.base <= self.cap < float("inf")):
            raise ConfigurationError(
                f"Backoff needs 0 < base <= cap (finite seconds), got base={self.base!r}, "
                f"cap={self.cap!r}"
            )

    def delay(self, attempts: int, rng: random.Random) -> float:
        """Seconds before try number ``attempts + 1``."""
        full = min(self.cap, self.base * 2.0 ** max(0, attempts))
        return full / 2 + rng.uniform(0.0, full / 2)


class Carried(StrEnum):
    """How one take of a run ended, for the worker's log and its tests."""

    finished = "finished"
    waiting = "waiting"  # on a person's decision
    parked = "parked"
    retry = "retry"
    elsewhere = "elsewhere"  # another worker has it, or another run a call it needs
    stopped = "stopped"  # drained at a boundary


def _as_polled(polled: WorkItem, now: WorkItem | None) -> bool:
    """Whether the entry ``now`` is still what a poll read as ``polled``."""
    if now is None:
        return False
    seen = (polled.state, polled.attempts, polled.not_before, polled.since)
    return (now.state, now.attempts, now.not_before, now.since) == seen


def parked_reason(exc: BaseException) -> str:
    """How a worker names a run it parks for an error: the error's type, then the error.
    Releases before this one wrote it so too, which ``parked_for`` relies on."""
    return error_text(exc)


def parked_for(item: WorkItem, error: type[BaseException]) -> bool:
    """Whether a worker parked ``item`` for an ``error`` of that type (``parked_reason``)."""
    reason = item.reason or ""
    return item.state is WorkState.parked and reason.startswith(f"{error.__name__}:")


def _where(item: WorkItem) -> tuple[str, str]:
    return item.tenant, item.run_id


class Parking:
    """Parking a run, for ``Worker``: what the worker holds that parking reads."""

    runner: AgentRunner
    work: WorkIndex
    telemetry: Telemetry | None
    backoff: Backoff
    max_attempts: int
    _rng: random.Random
    _later: dict[tuple[str, str], float]
    agents: dict[str, Agent]

    async def _wake_parked(self, *, formats: bool) -> None:
        """Wake the runs of this worker's agents that another worker parked but this one
        may carry: pinned to the revision this worker serves, parked by a worker of another
        revision (``RevisionMismatchError``: in a rolling deploy, old and new workers poll
        side by side, and nothing else would look at such a run again); and, with
        ``formats`` (once, as the worker starts), parked for a payload of a format an
        earlier release could not read (``CheckpointFormatError``): one this kit cannot
        read either is parked again, and stays parked until the next worker starts. A
        store that cannot be read here is met again by the first poll, which says why."""
        try:
            # Past damaged entries where the index can (one hand-edited row of any tenant
            # must not keep every other parked run asleep); the poll names them.
            listing = await listed_past_damage(self.work, None, WorkState.parked)
            parked = [i for i in listing.items if i.state is WorkState.parked]
        except Exception as exc:
            _log.warning("could not look at the parked runs: %r", Masked(exc))
            return
        for item in parked:
            agent = self.agents.get(item.agent)
            if agent is None:
                continue
            try:
                if formats and parked_for(item, CheckpointFormatError):
                    why = "parked for a format"
                elif parked_for(item, RevisionMismatchError) and await self._pinned_to(item, agent):
                    why = f"parked by a worker of another revision; it is {agent.revision}'s"
                else:
                    continue
                _log.info("run %s/%s: %s; looking again", *_where(item), Masked(why))
                await self._unpark_counting(item)
            except Exception as exc:
                _log.warning("could not look at parked run %s/%s: %r", *_where(item), Masked(exc))

    async def _unpark_counting(self, item: WorkItem) -> None:
        """Unpark ``item`` with its count going on, one more: a run old and new workers hand
        back and forth meets ``max_attempts``. In one write where the index offers it
        (``WakesParked``: an entry changed since it was read is left to the next sweep);
        else unparked (which starts the count again), then counted, and a failure between
        the two loses the count."""
        where = (item.tenant, item.run_id)
        if isinstance(self.work, WakesParked):
            await self.work.wake(
                *where, agent=item.agent, attempts=item.attempts, reason=item.reason
            )
            return
        await self.work.want(*where, agent=item.agent, state=WorkState.wanted)
        await self.work.want(
            *where, agent=item.agent, state=WorkState.wanted, count=item.attempts + 1
        )

    async def _pinned_to(self, item: WorkItem, agent: Agent) -> bool:
        """Whether the run's frontier is pinned to ``agent``'s revision."""
        assert self.runner.checkpoints is not None
        cp = await self.runner.checkpoints.latest(item.tenant, item.run_id)
        return cp is not None and cp.agent_revision == agent.revision

    async def _park_too_many(self, item: WorkItem) -> Carried:
        """Park a run taken ``max_attempts`` times: each take counted itself as it began, so
        takes that never came back (the process carrying it died in it, again and again)
        are counted too. Decided holding the run as a take would, on the entry as it stands
        then: the poll's view may be late, and a take may have counted itself since (not
        yet holding the run), moved it on, or an operator woken it; each leaves the entry
        changed, and the run is looked at again later instead. A run that finished since
        is not parked."""
        runner = self.runner
        assert runner.checkpoints is not None
        try:
            async with held_to_decide(
                runner.idempotency,
                runner.leases,
                runner.lease_policy,
                tenant=item.tenant,
                run_id=item.run_id,
                holder=new_holder(runner.worker),
                claim_ttl=runner.resume_claim_ttl,
            ):
                with contextlib.suppress(AdkError):  # unreadable: parked, as it would be
                    cp = await runner.checkpoints.latest(item.tenant, item.run_id)
                    if cp is not None and cp.status.finished:
                        await self.work.done(item.tenant, item.run_id)
                        return Carried.finished
                if not _as_polled(item, await self.work.entry(item.tenant, item.run_id)):
                    return self._held_elsewhere(item, "its entry changed since the poll")
                return await self._park_as(
                    item,
                    f"taken {item.attempts} times without finishing: the process carrying it "
                    "died, or lost it, each time",
                    "too_many_attempts",
                )
        except NOT_TAKEN as exc:
            return self._held_elsewhere(item, exc)
        except Exception as exc:  # the store's trouble: the run is looked at again later
            _log.warning("run %s/%s: could not be held to park it: %r", *_where(item), Masked(exc))
            return self._held_elsewhere(item, exc)

    def _held_elsewhere(self, item: WorkItem, exc: Exception | str) -> Carried:
        """Look at the run again after a while, not at the next poll."""
        hold = self._rng.uniform(0.5, 1.0) * self.runner.lease_policy.ttl
        self._later[(item.tenant, item.run_id)] = asyncio.get_running_loop().time() + hold
        _log.info(
            "run %s/%s: %s (%s); looking again in %.1f s",
            item.tenant,
            item.run_id,
            _why_later(exc),
            exc,
            hold,
        )
        return Carried.elsewhere

    async def _unless_settled_meanwhile(
        self, item: WorkItem, exc: IndeterminateToolCallError
    ) -> None:
        """Wake the run again if an operator settled every call it was parked for between
        the runner letting it go and the park: the operator's wake-up came first and the
        park overwrote it. (One that comes after the park unparks it itself.)"""
        keys = {c.key for c in exc.calls}
        if not keys or None in keys:
            return  # a call with no record is settled by no record: nothing to look at
        if item.attempts + 1 >= self.max_attempts:
            return  # woken often enough: should a resume still refuse, it stays parked
        try:
            found = await self.runner.idempotency.lookup(
                sorted(k for k in keys if k is not None), tenant=item.tenant
            )
            if len(found) < len(keys) or any(
                r.status is RecordStatus.in_flight for r in found.values()
            ):
                return
            _log.info(
                "run %s/%s: its calls were settled while it was being parked; waking it",
                item.tenant,
                item.run_id,
            )
            # After a delay, and counted (as every take is): should planning still refuse a
            # run whose records all look settled, this wakes it a bounded number of times.
            # (Without a count, as an operator's wake is: one with a count never unparks.)
            await self.work.want(
                item.tenant,
                item.run_id,
                agent=item.agent,
                delay=self.backoff.delay(item.attempts, self._rng),
                reason="its calls were settled while it was being parked",
            )
        except Exception as exc2:  # it stays parked: an operator's next action wakes it
            _log.warning(
                "run %s/%s: could not look again: %r", item.tenant, item.run_id, Masked(exc2)
            )

    async def _park(self, item: WorkItem, reason: str) -> Carried:
        return await self._park_as(item, reason, "parked")

    async def _park_as(self, item: WorkItem, reason: str, why: str) -> Carried:
        """Park the run; ``why`` (an error's type name) is what the metric tells apart."""
        reason = self.runner.redactor.text(reason)
        _log.warning("run %s/%s: parked: %s", item.tenant, item.run_id, Masked(reason))
        try:
            await self.work.park(item.tenant, item.run_id, agent=item.agent, reason=reason)
        except Exception as exc:  # it is still due: parked next time round
            _log.warning(
                "run %s/%s: could not be parked: %r", item.tenant, item.run_id, Masked(exc)
            )
            return Carried.parked
        if self.telemetry is not None:
            self.telemetry.parked(item.agent, why)
        return Carried.parked


def _why_later(exc: Exception | str) -> str:
    """What the worker's line says of a run it looks at again later: another holder only
    where one is known to exist (the store failing to answer is not one)."""
    if isinstance(exc, (str, *NOT_TAKEN)):
        return "held elsewhere"
    if isinstance(exc, StaleFenceError):
        return "taken over by a newer holder"
    if isinstance(exc, LeaseLostError):
        return "its lease was lost"
    if isinstance(exc, LeaseError):
        return "its lease could not be held"
    return "the store failed"
