"""The bounded walk every weigher shares (``checkpoint/payload/weighing.weighed``): it
weighs every item however nested, and reads no further once over its line."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from tesserix_adk.checkpoint.payload.weighing import weighed

_json = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.text(max_size=5)),
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.tuples(inner, inner),
        st.dictionaries(st.text(max_size=3), inner, max_size=4),
    ),
    max_leaves=30,
)


def _count(value: Any) -> int:
    """The oracle: itself, and every item held, a dict's keys too."""
    if isinstance(value, (list, tuple)):
        return 1 + sum(_count(v) for v in value)
    if isinstance(value, dict):
        return 1 + sum(1 + _count(v) for v in value.values())
    return 1


@settings(max_examples=200, deadline=None)
@given(value=_json)
def test_every_item_is_weighed_once_under_the_line(value: Any) -> None:
    assert weighed(value, lambda _: 1, past=10**9) == _count(value)


@settings(max_examples=200, deadline=None)
@given(value=_json, past=st.integers(0, 40))
def test_no_item_is_read_once_over_the_line(value: Any, past: int) -> None:
    read: list[Any] = []

    def weight(item: Any) -> int:
        read.append(item)
        return 1

    total = weighed(value, weight, past=past)
    assert total == min(_count(value), past + 1)
    assert len(read) == total


def test_a_deep_value_is_walked_without_recursion() -> None:
    deep: Any = "bottom"
    for _ in range(100_000):
        deep = [deep]
    assert weighed(deep, lambda item: len(item) if type(item) is str else 0, past=10) == 6


class _Unreadable(list[Any]):
    def __iter__(self) -> Any:
        raise RuntimeError("not today")


def test_a_containers_subclass_is_weighed_whole_and_never_read() -> None:
    # Its own __iter__ may raise or never end: weighed as one item, as a value it holds.
    assert weighed({"rows": _Unreadable([1, 2, 3])}, lambda _: 1, past=100) == 3
