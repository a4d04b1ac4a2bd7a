"""Attacks on "one carrier" (commit 2146604) without a Temporal server: a run whose frontier
names its carrier (``carried_by = Carrier.temporal``, format 4) as a Temporal activity
writes it, met by the kit's own commands on the same store.

Attacked: ``tesserix run --resume`` (its one sentence and exit code), ``run --resume
--accept-revision``, ``inspect`` (text and ``--json``) and ``runs`` of such a run,
``replay`` of one of its steps, ``cancel``, the kit's ``submit`` of its id, ``resolve``'s
hint and wake, and the codec (byte flips, carrier/format mismatches, an older payload).
(A kit worker meeting one is covered by tests/test_worker.py and, on Temporal, by
tests/on_temporal/test_attacks_one_carrier.py.)

Defects (all four fixed; their tests pass now: ``accept_revision`` refuses a carried run
before it writes anything, ``runs`` neither points such a run at ``--accept-revision`` nor
lists it as stuck, ``inspect`` says its workflow carries it on and names its carrier, text
and ``--json``):

- ``test_accept_revision_leaves_a_carried_run_as_its_workflow_left_it``:
  ``cli/resuming.py`` calls ``accept_revision`` (``run/upgrade.py`` ``_accept_held``)
  before ``runner.resume`` refuses the run; ``_accept_held`` never asks
  ``refuse_carried_by_workflow``, so the kit rewrites the Temporal run's frontier under
  another revision (a new step, an acceptance recorded) and then answers exit 4 "refused".
  The live workflow's next activity then meets a frontier of a revision it is not pinned to.
- ``test_runs_does_not_send_an_operator_to_accept_revision_for_a_carried_run``:
  ``cli/reasons.py`` ``blocked`` tells the operator to carry a Temporal run pinned to
  another revision on with ``tesserix run --resume ... --accept-revision``, a command
  that never carries it on (and, above, damages it).
- ``test_inspect_of_an_approved_carried_run_does_not_promise_a_resume``:
  ``cli/describe.py`` ``_where`` says "a resume carries it on" for a decided approval of a
  run the kit's resume refuses.
- ``test_inspect_json_names_the_runs_carrier``: neither ``inspect --json`` nor the text
  says which engine carries the run (``cli/inspecting.py`` has no ``carried_by``), so an
  operator cannot tell from the kit's own view why a resume is refused.

Held: the kit's resume and ``tesserix run --resume`` refuse an unfinished carried run with
``CarriedByWorkflowError`` (exit 4, one sentence, no lease kept, no reconciler asked); a
finished one reads back; a cancel keeps the carrier; the kit's ``submit`` of a carried
run's id queues nothing; a replay of a carried step is a kit run of its own (its frontiers
name no carrier) and sends nothing unstubbed; ``resolve`` of a carried run says to
``submit --temporal`` and wakes no worker; the codec refuses a byte flip, a carrier in
format 3, format 4 without one, and reads a golden format-2 frontier as carried by none.
"""

from __future__ import annotations

import asyncio
import dataclasses
import io
import json
from collections.abc import Callable
from typing import Any

import pytest

from booking import BOOK_TURNS, Airline
from tesserix_adk import (
    Agent,
    AgentRunner,
    Checkpointer,
    LeasePolicy,
    Reconciled,
    RunStatus,
    ScriptedProvider,
    open_stores,
    tool,
)
from tesserix_adk.checkpoint.payload import (
    Carrier,
    CheckpointStatus,
    decode_checkpoint,
    encode_checkpoint,
)
from tesserix_adk.checkpoint.redaction import Redactor
from tesserix_adk.cli import frontier_main, resume_main
from tesserix_adk.errors import CheckpointCorruptError, RunStartedError
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.stores.memory import MemoryWorkIndex
from tesserix_adk.testing.faults import SimulatedCrash

T = "acme"


def _stores() -> Stores:
    stores = open_stores("memory://")
    stores.work = MemoryWorkIndex(stores.leases)
    return stores


def _runner(stores: Stores, turns: list[Any] | None = None) -> AgentRunner:
    return AgentRunner.from_stores(
        ScriptedProvider(list(turns or BOOK_TURNS)),
        stores,
        lease_policy=LeasePolicy(ttl=2.0, renew_within=1.0),
        never_ran_margin=0.05,
    )


def _agent(
    airline: Airline,
    *,
    approval: bool = False,
    reconcile: Callable[..., Any] | None = None,
    instructions: str = "Book.",
) -> Agent:
    @tool
    def search_flights(origin: str, dest: str) -> list[str]:
        """Find flights."""
        return ["LH123"]

    @tool(reconcile=reconcile, requires_approval=approval)
    def book_seat(flight: str, ctx: Any) -> dict[str, str]:
        """Book a seat."""
        if airline.hook is not None:
            airline.hook("before")
        airline.bookings.append(f"{flight}:{ctx.idempotency_key}")
        return {"booking": f"B{len(airline.bookings)}"}

    return Agent("booking", instructions, [search_flights, book_seat])


# ``runs --agent test_attacks_one_carrier_kit:changed_agent``: the agent after a deploy.
changed_agent = _agent(Airline(), approval=True, instructions="Book, politely.")


async def _as_if_temporal_carried(stores: Stores, run_id: str) -> None:
    """Rewrite the run's frontier as its Temporal workflow's activity writes it."""
    cp = await Checkpointer.from_stores(stores).latest(T, run_id)
    assert cp is not None
    payload = encode_checkpoint(
        dataclasses.replace(cp, carried_by=Carrier.temporal, step=cp.step + 1), Redactor()
    )
    await stores.checkpoints.put(T, run_id, payload, step=cp.step + 1, fence=cp.fence)


async def _carried_waiting(stores: Stores, airline: Airline, **kwargs: Any) -> tuple[Agent, str]:
    """A Temporal run waiting on its approval; the agent and the request id."""
    agent = _agent(airline, approval=True, **kwargs)
    result = await _runner(stores).run(agent, "book", tenant=T, run_id="r1")
    assert result.status is RunStatus.waiting_approval and result.pending_approval is not None
    await _as_if_temporal_carried(stores, "r1")
    return agent, result.pending_approval.id


def _cli(
    main: Callable[..., int], argv: list[str], stores: Stores, **kwargs: Any
) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main(argv, stores=stores, out=out, err=err, **kwargs)
    return code, out.getvalue(), err.getvalue()


async def _latest(stores: Stores) -> Any:
    cp = await Checkpointer.from_stores(stores).latest(T, "r1")
    assert cp is not None
    return cp


# --- held ------------------------------------------------------------------------------------


async def test_run_resume_of_a_carried_run_is_one_sentence_exit_4_nothing_asked() -> None:
    stores, airline = _stores(), Airline()
    asked: list[str] = []

    def reconcile(call: Any, ctx: Any) -> Reconciled:
        asked.append(call.name)
        return Reconciled.never_ran()

    agent, _ = await _carried_waiting(stores, airline, reconcile=reconcile)
    before = await _latest(stores)
    argv = ["run", "--resume", "r1", "--tenant", T, "--agent", "booking"]
    code, out, err = await asyncio.to_thread(
        _cli, resume_main, argv, stores, agents={"booking": agent}, provider=ScriptedProvider([])
    )
    assert code == 4, (out, err)
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert "temporal workflow" in err and "submit --temporal" in err, err
    after = await _latest(stores)
    assert (after.step, after.carried_by) == (before.step, Carrier.temporal)
    assert airline.bookings == [] and asked == []
    assert await stores.leases.current(T, "r1") is None  # no lease left behind


async def test_a_cancelled_carried_run_keeps_its_carrier_and_reads_back() -> None:
    stores, airline = _stores(), Airline()
    agent, _ = await _carried_waiting(stores, airline)
    ended = await _runner(stores).cancel("r1", tenant=T, by="ops", reason="no longer needed")
    assert ended is not None and ended.status is RunStatus.cancelled
    cp = await _latest(stores)
    assert cp.status is CheckpointStatus.cancelled and cp.carried_by is Carrier.temporal
    again = await _runner(stores).resume(agent, "r1", tenant=T)
    assert again.status is RunStatus.cancelled and airline.bookings == []


async def test_the_kits_submit_of_a_carried_runs_id_queues_nothing() -> None:
    stores, airline = _stores(), Airline()
    agent, _ = await _carried_waiting(stores, airline)
    assert await _runner(stores).submit(agent, "book", tenant=T, run_id="r1") == "r1"
    # Another input under the id is told, not dropped unsaid (and queues nothing either).
    with pytest.raises(RunStartedError):
        await _runner(stores).submit(agent, "book again", tenant=T, run_id="r1")
    assert stores.work is not None
    assert await stores.work.due(limit=10) == []


async def test_a_replay_of_a_carried_step_is_a_kit_run_of_its_own() -> None:
    stores, airline = _stores(), Airline()
    agent = _agent(airline)
    await _runner(stores).run(agent, "book", tenant=T, run_id="r1")
    # Step 6: the turn that books (step 3), as its Temporal activity would have written it.
    turn = await Checkpointer.from_stores(stores).at(T, "r1", 3)
    assert turn is not None and [o.call.name for o in turn.outstanding] == ["book_seat"]
    carried = dataclasses.replace(turn, carried_by=Carrier.temporal, step=6)
    payload = encode_checkpoint(carried, Redactor())
    await stores.checkpoints.put(T, "r1", payload, step=6, fence=turn.fence)
    stubbed: list[str] = []
    replay = await _runner(stores).replay(
        agent,
        "r1",
        tenant=T,
        from_step=6,
        stubs={
            "book_seat": lambda flight, ctx=None: stubbed.append(flight) or {"ok": 1},
            "search_flights": lambda origin, dest: ["LH123"],
        },
        new_run_id="r1-replay",
    )
    assert replay.status is RunStatus.completed
    assert stubbed == ["LH123"] and len(airline.bookings) == 1  # the original's one only
    cp = await Checkpointer.from_stores(stores).latest(T, "r1-replay")
    assert cp is not None and cp.carried_by is None  # the kit carries a replay


@pytest.mark.parametrize("as_json", [False, True], ids=["text", "json"])
async def test_resolve_of_a_carried_run_wakes_no_worker_and_names_submit(as_json: bool) -> None:
    stores, airline = _stores(), Airline()
    agent = _agent(airline)
    runner = _runner(stores, [[("book_seat", {"flight": "LH123"})], "done"])

    def crash(stage: str) -> None:
        airline.hook = None
        raise SimulatedCrash("died inside the booking")

    airline.hook = crash  # the claim is left in flight: the booking is in doubt
    with pytest.raises(SimulatedCrash):
        await runner.run(agent, "book", tenant=T, run_id="r1")
    await _as_if_temporal_carried(stores, "r1")
    assert stores.work is not None
    await stores.work.done(T, "r1")  # the kit's own start wanted it; its workflow has it now
    cp = await _latest(stores)
    key = cp.outstanding[0].key
    assert key is not None
    argv = ["resolve", "r1", "--tenant", T, "--call", key, "--by", "ops"]
    argv += ["--outcome", '{"booking": "B1"}'] + (["--json"] if as_json else [])
    code, out, err = await asyncio.to_thread(_cli, frontier_main, argv, stores)
    assert code == 0, err
    if as_json:  # one JSON document, nothing after it
        told = json.loads(out)
        assert (told["woken"], told["also_woken"]) == (False, []), told
    else:
        assert "submit --temporal" in out and "tesserix run --resume" not in out, out
    assert stores.work is not None
    assert await stores.work.due(limit=10) == []


@pytest.mark.parametrize(
    "mangle",
    [
        lambda b: b.replace(b'"carried_by":"temporal"', b'"carried_by":"temporaL"'),
        lambda b: b.replace(b'"format":4', b'"format":3'),
        lambda b: b.replace(b'"format":4', b'"format":2'),
        lambda b: b.replace(b',"carried_by":"temporal"', b""),
    ],
    ids=["carrier-flipped", "format-3", "format-2", "carrier-dropped"],
)
def test_a_changed_carried_frontier_is_corrupt_never_a_kit_run(mangle: Any) -> None:
    cp = _frontier()
    payload = encode_checkpoint(dataclasses.replace(cp, carried_by=Carrier.temporal), Redactor())
    compact = json.dumps(json.loads(payload), separators=(",", ":")).encode()
    changed = mangle(compact)
    assert changed != compact
    with pytest.raises(CheckpointCorruptError):
        decode_checkpoint(changed, tenant="t", run_id="r")
    for i in range(0, len(payload), 7):  # byte flips across the whole payload
        flipped = payload[:i] + bytes([payload[i] ^ 0x01]) + payload[i + 1 :]
        try:
            read = decode_checkpoint(flipped, tenant="t", run_id="r")
        except Exception as exc:
            assert type(exc).__name__ in {"CheckpointCorruptError", "CheckpointFormatError"}
        else:  # a flip that leaves it readable (whitespace) leaves the carrier too
            assert read.carried_by is Carrier.temporal


def _frontier() -> Any:
    from tesserix_adk.checkpoint.payload import Boundary, Checkpoint
    from tesserix_adk.messages import Message

    return Checkpoint(
        tenant="t",
        run_id="r",
        agent_name="a",
        step=2,
        boundary=Boundary.before_approval,
        status=CheckpointStatus.waiting_approval,
        messages=(Message.user("book LH123"),),
    )


def test_a_golden_format_2_frontier_names_no_carrier() -> None:
    payload = encode_checkpoint(_frontier(), Redactor())
    assert json.loads(payload)["format"] == 2
    assert decode_checkpoint(payload, tenant="t", run_id="r").carried_by is None


# --- defects ---------------------------------------------------------------------------------


async def test_accept_revision_leaves_a_carried_run_as_its_workflow_left_it() -> None:
    stores, airline = _stores(), Airline()
    await _carried_waiting(stores, airline)
    before = await _latest(stores)
    assert changed_agent.revision != before.agent_revision
    argv = ["run", "--resume", "r1", "--tenant", T, "--agent", "booking"]
    argv += ["--accept-revision", "--by", "alice", "--note", "deploy"]
    code, out, err = await asyncio.to_thread(
        _cli,
        resume_main,
        argv,
        stores,
        agents={"booking": changed_agent},
        provider=ScriptedProvider([]),
    )
    assert code == 4, (out, err)
    assert "temporal workflow" in err, err
    after = await _latest(stores)
    # Refused "before anything is asked or sent": the frontier is its workflow's still.
    assert (after.step, after.agent_revision) == (before.step, before.agent_revision)
    assert "accepted as" not in out, out


async def test_runs_does_not_send_an_operator_to_accept_revision_for_a_carried_run() -> None:
    stores, airline = _stores(), Airline()
    await _carried_waiting(stores, airline)
    argv = ["runs", "--tenant", T, "--agent", "test_attacks_one_carrier_kit:changed_agent"]
    code, out, err = await asyncio.to_thread(_cli, frontier_main, argv, stores)
    assert code == 0, err
    assert "r1" in out, out
    assert "--accept-revision" not in out, out
    # Nor is it stuck for the kit: its workflow carries it.
    code, out, err = await asyncio.to_thread(_cli, frontier_main, [*argv, "--stuck"], stores)
    assert code == 0, err
    assert "r1" not in out, out


async def test_inspect_of_an_approved_carried_run_does_not_promise_a_resume() -> None:
    stores, airline = _stores(), Airline()
    _, request = await _carried_waiting(stores, airline)
    argv = ["approve", request, "--tenant", T, "--by", "alice"]
    code, _, err = await asyncio.to_thread(_cli, frontier_main, argv, stores)
    assert code == 0, err
    code, out, err = await asyncio.to_thread(
        _cli, frontier_main, ["inspect", "r1", "--tenant", T], stores
    )
    assert code == 0, err
    assert "approved by alice" in out, out
    assert "a resume carries it on" not in out, out


async def test_inspect_json_names_the_runs_carrier() -> None:
    stores, airline = _stores(), Airline()
    await _carried_waiting(stores, airline)
    code, out, err = await asyncio.to_thread(
        _cli, frontier_main, ["inspect", "r1", "--tenant", T, "--json"], stores
    )
    assert code == 0, err
    assert json.loads(out).get("carried_by") == "temporal", out
    code, out, err = await asyncio.to_thread(
        _cli, frontier_main, ["inspect", "r1", "--tenant", T], stores
    )
    assert "temporal" in out, out
