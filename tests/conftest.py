"""Fixtures every test may use."""

from __future__ import annotations

import pytest

from booking import Airline
from tesserix_adk.testing import FakeClock


@pytest.fixture
def airline() -> Airline:
    return Airline()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()
