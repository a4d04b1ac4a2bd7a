"""What a model call costs, as the run counts it and the ledger charges it.

A provider's answer reports its cost in micros and its tokens. The run and the ledger read
them only through ``paid``: a cost is whole micros, rounded up (a fraction of a micro is
never charged as nothing), and one that is negative, not a finite number, or past what
every ledger holds exactly is refused. Refused, not clamped: a provider reporting a refund
or NaN is broken, and the budget must not be switched off by it.
"""

from __future__ import annotations

import math
from numbers import Real

from tesserix_adk.errors import ProviderError
from tesserix_adk.messages import Usage
from tesserix_adk.providers._common import uncharged
from tesserix_adk.providers.base import ModelResponse

__all__ = ["MAX_COST_MICROS", "paid", "paid_as_told"]

MAX_COST_MICROS = 2**53 - 1
"""The most one model call may cost, in micros, and the most tokens it may count: exact as
a JSON number and in every ledger (which adds them up in 64 bits)."""


def paid(response: ModelResponse) -> tuple[int, Usage]:
    """The whole micros and the tokens ``response`` reports; ``ProviderError`` (not
    retryable: asking again pays again) if either cannot be charged as given."""
    return _checked(response.cost_micros, response.usage)


def paid_as_told(paid: object) -> tuple[int, Usage]:
    """``paid`` of a ``(cost in micros, usage)`` told apart from a response (a billed call
    whose answer could not be taken: ``ProviderError.paid``), shape and all."""
    if not (isinstance(paid, tuple) and len(paid) == 2 and isinstance(paid[1], Usage)):
        raise _refused(f"a billed call's cost and usage of {_short(paid)}")
    return _checked(*paid)


def _checked(cost: float, usage: Usage) -> tuple[int, Usage]:
    if not isinstance(usage, Usage):
        raise _refused(f"a usage of {_short(usage)}, not a Usage")
    if isinstance(cost, bool) or not isinstance(cost, Real):
        raise _refused(f"a cost of {_short(cost)} micros, not a number")
    # Compared before anything converts it: an int past a float's range would overflow.
    if not 0 <= cost <= MAX_COST_MICROS:  # NaN compares false, so it stops here too
        raise _refused(f"a cost of {_short(cost)} micros")
    for name in ("input_tokens", "output_tokens"):
        tokens = getattr(usage, name)
        if isinstance(tokens, bool) or not isinstance(tokens, int):
            raise _refused(f"{name}={_short(tokens)}")
        if not 0 <= tokens <= MAX_COST_MICROS:
            raise _refused(f"{name}={_short(tokens)} tokens")
    return math.ceil(cost), usage


def _short(value: object) -> str:
    """``repr`` of a reported value, cut (a 400-digit cost need not be printed whole)."""
    text = repr(value) if not isinstance(value, int) or value.bit_length() < 200 else "a huge int"
    return text if len(text) <= 60 else text[:57] + "..."


def _refused(what: str) -> ProviderError:
    return uncharged(what)
