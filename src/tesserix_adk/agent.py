"""``Agent``: what a run is an instance of, and its ``revision``.

The revision pins everything that changes what a resumed run would do (instructions, model,
each tool's contract) and nothing that does not (the module it lives in, tool bodies): a
frontier written under one revision is refused by an agent with another.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from tesserix_adk.errors import ConfigurationError
from tesserix_adk.tools import Tool, canonical_json

__all__ = ["Agent"]


class Agent:
    """An agent definition: instructions, tools, limits and an optional typed state. What
    its ``revision`` pins (name, instructions, model, tools) is fixed once made; the limits
    are not."""

    __slots__ = (
        "budget_micros",
        "instructions",
        "max_iterations",
        "model",
        "name",
        "parallel_tool_calls",
        "revision",
        "state_schema",
        "tools",
    )

    def __init__(
        self,
        name: str,
        instructions: str,
        tools: Iterable[Tool] = (),
        *,
        model: str | None = None,
        revision: str | None = None,
        max_iterations: int = 20,
        budget_micros: int | None = None,
        state_schema: type[Any] | None = None,
        parallel_tool_calls: int = 1,
    ) -> None:
        """``parallel_tool_calls``: how many of a turn's calls may run at once (1: one at a
        time in the model's order). Results reach the model in its order either way, and
        it is not part of the revision: a run may be resumed with another value."""
        tool_list = tuple(tools)
        for t in tool_list:
            if not isinstance(t, Tool):
                raise ConfigurationError(
                    f"agent {name!r}: {t!r} is not a Tool; decorate it with @tool"
                )
        names = [t.name for t in tool_list]
        if len(set(names)) != len(names):
            raise ConfigurationError(f"agent {name!r} has two tools with the same name")
        if not _whole(max_iterations, least=1):
            raise ConfigurationError(
                f"agent {name!r}: max_iterations must be a whole number of at least 1, "
                f"not {max_iterations!r}"
            )
        # Checked here, not at the first comparison: NaN would switch the budget off.
        if budget_micros is not None and not _whole(budget_micros, least=0):
            raise ConfigurationError(
                f"agent {name!r}: budget_micros must be a whole number of micros (0 or more) "
                f"or None, not {budget_micros!r}"
            )
        if not _whole(parallel_tool_calls, least=1):
            raise ConfigurationError(
                f"agent {name!r}: parallel_tool_calls must be a whole number of at least 1, "
                f"not {parallel_tool_calls!r}"
            )
        self.name = name
        self.instructions = instructions
        for t in tool_list:
            t.pin()
        self.tools: Mapping[str, Tool] = _Tools({t.name: t for t in tool_list})
        self.model = model
        self.max_iterations = max_iterations
        self.budget_micros = budget_micros
        self.state_schema = state_schema
        # Not in the revision: how many calls go out at once changes neither which calls a
        # turn makes, nor their keys, nor what the model is told, and resume decides each
        # call on its own whatever ran beside it.
        self.parallel_tool_calls = parallel_tool_calls
        self.revision = revision or self._computed_revision()

    def __setattr__(self, name: str, value: Any) -> None:
        # What the revision pins is fixed once made: a frontier written under it must not
        # be resumed by an agent changed since under its old revision. Limits are not
        # pinned (a run may be resumed with others), nor a subclass's own attributes.
        if name in _PINNED and hasattr(self, "revision") and hasattr(self, name):
            raise AttributeError(
                f"agent {self.name!r} is fixed once made (its revision pins it); make a new Agent"
            )
        object.__setattr__(self, name, value)

    def __delattr__(self, name: str) -> None:
        if name in _PINNED and hasattr(self, "revision"):
            raise AttributeError(f"agent {self.name!r} is fixed once made; make a new Agent")
        object.__delattr__(self, name)

    def _computed_revision(self) -> str:
        body = canonical_json(
            {
                "name": self.name,
                "instructions": self.instructions,
                "model": self.model,
                "tools": [
                    {
                        "name": t.name,
                        "description": t.description,
                        "schema": t.parameters,
                        "side_effects": t.side_effects,
                        "idempotent": t.idempotent,
                        "requires_approval": t.requires_approval,
                        "keyed": t.keyed,
                    }
                    for t in sorted(self.tools.values(), key=lambda t: t.name)
                ],
            }
        )
        return "sha256:" + hashlib.sha256(body.encode("utf-8")).hexdigest()

    def __repr__(self) -> str:
        return f"Agent({self.name!r}, revision={self.revision[:15]}…)"


# The fields the revision is computed from (and the revision itself).
_PINNED = frozenset({"name", "instructions", "model", "tools", "revision"})


class _Tools(Mapping[str, Tool]):
    """An agent's tools by name, read-only: its revision pins them (a plain mapping that
    copies and compares as a dict does)."""

    __slots__ = ("_by_name",)

    def __init__(self, by_name: dict[str, Tool]) -> None:
        self._by_name = by_name

    def __getitem__(self, name: str) -> Tool:
        return self._by_name[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_name)

    def __len__(self) -> int:
        return len(self._by_name)

    def get(self, name: str, default: Any = None) -> Any:
        """The tool named ``name``, or ``default``."""
        return self._by_name.get(name, default)

    def __repr__(self) -> str:
        return repr(self._by_name)


def _whole(value: object, *, least: int) -> bool:
    """``value`` is an ``int`` (not a ``bool``) of at least ``least``."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= least
