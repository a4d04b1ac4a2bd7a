"""Workers whose wall clock is off: ``libfaketime`` preloaded into an interpreter of their own.

The PyPI wheel ``libfaketime`` (the ``dev`` extra) ships a built ``libfaketime.so.1``; a
worker started with ``LD_PRELOAD`` on it and ``FAKETIME="+90s"`` sees every wall-clock read
(``time.time()``, SQLite's ``julianday('now')``) 90 s ahead. Only the wall clock is off
(``FAKETIME_DONT_FAKE_MONOTONIC=1``): a host whose clock is wrong or stepped still has a
monotonic clock that is not, and the history's times are monotonic. A fork of the fork
server cannot be preloaded, so a skewed worker is always a fresh interpreter.
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Iterable
from pathlib import Path

from reliability.history import Event

__all__ = ["OFFSETS", "faketime_env", "libfaketime", "live_takeovers", "skews"]

# The skews the issue asks for, in seconds, by their FAKETIME spelling.
OFFSETS = {"+90s": 90.0, "-90s": -90.0, "+1h": 3600.0, "-1h": -3600.0}


def libfaketime() -> Path | None:
    """The ``libfaketime.so.1`` of the installed ``libfaketime`` wheel, if there is one."""
    spec = importlib.util.find_spec("libfaketime")  # finds it without importing it
    if spec is None or not spec.submodule_search_locations:
        return None
    for root in spec.submodule_search_locations:
        so = Path(root) / "vendor" / "libfaketime" / "src" / "libfaketime.so.1"
        if so.exists():
            return so
    return None


def faketime_env(so: Path, offset: str) -> dict[str, str]:
    """The environment of a worker whose wall clock is ``offset`` (``"+90s"``) off."""
    return {
        "LD_PRELOAD": str(so),
        "FAKETIME": offset,
        "FAKETIME_DONT_FAKE_MONOTONIC": "1",
    }


def wall_offset() -> float:
    """This (unskewed) process's wall clock minus the host's monotonic clock, in seconds."""
    return time.time() - time.monotonic()


def skews(events: Iterable[Event], offset: float) -> dict[str, tuple[float, float]]:
    """Per worker, how far off its wall clock and SQLite's were when it started: each
    ``start`` line's wall times against the monotonic time it was written at, shifted by
    ``offset`` (``wall_offset()`` of an unskewed process)."""
    out = {}
    for e in events:
        if e.ev == "start" and "wall" in e.fields:
            real = e.t / 1e9 + offset
            out[e.proc] = (e["wall"] - real, e["db_wall"] - real)
    return out


def live_takeovers(events: list[Event], ttl: float) -> list[str]:
    """Leases granted while another worker's lease was certainly live by the host's clock.

    Worker S's grant (reply back at ``S.t``) came before ``g.sent + ttl`` for a grant or
    renewal ``g`` of another worker W whose reply was back before S asked: no store deciding
    by one true clock could have let the lease go that early. Only a W that never released
    its lease counts (killed, stopped, or ended superseded).
    """
    ended = {e.proc: e["verdict"] for e in events if e.ev == "result"}
    # The operator's resolve takes the run's lease and releases it; it never ends superseded.
    ended |= {e.proc: "resolve" for e in events if e.ev == "start" and e["mode"] == "resolve"}
    grants = [e for e in events if e.ev in ("acquire_ok", "renew_ok")]
    found = []
    for s in (e for e in events if e.ev == "acquire_ok"):
        for g in grants:
            if g.proc == s.proc or g.run != s.run:
                continue
            if ended.get(g.proc, "superseded") != "superseded":
                continue
            if g.t < s["sent"] and s.t < g["sent"] + ttl * 1e9:
                found.append(f"{s.run}: {s.proc} took fence {s['fence']} from {g.proc}")
                break
    return found
