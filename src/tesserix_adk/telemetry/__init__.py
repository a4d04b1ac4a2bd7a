"""OpenTelemetry spans and metrics (extra ``[otel]``: the API only; the application picks
the SDK). Nothing here is imported by ``tesserix_adk`` itself: a runner without telemetry
never loads OpenTelemetry.

Replay-safe: a call replayed or settled on resume is reported with that disposition, never
as a new execution; ids derive from the run (``telemetry.ids``)."""

from __future__ import annotations

from tesserix_adk.telemetry.config import Telemetry
from tesserix_adk.telemetry.ids import DeterministicIds, span_id_of, trace_id_of
from tesserix_adk.telemetry.spans import ToolDisposition, tool_disposition

__all__ = [
    "DeterministicIds",
    "Telemetry",
    "ToolDisposition",
    "span_id_of",
    "tool_disposition",
    "trace_id_of",
]
