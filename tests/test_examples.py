"""The examples the README points at run as written."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).parent.parent / "examples"


@pytest.mark.parametrize("store", ["memory://", "sqlite"])
def test_quickstart_runs_dies_and_refuses_to_guess(store: str, tmp_path: Path) -> None:
    url = store if store != "sqlite" else f"sqlite:///{tmp_path / 'adk.sqlite3'}"
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "quickstart.py"), url],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "IndeterminateToolCallError" in done.stdout
    assert done.stdout.strip().endswith("airline holds 1 booking(s)")
