"""The run loop: ``AgentRunner.run``, ``resume`` and ``replay``.

Each iteration: call the model, charge the ledger, checkpoint ``after_model_call``; ask for
approvals (checkpoint ``before_approval`` and stop); claim, run and complete each call in
the model's order; checkpoint ``after_tool_result``. A keyed call is dispatched only after
its claim is durably recorded (no claim, no dispatch). A ``BaseException`` (a stand-in for
process death, or cancellation) propagates untouched: nothing more is written and the last
boundary frontier stays resumable.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from pydantic_core import to_jsonable_python

from tesserix_adk.agent import Agent
from tesserix_adk.checkpoint.checkpointer import (
    Checkpointer,
    TranscriptCursor,
    state_from_json,
    state_to_json,
)
from tesserix_adk.checkpoint.payload import (
    Boundary,
    Checkpoint,
    CheckpointStatus,
    Grant,
    OutstandingCall,
    PendingApproval,
    decode_outcome,
    encode_outcome,
)
from tesserix_adk.checkpoint.planning import ResumePlan, plan_resume, refuse_if_undecidable
from tesserix_adk.checkpoint.redaction import Redactor
from tesserix_adk.errors import (
    AdkError,
    CheckpointTooLargeError,
    ConfigurationError,
    DivergedRunError,
    IndeterminateToolCallError,
    LeaseHeldError,
    NoCheckpointError,
    ResumeConflictError,
    RevisionMismatchError,
    RunFailedError,
    StoreUnavailableError,
)
from tesserix_adk.leases import Leaseholder, LeasePolicy
from tesserix_adk.messages import Message, ToolCall, ToolOutcome, Usage
from tesserix_adk.providers.base import ModelRequest, ModelResponse, Provider
from tesserix_adk.stores.protocols import (
    ApprovalRequest,
    ApprovalStatus,
    ApprovalStore,
    HistoryStore,
    IdempotencyRecord,
    IdempotencyStore,
    LeaseStore,
    Ledger,
    RecordStatus,
    ToolFlags,
)
from tesserix_adk.tools import Tool, ToolContext, accepts_ctx, call_maybe_async, canonical_json

__all__ = ["RESUME_CLAIM_TTL", "AgentRunner", "Run", "RunStatus", "run_claim_key"]

RESUME_CLAIM_TTL = 300.0

FrontierObserver = Callable[[Checkpoint, ResumePlan | None, int | None], None]
_log = logging.getLogger("tesserix_adk.runner")


class RunStatus(StrEnum):
    """How a call to ``run``/``resume``/``replay`` left the run."""

    completed = "completed"
    waiting_approval = "waiting_approval"
    budget_exhausted = "budget_exhausted"
    max_iterations = "max_iterations"
    failed = "failed"


@dataclass(frozen=True, slots=True, kw_only=True)
class Run:
    """Where a run stands after the runner let go of it."""

    run_id: str
    tenant: str
    agent_name: str
    status: RunStatus
    output: str | None = None
    iteration: int = 0
    usage: Usage = field(default_factory=Usage)
    spent_micros: int = 0
    pending_approval: ApprovalRequest | None = None
    replay_of: str | None = None
    fence: int | None = None


def run_claim_key(tenant: str, run_id: str) -> str:
    """The idempotency key of a run's resume claim (one per tenant and run)."""
    body = canonical_json(["resume", tenant, run_id])
    return "run1:" + hashlib.sha256(body.encode("utf-8")).hexdigest()


@dataclass(slots=True, kw_only=True)
class _Carry:
    """The live state of one run while this runner carries it."""

    agent: Agent
    tenant: str
    run_id: str
    messages: list[Message]
    iteration: int = 0
    step: int = 0
    steps_used: int = 0
    usage: Usage = field(default_factory=Usage)
    spent: int = 0
    state: Any = None
    grants: list[Grant] = field(default_factory=list)
    replay_of: str | None = None
    cursor: TranscriptCursor = field(default_factory=TranscriptCursor)
    lease: Leaseholder | None = None
    takeover_keys: set[str] = field(default_factory=set)
    # Completed side-effecting records the run left ahead of its frontier, by iteration.
    ahead: dict[int, set[str]] = field(default_factory=dict)
    run_claim: str | None = None
    stubs: Mapping[str, Callable[..., Any]] | None = None
    observation: Any = None

    @property
    def fence(self) -> int | None:
        return None if self.lease is None else self.lease.fence


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
        # How long a resumer that died keeps others from resuming (store's clock).
        self.resume_claim_ttl = resume_claim_ttl
        # Unique per runner instance: a restarted worker never mistakes a dead one's claim
        # for its own, and two processes sharing a worker name never both hold a run.
        self.holder = f"{worker or 'worker'}-{secrets.token_hex(6)}"

    @property
    def redactor(self) -> Redactor:
        """The redaction applied to everything the runner persists."""
        if self.checkpoints is not None:
            return self.checkpoints.redactor
        return Redactor()

    # --- public verbs --------------------------------------------------------------------

    async def run(
        self,
        agent: Agent,
        input: str | Message | Sequence[Message],
        *,
        tenant: str,
        run_id: str | None = None,
        state: Any = None,
    ) -> Run:
        """Start a new run and carry it until it finishes or waits on a person."""
        self._check_agent(agent)
        run_id = run_id or f"run_{secrets.token_hex(8)}"
        carry = _Carry(agent=agent, tenant=tenant, run_id=run_id, messages=_as_messages(input))
        carry.state = state
        lease = await self._take_lease(tenant, run_id)
        async with _holding(lease):
            carry.lease = lease
            await self._seal(carry)
            if self.checkpoints is not None:
                existing = await self.checkpoints.store.latest(tenant, run_id)
                if existing is not None:
                    raise ConfigurationError(
                        f"run {run_id!r} already has a frontier; resume it instead of "
                        "starting it again"
                    )
            if self.ledger is not None:
                carry.spent = await self.ledger.spent(tenant, run_id)
            return await self._loop(carry)

    async def resume(
        self,
        agent: Agent,
        run_id: str,
        *,
        tenant: str,
        on_frontier: FrontierObserver | None = None,
    ) -> Run:
        """Carry a run on from its frontier, never making a side-effecting call twice.

        ``on_frontier(checkpoint, plan, fence)`` is called once the frontier is read (and
        planned, unless it is finished or refused), before anything is carried on: the CLI
        prints its summary there.
        """
        self._check_agent(agent)
        self._require_checkpoints()
        claim = run_claim_key(tenant, run_id)
        await self._claim_run(claim, tenant, run_id)
        try:
            run = await self._resume_claimed(agent, run_id, tenant, claim, on_frontier)
        except (Exception, asyncio.CancelledError):
            await _shielded(self._release_claim(claim))
            raise
        # Any other BaseException stands in for a process death: the claim is left to
        # expire, exactly as a killed process would leave it.
        await _shielded(self._release_claim(claim))
        return run

    async def _resume_claimed(
        self,
        agent: Agent,
        run_id: str,
        tenant: str,
        claim: str,
        on_frontier: FrontierObserver | None,
    ) -> Run:
        checkpoints = self._require_checkpoints()
        try:
            lease = await self._take_lease(tenant, run_id)
        except LeaseHeldError as exc:
            raise ResumeConflictError(
                f"run {run_id!r} is held by {exc.holder or 'another worker'}", holder=exc.holder
            ) from exc
        async with _holding(lease):
            carry = _Carry(agent=agent, tenant=tenant, run_id=run_id, messages=[])
            carry.lease = lease
            carry.run_claim = claim
            await self._seal(carry)
            cp = await checkpoints.latest(tenant, run_id)
            if cp is None:
                raise NoCheckpointError(
                    f"nothing is checkpointed under run {run_id!r} for tenant {tenant!r}"
                )
            plan = None
            if not cp.is_tombstone and not cp.status.finished:
                plan = await plan_resume(cp, self.idempotency)
            if on_frontier is not None:
                on_frontier(cp, plan, carry.fence)
            _refuse_unresumable(cp, agent)
            if plan is None:
                return _finished_run(cp)
            if not _nothing_ran_since_approval_asked(cp, plan):
                refuse_if_undecidable(plan)
            await self._restore(carry, cp, plan)
            return await self._continue(carry, cp)

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
        checkpoints = self._require_checkpoints()
        unknown = set(stubs) - set(agent.tools)
        if unknown:
            raise ConfigurationError(f"stubs for unknown tool(s): {', '.join(sorted(unknown))}")
        unguarded = sorted(
            t.name
            for t in agent.tools.values()
            if t.side_effects and t.name not in stubs and t.name not in live
        )
        if unguarded:
            raise ConfigurationError(
                "replay refused: side-effecting tool(s) "
                f"{', '.join(unguarded)} are neither stubbed nor named in live"
            )
        self._check_agent(agent)
        cp = await checkpoints.at(tenant, run_id, from_step)
        if cp is None:
            raise NoCheckpointError(f"run {run_id!r} has no step {from_step} for tenant {tenant!r}")
        if cp.is_tombstone:
            raise CheckpointTooLargeError(
                f"step {from_step} of run {run_id!r} is a tombstone: {cp.reason}", retryable=False
            )
        masked = sorted(
            {oc.call.name for oc in cp.outstanding if oc.redacted and oc.call.name not in stubs}
        )
        if masked:
            raise ConfigurationError(
                f"step {from_step} holds call(s) to {', '.join(masked)} whose arguments were "
                "redacted; stub them to replay (a live tool would get masked arguments)"
            )
        messages = await checkpoints.messages(cp)
        new_id = new_run_id or f"{run_id}-replay-{secrets.token_hex(4)}"
        if new_id == run_id:
            raise ConfigurationError("a replay never writes into the original run")
        if await checkpoints.store.latest(tenant, new_id) is not None:
            raise ConfigurationError(
                f"run {new_id!r} already exists; a replay starts a run of its own"
            )
        carry = _Carry(
            agent=agent,
            tenant=tenant,
            run_id=new_id,
            messages=messages,
            iteration=cp.iteration,
            steps_used=cp.steps_used,
            usage=cp.usage,
            state=state_from_json(cp.state, agent.state_schema),
            grants=list(cp.grants),
            replay_of=f"{run_id}@{from_step}",
            stubs=dict(stubs),
            observation=cp.observation,
        )
        carry.cursor = TranscriptCursor()
        lease = await self._take_lease(tenant, new_id)
        async with _holding(lease):
            carry.lease = lease
            await self._seal(carry)
            # Keys name the run, so the replay's calls get keys of its own and never find
            # (or complete) a record of the original run.
            replayed = dataclasses.replace(
                cp,
                run_id=new_id,
                pending_approval=None,
                outstanding=tuple(self._outstanding(carry, oc.call) for oc in cp.outstanding),
            )
            if cp.status.finished:
                return _finished_run(replayed)
            return await self._continue(carry, replayed)

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

    async def _take_lease(self, tenant: str, run_id: str) -> Leaseholder | None:
        if self.leases is None:
            return None
        return await Leaseholder.acquire(
            self.leases, tenant, run_id, self.holder, self.lease_policy
        )

    async def _seal(self, carry: _Carry) -> None:
        """Raise the fence in every store this run writes to, before reading anything, so
        a superseded holder is refused even before this holder's first write."""
        fence = carry.fence
        if fence is None:
            return
        stores: list[Any] = [self.idempotency, self.ledger, self.approvals]
        if self.checkpoints is not None:
            stores += [self.checkpoints.store, self.checkpoints.history]
        for store in stores:
            if store is not None:
                await store.seal(carry.tenant, carry.run_id, fence)

    async def _claim_run(self, key: str, tenant: str, run_id: str) -> None:
        try:
            rec = await self.idempotency.claim(
                key,
                holder=self.holder,
                tenant=tenant,
                run_id=run_id,
                iteration=None,
                tool=None,
                call_id=None,
                flags=None,
                ttl=self.resume_claim_ttl,
            )
        except AdkError:
            raise
        except Exception as exc:
            raise StoreUnavailableError(f"the idempotency store is unreachable: {exc}") from exc
        if rec.status is not RecordStatus.in_flight or rec.holder != self.holder:
            raise ResumeConflictError(
                f"run {run_id!r} is being resumed by {rec.holder}", holder=rec.holder
            )

    async def _release_claim(self, key: str) -> None:
        try:
            await self.idempotency.release(key, holder=self.holder)
        except Exception as exc:  # it expires on its own; only work is lost
            _log.warning("releasing the resume claim failed: %r", exc)

    async def _restore(self, carry: _Carry, cp: Checkpoint, plan: ResumePlan) -> None:
        checkpoints = self._require_checkpoints()
        carry.messages = await checkpoints.messages(cp)
        carry.iteration = cp.iteration
        carry.step = cp.step
        carry.steps_used = cp.steps_used
        carry.usage = cp.usage
        carry.state = state_from_json(cp.state, carry.agent.state_schema)
        carry.grants = list(cp.grants)
        carry.replay_of = cp.replay_of
        carry.observation = cp.observation
        carry.cursor = TranscriptCursor(handle=cp.history_handle, persisted=len(carry.messages))
        carry.takeover_keys = {p.key for p in plan.to_dispatch if p.takeover and p.key}
        for p in plan.completed:
            if p.ahead and p.side_effects and p.key and p.iteration is not None:
                carry.ahead.setdefault(p.iteration, set()).add(p.key)
        if self.ledger is not None:
            carry.spent = await self.ledger.spent(carry.tenant, carry.run_id)
        else:
            carry.spent = cp.micros

    # --- the loop ------------------------------------------------------------------------

    async def _continue(self, carry: _Carry, cp: Checkpoint) -> Run:
        """Pick up at the frontier's boundary, then go on with the loop."""
        if cp.boundary is Boundary.after_tool_result:
            carry.iteration = cp.iteration + 1
            return await self._loop(carry)
        calls = list(cp.outstanding)
        if cp.pending_approval is not None:
            waiting = await self._decided(carry, cp.pending_approval.id, calls)
            if waiting is not None:
                return waiting
            # Before the decided turn dispatches anything, a frontier without the pending
            # request must name its unkeyed calls: a later resume then knows they may have run.
            await self._name_unkeyed(carry, calls)
        # A crash between the after_model_call frontier and the approval request (or a
        # replay from such a step) still asks before dispatching.
        waiting = await self._ask_approval(carry, calls)
        if waiting is not None:
            return waiting
        await self._dispatch(carry, calls)
        await self._boundary(carry, Boundary.after_tool_result)
        carry.iteration += 1
        return await self._loop(carry)

    async def _loop(self, carry: _Carry) -> Run:
        agent = carry.agent
        while True:
            if agent.budget_micros is not None and carry.spent >= agent.budget_micros:
                return await self._finish(carry, RunStatus.budget_exhausted)
            if carry.iteration >= agent.max_iterations:
                return await self._finish(carry, RunStatus.max_iterations)
            if carry.run_claim is not None:
                await self._claim_run(carry.run_claim, carry.tenant, carry.run_id)
            response = await self._call_model(carry)
            if isinstance(response, str):
                return await self._finish(carry, RunStatus.failed, output=response)
            message = response.message
            carry.steps_used += 1
            carry.messages.append(message)
            if not message.tool_calls:
                return await self._finish(carry, RunStatus.completed, output=message.text)
            calls = [self._outstanding(carry, c) for c in message.tool_calls]
            self._refuse_divergence(carry, calls)
            # A side-effecting call without a key leaves no record of its own: only a
            # frontier naming it lets a resume refuse instead of sending it again.
            await self._name_unkeyed(carry, calls, boundary_write=True)
            waiting = await self._ask_approval(carry, calls)
            if waiting is not None:
                return waiting
            await self._dispatch(carry, calls)
            await self._boundary(carry, Boundary.after_tool_result)
            carry.iteration += 1

    async def _name_unkeyed(
        self, carry: _Carry, calls: Sequence[OutstandingCall], *, boundary_write: bool = False
    ) -> None:
        """Write the ``after_model_call`` frontier: when the policy asks (``boundary_write``)
        or, whatever the policy, when a side-effecting call without a key is about to be
        sent — it leaves no record, so only a frontier naming it lets a resume refuse
        instead of sending it again. Such a call is not sent if that frontier failed."""
        unkeyed = [oc.call.name for oc in calls if oc.key is None and oc.side_effects]
        if not unkeyed and not boundary_write:
            return
        written = await self._boundary(
            carry, Boundary.after_model_call, outstanding=calls, force=bool(unkeyed)
        )
        if unkeyed and written is False:
            raise StoreUnavailableError(
                f"the frontier naming {', '.join(unkeyed)} (no idempotency key) could not "
                "be written, so it was not dispatched; the run is resumable"
            )

    async def _call_model(self, carry: _Carry) -> ModelResponse | str:
        """The model's answer, or why the run failed (a non-retryable model error)."""
        agent = carry.agent
        request = ModelRequest(
            agent_name=agent.name,
            instructions=agent.instructions,
            messages=tuple(carry.messages),
            tools=tuple(t.spec for t in agent.tools.values()),
            model=agent.model,
            iteration=carry.iteration,
        )
        try:
            response = await self.provider.complete(request)
        except AdkError as exc:
            if exc.retryable:
                raise
            _log.error("run %s failed on a non-retryable model error: %s", carry.run_id, exc)
            return f"{type(exc).__name__}: {exc}"
        carry.usage = carry.usage + response.usage
        carry.spent += response.cost_micros
        if self.ledger is not None:
            self._guard(carry)
            try:
                await self.ledger.charge(
                    carry.tenant,
                    carry.run_id,
                    response.cost_micros,
                    response.usage,
                    fence=carry.fence,
                )
            except AdkError:
                raise
            except Exception as exc:
                raise StoreUnavailableError(f"the ledger is unreachable: {exc}") from exc
        return response

    def _outstanding(self, carry: _Carry, call: ToolCall) -> OutstandingCall:
        tool = carry.agent.tools.get(call.name)
        if tool is None:  # answered with an error, never dispatched
            return OutstandingCall(call=call, key=None, side_effects=False)
        return OutstandingCall(
            call=call,
            key=tool.key_for(
                tenant=carry.tenant, run_id=carry.run_id, iteration=carry.iteration, call=call
            ),
            side_effects=tool.side_effects,
            idempotent=tool.idempotent,
        )

    def _refuse_divergence(self, carry: _Carry, calls: Sequence[OutstandingCall]) -> None:
        """Before anything of this turn is written: the run went further than its frontier,
        and the resumed model must ask again for exactly the side-effecting calls made."""
        done = carry.ahead.get(carry.iteration)
        if done:
            asked = {oc.key for oc in calls if oc.side_effects}
            extra = [oc.call.name for oc in calls if oc.side_effects and oc.key not in done]
            if extra:
                raise DivergedRunError(
                    f"run {carry.run_id!r} diverged at iteration {carry.iteration}: the model "
                    f"now asks for {', '.join(extra)}, which is not what already ran there"
                )
            missing = done - asked
            if not missing:
                del carry.ahead[carry.iteration]
        if not calls and carry.ahead:
            raise DivergedRunError(
                f"run {carry.run_id!r} diverged: it would finish without asking again for "
                f"{sum(len(v) for v in carry.ahead.values())} side-effecting call(s) that "
                "already ran"
            )

    # --- approvals -----------------------------------------------------------------------

    async def _ask_approval(self, carry: _Carry, calls: Sequence[OutstandingCall]) -> Run | None:
        decided = {g.call_id for g in carry.grants}
        needing = [
            oc.call
            for oc in calls
            if (tool := carry.agent.tools.get(oc.call.name)) is not None
            and tool.requires_approval
            and oc.call.id not in decided
        ]
        if not needing:
            return None
        assert self.approvals is not None  # _check_agent
        self._guard(carry)
        redactor = self.redactor
        request = await self.approvals.request(
            carry.tenant,
            carry.run_id,
            [
                ToolCall(id=c.id, name=c.name, arguments=redactor.value(dict(c.arguments)))
                for c in needing
            ],
            iteration=carry.iteration,
            fence=carry.fence,
        )
        pending = PendingApproval(id=request.id, calls=tuple(c.id for c in needing))
        await self._boundary(
            carry,
            Boundary.before_approval,
            outstanding=calls,
            status=CheckpointStatus.waiting_approval,
            pending=pending,
        )
        return self._run(carry, RunStatus.waiting_approval, pending_approval=request)

    async def _decided(
        self, carry: _Carry, request_id: str, calls: Sequence[OutstandingCall]
    ) -> Run | None:
        """``None`` once the request is decided (grants added); else the waiting run."""
        if self.approvals is None:
            raise ConfigurationError("this run waits on an approval; the runner has no store")
        request = await self.approvals.get(carry.tenant, request_id)
        if request is None:
            raise NoCheckpointError(f"approval request {request_id!r} is gone")
        if request.status is ApprovalStatus.pending:
            return self._run(carry, RunStatus.waiting_approval, pending_approval=request)
        approved = request.status is ApprovalStatus.approved
        known = {g.call_id for g in carry.grants}
        keys = {oc.call.id: oc.key for oc in calls}
        for call in request.calls:
            if call.id not in known:
                carry.grants.append(
                    Grant(
                        request=request.id,
                        call_id=call.id,
                        key=keys.get(call.id),
                        approved=approved,
                        by=request.by,
                        note=request.note,
                    )
                )
        return None

    # --- dispatch ------------------------------------------------------------------------

    async def _dispatch(self, carry: _Carry, calls: Sequence[OutstandingCall]) -> None:
        grants = {g.call_id: g for g in carry.grants}
        results: list[Message] = []
        observed: list[dict[str, Any]] = []
        for oc in calls:
            tool = carry.agent.tools.get(oc.call.name)
            if tool is None:
                outcome = ToolOutcome(
                    call_id=oc.call.id, content=f"unknown tool {oc.call.name!r}", is_error=True
                )
            elif tool.requires_approval and not _approved(grants.get(oc.call.id)):
                outcome = ToolOutcome(
                    call_id=oc.call.id, content=_denial(grants.get(oc.call.id)), is_error=True
                )
            else:
                outcome = await self._call_tool(carry, tool, oc)
            results.append(Message.tool_result(outcome))
            observed.append(
                {
                    "call_id": oc.call.id,
                    "tool": oc.call.name,
                    "content": outcome.content,
                    "is_error": outcome.is_error,
                }
            )
        carry.messages.extend(results)
        carry.observation = observed
        # Grants of a finished turn are settled; only the run's decisions stay on record.
        carry.grants = [g for g in carry.grants if g.call_id not in {c.call.id for c in calls}]

    async def _call_tool(self, carry: _Carry, tool: Tool, oc: OutstandingCall) -> ToolOutcome:
        ctx = ToolContext(
            tenant=carry.tenant,
            run_id=carry.run_id,
            call=oc.call,
            idempotency_key=oc.key,
            fence=carry.fence,
            iteration=carry.iteration,
            state=carry.state,
        )
        # Before every dispatch, keyed or not: a holder that may have lost the run sends
        # nothing (an unkeyed call has no fence downstream to stop it).
        self._guard(carry)
        if oc.key is None:
            return await self._invoke(carry, tool, oc.call, ctx)
        rec: IdempotencyRecord | None
        try:
            rec = await self.idempotency.claim(
                oc.key,
                holder=self.holder,
                tenant=carry.tenant,
                run_id=carry.run_id,
                iteration=carry.iteration,
                tool=tool.name,
                call_id=oc.call.id,
                flags=ToolFlags(side_effects=tool.side_effects, idempotent=tool.idempotent),
                fence=carry.fence,
                takeover=oc.key in carry.takeover_keys,
            )
        except AdkError:
            raise
        except Exception as exc:
            # A lost reply is settled by reading the record again, never by assuming.
            found = await _quietly(self.idempotency.lookup([oc.key]))
            rec = None if found is None else found.get(oc.key)
            if rec is None or not (
                rec.status is RecordStatus.completed
                or (rec.status is RecordStatus.in_flight and rec.holder == self.holder)
            ):
                raise StoreUnavailableError(
                    f"the idempotency store is unreachable; {tool.name} ({oc.call.id}) was not "
                    f"dispatched: {exc}"
                ) from exc
        if rec.status is RecordStatus.completed and rec.outcome is not None:
            return decode_outcome(rec.outcome, oc.call.id)
        if rec.status is not RecordStatus.in_flight or rec.holder != self.holder:
            raise IndeterminateToolCallError(
                f"{tool.name} ({oc.call.id}) is claimed in flight by {rec.holder}; nobody can "
                "say whether it ran"
            )
        outcome = await self._invoke(carry, tool, oc.call, ctx)
        encoded = encode_outcome(outcome, self.redactor)
        try:
            await self.idempotency.complete(oc.key, encoded, holder=self.holder)
        except AdkError:
            raise
        except Exception as exc:
            # A lost reply is settled by reading the record again, never by assuming.
            found = await _quietly(self.idempotency.lookup([oc.key]))
            rec2 = None if found is None else found.get(oc.key)
            if rec2 is None or rec2.status is not RecordStatus.completed:
                raise StoreUnavailableError(
                    f"{tool.name} ({oc.call.id}) ran but its outcome could not be recorded: {exc}"
                ) from exc
        return outcome

    async def _invoke(
        self, carry: _Carry, tool: Tool, call: ToolCall, ctx: ToolContext
    ) -> ToolOutcome:
        try:
            stub = None if carry.stubs is None else carry.stubs.get(tool.name)
            if stub is not None:
                result = _stub_result(await _call_stub(stub, call, ctx))
            else:
                result = await tool.invoke(call.arguments, ctx)
            return ToolOutcome(call_id=call.id, content=to_jsonable_python(result, fallback=str))
        except Exception as exc:
            return ToolOutcome(
                call_id=call.id, content=f"{type(exc).__name__}: {exc}", is_error=True
            )

    # --- writing frontiers ---------------------------------------------------------------

    def _guard(self, carry: _Carry) -> None:
        if carry.lease is not None:
            carry.lease.check()

    async def _boundary(
        self,
        carry: _Carry,
        boundary: Boundary,
        *,
        outstanding: Sequence[OutstandingCall] = (),
        status: CheckpointStatus = CheckpointStatus.running,
        pending: PendingApproval | None = None,
        final: bool = False,
        force: bool = False,
        output: str | None = None,
    ) -> bool | None:
        """Write a frontier if the policy (or ``final``/``force``) asks for one: ``True``
        written, ``False`` attempted and failed, ``None`` not attempted."""
        checkpoints = self.checkpoints
        if checkpoints is None:
            return None
        forced = final or force or boundary is Boundary.before_approval
        if not forced and boundary not in checkpoints.policy.boundaries:
            return None
        self._guard(carry)
        carry.step += 1
        try:
            state = state_to_json(carry.state, carry.agent.state_schema)
        except AdkError as exc:
            checkpoints.last_error = exc
            _log.warning("run %s: state not checkpointed: %s", carry.run_id, exc)
            return False
        frontier = Checkpoint(
            tenant=carry.tenant,
            run_id=carry.run_id,
            agent_name=carry.agent.name,
            agent_revision=carry.agent.revision,
            step=carry.step,
            boundary=boundary,
            status=status,
            iteration=carry.iteration,
            fence=carry.fence,
            messages=tuple(carry.messages),
            outstanding=tuple(outstanding),
            pending_approval=pending,
            grants=tuple(carry.grants),
            usage=carry.usage,
            micros=carry.spent,
            state=state,
            steps_used=carry.steps_used,
            replay_of=carry.replay_of,
            output=output,
            written_at=time.time(),
            observation=carry.observation,
        )
        return await checkpoints.write(frontier, cursor=carry.cursor)

    async def _finish(self, carry: _Carry, status: RunStatus, *, output: str | None = None) -> Run:
        # However the run ends, it must not end having skipped a call that already ran.
        self._refuse_divergence(carry, ())
        await self._boundary(
            carry,
            Boundary.after_model_call,
            status=CheckpointStatus(status.value),
            final=True,
            output=output,
        )
        return self._run(carry, status, output=output)

    def _run(
        self,
        carry: _Carry,
        status: RunStatus,
        *,
        output: str | None = None,
        pending_approval: ApprovalRequest | None = None,
    ) -> Run:
        return Run(
            run_id=carry.run_id,
            tenant=carry.tenant,
            agent_name=carry.agent.name,
            status=status,
            output=output,
            iteration=carry.iteration,
            usage=carry.usage,
            spent_micros=carry.spent,
            pending_approval=pending_approval,
            replay_of=carry.replay_of,
            fence=carry.fence,
        )


# --- helpers -----------------------------------------------------------------------------


def _approved(grant: Grant | None) -> bool:
    return grant is not None and grant.approved


def _denial(grant: Grant | None) -> str:
    if grant is None:  # pragma: no cover - _ask_approval runs before every dispatch
        return "not approved"
    note = f": {grant.note}" if grant.note else ""
    return f"denied by {grant.by}{note}"


def _as_messages(input: str | Message | Sequence[Message]) -> list[Message]:
    if isinstance(input, str):
        return [Message.user(input)]
    if isinstance(input, Message):
        return [input]
    return list(input)


def _refuse_unresumable(cp: Checkpoint, agent: Agent) -> None:
    if cp.is_tombstone:
        raise CheckpointTooLargeError(
            f"run {cp.run_id!r} cannot be carried on: its frontier at step {cp.step} was "
            f"refused ({cp.reason})",
            retryable=False,
        )
    if cp.agent_revision != agent.revision:
        raise RevisionMismatchError(
            f"run {cp.run_id!r} was checkpointed by agent {cp.agent_name!r} revision "
            f"{cp.agent_revision}; this agent is revision {agent.revision}"
        )
    if cp.status is CheckpointStatus.failed:
        raise RunFailedError(f"run {cp.run_id!r} ended failed at step {cp.step}")


def _nothing_ran_since_approval_asked(cp: Checkpoint, plan: ResumePlan) -> bool:
    """A ``before_approval`` frontier is only ever followed by a dispatch after a newer
    frontier named the turn's unkeyed calls; so while it is the latest, those calls did not
    run, and only a claimed record can make a call indeterminate."""
    return cp.boundary is Boundary.before_approval and all(
        p.record is None and not p.ahead for p in plan.indeterminate
    )


def _finished_run(cp: Checkpoint) -> Run:
    return Run(
        run_id=cp.run_id,
        tenant=cp.tenant,
        agent_name=cp.agent_name,
        status=RunStatus(cp.status.value),
        output=cp.output,
        iteration=cp.iteration,
        usage=cp.usage,
        spent_micros=cp.micros,
        replay_of=cp.replay_of,
    )


async def _call_stub(stub: Callable[..., Any], call: ToolCall, ctx: ToolContext) -> Any:
    return await call_maybe_async(stub, dict(call.arguments), ctx if accepts_ctx(stub) else None)


def _stub_result(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {**value, "stub": True}
    return {"stub": True, "value": value}


@contextlib.asynccontextmanager
async def _holding(lease: Leaseholder | None) -> Any:
    if lease is None:
        yield None
        return
    async with lease:
        yield lease


async def _shielded(awaitable: Awaitable[None]) -> None:
    """Finish cleanup even when the caller is being cancelled, then let the cancel through."""
    task = asyncio.ensure_future(awaitable)
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        with contextlib.suppress(Exception):
            await task
        raise


async def _quietly(awaitable: Awaitable[Any]) -> Any:
    try:
        return await awaitable
    except Exception:
        return None
