"""One attempt's spans: ``invoke_agent {agent}`` over it, ``chat {model}`` per model call
and ``execute_tool {tool}`` per call beside them, made from the events the loop reports.

Ids: the trace is the run's; the attempt is its fence (with a lease) or, without one, its
holder id, which no other attempt shares; a model call is named by its iteration, a tool
call by its iteration, call id and place in the turn (a model may give two calls one id).
A resume links to the attempt whose frontier it continues (known by that frontier's
fence, so only with a lease store).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Link, Span, SpanContext, SpanKind, StatusCode, TraceFlags

from tesserix_adk.checkpoint.checkpointer import OFF_LOOP_BYTES, text_weight
from tesserix_adk.run.events import (
    AttemptResumed,
    CallDisposition,
    FrontierWritten,
    ModelCallFinished,
    ModelCallStarted,
    RunEvent,
    ToolCallAsked,
    ToolCallFinished,
    ToolCallStarted,
    ToolCallUnsent,
)
from tesserix_adk.run.observing import Watched
from tesserix_adk.run.result import Run, RunStatus
from tesserix_adk.telemetry.ids import span_id_of, trace_id_of

if TYPE_CHECKING:
    from tesserix_adk.telemetry.config import Telemetry

__all__ = ["AttemptSpans", "ToolDisposition", "tool_disposition"]

Attributes = Mapping[str, str | bool | int | float | Sequence[str]]


_log = logging.getLogger("tesserix_adk.runner")

# The most of a tool's name or call id a span shows (the model writes them).
_SAID_CHARS = 256


class ToolDisposition(StrEnum):
    """``tesserix.tool.disposition``: how a call's result came to be."""

    dispatched = "dispatched"  # sent by this attempt: the only new execution
    replayed = "replayed"  # an earlier attempt's recorded outcome
    reconciled = "reconciled"  # the tool's reconciler said what happened
    resolved = "resolved"  # a person said what happened (``tesserix resolve``)
    refused = "refused"  # never sent


def tool_disposition(event: ToolCallFinished) -> ToolDisposition:
    """The span's disposition: ``settled`` told apart by who settled it."""
    if event.disposition is CallDisposition.settled:
        by = event.by or ""
        return (
            ToolDisposition.reconciled if by.startswith("reconciler:") else ToolDisposition.resolved
        )
    return ToolDisposition(event.disposition.value)


class AttemptSpans:
    """Hears one attempt's events (``run.observing.AttemptWatch``)."""

    def __init__(self, telemetry: Telemetry, watched: Watched) -> None:
        self._t = telemetry
        self._w = watched
        self._run_id = watched.run_id
        self._started_ns = time.time_ns()
        self._step_mark = time.monotonic()
        self._root: Span | None = None
        self._resumed: AttemptResumed | None = None
        # Whether the attempt carried the run at all (a resume of a finished run does not).
        self._carried = False
        self._chat: Span | None = None
        # By call id and place in the turn: two calls of one reply may share an id.
        self._tools: dict[tuple[str, int], Span] = {}
        self._arguments: dict[tuple[str, int], Mapping[str, Any]] = {}
        # The caller's own span (a request handler's, say) is linked, not made the parent:
        # the trace is the run's, whoever carries it.
        caller = trace.get_current_span().get_span_context()
        self._caller = caller if caller.is_valid else None

    # --- events --------------------------------------------------------------------------

    def event(self, event: RunEvent) -> None:
        """Open, close or annotate the span the event is about."""
        if self._run_id is None:
            self._run_id = getattr(event, "run_id", None)
        self._carried = True
        if isinstance(event, AttemptResumed) and self._root is None:
            self._resumed = event
        if isinstance(event, ModelCallStarted):
            self._chat = self._child(
                f"chat {event.model}" if event.model else "chat",
                ("chat", event.iteration),
                {"gen_ai.operation.name": "chat", **_model(event.model)},
                SpanKind.CLIENT,
            )
        elif isinstance(event, ModelCallFinished):
            self._model_finished(event)
        elif isinstance(event, ToolCallAsked):
            if self._t.capture_content:
                self._arguments[(event.call_id, event.position)] = event.arguments
        elif isinstance(event, ToolCallStarted):
            span = self._tool_span(event.iteration, event.call_id, event.position, event.name)
            self._tools[(event.call_id, event.position)] = span
        elif isinstance(event, ToolCallFinished):
            self._tool_finished(event)
        elif isinstance(event, ToolCallUnsent):
            self._tool_unsent(event)
        elif isinstance(event, FrontierWritten):
            now = time.monotonic()
            self._t.instruments.step_duration.record(
                now - self._step_mark,
                {"gen_ai.agent.name": self._w.agent, "tesserix.boundary": event.boundary.value},
            )
            self._step_mark = now

    def _model_finished(self, event: ModelCallFinished) -> None:
        span = self._chat or self._child(
            "chat", ("chat", event.iteration), {"gen_ai.operation.name": "chat"}, SpanKind.CLIENT
        )
        self._chat = None
        if event.error is not None:
            span.set_attribute("error.type", event.error)
            span.set_status(StatusCode.ERROR)
        else:
            span.set_attribute("gen_ai.usage.input_tokens", event.input_tokens)
            span.set_attribute("gen_ai.usage.output_tokens", event.output_tokens)
            span.set_attribute("gen_ai.response.finish_reasons", [event.finish_reason or "stop"])
        span.end()

    def _tool_span(self, iteration: int, call_id: str, position: int, name: str) -> Span:
        # The name and id are the model's words, and a model can be made to write a secret
        # there (a call it was refused for): masked as everything the kit keeps is.
        shown = self._said(name)
        attributes: dict[str, Any] = {
            "gen_ai.operation.name": "execute_tool",
            "gen_ai.tool.name": shown,
            "gen_ai.tool.call.id": self._said(call_id),
            "tesserix.iteration": iteration,
        }
        arguments = self._arguments.pop((call_id, position), None)
        if arguments is not None:
            attributes["gen_ai.tool.call.arguments"] = self._shown(dict(arguments))
        return self._child(
            f"execute_tool {shown}",
            ("tool", iteration, call_id, position),
            attributes,
            SpanKind.INTERNAL,
        )

    def _tool_finished(self, event: ToolCallFinished) -> None:
        span = self._tools.pop((event.call_id, event.position), None)
        if span is None:  # refused: never started, never sent
            span = self._tool_span(event.iteration, event.call_id, event.position, event.name)
        span.set_attribute("tesserix.tool.disposition", tool_disposition(event).value)
        if self._t.capture_content:
            span.set_attribute("gen_ai.tool.call.result", self._shown(event.content))
        if event.is_error:
            span.set_attribute("error.type", "tool_error")
            span.set_status(StatusCode.ERROR)
        span.end()

    def _tool_unsent(self, event: ToolCallUnsent) -> None:
        span = self._tools.pop((event.call_id, event.position), None)
        if span is None:
            span = self._tool_span(event.iteration, event.call_id, event.position, event.name)
        span.set_attribute("tesserix.tool.disposition", ToolDisposition.refused.value)
        span.set_attribute("error.type", event.error)
        span.set_status(StatusCode.ERROR)
        span.end()

    def _shown(self, content: Any) -> str:
        """Content as an attribute may hold it: JSON, masked twice over (values by key
        and shape, then the text), as everything the runner stores is. Content too large
        to mask on the event loop (the runner masks it in a thread for its records) is not
        captured: masking it here would hold up lease renewals."""
        weight = text_weight(content)
        if weight > OFF_LOOP_BYTES:
            return f"(not captured: about {weight} characters)"
        redactor = self._w.redactor
        return redactor.text(json.dumps(redactor.value(content), sort_keys=True, default=str))

    # --- the attempt ---------------------------------------------------------------------

    def end(self, run: Run | None, error: BaseException | None) -> None:
        """Close what is open; the attempt's span says how it ended. Each step is on its
        own: a span or an instrument that fails loses that step alone, not the others."""
        failed = type(error).__name__ if error else "abandoned"
        open_tools = list(self._tools.values())
        for span in [*([self._chat] if self._chat else []), *open_tools]:
            self._quietly(_failed_span, span, failed, span in open_tools)
        self._chat, self._tools = None, {}
        attributes: dict[str, str] = {"gen_ai.agent.name": self._w.agent}
        if run is not None:
            attributes["tesserix.run.status"] = run.status.value
        else:
            attributes["error.type"] = type(error).__name__ if error is not None else "unknown"
        if self._carried or run is None:
            # A run found already finished (or still waiting) was not carried: counting it
            # again would count one run's end twice.
            self._quietly(self._t.instruments.runs.add, 1, attributes)
        self._quietly(self._end_root, run, attributes)

    def _end_root(self, run: Run | None, attributes: dict[str, str]) -> None:
        root = self._ensure_root()
        try:
            root.set_attribute("tesserix.attempt.carried", self._carried)
            for name, value in attributes.items():
                if name != "gen_ai.agent.name":
                    root.set_attribute(name, value)
            if run is None or run.status is RunStatus.failed:
                root.set_status(StatusCode.ERROR)
        finally:
            root.end()

    def _said(self, words: str) -> str:
        """A name or id the model wrote, masked and cut to ``_SAID_CHARS``: a model can
        invent one of any length, and masking it all would hold the event loop."""
        if len(words) <= _SAID_CHARS:
            return self._w.redactor.text(words)
        # Masked before it is cut (a secret across the cut is masked whole, then cut away).
        head = self._w.redactor.text(words[: 4 * _SAID_CHARS])[:_SAID_CHARS]
        return f"{head}…({len(words)} characters)"

    def _quietly(self, step: Callable[..., object], *args: Any) -> None:
        quietly(step, *args, mask=self._w.redactor.text)

    def _attempt_ids(self) -> tuple[str | int, ...]:
        """What names this attempt in span ids: its fence, or without a lease (none held
        yet, or no lease store) its holder id, which no other attempt has."""
        fence = self._w.attempt.fence
        if fence is not None:
            return ("attempt", fence)
        return ("attempt-of", self._w.attempt.holder)

    def _ensure_root(self) -> Span:
        if self._root is not None:
            return self._root
        tenant, run_id = self._w.tenant, self._run_id or "unknown"
        number = self._w.attempt.fence
        trace_id = trace_id_of(tenant, run_id)
        links: list[Link] = []
        previous = None if self._resumed is None else self._resumed.fence
        # Only ids the kit chose can be linked to: they are the earlier attempt's too.
        if previous is not None and previous != number and self._t.ids is not None:
            linked = SpanContext(
                trace_id=trace_id,
                span_id=span_id_of(tenant, run_id, "attempt", previous),
                is_remote=True,
                trace_flags=TraceFlags(TraceFlags.SAMPLED),
            )
            links.append(Link(linked, {"tesserix.link": "continues"}))
        if self._caller is not None:
            links.append(Link(self._caller, {"tesserix.link": "caller"}))
        attributes: dict[str, Any] = {
            "gen_ai.operation.name": "invoke_agent",
            "gen_ai.agent.name": self._w.agent,
            "gen_ai.conversation.id": run_id,
            "tesserix.tenant": tenant,
            "tesserix.run.id": run_id,
            "tesserix.attempt.kind": self._w.kind.value,
            "tesserix.attempt.streamed": self._w.streamed,
            "tesserix.worker": self._w.worker,
        }
        if number is not None:
            attributes["tesserix.attempt"] = number
        if self._resumed is not None:
            attributes["tesserix.resumed.step"] = self._resumed.step
        self._expect(trace_id, span_id_of(tenant, run_id, *self._attempt_ids()))
        try:
            self._root = self._t.tracer.start_span(
                f"invoke_agent {self._w.agent}",
                context=otel_context.Context(),  # a root: the run's own trace
                kind=SpanKind.INTERNAL,
                attributes=attributes,
                links=links,
                start_time=self._started_ns,
            )
        finally:
            self._clear()
        return self._root

    def _child(
        self, name: str, what: tuple[str | int, ...], attributes: Attributes, kind: SpanKind
    ) -> Span:
        root = self._ensure_root()
        tenant, run_id = self._w.tenant, self._run_id or "unknown"
        self._expect(
            trace_id_of(tenant, run_id),
            span_id_of(tenant, run_id, *self._attempt_ids(), *what),
        )
        try:
            return self._t.tracer.start_span(
                name,
                context=trace.set_span_in_context(root, otel_context.Context()),
                kind=kind,
                attributes=attributes,
            )
        finally:
            self._clear()

    def _expect(self, trace_id: int, span_id: int) -> None:
        if self._t.ids is not None:
            self._t.ids.expect(trace_id, span_id)

    def _clear(self) -> None:
        if self._t.ids is not None:
            self._t.ids.clear()


def _model(model: str | None) -> dict[str, str]:
    return {} if model is None else {"gen_ai.request.model": model}


def _failed_span(span: Span, failed: str, sent: bool) -> None:
    if sent:
        # Started means sent (its claim was durable): it may have run, so it counts as an
        # execution, its outcome unknown to this attempt.
        span.set_attribute("tesserix.tool.disposition", ToolDisposition.dispatched.value)
    span.set_attribute("error.type", failed)
    span.set_status(StatusCode.ERROR)
    span.end()


def quietly(step: Callable[..., object], *args: Any, mask: Callable[[str], str]) -> None:
    """``step(*args)``; a failure is logged, masked by ``mask``, never raised: telling what
    a run or a worker did must not change what it did (a run it finished told as failed,
    one in doubt retried)."""
    try:
        step(*args)
    except Exception as exc:
        _log.warning("telemetry failed: %s", mask(repr(exc)))
