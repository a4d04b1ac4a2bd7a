"""Attacks on size limits, end to end: "Refuse, never truncate" and "a checkpoint failure
never fails the live run".

Real SQLite files (and the test Redis/PostgreSQL where a backend's own limit matters); the
stand-in for a crash is ``SimulatedCrash`` (a ``BaseException``) raised by
``FaultyCheckpointStore`` before a chosen frontier, which stops the attempt exactly where a
SIGKILL would, with nothing of the dead attempt's memory carried on.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import re
import sqlite3
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from run.helpers import Recording, answers, at, faulty_runner, fresh_stores
from tesserix_adk import (
    Agent,
    AgentRunner,
    CheckpointTooLargeError,
    HistoryUnavailableError,
    RunStatus,
    ScriptedProvider,
    tool,
)
from tesserix_adk.cli import ExitCode, frontier_main
from tesserix_adk.run.approvals import KIT_DECIDER
from tesserix_adk.stores import open_stores
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.testing.faults import SimulatedCrash

T = "size-attacks"


def _url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'adk.sqlite3'}"


@contextlib.asynccontextmanager
async def _opened(url: str) -> AsyncIterator[Stores]:
    async with open_stores(url) as stores:
        await stores.create_schema()
        yield stores


async def _cli(url: str, *argv: str) -> tuple[int, str, str]:
    """``tesserix <argv>`` in-process against ``url`` (its own stores, its own loop)."""

    def run() -> tuple[int, str, str]:
        out, err = io.StringIO(), io.StringIO()
        code = frontier_main(list(argv), stores=open_stores(url), out=out, err=err)
        return code, out.getvalue(), err.getvalue()

    return await asyncio.to_thread(run)


def _blobs(url: str) -> list[bytes]:
    """Every text or blob value in every table of the SQLite file."""
    path = url.removeprefix("sqlite:///")
    found: list[bytes] = []
    with contextlib.closing(sqlite3.connect(path)) as db:
        tables = [r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")]
        for table in tables:
            for row in db.execute(f'SELECT * FROM "{table}"'):
                for value in row:
                    if isinstance(value, bytes):
                        found.append(value)
                    elif isinstance(value, str):
                        found.append(value.encode("utf-8", "surrogatepass"))
    return found


class Desk:
    """A world with a report service (read-only, returns ``size`` bytes of text) and a
    ledger that counts each side effect."""

    def __init__(self) -> None:
        self.sent: list[str] = []
        self.reports = 0

    def agent(self, *, approval: bool = False) -> Agent:
        desk = self

        @tool(side_effects=False)
        def fetch_report(size: int, fill: str = "R") -> str:
            """Fetch a report of ``size`` characters."""
            desk.reports += 1
            return fill * size

        @tool(requires_approval=approval)
        def post_entry(memo: str) -> str:
            """Post one ledger entry (a side effect)."""
            desk.sent.append(memo)
            return f"posted #{len(desk.sent)}"

        @tool
        def big_post(size: int) -> str:
            """Post an entry whose receipt is ``size`` characters long (a side effect)."""
            desk.sent.append(f"big{size}")
            return "Q" * size

        return Agent("desk", "Do the books.", [fetch_report, post_entry, big_post])


class DiesAtTurn:
    """A model that "dies" (``SimulatedCrash``) when asked for turn ``turn`` (0-based):
    the process holding the run is gone right there."""

    def __init__(self, inner: Any, turn: int) -> None:
        self.inner = inner
        self.turn = turn

    async def complete(self, request: Any) -> Any:
        asked = sum(1 for m in request.messages if m.role == "assistant")
        if asked == self.turn:
            raise SimulatedCrash(f"died asking for turn {asked}")
        return await self.inner.complete(request)


# --- a frontier over max_bytes, then a crash ------------------------------------------------


async def test_a_run_that_goes_on_past_a_refused_frontier_then_crashes_is_refused_and_sends_nothing(
    tmp_path: Path,
) -> None:
    """A big report makes every later frontier too large; the run goes on live and posts
    once; it dies before its final frontier. The resume refuses, typed and final, and
    nothing is posted again."""
    desk = Desk()
    turns: list[Any] = [
        [("fetch_report", {"size": 30_000})],
        [("post_entry", {"memo": "pay rent"})],
        "Paid.",
    ]
    async with _opened(_url(tmp_path)) as stores:
        runner = AgentRunner.from_stores(
            DiesAtTurn(ScriptedProvider(turns), 2), stores, max_bytes=20_000
        )
        with pytest.raises(SimulatedCrash):
            await runner.run(desk.agent(), "pay", tenant=T, run_id="r")
        assert desk.sent == ["pay rent"]
        assert isinstance(runner.checkpoints.last_error, CheckpointTooLargeError)  # type: ignore[union-attr]
        again = AgentRunner.from_stores(ScriptedProvider(turns), stores, max_bytes=20_000)
        with pytest.raises(CheckpointTooLargeError) as refused:
            await again.resume(desk.agent(), "r", tenant=T)
        assert refused.value.retryable is False
    assert desk.sent == ["pay rent"]
    # The report is kept whole in its call's record (under that record's own 1 MiB cap),
    # and nowhere cut: every run of it anywhere is all 30,000 characters.
    whole = 0
    for blob in _blobs(_url(tmp_path)):
        for run in re.findall(rb"R{100,}", blob):
            assert len(run) == 30_000
            whole += 1
    assert whole == 1


async def _tombstoned(url: str, desk: Desk) -> None:
    """Run ``r`` to the end: a small post, then a report too large for any frontier (a
    good frontier at steps 1-3, tombstones from step 4 on)."""
    turns: list[Any] = [
        [("post_entry", {"memo": "small"})],
        [("fetch_report", {"size": 30_000})],
        "Done.",
    ]
    async with _opened(url) as stores:
        runner = AgentRunner.from_stores(ScriptedProvider(turns), stores, max_bytes=20_000)
        run = await runner.run(desk.agent(), "go", tenant=T, run_id="r")
        assert run.status is RunStatus.completed


async def test_inspect_and_runs_say_the_latest_frontier_is_a_tombstone(tmp_path: Path) -> None:
    url = _url(tmp_path)
    await _tombstoned(url, Desk())
    code, out, err = await _cli(url, "inspect", "r", "--tenant", T)
    assert code == ExitCode.CARRIED_ON, err
    assert "tombstone at step 5" in out and "over max_bytes=20000" in out
    code, out, err = await _cli(url, "runs", "--tenant", T)
    assert code == ExitCode.CARRIED_ON, err
    assert "tombstone at step 5" in out


async def test_show_tells_the_story_of_a_run_whose_frontier_was_refused(tmp_path: Path) -> None:
    url = _url(tmp_path)
    await _tombstoned(url, Desk())
    code, out, err = await _cli(url, "show", "r", "--tenant", T)
    assert code == ExitCode.CARRIED_ON, err
    assert "tombstone" in out


async def test_show_of_a_step_written_before_the_tombstone_is_readable(tmp_path: Path) -> None:
    url = _url(tmp_path)
    await _tombstoned(url, Desk())
    code, out, err = await _cli(url, "steps", "r", "--tenant", T)
    assert code == ExitCode.CARRIED_ON, err
    code, out, err = await _cli(url, "show", "r", "--tenant", T, "--step", "3")
    assert code == ExitCode.CARRIED_ON, err
    assert "post_entry" in out


async def test_the_console_does_not_call_a_tombstone_a_damaged_transcript(
    tmp_path: Path,
) -> None:
    from tesserix_adk.console.reads import run_detail

    url = _url(tmp_path)
    await _tombstoned(url, Desk())
    async with _opened(url) as stores:
        detail = await run_detail(stores, T, "r")
    assert detail is not None and detail.checkpoint.is_tombstone
    assert detail.transcript_problem is None, detail.transcript_problem


async def test_replay_from_a_step_before_the_tombstone_sends_nothing(tmp_path: Path) -> None:
    url = _url(tmp_path)
    desk = Desk()
    await _tombstoned(url, desk)
    assert desk.sent == ["small"]
    stubbed: list[str] = []
    turns: list[Any] = [
        [("post_entry", {"memo": "small"})],
        [("fetch_report", {"size": 10})],
        "Done.",
    ]
    async with _opened(url) as stores:
        runner = AgentRunner.from_stores(ScriptedProvider(turns), stores, max_bytes=20_000)
        try:
            run = await runner.replay(
                desk.agent(),
                "r",
                tenant=T,
                from_step=1,
                stubs={
                    "post_entry": lambda memo: stubbed.append(memo) or "stub",
                    "big_post": lambda size: "stub",
                },
                new_run_id="r-replay",
            )
        except CheckpointTooLargeError as exc:  # refused, typed: acceptable
            assert exc.retryable is False
        else:
            assert run.status is RunStatus.completed
    assert desk.sent == ["small"]


# --- a tool result over the record's cap ------------------------------------------------


async def test_a_receipt_over_the_record_cap_is_replaced_whole_and_replayed_not_resent(
    tmp_path: Path,
) -> None:
    """A side-effecting call whose result is over 1 MiB: its record says it was too large
    (no byte of it kept), the run dies before the frontier after the result, and the
    resume replays that record: the call is not made again."""
    desk = Desk()
    size = 1024 * 1024 + 10
    turns: list[Any] = [[("big_post", {"size": size})], "Posted."]
    url = _url(tmp_path)
    async with _opened(url) as stores:
        runner = faulty_runner(
            stores, ScriptedProvider(turns), crash_before=at("after_tool_result", 0)
        )
        with pytest.raises(SimulatedCrash):
            await runner.run(desk.agent(), "post", tenant=T, run_id="r")
        assert desk.sent == [f"big{size}"]
        for blob in _blobs(url):
            assert b"QQQQQQQQQQQQQQQQ" not in blob
        model = Recording(ScriptedProvider(turns))
        run = await AgentRunner.from_stores(model, stores).resume(desk.agent(), "r", tenant=T)
        assert run.status is RunStatus.completed
        [told] = answers(model.requests[-1], "big_post")
        assert "too large" in told.text and "QQQQ" not in told.text
    assert desk.sent == [f"big{size}"]


# --- approvals --------------------------------------------------------------------------


async def test_an_approval_asked_under_a_refused_frontier_can_be_acted_on(
    tmp_path: Path,
) -> None:
    desk = Desk()
    memo = "m" * 30_000
    turns: list[Any] = [[("post_entry", {"memo": memo})], "Posted."]
    url = _url(tmp_path)
    async with _opened(url) as stores:
        runner = AgentRunner.from_stores(ScriptedProvider(turns), stores, max_bytes=20_000)
        try:
            run = await runner.run(desk.agent(approval=True), "post", tenant=T, run_id="r")
        except CheckpointTooLargeError as exc:
            # Refused, final; the request withdrawn (denied by the kit, saying why), so no
            # person approves what nothing would carry out; nothing sent.
            assert exc.retryable is False
            with contextlib.closing(sqlite3.connect(url.removeprefix("sqlite:///"))) as db:
                (request_id,) = db.execute("SELECT id FROM adk_approvals").fetchone()
            asked = await stores.approvals.get(T, request_id)
            assert asked is not None and asked.status.value == "denied", asked
            assert asked.by == KIT_DECIDER and "too large" in (asked.note or "")
            assert desk.sent == []
            return
        assert run.status is RunStatus.waiting_approval
        assert run.pending_approval is not None
        await stores.approvals.decide(T, run.pending_approval.id, approved=True, by="ops")
        again = AgentRunner.from_stores(ScriptedProvider(turns), stores, max_bytes=20_000)
        resumed = await again.resume(desk.agent(approval=True), "r", tenant=T)
        assert resumed.status is RunStatus.completed
    assert desk.sent == [memo]


# --- submissions ------------------------------------------------------------------------


async def test_submit_refuses_an_input_no_frontier_of_the_run_could_hold(tmp_path: Path) -> None:
    desk = Desk()
    url = _url(tmp_path)
    async with _opened(url) as stores:
        runner = AgentRunner.from_stores(
            ScriptedProvider([[("post_entry", {"memo": "x"})], "Done."]), stores, max_bytes=20_000
        )
        with pytest.raises(CheckpointTooLargeError):
            await runner.submit(desk.agent(), "i" * 30_000, tenant=T, run_id="r")


# --- cancels ----------------------------------------------------------------------------


async def test_a_long_cancel_reason_ends_a_waiting_run_cancelled_not_tombstoned(
    tmp_path: Path,
) -> None:
    desk = Desk()
    turns: list[Any] = [[("post_entry", {"memo": "m"})], "Posted."]
    async with _opened(_url(tmp_path)) as stores:
        runner = AgentRunner.from_stores(ScriptedProvider(turns), stores, max_bytes=20_000)
        run = await runner.run(desk.agent(approval=True), "post", tenant=T, run_id="r")
        assert run.status is RunStatus.waiting_approval
        try:
            await runner.cancel("r", tenant=T, by="ops", reason="z" * 30_000)
        finally:
            latest = await runner.checkpoints.latest(T, "r")  # type: ignore[union-attr]
            assert latest is not None
            assert latest.status == "cancelled", latest.reason
    assert desk.sent == []


async def test_cancelling_a_tombstoned_run_answers_typed(tmp_path: Path) -> None:
    from tesserix_adk.errors import AdkError

    url = _url(tmp_path)
    desk = Desk()
    await _tombstoned(url, desk)
    async with _opened(url) as stores:
        runner = AgentRunner.from_stores(ScriptedProvider(["x"]), stores, max_bytes=20_000)
        with pytest.raises(CheckpointTooLargeError, match="tombstone") as refused:
            await runner.cancel("r", tenant=T, by="ops", reason="stop")
        assert isinstance(refused.value, AdkError) and refused.value.retryable is False
    command = [sys.executable, "-m", "tesserix_adk", "cancel", "r", "--tenant", T]
    command += ["--by", "ops", "--store", url]
    done = await asyncio.to_thread(
        subprocess.run, command, capture_output=True, text=True, timeout=60
    )
    # The operator's decision is taken (recorded), and the line says the run cannot be
    # carried on anyway: not a refusal.
    assert done.returncode == ExitCode.CARRIED_ON, (done.returncode, done.stdout, done.stderr)
    said = done.stdout
    assert "recorded" in said and "tombstone" in said and "cannot be carried on" in said, said
    assert said.count("\n") == 1 and done.stderr == ""
    assert desk.sent == ["small"]


# --- real backends: a result near the record's cap -----------------------------------------


@pytest.mark.parametrize(
    "where",
    [
        pytest.param("sqlite"),
        pytest.param("redis", marks=pytest.mark.redis),
        pytest.param("postgres", marks=pytest.mark.postgres),
    ],
)
async def test_a_result_just_under_the_record_cap_is_replayed_whole_on_every_backend(
    tmp_path: Path, where: str
) -> None:
    """A side-effecting call's 1,000,000-character receipt (under the record's 1 MiB cap;
    ``max_bytes`` raised to 4 MiB so its frontier fits too). The run dies before the frontier
    after it; the resume replays the record: the call is not made again and the model is
    told every character, none cut."""
    desk = Desk()
    size = 1_000_000
    turns: list[Any] = [[("big_post", {"size": size})], "Posted."]
    async with fresh_stores(where, tmp_path) as stores:
        run_id = f"r-{where}-{uuid.uuid4().hex[:8]}"
        runner = faulty_runner(
            stores,
            ScriptedProvider(turns),
            crash_before=at("after_tool_result", 0),
            max_bytes=4 * 1024 * 1024,
        )
        with pytest.raises(SimulatedCrash):
            await runner.run(desk.agent(), "post", tenant=T, run_id=run_id)
        model = Recording(ScriptedProvider(turns))
        again = AgentRunner.from_stores(model, stores, max_bytes=4 * 1024 * 1024)
        run = await again.resume(desk.agent(), run_id, tenant=T)
        assert run.status is RunStatus.completed
        [told] = answers(model.requests[-1], "big_post")
        assert told.text == "Q" * size
        latest = await again.checkpoints.latest(T, run_id)  # type: ignore[union-attr]
        assert latest is not None and not latest.is_tombstone
    assert desk.sent == [f"big{size}"]


# --- a transcript gone -----------------------------------------------------------------


@pytest.mark.parametrize("evicted", ["middle", "all"])
async def test_a_transcript_whose_entries_were_evicted_fails_the_resume_closed_and_sends_nothing(
    tmp_path: Path, evicted: str
) -> None:
    """The run posts twice and dies before the frontier after the second post; its
    transcript then loses an entry its last frontier names (or all of it). The resume is a
    typed ``HistoryUnavailableError``, and neither post goes out again."""
    desk = Desk()
    turns: list[Any] = [
        [("post_entry", {"memo": "one"})],
        [("post_entry", {"memo": "two"})],
        "Done.",
    ]
    url = _url(tmp_path)
    async with _opened(url) as stores:
        runner = faulty_runner(
            stores, ScriptedProvider(turns), crash_before=at("after_tool_result", 1)
        )
        with pytest.raises(SimulatedCrash):
            await runner.run(desk.agent(), "post", tenant=T, run_id="r")
    assert desk.sent == ["one", "two"]
    with contextlib.closing(sqlite3.connect(url.removeprefix("sqlite:///"))) as db:
        if evicted == "all":
            db.execute("DELETE FROM adk_history WHERE run_id = 'r'")
        else:
            db.execute(
                "DELETE FROM adk_history WHERE run_id = 'r' AND position = "
                "(SELECT MIN(position) + 1 FROM adk_history WHERE run_id = 'r')"
            )
        db.commit()
    async with _opened(url) as stores:
        model = Recording(ScriptedProvider(turns))
        again = AgentRunner.from_stores(model, stores)
        with pytest.raises(HistoryUnavailableError):
            await again.resume(desk.agent(), "r", tenant=T)
        assert model.requests == []
    assert desk.sent == ["one", "two"]


async def test_inspect_json_of_a_tombstoned_run_says_it_cannot_be_carried_on(
    tmp_path: Path,
) -> None:
    """Found by the console's attack: a tombstone plans nothing, and ``safe`` read true."""
    url = _url(tmp_path)
    await _tombstoned(url, Desk())
    code, out, err = await _cli(url, "inspect", "r", "--tenant", T, "--json")
    assert code == ExitCode.CARRIED_ON, err
    told = json.loads(out)
    assert told["status"] == "tombstone" and told["safe"] is False, told
