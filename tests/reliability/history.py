"""The history the processes under test write: one JSON object per line, appended.

Every line goes out in a single ``write(2)`` on a file opened ``O_APPEND``, so lines from
concurrent processes never interleave and a line is in the kernel the moment the call
returns: a SIGKILL right after it cannot lose it (a power cut could; none is simulated).

Times are ``time.monotonic_ns()``: on Linux that is one clock for every process of the
host, so ``sent``/``t`` of different processes can be compared.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Event", "Recorder", "now", "read_history", "written"]


def now() -> int:
    """The host's monotonic clock, in nanoseconds."""
    return time.monotonic_ns()


class Recorder:
    """Appends events to the history file at ``path`` for one process (``proc``)."""

    def __init__(self, path: str | os.PathLike[str], proc: str) -> None:
        self.path = str(path)
        self.proc = proc
        self.pid = os.getpid()
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def event(self, ev: str, run: str, **fields: Any) -> None:
        """Append one event; ``t`` is when it is written, ``sent`` (if given) when the
        request it reports went out."""
        body = {"ev": ev, "run": run, "proc": self.proc, "pid": self.pid, "t": now(), **fields}
        line = (json.dumps(body, sort_keys=True, default=str) + "\n").encode()
        written = os.write(self._fd, line)
        # A short write would tear the line; on a local file O_APPEND writes are whole.
        assert written == len(line), (written, len(line))

    def close(self) -> None:
        os.close(self._fd)


@dataclass(frozen=True, slots=True)
class Event:
    """One line of the history, with its position in the file."""

    seq: int
    ev: str
    run: str
    proc: str
    t: int
    fields: dict[str, Any] = field(default_factory=dict)

    def __getitem__(self, name: str) -> Any:
        return self.fields[name]

    def get(self, name: str, default: Any = None) -> Any:
        return self.fields.get(name, default)


def written(path: str | os.PathLike[str]) -> str:
    """The file's whole lines as they stand, while processes may still append (a read
    racing an append can see part of its line: that line is left for the next read)."""
    text = Path(path).read_text() if Path(path).exists() else ""
    return text[: text.rfind("\n") + 1]


def read_history(path: str | os.PathLike[str], *, live: bool = False) -> list[Event]:
    """Every event of the file, in the order they were appended.

    A torn last line (a writer killed inside ``write(2)`` cannot leave one, but a full disk
    could) is an error, not something to skip, except with ``live=True``: read while
    processes still write, only its whole lines are read (``written``).
    """
    events: list[Event] = []
    text = written(path) if live else Path(path).read_text() if Path(path).exists() else ""
    for seq, line in enumerate(text.splitlines()):
        body = json.loads(line)
        events.append(
            Event(
                seq=seq,
                ev=body.pop("ev"),
                run=body.pop("run"),
                proc=body.pop("proc"),
                t=body.pop("t"),
                fields=body,
            )
        )
    return events
