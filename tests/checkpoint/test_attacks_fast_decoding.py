"""Attacks on commit 902064a (payload JSON read by pydantic-core where shallow enough,
subset field checks, the transcript decoder's role table and fast paths, ``Message``
skipping conversions).

The oracle is the code the commit replaced: ``git archive 902064a^`` unpacked under a
temporary directory as the package ``tesserix_adk_old`` (every ``tesserix_adk`` name in it
renamed), imported beside the current one. Every payload must read to the same value as
before (types included: int vs float, -0.0, NaN, key order) or be refused with the same
typed error; the standard library's ``json`` is a second oracle for what a document means.
"""

from __future__ import annotations

import base64
import contextlib
import copy
import dataclasses
import enum
import json
import random
import sys
import threading
import time
import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from archived import archived, canonical
from booking import BOOK_TURNS, Airline, booking_agent
from tesserix_adk import (
    AgentRunner,
    Checkpointer,
    MemoryCheckpointStore,
    MemoryHistoryStore,
    MemoryIdempotencyStore,
    RunStatus,
    ScriptedProvider,
)
from tesserix_adk.checkpoint.payload import (
    CHECKPOINT_FORMAT,
    MAX_NESTING,
    decode_checkpoint,
    decode_message,
    decode_outcome,
    seal,
)
from tesserix_adk.checkpoint.payload.envelope import _loads
from tesserix_adk.errors import CheckpointCorruptError
from tesserix_adk.messages import BinaryPart, Message, Role, TextPart, ToolCall
from tesserix_adk.testing.corruption import (
    DELTAS,
    byte_flips,
    real_frontier,
    real_outcome,
    real_transcript_entry,
    truncations,
)
from tesserix_adk.testing.faults import FaultyCheckpointStore, SimulatedCrash

_REPO = Path(__file__).resolve().parents[2]
_GOLDEN = Path(__file__).parent / "golden"
_BEFORE = "902064a^"
_TYPED = {"CheckpointCorruptError", "CheckpointFormatError", "HistoryUnavailableError"}

_FAST = settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


# --- the oracle: the package as it was before the commit ---------------------------------


@pytest.fixture(scope="module")
def old(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimpleNamespace]:
    """The modules of ``tesserix_adk`` at ``902064a^``, imported as ``tesserix_adk_old``."""
    with archived(_BEFORE, "tesserix_adk_old", tmp_path_factory.mktemp("before_902064a")) as module:
        payload = module("checkpoint.payload")
        yield SimpleNamespace(
            envelope=module("checkpoint.payload.envelope"),
            payload=payload,
            messages=module("messages"),
        )


def _has_nan(canon: Any) -> bool:
    if canon == ("float", "nan"):
        return True
    return isinstance(canon, tuple) and any(_has_nan(c) for c in canon)


def _result(read: Callable[[bytes], Any], data: bytes) -> tuple[str, Any]:
    """What reading ``data`` gives: ``("read", canon)`` or ``("raised", error name)``."""
    try:
        got = read(data)
    except Exception as exc:  # any escape is compared, typed or not
        return ("raised", type(exc).__name__)
    return ("read", canonical(got))


def _same_as_before(
    new: Callable[[bytes], Any], before: Callable[[bytes], Any], data: bytes
) -> Any:
    """Assert ``new`` reads ``data`` as ``before`` did and refuses only with a typed error."""
    got, want = _result(new, data), _result(before, data)
    assert got == want, (data[:200], got, want)
    if got[0] == "raised":
        assert got[1] in _TYPED, (data[:200], got)
    return got


def _json_meaning(data: bytes) -> tuple[str, Any]:
    """What the standard library makes of the bytes, with the kit's nesting limit."""
    try:
        value = json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError):
        return ("raised", "CheckpointCorruptError")
    if not _within(value, MAX_NESTING):
        return ("raised", "CheckpointCorruptError")
    return ("read", canonical(value))


def _within(value: Any, limit: int) -> bool:
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        children = (
            item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        )
        if children is None:
            continue
        if depth + 1 > limit:
            return False
        stack.extend((child, depth + 1) for child in children)
    return True


def _loads_agrees(old: SimpleNamespace, data: bytes) -> None:
    """``_loads`` reads ``data`` as the old ``_loads`` did and as ``json`` does."""
    got = _same_as_before(
        lambda d: _loads(d, "a payload"), lambda d: old.envelope._loads(d, "a payload"), data
    )
    assert got == _json_meaning(data), data[:200]


# --- 1. documents read as json reads them ------------------------------------------------

_EDGES = [
    # numbers
    b'{"a":1e400,"b":-1e400,"c":1e-400,"d":-1e-400}',
    b'{"a":-0,"b":-0.0,"c":0.0,"d":-0e0,"e":0e-0,"f":-0E+0}',
    b'{"a":1.0,"b":1E2,"c":1e+2,"d":100,"e":1.5e-3}',
    b'{"a":9223372036854775807,"b":9223372036854775808,"c":-9223372036854775809}',
    b'{"a":12345678901234567890123456789012345678901234567890}',
    b'{"a":9007199254740993.0,"b":9007199254740993}',
    b'{"a":2.2250738585072011e-308,"b":4.9e-324,"c":2.4703282292062327e-324}',
    b'{"a":2.4703282292062328e-324,"b":1.7976931348623159e308}',
    b'{"a":0.1000000000000000055511151231257827021181583404541015625}',
    b'{"a":1e99999999999999999999,"b":1e-99999999999999999999,"c":0e99999999999999999999}',
    b"[" + b"9" * 4300 + b".0]",
    b"[0." + b"0" * 5000 + b"1]",
    b"[" + b"1" * 300 + b"e-300]",
    b"[01]",
    b"[-01]",
    b"[00]",
    b"[-]",
    b"[1.]",
    b"[.1]",
    b"[+1]",
    b"[1e]",
    b"[1e+]",
    b"[0x1]",
    b"[1_0]",
    b"[--1]",
    b"[1.e5]",
    # NaN and the infinities, and what is almost them
    b'{"a":NaN,"b":Infinity,"c":-Infinity}',
    b"[-NaN]",
    b"[+NaN]",
    b"[+Infinity]",
    b"[nan]",
    b"[inf]",
    b"[Inf]",
    b"[infinity]",
    b"[NAN]",
    b"[Infinityx]",
    b"[NaNx]",
    b"[-Inf]",
    # literals
    b"[true,false,null]",
    b"[True]",
    b"[NULL]",
    b"[nul]",
    b"[tru]",
    b"[truex]",
    b"[nulls]",
    # duplicate keys: the last value wins, in the first key's place
    b'{"a":1,"b":2,"a":3}',
    b'{"a":{"x":1},"a":[1]}',
    b'{"a":1,"a":1.0}',
    b'{"":1,"":2}',
    b'{"\\u0061":1,"a":2,"b":3}',
    # unicode escapes and surrogates
    b'{"a":"\\u00e9\\u00E9\\u0000\\u001f\\u007f\\uFFFF\\uFFFE\\uFEFF"}',
    b'{"a":"\\ud83d\\ude00\\uD83D\\uDE00\\uDBFF\\uDFFF"}',
    b'{"a":"\\ud800"}',
    b'{"a":"\\udfff"}',
    b'{"a":"\\udc00\\ud800"}',
    b'{"a":"\\ud800\\ud800"}',
    b'{"a":"\\ud800x"}',
    b'{"a":"\\ud800\\u0041"}',
    b'{"\\ud800":1}',
    b'{"a":"\\u12"}',
    b'{"a":"\\u00G9"}',
    b'{"a":"\\U00e9"}',
    b'{"a":"\\x41"}',
    b'{"a":"\\\'"}',
    b'{"a":"\\/\\b\\f\\n\\r\\t\\"\\\\"}',
    b'{"a":"\\a"}',
    b'{"a":"\\',
    # raw bytes inside strings: control characters, NUL, invalid UTF-8
    b'{"a":"a\tb"}',
    b'{"a":"a\nb"}',
    b'{"a":"\x00"}',
    b'{"a\x00":1}',
    b'{"a":"\x1f"}',
    b'{"a":"\x7f"}',
    b'{"a":"\xc2\x85\xe2\x80\xa8\xe2\x80\xa9"}',
    b'{"a":"\xff"}',
    b'{"a":"\xc3"}',
    b'{"a":"\xc0\x80"}',
    b'{"a":"\xed\xa0\x80"}',
    b'{"a":"\xed\xb0\x80\xed\xa0\x80"}',
    b'{"a":"\xf4\x90\x80\x80"}',
    b'{"a":"\xf0\x9f\x98"}',
    b'{"a":"\xf0\x9f\x98\x80"}',
    b'{"\xff":1}',
    b'{"a":1}\xff',
    b"\xff",
    # whitespace, byte-order marks, encodings, trailing bytes
    b' \t\r\n{"a":[ 1 , 2 ]}\r\n\t ',
    b'\x0c{"a":1}',
    b'{"a":1}\x0c',
    b'\x0b{"a":1}',
    b'\xc2\xa0{"a":1}',
    b'{"a":\xc2\xa01}',
    b'{"a":1}\xe2\x80\xa8',
    b'\xe3\x80\x80{"a":1}',
    b'\xef\xbb\xbf{"a":1}',
    b' \xef\xbb\xbf{"a":1}',
    b'{"a":1}\xef\xbb\xbf',
    '{"a":1}'.encode("utf-16"),
    '{"a":1}'.encode("utf-16-le"),
    '{"a":1}'.encode("utf-32"),
    b'{"a":1}\x00',
    b'\x00{"a":1}',
    b"\x00",
    b'{"a":1}x',
    b"{}{}",
    b"[] []",
    # not JSON
    b"",
    b" ",
    b"{'a':1}",
    b"{a:1}",
    b'{"a":1,}',
    b"[1,]",
    b"[1,,2]",
    b"[,1]",
    b'{"a":1 "b":2}',
    b'{"a"::1}',
    b'{"a"}',
    b'{"a" 1}',
    b"{1:2}",
    b'{"a":1}/**/',
    b'{"a":1}//',
    b"[1 2]",
    b"[",
    b"]",
    b"{",
    b'{"a":[1}',
    b'{"a":{]}',
    # scalars and arrays at the top
    b"1",
    b'"s"',
    b"null",
    b"true",
    b"[]",
    b"{}",
]


@pytest.mark.parametrize("data", _EDGES, ids=[repr(d[:40]) for d in _EDGES])
def test_edge_documents_read_as_before_and_as_json_reads_them(
    old: SimpleNamespace, data: bytes
) -> None:
    _loads_agrees(old, data)


def _nested(depth: int, inner: bytes = b"1", *, objects: bool = False) -> bytes:
    if objects:
        return b'{"k":' * depth + inner + b"}" * depth
    return b"[" * depth + inner + b"]" * depth


_NEAR_THE_LIMIT = [
    _nested(MAX_NESTING - 1),
    _nested(MAX_NESTING),
    _nested(MAX_NESTING + 1),
    _nested(MAX_NESTING, objects=True),
    _nested(MAX_NESTING + 1, objects=True),
    _nested(MAX_NESTING, b""),
    _nested(MAX_NESTING + 1, b""),
    # 64 brackets, one of them in a string: the fast path, depth 63
    _nested(MAX_NESTING - 1, b'"["'),
    # 65 brackets, one of them in a string: json's path, depth 64 reads
    _nested(MAX_NESTING, b'"["'),
    _nested(MAX_NESTING, b'"{"'),
    # depth 65 hidden behind strings full of closing brackets
    _nested(MAX_NESTING + 1, b'"]]]]]]]"'),
    # shallow, but thousands of brackets in strings
    b'{"a":"' + b"[" * 5000 + b'"}',
    b'{"a":"' + b"{" * 5000 + b"]" * 5000 + b'"}',
    b'{"a":"\\"' + b"[" * 100 + b'"}',
    # 64 sibling arrays: many brackets, no depth
    b"[" + b",".join([b"[]"] * MAX_NESTING) + b"]",
    b"[" + b",".join([b"[]"] * (MAX_NESTING - 1)) + b"]",
    # unpaired: more openings than closings, under and over the count
    b"[" * MAX_NESTING,
    b"[" * (MAX_NESTING + 1),
    b"]" * 200,
    b"[" * 5000 + b"]" * 5000,
    b"[" * 100000,
    # invalid UTF-8 and a lone surrogate deep inside, under and over the count
    _nested(MAX_NESTING - 1, b'"\xff"'),
    _nested(MAX_NESTING + 1, b'"\xff"'),
    _nested(MAX_NESTING, b'"\\ud800"'),
    _nested(MAX_NESTING - 1, b'"\\ud800"'),
]


@pytest.mark.parametrize("data", _NEAR_THE_LIMIT, ids=[repr(d[:20]) for d in _NEAR_THE_LIMIT])
def test_nesting_near_the_limit_reads_as_before(old: SimpleNamespace, data: bytes) -> None:
    _loads_agrees(old, data)


_TOKENS = [
    b"[", b"]", b"{", b"}", b'"', b"\\", b"u", b"d8", b"dc", b"00", b"0", b"1", b"9", b"-",
    b"+", b".", b"e", b"E", b",", b":", b" ", b"\t", b"\n", b"\r", b"\x0c", b"\x00", b"\x1f",
    b"\x7f", b"\xc3\xa9", b"\xff", b"\xc0\x80", b"\xed\xa0\x80", b"\xf0\x9f\x98\x80",
    b"\xf0\x9f", b"true", b"false", b"null", b"NaN", b"Infinity", b"a", b"/", b"b", b"n",
    b"\xef\xbb\xbf", b"\xc2\x85", b"\xe2\x80\xa8", b'"a":', b'{"a":', b'"\\ud83d', b"\\ude00",
]  # fmt: skip


@settings(_FAST, max_examples=1500)
@given(st.lists(st.sampled_from(_TOKENS), max_size=14))
def test_token_soup_reads_as_before_and_as_json_reads_it(
    old: SimpleNamespace, tokens: list[bytes]
) -> None:
    _loads_agrees(old, b"".join(tokens))


_DIGITS = st.text("0123456789", min_size=1, max_size=40) | st.text(
    "0123456789", min_size=4280, max_size=4320
)


@st.composite
def _numbers(draw: st.DrawFn) -> bytes:
    """A JSON number (sometimes thousands of digits long), or a near miss of one."""
    if draw(st.integers(0, 9)) == 0:
        return draw(st.text("0123456789+-.eE", min_size=1, max_size=12)).encode()
    head = draw(st.sampled_from(["0", "1", "9"])) + draw(_DIGITS).lstrip("0")
    if head.startswith("0"):
        head = "0"
    text = draw(st.sampled_from(["", "-"])) + head
    if draw(st.booleans()):
        text += "." + draw(st.text("0123456789", min_size=1, max_size=60))
    if draw(st.booleans()):
        exponent = draw(st.integers(0, 400) | st.integers(0, 10**25))
        text += draw(st.sampled_from("eE")) + draw(st.sampled_from(["", "+", "-"])) + str(exponent)
    return text.encode()


@_FAST
@given(_numbers())
def test_numbers_read_as_before_and_as_json_reads_them(old: SimpleNamespace, number: bytes) -> None:
    _loads_agrees(old, b'{"n":' + number + b',"m":[' + number + b"]}")


_PIECES = [
    "a", "\\\"", "\\\\", "\\/", "\\b", "\\f", "\\n", "\\r", "\\t", "\\u0000", "\\u001f",
    "\\u007f", "\\u00e9", "\\ud83d", "\\ude00", "\\uD83D", "\\uDE00", "\\uDBFF", "\\uDFFF",
    "\\uFFFF", "\\uFEFF", "é", "\U0001f600", "\u2028", "\ufeff", "\x7f", "\x1f", "\t", "[",
    "{", "\\u", "\\x", "\\",
]  # fmt: skip


@_FAST
@given(st.lists(st.sampled_from(_PIECES), max_size=10), st.sampled_from([b"", b"\xff", b"\xed"]))
def test_strings_read_as_before_and_as_json_reads_them(
    old: SimpleNamespace, pieces: list[str], junk: bytes
) -> None:
    text = "".join(pieces).encode("utf-8")
    _loads_agrees(old, b'{"' + text + b'":"' + text + b'","b":"' + junk + text + b'"}')


_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=-(10**4299), max_value=10**4299),
    st.floats(),
    st.text(),
)
_VALUES = st.recursive(
    _SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4)
    ),
    max_leaves=16,
)


@_FAST
@given(
    _VALUES,
    st.booleans(),
    st.sampled_from([None, (",", ":"), (", ", ": ")]),
    st.sampled_from([None, 0, 2, "\t"]),
)
def test_documents_json_wrote_read_back_as_json_reads_them(
    old: SimpleNamespace, value: Any, ascii_only: bool, separators: Any, indent: Any
) -> None:
    text = json.dumps(value, ensure_ascii=ascii_only, separators=separators, indent=indent)
    _loads_agrees(old, text.encode("utf-8", "surrogatepass"))


def test_integers_of_4300_digits_read_and_of_4301_are_refused(old: SimpleNamespace) -> None:
    for sign in (b"", b"-"):
        most = b"[" + sign + b"7" * 4300 + b"]"
        assert _loads(most, "a payload") == [int((sign + b"7" * 4300).decode())]
        _loads_agrees(old, most)
        over = b"[" + sign + b"7" * 4301 + b"]"
        with pytest.raises(CheckpointCorruptError):
            _loads(over, "a payload")
        _loads_agrees(old, over)


@pytest.fixture
def int_digits() -> Iterator[Callable[[int], None]]:
    """Sets ``sys.set_int_max_str_digits`` for the test (as ``PYTHONINTMAXSTRDIGITS`` or
    ``-X int_max_str_digits`` would for a process), restored after."""
    before = sys.get_int_max_str_digits()
    try:
        yield sys.set_int_max_str_digits
    finally:
        sys.set_int_max_str_digits(before)


def test_an_integer_json_refuses_under_a_lowered_digit_limit_is_still_refused(
    old: SimpleNamespace, int_digits: Callable[[int], None]
) -> None:
    int_digits(1000)
    data = b'{"n":' + b"1" * 2000 + b"}"
    with pytest.raises(ValueError):
        json.loads(data)
    before = _result(lambda d: old.envelope._loads(d, "a payload"), data)
    assert before == ("raised", "CheckpointCorruptError")
    assert _result(lambda d: _loads(d, "a payload"), data) == ("raised", "CheckpointCorruptError")


def test_an_integer_json_reads_with_no_digit_limit_still_reads(
    old: SimpleNamespace, int_digits: Callable[[int], None]
) -> None:
    int_digits(0)
    data = b'{"n":' + b"3" * 6000 + b"}"
    assert _loads(data, "a payload") == {"n": int("3" * 6000)}
    _loads_agrees(old, data)


def test_under_a_lowered_digit_limit_integers_within_it_or_past_4300_read_as_before(
    old: SimpleNamespace, int_digits: Callable[[int], None]
) -> None:
    int_digits(1000)
    _loads_agrees(old, b'{"n":' + b"1" * 999 + b"}")
    _loads_agrees(old, b'{"n":' + b"1" * 5000 + b"}")


_HUGE = {
    "digits": b'{"n":' + b"1" * (1 << 20) + b"}",
    "fraction": b'{"n":0.' + b"1" * (1 << 20) + b"}",
    "string": b'{"s":"' + b"x" * (1 << 20) + b'"}',
    "escapes": b'{"s":"' + b"\\u00e9" * (1 << 17) + b'"}',
    "surrogates": b'{"s":"' + b"\\ud83d\\ude00" * (1 << 16) + b'"}',
    "whitespace": b"{" + b" " * (1 << 20) + b"}",
    "brackets": b"[" * (1 << 20),
    "bad utf-8": b'{"s":"' + b"\xff" * (1 << 20) + b'"}',
    "keys": b"{" + b",".join(b'"k%d":%d' % (i, i) for i in range(50000)) + b"}",
}


@pytest.mark.parametrize("name", sorted(_HUGE))
def test_a_megabyte_payload_is_decided_quickly_and_as_before(
    old: SimpleNamespace, name: str
) -> None:
    data = _HUGE[name]
    started = time.perf_counter()
    got = _result(lambda d: _loads(d, "a payload"), data)
    took = time.perf_counter() - started
    assert took < 5.0, (name, took)
    assert got == _result(lambda d: old.envelope._loads(d, "a payload"), data)
    assert got[0] == "read" or got[1] == "CheckpointCorruptError"


def test_payloads_read_in_threads_read_as_json_reads_them() -> None:
    """pydantic-core keeps a process-wide cache of short strings; decoding from several
    threads at once (the checkpointer reads off the event loop) must not mix them up."""
    rng = random.Random(7)
    documents = []
    for _ in range(400):
        body = {f"k{rng.randrange(20000)}": f"v{rng.randrange(10**6)}" for _ in range(6)}
        body["s"] = "x" * rng.randrange(0, 90)
        documents.append((json.dumps(body).encode(), body))
    wrong: list[bytes] = []

    def work(seed: int) -> None:
        pick = random.Random(seed)
        for _ in range(4000):
            data, want = documents[pick.randrange(len(documents))]
            if _loads(data, "a payload") != want:
                wrong.append(data)

    threads = [threading.Thread(target=work, args=(seed,)) for seed in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert wrong == []


def _allows(requirement: str, version: str) -> bool:
    """Whether the project's dependencies let ``requirement`` be installed at ``version``."""
    project = tomllib.loads((_REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    for line in project["dependencies"]:
        wanted = Requirement(line)
        same = canonicalize_name(wanted.name) == canonicalize_name(requirement)
        if same and not wanted.specifier.contains(version, prereleases=True):
            return False
    return True


def test_no_pydantic_the_project_allows_brings_a_from_json_reading_4301_digit_integers() -> None:
    for pydantic, core in (("2.6.0", "2.16.1"), ("2.6.1", "2.16.2"), ("2.6.4", "2.16.3")):
        assert not (_allows("pydantic", pydantic) and _allows("pydantic-core", core)), pydantic


# --- 2. transcript entries decode as the old decoder decoded them ------------------------

_ROLE_NAMES = ["system", "user", "assistant", "tool"]
_NOT_ROLES = ["User", "USER", "user ", " user", "", "Role.user", "user\x00", "usér", "tools"]
_JUNK = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-2, 2),
    st.floats(allow_nan=False),
    st.sampled_from(["", "user", "true", "text", "[]"]),
    st.just([]),
    st.just({}),
    st.just([None]),
    st.just([[]]),
    st.just([{}]),
    st.lists(st.integers(0, 1), max_size=2),
    st.dictionaries(st.sampled_from(["id", "type", "x"]), st.text(max_size=2), max_size=2),
).map(copy.deepcopy)  # a fresh value each draw: entries are changed in place
_PART = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=6)}),
    st.fixed_dictionaries(
        {
            "type": st.just("binary"),
            "media_type": st.sampled_from(["image/png", ""]),
            "data": st.sampled_from(["", "AA==", "aGk=", "!!", "AA", "AA==\n", " AA=="]),
        }
    ),
)
_ARGUMENTS = st.dictionaries(
    st.text(max_size=3), _SCALARS | st.lists(_SCALARS, max_size=2), max_size=3
)
_CALL = st.fixed_dictionaries(
    {"id": st.text(max_size=4), "name": st.text(max_size=4), "arguments": _ARGUMENTS}
)
_ENTRY = st.fixed_dictionaries(
    {
        "role": st.sampled_from(_ROLE_NAMES),
        "content": st.text(max_size=8) | st.lists(_PART, max_size=3),
    },
    optional={
        "tool_calls": st.lists(_CALL, max_size=3),
        "tool_call_id": st.none() | st.text(max_size=4),
        "is_error": st.booleans(),
    },
)


@st.composite
def _entries(draw: st.DrawFn) -> dict[str, Any]:
    """A well-formed entry with up to three things about it made wrong."""
    entry: dict[str, Any] = draw(_ENTRY)
    for _ in range(draw(st.integers(0, 3))):
        how = draw(st.sampled_from(["drop", "add", "role", "calls", "call", "part", "flag"]))
        if how == "drop" and entry:
            entry.pop(draw(st.sampled_from(sorted(entry))))
        elif how == "add":
            key = draw(st.sampled_from(["extra", "format", "checksum", "ROLE", "tool_calls "]))
            entry[key] = draw(_JUNK)
        elif how == "role":
            entry["role"] = draw(st.sampled_from(_NOT_ROLES) | _JUNK)
        elif how == "calls":
            entry["tool_calls"] = draw(_JUNK)
        elif how == "call" and _dicts(entry.get("tool_calls")):
            call = draw(st.sampled_from(_dicts(entry["tool_calls"])))
            key = draw(st.sampled_from(["id", "name", "arguments", "more"]))
            if draw(st.booleans()) and key in call:
                del call[key]
            else:
                call[key] = draw(_JUNK)
        elif how == "part" and _dicts(entry.get("content")):
            part = draw(st.sampled_from(_dicts(entry["content"])))
            key = draw(st.sampled_from(["type", "text", "media_type", "data", "more"]))
            if draw(st.booleans()) and key in part:
                del part[key]
            else:
                part[key] = draw(_JUNK)
        elif how == "flag":
            key = draw(st.sampled_from(["is_error", "tool_call_id", "content"]))
            entry[key] = draw(_JUNK)
    return entry


def _dicts(value: Any) -> list[dict[str, Any]]:
    return [v for v in value if isinstance(v, dict)] if isinstance(value, list) else []


def _payloads(entry: dict[str, Any]) -> list[bytes]:
    """The entry sealed as the kit writes it, and in the shape written before checksums."""
    out = [json.dumps(entry).encode("utf-8", "surrogatepass")]
    with contextlib.suppress(ValueError, TypeError):
        out.append(seal({"format": CHECKPOINT_FORMAT, **entry}))
    return out


@settings(_FAST, max_examples=600)
@given(_entries())
def test_entries_decode_as_the_old_decoder_decoded_them(
    old: SimpleNamespace, entry: dict[str, Any]
) -> None:
    for payload in _payloads(entry):
        _same_as_before(decode_message, old.payload.decode_message, payload)


_MALFORMED: list[dict[str, Any]] = [
    {"role": "user", "content": "hi", "tool_calls": None},
    {"role": "user", "content": "hi", "tool_calls": {}},
    {"role": "user", "content": "hi", "tool_calls": 0},
    {"role": "user", "content": "hi", "tool_calls": False},
    {"role": "user", "content": "hi", "tool_calls": ""},
    {"role": "user", "content": "hi", "tool_calls": "[]"},
    {"role": "user", "content": "hi", "tool_calls": [None]},
    {"role": "user", "content": "hi", "tool_calls": [[]]},
    {"role": "user", "content": "hi", "tool_calls": [{}]},
    {"role": "user", "content": "hi", "tool_calls": [{"id": "a", "name": "b"}]},
    {"role": "user", "content": "hi", "tool_calls": [{"id": 1, "name": "b", "arguments": {}}]},
    {"role": "user", "content": "hi", "tool_calls": [{"id": "a", "name": None, "arguments": {}}]},
    {"role": "user", "content": "hi", "tool_calls": [{"id": "a", "name": "b", "arguments": None}]},
    {"role": "user", "content": "hi", "tool_calls": [{"id": "a", "name": "b", "arguments": []}]},
    {
        "role": "user",
        "content": "hi",
        "tool_calls": [{"id": "a", "name": "b", "arguments": {}, "x": 1}],
    },
    {"role": "user", "content": "hi", "is_error": 0},
    {"role": "user", "content": "hi", "is_error": 1},
    {"role": "user", "content": "hi", "is_error": None},
    {"role": "user", "content": "hi", "is_error": "true"},
    {"role": "user", "content": "hi", "is_error": 0.0},
    {"role": "user", "content": "hi", "tool_call_id": 0},
    {"role": "user", "content": "hi", "tool_call_id": False},
    {"role": "user", "content": "hi", "tool_call_id": []},
    {"role": "User", "content": "hi"},
    {"role": "USER", "content": "hi"},
    {"role": "user ", "content": "hi"},
    {"role": "", "content": "hi"},
    {"role": "Role.user", "content": "hi"},
    {"role": "user\u0000", "content": "hi"},
    {"role": None, "content": "hi"},
    {"role": 0, "content": "hi"},
    {"role": ["user"], "content": "hi"},
    {"role": {"user": 1}, "content": "hi"},
    {"role": "user", "content": None},
    {"role": "user", "content": 0},
    {"role": "user", "content": {}},
    {"role": "user", "content": [None]},
    {"role": "user", "content": ["hi"]},
    {"role": "user", "content": [{}]},
    {"role": "user", "content": [{"type": "text"}]},
    {"role": "user", "content": [{"type": "text", "text": None}]},
    {"role": "user", "content": [{"type": "text", "text": "a", "x": 1}]},
    {"role": "user", "content": [{"type": "TEXT", "text": "a"}]},
    {"role": "user", "content": [{"type": 1, "text": "a"}]},
    {"role": "user", "content": [{"type": "binary", "media_type": "a", "data": "!!"}]},
    {"role": "user", "content": [{"type": "binary", "media_type": "a", "data": "AA"}]},
    {"role": "user", "content": [{"type": "binary", "data": "AA=="}]},
    {"role": "user", "content": [{"type": "binary", "media_type": 1, "data": "AA=="}]},
    {"role": "user", "content": [{"type": "image", "data": "AA=="}]},
    {"role": "user", "content": "hi", "extra": 1},
    {"role": "user", "content": "hi", "Role": "user"},
    {"role": "user"},
    {"content": "hi"},
    {},
]


@pytest.mark.parametrize("entry", _MALFORMED, ids=[json.dumps(e)[:60] for e in _MALFORMED])
@pytest.mark.parametrize("sealed", [True, False], ids=["sealed", "legacy"])
def test_a_malformed_entry_is_corrupt_as_before(
    old: SimpleNamespace, entry: dict[str, Any], sealed: bool
) -> None:
    payload = seal({"format": CHECKPOINT_FORMAT, **entry}) if sealed else json.dumps(entry).encode()
    with pytest.raises(CheckpointCorruptError):
        decode_message(payload)
    assert _result(old.payload.decode_message, payload) == ("raised", "CheckpointCorruptError")


def test_a_legacy_entry_carrying_a_format_or_a_checksum_key_is_corrupt(
    old: SimpleNamespace,
) -> None:
    for payload in (
        b'{"role":"user","content":"hi","format":2}',
        b'{"role":"user","content":"hi","format":1}',
        b'{"role":"user","content":"hi","checksum":"sha256:' + b"0" * 64 + b'"}',
        b'{"format":2,"role":"user","content":"hi","checksum":"sha256:' + b"0" * 64 + b'"}',
    ):
        with pytest.raises(CheckpointCorruptError):
            decode_message(payload)
        _same_as_before(decode_message, old.payload.decode_message, payload)


def _user_message(entry: dict[str, Any], parts: Callable[..., Any] = list) -> Message:
    """The message a well-formed entry stands for, built as a user would (lists)."""
    content = entry["content"]
    if not isinstance(content, str):
        content = parts(
            TextPart(text=p["text"])
            if p["type"] == "text"
            else BinaryPart(data=base64.b64decode(p["data"]), media_type=p["media_type"])
            for p in content
        )
    calls = [
        ToolCall(id=c["id"], name=c["name"], arguments=c["arguments"])
        for c in entry.get("tool_calls", [])
    ]
    return Message(
        entry["role"],
        content,
        calls,
        tool_call_id=entry.get("tool_call_id"),
        is_error=entry.get("is_error", False),
    )


_WELL_FORMED_PART = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=6)}),
    st.fixed_dictionaries(
        {
            "type": st.just("binary"),
            "media_type": st.text(max_size=4),
            "data": st.binary(max_size=5).map(lambda b: base64.b64encode(b).decode()),
        }
    ),
)
_WELL_FORMED = st.fixed_dictionaries(
    {
        "role": st.sampled_from(_ROLE_NAMES),
        "content": st.text(max_size=8) | st.lists(_WELL_FORMED_PART, max_size=3),
    },
    optional={
        "tool_calls": st.lists(_CALL, max_size=2),
        "tool_call_id": st.none() | st.text(max_size=4),
        "is_error": st.booleans(),
    },
)


@_FAST
@given(_WELL_FORMED)
def test_a_well_formed_entry_decodes_to_a_normalised_message_equal_to_a_user_built_one(
    old: SimpleNamespace, entry: dict[str, Any]
) -> None:
    for payload in _payloads(entry):
        got = decode_message(payload)
        assert type(got.role) is Role
        assert type(got.content) is str or (
            type(got.content) is tuple
            and all(type(p) in (TextPart, BinaryPart) for p in got.content)
        )
        assert type(got.tool_calls) is tuple
        assert all(type(c) is ToolCall and type(c.arguments) is dict for c in got.tool_calls)
        if not _has_nan(canonical(got)):  # a NaN argument is equal only by _canon
            assert got == _user_message(entry)
        assert canonical(got) == canonical(_user_message(entry))
        before = old.payload.decode_message(payload)
        assert canonical(got) == canonical(before)
        with pytest.raises(dataclasses.FrozenInstanceError):
            got.content = "changed"  # type: ignore[misc]


# --- 3. messages built by users normalise as before --------------------------------------


class _OtherRole(enum.StrEnum):
    user = "user"
    tool = "tool"


class _RoleText(str):
    pass


_USER_ROLES = st.sampled_from(
    [*Role, *_ROLE_NAMES, _OtherRole.user, _OtherRole.tool, _RoleText("assistant")]
)
_USER_PARTS = st.lists(
    st.builds(TextPart, text=st.text(max_size=4))
    | st.builds(BinaryPart, data=st.binary(max_size=3), media_type=st.just("x/y")),
    max_size=3,
)
_USER_CALLS = st.lists(
    st.builds(
        ToolCall,
        id=st.text(max_size=3),
        name=st.text(max_size=3),
        arguments=st.just({}) | st.dictionaries(st.text(max_size=2), st.integers(), max_size=2),
    ),
    max_size=2,
)
_SHAPES: dict[str, Callable[[list[Any]], Any]] = {
    "list": list,
    "tuple": tuple,
    "generator": lambda xs: (x for x in xs),
    "iterator": iter,
    "map": lambda xs: map(lambda x: x, xs),
}


@settings(_FAST, max_examples=400)
@given(
    _USER_ROLES,
    st.text(max_size=5) | _USER_PARTS,
    st.sampled_from(sorted(_SHAPES)),
    _USER_CALLS,
    st.sampled_from(sorted(_SHAPES)),
    st.none() | st.text(max_size=3),
    st.booleans(),
)
def test_a_user_built_message_normalises_as_before(
    old: SimpleNamespace,
    role: Any,
    content: Any,
    content_shape: str,
    calls: list[ToolCall],
    calls_shape: str,
    call_id: str | None,
    is_error: bool,
) -> None:
    def build(cls: Any) -> Any:
        body = content if isinstance(content, str) else _SHAPES[content_shape](content)
        return cls(role, body, _SHAPES[calls_shape](calls), tool_call_id=call_id, is_error=is_error)

    got, before = build(Message), build(old.messages.Message)
    assert type(got.role) is Role and got.role.value == before.role.value
    assert type(got.content) is (str if isinstance(content, str) else tuple)
    assert type(got.tool_calls) is tuple
    assert canonical(got) == canonical(before)
    same = Message(
        Role(str(role)),
        content if isinstance(content, str) else tuple(content),
        tuple(calls),
        call_id,
        is_error,
    )
    assert got == same
    try:
        want_hash: Any = hash(before)
    except TypeError:
        want_hash = TypeError
    try:
        got_hash: Any = hash(got)
    except TypeError:
        got_hash = TypeError
    assert got_hash == want_hash
    if got_hash is not TypeError:
        assert hash(got) == hash(same)
    for name in ("role", "content", "tool_calls", "tool_call_id", "is_error"):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(got, name, getattr(got, name))


def test_a_message_built_of_final_types_keeps_them_and_stays_frozen() -> None:
    parts = (TextPart(text="a"),)
    calls = (ToolCall(id="c", name="n"),)
    message = Message(Role.assistant, parts, calls)
    assert message.content is parts and message.tool_calls is calls
    assert message == Message("assistant", [TextPart(text="a")], [ToolCall(id="c", name="n")])
    with pytest.raises(dataclasses.FrozenInstanceError):
        message.role = Role.user  # type: ignore[misc]
    replaced = dataclasses.replace(message, role="user", content=[TextPart(text="b")])
    assert type(replaced.role) is Role and type(replaced.content) is tuple


@pytest.mark.parametrize("role", ["User", "", "Role.user", None, 0])
def test_a_message_with_no_role_is_refused_as_before(old: SimpleNamespace, role: Any) -> None:
    with pytest.raises(ValueError):
        Message(role, "hi")
    with pytest.raises(ValueError):
        old.messages.Message(role, "hi")


class _Parts(tuple):  # type: ignore[type-arg]
    """A tuple subclass a caller might pass as content (a named or typed sequence of parts),
    here one whose equality is loose, as a subclass may define it."""

    __slots__ = ()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, tuple)

    __hash__ = tuple.__hash__


def test_a_tuple_subclass_as_content_becomes_a_plain_tuple_as_before(old: SimpleNamespace) -> None:
    a, b = TextPart(text="a"), TextPart(text="b")
    assert type(old.messages.Message(Role.user, _Parts((a,))).content) is tuple
    message = Message(Role.user, _Parts((a,)))
    assert message != Message(Role.user, (b,))
    assert type(message.content) is tuple


# --- 4. damaged payloads end to end ------------------------------------------------------


def _damaged(payload: bytes) -> Iterator[bytes]:
    for _, bad in byte_flips(payload, deltas=DELTAS):
        yield bad
    yield from truncations(payload)
    yield payload + b" "
    yield b" " + payload


def _legacy_entry() -> bytes:
    call = {"id": "call_1_0", "name": "book_seat", "arguments": {"flight": "LH123", "n": 2}}
    return json.dumps(
        {
            "role": "assistant",
            "content": [{"type": "text", "text": "Booking."}],
            "tool_calls": [call],
        }
    ).encode()


_SEALED: dict[str, Callable[[], bytes]] = {
    "entry": real_transcript_entry,
    "outcome": real_outcome,
    "frontier": lambda: real_frontier(history=True),
    "inline frontier": lambda: real_frontier(history=False),
    "golden format 2 frontier": lambda: (_GOLDEN / "format2_frontier.json").read_bytes(),
    "golden format 2 tombstone": lambda: (_GOLDEN / "format2_tombstone.json").read_bytes(),
}
_UNSEALED: dict[str, Callable[[], bytes]] = {
    "legacy entry": _legacy_entry,
    "legacy outcome": lambda: (
        b'{"content":{"booking":"B1","n":-0.0,"big":123456789012345678901},"is_error":false}'
    ),
    "golden format 1 frontier": lambda: (_GOLDEN / "format1_frontier.json").read_bytes(),
    "golden format 1 tombstone": lambda: (_GOLDEN / "format1_tombstone.json").read_bytes(),
}


def _readers(
    old: SimpleNamespace, name: str
) -> tuple[Callable[[bytes], Any], Callable[[bytes], Any]]:
    if "entry" in name:
        return decode_message, old.payload.decode_message
    if "outcome" in name:
        return (lambda p: decode_outcome(p, "c"), lambda p: old.payload.decode_outcome(p, "c"))
    run_id = "run_1" if "golden" in name else "run-1"
    return (
        lambda p: decode_checkpoint(p, tenant="acme", run_id=run_id),
        lambda p: old.payload.decode_checkpoint(p, tenant="acme", run_id=run_id),
    )


@pytest.mark.parametrize("name", sorted(_SEALED))
def test_every_damaged_sealed_payload_is_refused_as_before(old: SimpleNamespace, name: str) -> None:
    payload = _SEALED[name]()
    new, before = _readers(old, name)
    assert _result(new, payload) == _result(before, payload)
    assert _result(new, payload)[0] == "read"
    for bad in _damaged(payload):
        got = _same_as_before(new, before, bad)
        assert got == ("raised", "CheckpointCorruptError"), bad[:120]


@pytest.mark.parametrize("name", sorted(_UNSEALED))
def test_every_damaged_unsealed_payload_reads_as_before(old: SimpleNamespace, name: str) -> None:
    """Without a checksum a changed byte reaches the parser and the field checks, so this
    is where pydantic-core and the subset checks meet damage: each read must be the old
    decoder's, value for value, or its typed refusal."""
    payload = _UNSEALED[name]()
    new, before = _readers(old, name)
    assert _result(new, payload)[0] == "read"
    refused = 0
    for bad in _damaged(payload):
        refused += _same_as_before(new, before, bad)[0] == "raised"
    assert refused > len(payload)


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(value, dict):
        for key, child in value.items():
            out += _paths(child, (*prefix, key))
    elif isinstance(value, list):
        for i, child in enumerate(value):
            out += _paths(child, (*prefix, i))
    return out


_FIELD_JUNK = _JUNK | st.sampled_from(["acme", "run_1", "running", "after_model_call", 2, 1, -1])


@settings(_FAST, max_examples=300)
@given(st.sampled_from(["format2_frontier", "format2_tombstone", "format1_frontier"]), st.data())
def test_a_resealed_frontier_with_a_field_changed_decodes_as_before(
    old: SimpleNamespace, name: str, data: st.DataObject
) -> None:
    """The subset checks of ``_fields`` decide every frontier, tombstone and nested record:
    keys added, dropped, renamed or retyped anywhere read as the old checks read them."""
    body = json.loads((_GOLDEN / f"{name}.json").read_bytes())
    body.pop("checksum", None)
    for _ in range(data.draw(st.integers(1, 3))):
        path = data.draw(st.sampled_from([p for p in _paths(body) if p]))
        parent = body
        for step in path[:-1]:
            parent = parent[step]
        how = data.draw(st.sampled_from(["set", "drop", "add", "rename"]))
        if how == "set" or isinstance(parent, list):
            parent[path[-1]] = data.draw(_FIELD_JUNK)
        elif how == "drop":
            del parent[path[-1]]
        elif how == "add":
            parent[
                data.draw(st.sampled_from(["extra", "note", "redacted", "fence", "messages"]))
            ] = data.draw(_FIELD_JUNK)
        else:
            parent[path[-1].upper()] = parent.pop(path[-1])
    payloads = [json.dumps(body, separators=(",", ":")).encode()]
    with contextlib.suppress(ValueError, TypeError):
        payloads.append(seal(body))
    for payload in payloads:
        _same_as_before(
            lambda p: decode_checkpoint(p, tenant="acme", run_id="run_1"),
            lambda p: old.payload.decode_checkpoint(p, tenant="acme", run_id="run_1"),
            payload,
        )


# --- resume ------------------------------------------------------------------------------


async def _crashed_after_booking() -> tuple[Airline, Any]:
    """A run that booked and recorded the outcome, then died before its next frontier."""
    airline = Airline()
    stores = (MemoryCheckpointStore(), MemoryHistoryStore(), MemoryIdempotencyStore())
    faulty = FaultyCheckpointStore(
        stores[0],
        crash_before=lambda b: b["boundary"] == "after_tool_result" and b["iteration"] == 1,
    )
    runner = AgentRunner(
        ScriptedProvider(BOOK_TURNS),
        idempotency=stores[2],
        checkpoints=Checkpointer(faulty, history=stores[1]),
    )
    with pytest.raises(SimulatedCrash):
        await runner.run(booking_agent(airline), "book", tenant="acme", run_id="r")
    assert airline.bookings == ["LH123"]
    return airline, stores


async def _resume(stores: Any, airline: Airline) -> Any:
    store, history, idempotency = stores
    runner = AgentRunner(
        ScriptedProvider(BOOK_TURNS),
        idempotency=idempotency,
        checkpoints=Checkpointer(store, history=history),
    )
    return await runner.resume(booking_agent(airline), "r", tenant="acme")


async def test_resume_refuses_every_damaged_entry_outcome_and_frontier() -> None:
    airline, stores = await _crashed_after_booking()
    # Undamaged, the resume replays the recorded booking and completes without a second one.
    intact = copy.deepcopy(stores)
    twin = Airline(bookings=list(airline.bookings))
    run = await _resume(intact, twin)
    assert run.status is RunStatus.completed and twin.bookings == ["LH123"]

    store, history, idempotency = stores
    (key,) = [k for k, r in idempotency._records.items() if r.tool == "book_seat"]
    transcript = history._runs[("acme", "r")]
    frontier = store._runs[("acme", "r")].frontier
    assert frontier is not None
    # The entries the frontier names (one appended after it, before the crash, is not read).
    handle = decode_checkpoint(frontier.payload, tenant="acme", run_id="r").history_handle
    assert handle is not None
    named = handle.count
    assert named >= 4

    def with_outcome(world: Any, bad: bytes) -> None:
        records = world[2]._records
        records[key] = dataclasses.replace(records[key], outcome=bad)

    def with_entry(i: int) -> Callable[[Any, bytes], None]:
        def change(world: Any, bad: bytes) -> None:
            world[1]._runs[("acme", "r")].items[i] = bad

        return change

    def with_frontier(world: Any, bad: bytes) -> None:
        run = world[0]._runs[("acme", "r")]
        run.frontier = dataclasses.replace(run.frontier, payload=bad)

    targets: list[tuple[str, bytes, Callable[[Any, bytes], None], tuple[int, ...]]] = [
        ("outcome", idempotency._records[key].outcome, with_outcome, DELTAS),
        ("frontier", frontier.payload, with_frontier, (0x01,)),
    ]
    targets += [(f"entry {i}", transcript.items[i], with_entry(i), (0x01,)) for i in range(named)]
    wrong: list[str] = []
    for what, payload, change, deltas in targets:
        damaged = [bad for _, bad in byte_flips(payload, deltas=deltas)]
        damaged += list(truncations(payload))[::7]
        for bad in damaged:
            world = copy.deepcopy(stores)
            change(world, bad)
            twin = Airline(bookings=list(airline.bookings))
            try:
                got = await _resume(world, twin)
            except CheckpointCorruptError:
                got = None
            except Exception as exc:
                got = exc
            if got is not None or twin.bookings != ["LH123"]:
                wrong.append(f"{what}: {bad[:60]!r}... gave {got!r}, bookings {twin.bookings}")
    assert wrong == [], "\n".join(wrong[:20])
