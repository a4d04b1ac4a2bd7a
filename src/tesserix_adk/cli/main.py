"""The ``tesserix`` console script (and ``python -m tesserix_adk``).

Not ``adk``: that is the command of Google's Agent Development Kit, with its own
``adk run --resume``, and users may have both installed. An embedding product wires
``frontier_main``/``resume_main`` under whatever name it likes.

One parser reads the whole command line (argparse subcommands), so a value is only ever
taken as the option it follows: ``tesserix --tenant demo inspect r`` is a usage error, never
the demo. ``--store URL`` goes before or after the command.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version
from urllib.parse import urlsplit

from tesserix_adk.checkpoint.redaction import default_redactor
from tesserix_adk.cli.commands import (
    HelpShown,
    add_frontier_commands,
    add_resume_commands,
    add_worker_commands,
    new_parser,
    run_command,
)
from tesserix_adk.cli.failures import ExitCode, UsageError, explain, output_closed, say, told_by
from tesserix_adk.cli.jsonout import emit, error_json
from tesserix_adk.cli.text import sentence
from tesserix_adk.cli.ui import add_ui_command
from tesserix_adk.stores.urls import checked_server_url

__all__ = ["DEFAULT_STORE", "main"]

DEFAULT_STORE = "sqlite:///.adk/adk.sqlite3"

_EPILOG = """\
--store defaults to $ADK_STORE, else sqlite:///.adk/adk.sqlite3; it goes before or after
the command. `tesserix COMMAND --help` describes a command.

exit codes: 0 carried on, 1 nothing checkpointed, 2 bad command line,
            3 held elsewhere or store down (retry later), 4 must not be carried on
"""


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; returns its exit code."""
    _standard_streams()
    _quiet_logging()
    args_list = list(sys.argv[1:] if argv is None else argv)
    try:
        _refuse_options_before_the_command(args_list)
        args = _parser().parse_args(args_list)
    except HelpShown:
        return int(ExitCode.CARRIED_ON)
    except UsageError as exc:
        # argparse quotes the words it refused, which may hold a secret (an unquoted note).
        said = default_redactor().text(str(exc))
        return _failed(ExitCode.USAGE, f"tesserix: {sentence(said)}", args_list)
    if args.command == "demo":
        from tesserix_adk.cli.demo import run_demo

        return run_demo(keep=args.keep)
    from tesserix_adk.stores.urls import open_stores

    url = args.store = args.store or os.environ.get("ADK_STORE") or DEFAULT_STORE
    if args.command == "ui":
        from tesserix_adk.cli.ui import run_ui

        try:
            _check_store_url(url)
        except UsageError as exc:
            say(sys.stderr, f"tesserix: {sentence(str(exc))}")
            return int(ExitCode.USAGE)
        return run_ui(args, url)
    try:
        _check_store_url(url)
        stores = open_stores(url)
    except Exception as exc:
        code, text = explain(exc, told=told_by(args))
        return _failed(code, text, args_list)
    return run_command(args, stores=stores, agents={})


def _standard_streams() -> None:
    """A standard stream the shell closed (``>&-``, ``2>&-``) becomes one that discards
    what is written: the command still runs and exits with its own code."""
    for name in ("stdout", "stderr"):
        if getattr(sys, name) is None:
            setattr(sys, name, open(os.devnull, "w"))  # noqa: SIM115 - for the process


def _failed(code: ExitCode, text: str, args_list: Sequence[str]) -> int:
    """One sentence on stderr; under ``--json`` the error object on stdout too, as every
    command prints its own failures (here the command never got to run)."""
    say(sys.stderr, text)
    if "--json" in args_list:
        try:
            emit(sys.stdout, error_json(int(code), text.removeprefix("tesserix: ")))
        except (OSError, ValueError):  # its reader went away: the exit code still says it
            output_closed(sys.stdout)
    return int(code)


def _parser() -> argparse.ArgumentParser:
    parser = new_parser(
        usage="tesserix [--store URL] [--version] COMMAND ...",
        description="Inspect, decide on and carry on checkpointed agent runs.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--store", metavar="URL", help="the store (see below)")
    parser.add_argument("--version", action="version", version=f"tesserix {_version()}")
    # The same option after the command; SUPPRESS keeps a value given before it.
    store_after = new_parser(add_help=False)
    store_after.add_argument("--store", metavar="URL", default=argparse.SUPPRESS)
    sub = parser.add_subparsers(
        dest="command", required=True, metavar="COMMAND", title="commands", prog="tesserix"
    )
    add_frontier_commands(sub, parents=[store_after])
    add_resume_commands(sub, parents=[store_after])
    add_worker_commands(sub, parents=[store_after])
    demo = sub.add_parser(
        "demo",
        help="a run dies with SIGKILL and carries on with one booking (offline, temporary files)",
        description="Two acts with real OS processes against a temporary SQLite store.",
    )
    demo.add_argument(
        "--keep",
        nargs="?",
        const="",
        metavar="DIR",
        help="leave the store and the airline in DIR (a new or empty directory; without DIR, "
        "in the temporary one) and print the commands to explore them",
    )
    add_ui_command(sub, parents=[store_after])
    return parser


_TOP_LEVEL = ("--store", "--version", "-h", "--help")


def _refuse_options_before_the_command(argv: Sequence[str]) -> None:
    """An option of a command written before it: say where it goes, rather than let its
    value stand for the command (``--tenant demo inspect r``)."""
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--store":
            i += 2
        elif arg.startswith("--store=") or arg in _TOP_LEVEL:
            i += 1
        elif arg.startswith("-") and arg != "-" and arg != "--":
            name = arg.split("=", 1)[0]
            raise UsageError(
                f"{name} is not an option of tesserix itself; options of a command go after "
                f"it, as in `tesserix inspect RUN --tenant T`"
            )
        else:
            return


_REDIS_DB = re.compile(r"/?[0-9]*")


def _check_store_url(url: str) -> None:
    """What the drivers would let through quietly: a Redis database that is not a number
    (redis-py falls back to database 0, another run's data)."""
    try:
        parts = urlsplit(url.strip())
    except ValueError:
        return  # open_stores says why
    scheme = parts.scheme.lower()
    if scheme in ("redis", "rediss", "redis+cluster", "rediss+cluster", "postgresql", "postgres"):
        checked_server_url(url.strip(), scheme)  # its password's tail is no path to quote
    if scheme in ("redis", "rediss") and not _REDIS_DB.fullmatch(parts.path):
        raise UsageError(
            f"the Redis store URL's path must be a database number, as in "
            f"redis://host:6379/0, not {parts.path!r}"
        )


def _version() -> str:
    try:
        return version("tesserix-adk")
    except PackageNotFoundError:  # running from a source tree that was never installed
        return "unknown"


def _quiet_logging() -> None:
    """Errors reach the operator as one sentence; driver log records (a pool retrying a
    connection, say) would otherwise land on stderr too. ``ADK_DEBUG=1`` shows them."""
    root = logging.getLogger()
    if os.environ.get("ADK_DEBUG"):
        logging.basicConfig(level=logging.DEBUG)
    elif not root.handlers:
        root.addHandler(logging.NullHandler())
