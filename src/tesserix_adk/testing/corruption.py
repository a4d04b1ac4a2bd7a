"""A corruption suite: every damaged payload a store hands back must read as a typed error.

The helpers take a real payload (one the kit encoded) and damage it: every byte position
changed (``byte_flips``), every truncation (``truncations``), nesting thousands deep
(``nested``), or a field changed with a valid checksum recomputed (``resealed``, for tests
that need a well-formed payload saying something else). ``assert_every_read_fails`` runs a
reader over them and names each one that came back as a value instead of an error.

``CorruptionConformance`` is the suite a store runs: it stores damaged payloads through the
store's own methods and reads them back through the kit, so a store that alters bytes (a
JSON column that re-serialises, a text column that re-encodes) or a kit path that accepts
damage fails here. Subclass it and provide the fixtures ``checkpoint_store`` and
``history_store`` (a fresh, empty store each), as the other suites do.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import pytest

from tesserix_adk.checkpoint.checkpointer import Checkpointer
from tesserix_adk.checkpoint.payload import (
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
    record_tag,
    seal,
    unseal,
)
from tesserix_adk.checkpoint.redaction import Redactor
from tesserix_adk.errors import CheckpointCorruptError
from tesserix_adk.messages import Message, ToolCall, ToolOutcome
from tesserix_adk.stores.memory import MemoryCheckpointStore
from tesserix_adk.stores.protocols import CheckpointStore, HistoryHandle, HistoryStore

__all__ = [
    "DELTAS",
    "OUTCOME_RECORD",
    "CorruptionConformance",
    "assert_every_read_fails",
    "byte_flips",
    "nested",
    "nested_json",
    "real_bound_outcome",
    "real_frontier",
    "real_outcome",
    "real_transcript_entry",
    "resealed",
    "resealed_with",
    "truncations",
]

DELTAS = (0x01, 0x20, 0x80, 0xFF)
"""What each byte is XORed with: the low bit (a digit or letter becomes its neighbour),
case, the high bit (invalid UTF-8), and every bit."""

T = "acme"
R = "run-1"


def byte_flips(payload: bytes, *, deltas: Iterable[int] = DELTAS) -> Iterator[tuple[int, bytes]]:
    """``(position, payload with that one byte changed)`` for every position and delta."""
    steps = tuple(deltas)
    for i, byte in enumerate(payload):
        for delta in steps:
            yield i, payload[:i] + bytes([byte ^ delta]) + payload[i + 1 :]


def truncations(payload: bytes) -> Iterator[bytes]:
    """Every proper prefix of ``payload``, the empty one included."""
    for n in range(len(payload)):
        yield payload[:n]


def nested(depth: int, container: type[list[Any]] | type[dict[str, Any]] = list) -> Any:
    """A JSON value ``depth`` containers deep (``[[[]]]`` or ``{"a":{"a":{}}}``), built
    without recursion."""
    value: Any = [] if container is list else {}
    for _ in range(depth - 1):
        value = [value] if container is list else {"a": value}
    return value


def nested_json(depth: int) -> str:
    """JSON text ``depth`` arrays deep, for payloads too deep for ``json.dumps`` to write."""
    return "[" * depth + "]" * depth


def resealed_with(payload: bytes, field: str, raw_json: str) -> bytes:
    """``payload`` with the top-level ``field`` set to the JSON text ``raw_json`` (which
    may nest deeper than ``json`` can encode), with a checksum that verifies."""
    marker = "\x00tesserix-corruption-marker\x00"
    body, _ = unseal(payload, what="the payload")
    body.pop("checksum", None)
    body[field] = marker
    text = json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()
    return seal(text.replace(json.dumps(marker).encode(), raw_json.encode(), 1))


def resealed(payload: bytes, change: Callable[[Any], Any]) -> bytes:
    """``payload``'s body changed in place by ``change``, with a checksum that verifies.

    For tests that need a well-formed payload saying something else (a checksum is not a
    signature; this is what any writer can do). A payload without a checksum is sealed.
    """
    body, _ = unseal(payload, what="the payload")
    body.pop("checksum", None)
    change(body)
    return seal(body)


def assert_every_read_fails(
    payloads: Iterable[bytes],
    read: Callable[[bytes], Any],
    error: type[BaseException] = CheckpointCorruptError,
) -> None:
    """Fail naming every payload ``read`` did not refuse with ``error``, and what it gave."""
    wrong: list[str] = []
    for bad in payloads:
        try:
            got = read(bad)
        except error:
            continue
        except Exception as exc:
            wrong.append(f"{bad[:80]!r}...: raised {exc!r}")
        else:
            wrong.append(f"{bad[:80]!r}...: read as {got!r}")
    if wrong:
        shown = "\n  ".join(wrong[:20])
        raise AssertionError(f"{len(wrong)} damaged payload(s) were not refused:\n  {shown}")


# --- real payloads --------------------------------------------------------------------------


def real_frontier(*, tenant: str = T, run_id: str = R, history: bool = True) -> bytes:
    """A frontier with an outstanding side-effecting call, as the kit encodes it."""
    call = ToolCall(id="call_1_0", name="book_seat", arguments={"flight": "LH123", "seats": 2})
    messages = (
        Message.user("book LH123"),
        Message.assistant("Booking.", [call]),
    )
    cp = Checkpoint(
        tenant=tenant,
        run_id=run_id,
        agent_name="booking",
        agent_revision="sha256:" + "ab" * 32,
        step=3,
        boundary=Boundary.after_model_call,
        status=CheckpointStatus.running,
        iteration=1,
        fence=7,
        messages=None if history else messages,
        history_handle=None,
        outstanding=(OutstandingCall(call=call, key="k1:" + "cd" * 32, side_effects=True),),
        state={"phase": "apply", "ticket_id": "T-1"},
        steps_used=2,
        observation=[{"call_id": "c0", "tool": "search", "content": "LH123", "is_error": False}],
    )
    if history:
        handle = HistoryHandle(tenant=tenant, run_id=run_id, count=2, digest="sha256:" + "ef" * 32)
        cp = dataclasses.replace(cp, history_handle=handle)
    return encode_checkpoint(cp, Redactor())


def real_outcome() -> bytes:
    """A recorded outcome of a booking, as the kit encoded it before outcomes named their
    record (format 2; still read)."""
    return encode_outcome(
        ToolOutcome(call_id="call_1_0", content={"booking": "B1", "flight": "LH123"}), Redactor()
    )


OUTCOME_RECORD = record_tag(T, "book_seat:LH123")
"""The record ``real_bound_outcome`` names."""


def real_bound_outcome() -> bytes:
    """A recorded outcome of a booking as the kit encodes it now: naming its record
    (``OUTCOME_RECORD``, format 3)."""
    return encode_outcome(
        ToolOutcome(call_id="call_1_0", content={"booking": "B1", "flight": "LH123"}),
        Redactor(),
        record=OUTCOME_RECORD,
    )


def real_transcript_entry() -> bytes:
    """An assistant message asking for a call, as the kit encodes a transcript entry."""
    call = ToolCall(id="call_1_0", name="book_seat", arguments={"flight": "LH123"})
    return encode_message(Message.assistant("Booking.", [call]), Redactor())


def _damaged(payload: bytes) -> list[bytes]:
    out = [bad for _, bad in byte_flips(payload, deltas=(0x01, 0x80))]
    out += list(truncations(payload))[:: max(1, len(payload) // 64)]
    out.append(payload + b" ")
    out.append(json.dumps(json.loads(payload)).encode())
    return out


# --- the suite --------------------------------------------------------------------------------


class CorruptionConformance:
    """Subclass this in a test module to check that a store hands damaged payloads back
    byte for byte and the kit refuses every one of them with a typed error.

    Provide two fixtures: ``checkpoint_store`` and ``history_store`` (fresh and empty).
    """

    async def test_every_damaged_frontier_is_refused_and_kept_byte_for_byte(
        self, checkpoint_store: CheckpointStore
    ) -> None:
        checkpointer = Checkpointer(checkpoint_store)
        payloads = _damaged(real_frontier(history=False))
        # Every changed byte is tried against decode; a sample goes through the store.
        assert_every_read_fails(payloads, lambda p: decode_checkpoint(p, tenant=T, run_id=R))
        for step, bad in enumerate(payloads[:: max(1, len(payloads) // 40)], start=1):
            await checkpoint_store.put(T, R, bad, step=step)
            stored = await checkpoint_store.latest(T, R)
            assert stored is not None and stored.payload == bad
            with pytest.raises(CheckpointCorruptError):
                await checkpointer.latest(T, R)
            with pytest.raises(CheckpointCorruptError):
                await checkpointer.at(T, R, step)

    async def test_a_real_frontier_reads_back_through_the_store(
        self, checkpoint_store: CheckpointStore
    ) -> None:
        payload = real_frontier(history=False)
        await checkpoint_store.put(T, R, payload, step=3)
        read = await Checkpointer(checkpoint_store).latest(T, R)
        assert read == decode_checkpoint(payload, tenant=T, run_id=R)

    async def test_an_intact_checkpoint_in_another_steps_place_is_refused(
        self, checkpoint_store: CheckpointStore
    ) -> None:
        # Step 3's payload, whole and verifying, stored as step 4: a store that mixed rows
        # up (or a restore from the wrong backup) must not pass one step off as another.
        checkpointer = Checkpointer(checkpoint_store)
        await checkpoint_store.put(T, R, real_frontier(history=False), step=4)
        with pytest.raises(CheckpointCorruptError, match=r"step 4 .* is step 3's"):
            await checkpointer.latest(T, R)
        with pytest.raises(CheckpointCorruptError, match=r"step 4 .* is step 3's"):
            await checkpointer.at(T, R, 4)

    async def test_deeply_nested_payloads_are_refused_not_a_crash(
        self, checkpoint_store: CheckpointStore
    ) -> None:
        deep = resealed_with(real_frontier(history=False), "state", nested_json(5000))
        await checkpoint_store.put(T, R, deep, step=1)
        stored = await checkpoint_store.latest(T, R)
        assert stored is not None and stored.payload == deep
        with pytest.raises(CheckpointCorruptError, match="nest"):
            await Checkpointer(checkpoint_store).latest(T, R)
        assert_every_read_fails(
            [
                resealed_with(real_outcome(), "content", nested_json(5000)),
                f'{{"content":{nested_json(5000)},"is_error":false}}'.encode(),
            ],
            lambda p: decode_outcome(p, "c"),
        )
        assert_every_read_fails(
            [resealed_with(real_transcript_entry(), "content", nested_json(5000))],
            decode_message,
        )

    async def test_every_damaged_transcript_entry_is_refused(
        self, history_store: HistoryStore
    ) -> None:
        entry = real_transcript_entry()
        assert_every_read_fails(_damaged(entry), decode_message)
        good = encode_message(Message.user("book LH123"), Redactor())
        frontier = decode_checkpoint(real_frontier(), tenant=T, run_id=R)
        for i, (_, bad) in enumerate(byte_flips(entry, deltas=(0x01,))):
            if i % max(1, len(entry) // 24):
                continue
            run_id = f"{R}-{i}"
            # The store keeps what it was given; the handle it answers names those bytes,
            # so only the entry's own checksum can tell the damage.
            handle = await history_store.append(T, run_id, [good, bad], fence=None, after=None)
            reader = Checkpointer(MemoryCheckpointStore(), history=history_store)
            cp = dataclasses.replace(frontier, run_id=run_id, history_handle=handle)
            with pytest.raises(CheckpointCorruptError):
                await reader.messages(cp)

    async def test_damaged_recorded_outcomes_are_refused(self) -> None:
        assert_every_read_fails(_damaged(real_outcome()), lambda p: decode_outcome(p, "c"))
        assert_every_read_fails(
            _damaged(real_bound_outcome()),
            lambda p: decode_outcome(p, "c", record=OUTCOME_RECORD),
        )
        # Whole and sound, read under another record than its own: refused too.
        with pytest.raises(CheckpointCorruptError, match="another record"):
            decode_outcome(real_bound_outcome(), "c", record=record_tag(T, "book_seat:LH999"))
