"""The ``Redactor``: the walker over data and the text scanner that apply every rule.

Under a sensitive key, every non-empty **string** becomes ``[redacted:<kind>]``, however deep
in the value; numbers, booleans and ``None`` stay as they are and containers keep their shape.
So a typed state with ``token: int`` or ``password: str | None`` still validates after
redaction and a run stays resumable; a numeric credential is not masked (keep credentials in
strings). A string that is JSON text stays JSON text: it is masked token by token in place
(duplicate keys included), never re-serialised.

``extra_patterns`` add regexes whose matches become ``[redacted:custom]``; they run on
Python's backtracking engine as written, on the text between placeholders.
"""

from __future__ import annotations

import base64
import functools
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from tesserix_adk.checkpoint.redaction.free_text import (
    _KEY_HINTS,
    _mask_key_values,
    _mask_validation_inputs,
)
from tesserix_adk.checkpoint.redaction.keys import _key_kind
from tesserix_adk.checkpoint.redaction.patterns import (
    _PLACEHOLDER,
    _SHORTEST_SECRET,
    AWS_KEY_ID,
    AWS_SECRET,
    _builtin_rules,
    _Rule,
)
from tesserix_adk.errors import ConfigurationError

__all__ = ["Redactor", "default_redactor"]


_CUSTOM = "[redacted:custom]"
_ENCODED = "[redacted:encoded]"

# A run of base64 (standard or URL-safe, padded or not), in lines of 40 or more as MIME
# (76) and PEM (64) wrap it; one shorter than what encodes the shortest secret is left.
# A line break is a real one or, in a repr or a log line, an escaped one (``\\n``); the
# next line may be indented (YAML, a quoted mail: spaces, tabs, ``>``).
_BASE64_RUN = re.compile(
    r"(?:[A-Za-z0-9+/_-]{40,}+(?:\r?\n|(?:\\r)?\\n)[ \t>]*+)++[A-Za-z0-9+/_-]*+={0,2}"
    r"|[A-Za-z0-9+/_-]{16,}+={0,2}"
)
_NOT_BASE64 = re.compile(r"\\[rn]|[\r\n= \t>]")
_SHORTEST_ENCODED = 16

# A pass over a string is repeated until nothing changes (a mask can move a boundary that
# a pattern's look-around depends on); this bounds the repeats.
_MAX_PASSES = 4

# JSON text nested in a string nested in JSON text …: deeper levels are masked as free text.
_MAX_JSON_DEPTH = 8

# How many recent texts a redactor remembers the masking of, and up to what length (a
# larger text is masked anew each time rather than held in memory).
_MEMO_ENTRIES = 128
_MEMO_MAX_CHARS = 16 * 1024

# Every hint of every rule (patterns, key words, validation messages), for one quick look at
# a string no rule can touch. Substring tests: one regex alternating them tried each of them
# at every position of the text, a few times slower on text without any. ("/" covers "://".)
_HINTS = (
    "-----begin",
    "sk-",
    "ghp_",
    "gho_",
    "ghu_",
    "ghs_",
    "ghr_",
    "github_pat_",
    "xox",
    "akia",
    "asia",
    "eyj",
    "basic",
    "bearer",
    "secret",
    "/",
    "+",
    *_KEY_HINTS,
    "input_value=",
)


def _hinted(lowered: str) -> bool:
    """Whether ``lowered`` (a lowercased text) holds any hint; without one, no rule masks it."""
    return any(hint in lowered for hint in _HINTS)


# --- JSON text --------------------------------------------------------------------------

_JSON_START = re.compile(r"[ \t\r\n]*+[{\[]")
_JSON_TOKEN = re.compile(r'"[^"\\]*+(?:\\.[^"\\]*+)*+"|[{}\[\]]')
_JSON_COLON = re.compile(r"[ \t\r\n]*+:")


def _mask_custom(match: re.Match[str]) -> str:
    return _CUSTOM if match.group(0) else ""


@dataclass(frozen=True, slots=True)
class Redactor:
    """Masks secrets in user data before it is stored, logged or shown.

    ``text(s)`` masks a string (free text, a log line, an error message, JSON text);
    ``value(v)`` masks JSON-like data. Both are linear in the size of their input.
    ``extra_patterns`` are regular expressions (strings) whose matches become
    ``[redacted:custom]``; they run after the built-in patterns, on the text between
    placeholders. ``enabled=False`` turns every method into the identity.
    """

    extra_patterns: tuple[str, ...] = ()
    enabled: bool = True
    _rules: tuple[_Rule, ...] = field(init=False, repr=False, compare=False)
    _extra: tuple[re.Pattern[str], ...] = field(init=False, repr=False, compare=False)
    _memo: Callable[[str], str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.extra_patterns, str):
            raise ConfigurationError(
                "extra_patterns takes a tuple of regular expressions, not one string"
            )
        patterns = tuple(self.extra_patterns)
        compiled: list[re.Pattern[str]] = []
        for i, source in enumerate(patterns):
            try:
                compiled.append(re.compile(source))
            except re.error as exc:
                raise ConfigurationError(
                    f"extra_patterns[{i}] is not a valid regular expression: {source!r} ({exc})"
                ) from exc
        object.__setattr__(self, "extra_patterns", patterns)
        object.__setattr__(self, "_rules", _builtin_rules())
        object.__setattr__(self, "_extra", tuple(compiled))
        # The same text reaches redaction several times on its way into a run (a tool's
        # result: its record, the transcript, the frontier's observation; a call's
        # arguments: the transcript and the outstanding call): it is scanned once.
        object.__setattr__(self, "_memo", functools.lru_cache(maxsize=_MEMO_ENTRIES)(self._scan))

    def text(self, value: str) -> str:
        """``value`` with every secret in it masked; JSON text stays JSON text."""
        if not self.enabled:
            return value
        return self._text(value, 0)

    def value(self, data: Any) -> Any:
        """A redacted copy of JSON-like ``data``; the input is never mutated.

        Mappings become new dicts and lists and tuples become new lists (the output is bound
        for JSON); strings are masked with ``text``, and so are string keys. Under a sensitive
        key every non-empty string, however deep, becomes ``[redacted:<kind>]``; numbers,
        booleans and ``None`` stay. ``bytes`` and any other object are returned as they are:
        give this the JSON form of the data, not objects that hide strings.
        """
        if not self.enabled:
            return data
        return self._walk(data, None)[0]

    def masks(self, data: Any) -> tuple[Any, bool]:
        """``value(data)`` and whether it masked anything, in one walk."""
        if not self.enabled:
            return data, False
        return self._walk(data, None)

    def changed(self, data: Any) -> bool:
        """Whether redaction masks anything in ``data`` (a tuple becoming a list is no change)."""
        if not self.enabled:
            return False
        return self._walk(data, None)[1]

    def _text(self, value: str, depth: int, inside: bool = False) -> str:
        if len(value) < _SHORTEST_SECRET:
            return value
        if depth == 0 and len(value) <= _MEMO_MAX_CHARS:
            return self._memo(value)
        return self._scan(value, depth, inside)

    def _scan(self, value: str, depth: int = 0, inside: bool = False) -> str:
        # ``inside``: ``value`` came out of decoded base64 (``_holds_secret``).
        if depth < _MAX_JSON_DEPTH and _JSON_START.match(value):
            masked = self._json_text(value, depth, inside)
            if masked is not None:
                return masked
        for _ in range(_MAX_PASSES):
            masked = self._builtin(value)
            if self._extra:
                masked = self._custom(masked)
            if masked == value:
                break
            value = masked
        # Last, so what a rule knows (an API key is a run of base64 digits too) is masked
        # as what it is first.
        if depth < _MAX_JSON_DEPTH:
            value = self._encoded(value, depth, inside)
        return value

    def _encoded(self, value: str, depth: int, inside: bool) -> str:
        """``value`` with each run of base64 in it (standard or URL-safe, padded or not,
        wrapped in lines as MIME writes it) masked whole when the bytes it encodes hold a
        secret: a tool's binary result is kept as base64, where no rule would see one. The
        bytes are read as Latin-1, one character a byte, and again without their NULs (text
        in UTF-16), so every ASCII secret shows."""
        if len(value) < _SHORTEST_ENCODED:
            return value
        out: list[str] = []
        done = 0
        for m in _BASE64_RUN.finditer(value):
            run = m.group(0).rstrip("\r\n")  # the line break after the last line stays
            if len(run) < _SHORTEST_ENCODED or not self._holds_secret(run, depth, inside):
                continue
            out.append(value[done : m.start()])
            out.append(_ENCODED)
            done = m.start() + len(run)
        if not out:
            return value
        out.append(value[done:])
        return "".join(out)

    def _holds_secret(self, run: str, depth: int, inside: bool) -> bool:
        digits = _NOT_BASE64.sub("", run)
        # ``/``, ``_`` and ``-`` are base64 digits too, so a run may begin with what comes
        # before the base64 (``v1-``, a URL's path): each of the four alignments is tried,
        # in the text as given (JSON text in it too). Inside what was decoded, base64 is as
        # an encoder wrote it, and trying four there at every level would multiply.
        skips = range(1) if inside else range(4)
        return any(self._decodes_to_secret(digits[skip:], depth) for skip in skips)

    def _decodes_to_secret(self, digits: str, depth: int) -> bool:
        if len(digits) % 4 == 1:
            digits = digits[:-1]  # a stray last character encodes no whole byte
        if len(digits) < _SHORTEST_ENCODED - 4:
            return False
        try:
            raw = base64.b64decode(digits + "=" * (-len(digits) % 4), altchars=b"-_")
        except ValueError:  # binascii.Error: not base64 after all
            return False
        text = raw.decode("latin-1")
        if self._scan(text, depth + 1, inside=True) != text:
            return True
        bare = text.replace("\x00", "")
        return bare != text and self._scan(bare, depth + 1, inside=True) != bare

    def _builtin(self, value: str) -> str:
        if len(value) < _SHORTEST_SECRET:
            return value
        lowered = value.lower()
        if not _hinted(lowered):
            return value
        for rule in self._rules:
            value = rule.apply(value, lowered)
        if any(h in lowered for h in _KEY_HINTS):
            value = _mask_key_values(value)
        if "input_value=" in value:
            value = _mask_validation_inputs(value)
        return value

    def _custom(self, value: str) -> str:
        # Placeholders (the built-ins' and earlier patterns') are split out first, so a custom
        # pattern never eats into one or grows it on every pass; a pattern that matches the
        # empty string masks nothing.
        for pattern in self._extra:
            parts = _PLACEHOLDER.split(value)
            parts[::2] = [pattern.sub(_mask_custom, part) for part in parts[::2]]
            value = "".join(parts)
        return value

    def _json_text(self, text: str, depth: int, inside: bool = False) -> str | None:
        """JSON text masked in place, string by string; ``None`` if ``text`` is not JSON.

        Walking the tokens (not ``json.loads`` and back) keeps the text as it was, and masks
        every duplicate of a key, not only the one a parser would keep.
        """
        try:
            # Only whether it is JSON: an integer is not built (one past the interpreter's
            # digit limit is still JSON, and its neighbours still masked by key).
            json.loads(text, parse_int=len)
        except (ValueError, RecursionError):
            return None
        out: list[str] = []
        done = 0
        # Per open container: whether it is an object, and the kind its strings inherit.
        stack: list[tuple[bool, str | None]] = []
        # Per open array: its items so far, its first item when a string, and its second
        # with the kind the first gives it (a ``["x-api-key", "…"]`` pair masks it at ``]``).
        pairs: list[list[Any]] = []
        value_kind: str | None = None  # the kind of the key whose value comes next
        key_id: str | None = None  # that key, when an AWS key id (its value may be the secret)
        for m in _JSON_TOKEN.finditer(text):
            token = m.group(0)
            in_object, inherited = stack[-1] if stack else (False, None)
            if token in ("{", "["):
                if not in_object and pairs:
                    pairs[-1][0] += 1
                stack.append((token == "{", value_kind if in_object else inherited))
                if token == "[":
                    pairs.append([0, None, None])
                continue
            if token in ("}", "]"):
                stack.pop()
                if token == "]":
                    count, _, second = pairs.pop()
                    if count == 2 and second is not None:
                        item, kind = second
                        if kind is not None and item.start() >= done and item.group(0) != '""':
                            out.append(text[done : item.start()])
                            out.append(json.dumps(f"[redacted:{kind}]"))
                            done = item.end()
                continue
            decoded = json.loads(token) if "\\" in token else token[1:-1]
            if in_object and _JSON_COLON.match(text, m.end()):
                value_kind = _key_kind(decoded) or inherited
                key_id = decoded if _AWS_KEY_ID.fullmatch(decoded) else None
                masked = self._text(decoded, depth + 1, inside)
            else:
                kind = value_kind if in_object else inherited
                if in_object and kind is None and key_id is not None:
                    kind = _kind_for(key_id, decoded)
                masked = self._mask_under(kind, decoded, depth + 1, inside)
                if not in_object and pairs:
                    level = pairs[-1]
                    level[0] += 1
                    if level[0] == 1:
                        level[1] = decoded
                    elif level[0] == 2 and masked == decoded and level[1] is not None:
                        level[2] = (m, _kind_for(level[1], decoded))
            if masked != decoded:
                out.append(text[done : m.start()])
                out.append(json.dumps(masked, ensure_ascii=False))
                done = m.end()
        if not out:
            return text
        out.append(text[done:])
        return "".join(out)

    def _mask_under(self, kind: str | None, value: str, depth: int, inside: bool = False) -> str:
        if kind is None:
            return self._text(value, depth, inside)
        if not value or _PLACEHOLDER.fullmatch(value):
            return value
        return f"[redacted:{kind}]"

    def _walk(self, data: Any, kind: str | None) -> tuple[Any, bool]:
        if isinstance(data, str):
            masked = self._mask_under(kind, data, 0)
            return masked, masked != data
        if isinstance(data, Mapping):
            out: dict[Any, Any] = {}
            changed = False
            for key, item in data.items():
                new_key = key
                item_kind = kind
                if isinstance(key, str):
                    new_key = self._text(key, 0)
                    changed = changed or new_key != key
                    item_kind = _kind_for(key, item) or kind
                    # Two keys that are secrets themselves may mask alike, or one mask
                    # like a key beside it: kept apart, so the record loses no value the
                    # transcript (JSON text) still holds.
                    masked, count = new_key, 2
                    while new_key in out:
                        new_key = f"{masked} #{count}"
                        count += 1
                out[new_key], item_changed = self._walk(item, item_kind)
                changed = changed or item_changed
            return out, changed
        if isinstance(data, list | tuple):
            pair_kind = _pair_kind(data)
            if pair_kind is not None:
                # A (name, value) pair, as headers' items or a header list hold one: the
                # value is masked as it would be under that name in a mapping.
                name, name_changed = self._walk(data[0], kind)
                value, value_changed = self._walk(data[1], pair_kind)
                return [name, value], name_changed or value_changed
            items = [self._walk(item, kind) for item in data]
            return [item for item, _ in items], any(c for _, c in items)
        return data, False


def _pair_kind(data: list[Any] | tuple[Any, ...]) -> str | None:
    """The credential kind a ``[name, value]`` pair's name gives its text value, or
    ``None``: only text, as the JSON-text walker masks the same pair in a transcript."""
    if len(data) != 2 or not isinstance(data[0], str) or not isinstance(data[1], str):
        return None
    return _kind_for(data[0], data[1])


# An AWS access key id names its secret key as a credential's name names its value.
_AWS_KEY_ID = re.compile(AWS_KEY_ID)
_AWS_SECRET = re.compile(AWS_SECRET)


def _kind_for(name: str, value: Any) -> str | None:
    """The kind ``name`` (a mapping's key, a pair's first item) gives ``value``: a
    credential's name its own (``x-api-key``), to any value; an AWS access key id
    ``aws_secret_key``, to 40 base64 characters only (``{"AKIA…": "<secret>"}``; a key id
    beside a word is no pair)."""
    if _AWS_KEY_ID.fullmatch(name):
        shaped = isinstance(value, str) and _AWS_SECRET.fullmatch(value) is not None
        return "aws_secret_key" if shaped else None
    return _key_kind(name)


def default_redactor() -> Redactor:
    """A redactor with the built-in patterns only."""
    return Redactor()


class Masked:
    """A value for a log line (``_log.warning("... %r", Masked(exc))``): its ``str`` or
    ``repr`` with every secret masked by the built-in patterns, worked out only when the
    line is written. A store's error can quote its URL, password and all."""

    __slots__ = ("value",)

    def __init__(self, value: object) -> None:
        self.value = value

    def __str__(self) -> str:
        return default_redactor().text(_said(str, self.value))

    def __repr__(self) -> str:
        return default_redactor().text(_said(repr, self.value))


def _said(how: Callable[[object], str], value: object) -> str:
    try:
        return how(value)
    except Exception:
        return f"(a {type(value).__name__} whose text cannot be read)"
