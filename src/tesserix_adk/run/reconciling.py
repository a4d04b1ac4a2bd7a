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
from tesserix_adk.checkpoint.payload import record_tag
from tesserix_adk.checkpoint.planning import PlannedCall, ResumePlan
from tesserix_adk.checkpoint.redaction import Masked, Redactor
from tesserix_adk.errors import AdkError
from tesserix_adk.leases import NEVER_RAN_MARGIN, never_ran_wait
from tesserix_adk.messages import ToolCall, ToolOutcome
from tesserix_adk.reconcile import Reconciled, ReconciledAs
from tesserix_adk.run.attempt import Attempt
from tesserix_adk.run.invoking import converted, error_text
from tesserix_adk.run.parts import RunParts
from tesserix_adk.run.recording import redacted_record
from tesserix_adk.stores.grouping import outside_scope
from tesserix_adk.stores.protocols import LeaseStore
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
    leases: LeaseStore | None = None,
) -> bool:
    """Ask the reconciler of each call in doubt and record what it knows; whether anything
    was recorded (then the plan is made again).

    A claim another run holds under the same key (a business key two runs share) is asked
    about only once that run's lease is not live, and after the margin past its end: while
    it lives, its holder may be sending the call right now. ``leases`` is where that run's
    lease is read; without it such a claim is left in doubt."""
    askable, wait = await _askable(
        agent, plan, attempt, leases, tenant=tenant, run_id=run_id, margin=margin
    )
    if not askable:
        return False
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
        # The answer is about the claim the plan saw: recorded only while that claim still
        # stands (another run's holder may have settled it and claimed it again meanwhile,
        # and be sending it now).
        seen = pc.record.holder if pc.record is not None else None
        attempt.guard()
        if answer.found is ReconciledAs.never_ran:
            if not await _settled(
                parts, pc, tenant=tenant, run_id=run_id, never_ran=True, by=by, holder=seen
            ):
                recorded = True  # the record changed: the plan is made again
                continue
        elif answer.found is ReconciledAs.completed:
            try:
                # What the tool would have returned, made JSON data as its own result is.
                content = await converted(answer.content)
                outcome = ToolOutcome(call_id=pc.call_id or "", content=content)
                # Off the event loop when large, as a tool's own result is.
                encoded = (
                    await redacted_record(parts, outcome, record=record_tag(tenant, pc.key))
                ).payload
            except Exception as exc:
                _log.warning(
                    "run %s: the reconciler of %s answered what cannot be recorded (%s: %s); "
                    "the call stays in doubt",
                    run_id,
                    pc.describe(),
                    type(exc).__name__,
                    parts.redactor.text(str(exc))[:200],
                )
                continue
            attempt.guard()
            if not await _settled(
                parts, pc, encoded, tenant=tenant, run_id=run_id, by=by, holder=seen
            ):
                recorded = True
                continue
        _log.info("run %s: %s settled by its reconciler: %s", run_id, pc.describe(), answer.found)
        recorded = True
    return recorded


async def _askable(
    agent: Agent,
    plan: ResumePlan,
    attempt: Attempt,
    leases: LeaseStore | None,
    *,
    tenant: str,
    run_id: str,
    margin: float,
) -> tuple[list[tuple[PlannedCall, Tool]], float]:
    """The calls in doubt a reconciler may be asked about, each with its tool, and how long
    to wait first: the margin past the end of the lease of every run whose claim is asked
    about (this run's, or another's sharing a key, whose lease must not be live)."""
    askable: list[tuple[PlannedCall, Tool]] = []
    waits: list[float] = []
    # Without a lease store nothing says when the last carrier stopped: wait a whole margin.
    own = attempt.lease.since_previous_end() if attempt.lease is not None else 0.0
    for pc in plan.indeterminate:
        tool = agent.tools.get(pc.tool)
        if pc.key is None or tool is None or tool.reconcile is None:
            continue
        if pc.key in {asked.key for asked, _ in askable}:
            continue  # twins under one key: one answer settles the one record
        if pc.record is not None and pc.record.tool not in (None, pc.tool):
            # A key two tools share: the claim is another tool's call, which this tool's
            # reconciler knows nothing of; its answer would settle that call by a guess.
            continue
        other = pc.record.holding_run if pc.record is not None else run_id
        ended = own if other == run_id else await _other_run_ended(leases, tenant, other)
        if other != run_id and ended is None:
            _log.info(
                "run %s: %s is claimed by run %s, which may be sending it now; its "
                "reconciler is not asked",
                run_id,
                pc.describe(),
                other,
            )
            continue
        waits.append(never_ran_wait(ended, margin))
        askable.append((pc, tool))
    return askable, max(waits, default=0.0)


async def _settled(
    parts: RunParts,
    pc: PlannedCall,
    outcome: bytes | None = None,
    *,
    tenant: str,
    run_id: str,
    by: str,
    holder: str | None,
    never_ran: bool = False,
) -> bool:
    """Whether the reconciler's answer was recorded on the claim ``holder`` held; ``False``
    when that claim was settled or taken again meanwhile (the answer was about it alone)."""
    assert pc.key is not None
    try:
        await parts.idempotency.resolve(
            pc.key, outcome, tenant=tenant, never_ran=never_ran, by=by, holder=holder
        )
    except (KeyError, ValueError) as exc:
        _log.info(
            "run %s: %s changed while its reconciler was asked (%s); its answer is not "
            "recorded, and the call is planned again",
            run_id,
            pc.describe(),
            Masked(exc),
        )
        return False
    return True


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
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise  # the run is being cancelled: that is not the reconciler's answer
        _log.warning(
            "run %s: the reconciler of %s raised CancelledError by itself; the call stays in doubt",
            run_id,
            pc.describe(),
        )
        return Reconciled.unknown()
    except (Exception, SystemExit) as exc:
        # A reconciler calling sys.exit() is user code failing, not the worker asked to end.
        _log.warning(
            "run %s: the reconciler of %s failed (%s); the call stays in doubt",
            run_id,
            pc.describe(),
            redactor.text(error_text(exc)),
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
        except Exception as exc:  # handed to the awaiting task, which judges it
            value, error = None, exc
        except BaseException as exc:
            # sys.exit() in this thread would end only the thread: never the awaiting task,
            # let alone the worker's loop. It is the reconciler failing.
            value, error = None, RuntimeError(f"the reconciler raised {type(exc).__name__}")
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            loop.call_soon_threadsafe(settle, value, error)

    threading.Thread(target=run, name="tesserix-reconciler", daemon=True).start()
    return future


async def _other_run_ended(leases: LeaseStore | None, tenant: str, run_id: str) -> float | None:
    """Seconds since ``run_id``'s lease ended; ``None`` when its holder may be sending right
    now: its lease is live, cannot be read, or none ever ended (a claim made without a
    lease says nothing of when its holder stopped)."""
    if leases is None:
        return None
    try:
        if await leases.current(tenant, run_id) is not None:
            return None
        return await leases.ended_ago(tenant, run_id)
    except AdkError as exc:
        _log.warning("the lease of run %s could not be read (%s)", run_id, Masked(exc))
        return None
