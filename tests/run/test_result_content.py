"""What a tool returns, as the JSON data the model is told and the record keeps
(``run.result_data.result_content``): no value of a dict is lost to JSON's text keys, and a
result with nothing odd in it comes back as itself."""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import itertools
import json
import threading
from collections import Counter, deque
from collections.abc import Iterator
from typing import Any

import pydantic
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hostile_results import Witness
from tesserix_adk import Agent, AgentRunner, ScriptedProvider, open_stores, tool
from tesserix_adk.checkpoint.redaction import Redactor
from tesserix_adk.run import result_data
from tesserix_adk.run.invoking import result_content
from tesserix_adk.stores.protocols import RecordStatus

_keys = st.one_of(
    st.sampled_from(["1", "true", "None", "1.5", "a", "/w==", "[1, 2]", "1,2"]),
    # Keys pydantic writes as that text, and keys it cannot write at all (bytes that are
    # not UTF-8, an int past Python's digit limit for text, a frozenset).
    st.sampled_from([1, True, None, 1.5, b"1", b"\xff", (1, 2), frozenset({1})]),
    st.builds(lambda: 10**5000),  # built, not sampled: hypothesis cannot print it
)
_leaf = st.one_of(st.text(max_size=4), st.integers(-9, 9))


@dataclasses.dataclass
class _Box:
    held: Any


_values = st.recursive(
    _leaf,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.dictionaries(_keys, inner, min_size=1, max_size=4),
        # Holders pydantic writes as a dict and a list: a dict inside loses no value either.
        st.builds(_Box, inner),
        st.builds(lambda vs: deque(vs), st.lists(inner, max_size=3)),
    ),
    max_leaves=12,
)


def _leaves(value: Any) -> list[Any]:
    if isinstance(value, _Box):
        return _leaves(value.held)
    if isinstance(value, dict):
        return [leaf for v in value.values() for leaf in _leaves(v)]
    if isinstance(value, (list, tuple, deque)):
        return [leaf for v in value for leaf in _leaves(v)]
    return [value]


@settings(max_examples=300, deadline=None)
@given(value=_values, yielded=st.booleans())
def test_no_value_is_lost_to_keys_json_writes_alike(value: Any, yielded: bool) -> None:
    given = Counter(map(repr, _leaves(value)))
    # A generator is written as the list of what it yields, read once.
    written = result_content(iter([value]) if yielded else value)
    json.dumps(written, allow_nan=False)  # JSON data, nothing else
    # Every value the tool returned is still there, as many times.
    kept = Counter(map(repr, _leaves(written)))
    assert not given - kept, (written, value)


def test_a_clashing_key_is_written_with_its_type_and_text_keys_stay_as_they_are() -> None:
    assert result_content({1: "seat-one", "1": "seat-uno"}) == {
        "1": "seat-uno",
        "(int) 1": "seat-one",
    }
    assert result_content({"rows": [{True: 1, "true": 2}], "n": 3}) == {
        "rows": [{"true": 2, "(bool) true": 1}],
        "n": 3,
    }
    assert result_content({True: 1, "true": 2, "true (bool)": 3}) == {
        "true": 2,
        "true (bool)": 3,
        "(bool) true": 1,
    }
    assert result_content({1: "a", 2: "b"}) == {"1": "a", "2": "b"}  # nothing clashes


def test_a_plain_result_is_handed_back_as_itself() -> None:
    rows = {"rows": [{"id": i, "name": f"n{i}"} for i in range(100)]}
    assert result_content(rows) == rows


class _Named(enum.Enum):
    """Keys JSON writes as their value: ``_Named.password`` is written ``"password"``."""

    password = "password"
    api_key = "api_key"
    token = "token"
    authorization = "authorization"
    client_secret = "client_secret"


@settings(max_examples=60, deadline=None)
@given(
    name=st.sampled_from([m.value for m in _Named]),
    make=st.sampled_from(["bytes", "enum"]),
    first=st.booleans(),
)
def test_a_secret_under_a_clashing_key_is_masked_as_under_its_text_key(
    name: str, make: str, first: bool
) -> None:
    """A key that clashes with a text key is renamed so that its name still ends as the
    text key's does: the redactor, which masks by how a key's name ends, masks both."""
    other: Any = name.encode() if make == "bytes" else _Named(name)
    pairs = [(name, "hunter2-under-text"), (other, "hunter2-under-other")]
    value = dict(pairs if first else pairs[::-1])
    written = Redactor().value(result_content(value))
    assert "hunter2" not in json.dumps(written), written
    assert len(written) == 2


async def test_a_result_a_cancelled_sync_tool_returned_is_converted_off_the_loop() -> None:
    """Cancelled while a sync tool runs, the run waits for its thread and records what it
    returned: converted in a thread too, as a live call's result is."""
    seen: list[bool] = []
    entered, gate = threading.Event(), threading.Event()

    @tool(key=lambda **kw: "order-1")
    def book(seat: str) -> Any:
        """Book a seat (a side effect)."""
        entered.set()
        gate.wait(10)
        return {"many": [Witness(seen)] * 3}

    try:
        async with open_stores("memory://") as stores:
            await stores.create_schema()
            runner = AgentRunner.from_stores(ScriptedProvider([[("book", {"seat": "1"})]]), stores)
            task = asyncio.ensure_future(
                runner.run(Agent("a", "x", [book]), "go", tenant="t", run_id="r")
            )
            assert await asyncio.to_thread(entered.wait, 10)
            asyncio.get_running_loop().call_later(0.1, gate.set)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            [record] = await stores.idempotency.records("t", "r")
    finally:
        gate.set()
    assert record.status is RecordStatus.completed
    assert seen and not any(seen), seen


@pytest.mark.parametrize(
    "shape",
    ["flat", "pages", "huge-dict", "four-levels-down"],
)
def test_a_result_of_many_values_is_converted_in_pieces(
    shape: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One call into pydantic-core keeps the GIL for its whole length, so a result of
    hundreds of thousands of values goes to it in pieces of about ``_PIECE`` values,
    however they nest, and comes back the same as in one call."""
    row = (7, "seat", 1.5)
    value: Any = {
        "flat": [row] * 300_000,
        "pages": [[row] * 1_000] * 300,
        "huge-dict": dict.fromkeys([f"k{i}" for i in range(300_000)], 1.5),
        "four-levels-down": {"a": {"b": {"c": {"d": [row] * 300_000}}}},
    }[shape]
    sizes: list[int] = []
    one_call = result_data.to_jsonable_python

    def counted(data: Any, **kwargs: Any) -> Any:
        sizes.append(result_data._items(data, 10**9))
        return one_call(data, **kwargs)

    monkeypatch.setattr(result_data, "to_jsonable_python", counted)
    written = result_content(value)
    assert len(sizes) > 10 and max(sizes) <= 2 * result_data._PIECE, (len(sizes), max(sizes))
    assert written == one_call(value, fallback=str)


_PAIR_NAMES = st.sampled_from(["x-api-key", "Authorization", "token", "accept", "user"])
_PAIR_VALUES = st.one_of(
    st.text(min_size=1, max_size=6),
    st.integers(0, 9),
    st.dictionaries(st.sampled_from(["a", "b"]), st.text(max_size=3), max_size=2),
)


@settings(max_examples=150, deadline=None)
@given(pairs=st.lists(st.tuples(_PAIR_NAMES, _PAIR_VALUES).map(list), max_size=4))
def test_pairs_are_masked_alike_as_data_and_as_json_text(pairs: list[Any]) -> None:
    """A record keeps a result as data; the transcript keeps it as JSON text: a
    ``[name, value]`` pair is masked the same in both, so a resumed model is told what the
    record holds."""
    redactor = Redactor()
    as_data = redactor.value(pairs)
    as_text = json.loads(redactor.text(json.dumps(pairs)))
    assert as_data == as_text


def _past_the_cap(read: list[int], start: int = 0) -> Iterator[int]:
    """Values without end, counted as they are read; one read past ``MOST_READ`` and a few
    more would be reading on (the test would not hang on a kit that does)."""
    for n in itertools.count(start):
        read.append(n)
        if len(read) > result_data.MOST_READ + 5:
            raise AssertionError("read on past MOST_READ")
        yield n


def test_an_endless_generator_is_read_up_to_the_cap_and_says_the_rest_was_not_read() -> None:
    read: list[int] = []
    written = result_content({"rows": _past_the_cap(read)})
    rows = written["rows"]
    assert len(read) == result_data.MOST_READ
    assert rows[:-1] == list(range(result_data.MOST_READ))
    assert "the rest of this result was not read" in rows[-1], rows[-1]


def test_the_cap_holds_for_all_the_iterators_of_a_result_together() -> None:
    """Generators of generators: the values read in the whole result are counted, so one
    result cannot be read for ``MOST_READ`` values per iterator, without end."""
    read: list[int] = []

    def pages() -> Iterator[Iterator[int]]:
        while True:
            yield _past_the_cap(read, len(read))

    written = result_content(pages())
    assert len(read) < result_data.MOST_READ + 5
    assert "the rest of this result was not read" in json.dumps(written)[-200:]


async def test_a_tool_returning_an_endless_generator_completes_its_call() -> None:
    """The call's outcome is known (it returned): recorded completed, the run goes on,
    though no record can hold what it returned (too large at the default max_bytes)."""

    @tool(key=lambda **kw: "count-1")
    def count() -> Any:
        """Count (a side effect)."""
        return itertools.count()

    async with open_stores("memory://") as stores:
        await stores.create_schema()
        runner = AgentRunner.from_stores(ScriptedProvider([[("count", {})], "Done."]), stores)
        result = await runner.run(Agent("a", "x", [count]), "go", tenant="t", run_id="r")
        [record] = await stores.idempotency.records("t", "r")
    assert result.output == "Done."
    assert record.status is RecordStatus.completed


@pytest.mark.parametrize("through", ["list", "dict", "tuple-in-list"])
def test_a_cyclic_result_is_written_otherwise_after_one_look_at_its_cycle(
    through: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cycle holds more items than any piece, however small it is: cutting it into
    pieces went round it about a thousand times (seconds of work for two values). It is
    written as pydantic cannot, as its text, after one pass."""
    loop: list[Any] = ["booked"]
    holder: Any = {"list": loop, "dict": {"ref": "BK-1", "again": loop}}.get(through, [(loop,)])
    loop.append(holder)
    weighings: list[int] = []
    weigh = result_data._items

    def counted(value: Any, past: int) -> int:
        weighings.append(past)
        return weigh(value, past)

    monkeypatch.setattr(result_data, "_items", counted)
    written = result_content(holder)
    assert "booked" in json.dumps(written)
    assert len(weighings) < 100, len(weighings)  # about 3,000 when it went round the cycle


class _Card(pydantic.BaseModel):
    number: str

    @pydantic.field_serializer("number", when_used="json")
    def _masked(self, number: str) -> str:
        return "****" + number[-4:]


def test_a_cycle_written_as_text_never_shows_what_a_model_inside_it_masks() -> None:
    """The text of a result JSON cannot hold (a cycle) writes each container itself: a
    model's ``repr`` would show the field its serializer masks."""
    loop: list[Any] = [_Card(number="4111111111111111")]
    loop.append(loop)
    for result in (loop, {"cards": loop}, (loop,)):
        written = json.dumps(result_content(result))
        assert "4111111111111111" not in written, written
        assert "****1111" in written, written
