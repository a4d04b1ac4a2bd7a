"""``Worker``: one process that carries many runs, recovering the ones whose holder died.

It asks the work index for runs that want a worker — decided approvals first, then runs
whose lease lapsed before they finished, then submitted runs — and takes each through the
runner's own path (resume claim, lease, seal, plan), so two workers never carry one run and
an entry that went stale costs a look, never a duplicate. What must not carry on (a call in
doubt no reconciler settled, a diverged or changed run, an unreadable frontier) is parked
once with its reason and left for an operator; what failed for a passing reason is tried
again later, backing off with jitter. ``drain()`` (SIGTERM) takes nothing new and stops
every run at its next boundary, releasing its lease and resume claim, so another worker
takes it at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import functools
import logging
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING

from tesserix_adk.agent import Agent
from tesserix_adk.checkpoint.payload.submission import decode_submission
from tesserix_adk.errors import (
    AdkError,
    CarriedByWorkflowError,
    CheckpointCorruptError,
    CheckpointFormatError,
    CheckpointTooLargeError,
    ConfigurationError,
    DivergedRunError,
    HistoryUnavailableError,
    IndeterminateToolCallError,
    LeaseError,
    LeaseHeldError,
    NoCheckpointError,
    ReplayNotResumableError,
    ResumeConflictError,
    RevisionMismatchError,
    RunFailedError,
    RunStartedError,
    RunStoppedError,
    SchemaMismatchError,
    StaleFenceError,
    StorePermissionError,
)
from tesserix_adk.run.attempt import new_holder
from tesserix_adk.run.holding import held_to_decide
from tesserix_adk.run.result import Run, RunStatus
from tesserix_adk.run.runner import AgentRunner
from tesserix_adk.stores.protocols import RecordStatus, WorkIndex, WorkItem, WorkState
from tesserix_adk.worker_progress import TakeProgress

if TYPE_CHECKING:
    from tesserix_adk.telemetry import Telemetry

__all__ = ["Backoff", "Carried", "Worker"]

_log = logging.getLogger("tesserix_adk.worker")

# Errors after which carrying the run on again would only fail the same way, or guess.
_PARK = (
    IndeterminateToolCallError,
    DivergedRunError,
    RevisionMismatchError,
    HistoryUnavailableError,
    CheckpointFormatError,
    CheckpointCorruptError,
    CheckpointTooLargeError,
    RunFailedError,
    ReplayNotResumableError,
    ConfigurationError,
)
# The store's own trouble, not the run's: the worker stops instead of parking the run.
_STORE_WIDE = (SchemaMismatchError, StorePermissionError)
# Seconds the store's own check may take, asked whose such an error is.
_CHECK_TIMEOUT = 10.0


class _Whose(enum.Enum):
    """Whose a schema or permission error is (``Worker._whose``)."""

    store = "store"
    run = "run"
    unknown = "unknown"


# Someone else carries the run now, or will: nothing to record.
_ELSEWHERE = (ResumeConflictError, LeaseError, StaleFenceError)
# Found held as the take began (not lost while carried): the take did not happen.
_NOT_TAKEN = (ResumeConflictError, LeaseHeldError)


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


class Worker:
    """Carries the runs a work index says want a worker, ``concurrency`` at a time."""

    def __init__(
        self,
        runner: AgentRunner,
        agents: Sequence[Agent] | Mapping[str, Agent],
        *,
        concurrency: int = 8,
        poll_interval: float = 0.5,
        backoff: Backoff | None = None,
        max_attempts: int = 20,
        exit_when_idle: bool = False,
        drain_timeout: float = 30.0,
        rng: random.Random | None = None,
        telemetry: Telemetry | None = None,
    ) -> None:
        if runner.work is None:
            raise ConfigurationError(
                "a worker needs a work index: build the runner with work=... (from_stores "
                "does, on every backend that keeps one)"
            )
        if runner.checkpoints is None:
            raise ConfigurationError("a worker needs a Checkpointer (checkpoints=...)")
        if concurrency < 1:
            raise ConfigurationError(f"concurrency must be at least 1, got {concurrency}")
        self.runner = runner
        # Spans of the runs it carries (the runner's own telemetry, if it has none), parked
        # runs and lease takeovers.
        self.telemetry = telemetry
        if telemetry is not None and runner.telemetry is None:
            runner.telemetry = telemetry
        if runner.leases is not None:
            # A worker killed with SIGKILL strands its runs for a lease ttl, no longer: its
            # resume claims lapse with its leases, not after the CLI's five minutes.
            runner.resume_claim_ttl = min(runner.resume_claim_ttl, runner.lease_policy.ttl)
        self.work: WorkIndex = runner.work
        named = agents if isinstance(agents, Mapping) else {a.name: a for a in agents}
        if not named:
            raise ConfigurationError("a worker needs at least one agent to carry runs of")
        self.agents: dict[str, Agent] = dict(named)
        self.concurrency = concurrency
        self.poll_interval = poll_interval
        self.backoff = backoff or Backoff()
        self.max_attempts = max_attempts
        self.exit_when_idle = exit_when_idle
        self.drain_timeout = drain_timeout
        self._rng = rng or random.Random()
        self._draining = asyncio.Event()
        # The store's own trouble (a schema not this kit's, a grant missing) met while
        # carrying a run: the worker stops with it (raised by ``run``), as at its first look.
        self._fatal: ConfigurationError | None = None
        self._wake = asyncio.Event()
        self._running: dict[tuple[str, str], asyncio.Task[Carried]] = {}
        # Runs found held by another attempt, and the loop time before which this worker
        # does not look at them again: the index shows them due once their lease lapsed,
        # but a resume claim can outlive it by up to a ttl, and looking at every poll would
        # spin (and log) at the poll rate.
        self._later: dict[tuple[str, str], float] = {}
        self.carried: list[tuple[WorkItem, Carried]] = []

    # --- the loop ------------------------------------------------------------------------

    async def run(self) -> None:
        """Carry runs until ``drain()`` (or, with ``exit_when_idle``, until nothing is due
        and nothing runs); then stop every run at its next boundary and return."""
        blips = 0
        try:
            while not self._draining.is_set():
                try:
                    started = await self.poll()
                    blips = 0
                except Exception as exc:
                    if isinstance(exc, ConfigurationError):
                        # No store there, or not the kit's (no schema, no persistence):
                        # waiting mends nothing, and an idle-looking worker would hide the
                        # typo. Anything else (an outage, one run's damaged entry) is
                        # waited out, as the other runs may still be carried.
                        raise
                    blips += 1  # the store is down for a while: keep the worker
                    delay = self.backoff.delay(blips - 1, self._rng)
                    _log.warning("finding work failed (%r); trying again in %.1f s", exc, delay)
                    await self._nap(delay)
                    continue
                if self.exit_when_idle and not (started or self._running or self._later):
                    return
                if started == 0 or len(self._running) >= self.concurrency:
                    await self._nap()
        finally:
            await self._drain_running()
        if self._fatal is not None:
            raise self._fatal

    async def poll(self) -> int:
        """Take what is due now, up to the free slots; how many runs were started."""
        free = self.concurrency - len(self._running)
        if free <= 0 or self._draining.is_set():
            return 0
        now = asyncio.get_running_loop().time()
        self._later = {key: t for key, t in self._later.items() if t > now}
        # Ask for more than the free slots: some may be runs this worker carries or leaves
        # for later, and they must not hide the runs behind them.
        items = await self.work.due(
            limit=free + len(self._running) + len(self._later), agents=list(self.agents)
        )
        started = 0
        for item in items:
            key = (item.tenant, item.run_id)
            if key in self._running or key in self._later or started >= free:
                continue
            task = asyncio.create_task(self._carry(item), name=f"carry:{item.run_id}")
            self._running[key] = task
            task.add_done_callback(functools.partial(self._finished, key))
            started += 1
        return started

    def drain(self) -> None:
        """Take no new run; every run stops at its next boundary (SIGTERM, SIGINT)."""
        self._draining.set()
        self._wake.set()

    @property
    def draining(self) -> bool:
        """Whether ``drain()`` was asked for."""
        return self._draining.is_set()

    def _finished(self, key: tuple[str, str], _task: asyncio.Task[Carried]) -> None:
        self._running.pop(key, None)
        self._wake.set()

    async def _nap(self, seconds: float | None = None) -> None:
        self._wake.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), seconds or self.poll_interval)

    async def _drain_running(self) -> None:
        self._draining.set()
        tasks = list(self._running.values())
        if not tasks:
            return
        _, late = await asyncio.wait(tasks, timeout=self.drain_timeout)
        for task in late:
            # Past the deadline: cancelled where it stands. Its lease is released on the
            # way out; a call it had sent is left in doubt, for a reconciler or a person.
            _log.warning("run %s did not reach a boundary in time; cancelling it", task.get_name())
            task.cancel()
        if late:
            await asyncio.wait(late)

    # --- one run -------------------------------------------------------------------------

    def _stop(self) -> str | None:
        return "its worker is draining" if self._draining.is_set() else None

    async def _carry(self, item: WorkItem) -> Carried:
        if item.attempts >= self.max_attempts:
            how = await self._park_too_many(item)
            self.carried.append((item, how))
            return how
        counted = False
        progress = TakeProgress(self.work, item)
        try:
            # Counted before anything else, so a take no carrier lives to report is counted;
            # and wanted from now on, as the runner marks it, so the count is kept. Out of
            # other workers' polls for a ttl: until it holds the run, only this says a take
            # is under way (the runner's want brings it back once it does).
            await self.work.want(
                item.tenant,
                item.run_id,
                agent=item.agent,
                count=1,
                delay=self.runner.lease_policy.ttl,
            )
            counted = True
            how = await self._take(item, progress)
        except asyncio.CancelledError as exc:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                # This worker cancelled it (draining past its deadline): not the run's doing.
                if counted:
                    await self._give_back(item)
                await progress.settled()
                raise
            # Raised by the run's own code (a provider or a tool) with nobody cancelling:
            # a failure of that run, counted and delayed like any other, never a silent end
            # that takes it again at once.
            leaked = _LeakedCancel(f"{exc!r} raised inside the run")
            await progress.settled()  # before the failure's own write, never over it
            how = await self._after_error(progress.item, leaked, counted=counted)
        except Exception as exc:  # a worker outlives any one run
            await progress.settled()
            how = await self._after_error(progress.item, exc, counted=counted)
        await progress.settled()
        self.carried.append((item, how))
        return how

    async def _park_too_many(self, item: WorkItem) -> Carried:
        """Park a run taken ``max_attempts`` times: each take counted itself as it began, so
        takes that never came back (the process carrying it died in it, again and again)
        are counted too. Decided holding the run as a take would, so a take carrying it now
        (the count here may be a late poll's) is left alone, and a run that finished since
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
                return await self._park_as(
                    item,
                    f"taken {item.attempts} times without finishing: the process carrying it "
                    "died, or lost it, each time",
                    "too_many_attempts",
                )
        except _NOT_TAKEN as exc:
            return self._held_elsewhere(item, exc)

    async def _take(self, item: WorkItem, progress: TakeProgress) -> Carried:
        agent = self.agents[item.agent]
        assert self.runner.checkpoints is not None
        existing = await self.runner.checkpoints.store.latest(item.tenant, item.run_id)
        if existing is None:
            started = await self._start(item, agent, progress)
            if started is not None:
                return self._ended(item, started, "started")
        _log.info("run %s/%s: carrying it on", item.tenant, item.run_id)
        if self.telemetry is not None and item.state is WorkState.wanted:
            # Started, unfinished and unheld: its holder died or let go without finishing.
            self.telemetry.took_over(item.agent)
        result = await self.runner.resume(
            agent, item.run_id, tenant=item.tenant, stop=self._stop, on_event=progress
        )
        return self._ended(item, result, "carried on")

    async def _start(self, item: WorkItem, agent: Agent, progress: TakeProgress) -> Run | None:
        """Start a submitted run; ``None`` when it turns out to have a frontier already."""
        data = await self.work.input(item.tenant, item.run_id)
        if data is None:
            raise NoCheckpointError(
                f"run {item.run_id!r} has no frontier and no submission to start it from"
            )
        submission = decode_submission(data)
        _log.info("run %s/%s: starting it", item.tenant, item.run_id)
        try:
            return await self.runner.run(
                agent,
                list(submission.messages),
                tenant=item.tenant,
                run_id=item.run_id,
                state=submission.state,
                stop=self._stop,
                on_event=progress,
            )
        except RunStartedError:
            return None  # another worker started it in between: resume it instead

    def _ended(self, item: WorkItem, result: Run, verb: str) -> Carried:
        if result.status is RunStatus.waiting_approval:
            _log.info("run %s/%s: %s; waiting on an approval", item.tenant, item.run_id, verb)
            return Carried.waiting
        _log.info("run %s/%s: %s; finished %s", item.tenant, item.run_id, verb, result.status)
        return Carried.finished

    async def _whose(self, exc: ConfigurationError) -> _Whose:
        """Whose a schema or permission error a run met is: this worker's store's (the
        worker stops), the run's own (a tool or model of it met another store's: parked
        like any ``ConfigurationError``), or not known now (the store's check could not be
        made: retried later). A schema error is the store's when the store's own check
        fails too; a permission error always is (a store's check reads, and a grant
        missing may be a write's), as is any where the runner has no check
        (``AgentRunner.from_stores`` gives it one)."""
        verify = self.runner.verify_stores
        if isinstance(exc, StorePermissionError) or verify is None:
            return _Whose.store
        try:
            await asyncio.wait_for(verify(), timeout=_CHECK_TIMEOUT)
        except (SchemaMismatchError, StorePermissionError):
            return _Whose.store
        except Exception as failed:
            _log.warning("checking the store's schema failed (%r): asked again later", failed)
            return _Whose.unknown
        return _Whose.run

    def _held_elsewhere(self, item: WorkItem, exc: Exception) -> Carried:
        """Look at the run again after a while, not at the next poll."""
        hold = self._rng.uniform(0.5, 1.0) * self.runner.lease_policy.ttl
        self._later[(item.tenant, item.run_id)] = asyncio.get_running_loop().time() + hold
        _log.info(
            "run %s/%s: held elsewhere (%s); looking again in %.1f s",
            item.tenant,
            item.run_id,
            exc,
            hold,
        )
        return Carried.elsewhere

    async def _give_back(self, item: WorkItem) -> None:
        """Take back the attempt this take counted: the run was not carried (another worker
        has it) or this worker stopped it (a drain), through no fault of the run's."""
        with contextlib.suppress(Exception):
            await self.work.want(item.tenant, item.run_id, agent=item.agent, count=-1)

    async def _after_error(self, item: WorkItem, exc: Exception, *, counted: bool) -> Carried:
        where = f"{item.tenant}/{item.run_id}"
        if isinstance(exc, RunStoppedError):
            _log.info("run %s: stopped at a boundary (draining)", where)
            # A run carried through many deploys is not parked for them.
            if counted:
                await self._give_back(item)
            return Carried.stopped
        if isinstance(exc, CarriedByWorkflowError):
            # Its workflow carries it (a Temporal run an operator's approve woke): not this
            # worker's to carry, nor to park; the workflow takes the decision itself.
            if counted:
                await self._give_back(item)
            _log.info("run %s: left to its workflow (%s)", where, exc)
            with contextlib.suppress(Exception):  # else seen again, and left again
                await self.work.done(item.tenant, item.run_id)
            return Carried.elsewhere
        if isinstance(exc, _ELSEWHERE):
            if counted and isinstance(exc, _NOT_TAKEN):
                await self._give_back(item)
            # Whatever holds it lapses within about a ttl if its holder died; a live holder
            # keeps it. Either way, look again after a while, not at the next poll.
            return self._held_elsewhere(item, exc)
        whose = None
        store_wide = exc if isinstance(exc, _STORE_WIDE) else None
        if store_wide is not None:
            try:
                whose = await self._whose(store_wide)
            except asyncio.CancelledError:
                if counted:  # drained while the store was asked: not the run's doing
                    await asyncio.shield(self._give_back(item))
                raise
        if store_wide is not None and whose is _Whose.store:
            # The store's, not the run's (an earlier schema not yet migrated, a grant
            # missing): parked, the run would stay parked once the store is mended. It is
            # given back, and the worker stops with the store's sentence.
            if counted:
                await self._give_back(item)
            _log.error("run %s: %s; the worker stops", where, exc)
            self._fatal = self._fatal or store_wide
            self._draining.set()
            return Carried.stopped
        retryable = (isinstance(exc, AdkError) and exc.retryable) or whose is _Whose.unknown
        if isinstance(exc, (*_PARK, NoCheckpointError)) and not retryable:
            parked = await self._park_as(item, f"{type(exc).__name__}: {exc}", type(exc).__name__)
            if isinstance(exc, IndeterminateToolCallError):
                await self._unless_settled_meanwhile(item, exc)
            return parked
        if item.attempts + 1 >= self.max_attempts:
            return await self._park_as(
                item,
                f"failed {item.attempts + 1} times, last {type(exc).__name__}: {exc}",
                "too_many_attempts",
            )
        delay = self.backoff.delay(item.attempts, self._rng)
        reason = self.runner.redactor.text(f"{type(exc).__name__}: {exc}")
        _log.warning("run %s: %s; trying again in %.1f s", where, reason, delay)
        try:
            await self.work.want(
                item.tenant,
                item.run_id,
                agent=item.agent,
                state=WorkState.wanted,
                delay=delay,
                reason=reason,
                count=0 if counted else 1,  # the take counted this try already
            )
        except Exception:
            # The store took no delay (it refuses writes, say): this worker keeps it, or
            # the run would be due again at the next poll.
            self._later[(item.tenant, item.run_id)] = asyncio.get_running_loop().time() + delay
        return Carried.retry

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
            _log.warning("run %s/%s: could not look again: %r", item.tenant, item.run_id, exc2)

    async def _park(self, item: WorkItem, reason: str) -> Carried:
        return await self._park_as(item, reason, "parked")

    async def _park_as(self, item: WorkItem, reason: str, why: str) -> Carried:
        """Park the run; ``why`` (an error's type name) is what the metric tells apart."""
        reason = self.runner.redactor.text(reason)
        _log.warning("run %s/%s: parked: %s", item.tenant, item.run_id, reason)
        try:
            await self.work.park(item.tenant, item.run_id, agent=item.agent, reason=reason)
        except Exception as exc:  # it is still due: parked next time round
            _log.warning("run %s/%s: could not be parked: %r", item.tenant, item.run_id, exc)
            return Carried.parked
        if self.telemetry is not None:
            self.telemetry.parked(item.agent, why)
        return Carried.parked


class _LeakedCancel(Exception):
    """A ``CancelledError`` the run's own code raised while nothing cancelled it."""
