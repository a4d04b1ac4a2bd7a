"""A frontier's observation names the transcript entries that hold the last turn's results
instead of copying them (issue 18: lean frontiers, content redacted once), and reads back
exactly what an inline copy would have, or refuses as corrupt."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tesserix_adk import Agent, AgentRunner, ScriptedProvider, ScriptedTurn, tool
from tesserix_adk.checkpoint.payload import (
    CHECKPOINT_FORMAT,
    NAMING_FORMAT,
    Boundary,
    Checkpoint,
    CheckpointStatus,
    decode_checkpoint,
    decode_message,
    encode_checkpoint,
    encode_message,
    resolve_observation,
    seal,
    unseal,
)
from tesserix_adk.checkpoint.payload.redacting import _redacted_observation
from tesserix_adk.checkpoint.redaction import Redactor
from tesserix_adk.errors import CheckpointCorruptError
from tesserix_adk.messages import Message, ToolCall, ToolOutcome
from tesserix_adk.stores.protocols import EMPTY_HISTORY_DIGEST, HistoryHandle, chained
from tesserix_adk.stores.urls import open_stores

SECRET = "sk-proj-" + "Q7w8E9r0" * 6
RESULT = "seat 12A is held until noon; fare class Y; " * 8


def _handle(entries: list[bytes]) -> HistoryHandle:
    return HistoryHandle(
        tenant="t", run_id="r", count=len(entries), digest=chained(EMPTY_HISTORY_DIGEST, entries)
    )


def _frontier(messages: list[Message], observation: Any) -> Checkpoint:
    return Checkpoint(
        tenant="t",
        run_id="r",
        agent_name="a",
        step=3,
        boundary=Boundary.after_tool_result,
        status=CheckpointStatus.running,
        iteration=1,
        fence=1,
        messages=tuple(messages),
        observation=observation,
    )


def _turn(content: str = RESULT, call_id: str = "c1", *, is_error: bool = False) -> list[Message]:
    return [
        Message.user("hold a seat"),
        Message.assistant("", [ToolCall(id=call_id, name="hold", arguments={"seat": "12A"})]),
        Message.tool_result(ToolOutcome(call_id=call_id, content=content, is_error=is_error)),
    ]


def _observed(call_id: str, content: Any, *, is_error: bool = False) -> dict[str, Any]:
    return {"call_id": call_id, "tool": "hold", "content": content, "is_error": is_error}


def _encoded(messages: list[Message], observation: Any) -> tuple[bytes, list[Message]]:
    """The frontier as the ``Checkpointer`` encodes it with a history store, and the
    transcript as a resume reads it back."""
    redactor = Redactor()
    entries = [encode_message(m, redactor) for m in messages]
    payload = encode_checkpoint(
        _frontier(messages, observation), redactor, history=_handle(entries)
    )
    return payload, [decode_message(e) for e in entries]


def _resealed(payload: bytes, change: Any) -> bytes:
    body, _ = unseal(payload, what="test")
    change(body)
    return seal(body)


# --- what is stored -----------------------------------------------------------------------


def test_a_text_result_is_named_by_its_transcript_position_not_copied() -> None:
    messages = _turn()
    payload, read = _encoded(messages, [_observed("c1", RESULT)])
    assert RESULT.encode() not in payload
    cp = decode_checkpoint(payload, tenant="t", run_id="r")
    assert cp.observation == [{"call_id": "c1", "tool": "hold", "is_error": False, "content_at": 2}]
    assert resolve_observation(cp.observation, read) == [_observed("c1", RESULT)]


def test_a_result_with_a_secret_reads_back_masked_as_its_transcript_entry_is() -> None:
    text = f"{RESULT} key {SECRET}"
    payload, read = _encoded(_turn(text), [_observed("c1", text)])
    assert SECRET.encode() not in payload
    (entry,) = resolve_observation(
        decode_checkpoint(payload, tenant="t", run_id="r").observation, read
    )
    assert SECRET not in entry["content"] and "[redacted:" in entry["content"]
    assert entry["content"] == read[2].content


def test_content_the_transcript_does_not_hold_word_for_word_stays_inline() -> None:
    # A structured result is JSON text in the transcript but data in the observation; an
    # error flag or a call id that differs means another result.
    messages = _turn(json.dumps({"held": True}, sort_keys=True))
    observation = [
        _observed("c1", {"held": True}),
        _observed("c1", RESULT),
        _observed("c9", json.dumps({"held": True}, sort_keys=True)),
        _observed("c1", json.dumps({"held": True}, sort_keys=True), is_error=True),
    ]
    payload, read = _encoded(messages, observation)
    cp = decode_checkpoint(payload, tenant="t", run_id="r")
    assert all("content_at" not in e for e in cp.observation)
    assert resolve_observation(cp.observation, read) == observation


def test_without_a_history_store_the_observation_stays_inline() -> None:
    messages = _turn()
    payload = encode_checkpoint(_frontier(messages, [_observed("c1", RESULT)]), Redactor())
    cp = decode_checkpoint(payload, tenant="t", run_id="r")
    assert cp.observation == [_observed("c1", RESULT)]


def test_a_frontier_that_names_entries_is_format_3_and_one_that_names_none_format_2() -> None:
    # A kit that reads only format 2 refuses the first (a typed error), and reads the second.
    named, _ = _encoded(_turn(), [_observed("c1", RESULT)])
    copied, _ = _encoded(_turn(), [_observed("c1", {"held": True})])
    assert decode_checkpoint(named, tenant="t", run_id="r").format == NAMING_FORMAT == 3
    assert decode_checkpoint(copied, tenant="t", run_id="r").format == CHECKPOINT_FORMAT == 2


def test_named_entries_in_a_format_2_frontier_are_corrupt() -> None:
    payload, _ = _encoded(_turn(), [_observed("c1", RESULT)])
    bad = _resealed(payload, lambda b: b.update(format=2))
    with pytest.raises(CheckpointCorruptError, match="format-2"):
        decode_checkpoint(bad, tenant="t", run_id="r")


# --- property: what reads back is what an inline copy reads back ------------------------

_TEXT = st.sampled_from(["", "ok", RESULT, f"token={SECRET}", '{"password": "hunter2"}'])
_CALL_IDS = st.sampled_from(["c0", "c1", "call_2", SECRET])  # a key-like id is masked


@st.composite
def _transcripts(draw: st.DrawFn) -> tuple[list[Message], Any, set[Any]]:
    """A transcript, an observation (entries of its last turn's results, of earlier
    turns', and others), and the last turn's results."""
    messages: list[Message] = [Message.user("go")]
    results: list[tuple[str, str, bool]] = []
    last: list[tuple[str, str, bool]] = []
    for _ in range(draw(st.integers(0, 4))):
        ids = draw(st.lists(_CALL_IDS, min_size=1, max_size=3))
        calls = [ToolCall(id=i, name="hold", arguments={"n": draw(_TEXT)}) for i in ids]
        messages.append(Message.assistant(draw(_TEXT), calls))
        last = []
        for i in ids:
            content, failed = draw(_TEXT), draw(st.booleans())
            messages.append(
                Message.tool_result(ToolOutcome(call_id=i, content=content, is_error=failed))
            )
            last.append((i, content, failed))
        results += last
    if draw(st.booleans()):  # the model's next message (after_model_call)
        messages.append(Message.assistant(draw(_TEXT), []))
    entry = st.builds(
        _observed,
        _CALL_IDS,
        _TEXT | st.dictionaries(st.sampled_from(["a", "password"]), _TEXT),
        is_error=st.booleans(),
    )
    if results:
        entry = entry | st.sampled_from(results).map(lambda r: _observed(r[0], r[1], is_error=r[2]))
    if last:
        entry = entry | st.sampled_from(last).map(lambda r: _observed(r[0], r[1], is_error=r[2]))
    observation = draw(st.none() | st.lists(entry, max_size=4) | _TEXT)
    return messages, observation, set(last)


@settings(max_examples=300, deadline=None)
@given(_transcripts())
def test_an_observation_reads_back_as_its_inline_copy_would(
    drawn: tuple[list[Message], Any, set[Any]],
) -> None:
    messages, observation, last = drawn
    payload, read = _encoded(messages, observation)
    cp = decode_checkpoint(payload, tenant="t", run_id="r")
    # The oracle: the observation redacted and written out whole, as before references.
    inline = json.loads(json.dumps(_redacted_observation(observation, Redactor())))
    assert resolve_observation(cp.observation, read) == inline
    if not isinstance(observation, list):
        return
    held = {(m.tool_call_id, m.content, m.is_error) for m in read if m.role == "tool"}
    for stored, entry, raw in zip(cp.observation, inline, observation, strict=True):
        text = entry["content"]
        masked = entry["call_id"] != raw["call_id"]
        if "content_at" in stored:  # named: the transcript holds it word for word
            assert isinstance(text, str) and (entry["call_id"], text, entry["is_error"]) in held
            assert "content" not in stored
        # The last turn's results are named, not copied (unless the id itself is masked).
        ours = isinstance(raw["content"], str) and (raw["call_id"], raw["content"], raw["is_error"])
        if ours in last and not masked:
            assert "content_at" in stored


# --- what refuses -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "at",
    [3, -1, True, "2", 2.0, None],
    ids=["past-end", "negative", "bool", "str", "float", "null"],
)
def test_a_position_the_transcript_cannot_hold_is_corrupt(at: Any) -> None:
    payload, _ = _encoded(_turn(), [_observed("c1", RESULT)])
    bad = _resealed(payload, lambda b: b["observation"][0].update(content_at=at))
    with pytest.raises(CheckpointCorruptError, match="observation"):
        decode_checkpoint(bad, tenant="t", run_id="r")


def test_an_entry_with_both_its_content_and_a_position_is_corrupt() -> None:
    payload, _ = _encoded(_turn(), [_observed("c1", RESULT)])
    bad = _resealed(payload, lambda b: b["observation"][0].update(content="other"))
    with pytest.raises(CheckpointCorruptError, match="observation"):
        decode_checkpoint(bad, tenant="t", run_id="r")


def test_a_position_in_a_frontier_without_a_history_is_corrupt() -> None:
    payload, _ = _encoded(_turn(), [_observed("c1", RESULT)])

    def inline(body: dict[str, Any]) -> None:
        body["history"] = None
        body["messages"] = []

    with pytest.raises(CheckpointCorruptError, match="observation"):
        decode_checkpoint(_resealed(payload, inline), tenant="t", run_id="r")


@pytest.mark.parametrize(
    ("at", "change"),
    [
        (1, {}),  # the assistant message, not a result
        (0, {}),  # the user's message
        (2, {"call_id": "c2"}),  # another call's result
        (2, {"is_error": True}),  # the result with the other flag
    ],
    ids=["assistant", "user", "other-call", "other-flag"],
)
def test_a_position_that_is_not_that_calls_result_is_corrupt(
    at: int, change: dict[str, Any]
) -> None:
    payload, read = _encoded(_turn(), [_observed("c1", RESULT)])
    bad = _resealed(payload, lambda b: b["observation"][0].update(content_at=at, **change))
    cp = decode_checkpoint(bad, tenant="t", run_id="r")
    with pytest.raises(CheckpointCorruptError, match="observation"):
        resolve_observation(cp.observation, read)


def test_resolving_against_a_transcript_shorter_than_the_position_is_corrupt() -> None:
    payload, read = _encoded(_turn(), [_observed("c1", RESULT)])
    cp = decode_checkpoint(payload, tenant="t", run_id="r")
    with pytest.raises(CheckpointCorruptError, match="observation"):
        resolve_observation(cp.observation, read[:2])


# --- end to end ---------------------------------------------------------------------------


@tool
def hold(seat: str) -> str:
    """Hold a seat (side-effecting)."""
    return f"{RESULT}{seat}"


def _steps(path: Path) -> list[bytes]:
    with sqlite3.connect(path) as db:
        return [bytes(p) for (p,) in db.execute("SELECT payload FROM adk_checkpoint_steps")]


async def test_a_run_stores_each_result_once_in_its_transcript_and_reads_it_back(
    tmp_path: Path,
) -> None:
    path = tmp_path / "adk.sqlite3"
    stores = open_stores(f"sqlite:///{path}")
    await stores.create_schema()
    script: list[Any] = [
        ScriptedTurn(calls=[("hold", {"seat": "12A"})]),
        ScriptedTurn(calls=[("hold", {"seat": "12B"})]),
        "done",
    ]
    try:
        runner = AgentRunner.from_stores(ScriptedProvider(script), stores)
        run = await runner.run(Agent("a", "x", tools=[hold]), "go", tenant="t", run_id="r")
        assert run.status == "completed"
        checkpoints = runner.checkpoints
        assert checkpoints is not None
        seen = []
        for step in await checkpoints.steps("t", "r"):
            snap = await checkpoints.at("t", "r", step)
            assert snap is not None
            seen.append(await checkpoints.observation(snap))
        assert [
            {"call_id": "call_0_0", "tool": "hold", "content": f"{RESULT}12A", "is_error": False}
        ] in seen
        assert [
            {"call_id": "call_1_0", "tool": "hold", "content": f"{RESULT}12B", "is_error": False}
        ] in seen
    finally:
        await stores.aclose()
    assert not any(RESULT.encode() in p for p in _steps(path))


async def test_a_resumed_run_carries_the_observation_it_read_on(tmp_path: Path) -> None:
    path = tmp_path / "adk.sqlite3"

    class Died(BaseException):
        pass

    class DiesOnce(ScriptedProvider):
        async def complete(self, request: Any) -> Any:
            if len(request.messages) == 3 and not getattr(self, "died", False):
                self.died = True
                raise Died
            return await super().complete(request)

    agent = Agent("a", "x", tools=[hold])
    stores = open_stores(f"sqlite:///{path}")
    await stores.create_schema()
    try:
        first = AgentRunner.from_stores(
            DiesOnce([ScriptedTurn(calls=[("hold", {"seat": "12A"})])]), stores
        )
        with pytest.raises(Died):
            await first.run(agent, "go", tenant="t", run_id="r")
        # The script is read by the assistant messages a request holds: the first is done.
        script: list[Any] = [
            ScriptedTurn(calls=[("hold", {"seat": "12A"})]),
            ScriptedTurn(calls=[("hold", {"seat": "12B"})]),
            "done",
        ]
        second = AgentRunner.from_stores(ScriptedProvider(script), stores)
        assert (await second.resume(agent, "r", tenant="t")).status == "completed"
        checkpoints = second.checkpoints
        assert checkpoints is not None
        # The resumed run's first frontier (after its model call) observes the turn before
        # the crash, read back from the frontier it resumed.
        snaps = [await checkpoints.at("t", "r", s) for s in await checkpoints.steps("t", "r")]
        asked = [s for s in snaps if s is not None and s.outstanding and s.iteration == 1]
        assert len(asked) == 1
        assert await checkpoints.observation(asked[0]) == [
            {"call_id": "call_0_0", "tool": "hold", "content": f"{RESULT}12A", "is_error": False}
        ]
    finally:
        await stores.aclose()
    assert not any(RESULT.encode() in p for p in _steps(path))
