"""Attacks on b2f4e90: the free-text redactor's ``('x-api-key', '…')`` pair rule
(``checkpoint/redaction/free_text.py`` ``_KEY_WORD``) and the conversion of a long result
list in pieces (``run/invoking.py`` ``_in_pieces``).

Pairs: a tool's result or error text holding a header pair in the shapes Python and JSON
write it (single and double quotes, ``b''`` prefixes, ``dict_items``, ``OrderedDict``,
``Headers``, multidict reprs, mixed-case names, spaces and tabs) is run through a real
``AgentRunner`` on SQLite, and every byte of the database is searched for the secret;
then the shapes the rule misses (a line break inside the pair, as ``pprint`` writes a long
one; the same pair as data or as JSON text; a pair JSON-escaped inside a string; a
``bytearray`` value), the scan's cost on crafted text (as a ratio against plain text of the
same size, at two sizes, inside one run), and what the rule masks that is ordinary text
(an approval-gated call whose argument has the pair's shape).

Pieces: a hypothesis property against the old one-call conversion as oracle (pieces of 3
items, so small data crosses them) over nested lists, tuples, dicts with keys that are not
text, sets, bytes (UTF-8 or not), huge ints, floats, datetimes, dataclasses and objects
pydantic cannot write; a cycle through a long list; a list subclass; a long list of
unknown objects holding secrets (stored masked?); and the lease (``SHORT_LEASE``) while a
result of 1.5 million items that is not one flat list is converted (each such run in a
fresh interpreter: after the hypothesis examples, in-process runs kept the lease by chance).

Held: every pair shape above on one line is masked in the store; the scan stays linear on
crafted text (``'token', `` runs, long key runs, escaped quotes); ``_in_pieces`` agrees with
the one-call conversion on every generated value, on cycles and list subclasses; secrets
in a long list's items (beyond the first piece, under a key and in an object's text) are
stored masked; an approval-gated call whose argument ``('token', 'expires')`` is masked is
answered "not sent" with a reason that says its arguments were redacted.

Found, and fixed (their tests pass now; what each was):
- HIGH ``test_a_header_pair_pprint_wraps_is_masked``: ``pprint`` writes a pair whose value
  is long as ``('x-api-key',\\n  '…')``; ``_KEY_WORD`` allows only spaces and tabs around the
  comma, so the secret is stored raw (also ``('authorization',\\n  'Token '\\n  '…')``).
- MEDIUM ``test_a_header_pair_as_data_or_json_text_is_masked``: the same pair a tool returns
  as data (``list(resp.headers.items())``, ``resp.headers.raw``) or as JSON text
  (``[["x-api-key", "…"]]``) is stored raw: the data walker and the JSON-text walker mask by
  a mapping's key only; the pair rule is free text's alone (``redactor.py``).
- MEDIUM ``test_a_header_pair_json_escaped_in_text_is_masked``: ``[[\\"x-api-key\\", \\"…\\"]]``
  (JSON text quoted again inside an error message or a JSON log line) is stored raw: the
  comma branch of ``_KEY_WORD`` wants a bare quote after the comma, not ``\\"``.
- LOW ``test_a_header_pair_with_a_bytearray_value_is_masked``: ``('x-api-key',
  bytearray(b'…'))``: the comma branch's look-ahead takes ``b``/``r``/``u`` prefixes but not
  ``bytearray(``, which ``_STRING_PREFIX`` (and the ``:`` form) accepts.
- MEDIUM ``test_a_result_of_1_5_million_items_not_one_flat_list_keeps_the_lease``: only a
  list or tuple longer than 10,000 at depth < 3 is cut (``run/invoking._in_pieces``); a list
  of pages (1,500 lists of 1,000 rows), a dict of 1.5 million keys, or a long list four
  levels down is converted in one pydantic-core call holding the GIL for seconds, and the
  run under ``SHORT_LEASE`` ends ``LeaseLostError`` (README: "tens of millions of items …
  does not hold up lease renewals").

The fixes: the comma branch reads line breaks, an escaped quote and ``bytearray(`` after the
comma, and a value written as literals that continue it is masked whole (``free_text``);
the data walker and the JSON-text walker mask the second of a two-item list whose first
names a credential (``redactor._pair_kind``, ``_json_text``); ``_in_pieces`` cuts by the
number of items held however they nest (``_items``, ``_batches``). The lease test expected
``Run RunStatus.completed``; a ``RunStatus`` prints as ``completed``.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import datetime
import functools
import json
import pprint
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic_core import to_jsonable_python

from operator_cli import cli
from tesserix_adk import (
    Agent,
    AgentRunner,
    Run,
    RunStatus,
    ScriptedProvider,
    open_stores,
    tool,
)
from tesserix_adk.checkpoint.payload import MAX_NESTING
from tesserix_adk.checkpoint.redaction.redactor import default_redactor
from tesserix_adk.messages import int_as_text
from tesserix_adk.run import result_data
from tesserix_adk.run.model_sight import ModelSight
from tesserix_adk.run.result_data import result_content

T = "pairs"
SECRET = "Zq8vLm3xNp7TkW2rYb5cHd9f"  # no pattern knows it: only its key says it is one
LONG = SECRET * 3  # long enough that pprint wraps the pair holding it


def _stored(tmp_path: Path) -> bytes:
    return b"".join(p.read_bytes() for p in sorted(tmp_path.glob("adk.sqlite3*")))


def _stored_after(tmp_path: Path, value: Any, *, raises: bool = False) -> bytes:
    """Every byte of the SQLite store after a run whose read-only tool returned ``value``
    (or raised ``RuntimeError(value)``)."""
    url = f"sqlite:///{tmp_path / 'adk.sqlite3'}"

    @tool(side_effects=False)
    def peek(what: str) -> Any:
        """Look at the upstream reply."""
        if raises:
            raise RuntimeError(value)
        return value

    async def go() -> Run:
        async with open_stores(url) as stores:
            await stores.create_schema()
            runner = AgentRunner.from_stores(
                ScriptedProvider([[("peek", {"what": "x"})], "ok"]), stores
            )
            return await runner.run(Agent("a", "x", [peek]), "go", tenant=T, run_id="r1")

    run = asyncio.run(go())
    assert run.status is RunStatus.completed, run
    return _stored(tmp_path)


def _leaks(blob: bytes, *needles: str) -> list[str]:
    return [n for n in needles if n.encode() in blob]


# --- pairs on one line: what the rule masks ----------------------------------------------


class _MultiDictRepr:
    """An aiohttp-style multidict's repr, as an HTTP client's error text holds it."""

    def __repr__(self) -> str:
        return f"<CIMultiDictProxy('Content-Type': 'application/json', 'X-Api-Key': '{SECRET}')>"


ONE_LINE_PAIRS = {
    "single": f"[('x-api-key', '{SECRET}')]",
    "double": f'[("x-api-key", "{SECRET}")]',
    "bytes": f"[(b'x-api-key', b'{SECRET}')]",
    "mixed-case": f"[('X-Api-Key', '{SECRET}')]",
    "spaces": f"[('x-api-key' ,   '{SECRET}')]",
    "tab": f"[('x-api-key',\t'{SECRET}')]",
    "raw-bytes": f"[('x-api-key', rb'{SECRET}')]",
    "dict-items": repr({"x-api-key": SECRET}.items()),
    "ordered-dict": repr(collections.OrderedDict([("x-api-key", SECRET)])),
    "httpx-headers": repr(httpx.Headers([("x-api-key", SECRET), ("x-api-key", SECRET)])),
    "multidict": repr(_MultiDictRepr()),
    "authorization": f"[('Authorization', 'Token {SECRET}')]",
    "json-in-prose": "upstream said " + json.dumps([["x-api-key", SECRET]]),
}


@pytest.mark.parametrize("shape", sorted(ONE_LINE_PAIRS))
def test_a_header_pair_on_one_line_is_masked_by_the_redactor(shape: str) -> None:
    masked = default_redactor().text(f"request failed, headers={ONE_LINE_PAIRS[shape]}")
    assert SECRET not in masked, masked
    assert "[redacted:" in masked, masked


@pytest.mark.parametrize("raises", [False, True], ids=["result", "error"])
def test_header_pairs_on_one_line_never_reach_the_store(raises: bool, tmp_path: Path) -> None:
    text = " | ".join(ONE_LINE_PAIRS[s] for s in sorted(ONE_LINE_PAIRS))
    blob = _stored_after(tmp_path, text, raises=raises)
    assert not _leaks(blob, SECRET)


# --- pairs the rule misses ---------------------------------------------------------------


@pytest.mark.parametrize("name", ["x-api-key", "authorization"])
def test_a_header_pair_pprint_wraps_is_masked(name: str, tmp_path: Path) -> None:
    value = LONG if name == "x-api-key" else f"Token {LONG}"
    headers = [("content-type", "application/json"), (name, value), ("accept", "*/*")]
    text = pprint.pformat({"status": 401, "headers": headers})
    assert "',\n" in text  # pprint did wrap the pair
    blob = _stored_after(tmp_path, text, raises=True)
    assert not _leaks(blob, SECRET)


@pytest.mark.parametrize("form", ["items", "raw-bytes", "json-text"])
def test_a_header_pair_as_data_or_json_text_is_masked(form: str, tmp_path: Path) -> None:
    headers = httpx.Headers([("accept", "*/*"), ("x-api-key", SECRET)])
    value: Any = {
        "items": list(headers.items()),
        "raw-bytes": list(headers.raw),
        "json-text": json.dumps([list(p) for p in headers.items()]),
    }[form]
    # The same pair written as text (a repr) is masked: only the form differs.
    assert SECRET not in default_redactor().text(repr(list(headers.items())))
    blob = _stored_after(tmp_path, value)
    assert not _leaks(blob, SECRET)


def test_a_header_pair_json_escaped_in_text_is_masked(tmp_path: Path) -> None:
    body = json.dumps([["x-api-key", SECRET]])
    text = f"upstream returned {json.dumps(body)}"  # a JSON body quoted in an error
    blob = _stored_after(tmp_path, text, raises=True)
    assert not _leaks(blob, SECRET)


def test_a_header_pair_with_a_bytearray_value_is_masked(tmp_path: Path) -> None:
    # The ':' form of the same value is masked: only the pair form misses it.
    assert SECRET not in default_redactor().text(f"{{'x-api-key': bytearray(b'{SECRET}')}}")
    text = repr([("x-api-key", bytearray(SECRET.encode()))])
    blob = _stored_after(tmp_path, text, raises=True)
    assert not _leaks(blob, SECRET)


# --- the scan's cost ---------------------------------------------------------------------


def _best(text: str) -> float:
    times = []
    for _ in range(3):
        redactor = default_redactor()  # a fresh one: a redactor scans a text once (memo)
        started = time.perf_counter()
        redactor.text(text)
        times.append(time.perf_counter() - started)
    return min(times)


CRAFTED = {
    "quoted-token-commas": "'token', ",
    "quoted-token-commas-tight": "'token','",
    "bytes-prefix-commas": '"token", b',
    "long-key-runs": "a" * 120 + "_api_key', '",
    "escaped-quotes": '\\"token\\", \\"',
    "spaces-after-comma": "'password'," + " " * 16,
}


# Timed against the machine's load: in the ADK_SLOW=1 run; benchmarks/redaction.py prints
# the same shapes' rates beside ordinary text in every `make bench`.
@pytest.mark.slow
@pytest.mark.parametrize("shape", sorted(CRAFTED))
def test_the_pair_scan_stays_linear_on_crafted_text(shape: str) -> None:
    unit = CRAFTED[shape]
    ratios = []
    for size in (10_000, 40_000):
        plain = ("lorem ipsum dolor sit amet " * (size // 27 + 1))[:size]
        crafted = (unit * (size // len(unit) + 1))[:size]
        ratios.append(_best(crafted) / _best(plain))
    # Linear: the crafted text costs a constant multiple of plain text at both sizes; a
    # quadratic scan's multiple would grow about fourfold from the first size to the next.
    assert ratios[1] < ratios[0] * 2.5 + 2, ratios


# --- ordinary text the rule masks --------------------------------------------------------


def test_an_approved_call_whose_argument_looks_like_a_pair_is_refused_clearly(
    tmp_path: Path,
) -> None:
    url = f"sqlite:///{tmp_path / 'adk.sqlite3'}"
    query = "SELECT ('token', 'expires_at') FROM sessions"
    sent: list[str] = []
    told: list[str] = []

    @tool(requires_approval=True)
    def run_sql(sql: str) -> str:
        """Run a statement (needs a person)."""
        sent.append(sql)
        return "1 row"

    agent = Agent("db", "x", [run_sql])

    class Listening(ScriptedProvider):
        async def complete(self, request: Any) -> Any:
            told.extend(m.text for m in request.messages if m.tool_call_id is not None)
            return await super().complete(request)

    provider = Listening([[("run_sql", {"sql": query})], "ok"])

    async def go(resume: bool) -> Run:
        async with open_stores(url) as stores:
            await stores.create_schema()
            runner = AgentRunner.from_stores(provider, stores)
            if resume:
                return await runner.resume(agent, "r1", tenant=T)
            return await runner.run(agent, "go", tenant=T, run_id="r1")

    run = asyncio.run(go(False))
    assert run.status is RunStatus.waiting_approval and run.pending_approval is not None
    code, _, err = cli(
        "approve", run.pending_approval.id, "--tenant", T, "--by", "al", "--store", url
    )
    assert code == 0, err
    assert asyncio.run(go(True)).status is RunStatus.completed
    # README: the pair rule masks ordinary text of this shape too, and a masked call is
    # never sent: what matters is that the model and the operator are told so plainly.
    assert sent == []
    [answer] = told
    assert answer.startswith("not sent"), answer
    assert "redact" in answer or "mask" in answer or "secret" in answer, answer


# --- _in_pieces against the one-call conversion -------------------------------------------


def _one_call(result: Any) -> Any:
    """``result_content`` as it would be without the pieces: one ``to_jsonable_python``
    call, and where that fails a plain container value by value, as ``_converted`` does
    (a value nothing can write loses only itself)."""
    prepared = result_data._walked(result, result_data._Walk())
    content = _whole_or_each(prepared, set(), ModelSight())
    if isinstance(content, int) and not isinstance(content, bool):
        return int_as_text(content)
    return content


def _whole_or_each(value: Any, path: set[int], sight: ModelSight) -> Any:
    try:
        return to_jsonable_python(value, fallback=functools.partial(result_data._unknown, sight))
    except Exception:
        pass
    kind = type(value)
    if kind not in (list, tuple, dict) or id(value) in path or len(path) >= MAX_NESTING:
        return result_data._written_otherwise(value, sight)
    path.add(id(value))
    try:
        if kind is dict:
            return {
                result_data._written_key(k): _whole_or_each(v, path, sight)
                for k, v in value.items()
            }
        return [_whole_or_each(v, path, sight) for v in value]
    finally:
        path.discard(id(value))


def _canon(content: Any) -> Any:
    """JSON data in a form to compare (NaN equal to NaN, an int past the digit limit too,
    types kept: ``1`` is not ``1.0``). Not its pickle: pickle writes a string met twice
    once, so two equal values that share objects differently would differ."""
    if isinstance(content, dict):
        return ("dict", [(_canon(k), _canon(v)) for k, v in content.items()])
    if isinstance(content, list | tuple):
        return (type(content).__name__, [_canon(v) for v in content])
    if isinstance(content, float) and content != content:
        return ("float", "nan")
    if isinstance(content, int) and not isinstance(content, bool):
        return ("int", hex(content))
    return (type(content).__name__, content)


@dataclasses.dataclass
class Row:
    id: int
    tag: bytes
    at: datetime.datetime


class Opaque:
    def __init__(self, n: int) -> None:
        self.n = n

    def __str__(self) -> str:
        return f"opaque-{self.n}"


_KEYS = st.one_of(
    st.text(max_size=4),
    st.integers(-3, 3),
    st.floats(allow_nan=False, width=32),
    st.booleans(),
    st.none(),
    st.binary(max_size=3),
    st.tuples(st.integers(0, 2), st.integers(0, 2)),
    st.datetimes(min_value=datetime.datetime(2000, 1, 1), max_value=datetime.datetime(2001, 1, 1)),
)
_LEAVES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(0, 3).map(lambda n: 7**6000 + n),  # past Python's digit limit for text
    st.floats(),
    st.text(max_size=5),
    st.binary(max_size=4),  # UTF-8 or not
    st.datetimes(),
    st.builds(Row, st.integers(0, 9), st.binary(max_size=3), st.datetimes()),
    st.builds(Opaque, st.integers(0, 9)),
    st.frozensets(st.integers(0, 5), max_size=3),
)
_VALUES = st.recursive(
    _LEAVES,
    lambda inner: st.one_of(
        st.lists(inner, max_size=8),
        st.lists(inner, max_size=8).map(tuple),
        st.dictionaries(_KEYS, inner, max_size=5),
        st.sets(st.integers(0, 9), max_size=4),
    ),
    max_leaves=30,
)


@settings(max_examples=250, deadline=None, suppress_health_check=list(HealthCheck))
@given(_VALUES)
def test_in_pieces_agrees_with_the_one_call_conversion(value: Any) -> None:
    before = result_data._PIECE
    result_data._PIECE = 3  # pieces of three: small data crosses them
    try:
        got = result_content(value)
    finally:
        result_data._PIECE = before
    assert _canon(got) == _canon(_one_call(value))


def test_cycles_and_list_subclasses_agree_with_the_one_call_conversion(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(result_data, "_PIECE", 3)
    looped: list[Any] = [1, 2, 3, 4, 5, 6, 7]
    looped.append(looped)
    holder: dict[str, Any] = {"rows": [Opaque(1)] * 7}
    holder["rows"].append(holder)
    deep: dict[str, Any] = {"a": {"b": {"c": [1] * 7}}}
    deep["a"]["b"]["up"] = deep

    class Rows(list):  # type: ignore[type-arg]
        pass

    for value in (looped, holder, deep, Rows([Opaque(i) for i in range(8)]), (looped,) * 5):
        assert _canon(result_content(value)) == _canon(_one_call(value))


class Holder:
    """An object pydantic cannot write whose text holds a credential."""

    def __str__(self) -> str:
        return f"token={SECRET}"


def test_secrets_past_the_first_piece_are_stored_masked(tmp_path: Path) -> None:
    rows: list[Any] = [{"n": i} for i in range(25_000)]
    rows[15_000] = {"password": SECRET}
    rows[24_999] = Holder()
    rows[12_345] = f"[('x-api-key', '{SECRET}')]"
    blob = _stored_after(tmp_path, {"page": {"rows": rows}})
    assert not _leaks(blob, SECRET)
    assert b"[redacted:password]" in blob


# --- the lease while a result that is not one flat list is converted ----------------------

# Each run in a fresh interpreter: what ran before in this one (hypothesis's examples) must
# not change how long a conversion holds the GIL.
_UNDER_SHORT_LEASE = """
import asyncio, sys
from hostile_results import run_under_short_lease
ROW = (7, "seat", 1.5, 8, "aisle", 2.5)  # a row of six: its conversion is well over the ttl
shape = sys.argv[1]
if shape == "pages":
    value = [[ROW] * 1_000] * 1_500  # pages of rows: no list over 10,000
elif shape == "huge-dict":
    value = dict.fromkeys([f"k{i}" for i in range(1_500_000)], 1.5)
else:
    value = {"a": {"b": {"c": {"d": [ROW] * 1_500_000}}}}
ran = asyncio.run(run_under_short_lease(value))
print(type(ran).__name__, getattr(ran, "status", None))
"""


# A 0.5 s lease against other processes' load: in the ADK_SLOW=1 run (README, Testing);
# tests/run/test_result_content.py checks the pieces themselves in every run.
@pytest.mark.slow
@pytest.mark.parametrize("shape", ["pages", "huge-dict", "four-levels-down"])
def test_a_result_of_1_5_million_items_not_one_flat_list_keeps_the_lease(shape: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _UNDER_SHORT_LEASE, shape],
        cwd=Path(__file__).parent,
        capture_output=True,
        text=True,
        timeout=90,  # subprocess.run kills the child on timeout
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    said = done.stdout.strip()
    assert "LeaseLostError" not in said, said
    assert said == "Run completed", said
