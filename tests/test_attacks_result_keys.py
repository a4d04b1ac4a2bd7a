"""What a tool returns, on its way to the model, the stores, the logs and the spans, attacked
after the result-key changes (aa282a1, 78cc435, 83aba71, c747fd5, 19008dc):
``run/invoking.result_content`` (``_unclashed``, ``_keys_apart``, ``_cheap``, ``converted``),
``checkpoint/payload/outcomes._least_bytes`` and the redactor (``checkpoint/redaction``)
that masks what they write.

Attacked: dicts whose keys JSON writes alike, of every type pydantic writes (bytes, str and
int enums, plain enums, floats, ``None``, tuples, datetimes, ``Decimal``, ``UUID``, objects
written by their ``str``, str subclasses with a hash of their own), nested in lists, tuples
and sets, with secret-named keys, in real runs on SQLite (the file's bytes), with telemetry
capturing content, the runner's log lines, ``tesserix show --json``, and a run resumed after
dying right after its frontier; keys that only clash after the renaming (``#2 (bytes) …``);
renamed keys near the redactor's key-length limit; mappings that are not dicts (an HTTP
client's ``Headers``, a ``Mapping`` of one's own) on SQLite, Redis and PostgreSQL; keys
that are themselves secrets; keys pydantic cannot write beside clashing ones; clashing dicts
in containers pydantic writes as lists; ``SecretStr``/``SecretBytes`` values and keys;
JSON text whose duplicate keys hold secrets.

Held: every clashing key of every type is written apart and every secret under a
secret-named key stays masked, in SQLite's bytes, the spans, the log lines and ``show
--json``; keys that clash only after the renaming get a count and stay masked; the live
model, the record and the resumed model see the same keys; ``SecretStr`` values are written
as their mask; JSON text's duplicate secret keys are all masked.

Found, and fixed (their tests pass now):

* HIGH (older than this stop's changes): a mapping that is not a ``dict``
  (``httpx.Headers``, a tool's ``return resp.headers``) was handed to pydantic as it was and
  written as its ``str``; with a repeated header that is ``Headers([('x-api-key', '…'),
  …])``, name and value as a pair in a tuple, which the redactor does not mask: the API key
  was stored raw (SQLite, Redis and PostgreSQL). Such a mapping is now written as its items
  (``run/invoking._unclashed``), so each value sits under its key.
* MEDIUM: the same, for a ``Mapping`` of one's own: it was written as
  ``<… object at 0x…>`` and every value was lost.
* MEDIUM: a clashing key written after its type got longer (``"(bytes) "``, ``"#2 "``), and a
  key name over 128 characters is never taken for a credential: a bytes twin of a
  121-128-character ``…_password`` key was stored raw. A renamed key now keeps the end of
  its name within 128 characters (``_keys_apart``).
* MEDIUM: two keys that are secrets themselves (``sk-proj-…``) masked to the same
  placeholder, and ``Redactor._walk`` wrote the second over the first: the record kept one
  value of two. The second is now kept under the mask with ``#2``.

Found, and fixed later (LOW, ``run/result_data``):

* one key pydantic cannot write (bytes that are not UTF-8, an int past the digit limit)
  turned the clash check off for its whole dict, and the dict was written key by key
  (``_written_otherwise``), where ``1`` and ``"1"`` still clashed: a value was lost; so was
  one under a text key equal to the base64 of a bytes key. Such a key now counts as one
  that clashes, and is written by ``_key_name``.
* a clashing dict in a ``deque`` (or a generator) was not walked, and pydantic writes it as
  a list: a value was lost. ``_unclashed`` reads deques and iterators too.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import datetime
import decimal
import enum
import json
import logging
import uuid
from collections.abc import AsyncIterator, Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import SecretBytes, SecretStr

from adapters import services
from operator_cli import cli, sqlite_bytes
from otel_spans.world import Pipeline, every_value
from tesserix_adk import (
    Agent,
    AgentRunner,
    Checkpointer,
    ModelRequest,
    ModelResponse,
    RunStatus,
    ScriptedProvider,
    tool,
)
from tesserix_adk.checkpoint.payload import decode_outcome, recorded_outcome
from tesserix_adk.checkpoint.payload.redacting import redact_outcome_content
from tesserix_adk.checkpoint.redaction import Redactor
from tesserix_adk.messages import ToolOutcome
from tesserix_adk.run.invoking import result_content
from tesserix_adk.stores.protocols import RecordStatus
from tesserix_adk.stores.urls import open_stores
from tesserix_adk.testing.faults import FaultyCheckpointStore, SimulatedCrash

T = "keys"
T2 = "keys-resumed"  # keys are a tenant's: another run of the same key is answered
BACKENDS = [
    pytest.param("sqlite", id="sqlite"),
    pytest.param("redis", id="redis", marks=pytest.mark.redis),
    pytest.param("postgres", id="postgres", marks=pytest.mark.postgres),
]


def secret(n: int) -> str:
    """A secret no pattern finds: only the key it sits under says it is one."""
    return f"hunter{n:02d}-plain-9f3q"


# --- set-up ------------------------------------------------------------------------------


class Recording:
    """A scripted model that keeps every request it was sent."""

    def __init__(self, turns: list[Any]) -> None:
        self.inner = ScriptedProvider(turns)
        self.requests: list[ModelRequest] = []

    async def complete(self, request: ModelRequest) -> ModelResponse:
        self.requests.append(request)
        response: ModelResponse = await self.inner.complete(request)
        return response

    def told(self) -> dict[str, str]:
        """The tool results the last request carried (their text), by call id."""
        last = self.requests[-1]
        return {m.tool_call_id: m.text for m in last.messages if m.tool_call_id is not None}


def _keyed_tool(value: Any) -> Any:
    @tool(key=lambda **kw: "fetch-1")
    def fetch(what: str) -> Any:
        """Fetch a thing (a side effect, keyed)."""
        return value

    return fetch


async def _recorded(stores: Any, run_id: str, tenant: str = T) -> Any:
    [rec] = [r for r in await stores.idempotency.records(tenant, run_id)]
    assert rec.status is RecordStatus.completed
    return decode_outcome(rec.outcome, "c").content


async def _run_on(url: str, value: Any, *, run_id: str = "r") -> tuple[Any, Any]:
    """One run on ``url`` whose one keyed call returns ``value``: the run and the record's
    content."""
    async with open_stores(url) as stores:
        await stores.create_schema()
        runner = AgentRunner.from_stores(
            ScriptedProvider([[("fetch", {"what": "x"})], "ok"]), stores
        )
        run = await runner.run(Agent("a", "x", [_keyed_tool(value)]), "go", tenant=T, run_id=run_id)
        return run, await _recorded(stores, run_id)


# --- hostile keys ------------------------------------------------------------------------


class Field(enum.Enum):
    password = "password"


class IntKey(enum.IntEnum):
    one = 1


class Kind(enum.StrEnum):
    token = "token"


class Spelled:
    """A key pydantic writes by its ``str``."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __str__(self) -> str:
        return self.text

    def __hash__(self) -> int:
        return hash(("spelled", self.text))


class OwnHash(str):
    """A str subclass that is not equal to the text it spells (a dict holds both)."""

    def __hash__(self) -> int:
        return hash(("own", str(self)))

    def __eq__(self, other: object) -> bool:
        return self is other


def _hostile() -> tuple[Any, dict[str, str]]:
    """A result whose dicts clash in every way, with a secret under each secret-named key,
    and the plain values that must all be kept (marker → where)."""
    day = datetime.date(2026, 1, 2)
    when = datetime.datetime(2026, 1, 2, 3, 4, 5)
    ident = uuid.UUID(int=7)
    value = {
        "password": secret(1),
        b"password": secret(2),
        Field.password: secret(3),
        "(bytes) password": secret(4),  # taken already: the bytes key gets a count
        Spelled("password"): secret(5),
        OwnHash("password"): secret(6),
        ("db", "password"): secret(7),
        "db,password": secret(8),
        "rows": [
            {1: "plain-int", "1": "plain-text-1", IntKey.one: "same-as-int"},
            ({None: "plain-none", "None": "plain-None"},),
            {1.5: "plain-float", "1.5": "plain-text-1.5"},
            {day: "plain-day", str(day): "plain-day-text"},
            {when: "plain-when", when.isoformat(): "plain-when-text"},
            {decimal.Decimal("2.50"): "plain-decimal", "2.50": "plain-decimal-text"},
            {ident: "plain-uuid", str(ident): "plain-uuid-text"},
            {Kind.token: secret(9), b"token": secret(10), "nested": {b"secret": secret(11)}},
        ],
        "tagged": ({b"clientSecret": secret(12), "clientSecret": secret(13)},),
    }
    # IntKey.one == 1: one dict key; "same-as-int" replaces "plain-int" in Python itself.
    plain = [
        "same-as-int",
        "plain-text-1",
        "plain-none",
        "plain-None",
        "plain-float",
        "plain-text-1.5",
        "plain-day",
        "plain-day-text",
        "plain-when",
        "plain-when-text",
        "plain-decimal",
        "plain-decimal-text",
        "plain-uuid",
        "plain-uuid-text",
    ]
    return value, dict.fromkeys(plain, "kept")


SECRETS = [secret(n) for n in range(1, 14)]


def _leaves(value: Any) -> list[Any]:
    if isinstance(value, Mapping):
        return [leaf for v in value.values() for leaf in _leaves(v)]
    if isinstance(value, (list, tuple)):
        return [leaf for v in value for leaf in _leaves(v)]
    return [value]


def _keys(value: Any) -> set[str]:
    """Every key path of JSON data (lists by position)."""
    out: set[str] = set()

    def walk(v: Any, at: str) -> None:
        if isinstance(v, Mapping):
            for k, item in v.items():
                out.add(f"{at}/{k}")
                walk(item, f"{at}/{k}")
        elif isinstance(v, list):
            for i, item in enumerate(v):
                walk(item, f"{at}/{i}")

    walk(value, "")
    return out


# ==========================================================================================
# Held: clashing keys of every type, end to end on SQLite
# ==========================================================================================


async def _live_and_resumed(
    url: str, agent: Agent, otel: Pipeline
) -> tuple[Recording, Any, Recording, Any]:
    """A run of ``agent`` on ``url`` (its model, its record), and another that dies right
    after its after_tool_result frontier and is resumed (the resumed model, its record)."""
    turns: list[Any] = [[("fetch", {"what": "x"})], "ok"]
    async with open_stores(url) as stores:
        await stores.create_schema()
        live = Recording(turns)
        runner = AgentRunner.from_stores(live, stores, telemetry=otel.telemetry)
        run = await runner.run(agent, "go", tenant=T, run_id="live")
        assert run.status is RunStatus.completed
        record = await _recorded(stores, "live")

        # Another run dies right after its after_tool_result frontier, and is resumed.
        def after_result(body: dict[str, Any]) -> bool:
            return body.get("boundary") == "after_tool_result"

        dying = AgentRunner(
            Recording(turns),
            idempotency=stores.idempotency,
            checkpoints=Checkpointer(
                FaultyCheckpointStore(stores.checkpoints, crash_after=after_result),
                history=stores.history,
            ),
            ledger=stores.ledger,
        )
        with pytest.raises(SimulatedCrash):
            await dying.run(agent, "go", tenant=T2, run_id="dies")
        resumed = Recording(turns)
        again = AgentRunner.from_stores(resumed, stores)
        run2 = await again.resume(agent, "dies", tenant=T2)
        assert run2.status is RunStatus.completed
        record2 = await _recorded(stores, "dies", T2)
    return live, record, resumed, record2


def test_clashing_keys_of_every_type_keep_secrets_masked_in_store_spans_logs_and_show(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    value, plain = _hostile()
    url = f"sqlite:///{tmp_path / 'adk.sqlite3'}"
    otel = Pipeline(capture_content=True)
    caplog.set_level(logging.DEBUG)
    agent = Agent("a", "x", [_keyed_tool(value)])
    live, record, resumed, record2 = asyncio.run(_live_and_resumed(url, agent, otel))
    stored = sqlite_bytes(tmp_path)
    assert b"plain-text-1.5" in stored  # the store is read as written (no compression)
    code, shown, err = cli("show", "live", "--tenant", T, "--store", url, "--json")
    assert code == 0, err
    spans = "\n".join(every_value(otel.spans()))
    assert "gen_ai.tool.call.result" in str([s.attributes for s in otel.spans()])
    logs = "\n".join(r.getMessage() for r in caplog.records)
    for s in SECRETS:
        assert s.encode() not in stored, s
        assert s not in shown, s
        assert s not in spans, s
        assert s not in logs, s
    # No plain value lost, in the record or in what show prints.
    kept = {str(v) for v in _leaves(record)}
    assert set(plain) <= kept, set(plain) - kept
    assert all(p in shown for p in plain)
    # Every secret-named value is there, masked, each under a key of its own.
    assert sum(1 for v in _leaves(record) if str(v).startswith("[redacted:")) == len(SECRETS)
    # The live model, the record, the resumed model: the same keys.
    [live_text] = live.told().values()
    [resumed_text] = resumed.told().values()
    assert _keys(json.loads(live_text)) == _keys(record) == _keys(json.loads(resumed_text))
    assert record2 == record
    assert json.loads(resumed_text) == record


def test_keys_that_clash_only_after_the_renaming_are_counted_and_stay_masked() -> None:
    redactor = Redactor()
    value = {
        "api_key": "plain-a",
        b"api_key": secret(1),
        "(bytes) api_key": "plain-b",
        "#2 (bytes) api_key": "plain-c",
        Spelled("api_key"): secret(2),
    }
    written = result_content(value)
    assert written == {
        "api_key": "plain-a",
        "(bytes) api_key": "plain-b",
        "#2 (bytes) api_key": "plain-c",
        "#3 (bytes) api_key": secret(1),
        "(Spelled) api_key": secret(2),
    }
    stored = json.dumps(redact_outcome_content(written, redactor))
    assert secret(1) not in stored and secret(2) not in stored


def test_secret_types_and_json_text_with_duplicate_keys_are_never_stored_raw() -> None:
    redactor = Redactor()
    value = {
        "note": SecretStr(secret(1)),
        "blob": SecretBytes(secret(2).encode()),
        "list": [SecretStr(secret(3))],
        SecretStr(secret(4)): "plain-under-a-secret-key",
        "doc": json.dumps({"password": secret(5), "x": 1}).replace(
            '"x": 1', f'"password": "{secret(6)}"'
        ),
    }
    stored = recorded_outcome(ToolOutcome(call_id="c", content=result_content(value)), redactor)
    for n in range(1, 7):
        assert secret(n).encode() not in stored.payload, n
    assert b"plain-under-a-secret-key" in stored.payload


# ==========================================================================================
# Found: a mapping that is not a dict is written as its str
# ==========================================================================================


@contextlib.asynccontextmanager
async def _backend(where: str, tmp_path: Path) -> AsyncIterator[tuple[str, Any]]:
    """A store URL on ``where`` of this test's own, and how to read all it holds as bytes."""
    if where == "sqlite":

        async def sqlite_dump() -> bytes:
            return sqlite_bytes(tmp_path)

        yield f"sqlite:///{tmp_path / 'adk.sqlite3'}", sqlite_dump
    elif where == "redis":
        client = await services.redis_client()
        prefix = services.redis_prefix()

        async def redis_dump() -> bytes:
            out: list[bytes] = []
            async for key in client.scan_iter(match=f"{prefix}*", count=1000):
                out.append(key)
                kind = (await client.type(key)).decode()
                if kind == "string":
                    out.append(await client.get(key) or b"")
                elif kind == "hash":
                    for k, v in (await client.hgetall(key)).items():
                        out += [k, v]
                elif kind == "list":
                    out += await client.lrange(key, 0, -1)
                elif kind == "set":
                    out += list(await client.smembers(key))
                elif kind == "zset":
                    out += [m for m, _ in await client.zrange(key, 0, -1, withscores=True)]
                elif kind == "stream":
                    for _, fields in await client.xrange(key):
                        for k, v in fields.items():
                            out += [k, v]
                else:
                    out.append(f"<unread {kind}>".encode())
            return b"\n".join(out)

        try:
            url = services.with_query(services.REDIS_URL, prefix=prefix, allow_volatile="true")
            yield url, redis_dump
        finally:
            try:
                await services.delete_prefixed(client, prefix)
            finally:
                await client.aclose()
    else:
        import psycopg

        async with services.postgres_schema() as schema:

            async def postgres_dump() -> bytes:
                out: list[bytes] = []
                async with await psycopg.AsyncConnection.connect(
                    services.POSTGRES_URL, autocommit=True
                ) as conn:
                    cur = await conn.execute(
                        "SELECT table_name FROM information_schema.tables WHERE table_schema = %s",
                        (schema,),
                    )
                    for (table,) in await cur.fetchall():
                        rows = await conn.execute(f'SELECT * FROM "{schema}"."{table}"')
                        for row in await rows.fetchall():
                            for cell in row:
                                if isinstance(cell, bytes | memoryview):
                                    out.append(bytes(cell))
                                else:
                                    out.append(str(cell).encode())
                return b"\n".join(out)

            yield services.schema_url(schema), postgres_dump


@pytest.mark.parametrize("where", BACKENDS)
async def test_response_headers_with_a_repeated_name_keep_a_secret_header_masked(
    where: str, tmp_path: Path
) -> None:
    headers = httpx.Headers(
        [
            ("content-type", "application/json"),
            ("x-api-key", secret(1)),
            ("set-cookie", f"sid={secret(2)}"),
            ("set-cookie", "theme=dark"),
        ]
    )
    async with _backend(where, tmp_path) as (url, dump):
        run, _ = await _run_on(url, {"status": 200, "headers": headers})
        assert run.status is RunStatus.completed
        stored = await dump()
    assert b"application/json" in stored  # the result is there to look for
    assert secret(1).encode() not in stored
    assert secret(2).encode() not in stored


class Settings(Mapping[str, Any]):
    """A read-only mapping of one's own (no ``__repr__``), as config libraries hand out."""

    def __init__(self, data: dict[str, Any]) -> None:
        self._data = data

    def __getitem__(self, key: str) -> Any:
        return self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)


def test_a_mapping_that_is_not_a_dict_is_written_as_its_items() -> None:
    clashing = result_content(Settings({"seat": "14C", 1: "one", "1": "uno"}))
    assert clashing == {"seat": "14C", "1": "uno", "(int) 1": "one"}  # a dict: held
    assert result_content(Settings({"seat": "14C", "flight": "LH400"})) == {
        "seat": "14C",
        "flight": "LH400",
    }


# ==========================================================================================
# Found: a renamed key past the redactor's key-length limit
# ==========================================================================================


async def test_a_renamed_key_near_the_key_length_limit_keeps_its_secret_masked(
    tmp_path: Path,
) -> None:
    name = "x" * 116 + "_password"  # 125 characters: masked as it is
    redactor = Redactor()
    assert redactor.value({name: secret(1)}) == {name: "[redacted:password]"}
    url = f"sqlite:///{tmp_path / 'adk.sqlite3'}"
    run, record = await _run_on(url, {name: "plain-visible", name.encode(): secret(2)})
    assert run.status is RunStatus.completed
    assert len(record) == 2  # both kept
    assert secret(2).encode() not in sqlite_bytes(tmp_path)


# ==========================================================================================
# Found: keys that are secrets themselves, masked alike
# ==========================================================================================


async def test_two_secret_keys_masked_alike_lose_no_value(tmp_path: Path) -> None:
    first, second = "sk-proj-" + "A1b2C3d4" * 5, "sk-proj-" + "Z9y8X7w6" * 5
    url = f"sqlite:///{tmp_path / 'adk.sqlite3'}"
    turns: list[Any] = [[("fetch", {"what": "x"})], "ok"]
    async with open_stores(url) as stores:
        await stores.create_schema()
        live = Recording(turns)
        runner = AgentRunner.from_stores(live, stores)
        agent = Agent("a", "x", [_keyed_tool({first: "status-active", second: "status-revoked"})])
        run = await runner.run(agent, "go", tenant=T, run_id="r")
        assert run.status is RunStatus.completed
        record = await _recorded(stores, "r")
    stored = sqlite_bytes(tmp_path)
    assert first.encode() not in stored and second.encode() not in stored  # held
    [told] = live.told().values()
    assert len(json.loads(told)) == 2
    assert sorted(_leaves(record)) == ["status-active", "status-revoked"]


# ==========================================================================================
# Found (LOW): the clash check off, and containers not walked
# ==========================================================================================


@pytest.mark.parametrize(
    "odd", [pytest.param(b"\xff\xfe", id="bytes"), pytest.param(10**5000, id="huge-int")]
)
def test_a_key_pydantic_cannot_write_leaves_the_clash_check_on(odd: Any) -> None:
    written = result_content({1: "seat-one", "1": "seat-uno", odd: "odd"})
    assert sorted(_leaves(written)) == ["odd", "seat-one", "seat-uno"]


def test_a_base64_written_key_does_not_overwrite_a_text_key() -> None:
    written = result_content({b"\xff": "from-bytes", "/w==": "from-text"})
    assert sorted(_leaves(written)) == ["from-bytes", "from-text"]


@pytest.mark.parametrize("holder", ["deque", "generator"])
def test_a_clashing_dict_in_a_deque_or_generator_loses_no_value(holder: str) -> None:
    rows = [{1: "seat-one", "1": "seat-uno"}]
    value = collections.deque(rows) if holder == "deque" else (r for r in rows)
    written = result_content(value)
    assert sorted(_leaves(written)) == ["seat-one", "seat-uno"]
