"""``AgentRunner``: runs agents, checkpointing at safe boundaries, and carries them on.

Each public verb is one *attempt*: a holder id of its own, the run's lease (with a lease
store), the resume claim (``resume``), a seal on every store, then the loop. A
``BaseException`` (process death, cancellation) propagates untouched: nothing more is
written, the last boundary frontier stays resumable, and only the lease is released.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from tesserix_adk.agent import Agent
from tesserix_adk.checkpoint.checkpointer import Checkpointer
from tesserix_adk.checkpoint.payload import Checkpoint, decode_checkpoint
from tesserix_adk.checkpoint.planning import (
    ResumePlan,
    plan_resume,
    plan_without_frontier,
    refuse_if_undecidable,
)
from tesserix_adk.checkpoint.redaction import Masked, Redactor
from tesserix_adk.checkpoint.state_json import keepable_state
from tesserix_adk.errors import (
    CheckpointError,
    CheckpointTooLargeError,
    ConfigurationError,
    LeaseHeldError,
    NoCheckpointError,
    RunStartedError,
)
from tesserix_adk.leases import NEVER_RAN_MARGIN, LeasePolicy
from tesserix_adk.messages import Message
from tesserix_adk.providers.base import Provider
from tesserix_adk.run.approvals import told_waiting
from tesserix_adk.run.attempt import RESUME_CLAIM_TTL, Attempt, RunClaim, new_holder
from tesserix_adk.run.cancelling import (
    cancel_requested,
    cancelled_frontier,
    check_cancel_request,
    request_cancel,
)
from tesserix_adk.run.events import EventSink, RunEvent
from tesserix_adk.run.grouping import held_and_grouped
from tesserix_adk.run.holding import carried_elsewhere, holding
from tesserix_adk.run.ids import MAX_ID_BYTES, check_ids, check_worker, id_problem
from tesserix_adk.run.loop import carry_on, run_loop
from tesserix_adk.run.observing import AttemptKind, AttemptObserver, observe
from tesserix_adk.run.parts import RunParts
from tesserix_adk.run.reconciling import reconcile_in_doubt
from tesserix_adk.run.recording import to_the_end
from tesserix_adk.run.replay import replay_from
from tesserix_adk.run.result import Run, RunStatus, finished_run
from tesserix_adk.run.resume import (
    note_ahead,
    nothing_ran_since_approval_asked,
    refuse_carried_by_workflow,
    refuse_unresumable,
    restore,
    resumable,
)
from tesserix_adk.run.screening import without_secret_ids
from tesserix_adk.run.state import RunState, as_messages
from tesserix_adk.run.streaming import stream_run
from tesserix_adk.run.submitting import refuse_another_start, same_submission, submission
from tesserix_adk.stores.protocols import (
    ApprovalStore,
    CommitsWithNext,
    GroupedWrites,
    HistoryStore,
    IdempotencyStore,
    LeaseStore,
    Ledger,
    WorkIndex,
)

if TYPE_CHECKING:
    from tesserix_adk.stores.bundle import Stores

__all__ = [
    "MAX_ID_BYTES",
    "AgentRunner",
    "FrontierObserver",
    "StopSignal",
    "check_ids",
    "id_problem",
]

_log = logging.getLogger("tesserix_adk.runner")

FrontierObserver = Callable[[Checkpoint, ResumePlan | None, int | None, str], None]
StopSignal = Callable[[], str | None]
"""Asked at each boundary (before a model call, and after its answer before any call is
sent): why to stop there, or ``None`` to go on."""


class AgentRunner:
    """Runs agents, checkpointing at safe boundaries, and carries them on after a crash."""

    def __init__(
        self,
        provider: Provider,
        *,
        idempotency: IdempotencyStore,
        checkpoints: Checkpointer | None = None,
        leases: LeaseStore | None = None,
        history: HistoryStore | None = None,
        ledger: Ledger | None = None,
        approvals: ApprovalStore | None = None,
        lease_policy: LeasePolicy | None = None,
        worker: str | None = None,
        resume_claim_ttl: float = RESUME_CLAIM_TTL,
        work: WorkIndex | None = None,
        never_ran_margin: float = NEVER_RAN_MARGIN,
        telemetry: AttemptObserver | None = None,
        group_writes: bool = False,
    ) -> None:
        if history is not None and (checkpoints is None or checkpoints.history is not history):
            raise ConfigurationError(
                "the history store is configured once, on the Checkpointer "
                "(Checkpointer(store, history=...)); pass the same one or none here"
            )
        self.provider = provider
        self.idempotency = idempotency
        self.checkpoints = checkpoints
        self.leases = leases
        self.ledger = ledger
        self.approvals = approvals
        self.lease_policy = lease_policy or LeasePolicy()
        # The name every attempt's holder id starts with; each attempt adds its own suffix.
        check_worker("worker" if worker is None else worker)
        # Kept in every lease and claim it holds, and shown to operators: masked like
        # everything else the runner persists (a name pasted with a key in it).
        self.worker = self.redactor.text("worker" if worker is None else worker)
        # How long a resumer that died keeps others from resuming (store's clock).
        self.resume_claim_ttl = resume_claim_ttl
        # Runs that want a worker: kept up to date as runs start, wait and finish.
        self.work = work
        # How long past the previous lease a reconciler is asked whether a call never ran.
        self.never_ran_margin = never_ran_margin
        self.telemetry = telemetry  # spans and metrics (tesserix_adk.telemetry.Telemetry)
        # Whether a turn's writes commit together where the backend offers write groups
        # (``run.grouping``): fewer commits, but a process paused inside a group (SIGSTOP,
        # a frozen VM) holds SQLite's write lock, or the run's rows on PostgreSQL, until it
        # resumes; off by default, each write commits on its own.
        self.group_writes = group_writes
        # Checks the stores' schema (``Stores.verify``; ``from_stores`` sets it): a worker
        # asks it whether a schema error a run met is its store's.
        self.verify_stores: Callable[[], Awaitable[None]] | None = None

    @classmethod
    def from_stores(cls, provider: Provider, stores: Stores, **kwargs: Any) -> AgentRunner:
        """A runner over an ``open_stores`` bundle, history on the Checkpointer. ``kwargs``
        go to the Checkpointer (``policy``, ``max_bytes``, ``redact``, ``extra_patterns``)
        or the runner (``lease_policy``, ``worker``, ``telemetry``, ...)."""
        cp_options = {"policy", "max_bytes", "redact", "extra_patterns"}
        cp_kwargs = {k: v for k, v in kwargs.items() if k in cp_options}
        runner_kwargs = {k: v for k, v in kwargs.items() if k not in cp_options}
        checkpointer = Checkpointer.from_stores(stores, **cp_kwargs)
        runner = cls(
            provider,
            idempotency=stores.idempotency,
            checkpoints=checkpointer,
            leases=stores.leases,
            ledger=stores.ledger,
            approvals=stores.approvals,
            work=stores.work,
            **runner_kwargs,
        )
        runner.verify_stores = stores.verify
        return runner

    @property
    def redactor(self) -> Redactor:
        """The redaction applied to everything the runner persists."""
        return Redactor() if self.checkpoints is None else self.checkpoints.redactor

    @property
    def _parts(self) -> RunParts:
        def grouping(store: object) -> GroupedWrites | None:
            # Asked once a run: a runtime protocol check walks the protocol's members.
            return store if self.group_writes and isinstance(store, GroupedWrites) else None

        return RunParts(
            provider=self.provider,
            idempotency=self.idempotency,
            checkpoints=self.checkpoints,
            ledger=self.ledger,
            approvals=self.approvals,
            redactor=self.redactor,
            groups=grouping(self.idempotency),
            ledger_groups=grouping(self.ledger),
            commits_with_next=(
                self.idempotency
                if self.group_writes and isinstance(self.idempotency, CommitsWithNext)
                else None
            ),
        )

    # --- public verbs --------------------------------------------------------------------

    async def submit(
        self,
        agent: Agent,
        input: str | Message | Sequence[Message],
        *,
        tenant: str,
        run_id: str | None = None,
        state: Any = None,
    ) -> str:
        """Record a run durably as submitted, for a worker to start; its id.

        Submitting an id the run already has (submitted, started or finished) is a no-op
        that returns it, so a client that retries its request makes one run; a submission
        of that id for another agent, or with another input or state, is refused
        (``RunStartedError``, not retryable): the run goes on from the first. The input is
        stored redacted, like everything the kit stores. An input no frontier could hold
        (over ``max_bytes``) is refused, ``CheckpointTooLargeError``, nothing recorded, and so
        is a state no frontier can keep whole (``ConfigurationError``, as for ``run``).
        """
        self._check_agent(agent)
        work = self._require_work()
        run_id = f"run_{secrets.token_hex(8)}" if run_id is None else run_id
        check_ids(tenant=tenant, run_id=run_id)
        stored = None
        if self.checkpoints is not None:
            stored = await self.checkpoints.store.latest(tenant, run_id)
        messages = without_secret_ids(as_messages(input), self.redactor)
        if stored is not None:
            # Under way: the same request again is a no-op; another one (told apart by the
            # agent that carries it, and by the submission the run was started from, where
            # it kept one) is said. A replay is nobody's submission.
            with contextlib.suppress(CheckpointError):  # a damaged frontier says nothing
                cp = decode_checkpoint(
                    stored.payload, tenant=tenant, run_id=run_id, step=stored.step
                )
                refuse_another_start(cp, agent)
            if await work.input(tenant, run_id) is not None:
                with contextlib.suppress(CheckpointError):
                    data = submission(agent, messages, state, self.redactor)
                    await same_submission(
                        work, self.redactor, agent, tenant, run_id, data, "submitted"
                    )
            return run_id
        refused = f"run {run_id!r} not submitted"
        kept = keepable_state(state, agent.state_schema, self.redactor, refused=refused)
        if self.checkpoints is not None:
            self.checkpoints.check_input(messages, kept)
        data = submission(agent, messages, state, self.redactor)
        if not await work.submit(tenant, run_id, agent=agent.name, input=data):
            # Submitted before: the same request again is a no-op; another one is said.
            await same_submission(work, self.redactor, agent, tenant, run_id, data, "submitted")
        return run_id

    async def run(
        self,
        agent: Agent,
        input: str | Message | Sequence[Message],
        *,
        tenant: str,
        run_id: str | None = None,
        state: Any = None,
        stop: StopSignal | None = None,
        on_event: EventSink | None = None,
    ) -> Run:
        """Start a new run and carry it until it finishes or waits on a person.

        ``stop()`` is asked at each boundary (before each model call, and after its answer
        before any call is sent); a reason it returns stops the run there with
        ``RunStoppedError`` (a draining worker), to be carried on later.
        ``on_event(event)`` is told each event as ``stream`` would yield it, from the run's
        own task (or a sync tool's thread), so it must not block; ``RunFinished`` is not
        among them (``run`` returns it). A ``state`` no frontier can keep whole (it does not
        validate, is not JSON, or holds a secret the stores would keep masked) is refused
        before anything starts (``ConfigurationError``).
        """
        attempt = Attempt(
            holder=new_holder(self.worker), stop=stop, events=on_event, redactor=self.redactor
        )
        work = self._start(attempt, agent, input, tenant, run_id, state)
        return await observe(self, attempt, AttemptKind.run, agent, tenant, run_id, work)

    def stream(
        self,
        agent: Agent,
        input: str | Message | Sequence[Message],
        *,
        tenant: str,
        run_id: str | None = None,
        state: Any = None,
        stop: StopSignal | None = None,
    ) -> AsyncIterator[RunEvent]:
        """``run`` as an async iterator of its events, ending with ``RunFinished``. Leaving
        it early stops the run (lease released, resumable): see ``run.streaming``."""

        def start(events: EventSink) -> Coroutine[Any, Any, Run]:
            attempt = Attempt(
                holder=new_holder(self.worker), stop=stop, events=events, redactor=self.redactor
            )
            work = self._start(attempt, agent, input, tenant, run_id, state)
            return observe(self, attempt, AttemptKind.run, agent, tenant, run_id, work)

        return stream_run(start, name=f"stream:{run_id or 'new run'}")

    async def _start(
        self,
        attempt: Attempt,
        agent: Agent,
        input: str | Message | Sequence[Message],
        tenant: str,
        run_id: str | None,
        state: Any,
    ) -> Run:
        self._check_agent(agent)
        run_id = f"run_{secrets.token_hex(8)}" if run_id is None else run_id
        check_ids(tenant=tenant, run_id=run_id)
        messages = without_secret_ids(as_messages(input), self.redactor)
        run = RunState(agent=agent, tenant=tenant, run_id=run_id, messages=messages)
        run.state = state
        if self.checkpoints is not None:
            refused = f"run {run_id!r} not started"
            kept = keepable_state(state, agent.state_schema, self.redactor, refused=refused)
            # A state no frontier could hold would leave only tombstones (submit says so too).
            self.checkpoints.check_input([], kept)
        async with self._holding(attempt, tenant, run_id):
            if self.checkpoints is not None:
                existing = await self.checkpoints.store.latest(tenant, run_id)
                if existing is not None:
                    raise RunStartedError(
                        f"run {run_id!r} already has a frontier; resume it instead of "
                        "starting it again"
                    )
            # A retry of a run whose first frontier could not be written finds the records
            # the earlier attempt left: they are ahead of an empty frontier, planned as a
            # resume would (never sent again, in doubt refused, divergence refused).
            plan = await plan_without_frontier(tenant, run_id, self.idempotency)
            if await self._reconcile(agent, plan, attempt, tenant, run_id):
                plan = await plan_without_frontier(tenant, run_id, self.idempotency)
            refuse_if_undecidable(plan)
            note_ahead(attempt, plan)
            if self.ledger is not None:
                run.spent = await self.ledger.spent(tenant, run_id)
            await self._submitted(run)
            await self._wanted(tenant, run_id, agent)
            return await self._settled(await run_loop(self._parts, run, attempt), attempt)

    async def resume(
        self,
        agent: Agent,
        run_id: str,
        *,
        tenant: str,
        on_frontier: FrontierObserver | None = None,
        stop: StopSignal | None = None,
        on_event: EventSink | None = None,
    ) -> Run:
        """Carry a run on from its frontier, never making a side-effecting call twice.

        ``on_frontier(checkpoint, plan, fence, holder)`` (``holder``: this attempt's id) is
        called once the frontier is read (and planned, unless finished or refused), before
        anything is carried on: the CLI prints its summary there. Calls in doubt whose tool
        has a reconciler are settled by it first. A run whose cancel stands ends cancelled
        here, sending nothing (calls in doubt left as they are). ``stop`` and ``on_event``
        as for ``run``."""
        attempt = Attempt(
            holder=new_holder(self.worker), stop=stop, events=on_event, redactor=self.redactor
        )
        work = self._resume(attempt, agent, run_id, tenant, on_frontier)
        return await observe(self, attempt, AttemptKind.resume, agent, tenant, run_id, work)

    def stream_resume(
        self,
        agent: Agent,
        run_id: str,
        *,
        tenant: str,
        on_frontier: FrontierObserver | None = None,
        stop: StopSignal | None = None,
    ) -> AsyncIterator[RunEvent]:
        """``resume`` as an async iterator of its events, ending with ``RunFinished``;
        leaving it early stops the run as for ``stream``."""

        def start(events: EventSink) -> Coroutine[Any, Any, Run]:
            attempt = Attempt(
                holder=new_holder(self.worker), stop=stop, events=events, redactor=self.redactor
            )
            work = self._resume(attempt, agent, run_id, tenant, on_frontier)
            return observe(self, attempt, AttemptKind.resume, agent, tenant, run_id, work)

        return stream_run(start, name=f"stream-resume:{run_id}")

    async def _resume(
        self,
        attempt: Attempt,
        agent: Agent,
        run_id: str,
        tenant: str,
        on_frontier: FrontierObserver | None,
    ) -> Run:
        self._check_agent(agent)
        check_ids(tenant=tenant, run_id=run_id)
        checkpoints = self._require_checkpoints()
        claim = RunClaim(
            self.idempotency,
            tenant=tenant,
            run_id=run_id,
            holder=attempt.holder,
            ttl=self.resume_claim_ttl,
        )
        await claim.take()
        attempt.run_claim = claim
        claim.start_renewing()
        try:
            result = await self._resume_claimed(
                checkpoints, agent, run_id, tenant, attempt, on_frontier
            )
        except (Exception, asyncio.CancelledError):
            await to_the_end(claim.release())
            raise
        except BaseException:
            # A stand-in for a process death: the claim is left to expire, exactly as a
            # killed process would leave it (only its renewal stops).
            claim.abandon()
            raise
        await to_the_end(claim.release())
        return result

    async def _resume_claimed(
        self,
        checkpoints: Checkpointer,
        agent: Agent,
        run_id: str,
        tenant: str,
        attempt: Attempt,
        on_frontier: FrontierObserver | None,
    ) -> Run:
        async with self._holding(attempt, tenant, run_id, resuming=True):
            cp = await checkpoints.latest(tenant, run_id)
            if cp is None:
                raise NoCheckpointError(
                    f"nothing is checkpointed under run {run_id!r} for tenant {tenant!r}"
                )
            refuse_carried_by_workflow(cp)  # before a reconciler is asked anything
            plan = None
            if not cp.is_tombstone and not cp.status.finished:
                plan = await plan_resume(cp, self.idempotency)
                if resumable(cp, agent) and await self._reconcile(
                    agent, plan, attempt, tenant, run_id
                ):
                    plan = await plan_resume(cp, self.idempotency)
            if on_frontier is not None:
                on_frontier(cp, plan, attempt.fence, attempt.holder)
            if plan is None:
                refuse_unresumable(cp, agent)
                return await self._settled(finished_run(cp), attempt)
            # Read before anything is refused: a cancelled run ends where it stands, calls in
            # doubt and all (nothing more is sent, so none is guessed at), instead of
            # waiting on an operator's decision about a call it will never make again.
            cancelled = await cancel_requested(self.idempotency, tenant, run_id)
            if cancelled is not None and not resumable(cp, agent):
                # Ended as a cancel ends a run nobody holds, asking this agent nothing (it
                # is another revision, or the run a replay whose stubs are gone).
                await cancelled_frontier(checkpoints, cp, fence=attempt.fence, request=cancelled)
                ended = await checkpoints.latest(tenant, run_id)
                return await self._settled(finished_run(ended or cp), attempt)
            refuse_unresumable(cp, agent)
            if cancelled is None and not nothing_ran_since_approval_asked(cp, plan):
                if await carried_elsewhere(plan, self.leases, tenant=tenant, run_id=run_id):
                    plan = await plan_resume(cp, self.idempotency)
                    await carried_elsewhere(plan, self.leases, tenant=tenant, run_id=run_id)
                refuse_if_undecidable(plan)
            run = RunState(agent=agent, tenant=tenant, run_id=run_id, messages=[])
            await restore(checkpoints, self.ledger, run, attempt, cp, plan, self.idempotency)
            await self._wanted(tenant, run_id, agent)
            return await self._settled(
                await carry_on(self._parts, run, attempt, cp, cancelled=cancelled), attempt
            )

    async def replay(
        self,
        agent: Agent,
        run_id: str,
        *,
        tenant: str,
        from_step: int,
        stubs: Mapping[str, Callable[..., Any]],
        live: Sequence[str] = (),
        new_run_id: str | None = None,
    ) -> Run:
        """Run forward from a past step as a new run, side-effecting tools stubbed.

        Debugging, never production: nothing is written under the original run, and a
        side-effecting tool that is neither stubbed nor named in ``live`` refuses the
        replay before anything runs.
        """
        return await replay_from(
            self,
            agent,
            run_id,
            tenant=tenant,
            from_step=from_step,
            stubs=stubs,
            live=live,
            new_run_id=new_run_id,
        )

    async def cancel(
        self, run_id: str, *, tenant: str, by: str, reason: str | None = None
    ) -> Run | None:
        """Cancel a run, audited (who, when, why, recorded): its holder ends it at its next
        boundary with a final ``cancelled`` frontier and sends nothing more. A run nobody
        holds is ended here (its ``Run``); ``None`` when a live holder will, or none began."""
        check_ids(tenant=tenant, run_id=run_id)
        check_cancel_request(by=by, reason=reason)
        checkpoints = self._require_checkpoints()
        ended = await checkpoints.latest(tenant, run_id)
        if ended is not None and ended.status.finished and not ended.is_tombstone:
            # Nothing to cancel, and a run that ended never goes on: no request is recorded
            # (its story would say someone cancelled it) and no lease is taken.
            return finished_run(ended)
        request = await request_cancel(
            self.idempotency, tenant, run_id, by=by, reason=reason, redactor=self.redactor
        )
        attempt = Attempt(holder=new_holder(self.worker))
        try:
            async with self._holding(attempt, tenant, run_id):
                cp = await checkpoints.latest(tenant, run_id)
                if cp is not None and not cp.status.finished and not cp.is_tombstone:
                    await cancelled_frontier(checkpoints, cp, fence=attempt.fence, request=request)
                    cp = await checkpoints.latest(tenant, run_id)
        except LeaseHeldError:
            return None  # the holder finds the request at its next boundary
        if self.work is not None:
            await self.work.done(tenant, run_id)
        if cp is not None and cp.is_tombstone:
            raise CheckpointTooLargeError(
                f"run {run_id!r} cannot be carried on (its latest frontier, step {cp.step}, is "
                f"a tombstone: {cp.reason}), so nothing more is sent; the cancel is recorded",
                retryable=False,
            )
        return None if cp is None else finished_run(cp)

    # --- the work index and reconcilers ------------------------------------------------

    async def _reconcile(
        self, agent: Agent, plan: ResumePlan, attempt: Attempt, tenant: str, run_id: str
    ) -> bool:
        if not plan.indeterminate:
            return False
        return await reconcile_in_doubt(
            self._parts,
            agent,
            plan,
            attempt,
            tenant=tenant,
            run_id=run_id,
            margin=self.never_ran_margin,
            leases=self.leases,
        )

    async def _submitted(self, run: RunState) -> None:
        """A run started here keeps its input as a submission (a no-op for one the index
        knows: submitted, or started before), so a worker starts it from there if its
        process dies, or its stream's reader leaves, before its first frontier, as it
        carries on one that has a frontier. An input that cannot be stored (too large)
        leaves the run as it was without one: carried on only from its first frontier."""
        if self.work is None:
            return
        try:
            data = submission(run.agent, run.messages, run.state, self.redactor)
        except CheckpointError as exc:
            _log.warning(
                "run %s/%s: its input is not kept for a worker: %s",
                run.tenant,
                run.run_id,
                Masked(exc),
            )
            return
        if await self.work.submit(run.tenant, run.run_id, agent=run.agent.name, input=data):
            return
        await same_submission(
            self.work, self.redactor, run.agent, run.tenant, run.run_id, data, "started"
        )

    async def _wanted(self, tenant: str, run_id: str, agent: Agent) -> None:
        """The run is being carried: if its carrier dies, a worker carries it on. (A worker
        counts its takes itself; this keeps the count, and starts it again for a run an
        operator carries on from parked.)"""
        if self.work is not None:
            await self.work.want(tenant, run_id, agent=agent.name)

    async def _settled(self, result: Run, attempt: Attempt) -> Run:
        """A finished run, or one waiting on a person, wants no worker now. Waiting is
        told only while the attempt holds the run: an attempt whose read of the decision
        came back late may have read "pending" while the live holder sends the approved
        call, and must not take the run out of the workers' hands."""
        if self.work is None:
            return result
        if result.status is RunStatus.waiting_approval:
            attempt.guard()
            await told_waiting(self.approvals, self.work, result)
        else:
            await self.work.done(result.tenant, result.run_id)
        return result

    def _require_work(self) -> WorkIndex:
        if self.work is None:
            raise ConfigurationError(
                "submitting needs a work index (work=..., or AgentRunner.from_stores on a "
                "backend that keeps one)"
            )
        return self.work

    # --- set-up --------------------------------------------------------------------------

    def _check_agent(self, agent: Agent) -> None:
        if self.approvals is None and any(t.requires_approval for t in agent.tools.values()):
            raise ConfigurationError(
                f"agent {agent.name!r} has tools that require approval; give the runner an "
                "approval store (approvals=...)"
            )

    def _require_checkpoints(self) -> Checkpointer:
        if self.checkpoints is None:
            raise ConfigurationError("resuming needs a Checkpointer (checkpoints=...)")
        return self.checkpoints

    def _holding(
        self, attempt: Attempt, tenant: str, run_id: str, *, resuming: bool = False
    ) -> contextlib.AbstractAsyncContextManager[None]:
        """The run's lease and every store's seal for one attempt (``run/holding.py``)."""
        stores: list[Any] = [self.idempotency, self.ledger, self.approvals]
        if self.checkpoints is not None:
            stores += [self.checkpoints.store, self.checkpoints.history]
        sealed = [s for s in stores if s is not None]
        return held_and_grouped(
            holding(
                self.leases, self.lease_policy, sealed, attempt, tenant, run_id, resuming=resuming
            ),
            attempt,
        )
