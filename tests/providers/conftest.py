"""Fixtures: the vendor under test, providers closed after use (over the root conftest's
fake model server, ``model_server``), and the airline the booking agent talks to.

The server and its reply bodies live in ``fake_server``; the vendors in ``vendors``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from .booking import Airline
from .fake_server import ModelServer
from .vendors import VENDORS, SDKProvider, Vendor


@pytest.fixture(params=VENDORS, ids=[v.name for v in VENDORS])
def vendor(request: pytest.FixtureRequest) -> Vendor:
    """Each guarantee runs once per vendor SDK."""
    value: Vendor = request.param
    return value


@pytest.fixture
async def new_provider(
    vendor: Vendor, model_server: ModelServer
) -> AsyncIterator[Callable[..., SDKProvider]]:
    """Builds fresh providers (as new processes would) and closes them after the test."""
    made: list[SDKProvider] = []

    def make(**kwargs: Any) -> SDKProvider:
        provider = vendor.provider(model_server, **kwargs)
        made.append(provider)
        return provider

    yield make
    for provider in made:
        await provider.aclose()


@pytest.fixture
def airline() -> Airline:
    """A fresh airline with no bookings."""
    return Airline()
