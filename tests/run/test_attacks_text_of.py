"""Attack on ``run/result_data.py`` as of 3129d28: ``_text_of`` (the text of what JSON
cannot hold, container by container, a pydantic model as a note), ``_key_name`` /
``_holds_a_model`` (a dict key that is or holds a model) and ``_pydantic_writes`` (asked of
the type). Driven through ``result_content`` (what a completed call's outcome records), with
a secret only a model's ``field_serializer(when_used="json")`` masks; old behaviour compared
against ``git show 3129d28^:src/tesserix_adk/run/result_data.py``.

Found, and fixed unless marked left (``result_data._text_of`` never raises, the type asked of
its pydantic-ness; ``_holds_a_model`` looks into dataclass keys and takes a key too deep to
look into as holding one; a key it cannot look into is written as before):
- HIGH ``test_a_value_beside_a_lazy_object_whose_class_raises_is_kept``: a lazy proxy whose
  ``__class__`` raises (Django ``SimpleLazyObject``, ``lazy_object_proxy`` whose factory
  fails) beside the pages of a list: ``_pydantic_writes``' ``isinstance`` raises outside
  ``_text_of``'s ``try``, so the whole list is written "<a list that cannot be written as
  text>": every page lost, not only the value nothing can write.
- HIGH ``test_an_object_whose_attribute_lookup_raises_does_not_raise``: the same object as
  the whole result (or one whose ``__getattribute__`` raises): ``_text_of`` ->
  ``_pydantic_writes`` raises out of ``_last_text`` and ``result_content``: a completed call
  becomes an error.
- HIGH ``test_a_frozen_dataclass_key_holding_a_model_never_shows_what_it_masks``:
  ``_holds_a_model`` looks only in tuples and frozensets; a frozen dataclass key is written
  by pydantic as ``str`` (dataclass repr -> model repr): the masked field raw.
- HIGH ``test_a_model_deep_in_a_tuple_key_never_shows_what_it_masks``: a model more than
  MAX_NESTING (64) tuples deep in a key: ``_holds_a_model`` stops at ``depth < MAX_NESTING``,
  answers False, and pydantic writes the key as the model's ``str`` (contrived nesting).
- HIGH (regression of 3129d28)
  ``test_a_tuple_key_whose_iteration_raises_loses_no_value``: ``_key_name`` now iterates a
  tuple key (``_holds_a_model``) outside any ``try``; a tuple subclass whose ``__iter__``
  raises makes ``_keys_clash`` raise, the walk leaves the dict to pydantic, which writes the
  key ``"1"`` over the int key ``1``: a value lost that 3129d28^ kept as ``"(int) 1"``.
- MEDIUM (fixed: a container met again inside itself is a short note,
  ``result_data._again``) ``test_a_tree_with_parent_links_is_written_in_bounded_text``: N
  children each linking to the root: ``_converted`` retries ``_in_pieces`` (about 30,000
  weighing steps) for every link, then ``_last_text`` writes the whole tree again for every
  link: text and time quadratic (400 children: ~18 s, 6 MB; 10,000 children: hours, gigabytes), the
  conversion thread held. The same for ``[l] * N`` (a list holding itself N times; with
  N = 200,000 it never ends); ``MOST_WALKED`` does not see it (N values only).

Held: a list of 200,000 values holding itself once is written in bounded text, values kept;
a mapping whose ``items`` yields non-pairs, a list subclass whose ``__iter__`` or
``__len__`` raises, a mapping whose keys' ``__hash__``/``__eq__`` raise, a dataclass whose
field raises, each in a cycle: ``result_content`` does not raise and the page beside is
kept; a model 60 tuples deep in a key and a model in a deque, a namedtuple, a dataclass in
a cycle are written as a note (the secret masked).
"""

from __future__ import annotations

import collections.abc as abc
import dataclasses
import json
from collections import deque, namedtuple
from typing import Any

import pydantic
import pytest

from tesserix_adk.run.result_data import result_content

SECRET = "SIGNKEYqzv81x"  # only the model's serializer masks it


class Signed(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(frozen=True)
    token: str

    @pydantic.field_serializer("token", when_used="json")
    def _mask(self, value: str) -> str:
        return "***"


def _text(content: Any) -> str:
    return json.dumps(content, default=repr)


def _in_a_cycle(value: Any) -> list[Any]:
    held: list[Any] = ["page1", value]
    held.append(held)
    return held


class _Lazy:
    """Like Django's SimpleLazyObject whose setup fails: ``__class__`` evaluates it."""

    @property  # type: ignore[misc]
    def __class__(self) -> type:
        raise RuntimeError("Working outside of application context")

    def __repr__(self) -> str:
        return "<lazy>"


class _Hostile:
    def __getattribute__(self, name: str) -> Any:
        raise RuntimeError("unbound proxy")


def test_a_value_beside_a_lazy_object_whose_class_raises_is_kept() -> None:
    content = result_content(["page1", "page2", _Lazy()])
    assert "page1" in _text(content) and "page2" in _text(content)


@pytest.mark.parametrize("make", [_Lazy, _Hostile], ids=["class-raises", "getattribute-raises"])
def test_an_object_whose_attribute_lookup_raises_does_not_raise(make: Any) -> None:
    content = result_content(make())
    assert isinstance(content, str)


def test_a_frozen_dataclass_key_holding_a_model_never_shows_what_it_masks() -> None:
    @dataclasses.dataclass(frozen=True)
    class Request:
        signed: Signed

    content = result_content({Request(Signed(token=SECRET)): "page1"})
    assert "page1" in _text(content)
    assert SECRET not in _text(content)


def _deep_key(depth: int) -> Any:
    key: Any = Signed(token=SECRET)
    for _ in range(depth):
        key = (key,)
    return key


def test_a_model_deep_in_a_tuple_key_never_shows_what_it_masks() -> None:
    content = result_content({_deep_key(100): "page1"})
    assert SECRET not in _text(content)


def test_a_model_60_tuples_deep_in_a_key_is_a_note() -> None:
    content = result_content({_deep_key(60): "page1"})
    assert SECRET not in _text(content)
    assert "page1" in _text(content)


class _Unreadable(tuple):
    def __iter__(self) -> Any:
        raise RuntimeError("cannot iterate")


def test_a_tuple_key_whose_iteration_raises_loses_no_value() -> None:
    content = result_content({_Unreadable((1,)): "kept", 1: "other"})
    assert "kept" in _text(content) and "other" in _text(content)


def test_a_tree_with_parent_links_is_written_in_bounded_text() -> None:
    children = 60
    root: dict[str, Any] = {"name": "root", "children": []}
    for i in range(children):
        root["children"].append({"name": f"c{i}", "parent": root})
    content = result_content(root)
    assert all(f"c{i}" in _text(content) for i in range(children))
    # Each link to the root written as a short note, not the whole tree again.
    assert len(_text(content)) < 200 * children


def test_a_long_list_holding_itself_once_is_bounded_and_keeps_its_values() -> None:
    held: list[Any] = list(range(200_000))
    held.append(held)
    content = result_content(held)
    assert isinstance(content, list) and content[:3] == [0, 1, 2] and content[199_999] == 199_999
    assert len(_text(content)) < 40 * 200_000


class _NonPairs(abc.Mapping):  # type: ignore[type-arg]
    def __getitem__(self, key: Any) -> Any:
        return 1

    def __iter__(self) -> Any:
        return iter(["a"])

    def __len__(self) -> int:
        return 1

    def items(self) -> Any:
        return [("a", 1, 2), "x"]


class _BadLen(list):  # type: ignore[type-arg]
    def __len__(self) -> int:
        raise RuntimeError("len")


class _BadIter(list):  # type: ignore[type-arg]
    def __iter__(self) -> Any:
        raise RuntimeError("iter")


class _BadHash:
    def __hash__(self) -> int:
        raise RuntimeError("hash")

    def __eq__(self, other: object) -> bool:
        raise RuntimeError("eq")


class _BadKeys(abc.Mapping):  # type: ignore[type-arg]
    def __getitem__(self, key: Any) -> Any:
        return 1

    def __iter__(self) -> Any:
        return iter([_BadHash()])

    def __len__(self) -> int:
        return 1


@dataclasses.dataclass
class _Fields:
    a: Any
    b: int = 0


def _missing_field() -> _Fields:
    value = _Fields(1)
    del value.b
    return value


@pytest.mark.parametrize(
    "make",
    [_NonPairs, lambda: _BadLen([1, 2]), lambda: _BadIter([1, 2]), _BadKeys, _missing_field],
    ids=["non-pairs", "len-raises", "iter-raises", "hash-raises", "field-raises"],
)
def test_a_hostile_container_in_a_cycle_keeps_the_page_beside_it(make: Any) -> None:
    content = result_content(_in_a_cycle(make()))
    assert "page1" in _text(content)


Pair = namedtuple("Pair", "left right")


@dataclasses.dataclass
class _Holder:
    signed: Any
    me: Any = None


def _holder_cycle() -> _Holder:
    value = _Holder(Signed(token=SECRET))
    value.me = value
    return value


@pytest.mark.parametrize(
    "make",
    [
        lambda: _in_a_cycle(deque([Signed(token=SECRET)])),
        lambda: _in_a_cycle(Pair(Signed(token=SECRET), 1)),
        _holder_cycle,
    ],
    ids=["deque", "namedtuple", "dataclass"],
)
def test_a_model_in_a_container_in_a_cycle_is_a_note(make: Any) -> None:
    content = result_content(make())
    assert SECRET not in _text(content)
