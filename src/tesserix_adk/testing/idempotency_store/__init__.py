"""The conformance suite every ``IdempotencyStore`` passes.

``IdempotencyStoreConformance`` is one class a backend subclasses; its checks are written
by theme, one mixin per module (claims, completion and release, ttl expiry, fences,
look-up, resolution, tenants), so a reader finds every rule of one kind in one place.
Test names are the suite's interface (``-k`` selections name them), so a check keeps its
name whichever module holds it.
"""

from __future__ import annotations

from tesserix_adk.testing.idempotency_store.claims import ClaimChecks
from tesserix_adk.testing.idempotency_store.completion import CompletionChecks
from tesserix_adk.testing.idempotency_store.expiry import ExpiryChecks
from tesserix_adk.testing.idempotency_store.fences import FenceChecks
from tesserix_adk.testing.idempotency_store.lookup import LookupChecks
from tesserix_adk.testing.idempotency_store.resolution import ResolutionChecks
from tesserix_adk.testing.idempotency_store.tenants import TenantChecks

__all__ = ["IdempotencyStoreConformance"]


class IdempotencyStoreConformance(
    ClaimChecks,
    CompletionChecks,
    ExpiryChecks,
    FenceChecks,
    LookupChecks,
    ResolutionChecks,
    TenantChecks,
):
    """Subclass this in a test module to check an ``IdempotencyStore``.

    Provide two fixtures (in the subclass, a conftest or the module):

    - ``idempotency_store``: a fresh, empty store;
    - ``clock``: the ``FakeClock`` injected into that store, or ``None`` when the store
      reads its own clock (a database or server clock); ttl tests then wait for real, for
      ``past_short_ttl`` seconds at a time. ``controls_clock = False`` forces real waits.

    and, optionally, ``round_trips``: a ``testing.counting.RoundTrips`` wired to the
    store's driver, or ``None``; without one the tests of requests sent skip, saying why.
    """
