"""The night's fixes, attacked: a result converted in a worker thread recorded when the run
is cancelled meanwhile, and a result far past the record's cap replaced unscanned (c747fd5,
``run/invoking.converted``, ``run/dispatch`` on ``ThreadReturned``,
``checkpoint/payload/outcomes._least_bytes``); a result dict whose keys JSON writes alike
written as ``[key, value]`` pairs (aa282a1, ``run/invoking._unclashed``); an ``Agent`` fixed
once made and a ``Tool`` once an agent holds it (20f35fd, ``agent.py``, ``tools.py``).

Attacked: a parallel turn on SQLite cancelled while one call's result (holding a secret
under ``password``) is converted; a cancelled conversion of a clashing dict against the
record an uninterrupted run writes; results just under and far over the unscanned line,
with a secret, and ``_least_bytes`` against the real size of texts, str subclasses, bytes,
nested tuples and non-str keys; clashing dicts holding a ``password`` key, bytes that are
not UTF-8, a cycle, or sitting inside a dataclass or a pydantic model, and ``show --json``
of such a run; an agent's ``tools`` mapping and a tool's ``parameters`` changed in place,
a field deleted and set again, copies, subclasses, a tool shared by two agents, fields set
before a tool is handed to an agent.

Held: a run cancelled while a parallel turn's result is converted records that call
completed on SQLite (its secret masked), and a resume sends nothing again; an unkeyed
read cancelled so is sent again on resume, the lease given back; a cancelled
conversion records what an uninterrupted run records; results just under and over the
unscanned line (and over a small ``max_bytes``) keep no secret; ``_least_bytes`` never
counts more than the JSON written; a clashing dict in a cycle completes; ``show --json``
of a run whose result became pairs works; an agent's ``tools`` cannot be swapped, added
to or removed from in place (a plain dict at 20f35fd, which let the revision go stale; made
a read-only mapping in the working tree while this attack ran); copies keep the revision,
a tool may be held by two agents, a tool's fields may be set until an agent holds it, and
a subclass's own attributes stay its business.

Found, and fixed (their tests pass now):

* HIGH: a result dict whose keys clash (``1`` and ``"1"``) and that holds a ``password``
  key was written as ``[key, value]`` pairs (``run/invoking._unclashed``), and the redactor
  masks by key only in mappings: the password's value was stored raw (found in the SQLite
  store's bytes). Such a dict stays a dict now: text keys as they are, each other clashing
  key written with its type (``"(int) 1"``).
* MEDIUM: a clashing dict that pydantic cannot write as it came (a bytes value that is not
  UTF-8) went to ``run/invoking._written_otherwise`` with the original result: one of the
  clashing values was lost. It is handed the unclashed one now.
* LOW: ``del agent.model`` then setting it passed ``Agent.__setattr__``; the same for a
  pinned tool. Both refuse a delete now.
* LOW: a tool's ``parameters`` (its schema, what the model is told) changed in place kept
  the agent's revision. Pinned, the schema is read-only all the way down now
  (``tool_schema.read_only``).

Found, and fixed later (LOW):

* a clashing dict inside a dataclass or a pydantic model was not walked (``_unclashed``
  looked in plain containers only): a value was lost. A plain dataclass is walked now
  (``run/result_data._unclashed``); a model writes itself, its case left (strict xfail).
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import json
import threading
from pathlib import Path
from typing import Any

import pydantic
import pytest

from operator_cli import cli
from tesserix_adk import Agent, AgentRunner, RunStatus, ScriptedProvider, Tool, tool
from tesserix_adk.checkpoint.payload import decode_outcome, recorded_outcome
from tesserix_adk.checkpoint.payload.outcomes import _least_bytes
from tesserix_adk.checkpoint.redaction import Redactor
from tesserix_adk.messages import ToolOutcome
from tesserix_adk.run.invoking import result_content
from tesserix_adk.stores.protocols import RecordStatus
from tesserix_adk.stores.urls import open_stores

T = "t"
SECRET = "hunter2-plain-9f3q"  # no pattern finds it: only its key says it is a secret


def _stored_bytes(tmp_path: Path) -> bytes:
    """Everything the SQLite store wrote (its file and its WAL)."""
    return b"".join(p.read_bytes() for p in sorted(tmp_path.glob("adk.sqlite3*")))


async def _run_once(tmp_path: Path, value: Any) -> tuple[str, Any]:
    """A run on SQLite whose one keyed call returns ``value``; its URL and run."""
    url = f"sqlite:///{tmp_path / 'adk.sqlite3'}"

    @tool(key=lambda **kw: "order-1")
    def book(seat: str) -> Any:
        """Book a seat."""
        return value

    async with open_stores(url) as stores:
        await stores.create_schema()
        runner = AgentRunner.from_stores(
            ScriptedProvider([[("book", {"seat": "1A"})], "ok"]), stores
        )
        run = await runner.run(Agent("a", "x", [book]), "go", tenant=T, run_id="r")
    return url, run


class _Slow:
    """A value pydantic cannot write; its ``str`` (the fallback) waits on ``gate``."""

    def __init__(self, entered: threading.Event, gate: threading.Event) -> None:
        self.entered, self.gate = entered, gate

    def __str__(self) -> str:
        self.entered.set()
        self.gate.wait(10)
        return "receipt-1"


# ==========================================================================================
# c747fd5 (a): cancelled while a result is converted
# ==========================================================================================


async def test_a_parallel_turn_cancelled_in_a_conversion_records_it_masked_on_sqlite(
    tmp_path: Path,
) -> None:
    sent: list[str] = []
    entered, gate = threading.Event(), threading.Event()

    @tool(key=lambda **kw: "order-1")
    def book(seat: str) -> Any:
        """Book a seat (a side effect)."""
        sent.append(f"book {seat}")
        return {"password": SECRET, "receipt": _Slow(entered, gate)}

    @tool(key=lambda **kw: "note-1")
    def note(text: str) -> str:
        """Write a note (a side effect)."""
        sent.append(f"note {text}")
        return "noted"

    agent = Agent("a", "x", [book, note], parallel_tool_calls=2)
    script = [[("book", {"seat": "1A"}), ("note", {"text": "hi"})], "ok"]
    url = f"sqlite:///{tmp_path / 'adk.sqlite3'}"
    try:
        async with open_stores(url) as stores:
            await stores.create_schema()
            first = AgentRunner.from_stores(ScriptedProvider(script), stores)
            task = asyncio.ensure_future(first.run(agent, "go", tenant=T, run_id="r"))
            assert await asyncio.to_thread(entered.wait, 10)
            asyncio.get_running_loop().call_later(0.2, gate.set)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            gate.set()
            recs = {r.key: r for r in await stores.idempotency.records(T, "r")}
            booked = [r for k, r in recs.items() if k.endswith("order-1")]
            assert [r.status for r in booked] == [RecordStatus.completed]
            again = AgentRunner.from_stores(ScriptedProvider(script), stores)
            run = await again.resume(agent, "r", tenant=T)
    finally:
        gate.set()
    assert run.status is RunStatus.completed
    assert sorted(sent) == ["book 1A", "note hi"]
    assert SECRET.encode() not in _stored_bytes(tmp_path)


async def test_a_clashing_result_cancelled_in_conversion_is_recorded_as_a_live_one(
    tmp_path: Path,
) -> None:
    """The content a cancelled conversion hands over is converted again
    (``recording.returned_outcome``): it must come out as an uninterrupted run's."""
    entered, gate = threading.Event(), threading.Event()

    def value() -> Any:
        return {1: "a", "1": "b", "r": [_Slow(entered, gate), b"\xff\xfe", 2**70]}

    @tool(key=lambda **kw: "order-1")
    def book(seat: str) -> Any:
        """Book a seat (a side effect)."""
        return value()

    agent = Agent("a", "x", [book])
    script = [[("book", {"seat": "1A"})], "ok"]
    gate.set()
    live = result_content(value())
    gate.clear()
    entered.clear()
    try:
        async with open_stores("memory://") as stores:
            await stores.create_schema()
            first = AgentRunner.from_stores(ScriptedProvider(script), stores)
            task = asyncio.ensure_future(first.run(agent, "go", tenant=T, run_id="r"))
            assert await asyncio.to_thread(entered.wait, 10)
            asyncio.get_running_loop().call_later(0.2, gate.set)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            gate.set()
            [rec] = await stores.idempotency.records(T, "r")
            assert rec.status is RecordStatus.completed and rec.outcome is not None
            kept = decode_outcome(rec.outcome, "c")
            again = AgentRunner.from_stores(ScriptedProvider(script), stores)
            run = await again.resume(agent, "r", tenant=T)
    finally:
        gate.set()
    assert run.status is RunStatus.completed
    expected = recorded_outcome(ToolOutcome(call_id="c", content=live), Redactor()).outcome
    assert (kept.content, kept.is_error) == (expected.content, expected.is_error)


async def test_an_unkeyed_read_cancelled_in_its_conversion_is_sent_again_on_resume() -> None:
    """No record to keep it in: the resume sends the read again (safe: no side effects),
    and the lease goes back."""
    sent: list[str] = []
    entered, gate = threading.Event(), threading.Event()

    @tool(side_effects=False, key=None)
    def look(seat: str) -> Any:
        """Look at a seat."""
        sent.append(seat)
        return {"seat": _Slow(entered, gate)}

    agent = Agent("a", "x", [look])
    script = [[("look", {"seat": "1A"})], "ok"]
    try:
        async with open_stores("memory://") as stores:
            await stores.create_schema()
            first = AgentRunner.from_stores(ScriptedProvider(script), stores)
            task = asyncio.ensure_future(first.run(agent, "go", tenant=T, run_id="r"))
            assert await asyncio.to_thread(entered.wait, 10)
            asyncio.get_running_loop().call_later(0.2, gate.set)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert await stores.leases.current(T, "r") is None
            again = AgentRunner.from_stores(ScriptedProvider(script), stores)
            run = await again.resume(agent, "r", tenant=T)
    finally:
        gate.set()
    assert run.status is RunStatus.completed
    assert sent == ["1A", "1A"]


# ==========================================================================================
# c747fd5 (b): replaced unscanned past max(2 x cap, 1 MiB)
# ==========================================================================================


@pytest.mark.parametrize(
    ("max_bytes", "pad"),
    [
        (1_000_000, 2 * 1024 * 1024 - 200),  # just under the unscanned line: scanned
        (1_000_000, 2 * 1024 * 1024 + 200),  # just over it: replaced unscanned
        (1_000, 5_000),  # a small cap: scanned (the line is 1 MiB), then replaced
        (100_000, 90_000),  # under a cap of its own: kept, masked
    ],
)
def test_no_secret_is_kept_either_side_of_the_unscanned_line(max_bytes: int, pad: int) -> None:
    content = {"password": SECRET, "pad": "x" * pad, "token": f"sk-{'a1' * 24}"}
    for given in (content, json.dumps(content)):
        kept = recorded_outcome(
            ToolOutcome(call_id="c", content=given), Redactor(), max_bytes=max_bytes
        )
        assert SECRET.encode() not in kept.payload
        assert b"a1a1a1a1a1a1" not in kept.payload
        assert SECRET not in str(kept.outcome.content)


class _Shout(str):
    pass


@pytest.mark.parametrize(
    "value",
    [
        "é" * 10,
        _Shout("abc"),
        [("x", ("y", 1)), {"k": (1, 2.5, None)}],
        {1: "a", None: "b", 2.5: "c", False: "d", (1, "x"): "e"},
        {"k": b"\xff" * 3, "n": 10**20},
        [[[[[]]]], {}, ""],
        '\x00\x1f"\\',
    ],
)
def test_the_least_bytes_never_counts_more_than_is_written(value: Any) -> None:
    """A bound over the real size would replace a result that fits."""
    written = json.dumps(result_content(value), ensure_ascii=False, default=str)
    assert _least_bytes(value, past=10**9) <= len(written.encode("utf-8"))


# ==========================================================================================
# aa282a1: clashing keys written as [key, value] pairs
# ==========================================================================================


async def test_a_password_in_a_clashing_dict_is_not_stored_raw(tmp_path: Path) -> None:
    _, run = await _run_once(tmp_path, {"password": SECRET, 1: "a", "1": "b"})
    assert run.status is RunStatus.completed
    assert SECRET.encode() not in _stored_bytes(tmp_path)


async def test_a_password_in_a_plain_dict_is_not_stored_raw(tmp_path: Path) -> None:
    """The control: the same dict without clashing keys is masked."""
    _, run = await _run_once(tmp_path, {"password": SECRET, 1: "a"})
    assert run.status is RunStatus.completed
    assert SECRET.encode() not in _stored_bytes(tmp_path)


@pytest.mark.parametrize(
    ("value", "each"),
    [
        ({1: b"\xff", "1": "kept-b"}, ["/w==", "kept-b"]),
        ({1: "kept-a", "1": "kept-b", "img": b"\xff\xfe"}, ["kept-a", "kept-b", "//4="]),
    ],
    ids=["bytes-under-the-key", "bytes-beside"],
)
def test_a_clashing_dict_with_bytes_not_utf8_loses_no_value(
    value: dict[Any, Any], each: list[str]
) -> None:
    written = json.dumps(result_content(value), default=str)
    for v in each:
        assert v in written, written


@dataclasses.dataclass
class _Held:
    m: dict[Any, Any]


class _Model(pydantic.BaseModel):
    m: dict[Any, Any]


@pytest.mark.parametrize(
    "holder",
    [
        _Held,
        pytest.param(
            _Model,
            marks=pytest.mark.xfail(
                strict=True,
                reason="DEFECT MEDIUM (left): a pydantic model is written as it writes itself "
                "(its JSON-only masks, aliases, settings; walking it stored masked values "
                "raw): a clash inside loses a value",
            ),
        ),
    ],
    ids=["dataclass", "pydantic"],
)
def test_a_clashing_dict_inside_an_object_loses_no_value(holder: Any) -> None:
    written = json.dumps(result_content(holder(m={1: "kept-a", "1": "kept-b"})), default=str)
    assert "kept-a" in written and "kept-b" in written


def test_a_clashing_dict_in_a_cycle_is_written_and_keeps_its_values() -> None:
    value: dict[Any, Any] = {1: "kept-a", "1": "kept-b"}
    value[2] = value
    written = json.dumps(result_content(value), default=str)
    assert "kept-a" in written and "kept-b" in written


async def test_show_json_of_a_run_whose_result_had_clashing_keys(tmp_path: Path) -> None:
    url, run = await _run_once(tmp_path, {1: "kept-a", "1": "kept-b", "x": [1, {2: 3}]})
    assert run.status is RunStatus.completed
    code, out, err = await asyncio.to_thread(
        cli, "show", "r", "--tenant", T, "--store", url, "--json"
    )
    assert code == 0, err
    assert "kept-a" in out and "kept-b" in out
    json.loads(out)


# ==========================================================================================
# 20f35fd: an Agent fixed once made, a Tool once an agent holds it
# ==========================================================================================


def _book(seat: str) -> str:
    """Book a seat."""
    return seat


@pytest.mark.parametrize("how", ["swap", "add", "remove"])
def test_an_agents_tools_changed_in_place_do_not_keep_the_old_revision(how: str) -> None:
    booking = Tool(_book, name="book")
    agent = Agent("a", "x", [booking])
    looking = Tool(_book, name="book", side_effects=False)
    extra = Tool(_book, name="extra")
    tools = agent.tools
    try:
        if how == "swap":
            tools["book"] = looking  # type: ignore[index]
        elif how == "add":
            tools["extra"] = extra  # type: ignore[index]
        else:
            del tools["book"]  # type: ignore[attr-defined]
    except (TypeError, AttributeError):
        return  # refused: fixed
    now = Agent("a", "x", list(agent.tools.values()))
    assert agent.revision == now.revision


def test_a_tools_parameters_changed_in_place_do_not_keep_the_old_revision() -> None:
    booking = Tool(_book, name="book")
    agent = Agent("a", "x", [booking])
    try:
        booking.parameters["properties"]["seat"]["type"] = "integer"  # type: ignore[index]
    except TypeError:
        return  # refused: fixed
    assert agent.revision == Agent("a", "x", [booking]).revision


@pytest.mark.parametrize("target", ["agent", "tool"])
def test_a_field_deleted_then_set_is_refused(target: str) -> None:
    booking = Tool(_book, name="book")
    agent = Agent("a", "x", [booking], model="openai:gpt-4o")
    obj: Any = agent if target == "agent" else booking
    field = "model" if target == "agent" else "side_effects"
    with pytest.raises(AttributeError):
        delattr(obj, field)
        setattr(obj, field, "anthropic:claude" if target == "agent" else False)


def test_setting_fields_is_refused_once_pinned_and_allowed_before() -> None:
    booking = Tool(_book, name="book")
    booking.description = "Book one seat."  # not held yet: the user's to set
    booking.requires_approval = True
    agent = Agent("a", "x", [booking])
    for obj, field, new in [
        (agent, "instructions", "y"),
        (agent, "tools", {}),
        (agent, "revision", "sha256:0"),
        (booking, "description", "z"),
        (booking, "key", None),
        (booking, "parameters", {}),
    ]:
        with pytest.raises(AttributeError):
            setattr(obj, field, new)
    assert agent.revision == Agent("a", "x", [booking]).revision
    assert agent.tools["book"].description == "Book one seat."


def test_copies_keep_the_revision_and_a_tool_serves_two_agents() -> None:
    booking = Tool(_book, name="book")
    agent = Agent("a", "x", [booking])
    other = Agent("b", "y", [booking])
    assert other.tools["book"] is booking
    for made in (copy.copy(agent), copy.deepcopy(agent)):
        assert made.revision == agent.revision
        assert made.tools.keys() == agent.tools.keys()
        with pytest.raises(AttributeError):
            made.instructions = "changed"


def test_a_subclass_keeps_its_own_attributes() -> None:
    class Named(Agent):
        __slots__ = ("team",)

    class Loose(Agent):
        pass

    named = Named("a", "x", [Tool(_book, name="book")])
    named.team = "ops"
    named.team = "sales"
    loose = Loose("a", "x", [])
    loose.note = "anything"  # type: ignore[attr-defined]
    with pytest.raises(AttributeError):
        named.instructions = "y"
    with pytest.raises(AttributeError):
        loose.model = "openai:gpt-4o"
    assert named.team == "sales"
