"""Store-clock moments as people read them: ISO 8601 UTC to the second."""

from __future__ import annotations

from datetime import UTC, datetime

__all__ = ["iso_time"]


def iso_time(epoch: float) -> str:
    """Epoch seconds as ISO 8601 UTC to the second, e.g. ``2026-12-01T13:25:00Z``."""
    return datetime.fromtimestamp(epoch, tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
