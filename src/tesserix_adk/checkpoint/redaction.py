"""Redaction: the one place secrets are masked before any byte reaches a store.

A ``Redactor`` masks secrets in *user data*: message text, tool arguments, outcomes, state,
approval notes. The caller decides which parts of a payload are user data (so
``usage.input_tokens`` is never looked at); the redactor only walks what it is given.

Two rules apply:

- **Patterns** find secrets inside strings: API keys (OpenAI, Anthropic), ``Bearer`` tokens,
  AWS access key ids and secret keys, GitHub and Slack tokens, JWTs, PEM private-key blocks
  and passwords in URLs. Each match becomes ``[redacted:<kind>]`` so an operator sees that
  something was there and what it was; ``extra_patterns`` add regexes whose matches become
  ``[redacted:custom]``.
- **Sensitive keys**: the value under a mapping key named like a credential (``password``,
  ``secret``, ``token``, ``api_key``, ``authorization``, ``cookie`` …), matched on the whole
  key, case-insensitively, with an optional ``x-``/``x_``/``db_``/``client_`` prefix, is
  masked whatever it looks like: ``{"X-Api-Key": 42}`` becomes
  ``{"X-Api-Key": "[redacted:api_key]"}``.

Redaction is idempotent: the placeholders match no pattern, so redacting twice changes
nothing the first pass left. Bytes are never touched.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cache
from typing import Any

from tesserix_adk.errors import ConfigurationError

__all__ = ["Redactor", "default_redactor"]

_CUSTOM = "[redacted:custom]"

# Every placeholder the redactor writes; custom patterns never see these.
_PLACEHOLDER = re.compile(r"(\[redacted:[a-z0-9_]+\])")

# The shortest string any built-in pattern can match (``s://:p@``); shorter ones are skipped.
_SHORTEST_SECRET = 7

# A pass over a string is repeated until nothing changes (a mask can move a boundary that
# a pattern's look-around depends on); this bounds the repeats.
_MAX_PASSES = 4

# Key names (after the prefix is stripped and ``-`` becomes ``_``) and the kind they mask as.
_SENSITIVE_KEYS: dict[str, str] = {
    "password": "password",
    "passwd": "password",
    "secret": "secret",
    "secret_key": "secret",
    "secret_access_key": "secret",
    "aws_secret_access_key": "secret",
    "private_key": "secret",
    "token": "token",
    "access_token": "token",
    "refresh_token": "token",
    "auth_token": "token",
    "session_token": "token",
    "api_key": "api_key",
    "apikey": "api_key",
    "authorization": "authorization",
    "cookie": "cookie",
    "set_cookie": "cookie",
}
_KEY_PREFIXES = ("x_", "db_", "client_")


@dataclass(frozen=True, slots=True)
class _Rule:
    """One built-in pattern: what it masks, and the cheap checks that let it be skipped."""

    kind: str
    pattern: re.Pattern[str]
    # Lower-case substrings one of which must occur for the pattern to be tried at all.
    hints: tuple[str, ...] = ()
    min_length: int = _SHORTEST_SECRET
    replacement: str = field(init=False, repr=False)

    def __post_init__(self) -> None:
        # A ``keep`` group is context that stays (``Bearer ``, ``user:``); the rest goes.
        keep = "\\g<keep>" if "keep" in self.pattern.groupindex else ""
        object.__setattr__(self, "replacement", f"{keep}[redacted:{self.kind}]")

    def apply(self, value: str, lowered: str) -> str:
        if len(value) < self.min_length:
            return value
        if self.hints and not any(h in lowered for h in self.hints):
            return value
        return self.pattern.sub(self.replacement, value)


@cache
def _builtin_rules() -> tuple[_Rule, ...]:
    """The built-in patterns, compiled on first use (nothing is compiled at import).

    Order matters only for the label: the most specific kinds run first, so
    ``Bearer eyJ…`` reads ``Bearer [redacted:jwt]``.
    """
    b64 = r"[A-Za-z0-9/+]"
    return (
        _Rule(
            "private_key",
            # Through the matching END line; a block cut short is masked to the end.
            re.compile(
                r"-----BEGIN (?P<label>[A-Z0-9 ]*?)PRIVATE KEY-----"
                r"(?:.*?-----END (?P=label)PRIVATE KEY-----|.*\Z)",
                re.DOTALL,
            ),
            ("-----begin",),
        ),
        _Rule(
            "anthropic_key",
            re.compile(r"(?<![A-Za-z0-9_-])sk-ant-[A-Za-z0-9_-]{20,}"),
            ("sk-ant-",),
        ),
        _Rule(
            "openai_key",
            # ``sk-…`` and ``sk-proj-…``; 20 characters at least, so ``sk-learn`` stays.
            re.compile(r"(?<![A-Za-z0-9_-])sk-[A-Za-z0-9_-]{20,}"),
            ("sk-",),
        ),
        _Rule(
            "github_token",
            re.compile(
                r"(?<![A-Za-z0-9_])(?:gh[pousr]_[A-Za-z0-9]{36,}|github_pat_[A-Za-z0-9_]{22,})"
                r"(?![A-Za-z0-9_])"
            ),
            ("ghp_", "gho_", "ghs_", "ghu_", "ghr_", "github_pat_"),
        ),
        _Rule(
            "slack_token",
            re.compile(r"(?<![A-Za-z0-9])xox[abprs]-[A-Za-z0-9-]{10,}"),
            ("xox",),
        ),
        _Rule(
            "aws_access_key_id",
            re.compile(r"(?<![A-Za-z0-9])(?:AKIA|ASIA)[A-Z0-9]{16}(?![A-Za-z0-9])"),
            ("akia", "asia"),
        ),
        _Rule(
            "jwt",
            re.compile(
                r"(?<![A-Za-z0-9_-])eyJ[A-Za-z0-9_-]{5,}\.[A-Za-z0-9_-]{5,}\.[A-Za-z0-9_-]*"
            ),
            ("eyj",),
        ),
        _Rule(
            "bearer",
            # RFC 6750 b64token. A word of prose after "bearer" is not a token: one with no
            # digit has to be 20 characters long to count.
            re.compile(
                r"(?P<keep>\b(?i:bearer)\s+)"
                r"(?:(?=[A-Za-z\-._~+/]*[0-9])[A-Za-z0-9\-._~+/]{8,}|[A-Za-z0-9\-._~+/]{20,})=*"
            ),
            ("bearer",),
        ),
        _Rule(
            "url_password",
            # scheme://user:PASSWORD@host; the user may be empty (redis://:pw@host). The
            # password runs to the last ``@`` before the path, so ``p@ss`` goes whole.
            re.compile(
                r"(?P<keep>\b[A-Za-z][A-Za-z0-9+.-]*://[^\s/?#@:\[\]]*:)"
                r"(?!\[redacted:url_password\]@)[^\s/?#]+(?=@)"
            ),
            ("://",),
        ),
        _Rule(
            "aws_secret_key",
            # Next to a hint: any 40 base64 characters.
            re.compile(
                r"(?P<keep>(?i:\b(?:aws_)?secret_(?:access_)?key|\bsecretaccesskey)"
                r"[\"']?\s*[:=]\s*[\"']?)" + b64 + r"{40}(?![A-Za-z0-9/+=])"
            ),
            ("secret",),
            min_length=40,
        ),
        _Rule(
            "aws_secret_key",
            # Standalone: exactly 40 base64 characters with a ``/`` or ``+`` and both cases,
            # so a hex digest (sha1, a git sha) never matches.
            re.compile(
                r"(?<![A-Za-z0-9/+=])"
                r"(?=[A-Za-z0-9]*[/+])(?=[A-Z0-9/+]*[a-z])(?=[a-z0-9/+]*[A-Z])"
                + b64
                + r"{40}(?![A-Za-z0-9/+=])"
            ),
            min_length=40,
        ),
    )


def _mask_custom(match: re.Match[str]) -> str:
    return _CUSTOM if match.group(0) else ""


def _key_kind(key: str) -> str | None:
    """The kind a mapping key masks as, or ``None`` for an ordinary key."""
    name = key.lower().replace("-", "_")
    for prefix in _KEY_PREFIXES:
        if name.startswith(prefix) and name != prefix:
            stripped = name[len(prefix) :]
            if stripped in _SENSITIVE_KEYS:
                return _SENSITIVE_KEYS[stripped]
    return _SENSITIVE_KEYS.get(name)


@dataclass(frozen=True, slots=True)
class Redactor:
    """Masks secrets in user data before it is stored.

    ``extra_patterns`` are regular expressions (strings) whose matches become
    ``[redacted:custom]``; they run after the built-in patterns, on the text between
    placeholders. ``enabled=False`` turns every method into the identity.
    """

    extra_patterns: tuple[str, ...] = ()
    enabled: bool = True
    _rules: tuple[_Rule, ...] = field(init=False, repr=False, compare=False)
    _extra: tuple[re.Pattern[str], ...] = field(init=False, repr=False, compare=False)

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

    def text(self, value: str) -> str:
        """``value`` with every secret in it masked."""
        if not self.enabled:
            return value
        for _ in range(_MAX_PASSES):
            masked = self._custom(self._builtin(value)) if self._extra else self._builtin(value)
            if masked == value:
                break
            value = masked
        return value

    def value(self, data: Any) -> Any:
        """A redacted copy of JSON-like ``data``; the input is never mutated.

        Mappings become new dicts and lists and tuples become new lists (the output is bound
        for JSON); strings are masked with ``text``, and so are string keys. The value under a
        sensitive key becomes ``[redacted:<kind>]`` whatever it is, except ``None`` and
        booleans, which carry no secret. ``bytes``, numbers and any other object are returned
        as they are: give this the JSON form of the data, not objects that hide strings.
        """
        if not self.enabled:
            return data
        return self._walk(data)[0]

    def changed(self, data: Any) -> bool:
        """Whether redaction masks anything in ``data`` (a tuple becoming a list is no change)."""
        if not self.enabled:
            return False
        return self._walk(data)[1]

    def _builtin(self, value: str) -> str:
        if len(value) < _SHORTEST_SECRET:
            return value
        lowered = value.lower()
        for rule in self._rules:
            value = rule.apply(value, lowered)
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

    def _walk(self, data: Any) -> tuple[Any, bool]:
        if isinstance(data, str):
            masked = self.text(data)
            return masked, masked != data
        if isinstance(data, Mapping):
            out: dict[Any, Any] = {}
            changed = False
            for key, item in data.items():
                new_key = key
                if isinstance(key, str):
                    new_key = self.text(key)
                    changed = changed or new_key != key
                    kind = _key_kind(key)
                    if kind is not None and item is not None and not isinstance(item, bool):
                        placeholder = f"[redacted:{kind}]"
                        out[new_key] = placeholder
                        changed = changed or item != placeholder
                        continue
                out[new_key], item_changed = self._walk(item)
                changed = changed or item_changed
            return out, changed
        if isinstance(data, list | tuple):
            items = [self._walk(item) for item in data]
            return [item for item, _ in items], any(c for _, c in items)
        return data, False


def default_redactor() -> Redactor:
    """A redactor with the built-in patterns only."""
    return Redactor()
