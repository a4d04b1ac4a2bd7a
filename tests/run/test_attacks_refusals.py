"""An attacker's look at the refusals of e29ae79..HEAD: a call whose id, name or arguments
hold a lone surrogate (``_within_nesting``/``_carriable``), or whose custom key would hold
what the redactor masks (``without_secret_keys``/``_key_holds_a_secret``), is answered "not
sent" and ``outstanding_calls`` gives it no key; ``left_open``/``left_in_doubt``/
``as_seen_now`` drive ``inspect``, ``runs --stuck`` and the console; ``cli.failures.explain``
redacts error sentences; ``timestamps.shown_time`` clamps times. SQLite under ``tmp_path``
and ``memory://``; no Temporal, no servers.

Defects (each an ``xfail(strict=True)`` test asserting the right behaviour until fixed; all
are fixed since (f94d07d; calls sharing an id in an approved turn after it; error sentences
showing the run id and store path the operator gave as given, ``explain``'s ``told``), their
tests plain):

1. (e29ae79, HIGH) A side-effecting call sent twice, and sent without a key. The loop takes
   a call for refused when its arguments merely *hold* the key ``__tesserix_refused__``
   (``_refused``: ``REFUSED_ARGUMENTS in call.arguments``) and gives it no key and
   ``side_effects=False``; the dispatch answers "not sent" only when that key's value is
   not ``None`` (``arguments.get(REFUSED_ARGUMENTS) is not None``). A model that writes
   ``"__tesserix_refused__": null`` beside real arguments of a tool that does not refuse
   extra arguments (every MCP tool: the server validates) has the call sent *unclaimed,
   with no idempotency key* (the server cannot dedupe), recorded in the frontier as a
   call without side effects; after a death in it, the resume plans it "no side effects;
   sent again" and sends the booking a second time. (Before e29ae79 such a call was keyed
   and claimed like any other.)
2. (8f98f66/e29ae79, low-medium) An approval is asked for a call that will never be sent.
   ``ask_approval`` and ``_asks_a_person`` look only at the tool's ``requires_approval``:
   a refused call (lone surrogate, or a key that would hold a secret) of such a tool makes
   the run wait on a person (``waiting_approval``, no worker carries it) for a request
   whose only call is the refusal's stand-in. Approving it sends nothing (held), so the
   person is asked a question whose answer changes nothing, and the README's "Approve →
   the call is dispatched once" is not what they get.
3. (e29ae79, medium) Wrong ``DivergedRunError``: a worker (``tesserix worker``/``run
   --resume`` take no ``extra_patterns``) bills a customer and dies before its frontier;
   the application (which masks its customer ids) resumes past the frontier; the model asks
   for exactly the call that ran; the application's ``without_secret_keys`` turns it into
   a refusal, so ``_refuse_divergence`` says the call "was not asked for again": exit 4,
   for ever, nothing an operator can resolve. The record is there already; its outcome
   should be replayed (the reverse order, refused first, held: at most one send).
4. (e29ae79, medium) A secret reaches the store. ``without_secret_keys`` counts a twin's
   occurrence over every twin; ``outstanding_calls`` skips the refused ones. With a key
   function that takes ``occurrence`` (documented), twins whose first one is refused have
   the second checked at occurrence 1 and keyed at occurrence 0: the key that was judged
   to hold a secret is the one stored in ``adk_idempotency`` and handed to the tool.
5. (e29ae79, low-medium) A legitimate business key is refused as a secret because of the
   kit's own tenant prefix: ``key_for`` makes ``<tenant>/<key>`` and ``_key_holds_a_secret``
   runs the redactor on that. Tenant ``AcmeHoldings`` + ``/`` + a 27-character KSUID is 40
   base64 characters with a ``/`` and both cases: the standalone AWS-secret pattern. Every
   such call is "not sent"; the same order under tenant ``Acme`` is sent.
6. (e29ae79/8f98f66, low) ``inspect`` (and ``--json``, the console) tells a refused call as
   ``never_ran - no side effects; sent again``: the refusal writes the call into the
   frontier with ``side_effects=False``, and planning reads that as a read-only call. A
   refused money transfer is neither without side effects nor sent again.
7. (d23c63f, medium) ``left_open`` leaves out an *idempotent side-effecting* call an
   ended run left in flight: the airline booked the seat, the process died before the
   outcome was recorded, the resumed model answered without asking again (or the run was
   cancelled). Nobody will ever send that call again, yet ``runs --stuck`` and ``inspect``
   say nothing: the booking exists and no one is told. "Safe to send again" is about a
   resume sending it, which an ended run never does; such a call may have acted.
8. (approvals, low-medium; shows with refusals) Two calls of one turn under one provider
   call id (a refused one beside a whole one, or two whole ones), of a tool that needs an
   approval: once a person approves, the resume raises ``CheckpointCorruptError`` ("does
   not hold the calls it was asked for ... shows ['book', 'book'], the run asked about
   ['book', 'book']"): ``take_decision`` maps calls by id, so both names become one call.
   Nothing was damaged, yet the run must never be carried on (exit 4).
9. (636738d, low) ``explain`` redacts the whole sentence, so an id or path the operator
   needs is masked when it happens to look like a credential: run id
   ``Acme/Orders/2026/Invoice/Q3Batch/Item007`` (40 base64 characters with ``/``) is
   ``nothing is checkpointed under run '[redacted:aws_secret_key]'``; a store path such as
   ``/Users/JaneDoeSmiths/Library/Application Support/...`` loses its head, and with it the
   ``tesserix schema apply`` command the sentence tells the operator to run.
10. (636738d, low-medium) ``explain`` redacts *after* ``sentence()`` joined the lines, so a
    token wrapped across lines (which the redactor masks whole, continuation included)
    leaves its tail on the terminal: ``Bearer [redacted:bearer] ijklmnop87654321XYZW``.
11. (12cbd38, low) ``iso_time`` of a clamped early time (or NaN) is ``1-01-01T00:00:00Z``:
    not ISO 8601 (a year has four digits); ``--json`` readers (``fromisoformat``) refuse it.

What held (plain tests below): a refused call beside whole calls in a parallel turn, twins
among them, is never sent and each twin goes out once, and resuming the finished run sends
nothing; a refusal written into an ``after_model_call`` frontier stays a refusal when a
process that masks less carries the run on; a crash after a refusal refuses only the call
in doubt, and once it is resolved the run finishes with the refused call never sent;
approving a refused call sends nothing; a replay from a frontier holding a refused call
neither stubs nor sends it and writes nothing under the original run; ``explain`` still
masks an API key on one line; ``shown_time`` never raises on NaN, infinities or huge
epochs. Also seen without a test: a key function that raises on the model's arguments
(``KeyError`` for a missing field) ends the run with that bare error before any frontier
is written (charged, nothing checkpointed, ``inspect`` exit 1), as designed ("raised when
keyed"); a key function is called two or three times per call per turn (purity is its
documented contract).
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from run.helpers import Asks, Recording, answers, at, faulty_runner, fresh_stores
from tesserix_adk import (
    Agent,
    AgentRunner,
    Boundary,
    LeasePolicy,
    ModelRequest,
    ModelResponse,
    Role,
    RunStatus,
    ScriptedProvider,
    ToolCall,
    ToolContext,
    ToolOutcome,
    tool,
)
from tesserix_adk.checkpoint.checkpointer import CheckpointPolicy
from tesserix_adk.checkpoint.payload.outcomes import encode_outcome
from tesserix_adk.checkpoint.redaction import Redactor, default_redactor
from tesserix_adk.cli import ExitCode
from tesserix_adk.cli.failures import explain
from tesserix_adk.cli.main import main
from tesserix_adk.errors import (
    CheckpointCorruptError,
    IndeterminateToolCallError,
    NoCheckpointError,
    ProviderError,
)
from tesserix_adk.mcp.tools import MCPTool, ServerTool
from tesserix_adk.stores.urls import open_stores
from tesserix_adk.testing.faults import SimulatedCrash
from tesserix_adk.timestamps import iso_time, shown_time

T = "t"
SECRET = "sk-proj-AbCdEfGhIjKlMnOpQrStUvWxYz0123456789abcd"
ODD = "LH\ud83d"  # half a surrogate pair, as a stream cut in an emoji leaves it
CUSTOMER = "ACME-123456"
EXTRA = (r"ACME-\d{6}",)
FAST = LeasePolicy(ttl=2.0, renew_within=1.0)
ONLY_AFTER_TOOLS = CheckpointPolicy(boundaries={Boundary.after_tool_result})
REFUSED = "__tesserix_refused__"


# --- helpers ------------------------------------------------------------------------------


def _main(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(list(argv))
    seen = capsys.readouterr()
    return code, seen.out, seen.err


def _keys(path: Path) -> list[str]:
    with contextlib.closing(sqlite3.connect(path)) as conn:
        return [str(k) for (k,) in conn.execute("SELECT key FROM adk_idempotency")]


@pytest.fixture(autouse=True)
def _quiet(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No traceback added to the CLI's sentences under ``ADK_DEBUG``."""
    monkeypatch.delenv("ADK_DEBUG", raising=False)
    yield


# ==========================================================================================
# Defects
# ==========================================================================================

# --- 1. the refusal's stand-in, written by the model, sends a call unkeyed (twice) --------


def _mcp_booking(sent: list[tuple[dict[str, Any], str | None]], die: dict[str, bool]) -> Agent:
    async def send(name: str, arguments: Any, *, key: str | None) -> str:
        sent.append((dict(arguments), key))
        if die["on"]:
            raise SimulatedCrash("the process died while the server booked the seat")
        return "booked"

    listed = ServerTool(
        name="book_seat",
        description="Book a seat (side effects: no readOnlyHint).",
        input_schema={"type": "object", "properties": {"flight": {"type": "string"}}},
    )
    return Agent("mcp-booker", "Book.", [MCPTool(listed, send)])


@pytest.mark.parametrize("where", ["sqlite", "memory"])
async def test_a_model_writing_the_refusal_key_never_gets_a_call_sent_unkeyed_or_twice(
    tmp_path: Path, where: str
) -> None:
    sent: list[tuple[dict[str, Any], str | None]] = []
    die = {"on": True}
    agent = _mcp_booking(sent, die)
    turn = [ToolCall(id="c1", name="book_seat", arguments={"flight": "LH1", REFUSED: None})]
    async with fresh_stores(where, tmp_path) as stores:
        with contextlib.suppress(SimulatedCrash):
            await AgentRunner.from_stores(Asks(turn), stores).run(
                agent, "book", tenant=T, run_id="r"
            )
        die["on"] = False
        # Whatever the resume decides (refuse the call in doubt, or say "not sent"):
        with contextlib.suppress(IndeterminateToolCallError):
            await AgentRunner.from_stores(Asks(turn), stores).resume(agent, "r", tenant=T)
    assert len(sent) <= 1, sent  # today: two bookings
    assert all(key is not None for _, key in sent), sent  # today: sent with no key at all


# --- 2. an approval asked for a call that will never be sent ------------------------------


def _wire_agent(sent: list[str]) -> Agent:
    @tool(requires_approval=True, key=lambda **kw: f"wire-{kw['arguments']['account']}")
    def wire(account: str, ctx: ToolContext) -> str:
        """Wire money to an account; a person approves each transfer."""
        sent.append(account)
        return "wired"

    return Agent("bank", "Wire.", [wire])


_NEVER_SENT = {
    "lone surrogate": ToolCall(id="c1", name="wire", arguments={"account": ODD}),
    "secret key": ToolCall(id="c1", name="wire", arguments={"account": SECRET}),
}


@pytest.mark.parametrize("why", sorted(_NEVER_SENT))
async def test_no_approval_is_asked_for_a_call_the_kit_refuses(tmp_path: Path, why: str) -> None:
    sent: list[str] = []
    provider = Asks([_NEVER_SENT[why]])
    async with fresh_stores("sqlite", tmp_path) as stores:
        run = await AgentRunner.from_stores(provider, stores).run(
            _wire_agent(sent), "wire", tenant=T, run_id="r"
        )
    assert sent == []  # held: never sent
    assert run.pending_approval is None, run.pending_approval
    assert run.status is RunStatus.completed
    [told] = answers(provider.requests[-1], "wire")
    assert told.is_error and "not sent" in told.text


# --- 3. wrong DivergedRunError: the process that resumes masks more -----------------------


def _biller(sent: list[str | None]) -> Agent:
    @tool(side_effects=False)
    def look(q: str) -> str:
        """Look something up."""
        return "found"

    @tool(key=lambda **kw: f"invoice-{kw['arguments']['customer']}")
    def bill(customer: str, ctx: ToolContext) -> str:
        """Bill a customer once; the billing service dedupes by our key."""
        sent.append(ctx.idempotency_key)
        return "billed"

    return Agent("biller", "Bill the customer.", [look, bill])


async def test_a_process_that_masks_more_replays_the_call_a_worker_already_made(
    tmp_path: Path,
) -> None:
    sent: list[str | None] = []
    agent = _biller(sent)
    turns = [[("look", {"q": "who"})], [("bill", {"customer": CUSTOMER})], "done"]
    async with fresh_stores("sqlite", tmp_path) as stores:
        # `tesserix worker` (no extra patterns) bills, then dies before its frontier.
        worker = faulty_runner(
            stores,
            ScriptedProvider(turns),
            crash_before=at("after_tool_result", 1),
            lease_policy=FAST,
            policy=ONLY_AFTER_TOOLS,
        )
        with pytest.raises(SimulatedCrash):
            await worker.run(agent, "bill ACME", tenant=T, run_id="r")
        assert sent == [f"{T}/invoice-{CUSTOMER}"]
        # The application, which masks its customer ids, carries the run on.
        app = AgentRunner.from_stores(
            ScriptedProvider(turns), stores, policy=ONLY_AFTER_TOOLS, extra_patterns=EXTRA
        )
        resumed = await app.resume(agent, "r", tenant=T)  # today: DivergedRunError
    assert resumed.status is RunStatus.completed
    assert len(sent) == 1, sent


# --- 4. twins keyed by occurrence: the refused twin shifts the count ----------------------


async def test_a_twin_is_keyed_as_it_was_checked_and_no_secret_is_stored(tmp_path: Path) -> None:
    path = tmp_path / "adk.sqlite3"
    sent: list[str | None] = []

    def by_card(
        *, tenant: str, run_id: str, iteration: int, tool: str, arguments: Any, occurrence: int
    ) -> str:
        return f"charge-{arguments['cards'][occurrence]}"  # one card per twin, in order

    @tool(key=by_card)
    def charge(cards: list[str], ctx: ToolContext) -> str:
        """Charge the cards, one per call."""
        sent.append(ctx.idempotency_key)
        return "charged"

    cards = {"cards": [SECRET, "tok_4242"]}
    turns = [[("charge", cards), ("charge", cards)], "done"]
    async with fresh_stores("sqlite", tmp_path) as stores:
        run = await AgentRunner.from_stores(ScriptedProvider(turns), stores).run(
            Agent("payer", "Pay.", [charge]), "pay", tenant=T, run_id="r"
        )
    assert run.status is RunStatus.completed
    assert all(SECRET not in str(k) for k in sent), sent  # today: the tool gets the secret
    assert all(SECRET not in k for k in _keys(path)), _keys(path)  # and the store keeps it


# --- 5. the kit's own tenant prefix makes a business key look like a secret ---------------


async def test_a_business_key_is_not_refused_because_of_the_tenant_prefix(tmp_path: Path) -> None:
    sent: list[str | None] = []

    @tool(key=lambda **kw: str(kw["arguments"]["order"]))
    def ship(order: str, ctx: ToolContext) -> str:
        """Ship an order once; the warehouse dedupes by our key."""
        sent.append(ctx.idempotency_key)
        return "shipped"

    agent = Agent("shipper", "Ship.", [ship])
    ksuid = "2NfXpQ7bLkR9sTzVw4YcD1gHj8M"  # a KSUID: 27 base62 characters
    turns = [[("ship", {"order": ksuid})], "done"]
    assert not default_redactor().changed({"order": ksuid})  # nothing secret was asked
    async with fresh_stores("sqlite", tmp_path) as stores:
        for tenant in ("Acme", "AcmeHoldings"):
            await AgentRunner.from_stores(ScriptedProvider(turns), stores).run(
                agent, "ship", tenant=tenant, run_id="r"
            )
    assert sent == [f"Acme/{ksuid}", f"AcmeHoldings/{ksuid}"], sent  # today: Acme only


# --- 6. inspect tells a refused call as read-only and "sent again" ------------------------


def _refusal_then_crash_in_a_booking(url: str) -> None:
    """A turn of a refused money transfer beside a booking the process died in."""

    @tool
    def wire(account: str) -> str:
        """Wire money (side effects)."""
        raise AssertionError("a refused call is never sent")

    @tool
    def book(flight: str) -> str:
        """Book a seat."""
        raise SimulatedCrash("died inside the booking")

    turn = [
        ToolCall(id="c1", name="wire", arguments={"account": ODD}),
        ToolCall(id="c2", name="book", arguments={"flight": "LH1"}),
    ]

    async def go() -> None:
        async with open_stores(url) as stores:
            await stores.create_schema()
            with pytest.raises(SimulatedCrash):
                await AgentRunner.from_stores(Asks(turn), stores).run(
                    Agent("bank", "Wire.", [wire, book]), "go", tenant=T, run_id="r"
                )

    asyncio.run(go())


def test_inspect_never_says_a_refused_call_has_no_side_effects_or_is_sent_again(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"sqlite:///{tmp_path / 'adk.sqlite3'}"
    _refusal_then_crash_in_a_booking(url)
    code, out, err = _main(capsys, "--store", url, "inspect", "r", "--tenant", T)
    assert code == ExitCode.CARRIED_ON, err
    assert "book (c2): indeterminate" in out, out  # held: the booking is in doubt
    [line] = [s for s in out.splitlines() if s.startswith("wire (c1)")]
    assert "sent again" not in line and "no side effects" not in line, line
    assert "not sent" in line or "refused" in line, line


# --- 7. an idempotent booking an ended run left in flight is nobody's question ------------


def _idempotent_booking_left_in_flight(url: str, *, then: str) -> list[str]:
    booked: list[str] = []
    die = {"on": True}

    @tool(side_effects=False)
    def search(q: str) -> str:
        """Search flights."""
        return "LH1"

    @tool(idempotent=True)
    def book(flight: str, ctx: ToolContext) -> str:
        """Book a seat; the airline dedupes by our key."""
        booked.append(flight)
        if die["on"]:
            raise SimulatedCrash("died right after the airline booked")
        return "booked"

    agent = Agent("travel", "Book.", [search, book])
    first = [[("search", {"q": "x"})], [("book", {"flight": "LH1"})], "done"]
    again = [[("search", {"q": "x"})], "I could not book a seat; try again later."]

    async def go() -> None:
        async with open_stores(url) as stores:
            await stores.create_schema()
            runner = AgentRunner.from_stores(
                ScriptedProvider(first), stores, policy=ONLY_AFTER_TOOLS, lease_policy=FAST
            )
            with pytest.raises(SimulatedCrash):
                await runner.run(agent, "book", tenant=T, run_id="r")
            die["on"] = False
            later = AgentRunner.from_stores(
                ScriptedProvider(again), stores, policy=ONLY_AFTER_TOOLS, lease_policy=FAST
            )
            if then == "carried on":
                run = await later.resume(agent, "r", tenant=T)
                assert run.status is RunStatus.completed
            else:
                await later.cancel("r", tenant=T, by="ops")

    asyncio.run(go())
    return booked


@pytest.mark.parametrize("then", ["carried on", "cancelled"])
def test_an_idempotent_booking_an_ended_run_left_in_flight_is_listed_and_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], then: str
) -> None:
    url = f"sqlite:///{tmp_path / 'adk.sqlite3'}"
    booked = _idempotent_booking_left_in_flight(url, then=then)
    assert booked == ["LH1"]  # the airline holds a seat nobody recorded
    code, out, err = _main(capsys, "--store", url, "runs", "--tenant", T, "--stuck")
    assert code == ExitCode.CARRIED_ON and out.startswith("r "), (out, err)
    code, out, err = _main(capsys, "--store", url, "inspect", "r", "--tenant", T)
    assert code == ExitCode.CARRIED_ON, err
    assert "book (" in out and "tesserix resolve" in out, out


# --- 8. two calls of one turn under one id, approved ---------------------------------------


_ONE_ID = {
    "one refused": [
        ToolCall(id="c1", name="book", arguments={"flight": ODD}),
        ToolCall(id="c1", name="book", arguments={"flight": "LH1"}),
    ],
    "both whole": [
        ToolCall(id="c1", name="book", arguments={"flight": "LH2"}),
        ToolCall(id="c1", name="book", arguments={"flight": "LH1"}),
    ],
}


@pytest.mark.parametrize(
    "turn",
    [
        # Fixed: a refused call asks nobody, so the request names the whole call only.
        "one refused",
        # Fixed too: take_decision matches the request's ids in order, one call each.
        "both whole",
    ],
)
async def test_an_approved_turn_whose_calls_share_an_id_is_carried_on(turn: str) -> None:
    sent: list[str] = []

    @tool(requires_approval=True)
    def book(flight: str) -> str:
        """Book a seat; a person approves."""
        sent.append(flight)
        return "booked"

    agent = Agent("booker", "Book.", [book])
    async with open_stores("memory://") as stores:
        runner = AgentRunner.from_stores(Asks(_ONE_ID[turn]), stores)
        waiting = await runner.run(agent, "book", tenant=T, run_id="r")
        assert waiting.pending_approval is not None
        await stores.approvals.decide(T, waiting.pending_approval.id, approved=True, by="ops")
        try:
            run = await runner.resume(agent, "r", tenant=T)
        except CheckpointCorruptError as exc:  # today
            pytest.fail(f"nothing was damaged, yet: {exc}")
    assert run.status is RunStatus.completed
    whole = [c.arguments["flight"] for c in _ONE_ID[turn] if c.arguments["flight"] != ODD]
    assert sorted(sent) == sorted(whole)


# --- 9. explain masks what the operator needs ---------------------------------------------

RUN_ID = "Acme/Orders/2026/Invoice/Q3Batch/Item007"  # 40 base64 characters, with "/"


def test_an_error_sentence_keeps_the_run_id_it_names(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"sqlite:///{tmp_path / 'adk.sqlite3'}"

    async def schema() -> None:
        async with open_stores(url) as stores:
            await stores.create_schema()

    asyncio.run(schema())
    code, _out, err = _main(capsys, "--store", url, "inspect", RUN_ID, "--tenant", T)
    assert code == ExitCode.NOTHING_CHECKPOINTED, err  # held: exit 1, one sentence
    assert err.count("\n") == 1 and "Traceback" not in err, err  # held
    assert RUN_ID in err, err


def test_an_error_sentence_keeps_the_store_path_it_names(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The characters after "data-" up to ".sqlite3": 40 of [A-Za-z0-9/], both cases.
    head = "Tenants/AcmeCorp/Production/"
    stem = "Store" + "x" * (40 - len(head) - len("Store"))
    where = tmp_path / "data-Tenants" / "AcmeCorp" / "Production"
    assert len(f"{head}{stem}") == 40
    path = where / f"{stem}.sqlite3"
    code, _out, err = _main(capsys, "--store", f"sqlite:///{path}", "inspect", "r", "--tenant", T)
    assert code == ExitCode.NOTHING_CHECKPOINTED, err  # held: exit 1, one sentence
    assert "schema apply" in err, err  # held
    assert str(path) in err, err


# --- 10. explain redacts after joining lines: a wrapped token's tail is printed -----------


@pytest.mark.parametrize(
    ("text", "tail"),
    [
        ("Authorization: Bearer abcdefgh12345678\n  ijklmnop87654321XYZW", "ijklmnop87654321XYZW"),
        ("the provider refused sk-proj-AbCdEfGhIjKlMnOpQrSt\nUvWxYz0123456789abcd", "UvWxYz01"),
    ],
)
def test_an_error_sentence_masks_a_wrapped_token_whole(text: str, tail: str) -> None:
    assert tail not in default_redactor().text(text)  # held: the redactor masks it whole
    for exc in (ProviderError(text, retryable=False), RuntimeError(text)):
        code, said = explain(exc)
        assert code == ExitCode.MUST_NOT_CARRY_ON
        assert tail not in said, said


# --- 11. a clamped early time is not ISO 8601 ----------------------------------------------


@pytest.mark.parametrize("epoch", [float("nan"), float("-inf"), -1e20])
def test_a_clamped_early_time_is_still_iso_8601(epoch: float) -> None:
    shown = iso_time(epoch)
    assert datetime.fromisoformat(shown.replace("Z", "+00:00")).year == 1, shown


# ==========================================================================================
# What held
# ==========================================================================================


@pytest.mark.parametrize("where", ["sqlite", "memory"])
async def test_a_refused_call_beside_twins_in_a_parallel_turn_is_never_sent(
    tmp_path: Path, where: str
) -> None:
    sent: list[str | None] = []

    @tool(key=lambda **kw: f"charge-{kw['arguments']['card']}")
    def charge(card: str, ctx: ToolContext) -> str:
        """Charge a card."""
        sent.append(ctx.idempotency_key)
        return "charged"

    @tool
    async def book(flight: str, ctx: ToolContext) -> str:
        """Book a seat."""
        await asyncio.sleep(0)
        sent.append(ctx.idempotency_key)
        return "booked"

    agent = Agent("mixed", "Do it.", [charge, book], parallel_tool_calls=4)
    turn = [
        ToolCall(id="a", name="charge", arguments={"card": SECRET}),
        ToolCall(id="b", name="book", arguments={"flight": "LH1"}),
        ToolCall(id="c", name="book", arguments={"flight": ODD}),
        ToolCall(id="d", name="book", arguments={"flight": "LH1"}),
    ]
    provider = Asks(turn)
    async with fresh_stores(where, tmp_path) as stores:
        runner = AgentRunner.from_stores(provider, stores)
        run = await runner.run(agent, "go", tenant=T, run_id="r")
        again = await runner.resume(agent, "r", tenant=T)
    assert run.status is RunStatus.completed and again.status is RunStatus.completed
    assert len(sent) == 2 and len(set(sent)) == 2, sent  # the twins, once each
    told = {m.tool_call_id: m for m in provider.requests[-1].messages if m.tool_call_id}
    assert told["a"].is_error and "not sent" in told["a"].text
    assert told["c"].is_error and "not sent" in told["c"].text
    assert not told["b"].is_error and not told["d"].is_error


async def test_a_refusal_in_the_frontier_stays_one_for_a_process_that_masks_less(
    tmp_path: Path,
) -> None:
    sent: list[str | None] = []
    agent = _biller(sent)
    turns = [[("bill", {"customer": CUSTOMER}), ("look", {"q": "who"})], "done"]

    class _DiesInTheLookup:
        def __init__(self) -> None:
            self.inner = ScriptedProvider(turns)

        async def complete(self, request: ModelRequest) -> ModelResponse:
            if any(m.role is Role.tool for m in request.messages):
                raise SimulatedCrash("died before the second model call")
            response: ModelResponse = await self.inner.complete(request)
            return response

    async with fresh_stores("sqlite", tmp_path) as stores:
        app = AgentRunner.from_stores(_DiesInTheLookup(), stores, extra_patterns=EXTRA)
        with pytest.raises(SimulatedCrash):
            await app.run(agent, "bill", tenant=T, run_id="r")
        cli = AgentRunner.from_stores(ScriptedProvider(turns), stores)
        run = await cli.resume(agent, "r", tenant=T)
    assert run.status is RunStatus.completed
    assert sent == []


async def test_a_crash_after_a_refusal_refuses_only_the_call_in_doubt(tmp_path: Path) -> None:
    paid: list[str | None] = []
    booked: list[str] = []
    die = {"on": True}

    @tool(key=lambda **kw: f"charge-{kw['arguments']['card']}")
    def charge(card: str, ctx: ToolContext) -> str:
        """Charge a card."""
        paid.append(ctx.idempotency_key)
        return "charged"

    @tool
    def book(flight: str) -> str:
        """Book a seat."""
        booked.append(flight)
        if die["on"]:
            raise SimulatedCrash("died inside the booking")
        return "booked"

    agent = Agent("payer", "Pay and book.", [charge, book])
    turns = [[("charge", {"card": SECRET}), ("book", {"flight": "LH1"})], "done"]
    async with fresh_stores("sqlite", tmp_path) as stores:
        with pytest.raises(SimulatedCrash):
            await AgentRunner.from_stores(ScriptedProvider(turns), stores).run(
                agent, "go", tenant=T, run_id="r"
            )
        die["on"] = False
        with pytest.raises(IndeterminateToolCallError) as refused:
            await AgentRunner.from_stores(ScriptedProvider(turns), stores).resume(
                agent, "r", tenant=T
            )
        [doubt] = refused.value.calls
        assert doubt.tool == "book" and doubt.key is not None
        booked_outcome = encode_outcome(
            ToolOutcome(call_id=doubt.call_id, content="booked"), Redactor()
        )
        await stores.idempotency.resolve(doubt.key, booked_outcome, tenant=T, by="ops")
        provider = Recording(ScriptedProvider(turns))
        run = await AgentRunner.from_stores(provider, stores).resume(agent, "r", tenant=T)
    assert run.status is RunStatus.completed
    assert paid == [] and booked == ["LH1"]
    [told] = answers(provider.requests[-1], "charge")
    assert told.is_error and "not sent" in told.text


async def test_approving_a_refused_call_sends_nothing() -> None:
    sent: list[str] = []
    agent = _wire_agent(sent)
    async with open_stores("memory://") as stores:
        provider = Asks([_NEVER_SENT["secret key"]])
        runner = AgentRunner.from_stores(provider, stores)
        run = await runner.run(agent, "wire", tenant=T, run_id="r")
        if run.pending_approval is not None:  # defect 2: asked at all
            assert SECRET not in repr(run.pending_approval)
            await stores.approvals.decide(T, run.pending_approval.id, approved=True, by="ops")
            run = await runner.resume(agent, "r", tenant=T)
    assert run.status is RunStatus.completed
    assert sent == []
    [told] = answers(provider.requests[-1], "wire")
    assert told.is_error and "not sent" in told.text


async def test_a_replay_from_a_frontier_holding_a_refused_call_stubs_and_sends_nothing(
    tmp_path: Path,
) -> None:
    sent: list[str] = []
    stubbed: list[str] = []

    @tool
    def book(flight: str) -> str:
        """Book a seat."""
        sent.append(flight)
        return "booked"

    agent = Agent("booker", "Book.", [book])
    turn = [
        ToolCall(id="c1", name="book", arguments={"flight": ODD}),
        ToolCall(id="c2", name="book", arguments={"flight": "LH1"}),
    ]
    async with fresh_stores("sqlite", tmp_path) as stores:
        runner = AgentRunner.from_stores(Asks(turn), stores)
        first = await runner.run(agent, "book", tenant=T, run_id="r")
        assert first.status is RunStatus.completed and sent == ["LH1"]
        before = await stores.checkpoints.steps(T, "r")
        replayed = await AgentRunner.from_stores(Asks(turn), stores).replay(
            agent,
            "r",
            tenant=T,
            from_step=1,
            stubs={"book": lambda flight: stubbed.append(flight) or {"ok": True}},
            new_run_id="r-replay",
        )
        assert await stores.checkpoints.steps(T, "r") == before
    assert replayed.status is RunStatus.completed
    assert sent == ["LH1"] and stubbed == ["LH1"]


def test_explain_still_masks_a_key_on_one_line() -> None:
    code, said = explain(ProviderError(f"bad key {SECRET}", retryable=False))
    assert code == ExitCode.MUST_NOT_CARRY_ON
    assert SECRET not in said and "bad key" in said
    code, said = explain(NoCheckpointError("no frontier for run 'orders-2026-5'"))
    assert "orders-2026-5" in said


@pytest.mark.parametrize("epoch", [float("nan"), float("inf"), float("-inf"), 2.0**80, -(2.0**80)])
def test_shown_time_never_raises(epoch: float) -> None:
    assert shown_time(epoch, "%Y-%m-%d")
