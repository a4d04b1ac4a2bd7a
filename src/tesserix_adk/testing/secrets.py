"""Fake secrets to plant in user data, for tests that check nothing secret reaches a store.

``planted_secrets()`` gives one realistic-looking value per kind the built-in redaction
patterns know (kind → the text to plant, e.g. ``"Bearer …"`` for ``bearer``). A test puts
them in messages, tool arguments, outcomes or state, runs the kit, and then asks
``leaked_secrets(blob)`` which of them survived into the stored bytes.

``planted_cases()`` goes further: every *shape* a secret arrives in (a key wrapped across
lines, JSON text inside a string, a duplicated JSON key, ``accessToken``-style key names,
``Authorization: Basic`` headers, a pydantic validation message …), each a ``PlantedSecret``
with the text to plant and the part that must never be stored; ``leaked(blob)`` names the
cases that survived. ``PlantedSecretsSuite`` is a pytest base class a store's own test module
subclasses: it runs an agent through the kit with every case planted and reads everything
back through the store protocols.

The values are generated (from a fixed seed, so every call returns the same ones) rather than
written out, so no source file holds anything a secret scanner would flag. None of them is
real.
"""

from __future__ import annotations

import base64
import json
import random
import string
from dataclasses import dataclass
from typing import Any

__all__ = [
    "PlantedSecret",
    "PlantedSecretsSuite",
    "leaked",
    "leaked_secrets",
    "planted_cases",
    "planted_secrets",
]

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
    basic = base64.b64encode(f"svc_report:{pick(_ALNUM, 18)}".encode()).decode()
    return {
        "basic_auth": (f"Basic {basic}", basic),
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
    ``anthropic_key``, ``bearer``, ``basic_auth``, ``aws_access_key_id``, ``aws_secret_key``,
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


@dataclass(frozen=True, slots=True, kw_only=True)
class PlantedSecret:
    """One secret in one shape: ``planted`` goes into user data (a string, or JSON-like data
    for ``value`` cases); ``secret`` is the part that must never be stored (each of
    ``fragments`` too, for a secret split across lines)."""

    name: str
    planted: str | dict[str, object]
    secret: str
    fragments: tuple[str, ...] = ()

    def found_in(self, text: str) -> bool:
        """Whether the secret, or any fragment of it, appears in ``text``, raw or escaped."""
        for part in (self.secret, *self.fragments):
            once = json.dumps(part)[1:-1]
            twice = json.dumps(once)[1:-1]
            if part in text or once in text or twice in text:
                return True
        return False


def planted_cases() -> tuple[PlantedSecret, ...]:
    """Every secret in every shape users hand the kit; the same values every call.

    One case per built-in kind as plain text (``kind:<kind>``), then the shapes: wrapped
    across lines, inside JSON text (also as a duplicated key), under key names in data and in
    free text, in headers, and quoted by a pydantic validation message.
    """
    rng = random.Random(20240301)

    def pick(alphabet: str, n: int) -> str:
        return "".join(rng.choice(alphabet) for _ in range(n))

    cases = [
        PlantedSecret(name=f"kind:{kind}", planted=planted, secret=secret)
        for kind, (planted, secret) in _cores().items()
    ]
    cores = _cores()
    openai = cores["openai_key"][0]
    head, tail1, tail2 = openai[:40], openai[40:80], openai[80:]
    wrapped = f"{head}\n{tail1}\n{tail2}"

    def password() -> str:
        # A fresh one per case, so one case's secret never contains another's.
        return "Pw-" + pick(_ALNUM, 14)

    plain, duplicated, nested, quoted = password(), password(), password(), password()
    cases += [
        PlantedSecret(
            name="wrapped:key_across_lines",
            planted=f"the key is\n{wrapped}\nthanks",
            secret=openai,
            fragments=(tail1, tail2),
        ),
        PlantedSecret(
            name="wrapped:key_in_json_string",
            planted=json.dumps({"note": wrapped}),
            secret=openai,
            fragments=(tail1, tail2),
        ),
        PlantedSecret(
            name="wrapped:pem_in_json_string",
            planted=json.dumps({"config": cores["private_key"][0]}),
            secret=cores["private_key"][1],
        ),
        PlantedSecret(
            name="json:password_in_text",
            planted=json.dumps({"user": "ann", "password": plain}),
            secret=plain,
        ),
        PlantedSecret(
            name="json:duplicated_key",
            planted=f'{{"token":"{duplicated}","token":null}}',
            secret=duplicated,
        ),
        PlantedSecret(
            name="json:nested_json_text",
            planted=json.dumps({"body": json.dumps({"clientSecret": nested})}),
            secret=nested,
        ),
    ]
    for key in (
        "accessToken",
        "clientSecret",
        "openai_api_key",
        "x-api-key",
        "api-key",
        "authorization",
        "DB_PASSWORD",
        "refresh_token",
        "Set-Cookie",
    ):
        value = f"{key[:3]}-" + pick(_ALNUM, 16)
        cases.append(PlantedSecret(name=f"key:{key}", planted={key: value}, secret=value))
        text_value = f"{key[:3]}." + pick(_ALNUM, 16)
        cases.append(
            PlantedSecret(name=f"free_text:{key}", planted=f"{key}={text_value}", secret=text_value)
        )
    header = base64.b64encode(f"ann:{pick(_ALNUM, 12)}".encode()).decode()
    cookie = "sid=" + pick(_ALNUM, 20)
    pin = "pin-" + pick(_ALNUM, 10)
    cases += [
        PlantedSecret(
            name="header:authorization_basic",
            planted=f"Authorization: Basic {header}",
            secret=header,
        ),
        PlantedSecret(
            name="header:authorization_bearer_short",
            planted="Authorization: Bearer " + pin,
            secret=pin,
        ),
        PlantedSecret(name="header:cookie", planted=f"Cookie: {cookie}; theme=dark", secret=cookie),
        PlantedSecret(
            name="validation:pydantic_input_value",
            planted=(
                "1 validation error for LoginArgs\npassword\n  Input should be a valid integer "
                f"[type=int_parsing, input_value='{quoted}', input_type=str]"
            ),
            secret=quoted,
        ),
        PlantedSecret(
            name="validation:pydantic_truncated_key",
            planted=(
                "1 validation error for A\nlabel\n  Input should be a valid integer "
                f"[type=int_parsing, input_value='{openai[:24]}...{openai[-24:]}', "
                "input_type=str]"
            ),
            secret=openai[-24:],
        ),
    ]
    return tuple(cases)


def leaked(blob: bytes | str, cases: tuple[PlantedSecret, ...] | None = None) -> list[str]:
    """The names of the planted cases whose secret appears in ``blob``; ``[]`` if none."""
    text = blob.decode("utf-8", errors="replace") if isinstance(blob, bytes) else blob
    return [
        case.name for case in (planted_cases() if cases is None else cases) if case.found_in(text)
    ]


_TENANT = "acme"


class PlantedSecretsSuite:
    """Subclass this in a test module to check that no planted secret reaches a backend.

    Provide one fixture (in the subclass, a conftest or the module):

    - ``planted_stores``: a fresh ``tesserix_adk.stores.bundle.Stores`` (schema applied).

    The suite runs an agent through the kit with every ``planted_cases()`` case in the user
    message, the tool arguments, the tool results (plain and JSON text) and the final answer,
    then reads every frontier and step snapshot, the transcript, every recorded outcome and
    every approval back through the store protocols. Override ``raw_bytes`` to add what the
    backend itself holds (rows, keys), so bytes the protocols do not return are checked too.
    """

    async def raw_bytes(self, stores: Any, tenant: str, run_id: str) -> bytes:
        """Everything the backend holds for the run, as it holds it; ``b""`` if not given."""
        return b""

    async def test_no_planted_secret_reaches_any_store(self, planted_stores: Any) -> None:
        from tesserix_adk import Agent, AgentRunner, Checkpointer, ScriptedProvider, tool

        cases = planted_cases()

        @tool
        def lookup(case: str, payload: Any) -> Any:
            """Return the payload as the tool's result."""
            return payload

        calls = [("lookup", {"case": c.name, "payload": c.planted}) for c in cases]
        texts = [c.planted for c in cases if isinstance(c.planted, str)]
        runner = AgentRunner(
            ScriptedProvider([calls, "done: " + "\n".join(texts)]),
            idempotency=planted_stores.idempotency,
            checkpoints=Checkpointer.from_stores(planted_stores),
            leases=planted_stores.leases,
        )
        await runner.run(Agent("planted", "Plant."), "\n".join(texts), tenant=_TENANT, run_id="r")
        await runner.run(
            Agent("planted", "Plant.", [lookup]), "\n".join(texts), tenant=_TENANT, run_id="r2"
        )
        for run_id in ("r", "r2"):
            leaks = leaked(await self._stored(planted_stores, run_id), cases)
            assert not leaks, f"run {run_id} stored these planted secrets: {leaks}"

    async def test_no_planted_secret_reaches_an_approval(self, planted_stores: Any) -> None:
        from tesserix_adk import Agent, AgentRunner, Checkpointer, ScriptedProvider, tool

        cases = planted_cases()

        @tool(requires_approval=True)
        def pay(case: str, payload: Any) -> str:
            """Pay."""
            return "paid"

        runner = AgentRunner(
            ScriptedProvider([[("pay", {"case": c.name, "payload": c.planted}) for c in cases]]),
            idempotency=planted_stores.idempotency,
            checkpoints=Checkpointer.from_stores(planted_stores),
            approvals=planted_stores.approvals,
            leases=planted_stores.leases,
        )
        run = await runner.run(Agent("planted", "Plant.", [pay]), "go", tenant=_TENANT, run_id="a")
        assert run.pending_approval is not None
        request = await planted_stores.approvals.get(_TENANT, run.pending_approval.id)
        assert request is not None
        shown = json.dumps([dict(c.arguments) for c in request.calls], default=str)
        leaks = leaked(shown, cases) + leaked(await self._stored(planted_stores, "a"), cases)
        assert not leaks, f"the approval stored these planted secrets: {leaks}"

    async def _stored(self, stores: Any, run_id: str) -> bytes:
        from tesserix_adk.checkpoint.checkpointer import Checkpointer

        blobs: list[bytes] = []
        for step in await stores.checkpoints.steps(_TENANT, run_id):
            snapshot = await stores.checkpoints.at(_TENANT, run_id, step)
            if snapshot is not None:
                blobs.append(snapshot.payload)
        latest = await stores.checkpoints.latest(_TENANT, run_id)
        if latest is not None:
            blobs.append(latest.payload)
        frontier = await Checkpointer(stores.checkpoints, history=stores.history).latest(
            _TENANT, run_id
        )
        if frontier is not None and frontier.history_handle is not None:
            blobs += await stores.history.fetch(frontier.history_handle)
        for record in await stores.idempotency.records(_TENANT, run_id):
            blobs.append(record.outcome or b"")
        blobs.append(await self.raw_bytes(stores, _TENANT, run_id))
        return b"\n".join(blobs)
