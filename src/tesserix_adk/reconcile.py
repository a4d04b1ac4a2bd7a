"""Reconcilers: a tool's own way of finding out whether a call in doubt happened.

A call is in doubt when its claim was taken and no outcome recorded: the worker that sent
it may have died before, during or after the effect. Nobody may guess; but the system the
tool talks to often knows. ``@tool(reconcile=fn)`` gives a resume that question to ask:
``fn(call, ctx)`` (sync or async) looks the call up by ``ctx.idempotency_key`` and answers
``Reconciled.completed(content)``, ``Reconciled.never_ran()`` or ``Reconciled.unknown()``.
The answer is recorded as an operator's would be, ``by="reconciler:<tool>"``. A reconciler
that raises, hangs past its timeout or returns anything else is ``unknown``: the call stays
in doubt and the run is parked for a person.

``ctx.call.arguments`` are the arguments as the frontier kept them, secrets masked; look the
call up by its key, not by a masked argument.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tesserix_adk.messages import ToolCall
    from tesserix_adk.tools import ToolContext

__all__ = ["Reconciled", "ReconciledAs", "Reconciler"]


class ReconciledAs(StrEnum):
    """What a reconciler found."""

    completed = "completed"
    never_ran = "never_ran"
    unknown = "unknown"


@dataclass(frozen=True, slots=True)
class Reconciled:
    """A reconciler's answer; build it with ``completed``, ``never_ran`` or ``unknown``."""

    found: ReconciledAs
    content: Any = None

    def __post_init__(self) -> None:
        # ``Reconciled("unknown")`` is a natural slip; anything that is not one of the
        # three answers is refused here, so it reaches the runner as a failed reconciler
        # (unknown), never as a guess.
        try:
            found = ReconciledAs(self.found)
        except ValueError:
            raise ValueError(
                f"a reconciler answers completed, never_ran or unknown, not {self.found!r}"
            ) from None
        object.__setattr__(self, "found", found)

    @classmethod
    def completed(cls, content: Any) -> Reconciled:
        """The call happened; ``content`` is what the tool would have returned."""
        return cls(ReconciledAs.completed, content)

    @classmethod
    def never_ran(cls) -> Reconciled:
        """The call did not happen (and cannot happen late): it may be sent."""
        return cls(ReconciledAs.never_ran)

    @classmethod
    def unknown(cls) -> Reconciled:
        """The system cannot say: the call stays in doubt."""
        return cls(ReconciledAs.unknown)


Reconciler = Callable[["ToolCall", "ToolContext"], Reconciled | Awaitable[Reconciled]]
"""``fn(call, ctx) -> Reconciled`` (or an awaitable of one)."""
