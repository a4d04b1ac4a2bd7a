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


def test_runs_lists_a_submitted_run_before_a_worker_starts_it(
    store: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # At 3 a.m. "is my run there at all?": a run waiting for a worker is listed, as
    # submitted, and once a worker carried it, listed once with its frontier's status.
    submit = ["--store", store, "submit", "--agent", AGENT, "--tenant", "acme", "--input", "book"]
    assert main([*submit, "--run-id", "queued"]) == 0
    capsys.readouterr()
    runs = ["--store", store, "runs", "--tenant", "acme"]
    assert main([*runs, "--json"]) == 0
    (row,) = _json(capsys)["runs"]  # type: ignore[index]
    assert row["run_id"] == "queued" and row["status"] == "submitted"
    assert row["agent"] == "booking" and row["step"] is None and row["updated_at"].endswith("Z")
    assert main([*runs, "--no-header"]) == 0
    assert capsys.readouterr().out.split()[:3] == ["queued", "booking", "submitted"]
    # Filters apply: another agent's, a checkpoint status, --stuck leave it out.
    for extra in (["--agent", "other"], ["--status", "running"], ["--stuck"]):
        assert main([*runs, *extra, "--json"]) == 0
        assert _json(capsys) == {"runs": []}, extra
    worker = ["--store", store, "worker", "--agent", AGENT, "--exit-when-idle"]
    assert main(worker) == 0
    capsys.readouterr()
    assert main([*runs, "--json"]) == 0
    (row,) = _json(capsys)["runs"]  # type: ignore[index]
    assert row["run_id"] == "queued" and row["status"] == "completed"
