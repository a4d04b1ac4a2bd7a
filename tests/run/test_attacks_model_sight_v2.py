"""Attack on ce49040 and 22917f8: ``ModelSight`` (``run/model_sight.py``: a Tarjan-style
walk with a memo of clear and showing objects per result), ``result_data.error_text`` /
``_said`` (an exception that would show a model is written as its arguments) and
``result_data._count_inside`` (what a pydantic model holds counted against
``MOST_WALKED``). End to end through ``AgentRunner`` on SQLite with a keyed tool: the
call's record, the SQLite file's bytes and what the model was told.

Found, and fixed unless marked left (``error_text``, now in ``run/error_text.py``, looks at
``MOST_LOOKED_AT_IN_AN_ERROR`` (10,000 objects then, text and numbers never counted nor
taken to show a model; 100,000 values since, each counted, and past it the error's own text
is written); a type's fields and class attributes are read once per ``ModelSight``; a
container's subclass is looked at beyond its items; a ``ValidationError``'s inputs are
looked at; ``_count_inside`` reads the fields pydantic writes, not ``vars``):
- MEDIUM ``test_error_text_looks_at_few_objects_on_the_event_loop``: ``error_text`` runs
  on the event loop when a tool raises (``run/invoking.py``) and now walks everything the
  exception reaches (``ModelSight``, up to ``MOST_LOOKED_AT`` = 1,000,000 objects, each
  costing a walk of its class's ``__mro__`` dicts besides): a ``BulkError("insert
  failed", rows=...)`` holding 300,000 small rows held the loop ~6 s (20,000 rows of a
  class with 300 class attributes: ~3 s), where ``str(exc)`` took microseconds; lease
  renewals wait meanwhile (ttl 30 s). The test counts 60,004 objects looked at on the loop
  thread for a 20,000-row error.
- MEDIUM ``test_an_over_budget_error_keeps_its_message``: past ``MOST_LOOKED_AT`` every
  object not yet cleared is taken to show a model, the message text included:
  ``BulkError(rows, "insert failed")`` (no model anywhere) is written
  ``BulkError: <a list holding a pydantic model, ...>, <a str holding a pydantic model,
  ...>``: the message lost, and a model claimed where none is.
- MEDIUM ``test_a_list_subclass_argument_never_shows_what_it_masks``: ``_parts`` of a
  list/tuple/dict subclass is only its items, never its ``__dict__``: a ``Page(list)``
  whose ``repr`` shows its ``meta`` attribute (a model) in a tool's error is written as
  ``str(exc)``, the secret raw in the SQLite file and told to the model.
- MEDIUM ``test_a_validation_error_never_shows_what_it_masks``: a tool's
  ``pydantic.ValidationError`` (a model handed where another type is wanted) holds the
  input in pydantic-core, out of ``_parts``' sight; its text shows
  ``input_value=Card(memo='<secret>')``, raw in the SQLite file and told to the model.
- MEDIUM ``test_a_slotted_pydantic_dataclass_is_counted``: ``_held_inside`` reads
  ``vars(value)``, which raises for a ``pydantic.dataclasses.dataclass(slots=True)``
  (swallowed): what it holds is never counted, and shared lists inside it (ce49040's
  case) are left to pydantic, which takes hours.
- MEDIUM ``test_a_model_with_an_excluded_field_is_not_refused``: ``_count_inside`` counts
  ``Field(exclude=True)`` fields, which pydantic never writes: 3,000 search hits, each
  with an excluded 1,536-float embedding, are written as "(this result was not converted:
  it holds more than 4194304 values ...)" (after ~7 s) though their JSON is 40 KB: a
  completed read's result lost.
- MEDIUM (left, README names it)
  ``test_a_generator_inside_a_model_is_read_at_most_most_read_values``: a generator inside a
  model is read by pydantic, past ``MOST_READ`` and ``MOST_WALKED`` (an endless
  one holds the conversion thread for ever, its list growing).
- LOW (left: what its own ``__str__`` prints is not known)
  ``test_a_custom_str_error_holding_a_model_keeps_its_message``: an ``ApiError(resp)``
  whose ``__str__`` says ``API failed: status 500`` (never the model) is written
  ``ApiError: <a Card holding a pydantic model, ...>``: its message lost (and a model
  called a thing holding a model).
- LOW (left) ``test_builtins_showing_a_model_never_show_what_it_masks``: ``itertools.repeat``,
  ``asyncio.Future``, ``contextvars.ContextVar`` (default) and ``weakref.proxy`` show the
  model's text; ``_parts`` sees nothing inside them.
- LOW (left) ``test_an_object_cleared_then_given_a_model_never_shows_it``: the memo of clear
  objects is never looked at again: a ``Loader`` whose ``__str__`` fills a ``Lazy``
  met before it (in the same result) with a model: the second ``Lazy`` is written as its
  ``str``, the secret in it.

Held: the Tarjan walk against a brute-force reachability oracle (hypothesis: random graphs
of objects, lists, tuples and models, cycles spanning several strongly connected parts,
queries in random order on one ``ModelSight`` so scans abandoned at a model are met again,
a scan cut by ``MOST_LOOKED_AT``); ids are never reused while the memo holds them.
``error_text`` never raises and keeps the message of ``KeyError`` (quoted), ``OSError``
(errno, strerror, filename), an ``ExceptionGroup``, an exception with no args, one whose
``__str__`` raises, one holding a model in its args (a note); ``_count_inside`` counts a
model's ``extra``, a ``RootModel``, a plain pydantic dataclass and a model's nested dict,
tuple and set. Each odd tool error and result, end to end on SQLite with a keyed tool:
sent once, recorded once (completed), not sent again on resume.
"""

from __future__ import annotations

import asyncio
import contextvars
import itertools
import json
import threading
import weakref
from pathlib import Path
from typing import Any

import pydantic
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tesserix_adk.run import error_text as error_text_module
from tesserix_adk.run import model_sight, result_data
from tesserix_adk.run.model_sight import ModelSight
from tesserix_adk.run.result_data import MOST_READ, error_text, result_content

from .masked_model import (
    SECRET,
    assert_never_shown,
    run_on_sqlite,
)
from .masked_model import (
    card as _card,
)

T = "sight2"


async def _run_on_sqlite(tmp_path: Path, make: Any) -> tuple[Any, bytes, str, int]:
    return await run_on_sqlite(tmp_path, make, tenant=T)


async def _assert_never_shown(tmp_path: Path, make: Any) -> Any:
    return await assert_never_shown(tmp_path, make, tenant=T)


# --- the memo against a brute-force oracle (held) ------------------------------------------


class _Node:
    """A plain object; its ``out`` list (or tuple) holds what it points at."""

    def __init__(self) -> None:
        self.out: Any = []


class _Model(pydantic.BaseModel):
    n: int


@st.composite
def _graphs(draw: Any) -> tuple[list[Any], list[int]]:
    n = draw(st.integers(2, 14))
    is_model = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    is_model = [m and draw(st.integers(0, 3)) == 0 for m in is_model]
    edges = draw(st.lists(st.tuples(st.integers(0, n - 1), st.integers(0, n - 1)), max_size=3 * n))
    as_tuple = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    nodes: list[Any] = [_Model(n=i) if m else _Node() for i, m in enumerate(is_model)]
    for i, node in enumerate(nodes):
        if isinstance(node, _Node):
            node.out = [nodes[b] for a, b in edges if a == i]
    for i, node in enumerate(nodes):
        if isinstance(node, _Node) and as_tuple[i]:
            node.out = tuple(node.out)
    order = draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=2 * n))
    return nodes, order


def _oracle(start: Any) -> bool:
    seen: set[int] = set()
    todo = [start]
    while todo:
        v = todo.pop()
        if id(v) in seen:
            continue
        seen.add(id(v))
        if isinstance(v, pydantic.BaseModel):
            return True
        todo.extend(v.out)
    return False


@settings(max_examples=400, deadline=None)
@given(_graphs())
def test_the_memo_matches_reachability(graph: tuple[list[Any], list[int]]) -> None:
    """Held: on one ``ModelSight``, queries in any order (scans abandoned at a model met
    again, several strongly connected parts in one cycle) answer exactly as a brute-force
    reachability over the same graph."""
    nodes, order = graph
    sight = ModelSight()
    for i in order:
        assert sight.shows(nodes[i]) == _oracle(nodes[i]), (i, order)
        # the lists themselves: a part of its owner's strongly connected part
        if isinstance(nodes[i], _Node):
            assert sight.shows(nodes[i].out) == any(_oracle(c) for c in nodes[i].out)


def test_a_cut_scan_never_clears_what_it_did_not_finish(monkeypatch: pytest.MonkeyPatch) -> None:
    """Held: a scan cut by ``MOST_LOOKED_AT`` leaves nothing half-looked-at clear."""
    monkeypatch.setattr(model_sight, "MOST_LOOKED_AT", 5)
    a, b = _Node(), _Node()
    a.out = [b, _Node(), _Node(), _Node(), _Node()]
    b.out = [a, _card()]
    sight = ModelSight()
    assert sight.shows(a)
    assert sight.shows(b)


@pytest.mark.xfail(
    strict=True,
    reason="DEFECT LOW: ModelSight._clear (run/model_sight.py) is never re-looked at; an "
    "object cleared, then given a model by a str() side effect, is written as its str",
)
def test_an_object_cleared_then_given_a_model_never_shows_it() -> None:
    """A ``Loader`` whose ``__str__`` fills a ``Lazy`` (met earlier in the same result)
    with a model: the memo answers "clear" for the second ``Lazy``."""

    class Lazy:
        def __init__(self) -> None:
            self.detail: Any = None

        def __str__(self) -> str:
            return f"Lazy({self.detail!r})"

    class Loader:
        def __init__(self, other: Lazy) -> None:
            self.other = other

        def __str__(self) -> str:
            self.other.detail = _card()  # loaded on first print
            return "loader"

    lazy = Lazy()
    assert SECRET not in json.dumps(result_content([lazy, Loader(lazy), lazy]))


# --- leaks ---------------------------------------------------------------------------------


class _Page(list[Any]):
    def __init__(self, items: list[Any], meta: Any) -> None:
        super().__init__(items)
        self.meta = meta

    def __repr__(self) -> str:
        return f"Page({list(self)!r}, meta={self.meta!r})"


async def test_a_list_subclass_argument_never_shows_what_it_masks(tmp_path: Path) -> None:
    def refuse() -> Any:
        raise ValueError("page refused", _Page([1, 2], _card()))

    assert SECRET in str(ValueError("x", _Page([], _card())))
    outcome = await _assert_never_shown(tmp_path, refuse)
    assert outcome.is_error


class _Booking(pydantic.BaseModel):
    card: int


async def test_a_validation_error_never_shows_what_it_masks(tmp_path: Path) -> None:
    def book() -> Any:
        return _Booking(card=_card())  # type: ignore[arg-type]

    outcome = await _assert_never_shown(tmp_path, book)
    assert outcome.is_error


def _future() -> Any:
    loop = asyncio.new_event_loop()
    try:
        done = loop.create_future()
        done.set_result(_card())
        return done
    finally:
        loop.close()


_HELD: list[Any] = []


def _context_var() -> Any:
    card = _card()
    return contextvars.ContextVar("card", default=card)


def _proxy() -> Any:
    card = _card()
    _HELD.append(card)
    return weakref.proxy(card)


@pytest.mark.parametrize(
    "make",
    [
        lambda: itertools.repeat(_card(), 2),
        _future,
        _context_var,
        _proxy,
    ],
    ids=["repeat", "future", "contextvar", "weakproxy"],
)
@pytest.mark.xfail(
    strict=True,
    reason="DEFECT LOW: model_sight._parts sees nothing inside itertools.repeat, "
    "asyncio.Future, ContextVar or weakref.proxy, whose str shows the model",
)
def test_builtins_showing_a_model_never_show_what_it_masks(make: Any) -> None:
    value = make()
    assert SECRET in str(value)
    assert SECRET not in error_text(ValueError(value))


# --- error_text ----------------------------------------------------------------------------


class _ApiError(Exception):
    def __init__(self, resp: Any) -> None:
        self.resp = resp

    def __str__(self) -> str:
        return "API failed: status 500"


@pytest.mark.xfail(
    strict=True,
    reason="DEFECT LOW: result_data._said writes an exception reaching a model as its "
    "args; a custom __str__ that never shows the model loses its message",
)
def test_a_custom_str_error_holding_a_model_keeps_its_message() -> None:
    written = error_text(_ApiError(_card()))
    assert SECRET not in written
    assert "API failed: status 500" in written


class _BulkError(Exception):
    def __init__(self, rows: list[Any], msg: str) -> None:
        super().__init__(rows, msg)

    def __str__(self) -> str:
        return str(self.args[1])


def test_an_over_budget_error_keeps_its_message(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(error_text_module, "MOST_LOOKED_AT_IN_AN_ERROR", 1_000)
    rows = [[i, f"row {i}"] for i in range(1_000)]  # no model anywhere
    written = error_text(_BulkError(rows, "insert failed"))
    assert "holding a pydantic model" not in written, written
    assert "insert failed" in written, written


class _Row:
    def __init__(self, i: int) -> None:
        self.i = i
        self.name = f"row {i}"


class _RowsError(Exception):
    def __init__(self, msg: str, rows: list[_Row]) -> None:
        super().__init__(msg)
        self.rows = rows


async def test_error_text_looks_at_few_objects_on_the_event_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    loop_thread = threading.get_ident()
    on_loop = [0]
    parts = model_sight._parts

    def counted(value: Any, *kind: Any) -> Any:
        if threading.get_ident() == loop_thread:
            on_loop[0] += 1
        return parts(value, *kind)

    monkeypatch.setattr(model_sight, "_parts", counted)

    def fail() -> Any:
        raise _RowsError("insert failed", [_Row(i) for i in range(20_000)])

    outcome, _, _, sent = await _run_on_sqlite(tmp_path, fail)
    assert sent == 1
    assert outcome.is_error and "insert failed" in str(outcome.content)
    # At most MOST_LOOKED_AT_IN_AN_ERROR (100,000 values, each a few hundred ns).
    bound = error_text_module.MOST_LOOKED_AT_IN_AN_ERROR
    assert on_loop[0] <= bound, f"{on_loop[0]} objects looked at on the event loop"


class _NoStr(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no text")


class _Ok(Exception):
    pass


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (lambda: KeyError("user-1"), "KeyError: 'user-1'"),
        (
            lambda: OSError(2, "No such file or directory", "/tmp/x"),
            "FileNotFoundError: [Errno 2] No such file or directory: '/tmp/x'",
        ),
        (lambda: ValueError(), "ValueError: "),
        (
            lambda: ExceptionGroup("two failed", [ValueError("a"), KeyError("b")]),
            "ExceptionGroup: two failed (2 sub-exceptions)",
        ),
        (lambda: _NoStr("x"), "_NoStr: (its text cannot be read)"),
        (lambda: ValueError("refused", _card()), "ValueError: refused, <a Card"),
        (lambda: KeyError(_card()), "KeyError: <a Card"),
        (
            lambda: ExceptionGroup("g", [ValueError("a", _card())]),
            "ExceptionGroup: g, <a list holding",
        ),
    ],
    ids=["keyerror", "oserror", "noargs", "group", "str-raises", "model-arg", "model-key", "eg"],
)
async def test_odd_errors_are_recorded_once_and_keep_their_message(
    tmp_path: Path, make: Any, expected: str
) -> None:
    """Held: each is recorded (completed, an error) once, never sent again, its message
    kept, no secret anywhere."""
    assert error_text(make()).startswith(expected), error_text(make())

    def fail() -> Any:
        raise make()

    outcome = await _assert_never_shown(tmp_path, fail)
    assert outcome.is_error
    assert expected.split(": ", 1)[1].split(" <", 1)[0] in str(outcome.content)


# --- _count_inside -------------------------------------------------------------------------


def _shared(depth: int, width: int = 10) -> list[Any]:
    held: list[Any] = [0] * width
    for _ in range(depth):
        held = [held] * width
    return held


@pydantic.dataclasses.dataclass(slots=True)
class _Slotted:
    rows: list[Any]


@pydantic.dataclasses.dataclass
class _Plain:
    rows: list[Any]


class _Held(pydantic.BaseModel):
    rows: list[Any]


class _Extra(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="allow")


class _Root(pydantic.RootModel[Any]):
    pass


class _Nested(pydantic.BaseModel):
    inside: dict[str, Any]


def _refused(value: Any, budget: int = 1_000) -> bool:
    try:
        result_data._walked(value, result_data._Walk(values=budget))
    except result_data._TooMany:
        return True
    return False


@pytest.mark.parametrize(
    "make",
    [
        lambda rows: _Held(rows=rows),
        lambda rows: _Plain(rows=rows),
        lambda rows: _Extra(rows=rows),
        lambda rows: _Root(rows),
        lambda rows: _Nested(inside={"a": (1, {"b": [rows]})}),
        lambda rows: [_Held(rows=[rows, rows])],
    ],
    ids=["model", "pydantic-dataclass", "extra", "root", "nested", "in-a-list"],
)
def test_what_a_model_holds_is_counted(make: Any) -> None:
    """Held: shared lists (10,000 values) inside each are counted against a budget of
    1,000."""
    assert _refused(make(_shared(3)))
    assert not _refused(make([1, 2, 3]))


def test_a_slotted_pydantic_dataclass_is_counted() -> None:
    assert _refused(_Slotted(rows=_shared(3)))


class _Hit(pydantic.BaseModel):
    id: int
    embedding: list[float] = pydantic.Field(exclude=True)


def test_a_model_with_an_excluded_field_is_not_refused() -> None:
    hits = [_Hit(id=i, embedding=[0.5] * 1536) for i in range(100)]
    written = pydantic.TypeAdapter(list[_Hit]).dump_python(hits, mode="json")
    assert len(written) == 100  # pydantic writes 300 values; a budget of 10,000
    assert not _refused(hits, budget=10_000)


class _Paged(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(arbitrary_types_allowed=True)
    pages: object


@pytest.mark.xfail(
    strict=True,
    reason="DEFECT MEDIUM: result_data._count_inside leaves a model's generators to "
    "pydantic, which reads them past MOST_READ (an endless one for ever)",
)
def test_a_generator_inside_a_model_is_read_at_most_most_read_values() -> None:
    read = [0]

    def pages() -> Any:
        for i in itertools.count():
            read[0] += 1
            if i > MOST_READ + 1_000:
                raise RuntimeError("stopped by the test: an endless generator")
            yield i

    result_content(_Paged(pages=pages()))
    assert read[0] <= MOST_READ + 1


async def test_odd_results_are_recorded_once(tmp_path: Path) -> None:
    """Held: a result holding a model in an excluded field, extra, a root model and a
    plain object reaching a model: sent once, recorded completed, no secret anywhere."""

    class Holder:
        def __init__(self) -> None:
            self.card = _card()

        def __repr__(self) -> str:
            return f"Holder({self.card!r})"

    def make() -> Any:
        return {
            "hits": [_Hit(id=1, embedding=[0.1])],
            "extra": _Extra(card=_card()),  # type: ignore[call-arg]
            "root": _Root([_card()]),
            "holder": Holder(),
        }

    outcome = await _assert_never_shown(tmp_path, make)
    assert not outcome.is_error
