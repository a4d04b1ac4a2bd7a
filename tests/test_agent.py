"""Agent revisions: stable, and sensitive to exactly what changes a resumed run."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from typing import Any

import pytest

from tesserix_adk import Agent, ConfigurationError, tool


def _agent(**overrides: Any) -> Agent:
    flags = overrides.pop("flags", {})

    @tool(**flags)
    def book_seat(flight: str) -> str:
        """Book a seat."""
        return flight

    kwargs: dict[str, Any] = {"model": "openai:gpt-x"}
    kwargs.update(overrides)
    instructions = kwargs.pop("instructions", "Book flights.")
    return Agent("booking", instructions, [book_seat], **kwargs)


def test_revision_is_stable_across_definitions_and_processes() -> None:
    assert _agent().revision == _agent().revision
    code = (
        "from tesserix_adk import Agent, tool\n"
        "@tool\n"
        "def book_seat(flight: str) -> str:\n"
        "    '''Book a seat.'''\n"
        "    return 'another body entirely'\n"
        "print(Agent('booking', 'Book flights.', [book_seat], model='openai:gpt-x').revision)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == _agent().revision


@pytest.mark.parametrize(
    "change",
    [
        {"instructions": "Book flights, fast."},
        {"model": "anthropic:claude"},
        {"flags": {"side_effects": False}},
        {"flags": {"idempotent": True}},
        {"flags": {"requires_approval": True}},
        {"flags": {"key": None}},
        {"flags": {"description": "Reserve a seat."}},
        {"flags": {"name": "reserve_seat"}},
    ],
)
def test_any_contract_change_is_a_new_revision(change: dict[str, Any]) -> None:
    assert _agent(**change).revision != _agent().revision


def test_limits_do_not_change_the_revision_but_an_explicit_one_wins() -> None:
    assert _agent(max_iterations=3).revision == _agent().revision
    assert _agent(revision="v7").revision == "v7"


def test_bad_definitions_are_configuration_errors() -> None:
    @tool
    def a(x: int) -> int:
        return x

    with pytest.raises(ConfigurationError):
        Agent("x", "y", [a, a])
    with pytest.raises(ConfigurationError):
        Agent("x", "y", [lambda: None])  # type: ignore[list-item]
    with pytest.raises(ConfigurationError):
        Agent("x", "y", max_iterations=0)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("instructions", "Book every seat."),
        ("model", "other"),
        ("revision", "sha256:0"),
        ("tools", {}),
    ],
)
def test_an_agent_is_fixed_once_made(field: str, value: Any) -> None:
    """Its revision pins what it was made with: changed afterwards, a resume would go on
    under the old revision with new instructions or tools."""
    agent = _agent()
    before = (getattr(agent, field), agent.revision)
    with pytest.raises(AttributeError, match="fixed once made"):
        setattr(agent, field, value)
    assert (getattr(agent, field), agent.revision) == before


@pytest.mark.parametrize(
    ("field", "value"), [("description", "Other."), ("side_effects", False), ("key", None)]
)
def test_a_tool_is_fixed_once_made(field: str, value: Any) -> None:
    agent = _agent()
    made = agent.tools["book_seat"]
    before = getattr(made, field)
    with pytest.raises(AttributeError, match="fixed once an agent holds it"):
        setattr(made, field, value)
    assert getattr(made, field) == before
    assert _agent().revision == agent.revision


def test_a_tool_no_agent_holds_yet_may_still_be_set_up() -> None:
    """A subclass (an MCP tool) finishes its own fields after ``Tool.__init__``."""

    @tool
    def look(q: str) -> str:
        """Look."""
        return q

    look.description = "Look it up."
    assert Agent("a", "i", [look]).tools["look"].description == "Look it up."


def test_an_agents_tools_cannot_be_swapped_in_place() -> None:
    agent = _agent()

    @tool
    def other(x: str) -> str:
        """Other."""
        return x

    with pytest.raises(TypeError):
        agent.tools["book_seat"] = other  # type: ignore[index]
    with pytest.raises(AttributeError):
        agent.tools.pop("book_seat")  # type: ignore[attr-defined]
    assert list(agent.tools) == ["book_seat"] and agent.tools.get("nope") is None
    assert dict(agent.tools) == {"book_seat": agent.tools["book_seat"]}


def test_a_copied_agent_is_the_same_agent_and_as_fixed() -> None:
    agent = _agent()
    for copied in (copy.copy(agent), copy.deepcopy(agent)):
        assert copied.revision == agent.revision and list(copied.tools) == ["book_seat"]
        with pytest.raises(AttributeError, match="fixed once made"):
            copied.instructions = "other"


def test_a_pinned_tools_schema_is_read_only_all_the_way_down_and_still_json() -> None:
    agent = _agent()
    schema = agent.tools["book_seat"].parameters
    for change in (
        lambda: schema.__setitem__("type", "array"),
        lambda: schema["properties"]["flight"].update(type="integer"),
        lambda: schema["required"].append("x"),
        lambda: schema["properties"].pop("flight"),
    ):
        with pytest.raises(TypeError, match="fixed once an agent holds it"):
            change()
    assert json.loads(json.dumps(schema)) == schema
    assert copy.deepcopy(agent).tools["book_seat"].parameters == schema
    assert _agent().revision == agent.revision


def test_the_limits_the_revision_does_not_pin_can_be_set() -> None:
    """A run may be resumed with other limits, so they are not fixed."""
    agent = _agent()
    before = agent.revision
    agent.max_iterations = 3
    agent.parallel_tool_calls = 2
    agent.budget_micros = 10
    assert (agent.max_iterations, agent.parallel_tool_calls, agent.revision) == (3, 2, before)
