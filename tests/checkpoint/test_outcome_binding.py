"""A recorded outcome names the record it was written for (``record_tag``), so one read
back under another record is corrupt, never another call's answer (README guarantee 8).

End to end, on a SQLite file: ``test_attacks_integrity_rows.py`` swaps two records'
outcomes and copies one from another run's record.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tesserix_adk.checkpoint.payload import (
    OutcomeState,
    decode_outcome,
    encode_outcome,
    outcome_state,
    record_tag,
    recorded_outcome,
)
from tesserix_adk.checkpoint.payload.envelope import seal, unseal
from tesserix_adk.checkpoint.payload.outcomes import BOUND_FORMAT, STATE_FORMAT
from tesserix_adk.checkpoint.redaction import Redactor
from tesserix_adk.errors import CheckpointCorruptError, CheckpointFormatError
from tesserix_adk.messages import ToolOutcome

ids = st.text(min_size=1, max_size=40)


def _encoded(record: str | None, content: object = "held 12A") -> bytes:
    return encode_outcome(ToolOutcome(call_id="c1", content=content), Redactor(), record=record)


@given(first=st.tuples(ids, ids), second=st.tuples(ids, ids), content=st.text(max_size=50))
def test_an_outcome_reads_under_its_own_record_only(
    first: tuple[str, str], second: tuple[str, str], content: str
) -> None:
    mine = record_tag(*first)
    data = _encoded(mine, content)
    assert decode_outcome(data, "c9", record=mine) == ToolOutcome(call_id="c9", content=content)
    if record_tag(*second) != mine:
        with pytest.raises(CheckpointCorruptError, match="another record"):
            decode_outcome(data, "c9", record=record_tag(*second))


def test_tenant_and_key_never_join_into_one_tag() -> None:
    assert record_tag("a", "bc") != record_tag("ab", "c")
    assert record_tag("a\x00", "b") != record_tag("a", "\x00b")
    assert record_tag("acme", "k") != record_tag("globex", "k")


def test_an_outcome_written_before_records_were_named_still_reads() -> None:
    """Format 2, as records written by an earlier release hold them."""
    old = _encoded(None)
    assert b'"format":2' in old
    got = decode_outcome(old, "c1", record=record_tag("acme", "k"))
    assert got.content == "held 12A"


def test_a_result_too_large_is_replaced_and_still_names_its_record() -> None:
    mine = record_tag("acme", "k")
    data = encode_outcome(
        ToolOutcome(call_id="c1", content="x" * 5000), Redactor(), max_bytes=1000, record=mine
    )
    assert decode_outcome(data, "c1", record=mine).is_error
    with pytest.raises(CheckpointCorruptError):
        decode_outcome(data, "c1", record=record_tag("acme", "other"))


@pytest.mark.parametrize(
    "body",
    [
        {"format": BOUND_FORMAT, "content": "x", "is_error": False},  # names nothing
        {"format": 2, "content": "x", "is_error": False, "record": "ab"},  # names too early
        {"format": BOUND_FORMAT, "content": "x", "is_error": False, "record": 7},
    ],
    ids=["bound-without-record", "old-with-record", "record-not-text"],
)
def test_a_record_name_out_of_place_is_corrupt(body: dict[str, object]) -> None:
    with pytest.raises(CheckpointCorruptError):
        decode_outcome(seal(body), "c1")


def test_a_newer_format_is_refused_as_newer() -> None:
    data = seal({"format": STATE_FORMAT + 1, "content": "x", "is_error": False, "record": "a"})
    with pytest.raises(CheckpointFormatError):
        decode_outcome(data, "c1")


# --- the run's state kept with a call's outcome ----------------------------------------------


def test_an_outcome_keeps_the_runs_state_redacted_and_marks_a_lost_secret() -> None:
    tag = record_tag("acme", "k1")
    outcome = ToolOutcome(call_id="c1", content="booked", is_error=False)
    plain = recorded_outcome(
        outcome, Redactor(), record=tag, state=OutcomeState(state={"booked": ["LH1"]})
    ).payload
    assert json.loads(plain)["format"] == STATE_FORMAT
    assert decode_outcome(plain, "c1", record=tag) == outcome
    assert outcome_state(plain, record=tag) == OutcomeState(state={"booked": ["LH1"]})
    masked = recorded_outcome(
        outcome, Redactor(), record=tag, state=OutcomeState(state={"api_token": "tok-real-9"})
    ).payload
    assert b"tok-real-9" not in masked
    kept = outcome_state(masked, record=tag)
    assert kept is not None and kept.redacted and kept.state == {"api_token": "[redacted:token]"}
    typed = recorded_outcome(
        outcome, Redactor(), record=tag, state=OutcomeState(state={"pin": "x"}, redacted=True)
    ).payload
    assert outcome_state(typed, record=tag) == OutcomeState(state={"pin": "x"}, redacted=True)
    # Without a state, or for no record, the outcome is as before and keeps none.
    bare = recorded_outcome(outcome, Redactor(), record=tag).payload
    assert json.loads(bare)["format"] == BOUND_FORMAT and outcome_state(bare) is None
    unbound = recorded_outcome(outcome, Redactor(), state=OutcomeState(state={})).payload
    assert outcome_state(unbound) is None


def test_a_large_result_is_replaced_but_the_state_is_still_kept() -> None:
    tag = record_tag("acme", "k1")
    big = ToolOutcome(call_id="c1", content="x" * 5000, is_error=False)
    kept = recorded_outcome(
        big, Redactor(), max_bytes=1000, record=tag, state=OutcomeState(state={"n": 1})
    )
    assert kept.replaced and outcome_state(kept.payload, record=tag) == OutcomeState({"n": 1})


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(lambda b: b.pop("state"), id="state-dropped"),
        pytest.param(lambda b: b.update(state_redacted=False), id="mark-false"),
        pytest.param(lambda b: b.update(format=BOUND_FORMAT), id="format-3-with-state"),
        pytest.param(lambda b: b.pop("record"), id="names-no-record"),
    ],
)
def test_an_outcome_whose_kept_state_does_not_hold_is_corrupt(change: Any) -> None:
    tag = record_tag("acme", "k1")
    outcome = ToolOutcome(call_id="c1", content="ok", is_error=False)
    payload = recorded_outcome(
        outcome, Redactor(), record=tag, state=OutcomeState(state={"a": 1}, redacted=True)
    ).payload
    body, _ = unseal(payload, what="x")
    change(body)
    with pytest.raises(CheckpointCorruptError):
        outcome_state(seal(body))
    with pytest.raises(CheckpointCorruptError):
        decode_outcome(seal(body), "c1")


def test_a_result_far_past_the_cap_is_replaced_without_being_scanned() -> None:
    """Scanning megabytes of text holds the interpreter (the regular expressions keep the
    GIL): a result whose text alone is over twice the cap, which masking could never bring
    under it, is replaced unscanned; one just over the cap is still scanned, then replaced."""
    scanned: list[int] = []

    class Counting(Redactor):
        def value(self, data: Any) -> Any:
            scanned.append(1)
            return super().value(data)

        def text(self, value: str) -> str:
            scanned.append(1)
            return super().text(value)

    redactor = Counting()
    far = recorded_outcome(
        ToolOutcome(call_id="c", content={"rows": ["x" * 1000] * 2500}),
        redactor,
        max_bytes=1_000_000,
    )
    assert far.replaced and "too large" in str(far.outcome.content) and scanned == []
    near = recorded_outcome(
        ToolOutcome(call_id="c", content="x" * 1_500_000), redactor, max_bytes=1_000_000
    )
    assert near.replaced and scanned
