"""A clock tests move by hand, standing in for a store's own clock."""

from __future__ import annotations

__all__ = ["FakeClock"]


class FakeClock:
    """Epoch seconds that only move when ``advance`` is called."""

    def __init__(self, start: float = 1_800_000_000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        """Move the clock forward (or back, with a negative number)."""
        self.now += seconds
