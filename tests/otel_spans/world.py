"""An SDK pipeline kept in memory (spans and metrics), and the booking world on memory
stores with leases, for the telemetry tests."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from booking import BOOK_TURNS
from tesserix_adk import (
    AgentRunner,
    Checkpointer,
    MemoryCheckpointStore,
    MemoryIdempotencyStore,
    MemoryLeaseStore,
    ScriptedProvider,
)
from tesserix_adk.telemetry import DeterministicIds, Telemetry
from tesserix_adk.testing.faults import FaultyCheckpointStore


class Pipeline:
    """A tracer and a meter provider exporting to memory."""

    def __init__(self, *, deterministic: bool = True, capture_content: bool = False) -> None:
        self.exporter = InMemorySpanExporter()
        ids: Any = DeterministicIds() if deterministic else None
        self.tracer_provider = (
            TracerProvider(id_generator=ids) if ids is not None else TracerProvider()
        )
        self.tracer_provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        self.reader = InMemoryMetricReader()
        self.meter_provider = MeterProvider(metric_readers=[self.reader])
        self.telemetry = Telemetry(
            tracer_provider=self.tracer_provider,
            meter_provider=self.meter_provider,
            capture_content=capture_content,
        )

    def spans(self) -> list[ReadableSpan]:
        return list(self.exporter.get_finished_spans())

    def named(self, prefix: str) -> list[ReadableSpan]:
        return [s for s in self.spans() if s.name.startswith(prefix)]

    def points(self, name: str) -> list[Any]:
        """Every data point of the metric ``name`` (empty if it was never recorded)."""
        data = self.reader.get_metrics_data()
        found: list[Any] = []
        for rm in data.resource_metrics if data is not None else ():
            for sm in rm.scope_metrics:
                for metric in sm.metrics:
                    if metric.name == name:
                        found.extend(metric.data.data_points)
        return found


class World:
    """One tenant's stores, with leases, shared by every "process" (runner) of a test."""

    def __init__(self) -> None:
        self.idempotency = MemoryIdempotencyStore()
        self.store = FaultyCheckpointStore(MemoryCheckpointStore())
        self.leases = MemoryLeaseStore()

    def runner(
        self, pipeline: Pipeline, turns: Sequence[Any] = BOOK_TURNS, **kwargs: Any
    ) -> AgentRunner:
        return AgentRunner(
            ScriptedProvider(list(turns)),
            idempotency=self.idempotency,
            checkpoints=Checkpointer(self.store),
            leases=self.leases,
            telemetry=pipeline.telemetry,
            **kwargs,
        )


def attrs(span: ReadableSpan) -> dict[str, Any]:
    return dict(span.attributes or {})


def every_value(spans: Sequence[ReadableSpan]) -> list[str]:
    """Every attribute value (and span name, event and link attribute) as text."""
    out: list[str] = []
    for s in spans:
        out.append(s.name)
        out += [str(v) for v in (s.attributes or {}).values()]
        for link in s.links:
            out += [str(v) for v in (link.attributes or {}).values()]
        for ev in s.events:
            out += [str(v) for v in (ev.attributes or {}).values()]
    return out
