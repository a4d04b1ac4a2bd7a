"""Secrets that only their context gives away in free text: ``key: value`` pairs and pydantic
validation messages.

A credential-named key masks its value in free text too (``password=…``, ``"token": "…"``,
``('x-api-key', '…')``,
``Authorization: Basic …`` keeps the scheme). A pydantic ``input_value=…`` is masked whole
when its field is named like a secret or anything in it is a secret (pydantic cuts long
values short, so a partial mask would leave the tail). Both scans are linear: they anchor on
a word and read the key backwards from it.
"""

from __future__ import annotations

import re
import string

from tesserix_adk.checkpoint.redaction.keys import MAX_KEY_NAME, _key_kind
from tesserix_adk.checkpoint.redaction.patterns import _PLACEHOLDER, _PLACEHOLDER_TEXT

# The last word of a credential-like key right before ``:`` or ``=``; the whole key is then
# read backwards from it and checked with ``_key_kind``. Anchoring on the word (not on the key's
# first character) keeps the scan linear whatever runs of identifier characters come before.
# It runs on the ASCII-lowered text (same length, same positions): a case-insensitive
# alternation is several times slower to search.
_KEY_WORD = re.compile(
    r"(?P<word>(?:pass(?:word|wd|phrase)|pwd|secret|token|api[_-]?key"
    r"|(?:secret|private|access)[_-]?key|authorization|cookie|credential)s?)"
    # A separator may end the name (``DB_PASSWORD_=``), as it may a key in data. A quoted
    # key may also be followed by a comma and a quoted value: a ``('x-api-key', '…')`` pair,
    # as the text of headers, a multidict or ``dict.items()`` writes one.
    r"[_.-]{0,8}+(?P<close>\\?[\"'])?[ \t]{0,16}+"
    r"(?:(?P<sep>[:=])(?![:=])|(?(close)(?P<comma>,)[ \t\r\n]{0,16}+"
    r"(?=(?:bytearray\(|bytes\()?[bBrRuU]{0,2}\\?[\"'])|(?!)))"
    r"[ \t]{0,16}+"
)
# A whole number ending the value (a space, a delimiter or the end after it): a count,
# after a plural ``tokens``. ``123456789:AAH…`` (a bot token) is no count.
_COUNT = re.compile(r"[0-9][0-9,_]*+(?=[\s;)\]}\"']|[,.](?:\s|\Z)|\Z)")
_ASCII_LOWER = str.maketrans(string.ascii_uppercase, string.ascii_lowercase)
_KEY_HINTS = ("pass", "pwd", "secret", "token", "key", "auth", "cookie", "credential")
_HEADERS = frozenset({"authorization", "proxy-authorization", "cookie", "set-cookie"})
_KEY_CHAR_SET = frozenset(string.ascii_letters + string.digits + "_.-")
_KEY_CHARS = re.compile(rf"[A-Za-z0-9_.\-]{{0,{MAX_KEY_NAME}}}")
_DOUBLE_QUOTED = re.compile(r'[^"\\\n]*+(?:\\.[^"\\\n]*+)*+')
_SINGLE_QUOTED = re.compile(r"[^'\\\n]*+(?:\\.[^'\\\n]*+)*+")
_ESCAPED_QUOTED = re.compile(r'[^"\\\n]*+(?:\\[^"\n][^"\\\n]*+)*+')
_UNQUOTED = re.compile(r"[^\s,;&\"'()\[\]{}<>]*+")
# A Python string literal's prefix (``b'…'``, ``rb"…"``, ``u'…'``, ``bytearray(b'…'``): the
# quote after it opens the value, as a repr of bytes under a credential key writes it.
_STRING_PREFIX = re.compile(r"(?:bytearray\(|bytes\()?[bBrRuUfF][bBrRfF]?(?=[\"'])")
_TO_LINE_END = re.compile(r"[^\r\n]*+")
# The opening quote of a literal right after another (only space between).
_NEXT_LITERAL = re.compile(r"[ \t\r\n]{1,16}+([\"'])")
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9_-]{0,20}+ ++(?=\S)")
_JSON_LITERAL = re.compile(r"(?:-?[0-9][0-9.eE+-]*+|true|false|null)(?![A-Za-z0-9_])")

# A list or object as data writes one (JSON, a Python repr): a list of strings, numbers,
# literals, lists or objects, an object of quoted keys. A template (``{{ .Values.x }}``), a
# schema (``{ type: String }``), a link in prose (``[Don't share it](…)``) or an empty one
# (``password: []``, a config's blank) is none.
# Space, also as an escape writes it (pretty JSON inside a repr or a JSON string).
_SPACE = r"(?:[ \t\r\n]|\\[ntr])*+"
_STRUCTURE_START = re.compile(
    rf"""\[{_SPACE}(?:["'\[{{0-9-]|\\"|(?:null|true|false|None|True|False)(?![A-Za-z0-9_]))"""
    rf"""|\{{{_SPACE}(?:["']|\\")"""
)
# A structure whose quotes are escaped, as inside a JSON string: it opens on ``\"``, maybe
# after more openings (``[{\"user\": …}]``).
_ESCAPED_START = re.compile(rf'[\[{{]{_SPACE}(?:[\[{{]{_SPACE})*+\\"')
# What a list or object under a credential key is read through.
_STRUCTURE = re.compile(r"[\[\]{}\"'\\]")
_CLOSES = {"[": "]", "{": "}"}


def _structure_end(text: str, pos: int) -> int:
    """Where the list or object opening at ``pos`` closes (quoted strings skipped), or the
    end of the text when it never closes: all of it is masked, so each character is read
    once however many keys the text holds.

    Inside a JSON string (``[\\"a\\"]``), its quotes are escaped: each escape is read as
    the character it stands for, so a bracket inside a quoted string closes nothing."""
    # Escaped or not is known at the first quote: ``[null, \"a\"]`` opens on a literal.
    escaped: bool | None = True if _ESCAPED_START.match(text, pos) else None
    open_: list[str] = []
    quote: str | None = None
    skip = -1  # the last position an escape took
    inner_escape = -1  # where an escaped structure's own backslash escapes the next char
    for m in _STRUCTURE.finditer(text, pos):
        at, char = m.start(), m.group()
        if at <= skip:
            continue
        if char == "\\":
            skip = at + 1
            following = text[at + 1 : at + 2]
            if escaped is None and quote is None and following == '"':
                escaped = True
            if not escaped:
                continue  # the escaped character is not structure
            if following == "\\":
                char = "\\"  # an escaped structure's own backslash
            elif following == '"':
                char = '"'
            else:
                continue
        if inner_escape == at:
            continue  # escaped within the escaped structure: a plain character
        if escaped and char == "\\":
            inner_escape = at + 2
        elif quote is not None:
            if char == quote:
                quote = None
        elif char in "\"'":
            quote = char
            escaped = bool(escaped)
        elif char in _CLOSES:
            open_.append(_CLOSES[char])
        elif open_ and char == open_[-1]:
            open_.pop()
            if not open_:
                return at + 1
    return len(text)


def _mask_key_values(text: str) -> str:
    """``key: value`` and ``key=value`` pairs whose key is named like a credential."""
    out: list[str] = []
    done = 0
    for m in _KEY_WORD.finditer(text.translate(_ASCII_LOWER)):
        if m.start() < done:
            continue
        # The key's other words, read backwards from the one the pattern found.
        floor = max(done, m.start() - MAX_KEY_NAME)
        head = text[floor : m.start()][::-1]
        key_start = m.start() - _KEY_CHARS.match(head).end()  # type: ignore[union-attr]
        if key_start == floor > done and text[floor - 1] in _KEY_CHAR_SET:
            continue  # longer than any credential name
        if m.start() > key_start > 0 and text[key_start - 1] == "\\":
            # ``\npassword=``, ``\x0btoken=``: the escape (repr, JSON) is not the key's.
            key_start = min(m.start(), key_start + _escape_length(text, key_start))
        kind = _key_kind(text[key_start : m.end("word")])
        if kind is None:
            continue
        if m.group("word").endswith("tokens") and _COUNT.match(text, m.end()):
            continue  # "Total tokens: 1234" counts, in prose and usage reports
        span = _value_span(
            text,
            m.end(),
            kind,
            json_like=m.group("close") == '"',
            # A header is a line's own ``Name: value``; a quoted key is data's.
            header=m.group("sep") == ":" and m.group("close") is None,
        )
        if span is None:
            continue
        if m.group("comma") is not None and not _a_pair(text, key_start, span[1]):
            continue  # a name and a comma inside a longer list or an object: no pair
        start, end = span
        out.append(text[done:start])
        out.append(f"[redacted:{kind}]")
        done = end
    if not out:
        return text
    out.append(text[done:])
    return "".join(out)


# Around a pair: its opening before the name's quote, its close after the value's.
_PAIR_OPEN = re.compile(r"[\[(][ \t\r\n]{0,16}+[bBrRuU]{0,2}\\?[\"']\Z")
_PAIR_CLOSE = re.compile(r"\\?[\"'][ \t\r\n]{0,16}+,?[ \t\r\n]{0,16}+[\])]")


def _a_pair(text: str, key_start: int, value_end: int) -> bool:
    """Whether the name at ``key_start`` and the value ending at ``value_end`` are the two
    items of a pair: ``('x-api-key', '…')``, ``["x-api-key", "…"]``."""
    before = text[max(0, key_start - 20) : key_start]
    return _PAIR_OPEN.search(before) is not None and bool(_PAIR_CLOSE.match(text, value_end))


_ESCAPE = re.compile(r"x[0-9A-Fa-f]{2}|u[0-9A-Fa-f]{4}|U[0-9A-Fa-f]{8}|.", re.DOTALL)


def _escape_length(text: str, at: int) -> int:
    """How long the escape is whose backslash is right before ``at`` (one letter, or a
    ``\\x``, ``\\u`` or ``\\U`` code)."""
    found = _ESCAPE.match(text, at)
    return 0 if found is None else found.end() - at


def _value_span(
    text: str, pos: int, kind: str, *, json_like: bool, header: bool
) -> tuple[int, int] | None:
    """Where the value after a credential key starts and ends; ``None`` if there is none."""
    if text.startswith(_PLACEHOLDER_TEXT, pos):
        return None
    if text.startswith('\\"', pos):
        end = _ESCAPED_QUOTED.match(text, pos + 2).end()  # type: ignore[union-attr]
        return (pos + 2, end) if end > pos + 2 else None
    prefix = _STRING_PREFIX.match(text, pos)
    if prefix is not None:
        pos = prefix.end()
    quote = text[pos : pos + 1]
    if quote in ('"', "'"):
        body = _DOUBLE_QUOTED if quote == '"' else _SINGLE_QUOTED
        end = body.match(text, pos + 1).end()  # type: ignore[union-attr]
        if end == pos + 1 or text.startswith(_PLACEHOLDER_TEXT, pos + 1):
            return None
        # A value written as literals that continue it (``'Token '\n  '…'``, as pprint
        # wraps a long one): the rest of them is the value too.
        while (more := _NEXT_LITERAL.match(text, end + 1)) is not None and more.group(1) == quote:
            end = body.match(text, more.end()).end()  # type: ignore[union-attr]
        return pos + 1, end
    if quote in _CLOSES and _STRUCTURE_START.match(text, pos):
        # A list or object (``"token": ["…"]`` in an error's JSON): all of it, as a
        # mapping's value under such a key is masked whole.
        return pos, _structure_end(text, pos)
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
    if text[pos : end - 1].lower() in _HEADERS and text[end - 1 : end] == ":":
        # ``password=Authorization: …``: the header name is the next key, not this one's
        # value; masking it would leave the header's value with no key in front to mask it.
        # (Only a header's very name: ``password=Sup3rSecret: …`` is a password.)
        return None
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
