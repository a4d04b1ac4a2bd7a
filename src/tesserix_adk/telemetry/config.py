"""``Telemetry``: what ``AgentRunner(telemetry=...)`` and ``Worker(telemetry=...)`` take."""

from __future__ import annotations

from opentelemetry import metrics, trace

from tesserix_adk.checkpoint.redaction import default_redactor
from tesserix_adk.run.observing import AttemptWatch, Watched
from tesserix_adk.telemetry.ids import DeterministicIds
from tesserix_adk.telemetry.metrics import Instruments
from tesserix_adk.telemetry.spans import AttemptSpans, quietly

__all__ = ["Telemetry"]

_SCOPE = "tesserix_adk"


class Telemetry:
    """Spans (GenAI semantic conventions) and metrics of every attempt a runner makes.

    ``tracer_provider``/``meter_provider`` default to the global ones. Give the SDK
    ``TracerProvider`` a ``DeterministicIds`` (``id_generator=``) for span ids derived from
    the run; without it only trace ids are. ``capture_content`` adds tool arguments to
    spans, through the runner's ``Redactor``; off by default.
    """

    def __init__(
        self,
        *,
        tracer_provider: trace.TracerProvider | None = None,
        meter_provider: metrics.MeterProvider | None = None,
        capture_content: bool = False,
    ) -> None:
        provider = tracer_provider or trace.get_tracer_provider()
        self.tracer = provider.get_tracer(_SCOPE)
        found = getattr(provider, "id_generator", None)
        self.ids = found if isinstance(found, DeterministicIds) else None
        meter = (meter_provider or metrics.get_meter_provider()).get_meter(_SCOPE)
        self.instruments = Instruments(meter)
        self.capture_content = capture_content

    def watch(self, watched: Watched) -> AttemptWatch:
        """Spans and metrics of one attempt (``run.observing``)."""
        return AttemptSpans(self, watched)

    def parked(self, agent: str, error_type: str) -> None:
        """A worker parked a run (``error_type``: why, as an exception's type name); a
        meter that fails is logged, never the worker's failure."""
        attributes = {"gen_ai.agent.name": agent, "error.type": error_type}
        quietly(self.instruments.parked.add, 1, attributes, mask=_masked)

    def took_over(self, agent: str) -> None:
        """A worker carries on a run whose holder's lease lapsed; a meter that fails is
        logged, never the worker's failure."""
        quietly(self.instruments.takeovers.add, 1, {"gen_ai.agent.name": agent}, mask=_masked)


def _masked(words: str) -> str:
    # A worker's meter has no run's redactor: the built-in patterns mask what it says.
    return default_redactor().text(words)
