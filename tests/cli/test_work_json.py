"""``--json`` on ``submit``, ``cancel`` and ``worker``: one JSON object for the first two,
one JSON object per line for a worker (it prints as it goes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tesserix_adk.cli.demo_agent import AIRLINE_ENV, create_airline
from tesserix_adk.cli.main import main

AGENT = "tesserix_adk.cli.demo_agent:agent"


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    airline = tmp_path / "airline.sqlite3"
    create_airline(str(airline))
    monkeypatch.setenv(AIRLINE_ENV, str(airline))
    url = f"sqlite:///{tmp_path / 'adk.sqlite3'}"
    assert main(["--store", url, "schema", "apply"]) == 0
    return url


def _json(capsys: pytest.CaptureFixture[str]) -> object:
    return json.loads(capsys.readouterr().out)


def test_submit_cancel_and_worker_speak_json(
    store: str, capsys: pytest.CaptureFixture[str]
) -> None:
    capsys.readouterr()
    submit = ["--store", store, "submit", "--agent", AGENT, "--tenant", "acme", "--input", "book"]
    assert main([*submit, "--run-id", "r1", "--json"]) == 0
    assert _json(capsys) == {"run_id": "r1", "tenant": "acme", "agent": "booking"}
    assert main([*submit, "--run-id", "r2", "--json"]) == 0
    capsys.readouterr()

    cancel = ["--store", store, "cancel", "r2", "--tenant", "acme", "--by", "alice"]
    assert main([*cancel, "--reason", "token sk-live-abcdefghijklmnopqrstuvwx", "--json"]) == 0
    cancelled = _json(capsys)
    assert isinstance(cancelled, dict)
    assert cancelled["run_id"] == "r2" and cancelled["by"] == "alice"
    assert cancelled["state"] == "cancelled_before_start"
    assert "sk-live-abcdefghijklmnopqrstuvwx" not in json.dumps(cancelled)

    worker = ["--store", store, "worker", "--agent", AGENT, "--exit-when-idle", "--json"]
    assert main(worker) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert lines and all({"worker", "at", "message"} <= set(line) for line in lines)
    assert all(line["at"].endswith("Z") for line in lines)
    assert any("r1" in line["message"] and "finished" in line["message"] for line in lines)

    # A cancel of a run that has ended says so, as JSON.
    assert main([*cancel[:3], "r1", *cancel[4:], "--json"]) == 0
    ended = _json(capsys)
    assert isinstance(ended, dict) and ended["state"] == "already_ended"
    assert ended["status"] == "completed"
