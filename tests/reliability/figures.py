"""The figures of a session: trials and what the checker found, per backend.

Tests add what each batch of trials did; ``tests/conftest.py`` gathers each test
process's tally (``make test`` runs two), prints the summary at the end of the session and,
when ``ADK_TORTURE_FIGURES`` names a file, writes it there as JSON, which
``python tests/reliability/figures.py FILE`` prints again (``make torture`` ends with it).
"""

from __future__ import annotations

import json
import sys
import threading
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from reliability.checker import Verdict

__all__ = ["Tally", "TALLY", "lines"]


@dataclass
class Row:
    trials: int = 0
    duplicate_effects: int = 0
    stale_writes: int = 0
    wrong_refusals: int = 0
    hangs: int = 0
    kills: int = 0
    workers: int = 0
    scenarios: dict[str, int] = field(default_factory=dict)
    # Counts worth reading next to the trials (live leases a skewed worker took, ...).
    notes: dict[str, int] = field(default_factory=dict)


# A row's plain counts (its tables are merged key by key).
_COUNTS = tuple(f.name for f in fields(Row) if f.type == "int")


class Tally:
    def __init__(self) -> None:
        self.rows: dict[str, Row] = {}
        self._lock = threading.Lock()

    def add(
        self,
        backend: str,
        scenario: str,
        trials: int,
        verdict: Verdict,
        *,
        kills: int = 0,
        workers: int = 0,
        notes: dict[str, int] | None = None,
    ) -> None:
        with self._lock:
            row = self.rows.setdefault(backend, Row())
            row.trials += trials
            row.duplicate_effects += verdict.duplicate_effects
            row.stale_writes += verdict.stale_writes
            row.wrong_refusals += verdict.wrong_refusals
            row.hangs += verdict.hangs
            row.kills += kills
            row.workers += workers
            row.scenarios[scenario] = row.scenarios.get(scenario, 0) + trials
            for name, n in (notes or {}).items():
                row.notes[name] = row.notes.get(name, 0) + n

    def as_json(self) -> dict[str, dict[str, object]]:
        return {backend: asdict(row) for backend, row in sorted(self.rows.items())}

    def merge(self, rows: dict[str, dict[str, Any]]) -> None:
        """Add what another test process tallied (its ``as_json``)."""
        with self._lock:
            for backend, theirs in rows.items():
                row = self.rows.setdefault(backend, Row())
                for name in _COUNTS:
                    setattr(row, name, getattr(row, name) + int(theirs[name]))
                for table in ("scenarios", "notes"):
                    mine: dict[str, int] = getattr(row, table)
                    for key, n in theirs[table].items():
                        mine[key] = mine.get(key, 0) + int(n)


TALLY = Tally()


def lines(rows: dict[str, dict[str, object]]) -> list[str]:
    """One line per backend, in the form the issue fixes."""
    return [
        f"{backend}: {r['trials']} trials, {r['duplicate_effects']} duplicate effects, "
        f"{r['stale_writes']} stale writes accepted, {r['wrong_refusals']} wrong refusals, "
        f"{r['hangs']} hangs"
        for backend, r in rows.items()
    ]


def details(rows: dict[str, dict[str, object]]) -> list[str]:
    """What the trials were, per backend."""
    out = []
    for backend, r in rows.items():
        scenarios = r["scenarios"]
        assert isinstance(scenarios, dict)
        parts = ", ".join(f"{name} {n}" for name, n in sorted(scenarios.items()))
        notes = r.get("notes") or {}
        assert isinstance(notes, dict)
        extra = "".join(f", {n} {name}" for name, n in sorted(notes.items()))
        out.append(f"  {backend}: {parts}; {r['kills']} SIGKILLs, {r['workers']} processes{extra}")
    return out


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        data = json.load(f)
    print("\n".join(details(data)))
    print("\n".join(lines(data)))
