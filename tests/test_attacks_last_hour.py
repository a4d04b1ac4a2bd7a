"""An attack on the last hour's fixes: base64 decoded in every alignment of the text as
given (one inside decoded content and nested JSON text), MIME lines joined by real or
escaped newlines; a count after a plural ``tokens`` kept; a document part holding a secret
stored as a text part; every credential a provider's client holds masked (placeholders
under 8 characters left); the revision sweep's attempt count kept by a want, then a want
with a count.

Real runs (``AgentRunner`` on SQLite and PostgreSQL, a scripted model, real tools, the
real SDKs against the fake model server). Each defect is a strict xfail asserting the
correct behaviour; what held is an ordinary test that fails if the promise breaks. Counts,
never time.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from booking import Airline
from providers.fake_server import ModelServer, openai_error
from providers.vendors import OPENAI
from tesserix_adk import (
    Agent,
    AgentRunner,
    BinaryPart,
    Message,
    Role,
    RunStatus,
    TextPart,
    Worker,
    WorkState,
    tool,
)
from tesserix_adk.checkpoint.payload.redacting import _redacted_message
from tesserix_adk.checkpoint.redaction.redactor import Redactor
from tesserix_adk.errors import RevisionMismatchError, StoreUnavailableError
from tesserix_adk.messages import message_from_json
from tesserix_adk.providers import anthropic as anthropic_wire
from tesserix_adk.providers import openai as openai_wire
from tesserix_adk.providers._common import credentials, scrub
from tesserix_adk.stores.protocols import WakesParked
from tesserix_adk.testing.faults import SimulatedCrash
from tesserix_adk.worker_parking import Backoff, parked_for
from test_attacks_encoded_redaction import (
    BACKENDS,
    Recording,
    backend,
    crash_then_resume,
    runner,
)
from test_attacks_encoded_redaction import TENANT as ENC_TENANT
from test_attacks_revision_sweep import (
    T,
    _agents,
    _entry,
    _lapsed,
    _memory,
    _mismatch,
    _runner,
    _started,
)

TENANT = "last-hour"
ENCODED = "[redacted:encoded]"
PASSWORD = "hunter2Secret9xyz"
OPENAI_KEY = "sk-proj-" + "A1b2C3d4E5f6G7h8I9j0K1l2M3n4O5p6"
KEY_BODY = OPENAI_KEY[len("sk-proj-") :]
TELEGRAM = "123456789:AAHdqTcvCH1vGWJxfSeofSAs0K5PALDsaw"


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode("ascii")


def _reader_agent(result: Any) -> tuple[Agent, list[Any]]:
    """An agent with one read-only tool answering ``result``, and its two turns."""

    @tool(side_effects=False)
    def fetch(q: str) -> Any:
        """Fetch a document."""
        return result

    return Agent("reader", "Fetch it.", [fetch]), [[("fetch", {"q": "x"})], "done"]


async def _stored_after_run(where: str, tmp_path: Path, result: Any) -> str:
    agent, turns = _reader_agent(result)
    async with backend(where, tmp_path) as b:
        run = await runner(Recording(turns), b.stores).run(
            agent, "go", tenant=TENANT, run_id="r-fetch"
        )
        assert run.status is RunStatus.completed
        return await b.everything()


# --- (1) base64 in a tool's JSON text: only one alignment is tried ------------------------

GLUED_LINK = "https://files.example/dl/v1-" + b64(b"password=" + PASSWORD.encode())


def test_the_same_glued_link_is_masked_in_free_text_and_in_data() -> None:
    r = Redactor()
    assert ENCODED in r.text(f"see {GLUED_LINK}")
    assert ENCODED in str(r.value({"download": GLUED_LINK}))


@pytest.mark.parametrize("shape", ["dict", "json_text"])
@pytest.mark.parametrize("where", BACKENDS)
async def test_a_result_with_a_glued_base64_link_does_not_store_the_password(
    where: str, shape: str, tmp_path: Path
) -> None:
    data = {"download": GLUED_LINK, "pages": 3}
    result = data if shape == "dict" else json.dumps(data)
    everything = await _stored_after_run(where, tmp_path, result)
    assert GLUED_LINK.split("v1-")[1].rstrip("=") not in everything


@pytest.mark.parametrize("where", BACKENDS)
async def test_the_same_link_in_a_plain_text_result_does_not_store_the_password(
    where: str, tmp_path: Path
) -> None:
    everything = await _stored_after_run(where, tmp_path, f"Download it at {GLUED_LINK} today.")
    assert GLUED_LINK.split("v1-")[1].rstrip("=") not in everything
    assert ENCODED in everything


# --- (1) MIME lines indented (a YAML block, a quoted reply) ------------------------------

MAIL = (
    b"From: a\nSubject: hi\n\nOur config:\n"  # the key's body starts the second line
    b"OPENAI_API_KEY=" + OPENAI_KEY.encode() + b"\nthanks\n"
)
MIME_LINES = base64.encodebytes(MAIL).decode().splitlines()


def _lines_holding_the_key() -> list[str]:
    """The MIME lines (57 bytes each) whose bytes hold part of the key's body."""
    start = MAIL.index(KEY_BODY.encode())
    end = start + len(KEY_BODY)
    return [line for i, line in enumerate(MIME_LINES) if i * 57 < end and (i + 1) * 57 > start]


@pytest.mark.parametrize("indent", ["    ", "> "])
@pytest.mark.parametrize("where", BACKENDS)
async def test_an_indented_mime_attachment_leaves_no_line_of_the_key(
    where: str, indent: str, tmp_path: Path
) -> None:
    text = "attachment: |\n" + "".join(f"{indent}{line}\n" for line in MIME_LINES)
    everything = await _stored_after_run(where, tmp_path, text)
    held = _lines_holding_the_key()
    assert len(held) >= 2
    assert [line for line in held if line in everything] == []


@pytest.mark.parametrize("where", BACKENDS)
async def test_an_unindented_mime_attachment_leaves_no_line_of_the_key(
    where: str, tmp_path: Path
) -> None:
    text = "attachment:\n" + "".join(f"{line}\n" for line in MIME_LINES)
    everything = await _stored_after_run(where, tmp_path, text)
    assert [line for line in _lines_holding_the_key() if line in everything] == []
    assert OPENAI_KEY not in everything


# --- (2) the count rule --------------------------------------------------------------------


@pytest.mark.parametrize(
    "line",
    ["Total tokens: 1234", "tokens: 12,345", "tokens=1_000 ok", "Prompt tokens: 51234."],
)
def test_counts_after_tokens_stay(line: str) -> None:
    assert Redactor().text(line) == line


@pytest.mark.parametrize("line", ["tokens: 1234abcDEF5678ghiJKL", "tokens: 99-AbCdEfGhIjKlMn"])
def test_a_value_glued_to_a_count_is_masked(line: str) -> None:
    assert Redactor().text(line) != line


def test_a_telegram_bot_token_after_singular_token_is_masked() -> None:
    assert TELEGRAM not in Redactor().text(f"bot token: {TELEGRAM}")


@pytest.mark.parametrize("where", BACKENDS)
async def test_a_bot_token_after_plural_tokens_is_not_stored(where: str, tmp_path: Path) -> None:
    result = f"Bot tokens: {TELEGRAM}\nrotate monthly"
    everything = await _stored_after_run(where, tmp_path, result)
    assert TELEGRAM.split(":")[1] not in everything


# --- (3) binary parts: documents holding a secret -----------------------------------------

SVG = (
    b'<svg xmlns="http://www.w3.org/2000/svg" width="10" height="10">'
    b"<!-- build: OPENAI_API_KEY=" + OPENAI_KEY.encode() + b" -->"
    b'<rect width="10" height="10"/></svg>'
)
DOTENV = b"DB_HOST=db.internal\nOPENAI_API_KEY=" + OPENAI_KEY.encode() + b"\n"


async def _stored_after_message(where: str, tmp_path: Path, message: Message) -> str:
    agent = Agent("reader", "Read the file.", [])
    async with backend(where, tmp_path) as b:
        run = await runner(Recording(["looks fine"]), b.stores).run(
            agent, message, tenant=TENANT, run_id="r-doc"
        )
        assert run.status is RunStatus.completed
        return await b.everything()


@pytest.mark.parametrize("where", BACKENDS)
async def test_an_svg_part_holding_a_key_is_not_stored(where: str, tmp_path: Path) -> None:
    message = Message(
        Role.user,
        [TextPart(text="Is this logo ok?"), BinaryPart(data=SVG, media_type="image/svg+xml")],
    )
    everything = await _stored_after_message(where, tmp_path, message)
    assert b64(SVG) not in everything


@pytest.mark.parametrize(
    "media", ["application/octet-stream", "text/plain", "application/json", "Text/Plain"]
)
@pytest.mark.parametrize("where", BACKENDS)
async def test_a_document_part_holding_a_key_is_not_stored(
    where: str, media: str, tmp_path: Path
) -> None:
    message = Message(
        Role.user, [TextPart(text="Check."), BinaryPart(data=DOTENV, media_type=media)]
    )
    everything = await _stored_after_message(where, tmp_path, message)
    assert b64(DOTENV) not in everything
    assert f"{ENCODED} (a {media} part holding a secret)" in everything


def test_a_media_type_holding_a_key_is_not_stored() -> None:
    r = Redactor()
    for media in (f'text/plain; name="{OPENAI_KEY}"', f"image/png; name={OPENAI_KEY}"):
        message = Message(Role.user, [BinaryPart(data=DOTENV, media_type=media)])
        assert OPENAI_KEY not in json.dumps(_redacted_message(message, r)), media


def test_redacting_a_message_whose_document_became_text_is_idempotent() -> None:
    r = Redactor()
    message = Message(
        Role.user,
        [
            TextPart(text="Check"),
            BinaryPart(data=DOTENV, media_type="text/plain"),
            TextPart(text="this."),
        ],
    )
    once = _redacted_message(message, r)
    assert [p["type"] for p in once["content"]] == ["text", "text", "text"]
    again = _redacted_message(message_from_json(once), r)
    assert again == once


@pytest.mark.parametrize("where", BACKENDS)
async def test_a_resume_after_a_document_became_text_sends_once_and_tells_the_model(
    where: str, tmp_path: Path
) -> None:
    booked: list[str] = []

    @tool
    def book(flight: str) -> str:
        """Book (side-effecting)."""
        booked.append(flight)
        return "booked"

    agent = Agent("booker", "Book.", [book])
    turns: list[Any] = [[("book", {"flight": "LH400"})], "done"]
    message = Message(
        Role.user,
        [
            TextPart(text="Book per the attached config."),
            BinaryPart(data=DOTENV, media_type="application/pdf"),
        ],
    )
    async with backend(where, tmp_path) as b:
        run, again = await crash_then_resume(
            agent, turns, b.stores, "r-doc-resume", crash_at=("after_tool_result", 0), input=message
        )
        assert run.status is RunStatus.completed, run.output
        assert booked == ["LH400"]
        [user] = [m for m in again.requests[-1].messages if m.role is Role.user]
        assert not isinstance(user.content, str)
        assert all(isinstance(p, TextPart) for p in user.content)
        assert f"{ENCODED} (a application/pdf part holding a secret)" in user.text
        # Both vendors' wire formats take the resumed transcript.
        openai_wire._wire_messages("Book.", again.requests[-1].messages)
        anthropic_wire._wire_turns("Book.", again.requests[-1].messages)
        everything = await b.everything()
        assert b64(DOTENV) not in everything and OPENAI_KEY not in everything

        # A replay from the first step, and `tesserix show`, read the changed part.
        again_runner = AgentRunner.from_stores(Recording(turns), b.stores)
        assert again_runner.checkpoints is not None
        steps = await again_runner.checkpoints.steps(ENC_TENANT, "r-doc-resume")
        assert steps, "no step snapshots kept"
        replayed = await again_runner.replay(
            agent,
            "r-doc-resume",
            tenant=ENC_TENANT,
            from_step=steps[0],
            stubs={"book": lambda flight: "stubbed"},
        )
        assert replayed.status is RunStatus.completed, replayed.output
        assert booked == ["LH400"]
        url = b.url
    if where == "sqlite":
        shown = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-m", "tesserix_adk", "show", "r-doc-resume", "--tenant", ENC_TENANT],
            env={**os.environ, "NO_COLOR": "1", "ADK_STORE": url},
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        out = shown.stdout + shown.stderr
        assert shown.returncode == 0, out
        assert OPENAI_KEY not in out and b64(DOTENV) not in out


# --- (4) provider credentials ---------------------------------------------------------------


def test_a_credential_of_exactly_eight_characters_is_masked() -> None:
    assert credentials(["abcd1234", "short7x", None, 12345678]) == ("abcd1234",)
    assert scrub("bad key abcd1234 given", ["abcd1234"]) == "bad key [redacted:api_key] given"
    assert scrub("longer-key-abcd1234 and abcd1234", ["abcd1234", "longer-key-abcd1234"]) == (
        "[redacted:api_key] and [redacted:api_key]"
    )


GATEWAY_KEY = "gw/Hq3+Vb8Rt5=Ym2Kp9Wz4Lc"


@pytest.mark.parametrize("echo", ["urlencoded", "base64"])
async def test_an_encoded_echo_of_the_api_key_is_never_stored(
    model_server: ModelServer, tmp_path: Path, echo: str
) -> None:
    from urllib.parse import quote

    shown = quote(GATEWAY_KEY, safe="") if echo == "urlencoded" else b64(GATEWAY_KEY.encode())
    model_server.queue(openai_error(401, f"no such key: {shown}", "invalid_request_error"))
    provider = OPENAI.provider(model_server, api_key=GATEWAY_KEY, max_retries=0)
    agent = Agent("chat", "Answer.", [])
    try:
        async with backend("sqlite", tmp_path) as b:
            run = await runner(provider, b.stores).run(agent, "hi", tenant=TENANT, run_id="r-key")
            everything = await b.everything()
    finally:
        await provider.aclose()
    assert run.status is RunStatus.failed
    assert GATEWAY_KEY in model_server.requests[0].headers.get("authorization", "")
    assert shown not in everything and shown not in (run.output or "")


async def test_an_eight_character_key_echoed_plainly_is_never_stored(
    model_server: ModelServer, tmp_path: Path
) -> None:
    key = "k8Zq2Lm9"
    model_server.queue(openai_error(401, f"invalid key {key}", "invalid_request_error"))
    provider = OPENAI.provider(model_server, api_key=key, max_retries=0)
    agent = Agent("chat", "Answer.", [])
    try:
        async with backend("sqlite", tmp_path) as b:
            run = await runner(provider, b.stores).run(agent, "hi", tenant=TENANT, run_id="r-key")
            everything = await b.everything()
    finally:
        await provider.aclose()
    assert run.status is RunStatus.failed
    assert key in model_server.requests[0].headers.get("authorization", "")
    assert key not in everything and key not in (run.output or "")
    assert "[redacted:api_key]" in (run.output or "")


# --- (5) the revision sweep's two wants -----------------------------------------------------


class _SecondWant:
    """A work index whose sweep writes (``want`` or ``wake``) are watched: ``between`` runs
    after the first write returns, before any other; ``fail_at`` makes that write (1 or 2)
    fail (a store error, or the process dying there)."""

    def __init__(self, inner: Any, *, fail: BaseException | None = None, fail_at: int = 2) -> None:
        self.inner = inner
        self.fail = fail
        self.fail_at = fail_at
        self.between: Any = None
        self.writes = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def _write(self, name: str, *args: Any, **kwargs: Any) -> Any:
        self.writes += 1
        if self.writes == self.fail_at and self.fail is not None:
            raise self.fail
        result = await getattr(self.inner, name)(*args, **kwargs)
        if self.writes == 1 and self.between is not None:
            await self.between()
        return result

    async def want(self, *args: Any, **kwargs: Any) -> None:
        await self._write("want", *args, **kwargs)

    async def wake(self, *args: Any, **kwargs: Any) -> bool:
        return bool(await self._write("wake", *args, **kwargs))


async def _parked_with_attempts(attempts: int) -> tuple[Any, Agent, Agent, Airline]:
    stores, airline = _memory(), Airline()
    old, new = _agents(airline)
    await _started(stores, new, "r1")
    await _lapsed(stores, "r1")
    assert stores.work is not None
    base = (await _entry(stores, "r1")).attempts
    for _ in range(attempts - base):
        await stores.work.want(T, "r1", agent="booking", count=1)
    await stores.work.park(T, "r1", agent="booking", reason=_mismatch("r1"))
    item = await _entry(stores, "r1")
    assert item.state is WorkState.parked and item.attempts == attempts, item
    return stores, old, new, airline


async def test_the_count_goes_on_one_per_sweep_over_many_sweeps() -> None:
    stores, _old, new, airline = await _parked_with_attempts(2)
    worker = Worker(_runner(stores), [new], parked_sweep=0)
    assert stores.work is not None
    for k in range(1, 8):
        await worker._wake_parked(formats=False)
        item = await _entry(stores, "r1")
        assert item.state is WorkState.wanted and item.attempts == 2 + k, (k, item)
        await stores.work.park(T, "r1", agent="booking", reason=_mismatch("r1"))
    assert airline.bookings == []


@pytest.mark.parametrize("fail_at", [1, 2])
@pytest.mark.parametrize("how", ["store_error", "crash"])
async def test_a_failure_in_the_sweeps_wake_keeps_the_attempt_count(how: str, fail_at: int) -> None:
    """Wherever the wake's writes fail (a store error, or the process dying), the run is
    left parked or woken with its count, never with the count started again."""
    stores, _old, new, _airline = await _parked_with_attempts(5)
    worker = Worker(_runner(stores), [new], parked_sweep=0)
    fail: BaseException = (
        StoreUnavailableError("the work index went away")
        if how == "store_error"
        else SimulatedCrash("died in the wake")
    )
    proxy = _SecondWant(stores.work, fail=fail, fail_at=fail_at)
    worker.work = proxy
    # A process that died there: what is stored is what counts.
    with contextlib.suppress(SimulatedCrash):
        await worker._wake_parked(formats=False)
    item = await _entry(stores, "r1")
    assert item.attempts >= 5, item


async def test_an_old_worker_parking_the_run_right_after_the_wake_keeps_the_count() -> None:
    stores, old, new, airline = await _parked_with_attempts(5)
    fast = Backoff(base=0.001, cap=0.001)
    old_worker = Worker(_runner(stores), [old], backoff=fast)
    new_worker = Worker(_runner(stores), [new], parked_sweep=0)
    proxy = _SecondWant(stores.work)

    async def old_takes() -> None:
        item = await _entry(stores, "r1")
        await old_worker._carry(item)

    proxy.between = old_takes
    new_worker.work = proxy
    await new_worker._wake_parked(formats=False)
    item = await _entry(stores, "r1")
    assert parked_for(item, RevisionMismatchError), item
    assert airline.bookings == []
    assert item.attempts >= 5, item


async def test_an_old_worker_parking_the_run_before_the_wake_is_left_to_the_next_sweep() -> None:
    """Between the sweep's read and its wake, an old worker takes the run and parks it
    again, in its own words: the wake, of what was read, writes nothing; the next sweep
    wakes it with the count going on."""
    stores, old, new, airline = await _parked_with_attempts(5)
    fast = Backoff(base=0.001, cap=0.001)
    old_worker = Worker(_runner(stores), [old], backoff=fast)
    new_worker = Worker(_runner(stores), [new], parked_sweep=0)
    assert isinstance(stores.work, WakesParked)
    read = await _entry(stores, "r1")
    await old_worker._carry(read)
    again = await _entry(stores, "r1")
    assert parked_for(again, RevisionMismatchError) and again.reason != read.reason, again
    assert not await stores.work.wake(
        T, "r1", agent=read.agent, attempts=read.attempts, reason=read.reason
    )
    assert await _entry(stores, "r1") == again
    await new_worker._wake_parked(formats=False)
    item = await _entry(stores, "r1")
    assert (item.state, item.attempts) == (WorkState.wanted, again.attempts + 1), item
    assert again.attempts >= 5
    assert airline.bookings == []


async def test_a_new_worker_taking_the_run_between_the_wants_sends_nothing_twice() -> None:
    stores, _old, new, airline = await _parked_with_attempts(3)
    taker = Worker(_runner(stores), [new])
    sweeper = Worker(_runner(stores), [new], parked_sweep=0)
    proxy = _SecondWant(stores.work)

    async def new_takes() -> None:
        await taker._carry(await _entry(stores, "r1"))

    proxy.between = new_takes
    sweeper.work = proxy
    await sweeper._wake_parked(formats=False)
    item = await _entry(stores, "r1")
    assert item.state is WorkState.done, item  # finished by the taker; not revived
    assert len(airline.bookings) == 1
