"""``--json``: the machine-readable shapes the commands print, with stable field names.

Every time is ISO 8601 UTC (``timestamps.iso_time``) or ``null``; every idempotency key is
shown as its digest (``key_digest``), never raw, since a key is what a tool passes on to
the outside world. An error is one object: ``{"error": {"exit_code": N, "message": "..."}}``.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, TextIO

from tesserix_adk.stores.protocols import IdempotencyRecord, RunLease
from tesserix_adk.timestamps import iso_time
from tesserix_adk.tools import key_digest as digest_of

__all__ = ["claim_json", "emit", "error_json", "json_text", "key_digest", "lease_json", "when"]


def emit(out: TextIO, value: Any) -> None:
    """``value`` as one indented JSON document (``json_text``), written and flushed a piece
    at a time: a reader that leaves mid-document is then told (``BrokenPipeError``), never
    taken for a whole one (one large write that the pipe cut short reported no error)."""
    text = json_text(value, indent=2) + "\n"
    for start in range(0, len(text), _PIECE):
        out.write(text[start : start + _PIECE])
        out.flush()


# A pipe's usual capacity: a write no larger is refused whole once its reader has left.
_PIECE = 65536


def json_text(value: Any, *, indent: int | None = None) -> str:
    """Strict JSON in ASCII: every character past it escaped (C1 controls, bidi overrides,
    line separators reach no terminal raw; a lone surrogate is shown as U+FFFD), a float
    that is not finite written as the string ``"NaN"``, ``"Infinity"`` or ``"-Infinity"``
    (a bare ``NaN`` is not JSON: ``jq`` and strict parsers refuse the whole document)."""
    return json.dumps(_finite(value), indent=indent, default=str, ensure_ascii=True)


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, str):
        return _whole(value)
    if isinstance(value, dict):
        return {_whole(k) if isinstance(k, str) else k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


_SURROGATE = re.compile("[\ud800-\udfff]")


def _whole(text: str) -> str:
    """``text`` with each lone surrogate shown as U+FFFD: escaped as ``\\udXXX`` it is
    JSON but not I-JSON, and strict readers refuse the document."""
    return _SURROGATE.sub("\ufffd", text)


def error_json(code: int, message: str) -> dict[str, Any]:
    """What a command prints on stdout instead of its output when it fails under --json."""
    return {"error": {"exit_code": code, "message": message}}


def when(epoch: float | None) -> str | None:
    """A store-clock moment as ISO 8601 UTC, or ``None``."""
    return None if epoch is None or epoch <= 0 else iso_time(epoch)


def key_digest(key: str | None) -> str | None:
    """An idempotency key as an operator may see it: enough to tell keys apart."""
    return None if key is None else digest_of(key)


def lease_json(lease: RunLease | None) -> dict[str, Any] | None:
    """A run's live lease: who holds it, its fence and when it expires by the store's clock."""
    if lease is None:
        return None
    return {"holder": lease.holder, "fence": lease.fence, "expires_at": when(lease.expires_at)}


def claim_json(record: IdempotencyRecord | None) -> dict[str, Any] | None:
    """A resume claim (or any record without a tool): holder, status and expiry."""
    if record is None:
        return None
    return {
        "holder": record.holder,
        "status": str(record.status),
        "since": when(record.since),
        "expires_at": when(record.expires_at),
    }
