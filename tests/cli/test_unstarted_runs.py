"""A run submitted and not yet started has no frontier: the commands that read one say it
was submitted (exit 1), instead of leaving the operator to wonder whether the id is wrong."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tesserix_adk import Agent, AgentRunner, ScriptedProvider
from tesserix_adk.cli import ExitCode
from tesserix_adk.cli.main import main
from tesserix_adk.stores.urls import open_stores

AGENT = Agent("idle", "Nothing to do.", [])


def _submitted(url: str) -> None:
    async def go() -> None:
        async with open_stores(url) as stores:
            await stores.create_schema()
            runner = AgentRunner.from_stores(ScriptedProvider([]), stores)
            await runner.submit(AGENT, "hello", tenant="t", run_id="queued")

    asyncio.run(go())


@pytest.mark.parametrize(
    "command",
    [
        ["inspect", "queued"],
        ["show", "queued"],
        ["steps", "queued"],
        ["run", "--resume", "queued", "--agent", "cli.test_unstarted_runs:AGENT"],
    ],
    ids=["inspect", "show", "steps", "run-resume"],
)
def test_a_submitted_run_not_started_yet_is_said_to_be_submitted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: list[str]
) -> None:
    url = f"sqlite:///{tmp_path / 'adk.sqlite3'}"
    _submitted(url)
    code = main(["--store", url, *command, "--tenant", "t"])
    err = capsys.readouterr().err
    assert code == ExitCode.NOTHING_CHECKPOINTED, err
    assert "submitted" in err and "tesserix worker" in err, err


def test_an_unknown_run_is_not_said_to_be_submitted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"sqlite:///{tmp_path / 'adk.sqlite3'}"
    _submitted(url)
    assert main(["--store", url, "inspect", "nope", "--tenant", "t"]) == 1
    assert "submitted" not in capsys.readouterr().err
