"""Importing the kit never imports Temporal's SDK; only ``tesserix_adk.temporal`` does."""

from __future__ import annotations

import subprocess
import sys


def test_importing_the_kit_imports_no_temporalio() -> None:
    probe = "import sys, tesserix_adk, tesserix_adk.cli.main; print('temporalio' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert done.stdout.strip() == "False", done.stderr


def test_the_temporal_package_brings_the_sdk() -> None:
    probe = "import sys, tesserix_adk.temporal; print('temporalio' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert done.stdout.strip() == "True", done.stderr
