"""An attacker's look at ``messages.refusal_of`` and its uses: ``screening.refused``,
``loop.outstanding_calls``/``_asks_a_person``, ``dispatch._answer``, ``approvals.ask_approval``
and ``checkpoint.planning.plan_resume``. The question: can any arguments a model (or a
provider adapter, ``providers._common.arguments_from_text``) produce make the loop and the
dispatch disagree (one takes the call for refused, the other sends it), or have a call sent
while its frontier says it has no key or no side effects, including across a crash and a
resume (at the frontier, or past it with the model asking again)? ``memory://`` and SQLite
under ``tmp_path``; an MCP tool with a fake ``send`` (MCP tools take any arguments).

Findings: no defect found in the time given (15 minutes). Every use now calls the one
predicate on the same ``ToolCall`` object (or the frontier's round-tripped copy), so the
loop and the dispatch agree for every shape tried:

- the refusal's exact shape written by the model (``{"__tesserix_refused__": "<str>"}``),
  and any arguments holding ``_malformed_arguments`` (alone, beside real arguments, or
  made by ``arguments_from_text`` from a JSON array): never sent, no approval asked,
  planned as "refused, never sent", and nothing sent after a resume;
- the refusal's name with a non-string value (``None``, ``5``), alone or beside real
  arguments: not a refusal on either side; keyed, claimed and sent once; after a death in
  the send, the resume refuses the call in doubt rather than sending it again;
- ``NaN``/``Infinity`` arguments (``json.loads`` accepts them, so ``arguments_from_text``
  passes them on): keyed deterministically, sent once, the frontier round-trips them, and
  the resume after a death in the send refuses the call in doubt (no second send).

Looked at without a test: the frontier's redaction masks string values and string keys,
never the refusal's key and never a non-string into a string, so a redacted frontier
cannot turn a sent call into a refusal (a refusal needs exactly one key, the refusal's,
with a string value) nor a refusal into a sendable call.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import pytest

from run.helpers import Asks, fresh_stores
from tesserix_adk import (
    Agent,
    AgentRunner,
    Role,
    RunStatus,
    ToolCall,
)
from tesserix_adk.checkpoint.checkpointer import Checkpointer
from tesserix_adk.checkpoint.planning import plan_resume
from tesserix_adk.errors import IndeterminateToolCallError
from tesserix_adk.mcp.tools import MCPTool, ServerTool
from tesserix_adk.messages import MALFORMED_ARGUMENTS, REFUSED_ARGUMENTS, refusal_of
from tesserix_adk.providers._common import arguments_from_text
from tesserix_adk.testing.faults import FaultyCheckpointStore, SimulatedCrash

T = "t"
Sent = list[tuple[dict[str, Any], str | None]]


def _booking(sent: Sent, die: dict[str, bool]) -> Agent:
    """An MCP booking tool (side effects, takes any arguments) that may "die" mid-send."""

    async def send(name: str, arguments: Any, *, key: str | None) -> str:
        sent.append((dict(arguments), key))
        if die["on"]:
            raise SimulatedCrash("the process died while the server booked the seat")
        return "booked"

    listed = ServerTool(
        name="book_seat",
        description="Book a seat.",
        input_schema={"type": "object", "properties": {"flight": {"type": "string"}}},
    )
    return Agent("booker", "Book.", [MCPTool(listed, send)])


_REFUSED_SHAPES: dict[str, dict[str, Any]] = {
    "model writes the refusal": {REFUSED_ARGUMENTS: "just because"},
    "malformed beside real arguments": {MALFORMED_ARGUMENTS: "x", "flight": "LH1"},
    "malformed from a JSON array": arguments_from_text("[1, 2]"),
    "malformed from broken JSON": arguments_from_text('{"flight": "LH1"'),
}

_SENT_SHAPES: dict[str, dict[str, Any]] = {
    "refusal name, null value, alone": {REFUSED_ARGUMENTS: None},
    "refusal name, number value": {REFUSED_ARGUMENTS: 5},
    "refusal name, null beside real": {"flight": "LH1", REFUSED_ARGUMENTS: None},
    "NaN from the provider": arguments_from_text('{"flight": NaN}'),
    "Infinity from the provider": arguments_from_text('{"flight": -Infinity}'),
}


def test_the_predicate_on_the_shapes_tried() -> None:
    for args in _REFUSED_SHAPES.values():
        assert refusal_of(ToolCall(id="c", name="book_seat", arguments=args)) is not None
    for args in _SENT_SHAPES.values():
        assert refusal_of(ToolCall(id="c", name="book_seat", arguments=args)) is None


@pytest.mark.parametrize("where", ["sqlite", "memory"])
@pytest.mark.parametrize("shape", sorted(_REFUSED_SHAPES))
async def test_a_refused_shape_is_never_sent_planned_refused_and_not_sent_on_resume(
    tmp_path: Path, where: str, shape: str
) -> None:
    sent: Sent = []
    agent = _booking(sent, {"on": False})
    turn = [ToolCall(id="c1", name="book_seat", arguments=_REFUSED_SHAPES[shape])]
    async with fresh_stores(where, tmp_path) as stores:
        model = Asks(turn)
        run = await AgentRunner.from_stores(model, stores).run(agent, "book", tenant=T, run_id="r")
        assert run.status is RunStatus.completed
        answers = [m for m in model.requests[-1].messages if m.role is Role.tool]
        assert len(answers) == 1 and answers[0].is_error
        assert "not sent" in str(answers[0].content)
        resumed = await AgentRunner.from_stores(Asks(turn), stores).resume(agent, "r", tenant=T)
        assert resumed.status is RunStatus.completed
    assert sent == []


@pytest.mark.parametrize("shape", sorted(_REFUSED_SHAPES))
async def test_a_frontier_holding_a_refused_shape_plans_it_refused_not_sent_again(
    tmp_path: Path, shape: str
) -> None:
    sent: Sent = []
    agent = _booking(sent, {"on": False})
    turn = [ToolCall(id="c1", name="book_seat", arguments=_REFUSED_SHAPES[shape])]

    def after_tool_result(body: Any) -> bool:
        return bool(body.get("boundary") == "after_tool_result")

    async with fresh_stores("sqlite", tmp_path) as stores:
        dying = AgentRunner(
            Asks(turn),
            idempotency=stores.idempotency,
            checkpoints=Checkpointer(
                FaultyCheckpointStore(stores.checkpoints, crash_before=after_tool_result),
                history=stores.history,
            ),
            leases=stores.leases,
            ledger=stores.ledger,
            approvals=stores.approvals,
            work=stores.work,
        )
        with contextlib.suppress(SimulatedCrash):
            await dying.run(agent, "book", tenant=T, run_id="r")
        cps = Checkpointer(stores.checkpoints, history=stores.history)
        # Every frontier of the run that holds the call holds it unkeyed and read-only,
        # and the plan tells it as refused, never as "no side effects; sent again".
        latest = await cps.latest(T, "r")
        assert latest is not None
        assert len(latest.outstanding) == 1, latest.boundary
        for oc in latest.outstanding:
            assert oc.key is None and not oc.side_effects
            plan = await plan_resume(latest, stores.idempotency)
            reasons = [p.reason for p in plan.to_dispatch]
            assert len(reasons) == 1 and "refused, never sent" in reasons[0], reasons
        resumed = await AgentRunner.from_stores(Asks(turn), stores).resume(agent, "r", tenant=T)
        assert resumed.status is RunStatus.completed
    assert sent == []


@pytest.mark.parametrize("where", ["sqlite", "memory"])
@pytest.mark.parametrize("shape", sorted(_SENT_SHAPES))
async def test_a_sendable_shape_is_keyed_and_never_sent_twice_across_a_death_and_resume(
    tmp_path: Path, where: str, shape: str
) -> None:
    sent: Sent = []
    die = {"on": True}
    agent = _booking(sent, die)
    turn = [ToolCall(id="c1", name="book_seat", arguments=_SENT_SHAPES[shape])]
    async with fresh_stores(where, tmp_path) as stores:
        with contextlib.suppress(SimulatedCrash):
            await AgentRunner.from_stores(Asks(turn), stores).run(
                agent, "book", tenant=T, run_id="r"
            )
        die["on"] = False
        cps = Checkpointer(stores.checkpoints, history=stores.history)
        latest = await cps.latest(T, "r")
        assert latest is not None
        assert [(oc.key is not None, oc.side_effects) for oc in latest.outstanding] == [
            (True, True)
        ]
        # The resume, the model asking again for the same call: no guess, no second send.
        with pytest.raises(IndeterminateToolCallError):
            await AgentRunner.from_stores(Asks(turn), stores).resume(agent, "r", tenant=T)
    assert len(sent) == 1, sent
    assert all(key is not None for _, key in sent), sent


@pytest.mark.parametrize("shape", sorted(_SENT_SHAPES))
async def test_a_sendable_shape_goes_out_once_with_its_key(tmp_path: Path, shape: str) -> None:
    sent: Sent = []
    agent = _booking(sent, {"on": False})
    turn = [ToolCall(id="c1", name="book_seat", arguments=_SENT_SHAPES[shape])]
    async with fresh_stores("memory", tmp_path) as stores:
        run = await AgentRunner.from_stores(Asks(turn), stores).run(
            agent, "book", tenant=T, run_id="r"
        )
        assert run.status is RunStatus.completed
        again = await AgentRunner.from_stores(Asks(turn), stores).resume(agent, "r", tenant=T)
        assert again.status is RunStatus.completed
    assert len(sent) == 1 and sent[0][1] is not None, sent
