"""Attacks on README.md as a newcomer follows it: its links and paths, its command table,
its exit codes, and what it says about today's changes (a run's input kept as a
submission, ``--lease-ttl`` bounds, cancel reasons cut at 4,000 characters, approvals
withdrawn for a too-large frontier, tombstoned runs).

Real parts only: SQLite files, the console script as a real subprocess, a worker process
killed with SIGKILL in its first model call (``tests/processes.py``'s ``Site``).

Defects found (strict xfails):

- MEDIUM: a cancel whose reason is over the record cap (about 1 MiB), asked through
  ``AgentRunner.cancel`` while another process carries the run, is recorded as something
  no reader can read: the carrier stops with ``CheckpointCorruptError`` at its next
  boundary, and ``show``/``inspect`` answer exit 4 "cannot be read" for the run from then
  on; README says the request keeps the reason whole and the run ends cancelled. The same
  reason on a waiting run ends it cancelled, but ``show``/``inspect`` then answer exit 4.
- LOW: a cancel whose ``by`` is long (the reason is cut at 4,000 characters exactly so a
  long one cannot do this) turns a waiting run into a tombstone instead of a cancelled run.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from processes import AGENT, TENANT, Site
from tesserix_adk import (
    Agent,
    AgentRunner,
    CheckpointTooLargeError,
    RunStatus,
    ScriptedProvider,
    tool,
)
from tesserix_adk.cli import ExitCode, frontier_main
from tesserix_adk.errors import AdkError, CheckpointCorruptError, ConfigurationError
from tesserix_adk.run.approvals import KIT_DECIDER
from tesserix_adk.run.cancelling import REASON_CHARS, REASON_MAX_CHARS, cancel_requested
from tesserix_adk.stores import open_stores
from tesserix_adk.stores.bundle import Stores

ROOT = Path(__file__).parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
T = "newcomer"


# --- helpers ------------------------------------------------------------------------------


def _url(tmp_path: Path, name: str = "adk.sqlite3") -> str:
    return f"sqlite:///{tmp_path / name}"


@contextlib.asynccontextmanager
async def _opened(url: str) -> AsyncIterator[Stores]:
    async with open_stores(url) as stores:
        await stores.create_schema()
        yield stores


def _tesserix(*argv: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ADK_")}
    return subprocess.run(
        [sys.executable, "-m", "tesserix_adk", *argv],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=cwd,
        env=env,
    )


def _one_sentence(err: str) -> bool:
    lines = [line for line in err.strip().splitlines() if line.strip()]
    return len(lines) == 1 and "Traceback" not in err and lines[0].startswith("tesserix")


async def _cli(url: str, *argv: str) -> tuple[int, str, str]:
    def run() -> tuple[int, str, str]:
        out, err = io.StringIO(), io.StringIO()
        code = frontier_main(list(argv), stores=open_stores(url), out=out, err=err)
        return code, out.getvalue(), err.getvalue()

    return await asyncio.to_thread(run)


def _file_bytes(path: Path) -> bytes:
    """Every byte of a SQLite store as it lies on disk (its WAL and journal too)."""
    found = b""
    for part in path.parent.glob(path.name + "*"):
        found += part.read_bytes()
    return found


class Desk:
    """A ledger that counts each side effect; its one tool may need an approval."""

    def __init__(self) -> None:
        self.sent: list[str] = []

    def agent(self, *, approval: bool = False, during: Any = None) -> Agent:
        desk = self

        @tool(requires_approval=approval)
        def post_entry(memo: str) -> str:
            """Post one ledger entry (a side effect)."""
            desk.sent.append(memo)
            if during is not None:
                during()
            return f"posted #{len(desk.sent)}"

        return Agent("desk", "Do the books.", [post_entry])


def _slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it."""
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    lines = path.read_text().splitlines()
    anchors: set[str] = set()
    inside = False
    for line in lines:
        if line.lstrip().startswith("```"):
            inside = not inside
            continue
        if not inside and (m := re.match(r"^#{1,6}\s+(.*)$", line)):
            anchors.add(_slug(m[1]))
    return anchors


# --- links, anchors and paths -------------------------------------------------------------


@pytest.mark.parametrize("doc", [README, *DOCS], ids=lambda p: p.name)
def test_every_link_and_anchor_in_the_readme_and_docs_resolves(doc: Path) -> None:
    text = doc.read_text()
    broken: list[str] = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        where, _, anchor = target.partition("#")
        page = doc if not where else (doc.parent / where).resolve()
        if not page.exists():
            broken.append(f"{target}: no such file")
            continue
        if anchor and page.suffix == ".md" and anchor not in _anchors(page):
            broken.append(f"{target}: no such heading in {page.name}")
    assert not broken, broken


def test_every_repository_path_the_readme_names_exists() -> None:
    text = README.read_text()
    named = set(re.findall(r"`((?:tests|benchmarks|examples|docs|src|\.ci)/[\w./-]*)`", text))
    assert named, "the README names files of the repository"
    missing = sorted(p for p in named if not (ROOT / p.rstrip("/")).exists())
    assert not missing, missing


# --- the command table --------------------------------------------------------------------


def _documented_commands() -> list[tuple[str, list[str]]]:
    rows = [line for line in README.read_text().splitlines() if line.startswith("| `tesserix ")]
    found: list[tuple[str, list[str]]] = []
    for row in rows:
        synopsis = row.split("|")[1]
        m = re.match(r"\s*`tesserix (\w+)", synopsis)
        assert m is not None, row
        flags = set(re.findall(r"--[a-z][a-z-]+", synopsis))
        if m[1] not in ("demo", "ui"):  # "Every command but demo and ui takes --json"
            flags.add("--json")
        found.append((m[1], sorted(flags)))
    return found


def test_every_command_and_flag_in_the_readme_table_is_in_its_help() -> None:
    commands = _documented_commands()
    assert len(commands) >= 14, commands
    missing: dict[str, list[str]] = {}
    for command, flags in commands:
        shown = _tesserix(command, "--help")
        assert shown.returncode == 0, (command, shown.stderr)
        assert "Traceback" not in shown.stderr
        lost = [f for f in flags if f not in shown.stdout]
        if lost:
            missing[command] = lost
    assert not missing, missing


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--tenant", "demo", "inspect", "r"], "go after it"),
        (["inspect", "r", "--ten", "demo"], "--tenant"),  # never abbreviated
        (["cancel", "r", "--tenant", "t", "--by", ""], "must not be empty"),
        (["inspect", "", "--tenant", "t"], "must not be empty"),
        (["cancel", "r", "--tenant", "t", "--by", "ops", "--reason", "x" * 4001], "4000"),
        (["approve", "q", "--tenant", "t", "--by", "ops", "--note", "n" * 4001], "4000"),
        (["run", "--resume", "r", "--tenant", "t", "--agent", "no-colon"], "agent"),
        (["ui", "--host", "0.0.0.0", "--port", "0"], "token"),
    ],
    ids=[
        "option-before-command",
        "abbreviated-option",
        "empty-by",
        "empty-run-id",
        "cancel-reason-4001",
        "approve-note-4001",
        "agent-not-module-attr",
        "ui-off-loopback-without-token",
    ],
)
def test_documented_usage_errors_are_one_sentence_and_exit_2(
    tmp_path: Path, argv: list[str], says: str
) -> None:
    done = _tesserix(*argv, "--store", _url(tmp_path), cwd=tmp_path)
    assert done.returncode == ExitCode.USAGE, (done.returncode, done.stdout, done.stderr)
    assert _one_sentence(done.stderr), done.stderr
    assert says in done.stderr, done.stderr


def test_demo_keep_refuses_a_directory_that_is_not_new_or_empty(tmp_path: Path) -> None:
    kept = tmp_path / "demo-data"
    kept.mkdir()
    (kept / "mine.txt").write_text("keep me")
    done = _tesserix("demo", "--keep", str(kept))
    assert done.returncode == ExitCode.USAGE, (done.returncode, done.stderr)
    assert _one_sentence(done.stderr), done.stderr
    assert [p.name for p in kept.iterdir()] == ["mine.txt"]


def test_inspect_of_nothing_checkpointed_is_exit_1_and_a_missing_file_names_schema_apply(
    tmp_path: Path,
) -> None:
    asyncio.run(_apply(_url(tmp_path)))
    done = _tesserix("inspect", "nobody", "--tenant", T, "--store", _url(tmp_path))
    assert done.returncode == ExitCode.NOTHING_CHECKPOINTED, done.stderr
    assert _one_sentence(done.stderr), done.stderr
    missing = _url(tmp_path, "nowhere.sqlite3")
    done = _tesserix("inspect", "nobody", "--tenant", T, "--store", missing)
    assert done.returncode == ExitCode.NOTHING_CHECKPOINTED, done.stderr
    assert _one_sentence(done.stderr) and "tesserix schema apply" in done.stderr, done.stderr


async def _apply(url: str) -> None:
    async with _opened(url):
        pass


# --- --lease-ttl: from 1 s to 1 day -------------------------------------------------------


@pytest.mark.parametrize("ttl", ["0.999", "0", "-1", "86400.5", "1e300", "nan", "inf", "abc"])
def test_a_lease_ttl_outside_one_second_to_one_day_is_one_sentence_and_exit_2(
    tmp_path: Path, ttl: str
) -> None:
    url = _url(tmp_path)
    asyncio.run(_apply(url))
    done = _tesserix(
        "worker", "--agent", AGENT, "--exit-when-idle", "--lease-ttl", ttl, "--store", url
    )
    assert done.returncode == ExitCode.USAGE, (done.returncode, done.stdout, done.stderr)
    assert _one_sentence(done.stderr), done.stderr
    assert "--lease-ttl" in done.stderr, done.stderr


@pytest.mark.parametrize("ttl", ["1", "86400"])
def test_a_lease_ttl_at_either_bound_is_taken(tmp_path: Path, ttl: str) -> None:
    url = _url(tmp_path)
    asyncio.run(_apply(url))
    done = _tesserix(
        "worker", "--agent", AGENT, "--exit-when-idle", "--lease-ttl", ttl, "--store", url
    )
    assert done.returncode == ExitCode.CARRIED_ON, (done.stdout, done.stderr)
    assert f"lease ttl {ttl} s" in done.stdout + done.stderr, (done.stdout, done.stderr)


# --- run() keeps its input as a submission, redacted ----------------------------------------

SECRET = "sk-proj-" + "Ab3dEf6hIj9kLm2nOp5qRs8tUv1wXy4z" * 2


@pytest.fixture
def site(tmp_path: Path) -> Iterator[Site]:
    yield Site(tmp_path, _url(tmp_path))


@pytest.mark.skipif(os.name != "posix", reason="needs POSIX signals")
def test_a_run_killed_in_its_first_model_call_kept_its_input_redacted_and_a_worker_starts_it(
    site: Site, tmp_path: Path
) -> None:
    site.kill_at("first", "first_model_call", "--input", f"Book a seat. My key is {SECRET}.")
    assert SECRET.encode() not in _file_bytes(tmp_path / "adk.sqlite3")
    site.wait_lease_lapsed("first")
    worker = site.tesserix(
        "worker", "--agent", AGENT, "--lease-ttl", "2", "--exit-when-idle", "--json"
    )
    assert worker.returncode == 0, worker.stderr[-2000:]
    assert site.bookings("first") == 1
    shown = site.tesserix("show", "first", "--tenant", TENANT, "--json")
    assert json.loads(shown.stdout)["status"] == "completed", shown.stdout
    assert SECRET not in shown.stdout
    asyncio.run(_first_message_redacted(site.store, "first"))
    assert SECRET.encode() not in _file_bytes(tmp_path / "adk.sqlite3")
    listed = site.tesserix("runs", "--tenant", TENANT, "--json")
    rows = [r for r in json.loads(listed.stdout)["runs"] if r["run_id"] == "first"]
    assert len(rows) == 1 and rows[0]["status"] == "completed", rows


async def _first_message_redacted(url: str, run_id: str) -> None:
    async with open_stores(url) as stores:
        runner = AgentRunner.from_stores(ScriptedProvider(["x"]), stores)
        assert runner.checkpoints is not None
        latest = await runner.checkpoints.latest(TENANT, run_id)
        assert latest is not None
        first = (await runner.checkpoints.messages(latest))[0]
        assert "[redacted" in first.text and SECRET not in first.text, first.text


async def test_run_again_with_another_input_after_a_death_before_the_first_frontier_is_refused(
    tmp_path: Path,
) -> None:
    """README: a run id names one run for good; the input kept as a submission is the one a
    worker starts, so a ``run()`` with another input under that id must not carry it."""
    desk = Desk()
    url = _url(tmp_path)

    class Dies:
        async def complete(self, request: Any) -> Any:
            raise asyncio.CancelledError("the process died in its first model call")

    async with _opened(url) as stores:
        runner = AgentRunner.from_stores(Dies(), stores)
        with pytest.raises(asyncio.CancelledError):
            await runner.run(desk.agent(), "post memo A", tenant=T, run_id="r")
        again = AgentRunner.from_stores(ScriptedProvider(["Done."]), stores)
        with pytest.raises(AdkError, match="another input"):
            await again.run(desk.agent(), "post memo B", tenant=T, run_id="r")
        same = await again.run(desk.agent(), "post memo A", tenant=T, run_id="r")
        assert same.status is RunStatus.completed
    assert desk.sent == []


# --- cancel reasons cut at 4,000 characters -------------------------------------------------


async def _waiting(stores: Stores, desk: Desk, **kw: Any) -> AgentRunner:
    turns: list[Any] = [[("post_entry", {"memo": "m"})], "Posted."]
    runner = AgentRunner.from_stores(ScriptedProvider(turns), stores, **kw)
    run = await runner.run(desk.agent(approval=True), "post", tenant=T, run_id="r")
    assert run.status is RunStatus.waiting_approval
    return runner


async def test_a_cancel_reason_past_4000_characters_is_cut_in_the_frontier_kept_in_the_request(
    tmp_path: Path,
) -> None:
    desk = Desk()
    url = _url(tmp_path)
    # A key straddling the cut: redacted before the cut, so no part of it is stored.
    reason = "y" * (REASON_CHARS - 15) + f" {SECRET} " + "z" * 1000
    async with _opened(url) as stores:
        runner = await _waiting(stores, desk)
        ended = await runner.cancel("r", tenant=T, by="ops", reason=reason)
        assert ended is not None and ended.status is RunStatus.cancelled
        latest = await runner.checkpoints.latest(T, "r")  # type: ignore[union-attr]
        assert latest is not None and latest.status == "cancelled"
        assert (
            latest.output is not None and "characters more in the cancel request" in latest.output
        )
        request = await cancel_requested(stores.idempotency, T, "r")
        assert request is not None and request.reason is not None
        assert request.reason.endswith("z" * 1000) and "redacted" in request.reason
    code, _out, err = await _cli(url, "show", "r", "--tenant", T)
    assert code == ExitCode.CARRIED_ON, err
    assert SECRET.encode() not in _file_bytes(tmp_path / "adk.sqlite3")
    assert SECRET[:20].encode() not in _file_bytes(tmp_path / "adk.sqlite3")
    assert desk.sent == []


async def test_a_cancel_with_a_reason_over_a_mib_asked_while_the_run_is_carried_ends_it_cancelled(
    tmp_path: Path,
) -> None:
    url = _url(tmp_path)
    refused: list[BaseException] = []

    async def cancel_from_another_process() -> None:
        async with open_stores(url) as stores:
            other = AgentRunner.from_stores(ScriptedProvider(["x"]), stores)
            try:
                await other.cancel("r", tenant=T, by="ops", reason="z" * 1_200_000)
            except AdkError as exc:  # a typed refusal, nothing recorded, is fine too
                refused.append(exc)

    def during() -> None:
        # Asked from a sync tool's thread: the run is held, so the holder sees it at its
        # next boundary.
        assert threading.current_thread() is not threading.main_thread()
        asyncio.run(cancel_from_another_process())

    desk = Desk()
    turns: list[Any] = [[("post_entry", {"memo": "a"})], [("post_entry", {"memo": "b"})], "Done."]
    async with _opened(url) as stores:
        runner = AgentRunner.from_stores(ScriptedProvider(turns), stores)
        try:
            run = await runner.run(desk.agent(during=during), "post", tenant=T, run_id="r")
        except CheckpointCorruptError as exc:
            pytest.fail(f"the run was stopped as corrupt by its own cancel: {exc}")
        if refused:
            assert not isinstance(refused[0], CheckpointCorruptError)
            assert run.status is RunStatus.completed
        else:
            assert run.status is RunStatus.cancelled
    code, _out, err = await _cli(url, "show", "r", "--tenant", T)
    assert code == ExitCode.CARRIED_ON, err
    code, _out, err = await _cli(url, "inspect", "r", "--tenant", T)
    assert code == ExitCode.CARRIED_ON, err


async def test_a_cancel_by_a_long_name_ends_a_waiting_run_cancelled_not_tombstoned(
    tmp_path: Path,
) -> None:
    desk = Desk()
    async with _opened(_url(tmp_path)) as stores:
        runner = await _waiting(stores, desk, max_bytes=20_000)
        try:
            await runner.cancel("r", tenant=T, by="o" * 30_000, reason="stop")
        except CheckpointTooLargeError:
            pass  # judged by what was written
        except AdkError:
            # A typed refusal of the name, nothing recorded: the run still waits.
            latest = await runner.checkpoints.latest(T, "r")  # type: ignore[union-attr]
            assert latest is not None and latest.status == "waiting_approval"
            assert await cancel_requested(stores.idempotency, T, "r") is None
            return
        latest = await runner.checkpoints.latest(T, "r")  # type: ignore[union-attr]
        assert latest is not None
        assert not latest.is_tombstone and latest.status == "cancelled", latest.reason
    assert desk.sent == []


# --- approvals withdrawn for a too-large frontier --------------------------------------------


async def test_an_approval_withdrawn_for_a_too_large_frontier_cannot_be_approved_at_the_cli(
    tmp_path: Path,
) -> None:
    desk = Desk()
    url = _url(tmp_path)
    turns: list[Any] = [[("post_entry", {"memo": "m" * 30_000})], "Posted."]
    async with _opened(url) as stores:
        runner = AgentRunner.from_stores(ScriptedProvider(turns), stores, max_bytes=20_000)
        with pytest.raises(CheckpointTooLargeError) as stopped:
            await runner.run(desk.agent(approval=True), "post", tenant=T, run_id="r")
        assert stopped.value.retryable is False
    with contextlib.closing(sqlite3.connect(url.removeprefix("sqlite:///"))) as db:
        [(request_id,)] = db.execute("SELECT id FROM adk_approvals").fetchall()
    done = await asyncio.to_thread(
        _tesserix, "approve", request_id, "--tenant", T, "--by", "ops", "--store", url
    )
    assert done.returncode == ExitCode.MUST_NOT_CARRY_ON, (done.stdout, done.stderr)
    assert _one_sentence(done.stderr) and KIT_DECIDER in done.stderr, done.stderr
    code, out, err = await _cli(url, "runs", "--tenant", T, "--stuck")
    assert code == ExitCode.CARRIED_ON and "r " in out and "tombstone" in out, (out, err)
    code, out, err = await _cli(url, "inspect", "r", "--tenant", T)
    assert code == ExitCode.CARRIED_ON and "tombstone" in out, (out, err)
    assert desk.sent == []


# --- the console script's exit 141 ----------------------------------------------------------


def test_runs_into_a_reader_that_leaves_ends_as_sigpipe_would_saying_nothing(
    tmp_path: Path,
) -> None:
    url = _url(tmp_path)

    async def many() -> None:
        async with _opened(url) as stores:
            runner = AgentRunner.from_stores(ScriptedProvider(["x"]), stores)
            for i in range(400):
                await runner.submit(
                    Desk().agent(), "go", tenant=T, run_id=f"run-{i:04d}-" + "p" * 200
                )

    asyncio.run(many())
    env = {k: v for k, v in os.environ.items() if not k.startswith("ADK_")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "tesserix_adk", "runs", "--tenant", T, "--store", url],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.readline()
    proc.stdout.close()  # `| head -1`
    err = proc.stderr.read().decode()
    proc.stderr.close()
    code = proc.wait(timeout=60)
    assert code in (141, -signal.SIGPIPE), (code, err)
    assert err == "", err


async def test_a_waiting_run_cancelled_with_a_reason_over_a_mib_is_shown_as_cancelled(
    tmp_path: Path,
) -> None:
    """Found as a defect: such a request was stored unreadably. A reason past
    ``REASON_MAX_CHARS`` is now refused, typed, nothing recorded; the longest one taken ends
    the run cancelled and reads back."""
    desk = Desk()
    url = _url(tmp_path)
    async with _opened(url) as stores:
        runner = await _waiting(stores, desk)
        with pytest.raises(ConfigurationError, match="at most"):
            await runner.cancel("r", tenant=T, by="ops", reason="z" * 1_200_000)
        assert await cancel_requested(stores.idempotency, T, "r") is None
        ended = await runner.cancel("r", tenant=T, by="ops", reason="z" * REASON_MAX_CHARS)
        assert ended is not None and ended.status is RunStatus.cancelled
    for command in ("show", "inspect"):
        code, out, err = await _cli(url, command, "r", "--tenant", T)
        assert code == ExitCode.CARRIED_ON, (command, err)
        assert "cancelled" in out, (command, out)
    assert desk.sent == []
