"""The envelope every payload shares: the format number, the checksum and the nesting limit.

**Checksum.** Every payload is a JSON object whose last member is
``"checksum":"sha256:<64 hex>"``; the digest covers the exact bytes of the payload with that
member cut out (``{...,"checksum":"…"}`` → ``{...}``). Bytes, not a re-serialised form, so
any changed byte is caught: in the body the digest no longer matches, in the checksum member
either the digest or the member's shape is broken. The payload stays plain JSON, so stores,
operators and tests can still read it. A checksum guards against damage, not against a
forger: anyone who can rewrite the bytes can recompute sha256.

**Formats.** ``CHECKPOINT_FORMAT`` is the payload version; 2 added the checksum. A frontier
whose observation names transcript entries is format 3 (``observation.NAMING_FORMAT``), so
a kit that reads only 2 refuses it; one that names its carrier (a Temporal run) is format 4
(``frontier_codec.CARRIER_FORMAT``), so a kit that reads only 3 refuses it; every other
payload is still written as 2. A reader
verifies the checksum *before* it believes the ``format`` field, so a changed format digit is
corrupt, not a newer format. A newer format is refused with ``CheckpointFormatError`` (its
bytes left for a newer kit) when it verifies, or when it carries no checksum this reader
recognises (a newer kit may seal differently). Format 1 payloads (released before the
checksum; golden payloads under ``tests/``) are still read, strictly:

- a payload that verifies but claims format 1 is corrupt (one changed digit of a format-2
  payload cannot pass as format 1);
- a payload claiming format 1 that has a ``checksum`` member at all is corrupt;
- a payload claiming format 2 without a verifying checksum is corrupt.

No single-byte change turns a format-2 payload into a readable format-1 one: that needs the
checksum member removed (about 80 bytes) *and* the digit changed. Such a deliberate edit is
forgery, which a checksum cannot stop, so format 1 stays readable (refusing it would strand
every run written before the upgrade). Transcript entries and outcomes carry no format
field; one without a checksum is read only in the exact shape the kit wrote before
checksums (no other key, every type right).

**Nesting.** No payload nests more than ``MAX_NESTING`` (64) JSON arrays/objects deep, the
envelope included: a tool call's arguments object may nest 58 levels below itself. Encoding
something deeper raises ``CheckpointTooLargeError(retryable=False)`` (refused, like an
oversized frontier: the ``Checkpointer`` writes a tombstone), except an outcome, which is
replaced (see ``outcomes``); decoding it raises ``CheckpointCorruptError``. Depth is measured
on the bytes before ``json.loads`` runs, so no payload reaches a recursive parser or
redactor.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import sys
from collections.abc import Mapping
from typing import Any

from pydantic_core import from_json

from tesserix_adk.errors import (
    CheckpointCorruptError,
    CheckpointFormatError,
    CheckpointTooLargeError,
)

__all__ = [
    "CHECKPOINT_FORMAT",
    "DEFAULT_MAX_BYTES",
    "MAX_NESTING",
    "seal",
    "unseal",
    "within_nesting",
]

CHECKPOINT_FORMAT = 2
"""The format this kit writes every payload in (2 added the checksum), except a frontier
that names transcript entries (format 3, ``NAMING_FORMAT``) or its carrier (format 4)."""

DEFAULT_MAX_BYTES = 1024 * 1024
"""The default cap on one frontier, one transcript entry and one recorded outcome."""

MAX_NESTING = 64
"""How deep any payload may nest JSON arrays and objects, its envelope included."""


_CHECKSUM_HEAD = b',"checksum":"sha256:'
_CHECKSUM = re.compile(rb',"checksum":"sha256:([0-9a-f]{64})"\}')
_CHECKSUM_LEN = len(_CHECKSUM_HEAD) + 64 + 2

# JSON strings (escapes included) are cut out before brackets are counted.
_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_A_BRACKET = re.compile(r"[^\[\]{}]+")
_INNERMOST = re.compile(r"\[\]|\{\}")


def seal(body: Mapping[str, Any] | bytes) -> bytes:
    """``body`` (an object, or the exact bytes of a non-empty JSON object) as payload
    bytes, its checksum member last."""
    raw = body if isinstance(body, bytes) else _dumps(body)
    if not (raw.startswith(b"{") and raw.endswith(b"}") and raw != b"{}"):
        raise ValueError("only a non-empty JSON object can be sealed")
    digest = hashlib.sha256(raw).hexdigest().encode("ascii")
    return raw[:-1] + _CHECKSUM_HEAD + digest + b'"}'


def unseal(payload: bytes, *, what: str) -> tuple[dict[str, Any], bool]:
    """The JSON object of a payload and whether it carried a verifying checksum.

    ``CheckpointCorruptError`` (naming ``what``) if it is not a JSON object within
    ``MAX_NESTING``, or its checksum member is there and does not match. A payload with no
    checksum member in the place the kit writes it comes back with ``False``; the caller
    decides whether that shape may be read unverified.
    """
    tail = _CHECKSUM.fullmatch(payload, max(len(payload) - _CHECKSUM_LEN, 0))
    if tail is not None and len(payload) > _CHECKSUM_LEN:
        body = payload[:-_CHECKSUM_LEN] + b"}"
        digest = hashlib.sha256(body).hexdigest().encode("ascii")
        if not hmac.compare_digest(digest, tail.group(1)):
            raise CheckpointCorruptError(
                f"{what} does not match its checksum ({len(payload)} bytes): it was changed "
                "after it was written"
            )
        raw = _object(_loads(body, what), what)
        if "checksum" in raw:
            raise CheckpointCorruptError(f"{what} has two checksum members")
        return raw, True
    return _object(_loads(payload, what), what), False


_DIGEST_AT = len(_CHECKSUM_HEAD)
_FORMAT_KEY = "format"


def _sealed_now(payload: bytes, fast: bool) -> dict[str, Any] | None:
    """The body of ``payload`` with its ``format`` member taken out, where it is sealed as
    this kit writes today (a verifying checksum, format ``CHECKPOINT_FORMAT``, no second
    checksum, read by pydantic-core when ``fast``); otherwise ``None``, and the caller
    reads it through ``_versioned``, which decides and says why.

    What ``_versioned`` returns for such a payload, with less work per call: a resume reads
    every transcript entry of the run this way.
    """
    cut = len(payload) - _CHECKSUM_LEN
    if cut <= 0 or payload[cut : cut + _DIGEST_AT] != _CHECKSUM_HEAD:
        return None
    body = payload[:cut] + b"}"
    # A hexdigest is 64 lowercase hex digits, so a match is the shape ``_CHECKSUM`` wants.
    if payload[cut + _DIGEST_AT :] != hashlib.sha256(body).hexdigest().encode("ascii") + b'"}':
        return None
    if not fast or body.count(b"[") + body.count(b"{") > MAX_NESTING:
        return None
    try:
        raw = from_json(body)
    except ValueError:
        return None
    if type(raw) is not dict or "checksum" in raw:
        return None
    fmt = raw.pop(_FORMAT_KEY, None)
    if type(fmt) is not int or fmt != CHECKPOINT_FORMAT:
        return None
    return raw


def _reads_fast() -> bool:
    """Whether pydantic-core may parse payloads (see ``_loads``)."""
    limit = sys.get_int_max_str_digits()
    return limit == 0 or limit >= _DIGITS


# The longest integer pydantic-core reads (2.18 and later), Python's default limit too.
_DIGITS = 4300


def _loads(data: bytes, what: str) -> Any:
    limit = sys.get_int_max_str_digits()
    if data.count(b"[") + data.count(b"{") <= MAX_NESTING and (limit == 0 or limit >= _DIGITS):
        # Shallow enough whatever it holds (see ``_nesting``): parsed from the bytes by
        # pydantic-core, without a copy as text or a call through ``json``'s Python layers,
        # several times faster on a transcript entry. It accepts no document ``json``
        # refuses (``tests/checkpoint/test_json_reading.py``, and the attack in
        # ``test_attacks_fast_decoding.py``), and whatever it refuses goes to ``json``,
        # which decides and says why. It reads integers of up to 4,300 digits whatever the
        # interpreter allows, so under a lower limit ``json`` reads them all.
        try:
            return from_json(data)
        except ValueError:
            pass
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CheckpointCorruptError(f"{what} is not UTF-8 ({len(data)} bytes)") from exc
    depth = _nesting(text)
    if depth is None:
        raise CheckpointCorruptError(f"{what} is not valid JSON ({len(data)} bytes)")
    if depth > MAX_NESTING:
        raise CheckpointCorruptError(f"{what} nests deeper than the limit of {MAX_NESTING} levels")
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise CheckpointCorruptError(f"{what} is not valid JSON ({len(data)} bytes)") from exc


def _nesting(text: str) -> int | None:
    """How deep ``text`` nests arrays and objects, counting at most ``MAX_NESTING + 1``
    (or a bound of it within the limit); ``None`` if its brackets do not pair up (it cannot
    be JSON)."""
    opening = text.count("[") + text.count("{")
    if opening <= MAX_NESTING:
        # Nothing can nest deeper than it has brackets (brackets in strings only add to
        # the count): most payloads end here, before any regex walks them. Unpaired ones
        # still fail json.loads.
        return opening
    brackets = _NOT_A_BRACKET.sub("", _JSON_STRING.sub("", text))
    depth = 0
    # Each pass removes the innermost level; passes are capped, so hostile depth is cheap.
    while brackets and depth <= MAX_NESTING:
        fewer = _INNERMOST.sub("", brackets)
        if fewer == brackets:
            return None
        brackets = fewer
        depth += 1
    return depth


def _object(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise CheckpointCorruptError(f"{what} is not a JSON object")
    return value


def _versioned(payload: bytes, what: str) -> tuple[dict[str, Any], bool]:
    """The body of a transcript entry or outcome, its ``format`` member checked and removed,
    and whether it was sealed.

    Sealed ones open with ``"format"`` and close with the checksum, so no single cut of
    their bytes leaves a well-formed payload without either. One with neither is read as
    the kit wrote it before checksums; one with only one of them is corrupt.
    """
    raw, sealed, _ = _versioned_up_to(payload, what, CHECKPOINT_FORMAT)
    return raw, sealed


def _versioned_up_to(
    payload: bytes, what: str, newest: int
) -> tuple[dict[str, Any], bool, int | None]:
    """``_versioned`` for a payload this kit reads up to format ``newest``, with its format
    (``None``: written before checksums)."""
    raw, sealed = unseal(payload, what=what)
    fmt = raw.pop("format", None)
    if fmt is not None and (not isinstance(fmt, int) or isinstance(fmt, bool)):
        raise CheckpointCorruptError(f"{what} has no valid format")
    if fmt is not None and fmt > newest:
        raise CheckpointFormatError(
            f"{what} has format {fmt}, newer than the {newest} this kit reads; "
            "read it with a newer tesserix-adk"
        )
    if sealed and (fmt is None or fmt < 2):
        raise CheckpointCorruptError(f"{what} has a checksum but no format that has one")
    if not sealed and (fmt is not None or "checksum" in raw):
        raise CheckpointCorruptError(f"{what} has no checksum that verifies")
    return raw, sealed, fmt


def within_nesting(value: Any, limit: int = MAX_NESTING) -> bool:
    """Whether ``value`` nests at most ``limit`` containers deep; iterative, so a value
    nested thousands deep is measured without recursion (and without walking it all)."""
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, Mapping):
            children: Any = item.values()
        elif isinstance(item, list | tuple):
            children = item
        else:
            continue
        if depth + 1 > limit:
            return False
        stack.extend((child, depth + 1) for child in children)
    return True


def _bounded(value: Any, what: str) -> Any:
    """``value`` unchanged, or ``CheckpointTooLargeError`` if it alone nests too deep to be
    redacted or encoded (checked before anything recursive sees it)."""
    if not within_nesting(value):
        raise CheckpointTooLargeError(
            f"{what} nests deeper than the limit of {MAX_NESTING} levels; it was not written",
            retryable=False,
        )
    return value


def _sealed_within(body: Mapping[str, Any], what: str) -> bytes:
    payload = seal(body)
    depth = _nesting(payload.decode("utf-8"))
    if depth is None or depth > MAX_NESTING:
        raise CheckpointTooLargeError(
            f"{what} nests deeper than the limit of {MAX_NESTING} levels; it was not written",
            retryable=False,
        )
    return payload


def _dumps(value: Any) -> bytes:
    text = json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        # A lone surrogate (a tool or a model may return one; JSON text can carry it, UTF-8
        # cannot): written as a \u escape, so it reads back as it came.
        return json.dumps(value, separators=(",", ":"), ensure_ascii=True).encode("ascii")
