"""`tesserix schema show|apply` against PostgreSQL, as the operator runs it."""

from __future__ import annotations

import subprocess
import sys

from tesserix_adk.adapters.postgres import EXPECTED_CHECKPOINT_SCHEMA, open_postgres_stores


def _tesserix(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tesserix_adk", *args], capture_output=True, text=True, timeout=120
    )


async def test_schema_apply_makes_an_empty_database_verify(pg_url: str) -> None:
    before = _tesserix("inspect", "r", "--tenant", "acme", "--store", pg_url)
    assert before.returncode == 1
    assert "tesserix schema apply" in before.stderr and "Traceback" not in before.stderr

    shown = _tesserix("--store", pg_url, "schema", "show")
    assert shown.returncode == 0
    assert shown.stdout.strip() == EXPECTED_CHECKPOINT_SCHEMA.strip()

    applied = _tesserix("--store", pg_url, "schema", "apply")
    assert applied.returncode == 0, applied.stderr
    async with open_postgres_stores(pg_url) as stores:
        await stores.verify()
    nothing = _tesserix("inspect", "r", "--tenant", "acme", "--store", pg_url)
    assert nothing.returncode == 1 and "nothing is checkpointed" in nothing.stderr


def test_schema_apply_against_an_unreachable_server_is_exit_3() -> None:
    done = _tesserix(
        "--store", "postgresql://postgres@127.0.0.1:9/test?connect_timeout=1", "schema", "apply"
    )
    assert done.returncode == 3, done.stderr
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
