"""Settling calls in doubt with their tools' reconcilers, before a resume gives up on them.

Runs under the run's lease, so no other worker is carrying the run while a call's fate is
recorded. A ``never_ran`` answer is asked for only once the margin past the previous lease
has passed (``leases.never_ran_wait``): a claimant whose lease just lapsed may have sent the
call a moment before, and the external system must be asked after it could have landed.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import threading
from typing import Any

from tesserix_adk.agent import Agent
from tesserix_adk.checkpoint.payload import encode_outcome
from tesserix_adk.checkpoint.planning import PlannedCall, ResumePlan
from tesserix_adk.checkpoint.redaction import Redactor
from tesserix_adk.leases import NEVER_RAN_MARGIN, never_ran_wait
from tesserix_adk.messages import ToolCall, ToolOutcome
from tesserix_adk.reconcile import Reconciled, ReconciledAs
from tesserix_adk.run.attempt import Attempt
from tesserix_adk.run.parts import RunParts
from tesserix_adk.stores.grouping import outside_scope
from tesserix_adk.tools import Tool, ToolContext

__all__ = ["RECONCILE_TIMEOUT", "reconcile_in_doubt"]

RECONCILE_TIMEOUT = 30.0
"""Seconds a reconciler may take before its answer counts as unknown."""

_log = logging.getLogger("tesserix_adk.runner")


async def reconcile_in_doubt(
    parts: RunParts,
    agent: Agent,
    plan: ResumePlan,
    attempt: Attempt,
    *,
    tenant: str,
    run_id: str,
    margin: float = NEVER_RAN_MARGIN,
) -> bool:
    """Ask the reconciler of each call in doubt and record what it knows; whether anything
    was recorded (then the plan is made again)."""
    askable = [
        (pc, tool)
        for pc in plan.indeterminate
        if pc.key is not None
        and (tool := agent.tools.get(pc.tool)) is not None
        and tool.reconcile is not None
    ]
    if not askable:
        return False
    # Without a lease store nothing says when the last carrier stopped: wait a whole margin.
    ended = attempt.lease.since_previous_end() if attempt.lease is not None else 0.0
    wait = never_ran_wait(ended, margin)
    if wait > 0:
        # The lease keeps renewing meanwhile; the run is held, nobody else moves.
        _log.info(
            "run %s: waiting %.1f s past the previous lease before asking reconcilers",
            run_id,
            wait,
        )
        await asyncio.sleep(wait)
    recorded = False
    for pc, tool in askable:
        attempt.guard()
        answer = await _ask(tool, pc, attempt, parts.redactor, tenant=tenant, run_id=run_id)
        if answer.found not in (ReconciledAs.completed, ReconciledAs.never_ran):
            continue
        assert pc.key is not None
        by = f"reconciler:{tool.name}"
        attempt.guard()
        if answer.found is ReconciledAs.never_ran:
            await parts.idempotency.resolve(pc.key, tenant=tenant, never_ran=True, by=by)
        elif answer.found is ReconciledAs.completed:
            outcome = ToolOutcome(call_id=pc.call_id or "", content=answer.content)
            encoded = encode_outcome(outcome, parts.redactor)
            await parts.idempotency.resolve(pc.key, encoded, tenant=tenant, by=by)
        _log.info("run %s: %s settled by its reconciler: %s", run_id, pc.describe(), answer.found)
        recorded = True
    return recorded


async def _ask(
    tool: Tool,
    pc: PlannedCall,
    attempt: Attempt,
    redactor: Redactor,
    *,
    tenant: str,
    run_id: str,
) -> Reconciled:
    """The reconciler's answer; anything but a ``Reconciled`` in time is ``unknown``."""
    assert tool.reconcile is not None
    call = ToolCall(id=pc.call_id or "", name=pc.tool, arguments=dict(pc.arguments or {}))
    ctx = ToolContext(
        tenant=tenant,
        run_id=run_id,
        call=call,
        idempotency_key=pc.key,
        fence=attempt.fence,
        iteration=pc.iteration or 0,
    )
    reconcile = tool.reconcile
    try:
        with outside_scope():
            result = await _reconciled(reconcile, call, ctx)
    except Exception as exc:
        _log.warning(
            "run %s: the reconciler of %s failed (%s: %s); the call stays in doubt",
            run_id,
            pc.describe(),
            type(exc).__name__,
            redactor.text(str(exc)),
        )
        return Reconciled.unknown()
    if not isinstance(result, Reconciled):
        _log.warning(
            "run %s: the reconciler of %s returned %s, not a Reconciled; the call stays in doubt",
            run_id,
            pc.describe(),
            type(result).__name__,
        )
        return Reconciled.unknown()
    return result


async def _reconciled(reconcile: Any, call: ToolCall, ctx: ToolContext) -> Any:
    """What ``reconcile`` says of ``call``, within ``RECONCILE_TIMEOUT``."""
    if inspect.iscoroutinefunction(reconcile):
        return await asyncio.wait_for(reconcile(call, ctx), RECONCILE_TIMEOUT)
    # A sync reconciler asks a remote system: off the loop, so leases keep renewing, and in
    # a daemon thread, so one that hangs past its timeout cannot hold up a draining
    # worker's exit.
    result = await asyncio.wait_for(_in_daemon_thread(reconcile, call, ctx), RECONCILE_TIMEOUT)
    if inspect.isawaitable(result):
        result = await asyncio.wait_for(result, RECONCILE_TIMEOUT)
    return result


def _in_daemon_thread(fn: Any, *args: Any) -> asyncio.Future[Any]:
    """``fn(*args)`` in a daemon thread of its own, as a future of this loop."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()

    def settle(value: Any, error: BaseException | None) -> None:
        if future.done():
            return  # timed out and cancelled meanwhile
        if error is None:
            future.set_result(value)
        else:
            future.set_exception(error)

    def run() -> None:
        try:
            value, error = fn(*args), None
        except BaseException as exc:  # handed to the awaiting task, which judges it
            value, error = None, exc
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            loop.call_soon_threadsafe(settle, value, error)

    threading.Thread(target=run, name="tesserix-reconciler", daemon=True).start()
    return future
