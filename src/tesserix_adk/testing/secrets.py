"""Fake secrets to plant in user data, for tests that check nothing secret reaches a store.

``planted_secrets()`` gives one realistic-looking value per kind the built-in redaction
patterns know (kind → the text to plant, e.g. ``"Bearer …"`` for ``bearer``). A test puts
them in messages, tool arguments, outcomes or state, runs the kit, and then asks
``leaked_secrets(blob)`` which of them survived into the stored bytes.

The values are generated (from a fixed seed, so every call returns the same ones) rather than
written out, so no source file holds anything a secret scanner would flag. None of them is
real.
"""

from __future__ import annotations

import base64
import json
import random
import string

__all__ = ["leaked_secrets", "planted_secrets"]

_ALNUM = string.ascii_letters + string.digits
_B64 = _ALNUM + "+/"
_B64URL = _ALNUM + "-_"


def _cores() -> dict[str, tuple[str, str]]:
    """kind → (text to plant, the part of it that must never be stored)."""
    rng = random.Random(20240229)

    def pick(alphabet: str, n: int) -> str:
        return "".join(rng.choice(alphabet) for _ in range(n))

    def b64url(raw: bytes) -> str:
        return base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii")

    openai = "sk-" + "proj-" + pick(_B64URL, 56) + "T3Blbk" + "FJ" + pick(_ALNUM, 20)
    anthropic = "sk-" + "ant-api03-" + pick(_B64URL, 93) + "AA"
    bearer_token = "ya29." + "a0AfB_" + pick(_B64URL, 40)
    aws_id = "AK" + "IA" + "".join(rng.choice(string.ascii_uppercase + "234567") for _ in range(16))
    # 40 base64 characters with both cases, a digit, a "/" and a "+".
    aws_secret = "wJal" + pick(_ALNUM, 9) + "/K7MDENG" + pick(_ALNUM, 8) + "+bPxRfi" + "CY3x"
    github = "gh" + "p_" + pick(_ALNUM, 36)
    slack = (
        "xo"
        + "xb-"
        + pick(string.digits, 12)
        + "-"
        + pick(string.digits, 13)
        + "-"
        + pick(_ALNUM, 24)
    )
    jwt_header = b64url(json.dumps({"alg": "HS256", "typ": "JWT"}).encode())
    jwt_claims = b64url(json.dumps({"sub": "user_8812", "iat": 1_716_239_022}).encode())
    jwt = f"{jwt_header}.{jwt_claims}.{pick(_B64URL, 43)}"
    pem_lines = [pick(_B64, 64) for _ in range(6)]
    pem_kind = "RSA " + "PRIVATE KEY"
    pem = "\n".join([f"-----BEGIN {pem_kind}-----", *pem_lines, f"-----END {pem_kind}-----"])
    url_password = "Tr0ub4dor&3" + pick(_ALNUM, 12)
    url = f"postgres://booking_app:{url_password}@db.internal.example:5432/booking"
    return {
        "openai_key": (openai, openai),
        "anthropic_key": (anthropic, anthropic),
        "bearer": (f"Bearer {bearer_token}", bearer_token),
        "aws_access_key_id": (aws_id, aws_id),
        "aws_secret_key": (aws_secret, aws_secret),
        "github_token": (github, github),
        "slack_token": (slack, slack),
        "jwt": (jwt, jwt),
        "private_key": (pem, pem_lines[2]),
        "url_password": (url, url_password),
    }


def planted_secrets() -> dict[str, str]:
    """One fake secret per built-in redaction kind: kind → the text to plant.

    The kinds are the labels redaction writes (``[redacted:<kind>]``): ``openai_key``,
    ``anthropic_key``, ``bearer``, ``aws_access_key_id``, ``aws_secret_key``,
    ``github_token``, ``slack_token``, ``jwt``, ``private_key``, ``url_password``. A new
    dict every call; the values are the same every call.
    """
    return {kind: planted for kind, (planted, _) in _cores().items()}


def leaked_secrets(blob: bytes | str) -> list[str]:
    """The kinds whose secret part appears in ``blob`` (raw or JSON-escaped); ``[]`` if none.

    Only the secret part is looked for (the token after ``Bearer``, the password in the URL,
    a line from inside the key block), so text redaction rightly keeps does not count.
    """
    text = blob.decode("utf-8", errors="replace") if isinstance(blob, bytes) else blob
    found = []
    for kind, (_, secret) in _cores().items():
        escaped = json.dumps(secret)[1:-1]
        if secret in text or escaped in text:
            found.append(kind)
    return found
