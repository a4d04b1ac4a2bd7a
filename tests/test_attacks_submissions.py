"""Attacks on submitted runs, from ``AgentRunner.submit`` (and ``tesserix submit``) to the
worker that starts them: retried submits that differ, starts racing after a SIGKILL, what
the started run's model and tools are handed, damaged submissions and the CLI's answers.

SQLite throughout; PostgreSQL where a real server matters (processes racing a start).

Defects found, each fixed (their tests pass now):
- a retried ``submit`` of an id already submitted with another input, state or agent
  answers with the id as if recorded; what it carried is dropped, nothing said (and
  ``tesserix submit --json`` prints the other agent's name);
- ``runner.run`` of a submitted id under another agent is carried under that agent (the
  CLI's ``run --resume`` refuses the same);
- ``submit`` accepts a state no frontier can hold: a worker books with every frontier a
  tombstone and the run's answer kept nowhere (an input that large is refused);
- ``inspect`` of a run parked for a damaged submission says ``run --resume`` starts it;
  ``run --resume`` refuses it (exit 4).

Held: an identical retry and the same id under another tenant (two runs, each from its own
input); a start SIGKILLed before its first frontier, then raced by ``runner.run`` and two
workers (one booking, the dead take counted, not parked; SQLite and PostgreSQL); several
parts, a secret masked for the model, an image part byte for byte, a dataclass state (one
holding a secret refused, nothing recorded); a cancel during a worker's start or before a
hand start (nothing sent); a cancelled submission and one of an agent no worker knows left
alone; a damaged submission parked typed, its bytes kept, ``run --resume`` exit 4.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import signal
import sqlite3
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from booking import BOOK_TURNS, Airline, booking_agent
from cli.test_attacks_operator_night import _one_sentence, acli
from processes import store_url
from run.helpers import Recording
from tesserix_adk import (
    Agent,
    AgentRunner,
    Backoff,
    Carried,
    LeasePolicy,
    ScriptedProvider,
    ToolContext,
    Worker,
    tool,
)
from tesserix_adk.errors import (
    AdkError,
    CheckpointTooLargeError,
    ConfigurationError,
    RunStartedError,
)
from tesserix_adk.messages import BinaryPart, Message, Role, TextPart
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.stores.protocols import WorkState
from tesserix_adk.stores.urls import open_stores

T = "acme"
TTL = 0.5
FAST = Backoff(base=0.01, cap=0.02)
TESTS = Path(__file__).parent
SECRET = "sk-live-" + "Q9w8E7r6T5y4U3i2O1p0A9s8D7f6G5h4"


@contextlib.asynccontextmanager
async def _site(tmp_path: Path, backend: str = "sqlite") -> AsyncIterator[tuple[str, Stores]]:
    async with store_url(backend, tmp_path) as url, open_stores(url) as stores:
        await stores.create_schema()
        yield url, stores


def _runner(stores: Stores, provider: Any = None, **kwargs: Any) -> AgentRunner:
    return AgentRunner.from_stores(
        provider or ScriptedProvider(list(BOOK_TURNS)),
        stores,
        lease_policy=LeasePolicy(ttl=TTL, renew_within=TTL / 2),
        **kwargs,
    )


def _worker(stores: Stores, agents: list[Agent], provider: Any = None, **kwargs: Any) -> Worker:
    return Worker(
        _runner(stores, provider, **kwargs),
        agents,
        exit_when_idle=True,
        poll_interval=0.01,
        backoff=FAST,
    )


def _mailer(sent: list[str]) -> Agent:
    @tool
    def send_mail(to: str) -> str:
        """Send a mail (side-effecting)."""
        sent.append(to)
        return "sent"

    return Agent("mailer", "Mail people.", [send_mail])


def _user_texts(provider: Recording, n: int = 0) -> list[str]:
    return [m.text for m in provider.requests[n].messages if m.role is Role.user]


def _agent_module(tmp_path: Path) -> str:
    """A module with the booking agent and a mailer agent, for ``--agent``."""
    name = f"subagents_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(
        "from tesserix_adk import Agent, ScriptedProvider, tool\n"
        "from booking import BOOK_TURNS, Airline, booking_agent\n"
        "PROVIDER = ScriptedProvider(list(BOOK_TURNS))\n"
        "booking = booking_agent(Airline())\n"
        "@tool\n"
        "def send_mail(to: str) -> str:\n"
        '    """Send a mail."""\n'
        '    return "sent"\n'
        'mailer = Agent("mailer", "Mail people.", [send_mail])\n'
    )
    return str(tmp_path / f"{name}.py")


# --- 1. a retried submit ---------------------------------------------------------------------


@pytest.mark.parametrize("differs", ["input", "state", "agent"])
async def test_a_retried_submit_that_differs_is_refused_not_silently_dropped(
    differs: str, tmp_path: Path
) -> None:
    async with _site(tmp_path) as (_url, stores):
        booking = booking_agent(Airline())
        runner = _runner(stores)
        await runner.submit(booking, "book LH123", tenant=T, run_id="r", state={"seat": "12A"})
        assert stores.work is not None
        kept = await stores.work.input(T, "r")
        again: dict[str, Any] = {"agent": booking, "input": "book LH123", "state": {"seat": "12A"}}
        again[differs] = {
            "input": "book UA456",
            "state": {"seat": "1A"},
            "agent": _mailer([]),
        }[differs]
        answered: object = None
        try:
            answered = await runner.submit(
                again["agent"], again["input"], tenant=T, run_id="r", state=again["state"]
            )
        except AdkError as exc:
            answered = exc
        # Nothing of the first submission is changed, whatever the answer.
        assert await stores.work.input(T, "r") == kept
        entry = await stores.work.entry(T, "r")
        assert entry is not None and entry.agent == "booking"
        # The caller must be told its input is not the run's (as ``run`` is told).
        assert isinstance(answered, AdkError), f"submit answered {answered!r}, nothing said"


async def test_an_identical_retry_and_another_tenants_same_id_each_start_from_their_own_input(
    tmp_path: Path,
) -> None:
    async with _site(tmp_path) as (_url, stores):
        airline = Airline()
        booking = booking_agent(airline)
        runner = _runner(stores)
        for _ in range(2):
            assert await runner.submit(booking, "input of acme", tenant=T, run_id="r") == "r"
        assert await runner.submit(booking, "input of globex", tenant="globex", run_id="r") == "r"
        seen = Recording(ScriptedProvider(list(BOOK_TURNS)))
        worker = _worker(stores, [booking], seen)
        await asyncio.wait_for(worker.run(), 30)
        assert sorted(how.value for _, how in worker.carried) == ["finished", "finished"]
        started = sorted(
            tuple(_user_texts(seen, i))
            for i, r in enumerate(seen.requests)
            if not any(m.role is Role.assistant for m in r.messages)
        )
        assert started == [("input of acme",), ("input of globex",)]
        assert airline.bookings == ["LH123", "LH123"]
        for tenant in (T, "globex"):
            latest = await _runner(stores).checkpoints.latest(tenant, "r")  # type: ignore[union-attr]
            assert latest is not None and latest.status.value == "completed"


async def test_cli_submit_again_with_another_agent_does_not_name_that_agent(
    tmp_path: Path,
) -> None:
    async with _site(tmp_path) as (url, stores):
        module = _agent_module(tmp_path)
        argv = ["submit", "--tenant", T, "--input", "book", "--run-id", "r", "--json"]
        code, out, err = await acli(url, *argv, "--agent", f"{module}:booking")
        assert code == 0, err
        code, out, err = await acli(url, *argv, "--agent", f"{module}:mailer")
        entry = await stores.work.entry(T, "r")  # type: ignore[union-attr]
        assert entry is not None and entry.agent == "booking"
        # Refused: a conflict no retry resolves (exit 4, not 3's "retry later").
        assert code == 4, (code, out, err)
        said = (out + err).strip()
        assert "'booking'" in said and "Traceback" not in said, said


# --- 2. starting a submitted run ----------------------------------------------------------


async def test_run_of_a_submitted_id_under_another_agent_is_refused(tmp_path: Path) -> None:
    async with _site(tmp_path) as (_url, stores):
        airline, sent = Airline(), []
        await _runner(stores).submit(booking_agent(airline), "book", tenant=T, run_id="r")
        mails = ScriptedProvider([[("send_mail", {"to": "ceo@example.com"})], "mailed"])
        outcome: object
        try:
            outcome = await _runner(stores, mails).run(_mailer(sent), "book", tenant=T, run_id="r")
        except AdkError as exc:
            outcome = exc
        assert sent == [], f"the other agent's tool was sent ({outcome!r})"
        assert isinstance(outcome, RunStartedError), outcome


async def test_submit_refuses_a_state_no_frontier_could_hold(tmp_path: Path) -> None:
    async with _site(tmp_path) as (_url, stores):
        airline = Airline()
        booking = booking_agent(airline)
        runner = _runner(stores, max_bytes=16 * 1024)
        # The same size as input is refused at submit, nothing recorded.
        with pytest.raises(CheckpointTooLargeError):
            await runner.submit(booking, "y" * 40_000, tenant=T, run_id="big-input")
        try:
            await runner.submit(booking, "book", tenant=T, run_id="r", state={"n": "y" * 40_000})
        except CheckpointTooLargeError:
            assert await stores.work.entry(T, "r") is None  # type: ignore[union-attr]
            return
        worker = _worker(stores, [booking], max_bytes=16 * 1024)
        await asyncio.wait_for(worker.run(), 30)
        latest = await runner.checkpoints.latest(T, "r")  # type: ignore[union-attr]
        assert latest is not None
        assert not latest.is_tombstone, (airline.bookings, latest.reason)


@dataclasses.dataclass
class Trip:
    origin: str
    note: str


async def test_a_worker_hands_a_multi_part_secret_input_and_dataclass_state_as_kept(
    tmp_path: Path,
) -> None:
    """The model of a worker-started run sees every part in order, the secret masked (as
    stored), the image part byte for byte; the tool gets the schema's dataclass; nothing of
    the secret reaches the file."""
    blob = bytes(range(256)) + SECRET.encode()  # an image: left alone, byte for byte
    handed: list[Any] = []

    @tool(side_effects=False)
    def where(ctx: ToolContext) -> str:
        """Where the trip starts."""
        handed.append(ctx.state)
        return str(ctx.state.origin)

    agent = Agent("trips", "Say where.", [where], state_schema=Trip)
    parts = [
        Message(Role.system, "be brief"),
        Message.user(
            [TextPart(text=f"my key is {SECRET}"), BinaryPart(data=blob, media_type="image/png")]
        ),
        Message.user("and FRA"),
    ]
    async with _site(tmp_path) as (_url, stores):
        # A typed state holding a secret is refused, typed, nothing recorded: a tool would
        # be handed the mask after a crash.
        with pytest.raises(ConfigurationError, match="secret"):
            await _runner(stores).submit(
                agent, parts, tenant=T, run_id="r", state=Trip(origin="FRA", note=SECRET)
            )
        assert await stores.work.entry(T, "r") is None  # type: ignore[union-attr]
        state = Trip(origin="FRA", note="window seat")
        await _runner(stores).submit(agent, parts, tenant=T, run_id="r", state=state)
        seen = Recording(ScriptedProvider([[("where", {})], "FRA."]))
        worker = _worker(stores, [agent], seen)
        await asyncio.wait_for(worker.run(), 30)
        assert [how for _, how in worker.carried] == [Carried.finished], worker.carried
        first = seen.requests[0].messages
        assert [m.role for m in first] == [Role.system, Role.user, Role.user]
        text, binary = first[1].content
        assert isinstance(text, TextPart) and SECRET not in text.text
        assert text.text.startswith("my key is ")
        assert isinstance(binary, BinaryPart) and binary.data == blob
        assert first[2].text == "and FRA"
        assert len(handed) == 1 and type(handed[0]) is Trip
        assert handed[0] == state
    raw = (tmp_path / "adk.sqlite3").read_bytes()
    for suffix in ("-wal",):
        wal = tmp_path / f"adk.sqlite3{suffix}"
        raw += wal.read_bytes() if wal.exists() else b""
    assert SECRET[8:].encode() not in raw.replace(blob, b"")


# --- 3. SIGKILL during the start, then a race to start it ----------------------------------

CHILD = """
import asyncio, os, signal, sys
sys.path.insert(0, {tests!r})
from booking import BOOK_TURNS, Airline, booking_agent
from tesserix_adk import AgentRunner, LeasePolicy, ScriptedProvider, Worker
from tesserix_adk.stores.urls import open_stores

async def main():
    async with open_stores({url!r}) as stores:
        def dying(inner):
            async def write(*args, **kwargs):
                print("dying", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)  # in the start, before its first frontier
                return await inner(*args, **kwargs)

            return write

        for name in ("put", "put_with_history"):
            if hasattr(stores.checkpoints, name):
                setattr(stores.checkpoints, name, dying(getattr(stores.checkpoints, name)))
        runner = AgentRunner.from_stores(
            ScriptedProvider(list(BOOK_TURNS)), stores,
            lease_policy=LeasePolicy(ttl={ttl}, renew_within={ttl} / 2),
        )
        worker = Worker(runner, [booking_agent(Airline())], poll_interval=0.01, exit_when_idle=True)
        await worker.run()

asyncio.run(main())
"""


@pytest.mark.parametrize(
    "backend",
    [pytest.param("sqlite", id="sqlite"), pytest.param("postgres", marks=pytest.mark.postgres)],
)
async def test_a_start_sigkilled_before_its_first_frontier_is_started_once_by_racing_starters(
    backend: str, tmp_path: Path
) -> None:
    async with _site(tmp_path, backend) as (url, stores):
        airline = Airline()
        booking = booking_agent(airline)
        await _runner(stores).submit(booking, "book", tenant=T, run_id="r")
        script = CHILD.format(tests=str(TESTS), url=url, ttl=TTL)
        child = await asyncio.create_subprocess_exec(
            sys.executable, "-c", script, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        try:
            out, err = await asyncio.wait_for(child.communicate(), 30)
        finally:
            if child.returncode is None:  # it never died: no worker left polling after us
                child.kill()
                await child.wait()
        assert child.returncode == -signal.SIGKILL, (out, err[-2000:])
        assert b"dying" in out
        assert await stores.checkpoints.latest(T, "r") is None
        entry = await stores.work.entry(T, "r")  # type: ignore[union-attr]
        # Not parked; the dead take is counted, so a start that always kills is parked
        # after max_attempts rather than taken forever.
        assert entry is not None and entry.state is not WorkState.parked, entry
        assert entry.attempts == 1, entry
        assert await stores.work.input(T, "r") is not None  # type: ignore[union-attr]
        await asyncio.sleep(TTL + 0.3)  # the dead start's lease lapses

        async def by_hand() -> str:
            try:
                run = await _runner(stores).run(booking, "book", tenant=T, run_id="r")
            except AdkError as exc:  # a worker started it first
                return type(exc).__name__
            return run.status.value

        workers = [_worker(stores, [booking]) for _ in range(2)]
        got = await asyncio.wait_for(asyncio.gather(by_hand(), *(w.run() for w in workers)), 60)
        assert got[0] in ("completed", "LeaseHeldError", "RunStartedError"), got
        if airline.bookings == []:  # the hand start lost, and the workers saw it held
            await asyncio.sleep(TTL + 0.3)
            await asyncio.wait_for(_worker(stores, [booking]).run(), 30)
        assert airline.bookings == ["LH123"]
        latest = await stores.checkpoints.latest(T, "r")
        assert latest is not None
        records = [r for r in await stores.idempotency.records(T, "r") if r.tool == "book_seat"]
        assert len(records) == 1
        assert (await stores.work.entry(T, "r")).state is WorkState.done  # type: ignore[union-attr]


# --- 4. cancelled before the start, an unknown agent, a damaged submission ----------------


async def test_a_cancelled_submission_and_one_for_an_unknown_agent_are_left_alone(
    tmp_path: Path,
) -> None:
    async with _site(tmp_path) as (url, stores):
        airline, sent = Airline(), []
        booking = booking_agent(airline)
        await _runner(stores).submit(booking, "book", tenant=T, run_id="cancelled")
        await _runner(stores).submit(_mailer(sent), "mail", tenant=T, run_id="unknown")
        code, out, err = await acli(url, "cancel", "cancelled", "--tenant", T, "--by", "ops")
        assert code == 0 and err == "" and "cancelled before it started" in out, (out, err)
        worker = _worker(stores, [booking])
        await asyncio.wait_for(worker.run(), 30)
        assert worker.carried == [] and airline.bookings == [] and sent == []
        entry = await stores.work.entry(T, "unknown")  # type: ignore[union-attr]
        assert entry is not None and entry.state is WorkState.submitted and entry.attempts == 0
        code, out, err = await acli(url, "runs", "--tenant", T, "--json")
        assert code == 0, err
        shown = {r["run_id"]: r["status"] for r in json.loads(out)["runs"]}
        assert shown == {"cancelled": "cancelled", "unknown": "submitted"}
        # A second submit of the cancelled id does not revive it; the mailer's worker
        # starts its own run.
        await _runner(stores).submit(booking, "book", tenant=T, run_id="cancelled")
        mails = ScriptedProvider([[("send_mail", {"to": "a@example.com"})], "mailed"])
        await asyncio.wait_for(_worker(stores, [_mailer(sent), booking], mails).run(), 30)
        assert sent == ["a@example.com"] and airline.bookings == []


class _Gate:
    """The booking model, held inside its first call until let go."""

    def __init__(self) -> None:
        self.inner = ScriptedProvider(list(BOOK_TURNS))
        self.entered = asyncio.Event()
        self.go = asyncio.Event()

    async def complete(self, request: Any) -> Any:
        self.entered.set()
        await self.go.wait()
        return await self.inner.complete(request)


async def test_a_cancel_while_a_worker_starts_the_run_or_before_a_hand_start_sends_nothing(
    tmp_path: Path,
) -> None:
    async with _site(tmp_path) as (_url, stores):
        airline = Airline()
        booking = booking_agent(airline)
        runner = _runner(stores)
        # Cancelled while a worker is inside the start's first model call (no frontier
        # yet): the start ends cancelled at its next boundary, the booking never sent.
        await runner.submit(booking, "book", tenant=T, run_id="during")
        gate = _Gate()
        worker = _worker(stores, [booking], gate)
        carrying = asyncio.create_task(worker.run())
        await asyncio.wait_for(gate.entered.wait(), 10)
        assert await stores.checkpoints.latest(T, "during") is None
        assert await runner.cancel("during", tenant=T, by="ops") is None  # its holder ends it
        gate.go.set()
        await asyncio.wait_for(carrying, 30)
        # Cancelled before anything started it, then started by hand with its own input:
        # it ends cancelled too, nothing sent.
        await runner.submit(booking, "book", tenant=T, run_id="before")
        assert await runner.cancel("before", tenant=T, by="ops") is None
        by_hand = await _runner(stores).run(booking, "book", tenant=T, run_id="before")
        assert by_hand.status.value == "cancelled"
        assert airline.bookings == []
        for run_id in ("during", "before"):
            latest = await stores.checkpoints.latest(T, run_id)
            assert latest is not None and b'"cancelled"' in latest.payload, latest


def _damage(path: Path, run_id: str) -> None:
    with contextlib.closing(sqlite3.connect(path)) as db:
        (data,) = db.execute("SELECT input FROM adk_work WHERE run_id = ?", (run_id,)).fetchone()
        changed = bytes(data).replace(b'"book LH123"', b'"book LH999"')
        assert changed != bytes(data)
        db.execute("UPDATE adk_work SET input = ? WHERE run_id = ?", (changed, run_id))
        db.commit()


async def _parked_damaged(tmp_path: Path, url: str, stores: Stores, airline: Airline) -> str:
    booking = booking_agent(airline)
    await _runner(stores).submit(booking, "book LH123", tenant=T, run_id="r")
    _damage(tmp_path / "adk.sqlite3", "r")
    worker = _worker(stores, [booking])
    await asyncio.wait_for(worker.run(), 30)
    assert [how for _, how in worker.carried] == [Carried.parked]
    return _agent_module(tmp_path)


async def test_a_damaged_submission_is_parked_typed_kept_and_refused_in_one_sentence(
    tmp_path: Path,
) -> None:
    async with _site(tmp_path) as (url, stores):
        airline = Airline()
        module = await _parked_damaged(tmp_path, url, stores, airline)
        assert airline.bookings == []
        entry = await stores.work.entry(T, "r")  # type: ignore[union-attr]
        assert entry is not None and entry.state is WorkState.parked
        assert entry.reason is not None and "CheckpointCorruptError" in entry.reason
        assert await stores.work.input(T, "r") is not None  # type: ignore[union-attr]
        code, out, err = await acli(url, "runs", "--tenant", T, "--stuck")
        assert code == 0 and "CheckpointCorruptError" in out, (out, err)
        argv = ["run", "--resume", "r", "--tenant", T, "--agent", f"{module}:booking"]
        code, out, err = await acli(url, *argv)
        assert code == 4, (code, out, err)
        _one_sentence(err)
        assert "checksum" in err
        assert airline.bookings == [] and await stores.checkpoints.latest(T, "r") is None
        # A worker does not take it again; an operator's cancel ends it.
        again = _worker(stores, [booking_agent(airline)])
        await asyncio.wait_for(again.run(), 30)
        assert again.carried == []
        code, out, err = await acli(url, "cancel", "r", "--tenant", T, "--by", "ops")
        assert code == 0, err


async def test_inspect_of_a_damaged_submission_does_not_promise_that_run_resume_starts_it(
    tmp_path: Path,
) -> None:
    async with _site(tmp_path) as (url, stores):
        await _parked_damaged(tmp_path, url, stores, Airline())
        _code, _out, err = await acli(url, "inspect", "r", "--tenant", T)
        _one_sentence(err)
        assert "run --resume` starts it" not in err, err
