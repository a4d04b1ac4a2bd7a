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
from typing import TYPE_CHECKING

from tesserix_adk.agent import Agent
from tesserix_adk.checkpoint.checkpointer import state_from_json
from tesserix_adk.checkpoint.payload.submission import decode_submission
from tesserix_adk.checkpoint.redaction import Masked
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
    NoCheckpointError,
    ReplayNotResumableError,
    ResumeConflictError,
    RevisionMismatchError,
    RunFailedError,
    RunStartedError,
    RunStoppedError,
    SchemaMismatchError,
    StaleFenceError,
    StateRedactedError,
    StorePermissionError,
)
from tesserix_adk.run.invoking import error_text
from tesserix_adk.run.result import Run, RunStatus
from tesserix_adk.run.runner import AgentRunner
from tesserix_adk.stores.protocols import WorkIndex, WorkItem, WorkState
from tesserix_adk.worker_parking import NOT_TAKEN, Backoff, Carried, Parking, parked_reason
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
    StateRedactedError,
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


class Worker(Parking):
    """Carries the runs a work index says want a worker, ``concurrency`` at a time.

    A run pinned to another revision of its agent is parked; a worker of that revision
    wakes it again as it starts and then every ``parked_sweep`` seconds as it polls (a
    rolling deploy: old and new workers side by side)."""

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
        parked_sweep: float = 30.0,
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
        # How often a worker looks for runs parked by a worker of another revision that
        # are pinned to its own (``Parking._wake_parked``).
        self.parked_sweep = parked_sweep
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
        loop = asyncio.get_running_loop()
        try:
            await self._wake_parked(formats=True)
            swept = loop.time()
            while not self._draining.is_set():
                try:
                    if loop.time() - swept >= self.parked_sweep:
                        await self._wake_parked(formats=False)
                        swept = loop.time()
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
                    _log.warning(
                        "finding work failed (%r); trying again in %.1f s", Masked(exc), delay
                    )
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

    async def _take(self, item: WorkItem, progress: TakeProgress) -> Carried:
        agent = self.agents[item.agent]
        assert self.runner.checkpoints is not None
        existing = await self.runner.checkpoints.store.latest(item.tenant, item.run_id)
        if existing is None:
            started = await self._start(item, agent, progress)
            if started is not None:
                return self._ended(item, started, "started")
        _log.info("run %s/%s: carrying it on", item.tenant, item.run_id)
        held: list[bool] = []
        try:
            result = await self.runner.resume(
                agent,
                item.run_id,
                tenant=item.tenant,
                stop=self._stop,
                on_event=progress,
                on_frontier=lambda *_: held.append(True),
            )
        finally:
            # Its frontier was read and planned under the run's lease, whatever came of
            # it then (a call in doubt refused, say): taken over. Not before: a take
            # refused as held elsewhere, or failing on the store first, took nothing.
            if held:
                self._took_over(item)
        return self._ended(item, result, "carried on")

    def _took_over(self, item: WorkItem) -> None:
        """Count a takeover of a run this worker's resume held: one wanted with no failure
        noted, started, unfinished and unheld, whose holder died or let go without
        finishing. (A worker's retry of a run that failed, its reason noted, is its own.)"""
        if self.telemetry is not None and item.state is WorkState.wanted and item.reason is None:
            self.telemetry.took_over(item.agent)

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
                # As a resume restores it: the schema's own type, not its JSON form.
                state=state_from_json(submission.state, agent.state_schema),
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
            _log.warning(
                "checking the store's schema failed (%r): asked again later", Masked(failed)
            )
            return _Whose.unknown
        return _Whose.run

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
            _log.info("run %s: left to its workflow (%s)", where, Masked(exc))
            with contextlib.suppress(Exception):  # else seen again, and left again
                await self.work.done(item.tenant, item.run_id)
            return Carried.elsewhere
        if isinstance(exc, _ELSEWHERE):
            if counted and isinstance(exc, NOT_TAKEN):
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
            _log.error("run %s: %s; the worker stops", where, Masked(exc))
            self._fatal = self._fatal or store_wide
            self._draining.set()
            return Carried.stopped
        retryable = (isinstance(exc, AdkError) and exc.retryable) or whose is _Whose.unknown
        if isinstance(exc, (*_PARK, NoCheckpointError)) and not retryable:
            parked = await self._park_as(item, parked_reason(exc), type(exc).__name__)
            if isinstance(exc, IndeterminateToolCallError):
                await self._unless_settled_meanwhile(item, exc)
            return parked
        if item.attempts + 1 >= self.max_attempts:
            return await self._park_as(
                item,
                f"failed {item.attempts + 1} times, last {error_text(exc)}",
                "too_many_attempts",
            )
        delay = self.backoff.delay(item.attempts, self._rng)
        reason = self.runner.redactor.text(error_text(exc))
        _log.warning("run %s: %s; trying again in %.1f s", where, Masked(reason), delay)
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


class _LeakedCancel(Exception):
    """A ``CancelledError`` the run's own code raised while nothing cancelled it."""
