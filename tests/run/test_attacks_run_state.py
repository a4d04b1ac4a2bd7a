"""Attacks on a run's structured state (``Agent(state_schema=...)``, ``run(..., state=...)``,
``ctx.state``) across crashes: what a frontier records of it, what a resume restores, what a
tool is handed after a real SIGKILL, on SQLite, Redis and PostgreSQL.

The crash cases run the agent in real ``python`` subprocesses: the first one is killed with
SIGKILL by one of its own tools right after a side-effecting call of the same turn completed
(so the ``after_tool_result`` frontier is never written), and a second process resumes the
run. Every call a tool receives is logged to a file, so the test sees what each process sent.

Found here and fixed since: a resume lost what a completed call's tool wrote into the state
after the last frontier (each call's record now keeps the run's state as it stood then);
a secret in the state was resumed as its mask (refused now, ``StateRedactedError``).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path
from typing import Any

import pydantic
import pytest

from processes import held_open, store_url
from run.helpers import at, faulty_runner, fresh_stores
from tesserix_adk import Agent, AgentRunner, ScriptedProvider, ToolContext, tool
from tesserix_adk.errors import (
    AdkError,
    CheckpointError,
    CheckpointTooLargeError,
    ConfigurationError,
    StateRedactedError,
)
from tesserix_adk.stores.urls import open_stores
from tesserix_adk.testing.faults import SimulatedCrash

pytestmark = pytest.mark.skipif(os.name != "posix", reason="needs POSIX signals")

T = "acme"
TOKEN = "tok-live-4242-real"  # a credential the run's state carries under a secret-named key

AGENT_MODULE = textwrap.dedent(
    '''
    """A trip agent whose state carries a credential and the bookings its tool made."""
    import asyncio
    import json
    import os
    import signal
    import sys

    import pydantic

    from tesserix_adk import (
        Agent, AgentRunner, LeasePolicy, ScriptedProvider, ToolContext, tool,
    )
    from tesserix_adk.errors import AdkError, ResumeConflictError
    from tesserix_adk.stores.urls import open_stores

    LOG = os.environ["STATE_LOG"]


    class Trip(pydantic.BaseModel):
        api_token: str = ""
        booked: list[str] = []


    def note(**fields):
        with open(LOG, "a", encoding="utf-8") as out:
            out.write(json.dumps({"pid": os.getpid(), **fields}) + "\\n")
            out.flush()
            os.fsync(out.fileno())


    @tool
    def book(flight: str, ctx: ToolContext) -> str:
        """Book a seat on a flight (fetches the run's API token the first time)."""
        note(tool="book", flight=flight, token=ctx.state.api_token,
             booked=list(ctx.state.booked))
        if not ctx.state.api_token and os.environ.get("STATE_TURNS") == "secret":
            ctx.state.api_token = os.environ["STATE_TOKEN"]
        ctx.state.booked.append(flight)
        return f"booked {flight}"


    @tool(side_effects=False)
    def settle(ctx: ToolContext) -> str:
        """Look at the bookings (the first process dies here)."""
        if os.environ.get("STATE_DIE") == "1":
            os.kill(os.getpid(), signal.SIGKILL)
        return "settled"


    agent = Agent("trip", "Book the trip.", [book, settle], state_schema=Trip)
    TURNS = [
        [("book", {"flight": "LH1"}), ("settle", {})],
        [("book", {"flight": "LH2"})],
        "done",
    ]
    # The token is in the state at a frontier before the death.
    SECRET_TURNS = [
        [("book", {"flight": "LH1"})],
        [("book", {"flight": "LH2"}), ("settle", {})],
        [("book", {"flight": "LH3"})],
        "done",
    ]


    async def main(phase, url, run_id):
        async with open_stores(url) as stores:
            turns = SECRET_TURNS if os.environ.get("STATE_TURNS") == "secret" else TURNS
            runner = AgentRunner.from_stores(
                ScriptedProvider(turns), stores,
                lease_policy=LeasePolicy(ttl=1.5, renew_within=0.5),
            )
            result = {}
            try:
                if phase == "run":
                    run = await runner.run(agent, "go", tenant="acme", run_id=run_id, state=Trip())
                else:
                    for _ in range(100):
                        try:
                            run = await runner.resume(agent, run_id, tenant="acme")
                            break
                        except ResumeConflictError:
                            await asyncio.sleep(0.2)
                result["status"] = str(run.status)
            except AdkError as exc:
                result["error"] = type(exc).__name__
                result["message"] = str(exc)
            cp = await runner.checkpoints.latest("acme", run_id)
            result["latest"] = None if cp is None else {
                "status": str(cp.status), "state": cp.state,
                "messages": [str(m.content) for m in await runner.checkpoints.messages(cp)],
            }
            print(json.dumps(result))


    if __name__ == "__main__":
        asyncio.run(main(*sys.argv[1:]))
    '''
)


def _process(tmp: Path, url: str, phase: str, run_id: str, *, die: bool, turns: str = "") -> Any:
    env = {
        **os.environ,
        "STATE_TURNS": turns,
        "STATE_LOG": str(tmp / "calls.jsonl"),
        "STATE_TOKEN": TOKEN,
        "STATE_DIE": "1" if die else "0",
        "PYTHONPATH": os.pathsep.join([str(tmp), os.environ.get("PYTHONPATH", "")]),
    }
    return subprocess.run(
        [sys.executable, str(tmp / "trip_agent.py"), phase, url, run_id],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _killed_then_resumed(
    tmp: Path, url: str, turns: str
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The trip run killed (SIGKILL) mid-turn in one process, resumed in another: every
    call the tools received, and what the resuming process reports."""
    (tmp / "trip_agent.py").write_text(AGENT_MODULE)
    run_id = f"trip-{uuid.uuid4().hex[:8]}"
    first = _process(tmp, url, "run", run_id, die=True, turns=turns)
    assert first.returncode == -9, (first.returncode, first.stderr[-2000:])
    second = _process(tmp, url, "resume", run_id, die=False, turns=turns)
    assert second.returncode == 0, second.stderr[-3000:]
    lines = (tmp / "calls.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines], json.loads(second.stdout.strip().splitlines()[-1])


def _scenario(
    backend: str, tmp_path: Path, turns: str = ""
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    with held_open(store_url(backend, tmp_path)) as url:

        async def apply() -> None:
            async with open_stores(url) as stores:
                await stores.create_schema()

        asyncio.run(apply())
        return _killed_then_resumed(tmp_path, url, turns)


# --- 1. real SIGKILL mid-turn: the completed call is never made twice (holds) -------------


@pytest.mark.parametrize(
    "backend",
    [
        pytest.param("sqlite", id="sqlite"),
        pytest.param("postgres", id="postgres", marks=pytest.mark.postgres),
    ],
)
def test_killed_after_a_stateful_call_the_resume_never_books_it_again(
    backend: str, tmp_path: Path
) -> None:
    calls, resumed = _scenario(backend, tmp_path)
    flights = [c["flight"] for c in calls if c["tool"] == "book"]
    assert flights == ["LH1", "LH2"], calls
    assert resumed.get("status") == "completed", resumed


# --- 2. state a tool changed before the crash: restored with its call's record (it was lost)


@pytest.mark.parametrize(
    "backend",
    [
        pytest.param("sqlite", id="sqlite"),
        pytest.param("postgres", id="postgres", marks=pytest.mark.postgres),
    ],
)
def test_the_resumed_state_keeps_what_a_completed_call_wrote_into_it(
    backend: str, tmp_path: Path
) -> None:
    calls, resumed = _scenario(backend, tmp_path)
    latest = resumed["latest"]
    assert any("booked LH1" in m for m in latest["messages"]), latest
    # The conversation says LH1 was booked (its recorded outcome was replayed), so the state
    # the run finished with must say so too; and the tool serving the next turn must have
    # been shown it.
    second = [c for c in calls if c["tool"] == "book" and c["flight"] == "LH2"]
    assert second and second[0]["booked"] == ["LH1"], calls
    assert latest["state"]["booked"] == ["LH1", "LH2"], latest


# --- 3. a secret in the state: masked in the store, so never handed to a tool as real ---


def test_a_run_never_starts_with_a_secret_in_its_state(tmp_path: Path) -> None:
    """Stored, the state would be masked, and a run carried on after a crash would hand its
    tools the mask: refused before anything is sent or kept, naming where, not what."""
    sent: list[str] = []

    class Trip(pydantic.BaseModel):
        api_token: str = ""

    @tool
    def book(ctx: ToolContext) -> str:
        """Book."""
        sent.append(ctx.state.api_token)
        return "ok"

    agent = Agent("trip", "Book.", [book], state_schema=Trip)

    async def go() -> None:
        async with fresh_stores("sqlite", tmp_path) as stores:
            runner = AgentRunner.from_stores(ScriptedProvider([[("book", {})], "done"]), stores)
            with pytest.raises(ConfigurationError) as refused:
                await runner.run(agent, "go", tenant=T, run_id="t", state=Trip(api_token=TOKEN))
            assert "api_token" in str(refused.value) and TOKEN not in str(refused.value)
            assert await runner.checkpoints.latest(T, "t") is None
            assert stores.work is not None and await stores.work.input(T, "t") is None

    asyncio.run(go())
    assert sent == []


@pytest.mark.redis
def test_a_resumed_tool_is_never_handed_a_masked_state_value_as_real(tmp_path: Path) -> None:
    """A tool put the credential into the state; the process died (SIGKILL) at a later turn.
    Every frontier since holds the mask, so the resume refuses, typed, and sends nothing."""
    calls, resumed = _scenario("redis", tmp_path, "secret")
    assert [c["flight"] for c in calls] == ["LH1", "LH2"], calls
    assert calls[1]["token"] == TOKEN  # the first process had the real one
    assert resumed.get("error") == "StateRedactedError", resumed
    assert TOKEN not in resumed["message"]
    assert "[redacted:" in json.dumps(resumed["latest"]["state"])


def test_the_secret_in_the_state_never_reaches_the_store(tmp_path: Path) -> None:
    calls, resumed = _scenario("sqlite", tmp_path, "secret")
    assert calls[1]["token"] == TOKEN  # the first process had the real one
    assert resumed.get("error") == "StateRedactedError", resumed
    raw = (tmp_path / "adk.sqlite3").read_bytes()
    wal = tmp_path / "adk.sqlite3-wal"
    if wal.exists():
        raw += wal.read_bytes()
    assert TOKEN.encode() not in raw
    assert "[redacted:" in json.dumps(resumed["latest"]["state"])


# --- 4. a pydantic SecretStr field in the state schema -------------------------------------


class Vault(pydantic.BaseModel):
    pin: pydantic.SecretStr | None = None
    step: int = 0


async def test_a_secretstr_in_the_state_is_never_resumed_as_its_mask(tmp_path: Path) -> None:
    """pydantic writes a ``SecretStr`` as ``'**********'``: a run does not start with one in
    its state, and one a tool put there mid-run stops the resume, typed, so the tool is
    never handed ``SecretStr('**********')`` as the password."""
    seen: list[str] = []

    @tool
    def login(ctx: ToolContext) -> str:
        """Log in with the run's password (fetched the first time)."""
        if ctx.state.pin is None:
            ctx.state.pin = pydantic.SecretStr("pw-Real-123")
        seen.append(ctx.state.pin.get_secret_value())
        ctx.state.step += 1
        return "in"

    agent = Agent("vault", "Log in twice.", [login], state_schema=Vault)
    turns = [[("login", {})], [("login", {})], "done"]
    async with fresh_stores("sqlite", tmp_path) as stores:
        with pytest.raises(ConfigurationError) as refused:
            await AgentRunner.from_stores(ScriptedProvider(turns), stores).run(
                agent, "go", tenant=T, run_id="v0", state=Vault(pin="pw-Real-123")
            )
        assert "pin" in str(refused.value) and seen == []
        runner = faulty_runner(
            stores, ScriptedProvider(turns), crash_before=at("after_tool_result", 1)
        )
        with pytest.raises(SimulatedCrash):
            await runner.run(agent, "go", tenant=T, run_id="v", state=Vault())
        assert seen == ["pw-Real-123", "pw-Real-123"]
        again = AgentRunner.from_stores(ScriptedProvider(turns), stores)
        with pytest.raises(StateRedactedError) as stopped:
            await again.resume(agent, "v", tenant=T)
        assert stopped.value.retryable is False
        latest = await again.checkpoints.latest(T, "v")
        assert latest is not None and latest.state_redacted
    assert seen == ["pw-Real-123", "pw-Real-123"]


# --- 5. a state a tool made invalid: the caller is told "completed", the store "running" --


class Counter(pydantic.BaseModel):
    n: int = 0


async def test_a_run_whose_state_went_invalid_is_not_reported_completed_while_stored_running(
    tmp_path: Path,
) -> None:
    @tool(side_effects=False)
    def spoil(ctx: ToolContext) -> str:
        """Leave the state invalid (pydantic does not validate assignment by default)."""
        ctx.state.n = "not a number"
        return "ok"

    agent = Agent("spoil", "Spoil it.", [spoil], state_schema=Counter)
    async with fresh_stores("sqlite", tmp_path) as stores:
        runner = AgentRunner.from_stores(ScriptedProvider([[("spoil", {})], "done"]), stores)
        try:
            run = await runner.run(agent, "go", tenant=T, run_id="s", state=Counter())
        except CheckpointError:
            return  # refused, typed: an honest answer
        latest = await runner.checkpoints.latest(T, "s")
    shown = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "tesserix_adk", "show", "s", "--tenant", T, "--json"],
        env={**os.environ, "ADK_STORE": f"sqlite:///{tmp_path / 'adk.sqlite3'}"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert str(run.status) == "completed"
    assert json.loads(shown.stdout)["status"] == "completed", shown.stdout
    assert latest is not None and str(latest.status) == "completed", latest


# --- 6. a state that cannot be written as JSON, given at the start ------------------------


async def test_a_state_that_cannot_be_written_is_refused_before_any_call_is_sent(
    tmp_path: Path,
) -> None:
    sent: list[str] = []

    @tool
    def charge(amount: int) -> str:
        """Charge the card."""
        sent.append(f"charge {amount}")
        return "charged"

    agent = Agent("pay", "Charge.", [charge])
    async with fresh_stores("sqlite", tmp_path) as stores:
        runner = AgentRunner.from_stores(
            ScriptedProvider([[("charge", {"amount": 5})], "done"]), stores
        )
        try:
            await runner.run(agent, "go", tenant=T, run_id="p", state={"conn": object()})
        except AdkError:
            assert sent == []  # refused, typed, before anything was sent
            return
        latest = await runner.checkpoints.latest(T, "p")
    assert latest is not None, f"sent {sent} with no frontier ever written"


# --- 7. a schema changed between processes ------------------------------------------------


class TicketV1(pydantic.BaseModel):
    ticket: int


class TicketV2(pydantic.BaseModel):
    ticket: int
    queue: str  # new and required: the stored state lacks it


async def test_a_changed_incompatible_schema_is_refused_typed_and_the_run_stays_resumable(
    tmp_path: Path,
) -> None:
    sent: list[int] = []

    @tool
    def escalate(ctx: ToolContext) -> str:
        """Escalate the ticket."""
        sent.append(ctx.state.ticket)
        return "escalated"

    turns = [[("escalate", {})], [("escalate", {})], "done"]
    v1 = Agent("desk", "Escalate.", [escalate], state_schema=TicketV1)
    v2 = Agent("desk", "Escalate.", [escalate], state_schema=TicketV2)
    async with fresh_stores("sqlite", tmp_path) as stores:
        runner = faulty_runner(
            stores, ScriptedProvider(turns), crash_before=at("after_tool_result", 1)
        )
        with pytest.raises(SimulatedCrash):
            await runner.run(v1, "go", tenant=T, run_id="d", state=TicketV1(ticket=7))
        assert sent == [7, 7]
        with pytest.raises(CheckpointError) as refused:
            await AgentRunner.from_stores(ScriptedProvider(turns), stores).resume(v2, "d", tenant=T)
        assert refused.value.retryable is False
        assert sent == [7, 7]  # nothing dispatched under the new schema
        # The refusal left no claim behind: the old code carries the run on at once.
        run = await AgentRunner.from_stores(ScriptedProvider(turns), stores).resume(
            v1, "d", tenant=T
        )
    assert str(run.status) == "completed"
    assert sent == [7, 7]


# --- 8. in-place mutation after a frontier: no aliasing into what was checkpointed --------


class Notes(pydantic.BaseModel):
    lines: list[str] = []
    meta: dict[str, list[int]] = {}


async def test_a_tool_mutating_the_state_in_place_never_rewrites_an_earlier_step(
    tmp_path: Path,
) -> None:
    @tool(side_effects=False)
    def scribble(word: str, ctx: ToolContext) -> str:
        """Append in place."""
        ctx.state.lines.append(word)
        ctx.state.meta.setdefault("k", []).append(len(word))
        return "ok"

    agent = Agent("notes", "Write.", [scribble], state_schema=Notes, max_iterations=5)
    turns = [[("scribble", {"word": "a"})], [("scribble", {"word": "bb"})], "done"]
    live = Notes()
    async with fresh_stores("memory", tmp_path) as stores:
        runner = AgentRunner.from_stores(ScriptedProvider(turns), stores)
        run = await runner.run(agent, "go", tenant=T, run_id="n", state=live)
        states = []
        for step in range(1, 6):
            cp = await runner.checkpoints.at(T, "n", step)
            states.append(None if cp is None else cp.state)
    assert str(run.status) == "completed"
    assert states[0] == {"lines": [], "meta": {}}
    assert states[1] == {"lines": ["a"], "meta": {"k": [1]}}
    assert states[-1] == {"lines": ["a", "bb"], "meta": {"k": [1, 2]}}
    assert live.lines == ["a", "bb"]  # the caller's object is the live one


# --- 9. parallel calls sharing the state ----------------------------------------------------


async def test_parallel_calls_each_leave_their_change_in_the_turns_frontier(
    tmp_path: Path,
) -> None:
    @tool(side_effects=False)
    async def mark(tag: str, ctx: ToolContext) -> str:
        """Mark a tag."""
        ctx.state.lines.append(tag)
        return tag

    agent = Agent("par", "Mark.", [mark], state_schema=Notes, parallel_tool_calls=3)
    turns = [[("mark", {"tag": "x"}), ("mark", {"tag": "y"}), ("mark", {"tag": "z"})], "done"]
    async with fresh_stores("sqlite", tmp_path) as stores:
        runner = AgentRunner.from_stores(ScriptedProvider(turns), stores)
        await runner.run(agent, "go", tenant=T, run_id="par", state=Notes())
        latest = await runner.checkpoints.latest(T, "par")
    assert latest is not None and sorted(latest.state["lines"]) == ["x", "y", "z"]


# --- 10. a state near the record cap ------------------------------------------------------


class Big(pydantic.BaseModel):
    blob: str


async def test_a_state_over_the_cap_leaves_a_tombstone_a_resume_refuses(tmp_path: Path) -> None:
    @tool(side_effects=False)
    def grow(ctx: ToolContext) -> str:
        """Grow the state past the cap."""
        ctx.state.blob = "x" * 300_000
        return "grown"

    agent = Agent("big", "Grow.", [grow], state_schema=Big)
    turns = [[("grow", {})], [("grow", {})], "done"]
    async with fresh_stores("sqlite", tmp_path) as stores:
        runner = faulty_runner(
            stores,
            ScriptedProvider(turns),
            crash_before=lambda body: body.get("step") == 3,
            max_bytes=200_000,
        )
        with pytest.raises(SimulatedCrash):
            await runner.run(agent, "go", tenant=T, run_id="b", state=Big(blob="small"))
        latest = await runner.checkpoints.latest(T, "b")
        assert latest is not None and str(latest.status) == "tombstone"
        with pytest.raises(CheckpointTooLargeError) as refused:
            await AgentRunner.from_stores(ScriptedProvider(turns), stores).resume(
                agent, "b", tenant=T
            )
    assert refused.value.retryable is False
