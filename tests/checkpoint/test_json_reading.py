"""Reading payload JSON fast without reading it differently.

Payloads (frontiers, transcript entries, outcomes) are parsed by pydantic-core where they
are shallow enough, by ``json`` otherwise or where pydantic-core refuses. Two oracles: the
standard library's ``json`` for what a document means, and the transcript entry's shape
written out here for which entries are well formed.
"""

from __future__ import annotations

import base64
import json
import math
import sys
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tesserix_adk.checkpoint.payload.envelope import CHECKPOINT_FORMAT, MAX_NESTING, _loads, seal
from tesserix_adk.checkpoint.payload.transcript import decode_message, decode_messages
from tesserix_adk.errors import CheckpointCorruptError
from tesserix_adk.messages import BinaryPart, Message, TextPart, ToolCall
from tesserix_adk.stores.protocols import EMPTY_HISTORY_DIGEST, chain_digest, chained
from tesserix_adk.testing.corruption import byte_flips

_SETTINGS = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])

_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(),
)
_values = st.recursive(
    _scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=20,
)


def _depth(value: Any) -> int:
    if isinstance(value, list):
        return 1 + max(map(_depth, value), default=0)
    if isinstance(value, dict):
        return 1 + max(map(_depth, value.values()), default=0)
    return 0


def _reference(data: bytes) -> Any:
    """What ``json`` makes of the bytes (``CheckpointCorruptError`` where it cannot, or
    where it nests deeper than the kit reads)."""
    try:
        value = json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError) as exc:
        raise CheckpointCorruptError(str(exc)) from exc
    if _depth(value) > MAX_NESTING:
        raise CheckpointCorruptError("too deep")
    return value


def _same(a: Any, b: Any) -> bool:
    """Equal, NaN equal to NaN, and of the same types all the way down (1 is not 1.0,
    -0.0 is not 0.0)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return (math.isnan(a) and math.isnan(b)) or (
            a == b and math.copysign(1, a) == math.copysign(1, b)
        )
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    return bool(a == b)


def _agree(data: bytes) -> None:
    try:
        want = _reference(data)
    except CheckpointCorruptError:
        with pytest.raises(CheckpointCorruptError):
            _loads(data, "a payload")
        return
    got = _loads(data, "a payload")
    assert _same(got, want), (data, got, want)


@_SETTINGS
@given(_values, st.booleans())
def test_a_document_json_wrote_reads_as_json_reads_it(value: Any, ascii_only: bool) -> None:
    try:
        data = json.dumps(value, ensure_ascii=ascii_only).encode("utf-8")
    except UnicodeEncodeError:
        return  # a lone surrogate: no payload holds one (the kit refuses to write it)
    _agree(data)


@_SETTINGS
@given(_values, st.data())
def test_a_damaged_document_reads_as_json_reads_it_or_is_corrupt(
    value: Any, data: st.DataObject
) -> None:
    raw = bytearray(
        json.dumps(value, ensure_ascii=data.draw(st.booleans())).encode("utf-8", "surrogatepass")
    )
    for _ in range(data.draw(st.integers(1, 3))):
        at = data.draw(st.integers(0, len(raw)))
        how = data.draw(st.sampled_from(["flip", "insert", "delete"]))
        if how == "insert" or not raw:
            raw[at:at] = bytes([data.draw(st.integers(0, 255))])
        elif how == "delete":
            del raw[min(at, len(raw) - 1)]
        else:
            raw[min(at, len(raw) - 1)] ^= data.draw(st.integers(1, 255))
    _agree(bytes(raw))


@pytest.mark.parametrize(
    "data",
    [
        b'{"a":"\\ud800"}',  # a lone surrogate json reads and pydantic-core refuses
        b'\xef\xbb\xbf{"a":1}',  # a byte-order mark
        b'{"a":1e999,"b":-0.0,"c":12345678901234567890123}',
        b'{"a":1,"a":2}',
        b'{"a":NaN,"b":-Infinity}',
        b'{"a":"\\u0000"}',
        b"[" * 64 + b"]" * 64,
        b"[" * 65 + b"]" * 65,
        b'{"a":"\xff"}',
        b'  {"a":[]}  ',
    ],
)
def test_edges_read_as_json_reads_them(data: bytes) -> None:
    _agree(data)


# --- transcript entries against their shape -------------------------------------------

_ROLES = ["system", "user", "assistant", "tool"]
_part = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=5)}),
    st.fixed_dictionaries(
        {
            "type": st.just("binary"),
            "media_type": st.text(max_size=5),
            "data": st.binary(max_size=6).map(lambda b: base64.b64encode(b).decode()),
        }
    ),
)
_call = st.fixed_dictionaries(
    {
        "id": st.text(max_size=4),
        "name": st.text(max_size=4),
        # No NaN: a message holding one is not equal to itself, which says nothing here.
        "arguments": st.dictionaries(
            st.text(max_size=3), _scalars.filter(lambda v: v == v), max_size=3
        ),
    }
)
_well_formed = st.fixed_dictionaries(
    {
        "role": st.sampled_from(_ROLES),
        "content": st.one_of(st.text(max_size=8), st.lists(_part, max_size=3)),
    },
    optional={
        "tool_calls": st.lists(_call, max_size=3),
        "tool_call_id": st.one_of(st.none(), st.text(max_size=4)),
        "is_error": st.booleans(),
    },
)
_junk = st.one_of(_values, st.sampled_from(["user", "tool", "nobody", ""]))


@st.composite
def _entries(draw: st.DrawFn) -> dict[str, Any]:
    """A well-formed entry, then perhaps one thing about it made wrong."""
    entry: dict[str, Any] = draw(_well_formed)
    how = draw(st.sampled_from(["none", "drop", "add", "replace", "deep"]))
    if how == "drop":
        entry.pop(draw(st.sampled_from(sorted(entry))))
    elif how == "add":
        entry[draw(st.sampled_from(["extra", "tool_calls", "is_error", "tool_call_id"]))] = draw(
            _junk
        )
    elif how == "replace":
        entry[draw(st.sampled_from(sorted(entry)))] = draw(_junk)
    elif how == "deep" and entry.get("tool_calls"):
        call = draw(st.sampled_from(entry["tool_calls"]))
        key = draw(st.sampled_from(["id", "name", "arguments", "more"]))
        if draw(st.booleans()) and key in call:
            del call[key]
        else:
            call[key] = draw(_junk)
    elif how == "deep" and isinstance(entry["content"], list) and entry["content"]:
        part = draw(st.sampled_from(entry["content"]))
        part[draw(st.sampled_from(["type", "text", "media_type", "data", "more"]))] = draw(_junk)
    return entry


def _oracle(entry: dict[str, Any]) -> Message | None:
    """The message a well-formed entry is; ``None`` for any other."""
    allowed = {"role", "content", "tool_calls", "tool_call_id", "is_error"}
    if not {"role", "content"} <= entry.keys() <= allowed or entry["role"] not in _ROLES:
        return None
    content = entry["content"]
    parts: list[Any] = []
    if isinstance(content, list):
        for p in content:
            if not isinstance(p, dict):
                return None
            if (
                p.get("type") == "text"
                and p.keys() == {"type", "text"}
                and isinstance(p["text"], str)
            ):
                parts.append(TextPart(text=p["text"]))
            elif (
                p.get("type") == "binary"
                and p.keys() == {"type", "media_type", "data"}
                and isinstance(p["media_type"], str)
                and isinstance(p["data"], str)
            ):
                try:
                    raw = base64.b64decode(p["data"], validate=True)
                except ValueError:
                    return None
                parts.append(BinaryPart(data=raw, media_type=p["media_type"]))
            else:
                return None
    elif not isinstance(content, str):
        return None
    calls = entry.get("tool_calls", [])
    if not isinstance(calls, list):
        return None
    made: list[ToolCall] = []
    for c in calls:
        if not (
            isinstance(c, dict)
            and c.keys() == {"id", "name", "arguments"}
            and isinstance(c["id"], str)
            and isinstance(c["name"], str)
            and isinstance(c["arguments"], dict)
        ):
            return None
        made.append(ToolCall(id=c["id"], name=c["name"], arguments=c["arguments"]))
    call_id = entry.get("tool_call_id")
    is_error = entry.get("is_error", False)
    if not (call_id is None or isinstance(call_id, str)) or not isinstance(is_error, bool):
        return None
    return Message(
        entry["role"],
        content if isinstance(content, str) else parts,
        made,
        tool_call_id=call_id,
        is_error=is_error,
    )


@_SETTINGS
@given(_entries())
def test_an_entry_decodes_exactly_when_it_has_the_shape_of_a_message(entry: dict[str, Any]) -> None:
    payload = seal({"format": CHECKPOINT_FORMAT, **entry})
    want = _oracle(entry)
    if want is None:
        with pytest.raises(CheckpointCorruptError):
            decode_message(payload)
        return
    got = decode_message(payload)
    assert got == want
    assert type(got.role) is type(want.role) and type(got.tool_calls) is tuple


# --- a transcript read in one pass -------------------------------------------------------


def _one_by_one(entries: list[bytes]) -> list[Message] | tuple[type[Exception], str]:
    """The oracle for ``decode_messages``: ``decode_message`` entry by entry, or the error
    of the first entry it refuses."""
    try:
        return [decode_message(e) for e in entries]
    except Exception as exc:
        return type(exc), str(exc)


def _in_one_pass(entries: list[bytes]) -> list[Message] | tuple[type[Exception], str]:
    try:
        return decode_messages(entries)
    except Exception as exc:
        return type(exc), str(exc)


@st.composite
def _stored(draw: st.DrawFn) -> bytes:
    """An entry as a store might hand it back: sealed as the kit writes it, or with its
    format changed, unsealed (as before checksums), one byte changed, or cut short."""
    entry = draw(_entries())
    how = draw(st.sampled_from(["sealed", "format", "unsealed", "flip", "cut"]))
    if how == "format":
        fmt = draw(st.one_of(st.sampled_from([1, 3, True, 2.0, "2", None]), _junk))
        return seal({"format": fmt, **entry})
    if how == "unsealed":
        return json.dumps(entry).encode()
    payload = seal({"format": CHECKPOINT_FORMAT, **entry})
    if how == "flip":
        flips = list(byte_flips(payload, deltas=(draw(st.sampled_from([0x01, 0x20, 0x80])),)))
        return draw(st.sampled_from(flips))[1]
    if how == "cut":
        return payload[: draw(st.integers(0, len(payload) - 1))]
    return payload


@_SETTINGS
@given(st.lists(_stored(), max_size=6))
def test_a_transcript_read_in_one_pass_reads_as_entry_by_entry(entries: list[bytes]) -> None:
    want = _one_by_one(entries)
    got = _in_one_pass(entries)
    assert got == want
    if isinstance(got, list):
        assert all(type(m.role) is type(w.role) for m, w in zip(got, want, strict=True))
        assert all(type(m.tool_calls) is tuple for m in got)


@_SETTINGS
@given(_entries())
def test_an_entry_read_in_one_pass_decodes_exactly_when_it_has_the_shape_of_a_message(
    entry: dict[str, Any],
) -> None:
    payload = seal({"format": CHECKPOINT_FORMAT, **entry})
    want = _oracle(entry)
    if want is None:
        with pytest.raises(CheckpointCorruptError):
            decode_messages([payload])
        return
    assert decode_messages([payload]) == [want]


def test_a_transcript_read_in_one_pass_reads_json_under_a_lowered_digit_limit() -> None:
    """pydantic-core reads 4,300 digits whatever the interpreter allows (see ``_loads``)."""
    payload = seal({"format": CHECKPOINT_FORMAT, "role": "user", "content": "x", "n": 1})
    big = seal(
        {
            "format": CHECKPOINT_FORMAT,
            "role": "tool",
            "content": "x",
            "tool_calls": [{"id": "c", "name": "t", "arguments": {"n": int("9" * 700)}}],
        }
    )
    limit = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(640)
    try:
        assert _in_one_pass([payload]) == _one_by_one([payload])
        got = _in_one_pass([big])
        assert got == _one_by_one([big])
        assert isinstance(got, tuple) and got[0] is CheckpointCorruptError
    finally:
        sys.set_int_max_str_digits(limit)


@_SETTINGS
@given(st.lists(st.binary(max_size=40), max_size=8), st.sampled_from([EMPTY_HISTORY_DIGEST, "x"]))
def test_a_digest_chained_in_one_pass_is_the_chain_of_each(items: list[bytes], start: str) -> None:
    want = start
    for item in items:
        want = chain_digest(want, item)
    assert chained(start, items) == want
