"""The latest fixes, attacked as a user and as an attacker would meet them: 6933a0b (a
tool result mapping that is not a dict written as its items, ``run/invoking._unclashed``;
a renamed clashing key kept within 128 characters, ``_keys_apart``; two keys that mask alike
kept apart, ``checkpoint/redaction/redactor.Redactor._walk``), 57f2e98 (a pinned tool's
schema read-only all the way down, ``tool_schema.read_only``), 12fb39e (a cancelled sync
tool's result converted off the event loop, ``run/recording.returned_outcome``,
``run/dispatch._record_returned``) and 20f35fd/0b974bd (an ``Agent`` fixed once made,
``agent.Agent.__setattr__``/``__delattr__``, ``_Tools``).

Held:

* a pinned schema with ``$defs``/``anyOf`` goes out whole through both real SDKs
  (OpenAI and Anthropic, over the fake model server), equal to the schema before pinning;
  it writes as JSON (``json``, pydantic-core), pickles and copies equal, validates as a dict
  with pydantic and ``jsonschema``, goes into an MCP ``Tool``; one tool in two agents gives
  both the same revision, and a shallow ``dict()`` of it is a plain dict;
* an ``Agent`` copies and deep-copies with its revision, sits in a pydantic model
  (``model_copy(deep=True)`` too), is subclassed with attributes of the subclass's own;
  its tools compare and copy as a dict and refuse every change;
* a cancelled sync tool whose thread returned a large result has it converted in a worker
  thread (its objects' ``str`` never runs on the event loop), recorded completed and masked;
* ``httpx.Headers`` returned as they are: every secret header masked by its name in the
  store; two ``sk-proj-…`` keys keep both values.

Found, and fixed (their tests pass now):

* HIGH: the non-dict-mapping fix (6933a0b) reached only mappings in plain containers;
  ``httpx.Headers`` inside a dataclass (``return Reply(status, resp.headers)``) were still
  written as their ``str`` and, with a repeated ``Set-Cookie``, the session cookies were
  stored raw. pydantic now hands every mapping it cannot write to the kit, which writes it
  as its items (``run/invoking._unknown``).
* MEDIUM: a mapping whose items repeat a key (starlette's ``Headers``, ``QueryParams``,
  multidicts) lost every value of a repeated key but the last. Such a key now holds the
  list of its values (``_grouped``, through ``multi_items`` where a multidict has it).
* MEDIUM: a ``Mapping`` of one's own inside a dataclass was written as ``<… object at
  0x…>``: fixed with the HIGH.
* MEDIUM: a deep copy of a pinned schema was read-only too, so a provider of one's own
  that adapts its copy failed every call. A copy (``copy``, ``deepcopy``, ``pickle``) is a
  plain dict or list now (``tool_schema.read_only``).
* LOW: a key that already read as the mask was written over the masked key beside it
  (``Redactor._walk``): every key that meets one already written is now kept apart.
* The limit: fields the revision does not pin (``parallel_tool_calls``, ``max_iterations``,
  ``budget_micros``, ``state_schema``) were refused too. They can be set again; only what
  the revision pins (name, instructions, model, tools) is fixed.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import json
import pickle
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, ClassVar
from unittest import mock

import httpx
import jsonschema
import pytest
from pydantic import BaseModel, ConfigDict, TypeAdapter
from pydantic_core import to_json
from starlette.datastructures import Headers as StarletteHeaders
from starlette.datastructures import QueryParams

from operator_cli import sqlite_bytes
from providers.fake_server import ModelServer
from providers.vendors import VENDORS, Vendor
from tesserix_adk import (
    Agent,
    AgentRunner,
    Checkpointer,
    MemoryCheckpointStore,
    MemoryHistoryStore,
    MemoryIdempotencyStore,
    MemoryLedger,
    ModelRequest,
    ModelResponse,
    RunStatus,
    ScriptedProvider,
    tool,
)
from tesserix_adk.checkpoint.payload import decode_outcome
from tesserix_adk.checkpoint.redaction import Redactor
from tesserix_adk.run.invoking import result_content
from tesserix_adk.stores.protocols import RecordStatus
from tesserix_adk.stores.urls import open_stores

T = "late"


def secret(n: int) -> str:
    """A secret no pattern finds: only the name it sits under says it is one."""
    return f"hunter{n:02d}plain9f3q"


class Address(BaseModel):
    street: str
    zip: int | None = None


def _schema_tool() -> Any:
    """A fresh tool whose schema has ``$defs``, ``anyOf`` and nested lists."""

    @tool(side_effects=False)
    def ship(to: Address, via: list[Address] | None = None, note: str = "") -> str:
        """Ship a parcel."""
        return f"shipped to {to.street}"

    return ship


def _memory_runner(provider: Any) -> AgentRunner:
    return AgentRunner(
        provider,
        idempotency=MemoryIdempotencyStore(),
        checkpoints=Checkpointer(MemoryCheckpointStore(), history=MemoryHistoryStore()),
        ledger=MemoryLedger(),
    )


async def _recorded(stores: Any, run_id: str) -> Any:
    [rec] = list(await stores.idempotency.records(T, run_id))
    assert rec.status is RecordStatus.completed
    return decode_outcome(rec.outcome, "c").content


class Told:
    """A scripted model that keeps every request it was sent."""

    def __init__(self, turns: list[Any]) -> None:
        self.inner = ScriptedProvider(turns)
        self.requests: list[ModelRequest] = []

    async def complete(self, request: ModelRequest) -> ModelResponse:
        self.requests.append(request)
        response: ModelResponse = await self.inner.complete(request)
        return response

    def results(self) -> list[str]:
        return [m.text for m in self.requests[-1].messages if m.tool_call_id is not None]


async def _run_returning(tmp_path: Path, value: Any, run_id: str = "r") -> tuple[Told, Any]:
    """One run on SQLite whose one keyed call returns ``value``: the model, the record."""

    @tool(key=lambda **kw: f"fetch-{run_id}")
    def fetch(what: str) -> Any:
        """Fetch a thing (a side effect, keyed)."""
        return value

    model = Told([[("fetch", {"what": "x"})], "ok"])
    async with open_stores(f"sqlite:///{tmp_path / 'adk.sqlite3'}") as stores:
        await stores.create_schema()
        run = await AgentRunner.from_stores(model, stores).run(
            Agent("a", "x", [fetch]), "go", tenant=T, run_id=run_id
        )
        assert run.status is RunStatus.completed
        return model, await _recorded(stores, run_id)


# ==========================================================================================
# 57f2e98: a pinned schema, read-only all the way down
# ==========================================================================================


@pytest.mark.parametrize("vendor", VENDORS, ids=[v.name for v in VENDORS])
async def test_real_sdks_send_a_pinned_schema_with_defs_and_anyof_whole(
    vendor: Vendor, model_server: ModelServer
) -> None:
    ship = _schema_tool()
    before = json.loads(json.dumps(ship.parameters))
    agent = Agent("shipper", "Ship it.", [ship])
    assert type(ship.parameters) is not dict  # pinned
    model_server.queue(
        vendor.turn(calls=[("call_1", "ship", {"to": {"street": "Main 1"}})]),
        vendor.turn("Shipped."),
    )
    provider = vendor.provider(model_server)
    try:
        run = await _memory_runner(provider).run(agent, "ship", tenant=T, run_id="r")
    finally:
        await provider.aclose()
    assert run.status is RunStatus.completed and run.output == "Shipped."
    for body in model_server.bodies:
        [wire] = body["tools"]
        sent = wire["function"]["parameters"] if vendor.name == "openai" else wire["input_schema"]
        assert sent == before
    assert ship.parameters == before  # untouched by the SDKs


def test_a_pinned_schema_writes_copies_and_validates_as_a_dict() -> None:
    ship = _schema_tool()
    before = json.loads(json.dumps(ship.parameters))
    first = Agent("one", "x", [ship])
    second = Agent("one", "x", [ship])  # the same tool in another agent: pinned once
    assert first.revision == second.revision
    assert first.revision == Agent("one", "x", [_schema_tool()]).revision
    schema = ship.parameters
    assert json.loads(json.dumps(schema)) == before
    assert json.loads(to_json(schema)) == before
    for again in (pickle.loads(pickle.dumps(schema)), copy.copy(schema), copy.deepcopy(schema)):
        assert again == before
    assert TypeAdapter(dict[str, Any]).validate_python(schema) == before
    jsonschema.validate({"to": {"street": "Main 1"}, "via": None}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"to": {"street": 1}}, schema)
    import mcp.types as mcp_types

    listed = mcp_types.Tool(name="ship", input_schema=schema)
    assert json.loads(listed.model_dump_json())["input_schema"] == before
    # A shallow dict of it is the caller's own; the schema itself refuses every change.
    top = dict(schema)
    top["x-adapted"] = True
    assert "x-adapted" not in schema
    with pytest.raises(TypeError):
        schema["properties"]["note"]["default"] = "changed"  # type: ignore[index]
    with pytest.raises(TypeError):
        schema["required"].append("note")  # type: ignore[index]
    assert json.loads(json.dumps(schema)) == before


def _strict(schema: Any) -> None:
    """What an adapter for a strict vendor does to its own copy of a schema."""
    if isinstance(schema, dict):
        if schema.get("type") == "object":
            schema["additionalProperties"] = False
        schema.pop("title", None)
        for value in schema.values():
            _strict(value)
    elif isinstance(schema, list):
        for value in schema:
            _strict(value)


class StrictAdapter:
    """A provider of one's own that adapts each tool's schema on a deep copy of it."""

    def __init__(self) -> None:
        self.inner = ScriptedProvider(["done"])
        self.sent: list[Any] = []

    async def complete(self, request: ModelRequest) -> ModelResponse:
        for spec in request.tools:
            schema = copy.deepcopy(spec.parameters)
            _strict(schema)
            self.sent.append(schema)
        response: ModelResponse = await self.inner.complete(request)
        return response


async def test_a_provider_may_adapt_its_own_deep_copy_of_a_pinned_schema() -> None:
    provider = StrictAdapter()
    run = await _memory_runner(provider).run(
        Agent("shipper", "Ship it.", [_schema_tool()]), "ship", tenant=T, run_id="r"
    )
    assert run.status is RunStatus.completed
    [schema] = provider.sent
    assert schema["additionalProperties"] is False and "title" not in schema


# ==========================================================================================
# 20f35fd/0b974bd: an Agent fixed once made
# ==========================================================================================


class Settings(BaseModel):
    model_config = ConfigDict(arbitrary_types_allowed=True)
    agent: Agent
    region: str = "eu"


class Tagged(Agent):
    """A subclass with an attribute of its own."""

    def __init__(self, *args: Any, team: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.team = team


def test_an_agent_copies_subclasses_and_sits_in_a_pydantic_model() -> None:
    ship = _schema_tool()
    agent = Agent("shipper", "Ship it.", [ship], max_iterations=5, parallel_tool_calls=2)
    for again in (copy.copy(agent), copy.deepcopy(agent)):
        assert again.revision == agent.revision
        assert again.max_iterations == 5 and again.parallel_tool_calls == 2
        assert list(again.tools) == ["ship"]
        with pytest.raises(AttributeError):
            again.instructions = "changed"
    settings = Settings(agent=agent)
    deep = settings.model_copy(deep=True)
    assert deep.agent.revision == agent.revision
    tagged = Tagged("shipper", "Ship it.", [ship], team="ops")
    tagged.team = "sales"  # the subclass's own attribute is its business
    assert tagged.revision == agent.revision and tagged.team == "sales"
    # Its tools: a read-only mapping that compares and copies as a dict.
    assert agent.tools == {"ship": ship} and dict(agent.tools) == {"ship": ship}
    assert {**agent.tools} == {"ship": ship} and agent.tools.get("nope") is None
    with pytest.raises(TypeError):
        agent.tools["ship"] = ship  # type: ignore[index]
    with pytest.raises(AttributeError):
        del agent.tools
    with pytest.raises(AttributeError):
        ship.requires_approval = True
    # Remade with another limit from the same (pinned) tools: the same revision.
    assert Agent("shipper", "Ship it.", agent.tools.values(), max_iterations=9).revision == (
        agent.revision
    )


@pytest.fixture
def agent_for_tests() -> Iterator[Agent]:
    yield Agent("shipper", "Ship it.", [_schema_tool()])


def test_a_field_the_revision_does_not_pin_can_be_set(agent_for_tests: Agent) -> None:
    agent = agent_for_tests
    revision = agent.revision
    with mock.patch.object(agent, "max_iterations", 2):
        assert agent.max_iterations == 2
    agent.parallel_tool_calls = 4
    assert agent.revision == revision


# ==========================================================================================
# 12fb39e: a cancelled sync tool's result, converted off the event loop
# ==========================================================================================


class Odd:
    """An object a tool returns, written by its ``str``: says which thread wrote it."""

    threads: ClassVar[list[int]] = []

    def __str__(self) -> str:
        Odd.threads.append(threading.get_ident())
        return "odd-marker"


async def test_a_cancelled_sync_tools_result_is_converted_off_the_loop_and_recorded(
    tmp_path: Path,
) -> None:
    started, go = threading.Event(), threading.Event()
    Odd.threads = []

    @tool(key=lambda **kw: "slow-1")
    def slow(what: str) -> Any:
        """A slow sync side effect."""
        started.set()
        go.wait(10)
        return {"password": secret(1), "rows": [{"n": i, "odd": Odd()} for i in range(100)]}

    async with open_stores(f"sqlite:///{tmp_path / 'adk.sqlite3'}") as stores:
        await stores.create_schema()
        runner = AgentRunner.from_stores(
            ScriptedProvider([[("slow", {"what": "x"})], "ok"]), stores
        )
        task = asyncio.create_task(runner.run(Agent("a", "x", [slow]), "go", tenant=T, run_id="c"))
        try:
            assert await asyncio.to_thread(started.wait, 10)
            task.cancel()
            await asyncio.sleep(0.05)
            assert not task.done()  # waits for the thread: what it did is known
        finally:
            go.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        content = await _recorded(stores, "c")
    assert content["password"] != secret(1)
    assert content["rows"][99] == {"n": 99, "odd": "odd-marker"}
    assert len(Odd.threads) == 100
    assert threading.get_ident() not in Odd.threads  # never on the event loop's thread
    assert secret(1).encode() not in sqlite_bytes(tmp_path)


# ==========================================================================================
# 6933a0b: mappings that are not dicts, keys that mask alike
# ==========================================================================================


async def test_httpx_headers_returned_as_they_are_are_masked_by_name(tmp_path: Path) -> None:
    headers = httpx.Headers(
        [
            ("set-cookie", f"sessionid={secret(1)}; Path=/"),
            ("set-cookie", f"csrftoken={secret(2)}"),
            ("x-api-key", secret(3)),
            ("x-api-key", secret(4)),
            ("content-type", "application/json"),
        ]
    )
    _, record = await _run_returning(tmp_path, headers)
    assert record["content-type"] == "application/json"
    stored = sqlite_bytes(tmp_path)
    for n in range(1, 5):
        assert secret(n).encode() not in stored


@dataclasses.dataclass
class Reply:
    """What a tool of one's own returns for an HTTP call: status and headers."""

    status: int
    headers: Mapping[str, str]


async def test_headers_inside_a_dataclass_are_masked_by_name_in_the_store(
    tmp_path: Path,
) -> None:
    headers = httpx.Headers(
        [
            ("set-cookie", f"sessionid={secret(1)}; Path=/"),
            ("set-cookie", f"csrftoken={secret(2)}"),
        ]
    )
    await _run_returning(tmp_path, Reply(200, headers))
    stored = sqlite_bytes(tmp_path)
    assert secret(1).encode() not in stored and secret(2).encode() not in stored


class OwnMapping(Mapping[str, str]):
    """A mapping of one's own (a settings object, a row)."""

    def __init__(self, data: dict[str, str]) -> None:
        self._data = data

    def __getitem__(self, key: str) -> str:
        return self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)


async def test_a_mapping_of_ones_own_inside_a_dataclass_keeps_its_values(
    tmp_path: Path,
) -> None:
    model, record = await _run_returning(tmp_path, Reply(200, OwnMapping({"etag": "plain-7"})))
    assert "plain-7" in json.dumps(record)
    assert "plain-7" in model.results()[0]


async def test_a_mapping_that_repeats_a_key_loses_no_value(tmp_path: Path) -> None:
    headers = StarletteHeaders(
        raw=[(b"link", b"<https://a.example/p2>; rel=next"), (b"link", b"<https://a.example/p9>")]
    )
    assert "p2" in json.dumps(result_content(headers))
    assert "tag-a" in json.dumps(result_content(QueryParams("tag=tag-a&tag=tag-b")))
    model, record = await _run_returning(tmp_path, {"headers": headers})
    assert "p2" in json.dumps(record) and "p2" in model.results()[0]


def test_two_secret_keys_that_mask_alike_keep_both_values() -> None:
    first, second = "sk-proj-" + "A1b2C3d4" * 6, "sk-proj-" + "Z9y8X7w6" * 6
    masked = Redactor().value({first: "plain-1", second: "plain-2", "note": "plain-3"})
    assert sorted(masked.values()) == ["plain-1", "plain-2", "plain-3"]
    assert first not in json.dumps(masked) and second not in json.dumps(masked)


def test_a_key_reading_as_the_mask_does_not_overwrite_a_masked_key() -> None:
    key = "sk-proj-" + "A1b2C3d4" * 6
    redactor = Redactor()
    mask = redactor.text(key)
    assert mask != key
    masked = redactor.value({key: "plain-1", mask: "plain-2"})
    assert sorted(masked.values()) == ["plain-1", "plain-2"]
    twice = redactor.value(
        {key: "plain-1", "sk-proj-" + "Z9y8X7w6" * 6: "p-2", f"{mask} #2": "p-3"}
    )
    assert sorted(twice.values()) == ["p-2", "p-3", "plain-1"]
