"""Attack on two changes: ``runs --stuck``, the console and ``inspect`` asking what a
resume asks (``cli/reasons.left_for_a_person``, ``blocked(refused=...)``, ``carriable``;
8017ad8), and ``run.events.ProgressListener`` with ``arguments_from_text`` reading
arguments sent as an object (5e87369). SQLite, the real OpenAI SDK against the fake model
server. Not a copy of ``test_attacks_stuck_oracle.py``.

Found, and fixed unless marked left (the listings catch a newer release's record as they
catch a damaged one; ``carriable`` asks ``state_refused`` and
``nothing_ran_since_approval_asked``; a refusal counts only with no live lease; streamed
arguments sent as one object are read as it):

MEDIUM
- ``test_a_newer_format_outcome_of_one_run_hides_no_other``: one run's completed record
  written by a newer release (outcome format 5, a rolling upgrade) makes ``tesserix runs``
  and ``runs --stuck`` exit 4 and the console's run list raise, hiding every other run
  (README: one run's damage hides no other). ``cli/listing.py`` ``_rows`` and
  ``console/reads.py`` ``runs`` catch only ``CheckpointCorruptError`` around
  ``left_for_a_person``, whose ``carried_state`` raises ``CheckpointFormatError``.
- ``test_inspect_and_runs_stuck_agree_on_a_masked_record_state``: a run whose last
  completed call recorded a masked state is listed by ``runs --stuck`` ("every resume
  refuses it") and refused by every resume, yet ``inspect --json`` says ``"safe": true``
  (the console's "can be carried on" too): ``carriable`` asks ``uncarriable(cp)`` and the
  plan, never ``carried_state``.
- ``test_a_run_its_live_holder_carries_is_not_listed_stuck``: a run whose frontier state
  was masked is listed by ``runs --stuck`` and the console ("every resume refuses it")
  while its live holder carries it on and completes it; README keeps such runs only with
  no live lease. ``blocked`` returns ``refused`` whatever the lease.
- ``test_streamed_arguments_sent_as_an_object_are_read_as_plain_ones``: the fix reads
  object arguments on the plain endpoint only; streamed (``stream()``/``run(on_event=)``),
  ``providers/openai.py`` ``_StreamedReply.whole`` joins the fragments as text (TypeError),
  so the same server leaves a streamed run charged and stopped retryably, never answered.

LOW
- (left: reading every completed outcome of every run to list them costs a read of each outcome; a
  resume names it) ``test_flipped_outcome_of_a_stateless_run_is_listed_stuck``: flipped outcome
  bytes in a completed record of a run without state: every resume refuses it (corrupt at replay),
  yet ``runs --stuck`` leaves it out and ``inspect`` says safe (the outcome is read only via
  ``carried_state``, which a stateless run skips); with state the same damage is listed.
- ``test_waiting_and_before_approval_runs_are_not_listed_stuck``: ``inspect`` says
  ``"safe": false`` (call "indeterminate") of an unkeyed call waiting on an approval, which
  ``runs --stuck`` leaves out and the resume carries on once approved: ``carriable`` does
  not ask ``nothing_ran_since_approval_asked``.

Held:
- ``test_damaged_records_of_one_run_hide_no_other``: flipped outcome bytes (run with state)
  and a record renamed to a tool its turn never asked for: listed ``unreadable`` by
  ``runs``, ``runs --stuck`` and the console, exit 0, the other run still listed and
  carried on; the resume refuses both as corrupt.
- ``test_the_refusal_words_keep_the_secret_out``: the "every resume refuses it" text in
  ``runs`` (text, JSON), ``inspect``, ``show`` and the console holds no secret, and an odd
  run id in it is escaped.
- ``test_waiting_and_before_approval_runs_are_not_listed_stuck`` (its listing part): not
  stuck, and sent once after approval.
- ``test_a_progress_listener_keeps_the_wire_plain_and_a_sink_streams``: a
  ``ProgressListener`` keeps the plain endpoint and hears the run; a plain function
  streams; object arguments with a number key and nested ``null``s never send a call twice;
  each run charged exactly its two answered calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from processes import store_url
from providers.fake_server import ModelServer, Reply, openai_stream
from providers.vendors import OPENAI
from tesserix_adk import (
    Agent,
    AgentRunner,
    LeasePolicy,
    RunStatus,
    ScriptedProvider,
    open_stores,
    tool,
)
from tesserix_adk.checkpoint.payload.envelope import seal
from tesserix_adk.cli import frontier_main
from tesserix_adk.console.reads import RunFilter, runs
from tesserix_adk.errors import CheckpointCorruptError, CheckpointFormatError, StateRedactedError
from tesserix_adk.providers.pricing import Price
from tesserix_adk.run.events import ProgressListener, RunEvent
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.testing.faults import SimulatedCrash

T = "acme"
SECRET = "sk-live-PLANTEDst4ckFixesSecret0123456789"
SHORT = LeasePolicy(ttl=0.3, renew_within=0.1)
TWO_IN_ONE: list[Any] = [[("remember", {"x": "1"}), ("look", {"x": "2"})], "Done."]


@contextlib.asynccontextmanager
async def opened(backend: str, tmp: Path) -> AsyncIterator[tuple[Stores, str]]:
    async with store_url(backend, tmp) as url, open_stores(url) as stores:
        await stores.create_schema()
        yield stores, url


async def cli(url: str, *argv: str) -> tuple[int, str]:
    """A frontier command on stores of its own, in a thread (its own event loop)."""

    def call() -> tuple[int, str]:
        out, err = io.StringIO(), io.StringIO()
        code = frontier_main(list(argv), stores=open_stores(url), out=out, err=err)
        return code, out.getvalue() + err.getvalue()

    return await asyncio.to_thread(call)


async def listed(url: str, *extra: str) -> dict[str, dict[str, Any]]:
    code, text = await cli(url, "runs", "--tenant", T, "--json", *extra)
    assert code == 0, text
    return {r["run_id"]: r for r in json.loads(text)["runs"]}


async def inspected(url: str, run_id: str) -> dict[str, Any]:
    code, text = await cli(url, "inspect", run_id, "--tenant", T, "--json")
    assert code == 0, text
    found: dict[str, Any] = json.loads(text)
    return found


async def lapsed(stores: Stores, run_id: str) -> None:
    for _ in range(200):
        if await stores.leases.current(T, run_id) is None:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"the lease of {run_id} never lapsed")


def runner(stores: Stores, turns: list[Any]) -> AgentRunner:
    return AgentRunner.from_stores(
        ScriptedProvider(list(turns)),
        stores,
        lease_policy=SHORT,
        never_ran_margin=0.05,
        resume_claim_ttl=0.3,
    )


def stateful_agent(value: str = "plain", *, dies_once: bool = True) -> Agent:
    """``remember`` writes ``value`` into the state (when the run has one); ``look`` kills
    the "process" the first time it is sent (``dies_once``)."""
    dies = {"n": 0 if dies_once else 1}

    @tool
    def remember(x: str, ctx: Any) -> str:
        """Keep something in the run's state."""
        if ctx.state is not None:
            ctx.state["kept"] = value
        return "kept"

    @tool(side_effects=False)
    def look(x: str) -> str:
        """Look something up; the process dies inside it the first time."""
        dies["n"] += 1
        if dies["n"] == 1:
            raise SimulatedCrash("died while looking")
        return "seen"

    return Agent("stateful", "Go.", [remember, look])


async def crashed(stores: Stores, run_id: str, value: str = "plain", **kw: Any) -> None:
    """``remember`` completes and ``look`` dies in one turn; the dead lease lapses."""
    with pytest.raises(SimulatedCrash):
        await runner(stores, TWO_IN_ONE).run(
            stateful_agent(value), "go", tenant=T, run_id=run_id, **kw
        )
    await lapsed(stores, run_id)


async def resumed(stores: Stores, run_id: str) -> Any:
    return await runner(stores, TWO_IN_ONE).resume(
        stateful_agent(dies_once=False), run_id, tenant=T
    )


def database(url: str) -> str:
    assert url.startswith("sqlite:///")
    return url.removeprefix("sqlite:///")


def outcome_of(url: str, run_id: str, tool_name: str) -> bytes:
    with sqlite3.connect(database(url)) as db:
        (raw,) = db.execute(
            "SELECT outcome FROM adk_idempotency WHERE run_id = ? AND tool = ?",
            (run_id, tool_name),
        ).fetchone()
    return bytes(raw)


def write_outcome(url: str, run_id: str, tool_name: str, outcome: bytes) -> None:
    with sqlite3.connect(database(url)) as db:
        changed = db.execute(
            "UPDATE adk_idempotency SET outcome = ? WHERE run_id = ? AND tool = ?",
            (outcome, run_id, tool_name),
        ).rowcount
    assert changed == 1


def newer_format(raw: bytes) -> bytes:
    """The same outcome, sealed as a newer release would write it (format 5)."""
    body = json.loads(raw)
    body.pop("checksum")
    body["format"] = 5
    return seal(body)


# --- part 1: runs --stuck, the console and inspect ask what a resume asks ---------------


async def test_a_newer_format_outcome_of_one_run_hides_no_other(tmp_path: Path) -> None:
    async with opened("sqlite", tmp_path) as (stores, url):
        await crashed(stores, "good", state={})
        await crashed(stores, "newer", state={})
        write_outcome(url, "newer", "remember", newer_format(outcome_of(url, "newer", "remember")))
        with pytest.raises(CheckpointFormatError):
            await resumed(stores, "newer")  # every resume refuses it: a person's
        code, text = await cli(url, "runs", "--tenant", T)
        assert code == 0 and "good" in text, text
        stuck = await listed(url, "--stuck")
        assert "newer" in stuck and "good" not in stuck, stuck
        shown = {r.run_id for r in await runs(stores, T, RunFilter())}
        assert shown == {"good", "newer"}, shown


async def test_damaged_records_of_one_run_hide_no_other(tmp_path: Path) -> None:
    """A completed record whose outcome bytes were flipped (in a run with state) and one
    renamed to a tool its turn never asked for: each run is listed unreadable by ``runs``,
    ``runs --stuck`` and the console (exit 0), every other run still listed, and the
    resume refuses each as corrupt. Held."""
    async with opened("sqlite", tmp_path) as (stores, url):
        for run_id in ("good", "flipped", "ghost"):
            await crashed(stores, run_id, state={})
        raw = outcome_of(url, "flipped", "remember")
        write_outcome(url, "flipped", "remember", raw.replace(b'"plain"', b'"plaiN"', 1))
        with sqlite3.connect(database(url)) as db:
            db.execute(
                "UPDATE adk_idempotency SET tool = 'ghost' WHERE run_id = 'ghost' "
                "AND tool = 'remember'"
            )
        for run_id in ("flipped", "ghost"):
            with pytest.raises(CheckpointCorruptError):
                await resumed(stores, run_id)
        every = await listed(url)
        assert set(every) == {"good", "flipped", "ghost"}, every
        assert every["good"]["status"] == "running"
        assert {every[r]["status"] for r in ("flipped", "ghost")} == {"unreadable"}
        assert set(await listed(url, "--stuck")) == {"flipped", "ghost"}
        console = {r.run_id: r for r in await runs(stores, T, RunFilter(stuck=True))}
        assert set(console) == {"flipped", "ghost"}
        assert all(r.unreadable for r in console.values())
        assert (await resumed(stores, "good")).status is RunStatus.completed


async def test_inspect_and_runs_stuck_agree_on_a_masked_record_state(tmp_path: Path) -> None:
    async with opened("sqlite", tmp_path) as (stores, url):
        await crashed(stores, "masked", value=SECRET, state={})
        with pytest.raises(StateRedactedError):
            await resumed(stores, "masked")
        stuck = await listed(url, "--stuck")
        assert stuck["masked"]["blocked"].startswith("every resume refuses it: ")
        found = await inspected(url, "masked")
        assert found["safe"] is False, found


async def test_the_refusal_words_keep_the_secret_out(tmp_path: Path) -> None:
    """The 'every resume refuses it' text of a state masked in the frontier and in a
    completed call's record, in ``runs`` (text and JSON), ``inspect``, ``show`` and the
    console: the secret is in none of them; an odd run id is escaped in the text. Held."""
    odd = "masked\x1b[2Jrun"
    async with opened("sqlite", tmp_path) as (stores, url):
        await crashed(stores, odd, value=SECRET, state={})
        code, text = await cli(url, "runs", "--tenant", T, "--stuck")
        assert code == 0 and "every resume refuses it" in text, text
        assert "\x1b" not in text and SECRET not in text
        stuck = await listed(url, "--stuck")
        assert SECRET not in json.dumps(stuck)
        for command in ("inspect", "show"):
            code, text = await cli(url, command, odd, "--tenant", T)
            assert code == 0 and SECRET not in text, text
        summaries = await runs(stores, T, RunFilter(stuck=True))
        assert [s.run_id for s in summaries] == [odd]
        assert SECRET not in repr(summaries)


@pytest.mark.xfail(
    strict=True,
    reason="DEFECT LOW: a completed record with flipped outcome bytes in a run without "
    "state is refused by every resume (CheckpointCorruptError at replay) yet `runs "
    '--stuck` leaves it out and `inspect` says "safe": true (cli/reasons.left_for_a_person '
    "reads outcomes only through carried_state, which a run without state skips), while "
    "the same damage in a run with state is listed unreadable",
)
async def test_flipped_outcome_of_a_stateless_run_is_listed_stuck(tmp_path: Path) -> None:
    async with opened("sqlite", tmp_path) as (stores, url):
        await crashed(stores, "stateless")
        raw = outcome_of(url, "stateless", "remember")
        assert b'"kept"' in raw
        write_outcome(url, "stateless", "remember", raw.replace(b'"kept"', b'"kepT"', 1))
        with pytest.raises(CheckpointCorruptError):
            await resumed(stores, "stateless")
        found = await inspected(url, "stateless")
        stuck = await listed(url, "--stuck")
        assert "stateless" in stuck and found["safe"] is False, (stuck, found["safe"])


async def test_a_run_its_live_holder_carries_is_not_listed_stuck(tmp_path: Path) -> None:
    entered, gate = asyncio.Event(), asyncio.Event()

    @tool
    def remember(x: str, ctx: Any) -> str:
        """Keep a token in the run's state (what README tells you not to do)."""
        ctx.state["token"] = SECRET
        return "kept"

    @tool(side_effects=False)
    async def look(x: str) -> str:
        """Look something up, slowly."""
        entered.set()
        await gate.wait()
        return "seen"

    agent = Agent("stateful", "Go.", [remember, look])
    turns: list[Any] = [[("remember", {"x": "1"})], [("look", {"x": "2"})], "Done."]
    async with opened("sqlite", tmp_path) as (stores, url):
        live = AgentRunner.from_stores(ScriptedProvider(turns), stores)
        task = asyncio.create_task(live.run(agent, "go", tenant=T, run_id="live", state={}))
        try:
            await asyncio.wait_for(entered.wait(), 10)
            every = await listed(url)
            assert every["live"]["lease"] is not None  # held, being carried now
            stuck = await listed(url, "--stuck")
            console = {r.run_id for r in await runs(stores, T, RunFilter(stuck=True))}
        finally:
            gate.set()
            run = await asyncio.wait_for(task, 10)
        assert run.status is RunStatus.completed  # nobody was needed
        assert "live" not in stuck and "live" not in console, (stuck, console)


async def test_waiting_and_before_approval_runs_are_not_listed_stuck(tmp_path: Path) -> None:
    """An unkeyed side-effecting call waiting on a pending approval (a ``before_approval``
    frontier): not stuck in ``runs --stuck`` nor the console (held); once approved, the
    resume carries it on and sends it once (held); ``inspect`` calls it safe (not)."""
    sent: list[str] = []

    @tool(key=None, requires_approval=True)
    def notify(message: str) -> str:
        """Send a message (needs approval, no key)."""
        sent.append(message)
        return "sent"

    agent = Agent("notifier", "Notify.", [notify])
    turns: list[Any] = [[("notify", {"message": "hi"})], "Sent."]
    async with opened("sqlite", tmp_path) as (stores, url):
        first = await runner(stores, turns).run(agent, "go", tenant=T, run_id="wait")
        assert first.status is RunStatus.waiting_approval and first.pending_approval
        assert set(await listed(url, "--stuck")) == set()
        assert [r.run_id for r in await runs(stores, T, RunFilter(stuck=True))] == []
        safe = (await inspected(url, "wait"))["safe"]
        assert stores.approvals is not None
        await stores.approvals.decide(T, first.pending_approval.id, approved=True, by="alice")
        done = await runner(stores, turns).resume(agent, "wait", tenant=T)
        assert done.status is RunStatus.completed and sent == ["hi"]
        assert safe is True


# --- part 2: ProgressListener and arguments sent as an object ---------------------------


PRICE = Price(input_per_million_micros=1_000_000, output_per_million_micros=1_000_000)
PER_CALL = 150  # 120 + 30 tokens at one micro each


class Shop:
    def __init__(self) -> None:
        self.charges: list[tuple[int, int]] = []

    def agent(self) -> Agent:
        @tool(key=lambda *, arguments, **_: f"order-{arguments['order']}")
        def charge(order: int, amount: int) -> str:
            """Charge an order (side-effecting, keyed by the order)."""
            self.charges.append((order, amount))
            return f"charged order {order}"

        return Agent("shop", "Charge what the user asks.", [charge])


def streamed_with_object_arguments(arguments: dict[str, Any]) -> Reply:
    """A streamed reply whose one call's arguments come in one delta as an object."""
    frames = openai_stream(None, [("c1", "charge", {"order": 5, "amount": 10})], pieces=1)
    out = []
    for frame in frames:
        if frame.startswith("data: {"):
            body = json.loads(frame.removeprefix("data: "))
            for choice in body["choices"]:
                for call in choice["delta"].get("tool_calls") or ():
                    fn = call.get("function") or {}
                    if fn.get("arguments"):
                        fn["arguments"] = arguments
            frame = f"data: {json.dumps(body)}\n\n"
        out.append(frame)
    return Reply(events=out, content_type="text/event-stream")


async def test_streamed_arguments_sent_as_an_object_are_read_as_plain_ones(
    model_server: ModelServer, tmp_path: Path
) -> None:
    shop = Shop()
    model_server.queue(
        streamed_with_object_arguments({"order": 5, "amount": 10}),
        Reply(events=openai_stream("Charged."), content_type="text/event-stream"),
    )
    heard: list[RunEvent] = []
    async with opened("sqlite", tmp_path) as (stores, _):
        provider = OPENAI.provider(model_server, prices=PRICE, max_retries=0)
        try:
            run = await AgentRunner.from_stores(provider, stores).run(
                shop.agent(), "charge 5", tenant=T, run_id="s1", on_event=heard.append
            )
        finally:
            await provider.aclose()
        assert [r.body.get("stream") for r in model_server.requests] == [True, True]
        assert run.status is RunStatus.completed, run.status
        assert shop.charges == [(5, 10)]
        assert await stores.ledger.spent(T, "s1") == 2 * PER_CALL


class Counting(ProgressListener):
    def __init__(self) -> None:
        self.events: list[RunEvent] = []

    def __call__(self, event: RunEvent) -> None:
        self.events.append(event)


async def test_a_progress_listener_keeps_the_wire_plain_and_a_sink_streams(
    model_server: ModelServer, tmp_path: Path
) -> None:
    """``run(on_event=ProgressListener)`` posts without ``stream`` and hears the run's
    progress; ``run(on_event=function)`` streams; the run, the charge once and the spend
    are the same both ways, and odd object arguments (numbers as keys, nested, ``null``
    values) reach the tool as the text form would. Held."""
    shop = Shop()
    args: dict[Any, Any] = {"order": 5, "amount": 10}
    plain = OPENAI.turn(None, [("c1", "charge", args)])
    plain["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"] = {
        **args,
        1: {"nested": [None, {"deep": True}]},
    }
    model_server.queue(
        plain,
        OPENAI.turn("Charged."),
        Reply(
            events=openai_stream(None, [("c1", "charge", {"order": 6, "amount": 10})]),
            content_type="text/event-stream",
        ),
        Reply(events=openai_stream("Charged."), content_type="text/event-stream"),
    )
    listener = Counting()
    async with opened("sqlite", tmp_path) as (stores, _):
        provider = OPENAI.provider(model_server, prices=PRICE, max_retries=0)
        try:
            runner_ = AgentRunner.from_stores(provider, stores)
            first = await runner_.run(
                shop.agent(), "charge 5", tenant=T, run_id="p1", on_event=listener
            )
            second = await runner_.run(
                shop.agent(), "charge 6", tenant=T, run_id="p2", on_event=lambda e: None
            )
        finally:
            await provider.aclose()
        assert [bool(r.body.get("stream")) for r in model_server.requests] == [
            False,
            False,
            True,
            True,
        ]
        assert listener.events, "the listener heard nothing"
        assert first.status is second.status is RunStatus.completed
        # The extra member "1" is a field the tool lacks: answered, not sent (or sent once).
        assert shop.charges in ([(6, 10)], [(5, 10), (6, 10)]), shop.charges
        for run_id in ("p1", "p2"):
            assert await stores.ledger.spent(T, run_id) == 2 * PER_CALL
