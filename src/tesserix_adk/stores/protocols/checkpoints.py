"""Checkpoint stores and their optional capabilities."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from tesserix_adk.stores.protocols.transcripts import HistoryHandle, HistoryStore

__all__ = [
    "CheckpointStore",
    "FencedStore",
    "FrontierWithHistory",
    "RunListing",
    "StepHistory",
    "StoredCheckpoint",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class StoredCheckpoint:
    """A frontier or step snapshot as a store keeps it: opaque bytes plus metadata."""

    payload: bytes
    step: int
    fence: int | None = None


@runtime_checkable
class FencedStore(Protocol):
    """A store that refuses writes from a superseded holder."""

    async def seal(self, tenant: str, run_id: str, fence: int) -> None:
        """Raise the highest-seen fence for the run without writing data."""
        ...


@runtime_checkable
class CheckpointStore(Protocol):
    """Keeps one frontier per run (``latest``).

    What a backend may offer beyond this is declared as a capability protocol of its own
    and asked for by type: ``StepHistory`` (numbered step snapshots), ``RunListing`` (the
    runs of a tenant) and ``FrontierWithHistory`` (a frontier and its transcript in one
    transaction). Every backend the kit ships offers all three.
    """

    async def put(
        self, tenant: str, run_id: str, payload: bytes, *, step: int, fence: int | None = None
    ) -> None:
        """Write a frontier; it becomes ``latest`` and step ``step`` (last write wins)."""
        ...

    async def latest(self, tenant: str, run_id: str) -> StoredCheckpoint | None:
        """The last accepted put, or ``None``."""
        ...

    async def forget(self, tenant: str, run_id: str) -> None:
        """Remove the run's frontier and steps; its fence stays."""
        ...

    async def seal(self, tenant: str, run_id: str, fence: int) -> None:
        """Raise the highest-seen fence for the run without writing data."""
        ...


@runtime_checkable
class StepHistory(Protocol):
    """A capability of a ``CheckpointStore``: every put is also kept as the snapshot of
    its step, for ``tesserix steps``, ``inspect --step`` and replay."""

    async def at(self, tenant: str, run_id: str, step: int) -> StoredCheckpoint | None:
        """The snapshot written under ``step``, or ``None`` (never a default)."""
        ...

    async def steps(self, tenant: str, run_id: str) -> list[int]:
        """The steps still kept for the run, ascending."""
        ...


@runtime_checkable
class RunListing(Protocol):
    """A capability of a ``CheckpointStore``: the runs of a tenant, for ``tesserix runs``."""

    async def runs(self, tenant: str) -> list[str]:
        """The run ids with a frontier for the tenant, sorted."""
        ...


@runtime_checkable
class FrontierWithHistory(Protocol):
    """A capability of a ``CheckpointStore``: a transcript append and the frontier that
    names it written in one transaction (one commit, one sync)."""

    async def put_with_history(
        self,
        history: HistoryStore,
        tenant: str,
        run_id: str,
        payload: bytes,
        *,
        step: int,
        fence: int | None,
        encoded: Sequence[bytes],
        after: HistoryHandle | None,
    ) -> HistoryHandle | None:
        """Append ``encoded`` after ``after`` and put the frontier, atomically; ``None``
        (and nothing written) when ``history`` is not in this store's database, and the
        caller writes them one after the other."""
        ...
