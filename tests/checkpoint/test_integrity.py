"""Integrity: every payload the kit encodes is checksummed, every decode failure is typed.

Frontiers (and step snapshots, the same codec), transcript entries and recorded outcomes
are checked at every byte position of a real payload; deep nesting, wrong field types and
oversized outcomes fail closed with typed errors; one outcome codec redacts the transcript,
the observation and the recorded outcome alike.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from booking import BOOK_TURNS, Airline, booking_agent
from tesserix_adk import (
    Agent,
    AgentRunner,
    CheckpointCorruptError,
    Checkpointer,
    CheckpointError,
    CheckpointTooLargeError,
    HistoryUnavailableError,
    MemoryCheckpointStore,
    MemoryHistoryStore,
    MemoryIdempotencyStore,
    Message,
    ScriptedProvider,
    ToolCall,
    ToolOutcome,
    tool,
)
from tesserix_adk.checkpoint.payload import (
    CHECKPOINT_FORMAT,
    DEFAULT_MAX_BYTES,
    MAX_NESTING,
    Boundary,
    Checkpoint,
    CheckpointStatus,
    OutstandingCall,
    decode_checkpoint,
    decode_message,
    decode_outcome,
    encode_checkpoint,
    encode_message,
    encode_outcome,
    recorded_outcome,
    redact_outcome_content,
)
from tesserix_adk.checkpoint.redaction import Redactor
from tesserix_adk.stores.protocols import HistoryHandle
from tesserix_adk.testing.corruption import (
    CorruptionConformance,
    byte_flips,
    nested,
    nested_json,
    resealed,
    resealed_with,
    truncations,
)
from tesserix_adk.testing.faults import FaultyCheckpointStore, SimulatedCrash

GOLDEN = Path(__file__).parent / "golden"
LONG = os.environ.get("ADK_LONG") == "1"
FUZZ = settings(
    max_examples=5000 if LONG else 200,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


async def _interrupted(airline: Airline, *, history: bool = True) -> tuple[Checkpointer, Any]:
    """A booking run that died right after the model asked for book_seat."""
    store = MemoryCheckpointStore()
    hist = MemoryHistoryStore() if history else None
    idem = MemoryIdempotencyStore()
    faulty = FaultyCheckpointStore(
        store,
        crash_after=lambda b: b["boundary"] == "after_model_call" and b["iteration"] == 1,
    )
    runner = AgentRunner(
        ScriptedProvider(BOOK_TURNS),
        idempotency=idem,
        checkpoints=Checkpointer(faulty, history=hist),
    )
    with pytest.raises(SimulatedCrash):
        await runner.run(booking_agent(airline), "book", tenant="acme", run_id="r")
    return Checkpointer(store, history=hist), idem


async def _frontier_payload(airline: Airline, *, history: bool = True) -> bytes:
    checkpointer, _ = await _interrupted(airline, history=history)
    stored = await checkpointer.store.latest("acme", "r")
    assert stored is not None
    cp = decode_checkpoint(stored.payload, tenant="acme", run_id="r")
    assert [o.call.name for o in cp.outstanding] == ["book_seat"]
    return stored.payload


def _outcome_payload() -> bytes:
    outcome = ToolOutcome(call_id="call_1_0", content={"booking": "B1", "flight": "LH123"})
    return encode_outcome(outcome, Redactor())


def _entry_payload() -> bytes:
    message = Message.assistant(
        "Booking.", [ToolCall(id="call_1_0", name="book_seat", arguments={"flight": "LH123"})]
    )
    return encode_message(message, Redactor())


def _every_read_fails(
    payloads: list[bytes], read: Callable[[bytes], Any], error: type[Exception]
) -> list[tuple[int, Any]]:
    """The payloads that did not fail with exactly ``error``, and what reading gave."""
    wrong: list[tuple[int, Any]] = []
    for i, bad in enumerate(payloads):
        try:
            got = read(bad)
        except error:
            continue
        except Exception as exc:
            wrong.append((i, repr(exc)))
            continue
        wrong.append((i, got))
    return wrong


# --- every byte ---------------------------------------------------------------------------


async def test_every_byte_change_of_a_frontier_with_outstanding_calls_is_corrupt(
    airline: Airline,
) -> None:
    payload = await _frontier_payload(airline)
    flips = [bad for _, bad in byte_flips(payload)]
    assert len(flips) >= len(payload)
    wrong = _every_read_fails(
        flips,
        lambda p: decode_checkpoint(p, tenant="acme", run_id="r"),
        CheckpointCorruptError,
    )
    assert wrong == []


async def test_every_byte_change_of_an_inline_frontier_is_corrupt(airline: Airline) -> None:
    payload = await _frontier_payload(airline, history=False)
    wrong = _every_read_fails(
        [bad for _, bad in byte_flips(payload)],
        lambda p: decode_checkpoint(p, tenant="acme", run_id="r"),
        CheckpointCorruptError,
    )
    assert wrong == []


def test_every_byte_change_of_a_recorded_outcome_is_corrupt() -> None:
    payload = _outcome_payload()
    wrong = _every_read_fails(
        [bad for _, bad in byte_flips(payload)],
        lambda p: decode_outcome(p, "call_1_0"),
        CheckpointCorruptError,
    )
    assert wrong == []


def test_every_byte_change_of_a_transcript_entry_is_corrupt() -> None:
    payload = _entry_payload()
    wrong = _every_read_fails(
        [bad for _, bad in byte_flips(payload)], decode_message, CheckpointCorruptError
    )
    assert wrong == []


async def test_every_byte_change_of_a_stored_transcript_entry_is_corrupt_on_read(
    airline: Airline,
) -> None:
    """The history store keeps what it is given and answers a handle naming those bytes, so
    the chained digest cannot see damage done before the append (or by a store that
    re-digests); the entry's own checksum does, and says corrupt rather than unavailable."""
    checkpointer, _ = await _interrupted(airline)
    frontier = await checkpointer.latest("acme", "r")
    assert frontier is not None and frontier.history_handle is not None
    assert checkpointer.history is not None
    entries = await checkpointer.history.fetch(frontier.history_handle)
    entry = entries[1]  # the assistant message asking for search_flights
    for _, bad in byte_flips(entry, deltas=(0x01,)):
        history = MemoryHistoryStore()
        changed = [*entries[:1], bad, *entries[2:]]
        handle = await history.append("acme", "r", changed, fence=None, after=None)
        reader = Checkpointer(checkpointer.store, history=history)
        with pytest.raises(CheckpointCorruptError):
            await reader.messages(dataclasses.replace(frontier, history_handle=handle))


async def test_intact_entries_that_are_not_the_named_ones_are_unavailable(
    airline: Airline,
) -> None:
    checkpointer, _ = await _interrupted(airline)
    frontier = await checkpointer.latest("acme", "r")
    assert frontier is not None and frontier.history_handle is not None
    assert checkpointer.history is not None
    entries = await checkpointer.history.fetch(frontier.history_handle)
    other = encode_message(Message.user("book UA456 instead"), Redactor())
    reader = Checkpointer(checkpointer.store, history=_Answers([other, *entries[1:]]))
    with pytest.raises(HistoryUnavailableError):
        await reader.messages(frontier)


class _Answers(MemoryHistoryStore):
    """A history store that answers every handle with fixed bytes (it kept no digests)."""

    def __init__(self, entries: list[bytes]) -> None:
        super().__init__()
        self.entries = entries

    async def fetch(self, handle: HistoryHandle) -> list[bytes]:
        return list(self.entries)


def test_truncated_payloads_are_corrupt() -> None:
    for payload, read in (
        (_outcome_payload(), lambda p: decode_outcome(p, "c")),
        (_entry_payload(), decode_message),
    ):
        wrong = _every_read_fails(list(truncations(payload)), read, CheckpointCorruptError)
        assert wrong == []


# --- formats and downgrade ----------------------------------------------------------------


async def test_frontiers_are_written_in_the_checksummed_format(airline: Airline) -> None:
    payload = await _frontier_payload(airline)
    assert CHECKPOINT_FORMAT == 2
    body = json.loads(payload)
    assert body["format"] == 2
    assert list(body)[-1] == "checksum" and body["checksum"].startswith("sha256:")


def test_a_format_1_payload_carrying_a_checksum_is_refused() -> None:
    golden = (GOLDEN / "format1_frontier.json").read_bytes()
    assert decode_checkpoint(golden, tenant="acme", run_id="run_1").format == 1
    body = json.loads(golden)
    body["checksum"] = "sha256:" + "0" * 64
    with pytest.raises(CheckpointCorruptError, match="checksum"):
        decode_checkpoint(json.dumps(body).encode(), tenant="acme", run_id="run_1")


async def test_a_checksummed_payload_downgraded_to_format_1_by_one_byte_is_refused(
    airline: Airline,
) -> None:
    payload = await _frontier_payload(airline)
    downgraded = payload.replace(b'{"format":2,', b'{"format":1,', 1)
    assert downgraded != payload
    with pytest.raises(CheckpointCorruptError, match="checksum"):
        decode_checkpoint(downgraded, tenant="acme", run_id="r")


async def test_a_payload_of_the_new_format_without_its_checksum_is_refused(
    airline: Airline,
) -> None:
    payload = await _frontier_payload(airline)
    body = json.loads(payload)
    del body["checksum"]
    stripped = json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()
    with pytest.raises(CheckpointCorruptError, match="checksum"):
        decode_checkpoint(stripped, tenant="acme", run_id="r")


def test_a_resealed_payload_reads_so_tests_can_build_valid_variants() -> None:
    golden = (GOLDEN / "format2_frontier.json").read_bytes()
    cp = decode_checkpoint(golden, tenant="acme", run_id="run_1")
    changed = resealed(golden, lambda b: b.update(step=9))
    assert decode_checkpoint(changed, tenant="acme", run_id="run_1").step == 9
    assert cp.step != 9


# --- nesting ------------------------------------------------------------------------------


def test_the_nesting_limit_is_stated() -> None:
    assert MAX_NESTING == 64


@pytest.mark.parametrize("seal", [False, True], ids=["unsealed", "sealed"])
def test_deeply_nested_payloads_are_corrupt_not_a_recursion_error(seal: bool) -> None:
    deep = nested_json(5000)
    if seal:
        frontier = resealed_with((GOLDEN / "format2_frontier.json").read_bytes(), "state", deep)
        outcome = resealed_with(_outcome_payload(), "content", deep)
        entry = resealed_with(_entry_payload(), "content", deep)
    else:
        golden = (GOLDEN / "format1_frontier.json").read_text()
        frontier = golden.replace('"state":{', f'"state":{deep},"x":{{', 1).encode()
        outcome = f'{{"content":{deep},"is_error":false}}'.encode()
        entry = f'{{"role":"user","content":{deep}}}'.encode()
    with pytest.raises(CheckpointCorruptError, match="nest"):
        decode_checkpoint(frontier, tenant="acme", run_id="run_1")
    with pytest.raises(CheckpointCorruptError, match="nest"):
        decode_outcome(outcome, "c")
    with pytest.raises(CheckpointCorruptError, match="nest"):
        decode_message(entry)


def test_json_nested_just_below_and_just_over_the_limit() -> None:
    payload = _outcome_payload()
    # The outcome body is one level ({"content": ...}); content may use the rest.
    fits = resealed(payload, lambda b: b.update(content=nested(MAX_NESTING - 1)))
    assert decode_outcome(fits, "c").content == nested(MAX_NESTING - 1)
    over = resealed(payload, lambda b: b.update(content=nested(MAX_NESTING)))
    with pytest.raises(CheckpointCorruptError, match="nest"):
        decode_outcome(over, "c")


def _depth(value: Any) -> int:
    if isinstance(value, dict):
        return 1 + max((_depth(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((_depth(v) for v in value), default=0)
    return 0


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(alphabet='ab[]{}\\"', max_size=6),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3)
    ),
    max_leaves=120,
)


@given(value=_json_values, wrap=st.integers(min_value=0, max_value=80))
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_an_outcome_decodes_exactly_when_it_nests_within_the_limit(value: Any, wrap: int) -> None:
    """Oracle: the depth of the decoded value. The limit is measured on the bytes (with a
    fast path for payloads with few brackets), and must agree with it either way, whatever
    brackets and escapes the strings hold."""
    for _ in range(wrap):
        value = [value]
    payload = resealed(_outcome_payload(), lambda b: b.update(content=value))
    if 1 + _depth(value) <= MAX_NESTING:
        assert decode_outcome(payload, "c").content == value
    else:
        with pytest.raises(CheckpointCorruptError, match="nest"):
            decode_outcome(payload, "c")


def _deep_frontier(depth: int) -> Checkpoint:
    return Checkpoint(
        tenant="acme",
        run_id="r",
        agent_name="a",
        step=1,
        boundary=Boundary.after_model_call,
        status=CheckpointStatus.running,
        messages=(Message.user("hi"),),
        outstanding=(
            OutstandingCall(
                call=ToolCall(id="c", name="t", arguments={"x": nested(depth)}), key="k"
            ),
        ),
    )


def test_encoding_arguments_nested_5000_deep_is_a_typed_refusal() -> None:
    with pytest.raises(CheckpointTooLargeError, match="nest") as err:
        encode_checkpoint(_deep_frontier(5000), Redactor())
    assert err.value.retryable is False
    with pytest.raises(CheckpointTooLargeError, match="nest"):
        encode_checkpoint(_deep_frontier(MAX_NESTING), Redactor())
    with pytest.raises(CheckpointTooLargeError, match="nest"):
        encode_message(
            Message.assistant("", [ToolCall(id="c", name="t", arguments={"x": nested(5000)})]),
            Redactor(),
        )


def test_what_the_encoder_accepts_the_decoder_reads() -> None:
    """The limit is one number for both sides: the deepest frontier that encodes decodes."""
    depth = 1
    while True:
        try:
            payload = encode_checkpoint(_deep_frontier(depth), Redactor())
        except CheckpointTooLargeError:
            break
        cp = decode_checkpoint(payload, tenant="acme", run_id="r")
        assert cp.outstanding[0].call.arguments == {"x": nested(depth)}
        depth += 1
    assert depth > MAX_NESTING - 8


async def test_a_checkpointer_refuses_a_too_deep_frontier_with_a_tombstone() -> None:
    store = MemoryCheckpointStore()
    checkpointer = Checkpointer(store)
    from tesserix_adk.checkpoint.checkpointer import TranscriptCursor

    assert not await checkpointer.write(_deep_frontier(5000), cursor=TranscriptCursor())
    assert isinstance(checkpointer.last_error, CheckpointTooLargeError)
    latest = await checkpointer.latest("acme", "r")
    assert latest is not None and latest.is_tombstone


def test_an_outcome_nested_5000_deep_is_recorded_as_completed_with_an_error() -> None:
    deep = ToolOutcome(call_id="c", content={"x": nested(5000)})
    recorded = recorded_outcome(deep, Redactor())
    assert recorded.replaced
    assert recorded.outcome.is_error and "nest" in recorded.outcome.content
    assert decode_outcome(recorded.payload, "c") == recorded.outcome


# --- wrong types --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "change",
    [
        lambda b: b.update(written_at="soon"),
        lambda b: b.update(observation={"x": 1}, state=[1]) or b.update(written_at=True),
        lambda b: b["history"].update(count="4"),
        lambda b: b.update(agent="booking"),
        lambda b: b.update(outstanding="book_seat"),
        lambda b: b.update(grants=[{"request": 1}]),
        lambda b: b.update(usage=None),
        lambda b: b.update(messages={"role": "user"}),
        lambda b: b.update(messages=[{"role": "user", "content": "x", "is_error": "no"}]),
        lambda b: b.update(messages=[{"role": "tool", "content": "x", "tool_call_id": 5}]),
        lambda b: b.update(messages=[{"role": "user", "content": [{"type": "text", "text": 5}]}]),
        lambda b: b.update(messages=[{"role": "user", "content": "x", "extra": 1}]),
        lambda b: b.update(unknown_field=1),
    ],
    ids=[
        "written-at-not-a-number",
        "written-at-a-bool",
        "count-a-string",
        "agent-a-string",
        "outstanding-a-string",
        "grant-fields",
        "usage-null",
        "messages-an-object",
        "message-is-error-a-string",
        "message-call-id-a-number",
        "text-part-a-number",
        "message-unknown-field",
        "unknown-field",
    ],
)
@pytest.mark.parametrize("name", ["format1_frontier.json", "format2_frontier.json"])
def test_a_field_of_the_wrong_type_is_corrupt(
    change: Callable[[dict[str, Any]], Any], name: str
) -> None:
    golden = (GOLDEN / name).read_bytes()
    if name.startswith("format1"):
        body = json.loads(golden)
        change(body)
        bad = json.dumps(body).encode()
    else:
        bad = resealed(golden, change)
    with pytest.raises(CheckpointCorruptError):
        decode_checkpoint(bad, tenant="acme", run_id="run_1")


@pytest.mark.parametrize(
    "body",
    [
        {"content": "x", "is_error": "false"},
        {"content": "x", "is_error": 0},
        {"content": "x"},
        {"content": "x", "is_error": False, "extra": 1},
        ["content", "is_error"],
        "x",
    ],
)
def test_a_legacy_outcome_of_the_wrong_shape_is_corrupt(body: Any) -> None:
    with pytest.raises(CheckpointCorruptError):
        decode_outcome(json.dumps(body).encode(), "c")


def test_a_legacy_outcome_and_transcript_entry_still_read() -> None:
    legacy = b'{"content":{"booking":"B1"},"is_error":false}'
    assert decode_outcome(legacy, "c") == ToolOutcome(call_id="c", content={"booking": "B1"})
    assert decode_message(b'{"role":"user","content":"hi"}') == Message.user("hi")


# --- fuzz ---------------------------------------------------------------------------------


def _mutation() -> st.SearchStrategy[Callable[[bytes], bytes]]:
    position = st.floats(min_value=0, max_value=1, exclude_max=True)
    byte = st.integers(min_value=0, max_value=255)

    def at(p: bytes, f: float) -> int:
        return int(f * len(p))

    return st.one_of(
        st.builds(
            lambda f, b: lambda p: p[: at(p, f)] + bytes([b]) + p[at(p, f) + 1 :], position, byte
        ),
        st.builds(
            lambda f, b: lambda p: p[: at(p, f)] + bytes([b]) + p[at(p, f) :], position, byte
        ),
        st.builds(lambda f: lambda p: p[: at(p, f)] + p[at(p, f) + 1 :], position),
        st.builds(lambda f: lambda p: p[: at(p, f)], position),
        st.builds(
            lambda f, g: lambda p: p[: at(p, min(f, g))] + p[at(p, max(f, g)) :], position, position
        ),
    )


_FRONTIER = (GOLDEN / "format2_frontier.json").read_bytes()


@FUZZ
@given(mutations=st.lists(_mutation(), min_size=1, max_size=3))
def test_fuzzed_payloads_read_as_the_same_state_or_a_typed_error(
    mutations: list[Callable[[bytes], bytes]],
) -> None:
    reads: list[tuple[bytes, Callable[[bytes], Any]]] = [
        (_FRONTIER, lambda p: decode_checkpoint(p, tenant="acme", run_id="run_1")),
        (_outcome_payload(), lambda p: decode_outcome(p, "c")),
        (_entry_payload(), decode_message),
    ]
    for payload, read in reads:
        original = read(payload)
        bad = payload
        for mutate in mutations:
            bad = mutate(bad)
        try:
            got = read(bad)
        except CheckpointError:
            continue
        assert got == original


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=5),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=8,
)


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(value, dict):
        for k, v in value.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _paths(v, (*prefix, i))
    return out


@FUZZ
@given(data=st.data())
def test_resealed_payloads_with_any_field_changed_decode_or_fail_typed(data: st.DataObject) -> None:
    """Past the checksum, the decoder itself is typed: no ValueError, KeyError, TypeError."""
    for payload, read in (
        (_FRONTIER, lambda p: decode_checkpoint(p, tenant="acme", run_id="run_1")),
        (_outcome_payload(), lambda p: decode_outcome(p, "c")),
        (_entry_payload(), decode_message),
    ):
        body = json.loads(payload)
        del body["checksum"]
        path = data.draw(st.sampled_from([p for p in _paths(body) if p]))
        value = data.draw(_JSON)

        def change(b: Any, path: tuple[Any, ...] = path, value: Any = value) -> None:
            for step in path[:-1]:
                b = b[step]
            b[path[-1]] = value

        with contextlib.suppress(CheckpointError):
            read(resealed(payload, change))


# --- outcome size cap ---------------------------------------------------------------------


def test_an_outcome_over_the_cap_is_replaced_not_truncated() -> None:
    big = ToolOutcome(call_id="c", content="x" * 5000)
    recorded = recorded_outcome(big, Redactor(), max_bytes=1000)
    assert recorded.replaced
    assert len(recorded.payload) <= 1000
    decoded = decode_outcome(recorded.payload, "c")
    assert decoded == recorded.outcome
    assert decoded.is_error
    assert "too large" in decoded.content
    size = len(recorded_outcome(big, Redactor(), max_bytes=10**9).payload)
    assert f"{size - 1000} bytes over the cap of 1000" in decoded.content
    # The positional form the runner uses keeps working, with the same cap by keyword.
    assert encode_outcome(big, Redactor(), max_bytes=1000) == recorded.payload


def test_a_result_json_cannot_write_is_recorded_as_text_like_the_transcript() -> None:
    when = datetime(2030, 1, 2, tzinfo=UTC)
    outcome = ToolOutcome(call_id="c", content={"at": when, "ids": (1, 2)})
    recorded = recorded_outcome(outcome, Redactor())
    assert decode_outcome(recorded.payload, "c").content == {"at": str(when), "ids": [1, 2]}
    entry = decode_message(encode_message(Message.tool_result(outcome), Redactor()))
    assert json.loads(entry.text) == recorded.outcome.content


def test_an_outcome_at_the_cap_is_kept_whole() -> None:
    small = ToolOutcome(call_id="c", content="y" * 100)
    size = len(encode_outcome(small, Redactor()))
    recorded = recorded_outcome(small, Redactor(), max_bytes=size)
    assert not recorded.replaced
    assert recorded.outcome == small
    assert recorded_outcome(small, Redactor(), max_bytes=size - 1).replaced


def test_the_default_outcome_cap_is_one_mebibyte() -> None:
    assert DEFAULT_MAX_BYTES == 1024 * 1024
    huge = ToolOutcome(call_id="c", content="z" * (2 * DEFAULT_MAX_BYTES))
    payload = encode_outcome(huge, Redactor())
    assert len(payload) < 1024
    assert decode_outcome(payload, "c").is_error


async def test_a_run_records_a_huge_tool_result_small_and_says_it_completed() -> None:
    @tool
    def dump() -> str:
        """A tool with a huge result."""
        return "d" * (3 * 1024 * 1024)

    idem = MemoryIdempotencyStore()
    runner = AgentRunner(
        ScriptedProvider([[("dump", {})], "done"]),
        idempotency=idem,
        checkpoints=Checkpointer(MemoryCheckpointStore(), history=MemoryHistoryStore()),
    )
    await runner.run(Agent("a", "b", [dump]), "go", tenant="acme", run_id="r")
    records = await idem.records("acme", "r")
    done = [r for r in records if r.tool == "dump"]
    assert len(done) == 1 and done[0].outcome is not None
    assert len(done[0].outcome) <= DEFAULT_MAX_BYTES
    outcome = decode_outcome(done[0].outcome, "x")
    assert outcome.is_error and "too large" in outcome.content


# --- one outcome codec --------------------------------------------------------------------


def test_json_text_results_are_masked_by_key_in_every_path() -> None:
    redactor = Redactor()
    text = json.dumps({"password": "hunter2", "ok": True})
    content = redact_outcome_content(text, redactor)
    assert "hunter2" not in content and json.loads(content)["ok"] is True
    record = decode_outcome(encode_outcome(ToolOutcome(call_id="c", content=text), redactor), "c")
    entry = decode_message(
        encode_message(Message.tool_result(ToolOutcome(call_id="c", content=text)), redactor)
    )
    assert record.content == content
    assert entry.content == content


async def test_a_json_text_tool_result_is_masked_in_transcript_observation_and_record() -> None:
    @tool
    def login() -> str:
        """Log in."""
        return json.dumps({"user": "ann", "password": "hunter2"})

    store = FaultyCheckpointStore(MemoryCheckpointStore())
    history = MemoryHistoryStore()
    idem = MemoryIdempotencyStore()
    runner = AgentRunner(
        ScriptedProvider([[("login", {})], "done"]),
        idempotency=idem,
        checkpoints=Checkpointer(store, history=history),
    )
    await runner.run(Agent("a", "b", [login]), "go", tenant="acme", run_id="r")
    blobs = list(store.payloads)
    latest = await Checkpointer(store, history=history).latest("acme", "r")
    assert latest is not None and latest.history_handle is not None
    blobs += await history.fetch(latest.history_handle)
    blobs += [r.outcome or b"" for r in await idem.records("acme", "r")]
    leaks = [b for b in blobs if b"hunter2" in b]
    assert leaks == []
    # The observation names the transcript's (masked) entry; read back, it is masked too.
    observed = await Checkpointer(store, history=history).observation(latest)
    assert observed and "[redacted:" in json.dumps(observed) and "hunter2" not in str(observed)


# --- the shipped suite, on the memory stores ----------------------------------------------


class TestCorruptionOnMemoryStores(CorruptionConformance):
    @pytest.fixture
    def checkpoint_store(self) -> MemoryCheckpointStore:
        return MemoryCheckpointStore()

    @pytest.fixture
    def history_store(self) -> MemoryHistoryStore:
        return MemoryHistoryStore()
