"""Attacks on the session's three fixes: call ids holding a secret replaced by a digest as
the model's answer comes in (a7206aa, ``run/screening.py``), and an attempt whose lease may
have lapsed saying ``LeaseLostError`` instead of refusing in doubt, declaring a divergence
or returning a waiting run (b5ff365, bd01268, ``run/holding.py``, ``AgentRunner._settled``).

Defects, found as strict xfails and fixed (markers removed): a run's input and a
submission get the same id replacement, in calls and results alike
(``screening.without_secret_ids``), and a model's own ``call_masked_...`` id is replaced
too, so no two ids become one.

1. (MEDIUM) ``test_a_secret_call_id_in_the_run_input_is_not_stored_raw``: only the model's
   answer is screened; a call id in the messages a run starts from (a conversation carried
   over) reaches the transcript (``adk_history``) as given, while a secret in the same
   input's text is masked.
2. (MEDIUM) ``test_a_secret_call_id_in_a_submission_is_not_stored_raw``: the same through
   ``runner.submit`` (the work index keeps the submission's call ids raw).
3. (LOW) ``test_two_distinct_model_call_ids_never_become_one``: the replacement
   ``call_masked_<digest>`` lives in the ids a model may use itself; a turn asking with a
   secret id and with that id's replacement gets one id for two calls (README: "two masked
   ids must not become one"), and both results go back to the provider under it.

What held: twins under one secret id each run once (also across a crash) and no store keeps
the id; streamed events carry only the replacement; the OpenAI and Anthropic wire shapes
pair each replaced id with its result; an approval names calls by the replacement and the
approved calls go out once; a resume whose reads are slower than the ttl (renewals
working) still parks the run in doubt for an operator; with renewals failing every take
ends in ``LeaseLostError`` and the run is parked after ``max_attempts`` with nothing sent
again; without a lease store a resume still refuses a call in doubt.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from run.helpers import Asks, at, faulty_runner, fresh_stores
from run.shared_key import EVERY, T, booking, books, crashes
from tesserix_adk import (
    Agent,
    AgentRunner,
    IndeterminateToolCallError,
    LeasePolicy,
    Message,
    RunStatus,
    ToolCall,
    ToolContext,
    ToolOutcome,
    tool,
)
from tesserix_adk.providers import anthropic as anthropic_wire
from tesserix_adk.providers import openai as openai_wire
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.stores.protocols import WorkState
from tesserix_adk.testing.faults import SimulatedCrash
from tesserix_adk.worker import Backoff, Worker

SECRET = "sk-proj-QZSECRETQZaaaaaaaaaaaaaaaaaaaa1"
NEEDLE = "QZSECRETQZ"
TTL = 0.5
POLICY = LeasePolicy(ttl=TTL, renew_within=TTL / 2)


def replaced(call_id: str) -> str:
    """The id ``run/screening.py`` gives a call id holding a secret."""
    return "call_masked_" + hashlib.sha256(call_id.encode()).hexdigest()[:24]


def sqlite_text(path: Path) -> str:
    """Every cell of every table of the SQLite file, and its raw bytes."""
    out = []
    for suffix in ("", "-wal", "-journal"):
        f = Path(str(path) + suffix)
        if f.exists():
            out.append(f.read_bytes().decode("latin-1"))
    with contextlib.closing(sqlite3.connect(path)) as db:
        tables = [r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")]
        for table in tables:
            for row in db.execute(f'SELECT * FROM "{table}"'):
                out.extend(c.decode("latin-1") if isinstance(c, bytes) else str(c) for c in row)
    return "\n".join(out)


def sent_tool(sent: list[tuple[str, str]], *, approval: bool = False) -> Any:
    @tool(requires_approval=approval)
    async def book(order: str, ctx: ToolContext) -> str:
        """Book an order (side-effecting, default key)."""
        sent.append((order, ctx.call.id))
        return f"booked {order}"

    return book


def history_with_secret_id() -> list[Message]:
    return [
        Message.user("earlier: my key is sk-proj-QZTEXTQZbbbbbbbbbbbbbbbbbbbbbb2"),
        Message(
            role="assistant",
            content="",
            tool_calls=(ToolCall(id=SECRET, name="book", arguments={"order": "0"}),),
        ),
        Message.tool_result(ToolOutcome(call_id=SECRET, content="booked 0")),
        Message.user("and now?"),
    ]


# --- 1. call ids holding a secret -------------------------------------------------------


async def test_a_secret_call_id_in_the_run_input_is_not_stored_raw(tmp_path: Path) -> None:
    sent: list[tuple[str, str]] = []
    agent = Agent("shop", "Book.", [sent_tool(sent)])
    async with fresh_stores("sqlite", tmp_path) as stores:
        runner = AgentRunner.from_stores(Asks("done"), stores, lease_policy=POLICY)
        done = await runner.run(agent, history_with_secret_id(), tenant=T, run_id="r")
        assert done.status is RunStatus.completed
    stored = sqlite_text(tmp_path / "adk.sqlite3")
    assert "QZTEXTQZ" not in stored  # the input's text is masked
    assert NEEDLE not in stored  # ... and so must its call ids be


async def test_a_secret_call_id_in_a_submission_is_not_stored_raw(tmp_path: Path) -> None:
    agent = Agent("shop", "Book.", [sent_tool([])])
    async with fresh_stores("sqlite", tmp_path) as stores:
        runner = AgentRunner.from_stores(Asks("done"), stores, lease_policy=POLICY)
        await runner.submit(agent, history_with_secret_id(), tenant=T, run_id="r")
    stored = sqlite_text(tmp_path / "adk.sqlite3")
    assert "QZTEXTQZ" not in stored
    assert NEEDLE not in stored


async def test_two_distinct_model_call_ids_never_become_one(tmp_path: Path) -> None:
    sent: list[tuple[str, str]] = []
    agent = Agent("shop", "Book.", [sent_tool(sent)])
    model = Asks(
        [
            ToolCall(id=SECRET, name="book", arguments={"order": "1"}),
            ToolCall(id=replaced(SECRET), name="book", arguments={"order": "2"}),
        ],
        "done",
    )
    async with fresh_stores("memory", tmp_path) as stores:
        runner = AgentRunner.from_stores(model, stores, lease_policy=POLICY)
        done = await runner.run(agent, "go", tenant=T, run_id="r")
        assert done.status is RunStatus.completed
    assert sorted(o for o, _ in sent) == ["1", "2"]  # each sent once
    # The model told two calls apart; the provider must be able to as well.
    [asked] = [m for m in model.requests[-1].messages if m.tool_calls]
    ids = [c.id for c in asked.tool_calls]
    assert len(set(ids)) == 2, ids


@pytest.mark.parametrize("where", EVERY)
async def test_twins_under_one_secret_id_each_run_once_across_a_crash(
    where: str, tmp_path: Path
) -> None:
    """Two identical calls under one secret id: each sent once, though the attempt dies
    after both went out and before their results were checkpointed; the resume replays
    both, and neither the frontier, the transcript nor the records keep the id."""
    sent: list[tuple[str, str]] = []
    agent = Agent("shop", "Book.", [sent_tool(sent)])
    twins = [ToolCall(id=SECRET, name="book", arguments={"order": "1"})] * 2
    async with fresh_stores(where, tmp_path) as stores:
        dying = faulty_runner(
            stores,
            Asks(twins, "done"),
            crash_before=at("after_tool_result", 0),
            lease_policy=POLICY,
        )
        with pytest.raises(SimulatedCrash):
            await dying.run(agent, "go", tenant=T, run_id="r")
        await asyncio.sleep(TTL * 1.5)  # its lease lapses
        model = Asks(twins, "done")
        again = AgentRunner.from_stores(model, stores, lease_policy=POLICY)
        done = await again.resume(agent, "r", tenant=T)
        assert done.status is RunStatus.completed
        assert sent == [("1", replaced(SECRET))] * 2, sent
        told = [m.text for m in model.requests[-1].messages if m.tool_call_id is not None]
        assert told == ["booked 1", "booked 1"], told
        await assert_nothing_keeps_the_secret(stores)
    if where == "sqlite":
        assert NEEDLE not in sqlite_text(tmp_path / "adk.sqlite3")


async def assert_nothing_keeps_the_secret(stores: Stores) -> None:
    cp = await stores.checkpoints.latest(T, "r")
    assert cp is not None
    assert NEEDLE not in repr(cp)
    records = await stores.idempotency.records(T, "r")
    assert records and NEEDLE not in repr(records)


async def test_streamed_events_and_wire_requests_carry_only_the_replacement(
    tmp_path: Path,
) -> None:
    sent: list[tuple[str, str]] = []
    agent = Agent("shop", "Book.", [sent_tool(sent)])
    other = "Bearer QZSECRETQZcccccccccccccccccccccc"
    model = Asks(
        [
            ToolCall(id=SECRET, name="book", arguments={"order": "1"}),
            ToolCall(id=other, name="book", arguments={"order": "2"}),
        ],
        "done",
    )
    async with fresh_stores("memory", tmp_path) as stores:
        runner = AgentRunner.from_stores(model, stores, lease_policy=POLICY)
        events = [e async for e in runner.stream(agent, "go", tenant=T, run_id="r")]
    assert events and all(NEEDLE not in repr(e) for e in events)
    assert sorted(o for o, _ in sent) == ["1", "2"]
    messages = model.requests[-1].messages
    wire = openai_wire._wire_messages("Book.", messages)
    asked = [c["id"] for m in wire for c in m.get("tool_calls") or ()]
    answered = [m["tool_call_id"] for m in wire if m["role"] == "tool"]
    assert asked == answered == [replaced(SECRET), replaced(other)]
    _, turns = anthropic_wire._wire_turns("Book.", messages)
    uses = [b["id"] for t in turns for b in t["content"] if b.get("type") == "tool_use"]
    results = [
        b["tool_use_id"] for t in turns for b in t["content"] if b.get("type") == "tool_result"
    ]
    assert uses == results == [replaced(SECRET), replaced(other)]
    assert NEEDLE not in repr(wire) + repr(turns)


@pytest.mark.parametrize("where", EVERY)
async def test_an_approval_names_the_replacement_and_the_approved_calls_go_once(
    where: str, tmp_path: Path
) -> None:
    sent: list[tuple[str, str]] = []
    agent = Agent("shop", "Book.", [sent_tool(sent, approval=True)])
    calls = [
        ToolCall(id=SECRET, name="book", arguments={"order": "1"}),
        ToolCall(id=SECRET, name="book", arguments={"order": "2"}),
    ]
    async with fresh_stores(where, tmp_path) as stores:
        runner = AgentRunner.from_stores(Asks(calls, "done"), stores, lease_policy=POLICY)
        waiting = await runner.run(agent, "go", tenant=T, run_id="r")
        assert waiting.status is RunStatus.waiting_approval
        request = waiting.pending_approval
        assert request is not None
        assert [c.id for c in request.calls] == [replaced(SECRET)] * 2
        stored = await stores.approvals.get(T, request.id)
        assert stored is not None and NEEDLE not in repr(stored)
        await stores.approvals.decide(T, request.id, approved=True, by="ops")
        done = await runner.resume(agent, "r", tenant=T)
        assert done.status is RunStatus.completed
        again = await runner.resume(agent, "r", tenant=T)
        assert again.status is RunStatus.completed
    assert sorted(o for o, _ in sent) == ["1", "2"], sent


# --- 2. lease lapses and refusals -----------------------------------------------------


class SlowReads:
    """An idempotency store whose reads of records answer ``delay`` seconds late."""

    def __init__(self, inner: Any, delay: float) -> None:
        self.inner = inner
        self.delay = delay

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def lookup(self, keys: Any, *, tenant: str) -> Any:
        await asyncio.sleep(self.delay)
        return await self.inner.lookup(keys, tenant=tenant)

    async def records(self, tenant: str, run_id: str) -> Any:
        await asyncio.sleep(self.delay)
        return await self.inner.records(tenant, run_id)


class StuckRenewals:
    """A lease store whose renewals never answer (a network holding them back)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def renew(self, lease: Any, ttl: float) -> Any:
        await asyncio.Event().wait()


async def in_doubt(stores: Stores, sent: list[str]) -> Agent:
    """Run r1's booking dies in flight: a genuine call in doubt."""
    agent = Agent("shop", "Book.", [booking(sent, {"r1"})])
    await crashes(AgentRunner.from_stores(books("c1"), stores, lease_policy=POLICY), agent, "r1")
    return agent


async def carried(worker: Worker) -> None:
    await asyncio.wait_for(worker.run(), 30)


@pytest.mark.parametrize("where", ["memory", "sqlite"])
async def test_reads_slower_than_the_ttl_still_park_a_call_in_doubt(
    where: str, tmp_path: Path
) -> None:
    """Renewals working, the plan's reads each take longer than the ttl: the lease holds,
    so the refusal reaches an operator (parked, naming the call) instead of LeaseLostError."""
    sent: list[str] = []
    async with fresh_stores(where, tmp_path) as stores:
        agent = await in_doubt(stores, sent)
        runner = AgentRunner.from_stores(
            books("c1"), stores, lease_policy=POLICY, resume_claim_ttl=TTL
        )
        runner.idempotency = SlowReads(stores.idempotency, TTL * 1.5)
        worker = Worker(
            runner,
            [agent],
            max_attempts=3,
            poll_interval=0.05,
            backoff=Backoff(base=0.05, cap=0.1),
            exit_when_idle=True,
        )
        await carried(worker)
        assert [str(how) for _, how in worker.carried] == ["parked"]
        [item] = await stores.work.items(T)
        assert item.state is WorkState.parked
        assert item.reason is not None and "IndeterminateToolCallError" in item.reason
    assert sent == ["r1"]


@pytest.mark.parametrize("where", ["memory", "sqlite"])
async def test_renewals_failing_every_take_end_parked_with_nothing_sent_again(
    where: str, tmp_path: Path
) -> None:
    """Every take's renewals hang and its reads outlast the ttl: each refusal becomes
    LeaseLostError ("elsewhere"), and the worker parks the run after max_attempts takes
    (its reason no longer names the call in doubt: LOW, noted in the report)."""
    sent: list[str] = []
    async with fresh_stores(where, tmp_path) as stores:
        agent = await in_doubt(stores, sent)
        runner = AgentRunner.from_stores(
            books("c1"), stores, lease_policy=POLICY, resume_claim_ttl=TTL
        )
        runner.idempotency = SlowReads(stores.idempotency, TTL * 1.5)
        runner.leases = StuckRenewals(stores.leases)
        worker = Worker(
            runner,
            [agent],
            max_attempts=3,
            poll_interval=0.05,
            backoff=Backoff(base=0.05, cap=0.1),
            exit_when_idle=True,
        )
        await carried(worker)
        assert [str(how) for _, how in worker.carried] == [
            "elsewhere",
            "elsewhere",
            "elsewhere",
            "parked",
        ]
        [item] = await stores.work.items(T)
        assert item.state is WorkState.parked
    assert sent == ["r1"]


@pytest.mark.parametrize("where", ["memory", "sqlite"])
async def test_without_a_lease_store_a_resume_still_refuses_in_doubt(
    where: str, tmp_path: Path
) -> None:
    sent: list[str] = []
    async with fresh_stores(where, tmp_path) as stores:
        agent = await in_doubt(stores, sent)
        runner = AgentRunner.from_stores(books("c1"), stores, lease_policy=POLICY)
        runner.leases = None
        with pytest.raises(IndeterminateToolCallError):
            await runner.resume(agent, "r1", tenant=T)
    assert sent == ["r1"]
