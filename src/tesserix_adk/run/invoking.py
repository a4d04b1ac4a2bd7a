"""Sending one call: the attempt's guard right before the tool starts (a refusal there is
``NotSent``: nothing went out), a replay's stub in the tool's place, and the tool's answer
or error as the call's outcome."""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping
from typing import Any

from tesserix_adk.checkpoint.redaction import Redactor
from tesserix_adk.errors import AdkError, ToolOutcomeUnknownError
from tesserix_adk.messages import ToolCall, ToolOutcome
from tesserix_adk.run.attempt import Attempt
from tesserix_adk.run.result_data import converted, error_text, mapping_items, result_content
from tesserix_adk.stores.grouping import outside_scope
from tesserix_adk.tools import NotStarted, Tool, ToolContext, accepts_ctx, call_maybe_async

__all__ = ["NotSent", "converted", "error_text", "invoke", "result_content"]

_log = logging.getLogger("tesserix_adk.runner")


class NotSent(Exception):
    """The guard refused right before the tool started: nothing was sent."""

    def __init__(self, error: AdkError) -> None:
        super().__init__(str(error))
        self.error = error


async def invoke(
    attempt: Attempt, tool: Tool, call: ToolCall, ctx: ToolContext, redactor: Redactor
) -> ToolOutcome:
    """Run the tool (or its replay stub); an ``Exception`` is the call's error outcome,
    except the guard's own refusal, which stops the run with nothing sent, and a
    ``ToolOutcomeUnknownError``, which stops it with the call left in doubt."""
    refused: list[AdkError] = []

    def guard() -> None:
        try:
            attempt.guard()
        except AdkError as exc:
            refused.append(exc)
            raise

    try:
        if attempt.stubs is not None and tool.name in attempt.stubs:
            stub = attempt.stubs[tool.name]
            # Called like the tool it stands for: with the arguments its parameters make;
            # a call whose arguments were masked gets them as stored (placeholders fail the
            # tool's validation, and the stub is what replay demands for such a call).
            args = (
                copy.deepcopy(dict(call.arguments))
                if call.id in attempt.masked_calls
                else tool.parsed_arguments(call.arguments)
            )
            guard()
            with outside_scope():
                value = await call_maybe_async(
                    stub, args, ctx if accepts_ctx(stub) else None, thread=True
                )
            result = _stub_result(value)
        else:
            with outside_scope():
                result = await tool.invoke(call.arguments, ctx, guard=guard)
        return ToolOutcome(call_id=call.id, content=await converted(result))
    except ToolOutcomeUnknownError as exc:
        # Sent, and whether it took effect is unknown: told to the model as an error it
        # would be asked for again under a new key. Its claim stays in flight, for the
        # reconciler or an operator, as if the process had died inside the call.
        _log.warning(
            "%s (%s) may have run, its outcome unknown: %s",
            tool.name,
            call.id,
            redactor.text(str(exc)),
        )
        exc.add_note(f"the call {tool.name} ({call.id}) is left in doubt, its claim in flight")
        raise
    except NotStarted as exc:
        if refused and exc.error is refused[0]:
            raise NotSent(refused[0]) from None
        return ToolOutcome(call_id=call.id, content=error_text(exc.error), is_error=True)
    except Exception as exc:
        if refused and exc is refused[0]:
            raise NotSent(refused[0]) from None
        return ToolOutcome(call_id=call.id, content=error_text(exc), is_error=True)


def _stub_result(value: Any) -> Any:
    if isinstance(value, Mapping):
        # Its items as a multidict gives them, each value kept; the stub mark beside them.
        return {**dict(mapping_items(value)), "stub": True}
    return {"stub": True, "value": value}
