"""What an operator's command prints, and what a store kept, as tests read them: one
``tesserix`` command run in this process, and the raw bytes of a SQLite store."""

from __future__ import annotations

import concurrent.futures
import contextlib
import io
from pathlib import Path

from tesserix_adk.cli.main import main

__all__ = ["cli", "sqlite_bytes"]


def cli(*argv: str) -> tuple[int, str, str]:
    """``tesserix ARGV``: its exit code, stdout and stderr. On a thread of its own, since it
    runs its own event loop and the calling test may be inside one."""

    def run() -> tuple[int, str, str]:
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(list(argv))
        return code, out.getvalue(), err.getvalue()

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(run).result()


def sqlite_bytes(directory: Path, name: str = "adk.sqlite3") -> bytes:
    """Everything a SQLite store in ``directory`` wrote: its file and its WAL."""
    return b"".join(p.read_bytes() for p in sorted(directory.glob(f"{name}*")))
