"""An attacker's look at the redaction of encoded content, end to end: each run of base64
in a text is decoded and masked whole (``[redacted:encoded]``) when its bytes hold a
secret, and plural credential names are masked except counts.

Real runs (``AgentRunner`` on SQLite and PostgreSQL, a scripted model, real tools): harmless
base64 in a tool's arguments must be kept and sent after a crash; images and documents must
be kept when they hold no secret, and masked when they do; the live model sees the real
content while the store keeps the masked one, and a resumed model is told the masked one;
and the work per byte (base64 decodes, rule passes) stays bounded for hostile texts.

Each defect found is a strict xfail asserting the correct behaviour; what held is an
ordinary test that fails if the promise breaks.
"""

from __future__ import annotations

import base64
import contextlib
import email.message
import hashlib
import json
import os
import sqlite3
import struct
import subprocess
import sys
import uuid
import zlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from adapters import services
from tesserix_adk import (
    Agent,
    AgentRunner,
    BinaryPart,
    Checkpointer,
    Message,
    ModelRequest,
    ModelResponse,
    Role,
    RunStatus,
    ScriptedProvider,
    TextPart,
    tool,
)
from tesserix_adk.checkpoint.redaction.redactor import Redactor
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.stores.urls import open_stores
from tesserix_adk.testing.faults import FaultyCheckpointStore, SimulatedCrash

ENCODED = "[redacted:encoded]"
TENANT = "enc-attack"
PASSWORD = "hunter2Secret9xyz"
OPENAI_KEY = "sk-proj-" + "A1b2C3d4E5f6G7h8I9j0K1l2M3n4O5p6"

BACKENDS = [
    pytest.param("sqlite", id="sqlite"),
    pytest.param("postgres", id="postgres", marks=pytest.mark.postgres),
]


# --- set-up ------------------------------------------------------------------------------


class Backend:
    """Stores of one backend, and everything they hold as text."""

    def __init__(self, stores: Stores, dump: Callable[[], Any], url: str) -> None:
        self.stores = stores
        self._dump = dump
        self.url = url

    async def everything(self) -> str:
        return str(await self._dump())


@contextlib.asynccontextmanager
async def backend(where: str, tmp_path: Path) -> AsyncIterator[Backend]:
    if where == "sqlite":
        path = tmp_path / "adk.sqlite3"
        url = f"sqlite:///{path}"
        async with open_stores(url) as stores:
            await stores.create_schema()

            async def dump_sqlite() -> str:
                out: list[str] = []
                with contextlib.closing(sqlite3.connect(path)) as db:
                    tables = [
                        r[0]
                        for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")
                    ]
                    for table in tables:
                        for row in db.execute(f'SELECT * FROM "{table}"'):
                            for cell in row:
                                out.append(
                                    cell.decode("utf-8", "replace")
                                    if isinstance(cell, bytes)
                                    else str(cell)
                                )
                return "\n".join(out)

            yield Backend(stores, dump_sqlite, url)
        return
    import psycopg

    async with services.postgres_schema() as schema:
        url = services.schema_url(schema)
        async with services.postgres_stores_applied(url) as stores:

            async def dump_postgres() -> str:
                out: list[str] = []
                async with await psycopg.AsyncConnection.connect(
                    services.POSTGRES_URL, autocommit=True
                ) as conn:
                    cur = await conn.execute(
                        "SELECT table_name FROM information_schema.tables WHERE table_schema = %s",
                        (schema,),
                    )
                    for (table,) in await cur.fetchall():
                        rows = await conn.execute(f'SELECT * FROM "{schema}"."{table}"')
                        for row in await rows.fetchall():
                            for cell in row:
                                if isinstance(cell, bytes | memoryview):
                                    out.append(bytes(cell).decode("utf-8", "replace"))
                                else:
                                    out.append(str(cell))
                return "\n".join(out)

            yield Backend(stores, dump_postgres, url)


def at(boundary: str, iteration: int) -> Callable[[dict[str, Any]], bool]:
    return lambda body: body.get("boundary") == boundary and body.get("iteration") == iteration


class Recording:
    """A scripted model that keeps every request it was sent."""

    def __init__(self, turns: list[Any]) -> None:
        self.inner = ScriptedProvider(turns)
        self.requests: list[ModelRequest] = []

    async def complete(self, request: ModelRequest) -> ModelResponse:
        self.requests.append(request)
        response: ModelResponse = await self.inner.complete(request)
        return response

    def results(self) -> dict[str, Message]:
        """The tool results the last request carried, by call id."""
        last = self.requests[-1]
        return {m.tool_call_id: m for m in last.messages if m.tool_call_id is not None}


def runner(
    provider: Any, stores: Stores, crash_after: Callable[[dict[str, Any]], bool] | None = None
) -> AgentRunner:
    store: Any = stores.checkpoints
    if crash_after is not None:
        store = FaultyCheckpointStore(stores.checkpoints, crash_after=crash_after)
    return AgentRunner(
        provider,
        idempotency=stores.idempotency,
        checkpoints=Checkpointer(store, history=stores.history),
        ledger=stores.ledger,
        approvals=stores.approvals,
    )


async def crash_then_resume(
    agent: Agent,
    turns: list[Any],
    stores: Stores,
    run_id: str,
    *,
    crash_at: tuple[str, int],
    input: Any = "go",
) -> tuple[Any, Recording]:
    """Run until the frontier ``crash_at`` is written, "die", then resume in a new runner."""
    with pytest.raises(SimulatedCrash):
        await runner(Recording(turns), stores, at(*crash_at)).run(
            agent, input, tenant=TENANT, run_id=run_id
        )
    again = Recording(turns)
    run = await runner(again, stores).resume(agent, run_id, tenant=TENANT)
    return run, again


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode("ascii")


def png(width: int, height: int, text: bytes = b"") -> bytes:
    """A real PNG (with an optional tEXt chunk)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = zlib.crc32(kind + data) & 0xFFFFFFFF
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)

    rows = b"".join(
        b"\x00" + bytes((x * 7 + y * 3) % 256 for x in range(width * 3)) for y in range(height)
    )
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + (chunk(b"tEXt", text) if text else b"")
        + chunk(b"IDAT", zlib.compress(rows))
        + chunk(b"IEND", b"")
    )


PDF = (
    b"%PDF-1.4\n1 0 obj<</Type/Catalog/Pages 2 0 R>>endobj\n"
    b"4 0 obj<</Length 88>>stream\nBT /F1 12 Tf (Password reset instructions) Tj ET\n"
    b"BT (Token count: 512 per page) Tj ET\nendstream endobj\n%%EOF\n"
)
DOTENV_BYTES = b"OPENAI_API_KEY=" + OPENAI_KEY.encode() + b"\n"
CSV = b"date,model,requests,cost_usd\n2024-05-01,gpt-4o,1200,3.10\n2024-05-02,gpt-4o,900,2.20\n"

# Harmless values a tool's arguments carry every day, shaped like base64.
HARMLESS: dict[str, str] = {
    "csv": b64(CSV),
    "png": b64(png(48, 48, b"Software\x00tesserix screenshot tool 1.0")),
    "pdf": b64(PDF),
    "pdf_urlsafe_unpadded": base64.urlsafe_b64encode(PDF).decode().rstrip("="),
    "pdf_mime": base64.encodebytes(PDF).decode(),
    "git_sha": hashlib.sha1(b"tree 0\x00").hexdigest(),
    "s3_etag": hashlib.md5(b"part").hexdigest() + "-12",
    "uuid_hex": uuid.UUID("6f1c2a0e-8d1b-4c2e-9a55-0f3b8e4d2c11").hex,
    "sha256": hashlib.sha256(b"release.tar.gz").hexdigest(),
    "urlsafe_id": base64.urlsafe_b64encode(hashlib.sha256(b"id").digest()[:18]).decode(),
    "nested_b64_json": b64(json.dumps({"file": b64(CSV), "pages": 3}).encode()),
}


# --- (1) harmless base64 in arguments: kept, and sent after a crash ----------------------


@pytest.mark.parametrize("where", BACKENDS)
async def test_harmless_base64_arguments_are_kept_and_sent_after_a_crash(
    where: str, tmp_path: Path
) -> None:
    sent: list[tuple[str, str]] = []

    @tool
    def upload(name: str, content: str) -> str:
        """Upload a file (side-effecting, keyed)."""
        sent.append((name, content))
        return f"uploaded {name}"

    agent = Agent("uploader", "Upload.", [upload])
    turns: list[Any] = [
        [("upload", {"name": name, "content": content}) for name, content in HARMLESS.items()],
        "done",
    ]
    redactor = Redactor()
    for name, content in HARMLESS.items():
        assert redactor.text(content) == content, name
    async with backend(where, tmp_path) as b:
        # Dies right after the frontier naming the calls: none was claimed.
        run, again = await crash_then_resume(
            agent, turns, b.stores, "r-harmless", crash_at=("after_model_call", 0)
        )
        assert run.status is RunStatus.completed
        assert sorted(sent) == sorted(HARMLESS.items())  # each sent once, exactly as asked
        told = [m.text for m in again.results().values()]
        assert not any("not sent" in t for t in told), told
        everything = await b.everything()
        for name, content in HARMLESS.items():
            if "\n" not in content:
                assert content in everything, name


async def test_base64_of_a_secret_in_an_argument_is_masked_and_not_sent_after_a_crash(
    tmp_path: Path,
) -> None:
    sent: list[str] = []

    @tool
    def upload(name: str, content: str) -> str:
        """Upload a file (side-effecting, keyed)."""
        sent.append(content)
        return "uploaded"

    blob = base64.urlsafe_b64encode(DOTENV_BYTES).decode().rstrip("=")
    agent = Agent("uploader", "Upload.", [upload])
    turns: list[Any] = [[("upload", {"name": ".env", "content": blob})], "done"]
    async with backend("sqlite", tmp_path) as b:
        run, again = await crash_then_resume(
            agent, turns, b.stores, "r-secret-arg", crash_at=("after_model_call", 0)
        )
        assert run.status is RunStatus.completed
        assert sent == []
        assert [m.text.startswith("not sent") for m in again.results().values()] == [True]
        everything = await b.everything()
        assert blob not in everything and OPENAI_KEY not in everything


# A report a tool is asked to send; a usage figure is not a credential.
USAGE_REPORT = "Daily usage. Prompt tokens: 51234, completion tokens: 8812. Total tokens: 60046"


@pytest.mark.parametrize("where", BACKENDS)
@pytest.mark.parametrize("shape", ["plain", "base64_csv"])
async def test_a_token_count_in_an_argument_is_kept_and_sent_after_a_crash(
    where: str, shape: str, tmp_path: Path
) -> None:
    sent: list[str] = []

    @tool
    def send_report(body: str) -> str:
        """Mail a report."""
        sent.append(body)
        return "mailed"

    body = USAGE_REPORT if shape == "plain" else b64(CSV + USAGE_REPORT.encode() + b"\n")
    agent = Agent("reporter", "Report.", [send_report])
    turns: list[Any] = [[("send_report", {"body": body})], "done"]
    async with backend(where, tmp_path) as b:
        run, again = await crash_then_resume(
            agent, turns, b.stores, "r-usage", crash_at=("after_model_call", 0)
        )
        assert run.status is RunStatus.completed
        assert sent == [body], [m.text for m in again.results().values()]


@pytest.mark.parametrize(
    "line",
    [
        "Prompt tokens: 512, completion tokens: 88",
        "Total tokens: 1234",
        "Tokens = 4096",
        "tokens=512 latency_ms=320",
        "Context window: 128000 tokens; used tokens: 9000",
    ],
)
def test_token_counts_in_prose_stay(line: str) -> None:
    assert Redactor().text(line) == line


# --- (2) images and documents in messages ----------------------------------------------


SCREENSHOT = png(32, 32)
DOTENV = (
    b"# .env of the service\nDB_HOST=db.internal\nOPENAI_API_KEY=" + OPENAI_KEY.encode() + b"\n"
)


@pytest.mark.parametrize("where", BACKENDS)
async def test_an_image_part_without_a_secret_is_kept_and_told_to_a_resumed_model(
    where: str, tmp_path: Path
) -> None:
    @tool(side_effects=False)
    def look(q: str) -> str:
        """Look something up."""
        return "ok"

    agent = Agent("viewer", "Describe.", [look])
    turns: list[Any] = [[("look", {"q": "x"})], "a red square"]
    message = Message(
        Role.user,
        [
            TextPart(text="What is in this screenshot?"),
            BinaryPart(data=SCREENSHOT, media_type="image/png"),
        ],
    )
    async with backend(where, tmp_path) as b:
        run, again = await crash_then_resume(
            agent, turns, b.stores, "r-image", crash_at=("after_model_call", 0), input=message
        )
        assert run.status is RunStatus.completed
        [user] = [m for m in again.requests[-1].messages if m.role is Role.user]
        assert not isinstance(user.content, str)
        binary = [p for p in user.content if isinstance(p, BinaryPart)]
        assert [p.data for p in binary] == [SCREENSHOT]
        assert b64(SCREENSHOT) in await b.everything()


@pytest.mark.parametrize("where", BACKENDS)
async def test_a_document_part_holding_a_key_is_not_stored(where: str, tmp_path: Path) -> None:
    agent = Agent("reader", "Read the file.", [])
    message = Message(
        Role.user,
        [TextPart(text="Check this config."), BinaryPart(data=DOTENV, media_type="text/plain")],
    )
    async with backend(where, tmp_path) as b:
        run = await runner(Recording(["looks fine"]), b.stores).run(
            agent, message, tenant=TENANT, run_id="r-doc"
        )
        assert run.status is RunStatus.completed
        everything = await b.everything()
        assert OPENAI_KEY not in everything
        assert b64(DOTENV) not in everything


# A tool's binary result (not UTF-8: kept as base64) holding a password and a key.
SECRET_BLOB = b"\xff\xfe dump\npassword=" + PASSWORD.encode() + b"\n" + OPENAI_KEY.encode() + b"\n"


def _binary_agent() -> Agent:
    @tool(side_effects=False)
    def screenshot() -> bytes:
        """A screenshot (PNG bytes)."""
        return SCREENSHOT

    @tool(side_effects=False)
    def dump_env() -> bytes:
        """A binary dump of the environment."""
        return SECRET_BLOB

    return Agent("shooter", "Look.", [screenshot, dump_env])


BINARY_TURNS: list[Any] = [[("screenshot", {}), ("dump_env", {})], "seen"]


@pytest.mark.parametrize("where", BACKENDS)
async def test_live_model_sees_real_bytes_while_the_store_keeps_them_masked(
    where: str, tmp_path: Path
) -> None:
    provider = Recording(BINARY_TURNS)
    async with backend(where, tmp_path) as b:
        run = await runner(provider, b.stores).run(
            _binary_agent(), "go", tenant=TENANT, run_id="r-live"
        )
        assert run.status is RunStatus.completed
        live = sorted(m.text for m in provider.results().values())
        assert live == sorted([b64(SCREENSHOT), b64(SECRET_BLOB)])
        everything = await b.everything()
        assert b64(SCREENSHOT) in everything  # the image is kept whole
        assert b64(SECRET_BLOB) not in everything
        assert PASSWORD not in everything and OPENAI_KEY not in everything
        assert ENCODED in everything


@pytest.mark.parametrize("where", BACKENDS)
async def test_a_resumed_model_is_told_the_masked_result_and_the_kept_image(
    where: str, tmp_path: Path
) -> None:
    async with backend(where, tmp_path) as b:
        run, again = await crash_then_resume(
            _binary_agent(),
            BINARY_TURNS,
            b.stores,
            "r-resumed",
            crash_at=("after_tool_result", 0),
        )
        assert run.status is RunStatus.completed
        told = sorted(m.text for m in again.results().values())
        assert told == sorted([b64(SCREENSHOT), ENCODED])


def test_show_prints_the_masked_result_and_never_the_secret(tmp_path: Path) -> None:
    import asyncio

    async def go() -> str:
        async with backend("sqlite", tmp_path) as b:
            run = await runner(Recording(BINARY_TURNS), b.stores).run(
                _binary_agent(), "go", tenant=TENANT, run_id="r-show"
            )
            assert run.status is RunStatus.completed
            return b.url

    url = asyncio.run(go())
    env = {**os.environ, "NO_COLOR": "1"}
    shown = subprocess.run(
        [sys.executable, "-m", "tesserix_adk", "show", "r-show", "--tenant", TENANT],
        env={**env, "ADK_STORE": url},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    out = shown.stdout + shown.stderr
    assert shown.returncode == 0, out
    assert ENCODED in out
    assert PASSWORD not in out and OPENAI_KEY not in out and b64(SECRET_BLOB) not in out


# --- base64 that gets through: glued after other base64 characters ----------------------


SECRET_JSON = json.dumps({"user": "bob", "password": PASSWORD}).encode()
SECRET_B64URL = base64.urlsafe_b64encode(SECRET_JSON).decode().rstrip("=")


@pytest.mark.parametrize(
    "prefix",
    ["/tmp/upload/", "tok_"],  # lengths a multiple of 4: the run decodes aligned
)
def test_base64_glued_after_an_aligned_prefix_is_masked(prefix: str) -> None:
    assert SECRET_B64URL not in Redactor().text(prefix + SECRET_B64URL)


@pytest.mark.parametrize("where", BACKENDS)
async def test_a_link_with_a_base64_path_segment_holding_a_password_is_not_stored(
    where: str, tmp_path: Path
) -> None:
    link = "https://files.example.com/v1/share/" + SECRET_B64URL

    @tool(side_effects=False)
    def share() -> str:
        """Make a share link."""
        return f"Shared. Link: {link}"

    agent = Agent("sharer", "Share.", [share])
    async with backend(where, tmp_path) as b:
        run = await runner(Recording([[("share", {})], "done"]), b.stores).run(
            agent, "go", tenant=TENANT, run_id="r-link"
        )
        assert run.status is RunStatus.completed
        assert SECRET_B64URL not in await b.everything()


async def test_a_tool_error_quoting_a_mime_body_does_not_store_the_secret(tmp_path: Path) -> None:
    note = email.message.EmailMessage()
    note["Subject"] = "credentials"
    body = ("Hello team,\n" * 12 + f"the db password={PASSWORD}\n").encode()
    note.add_attachment(body, maintype="application", subtype="octet-stream", filename="c.txt")
    raw = note.as_string()
    [attachment] = list(note.iter_attachments())
    lines = str(attachment.get_payload()).splitlines()
    assert all(len(ln) == 76 for ln in lines[:-1])
    # The base64 lines (57 bytes each) whose bytes carry part of the password.
    at_byte = body.index(PASSWORD.encode())
    carrying = [
        ln
        for i, ln in enumerate(lines)
        if i * 57 < at_byte + len(PASSWORD) and at_byte < (i + 1) * 57
    ]
    assert carrying and all(ln in raw for ln in carrying)

    @tool(side_effects=False)
    def parse_mail(ref: str) -> str:
        """Parse a mail."""
        raise ValueError(f"cannot parse {raw!r}")

    agent = Agent("mailer", "Read mail.", [parse_mail])
    async with backend("sqlite", tmp_path) as b:
        run = await runner(Recording([[("parse_mail", {"ref": "m1"})], "done"]), b.stores).run(
            agent, "go", tenant=TENANT, run_id="r-mime"
        )
        assert run.status is RunStatus.completed
        everything = await b.everything()
        assert "cannot parse" in everything  # the error result was stored
        assert [ln for ln in carrying if ln in everything] == []


@pytest.mark.parametrize("prefix", ["x", "v1-", "k8s-secret-", "https://api.example.com/v1/"])
def test_base64_glued_after_any_prefix_is_masked(prefix: str) -> None:
    assert SECRET_B64URL not in Redactor().text(prefix + SECRET_B64URL)


# --- (4) work per byte: count, do not time ------------------------------------------------


class Counter:
    """Counts the bytes base64 decodes and the characters the rule pass reads."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.decoded = 0
        self.decodes = 0
        self.ruled = 0
        real_decode = base64.b64decode
        real_builtin = Redactor._builtin

        def decode(s: Any, *args: Any, **kwargs: Any) -> bytes:
            self.decodes += 1
            self.decoded += len(s)
            return real_decode(s, *args, **kwargs)

        def builtin(redactor: Redactor, value: str) -> str:
            self.ruled += len(value)
            return real_builtin(redactor, value)

        monkeypatch.setattr(base64, "b64decode", decode)
        monkeypatch.setattr(Redactor, "_builtin", builtin)

    def per_byte(self, text: str) -> tuple[float, float]:
        self.decoded = self.ruled = self.decodes = 0
        Redactor().text(text)
        return self.decoded / len(text), self.ruled / len(text)


def nest(ops: str, inner: str) -> str:
    """``inner`` wrapped by each op in turn: ``b`` base64, ``j`` JSON text in a string."""
    text = inner
    for op in ops:
        text = b64(text.encode("latin-1")) if op == "b" else json.dumps({"x": text})
    return text


# The worst mix a beam search found (base64 of JSON text in strings of JSON text …): each
# base64 run is reached both through the JSON text around it and through its own string.
HOSTILE_NESTINGS = ["b" * 12, "bj" * 8, "bbjbjjbjjbjjjjbjjjbjjjjj", "bbjjbjjbjjjbjjjjbjjjjj"]


@pytest.mark.parametrize("ops", HOSTILE_NESTINGS)
def test_nested_base64_work_per_byte_is_bounded_and_linear(
    ops: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    counter = Counter(monkeypatch)
    small = counter.per_byte(nest(ops, "word " * 400))
    large = counter.per_byte(nest(ops, "word " * 1600))
    # Bounded by a constant (the depth cap): measured up to ~93 decoded bytes and ~70
    # rule characters per input byte for these mixes.
    assert small[0] <= 128 and small[1] <= 128, small
    assert large[0] <= 128 and large[1] <= 128, large
    # Linear: four times the input is about four times the work, never more per byte.
    assert large[0] <= small[0] * 1.25 + 0.5 and large[1] <= small[1] * 1.25 + 0.5


@pytest.mark.parametrize(
    "text",
    [
        pytest.param(" ".join(["QUJDREVGR0hJSktMTU5PUA"] * 4000), id="many_short_runs"),
        pytest.param(json.dumps(["QUJDREVGR0hJSktMTU5PUA"] * 4000), id="many_short_runs_json"),
        pytest.param("A" * 39 + ("\n" + "B" * 39) * 3000, id="lines_of_39"),
        pytest.param(("C" * 40 + "\n") * 3000 + "!" + "D" * 15, id="mime_then_short"),
        pytest.param(b64(("x\x00" * 20000).encode("latin-1")), id="utf16_shaped"),
    ],
)
def test_flat_hostile_texts_cost_a_few_passes_per_byte(
    text: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    counter = Counter(monkeypatch)
    decoded, ruled = counter.per_byte(text)
    # A run in the text as given is decoded at each of its four alignments (a prefix such
    # as "v1-" may be glued to the base64): a constant, measured 5.4 and 6.5 at most.
    assert decoded <= 8 and ruled <= 12, (decoded, ruled)
    assert counter.decodes <= len(text) // 2
