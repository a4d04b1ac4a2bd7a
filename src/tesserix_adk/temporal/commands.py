"""``tesserix worker --temporal`` and ``tesserix submit --temporal``: the command line's
Temporal half (``cli.work`` imports this only when ``--temporal`` is given, so the command
line imports no ``temporalio`` otherwise).

A worker runs until SIGTERM or SIGINT, then shuts down gracefully: it polls no more, lets
its activities finish (each releases its lease) and exits 0. Whatever a run was doing is
carried on by any other worker on the task queue: that is Temporal's job, and the kit's
records say what the next attempt may do.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import signal
from collections.abc import Awaitable, Sequence
from datetime import timedelta
from typing import Any, TextIO

from temporalio.api.workflowservice.v1 import DescribeNamespaceRequest
from temporalio.client import Client, WorkflowExecutionStatus, WorkflowHandle
from temporalio.common import WorkflowIDReusePolicy
from temporalio.exceptions import WorkflowAlreadyStartedError
from temporalio.service import RPCError, RPCStatusCode

from tesserix_adk.agent import Agent
from tesserix_adk.checkpoint.checkpointer import Checkpointer
from tesserix_adk.checkpoint.continuation import (
    ContinuationPolicy,
)
from tesserix_adk.checkpoint.planning import ResumePlan, plan_resume, refuse_if_undecidable
from tesserix_adk.errors import AdkError, ConfigurationError, ResumeConflictError
from tesserix_adk.run.holding import carried_now, lease_lapses
from tesserix_adk.run.resume import nothing_ran_since_approval_asked, refuse_unresumable
from tesserix_adk.run.runner import AgentRunner
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.temporal.shapes import RunInput
from tesserix_adk.temporal.worker import agent_worker, carry_on_run, start_run

__all__ = ["connect", "serve", "submit"]


async def connect(address: str, namespace: str) -> Client:
    """A client of the server at ``address``; a retryable ``AdkError`` (exit 3) when it
    cannot be reached."""
    # Asked first without the SDK: a failed connect leaves its native core's threads
    # behind, and one that calls into Python while the interpreter exits aborts it
    # (SIGABRT, now and then, instead of exit 3). A server that is down never gets there.
    reason = await _unreachable(address)
    if reason is None:
        try:
            client = await Client.connect(address, namespace=namespace)
        except Exception as exc:
            reason = str(exc)
        else:
            await _namespace_known(client, address, namespace)
            return client
    # Not chained: the SDK's error holds its native core, which must not outlive the loop.
    raise AdkError(
        f"the Temporal server at {address} cannot be reached ({reason}); start it or try "
        "again later",
        retryable=True,
    )


async def _namespace_known(client: Client, address: str, namespace: str) -> None:
    """A namespace the server does not know is a command line to fix (exit 2), said before
    a worker announces it is carrying anything."""
    try:
        await client.workflow_service.describe_namespace(
            DescribeNamespaceRequest(namespace=namespace)
        )
    except RPCError as exc:
        if exc.status is RPCStatusCode.NOT_FOUND:
            raise ConfigurationError(
                f"the Temporal server at {address} has no namespace {namespace!r}; name one "
                "it has with --namespace"
            ) from None
        raise AdkError(
            f"the Temporal server at {address} did not answer for namespace {namespace!r} "
            f"({exc.message}); try again later",
            retryable=True,
        ) from None


async def _unreachable(address: str) -> str | None:
    """Why nothing listens at ``address`` (``host:port``), or ``None`` if something does."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        return f"{address!r} is not HOST:PORT"
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, int(port)), 10)
    except (OSError, TimeoutError) as exc:
        return str(exc) or type(exc).__name__
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return None


async def submit(
    address: str,
    namespace: str,
    agent: Agent,
    input: str,
    *,
    tenant: str,
    run_id: str,
    task_queue: str,
    stores: Stores,
) -> str:
    """Start the run as a workflow; its id back. The same run id twice makes one run: while
    its workflow is open, or once the run ended, nothing more is started. A run whose
    workflow closed without finishing it (failed on a call in doubt an operator has since
    resolved, terminated, timed out) is carried on by a new execution from its frontier."""

    async def start() -> None:
        client = await connect(address, namespace)
        try:
            await start_run(
                client, agent, input, tenant=tenant, run_id=run_id, task_queue=task_queue
            )
            return
        except WorkflowAlreadyStartedError:
            pass
        handle = client.get_workflow_handle(run_id)
        # The workflow id is the run id, one namespace for every tenant: the execution
        # holding it may be another tenant's run, never this one's to answer for.
        was = await _started_with(client, handle)
        if was is None or was.tenant != tenant:
            # Unreadable as this kit's input: whose run it is cannot be told, so it is
            # never taken for this tenant's.
            whose = "another tenant's run" if was is not None else "a workflow this kit cannot read"
            raise ConfigurationError(
                f"run id {run_id!r} is the workflow id of {whose} on this Temporal "
                "namespace; nothing was started: choose another run id"
            )
        if await _open_or_completed(handle):
            return
        cp = await Checkpointer.from_stores(stores).latest(tenant, run_id)
        if cp is not None and (cp.status.finished or cp.is_tombstone):
            return  # the run ended; submitting its id again makes no second run
        # The closed execution's own settings (and, before any frontier, its own input: the
        # same run id is the same request, whatever this submit says).
        options, poll = was.options, was.approval_poll
        policy = ContinuationPolicy(
            max_steps=was.max_steps, max_history_bytes=was.max_history_bytes
        )
        with contextlib.suppress(WorkflowAlreadyStartedError):  # another submit was first
            if cp is None:  # its workflow closed before the run's first frontier
                first = input if was.input is None else was.input
                await start_run(
                    client,
                    agent,
                    first,
                    tenant=tenant,
                    run_id=run_id,
                    task_queue=task_queue,
                    continuation=policy,
                    options=options,
                    approval_poll=poll,
                    id_reuse_policy=WorkflowIDReusePolicy.ALLOW_DUPLICATE_FAILED_ONLY,
                )
                return
            # Refused here, in one sentence, rather than by the execution it would start.
            refuse_unresumable(cp, agent)
            plan = await plan_resume(cp, stores.idempotency)
            if not nothing_ran_since_approval_asked(cp, plan):
                await _unless_held(stores, plan, tenant, run_id)
                refuse_if_undecidable(plan)
            await carry_on_run(
                client,
                agent,
                cp,
                spent_micros=await stores.ledger.spent(tenant, run_id),
                task_queue=task_queue,
                continuation=policy,
                options=options,
                approval_poll=poll,
                chain=was.chain,
            )

    await _dropping_the_client(start())
    return run_id


async def _open_or_completed(handle: WorkflowHandle[Any, Any]) -> bool:
    """Whether the run's newest workflow execution is open or completed (so submitting its
    id again starts nothing)."""
    status = (await handle.describe()).status
    return status in (None, WorkflowExecutionStatus.RUNNING, WorkflowExecutionStatus.COMPLETED)


async def _started_with(client: Client, handle: WorkflowHandle[Any, Any]) -> RunInput | None:
    """The input the run's newest execution was started with, or ``None`` if its history
    does not begin with one this kit reads."""
    async for event in handle.fetch_history_events(page_size=1):
        started = event.workflow_execution_started_event_attributes
        if not started.input.payloads:
            return None
        try:
            (was,) = await client.data_converter.decode(started.input.payloads, [RunInput])
        except Exception:  # written by another kit or by hand: use this submit's settings
            return None
        return was if isinstance(was, RunInput) else None
    return None


async def serve(
    address: str,
    namespace: str,
    *,
    runner: AgentRunner,
    agents: Sequence[Agent],
    task_queue: str,
    concurrency: int,
    out: TextIO,
    name: str,
) -> None:
    """Carry runs of ``agents`` from ``task_queue`` until SIGTERM or SIGINT."""

    async def work() -> None:
        client = await connect(address, namespace)
        await _serve(
            client,
            runner=runner,
            agents=agents,
            task_queue=task_queue,
            concurrency=concurrency,
            out=out,
            name=name,
        )

    await _dropping_the_client(work())


async def _dropping_the_client(work: Awaitable[None]) -> None:
    """Run ``work`` (which made the only client), then collect that client while the event
    loop still runs: a client alive when the interpreter exits can crash it there (the SDK's
    native threads call into Python while it finalizes; SIGSEGV or SIGABRT now and then
    under load instead of the command's exit code)."""
    try:
        await work
    finally:
        del work
        gc.collect()


async def _serve(
    client: Client,
    *,
    runner: AgentRunner,
    agents: Sequence[Agent],
    task_queue: str,
    concurrency: int,
    out: TextIO,
    name: str,
) -> None:
    worker = agent_worker(
        client,
        task_queue=task_queue,
        runner=runner,
        agents=agents,
        max_concurrent_activities=concurrency,
        graceful_shutdown_timeout=timedelta(seconds=30),
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    installed = []
    for signum in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(signum, _stopping, stop, out, name, signum)
            installed.append(signum)
    try:
        async with worker:
            out.write(
                f"worker {name}: carrying runs of {', '.join(a.name for a in agents)} from "
                f"Temporal task queue {task_queue}, {concurrency} activities at a time\n"
            )
            out.flush()
            await stop.wait()
    finally:
        for signum in installed:
            loop.remove_signal_handler(signum)


def _stopping(stop: asyncio.Event, out: TextIO, name: str, signum: int) -> None:
    if not stop.is_set():
        out.write(
            f"worker {name}: {signal.Signals(signum).name}: shutting down (running "
            "activities finish first)\n"
        )
        out.flush()
    stop.set()


async def _unless_held(stores: Stores, plan: ResumePlan, tenant: str, run_id: str) -> None:
    """``ResumeConflictError`` when a call in doubt may be the live holder's: the run's
    lease is still held (a closed execution's activity, still inside its tool), so the
    call may be being sent now, and is not an operator's to decide yet."""
    if plan.indeterminate and await carried_now(stores.leases, tenant, run_id):
        calls = ", ".join(p.describe() for p in plan.indeterminate)
        raise ResumeConflictError(
            f"run {run_id!r} is still held, and its holder may be sending {calls}; submit it "
            "again once it lets go" + await lease_lapses(stores.leases, tenant, run_id)
        )
