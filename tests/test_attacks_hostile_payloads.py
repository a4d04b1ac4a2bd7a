"""Hostile tool results: Python types a user plausibly returns, results that stall the event
loop, and ``show``/``replay`` of runs that hold them.

Defects (strict xfails):

* A tool returning an int of more than 4,300 digits (``10**5000``): the call ran, then
  ``json.dumps`` in ``redact_outcome_content`` raises a bare ``ValueError`` (Python's
  int-to-string limit; ``default=str`` never sees it). The run dies with that untyped error,
  the call's claim stays ``in_flight``, and a resume refuses it as indeterminate: a call the
  kit watched return needs an operator. ``tesserix replay`` with a stub answering such an
  int prints ``ValueError`` (a Python internal).
* A tool returning bytes that are not UTF-8 (an image, a PDF) or a model holding such
  bytes: ``to_jsonable_python`` raises ``UnicodeDecodeError`` after the tool ran, and the
  model is told ``is_error`` "UnicodeDecodeError: ..." of a call that succeeded (a model
  then asks again: a second booking under a new key).
* A result dict with keys ``1`` and ``"1"``: one value silently replaced the other. Fixed:
  a key that is not text and clashes is written with its type (``invoking._unclashed``).
* A tool result of many small items (6M ints, ~12 MB): ``to_jsonable_python`` (invoking)
  and ``text_weight``'s ``str()`` (recording) ran on the event loop, so no renewal
  happened for about a second and the holder lost its lease, though a small result ran
  to the end under the same ``LeasePolicy``. Fixed: a result that is not plainly cheap is
  converted in a worker thread (``run/invoking.converted``), and ``text_weight`` stops
  counting once over the line past which the rest goes to a thread.

Held (plain tests): odd results (NaN, infinities, NUL, lone surrogates, big ints within
the limit, datetimes, Decimals, sets, tuples, dataclasses, pydantic models, str
subclasses) reach a resumed model exactly as the first process's model saw them (property
test); ``show --json`` of such runs is strict JSON and prints no secret hidden in a
dataclass, a pydantic model, an enum, bytes, a set or a dict key; ``show`` needs no agent
and changes nothing.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import enum
import json
import sqlite3
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

import booking
from hostile_results import Witness, run_under_short_lease
from tesserix_adk import (
    Agent,
    AgentRunner,
    Message,
    ModelRequest,
    ModelResponse,
    ProviderError,
    Role,
    RunStatus,
    ScriptedProvider,
    ToolCall,
    tool,
)
from tesserix_adk.cli import ExitCode
from tesserix_adk.cli.main import main
from tesserix_adk.stores.urls import open_stores

HERE = "test_attacks_hostile_payloads"
SECRET = "sk-proj-" + "Zx9Yw8Vu7Ts6Rq5Po4Nm" * 2
HUGE = 10**5000


def _plain(err: str) -> bool:
    internals = ("Error:", "Exception:", "Traceback")
    return (
        err.startswith("tesserix: ")
        and err.count("\n") == 1
        and not any(name in err for name in internals)
    )


async def _one_call(
    url: str, value: Any, *, side_effects: bool = True, run_id: str = "r"
) -> tuple[Any, list[str]]:
    """A run whose one tool call returns ``value``: (run or the exception, the sends)."""
    sent: list[str] = []

    @tool(side_effects=side_effects)
    def give(n: str) -> Any:
        """Give something back."""
        sent.append(n)
        return value

    async with open_stores(url) as stores:
        await stores.create_schema()
        runner = AgentRunner.from_stores(ScriptedProvider([[("give", {"n": "1"})], "ok"]), stores)
        try:
            run: Any = await runner.run(Agent("a", "x", [give]), "go", tenant="t", run_id=run_id)
        except Exception as exc:
            run = exc
    return run, sent


async def _records(url: str) -> list[Any]:
    async with open_stores(url) as stores:
        return list(await stores.idempotency.records("t", "r"))


async def _tool_messages(url: str) -> list[Message]:
    from tesserix_adk import Checkpointer

    async with open_stores(url) as stores:
        cps = Checkpointer(stores.checkpoints, history=stores.history)
        frontier = await cps.latest("t", "r")
        assert frontier is not None
        return [m for m in await cps.messages(frontier) if m.role is Role.tool]


# ==========================================================================================
# Defects
# ==========================================================================================


def test_a_tool_returning_a_huge_int_is_recorded_not_left_in_doubt(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'big.sqlite3'}"
    run, sent = asyncio.run(_one_call(url, HUGE))
    assert sent == ["1"]
    records = asyncio.run(_records(url))
    assert [r.status.value for r in records] == ["completed"], (run, records)
    assert not isinstance(run, Exception), repr(run)
    assert run.status is RunStatus.completed


def huge_booking(flight: str) -> dict[str, Any]:
    """A stub answering an int past Python's int-to-text limit."""
    return {"booking": HUGE, "flight": flight}


def test_cli_replay_with_a_stub_answering_a_huge_int_is_one_sentence(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"sqlite:///{tmp_path / 'adk.sqlite3'}"

    async def build() -> None:
        async with open_stores(url) as stores:
            await stores.create_schema()
            runner = AgentRunner.from_stores(ScriptedProvider(booking.BOOK_TURNS), stores)
            agent = booking.booking_agent(booking.Airline())
            await runner.run(agent, "book", tenant="t", run_id="r")

    asyncio.run(build())
    code = main(
        [
            "--store",
            url,
            "replay",
            "r",
            "--tenant",
            "t",
            "--from-step",
            "3",
            "--agent",
            f"{HERE}:AGENT",
            "--provider",
            "booking:provider",
            "--stub",
            f"book_seat={HERE}:huge_booking",
        ]
    )
    err = capsys.readouterr().err
    assert "ValueError" not in err, err
    assert code == ExitCode.CARRIED_ON or _plain(err), (code, err)


AGENT = booking.booking_agent(booking.Airline())


@dataclasses.dataclass
class Snapshot:
    """A screenshot tool's answer: a name and the PNG's bytes."""

    name: str
    png: bytes


@pytest.mark.parametrize(
    "value",
    [b"\x89PNG\r\n\x1a\n\x00\xff", Snapshot("shot", b"\xff\xd8\xff\xe0")],
    ids=["bytes", "dataclass-with-bytes"],
)
def test_a_tool_returning_binary_bytes_is_not_told_as_a_failure(tmp_path: Path, value: Any) -> None:
    url = f"sqlite:///{tmp_path / 'bin.sqlite3'}"
    run, sent = asyncio.run(_one_call(url, value))
    assert sent == ["1"] and run.status is RunStatus.completed
    [message] = asyncio.run(_tool_messages(url))
    assert not message.is_error, message.content


def test_a_result_with_colliding_keys_keeps_both_values(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'keys.sqlite3'}"
    run, _ = asyncio.run(_one_call(url, {1: "seat-one", "1": "seat-uno"}))
    assert run.status is RunStatus.completed
    [message] = asyncio.run(_tool_messages(url))
    assert "seat-one" in message.text and "seat-uno" in message.text, message.text


def _wide_and_deep(items: int) -> dict[str, Any]:
    deep: Any = 0
    for _ in range(70):  # past the nesting limit: replaced at once, off the loop
        deep = [deep]
    return {"many": [0] * items, "deep": deep}


def test_a_tool_result_is_converted_off_the_event_loop() -> None:
    seen: list[bool] = []
    run = asyncio.run(run_under_short_lease({"many": [Witness(seen)] * 3}))
    assert not isinstance(run, Exception) and run.status is RunStatus.completed, run
    assert seen and not any(seen), seen


def test_a_deep_result_under_a_short_lease_completes() -> None:
    run = asyncio.run(run_under_short_lease(_wide_and_deep(10)))
    assert not isinstance(run, Exception) and run.status is RunStatus.completed, run


# ==========================================================================================
# What held
# ==========================================================================================

_ODD = ["a", " ", "\x00", "\ud800", "\udfff", "é", "\u2028", '"', "\\", "{", "]", ":", "0"]
_text = st.lists(st.sampled_from(_ODD), max_size=8).map("".join)
_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**4000), max_value=10**4000),
    st.floats(allow_nan=True, allow_infinity=True),
    _text,
    st.datetimes(timezones=st.just(datetime.UTC)),
    st.decimals(allow_nan=False, places=3, min_value=-(10**6), max_value=10**6),
)
_values = st.recursive(
    _leaf,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.lists(inner, max_size=3).map(tuple),
        st.dictionaries(st.sampled_from(["k", "a b", "é", "\x00", "1"]), inner, max_size=3),
    ),
    max_leaves=12,
)


class _Crashing:
    """Asks for ``give`` once, then fails retryably (the process "dies" before the model
    hears the result); keeps the tool message it was shown."""

    def __init__(self, fail: bool) -> None:
        self.fail = fail
        self.shown: list[str] = []

    async def complete(self, request: ModelRequest) -> ModelResponse:
        asked = sum(1 for m in request.messages if m.role is Role.assistant)
        if asked == 0:
            call = ToolCall(id="c1", name="give", arguments={"n": "1"})
            return ModelResponse(message=Message(role="assistant", content="", tool_calls=[call]))
        self.shown += [m.text for m in request.messages if m.role is Role.tool]
        if self.fail:
            raise ProviderError("the process died here", retryable=True)
        return ModelResponse(message=Message(role="assistant", content="done"))


@settings(
    max_examples=25,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(value=_values)
def test_a_resumed_model_sees_the_odd_result_the_first_model_saw(value: Any) -> None:
    sent: list[str] = []

    @tool
    def give(n: str) -> Any:
        """Give something back."""
        sent.append(n)
        return value

    agent = Agent("a", "x", [give])

    async def go() -> tuple[list[str], list[str]]:
        async with open_stores("memory://") as stores:
            await stores.create_schema()
            first, second = _Crashing(fail=True), _Crashing(fail=False)
            with pytest.raises(ProviderError):
                await AgentRunner.from_stores(first, stores).run(
                    agent, "go", tenant="t", run_id="r"
                )
            run = await AgentRunner.from_stores(second, stores).resume(agent, "r", tenant="t")
            assert run.status is RunStatus.completed
            return first.shown, second.shown

    first, second = asyncio.run(go())
    assert sent == ["1"]
    assert first == second


class _Key(enum.Enum):
    API = SECRET


@dataclasses.dataclass
class Login:
    user: str
    password: str


class Session(BaseModel):
    token: str


_SECRETS = {
    "dict-key": {SECRET: 1},
    "enum": _Key.API,
    "dataclass": Login("ada", "hunter2-hunter2"),
    "pydantic": Session(token="tok-abcdefgh12345"),
    "bytes": b"Authorization: Bearer " + SECRET.encode(),
    "set": {SECRET},
    "exception": ValueError(f"refused {SECRET}"),
}


def test_show_of_odd_typed_secret_results_is_strict_json_and_masked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "odd.sqlite3"
    url = f"sqlite:///{path}"
    hidden = (SECRET, "hunter2-hunter2", "tok-abcdefgh12345")
    for name, value in _SECRETS.items():
        asyncio.run(_one_call(url, value, run_id=name))
    before = list(sqlite3.connect(path).iterdump())
    for name in _SECRETS:
        code = main(["--store", url, "show", name, "--tenant", "t", "--json"])
        out, err = capsys.readouterr()
        assert (code, err) == (ExitCode.CARRIED_ON, ""), (name, err)

        def refuse(constant: str) -> Any:
            raise AssertionError(f"not JSON: {constant}")

        shown = json.dumps(json.loads(out, parse_constant=refuse))
        assert not any(s in out or s in shown for s in hidden), (name, out)
    assert list(sqlite3.connect(path).iterdump()) == before
    assert not any(s.encode() in path.read_bytes() for s in hidden)
