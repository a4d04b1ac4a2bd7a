"""Redaction masks every secret kind it knows, in text and deep in data, and nothing else."""

from __future__ import annotations

import base64
import copy
import hashlib
import json
import random
import string
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from tesserix_adk.checkpoint.redaction import Redactor, default_redactor
from tesserix_adk.errors import ConfigurationError
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.stores.urls import open_stores
from tesserix_adk.testing.secrets import (
    PlantedSecretsSuite,
    leaked,
    leaked_secrets,
    planted_cases,
    planted_secrets,
)

# Fake secrets, generated so no source line looks like a real token to a secret scanner.
_rng = random.Random(7)
_ALNUM = string.ascii_letters + string.digits


def _pick(alphabet: str, n: int) -> str:
    return "".join(_rng.choice(alphabet) for _ in range(n))


def _same(secret: str) -> tuple[str, str]:
    """A sample whose planted text is all secret."""
    return (secret, secret)


def _strings(data: Any) -> str:
    """Every string in ``data``, joined, so a secret with newlines is found as it is."""
    if isinstance(data, str):
        return data
    if isinstance(data, dict):
        return "\n".join(_strings(k) + "\n" + _strings(v) for k, v in data.items())
    if isinstance(data, list | tuple):
        return "\n".join(_strings(item) for item in data)
    return ""


def _b64url(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii")


_PEM_BODY = "\n".join(_pick(_ALNUM + "+/", 64) for _ in range(4))
_PEM_LABEL = "EC " + "PRIVATE KEY"
_URL_PASSWORD = "s3cr3t-" + _pick(_ALNUM, 10)
_BEARER_TOKEN = "tok_" + _pick(_ALNUM, 30)
_BASIC = base64.b64encode(f"report:{_pick(_ALNUM, 14)}".encode()).decode()

# kind → (text to plant, the part that must disappear)
SAMPLES: dict[str, tuple[str, str]] = {
    "openai_key": _same("sk-" + _pick(_ALNUM, 48)),
    "anthropic_key": _same("sk-" + "ant-api03-" + _pick(_ALNUM + "-_", 90) + "AA"),
    "bearer": (f"Bearer {_BEARER_TOKEN}", _BEARER_TOKEN),
    "basic_auth": (f"Basic {_BASIC}", _BASIC),
    "aws_access_key_id": _same("AS" + "IA" + _pick(string.ascii_uppercase + string.digits, 16)),
    "aws_secret_key": _same("Zk9q" + _pick(_ALNUM, 16) + "/x+Q" + _pick(_ALNUM, 12) + "Ab1c"),
    "github_token": _same("gh" + "s_" + _pick(_ALNUM, 36)),
    "slack_token": _same("xo" + "xp-" + _pick(string.digits, 11) + "-" + _pick(_ALNUM, 20)),
    "jwt": _same(
        _b64url(b'{"alg":"RS256","typ":"JWT"}')
        + "."
        + _b64url(b'{"sub":"42","scope":"admin"}')
        + "."
        + _pick(_ALNUM + "-_", 86)
    ),
    "private_key": (
        f"-----BEGIN {_PEM_LABEL}-----\n{_PEM_BODY}\n-----END {_PEM_LABEL}-----",
        _PEM_BODY,
    ),
    "url_password": (f"mysql://reporter:{_URL_PASSWORD}@10.0.0.7:3306/sales", _URL_PASSWORD),
}
KINDS = sorted(SAMPLES)


def test_every_sample_is_the_length_its_kind_needs() -> None:
    assert len(SAMPLES["aws_secret_key"][0]) == 40
    assert len(SAMPLES["aws_access_key_id"][0]) == 20


@pytest.mark.parametrize("kind", KINDS)
def test_every_builtin_kind_is_masked_in_text_and_named(kind: str) -> None:
    planted, secret = SAMPLES[kind]
    out = default_redactor().text(f"please use {planted} for this.")
    assert secret not in out
    assert f"[redacted:{kind}]" in out
    assert out.startswith("please use ") and out.endswith(" for this.")


@pytest.mark.parametrize("kind", KINDS)
def test_every_builtin_kind_is_masked_deep_inside_nested_data(kind: str) -> None:
    planted, secret = SAMPLES[kind]
    data = {"outer": [{"inner": {"note": f"x {planted} y", "n": 3}}, ("t", planted)]}
    out = default_redactor().value(data)
    assert secret not in _strings(out)
    assert secret in _strings(data)
    assert f"[redacted:{kind}]" in out["outer"][0]["inner"]["note"]
    assert out["outer"][0]["inner"]["n"] == 3
    assert f"[redacted:{kind}]" in out["outer"][1][1]


def test_several_secrets_in_one_string_are_all_masked() -> None:
    text = " | ".join(planted for planted, _ in SAMPLES.values())
    out = default_redactor().text(text)
    for kind, (_, secret) in SAMPLES.items():
        assert secret not in out, kind
        assert f"[redacted:{kind}]" in out


def test_url_password_goes_but_user_and_host_stay() -> None:
    out = default_redactor().text(SAMPLES["url_password"][0])
    assert out == "mysql://reporter:[redacted:url_password]@10.0.0.7:3306/sales"


def test_url_password_with_an_empty_user_or_an_at_sign_goes_whole() -> None:
    r = default_redactor()
    assert (
        r.text("redis://:hunter22@cache:6379/0") == "redis://:[redacted:url_password]@cache:6379/0"
    )
    assert r.text("postgres://u:p@ss@db/x") == "postgres://u:[redacted:url_password]@db/x"


def test_urls_without_a_password_are_left_alone() -> None:
    r = default_redactor()
    for url in [
        "https://example.com:8443/path?user=a@b.example",
        "ssh://git@github.com/org/repo.git",
        "mailto:someone@example.com",
    ]:
        assert r.text(url) == url


def test_bearer_keeps_the_word_and_masks_the_token() -> None:
    r = default_redactor()
    assert r.text(SAMPLES["bearer"][0]) == "Bearer [redacted:bearer]"
    assert r.text("authorization: bearer abc.def-123_xyz==") == (
        "authorization: bearer [redacted:bearer]"
    )


def test_a_jwt_after_bearer_is_named_as_a_jwt() -> None:
    out = default_redactor().text("Bearer " + SAMPLES["jwt"][0])
    assert out == "Bearer [redacted:jwt]"


def test_anthropic_and_project_keys_get_their_own_labels() -> None:
    r = default_redactor()
    assert r.text(SAMPLES["anthropic_key"][0]) == "[redacted:anthropic_key]"
    assert r.text("sk-" + "proj-" + _pick(_ALNUM + "_-", 60)) == "[redacted:openai_key]"


def test_aws_secret_key_next_to_a_hint_is_masked_even_without_slash_or_plus() -> None:
    value = _pick(string.ascii_lowercase, 20) + _pick(string.ascii_uppercase, 20)
    r = default_redactor()
    for line in [
        f"aws_secret_access_key={value}",
        f'AWS_SECRET_ACCESS_KEY: "{value}"',
        f"secret_access_key = '{value}'",
    ]:
        out = r.text(line)
        assert value not in out
        assert "[redacted:aws_secret_key]" in out


def test_aws_secret_key_right_after_its_key_id_is_masked_even_without_slash_or_plus() -> None:
    key_id = SAMPLES["aws_access_key_id"][0]
    value = _pick(string.ascii_lowercase, 20) + _pick(string.digits + string.ascii_uppercase, 20)
    r = default_redactor()
    # s3fs's password file, a credentials CSV's row, the two on one line.
    for line in [f"{key_id}:{value}", f",,{key_id},{value}", f"{key_id} {value}"]:
        out = r.text(line)
        assert value not in out and key_id not in out, out
        assert out.count("[redacted:aws_") == 2, out
    # Prose after a key id, and a longer run, are not a secret key.
    prose = f"{key_id} is the access key id the documentation uses as its example"
    assert r.text(prose).endswith(" is the access key id the documentation uses as its example")
    assert value + "x" in r.text(f"{key_id} {value}x")


def test_a_github_token_glued_to_a_name_is_masked() -> None:
    token = "ghp_" + _pick(string.ascii_letters, 30) + "7" + _pick(_ALNUM, 5)
    r = default_redactor()
    assert r.text(f"lookup_{token}") == "lookup_[redacted:github_token]"
    assert r.text(f"lookup_{token}_v2") == "lookup_[redacted:github_token]_v2"
    assert r.text(f"{token}_old") == "[redacted:github_token]_old"
    assert r.text(f"GH_TOKEN={token}") == "GH_TOKEN=[redacted:github_token]"
    # A word glued the same way is no token: glued, the 36 characters need a digit.
    word = "fetch_ghs_ClassificationAndLabellingOfChemicals"
    assert r.text(word) == word


def test_an_aws_key_pair_as_a_mapping_masks_its_secret() -> None:
    key_id = SAMPLES["aws_access_key_id"][0]
    secret = _pick(string.ascii_letters, 40)  # no digit, no / or +: only the pair tells
    r = default_redactor()
    assert r.value({key_id: secret}) == {
        "[redacted:aws_access_key_id]": "[redacted:aws_secret_key]"
    }
    as_text = r.text(json.dumps({key_id: secret}))
    assert secret not in as_text and key_id not in as_text
    # A key id over a value of another shape keeps the value.
    assert r.value({key_id: "active"}) == {"[redacted:aws_access_key_id]": "active"}


def test_github_fine_grained_tokens_are_masked() -> None:
    token = "github_" + "pat_" + _pick(_ALNUM, 22) + "_" + _pick(_ALNUM, 59)
    assert default_redactor().text(token) == "[redacted:github_token]"


def test_pem_block_is_masked_whole_across_lines() -> None:
    planted = SAMPLES["private_key"][0]
    out = default_redactor().text(f"key:\n{planted}\nend of file")
    assert out == "key:\n[redacted:private_key]\nend of file"


def test_a_pem_block_cut_short_is_masked_to_the_end() -> None:
    out = default_redactor().text(f"-----BEGIN {_PEM_LABEL}-----\n{_PEM_BODY[:100]}")
    assert out == "[redacted:private_key]"


def test_hex_digests_are_not_masked() -> None:
    sha256 = hashlib.sha256(b"agent").hexdigest()
    git_sha = hashlib.sha1(b"commit").hexdigest()
    text = f"revision sha256:{sha256} at commit {git_sha} ({git_sha.upper()})"
    assert default_redactor().text(text) == text


def test_ordinary_text_is_left_alone() -> None:
    r = default_redactor()
    for text in [
        "",
        "hi",
        "sk-learn is a python library; ask-me-anything",
        "a Bearer token is sent by the bearer of the token.",
        "Bearer authentication needs TLS.",
        "the eyJ prefix starts a JWT header",
        "AKIA is the prefix of an access key id",
        "path /usr/local/lib/python3/site-packages/pkg/module/x.py",
        "booking ref LH123 on 2024-05-01, seat 14C",
    ]:
        assert r.text(text) == text


_SENSITIVE_KEYS = [
    "password",
    "Password",
    "PASSWORD",
    "secret",
    "client_secret",
    "token",
    "access_token",
    "refresh_token",
    "api_key",
    "apikey",
    "X-Api-Key",
    "x_api_key",
    "authorization",
    "Authorization",
    "cookie",
    "Set-Cookie",
    "db_password",
    "DB-Password",
    "private_key",
]


@pytest.mark.parametrize("key", _SENSITIVE_KEYS)
@pytest.mark.parametrize("value", ["hunter2", "[redacted:jwt]x", " "])
def test_a_string_under_a_sensitive_key_is_masked_whatever_it_looks_like(
    key: str, value: str
) -> None:
    out = default_redactor().value({"data": [{key: value, "other": "kept"}]})
    masked = out["data"][0][key]
    assert masked.startswith("[redacted:") and masked.endswith("]") and value not in masked
    assert out["data"][0]["other"] == "kept"


@pytest.mark.parametrize("key", _SENSITIVE_KEYS)
def test_under_a_sensitive_key_strings_go_and_the_shape_stays(key: str) -> None:
    value = {"nested": "v", "n": 7, "list": ["a", 2, None, True], "empty": ""}
    out = default_redactor().value({key: value})[key]
    assert set(out) == set(value)
    assert out["nested"].startswith("[redacted:") and out["list"][0] == out["nested"]
    assert out["n"] == 7 and out["list"][1:] == [2, None, True] and out["empty"] == ""


@pytest.mark.parametrize("key", _SENSITIVE_KEYS)
@pytest.mark.parametrize("value", [1234, 3.5, 0, None, True, False, ""])
def test_numbers_booleans_none_and_empty_strings_under_a_sensitive_key_stay(
    key: str, value: Any
) -> None:
    # They carry no credential worth masking, and masking them would break a typed state.
    data = {key: value}
    assert default_redactor().value(data) == data
    assert default_redactor().changed(data) is False


@pytest.mark.parametrize(
    ("key", "kind"),
    [
        ("Password", "password"),
        ("db_password", "password"),
        ("client_secret", "secret"),
        ("x-auth-token", "token"),
        ("refresh_token", "token"),
        ("X-API-KEY", "api_key"),
        ("apikey", "api_key"),
        ("Authorization", "authorization"),
        ("set-cookie", "cookie"),
    ],
)
def test_sensitive_key_placeholder_names_the_kind(key: str, kind: str) -> None:
    assert default_redactor().value({key: "x"}) == {key: f"[redacted:{kind}]"}


@pytest.mark.parametrize(
    "key",
    [
        "input_tokens",
        "output_tokens",
        "max_tokens",
        "max_new_tokens",
        "cache_read_input_tokens",
        "token_count",
        "secretary",
        "password_hint",
        "cookies_enabled",
        "author",
        "key",
        "x-",
    ],
)
def test_keys_that_only_contain_a_sensitive_word_are_left_alone(key: str) -> None:
    data = {key: 1200, "nested": {key: "plain"}}
    assert default_redactor().value(data) == data


def test_none_and_booleans_under_sensitive_keys_stay() -> None:
    data = {"password": None, "cookie": False, "token": True}
    assert default_redactor().value(data) == data


def test_string_keys_are_redacted_too() -> None:
    key = SAMPLES["github_token"][0]
    assert default_redactor().value({key: 1}) == {"[redacted:github_token]": 1}


def test_bytes_are_never_touched() -> None:
    blob = f"Bearer {_BEARER_TOKEN}".encode()
    raw = bytearray(blob)
    r = default_redactor()
    assert r.value(blob) is blob
    out = r.value({"image": blob, "buf": raw, "parts": [blob], "password": "x"})
    assert out["image"] is blob
    assert out["buf"] is raw
    assert out["parts"][0] is blob
    assert out["password"] == "[redacted:password]"


def test_numbers_and_none_pass_through() -> None:
    data = {"a": 1, "b": 2.5, "c": None, "d": True, "e": [0, -1]}
    assert default_redactor().value(data) == data


def test_extra_patterns_are_masked_as_custom() -> None:
    r = Redactor(extra_patterns=(r"ACME-\d{6}", r"(?i)internal-[a-z]+"))
    out = r.text("ticket ACME-123456 on Internal-Billing, not ACME-12")
    assert out == "ticket [redacted:custom] on [redacted:custom], not ACME-12"
    assert r.value({"k": ["ACME-000001"]}) == {"k": ["[redacted:custom]"]}


def test_extra_patterns_add_to_the_builtins() -> None:
    r = Redactor(extra_patterns=(r"ACME-\d{6}",))
    out = r.text(f"ACME-123456 {SAMPLES['github_token'][0]}")
    assert out == "[redacted:custom] [redacted:github_token]"


def test_extra_patterns_never_eat_into_a_placeholder() -> None:
    r = Redactor(extra_patterns=(r"redacted", r"\[[^\]]*\]", r"x*"))
    once = r.text(f"{SAMPLES['openai_key'][0]} [note] xx")
    assert once == "[redacted:openai_key] [redacted:custom] [redacted:custom]"
    assert r.text(once) == once


def test_extra_patterns_given_as_a_list_are_kept_as_a_tuple() -> None:
    r = Redactor(extra_patterns=[r"ACME-\d+"])  # type: ignore[arg-type]
    assert r.extra_patterns == (r"ACME-\d+",)
    assert r == Redactor(extra_patterns=(r"ACME-\d+",))


def test_an_invalid_extra_pattern_is_refused_when_the_redactor_is_built() -> None:
    with pytest.raises(ConfigurationError, match=r"extra_patterns\[1\]"):
        Redactor(extra_patterns=("ok", "(unclosed"))


def test_a_single_string_is_not_taken_for_a_tuple_of_patterns() -> None:
    with pytest.raises(ConfigurationError):
        Redactor(extra_patterns="ACME")  # type: ignore[arg-type]


def test_a_disabled_redactor_keeps_everything() -> None:
    r = Redactor(enabled=False, extra_patterns=("ACME",))
    data = {"password": "hunter2", "note": [SAMPLES["jwt"][0], "ACME"]}
    assert r.value(data) is data
    assert r.text(SAMPLES["bearer"][0]) == SAMPLES["bearer"][0]
    assert r.changed(data) is False


def test_input_is_not_mutated_and_output_is_a_new_structure() -> None:
    data: dict[str, Any] = {
        "args": {"password": "pw", "items": [{"t": SAMPLES["slack_token"][0]}], "tup": (1, "a")},
        "plain": ["a", {"b": "c"}],
    }
    before = copy.deepcopy(data)
    out = default_redactor().value(data)
    assert data == before
    assert out is not data
    assert out["plain"] is not data["plain"]
    assert out["plain"][1] is not data["plain"][1]
    assert out["args"]["tup"] == [1, "a"]  # tuples come back as lists: the output is JSON-bound


@pytest.mark.parametrize("kind", KINDS)
def test_redaction_is_idempotent(kind: str) -> None:
    r = Redactor(extra_patterns=(r"ACME-\d+",))
    planted, _ = SAMPLES[kind]
    data = {"msg": f"a {planted} b ACME-1", "token": "t", "list": [planted]}
    once = r.value(data)
    assert r.value(once) == once
    assert r.text(once["msg"]) == once["msg"]
    assert r.changed(once) is False


def test_changed_says_whether_anything_was_masked() -> None:
    r = default_redactor()
    assert r.changed({"q": "hello", "n": [1, 2]}) is False
    assert r.changed(("a", ("b",))) is False  # tuples becoming lists is not a change
    assert r.changed({"q": [f"call with {SAMPLES['openai_key'][0]}"]}) is True
    assert r.changed({"api_key": "5"}) is True
    assert r.changed({"api_key": 5}) is False
    assert r.changed(SAMPLES["aws_access_key_id"][0]) is True
    assert r.changed(b"Bearer " + _BEARER_TOKEN.encode()) is False


def test_default_redactor_has_the_builtin_patterns_only() -> None:
    r = default_redactor()
    assert r == Redactor()
    assert r.extra_patterns == ()
    assert r.enabled is True


def test_planted_secrets_cover_every_builtin_kind_and_all_get_masked() -> None:
    planted = planted_secrets()
    assert sorted(planted) == KINDS
    assert planted == planted_secrets()  # the same values every call
    stored = json.dumps(
        default_redactor().value({"state": planted, "text": list(planted.values())})
    )
    assert leaked_secrets(stored) == []
    for kind in KINDS:
        assert f"[redacted:{kind}]" in stored


def test_leaked_secrets_finds_planted_secrets_raw_or_json_escaped() -> None:
    planted = planted_secrets()
    assert sorted(leaked_secrets(json.dumps(planted).encode())) == KINDS
    assert leaked_secrets(planted["private_key"]) == ["private_key"]
    assert leaked_secrets("nothing here") == []


# --- coverage users expect ---------------------------------------------------------------

_LONG_KEY = "sk-" + "proj-" + _pick(_ALNUM, 64)
_WRAPPED_TAIL = [_pick(_ALNUM, 39) + "7", _pick(_ALNUM, 30) + "9"]
_WRAPPED_KEY = "\n".join([_LONG_KEY, *_WRAPPED_TAIL])


@pytest.mark.parametrize("newline", ["\n", "\r\n"])
def test_a_key_wrapped_across_lines_is_masked_with_every_line(newline: str) -> None:
    wrapped = _WRAPPED_KEY.replace("\n", newline)
    out = default_redactor().text(f"use this key:{newline}{wrapped}{newline}Thanks, Ann")
    assert out == f"use this key:{newline}[redacted:openai_key]{newline}Thanks, Ann"


def test_a_key_wrapped_inside_a_json_string_is_masked_with_every_line() -> None:
    result = json.dumps({"note": _WRAPPED_KEY, "n": 1})
    out = default_redactor().text(result)
    assert json.loads(out) == {"note": "[redacted:openai_key]", "n": 1}
    # Also when the JSON text is not parsed as such (cut short, or inside a log line).
    line = default_redactor().text("tool said: " + result[:-1])
    assert all(part not in line for part in _WRAPPED_TAIL)


def test_a_wrapped_key_whose_first_line_is_short_is_masked_too() -> None:
    out = default_redactor().text("sk-" + "proj-\n" + _WRAPPED_TAIL[0] + "\nbye")
    assert out == "[redacted:openai_key]\nbye"


def test_a_pem_block_inside_json_text_is_masked() -> None:
    planted, body = SAMPLES["private_key"]
    r = default_redactor()
    for text in [json.dumps({"config": planted}), "raw: " + json.dumps(planted)]:
        out = r.text(text)
        assert all(line not in out for line in body.splitlines())
        assert "[redacted:private_key]" in out


@pytest.mark.parametrize(
    ("key", "kind"),
    [
        ("accessToken", "token"),
        ("AccessToken", "token"),
        ("idToken", "token"),
        ("clientSecret", "secret"),
        ("openai_api_key", "api_key"),
        ("OPENAI_API_KEY", "api_key"),
        ("openAIApiKey", "api_key"),
        ("x-api-key", "api_key"),
        ("api-key", "api_key"),
        ("apiKey", "api_key"),
        ("authorization", "authorization"),
        ("Proxy-Authorization", "authorization"),
        ("github_token", "token"),
        ("db.password", "password"),
        ("aws_secret_access_key", "secret"),
        ("SecretAccessKey", "secret"),
        ("credentials", "secret"),
        ("passphrase", "password"),
        ("MYSQL_PWD", "password"),
        ("db_pwd", "password"),
    ],
)
def test_key_names_users_expect_are_sensitive_in_data_json_text_and_free_text(
    key: str, kind: str
) -> None:
    r = default_redactor()
    placeholder = f"[redacted:{kind}]"
    assert r.value({key: "hunter2"}) == {key: placeholder}
    assert json.loads(r.text(json.dumps({key: "hunter2", "n": 1}))) == {key: placeholder, "n": 1}
    assert r.text(f"{key}=hunter2&page=2") == f"{key}={placeholder}&page=2"
    assert r.text(f"{key}: hunter2\nnext") == f"{key}: {placeholder}\nnext"
    assert r.text(f"{{'{key}': 'hunter2', 'n': 1}}") == f"{{'{key}': '{placeholder}', 'n': 1}}"


@pytest.mark.parametrize(
    "key",
    [
        "inputTokens",
        "max_tokens",
        "passwordHint",
        "tokenizer",
        "secretary",
        "nextToken",
        "next_page_token",
        "pageToken",
        "monkey",
        "keyboard",
        "PWD",
        "OLDPWD",
        "boarding_pass",
    ],
)
def test_names_that_only_look_sensitive_stay_in_data_and_free_text(key: str) -> None:
    r = default_redactor()
    assert r.value({key: "plain-value"}) == {key: "plain-value"}
    assert r.text(f"{key}=plain-value") == f"{key}=plain-value"


def test_authorization_headers_keep_their_scheme() -> None:
    r = default_redactor()
    basic = base64.b64encode(b"user:pass").decode()
    assert r.text(f"Authorization: Basic {basic}") == "Authorization: Basic [redacted:basic_auth]"
    assert r.text(f"curl -H 'Authorization: Basic {basic}' x") == (
        "curl -H 'Authorization: Basic [redacted:basic_auth]' x"
    )
    assert r.value({"headers": {"Authorization": f"Basic {basic}"}}) == {
        "headers": {"Authorization": "[redacted:authorization]"}
    }
    # A scheme with a short token, or one nobody knows, still loses the token.
    assert r.text("Authorization: Bearer abc\nHost: x") == (
        "Authorization: Bearer [redacted:authorization]\nHost: x"
    )
    assert r.text("authorization: Digest username=a, response=b\n") == (
        "authorization: Digest [redacted:authorization]\n"
    )
    assert r.text("Basic authentication needs TLS.") == "Basic authentication needs TLS."


def test_header_lines_with_api_keys_and_cookies_are_masked() -> None:
    r = default_redactor()
    text = "X-Api-Key: abc123def\napi-key: 42\nCookie: sid=abc; theme=dark\nAccept: */*"
    assert r.text(text) == (
        "X-Api-Key: [redacted:api_key]\napi-key: [redacted:api_key]\n"
        "Cookie: [redacted:cookie]\nAccept: */*"
    )


def test_json_inside_a_string_value_is_masked_by_key_and_stays_json_text() -> None:
    inner = json.dumps({"user": "ann", "password": "hunter2", "tries": 3}, indent=2)
    out = default_redactor().value({"result": inner, "list": [inner]})
    for text in (out["result"], out["list"][0]):
        assert "hunter2" not in text
        assert json.loads(text) == {"user": "ann", "password": "[redacted:password]", "tries": 3}
    # Only the masked string changed; the layout is the tool's own.
    assert out["result"] == inner.replace('"hunter2"', '"[redacted:password]"')


def test_json_text_nested_in_json_text_is_masked_at_every_level() -> None:
    inner = json.dumps({"token": "t0k3n-value"})
    outer = json.dumps({"body": inner, "secret": {"k": ["a", 1]}})
    out = default_redactor().text(outer)
    assert json.loads(json.loads(out)["body"]) == {"token": "[redacted:token]"}
    assert json.loads(out)["secret"] == {"k": ["[redacted:secret]", 1]}


@pytest.mark.parametrize(
    "text",
    [
        '{"token":"a","token":"hunter2-secret"}',
        '{"token":"hunter2-secret","token":"[redacted:token]"}',
        '{"token":"hunter2-secret","token":null}',
        '{"password":"hunter2-secret","password":1}',
        '[{"note":"x","api_key":"hunter2-secret","api_key":"b"}]',
    ],
)
def test_every_duplicate_of_a_key_in_json_text_is_masked(text: str) -> None:
    # A parser keeps only the last duplicate, so judging the text by what json.loads returns
    # lets the others through; the text itself is masked, duplicates and all.
    out = default_redactor().text(text)
    assert "hunter2" not in out
    pairs = json.loads(out, object_pairs_hook=list)
    assert json.dumps(json.loads(text, object_pairs_hook=list)).count('"') == json.dumps(
        pairs
    ).count('"')


def test_numbers_and_literals_under_a_sensitive_key_in_json_text_stay() -> None:
    text = '{"token": 42, "password": null, "secret": true, "api_key": ""}'
    assert default_redactor().text(text) == text


def test_anthropic_and_project_keys_are_masked_in_every_setting() -> None:
    r = default_redactor()
    anthropic = SAMPLES["anthropic_key"][0]
    for planted, kind in [(_LONG_KEY, "openai_key"), (anthropic, "anthropic_key")]:
        assert r.text(f"OPENAI_API_KEY={planted}") == f"OPENAI_API_KEY=[redacted:{kind}]"
        assert r.value({"cfg": f'{{"k": "{planted}"}}'}) == {"cfg": f'{{"k": "[redacted:{kind}]"}}'}


# --- a typed state stays resumable ------------------------------------------------------


def test_a_typed_state_with_secret_named_fields_round_trips_through_redaction() -> None:
    from dataclasses import asdict, dataclass

    from pydantic import BaseModel, TypeAdapter

    class State(BaseModel):
        token: int
        password: str | None = None
        secret: bool = False
        api_key: str = ""
        credentials: dict[str, str | int] = {}
        note: str = ""

    state = State(token=42, password="hunter2", credentials={"user": "ann", "pin": 1234})
    out = default_redactor().value(state.model_dump(mode="json"))
    back = State.model_validate(out)
    assert back.token == 42 and back.secret is False and back.api_key == ""
    assert back.password == "[redacted:password]"
    assert back.credentials == {"user": "[redacted:secret]", "pin": 1234}

    @dataclass
    class Counters:
        token: int
        refresh_token: float | None
        cookie: bool

    plain = Counters(token=7, refresh_token=None, cookie=True)
    assert TypeAdapter(Counters).validate_python(default_redactor().value(asdict(plain))) == plain


# --- free text: log lines, errors, validation messages ----------------------------------


def test_log_lines_and_error_messages_are_masked_as_free_text() -> None:
    r = default_redactor()
    line = (
        "provider call failed: 401 for https://api.example/v1?api_key=abc123&model=m "
        "headers={'x-api-key': 'abc123', 'Accept': 'json'} password=hunter2"
    )
    out = r.text(line)
    assert "abc123" not in out and "hunter2" not in out
    assert "model=m" in out and "'Accept': 'json'" in out


def test_a_pydantic_validation_message_never_quotes_a_secret() -> None:
    from pydantic import BaseModel, ValidationError

    class Creds(BaseModel):
        password: int
        nested: dict[str, int] = {}
        label: int = 0

    with pytest.raises(ValidationError) as caught:
        Creds(
            password="hunter2" * 10,  # type: ignore[arg-type]
            nested={"token": _LONG_KEY},  # type: ignore[dict-item]
            label=SAMPLES["anthropic_key"][0],  # type: ignore[arg-type]
        )
    message = str(caught.value)
    assert "hunter2" in message and _LONG_KEY[:20] in message  # pydantic quotes them
    out = default_redactor().text(message)
    assert "hunter2" not in out
    # pydantic cuts long values to a head and a tail: neither may survive.
    for secret in (_LONG_KEY, SAMPLES["anthropic_key"][0]):
        assert secret[:12] not in out and secret[-12:] not in out
    assert "input_value='[redacted:password]'" in out
    assert "1 validation error" in out or "3 validation errors" in out


def test_a_pydantic_argument_error_is_masked_by_field_name() -> None:
    from pydantic import BaseModel, ValidationError

    class LoginArgs(BaseModel):
        user: str
        password: int
        retries: int = 0

    with pytest.raises(ValidationError) as caught:
        LoginArgs.model_validate({"user": "ann", "password": "hunter2", "retries": "x"})
    # As the tool layer words it, with the arguments the model sent.
    message = f"invalid arguments for login: {caught.value}"
    out = default_redactor().text(message)
    assert "hunter2" not in out and "input_value='[redacted:password]'" in out
    assert "input_value='x'" in out  # an ordinary field keeps its input


# --- the planted-secrets suite a store runs ---------------------------------------------


def test_every_planted_case_is_masked_by_the_redactor() -> None:
    r = default_redactor()
    cases = planted_cases()
    assert len({c.name for c in cases}) == len(cases)
    for case in cases:
        assert case.found_in(json.dumps(case.planted)), case.name  # the check can fail
        out = r.value(case.planted) if isinstance(case.planted, dict) else r.text(case.planted)
        assert leaked(json.dumps(out), (case,)) == [], case.name


class TestPlantedSecretsOnMemoryStores(PlantedSecretsSuite):
    @pytest.fixture
    def planted_stores(self) -> Stores:
        return open_stores("memory://")


class TestPlantedSecretsOnSqlite(PlantedSecretsSuite):
    @pytest.fixture
    async def planted_stores(self, tmp_path: Any) -> AsyncIterator[Stores]:
        stores = open_stores(f"sqlite:///{tmp_path}/planted.db")
        await stores.create_schema()
        yield stores
        await stores.aclose()

    async def raw_bytes(self, stores: Any, tenant: str, run_id: str) -> bytes:
        # The database file and its write-ahead log, as they lie on disk.
        path = Path(str(stores.url).removeprefix("sqlite:///").split("?")[0])
        files = [path, path.with_name(path.name + "-wal")]
        return b"".join(f.read_bytes() for f in files if f.exists())


@pytest.mark.redis
class TestPlantedSecretsOnRedis(PlantedSecretsSuite):
    @pytest.fixture
    async def planted_stores(self) -> AsyncIterator[Stores]:
        from adapters.services import redis_stores

        async with redis_stores() as stores:
            yield stores


@pytest.mark.postgres
class TestPlantedSecretsOnPostgres(PlantedSecretsSuite):
    @pytest.fixture
    async def planted_stores(self) -> AsyncIterator[Stores]:
        from adapters.services import postgres_stores

        async with postgres_stores() as stores:
            yield stores


def test_a_header_written_where_a_password_value_would_be_keeps_its_own_mask() -> None:
    # Found by the property against the earlier redactor: the password rule took the word
    # "Authorization:" as its value, and the header's value then had no key to mask it.
    masked = Redactor().text("password=Authorization: Zk3-q9sekret")
    assert "Zk3-q9sekret" not in masked
    assert masked == "password=Authorization: [redacted:authorization]"
    assert Redactor().text("password=hunter2xx next") == "password=[redacted:password] next"


def test_text_parts_of_a_message_are_masked_as_the_one_text_they_make() -> None:
    from tesserix_adk.checkpoint.payload.redacting import _redacted_message
    from tesserix_adk.messages import BinaryPart, Message, TextPart

    key = "sk-proj-" + "Ab3" * 10
    split = Message.user(
        [TextPart(text="my key is " + key[:12]), TextPart(text=key[12:]), TextPart(text="!")]
    )
    (whole,) = _redacted_message(split, Redactor())["content"]
    assert whole == {"type": "text", "text": "my key is [redacted:openai_key]!"}
    # Parts with nothing across them keep their shape; a binary part ends a run of text.
    plain = Message.user(
        [
            TextPart(text="hello "),
            TextPart(text="world"),
            BinaryPart(data=b"\x89PNG", media_type="image/png"),
            TextPart(text=key[:12]),
        ]
    )
    parts = _redacted_message(plain, Redactor())["content"]
    assert [p.get("text") for p in parts] == ["hello ", "world", None, key[:12]]


# As long as issued keys are (well past the 40 characters a glued one needs).
_GLUED_OPENAI = "sk-" + "proj-" + _pick(_ALNUM, 60) + "a1B"
_GLUED_ANTHROPIC = "sk-" + "ant-api03-" + _pick(_ALNUM, 60) + "a1B"


@pytest.mark.parametrize("before", ["call_", "x", "id-", "7"])
def test_a_key_glued_to_the_word_before_it_is_masked(before: str) -> None:
    """A model's call id (``call_sk-proj-…``) or a key pasted onto a word."""
    r = default_redactor()
    text = f"ids {before}{_GLUED_OPENAI} and {before}{_GLUED_ANTHROPIC} end"
    assert r.text(text) == (
        f"ids {before}[redacted:openai_key] and {before}[redacted:anthropic_key] end"
    )


def test_slugs_and_words_that_hold_a_key_prefix_stay() -> None:
    r = default_redactor()
    for text in [
        "flask-ant-design-components-for-react-2024",
        "desk-proj-management-tool-for-small-teams-2024-abcdefgh",
        "task-ask-ant-colony-simulation-with-many-agents-2024",
        "kiosk-proj-" + "Alpha" * 8,  # no digit: not a key's random part
    ]:
        assert r.text(text) == text


@pytest.mark.parametrize("prefix", ["b", "B", "rb", "u", "f"])
def test_a_python_string_prefix_opens_the_value_under_a_credential_key(prefix: str) -> None:
    """A bytes (or other prefixed) literal in a repr: the quoted value goes, not the prefix."""
    r = default_redactor()
    text = f"login refused for {{'user': 'bob', 'password': {prefix}'hunter2'}}"
    assert r.text(text) == (
        f"login refused for {{'user': 'bob', 'password': {prefix}'[redacted:password]'}}"
    )
    assert r.text(f'token={prefix}"abc" rest') == f'token={prefix}"[redacted:token]" rest'


def test_a_list_or_object_under_a_credential_key_in_free_text_goes_whole() -> None:
    r = default_redactor()
    text = (
        'HTTP 422: {"token": ["abc", "d]e"], "credentials": {"user": "bob", "pass": "pw"}, '
        '"n": 1} tail'
    )
    assert r.text(text) == (
        'HTTP 422: {"token": [redacted:token], "credentials": [redacted:secret], "n": 1} tail'
    )
    # Pretty-printed across lines, and nested.
    text = 'error:\n{"api_key": [\n  "k1",\n  {"k": ["k2"]}\n],\n"page": 2}'
    assert r.text(text) == 'error:\n{"api_key": [redacted:api_key],\n"page": 2}'


def test_an_ordinary_url_path_is_not_taken_for_an_aws_secret() -> None:
    r = default_redactor()
    for text in [
        "https://example.com/Users/JohnSmith/Documents/Reports/AB.txt",
        "https://h.example:8080/api/v2/Users/JohnSmith/Documents/Rep.txt",
        "see docs.example.org/Guides/GettingStarted/Install/Linux/Debian",
    ]:
        assert r.text(text) == text
    # A key itself still goes, standalone, quoted, or at the end of a sentence.
    key = "wJalrXUtnFEMI/K7MDENG/bPxRfiCY" + "EXAMPLEKEY"
    for text in [key, f'x="{key}"', f"the key {key}."]:
        assert key not in r.text(text)
