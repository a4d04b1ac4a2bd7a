"""How a tool's result is written before the kit stores it, attacked after today's changes
(996690a, 6933a0b, 83aba71, 78cc435, c747fd5, 19008dc): ``run/invoking.result_content``
(``_unclashed``, ``_grouped``, ``_unknown``, ``_keys_apart``, ``_written_otherwise``),
``converted``/``_cheap`` (off the event loop), ``Redactor._walk`` and
``checkpoint/payload/outcomes._least_bytes``.

Attacked: every mapping pydantic cannot write (``ChainMap``, ``MappingProxyType``,
``OrderedDict``, ``defaultdict``, ``Counter``, httpx's and starlette's multidicts,
``FormData``, a ``Mapping`` of one's own) nested three levels deep in dataclasses,
namedtuples and pydantic models, on SQLite (the file's bytes), with spans capturing
content, the runner's log lines, ``tesserix show --json`` and a run resumed after dying
right after its frontier; mappings whose ``items`` raise, give triples or unhashable keys,
whose ``multi_items`` raises; keys whose ``str`` and ``repr`` raise; self-referencing
results (through a dataclass); clashing dicts inside objects pydantic walks itself; a
result of a million and a half rows converted in a worker thread under
``LeasePolicy(ttl=0.5, renew_within=0.25)``; a replay stub returning a multidict.

Held:

* every mapping kind above, in every holder, three levels deep: each secret masked by its
  key's name in SQLite's bytes, the spans, the log lines and ``show --json``; every plain
  value kept (a repeated header with all of its values); the live model, the record, the
  resumed run's record and the resumed model agree;
* a mapping that cannot be read at all (``items`` raising, triples, an unhashable key):
  the call is still recorded completed, the model told what the record holds, nothing
  raised;
* a self-referencing mapping (a ``ChainMap`` holding itself, a dataclass through a
  ``MappingProxyType``): written as its text, secrets under dict-like keys masked.

Found, and fixed (their tests pass now):

* HIGH ``test_a_secret_header_in_a_result_written_as_its_text_is_never_stored_raw``: a
  result pydantic cannot walk (a dataclass that refers to itself, an ``attrs`` class, a
  ``SimpleNamespace``) holding ``httpx.Headers`` with a repeated name was written as its
  ``repr``, where the headers read ``Headers([('x-api-key', '…'), …])``: a pair the
  redactor's free text did not read. The API key was stored raw (SQLite, Redis,
  PostgreSQL). The free-text scan now masks the value of a quoted credential-named key
  followed by a comma and a quoted value (``checkpoint/redaction/free_text._KEY_WORD``).
* MEDIUM ``test_a_million_rows_converted_in_a_thread_keep_the_lease``: one call into
  pydantic-core keeps the GIL for its whole length, so a thread did not free the event loop
  (about 0.8 s for 1.5 M rows). A long list is converted 10,000 items at a time now
  (``run/invoking._in_pieces``).
* LOW: a multidict whose ``multi_items`` raises is read through ``items``; a replay stub's
  multidict keeps every value of a repeated key (``_stub_result``).

Found, and fixed later (``run/result_data``: ``_object_unclashed``, ``_key_name``):

* MEDIUM ``test_a_clashing_dict_inside_an_object_pydantic_walks_loses_no_value``: a dict
  whose keys JSON writes alike (``1`` and ``"1"``) inside a dataclass or a pydantic model
  was written by pydantic itself: one value was lost (the night attack's LOW, by another
  road). A plain dataclass is now walked as the dict of its fields; a model is left to write
  itself (walking it stored values its JSON-only serializers mask raw,
  ``test_attacks_result_holders.py``), so its case is a strict xfail again (MEDIUM, left).
* LOW: a dict with one key whose ``str`` and ``repr`` both raise was written as ``<a dict
  that cannot be written as text>``: every other value was lost. That key alone is now
  written as what it is.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import logging
import types
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import attrs
import httpx
import pytest
from pydantic import BaseModel, ConfigDict
from starlette.datastructures import FormData, MultiDict, QueryParams
from starlette.datastructures import Headers as StarletteHeaders

from hostile_results import run_under_short_lease
from operator_cli import cli, sqlite_bytes
from otel_spans.world import Pipeline, every_value
from processes import BACKENDS, store_url
from tesserix_adk import (
    Agent,
    AgentRunner,
    Checkpointer,
    ModelRequest,
    ModelResponse,
    Run,
    RunStatus,
    ScriptedProvider,
    tool,
)
from tesserix_adk.checkpoint.payload import decode_outcome
from tesserix_adk.errors import LeaseLostError
from tesserix_adk.stores.protocols import RecordStatus
from tesserix_adk.stores.urls import open_stores
from tesserix_adk.testing.faults import FaultyCheckpointStore, SimulatedCrash

T = "round"
T2 = "round-resumed"  # keys are a tenant's: the dying run keys its call under another


def secret(n: int) -> str:
    """A secret no pattern finds: only the key it sits under says it is one."""
    return f"hunter{n:02d}plain9f3q"


class Recording:
    """A scripted model that keeps every request it was sent."""

    def __init__(self, turns: list[Any]) -> None:
        self.inner = ScriptedProvider(turns)
        self.requests: list[ModelRequest] = []

    async def complete(self, request: ModelRequest) -> ModelResponse:
        self.requests.append(request)
        response: ModelResponse = await self.inner.complete(request)
        return response

    def told(self) -> str:
        """The one tool result the last request carried, as text."""
        [text] = [m.text for m in self.requests[-1].messages if m.tool_call_id is not None]
        return text


def _agent(value: Any) -> Agent:
    @tool(key=lambda **kw: "fetch-1")
    def fetch(what: str) -> Any:
        """Fetch a thing (a side effect, keyed)."""
        return value

    return Agent("a", "x", [fetch])


async def _recorded(stores: Any, run_id: str, tenant: str) -> tuple[bytes, Any]:
    [rec] = list(await stores.idempotency.records(tenant, run_id))
    assert rec.status is RecordStatus.completed
    return bytes(rec.outcome), decode_outcome(rec.outcome, "c").content


@dataclasses.dataclass
class Seen:
    """One run live, and another that died right after its after_tool_result frontier and
    was resumed: what each model was told and what each record holds."""

    live: str
    record: Any
    payload: bytes
    resumed: str
    record2: Any


async def _live_and_resumed(url: str, value: Any, otel: Pipeline | None = None) -> Seen:
    agent = _agent(value)
    turns: list[Any] = [[("fetch", {"what": "x"})], "ok"]
    async with open_stores(url) as stores:
        await stores.create_schema()
        live = Recording(turns)
        telemetry = {} if otel is None else {"telemetry": otel.telemetry}
        runner = AgentRunner.from_stores(live, stores, **telemetry)
        run = await runner.run(agent, "go", tenant=T, run_id="live")
        assert run.status is RunStatus.completed
        payload, record = await _recorded(stores, "live", T)

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
        run2 = await AgentRunner.from_stores(resumed, stores).resume(agent, "dies", tenant=T2)
        assert run2.status is RunStatus.completed
        _, record2 = await _recorded(stores, "dies", T2)
    return Seen(live.told(), record, payload, resumed.told(), record2)


def _as_data(told: str) -> Any:
    """What a model was told, as the record holds it (a text result is told as it is)."""
    try:
        return json.loads(told)
    except ValueError:
        return told


def _leaves(value: Any) -> list[Any]:
    if isinstance(value, dict):
        return [leaf for v in value.values() for leaf in _leaves(v)]
    if isinstance(value, list):
        return [leaf for v in value for leaf in _leaves(v)]
    return [value]


# --- holders pydantic walks, and mappings it cannot write ---------------------------------


@dataclasses.dataclass
class Reply:
    status: int
    headers: Any
    extra: Any = None


class Page(NamedTuple):
    items: Any
    meta: Any


class Envelope(BaseModel):
    model_config = ConfigDict(arbitrary_types_allowed=True)

    reply: Any
    pages: list[Any]


class Settings(Mapping[str, Any]):
    """A mapping of one's own (a settings object)."""

    def __init__(self, data: dict[str, Any]) -> None:
        self._data = data

    def __getitem__(self, key: str) -> Any:
        return self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)


def _every_mapping() -> tuple[Any, list[str], list[str]]:
    """A result holding every mapping kind pydantic cannot write (and the dict subclasses
    it can), three levels down in a pydantic model, a dataclass and a namedtuple: the
    result, its secrets and its plain values."""
    s = [secret(n) for n in range(1, 17)]
    plain = [f"plain-{n}" for n in range(1, 12)]
    deepest = Reply(
        201,
        httpx.Headers([("x-api-key", s[0]), ("x-api-key", s[1]), ("x-trace", plain[0])]),
        extra=Page(
            items=[
                collections.ChainMap({"password": s[2]}, {"region": plain[1]}),
                types.MappingProxyType({"api_key": s[3], "zone": plain[2]}),
            ],
            meta=collections.OrderedDict(token=s[4], page=plain[3]),
        ),
    )
    middle = Page(
        items=[
            collections.defaultdict(list, {"client_secret": s[5], "owner": plain[4]}),
            collections.Counter({"apples": 3}),
            QueryParams([("access_token", s[6]), ("access_token", s[7]), ("q", plain[5])]),
            MultiDict([("password", s[8]), ("password", s[9]), ("user", plain[6])]),
        ],
        meta=Reply(200, FormData([("passphrase", s[10]), ("note", plain[7])]), extra=deepest),
    )
    top = Envelope(
        reply=Reply(
            200,
            StarletteHeaders(
                raw=[
                    (b"set-cookie", f"sid={s[11]}".encode()),
                    (b"set-cookie", f"csrf={s[12]}".encode()),
                    (b"x-request-id", plain[8].encode()),
                ]
            ),
            extra=Settings({"db_password": s[13], "host": plain[9], "inner": middle}),
        ),
        pages=[httpx.QueryParams({"refresh_token": s[14], "p": plain[10]}), {"secret": s[15]}],
    )
    return top, s, plain


def test_every_mapping_kind_nested_in_objects_is_masked_kept_and_agrees(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    value, secrets, plain = _every_mapping()
    url = f"sqlite:///{tmp_path / 'adk.sqlite3'}"
    otel = Pipeline(capture_content=True)
    caplog.set_level(logging.DEBUG)
    seen = asyncio.run(_live_and_resumed(url, value, otel))
    stored = sqlite_bytes(tmp_path)
    assert b"plain-11" in stored  # the store is read as written
    code, shown, err = cli("show", "live", "--tenant", T, "--store", url, "--json")
    assert code == 0, err
    spans = "\n".join(every_value(otel.spans()))
    logs = "\n".join(r.getMessage() for r in caplog.records)
    for s in secrets:
        assert s.encode() not in stored, s
        assert s not in shown and s not in spans and s not in logs, s
        assert s not in json.dumps(seen.record) and s not in seen.resumed, s
    leaves = [str(v) for v in _leaves(seen.record)]
    for p in plain:
        assert any(p in leaf for leaf in leaves), p
        assert p in shown, p
    assert 3 in _leaves(seen.record)  # the Counter's count
    # Each secret is there, masked: the repeated headers with all of their values.
    assert sum(leaf.count("[redacted:") for leaf in leaves) >= len(secrets)
    # The live model was told the result unmasked; its shape (every key) is the record's.
    assert json.loads(seen.resumed) == seen.record == seen.record2
    assert _keys(json.loads(seen.live)) == _keys(seen.record)


def _keys(value: Any, at: str = "") -> set[str]:
    out: set[str] = set()
    if isinstance(value, dict):
        for k, v in value.items():
            out.add(f"{at}/{k}")
            out |= _keys(v, f"{at}/{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out |= _keys(v, f"{at}/{i}")
    return out


# --- mappings that cannot be read --------------------------------------------------------


class RaisingItems(Settings):
    def items(self) -> Any:
        raise RuntimeError("the connection is gone")


class Triples(Settings):
    def items(self) -> Any:
        return [("password", secret(40), "extra")]


class UnhashableKeys(Settings):
    def items(self) -> Any:
        return [(["password"], secret(41))]


@pytest.mark.parametrize(
    "odd",
    [
        RaisingItems({"password": secret(42)}),
        Triples({"password": secret(40)}),
        UnhashableKeys({"password": secret(41)}),
        Reply(200, RaisingItems({"password": secret(42)})),
        [Triples({"password": secret(40)})],
    ],
    ids=["items-raise", "triples", "unhashable-key", "in-a-dataclass", "in-a-list"],
)
def test_a_mapping_that_cannot_be_read_is_still_recorded_completed(
    odd: Any, tmp_path: Path
) -> None:
    seen = asyncio.run(_live_and_resumed(f"sqlite:///{tmp_path / 'adk.sqlite3'}", odd))
    stored = sqlite_bytes(tmp_path)
    for n in (40, 41, 42):
        assert secret(n).encode() not in stored
    assert _as_data(seen.resumed) == seen.record == seen.record2
    assert _as_data(seen.live) == seen.record  # nothing here to mask


def test_a_self_referencing_mapping_is_written_and_masked(tmp_path: Path) -> None:
    chain: collections.ChainMap[str, Any] = collections.ChainMap({"password": secret(50)})
    chain["me"] = chain
    inner: dict[str, Any] = {"token": secret(51)}
    through = Reply(200, types.MappingProxyType(inner))
    inner["back"] = through
    for value in (chain, through):
        seen = asyncio.run(_live_and_resumed(f"sqlite:///{tmp_path / 'adk.sqlite3'}", value))
        (tmp_path / "adk.sqlite3").unlink()
        assert secret(50) not in json.dumps(seen.record)
        assert secret(51) not in json.dumps(seen.record)
        assert "[redacted:" in json.dumps(seen.record)
        assert seen.record == seen.record2


# --- a secret header written as text -----------------------------------------------------


@attrs.define
class AttrsReply:
    status: int
    headers: Any


def _headers_as_text(holder: str) -> Any:
    headers = httpx.Headers([("x-api-key", secret(60)), ("x-api-key", secret(61))])
    if holder == "self-referencing-dataclass":
        reply = Reply(200, headers)
        reply.extra = reply  # a parent pointer, as a tree's node has
        return reply
    if holder == "attrs":
        return AttrsReply(200, headers)
    return types.SimpleNamespace(status=200, headers=headers)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("holder", ["self-referencing-dataclass", "attrs", "namespace"])
async def test_a_secret_header_in_a_result_written_as_its_text_is_never_stored_raw(
    backend: str, holder: str, tmp_path: Path
) -> None:
    async with store_url(backend, tmp_path) as url:
        seen = await _live_and_resumed(url, _headers_as_text(holder))
    for n in (60, 61):
        assert secret(n).encode() not in seen.payload, n
        assert secret(n) not in seen.resumed, n
        if backend == "sqlite":
            assert secret(n).encode() not in sqlite_bytes(tmp_path), n


# --- a clashing dict inside an object pydantic walks --------------------------------------


class Model(BaseModel):
    codes: dict[Any, Any]


@pytest.mark.parametrize(
    "holder",
    [
        "dataclass",
        pytest.param(
            "pydantic-model",
            marks=pytest.mark.xfail(
                strict=True,
                reason="DEFECT MEDIUM (left): a pydantic model is written as it writes itself "
                "(its JSON-only masks, aliases, settings; walking it stored masked values "
                "raw): a clash inside loses a value",
            ),
        ),
    ],
)
def test_a_clashing_dict_inside_an_object_pydantic_walks_loses_no_value(
    holder: str, tmp_path: Path
) -> None:
    codes = {1: "one-by-int", "1": "one-by-text"}
    value = Reply(200, codes) if holder == "dataclass" else Model(codes=codes)
    seen = asyncio.run(_live_and_resumed(f"sqlite:///{tmp_path / 'adk.sqlite3'}", value))
    for kept in ("one-by-int", "one-by-text"):
        assert kept in seen.live, kept
        assert kept in json.dumps(seen.record), kept
        assert kept in seen.resumed, kept


# --- the lease while a large result is converted -----------------------------------------


# A 0.5 s lease against other processes' load: in the ADK_SLOW=1 run (README, Testing);
# tests/run/test_result_content.py checks the pieces themselves in every run.
@pytest.mark.slow
def test_a_million_rows_converted_in_a_thread_keep_the_lease() -> None:
    rows = [(7, "seat", 1.5)] * 1_500_000  # rows of a query: one tuple repeated, to spare memory
    ran = asyncio.run(run_under_short_lease(rows))
    assert not isinstance(ran, LeaseLostError), ran
    assert isinstance(ran, Run) and ran.status is RunStatus.completed, ran


# --- a mapping readable one way only -----------------------------------------------------


class MultiItemsRaise(Settings):
    """A multidict whose ``multi_items`` fails while ``items`` reads every value."""

    def multi_items(self) -> Any:
        raise RuntimeError("multi_items is not supported by this backend")


class Unwritable:
    """A key whose text cannot be read at all."""

    def __str__(self) -> str:
        raise RuntimeError("no text")

    def __repr__(self) -> str:
        raise RuntimeError("no repr")


@pytest.mark.parametrize(
    "which",
    [
        "multi-items-raise",
        "one-unwritable-key",
    ],
)
def test_a_mapping_readable_one_way_loses_no_value(which: str, tmp_path: Path) -> None:
    value: Any = (
        MultiItemsRaise({"note": "kept-value", "password": secret(70)})
        if which == "multi-items-raise"
        else {"note": "kept-value", Unwritable(): 1}
    )
    seen = asyncio.run(_live_and_resumed(f"sqlite:///{tmp_path / 'adk.sqlite3'}", value))
    assert secret(70).encode() not in sqlite_bytes(tmp_path)
    assert "kept-value" in json.dumps(seen.record)
    assert "kept-value" in seen.live


# --- a replay stub's mapping --------------------------------------------------------------


async def test_a_replay_stub_returning_a_multidict_loses_no_value(tmp_path: Path) -> None:
    async with open_stores(f"sqlite:///{tmp_path / 'adk.sqlite3'}") as stores:
        await stores.create_schema()
        agent = _agent({"ok": 1})
        turns: list[Any] = [[("fetch", {"what": "x"})], "ok"]
        run = await AgentRunner.from_stores(Recording(turns), stores).run(
            agent, "go", tenant=T, run_id="orig"
        )
        assert run.status is RunStatus.completed
        [first, *_] = await stores.checkpoints.steps(T, "orig")
        headers = StarletteHeaders(
            raw=[(b"set-cookie", b"sid=first-cookie"), (b"set-cookie", b"lang=second-cookie")]
        )
        model = Recording(turns)
        replayed = await AgentRunner.from_stores(model, stores).replay(
            agent,
            "orig",
            tenant=T,
            from_step=first,
            stubs={"fetch": lambda what: headers},
            new_run_id="rep",
        )
        assert replayed.status is RunStatus.completed
    told = model.told()
    assert "first-cookie" in told and "second-cookie" in told, told
