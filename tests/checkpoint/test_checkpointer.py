"""Checkpointer: redaction before any byte is stored, formats, corruption, golden payloads."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from booking import BOOK_TURNS, Airline, booking_agent
from tesserix_adk import (
    Agent,
    AgentRunner,
    BinaryPart,
    CheckpointCorruptError,
    Checkpointer,
    CheckpointError,
    CheckpointFormatError,
    CheckpointStatus,
    MemoryApprovalStore,
    MemoryCheckpointStore,
    MemoryHistoryStore,
    MemoryIdempotencyStore,
    Message,
    RevisionMismatchError,
    RunStatus,
    ScriptedProvider,
    ScriptedTurn,
    TextPart,
    tool,
)
from tesserix_adk.checkpoint.payload import (
    CARRIER_FORMAT,
    MASKED_STATE_FORMAT,
    Boundary,
    Carrier,
    Checkpoint,
    decode_checkpoint,
    encode_checkpoint,
)
from tesserix_adk.checkpoint.redaction import Redactor
from tesserix_adk.stores.protocols import HistoryHandle
from tesserix_adk.testing.corruption import resealed
from tesserix_adk.testing.faults import FaultyCheckpointStore, SimulatedCrash
from tesserix_adk.testing.secrets import leaked_secrets, planted_secrets

GOLDEN = Path(__file__).parent / "golden"


class _Stores:
    def __init__(self) -> None:
        self.checkpoints = FaultyCheckpointStore(MemoryCheckpointStore())
        self.history = MemoryHistoryStore()
        self.idempotency = MemoryIdempotencyStore()
        self.approvals = MemoryApprovalStore()

    async def every_byte(self, tenant: str, run_id: str) -> bytes:
        """Everything any store holds for the run, concatenated."""
        blobs = list(self.checkpoints.payloads)
        latest = await Checkpointer(self.checkpoints, history=self.history).latest(tenant, run_id)
        assert latest is not None and latest.history_handle is not None
        blobs += await self.history.fetch(latest.history_handle)
        for rec in await self.idempotency.records(tenant, run_id):
            blobs.append(rec.outcome or b"")
        return b"\n".join(blobs)


def _secret_agent(secrets: dict[str, str], *, approval: bool = False) -> Agent:
    @tool(requires_approval=approval)
    def lookup_customer(customer: str, note: str) -> dict[str, Any]:
        """Look a customer up."""
        return {"customer": customer, "found": list(secrets.values()), "password": "hunter2"}

    return Agent("support", "Help.", [lookup_customer])


def _secret_turns(secrets: dict[str, str]) -> list[Any]:
    joined = " ".join(secrets.values())
    return [
        ScriptedTurn(
            text=f"Looking up with {joined}",
            calls=[("lookup_customer", {"customer": "c-1", "note": joined})],
        ),
        f"Done: {joined}",
    ]


async def test_planted_secrets_never_reach_any_store() -> None:
    secrets = planted_secrets()
    stores = _Stores()
    runner = AgentRunner(
        ScriptedProvider(_secret_turns(secrets)),
        idempotency=stores.idempotency,
        checkpoints=Checkpointer(stores.checkpoints, history=stores.history),
    )
    user = "my keys: " + " ".join(secrets.values())
    run = await runner.run(_secret_agent(secrets), user, tenant="acme", run_id="r")
    assert run.status is RunStatus.completed
    stored = await stores.every_byte("acme", "r")
    assert leaked_secrets(stored) == []
    assert b"hunter2" not in stored
    for kind in secrets:
        assert f"[redacted:{kind}]".encode() in stored


async def test_approval_requests_are_redacted_too() -> None:
    secrets = planted_secrets()
    stores = _Stores()
    runner = AgentRunner(
        ScriptedProvider(_secret_turns(secrets)),
        idempotency=stores.idempotency,
        checkpoints=Checkpointer(stores.checkpoints, history=stores.history),
        approvals=stores.approvals,
    )
    run = await runner.run(_secret_agent(secrets, approval=True), "go", tenant="acme", run_id="r")
    assert run.pending_approval is not None
    request = await stores.approvals.get("acme", run.pending_approval.id)
    assert request is not None
    assert leaked_secrets(json.dumps([dict(c.arguments) for c in request.calls])) == []


async def test_extra_patterns_are_masked_too() -> None:
    stores = _Stores()
    runner = AgentRunner(
        ScriptedProvider(["ok"]),
        idempotency=stores.idempotency,
        checkpoints=Checkpointer(
            stores.checkpoints, history=stores.history, extra_patterns=(r"EMP-\d+",)
        ),
    )
    await runner.run(Agent("a", "b"), "employee EMP-12345", tenant="acme", run_id="r")
    stored = await stores.every_byte("acme", "r")
    assert b"EMP-12345" not in stored
    assert b"[redacted:custom]" in stored


async def test_redact_false_keeps_secrets() -> None:
    secrets = planted_secrets()
    stores = _Stores()
    runner = AgentRunner(
        ScriptedProvider(["ok"]),
        idempotency=stores.idempotency,
        checkpoints=Checkpointer(stores.checkpoints, history=stores.history, redact=False),
    )
    await runner.run(Agent("a", "b"), secrets["github_token"], tenant="acme", run_id="r")
    assert secrets["github_token"].encode() in await stores.every_byte("acme", "r")


async def test_binary_parts_come_back_byte_for_byte() -> None:
    data = bytes(range(256)) * 4 + planted_secrets()["openai_key"].encode()
    for history in (MemoryHistoryStore(), None):
        checkpointer = Checkpointer(MemoryCheckpointStore(), history=history)
        runner = AgentRunner(
            ScriptedProvider(["ok"]), idempotency=MemoryIdempotencyStore(), checkpoints=checkpointer
        )
        message = Message.user(
            [TextPart(text="see image"), BinaryPart(data=data, media_type="image/png")]
        )
        await runner.run(Agent("a", "b"), message, tenant="acme", run_id="r")
        frontier = await checkpointer.latest("acme", "r")
        assert frontier is not None
        first = (await checkpointer.messages(frontier))[0]
        assert not isinstance(first.content, str)
        assert first.content[1] == BinaryPart(data=data, media_type="image/png")


# --- failing closed ----------------------------------------------------------------------


def _outstanding(payload: bytes, **change: Any) -> bytes:
    return resealed(payload, lambda b: b["outstanding"][0].update(change))


async def _finished_run(airline: Airline) -> tuple[MemoryCheckpointStore, MemoryIdempotencyStore]:
    """A run that died right after the model asked for book_seat: a resume has work to do."""
    store = MemoryCheckpointStore()
    idem = MemoryIdempotencyStore()
    faulty = FaultyCheckpointStore(
        store,
        crash_after=lambda b: b["boundary"] == "after_model_call" and b["iteration"] == 1,
    )
    runner = AgentRunner(
        ScriptedProvider(BOOK_TURNS), idempotency=idem, checkpoints=Checkpointer(faulty)
    )
    with pytest.raises(SimulatedCrash):
        await runner.run(booking_agent(airline), "book", tenant="acme", run_id="r")
    return store, idem


async def _overwrite(store: MemoryCheckpointStore, payload: bytes) -> None:
    latest = await store.latest("acme", "r")
    assert latest is not None
    await store.put("acme", "r", payload, step=latest.step + 1, fence=latest.fence)


@pytest.mark.parametrize(
    ("mangle", "error"),
    [
        (
            lambda p: resealed(p, lambda b: b.update(format=MASKED_STATE_FORMAT + 1)),
            CheckpointFormatError,
        ),
        (
            lambda p: json.dumps({**json.loads(p), "format": MASKED_STATE_FORMAT + 1}).encode(),
            CheckpointFormatError,
        ),
        (lambda p: json.dumps(json.loads(p)).encode(), CheckpointCorruptError),
        (lambda p: b"\x00garbage\xff" + p[:10], CheckpointCorruptError),
        (lambda p: p[: len(p) // 2], CheckpointCorruptError),
        (lambda p: resealed(p, lambda b: b.update(run_id="other")), CheckpointCorruptError),
        (lambda p: resealed(p, lambda b: b.pop("outstanding")), CheckpointCorruptError),
        (lambda p: _outstanding(p, key=5), CheckpointCorruptError),
        (lambda p: _outstanding(p, arguments=["x"]), CheckpointCorruptError),
        (lambda p: resealed(p, lambda b: b.update(fence="seven")), CheckpointCorruptError),
        (lambda p: _outstanding(p, side_effects="false"), CheckpointCorruptError),
        (lambda p: resealed(p, lambda b: b.update(boundary=None)), CheckpointCorruptError),
    ],
    ids=[
        "newer-format",
        "newer-format-another-envelope",
        "re-serialised",
        "garbage",
        "truncated",
        "other-run",
        "missing-field",
        "key-not-a-string",
        "arguments-not-an-object",
        "fence-not-a-number",
        "flag-not-a-bool",
        "no-boundary",
    ],
)
async def test_unreadable_frontier_refuses_with_a_typed_error_and_stays_untouched(
    airline: Airline, mangle: Any, error: type[Exception]
) -> None:
    store, idem = await _finished_run(airline)
    latest = await store.latest("acme", "r")
    assert latest is not None
    bad = mangle(latest.payload)
    await _overwrite(store, bad)
    runner = AgentRunner(
        ScriptedProvider(BOOK_TURNS), idempotency=idem, checkpoints=Checkpointer(store)
    )
    with pytest.raises(error):
        await runner.resume(booking_agent(airline), "r", tenant="acme")
    after = await store.latest("acme", "r")
    assert after is not None and after.payload == bad


async def test_changed_revision_is_refused_and_the_frontier_stays(airline: Airline) -> None:
    store = MemoryCheckpointStore()
    idem = MemoryIdempotencyStore()
    runner = AgentRunner(
        ScriptedProvider(BOOK_TURNS), idempotency=idem, checkpoints=Checkpointer(store)
    )
    await runner.run(booking_agent(airline, max_iterations=1), "b", tenant="acme", run_id="r")
    before = await store.latest("acme", "r")
    changed = Agent("booking", "Book the flight, and upsell insurance.", [])
    with pytest.raises(RevisionMismatchError):
        await runner.resume(changed, "r", tenant="acme")
    assert await store.latest("acme", "r") == before


# --- typed state -------------------------------------------------------------------------


class Ticket(BaseModel):
    phase: str
    ticket_id: str


async def test_state_is_validated_on_save_and_an_invalid_state_is_not_saved() -> None:
    @tool(side_effects=False)
    def lose_ticket(ctx: Any = None) -> str:
        """Break the state."""
        ctx.state.ticket_id = None  # pydantic models are mutable; this one is now invalid
        return "ok"

    agent = Agent("t", "i", [lose_ticket], state_schema=Ticket)
    store = FaultyCheckpointStore(MemoryCheckpointStore())
    checkpointer = Checkpointer(store)
    runner = AgentRunner(
        ScriptedProvider([[("lose_ticket", {})], "done"]),
        idempotency=MemoryIdempotencyStore(),
        checkpoints=checkpointer,
    )
    state = Ticket(phase="apply", ticket_id="T-1")
    # The run stops, typed, at the first frontier that cannot hold its state (it used to
    # go on with nothing kept, its last frontier saying it was running).
    with pytest.raises(CheckpointError, match="does not validate"):
        await runner.run(agent, "go", tenant="acme", run_id="r", state=state)
    assert [p["state"] for p in store.puts] == [{"phase": "apply", "ticket_id": "T-1"}]
    assert "does not validate" in str(checkpointer.last_error)


async def test_state_is_validated_on_load() -> None:
    agent = Agent("t", "i", [], state_schema=Ticket, max_iterations=1)
    store = MemoryCheckpointStore()
    idem = MemoryIdempotencyStore()
    runner = AgentRunner(
        ScriptedProvider([[("nothing", {})]]), idempotency=idem, checkpoints=Checkpointer(store)
    )
    await runner.run(agent, "go", tenant="acme", run_id="r", state=Ticket(phase="a", ticket_id="1"))
    latest = await store.latest("acme", "r")
    assert latest is not None
    changed = resealed(
        latest.payload,
        lambda b: b.update(
            status="running",
            boundary="after_tool_result",
            state={"phase": "x"},
            step=b["step"] + 1,  # _overwrite stores it as the next step
        ),
    )
    await _overwrite(store, changed)
    with pytest.raises(CheckpointCorruptError, match="state"):
        await runner.resume(
            Agent("t", "i", [], state_schema=Ticket, max_iterations=1), "r", tenant="acme"
        )


# --- golden payloads ---------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(p.name for p in GOLDEN.glob("format*.json")))
def test_golden_payloads_of_released_formats_are_still_read(name: str) -> None:
    payload = (GOLDEN / name).read_bytes()
    cp = decode_checkpoint(payload, tenant="acme", run_id="run_1")
    expected = json.loads((GOLDEN / name.replace(".json", ".expected")).read_text())
    assert cp.format == expected["format"]
    assert str(cp.status) == expected["status"]
    assert cp.step == expected["step"]
    assert cp.iteration == expected["iteration"]
    assert [(o.call.name, o.key) for o in cp.outstanding] == [
        tuple(x) for x in expected["outstanding"]
    ]
    if cp.status is not CheckpointStatus.tombstone:
        assert cp.history_handle is not None
        assert cp.history_handle.count == expected["history_count"]
        assert cp.state == expected["state"]


@pytest.mark.parametrize("own", ["messages", "handle", "both", "neither"])
def test_a_frontier_encoded_naming_a_transcript_is_that_frontier_naming_it(own: str) -> None:
    """``encode_checkpoint(..., history=h)``, what a Checkpointer with a history store
    writes, is the frontier with its messages dropped and ``h`` as its handle."""
    ours = HistoryHandle(tenant="t", run_id="r", count=2, digest="sha256:" + "ab" * 32)
    named = HistoryHandle(tenant="t", run_id="r", count=3, digest="sha256:" + "cd" * 32)
    messages = (Message.user("book LH123"), Message.assistant("booked"))
    cp = Checkpoint(
        tenant="t",
        run_id="r",
        agent_name="a",
        step=4,
        boundary=Boundary.after_tool_result,
        status=CheckpointStatus.running,
        messages=messages if own in ("messages", "both") else None,
        history_handle=ours if own in ("handle", "both") else None,
        observation=[{"call_id": "c", "tool": "t", "content": "x", "is_error": False}],
    )
    redactor = Redactor()
    want = encode_checkpoint(dataclasses.replace(cp, messages=None, history_handle=named), redactor)
    assert encode_checkpoint(cp, redactor, history=named) == want
    read = decode_checkpoint(want, tenant="t", run_id="r")
    assert read.messages is None and read.history_handle is not None
    assert (read.history_handle.count, read.history_handle.digest) == (3, named.digest)


def _carried(**changes: Any) -> Checkpoint:
    return Checkpoint(
        tenant="t",
        run_id="r",
        agent_name="a",
        step=2,
        boundary=Boundary.before_approval,
        status=CheckpointStatus.waiting_approval,
        messages=(Message.user("book LH123"),),
        **changes,
    )


def test_a_frontier_naming_its_carrier_is_format_4_and_reads_back_naming_it() -> None:
    """A Temporal run's frontier says so, in a format a kit that reads only 3 refuses; a
    frontier of the kit's own run is written as before, naming none."""
    redactor = Redactor()
    payload = encode_checkpoint(_carried(carried_by=Carrier.temporal), redactor)
    assert json.loads(payload)["format"] == CARRIER_FORMAT == 4
    read = decode_checkpoint(payload, tenant="t", run_id="r")
    assert read.carried_by is Carrier.temporal and read.format == CARRIER_FORMAT
    own = encode_checkpoint(_carried(), redactor)
    assert json.loads(own)["format"] == 2 and b"carried_by" not in own
    assert decode_checkpoint(own, tenant="t", run_id="r").carried_by is None


@pytest.mark.parametrize(
    "mangle",
    [
        lambda b: b.update(format=3),  # a carrier in a format that has none
        lambda b: b.pop("carried_by"),  # format 4 without its carrier
        lambda b: b.update(carried_by="airflow"),  # no such carrier
        lambda b: b.update(carried_by=None),
        lambda b: b.update(carried_by=["temporal"]),
    ],
    ids=["format-3", "missing", "unknown", "null", "not-a-string"],
)
def test_a_frontier_whose_carrier_does_not_fit_its_format_is_corrupt(mangle: Any) -> None:
    payload = encode_checkpoint(_carried(carried_by=Carrier.temporal), Redactor())
    with pytest.raises(CheckpointCorruptError):
        decode_checkpoint(resealed(payload, mangle), tenant="t", run_id="r")
