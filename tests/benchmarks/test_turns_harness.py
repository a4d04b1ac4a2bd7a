"""The benchmark harness still runs against the current API (``turns.py --smoke``).

Nothing is timed or compared here: benchmarks print figures and never assert them. This
only keeps ``benchmarks/turns.py`` from rotting as the runner and the stores change.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

HARNESS = Path(__file__).resolve().parents[2] / "benchmarks" / "turns.py"


def test_turns_harness_smoke_runs_on_memory_and_sqlite(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(HARNESS), "--smoke", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "ours / floor 2" in done.stdout
    results = json.loads((tmp_path / "turns-smoke.json").read_text())
    assert set(results["per_turn"]) == {"memory", "sqlite-full"}
    assert results["counts"]["sqlite-full"]["ours"]["commits"] > 0
    assert results["resume"]["memory"]
