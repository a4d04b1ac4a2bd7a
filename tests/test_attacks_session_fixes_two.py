"""An attacker's second look at the session's fixes: plural credential names and counts,
base64 text masked whole (``[redacted:encoded]``), approvals compared by tenant too, store
URL masking in the CLI's error paths, and the linear-time promise of the new rules.

Each defect found is a strict xfail asserting the correct behaviour; what held is an
ordinary test that fails if the promise breaks.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from run.helpers import fresh_stores
from tesserix_adk import Agent, AgentRunner, RunStatus, ScriptedProvider, tool
from tesserix_adk.checkpoint.redaction.redactor import Redactor
from tesserix_adk.run.invoking import result_content

ENCODED = "[redacted:encoded]"
PASSWORD = "hunter2Secret9xyz"
OPENAI_KEY = "sk-proj-" + "A1b2C3d4E5f6G7h8I9j0K1l2M3n4O5p6"
# Latin-1 bytes (not UTF-8) holding a password and an API key: a tool's binary result.
BLOB = ("\xff\xfe header\npassword=" + PASSWORD + "\n" + OPENAI_KEY + "\n").encode("latin-1")


def _r() -> Redactor:
    return Redactor()


def _no_secret(text: str) -> bool:
    return PASSWORD not in text and OPENAI_KEY not in text


# --- base64 masked whole: what holds ----------------------------------------------------


@pytest.mark.parametrize(
    "shape",
    ["standard", "urlsafe", "double", "in_json_text", "result_bytes", "result_dataclass"],
)
def test_padded_base64_holding_a_secret_is_masked(shape: str) -> None:
    r = _r()
    b64 = base64.b64encode(BLOB).decode()
    if shape == "standard":
        assert r.text(b64) == ENCODED
    elif shape == "urlsafe":
        assert r.text(base64.urlsafe_b64encode(BLOB).decode()) == ENCODED
    elif shape == "double":
        assert r.text(base64.b64encode(b64.encode()).decode()) == ENCODED
    elif shape == "in_json_text":
        assert json.loads(r.text(json.dumps({"blob": b64, "n": 1}))) == {"blob": ENCODED, "n": 1}
    elif shape == "result_bytes":
        # The kit's own conversion of a tool's non-UTF-8 bytes, for each padding length.
        for extra in (b"", b"x", b"xy"):
            content = result_content(BLOB + extra)
            assert isinstance(content, str)
            assert r.value(content) == ENCODED
    else:

        @dataclasses.dataclass
        class Shot:
            png: bytes
            note: bytes

        content = result_content(Shot(png=b"\x89PNG\xff", note=("password=" + PASSWORD).encode()))
        # A plain dataclass is written value by value, as a dict is: the note is its UTF-8
        # text (once base64, as the image made all its bytes), masked by the password rule.
        masked = r.value(content)
        assert masked["note"].startswith("password=") and _no_secret(json.dumps(masked))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prefix=st.binary(max_size=40), suffix=st.binary(max_size=40))
def test_a_password_line_in_any_binary_is_masked(prefix: bytes, suffix: bytes) -> None:
    raw = prefix + b"\npassword=" + PASSWORD.encode() + b"\n" + suffix
    masked = _r().text(base64.b64encode(raw).decode())
    assert masked == ENCODED


@settings(max_examples=60, deadline=None)
@given(data=st.binary(min_size=1, max_size=64))
def test_ids_and_digests_are_not_taken_for_encoded_secrets(data: bytes) -> None:
    # Ordinary values shaped like base64: digests, uuids, url-safe ids.
    r = _r()
    digest = hashlib.sha256(data).digest()
    for value in (
        hashlib.sha256(data).hexdigest(),
        base64.b64encode(digest).decode(),
        base64.urlsafe_b64encode(digest[:18]).decode(),
        uuid.UUID(bytes=digest[:16]).hex,
        "ReleaseCandidateBuild2024",
        "/var/lib/postgresql/data",
    ):
        assert r.text(value) == value


# --- base64 masked whole: what gets through --------------------------------------------


@pytest.mark.parametrize("alphabet", ["standard", "urlsafe"])
def test_unpadded_base64_holding_a_secret_is_masked(alphabet: str) -> None:
    encode = base64.b64encode if alphabet == "standard" else base64.urlsafe_b64encode
    unpadded = encode(BLOB + b"!").decode().rstrip("=")
    assert len(unpadded) % 4 != 0
    masked = _r().text(unpadded)
    assert masked == ENCODED, masked


@pytest.mark.parametrize("newline", ["\n", "\r\n"])
def test_mime_wrapped_base64_holding_a_secret_is_masked(newline: str) -> None:
    wrapped = base64.encodebytes(BLOB * 3).decode().replace("\n", newline)
    assert newline in wrapped.strip()
    masked = _r().text(wrapped)
    # Whole, or at least no line of it decodes to the secret any more.
    joined = "".join(masked.split())
    try:
        decoded = base64.b64decode(joined).decode("latin-1")
    except ValueError:
        decoded = ""
    assert _no_secret(decoded), masked[:120]


@pytest.mark.parametrize(
    "template",
    ["data:application/octet-stream;base64,{}", "attachment secrets.bin: {}", "{} (base64)"],
)
def test_base64_inside_free_text_holding_a_secret_is_masked(template: str) -> None:
    b64 = base64.b64encode(BLOB).decode()
    masked = _r().text(template.format(b64))
    assert b64 not in masked, masked[:120]


def test_utf16_bytes_result_holding_a_password_is_masked() -> None:
    raw = ("\ufeffDB_PASSWORD=" + PASSWORD + "\r\n").encode("utf-16-le")
    content = result_content(raw)
    assert isinstance(content, str)  # base64: the bytes are not UTF-8
    masked = _r().value(content)
    assert masked != content, masked


# --- plural names and counts ------------------------------------------------------------


@pytest.mark.parametrize(
    "name", ["api_keys", "tokens", "client_secrets", "accessTokens", "passwords", "cookies"]
)
def test_plural_credential_names_mask_in_data_json_and_free_text(name: str) -> None:
    r = _r()
    assert PASSWORD not in json.dumps(r.value({name: PASSWORD}))
    assert PASSWORD not in json.dumps(r.value({name: [PASSWORD, {"x": PASSWORD}]}))
    assert PASSWORD not in r.text(json.dumps({name: PASSWORD}))
    assert PASSWORD not in r.text(f"{name}={PASSWORD}")
    assert PASSWORD not in r.text(f"{name}: {PASSWORD}")


@pytest.mark.parametrize("line", ["DB_PASSWORD_=" + PASSWORD, "API_TOKENS__: " + PASSWORD])
def test_a_name_ending_in_a_separator_masks_in_free_text(line: str) -> None:
    assert PASSWORD not in _r().text(line)


@pytest.mark.parametrize(
    "name",
    [
        "input_tokens",
        "output_tokens",
        "max_tokens",
        "maxTokens",
        "max_new_tokens",
        "max_completion_tokens",
        "cache_read_input_tokens",
        "cache_creation_input_tokens",
        "reasoning_tokens",
        "prompt_tokens",
    ],
)
def test_counts_named_tokens_stay(name: str) -> None:
    r = _r()
    assert r.value({name: 12}) == {name: 12}
    assert r.value({name: "12"}) == {name: "12"}
    assert r.text(f"{name}=12") == f"{name}=12"
    assert r.text(f"usage: {name}: 12, done") == f"usage: {name}: 12, done"


@pytest.mark.parametrize("name", ["accepted_prediction_tokens", "rejected_prediction_tokens"])
def test_openai_prediction_token_counts_stay(name: str) -> None:
    r = _r()
    # What str() of openai's CompletionTokensDetails writes into a log line or a result.
    line = f"CompletionTokensDetails({name}=3, audio_tokens=0, reasoning_tokens=5)"
    assert r.text(line) == line
    assert r.value({name: "3"}) == {name: "3"}


# --- linear time ------------------------------------------------------------------------


def test_nested_base64_decodes_a_linear_amount(monkeypatch: pytest.MonkeyPatch) -> None:
    decoded: list[int] = []
    real = base64.b64decode

    def counting(s: Any, *args: Any, **kwargs: Any) -> bytes:
        decoded.append(len(s))
        return real(s, *args, **kwargs)

    monkeypatch.setattr(base64, "b64decode", counting)

    def nested(n: int) -> str:
        inner = "word " * n
        text = inner
        for _ in range(12):  # deeper than the redactor follows
            text = base64.b64encode(text.encode()).decode()
        return text

    _r().text(nested(500))
    small = sum(decoded)
    decoded.clear()
    _r().text(nested(2000))
    large = sum(decoded)
    assert small > 0
    assert large <= 5 * small


# --- approvals across tenants, every backend --------------------------------------------

BACKENDS = [
    pytest.param("memory", id="memory"),
    pytest.param("sqlite", id="sqlite"),
    pytest.param("redis", id="redis", marks=pytest.mark.redis),
    pytest.param("postgres", id="postgres", marks=pytest.mark.postgres),
]


@pytest.mark.parametrize("backend", BACKENDS)
async def test_approval_of_one_tenant_never_decides_another_tenants_run(
    backend: str, tmp_path: Path
) -> None:
    sent: list[str] = []

    @tool(requires_approval=True)
    def wire(amount: int) -> str:
        """Wire money (needs a person)."""
        sent.append(f"wire {amount}")
        return "wired"

    agent = Agent("bank", "Wire it.", [wire])
    turns: list[Any] = [[("wire", {"amount": 5})], "done"]
    async with fresh_stores(backend, tmp_path) as stores:
        runner = AgentRunner.from_stores(ScriptedProvider(turns), stores, worker="w")
        a = await runner.run(agent, "go", tenant="tenant-a", run_id="same")
        b = await runner.run(agent, "go", tenant="tenant-b", run_id="same")
        assert a.status is RunStatus.waiting_approval
        assert b.status is RunStatus.waiting_approval
        assert a.pending_approval is not None and b.pending_approval is not None
        assert a.pending_approval.id != b.pending_approval.id
        # Tenant A's decision cannot be made on B's request, nor found under A for it.
        with pytest.raises(KeyError):
            await stores.approvals.decide(
                "tenant-a", b.pending_approval.id, approved=True, by="mallory"
            )
        assert await stores.approvals.get("tenant-a", b.pending_approval.id) is None
        await stores.approvals.decide("tenant-a", a.pending_approval.id, approved=True, by="ann")
        b2 = await runner.resume(agent, "same", tenant="tenant-b")
        assert b2.status is RunStatus.waiting_approval
        assert sent == []
        a2 = await runner.resume(agent, "same", tenant="tenant-a")
        assert a2.status is RunStatus.completed
        assert sent == ["wire 5"]
        b3 = await runner.resume(agent, "same", tenant="tenant-b")
        assert b3.status is RunStatus.waiting_approval
        assert sent == ["wire 5"]


# --- store URLs in the CLI's error paths ------------------------------------------------

SECRET = "Zq8SECRETpw"
TESSERIX = str(Path(sys.executable).parent / "tesserix")


def _cli(*argv: str) -> tuple[int, str]:
    done = subprocess.run(
        [TESSERIX, *argv], capture_output=True, text=True, timeout=60, check=False
    )
    return done.returncode, done.stdout + done.stderr


COMMANDS = [
    ["runs", "--tenant", "t"],
    ["inspect", "r", "--tenant", "t"],
    ["cancel", "r", "--tenant", "t", "--by", "bob"],
    ["schema", "apply"],
]


@pytest.mark.parametrize(
    "url",
    [
        f"postgresql://bob:{SECRET}@x@127.0.0.1:1/db",
        f"bob:{SECRET}@127.0.0.1:1/db",
        f"sqlite://bob:{SECRET}@x/db",
        f"postgresql://bob:{SECRET}@[::1/db",
        f"redis://:{SECRET}@x@127.0.0.1:1/0",
    ],
)
@pytest.mark.parametrize("command", COMMANDS[:2], ids=["runs", "inspect"])
def test_store_url_passwords_are_masked_in_cli_errors(url: str, command: list[str]) -> None:
    code, out = _cli(*command, "--store", url)
    assert code != 0
    assert SECRET not in out and SECRET[:4] not in out, out


@pytest.mark.parametrize(
    "url",
    [
        pytest.param(f"postgresql:/bob:{SECRET}@127.0.0.1:1/db", id="pg_one_slash"),
        pytest.param(f"bob:{SECRET}@127.0.0.1:1/db?next=//x", id="no_scheme_slashes_later"),
        pytest.param(f"redis://bob:{SECRET[:4]}/{SECRET[4:]}@127.0.0.1:1/0", id="redis_slash"),
        pytest.param(f"postgresql://bob:{SECRET[:4]}/{SECRET[4:]}@127.0.0.1:1/db", id="pg_slash"),
    ],
)
@pytest.mark.parametrize("command", COMMANDS, ids=["runs", "inspect", "cancel", "schema"])
def test_odd_store_urls_never_print_the_password(url: str, command: list[str]) -> None:
    code, out = _cli(*command, "--store", url)
    assert code != 0
    assert SECRET[:4] not in out and SECRET[4:] not in out, out
