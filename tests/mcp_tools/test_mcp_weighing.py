"""A reply past ``max_reply_items`` (``tesserix_adk.mcp.weighing``) is not read: its call
alone is in doubt, the connection stays, and the run stops without sending it again. The
raw stdio server is the crash attacks' (``Hostile``): ``blocks`` answers ``book_seat``
with ``BLOCKS`` annotated text blocks, ``error_blocks`` with an error carrying that many
values, ``noisy`` sends a notification of that many values before its plain answer."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mcp_tools.test_attacks_mcp_crashes import BOOK, Hostile, T, _record
from tesserix_adk import (
    Agent,
    AgentRunner,
    IndeterminateToolCallError,
    ScriptedProvider,
    open_stores,
)
from tesserix_adk.errors import ConfigurationError, ToolOutcomeUnknownError
from tesserix_adk.mcp import MCPReplyLostError, MCPToolError, MCPToolset
from tesserix_adk.mcp.weighing import heavier_than
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.stores.protocols import RecordStatus

# One of the server's blocks, as it writes it.
_BLOCK = json.loads(
    '{"type":"text","text":"b","annotations":{"audience":["user","assistant","user",'
    '"assistant"],"priority":0.5,"lastModified":"2025-01-01T00:00:00Z"},"_meta":{"a":1}}'
)


def _count(value: Any) -> int:
    """The oracle: every JSON value in ``value``, containers and scalars alike."""
    if isinstance(value, dict):
        return 1 + sum(_count(v) for v in value.values())
    if isinstance(value, list):
        return 1 + sum(_count(v) for v in value)
    return 1


def _blocks_reply(n: int) -> int:
    """The values in the ``blocks`` server's result for ``n`` blocks."""
    return _count({"content": [_BLOCK] * n})


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner) | st.dictionaries(st.text(), inner),
    max_leaves=60,
)


@given(value=_json, limit=st.integers(min_value=0, max_value=80))
def test_heavier_than_agrees_with_counting_every_value(value: Any, limit: int) -> None:
    assert heavier_than(value, limit) is (_count(value) > limit)


@pytest.fixture
def hostile(tmp_path: Path) -> Hostile:
    return Hostile(tmp_path)


@pytest.fixture
async def stores(tmp_path: Path) -> AsyncIterator[Stores]:
    async with open_stores(f"sqlite:///{tmp_path / 'adk.sqlite3'}") as opened:
        await opened.create_schema()
        yield opened


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "10"])
def test_max_reply_items_must_be_a_positive_whole_number(bad: Any) -> None:
    with pytest.raises(ConfigurationError, match="max_reply_items"):
        MCPToolset.stdio("server", max_reply_items=bad)
    with pytest.raises(ConfigurationError, match="max_reply_items"):
        MCPToolset.http("http://127.0.0.1:1/mcp", max_reply_items=bad)


async def test_a_reply_at_the_limit_is_read_and_one_past_it_is_in_doubt(
    hostile: Hostile,
) -> None:
    at = _blocks_reply(3)
    async with hostile.toolset("blocks", BLOCKS="3", max_reply_items=at) as toolset:
        assert await toolset.call("book_seat", {"flight": "LH1"}, key="k1") == "b\nb\nb"
    async with hostile.toolset("blocks", BLOCKS="3", max_reply_items=at - 1) as toolset:
        with pytest.raises(MCPReplyLostError, match="max_reply_items") as lost:
            await toolset.call("book_seat", {"flight": "LH2"}, key="k2")
        assert lost.value.outcome_unknown
        assert f"{at - 1:,} JSON values" in str(lost.value)
        # That call only: the connection stands and the next call is answered.
        assert await toolset.call("look", {}) == "seen"
    assert [c["arguments"]["flight"] for c in hostile.calls()] == ["LH1", "LH2"]


async def test_an_error_answer_past_the_limit_is_in_doubt_not_told_as_the_servers(
    hostile: Hostile,
) -> None:
    async with hostile.toolset("error_blocks", BLOCKS="5", max_reply_items=1000) as toolset:
        with pytest.raises(MCPToolError, match="refused"):  # within: the server's own no
            await toolset.call("book_seat", {"flight": "LH1"}, key="k1")
    async with hostile.toolset("error_blocks", BLOCKS="500", max_reply_items=1000) as toolset:
        with pytest.raises(MCPReplyLostError, match="max_reply_items"):
            await toolset.call("book_seat", {"flight": "LH2"}, key="k2")


async def test_a_notification_past_the_limit_is_dropped_and_the_call_answered(
    hostile: Hostile,
) -> None:
    async with hostile.toolset("noisy", BLOCKS="5000", max_reply_items=1000) as toolset:
        assert await toolset.call("book_seat", {"flight": "LH1"}, key="k1") == "booked"
        assert await toolset.call("look", {}) == "seen"


async def test_a_run_whose_reply_is_past_the_limit_stops_in_doubt_and_sends_it_once(
    hostile: Hostile, stores: Stores
) -> None:
    async with hostile.toolset("blocks", BLOCKS="200", max_reply_items=100) as toolset:
        agent = Agent("mcp", "book", list(toolset.tools))
        runner = AgentRunner.from_stores(ScriptedProvider(BOOK), stores)
        with pytest.raises(ToolOutcomeUnknownError, match="max_reply_items"):
            await runner.run(agent, "b", tenant=T, run_id="r")
        (record,) = await _record(stores, "r")
        assert record.status is RecordStatus.in_flight
        with pytest.raises(IndeterminateToolCallError):
            await runner.resume(agent, "r", tenant=T)
    assert len(hostile.calls()) == 1
