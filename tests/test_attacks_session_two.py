"""An attacker's look at today's commits (7762367..HEAD): keys that hold a secret kept as
their digest ``m1:`` (a33a0ef), lone surrogates and strict ``--json`` (a33a0ef), the step
check on reading a checkpoint (8838d9a), redacted output, ``runs``/``inspect``/``show``
and ``runs --stuck`` (f22cddd, 99b8fb6, 1c381ee, c419bf9), and the worker stopping on an
error its store says will not pass (5375904). SQLite under ``tmp_path``; Redis and
PostgreSQL (shared servers, unique prefixes and schemas) where they matter.

Defects (each an ``xfail(strict=True)`` test asserting the right behaviour until fixed;
all ten are fixed since, their tests plain):

1. (a33a0ef, medium) Whether a custom key is kept as ``m1:<sha256>`` depends on the
   redaction configuration of the process that computes it. A business key built from an
   argument one process masks (``extra_patterns``; likewise a later kit adding a built-in
   pattern) and another does not (``tesserix worker`` and ``run --resume`` take no
   ``extra_patterns``) is ``m1:...`` in one and as written in the other: a second run of
   the same business object is not found and is sent again, under another key the far
   side cannot dedupe (two sends); and a run carried on past its frontier by the other
   process is refused as diverged (DivergedRunError, exit 4) although the model asked for
   exactly the call that ran.
2. (a33a0ef, low-medium) ``m1:`` is an unsalted SHA-256 of the key: a password the key was
   built from is recovered from the stored record (and from ``inspect --json``'s ``key``)
   by hashing a short dictionary. "No store keeps the secret" holds only for high-entropy
   secrets.
3. (a33a0ef, low-medium) A lone surrogate a model puts in a tool call's arguments or call id
   (a streamed emoji cut in half) still breaks the run before anything is sent: the
   default key, ``masked_key`` and the approval id encode UTF-8 and raise a bare
   ``UnicodeEncodeError``; a call id (or a custom key) holding one reaches the store and
   comes back as a *retryable* ``StoreUnavailableError`` that says the claim "lost its
   reply", which a worker retries until it parks the run. The run can never go on.
4. (a33a0ef, low) ``--json`` output (``show``, ``inspect``, ``runs``) writes a lone
   surrogate as a ``\\udXXX`` escape: not I-JSON (RFC 7493); strict parsers refuse it and a
   parsed document cannot be written back out as UTF-8.
5. (5375904, medium) A Redis that refuses writes for a while with ``MISCONF`` (AOF or RDB
   write failing: disk full; the kit requires AOF) or ``NOREPLICAS`` is translated as a
   non-retryable ``StoreUnavailableError``; the worker's poll (``work_due.lua`` writes) now
   re-raises it and the worker exits, where it used to back off and carry on once the
   disk was freed.
6. (5375904, medium) On Redis, one run whose key is damaged (its lease key holding a string)
   makes ``work_due.lua`` fail whole with WRONGTYPE, a non-retryable
   ``CheckpointCorruptError``: every worker now exits at its first poll and no healthy run
   is carried. SQLite and PostgreSQL leave such an entry out (``due_items``) and carry the
   others.
7. (c419bf9, low-medium) ``left_in_doubt`` ignores the record's tool flags: a read-only
   call (``side_effects=False``) left in flight makes a run that *completed* (carried on
   after a crash, the model not asking again) or was cancelled show in ``runs --stuck`` for
   ever, and ``inspect`` tells the operator to check the tool's own system and ``tesserix
   resolve`` a weather lookup; before it planned such a call as safe to send again.
8. (1c381ee/c419bf9, low-medium) The web console's run page was left out of both fixes: for
   a call under the run's live lease holder it still says "that holder no longer carries
   the run"; for a run that ended with a booking in doubt (which its runs list marks stuck)
   its plan names no call, says ``safe: yes`` and offers no resolve form.
9. (99b8fb6 area, low-medium) A run holding a lease whose expiry by the store's clock is
   past year 9999 (``acquire`` with a long ttl; a far-future expiry) makes ``runs`` fail
   for every run of the tenant, and ``inspect``/``show`` of it, with ``tesserix:
   ValueError: year 11533 is out of range`` (exit 4, a Python internal).
10. (f22cddd area, medium) ``run --resume`` (and every command) prints an error's text
    unredacted: a provider whose error repeats its bearer token or API key puts it on the
    operator's terminal (stderr, and the ``--json`` error object), the same terminal
    f22cddd now keeps the run's output masked for.

Since this attack, defects 1 and 2 are gone with the digest: a call whose key would hold a
secret is refused ("not sent"), so the tests of 1 and 2 now check that (one send at most
whatever each process masks; a password neither sent nor stored).

What held (plain tests below): no byte of a secret a key was built from reaches the SQLite
file; a key function that raises on the masked arguments is refused, not sent. The step
check refuses nothing a legitimate writer wrote: runs pruned to
``keep_last=1``, tombstoned, cancelled and carried on read back at ``latest`` and at every
kept step on SQLite, Redis and PostgreSQL. The worker keeps going through a retryable poll
failure, and on SQLite leaves one damaged work entry out and carries the healthy run. A
booking left in doubt by a cancel is listed by ``runs --stuck`` and named by ``inspect``.
Also checked without a test here: surrogates in CLI arguments (``--note``, ``--reason``,
``--by``, run ids, tenants) are refused with exit 2 and one sentence; ``resolve --outcome``
with a ``\\ud800`` escape records it; approvals of calls under a secret key ask under one id
across a crash and answer the masked call "not sent" once approved; ``show --step`` of a
huge or negative step is exit 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from adapters import services
from booking import BOOK_TURNS, Airline, booking_agent
from run.helpers import at, faulty_runner
from tesserix_adk import (
    Agent,
    AgentRunner,
    Boundary,
    LeasePolicy,
    Message,
    ModelRequest,
    ModelResponse,
    Role,
    RunStatus,
    ScriptedProvider,
    ToolCall,
    ToolContext,
    tool,
)
from tesserix_adk.checkpoint.checkpointer import Checkpointer, CheckpointPolicy
from tesserix_adk.cli import ExitCode
from tesserix_adk.cli.main import main
from tesserix_adk.errors import StoreUnavailableError
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.stores.urls import open_stores
from tesserix_adk.testing.faults import SimulatedCrash
from tesserix_adk.worker import Backoff, Worker

HERE = "test_attacks_session_two"
T = "t"
SECRET = "sk-proj-AbCdEfGhIjKlMnOpQrStUvWxYz0123456789abcd"
BEARER = "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N"
# A customer id one deployment masks (its own pattern), the kit's built-ins do not.
CUSTOMER = "ACME-123456"
EXTRA = (r"ACME-\d{6}",)
ODD = "half a pair: \ud83d, then on"
FAST = LeasePolicy(ttl=2.0, renew_within=1.0)

# --- what the CLI loads by reference (``--agent/--provider test_attacks_session_two:X``) ---

AGENT = booking_agent(Airline())


class _Leaky:
    """A provider whose client fails with its credentials in the message."""

    async def complete(self, request: ModelRequest) -> ModelResponse:
        raise RuntimeError(
            f"client misconfigured: api_key={SECRET}, Authorization: Bearer {BEARER}"
        )


def leaky() -> _Leaky:
    return _Leaky()


# --- helpers ------------------------------------------------------------------------------


def _main(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(list(argv))
    seen = capsys.readouterr()
    return code, seen.out, seen.err


def _everything_stored(path: Path) -> bytes:
    with contextlib.closing(sqlite3.connect(path)) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        dump = "\n".join(conn.iterdump())
    return dump.encode("utf-8", "surrogatepass") + path.read_bytes()


def _rows(path: Path, sql: str, *params: Any) -> list[tuple[Any, ...]]:
    with contextlib.closing(sqlite3.connect(path)) as conn:
        return conn.execute(sql, params).fetchall()


def _execute(path: Path, sql: str, *params: Any) -> None:
    with contextlib.closing(sqlite3.connect(path)) as conn:
        conn.execute(sql, params)
        conn.commit()


ONLY_AFTER_TOOLS = CheckpointPolicy(boundaries={Boundary.after_tool_result})


@tool(side_effects=False)
def look(q: str) -> str:
    """Look something up."""
    return "found"


def _biller(sent: list[str | None]) -> Agent:
    @tool(key=lambda **kw: f"invoice-{kw['arguments']['customer']}")
    def bill(customer: str, ctx: ToolContext) -> str:
        """Bill a customer once; the billing service dedupes by our key."""
        sent.append(ctx.idempotency_key)
        return "billed"

    return Agent("biller", "Bill the customer.", [look, bill])


def _payer(sent: list[str | None], crash: dict[str, str | None]) -> Agent:
    @tool(key=lambda **kw: f"charge-{kw['arguments']['card']}")
    def charge(card: str, ctx: ToolContext) -> str:
        """Charge a card; keyed by the card."""
        sent.append(ctx.idempotency_key)
        if crash.get("at") == "after":
            raise SimulatedCrash("died right after the charge went out")
        return "charged"

    return Agent("payer", "Charge the card.", [look, charge])


PAY_TURNS: list[Any] = [[("look", {"q": "card"})], [("charge", {"card": SECRET})], "done"]


class _Asks:
    """A model that asks for ``calls`` first, then answers ``done``."""

    def __init__(self, calls: list[ToolCall]) -> None:
        self.calls = calls

    async def complete(self, request: ModelRequest) -> ModelResponse:
        asked = sum(1 for m in request.messages if m.role is Role.assistant)
        if asked == 0:
            return ModelResponse(
                message=Message(role="assistant", content="", tool_calls=self.calls)
            )
        return ModelResponse(message=Message(role="assistant", content="done"))


# ==========================================================================================
# Defects
# ==========================================================================================

# --- 1. a key's identity depends on the redaction configuration ---------------------------


async def test_a_business_key_names_one_object_whatever_the_redaction_config(
    tmp_path: Path,
) -> None:
    sent: list[str | None] = []
    agent = _biller(sent)
    turns = [[("bill", {"customer": CUSTOMER})], "done"]
    async with open_stores(f"sqlite:///{tmp_path / 'adk.sqlite3'}") as stores:
        await stores.create_schema()
        # The application masks its customer ids; `tesserix worker` cannot be told to.
        app = AgentRunner.from_stores(ScriptedProvider(turns), stores, extra_patterns=EXTRA)
        first = await app.run(agent, "bill ACME", tenant=T, run_id="from-the-app")
        worker = AgentRunner.from_stores(ScriptedProvider(turns), stores)
        second = await worker.run(agent, "bill ACME", tenant=T, run_id="from-a-worker")
    assert (first.status, second.status) == (RunStatus.completed, RunStatus.completed)
    # One customer, one invoice: the second run is answered from the first's record.
    assert len(sent) == 1, sent


async def test_a_run_carried_on_by_another_process_sends_the_call_at_most_once(
    tmp_path: Path,
) -> None:
    sent: list[str | None] = []
    agent = _biller(sent)
    turns = [[("look", {"q": "who"})], [("bill", {"customer": CUSTOMER})], "done"]
    async with open_stores(f"sqlite:///{tmp_path / 'adk.sqlite3'}") as stores:
        await stores.create_schema()
        app = faulty_runner(
            stores,
            ScriptedProvider(turns),
            crash_before=at("after_tool_result", 1),  # billed; died before its frontier
            lease_policy=FAST,
            policy=ONLY_AFTER_TOOLS,
            extra_patterns=EXTRA,
        )
        with pytest.raises(SimulatedCrash):
            await app.run(agent, "bill ACME", tenant=T, run_id="r")
        assert sent == []  # this process masks the customer id: the call is refused
        # What `tesserix run --resume` or `tesserix worker` builds: no extra patterns.
        cli = AgentRunner.from_stores(ScriptedProvider(turns), stores, policy=ONLY_AFTER_TOOLS)
        resumed = await cli.resume(agent, "r", tenant=T)
    assert resumed.status is RunStatus.completed
    assert len(sent) <= 1, sent


# --- 2. the digest of a low-entropy secret is the secret ----------------------------------

PASSWORDS = ["123456", "password", "qwerty", "letmein", "dragon", "sunshine1", "iloveyou"]


async def test_a_key_built_from_a_password_is_neither_sent_nor_stored(tmp_path: Path) -> None:
    path = tmp_path / "adk.sqlite3"
    seen: list[str | None] = []

    @tool(key=lambda **kw: f"login-{kw['arguments']['user']}-{kw['arguments']['password']}")
    def sign_in(user: str, password: str, ctx: ToolContext) -> str:
        """Sign in once per user and password."""
        seen.append(ctx.idempotency_key)
        return "signed in"

    turns = [[("sign_in", {"user": "bob", "password": "sunshine1"})], "done"]
    async with open_stores(f"sqlite:///{path}") as stores:
        await stores.create_schema()
        run = await AgentRunner.from_stores(ScriptedProvider(turns), stores).run(
            Agent("login", "Sign in.", [sign_in]), "sign in", tenant=T, run_id="r"
        )
    assert run.status is RunStatus.completed and seen == []
    assert b"sunshine1" not in _everything_stored(path)
    assert _rows(path, "SELECT key FROM adk_idempotency WHERE tool = 'sign_in'") == []
    assert not any(
        hashlib.sha256(f"{T}/login-bob-{guess}".encode()).hexdigest().encode()
        in _everything_stored(path)
        for guess in PASSWORDS
    )


# --- 3. a lone surrogate from the model in a call -----------------------------------------


def _odd_calls(where: str) -> tuple[Agent, list[ToolCall], list[str]]:
    sent: list[str] = []

    @tool
    def book(flight: str) -> str:
        """Book a flight (default key)."""
        sent.append(flight)
        return "booked"

    @tool(key=lambda **kw: f"order-{kw['arguments']['flight']}")
    def order(flight: str) -> str:
        """Order (a business key)."""
        sent.append(flight)
        return "ordered"

    calls = {
        "arguments, default key": [
            ToolCall(id="c1", name="book", arguments={"flight": "LH\ud83d"})
        ],
        "arguments, custom key": [
            ToolCall(id="c1", name="order", arguments={"flight": "LH\ud83d"})
        ],
        "call id": [ToolCall(id="c\ud83d", name="book", arguments={"flight": "LH1"})],
    }[where]
    return Agent("odd", "Book.", [book, order]), calls, sent


@pytest.mark.parametrize("where", ["arguments, default key", "arguments, custom key", "call id"])
async def test_a_lone_surrogate_in_a_models_call_is_refused_not_a_crash(
    tmp_path: Path, where: str
) -> None:
    # Fixed by refusing the call ("not sent", saying why): no store keeps such text as
    # asked, so it is neither keyed nor sent; the model may ask again with whole characters.
    agent, calls, sent = _odd_calls(where)
    async with open_stores(f"sqlite:///{tmp_path / 'adk.sqlite3'}") as stores:
        await stores.create_schema()
        runner = AgentRunner.from_stores(_Asks(calls), stores)
        try:
            run = await runner.run(agent, "book", tenant=T, run_id="r")
        finally:
            assert len(sent) <= 1, sent  # held: never sent twice
    assert run.status is RunStatus.completed
    assert sent == []


# --- 4. --json with a lone surrogate is not I-JSON ----------------------------------------


def _odd_run(url: str) -> None:
    @tool
    def fetch(page: str) -> str:
        """Fetch a page (it holds half a surrogate pair)."""
        return ODD

    async def go() -> None:
        async with open_stores(url) as stores:
            await stores.create_schema()
            provider = ScriptedProvider([[("fetch", {"page": "1"})], "answer: " + ODD])
            await AgentRunner.from_stores(provider, stores).run(
                Agent("reader", "Read.", [fetch]), "read it", tenant=T, run_id="r"
            )

    asyncio.run(go())


@pytest.mark.parametrize("command", ["show", "inspect", "runs"])
def test_json_output_holds_no_lone_surrogate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    url = f"sqlite:///{tmp_path / 'adk.sqlite3'}"
    _odd_run(url)
    argv = ["runs", "--tenant", T] if command == "runs" else [command, "r", "--tenant", T]
    code, out, err = _main(capsys, "--store", url, *argv, "--json")
    assert code == ExitCode.CARRIED_ON, err
    assert out.isascii()  # held: ASCII
    document = json.loads(out)
    # Every string of the document is Unicode text (RFC 7493 2.1: no unpaired surrogates).
    json.dumps(document, ensure_ascii=False).encode("utf-8")


# --- 5 and 6. the worker and Redis --------------------------------------------------------


def _worker(runner: AgentRunner, agent: Agent) -> Worker:
    return Worker(
        runner,
        [agent],
        exit_when_idle=True,
        poll_interval=0.01,
        backoff=Backoff(base=0.01, cap=0.02),
    )


@pytest.mark.redis
@pytest.mark.parametrize(
    "refusal",
    [
        "MISCONF Errors writing to the AOF file: No space left on device",
        "NOREPLICAS Not enough good replicas to write.",
    ],
)
async def test_a_worker_outlives_a_redis_that_refuses_writes_for_a_while(refusal: str) -> None:
    from redis.exceptions import ResponseError

    async with services.redis_stores() as stores:
        assert stores.work is not None
        work: Any = stores.work
        due, polls = work._due, []

        async def refused_once(*args: Any, **kwargs: Any) -> Any:
            polls.append(1)
            if len(polls) == 1:
                raise ResponseError(refusal)  # what redis-py raises for the server's reply
            return await due(*args, **kwargs)

        work._due = refused_once
        agent = booking_agent(Airline())
        worker = _worker(AgentRunner.from_stores(ScriptedProvider(BOOK_TURNS), stores), agent)
        try:
            await asyncio.wait_for(worker.run(), 20)
        finally:
            work._due = due
    assert len(polls) >= 2, polls


@pytest.mark.redis
async def test_one_damaged_run_on_redis_does_not_stop_the_worker() -> None:
    async with services.redis_stores() as stores:
        agent = booking_agent(Airline())
        runner = AgentRunner.from_stores(ScriptedProvider(BOOK_TURNS), stores)
        await runner.submit(agent, "book", tenant=T, run_id="healthy")
        await runner.submit(agent, "book", tenant=T, run_id="damaged")
        client = await services.redis_client()
        try:
            prefix = stores.work._keys.prefix  # type: ignore[union-attr]
            [work_key] = [k async for k in client.scan_iter(match=f"{prefix}*damaged*:work")]
            # The run's lease key holding another kind of value (a hand edit, another app).
            await client.set(work_key[: -len(b":work")] + b":lease", b"not a hash")
        finally:
            await client.aclose()
        worker = _worker(runner, agent)
        await asyncio.wait_for(worker.run(), 20)
        healthy = await Checkpointer.from_stores(stores).latest(T, "healthy")
    assert healthy is not None and healthy.status.value == "completed"


# --- 7. a read-only call left in flight is no call in doubt -------------------------------


def _weather_run(url: str, *, then: str) -> None:
    """A run whose read-only lookup died in flight; then carried on (the model, asked again,
    answers without it) or cancelled."""
    die = {"on": True}

    @tool(side_effects=False)
    def weather(city: str) -> str:
        """Read the weather (no side effects)."""
        if die["on"] and city == "Bergen":
            raise SimulatedCrash("died while looking")
        return "sunny"

    agent = Agent("forecaster", "Tell the weather.", [weather])
    first = [[("weather", {"city": "Oslo"})], [("weather", {"city": "Bergen"})], "done"]
    again = [[("weather", {"city": "Oslo"})], "Sunny in Oslo; Bergen is probably wet."]

    async def go() -> None:
        async with open_stores(url) as stores:
            await stores.create_schema()
            runner = AgentRunner.from_stores(
                ScriptedProvider(first), stores, policy=ONLY_AFTER_TOOLS, lease_policy=FAST
            )
            with pytest.raises(SimulatedCrash):
                await runner.run(agent, "weather?", tenant=T, run_id="r")
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


@pytest.mark.parametrize("then", ["carried on", "cancelled"])
def test_a_read_only_call_left_in_flight_makes_no_run_stuck(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], then: str
) -> None:
    url = f"sqlite:///{tmp_path / 'adk.sqlite3'}"
    _weather_run(url, then=then)
    code, out, err = _main(capsys, "--store", url, "inspect", "r", "--tenant", T)
    assert code == ExitCode.CARRIED_ON, err
    assert "indeterminate" not in out and "tesserix resolve" not in out, out
    code, out, err = _main(capsys, "--store", url, "runs", "--tenant", T, "--stuck")
    assert (code, out) == (ExitCode.CARRIED_ON, "no runs\n"), (out, err)


# --- 8. the console's run page ------------------------------------------------------------


def _booking_run_holding(url: str, run_id: str, airline: Airline) -> Any:
    async def go() -> Any:
        async with open_stores(url) as stores:
            await stores.create_schema()
            runner = AgentRunner.from_stores(ScriptedProvider(BOOK_TURNS), stores)
            return await runner.run(booking_agent(airline), "book", tenant=T, run_id=run_id)

    return asyncio.run(go())


def _detail(url: str, run_id: str) -> Any:
    from tesserix_adk.console.reads import run_detail

    async def go() -> Any:
        async with open_stores(url) as stores:
            return await run_detail(stores, T, run_id)

    return asyncio.run(go())


def test_console_does_not_say_a_live_holder_no_longer_carries_the_run(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'adk.sqlite3'}"
    airline = Airline()
    inside, go_on = threading.Event(), threading.Event()

    def hold(stage: str) -> None:
        if stage == "before":
            inside.set()
            go_on.wait(30)

    airline.hook = hold
    worker = threading.Thread(target=_booking_run_holding, args=(url, "live", airline))
    worker.start()
    try:
        assert inside.wait(30), "the run never reached book_seat"
        detail = _detail(url, "live")
    finally:
        go_on.set()
        worker.join(30)
    assert detail.lease is not None
    [call] = detail.plan.calls
    assert detail.lease.holder in call.reason  # held: it names the holder
    assert "no longer carries the run" not in call.reason, call.reason


def _booking_left_in_doubt_then_cancelled(url: str) -> None:
    airline = Airline()

    def die(stage: str) -> None:
        if stage == "after":
            raise SimulatedCrash("died right after booking")

    airline.hook = die

    async def go() -> None:
        async with open_stores(url) as stores:
            await stores.create_schema()
            runner = AgentRunner.from_stores(ScriptedProvider(BOOK_TURNS), stores)
            with pytest.raises(SimulatedCrash):
                await runner.run(booking_agent(airline), "book", tenant=T, run_id="r")
            await runner.cancel("r", tenant=T, by="ops")

    asyncio.run(go())


def test_console_names_the_call_an_ended_run_left_in_doubt(tmp_path: Path) -> None:
    from tesserix_adk.console.pages import run_page
    from tesserix_adk.console.reads import RunFilter, runs

    url = f"sqlite:///{tmp_path / 'adk.sqlite3'}"
    _booking_left_in_doubt_then_cancelled(url)

    async def listed() -> list[Any]:
        async with open_stores(url) as stores:
            return await runs(stores, T, RunFilter(stuck=True))

    [summary] = asyncio.run(listed())
    assert summary.stuck  # held: the list says so
    detail = _detail(url, "r")
    assert [p.call_id for p in detail.plan.indeterminate] == ["call_1_0"]
    assert not detail.plan.safe
    assert "/resolve" in run_page(T, detail, "csrf")


# --- 9. a far-future lease ----------------------------------------------------------------


def test_a_lease_expiring_past_year_9999_hides_no_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"sqlite:///{tmp_path / 'adk.sqlite3'}"
    _booking_run_holding(url, "other", Airline())
    _booking_run_holding(url, "held", Airline())

    async def hold() -> None:
        async with open_stores(url) as stores:
            await stores.leases.acquire(T, "held", "janitor", 3e11)  # ttl in seconds

    asyncio.run(hold())
    code, out, err = _main(capsys, "--store", url, "runs", "--tenant", T)
    assert code == ExitCode.CARRIED_ON, err
    assert "other" in out and "held" in out
    for command in ("inspect", "show"):
        code, _, err = _main(capsys, "--store", url, command, "held", "--tenant", T)
        assert (code, err) == (ExitCode.CARRIED_ON, ""), (command, err)


# --- 10. error texts on the operator's terminal -------------------------------------------


def _frontier_after_the_search(url: str) -> None:
    class _DiesOnSecondTurn:
        def __init__(self) -> None:
            self.inner = ScriptedProvider(BOOK_TURNS)
            self.asked = 0

        async def complete(self, request: ModelRequest) -> ModelResponse:
            self.asked += 1
            if self.asked == 2:
                raise SimulatedCrash("died while the model thought")
            response: ModelResponse = await self.inner.complete(request)
            return response

    async def go() -> None:
        async with open_stores(url) as stores:
            await stores.create_schema()
            runner = AgentRunner.from_stores(_DiesOnSecondTurn(), stores)
            with pytest.raises(SimulatedCrash):
                await runner.run(AGENT, "book", tenant=T, run_id="r")

    asyncio.run(go())


@pytest.mark.parametrize("as_json", [False, True])
def test_run_resume_never_prints_a_secret_an_error_repeats(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], as_json: bool
) -> None:
    url = f"sqlite:///{tmp_path / 'adk.sqlite3'}"
    _frontier_after_the_search(url)
    json_flag = ["--json"] if as_json else []
    code, out, err = _main(capsys, "--store", url, "run", "--resume", "r", "--tenant", T,
                           "--agent", f"{HERE}:AGENT", "--provider", f"{HERE}:leaky",
                           *json_flag)  # fmt: skip
    assert code == ExitCode.MUST_NOT_CARRY_ON, err  # held: one sentence, exit 4
    assert "client misconfigured" in err  # held: it says what went wrong
    assert SECRET not in err + out and BEARER not in err + out, err


# ==========================================================================================
# What held
# ==========================================================================================


async def test_a_key_function_that_fails_on_masked_arguments_is_refused_not_sent(
    tmp_path: Path,
) -> None:
    path = tmp_path / "adk.sqlite3"
    sent: list[str | None] = []

    def by_card(**kw: Any) -> str:
        token = kw["arguments"]["token"]
        if token.startswith("[redacted"):
            raise ValueError("not a card token")
        return f"charge-{token}"

    @tool(key=by_card)
    def charge(token: str, ctx: ToolContext) -> str:
        """Charge a stored card by its token."""
        sent.append(ctx.idempotency_key)
        return "charged"

    agent = Agent("payer", "Charge.", [charge])
    turns = [[("charge", {"token": "tok_4242"})], "done"]
    async with open_stores(f"sqlite:///{path}") as stores:
        await stores.create_schema()
        for run_id in ("first", "second"):
            run = await AgentRunner.from_stores(ScriptedProvider(turns), stores).run(
                agent, "charge", tenant=T, run_id=run_id
            )
            assert run.status is RunStatus.completed
    assert sent == []
    assert b"tok_4242" not in _everything_stored(path)


@contextlib.asynccontextmanager
async def _backend(name: str, tmp_path: Path) -> Any:
    if name == "sqlite":
        async with open_stores(f"sqlite:///{tmp_path / 'adk.sqlite3'}?keep_last=1") as stores:
            await stores.create_schema()
            yield stores
    elif name == "redis":
        async with services.redis_stores(keep_last=1) as stores:
            yield stores
    else:
        async with services.postgres_stores(keep_last=1) as stores:
            yield stores


async def _readable(stores: Stores, run_id: str) -> list[str]:
    checkpointer = Checkpointer.from_stores(stores)
    latest = await checkpointer.latest(T, run_id)
    assert latest is not None
    kept = await checkpointer.steps(T, run_id)
    assert kept, run_id
    for step in kept:
        cp = await checkpointer.at(T, run_id, step)
        assert cp is not None and cp.step == step
    return [str(latest.status), *(str(s) for s in kept)]


@pytest.mark.parametrize(
    "backend",
    [
        "sqlite",
        pytest.param("redis", marks=pytest.mark.redis),
        pytest.param("postgres", marks=pytest.mark.postgres),
    ],
)
async def test_the_step_check_refuses_nothing_a_legitimate_writer_wrote(
    backend: str, tmp_path: Path
) -> None:
    async with _backend(backend, tmp_path) as stores:
        # A run pruned to its last step, carried on after a death.
        runner = faulty_runner(
            stores,
            ScriptedProvider(BOOK_TURNS),
            crash_before=at("after_tool_result", 1),
            lease_policy=FAST,
        )
        with pytest.raises(SimulatedCrash):
            await runner.run(booking_agent(Airline()), "book", tenant=T, run_id="carried")
        again = AgentRunner.from_stores(ScriptedProvider(BOOK_TURNS), stores, lease_policy=FAST)
        assert (await again.resume(booking_agent(Airline()), "carried", tenant=T)).status is (
            RunStatus.completed
        )
        # A run whose frontier was too large: a tombstone in its place.
        tiny = AgentRunner.from_stores(ScriptedProvider(BOOK_TURNS), stores, max_bytes=300)
        await tiny.run(booking_agent(Airline()), "book", tenant=T, run_id="tombstoned")
        # A run cancelled by an operator while it waited on an approval.
        asks = AgentRunner.from_stores(ScriptedProvider(BOOK_TURNS), stores)
        waiting = await asks.run(
            booking_agent(Airline(), approval=True), "book", tenant=T, run_id="cancelled"
        )
        assert waiting.status is RunStatus.waiting_approval
        await asks.cancel("cancelled", tenant=T, by="ops")
        seen = {r: await _readable(stores, r) for r in ("carried", "tombstoned", "cancelled")}
    assert seen["carried"][0] == "completed"
    assert seen["tombstoned"][0] == "tombstone"
    assert seen["cancelled"][0] == "cancelled"


async def test_a_worker_outlives_a_passing_poll_failure_and_a_damaged_sqlite_entry(
    tmp_path: Path,
) -> None:
    path = tmp_path / "adk.sqlite3"
    async with open_stores(f"sqlite:///{path}") as stores:
        await stores.create_schema()
        assert stores.work is not None
        agent = booking_agent(Airline())
        runner = AgentRunner.from_stores(ScriptedProvider(BOOK_TURNS), stores)
        await runner.submit(agent, "book", tenant=T, run_id="healthy")
        await runner.submit(agent, "book", tenant=T, run_id="damaged")
        _execute(path, "UPDATE adk_work SET attempts = 'many' WHERE run_id = 'damaged'")
        work: Any = stores.work
        due, polls = work.due, []

        async def passing(*args: Any, **kwargs: Any) -> Any:
            polls.append(1)
            if len(polls) == 1:
                raise StoreUnavailableError("the store is restarting")
            return await due(*args, **kwargs)

        work.due = passing
        worker = _worker(runner, agent)
        try:
            await asyncio.wait_for(worker.run(), 20)
        finally:
            work.due = due
        healthy = await Checkpointer.from_stores(stores).latest(T, "healthy")
    assert len(polls) >= 2
    assert healthy is not None and healthy.status.value == "completed"
    assert [item.run_id for item, _ in worker.carried] == ["healthy"]  # the other left out


def test_a_booking_a_cancel_left_in_doubt_is_listed_and_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"sqlite:///{tmp_path / 'adk.sqlite3'}"
    _booking_left_in_doubt_then_cancelled(url)
    code, out, err = _main(capsys, "--store", url, "runs", "--tenant", T, "--stuck")
    assert code == ExitCode.CARRIED_ON and out.startswith("r "), (out, err)
    code, out, err = _main(capsys, "--store", url, "inspect", "r", "--tenant", T)
    assert code == ExitCode.CARRIED_ON, err
    assert "book_seat (call_1_0): indeterminate" in out and "tesserix resolve" in out, out


@pytest.fixture(autouse=True)
def _quiet(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No traceback added to the CLI's sentences under ``ADK_DEBUG``."""
    monkeypatch.delenv("ADK_DEBUG", raising=False)
    yield
