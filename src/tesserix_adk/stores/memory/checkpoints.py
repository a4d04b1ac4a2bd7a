"""In-process checkpoints: each run's frontier and its step snapshots."""

from __future__ import annotations

from dataclasses import dataclass, field

from tesserix_adk.errors import ConfigurationError
from tesserix_adk.stores.memory.fencing import Fences, RunKey
from tesserix_adk.stores.protocols import StoredCheckpoint

__all__ = ["MemoryCheckpointStore"]


@dataclass(slots=True, kw_only=True)
class _CheckpointRun:
    frontier: StoredCheckpoint | None = None
    steps: dict[int, StoredCheckpoint] = field(default_factory=dict)


class MemoryCheckpointStore:
    """A ``CheckpointStore`` in a dictionary; ``keep_last=N`` keeps the N highest steps."""

    def __init__(self, *, keep_last: int | None = None) -> None:
        if keep_last is not None and keep_last < 1:
            raise ConfigurationError(f"keep_last must be at least 1, got {keep_last}")
        self.keep_last = keep_last
        self._runs: dict[RunKey, _CheckpointRun] = {}
        self._fences = Fences()

    async def put(
        self, tenant: str, run_id: str, payload: bytes, *, step: int, fence: int | None = None
    ) -> None:
        """Write a frontier; it becomes ``latest`` and step ``step`` (last write wins)."""
        self._fences.check(tenant, run_id, fence)
        self._fences.accept(tenant, run_id, fence)
        checkpoint = StoredCheckpoint(payload=bytes(payload), step=step, fence=fence)
        run = self._runs.setdefault((tenant, run_id), _CheckpointRun())
        run.frontier = checkpoint
        run.steps[step] = checkpoint
        if self.keep_last is not None and len(run.steps) > self.keep_last:
            # The frontier is kept apart from the steps, so pruning its step never loses it.
            for old in sorted(run.steps)[: -self.keep_last]:
                del run.steps[old]

    async def latest(self, tenant: str, run_id: str) -> StoredCheckpoint | None:
        """The last accepted put, or ``None``."""
        run = self._runs.get((tenant, run_id))
        return None if run is None else run.frontier

    async def at(self, tenant: str, run_id: str, step: int) -> StoredCheckpoint | None:
        """The snapshot written under ``step``, or ``None`` (never a default)."""
        run = self._runs.get((tenant, run_id))
        return None if run is None else run.steps.get(step)

    async def steps(self, tenant: str, run_id: str) -> list[int]:
        """The steps still kept for the run, ascending."""
        run = self._runs.get((tenant, run_id))
        return [] if run is None else sorted(run.steps)

    async def runs(self, tenant: str) -> list[str]:
        """The run ids with a frontier for the tenant, sorted."""
        return sorted(
            run_id
            for (owner, run_id), run in self._runs.items()
            if owner == tenant and run.frontier is not None
        )

    async def forget(self, tenant: str, run_id: str) -> None:
        """Remove the run's frontier and steps; its fence stays."""
        self._runs.pop((tenant, run_id), None)

    async def seal(self, tenant: str, run_id: str, fence: int) -> None:
        """Raise the highest-seen fence for the run without writing data."""
        self._fences.seal(tenant, run_id, fence)
