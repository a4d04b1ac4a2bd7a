"""What a streamed run reports as it goes: typed events, in the order things happened.

Events describe; they decide nothing. A text delta is never saved: the frontier is written
only once the model's whole message is in (``FrontierWritten`` says when), so a run that
dies mid-stream goes on from its last boundary and asks the model again.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from tesserix_adk.checkpoint.payload import Boundary
from tesserix_adk.run.result import Run

__all__ = [
    "AttemptResumed",
    "CallDisposition",
    "EventSink",
    "FrontierWritten",
    "ModelCallFinished",
    "ModelCallStarted",
    "ProgressListener",
    "RunEvent",
    "RunFinished",
    "TextDelta",
    "ToolCallAsked",
    "ToolCallFinished",
    "ToolCallStarted",
    "ToolCallUnsent",
]


class CallDisposition(StrEnum):
    """How a tool call's result came to be."""

    dispatched = "dispatched"  # sent to the tool by this attempt
    replayed = "replayed"  # an earlier attempt's recorded outcome, not sent again
    settled = "settled"  # a reconciler or an operator said what happened
    refused = "refused"  # answered with an error, never sent (unknown tool, denied, masked)


@dataclass(frozen=True, slots=True, kw_only=True)
class TextDelta:
    """A piece of the model's text as it streams in."""

    run_id: str
    iteration: int
    text: str


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolCallAsked:
    """The model asked for a call (its whole message is in)."""

    run_id: str
    iteration: int
    call_id: str
    name: str
    # The call's place among its turn's calls: a model may give two calls one id.
    position: int = 0
    arguments: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolCallStarted:
    """The call is about to be sent (its claim is durable) or its outcome replayed."""

    run_id: str
    iteration: int
    call_id: str
    name: str
    # The call's place among its turn's calls: a model may give two calls one id.
    position: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolCallFinished:
    """The call has its result."""

    run_id: str
    iteration: int
    call_id: str
    name: str
    # The call's place among its turn's calls: a model may give two calls one id.
    position: int = 0
    disposition: CallDisposition
    is_error: bool = False
    # Who settled it (``settled`` only): ``reconciler:<tool>`` or the person who resolved it.
    by: str | None = None
    # The result as the model is told it (JSON-able; a replayed one as it was recorded).
    content: Any = None


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolCallUnsent:
    """A started call was stopped before it was sent (its lease lapsed): it has no result,
    it never ran, and the run stops with ``error`` (the error's type name)."""

    run_id: str
    iteration: int
    call_id: str
    name: str
    # The call's place among its turn's calls: a model may give two calls one id.
    position: int = 0
    error: str


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelCallStarted:
    """The model is about to be asked (again, after a crash: a model call is not durable)."""

    run_id: str
    iteration: int
    model: str | None


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelCallFinished:
    """The model answered (``error`` is None) or could not (the error's type name)."""

    run_id: str
    iteration: int
    model: str | None
    input_tokens: int = 0
    output_tokens: int = 0
    # ``tool_calls`` or ``stop``; None when it failed.
    finish_reason: str | None = None
    error: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class AttemptResumed:
    """A resume picks the run up at its frontier: ``step``, written under ``fence``."""

    run_id: str
    step: int
    iteration: int
    boundary: Boundary | None
    fence: int | None


@dataclass(frozen=True, slots=True, kw_only=True)
class FrontierWritten:
    """A frontier is durable: where the run goes on should this process die now."""

    run_id: str
    step: int
    boundary: Boundary


@dataclass(frozen=True, slots=True, kw_only=True)
class RunFinished:
    """The run ended (or waits on a person): the same ``Run`` ``run()`` returns."""

    run: Run


RunEvent = (
    TextDelta
    | ToolCallAsked
    | ToolCallStarted
    | ToolCallFinished
    | FrontierWritten
    | RunFinished
    | ModelCallStarted
    | ModelCallFinished
    | AttemptResumed
    | ToolCallUnsent
)

# Called in the run's own task, so it must not block: a stream puts the event on a queue.
EventSink = Callable[[RunEvent], None]


class ProgressListener:
    """An ``on_event`` sink that follows a run's progress, not its text (a worker's count
    of a take's progress): given one, ``run`` and ``resume`` call the model's plain
    endpoints, as without a sink, where any other sink has the model's text streamed."""

    def __call__(self, event: RunEvent) -> None:
        """Hear ``event``; from the run's own task, so it must not block."""
