"""Agent revisions: stable, and sensitive to exactly what changes a resumed run."""

from __future__ import annotations

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
