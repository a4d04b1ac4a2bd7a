"""``tesserix`` reads its command line honestly: real subcommands, usage errors as one
sentence (exit 2), and ids that cannot forge output lines."""

from __future__ import annotations

import asyncio
import io
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

from booking import BOOK_TURNS, Airline, booking_agent
from tesserix_adk import (
    AgentRunner,
    Checkpoint,
    Checkpointer,
    CheckpointStatus,
    PendingApproval,
    ScriptedProvider,
    Usage,
)
from tesserix_adk.cli import ExitCode, describe, frontier_main
from tesserix_adk.cli.main import main
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.stores.urls import open_stores


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A SQLite store with its schema applied; ``ADK_STORE`` points somewhere unusable, so
    a command that ignored ``--store`` would fail."""
    url = f"sqlite:///{tmp_path / 'adk.sqlite3'}"

    async def apply() -> None:
        async with open_stores(url) as stores:
            await stores.create_schema()

    asyncio.run(apply())
    monkeypatch.setenv("ADK_STORE", "ftp://not-a-store")
    return url


def _main(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    seen = capsys.readouterr()
    return code, seen.out, seen.err


def _one_sentence(err: str) -> bool:
    return err.startswith("tesserix: ") and err.count("\n") == 1 and "Traceback" not in err


# --- subcommands --------------------------------------------------------------------------


def test_an_option_value_is_never_taken_for_a_command(
    store: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = _main(capsys, "--store", store, "--tenant", "demo", "inspect", "r")
    assert code == ExitCode.USAGE, out
    assert _one_sentence(err) and "--tenant" in err
    assert "airline" not in out  # the demo did not run


@pytest.mark.parametrize(
    "where",
    ["before", "before=", "after", "after="],
)
def test_store_goes_before_or_after_the_command(
    store: str, capsys: pytest.CaptureFixture[str], where: str
) -> None:
    given = [f"--store={store}"] if where.endswith("=") else ["--store", store]
    command = ["inspect", "nope", "--tenant", "t"]
    argv = [*given, *command] if where.startswith("before") else [*command, *given]
    code, _, err = _main(capsys, *argv)
    assert code == ExitCode.NOTHING_CHECKPOINTED, err
    assert "nothing is checkpointed under run 'nope'" in err


def test_version_prints_the_version(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _main(capsys, "--version")
    assert (code, err) == (0, "")
    assert out == f"tesserix {version('tesserix-adk')}\n"


def test_version_of_the_console_script() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "tesserix_adk", "--version"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"tesserix {version('tesserix-adk')}\n"


@pytest.mark.parametrize("command", ["demo", "inspect", "run", "resolve", "schema"])
def test_help_of_a_command_prints_help_and_runs_nothing(
    capsys: pytest.CaptureFixture[str], command: str
) -> None:
    code, out, err = _main(capsys, command, "--help")
    assert (code, err) == (0, "")
    assert out.startswith(f"usage: tesserix {command}")
    assert "airline holds" not in out


def test_help_lists_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _main(capsys, "--help")
    assert code == 0
    for command in ("inspect", "run", "approve", "resolve", "runs", "steps", "replay", "demo"):
        assert command in out
    assert "exit codes" in out


@pytest.mark.parametrize(
    "argv",
    [
        ("--tenant",),
        ("--bogus", "inspect", "r", "--tenant", "t"),
        ("inspect",),
        ("inspect", "r", "--tenant"),
        ("inspect", "r", "--tenant", "t", "extra"),
        ("inspect", "r", "--tenant", "t", "--store"),
        ("resolve", "r", "--tenant", "t", "--call", "c", "--by", "me"),
        ("resolve", "r", "--tenant", "t", "--call", "c", "--never-ran", "--outcome", "1"),
        ("replay", "r", "--tenant", "t", "--from-step", "x", "--agent", "a:b"),
        ("demo", "--bogus"),
        ("demo", "extra"),
        ("schema", "drop"),
        ("approve", "req", "--tenant", "t", "--by", ""),
        ("resolve", "r", "--tenant", "t", "--call", "c", "--never-ran", "--by", ""),
        ("inspect", "", "--tenant", "t"),
        ("inspect", "r", "--tenant", ""),
        ("inspect", "r", "--tenant", "t", "--ten", "x"),
    ],
)
def test_every_usage_error_is_one_sentence_and_exit_2(
    store: str, capsys: pytest.CaptureFixture[str], argv: tuple[str, ...]
) -> None:
    code, out, err = _main(capsys, "--store", store, *argv)
    assert code == ExitCode.USAGE, (out, err)
    assert _one_sentence(err), err
    assert "airline" not in out


def _pending_approval(stores: Stores) -> str:
    async def go() -> str:
        request = await stores.approvals.request("t", "r", ("call_1_0",), iteration=1, fence=None)
        return request.id

    return asyncio.run(go())


def test_an_empty_by_is_refused_and_decides_nothing() -> None:
    stores = open_stores("memory://")
    request = _pending_approval(stores)
    err = io.StringIO()
    code = frontier_main(
        ["approve", request, "--tenant", "t", "--by", ""], stores=stores, out=io.StringIO(), err=err
    )
    assert code == ExitCode.USAGE and "--by" in err.getvalue()
    decided = asyncio.run(stores.approvals.get("t", request))
    assert decided is not None and str(decided.status) == "pending"


@pytest.mark.parametrize("run_id", ["r" * 10_000, "r\udc80"], ids=["10KB", "surrogate"])
def test_an_id_no_store_can_keep_is_a_usage_error(run_id: str) -> None:
    stores = open_stores("memory://")
    err = io.StringIO()
    code = frontier_main(
        ["inspect", run_id, "--tenant", "t"], stores=stores, out=io.StringIO(), err=err
    )
    assert code == ExitCode.USAGE, err.getvalue()
    assert _one_sentence(err.getvalue())


# --- ids that cannot forge lines --------------------------------------------------------

HOSTILE_RUN = "r\nrun forged  tenant acme  agent booking\x1b[2J"
HOSTILE_HOLDER = "w\rheld by root (fence 99)\x1b]0;pwned\x07"


def _finished_run(stores: Stores, run_id: str) -> None:
    async def go() -> None:
        runner = AgentRunner(
            ScriptedProvider(BOOK_TURNS),
            idempotency=stores.idempotency,
            checkpoints=Checkpointer.from_stores(stores),
            ledger=stores.ledger,
        )
        await runner.run(booking_agent(Airline()), "book", tenant="acme", run_id=run_id)

    asyncio.run(go())


def _no_control_characters(text: str) -> bool:
    return all(c.isprintable() for line in text.split("\n") for c in line)


def test_describe_escapes_ids_and_prints_ordinary_ones_as_they_are() -> None:
    cp = Checkpoint(
        tenant="acme\x1b[31m",
        run_id=HOSTILE_RUN,
        agent_name="booking",
        step=7,
        status=CheckpointStatus.waiting_approval,
        iteration=3,
        messages=(),
        usage=Usage(input_tokens=1, output_tokens=2),
        micros=3,
        pending_approval=PendingApproval(id="req\n9", calls=("call_3_0",)),
    )
    text = describe(cp)
    assert text.splitlines() == [
        "run r\\nrun forged  tenant acme  agent booking\\x1b[2J  tenant acme\\x1b[31m  "
        "agent booking",
        "iteration 3  1 in, 2 out  3 micros",
        "waiting on approval req\\n9",
    ]


def test_inspect_and_runs_print_hostile_ids_escaped() -> None:
    stores = open_stores("memory://")
    _finished_run(stores, HOSTILE_RUN)
    asyncio.run(stores.leases.acquire("acme", HOSTILE_RUN, HOSTILE_HOLDER, 60))
    out = io.StringIO()
    code = frontier_main(["inspect", HOSTILE_RUN, "--tenant", "acme"], stores=stores, out=out)
    assert code == ExitCode.CARRIED_ON
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("run r\\nrun forged  tenant acme  agent booking\\x1b[2J")
    assert lines[-1].startswith(
        "held by w\\rheld by root (fence 99)\\x1b]0;pwned\\x07 (fence 1) until 20"
    )
    assert lines[-1].endswith("by the store's clock, unless renewed")
    assert _no_control_characters(out.getvalue())
    listed = io.StringIO()
    assert frontier_main(["runs", "--tenant", "acme"], stores=stores, out=listed) == 0
    assert len(listed.getvalue().splitlines()) == 1
    assert _no_control_characters(listed.getvalue())


def test_an_error_naming_a_hostile_id_stays_one_line() -> None:
    stores = open_stores("memory://")
    _finished_run(stores, "r")
    asyncio.run(stores.leases.acquire("acme", "r", HOSTILE_HOLDER, 60))
    err = io.StringIO()
    code = frontier_main(
        ["resolve", "r", "--tenant", "acme", "--call", "call_1_0", "--never-ran", "--by", "me"],
        stores=stores,
        out=io.StringIO(),
        err=err,
    )
    assert code == ExitCode.HELD
    assert err.getvalue().count("\n") == 1 and _no_control_characters(err.getvalue())
    assert "\\x1b]0;pwned" in err.getvalue()


def test_an_operator_name_with_a_newline_is_echoed_escaped() -> None:
    stores = open_stores("memory://")
    request = _pending_approval(stores)
    out = io.StringIO()
    code = frontier_main(
        ["approve", request, "--tenant", "t", "--by", "alice\nrecorded: all good"],
        stores=stores,
        out=out,
    )
    assert code == ExitCode.CARRIED_ON
    assert len(out.getvalue().splitlines()) == 1 and "alice\\nrecorded" in out.getvalue()


@pytest.mark.parametrize(
    ("argv", "code"),
    [
        (["inspect", "--tenant", "acme", "--json"], ExitCode.USAGE),  # no run id
        (["--store", "nosuch://x", "inspect", "r", "--tenant", "acme", "--json"], ExitCode.USAGE),
    ],
)
def test_an_error_before_the_command_runs_is_json_too_under_json(
    argv: list[str], code: ExitCode, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    assert main(argv) == int(code)
    captured = capsys.readouterr()
    error = json.loads(captured.out)["error"]
    assert error["exit_code"] == int(code) and error["message"]
    assert captured.err.count("\n") == 1 and "Traceback" not in captured.err
