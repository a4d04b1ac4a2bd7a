"""Redaction: the one place secrets are masked before any byte reaches a store.

A ``Redactor`` masks secrets in *user data*: message text, tool arguments, outcomes, state,
approval notes, log lines and error messages. The caller decides which parts of a payload
are user data (so ``usage.input_tokens`` is never looked at); the redactor only walks what it
is given. Two entry points, both linear in the size of their input:

- ``Redactor.text(s)`` for any string: free text, a log line, an exception message, a tool
  result (which may be JSON text);
- ``Redactor.value(v)`` for JSON-like data (dicts, lists, strings, numbers).

What is masked:

- **Patterns** find secrets inside strings: API keys (OpenAI ``sk-``/``sk-proj-``,
  Anthropic ``sk-ant-``), ``Bearer`` tokens, ``Basic`` credentials, AWS access key ids and
  secret keys, GitHub and Slack tokens, JWTs, PEM private-key blocks and passwords in URLs
  (the user stays). A token wrapped across lines (a line break, or a JSON-escaped ``\\n``,
  right after it and a next line that is all token characters) is masked with its
  continuation lines. Each match becomes ``[redacted:<kind>]``; ``extra_patterns`` add
  regexes whose matches become ``[redacted:custom]``.
- **Sensitive keys**: a key named like a credential (``password``, ``secret``, ``token``,
  ``api_key``, ``authorization``, ``cookie``, ``credentials`` …, whole or as the last words of
  the key in any casing: ``accessToken``, ``clientSecret``, ``openai_api_key``, ``X-Api-Key``,
  ``db.password``) masks its value, in a mapping, in JSON text and in free text
  (``password=…``, ``"token": "…"``, ``Authorization: Basic …`` keeps the scheme). Keys that
  only contain such a word stay (``input_tokens``, ``password_hint``, ``secretary``), and so do
  pagination tokens (``next_page_token``, ``nextToken``).
- **Validation messages**: a pydantic ``input_value=…`` is masked whole when its field is
  named like a secret or anything in it is a secret (pydantic cuts long values short, so a
  partial mask would leave the tail).

Under a sensitive key, every non-empty **string** becomes ``[redacted:<kind>]``, however deep
in the value; numbers, booleans and ``None`` stay as they are and containers keep their shape.
So a typed state with ``token: int`` or ``password: str | None`` still validates after
redaction and a run stays resumable; a numeric credential is not masked (keep credentials in
strings). A string that is JSON text stays JSON text: it is masked token by token in place
(duplicate keys included), never re-serialised.

Redaction is idempotent: the placeholders match no pattern, so redacting twice changes
nothing the first pass left. Bytes are never touched. Every built-in pattern is linear-time
(bounded quantifiers, possessive runs, anchors that cannot restart inside a run); patterns
given in ``extra_patterns`` run on Python's backtracking engine as written.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
import string
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cache, lru_cache
from typing import Any

from tesserix_adk.errors import ConfigurationError

__all__ = ["Redactor", "default_redactor"]

_CUSTOM = "[redacted:custom]"

# Every placeholder the redactor writes; custom patterns never see these.
_PLACEHOLDER = re.compile(r"(\[redacted:[a-z0-9_]+\])")
_PLACEHOLDER_TEXT = "[redacted:"

# The shortest string any built-in rule can match (``s://:p@``, ``token=x``).
_SHORTEST_SECRET = 7

# A pass over a string is repeated until nothing changes (a mask can move a boundary that
# a pattern's look-around depends on); this bounds the repeats.
_MAX_PASSES = 4

# JSON text nested in a string nested in JSON text …: deeper levels are masked as free text.
_MAX_JSON_DEPTH = 8

# A key longer than this is never taken for a credential name (and is never worth caching).
_MAX_KEY = 128

# --- sensitive key names ----------------------------------------------------------------

# Whole names, after camelCase, ``-``, ``.`` and spaces became ``_`` and case was folded.
_WHOLE_KEYS: dict[str, str] = {
    "accesstoken": "token",
    "apitoken": "token",
    "authtoken": "token",
    "idtoken": "token",
    "refreshtoken": "token",
    "sessiontoken": "token",
    "clientsecret": "secret",
    "privatekey": "secret",
    "secretkey": "secret",
    "secretaccesskey": "secret",
    "xapikey": "api_key",
    "setcookie": "cookie",
}
# Last words of a name (the whole name, or after an ``_``) and the kind they mask as.
_KEY_SUFFIXES: dict[str, str] = {
    "password": "password",
    "passwd": "password",
    "passphrase": "password",
    "secret": "secret",
    "secret_key": "secret",
    "secret_access_key": "secret",
    "private_key": "secret",
    "credential": "secret",
    "credentials": "secret",
    "token": "token",
    "api_key": "api_key",
    "apikey": "api_key",
    "authorization": "authorization",
    "cookie": "cookie",
}
# Tokens that page or cancel, not credentials: masking them would break a resumed run.
_NOT_SECRET = frozenset(
    {
        "next_token",
        "page_token",
        "next_page_token",
        "continuation_token",
        "pagination_token",
        "sync_token",
        "cancel_token",
        "cancellation_token",
    }
)
_CAMEL = re.compile(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])")
_KEY_SEPARATORS = re.compile(r"[-.\s_]+")


@lru_cache(maxsize=4096)
def _named_kind(key: str) -> str | None:
    name = _KEY_SEPARATORS.sub("_", _CAMEL.sub("_", key)).strip("_").lower()
    if name in _NOT_SECRET:
        return None
    if name in _WHOLE_KEYS:
        return _WHOLE_KEYS[name]
    if name in _KEY_SUFFIXES:
        return _KEY_SUFFIXES[name]
    # The longest suffix first is irrelevant: every suffix of one kind family maps alike.
    for suffix, kind in _KEY_SUFFIXES.items():
        if name.endswith("_" + suffix):
            return kind
    return None


def _key_kind(key: str) -> str | None:
    """The kind a key masks as (``accessToken`` → ``token``), or ``None`` for an ordinary key."""
    if len(key) > _MAX_KEY or len(key) < 3:
        return None
    return _named_kind(key)


# --- patterns ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Rule:
    """One built-in pattern: what it masks, and the cheap checks that let it be skipped."""

    kind: str
    pattern: re.Pattern[str]
    # Lower-case substrings one of which must occur for the pattern to be tried at all.
    hints: tuple[str, ...] = ()
    min_length: int = _SHORTEST_SECRET
    # A match this refuses is left as it is (e.g. ``Basic`` + a word that is not base64).
    accept: Callable[[re.Match[str]], bool] | None = None
    replacement: str = field(init=False, repr=False)

    def __post_init__(self) -> None:
        # A ``keep`` group is context that stays (``Bearer ``, ``://user:``); the rest goes.
        keep = "\\g<keep>" if "keep" in self.pattern.groupindex else ""
        object.__setattr__(self, "replacement", f"{keep}[redacted:{self.kind}]")

    def apply(self, value: str, lowered: str) -> str:
        if len(value) < self.min_length:
            return value
        if self.hints and not any(h in lowered for h in self.hints):
            return value
        if self.accept is None:
            return self.pattern.sub(self.replacement, value)
        accept = self.accept
        return self.pattern.sub(
            lambda m: m.expand(self.replacement) if accept(m) else m.group(0), value
        )


def _wrapped(body: str, body_without_digits: str) -> str:
    """Continuation lines of a token wrapped across lines, for a token made of ``body``.

    A continuation starts right after the token with a line break (or a JSON-escaped one) and
    is a whole line of token characters with a digit in it or at least 16 long, so a word on
    the next line ("Thanks") is never taken for the end of a key.
    """
    return (
        r"(?:(?:\r?\n|\\r\\n|\\n)[ \t]{0,16}+"
        rf"(?={body_without_digits}*+[0-9]|{body}{{16}}){body}++"
        r"(?=[ \t]*+(?:[\r\n\"',;)\]}]|\\[rn\"]|\Z)))"
    )


def _prefixed_token(prefix: str, body: str, body_without_digits: str, least: int) -> str:
    """``prefix`` then at least ``least`` body characters, or a shorter head wrapped."""
    cont = _wrapped(body, body_without_digits)
    return rf"{prefix}(?:{body}{{{least},}}+{cont}*|{body}{{0,{least - 1}}}+{cont}+)"


def _is_basic_credential(match: re.Match[str]) -> bool:
    # ``Basic`` + base64 of ``user:password``; "Basic authentication" is prose.
    token = match.group("token")
    try:
        raw = base64.b64decode(token + "=" * (-len(token) % 4), validate=True)
        decoded = raw.decode("utf-8")
    except (binascii.Error, ValueError):
        return False
    return ":" in decoded and decoded.isprintable()


@cache
def _builtin_rules() -> tuple[_Rule, ...]:
    """The built-in patterns, compiled on first use (nothing is compiled at import).

    Order matters only for the label: the most specific kinds run first, so
    ``Bearer eyJ…`` reads ``Bearer [redacted:jwt]``.
    """
    b64 = r"[A-Za-z0-9/+]"
    key_body, key_letters = r"[A-Za-z0-9_-]", r"[A-Za-z_-]"
    return (
        _Rule(
            "private_key",
            # Through the matching END line; a block cut short is masked to the end. The
            # label is bounded so comparing it at every END line stays cheap.
            re.compile(
                r"-----BEGIN (?P<label>[A-Z0-9 ]{0,40}?)PRIVATE KEY-----"
                r"(?:.*?-----END (?P=label)PRIVATE KEY-----|.*\Z)",
                re.DOTALL,
            ),
            ("-----begin",),
        ),
        _Rule(
            "anthropic_key",
            re.compile(
                _prefixed_token("sk-ant-(?<![A-Za-z0-9_-]sk-ant-)", key_body, key_letters, 20)
            ),
            ("sk-ant-",),
        ),
        _Rule(
            "openai_key",
            # ``sk-…`` and ``sk-proj-…``; 20 characters at least, so ``sk-learn`` stays.
            re.compile(_prefixed_token("sk-(?<![A-Za-z0-9_-]sk-)", key_body, key_letters, 20)),
            ("sk-",),
        ),
        _Rule(
            "github_token",
            re.compile(
                r"g(?<![A-Za-z0-9_]g)(?:h[pousr]_[A-Za-z0-9]{36,}+|ithub_pat_[A-Za-z0-9_]{22,}+)"
                r"(?![A-Za-z0-9_])" + _wrapped(r"[A-Za-z0-9_]", r"[A-Za-z_]") + "*"
            ),
            ("ghp_", "gho_", "ghs_", "ghu_", "ghr_", "github_pat_"),
        ),
        _Rule(
            "slack_token",
            re.compile(
                r"xox(?<![A-Za-z0-9]xox)[abprs]-[A-Za-z0-9-]{10,}+"
                + _wrapped(r"[A-Za-z0-9-]", r"[A-Za-z-]")
                + "*"
            ),
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
                r"eyJ(?<![A-Za-z0-9_-]eyJ)[A-Za-z0-9_-]{5,}+\.[A-Za-z0-9_-]{5,}+\.[A-Za-z0-9_-]*+"
                + _wrapped(key_body, key_letters)
                + "*"
            ),
            ("eyj",),
        ),
        _Rule(
            "basic_auth",
            re.compile(
                r"(?P<keep>(?<![A-Za-z0-9_])(?i:basic)[ \t]{1,16}+)"
                r"(?P<token>[A-Za-z0-9+/]{4,}+={0,2}+)(?![A-Za-z0-9+/=])"
            ),
            ("basic",),
            accept=_is_basic_credential,
        ),
        _Rule(
            "bearer",
            # RFC 6750 b64token. A word of prose after "bearer" is not a token: one with no
            # digit has to be 20 characters long to count.
            re.compile(
                r"(?P<keep>(?<![A-Za-z0-9_])(?i:bearer)[ \t]{1,16}+)"
                r"(?:(?=[A-Za-z\-._~+/]*+[0-9])[A-Za-z0-9\-._~+/]{8,}+|[A-Za-z0-9\-._~+/]{20,}+)"
                r"=*+" + _wrapped(r"[A-Za-z0-9\-._~+/=]", r"[A-Za-z\-._~+/=]") + "*"
            ),
            ("bearer",),
        ),
        _Rule(
            "url_password",
            # scheme://user:PASSWORD@host; the user may be empty (redis://:pw@host). The
            # password runs to the last ``@`` before the path, so ``p@ss`` goes whole.
            # Anchored on ``://`` (after a scheme character) rather than on the scheme, so a
            # long scheme-like run never restarts the match at each of its characters.
            # (Here and above, a look-behind placed after a literal prefix lets the engine
            # search for the literal instead of trying every position.)
            re.compile(
                r"(?P<keep>://(?<=[A-Za-z0-9+.-]://)[^\s/?#@:\[\]]*+:)"
                r"(?!\[redacted:url_password\]@)[^\s/?#]+(?=@)"
            ),
            ("://",),
        ),
        _Rule(
            "aws_secret_key",
            # Next to a hint: any 40 base64 characters.
            re.compile(
                r"(?P<keep>(?i:(?<![A-Za-z0-9])(?:aws_)?secret_(?:access_)?key"
                r"|(?<![A-Za-z0-9])secretaccesskey)"
                r"[\"']?[ \t]{0,16}+[:=][ \t]{0,16}+[\"']?)" + b64 + r"{40}(?![A-Za-z0-9/+=])"
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
                r"(?=[A-Za-z0-9]{0,39}[/+])(?=[A-Z0-9/+]{0,39}[a-z])(?=[a-z0-9/+]{0,39}[A-Z])"
                + b64
                + r"{40}(?![A-Za-z0-9/+=])"
            ),
            ("/", "+"),
            min_length=40,
        ),
    )


# --- key = value in free text -----------------------------------------------------------

# The last word of a credential-like key right before ``:`` or ``=``; the whole key is then
# read backwards from it and checked with ``_key_kind``. Anchoring on the word (not on the key's
# first character) keeps the scan linear whatever runs of identifier characters come before.
# It runs on the ASCII-lowered text (same length, same positions): a case-insensitive
# alternation is several times slower to search.
_KEY_WORD = re.compile(
    r"(?P<word>pass(?:word|wd|phrase)|secret|token|api[_-]?key"
    r"|(?:secret|private|access)[_-]?key|authorization|cookie|credentials?)"
    r"(?P<close>\\?[\"'])?[ \t]{0,16}+(?P<sep>[:=])(?![:=])[ \t]{0,16}+"
)
_ASCII_LOWER = str.maketrans(string.ascii_uppercase, string.ascii_lowercase)
_KEY_HINTS = ("pass", "secret", "token", "key", "auth", "cookie", "credential")
_KEY_CHAR_SET = frozenset(string.ascii_letters + string.digits + "_.-")
_KEY_CHARS = re.compile(rf"[A-Za-z0-9_.\-]{{0,{_MAX_KEY}}}")
_DOUBLE_QUOTED = re.compile(r'[^"\\\n]*+(?:\\.[^"\\\n]*+)*+')
_SINGLE_QUOTED = re.compile(r"[^'\\\n]*+(?:\\.[^'\\\n]*+)*+")
_ESCAPED_QUOTED = re.compile(r'[^"\\\n]*+(?:\\[^"\n][^"\\\n]*+)*+')
_UNQUOTED = re.compile(r"[^\s,;&\"'()\[\]{}<>]*+")
_TO_LINE_END = re.compile(r"[^\r\n]*+")
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9_-]{0,20}+ ++(?=\S)")
_JSON_LITERAL = re.compile(r"(?:-?[0-9][0-9.eE+-]*+|true|false|null)(?![A-Za-z0-9_])")


def _mask_key_values(text: str) -> str:
    """``key: value`` and ``key=value`` pairs whose key is named like a credential."""
    out: list[str] = []
    done = 0
    for m in _KEY_WORD.finditer(text.translate(_ASCII_LOWER)):
        if m.start() < done:
            continue
        # The key's other words, read backwards from the one the pattern found.
        floor = max(done, m.start() - _MAX_KEY)
        head = text[floor : m.start()][::-1]
        key_start = m.start() - _KEY_CHARS.match(head).end()  # type: ignore[union-attr]
        if key_start == floor > done and text[floor - 1] in _KEY_CHAR_SET:
            continue  # longer than any credential name
        kind = _key_kind(text[key_start : m.end("word")])
        if kind is None:
            continue
        span = _value_span(
            text,
            m.end(),
            kind,
            json_like=m.group("close") == '"',
            header=m.group("sep") == ":",
        )
        if span is None:
            continue
        start, end = span
        out.append(text[done:start])
        out.append(f"[redacted:{kind}]")
        done = end
    if not out:
        return text
    out.append(text[done:])
    return "".join(out)


def _value_span(
    text: str, pos: int, kind: str, *, json_like: bool, header: bool
) -> tuple[int, int] | None:
    """Where the value after a credential key starts and ends; ``None`` if there is none."""
    if text.startswith(_PLACEHOLDER_TEXT, pos):
        return None
    if text.startswith('\\"', pos):
        end = _ESCAPED_QUOTED.match(text, pos + 2).end()  # type: ignore[union-attr]
        return (pos + 2, end) if end > pos + 2 else None
    quote = text[pos : pos + 1]
    if quote in ('"', "'"):
        body = _DOUBLE_QUOTED if quote == '"' else _SINGLE_QUOTED
        end = body.match(text, pos + 1).end()  # type: ignore[union-attr]
        if end == pos + 1 or text.startswith(_PLACEHOLDER_TEXT, pos + 1):
            return None
        return pos + 1, end
    if json_like and _JSON_LITERAL.match(text, pos):
        # A number, boolean or null under a quoted key stays, as it does in data.
        return None
    if header and kind in ("authorization", "cookie"):
        # A header value: the scheme (``Basic``, ``Digest``) stays, the rest of the line goes.
        scheme = _SCHEME.match(text, pos) if kind == "authorization" else None
        start = scheme.end() if scheme is not None else pos
        if text.startswith(_PLACEHOLDER_TEXT, start):
            return None
        end = _TO_LINE_END.match(text, start).end()  # type: ignore[union-attr]
        while end > start and text[end - 1] in " \t":
            end -= 1
        return (start, end) if end > start else None
    end = _UNQUOTED.match(text, pos).end()  # type: ignore[union-attr]
    return (pos, end) if end > pos else None


# --- pydantic validation messages -------------------------------------------------------

# ``input_value=<repr>, input_type=…``: the repr runs to ``, input_type=``, never past the
# line or the next ``input_value=`` (so each occurrence is scanned once).
_INPUT_VALUE = r"(?:[^\n,i]|i(?!nput_value=)|,(?! input_type=))*+(?=, input_type=)"
_VALIDATION_FIELD = re.compile(
    r"(?m)^(?P<loc>[^\s][^\n]{0,255}+)(?P<mid>\n  [^\n\[]{0,500}+\[type=[A-Za-z0-9_.]{1,64}+"
    r", input_value=)(?P<value>" + _INPUT_VALUE + ")"
)
_VALIDATION_INPUT = re.compile(r"(?P<mid>input_value=)(?P<value>" + _INPUT_VALUE + ")")
_SECRET_STARTS = (
    "sk-",
    "ghp_",
    "gho_",
    "ghs_",
    "ghu_",
    "ghr_",
    "github_pat_",
    "xox",
    "eyJ",
    "AKIA",
    "ASIA",
    "-----BEGIN",
    "Bearer ",
    "Basic ",
)


def _placeholder_kind(value: str) -> str | None:
    found = _PLACEHOLDER.search(value)
    return None if found is None else found.group(1)[len(_PLACEHOLDER_TEXT) : -1]


def _mask_validation_inputs(text: str) -> str:
    """Mask pydantic's quoted inputs whole: by field name, or when they hold a secret."""

    def by_field(m: re.Match[str]) -> str:
        field_name = m.group("loc").rstrip().rsplit(".", 1)[-1]
        kind = _key_kind(field_name)
        if kind is None:
            return m.group(0)
        return f"{m.group('loc')}{m.group('mid')}'[redacted:{kind}]'"

    def by_content(m: re.Match[str]) -> str:
        value = m.group("value")
        kind = _placeholder_kind(value)
        if kind is None and value.lstrip("'\"").startswith(_SECRET_STARTS):
            kind = "secret"
        if kind is None:
            return m.group(0)
        return f"{m.group('mid')}'[redacted:{kind}]'"

    return _VALIDATION_INPUT.sub(by_content, _VALIDATION_FIELD.sub(by_field, text))


# Every hint of every rule above, for one quick look at a string no rule can touch.
_ANY_HINT = re.compile(
    r"-----begin|sk-|gh[pousr]_|github_pat_|xox|akia|asia|eyj|basic|bearer|://|secret|[/+]"
    r"|pass|token|key|auth|cookie|credential|input_value="
)

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

    def changed(self, data: Any) -> bool:
        """Whether redaction masks anything in ``data`` (a tuple becoming a list is no change)."""
        if not self.enabled:
            return False
        return self._walk(data, None)[1]

    def _text(self, value: str, depth: int) -> str:
        if len(value) < _SHORTEST_SECRET:
            return value
        if depth < _MAX_JSON_DEPTH and _JSON_START.match(value):
            masked = self._json_text(value, depth)
            if masked is not None:
                return masked
        for _ in range(_MAX_PASSES):
            masked = self._builtin(value)
            if self._extra:
                masked = self._custom(masked)
            if masked == value:
                break
            value = masked
        return value

    def _builtin(self, value: str) -> str:
        if len(value) < _SHORTEST_SECRET:
            return value
        lowered = value.lower()
        if _ANY_HINT.search(lowered) is None:
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

    def _json_text(self, text: str, depth: int) -> str | None:
        """JSON text masked in place, string by string; ``None`` if ``text`` is not JSON.

        Walking the tokens (not ``json.loads`` and back) keeps the text as it was, and masks
        every duplicate of a key, not only the one a parser would keep.
        """
        try:
            json.loads(text)
        except (ValueError, RecursionError):
            return None
        out: list[str] = []
        done = 0
        # Per open container: whether it is an object, and the kind its strings inherit.
        stack: list[tuple[bool, str | None]] = []
        value_kind: str | None = None  # the kind of the key whose value comes next
        for m in _JSON_TOKEN.finditer(text):
            token = m.group(0)
            in_object, inherited = stack[-1] if stack else (False, None)
            if token in ("{", "["):
                stack.append((token == "{", value_kind if in_object else inherited))
                continue
            if token in ("}", "]"):
                stack.pop()
                continue
            decoded = json.loads(token) if "\\" in token else token[1:-1]
            if in_object and _JSON_COLON.match(text, m.end()):
                value_kind = _key_kind(decoded) or inherited
                masked = self._text(decoded, depth + 1)
            else:
                kind = value_kind if in_object else inherited
                masked = self._mask_under(kind, decoded, depth + 1)
            if masked != decoded:
                out.append(text[done : m.start()])
                out.append(json.dumps(masked, ensure_ascii=False))
                done = m.end()
        if not out:
            return text
        out.append(text[done:])
        return "".join(out)

    def _mask_under(self, kind: str | None, value: str, depth: int) -> str:
        if kind is None:
            return self._text(value, depth)
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
                    item_kind = _key_kind(key) or kind
                out[new_key], item_changed = self._walk(item, item_kind)
                changed = changed or item_changed
            return out, changed
        if isinstance(data, list | tuple):
            items = [self._walk(item, kind) for item in data]
            return [item for item, _ in items], any(c for _, c in items)
        return data, False


def default_redactor() -> Redactor:
    """A redactor with the built-in patterns only."""
    return Redactor()
