"""The shipped CLI and demo worker stand on the kit alone: no test helper is imported."""

from __future__ import annotations

import subprocess
import sys

SHIPPED = (
    "tesserix_adk.cli.main",
    "tesserix_adk.cli.commands",
    "tesserix_adk.cli.demo",
    "tesserix_adk.cli.demo_agent",
    "tesserix_adk.cli.worker",
)


def test_the_demo_worker_and_cli_import_no_test_helpers() -> None:
    # A fresh interpreter, so nothing this test run imported hides what the CLI imports.
    code = (
        "import importlib, sys\n"
        f"for name in {SHIPPED!r}:\n"
        "    importlib.import_module(name)\n"
        "print(sorted(m for m in sys.modules if m.startswith('tesserix_adk.testing')))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert done.stdout.strip() == "[]"
