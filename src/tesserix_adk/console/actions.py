"""The console's decisions, carried out by the CLI's own commands.

Approve, deny, resolve and cancel build the command line an operator would type and run it
through the CLI's parser and command functions (``run_frontier_command``,
``run_work_command``), so a decision in the page is checked, redacted, audited and wakes a
worker exactly as ``tesserix approve`` / ``resolve`` / ``cancel`` do. What the command
printed is what the page says.
"""

from __future__ import annotations

import argparse
import io
from dataclasses import dataclass
from enum import StrEnum

from tesserix_adk.cli.commands import (
    HelpShown,
    UsageError,
    add_frontier_commands,
    add_worker_commands,
    new_parser,
)
from tesserix_adk.cli.failures import ExitCode, explain, told_by
from tesserix_adk.cli.frontier import run_frontier_command
from tesserix_adk.cli.work import run_work_command
from tesserix_adk.stores.bundle import Stores

__all__ = ["Action", "Done", "approve_argv", "cancel_argv", "carry_out", "resolve_argv"]


class Action(StrEnum):
    """What a console form asks for."""

    approve = "approve"
    deny = "deny"
    resolve = "resolve"
    cancel = "cancel"


@dataclass(frozen=True, slots=True)
class Done:
    """What became of a decision: the CLI's exit code and the line it printed."""

    code: ExitCode
    text: str
    # What a cancel became (``tesserix cancel --json``'s ``state``), when it ran.
    cancel_state: str | None = None

    @property
    def ok(self) -> bool:
        """The command did what it was asked."""
        return self.code is ExitCode.CARRIED_ON


def approve_argv(
    tenant: str, request: str, *, by: str, note: str | None, deny: bool = False
) -> list[str]:
    """``tesserix approve REQUEST --tenant T --by NAME [--deny] [--note TEXT]``."""
    argv = ["approve", f"--tenant={tenant}", f"--by={by}"]
    if deny:
        argv.append("--deny")
    if note:
        argv.append(f"--note={note}")
    return [*argv, "--", request]


def resolve_argv(
    tenant: str, run_id: str, *, call: str, by: str, never_ran: bool, outcome: str | None
) -> list[str]:
    """``tesserix resolve RUN --tenant T --call C --by NAME (--never-ran | --outcome JSON)``."""
    argv = ["resolve", f"--tenant={tenant}", f"--call={call}", f"--by={by}"]
    argv.append("--never-ran" if never_ran else f"--outcome={outcome or ''}")
    return [*argv, "--", run_id]


def cancel_argv(tenant: str, run_id: str, *, by: str, reason: str | None) -> list[str]:
    """``tesserix cancel RUN --tenant T --by NAME [--reason TEXT]``."""
    argv = ["cancel", f"--tenant={tenant}", f"--by={by}"]
    if reason:
        argv.append(f"--reason={reason}")
    return [*argv, "--", run_id]


def _parser() -> argparse.ArgumentParser:
    parser = new_parser()
    sub = parser.add_subparsers(dest="command", required=True)
    add_frontier_commands(sub)
    add_worker_commands(sub)
    return parser


async def carry_out(argv: list[str], stores: Stores) -> Done:
    """Parse ``argv`` as the CLI does and run it on ``stores``; never raises for a refusal."""
    out = io.StringIO()
    args: argparse.Namespace | None = None
    try:
        args = _parser().parse_args(argv)
        if args.command == "cancel":
            code = await run_work_command(args, stores, {}, out)
        else:
            code = await run_frontier_command(args, stores, out)
    except (UsageError, HelpShown) as exc:
        return Done(ExitCode.USAGE, f"tesserix: {exc}")
    except Exception as exc:  # the CLI's one sentence for it, as on stderr
        code, text = explain(exc, told=told_by(args))
        return Done(code, text)
    return Done(code, out.getvalue().strip(), getattr(args, "cancel_state", None))
