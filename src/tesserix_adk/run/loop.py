"""The run loop as SPEC §2 reads, one iteration at a time.

1. call the model, charge the ledger, append its message → ``after_model_call``;
2. calls needing an approval not yet given → ``before_approval``, and the run waits;
3. each call through the dispatch unit, ``agent.parallel_tool_calls`` at a time (one by
   default);
4. all results appended in the model's order → ``after_tool_result``; next iteration.

A streamed run (``attempt.events``) hears the model's text as it arrives and each call it
asked for once its whole message is in; nothing of a message is kept before it is whole.

A run resumed past its frontier must ask again for exactly the side-effecting calls it
already made at each iteration; the first turn that does not is refused at once, before
anything of that turn is written or sent.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence

from tesserix_adk.agent import Agent
from tesserix_adk.checkpoint.payload import (
    Boundary,
    Checkpoint,
    CheckpointStatus,
    OutstandingCall,
)
from tesserix_adk.checkpoint.redaction import Masked
from tesserix_adk.errors import (
    AdkError,
    ConfigurationError,
    DivergedRunError,
    ProviderError,
    StoreUnavailableError,
)
from tesserix_adk.messages import Message, ToolCall, Usage
from tesserix_adk.providers.base import ModelRequest, ModelResponse, StreamingProvider
from tesserix_adk.run import grouping
from tesserix_adk.run.approvals import ask_approval, take_decision
from tesserix_adk.run.attempt import Attempt
from tesserix_adk.run.cancelling import UNREAD, CancelRequest, Unread, cancel_requested
from tesserix_adk.run.costs import paid, paid_as_told
from tesserix_adk.run.dispatch import dispatch_turn
from tesserix_adk.run.events import (
    AttemptResumed,
    ModelCallFinished,
    ModelCallStarted,
    TextDelta,
    ToolCallAsked,
)
from tesserix_adk.run.frontier import write_frontier, write_frontier_naming_unkeyed
from tesserix_adk.run.invoking import error_text
from tesserix_adk.run.parts import RunParts
from tesserix_adk.run.recording import to_the_end
from tesserix_adk.run.result import Run, RunStatus
from tesserix_adk.run.screening import refused, screened
from tesserix_adk.run.state import RunState
from tesserix_adk.stores.protocols import Ledger
from tesserix_adk.tools import canonical_json, replay_key

__all__ = ["carry_on", "end_as_ended", "outstanding_calls", "run_loop"]

_log = logging.getLogger("tesserix_adk.runner")

# Seconds a cancelled run still waits for the charge of a model call it made (the stores
# bound their own calls by their timeouts, 5 s by default).
CHARGE_GRACE = 5.0


async def run_loop(parts: RunParts, run: RunState, attempt: Attempt) -> Run:
    """Iterate until the model answers without calls, the budget or iterations run out,
    or a call needs an approval."""
    agent = run.agent
    while True:
        # The last statement of what the last turn left open: its COMMIT goes with it.
        cancelled = await grouping.committing_with(
            parts.commits_with_next,
            attempt,
            cancel_requested(parts.idempotency, run.tenant, run.run_id),
        )
        if cancelled is not None:
            return await _finish(
                parts, run, attempt, RunStatus.cancelled, output=cancelled.describe()
            )
        attempt.stop_if_asked(run.run_id)
        if agent.budget_micros is not None and run.budget_spent >= agent.budget_micros:
            return await _finish(parts, run, attempt, RunStatus.budget_exhausted)
        if run.iteration >= agent.max_iterations:
            return await _finish(parts, run, attempt, RunStatus.max_iterations)
        attempt.guard()
        # Whatever the last turn left open is durable before the model hears of it
        # (committed with the cancel check above; here, should anything have joined since).
        await grouping.commit(attempt)
        response = await _call_model(parts, run, attempt)
        if isinstance(response, str):
            return await _finish(parts, run, attempt, RunStatus.failed, output=response)
        message = screened(
            run,
            response.message,
            parts.redactor,
            recorded=attempt.ahead.get(run.iteration, {}).keys(),
        )
        run.steps_used += 1
        run.messages.append(message)
        for position, call in enumerate(message.tool_calls):
            attempt.emit(
                ToolCallAsked(
                    run_id=run.run_id,
                    iteration=run.iteration,
                    call_id=call.id,
                    name=call.name,
                    position=position,
                    arguments=call.arguments,
                )
            )
        # A cancel asked while the model thought ends the run here, at after_model_call,
        # before a last answer ends it completed or a call waits on a person (the check
        # above was before the model was asked). The calls of any other turn each ask once
        # claimed (``call_tool``): answered "not sent", the run ends at the next boundary.
        # (And before a resumed run past its frontier is refused as diverged: a cancelled
        # run ends where it stands, whatever it would have asked.)
        if (
            not message.tool_calls
            or _asks_a_person(agent, message)
            or run.iteration in attempt.ahead
        ):
            cancelled = await cancel_requested(parts.idempotency, run.tenant, run.run_id)
            if cancelled is not None:
                return await _finish(
                    parts, run, attempt, RunStatus.cancelled, output=cancelled.describe()
                )
        if not message.tool_calls:
            return await _finish(parts, run, attempt, RunStatus.completed, output=message.text)
        calls = outstanding_calls(run, message.tool_calls)
        _refuse_divergence(run, attempt, calls)
        await write_frontier_naming_unkeyed(parts, run, attempt, calls, policy_asks=True)
        # A drain asked while the model thought stops here, at after_model_call, with
        # nothing claimed: a call it would start now could outlast the drain and be cut,
        # in doubt. (What an open write group holds commits on the way out.)
        attempt.stop_if_asked(run.run_id)
        waiting = await _take_turn(parts, run, attempt, calls)
        if waiting is not None:
            return waiting


async def carry_on(
    parts: RunParts,
    run: RunState,
    attempt: Attempt,
    cp: Checkpoint,
    *,
    cancelled: CancelRequest | Unread | None = UNREAD,
) -> Run:
    """Pick up at the frontier's boundary, then go on with the loop. ``cancelled``: the
    run's cancel request as the caller read it already, if it did."""
    attempt.emit(
        AttemptResumed(
            run_id=run.run_id,
            step=cp.step,
            iteration=cp.iteration,
            boundary=cp.boundary,
            fence=cp.fence,
        )
    )
    if isinstance(cancelled, Unread):
        cancelled = await cancel_requested(parts.idempotency, run.tenant, run.run_id)
    if cancelled is not None:
        return await _finish(parts, run, attempt, RunStatus.cancelled, output=cancelled.describe())
    attempt.stop_if_asked(run.run_id)
    if cp.boundary is Boundary.after_tool_result:
        run.iteration = cp.iteration + 1
        return await run_loop(parts, run, attempt)
    calls = list(cp.outstanding)
    # The frontier's outstanding calls are this iteration's turn.
    _refuse_divergence(run, attempt, calls)
    if cp.pending_approval is not None:
        waiting = await take_decision(parts, run, attempt, cp.pending_approval, calls)
        if waiting is not None:
            return waiting
        # Before the decided turn dispatches anything, a frontier without the pending
        # request must name its unkeyed calls: a later resume then knows they may have run.
        await write_frontier_naming_unkeyed(parts, run, attempt, calls, policy_asks=False)
    waiting = await _take_turn(parts, run, attempt, calls)
    if waiting is not None:
        return waiting
    return await run_loop(parts, run, attempt)


async def _take_turn(
    parts: RunParts, run: RunState, attempt: Attempt, calls: Sequence[OutstandingCall]
) -> Run | None:
    """Approvals, then dispatch, then ``after_tool_result``; the waiting run if a person
    has to decide first. (A crash between ``after_model_call`` and the approval request,
    or a replay from such a step, still asks before dispatching.)"""
    waiting = await ask_approval(parts, run, attempt, calls)
    if waiting is not None:
        return waiting
    await dispatch_turn(parts, run, attempt, calls)
    # The frontier (and its transcript append) and the next boundary's reads share one
    # transaction, committed before the model is asked again.
    await grouping.begin(parts.groups, attempt)
    await write_frontier(parts, run, attempt, Boundary.after_tool_result)
    run.iteration += 1
    return None


def _asks_a_person(agent: Agent, message: Message) -> bool:
    """Whether a call of the model's answer needs an approval before it is sent (a call
    the kit refuses is never sent, so nobody is asked about it)."""
    return any(
        (tool := agent.tools.get(call.name)) is not None
        and tool.requires_approval
        and not refused(call)
        for call in message.tool_calls
    )


def outstanding_calls(run: RunState, calls: Sequence[ToolCall]) -> list[OutstandingCall]:
    """The turn's calls with their keys; twins (same tool, same arguments) are told apart
    by their occurrence within the turn."""
    seen: dict[tuple[str, str], int] = {}
    result: list[OutstandingCall] = []
    for call in calls:
        tool = run.agent.tools.get(call.name)
        if tool is None or refused(call):  # answered with an error, never dispatched
            result.append(OutstandingCall(call=call, key=None, side_effects=False))
            continue
        twin = (call.name, canonical_json(dict(call.arguments)))
        occurrence = seen.get(twin, 0)
        seen[twin] = occurrence + 1
        try:
            key = tool.key_for(
                tenant=run.tenant,
                run_id=run.run_id,
                iteration=run.iteration,
                call=call,
                occurrence=occurrence,
            )
        except ConfigurationError:
            raise
        except Exception as exc:
            # A call screened before (a frontier's, a replayed step's) that the key function
            # of today's tool cannot key: its author's to mend, said as such.
            raise ConfigurationError(
                f"the key function of tool {tool.name!r} raised {type(exc).__name__} for "
                f"the call {call.id}; it cannot key a call the run already holds"
            ) from exc
        if key is not None and run.replay_of is not None:
            # A key naming the business object is the original run's too: a replay's stub
            # must never record under it, nor find the original's record there.
            key = replay_key(run.run_id, key)
        result.append(
            OutstandingCall(
                call=call, key=key, side_effects=tool.side_effects, idempotent=tool.idempotent
            )
        )
    return result


def _refuse_divergence(run: RunState, attempt: Attempt, calls: Sequence[OutstandingCall]) -> None:
    """The run went further than its frontier: at each such iteration the model must ask
    again for every side-effecting call that already ran there (its outcome is replayed),
    so nothing that happened is hidden from it. Calls it asks for beside them are new
    calls of that turn (one the dead attempt had not reached yet, say) and go out once."""
    done = attempt.ahead.get(run.iteration)
    if not done:
        return
    # Asked again is the same tool under the same key: another tool keyed alike (a refund
    # under its charge's ``order-5``) is answered "not sent" and hides the charge.
    asked = {(oc.key, oc.call.name) for oc in calls if oc.side_effects and oc.key is not None}
    missing = [a.describe() for key, a in done.items() if (key, a.tool) not in asked]
    if missing:
        raise DivergedRunError(
            f"run {run.run_id!r} diverged at iteration {run.iteration}: {len(missing)} "
            f"side-effecting call(s) that already ran there were not asked for again: "
            f"{', '.join(missing)}"
        )
    del attempt.ahead[run.iteration]


async def end_as_ended(parts: RunParts, run: RunState, attempt: Attempt, cp: Checkpoint) -> Run:
    """Write ``cp``, a frontier that ended, as ``run``'s own final frontier (a replay from
    a run's last step: nothing is left to run)."""
    return await _finish(parts, run, attempt, RunStatus(cp.status.value), output=cp.output)


async def _finish(
    parts: RunParts,
    run: RunState,
    attempt: Attempt,
    status: RunStatus,
    *,
    output: str | None = None,
) -> Run:
    # However the run ends, it must not end having skipped a call that already ran (a
    # cancelled run ends where it stands, and says so).
    if attempt.ahead and status is not RunStatus.cancelled:
        skipped = [a.describe() for calls in attempt.ahead.values() for a in calls.values()]
        raise DivergedRunError(
            f"run {run.run_id!r} diverged: it would finish without asking again for "
            f"{len(skipped)} side-effecting call(s) that already ran: {', '.join(skipped)}"
        )
    await write_frontier(
        parts,
        run,
        attempt,
        Boundary.after_model_call,
        status=CheckpointStatus(status.value),
        final=True,
        output=output,
    )
    return run.result(status, fence=attempt.fence, output=output)


async def _call_model(parts: RunParts, run: RunState, attempt: Attempt) -> ModelResponse | str:
    """The model's answer, or why the run failed (a non-retryable model error)."""
    agent = run.agent
    request = ModelRequest(
        agent_name=agent.name,
        instructions=agent.instructions,
        messages=tuple(run.messages),
        tools=tuple(t.spec for t in agent.tools.values()),
        model=agent.model,
        iteration=run.iteration,
    )
    attempt.emit(ModelCallStarted(run_id=run.run_id, iteration=run.iteration, model=agent.model))
    try:
        response, cost, usage = await _asked(parts, run, attempt, request)
    except ConfigurationError:
        raise  # a usage mistake, not a run failure: nothing durable is written
    except AdkError as exc:
        if isinstance(exc, ProviderError) and exc.paid is not None:
            try:
                await _charge_unanswered(parts, run, attempt, exc.paid)
            except ProviderError as refused:
                # Billed, and not chargeable as told: asking again would pay again
                # uncounted, so the run stops as for an answer whose cost cannot be charged.
                exc = refused
        if exc.retryable:
            raise
        reason = parts.redactor.text(error_text(exc))
        _log.error("run %s failed on a non-retryable model error: %s", run.run_id, Masked(reason))
        return reason
    except (OSError, TimeoutError) as exc:
        # Connection resets, refused connections and timeouts outside the SDK's own
        # translation: the run is resumable, so say "try again".
        raise ProviderError(
            f"the model could not be reached: {type(exc).__name__}: "
            f"{parts.redactor.text(str(exc))}",
            retryable=True,
        ) from exc
    run.usage = run.usage + usage
    run.spent += cost
    # The charge, the frontier and the first claim commit together (``run.grouping``). A
    # model call made is paid: the charge is made even if the run is cancelled meanwhile,
    # unless the ledger takes longer than CHARGE_GRACE to answer.
    await to_the_end(_group_and_charge(parts, run, attempt, cost, usage), grace=CHARGE_GRACE)
    return response


async def _charge_unanswered(
    parts: RunParts, run: RunState, attempt: Attempt, paid: object
) -> None:
    """Charge a call the vendor billed though its answer could not be taken (a stream cut
    after its usage, an unreadable reply), on its own: asking again pays again, so the
    budget counts it first. ``ProviderError`` (not retryable) if it cannot be charged as
    told; a ledger's own failure is a retryable ``StoreUnavailableError``."""
    cost, usage = paid_as_told(paid)
    run.usage = run.usage + usage
    run.spent += cost
    if parts.ledger is None:
        return
    attempt.guard()
    await to_the_end(_charger(parts.ledger, run, cost, usage, attempt.fence)(), grace=CHARGE_GRACE)


def _charger(
    ledger: Ledger, run: RunState, cost: int, usage: Usage, fence: int | None
) -> Callable[[], Awaitable[None]]:
    """The charge of one model call, as a call that may be made again (a write group lost
    with its commit charges it again, once); a ledger's own failure is a retryable
    ``StoreUnavailableError``."""

    async def charge() -> None:
        try:
            await ledger.charge(run.tenant, run.run_id, cost, usage, fence=fence)
        except AdkError:
            raise
        except Exception as exc:
            raise StoreUnavailableError(f"the ledger is unreachable: {exc}") from exc

    return charge


async def _group_and_charge(
    parts: RunParts, run: RunState, attempt: Attempt, cost: int, usage: Usage
) -> None:
    await grouping.begin(parts.groups, attempt)
    ledger = parts.ledger
    if ledger is None:
        return
    attempt.guard()
    charge = _charger(ledger, run, cost, usage, attempt.fence)
    await charge()
    group, joining = attempt.group, parts.ledger_groups
    if group is not None and joining is not None and joining.joins(group.group):
        # Lost with the group should it certainly not commit: charged again, once.
        group.retry.append(charge)


async def _asked(
    parts: RunParts, run: RunState, attempt: Attempt, request: ModelRequest
) -> tuple[ModelResponse, int, Usage]:
    """``_ask``, reported, with what the answer costs (``paid``): whoever listens hears how
    the model call ended, even when it raised or its cost cannot be charged (before the
    ledger, which is the run's, not the model's)."""
    try:
        response = await _ask(parts, run, attempt, request)
        cost, usage = paid(response)
    except BaseException as exc:
        attempt.emit(
            ModelCallFinished(
                run_id=run.run_id,
                iteration=run.iteration,
                model=request.model,
                error=type(exc).__name__,
            )
        )
        raise
    attempt.emit(
        ModelCallFinished(
            run_id=run.run_id,
            iteration=run.iteration,
            model=request.model,
            input_tokens=usage.input_tokens,
            output_tokens=usage.output_tokens,
            finish_reason=response.finish_reason
            or ("tool_calls" if response.message.tool_calls else "stop"),
        )
    )
    return response, cost, usage


async def _ask(
    parts: RunParts, run: RunState, attempt: Attempt, request: ModelRequest
) -> ModelResponse:
    """The model's whole answer; its text streamed to whoever listens as it arrives (all
    at once from a provider that cannot stream)."""
    provider = parts.provider
    if not attempt.streams:
        return await provider.complete(request)
    iteration = run.iteration

    def on_text(text: str) -> None:
        attempt.emit(TextDelta(run_id=run.run_id, iteration=iteration, text=text))

    if isinstance(provider, StreamingProvider):
        return await provider.complete_streaming(request, on_text)
    response = await provider.complete(request)
    if response.message.text:
        on_text(response.message.text)
    return response
