"""An attack on this stop's later fixes (94cf0f5..HEAD), each attacked again.

1. Tombstoned runs told from their last frontier written whole (``last_written_whole``,
   ``tesserix show``, the console): damaged or missing snapshots before the tombstone,
   ``show --step`` of a tombstone step, ``--json``.
2. An approval whose ``before_approval`` frontier is too large (``_refuse_too_large``): two
   calls needing approval in one turn, a resume afterwards, ``tesserix approve`` afterwards.
3. Submissions (``AgentRunner._submitted``/``_submission``): a worker starting a submitted
   run whose input or state the kit reshapes (a call id holding a secret, a pydantic state
   schema, a dataclass state, secrets in the input).
4. Cancel reasons near the limits, in characters that are not one byte.

Real SQLite files; a crash before the first frontier is ``SimulatedCrash`` raised by the
model (the process is gone right there, nothing of its memory carried on).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import sqlite3
import threading
from pathlib import Path
from typing import Any

import pydantic
import pytest

from booking import Airline, booking_agent
from run.helpers import Recording, answers, at, faulty_runner, fresh_stores
from tesserix_adk import (
    Agent,
    AgentRunner,
    CheckpointTooLargeError,
    LeasePolicy,
    Message,
    Role,
    RunStatus,
    ScriptedProvider,
    ToolCall,
    ToolContext,
    Worker,
    WorkState,
    tool,
)
from tesserix_adk.checkpoint.checkpointer import Checkpointer
from tesserix_adk.cli import ExitCode
from tesserix_adk.console.reads import run_detail
from tesserix_adk.errors import AdkError, CheckpointCorruptError, ConfigurationError
from tesserix_adk.run.approvals import KIT_DECIDER
from tesserix_adk.run.cancelling import BY_CHARS, REASON_MAX_CHARS, cancel_requested
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.testing.faults import SimulatedCrash
from test_attacks_morning_fixes import _DiesFirst, _Recording, _user_texts
from test_attacks_readme_newcomer import Desk as CarriedDesk
from test_attacks_revision_sweep import _entry, _lapsed
from test_attacks_size_limits import Desk, _cli, _opened, _tombstoned
from test_attacks_size_limits import T as SIZE_T

T = "later-fixes"
SECRET = "sk-proj-" + "Q1w2E3r4T5y6U7i8O9p0A1s2D3f4G5h6J7k8L9z0"
BOOK = [("book_seat", {"flight": "LH123"})]


def _url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'adk.sqlite3'}"


def _file_bytes(directory: Path) -> bytes:
    """Every byte of the SQLite store as it lies on disk (its WAL and journal too)."""
    return b"".join(p.read_bytes() for p in directory.glob("adk.sqlite3*"))


def _fast(stores: Stores, provider: Any, **kwargs: Any) -> AgentRunner:
    return AgentRunner.from_stores(
        provider, stores, lease_policy=LeasePolicy(ttl=0.6, renew_within=0.3), **kwargs
    )


def _worker(stores: Stores, provider: Any, agent: Any) -> Worker:
    return Worker(_fast(stores, provider), [agent], exit_when_idle=True, poll_interval=0.01)


def _earlier_turn(call_id: str) -> list[Message]:
    """A conversation carried over from elsewhere: the user, one search the model asked for
    under ``call_id``, and its result."""
    return [
        Message(role=Role.user, content="book me FRA to JFK"),
        Message(
            role=Role.assistant,
            tool_calls=(ToolCall(id=call_id, name="search_flights", arguments={"origin": "FRA"}),),
        ),
        Message(role=Role.tool, content='["LH123"]', tool_call_id=call_id),
    ]


# The next turn is chosen by counting assistant messages: the input holds one already.
AFTER_EARLIER = ["(never asked)", BOOK, "Booked LH123."]

ODD_IDS = [
    pytest.param(f"call_{SECRET}", id="secret-in-id"),
    pytest.param("call_masked_0123456789abcdef01234567", id="looks-masked"),
]


# --- 3. submissions a worker must start ----------------------------------------------------


@pytest.mark.parametrize("call_id", ODD_IDS)
async def test_a_worker_starts_a_submitted_run_whose_input_has_a_replaced_call_id(
    call_id: str, tmp_path: Path
) -> None:
    async with fresh_stores("sqlite", tmp_path) as stores:
        airline = Airline()
        agent = booking_agent(airline)
        await _fast(stores, ScriptedProvider(["x"])).submit(
            agent, _earlier_turn(call_id), tenant=T, run_id="carried-over"
        )
        worker = _worker(stores, ScriptedProvider(list(AFTER_EARLIER)), agent)
        await asyncio.wait_for(worker.run(), 30)
        item = await _entry(stores, "carried-over", tenant=T)
        assert item.state is WorkState.done, item
        latest = await Checkpointer.from_stores(stores).latest(T, "carried-over")
        assert latest is not None and latest.status == "completed"
        assert airline.bookings == ["LH123"]


async def test_a_run_dead_before_its_first_frontier_with_a_secret_call_id_is_started_by_a_worker(
    tmp_path: Path,
) -> None:
    async with fresh_stores("sqlite", tmp_path) as stores:
        airline = Airline()
        agent = booking_agent(airline)
        with pytest.raises(SimulatedCrash):
            await _fast(stores, _DiesFirst()).run(
                agent, _earlier_turn(f"call_{SECRET}"), tenant=T, run_id="dead-early"
            )
        await _lapsed(stores, "dead-early", tenant=T)
        worker = _worker(stores, ScriptedProvider(list(AFTER_EARLIER)), agent)
        await asyncio.wait_for(worker.run(), 30)
        item = await _entry(stores, "dead-early", tenant=T)
        assert item.state is WorkState.done, item
        assert airline.bookings == ["LH123"]


async def test_the_users_own_retry_of_a_run_with_a_secret_call_id_is_not_another_input(
    tmp_path: Path,
) -> None:
    async with fresh_stores("sqlite", tmp_path) as stores:
        airline = Airline()
        agent = booking_agent(airline)
        await _fast(stores, ScriptedProvider(["x"])).submit(
            agent, _earlier_turn(f"call_{SECRET}"), tenant=T, run_id="retry"
        )
        run = await _fast(stores, ScriptedProvider(list(AFTER_EARLIER))).run(
            agent, _earlier_turn(f"call_{SECRET}"), tenant=T, run_id="retry"
        )
        assert run.status is RunStatus.completed
        assert airline.bookings == ["LH123"]


class Trip(pydantic.BaseModel):
    origin: str
    seats: int = 1
    tags: list[str] = pydantic.Field(default_factory=list)
    note: str = ""


@dataclasses.dataclass
class Basket:
    items: tuple[str, ...]
    total: float


# No secret in them: a state that holds one is refused at submit (it could only be
# started, or resumed, with the mask; tests/run/test_attacks_run_state.py).
STATES = [
    pytest.param({"state_schema": Trip}, Trip(origin="FRA", note="aisle"), id="pydantic-schema"),
    pytest.param({}, Basket(items=("a", "b"), total=1.5), id="dataclass"),
    pytest.param({}, {"seen": {3, 1, 2}, "password": 4}, id="set-and-number-under-secret-key"),
]


@pytest.mark.parametrize(("agent_kwargs", "state"), STATES)
async def test_a_worker_starts_a_submitted_run_whose_state_the_kit_reshapes(
    agent_kwargs: dict[str, Any], state: Any, tmp_path: Path
) -> None:
    async with fresh_stores("sqlite", tmp_path) as stores:
        airline = Airline()
        agent = booking_agent(airline, **agent_kwargs)
        await _fast(stores, ScriptedProvider(["x"])).submit(
            agent, f"book LH123, my key is {SECRET}", tenant=T, run_id="stateful", state=state
        )
        seen = _Recording([BOOK, "Booked LH123."])
        worker = _worker(stores, seen, agent)
        await asyncio.wait_for(worker.run(), 30)
        assert worker.carried and worker.carried[-1][1].value == "finished", worker.carried
        item = await _entry(stores, "stateful", tenant=T)
        assert item.state is WorkState.done, item
        assert airline.bookings == ["LH123"]
        assert SECRET not in _user_texts(seen.requests[0])[0]
    raw = _file_bytes(tmp_path)
    assert SECRET[8:30].encode() not in raw


async def test_a_worker_started_run_gives_its_tools_the_schemas_state_not_its_json(
    tmp_path: Path,
) -> None:
    """A submission keeps the state as JSON; a worker starting it handed that dict to the
    run, so a tool reading ``ctx.state.origin`` failed (and, warnings as errors, no frontier
    could hold it). It is the schema's model now, as a resume restores it."""
    seen: list[Any] = []

    @tool(side_effects=False)
    def where(ctx: ToolContext) -> str:
        """Where the trip starts."""
        seen.append(ctx.state)
        return ctx.state.origin  # type: ignore[no-any-return]

    agent = Agent("trips", "Say where.", [where], state_schema=Trip)
    async with fresh_stores("sqlite", tmp_path) as stores:
        await _fast(stores, ScriptedProvider(["x"])).submit(
            agent, "where from?", tenant=T, run_id="trip", state=Trip(origin="FRA")
        )
        worker = _worker(stores, ScriptedProvider([[("where", {})], "FRA."]), agent)
        await asyncio.wait_for(worker.run(), 30)
        assert worker.carried[-1][1].value == "finished", worker.carried
        latest = await Checkpointer.from_stores(stores).latest(T, "trip")
    assert [type(s) for s in seen] == [Trip]
    assert latest is not None and latest.status.value == "completed"


# --- 4. cancel reasons near the limits -----------------------------------------------------

# A reason within REASON_MAX_CHARS whose JSON is over the 1 MiB record cap: astral
# characters with one lone surrogate (argv's surrogateescape gives one for a non-UTF-8
# byte), which sends the whole record to \u escapes (12 bytes for each astral character).
WIDE_REASON = "\U0001f600" * (REASON_MAX_CHARS - 1) + "\udcff"


async def _waiting(stores: Stores, desk: Desk) -> AgentRunner:
    turns: list[Any] = [[("post_entry", {"memo": "m"})], "Posted."]
    runner = AgentRunner.from_stores(ScriptedProvider(turns), stores)
    run = await runner.run(desk.agent(approval=True), "post", tenant=T, run_id="r")
    assert run.status is RunStatus.waiting_approval
    return runner


async def test_a_cancel_reason_of_wide_characters_within_the_limit_is_kept_readable(
    tmp_path: Path,
) -> None:
    url = _url(tmp_path)
    desk = Desk()
    async with _opened(url) as stores:
        runner = await _waiting(stores, desk)
        try:
            ended = await runner.cancel("r", tenant=T, by="ops", reason=WIDE_REASON)
        except ConfigurationError:
            # Refused, typed, nothing recorded: the run still waits.
            assert await cancel_requested(stores.idempotency, T, "r") is None
            return
        assert ended is not None and ended.status is RunStatus.cancelled
        request = await cancel_requested(stores.idempotency, T, "r")
        assert request is not None and request.by == "ops"
    code, _out, err = await _cli(url, "show", "r", "--tenant", T)
    assert code == ExitCode.CARRIED_ON, err
    assert desk.sent == []


async def test_a_wide_cancel_reason_asked_while_the_run_is_carried_ends_it_cancelled(
    tmp_path: Path,
) -> None:
    url = _url(tmp_path)
    refused: list[BaseException] = []

    async def cancel_from_another_process() -> None:
        async with _opened(url) as stores:
            other = AgentRunner.from_stores(ScriptedProvider(["x"]), stores)
            try:
                await other.cancel("r", tenant=T, by="ops", reason=WIDE_REASON)
            except ConfigurationError as exc:  # refused, nothing recorded: fine too
                refused.append(exc)

    def during() -> None:
        assert threading.current_thread() is not threading.main_thread()
        asyncio.run(cancel_from_another_process())

    desk = CarriedDesk()
    turns: list[Any] = [[("post_entry", {"memo": "a"})], [("post_entry", {"memo": "b"})], "Done."]
    async with _opened(url) as stores:
        runner = AgentRunner.from_stores(ScriptedProvider(turns), stores)
        try:
            run = await runner.run(desk.agent(during=during), "post", tenant=T, run_id="r")
        except CheckpointCorruptError as exc:
            pytest.fail(f"the run was stopped as corrupt by its own cancel: {exc}")
        expected = RunStatus.completed if refused else RunStatus.cancelled
        assert run.status is expected
    assert desk.sent == ["a"] if not refused else desk.sent == ["a", "b"]


async def test_a_cancel_reason_of_astral_characters_at_the_limit_is_kept_and_read_back(
    tmp_path: Path,
) -> None:
    url = _url(tmp_path)
    desk = Desk()
    reason = "\U0001f600" * REASON_MAX_CHARS
    async with _opened(url) as stores:
        runner = await _waiting(stores, desk)
        with pytest.raises(ConfigurationError):
            await runner.cancel("r", tenant=T, by="ops", reason=reason + "x")
        assert await cancel_requested(stores.idempotency, T, "r") is None
        ended = await runner.cancel("r", tenant=T, by="\u00e9" * BY_CHARS, reason=reason)
        assert ended is not None and ended.status is RunStatus.cancelled
        request = await cancel_requested(stores.idempotency, T, "r")
        assert request is not None and request.reason == reason
        latest = await runner.checkpoints.latest(T, "r")  # type: ignore[union-attr]
        assert latest is not None and latest.status == "cancelled" and not latest.is_tombstone
    code, _out, err = await _cli(url, "show", "r", "--tenant", T)
    assert code == ExitCode.CARRIED_ON, err
    assert desk.sent == []


# --- 1. tombstoned runs told from the last frontier written whole --------------------------


async def test_show_step_of_a_tombstone_step_and_json_tell_the_last_whole_steps_conversation(
    tmp_path: Path,
) -> None:
    url = _url(tmp_path)
    await _tombstoned(url, Desk())
    code, out, err = await _cli(url, "show", "r", "--tenant", SIZE_T, "--step", "4", "--json")
    assert code == ExitCode.CARRIED_ON, err
    told = json.loads(out)
    assert told["status"] == "tombstone"
    assert any("step 4 is a tombstone" in n and "step 3's" in n for n in told["not_kept"])
    asked = [t for t in told["turns"] if "post_entry" in json.dumps(t)]
    assert asked, told["turns"]


async def test_show_and_console_of_a_tombstoned_run_whose_earlier_steps_are_gone_say_so(
    tmp_path: Path,
) -> None:
    url = _url(tmp_path)
    await _tombstoned(url, Desk())
    path = url.removeprefix("sqlite:///")
    with contextlib.closing(sqlite3.connect(path)) as db:
        db.execute("DELETE FROM adk_checkpoint_steps WHERE run_id = 'r' AND step <= 3")
        db.commit()
    code, out, err = await _cli(url, "show", "r", "--tenant", SIZE_T)
    assert code == ExitCode.CARRIED_ON, err
    assert "no step before it was written whole" in out
    async with _opened(url) as stores:
        detail = await run_detail(stores, SIZE_T, "r")
    assert detail is not None and detail.checkpoint.is_tombstone
    assert detail.transcript_problem is None


async def test_show_of_a_tombstoned_run_with_a_damaged_step_before_it_still_tells_the_story(
    tmp_path: Path,
) -> None:
    url = _url(tmp_path)
    await _tombstoned(url, Desk())
    path = url.removeprefix("sqlite:///")
    with contextlib.closing(sqlite3.connect(path)) as db:
        (payload,) = db.execute(
            "SELECT payload FROM adk_checkpoint_steps WHERE run_id = 'r' AND step = 3"
        ).fetchone()
        damaged = bytearray(payload)
        damaged[len(damaged) // 2] ^= 1
        db.execute(
            "UPDATE adk_checkpoint_steps SET payload = ? WHERE run_id = 'r' AND step = 3",
            (bytes(damaged),),
        )
        db.commit()
    code, out, err = await _cli(url, "show", "r", "--tenant", SIZE_T)
    assert code == ExitCode.CARRIED_ON, err
    assert "step 3 cannot be read" in out and "tombstone" in out


# --- 2. approvals whose frontier is too large -----------------------------------------------


async def test_two_calls_needing_approval_with_a_too_large_frontier_send_nothing_and_stay_refused(
    tmp_path: Path,
) -> None:
    desk = Desk()
    url = _url(tmp_path)
    big = "m" * 30_000
    turns: list[Any] = [
        [("post_entry", {"memo": "small"}), ("post_entry", {"memo": big})],
        "Posted.",
    ]
    agent = desk.agent(approval=True)
    async with _opened(url) as stores:
        runner = AgentRunner.from_stores(ScriptedProvider(turns), stores, max_bytes=20_000)
        with pytest.raises(CheckpointTooLargeError) as stopped:
            await runner.run(agent, "post", tenant=T, run_id="r")
        assert stopped.value.retryable is False
        with contextlib.closing(sqlite3.connect(url.removeprefix("sqlite:///"))) as db:
            [(request_id,)] = db.execute("SELECT id FROM adk_approvals").fetchall()
        asked = await stores.approvals.get(T, request_id)
        assert asked is not None and asked.status.value == "denied" and asked.by == KIT_DECIDER
        assert len(asked.calls) == 2
        again = AgentRunner.from_stores(ScriptedProvider(turns), stores, max_bytes=20_000)
        with pytest.raises(AdkError) as refused:
            await again.resume(agent, "r", tenant=T)
        assert refused.value.retryable is False
    code, _out, err = await _cli(url, "approve", request_id, "--tenant", T, "--by", "ops")
    assert code == ExitCode.MUST_NOT_CARRY_ON, err
    assert desk.sent == []


# --- 5. odd results: the same text live and replayed ---------------------------------------


async def test_an_odd_result_is_told_alike_live_and_replayed_after_a_crash_and_kept_masked(
    tmp_path: Path,
) -> None:
    sent: list[str] = []

    @tool
    def fetch_pages(leg: str) -> Any:
        """Fetch a leg's pages (a side effect)."""
        sent.append(leg)
        return {("leg", b"\xff\x00"): frozenset({"b", "a"}), "key": f"auth {SECRET}"}

    agent = Agent("pages", "Fetch pages.", [fetch_pages])
    turns: list[Any] = [[("fetch_pages", {"leg": "FRA"})], "Fetched."]

    async def told(run_id: str, *, crash: bool) -> str:
        async with fresh_stores("sqlite", tmp_path) as stores:
            if crash:
                dying = faulty_runner(
                    stores, ScriptedProvider(turns), crash_before=at("after_tool_result", 0)
                )
                with pytest.raises(SimulatedCrash):
                    await dying.run(agent, "fetch", tenant=T, run_id=run_id)
                model = Recording(ScriptedProvider(turns))
                run = await AgentRunner.from_stores(model, stores).resume(agent, run_id, tenant=T)
            else:
                model = Recording(ScriptedProvider(turns))
                run = await AgentRunner.from_stores(model, stores).run(
                    agent, "fetch", tenant=T, run_id=run_id
                )
            assert run.status is RunStatus.completed
            [answer] = answers(model.requests[-1], "fetch_pages")
            assert not answer.is_error, answer.text
            return answer.text

    live = await told("live", crash=False)
    replayed = await told("crashed", crash=True)
    assert sent == ["FRA", "FRA"]  # once per run: the crashed run's call was not made again
    # The same text, the secret masked in what was kept (the live model had it already).
    assert replayed == live.replace(SECRET, "[redacted:openai_key]")
    raw = _file_bytes(tmp_path)
    assert SECRET[8:30].encode() not in raw
