"""Continuation: start the engine's execution again, never the run, never unapproved."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import pytest

from tesserix_adk import ConfigurationError, Grant, HistoryHandle, PendingApproval
from tesserix_adk.checkpoint.continuation import (
    DEFAULT_CONTINUATION,
    Continuation,
    ContinuationPolicy,
    continued,
)


@dataclass
class EngineState:
    run_id: str = "run_1"
    journal: list[Any] = field(default_factory=list)
    history_handle: HistoryHandle | None = None
    spent_micros: int = 0
    iteration: int = 0
    grants: list[Grant] = field(default_factory=list)
    pending_approval: PendingApproval | None = None


def test_due_on_steps_or_on_history_bytes() -> None:
    policy = ContinuationPolicy(max_steps=3, max_history_bytes=1000)
    assert not policy.due([1, 2])
    assert policy.due([1, 2, 3])
    assert not policy.due([1], history_bytes=999)
    assert policy.due([1], history_bytes=1000)
    assert not DEFAULT_CONTINUATION.due([0] * 10)
    with pytest.raises(ConfigurationError):
        ContinuationPolicy(max_steps=0)


def test_continued_carries_handle_spend_iteration_and_approvals_but_not_the_journal() -> None:
    handle = HistoryHandle(tenant="acme", run_id="run_1", count=40, digest="sha256:ab")
    grant = Grant(request="req-1", call_id="c1", key="k1:x", approved=True, by="alice")
    pending = PendingApproval(id="req-2", calls=("c7",))
    state = EngineState(
        journal=[{"step": i} for i in range(500)],
        history_handle=handle,
        spent_micros=4100,
        iteration=12,
        grants=[grant],
        pending_approval=pending,
    )
    carry = continued(state, tenant="acme", agent_name="booking")
    assert (carry.history_handle, carry.spent_micros, carry.iteration) == (handle, 4100, 12)
    assert carry.grants == (grant,) and carry.pending_approval == pending
    assert carry.acting_under == frozenset({"req-1", "req-2"})
    assert not any(f.name == "journal" for f in dataclasses.fields(Continuation))


def test_a_continuation_that_drops_an_approval_cannot_be_built() -> None:
    grant = Grant(request="req-1", call_id="c1", key=None, approved=True, by="alice")
    carry = continued(EngineState(grants=[grant]), tenant="acme", agent_name="booking")
    with pytest.raises(ConfigurationError, match="req-1"):
        dataclasses.replace(carry, grants=())
    pending = continued(
        EngineState(pending_approval=PendingApproval(id="req-9", calls=("c",))),
        tenant="acme",
        agent_name="booking",
    )
    with pytest.raises(ConfigurationError, match="req-9"):
        dataclasses.replace(pending, pending_approval=None)
