"""``run.costs.paid``: what a model call's reported cost and tokens count as, or why they
are refused (the budget attack in ``test_attacks_budget_cancel.py`` runs it end to end)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tesserix_adk.errors import ProviderError
from tesserix_adk.messages import Message, Usage
from tesserix_adk.providers.base import ModelResponse
from tesserix_adk.run.costs import MAX_COST_MICROS, paid


def _answer(cost: Any, usage: Usage | None = None) -> ModelResponse:
    return ModelResponse(message=Message.assistant("ok"), usage=usage or Usage(), cost_micros=cost)


@given(st.integers(0, MAX_COST_MICROS))
def test_whole_micros_are_charged_as_given(cost: int) -> None:
    assert paid(_answer(cost))[0] == cost


@pytest.mark.parametrize(("cost", "charged"), [(0.9, 1), (5.0, 5), (5.4, 6), (1e-9, 1), (0.0, 0)])
def test_a_fraction_of_a_micro_is_rounded_up_never_down(cost: float, charged: int) -> None:
    assert paid(_answer(cost)) == (charged, Usage())


@pytest.mark.parametrize(
    "cost",
    [
        -1,
        -0.5,
        float("nan"),
        float("inf"),
        float("-inf"),
        MAX_COST_MICROS + 1,
        2**70,
        True,
        "5",
        None,
    ],
)
def test_a_cost_no_ledger_can_charge_is_refused_and_not_retried(cost: Any) -> None:
    with pytest.raises(ProviderError, match="cannot charge") as caught:
        paid(_answer(cost))
    assert caught.value.retryable is False


@pytest.mark.parametrize(
    "usage",
    [Usage(input_tokens=-1), Usage(output_tokens=-5), Usage(input_tokens=1.5)],  # type: ignore[arg-type]
)
def test_tokens_that_are_not_a_count_are_refused(usage: Usage) -> None:
    with pytest.raises(ProviderError, match="tokens"):
        paid(_answer(10, usage))
