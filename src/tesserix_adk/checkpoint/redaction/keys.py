"""Sensitive key names: which keys name a credential, and the kind their values mask as.

A key named like a credential (``password``, ``secret``, ``token``, ``api_key``,
``authorization``, ``cookie``, ``credentials`` …, whole or as the last words of the key in any
casing: ``accessToken``, ``clientSecret``, ``openai_api_key``, ``X-Api-Key``, ``db.password``;
plural too: ``api_keys``, ``passwords``, ``tokens``, ``accessTokens``) masks its value, in a
mapping, in JSON text and in free text. Keys that only contain such a word stay
(``password_hint``, ``secretary``), and so do counts (``input_tokens``, ``max_tokens``)
and pagination tokens (``next_page_token``, ``nextToken``). ``pwd`` masks only as a name's
last word after another (``MYSQL_PWD``): ``PWD`` alone is the working directory.
"""

from __future__ import annotations

import re
from functools import lru_cache

# A key longer than this is never taken for a credential name (and is never worth caching).
MAX_KEY_NAME = 128

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
        "starting_token",
        "client_token",
        "idempotency_token",
    }
)
# Words before ``_tokens`` that make it a count (a model's usage, a limit) or a model's
# own tokens, not credentials: ``input_tokens``, ``max_new_tokens``,
# ``accepted_prediction_tokens``, ``stop_tokens``, ``special_tokens``.
_COUNTED_TOKENS = frozenset(
    {
        "input",
        "output",
        "max",
        "min",
        "total",
        "prompt",
        "completion",
        "cached",
        "reasoning",
        "num",
        "n",
        "used",
        "remaining",
        "context",
        "new",
        "audio",
        "text",
        "image",
        "accepted",
        "rejected",
        "generated",
        "response",
        "request",
        "thinking",
        "prediction",
        "stop",
        "special",
        "eos",
        "bos",
        "pad",
        "unk",
        "added",
        "extra",
        "vocab",
        "video",
    }
)
_PASSWORD_WORDS = ("password", "passwd", "passphrase")
_CAMEL = re.compile(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])")
_KEY_SEPARATORS = re.compile(r"[-.\s_]+")


@lru_cache(maxsize=4096)
def _named_kind(key: str) -> str | None:
    name = _KEY_SEPARATORS.sub("_", _CAMEL.sub("_", key)).strip("_").lower()
    kind = _kind_of(name)
    if kind is None and name.endswith("s") and not name.endswith("ss"):
        # A plural names credentials too (``api_keys``, ``tokens``, ``client_secrets``),
        # except counts named so: ``input_tokens``, ``max_tokens`` are usage figures.
        singular = name[:-1]
        *words, last = singular.split("_")
        if last != "token" or _COUNTED_TOKENS.isdisjoint(words):
            kind = _kind_of(singular)
    return kind


def _kind_of(name: str) -> str | None:
    # Also as a name's last words (``meta.next_page_token``, S3's ``NextContinuationToken``).
    if name in _NOT_SECRET or any(name.endswith("_" + n) for n in _NOT_SECRET):
        return None
    if name in _WHOLE_KEYS:
        return _WHOLE_KEYS[name]
    if name in _KEY_SUFFIXES:
        return _KEY_SUFFIXES[name]
    # The longest suffix first is irrelevant: every suffix of one kind family maps alike.
    for suffix, kind in _KEY_SUFFIXES.items():
        if name.endswith("_" + suffix):
            return kind
    # A password word needs no separator before it (``PGPASSWORD``, ``DBPASSWORD``): no
    # ordinary key ends in one. (``token`` does: ``NEXTTOKEN`` pages.)
    if name.endswith(_PASSWORD_WORDS):
        return "password"
    # ``MYSQL_PWD``, ``DB_PWD``: ``pwd`` only as the last word after another, since ``PWD``
    # alone (and ``OLDPWD``) names the working directory.
    if name.endswith("_pwd"):
        return "password"
    return None


def _key_kind(key: str) -> str | None:
    """The kind a key masks as (``accessToken`` → ``token``), or ``None`` for an ordinary key."""
    if len(key) > MAX_KEY_NAME or len(key) < 3:
        return None
    return _named_kind(key)
