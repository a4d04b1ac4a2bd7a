"""Span and trace ids derived from what the run is, never drawn at random.

A run's trace id comes from (tenant, run); a span id from (tenant, run, attempt, what): the
same attempt reported twice (a retried export, an attempt's spans re-sent) names the same
spans, so a backend counts them once. The API alone cannot choose a span's id, so an SDK
``TracerProvider`` is given a ``DeterministicIds`` as its ``id_generator``; the kit tells
it, just before each span it starts, the ids that span must have. Any other span (another
library's, on the same provider) gets random ids as usual.
"""

from __future__ import annotations

import hashlib
import secrets
import threading

from tesserix_adk.tools import canonical_json

__all__ = ["DeterministicIds", "span_id_of", "trace_id_of"]


def _digest(parts: list[object], bits: int) -> int:
    body = canonical_json(["tesserix-otel", *parts]).encode("utf-8")
    value = int.from_bytes(hashlib.sha256(body).digest()[: bits // 8], "big")
    return value or 1  # zero is the API's invalid id


def trace_id_of(tenant: str, run_id: str) -> int:
    """The 128-bit trace id of a run: every attempt of it is in this trace."""
    return _digest([tenant, run_id], 128)


def span_id_of(tenant: str, run_id: str, *what: str | int | None) -> int:
    """The 64-bit span id of one thing a run did (an attempt, a model call, a call)."""
    return _digest([tenant, run_id, *what], 64)


class DeterministicIds:
    """An SDK ``IdGenerator`` (duck-typed: the kit needs only the API) that hands out the
    ids the kit asked for, and random ones for everything else.

    ``TracerProvider(id_generator=DeterministicIds())``. Ids are handed over per thread
    between ``expect`` and the ``start_span`` right after it, which is synchronous.
    """

    def __init__(self) -> None:
        self._next = threading.local()

    def expect(self, trace_id: int, span_id: int) -> None:
        """The next span started on this thread gets these ids (the trace id only if it
        has no parent)."""
        self._next.trace_id = trace_id
        self._next.span_id = span_id

    def clear(self) -> None:
        """Forget what ``expect`` said (its span was started, or never was)."""
        self._next.trace_id = None
        self._next.span_id = None

    def generate_trace_id(self) -> int:
        """The expected trace id, else a random one."""
        trace_id: int | None = getattr(self._next, "trace_id", None)
        self._next.trace_id = None
        return trace_id if trace_id is not None else secrets.randbits(128) or 1

    def generate_span_id(self) -> int:
        """The expected span id, else a random one."""
        span_id: int | None = getattr(self._next, "span_id", None)
        self._next.span_id = None
        return span_id if span_id is not None else secrets.randbits(64) or 1

    def is_trace_id_random(self) -> bool:
        """Trace ids the kit chose are not random (W3C ``random`` trace flag unset)."""
        return False
