"""A reviewer's attacks on four commits: 8ca3058 (the worker counts its own takes: ``_carry``,
``_after_error``, ``_give_back``; the runner's ``_wanted`` without a count), 697908d (a cancel
acknowledged while the model thinks ends the run cancelled, whatever it answers), 95b29e4
(runs with no frontier listed and shown; ``tesserix cancel`` names the standing request and
says "requested" for a run held before its first frontier) and a92a6fb (adjacent text parts
of a message redacted again joined; ``password=Authorization: x``).

Attacked: a worker's give-back landing after another worker parked the run; a cancel landing
between a worker's poll and its take; a run whose resume claim a dead resumer left behind (a
hot loop, and the count kept); a cancel acknowledged during the last model call of a streamed
run and of a replay; ``tesserix cancel`` of a run carried in-process (``runner.run``, never
submitted) before its first frontier, and of bad ids; a key split across two text parts whose
head alone is long enough to be masked (OpenAI key, a ``password=`` value, a Bearer token);
a key split across three parts; text parts whose joined text is JSON; a resume and a replay
of a run whose first message held a split key (transcript verified, what the model is told);
a password whose value ends in a credential-like word and a colon.

Defects found, all fixed since (they were strict xfails; their tests pass now): a want
with a count leaves a parked or done entry as it is, `tesserix cancel` looks at the lease of
a run with no frontier, a value masked at the end of a text part goes on into the next, and
only a header's very name is taken for the next key:
- a worker's give-back (``want(count=-1)``, default state ``wanted``) unparks a run another
  worker parked meanwhile, erasing its reason: the run is due again, taken by the next poll
  (memory, SQLite, Redis and PostgreSQL alike; the take's own ``want(count=1)`` does the
  same to a run parked between the poll and the take);
- ``tesserix cancel`` of a run carried in-process before its first frontier answers
  "nothing is checkpointed or submitted" (exit 1) while ``tesserix runs`` lists the same run
  with its live lease; no cancel is recorded and the booking it goes on to ask for is sent;
- a key split across two text parts, the head long enough to match on its own, is masked
  only in the head: the joined pass runs over the parts already redacted, where the head is
  a placeholder, so the tail of the key (62 characters of an OpenAI key, most of a password,
  most of a Bearer token) is stored in clear;
- a92a6fb's ``password=Authorization: x`` rule leaves a password whose value ends in a
  credential-like word and a colon unmasked (``db_password=Sup3rSecret: rotate it``): it was
  masked before the commit.

Held (plain tests): a run cancelled between a worker's poll and its take ends cancelled, the
model never asked and nothing sent; a run whose resume claim a dead resumer holds is looked at
about once a lease ttl, its count given back each time (never parked for it); a cancel during
the last model call of a streamed run and of a replay ends each cancelled; ``tesserix cancel``
ends an empty or over-long id in one sentence, exit 2; a key split across three parts, each
too short, is masked; joined text parts that make JSON are masked under their key; a run
whose first message held a split key resumes (its transcript verifies) telling the model the
masked text as one part, stores nothing of the key, and replays.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import sqlite3
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from processes import store_url
from tesserix_adk import (
    Agent,
    AgentRunner,
    Backoff,
    LeasePolicy,
    RunStatus,
    ScriptedProvider,
    TextPart,
    Worker,
    WorkState,
    open_stores,
    tool,
)
from tesserix_adk.checkpoint.redaction import Redactor
from tesserix_adk.cli.main import main as tesserix
from tesserix_adk.messages import Message, Role
from tesserix_adk.run.attempt import RunClaim
from tesserix_adk.run.events import RunFinished
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.stores.memory import MemoryWorkIndex
from tesserix_adk.testing.faults import SimulatedCrash
from tesserix_adk.testing.secrets import planted_secrets

T = "acme"
FAST = Backoff(base=0.01, cap=0.02)


# --- helpers -------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def _stores(backend: str, tmp_path: Path) -> AsyncIterator[Stores]:
    if backend == "memory":
        stores = open_stores("memory://")
        stores.work = MemoryWorkIndex(stores.leases)
        yield stores
        return
    async with store_url(backend, tmp_path) as url, open_stores(url) as stores:
        await stores.create_schema()
        yield stores


def _runner(stores: Stores, provider: Any, ttl: float = 2.0, **kw: Any) -> AgentRunner:
    return AgentRunner.from_stores(
        provider,
        stores,
        lease_policy=LeasePolicy(ttl=ttl, renew_within=ttl / 2),
        resume_claim_ttl=ttl,
        **kw,
    )


async def _entry(stores: Stores, run_id: str) -> Any:
    assert stores.work is not None
    for state in (None, WorkState.done):
        found = [i for i in await stores.work.items(T, state=state) if i.run_id == run_id]
        if found:
            return found[0]
    return None


async def _until(cond: Any, seconds: float, what: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while not await cond():
        assert loop.time() < deadline, what
        await asyncio.sleep(0.01)


def _everything(path: Path) -> str:
    """Every stored byte of a SQLite store: the files and every row of every table."""
    out = bytearray()
    for suffix in ("", "-wal", "-shm", "-journal"):
        f = Path(str(path) + suffix)
        if f.exists():
            out += f.read_bytes()
    with contextlib.closing(sqlite3.connect(path)) as db:
        tables = [r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")]
        for table in tables:
            for row in db.execute(f'SELECT * FROM "{table}"'):
                for cell in row:
                    out += cell if isinstance(cell, bytes) else str(cell).encode()
                    out += b"\n"
    return bytes(out).decode("utf-8", "replace")


def _shown(stored: str, fragment: str) -> bool:
    return fragment in stored or json.dumps(fragment)[1:-1] in stored


def _cli(url: str, *args: str) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = tesserix([*args, "--store", url])
    return code, out.getvalue()


class _Held(ScriptedProvider):
    """Scripted turns; each model call waits for ``go`` (it says ``started`` first)."""

    def __init__(self, turns: list[Any]) -> None:
        super().__init__(turns)
        self.started = asyncio.Event()
        self.go = asyncio.Event()

    async def complete(self, request: Any) -> Any:
        self.started.set()
        await asyncio.wait_for(self.go.wait(), 10)
        return await super().complete(request)


# --- 8ca3058: the worker counts its takes ----------------------------------------------------


class _GiveBackAfterPark:
    """A work index where another worker (B) takes the run right after this worker's poll,
    then, before this worker's give-back lands, lets go of it and parks it (B found a call
    in doubt: the order of writes over a network)."""

    def __init__(self, inner: Any, stores: Stores) -> None:
        self.inner = inner
        self.stores = stores
        self.lease: Any = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def due(self, *, limit: int, agents: Any = None) -> Any:
        items = await self.inner.due(limit=limit, agents=agents)
        if items and self.lease is None:
            self.lease = await self.stores.leases.acquire(T, "r1", "worker-B", 5.0)
        return items

    async def want(self, tenant: str, run_id: str, **kw: Any) -> None:
        if kw.get("count") == -1 and self.lease is not None:
            await self.stores.leases.release(self.lease)
            await self.inner.park(
                tenant, run_id, agent=kw["agent"], reason="IndeterminateToolCallError: book"
            )
        await self.inner.want(tenant, run_id, **kw)


@pytest.mark.parametrize(
    "backend",
    [
        "memory",
        "sqlite",
        pytest.param("redis", marks=pytest.mark.redis),
        pytest.param("postgres", marks=pytest.mark.postgres),
    ],
)
async def test_a_give_back_landing_after_another_workers_park_leaves_the_run_parked(
    backend: str, tmp_path: Path
) -> None:
    async with _stores(backend, tmp_path) as stores:
        agent = Agent("a", "i")
        runner = _runner(stores, ScriptedProvider(["ok"]))
        await runner.submit(agent, "go", tenant=T, run_id="r1")
        inner = stores.work
        runner.work = _GiveBackAfterPark(inner, stores)
        worker = Worker(runner, [agent], poll_interval=0.01, backoff=FAST)
        task = asyncio.create_task(worker.run())
        try:
            await _until(lambda: _carried(worker), 10, "never taken")
        finally:
            worker.drain()
            await asyncio.wait_for(task, 10)
        assert [str(how) for _, how in worker.carried] == ["elsewhere"]  # refused, given back
        entry = await _entry(stores, "r1")
        assert (entry.state, entry.reason) == (
            WorkState.parked,
            "IndeterminateToolCallError: book",
        )
        assert inner is not None and await inner.due(limit=5) == []


async def _carried(worker: Worker) -> bool:
    return bool(worker.carried)


class _CancelAfterPoll:
    """A work index where an operator's cancel lands right after this worker's poll."""

    def __init__(self, inner: Any, canceller: AgentRunner) -> None:
        self.inner = inner
        self.canceller = canceller
        self.cancelled = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def due(self, *, limit: int, agents: Any = None) -> Any:
        items = await self.inner.due(limit=limit, agents=agents)
        if items and not self.cancelled:
            self.cancelled = True
            assert await self.canceller.cancel("r1", tenant=T, by="ops") is None
        return items


async def test_a_run_cancelled_between_a_workers_poll_and_its_take_sends_nothing() -> None:
    async with _stores("memory", Path()) as stores:
        sent: list[str] = []

        @tool
        def book(flight: str) -> str:
            """Book a flight."""
            sent.append(flight)
            return "booked"

        agent = Agent("a", "Book.", [book])
        model = ScriptedProvider([[("book", {"flight": "F1"})], "done"])
        runner = _runner(stores, model)
        await runner.submit(agent, "book F1", tenant=T, run_id="r1")
        runner.work = _CancelAfterPoll(stores.work, _runner(stores, model))
        worker = Worker(runner, [agent], poll_interval=0.01, backoff=FAST)
        task = asyncio.create_task(worker.run())
        try:
            await _until(lambda: _carried(worker), 10, "never taken")
        finally:
            worker.drain()
            await asyncio.wait_for(task, 10)
        assert [str(how) for _, how in worker.carried] == ["finished"]
        assert model.calls == 0 and sent == []
        assert runner.checkpoints is not None
        cp = await runner.checkpoints.latest(T, "r1")
        assert cp is not None and str(cp.status) == "cancelled"
        assert stores.work is not None and await stores.work.due(limit=5) == []


async def test_a_claim_left_by_a_dead_resumer_is_looked_at_once_a_ttl_and_never_counted() -> None:
    """A ``tesserix run --resume`` killed mid-run leaves its resume claim for five minutes
    while the lease lapses at once: every worker sees the run due. Each take is refused and
    given back; the worker must not spin on it, and the run must not be parked for it."""
    async with _stores("memory", Path()) as stores:
        crash = {"on": True}

        @tool(side_effects=False)
        def lookup(code: str) -> str:
            """Look a code up."""
            if crash["on"]:
                raise SimulatedCrash("killed in lookup")
            return code

        agent = Agent("a", "Look up.", [lookup])
        model = ScriptedProvider([[("lookup", {"code": "X"})], "done"])
        runner = _runner(stores, model, ttl=0.2)
        with pytest.raises(SimulatedCrash):
            await runner.run(agent, "look X up", tenant=T, run_id="r1")
        crash["on"] = False
        dead = RunClaim(stores.idempotency, tenant=T, run_id="r1", holder="cli-dead", ttl=300)
        await dead.take()  # never renewed, never released: the resumer was killed
        worker = Worker(runner, [agent], poll_interval=0.01, backoff=FAST, max_attempts=3)
        task = asyncio.create_task(worker.run())
        await asyncio.sleep(1.0)
        worker.drain()
        await asyncio.wait_for(task, 10)
        hows = {str(how) for _, how in worker.carried}
        assert hows == {"elsewhere"}, hows
        assert 1 <= len(worker.carried) <= 12, f"taken {len(worker.carried)} times in 1 s"
        entry = await _entry(stores, "r1")
        assert (entry.state, entry.attempts) == (WorkState.wanted, 0)


# --- 697908d: a cancel acknowledged while the model thinks ---------------------------------


async def test_a_cancel_during_the_last_model_call_of_a_streamed_run_ends_it_cancelled() -> None:
    async with _stores("memory", Path()) as stores:
        model = _Held(["All done."])
        runner = _runner(stores, model)
        events: list[Any] = []

        async def consume() -> None:
            async for event in runner.stream(Agent("a", "i"), "hi", tenant=T, run_id="s1"):
                events.append(event)

        task = asyncio.create_task(consume())
        await asyncio.wait_for(model.started.wait(), 10)
        assert await _runner(stores, model).cancel("s1", tenant=T, by="ops") is None
        model.go.set()
        await asyncio.wait_for(task, 10)
        assert isinstance(events[-1], RunFinished)
        assert events[-1].run.status is RunStatus.cancelled
        assert runner.checkpoints is not None
        cp = await runner.checkpoints.latest(T, "s1")
        assert cp is not None and str(cp.status) == "cancelled"


async def test_a_cancel_during_the_last_model_call_of_a_replay_ends_it_cancelled() -> None:
    async with _stores("memory", Path()) as stores:

        @tool(side_effects=False)
        def lookup(code: str) -> str:
            """Look a code up."""
            return code

        agent = Agent("a", "Look up.", [lookup])
        turns: list[Any] = [[("lookup", {"code": "X"})], "done"]
        original = await _runner(stores, ScriptedProvider(turns)).run(
            agent, "look", tenant=T, run_id="o1"
        )
        assert original.status is RunStatus.completed
        model = _Held(turns)
        runner = _runner(stores, model)
        assert runner.checkpoints is not None
        steps = await runner.checkpoints.steps(T, "o1")
        after_tool = None
        for step in steps:
            cp = await runner.checkpoints.at(T, "o1", step)
            if cp is not None and str(cp.boundary) == "after_tool_result":
                after_tool = step
        assert after_tool is not None, steps
        replay = asyncio.create_task(
            runner.replay(agent, "o1", tenant=T, from_step=after_tool, stubs={}, new_run_id="rp")
        )
        await asyncio.wait_for(model.started.wait(), 10)
        assert await _runner(stores, model).cancel("rp", tenant=T, by="ops") is None
        model.go.set()
        run = await asyncio.wait_for(replay, 10)
        assert run.status is RunStatus.cancelled
        assert run.output is not None and "ops" in run.output


# --- 95b29e4: tesserix cancel of a run with no frontier ---------------------------------------


SENT: list[str] = []


@tool
def book_seat(code: str) -> str:
    """Book a seat."""
    SENT.append(code)
    return code


class _SlowFirst(ScriptedProvider):
    """Its first model call waits (in another thread's loop) until ``gate`` is set."""

    def __init__(self, turns: list[Any], asked: threading.Event, gate: threading.Event) -> None:
        super().__init__(turns)
        self.asked, self.gate = asked, gate

    async def complete(self, request: Any) -> Any:
        self.asked.set()
        for _ in range(3000):
            if self.gate.is_set():
                break
            await asyncio.sleep(0.01)
        return await super().complete(request)


@contextlib.contextmanager
def _carried_in_process(url: str, run_id: str) -> Iterator[dict[str, Any]]:
    """``runner.run`` (an app carrying its own run, never submitted) in another thread,
    held in its first model call (lease live, no frontier) until the block ends."""
    asked, gate = threading.Event(), threading.Event()
    ended: dict[str, Any] = {}

    async def carry() -> None:
        async with open_stores(url) as stores:
            model = _SlowFirst([[("book_seat", {"code": "X1"})], "done"], asked, gate)
            runner = AgentRunner.from_stores(model, stores)
            try:
                agent = Agent("booking", "Book.", [book_seat])
                ended["run"] = await runner.run(agent, "book", tenant=T, run_id=run_id)
            except Exception as exc:
                ended["error"] = exc

    thread = threading.Thread(target=lambda: asyncio.run(carry()), daemon=True)
    thread.start()
    try:
        assert asked.wait(30), "the run never reached its first model call"
        yield ended
    finally:
        gate.set()
        thread.join(60)


async def _schema(url: str) -> None:
    async with open_stores(url) as stores:
        await stores.create_schema()


def test_cancelling_a_run_carried_in_process_before_its_first_frontier_is_requested(
    tmp_path: Path,
) -> None:
    url = f"sqlite:///{tmp_path / 'adk.sqlite3'}"
    asyncio.run(_schema(url))
    SENT.clear()
    with _carried_in_process(url, "r-app") as ended:
        code, out = _cli(url, "runs", "--tenant", T, "--json")
        (row,) = json.loads(out)["runs"]
        assert code == 0 and row["run_id"] == "r-app" and row["lease"] is not None  # listed
        code, out = _cli(url, "cancel", "r-app", "--tenant", T, "--by", "erin", "--json")
    assert "error" not in ended, ended
    assert code == 0, out  # fails here: "nothing is checkpointed or submitted", exit 1
    assert json.loads(out)["state"] == "requested"
    assert ended["run"].status is RunStatus.cancelled
    assert SENT == [], "the booking of a run the operator cancelled was sent"


@pytest.mark.parametrize(
    ("run_id", "said"),
    [("", "must not be empty"), ("r" * 600, "ids longer than 512 bytes are refused")],
)
def test_tesserix_cancel_ends_a_bad_id_in_one_sentence_exit_2(
    tmp_path: Path, run_id: str, said: str
) -> None:
    url = f"sqlite:///{tmp_path / 'adk.sqlite3'}"
    code, out = _cli(url, "cancel", run_id, "--tenant", T, "--by", "erin")
    assert code == 2
    lines = out.strip().splitlines()
    assert len(lines) == 1 and said in lines[0] and "Traceback" not in out, out


# --- a92a6fb: text parts redacted joined --------------------------------------------------------


def _split_cases() -> list[Any]:
    secrets = planted_secrets()
    key = secrets["openai_key"]
    bearer = secrets["bearer"]  # "Bearer <token>"
    password = "Hun" + "ter2-Secr3t-pw-9z"
    return [
        pytest.param(["my key is " + key[:30], key[30:] + " thanks"], key[30:], id="openai_key"),
        pytest.param(
            ["password=" + password[:3], password[3:] + " now"], password[3:], id="password"
        ),
        pytest.param(["Authorization: " + bearer[:20], bearer[20:]], bearer[20:], id="bearer"),
    ]


async def _run_with_first_message(url: str, parts: list[str]) -> Any:
    async with open_stores(url) as stores:
        await stores.create_schema()
        runner = _runner(stores, ScriptedProvider(["ok"]))
        message = Message.user([TextPart(text=p) for p in parts])
        return await runner.run(Agent("a", "i"), [message], tenant=T, run_id="r1")


@pytest.mark.parametrize(("parts", "tail"), _split_cases())
async def test_a_key_split_across_two_text_parts_leaves_no_tail_of_it_stored(
    tmp_path: Path, parts: list[str], tail: str
) -> None:
    assert len(tail) >= 12
    run = await _run_with_first_message(f"sqlite:///{tmp_path / 'adk.sqlite3'}", parts)
    assert run.status is RunStatus.completed
    stored = _everything(tmp_path / "adk.sqlite3")
    assert not _shown(stored, tail), "the tail of the key is stored unmasked"


async def test_a_key_split_across_three_text_parts_each_too_short_is_masked(
    tmp_path: Path,
) -> None:
    key = planted_secrets()["openai_key"]
    parts = ["key " + key[:12], key[12:24], key[24:]]
    run = await _run_with_first_message(f"sqlite:///{tmp_path / 'adk.sqlite3'}", parts)
    assert run.status is RunStatus.completed
    stored = _everything(tmp_path / "adk.sqlite3")
    assert "[redacted:openai_key]" in stored
    for piece in (key[12:24], key[24:]):
        assert not _shown(stored, piece)


async def test_text_parts_that_join_into_json_are_masked_under_their_key(tmp_path: Path) -> None:
    value = "Zq3Xv9Lm2Nb7Tc5Rd1Wf"
    parts = ['{"user": "ann", "api_key": "', value + '"}']
    run = await _run_with_first_message(f"sqlite:///{tmp_path / 'adk.sqlite3'}", parts)
    assert run.status is RunStatus.completed
    stored = _everything(tmp_path / "adk.sqlite3")
    assert not _shown(stored, value)


async def test_a_run_whose_first_message_held_a_split_key_resumes_and_replays(
    tmp_path: Path,
) -> None:
    """The merged part is what a resume tells the model (one part, the masked text); the
    transcript it was written to verifies; a replay from its step runs."""
    key = planted_secrets()["openai_key"]
    url = f"sqlite:///{tmp_path / 'adk.sqlite3'}"
    crash = {"on": True}

    @tool(side_effects=False)
    def lookup(code: str) -> str:
        """Look a code up."""
        if crash["on"]:
            raise SimulatedCrash("killed in lookup")
        return code

    agent = Agent("a", "Look up.", [lookup])
    turns: list[Any] = [[("lookup", {"code": "X"})], "done"]
    first = Message.user([TextPart(text="my key is " + key[:12]), TextPart(text=key[12:])])
    told: list[Any] = []

    class Recording(ScriptedProvider):
        async def complete(self, request: Any) -> Any:
            told.append(request)
            return await super().complete(request)

    async with open_stores(url) as stores:
        await stores.create_schema()
        with pytest.raises(SimulatedCrash):
            await _runner(stores, ScriptedProvider(turns)).run(
                agent, [first], tenant=T, run_id="r1"
            )
        crash["on"] = False
        runner = _runner(stores, Recording(turns))
        run = await runner.resume(agent, "r1", tenant=T)
        assert run.status is RunStatus.completed
        (user,) = [m for m in told[-1].messages if m.role is Role.user]
        assert user.content == (TextPart(text="my key is [redacted:openai_key]"),)
        assert runner.checkpoints is not None
        steps = await runner.checkpoints.steps(T, "r1")
        replayed = await runner.replay(agent, "r1", tenant=T, from_step=steps[0], stubs={})
        assert replayed.status is RunStatus.completed
    stored = _everything(tmp_path / "adk.sqlite3")
    assert not _shown(stored, key[12:]) and not _shown(stored, key)


def test_a_password_ending_in_a_credential_word_and_a_colon_is_masked() -> None:
    for text, password in [
        ("the db_password=Sup3rSecret: rotate it", "Sup3rSecret"),
        ("password=BlueToken: keep it safe", "BlueToken"),
    ]:
        masked = Redactor().text(text)
        assert password not in masked, masked
