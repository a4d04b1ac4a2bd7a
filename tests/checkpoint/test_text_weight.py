"""``text_weight``: how much text a value holds, counted only until it is over the line
past which its redaction and encoding go to a worker thread. The count runs on the event
loop, so a value of millions of items must cost it no more than one just over the line."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from tesserix_adk.checkpoint.checkpointer import OFF_LOOP_BYTES, text_weight


class _Noted:
    """An item of a tool's own: counts each time it is printed."""

    printed = 0

    def __str__(self) -> str:
        type(self).printed += 1
        return "abcd"

    __repr__ = __str__


def test_millions_of_items_are_counted_only_until_over_the_line() -> None:
    _Noted.printed = 0
    many = [_Noted()] * 2_000_000
    assert text_weight(many) > OFF_LOOP_BYTES
    # Each item counts for at least one character: the walk stopped once over the line.
    assert _Noted.printed <= OFF_LOOP_BYTES, _Noted.printed
    _Noted.printed = 0
    assert text_weight({"rows": [{"id": i, "n": _Noted()} for i in range(500_000)]}) > (
        OFF_LOOP_BYTES
    )
    assert _Noted.printed <= OFF_LOOP_BYTES, _Noted.printed


def test_a_generator_is_no_json_data_and_is_never_walked() -> None:
    def items() -> Any:
        yield from ["abcdefgh"] * 10_000_000

    assert text_weight(items()) < 200  # its str, which never iterates it


def test_a_deep_value_and_a_huge_int_count_as_heavy() -> None:
    deep: Any = []
    for _ in range(100_000):
        deep = [deep]
    assert text_weight(deep) > OFF_LOOP_BYTES
    assert text_weight(10**5000) > OFF_LOOP_BYTES
    assert text_weight({"n": 10**5000}) > OFF_LOOP_BYTES


@dataclass
class _Row:
    name: str


_json = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(10**12), 10**12), st.floats(), st.text()),
    lambda inner: st.one_of(
        st.lists(inner, max_size=5), st.dictionaries(st.text(max_size=5), inner, max_size=5)
    ),
    max_leaves=30,
)


@settings(max_examples=200, deadline=None)
@given(value=_json)
def test_small_json_data_is_weighed_within_a_small_factor_of_its_text(value: Any) -> None:
    """Below the line the count is an estimate of the printed text: never far from it,
    so what went to a thread before still goes (and what stayed on the loop still stays)."""
    printed = len(str(value))
    weight = text_weight(value)
    assert weight <= OFF_LOOP_BYTES
    assert printed // 8 <= weight <= 6 * printed + 8, (weight, printed)


def test_other_objects_are_their_text() -> None:
    assert text_weight(_Row("x" * 100)) == len(str(_Row("x" * 100)))
