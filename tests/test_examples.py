"""The examples the README points at run as written."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).parent.parent / "examples"


def _quickstart(url: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(EXAMPLES / "quickstart.py"), url],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize("store", ["memory://", "sqlite"])
def test_quickstart_runs_dies_and_refuses_to_guess(store: str, tmp_path: Path) -> None:
    url = store if store != "sqlite" else f"sqlite:///{tmp_path / 'adk.sqlite3'}"
    done = _quickstart(url)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith(f"store {url}; run run-")
    assert "IndeterminateToolCallError" in done.stdout
    assert "airline holds 1 booking(s)" in done.stdout


def test_quickstart_runs_again_on_its_store_as_a_new_run(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'adk.sqlite3'}"
    first, second = _quickstart(url), _quickstart(url)
    assert first.returncode == 0 and second.returncode == 0, second.stdout + second.stderr
    ids = [re.search(r"; run (\S+)", d.stdout)[1] for d in (first, second)]  # type: ignore[index]
    assert ids[0] != ids[1]
    for done, run_id in zip((first, second), ids, strict=True):
        assert "airline holds 1 booking(s)" in done.stdout
        # The line it prints to look at the run works, and finds this run.
        look = done.stdout.strip().splitlines()[-1].removeprefix("look at it: tesserix ")
        seen = subprocess.run(
            [sys.executable, "-m", "tesserix_adk", *look.split()],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert seen.returncode == 0, seen.stderr
        assert seen.stdout.startswith(f"run {run_id}  tenant acme  agent booking")
