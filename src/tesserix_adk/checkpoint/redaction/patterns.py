"""The built-in patterns that find secrets inside strings, and the placeholders they write.

API keys (OpenAI ``sk-``/``sk-proj-``, Anthropic ``sk-ant-``), ``Bearer`` tokens, ``Basic``
credentials, AWS access key ids and secret keys, GitHub and Slack tokens, JWTs, PEM
private-key blocks and passwords in URLs (the user stays). A token wrapped across lines (a
line break, or a JSON-escaped ``\\n``, right after it and a next line that is all token
characters) is masked with its continuation lines. Each match becomes ``[redacted:<kind>]``.

A token is one when no token character comes right before it, unless that character ends
an escape (``\\nsk-…``, ``\\u201csk-…`` as ``repr`` or JSON text write them before a key):
see ``_NOT_ESCAPE_END``.

Every built-in pattern is linear-time (bounded quantifiers, possessive runs, anchors that
cannot restart inside a run), and none is compiled at import.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache

# Every placeholder the redactor writes; custom patterns never see these.
_PLACEHOLDER = re.compile(r"(\[redacted:[a-z0-9_]+\])")
_PLACEHOLDER_TEXT = "[redacted:"

# The shortest string any built-in rule can match (``s://:p@``, ``token=x``).
_SHORTEST_SECRET = 7


# Not the end of an escape as ``repr`` or JSON writes one: a token character right before a
# token counts (it is part of a longer word) unless it ends ``\\n``, ``\\x0b``, ``\\u201c`` or
# ``\\U0001f511``. Fixed-width look-behinds, so every pattern stays linear.
_NOT_ESCAPE_END = r"(?<!\\)(?<!\\x[0-9A-Fa-f])(?<!\\u[0-9A-Fa-f]{3})(?<!\\U[0-9A-Fa-f]{7})"


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
    the next line ("Thanks") is never taken for the end of a key; it may end a sentence
    (``….``).
    """
    return (
        r"(?:(?:\r?\n|\\r\\n|\\n)[ \t]{0,16}+"
        rf"(?={body_without_digits}*+[0-9]|{body}{{16}}){body}++"
        r"(?=[ \t]*+(?:[\r\n\"',;)\]}]|[.:!?](?![A-Za-z0-9])|\\[rn\"]|\Z)))"
    )


def _prefixed_token(
    prefix: str, body: str, body_without_digits: str, least: int, head: int = 0
) -> str:
    """``prefix`` then at least ``least`` body characters, or a shorter head (of at least
    ``head``) wrapped."""
    cont = _wrapped(body, body_without_digits)
    return rf"{prefix}(?:{body}{{{least},}}+{cont}*|{body}{{{head},{least - 1}}}+{cont}+)"


def _random_body(match: re.Match[str]) -> bool:
    """Whether a glued key's body reads as a key's random part: as many upper-case letters
    as chance gives (a fifth to four fifths of its letters), where a slug of CamelCase
    words (``flask-admin-MultiTenantDashboard2024-…``) has one a word."""
    body = match.group("body")
    if body is None:
        return True  # an alternative without one (a legacy key, one after ``%XX``)
    upper = sum(1 for c in body if "A" <= c <= "Z")
    letters = upper + sum(1 for c in body if "a" <= c <= "z")
    return letters > 0 and 0.2 <= upper / letters <= 0.8


def _mixed(body: str, least: int) -> str:
    """At least ``least`` ``body`` characters with a digit and both cases among them (a
    key's random part; a slug of words has no upper case)."""
    return (
        rf"(?=[A-Za-z_-]{{0,{least * 4}}}[0-9])(?=[A-Z0-9_-]{{0,{least * 4}}}[a-z])"
        rf"(?=[a-z0-9_-]{{0,{least * 4}}}[A-Z]){body}{{{least},}}+"
    )


def _is_basic_credential(match: re.Match[str]) -> bool:
    # ``Basic`` + base64 of ``user:password``; "Basic authentication" is prose.
    token = match.group("token")
    try:
        raw = base64.b64decode(token + "=" * (-len(token) % 4), validate=True)
        decoded = raw.decode("utf-8")
    except (binascii.Error, ValueError):
        return False
    return ":" in decoded and decoded.isprintable()


# An AWS access key id, and the shape of its secret key: the rules below and the redactor's
# pairs (``["AKIA…", "<secret>"]``, ``{"AKIA…": "<secret>"}``) read them alike.
AWS_KEY_ID = r"(?:AKIA|ASIA)[A-Z0-9]{16}"
AWS_SECRET = r"[A-Za-z0-9/+]{40}"


@cache
def _builtin_rules() -> tuple[_Rule, ...]:
    """The built-in patterns, compiled on first use (nothing is compiled at import).

    Order matters only for the label: the most specific kinds run first, so
    ``Bearer eyJ…`` reads ``Bearer [redacted:jwt]``.
    """
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
                _prefixed_token(
                    r"sk-ant-(?<!" + _NOT_ESCAPE_END + r"[A-Za-z0-9_-]sk-ant-)",
                    key_body,
                    key_letters,
                    20,
                )
            ),
            ("sk-ant-",),
        ),
        _Rule(
            "openai_key",
            # ``sk-…`` and ``sk-proj-…``; 20 characters at least, so ``sk-learn`` stays.
            re.compile(
                _prefixed_token(
                    r"sk-(?<!" + _NOT_ESCAPE_END + r"[A-Za-z0-9_-]sk-)", key_body, key_letters, 20
                )
            ),
            ("sk-",),
        ),
        # A key glued to the word before it (``call_sk-proj-…``, a model's id), or after
        # a URL's escape (``Bearer%20sk-…``): only the shapes keys are issued in, long and
        # random (``_random_body``), so a slug such as ``flask-admin-SQLAlchemy2-Examples``
        # or ``desk-proj-tool`` stays.
        _Rule(
            "anthropic_key",
            re.compile(
                r"(?<=[A-Za-z0-9_-])sk-ant-[a-z]{2,6}[0-9]{2}-(?P<body>"
                + _mixed(key_body, 20)
                + ")"
                + _wrapped(key_body, key_letters)
                + "*"
            ),
            ("sk-ant-",),
            accept=_random_body,
        ),
        _Rule(
            "openai_key",
            re.compile(
                r"(?<=[A-Za-z0-9_-])sk-(?:proj|svcacct|admin|None)-(?P<body>"
                + _mixed(key_body, 40)
                + ")"
                + _wrapped(key_body, key_letters)
                + "*"
                # Legacy keys: 20 characters, ``T3BlbkFJ`` (base64 of "OpenAI"), 20 more.
                r"|(?<=[A-Za-z0-9_-])sk-[A-Za-z0-9]{20}T3BlbkFJ[A-Za-z0-9]{20}(?![A-Za-z0-9])"
                r"|(?<=%[0-9A-Fa-f]{2})sk-" + key_body + "{20,}+"
            ),
            ("sk-",),
            accept=_random_body,
        ),
        _Rule(
            "github_token",
            # On its own, or with a word glued after it (``ghp_…_old``); wrapped across lines
            # anywhere (a short first line too). A classic token is 36 characters; a
            # fine-grained one 82 with a digit (``github_pat_`` then a name's words, as in
            # ``github_pat_expiration_warning_days``, is none).
            re.compile(
                r"g(?<!"
                + _NOT_ESCAPE_END
                + r"[A-Za-z0-9_]g)(?:"
                + _prefixed_token(r"h[pousr]_", r"[A-Za-z0-9]", r"[A-Za-z]", 36, head=8)
                + r"(?![A-Za-z0-9])|"
                # The head of a wrapped token whose last line reads as no token's (short,
                # no digit): the head alone, at least 20 of its 36 characters; and a token
                # broken right after its prefix, whole on the next line.
                + r"h[pousr]_[A-Za-z0-9]{20,35}+(?=\r?\n|\\[rn])|"
                + r"h[pousr]_(?:\r?\n|\\r\\n|\\n)[ \t]{0,16}+[A-Za-z0-9]{36,}+(?![A-Za-z0-9])|"
                + r"ithub_pat_(?=[A-Za-z_]{0,82}+[0-9])"
                + _prefixed_token("", r"[A-Za-z0-9_]", r"[A-Za-z_]", 82)
                + r"(?![A-Za-z0-9_]))"
            ),
            ("ghp_", "gho_", "ghs_", "ghu_", "ghr_", "github_pat_"),
        ),
        _Rule(
            "slack_token",
            re.compile(
                r"xox(?<!"
                + _NOT_ESCAPE_END
                + r"[A-Za-z0-9]xox)[abprs]-[A-Za-z0-9-]{10,}+"
                + _wrapped(r"[A-Za-z0-9-]", r"[A-Za-z-]")
                + "*"
            ),
            ("xox",),
        ),
        _Rule(
            "aws_access_key_id",
            re.compile(
                r"(?<!" + _NOT_ESCAPE_END + r"[A-Za-z0-9])" + AWS_KEY_ID + r"(?![A-Za-z0-9])"
            ),
            ("akia", "asia"),
        ),
        _Rule(
            "aws_secret_key",
            # Right after its key id (masked by the rule above), across what writes a pair:
            # quotes, separators, spaces, a line break, a table's bars. Any 40 base64
            # characters, ``/`` or ``+`` or none, as s3fs (``AKIA…:<secret>``), a credentials
            # CSV (``AKIA…,<secret>``, quoted or not), JSON, a tuple's repr, a table and a
            # line of the two (``AKIA… <secret>``) keep a pair.
            re.compile(
                r"(?P<keep>\[redacted:aws_access_key_id\][\"']?"
                r"[ \t\r\n:,;=|]{0,24}+[\"']?)" + AWS_SECRET + r"(?![A-Za-z0-9/+=])"
            ),
            ("akia", "asia"),
            min_length=40,
        ),
        _Rule(
            "jwt",
            re.compile(
                r"eyJ(?<!"
                + _NOT_ESCAPE_END
                + r"[A-Za-z0-9_-]eyJ)[A-Za-z0-9_-]{5,}+\.[A-Za-z0-9_-]{5,}+\.[A-Za-z0-9_-]*+"
                + _wrapped(key_body, key_letters)
                + "*"
            ),
            ("eyj",),
        ),
        _Rule(
            "basic_auth",
            re.compile(
                r"(?P<keep>(?<!" + _NOT_ESCAPE_END + r"[A-Za-z0-9_])(?i:basic)[ \t]{1,16}+)"
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
                r"(?P<keep>(?<!" + _NOT_ESCAPE_END + r"[A-Za-z0-9_])(?i:bearer)[ \t]{1,16}+)"
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
                r"(?P<keep>(?i:(?<!"
                + _NOT_ESCAPE_END
                + r"[A-Za-z0-9])(?:aws_)?secret_(?:access_)?key"
                r"|(?<!" + _NOT_ESCAPE_END + r"[A-Za-z0-9])secretaccesskey)"
                r"[\"']?[ \t]{0,16}+[:=][ \t]{0,16}+[\"']?)" + AWS_SECRET + r"(?![A-Za-z0-9/+=])"
            ),
            ("secret",),
            min_length=40,
        ),
        _Rule(
            "aws_secret_key",
            # Standalone: exactly 40 base64 characters with a ``/`` or ``+``, both cases and
            # a digit, so a hex digest (sha1, a git sha) never matches, nor a run of a URL's
            # path (``example.com/Users/JohnSmith/…``, ``user-guide/Chapter2/…``): a key is
            # never glued to what comes before a path's run (``. : _ ~ % # @ & -``), except
            # the ``:`` after its key id, masked by then (``AKIA…:<secret>``, as s3fs keeps
            # a pair); nor does it start with ``/`` (``/Users/JohnSmith/…``) or run into a
            # file's extension or a host's next label (``…/Av2xy.tsx``), nor opens a data
            # URL's payload (``data:image/png;base64,…``).
            re.compile(
                r"(?<!base64,)(?:(?<!" + _NOT_ESCAPE_END + r"[A-Za-z0-9/+=.:_~%#@&-])"
                r"|(?<=\[redacted:aws_access_key_id\]:))"
                r"(?=[A-Za-z0-9]{0,39}[/+])(?=[A-Z0-9/+]{0,39}[a-z])(?=[a-z0-9/+]{0,39}[A-Z])"
                r"(?=[A-Za-z/+]{0,39}[0-9])(?=[A-Za-z0-9])"
                + AWS_SECRET
                + r"(?![A-Za-z0-9/+=]|\.[A-Za-z0-9])"
            ),
            ("/", "+"),
            min_length=40,
        ),
        _Rule(
            "github_token",
            # Glued to a name before it (``lookup_ghp_…``, a tool or a variable named after
            # it), tried last, on what no other rule took (a bearer token holding one is
            # masked whole by its own rule): then its 36 characters must hold a digit and an
            # upper-case letter, as a token's nearly always do and neither a word
            # (``fetch_ghs_Classification…``) nor a hash (``laughs_da39a3ee…``) does.
            re.compile(
                r"(?<=[A-Za-z0-9_])g(?:h[pousr]_(?=[A-Za-z]{0,35}+[0-9])"
                r"(?=[a-z0-9]{0,35}+[A-Z])[A-Za-z0-9]{36,}+(?![A-Za-z0-9])"
                r"|ithub_pat_(?=[A-Za-z_]{0,82}+[0-9])[A-Za-z0-9_]{82,}+(?![A-Za-z0-9_]))"
            ),
            ("ghp_", "gho_", "ghs_", "ghu_", "ghr_", "github_pat_"),
        ),
    )
