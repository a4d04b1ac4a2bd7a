"""The checker itself: each invariant, shown failing on a history that breaks it.

A checker that cannot fail proves nothing, so every violation it is meant to catch is
written here by hand, next to the clean history it must accept.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from reliability.checker import Verdict, check
from reliability.history import Recorder, read_history

ITEMS = ("a",)


def _history(tmp_path: Path, events: list[tuple[str, str, dict[str, Any]]]) -> Verdict:
    recorders: dict[str, Recorder] = {}
    for proc, ev, fields in events:
        rec = recorders.setdefault(proc, Recorder(tmp_path / "h.jsonl", proc))
        rec.event(ev, "r", **fields)
    for rec in recorders.values():
        rec.close()
    return check(read_history(tmp_path / "h.jsonl"), expected_items=ITEMS)


def _grant(fence: int) -> tuple[str, dict[str, Any]]:
    return "acquire_ok", {"fence": fence, "holder": f"h{fence}", "sent": 0, "ttl": 1}


CLEAN: list[tuple[str, str, dict[str, Any]]] = [
    ("w1", *_grant(1)),
    ("w1", "claim_sent", {"key": "k", "fence": 1, "holder": "h1"}),
    ("w1", "claim_ok", {"key": "k", "fence": 1, "sent": 1, "status": "in_flight", "mine": True}),
    ("w1", "effect", {"key": "k", "fence": 1, "item": "a", "sent": 2}),
    ("w1", "complete_sent", {"key": "k", "holder": "h1"}),
    ("w1", "complete_ok", {"key": "k", "sent": 3}),
    ("w1", "result", {"verdict": "completed", "code": 0}),
]


def test_a_clean_history_passes(tmp_path: Path) -> None:
    verdict = _history(tmp_path, CLEAN)
    assert verdict.ok, verdict.explain()
    assert verdict.runs == 1


def test_two_effects_of_one_key_are_a_duplicate(tmp_path: Path) -> None:
    again = ("w2", "effect", {"key": "k", "fence": 1, "item": "a", "sent": 2})
    verdict = _history(tmp_path, [*CLEAN, again])
    assert verdict.duplicate_effects == 1 and not verdict.ok


def test_a_write_after_a_higher_fence_was_granted_is_a_stale_write(tmp_path: Path) -> None:
    events = [*CLEAN[:1], ("w2", *_grant(2)), ("w1", "put_ok", {"fence": 1, "step": 1})]
    # The put went out (sent) after fence 2's grant was back.
    events[-1][2]["sent"] = 10**19
    verdict = _history(tmp_path, [*events, *CLEAN[-1:]])
    assert verdict.stale_writes == 1, verdict.explain()


def test_fences_that_do_not_rise_in_grant_order_are_caught(tmp_path: Path) -> None:
    late = ("w2", "acquire_ok", {"fence": 1, "holder": "x", "sent": 10**19, "ttl": 1})
    verdict = _history(tmp_path, [CLEAN[0], late, *CLEAN[1:]])
    assert verdict.stale_writes >= 1, verdict.explain()


def test_a_refusal_must_name_exactly_the_calls_in_doubt(tmp_path: Path) -> None:
    claimed = CLEAN[:3]  # claimed and acknowledged, never completed: in doubt
    right = ("w2", "result", {"verdict": "refused", "code": 4, "keys": ["k"]})
    none = ("w2", "result", {"verdict": "refused", "code": 4, "keys": []})
    stranger = ("w2", "result", {"verdict": "refused", "code": 4, "keys": ["k", "other"]})
    done = ("w3", "result", {"verdict": "completed", "code": 0})
    for n, (refusal, wrong) in enumerate(((right, 0), (none, 1), (stranger, 1))):
        path = tmp_path / str(n)
        path.mkdir()
        verdict = _history(path, [*claimed, refusal, done])
        assert verdict.wrong_refusals == wrong, verdict.explain()


def test_a_completed_call_named_in_a_refusal_is_a_wrong_refusal(tmp_path: Path) -> None:
    refusal = ("w2", "result", {"verdict": "refused", "code": 4, "keys": ["k"]})
    verdict = _history(tmp_path, [*CLEAN[:-1], refusal, CLEAN[-1]])
    assert verdict.wrong_refusals == 1, verdict.explain()


def test_a_run_that_never_completes_or_hangs_fails(tmp_path: Path) -> None:
    hang = ("harness", "hang", {"worker": "w1", "detail": "stack"})
    verdict = _history(tmp_path, [*CLEAN[:-1], hang])
    assert verdict.hangs == 1 and verdict.unfinished == 1
    assert "stack" in verdict.explain()


def test_a_completed_run_whose_call_never_took_effect_fails(tmp_path: Path) -> None:
    verdict = _history(tmp_path, [e for e in CLEAN if e[1] != "effect"])
    assert verdict.lost_effects == 1 and not verdict.ok
