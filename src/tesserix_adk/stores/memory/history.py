"""In-process transcripts: each run's items with their chained digests."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from tesserix_adk.errors import HistoryUnavailableError
from tesserix_adk.stores._common import prefix_of
from tesserix_adk.stores.memory.fencing import Fences, RunKey
from tesserix_adk.stores.protocols import EMPTY_HISTORY_DIGEST, HistoryHandle, chain_digest

__all__ = ["MemoryHistoryStore"]


@dataclass(slots=True, kw_only=True)
class _Transcript:
    items: list[bytes] = field(default_factory=list)
    # digests[n] names the prefix of length n, so digests[0] is the empty prefix.
    digests: list[str] = field(default_factory=lambda: [EMPTY_HISTORY_DIGEST])

    def resolves(self, count: int, digest: str) -> bool:
        return 0 <= count < len(self.digests) and self.digests[count] == digest


class MemoryHistoryStore:
    """A ``HistoryStore`` in a dictionary: each run's items with their chained digests."""

    def __init__(self) -> None:
        self._runs: dict[RunKey, _Transcript] = {}
        self._fences = Fences()

    async def append(
        self,
        tenant: str,
        run_id: str,
        encoded: Sequence[bytes],
        *,
        fence: int | None = None,
        after: HistoryHandle | None,
    ) -> HistoryHandle:
        """Append after the prefix ``after`` names (``None``: the empty prefix), dropping
        any tail beyond it; ``HistoryUnavailableError`` if that prefix does not resolve."""
        self._fences.check(tenant, run_id, fence)
        count, digest = prefix_of(tenant, run_id, after)
        transcript = self._runs.get((tenant, run_id), _Transcript())
        if not transcript.resolves(count, digest):
            raise HistoryUnavailableError(
                f"the transcript of run {run_id!r} no longer has the prefix of {count} "
                f"messages this append follows"
            )
        self._fences.accept(tenant, run_id, fence)
        # A dead writer may have appended past ``after``; that tail is dropped.
        del transcript.items[count:]
        del transcript.digests[count + 1 :]
        for item in encoded:
            transcript.items.append(bytes(item))
            transcript.digests.append(chain_digest(transcript.digests[-1], item))
        self._runs[(tenant, run_id)] = transcript
        return HistoryHandle(
            tenant=tenant,
            run_id=run_id,
            count=len(transcript.items),
            digest=transcript.digests[-1],
        )

    async def fetch(self, handle: HistoryHandle) -> list[bytes]:
        """The bytes of the prefix; ``HistoryUnavailableError`` if it does not resolve."""
        transcript = self._runs.get((handle.tenant, handle.run_id), _Transcript())
        if not transcript.resolves(handle.count, handle.digest):
            raise HistoryUnavailableError(
                f"the transcript of run {handle.run_id!r} no longer has the prefix of "
                f"{handle.count} messages the handle names"
            )
        return transcript.items[: handle.count]

    async def forget(self, tenant: str, run_id: str) -> None:
        """Remove the run's transcript; its fence stays."""
        self._runs.pop((tenant, run_id), None)

    async def seal(self, tenant: str, run_id: str, fence: int) -> None:
        """Raise the highest-seen fence for the run without writing data."""
        self._fences.seal(tenant, run_id, fence)
