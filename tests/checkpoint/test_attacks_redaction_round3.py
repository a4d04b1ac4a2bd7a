"""Attacks on commit b6f82aa (README guarantee 7, redaction), round 3: ``patterns._random``
(a glued key wants 40 characters and a run of 16 letters and digits), the glued
``sk-ant-<word><NN>-``, legacy and URL-escaped keys, the standalone AWS secret's new
look-behind (``. : _ ~ % # @ & -`` refused, save right after ``]:``), and
``free_text._STRUCTURE_START`` / ``_ESCAPED_START`` / the escape-aware, uncapped
``_structure_end`` (a list or object under a credential key is masked whole only when it
is "written as data", read through JSON escapes, to the end of the text if it never
closes). The attack on 2bc014f is in ``test_attacks_redaction_changes.py``; its rigs are
reused here and its cases are not repeated.

Run-level tests use the real ``AgentRunner`` on a SQLite file with a scripted model; an
approval-gated (keyed) tool is approved through the CLI and the run resumed, so a masked
argument shows as a call answered "not sent", and a masked result as what the resumed
model is told. Where a regression is claimed, the same input was checked against the
redactor as of 2bc014f (loaded from ``git show`` in a scratch session, not here).

A strict xfail is a defect (its reason says which); a plain test is a promise that held.

Defects (leaks):

1. (MEDIUM-HIGH, regression) ``test_pretty_json_in_a_repr_or_escaped_string_is_masked``
   and the redactor-level ``test_escaped_pretty_structures_under_a_credential_key_are_
   masked``: README promises a list or object under a credential key is masked whole
   "when it is written as data, JSON or a Python repr, also JSON-escaped inside a
   string". Pretty-printed JSON (``json.dumps(…, indent=2)``, what most APIs return)
   inside a ``repr`` (``f"bad response: {resp.text!r}"``) or a JSON-escaped string writes
   ``[\\n    "…"`` / ``{\\n    \\"user\\"…``: the newline is an escape, which
   ``_STRUCTURE_START`` (raw whitespace only, then a quote or ``\\"``) does not skip, so
   the structure is refused and ``"token": [\\n "…"]`` and ``"credentials": {\\n "user":
   …, "pass": "…"}`` are stored raw. 2bc014f masked both.
2. (LOW, regression) ``test_a_list_starting_with_null_or_none_under_a_credential_key_is_
   masked``: a JSON list starting with ``null``/``true``/``false`` or a Python repr's
   ``None``/``True`` (``{'token': [None, '…']}``) is data, but ``_STRUCTURE_START`` only
   takes a quote, bracket, digit or ``-`` first, so the secrets after stay. 2bc014f
   masked them.
3. (LOW) ``test_an_escaped_structure_not_opening_on_an_escaped_quote_is_masked_whole``:
   escape-aware reading is decided by the first character only (``_ESCAPED_START``): a
   JSON-escaped list of objects (``[{\\"user\\": …}]``) is read as raw text, where every
   ``\\"`` is skipped, so a ``}]`` inside a string (a password with symbols) closes it
   and the rest is stored; likewise a Python ``repr`` of JSON text (``'{"pass":
   "Zq\\\\"}8…"}'``), where ``\\\\"`` is an escaped JSON quote read as a real one. The
   same class as defect 10 of the 2bc014f attack, in the shapes the fix did not cover.

Defects (false positives):

4. (LOW-MEDIUM, regression) ``test_an_ipv6_url_with_a_port_is_sent_after_approval``: the
   ``]:`` exception is for any ``]``, not only a masked key id: ``http://[::1]:8080/Users/
   JohnSmith/Documents/Reports24.pdf`` (a port and path making a 40-character run right
   after ``]:``) is masked as ``aws_secret_key`` and the approved call is "not sent".
   README: a URL's path "is not taken for" a secret; only ``AKIA…:<secret>`` is named.
   2bc014f left this URL alone (``:`` was refused).
5. (LOW-MEDIUM) ``test_a_slug_with_a_camelcase_word_after_sk_admin_is_sent_after_
   approval``: ``_random``'s run of 16 letters and digits is any CamelCase compound
   (``MultiTenantDashboard2024``): ``…/flask-admin-MultiTenantDashboard2024-example-
   application`` is still taken for a glued key (README: "a slug such as
   flask-admin-SQLAlchemy2-Examples stays"), and the approved call is "not sent".
6. (LOW) ``test_a_source_file_quoting_an_unclosed_list_reaches_the_resumed_model``: a
   structure that never closes is masked to the END of the text: a source file that
   quotes ``'token: ["'`` in a string literal (a parser, a test) loses every line after
   it for the resumed model (2bc014f lost 16 KiB; now any size). A careful user expects a
   value masked, not the rest of a file.
7. (LOW) ``test_an_empty_list_or_object_under_a_credential_key_is_sent``: ``password:
   []`` / ``credentials: {}`` hold nothing, yet are masked (``_STRUCTURE_START`` takes
   ``]`` and ``}`` first on purpose), while ``password: ""`` stays; a keyed call writing
   such a config template is "not sent".

Held: structures with raw whitespace (``token: [ \\n '…' ]``, ``[\\t"…"]``,
``secret: {\\n "k": …}``), mixed quotes, brackets inside strings and JSON-in-JSON
(``\\\\\\"``) escapes are masked whole and stop at their end; AWS pairs and hinted forms
(``AKIA…:secret``, ``https://AKIA…:secret@host``, ``[default]`` files, ``--aws-secret-key=``,
``secret:…``, ``"…"`` after ``=``) are masked; a glued key whose run of 16 comes late
(within 160 characters) is masked, hyphenated slugs stay; every new rule gives exact
output on hostile inputs at two sizes.

Not claimed (README names or does not promise them): a standalone AWS secret glued after
``_ - @ # ~ & %`` (README lists exactly these), a non-AKIA id before ``:`` (GCS
``GOOG1…:<secret>``, Wasabi: leaked since 2bc014f), a tuple under a key
(``password=(b'…',)``), YAML flow lists of bare words (``token: [abc, def]``, which
cannot be told from a link in prose), ``…%20sk-hynix-memory-prices`` (the unglued rule
already masks ``sk-`` + 20 after ``=``).

Fixed (markers removed): 1 (space after an opening bracket may be escaped, ``\\n``), 2 (a
list may start with a literal), 3 for a JSON-escaped list of objects (escaped mode is
decided past the openings), 4 (the ``]:`` exception is only after a masked key id), 5 (a
glued key's body must read as random: ``patterns._random_body``, upper-case letters a fifth
to four fifths of its letters), 7 (an empty list or object is none). Left, and named in
README: 3 for a repr of JSON text, 6.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_attacks_redaction_changes import (
    AWS_ID,
    AWS_SECRET,
    BODY,
    KIB,
    SK,
    _fill,
    approved_call,
    hang_guard,
    not_sent,
    raises,
    redact,
    stored_after,
)

M = "[redacted:"


# --- 1. pretty JSON inside a repr or a JSON-escaped string --------------------------------

PRETTY = json.dumps(
    {
        "user": "bob",
        "token": ["QZPRETTYLISTQZ"],
        "credentials": {"user": "bob", "pass": "QZPRETTYOBJQZ"},
        "status": "expired",
    },
    indent=2,
)
ESCAPED_PRETTY = {
    "repr": "bad response: " + repr(PRETTY),  # f"{resp.text!r}"
    "json_escaped": "request failed: body=" + json.dumps(PRETTY),  # a log line, Go %q
    "repr_of_dict": "error: " + repr({"status": 401, "body": PRETTY}),
}


@pytest.mark.parametrize("shape", sorted(ESCAPED_PRETTY))
def test_pretty_json_in_a_repr_or_escaped_string_is_masked(
    shape: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    seen = stored_after(tmp_path, caplog, raises(ESCAPED_PRETTY[shape]))
    assert "expired" in seen  # the message was stored
    assert "QZPRETTYLISTQZ" not in seen
    assert "QZPRETTYOBJQZ" not in seen


@pytest.mark.parametrize(
    "text",
    [
        'x=\'{"token": [\\n    "QZESCQZ"\\n  ]}\'',
        'x="{\\"token\\": [\\n    \\"QZESCQZ\\"\\n  ]}"',
        'x="{\\"credentials\\": {\\n  \\"user\\": \\"bob\\", \\"pass\\": \\"QZESCQZ\\"}}"',
        'x=\'{"credentials": {\\t"user": "bob", "pass": "QZESCQZ"}}\'',
    ],
    ids=["repr_list", "escaped_list", "escaped_object", "repr_tab_object"],
)
def test_escaped_pretty_structures_under_a_credential_key_are_masked(text: str) -> None:
    out = redact(text)
    assert "QZESCQZ" not in out, out


def test_the_same_pretty_json_as_raw_free_text_is_masked() -> None:
    """Held: with real newlines the same structures are masked whole, and end there."""
    out = redact("HTTP 401\n" + PRETTY + "\nretry later")
    assert "QZPRETTY" not in out, out
    assert '"status": "expired"' in out and out.endswith("retry later")


# --- 2. a list starting with null / None ----------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        'HTTP 400: {"token": [null, "QZNULLQZ"]}',
        'HTTP 400: {"token": [false, "QZNULLQZ"]}',
        "kwargs={'token': [None, 'QZNULLQZ']}",
        "kwargs={'credentials': [True, 'QZNULLQZ']}",
    ],
    ids=["json_null", "json_false", "repr_none", "repr_true"],
)
def test_a_list_starting_with_null_or_none_under_a_credential_key_is_masked(text: str) -> None:
    out = redact(text)
    assert "QZNULLQZ" not in out, out


# --- 3. escapes read only when the structure opens on an escaped quote -----------------------

MIXED_ESCAPES = {
    # A JSON-escaped list of objects: '[{\"' does not open on an escaped quote.
    "escaped_list_of_objects": "request failed: body="
    + json.dumps(json.dumps({"credentials": [{"user": "bob", "pass": "Zq}]8QZMIXEDQZ"}], "n": 1})),
    # A Python repr of JSON text: the JSON escape '\\"' is doubled by repr.
    "repr_of_json": "bad response: "
    + repr(json.dumps({"credentials": {"user": "bob", "pass": 'Zq"}8QZMIXEDQZ'}, "n": 1})),
}


@pytest.mark.parametrize(
    "shape",
    [
        "escaped_list_of_objects",
        pytest.param(
            "repr_of_json",
            marks=pytest.mark.xfail(
                strict=True,
                reason="defect 3 (LOW): a repr of JSON text doubles its escapes ('\\\\\"'), "
                "read raw, so a '}' inside a string closes the object and the rest is stored",
            ),
        ),
    ],
)
def test_an_escaped_structure_not_opening_on_an_escaped_quote_is_masked_whole(
    shape: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    seen = stored_after(tmp_path, caplog, raises(MIXED_ESCAPES[shape]))
    assert "request failed" in seen or "bad response" in seen
    assert "QZMIXEDQZ" not in seen


# --- 4. an IPv6 URL with a port ------------------------------------------------------------

IPV6_URL = "http://[::1]:8080/Users/JohnSmith/Documents/Reports24.pdf"


def test_the_ipv6_url_has_a_40_character_run_after_the_bracket() -> None:
    run = IPV6_URL.split("]:", 1)[1].split(".", 1)[0]
    assert len(run) == 40 and "/" in run
    assert redact(IPV6_URL.replace("[::1]", "localhost")) == IPV6_URL.replace("[::1]", "localhost")


def test_an_ipv6_url_with_a_port_is_sent_after_approval(tmp_path: Path) -> None:
    args = {"url": IPV6_URL}
    outcome = approved_call(tmp_path, args)
    assert outcome.sent == [args], outcome.told


def test_an_aws_key_pair_after_a_masked_key_id_is_still_masked() -> None:
    """Held: what the ']:' exception is for."""
    assert AWS_SECRET not in redact(f"{AWS_ID}:{AWS_SECRET}")
    assert AWS_SECRET not in redact(f"s3fs: {AWS_ID}:{AWS_SECRET} > ~/.passwd-s3fs")


# --- 5. a CamelCase compound after sk-admin- -----------------------------------------------

CAMEL_SLUGS = {
    "repo": "https://github.com/acme/fla"
    + SK
    + "admin-MultiTenantDashboard2024-example-application",
    "branch": "feature/kio" + SK + "admin-KioskManagementService2024-api-refactor",
}


def test_a_slug_with_a_camelcase_word_after_sk_admin_is_sent_after_approval(
    tmp_path: Path,
) -> None:
    outcome = approved_call(tmp_path, dict(CAMEL_SLUGS))
    assert outcome.sent == [CAMEL_SLUGS], outcome.told


def test_glued_keys_the_new_rule_is_for_are_masked() -> None:
    """Held: a glued key with its run of 16 late in the body (within 160 characters),
    and the documented slug, are told apart."""
    late = "call_" + SK + "proj-" + "a_B-c_1" * 20 + BODY
    assert redact(late) == "call_[redacted:openai_key]"
    slug = "https://github.com/acme/fla" + SK + "admin-SQLAlchemy2-Examples"
    assert redact(slug) == slug


# --- 6. a never-closed structure masks the rest of the text --------------------------------

SOURCE = (
    "def parse(line):\n"
    "    if line.startswith('token: [\"'):\n"
    "        return json.loads(line[7:])\n"
    "    return None\n\n"
    + "".join(f"def helper_{i}(x):\n    return x + {i}\n\n" for i in range(200))
    + "def LAST_FUNCTION():\n    return 'end of file'\n"
)


@pytest.mark.xfail(
    strict=True,
    reason="defect 6 (LOW): a structure that never closes is masked to the end of the "
    "text, so a source file quoting 'token: [\"' loses every later line for the resumed "
    "model",
)
def test_a_source_file_quoting_an_unclosed_list_reaches_the_resumed_model(tmp_path: Path) -> None:
    outcome = approved_call(tmp_path, {"note": "read"}, read=SOURCE)
    assert outcome.sent == [{"note": "read"}]
    told = [t for t in outcome.told if "def parse" in t]
    assert told, outcome.told
    assert "helper_150" in told[0] and "LAST_FUNCTION" in told[0], told[0][-200:]


# --- 7. an empty list or object under a credential key --------------------------------------

CONFIG = 'database:\n  user: app\n  password: ""\n  replicas_password: []\ncredentials: {}\n'


def test_an_empty_string_under_a_credential_key_stays() -> None:
    assert redact('password: ""\nname: app') == 'password: ""\nname: app'


def test_an_empty_list_or_object_under_a_credential_key_is_sent(tmp_path: Path) -> None:
    args = {"path": "config/app.yaml", "content": CONFIG}
    outcome = approved_call(tmp_path, args)
    assert not not_sent(outcome), outcome.told
    assert outcome.sent == [args], outcome.told


# --- held: structures the new start test takes ----------------------------------------------

HELD_STRUCTURES = {
    "space_newline_single": ("token: [ \n 'QZHQZ' ] then", "token: [redacted:token] then"),
    "tab_double": ('token: [\t"QZHQZ"] then', "token: [redacted:token] then"),
    "object_newline": ('secret: {\n "k": "QZHQZ"} then', "secret: [redacted:secret] then"),
    "bracket_in_strings": (
        "token: ['a]', \"b]\", 'QZHQZ'] then",
        "token: [redacted:token] then",
    ),
    "mixed_quotes": ("token: ['it\"s', \"it's\", 'QZHQZ'] then", "token: [redacted:token] then"),
    "json_in_json_backslashes": (
        'x="{\\"token\\": [\\"a\\\\\\\\\\", \\"b\\\\\\"]\\", \\"QZHQZ\\"], \\"n\\": 1}"',
        'x="{\\"token\\": [redacted:token], \\"n\\": 1}"',
    ),
    "escaped_object_brace_in_string": (
        'x="{\\"credentials\\": {\\"pass\\": \\"a}b\\", \\"k\\": \\"QZHQZ\\"}, \\"n\\": 1}"',
        'x="{\\"credentials\\": [redacted:secret], \\"n\\": 1}"',
    ),
}


@pytest.mark.parametrize("name", sorted(HELD_STRUCTURES))
def test_structures_written_as_data_are_masked_whole_and_end_at_their_close(name: str) -> None:
    text, expected = HELD_STRUCTURES[name]
    assert redact(text) == expected


HELD_AWS = {
    "url_pair": f"https://{AWS_ID}:{AWS_SECRET}@bucket.s3.amazonaws.com/x",
    "ini": f"[default]\naws_access_key_id={AWS_ID}\naws_secret_access_key = {AWS_SECRET}",
    "flag": f"--aws-secret-key={AWS_SECRET}",
    "yaml_secret": f"secret:{AWS_SECRET}",
    "quoted_after_equals": f'export AWS_SECRET="{AWS_SECRET}"',
    "csv": f"bob,,{AWS_ID},{AWS_SECRET},https://console.aws.amazon.com",
    "space": f"-s {AWS_SECRET}",
}


@pytest.mark.parametrize("name", sorted(HELD_AWS))
def test_aws_secrets_in_ordinary_contexts_are_masked(name: str) -> None:
    out = redact(HELD_AWS[name])
    assert AWS_SECRET not in out and M in out, out


# --- linear time ----------------------------------------------------------------------------


def _backslash_run(size: int) -> tuple[str, str]:
    # An escaped list that never closes, then nothing but backslashes.
    text = 'token: [\\"' + _fill("\\", size)
    return text, "token: [redacted:token]"


def _escaped_lists(size: int) -> tuple[str, str]:
    unit = 'token: [\\"a\\\\\\"]\\", \\"b\\"] '
    count = size // len(unit)
    return unit * count, "token: [redacted:token] " * count


def _quote_flips(size: int) -> tuple[str, str]:
    text = 'token: [\\"' + _fill('"\'\\"\\\\', size)
    return text, "token: [redacted:token]"


def _start_whitespace(size: int) -> tuple[str, str]:
    # A bracket, a long run of whitespace, then no data: refused, so it stays.
    text = _fill("token: [" + " \t\r\n" * 64 + "x]\n", size)
    return text, text


def _random_run_just_out_of_reach(size: int) -> tuple[str, str]:
    # Digit and both cases early; the run of 16 starts past the 160 characters b6f82aa
    # looked at. Its fix reads the body's letters instead (half of them upper case here,
    # as chance gives): a key, masked, each unit once.
    unit = "_" + SK + "proj-" + "aB1-" * 41 + "Abcdefghijklmnop1 "
    count = size // len(unit)
    return unit * count, "_[redacted:openai_key] " * count


def _ipv6_brackets(size: int) -> tuple[str, str]:
    text = _fill("]:aA1/", size)
    return text, text


def _url_escape_short(size: int) -> tuple[str, str]:
    text = _fill("%2F" + SK + "a" * 19 + " ", size)
    return text, text


def _never_closed_then_keys(size: int) -> tuple[str, str]:
    text = 'secret: {"' + _fill('password: ["x ', size)
    return text, "secret: [redacted:secret]"


HOSTILE = {
    "backslash_run": _backslash_run,
    "escaped_lists": _escaped_lists,
    "quote_flips": _quote_flips,
    "start_whitespace": _start_whitespace,
    "random_run_just_out_of_reach": _random_run_just_out_of_reach,
    "ipv6_brackets": _ipv6_brackets,
    "url_escape_short": _url_escape_short,
    "never_closed_then_keys": _never_closed_then_keys,
}


@pytest.mark.parametrize("size", (64 * KIB, 256 * KIB), ids=lambda s: f"{s // KIB}KiB")
@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_b6f82aa_rules_are_exact_on_hostile_input_at_two_sizes(name: str, size: int) -> None:
    text, expected = HOSTILE[name](size)
    with hang_guard():
        out = redact(text)
    assert out == expected
