"""Property tests of README guarantee 7 (redaction) against an oracle.

Hypothesis draws JSON-like data (keys from credential names, near names such as
``tokens_used``/``password_hint``/``next_page_token``/``boarding_pass``/``PWD``, and plain
names; string leaves from prose, ids, URLs, paths, numbers as text, passwords only a key
gives away, and ``planted_secrets()``, alone or inside prose) and renders it as tools and
errors do: ``json.dumps`` (default, compact, ``indent=2``), ``repr``, JSON inside a JSON
string, ``f"error: {json.dumps(x)!r}"``, ``HTTP 422: `` + JSON (also pretty), ``key: value``
lines, a query string (``urlencode`` of dotted paths). The oracle: (a) no planted secret is
left, raw or escaped; (b) every string leaf under no credential key (at any depth) and
holding no planted secret is still there, as often as it was written; (a') a string under
a credential key is gone where README promises it (JSON and repr shapes: whole; ``key:
value`` lines: a one-word value, line by line; a query string: the pair whose last name is
a credential); (c) ``Redactor().value`` agrees on the data. Then ordinary text alone
(prose, code, long CamelCase URLs, base64 data: URLs, UUIDs, shas, slugs, paths, SQL) must
come back unchanged.

Examples are drawn under the suite's profile (derandomized unless ADK_HYPOTHESIS=explore),
at most 200 per test, with no example database. Explored locally with ADK_HYPOTHESIS=explore
at 1,500-5,000 examples per test; every class found is below, with a strict xfail.

Excluded from the properties, exactly (each predicate below names its class):

* A list of two texts whose first names a credential: README says its second is masked
  (a ``[name, value]`` pair, as headers' items hold one), which the oracle does not model.
* README's limits: a passphrase's later words (``key: value`` lines check one-word
  values only), a repr of JSON text (``error_repr_of_json`` with a structure under a
  credential key holding a quote, backslash, bracket or non-ASCII string), a name ending
  in ``_pwd`` (a flattened ``a.PWD``). Tuples of pairs, glued wrapped keys and never-closing
  structures are not generated.
* Expected masks, not defects: a token after the word ``bearer``; ``sk-`` + 20 key
  characters not glued to a word (known, ``sk-hynix-…``, not claimed by round 3).
* D5-D7 below (D5 only in the query-string rendering, for the kinds that percent-encoding
  changes).

Defects: D1-D4 were found as strict xfails and fixed (markers and exclusions removed: a
quoted key is never a header's name; the standalone AWS secret does not open on ``/`` nor
run into an extension; escaped reading is decided at a structure's first quote; a paging
token's name is exempt as a name's last words too). D5-D8 stay (strict xfails
``test_d5`` … ``test_d8``), named in the session's note:

D1 (LOW-MEDIUM, false positive) in free text an ``authorization``/``cookie`` key whose
   value is not a string (``"authorization": []``, ``{'cookie': None, …}``, ``0``) is read
   as a header and the rest of the LINE is masked (compact JSON: the rest of the document).
   ``free_text._value_span``: the header branch runs for any ``:`` separator when the value
   is neither a quoted string, an opened structure nor (only under a ``"``-quoted key) a
   JSON literal.
D2 (LOW-MEDIUM, false positive) a path whose first 40 characters are base64 with both
   cases and a digit is an ``aws_secret_key``: ``/Users/JohnSmith/Documents/
   Reports2024Q1.pdf``, ``src/Components/UserProfileSettings/Av2xy.tsx`` (also in
   ``value()``, so a keyed call passing it is "not sent"). ``patterns.py`` standalone rule:
   the look-behind refuses what is glued before the run, but the run may open on ``/`` or
   a letter after a space, and after a backslash a letter counts as an escape's.
D3 (MEDIUM-LOW, leak) JSON-escaped (``json.dumps`` of JSON text, promised), a list under a
   credential key whose first item is not a string (``[null, \\"…\\"]``, ``[1, …]``,
   ``[[], …]``) is read as raw text: a ``]`` in a later string ends it and the secret's
   tail is stored; an apostrophe masks to the end of the text. ``_ESCAPED_START`` decides
   escaped reading only when ``\\"`` follows the openings (round 3's defect 3, remaining
   shape).
D4 (LOW, false positive) ``_token`` names exempt only as eight exact names
   (``keys._NOT_SECRET``): ``NextContinuationToken`` (S3), ``nextSyncToken`` (Google
   Calendar), ``StartingToken`` (boto), ``ClientToken`` (AWS idempotency), a prefixed
   ``meta.next_page_token`` are masked.
D5 (LOW, gap README does not name) a secret percent-encoded in a query string under an
   ordinary key (``Bearer+…``, ``Basic+…``, a DSN's ``%3A…%40``, ``%2F``/``%2B`` in an AWS
   secret, a PEM's ``%0A``) is left.
D6 (MEDIUM-LOW, leak) an unquoted value under a credential key stops at the first
   ``, ; ( ) < > ' "`` (``free_text._UNQUOTED``): ``DB_PASSWORD=aB3xq9,Zt7Kp2mW`` stores
   ``,Zt7Kp2mW``. README names only a passphrase's later words.
D7 (LOW, false positive) ``AKIA``/``ASIA`` + 16 of ``[A-Z0-9]``: a code with 0, 1, 8 or 9
   (``ASIAPACIFICSALES2024``) cannot be a key id (base32) and is masked.
D8 (LOW, coverage, a judgement) ``SecretString``, ``signing_key``, ``encryption_key``,
   ``passcode`` are not credential names.

Held: every planted kind in every rendering (JSON, pretty, JSON-in-JSON, repr, repr of
JSON, ``HTTP 422:``, ``key: value`` lines, query strings for kinds percent-encoding leaves
alone) and in ``value()``; structures under credential keys masked whole and ended at
their close in JSON, pretty JSON, repr and JSON-in-JSON (opening on a string); near names
never masked in data or text; ordinary leaves (unicode, apostrophes, curly quotes,
numbers as text, long CamelCase URLs, git shas, UUIDs) kept verbatim; ordinary text
(30,000 explored examples) unchanged save D2, D7.
"""

from __future__ import annotations

import json
import re
import string
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import quote, quote_plus, urlencode

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tesserix_adk.checkpoint.redaction import Redactor
from tesserix_adk.checkpoint.redaction.keys import _key_kind
from tesserix_adk.testing.secrets import planted_cases

R = Redactor()
M = "[redacted:"

# --- what is planted ----------------------------------------------------------------------

# kind -> (text to plant, the part that must never be stored)
PLANTED: dict[str, tuple[str, str]] = {
    case.name.removeprefix("kind:"): (str(case.planted), case.secret)
    for case in planted_cases()
    if case.name.startswith("kind:")
}
SECRET_PARTS = tuple(secret for _, secret in PLANTED.values())

CRED_KEYS = (
    "password",
    "token",
    "api_key",
    "secret",
    "accessToken",
    "MYSQL_PWD",
    "credentials",
    "authorization",
    "clientSecret",
    "openai_api_key",
    "x-api-key",
    "PGPASSWORD",
    "db.password",
    "refresh_token",
    "Cookie",
    "private_key",
    "passphrase",
    "AWS_SECRET_ACCESS_KEY",
)
NEAR_KEYS = (
    "tokens_used",
    "password_hint",
    "next_page_token",
    "boarding_pass",
    "PWD",
    "OLDPWD",
    "input_tokens",
    "secretary",
    "DB_PASS",
    "nextToken",
    "api_key_id",
    "token_count",
    "secret_santa",
    "author",
    "keyboard",
)
PLAIN_KEYS = ("name", "id", "url", "path", "note", "items", "count", "user", "data", "error")
assert all(_key_kind(k) for k in CRED_KEYS)
assert not any(_key_kind(k) for k in NEAR_KEYS + PLAIN_KEYS)

WORDS = (
    "the",
    "quick",
    "brown",
    "fox",
    "booking",
    "flight",
    "seat",
    "refund",
    "was",
    "approved",
    "for",
    "customer",
    "order",
    "shipped",
    "Paris",
    "München",
    "café",
    "résumé",
    "error",
    "retry",
    "later",
    "ok",
    "done",
    "“quoted”",
    "it's",
    "a",
    "b",
    "100%",
    "e.g.",
    "(see",
    "notes)",
)

prose = st.lists(st.sampled_from(WORDS), min_size=1, max_size=12).map(" ".join)
hexdigits = st.text("0123456789abcdef", min_size=40, max_size=40)
uuid_text = st.uuids().map(str)
ident = st.one_of(
    hexdigits,
    uuid_text,
    st.text(string.ascii_letters + string.digits, min_size=8, max_size=24).map(
        lambda s: "call_" + s
    ),
    st.from_regex(r"[A-Z][a-z]{2,8}(?:[A-Z][a-z]{2,8}){1,4}[0-9]{0,4}", fullmatch=True),
)
url = st.builds(
    lambda host, parts, q: f"https://{host}/" + "/".join(parts) + (f"?q={q}" if q else ""),
    st.sampled_from(("example.com", "api.example.org:8443", "docs.python.org")),
    st.lists(
        st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,24}", fullmatch=True), min_size=1, max_size=6
    ),
    st.from_regex(r"[a-z0-9]{0,8}", fullmatch=True),
)
path = st.lists(st.from_regex(r"[A-Za-z0-9_.-]{1,16}", fullmatch=True), min_size=1, max_size=6).map(
    lambda parts: "/srv/" + "/".join(parts)
)
number_text = st.one_of(st.integers().map(str), st.floats(allow_nan=False).map(repr))
# A password only its key gives away.
PASSWORD_CHARS = string.ascii_letters + string.digits + "-_!@#$%^*.~"
passwordish = st.one_of(
    st.text(PASSWORD_CHARS, min_size=8, max_size=20).map(lambda s: "Pw" + s),
    # Every printable ASCII character a generated password may hold.
    st.text(string.punctuation + string.ascii_letters + string.digits, min_size=8, max_size=20).map(
        lambda s: "Pw" + s
    ),
)
planted = st.sampled_from(sorted(PLANTED)).map(lambda kind: PLANTED[kind][0])
embedded = st.builds(lambda a, s, b: f"{a} {s} {b}", prose, planted, prose)

ordinary_leaf = st.one_of(prose, ident, url, path, number_text, passwordish)
leaf = st.one_of(ordinary_leaf, planted, embedded)
scalar = st.one_of(leaf, leaf, leaf, st.integers(), st.booleans(), st.none())
key = st.one_of(st.sampled_from(CRED_KEYS), st.sampled_from(NEAR_KEYS), st.sampled_from(PLAIN_KEYS))


def _data(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(
        st.lists(children, max_size=4), st.dictionaries(key, children, min_size=1, max_size=4)
    )


data = st.dictionaries(key, st.recursive(scalar, _data, max_leaves=10), min_size=1, max_size=5)


# --- the oracle ---------------------------------------------------------------------------


def leaves(
    value: Any, under: bool = False, at: tuple[Any, ...] = ()
) -> Iterator[tuple[tuple[Any, ...], bool, str]]:
    """(path, under a credential key, string) for every string leaf."""
    if isinstance(value, str):
        yield at, under, value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from leaves(v, under or _key_kind(k) is not None, (*at, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from leaves(v, under, (*at, i))


def holds_secret(text: str) -> bool:
    return any(part in text for part in SECRET_PARTS) or any(
        planted_text in text for planted_text, _ in PLANTED.values()
    )


def secret_forms(part: str) -> tuple[str, ...]:
    once = json.dumps(part)[1:-1]
    twice = json.dumps(once)[1:-1]
    return (part, once, twice, quote(part, safe=""), quote_plus(part))


def leaked(text: str) -> list[str]:
    return [
        kind
        for kind, (_, part) in PLANTED.items()
        if any(form in text for form in secret_forms(part))
    ]


# --- renderings ---------------------------------------------------------------------------


def _yaml_scalar(value: Any) -> str:
    if isinstance(value, str):
        return json.dumps(value) if "\n" in value or not value else value
    return json.dumps(value)


def yamlish(value: Any, pad: str = "") -> list[str]:
    """``key: value`` lines, nested by indentation, as a config dump or a log writes them."""
    lines: list[str] = []
    if isinstance(value, dict):
        for k, v in value.items():
            if isinstance(v, dict | list) and v:
                lines.append(f"{pad}{k}:")
                lines.extend(yamlish(v, pad + "  "))
            else:
                lines.append(f"{pad}{k}: {_yaml_scalar(v if v != [] else '[]')}")
    else:
        for v in value:
            if isinstance(v, dict | list) and v:
                lines.append(f"{pad}-")
                lines.extend(yamlish(v, pad + "  "))
            else:
                lines.append(f"{pad}- {_yaml_scalar(v)}")
    return lines


def flat(value: Any, at: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(value, dict):
        for k, v in value.items():
            yield from flat(v, f"{at}.{k}" if at else k)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from flat(v, f"{at}.{i}")
    else:
        yield at, "" if value is None else value


RENDER: dict[str, Callable[[Any], str]] = {
    "json": lambda x: json.dumps(x),
    "json_compact": lambda x: json.dumps(x, separators=(",", ":")),
    "json_indent": lambda x: json.dumps(x, indent=2),
    "repr": repr,
    "json_in_json": lambda x: json.dumps(json.dumps(x)),
    "error_repr_of_json": lambda x: f"error: {json.dumps(x)!r}",
    "http_422": lambda x: "HTTP 422: " + json.dumps(x),
    "http_422_indent": lambda x: "HTTP 422: " + json.dumps(x, indent=2),
    "yamlish": lambda x: "\n".join(yamlish(x)),
    "query": lambda x: urlencode(list(flat(x))),
}

# How one string leaf reads in each rendering.
ENCODE: dict[str, Callable[[str], str]] = {
    "json": json.dumps,
    "json_compact": json.dumps,
    "json_indent": json.dumps,
    "repr": repr,
    "json_in_json": lambda s: json.dumps(json.dumps(s))[1:-1],
    "error_repr_of_json": lambda s: repr(json.dumps(s))[1:-1],
    "http_422": json.dumps,
    "http_422_indent": json.dumps,
    "yamlish": _yaml_scalar,
    "query": quote_plus,
}
STRUCTURED = frozenset(RENDER) - {"yamlish", "query"}


# --- 1. structured data in every rendering ------------------------------------------------


def nodes(value: Any) -> Iterator[tuple[str, Any]]:
    """(key, value) for every entry of every mapping, however deep."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield k, v
            yield from nodes(v)
    elif isinstance(value, list):
        for v in value:
            yield from nodes(v)


FREE_TEXT = frozenset(RENDER) - {"json", "json_compact", "json_indent"}


def _strings(v: Any) -> list[str]:
    return [s for _, _, s in leaves(v)] + [k for k, _ in nodes(v)]


def limit_repr_of_json_text(form: str, value: Any) -> bool:
    """README's limit: in a repr of JSON text, whose escapes are doubled, a bracket inside a
    string may end a structure early (a quote, backslash or non-ASCII character is written
    as a doubled escape, ``\\\\"``, and read as a real quote)."""
    return form == "error_repr_of_json" and any(
        _key_kind(k)
        and isinstance(v, list | dict)
        and any(not s.isascii() or any(c in s for c in "'\"\\[]{}") for s in _strings(v))
        for k, v in nodes(value)
    )


def holds_a_pair(value: Any) -> bool:
    """A list of two texts whose first names a credential (``["x-api-key", "…"]``): its
    second is masked as under that name (README), which the oracle does not model."""
    if isinstance(value, dict):
        return any(holds_a_pair(v) for v in value.values())
    if isinstance(value, list):
        pair = len(value) == 2 and all(isinstance(v, str) for v in value)
        return (pair and _key_kind(value[0]) is not None) or any(map(holds_a_pair, value))
    return False


def excluded(form: str, value: Any) -> str | None:
    if holds_a_pair(value):
        return "README: a [name, value] pair whose name is a credential's masks its value"
    if limit_repr_of_json_text(form, value):
        return "README: a repr of JSON text"
    if form == "query" and any(name.endswith(".PWD") for name, _ in flat(value)):
        return "README: a name ending in _pwd is masked whatever it holds (a.PWD reads so)"
    return None


def check_rendering(form: str, value: dict[str, Any]) -> None:
    if excluded(form, value):
        return
    text = RENDER[form](value)
    out = R.text(text)
    found_kinds = leaked(out)
    if form == "query":
        # D5: a secret percent-encoded (``Bearer+ya29…``, ``%2F``/``%2B`` in an AWS secret, a
        # URL's password as ``%3A…%40``, a PEM key's ``%0A``) is not looked for.
        found_kinds = [k for k in found_kinds if quote_plus(PLANTED[k][0]) == PLANTED[k][0]]
    assert found_kinds == [], (form, text, out)
    enc = ENCODE[form]
    found = list(leaves(value))
    others = [s for _, under, s in found if not under]
    # (b) every ordinary string survives, as many times as it was written.
    keep: dict[str, int] = {}
    for _, under, s in found:
        if not under and not holds_secret(s):
            keep[enc(s)] = keep.get(enc(s), 0) + 1
    for written, times in keep.items():
        assert out.count(written) >= times, (form, written, text, out)
    # (a') what only its key gives away is gone, in every shape README promises.
    for at, under, s in found:
        if not under or not s or any(s in o for o in others) or len(s) < 6:
            continue
        if form in STRUCTURED:
            assert enc(s) not in out, (form, s, text, out)
        elif form == "query" and isinstance(at[-1], str) and _key_kind(at[-1]):
            name = ".".join(str(step) for step in at)
            assert f"{name}={enc(s)}" not in out, (form, s, text, out)


@pytest.mark.parametrize("form", sorted(RENDER))
@settings(max_examples=150, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(value=data)
def test_rendered_data_is_masked_by_the_oracle(form: str, value: dict[str, Any]) -> None:
    check_rendering(form, value)


@settings(max_examples=200, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(value=data)
def test_value_agrees_with_the_oracle(value: dict[str, Any]) -> None:
    if holds_a_pair(value):
        return  # README: a pair masks its value (tests/run/test_result_content.py)
    out = R.value(value)
    assert leaked(json.dumps(out)) == []
    for at, under, s in leaves(value):
        got: Any = out
        for step in at:
            got = got[step]
        if under and s:
            assert got.startswith(M) and got.endswith("]"), (at, s, got)
        elif not holds_secret(s):
            assert got == s, (at, s, got)


# Where an unquoted value stops (``free_text._UNQUOTED``): D6 when inside a password.
_STOPS = frozenset(",;&\"'()[]{}<>")


@settings(max_examples=200, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(value=data)
def test_key_value_lines_are_masked_line_by_line(value: dict[str, Any]) -> None:
    """``key: value`` lines (a config dump, a log): masking never adds or removes a line, so
    each line is judged on its own. A one-word string under a credential key goes whole;
    a line of an ordinary key holding no secret stays as it is."""
    if excluded("yamlish", value):
        return
    text = RENDER["yamlish"](value)
    out = R.text(text)
    assert leaked(out) == []
    lines, masked = text.split("\n"), out.split("\n")
    assert len(lines) == len(masked)
    for line, got in zip(lines, masked, strict=True):
        name, sep, rest = line.strip().partition(": ")
        if not sep or name.startswith("- "):
            continue
        kind = _key_kind(name)
        if kind is None and not holds_secret(rest):
            assert got == line, (line, got, out)
        elif (
            kind is not None
            and rest
            and not rest.startswith('"')
            and not any(c.isspace() for c in rest)  # README: a passphrase's later words
            and not _STOPS & set(rest)  # D6
            and rest not in ("null", "true", "false", "[]")
            and not re.fullmatch(r"-?[0-9.e+-]+|-?inf|nan", rest)
        ):
            assert re.fullmatch(rf"{re.escape(name)}: \[redacted:[a-z_]+\]", got.strip()), (
                line,
                got,
            )


# --- 2. ordinary text stays as it is ------------------------------------------------------

camel_word = st.from_regex(r"[A-Z][a-z]{2,9}", fullmatch=True)
camel = st.lists(camel_word, min_size=1, max_size=5).map("".join)
camel_path_segment = st.one_of(
    camel,
    st.builds(lambda w, n: f"{w}{n}", camel, st.integers(0, 2030)),
    st.from_regex(r"[a-z]{2,10}", fullmatch=True),
)
long_url = st.builds(
    lambda host, parts, ext: f"https://{host}/" + "/".join(parts) + ext,
    st.sampled_from(("github.com", "example.com", "learn.microsoft.com", "s3.amazonaws.com")),
    st.lists(camel_path_segment, min_size=1, max_size=8),
    st.sampled_from(("", "/", ".html", ".md", "?tab=readme", "#Section2")),
)
image_data = st.binary(min_size=20, max_size=300).map(
    lambda b: "data:image/png;base64," + __import__("base64").b64encode(b).decode()
)
slug = st.lists(
    st.one_of(st.from_regex(r"[a-z]{2,10}", fullmatch=True), camel, st.integers(0, 2030).map(str)),
    min_size=2,
    max_size=8,
).map("-".join)
rel_path = st.lists(camel_path_segment, min_size=1, max_size=6).map(lambda p: "/".join(p))
file_path = st.builds(
    lambda root, p, ext: root + p + ext,
    st.sampled_from(("/", "./", "src/", "/Users/JohnSmith/", "C:\\\\Users\\\\")),
    rel_path,
    st.sampled_from(("", ".py", ".tsx", ".pdf", ".md")),
)
sql = st.builds(
    lambda table, col, n: f"SELECT {col}, COUNT(*) FROM {table} WHERE id > {n} GROUP BY {col};",
    st.sampled_from(("users", "bookings", "orders")),
    st.sampled_from(("status", "created_at", "region")),
    st.integers(0, 10**9),
)
code = st.sampled_from(
    (
        "def add(a: int, b: int) -> int:\n    return a + b\n",
        "for (let i = 0; i < n; i++) { total += xs[i]; }",
        "x = {'a': [1, 2, 3], 'b': None}",
        'fetch("/api/v2/items?page=2").then(r => r.json())',
        "SELECT 1 + 2 AS three",
        "git log --oneline | head -n 5",
        "a/b + c/d == (a*d + b*c)/(b*d)",
    )
)
region_code = st.builds(
    lambda p, rest: p + rest,
    st.sampled_from(("ASIA", "EMEA", "AMER")),
    st.from_regex(r"[A-Z0-9]{12,18}", fullmatch=True),
)
prose_more = st.lists(
    st.sampled_from((*WORDS, "bearer", "basic", "the bearer of", "basic plan", "Basic")),
    min_size=1,
    max_size=12,
).map(" ".join)
fragment = st.one_of(
    prose_more,
    long_url,
    image_data,
    uuid_text,
    hexdigits,
    slug,
    file_path,
    sql,
    code,
    number_text,
    region_code,
    ident,
)
ordinary_text = st.lists(fragment, min_size=1, max_size=6).flatmap(
    lambda parts: st.sampled_from((" ", "\n", ", ", " | ", "\t")).map(lambda sep: sep.join(parts))
)


def defect_false_positive(text: str) -> str | None:
    if _CODE_LIKE_KEY_ID.search(text):
        return "D7"
    if _UNGLUED_SK.search(text):
        return "known: any sk- + 20 key characters not glued to a word is a key (sk-hynix-…)"
    if _BEARER_CONTEXT.search(text):
        return "expected: a token after the word bearer is a credential (RFC 6750)"
    return None


_UNGLUED_SK = re.compile(r"(?<![A-Za-z0-9_-])sk-[A-Za-z0-9_-]{20}")
_BEARER_CONTEXT = re.compile(r"(?i)(?<![A-Za-z0-9_])bearer[ \t]+[A-Za-z0-9._~+/-]{8,}")


# D7: an upper-case code of exactly 20 characters opening on ASIA or AKIA, digits such as
# 0, 1, 8 or 9 in it (never in a real key id, whose 16 are base32: A-Z and 2-7).
_CODE_LIKE_KEY_ID = re.compile(r"(?<![A-Za-z0-9])(?:AKIA|ASIA)[A-Z0-9]{16}(?![A-Za-z0-9])")


@settings(max_examples=200, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=ordinary_text)
def test_ordinary_text_stays(text: str) -> None:
    if defect_false_positive(text):
        return
    assert R.text(text) == text


# --- each defect class, deterministic -----------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        'HTTP 422: {"authorization": [], "name": "bob smith"}',
        "{'cookie': None, 'name': 'bob smith'}",
        "got {'Authorization': 0, 'name': 'bob smith'}",
    ],
)
def test_d1_a_header_key_with_no_string_keeps_the_rest_of_the_line(text: str) -> None:
    assert "bob smith" in R.text(text)


@pytest.mark.parametrize(
    "path",
    [
        "/Users/JohnSmith/Documents/Reports2024Q1.pdf",
        "src/Components/UserProfileSettings/Av2xy.tsx",
    ],
)
def test_d2_a_path_is_not_an_aws_secret(path: str) -> None:
    assert R.text(f"open {path} now") == f"open {path} now"
    assert R.value({"path": path}) == {"path": path}


@pytest.mark.parametrize("first", [None, 1, []])
def test_d3_an_escaped_list_not_opening_on_a_string_is_masked_whole(first: Any) -> None:
    text = json.dumps(json.dumps({"token": [first, "Pw]tail-QZSECRETQZ"], "note": "kept"}))
    out = R.text(text)
    assert "QZSECRETQZ" not in out
    assert "kept" in out


@pytest.mark.parametrize(
    "name",
    [
        "NextContinuationToken",
        "nextSyncToken",
        "StartingToken",
        "ClientToken",
        "meta.next_page_token",
    ],
)
def test_d4_paging_and_idempotency_token_names_stay(name: str) -> None:
    assert R.value({name: "1ueGcxLPRx1Tr"}) == {name: "1ueGcxLPRx1Tr"}


@pytest.mark.xfail(
    strict=True,
    reason="D5 (LOW, gap README does not name): a secret percent-encoded in a query string "
    "under an ordinary key (Bearer+…, Basic+…, a DSN's %3A…%40, an AWS secret's %2F/%2B, a "
    "PEM's %0A) is not recognised; only Bearer%20sk-… is",
)
@pytest.mark.parametrize("kind", ["bearer", "url_password", "aws_secret_key", "private_key"])
def test_d5_a_percent_encoded_secret_in_a_query_string_is_masked(kind: str) -> None:
    out = R.text("GET /cb?" + urlencode({"next": PLANTED[kind][0], "page": "2"}))
    assert leaked(out) == []


@pytest.mark.xfail(
    strict=True,
    reason="D6 (MEDIUM-LOW, leak): an unquoted value under a credential key stops at the "
    "first of , ; ( ) < > ' \" (free_text._UNQUOTED), so a generated password holding one "
    "is masked only up to it and its tail is stored; README names only a passphrase's "
    "later words (a space)",
)
@pytest.mark.parametrize(
    "line",
    [
        "DB_PASSWORD=aB3xq9,Zt7KpQZ",
        "password: Xk9(Tq2)LmQZ",
        "export PGPASSWORD=Hq7;rm8VQZ",
        "password: Zq8>Tm3<WnQZ",
    ],
)
def test_d6_a_password_with_punctuation_is_masked_whole(line: str) -> None:
    assert "QZ" not in R.text(line)


@pytest.mark.xfail(
    strict=True,
    reason="D7 (LOW, false positive): the access key id rule takes any 16 of [A-Z0-9] after "
    "AKIA/ASIA; a real id's 16 are base32 (A-Z, 2-7), so a code holding 0, 1, 8 or 9 "
    "(ASIAPACIFICSALES2024) is not one",
)
def test_d7_an_upper_case_code_that_cannot_be_a_key_id_stays() -> None:
    assert R.text("region ASIAPACIFICSALES2024 closed") == "region ASIAPACIFICSALES2024 closed"


@pytest.mark.xfail(
    strict=True,
    reason="D8 (LOW, coverage): names that carry a secret but end in no listed word stay "
    "(AWS Secrets Manager's SecretString, signing_key, encryption_key, hmac_key, passcode); "
    "README's list ends in '…', so this is a judgement, not a broken promise",
)
@pytest.mark.parametrize("name", ["SecretString", "signing_key", "encryption_key", "passcode"])
def test_d8_names_that_carry_a_secret_are_masked(name: str) -> None:
    assert R.value({name: "hunter2-Prod"}) != {name: "hunter2-Prod"}


# --- what held, pinned --------------------------------------------------------------------


def test_near_names_stay_and_credential_names_mask_in_data() -> None:
    value = {k: "Pw-ordinary-7" for k in NEAR_KEYS + PLAIN_KEYS}
    assert R.value(value) == value
    masked = R.value({k: "Pw-ordinary-7" for k in CRED_KEYS})
    assert all(v.startswith(M) for v in masked.values())
