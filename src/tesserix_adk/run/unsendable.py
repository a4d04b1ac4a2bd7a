"""A model's call that cannot go out whatever its record says: its arguments were kept
masked (they held a secret), or its tool's validation refuses them. Such a call is answered
"not sent", saying why; the dispatch unit then keeps nothing under its key."""

from __future__ import annotations

from tesserix_adk.checkpoint.payload import Carrier, OutstandingCall
from tesserix_adk.messages import ToolOutcome
from tesserix_adk.run.attempt import Attempt
from tesserix_adk.run.state import RunState
from tesserix_adk.tools import Tool

__all__ = ["MASKED_CALL", "MASKED_ON_TEMPORAL", "invalid_arguments", "masked", "unsendable"]

MASKED_CALL = (
    "not sent: its arguments held a secret, and the kit never stores secrets, so the "
    "arguments this run kept are masked and sending them would be wrong; ask for the call "
    "again with the real values if it is still needed"
)
# On Temporal a call reaches its activity only as the run's frontier keeps it: asking
# again with the same secret would be refused alike, so the model is told what to change.
MASKED_ON_TEMPORAL = (
    "not sent: its arguments hold a secret, and on Temporal a call reaches the tool only "
    "as the run's frontier keeps it, with secrets masked, so a call with a secret in its "
    "arguments is never sent there; do not ask for it again with the secret in it (the "
    "tool has to get its credential from its own configuration)"
)


def masked(run: RunState) -> str:
    """What the model is told of a call of ``run`` kept with masked arguments."""
    return MASKED_ON_TEMPORAL if run.carried_by is Carrier.temporal else MASKED_CALL


def invalid_arguments(attempt: Attempt, tool: Tool, oc: OutstandingCall) -> ToolOutcome | None:
    """The answer to a call whose arguments its tool's validation refuses (it would raise
    before sending anything), or ``None``. A call whose arguments the replayed step kept
    masked goes to the replay's stub unjudged: the tool is not called, and the masks would
    fail its validation where the original's real values passed."""
    stubbed = attempt.stubs is not None and tool.name in attempt.stubs
    if stubbed and oc.call.id in attempt.masked_calls:
        return None
    why = tool.invalid_arguments(oc.call.arguments)
    return None if why is None else ToolOutcome(call_id=oc.call.id, content=why, is_error=True)


def unsendable(
    run: RunState, attempt: Attempt, tool: Tool, oc: OutstandingCall
) -> ToolOutcome | None:
    """The answer to a call that cannot go out whatever its record says: its arguments
    were masked in the frontier, or its tool's validation refuses them; else ``None``."""
    if oc.redacted:
        return ToolOutcome(call_id=oc.call.id, content=masked(run), is_error=True)
    return invalid_arguments(attempt, tool, oc)
