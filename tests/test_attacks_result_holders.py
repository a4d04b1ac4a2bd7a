"""What a tool returns, as the JSON data its outcome holds, attacked after 9749d42
(``run/result_data``: ``_object_unclashed`` walks a dataclass or a model in pydantic's Python
mode so a clashing dict inside keeps every value; deques and iterators read as lists; keys
pydantic cannot write go through ``_key_name``), end to end through ``AgentRunner`` on SQLite
(the file's raw bytes), through a replay stub (``run/invoking._stub_result``), and by calling
``result_content`` directly.

Attacked: what pydantic's JSON mode masks or renames (``SecretStr``, ``Field(exclude=True)``,
``field_serializer``/``PlainSerializer``/``model_serializer`` with ``when_used="json"``,
computed fields, serialization aliases, JSON settings) when the walk's copy is used (a clash,
a generator or ``httpx.Headers`` inside); clashes in models in dicts in dataclasses, typed
``dict`` fields, ``RootModel``, ``slots=True`` dataclasses, NamedTuples, dict subclasses,
mapping proxies, enum keys, keys taken by a renamed ``"(int) 1"``, bytes and huge-int keys;
results with nothing clashing against ``to_jsonable_python(value, fallback=str)``; cycles
through a dataclass; an iterator raising midway; a large generator; a file object; how much a
single pydantic-core call is handed for a large dataclass.

Found:

* HIGH ``test_a_json_only_mask_holds_in_the_sqlite_file``,
  ``test_a_json_only_mask_holds_beside_what_makes_the_walk_used``,
  ``test_a_stubs_json_only_mask_holds_in_the_sqlite_file``: a model's JSON-only serializer
  (a card number masked by ``field_serializer(when_used="json")``, ``PlainSerializer`` or a
  wrap ``model_serializer``) is skipped by the Python-mode walk, whose copy is used whenever
  the model holds a clash, a generator or a ``Headers``: the value is stored raw in SQLite.
* HIGH ``test_a_credential_named_serialization_alias_stays_masked_beside_a_clash``: the walk
  (``_PLAIN.to_python``) does not write serialization aliases, where ``to_jsonable_python``
  does: a field ``pw`` aliased ``db_password`` is written ``pw``, not masked, stored raw.
* MEDIUM ``test_an_iterator_that_raises_midway_loses_no_page_it_yielded``: a generator that
  raises midway is recorded completed as ``[]``, the pages it yielded lost.
* MEDIUM ``test_a_large_dataclass_result_is_converted_in_pieces``: a dataclass of many rows
  goes whole into one pydantic-core call (``_in_pieces`` counts it as one item; older than
  9749d42), and now whole into ``_PLAIN.to_python`` too: no pieces for the lease renewals.
* LOW ``test_a_clash_beside_a_set_of_frozen_dataclasses_keeps_every_value``: a set of (or a
  dict keyed by) frozen dataclasses makes the Python-mode walk fail, and the whole object is
  left to pydantic: a clashing dict beside it loses a value.
* LOW ``test_a_clash_leaves_a_models_json_settings_alone``: a model's ``ser_json_timedelta``
  is dropped when the walk is used (``3.0`` alone, ``"PT3S"`` beside a clash).

Fixed (all of the above): a pydantic model is no longer walked: it is written as it writes
itself for JSON, its masks, aliases and settings kept; a plain dataclass is walked as the dict
of its fields pydantic writes (so a large one is cut into pieces too, and a set of frozen
ones is walked item by item); an iterator that raises keeps what it yielded and says how it
stopped (``run/result_data._unclashed``, ``_read_once``, ``_plain_dataclass``).

Left (strict xfails, MEDIUM): a clashing dict inside a pydantic model loses a value again,
as before 9749d42 (``test_no_value_is_lost_in_any_holder``'s five model cases): keeping it
would mean writing the model otherwise than it writes itself, which is what leaked.

Held: ``SecretStr`` and excluded fields stay hidden beside a clash (and in SQLite); computed
fields are written; credential-named fields of a model stay masked in SQLite; every holder
listed above but models keeps every value; results with nothing clashing are written exactly
as ``to_jsonable_python(value, fallback=str)`` writes them (dataclasses and models of
datetimes, decimals, UUIDs, enums, sets, tuples, bytes, aliases, timedeltas); a cycle through
a dataclass is written and keeps its clash; a 40,000-item generator inside a dataclass is kept
whole; a file object is written as its lines; a replay stub's clashing dataclass keeps every
value; a large plain list is converted in pieces.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
import decimal
import enum
import io
import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, NamedTuple

import httpx
import pytest
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PlainSerializer,
    RootModel,
    SecretStr,
    computed_field,
    field_serializer,
    model_serializer,
)
from pydantic_core import to_jsonable_python

from operator_cli import sqlite_bytes
from tesserix_adk import Agent, AgentRunner, RunStatus, ScriptedProvider, tool
from tesserix_adk.checkpoint.payload import decode_outcome
from tesserix_adk.run import result_data
from tesserix_adk.run.result_data import result_content
from tesserix_adk.stores.protocols import RecordStatus
from tesserix_adk.stores.urls import open_stores

T = "holders"
CARD = "4111-1111-7731-0042"  # what a tool's own JSON serializer masks; no key name says so
SECRET = "hunter77-plain-zq8w"  # a SecretStr's value / an excluded field's value


def clash() -> dict[Any, str]:
    return {1: "v-int-9k", "1": "v-str-9k"}


# --- set-up ------------------------------------------------------------------------------


class Recording:
    def __init__(self, turns: list[Any]) -> None:
        self.inner = ScriptedProvider(turns)
        self.requests: list[Any] = []

    async def complete(self, request: Any) -> Any:
        self.requests.append(request)
        return await self.inner.complete(request)

    def told(self) -> str:
        last = self.requests[-1]
        return "".join(m.text for m in last.messages if m.tool_call_id is not None)


async def run_on_sqlite(tmp_path: Path, make: Any) -> tuple[Any, Any, bytes, str]:
    """One run whose one keyed call returns ``make()``: the run, the record's content, the
    SQLite file's bytes and what the model was told."""

    @tool(key=lambda **kw: "fetch-1")
    def fetch(what: str) -> Any:
        """Fetch a thing (a side effect, keyed)."""
        return make()

    provider = Recording([[("fetch", {"what": "x"})], "ok"])
    async with open_stores(f"sqlite:///{tmp_path / 'adk.sqlite3'}") as stores:
        await stores.create_schema()
        runner = AgentRunner.from_stores(provider, stores)
        run = await runner.run(Agent("a", "x", [fetch]), "go", tenant=T, run_id="r")
        [rec] = list(await stores.idempotency.records(T, "r"))
        assert rec.status is RecordStatus.completed
        content = decode_outcome(rec.outcome, "c").content
    return run, content, sqlite_bytes(tmp_path), provider.told()


# --- secrets: what pydantic's JSON mode masks ------------------------------------------


class JsonMasked(BaseModel):
    """A record whose card number the tool's author masks for JSON (``when_used="json"``)."""

    model_config = ConfigDict(arbitrary_types_allowed=True)
    card_number: str
    extra: Any = None

    @field_serializer("card_number", when_used="json")
    def _mask(self, v: str) -> str:
        return "****" + v[-4:]


class JsonMaskedAnnotated(BaseModel):
    model_config = ConfigDict(arbitrary_types_allowed=True)
    card_number: Annotated[str, PlainSerializer(lambda v: "****" + v[-4:], when_used="json")]
    extra: Any = None


class JsonModelSerializer(BaseModel):
    model_config = ConfigDict(arbitrary_types_allowed=True)
    card_number: str
    extra: Any = None

    @model_serializer(mode="wrap", when_used="json")
    def _ser(self, handler: Any) -> Any:
        out = handler(self)
        out["card_number"] = "****" + self.card_number[-4:]
        return out


def _gen() -> Iterator[dict[str, int]]:
    yield {"page": 1}


TRIGGERS = {
    "clash": clash,
    "generator": _gen,  # nothing clashes: a generator alone makes the walk's copy used
    "headers": lambda: httpx.Headers({"accept": "json"}),  # nothing clashes either
}
MASKERS = [JsonMasked, JsonMaskedAnnotated, JsonModelSerializer]


def _masked(cls: type[BaseModel], trigger: str) -> BaseModel:
    return cls(card_number=CARD, extra=TRIGGERS[trigger]())


@pytest.mark.parametrize("cls", MASKERS, ids=lambda c: c.__name__)
def test_a_json_only_mask_holds_with_nothing_beside_it(cls: type[BaseModel]) -> None:
    out = json.dumps(result_content(cls(card_number=CARD, extra=[1])))
    assert CARD not in out and "****0042" in out


@pytest.mark.parametrize("trigger", list(TRIGGERS))
@pytest.mark.parametrize("cls", MASKERS, ids=lambda c: c.__name__)
def test_a_json_only_mask_holds_beside_what_makes_the_walk_used(
    cls: type[BaseModel], trigger: str
) -> None:
    out = json.dumps(result_content(_masked(cls, trigger)))
    assert CARD not in out


@pytest.mark.parametrize("trigger", ["clash", "generator"])
async def test_a_json_only_mask_holds_in_the_sqlite_file(tmp_path: Path, trigger: str) -> None:
    run, content, stored, told = await run_on_sqlite(tmp_path, lambda: _masked(JsonMasked, trigger))
    assert run.status is RunStatus.completed
    assert CARD.encode() not in stored
    assert CARD not in json.dumps(content) and CARD not in told


class Account(BaseModel):
    """Secrets pydantic writes masked or not at all in both modes."""

    user: str
    api: SecretStr
    internal: str = Field(default="", exclude=True)
    rows: dict[Any, Any] = {}
    renamed: str = Field(default="r", serialization_alias="Renamed")

    @computed_field  # type: ignore[prop-decorator]
    @property
    def shown(self) -> str:
        return "shown-" + self.user


@pytest.mark.parametrize("rows", [{}, clash()], ids=["plain", "clash"])
def test_secretstr_and_excluded_fields_stay_hidden_in_the_walk(rows: dict[Any, str]) -> None:
    m = Account(user="u", api=SecretStr(SECRET), internal=SECRET + "-x", rows=rows)
    out = result_content(m)
    text = json.dumps(out)
    assert SECRET not in text
    assert out["shown"] == "shown-u" and "internal" not in out


async def test_secretstr_and_excluded_fields_beside_a_clash_in_the_sqlite_file(
    tmp_path: Path,
) -> None:
    @dataclasses.dataclass
    class Envelope:
        account: Account
        tags: Any

    def make() -> Any:
        m = Account(user="u", api=SecretStr(SECRET), internal=SECRET + "-x", rows=clash())
        return Envelope(account=m, tags=collections.deque([clash()]))

    run, content, stored, told = await run_on_sqlite(tmp_path, make)
    assert run.status is RunStatus.completed
    assert SECRET.encode() not in stored and SECRET not in told
    # The deque's clash keeps both values; the model's is the model's to write (left below).
    assert json.dumps(content["tags"]).count("v-int-9k") == 1
    assert b"v-int-9k" in stored and "v-int-9k" in told


# --- values lost -------------------------------------------------------------------------


class Inner(BaseModel):
    rows: dict[Any, Any]


@dataclasses.dataclass
class Outer:
    m: dict[str, Any]


@dataclasses.dataclass(slots=True)
class Slotted:
    rows: Any


class Pair(NamedTuple):
    rows: Any
    n: int


class MyDict(dict):  # type: ignore[type-arg]
    pass


class Root(RootModel[dict[Any, Any]]):
    pass


class Typed(BaseModel):
    ints: dict[int, str]
    anys: dict[Any, str]


class Colour(enum.Enum):
    one = "1"


class Num(enum.IntEnum):
    two = 2


class Anything(BaseModel):
    model_config = ConfigDict(arbitrary_types_allowed=True)
    x: Any


@dataclasses.dataclass(frozen=True)
class Frozen:
    x: Any


def _holders() -> dict[str, tuple[Any, list[str]]]:
    c = clash()
    vals = list(c.values())
    return {
        "model-in-dict-in-dataclass": (Outer(m={"k": Inner(rows=clash())}), vals),
        "slots-dataclass": (Slotted(clash()), vals),
        "namedtuple": (Pair(clash(), 3), vals),
        "dict-subclass": (MyDict(clash()), vals),
        "rootmodel": (Root(clash()), vals),
        "typed-model-fields": (
            Typed(ints={1: "ti-1"}, anys={1: "ta-int", "1": "ta-str"}),
            ["ti-1", "ta-int", "ta-str"],
        ),
        "enum-keys": ({Colour.one: "e-enum", "1": "e-str", Num.two: "e-int", "2": "e-2"}, []),
        "renamed-taken": ({1: "r-int", "1": "r-str", "(int) 1": "r-renamed"}, []),
        "dataclass-in-model-in-list": (Anything(x=[Frozen(x=clash())]), vals),
        "deque-in-dataclass": (Frozen(x=collections.deque([clash(), clash()])), vals),
        "generator-in-model": (Anything(x=(d for d in [clash()])), vals),
        "mappingproxy-in-dataclass": (Frozen(x=__import__("types").MappingProxyType(c)), vals),
        "bytes-keys": (Frozen(x={b"\xff": "b-raw", "/w==": "b-b64", b"k": "b-k", "k": "b-kk"}), []),
        "huge-int-key": (Frozen(x={10**5000: "h-int", "x": "h-x"}), []),
    }


# A pydantic model writes itself for JSON (serializers that mask, aliases, its settings);
# 9749d42 walked it in Python mode to keep a clash's values and stored masked values raw.
_MODEL_WRITES_ITSELF = pytest.mark.xfail(
    strict=True,
    reason="DEFECT MEDIUM (left): a dict whose keys JSON writes alike inside a pydantic model "
    "loses a value: the model is written as it writes itself (run/result_data._unclashed "
    "does not walk it, so its JSON-only masks hold)",
)
_IN_A_MODEL = {
    "model-in-dict-in-dataclass",
    "rootmodel",
    "typed-model-fields",
    "dataclass-in-model-in-list",
    "generator-in-model",
}


@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=_MODEL_WRITES_ITSELF) if n in _IN_A_MODEL else n for n in _holders()],
)
def test_no_value_is_lost_in_any_holder(name: str) -> None:
    value, expected = _holders()[name]
    if not expected:
        expected = [v for v in _leaves(value) if isinstance(v, str)]
    text = json.dumps(result_content(value))
    for v in expected:
        assert text.count(json.dumps(v)) >= 1, (v, text)


def _leaves(value: Any) -> list[Any]:
    if isinstance(value, dict):
        return [x for v in value.values() for x in _leaves(v)]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [x for f in dataclasses.fields(value) for x in _leaves(getattr(value, f.name))]
    return [value]


@pytest.mark.parametrize("tags", ["set", "frozen-key"])
def test_a_clash_beside_a_set_of_frozen_dataclasses_keeps_every_value(tags: str) -> None:
    held = {Frozen(1)} if tags == "set" else {Frozen(1): "a"}
    text = json.dumps(result_content(Frozen(x=(held, clash()))))
    assert "v-int-9k" in text and "v-str-9k" in text


async def test_an_iterator_that_raises_midway_loses_no_page_it_yielded(tmp_path: Path) -> None:
    def pages() -> Iterator[dict[str, str]]:
        yield {"page": "page-one-7x"}
        yield {"page": "page-two-7x"}
        raise ConnectionError("page 3 timed out")

    run, content, _, told = await run_on_sqlite(tmp_path, pages)
    assert run.status is RunStatus.completed
    assert "page-one-7x" in json.dumps(content) and "page-one-7x" in told


# --- nothing clashing: written exactly as pydantic writes it -----------------------------


class Colours(enum.Enum):
    red = "red"


@dataclasses.dataclass
class Row:
    when: datetime.datetime
    amount: decimal.Decimal
    ident: uuid.UUID
    colour: Colours
    tags: set[str]
    pair: tuple[int, str]
    raw: bytes
    nested: dict[Any, Any]
    span: datetime.timedelta


class Order(BaseModel):
    model_config = ConfigDict(arbitrary_types_allowed=True)
    id: int
    rows: list[Row]
    meta: dict[Any, Any]
    total: float = Field(serialization_alias="Total")
    obj: Any = None


def _ordinary() -> list[Any]:
    row = Row(
        when=datetime.datetime(2026, 1, 2, 3, 4, 5),
        amount=decimal.Decimal("2.50"),
        ident=uuid.UUID(int=5),
        colour=Colours.red,
        tags={"a"},
        pair=(1, "x"),
        raw=b"text",
        nested={1: "one", None: "none", (1, 2): "tuple", 2.5: "float"},
        span=datetime.timedelta(seconds=90),
    )
    return [
        row,
        Order(id=1, rows=[row, row], meta={"k": [1, {2: "b"}]}, total=1.5, obj=object),
        [row, {"x": Order(id=2, rows=[], meta={}, total=0.0)}],
        Frozen(x=Frozen(x=[1, (2, 3)])),
        Slotted(rows={Colours.red: 1}),
    ]


@pytest.mark.parametrize("i", range(len(_ordinary())))
def test_nothing_clashing_is_written_exactly_as_pydantic_writes_it(i: int) -> None:
    value = _ordinary()[i]
    assert result_content(value) == to_jsonable_python(_ordinary()[i], fallback=str)


class Timed(BaseModel):
    model_config = ConfigDict(ser_json_timedelta="float")
    span: datetime.timedelta
    rows: dict[Any, Any] = {}


def test_a_clash_leaves_a_models_json_settings_alone() -> None:
    alone = result_content(Timed(span=datetime.timedelta(seconds=3)))
    beside = result_content(Timed(span=datetime.timedelta(seconds=3), rows=clash()))
    assert alone["span"] == beside["span"] == 3.0


# --- cycles, files, large results --------------------------------------------------------


@dataclasses.dataclass
class Node:
    me: Any = None
    rows: Any = None


def test_a_cycle_through_a_dataclass_is_written_and_keeps_its_clash() -> None:
    n = Node(rows=clash())
    n.me = [n]
    text = json.dumps(result_content(n))
    assert "v-int-9k" in text and "v-str-9k" in text


async def test_a_cycle_through_a_dataclass_completes_on_sqlite(tmp_path: Path) -> None:
    def make() -> Any:
        n = Node(rows=clash())
        n.me = n
        return n

    run, content, _, _ = await run_on_sqlite(tmp_path, make)
    assert run.status is RunStatus.completed and "v-int-9k" in json.dumps(content)


def test_a_file_object_is_written_as_its_lines() -> None:
    assert result_content(io.StringIO("a\nb\n")) == ["a\n", "b\n"]


class _Counting:
    """Records how many values each single call into pydantic-core was handed."""

    def __init__(self) -> None:
        self.largest = 0

    def note(self, value: Any) -> None:
        self.largest = max(self.largest, _count(value))


def _count(value: Any) -> int:
    total, stack = 0, [value]
    while stack:
        v = stack.pop()
        total += 1
        if isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, (list, tuple, set, collections.deque)):
            stack.extend(v)
        elif dataclasses.is_dataclass(v) and not isinstance(v, type):
            stack.extend(getattr(v, f.name) for f in dataclasses.fields(v))
        elif isinstance(v, BaseModel):
            stack.extend(v.__dict__.values())
    return total


@dataclasses.dataclass
class QueryResult:
    rows: list[dict[str, Any]]
    count: int


def test_a_large_dataclass_result_is_converted_in_pieces(monkeypatch: Any) -> None:
    seen = _Counting()
    real = result_data.to_jsonable_python

    def counted(value: Any, **kw: Any) -> Any:
        seen.note(value)
        return real(value, **kw)

    monkeypatch.setattr(result_data, "to_jsonable_python", counted)
    rows = [{"id": i} for i in range(30_000)]
    out = result_content(QueryResult(rows=rows, count=len(rows)))
    assert len(out["rows"]) == 30_000
    assert seen.largest <= 3 * result_data._PIECE, seen.largest


def test_a_large_plain_list_is_converted_in_pieces(monkeypatch: Any) -> None:
    seen = _Counting()
    real = result_data.to_jsonable_python

    def counted(value: Any, **kw: Any) -> Any:
        seen.note(value)
        return real(value, **kw)

    monkeypatch.setattr(result_data, "to_jsonable_python", counted)
    out = result_content([{"id": i} for i in range(30_000)])
    assert len(out) == 30_000 and seen.largest <= 3 * result_data._PIECE


# --- the replay stub path ----------------------------------------------------------------


def _shop(paid: list[Any]) -> Agent:
    @tool(side_effects=False)
    def look(order: str) -> dict[str, Any]:
        """Read an order."""
        return {"order": order}

    @tool
    def pay(order: str) -> dict[str, Any]:
        """Pay (the real thing)."""
        paid.append(order)
        return {"paid": order}

    return Agent("shop", "Pay.", [look, pay])


def _script() -> ScriptedProvider:
    return ScriptedProvider([[("look", {"order": "o-1"})], [("pay", {"order": "o-1"})], "done"])


async def _replayed(tmp_path: Path, stub: Any) -> tuple[Any, bytes, str]:
    paid: list[Any] = []
    async with open_stores(f"sqlite:///{tmp_path / 'adk.sqlite3'}") as stores:
        await stores.create_schema()
        run = await AgentRunner.from_stores(_script(), stores, worker="w").run(
            _shop(paid), "pay", tenant=T, run_id="orig"
        )
        assert run.status is RunStatus.completed
        step = None
        for s in await stores.checkpoints.steps(T, "orig"):
            cp = await AgentRunner.from_stores(_script(), stores).checkpoints.at(T, "orig", s)  # type: ignore[union-attr]
            if cp is not None and any(oc.call.name == "pay" for oc in cp.outstanding):
                step = s
                break
        assert step is not None
        provider = Recording([[("look", {"order": "o-1"})], [("pay", {"order": "o-1"})], "done"])
        replay = await AgentRunner.from_stores(provider, stores, worker="w").replay(
            _shop(paid), "orig", tenant=T, from_step=step, stubs={"pay": stub}
        )
        assert replay.status is RunStatus.completed and paid == ["o-1"]
    return replay, sqlite_bytes(tmp_path), provider.told()


async def test_a_stubs_clashing_dataclass_keeps_every_value(tmp_path: Path) -> None:
    _, stored, told = await _replayed(tmp_path, lambda order: Frozen(x=clash()))
    assert "v-int-9k" in told and "v-str-9k" in told and b"v-int-9k" in stored


async def test_a_stubs_json_only_mask_holds_in_the_sqlite_file(tmp_path: Path) -> None:
    _, stored, told = await _replayed(tmp_path, lambda order: _masked(JsonMasked, "generator"))
    assert CARD.encode() not in stored and CARD not in told


class Login(BaseModel):
    user: str
    password: str
    pw: str = Field(default="", serialization_alias="db_password")
    rows: dict[Any, Any] = {}


ALIASED = "alias-held-k3j9x"


def _login(rows: dict[Any, str]) -> Any:
    return Frozen(x=Login(user="u", password=SECRET, pw=ALIASED, rows=rows))


async def test_secret_named_fields_of_a_walked_model_stay_masked_in_sqlite(tmp_path: Path) -> None:
    run, _, stored, told = await run_on_sqlite(tmp_path, lambda: _login(clash()))
    assert run.status is RunStatus.completed
    assert SECRET.encode() not in stored  # the live model is told it: only stores are masked
    assert "v-str-9k" in told


def test_a_serialization_alias_is_the_key_with_nothing_clashing() -> None:
    out = result_content(_login({}))
    assert out == to_jsonable_python(_login({}), fallback=str)
    assert out["x"]["db_password"] == ALIASED


@pytest.mark.parametrize("trigger", ["clash", "generator"])
async def test_a_credential_named_serialization_alias_stays_masked_beside_a_clash(
    tmp_path: Path, trigger: str
) -> None:
    def make() -> Any:
        if trigger == "clash":
            return _login(clash())
        return Frozen(x=[_login({}), (i for i in range(2))])

    run, _, stored, _ = await run_on_sqlite(tmp_path, make)
    assert run.status is RunStatus.completed
    assert ALIASED.encode() not in stored


async def test_a_large_generator_inside_a_dataclass_is_kept_whole(tmp_path: Path) -> None:
    def make() -> Any:
        return Frozen(x=({"i": i} for i in range(40_000)))

    run, content, _, _ = await run_on_sqlite(tmp_path, make)
    assert run.status is RunStatus.completed
    assert len(content["x"]) == 40_000 and content["x"][-1] == {"i": 39_999}
