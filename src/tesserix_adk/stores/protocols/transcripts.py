"""Transcripts kept out of line, as chained prefixes."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

__all__ = ["EMPTY_HISTORY_DIGEST", "HistoryHandle", "HistoryStore", "chain_digest", "chained"]


EMPTY_HISTORY_DIGEST = "sha256:" + hashlib.sha256(b"").hexdigest()


def chain_digest(previous: str, item: bytes) -> str:
    """The digest of a transcript prefix extended by one encoded message."""
    h = hashlib.sha256()
    h.update(previous.encode("ascii"))
    h.update(b"\x00")
    h.update(hashlib.sha256(item).digest())
    return "sha256:" + h.hexdigest()


def chained(previous: str, items: Iterable[bytes]) -> str:
    """``chain_digest`` applied to each of ``items`` in turn: the digest of ``previous``'s
    prefix extended by all of them (a resume chains every entry of the run)."""
    sha256 = hashlib.sha256
    digest: bytes | None = None
    for item in items:
        # ``previous`` is encoded only once there is something to chain onto it.
        prefix = previous.encode("ascii") if digest is None else digest
        digest = b"sha256:" + sha256(prefix + b"\x00" + sha256(item).digest()).hexdigest().encode()
    return previous if digest is None else digest.decode("ascii")


@dataclass(frozen=True, slots=True, kw_only=True)
class HistoryHandle:
    """Names an exact prefix of a run's transcript: its length and chained digest."""

    tenant: str
    run_id: str
    count: int
    digest: str


@runtime_checkable
class HistoryStore(Protocol):
    """Keeps a run's encoded messages out of line, appended as the run goes."""

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
        ...

    async def fetch(self, handle: HistoryHandle) -> list[bytes]:
        """The bytes of the prefix; ``HistoryUnavailableError`` if it does not resolve."""
        ...

    async def forget(self, tenant: str, run_id: str) -> None:
        """Remove the run's transcript; its fence stays."""
        ...

    async def seal(self, tenant: str, run_id: str, fence: int) -> None:
        """Raise the highest-seen fence for the run without writing data."""
        ...
