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

    @tool(side_effects=False, inline=True)
    def slow_lookup(q: str) -> str:
        """Blocks the event loop past the lease ttl, so no renewal can happen (inline: a
        sync tool otherwise runs in a worker thread and the lease is renewed)."""
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


async def test_a_tool_exception_is_the_calls_error_outcome_recorded_and_answered() -> None:
    @tool
    def charge(amount: int) -> str:
        """Charge a card."""
        raise ValueError("card declined")

    seen: list[Any] = []

    class Records:
        def __init__(self) -> None:
            self.inner = ScriptedProvider([[("charge", {"amount": 5})], "The card was declined."])

        async def complete(self, request: Any) -> Any:
            seen.append(request)
            return await self.inner.complete(request)

    idem = MemoryIdempotencyStore()
    runner = AgentRunner(
        Records(), idempotency=idem, checkpoints=Checkpointer(MemoryCheckpointStore())
    )
    run = await runner.run(Agent("pay", "Charge.", [charge]), "pay", tenant="acme", run_id="r")
    assert run.status is RunStatus.completed
    answer = next(m for m in seen[-1].messages if m.tool_call_id == "call_0_0")
    assert answer.is_error and answer.text == "ValueError: card declined"
    (record,) = [r for r in await idem.records("acme", "r") if r.tool == "charge"]
    assert str(record.status) == "completed" and b'"is_error":true' in (record.outcome or b"")


async def test_an_idempotent_call_in_flight_is_sent_again_under_the_same_key() -> None:
    keys: list[str | None] = []

    def agent(crash: bool) -> Agent:
        @tool(idempotent=True)
        def refund(order: str, ctx: Any = None) -> str:
            """The payment provider deduplicates by our key."""
            keys.append(ctx.idempotency_key)
            if crash:
                raise SimulatedCrash
            return "refunded"

        return Agent("refunds", "Refund.", [refund])

    idem, store = MemoryIdempotencyStore(), MemoryCheckpointStore()
    turns = [[("refund", {"order": "o-1"})], "done"]

    def runner() -> AgentRunner:
        return AgentRunner(
            ScriptedProvider(turns), idempotency=idem, checkpoints=Checkpointer(store)
        )

    with pytest.raises(SimulatedCrash):
        await runner().run(agent(True), "refund", tenant="acme", run_id="r")
    run = await runner().resume(agent(False), "r", tenant="acme")
    assert run.status is RunStatus.completed
    assert len(keys) == 2 and keys[0] == keys[1]  # re-sent, with the key it deduplicates by


def test_a_history_store_other_than_the_checkpointers_is_refused() -> None:
    from tesserix_adk import ConfigurationError, Resumer

    checkpointer = Checkpointer(MemoryCheckpointStore(), history=MemoryHistoryStore())
    with pytest.raises(ConfigurationError, match="history"):
        AgentRunner(
            ScriptedProvider([]),
            idempotency=MemoryIdempotencyStore(),
            checkpoints=checkpointer,
            history=MemoryHistoryStore(),
        )
    with pytest.raises(ConfigurationError, match="history"):
        Resumer(checkpointer, MemoryLeaseStore(), MemoryHistoryStore(), MemoryIdempotencyStore())


async def test_a_waiting_run_with_an_unkeyed_call_keeps_waiting_until_decided() -> None:
    from tesserix_adk import MemoryApprovalStore
    from tesserix_adk.testing import FakeClock

    sent: list[str] = []
    dies = {"now": False}

    @tool(key=None, requires_approval=True)
    def wire_money(to: str) -> str:
        """Unkeyed and needs a person: nothing is sent before the decision."""
        sent.append(to)
        if dies["now"]:
            raise SimulatedCrash
        return "sent"

    agent = Agent("payments", "Pay.", [wire_money])
    clock = FakeClock()
    store, idem = MemoryCheckpointStore(), MemoryIdempotencyStore(clock=clock)
    approvals = MemoryApprovalStore()

    def runner() -> AgentRunner:
        return AgentRunner(
            ScriptedProvider([[("wire_money", {"to": "acct-1"})], "paid"]),
            idempotency=idem,
            checkpoints=Checkpointer(store),
            approvals=approvals,
        )

    run = await runner().run(agent, "pay", tenant="acme", run_id="r")
    assert run.status is RunStatus.waiting_approval and run.pending_approval is not None
    again = await runner().resume(agent, "r", tenant="acme")  # not refused: nothing ran
    assert again.status is RunStatus.waiting_approval and sent == []
    await approvals.decide("acme", run.pending_approval.id, approved=True, by="alice")
    # The resume that dispatches first writes a frontier naming the call; dying in the call
    # then leaves a frontier that refuses, instead of one that would send it again.
    dies["now"] = True
    with pytest.raises(SimulatedCrash):
        await runner().resume(agent, "r", tenant="acme")
    assert sent == ["acct-1"]
    clock.advance(301)  # the dead resumer's claim lapses by the store's clock
    with pytest.raises(IndeterminateToolCallError, match="wire_money"):
        await runner().resume(agent, "r", tenant="acme")
    assert sent == ["acct-1"]


async def test_a_decided_unkeyed_call_is_sent_once_when_nothing_dies() -> None:
    from tesserix_adk import MemoryApprovalStore

    sent: list[str] = []

    @tool(key=None, requires_approval=True)
    def wire_money(to: str) -> str:
        """Unkeyed and needs a person."""
        sent.append(to)
        return "sent"

    agent = Agent("payments", "Pay.", [wire_money])
    store, idem, approvals = (
        MemoryCheckpointStore(),
        MemoryIdempotencyStore(),
        MemoryApprovalStore(),
    )

    def runner() -> AgentRunner:
        return AgentRunner(
            ScriptedProvider([[("wire_money", {"to": "acct-1"})], "paid"]),
            idempotency=idem,
            checkpoints=Checkpointer(store),
            approvals=approvals,
        )

    run = await runner().run(agent, "pay", tenant="acme", run_id="r")
    assert run.pending_approval is not None
    await approvals.decide("acme", run.pending_approval.id, approved=True, by="alice")
    done = await runner().resume(agent, "r", tenant="acme")
    assert done.status is RunStatus.completed and sent == ["acct-1"]
