"""Building a Temporal worker that carries agent runs, and starting a run as a workflow."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from temporalio.client import Client, WorkflowHandle
from temporalio.common import WorkflowIDReusePolicy
from temporalio.worker import Worker

from tesserix_adk.agent import Agent
from tesserix_adk.checkpoint.continuation import DEFAULT_CONTINUATION, ContinuationPolicy
from tesserix_adk.checkpoint.payload import Checkpoint
from tesserix_adk.checkpoint.redaction import Redactor
from tesserix_adk.run.ids import check_ids
from tesserix_adk.run.runner import AgentRunner
from tesserix_adk.temporal.activities import AgentActivities
from tesserix_adk.temporal.shapes import (
    WORKFLOW_NAME,
    ActivityOptions,
    ContinueReason,
    RunInput,
    RunOutcome,
    carried_from_frontier,
)
from tesserix_adk.temporal.workflow import AgentWorkflow

__all__ = ["agent_worker", "carry_on_run", "start_run"]


def agent_worker(
    client: Client,
    *,
    task_queue: str,
    runner: AgentRunner,
    agents: Sequence[Agent],
    heartbeat_every: float = 1.0,
    **worker_options: Any,
) -> Worker:
    """A Temporal ``Worker`` on ``task_queue`` carrying runs of ``agents`` with ``runner``'s
    stores and provider (``AgentRunner.from_stores``); run it with ``await worker.run()``
    or ``async with worker``. ``worker_options`` go to ``temporalio.worker.Worker``."""
    activities = AgentActivities(runner, agents, heartbeat_every=heartbeat_every)
    return Worker(
        client,
        task_queue=task_queue,
        workflows=[AgentWorkflow],
        activities=[activities.model_turn, activities.tool_call],
        **worker_options,
    )


async def start_run(
    client: Client,
    agent: Agent,
    input: str,
    *,
    tenant: str,
    run_id: str,
    task_queue: str,
    continuation: ContinuationPolicy = DEFAULT_CONTINUATION,
    options: ActivityOptions | None = None,
    approval_poll: float = 2.0,
    redactor: Redactor | None = None,
    task_timeout: float | None = None,
    id_reuse_policy: WorkflowIDReusePolicy = WorkflowIDReusePolicy.REJECT_DUPLICATE,
) -> WorkflowHandle[Any, RunOutcome]:
    """Start ``agent`` on ``input`` as an ``AgentWorkflow`` whose workflow id is the kit's
    run id, pinned to the agent's revision; its handle. A run id used before is refused by
    the server (one run, one chain; ``id_reuse_policy`` says otherwise). The input enters
    Temporal's history redacted (by ``redactor``, the kit's default masking without one),
    as ``submit`` stores it.
    ``task_timeout``: seconds a workflow task may take (the server's default, 10 s, without
    one) — how long a worker frozen mid-task holds the run up before another takes it."""
    check_ids(tenant=tenant, run_id=run_id)
    input = (redactor or Redactor()).text(input)
    start = RunInput(
        tenant=tenant,
        run_id=run_id,
        agent_name=agent.name,
        agent_revision=agent.revision,
        input=input,
        max_steps=continuation.max_steps,
        max_history_bytes=continuation.max_history_bytes,
        options=options or ActivityOptions(),
        approval_poll=approval_poll,
    )
    return await client.start_workflow(
        WORKFLOW_NAME,
        start,
        id=run_id,
        task_queue=task_queue,
        result_type=RunOutcome,
        id_reuse_policy=id_reuse_policy,
        task_timeout=None if task_timeout is None else timedelta(seconds=task_timeout),
    )


async def carry_on_run(
    client: Client,
    agent: Agent,
    checkpoint: Checkpoint,
    *,
    spent_micros: int,
    task_queue: str,
    continuation: ContinuationPolicy = DEFAULT_CONTINUATION,
    options: ActivityOptions | None = None,
    approval_poll: float = 2.0,
    task_timeout: float | None = None,
    chain: Sequence[ContinueReason] = (),
) -> WorkflowHandle[Any, RunOutcome]:
    """Start a new execution of a run whose workflow closed without finishing it (failed,
    say, on a call in doubt that ``tesserix resolve`` has since settled), from its frontier
    ``checkpoint``, as a continue-as-new would carry it: the transcript handle, the spend
    (``spent_micros``, the ledger's), the iteration, approvals and grants; ``chain`` says
    why earlier executions continued as new. A call of its open turn that the closed
    execution may have sent without a key is refused as in doubt. The server refuses it
    (``WorkflowAlreadyStartedError``) while an execution of the run is open or once one
    completed."""
    check_ids(tenant=checkpoint.tenant, run_id=checkpoint.run_id)
    start = RunInput(
        tenant=checkpoint.tenant,
        run_id=checkpoint.run_id,
        agent_name=agent.name,
        agent_revision=agent.revision,
        carried=carried_from_frontier(checkpoint, spent_micros),
        max_steps=continuation.max_steps,
        max_history_bytes=continuation.max_history_bytes,
        options=options or ActivityOptions(),
        approval_poll=approval_poll,
        chain=list(chain),
        carried_on=True,
    )
    return await client.start_workflow(
        WORKFLOW_NAME,
        start,
        id=checkpoint.run_id,
        task_queue=task_queue,
        result_type=RunOutcome,
        # Only a failed, terminated, timed-out or cancelled execution's id is taken again.
        id_reuse_policy=WorkflowIDReusePolicy.ALLOW_DUPLICATE_FAILED_ONLY,
        task_timeout=None if task_timeout is None else timedelta(seconds=task_timeout),
    )
