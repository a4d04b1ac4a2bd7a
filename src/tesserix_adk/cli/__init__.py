"""The operator CLI: ``describe()``, ``frontier_main``/``resume_main`` and ``ExitCode``."""

from tesserix_adk.cli.commands import ExitCode, frontier_main, resume_main
from tesserix_adk.cli.describe import describe

__all__ = ["ExitCode", "describe", "frontier_main", "resume_main"]
