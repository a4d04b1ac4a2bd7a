"""What every backend says and checks the same way, written once: ttl checks, the stored
form of an approval's calls, the messages of a refused fence or claim, and the prefix an
append follows and the digests it chains.

The idempotency state machine and the resolution check live in ``records.py``; decoding a
damaged row lives in ``rows.py``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from tesserix_adk.errors import StaleFenceError
from tesserix_adk.messages import ToolCall
from tesserix_adk.stores.protocols import EMPTY_HISTORY_DIGEST, HistoryHandle, chain_digest

__all__ = [
    "calls_to_json",
    "no_claim",
    "positive_ttl",
    "stale_fence",
    "unsealable",
    "chained_digests",
    "prefix_of",
]


def positive_ttl(ttl: float) -> float:
    """``ttl`` as a float, or ``ValueError`` unless it is a positive number of seconds."""
    if not ttl > 0:
        raise ValueError(f"ttl must be a positive number of seconds, got {ttl!r}")
    return float(ttl)


def calls_to_json(calls: Sequence[ToolCall]) -> str:
    """An approval's calls as stored: compact JSON, ASCII only.

    ASCII because a lone surrogate in a model's arguments has no UTF-8 form: escaped, it
    round-trips through every backend's text column; raw, one backend would refuse it.
    """
    return json.dumps(
        [{"id": c.id, "name": c.name, "arguments": dict(c.arguments)} for c in calls],
        separators=(",", ":"),
        ensure_ascii=True,
    )


def stale_fence(what: str, run_id: str, fence: int | None, seen: int | None) -> StaleFenceError:
    """The refusal of a write ``what`` carrying ``fence`` once fence ``seen`` was seen
    (``None``: a higher one, not named)."""
    saw = "a higher fence was seen" if seen is None else f"fence {seen} was seen"
    if fence is None:
        return StaleFenceError(f"unfenced {what} refused for run {run_id!r}: {saw}")
    return StaleFenceError(f"fence {fence} is stale for run {run_id!r}: {saw}")


def unsealable(run_id: str, fence: int, seen: int | None) -> StaleFenceError:
    """The refusal of a seal at ``fence`` once a higher fence was seen."""
    saw = "a higher fence" if seen is None else f"fence {seen}"
    return StaleFenceError(f"cannot seal run {run_id!r} at fence {fence}: {saw} was seen")


def no_claim(holder: str, key: str) -> StaleFenceError:
    """The refusal of a completion or release by a holder whose claim is not there."""
    return StaleFenceError(f"{holder!r} holds no claim on {key!r}")


def prefix_of(tenant: str, run_id: str, after: HistoryHandle | None) -> tuple[int, str]:
    """The (length, digest) of the transcript prefix an append follows; ``ValueError`` when
    ``after`` names another run."""
    if after is None:
        return 0, EMPTY_HISTORY_DIGEST
    if (after.tenant, after.run_id) != (tenant, run_id):
        raise ValueError(
            f"handle names run {after.run_id!r} of {after.tenant!r}, "
            f"not run {run_id!r} of {tenant!r}"
        )
    return after.count, after.digest


def chained_digests(digest: str, items: Sequence[bytes]) -> list[str]:
    """The digest of each longer prefix as ``items`` extend the one ``digest`` names."""
    digests: list[str] = []
    for item in items:
        digest = chain_digest(digest, item)
        digests.append(digest)
    return digests
