"""Which write group a store's write joins: the one the current attempt opened on that
store's database (``protocols.grouping``).

The runner marks each attempt with a ``GroupScope`` (a context variable, set by
``group_scope()``), so every task of the attempt, the shielded ones that finish recording
an outcome included, sees the group open on it, and no task of another run does. A
backend's group subclasses ``OpenGroup``; its stores ask ``joined(database)``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass

__all__ = ["GroupScope", "OpenGroup", "group_scope", "in_scope", "joined", "outside_scope"]


@dataclass(slots=True, eq=False)
class GroupScope:
    """One attempt's slot for its open group; shared by every task the attempt starts."""

    group: OpenGroup | None = None


# A context variable, not state: each attempt's tasks see their own scope or none.
_SCOPE: ContextVar[GroupScope | None] = ContextVar("tesserix_adk_group_scope", default=None)


@contextlib.contextmanager
def group_scope() -> Iterator[GroupScope]:
    """Mark the current context (and the tasks it starts) as one attempt's."""
    scope = GroupScope()
    token = _SCOPE.set(scope)
    try:
        yield scope
    finally:
        _SCOPE.reset(token)


@contextlib.contextmanager
def outside_scope() -> Iterator[None]:
    """Run the user's code (a tool, a reconciler) outside the attempt's scope: a task it
    starts, which may outlive the call, never joins a group the run opens later."""
    token = _SCOPE.set(None)
    try:
        yield
    finally:
        _SCOPE.reset(token)


def in_scope() -> bool:
    """Whether this context belongs to an attempt that may open a group."""
    return _SCOPE.get() is not None


def joined(owner: object) -> OpenGroup | None:
    """The group this context's attempt has open on ``owner`` (a database), if any."""
    scope = _SCOPE.get()
    group = None if scope is None else scope.group
    if group is None or group.owner is not owner or not group.active:
        return None
    return group


class OpenGroup:
    """The part of a backend's write group that says who joins it: while active, writes
    on ``owner`` from the attempt that opened it."""

    def __init__(self, owner: object) -> None:
        self.owner = owner
        self.active = False
        self._scope: GroupScope | None = None

    def _enter(self) -> None:
        scope = _SCOPE.get()
        if scope is None:
            # Nobody would ever join it: every write would wait for it, so refuse now.
            raise RuntimeError("a write group is opened only inside group_scope()")
        scope.group = self
        self._scope = scope
        self.active = True

    def _leave(self) -> None:
        self.active = False
        if self._scope is not None and self._scope.group is self:
            self._scope.group = None
        self._scope = None
