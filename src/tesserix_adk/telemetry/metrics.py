"""The kit's instruments, through the API's meter: step latency, runs by status, parked
runs and lease takeovers."""

from __future__ import annotations

from opentelemetry.metrics import Meter

__all__ = ["Instruments"]


class Instruments:
    """Built once per ``Telemetry`` (a meter hands out the same instrument for a name)."""

    def __init__(self, meter: Meter) -> None:
        self.step_duration = meter.create_histogram(
            "tesserix.step.duration",
            unit="s",
            description="Seconds from the start of a durable step to its frontier being written",
        )
        self.runs = meter.create_counter(
            "tesserix.runs",
            unit="{attempt}",
            description="Attempts ended, by the status the run was left in",
        )
        self.parked = meter.create_counter(
            "tesserix.runs.parked",
            unit="{run}",
            description="Runs a worker parked for an operator",
        )
        self.takeovers = meter.create_counter(
            "tesserix.lease.takeovers",
            unit="{run}",
            description="Runs a worker carried on after their holder's lease lapsed",
        )
