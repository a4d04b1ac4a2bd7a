"""The operator commands: ``frontier_main`` (look, decide) and ``resume_main`` (carry on).

Both take ``argv`` and already-opened ``Stores``, return an ``ExitCode`` and never call
``sys.exit``, so an embedding product can wire them under its own command name. Every error
is one sentence on stderr; a script reads the exit code:

    0 carried on (or printed what was asked)      3 not now: held elsewhere / store down
    1 nothing checkpointed under that id          4 must not be carried on
    2 a command line it could not read

The parsers are built by ``add_frontier_commands``/``add_resume_commands``, which the
``tesserix`` console script mounts under one parser of its own (``tesserix_adk.cli.main``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, NoReturn, TextIO

from tesserix_adk.agent import Agent
from tesserix_adk.checkpoint.redaction import Redactor
from tesserix_adk.cli.failures import (
    ExitCode,
    UsageError,
    exit_code_for,
    explain,
    output_closed,
    say,
    told_by,
)
from tesserix_adk.cli.frontier import run_frontier_command
from tesserix_adk.cli.jsonout import emit, error_json
from tesserix_adk.cli.listing import add_runs_arguments
from tesserix_adk.cli.loading import ProviderSource, load_agent, load_provider
from tesserix_adk.cli.resuming import run_resume_command
from tesserix_adk.cli.work import WORK_COMMANDS, add_work_commands, run_work_command
from tesserix_adk.leases import NEVER_RAN_MARGIN
from tesserix_adk.run.runner import id_problem
from tesserix_adk.run.screening import id_as_kept
from tesserix_adk.stores.bundle import Stores

__all__ = [
    "FRONTIER_COMMANDS",
    "RESUME_COMMANDS",
    "add_worker_commands",
    "ExitCode",
    "HelpShown",
    "UsageError",
    "add_frontier_commands",
    "add_resume_commands",
    "exit_code_for",
    "frontier_main",
    "load_agent",
    "load_provider",
    "new_parser",
    "resume_main",
    "run_command",
]

FRONTIER_COMMANDS = frozenset({"inspect", "show", "runs", "steps", "approve", "resolve", "schema"})
RESUME_COMMANDS = frozenset({"run", "replay"})

Parents = Sequence[argparse.ArgumentParser]


class _Parser(argparse.ArgumentParser):
    """argparse that raises instead of exiting, so callers get an exit code back."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # No abbreviations: `--never` must not quietly stand for `--never-ran`.
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        # "tesserix: inspect: ..." rather than "tesserix: tesserix inspect: ...".
        where = self.prog.partition(" ")[2]
        raise UsageError(f"{where}: {message}" if where else message)

    def exit(self, status: int = 0, message: str | None = None) -> NoReturn:
        if message:
            raise UsageError(message.strip())
        raise HelpShown


class HelpShown(Exception):
    """``--help`` or ``--version`` printed what was asked; nothing more to do (exit 0)."""


def new_parser(prog: str = "tesserix", **kwargs: Any) -> argparse.ArgumentParser:
    """An argument parser that raises ``UsageError``/``HelpShown`` instead of exiting."""
    return _Parser(prog=prog, **kwargs)


def _named(value: str) -> str:
    """An id or a name on the command line: never empty, and one a store can keep (UTF-8,
    at most the runner's ``MAX_ID_BYTES``), as the runner demands of every id."""
    if not value.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    problem = id_problem(value)
    if problem is not None:
        raise argparse.ArgumentTypeError(problem)
    return value


def _operator(value: str) -> str:
    """Who acts (``--by``): a name as ``_named`` reads it, with any secret in it masked, as
    in every text bound for a store (a token pasted into the wrong flag)."""
    return _named(Redactor().text(_named(value)))


def _resolver(value: str) -> str:
    """Who resolved a call (``--by``): an operator, as ``_operator`` reads one. A name
    starting ``reconciler:`` is the kit's reconcilers' own, which ``show`` and spans tell
    apart from a person's answer: an operator taking it would be recorded as one."""
    named = _operator(value)
    if named.startswith("reconciler:"):
        raise argparse.ArgumentTypeError(
            "names starting 'reconciler:' are the kit's reconcilers'; give who checked"
        )
    return named


def _call(value: str) -> str:
    """A call named on the command line: a provider's id that holds a secret is found by
    the id the kit keeps in its place (never echoed as given)."""
    return id_as_kept(_named(value), Redactor())


# A decision's note is read by people, and carried into the run (``GRANT_NOTE_CHARS``).
NOTE_CHARS = 4000


def _text(value: str) -> str:
    """Free text on the command line (a note, an input, an outcome): text a store can keep.
    A byte the terminal sent that is not UTF-8 reaches Python as a lone surrogate, which
    nothing can encode: refused here, before anything is written."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise argparse.ArgumentTypeError(
            "is not UTF-8 text (a byte in it could not be read as UTF-8)"
        ) from None
    return value


def _note(value: str) -> str:
    """A note on a decision: UTF-8 text of at most ``NOTE_CHARS`` characters."""
    value = _text(value)
    if len(value) > NOTE_CHARS:
        raise argparse.ArgumentTypeError(
            f"is {len(value)} characters long; a note is at most {NOTE_CHARS}"
        )
    return value


def _seconds(value: str) -> float:
    """A duration on the command line: a finite number of seconds, zero or more."""
    try:
        seconds = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number of seconds") from None
    if not 0 <= seconds < float("inf"):
        raise argparse.ArgumentTypeError(f"{value!r} is not a finite number of seconds >= 0")
    return seconds


def _subcommands(parser: argparse.ArgumentParser) -> Any:
    return parser.add_subparsers(
        dest="command", required=True, metavar="COMMAND", parser_class=_Parser
    )


# --- frontier_main: look and decide, never carry on ---------------------------------------


def frontier_main(
    argv: Sequence[str], *, stores: Stores, out: TextIO | None = None, err: TextIO | None = None
) -> int:
    """``inspect``, ``show``, ``runs``, ``steps``, ``approve``, ``resolve``, ``schema``."""
    parser = new_parser(description="Inspect and decide on checkpointed runs.")
    add_frontier_commands(_subcommands(parser))
    return _main(parser, argv, stores=stores, agents={}, out=out, err=err)


def add_frontier_commands(sub: Any, parents: Parents = ()) -> None:
    """Add the frontier commands to ``sub`` (an ``add_subparsers()`` result)."""
    p = sub.add_parser(
        "inspect", help="show a run's frontier and plan (takes no lease)", parents=parents
    )
    p.add_argument("run", metavar="RUN", type=_named)
    p.add_argument("--tenant", required=True, type=_named)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p = sub.add_parser(
        "show",
        help="tell a run's story: steps, turns, calls, approvals, fences, spend",
        parents=parents,
    )
    p.add_argument("run", metavar="RUN", type=_named)
    p.add_argument("--tenant", required=True, type=_named)
    p.add_argument("--step", type=int, metavar="N", help="only what step N holds")
    _json(p)
    p = sub.add_parser("runs", help="list a tenant's runs, newest first", parents=parents)
    add_runs_arguments(p, _named)
    p = sub.add_parser("steps", help="list a run's step snapshots", parents=parents)
    p.add_argument("run", metavar="RUN", type=_named)
    p.add_argument("--tenant", required=True, type=_named)
    _json(p)
    p = sub.add_parser("approve", help="decide an approval request", parents=parents)
    p.add_argument("request", metavar="REQUEST", type=_named)
    p.add_argument("--tenant", required=True, type=_named)
    p.add_argument("--by", required=True, type=_operator, help="who decides")
    p.add_argument("--deny", action="store_true")
    p.add_argument("--note", type=_note, help="why (secrets in it are masked before it is stored)")
    p.add_argument(
        "--agent",
        type=_named,
        metavar="module:attr",
        help="the run's agent, to print the exact `tesserix run --resume` that carries it on",
    )
    _json(p)
    p = sub.add_parser(
        "resolve",
        help="record what an indeterminate call did (holds the run's lease meanwhile)",
        parents=parents,
    )
    p.add_argument("run", metavar="RUN", type=_named)
    p.add_argument("--tenant", required=True, type=_named)
    p.add_argument("--call", required=True, type=_call, help="provider call id or idempotency key")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument(
        "--outcome", type=_text, help="the call's outcome as JSON (secrets are masked)"
    )
    what.add_argument("--never-ran", action="store_true")
    p.add_argument("--by", required=True, type=_resolver, help="who checked")
    p.add_argument(
        "--margin",
        type=_seconds,
        default=NEVER_RAN_MARGIN,
        metavar="SECONDS",
        help=(
            "--never-ran only once the run's last lease ended this long ago by the store's "
            f"clock (default {NEVER_RAN_MARGIN:g}); lower it only for tools that cannot "
            "deliver a call later than that after their lease ended"
        ),
    )
    _json(p)
    p = sub.add_parser("schema", help="show or apply the store's schema", parents=parents)
    p.add_argument("action", choices=["show", "apply"])
    _json(p)


def _json(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--json",
        action="store_true",
        help="one JSON object on stdout (an error too: {error: {exit_code, message}})",
    )


# --- resume_main: carry a run on ----------------------------------------------------------


def resume_main(
    argv: Sequence[str],
    *,
    stores: Stores,
    agents: Mapping[str, Agent],
    provider: ProviderSource = None,
    out: TextIO | None = None,
    err: TextIO | None = None,
) -> int:
    """``run --resume RUN`` (and ``replay``): take the lease and carry the run on.

    ``provider`` is the model for agents the product names (``--agent NAME``): a provider,
    or a class or factory called with no arguments (then closed when the command ends).
    ``--provider module:attr`` overrides it; without either, an agent given as
    ``module:attr`` takes its module's ``PROVIDER``, else its ``model``."""
    parser = new_parser(description="Carry checkpointed runs on.")
    add_resume_commands(_subcommands(parser))
    return _main(parser, argv, stores=stores, agents=agents, out=out, err=err, provider=provider)


def add_worker_commands(sub: Any, parents: Parents = ()) -> None:
    """Add ``submit`` and ``worker`` to ``sub`` (an ``add_subparsers()`` result)."""
    add_work_commands(
        sub, parents, named=_named, seconds=_seconds, note=_note, text=_text, operator=_operator
    )


def add_resume_commands(sub: Any, parents: Parents = ()) -> None:
    """Add ``run`` and ``replay`` to ``sub`` (an ``add_subparsers()`` result)."""
    p = sub.add_parser("run", help="carry a run on from its frontier", parents=parents)
    p.add_argument("--resume", metavar="RUN", type=_named, help="the run to carry on")
    p.add_argument("--tenant", required=True, type=_named)
    p.add_argument(
        "--agent", required=True, type=_named, help="a name known to the product, or module:attr"
    )
    p.add_argument("--provider", type=_named, help="module:attr of the model provider")
    p.add_argument(
        "--worker", type=_named, help="a name for this worker (a random suffix is added)"
    )
    p.add_argument(
        "--accept-revision",
        action="store_true",
        help="carry on a run pinned to another agent revision under this one, when every "
        "outstanding call's tool is unchanged (audited; needs --by)",
    )
    p.add_argument("--by", type=_operator, help="who accepts the revision change")
    p.add_argument("--note", type=_note, help="why (secrets in it are masked before it is stored)")
    _json(p)
    p = sub.add_parser(
        "replay", help="run forward from a past step as a new run (debugging)", parents=parents
    )
    p.add_argument("run", metavar="RUN", type=_named)
    p.add_argument("--tenant", required=True, type=_named)
    p.add_argument("--from-step", type=int, required=True)
    p.add_argument(
        "--agent", required=True, type=_named, help="a name known to the product, or module:attr"
    )
    p.add_argument("--provider", type=_named, help="module:attr of the model provider")
    p.add_argument(
        "--stub",
        action="append",
        default=[],
        metavar="TOOL=module:attr",
        help="replace a tool with a stub (repeatable)",
    )
    p.add_argument(
        "--live",
        action="append",
        default=[],
        metavar="TOOL",
        help="let a side-effecting tool run for real (repeatable; never in production)",
    )
    p.add_argument("--new-run-id", type=_named)
    _json(p)


# --- running a parsed command -------------------------------------------------------------


def run_command(
    args: argparse.Namespace,
    *,
    stores: Stores,
    agents: Mapping[str, Agent],
    out: TextIO | None = None,
    err: TextIO | None = None,
) -> int:
    """Run a command ``add_frontier_commands``/``add_resume_commands`` parsed; closes
    ``stores``; returns the exit code, never raises for an error of the command."""
    return _main(None, args, stores=stores, agents=agents, out=out, err=err)


def _main(
    parser: argparse.ArgumentParser | None,
    argv: Sequence[str] | argparse.Namespace,
    *,
    stores: Stores,
    agents: Mapping[str, Agent],
    out: TextIO | None,
    err: TextIO | None,
    provider: ProviderSource = None,
) -> int:
    out = out or sys.stdout
    err = err or sys.stderr
    # Set once the command line is read: whether an error is also a JSON object on stdout.
    wants_json = [
        bool(getattr(argv, "json", False))
        if isinstance(argv, argparse.Namespace)
        else "--json" in argv  # a command line that cannot be read still answers in JSON
    ]
    # And what it names, which an error's sentence shows as given (``explain``'s ``told``).
    told = list(told_by(argv)) if isinstance(argv, argparse.Namespace) else []

    def body() -> Awaitable[ExitCode]:
        if isinstance(argv, argparse.Namespace):
            args = argv
        else:
            assert parser is not None
            args = parser.parse_args(list(argv))
        wants_json[0] = bool(getattr(args, "json", False))
        told[:] = told_by(args)
        if args.command in RESUME_COMMANDS:
            return run_resume_command(args, stores, agents, out, provider=provider)
        if args.command in WORK_COMMANDS:
            return run_work_command(args, stores, agents, out)
        return run_frontier_command(args, stores, out)

    return _run(body, stores, err, out, wants_json, told)


def _run(
    body: Callable[[], Awaitable[ExitCode]],
    stores: Stores,
    err: TextIO,
    out: TextIO,
    wants_json: list[bool],
    told: list[str],
) -> int:
    async def main() -> ExitCode:
        # Connections belong to this event loop: close them before it ends.
        try:
            return await body()
        finally:
            await stores.aclose()

    try:
        return int(asyncio.run(main()))
    except HelpShown:
        return int(ExitCode.CARRIED_ON)
    except KeyboardInterrupt:
        say(err, "tesserix: interrupted")
        return 130
    except BrokenPipeError:
        return output_closed(out)
    except Exception as exc:
        code, text = explain(exc, told=told)
        say(err, text)
        if wants_json[0]:
            with contextlib.suppress(Exception):
                emit(out, error_json(int(code), text.removeprefix("tesserix: ")))
        if os.environ.get("ADK_DEBUG"):
            import traceback

            traceback.print_exception(exc, file=err)
        return int(code)
    finally:
        with contextlib.suppress(Exception):
            out.flush()
