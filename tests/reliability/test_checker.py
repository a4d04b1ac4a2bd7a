"""The checker itself: each invariant, shown failing on a history that breaks it.

A checker that cannot fail proves nothing, so every violation it is meant to catch is
written here by hand, next to the clean history it must accept.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from reliability.checker import Verdict, check
from reliability.history import Event, Recorder, read_history
from reliability.skew import live_takeovers

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


def test_a_claim_dropped_unsent_need_not_be_named_but_may_be(tmp_path: Path) -> None:
    # Claimed, then dropped by its holder before it sent the call (the kit's
    # release_unsent); whether the drop landed, a later refusal is right either way.
    claimed = [*CLEAN[:3], ("w1", "release_sent", {"key": "k", "holder": "h1"})]
    done = ("w3", "result", {"verdict": "completed", "code": 0})
    for n, keys in enumerate(([], ["k"])):
        refusal = ("w2", "result", {"verdict": "refused", "code": 4, "keys": keys})
        path = tmp_path / str(n)
        path.mkdir()
        verdict = _history(path, [*claimed, refusal, done])
        assert verdict.wrong_refusals == 0, verdict.explain()
    # Dropped by another holder: nothing was dropped, the call is in doubt still.
    stranger = [*CLEAN[:3], ("w2", "release_sent", {"key": "k", "holder": "h2"})]
    none = ("w2", "result", {"verdict": "refused", "code": 4, "keys": []})
    path = tmp_path / "stranger"
    path.mkdir()
    assert _history(path, [*stranger, none, done]).wrong_refusals == 1
    # Claimed again after the drop: in doubt once more, and must be named.
    again = [*claimed, *CLEAN[1:3]]
    path = tmp_path / "again"
    path.mkdir()
    assert _history(path, [*again, none, done]).wrong_refusals == 1


def test_a_completed_call_named_in_a_refusal_is_a_wrong_refusal(tmp_path: Path) -> None:
    refusal = ("w2", "result", {"verdict": "refused", "code": 4, "keys": ["k"]})
    verdict = _history(tmp_path, [*CLEAN[:-1], refusal, CLEAN[-1]])
    assert verdict.wrong_refusals == 1, verdict.explain()


def test_a_call_completed_after_the_refuser_took_the_run_may_be_named(tmp_path: Path) -> None:
    # w2 took the run while k was in flight (w1 stalled past its ttl, or on SQLite a clock
    # ahead took a live lease); w1 then recorded k (a complete is the holder's, not
    # fenced) while w2 was deciding: w2 saw k in doubt, and naming it is no guess.
    events = [
        *CLEAN[:4],
        ("w2", *_grant(2)),
        *CLEAN[4:6],
        ("w2", "result", {"verdict": "refused", "code": 4, "keys": ["k"]}),
        ("w3", "result", {"verdict": "completed", "code": 0}),
    ]
    verdict = _history(tmp_path, events)
    assert verdict.wrong_refusals == 0, verdict.explain()


def test_a_run_that_never_completes_or_hangs_fails(tmp_path: Path) -> None:
    hang = ("harness", "hang", {"worker": "w1", "detail": "stack"})
    verdict = _history(tmp_path, [*CLEAN[:-1], hang])
    assert verdict.hangs == 1 and verdict.unfinished == 1
    assert "stack" in verdict.explain()


def test_a_completed_run_whose_call_never_took_effect_fails(tmp_path: Path) -> None:
    verdict = _history(tmp_path, [e for e in CLEAN if e[1] != "effect"])
    assert verdict.lost_effects == 1 and not verdict.ok


def _ev(seq: int, ev: str, proc: str, t: float, **fields: Any) -> Event:
    return Event(seq=seq, ev=ev, run="r", proc=proc, t=int(t * 1e9), fields=fields)


def test_a_lease_taken_while_another_was_live_is_found_and_a_lapsed_one_is_not() -> None:
    # w1 renewed at 1.0 s (ttl 0.6, so live until at least 1.6 s) and ended superseded.
    base = [
        _ev(0, "start", "w1", 0.0, mode="carry"),
        _ev(1, "acquire_ok", "w1", 0.1, fence=1, sent=int(0.05e9)),
        _ev(2, "renew_ok", "w1", 1.01, fence=1, sent=int(1.0e9)),
        _ev(3, "result", "w1", 3.0, verdict="superseded"),
    ]
    early = _ev(4, "acquire_ok", "w2", 1.3, fence=2, sent=int(1.2e9))
    late = _ev(4, "acquire_ok", "w2", 1.8, fence=2, sent=int(1.7e9))
    assert live_takeovers([*base, early], 0.6) == ["r: w2 took fence 2 from w1"]
    assert live_takeovers([*base, late], 0.6) == []
    # A holder that completed may have released its lease: taking it early is no sign.
    done = [*base[:3], _ev(3, "result", "w1", 1.2, verdict="completed")]
    assert live_takeovers([*done, early], 0.6) == []
