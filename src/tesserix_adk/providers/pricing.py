"""Prices and the cost of a model call, in micros, from a table the user passes.

Shared by the SDK-backed providers and importable without either SDK. There is no built-in
price list and no network look-up: a price the user did not give costs 0, so a budget only
binds when the user has said what a token costs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from tesserix_adk.errors import ConfigurationError
from tesserix_adk.messages import Usage

__all__ = ["Price", "Prices", "cost_micros", "price_for"]

_MILLION = 1_000_000


@dataclass(frozen=True, slots=True, kw_only=True)
class Price:
    """What a million tokens cost, in micros (millionths of the currency unit).

    For example ``Price(input_per_million_micros=2_500_000,
    output_per_million_micros=10_000_000)`` is $2.50 in and $10.00 out per million tokens.
    """

    input_per_million_micros: int
    output_per_million_micros: int

    def __post_init__(self) -> None:
        if self.input_per_million_micros < 0 or self.output_per_million_micros < 0:
            raise ConfigurationError(f"a price cannot be negative: {self!r}")


Prices = Mapping[str, Price] | Price | None
"""One price for every model, a table by model name, or ``None`` (every call costs 0)."""


def price_for(prices: Prices, *models: str | None) -> Price | None:
    """The price of the first of ``models`` the table names (a lone ``Price`` fits all)."""
    if prices is None or isinstance(prices, Price):
        return prices
    for model in models:
        if model is not None and model in prices:
            return prices[model]
    return None


def cost_micros(usage: Usage, price: Price | None) -> int:
    """``ceil(in * input_price / 1e6 + out * output_price / 1e6)``; 0 without a price.

    Integer arithmetic, rounded up once over the sum, so a run of cheap calls is never
    charged less than it cost.
    """
    if price is None:
        return 0
    total = (
        usage.input_tokens * price.input_per_million_micros
        + usage.output_tokens * price.output_per_million_micros
    )
    return -(-total // _MILLION)
