"""The ``tesserix`` console script (and ``python -m tesserix_adk``).

Not ``adk``: that is the command of Google's Agent Development Kit, with its own
``adk run --resume``, and users may have both installed. An embedding product wires
``frontier_main``/``resume_main`` under whatever name it likes.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence

from tesserix_adk.cli.commands import ExitCode, frontier_main, resume_main

__all__ = ["DEFAULT_STORE", "main"]

DEFAULT_STORE = "sqlite:///.adk/adk.sqlite3"

_USAGE = """\
usage: tesserix [--store URL] COMMAND ...

commands:
  inspect RUN --tenant T [--json]        show a run's frontier and plan (takes no lease)
  run --resume RUN --tenant T --agent module:attr [--provider module:attr] [--worker W]
  approve REQ --tenant T --by NAME [--deny] [--note TEXT]
  resolve RUN --tenant T --call ID (--outcome JSON | --never-ran) --by NAME
  runs --tenant T [--stuck]              list runs (stuck: in flight, lease lapsed)
  steps RUN --tenant T                   a run's step snapshots
  replay RUN --tenant T --from-step N --stub TOOL=module:attr [--live TOOL] --agent module:attr
  schema show|apply                      the store's schema
  demo                                   a run dies and carries on with one booking

--store defaults to $ADK_STORE, else sqlite:///.adk/adk.sqlite3
exit codes: 0 carried on, 1 nothing checkpointed, 2 bad command line,
            3 held elsewhere or store down (retry later), 4 must not be carried on
"""

_FRONTIER = {"inspect", "runs", "steps", "approve", "resolve", "schema"}
_RESUME = {"run", "replay"}


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; returns its exit code."""
    _quiet_logging()
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        store, args = _take_store(args)
    except ValueError as exc:
        sys.stderr.write(f"tesserix: {exc}\n")
        return int(ExitCode.USAGE)
    command = next((a for a in args if not a.startswith("-")), None)
    if command is None:
        if "-h" in args or "--help" in args:
            sys.stdout.write(_USAGE)
            return int(ExitCode.CARRIED_ON)
        sys.stderr.write("tesserix: no command given; try `tesserix --help`\n")
        return int(ExitCode.USAGE)
    if command == "demo":
        from tesserix_adk.cli.demo import run_demo

        return run_demo(args[args.index("demo") + 1 :])
    if command not in _FRONTIER | _RESUME:
        sys.stderr.write(f"tesserix: unknown command {command!r}; try `tesserix --help`\n")
        return int(ExitCode.USAGE)
    from tesserix_adk.errors import ConfigurationError
    from tesserix_adk.stores.urls import open_stores

    url = store or os.environ.get("ADK_STORE") or DEFAULT_STORE
    try:
        stores = open_stores(url)
    except ConfigurationError as exc:
        sys.stderr.write(f"tesserix: {exc}\n")
        return int(ExitCode.USAGE)
    if command in _RESUME:
        return resume_main(args, stores=stores, agents={})
    return frontier_main(args, stores=stores)


def _quiet_logging() -> None:
    """Errors reach the operator as one sentence; driver log records (a pool retrying a
    connection, say) would otherwise land on stderr too. ``ADK_DEBUG=1`` shows them."""
    root = logging.getLogger()
    if os.environ.get("ADK_DEBUG"):
        logging.basicConfig(level=logging.DEBUG)
    elif not root.handlers:
        root.addHandler(logging.NullHandler())


def _take_store(args: list[str]) -> tuple[str | None, list[str]]:
    """Pull ``--store URL`` out of ``args`` wherever it stands."""
    store = None
    rest: list[str] = []
    it = iter(args)
    for arg in it:
        if arg == "--store":
            store = next(it, None)
            if store is None:
                raise ValueError("--store needs a URL")
        elif arg.startswith("--store="):
            store = arg.split("=", 1)[1]
        else:
            rest.append(arg)
    return store, rest
