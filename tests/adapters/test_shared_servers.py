"""The shared test servers (``ADK_TEST_POSTGRES_URL``, ``ADK_TEST_REDIS_URL``) are only ever
connected to: a test that takes a server down starts one of its own
(``adapters/throwaway.py``, ``reliability/servers.py``, ``adapters/pooler.py``).

An outage test once ran ``pg_ctlcluster <ver> main stop``, which stops the machine's
PostgreSQL whatever the URL points at; this keeps the next one from doing so.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Commands that stop, restart or reconfigure the machine's servers (its service manager,
# Debian's cluster wrappers) or a whole PostgreSQL server by SQL; ``pg_ctl -D <dir>`` of a
# cluster of the test's own is not among them.
_SHARED = re.compile(
    r"pg_ctlcluster|systemctl|\bservice\s+(postgresql|redis)|/etc/init\.d/"
    r"|ALTER\s+SYSTEM|pg_reload_conf"
)


def test_no_test_or_benchmark_stops_or_reconfigures_a_shared_server() -> None:
    found = []
    for folder in ("tests", "benchmarks", "examples"):
        for path in (ROOT / folder).rglob("*.py"):
            if path == Path(__file__).resolve():
                continue
            for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                if _SHARED.search(line) and not line.lstrip().startswith("#"):
                    found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not found, "\n".join(found)
