"""Store-clock moments as people read them: ISO 8601 UTC to the second."""

from __future__ import annotations

import math
from datetime import UTC, datetime

__all__ = ["iso_time", "shown_time"]

# What a datetime can show; a store's clock (or a lease given a ttl of centuries) may say
# more, and a display must not fail for it.
_EARLIEST = datetime(1, 1, 1, tzinfo=UTC).timestamp()
_LATEST = datetime(9999, 12, 31, 23, 59, 59, tzinfo=UTC).timestamp()


def shown_time(epoch: float, fmt: str) -> str:
    """Epoch seconds in UTC as ``fmt`` writes them, held within years 1 to 9999."""
    held = _EARLIEST if math.isnan(epoch) else min(max(epoch, _EARLIEST), _LATEST)
    moment = datetime.fromtimestamp(held, tz=UTC)
    # Four digits whatever the C library does with %Y (glibc writes year 1 as "1").
    return moment.strftime(fmt.replace("%Y", f"{moment.year:04d}"))


def iso_time(epoch: float) -> str:
    """Epoch seconds as ISO 8601 UTC to the second, e.g. ``2026-12-01T13:25:00Z``."""
    return shown_time(epoch, "%Y-%m-%dT%H:%M:%SZ")
