"""``AgentWorkflow``: the run loop as a deterministic Temporal workflow.

Each turn is a model activity, then one activity per call, in the model's order. The
workflow holds only numbers and names (iteration, the results of the turn in hand); the
transcript lives in the kit's stores and crosses executions as a handle. After every turn
it asks ``ContinuationPolicy.due`` and the server's ``is_continue_as_new_suggested``; when
either says so it closes the turn into a frontier, waits for its handlers, and continues as
new with ``continued(...)``: transcript handle, spend, iteration, approvals and grants —
never the journal. Approvals are the kit's: the request is in the approval store, where
``tesserix approve`` decides it; the workflow looks there on a short timer, and a signal
(``tesserix.approval_decided``) wakes it at once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any, NoReturn, TypeVar

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError

with workflow.unsafe.imports_passed_through():
    from tesserix_adk.checkpoint.continuation import ContinuationPolicy, continued
    from tesserix_adk.checkpoint.payload import Grant, PendingApproval
    from tesserix_adk.stores.protocols import HistoryHandle
    from tesserix_adk.temporal.shapes import (
        MODEL_ACTIVITY,
        TOOL_ACTIVITY,
        WORKFLOW_NAME,
        CallRef,
        ContinueReason,
        ModelStep,
        RunInput,
        RunOutcome,
        StepKind,
        StepResult,
        ToolInput,
        ToolResult,
        carried_from,
        continuation_from,
    )

__all__ = ["APPROVAL_SIGNAL", "AgentWorkflow"]

T = TypeVar("T")

APPROVAL_SIGNAL = "tesserix.approval_decided"


@dataclass(slots=True, kw_only=True)
class _Standing:
    """What ``continued`` reads (a ``ContinuableState``): the journal of this execution
    only, to count its steps, and what the last activity said of the run."""

    run_id: str
    journal: Sequence[Any] = ()
    history_handle: HistoryHandle | None = None
    spent_micros: int = 0
    iteration: int = 0
    grants: Sequence[Grant] = ()
    pending_approval: PendingApproval | None = None


@workflow.defn(name=WORKFLOW_NAME)
class AgentWorkflow:
    """One agent run; the workflow id is the kit's run id."""

    def __init__(self) -> None:
        self._woken = False

    @workflow.signal(name=APPROVAL_SIGNAL)
    async def approval_decided(self) -> None:
        """An approval of this run was decided: look at once, not at the next timer."""
        self._woken = True

    @workflow.run
    async def run(self, start: RunInput) -> RunOutcome:
        """Carry the run until it ends; continue-as-new whenever it has run long enough."""
        policy = ContinuationPolicy(
            max_steps=start.max_steps, max_history_bytes=start.max_history_bytes
        )
        standing = _Standing(run_id=start.run_id)
        carried = start.carried
        history = None
        results: list[ToolResult] | None = None
        if carried is not None:
            # Rebuilt, so a carry that dropped an approval is refused here too.
            continuation_from(
                carried, tenant=start.tenant, agent_name=start.agent_name, run_id=start.run_id
            )
            standing.iteration = carried.iteration
            history = carried.history
        step: StepResult
        resumed = start.carried_on
        if carried is not None and carried.pending_approval is not None:
            step = await self._model(start, standing.iteration, resumed=resumed)
        else:
            step = await self._model(start, standing.iteration, history=history, resumed=resumed)
        while True:
            while step.kind is StepKind.waiting:
                reason = self._continue_reason(policy, standing)
                if reason is not None:
                    return await self._continue(start, standing, step, reason)
                self._woken = False
                # The timer elapsing is the usual way: the decision is made in the approval
                # store (``tesserix approve``), which knows nothing of Temporal.
                with contextlib.suppress(TimeoutError):
                    await workflow.wait_condition(
                        lambda: self._woken, timeout=timedelta(seconds=start.approval_poll)
                    )
                step = await self._model(start, step.iteration)
            if step.kind is StepKind.finished:
                return RunOutcome(
                    run_id=start.run_id,
                    status=step.status or "completed",
                    output=step.output,
                    iteration=step.iteration,
                    chain=list(start.chain),
                )
            results = [await self._tool(start, step.iteration, c) for c in step.calls]
            standing.journal = [*standing.journal, step.iteration]
            standing.iteration = step.iteration + 1
            reason = self._continue_reason(policy, standing)
            if reason is not None:
                folded = await self._model(
                    start, standing.iteration, results=results, fold_only=True
                )
                return await self._continue(start, standing, folded, reason)
            step = await self._model(start, standing.iteration, results=results)

    def _continue_reason(
        self, policy: ContinuationPolicy, standing: _Standing
    ) -> ContinueReason | None:
        info = workflow.info()
        if policy.due(standing.journal, history_bytes=info.get_current_history_size()):
            return ContinueReason.policy
        if info.is_continue_as_new_suggested():
            return ContinueReason.suggested
        return None

    async def _continue(
        self, start: RunInput, standing: _Standing, step: StepResult, reason: ContinueReason
    ) -> NoReturn:
        standing.history_handle = None if step.history is None else HistoryHandle(**step.history)
        standing.spent_micros = step.spent_micros
        standing.iteration = step.iteration
        standing.grants = [Grant(**g) for g in step.grants]
        if step.kind is StepKind.waiting and step.approval is not None:
            standing.pending_approval = PendingApproval(id=step.approval, calls=())
        carry = continued(standing, tenant=start.tenant, agent_name=start.agent_name)
        # A signal being handled (an approval decided) must not be cut off by the new run.
        await workflow.wait_condition(workflow.all_handlers_finished)
        workflow.continue_as_new(
            replace(
                start,
                input=None,
                carried=carried_from(carry),
                chain=[*start.chain, reason],
                carried_on=False,
            )
        )

    async def _model(
        self,
        start: RunInput,
        iteration: int,
        *,
        results: list[ToolResult] | None = None,
        fold_only: bool = False,
        history: dict[str, Any] | None = None,
        resumed: bool = False,
    ) -> StepResult:
        step = ModelStep(
            tenant=start.tenant,
            run_id=start.run_id,
            agent_name=start.agent_name,
            agent_revision=start.agent_revision,
            iteration=iteration,
            input=start.input if start.carried is None else None,
            results=results,
            fold_only=fold_only,
            history=history,
            resumed=resumed,
        )
        options = start.options
        return await _named(
            workflow.execute_activity(
                MODEL_ACTIVITY,
                step,
                result_type=StepResult,
                start_to_close_timeout=timedelta(seconds=options.model_timeout),
                retry_policy=self._retry(start),
            )
        )

    async def _tool(self, start: RunInput, iteration: int, ref: CallRef) -> ToolResult:
        call = ToolInput(
            tenant=start.tenant,
            run_id=start.run_id,
            agent_name=start.agent_name,
            agent_revision=start.agent_revision,
            iteration=iteration,
            call_id=ref.call_id,
            position=ref.position,
        )
        options = start.options
        return await _named(
            workflow.execute_activity(
                TOOL_ACTIVITY,
                call,
                result_type=ToolResult,
                start_to_close_timeout=timedelta(seconds=options.tool_timeout),
                heartbeat_timeout=timedelta(seconds=options.heartbeat_timeout),
                retry_policy=self._retry(start),
            )
        )

    def _retry(self, start: RunInput) -> RetryPolicy:
        return RetryPolicy(
            initial_interval=timedelta(seconds=start.options.retry_initial),
            maximum_interval=timedelta(seconds=start.options.retry_max),
            backoff_coefficient=2.0,
        )


async def _named(activity: Awaitable[T]) -> T:
    """The activity's result; a refusal the kit made ends the workflow as itself (its
    type and message, naming the call), not as a wrapped activity failure."""
    try:
        return await activity
    except ActivityError as exc:
        cause = exc.cause
        if isinstance(cause, ApplicationError) and cause.non_retryable:
            raise ApplicationError(cause.message, type=cause.type, non_retryable=True) from exc
        raise
