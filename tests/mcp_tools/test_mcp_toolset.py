"""An MCP server's tools as kit tools, against the real test server (tests/mcp_tools/
server.py) over stdio and streamable HTTP: flags from annotations, the idempotency key in
``_meta``, results as outcomes, connection failures as typed errors, and the tool list in
the agent's revision."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from mcp_tools.servers import SERVER, Effects, free_port, http_server, stdio
from tesserix_adk import (
    Agent,
    AgentRunner,
    ConfigurationError,
    IndeterminateToolCallError,
    RevisionMismatchError,
    RunStatus,
    ScriptedProvider,
    open_stores,
)
from tesserix_adk.mcp import (
    MCPReplyLostError,
    MCPToolError,
    MCPToolOverride,
    MCPToolset,
    MCPUnavailableError,
)
from tesserix_adk.messages import Role
from tesserix_adk.providers.base import ModelRequest, ModelResponse
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.stores.protocols import RecordStatus

T = "acme"
BOOK = [
    [("find_flights", {"origin": "FRA", "dest": "JFK"})],
    [("book_seat", {"flight": "LH123"})],
    "Booked.",
]


class _Told(ScriptedProvider):
    """The scripted model, keeping the last transcript it was sent."""

    last: ModelRequest | None = None

    async def complete(self, request: ModelRequest) -> ModelResponse:
        self.last = request
        return await super().complete(request)

    def tool_results(self) -> list[tuple[str, bool]]:
        assert self.last is not None
        return [(m.text, m.is_error) for m in self.last.messages if m.role is Role.tool]


def _runner(provider: ScriptedProvider, stores: Stores) -> AgentRunner:
    return AgentRunner.from_stores(provider, stores)


async def test_tools_are_listed_with_flags_from_their_annotations(tmp_path: Path) -> None:
    async with stdio(Effects(tmp_path)) as toolset:
        tools = {t.name: t for t in toolset.tools}
    assert sorted(tools) == [
        "book_seat",
        "booking_for",
        "cancel_booking",
        "find_flights",
        "set_seat_limit",
    ]
    flags = {n: (t.side_effects, t.idempotent, t.keyed) for n, t in tools.items()}
    assert flags["find_flights"] == (False, False, True)  # readOnlyHint
    assert flags["set_seat_limit"] == (True, True, True)  # idempotentHint
    assert flags["book_seat"] == (True, False, True)  # no hints: side-effecting and keyed
    assert flags["cancel_booking"] == (True, False, True)
    book = tools["book_seat"]
    assert book.description == "Book a seat on a flight."
    assert book.spec.parameters["properties"] == {"flight": {"title": "Flight", "type": "string"}}
    assert book.spec.parameters["required"] == ["flight"]


async def test_an_override_sets_a_tools_flags_over_its_annotations(tmp_path: Path) -> None:
    overrides = {
        "find_flights": MCPToolOverride(side_effects=True),
        "book_seat": MCPToolOverride(idempotent=True, requires_approval=True),
        "set_seat_limit": MCPToolOverride(key=None),
    }
    async with stdio(Effects(tmp_path), overrides=overrides) as toolset:
        tools = {t.name: t for t in toolset.tools}
    assert (tools["find_flights"].side_effects, tools["find_flights"].idempotent) == (True, False)
    book = tools["book_seat"]
    assert (book.side_effects, book.idempotent, book.requires_approval) == (True, True, True)
    assert not tools["set_seat_limit"].keyed
    assert tools["cancel_booking"].side_effects and not tools["cancel_booking"].idempotent


async def test_an_override_naming_no_listed_tool_is_refused(tmp_path: Path) -> None:
    toolset = stdio(Effects(tmp_path), overrides={"book_set": MCPToolOverride()})
    with pytest.raises(ConfigurationError, match="book_set"):
        async with toolset:
            pass


async def test_a_run_calls_the_mcp_tool_once_and_its_key_reaches_the_server(
    tmp_path: Path,
) -> None:
    effects = Effects(tmp_path)
    provider = _Told(BOOK)
    async with stdio(effects) as toolset, open_stores("memory://") as stores:
        agent = Agent("booking", "Book.", toolset.tools)
        run = await _runner(provider, stores).run(agent, "book", tenant=T, run_id="r1")
        (record,) = [r for r in await stores.idempotency.records(T, "r1") if r.tool == "book_seat"]
    assert run.status is RunStatus.completed
    assert effects.keys() == [record.key]
    assert record.key is not None and record.key.startswith("k1:")
    assert provider.tool_results() == [("LH123 FRA-JFK", False), ("booking B1", False)]


async def test_over_streamable_http_the_key_reaches_the_server(tmp_path: Path) -> None:
    effects = Effects(tmp_path)
    provider = _Told(BOOK)
    with http_server(effects) as url:
        async with MCPToolset.http(url) as toolset, open_stores("memory://") as stores:
            assert {t.name for t in toolset.tools} >= {"book_seat", "find_flights"}
            agent = Agent("booking", "Book.", toolset.tools)
            run = await _runner(provider, stores).run(agent, "book", tenant=T, run_id="h1")
            (record,) = [
                r for r in await stores.idempotency.records(T, "h1") if r.tool == "book_seat"
            ]
    assert run.status is RunStatus.completed
    assert effects.keys() == [record.key]
    assert provider.tool_results()[-1] == ("booking B1", False)


async def test_an_error_result_is_the_calls_error_outcome(tmp_path: Path) -> None:
    provider = _Told([[("cancel_booking", {"booking": "B9"})], "Sorry."])
    async with stdio(Effects(tmp_path)) as toolset, open_stores("memory://") as stores:
        with pytest.raises(MCPToolError, match="no booking B9") as raised:
            await toolset.call("cancel_booking", {"booking": "B9"})
        assert raised.value.retryable is False
        agent = Agent("booking", "Book.", toolset.tools)
        run = await _runner(provider, stores).run(agent, "cancel", tenant=T, run_id="e1")
    assert run.status is RunStatus.completed
    ((text, is_error),) = provider.tool_results()
    assert is_error and "no booking B9" in text


async def test_arguments_the_server_refuses_are_an_error_outcome(tmp_path: Path) -> None:
    async with stdio(Effects(tmp_path)) as toolset:
        with pytest.raises(MCPToolError):
            await toolset.call("set_seat_limit", {"limit": "many"})


async def test_a_server_that_cannot_be_reached_is_retryable(tmp_path: Path) -> None:
    with pytest.raises(MCPUnavailableError) as raised:
        async with MCPToolset.http(f"http://127.0.0.1:{free_port()}/mcp"):
            pass
    assert raised.value.retryable is True and raised.value.outcome_unknown is False


async def test_a_server_command_that_does_not_exist_is_a_configuration_error(
    tmp_path: Path,
) -> None:
    with pytest.raises(ConfigurationError) as raised:
        async with MCPToolset.stdio(str(tmp_path / "no-such-server")):
            pass
    assert raised.value.retryable is False


async def test_a_server_dying_mid_call_is_a_lost_reply_and_later_calls_are_not_sent(
    tmp_path: Path,
) -> None:
    effects, hold = Effects(tmp_path), tmp_path / "hold"
    hold.mkdir()
    async with stdio(effects, MCP_HOLD_DIR=str(hold)) as toolset:
        call = asyncio.ensure_future(toolset.call("book_seat", {"flight": "LH1"}, key="k-1"))
        inside = hold / "inside"
        deadline = time.monotonic() + 20
        while not inside.exists():
            assert time.monotonic() < deadline and not call.done()
            await asyncio.sleep(0.02)
        os.kill(int(inside.read_text()), signal.SIGKILL)
        with pytest.raises(MCPReplyLostError) as lost:
            await asyncio.wait_for(call, 20)
        assert lost.value.outcome_unknown and lost.value.retryable
        assert "may have run" in str(lost.value)
        with pytest.raises(MCPUnavailableError) as unsent:
            await toolset.call("book_seat", {"flight": "LH2"}, key="k-2")
        assert not unsent.value.outcome_unknown
    assert effects.keys() == ["k-1"]


def _waiting(variant: str, effects: Effects) -> MCPToolset:
    # book_seat waits on an approval, so the run stops with a frontier to resume from.
    return stdio(
        effects,
        variant=variant,
        overrides={"book_seat": MCPToolOverride(requires_approval=True)},
    )


@pytest.mark.parametrize("variant", ["schema", "annotations", "added"])
async def test_a_server_that_changed_its_tools_is_a_changed_agent_and_resume_refuses_it(
    tmp_path: Path, variant: str
) -> None:
    effects = Effects(tmp_path)
    async with open_stores("memory://") as stores:
        runner = _runner(ScriptedProvider(BOOK), stores)
        async with _waiting("", effects) as toolset:
            agent = Agent("booking", "Book.", toolset.tools)
            run = await runner.run(agent, "book", tenant=T, run_id="v1")
            assert run.status is RunStatus.waiting_approval
        async with _waiting("", effects) as toolset:
            assert Agent("booking", "Book.", toolset.tools).revision == agent.revision
        async with _waiting(variant, effects) as toolset:
            changed = Agent("booking", "Book.", toolset.tools)
            assert changed.revision != agent.revision
            with pytest.raises(RevisionMismatchError):
                await runner.resume(changed, "v1", tenant=T)
    assert effects.keys() == []


async def test_a_prefix_names_the_kit_tool_and_the_server_is_asked_for_its_own_name(
    tmp_path: Path,
) -> None:
    effects = Effects(tmp_path)
    toolset = MCPToolset.stdio(sys.executable, [SERVER], env=effects.env(), prefix="airline_")
    provider = _Told([[("airline_book_seat", {"flight": "LH7"})], "Booked."])
    async with toolset, open_stores("memory://") as stores:
        assert "airline_book_seat" in {t.name for t in toolset.tools}
        agent = Agent("booking", "Book.", toolset.tools)
        run = await _runner(provider, stores).run(agent, "book", tenant=T, run_id="p1")
    assert run.status is RunStatus.completed
    assert provider.tool_results() == [("booking B1", False)]
    assert len(effects.keys()) == 1


async def test_an_unkeyed_tool_sends_no_key(tmp_path: Path) -> None:
    effects = Effects(tmp_path)
    overrides = {"book_seat": MCPToolOverride(key=None)}
    provider = _Told([[("book_seat", {"flight": "LH7"})], "Booked."])
    async with stdio(effects, overrides=overrides) as toolset, open_stores("memory://") as stores:
        agent = Agent("booking", "Book.", toolset.tools)
        await _runner(provider, stores).run(agent, "book", tenant=T, run_id="u1")
    assert effects.keys() == [None]


async def test_a_call_past_its_timeout_is_a_lost_reply_and_the_connection_stays(
    tmp_path: Path,
) -> None:
    effects, hold = Effects(tmp_path), tmp_path / "hold"
    hold.mkdir()
    toolset = MCPToolset.stdio(
        sys.executable,
        [SERVER],
        env=effects.env(MCP_HOLD_DIR=str(hold)),
        call_timeout=0.5,
    )
    async with toolset:
        with pytest.raises(MCPReplyLostError, match="may have run") as lost:
            await toolset.call("book_seat", {"flight": "LH1"}, key="k-1")
        assert lost.value.outcome_unknown
        (hold / "release").write_text("")
        assert await toolset.call("find_flights", {"origin": "FRA", "dest": "JFK"}) == (
            "LH123 FRA-JFK"
        )
    assert effects.keys() == ["k-1"]


async def test_a_run_whose_mcp_call_lost_its_reply_leaves_it_in_doubt(tmp_path: Path) -> None:
    """Not an error result the model would answer by asking again under a new key: the
    call stays in flight and the resume refuses it, naming it, until someone decides."""
    effects, hold = Effects(tmp_path), tmp_path / "hold"
    hold.mkdir()
    toolset = MCPToolset.stdio(
        sys.executable, [SERVER], env=effects.env(MCP_HOLD_DIR=str(hold)), call_timeout=0.5
    )
    async with toolset, open_stores("memory://") as stores:
        agent = Agent("booking", "Book.", toolset.tools)
        with pytest.raises(MCPReplyLostError):
            await _runner(ScriptedProvider(BOOK), stores).run(agent, "book", tenant=T, run_id="r1")
        (record,) = [r for r in await stores.idempotency.records(T, "r1") if r.tool == "book_seat"]
        assert record.status is RecordStatus.in_flight
        (hold / "release").write_text("")
        with pytest.raises(IndeterminateToolCallError, match="book_seat"):
            await _runner(ScriptedProvider(BOOK[1:]), stores).resume(agent, "r1", tenant=T)
    assert effects.keys() == [record.key]


async def test_tools_are_asked_for_only_while_connected(tmp_path: Path) -> None:
    toolset = stdio(Effects(tmp_path))
    with pytest.raises(ConfigurationError, match="not connected"):
        _ = toolset.tools
    async with toolset:
        assert toolset.tools
    with pytest.raises(ConfigurationError, match="not connected"):
        await toolset.call("find_flights", {"origin": "FRA", "dest": "JFK"})
