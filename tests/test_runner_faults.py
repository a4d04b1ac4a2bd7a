"""The run loop under faults: unkeyed calls, lost replies, lapsed leases, divergence at any end."""

from __future__ import annotations

import time
from typing import Any

import pytest

from booking import BOOK_TURNS, Airline, booking_agent
from tesserix_adk import (
    Agent,
    AgentRunner,
    Boundary,
    Checkpointer,
    CheckpointPolicy,
    DivergedRunError,
    IndeterminateToolCallError,
    LeaseLostError,
    LeasePolicy,
    MemoryCheckpointStore,
    MemoryHistoryStore,
    MemoryIdempotencyStore,
    MemoryLeaseStore,
    MemoryLedger,
    RunStatus,
    ScriptedProvider,
    StoreUnavailableError,
    Usage,
    tool,
)
from tesserix_adk.testing.faults import FaultyCheckpointStore, SimulatedCrash


def _mailer(sent: list[str], *, crash: bool = False) -> Agent:
    @tool(key=None)
    def send_email(to: str) -> str:
        """Send an email (no idempotency key: the mail server cannot deduplicate)."""
        sent.append(to)
        if crash:
            raise SimulatedCrash
        return "sent"

    return Agent("mailer", "Send mail.", [send_email])


MAIL_TURNS: list[Any] = [[("send_email", {"to": "a@example.com"})], "sent"]


async def test_unkeyed_call_forces_the_frontier_naming_it_whatever_the_policy() -> None:
    sent: list[str] = []
    store = FaultyCheckpointStore(MemoryCheckpointStore())
    policy = CheckpointPolicy(boundaries=frozenset({Boundary.after_tool_result}))
    idem = MemoryIdempotencyStore()

    def runner() -> AgentRunner:
        return AgentRunner(
            ScriptedProvider(MAIL_TURNS),
            idempotency=idem,
            checkpoints=Checkpointer(store, policy=policy),
        )

    with pytest.raises(SimulatedCrash):
        await runner().run(_mailer(sent, crash=True), "mail", tenant="acme", run_id="r")
    assert [p["boundary"] for p in store.puts] == ["after_model_call"]
    with pytest.raises(IndeterminateToolCallError, match="send_email"):
        await runner().resume(_mailer(sent), "r", tenant="acme")
    assert sent == ["a@example.com"]


async def test_unkeyed_call_is_not_sent_when_its_frontier_cannot_be_written() -> None:
    sent: list[str] = []
    store = FaultyCheckpointStore(MemoryCheckpointStore(), fail_with=ConnectionError("down"))
    runner = AgentRunner(
        ScriptedProvider(MAIL_TURNS),
        idempotency=MemoryIdempotencyStore(),
        checkpoints=Checkpointer(store),
    )
    with pytest.raises(StoreUnavailableError, match="send_email") as err:
        await runner.run(_mailer(sent), "mail", tenant="acme", run_id="r")
    assert err.value.retryable
    assert sent == []


async def test_a_holder_past_its_lease_deadline_sends_nothing_not_even_unkeyed_calls() -> None:
    sent: list[str] = []

    @tool(side_effects=False)
    def slow_lookup(q: str) -> str:
        """Blocks the event loop past the lease ttl, so no renewal can happen."""
        time.sleep(0.35)
        return q

    @tool(key=None)
    def send_email(to: str) -> str:
        """Unkeyed: nothing downstream could fence it out."""
        sent.append(to)
        return "sent"

    agent = Agent("mailer", "Send mail.", [slow_lookup, send_email])
    turns = [[("slow_lookup", {"q": "x"}), ("send_email", {"to": "a@example.com"})], "done"]
    runner = AgentRunner(
        ScriptedProvider(turns),
        idempotency=MemoryIdempotencyStore(),
        checkpoints=Checkpointer(MemoryCheckpointStore()),
        leases=MemoryLeaseStore(),
        lease_policy=LeasePolicy(ttl=0.3, renew_within=0.1),
    )
    with pytest.raises(LeaseLostError):
        await runner.run(agent, "go", tenant="acme", run_id="r")
    assert sent == []


async def test_a_lost_reply_to_a_claim_is_settled_by_reading_the_record(airline: Airline) -> None:
    inner = MemoryIdempotencyStore()
    lost: list[str] = []

    class LosesReplies:
        def __getattr__(self, name: str) -> Any:
            return getattr(inner, name)

        async def claim(self, key: str, **kwargs: Any) -> Any:
            record = await inner.claim(key, **kwargs)
            if kwargs.get("tool") == "book_seat" and not lost:
                lost.append(key)
                raise ConnectionResetError("reply lost after the claim was committed")
            return record

    runner = AgentRunner(
        ScriptedProvider(BOOK_TURNS),
        idempotency=LosesReplies(),  # type: ignore[arg-type]
        checkpoints=Checkpointer(MemoryCheckpointStore()),
    )
    run = await runner.run(booking_agent(airline), "book", tenant="acme", run_id="r")
    assert lost and run.status is RunStatus.completed
    assert airline.bookings == ["LH123"]


async def test_a_resumed_run_that_ends_on_budget_with_a_completed_call_ahead_is_diverged(
    airline: Airline,
) -> None:
    store = FaultyCheckpointStore(MemoryCheckpointStore())
    idem, ledger, history = MemoryIdempotencyStore(), MemoryLedger(), MemoryHistoryStore()
    policy = CheckpointPolicy(boundaries=frozenset({Boundary.after_tool_result}))

    def runner() -> AgentRunner:
        return AgentRunner(
            ScriptedProvider(BOOK_TURNS),
            idempotency=idem,
            ledger=ledger,
            checkpoints=Checkpointer(store, history=history, policy=policy),
        )

    agent = booking_agent(airline, budget_micros=1000)
    store.crash_before = lambda b: b.get("iteration") == 1
    with pytest.raises(SimulatedCrash):
        await runner().run(agent, "book", tenant="acme", run_id="r")
    store.crash_before = None
    await ledger.charge("acme", "r", 5000, Usage())  # the budget is gone by the ledger
    with pytest.raises(DivergedRunError):
        await runner().resume(agent, "r", tenant="acme")
    assert airline.bookings == ["LH123"]
    assert store.puts[-1]["iteration"] == 0  # no final frontier pretending nothing ran
