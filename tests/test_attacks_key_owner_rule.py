"""Attacks on the key-owner rule (8fe698a, dce4c52): a call whose idempotency key holds a
record of ANOTHER tool is answered "not sent" (``run.dispatch._keyed_by_another_tool``,
``checkpoint.planning``), unless the record is this very call's (same run, turn and call
id), which is ``CheckpointCorruptError``; and ``_refuse_divergence`` compares (key, tool)
for calls that ran ahead of the frontier.

The oracle: each side-effecting key takes effect at most once; a call that ran is never
hidden from the model (its outcome replayed, or a typed refusal); and a call of the same
logical kind is never refused falsely (a store called damaged that is not, a run wedged).

Defects (strict xfails):

* "This very call" is told by (run, turn, call id), but a provider's call id is no identity
  of a call: a model may give two calls one id (the kit says so in ``temporal/calls.py``
  and ``telemetry/spans.py``), and a turn asked again after a crash numbers its calls anew
  (``ScriptedProvider``'s ``call_<turn>_<place>``, as local OpenAI-compatible servers do).
  A charge and a refund keyed alike under one id, or a re-asked turn whose refund got the
  id the charge that ran had, is ``CheckpointCorruptError`` ("the store holds a damaged
  row"), in the run and in the resume plan (``inspect``): the run can never be carried on
  and the charge is never told, though nothing in the store is damaged.
* ``accept-revision`` renaming a tool whose call completed ahead of the frontier (under a
  business key) is accepted; the resume, whose model asks the renamed tool under the same
  key, is then ``DivergedRunError`` at every try (it was replayed before dce4c52).

Held: the rule over a hypothesis-made sequence of turns (at most one effect per key; the
owner tool replayed, another tool "not sent"); a business key two runs of the SAME tool
share still replays; a crash of the earlier kit (a576b4c) ahead of the frontier, resumed by
this one, replays the same tool and refuses another tool under its key as diverged;
an operator's ``resolve`` keeps the record's tool (replayed to it, "not sent" to another).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from archived import archived
from run.helpers import Asks, Recording, at, faulty_runner, fresh_stores
from tesserix_adk import (
    Agent,
    AgentRunner,
    Boundary,
    Checkpointer,
    CheckpointPolicy,
    DivergedRunError,
    LeasePolicy,
    RevisionMismatchError,
    Role,
    RunStatus,
    ScriptedProvider,
    ToolCall,
    tool,
)
from tesserix_adk.checkpoint.planning import ToolDisposition, plan_resume
from tesserix_adk.errors import CheckpointCorruptError
from tesserix_adk.run.upgrade import accept_revision
from tesserix_adk.testing.faults import FaultyCheckpointStore, SimulatedCrash

T = "acme"
OLD_COMMIT = "a576b4c"
OLD_NAME = "tesserix_adk_old_keyowner"


def _by_order(**kw: Any) -> str:
    return f"order-{kw['arguments']['order']}"


def _shop(sent: list[str], *, charge_name: str = "charge", crash: bool = False) -> Agent:
    """charge and refund keyed alike (``order-<n>``), and a read-only look."""

    def charge(order: str) -> str:
        """Charge an order."""
        sent.append(f"charge {order}")
        if crash:
            raise SimulatedCrash
        return f"charged order {order}"

    @tool(key=_by_order)
    def refund(order: str) -> str:
        """Refund an order."""
        sent.append(f"refund {order}")
        return f"refunded order {order}"

    @tool(side_effects=False)
    def look(order: str) -> str:
        """Look an order up."""
        return f"order {order} is open"

    return Agent("shop", "Shop.", [tool(key=_by_order, name=charge_name)(charge), refund, look])


def _told(requests: list[Any]) -> list[tuple[str, bool]]:
    return [(str(m.content), m.is_error) for m in requests[-1].messages if m.role is Role.tool]


def _both_one_id() -> list[ToolCall]:
    return [
        ToolCall(id="x", name="charge", arguments={"order": "5"}),
        ToolCall(id="x", name="refund", arguments={"order": "5"}),
    ]


async def _charge_ahead_of_the_frontier(stores: Any, sent: list[str]) -> None:
    """The charge at iteration 1 runs; the process dies before that turn's frontier."""
    policy = CheckpointPolicy(boundaries=frozenset({Boundary.after_tool_result}))
    dying = FaultyCheckpointStore(stores.checkpoints, crash_before=at("after_tool_result", 1))
    first = AgentRunner(
        ScriptedProvider([[("look", {"order": "5"})], [("charge", {"order": "5"})], "done"]),
        idempotency=stores.idempotency,
        checkpoints=Checkpointer(dying, history=stores.history, policy=policy),
        leases=stores.leases,
    )
    with pytest.raises(SimulatedCrash):
        await first.run(_shop(sent), "go", tenant=T, run_id="r")
    assert sent == ["charge 5"]


# ==========================================================================================
# Defects: "this very call" by its provider's id
# ==========================================================================================


async def test_charge_and_refund_given_one_id_are_no_damaged_row(tmp_path: Path) -> None:
    sent: list[str] = []
    async with fresh_stores("sqlite", tmp_path) as stores:
        model = Asks(_both_one_id())
        run = await AgentRunner.from_stores(model, stores).run(
            _shop(sent), "go", tenant=T, run_id="r"
        )
        assert run.status is RunStatus.completed
        assert sent == ["charge 5"]
        charged, refund = _told(model.requests)
        assert charged == ("charged order 5", False)
        assert refund[1] and refund[0].startswith("not sent"), refund


async def test_the_plan_of_two_calls_given_one_id_is_no_damaged_row(tmp_path: Path) -> None:
    sent: list[str] = []
    async with fresh_stores("sqlite", tmp_path) as stores:
        dying = faulty_runner(stores, Asks(_both_one_id()), crash_before=at("after_tool_result", 0))
        # Today the refund's CheckpointCorruptError ends the attempt; once mended the
        # process dies before the turn's last frontier. Either way the charge ran once.
        with pytest.raises((SimulatedCrash, CheckpointCorruptError)):
            await dying.run(_shop(sent), "go", tenant=T, run_id="r")
        assert sent == ["charge 5"]
        frontier = await Checkpointer.from_stores(stores).latest(T, "r")
        assert frontier is not None
        plan = await plan_resume(frontier, stores.idempotency)
        by_tool = {p.tool: p.disposition for p in plan.calls if p.call_id == "x"}
        assert by_tool["charge"] is ToolDisposition.completed
        assert by_tool["refund"] is ToolDisposition.never_ran


async def test_a_reasked_turn_giving_the_refund_the_charges_id_replays_the_charge(
    tmp_path: Path,
) -> None:
    sent: list[str] = []
    async with fresh_stores("sqlite", tmp_path) as stores:
        await _charge_ahead_of_the_frontier(stores, sent)
        # Asked again at iteration 1, the model asks the refund first, then the charge:
        # the refund is call_1_0 now, the id the charge had.
        model = Recording(
            ScriptedProvider(
                [
                    [("look", {"order": "5"})],
                    [("refund", {"order": "5"}), ("charge", {"order": "5"})],
                    "done",
                ]
            )
        )
        run = await AgentRunner.from_stores(model, stores).resume(_shop(sent), "r", tenant=T)
        assert run.status is RunStatus.completed
        assert sent == ["charge 5"]
        refund, charged = _told(model.requests)[-2:]
        assert charged == ("charged order 5", False)
        assert refund[1] and refund[0].startswith("not sent"), refund


# ==========================================================================================
# Defect: a renamed tool, accepted
# ==========================================================================================


async def test_accepting_a_rename_of_a_tool_that_ran_ahead_is_refused_or_replays(
    tmp_path: Path,
) -> None:
    sent: list[str] = []
    async with fresh_stores("sqlite", tmp_path) as stores:
        await _charge_ahead_of_the_frontier(stores, sent)
        renamed = _shop(sent, charge_name="pay")
        model = Recording(
            ScriptedProvider([[("look", {"order": "5"})], [("pay", {"order": "5"})], "done"])
        )
        runner = AgentRunner.from_stores(model, stores)
        try:
            await accept_revision(runner, renamed, "r", tenant=T, by="ops")
        except RevisionMismatchError as refused:
            # Refused up front, naming the call: the person knows the rename cannot carry it.
            assert "charge" in str(refused)
            return
        # Accepted: the same logical call asked under its new name is told what happened.
        run = await runner.resume(renamed, "r", tenant=T)
        assert run.status is RunStatus.completed
        assert sent == ["charge 5"]
        assert _told(model.requests)[-1] == ("charged order 5", False)


# ==========================================================================================
# Held
# ==========================================================================================


async def test_a_rename_with_the_call_in_flight_ahead_is_refused_by_accept_revision(
    tmp_path: Path,
) -> None:
    sent: list[str] = []
    lease = LeasePolicy(ttl=0.2, renew_within=0.1)
    async with fresh_stores("sqlite", tmp_path) as stores:
        dies = ScriptedProvider([[("charge", {"order": "5"})], "done"])
        with pytest.raises(SimulatedCrash):
            await AgentRunner.from_stores(dies, stores, lease_policy=lease).run(
                _shop(sent, crash=True), "go", tenant=T, run_id="r"
            )
        await asyncio.sleep(0.4)
        runner = AgentRunner.from_stores(ScriptedProvider(["done"]), stores, lease_policy=lease)
        with pytest.raises(RevisionMismatchError, match="charge"):
            await accept_revision(runner, _shop(sent, charge_name="pay"), "r", tenant=T, by="o")
        assert sent == ["charge 5"]


async def test_a_business_key_two_runs_of_the_same_tool_share_still_replays(
    tmp_path: Path,
) -> None:
    sent: list[str] = []
    async with fresh_stores("sqlite", tmp_path) as stores:
        for run_id in ("A", "B"):
            model = Recording(ScriptedProvider([[("charge", {"order": "5"})], "done"]))
            run = await AgentRunner.from_stores(model, stores).run(
                _shop(sent), "go", tenant=T, run_id=run_id
            )
            assert run.status is RunStatus.completed
            assert _told(model.requests) == [("charged order 5", False)]
        assert sent == ["charge 5"]


async def test_an_operators_resolution_keeps_the_tool_it_replays_to(tmp_path: Path) -> None:
    sent: list[str] = []
    lease = LeasePolicy(ttl=0.2, renew_within=0.1)
    async with fresh_stores("sqlite", tmp_path) as stores:
        dies = ScriptedProvider([[("charge", {"order": "5"})], "done"])
        with pytest.raises(SimulatedCrash):
            await AgentRunner.from_stores(dies, stores, lease_policy=lease).run(
                _shop(sent, crash=True), "go", tenant=T, run_id="r"
            )
        await asyncio.sleep(0.4)
        (rec,) = await stores.idempotency.records(T, "r")
        from tesserix_adk.checkpoint.payload.outcomes import encode_outcome, record_tag
        from tesserix_adk.checkpoint.redaction import Redactor
        from tesserix_adk.messages import ToolOutcome

        told = ToolOutcome(call_id=rec.call_id or "", content="charged by hand")
        outcome = encode_outcome(told, Redactor(), record=record_tag(T, rec.key))
        await stores.idempotency.resolve(rec.key, tenant=T, by="ops", outcome=outcome)
        (resolved,) = await stores.idempotency.records(T, "r")
        assert resolved.tool == "charge"
        model = Recording(ScriptedProvider([[("charge", {"order": "5"})], "done"]))
        run = await AgentRunner.from_stores(model, stores, lease_policy=lease).resume(
            _shop(sent), "r", tenant=T
        )
        assert run.status is RunStatus.completed
        assert "charged by hand" in _told(model.requests)[-1][0]
        # Another run's refund under the key is "not sent", never told the operator's word.
        model = Recording(ScriptedProvider([[("refund", {"order": "5"})], "done"]))
        await AgentRunner.from_stores(model, stores).run(_shop(sent), "go", tenant=T, run_id="B")
        (refund,) = _told(model.requests)
        assert refund[1] and refund[0].startswith("not sent"), refund
        assert sent == ["charge 5"]


CALL = st.tuples(st.sampled_from(["charge", "refund", "look"]), st.sampled_from(["5", "6"]))


@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(turns=st.lists(st.lists(CALL, min_size=1, max_size=3), min_size=1, max_size=3))
async def test_the_owner_of_a_key_is_replayed_and_any_other_tool_not_sent(
    tmp_path_factory: pytest.TempPathFactory, turns: list[list[tuple[str, str]]]
) -> None:
    sent: list[str] = []
    script: list[Any] = [[(name, {"order": order}) for name, order in calls] for calls in turns]
    async with fresh_stores("memory", tmp_path_factory.mktemp("h")) as stores:
        model = Recording(ScriptedProvider([*script, "done"]))
        run = await AgentRunner.from_stores(model, stores).run(
            _shop(sent), "go", tenant=T, run_id="r"
        )
        assert run.status is RunStatus.completed
    # The oracle: the first side-effecting tool under a key owns it. Twins of one turn
    # (same tool and arguments) get keys of their own: ``order-5``, ``order-5#1``, ...
    owner: dict[str, str] = {}
    expected: list[tuple[str, bool]] = []
    effects: list[tuple[str, str]] = []
    past = {"charge": "charged", "refund": "refunded"}
    for calls in turns:
        seen: dict[tuple[str, str], int] = {}
        for name, order in calls:
            if name == "look":
                expected.append((f"order {order} is open", False))
                continue
            twin = seen[(name, order)] = seen.get((name, order), -1) + 1
            key = f"order-{order}" + (f"#{twin}" if twin else "")
            first = owner.setdefault(key, name)
            if first == name:
                if key not in {k for k, _ in effects}:
                    effects.append((key, f"{name} {order}"))
                expected.append((f"{past[name]} order {order}", False))
            else:
                expected.append(("not sent", True))
    assert sent == [what for _, what in effects]
    told = [
        (text[:8] if text.startswith("not sent") else text, error)
        for text, error in _told(model.requests)
    ]
    assert told == expected


# ==========================================================================================
# Held: records of the earlier kit
# ==========================================================================================


@pytest.fixture(scope="module")
def old_kit(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    with archived(OLD_COMMIT, OLD_NAME, tmp_path_factory.mktemp("old-kit")) as load:
        yield load


@pytest.mark.parametrize("asked", ["charge", "refund"])
async def test_a_charge_the_earlier_kit_left_ahead_is_replayed_or_diverged(
    old_kit: Any, asked: str, tmp_path: Path
) -> None:
    top: ModuleType = old_kit("")
    faults = old_kit("testing.faults")
    urls = old_kit("stores.urls")
    url = f"sqlite:///{tmp_path / 'adk.sqlite3'}"
    sent: list[str] = []

    @top.tool(key=_by_order)
    def charge(order: str) -> str:
        """Charge an order."""
        sent.append(f"charge {order}")
        return f"charged order {order}"

    @top.tool(key=_by_order)
    def refund(order: str) -> str:
        """Refund an order."""
        sent.append(f"refund {order}")
        return f"refunded order {order}"

    @top.tool(side_effects=False)
    def look(order: str) -> str:
        """Look an order up."""
        return f"order {order} is open"

    async with urls.open_stores(url) as old_stores:
        await old_stores.create_schema()
        policy = top.CheckpointPolicy(boundaries=frozenset({top.Boundary.after_tool_result}))
        dying = faults.FaultyCheckpointStore(
            old_stores.checkpoints, crash_before=at("after_tool_result", 1)
        )
        first = top.AgentRunner(
            top.ScriptedProvider(
                [[("look", {"order": "5"})], [("charge", {"order": "5"})], "done"]
            ),
            idempotency=old_stores.idempotency,
            checkpoints=top.Checkpointer(dying, history=old_stores.history, policy=policy),
            leases=old_stores.leases,
        )
        with pytest.raises(faults.SimulatedCrash):
            await first.run(
                top.Agent("shop", "Shop.", [charge, refund, look]), "go", tenant=T, run_id="r"
            )
    assert sent == ["charge 5"]
    from tesserix_adk.stores.urls import open_stores

    async with open_stores(url) as stores:
        model = Recording(
            ScriptedProvider([[("look", {"order": "5"})], [(asked, {"order": "5"})], "done"])
        )
        runner = AgentRunner.from_stores(model, stores)
        if asked == "charge":
            run = await runner.resume(_shop(sent), "r", tenant=T)
            assert run.status is RunStatus.completed
            assert _told(model.requests)[-1] == ("charged order 5", False)
        else:
            with pytest.raises(DivergedRunError, match="charge"):
                await runner.resume(_shop(sent), "r", tenant=T)
    assert sent == ["charge 5"]
