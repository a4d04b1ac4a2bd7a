"""An attack on commit 9048ff1 (README "Replay"; ``run/replay.py`` ``usable_step``,
``_refuse_taken``, ``_charged``; ``run/loop.py`` ``end_as_ended``; ``AgentRunner.submit``
and ``submitting.refuse_another_start``): can a replay still send a real side-effecting
call twice, is a replay from a final step written right, does ``submit`` refuse a
legitimate retry, and are the new refusals one typed sentence that records nothing.

Found, and fixed (``replay._refuse_recorded_effects``: a tool the run's records name as
side-effecting is stubbed or live; ``MCPTool.takes_context`` is False; ``runner.submit``
skips the agent check on a frontier it cannot read; README's "Secrets"):

1. HIGH ``test_a_replay_from_before_the_booking_never_books_again_under_a_read_only_revision``:
   the fix refuses an unstubbed call only when *the step replayed from* recorded it as
   side-effecting. Replayed from the step before the booking (the search step) under a
   revision that (wrongly) calls ``book_seat`` read-only, the model asks for the booking
   anew and it goes out for real: the airline holds LH123 twice, though the original run
   recorded ``book_seat`` as side-effecting at its next step (and in its call record,
   ``ToolFlags(side_effects=True)``). With ``requires_approval`` dropped as well, it books
   without a person being asked. ``replay.usable_step`` reads only ``cp.outstanding`` of
   the one step; ``check_stubs`` trusts the agent given.
2. LOW ``test_a_read_only_mcp_tool_is_not_refused_for_a_state_it_never_sees``: from a step
   whose state lost a secret, an unstubbed read-only MCP tool is refused "(a tool would get
   the mask as if it were the value)", though an MCP tool is never handed the state:
   ``MCPTool`` is built on ``_sent_over_mcp(ctx)``, so ``Tool.takes_context`` is true for
   every MCP tool (``mcp/tools.py``; ``replay.usable_step``).
3. LOW ``test_a_retried_submission_of_a_run_whose_frontier_is_damaged_is_a_no_op``: the same
   submission again (same agent, same input) of a started run whose frontier is damaged
   now raises ``CheckpointCorruptError`` (CLI exit 4) where it returned the id
   (``submit``'s docstring: "a no-op that returns it"): ``runner.submit`` decodes the
   frontier (``checkpoints.latest``) for ``refuse_another_start`` instead of reading what
   it needs, or passing a frontier it cannot read.
4. LOW ``test_the_readme_secrets_section_says_what_a_replay_refuses``: README "Secrets" still
   says a replay from a redacted-state step "refuses `live` tools (its side-effecting tools
   must be stubbed)"; the code (and the "Replay" section) refuse every unstubbed tool that
   takes ``ctx``, read-only or not.

Held: a revision re-marking the booking read-only is refused from the step that holds it,
also at an approval wait; the refusal is one ``ConfigurationError`` (CLI exit 2, one line,
no traceback) that records nothing under the new id, which a later replay can take; a
replay from the final step of a completed, failed and cancelled run writes one frontier
under its id with the original's status, output and transcript, its own zero spend and
usage, ``replay_of`` naming the step, and ``tesserix show --json`` reads it; its id is
refused to a second replay, to ``submit`` (CLI exit 4) and to ``run``; the same
submission again is a no-op for a run whose frontier is a tombstone, and for agents named
with non-ASCII, spaces, full-width letters and 300 characters; a submission for another
agent under a started run's id is ``RunStartedError``, nothing recorded.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from booking import BOOK_TURNS, Airline, booking_agent
from operator_cli import cli
from tesserix_adk import (
    Agent,
    AgentRunner,
    ConfigurationError,
    ProviderError,
    RunStatus,
    ScriptedProvider,
    ScriptedTurn,
    ToolContext,
    open_stores,
    tool,
)
from tesserix_adk.errors import RunStartedError

from .replaying import TOKEN, fresh, new_id, sqlite, step_with, stub_booking

HERE = "run.test_attacks_replay_submit_fixes"
README = Path(__file__).resolve().parents[2] / "README.md"


def read_only_revision(airline: Airline) -> Agent:
    """The next revision of the booking agent, which (wrongly) calls booking read-only
    and drops its approval."""

    @tool(side_effects=False)
    def search_flights(origin: str, dest: str) -> list[str]:
        """Find flights."""
        return ["LH123", "UA456"]

    @tool(side_effects=False)
    def book_seat(flight: str) -> dict[str, str]:
        """Book one seat."""
        airline.bookings.append(flight)
        return {"booking": "B2", "flight": flight}

    return Agent("booking", "Book.", [search_flights, book_seat])


class Creds(BaseModel):
    token: str = ""


@tool
def login(order: str, ctx: ToolContext) -> str:
    """Log in: keeps the session token in the run's state."""
    ctx.state.token = TOKEN
    return "in"


# ==========================================================================================
# Defects
# ==========================================================================================


@pytest.mark.parametrize("approval", [False, True])
async def test_a_replay_from_before_the_booking_never_books_again_under_a_read_only_revision(
    tmp_path: Path, approval: bool
) -> None:
    airline = Airline()
    rid = new_id()
    async with sqlite(tmp_path) as stores:
        original = booking_agent(airline, approval=approval)
        run = await fresh(stores).run(original, "go", tenant="t", run_id=rid)
        if approval:
            assert run.pending_approval is not None
            await stores.approvals.decide("t", run.pending_approval.id, approved=True, by="al")
            await fresh(stores).resume(original, rid, tenant="t")
        assert airline.bookings == ["LH123"]
        step = await step_with(stores, rid, "search_flights")
        with contextlib.suppress(ConfigurationError):
            await fresh(stores).replay(
                read_only_revision(airline), rid, tenant="t", from_step=step, stubs={}
            )
    assert airline.bookings == ["LH123"], "the replay booked LH123 a second time for real"


async def test_a_read_only_mcp_tool_is_not_refused_for_a_state_it_never_sees(
    tmp_path: Path,
) -> None:
    from tesserix_adk.mcp.tools import MCPTool, ServerTool

    sent: list[Any] = []

    async def send(name: str, arguments: Any, *, key: str | None) -> Any:
        sent.append(name)
        return "ok"

    listed = ServerTool(
        name="lookup", description="Look up.", input_schema={"type": "object"}, read_only=True
    )
    lookup = MCPTool(listed, send)
    agent = Agent("creds", "x", [login, lookup], state_schema=Creds)
    turns = [[("login", {"order": "o"})], [("lookup", {})], "done"]
    rid = new_id()
    async with sqlite(tmp_path) as stores:
        await fresh(stores, turns).run(agent, "go", tenant="t", run_id=rid, state=Creds())
        assert sent == ["lookup"]
        step = await step_with(stores, rid, "lookup")
        rep = await fresh(stores, turns).replay(
            agent, rid, tenant="t", from_step=step, stubs={"login": lambda order: "in"}
        )
        assert rep.status is RunStatus.completed
    assert sent == ["lookup", "lookup"]


async def test_a_retried_submission_of_a_run_whose_frontier_is_damaged_is_a_no_op(
    tmp_path: Path,
) -> None:
    agent = booking_agent(Airline())
    rid = new_id()
    async with sqlite(tmp_path) as stores:
        await fresh(stores).submit(agent, "go", tenant="t", run_id=rid)
        await fresh(stores).run(agent, "go", tenant="t", run_id=rid)
        last = max(await stores.checkpoints.steps("t", rid))
        await stores.checkpoints.put("t", rid, b"\x00damaged", step=last + 1, fence=1)
        assert await fresh(stores).submit(agent, "go", tenant="t", run_id=rid) == rid


def test_the_readme_secrets_section_says_what_a_replay_refuses() -> None:
    text = " ".join(README.read_text(encoding="utf-8").split())
    assert "a replay from such a step refuses `live` tools" not in text


# ==========================================================================================
# What held
# ==========================================================================================


async def test_a_read_only_revision_is_refused_from_the_step_holding_the_call(
    tmp_path: Path,
) -> None:
    """From the booking step and from the approval wait: refused, one typed sentence,
    nothing recorded under the new id, which a later (stubbed) replay then takes."""
    airline = Airline()
    rid, new = new_id(), new_id("rep")
    async with sqlite(tmp_path) as stores:
        original = booking_agent(airline, approval=True)
        run = await fresh(stores).run(original, "go", tenant="t", run_id=rid)
        assert run.status is RunStatus.waiting_approval
        step = await step_with(stores, rid, "book_seat")
        for from_step in {step, max(await stores.checkpoints.steps("t", rid))}:
            with pytest.raises(ConfigurationError, match="recorded as side-effecting"):
                await fresh(stores).replay(
                    read_only_revision(airline), rid, tenant="t", from_step=from_step,
                    stubs={}, new_run_id=new,
                )  # fmt: skip
        assert await stores.checkpoints.latest("t", new) is None
        assert await stores.idempotency.records("t", new) == []
        assert stores.ledger is not None and await stores.ledger.spent("t", new) == 0
        rep = await fresh(stores).replay(
            original, rid, tenant="t", from_step=step, stubs={"book_seat": stub_booking},
            new_run_id=new,
        )  # fmt: skip
        assert rep.status is RunStatus.waiting_approval and rep.run_id == new
    assert airline.bookings == []


def test_the_cli_says_the_refusal_in_one_sentence(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'adk.sqlite3'}"
    rid, new = new_id(), new_id("rep")

    async def build() -> int:
        async with open_stores(url) as stores:
            await stores.create_schema()
            await fresh(stores).run(AGENT, "go", tenant="t", run_id=rid)
            return await step_with(stores, rid, "book_seat")

    step = asyncio.run(build())
    code, out, err = cli(
        *("--store", url, "replay", rid, "--tenant", "t", "--from-step", str(step)),
        *("--agent", f"{HERE}:READ_ONLY", "--provider", f"{HERE}:provider"),
        *("--new-run-id", new),
    )
    assert code == 2, (code, out, err)
    assert "recorded as side-effecting" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    code, _, err = cli("--store", url, "show", new, "--tenant", "t")
    assert code == 1, err


class _FailsAtTurn:
    def __init__(self, n: int) -> None:
        self.inner, self.n, self.asked = ScriptedProvider(BOOK_TURNS), n, 0

    async def complete(self, request: Any) -> Any:
        self.asked += 1
        if self.asked == self.n:
            raise ProviderError("400 bad request", retryable=False)
        return await self.inner.complete(request)


@pytest.mark.parametrize("ending", ["completed", "failed", "cancelled"])
async def test_a_replay_from_a_final_step_is_written_as_its_own_run(
    tmp_path: Path, ending: str
) -> None:
    airline = Airline()
    agent = booking_agent(airline, approval=ending == "cancelled")
    rid, new = new_id(), new_id("rep")
    turns = [
        ScriptedTurn(calls=[("search_flights", {"origin": "FRA", "dest": "JFK"})], cost_micros=7),
        ScriptedTurn(calls=[("book_seat", {"flight": "LH123"})], cost_micros=11),
        ScriptedTurn(text="Booked.", cost_micros=13),
    ]
    url = f"sqlite:///{tmp_path / 'adk.sqlite3'}"
    async with sqlite(tmp_path) as stores:
        if ending == "failed":
            runner = AgentRunner.from_stores(_FailsAtTurn(3), stores)
            await runner.run(agent, "go", tenant="t", run_id=rid)
        else:
            run = await fresh(stores, turns).run(agent, "go", tenant="t", run_id=rid)
            if ending == "cancelled":
                assert run.status is RunStatus.waiting_approval
                assert await fresh(stores).cancel(rid, tenant="t", by="op") is not None
        checkpoints = fresh(stores).checkpoints
        assert checkpoints is not None
        last = max(await stores.checkpoints.steps("t", rid))
        final = await checkpoints.at("t", rid, last)
        assert final is not None and final.status.value == ending
        rep = await fresh(stores).replay(
            agent, rid, tenant="t", from_step=last, stubs={"book_seat": stub_booking},
            new_run_id=new,
        )  # fmt: skip
        assert rep.status is RunStatus(ending) and rep.output == final.output
        assert rep.replay_of == f"{rid}@{last}" and rep.spent_micros == 0
        written = await checkpoints.latest("t", new)
        assert written is not None and written.status is final.status
        assert written.replay_of == f"{rid}@{last}" and written.output == final.output
        assert written.micros == 0 and written.usage.input_tokens == 0
        assert await checkpoints.messages(written) == await checkpoints.messages(final)
        assert await stores.checkpoints.steps("t", new) == [1]
        assert stores.ledger is not None and await stores.ledger.spent("t", new) == 0
        with pytest.raises(ConfigurationError, match="already exists"):
            await fresh(stores).replay(
                agent, rid, tenant="t", from_step=last, stubs={"book_seat": stub_booking},
                new_run_id=new,
            )  # fmt: skip
        with pytest.raises(RunStartedError):
            await fresh(stores).submit(agent, "go", tenant="t", run_id=new)
        with pytest.raises(RunStartedError):
            await fresh(stores).run(agent, "go", tenant="t", run_id=new)
        assert await fresh(stores).work.input("t", new) is None  # type: ignore[union-attr]
    code, shown, err = cli("--store", url, "show", new, "--tenant", "t", "--json")
    assert code == 0, err
    printed = json.loads(shown)
    assert printed["replay_of"] == f"{rid}@{last}" and printed["status"] == ending
    assert printed["spent"] == {"micros": 0, "input_tokens": 0, "output_tokens": 0}
    assert [s["step"] for s in printed["steps"]] == [1]
    code, _, err = cli(
        *("--store", url, "submit", "--agent", f"{HERE}:AGENT", "--tenant", "t"),
        *("--input", "go", "--run-id", new),
    )
    assert code == 4 and "replay of" in err, (code, err)
    assert airline.bookings == ([] if ending == "cancelled" else ["LH123"])


async def test_the_same_submission_again_of_a_run_whose_frontier_is_a_tombstone(
    tmp_path: Path,
) -> None:
    from tesserix_adk.checkpoint.payload.frontier_codec import tombstone_payload

    agent = booking_agent(Airline())
    rid = new_id()
    async with sqlite(tmp_path) as stores:
        await fresh(stores).submit(agent, "go", tenant="t", run_id=rid)
        await fresh(stores).run(agent, "go", tenant="t", run_id=rid)
        last = max(await stores.checkpoints.steps("t", rid))
        tomb = tombstone_payload(
            tenant="t", run_id=rid, agent_name="booking", step=last + 1, reason="big", fence=1
        )
        await stores.checkpoints.put("t", rid, tomb, step=last + 1, fence=1)
        assert await fresh(stores).submit(agent, "go", tenant="t", run_id=rid) == rid
        other = Agent("other", "x", list(agent.tools.values()))
        with pytest.raises(RunStartedError, match="carried by agent"):
            await fresh(stores).submit(other, "go", tenant="t", run_id=rid)


ODD_NAMES = ["bücher agent/1", "  spaced  ", "\uff21\uff47\uff45\uff4e\uff54", "a" * 300]


@pytest.mark.parametrize("name", ODD_NAMES)
async def test_the_same_submission_again_for_an_oddly_named_agent(
    tmp_path: Path, name: str
) -> None:
    agent = Agent(name, "Book.", list(booking_agent(Airline()).tools.values()))
    rid = new_id()
    async with sqlite(tmp_path) as stores:
        await fresh(stores).run(agent, "go", tenant="t", run_id=rid)
        assert await fresh(stores).submit(agent, "go", tenant="t", run_id=rid) == rid
        with pytest.raises(RunStartedError):
            await fresh(stores).submit(agent, "another", tenant="t", run_id=rid)


AIRLINE = Airline()
AGENT = booking_agent(AIRLINE)
READ_ONLY = read_only_revision(AIRLINE)


def provider() -> ScriptedProvider:
    return ScriptedProvider(BOOK_TURNS)
