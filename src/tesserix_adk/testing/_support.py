"""What the conformance suites share: awkward ids and the passing of a store's time."""

from __future__ import annotations

import asyncio
from typing import ClassVar

from tesserix_adk.testing.clock import FakeClock

__all__ = ["JOIN_ALIKE_IDS", "ODD_IDS", "ClockedConformance"]

# Ids that break a store which quotes, splits, globs or normalises instead of keeping bytes.
ODD_IDS: tuple[str, ...] = (
    "a:b",
    "x'; DROP TABLE t;--",
    "{tag}",
    "ü/ß",
    "*",
    "%41",
    "a b",
    'q"uote\\',
)

# Pairs of (tenant, run_id) that collide when a store joins them with ":" or "/".
JOIN_ALIKE_IDS: tuple[tuple[str, str], ...] = (
    ("a:b", "c"),
    ("a", "b:c"),
    ("a/b", "c"),
    ("a", "b/c"),
)


class ClockedConformance:
    """Lets time pass on the store's clock, by hand or for real.

    The suite asks for a ``clock`` fixture: the ``FakeClock`` injected into the store under
    test, or ``None`` when the store reads a clock nobody can move (a database or server
    clock). Set ``controls_clock = False`` to force real waits whatever ``clock`` is. Real
    waits use ``short_ttl`` and ``past_short_ttl`` seconds, so keep them small but with a
    margin wide enough for the round trips of the backend.
    """

    controls_clock: ClassVar[bool] = True
    short_ttl: ClassVar[float] = 0.3
    past_short_ttl: ClassVar[float] = 0.5

    def moves_clock(self, clock: FakeClock | None) -> bool:
        """Whether time passes by advancing ``clock`` rather than by sleeping."""
        return self.controls_clock and clock is not None

    async def let_pass(self, clock: FakeClock | None, seconds: float) -> None:
        """Let ``seconds`` pass on the store's clock."""
        if clock is not None and self.moves_clock(clock):
            clock.advance(seconds)
        else:
            await asyncio.sleep(seconds)
