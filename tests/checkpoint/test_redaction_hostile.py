"""Redaction stays linear on inputs crafted against each pattern, and still masks what it must.

No test here measures speed (``benchmarks/redaction.py`` prints the figures). Each hostile
input is redacted at two sizes, 64 KiB and 256 KiB, and the result must be exactly what the
patterns promise at both sizes; a generous alarm only stops a test that would otherwise hang
(before the fix, the reported input took 16.9 s at 64 KiB and grew with the square of it).
"""

from __future__ import annotations

import signal
import string
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tesserix_adk.checkpoint.redaction import default_redactor

KIB = 1024
SIZES = (64 * KIB, 256 * KIB)
# A hang guard for one 256 KiB input, not a speed target.
DEADLINE_SECONDS = 20.0

# Built from parts so no source line looks like a credential to a scanner.
_PASSWORD = "pw-" + "Zq8" * 4
_SECRET_URL = f"postgres://app:{_PASSWORD}@db.internal/x"
_MASKED_URL = "postgres://app:[redacted:url_password]@db.internal/x"


@contextmanager
def hang_guard(seconds: float = DEADLINE_SECONDS) -> Iterator[None]:
    def expire(signum: int, frame: FrameType | None) -> None:
        raise TimeoutError(f"redaction did not finish within {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _fill(unit: str, size: int) -> str:
    return unit * (size // len(unit))


# name → build(size) -> (input, the exact output redaction must give)
Case = Callable[[int], tuple[str, str]]


def _unchanged_then_url(unit: str) -> Case:
    """Filler no pattern may touch, then a URL whose password must still go."""

    def build(size: int) -> tuple[str, str]:
        filler = _fill(unit, size)
        return f"{filler} {_SECRET_URL}", f"{filler} {_MASKED_URL}"

    return build


def _reported(size: int) -> tuple[str, str]:
    text = "http://x/ " + _fill("a.", size)
    return text, text


def _scheme_run_glued_to_a_url(size: int) -> tuple[str, str]:
    # A scheme-like run as long as the input right before "://": the password still goes.
    filler = _fill("a.", size)
    return f"{filler}{_SECRET_URL}", f"{filler}{_MASKED_URL}"


def _many_at_signs(size: int) -> tuple[str, str]:
    body = _fill("a@", size)
    return f"s://u:{body}", "s://u:[redacted:url_password]@"


def _pem_never_ended(size: int) -> tuple[str, str]:
    label = "A " + "PRIVATE KEY"
    ends = _fill(f"-----END B {'PRIVATE KEY'}-----\n", size)
    return f"x\n-----BEGIN {label}-----\n{ends}", "x\n[redacted:private_key]"


def _github_runs_ending_in_underscore(size: int) -> tuple[str, str]:
    # A token with a word glued after it (``ghp_…_old``) is a token: each is masked.
    unit = "ghp_" + "a" * 40 + "_ "
    n = max(size // len(unit), 1)
    return f"{unit * n}{_SECRET_URL}", "[redacted:github_token]_ " * n + _MASKED_URL


def _bearer_dots(size: int) -> tuple[str, str]:
    return "Bearer " + _fill("a.", size), "Bearer [redacted:bearer]"


def _secret_key_repeated(size: int) -> tuple[str, str]:
    return _fill("secret_key=", size), "secret_key=[redacted:secret]"


def _json_with_a_huge_token(size: int) -> tuple[str, str]:
    return '{"token": "' + _fill("a", size) + '"}', '{"token": "[redacted:token]"}'


def _unclosed_quoted_password(size: int) -> tuple[str, str]:
    return 'password="' + _fill("\\a", size), 'password="[redacted:password]'


def _wrapped_key(size: int) -> tuple[str, str]:
    key = "sk-" + "proj-" + "Ab3" * 10 + _fill("\nxY7Qa1", size)
    return f"key:\n{key}\nend", "key:\n[redacted:openai_key]\nend"


def _closed_lists_under_a_key(size: int) -> tuple[str, str]:
    unit = '{"token": ["a", {"b": "]"}]} '
    count = size // len(unit)
    return unit * count + _SECRET_URL, '{"token": [redacted:token]} ' * count + _MASKED_URL


def _unclosed_lists_under_a_key(size: int) -> tuple[str, str]:
    # Never closed: masked to the end, each character read once.
    return _fill('password: ["a[', size), "password: [redacted:password]"


def _prose_brackets_under_a_key(size: int) -> tuple[str, str]:
    # Not data (a link, a template): the look at each one is a few characters.
    filler = _fill("password: [Don't {{ x }} ", size)
    return f"{filler} {_SECRET_URL}", f"{filler} {_MASKED_URL}"


CASES: dict[str, Case] = {
    "reported_url_then_dots": _reported,
    "scheme_run_glued_to_a_url": _scheme_run_glued_to_a_url,
    "many_schemes": _unchanged_then_url("a://"),
    "many_user_colons": _unchanged_then_url("x://u:"),
    "many_at_signs": _many_at_signs,
    "pem_begins": _unchanged_then_url("-----BEGIN "),
    "pem_begin_labels": _unchanged_then_url("-----BEGIN A A A A "),
    "pem_never_ended": _pem_never_ended,
    "sk_prefixes": _unchanged_then_url("sk-a "),
    "github_run_ending_in_underscore": _github_runs_ending_in_underscore,
    "github_prefixes_glued": _unchanged_then_url("ghp_a"),
    "slack_prefixes": _unchanged_then_url("xoxb-a "),
    "jwt_header_run": _unchanged_then_url("eyJ" + "a" * 50 + " "),
    "jwt_dots": _unchanged_then_url("eyJa.b "),
    "bearer_words": _unchanged_then_url("bearer "),
    "bearer_dots": _bearer_dots,
    "basic_words": _unchanged_then_url("Basic "),
    "basic_base64_run": _unchanged_then_url("Basic QQQQ "),
    "secret_key_repeated": _secret_key_repeated,
    "secret_key_without_values": _unchanged_then_url("secret_key =  \n"),
    "base64_run_without_a_boundary": _unchanged_then_url("aA1/"),
    "base64_words": _unchanged_then_url("aA1/aA1/aA1/aA1/aA1/aA1/aA1/aA1/aA1/aA1/+ "),
    "key_value_pairs": _unchanged_then_url("a=b "),
    "sensitive_words_without_values": _unchanged_then_url("token "),
    "json_literals_under_a_sensitive_key": _unchanged_then_url('"token": 1, '),
    "long_identifier_before_a_separator": _unchanged_then_url("a" * 300 + " "),
    "identifier_run": _unchanged_then_url("a_b-c."),
    "input_values": _unchanged_then_url("input_value="),
    "validation_lines": _unchanged_then_url("x\n  [type=t, input_value="),
    "open_brackets": _unchanged_then_url("["),
    "open_objects": _unchanged_then_url('{"a":'),
    "escaped_newlines": _unchanged_then_url("\\n"),
    "newlines": _unchanged_then_url("\n"),
    "json_with_a_huge_token": _json_with_a_huge_token,
    "unclosed_quoted_password": _unclosed_quoted_password,
    "wrapped_key": _wrapped_key,
    "glued_key_prefixes": _unchanged_then_url("xsk-" + "proj-aA1 "),
    "glued_anthropic_prefixes": _unchanged_then_url("xsk-" + "ant-api03-aA1 "),
    "glued_key_prefixes_without_a_digit": _unchanged_then_url("_sk-" + "proj-" + "aB" * 30 + " "),
    "closed_lists_under_a_key": _closed_lists_under_a_key,
    "unclosed_lists_under_a_key": _unclosed_lists_under_a_key,
    "prose_brackets_under_a_key": _prose_brackets_under_a_key,
}


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s // KIB}KiB")
@pytest.mark.parametrize("name", sorted(CASES))
def test_hostile_input_is_redacted_exactly_at_every_size(name: str, size: int) -> None:
    text, expected = CASES[name](size)
    with hang_guard():
        out = default_redactor().text(text)
    assert out == expected


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s // KIB}KiB")
def test_hostile_strings_deep_in_data_are_redacted_too(size: int) -> None:
    text, expected = CASES["reported_url_then_dots"](size)
    url_text, url_expected = CASES["many_schemes"](size)
    with hang_guard():
        out = default_redactor().value({"result": [text, {"note": url_text}]})
    assert out == {"result": [expected, {"note": url_expected}]}


# Fragments each pattern keys on; random mixes of them find inputs nobody thought of.
_FRAGMENTS = [
    "sk-",
    "sk-ant-",
    "proj-",
    "ghp_",
    "github_pat_",
    "xoxb-",
    "AKIA",
    "eyJ",
    ".",
    "Bearer ",
    "Basic ",
    "://",
    "@",
    ":",
    "=",
    '"',
    "'",
    "\\",
    "\\n",
    "\n",
    " ",
    "-----BEGIN ",
    "PRIVATE KEY-----",
    "-----END ",
    "token",
    "password",
    "secret_key",
    "input_value=",
    ", input_type=",
    "{",
    "}",
    "[",
    "]",
    "a",
    "Z9/+",
]
_mixes = st.lists(
    st.one_of(
        st.sampled_from(_FRAGMENTS), st.text(string.ascii_letters + string.digits, max_size=8)
    ),
    max_size=60,
).map("".join)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_mixes)
def test_redaction_of_any_mix_is_idempotent_and_keeps_placeholders(text: str) -> None:
    r = default_redactor()
    once = r.text(text)
    assert r.text(once) == once


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_mixes.filter(bool))
def test_a_mix_repeated_to_64_kib_finishes_and_still_masks_a_url_after_it(unit: str) -> None:
    # After a blank line, so no fragment glues onto the url (a cut-short PEM block may still
    # swallow it: masked either way).
    text = _fill(unit, 64 * KIB) + "\n\n " + _SECRET_URL
    with hang_guard():
        out = default_redactor().text(text)
    assert _PASSWORD not in out
